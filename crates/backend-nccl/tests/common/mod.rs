//! Running ranks on GPUs: one thread per GPU, bootstrapped in memory.

#![allow(dead_code)]

use backend_nccl::inproc::InProcess;
use backend_nccl::{probe, NcclCommunicator, NcclFactory, NcclOptions};
use std::time::Duration;

/// The number of GPUs, or prints `SKIPPED: <reason>` and returns `None`.
pub fn gpus_or_skip(test: &str, min: usize) -> Option<usize> {
    match probe::gpu_count() {
        Ok(n) if n >= min => Some(n),
        Ok(n) => {
            println!("SKIPPED: {test}: needs {min} GPUs, found {n}");
            None
        }
        Err(e) => {
            println!("SKIPPED: {test}: no usable GPU: {e}");
            None
        }
    }
}

/// Runs `f` on `n` ranks (rank `i` on GPU `i`), each with its own factory and world
/// communicator; results in rank order. A rank that fails to initialise aborts the test.
pub fn on_gpus<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(&NcclFactory, &NcclCommunicator) -> T + Sync,
) -> Vec<T> {
    let boots = InProcess::world_with_timeout(n, Duration::from_secs(120));
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let f = &f;
                s.spawn(move || {
                    let opts = NcclOptions {
                        device: Some(i),
                        timeout,
                        ..NcclOptions::default()
                    };
                    let (factory, world) = match NcclFactory::init(b, opts) {
                        Ok(v) => v,
                        Err(e) => panic!("rank {i}: NcclFactory::init failed: {e}"),
                    };
                    f(&factory, &world)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}
