//! The mismatch check's exchange on Gloo (one round of messages up to 16 ranks, dissemination
//! rounds above): every rank agrees when the ranks agree, and a disagreement is the same
//! `CollectiveMismatch` on every rank, blocking and nonblocking, on both paths.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{Communicator, CommunicatorExt, Error, MismatchCheck, ReduceOp};
use std::time::Duration;

fn run(n: usize, name: &str) {
    let cfg = GlooConfig::new(name).with_timeout(Duration::from_secs(60));
    let out = run_ranks(n, &cfg, |_f, w| {
        assert_eq!(w.mismatch_check(), MismatchCheck::All);
        let (me, n) = (w.rank(), w.size());
        // Agreement: checked collectives of every kind return their values.
        let mut v = vec![me as i64 + 1; 3];
        w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        let total = (n * (n + 1) / 2) as i64;
        assert_eq!(v, vec![total; 3], "rank {me}");
        let mut b = vec![me as u32; 2];
        w.broadcast((&mut b[..]).into(), n - 1)?;
        assert_eq!(b, vec![(n - 1) as u32; 2], "rank {me}");
        let sum = w.iall_reduce(vec![1i32; 4], ReduceOp::Sum)?.wait()?;
        assert_eq!(sum, vec![n as i32; 4], "rank {me}");
        // A count that differs on the last rank: the same error everywhere, buffer untouched.
        let count = if me == n - 1 { 5 } else { 4 };
        let mut x = vec![2.0f32; count];
        let e = w
            .all_reduce_in_place(&mut x[..], ReduceOp::Max)
            .unwrap_err();
        assert!(x.iter().all(|&y| y == 2.0), "rank {me}: the buffer changed");
        let blocking = mismatch_values(&e, "all_reduce", "count");
        // The same on a nonblocking collective (checked on the worker right before it runs).
        let e = w
            .iall_reduce(vec![1.0f32; count], ReduceOp::Sum)?
            .wait()
            .unwrap_err();
        let nonblocking = mismatch_values(&e, "all_reduce", "count");
        // Still usable afterwards.
        let mut y = vec![1u8; 2];
        w.all_reduce_in_place(&mut y[..], ReduceOp::Sum)?;
        assert_eq!(y, vec![n as u8; 2], "rank {me}");
        Ok((blocking, nonblocking))
    })
    .unwrap();
    let want: Vec<(usize, String)> = (0..n)
        .map(|r| (r, if r == n - 1 { "5" } else { "4" }.to_string()))
        .collect();
    for (rank, r) in out.into_iter().enumerate() {
        let (blocking, nonblocking) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(blocking, want, "rank {rank}, blocking");
        assert_eq!(nonblocking, want, "rank {rank}, nonblocking");
    }
}

fn mismatch_values(e: &Error, op: &str, field: &str) -> Vec<(usize, String)> {
    match e {
        Error::CollectiveMismatch {
            op: o,
            field: f,
            values,
            ..
        } if *o == op && *f == field => values.clone(),
        other => panic!("expected a mismatch of {op} on {field}, got {other}"),
    }
}

#[test]
fn direct_exchange_at_2_3_and_5_ranks() {
    for n in [2, 3, 5] {
        run(n, &format!("check-direct-{n}"));
    }
}

/// Above 16 ranks the check runs in dissemination rounds (5 of them at 17 ranks).
#[test]
fn dissemination_at_17_ranks() {
    run(17, "check-dissemination-17");
}
