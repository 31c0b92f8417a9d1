//! Mismatch checking (`grid_core::MismatchCheck`) on ranks as threads: every kind of
//! disagreement gives `Error::CollectiveMismatch` on every rank, naming the field, the ranks
//! and their values; agreement passes with the right results and leaves sequence numbers alone.

use backend_local::{run, LocalComm, LocalConfig};
use grid_core::{Communicator, CommunicatorExt, Error, MismatchCheck, ReduceOp, Result};
use std::time::Duration;

fn quick() -> LocalConfig {
    LocalConfig {
        timeout: Duration::from_secs(10),
        rendezvous: false,
    }
}

/// Runs `size` ranks with the check on for every collective; `f` issues each rank's calls.
fn checked<R: Send>(
    size: usize,
    f: impl Fn(&LocalComm) -> Result<R> + Sync,
) -> Vec<std::result::Result<R, Error>> {
    run(size, &quick(), |_, w| {
        w.set_mismatch_check(MismatchCheck::All);
        Ok(f(&w))
    })
    .expect("the ranks ran")
}

/// Every rank got the mismatch error with its own operation (`want_ops`, one per rank), this
/// sequence number, field and values; returns rank 0's message.
fn every_rank_reports<R: std::fmt::Debug>(
    results: Vec<std::result::Result<R, Error>>,
    want_ops: &[&str],
    want_seq: u64,
    want_field: &str,
    want_values: &[&str],
) -> String {
    assert_eq!(results.len(), want_ops.len());
    let mut message = String::new();
    for (rank, r) in results.into_iter().enumerate() {
        let want_op = want_ops[rank];
        match r {
            Err(e @ Error::CollectiveMismatch { .. }) => {
                if let Error::CollectiveMismatch {
                    op,
                    comm,
                    seq,
                    field,
                    values,
                } = &e
                {
                    assert_eq!(
                        (*op, comm.as_str(), *seq, *field),
                        (want_op, "world", want_seq, want_field),
                        "rank {rank}"
                    );
                    let got: Vec<(usize, &str)> =
                        values.iter().map(|(r, v)| (*r, v.as_str())).collect();
                    let want: Vec<(usize, &str)> =
                        want_values.iter().copied().enumerate().collect();
                    assert_eq!(got, want, "rank {rank}");
                }
                assert!(e.is_communication());
                if rank == 0 {
                    message = e.to_string();
                }
            }
            other => panic!("rank {rank}: expected a collective mismatch, got {other:?}"),
        }
    }
    message
}

#[test]
fn a_count_mismatch_names_both_counts_on_every_rank() {
    let r = checked(2, |w| {
        let n = if w.rank() == 0 { 4 } else { 65536 };
        let mut v = vec![1i32; n];
        w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)
    });
    let msg = every_rank_reports(r, &["all_reduce"; 2], 0, "count", &["4", "65536"]);
    assert_eq!(
        msg,
        "all_reduce #0 on communicator 'world': ranks disagree on count: rank 0: 4, rank 1: 65536 (every rank must make the same collective call)"
    );
}

#[test]
fn a_dtype_mismatch_of_the_same_size_is_caught() {
    let r = checked(2, |w| {
        if w.rank() == 0 {
            w.all_reduce_in_place(&mut [1f32; 4][..], ReduceOp::Sum)
        } else {
            w.all_reduce_in_place(&mut [1i32; 4][..], ReduceOp::Sum)
        }
    });
    every_rank_reports(r, &["all_reduce"; 2], 0, "dtype", &["f32", "i32"]);
}

#[test]
fn a_reduce_op_mismatch_is_caught() {
    let r = checked(3, |w| {
        let op = if w.rank() == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        w.all_reduce_into(&[1.0f64; 8][..], &mut [0.0f64; 8][..], op)
    });
    let msg = every_rank_reports(
        r,
        &["all_reduce"; 3],
        0,
        "reduce op",
        &["Sum", "Max", "Sum"],
    );
    assert!(msg.contains(": ranks 0, 2: Sum, rank 1: Max ("), "{msg}");
}

#[test]
fn different_broadcast_roots_are_caught() {
    let r = checked(2, |w| {
        let mut b = [w.rank() as u8; 16];
        w.broadcast_into(&mut b[..], w.rank())
    });
    every_rank_reports(r, &["broadcast"; 2], 0, "root", &["0", "1"]);
}

#[test]
fn different_operations_are_caught() {
    let r = checked(2, |w| {
        if w.rank() == 0 {
            w.all_reduce_in_place(&mut [1i64; 2][..], ReduceOp::Sum)
        } else {
            w.all_gather_into(&[1i64][..], &mut [0i64; 2][..])
        }
    });
    every_rank_reports(
        r,
        &["all_reduce", "all_gather"],
        0,
        "operation",
        &["all_reduce", "all_gather"],
    );
}

#[test]
fn a_rank_that_skips_a_collective_is_caught_at_the_next_one() {
    // Ranks 0 and 1 agree on a first collective; rank 2 skips the second and goes on to the
    // barrier, which meets the others' all-reduce.
    let r = checked(3, |w| {
        let mut v = [1i32; 4];
        w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        assert_eq!(v, [3; 4]);
        if w.rank() != 2 {
            w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        }
        w.barrier()
    });
    let mut ops = Vec::new();
    for (rank, res) in r.into_iter().enumerate() {
        match res {
            Err(Error::CollectiveMismatch {
                op,
                seq,
                field,
                values,
                ..
            }) => {
                assert_eq!((seq, field), (1, "operation"), "rank {rank}");
                let values: Vec<&str> = values.iter().map(|(_, v)| v.as_str()).collect();
                assert_eq!(
                    values,
                    ["all_reduce", "all_reduce", "barrier"],
                    "rank {rank}"
                );
                ops.push(op);
            }
            other => panic!("rank {rank}: expected a collective mismatch, got {other:?}"),
        }
    }
    assert_eq!(ops, ["all_reduce", "all_reduce", "barrier"]);
}

#[test]
fn a_nonblocking_mismatch_fails_at_start() {
    let r = checked(2, |w| {
        let n = 2 + w.rank();
        w.iall_reduce(vec![1.0f32; n], ReduceOp::Sum).map(|_| ())
    });
    every_rank_reports(r, &["all_reduce"; 2], 0, "count", &["2", "3"]);
}

#[test]
fn agreement_passes_with_right_results_and_takes_no_sequence_numbers() {
    let r = checked(4, |w| {
        let me = w.rank() as i64;
        let mut v = [me, 10 * me];
        w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        let mut b = [me as f32; 3];
        w.broadcast_into(&mut b[..], 2)?;
        let mut g = [0u8; 4];
        w.all_gather_into(&[me as u8][..], &mut g[..])?;
        let mut rs = [0i32; 1];
        w.reduce_scatter_into(&[1i32, 2, 3, 4][..], &mut rs[..], ReduceOp::Max)?;
        w.barrier()?;
        // Point-to-point is not checked: a ring of sends and receives still works.
        let next = (w.rank() + 1) % 4;
        let prev = (w.rank() + 3) % 4;
        let mut got = [0i64];
        let mine = [me];
        let ops = vec![
            grid_core::P2pOp::Send {
                buf: (&mine[..]).into(),
                peer: next,
                tag: 0,
            },
            grid_core::P2pOp::Recv {
                buf: (&mut got[..]).into(),
                peer: prev,
                tag: 0,
            },
        ];
        w.batch_p2p(ops)?;
        let nb = w.iall_reduce(vec![me], ReduceOp::Sum)?.wait()?;
        Ok((v, b, g, rs, got[0], nb, w.ops_issued()))
    });
    for (rank, res) in r.into_iter().enumerate() {
        let (v, b, g, rs, got, nb, issued) = res.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(v, [6, 60]);
        assert_eq!(b, [2.0; 3]);
        assert_eq!(g, [0, 1, 2, 3]);
        assert_eq!(rs, [1 + rank as i32]);
        assert_eq!(got, ((rank + 3) % 4) as i64);
        assert_eq!(nb, vec![6]);
        // Seven operations issued; the check's exchanges took no sequence number.
        assert_eq!(issued, 7, "rank {rank}");
    }
}

#[test]
fn with_the_check_off_the_backend_reports_the_mismatch_itself() {
    // The contrast: without the check, the same disagreement reaches the backend, which (on
    // this backend) fails with its own error instead of the typed one.
    let r = run(2, &quick(), |_, w| {
        w.set_mismatch_check(MismatchCheck::Off);
        assert_eq!(w.mismatch_check(), MismatchCheck::Off);
        let n = if w.rank() == 0 { 4 } else { 8 };
        Ok(w.all_reduce_in_place(&mut vec![1i32; n][..], ReduceOp::Sum))
    })
    .unwrap();
    for (rank, res) in r.into_iter().enumerate() {
        match res {
            Err(Error::Library(_)) => {}
            other => panic!("rank {rank}: expected the backend's error, got {other:?}"),
        }
    }
}

#[test]
fn a_threshold_checks_only_collectives_at_or_above_it() {
    let r = run(2, &quick(), |_, w| {
        w.set_mismatch_check(MismatchCheck::Above(1024));
        // 256 f32 = 1024 bytes on both ranks: checked, the reductions differ.
        let op = if w.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Min
        };
        let big = w.all_reduce_in_place(&mut [1f32; 256][..], op);
        // 255 f32 on both ranks: below the threshold, not checked, so the same disagreement
        // reaches the backend.
        let small = w.all_reduce_in_place(&mut [1f32; 255][..], op);
        Ok((big, small))
    })
    .unwrap();
    for (rank, (big, small)) in r.into_iter().enumerate() {
        assert!(
            matches!(
                big,
                Err(Error::CollectiveMismatch {
                    field: "reduce op",
                    ..
                })
            ),
            "rank {rank}: {big:?}"
        );
        assert!(
            matches!(small, Err(Error::Library(_))),
            "rank {rank}: {small:?}"
        );
    }
}
