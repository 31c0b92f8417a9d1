//! Sub-groups: split, create_group, nesting, and whole collections from a layout plan.

mod common;

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{
    build_collection, Communicator, CommunicatorExt, GroupFactory, LayoutConfig, LayoutPlan,
    PgEntry, ReduceOp,
};
use std::time::Duration;

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

fn all_ok<R: std::fmt::Debug>(results: Vec<grid_core::Result<R>>) -> Vec<R> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn split_by_colour_and_key() {
    let out = run_ranks(8, &cfg("split"), |f, world| {
        let me = world.rank();
        // Parity groups, ordered by descending world rank through the key.
        let g = f
            .split(&world, Some((me % 2) as u32), 100 - me)?
            .expect("member");
        let expect: Vec<usize> = (0..8).rev().filter(|r| r % 2 == me % 2).collect();
        assert_eq!(g.global_ranks(), &expect[..]);
        assert_eq!(g.rank(), expect.iter().position(|&r| r == me).unwrap());
        let mut sum = [0i64];
        g.all_reduce_into(&[me as i64], &mut sum, ReduceOp::Sum)?;
        assert_eq!(sum[0], expect.iter().sum::<usize>() as i64);
        // A second split with the same colours gets fresh keys: it must not collide.
        let g2 = f.split(&world, Some((me % 2) as u32), me)?.expect("member");
        assert_eq!(g2.rank(), me / 2);
        // Ranks without a colour take part and get nothing.
        let low = f.split(&world, (me < 3).then_some(5), me)?;
        assert_eq!(low.is_some(), me < 3);
        if let Some(low) = &low {
            assert_eq!(low.global_ranks(), &[0, 1, 2]);
            common::suite(low);
        }
        // Nested: split a split.
        let q = f
            .split(&g2, Some((g2.rank() / 2) as u32), g2.rank())?
            .expect("member");
        assert_eq!(q.size(), 2);
        let want: Vec<usize> = (0..8)
            .filter(|r| r % 2 == me % 2 && (r / 2) / 2 == (me / 2) / 2)
            .collect();
        assert_eq!(q.global_ranks(), &want[..]);
        let mut all = [0i64; 2];
        q.all_gather_into(&[me as i64], &mut all)?;
        assert_eq!(
            all.to_vec(),
            want.iter().map(|&r| r as i64).collect::<Vec<_>>()
        );
        // create_group with an explicit rank list (the first and the last rank).
        let ends = f.create_group(&world, &[7, 0])?;
        assert_eq!(ends.is_some(), me == 0 || me == 7);
        if let Some(e) = ends {
            assert_eq!(e.global_ranks(), &[0, 7]);
            common::suite(&e);
        }
        // The world still works after all that.
        world.barrier()?;
        Ok(g.name().to_string())
    })
    .unwrap();
    let names = all_ok(out);
    assert_eq!(names[0], "w0/s0/c0");
    assert_eq!(names[1], "w0/s0/c1");
}

#[test]
fn split_errors() {
    let out = run_ranks(2, &cfg("split-errors"), |f, world| {
        let e = f.create_group(&world, &[0, 0]).unwrap_err();
        assert!(matches!(e, grid_core::Error::Invalid(_)), "{e}");
        let e = f.create_group(&world, &[2]).unwrap_err();
        assert!(matches!(e, grid_core::Error::PeerOutOfRange { .. }), "{e}");
        let e = f.world(3, 2).unwrap_err();
        assert!(matches!(e, grid_core::Error::RankOutOfRange { .. }), "{e}");
        Ok(())
    })
    .unwrap();
    all_ok(out);
}

#[test]
fn collection_from_plan() {
    let mut lc = LayoutConfig::new(8);
    lc.tp = 2;
    lc.pp = 2;
    lc.cp = 2;
    let plan = LayoutPlan::new(lc).unwrap();
    let out = run_ranks(8, &cfg("collection"), |f, world| {
        let built = build_collection(f, &world, &plan)?;
        let view = plan.rank_view(world.rank())?;
        let groups = view.collection();
        let mut checked = 0;
        for (name, entry) in built.collection.iter() {
            let PgEntry::Group(comm) = entry else {
                continue;
            };
            let Some(PgEntry::Group(g)) = groups.entry(name)? else {
                panic!("{name}: built but not in the rank view");
            };
            // Communicator ranks are sorted world ranks (some families list members unsorted).
            let mut members = g.to_vec();
            members.sort_unstable();
            assert_eq!(comm.global_ranks(), &members[..], "{name}");
            let mut got = [0i64];
            comm.all_reduce_into(&[world.rank() as i64], &mut got, ReduceOp::Sum)?;
            assert_eq!(got[0], g.to_vec().iter().sum::<usize>() as i64, "{name}");
            checked += 1;
        }
        Ok((checked, built.communicators_created()))
    })
    .unwrap();
    for (checked, created) in all_ok(out) {
        assert!(checked >= 10, "only {checked} families checked");
        assert!(created >= 5, "only {created} communicators created");
    }
}

#[test]
fn in_process_store_forgets_finished_groups() {
    let store = backend_gloo::InProcessStore::new().unwrap();
    let rdv = backend_gloo::Rendezvous::InProcess(store.clone());
    let out = backend_gloo::run_ranks_with(&rdv, 4, &cfg("forget"), |f, w| {
        let me = w.rank();
        w.barrier()?;
        let before = store.key_count()?;
        for _ in 0..100 {
            let g = f.split(&w, Some((me % 2) as u32), me)?;
            drop(g);
            w.barrier()?;
        }
        Ok((before, store.key_count()?))
    })
    .unwrap();
    for (before, after) in all_ok(out) {
        // The world's keys stay (they mark the job id as used); no group leaves an entry.
        assert!(before > 0, "the world's keys are in the store");
        assert_eq!(after, before, "keys left by 100 groups");
    }
}
