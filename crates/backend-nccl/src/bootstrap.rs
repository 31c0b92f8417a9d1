//! The first NCCL unique id travels over a *bootstrap* communicator from another backend (MPI
//! or Gloo for one process per GPU, `backend-local` for one process with one thread per GPU). Only that first id is
//! exchanged: every sub-group afterwards comes from `ncclCommSplit` of the world communicator.
//!
//! The exchange never leaves a rank waiting for a rank that already gave up: every rank first
//! all-gathers a one-byte "ready" flag (library found, device usable, and on rank 0 the id
//! created), and only if all are ready does rank 0 broadcast the 128 id bytes.

use grid_core::{BufMut, BufRef, Communicator, Error, Result};

/// Size of an `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

/// Exchanges the unique id over `bootstrap` (collective over it).
///
/// `local` is this rank's readiness (`Err` if it cannot take part, with the reason), `make_id`
/// creates the id and is called on rank 0 only, and only if rank 0 is ready. Returns the same
/// 128 bytes on every rank, or an error on every rank if any rank was not ready: the rank's own
/// reason where it failed, [`Error::PeerFailed`] naming the failed ranks elsewhere.
///
/// ```
/// use backend_nccl::bootstrap::exchange_unique_id;
/// let ids = backend_local::run(2, &Default::default(), |_, boot| {
///     exchange_unique_id(&boot, Ok(()), &mut || Ok([7u8; 128]))
/// })?;
/// assert_eq!(ids, vec![[7u8; 128]; 2]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn exchange_unique_id(
    bootstrap: &dyn Communicator,
    local: Result<()>,
    make_id: &mut dyn FnMut() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    let ids = exchange_unique_ids(bootstrap, local, &[0], make_id)?;
    ids.into_iter()
        .next()
        .ok_or_else(|| crate::error::internal("nccl init", "no unique id"))
}

/// The ranks that create the unique ids of a communicator of `nranks` initialised from `nids`
/// ids (`ncclCommInitRankScalable`): the ranks are cut into `nids` runs as even as possible (the
/// first `nranks % nids` runs one longer), and the first rank of each run creates its run's id,
/// as NCCL's user guide recommends (*Creating a communicator using multiple ncclUniqueIds*).
/// `nids` is clamped to `1..=nranks`.
///
/// ```
/// use backend_nccl::bootstrap::root_ranks;
/// assert_eq!(root_ranks(7, 3), vec![0, 3, 5]); // the user guide's example
/// assert_eq!(root_ranks(8, 1), vec![0]);
/// assert_eq!(root_ranks(4, 9), vec![0, 1, 2, 3]);
/// ```
pub fn root_ranks(nranks: usize, nids: usize) -> Vec<usize> {
    let nids = nids.clamp(1, nranks.max(1));
    let (per, extra) = (nranks / nids, nranks % nids);
    (0..nids).map(|i| i * per + i.min(extra)).collect()
}

/// How many unique ids initialise a communicator of `nranks` with at most `ranks_per_root`
/// ranks per id (`ceil(nranks / ranks_per_root)`, at least 1); 1 when `scalable` is false
/// (the library has no `ncclCommInitRankScalable`).
///
/// ```
/// use backend_nccl::bootstrap::root_count;
/// assert_eq!(root_count(8, 128, true), 1);
/// assert_eq!(root_count(1000, 128, true), 8);
/// assert_eq!(root_count(1000, 128, false), 1);
/// ```
pub fn root_count(nranks: usize, ranks_per_root: usize, scalable: bool) -> usize {
    if !scalable {
        return 1;
    }
    nranks.div_ceil(ranks_per_root.max(1)).max(1)
}

/// Exchanges the unique ids created on `roots` (see [`root_ranks`]) over `bootstrap`
/// (collective over it): like [`exchange_unique_id`], with one broadcast of 128 bytes per root.
/// Returns the ids in the order of `roots`, the same on every rank.
///
/// ```
/// use backend_nccl::bootstrap::exchange_unique_ids;
/// let ids = backend_local::run(3, &Default::default(), |_, boot| {
///     let me = grid_core::Communicator::rank(&boot) as u8;
///     exchange_unique_ids(&boot, Ok(()), &[0, 2], &mut || Ok([me; 128]))
/// })?;
/// assert_eq!(ids, vec![vec![[0u8; 128], [2u8; 128]]; 3]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn exchange_unique_ids(
    bootstrap: &dyn Communicator,
    local: Result<()>,
    roots: &[usize],
    make_id: &mut dyn FnMut() -> Result<[u8; ID_BYTES]>,
) -> Result<Vec<[u8; ID_BYTES]>> {
    let me = bootstrap.rank();
    let n = bootstrap.size();
    let mut my_err = local.err();
    let mut mine = [0u8; ID_BYTES];
    if roots.contains(&me) && my_err.is_none() {
        match make_id() {
            Ok(b) => mine = b,
            Err(e) => my_err = Some(e),
        }
    }
    let ready = [u8::from(my_err.is_none())];
    let mut flags = vec![0u8; n];
    bootstrap.all_gather(BufRef::from(&ready[..]), BufMut::from(&mut flags[..]))?;
    let failed: Vec<usize> = flags
        .iter()
        .enumerate()
        .filter(|(_, f)| **f == 0)
        .map(|(i, _)| i)
        .collect();
    if let Some(e) = my_err {
        return Err(e);
    }
    if let Some(&first) = failed.first() {
        return Err(Error::PeerFailed {
            op: "nccl init",
            peer: first,
            message: format!(
                "bootstrap ranks {failed:?} could not set up NCCL (each reports its reason); no NCCL communicator was created"
            ),
            at: None,
        });
    }
    let mut ids = Vec::with_capacity(roots.len());
    for &root in roots {
        let mut id = if root == me { mine } else { [0u8; ID_BYTES] };
        bootstrap.broadcast(BufMut::from(&mut id[..]), root)?;
        ids.push(id);
    }
    Ok(ids)
}

/// The environment variables read for the node-local rank, in order: torchrun, Open MPI,
/// MPICH/Intel MPI, MVAPICH, Slurm.
pub const LOCAL_RANK_VARS: [&str; 5] = [
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
];

/// The node-local rank from the first of [`LOCAL_RANK_VARS`] that is set to a number.
///
/// ```
/// let env = |k: &str| (k == "OMPI_COMM_WORLD_LOCAL_RANK").then(|| "3".to_string());
/// assert_eq!(backend_nccl::bootstrap::local_rank_from(&env), Some(3));
/// ```
pub fn local_rank_from(get: &dyn Fn(&str) -> Option<String>) -> Option<usize> {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|k| get(k).and_then(|v| v.trim().parse().ok()))
}

/// The GPU a rank uses: `explicit` if given (must be visible), else the node-local rank modulo
/// the number of visible GPUs, else the bootstrap rank modulo that number (right when ranks are
/// placed on nodes in blocks of `count`).
///
/// ```
/// use backend_nccl::bootstrap::choose_device;
/// assert_eq!(choose_device(None, Some(5), 13, 4).unwrap(), 1);
/// assert_eq!(choose_device(None, None, 6, 4).unwrap(), 2);
/// assert!(choose_device(Some(4), None, 0, 4).is_err());
/// ```
pub fn choose_device(
    explicit: Option<usize>,
    local_rank: Option<usize>,
    rank: usize,
    count: usize,
) -> Result<usize> {
    if count == 0 {
        return Err(crate::error::lib(
            "choose device",
            "no GPU is visible (CUDA_VISIBLE_DEVICES may hide them)",
        ));
    }
    match explicit {
        Some(d) if d < count => Ok(d),
        Some(d) => Err(Error::Invalid(format!(
            "device {d} was requested but only {count} GPU(s) are visible (valid: 0..{count}; CUDA_VISIBLE_DEVICES={:?})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
        ))),
        None => Ok(local_rank.unwrap_or(rank) % count),
    }
}

/// A GPU this process uses for one NCCL rank: while it is held, another rank of this process
/// asking for the same GPU fails at once ([`claim_device`]) instead of hanging in NCCL (two ranks
/// of one communicator on one GPU are not supported by NCCL and may hang). Released on drop.
#[derive(Debug)]
pub struct DeviceClaim(usize);

fn claims() -> std::sync::MutexGuard<'static, Vec<usize>> {
    static CLAIMS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
    CLAIMS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Claims GPU `device` for one NCCL rank of this process.
///
/// ```
/// use backend_nccl::bootstrap::claim_device;
/// let a = claim_device(7)?;
/// let e = claim_device(7).unwrap_err();
/// assert!(e.to_string().contains("device 7 is already used by another NCCL rank of this process"));
/// drop(a);
/// let _b = claim_device(7)?; // free again
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn claim_device(device: usize) -> Result<DeviceClaim> {
    let mut c = claims();
    if c.contains(&device) {
        return Err(Error::Invalid(format!(
            "nccl init: device {device} is already used by another NCCL rank of this process (NCCL does not support two ranks on one GPU and may hang); give each rank its own GPU: NcclOptions::device, CUDA_VISIBLE_DEVICES, or a node-local rank (LOCAL_RANK, ...) per process"
        )));
    }
    c.push(device);
    Ok(DeviceClaim(device))
}

impl DeviceClaim {
    /// The claimed GPU.
    pub fn device(&self) -> usize {
        self.0
    }
}

impl Drop for DeviceClaim {
    fn drop(&mut self) {
        claims().retain(|d| *d != self.0);
    }
}
