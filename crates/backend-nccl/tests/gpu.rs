//! GPU smoke tests. They run wherever a driver, libnccl and a GPU are present (one rank per
//! GPU, threads of this process) and otherwise print `SKIPPED: <reason>` and return.

mod common;

use backend_nccl::NcclDeviceBuffer;
use common::{gpus_or_skip, on_gpus};
use grid_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, Error, GroupFactory, P2pOp, ReduceOp, Request,
    Tensor,
};
use half::bf16;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[test]
fn device_and_host_all_reduce() {
    let Some(n) = gpus_or_skip("device_and_host_all_reduce", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let r = w.rank() as f32;
        let send = w.to_device(&[r, 1.0, 2.0 * r]).unwrap();
        let mut recv: NcclDeviceBuffer<f32> = w.zeros(3).unwrap();
        w.all_reduce(
            BufRef::Device(&send),
            BufMut::Device(&mut recv),
            ReduceOp::Sum,
        )
        .unwrap();
        let dev = w.to_host(&recv).unwrap();
        let mut host = vec![bf16::ZERO; 2];
        w.all_reduce_into(
            &[bf16::from_f32(r), bf16::ONE][..],
            &mut host[..],
            ReduceOp::Max,
        )
        .unwrap();
        (dev, host)
    });
    let s: f32 = (0..n).map(|r| r as f32).sum();
    for (dev, host) in out {
        assert_eq!(dev, vec![s, n as f32, 2.0 * s]);
        assert_eq!(host, vec![bf16::from_f32((n - 1) as f32), bf16::ONE]);
    }
}

/// All-reduce on device memory in place (NCCL's own in-place form: the same buffer as send
/// and receive) and out of place, blocking and nonblocking; the send buffer of the
/// out-of-place forms is left as it was.
#[test]
fn in_place_and_out_of_place_all_reduce_on_device() {
    let Some(n) = gpus_or_skip("in_place_and_out_of_place_all_reduce_on_device", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let r = w.rank() as i64;
        // Blocking, in place.
        let mut buf = w.to_device(&[r, 1]).unwrap();
        w.in_place_all_reduce(BufMut::Device(&mut buf), ReduceOp::Sum)
            .unwrap();
        let in_place = w.to_host(&buf).unwrap();
        // Blocking, out of place.
        let send = w.to_device(&[r + 1, 2]).unwrap();
        let mut recv: NcclDeviceBuffer<i64> = w.zeros(2).unwrap();
        w.all_reduce(
            BufRef::Device(&send),
            BufMut::Device(&mut recv),
            ReduceOp::Max,
        )
        .unwrap();
        let out_of_place = (w.to_host(&recv).unwrap(), w.to_host(&send).unwrap());
        // Nonblocking, in place and out of place, on device tensors.
        let a = w
            .start(Request::AllReduce {
                buf: Tensor::Device(Box::new(w.to_device(&[r]).unwrap())),
                op: ReduceOp::Sum,
            })
            .unwrap();
        let b = w
            .start(Request::AllReduceInto {
                send: Tensor::Device(Box::new(w.to_device(&[2 * r]).unwrap())),
                recv: Tensor::Device(Box::new(w.zeros::<i64>(1).unwrap())),
                op: ReduceOp::Sum,
            })
            .unwrap();
        let back = |t: Tensor| match t {
            Tensor::Device(d) => {
                let d = d
                    .as_any()
                    .downcast_ref::<NcclDeviceBuffer<i64>>()
                    .expect("an i64 NCCL buffer comes back");
                w.to_host(d).unwrap()
            }
            Tensor::Host(h) => panic!("a device tensor came back as host memory: {h:?}"),
        };
        let nb = (back(a.wait().unwrap()), back(b.wait().unwrap()));
        // Host memory, nonblocking out of place.
        let h = w
            .iall_reduce_into(vec![1.0f32, r as f32], vec![0.0f32; 2], ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        (r, in_place, out_of_place, nb, h)
    });
    let s: i64 = (0..n as i64).sum();
    for (r, in_place, (oop, send), (a, b), h) in out {
        assert_eq!(in_place, vec![s, n as i64]);
        assert_eq!(oop, vec![n as i64, 2]);
        assert_eq!(
            send,
            vec![r + 1, 2],
            "out of place leaves the send buffer alone"
        );
        assert_eq!(a, vec![s]);
        assert_eq!(b, vec![2 * s]);
        assert_eq!(h, vec![n as f32, s as f32]);
    }
}

/// Validation happens in the front end, before NCCL: wrong lengths and self-sends are typed
/// errors and the communicator stays usable.
#[test]
fn invalid_arguments_never_reach_nccl() {
    let Some(n) = gpus_or_skip("invalid_arguments_never_reach_nccl", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let send = w.to_device(&[1.0f32, 2.0]).unwrap();
        let mut recv: NcclDeviceBuffer<f32> = w.zeros(3).unwrap();
        let e1 = w
            .all_reduce(
                BufRef::Device(&send),
                BufMut::Device(&mut recv),
                ReduceOp::Sum,
            )
            .unwrap_err();
        let e2 = w.send_to(&[1u8][..], w.rank(), 0).unwrap_err();
        let e3 = w
            .all_reduce_into(&[1i32][..], &mut [0i32][..], ReduceOp::Avg)
            .unwrap_err();
        let mut ok = [1.0f32];
        w.all_reduce_in_place(&mut ok[..], ReduceOp::Sum).unwrap();
        (e1, e2, e3, ok[0])
    });
    for (e1, e2, e3, ok) in out {
        assert!(
            matches!(
                e1,
                Error::LengthMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            ),
            "{e1:?}"
        );
        assert!(matches!(e2, Error::SelfPeer { .. }), "{e2:?}");
        assert!(
            matches!(
                e3,
                Error::Unsupported {
                    backend: "nccl",
                    ..
                }
            ),
            "{e3:?}"
        );
        assert_eq!(ok, n as f32);
    }
}

#[test]
fn split_members_and_ring_exchange() {
    let Some(n) = gpus_or_skip("split_members_and_ring_exchange", 2) else {
        return;
    };
    let out = on_gpus(n, T, |f, w| {
        let me = w.rank();
        // Pairs {0,1}, {2,3}, ...; an odd last rank stays alone.
        let sub = f.split(w, Some((me / 2) as u32), me).unwrap().unwrap();
        let members = sub.global_ranks().to_vec();
        // Ring over the world with receives started first (held back, posted as one group on
        // the first wait).
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let rw = w.irecv::<i64>(4, left, 0).unwrap();
        let sw = w.isend(vec![me as i64; 4], right, 0).unwrap();
        let got = rw.wait().unwrap();
        sw.wait().unwrap();
        // Non-members of a group get None.
        let first = f.create_group(w, &[0]).unwrap().map(|c| c.size());
        (members, got, first)
    });
    for (me, (members, got, first)) in out.into_iter().enumerate() {
        let lo = me / 2 * 2;
        let want: Vec<usize> = (lo..(lo + 2).min(n)).collect();
        assert_eq!(members, want);
        assert_eq!(got, vec![((me + n - 1) % n) as i64; 4]);
        assert_eq!(first, (me == 0).then_some(1));
    }
}

#[test]
fn abort_all_stops_every_communicator() {
    let Some(n) = gpus_or_skip("abort_all_stops_every_communicator", 1) else {
        return;
    };
    let out = on_gpus(n, T, |f, w| {
        let sub = f.split(w, Some(0), w.rank()).unwrap().unwrap();
        w.barrier().unwrap();
        let aborted = f.abort_all();
        let e1 = w.barrier().unwrap_err();
        let e2 = sub
            .all_reduce_into(&[1i32][..], &mut [0i32][..], ReduceOp::Sum)
            .unwrap_err();
        (aborted, e1, e2, f.job().live_count())
    });
    for (aborted, e1, e2, live) in out {
        assert_eq!(aborted, 2);
        assert!(matches!(e1, Error::Aborted { op: "barrier", .. }), "{e1:?}");
        assert!(e1.to_string().contains("abort_all() was called"), "{e1}");
        assert!(
            matches!(
                e2,
                Error::Aborted {
                    op: "all_reduce",
                    ..
                }
            ),
            "{e2:?}"
        );
        assert_eq!(live, 0);
    }
}

/// The NCCL issue's cross-communicator case: rank 0 starts an `isend` on one communicator and
/// then blocks in an all-reduce on another; rank 1 receives first, then joins the all-reduce.
/// The held-back send is posted before rank 0 blocks, so both finish.
#[test]
fn isend_then_all_reduce_on_another_communicator() {
    let Some(_) = gpus_or_skip("isend_then_all_reduce_on_another_communicator", 2) else {
        return;
    };
    let out = on_gpus(2, T, |f, w| {
        let me = w.rank();
        let pp = f.split(w, Some(0), me).unwrap().unwrap();
        let dp = f.split(w, Some(0), me).unwrap().unwrap();
        let start = std::time::Instant::now();
        let mut sum = [me as f32 + 1.0];
        if me == 0 {
            let send = pp.isend(vec![7i32; 1024], 1, 0).unwrap();
            dp.all_reduce_in_place(&mut sum[..], ReduceOp::Sum).unwrap();
            send.wait().unwrap();
        } else {
            let mut got = vec![0i32; 1024];
            pp.recv_from(&mut got[..], 0, 0).unwrap();
            assert_eq!(got, vec![7i32; 1024]);
            dp.all_reduce_in_place(&mut sum[..], ReduceOp::Sum).unwrap();
        }
        (sum[0], start.elapsed())
    });
    for (sum, took) in out {
        assert_eq!(sum, 3.0);
        assert!(took < T, "took {took:?}");
    }
}

/// Works dropped before completion keep their buffers until the device is done with them:
/// new buffers allocated right after (which could reuse the memory) are never corrupted.
#[test]
fn dropped_work_then_reallocation_is_not_corrupted() {
    let Some(n) = gpus_or_skip("dropped_work_then_reallocation_is_not_corrupted", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let mut bad = 0usize;
        for round in 0..20i32 {
            let big = w.to_device(&vec![1i32; 1 << 20]).unwrap();
            drop(
                w.start(Request::AllReduce {
                    buf: Tensor::Device(Box::new(big)),
                    op: ReduceOp::Sum,
                })
                .unwrap(),
            );
            let fresh = w.to_device(&vec![round; 1 << 20]).unwrap();
            let mut recv: NcclDeviceBuffer<i32> = w.zeros(1 << 20).unwrap();
            w.all_reduce(
                BufRef::Device(&fresh),
                BufMut::Device(&mut recv),
                ReduceOp::Sum,
            )
            .unwrap();
            let host = w.to_host(&recv).unwrap();
            bad += host.iter().filter(|&&x| x != round * n as i32).count();
        }
        w.synchronize().unwrap();
        bad
    });
    assert_eq!(out, vec![0; n]);
}

/// A stalled operation (rank 1 never joins) ends in `Timeout` on rank 0 within its limit plus
/// one second; `abort()` from another thread ends a stalled operation at once.
#[test]
fn stalled_operations_time_out_and_abort_from_another_thread() {
    let Some(_) = gpus_or_skip(
        "stalled_operations_time_out_and_abort_from_another_thread",
        2,
    ) else {
        return;
    };
    let limit = Duration::from_secs(2);
    let out = on_gpus(2, T, |f, w| {
        let me = w.rank();
        let a = f.split(w, Some(0), me).unwrap().unwrap();
        let b = f.split(w, Some(0), me).unwrap().unwrap();
        if me == 1 {
            // Never joins; gives up after the others did.
            std::thread::sleep(limit * 3);
            a.abort();
            b.abort();
            return (None, None);
        }
        // First the abort: a user abort fails only its own communicator.
        let aborted = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let t = std::time::Instant::now();
                let r = b
                    .with_time_limit(grid_core::TimeLimit::Unlimited)
                    .all_reduce_into(&[1.0f32][..], &mut [0.0f32][..], ReduceOp::Sum);
                (r, t.elapsed())
            });
            std::thread::sleep(Duration::from_millis(500));
            let t = std::time::Instant::now();
            b.abort();
            let abort_took = t.elapsed();
            let (r, waited) = h.join().expect("the waiting thread");
            (r.unwrap_err(), waited, abort_took)
        });
        // Then the time limit (whose failure then aborts the rest of the job).
        let t0 = std::time::Instant::now();
        let e = a
            .with_time_limit(limit)
            .all_reduce_into(&[1.0f32][..], &mut [0.0f32][..], ReduceOp::Sum)
            .unwrap_err();
        let timed_out = (e, t0.elapsed());
        (Some(timed_out), Some(aborted))
    });
    let (Some((e, took)), Some((ea, waited, abort_took))) = (&out[0].0, &out[0].1) else {
        panic!("rank 0 returned nothing")
    };
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(
        *took < limit + Duration::from_secs(1),
        "timed out after {took:?}"
    );
    assert!(matches!(ea, Error::Aborted { .. }), "{ea:?}");
    assert!(
        *waited < Duration::from_millis(1500),
        "woke after {waited:?}"
    );
    assert!(
        *abort_took < Duration::from_millis(250),
        "abort() took {abort_took:?}"
    );
    println!("abort() returned after {abort_took:?}");
}

/// Two ranks of one process asked for the same GPU: both fail at once (one names the device,
/// the other the rank that could not set up), instead of hanging in NCCL.
#[test]
fn two_ranks_on_one_gpu_fail_on_both_ranks() {
    let Some(_) = gpus_or_skip("two_ranks_on_one_gpu_fail_on_both_ranks", 1) else {
        return;
    };
    let out = common::serialised(|| {
        backend_local::run(2, &backend_local::LocalConfig::default(), |_, boot| {
            let opts = backend_nccl::NcclOptions {
                device: Some(0),
                timeout: T,
                ..backend_nccl::NcclOptions::default()
            };
            Ok(backend_nccl::NcclFactory::init(&boot, opts).map(|_| ()))
        })
    })
    .expect("the bootstrap world");
    let errors: Vec<String> = out
        .into_iter()
        .map(|r| r.expect_err("a second rank on GPU 0 must fail").to_string())
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("device 0 is already used by another NCCL rank")),
        "{errors:?}"
    );
}

/// Every collective and `batch_p2p` on device buffers (distinct send and receive buffers), in
/// f32, f16 and bf16, from 8 bytes to 64 MiB, checked exactly: the values are small integers,
/// so every sum of up to 8 ranks is exact in every float type.
fn every_collective_on_device<T>(w: &backend_nccl::NcclCommunicator, conv: fn(f32) -> T) -> usize
where
    T: backend_nccl::NcclElement + PartialEq + std::fmt::Debug,
{
    let (me, n) = (w.rank(), w.size());
    let val = |rank: usize, i: usize| conv(((rank + i) % 7) as f32);
    let mut bad = 0usize;
    for bytes in [8usize, 1 << 10, 1 << 20, 64 << 20] {
        // A multiple of n elements (all_to_all and reduce_scatter split it in n blocks).
        let len = (bytes / std::mem::size_of::<T>()).max(n) / n * n;
        let mine: Vec<T> = (0..len).map(|i| val(me, i)).collect();
        let send = w.to_device(&mine).unwrap();
        // all_reduce (sum), out of place.
        let mut recv: NcclDeviceBuffer<T> = w.zeros(len).unwrap();
        w.all_reduce(
            BufRef::Device(&send),
            BufMut::Device(&mut recv),
            ReduceOp::Sum,
        )
        .unwrap();
        let got = w.to_host(&recv).unwrap();
        bad += (0..len)
            .filter(|&i| got[i] != conv((0..n).map(|r| ((r + i) % 7) as f32).sum()))
            .count();
        // broadcast from the last rank.
        let mut b = w.to_device(&mine).unwrap();
        w.broadcast(BufMut::Device(&mut b), n - 1).unwrap();
        let got = w.to_host(&b).unwrap();
        bad += (0..len).filter(|&i| got[i] != val(n - 1, i)).count();
        // all_gather of a block of len / n.
        let blk = len / n;
        let part = w.to_device(&mine[..blk]).unwrap();
        let mut all: NcclDeviceBuffer<T> = w.zeros(len).unwrap();
        w.all_gather(BufRef::Device(&part), BufMut::Device(&mut all))
            .unwrap();
        let got = w.to_host(&all).unwrap();
        bad += (0..len)
            .filter(|&i| got[i] != val(i / blk, i % blk))
            .count();
        // reduce_scatter (sum) into a block.
        let mut out: NcclDeviceBuffer<T> = w.zeros(blk).unwrap();
        w.reduce_scatter(
            BufRef::Device(&send),
            BufMut::Device(&mut out),
            ReduceOp::Sum,
        )
        .unwrap();
        let got = w.to_host(&out).unwrap();
        bad += (0..blk)
            .filter(|&j| {
                let i = me * blk + j;
                got[j] != conv((0..n).map(|r| ((r + i) % 7) as f32).sum())
            })
            .count();
        // all_to_all: block j of rank r lands in block r of rank j.
        let mut a2a: NcclDeviceBuffer<T> = w.zeros(len).unwrap();
        w.all_to_all(BufRef::Device(&send), BufMut::Device(&mut a2a))
            .unwrap();
        let got = w.to_host(&a2a).unwrap();
        bad += (0..len)
            .filter(|&i| got[i] != val(i / blk, me * blk + i % blk))
            .count();
        // batch_p2p ring: send to the right, receive from the left (n > 1).
        if n > 1 {
            let (right, left) = ((me + 1) % n, (me + n - 1) % n);
            let mut from_left: NcclDeviceBuffer<T> = w.zeros(len).unwrap();
            w.batch_p2p(vec![
                P2pOp::Send {
                    buf: BufRef::Device(&send),
                    peer: right,
                    tag: 0,
                },
                P2pOp::Recv {
                    buf: BufMut::Device(&mut from_left),
                    peer: left,
                    tag: 0,
                },
            ])
            .unwrap();
            let got = w.to_host(&from_left).unwrap();
            bad += (0..len).filter(|&i| got[i] != val(left, i)).count();
        }
    }
    bad
}

#[test]
fn every_collective_on_device_buffers_in_f32_f16_bf16() {
    let Some(n) = gpus_or_skip("every_collective_on_device_buffers_in_f32_f16_bf16", 1) else {
        return;
    };
    let n = n.min(8);
    let out = on_gpus(n, T, |_, w| {
        (
            every_collective_on_device::<f32>(w, |x| x),
            every_collective_on_device::<half::f16>(w, half::f16::from_f32),
            every_collective_on_device::<bf16>(w, bf16::from_f32),
        )
    });
    assert_eq!(
        out,
        vec![(0, 0, 0); n],
        "wrong elements per rank (f32, f16, bf16)"
    );
}
