//! Small collectives as one round of messages that carry the mismatch check (`comm/oneshot.rs`):
//! exact results on both sides of the one-round limit, the same bits on every rank, grid-core's
//! kernels' results (f16 and averages included), and, with the check off, a length disagreement
//! that is an error on every rank instead of wrong data.

use backend_gloo::{run_ranks, GlooConfig, ONE_ROUND_MAX};
use grid_core::{
    kernels, Communicator, CommunicatorExt, Error, HostSlice, HostSliceMut, MismatchCheck, ReduceOp,
};
use half::f16;
use std::time::Duration;

/// Payload bytes of the largest one-round message (the inline limit: the check's messages
/// carry their 8-integer fingerprint beyond it).
const LIMIT: usize = ONE_ROUND_MAX;

fn cfg(name: &str) -> GlooConfig {
    GlooConfig::new(name).with_timeout(Duration::from_secs(60))
}

/// Deterministic values of rank `r` that make f32 sums depend on the order of the additions.
fn values(r: usize, len: usize) -> Vec<f32> {
    let mut x = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1000.0
        })
        .collect()
}

/// The host kernels' sum of every rank's `values` in rank order.
fn kernel_sum(n: usize, len: usize) -> Vec<f32> {
    let all: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
    let inputs: Vec<HostSlice<'_>> = all.iter().map(|v| HostSlice::F32(v)).collect();
    let mut out = vec![0.0f32; len];
    kernels::reduce(&inputs, HostSliceMut::F32(&mut out), ReduceOp::Sum).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every element of `got` within rounding (1e-3 relative, plus 1e-3) of `want`; `rank` names
/// the rank in the message.
fn assert_close(got: impl IntoIterator<Item = f32>, want: &[f32], rank: usize) {
    for (g, k) in got.into_iter().zip(want) {
        assert!(
            (g - k).abs() <= 1e-3 * (1.0 + k.abs()),
            "rank {rank}: {g} vs {k}"
        );
    }
}

/// All-reduce and reduce-scatter of f32 at the one-round limit (the kernels' bits, the same on
/// every rank), one element above it (all-reduce: libgloo's algorithm, the same bits on every
/// rank, the sum within rounding; reduce-scatter out of place: the direct exchange, the kernels'
/// bits again) and at `n` times the limit (all-reduce in two rounds: the kernels' bits), in
/// place and out of place; all-gather, all-to-all and broadcast of integers
/// exactly, at 2, 3 and 4 ranks.
#[test]
fn results_on_both_sides_of_the_limit_at_2_to_4_ranks() {
    for n in [2usize, 3, 4] {
        let out = run_ranks(n, &cfg(&format!("one-round-{n}")), |_f, w| {
            let me = w.rank();
            let mut seen = Vec::new();
            // One round; the largest one round; libgloo (not a multiple of n); two rounds
            // (n blocks of one message each).
            for len in [1, LIMIT / 4, LIMIT / 4 + 1, n * (LIMIT / 4)] {
                let one_round = len * 4 <= LIMIT;
                let two_rounds = len % n == 0 && len / n * 4 <= LIMIT;
                let want = kernel_sum(n, len);
                let mut into = vec![0.0f32; len];
                w.all_reduce_into(&values(me, len), &mut into, ReduceOp::Sum)?;
                let mut inplace = values(me, len);
                w.all_reduce_in_place(&mut inplace, ReduceOp::Sum)?;
                for got in [&into, &inplace] {
                    if one_round || two_rounds {
                        assert_eq!(bits(got), bits(&want), "rank {me}, {len} elements");
                    } else {
                        assert_close(got.iter().copied(), &want, me);
                    }
                }
                assert_eq!(bits(&into), bits(&inplace), "rank {me}, {len} elements");
                seen.push(bits(&into));

                // Reduce-scatter: blocks of `len` elements (each rank's block fits when the
                // all-reduce does).
                let send: Vec<f32> = (0..n).flat_map(|_| values(me, len)).collect();
                let mut block = vec![0.0f32; len];
                w.reduce_scatter_into(&send, &mut block, ReduceOp::Sum)?;
                let mut whole = send.clone();
                w.reduce_scatter_in_place(&mut whole, ReduceOp::Sum)?;
                // Out of place: one round, or above it the direct exchange (the default
                // algorithm), both in rank order with the kernels. In place above the limit:
                // libgloo's all-reduce (no scratch memory), equal within rounding.
                assert_eq!(
                    bits(&block),
                    bits(&want),
                    "rank {me}, reduce-scatter of {len}"
                );
                let mine = &whole[me * len..(me + 1) * len];
                if one_round {
                    assert_eq!(bits(mine), bits(&want), "rank {me}, in place, {len}");
                } else {
                    assert_close(mine.iter().copied(), &want, me);
                }

                // Exact moves of integers.
                let mine: Vec<i32> = (0..len).map(|i| (me * 1_000_000 + i) as i32).collect();
                let mut gathered = vec![0i32; n * len];
                w.all_gather_into(&mine, &mut gathered)?;
                let mut gathered_in_place = vec![-1i32; n * len];
                gathered_in_place[me * len..(me + 1) * len].copy_from_slice(&mine);
                w.all_gather_in_place(&mut gathered_in_place)?;
                for r in 0..n {
                    for i in [0, len - 1] {
                        let v = (r * 1_000_000 + i) as i32;
                        assert_eq!(gathered[r * len + i], v, "rank {me}: all-gather");
                        assert_eq!(gathered_in_place[r * len + i], v, "rank {me}: in place");
                    }
                }
                let to: Vec<i32> = (0..n * len).map(|i| (me * 1_000_000 + i) as i32).collect();
                let mut from = vec![0i32; n * len];
                w.all_to_all_into(&to, &mut from)?;
                for r in 0..n {
                    // Block `me` of rank r's input.
                    let first = (r * 1_000_000 + me * len) as i32;
                    assert_eq!(from[r * len], first, "rank {me}: all-to-all from {r}");
                    assert_eq!(from[r * len + len - 1], first + len as i32 - 1);
                }
                let mut b: Vec<i32> = (0..len).map(|i| (me * 7 + i) as i32).collect();
                w.broadcast_into(&mut b, n - 1)?;
                assert_eq!(
                    b[len - 1],
                    ((n - 1) * 7 + len - 1) as i32,
                    "rank {me}: broadcast"
                );
                w.barrier()?;
            }
            // Nonblocking forms take the same path on the worker.
            let len = 1000;
            let sum = w.iall_reduce(values(me, len), ReduceOp::Sum)?.wait()?;
            assert_eq!(
                bits(&sum),
                bits(&kernel_sum(n, len)),
                "rank {me}: iall_reduce"
            );
            seen.push(bits(&sum));
            Ok(seen)
        })
        .unwrap();
        let first = out[0].as_ref().unwrap();
        for (r, o) in out.iter().enumerate() {
            assert_eq!(
                o.as_ref().unwrap(),
                first,
                "{n} ranks: rank {r} holds other bits than rank 0"
            );
        }
    }
}

/// f16 sums and i32 / f32 averages give exactly the host kernels' results (f16 combined in f32
/// and rounded, integer averages summed in i64 and truncated).
#[test]
fn narrow_types_and_averages_follow_the_kernels() {
    let n = 3;
    let out = run_ranks(n, &cfg("one-round-kernels"), |_f, w| {
        let me = w.rank();
        let h: Vec<f16> = (0..64)
            .map(|i| f16::from_f32(0.1 * (me * 64 + i) as f32))
            .collect();
        let mut hs = h.clone();
        w.all_reduce_in_place(&mut hs, ReduceOp::Sum)?;
        let ints: Vec<i32> = (0..16).map(|i| i32::MAX - (me * 16 + i) as i32).collect();
        let mut avg = vec![0i32; 16];
        w.all_reduce_into(&ints, &mut avg, ReduceOp::Avg)?;
        let mut favg = values(me, 33);
        w.all_reduce_in_place(&mut favg, ReduceOp::Avg)?;
        Ok((hs, avg, favg))
    })
    .unwrap();
    let hin: Vec<Vec<f16>> = (0..n)
        .map(|me| {
            (0..64)
                .map(|i| f16::from_f32(0.1 * (me * 64 + i) as f32))
                .collect()
        })
        .collect();
    let iin: Vec<Vec<i32>> = (0..n)
        .map(|me| (0..16).map(|i| i32::MAX - (me * 16 + i) as i32).collect())
        .collect();
    let fin: Vec<Vec<f32>> = (0..n).map(|me| values(me, 33)).collect();
    let mut hwant = vec![f16::ZERO; 64];
    kernels::reduce(
        &hin.iter().map(|v| HostSlice::F16(v)).collect::<Vec<_>>(),
        HostSliceMut::F16(&mut hwant),
        ReduceOp::Sum,
    )
    .unwrap();
    let mut iwant = vec![0i32; 16];
    kernels::reduce(
        &iin.iter().map(|v| HostSlice::I32(v)).collect::<Vec<_>>(),
        HostSliceMut::I32(&mut iwant),
        ReduceOp::Avg,
    )
    .unwrap();
    let mut fwant = vec![0.0f32; 33];
    kernels::reduce(
        &fin.iter().map(|v| HostSlice::F32(v)).collect::<Vec<_>>(),
        HostSliceMut::F32(&mut fwant),
        ReduceOp::Avg,
    )
    .unwrap();
    for (r, o) in out.into_iter().enumerate() {
        let (hs, avg, favg) = o.unwrap();
        assert_eq!(hs, hwant, "rank {r}: f16 sum");
        assert_eq!(
            avg, iwant,
            "rank {r}: i32 average (no overflow: summed in i64)"
        );
        assert_eq!(bits(&favg), bits(&fwant), "rank {r}: f32 average");
    }
}

/// With the check off, ranks that disagree on a small all-reduce's count get an error naming
/// the peer and both counts (the length protocol), not a result: the buffer is unchanged when
/// no peer's block arrived, and the communicator still works (broadcast and barrier included).
#[test]
fn unchecked_length_disagreement_is_an_error_on_every_rank() {
    let out = run_ranks(3, &cfg("one-round-unchecked"), |_f, w| {
        w.set_mismatch_check(MismatchCheck::Off);
        let me = w.rank();
        let count = if me == 2 { 6 } else { 4 };
        let mut v = vec![1.0f32; count];
        let e = w.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
        // Every rank got at least one block of another length: nothing was reduced.
        assert!(v.iter().all(|&x| x == 1.0), "rank {me}: the buffer changed");
        let mut ok = vec![me as i64; 3];
        w.all_reduce_in_place(&mut ok, ReduceOp::Sum)?;
        assert_eq!(ok, vec![3; 3]);
        // An unchecked broadcast sends the root's messages alone; barriers still meet.
        let mut b = vec![me as u32; 5];
        w.broadcast_into(&mut b, 1)?;
        assert_eq!(b, vec![1u32; 5], "rank {me}: unchecked broadcast");
        w.barrier()?;
        Ok(e)
    })
    .unwrap();
    for (r, o) in out.into_iter().enumerate() {
        let e = o.unwrap();
        let text = e.to_string();
        assert!(matches!(e, Error::Library(_)), "rank {r}: {e}");
        assert!(text.contains("all_reduce"), "rank {r}: {text}");
        let (theirs, mine) = if r == 2 { ("4", "6") } else { ("6", "4") };
        assert!(
            text.contains(&format!("{theirs} f32 elements"))
                && text.contains(&format!("{mine} f32 elements")),
            "rank {r}: names both counts: {text}"
        );
    }
}

/// `one_round_max = 0` sends every collective with data through libgloo's algorithms: results
/// within rounding of the kernels' (f32) or exact (integers), the same bits on every rank, and
/// a disagreement still the same `CollectiveMismatch` everywhere (the check as a round of its
/// own). A limit above what one message can carry is refused before any rendezvous.
#[test]
fn one_round_max_zero_uses_libgloo_and_still_checks() {
    let n = 3;
    let config = cfg("one-round-off").with_one_round_max(0);
    let out = run_ranks(n, &config, |_f, w| {
        let me = w.rank();
        let mut v = values(me, 1000);
        w.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let mut b = vec![me as i64; 7];
        w.broadcast_into(&mut b, 2)?;
        assert_eq!(b, vec![2; 7], "rank {me}");
        let count = if me == 1 { 9 } else { 8 };
        let e = w
            .all_reduce_in_place(&mut vec![1i32; count], ReduceOp::Sum)
            .unwrap_err();
        assert!(
            matches!(&e, Error::CollectiveMismatch { field: "count", .. }),
            "rank {me}: {e}"
        );
        Ok(bits(&v))
    })
    .unwrap();
    let want = kernel_sum(n, 1000);
    let first = out[0].as_ref().unwrap().clone();
    for (r, o) in out.into_iter().enumerate() {
        let got = o.unwrap();
        assert_eq!(got, first, "rank {r}: other bits than rank 0");
        assert_close(got.iter().map(|g| f32::from_bits(*g)), &want, r);
    }
    let too_big = cfg("one-round-too-big").with_one_round_max(ONE_ROUND_MAX + 1);
    let e = run_ranks(2, &too_big, |_f, _w| Ok(())).unwrap_err();
    assert!(e.to_string().contains("one_round_max"), "{e}");
}
