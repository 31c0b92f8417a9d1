//! Members-only creation on the local backend (ranks as threads): the torch-deadlock layout
//! (Megatron's families at world 8, tp 2, pp 2; pytorch/pytorch#173608) created by the members
//! only in the exhaustive set of family orders ([`family_orders`]: 2304 orders reaching every
//! state of the 9! permutations), each group checked against the split build, under a hard
//! timeout; and `build_collection_with` in members-only mode.

use backend_local::{run, LocalConfig};
use grid_core::{
    build_collection, build_collection_with, CollectionOptions, Communicator, CommunicatorExt,
    Creation, Error, FamilyLevel, GroupFactory, GroupOptions, InitPlan, LayoutConfig, LayoutPlan,
    PgEntry, ReduceOp, Result,
};
use std::collections::HashSet;
use std::time::Duration;

fn torch_deadlock_plan() -> LayoutPlan {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        ..LayoutConfig::new(8)
    })
    .unwrap()
}

/// The family levels that create distinct communicators (the first of each group signature),
/// in Megatron's order.
fn distinct_families(plan: &LayoutPlan) -> Vec<FamilyLevel> {
    let mut seen = HashSet::new();
    plan.family_levels()
        .into_iter()
        .filter(|fl| seen.insert(plan.group_signature(*fl).unwrap()))
        .collect()
}

/// The family orders to run, an exhaustive set for members-only creation: for every family `f`
/// and every set `s` of the other families, the order "`s` (Megatron's order), `f`, the rest".
/// A creation's outcome depends only on the family created and on the set of families created
/// before it on the rank (what any counter-based name, torch's included, is a function of), and
/// every one of the n! orders creates each family after some such set: these n * 2^(n-1) orders
/// reach every state the n! orders reach (9 families: 2304 orders instead of 362880).
fn family_orders(n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    for f in 0..n {
        for mask in 0u32..(1 << n) {
            if mask & (1 << f) != 0 {
                continue;
            }
            let mut order: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
            order.push(f);
            order.extend((0..n).filter(|&i| i != f && mask & (1 << i) == 0));
            out.push(order);
        }
    }
    out
}

fn sum_check<C: Communicator + ?Sized>(c: &C, what: &str, rank: usize) -> Result<()> {
    let mut s = [0i64];
    c.all_reduce_into(&[rank as i64], &mut s, ReduceOp::Sum)?;
    let want: usize = c.global_ranks().iter().sum();
    if s[0] != want as i64 {
        return Err(Error::Invalid(format!(
            "{what}: all-reduce {} want {want}",
            s[0]
        )));
    }
    Ok(())
}

/// Runs `f` on a thread and fails the test if it does not finish within `limit` (a deadlock).
fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}: a deadlock")
        }
        Err(e) => panic!("the run failed (see the panic above): {e}"),
    }
}

#[test]
fn members_only_every_family_order_on_local() {
    let counts = within(Duration::from_secs(300), || {
        let plan = torch_deadlock_plan();
        let fams = distinct_families(&plan);
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
    let plan = torch_deadlock_plan();
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
