//! The initialisation plan (`InitPlan`) against what `build_collection` actually does on the
//! in-process backend: the same splits, in the same order, with the same colours and keys, the
//! same plan check, the same communicators; and `verify_plan` on large simulated worlds.

use backend_local::{LocalComm, LocalConfig, LocalFactory, LocalWorld};
use grid_core::*;
use proptest::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A factory that records every split (colour, key) it is asked for, then lets the in-process
/// backend do it.
#[derive(Default)]
struct Recording {
    inner: LocalFactory,
    splits: Mutex<Vec<(Option<u32>, usize)>>,
}

impl GroupFactory for Recording {
    type Comm = LocalComm;
    fn split(
        &self,
        parent: &LocalComm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<LocalComm>> {
        if let Ok(mut s) = self.splits.lock() {
            s.push((color, key));
        }
        self.inner.split(parent, color, key)
    }
}

/// What one rank did: its splits, the collective operations logged on the parent, and the
/// communicators it got (sorted members), one per created communicator in creation order.
#[derive(Debug)]
struct Observed {
    splits: Vec<(Option<u32>, usize)>,
    parent_ops: Vec<String>,
    created: Vec<Vec<usize>>,
    calls_reported: usize,
}

/// Runs `build_collection` of `plan` on `parent_size` threads of the in-process backend.
fn observe(plan: &LayoutPlan, parent_size: usize) -> Vec<Observed> {
    // Every communicator logs its operations (the first call wins; all calls ask the same).
    let _ = Recorder::set_global(Recorder::new(None, 4096).unwrap());
    assert!(Recorder::global().is_recording());
    let config = LocalConfig {
        timeout: Duration::from_secs(20),
        rendezvous: false,
    };
    let comms = LocalWorld::with_config(parent_size, config)
        .unwrap()
        .communicators();
    let plan = Arc::new(plan.clone());
    let handles: Vec<_> = comms
        .into_iter()
        .map(|world| {
            let plan = plan.clone();
            std::thread::spawn(move || {
                let factory = Recording::default();
                let built = build_collection(&factory, &world, &plan).unwrap();
                let parent_ops = world
                    .op_log()
                    .map(|l| l.snapshot().records.iter().map(|r| r.op.clone()).collect())
                    .unwrap_or_default();
                let mut created = Vec::new();
                let mut seen: Vec<*const LocalComm> = Vec::new();
                let mut note = |c: &Arc<LocalComm>| {
                    let p = Arc::as_ptr(c);
                    if !seen.contains(&p) {
                        seen.push(p);
                        created.push(c.global_ranks().to_vec());
                    }
                };
                // Creation order is Megatron's family order: walk the stats, not the fields.
                for s in &built.stats {
                    if s.created == 0 {
                        continue;
                    }
                    let fl = s.family;
                    let comm = if fl.family == Family::Hcp {
                        built.collection.hcp.as_ref().map(|h| h[fl.level].clone())
                    } else {
                        built.collection.get(fl.family.name()).unwrap().cloned()
                    };
                    if let Some(c) = comm {
                        note(&c);
                    }
                }
                let splits = factory.splits.lock().unwrap().clone();
                Observed {
                    splits,
                    parent_ops,
                    created,
                    calls_reported: built.collective_calls,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Compares the plan of every rank with what `build_collection` did.
fn check_against_backend(plan: &LayoutPlan) {
    let off = plan.rank_offset();
    let parent_size = off + plan.world_size();
    let init = InitPlan::new(plan, Creation::Split).unwrap();
    let observed = observe(plan, parent_size);
    for (rank, o) in observed.iter().enumerate() {
        // One plan check: the all-gather is the only operation on the parent's log.
        assert_eq!(o.parent_ops, vec!["all_gather".to_string()], "rank {rank}");
        assert_eq!(o.splits.len() + 1, o.calls_reported, "rank {rank}");
        if !plan.contains(rank) {
            // Outside the plan: in every split, with no colour.
            assert_eq!(o.splits.len(), init.shared().len(), "rank {rank}");
            assert!(o.splits.iter().all(|(c, _)| c.is_none()), "rank {rank}");
            continue;
        }
        let p = init.rank(rank).unwrap();
        assert_eq!(p.collective_calls, o.calls_reported, "rank {rank}");
        assert_eq!(p.calls[0].op, CallOp::PlanCheck);
        let planned: Vec<(Option<u32>, usize)> = p.calls[1..]
            .iter()
            .map(|c| {
                assert_eq!(c.op, CallOp::Split);
                (c.colour.map(|x| x as u32), c.key.unwrap())
            })
            .collect();
        assert_eq!(
            planned, o.splits,
            "rank {rank}: splits (colour, key) in order"
        );
        assert_eq!(p.communicators, o.created.len(), "rank {rank}");
        // Each planned communicator is the one the backend created: same size, same members.
        let planned_comms: Vec<&InitCall> = p
            .calls
            .iter()
            .filter(|c| c.communicator.is_some())
            .collect();
        for (c, got) in planned_comms.iter().zip(&o.created) {
            let info = c.communicator.unwrap();
            assert_eq!(info.size, got.len(), "rank {rank} {:?}", c.families);
            assert_eq!(got[info.group_rank], rank, "rank {rank} {:?}", c.families);
            let want = plan
                .group_of(c.families[0], rank)
                .unwrap()
                .unwrap()
                .sorted();
            assert_eq!(&want, got, "rank {rank} {:?}", c.families);
        }
        // Members-only: the same communicators, one creation each, no call where no group.
        let m = InitPlan::new(plan, Creation::MembersOnly)
            .unwrap()
            .rank(rank)
            .unwrap();
        assert_eq!(m.communicators, p.communicators);
        assert_eq!(m.collective_calls, 1 + p.communicators);
        assert!(m.calls[1..]
            .iter()
            .all(|c| c.op == CallOp::Create && c.participants == c.communicator.unwrap().size));
    }
}

fn cfg(world: usize, f: impl FnOnce(&mut LayoutConfig)) -> LayoutPlan {
    let mut c = LayoutConfig::new(world);
    f(&mut c);
    LayoutPlan::new(c).unwrap()
}

#[test]
fn the_plan_is_what_build_collection_does() {
    let layouts = [
        // The README's demo layout at 64 ranks.
        cfg(64, |c| {
            (c.tp, c.pp, c.cp, c.ep, c.etp, c.dist_opt_instances) = (2, 2, 2, 4, Some(1), 2)
        }),
        cfg(8, |c| (c.tp, c.pp) = (2, 2)),
        cfg(16, |c| (c.pp, c.cp, c.hcp_sizes) = (2, 4, Some(vec![2, 2]))),
        cfg(12, |c| {
            (c.tp, c.pp, c.order, c.rank_offset) = (2, 3, "tp-pp-dp".into(), 3)
        }),
        cfg(8, |c| {
            c.pp = 4;
            c.embedding = EmbeddingRule::Stages(vec![0, 2, -1]);
        }),
        cfg(4, |_| {}),
    ];
    for plan in &layouts {
        check_against_backend(plan);
    }
}

/// A random valid layout of at most 24 ranks (ranks are threads here).
fn small_plan() -> impl Strategy<Value = LayoutPlan> {
    let orders = prop::sample::select(vec![
        "tp-cp-ep-dp-pp",
        "tp-cp-ep-pp-dp",
        "tp-dp-cp-ep-pp",
        "cp-tp-ep-dp-pp",
        "tp-pp-cp-ep-dp",
        "ep-tp-cp-dp-pp",
    ]);
    (
        prop::sample::select(vec![1usize, 2, 4]),
        prop::sample::select(vec![1usize, 2, 3]),
        prop::sample::select(vec![1usize, 2, 4]),
        prop::sample::select(vec![1usize, 2, 4]),
        prop::sample::select(vec![1usize, 2]),
        1usize..=3,
        prop::sample::select(vec![1usize, 2]),
        orders,
        0usize..3,
        any::<bool>(),
    )
        .prop_filter_map(
            "invalid or too large",
            |(tp, pp, cp, ep, etp, dpm, ndo, order, off, hcp)| {
                let world = tp * pp * cp * dpm * ep * etp;
                if world > 24 {
                    return None;
                }
                let cfg = LayoutConfig {
                    tp,
                    pp,
                    cp,
                    ep,
                    etp: Some(etp),
                    order: order.to_string(),
                    dist_opt_instances: ndo,
                    hcp_sizes: (hcp && cp == 4).then(|| vec![2, 2]),
                    rank_offset: off,
                    ..LayoutConfig::new(world)
                };
                LayoutPlan::new(cfg).ok()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn random_layouts_match_the_backend(plan in small_plan()) {
        check_against_backend(&plan);
        let v = verify_plan(&plan, Creation::Split).unwrap();
        prop_assert_eq!(v.ranks, plan.world_size());
        prop_assert_eq!(v.calls_per_rank.0, v.calls_per_rank.1);
        verify_plan(&plan, Creation::MembersOnly).unwrap();
    }
}

#[test]
fn the_summary_adds_up_the_ranks() {
    let plan = cfg(64, |c| {
        (c.tp, c.pp, c.cp, c.ep, c.etp, c.dist_opt_instances) = (2, 2, 2, 4, Some(1), 2)
    });
    for creation in [Creation::Split, Creation::MembersOnly] {
        let init = InitPlan::new(&plan, creation).unwrap();
        let s = init.summary().unwrap();
        let per: Vec<RankInitPlan> = (0..64).map(|r| init.rank(r).unwrap()).collect();
        let comms: Vec<usize> = per.iter().map(|p| p.communicators).collect();
        let calls: Vec<usize> = per.iter().map(|p| p.collective_calls).collect();
        assert_eq!(s.communicators.min, *comms.iter().min().unwrap());
        assert_eq!(s.communicators.max, *comms.iter().max().unwrap());
        assert_eq!(s.communicators.total, comms.iter().sum::<usize>() as u64);
        assert_eq!(comms[s.communicators.max_rank], s.communicators.max);
        assert_eq!(comms[s.communicators.min_rank], s.communicators.min);
        assert_eq!(s.calls.total, calls.iter().sum::<usize>() as u64);
        // Members of each shared communicator = ranks that got it.
        for (i, sh) in s.shared.iter().enumerate() {
            let got = per
                .iter()
                .filter(|p| {
                    p.calls
                        .iter()
                        .any(|c| c.families == sh.families && c.communicator.is_some())
                })
                .count();
            assert_eq!(sh.members, got, "shared {i} {:?}", sh.families);
        }
        // Embedding groups (first and last stage) are not every rank's.
        let embd = s
            .shared
            .iter()
            .find(|sh| sh.families.contains(&Family::Embd.into()))
            .unwrap();
        assert_eq!(embd.members, 64);
        assert_eq!(embd.group_size, Some(2));
    }
    // The demo layout at 64: 1 plan check + one split per distinct family on every rank.
    let s = InitPlan::new(&plan, Creation::Split)
        .unwrap()
        .summary()
        .unwrap();
    assert_eq!(s.calls.min, s.calls.max);
    assert_eq!(s.calls.min, 1 + s.shared.len());
}

#[test]
fn one_rank_of_a_million_in_milliseconds() {
    let plan = cfg(1 << 20, |c| {
        (c.tp, c.pp, c.cp, c.ep, c.etp, c.dist_opt_instances) = (2, 2, 2, 4, Some(1), 2)
    });
    let init = InitPlan::new(&plan, Creation::Split).unwrap();
    let t = Instant::now();
    let p = init.rank(777_777).unwrap();
    let took = t.elapsed();
    assert_eq!(p.collective_calls, 1 + init.shared().len());
    // Generous for a debug build on a loaded machine; the release figure is in the docs.
    assert!(took < Duration::from_millis(200), "{took:?}");
}

#[test]
fn verify_passes_on_large_worlds_of_several_layouts() {
    // Debug build: 8,192 ranks each (131,072 in release: docs/grid-command.md).
    let layouts = [
        cfg(1 << 13, |c| {
            (c.tp, c.pp, c.cp, c.ep, c.etp, c.dist_opt_instances) = (2, 2, 2, 4, Some(1), 2)
        }),
        cfg(1 << 13, |c| {
            (c.tp, c.pp, c.cp, c.hcp_sizes) = (8, 4, 4, Some(vec![2, 2]))
        }),
        cfg(1 << 13, |c| {
            (c.tp, c.pp, c.order) = (2, 4, "tp-pp-dp".into())
        }),
        cfg(1 << 13, |c| {
            (c.tp, c.pp, c.ep, c.dist_opt_instances) = (4, 8, 8, 4)
        }),
    ];
    for plan in &layouts {
        for creation in [Creation::Split, Creation::MembersOnly] {
            let v = verify_plan(plan, creation).unwrap();
            assert_eq!(v.ranks, 1 << 13);
            assert!(v.memberships_checked >= (1u64 << 13) * v.splits_checked as u64 / 2);
        }
    }
}

#[test]
fn verify_finds_a_rule_that_ranks_would_disagree_on() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // A custom embedding rule that answers differently from call to call: the groups the plan
    // lists and the colours ranks compute on their own disagree, which verify must report.
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    let rule: EmbeddingFn = Arc::new(move |g: &[usize]| {
        if c2.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
            vec![g[0]]
        } else {
            vec![g[g.len() - 1]]
        }
    });
    let plan = cfg(16, |c| {
        c.pp = 4;
        c.embedding = EmbeddingRule::Custom {
            name: "flaky".into(),
            rule,
        };
    });
    let err = verify_plan(&plan, Creation::Split).unwrap_err().to_string();
    assert!(err.contains("embd"), "{err}");
}

#[test]
fn ranks_outside_the_plan_are_errors() {
    let plan = cfg(8, |c| (c.tp, c.rank_offset) = (2, 4));
    let init = InitPlan::new(&plan, Creation::Split).unwrap();
    let err = init.rank(2).unwrap_err().to_string();
    assert!(err.contains('2') && err.contains("4"), "{err}");
    assert!(init.rank(12).is_err());
    assert!(init.rank(11).is_ok());
}
