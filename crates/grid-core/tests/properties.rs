//! Property tests of the topology arithmetic.

use grid_core::*;
use proptest::prelude::*;
use std::collections::HashSet;

/// A random grid of 1..=4 dims with sizes 1..=4 and a small offset.
fn grid_strategy() -> impl Strategy<Value = HyperGrid> {
    (prop::collection::vec(1usize..=4, 1..=4), 0usize..20).prop_map(|(shape, off)| {
        let names: Vec<String> = (0..shape.len()).map(|i| format!("d{i}")).collect();
        HyperGrid::new(shape, &names, off).unwrap()
    })
}

/// A random valid layout: sizes chosen so the world divides.
fn plan_strategy() -> impl Strategy<Value = LayoutPlan> {
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
        1usize..=4,
        prop::sample::select(vec![1usize, 2]),
        orders,
        0usize..5,
        any::<bool>(),
    )
        .prop_filter_map(
            "invalid layout",
            |(tp, pp, cp, ep, etp, dpm, ndo, order, off, hcp)| {
                let world = tp * pp * cp * dpm * ep * etp;
                let hcp_sizes = (hcp && cp == 4).then(|| vec![2, 2]);
                let cfg = LayoutConfig {
                    tp,
                    pp,
                    cp,
                    ep,
                    etp: Some(etp),
                    order: order.to_string(),
                    dist_opt_instances: ndo,
                    hcp_sizes,
                    rank_offset: off,
                    ..LayoutConfig::new(world)
                };
                LayoutPlan::new(cfg).ok()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn coordinates_round_trip(g in grid_strategy()) {
        for r in g.offset()..g.offset() + g.size() {
            let c = g.coords(r).unwrap();
            prop_assert_eq!(g.rank_of(&c).unwrap(), r);
        }
        prop_assert!(g.coords(g.offset() + g.size()).is_err());
    }

    #[test]
    fn every_grid_family_partitions(g in grid_strategy(), bits in 0u32..16) {
        let n = g.shape().len();
        let dims: Vec<String> = (0..n).filter(|i| bits & (1 << i) != 0).map(|i| format!("d{i}")).collect();
        let groups = g.groups(&dims).unwrap();
        let mut seen = HashSet::new();
        for grp in groups.iter() {
            prop_assert!(grp.windows(2).all(|w| w[0] < w[1]), "group not ascending");
            for &r in grp { prop_assert!(seen.insert(r), "rank {} twice", r); }
        }
        prop_assert_eq!(seen.len(), g.size());
        // Per-rank lookup agrees with the enumeration, and positions invert.
        for grp in groups.iter() {
            for (i, &r) in grp.iter().enumerate() {
                let mine = g.group_of(r, &dims).unwrap();
                prop_assert_eq!(mine.to_vec(), grp.to_vec());
                prop_assert_eq!(mine.position(r), Some(i));
            }
        }
    }

    #[test]
    fn orthogonal_groups_meet_in_one_rank(g in grid_strategy(), a in 0u32..16, b in 0u32..16) {
        let n = g.shape().len();
        let a = a & ((1 << n) - 1);
        let b = b & ((1 << n) - 1) & !a; // disjoint dimension sets
        let da: Vec<String> = (0..n).filter(|i| a & (1 << i) != 0).map(|i| format!("d{i}")).collect();
        let db: Vec<String> = (0..n).filter(|i| b & (1 << i) != 0).map(|i| format!("d{i}")).collect();
        for r in g.offset()..g.offset() + g.size() {
            let ga: HashSet<usize> = g.group_of(r, &da).unwrap().iter().collect();
            let gb: HashSet<usize> = g.group_of(r, &db).unwrap().iter().collect();
            let both: Vec<usize> = ga.intersection(&gb).copied().collect();
            prop_assert_eq!(both, vec![r]);
        }
    }

    #[test]
    fn plan_families_partition_and_views_match(plan in plan_strategy()) {
        let off = plan.rank_offset();
        let w = plan.world_size();
        for fl in plan.family_levels() {
            let groups = plan.groups(fl).unwrap();
            prop_assert_eq!(groups.len(), plan.num_groups(fl).unwrap());
            let mut seen = HashSet::new();
            for g in groups.iter() {
                for &r in g {
                    prop_assert!(r >= off && r < off + w, "{} rank {} outside the layout", fl, r);
                    prop_assert!(seen.insert(r), "{}: rank {} twice", fl, r);
                }
            }
            let partial = matches!(fl.family, Family::Embd | Family::PosEmbd);
            if !partial {
                prop_assert_eq!(seen.len(), w, "{} does not cover the layout", fl);
            }
            for r in off..off + w {
                let idx = plan.group_index_of(fl, r).unwrap();
                let mine = plan.group_of(fl, r).unwrap();
                match (idx, mine) {
                    (Some(i), Some(g)) => {
                        let members = g.to_vec();
                        prop_assert_eq!(groups.get(i), members.as_slice());
                        prop_assert!(g.contains(r));
                    }
                    (None, None) => prop_assert!(!seen.contains(&r)),
                    other => prop_assert!(false, "{}: index/group disagree {:?}", fl, other),
                }
            }
        }
        // Families with the same signature have the same groups as sets on every rank.
        let fls = plan.family_levels();
        for (i, a) in fls.iter().enumerate() {
            for b in &fls[i + 1..] {
                if plan.group_signature(*a).unwrap() == plan.group_signature(*b).unwrap() {
                    for r in off..off + w {
                        let ga = plan.group_of(*a, r).unwrap().map(|g| g.sorted());
                        let gb = plan.group_of(*b, r).unwrap().map(|g| g.sorted());
                        prop_assert_eq!(ga, gb, "{} and {} share a signature", a, b);
                    }
                }
            }
        }
        // The dense and expert grids agree on pipeline groups; tp and dp meet in one rank.
        for r in off..off + w {
            let v = plan.rank_view(r).unwrap();
            let tp: HashSet<usize> = v.group(Family::Tp).unwrap().iter().collect();
            let dp: HashSet<usize> = v.group(Family::Dp).unwrap().iter().collect();
            prop_assert_eq!(tp.intersection(&dp).count(), 1);
            let pp = v.group(Family::Pp).unwrap();
            prop_assert_eq!(pp.get(v.coords.pp), r);
            prop_assert_eq!(v.is_first_stage, v.coords.pp == 0);
        }
    }
}

#[test]
fn fingerprint_distinguishes_plans() {
    let a = LayoutPlan::new(LayoutConfig {
        tp: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap();
    let b = LayoutPlan::new(LayoutConfig {
        pp: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap();
    let a2 = LayoutPlan::new(LayoutConfig {
        tp: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.fingerprint(), a2.fingerprint());
}

#[test]
fn fingerprint_covers_custom_rule_behaviour_cheaply_at_a_million_ranks() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let calls = Arc::new(AtomicUsize::new(0));
    // Picks the first stage everywhere, or the last stage on the last pipeline only.
    let rule = |odd_last: bool| {
        let calls = calls.clone();
        EmbeddingRule::Custom {
            name: "r".into(),
            rule: Arc::new(move |g: &[usize]| {
                calls.fetch_add(1, Ordering::Relaxed);
                if odd_last && g[0] == (1 << 20) / 2 - 1 {
                    vec![g[1]]
                } else {
                    vec![g[0]]
                }
            }),
        }
    };
    let plan = |r: EmbeddingRule| {
        LayoutPlan::new(LayoutConfig {
            pp: 2,
            embedding: r,
            ..LayoutConfig::new(1 << 20)
        })
        .unwrap()
    };
    let (a, b) = (plan(rule(false)), plan(rule(true)));
    let (fa, fb) = (a.fingerprint(), b.fingerprint());
    // The last pipeline is always in the sample.
    assert_ne!(fa, fb);
    assert_eq!(fa, plan(rule(false)).fingerprint());
    // A bounded sample: 2^19 pipelines, CUSTOM_RULE_SAMPLE calls per fingerprint.
    assert_eq!(calls.load(Ordering::Relaxed), 3 * CUSTOM_RULE_SAMPLE);
    // The position rule is unchanged and the default embedding rule costs no call.
    let d = plan(EmbeddingRule::Default);
    let before = calls.load(Ordering::Relaxed);
    assert_ne!(d.fingerprint(), fa);
    assert_eq!(calls.load(Ordering::Relaxed), before);
}

#[test]
fn dp_and_dp_cp_share_a_signature_when_cp_is_one() {
    let p = LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        ..LayoutConfig::new(16)
    })
    .unwrap();
    let s = |f: Family| p.group_signature(f.into()).unwrap();
    assert_eq!(s(Family::Dp), s(Family::DpCp));
    assert_eq!(s(Family::Cp), s(Family::Ep)); // both singletons
    assert_ne!(s(Family::Tp), s(Family::Dp));
}

#[test]
fn errors_name_the_problem() {
    let e = LayoutPlan::new(LayoutConfig {
        tp: 8,
        ..LayoutConfig::new(12)
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "world size 12 is not divisible by tp·pp·cp = 8·1·1 = 8"
    );
    let e = LayoutPlan::new(LayoutConfig {
        tp: 0,
        ..LayoutConfig::new(12)
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "tp must be a positive integer, got 0");
    let p = LayoutPlan::new(LayoutConfig::new(4)).unwrap();
    assert_eq!(
        p.rank_view(4).unwrap_err().to_string(),
        "rank 4 is outside the layout, which covers ranks 0..4 (end exclusive)"
    );
}

#[test]
fn custom_embedding_rule() {
    let mut cfg = LayoutConfig {
        pp: 4,
        ..LayoutConfig::new(8)
    };
    cfg.embedding = EmbeddingRule::Custom {
        name: "last-only".into(),
        rule: std::sync::Arc::new(|pp: &[usize]| vec![pp[pp.len() - 1]]),
    };
    let p = LayoutPlan::new(cfg.clone()).unwrap();
    assert_eq!(
        p.groups(Family::Embd.into()).unwrap().to_vecs(),
        vec![vec![6], vec![7]]
    );
    assert!(p.rank_view(0).unwrap().group(Family::Embd).is_none());
    cfg.embedding = EmbeddingRule::Custom {
        name: "bad".into(),
        rule: std::sync::Arc::new(|_: &[usize]| vec![99]),
    };
    let p = LayoutPlan::new(cfg).unwrap();
    assert!(matches!(
        p.groups(Family::Embd.into()),
        Err(Error::BadEmbeddingRule { .. })
    ));
}

#[test]
fn collection_from_view_and_display() {
    let p = LayoutPlan::new(LayoutConfig {
        tp: 2,
        cp: 4,
        hcp_sizes: Some(vec![2, 2]),
        ..LayoutConfig::new(16)
    })
    .unwrap();
    let c = p.rank_view(5).unwrap().collection();
    assert_eq!(c.tp.as_ref().unwrap().to_vec(), vec![4, 5]);
    assert_eq!(c.hcp.as_ref().unwrap().len(), 2);
    let s = c.to_string();
    assert!(s.starts_with("ProcessGroupCollection(tp(2), pp(1), mp(2), embd(1), pos_embd(1), cp(4), tp_cp(8), hcp([2, 2])"), "{s}");
    let built = ProcessGroupCollection::from_plan(&p, 5, |_, g| Ok(g.len())).unwrap();
    assert_eq!(built.tp, Some(2));
    assert_eq!(built.hcp, Some(vec![2, 2]));
    assert!(ProcessGroupCollection::<usize>::new().get("bogus").is_err());
    assert_eq!(
        ProcessGroupCollection::<Group>::new().to_string(),
        "ProcessGroupCollection(empty)"
    );
}
