//! Members-only creation on Gloo (ranks as threads, in-process store): only a group's members
//! meet, in a rendezvous under a store prefix derived from the group's family and members.
//!
//! The layout is the one on which torch's `new_group(use_local_synchronization=True)` deadlocks
//! (Megatron's families at world 8, tp 2, pp 2; pytorch/pytorch#173608: torch names a group from
//! a per-process counter, `len(_world.pg_names)`; ranks outside an embedding group skip its
//! creation, so the counter, and with it the store prefix of every later group, differs between
//! pipeline stages and the members of the next group wait under different names forever).
//! Every rank creates the groups it belongs to in many orders of the 9 families that create
//! distinct communicators, and every group must have the split build's members and a correct
//! all-reduce. Each run is under a hard timeout: a deadlock fails it.
//!
//! A Gloo rendezvous costs tens of milliseconds on a loaded machine (about 0.4 s per order of
//! 9 families measured at load 15), so the exhaustive set of `grid_conformance::members_only::family_orders` (2304 orders,
//! reaching every state of the 9! = 362880 permutations; it runs on MPI and on the local
//! backend) would take about 15 minutes here. This test runs the 34 orders of
//! [`gloo_orders`] by default, and the whole exhaustive set with
//! `GRID_MEMBERS_ONLY_ALL_ORDERS=1`.

use backend_gloo::{run_ranks, GlooConfig};
use grid_conformance::members_only::{
    distinct_families, family_orders, sum_check, torch_deadlock_plan, within,
};
use grid_core::{
    build_collection, build_collection_with, BackendOptions, CollectionOptions, Communicator,
    CommunicatorExt, Creation, Error, GlooGroupOptions, GroupFactory, GroupOptions, PgEntry,
    ReduceOp,
};
use std::time::Duration;

/// The orders run on Gloo by default (34): the 9 rotations of Megatron's order and the 9 of
/// its reverse (every ordered pair of families appears both ways, every family comes first
/// once), and, for each of the 8 other families, that family first with and without
/// `pos_embd`, the one family some ranks skip (the torch failure), created just before it.
fn gloo_orders(n: usize, skipped: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    for r in 0..n {
        out.push((0..n).map(|i| (i + r) % n).collect());
        out.push((0..n).rev().map(|i| (i + r) % n).collect());
    }
    for f in (0..n).filter(|&f| f != skipped) {
        let mut with = vec![skipped, f];
        with.extend((0..n).filter(|&i| i != f && i != skipped));
        out.push(with);
        let mut without = vec![f];
        without.extend((0..n).filter(|&i| i != f));
        out.push(without);
    }
    out
}

#[test]
fn members_only_every_family_order_on_gloo() {
    let all = std::env::var("GRID_MEMBERS_ONLY_ALL_ORDERS").is_ok_and(|v| v == "1");
    let limit = Duration::from_secs(if all { 1800 } else { 300 });
    let (n, count) = within(limit, move || {
        let plan = torch_deadlock_plan().unwrap();
        let fams = distinct_families(&plan).unwrap();
        // tp, pp, mp, embd, pos_embd, cp, tp_dp, dp, intra_dist_opt (the others share).
        assert_eq!(fams.len(), 9, "{fams:?}");
        let pos = fams
            .iter()
            .position(|fl| fl.to_string() == "pos_embd")
            .unwrap();
        let orders = if all {
            family_orders(fams.len())
        } else {
            gloo_orders(fams.len(), pos)
        };
        assert_eq!(orders.len(), if all { 2304 } else { 34 });
        let count = orders.len();
        let cfg = GlooConfig::new("members-only-orders").with_timeout(Duration::from_secs(60));
        let out = run_ranks(8, &cfg, |f, world| {
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
            let mut created = 0usize;
            for order in &orders {
                let mut comms = Vec::new();
                for &i in order {
                    let fl = fams[i];
                    let Some(want) = &reference[i] else {
                        // No group of this family on this rank: no call at all.
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
            Ok(created)
        })
        .unwrap();
        let errors: Vec<String> = out
            .iter()
            .enumerate()
            .filter_map(|(r, o)| o.as_ref().err().map(|e| format!("rank {r}: {e}")))
            .collect();
        assert!(errors.is_empty(), "{}", errors.join("\n"));
        (out.into_iter().flatten().collect::<Vec<_>>(), count)
    });
    // Every rank is in a group of every family but pos_embd (first pipeline stage only).
    for (rank, c) in n.iter().enumerate() {
        let skipped = if rank < 4 { 0 } else { count };
        assert_eq!(*c, count * 9 - skipped, "rank {rank}");
    }
}

#[test]
fn members_only_build_collection_on_gloo() {
    within(Duration::from_secs(300), || {
        let plan = torch_deadlock_plan().unwrap();
        let cfg = GlooConfig::new("members-only-build").with_timeout(Duration::from_secs(60));
        let out = run_ranks(8, &cfg, |f, world| {
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
            Ok((mo.collective_calls, split.collective_calls))
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            let (mo, split) = r.unwrap();
            // The plan check plus one creation per distinct family the rank is a member of;
            // the split build calls once per distinct family on every rank.
            assert_eq!(split, 10, "rank {rank}");
            assert_eq!(mo, if rank < 4 { 10 } else { 9 }, "rank {rank}");
        }
    });
}

#[test]
fn members_only_non_members_make_no_call_on_gloo() {
    within(Duration::from_secs(120), || {
        let cfg = GlooConfig::new("members-only-pair").with_timeout(Duration::from_secs(20));
        let out = run_ranks(3, &cfg, |f, world| {
            let opts = GroupOptions::new();
            // Rank 2 makes no call and goes straight to the barrier.
            let pair = f.create_group_as(&world, &[1, 0], &opts, Creation::MembersOnly)?;
            let mut names = Vec::new();
            if let Some(c) = &pair {
                assert_eq!(c.global_ranks(), [0, 1]);
                sum_check(c, "pair", world.rank())?;
                names.push(c.name().to_string());
                // The same group again: its own rendezvous (the identity's count advanced).
                let again = f
                    .create_group_as(&world, &[0, 1], &opts, Creation::MembersOnly)?
                    .unwrap();
                sum_check(&again, "again", world.rank())?;
            } else {
                let e = f
                    .create_members_only(&world, &[0, 1], "x", &opts)
                    .err()
                    .unwrap();
                assert!(
                    e.to_string()
                        .contains("rank 2 is not one of the members [0, 1]"),
                    "{e}"
                );
            }
            world.barrier()?;
            Ok(names)
        })
        .unwrap();
        let out: Vec<Vec<String>> = out.into_iter().map(|r| r.unwrap()).collect();
        assert!(out[0][0].starts_with("group/0-1n2-"), "{:?}", out[0]);
        assert_eq!(out[0], out[1]);
        assert!(out[2].is_empty());
    });
}

/// A member that never comes to its group's rendezvous (a group's rendezvous has no arrival
/// phase: its members come from the parent): the members that came fail within the time limit
/// with an error that names it, and the parent stays usable.
#[test]
fn members_only_missing_member_is_named_on_gloo() {
    within(Duration::from_secs(120), || {
        let limit = Duration::from_millis(700);
        let cfg = GlooConfig::new("members-only-missing").with_timeout(Duration::from_secs(20));
        let out = run_ranks(3, &cfg, |f, world| {
            let opts = GroupOptions::new().with_backend(BackendOptions::Gloo(GlooGroupOptions {
                timeout: Some(limit),
                hostname: None,
            }));
            let mut got = None;
            if world.rank() != 2 {
                let t = std::time::Instant::now();
                // Rank 2 is a member but never calls.
                let e = f
                    .create_group_as(&world, &[0, 1, 2], &opts, Creation::MembersOnly)
                    .err()
                    .ok_or_else(|| Error::Invalid("created without rank 2".into()))?;
                got = Some((e, t.elapsed()));
            }
            world.barrier()?;
            Ok(got)
        })
        .unwrap();
        for (r, o) in out.into_iter().enumerate().take(2) {
            let (e, took) = o.unwrap().unwrap();
            assert!(
                matches!(&e, Error::PeerFailed { op: "rendezvous", peer: 2, message, .. }
                    if message.contains("1 rank of 2 never arrived: rank 2")),
                "rank {r}: {e}"
            );
            assert!(
                took >= limit.mul_f64(0.9) && took < limit + Duration::from_millis(2000),
                "rank {r}: {took:?}"
            );
        }
    });
}

#[test]
fn members_only_vs_split_timing_on_gloo() {
    // A benchmark, not a check of speed: builds the torch-deadlock layout's collection by
    // splits and members-only, alternating, and prints the medians (max over ranks).
    within(Duration::from_secs(300), || {
        let plan = torch_deadlock_plan().unwrap();
        let cfg = GlooConfig::new("members-only-timing").with_timeout(Duration::from_secs(60));
        let mo = CollectionOptions::new().with_creation(Creation::MembersOnly);
        let out = run_ranks(8, &cfg, |f, world| {
            let (mut split_s, mut mo_s) = (Vec::new(), Vec::new());
            for _ in 0..7 {
                for members_only in [false, true] {
                    world.barrier()?;
                    let t = std::time::Instant::now();
                    let built = if members_only {
                        build_collection_with(f, &world, &plan, &mo)?
                    } else {
                        build_collection(f, &world, &plan)?
                    };
                    let mut s = [t.elapsed().as_secs_f64()];
                    drop(built);
                    world.all_reduce_in_place(&mut s, ReduceOp::Max)?;
                    if members_only {
                        &mut mo_s
                    } else {
                        &mut split_s
                    }
                    .push(s[0]);
                }
            }
            split_s.sort_by(f64::total_cmp);
            mo_s.sort_by(f64::total_cmp);
            Ok((split_s[3] * 1e3, mo_s[3] * 1e3))
        })
        .unwrap();
        let (split, mo) = out[0].as_ref().unwrap();
        println!(
            "Gloo threads world 8 tp 2 pp 2, 7 runs each: split {split:.1} ms, members-only {mo:.1} ms (medians of the max over ranks)"
        );
    });
}
