//! Framed point-to-point messages on Gloo (`P2pOp::SendFramed` / `RecvFramed`, one message of the
//! length protocol each): exact headers and payloads inline and chunked, to this rank itself, and
//! every disagreement on the form (framed against plain, two header lengths) an error naming it,
//! after which the communicator still works. Ranks are threads.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{BufMut, BufRef, Communicator, Error, P2pOp, FRAME_HEAD_MAX};
use std::time::Duration;

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(20))
}

/// One framed message from rank 0 to rank 1 (`head_out` / `head_in` bytes of header, `len`
/// f32), then the same message framed alike on both sides: (rank 0's result, rank 1's result,
/// rank 1's header and data after the second message).
fn exchange(
    job: &str,
    len: usize,
    head_out: Option<usize>,
    head_in: Option<usize>,
) -> Vec<(String, String, Vec<u8>, bool)> {
    let out = run_ranks(2, &cfg(job), |_f, w| {
        let data: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let head: Vec<u8> = (0..FRAME_HEAD_MAX as u8).collect();
        let describe = |r: grid_core::Result<()>| match r {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        let mut got = vec![-1.0f32; len];
        let mut got_head = vec![0u8; head_in.unwrap_or(0)];
        let first = if w.rank() == 0 {
            let op = match head_out {
                Some(h) => P2pOp::SendFramed {
                    head: &head[..h],
                    buf: BufRef::from(&data[..]),
                    peer: 1,
                    tag: 5,
                },
                None => P2pOp::Send {
                    buf: BufRef::from(&data[..]),
                    peer: 1,
                    tag: 5,
                },
            };
            describe(w.batch_p2p(vec![op]))
        } else {
            let op = match head_in {
                Some(_) => P2pOp::RecvFramed {
                    head: &mut got_head[..],
                    buf: BufMut::from(&mut got[..]),
                    peer: 0,
                    tag: 5,
                },
                None => P2pOp::Recv {
                    buf: BufMut::from(&mut got[..]),
                    peer: 0,
                    tag: 5,
                },
            };
            describe(w.batch_p2p(vec![op]))
        };
        let untouched = got.iter().all(|&x| x == -1.0);
        // The communicator still works: the same message framed alike on both sides.
        let mut again = vec![0u8; 3];
        let second = if w.rank() == 0 {
            w.batch_p2p(vec![P2pOp::SendFramed {
                head: &head[..3],
                buf: BufRef::from(&data[..]),
                peer: 1,
                tag: 6,
            }])
        } else {
            w.batch_p2p(vec![P2pOp::RecvFramed {
                head: &mut again[..],
                buf: BufMut::from(&mut got[..]),
                peer: 0,
                tag: 6,
            }])
        };
        second?;
        if w.rank() == 1 {
            assert_eq!(got, data, "the second message's payload");
        }
        Ok((
            first,
            format!("untouched={untouched}"),
            again,
            got_head == head[..got_head.len()],
        ))
    })
    .unwrap();
    out.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn framed_messages_arrive_whole_inline_and_chunked() {
    // 10 f32 inline; 100,000 f32 (400 KB) chunked.
    for len in [0, 10, 100_000] {
        for h in [1, 48, FRAME_HEAD_MAX] {
            let out = exchange(&format!("framed-ok-{len}-{h}"), len, Some(h), Some(h));
            assert_eq!(out[0].0, "ok", "sender, {len} elements, {h}-byte header");
            assert_eq!(out[1].0, "ok", "receiver, {len} elements, {h}-byte header");
            assert!(out[1].3, "the header arrived ({len} elements, {h} bytes)");
            assert_eq!(out[1].2, vec![0, 1, 2], "second header");
        }
    }
}

#[test]
fn framing_disagreements_are_errors_and_the_communicator_survives() {
    // (sender's header, receiver's header, what the receiver's error names)
    let cases = [
        (
            Some(48),
            None,
            [
                "a framed message with a header of 48 bytes",
                "a plain message",
            ],
        ),
        (
            None,
            Some(48),
            [
                "a plain message",
                "a framed message with a header of 48 bytes",
            ],
        ),
        (
            Some(5),
            Some(6),
            ["a header of 5 bytes", "a header of 6 bytes"],
        ),
    ];
    for len in [10usize, 100_000] {
        for (i, (out_h, in_h, names)) in cases.iter().enumerate() {
            let out = exchange(&format!("framed-bad-{len}-{i}"), len, *out_h, *in_h);
            let recv = &out[1].0;
            assert!(
                recv.contains("disagree on the form of the message with tag 5")
                    && names.iter().all(|n| recv.contains(n))
                    && recv.contains("frame a message alike"),
                "receiver, {len} elements, case {i}: {recv}"
            );
            assert_eq!(out[1].1, "untouched=true", "receiver's memory, case {i}");
            // A chunked sender hears the receiver's answer; an inline one completed.
            let send = &out[0].0;
            if len > 16_384 {
                assert!(
                    send.contains("disagree on the form of the message with tag 5"),
                    "sender, case {i}: {send}"
                );
            } else {
                assert_eq!(send, "ok", "inline sender, case {i}");
            }
        }
    }
}

#[test]
fn framed_messages_to_this_rank_and_bad_headers() {
    let out = run_ranks(2, &cfg("framed-self"), |_f, w| {
        let me = w.rank();
        let data = [me as i64, 7, 8];
        let head = [9u8, me as u8];
        let (mut got, mut got_head) = ([0i64; 3], [0u8; 2]);
        w.batch_p2p(vec![
            P2pOp::SendFramed {
                head: &head,
                buf: BufRef::from(&data[..]),
                peer: me,
                tag: 3,
            },
            P2pOp::RecvFramed {
                head: &mut got_head,
                buf: BufMut::from(&mut got[..]),
                peer: me,
                tag: 3,
            },
        ])?;
        assert_eq!((got, got_head), (data, head));
        // A plain receive for a framed send to itself.
        let e = w
            .batch_p2p(vec![
                P2pOp::SendFramed {
                    head: &head,
                    buf: BufRef::from(&data[..]),
                    peer: me,
                    tag: 3,
                },
                P2pOp::Recv {
                    buf: BufMut::from(&mut got[..]),
                    peer: me,
                    tag: 3,
                },
            ])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("is framed with a header of 2 bytes but its receive is plain"),
            "{e}"
        );
        // A header longer than the limit is refused before anything is sent, on every backend.
        let long = [0u8; FRAME_HEAD_MAX + 1];
        let e = w
            .batch_p2p(vec![P2pOp::SendFramed {
                head: &long,
                buf: BufRef::from(&data[..]),
                peer: 1 - me,
                tag: 3,
            }])
            .unwrap_err();
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("65 bytes") && m.contains("64 bytes")),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
    for r in out {
        r.unwrap();
    }
}
