//! [`NcclFactory`]: creates the world communicator over a bootstrap communicator, and every
//! sub-group with `ncclCommSplit` of a parent (no new unique-id exchange per group).

use crate::bootstrap::{
    choose_device, claim_device, exchange_unique_ids, local_rank_from, root_count, root_ranks,
    DeviceClaim,
};
use crate::comm::{Capabilities, NcclBackend, NcclCommunicator};
use crate::engine::{Job, Progress, Watchdog};
use crate::error::{annotate, cuda, lib, BACKEND};
use crate::ffi::{self, CommConfig, RawComm};
use crate::p2p::{resolve_posting, Lane, P2pPosting};
use crate::probe;
use crate::split::{nccl_color, nccl_key};
use cudarc::driver::CudaContext;
use grid_core::{
    split_members, BufMut, BufRef, Communicator, Error, GroupFactory, Result, SplitEntry, TimeLimit,
};
use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Per-communicator NCCL settings (`ncclConfig_t`), applied to the world communicator and to
/// every split. Every communicator is created **nonblocking** (`blocking = 0`) whatever these
/// say: that is what lets a time limit or `abort()` end a creation or an operation whose peer
/// never arrives. `None` leaves NCCL's default (`NCCL_CONFIG_UNDEF_INT`).
///
/// ```
/// let c = backend_nccl::NcclConfig { split_share: true, max_ctas: Some(16), ..Default::default() };
/// assert_eq!(c.min_ctas, None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NcclConfig {
    /// `splitShare`: splits share their parent's buffers and proxy thread (less memory; the
    /// parent and its splits must then not run operations concurrently). Default false.
    pub split_share: bool,
    /// `cgaClusterSize` (0 to 8 on Hopper and newer).
    pub cga_cluster_size: Option<u32>,
    /// `minCTAs`: the fewest thread blocks NCCL uses.
    pub min_ctas: Option<u32>,
    /// `maxCTAs`: the most thread blocks NCCL uses.
    pub max_ctas: Option<u32>,
    /// `netName`: the network plugin or transport to use (for example `"IB"` or `"Socket"`).
    pub net_name: Option<String>,
}

impl NcclConfig {
    /// The raw form; errors name the field, the value and the valid range.
    pub(crate) fn to_raw(&self) -> Result<CommConfig> {
        let int = |what: &str, v: Option<u32>| -> Result<Option<c_int>> {
            v.map(|x| {
                c_int::try_from(x).map_err(|_| {
                    Error::Invalid(format!(
                        "NcclConfig: {what} {x} does not fit NCCL's int (valid: 0..={})",
                        c_int::MAX
                    ))
                })
            })
            .transpose()
        };
        if let (Some(lo), Some(hi)) = (self.min_ctas, self.max_ctas) {
            if lo > hi {
                return Err(Error::Invalid(format!(
                    "NcclConfig: min_ctas {lo} is larger than max_ctas {hi} (min_ctas must be <= max_ctas)"
                )));
            }
        }
        let net_name = match &self.net_name {
            None => None,
            Some(n) => Some(CString::new(n.as_str()).map_err(|_| {
                Error::Invalid(format!(
                    "NcclConfig: net_name {n:?} contains a NUL byte (give a plain name such as \"IB\" or \"Socket\")"
                ))
            })?),
        };
        Ok(CommConfig {
            split_share: self.split_share,
            cga_cluster_size: int("cga_cluster_size", self.cga_cluster_size)?,
            min_ctas: int("min_ctas", self.min_ctas)?,
            max_ctas: int("max_ctas", self.max_ctas)?,
            net_name,
        })
    }
}

/// Options of an NCCL job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// GPU ordinal; `None` picks the node-local rank (from `LOCAL_RANK`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`, ...) modulo the number of visible GPUs.
    pub device: Option<usize>,
    /// Longest wait for an operation (a stream-ordered wait, `synchronize`, a host-staged
    /// call, `Work::wait`) before it fails with [`Error::Timeout`]. Default 10 minutes (PyTorch's
    /// default for NCCL).
    pub timeout: Duration,
    /// Abort every communicator of the job when one reports an error or times out (default
    /// true), so that no rank stays blocked in another group waiting for a failed peer.
    pub abort_on_failure: bool,
    /// NCCL's per-communicator settings ([`NcclConfig`]).
    pub config: NcclConfig,
    /// At most this many ranks per NCCL unique id when the world communicator is created: a
    /// world of `n` ranks is initialised from `ceil(n / ranks_per_root)` ids with
    /// `ncclCommInitRankScalable` (NCCL >= 2.23; the ids are created on evenly spaced ranks,
    /// [`crate::bootstrap::root_ranks`], and broadcast over the bootstrap communicator), which
    /// spreads NCCL's bootstrap over several roots in large worlds. With one id, or an older
    /// NCCL, `ncclCommInitRankConfig`. Default 128 (PyTorch's `TORCH_NCCL_RANKS_PER_ROOT`
    /// default); must be the same on every rank, as must the NCCL version.
    pub ranks_per_root: usize,
    /// How single sends and receives are posted ([`crate::p2p`]): at once on two
    /// point-to-point communicators split from each communicator when it is created (the
    /// default, [`P2pPosting::Lanes`]), or held back and grouped ([`P2pPosting::HoldBack`]; no
    /// extra communicators). Must be the same on every rank. [`NcclFactory::set_p2p_posting`]
    /// changes it for communicators split later.
    pub p2p: P2pPosting,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: None,
            timeout: Duration::from_secs(600),
            abort_on_failure: true,
            config: NcclConfig::default(),
            p2p: P2pPosting::Lanes,
            ranks_per_root: 128,
        }
    }
}

/// The first NCCL with `ncclCommInitRankScalable` (several unique ids per communicator).
pub const SCALABLE_INIT_VERSION: (u32, u32, u32) = (2, 23, 0);

/// The oldest NCCL this backend runs on: `ncclCommSplit`, and nonblocking communicators with
/// the `ncclConfig_t` fields it sets (`splitShare` came in 2.18).
pub const MIN_SPLIT_VERSION: (u32, u32, u32) = (2, 18, 0);

/// Creates NCCL communicators: [`NcclFactory::init`] for the world, then
/// [`GroupFactory::split`] / [`GroupFactory::create_group`] for sub-groups, so that
/// `grid_core::build_collection` builds a whole process-group collection with one split per
/// family.
///
/// ```no_run
/// use backend_local::{run, LocalConfig};
/// use backend_nccl::{NcclFactory, NcclOptions};
/// use grid_core::{Communicator, GroupFactory};
/// // One process, one thread per GPU, bootstrapped over backend-local (an MPI or Gloo
/// // communicator works the same way).
/// run(2, &LocalConfig::default(), |_, boot| {
///     let opts = NcclOptions { device: Some(boot.rank()), ..NcclOptions::default() };
///     let (factory, world) = NcclFactory::init(&boot, opts)?;
///     let me = world.rank();
///     let _pair = factory.split(&world, Some((me / 2) as u32), me)?;
///     Ok(())
/// })?;
/// # Ok::<(), grid_core::Error>(())
/// ```
pub struct NcclFactory {
    job: Arc<Job>,
    opts: NcclOptions,
    ctx: Arc<CudaContext>,
    version: (u32, u32, u32),
    caps: Capabilities,
    splits: AtomicUsize,
    config: CommConfig,
    /// Communicators created from now on get point-to-point lanes ([`P2pPosting::Lanes`]).
    lanes: AtomicBool,
    /// Why lanes are not possible with the loaded NCCL and CUDA, if so.
    no_lanes: Option<String>,
    /// This process's claim on the GPU, for as long as the factory lives.
    _claim: DeviceClaim,
}

impl std::fmt::Debug for NcclFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclFactory")
            .field("device", &self.ctx.ordinal())
            .field("nccl", &self.version)
            .field("opts", &self.opts)
            .finish()
    }
}

/// What one rank sets up before the id exchange: its device's context, the NCCL version and
/// what it and the GPU can do, and its claim on the GPU.
type LocalSetup = (Arc<CudaContext>, (u32, u32, u32), Capabilities, DeviceClaim);

fn local_setup(rank: usize, opts: &NcclOptions, bootstrap_backend: &str) -> Result<LocalSetup> {
    let count = probe::gpu_count()?;
    let env = |k: &str| std::env::var(k).ok();
    // Ranks that are threads of this process (a `backend-local` bootstrap) share one node-local
    // rank from the environment: each takes its own rank instead.
    let local_rank = if bootstrap_backend == "local" {
        None
    } else {
        local_rank_from(&env)
    };
    let device = choose_device(opts.device, local_rank, rank, count)?;
    let claim = claim_device(device)?;
    let ctx = cuda("cuDevicePrimaryCtxRetain", || CudaContext::new(device))?;
    let version = probe::nccl_version()?;
    if version < MIN_SPLIT_VERSION {
        let (a, b, p) = version;
        return Err(Error::Unsupported {
            op: "init",
            backend: BACKEND,
            what: format!(
                "NCCL {a}.{b}.{p}: this backend needs NCCL >= 2.18.0 (nonblocking communicators with ncclConfig_t, ncclCommSplit, ncclCommFinalize); install a newer libnccl"
            ),
        });
    }
    let (major, minor) = cuda("cuDeviceGetAttribute", || ctx.compute_capability())?;
    let caps = Capabilities::new(version, (major.max(0) as u32, minor.max(0) as u32));
    Ok((ctx, version, caps, claim))
}

impl NcclFactory {
    /// Creates the world communicator: every rank of `bootstrap` calls this (collective over
    /// `bootstrap`). Checks the CUDA driver, libnccl and the GPU first (a clear error, never a
    /// panic, when any is missing), exchanges the unique id over `bootstrap` (a broadcast of 128
    /// bytes from rank 0), then `ncclCommInitRankConfig` in nonblocking mode: the communicator
    /// is under the watchdog (and abortable) while it connects, and a rank that never arrives
    /// makes the others fail with [`Error::Timeout`] after [`NcclOptions::timeout`]. NCCL rank
    /// `i` is bootstrap rank `i`.
    ///
    /// When one rank cannot set up NCCL, every rank returns an error (that rank its reason, the
    /// others [`Error::PeerFailed`]) and no rank blocks.
    pub fn init(
        bootstrap: &dyn Communicator,
        opts: NcclOptions,
    ) -> Result<(NcclFactory, NcclCommunicator)> {
        let rank = bootstrap.rank();
        let size = bootstrap.size();
        let config = opts.config.to_raw();
        let local = config
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|_| local_setup(rank, &opts, bootstrap.backend()));
        let ready = local.as_ref().map(|_| ()).map_err(Clone::clone);
        let scalable = local
            .as_ref()
            .is_ok_and(|(_, v, _, _)| *v >= SCALABLE_INIT_VERSION);
        let roots = root_ranks(size, root_count(size, opts.ranks_per_root, scalable));
        let ids = exchange_unique_ids(bootstrap, ready, &roots, &mut ffi::unique_id)?;
        let (ctx, version, caps, claim) = local?;
        let config = config?;
        let dog = Watchdog::global()?;
        cuda("bind context", || ctx.bind_to_thread())?;
        let stream = cuda("cuStreamCreate", || ctx.new_stream())?;
        let raw = Arc::new(RawComm::init_rank(size, &ids, rank, &config)?);
        let job = Job::new(opts.abort_on_failure);
        let tracked = dog.track("world", raw.clone(), "init", Some(&job));
        crate::job::process().register(&tracked);
        if let Err(e) = tracked.settle("init", TimeLimit::After(opts.timeout)) {
            tracked.close();
            return Err(annotate(e, "init", "world"));
        }
        let world = NcclBackend::create(
            raw,
            tracked,
            (ctx.clone(), caps),
            stream,
            bootstrap.global_ranks().to_vec(),
            "world".to_string(),
            opts.timeout,
        );
        let driver = ffi::driver_version().ok();
        let launch_order = std::env::var("NCCL_LAUNCH_ORDER_IMPLICIT").ok();
        let (posting, no_lanes) = resolve_posting(opts.p2p, launch_order.as_deref(), driver);
        if let Some(why) = &no_lanes {
            tracing::warn!("nccl: {why}");
        }
        if posting == P2pPosting::Lanes {
            split_lanes(
                &world,
                &job,
                &config,
                TimeLimit::After(opts.timeout),
                opts.timeout,
            )?;
        }
        tracing::debug!(
            rank,
            size,
            device = ctx.ordinal(),
            "nccl: world communicator created"
        );
        Ok((
            NcclFactory {
                job,
                opts,
                ctx,
                version,
                caps,
                splits: AtomicUsize::new(0),
                config,
                lanes: AtomicBool::new(posting == P2pPosting::Lanes),
                no_lanes,
                _claim: claim,
            },
            world,
        ))
    }

    /// The registry of every communicator this factory created.
    pub fn job(&self) -> &Arc<Job> {
        &self.job
    }

    /// Aborts every live communicator this factory created (world and splits); returns how
    /// many. Use it when one operation failed and the others must not keep waiting.
    pub fn abort_all(&self) -> usize {
        self.job.abort_all()
    }

    /// The GPU of this rank.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The loaded NCCL version.
    pub fn nccl_version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// What the loaded NCCL and this rank's GPU can do (fp8 reductions).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// The options this factory was created with.
    pub fn options(&self) -> &NcclOptions {
        &self.opts
    }

    /// How communicators split from now on post single sends and receives ([`crate::p2p`]);
    /// every rank must make the same change before the same split. `Lanes` is refused (the
    /// error says why) where the loaded NCCL and CUDA would serialise the lanes.
    pub fn set_p2p_posting(&self, posting: P2pPosting) -> Result<()> {
        if let (P2pPosting::Lanes, Some(why)) = (posting, &self.no_lanes) {
            return Err(Error::Unsupported {
                op: "set_p2p_posting",
                backend: BACKEND,
                what: format!("point-to-point lanes: {why}"),
            });
        }
        self.lanes
            .store(posting == P2pPosting::Lanes, Ordering::Relaxed);
        Ok(())
    }

    /// How communicators split from now on post single sends and receives.
    pub fn p2p_posting(&self) -> P2pPosting {
        if self.lanes.load(Ordering::Relaxed) {
            P2pPosting::Lanes
        } else {
            P2pPosting::HoldBack
        }
    }
}

/// Splits the two point-to-point lanes of `comm` ([`crate::p2p`]), right after its creation
/// (collective over it: every member calls this in the same order). A communicator of one rank
/// gets none (it has no peer). The lanes are nonblocking NCCL communicators of the same ranks,
/// with `comm`'s NCCL options but never `splitShare` (a shared device stream would serialise
/// them with `comm`), each with its own stream, under the watchdog and in `job`.
fn split_lanes(
    comm: &NcclCommunicator,
    job: &Arc<Job>,
    config: &CommConfig,
    limit: TimeLimit,
    timeout: Duration,
) -> Result<()> {
    const OP: &str = "split";
    let shared = comm.inner().shared();
    if shared.raw.size() < 2 {
        return Ok(());
    }
    let config = CommConfig {
        split_share: false,
        ..config.clone()
    };
    let key = nccl_key(shared.raw.rank())?;
    let wrap = |e| annotate(e, OP, comm.comm_name());
    let mut made = Vec::with_capacity(2);
    for lane in [Lane::Up, Lane::Down] {
        let name = format!("{}/{}", comm.comm_name(), lane.suffix());
        cuda("bind context", || shared.ctx.bind_to_thread()).map_err(wrap)?;
        // One NCCL call at a time on this device, until the split settled.
        let calls = shared.device_guard();
        let raw = match shared.raw.split(Some(0), key, &config) {
            Ok((raw, _)) => raw,
            Err(e) => return Err(shared.failed_call(OP, e)),
        };
        let Some(raw) = raw else {
            return Err(wrap(lib(
                OP,
                "ncclCommSplit with colour 0 gave no communicator for a point-to-point lane",
            )));
        };
        let raw = Arc::new(raw);
        let tracked = Watchdog::global()?.track(name.clone(), raw.clone(), OP, Some(job));
        crate::job::process().register(&tracked);
        let ready = tracked
            .settle(OP, limit)
            .and_then(|()| raw.learn_identity())
            .and_then(|(rank, size)| {
                if (rank, size) == (shared.raw.rank(), shared.raw.size()) {
                    Ok(())
                } else {
                    Err(lib(
                        OP,
                        format!(
                            "point-to-point lane '{name}' has rank {rank} of {size}, its communicator rank {} of {}",
                            shared.raw.rank(),
                            shared.raw.size()
                        ),
                    ))
                }
            })
            .and_then(|()| cuda("cuStreamCreate", || shared.ctx.new_stream()));
        drop(calls);
        let stream = match ready {
            Ok(s) => s,
            Err(e) => {
                tracked.fail(e.clone());
                tracked.close();
                return Err(wrap(e));
            }
        };
        made.push(Arc::new(crate::comm::Shared::new(
            raw,
            tracked,
            shared.ctx.clone(),
            stream,
            name,
            timeout,
        )));
    }
    let (Some(down), Some(up)) = (made.pop(), made.pop()) else {
        return Err(crate::error::internal(OP, "two lanes"));
    };
    if shared.lanes.set([up, down]).is_err() {
        return Err(crate::error::internal(OP, "lanes set twice"));
    }
    Ok(())
}

impl GroupFactory for NcclFactory {
    type Comm = NcclCommunicator;

    /// `ncclCommSplit` of `parent` (collective over it; non-members pass
    /// `NCCL_SPLIT_NOCOLOR`). The member list is learnt first with one small all-gather of
    /// `(colour, key, world rank)` over the parent. Needs NCCL >= 2.18.
    fn split(
        &self,
        parent: &NcclCommunicator,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<NcclCommunicator>> {
        self.split_configured(parent, color, key, None, None)
    }

    /// `ncclCommSplit` with the group's options: the communicator is created under the
    /// options' name, with their time limit, and with their NCCL options
    /// ([`grid_core::NcclGroupOptions`]) over the factory's [`NcclConfig`] (`cga_cluster_size`,
    /// `min_ctas`, `max_ctas`, `net_name`, `split_share` in the split's `ncclConfig_t`).
    /// `is_high_priority_stream: true` is rejected ([`Error::Unsupported`]: this backend
    /// creates every stream with the default priority), and so are options for another
    /// backend, before any communication.
    fn split_with(
        &self,
        parent: &NcclCommunicator,
        color: Option<u32>,
        key: usize,
        options: &grid_core::GroupOptions,
    ) -> Result<Option<NcclCommunicator>> {
        options.check_backend(BACKEND)?;
        let config = group_config(&self.opts.config, options)?;
        let comm =
            self.split_configured(parent, color, key, options.name.as_deref(), config.as_ref())?;
        if let (Some(c), Some(t)) = (&comm, options.timeout) {
            c.set_time_limit(t);
        }
        Ok(comm)
    }
}

/// The `ncclConfig_t` of a group with `options`: its NCCL options over the factory's `base`
/// (`None`: no NCCL options, the factory's configuration). `is_high_priority_stream: true` is
/// [`Error::Unsupported`]: this backend creates every stream with the default priority.
fn group_config(
    base: &NcclConfig,
    options: &grid_core::GroupOptions,
) -> Result<Option<CommConfig>> {
    let grid_core::BackendOptions::Nccl(n) = &options.backend else {
        return Ok(None);
    };
    if n.is_high_priority_stream {
        return Err(Error::Unsupported {
            op: "split",
            backend: BACKEND,
            what: format!(
                "is_high_priority_stream for group '{}' (the NCCL backend creates its streams with the default priority; set it to false)",
                options.name.as_deref().unwrap_or("(unnamed)")
            ),
        });
    }
    Ok(Some(merged_config(base, n).to_raw()?))
}

/// A group's NCCL options over the factory's configuration: each field given wins.
fn merged_config(base: &NcclConfig, n: &grid_core::NcclGroupOptions) -> NcclConfig {
    NcclConfig {
        split_share: n.split_share.unwrap_or(base.split_share),
        cga_cluster_size: n.cga_cluster_size.or(base.cga_cluster_size),
        min_ctas: n.min_ctas.or(base.min_ctas),
        max_ctas: n.max_ctas.or(base.max_ctas),
        net_name: n.net_name.clone().or_else(|| base.net_name.clone()),
    }
}

impl NcclFactory {
    /// The split, under `name` (else an automatic one) with `config` (else the factory's).
    fn split_configured(
        &self,
        parent: &NcclCommunicator,
        color: Option<u32>,
        key: usize,
        name: Option<&str>,
        config: Option<&CommConfig>,
    ) -> Result<Option<NcclCommunicator>> {
        const OP: &str = "split";
        parent.ensure_usable(OP)?;
        let c = nccl_color(color)?;
        let k = nccl_key(key)?;
        if self.version < MIN_SPLIT_VERSION {
            let (a, b, p) = self.version;
            return Err(Error::Unsupported {
                op: OP,
                backend: BACKEND,
                what: format!("ncclCommSplit with NCCL {a}.{b}.{p} (it needs NCCL >= 2.18.0)"),
            });
        }
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let world_rank = parent
            .global_ranks()
            .get(parent.rank())
            .copied()
            .unwrap_or(parent.rank());
        let mine = SplitEntry {
            color,
            key,
            world_rank,
        }
        .encode();
        let mut all = vec![0i64; 3 * parent.size()];
        parent.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut all[..]))?;
        let plan = split_members(&SplitEntry::decode_all(&all)?, parent.rank());

        let shared = parent.inner().shared();
        let wrap = |e| annotate(e, OP, parent.comm_name());
        let limit = parent.time_limit();
        cuda("bind context", || shared.ctx.bind_to_thread()).map_err(wrap)?;
        let name = match name {
            Some(given) => given.to_string(),
            None => format!("{}/split{n}.{}", parent.comm_name(), color.unwrap_or(0)),
        };
        // Held-back sends and receives were started first: posted first. Then one NCCL call
        // at a time on this device, until the split settled.
        shared.outbox.post_all();
        let calls = shared.device_guard();
        let (raw, progress) = match shared.raw.split(c, k, config.unwrap_or(&self.config)) {
            Ok(v) => v,
            Err(e) => return Err(shared.failed_call(OP, e)),
        };
        // The new communicator is under the watchdog (and abortable) while it connects.
        let child = match raw {
            None => {
                if progress == Progress::InProgress {
                    shared.tracked.begin(OP);
                    shared.tracked.settle(OP, limit).map_err(wrap)?;
                }
                None
            }
            Some(raw) => {
                let raw = Arc::new(raw);
                let dog = Watchdog::global()?;
                let tracked = dog.track(name.clone(), raw.clone(), OP, Some(&self.job));
                crate::job::process().register(&tracked);
                if let Err(e) = tracked
                    .settle(OP, limit)
                    .and_then(|()| raw.learn_identity().map(|_| ()))
                {
                    tracked.fail(e.clone());
                    tracked.close();
                    return Err(wrap(e));
                }
                Some((raw, tracked))
            }
        };
        // The lanes' splits below take the device's call lock themselves.
        drop(calls);
        match (child, plan) {
            (None, None) => Ok(None),
            (Some((raw, tracked)), Some(p))
                if raw.rank() == p.rank && raw.size() == p.members.len() =>
            {
                let stream = match cuda("cuStreamCreate", || shared.ctx.new_stream()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracked.abort("its stream could not be created");
                        tracked.close();
                        return Err(wrap(e));
                    }
                };
                let child = NcclBackend::create(
                    raw,
                    tracked,
                    (shared.ctx.clone(), self.caps),
                    stream,
                    p.members,
                    name,
                    self.opts.timeout,
                );
                if self.lanes.load(Ordering::Relaxed) {
                    split_lanes(
                        &child,
                        &self.job,
                        config.unwrap_or(&self.config),
                        limit,
                        self.opts.timeout,
                    )?;
                }
                Ok(Some(child))
            }
            (child, plan) => {
                let got = child.as_ref().map(|(r, _)| (r.rank(), r.size()));
                if let Some((_, t)) = child {
                    t.abort("split with inconsistent arguments");
                    t.close();
                }
                Err(wrap(lib(
                    OP,
                    format!(
                        "ncclCommSplit gave (rank, size) {got:?} but the all-gathered colours and keys predict {:?}: the ranks called split with inconsistent arguments",
                        plan.map(|p| (p.rank, p.members.len()))
                    ),
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_options_merge_over_the_factory_config() {
        let base = NcclConfig {
            split_share: true,
            max_ctas: Some(16),
            net_name: Some("IB".into()),
            ..Default::default()
        };
        let n = grid_core::NcclGroupOptions {
            cga_cluster_size: Some(2),
            max_ctas: Some(32),
            split_share: Some(false),
            ..Default::default()
        };
        assert_eq!(
            merged_config(&base, &n),
            NcclConfig {
                split_share: false,
                cga_cluster_size: Some(2),
                min_ctas: None,
                max_ctas: Some(32),
                net_name: Some("IB".into()),
            }
        );
        let o = |n: grid_core::NcclGroupOptions| {
            grid_core::GroupOptions::new()
                .named("tp")
                .with_backend(grid_core::BackendOptions::Nccl(n))
        };
        assert!(group_config(&base, &o(n.clone())).unwrap().is_some());
        assert!(group_config(&base, &grid_core::GroupOptions::new())
            .unwrap()
            .is_none());
        let e = group_config(
            &base,
            &o(grid_core::NcclGroupOptions {
                is_high_priority_stream: true,
                ..Default::default()
            }),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("is_high_priority_stream for group 'tp'"),
            "{e}"
        );
        // The factory's own checks apply to the merged configuration.
        let e = group_config(
            &base,
            &o(grid_core::NcclGroupOptions {
                min_ctas: Some(64),
                ..Default::default()
            }),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("min_ctas 64 is larger than max_ctas 16"),
            "{e}"
        );
    }

    #[test]
    fn config_values_are_checked() {
        assert!(NcclConfig::default().to_raw().is_ok());
        let e = NcclConfig {
            min_ctas: Some(8),
            max_ctas: Some(4),
            ..Default::default()
        }
        .to_raw()
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "NcclConfig: min_ctas 8 is larger than max_ctas 4 (min_ctas must be <= max_ctas)"
        );
        let e = NcclConfig {
            max_ctas: Some(u32::MAX),
            ..Default::default()
        }
        .to_raw()
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("max_ctas 4294967295 does not fit NCCL's int (valid: 0..=2147483647)"),
            "{e}"
        );
        let e = NcclConfig {
            net_name: Some("I\0B".into()),
            ..Default::default()
        }
        .to_raw()
        .unwrap_err();
        assert!(e.to_string().contains("contains a NUL byte"), "{e}");
    }
}
