//! Ranks as threads for the multi-module tests, over the in-process backend (`backend-local`):
//! one thread per rank, messages matched by (communicator, source, destination, tag). With
//! `rendezvous` on, a send completes only once the receiver has taken the message (like a large
//! MPI message), so any ordering that would deadlock on a real backend deadlocks here too and
//! fails with a time-out.
#![allow(dead_code)]

use backend_local::{LocalComm, LocalConfig, LocalFactory, LocalStats, LocalWorld};
use grid_core::{DType, GroupFactory, Result};
use std::sync::Arc;
use std::time::Duration;

/// A rank's communicator.
pub type ThreadComm = LocalComm;

/// What a simulated world's ranks sent.
pub struct Hub {
    stats: Arc<LocalStats>,
}

impl Hub {
    /// (world src, world dst, elements) of every payload-sized point-to-point message: more
    /// than 6 elements, and not the 48 bytes of a header framed with its payload, which this
    /// backend sends as a message of its own (shorter ones are control messages: headers of
    /// six `i64`).
    pub fn log(&self) -> Vec<(usize, usize, usize)> {
        self.stats
            .messages()
            .into_iter()
            .filter(|m| m.len > 6 && !(m.dtype == DType::U8 && m.len == 48))
            .map(|m| (m.src, m.dst, m.len))
            .collect()
    }
    /// `batch_p2p` calls made by world rank `rank` so far.
    pub fn batches(&self, rank: usize) -> usize {
        self.stats.batches(rank)
    }
}

/// Splits [`ThreadComm`]s (the local backend's factory).
pub struct ThreadFactory;

impl GroupFactory for ThreadFactory {
    type Comm = ThreadComm;
    fn split(
        &self,
        parent: &ThreadComm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<ThreadComm>> {
        LocalFactory::new().split(parent, color, key)
    }
}

/// Runs `body(rank, world)` on `n` threads and returns each rank's result.
pub fn run_world<T: Send>(
    n: usize,
    rendezvous: bool,
    body: impl Fn(usize, Arc<ThreadComm>) -> T + Sync,
) -> (Vec<T>, Arc<Hub>) {
    let config = LocalConfig {
        timeout: Duration::from_secs(10),
        rendezvous,
    };
    let world = LocalWorld::with_config(n, config).expect("a local world of n > 0 ranks");
    let hub = Arc::new(Hub {
        stats: world.stats(),
    });
    let comms = world.communicators();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let body = &body;
                s.spawn(move || body(r, Arc::new(c)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    (out, hub)
}
