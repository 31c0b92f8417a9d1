//! The shared conformance suite (`grid-conformance`) on Gloo, ranks as threads.

use backend_gloo::{run_ranks, GlooConfig};
use grid_conformance::{run_with, Options};
use std::time::Duration;

fn conformance(n: usize) {
    let cfg = GlooConfig::new(format!("conformance{n}")).with_timeout(Duration::from_secs(60));
    let out = run_ranks(n, &cfg, |factory, world| {
        // Gloo has no finish operation; abort() is checked by the suite's lifecycle section.
        let opts = Options {
            mismatch_check: Some(grid_conformance::comm_mismatch_check()),
            ..Options::default()
        };
        Ok(run_with(factory, &world, &opts))
    })
    .unwrap();
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Ok(Ok(report)) => {
                assert!(report.passed() > 0, "rank {r}: nothing ran");
                if r == 0 {
                    eprintln!(
                        "{n} ranks: {} checks passed, {} skipped",
                        report.passed(),
                        report.skipped().len()
                    );
                    for s in report.skipped() {
                        eprintln!("  skipped {}: {:?}", s.name, s.outcome);
                    }
                }
            }
            Ok(Err(failure)) => panic!("{n} ranks, rank {r}: {failure}"),
            Err(e) => panic!("{n} ranks, rank {r}: {e}"),
        }
    }
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
