//! Rendezvous stores, configuration, [`GlooFactory`] (world and sub-group creation) and
//! launchers (ranks as threads of this process, or one rank per process from the environment).

use crate::blame::{Blame, SharedStore, GRACE};
use crate::comm::{GlooBackend, GlooCommunicator};
use crate::exec::panic_message;
use crate::ffi::{
    AllreduceAlgorithm, RawContext, RawDevice, RawStore, ReduceScatterAlgorithm, ShimCode,
    ShimError,
};
use grid_core::{
    split_members, Comm, Communicator, CommunicatorExt, Error, GroupFactory, LibraryError, Result,
    SplitEntry,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BACKEND: &str = "gloo";

/// Where the ranks of a job meet to exchange their addresses.
///
/// * [`Rendezvous::in_process`]: an in-memory store shared by ranks that are threads of one
///   process (the embedded default: no launcher, no server, no files).
/// * [`Rendezvous::File`]: a directory on a file system every rank sees (a local temporary
///   directory, or a shared file system across hosts); created if missing.
/// * [`Rendezvous::Redis`]: a Redis server (Gloo's own `RedisStore`).
///
/// Keys are namespaced by the job id ([`GlooConfig::job_id`]), so jobs with different ids never
/// see each other's keys, and a job id that was already used in a store fails at once with
/// [`Error::Invalid`] instead of mixing with the old job.
///
/// ```
/// use backend_gloo::Rendezvous;
/// let r = Rendezvous::parse("redis://127.0.0.1:6379").unwrap();
/// assert!(matches!(r, Rendezvous::Redis { port: 6379, .. }));
/// let f = Rendezvous::parse("file:///tmp/job").unwrap();
/// assert!(matches!(f, Rendezvous::File(p) if p.as_os_str() == "/tmp/job"));
/// assert!(Rendezvous::parse("tcp://x").is_err());
/// ```
#[derive(Clone)]
pub enum Rendezvous {
    /// An in-memory store shared by the threads of this process.
    InProcess(InProcessStore),
    /// A store in a directory.
    File(PathBuf),
    /// A Redis server.
    Redis {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rendezvous::InProcess(_) => write!(f, "InProcess"),
            Rendezvous::File(p) => write!(f, "File({})", p.display()),
            Rendezvous::Redis { host, port } => write!(f, "Redis({host}:{port})"),
        }
    }
}

/// An in-memory rendezvous store (Gloo's `HashStore`) shared by the ranks that are threads of
/// this process. Cloning shares the store.
///
/// ```
/// let store = backend_gloo::InProcessStore::new().unwrap();
/// let same = store.clone();
/// # drop((store, same));
/// ```
#[derive(Clone)]
pub struct InProcessStore(Arc<Mutex<RawStore>>);

impl InProcessStore {
    /// A new, empty store.
    pub fn new() -> Result<InProcessStore> {
        RawStore::hash()
            .map(|s| InProcessStore(Arc::new(Mutex::new(s))))
            .map_err(|e| store_error("in-process", e))
    }

    /// Number of keys the store holds (every job's, every rank's).
    ///
    /// ```
    /// use backend_gloo::{run_ranks_with, GlooConfig, Rendezvous};
    /// use grid_core::{Communicator, GroupFactory};
    /// let store = backend_gloo::InProcessStore::new().unwrap();
    /// assert_eq!(store.key_count().unwrap(), 0);
    /// let r = Rendezvous::InProcess(store.clone());
    /// let world_keys = run_ranks_with(&r, 2, &GlooConfig::new("doc-count"), |f, w| {
    ///     // A sub-group's keys are removed once every member has connected.
    ///     drop(f.split(&w, Some(0), w.rank())?);
    ///     w.barrier()?;
    ///     store.key_count()
    /// })
    /// .unwrap();
    /// // The world's keys stay: they mark the job id as used.
    /// assert!(world_keys.iter().all(|n| *n.as_ref().unwrap() > 0));
    /// assert_eq!(store.key_count().unwrap(), *world_keys[0].as_ref().unwrap());
    /// ```
    pub fn key_count(&self) -> Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .count()
            .ok_or_else(|| {
                LibraryError::new(
                    BACKEND,
                    "rendezvous",
                    "the in-process store cannot count its keys",
                )
                .into()
            })
    }

    fn handle(&self) -> Result<RawStore> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .try_clone()
            .ok_or_else(|| {
                LibraryError::new(BACKEND, "rendezvous", "cannot share the in-process store").into()
            })
    }
}

impl Rendezvous {
    /// A fresh in-process store.
    ///
    /// ```
    /// let r = backend_gloo::Rendezvous::in_process().unwrap();
    /// # drop(r);
    /// ```
    pub fn in_process() -> Result<Rendezvous> {
        InProcessStore::new().map(Rendezvous::InProcess)
    }

    /// Parses `file:<dir>` / `file://<dir>` / a plain absolute path, or `redis://host:port`.
    /// (An in-process store cannot be named: it exists only inside one process.)
    ///
    /// ```
    /// let r = backend_gloo::Rendezvous::parse("/tmp/some-dir").unwrap();
    /// assert!(matches!(r, backend_gloo::Rendezvous::File(_)));
    /// ```
    pub fn parse(s: &str) -> Result<Rendezvous> {
        let bad = || {
            Error::Invalid(format!(
                "rendezvous location {s:?} is not understood: use file:<directory>, a directory path, or redis://<host>:<port>"
            ))
        };
        if let Some(rest) = s.strip_prefix("redis://") {
            let rest = rest.trim_end_matches('/');
            let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
            let port: u16 = port.parse().map_err(|_| bad())?;
            if host.is_empty() {
                return Err(bad());
            }
            return Ok(Rendezvous::Redis {
                host: host.to_string(),
                port,
            });
        }
        let path = s
            .strip_prefix("file://")
            .or_else(|| s.strip_prefix("file:"))
            .unwrap_or(s);
        if path.is_empty() || s.contains("://") && !s.starts_with("file://") {
            return Err(bad());
        }
        Ok(Rendezvous::File(PathBuf::from(path)))
    }

    fn open(&self) -> Result<RawStore> {
        match self {
            Rendezvous::InProcess(s) => s.handle(),
            Rendezvous::File(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| {
                    Error::Invalid(format!(
                        "rendezvous directory {} cannot be created: {e}",
                        dir.display()
                    ))
                })?;
                let p = dir.to_str().ok_or_else(|| {
                    Error::Invalid(format!(
                        "rendezvous directory {} is not valid UTF-8",
                        dir.display()
                    ))
                })?;
                RawStore::file(p).map_err(|e| store_error("file", e))
            }
            Rendezvous::Redis { host, port } => {
                RawStore::redis(host, *port).map_err(|e| store_error("redis", e))
            }
        }
    }
}

fn store_error(kind: &str, e: ShimError) -> Error {
    LibraryError::new(
        BACKEND,
        "rendezvous",
        format!("cannot open the {kind} store: {}", e.message),
    )
    .code(e.code.status())
    .class(e.code.class())
    .into()
}

/// Settings of a Gloo job, the same on every rank.
///
/// ```
/// use backend_gloo::{GlooConfig, ReduceScatterAlgorithm};
/// use std::time::Duration;
/// let cfg = GlooConfig::new("train-42")
///     .with_timeout(Duration::from_secs(10))
///     .with_reduce_scatter(ReduceScatterAlgorithm::Allreduce);
/// assert_ne!(cfg.reduce_scatter, ReduceScatterAlgorithm::default()); // Direct
/// assert_eq!(cfg.job_id, "train-42");
/// assert_eq!(cfg.hostname, "127.0.0.1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlooConfig {
    /// Namespace of every store key of this job: unique per run (letters, digits, `.`, `_`, `-`).
    pub job_id: String,
    /// Bound of every operation, and of each rendezvous as a whole (Gloo's default is 30 s):
    /// arrival of every rank, the address exchange, every connection and the closing barrier
    /// share one deadline, whatever the world size. A rendezvous that times out lists the
    /// ranks that never arrived or never connected.
    ///
    /// [`Duration::MAX`] ([`GlooConfig::NO_LIMIT`]) means **no limit**, and so does
    /// `u64::MAX` ms (`GRID_GLOO_TIMEOUT_MS=18446744073709551615`) and any timeout of 100 years
    /// or more (Gloo counts deadlines in 64-bit nanoseconds: such a timeout is handed to it as
    /// 100 years).
    ///
    /// A failed operation takes about one second more (two when several ranks are silent) to
    /// find the rank that failed first, which its error names (`docs/backends.md` §2.4).
    pub timeout: Duration,
    /// Address of this host the TCP device listens on (default `127.0.0.1`: single host).
    pub hostname: String,
    /// Algorithm of `all_reduce` (and of the all-reduce inside
    /// [`ReduceScatterAlgorithm::Allreduce`]; all-reduces of at most 64 KiB on at
    /// most 16 ranks run as one round of messages instead). [`AllreduceAlgorithm::Auto`] (the default) picks by rank count and message
    /// size ([`crate::ALLREDUCE_TABLE`]), or takes [`crate::ALLREDUCE_ENV`] when that is set.
    pub allreduce: AllreduceAlgorithm,
    /// Algorithm of `reduce_scatter` ([`ReduceScatterAlgorithm::Direct`] unless set).
    pub reduce_scatter: ReduceScatterAlgorithm,
    /// Largest payload (bytes) of one message of the collectives that run as one round of
    /// messages (on at most 16 ranks: all-reduce, all-gather, reduce-scatter, all-to-all,
    /// broadcast; all-reduces of up to `n` such blocks as two rounds). At most and by default
    /// [`crate::ONE_ROUND_MAX`] (64 KiB); 0 sends every collective with data through libgloo's
    /// algorithms (the mismatch check is then a round of its own). [`crate::ONE_ROUND_ENV`]
    /// sets it when the program leaves the default. Every rank must use the same value: ranks
    /// that differ get an error naming both message lengths.
    pub one_round_max: usize,
    /// Whether Gloo's transport thread polls while one of libgloo's collectives runs (the
    /// default): between events it gives its core away (`sched_yield`) instead of sleeping in
    /// `epoll_wait`. libgloo's event loop only try-locks a connection that a rank's thread is
    /// using, and tries again at once while that fails; when its own wake-up took the core
    /// from that thread, the connection was released only at the scheduler's next tick, 4 ms
    /// on the 2-core machines measured (ranks outnumbering cores): a collective of 0.3 ms then
    /// took 4 ms in most calls. Polling costs the transport thread's share of a core for the
    /// length of each collective, as MPI's own progress does; `false` lets it sleep.
    /// [`BUSY_POLL_ENV`] (`0` or `1`) sets it when the program leaves the default. The
    /// one-round collectives and point-to-point messages yield the same way only while they
    /// post their messages (microseconds), whatever this says.
    pub busy_poll: bool,
}

/// Environment variable that sets [`GlooConfig::busy_poll`] (`1` or `0`) when the program
/// leaves it at its default.
pub const BUSY_POLL_ENV: &str = "GRID_GLOO_BUSY_POLL";

/// On a crowded communicator (its ranks all on this host, over loopback, and more of them than
/// this process may use cores), libgloo's collectives whose largest buffer has this many bytes
/// or more run without busy polling: 32 MiB. Such a collective lasts tens of milliseconds, so
/// the scheduler tick that polling saves (4 ms) matters little, while each rank's polling loop
/// thread takes core time from the ranks that copy. Measured with the peer benchmark on a
/// 2-core machine (docs/performance.md, *Busy polling on a crowded host*): 4 ranks, every
/// collective of 32 and 64 MiB, polling against none, two runs each: without it 26 of 28 cells
/// were faster (0.71-0.98 of the time), at 8 MiB the cells went both ways (0.78-1.47), and at
/// 2 ranks (not crowded) the all-reduces of 32 and 64 MiB were slower without (1.09-1.22).
pub const BUSY_POLL_CROWDED_BELOW: usize = 32 << 20;

/// libgloo's broadcasts of this many bytes or more run without busy polling on every
/// communicator, crowded or not: 64 MiB. In a broadcast each rank's copies go one way (the root
/// sends, a leaf receives), so a polling loop thread has little to handle and takes core time
/// from the thread that copies. Measured with 2 ranks on a 2-core machine (as many ranks as
/// cores: [`BUSY_POLL_CROWDED_BELOW`] does not apply), polling against none in alternation,
/// three series of 3, 5 and 6 sittings (docs/performance.md, *Busy polling on a crowded host*):
/// the 64 MiB broadcast's median was lower without polling in all six cells (processes and
/// threads, 1-31 % lower); at 32 MiB the two were even, at 16 MiB polling was ahead.
pub const BROADCAST_BUSY_POLL_BELOW: usize = crate::ffi::BROADCAST_BUSY_POLL_BELOW;

/// Whether a communicator of `size` ranks is crowded: its device is bound to a loopback address
/// (`loopback`: every rank is on this host) and the ranks outnumber `cores`. A communicator
/// over a real interface is never counted as crowded (how many of its ranks share this host is
/// not known here), nor one smaller than the host's crowd (a group of 2 of 4 ranks on 2 cores):
/// both keep polling, as before the rule.
fn crowded(loopback: bool, size: usize, cores: usize) -> bool {
    loopback && size > cores
}

/// The cores this process may use (when unknown, as many as any communicator has ranks: no
/// communicator counts as crowded).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(usize::MAX, |n| n.get())
}

/// `1` or `0` (surrounding spaces ignored) as a switch; anything else is `None`.
fn parse_switch(v: &str) -> Option<bool> {
    match v.trim() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

impl GlooConfig {
    /// The timeout that means no limit: [`Duration::MAX`] (any timeout of 100 years or more,
    /// such as `u64::MAX` ms, means the same).
    ///
    /// ```
    /// use backend_gloo::GlooConfig;
    /// let cfg = GlooConfig::new("patient").with_timeout(GlooConfig::NO_LIMIT);
    /// assert!(cfg.has_no_limit());
    /// let cfg = GlooConfig::new("patient").with_timeout(std::time::Duration::from_millis(u64::MAX));
    /// assert!(cfg.has_no_limit());
    /// assert!(!GlooConfig::new("j").has_no_limit());
    /// ```
    pub const NO_LIMIT: Duration = Duration::MAX;

    /// Whether [`GlooConfig::timeout`] means no limit (100 years or more).
    ///
    /// ```
    /// use backend_gloo::GlooConfig;
    /// use std::time::Duration;
    /// assert!(!GlooConfig::new("j").with_timeout(Duration::from_secs(3600)).has_no_limit());
    /// ```
    pub fn has_no_limit(&self) -> bool {
        self.timeout >= crate::ffi::NO_LIMIT
    }

    /// Defaults: 30 s timeout, `127.0.0.1`, all-reduce algorithm chosen per call
    /// ([`AllreduceAlgorithm::Auto`]), reduce-scatter through that all-reduce.
    ///
    /// ```
    /// let cfg = backend_gloo::GlooConfig::new("job");
    /// assert_eq!(cfg.timeout.as_secs(), 30);
    /// ```
    pub fn new(job_id: impl Into<String>) -> GlooConfig {
        GlooConfig {
            job_id: job_id.into(),
            timeout: Duration::from_secs(30),
            hostname: "127.0.0.1".into(),
            allreduce: AllreduceAlgorithm::Auto,
            reduce_scatter: ReduceScatterAlgorithm::Direct,
            one_round_max: crate::ONE_ROUND_MAX,
            busy_poll: true,
        }
    }

    /// Sets the timeout.
    ///
    /// ```
    /// let cfg = backend_gloo::GlooConfig::new("j").with_timeout(std::time::Duration::from_millis(500));
    /// assert_eq!(cfg.timeout.as_millis(), 500);
    /// ```
    pub fn with_timeout(mut self, timeout: Duration) -> GlooConfig {
        self.timeout = timeout;
        self
    }

    /// Sets the listening address.
    ///
    /// ```
    /// let cfg = backend_gloo::GlooConfig::new("j").with_hostname("10.0.0.7");
    /// assert_eq!(cfg.hostname, "10.0.0.7");
    /// ```
    pub fn with_hostname(mut self, hostname: impl Into<String>) -> GlooConfig {
        self.hostname = hostname.into();
        self
    }

    /// Sets the all-reduce algorithm.
    ///
    /// ```
    /// use backend_gloo::{AllreduceAlgorithm, GlooConfig};
    /// let cfg = GlooConfig::new("j").with_allreduce(AllreduceAlgorithm::Bcube);
    /// assert_eq!(cfg.allreduce, AllreduceAlgorithm::Bcube);
    /// ```
    pub fn with_allreduce(mut self, a: AllreduceAlgorithm) -> GlooConfig {
        self.allreduce = a;
        self
    }

    /// Sets the reduce-scatter algorithm.
    ///
    /// ```
    /// use backend_gloo::{GlooConfig, ReduceScatterAlgorithm};
    /// let cfg = GlooConfig::new("j").with_reduce_scatter(ReduceScatterAlgorithm::HalvingDoubling);
    /// assert_eq!(cfg.reduce_scatter, ReduceScatterAlgorithm::HalvingDoubling);
    /// ```
    pub fn with_reduce_scatter(mut self, a: ReduceScatterAlgorithm) -> GlooConfig {
        self.reduce_scatter = a;
        self
    }

    /// Sets the largest payload of a one-round collective's message ([`GlooConfig::one_round_max`]).
    ///
    /// ```
    /// use backend_gloo::{GlooConfig, ONE_ROUND_MAX};
    /// assert_eq!(GlooConfig::new("j").one_round_max, ONE_ROUND_MAX);
    /// assert_eq!(GlooConfig::new("j").with_one_round_max(0).one_round_max, 0);
    /// ```
    pub fn with_one_round_max(mut self, bytes: usize) -> GlooConfig {
        self.one_round_max = bytes;
        self
    }

    /// Sets whether the transport thread polls during libgloo's collectives
    /// ([`GlooConfig::busy_poll`]).
    ///
    /// ```
    /// use backend_gloo::GlooConfig;
    /// assert!(GlooConfig::new("j").busy_poll);
    /// assert!(!GlooConfig::new("j").with_busy_poll(false).busy_poll);
    /// ```
    pub fn with_busy_poll(mut self, on: bool) -> GlooConfig {
        self.busy_poll = on;
        self
    }

    /// `self` with [`crate::ALLREDUCE_ENV`], [`crate::ONE_ROUND_ENV`] and [`BUSY_POLL_ENV`]
    /// applied: an `Auto` all-reduce takes the algorithm the variable names, a default
    /// one-round limit the variable's bytes, a default busy poll the variable's `0` or `1`;
    /// values set explicitly stay.
    fn with_env_overrides(mut self) -> Result<GlooConfig> {
        if self.allreduce == AllreduceAlgorithm::Auto {
            if let Some(a) = AllreduceAlgorithm::from_env().map_err(Error::Invalid)? {
                self.allreduce = a;
            }
        }
        if self.one_round_max == crate::ONE_ROUND_MAX {
            if let Ok(v) = std::env::var(crate::ONE_ROUND_ENV) {
                self.one_round_max = v.trim().parse().map_err(|_| {
                    Error::Invalid(format!(
                        "{}={v:?} is not a number of bytes from 0 to {}",
                        crate::ONE_ROUND_ENV,
                        crate::ONE_ROUND_MAX
                    ))
                })?;
            }
        }
        if self.busy_poll {
            if let Ok(v) = std::env::var(BUSY_POLL_ENV) {
                self.busy_poll = parse_switch(&v).ok_or_else(|| {
                    Error::Invalid(format!(
                        "{BUSY_POLL_ENV}={v:?} is not a switch: use 1 (poll during collectives, the default) or 0 (sleep)"
                    ))
                })?;
            }
        }
        Ok(self)
    }

    fn validate(&self) -> Result<()> {
        let ok = !self.job_id.is_empty()
            && self.job_id.len() <= 128
            && self
                .job_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !ok {
            return Err(Error::Invalid(format!(
                "job id {:?} is not valid: use 1 to 128 letters, digits, '.', '_' or '-'",
                self.job_id
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::Invalid("the Gloo timeout must be positive".into()));
        }
        if self.one_round_max > crate::ONE_ROUND_MAX {
            return Err(Error::Invalid(format!(
                "one_round_max of {} bytes is larger than a one-round message can carry: use 0 to {} ({})",
                self.one_round_max,
                crate::ONE_ROUND_MAX,
                crate::ONE_ROUND_ENV
            )));
        }
        Ok(())
    }
}

/// Creates Gloo communicators for one rank: the world ([`GlooFactory::world`]) and sub-groups
/// ([`GroupFactory::split`], [`GroupFactory::create_group`], and so
/// `grid_core::build_collection`).
///
/// A split all-gathers the colours over the parent, then each colour group does its own
/// rendezvous (a new Gloo context with a full mesh of connections) under the store prefix
/// `grid-gloo/<job>/<parent name>/s<n>/c<colour>`, as PyTorch does for `new_group`: only the
/// members take part, and `n` counts the splits of that parent, so successive groups never
/// share keys. Once a group's rendezvous has completed on every member, each member removes
/// the keys it wrote, so creating and dropping groups does not grow the store (file store: the
/// key files; Redis: the keys; in-process store: the entries). A world's keys stay: they mark
/// the job id as used (see [`Rendezvous`]).
///
/// ```
/// use backend_gloo::{run_ranks, GlooConfig};
/// use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
///
/// let out = run_ranks(4, &GlooConfig::new("doc-split"), |factory, world| {
///     // Even and odd world ranks.
///     let half = factory.split(&world, Some((world.rank() % 2) as u32), world.rank())?.unwrap();
///     let mut sum = [0u8];
///     half.all_reduce_into(&[world.rank() as u8], &mut sum, ReduceOp::Sum)?;
///     Ok((half.global_ranks().to_vec(), sum[0]))
/// })
/// .unwrap();
/// assert_eq!(out[1].as_ref().unwrap(), &(vec![1, 3], 4));
/// ```
pub struct GlooFactory {
    store: Mutex<RawStore>,
    /// A second handle to the store, for failure records (`crate::blame`); `None` when it
    /// could not be opened (failures are then blamed as Gloo reports them).
    records: Option<SharedStore>,
    device: RawDevice,
    config: GlooConfig,
    worlds: AtomicU64,
    /// Members-only creations made per group identity ([`GroupFactory::create_members_only`]).
    identities: Mutex<std::collections::HashMap<String, u64>>,
}

impl std::fmt::Debug for GlooFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlooFactory")
            .field("config", &self.config)
            .finish()
    }
}

impl GlooFactory {
    /// Opens the store (connects to Redis) and creates this rank's TCP device.
    ///
    /// ```
    /// use backend_gloo::{GlooConfig, GlooFactory, Rendezvous};
    /// let f = GlooFactory::new(&Rendezvous::in_process().unwrap(), GlooConfig::new("doc-new")).unwrap();
    /// let world = f.world(0, 1).unwrap();
    /// # drop(world);
    /// ```
    pub fn new(rendezvous: &Rendezvous, config: GlooConfig) -> Result<GlooFactory> {
        config.validate()?;
        let config = config.with_env_overrides()?;
        let store = rendezvous.open()?;
        let device = RawDevice::tcp(&config.hostname).map_err(|e| {
            LibraryError::new(
                BACKEND,
                "device",
                format!(
                    "cannot create a TCP device on {}: {}",
                    config.hostname, e.message
                ),
            )
            .code(e.code.status())
            .class(e.code.class())
        })?;
        // Failure records go through their own handle, so that a rendezvous in progress on
        // another thread never delays a failing operation; a store server request of theirs
        // is bounded by the blame grace period.
        let records = match rendezvous.open().and_then(|mut s| {
            s.set_io_timeout(Some(GRACE))
                .map_err(|e| store_error("records", e))?;
            Ok(s)
        }) {
            Ok(s) => Some(Arc::new(Mutex::new(s))),
            Err(e) => {
                tracing::warn!(error = %e, "gloo: no store handle for failure records; failures are blamed as Gloo reports them");
                None
            }
        };
        Ok(GlooFactory {
            store: Mutex::new(store),
            records,
            device,
            config,
            worlds: AtomicU64::new(0),
            identities: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// The job's settings.
    ///
    /// ```
    /// # use backend_gloo::{GlooConfig, GlooFactory, Rendezvous};
    /// let f = GlooFactory::new(&Rendezvous::in_process().unwrap(), GlooConfig::new("doc-cfg")).unwrap();
    /// assert_eq!(f.config().job_id, "doc-cfg");
    /// ```
    pub fn config(&self) -> &GlooConfig {
        &self.config
    }

    /// The world communicator: rendezvous of `size` ranks, this one being `rank`. Every rank of
    /// the job calls it (the k-th call on each rank meets the k-th call on the others).
    ///
    /// ```
    /// # use backend_gloo::{GlooConfig, GlooFactory, Rendezvous};
    /// # use grid_core::Communicator;
    /// let f = GlooFactory::new(&Rendezvous::in_process().unwrap(), GlooConfig::new("doc-world")).unwrap();
    /// let w = f.world(0, 1).unwrap();
    /// assert_eq!((w.rank(), w.size(), w.global_ranks()), (0, 1, &[0usize][..]));
    /// assert!(f.world(1, 1).is_err());
    /// ```
    pub fn world(&self, rank: usize, size: usize) -> Result<GlooCommunicator> {
        if size == 0 || rank >= size {
            return Err(Error::RankOutOfRange {
                rank,
                first: 0,
                end: size,
            });
        }
        let name = format!("w{}", self.worlds.fetch_add(1, Ordering::Relaxed));
        self.connect(&name, rank, (0..size).collect(), Meeting::World)
    }

    fn prefix(&self, name: &str) -> String {
        format!("grid-gloo/{}/{}", self.config.job_id, name)
    }

    /// Rendezvous of a communicator `name` whose members are `global_ranks` (this rank at
    /// position `rank`).
    fn connect(
        &self,
        name: &str,
        rank: usize,
        global_ranks: Vec<usize>,
        meeting: Meeting,
    ) -> Result<GlooCommunicator> {
        self.connect_with(name, rank, global_ranks, meeting, &Link::default())
    }

    /// [`GlooFactory::connect`] with a group's own name, timeout and device.
    fn connect_with(
        &self,
        name: &str,
        rank: usize,
        global_ranks: Vec<usize>,
        meeting: Meeting,
        link: &Link<'_>,
    ) -> Result<GlooCommunicator> {
        let device = link.device.unwrap_or(&self.device);
        let timeout = link.timeout.unwrap_or(self.config.timeout);
        let display = link.name.unwrap_or(name);
        let size = global_ranks.len();
        let prefix = self.prefix(name);
        let t = std::time::Instant::now();
        let ctx = {
            let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
            RawContext::connect(
                &mut store,
                &prefix,
                device,
                rank,
                size,
                timeout,
                meeting == Meeting::Group,
            )
        }
        .map_err(|e| self.rendezvous_error(name, rank, size, e))?;
        ctx.set_busy_poll(self.config.busy_poll);
        if crowded(device.is_loopback(), size, cores()) {
            ctx.set_busy_poll_below(BUSY_POLL_CROWDED_BELOW);
        }
        tracing::debug!(
            communicator = name,
            rank,
            size,
            seconds = t.elapsed().as_secs_f64(),
            "gloo rendezvous"
        );
        let blame = self
            .records
            .as_ref()
            .map(|s| Blame::new(s.clone(), prefix, rank, global_ranks.clone()));
        let mut backend = GlooBackend::new(
            ctx,
            global_ranks,
            display.to_string(),
            timeout,
            self.config.allreduce,
            self.config.reduce_scatter,
            self.config.one_round_max,
        )
        .with_store_name(name.to_string());
        if let Some(b) = blame {
            backend = backend.with_blame(b);
        }
        Ok(Comm::new(backend, display))
    }

    fn rendezvous_error(&self, name: &str, rank: usize, size: usize, e: ShimError) -> Error {
        let job = &self.config.job_id;
        match e.code {
            ShimCode::KeyExists => Error::Invalid(format!(
                "rendezvous of communicator '{name}' (rank {rank} of {size}) found keys of an earlier run of job '{job}' in the store: \
                 job ids must be unique per run; use a new job id or an empty store ({})",
                e.message
            )),
            ShimCode::Invalid => Error::Invalid(format!("rendezvous of '{name}': {}", e.message)),
            // A rank that died or stopped during the rendezvous, found by the shim.
            ShimCode::Timeout | ShimCode::Io | ShimCode::Other if e.peer.is_some() => {
                let peer = e.peer.unwrap_or_default();
                rendezvous_peer_failed(
                    peer,
                    format!(
                        "communicator '{name}' of job '{job}' (rank {rank} of {size}): {}",
                        e.message
                    ),
                )
            }
            // Ranks that never arrived (or several that never connected): the message lists
            // them, which `Error::Timeout` has no room for.
            ShimCode::Timeout => LibraryError::new(
                BACKEND,
                "rendezvous",
                format!(
                    "communicator '{name}' of job '{job}' (rank {rank} of {size}): {}",
                    e.message
                ),
            )
            .comm(name)
            .code(ShimCode::Timeout.status())
            .class(ShimCode::Timeout.class())
            .into(),
            code => LibraryError::new(
                BACKEND,
                "rendezvous",
                format!(
                    "communicator '{name}' of job '{job}' (rank {rank} of {size}): {}",
                    e.message
                ),
            )
            .comm(name)
            .code(code.status())
            .class(code.class())
            .into(),
        }
    }
}

/// The error of a rendezvous that failed because of communicator rank `peer`.
fn rendezvous_peer_failed(peer: usize, message: String) -> Error {
    Error::PeerFailed {
        op: "rendezvous",
        peer,
        message,
        at: None,
    }
}

/// Whose rendezvous it is: what its members can take for granted, and what becomes of its keys
/// once every member has connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Meeting {
    /// A world: every rank first announces its arrival (the world size is the caller's word,
    /// and a wrong one must fail listing the ranks that never came), and the keys are kept for
    /// the life of the store: they mark the job id as used, so that a second run under the
    /// same id fails at once instead of mixing with the first.
    World,
    /// A group of a connected communicator: its members are known, so there is no arrival
    /// phase, and the keys are removed (each rank removes the keys it set), so that creating
    /// and dropping groups does not grow the store.
    Group,
}

impl GroupFactory for GlooFactory {
    type Comm = GlooCommunicator;

    fn split(
        &self,
        parent: &GlooCommunicator,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<GlooCommunicator>> {
        self.split_linked(parent, color, key, &Link::default())
    }

    /// The split, creating the communicator under the options' name, with their time limit
    /// and their Gloo options ([`grid_core::GlooGroupOptions`]): Gloo's timeout for the
    /// group's rendezvous and operations, and a TCP device on the given hostname (created for
    /// the group; its rendezvous store stays the factory's). Options for another backend are
    /// rejected before any communication.
    fn split_with(
        &self,
        parent: &GlooCommunicator,
        color: Option<u32>,
        key: usize,
        options: &grid_core::GroupOptions,
    ) -> Result<Option<GlooCommunicator>> {
        options.check_backend(BACKEND)?;
        let gloo = gloo_options(options);
        // Only members connect on a device: creating one is local, and a failure here is
        // reported before the collective exchange of the split, on every rank (same options).
        let device = group_device(options)?;
        let link = Link {
            name: options.name.as_deref(),
            timeout: gloo.and_then(|g| g.timeout),
            device: device.as_ref(),
        };
        let comm = self.split_linked(parent, color, key, &link)?;
        if let (Some(c), Some(t)) = (&comm, options.timeout) {
            c.set_time_limit(t);
        }
        Ok(comm)
    }

    /// Members-only creation: the members meet in a rendezvous under a store prefix of the
    /// group's own, `<parent>/m/<identity>/<k>`, where `k` counts the groups of this identity
    /// this rank created from this factory before (a count only the group's members advance,
    /// all alike). Ranks outside the group make no call and touch no key; the rendezvous keys
    /// are removed once every member connected. Named `options.name`, else `identity`; Gloo
    /// options apply as in [`GroupFactory::split_with`].
    fn create_members_only(
        &self,
        parent: &GlooCommunicator,
        members: &[usize],
        identity: &str,
        options: &grid_core::GroupOptions,
    ) -> Result<GlooCommunicator> {
        const OP: &str = "create_members_only";
        parent.ensure_usable(OP)?;
        options.check_backend(BACKEND)?;
        let me = parent.rank();
        grid_core::comm::check::members_only(OP, members, parent.size(), me)?;
        let rank = members.iter().position(|&r| r == me).ok_or_else(|| {
            Error::Invalid(format!(
                "{OP}: rank {me} is not one of the members {members:?}"
            ))
        })?;
        let global: Vec<usize> = members
            .iter()
            .map(|&r| parent.global_ranks().get(r).copied().unwrap_or(r))
            .collect();
        let gloo = gloo_options(options);
        let device = group_device(options)?;
        let base = format!("{}/m/{identity}", parent.inner().store_name());
        let k = {
            let mut counts = self.identities.lock().unwrap_or_else(|e| e.into_inner());
            // Per calling rank too: a factory may serve several ranks.
            let c = counts.entry(format!("{base}@{me}")).or_insert(0);
            let k = *c;
            *c += 1;
            k
        };
        let name = format!("{base}/{k}");
        let display = options.name.as_deref().unwrap_or(identity);
        let link = Link {
            name: Some(display),
            timeout: gloo.and_then(|g| g.timeout),
            device: device.as_ref(),
        };
        let comm = self.connect_with(&name, rank, global, Meeting::Group, &link)?;
        if let Some(t) = options.timeout {
            comm.set_time_limit(t);
        }
        Ok(comm)
    }
}

/// The Gloo options of a group, if it has some.
fn gloo_options(options: &grid_core::GroupOptions) -> Option<&grid_core::GlooGroupOptions> {
    match &options.backend {
        grid_core::BackendOptions::Gloo(g) => Some(g),
        _ => None,
    }
}

/// The TCP device a group's Gloo options ask for (`None`: the factory's).
fn group_device(options: &grid_core::GroupOptions) -> Result<Option<RawDevice>> {
    let device = match gloo_options(options).and_then(|g| g.hostname.as_deref()) {
        Some(h) => Some(RawDevice::tcp(h).map_err(|e| {
            Error::from(
                LibraryError::new(
                    BACKEND,
                    "device",
                    format!(
                        "group '{}': cannot create a TCP device on {h}: {}",
                        options.name.as_deref().unwrap_or("(unnamed)"),
                        e.message
                    ),
                )
                .code(e.code.status())
                .class(e.code.class()),
            )
        })?),
        None => None,
    };
    Ok(device)
}

impl GlooFactory {
    fn split_linked(
        &self,
        parent: &GlooCommunicator,
        color: Option<u32>,
        key: usize,
        link: &Link<'_>,
    ) -> Result<Option<GlooCommunicator>> {
        const OP: &str = "split";
        parent.ensure_usable(OP)?;
        let seq = parent.next_split();
        let me = parent.rank();
        // Colour, key and world rank of every parent rank (grid-core's split arithmetic).
        let mine = SplitEntry {
            color,
            key,
            world_rank: parent.global_ranks().get(me).copied().unwrap_or(me),
        }
        .encode();
        let mut all = vec![0i64; mine.len() * parent.size()];
        parent.all_gather_into(&mine[..], &mut all)?;
        let entries = SplitEntry::decode_all(&all)?;
        let Some(color) = color else {
            return Ok(None);
        };
        let members = split_members(&entries, me).ok_or_else(|| {
            Error::from(
                LibraryError::new(
                    BACKEND,
                    OP,
                    format!("rank {me} is missing from its own colour group {color}"),
                )
                .comm(parent.comm_name()),
            )
        })?;
        let name = format!("{}/s{seq}/c{color}", parent.inner().store_name());
        self.connect_with(&name, members.rank, members.members, Meeting::Group, link)
            .map(Some)
    }
}

/// What a group's options change in its rendezvous: the name it is shown under, Gloo's
/// timeout and the TCP device (`None`: the factory's).
#[derive(Default)]
struct Link<'a> {
    name: Option<&'a str>,
    timeout: Option<std::time::Duration>,
    device: Option<&'a RawDevice>,
}

/// Runs `world_size` ranks as threads of this process, meeting through a fresh in-process store,
/// and returns each rank's result in rank order (a rank that panicked yields
/// [`Error::Invalid`] with the panic message).
///
/// `f` receives the rank's factory and its world communicator.
///
/// ```
/// use backend_gloo::{run_ranks, GlooConfig};
/// use grid_core::{Communicator, CommunicatorExt};
///
/// let gathered = run_ranks(3, &GlooConfig::new("doc-run"), |_f, world| {
///     let mut all = vec![0i32; 3];
///     world.all_gather_into(&[10 * world.rank() as i32], &mut all)?;
///     Ok(all)
/// })
/// .unwrap();
/// assert_eq!(gathered[2].as_ref().unwrap(), &vec![0, 10, 20]);
/// ```
pub fn run_ranks<R, F>(world_size: usize, config: &GlooConfig, f: F) -> Result<Vec<Result<R>>>
where
    R: Send,
    F: Fn(&GlooFactory, GlooCommunicator) -> Result<R> + Sync,
{
    run_ranks_with(&Rendezvous::in_process()?, world_size, config, f)
}

/// [`run_ranks`] with a given rendezvous (for example a file store shared with other processes).
///
/// ```
/// use backend_gloo::{run_ranks_with, GlooConfig, Rendezvous};
/// use grid_core::Communicator;
/// let r = Rendezvous::in_process().unwrap();
/// let sizes = run_ranks_with(&r, 2, &GlooConfig::new("doc-with"), |_f, w| Ok(w.size())).unwrap();
/// assert_eq!(sizes.len(), 2);
/// ```
pub fn run_ranks_with<R, F>(
    rendezvous: &Rendezvous,
    world_size: usize,
    config: &GlooConfig,
    f: F,
) -> Result<Vec<Result<R>>>
where
    R: Send,
    F: Fn(&GlooFactory, GlooCommunicator) -> Result<R> + Sync,
{
    if world_size == 0 {
        return Err(Error::NonPositive {
            what: "world size".into(),
            value: 0,
        });
    }
    config.validate()?;
    // A bad GRID_GLOO_ALLREDUCE fails here once, not on every rank.
    config.clone().with_env_overrides()?;
    let f = &f;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                std::thread::Builder::new()
                    .name(format!("gloo-rank-{rank}"))
                    .spawn_scoped(s, move || -> Result<R> {
                        let factory = GlooFactory::new(rendezvous, config.clone())?;
                        let world = factory.world(rank, world_size)?;
                        f(&factory, world)
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| {
                    Err(Error::Invalid(format!(
                        "rank {rank} panicked: {}",
                        panic_message(&*p)
                    )))
                }),
                Err(e) => Err(LibraryError::new(
                    BACKEND,
                    "run_ranks",
                    format!("cannot start the thread of rank {rank}: {e}"),
                )
                .into()),
            })
            .collect()
    });
    Ok(results)
}

/// Environment variables read by [`init_from_env`].
pub mod env {
    /// This process's rank (torchrun's name).
    pub const RANK: &str = "RANK";
    /// Number of ranks (torchrun's name).
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// Rendezvous location: `file:<dir>`, a directory, or `redis://host:port`.
    pub const STORE: &str = "GRID_GLOO_STORE";
    /// Job id (unique per run).
    pub const JOB_ID: &str = "GRID_GLOO_JOB_ID";
    /// Timeout in milliseconds (optional; `18446744073709551615`, that is `u64::MAX`, means no
    /// limit: see [`crate::GlooConfig::timeout`]).
    pub const TIMEOUT_MS: &str = "GRID_GLOO_TIMEOUT_MS";
    /// Listening address (optional, default 127.0.0.1).
    pub const HOSTNAME: &str = "GRID_GLOO_HOSTNAME";
}

fn env_var(name: &str) -> Result<String> {
    std::env::var(name)
        .map_err(|_| Error::Invalid(format!("environment variable {name} is not set")))
}

fn env_usize(name: &str) -> Result<usize> {
    let v = env_var(name)?;
    v.trim().parse().map_err(|_| {
        Error::Invalid(format!(
            "environment variable {name}={v:?} is not a non-negative integer"
        ))
    })
}

/// One rank per process: reads [`env::RANK`], [`env::WORLD_SIZE`], [`env::STORE`],
/// [`env::JOB_ID`] (and optionally [`env::TIMEOUT_MS`], [`env::HOSTNAME`]) and returns the
/// factory and the world communicator.
///
/// ```no_run
/// // RANK=0 WORLD_SIZE=2 GRID_GLOO_STORE=file:/tmp/rdv GRID_GLOO_JOB_ID=run-1 ./program
/// let (factory, world) = backend_gloo::init_from_env().unwrap();
/// # drop((factory, world));
/// ```
pub fn init_from_env() -> Result<(GlooFactory, GlooCommunicator)> {
    let rank = env_usize(env::RANK)?;
    let size = env_usize(env::WORLD_SIZE)?;
    let store = Rendezvous::parse(&env_var(env::STORE)?)?;
    let mut config = GlooConfig::new(env_var(env::JOB_ID)?);
    if std::env::var_os(env::TIMEOUT_MS).is_some() {
        config.timeout = Duration::from_millis(env_usize(env::TIMEOUT_MS)? as u64);
    }
    if let Ok(h) = std::env::var(env::HOSTNAME) {
        config.hostname = h;
    }
    let factory = GlooFactory::new(&store, config)?;
    let world = factory.world(rank, size)?;
    Ok((factory, world))
}

#[cfg(test)]
mod tests {
    use super::crowded;

    #[test]
    fn crowded_only_on_loopback_with_more_ranks_than_cores() {
        assert!(crowded(true, 4, 2));
        assert!(crowded(true, 3, 2));
        assert!(!crowded(true, 2, 2), "as many ranks as cores");
        assert!(!crowded(true, 1, 2));
        assert!(
            !crowded(false, 64, 2),
            "ranks over a real interface may be on other hosts"
        );
        assert!(!crowded(true, 1 << 20, usize::MAX), "cores unknown");
    }
}
