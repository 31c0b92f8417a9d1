//! The `moe-dispatch` example: the program (local backend, its default) returns every token to
//! its source, and the library's rank function does the same on other layouts, seeds and the
//! nonblocking form; bad arguments are refused with exit status 2 and the reason.

mod common;

use common::example;
use grid_programs::moe::{idle_expert, route, run_rank, silent_source, summary, MoeConfig};
use std::process::Command;

#[test]
fn moe_dispatch_program_returns_every_token_to_its_source() {
    let exe = example("moe-dispatch");
    let out = Command::new(&exe).output().expect("run moe-dispatch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    assert!(stderr.is_empty(), "no problem may be reported: {stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("moe-dispatch: world 8, tp 1, pp 1, ep 4"),
        "{stdout}"
    );
    // Two expert-parallel groups of 4 (world 8, ep 4: expert dp 2), each with its idle expert
    // and silent source.
    let groups: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("expert-parallel group"))
        .collect();
    assert_eq!(groups.len(), 2, "{stdout}");
    assert!(groups
        .iter()
        .all(|g| g.contains("idle expert 3") && g.contains("silent source 0")));
    let last = lines.last().copied().unwrap_or_default();
    assert!(
        last.starts_with("moe-dispatch: ok: ")
            && last.contains("in order, with the expected values"),
        "{stdout}"
    );
    // The token total printed is the sum of what the routing sends (recomputed here).
    let cfg = MoeConfig::default();
    let plan = grid_core::LayoutPlan::new(cfg.layout()).expect("the default layout");
    let ep = grid_core::FamilyLevel::from(grid_core::Family::Ep);
    let mut total = 0;
    for g in plan.groups(ep).expect("ep groups").iter() {
        // Communicator ranks are the members in world-rank order.
        let mut members = g.to_vec();
        members.sort_unstable();
        for (j, &m) in members.iter().enumerate() {
            total += route(cfg.seed, m, j, members.len(), cfg.tokens)
                .experts
                .len();
        }
    }
    assert!(
        last.contains(&format!("ok: {total} tokens")),
        "{last} (want {total})"
    );
}

#[test]
fn moe_dispatch_refuses_bad_arguments() {
    let exe = example("moe-dispatch");
    for (args, want) in [
        (&["--hidden", "1"][..], "--hidden 1"),
        (&["--ep", "3"][..], "the layout is invalid"),
        (&["--backend", "tcp"][..], "expected local, gloo or mpi"),
        (&["--world"][..], "--world needs a value"),
        (&["--seed", "-1"][..], "--seed \"-1\""),
        (&["--frobnicate", "1"][..], "unknown argument"),
    ] {
        let out = Command::new(&exe)
            .args(args)
            .output()
            .expect("run moe-dispatch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr} (want {want:?})");
    }
}

/// The rank function on several layouts, seeds and both forms, through the local backend.
#[test]
fn every_token_returns_on_other_layouts_and_the_nonblocking_form() {
    let cases = [
        MoeConfig::default(),
        MoeConfig {
            nonblocking: true,
            seed: 11,
            ..MoeConfig::default()
        },
        MoeConfig {
            world: 8,
            tp: 2,
            ep: 4,
            etp: Some(1),
            tokens: 9,
            hidden: 5,
            ..MoeConfig::default()
        },
        MoeConfig {
            world: 8,
            pp: 2,
            ep: 2,
            seed: 3,
            ..MoeConfig::default()
        },
        MoeConfig {
            world: 8,
            ep: 8,
            tokens: 20,
            hidden: 2,
            ..MoeConfig::default()
        },
        MoeConfig {
            world: 4,
            ep: 1,
            ..MoeConfig::default()
        },
        MoeConfig {
            world: 4,
            ep: 4,
            tokens: 0,
            ..MoeConfig::default()
        },
    ];
    for cfg in cases {
        let out = backend_local::run(cfg.world, &Default::default(), |f, w| run_rank(f, &w, &cfg))
            .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        for o in &out {
            assert!(o.problems.is_empty(), "{cfg:?}: {:?}", o.problems);
            assert_eq!(o.all, out[0].all, "every rank holds the same reports");
        }
        let (lines, ok) = summary(&cfg, &out[0].all);
        assert!(ok, "{cfg:?}: {lines:?}");
        // What each expert received is what the sources sent it (the counts exchange), and the
        // idle expert and the silent source are idle and silent.
        for r in &out[0].all {
            let e = r
                .group
                .iter()
                .position(|&m| m == r.rank)
                .expect("in its group");
            for (j, &src) in r.group.iter().enumerate() {
                let s = out[0].all.iter().find(|x| x.rank == src).expect("report");
                assert_eq!(r.received[j], s.sent[e], "{cfg:?}");
            }
            if idle_expert(cfg.seed, r.group.len()) == Some(e) {
                assert_eq!(r.received.iter().sum::<usize>(), 0, "{cfg:?}");
            }
            if silent_source(cfg.seed, r.group.len()) == Some(e) {
                assert_eq!(r.sent.iter().sum::<usize>(), 0, "{cfg:?}");
            }
        }
    }
}

#[test]
fn a_world_of_the_wrong_size_is_refused() {
    let cfg = MoeConfig::default(); // 8 ranks
    let err = backend_local::run(4, &Default::default(), |f, w| run_rank(f, &w, &cfg))
        .expect_err("4 ranks cannot run a layout of 8");
    let msg = err.to_string();
    assert!(msg.contains("--world 8") && msg.contains("has 4"), "{msg}");
}
