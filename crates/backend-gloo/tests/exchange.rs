//! The raw layer of the collectives built from point-to-point messages
//! (`RawContext::exchange`): exact values at 2, 3 and 4 ranks with blocks below and above the
//! inline limit, empty blocks, a block whose sides disagree (reported, memory untouched, the
//! context still usable), separation from user point-to-point messages of the same tag, and
//! the argument checks.

use backend_gloo::{run_ranks, GlooConfig, RawBlock, RawP2p, ShimCode, P2P_INLINE_MAX};
use grid_core::{Communicator, Error, HostSlice, HostSliceMut};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(T)
}

fn shim(e: backend_gloo::ShimError) -> Error {
    Error::Invalid(e.to_string())
}

/// The value of element `i` of the block that rank `from` sends to rank `to`.
fn val(from: usize, to: usize, i: usize) -> i64 {
    (from * 1_000_000 + to * 10_000 + i) as i64
}

/// Uneven counts: rank `from` sends `count(from, to)` elements to `to`; some are empty, some
/// above the inline limit (8-byte elements).
fn count(from: usize, to: usize, big: bool) -> usize {
    let base = (from * 3 + to * 5) % 4; // 0..=3, so some blocks are empty
    if big && (from + to) % 2 == 1 {
        P2P_INLINE_MAX / 8 + 1000 + base
    } else {
        base
    }
}

fn all_to_all(n: usize, big: bool) {
    let job = format!("xchg-{n}-{big}");
    let results = run_ranks(n, &cfg(&job), move |_f, w| {
        let me = w.rank();
        let mut send = Vec::new();
        let mut sends = Vec::new();
        for to in 0..n {
            let c = count(me, to, big);
            if to != me {
                sends.push(RawBlock {
                    peer: to,
                    offset: send.len(),
                    count: c,
                });
            }
            send.extend((0..c).map(|i| val(me, to, i)));
        }
        let mut recvs = Vec::new();
        let mut total = 0;
        for from in 0..n {
            let c = count(from, me, big);
            if from != me {
                recvs.push(RawBlock {
                    peer: from,
                    offset: total,
                    count: c,
                });
            }
            total += c;
        }
        let mut recv = vec![-1i64; total];
        let m = w
            .raw()
            .exchange(
                HostSlice::I64(&send),
                &sends,
                HostSliceMut::I64(&mut recv),
                &recvs,
                42,
                T,
            )
            .map_err(shim)?;
        assert!(m.is_empty(), "{m:?}");
        // Every block from another rank, exactly; this rank's own block left to the caller.
        let mut at = 0;
        for from in 0..n {
            let c = count(from, me, big);
            for i in 0..c {
                let want = if from == me { -1 } else { val(from, me, i) };
                assert_eq!(recv[at + i], want, "rank {me}: element {i} from {from}");
            }
            at += c;
        }
        Ok(())
    })
    .unwrap();
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r} of {n}: {e}"));
    }
}

#[test]
fn uneven_blocks_exact_at_2_3_4_ranks() {
    for n in [2, 3, 4] {
        all_to_all(n, false);
        all_to_all(n, true);
    }
}

/// Rank 0 sends 5 elements where rank 1 expects 4, once inline and once above the inline limit:
/// rank 1 is told (sender, both counts), its memory is untouched, the large send learns it
/// too, and the context works afterwards.
#[test]
fn disagreeing_block_is_reported_and_discarded() {
    let results = run_ranks(2, &cfg("xchg-mismatch"), |_f, w| {
        let me = w.rank();
        let mut out = Vec::new();
        for (tag, n) in [(7u32, 5usize), (8, P2P_INLINE_MAX / 4 + 3)] {
            if me == 0 {
                let send = vec![3.5f32; n];
                let m = w
                    .raw()
                    .exchange(
                        HostSlice::F32(&send),
                        &[RawBlock {
                            peer: 1,
                            offset: 0,
                            count: n,
                        }],
                        HostSliceMut::F32(&mut []),
                        &[],
                        tag,
                        T,
                    )
                    .map_err(shim)?;
                out.push(m);
            } else {
                let mut recv = vec![0.25f32; n - 1];
                let m = w
                    .raw()
                    .exchange(
                        HostSlice::F32(&[]),
                        &[],
                        HostSliceMut::F32(&mut recv),
                        &[RawBlock {
                            peer: 0,
                            offset: 0,
                            count: n - 1,
                        }],
                        tag,
                        T,
                    )
                    .map_err(shim)?;
                assert!(recv.iter().all(|&x| x == 0.25), "memory written");
                out.push(m);
            }
        }
        // Still usable: a matching exchange.
        let peer = 1 - me;
        let mut r = [0u8; 2];
        let m = w
            .raw()
            .exchange(
                HostSlice::U8(&[me as u8 + 1, 9]),
                &[RawBlock {
                    peer,
                    offset: 0,
                    count: 2,
                }],
                HostSliceMut::U8(&mut r),
                &[RawBlock {
                    peer,
                    offset: 0,
                    count: 2,
                }],
                9,
                T,
            )
            .map_err(shim)?;
        assert!(m.is_empty());
        assert_eq!(r, [peer as u8 + 1, 9]);
        Ok(out)
    })
    .unwrap();
    let r0 = results[0].as_ref().unwrap();
    let r1 = results[1].as_ref().unwrap();
    // Inline: the sender is not told; the receiver is.
    assert!(r0[0].is_empty(), "{:?}", r0[0]);
    let m = r1[0][0];
    assert!(m.is_recv);
    assert_eq!(m.peer, 0);
    assert_eq!(m.sent.1, 5);
    assert_eq!(m.posted.1, 4);
    // Above the inline limit both sides are told.
    let n = (P2P_INLINE_MAX / 4 + 3) as u64;
    assert_eq!((r1[1][0].sent.1, r1[1][0].posted.1), (n, n - 1));
    assert!(!r0[1][0].is_recv);
    assert_eq!((r0[1][0].sent.1, r0[1][0].posted.1), (n, n - 1));
}

/// A user message with the same tag as a collective's exchange, posted before it, is never
/// taken by the exchange (and the other way round).
#[test]
fn user_messages_never_match_collective_blocks() {
    let results = run_ranks(2, &cfg("xchg-tags"), |_f, w| {
        let me = w.rank();
        let tag = 11u32;
        if me == 0 {
            // The user message is posted first (Gloo completes a send only once its receive is
            // posted, so it waits on a thread while the exchange runs).
            std::thread::scope(|s| {
                let user = s.spawn(|| {
                    let mut ops = [RawP2p::Send {
                        data: HostSlice::I32(&[100, 101]),
                        peer: 1,
                        tag,
                        head: None,
                    }];
                    w.raw().p2p(&mut ops, T).map_err(shim)
                });
                std::thread::sleep(Duration::from_millis(200));
                let m = w
                    .raw()
                    .exchange(
                        HostSlice::I32(&[7, 8]),
                        &[RawBlock {
                            peer: 1,
                            offset: 0,
                            count: 2,
                        }],
                        HostSliceMut::I32(&mut []),
                        &[],
                        tag,
                        T,
                    )
                    .map_err(shim)?;
                assert!(m.is_empty());
                user.join()
                    .map_err(|_| Error::Invalid("user send panicked".into()))??;
                Ok::<(), Error>(())
            })?;
            Ok((vec![], vec![]))
        } else {
            // The collective's block first, then the user message.
            let mut coll = vec![0i32; 2];
            let m = w
                .raw()
                .exchange(
                    HostSlice::I32(&[]),
                    &[],
                    HostSliceMut::I32(&mut coll),
                    &[RawBlock {
                        peer: 0,
                        offset: 0,
                        count: 2,
                    }],
                    tag,
                    T,
                )
                .map_err(shim)?;
            assert!(m.is_empty());
            let mut user = vec![0i32; 2];
            let mut ops = [RawP2p::Recv {
                data: HostSliceMut::I32(&mut user),
                peer: 0,
                tag,
                head: None,
            }];
            w.raw().p2p(&mut ops, T).map_err(shim)?;
            Ok((coll, user))
        }
    })
    .unwrap();
    let (coll, user) = results[1].as_ref().unwrap();
    assert_eq!(coll, &[7, 8]);
    assert_eq!(user, &[100, 101]);
}

#[test]
fn bad_blocks_are_refused_before_anything_moves() {
    let results = run_ranks(2, &cfg("xchg-args"), |_f, w| {
        let me = w.rank();
        let peer = 1 - me;
        let mut recv = [0i64; 4];
        let mut errs = Vec::new();
        let mut try_it = |sends: &[RawBlock], recvs: &[RawBlock], recv: &mut [i64]| {
            let e = w
                .raw()
                .exchange(
                    HostSlice::I64(&[1, 2, 3]),
                    sends,
                    HostSliceMut::I64(recv),
                    recvs,
                    3,
                    T,
                )
                .unwrap_err();
            assert_eq!(e.code, ShimCode::Invalid, "{e}");
            errs.push(e.message);
        };
        let b = |peer, offset, count| RawBlock {
            peer,
            offset,
            count,
        };
        // A send block past the end of the send buffer.
        try_it(&[b(peer, 2, 2)], &[], &mut recv);
        // A receive block past the end.
        try_it(&[], &[b(peer, 3, 2)], &mut recv);
        // Overflowing offset.
        try_it(&[], &[b(peer, usize::MAX, 2)], &mut recv);
        // Two receive blocks that overlap.
        try_it(&[], &[b(peer, 0, 3), b(peer, 2, 1)], &mut recv);
        // This rank as a peer, and a rank outside the context.
        try_it(&[b(me, 0, 1)], &[], &mut recv);
        try_it(&[], &[b(2, 0, 1)], &mut recv);
        assert_eq!(recv, [0; 4]);
        Ok(errs)
    })
    .unwrap();
    let errs = results[0].as_ref().unwrap();
    assert!(
        errs[0].contains("does not lie inside the buffer of 3"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("does not lie inside the buffer of 4"),
        "{}",
        errs[1]
    );
    assert!(errs[3].contains("overlap"), "{}", errs[3]);
    assert!(errs[4].contains("not another rank"), "{}", errs[4]);
    assert!(errs[5].contains("not another rank"), "{}", errs[5]);
}
