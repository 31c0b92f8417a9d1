//! The operation-set section: the uneven collectives (all-to-all-v, all-gather-v,
//! reduce-scatter-v) and the rooted ones (reduce, gather, scatter), blocking and nonblocking,
//! for every dtype the communicator moves, every root and every reduction it supports, with
//! exact expected values; then their error cases, each the typed error with its numbers.
//!
//! Uneven counts (group of `n` ranks, `n ≥ 2`):
//! * all-to-all-v: rank `s` sends `(s + 2j + 1) mod 4` elements to rank `j`, except that the
//!   last rank sends nothing and rank 0 receives nothing (so a rank with empty send and a rank
//!   with empty receive buffers take part in every call); element `t` of the block `s → j` is
//!   `tag((s·n + j)·4 + t)`;
//! * all-gather-v and reduce-scatter-v: rank `j`'s block has `j mod 3` elements (rank 0's is
//!   empty); block elements are numbered across the whole buffer, so element `x` of the
//!   gathered buffer is `tag(x)` and element `x` of a reduce-scatter input is rank `r`'s
//!   reduction input for index `x`.
//!
//! A group of one rank uses 3 elements for each count instead.

use crate::ctx::{expect_err, Ctx};
use crate::values::{reduce_expected, value_in, Num, K};
use grid_core::{
    Bool, BufMut, BufRef, Communicator, CommunicatorExt, DType, Error, HostBuffer, ReduceOp,
    Request, F8E4M3, F8E5M2,
};
use half::{bf16, f16};

/// Elements rank `s` sends to rank `j` in the uneven all-to-all of `n` ranks.
pub(crate) fn a2a_count(n: usize, s: usize, j: usize) -> usize {
    if n == 1 {
        3
    } else if s == n - 1 || j == 0 {
        0
    } else {
        (s + 2 * j + 1) % 4
    }
}

/// Elements of rank `j`'s block in all-gather-v and reduce-scatter-v over `n` ranks.
pub(crate) fn v_count(n: usize, j: usize) -> usize {
    if n == 1 {
        3
    } else {
        j % 3
    }
}

/// Start of each block (prefix sums).
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect()
}

/// The all-to-all-v plan of rank `me`: send counts, send buffer, receive counts, expected receive.
fn a2a_plan<T: Num>(n: usize, me: usize) -> (Vec<usize>, Vec<T>, Vec<usize>, Vec<T>) {
    let send_counts: Vec<usize> = (0..n).map(|j| a2a_count(n, me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|s| a2a_count(n, s, me)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..send_counts[j]).map(move |t| T::tag((me * n + j) * 4 + t)))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|s| (0..recv_counts[s]).map(move |t| T::tag((s * n + me) * 4 + t)))
        .collect();
    (send_counts, send, recv_counts, want)
}

pub(crate) fn operations(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    for d in DType::ALL {
        if !c.supports(d, None) {
            ctx.skip(
                format!("{label}/ops/{d}"),
                format!("the {} backend cannot move {d}", c.backend()),
            );
            continue;
        }
        match d {
            DType::F32 => ops_typed::<f32>(ctx, label, c),
            DType::F64 => ops_typed::<f64>(ctx, label, c),
            DType::I32 => ops_typed::<i32>(ctx, label, c),
            DType::I64 => ops_typed::<i64>(ctx, label, c),
            DType::U8 => ops_typed::<u8>(ctx, label, c),
            DType::F16 => ops_typed::<f16>(ctx, label, c),
            DType::BF16 => ops_typed::<bf16>(ctx, label, c),
            DType::I8 => ops_typed::<i8>(ctx, label, c),
            DType::U32 => ops_typed::<u32>(ctx, label, c),
            DType::U64 => ops_typed::<u64>(ctx, label, c),
            DType::Bool => ops_typed::<Bool>(ctx, label, c),
            DType::F8E4M3 => ops_typed::<F8E4M3>(ctx, label, c),
            DType::F8E5M2 => ops_typed::<F8E5M2>(ctx, label, c),
        }
    }
    bool_bytes(ctx, label, c);
    op_errors(ctx, label, c);
}

/// Any non-zero byte is true: moves keep the bytes as they are, and reductions of bytes other
/// than 0 and 1 are still OR (sum, max) and AND (product, min).
fn bool_bytes(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/ops/bool/bytes");
    if !c.supports(DType::Bool, None) {
        ctx.skip(p, format!("the {} backend cannot move bool", c.backend()));
        return;
    }
    // Element 0: true everywhere (bytes 0x80 | r); 1: false everywhere; 2: 0xff on even ranks,
    // 0 on odd ones; 3: 0x02 on rank 0 only.
    let byte = |r: usize, i: usize| -> u8 {
        match i {
            0 => 0x80 | (r % 0x80) as u8,
            1 => 0,
            2 if r.is_multiple_of(2) => 0xff,
            3 if r == 0 => 0x02,
            _ => 0,
        }
    };
    let mine: Vec<Bool> = (0..4).map(|i| Bool::from_byte(byte(me, i))).collect();
    let name = format!("{p}/all_gather_v_keeps_bytes");
    let counts = vec![4; n];
    let mut all = vec![Bool::from(false); 4 * n];
    if ctx
        .ok(&name, c.all_gather_v_into(&mine[..], &mut all[..], &counts))
        .is_some()
    {
        let want: Vec<u8> = (0..4 * n).map(|x| byte(x / 4, x % 4)).collect();
        let got: Vec<u8> = all.iter().map(|b| b.to_byte()).collect();
        ctx.eq(name, &want, &got);
    }
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod, ReduceOp::Min] {
        let name = format!("{p}/reduce/{op}");
        if !c.supports(DType::Bool, Some(op)) {
            ctx.skip(
                name,
                format!("the {} backend does not reduce bool with {op}", c.backend()),
            );
            continue;
        }
        let or = matches!(op, ReduceOp::Sum | ReduceOp::Max);
        let want: Vec<bool> = (0..4)
            .map(|i| {
                let mut bits = (0..n).map(|r| byte(r, i) != 0);
                if or {
                    bits.any(|b| b)
                } else {
                    bits.all(|b| b)
                }
            })
            .collect();
        let mut out = [Bool::from(!want[0]); 4];
        let target = (me == 0).then_some(&mut out[..]);
        if ctx
            .ok(&name, c.reduce_into(&mine[..], target, op, 0))
            .is_some()
        {
            if me == 0 {
                let got: Vec<bool> = out.iter().map(|b| b.get()).collect();
                ctx.eq(name, &want, &got);
            } else {
                ctx.pass(name);
            }
        }
        let name = format!("{p}/all_reduce/{op}");
        let mut out = [Bool::from(false); 4];
        if ctx
            .ok(&name, c.all_reduce_into(&mine[..], &mut out[..], op))
            .is_some()
        {
            let got: Vec<bool> = out.iter().map(|b| b.get()).collect();
            ctx.eq(name, &want, &got);
        }
    }
}

/// Why reduction `op` of `T` cannot be checked on `c`, or `None` when it can.
fn unreducible<T: Num>(c: &dyn Communicator, op: ReduceOp) -> Option<String> {
    let (d, n) = (T::DTYPE, c.size());
    if !c.supports(d, Some(op)) {
        Some(format!(
            "the {} backend does not reduce {d} with {op}",
            c.backend()
        ))
    } else if n > T::EXACT_UP_TO {
        Some(format!(
            "exact {d} values need groups of at most {} ranks",
            T::EXACT_UP_TO
        ))
    } else {
        None
    }
}

fn ops_typed<T: Num>(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me, d) = (c.size(), c.rank(), T::DTYPE);
    let p = format!("{label}/ops/{d}");
    let fill = T::tag(199);
    let v_counts: Vec<usize> = (0..n).map(|j| v_count(n, j)).collect();
    let v_off = offsets(&v_counts);
    let v_total: usize = v_counts.iter().sum();

    // ---- all-to-all-v ----------------------------------------------------------------------
    let (sc, send, rc, want) = a2a_plan::<T>(n, me);
    let name = format!("{p}/all_to_all_v");
    let mut recv = vec![fill; want.len()];
    if ctx
        .ok(
            &name,
            c.all_to_all_v_into(&send[..], &sc, &mut recv[..], &rc),
        )
        .is_some()
    {
        ctx.eq(name, &want, &recv);
    }
    let name = format!("{p}/iall_to_all_v");
    let r = c
        .iall_to_all_v(send.clone(), sc.clone(), rc.clone())
        .and_then(|w| w.wait());
    if let Some(v) = ctx.ok(&name, r) {
        ctx.eq(name, &want, &v);
    }
    // Every count zero: empty buffers everywhere.
    let name = format!("{p}/all_to_all_v/all_empty");
    let zeros = vec![0usize; n];
    let mut none: Vec<T> = Vec::new();
    if ctx
        .ok(
            &name,
            c.all_to_all_v_into(&[][..], &zeros, &mut none[..], &zeros),
        )
        .is_some()
    {
        ctx.pass(name);
    }

    // ---- all-gather-v ----------------------------------------------------------------------
    let name = format!("{p}/all_gather_v");
    let mine: Vec<T> = (0..v_counts[me]).map(|t| T::tag(v_off[me] + t)).collect();
    let want: Vec<T> = (0..v_total).map(T::tag).collect();
    let mut recv = vec![fill; v_total];
    if ctx
        .ok(
            &name,
            c.all_gather_v_into(&mine[..], &mut recv[..], &v_counts),
        )
        .is_some()
    {
        ctx.eq(name, &want, &recv);
    }
    let name = format!("{p}/iall_gather_v");
    let r = c
        .iall_gather_v(mine.clone(), v_counts.clone())
        .and_then(|w| w.wait());
    if let Some(v) = ctx.ok(&name, r) {
        ctx.eq(name, &want, &v);
    }

    // ---- reduce-scatter-v and reduce, every reduction ---------------------------------------
    for op in ReduceOp::ALL {
        let name = format!("{p}/reduce_scatter_v/{op}");
        if let Some(why) = unreducible::<T>(c, op) {
            // One record for the reduction's checks: (i)reduce_scatter_v, (i)reduce per root.
            ctx.skip(format!("{p}/reduce_scatter_v_and_reduce/{op}"), why);
            continue;
        }
        let send: Vec<T> = (0..v_total).map(|x| value_in::<T>(op, me, x)).collect();
        let want: Vec<T> = (0..v_counts[me])
            .map(|t| reduce_expected::<T>(op, n, v_off[me] + t))
            .collect();
        let mut recv = vec![fill; v_counts[me]];
        if ctx
            .ok(
                &name,
                c.reduce_scatter_v_into(&send[..], &v_counts, &mut recv[..], op),
            )
            .is_some()
        {
            ctx.values(name, op, n, &want, &recv);
        }
        let name = format!("{p}/ireduce_scatter_v/{op}");
        let r = c
            .ireduce_scatter_v(send, v_counts.clone(), op)
            .and_then(|w| w.wait());
        if let Some(v) = ctx.ok(&name, r) {
            ctx.values(name, op, n, &want, &v);
        }

        // Reduce to every root. Non-roots pass no buffer for even roots, and a buffer the
        // operation must ignore (leave untouched) for odd roots.
        let send: Vec<T> = (0..K).map(|i| value_in::<T>(op, me, i)).collect();
        let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
        for root in 0..n {
            let name = format!("{p}/reduce/{op}/root{root}");
            let mut recv = vec![fill; K];
            let pass_buffer = me == root || root % 2 == 1;
            let target = pass_buffer.then_some(&mut recv[..]);
            if ctx
                .ok(&name, c.reduce_into(&send[..], target, op, root))
                .is_some()
            {
                if me == root {
                    ctx.values(name, op, n, &want, &recv);
                } else {
                    ctx.eq(name, &vec![fill; K], &recv);
                }
            }
            let name = format!("{p}/ireduce/{op}/root{root}");
            let r = c.ireduce(send.clone(), op, root).and_then(|w| w.wait());
            if let Some(v) = ctx.ok(&name, r) {
                if me == root {
                    ctx.values(name, op, n, &want, &v);
                } else {
                    // Non-roots get their send buffer back.
                    ctx.eq(name, &send, &v);
                }
            }
        }
    }

    // ---- gather and scatter, every root ------------------------------------------------------
    let k = 2;
    for root in 0..n {
        // Gather: rank r sends tag(r·k + t); the root receives tag(x) for x in 0..n·k.
        let name = format!("{p}/gather/root{root}");
        let send: Vec<T> = (0..k).map(|t| T::tag(me * k + t)).collect();
        let want: Vec<T> = (0..n * k).map(T::tag).collect();
        let mut recv = vec![fill; n * k];
        let target = (me == root || root % 2 == 1).then_some(&mut recv[..]);
        if ctx
            .ok(&name, c.gather_into(&send[..], target, root))
            .is_some()
        {
            if me == root {
                ctx.eq(name, &want, &recv);
            } else {
                ctx.eq(name, &vec![fill; n * k], &recv);
            }
        }
        let name = format!("{p}/igather/root{root}");
        let r = c.igather(send.clone(), root).and_then(|w| w.wait());
        if let Some(v) = ctx.ok(&name, r) {
            if me == root {
                ctx.eq(name, &want, &v);
            } else {
                ctx.eq(name, &send, &v);
            }
        }

        // Scatter: block j of the root's buffer is tag(100 + root + j·k + t), for rank j.
        let name = format!("{p}/scatter/root{root}");
        let full: Vec<T> = (0..n * k).map(|x| T::tag(100 + root + x)).collect();
        let want: Vec<T> = (0..k).map(|t| T::tag(100 + root + me * k + t)).collect();
        // Non-roots pass nothing for even roots, and a wrong-sized buffer that must be ignored
        // for odd roots.
        let junk = [fill; 1];
        let source = if me == root {
            Some(&full[..])
        } else if root % 2 == 1 {
            Some(&junk[..])
        } else {
            None
        };
        let mut recv = vec![fill; k];
        if ctx
            .ok(&name, c.scatter_into(source, &mut recv[..], root))
            .is_some()
        {
            ctx.eq(name, &want, &recv);
        }
        let name = format!("{p}/iscatter/root{root}");
        let source = (me == root).then(|| full.clone());
        let r = c.iscatter(source, k, root).and_then(|w| w.wait());
        if let Some(v) = ctx.ok(&name, r) {
            ctx.eq(name, &want, &v);
        }
    }
}

/// The error cases of the operation set, on f32 (and bool/fp8 for the unsupported
/// reductions). Every rank makes the same mistake, so no collective is left half-entered.
fn op_errors(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/ops/errors");
    let len_is = |want: usize, got: usize| move |e: &Error| matches!(e, Error::LengthMismatch { expected, actual, .. } if *expected == want && *actual == got);
    // A counts vector refused as `BadCounts` naming it, holding it, and saying `problem`
    // (its number of entries against the size, or its sum against the buffer).
    let counts_err = |which: &'static str, given: Vec<usize>, problem: String| {
        move |e: &Error| {
            matches!(e, Error::BadCounts { what, counts, problem: p, .. }
                if *what == which && *counts == given && p.contains(&problem))
        }
    };
    let range = move |e: &Error| matches!(e, Error::PeerOutOfRange { rank, size, .. } if *rank == n && *size == n);
    let unsup = |e: &Error| matches!(e, Error::Unsupported { .. });

    // all-to-all-v: counts vectors of the wrong length, counts that do not sum to the buffers.
    let (sc, send, rc, want) = a2a_plan::<f32>(n, me);
    let mut recv = vec![0f32; want.len()];
    let long: Vec<usize> = sc.iter().copied().chain([0]).collect();
    expect_err(
        ctx,
        format!("{p}/all_to_all_v_send_counts_length"),
        c.all_to_all_v_into(&send[..], &long, &mut recv[..], &rc),
        &format!(
            "BadCounts for send_counts with {} entries for {n} ranks",
            n + 1
        ),
        counts_err(
            "send_counts",
            long.clone(),
            format!("has {} entries", n + 1),
        ),
    );
    // One entry short; the receive buffer matches the short vector's sum, so only the length
    // is wrong.
    let short = &rc[..n - 1];
    let short_sum: usize = short.iter().sum();
    expect_err(
        ctx,
        format!("{p}/all_to_all_v_recv_counts_length"),
        c.all_to_all_v_into(&send[..], &sc, &mut recv[..short_sum], short),
        &format!(
            "BadCounts for recv_counts with {} entries for {n} ranks",
            n - 1
        ),
        counts_err(
            "recv_counts",
            short.to_vec(),
            format!("has {} entries", n - 1),
        ),
    );
    let bigger: Vec<f32> = send.iter().copied().chain([0.0]).collect();
    expect_err(
        ctx,
        format!("{p}/all_to_all_v_send_sum"),
        c.all_to_all_v_into(&bigger[..], &sc, &mut recv[..], &rc),
        &format!(
            "BadCounts: send_counts sum to {} but the send buffer has {}",
            send.len(),
            send.len() + 1
        ),
        counts_err(
            "send_counts",
            sc.clone(),
            format!(
                "sums to {} but the send buffer has {} elements",
                send.len(),
                send.len() + 1
            ),
        ),
    );
    let mut recv_big = vec![0f32; want.len() + 2];
    expect_err(
        ctx,
        format!("{p}/all_to_all_v_recv_sum"),
        c.all_to_all_v_into(&send[..], &sc, &mut recv_big[..], &rc),
        &format!(
            "BadCounts: recv_counts sum to {} but the recv buffer has {}",
            want.len(),
            want.len() + 2
        ),
        counts_err(
            "recv_counts",
            rc.clone(),
            format!(
                "sums to {} but the recv buffer has {} elements",
                want.len(),
                want.len() + 2
            ),
        ),
    );
    expect_err(
        ctx,
        format!("{p}/start_all_to_all_v_send_sum"),
        c.start(Request::AllToAllV {
            send: bigger.clone().into(),
            send_counts: sc.clone(),
            recv: vec![0f32; want.len()].into(),
            recv_counts: rc.clone(),
        })
        .map(|_| ()),
        "BadCounts for send_counts",
        counts_err(
            "send_counts",
            sc.clone(),
            format!("but the send buffer has {} elements", send.len() + 1),
        ),
    );

    // all-gather-v / reduce-scatter-v.
    let v_counts: Vec<usize> = (0..n).map(|j| v_count(n, j)).collect();
    let total: usize = v_counts.iter().sum();
    let mine = vec![1f32; v_counts[me] + 1];
    expect_err(
        ctx,
        format!("{p}/all_gather_v_send_length"),
        c.all_gather_v_into(&mine[..], &mut vec![0f32; total][..], &v_counts),
        &format!(
            "LengthMismatch {{ expected: {}, actual: {} }}",
            v_counts[me],
            v_counts[me] + 1
        ),
        len_is(v_counts[me], v_counts[me] + 1),
    );
    let long: Vec<usize> = v_counts.iter().copied().chain([0]).collect();
    expect_err(
        ctx,
        format!("{p}/all_gather_v_counts_length"),
        c.all_gather_v_into(&mine[..v_counts[me]], &mut vec![0f32; total][..], &long),
        &format!(
            "BadCounts for recv_counts with {} entries for {n} ranks",
            n + 1
        ),
        counts_err(
            "recv_counts",
            long.clone(),
            format!("has {} entries", n + 1),
        ),
    );
    expect_err(
        ctx,
        format!("{p}/all_gather_v_recv_sum"),
        c.all_gather_v_into(
            &mine[..v_counts[me]],
            &mut vec![0f32; total + 1][..],
            &v_counts,
        ),
        &format!(
            "BadCounts: recv_counts sum to {total} but the recv buffer has {}",
            total + 1
        ),
        counts_err(
            "recv_counts",
            v_counts.clone(),
            format!(
                "sums to {total} but the recv buffer has {} elements",
                total + 1
            ),
        ),
    );
    expect_err(
        ctx,
        format!("{p}/reduce_scatter_v_recv_length"),
        c.reduce_scatter_v_into(
            &vec![1f32; total][..],
            &v_counts,
            &mut vec![0f32; v_counts[me] + 1][..],
            ReduceOp::Sum,
        ),
        &format!(
            "LengthMismatch {{ expected: {}, actual: {} }}",
            v_counts[me],
            v_counts[me] + 1
        ),
        len_is(v_counts[me], v_counts[me] + 1),
    );
    expect_err(
        ctx,
        format!("{p}/reduce_scatter_v_send_sum"),
        c.reduce_scatter_v_into(
            &vec![1f32; total + 3][..],
            &v_counts,
            &mut vec![0f32; v_counts[me]][..],
            ReduceOp::Sum,
        ),
        &format!(
            "BadCounts: send_counts sum to {total} but the send buffer has {}",
            total + 3
        ),
        counts_err(
            "send_counts",
            v_counts.clone(),
            format!(
                "sums to {total} but the send buffer has {} elements",
                total + 3
            ),
        ),
    );
    expect_err(
        ctx,
        format!("{p}/start_reduce_scatter_v_counts_length"),
        c.start(Request::ReduceScatterV {
            send: vec![1f32; total].into(),
            send_counts: long.clone(),
            recv: vec![0f32; v_counts[me]].into(),
            op: ReduceOp::Sum,
        })
        .map(|_| ()),
        "BadCounts for send_counts",
        counts_err(
            "send_counts",
            long.clone(),
            format!("has {} entries", n + 1),
        ),
    );

    // Rooted operations: root out of range, the root's buffer missing or of the wrong length.
    let mut out2 = [0f32; 2];
    expect_err(
        ctx,
        format!("{p}/reduce_root"),
        c.reduce_into(&[1f32, 2.0][..], Some(&mut out2[..]), ReduceOp::Sum, n),
        &format!("PeerOutOfRange {{ rank: {n}, size: {n} }}"),
        range,
    );
    expect_err(
        ctx,
        format!("{p}/gather_root"),
        c.gather_into(&[1f32][..], Some(&mut vec![0f32; n][..]), n + 2),
        "PeerOutOfRange",
        |e| matches!(e, Error::PeerOutOfRange { rank, size, .. } if *rank == n + 2 && *size == n),
    );
    expect_err(
        ctx,
        format!("{p}/scatter_root"),
        c.scatter_into(Some(&vec![0f32; n][..]), &mut [0f32][..], n),
        &format!("PeerOutOfRange {{ rank: {n}, size: {n} }}"),
        range,
    );
    expect_err(
        ctx,
        format!("{p}/start_reduce_root"),
        c.start(Request::Reduce {
            send: vec![1f32].into(),
            recv: Some(vec![0f32].into()),
            op: ReduceOp::Sum,
            root: n,
        })
        .map(|_| ()),
        "PeerOutOfRange",
        range,
    );
    // The root's own mistakes: only the root (rank 0) calls, and the front end refuses before
    // any communication, so no other rank is left waiting in a collective.
    let missing = |which: &'static str| move |e: &Error| matches!(e, Error::MissingRootBuffer { what, root: 0, .. } if *what == which);
    if me == 0 {
        expect_err(
            ctx,
            format!("{p}/reduce_missing_root_buffer"),
            c.reduce_into(&[1f32][..], None, ReduceOp::Sum, 0),
            "MissingRootBuffer { what: \"recv buffer\", root: 0 }",
            missing("recv buffer"),
        );
        expect_err(
            ctx,
            format!("{p}/gather_missing_root_buffer"),
            c.gather_into(&[1f32][..], None, 0),
            "MissingRootBuffer { what: \"recv buffer\", root: 0 }",
            missing("recv buffer"),
        );
        expect_err(
            ctx,
            format!("{p}/scatter_missing_root_buffer"),
            c.scatter_into(None, &mut [0f32][..], 0),
            "MissingRootBuffer { what: \"send buffer\", root: 0 }",
            missing("send buffer"),
        );
        expect_err(
            ctx,
            format!("{p}/reduce_root_length"),
            c.reduce_into(&[1f32, 2.0][..], Some(&mut [0f32; 3][..]), ReduceOp::Sum, 0),
            "LengthMismatch { expected: 2, actual: 3 }",
            len_is(2, 3),
        );
        expect_err(
            ctx,
            format!("{p}/gather_root_length"),
            c.gather_into(&[1f32, 2.0][..], Some(&mut vec![0f32; 2 * n + 1][..]), 0),
            &format!(
                "LengthMismatch {{ expected: {}, actual: {} }}",
                2 * n,
                2 * n + 1
            ),
            len_is(2 * n, 2 * n + 1),
        );
        expect_err(
            ctx,
            format!("{p}/scatter_root_length"),
            c.scatter_into(Some(&vec![0f32; 2 * n + 1][..]), &mut [0f32; 2][..], 0),
            &format!(
                "LengthMismatch {{ expected: {}, actual: {} }}",
                2 * n,
                2 * n + 1
            ),
            len_is(2 * n, 2 * n + 1),
        );
        expect_err(
            ctx,
            format!("{p}/gather_root_dtype"),
            c.gather(
                BufRef::from(&[1f32][..]),
                Some(BufMut::from(&mut vec![0i32; n][..])),
                0,
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
    }

    // Unsupported reductions (Avg on bool everywhere, fp8 where the backend does not reduce
    // it): reduce and reduce-scatter-v refuse them like all-reduce does.
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
            let send = HostBuffer::zeros(d, 2);
            let mut recv = HostBuffer::zeros(d, 2);
            expect_err(
                ctx,
                format!("{name}/reduce"),
                c.reduce(
                    BufRef::Host(send.as_slice()),
                    Some(BufMut::Host(recv.as_mut_slice())),
                    op,
                    0,
                ),
                "Unsupported",
                unsup,
            );
            let send = HostBuffer::zeros(d, total);
            let mut recv = HostBuffer::zeros(d, v_counts[me]);
            expect_err(
                ctx,
                format!("{name}/reduce_scatter_v"),
                c.reduce_scatter_v(
                    BufRef::Host(send.as_slice()),
                    &v_counts,
                    BufMut::Host(recv.as_mut_slice()),
                    op,
                ),
                "Unsupported",
                unsup,
            );
        }
    }
    let name = format!("{p}/bool_avg_refused");
    ctx.expect(name, !c.supports(DType::Bool, Some(ReduceOp::Avg)), || {
        format!(
            "the {} backend claims to average bool, which has no average",
            c.backend()
        )
    });

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
