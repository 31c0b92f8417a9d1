//! Job-level failure handling: a registry of weak handles to every communicator, so that when
//! one fails all of them can be aborted (a rank blocked in another group's collective would
//! otherwise wait forever for the failed peer).

use crate::comm::Shared;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The communicators created through one [`crate::NcclFactory`] (the world and every split).
///
/// ```no_run
/// # fn f(factory: &backend_nccl::NcclFactory) {
/// // Something failed on this rank: interrupt every NCCL operation of the job.
/// let aborted = factory.job().abort_all();
/// println!("aborted {aborted} communicators");
/// # }
/// ```
#[derive(Default)]
pub struct Job {
    members: Mutex<Vec<Weak<Shared>>>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({} live communicators)", self.live_count())
    }
}

impl Job {
    /// An empty registry.
    pub fn new() -> Arc<Job> {
        Arc::new(Job::default())
    }

    pub(crate) fn register(&self, s: &Arc<Shared>) {
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|w| w.strong_count() > 0);
        m.push(Arc::downgrade(s));
    }

    fn live(&self) -> Vec<Arc<Shared>> {
        let m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .filter_map(Weak::upgrade)
            .filter(|s| s.raw.is_live())
            .collect()
    }

    /// Number of communicators of this job that are still live.
    pub fn live_count(&self) -> usize {
        self.live().len()
    }

    /// Aborts (`ncclCommAbort`) every live communicator of the job; returns how many.
    pub fn abort_all(&self) -> usize {
        self.live().into_iter().filter(|s| s.raw.abort()).count()
    }
}

/// The registry of every communicator of this process (all factories).
pub(crate) fn process() -> &'static Job {
    static P: OnceLock<Job> = OnceLock::new();
    P.get_or_init(Job::default)
}

/// Aborts every live NCCL communicator of this process, whichever factory created it; returns
/// how many. Safe to call from any thread, for example from a signal-handling or watchdog thread.
///
/// ```
/// assert_eq!(backend_nccl::abort_all(), 0); // nothing was created in this doc test
/// ```
pub fn abort_all() -> usize {
    process().abort_all()
}
