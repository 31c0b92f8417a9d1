//! The shared conformance suite on the local backend at 1, 2, 4 and 8 ranks (threads).

use backend_local::{run, LocalComm, LocalConfig};
use grid_conformance::{run_with, Options};
use std::time::Duration;

fn conformance(ranks: usize) {
    let config = LocalConfig {
        timeout: Duration::from_secs(60),
        rendezvous: false,
    };
    let results = run(ranks, &config, |factory, world| {
        let opts = Options::<LocalComm> {
            finish: Some(Box::new(|c: &LocalComm| c.finish())),
            mismatch_check: Some(grid_conformance::comm_mismatch_check()),
            ..Default::default()
        };
        Ok(run_with(factory, &world, &opts))
    })
    .unwrap_or_else(|e| panic!("local run of {ranks} ranks failed: {e}"));
    let mut failed = Vec::new();
    for r in results {
        match r {
            Ok(report) => {
                assert!(report.passed() > 0, "{report}");
                println!("{report}");
            }
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
fn conformance_1_rank() {
    conformance(1);
}

#[test]
fn conformance_2_ranks() {
    conformance(2);
}

#[test]
fn conformance_4_ranks() {
    conformance(4);
}

#[test]
fn conformance_8_ranks() {
    conformance(8);
}
