//! Megatron's Gloo twins (`build_gloo_twins`) on MPI processes: only the data-parallel families
//! of `GLOO_TWIN_FAMILIES` exist, with the plan's members and a correct all-reduce, by split and
//! by members-only creation.

use backend_mpi::{mpi_test, MpiFactory};
use grid_core::{
    build_gloo_twins, CollectionOptions, Communicator, CommunicatorExt, Creation, Family,
    LayoutConfig, LayoutPlan, PgEntry, ReduceOp, GLOO_TWIN_FAMILIES,
};
use std::collections::HashSet;

mpi_test!(mpi_gloo_twins_np8, np = 8, timeout = 120, |rt| {
    let w = rt.world();
    let rank = w.rank();
    let plan = LayoutPlan::new(LayoutConfig {
        cp: 2,
        ep: 2,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(8)
    })
    .map_err(|e| e.to_string())?;
    let want: Vec<&str> = GLOO_TWIN_FAMILIES.iter().map(|f| f.name()).collect();
    let distinct: HashSet<_> = GLOO_TWIN_FAMILIES
        .iter()
        .map(|f| plan.group_signature((*f).into()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let f = MpiFactory::new();
    for creation in [Creation::Split, Creation::MembersOnly] {
        let opts = CollectionOptions::new().with_creation(creation);
        let twins = build_gloo_twins(&f, w, &plan, &opts).map_err(|e| e.to_string())?;
        if twins.collection.keys() != want {
            return Err(format!(
                "{creation}: families {:?}",
                twins.collection.keys()
            ));
        }
        if twins.collective_calls != 1 + distinct.len() {
            return Err(format!("{creation}: {} calls", twins.collective_calls));
        }
        for (name, e) in twins.collection.iter() {
            let PgEntry::Group(c) = e else {
                return Err(format!("{name}: levels"));
            };
            let fam = Family::from_name(name).map_err(|e| e.to_string())?;
            let mut members = plan
                .group_of(fam.into(), rank)
                .map_err(|e| e.to_string())?
                .ok_or(format!("{name}: no group"))?
                .to_vec();
            members.sort_unstable();
            if c.global_ranks() != members {
                return Err(format!(
                    "{creation} {name}: {:?} want {members:?}",
                    c.global_ranks()
                ));
            }
            let mut s = [0i64];
            c.all_reduce_into(&[rank as i64][..], &mut s[..], ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if s[0] != members.iter().sum::<usize>() as i64 {
                return Err(format!("{creation} {name}: sum {}", s[0]));
            }
        }
    }
    Ok(())
});
