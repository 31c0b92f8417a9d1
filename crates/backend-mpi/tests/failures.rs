//! Failure handling on MPI (issue #11), under `mpirun`: time limits, `abort()`, the clean end of
//! the job for operations MPI cannot cancel, count mismatches on both sides of the mismatch
//! check's threshold, and what Open MPI 4.1 does when a rank dies.
//!
//! The `mpi_fail_helper_*` tests are bodies that fail on purpose: they do so only when the
//! launcher tests below (`mpi_job_*`) run them with `BACKEND_MPI_SCENARIO` set; otherwise they
//! pass at once.

use backend_mpi::testing::{launch_with_env, under_launcher};
use backend_mpi::{mpi_test, MpiFactory, MpiRuntime, EXIT_ABORTED, EXIT_TIMEOUT};
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp, TimeLimit};
use std::time::{Duration, Instant};

fn e(e: Error) -> String {
    e.to_string()
}

/// A fresh communicator over the whole world (so that a failed one does not fail the world).
fn fresh(rt: &MpiRuntime) -> Result<backend_mpi::MpiCommunicator, String> {
    MpiFactory::new()
        .split(rt.world(), Some(0), rt.world().rank())
        .map_err(e)?
        .ok_or_else(|| "every rank is a member".to_string())
}

/// Expects the communicator to refuse further operations with `Error::Aborted`.
fn refuses(c: &backend_mpi::MpiCommunicator, what: &str) -> Result<(), String> {
    match c.barrier() {
        Err(Error::Aborted { .. }) => Ok(()),
        other => Err(format!("{what}: a later barrier returned {other:?}")),
    }
}

// A receive from a peer that never sends: a per-operation limit overrides the default and
// yields Error::Timeout { millis: 300 } promptly, naming the operation, its number and the
// communicator; the communicator then refuses everything with Error::Aborted. `abort()` from
// another thread wakes a receive that has no limit; a nonblocking receive is cancelled too.
mpi_test!(
    mpi_receive_limits_and_abort_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let w = rt.world();
        // The configured default (GRID_MPI_TIMEOUT_MS, else 10 minutes), inherited by splits.
        let configured = backend_mpi::MpiConfig::from_env().map_err(e)?.timeout;
        if w.time_limit() != configured || fresh(rt)?.time_limit() != configured {
            return Err(format!(
                "default limit {}, configured {configured}",
                w.time_limit()
            ));
        }
        let (a, b, c) = (fresh(rt)?, fresh(rt)?, fresh(rt)?);
        let (d, f) = (fresh(rt)?, fresh(rt)?);
        if w.rank() == 0 {
            // 1. Per-operation limit.
            let t = Instant::now();
            let mut buf = [0f32; 4];
            let r = a
                .with_time_limit(Duration::from_millis(300))
                .recv_from(&mut buf[..], 1, 77);
            let took = t.elapsed();
            println!("recv with a 300 ms limit returned after {took:?}");
            match &r {
                Err(Error::Timeout {
                    millis: 300,
                    peer: Some(1),
                    ..
                }) => {}
                other => return Err(format!("recv with a 300 ms limit: {other:?}")),
            }
            if took < Duration::from_millis(300) || took > Duration::from_millis(2000) {
                return Err(format!("the 300 ms limit took {took:?}"));
            }
            let msg = r.unwrap_err().to_string();
            for part in ["recv #0", "split", "world ranks 0, 1", "300 ms", "rank 1"] {
                if !msg.contains(part) {
                    return Err(format!("timeout message without {part:?}: {msg}"));
                }
            }
            refuses(&a, "after the timeout")?;
            // 2. abort() from another thread, the receive having no limit.
            b.set_time_limit(TimeLimit::Unlimited);
            let t = Instant::now();
            let r = std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(200));
                    b.abort();
                });
                b.recv_from(&mut buf[..], 1, 78)
            });
            let took = t.elapsed();
            println!("recv woken by abort() 200 ms after it began, returned after {took:?}");
            if !matches!(r, Err(Error::Aborted { .. })) {
                return Err(format!("recv woken by abort(): {r:?}"));
            }
            if took > Duration::from_millis(2000) {
                return Err(format!("abort() took {took:?} to wake the receive"));
            }
            refuses(&b, "after abort()")?;
            // 3. A nonblocking receive past its limit is cancelled.
            let work = c
                .with_time_limit(Duration::from_millis(200))
                .irecv::<i64>(8, 1, 79)
                .map_err(e)?;
            let t = Instant::now();
            match work.wait() {
                Err(Error::Timeout { millis: 200, .. }) => {}
                other => return Err(format!("irecv with a 200 ms limit: {other:?}")),
            }
            if t.elapsed() > Duration::from_millis(2000) {
                return Err(format!("irecv timeout took {:?}", t.elapsed()));
            }
            refuses(&c, "after the nonblocking timeout")?;
            // 4. A batch whose receive never matches: cancelled, Error::Timeout.
            let mut never = [0u8; 4];
            let r = d
                .with_time_limit(Duration::from_millis(200))
                .batch_p2p(vec![grid_core::P2pOp::Recv {
                    buf: (&mut never[..]).into(),
                    peer: 1,
                    tag: 80,
                }]);
            if !matches!(r, Err(Error::Timeout { millis: 200, .. })) {
                return Err(format!("batch with a 200 ms limit: {r:?}"));
            }
            // 5. A nonblocking send that nobody receives (1 MiB: rendezvous) returns the error from its
            // wait; its buffer is leaked and the job goes on.
            let work = f
                .with_time_limit(Duration::from_millis(200))
                .isend(vec![0u8; 1 << 20], 1, 81)
                .map_err(e)?;
            match work.wait() {
                Err(Error::Timeout {
                    millis: 200,
                    peer: Some(1),
                    ..
                }) => {}
                other => {
                    return Err(format!(
                        "isend with a 200 ms limit: {:?}",
                        other.map(|v| v.len())
                    ))
                }
            }
        }
        // Rank 1 never sent anything: the world is still usable on both ranks.
        let mut s = [1i64];
        w.all_reduce_in_place(&mut s[..], ReduceOp::Sum)
            .map_err(e)?;
        if s[0] != 2 {
            return Err(format!("sum {}", s[0]));
        }
        Ok(())
    }
);

// A nonblocking receive dropped before a message arrived is cancelled: the next message goes to
// the next receive. A receive whose message arrives while it waits completes normally.
mpi_test!(
    mpi_dropped_receive_is_cancelled_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let w = rt.world();
        if w.rank() == 0 {
            drop(w.irecv::<i32>(2, 1, 9).map_err(e)?);
            w.barrier().map_err(e)?;
            let mut got = [0i32; 2];
            w.recv_from(&mut got[..], 1, 9).map_err(e)?;
            if got != [7, 8] {
                return Err(format!("the message went elsewhere: {got:?}"));
            }
            let mut late = [0i32; 1];
            w.with_time_limit(Duration::from_millis(5000))
                .recv_from(&mut late[..], 1, 10)
                .map_err(e)?;
            if late != [11] {
                return Err(format!("late message {late:?}"));
            }
        } else {
            w.barrier().map_err(e)?;
            w.send_to(&[7i32, 8][..], 0, 9).map_err(e)?;
            std::thread::sleep(Duration::from_millis(300));
            w.send_to(&[11i32][..], 0, 10).map_err(e)?;
        }
        Ok(())
    }
);

// Sends, receives and batches that complete normally are unaffected by a short limit, and a
// receive that arrives while its wait runs completes.
mpi_test!(
    mpi_point_to_point_within_limits_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let w = rt.world();
        let c = w.with_time_limit(Duration::from_millis(5000));
        let peer = 1 - w.rank();
        for i in 0..200u32 {
            let big = vec![i as f32; 1 << 16]; // 256 KiB: rendezvous protocol
            let mut got = vec![0f32; 1 << 16];
            if w.rank() == 0 {
                c.send_to(&big[..], peer, i).map_err(e)?;
                c.recv_from(&mut got[..], peer, i).map_err(e)?;
            } else {
                c.recv_from(&mut got[..], peer, i).map_err(e)?;
                c.send_to(&big[..], peer, i).map_err(e)?;
            }
            if got[got.len() - 1] != i as f32 {
                return Err(format!("round {i}: got {}", got[got.len() - 1]));
            }
            let mine = [w.rank() as i32; 3];
            let mut theirs = [0i32; 3];
            c.batch_p2p(vec![
                grid_core::P2pOp::Send {
                    buf: (&mine[..]).into(),
                    peer,
                    tag: 1000 + i,
                },
                grid_core::P2pOp::Recv {
                    buf: (&mut theirs[..]).into(),
                    peer,
                    tag: 1000 + i,
                },
            ])
            .map_err(e)?;
            if theirs != [peer as i32; 3] {
                return Err(format!("batch round {i}: {theirs:?}"));
            }
        }
        Ok(())
    }
);

/// Runs a scenario of `mpi_fail_helper_np2` (or `_np4`) under mpirun and returns its output.
fn scenario(np: usize, name: &str, env: &[(&str, &str)]) -> backend_mpi::testing::LaunchOutput {
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let test = format!("mpi_fail_helper_np{np}");
    let args = ["--exact", test.as_str(), "--nocapture", "--test-threads=1"];
    let mut all = vec![("BACKEND_MPI_SCENARIO", name)];
    all.extend_from_slice(env);
    match launch_with_env(np, 60, &exe, &args, &all) {
        Ok(o) => o,
        Err(err) => panic!("{name}: {err}"),
    }
}

fn helper(rt: &MpiRuntime) -> Result<(), String> {
    let w = rt.world();
    let scenario = std::env::var("BACKEND_MPI_SCENARIO").unwrap_or_default();
    let me = w.rank();
    match scenario.as_str() {
        // Rank 1 never enters the all-reduce: rank 0 ends the job at its 500 ms limit.
        "collective-timeout" => {
            if me == 0 {
                let mut v = [1f32; 4];
                let r = w
                    .with_time_limit(Duration::from_millis(500))
                    .all_reduce_in_place(&mut v[..], ReduceOp::Sum);
                return Err(format!("the all-reduce returned: {r:?}"));
            }
            std::thread::sleep(Duration::from_secs(20));
            Err("rank 1 outlived the job".into())
        }
        // abort() from another thread while rank 0 is stuck in a collective without a limit.
        "collective-abort" => {
            if me == 0 {
                w.set_time_limit(TimeLimit::Unlimited);
                let r = std::thread::scope(|s| {
                    s.spawn(|| {
                        std::thread::sleep(Duration::from_millis(300));
                        w.abort();
                    });
                    w.barrier()
                });
                return Err(format!("the barrier returned: {r:?}"));
            }
            std::thread::sleep(Duration::from_secs(20));
            Err("rank 1 outlived the job".into())
        }
        // Rank 1 never takes part in the split: rank 0's MPI_Comm_split ends the job at the
        // world's 500 ms limit.
        "split-timeout" => {
            if me == 0 {
                w.set_time_limit(TimeLimit::from_millis(500));
                let r = MpiFactory::new().split(w, Some(0), 0);
                return Err(format!("the split returned: {:?}", r.map(|c| c.is_some())));
            }
            std::thread::sleep(Duration::from_secs(20));
            Err("rank 1 outlived the job".into())
        }
        // A send of 1 MiB (rendezvous) that nobody receives.
        "send-timeout" => {
            if me == 0 {
                let big = vec![0u8; 1 << 20];
                let r = w
                    .with_time_limit(Duration::from_millis(400))
                    .send_to(&big[..], 1, 5);
                return Err(format!("the send returned: {r:?}"));
            }
            std::thread::sleep(Duration::from_secs(20));
            Err("rank 1 outlived the job".into())
        }
        // Counts on both sides of the check's threshold (COUNT elements on rank 0, 4 on the
        // others), with the default checking mode: no rank crashes or returns wrong data.
        "straddle" => {
            let n: usize = std::env::var("COUNT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(65536);
            let n = if me == 0 { n } else { 4 };
            let mut v = vec![1i32; n];
            let r = w
                .with_time_limit(Duration::from_millis(1000))
                .all_reduce_in_place(&mut v[..], ReduceOp::Sum);
            Err(format!("rank {me}: the all-reduce of {n} returned {r:?}"))
        }
        // Rank 1 stops itself (SIGSTOP) in the middle of a loop: nobody gets an error from MPI
        // and mpirun notices nothing; the others end the job at their 3 s limit.
        "sigstop" => {
            // In step first under the default limit (start-up can be slow on a loaded machine),
            // then a limit long enough that scheduling delays of 4 ranks on 2 cores never reach it.
            w.barrier().map_err(e)?;
            w.set_time_limit(TimeLimit::from_millis(3000));
            let mut v = [1f32; 16];
            for i in 0.. {
                if me == 1 && i == 100 {
                    // raise(): the process is stopped before the call returns, so it never
                    // enters all-reduce #101 (a `kill -STOP` from a child process can land a few
                    // iterations later on a loaded machine).
                    let _ = signal_hook::low_level::raise(signal_hook::consts::SIGSTOP);
                }
                w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)
                    .map_err(e)?;
            }
            Ok(())
        }
        // A loop of all-reduces in which rank 1 kills itself (SIGKILL) at iteration 200.
        "sigkill" => {
            let limit: u64 = std::env::var("LIMIT_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(20_000);
            w.set_time_limit(TimeLimit::from_millis(limit));
            let mut v = vec![1f32; 1024];
            for i in 0.. {
                if me == 1 && i == 200 {
                    eprintln!("rank 1: SIGKILL at iteration {i}");
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &std::process::id().to_string()])
                        .status();
                    std::thread::sleep(Duration::from_secs(20));
                }
                w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)
                    .map_err(e)?;
                v.iter_mut().for_each(|x| *x = 1.0);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

mpi_test!(mpi_fail_helper_np2, np = 2, timeout = 60, helper);
mpi_test!(mpi_fail_helper_np4, np = 4, timeout = 60, helper);

fn assert_ended(out: &backend_mpi::testing::LaunchOutput, code: i32, parts: &[&str]) {
    assert_eq!(out.code, Some(code), "exit code: {}", out.output);
    for p in parts {
        assert!(out.output.contains(p), "no {p:?} in:\n{}", out.output);
    }
    assert!(
        !out.output.contains("Segmentation fault") && !out.output.contains("FAILED:"),
        "{}",
        out.output
    );
}

#[test]
fn mpi_job_ends_at_a_collective_timeout() {
    if under_launcher() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("grid-mpi-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let out = scenario(2, "collective-timeout", &[("GRID_TRACE_DIR", &d)]);
    assert_ended(
        &out,
        EXIT_TIMEOUT,
        &[
            "world rank 0: ending the job (MPI_Abort, exit code 124): all_reduce #0 on communicator 'world' (world ranks 0, 1) did not complete within its time limit of 500 ms (timeout)",
            "operation log written to",
        ],
    );
    // One message, from the rank that waited.
    assert_eq!(
        out.output.matches("ending the job").count(),
        1,
        "{}",
        out.output
    );
    assert!(out.elapsed < Duration::from_secs(15), "{:?}", out.elapsed);
    let log = std::fs::read_to_string(dir.join("rank-0.json")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        log.contains("\"all_reduce\"") && log.contains("timeout"),
        "{log}"
    );
}

#[test]
fn mpi_job_ends_when_a_stuck_collective_is_aborted() {
    if under_launcher() {
        return;
    }
    let out = scenario(2, "collective-abort", &[]);
    assert_ended(
        &out,
        EXIT_ABORTED,
        &["world rank 0: ending the job (MPI_Abort, exit code 125): barrier #0 on communicator 'world' (world ranks 0, 1) was still in progress when abort() was called on this rank (abort"],
    );
    assert!(out.elapsed < Duration::from_secs(15), "{:?}", out.elapsed);
}

#[test]
fn mpi_job_ends_at_a_split_timeout() {
    if under_launcher() {
        return;
    }
    let out = scenario(2, "split-timeout", &[]);
    assert_ended(
        &out,
        EXIT_TIMEOUT,
        &["split (creating a sub-communicator) on communicator 'world' (world ranks 0, 1) did not complete within its time limit of 500 ms (timeout)"],
    );
}

#[test]
fn mpi_job_ends_at_a_send_timeout() {
    if under_launcher() {
        return;
    }
    let out = scenario(2, "send-timeout", &[]);
    assert_ended(
        &out,
        EXIT_TIMEOUT,
        &["send #0 on communicator 'world' (world ranks 0, 1) did not complete within its time limit of 400 ms (timeout)"],
    );
}

// 65536 against 4 made one rank segfault, 16383 and 2048 against 4 too (heap corruption by the
// rendezvous protocol). Now the checking rank waits on the check's own communicator and the
// others in the real all-reduce: both reach their limit and the job ends, with no crash.
#[test]
fn mpi_job_straddling_the_check_threshold_ends_cleanly() {
    if under_launcher() {
        return;
    }
    for (np, count) in [(2, "65536"), (2, "2048"), (4, "16383")] {
        let out = scenario(np, "straddle", &[("COUNT", count)]);
        assert_ended(
            &out,
            EXIT_TIMEOUT,
            &["did not complete within its time limit of 1000 ms (timeout)"],
        );
        assert!(
            !out.output.contains("returned"),
            "{np} ranks, {count} against 4: an all-reduce returned:\n{}",
            out.output
        );
    }
}

#[test]
fn mpi_job_with_a_stopped_rank_ends_at_the_limit() {
    if under_launcher() {
        return;
    }
    let out = scenario(4, "sigstop", &[]);
    assert_ended(
        &out,
        EXIT_TIMEOUT,
        &["all_reduce #101 on communicator 'world' (world ranks 0, 1, 2, 3) did not complete within its time limit of 3000 ms (timeout)"],
    );
    assert!(out.elapsed < Duration::from_secs(15), "{:?}", out.elapsed);
}

// What Open MPI 4.1 (Debian 12's 4.1.4) does when a rank dies: the survivors get no error from
// MPI (their all-reduce just stops progressing); mpirun notices the death at once, sends the
// survivors SIGCONT then SIGTERM one second later, and exits with a non-zero code; the
// survivors' SIGTERM report names the operation they were waiting in. A survivor whose time
// limit is shorter than that second ends the job itself with the timeout message.
#[test]
fn mpi_job_when_a_rank_is_killed() {
    if under_launcher() {
        return;
    }
    // Limit 20 s: mpirun's SIGTERM ends the survivors about 1 s after the death.
    let out = scenario(4, "sigkill", &[("LIMIT_MS", "20000")]);
    assert!(
        out.output.contains("rank 1: SIGKILL at iteration 200"),
        "{}",
        out.output
    );
    assert!(
        out.output.contains("exited on signal 9 (Killed)"),
        "mpirun did not report the death:\n{}",
        out.output
    );
    assert_ne!(out.code, Some(0), "{}", out.output);
    assert!(
        out.elapsed < Duration::from_secs(12),
        "{:?}: {}",
        out.elapsed,
        out.output
    );
    assert!(
        !out.output.contains("FAILED:"),
        "a survivor got an error: {}",
        out.output
    );
    // Each survivor says where it was when mpirun's SIGTERM came (mpirun may drop some lines
    // of the ranks it kills: at least one arrives).
    assert!(
        out.output.contains("terminated by SIGTERM (mpirun ends the whole job when a process died or exited without MPI_Finalize) while waiting in")
            && out.output.contains("on communicator 'world' (world ranks 0, 1, 2, 3); time limit 20000 ms"),
        "{}",
        out.output
    );
    // Limit 300 ms: the survivors' own limit comes first. The all-reduce of 4 KiB carries its
    // mismatch check in one round of messages (`ROUND_MAX`), so the survivors wait in the
    // all-reduce itself, the one rank 1 never entered.
    let out = scenario(4, "sigkill", &[("LIMIT_MS", "300")]);
    assert!(
        out.output.contains(
            "all_reduce #200 on communicator 'world' (world ranks 0, 1, 2, 3) did not complete"
        ) && out
            .output
            .contains("did not complete within its time limit of 300 ms (timeout)"),
        "{}",
        out.output
    );
    assert!(out.elapsed < Duration::from_secs(12), "{:?}", out.elapsed);
}
