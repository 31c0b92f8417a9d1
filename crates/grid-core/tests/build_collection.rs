//! `build_collection` on the in-process backend (`backend-local`, ranks are threads): one split per
//! distinct family, reuse of identical families, no communicator outside a rank's groups, and
//! a plan mismatch that fails every rank instead of hanging.

use backend_local::{LocalComm, LocalConfig, LocalFactory, LocalWorld};
use grid_core::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Runs `body(rank, world)` on `n` threads sharing one world of the in-process backend.
fn run_ranks<T: Send + 'static>(
    n: usize,
    body: impl Fn(usize, LocalComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let config = LocalConfig {
        timeout: Duration::from_secs(10),
        rendezvous: false,
    };
    let comms = LocalWorld::with_config(n, config).unwrap().communicators();
    let body = Arc::new(body);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let body = body.clone();
            std::thread::spawn(move || body(r, c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn moe_plan() -> LayoutPlan {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        cp: 2,
        ep: 2,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(16)
    })
    .unwrap()
}

#[test]
fn builds_every_family_with_one_split_each() {
    let plan = moe_plan();
    let distinct: std::collections::HashSet<_> = plan
        .family_levels()
        .iter()
        .map(|f| plan.group_signature(*f).unwrap())
        .collect();
    let results = run_ranks(16, move |rank, world| {
        let plan = moe_plan();
        let factory = LocalFactory::new();
        let built = build_collection(&factory, &world, &plan).unwrap();
        // Every family the rank belongs to has a communicator over exactly the plan's group.
        for fl in plan.family_levels() {
            let want = plan.group_of(fl, rank).unwrap().map(|g| g.sorted());
            let got = match fl.family {
                Family::Hcp => built
                    .collection
                    .hcp
                    .as_ref()
                    .map(|h| h[fl.level].global_ranks().to_vec()),
                f => built
                    .collection
                    .get(f.name())
                    .unwrap()
                    .map(|c| c.global_ranks().to_vec()),
            };
            assert_eq!(got, want, "rank {rank} family {fl}");
        }
        // An all-reduce on each communicator sums the members' world ranks.
        for (name, entry) in built.collection.iter() {
            if let PgEntry::Group(c) = entry {
                let mut out = [0i64];
                c.all_reduce_into(&[rank as i64], &mut out, ReduceOp::Sum)
                    .unwrap();
                let want: usize = c.global_ranks().iter().sum();
                assert_eq!(out[0] as usize, want, "rank {rank} {name}");
            }
        }
        (
            factory.splits(),
            built.collective_calls,
            built.communicators_created(),
            built.stats,
        )
    });
    for (splits, calls, created, stats) in results {
        assert_eq!(splits, distinct.len(), "one split per distinct family");
        assert_eq!(calls, distinct.len() + 1, "plus the plan check");
        assert!(created <= distinct.len());
        // A reused family never creates a communicator and names an earlier family.
        for (i, s) in stats.iter().enumerate() {
            if let Some(from) = s.reused_from {
                assert_eq!(s.created, 0);
                assert!(stats[..i]
                    .iter()
                    .any(|e| e.family == from && e.reused_from.is_none()));
            }
        }
    }
}

#[test]
fn reuses_identical_families() {
    // cp = 1: dp_cp is dp, intra_dp_cp is dp_cp (one instance), ep and cp are singletons.
    let results = run_ranks(8, |_, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let built = build_collection(&LocalFactory::new(), &world, &plan).unwrap();
        let reused: HashMap<String, String> = built
            .stats
            .iter()
            .filter_map(|s| s.reused_from.map(|f| (s.family.to_string(), f.to_string())))
            .collect();
        let c = &built.collection;
        assert!(Arc::ptr_eq(
            c.dp.as_ref().unwrap(),
            c.dp_cp.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(
            c.dp_cp.as_ref().unwrap(),
            c.intra_dp_cp.as_ref().unwrap()
        ));
        reused
    });
    for r in results {
        assert_eq!(r["dp_cp"], "dp");
        assert_eq!(r["intra_dp_cp"], "dp");
        assert_eq!(r["ep"], "cp"); // both singletons
        assert_eq!(r["expt_tp"], "tp"); // etp = tp and ep = 1
        assert_eq!(r["tp_ep_pp"], "mp");
        assert_eq!(r["expt_dp"], "dp");
    }
}

#[test]
fn ranks_outside_the_layout_get_nothing_but_take_part() {
    let results = run_ranks(12, |rank, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            rank_offset: 4,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let built = build_collection(&LocalFactory::new(), &world, &plan).unwrap();
        (
            rank,
            built.collection.len(),
            built
                .collection
                .tp
                .as_ref()
                .map(|c| c.global_ranks().to_vec()),
        )
    });
    for (rank, n, tp) in results {
        if rank < 4 {
            assert_eq!((n, tp), (0, None));
        } else {
            assert!(n > 0);
            let base = rank - rank % 2;
            assert_eq!(tp, Some(vec![base, base + 1]));
        }
    }
}

#[test]
fn a_different_plan_on_one_rank_fails_every_rank() {
    let results = run_ranks(8, |rank, world| {
        let tp = if rank == 3 { 4 } else { 2 };
        let plan = LayoutPlan::new(LayoutConfig {
            tp,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        build_collection(&LocalFactory::new(), &world, &plan).err()
    });
    for (rank, err) in results.into_iter().enumerate() {
        match err {
            Some(Error::PlanMismatch { mismatched, .. }) => {
                if rank == 3 {
                    assert_eq!(mismatched.len(), 7);
                } else {
                    assert_eq!(mismatched, vec![3]);
                }
            }
            other => panic!("rank {rank}: expected PlanMismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_plan_larger_than_the_world_fails_every_rank_before_any_split() {
    let results = run_ranks(4, |_, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let factory = LocalFactory::new();
        let err = build_collection(&factory, &world, &plan).err();
        // Nobody is stuck in a split: the parent still works on every rank.
        let mut s = [0i64];
        world
            .all_reduce_into(&[1i64], &mut s, ReduceOp::Sum)
            .unwrap();
        (err, factory.splits(), s[0])
    });
    for (rank, (err, splits, sum)) in results.into_iter().enumerate() {
        match err {
            Some(Error::PlanDoesNotFit {
                world_size: 8,
                rank_offset: 0,
                parent_size: 4,
                missing: 4,
            }) => {}
            other => panic!("rank {rank}: expected PlanDoesNotFit, got {other:?}"),
        }
        assert_eq!(splits, 0, "rank {rank}: no split before the check");
        assert_eq!(sum, 4);
    }
}

#[test]
fn a_plan_whose_offset_runs_past_the_world_fails_every_rank() {
    let results = run_ranks(8, |_, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            rank_offset: 4,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let factory = LocalFactory::new();
        let err = build_collection(&factory, &world, &plan).err();
        (err.map(|e| e.to_string()), factory.splits())
    });
    for (rank, (err, splits)) in results.into_iter().enumerate() {
        let msg = err.unwrap_or_else(|| panic!("rank {rank}: the plan was accepted"));
        assert!(
            msg.contains("ranks 4..12") && msg.contains("8 ranks") && msg.contains("rank 8 "),
            "rank {rank}: {msg}"
        );
        assert_eq!(splits, 0);
    }
}

#[test]
fn same_name_custom_rules_with_different_behaviour_fail_every_rank() {
    let results = run_ranks(8, |rank, world| {
        // One name, two behaviours: rank 5 picks the last stage, everyone else the first.
        let rule: EmbeddingFn = if rank == 5 {
            Arc::new(|g: &[usize]| vec![g[g.len() - 1]])
        } else {
            Arc::new(|g: &[usize]| vec![g[0]])
        };
        let plan = LayoutPlan::new(LayoutConfig {
            pp: 4,
            embedding: EmbeddingRule::Custom {
                name: "tied".into(),
                rule,
            },
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let factory = LocalFactory::new();
        let err = build_collection(&factory, &world, &plan).err();
        (err, factory.splits())
    });
    for (rank, (err, splits)) in results.into_iter().enumerate() {
        match err {
            Some(Error::PlanMismatch { mismatched, .. }) => {
                if rank == 5 {
                    assert_eq!(mismatched.len(), 7);
                } else {
                    assert_eq!(mismatched, vec![5]);
                }
            }
            other => panic!("rank {rank}: expected PlanMismatch, got {other:?}"),
        }
        assert_eq!(splits, 0, "rank {rank}");
    }
}

#[test]
fn same_name_custom_rules_with_the_same_behaviour_build() {
    let results = run_ranks(8, |rank, world| {
        // Two closures, one behaviour (written differently on odd ranks).
        let rule: EmbeddingFn = if rank % 2 == 1 {
            Arc::new(|g: &[usize]| g[..1].to_vec())
        } else {
            Arc::new(|g: &[usize]| vec![g[0]])
        };
        let plan = LayoutPlan::new(LayoutConfig {
            pp: 4,
            embedding: EmbeddingRule::Custom {
                name: "tied".into(),
                rule,
            },
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let built = build_collection(&LocalFactory::new(), &world, &plan).unwrap();
        built
            .collection
            .embd
            .as_ref()
            .map(|c| c.global_ranks().to_vec())
    });
    for (rank, embd) in results.into_iter().enumerate() {
        // pp groups are {r, r + 2, r + 4, r + 6} for r in 0..2: the first stage is the group.
        let want = (rank < 2).then(|| vec![rank]);
        assert_eq!(embd, want, "rank {rank}");
    }
}
