//! Failure scenarios with real processes: `gloo-loop` (4 processes meeting through a directory
//! and through a `redis-server` of the test's own) and `mpi-loop` (under `mpirun -np 4`), each
//! told a fault with `--fault RANK:KIND@ITER` (see `grid_programs::smoke::FaultKind`).
//!
//! Every scenario asserts, as docs/when-a-job-fails.md promises:
//! * every rank but a killed one ends on its own with exactly one JSON line carrying an error,
//!   and exit status 1: no process is terminated by a signal (a library thread's `abort()`, a
//!   segfault) except the rank the scenario kills;
//! * every rank that is not deliberately delayed by its fault returns its error within the
//!   timeout plus [`MARGIN`] of posting the operation it failed in (from its own operation
//!   log: the dump's time against the last operation's posting time); a rank whose watchdog
//!   called `abort()` returns an error saying so within [`ABORT_MARGIN`] of the call;
//! * `grid trace --format json` on the dumps names the culprit: the killed or skipping rank as
//!   the world communicator's only `missing_ranks`, or the disagreement in `mismatches` at the
//!   fault's sequence number, with the faulty rank's value apart from every other rank's;
//! * with `GRID_DEBUG=detail`, every rank's error is the check's ("ranks disagree on ...");
//!   the same scenarios without it run with each backend's default check.
//!
//! The Gloo rendezvous scenarios (Redis down at start, killed during the rendezvous, a store
//! directory left by an earlier job) assert a clear error on every rank within the timeout plus
//! the margin of its start, and a trace that blames nobody (no communicator was created).
//!
//! Under `mpirun`, each rank runs inside `sh`, which writes the rank's output and exit status to
//! files (`mpirun` forwards output unreliably once ranks die), and `mpirun` runs with
//! `orte_enable_recovery=1` and `orte_abort_on_non_zero_status=0`, so that it lets every rank
//! end by itself instead of killing the job when the first rank exits (its default).

mod common;

use common::{example, fresh_dir, grid_command, start_redis};
use grid_core::oplog::TraceDump;
use serde_json::Value;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Ranks per scenario.
const RANKS: usize = 4;
/// All-reduces per rank.
const ITERS: u64 = 20;
/// The iteration at which the fault strikes.
const FAULT_ITER: u64 = 5;
/// The faulty rank.
const FAULTY: usize = 2;
/// Bytes per all-reduce.
const BYTES: usize = 4096;
/// The time limit of every operation.
const TIMEOUT_MS: u64 = 3000;
/// How much later than its timeout a rank may return its error (docs/when-a-job-fails.md).
const MARGIN: Duration = Duration::from_secs(2);
/// How much later than the `abort()` call (a third of the timeout after the operation was
/// posted) a stuck operation must return (docs/when-a-job-fails.md): well before its timeout.
const ABORT_MARGIN: Duration = Duration::from_secs(1);
/// A scenario that has not ended after this long is a hang.
const HANG: Duration = Duration::from_secs(30);

fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS)
}

/// What `grid trace` must find.
#[derive(Debug, Clone, Copy)]
enum Culprit {
    /// The faulty rank is the world communicator's only missing rank.
    Missing,
    /// A mismatch of this trace field at the fault's sequence number, and, with the check on,
    /// the check's field name in every rank's error.
    Mismatch {
        field: &'static str,
        check: Option<&'static str>,
    },
}

/// The culprit of each fault kind.
fn culprit(kind: &str) -> Culprit {
    let mismatch = |field, check| Culprit::Mismatch {
        field,
        check: Some(check),
    };
    match kind {
        "kill" | "skip" | "abort" => Culprit::Missing,
        "count" => mismatch("count", "count"),
        "dtype" => mismatch("dtype", "dtype"),
        "op" => mismatch("reduce_op", "reduce op"),
        "root" => mismatch("root", "root"),
        // Point-to-point is not checked: the send's count against the receive's.
        "long-send" => Culprit::Mismatch {
            field: "count",
            check: None,
        },
        other => panic!("no scenario for fault kind {other}"),
    }
}

/// How one rank ended.
#[derive(Debug)]
struct RankEnd {
    rank: usize,
    stdout: String,
    stderr: String,
    /// Exit code, if it exited.
    code: Option<i32>,
    /// The signal that ended it, if one did.
    signal: Option<i32>,
    /// From its start to its end, as the test saw it (Gloo only).
    took: Option<Duration>,
}

impl RankEnd {
    fn describe(&self) -> String {
        format!(
            "--- rank {} (code {:?}, signal {:?}, took {:?})\n{}{}",
            self.rank, self.code, self.signal, self.took, self.stdout, self.stderr
        )
    }

    /// The one JSON line, or why there is none.
    fn line(&self) -> Result<Value, String> {
        let lines: Vec<&str> = self.stdout.lines().collect();
        match lines[..] {
            [one] => serde_json::from_str(one).map_err(|e| format!("{one:?} is not JSON: {e}")),
            _ => Err(format!(
                "{} lines on stdout, expected exactly one",
                lines.len()
            )),
        }
    }
}

/// Waits for `child` until `deadline`, killing it then (a hang).
fn finish(rank: usize, mut child: Child, started: Instant, deadline: Instant) -> RankEnd {
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() >= deadline => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("waiting for rank {rank}: {e}"),
        }
    };
    let took = started.elapsed();
    if status.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("collect a rank's output");
    let hung = if status.is_none() {
        format!("\n[the test killed this rank: still running after {HANG:?}]")
    } else {
        String::new()
    };
    RankEnd {
        rank,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned() + &hung,
        code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        took: Some(took),
    }
}

/// `GRID_DEBUG` for a scenario: `detail` (the checking mode), or empty, which leaves each
/// backend its default (Gloo checks every collective, MPI blocking collectives of 2 KiB or
/// more; `mpi-loop`'s nonblocking collectives are then unchecked).
fn grid_debug(detail: bool) -> &'static str {
    if detail {
        "detail"
    } else {
        ""
    }
}

/// One `gloo-loop` rank.
fn spawn_gloo(exe: &Path, rank: usize, store: &str, extra: &[String], detail: bool) -> Child {
    let mut c = Command::new(exe);
    c.args(["--rank", &rank.to_string(), "--world-size"])
        .arg(RANKS.to_string())
        .args(["--store", store])
        .args(extra)
        .env("GRID_DEBUG", grid_debug(detail))
        .env_remove("GRID_TRACE_DIR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("start a gloo-loop rank")
}

/// The loop options of a fault scenario.
fn loop_args(trace: &Path, fault: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = [
        "--iters",
        &ITERS.to_string(),
        "--bytes",
        &BYTES.to_string(),
        "--timeout-ms",
        &TIMEOUT_MS.to_string(),
        "--trace-dir",
        &trace.to_string_lossy(),
    ]
    .map(String::from)
    .into();
    if let Some(f) = fault {
        v.extend(["--fault".to_string(), f.to_string()]);
    }
    v
}

/// Where the Gloo ranks meet.
#[derive(Debug, Clone, Copy)]
enum Store {
    File,
    Redis,
}

/// Runs the 4 `gloo-loop` ranks of a scenario; returns how they ended.
fn run_gloo(store: Store, trace: &Path, fault: Option<&str>, detail: bool) -> Vec<RankEnd> {
    let exe = example("gloo-loop");
    let store_dir = fresh_dir("fault-store");
    let redis = matches!(store, Store::Redis).then(start_redis);
    let url = match &redis {
        Some(r) => format!("redis://127.0.0.1:{}/faults", r.port()),
        None => format!("file:{}", store_dir.display()),
    };
    let args = loop_args(trace, fault);
    let started = Instant::now();
    let children: Vec<Child> = (0..RANKS)
        .map(|r| spawn_gloo(&exe, r, &url, &args, detail))
        .collect();
    let ends = children
        .into_iter()
        .enumerate()
        .map(|(r, c)| finish(r, c, started, started + HANG))
        .collect();
    let _ = std::fs::remove_dir_all(&store_dir);
    ends
}

/// The `sh` wrapper of each MPI rank: output and exit status to files named by the rank.
const MPI_WRAPPER: &str = r#"out="$GRID_FAULT_OUT/rank-$OMPI_COMM_WORLD_RANK"; "$@" >"$out.stdout" 2>"$out.stderr"; s=$?; echo $s >"$out.status"; exit $s"#;

/// Runs `mpirun -np 4 mpi-loop` for a scenario; returns how each rank ended.
fn run_mpi(trace: &Path, fault: Option<&str>, detail: bool) -> (Vec<RankEnd>, String) {
    let exe = example("mpi-loop");
    let outputs = fresh_dir("fault-mpi-out");
    let out_env = outputs.to_string_lossy().into_owned();
    let mut argv: Vec<String> = vec![
        "-c".into(),
        MPI_WRAPPER.into(),
        "sh".into(),
        exe.to_string_lossy().into_owned(),
    ];
    argv.extend(loop_args(trace, fault));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let env = [
        ("GRID_FAULT_OUT", out_env.as_str()),
        ("GRID_DEBUG", grid_debug(detail)),
        ("OMPI_MCA_orte_enable_recovery", "1"),
        ("OMPI_MCA_orte_abort_on_non_zero_status", "0"),
    ];
    let launched =
        backend_mpi::testing::launch_with_env(RANKS, HANG.as_secs(), "/bin/sh", &argv, &env)
            .unwrap_or_else(|e| panic!("mpirun: {e}"));
    let ends = (0..RANKS)
        .map(|r| {
            let read = |ext: &str| {
                std::fs::read_to_string(outputs.join(format!("rank-{r}.{ext}"))).unwrap_or_default()
            };
            let status: Option<i32> = read("status").trim().parse().ok();
            let mut stderr = read("stderr");
            if status.is_none() {
                stderr.push_str("\n[no exit status: the rank's shell was ended (by mpirun?)]");
            }
            RankEnd {
                rank: r,
                stdout: read("stdout"),
                stderr,
                // sh reports death by signal N as status 128 + N.
                code: status.filter(|s| *s < 128),
                signal: status.filter(|s| *s > 128).map(|s| s - 128),
                took: None,
            }
        })
        .collect();
    let _ = std::fs::remove_dir_all(&outputs);
    let mpirun = format!(
        "mpirun: exit {:?} after {:.1} s\n{}",
        launched.code,
        launched.elapsed.as_secs_f64(),
        launched.output
    );
    (ends, mpirun)
}

/// `grid trace --format json DIR`.
fn grid_trace(trace: &Path) -> Result<Value, String> {
    let out = Command::new(grid_command())
        .args(["trace", "--format", "json"])
        .arg(trace)
        .output()
        .map_err(|e| format!("cannot run grid trace: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "grid trace exited {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("grid trace printed no JSON: {e}"))
}

/// The world communicator's findings in a `grid trace` report.
fn world_report(report: &Value) -> Option<&Value> {
    let world: Vec<Value> = (0..RANKS).map(Value::from).collect();
    report["communicators"]
        .as_array()?
        .iter()
        .find(|c| c["ranks"].as_array() == Some(&world))
}

/// Checks one fault scenario's ends, dumps and trace; panics with every problem found and
/// every rank's output.
fn check_fault(label: &str, kind: &str, detail: bool, ends: &[RankEnd], trace: &Path, extra: &str) {
    let culprit = culprit(kind);
    let mut problems = Vec::new();
    for end in ends {
        let r = end.rank;
        let killed = kind == "kill" && r == FAULTY;
        if killed {
            if end.signal != Some(9) {
                problems.push(format!(
                    "rank {r} was to kill itself with SIGKILL; it ended with code {:?}, signal {:?}",
                    end.code, end.signal
                ));
            }
            continue;
        }
        if let Some(sig) = end.signal {
            problems.push(format!("rank {r} was terminated by signal {sig}"));
        }
        if end.signal.is_none() && end.code != Some(1) {
            problems.push(format!(
                "rank {r} exited with {:?}, expected 1 (an error)",
                end.code
            ));
        }
        match end.line() {
            Err(e) => problems.push(format!("rank {r}: {e}")),
            Ok(v) => {
                if v["rank"] != r {
                    problems.push(format!("rank {r} printed rank {}", v["rank"]));
                }
                match v["error"].as_str() {
                    Some(e) if !e.is_empty() => {
                        if kind == "abort" && r != FAULTY && !e.contains("abort") {
                            problems.push(format!(
                                "rank {r}: its watchdog called abort(), so the error must say so: {e}"
                            ));
                        }
                        if let (true, Culprit::Mismatch { check: Some(f), .. }) = (detail, culprit)
                        {
                            let want = format!("ranks disagree on {f}");
                            if !e.contains(&want) {
                                problems.push(format!(
                                    "rank {r}: with GRID_DEBUG=detail the error must say {want:?}: {e}"
                                ));
                            }
                        }
                    }
                    _ => problems.push(format!("rank {r} reported no error: {v}")),
                }
            }
        }
        // In time: ranks delayed on purpose by their fault are not bound.
        let delayed = r == FAULTY && matches!(kind, "skip" | "abort");
        if delayed {
            continue;
        }
        let path = trace.join(format!("rank-{r}.json"));
        let dump = match std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|t| TraceDump::from_json(&t).map_err(|e| e.to_string()))
        {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("rank {r}: no usable dump {}: {e}", path.display()));
                continue;
            }
        };
        let last = dump
            .communicators
            .iter()
            .find(|c| c.ranks == (0..RANKS).collect::<Vec<_>>())
            .and_then(|c| c.records.last());
        match last {
            None => problems.push(format!(
                "rank {r}: its dump has no operation of the world communicator"
            )),
            Some(op) => {
                let waited = Duration::from_micros(dump.dumped_at_us.saturating_sub(op.posted_us));
                eprintln!(
                    "{label}: rank {r} returned {waited:?} after posting {} #{}",
                    op.op, op.seq
                );
                let bound = if kind == "abort" {
                    timeout() / 3 + ABORT_MARGIN
                } else {
                    timeout() + MARGIN
                };
                if waited > bound {
                    problems.push(format!(
                        "rank {r} returned its error {waited:?} after posting {} #{}: more than {bound:?} ({})",
                        op.op,
                        op.seq,
                        if kind == "abort" {
                            "abort() a third of the timeout in, plus the abort margin"
                        } else {
                            "the timeout plus the margin"
                        }
                    ));
                }
            }
        }
    }
    match grid_trace(trace) {
        Err(e) => problems.push(e),
        Ok(report) => match world_report(&report) {
            None => problems.push(format!("grid trace has no world communicator: {report}")),
            Some(world) => match culprit {
                Culprit::Missing => {
                    if world["missing_ranks"] != serde_json::json!([FAULTY]) {
                        problems.push(format!(
                            "grid trace must name rank {FAULTY} alone in missing_ranks: {world}"
                        ));
                    }
                }
                Culprit::Mismatch { field, .. } => {
                    let found = world["mismatches"].as_array().is_some_and(|ms| {
                        ms.iter().any(|m| {
                            let values = m["values"].as_object();
                            m["field"] == field
                                && m["seq"] == FAULT_ITER
                                && values.is_some_and(|vs| {
                                    let faulty = vs.get(&FAULTY.to_string());
                                    vs.len() >= 2
                                        && faulty.is_some()
                                        && vs
                                            .iter()
                                            .filter(|(k, _)| **k != FAULTY.to_string())
                                            .all(|(_, v)| Some(v) != faulty)
                                })
                        })
                    });
                    if !found {
                        problems.push(format!(
                            "grid trace must report a {field} mismatch at #{FAULT_ITER} with rank {FAULTY} apart: {world}"
                        ));
                    }
                }
            },
        },
    }
    if !problems.is_empty() {
        let outputs: Vec<String> = ends.iter().map(RankEnd::describe).collect();
        panic!(
            "{label}: {} problem(s):\n  {}\n{}\n{extra}",
            problems.len(),
            problems.join("\n  "),
            outputs.join("\n")
        );
    }
}

/// A fault scenario on Gloo.
fn gloo_fault(store: Store, kind: &str, detail: bool) {
    let trace = fresh_dir("fault-trace");
    let fault = format!("{FAULTY}:{kind}@{FAULT_ITER}");
    let ends = run_gloo(store, &trace, Some(&fault), detail);
    let label = format!(
        "gloo ({store:?} store) --fault {fault}, GRID_DEBUG={:?}",
        grid_debug(detail)
    );
    let report = grid_trace(&trace)
        .map(|r| r.to_string())
        .unwrap_or_default();
    check_fault(&label, kind, detail, &ends, &trace, &report);
    let _ = std::fs::remove_dir_all(&trace);
}

/// A fault scenario on MPI.
fn mpi_fault(kind: &str, detail: bool) {
    let trace = fresh_dir("fault-trace");
    let fault = format!("{FAULTY}:{kind}@{FAULT_ITER}");
    let (ends, mpirun) = run_mpi(&trace, Some(&fault), detail);
    let label = format!("mpi --fault {fault}, GRID_DEBUG={:?}", grid_debug(detail));
    check_fault(&label, kind, detail, &ends, &trace, &mpirun);
    let _ = std::fs::remove_dir_all(&trace);
}

macro_rules! scenarios {
    ($run:ident { $($name:ident: $kind:literal, $detail:literal;)* }) => {
        $(
            #[test]
            fn $name() {
                $run($kind, $detail);
            }
        )*
    };
}

fn gloo_file(kind: &str, detail: bool) {
    gloo_fault(Store::File, kind, detail)
}

fn gloo_redis(kind: &str, detail: bool) {
    gloo_fault(Store::Redis, kind, detail)
}

scenarios!(gloo_file {
    gloo_file_kill: "kill", false;
    gloo_file_skip: "skip", false;
    gloo_file_count: "count", false;
    gloo_file_count_checked: "count", true;
    gloo_file_dtype: "dtype", false;
    gloo_file_dtype_checked: "dtype", true;
    gloo_file_root: "root", false;
    gloo_file_root_checked: "root", true;
    gloo_file_op: "op", false;
    gloo_file_op_checked: "op", true;
    gloo_file_long_send: "long-send", false;
    gloo_file_abort: "abort", false;
});

scenarios!(gloo_redis {
    gloo_redis_kill: "kill", false;
    gloo_redis_skip: "skip", false;
    gloo_redis_count: "count", false;
    gloo_redis_count_checked: "count", true;
    gloo_redis_dtype: "dtype", false;
    gloo_redis_dtype_checked: "dtype", true;
    gloo_redis_root: "root", false;
    gloo_redis_root_checked: "root", true;
    gloo_redis_op: "op", false;
    gloo_redis_op_checked: "op", true;
    gloo_redis_long_send: "long-send", false;
    gloo_redis_abort: "abort", false;
});

// Test names carry `mpi_`: nextest runs them one at a time (.config/nextest.toml).
scenarios!(mpi_fault {
    mpi_fault_kill: "kill", false;
    mpi_fault_skip: "skip", false;
    mpi_fault_count: "count", false;
    mpi_fault_count_checked: "count", true;
    mpi_fault_dtype: "dtype", false;
    mpi_fault_dtype_checked: "dtype", true;
    mpi_fault_root: "root", false;
    mpi_fault_root_checked: "root", true;
    mpi_fault_op: "op", false;
    mpi_fault_op_checked: "op", true;
    mpi_fault_long_send: "long-send", false;
    mpi_fault_abort: "abort", false;
});

/// Checks a rendezvous scenario: every rank ends on its own, with one JSON line whose error
/// contains `want`, within the timeout plus the margin of its start; the trace blames nobody.
fn check_rendezvous(label: &str, ends: &[RankEnd], want: &str, trace: &Path) {
    let mut problems = Vec::new();
    for end in ends {
        let r = end.rank;
        if let Some(sig) = end.signal {
            problems.push(format!("rank {r} was terminated by signal {sig}"));
        } else if end.code != Some(1) {
            problems.push(format!("rank {r} exited with {:?}, expected 1", end.code));
        }
        match end.line() {
            Err(e) => problems.push(format!("rank {r}: {e}")),
            Ok(v) => match v["error"].as_str() {
                Some(e) if e.contains(want) => {}
                _ => problems.push(format!("rank {r}: the error must mention {want:?}: {v}")),
            },
        }
        if let Some(took) = end.took {
            if took > timeout() + MARGIN {
                problems.push(format!(
                    "rank {r} ended {took:?} after its start: more than the timeout {:?} + margin {MARGIN:?}",
                    timeout()
                ));
            }
        }
    }
    match grid_trace(trace) {
        Err(e) => problems.push(e),
        Ok(report) => {
            let comms = report["communicators"].as_array().map_or(0, Vec::len);
            let files = report["ranks"].as_array().map_or(0, Vec::len);
            if comms != 0 || files != RANKS || report["missing_files"] != serde_json::json!([]) {
                problems.push(format!(
                    "grid trace must read {RANKS} dumps without any communicator (none was created): {report}"
                ));
            }
        }
    }
    if !problems.is_empty() {
        let outputs: Vec<String> = ends.iter().map(RankEnd::describe).collect();
        panic!(
            "{label}: {} problem(s):\n  {}\n{}",
            problems.len(),
            problems.join("\n  "),
            outputs.join("\n")
        );
    }
}

#[test]
fn gloo_redis_down_at_start() {
    let exe = example("gloo-loop");
    let trace = fresh_dir("fault-trace");
    // A port nothing listens on: a server that was started, then stopped.
    let port = {
        let mut redis = start_redis();
        redis.kill();
        redis.port()
    };
    let url = format!("redis://127.0.0.1:{port}/faults");
    let args = loop_args(&trace, None);
    let ends: Vec<RankEnd> = (0..RANKS)
        .map(|r| {
            let started = Instant::now();
            let child = spawn_gloo(&exe, r, &url, &args, false);
            (r, child, started)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|(r, c, started)| finish(r, c, started, started + HANG))
        .collect();
    check_rendezvous("gloo, Redis down at start", &ends, "redis", &trace);
    let _ = std::fs::remove_dir_all(&trace);
}

#[test]
fn gloo_redis_killed_during_rendezvous() {
    let exe = example("gloo-loop");
    let trace = fresh_dir("fault-trace");
    let mut redis = start_redis();
    let url = format!("redis://127.0.0.1:{}/faults", redis.port());
    let args = loop_args(&trace, None);
    // Ranks 0..2 start and wait in the rendezvous for rank 3, which is not there yet.
    let mut started: Vec<(usize, Child, Instant)> = (0..RANKS - 1)
        .map(|r| (r, spawn_gloo(&exe, r, &url, &args, false), Instant::now()))
        .collect();
    std::thread::sleep(timeout() / 3);
    redis.kill();
    // Rank 3 comes late and finds no server.
    started.push((
        RANKS - 1,
        spawn_gloo(&exe, RANKS - 1, &url, &args, false),
        Instant::now(),
    ));
    let ends: Vec<RankEnd> = started
        .into_iter()
        .map(|(r, c, t)| finish(r, c, t, t + HANG))
        .collect();
    check_rendezvous(
        "gloo, Redis killed during the rendezvous",
        &ends,
        "redis",
        &trace,
    );
    let _ = std::fs::remove_dir_all(&trace);
}

#[test]
fn gloo_stale_store_directory() {
    let exe = example("gloo-loop");
    let store = fresh_dir("fault-stale-store");
    let url = format!("file:{}", store.display());
    // An earlier job ran to completion in the same directory (and left its keys there).
    let first_trace = fresh_dir("fault-trace");
    let started = Instant::now();
    let first: Vec<RankEnd> = (0..RANKS)
        .map(|r| spawn_gloo(&exe, r, &url, &loop_args(&first_trace, None), false))
        .collect::<Vec<_>>()
        .into_iter()
        .enumerate()
        .map(|(r, c)| finish(r, c, started, started + HANG))
        .collect();
    for end in &first {
        assert_eq!(
            end.code,
            Some(0),
            "the earlier job failed:\n{}",
            end.describe()
        );
    }
    let trace = fresh_dir("fault-trace");
    let args = loop_args(&trace, None);
    let ends: Vec<RankEnd> = (0..RANKS)
        .map(|r| (r, spawn_gloo(&exe, r, &url, &args, false), Instant::now()))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|(r, c, t)| finish(r, c, t, t + HANG))
        .collect();
    check_rendezvous(
        "gloo, a stale store directory",
        &ends,
        "earlier run of job",
        &trace,
    );
    for d in [store, first_trace, trace] {
        let _ = std::fs::remove_dir_all(d);
    }
}
