//! Ranks as threads of this process, meeting through the in-process store.

mod common;

use backend_gloo::{run_ranks, AllreduceAlgorithm, GlooConfig, ReduceScatterAlgorithm};
use std::time::Duration;

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

fn suite_at(n: usize, config: GlooConfig) {
    let results = run_ranks(n, &config, |_f, world| {
        common::suite(&world);
        Ok(())
    })
    .unwrap();
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r} of {n}: {e}"));
    }
}

#[test]
fn suite_1_rank() {
    suite_at(1, cfg("t1"));
}

#[test]
fn suite_2_ranks() {
    suite_at(2, cfg("t2"));
}

#[test]
fn suite_4_ranks() {
    suite_at(4, cfg("t4"));
}

#[test]
fn suite_8_ranks() {
    suite_at(8, cfg("t8"));
}

#[test]
fn suite_3_ranks_allreduce_algorithms() {
    suite_at(
        3,
        cfg("t3").with_reduce_scatter(ReduceScatterAlgorithm::Allreduce),
    );
    suite_at(4, cfg("t4b").with_allreduce(AllreduceAlgorithm::Bcube));
}
