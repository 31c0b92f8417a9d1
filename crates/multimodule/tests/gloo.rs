//! The same data checks on the Gloo backend (ranks as threads of this process, TCP loopback).

mod common;
use backend_gloo::{run_ranks, GlooConfig};
use common::check::l3;
use common::check::{grid, plan_of, run_rank, world_of, Case, Layout};
use common::scenarios::{two_encoders_rank, two_encoders_spec, TWO_ENCODERS_PER_MB};
use grid_core::Communicator;
use multimodule::{BridgeCommunicator, DimMapping, PipelinePlan};
use std::sync::Arc;
use std::time::Duration;

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

fn gloo_case(job: &str, case: Case) -> usize {
    let plan = plan_of(&case);
    let res = run_ranks(world_of(&case), &cfg(job), |f, w| {
        let rank = w.rank();
        let bridge = BridgeCommunicator::new(f, Arc::new(w), plan.clone(), 40)
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        Ok(run_rank(&case, &bridge, rank))
    })
    .unwrap();
    res.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .sum()
}

fn case(
    src: grid_core::HyperGrid,
    dst: grid_core::HyperGrid,
    layout: Layout,
    batches: Vec<usize>,
    fused: bool,
) -> Case {
    Case {
        src,
        dst,
        layout,
        batches,
        microbatches: 3,
        fused,
        rendezvous: false,
    }
}

#[test]
fn gloo_bridges() {
    let l2 = Layout {
        ndim: 2,
        dm: DimMapping::default(),
        seq: 1,
        hidden: 4,
    };
    for (k, fused) in [false, true].into_iter().enumerate() {
        let j = |n: &str| format!("mm-{n}-{k}");
        // fan-in, fan-out, 1:1, pp on both sides, 2-D, uneven, non-dividing, cp, colocated.
        assert!(
            gloo_case(
                &j("fanin"),
                case(
                    grid(1, 1, 1, 4, 0),
                    grid(4, 1, 1, 1, 4),
                    l3(2),
                    vec![2; 4],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("fanout"),
                case(
                    grid(2, 1, 1, 2, 0),
                    grid(1, 1, 1, 4, 4),
                    l3(2),
                    vec![5, 5],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("one"),
                case(
                    grid(2, 1, 1, 1, 0),
                    grid(2, 1, 1, 1, 2),
                    l3(3),
                    vec![3],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("pp"),
                case(
                    grid(2, 1, 2, 1, 0),
                    grid(1, 1, 2, 2, 4),
                    l3(2),
                    vec![4],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("2d"),
                case(
                    grid(1, 1, 1, 4, 0),
                    grid(4, 1, 1, 1, 4),
                    l2,
                    vec![5; 4],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("lcm"),
                case(
                    grid(1, 1, 1, 3, 0),
                    grid(1, 1, 1, 2, 3),
                    l3(2),
                    vec![4; 3],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("cp"),
                case(
                    grid(1, 2, 2, 1, 0),
                    grid(2, 2, 1, 1, 4),
                    l3(6),
                    vec![3],
                    fused
                )
            ) > 0
        );
        assert!(
            gloo_case(
                &j("coloc"),
                case(
                    grid(2, 1, 1, 2, 0),
                    grid(1, 1, 1, 4, 0),
                    l3(2),
                    vec![4, 4],
                    fused
                )
            ) > 0
        );
    }
}

#[test]
fn gloo_two_encoders_llm_generator() {
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let n = 4;
    let res = run_ranks(8, &cfg("mm-two-enc"), |f, w| {
        let rank = w.rank();
        Ok(two_encoders_rank(f, Arc::new(w), &plan, rank, n))
    })
    .unwrap();
    let total: usize = res
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .sum();
    assert_eq!(total, n * TWO_ENCODERS_PER_MB);
}
