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
        // Ring over the world with receives started first (each enqueued at once on its
        // point-to-point lane).
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
    // The world and the split, each with its two point-to-point lanes when there are peers.
    let per_comm = 1 + 2 * usize::from(n > 1);
    for (aborted, e1, e2, live) in out {
        assert_eq!(aborted, 2 * per_comm);
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
/// The send is enqueued at once on the pipeline communicator's point-to-point lane, so both
/// finish.
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

/// An `isend`/`irecv` exchange between two ranks, both sending first, with messages far larger
/// than NCCL's buffers (64 MiB): every call is enqueued at once (lanes) and the exchange
/// completes; then the same with the sends and receives held back ([`P2pPosting::HoldBack`],
/// posted as one group at the first wait); then blocking `send`/`recv` ordered after the
/// nonblocking ones between the same ranks (messages of one direction keep their order).
#[test]
fn isend_irecv_exchange_between_two_ranks() {
    use backend_nccl::p2p::P2pPosting;
    let Some(_) = gpus_or_skip("isend_irecv_exchange_between_two_ranks", 2) else {
        return;
    };
    let len = 16 << 20; // 64 MiB of f32
    let out = on_gpus(2, T, |f, w| {
        let me = w.rank();
        let peer = 1 - me;
        let mut results = Vec::new();
        for posting in [P2pPosting::Lanes, P2pPosting::HoldBack] {
            f.set_p2p_posting(posting).unwrap();
            let c = f.split(w, Some(0), me).unwrap().unwrap();
            assert_eq!(c.p2p_posting(), posting);
            let mine = c.to_device(&vec![me as f32 + 1.0; len]).unwrap();
            let theirs: NcclDeviceBuffer<f32> = c.zeros(len).unwrap();
            let s = c
                .start(Request::Send {
                    buf: Tensor::Device(Box::new(mine)),
                    peer,
                    tag: 0,
                })
                .unwrap();
            let r = c
                .start(Request::Recv {
                    buf: Tensor::Device(Box::new(theirs)),
                    peer,
                    tag: 0,
                })
                .unwrap();
            s.wait().unwrap();
            let Tensor::Device(got) = r.wait().unwrap() else {
                panic!("device receive came back as host memory")
            };
            let got = got
                .as_any()
                .downcast_ref::<NcclDeviceBuffer<f32>>()
                .map(|b| c.to_host(b).unwrap())
                .unwrap();
            let bad = got.iter().filter(|&&x| x != peer as f32 + 1.0).count();
            // Order: a nonblocking message, then a blocking one, same direction.
            let mut first = vec![0i64; 4];
            let mut second = vec![0i64; 4];
            if me == 0 {
                let w1 = c.isend(vec![1i64; 4], 1, 0).unwrap();
                c.send_to(&[2i64; 4][..], 1, 0).unwrap();
                w1.wait().unwrap();
            } else {
                c.recv_from(&mut first[..], 0, 0).unwrap();
                c.recv_from(&mut second[..], 0, 0).unwrap();
            }
            results.push((bad, first, second));
        }
        f.set_p2p_posting(P2pPosting::Lanes).unwrap();
        results
    });
    for (me, results) in out.into_iter().enumerate() {
        for (bad, first, second) in results {
            assert_eq!(bad, 0, "rank {me}");
            if me == 1 {
                assert_eq!((first, second), (vec![1; 4], vec![2; 4]));
            }
        }
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

/// The seed of the random data of [`every_collective_on_device`]: `GRID_TEST_SEED` if set (to
/// replay a failure), else the clock; printed once, the same for every rank of the process.
fn test_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = std::env::var("GRID_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        println!("random data: GRID_TEST_SEED={seed}");
        seed
    })
}

/// Element `i` of rank `rank`'s random data: an integer from 0 to 7 (a SplitMix64 hash of the
/// seed, the rank and the index), so every sum over up to 8 ranks is exact in f32, f16 and bf16.
fn random_value(seed: u64, rank: usize, i: usize) -> f32 {
    let mut x = seed ^ ((rank as u64) << 40) ^ (i as u64);
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x % 8) as f32
}

/// Every collective and `batch_p2p` on device buffers (distinct send and receive buffers), in
/// f32, f16 and bf16, from 8 bytes to 1 GiB (1 GiB where the device has the memory, else a
/// printed `NOT RUN` of that size), checked exactly: the values are seeded random integers from
/// 0 to 7 ([`random_value`]), so every sum of up to 8 ranks is exact in every float type.
fn every_collective_on_device<T>(w: &backend_nccl::NcclCommunicator, conv: fn(f32) -> T) -> usize
where
    T: backend_nccl::NcclElement + PartialEq + std::fmt::Debug,
{
    let (me, n) = (w.rank(), w.size());
    let seed = test_seed();
    let val = |rank: usize, i: usize| conv(random_value(seed, rank, i));
    let sum = |i: usize| conv((0..n).map(|r| random_value(seed, r, i)).sum());
    let mut bad = 0usize;
    for bytes in [8usize, 1 << 10, 1 << 20, 64 << 20, 1 << 30] {
        // The largest size needs about seven buffers of its size on the device at once.
        if bytes > 64 << 20 {
            let (free, _) = w.context().mem_get_info().unwrap();
            if free < 7 * bytes {
                println!(
                    "NOT RUN: size {} MiB of {}: needs about {} MiB of free device memory, device {} has {} MiB",
                    bytes >> 20,
                    std::any::type_name::<T>(),
                    (7 * bytes) >> 20,
                    w.device(),
                    free >> 20
                );
                continue;
            }
        }
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
        bad += (0..len).filter(|&i| got[i] != sum(i)).count();
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
                got[j] != sum(i)
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

// ----- the operations of issue #16 item 7 and the new dtypes ---------------------------------

/// Elements rank `r` contributes to rank / block `j` in the uneven operations: zeros included
/// (every fourth block is empty), times `scale` to reach large messages.
fn uneven(j: usize, scale: usize) -> usize {
    [1, 3, 0, 2][j % 4] * scale
}

/// The value of element `k` of the block rank `from` sends to rank `to`.
fn cell(from: usize, to: usize, k: usize) -> i64 {
    (from as i64) * 1_000_000_000 + (to as i64) * 1_000_000 + k as i64
}

fn dev_i64(w: &backend_nccl::NcclCommunicator, len: usize) -> NcclDeviceBuffer<i64> {
    NcclDeviceBuffer::new(w.stream().alloc_zeros::<i64>(len).unwrap())
}

/// The six new operations, blocking, on device buffers (distinct send and receive buffers),
/// with uneven counts (empty blocks included), every root, from a few elements to 8 MiB per
/// rank, checked exactly against their definitions. Returns the number of wrong elements.
fn new_operations_on_device(w: &backend_nccl::NcclCommunicator, scale: usize) -> usize {
    let (me, n) = (w.rank(), w.size());
    let mut bad = 0usize;
    let count = |got: &[i64], want: &[i64]| {
        if got.len() != want.len() {
            return got.len().max(want.len());
        }
        got.iter().zip(want).filter(|(a, b)| a != b).count()
    };

    // all_to_all_v: rank r sends uneven(2r + j) to rank j.
    let sc: Vec<usize> = (0..n).map(|j| uneven(2 * me + j, scale)).collect();
    let rc: Vec<usize> = (0..n).map(|j| uneven(2 * j + me, scale)).collect();
    let send: Vec<i64> = (0..n)
        .flat_map(|j| (0..sc[j]).map(move |k| cell(me, j, k)))
        .collect();
    let want: Vec<i64> = (0..n)
        .flat_map(|j| (0..rc[j]).map(move |k| cell(j, me, k)))
        .collect();
    if !send.is_empty() && !want.is_empty() {
        let s = w.to_device(&send).unwrap();
        let mut r = dev_i64(w, want.len());
        w.all_to_all_v(BufRef::Device(&s), &sc, BufMut::Device(&mut r), &rc)
            .unwrap();
        bad += count(&w.to_host(&r).unwrap(), &want);
    }

    // all_gather_v: rank j contributes uneven(j).
    let counts: Vec<usize> = (0..n).map(|j| uneven(j, scale)).collect();
    let total: usize = counts.iter().sum();
    let want: Vec<i64> = (0..n)
        .flat_map(|j| (0..counts[j]).map(move |k| cell(j, 0, k)))
        .collect();
    if total > 0 && counts[me] > 0 {
        let mine: Vec<i64> = (0..counts[me]).map(|k| cell(me, 0, k)).collect();
        let s = w.to_device(&mine).unwrap();
        let mut r = dev_i64(w, total);
        w.all_gather_v(BufRef::Device(&s), BufMut::Device(&mut r), &counts)
            .unwrap();
        bad += count(&w.to_host(&r).unwrap(), &want);
    }

    // reduce_scatter_v (sum and max): block j of every rank reduces onto rank j.
    if total > 0 && counts[me] > 0 {
        let send: Vec<i64> = (0..total).map(|i| (me * 7 + i) as i64).collect();
        let off: usize = counts[..me].iter().sum();
        let s = w.to_device(&send).unwrap();
        for (op, f) in [
            (
                ReduceOp::Sum,
                (|a: i64, b: i64| a + b) as fn(i64, i64) -> i64,
            ),
            (ReduceOp::Max, |a: i64, b: i64| a.max(b)),
        ] {
            let mut r = dev_i64(w, counts[me]);
            w.reduce_scatter_v(BufRef::Device(&s), &counts, BufMut::Device(&mut r), op)
                .unwrap();
            let want: Vec<i64> = (0..counts[me])
                .map(|k| (1..n).fold((off + k) as i64, |acc, r| f(acc, (r * 7 + off + k) as i64)))
                .collect();
            bad += count(&w.to_host(&r).unwrap(), &want);
        }
    }

    // reduce, gather and scatter with every root.
    let m = 5 * scale;
    for root in 0..n {
        let send: Vec<i64> = (0..m).map(|i| (me * i + 1) as i64).collect();
        let s = w.to_device(&send).unwrap();
        let mut r = dev_i64(w, m);
        let recv = (me == root).then_some(BufMut::Device(&mut r));
        w.reduce(BufRef::Device(&s), recv, ReduceOp::Sum, root)
            .unwrap();
        if me == root {
            let want: Vec<i64> = (0..m)
                .map(|i| (0..n).map(|q| (q * i + 1) as i64).sum())
                .collect();
            bad += count(&w.to_host(&r).unwrap(), &want);
        }

        let mine: Vec<i64> = (0..m).map(|k| cell(me, root, k)).collect();
        let s = w.to_device(&mine).unwrap();
        let mut g = dev_i64(w, n * m);
        let recv = (me == root).then_some(BufMut::Device(&mut g));
        w.gather(BufRef::Device(&s), recv, root).unwrap();
        if me == root {
            let want: Vec<i64> = (0..n)
                .flat_map(|j| (0..m).map(move |k| cell(j, root, k)))
                .collect();
            bad += count(&w.to_host(&g).unwrap(), &want);
        }

        let all: Vec<i64> = (0..n)
            .flat_map(|j| (0..m).map(move |k| cell(root, j, k)))
            .collect();
        let s = w.to_device(&all).unwrap();
        let mut r = dev_i64(w, m);
        let send = (me == root).then_some(BufRef::Device(&s));
        w.scatter(send, BufMut::Device(&mut r), root).unwrap();
        let want: Vec<i64> = (0..m).map(|k| cell(root, me, k)).collect();
        bad += count(&w.to_host(&r).unwrap(), &want);
    }
    bad
}

#[test]
fn new_operations_on_device_buffers() {
    let Some(n) = gpus_or_skip("new_operations_on_device_buffers", 1) else {
        return;
    };
    let n = n.min(8);
    let out = on_gpus(n, T, |_, w| {
        // 1 element per unit up to about 8 MiB per rank.
        [1usize, 1000, 1 << 18]
            .into_iter()
            .map(|scale| new_operations_on_device(w, scale))
            .collect::<Vec<_>>()
    });
    assert_eq!(
        out,
        vec![vec![0, 0, 0]; n],
        "wrong elements per rank and scale"
    );
}

/// The typed forms on host memory (staged through the GPU), blocking and nonblocking, with
/// the non-root buffers `None` and the nonblocking results as grid-core defines them (the
/// root's result; a non-root rank gets its send buffer back).
#[test]
fn new_operations_on_host_memory_blocking_and_nonblocking() {
    let Some(n) = gpus_or_skip("new_operations_on_host_memory_blocking_and_nonblocking", 1) else {
        return;
    };
    let n = n.min(8);
    let out = on_gpus(n, T, |_, w| {
        let me = w.rank();
        let sc: Vec<usize> = (0..n).map(|j| uneven(me + j, 1)).collect();
        let rc: Vec<usize> = (0..n).map(|j| uneven(j + me, 1)).collect();
        let send: Vec<i32> = (0..n)
            .flat_map(|j| (0..sc[j]).map(move |k| (me * 100 + j * 10 + k) as i32))
            .collect();
        let mut a2a = vec![-1i32; rc.iter().sum()];
        w.all_to_all_v_into(&send, &sc, &mut a2a, &rc).unwrap();
        let a2a_nb = w
            .iall_to_all_v(send.clone(), sc.clone(), rc.clone())
            .unwrap()
            .wait()
            .unwrap();

        let counts: Vec<usize> = (0..n).map(|j| uneven(j, 2)).collect();
        let mine: Vec<f32> = (0..counts[me]).map(|k| (me * 10 + k) as f32).collect();
        let mut ag = vec![-1.0f32; counts.iter().sum()];
        w.all_gather_v_into(&mine, &mut ag, &counts).unwrap();
        let ag_nb = w
            .iall_gather_v(mine.clone(), counts.clone())
            .unwrap()
            .wait()
            .unwrap();

        let total: usize = counts.iter().sum();
        let block: Vec<u32> = (0..total).map(|i| (me + i) as u32).collect();
        let mut rs = vec![0u32; counts[me]];
        w.reduce_scatter_v_into(&block, &counts, &mut rs, ReduceOp::Sum)
            .unwrap();
        let rs_nb = w
            .ireduce_scatter_v(block.clone(), counts.clone(), ReduceOp::Min)
            .unwrap()
            .wait()
            .unwrap();

        let root = n - 1;
        let x = vec![me as u64 + 1, 2];
        let mut red = vec![0u64; 2];
        w.reduce_into(
            &x,
            (me == root).then_some(&mut red[..]),
            ReduceOp::Prod,
            root,
        )
        .unwrap();
        let red_nb = w
            .ireduce(x.clone(), ReduceOp::Max, root)
            .unwrap()
            .wait()
            .unwrap();

        let g = vec![me as i8, -(me as i8)];
        let mut gat = vec![0i8; 2 * n];
        w.gather_into(&g, (me == root).then_some(&mut gat[..]), root)
            .unwrap();
        let gat_nb = w.igather(g.clone(), root).unwrap().wait().unwrap();

        let all: Vec<i64> = (0..2 * n as i64).collect();
        let mut sca = vec![0i64; 2];
        w.scatter_into((me == root).then_some(&all[..]), &mut sca, root)
            .unwrap();
        let sca_nb = w
            .iscatter((me == root).then(|| all.clone()), 2, root)
            .unwrap()
            .wait()
            .unwrap();
        (
            (a2a, a2a_nb),
            (ag, ag_nb),
            (rs, rs_nb),
            (red, red_nb),
            (gat, gat_nb),
            (sca, sca_nb),
        )
    });
    let counts: Vec<usize> = (0..n).map(|j| uneven(j, 2)).collect();
    let gathered: Vec<f32> = (0..n)
        .flat_map(|j| (0..counts[j]).map(move |k| (j * 10 + k) as f32))
        .collect();
    let root = n - 1;
    for (me, (a2a, ag, rs, red, gat, sca)) in out.into_iter().enumerate() {
        let want: Vec<i32> = (0..n)
            .flat_map(|j| (0..uneven(j + me, 1)).map(move |k| (j * 100 + me * 10 + k) as i32))
            .collect();
        assert_eq!(a2a, (want.clone(), want), "all_to_all_v on rank {me}");
        assert_eq!(
            ag,
            (gathered.clone(), gathered.clone()),
            "all_gather_v on rank {me}"
        );
        let off: usize = counts[..me].iter().sum();
        let sum: Vec<u32> = (0..counts[me])
            .map(|k| (0..n).map(|r| (r + off + k) as u32).sum())
            .collect();
        let min: Vec<u32> = (0..counts[me]).map(|k| (off + k) as u32).collect();
        assert_eq!(rs, (sum, min), "reduce_scatter_v on rank {me}");
        let prod: u64 = (1..=n as u64).product();
        if me == root {
            assert_eq!(
                red,
                (vec![prod, 1 << n], vec![n as u64, 2]),
                "reduce on the root"
            );
            let g: Vec<i8> = (0..n).flat_map(|j| [j as i8, -(j as i8)]).collect();
            assert_eq!(gat, (g.clone(), g), "gather on the root");
        } else {
            assert_eq!(red.0, vec![0, 0], "a non-root receive buffer is left alone");
            assert_eq!(
                red.1,
                vec![me as u64 + 1, 2],
                "ireduce off the root: the send back"
            );
            assert_eq!(
                gat.1,
                vec![me as i8, -(me as i8)],
                "igather off the root: the send back"
            );
        }
        let want = vec![2 * me as i64, 2 * me as i64 + 1];
        assert_eq!(sca, (want.clone(), want), "scatter on rank {me}");
    }
}

/// Nonblocking forms on device tensors: the result comes back as this backend's device
/// buffer (stream-ordered), off the root the send tensor.
#[test]
fn new_operations_nonblocking_on_device_tensors() {
    let Some(n) = gpus_or_skip("new_operations_nonblocking_on_device_tensors", 1) else {
        return;
    };
    let n = n.min(8);
    let out = on_gpus(n, T, |_, w| {
        let me = w.rank();
        let back = |t: Tensor| match t {
            Tensor::Device(d) => w
                .to_host(
                    d.as_any()
                        .downcast_ref::<NcclDeviceBuffer<i64>>()
                        .expect("an i64 NCCL buffer comes back"),
                )
                .unwrap(),
            Tensor::Host(h) => panic!("a device tensor came back as host memory: {h:?}"),
        };
        let dev = |v: &[i64]| Tensor::Device(Box::new(w.to_device(v).unwrap()));
        let zeros = |len: usize| Tensor::Device(Box::new(dev_i64(w, len)));
        let counts: Vec<usize> = (0..n).map(|j| j % 2 + 1).collect();
        let total: usize = counts.iter().sum();
        let root = 0;
        let works = vec![
            w.start(Request::AllToAllV {
                send: dev(&vec![me as i64; n]),
                send_counts: vec![1; n],
                recv: zeros(n),
                recv_counts: vec![1; n],
            })
            .unwrap(),
            w.start(Request::AllGatherV {
                send: dev(&vec![me as i64; counts[me]]),
                recv: zeros(total),
                recv_counts: counts.clone(),
            })
            .unwrap(),
            w.start(Request::ReduceScatterV {
                send: dev(&vec![1; total]),
                send_counts: counts.clone(),
                recv: zeros(counts[me]),
                op: ReduceOp::Sum,
            })
            .unwrap(),
            w.start(Request::Reduce {
                send: dev(&[me as i64, 1]),
                recv: (me == root).then(|| zeros(2)),
                op: ReduceOp::Sum,
                root,
            })
            .unwrap(),
            w.start(Request::Gather {
                send: dev(&[me as i64]),
                recv: (me == root).then(|| zeros(n)),
                root,
            })
            .unwrap(),
            w.start(Request::Scatter {
                send: (me == root).then(|| dev(&(10..10 + n as i64).collect::<Vec<_>>())),
                recv: zeros(1),
                root,
            })
            .unwrap(),
        ];
        works
            .into_iter()
            .map(|k| back(k.wait().unwrap()))
            .collect::<Vec<_>>()
    });
    let counts: Vec<usize> = (0..n).map(|j| j % 2 + 1).collect();
    let ranks: Vec<i64> = (0..n as i64).collect();
    let gathered: Vec<i64> = (0..n)
        .flat_map(|j| std::iter::repeat_n(j as i64, counts[j]))
        .collect();
    let s: i64 = ranks.iter().sum();
    for (me, got) in out.into_iter().enumerate() {
        assert_eq!(got[0], ranks, "all_to_all_v on rank {me}");
        assert_eq!(got[1], gathered, "all_gather_v on rank {me}");
        assert_eq!(
            got[2],
            vec![n as i64; counts[me]],
            "reduce_scatter_v on rank {me}"
        );
        if me == 0 {
            assert_eq!(got[3], vec![s, n as i64], "reduce on the root");
            assert_eq!(got[4], ranks, "gather on the root");
        } else {
            assert_eq!(
                got[3],
                vec![me as i64, 1],
                "reduce off the root: the send back"
            );
            assert_eq!(
                got[4],
                vec![me as i64],
                "gather off the root: the send back"
            );
        }
        assert_eq!(got[5], vec![10 + me as i64], "scatter on rank {me}");
    }
}

/// The new dtypes: i8, u32 and u64 reduce exactly (sums wrap); `Bool` reduces as logical or
/// (`Sum`, `Max`) and and (`Prod`, `Min`) for any non-zero bytes, and `Avg` is refused
/// before NCCL; fp8 moves every one of its 256 bit patterns unchanged (NaNs included), and
/// reduces exactly when NCCL and the GPU can (else the front end refuses the reduction,
/// naming why).
#[test]
fn new_dtypes_move_and_reduce() {
    use grid_core::{Bool, F8E4M3, F8E5M2};
    let Some(n) = gpus_or_skip("new_dtypes_move_and_reduce", 1) else {
        return;
    };
    let n = n.min(8);
    let out = on_gpus(n, T, |_, w| {
        let me = w.rank();
        let mut i8s = vec![0i8; 2];
        w.all_reduce_into(&[100i8, -(me as i8)][..], &mut i8s[..], ReduceOp::Sum)
            .unwrap();
        let mut u32s = vec![0u32; 2];
        w.all_reduce_into(&[u32::MAX, me as u32][..], &mut u32s[..], ReduceOp::Sum)
            .unwrap();
        let mut u64s = vec![0u64; 2];
        w.all_reduce_into(
            &[u64::MAX - me as u64, me as u64][..],
            &mut u64s[..],
            ReduceOp::Min,
        )
        .unwrap();
        // Bool: rank 0 holds true as the byte 0x80, the others false; a pattern true
        // everywhere as distinct non-zero bytes.
        let bools = [
            Bool::from_byte(if me == 0 { 0x80 } else { 0 }),
            Bool::from_byte(me as u8 + 1),
        ];
        let mut or = vec![Bool::FALSE; 2];
        let mut and = vec![Bool::FALSE; 2];
        let mut max = vec![Bool::FALSE; 2];
        let mut min = vec![Bool::FALSE; 2];
        w.all_reduce_into(&bools[..], &mut or[..], ReduceOp::Sum)
            .unwrap();
        w.all_reduce_into(&bools[..], &mut and[..], ReduceOp::Prod)
            .unwrap();
        w.all_reduce_into(&bools[..], &mut max[..], ReduceOp::Max)
            .unwrap();
        w.all_reduce_into(&bools[..], &mut min[..], ReduceOp::Min)
            .unwrap();
        let avg = w.all_reduce_into(&bools[..], &mut or.clone()[..], ReduceOp::Avg);
        let logic: Vec<(bool, bool)> = [or, and, max, min]
            .iter()
            .map(|v| (v[0].get(), v[1].get()))
            .collect();
        // fp8: all 256 bit patterns through an all-gather, on device and host.
        let e4: Vec<F8E4M3> = (0..=255u8).map(F8E4M3::from_bits).collect();
        let e5: Vec<F8E5M2> = (0..=255u8).map(F8E5M2::from_bits).collect();
        let mut g4 = vec![F8E4M3::from_bits(0); 256 * n];
        w.all_gather_into(&e4[..], &mut g4[..]).unwrap();
        let d5 = w.to_device(&e5).unwrap();
        let mut g5: NcclDeviceBuffer<F8E5M2> = w.zeros(256 * n).unwrap();
        w.all_gather(BufRef::Device(&d5), BufMut::Device(&mut g5))
            .unwrap();
        let g5 = w.to_host(&g5).unwrap();
        let moved = g4
            .iter()
            .map(|x| x.to_bits())
            .eq((0..n).flat_map(|_| 0..=255u8))
            && g5
                .iter()
                .map(|x| x.to_bits())
                .eq((0..n).flat_map(|_| 0..=255u8));
        // fp8 reductions: every partial sum is a small integer, exact in E4M3.
        let caps = w.capabilities();
        let x = [
            F8E4M3::from_f32(1.0),
            F8E4M3::from_f32(if me == 0 { -2.0 } else { 0.0 }),
        ];
        let mut s = [F8E4M3::from_bits(0); 2];
        let fp8 = w.all_reduce_into(&x[..], &mut s[..], ReduceOp::Sum);
        let fp8 = match fp8 {
            Ok(()) => Ok((s[0].to_f32(), s[1].to_f32())),
            Err(e) => Err(e),
        };
        (
            i8s,
            u32s,
            u64s,
            logic,
            avg,
            moved,
            caps.fp8_reductions(),
            fp8,
        )
    });
    for (me, (i8s, u32s, u64s, logic, avg, moved, fp8_ok, fp8)) in out.into_iter().enumerate() {
        let s: i64 = (0..n as i64).sum();
        assert_eq!(
            i8s,
            vec![(100 * n as i64) as i8, (-s) as i8],
            "i8 wraps, rank {me}"
        );
        assert_eq!(
            u32s,
            vec![(u32::MAX as u64 * n as u64) as u32, s as u32],
            "u32, rank {me}"
        );
        assert_eq!(
            u64s,
            vec![u64::MAX - (n as u64 - 1), 0],
            "u64 min, rank {me}"
        );
        let or0 = true;
        let and0 = n == 1;
        assert_eq!(
            logic,
            vec![(or0, true), (and0, true), (or0, true), (and0, true)],
            "bool or/and/max/min, rank {me}"
        );
        match avg {
            Err(Error::Unsupported { .. }) => {}
            other => panic!("bool avg must be refused before NCCL, got {other:?}"),
        }
        assert!(moved, "fp8 bit patterns changed on rank {me}");
        if fp8_ok {
            assert_eq!(fp8.unwrap(), (n as f32, -2.0), "fp8 sum, rank {me}");
        } else {
            let e = fp8.unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains("fp8"), "{e}");
        }
    }
}

// ----- the GPU verification kit of the NCCL issue (item 9) ----------------------------------

/// Prints what the suite runs on, one `GPU: ` line per fact (`cargo xtask test --gpu` repeats
/// them in its report): the NCCL version and every visible device.
#[test]
fn nccl_version_and_devices() {
    let Some(n) = gpus_or_skip("nccl_version_and_devices", 1) else {
        return;
    };
    let (a, b, c) = backend_nccl::probe::nccl_version().unwrap();
    println!("GPU: NCCL {a}.{b}.{c}");
    for i in 0..n {
        let ctx = backend_nccl::cudarc::driver::CudaContext::new(i).unwrap();
        let (ma, mi) = ctx.compute_capability().unwrap();
        println!(
            "GPU: device {i} of {n}: {}, compute capability {ma}.{mi}, {} GiB",
            ctx.name().unwrap(),
            ctx.total_mem().unwrap() >> 30
        );
    }
}

/// CUDA graph capture: an in-place all-reduce captured into a graph on the communicator's
/// stream, the graph launched three times (ones become n^3), host memory refused during the
/// capture with an error naming the operation, then eager all-reduces on the same buffer and on
/// host memory.
#[test]
fn graph_capture_replay_then_eager() {
    use backend_nccl::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(n) = gpus_or_skip("graph_capture_replay_then_eager", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let mut buf = w.to_device(&vec![1.0f32; 4096]).unwrap();
        w.synchronize().unwrap();
        let s = w.stream().clone();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let captured = w.in_place_all_reduce(BufMut::Device(&mut buf), ReduceOp::Sum);
        let refused = w
            .all_reduce_into(&[1.0f32][..], &mut [0.0f32][..], ReduceOp::Sum)
            .unwrap_err();
        let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().unwrap();
        captured.unwrap();
        for _ in 0..3 {
            graph.launch().unwrap();
        }
        let replayed = w.to_host(&buf).unwrap();
        // Eager again, on the captured buffer and on host memory.
        w.in_place_all_reduce(BufMut::Device(&mut buf), ReduceOp::Sum)
            .unwrap();
        let again = w.to_host(&buf).unwrap();
        let mut eager = [0.0f32; 2];
        w.all_reduce_into(&[1.0f32, 2.0][..], &mut eager[..], ReduceOp::Sum)
            .unwrap();
        (replayed, again, refused, eager)
    });
    let n = n as f32;
    for (replayed, again, refused, eager) in out {
        assert!(
            replayed.iter().all(|&x| x == n * n * n),
            "{:?}",
            &replayed[..4]
        );
        assert!(
            again.iter().all(|&x| x == n * n * n * n),
            "{:?}",
            &again[..4]
        );
        assert!(
            matches!(
                refused,
                Error::Unsupported {
                    op: "all_reduce",
                    ..
                }
            ),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("CUDA graph"), "{refused}");
        assert_eq!(eager, [n, 2.0 * n]);
    }
}

/// `start()` on device tensors: out-of-place all-reduce, all-gather, reduce-scatter and
/// broadcast, each waited for (stream-ordered) and checked.
#[test]
fn start_on_device_tensors() {
    let Some(n) = gpus_or_skip("start_on_device_tensors", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let me = w.rank();
        let len = 1024 * n;
        let dev = |v: Vec<f32>| -> Tensor { Tensor::Device(Box::new(w.to_device(&v).unwrap())) };
        let zeros =
            |len: usize| -> Tensor { Tensor::Device(Box::new(w.zeros::<f32>(len).unwrap())) };
        let host = |t: Tensor| -> Vec<f32> {
            let Tensor::Device(d) = t else {
                panic!("a device tensor came back as host memory")
            };
            let b = d.as_any().downcast_ref::<NcclDeviceBuffer<f32>>().unwrap();
            w.to_host(b).unwrap()
        };
        let ar = w
            .start(Request::AllReduceInto {
                send: dev(vec![me as f32 + 1.0; len]),
                recv: zeros(len),
                op: ReduceOp::Sum,
            })
            .unwrap();
        let ag = w
            .start(Request::AllGather {
                send: dev(vec![me as f32; 1024]),
                recv: zeros(len),
            })
            .unwrap();
        let rs = w
            .start(Request::ReduceScatter {
                send: dev((0..len).map(|i| i as f32).collect()),
                recv: zeros(1024),
                op: ReduceOp::Sum,
            })
            .unwrap();
        let bc = w
            .start(Request::Broadcast {
                buf: dev(vec![me as f32 + 5.0; len]),
                root: 0,
            })
            .unwrap();
        (
            host(ar.wait().unwrap()),
            host(ag.wait().unwrap()),
            host(rs.wait().unwrap()),
            host(bc.wait().unwrap()),
        )
    });
    let nf = n as f32;
    for (me, (ar, ag, rs, bc)) in out.into_iter().enumerate() {
        assert!(ar.iter().all(|&x| x == nf * (nf + 1.0) / 2.0), "rank {me}");
        assert!(
            ag.iter().enumerate().all(|(i, &x)| x == (i / 1024) as f32),
            "rank {me}"
        );
        assert!(
            rs.iter()
                .enumerate()
                .all(|(j, &x)| x == nf * (me * 1024 + j) as f32),
            "rank {me}"
        );
        assert!(bc.iter().all(|&x| x == 5.0), "rank {me}");
    }
}

/// 100 rounds of split (with its point-to-point lanes), one operation, and drop: once the
/// watchdog has finalized and destroyed the dropped communicators, free device memory is back
/// to its level after the first round (within 64 MiB for the driver's own pools).
#[test]
fn split_and_drop_100_rounds_return_device_memory() {
    let Some(n) = gpus_or_skip("split_and_drop_100_rounds_return_device_memory", 1) else {
        return;
    };
    let out = on_gpus(n, Duration::from_secs(120), |f, w| {
        let me = w.rank();
        let round = || {
            let c = f.split(w, Some(0), me).unwrap().unwrap();
            let mut x = [1.0f32];
            c.all_reduce_in_place(&mut x[..], ReduceOp::Sum).unwrap();
            drop(c);
        };
        let settle = || {
            // The watchdog finalizes dropped communicators in the background; wait for it
            // (a test-side poll, bounded).
            let start = std::time::Instant::now();
            while f.job().live_count() > 1 + 2 * usize::from(n > 1)
                && start.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            w.synchronize().unwrap();
            w.context().mem_get_info().unwrap().0
        };
        round();
        let before = settle();
        for _ in 0..100 {
            round();
        }
        let after = settle();
        (before, after, f.job().live_count())
    });
    for (me, (before, after, live)) in out.into_iter().enumerate() {
        println!(
            "rank {me}: free device memory {} MiB after 1 round, {} MiB after 101 rounds ({live} live communicators)",
            before >> 20,
            after >> 20
        );
        assert!(
            after + (64 << 20) >= before,
            "rank {me}: {} MiB of device memory not returned",
            (before - after) >> 20
        );
    }
}

/// Host overhead of one 8-byte all-reduce on device buffers: the time a blocking call takes to
/// return (enqueue, stream joins, marker) and, over the same calls, the time until all of them
/// completed. Printed, not asserted (timings are benchmarks, not tests).
#[test]
fn host_overhead_per_8_byte_call() {
    let Some(n) = gpus_or_skip("host_overhead_per_8_byte_call", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let send = w.to_device(&[1.0f32, 2.0]).unwrap();
        let mut recv: NcclDeviceBuffer<f32> = w.zeros(2).unwrap();
        let mut once = || {
            w.all_reduce(
                BufRef::Device(&send),
                BufMut::Device(&mut recv),
                ReduceOp::Sum,
            )
            .unwrap()
        };
        for _ in 0..100 {
            once();
        }
        w.synchronize().unwrap();
        let calls = 2000u32;
        let t = std::time::Instant::now();
        for _ in 0..calls {
            once();
        }
        let enqueued = t.elapsed() / calls;
        w.synchronize().unwrap();
        let completed = t.elapsed() / calls;
        (enqueued, completed)
    });
    for (me, (enqueued, completed)) in out.into_iter().enumerate() {
        println!(
            "rank {me} of {n}: host overhead per 8 B all_reduce on device buffers: {:.2} µs to return, {:.2} µs per call including completion",
            enqueued.as_secs_f64() * 1e6,
            completed.as_secs_f64() * 1e6
        );
    }
}

/// The random data of the device tests (CPU only): every value 0..=7 occurs, ranks differ, and
/// a seed replays exactly.
#[test]
fn random_data_is_small_integers_that_differ_by_rank_and_replay_by_seed() {
    let a: Vec<f32> = (0..4096).map(|i| random_value(42, 0, i)).collect();
    let b: Vec<f32> = (0..4096).map(|i| random_value(42, 1, i)).collect();
    for v in 0..8 {
        assert!(a.contains(&(v as f32)), "value {v} never occurs");
    }
    assert!(a
        .iter()
        .all(|&x| (0.0..8.0).contains(&x) && x.fract() == 0.0));
    assert!(a.iter().zip(&b).filter(|(x, y)| x != y).count() > 3000);
    assert_eq!(
        a,
        (0..4096)
            .map(|i| random_value(42, 0, i))
            .collect::<Vec<_>>()
    );
    assert_ne!(
        a,
        (0..4096)
            .map(|i| random_value(43, 0, i))
            .collect::<Vec<_>>()
    );
}
