//! Job-level failure handling: [`Job`] (the communicators of one factory, aborted together when
//! one fails; see [`crate::engine`]) and the process-wide registry behind [`abort_all`].

pub use crate::engine::Job;
use std::sync::Arc;
use std::sync::OnceLock;

/// The registry of every communicator of this process (all factories). It never aborts on a
/// member's failure by itself; [`abort_all`] aborts everything on request.
pub(crate) fn process() -> &'static Arc<Job> {
    static P: OnceLock<Arc<Job>> = OnceLock::new();
    P.get_or_init(|| Job::new(false))
}

/// Aborts every live NCCL communicator of this process, whichever factory created it; returns
/// how many. Safe to call from any thread, for example from a signal-handling thread.
///
/// ```
/// assert_eq!(backend_nccl::abort_all(), 0); // nothing was created in this doc test
/// ```
pub fn abort_all() -> usize {
    process().abort_all()
}
