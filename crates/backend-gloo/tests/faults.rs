//! Timeouts, lost peers and stale stores, with ranks as threads. Every test is bounded: a
//! failure to time out shows up as an assertion on the elapsed time, never as a hang (each
//! blocking call is itself bounded by the configured Gloo timeout).

use backend_gloo::{run_ranks, run_ranks_with, GlooConfig, Rendezvous};
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp};
use std::sync::Barrier;
use std::time::{Duration, Instant};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// How long a failed operation may wait for the other ranks' failure records before it blames
/// one (`docs/backends.md` §2.4).
const BLAME_GRACE: Duration = Duration::from_secs(1);

/// Asserts that `elapsed` lies in [timeout · 0.9, timeout + slack].
fn within(elapsed: Duration, timeout: Duration, slack: Duration) {
    assert!(
        elapsed >= timeout.mul_f64(0.9) && elapsed <= timeout + slack,
        "took {elapsed:?} for a timeout of {timeout:?}"
    );
}

#[test]
fn collective_timeout_is_configurable() {
    for timeout in [ms(400), ms(1200)] {
        let cfg = GlooConfig::new("coll-timeout").with_timeout(timeout);
        let gate = Barrier::new(2);
        let out = run_ranks(2, &cfg, |_f, world| {
            if world.rank() == 1 {
                // Stay connected but never join the collective.
                gate.wait();
                return Ok(None);
            }
            let t = Instant::now();
            let e = world
                .all_reduce_into(&[1.0f32], &mut [0.0f32], ReduceOp::Sum)
                .unwrap_err();
            let took = t.elapsed();
            // Later calls fail at once: the front end refuses them, naming the first failure.
            let again = world.barrier().unwrap_err();
            gate.wait();
            Ok(Some((e, took, again)))
        })
        .unwrap();
        let (e, took, again) = out[0].as_ref().unwrap().clone().unwrap();
        // Rank 1 is the member that never reported a failure: it is blamed, after the grace
        // period in which a failing rank waits for the others' failure records.
        assert!(
            matches!(e, Error::Timeout { op: "all_reduce", millis, peer: Some(1), .. } if millis == timeout.as_millis() as u64),
            "{e}"
        );
        within(took, timeout, ms(1500) + BLAME_GRACE);
        assert!(
            matches!(&again, Error::Aborted { op: "barrier", reason, .. } if reason.contains("failed earlier")),
            "{again}"
        );
        assert!(out[1].is_ok());
    }
}

#[test]
fn recv_and_nonblocking_timeouts() {
    let timeout = ms(500);
    let cfg = GlooConfig::new("p2p-timeout").with_timeout(timeout);
    let gate = Barrier::new(2);
    let out = run_ranks(2, &cfg, |f, world| {
        // Other communicators for the nonblocking part (the first one dies with the timeout).
        let other = f.create_group(&world, &[0, 1])?.expect("member");
        let checked = f.create_group(&world, &[0, 1])?.expect("member");
        if world.rank() == 1 {
            gate.wait();
            return Ok(None);
        }
        let t = Instant::now();
        let e = world.recv_from(&mut [0u8; 4], 1, 3).unwrap_err();
        let took = t.elapsed();
        // With mismatch checking on (Gloo's default), the check runs on the communicator's
        // worker right before the collective: the start returns at once, and the wait times
        // out (in the check's exchange, which waits for the peer).
        assert_eq!(checked.mismatch_check(), grid_core::MismatchCheck::All);
        let t3 = Instant::now();
        let started = checked.iall_reduce(vec![1i32], ReduceOp::Sum)?;
        assert!(
            t3.elapsed() < ms(200),
            "a checked start blocked for {:?}",
            t3.elapsed()
        );
        let e3 = started.wait().map(|_| ()).unwrap_err();
        assert!(
            matches!(
                e3,
                Error::Timeout {
                    op: "all_reduce",
                    ..
                }
            ),
            "{e3}"
        );
        within(t3.elapsed(), timeout, ms(1500));
        // Without it the start returns at once and the wait times out.
        other.set_mismatch_check(grid_core::MismatchCheck::Off);
        let w = other.iall_reduce(vec![1i32], ReduceOp::Sum)?.into_inner();
        let w = match w.wait_timeout(ms(50)) {
            Ok(r) => panic!("completed without the peer: {r:?}"),
            Err(w) => w,
        };
        let t2 = Instant::now();
        let e2 = w.wait().unwrap_err();
        let took2 = t2.elapsed();
        gate.wait();
        Ok(Some((e, took, e2, took2)))
    })
    .unwrap();
    let (e, took, e2, took2) = out[0].as_ref().unwrap().clone().unwrap();
    assert!(matches!(e, Error::Timeout { op: "recv", .. }), "{e}");
    within(took, timeout, ms(1500));
    assert!(
        matches!(
            e2,
            Error::Timeout {
                op: "all_reduce",
                ..
            }
        ),
        "{e2}"
    );
    assert!(took2 <= timeout + ms(1500), "{took2:?}");
}

#[test]
fn rendezvous_timeout() {
    let timeout = ms(600);
    let cfg = GlooConfig::new("rdv-timeout").with_timeout(timeout);
    let store = Rendezvous::in_process().unwrap();
    let t = Instant::now();
    // Only rank 0 of a world of 2 shows up.
    let f = backend_gloo::GlooFactory::new(&store, cfg).unwrap();
    let e = f.world(0, 2).unwrap_err();
    within(t.elapsed(), timeout, ms(500));
    // The error lists the rank that never arrived (`Error::Timeout` has no room for a list).
    match &e {
        Error::Library(l) => {
            assert_eq!(
                (l.op, l.class.as_deref()),
                ("rendezvous", Some("timeout")),
                "{e}"
            );
            assert!(
                l.message.contains("timed out after 600 ms")
                    && l.message.contains("1 rank of 1 never arrived: rank 1"),
                "{e}"
            );
        }
        other => panic!("expected a rendezvous timeout, got {other}"),
    }
}

/// A rank that leaves (drops its communicators and ends) makes every other rank fail with an
/// error naming it, within the timeout.
#[test]
fn lost_rank_is_named() {
    let timeout = ms(2000);
    let cfg = GlooConfig::new("lost-rank").with_timeout(timeout);
    let survivors = Barrier::new(3);
    let t0 = Instant::now();
    let out = run_ranks(4, &cfg, |_f, world| {
        world.barrier()?;
        if world.rank() == 2 {
            drop(world);
            return Ok(None);
        }
        let t = Instant::now();
        let mut err = None;
        for _ in 0..10_000 {
            let mut x = [0i64; 16];
            if let Err(e) = world.all_reduce_into(&[1i64; 16], &mut x, ReduceOp::Sum) {
                err = Some(e);
                break;
            }
        }
        let took = t.elapsed();
        // Keep this rank's connections open until every survivor has failed, so that each
        // names the rank that really left rather than a survivor that gave up.
        survivors.wait();
        Ok(Some((err, took)))
    })
    .unwrap();
    assert!(t0.elapsed() < timeout * 3, "took {:?}", t0.elapsed());
    for (r, res) in out.into_iter().enumerate() {
        let v = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        if r == 2 {
            continue;
        }
        let (err, took) = v.unwrap();
        let e = err.unwrap_or_else(|| panic!("rank {r} never failed"));
        assert!(
            matches!(&e, Error::PeerFailed { peer: 2, .. }),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("world rank 2"), "rank {r}: {e}");
        assert!(took <= timeout + ms(1500), "rank {r} took {took:?}");
    }
}

/// A job id reused in the same store fails fast instead of mixing with the old run; another job
/// id in the same store works.
#[test]
fn reused_job_id_in_memory() {
    let store = Rendezvous::in_process().unwrap();
    let cfg = GlooConfig::new("job-a").with_timeout(Duration::from_secs(20));
    let first = run_ranks_with(&store, 2, &cfg, |_f, w| Ok(w.size())).unwrap();
    assert!(first.iter().all(|r| r.is_ok()));
    let t = Instant::now();
    let again = run_ranks_with(&store, 2, &cfg, |_f, w| Ok(w.size())).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    for r in again {
        let e = r.unwrap_err();
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("job 'job-a'")),
            "{e}"
        );
    }
    let other = run_ranks_with(&store, 2, &GlooConfig::new("job-b"), |_f, w| {
        let mut s = [0i32];
        w.all_reduce_into(&[1i32], &mut s, ReduceOp::Sum)?;
        Ok(s[0])
    })
    .unwrap();
    assert!(other.iter().all(|r| r.as_ref().ok() == Some(&2)));
}

/// A stale directory: a finished run, and a crashed run that left half of its keys. New job ids
/// work; reusing an id never hangs.
#[test]
fn stale_file_store() {
    let dir = std::env::temp_dir().join(format!("gloo-stale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Rendezvous::File(dir.clone());
    let timeout = ms(1500);
    let cfg = |job: &str| GlooConfig::new(job).with_timeout(timeout);
    let sum = |_f: &backend_gloo::GlooFactory, w: backend_gloo::GlooCommunicator| {
        let mut s = [0i32];
        w.all_reduce_into(&[w.rank() as i32 + 1], &mut s, ReduceOp::Sum)?;
        Ok(s[0])
    };
    // A finished run.
    let done = run_ranks_with(&store, 2, &cfg("done"), sum).unwrap();
    assert!(done.iter().all(|r| r.as_ref().ok() == Some(&3)));
    // A crashed run: only rank 0 of 2 ever arrived.
    let f = backend_gloo::GlooFactory::new(&store, cfg("crashed")).unwrap();
    assert!(f.world(0, 2).is_err());
    // New jobs in the same directory are not disturbed.
    let fresh = run_ranks_with(&store, 3, &cfg("fresh"), sum).unwrap();
    assert!(
        fresh.iter().all(|r| r.as_ref().ok() == Some(&6)),
        "{fresh:?}"
    );
    // Reusing either id fails, in bounded time.
    for job in ["done", "crashed"] {
        let t = Instant::now();
        let again = run_ranks_with(&store, 2, &cfg(job), sum).unwrap();
        // A rank whose own arrival key is new may find the old run's arrival key of a peer
        // and wait for that peer's addresses: never longer than the rendezvous timeout.
        assert!(
            t.elapsed() <= timeout + ms(1500),
            "{job}: took {:?}",
            t.elapsed()
        );
        assert!(again.iter().all(|r| r.is_err()), "{job}: {again:?}");
        assert!(
            again.iter().any(
                |r| matches!(r, Err(Error::Invalid(m)) if m.contains(&format!("job '{job}'")))
            ),
            "{job}: {again:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A count that differs between ranks aborts the process inside libgloo when it reaches the
/// library; with mismatch checking on, every rank gets the typed error first and the
/// communicator stays usable.
#[test]
fn mismatch_checking_turns_a_count_mismatch_into_an_error() {
    let cfg = GlooConfig::new("mismatch-check").with_timeout(ms(10_000));
    let out = run_ranks(2, &cfg, |_f, world| {
        world.set_mismatch_check(grid_core::MismatchCheck::All);
        let n = if world.rank() == 0 { 4 } else { 65536 };
        let mut v = vec![1.0f32; n];
        let e = world.all_reduce_in_place(&mut v[..], ReduceOp::Sum);
        // Nothing reached Gloo: the next, agreeing collective runs normally.
        let mut s = [world.rank() as i64 + 1];
        world.all_reduce_in_place(&mut s[..], ReduceOp::Sum)?;
        Ok((e, s[0]))
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let (e, sum) = r.unwrap();
        match e {
            Err(Error::CollectiveMismatch {
                op: "all_reduce",
                field: "count",
                values,
                ..
            }) => assert_eq!(
                values,
                vec![(0, "4".to_string()), (1, "65536".to_string())],
                "rank {rank}"
            ),
            other => panic!("rank {rank}: expected a collective mismatch, got {other:?}"),
        }
        assert_eq!(sum, 3, "rank {rank}");
    }
}

/// Timeouts too long for Gloo's deadline arithmetic (which used to make every wait fail at
/// once) mean no limit: a peer that comes 0.5 s late is waited for.
#[test]
fn huge_timeouts_mean_no_limit() {
    let huge = [
        GlooConfig::NO_LIMIT,
        Duration::from_millis(u64::MAX),
        Duration::from_millis(u64::MAX - 1),
        Duration::from_secs(200 * 365 * 24 * 3600),
    ];
    for (i, timeout) in huge.into_iter().enumerate() {
        let cfg = GlooConfig::new(format!("huge-timeout-{i}")).with_timeout(timeout);
        assert!(cfg.has_no_limit(), "{timeout:?}");
        let out = run_ranks(2, &cfg, |_f, world| {
            if world.rank() == 1 {
                std::thread::sleep(ms(500));
            }
            let t = Instant::now();
            let mut sum = [0i32];
            world.all_reduce_into(&[1i32], &mut sum, ReduceOp::Sum)?;
            Ok((sum[0], t.elapsed()))
        })
        .unwrap();
        let (sum, waited) = out[0]
            .as_ref()
            .unwrap_or_else(|e| panic!("{timeout:?}: {e}"));
        assert_eq!(*sum, 2, "{timeout:?}");
        assert!(
            *waited >= ms(400),
            "{timeout:?}: rank 0 waited only {waited:?}"
        );
        assert_eq!(out[1].as_ref().map(|r| r.0).ok(), Some(2), "{timeout:?}");
    }
    assert!(!GlooConfig::new("j")
        .with_timeout(Duration::from_secs(99 * 365 * 24 * 3600))
        .has_no_limit());
}
