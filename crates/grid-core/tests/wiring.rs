//! The optimizer and DDP wiring (`use_mpu_process_groups`, `setup_process_groups_for_optimizer`,
//! `setup_process_groups_for_ddp`): Megatron's checks, fallbacks and errors on membership
//! groups, and the same code on live communicators of the in-process backend.

use backend_local::{LocalComm, LocalConfig, LocalFactory, LocalWorld};
use grid_core::*;
use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

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

fn plain_plan() -> LayoutPlan {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap()
}

const DIST_OPT_2: DdpSettings = DdpSettings {
    num_distributed_optimizer_instances: 2,
    use_distributed_optimizer: true,
};

fn opt(cp: usize, ddp: Option<DdpSettings>) -> OptimizerWiring {
    OptimizerWiring {
        context_parallel_size: cp,
        ddp,
        use_gloo_process_groups: false,
    }
}

fn members(g: &Option<Group>) -> Option<Vec<usize>> {
    g.as_ref().map(|g| g.to_vec())
}

fn family(plan: &LayoutPlan, f: Family, rank: usize) -> Option<Vec<usize>> {
    plan.group_of(f.into(), rank).unwrap().map(|g| g.to_vec())
}

#[test]
fn optimizer_and_ddp_groups_are_the_plans_families_on_every_rank() {
    let plan = moe_plan();
    for rank in 0..16 {
        let pgs =
            use_mpu_process_groups(&plan.rank_view(rank).unwrap().collection(), None).unwrap();
        let o = setup_process_groups_for_optimizer(&pgs, &opt(2, Some(DIST_OPT_2))).unwrap();
        let f = |x| family(&plan, x, rank);
        assert_eq!(members(&o.dp), f(Family::Dp));
        assert_eq!(members(&o.dp_cp), f(Family::DpCp));
        assert_eq!(members(&o.intra_dp_cp), f(Family::IntraDpCp));
        assert_eq!(members(&o.expt_dp), f(Family::ExptDp));
        assert_eq!(members(&o.intra_expt_dp), f(Family::IntraExptDp));
        assert_eq!(members(&o.mp), f(Family::Mp));
        assert_eq!(members(&o.expt_tp_pp), f(Family::TpEpPp));
        assert_eq!(members(&o.inter_dist_opt), f(Family::InterDistOpt));
        assert_eq!(members(&o.intra_dist_opt), f(Family::IntraDistOpt));
        assert!(o.inter_dist_opt.is_some() && o.intra_dp_cp != o.dp_cp);
        assert!(o.intra_dp_cp_gloo.is_none() && o.intra_expt_dp_gloo.is_none());

        let wiring = DdpWiring {
            context_parallel_size: 2,
            ddp: DIST_OPT_2,
        };
        let d =
            setup_process_groups_for_ddp(&pgs, &wiring, || panic!("expt_dp is provided")).unwrap();
        assert_eq!(members(&d.dp_cp), f(Family::DpCp));
        assert_eq!(Some(d.expt_dp.to_vec()), f(Family::ExptDp));
        assert!(!d.expt_dp_is_singleton);
        assert_eq!(members(&d.intra_dp_cp), f(Family::IntraDpCp));
        assert_eq!(members(&d.intra_expt_dp), f(Family::IntraExptDp));
        assert_eq!(members(&d.inter_dist_opt), f(Family::InterDistOpt));
        assert_eq!(members(&d.tp), f(Family::Tp));
        assert_eq!(members(&d.pp), f(Family::Pp));
        assert_eq!(members(&d.ep), f(Family::Ep));
    }
}

#[test]
fn one_instance_and_no_context_parallelism_fall_back_as_megatron_does() {
    let plan = plain_plan();
    let full = plan.rank_view(5).unwrap().collection();
    // dp_cp absent with cp = 1: it is dp.
    let pgs = use_mpu_process_groups(
        &full,
        Some(&["dp", "expt_dp", "mp", "tp_ep_pp", "tp", "pp", "ep"]),
    )
    .unwrap();
    let one = DdpSettings {
        num_distributed_optimizer_instances: 1,
        use_distributed_optimizer: false,
    };
    let o = setup_process_groups_for_optimizer(&pgs, &opt(1, Some(one))).unwrap();
    assert_eq!(members(&o.dp), Some(vec![5, 7]));
    assert_eq!(o.dp_cp, o.dp);
    assert_eq!(o.intra_dp_cp, o.dp);
    assert_eq!(o.intra_expt_dp, o.expt_dp);
    assert!(o.inter_dist_opt.is_none() && o.intra_dist_opt.is_none());
    // No ddp config at all: the same fallbacks, and no intra_dist_opt.
    let o2 = setup_process_groups_for_optimizer(&pgs, &opt(1, None)).unwrap();
    assert_eq!(o2, o);
    // DDP: the same fallbacks.
    let wiring = DdpWiring {
        context_parallel_size: 1,
        ddp: one,
    };
    let d = setup_process_groups_for_ddp(&pgs, &wiring, || panic!("not needed")).unwrap();
    assert_eq!(d.dp_cp, d.dp);
    assert_eq!(d.intra_dp_cp, d.dp);
    assert_eq!(d.intra_expt_dp.as_ref(), Some(&d.expt_dp));
    assert!(d.inter_dist_opt.is_none());
}

#[test]
fn missing_groups_are_named() {
    let plan = moe_plan();
    let full = plan.rank_view(3).unwrap().collection();
    // Everything but `drop`: the dropped groups are absent, as if never set.
    let without = |drop: &[&str]| {
        let names: Vec<&str> = ProcessGroupCollection::<Group>::FIELDS
            .iter()
            .copied()
            .filter(|n| !drop.contains(n))
            .collect();
        use_mpu_process_groups(&full, Some(&names)).unwrap()
    };
    let err = |p: &ProvidedGroups<Group>, w: &OptimizerWiring| {
        setup_process_groups_for_optimizer(p, w)
            .unwrap_err()
            .to_string()
    };
    let w = opt(2, Some(DIST_OPT_2));
    assert_eq!(
        err(&without(&["dp"]), &w),
        "setup_process_groups_for_optimizer: the dp process group is required but not provided \
         in the collection: it is always required"
    );
    assert_eq!(
        err(&without(&["dp_cp"]), &w),
        "setup_process_groups_for_optimizer: the dp_cp process group is required but not \
         provided in the collection: it is required when context_parallel_size > 1 (it is 2); \
         without context parallelism it falls back to dp"
    );
    assert_eq!(
        err(&without(&["expt_dp"]), &w),
        "setup_process_groups_for_optimizer: the expt_dp process group is required but not \
         provided in the collection: set it explicitly to none (ProvidedGroups::with_none) if \
         you don't need it"
    );
    assert_eq!(
        err(&without(&["intra_dp_cp", "inter_dist_opt"]), &w),
        "setup_process_groups_for_optimizer: the intra_dp_cp, inter_dist_opt process group is \
         required but not provided in the collection: intra_dp_cp, intra_expt_dp, \
         inter_dist_opt and intra_dist_opt are required with 2 distributed-optimizer instances \
         (> 1)"
    );
    let one_dist = opt(
        2,
        Some(DdpSettings {
            num_distributed_optimizer_instances: 1,
            use_distributed_optimizer: true,
        }),
    );
    assert!(err(&without(&["intra_dist_opt"]), &one_dist)
        .contains("the intra_dist_opt process group is required"));
    assert!(err(&without(&["mp"]), &w).contains("the mp process group is required"));
    assert!(err(&without(&["tp_ep_pp"]), &w).contains("the tp_ep_pp process group is required"));
    let gloo = OptimizerWiring {
        use_gloo_process_groups: true,
        ..w
    };
    assert_eq!(
        err(&without(&[]), &gloo),
        "setup_process_groups_for_optimizer: Gloo process groups are not supported when a \
         collection is provided: set use_gloo_process_groups to false"
    );
    // Megatron's category for these is ValueError.
    let e = setup_process_groups_for_optimizer(&without(&["dp"]), &w).unwrap_err();
    assert_eq!(e.megatron_category(), Some("ValueError"));
    // Zero instances is rejected before anything else.
    let zero = opt(
        2,
        Some(DdpSettings {
            num_distributed_optimizer_instances: 0,
            use_distributed_optimizer: false,
        }),
    );
    assert_eq!(
        err(&without(&[]), &zero),
        "num_distributed_optimizer_instances must be a positive integer, got 0"
    );

    // DDP.
    let dw = DdpWiring {
        context_parallel_size: 2,
        ddp: DIST_OPT_2,
    };
    let derr = |p: &ProvidedGroups<Group>| {
        setup_process_groups_for_ddp(p, &dw, || Ok(Group::single(3)))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        derr(&without(&["pp", "ep"])),
        "setup_process_groups_for_ddp: the pp, ep process group is required but not provided \
         in the collection: tp, pp and ep are always required"
    );
    assert!(derr(&without(&["intra_expt_dp"])).contains("the intra_expt_dp process group"));
    assert!(derr(&without(&["dp"])).contains("the dp process group"));
}

#[test]
fn explicit_none_and_the_singleton_expert_dp_group() {
    let plan = plain_plan();
    let full = plan.rank_view(6).unwrap().collection();
    let some =
        use_mpu_process_groups(&full, Some(&["dp", "mp", "tp_ep_pp", "tp", "pp", "ep"])).unwrap();
    // Optimizer: expt_dp absent is an error, explicitly none is fine (and stays none).
    assert!(setup_process_groups_for_optimizer(&some, &opt(1, None)).is_err());
    let none = some.clone().with_none("expt_dp").unwrap();
    let o = setup_process_groups_for_optimizer(&none, &opt(1, None)).unwrap();
    assert!(o.expt_dp.is_none() && o.intra_expt_dp.is_none());
    // DDP: absent or none both get a new group of this rank alone, made once.
    let wiring = DdpWiring {
        context_parallel_size: 1,
        ddp: DdpSettings::default(),
    };
    for p in [&some, &none] {
        let calls = Cell::new(0);
        let d = setup_process_groups_for_ddp(p, &wiring, || {
            calls.set(calls.get() + 1);
            Ok(Group::single(6))
        })
        .unwrap();
        assert_eq!(calls.get(), 1);
        assert!(d.expt_dp_is_singleton);
        assert_eq!(d.expt_dp.to_vec(), vec![6]);
        assert_eq!(d.intra_expt_dp, Some(Group::single(6)));
    }
    // A failing singleton maker fails the call.
    let e = setup_process_groups_for_ddp(&some, &wiring, || Err(Error::Invalid("no".into())));
    assert_eq!(e.unwrap_err().to_string(), "no");
    // with_none refuses a set group and unknown names.
    assert_eq!(
        some.clone().with_none("dp").unwrap_err().to_string(),
        "ProvidedGroups::with_none: the dp group is set; a field is either a group or explicitly none"
    );
    assert!(some.clone().with_none("nope").is_err());
}

#[test]
fn use_mpu_process_groups_names_every_invalid_group() {
    let full = plain_plan().rank_view(0).unwrap().collection();
    let e = use_mpu_process_groups(&full, Some(&["tp", "gtp_remat", "xx"])).unwrap_err();
    assert_eq!(e.megatron_category(), Some("ValueError"));
    let text = e.to_string();
    assert!(
        text.starts_with(
            "use_mpu_process_groups: invalid process groups requested: [\"gtp_remat\", \"xx\"] (valid names: tp, pp,"
        ),
        "{text}"
    );
    // Megatron returns None for dp_cp_ag and expt_dp_ag, and for groups a rank is not in.
    let p = use_mpu_process_groups(
        &full,
        Some(&["dp_cp_ag", "expt_dp_ag", "inter_dist_opt", "hcp"]),
    )
    .unwrap();
    assert_eq!(
        p.explicit_none(),
        vec!["dp_cp_ag", "expt_dp_ag", "hcp", "inter_dist_opt"]
    );
    assert!(p.collection().is_empty());
}

/// Runs `body(rank, world)` on `n` threads sharing one world of the in-process backend.
fn run_ranks<T: Send + 'static>(
    n: usize,
    body: impl Fn(usize, LocalComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let config = LocalConfig {
        timeout: Duration::from_secs(20),
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

/// The sorted members of a plan family (communicator ranks are torch's sorted order).
fn sorted(plan: &LayoutPlan, f: Family, rank: usize) -> Vec<usize> {
    let mut m = family(plan, f, rank).expect("a member");
    m.sort_unstable();
    m
}

fn sum_over(c: &LocalComm, rank: usize) -> i64 {
    let mut s = [0i64];
    c.all_reduce_into(&[rank as i64], &mut s, ReduceOp::Sum)
        .unwrap();
    s[0]
}

#[test]
fn live_communicators_of_the_in_process_backend() {
    let out = run_ranks(16, |rank, world| {
        let plan = moe_plan();
        let factory = LocalFactory::new();
        let built = build_collection(&factory, &world, &plan).unwrap();
        let pgs = use_mpu_process_groups(&built.collection, None).unwrap();
        let o = setup_process_groups_for_optimizer(&pgs, &opt(2, Some(DIST_OPT_2))).unwrap();
        let checks: [(&str, &Option<Arc<LocalComm>>, Family); 9] = [
            ("dp", &o.dp, Family::Dp),
            ("dp_cp", &o.dp_cp, Family::DpCp),
            ("intra_dp_cp", &o.intra_dp_cp, Family::IntraDpCp),
            ("expt_dp", &o.expt_dp, Family::ExptDp),
            ("intra_expt_dp", &o.intra_expt_dp, Family::IntraExptDp),
            ("mp", &o.mp, Family::Mp),
            ("expt_tp_pp", &o.expt_tp_pp, Family::TpEpPp),
            ("inter_dist_opt", &o.inter_dist_opt, Family::InterDistOpt),
            ("intra_dist_opt", &o.intra_dist_opt, Family::IntraDistOpt),
        ];
        for (name, comm, f) in checks {
            let comm = comm
                .as_ref()
                .unwrap_or_else(|| panic!("rank {rank}: no {name}"));
            let want = sorted(&plan, f, rank);
            assert_eq!(comm.global_ranks(), &want[..], "rank {rank} {name}");
            assert_eq!(
                sum_over(comm, rank),
                want.iter().sum::<usize>() as i64,
                "rank {rank} {name}"
            );
        }
        // The wiring hands out the collection's communicators, not copies.
        assert!(Arc::ptr_eq(
            o.dp_cp.as_ref().unwrap(),
            built.collection.dp_cp.as_ref().unwrap()
        ));
        // One optimizer instance on a collection without dp_cp: the fallbacks are dp's
        // communicator itself (cp = 1 is what the caller declares; this layout's dp and dp_cp
        // differ, so the fallback is visible).
        let no_dp_cp = use_mpu_process_groups(
            &built.collection,
            Some(&["dp", "expt_dp", "mp", "tp_ep_pp", "tp", "pp", "ep"]),
        )
        .unwrap();
        let o1 = setup_process_groups_for_optimizer(&no_dp_cp, &opt(1, None)).unwrap();
        assert!(Arc::ptr_eq(
            o1.dp_cp.as_ref().unwrap(),
            o1.dp.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(
            o1.intra_dp_cp.as_ref().unwrap(),
            o1.dp.as_ref().unwrap()
        ));
        // DDP without expt_dp: every rank makes its own one-rank communicator (a split of the
        // world with one colour per rank, collective like torch's new_group).
        let no_expt =
            use_mpu_process_groups(&built.collection, Some(&["dp", "tp", "pp", "ep"])).unwrap();
        let wiring = DdpWiring {
            context_parallel_size: 1,
            ddp: DdpSettings::default(),
        };
        let d = setup_process_groups_for_ddp(&no_expt, &wiring, || {
            factory
                .split(&world, Some(rank as u32), rank)?
                .map(Arc::new)
                .ok_or_else(|| Error::Invalid("no singleton communicator".into()))
        })
        .unwrap();
        assert!(d.expt_dp_is_singleton);
        assert_eq!(d.expt_dp.global_ranks(), &[rank]);
        assert_eq!(sum_over(&d.expt_dp, rank), rank as i64);
        assert_eq!(
            d.tp.as_ref().unwrap().global_ranks(),
            &sorted(&plan, Family::Tp, rank)[..]
        );
        rank
    });
    assert_eq!(out, (0..16).collect::<Vec<_>>());
}

#[test]
fn hcp_can_be_explicitly_none_unless_set() {
    let plain = plain_plan().rank_view(0).unwrap().collection();
    let p = ProvidedGroups::new(plain).with_none("hcp").unwrap();
    assert_eq!(p.explicit_none(), vec!["hcp"]);
    let hier = LayoutPlan::new(LayoutConfig {
        cp: 4,
        hcp_sizes: Some(vec![2, 2]),
        ..LayoutConfig::new(8)
    })
    .unwrap();
    let with_levels = ProvidedGroups::new(hier.rank_view(0).unwrap().collection());
    assert!(with_levels.with_none("hcp").is_err());
}
