//! Megatron's Gloo twins (`build_gloo_twins`) on Gloo ranks (threads): only the data-parallel
//! families of `GLOO_TWIN_FAMILIES` exist, with the plan's members and a correct all-reduce, by
//! split and by members-only creation.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{
    build_gloo_twins, CollectionOptions, Communicator, CommunicatorExt, Creation, LayoutConfig,
    LayoutPlan, PgEntry, ReduceOp, GLOO_TWIN_FAMILIES,
};
use std::collections::HashSet;
use std::time::Duration;

#[test]
fn gloo_twins_are_exactly_the_data_parallel_families() {
    // cp 2, ep 2 (etp 1), two optimizer instances over 8 ranks: dp, dp_cp, expt_dp,
    // intra_dp_cp and intra_expt_dp all differ.
    let plan = LayoutPlan::new(LayoutConfig {
        cp: 2,
        ep: 2,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap();
    let want: Vec<&str> = GLOO_TWIN_FAMILIES.iter().map(|f| f.name()).collect();
    let distinct: HashSet<_> = GLOO_TWIN_FAMILIES
        .iter()
        .map(|f| plan.group_signature((*f).into()).unwrap())
        .collect();
    for creation in [Creation::Split, Creation::MembersOnly] {
        let cfg =
            GlooConfig::new(format!("twins-{creation}")).with_timeout(Duration::from_secs(60));
        let out = run_ranks(8, &cfg, |f, world| {
            let rank = world.rank();
            let opts = CollectionOptions::new().with_creation(creation);
            let twins = build_gloo_twins(f, &world, &plan, &opts)?;
            assert_eq!(twins.collection.keys(), want, "rank {rank} {creation}");
            for (name, e) in twins.collection.iter() {
                let PgEntry::Group(c) = e else {
                    panic!("{name}: levels")
                };
                let fam = grid_core::Family::from_name(name)?;
                let mut members = plan.group_of(fam.into(), rank)?.unwrap().to_vec();
                members.sort_unstable();
                assert_eq!(c.global_ranks(), members, "rank {rank} {name}");
                let mut s = [0i64];
                c.all_reduce_into(&[rank as i64], &mut s, ReduceOp::Sum)?;
                assert_eq!(
                    s[0],
                    members.iter().sum::<usize>() as i64,
                    "rank {rank} {name}"
                );
            }
            Ok(twins.collective_calls)
        })
        .unwrap();
        for (rank, calls) in out.into_iter().enumerate() {
            // The plan check plus one creation per distinct twin family (every rank is in a
            // group of each).
            assert_eq!(calls.unwrap(), 1 + distinct.len(), "rank {rank} {creation}");
        }
    }
}
