//! Running ranks on GPUs: one thread per GPU, bootstrapped over backend-local.

#![allow(dead_code)]

use backend_local::{LocalConfig, LocalWorld};
use backend_nccl::{probe, NcclCommunicator, NcclFactory, NcclOptions};
use std::sync::Mutex;
use std::time::Duration;

/// The number of GPUs, or `None` after printing why the test does not run:
/// * no usable GPU (driver, libnccl or device missing): `SKIPPED: <test>: no usable GPU: ...`,
///   and with `GRID_REQUIRE_GPU=1` the test fails instead, naming what is missing;
/// * fewer GPUs than the test's ranks: `NOT RUN: <test>: needs N GPUs, found M`. One GPU is
///   enough for the suite; more GPUs add the multi-rank tests, so this is not a skip (and
///   `cargo xtask test --gpu` reports it without failing).
pub fn gpus_or_skip(test: &str, min: usize) -> Option<usize> {
    match probe::gpu_count() {
        Ok(n) if n >= min => Some(n),
        Ok(n) => {
            println!("NOT RUN: {test}: needs {min} GPUs, found {n}");
            None
        }
        Err(e) => {
            if std::env::var("GRID_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: GRID_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            println!("SKIPPED: {test}: no usable GPU: {e}");
            None
        }
    }
}

/// The GPU tests of one test binary run one at a time (cargo runs tests on parallel threads;
/// two tests' ranks on one GPU would be two NCCL ranks per device, which the backend refuses).
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs `f` while holding [`SERIAL`] (for GPU tests that do not use [`on_gpus`]).
pub fn serialised<T>(f: impl FnOnce() -> T) -> T {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    f()
}

/// Runs `f` on `n` ranks (rank `i` on GPU `i`), each with its own factory and world
/// communicator; results in rank order. A rank that fails to initialise aborts the test. Holds
/// [`SERIAL`] throughout.
pub fn on_gpus<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(&NcclFactory, &NcclCommunicator) -> T + Sync,
) -> Vec<T> {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let config = LocalConfig {
        timeout: Duration::from_secs(120),
        ..LocalConfig::default()
    };
    let boots = match LocalWorld::with_config(n, config) {
        Ok(w) => w.communicators(),
        Err(e) => panic!("bootstrap world of {n} ranks: {e}"),
    };
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
