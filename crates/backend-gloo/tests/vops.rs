//! The operations of issue #16 item 7 on Gloo beyond the shared exact-value suite (which
//! `threads.rs` and `processes.rs` run through `common::suite`): blocks above the 64 KiB inline
//! limit (the payload travels without a copy), a time limit that names the rank that never
//! came, an abort that wakes a rank waiting in a rooted operation, and user messages that share
//! the collective's tag number.

mod common;

use backend_gloo::{run_ranks, GlooConfig, P2P_INLINE_MAX};
use grid_core::{Communicator, CommunicatorExt, Error, MismatchCheck, ReduceOp};
use std::sync::Barrier;
use std::time::{Duration, Instant};

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

fn all_ok<T>(results: Vec<grid_core::Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// The suite of item 7 (`common::vops`) at 1, 2, 3 and 4 ranks; the conformance suite's `ops`
/// section checks the same operations at 8 ranks, as threads and as processes.
#[test]
fn item7_suite_at_1_to_4_ranks() {
    for n in [1, 2, 3, 4] {
        all_ok(
            run_ranks(n, &cfg(&format!("v-suite-{n}")), |_f, w| {
                common::vops::suite(&w);
                Ok(())
            })
            .unwrap(),
        );
    }
}

/// Blocks of 3 × the inline limit: all-to-all-v, all-gather-v, reduce-scatter-v, reduce,
/// gather and scatter with exact values at 3 ranks.
#[test]
fn large_blocks_are_exact() {
    let big = 3 * P2P_INLINE_MAX / 4 + 17; // f32 elements per block: > 192 KiB
    all_ok(
        run_ranks(3, &cfg("v-large"), move |_f, w| {
            let (me, n) = (w.rank(), w.size());
            let val = |from: usize, to: usize, i: usize| (from * 7 + to * 3 + i % 1000) as f32;
            // all_to_all_v: block sizes big, big + 1, big + 2 by destination.
            let sc: Vec<usize> = (0..n).map(|j| big + (me + j) % 3).collect();
            let rc: Vec<usize> = (0..n).map(|j| big + (j + me) % 3).collect();
            let send: Vec<f32> = (0..n)
                .flat_map(|j| (0..sc[j]).map(move |i| val(me, j, i)))
                .collect();
            let mut recv = vec![0.0f32; rc.iter().sum()];
            w.all_to_all_v_into(&send, &sc, &mut recv, &rc)?;
            let want: Vec<f32> = (0..n)
                .flat_map(|j| (0..rc[j]).map(move |i| val(j, me, i)))
                .collect();
            assert!(recv == want, "all_to_all_v");
            // all_gather_v
            let counts: Vec<usize> = (0..n).map(|j| big + j).collect();
            let mine: Vec<f32> = (0..counts[me]).map(|i| val(me, 0, i)).collect();
            let mut recv = vec![0.0f32; counts.iter().sum()];
            w.all_gather_v_into(&mine, &mut recv, &counts)?;
            let want: Vec<f32> = (0..n)
                .flat_map(|j| (0..counts[j]).map(move |i| val(j, 0, i)))
                .collect();
            assert!(recv == want, "all_gather_v");
            // reduce_scatter_v (sums of small integers: exact in f32)
            let total: usize = counts.iter().sum();
            let send: Vec<f32> = (0..total).map(|i| val(me, 1, i)).collect();
            let mut recv = vec![0.0f32; counts[me]];
            w.reduce_scatter_v_into(&send, &counts, &mut recv, ReduceOp::Sum)?;
            let off: usize = counts[..me].iter().sum();
            let want: Vec<f32> = (0..counts[me])
                .map(|i| (0..n).map(|r| val(r, 1, off + i)).sum())
                .collect();
            assert!(recv == want, "reduce_scatter_v");
            // reduce, gather, scatter to and from root 1
            let send: Vec<f32> = (0..big).map(|i| val(me, 2, i)).collect();
            let mut out = vec![0.0f32; big];
            w.reduce_into(&send, (me == 1).then_some(&mut out[..]), ReduceOp::Max, 1)?;
            if me == 1 {
                let want: Vec<f32> = (0..big).map(|i| val(n - 1, 2, i)).collect();
                assert!(out == want, "reduce");
            }
            let mut all = vec![0.0f32; big * n];
            w.gather_into(&send, (me == 1).then_some(&mut all[..]), 1)?;
            if me == 1 {
                let want: Vec<f32> = (0..n)
                    .flat_map(|j| (0..big).map(move |i| val(j, 2, i)))
                    .collect();
                assert!(all == want, "gather");
            }
            let blocks: Vec<f32> = (0..n)
                .flat_map(|j| (0..big).map(move |i| val(1, j, i)))
                .collect();
            let mut got = vec![0.0f32; big];
            w.scatter_into((me == 1).then_some(&blocks[..]), &mut got, 1)?;
            let want: Vec<f32> = (0..big).map(|i| val(1, me, i)).collect();
            assert!(got == want, "scatter");
            Ok(())
        })
        .unwrap(),
    );
}

/// A rank that never joins an all-to-all-v: the others fail within the time limit with
/// `Timeout` blaming it (check off, so the exchange itself waits; with the check on, the
/// check's exchange would), and later calls are refused.
#[test]
fn missing_rank_is_a_timeout_naming_it() {
    let timeout = Duration::from_millis(800);
    let gate = Barrier::new(3);
    let out = run_ranks(3, &cfg("v-timeout").with_timeout(timeout), |_f, w| {
        w.set_mismatch_check(MismatchCheck::Off);
        if w.rank() == 2 {
            gate.wait();
            return Ok(None);
        }
        let n = w.size();
        let t = Instant::now();
        let e = w
            .all_to_all_v_into(&vec![1u64; n], &vec![1; n], &mut vec![0u64; n], &vec![1; n])
            .unwrap_err();
        let took = t.elapsed();
        let again = w.gather_into(&[1u8], None, 2).unwrap_err();
        gate.wait();
        Ok(Some((e, took, again)))
    })
    .unwrap();
    for (r, res) in out.iter().enumerate().take(2) {
        let (e, took, again) = res.as_ref().unwrap().clone().unwrap();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    op: "all_to_all_v",
                    peer: Some(2),
                    ..
                }
            ),
            "rank {r}: {e}"
        );
        assert!(
            took >= timeout.mul_f64(0.9) && took <= timeout + Duration::from_millis(3500),
            "rank {r}: took {took:?}"
        );
        assert!(
            matches!(again, Error::Aborted { op: "gather", .. }),
            "{again}"
        );
    }
}

/// Rank 0 waits as the root of a gather for a rank that is late; `abort()` from another
/// thread of rank 0 wakes it at once with `Aborted`.
#[test]
fn abort_wakes_a_waiting_root() {
    let gate = Barrier::new(2);
    let out = run_ranks(2, &cfg("v-abort"), |_f, w| {
        if w.rank() == 1 {
            gate.wait();
            return Ok(None);
        }
        let took = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                w.abort();
            });
            let t = Instant::now();
            let mut all = [0i32; 8];
            let e = w
                .gather_into(&[1i32; 4], Some(&mut all[..]), 0)
                .unwrap_err();
            (e, t.elapsed())
        });
        gate.wait();
        Ok(Some(took))
    })
    .unwrap();
    let (e, took) = out[0].as_ref().unwrap().clone().unwrap();
    assert!(matches!(e, Error::Aborted { op: "gather", .. }), "{e}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// User messages whose tags equal the tickets of the collectives around them (0, 1, 2, ...)
/// are posted before and received after an all-to-all-v and a gather: neither side takes the
/// other's messages.
#[test]
fn user_tags_never_meet_collective_blocks() {
    all_ok(
        run_ranks(2, &cfg("v-tags"), |_f, w| {
            let (me, peer) = (w.rank(), 1 - w.rank());
            let mut sends = Vec::new();
            for tag in 0..4u32 {
                sends.push(w.isend(vec![100 + tag as i32; 2], peer, tag)?);
            }
            // Rank r sends 1 + j elements to rank j.
            let rc = vec![1 + me; 2];
            let mut recv = vec![0i32; 2 * (1 + me)];
            w.all_to_all_v_into(&[me as i32; 3], &[1, 2], &mut recv, &rc)?;
            let want: Vec<i32> = (0..2).flat_map(|j| vec![j; 1 + me]).collect();
            assert_eq!(recv, want);
            let mut all = [0i32; 4];
            w.gather_into(&[me as i32; 2], (me == 0).then_some(&mut all[..]), 0)?;
            for tag in 0..4u32 {
                let mut got = [0i32; 2];
                w.recv_from(&mut got, peer, tag)?;
                assert_eq!(got, [100 + tag as i32; 2]);
            }
            for s in sends {
                s.wait()?;
            }
            Ok(())
        })
        .unwrap(),
    );
}
