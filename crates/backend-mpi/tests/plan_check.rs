//! `build_collection`'s plan check on MPI: a plan that does not fit the world, and custom
//! embedding rules with one name but different behaviour, fail on every rank before any split
//! (no rank is left waiting in a split the others skip).

use backend_mpi::{mpi_test, MpiFactory, MpiRuntime};
use grid_core::{
    build_collection, Communicator, CommunicatorExt, EmbeddingFn, EmbeddingRule, Error,
    LayoutConfig, LayoutPlan, ReduceOp,
};
use std::sync::Arc;

/// The world still works on every rank (nobody is stuck in a collective).
fn world_usable(rt: &MpiRuntime) -> Result<(), String> {
    let w = rt.world();
    let mut s = [0i64];
    w.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if s[0] != w.size() as i64 {
        return Err(format!("world sum {} on {} ranks", s[0], w.size()));
    }
    Ok(())
}

mpi_test!(
    mpi_plan_larger_than_the_world_fails_every_rank_np4,
    np = 4,
    timeout = 60,
    |rt| {
        let w = rt.world();
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            ..LayoutConfig::new(8)
        })
        .map_err(|e| e.to_string())?;
        let factory = MpiFactory::new();
        match build_collection(&factory, w, &plan) {
            Err(Error::PlanDoesNotFit {
                world_size: 8,
                rank_offset: 0,
                parent_size: 4,
                missing: 4,
            }) => {}
            Err(e) => {
                return Err(format!(
                    "rank {}: expected PlanDoesNotFit, got {e}",
                    w.rank()
                ))
            }
            Ok(_) => {
                return Err(format!(
                    "rank {}: the plan of 8 ranks was accepted",
                    w.rank()
                ))
            }
        }
        let calls = factory.calls();
        if calls.splits + calls.creates != 0 {
            return Err(format!(
                "rank {}: communicators created: {calls:?}",
                w.rank()
            ));
        }
        world_usable(rt)
    }
);

mpi_test!(
    mpi_custom_rules_same_name_other_behaviour_fail_every_rank_np4,
    np = 4,
    timeout = 60,
    |rt| {
        let w = rt.world();
        // One name, two behaviours: rank 2 picks the last stage, everyone else the first.
        let rule: EmbeddingFn = if w.rank() == 2 {
            Arc::new(|g: &[usize]| vec![g[g.len() - 1]])
        } else {
            Arc::new(|g: &[usize]| vec![g[0]])
        };
        let plan = LayoutPlan::new(LayoutConfig {
            pp: 2,
            embedding: EmbeddingRule::Custom {
                name: "tied".into(),
                rule,
            },
            ..LayoutConfig::new(4)
        })
        .map_err(|e| e.to_string())?;
        let factory = MpiFactory::new();
        match build_collection(&factory, w, &plan) {
            Err(Error::PlanMismatch { mismatched, .. }) => {
                let want: Vec<usize> = if w.rank() == 2 {
                    vec![0, 1, 3]
                } else {
                    vec![2]
                };
                if mismatched != want {
                    return Err(format!(
                        "rank {}: mismatched {mismatched:?}, want {want:?}",
                        w.rank()
                    ));
                }
            }
            Err(e) => return Err(format!("rank {}: expected PlanMismatch, got {e}", w.rank())),
            Ok(_) => {
                return Err(format!(
                    "rank {}: the mismatched rules were accepted",
                    w.rank()
                ))
            }
        }
        let calls = factory.calls();
        if calls.splits + calls.creates != 0 {
            return Err(format!(
                "rank {}: communicators created: {calls:?}",
                w.rank()
            ));
        }
        world_usable(rt)
    }
);
