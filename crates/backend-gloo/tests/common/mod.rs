//! Exact-value checks of every communicator operation, shared by the thread, file-store and
//! Redis tests. Every rank of a communicator calls [`suite`] with the same arguments.
#![allow(dead_code)]

pub mod procs;
pub mod vops;

use grid_core::{
    Communicator, CommunicatorExt, DType, Element, Error, HostBuffer, P2pOp, ReduceOp, Request,
    Tensor,
};
use half::{bf16, f16};
use std::time::Duration;

/// Element types with exact conversions from small integers.
pub trait Val: Element {
    fn of(x: f64) -> Self;
}
impl Val for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
}
impl Val for f64 {
    fn of(x: f64) -> Self {
        x
    }
}
impl Val for i32 {
    fn of(x: f64) -> Self {
        x as i32
    }
}
impl Val for i64 {
    fn of(x: f64) -> Self {
        x as i64
    }
}
impl Val for u8 {
    fn of(x: f64) -> Self {
        (x as i64).rem_euclid(256) as u8
    }
}
impl Val for f16 {
    fn of(x: f64) -> Self {
        f16::from_f64(x)
    }
}
impl Val for bf16 {
    fn of(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

fn value(op: ReduceOp, rank: usize, i: usize, size: usize) -> f64 {
    match op {
        ReduceOp::Prod => 1.0 + ((rank + i) % 2) as f64,
        ReduceOp::Min | ReduceOp::Max => ((rank * 3 + i * 5) % (size + 3)) as f64,
        ReduceOp::Sum | ReduceOp::Avg => (rank + i % 3) as f64,
    }
}

fn expected(op: ReduceOp, i: usize, size: usize) -> f64 {
    let vals = (0..size).map(|r| value(op, r, i, size));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<f64>() / size as f64,
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

fn reductions<T: Val>(c: &dyn Communicator, n: usize) {
    let (rank, size) = (c.rank(), c.size());
    for op in ReduceOp::ALL {
        assert!(c.supports(T::DTYPE, Some(op)), "{op} on {}", T::DTYPE);
        let send: Vec<T> = (0..n).map(|i| T::of(value(op, rank, i, size))).collect();
        let want: Vec<T> = (0..n).map(|i| T::of(expected(op, i, size))).collect();
        // all_reduce
        let mut recv = vec![T::of(0.0); n];
        c.all_reduce_into(&send, &mut recv, op).unwrap();
        assert_eq!(recv, want, "all_reduce {op} {} n={n} size={size}", T::DTYPE);
        // reduce_scatter: block b of the input of rank r is `value(op, r, b*n + i)`.
        let big: Vec<T> = (0..n * size)
            .map(|i| T::of(value(op, rank, i, size)))
            .collect();
        let mut block = vec![T::of(0.0); n];
        c.reduce_scatter_into(&big, &mut block, op).unwrap();
        let want_block: Vec<T> = (0..n)
            .map(|i| T::of(expected(op, rank * n + i, size)))
            .collect();
        assert_eq!(
            block,
            want_block,
            "reduce_scatter {op} {} n={n} size={size}",
            T::DTYPE
        );
        // nonblocking all_reduce
        let w = c.iall_reduce(send.clone(), op).unwrap();
        assert_eq!(w.wait().unwrap(), want, "iall_reduce {op} {}", T::DTYPE);
    }
}

fn movement<T: Val>(c: &dyn Communicator, n: usize) {
    let (rank, size) = (c.rank(), c.size());
    let mine: Vec<T> = (0..n)
        .map(|i| T::of(((rank * 7 + i) % 100) as f64))
        .collect();
    // broadcast from every root
    for root in 0..size {
        let mut buf = if rank == root {
            mine.clone()
        } else {
            vec![T::of(0.0); n]
        };
        c.broadcast_into(&mut buf, root).unwrap();
        let want: Vec<T> = (0..n)
            .map(|i| T::of(((root * 7 + i) % 100) as f64))
            .collect();
        assert_eq!(buf, want, "broadcast root {root} {}", T::DTYPE);
    }
    // all_gather
    let mut all = vec![T::of(0.0); n * size];
    c.all_gather_into(&mine, &mut all).unwrap();
    let want: Vec<T> = (0..size)
        .flat_map(|r| (0..n).map(move |i| T::of(((r * 7 + i) % 100) as f64)))
        .collect();
    assert_eq!(all, want, "all_gather {}", T::DTYPE);
    // all_to_all: block j of rank r holds 10 r + j (+ i/100 position marker in integers)
    let send: Vec<T> = (0..size)
        .flat_map(|j| (0..n).map(move |i| T::of((10 * rank + j + i % 2) as f64)))
        .collect();
    let mut recv = vec![T::of(0.0); n * size];
    c.all_to_all_into(&send, &mut recv).unwrap();
    let want: Vec<T> = (0..size)
        .flat_map(|r| (0..n).map(move |i| T::of((10 * r + rank + i % 2) as f64)))
        .collect();
    assert_eq!(recv, want, "all_to_all {}", T::DTYPE);
}

fn point_to_point(c: &dyn Communicator) {
    let (rank, size) = (c.rank(), c.size());
    if size == 1 {
        // Only messages to itself, through a batch.
        let a = [1i32, 2, 3];
        let mut b = [0i32; 3];
        c.batch_p2p(vec![
            P2pOp::Recv {
                buf: (&mut b[..]).into(),
                peer: 0,
                tag: 4,
            },
            P2pOp::Send {
                buf: (&a[..]).into(),
                peer: 0,
                tag: 4,
            },
        ])
        .unwrap();
        assert_eq!(b, a);
        return;
    }
    let right = (rank + 1) % size;
    let left = (rank + size - 1) % size;
    // Ring shift with blocking calls: even ranks send first.
    let msg = [rank as f64, 0.5];
    let mut got = [0.0f64; 2];
    if rank % 2 == 0 {
        c.send_to(&msg, right, 11).unwrap();
        c.recv_from(&mut got, left, 11).unwrap();
    } else {
        c.recv_from(&mut got, left, 11).unwrap();
        c.send_to(&msg, right, 11).unwrap();
    }
    assert_eq!(got, [left as f64, 0.5]);
    // A batch with both directions, two tags, and a message to itself.
    let to_right = [rank as i64; 4];
    let to_left = [100 + rank as i64; 2];
    let to_me = [7u8, 8];
    let mut from_left = vec![0i64; 4];
    let mut from_right = vec![0i64; 2];
    let mut from_me = [0u8; 2];
    let mut ops = vec![
        P2pOp::Recv {
            buf: (&mut from_left[..]).into(),
            peer: left,
            tag: 1,
        },
        P2pOp::Send {
            buf: (&to_right[..]).into(),
            peer: right,
            tag: 1,
        },
        P2pOp::Recv {
            buf: (&mut from_right[..]).into(),
            peer: right,
            tag: 2,
        },
        P2pOp::Send {
            buf: (&to_left[..]).into(),
            peer: left,
            tag: 2,
        },
    ];
    ops.push(P2pOp::Send {
        buf: (&to_me[..]).into(),
        peer: rank,
        tag: 9,
    });
    ops.push(P2pOp::Recv {
        buf: (&mut from_me[..]).into(),
        peer: rank,
        tag: 9,
    });
    c.batch_p2p(ops).unwrap();
    assert_eq!(from_left, vec![left as i64; 4]);
    assert_eq!(from_right, vec![100 + right as i64; 2]);
    assert_eq!(from_me, to_me);
    // Nonblocking: both sides post the receive first, then the send, then wait in reverse.
    let r = c.irecv::<bf16>(3, left, 5).unwrap();
    let s = c
        .isend(vec![bf16::from_f32(rank as f32 + 0.5); 3], right, 5)
        .unwrap();
    assert_eq!(
        s.wait().unwrap(),
        vec![bf16::from_f32(rank as f32 + 0.5); 3]
    );
    assert_eq!(
        r.wait().unwrap(),
        vec![bf16::from_f32(left as f32 + 0.5); 3]
    );
    // Zero-length messages.
    let empty: [f32; 0] = [];
    let mut empty_in: [f32; 0] = [];
    c.batch_p2p(vec![
        P2pOp::Send {
            buf: (&empty[..]).into(),
            peer: right,
            tag: 3,
        },
        P2pOp::Recv {
            buf: (&mut empty_in[..]).into(),
            peer: left,
            tag: 3,
        },
    ])
    .unwrap();
}

fn nonblocking(c: &dyn Communicator) {
    let (rank, size) = (c.rank(), c.size());
    let s = (size * (size - 1) / 2) as i64;
    // Several collectives in flight, a blocking one in between, waited in reverse order.
    let w1 = c.iall_reduce(vec![rank as i64; 3], ReduceOp::Sum).unwrap();
    let w2 = c.iall_gather(vec![rank as i32]).unwrap();
    let w3 = c.ibroadcast(vec![rank as f32; 2], size - 1).unwrap();
    let mut blocking = [0i64];
    c.all_reduce_into(&[1i64], &mut blocking, ReduceOp::Sum)
        .unwrap();
    let w4 = c
        .ireduce_scatter(vec![1.0f64; 2 * size], ReduceOp::Sum)
        .unwrap();
    let w5 = c
        .iall_to_all((0..size).map(|j| (rank * size + j) as i32).collect())
        .unwrap();
    let b = c.ibarrier().unwrap();
    c.barrier().unwrap();
    b.wait().unwrap();
    assert_eq!(
        w5.wait().unwrap(),
        (0..size)
            .map(|r| (r * size + rank) as i32)
            .collect::<Vec<_>>()
    );
    assert_eq!(w4.wait().unwrap(), vec![size as f64; 2]);
    assert_eq!(blocking, [size as i64]);
    assert_eq!(w3.wait().unwrap(), vec![(size - 1) as f32; 2]);
    assert_eq!(w2.wait().unwrap(), (0..size as i32).collect::<Vec<_>>());
    assert_eq!(w1.wait().unwrap(), vec![s; 3]);
    // wait_timeout and is_completed on a finished operation
    let mut w = c
        .iall_reduce(vec![1u8], ReduceOp::Max)
        .unwrap()
        .into_inner();
    c.synchronize().unwrap();
    assert!(w.is_completed());
    match w.wait_timeout(Duration::from_secs(10)) {
        Ok(r) => assert_eq!(r.unwrap().into_vec::<u8>().unwrap(), vec![1]),
        Err(_) => panic!("a completed operation timed out"),
    }
    // The erased form with explicit buffers.
    let work = c
        .start(Request::AllGather {
            send: Tensor::Host(HostBuffer::F16(vec![f16::from_f32(rank as f32)])),
            recv: Tensor::Host(HostBuffer::zeros(DType::F16, size)),
        })
        .unwrap();
    let got = work.wait().unwrap().into_vec::<f16>().unwrap();
    assert_eq!(
        got,
        (0..size)
            .map(|r| f16::from_f32(r as f32))
            .collect::<Vec<_>>()
    );
}

fn argument_errors(c: &dyn Communicator) {
    let size = c.size();
    let mut out = vec![0.0f32; 3];
    let e = c
        .all_reduce_into(&[1.0f32; 2], &mut out, ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    let mut wrong = [0i32; 2];
    let e = c
        .all_reduce(
            BufRefOf::f32(&[1.0, 2.0]),
            (&mut wrong[..]).into(),
            ReduceOp::Sum,
        )
        .unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = c.broadcast_into(&mut out, size).unwrap_err();
    assert!(matches!(e, Error::PeerOutOfRange { .. }), "{e}");
    let e = c.send_to(&[1u8], size + 2, 0).unwrap_err();
    assert!(matches!(e, Error::PeerOutOfRange { .. }), "{e}");
    let e = c.send_to(&[1u8], c.rank(), 0).unwrap_err();
    assert!(matches!(e, Error::SelfPeer { .. }), "{e}");
    let mut gathered = vec![0u8; size + 1];
    let e = c.all_gather_into(&[1u8], &mut gathered).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    if size > 1 {
        let mut a2a = vec![0u8; size + 1];
        let e = c
            .all_to_all_into(&vec![0u8; size + 1], &mut a2a)
            .unwrap_err();
        assert!(matches!(e, Error::Indivisible { .. }), "{e}");
    }
    assert!(!c.accepts(grid_core::Memory::Device));
    // The communicator still works after rejected arguments.
    let mut one = [0i32];
    c.all_reduce_into(&[1i32], &mut one, ReduceOp::Sum).unwrap();
    assert_eq!(one, [size as i32]);
}

struct BufRefOf;
impl BufRefOf {
    fn f32(s: &[f32]) -> grid_core::BufRef<'_> {
        s.into()
    }
}

/// Every check, on one communicator.
pub fn suite(c: &dyn Communicator) {
    assert_eq!(c.backend(), "gloo");
    for n in [1usize, 5, 67] {
        reductions::<f32>(c, n);
        reductions::<f64>(c, n);
        reductions::<i32>(c, n);
        reductions::<i64>(c, n);
        reductions::<u8>(c, n);
        reductions::<f16>(c, n);
        reductions::<bf16>(c, n);
        reductions::<i8>(c, n);
        reductions::<u32>(c, n);
        reductions::<u64>(c, n);
    }
    // One size beyond Gloo's 1 MiB ring segment: 300k f32 = 1.2 MB.
    let n = 300_000;
    let big: Vec<f32> = (0..n)
        .map(|i| (i % 1000) as f32 + c.rank() as f32)
        .collect();
    let mut out = vec![0.0f32; n];
    c.all_reduce_into(&big, &mut out, ReduceOp::Sum).unwrap();
    let s = (c.size() * (c.size() - 1) / 2) as f32;
    assert!(out
        .iter()
        .enumerate()
        .all(|(i, &x)| x == c.size() as f32 * (i % 1000) as f32 + s));
    for n in [1usize, 4, 33] {
        movement::<f32>(c, n);
        movement::<u8>(c, n);
        movement::<i64>(c, n);
        movement::<bf16>(c, n);
    }
    movement::<i8>(c, 33);
    movement::<u64>(c, 33);
    // The uneven and rooted operations (`vops::suite`) run in `tests/vops.rs` at 1 to 4 ranks,
    // and the conformance suite's `ops` section checks them at 1, 2, 4 and 8 ranks as threads
    // and as processes; repeating them in every run of this suite doubled its time.
    point_to_point(c);
    nonblocking(c);
    argument_errors(c);
    // Zero-length collectives are no-ops.
    let empty: [f32; 0] = [];
    let mut e2: [f32; 0] = [];
    c.all_reduce_into(&empty, &mut e2, ReduceOp::Sum).unwrap();
    c.barrier().unwrap();
}
