//! Members-only creation on MPI (`MPI_Comm_create_group`): only a group's members take part,
//! under an identity derived from its family and members.
//!
//! The layout is the one on which torch's `new_group(use_local_synchronization=True)` deadlocks
//! (Megatron's families at world 8, tp 2, pp 2; pytorch/pytorch#173608: torch names a group
//! from a per-process counter, `len(_world.pg_names)`; ranks outside an embedding group skip its
//! creation, so the counter, and with it the store prefix of every later group, differs between
//! pipeline stages and the members of the next group wait under different names forever). Here every rank
//! creates the groups it belongs to in every order of the 9 families that create distinct
//! communicators, through the exhaustive set of `grid_conformance::members_only::family_orders` (2304 orders, reaching every
//! state of the 9! = 362880 permutations; on every rank the same order, ranks skipping the
//! families they are in no group of), and every group must have the split build's members and
//! a correct all-reduce. The whole run is under mpirun's hard timeout: a deadlock fails it.

use backend_mpi::{mpi_test, MpiFactory};
use grid_conformance::members_only::{
    distinct_families, family_orders, sum_check, torch_deadlock_plan,
};
use grid_core::{
    build_collection, build_collection_with, CollectionOptions, Communicator, CommunicatorExt,
    Creation, GroupFactory, GroupOptions, PgEntry, ReduceOp,
};

mpi_test!(
    mpi_members_only_every_family_order_np8,
    np = 8,
    timeout = 300,
    |rt| {
        let w = rt.world();
        let rank = w.rank();
        let plan = torch_deadlock_plan().map_err(|e| e.to_string())?;
        let fams = distinct_families(&plan).map_err(|e| e.to_string())?;
        // tp, pp, mp, embd, pos_embd, cp, tp_dp, dp, intra_dist_opt (the others share).
        if fams.len() != 9 {
            return Err(format!("expected 9 distinct families, got {fams:?}"));
        }
        let f = MpiFactory::new();
        // The reference: the split build's members per family.
        let split = build_collection(&f, w, &plan).map_err(|e| e.to_string())?;
        let reference: Vec<Option<Vec<usize>>> = fams
            .iter()
            .map(|fl| match split.collection.entry(fl.family.name()) {
                Ok(Some(PgEntry::Group(c))) => Some(c.global_ranks().to_vec()),
                Ok(Some(PgEntry::Levels(l))) => l.get(fl.level).map(|c| c.global_ranks().to_vec()),
                _ => None,
            })
            .collect();
        let orders = family_orders(fams.len());
        if orders.len() != 9 << 8 {
            return Err(format!("{} orders", orders.len()));
        }
        let mut created = 0usize;
        for order in &orders {
            let mut comms = Vec::new();
            for &i in order {
                let fl = fams[i];
                let Some(want) = &reference[i] else {
                    // No group of this family on this rank: no call at all.
                    if plan
                        .group_of(fl, rank)
                        .map_err(|e| e.to_string())?
                        .is_some()
                    {
                        return Err(format!("rank {rank} {fl}: split build gave no group"));
                    }
                    continue;
                };
                let opts = GroupOptions::new().named(fl.to_string());
                let c = f
                    .create_group_as(w, want, &opts, Creation::MembersOnly)
                    .map_err(|e| format!("order {order:?} {fl}: {e}"))?
                    .ok_or(format!("order {order:?} {fl}: member got no communicator"))?;
                if c.global_ranks() != want.as_slice() {
                    return Err(format!(
                        "order {order:?} {fl}: ranks {:?} want {want:?}",
                        c.global_ranks()
                    ));
                }
                sum_check(&c, &format!("order {order:?} {fl}"), rank).map_err(|e| e.to_string())?;
                created += 1;
                comms.push(c);
            }
        }
        if rank == 0 {
            println!(
                "members-only: {} family orders x {} families, {created} communicators created on rank 0",
                orders.len(),
                fams.len()
            );
        }
        Ok(())
    }
);

mpi_test!(
    mpi_members_only_build_collection_np8,
    np = 8,
    timeout = 120,
    |rt| {
        let w = rt.world();
        let rank = w.rank();
        let plan = torch_deadlock_plan().map_err(|e| e.to_string())?;
        let f = MpiFactory::new();
        let split = build_collection(&f, w, &plan).map_err(|e| e.to_string())?;
        let opts = CollectionOptions::new().with_creation(Creation::MembersOnly);
        let before = f.calls();
        let mo = build_collection_with(&f, w, &plan, &opts).map_err(|e| e.to_string())?;
        let after = f.calls();
        if after.splits != before.splits {
            return Err("members-only build made splits".into());
        }
        let mine = plan
            .family_levels()
            .into_iter()
            .filter(|fl| plan.group_of(*fl, rank).ok().flatten().is_some())
            .count();
        if mo.collection.keys() != split.collection.keys() {
            return Err(format!(
                "families {:?} vs split {:?}",
                mo.collection.keys(),
                split.collection.keys()
            ));
        }
        for (name, e) in mo.collection.iter() {
            let PgEntry::Group(c) = e else { continue };
            let s = split.collection.get(name).map_err(|e| e.to_string())?;
            let s = s.ok_or(format!("{name}: missing in split build"))?;
            if c.global_ranks() != s.global_ranks() {
                return Err(format!(
                    "{name}: {:?} vs split {:?}",
                    c.global_ranks(),
                    s.global_ranks()
                ));
            }
            sum_check(c.as_ref(), name, rank).map_err(|e| e.to_string())?;
        }
        // The plan check plus one creation per distinct family this rank is a member of.
        if mo.collective_calls != 1 + after.creates - before.creates
            || mo.communicators_created() != after.creates - before.creates
            || mo.communicators_created() > mine
        {
            return Err(format!(
                "calls {} creates {} communicators {} families {mine}",
                mo.collective_calls,
                after.creates - before.creates,
                mo.communicators_created()
            ));
        }
        Ok(())
    }
);

mpi_test!(
    mpi_members_only_non_members_make_no_call_np3,
    np = 3,
    timeout = 60,
    |rt| {
        let w = rt.world();
        let f = MpiFactory::new();
        let opts = GroupOptions::new();
        // Rank 2 makes no call at all and goes straight to the barrier: ranks 0 and 1 create
        // their pair without it (a collective over the parent would wait for rank 2 forever).
        let pair = f
            .create_group_as(w, &[1, 0], &opts, Creation::MembersOnly)
            .map_err(|e| e.to_string())?;
        match (w.rank(), &pair) {
            (2, None) => {}
            (0 | 1, Some(c)) => {
                if c.global_ranks() != [0, 1] || !c.name().starts_with("group/0-1n2-") {
                    return Err(format!("pair {:?} named {}", c.global_ranks(), c.name()));
                }
                sum_check(c, "pair", w.rank()).map_err(|e| e.to_string())?;
                // The same group again: its own rendezvous, not confused with the first.
                let again = f
                    .create_group_as(w, &[0, 1], &opts, Creation::MembersOnly)
                    .map_err(|e| e.to_string())?
                    .ok_or("second pair missing")?;
                sum_check(&again, "pair again", w.rank()).map_err(|e| e.to_string())?;
            }
            (r, p) => {
                return Err(format!(
                    "rank {r}: pair {:?}",
                    p.as_ref().map(|c| c.global_ranks().to_vec())
                ))
            }
        }
        // A member list without the caller is refused before any communication.
        if w.rank() == 2 {
            let e = f
                .create_members_only(w, &[0, 1], "x", &opts)
                .err()
                .ok_or("a non-member's call was accepted")?;
            if !e
                .to_string()
                .contains("rank 2 is not one of the members [0, 1]")
            {
                return Err(format!("unexpected error: {e}"));
            }
        }
        w.barrier().map_err(|e| e.to_string())
    }
);

mpi_test!(
    mpi_members_only_vs_split_timing_np8,
    np = 8,
    timeout = 120,
    |rt| {
        // A benchmark, not a check of speed: builds the torch-deadlock layout's collection by
        // splits and members-only, alternating, and prints the medians (max over ranks).
        let w = rt.world();
        let plan = torch_deadlock_plan().map_err(|e| e.to_string())?;
        let f = MpiFactory::new();
        let mo = CollectionOptions::new().with_creation(Creation::MembersOnly);
        let (mut split_s, mut mo_s) = (Vec::new(), Vec::new());
        for _ in 0..21 {
            for members_only in [false, true] {
                w.barrier().map_err(|e| e.to_string())?;
                let t = std::time::Instant::now();
                let built = if members_only {
                    build_collection_with(&f, w, &plan, &mo)
                } else {
                    build_collection(&f, w, &plan)
                }
                .map_err(|e| e.to_string())?;
                let mut s = [t.elapsed().as_secs_f64()];
                drop(built);
                w.all_reduce_in_place(&mut s[..], ReduceOp::Max)
                    .map_err(|e| e.to_string())?;
                if members_only {
                    &mut mo_s
                } else {
                    &mut split_s
                }
                .push(s[0]);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2] * 1e3
        };
        if w.rank() == 0 {
            println!(
                "MPI world 8 tp 2 pp 2, 21 runs each: split {:.3} ms, members-only {:.3} ms (medians of the max over ranks)",
                median(&mut split_s),
                median(&mut mo_s)
            );
        }
        Ok(())
    }
);
