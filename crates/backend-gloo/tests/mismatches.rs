//! Disagreements between ranks on Gloo, with ranks as real processes (this test binary started
//! once per rank, meeting through a directory): a send longer or shorter than the posted
//! receive, another element type, a collective whose count, element type, reduction or root
//! differs between ranks, a rank that skips a collective or never arrives. None may terminate a
//! process or return `Ok` with wrong data: every case ends with the exact error on every rank
//! involved, and every process exits normally (never by a signal such as SIGABRT).
//!
//! Each child runs its scenario, asserts its own results and prints `CHECKED <scenario> rank R`
//! as its last line; the parent requires that line from every rank, exit status 0 and no
//! signal. Every child is killed at a deadline, so a hang fails the test instead of blocking it.

mod common;

use common::procs::forward_output;

use backend_gloo::{env, init_from_env, run_ranks, GlooCommunicator, GlooConfig};
use grid_core::{
    Communicator, CommunicatorExt, DType, Error, HostBuffer, MismatchCheck, P2pOp, ReduceOp,
};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Set in the environment of the child processes.
const CHILD: &str = "GRID_GLOO_MISMATCH_CHILD";

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `test` as `n` rank processes (operation timeout `timeout_ms`, extra environment
/// `envs`) and requires every rank to exit 0, by itself, after printing its CHECKED line.
fn run_processes(test: &str, n: usize, timeout_ms: u64, envs: &[(&str, &str)]) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let job = format!("{test}-{}-{nanos}", std::process::id());
    let dir = std::env::temp_dir().join(format!("gloo-mismatch-{job}"));
    let exe = std::env::current_exe().expect("test binary path");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut children = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, n.to_string())
            .env(env::STORE, format!("file:{}", dir.display()))
            .env(env::JOB_ID, &job)
            .env(env::TIMEOUT_MS, timeout_ms.to_string())
            .env_remove("GRID_DEBUG")
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start a rank process");
        forward_output(&mut child, rank, &tx);
        children.push(child);
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut status = vec![None; n];
    while status.iter().any(Option::is_none) && Instant::now() < deadline {
        for (i, c) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[i] = Some(s);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (i, c) in children.iter_mut().enumerate() {
        if status[i].is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    let mut output = vec![Vec::new(); n];
    // The readers end when the pipes close (every child has exited or was killed).
    while let Ok((r, line)) = rx.recv_timeout(Duration::from_secs(5)) {
        output[r].push(line);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let report = output
        .iter()
        .enumerate()
        .map(|(r, l)| format!("--- rank {r}\n{}", l.join("\n")))
        .collect::<Vec<_>>()
        .join("\n");
    for (r, s) in status.iter().enumerate() {
        let s = s.unwrap_or_else(|| panic!("{test}: rank {r} did not finish in time\n{report}"));
        assert_eq!(
            s.signal(),
            None,
            "{test}: rank {r} was terminated by a signal\n{report}"
        );
        assert!(s.success(), "{test}: rank {r} exited with {s}\n{report}");
        let mark = format!("CHECKED {test} rank {r}");
        assert!(
            output[r].iter().any(|l| l.contains(&mark)),
            "{test}: rank {r} did not check its results\n{report}"
        );
    }
    // Shown with --nocapture: what every rank printed (the errors it checked).
    eprintln!("{report}");
}

fn child_world() -> GlooCommunicator {
    let (_factory, world) = init_from_env().unwrap_or_else(|e| panic!("init: {e}"));
    world
}

fn checked(test: &str, world: &GlooCommunicator) {
    println!("CHECKED {test} rank {}", world.rank());
}

/// Asserts that `e` is the error of a message whose two sides disagreed, with the other rank,
/// the tag and both element types and counts in its message: on the receive's side (`op`
/// `recv` or `batch_p2p` with a receive) naming the sender `peer`, on the send's side (`send`)
/// naming the receiver `peer`.
fn assert_message_mismatch(
    e: Error,
    op: &str,
    peer: usize,
    tag: u32,
    sent: (DType, usize),
    posted: (DType, usize),
) {
    match &e {
        Error::Library(l) => {
            assert_eq!(
                (l.backend, l.op, l.class.as_deref()),
                ("gloo", op, Some("message mismatch")),
                "{e}"
            );
            let wanted = if op == "send" {
                vec![
                    format!(
                        "rank {peer} (world rank {peer}) posted a receive of {} {} elements with tag {tag}",
                        posted.1, posted.0
                    ),
                    format!("send of {} {} elements", sent.1, sent.0),
                ]
            } else {
                vec![
                    format!(
                        "rank {peer} (world rank {peer}) sent {} {} elements with tag {tag}",
                        sent.1, sent.0
                    ),
                    format!("posted {} {} elements", posted.1, posted.0),
                ]
            };
            for w in wanted {
                assert!(l.message.contains(&w), "{e}\nwanted: {w}");
            }
            assert!(l.comm == "w0", "{e}");
        }
        other => panic!("{op}: expected a message mismatch, got {other:?}"),
    }
    assert!(e.is_communication());
}

/// Messages of more than this many bytes are answered by their receiver, so their sender learns
/// of a mismatch too; smaller sends complete without an answer.
const INLINE_MAX: usize = 64 << 10;

// ---- point to point ----------------------------------------------------------------------------

fn p2p_child(test: &str) {
    let world = child_world();
    let me = world.rank();
    let peer = 1 - me;
    // (sent count, posted count) for f32 messages from rank 0 to rank 1: longer and shorter than
    // the receive, inline (up to 64 KiB) and in chunks (more than 64 KiB, several 4 MiB chunks),
    // and crossing the inline limit in both directions.
    let cases: [(usize, usize); 8] = [
        (8, 4),
        (4, 8),
        (0, 1),
        (3_000_000, 1000),
        (100_000, 200_000),
        (16_384, 16_385),
        (16_385, 16_384),
        (2_500_000, 2_000_000),
    ];
    for (i, &(sent, posted)) in cases.iter().enumerate() {
        let tag = 10 + i as u32;
        if me == 0 {
            let data: Vec<f32> = (0..sent).map(|x| x as f32).collect();
            // The receiver consumed (and discarded) the message. A large send learns of the
            // mismatch from the receiver's answer; a small one completes.
            let r = world.send_to(&data[..], peer, tag);
            if sent * 4 > INLINE_MAX {
                let e = r.unwrap_err();
                println!("case {i} (sender): {e}");
                assert_message_mismatch(
                    e,
                    "send",
                    1,
                    tag,
                    (DType::F32, sent),
                    (DType::F32, posted),
                );
            } else {
                r.unwrap_or_else(|e| panic!("case {i}: send: {e}"));
            }
        } else {
            let mut buf = vec![-1.0f32; posted];
            let e = world.recv_from(&mut buf[..], peer, tag).unwrap_err();
            println!("case {i}: {e}");
            assert_message_mismatch(e, "recv", 0, tag, (DType::F32, sent), (DType::F32, posted));
            assert!(
                buf.iter().all(|&x| x == -1.0),
                "case {i}: the receive buffer changed"
            );
        }
    }
    // Another element type of the same size, inline and chunked.
    for (tag, n) in [(30u32, 4usize), (31, 1 << 20)] {
        if me == 0 {
            let r = world.send_to(&vec![7i32; n][..], peer, tag);
            if n * 4 > INLINE_MAX {
                assert_message_mismatch(
                    r.unwrap_err(),
                    "send",
                    1,
                    tag,
                    (DType::I32, n),
                    (DType::F32, n),
                );
            } else {
                r.unwrap();
            }
        } else {
            let mut buf = vec![0.5f32; n];
            let e = world.recv_from(&mut buf[..], peer, tag).unwrap_err();
            assert_message_mismatch(e, "recv", 0, tag, (DType::I32, n), (DType::F32, n));
            assert!(buf.iter().all(|&x| x == 0.5));
        }
    }
    // Nonblocking: the receive's wait returns the error; the send's wait succeeds for a small
    // message and returns the error for a large one.
    if me == 0 {
        let w = world.isend(vec![1u8; 16], peer, 40).unwrap();
        assert_eq!(w.wait().unwrap(), vec![1u8; 16]);
        let w = world.isend(vec![1u8; 100_000], peer, 41).unwrap();
        let e = w.wait().unwrap_err();
        assert_message_mismatch(e, "send", 1, 41, (DType::U8, 100_000), (DType::U8, 50));
    } else {
        let w = world.irecv::<u8>(8, peer, 40).unwrap();
        let e = w.wait().unwrap_err();
        assert_message_mismatch(e, "recv", 0, 40, (DType::U8, 16), (DType::U8, 8));
        let w = world.irecv::<u8>(50, peer, 41).unwrap();
        let e = w.wait().unwrap_err();
        assert_message_mismatch(e, "recv", 0, 41, (DType::U8, 100_000), (DType::U8, 50));
    }
    // A batch: the mismatched receive is named by its position, the batch's other operations
    // complete, the data of the matching receive is right.
    if me == 0 {
        let a = [1i64; 6];
        let b = [2i64; 3];
        world
            .batch_p2p(vec![
                P2pOp::Send {
                    buf: (&a[..]).into(),
                    peer,
                    tag: 50,
                },
                P2pOp::Send {
                    buf: (&b[..]).into(),
                    peer,
                    tag: 51,
                },
            ])
            .unwrap();
    } else {
        let mut a = vec![0i64; 4];
        let mut b = vec![0i64; 3];
        let e = world
            .batch_p2p(vec![
                P2pOp::Recv {
                    buf: (&mut a[..]).into(),
                    peer,
                    tag: 50,
                },
                P2pOp::Recv {
                    buf: (&mut b[..]).into(),
                    peer,
                    tag: 51,
                },
            ])
            .unwrap_err();
        assert!(e.to_string().contains("receive #0 of the batch"), "{e}");
        assert_message_mismatch(e, "batch_p2p", 0, 50, (DType::I64, 6), (DType::I64, 4));
        assert_eq!(a, vec![0; 4]);
        assert_eq!(b, vec![2; 3]);
    }
    // The communicator is intact: matching messages of every kind, both ways, then a collective.
    for n in [0usize, 5, 16_384, 16_385, 1 << 20, 3 << 20] {
        let mine: Vec<f32> = (0..n).map(|x| (x + me) as f32).collect();
        let mut theirs = vec![0.0f32; n];
        if me == 0 {
            world.send_to(&mine[..], peer, 60).unwrap();
            world.recv_from(&mut theirs[..], peer, 61).unwrap();
        } else {
            world.recv_from(&mut theirs[..], peer, 60).unwrap();
            world.send_to(&mine[..], peer, 61).unwrap();
        }
        assert!(
            theirs
                .iter()
                .enumerate()
                .all(|(x, &v)| v == (x + peer) as f32),
            "{n} elements: wrong data"
        );
    }
    let mut s = [1i32];
    world
        .all_reduce_in_place(&mut s[..], ReduceOp::Sum)
        .unwrap();
    assert_eq!(s, [2]);
    checked(test, &world);
}

#[test]
fn p2p_mismatches_are_errors_and_the_communicator_survives() {
    const T: &str = "p2p_mismatches_are_errors_and_the_communicator_survives";
    if in_child() {
        return p2p_child(T);
    }
    run_processes(T, 2, 20_000, &[]);
}

/// Messages of one pair and tag keep their order whatever their sizes (inline and chunked
/// payloads interleaved), posted all at once on both sides.
#[test]
fn p2p_order_of_one_pair_and_tag() {
    let sizes = [3usize, 70_000, 0, 2_000_000, 1, 16_384, 1_100_000, 9];
    let out = run_ranks(2, &GlooConfig::new("p2p-order"), |_f, w| {
        let peer = 1 - w.rank();
        if w.rank() == 0 {
            let works: Vec<_> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| w.isend(vec![i as i32; n], peer, 7))
                .collect::<grid_core::Result<_>>()?;
            for wk in works {
                wk.wait()?;
            }
            Ok(true)
        } else {
            let works: Vec<_> = sizes
                .iter()
                .map(|&n| w.irecv::<i32>(n, peer, 7))
                .collect::<grid_core::Result<_>>()?;
            // Waited in reverse: each receive still gets its own message.
            let mut got: Vec<Vec<i32>> = works
                .into_iter()
                .rev()
                .map(|wk| wk.wait())
                .collect::<grid_core::Result<_>>()?;
            got.reverse();
            Ok(got
                .iter()
                .enumerate()
                .all(|(i, v)| v.len() == sizes[i] && v.iter().all(|&x| x == i as i32)))
        }
    })
    .unwrap();
    for (r, res) in out.into_iter().enumerate() {
        assert!(res.unwrap(), "rank {r}: wrong data or order");
    }
}

/// Large messages go from the sender's memory to the receiver's without a copy; small ones are
/// copied once on each side (through the staging buffer that carries their header). Ranks are
/// processes, so each counts only its own copies.
fn no_copy_child(test: &str) {
    let w = child_world();
    let peer = 1 - w.rank();
    let mut copied = Vec::new();
    for n in [256usize, 4 << 20] {
        let before = backend_gloo::p2p_copied_bytes();
        if w.rank() == 0 {
            w.send_to(&vec![3.0f32; n][..], peer, 1).unwrap();
        } else {
            let mut buf = vec![0.0f32; n];
            w.recv_from(&mut buf[..], peer, 1).unwrap();
            assert!(buf.iter().all(|&x| x == 3.0));
        }
        copied.push(backend_gloo::p2p_copied_bytes() - before);
    }
    assert_eq!(
        copied,
        vec![256 * 4, 0],
        "bytes copied by rank {}",
        w.rank()
    );
    checked(test, &w);
}

#[test]
fn p2p_large_messages_are_not_copied() {
    const T: &str = "p2p_large_messages_are_not_copied";
    if in_child() {
        return no_copy_child(T);
    }
    run_processes(T, 2, 20_000, &[]);
}

// ---- collectives -------------------------------------------------------------------------------

/// Asserts a collective mismatch of `op` on `field` with these values (every rank's, in order).
fn assert_collective_mismatch(e: Error, op: &str, field: &str, values: &[&str]) {
    match &e {
        Error::CollectiveMismatch {
            op: o,
            field: f,
            values: v,
            comm,
            ..
        } => {
            assert_eq!((*o, *f, comm.as_str()), (op, field, "w0"), "{e}");
            let want: Vec<(usize, String)> = values
                .iter()
                .enumerate()
                .map(|(r, v)| (r, v.to_string()))
                .collect();
            assert_eq!(v, &want, "{e}");
        }
        other => panic!("expected a collective mismatch of {op} on {field}, got {other:?}"),
    }
}

fn collectives_child(test: &str) {
    let world = child_world();
    let me = world.rank();
    let n = world.size();
    assert_eq!(world.mismatch_check(), MismatchCheck::All, "Gloo's default");
    let each = |f: &dyn Fn(usize) -> String| (0..n).map(f).collect::<Vec<_>>();
    // A count of 65536 on rank 2 against 4 elsewhere (without the check: SIGABRT in libgloo).
    let count = if me == 2 { 65536 } else { 4 };
    let mut v = vec![1.0f32; count];
    let e = world
        .all_reduce_in_place(&mut v[..], ReduceOp::Sum)
        .unwrap_err();
    println!("rank {me}: {e}");
    let want = each(&|r| if r == 2 { "65536" } else { "4" }.to_string());
    assert_collective_mismatch(
        e,
        "all_reduce",
        "count",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(v.iter().all(|&x| x == 1.0), "the buffer changed");
    // An element type of the same size: i32 on rank 1, f32 elsewhere.
    let e = if me == 1 {
        world
            .all_reduce_in_place(&mut [1i32; 8][..], ReduceOp::Sum)
            .unwrap_err()
    } else {
        world
            .all_reduce_in_place(&mut [1.0f32; 8][..], ReduceOp::Sum)
            .unwrap_err()
    };
    let want = each(&|r| if r == 1 { "i32" } else { "f32" }.to_string());
    assert_collective_mismatch(
        e,
        "all_reduce",
        "dtype",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // A reduction: Max on rank 3, Sum elsewhere.
    let op = if me == 3 {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    let e = world
        .all_reduce_in_place(&mut [1i64; 8][..], op)
        .unwrap_err();
    let want = each(&|r| if r == 3 { ReduceOp::Max } else { ReduceOp::Sum }.to_string());
    assert_collective_mismatch(
        e,
        "all_reduce",
        "reduce op",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // A broadcast root: rank 1 says root 1, the others root 0.
    let root = usize::from(me == 1);
    let mut b = [me as u8; 16];
    let e = world.broadcast_into(&mut b[..], root).unwrap_err();
    let want = each(&|r| if r == 1 { "1" } else { "0" }.to_string());
    assert_collective_mismatch(
        e,
        "broadcast",
        "root",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert_eq!(b, [me as u8; 16]);
    // An all-gather whose block differs (element size in bytes: 3 f64 against 6 f32).
    let e = if me == 0 {
        world
            .all_gather_into(&[0.0f64; 3][..], &mut vec![0.0f64; 3 * n][..])
            .unwrap_err()
    } else {
        world
            .all_gather_into(&[0.0f32; 6][..], &mut vec![0.0f32; 6 * n][..])
            .unwrap_err()
    };
    let want = each(&|r| if r == 0 { "f64" } else { "f32" }.to_string());
    assert_collective_mismatch(
        e,
        "all_gather",
        "dtype",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // Nonblocking collectives are checked on the communicator's worker right before they run:
    // the start returns at once, and the wait returns the mismatch.
    let w = if me == 0 {
        world.iall_reduce(vec![1.0f32; 100], ReduceOp::Sum)
    } else {
        world.iall_reduce(vec![1.0f32; 10], ReduceOp::Sum)
    };
    let e = w
        .unwrap_or_else(|e| panic!("rank {me}: a checked start must not fail or block: {e}"))
        .wait()
        .map(|_| ())
        .unwrap_err();
    let want = each(&|r| if r == 0 { "100" } else { "10" }.to_string());
    assert_collective_mismatch(
        e,
        "all_reduce",
        "count",
        &want.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // Nothing reached Gloo: the communicator works and agreeing calls give exact results.
    let mut s = [me as i64 + 1; 5];
    world
        .all_reduce_in_place(&mut s[..], ReduceOp::Sum)
        .unwrap();
    assert_eq!(s, [(n * (n + 1) / 2) as i64; 5]);
    checked(test, &world);
}

#[test]
fn collective_mismatches_are_errors_on_every_rank() {
    const T: &str = "collective_mismatches_are_errors_on_every_rank";
    if in_child() {
        return collectives_child(T);
    }
    run_processes(T, 4, 20_000, &[]);
}

/// Rank 1 skips the third of five f32 all-reduces, then every rank sums an i64 count: rank 1's
/// i64 all-reduce meets the others' fifth f32 one (without the check: a wrong `Ok` on some
/// ranks, 1065353216 for 4).
fn skip_child(test: &str) {
    let world = child_world();
    let me = world.rank();
    let mut done = 0i64;
    let mut err = None;
    for i in 0..5 {
        if me == 1 && i == 2 {
            continue;
        }
        let mut x = [1.0f32; 4];
        match world.all_reduce_in_place(&mut x[..], ReduceOp::Sum) {
            Ok(()) => {
                assert_eq!(x, [4.0; 4], "all-reduce {i}");
                done += 1;
            }
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let e = match err {
        Some(e) => e,
        None => {
            let mut c = [done];
            world
                .all_reduce_in_place(&mut c[..], ReduceOp::Sum)
                .unwrap_err()
        }
    };
    let want: Vec<&str> = (0..4).map(|r| if r == 1 { "i64" } else { "f32" }).collect();
    assert_collective_mismatch(e, "all_reduce", "dtype", &want);
    assert_eq!(done, 4, "rank {me} completed the agreeing all-reduces");
    checked(test, &world);
}

#[test]
fn skipped_collective_is_an_error_on_every_rank() {
    const T: &str = "skipped_collective_is_an_error_on_every_rank";
    if in_child() {
        return skip_child(T);
    }
    run_processes(T, 4, 20_000, &[]);
}

/// Rank 1 never enters the last all-reduce but stays connected: rank 0 gets a timeout in time.
fn absent_child(test: &str) {
    let world = child_world();
    let timeout = world.timeout();
    world.barrier().unwrap();
    if world.rank() == 1 {
        // Stay connected while rank 0 waits for its timeout.
        std::thread::sleep(timeout + Duration::from_secs(2));
    } else {
        let t = Instant::now();
        let e = world
            .all_reduce_in_place(&mut [1.0f32; 4][..], ReduceOp::Sum)
            .unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(e, Error::Timeout { op: "all_reduce", millis, .. } if millis == timeout.as_millis() as u64),
            "{e}"
        );
        assert!(
            took >= timeout.mul_f64(0.9) && took <= timeout + Duration::from_millis(1500),
            "took {took:?} for a timeout of {timeout:?}"
        );
    }
    checked(test, &world);
}

#[test]
fn absent_rank_is_a_timeout() {
    const T: &str = "absent_rank_is_a_timeout";
    if in_child() {
        return absent_child(T);
    }
    run_processes(T, 2, 2_000, &[]);
}

/// `GRID_DEBUG=off` turns Gloo's default check off (and `detail` keeps every collective
/// checked); `set_mismatch_check` changes it per communicator.
fn env_child(test: &str) {
    let world = child_world();
    let want = match std::env::var("GRID_DEBUG").as_deref() {
        Ok("off") => MismatchCheck::Off,
        _ => MismatchCheck::All,
    };
    assert_eq!(world.mismatch_check(), want);
    world.set_mismatch_check(MismatchCheck::Above(1 << 20));
    assert_eq!(world.mismatch_check(), MismatchCheck::Above(1 << 20));
    let mut x = HostBuffer::zeros(DType::F32, 4);
    world
        .in_place_all_reduce(x.as_mut_slice().into(), ReduceOp::Sum)
        .unwrap();
    checked(test, &world);
}

#[test]
fn grid_debug_selects_the_mode() {
    const T: &str = "grid_debug_selects_the_mode";
    if in_child() {
        return env_child(T);
    }
    run_processes(T, 2, 20_000, &[("GRID_DEBUG", "off")]);
    run_processes(T, 2, 20_000, &[("GRID_DEBUG", "detail")]);
    run_processes(T, 2, 20_000, &[]);
}

// ---- the operations with per-rank counts and the rooted ones (issue #16 item 7) ----------------

/// Asserts a collective mismatch of `op` reported on every rank (checked mode).
fn assert_v_mismatch(e: Error, op: &str, n: usize) {
    match &e {
        Error::CollectiveMismatch {
            op: o,
            comm,
            values,
            ..
        } => {
            assert_eq!((*o, comm.as_str()), (op, "w0"), "{e}");
            assert_eq!(values.len(), n, "{e}");
        }
        other => panic!("expected a collective mismatch of {op}, got {other:?}"),
    }
}

/// With the check on (Gloo's default), a count disagreement of each operation with per-rank
/// counts, and a length disagreement of each rooted one, is `CollectiveMismatch` on every rank
/// before any data moves (the receive buffers keep their contents); the communicator then
/// works.
fn v_checked_child(test: &str) {
    let world = child_world();
    let (me, n) = (world.rank(), world.size());
    assert_eq!(world.mismatch_check(), MismatchCheck::All);
    // all_to_all_v: rank 1 sends 3 elements to rank 0, which expects 2 from it.
    let send_counts: Vec<usize> = (0..n)
        .map(|j| if me == 1 && j == 0 { 3 } else { 2 })
        .collect();
    let recv_counts = vec![2usize; n];
    let send = vec![me as i32; send_counts.iter().sum()];
    let mut recv = vec![-1i32; 2 * n];
    let e = world
        .all_to_all_v_into(&send, &send_counts, &mut recv, &recv_counts)
        .unwrap_err();
    println!("rank {me}: {e}");
    assert_v_mismatch(e, "all_to_all_v", n);
    assert!(recv.iter().all(|&x| x == -1), "the buffer changed");
    // all_gather_v: rank 2 passes other counts.
    let counts: Vec<usize> = (0..n)
        .map(|j| if me == 2 && j == 0 { 3 } else { 2 })
        .collect();
    let send = vec![1.0f32; counts[me]];
    let mut recv = vec![0.0f32; counts.iter().sum()];
    let e = world
        .all_gather_v_into(&send, &mut recv, &counts)
        .unwrap_err();
    println!("rank {me}: {e}");
    assert_v_mismatch(e, "all_gather_v", n);
    // reduce_scatter_v: rank 0 passes other counts.
    let counts: Vec<usize> = (0..n)
        .map(|j| if me == 0 && j == 1 { 3 } else { 2 })
        .collect();
    let send = vec![1i64; counts.iter().sum()];
    let mut recv = vec![0i64; counts[me]];
    let e = world
        .reduce_scatter_v_into(&send, &counts, &mut recv, ReduceOp::Sum)
        .unwrap_err();
    println!("rank {me}: {e}");
    assert_v_mismatch(e, "reduce_scatter_v", n);
    // reduce, gather, scatter: rank 1's length differs.
    let len = if me == 1 { 5 } else { 4 };
    let send = vec![1.0f64; len];
    let mut out = vec![0.0f64; len];
    let e = world
        .reduce_into(&send, (me == 0).then_some(&mut out[..]), ReduceOp::Sum, 0)
        .unwrap_err();
    println!("rank {me}: {e}");
    assert_v_mismatch(e, "reduce", n);
    let mut all = vec![0.0f64; len * n];
    let e = world
        .gather_into(&send, (me == 0).then_some(&mut all[..]), 0)
        .unwrap_err();
    assert_v_mismatch(e, "gather", n);
    let blocks = vec![2.0f64; len * n];
    let e = world
        .scatter_into((me == 0).then_some(&blocks[..]), &mut out, 0)
        .unwrap_err();
    assert_v_mismatch(e, "scatter", n);
    // The nonblocking form fails its wait on every rank.
    let send = vec![me as i32; send_counts.iter().sum()];
    let e = world
        .iall_to_all_v(send, send_counts.clone(), recv_counts.clone())
        .and_then(|w| w.wait())
        .unwrap_err();
    println!("rank {me}: {e}");
    assert_v_mismatch(e, "all_to_all_v", n);
    // Nothing reached Gloo: agreeing calls work.
    let counts: Vec<usize> = (0..n).map(|j| j + 1).collect();
    let mut recv = vec![0u8; counts.iter().sum()];
    world
        .all_gather_v_into(&vec![me as u8; me + 1], &mut recv, &counts)
        .unwrap();
    let want: Vec<u8> = (0..n).flat_map(|j| vec![j as u8; j + 1]).collect();
    assert_eq!(recv, want);
    checked(test, &world);
}

#[test]
fn v_op_count_mismatches_are_errors_on_every_rank() {
    const T: &str = "v_op_count_mismatches_are_errors_on_every_rank";
    if in_child() {
        return v_checked_child(T);
    }
    run_processes(T, 3, 20_000, &[]);
}

/// Asserts the error of a block whose sides disagreed (check off): class `message mismatch`,
/// the operation, the peer and both counts in the message.
fn assert_block_mismatch(e: Error, op: &str, peer: usize, sent: usize, expected: usize) {
    match &e {
        Error::Library(l) => {
            assert_eq!(
                (l.backend, l.op, l.class.as_deref()),
                ("gloo", op, Some("message mismatch")),
                "{e}"
            );
            let want = format!("rank {peer} (world rank {peer}) sent a block of {sent} ");
            assert!(l.message.contains(&want), "{e}");
            assert!(l.message.contains(&format!("expected {expected} ")), "{e}");
            assert!(l.message.contains("remains usable"), "{e}");
        }
        other => panic!("expected a block mismatch of {op}, got {other:?}"),
    }
}

/// With `GRID_DEBUG=off` nothing checks the counts before the data moves: every block carries
/// its count, so the rank that receives a block of another length gets an error naming the
/// sender and both counts (its memory for the block unchanged), no process is terminated, the
/// ranks whose blocks matched complete, and the communicator works afterwards.
fn v_unchecked_child(test: &str) {
    let world = child_world();
    let (me, n) = (world.rank(), world.size());
    assert_eq!(world.mismatch_check(), MismatchCheck::Off);
    let ok_or_mismatch =
        |r: grid_core::Result<()>, op: &str, bad: bool, peer, sent, expected| match (r, bad) {
            (Ok(()), false) => {}
            (Err(e), true) => {
                println!("rank {me}: {e}");
                assert_block_mismatch(e, op, peer, sent, expected);
            }
            (r, _) => panic!("rank {me}: {op}: unexpected {r:?}"),
        };
    // all_to_all_v: rank 1 sends 3 elements to rank 0, which expects 2.
    let send_counts: Vec<usize> = (0..n)
        .map(|j| if me == 1 && j == 0 { 3 } else { 2 })
        .collect();
    let recv_counts = vec![2usize; n];
    let send = vec![me as i32 + 10; send_counts.iter().sum()];
    let mut recv = vec![-1i32; 2 * n];
    let r = world.all_to_all_v_into(&send, &send_counts, &mut recv, &recv_counts);
    ok_or_mismatch(r, "all_to_all_v", me == 0, 1, 3, 2);
    // The block from rank 1 was discarded; the others arrived.
    for j in 0..n {
        let want = if me == 0 && j == 1 { -1 } else { j as i32 + 10 };
        assert_eq!(recv[2 * j..2 * j + 2], [want, want], "rank {me} block {j}");
    }
    // all_gather_v: rank 2 believes it contributes 3 elements; the others expect 2 from it.
    let counts: Vec<usize> = (0..n)
        .map(|j| if me == 2 && j == 2 { 3 } else { 2 })
        .collect();
    let send = vec![me as f32; counts[me]];
    let mut recv = vec![0.0f32; counts.iter().sum()];
    let r = world.all_gather_v_into(&send, &mut recv, &counts);
    ok_or_mismatch(r, "all_gather_v", me != 2, 2, 3, 2);
    // reduce_scatter_v: rank 0 sends 3 elements as rank 1's block, which expects 2.
    let counts: Vec<usize> = (0..n)
        .map(|j| if me == 0 && j == 1 { 3 } else { 2 })
        .collect();
    let send = vec![1i64; counts.iter().sum()];
    let mut recv = vec![0i64; counts[me]];
    let r = world.reduce_scatter_v_into(&send, &counts, &mut recv, ReduceOp::Sum);
    ok_or_mismatch(r, "reduce_scatter_v", me == 1, 0, 3, 2);
    if me != 1 {
        assert_eq!(recv, vec![n as i64; 2], "rank {me}: reduce_scatter_v");
    }
    // reduce and gather to root 0: rank 1 sends 5 elements, the root expects 4.
    let len = if me == 1 { 5 } else { 4 };
    let send = vec![1.0f64; len];
    let mut out = vec![0.0f64; len];
    let r = world.reduce_into(&send, (me == 0).then_some(&mut out[..]), ReduceOp::Sum, 0);
    ok_or_mismatch(r, "reduce", me == 0, 1, 5, 4);
    let mut all = vec![0.0f64; len * n];
    let r = world.gather_into(&send, (me == 0).then_some(&mut all[..]), 0);
    ok_or_mismatch(r, "gather", me == 0, 1, 5, 4);
    // scatter from root 0 (blocks of 4): rank 1 expects 5.
    let blocks = vec![2.0f64; 4 * n];
    let mut got = vec![0.0f64; len];
    let r = world.scatter_into((me == 0).then_some(&blocks[..]), &mut got, 0);
    ok_or_mismatch(r, "scatter", me == 1, 0, 4, 5);
    // Every message was consumed: agreeing calls give exact results.
    let counts: Vec<usize> = (0..n).map(|j| j + 1).collect();
    let mut recv = vec![0u8; counts.iter().sum()];
    world
        .all_gather_v_into(&vec![me as u8; me + 1], &mut recv, &counts)
        .unwrap();
    let want: Vec<u8> = (0..n).flat_map(|j| vec![j as u8; j + 1]).collect();
    assert_eq!(recv, want);
    let mut s = [me as i64 + 1; 3];
    world
        .all_reduce_in_place(&mut s[..], ReduceOp::Sum)
        .unwrap();
    assert_eq!(s, [(n * (n + 1) / 2) as i64; 3]);
    checked(test, &world);
}

#[test]
fn v_op_count_mismatches_unchecked_never_crash() {
    const T: &str = "v_op_count_mismatches_unchecked_never_crash";
    if in_child() {
        return v_unchecked_child(T);
    }
    run_processes(T, 3, 20_000, &[("GRID_DEBUG", "off")]);
}
