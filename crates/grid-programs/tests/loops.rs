//! The smoke-test programs `gloo-loop` and `mpi-loop` (examples of this crate, built by
//! `cargo test` beside the tests): their JSON line, exit status and operation-log dumps.

mod common;

use common::{example, fresh_dir};
use grid_core::oplog::{OpState, TraceDump};
use grid_core::trace::analyze;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn spawn_rank(exe: &Path, rank: usize, size: usize, store: &Path, extra: &[&str]) -> Child {
    Command::new(exe)
        .args([
            "--rank",
            &rank.to_string(),
            "--world-size",
            &size.to_string(),
        ])
        .arg("--store")
        .arg(format!("file:{}", store.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a rank")
}

/// Waits for `child` at most `limit`; kills it (and fails the test) after that.
fn wait_within(mut child: Child, limit: Duration, what: &str) -> (Output, Duration) {
    let start = Instant::now();
    loop {
        match child.try_wait().expect("wait for a rank") {
            Some(_) => break,
            None if start.elapsed() > limit => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("collect a killed rank");
                panic!(
                    "{what} did not end within {limit:?}; it wrote:\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let elapsed = start.elapsed();
    (child.wait_with_output().expect("collect a rank"), elapsed)
}

/// The one JSON line a rank printed.
fn json_line(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "exactly one line expected, got {stdout:?} (stderr {:?})",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", lines[0]))
}

#[test]
fn gloo_loop_three_processes_complete_every_iteration() {
    let exe = example("gloo-loop");
    let store = fresh_dir("gloo-loop-store");
    let ranks: Vec<Child> = (0..3)
        .map(|r| spawn_rank(&exe, r, 3, &store, &["--iters", "20", "--bytes", "4096"]))
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let (out, _) = wait_within(child, Duration::from_secs(60), &format!("rank {r}"));
        let v = json_line(&out);
        assert_eq!(
            v,
            serde_json::json!({"rank": r, "completed": 20, "error": null}),
            "rank {r}"
        );
        assert!(out.status.success(), "rank {r}: {:?}", out.status);
    }
    std::fs::remove_dir_all(&store).expect("remove the store");
}

#[test]
fn gloo_loop_survivors_report_a_killed_rank_and_dump_their_logs() {
    let exe = example("gloo-loop");
    let store = fresh_dir("gloo-loop-kill-store");
    let trace = match std::env::var_os("GRID_LOOP_TEST_TRACE_DIR") {
        // To look at the dumps afterwards: a directory the test keeps.
        Some(d) => PathBuf::from(d),
        None => fresh_dir("gloo-loop-kill-trace"),
    };
    let trace_arg = trace.to_string_lossy().into_owned();
    let args = [
        "--seconds",
        "30",
        "--timeout-ms",
        "3000",
        "--bytes",
        "4096",
        "--trace-dir",
        &trace_arg,
    ];
    let mut ranks: Vec<Child> = (0..3)
        .map(|r| spawn_rank(&exe, r, 3, &store, &args))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let mut victim = ranks.pop().expect("rank 2");
    victim.kill().expect("SIGKILL rank 2");
    let _ = victim.wait();
    for (r, child) in ranks.into_iter().enumerate() {
        // Timeout + margin after the kill.
        let (out, took) = wait_within(child, Duration::from_secs(8), &format!("rank {r}"));
        let v = json_line(&out);
        assert_eq!(v["rank"], r, "{v}");
        assert!(v["completed"].as_u64().is_some(), "{v}");
        assert!(
            v["error"].as_str().is_some_and(|e| !e.is_empty()),
            "rank {r} must report an error: {v}"
        );
        assert!(!out.status.success(), "rank {r} exited {:?}", out.status);
        eprintln!("rank {r} ended {took:?} after the kill: {v}");
    }
    // Both survivors dumped; the killed rank could not. The analysis names rank 2.
    let dumps: Vec<(usize, Option<TraceDump>)> = (0..3)
        .map(|r| {
            let path = trace.join(format!("rank-{r}.json"));
            let dump = std::fs::read_to_string(&path)
                .ok()
                .map(|t| TraceDump::from_json(&t).expect("a valid dump"));
            (r, dump)
        })
        .collect();
    assert!(dumps[0].1.is_some() && dumps[1].1.is_some(), "{dumps:#?}");
    assert!(dumps[2].1.is_none());
    for (r, d) in &dumps[..2] {
        let d = d.as_ref().expect("checked above");
        assert_eq!(d.rank, *r);
        assert!(
            d.reason.starts_with("failure: ") || d.reason == "timeout",
            "{}",
            d.reason
        );
    }
    let report = analyze(dumps, &[0, 1, 2]);
    let world = report
        .communicators
        .iter()
        .find(|c| c.ranks == [0, 1, 2])
        .unwrap_or_else(|| panic!("no world communicator in {report:#?}"));
    assert!(
        world.missing_ranks.contains(&2),
        "rank 2 must be missing: {world:#?}"
    );
    assert!(!world.missing_ranks.contains(&0) && !world.missing_ranks.contains(&1));
    std::fs::remove_dir_all(&store).expect("remove the store");
    if std::env::var_os("GRID_LOOP_TEST_TRACE_DIR").is_none() {
        std::fs::remove_dir_all(&trace).expect("remove the dumps");
    }
}

#[test]
fn gloo_loop_dumps_its_log_on_sigusr1_and_carries_on() {
    let exe = example("gloo-loop");
    let store = fresh_dir("gloo-loop-usr1-store");
    let trace = fresh_dir("gloo-loop-usr1-trace");
    let trace_arg = trace.to_string_lossy().into_owned();
    let args = [
        "--seconds",
        "4",
        "--bytes",
        "4096",
        "--trace-dir",
        &trace_arg,
    ];
    let ranks: Vec<Child> = (0..2)
        .map(|r| spawn_rank(&exe, r, 2, &store, &args))
        .collect();
    // Long enough for the ranks to have met (the handler is installed with the first
    // communicator); the loop runs for 4 s.
    std::thread::sleep(Duration::from_secs(2));
    let status = Command::new("kill")
        .args(["-USR1", &ranks[0].id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let path = trace.join("rank-0.json");
    let start = Instant::now();
    while !path.exists() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let dump = TraceDump::from_json(
        &std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("no dump at {}: {e}", path.display())),
    )
    .expect("a valid dump");
    assert_eq!((dump.rank, dump.reason.as_str()), (0, "SIGUSR1"));
    let world = dump
        .communicators
        .iter()
        .find(|c| c.ranks == [0, 1])
        .expect("the world communicator's log");
    assert!(world.records.iter().any(|r| r.op == "all_reduce"));
    // The signal did not disturb the loop.
    for (r, child) in ranks.into_iter().enumerate() {
        let (out, _) = wait_within(child, Duration::from_secs(30), &format!("rank {r}"));
        let v = json_line(&out);
        assert_eq!(v["error"], serde_json::Value::Null, "rank {r}: {v}");
        assert!(out.status.success(), "rank {r}: {:?}", out.status);
    }
    assert!(
        !trace.join("rank-1.json").exists(),
        "rank 1 was not signalled"
    );
    std::fs::remove_dir_all(&store).expect("remove the store");
    std::fs::remove_dir_all(&trace).expect("remove the dumps");
}

#[test]
fn gloo_loop_rejects_bad_options_with_one_line_and_status_2() {
    let exe = example("gloo-loop");
    for args in [
        &["--rank", "0", "--world-size", "2"][..],
        &["--rank", "2", "--world-size", "2", "--store", "file:/tmp/x"],
        &["--rank", "0", "--world-size", "2", "--store", "tcp://x"],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--bytes",
            "6",
        ],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--iters",
            "2",
            "--seconds",
            "1",
        ],
        &["--frobnicate", "1"],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--fault",
            "1:crash@3",
        ],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--fault",
            "2:kill@3",
        ],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--iters",
            "3",
            "--fault",
            "1:kill@3",
        ],
        &[
            "--rank",
            "0",
            "--world-size",
            "2",
            "--store",
            "file:/tmp/x",
            "--seconds",
            "3",
            "--fault",
            "1:kill@0",
        ],
        &["--iters"],
    ] {
        let out = Command::new(&exe)
            .args(args)
            .output()
            .expect("run gloo-loop");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err:?}");
        assert!(err.starts_with("gloo-loop: "), "{err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn mpi_loop_two_ranks_complete_every_iteration() {
    let exe = example("mpi-loop");
    let exe = exe.to_string_lossy();
    // With --trace-dir too: the recorder is installed before MPI creates the world
    // communicator, and nothing is dumped when nothing fails.
    let trace = fresh_dir("mpi-loop-trace");
    let trace_arg = trace.to_string_lossy().into_owned();
    let args = [
        "--iters",
        "20",
        "--bytes",
        "4096",
        "--trace-dir",
        &trace_arg,
    ];
    let out = backend_mpi::testing::launch(2, 60, &exe, &args).expect("mpirun runs");
    let dumped = std::fs::read_dir(&trace).map_or(0, |d| d.count());
    std::fs::remove_dir_all(&trace).expect("remove the dump directory");
    assert_eq!(dumped, 0, "a clean run dumps nothing");
    assert_eq!(out.code, Some(0), "{}", out.output);
    let mut lines: Vec<serde_json::Value> = out
        .output
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    lines.sort_by_key(|v| v["rank"].as_u64());
    assert_eq!(
        lines,
        vec![
            serde_json::json!({"rank": 0, "completed": 20, "error": null}),
            serde_json::json!({"rank": 1, "completed": 20, "error": null}),
        ],
        "{}",
        out.output
    );
}

#[test]
fn mpi_loop_timeout_reports_and_dumps_the_timed_out_all_reduce() {
    let exe = example("mpi-loop");
    let exe = exe.to_string_lossy();
    // 64 MiB cannot be all-reduced in 1 ms: every rank times out in its first iteration.
    let trace = fresh_dir("mpi-loop-timeout-trace");
    let trace_arg = trace.to_string_lossy().into_owned();
    let args = [
        "--bytes",
        "67108864",
        "--timeout-ms",
        "1",
        "--iters",
        "3",
        "--trace-dir",
        &trace_arg,
    ];
    let out = backend_mpi::testing::launch(2, 60, &exe, &args).expect("mpirun runs");
    assert_ne!(out.code, Some(0), "{}", out.output);
    let line = out
        .output
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in {}", out.output));
    let v: serde_json::Value = serde_json::from_str(line).expect("JSON");
    assert_eq!(
        v["error"],
        "all_reduce #0 on communicator 'world' (world ranks 0, 1): timed out after 1 ms",
        "{v}"
    );
    assert_eq!(v["completed"], 0, "{v}");
    // The first rank to exit makes mpirun end the other, which may not have dumped yet: at
    // least one dump, and every dump names the timeout and holds the all-reduce, failed by it.
    let dumps: Vec<TraceDump> = (0..2)
        .filter_map(|r| std::fs::read_to_string(trace.join(format!("rank-{r}.json"))).ok())
        .map(|t| TraceDump::from_json(&t).expect("a valid dump"))
        .collect();
    assert!(
        !dumps.is_empty(),
        "no dump in {}: {}",
        trace.display(),
        out.output
    );
    for d in &dumps {
        assert_eq!(d.reason, "timeout");
        let world = d
            .communicators
            .iter()
            .find(|c| c.ranks == [0, 1])
            .expect("the world communicator");
        let last = world.records.last().expect("a record");
        assert_eq!(
            (last.op.as_str(), last.count, last.state.name()),
            ("all_reduce", 16 << 20, "failed")
        );
        assert!(
            matches!(&last.state, OpState::Failed { reason } if reason.contains("timed out after 1 ms")),
            "{:?}",
            last.state
        );
    }
    std::fs::remove_dir_all(&trace).expect("remove the dumps");
}

/// `nccl-loop` under mpirun: with GPUs for both ranks it completes every iteration; without
/// (CI), every rank that reports prints one line naming what is missing (the driver, libnccl
/// or a GPU), completes nothing and fails the job, and nothing hangs.
#[test]
fn nccl_loop_mpi_bootstrap_completes_or_names_what_is_missing() {
    let exe = example("nccl-loop");
    let exe = exe.to_string_lossy();
    let out = backend_mpi::testing::launch(2, 60, &exe, &["--iters", "5", "--bytes", "4096"])
        .expect("mpirun runs");
    let lines: Vec<serde_json::Value> = out
        .output
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert!(!lines.is_empty(), "no rank reported: {}", out.output);
    match backend_nccl::probe::gpu_count() {
        Ok(n) if n >= 2 => {
            assert_eq!(out.code, Some(0), "{}", out.output);
            assert_eq!(lines.len(), 2, "{}", out.output);
            for l in &lines {
                assert_eq!(l["completed"], 5, "{l}");
                assert!(l["error"].is_null(), "{l}");
            }
        }
        _ => {
            assert_ne!(out.code, Some(0), "{}", out.output);
            for l in &lines {
                assert_eq!(l["completed"], 0, "{l}");
                let e = l["error"]
                    .as_str()
                    .unwrap_or_else(|| panic!("no error: {l}"));
                assert!(
                    ["CUDA driver", "libnccl", "GPU"]
                        .iter()
                        .any(|w| e.contains(w)),
                    "the error does not say what is missing: {e}"
                );
            }
        }
    }
    // A bad option: status 2 and one line, before MPI starts.
    let bad = Command::new(&*exe)
        .args(["--iters", "x"])
        .output()
        .expect("run nccl-loop");
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.starts_with("nccl-loop: "), "{err}");
}
