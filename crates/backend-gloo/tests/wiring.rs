//! The optimizer and DDP wiring on live Gloo communicators from `build_collection` (ranks as
//! threads, in-process store): every group it hands out is the plan's group and carries a
//! correct all-reduce; the DDP fallback's one-rank expert-dp group is a real communicator.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{
    build_collection, setup_process_groups_for_ddp, setup_process_groups_for_optimizer,
    use_mpu_process_groups, Communicator, CommunicatorExt, DdpSettings, DdpWiring, Error, Family,
    GroupFactory, LayoutConfig, LayoutPlan, OptimizerWiring, ReduceOp,
};
use std::sync::Arc;
use std::time::Duration;

fn sorted(plan: &LayoutPlan, f: Family, rank: usize) -> Vec<usize> {
    let mut m = plan
        .group_of(f.into(), rank)
        .unwrap()
        .unwrap_or_else(|| panic!("rank {rank} is in no {f} group"))
        .to_vec();
    m.sort_unstable();
    m
}

fn check<C: Communicator + ?Sized>(name: &str, comm: Option<&Arc<C>>, want: &[usize], rank: usize) {
    let comm = comm.unwrap_or_else(|| panic!("rank {rank}: no {name} group"));
    assert_eq!(comm.global_ranks(), want, "rank {rank} {name}");
    let mut s = [0i64];
    comm.all_reduce_into(&[rank as i64], &mut s, ReduceOp::Sum)
        .unwrap();
    assert_eq!(
        s[0],
        want.iter().sum::<usize>() as i64,
        "rank {rank} {name}"
    );
}

#[test]
fn optimizer_and_ddp_wiring_on_gloo() {
    // tp 2, cp 2, ep 2 (etp 1) over 8 ranks with two distributed-optimizer instances.
    let plan = LayoutPlan::new(LayoutConfig {
        tp: 2,
        cp: 2,
        ep: 2,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap();
    let cfg = GlooConfig::new("wiring").with_timeout(Duration::from_secs(60));
    let out = run_ranks(8, &cfg, |f, world| {
        let rank = world.rank();
        let built = build_collection(f, &world, &plan)?;
        let pgs = use_mpu_process_groups(&built.collection, None)?;
        let ddp = DdpSettings {
            num_distributed_optimizer_instances: 2,
            use_distributed_optimizer: true,
        };
        let o = setup_process_groups_for_optimizer(
            &pgs,
            &OptimizerWiring {
                context_parallel_size: 2,
                ddp: Some(ddp),
                use_gloo_process_groups: false,
            },
        )?;
        for (name, comm, fam) in [
            ("dp", &o.dp, Family::Dp),
            ("dp_cp", &o.dp_cp, Family::DpCp),
            ("intra_dp_cp", &o.intra_dp_cp, Family::IntraDpCp),
            ("expt_dp", &o.expt_dp, Family::ExptDp),
            ("intra_expt_dp", &o.intra_expt_dp, Family::IntraExptDp),
            ("mp", &o.mp, Family::Mp),
            ("expt_tp_pp", &o.expt_tp_pp, Family::TpEpPp),
            ("inter_dist_opt", &o.inter_dist_opt, Family::InterDistOpt),
            ("intra_dist_opt", &o.intra_dist_opt, Family::IntraDistOpt),
        ] {
            check(name, comm.as_ref(), &sorted(&plan, fam, rank), rank);
        }
        let no_expt = use_mpu_process_groups(
            &built.collection,
            Some(&[
                "dp",
                "dp_cp",
                "intra_dp_cp",
                "intra_expt_dp",
                "inter_dist_opt",
                "tp",
                "pp",
                "ep",
            ]),
        )?;
        let d = setup_process_groups_for_ddp(
            &no_expt,
            &DdpWiring {
                context_parallel_size: 2,
                ddp,
            },
            || {
                f.split(&world, Some(rank as u32), rank)?
                    .map(Arc::new)
                    .ok_or_else(|| Error::Invalid("no one-rank communicator".into()))
            },
        )?;
        assert!(d.expt_dp_is_singleton);
        check("expt_dp (one rank)", Some(&d.expt_dp), &[rank], rank);
        check("tp", d.tp.as_ref(), &sorted(&plan, Family::Tp, rank), rank);
        check(
            "intra_expt_dp",
            d.intra_expt_dp.as_ref(),
            &sorted(&plan, Family::IntraExptDp, rank),
            rank,
        );
        Ok(rank)
    })
    .unwrap();
    let ranks: Vec<usize> = out
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    assert_eq!(ranks, (0..8).collect::<Vec<_>>());
}
