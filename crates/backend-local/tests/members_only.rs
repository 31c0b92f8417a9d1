//! Members-only creation on the local backend (ranks as threads): the torch-deadlock layout
//! (Megatron's families at world 8, tp 2, pp 2; pytorch/pytorch#173608) created by the members
//! only in the exhaustive set of family orders (`grid_conformance::members_only::family_orders`: 2304 orders reaching every
//! state of the 9! permutations), each group checked against the split build, under a hard
//! timeout; and `build_collection_with` in members-only mode.

use backend_local::{run, LocalConfig};
use grid_conformance::members_only::{
    distinct_families, family_orders, sum_check, torch_deadlock_plan, within,
};
use grid_core::{
    build_collection, build_collection_with, CollectionOptions, Communicator, Creation, Error,
    GroupFactory, GroupOptions, InitPlan, PgEntry,
};
use std::time::Duration;

#[test]
fn members_only_every_family_order_on_local() {
    let counts = within(Duration::from_secs(300), || {
        let plan = torch_deadlock_plan().unwrap();
        let fams = distinct_families(&plan).unwrap();
        assert_eq!(fams.len(), 9, "{fams:?}");
        let orders = family_orders(fams.len());
        assert_eq!(orders.len(), 2304);
        let cfg = LocalConfig::default();
        run(8, &cfg, |f, world| {
            let rank = world.rank();
            let split = build_collection(f, &world, &plan)?;
            let reference: Vec<Option<Vec<usize>>> = fams
                .iter()
                .map(|fl| match split.collection.entry(fl.family.name()) {
                    Ok(Some(PgEntry::Group(c))) => Some(c.global_ranks().to_vec()),
                    Ok(Some(PgEntry::Levels(l))) => {
                        l.get(fl.level).map(|c| c.global_ranks().to_vec())
                    }
                    _ => None,
                })
                .collect();
            let splits_before = f.splits();
            let mut created = 0usize;
            for order in &orders {
                let mut comms = Vec::new();
                for &i in order {
                    let fl = fams[i];
                    let Some(want) = &reference[i] else {
                        assert!(plan.group_of(fl, rank)?.is_none(), "rank {rank} {fl}");
                        continue;
                    };
                    let opts = GroupOptions::new().named(fl.to_string());
                    let c = f
                        .create_group_as(&world, want, &opts, Creation::MembersOnly)?
                        .ok_or_else(|| Error::Invalid(format!("{order:?} {fl}: no comm")))?;
                    if c.global_ranks() != want.as_slice() {
                        return Err(Error::Invalid(format!(
                            "order {order:?} {fl}: ranks {:?} want {want:?}",
                            c.global_ranks()
                        )));
                    }
                    sum_check(&c, &format!("order {order:?} {fl}"), rank)?;
                    created += 1;
                    comms.push(c);
                }
            }
            // No parent round was used: members-only creation makes no split.
            assert_eq!(f.splits(), splits_before);
            Ok(created)
        })
        .unwrap()
    });
    for (rank, c) in counts.iter().enumerate() {
        let skipped = if rank < 4 { 0 } else { 2304 };
        assert_eq!(*c, 2304 * 9 - skipped, "rank {rank}");
    }
}

#[test]
fn members_only_build_collection_on_local() {
    let plan = torch_deadlock_plan().unwrap();
    let out = run(8, &LocalConfig::default(), |f, world| {
        let rank = world.rank();
        let split = build_collection(f, &world, &plan)?;
        let opts = CollectionOptions::new().with_creation(Creation::MembersOnly);
        let mo = build_collection_with(f, &world, &plan, &opts)?;
        assert_eq!(mo.collection.keys(), split.collection.keys(), "rank {rank}");
        for (name, e) in mo.collection.iter() {
            let PgEntry::Group(c) = e else { continue };
            let s = split.collection.get(name)?.unwrap();
            assert_eq!(c.global_ranks(), s.global_ranks(), "rank {rank} {name}");
            sum_check(c.as_ref(), name, rank)?;
        }
        Ok(mo.collective_calls)
    })
    .unwrap();
    assert_eq!(out, vec![10, 10, 10, 10, 9, 9, 9, 9]);
    // What `grid init-plan --creation members-only` describes is what was done.
    let init = InitPlan::new(&plan, Creation::MembersOnly).unwrap();
    for (rank, calls) in out.iter().enumerate() {
        assert_eq!(
            init.rank(rank).unwrap().collective_calls,
            *calls,
            "rank {rank}"
        );
    }
}
