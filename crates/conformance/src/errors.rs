//! The error section: mismatched lengths and dtypes, roots and peers out of range, unsupported
//! dtypes and device memory, each expected as its typed [`grid_core::Error`].

use crate::ctx::{expect_err, Ctx};
use grid_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, DeviceBuffer, Error, P2pOp, ReduceOp,
    Request, Tensor,
};
use std::any::Any;

/// A fake device buffer, for checking that host-only backends reject device memory.
#[derive(Debug)]
struct FakeDevice(usize);

impl DeviceBuffer for FakeDevice {
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn len(&self) -> usize {
        self.0
    }
    fn device(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub(crate) fn errors(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/errors");
    let len = |e: &Error| matches!(e, Error::LengthMismatch { .. });
    let dty = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
    let range = |e: &Error| matches!(e, Error::PeerOutOfRange { .. });
    let unsup = |e: &Error| matches!(e, Error::Unsupported { .. });
    let mut out3 = [0f32; 3];
    let mut out_i = [0i32; 2];
    expect_err(
        ctx,
        format!("{p}/all_reduce_length"),
        c.all_reduce_into(&[1f32, 2.0][..], &mut out3[..], ReduceOp::Sum),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/all_reduce_dtype"),
        c.all_reduce(
            BufRef::from(&[1f32, 2.0][..]),
            BufMut::from(&mut out_i[..]),
            ReduceOp::Sum,
        ),
        "DTypeMismatch",
        dty,
    );
    let mut ag = vec![0f32; n * 2 + 1];
    expect_err(
        ctx,
        format!("{p}/all_gather_length"),
        c.all_gather_into(&[1f32, 2.0][..], &mut ag[..]),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/all_gather_dtype"),
        c.all_gather(
            BufRef::from(&[1f32][..]),
            BufMut::from(&mut vec![0i32; n][..]),
        ),
        "DTypeMismatch",
        dty,
    );
    let rs = vec![0f32; n * 2 + 1];
    expect_err(
        ctx,
        format!("{p}/reduce_scatter_length"),
        c.reduce_scatter_into(&rs[..], &mut [0f32; 2][..], ReduceOp::Sum),
        "LengthMismatch",
        len,
    );
    let a2a = vec![0f32; n * 2];
    expect_err(
        ctx,
        format!("{p}/all_to_all_length"),
        c.all_to_all_into(&a2a[..], &mut vec![0f32; n * 2 + 1][..]),
        "LengthMismatch",
        len,
    );
    if n > 1 {
        let odd = vec![0f32; n + 1];
        expect_err(
            ctx,
            format!("{p}/all_to_all_indivisible"),
            c.all_to_all_into(&odd[..], &mut vec![0f32; n + 1][..]),
            "Invalid, LengthMismatch or Indivisible",
            |e| {
                matches!(
                    e,
                    Error::Invalid(_) | Error::LengthMismatch { .. } | Error::Indivisible { .. }
                )
            },
        );
    }
    expect_err(
        ctx,
        format!("{p}/broadcast_root"),
        c.broadcast_into(&mut [0f32; 2][..], n),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/send_peer"),
        c.send_to(&[0f32][..], n, 0),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/recv_peer"),
        c.recv_from(&mut [0f32][..], n + 3, 0),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/send_self"),
        c.send_to(&[0f32][..], me, 0),
        "an error",
        |_| true,
    );
    expect_err(
        ctx,
        format!("{p}/batch_peer"),
        c.batch_p2p(vec![P2pOp::Send {
            buf: BufRef::from(&[0f32][..]),
            peer: n,
            tag: 0,
        }]),
        "PeerOutOfRange",
        range,
    );
    // The errors carry the numbers involved.
    expect_err(
        ctx,
        format!("{p}/all_reduce_length_numbers"),
        c.all_reduce_into(&[1f32, 2.0][..], &mut out3[..], ReduceOp::Sum),
        "LengthMismatch { expected: 2, actual: 3 }",
        |e| {
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/all_gather_length_numbers"),
        c.all_gather_into(&[1f32, 2.0][..], &mut ag[..]),
        "LengthMismatch with expected = 2·size",
        |e| matches!(e, Error::LengthMismatch { expected, actual, .. } if *expected == 2 * n && *actual == 2 * n + 1),
    );
    expect_err(
        ctx,
        format!("{p}/all_reduce_dtype_numbers"),
        c.all_reduce(
            BufRef::from(&[1f32, 2.0][..]),
            BufMut::from(&mut out_i[..]),
            ReduceOp::Sum,
        ),
        "DTypeMismatch { expected: f32, actual: i32 }",
        |e| {
            matches!(
                e,
                Error::DTypeMismatch {
                    expected: DType::F32,
                    actual: DType::I32,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/broadcast_root_numbers"),
        c.broadcast_into(&mut [0f32; 2][..], n),
        "PeerOutOfRange { rank: size, size }",
        |e| matches!(e, Error::PeerOutOfRange { rank, size, .. } if *rank == n && *size == n),
    );
    // The in-place all-gather and reduce-scatter: a buffer that is not one block per rank is
    // Indivisible, naming its length and the size, blocking and nonblocking, before any
    // communication (so every rank may make the bad call alone).
    if n > 1 {
        let indivisible = |e: &Error| matches!(e, Error::Indivisible { len, parts, .. } if *len == 2 * n + 1 && *parts == n);
        let want = "Indivisible { len: 2·size + 1, parts: size }";
        let mut odd = vec![0f32; 2 * n + 1];
        expect_err(
            ctx,
            format!("{p}/all_gather_in_place_indivisible"),
            c.all_gather_in_place(&mut odd[..]),
            want,
            indivisible,
        );
        expect_err(
            ctx,
            format!("{p}/reduce_scatter_in_place_indivisible"),
            c.reduce_scatter_in_place(&mut odd[..], ReduceOp::Sum),
            want,
            indivisible,
        );
        expect_err(
            ctx,
            format!("{p}/iall_gather_in_place_indivisible"),
            c.iall_gather_in_place(vec![0i64; 2 * n + 1]).map(|_| ()),
            want,
            indivisible,
        );
        expect_err(
            ctx,
            format!("{p}/ireduce_scatter_in_place_indivisible"),
            c.ireduce_scatter_in_place(vec![0i64; 2 * n + 1], ReduceOp::Max)
                .map(|_| ()),
            want,
            indivisible,
        );
    }
    // An unsupported reduction in place is refused like out of place (bool has no average).
    if c.supports(DType::Bool, None) {
        let mut b = vec![grid_core::Bool::from(true); 2 * n];
        expect_err(
            ctx,
            format!("{p}/reduce_scatter_in_place_unsupported"),
            c.reduce_scatter_in_place(&mut b[..], ReduceOp::Avg),
            "Unsupported",
            unsup,
        );
    }
    // Out-of-place nonblocking all-reduce validates at start too.
    expect_err(
        ctx,
        format!("{p}/start_all_reduce_into_length"),
        c.start(Request::AllReduceInto {
            send: vec![1f32, 2.0].into(),
            recv: vec![0f32; 3].into(),
            op: ReduceOp::Sum,
        })
        .map(|_| ()),
        "LengthMismatch { expected: 2, actual: 3 }",
        |e| {
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/start_all_reduce_into_dtype"),
        c.start(Request::AllReduceInto {
            send: vec![1f32, 2.0].into(),
            recv: vec![0i32; 2].into(),
            op: ReduceOp::Sum,
        })
        .map(|_| ()),
        "DTypeMismatch",
        dty,
    );
    // Nonblocking forms validate at start.
    let start = |r: Request| c.start(r).map(|_| ());
    expect_err(
        ctx,
        format!("{p}/start_all_gather_length"),
        start(Request::AllGather {
            send: vec![1f32].into(),
            recv: vec![0f32; n + 1].into(),
        }),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/start_reduce_scatter_dtype"),
        start(Request::ReduceScatter {
            send: vec![1f32; n].into(),
            recv: vec![0i32; 1].into(),
            op: ReduceOp::Sum,
        }),
        "DTypeMismatch",
        dty,
    );
    expect_err(
        ctx,
        format!("{p}/start_broadcast_root"),
        start(Request::Broadcast {
            buf: vec![1f32].into(),
            root: n,
        }),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/start_send_peer"),
        start(Request::Send {
            buf: vec![1f32].into(),
            peer: n,
            tag: 0,
        }),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/start_recv_peer"),
        start(Request::Recv {
            buf: vec![1f32].into(),
            peer: n,
            tag: 0,
        }),
        "PeerOutOfRange",
        range,
    );
    // Unsupported dtype/op pairs must say so.
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            if c.supports(d, Some(op)) {
                continue;
            }
            let name = format!("{p}/unsupported/{d}/{op}");
            if !c.supports(d, None) {
                ctx.skip(name, "dtype not movable");
                continue;
            }
            let send = grid_core::HostBuffer::zeros(d, 2);
            let mut recv = grid_core::HostBuffer::zeros(d, 2);
            expect_err(
                ctx,
                name,
                c.all_reduce(
                    BufRef::Host(send.as_slice()),
                    BufMut::Host(recv.as_mut_slice()),
                    op,
                ),
                "Unsupported",
                unsup,
            );
        }
    }
    // Device memory on a host-only backend.
    if !c.accepts(grid_core::Memory::Device) {
        let dev = FakeDevice(2);
        let mut out = [0f32; 2];
        expect_err(
            ctx,
            format!("{p}/device_memory"),
            c.all_reduce(
                BufRef::Device(&dev),
                BufMut::from(&mut out[..]),
                ReduceOp::Sum,
            ),
            "Unsupported",
            unsup,
        );
        let mut dev_out = FakeDevice(2);
        expect_err(
            ctx,
            format!("{p}/device_memory_in_place"),
            c.in_place_all_reduce(BufMut::Device(&mut dev_out), ReduceOp::Sum),
            "Unsupported",
            unsup,
        );
        expect_err(
            ctx,
            format!("{p}/device_memory_start"),
            c.start(Request::AllReduce {
                buf: Tensor::Device(Box::new(FakeDevice(2))),
                op: ReduceOp::Sum,
            })
            .map(|_| ()),
            "Unsupported",
            unsup,
        );
    } else {
        ctx.skip(
            format!("{p}/device_memory"),
            "the backend accepts device memory",
        );
    }
    // The communicator still works after all of the above.
    let name = format!("{p}/still_usable");
    let mut s = [0i64];
    if ctx
        .ok(
            &name,
            c.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum),
        )
        .is_some()
    {
        ctx.eq(name, &(n as i64), &s[0]);
    }
}
