//! The blocking sections: identity (rank, size, global ranks) and the operation sweep over every
//! supported dtype and reduction.

use crate::ctx::Ctx;
use crate::values::{reduce_expected, value_in, Num, K};
use grid_core::{Bool, F8E4M3, F8E5M2};
use grid_core::{BufMut, BufRef, Communicator, CommunicatorExt, DType, P2pOp, ReduceOp};
use half::{bf16, f16};

pub(crate) fn identity(
    ctx: &mut Ctx,
    label: &str,
    c: &dyn Communicator,
    expected_global: &[usize],
) {
    let n = c.size();
    ctx.expect(format!("{label}/rank_in_range"), c.rank() < n, || {
        format!("rank {} not below size {n}", c.rank())
    });
    ctx.eq(
        format!("{label}/global_ranks_len"),
        &n,
        &c.global_ranks().len(),
    );
    ctx.eq(
        format!("{label}/global_ranks"),
        &expected_global.to_vec(),
        &c.global_ranks().to_vec(),
    );
    let sorted = c.global_ranks().windows(2).all(|w| w[0] < w[1]);
    ctx.expect(format!("{label}/global_ranks_ascending"), sorted, || {
        format!("{:?} is not ascending", c.global_ranks())
    });
    // The rank is this process's position: all-gather the world rank and compare.
    let me = ctx.rank as i64;
    let mut all = vec![0i64; n];
    if ctx
        .ok(
            &format!("{label}/all_gather_identity"),
            c.all_gather_into(&[me], &mut all[..]),
        )
        .is_some()
    {
        let want: Vec<i64> = c.global_ranks().iter().map(|&g| g as i64).collect();
        ctx.eq(format!("{label}/ranks_match_global_ranks"), &want, &all);
    }
}

pub(crate) fn sweep(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    for d in DType::ALL {
        if !c.supports(d, None) {
            ctx.skip(
                format!("{label}/{d}"),
                format!("the {} backend cannot move {d}", c.backend()),
            );
            continue;
        }
        match d {
            DType::F32 => typed::<f32>(ctx, label, c),
            DType::F64 => typed::<f64>(ctx, label, c),
            DType::I32 => typed::<i32>(ctx, label, c),
            DType::I64 => typed::<i64>(ctx, label, c),
            DType::U8 => typed::<u8>(ctx, label, c),
            DType::F16 => typed::<f16>(ctx, label, c),
            DType::BF16 => typed::<bf16>(ctx, label, c),
            DType::I8 => typed::<i8>(ctx, label, c),
            DType::U32 => typed::<u32>(ctx, label, c),
            DType::U64 => typed::<u64>(ctx, label, c),
            DType::Bool => typed::<Bool>(ctx, label, c),
            DType::F8E4M3 => typed::<F8E4M3>(ctx, label, c),
            DType::F8E5M2 => typed::<F8E5M2>(ctx, label, c),
        }
    }
}

fn typed<T: Num>(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me, d) = (c.size(), c.rank(), T::DTYPE);
    let p = format!("{label}/{d}");
    // Reductions.
    for op in ReduceOp::ALL {
        let name = format!("{p}/all_reduce/{op}");
        if !c.supports(d, Some(op)) {
            ctx.skip(
                name.clone(),
                format!("the {} backend does not reduce {d} with {op}", c.backend()),
            );
            ctx.skip(format!("{p}/reduce_scatter/{op}"), "unsupported");
            ctx.skip(format!("{p}/reduce_scatter_in_place/{op}"), "unsupported");
            continue;
        }
        if n > T::EXACT_UP_TO {
            ctx.skip(
                name,
                format!(
                    "exact {d} values need groups of at most {} ranks",
                    T::EXACT_UP_TO
                ),
            );
            continue;
        }
        let send: Vec<T> = (0..K).map(|i| value_in::<T>(op, me, i)).collect();
        let mut recv = vec![T::of(0); K];
        if ctx
            .ok(&name, c.all_reduce_into(&send[..], &mut recv[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name.clone(), op, n, &want, &recv);
        }
        // The same reduction in place: the input buffer receives the result.
        let name = format!("{p}/all_reduce_in_place/{op}");
        let mut buf = send.clone();
        if ctx
            .ok(&name, c.all_reduce_in_place(&mut buf[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name, op, n, &want, &buf);
        }
        // Reduce-scatter: element j of rank r's input is input(op, r, j).
        let name = format!("{p}/reduce_scatter/{op}");
        let k = 2;
        let send: Vec<T> = (0..n * k).map(|j| value_in::<T>(op, me, j)).collect();
        let mut recv = vec![T::of(0); k];
        if ctx
            .ok(&name, c.reduce_scatter_into(&send[..], &mut recv[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..k)
                .map(|i| reduce_expected::<T>(op, n, me * k + i))
                .collect();
            ctx.values(name, op, n, &want, &recv);
        }
        // The same in place: the input is the whole buffer, this rank's reduced block lands at
        // rank · k (the rest of the buffer is unspecified and not checked).
        let name = format!("{p}/reduce_scatter_in_place/{op}");
        let mut buf: Vec<T> = (0..n * k).map(|j| value_in::<T>(op, me, j)).collect();
        if ctx
            .ok(&name, c.reduce_scatter_in_place(&mut buf[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..k)
                .map(|i| reduce_expected::<T>(op, n, me * k + i))
                .collect();
            ctx.values(name, op, n, &want, &buf[me * k..(me + 1) * k]);
        }
    }
    // Empty all-reduce.
    let name = format!("{p}/all_reduce/empty");
    let mut empty: Vec<T> = Vec::new();
    if !c.supports(d, Some(ReduceOp::Sum)) {
        ctx.skip(
            name,
            format!("the {} backend does not reduce {d} with Sum", c.backend()),
        );
    } else if ctx
        .ok(
            &name,
            c.all_reduce_into(&[][..], &mut empty[..], ReduceOp::Sum),
        )
        .is_some()
    {
        ctx.pass(name);
    }
    // Broadcast from every root.
    for root in 0..n {
        let name = format!("{p}/broadcast/root{root}");
        let want: Vec<T> = (0..K).map(|i| T::tag(root % 16 * 10 + i)).collect();
        let mut buf: Vec<T> = if me == root {
            want.clone()
        } else {
            vec![T::of(99); K]
        };
        if ctx
            .ok(&name, c.broadcast_into(&mut buf[..], root))
            .is_some()
        {
            ctx.eq(name, &want, &buf);
        }
    }
    // All-gather.
    let name = format!("{p}/all_gather");
    let k = 3;
    let send: Vec<T> = (0..k).map(|i| T::tag(me * k + i)).collect();
    let mut recv = vec![T::of(0); n * k];
    if ctx
        .ok(&name, c.all_gather_into(&send[..], &mut recv[..]))
        .is_some()
    {
        let want: Vec<T> = (0..n * k).map(|j| T::tag(j)).collect();
        ctx.eq(name, &want, &recv);
    }
    // All-gather in place: this rank's block already at rank · k, the others' slots hold junk
    // that must be overwritten.
    let name = format!("{p}/all_gather_in_place");
    let mut buf: Vec<T> = (0..n * k)
        .map(|j| if j / k == me { T::tag(j) } else { T::of(99) })
        .collect();
    if ctx.ok(&name, c.all_gather_in_place(&mut buf[..])).is_some() {
        let want: Vec<T> = (0..n * k).map(|j| T::tag(j)).collect();
        ctx.eq(name, &want, &buf);
    }
    // All-to-all: from rank r to rank j, element i: (r·n + j)·2 + i.
    let name = format!("{p}/all_to_all");
    let k = 2;
    let send: Vec<T> = (0..n * k)
        .map(|x| T::tag((me * n + x / k) * k + x % k))
        .collect();
    let mut recv = vec![T::of(0); n * k];
    if ctx
        .ok(&name, c.all_to_all_into(&send[..], &mut recv[..]))
        .is_some()
    {
        let want: Vec<T> = (0..n * k)
            .map(|x| T::tag(((x / k) * n + me) * k + x % k))
            .collect();
        ctx.eq(name, &want, &recv);
    }
    // Barrier.
    let name = format!("{p}/barrier");
    if ctx.ok(&name, c.barrier()).is_some() {
        ctx.pass(name);
    }
    if n < 2 {
        ctx.skip(format!("{p}/send_recv"), "needs 2 ranks");
        ctx.skip(format!("{p}/batch_p2p"), "needs 2 ranks");
        return;
    }
    // Ring: rank 0 sends first, every other rank receives first (no deadlock at any size).
    let name = format!("{p}/send_recv");
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let out: Vec<T> = (0..4).map(|i| T::tag(me * 10 + i)).collect();
    let mut inb = vec![T::of(0); 4];
    let r = if me == 0 {
        c.send_to(&out[..], right, 7)
            .and_then(|_| c.recv_from(&mut inb[..], left, 7))
    } else {
        c.recv_from(&mut inb[..], left, 7)
            .and_then(|_| c.send_to(&out[..], right, 7))
    };
    if ctx.ok(&name, r).is_some() {
        let want: Vec<T> = (0..4).map(|i| T::tag(left * 10 + i)).collect();
        ctx.eq(name, &want, &inb);
    }
    // Batch: send [16r + j, 16r + j + 1] to every other rank j, receive from every other rank.
    let name = format!("{p}/batch_p2p");
    let outs: Vec<Vec<T>> = (0..n)
        .map(|j| vec![T::tag(16 * me + j), T::tag(16 * me + j + 1)])
        .collect();
    let mut ins: Vec<Vec<T>> = vec![vec![T::of(0); 2]; n];
    let mut ops: Vec<P2pOp<'_>> = Vec::new();
    for (j, (o, i)) in outs.iter().zip(ins.iter_mut()).enumerate() {
        if j == me {
            continue;
        }
        ops.push(P2pOp::Send {
            buf: BufRef::from(&o[..]),
            peer: j,
            tag: 11,
        });
        ops.push(P2pOp::Recv {
            buf: BufMut::from(&mut i[..]),
            peer: j,
            tag: 11,
        });
    }
    if ctx.ok(&name, c.batch_p2p(ops)).is_some() {
        let want: Vec<Vec<T>> = (0..n)
            .map(|j| {
                if j == me {
                    vec![T::of(0); 2]
                } else {
                    vec![T::tag(16 * j + me), T::tag(16 * j + me + 1)]
                }
            })
            .collect();
        ctx.eq(name, &want, &ins);
    }
    // Framed: to every other rank a 5-byte header [me, j, 0xAB, 0xCD, dtype size] with a
    // payload of 70,000 elements (past Gloo's 64 KiB inline limit for every dtype), and a plain
    // message of 3 elements in the same batch on another tag.
    let name = format!("{p}/batch_p2p_framed");
    const LEN: usize = 70_000;
    let heads: Vec<[u8; 5]> = (0..n)
        .map(|j| {
            [
                me as u8,
                j as u8,
                0xAB,
                0xCD,
                std::mem::size_of::<T>() as u8,
            ]
        })
        .collect();
    let datas: Vec<Vec<T>> = (0..n)
        .map(|j| (0..LEN).map(|x| T::tag(me * 7 + j * 3 + x)).collect())
        .collect();
    let plains: Vec<[T; 3]> = (0..n)
        .map(|j| [T::tag(me), T::tag(j), T::tag(me + j)])
        .collect();
    let mut in_heads = vec![[0u8; 5]; n];
    let mut in_datas: Vec<Vec<T>> = vec![vec![T::of(0); LEN]; n];
    let mut in_plains: Vec<[T; 3]> = vec![[T::of(0); 3]; n];
    let mut ops: Vec<P2pOp<'_>> = Vec::new();
    for (j, ((ih, id), ip)) in in_heads
        .iter_mut()
        .zip(in_datas.iter_mut())
        .zip(in_plains.iter_mut())
        .enumerate()
    {
        if j == me {
            continue;
        }
        ops.push(P2pOp::SendFramed {
            head: &heads[j][..],
            buf: BufRef::from(&datas[j][..]),
            peer: j,
            tag: 20,
        });
        ops.push(P2pOp::Send {
            buf: BufRef::from(&plains[j][..]),
            peer: j,
            tag: 22,
        });
        ops.push(P2pOp::RecvFramed {
            head: &mut ih[..],
            buf: BufMut::from(&mut id[..]),
            peer: j,
            tag: 20,
        });
        ops.push(P2pOp::Recv {
            buf: BufMut::from(&mut ip[..]),
            peer: j,
            tag: 22,
        });
    }
    if ctx.ok(&name, c.batch_p2p(ops)).is_some() {
        let others = (0..n).filter(|&j| j != me);
        let want_heads: Vec<[u8; 5]> = others
            .clone()
            .map(|j| {
                [
                    j as u8,
                    me as u8,
                    0xAB,
                    0xCD,
                    std::mem::size_of::<T>() as u8,
                ]
            })
            .collect();
        let got_heads: Vec<[u8; 5]> = others.clone().map(|j| in_heads[j]).collect();
        let want_datas: Vec<Vec<T>> = others
            .clone()
            .map(|j| (0..LEN).map(|x| T::tag(j * 7 + me * 3 + x)).collect())
            .collect();
        let got_datas: Vec<&Vec<T>> = others.clone().map(|j| &in_datas[j]).collect();
        let want_plains: Vec<[T; 3]> = others
            .clone()
            .map(|j| [T::tag(j), T::tag(me), T::tag(me + j)])
            .collect();
        let got_plains: Vec<[T; 3]> = others.map(|j| in_plains[j]).collect();
        if want_heads != got_heads {
            ctx.fail(
                &name,
                format!("headers {got_heads:?}, expected {want_heads:?}"),
            );
        } else if want_plains != got_plains {
            ctx.fail(
                &name,
                "the plain messages beside the framed ones differ".into(),
            );
        } else {
            let want: Vec<&Vec<T>> = want_datas.iter().collect();
            ctx.eq(name, &want, &got_datas);
        }
    }
}
