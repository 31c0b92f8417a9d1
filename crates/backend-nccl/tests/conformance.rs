//! The shared conformance suite on NCCL, one rank per GPU (threads of this process,
//! bootstrapped in memory). Behind the `gpu-tests` feature (`cargo xtask test --gpu`); without a
//! usable GPU it prints `SKIPPED: <reason>` and returns.
#![cfg(feature = "gpu-tests")]

mod common;

use backend_nccl::NcclCommunicator;
use common::{gpus_or_skip, on_gpus};
use grid_conformance::{run_with, Options};
use std::time::Duration;

fn run(ranks: usize) {
    let results = on_gpus(ranks, Duration::from_secs(120), |factory, world| {
        // abort() is checked by the suite's lifecycle section on every backend.
        let opts = Options::<NcclCommunicator>::default();
        run_with(factory, world, &opts)
    });
    let mut failed = Vec::new();
    for r in results {
        match r {
            Ok(report) => println!("{report}"),
            Err(f) => failed.push(f.to_string()),
        }
    }
    assert!(
        failed.is_empty(),
        "conformance failed:\n{}",
        failed.join("\n")
    );
}

#[test]
fn nccl_conformance_all_gpus() {
    let Some(n) = gpus_or_skip("nccl_conformance_all_gpus", 1) else {
        return;
    };
    run(n);
}

#[test]
fn nccl_conformance_two_gpus() {
    let Some(n) = gpus_or_skip("nccl_conformance_two_gpus", 2) else {
        return;
    };
    if n == 2 {
        println!("NOT RUN: nccl_conformance_two_gpus: the all-GPU run already covers 2 ranks");
        return;
    }
    run(2);
}
