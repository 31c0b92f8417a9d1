//! The operation set of issue #16 item 7 on the in-process backend: uneven all-to-all,
//! all-gather and reduce-scatter with per-rank counts, rooted reduce, gather and scatter, with
//! exact values, blocking and nonblocking, and how disagreements between ranks are reported
//! (by the backend itself, and by the front end's mismatch check). The backend-neutral
//! conformance suite covers every dtype; this file pins the backend's own behaviour.

use grid_core::{Bool, Communicator, CommunicatorExt, Error, MismatchCheck, ReduceOp, F8E4M3};

/// Rank `r` sends `(r + j + 1) mod 3` elements to rank `j` (so some blocks are empty), each
/// tagged `1000·r + 10·j + i`.
fn counts(r: usize, j: usize) -> usize {
    (r + j + 1) % 3
}

fn a2a_case(n: usize, me: usize) -> (Vec<i64>, Vec<usize>, Vec<usize>, Vec<i64>) {
    let send_counts: Vec<usize> = (0..n).map(|j| counts(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| counts(i, me)).collect();
    let send: Vec<i64> = (0..n)
        .flat_map(|j| (0..send_counts[j]).map(move |i| (1000 * me + 10 * j + i) as i64))
        .collect();
    let want: Vec<i64> = (0..n)
        .flat_map(|i| (0..counts(i, me)).map(move |k| (1000 * i + 10 * me + k) as i64))
        .collect();
    (send, send_counts, recv_counts, want)
}

#[test]
fn uneven_all_to_all_blocking_and_nonblocking() {
    let n = 4;
    let out = backend_local::run(n, &Default::default(), |_f, c| {
        let me = c.rank();
        let (send, sc, rc, want) = a2a_case(n, me);
        let mut recv = vec![-1i64; rc.iter().sum()];
        c.all_to_all_v_into(&send, &sc, &mut recv, &rc)?;
        assert_eq!(recv, want, "rank {me} blocking");
        let got = c.iall_to_all_v(send, sc, rc)?.wait()?;
        assert_eq!(got, want, "rank {me} nonblocking");
        Ok(())
    });
    out.unwrap();
}

#[test]
fn all_gather_v_and_reduce_scatter_v() {
    let n = 3;
    let counts = [2usize, 0, 3];
    backend_local::run(n, &Default::default(), |_f, c| {
        let me = c.rank();
        let mine: Vec<u32> = (0..counts[me]).map(|i| (10 * me + i) as u32).collect();
        let mut all = vec![0u32; 5];
        c.all_gather_v_into(&mine, &mut all, &counts)?;
        assert_eq!(all, vec![0, 1, 20, 21, 22]);
        assert_eq!(
            c.iall_gather_v(mine, counts.to_vec())?.wait()?,
            vec![0, 1, 20, 21, 22]
        );
        // Reduce-scatter-v: element e of every rank's input is (me + 1)·(e + 1).
        let send: Vec<i8> = (0..5).map(|e| ((me + 1) * (e + 1)) as i8).collect();
        let mut block = vec![0i8; counts[me]];
        c.reduce_scatter_v_into(&send, &counts, &mut block, ReduceOp::Sum)?;
        // Sum over ranks of (r + 1) = 6, times (e + 1) for this rank's elements.
        let from: usize = counts[..me].iter().sum();
        let want: Vec<i8> = (from..from + counts[me])
            .map(|e| (6 * (e + 1)) as i8)
            .collect();
        assert_eq!(block, want);
        let nb = c
            .ireduce_scatter_v(send, counts.to_vec(), ReduceOp::Max)?
            .wait()?;
        let want: Vec<i8> = (from..from + counts[me])
            .map(|e| (3 * (e + 1)) as i8)
            .collect();
        assert_eq!(nb, want);
        Ok(())
    })
    .unwrap();
}

#[test]
fn rooted_reduce_gather_scatter_for_every_root() {
    let n = 3;
    backend_local::run(n, &Default::default(), |_f, c| {
        let me = c.rank();
        for root in 0..n {
            // Reduce: booleans, AND and OR; the non-roots' buffers stay untouched.
            let flags = [Bool::from(me == 1), Bool::TRUE];
            let mut out = [Bool::from_byte(9); 2];
            c.reduce_into(&flags, Some(&mut out), ReduceOp::Max, root)?;
            if me == root {
                assert_eq!(out, [Bool::TRUE, Bool::TRUE]);
            } else {
                assert_eq!(out.map(Bool::to_byte), [9, 9]);
            }
            let and = c.ireduce(flags.to_vec(), ReduceOp::Min, root)?.wait()?;
            if me == root {
                assert_eq!(and, vec![Bool::FALSE, Bool::TRUE]);
            } else {
                assert_eq!(and, flags.to_vec()); // a non-root gets its input back
            }
            // Gather of 8-bit floats (moved, not reduced).
            let mine = [F8E4M3::from_f32(me as f32 + 0.5)];
            let mut all = vec![F8E4M3::default(); n];
            c.gather_into(&mine, (me == root).then_some(&mut all[..]), root)?;
            let want: Vec<F8E4M3> = (0..n).map(|r| F8E4M3::from_f32(r as f32 + 0.5)).collect();
            if me == root {
                assert_eq!(all, want);
                assert_eq!(c.igather(mine.to_vec(), root)?.wait()?, want);
            } else {
                assert_eq!(c.igather(mine.to_vec(), root)?.wait()?, mine.to_vec());
            }
            // Scatter of u64 blocks of 2.
            let src: Vec<u64> = (0..2 * n as u64).map(|x| u64::MAX - 10 + x).collect();
            let mut block = [0u64; 2];
            c.scatter_into((me == root).then_some(&src[..]), &mut block, root)?;
            assert_eq!(block.to_vec(), src[2 * me..2 * me + 2].to_vec());
            let nb = c
                .iscatter((me == root).then(|| src.clone()), 2, root)?
                .wait()?;
            assert_eq!(nb, src[2 * me..2 * me + 2].to_vec());
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn bad_arguments_are_typed_errors_on_the_calling_rank() {
    backend_local::run(2, &Default::default(), |_f, c| {
        let e = c
            .all_to_all_v_into(&[1i32, 2], &[2], &mut [0i32; 2], &[1, 1])
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadCounts {
                    what: "send_counts",
                    ..
                }
            ),
            "{e}"
        );
        let e = c
            .all_gather_v_into(&[1i32], &mut [0i32; 3], &[1, 1])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_gather_v: recv_counts [1, 1] sums to 2 but the recv buffer has 3 elements"
        );
        let e = c
            .reduce_into(&[1i32], None, ReduceOp::Sum, c.rank())
            .unwrap_err();
        assert!(
            matches!(e, Error::MissingRootBuffer { op: "reduce", .. }),
            "{e}"
        );
        let e = c.gather_into(&[1i32], None, 2).unwrap_err();
        assert!(
            matches!(e, Error::PeerOutOfRange { op: "gather", .. }),
            "{e}"
        );
        let e = c
            .reduce_into(&[Bool::TRUE], Some(&mut [Bool::FALSE]), ReduceOp::Avg, 0)
            .unwrap_err();
        assert!(e.to_string().contains("Avg on bool"), "{e}");
        let x = [F8E4M3::from_f32(1.0)];
        let e = c
            .reduce_into(&x, Some(&mut [F8E4M3::default()]), ReduceOp::Sum, 0)
            .unwrap_err();
        assert!(e.to_string().contains("f8e4m3"), "{e}");
        // Both ranks made the same calls and all were refused locally: still in step.
        c.barrier()
    })
    .unwrap();
}

/// Rank 1 expects 2 elements from rank 0, which sends 1: with the check off the backend itself
/// reports it (every rank sees every rank's counts); with the check on, the front end does,
/// naming the rank, the peer and both counts, before any data moves.
#[test]
fn disagreeing_all_to_all_v_counts_fail_on_every_rank() {
    for mode in [MismatchCheck::Off, MismatchCheck::All] {
        let errs = backend_local::run(2, &Default::default(), |_f, c| {
            c.set_mismatch_check(mode);
            let (sc, rc) = if c.rank() == 0 {
                ([1, 1], [1, 1])
            } else {
                ([1, 1], [2, 1])
            };
            let send = [7i32; 2];
            let mut recv = vec![0i32; rc.iter().sum()];
            let e = c.all_to_all_v_into(&send, &sc, &mut recv, &rc).unwrap_err();
            Ok(e.to_string())
        })
        .unwrap();
        for (rank, e) in errs.iter().enumerate() {
            match mode {
                MismatchCheck::Off => assert!(
                    e.contains("world rank 0 sends 1 elements to world rank 1, which expects 2"),
                    "rank {rank}: {e}"
                ),
                _ => assert!(
                    e.contains("rank 1: expects 2 elements from rank 0, which sends 1")
                        && e.contains("rank 0: agrees"),
                    "rank {rank}: {e}"
                ),
            }
        }
    }
}

#[test]
fn disagreeing_all_gather_v_counts_fail_on_every_rank() {
    for mode in [MismatchCheck::Off, MismatchCheck::All] {
        let errs = backend_local::run(2, &Default::default(), |_f, c| {
            c.set_mismatch_check(mode);
            let counts = if c.rank() == 0 { [1, 2] } else { [2, 1] };
            let send = vec![1u64; counts[c.rank()]];
            let mut recv = [0u64; 3];
            Ok(c.all_gather_v_into(&send, &mut recv, &counts).unwrap_err())
        })
        .unwrap();
        for e in errs {
            match mode {
                // With the check off the backend itself compares the calls (each carries its
                // counts vector) and reports both on every rank.
                MismatchCheck::Off => {
                    let text = e.to_string();
                    assert!(
                        text.contains("disagree about collective call")
                            && text.contains("AllGatherV(U64, [1, 2])")
                            && text.contains("AllGatherV(U64, [2, 1])"),
                        "{text}"
                    );
                }
                _ => assert!(
                    matches!(e, Error::CollectiveMismatch { .. }),
                    "{mode:?}: {e}"
                ),
            }
        }
    }
}
