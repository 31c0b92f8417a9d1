//! The optimizer and DDP wiring (`use_mpu_process_groups`, `setup_process_groups_for_optimizer`,
//! `setup_process_groups_for_ddp`) on live MPI communicators from `build_collection`: every
//! group it hands out is the plan's group, carries a correct all-reduce, and the one-rank
//! expert-dp group of the DDP fallback is a real communicator.

use backend_mpi::{mpi_test, MpiFactory};
use grid_core::{
    build_collection, setup_process_groups_for_ddp, setup_process_groups_for_optimizer,
    use_mpu_process_groups, Communicator, CommunicatorExt, DdpSettings, DdpWiring, Error, Family,
    GroupFactory, LayoutConfig, LayoutPlan, OptimizerWiring, ReduceOp,
};
use std::sync::Arc;

/// The plan's group of `f` for `rank`, sorted (communicator ranks are torch's sorted order).
fn sorted(plan: &LayoutPlan, f: Family, rank: usize) -> Result<Vec<usize>, String> {
    let mut m = plan
        .group_of(f.into(), rank)
        .map_err(|e| e.to_string())?
        .ok_or(format!("rank {rank} is in no {f} group"))?
        .to_vec();
    m.sort_unstable();
    Ok(m)
}

fn check<C: Communicator + ?Sized>(
    name: &str,
    comm: Option<&Arc<C>>,
    want: &[usize],
    rank: usize,
) -> Result<(), String> {
    let comm = comm.ok_or(format!("rank {rank}: no {name} group"))?;
    if comm.global_ranks() != want {
        return Err(format!(
            "rank {rank} {name}: ranks {:?}, want {want:?}",
            comm.global_ranks()
        ));
    }
    let mut s = [0i64];
    comm.all_reduce_into(&[rank as i64][..], &mut s[..], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let expect = want.iter().sum::<usize>() as i64;
    if s[0] != expect {
        return Err(format!("rank {rank} {name}: sum {} want {expect}", s[0]));
    }
    Ok(())
}

mpi_test!(
    mpi_optimizer_and_ddp_wiring_np4,
    np = 4,
    timeout = 60,
    |rt| {
        let w = rt.world();
        let rank = w.rank();
        // cp 2 and ep 2 with two distributed-optimizer instances: every group of the wiring exists
        // (inter_dist_opt included) and dp, dp_cp, expt_dp and the intra groups all differ.
        let plan = LayoutPlan::new(LayoutConfig {
            cp: 2,
            ep: 2,
            etp: Some(1),
            dist_opt_instances: 2,
            ..LayoutConfig::new(4)
        })
        .map_err(|e| e.to_string())?;
        let factory = MpiFactory::new();
        let built = build_collection(&factory, w, &plan).map_err(|e| e.to_string())?;
        let pgs = use_mpu_process_groups(&built.collection, None).map_err(|e| e.to_string())?;
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
        )
        .map_err(|e| e.to_string())?;
        for (name, comm, f) in [
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
            check(name, comm.as_ref(), &sorted(&plan, f, rank)?, rank)?;
        }
        // DDP on a collection without expt_dp: every rank makes its own one-rank communicator.
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
        )
        .map_err(|e| e.to_string())?;
        let d = setup_process_groups_for_ddp(
            &no_expt,
            &DdpWiring {
                context_parallel_size: 2,
                ddp,
            },
            || {
                factory
                    .split(w, Some(rank as u32), rank)?
                    .map(Arc::new)
                    .ok_or_else(|| Error::Invalid("no one-rank communicator".into()))
            },
        )
        .map_err(|e| e.to_string())?;
        if !d.expt_dp_is_singleton {
            return Err("expt_dp was not made".into());
        }
        check("expt_dp (one rank)", Some(&d.expt_dp), &[rank], rank)?;
        check(
            "inter_dist_opt",
            d.inter_dist_opt.as_ref(),
            &sorted(&plan, Family::InterDistOpt, rank)?,
            rank,
        )?;
        check("ep", d.ep.as_ref(), &sorted(&plan, Family::Ep, rank)?, rank)?;
        // A missing group is named on every rank, before anything is created.
        let missing = use_mpu_process_groups(&built.collection, Some(&["dp", "tp", "pp"]))
            .map_err(|e| e.to_string())?;
        match setup_process_groups_for_ddp(
            &missing,
            &DdpWiring {
                context_parallel_size: 1,
                ddp: DdpSettings::default(),
            },
            || {
                Err(Error::Invalid(
                    "the singleton is made before the tp/pp/ep check".into(),
                ))
            },
        ) {
            Err(Error::Invalid(m)) if m.starts_with("the singleton") => {}
            other => {
                return Err(format!(
                    "rank {rank}: expected the singleton maker's error, got {other:?}"
                ))
            }
        }
        Ok(())
    }
);
