//! Live groups of a `LiveCommGrid` for every subset of dims of a 4-D grid and of a view, and
//! group options (names, time limits, `update_pg_timeout`) on the in-process backend.

use backend_local::{run, LocalConfig};
use grid_conformance::group_options::{check_named_timeouts, TP_NAME, TP_UPDATED_MS};
use grid_conformance::live::{check_live_groups, LiveGridCase, ViewCase};
use grid_core::{
    build_collection_with, BackendOptions, CollectionOptions, Communicator, Error, GroupFactory,
    GroupOptions, LayoutConfig, LayoutPlan, NcclGroupOptions,
};
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn case() -> LiveGridCase {
    LiveGridCase {
        shape: vec![2, 2, 2, 2],
        names: vec!["tp", "cp", "dp", "pp"],
        view: Some(ViewCase {
            name: "expert",
            shape: vec![4, 2, 2],
            names: vec!["expt_tp", "ep", "pp"],
            shared: vec!["pp"],
        }),
    }
}

#[test]
fn a_live_group_for_every_subset_of_a_4d_grid_and_a_view() {
    let out = run(16, &LocalConfig::default(), |f, world| {
        check_live_groups(f, &world, &case()).map_err(Error::Invalid)
    })
    .unwrap();
    for (r, rep) in out.iter().enumerate() {
        // 15 subsets of the base, 7 of the view, of which {pp} is the base's key.
        assert_eq!((rep.created, rep.shared_with_base), (21, 1), "rank {r}");
    }
}

#[test]
fn stalled_operations_on_named_groups_time_out_with_the_name_and_the_updated_limit() {
    let barrier = Arc::new(Barrier::new(4));
    let out = run(4, &LocalConfig::default(), |f, world| {
        let b = barrier.clone();
        check_named_timeouts(f, &world, || {
            b.wait();
            Ok(())
        })
        .map_err(Error::Invalid)
    })
    .unwrap();
    let e0 = out[0].error.clone().unwrap();
    assert!(e0.contains(&format!("communicator '{TP_NAME}'")), "{e0}");
    assert!(
        e0.contains(&format!("timed out after {TP_UPDATED_MS} ms")),
        "{e0}"
    );
    assert!(out[3].error.clone().unwrap().contains("communicator 'dp'"));
    eprintln!(
        "tp stall: {:?} ({e0}); dp stall: {:?}",
        out[0].waited, out[3].waited
    );
}

#[test]
fn options_of_another_backend_are_rejected_on_every_rank_before_any_split() {
    let plan = LayoutPlan::new(LayoutConfig {
        world_size: 2,
        tp: 2,
        ..Default::default()
    })
    .unwrap();
    let opts = CollectionOptions::from_nccl_comm_cfgs_text("tp:\n  max_ctas: 8\n").unwrap();
    let out = run(2, &LocalConfig::default(), |f, world| {
        let r = build_collection_with(f, &world, &plan, &opts).map(|_| ());
        Ok((r.map_err(|e| e.to_string()), f.splits()))
    })
    .unwrap();
    for (r, splits) in out {
        assert_eq!(
            r.unwrap_err(),
            "group 'tp': its backend options are for 'nccl', but the factory creating it is 'local' (give BackendOptions::None, or options of the backend that creates the group)"
        );
        assert_eq!(splits, 0);
    }
    // The same for one group.
    let out = run(2, &LocalConfig::default(), |f, world| {
        let o = GroupOptions::new().with_backend(BackendOptions::Nccl(NcclGroupOptions::default()));
        Ok(f.split_with(&world, Some(0), world.rank(), &o)
            .map(|_| ())
            .is_err())
    })
    .unwrap();
    assert_eq!(out, vec![true, true]);
}

#[test]
fn a_named_split_keeps_its_name_in_errors_and_its_time_limit() {
    let out = run(2, &LocalConfig::default(), |f, world| {
        let o = GroupOptions::new()
            .named("PAIR")
            .with_timeout(Duration::from_millis(250));
        let g = f.split_with(&world, Some(0), world.rank(), &o)?.unwrap();
        Ok((g.name().to_string(), g.time_limit().as_millis()))
    })
    .unwrap();
    assert_eq!(out, vec![("PAIR".to_string(), 250); 2]);
}

#[test]
fn live_groups_take_options_and_update_pg_timeout() {
    use grid_core::{CommGrid, LiveCommGrid, TimeLimit};
    let out = run(4, &LocalConfig::default(), |f, world| {
        let grid = CommGrid::new(vec![2, 2], &["tp", "dp"], 0, 4, world.rank())?;
        let mut live = LiveCommGrid::new(grid, f, &world)?;
        // Not created yet: an error, also for update_pg_timeout.
        let missing = live.update_pg_timeout(&["dp"], None, TimeLimit::Unlimited);
        let o = GroupOptions::new()
            .named("DATA_PARALLEL_GROUP")
            .with_timeout(Duration::from_millis(700));
        let dp = live.create_pg(&["dp"], None, &o)?.unwrap();
        let tp = live
            .create_pg(&["tp"], None, &GroupOptions::new())?
            .unwrap();
        let before = (
            dp.name().to_string(),
            dp.time_limit(),
            tp.name().to_string(),
        );
        live.update_pg_timeout(&["dp"], None, Duration::from_millis(900))?;
        let one = dp.time_limit();
        let all = live.update_all_pg_timeouts(TimeLimit::Unlimited);
        Ok((
            missing.map_err(|e| e.to_string()),
            before,
            one,
            all,
            tp.time_limit(),
        ))
    })
    .unwrap();
    for (missing, before, one, all, tp_after) in out {
        assert_eq!(
            missing.unwrap_err(),
            "process group for dp hasn't been created: call create_pg first"
        );
        assert_eq!(
            before,
            (
                "DATA_PARALLEL_GROUP".to_string(),
                TimeLimit::from_millis(700),
                "tp".to_string()
            )
        );
        assert_eq!(one, TimeLimit::from_millis(900));
        assert_eq!((all, tp_after), (2, TimeLimit::Unlimited));
    }
}

/// A factory that implements only `split`: the trait's default `split_with` applies the time
/// limit and refuses what it cannot apply (a name, backend options) before splitting.
struct SplitOnly<'a>(&'a backend_local::LocalFactory);

impl GroupFactory for SplitOnly<'_> {
    type Comm = backend_local::LocalComm;
    fn split(
        &self,
        parent: &Self::Comm,
        color: Option<u32>,
        key: usize,
    ) -> grid_core::Result<Option<Self::Comm>> {
        self.0.split(parent, color, key)
    }
}

#[test]
fn the_default_split_with_applies_the_time_limit_and_refuses_names() {
    let out = run(2, &LocalConfig::default(), |f, world| {
        let plain = SplitOnly(f);
        let timed = GroupOptions::new().with_timeout(Duration::from_millis(321));
        let g = plain
            .split_with(&world, Some(0), world.rank(), &timed)?
            .unwrap();
        let named = plain
            .split_with(
                &world,
                Some(0),
                world.rank(),
                &GroupOptions::new().named("x"),
            )
            .map(|_| ())
            .unwrap_err();
        Ok((g.time_limit().as_millis(), named.to_string(), f.splits()))
    })
    .unwrap();
    for (ms, e, splits) in out {
        assert_eq!(ms, 321);
        assert!(
            matches!(e.as_str(), s if s.contains("group names and backend options")),
            "{e}"
        );
        // The refused call made no split.
        assert_eq!(splits, 1);
    }
}
