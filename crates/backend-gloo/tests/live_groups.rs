//! Live groups of a `LiveCommGrid` for every subset of dims of a 4-D grid and of a view, and
//! group options (names, time limits, `update_pg_timeout`, Gloo options) on Gloo.

use backend_gloo::{run_ranks, GlooConfig};
use grid_conformance::group_options::{check_named_timeouts, TP_NAME, TP_UPDATED_MS};
use grid_conformance::live::{check_live_groups, LiveGridCase, ViewCase};
use grid_core::{
    BackendOptions, Communicator, CommunicatorExt, Error, GlooGroupOptions, GroupFactory,
    GroupOptions, ReduceOp,
};
use std::time::Duration;

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

#[test]
fn a_live_group_for_every_subset_of_a_4d_grid_and_a_view() {
    let case = LiveGridCase {
        shape: vec![2, 2, 2, 2],
        names: vec!["tp", "cp", "dp", "pp"],
        view: Some(ViewCase {
            name: "expert",
            shape: vec![4, 2, 2],
            names: vec!["expt_tp", "ep", "pp"],
            shared: vec!["pp"],
        }),
    };
    let out = run_ranks(16, &cfg("live-all-subsets"), |f, world| {
        check_live_groups(f, &world, &case).map_err(Error::Invalid)
    })
    .unwrap();
    for (r, rep) in out.into_iter().enumerate() {
        let rep = rep.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((rep.created, rep.shared_with_base), (21, 1), "rank {r}");
    }
}

#[test]
fn stalled_operations_on_named_groups_time_out_with_the_name_and_the_updated_limit() {
    let out = run_ranks(4, &cfg("live-named-timeouts"), |f, world| {
        check_named_timeouts(f, &world, || world.barrier()).map_err(Error::Invalid)
    })
    .unwrap();
    let out: Vec<_> = out
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    let e0 = out[0].error.clone().unwrap();
    assert!(e0.contains(&format!("communicator '{TP_NAME}'")), "{e0}");
    assert!(
        e0.contains(&format!("timed out after {TP_UPDATED_MS} ms")),
        "{e0}"
    );
    assert!(out[3].error.clone().unwrap().contains("communicator 'dp'"));
    eprintln!(
        "tp stall: {:?} ({e0}); dp stall: {:?} ({})",
        out[0].waited,
        out[3].waited,
        out[3].error.clone().unwrap()
    );
}

#[test]
fn gloo_options_set_the_device_and_the_timeout_of_one_group() {
    let out = run_ranks(2, &cfg("live-gloo-options"), |f, world| {
        let o = GroupOptions::new()
            .named("PAIR")
            .with_backend(BackendOptions::Gloo(GlooGroupOptions {
                timeout: Some(Duration::from_millis(700)),
                hostname: Some("127.0.0.1".into()),
            }));
        let g = f.split_with(&world, Some(0), world.rank(), &o)?.unwrap();
        let mut s = [0i32];
        g.all_reduce_into(&[1], &mut s, ReduceOp::Sum)?;
        // A bad hostname is an error naming the group and the address, on every rank.
        let bad = GroupOptions::new()
            .named("BAD")
            .with_backend(BackendOptions::Gloo(GlooGroupOptions {
                hostname: Some("no-such-host.invalid".into()),
                ..Default::default()
            }));
        let e = f
            .split_with(&world, Some(0), world.rank(), &bad)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        Ok((g.name().to_string(), g.inner().timeout(), s[0], e))
    })
    .unwrap();
    for r in out {
        let (name, timeout, sum, e) = r.unwrap();
        assert_eq!(
            (name.as_str(), timeout, sum),
            ("PAIR", Duration::from_millis(700), 2)
        );
        assert!(
            e.contains("group 'BAD'") && e.contains("no-such-host.invalid"),
            "{e}"
        );
    }
}
