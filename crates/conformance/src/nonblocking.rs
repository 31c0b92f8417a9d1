//! The nonblocking section: every `i*` operation per dtype and the ordering of outstanding
//! requests.

use crate::ctx::Ctx;
use crate::values::{reduce_expected, value_in, Num, K};
use grid_core::{Bool, F8E4M3, F8E5M2};
use grid_core::{Communicator, CommunicatorExt, DType, ReduceOp};
use half::{bf16, f16};
use std::time::{Duration, Instant};

pub(crate) fn nonblocking(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    for d in DType::ALL {
        if !c.supports(d, None) {
            ctx.skip(format!("{label}/nonblocking/{d}"), "unsupported dtype");
            continue;
        }
        match d {
            DType::F32 => nb_typed::<f32>(ctx, label, c),
            DType::F64 => nb_typed::<f64>(ctx, label, c),
            DType::I32 => nb_typed::<i32>(ctx, label, c),
            DType::I64 => nb_typed::<i64>(ctx, label, c),
            DType::U8 => nb_typed::<u8>(ctx, label, c),
            DType::F16 => nb_typed::<f16>(ctx, label, c),
            DType::BF16 => nb_typed::<bf16>(ctx, label, c),
            DType::I8 => nb_typed::<i8>(ctx, label, c),
            DType::U32 => nb_typed::<u32>(ctx, label, c),
            DType::U64 => nb_typed::<u64>(ctx, label, c),
            DType::Bool => nb_typed::<Bool>(ctx, label, c),
            DType::F8E4M3 => nb_typed::<F8E4M3>(ctx, label, c),
            DType::F8E5M2 => nb_typed::<F8E5M2>(ctx, label, c),
        }
    }
    nb_ordering(ctx, label, c);
}

fn nb_typed<T: Num>(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me, d) = (c.size(), c.rank(), T::DTYPE);
    let p = format!("{label}/nonblocking/{d}");
    for op in ReduceOp::ALL {
        let name = format!("{p}/iall_reduce/{op}");
        if !c.supports(d, Some(op)) || n > T::EXACT_UP_TO {
            ctx.skip(name, "unsupported or group too large for exact values");
            continue;
        }
        let send: Vec<T> = (0..K).map(|i| value_in::<T>(op, me, i)).collect();
        // Out of place: `send` comes back untouched by the result, which lands in `recv`.
        let name_into = format!("{p}/iall_reduce_into/{op}");
        let into = c
            .iall_reduce_into(send.clone(), vec![T::of(99); K], op)
            .and_then(|w| w.wait());
        if let Some(v) = ctx.ok(&name_into, into) {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name_into, op, n, &want, &v);
        }
        if let Some(v) = ctx.ok(&name, c.iall_reduce(send, op).and_then(|w| w.wait())) {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name, op, n, &want, &v);
        }
        let name = format!("{p}/ireduce_scatter/{op}");
        let send: Vec<T> = (0..n * 2).map(|j| value_in::<T>(op, me, j)).collect();
        if let Some(v) = ctx.ok(&name, c.ireduce_scatter(send, op).and_then(|w| w.wait())) {
            let want: Vec<T> = (0..2)
                .map(|i| reduce_expected::<T>(op, n, me * 2 + i))
                .collect();
            ctx.values(name, op, n, &want, &v);
        }
        // In place: `wait` hands back the whole buffer, this rank's block at rank · 2.
        let name = format!("{p}/ireduce_scatter_in_place/{op}");
        let buf: Vec<T> = (0..n * 2).map(|j| value_in::<T>(op, me, j)).collect();
        let r = c.ireduce_scatter_in_place(buf, op).and_then(|w| w.wait());
        if let Some(v) = ctx.ok(&name, r) {
            let want: Vec<T> = (0..2)
                .map(|i| reduce_expected::<T>(op, n, me * 2 + i))
                .collect();
            if v.len() == n * 2 {
                ctx.values(name, op, n, &want, &v[me * 2..me * 2 + 2]);
            } else {
                ctx.fail(
                    &name,
                    format!(
                        "wait returned {} elements, want the whole buffer of {}",
                        v.len(),
                        n * 2
                    ),
                );
            }
        }
    }
    let root = n - 1;
    let name = format!("{p}/ibroadcast");
    let want: Vec<T> = (0..K).map(|i| T::tag(root % 16 * 10 + i)).collect();
    let buf = if me == root {
        want.clone()
    } else {
        vec![T::of(99); K]
    };
    if let Some(v) = ctx.ok(&name, c.ibroadcast(buf, root).and_then(|w| w.wait())) {
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/iall_gather");
    let send: Vec<T> = (0..3).map(|i| T::tag(me * 3 + i)).collect();
    if let Some(v) = ctx.ok(&name, c.iall_gather(send).and_then(|w| w.wait())) {
        let want: Vec<T> = (0..n * 3).map(|j| T::tag(j)).collect();
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/iall_gather_in_place");
    let buf: Vec<T> = (0..n * 3)
        .map(|j| if j / 3 == me { T::tag(j) } else { T::of(99) })
        .collect();
    if let Some(v) = ctx.ok(&name, c.iall_gather_in_place(buf).and_then(|w| w.wait())) {
        let want: Vec<T> = (0..n * 3).map(|j| T::tag(j)).collect();
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/iall_to_all");
    let send: Vec<T> = (0..n * 2)
        .map(|x| T::tag((me * n + x / 2) * 2 + x % 2))
        .collect();
    if let Some(v) = ctx.ok(&name, c.iall_to_all(send).and_then(|w| w.wait())) {
        let want: Vec<T> = (0..n * 2)
            .map(|x| T::tag(((x / 2) * n + me) * 2 + x % 2))
            .collect();
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/ibarrier");
    if ctx.ok(&name, c.ibarrier().and_then(|w| w.wait())).is_some() {
        ctx.pass(name);
    }
    if n < 2 {
        ctx.skip(format!("{p}/isend_irecv"), "needs 2 ranks");
        return;
    }
    // Every rank posts its receive and its send at once, then waits: a backend that serialises
    // them as blocking calls deadlocks here for large messages.
    let name = format!("{p}/isend_irecv");
    let len = if d == DType::F32 || d == DType::I32 {
        1 << 16
    } else {
        7
    };
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let out: Vec<T> = (0..len).map(|i| T::tag(me + i)).collect();
    let r = c.irecv::<T>(len, left, 21).and_then(|rw| {
        let sw = c.isend(out.clone(), right, 21)?;
        let got = rw.wait()?;
        let sent = sw.wait()?;
        Ok((got, sent))
    });
    if let Some((got, sent)) = ctx.ok(&name, r) {
        let want: Vec<T> = (0..len).map(|i| T::tag(left + i)).collect();
        let ok = got == want && sent == out;
        ctx.expect(name, ok, || {
            format!(
                "received {:?}... (want {:?}...), send returned the sent buffer: {}",
                &got[..got.len().min(4)],
                &want[..want.len().min(4)],
                sent == out
            )
        });
    }
}

/// Several outstanding works on one communicator, waited on out of order and mixed with a
/// blocking call; a timed wait that must time out; `is_completed`.
fn nb_ordering(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/nonblocking/ordering");
    if !c.supports(DType::I64, Some(ReduceOp::Sum)) {
        ctx.skip(p, "needs i64 sums");
        return;
    }
    let rank_sum = (n * (n - 1) / 2) as i64;
    let mut works = Vec::new();
    for j in 0..4i64 {
        match c.iall_reduce(vec![me as i64 + 100 * j, j], ReduceOp::Sum) {
            Ok(w) => works.push((j, w)),
            Err(e) => ctx.fail(&p, format!("starting all_reduce {j}: {e}")),
        }
    }
    // A blocking collective while the four are outstanding.
    let mut mid = [0i64];
    let blocking = c.all_reduce_into(&[1i64][..], &mut mid[..], ReduceOp::Sum);
    let ag = c.iall_gather(vec![me as i64]);
    let mut results = Vec::new();
    for (j, w) in works.into_iter().rev() {
        results.push((j, w.wait()));
    }
    let ag = ag.and_then(|w| w.wait());
    let mut ok = true;
    let mut msgs = Vec::new();
    for (j, r) in results {
        match r {
            Ok(v) if v == vec![rank_sum + 100 * j * n as i64, j * n as i64] => {}
            Ok(v) => {
                ok = false;
                msgs.push(format!(
                    "work {j}: expected {:?}, got {v:?}",
                    [rank_sum + 100 * j * n as i64, j * n as i64]
                ));
            }
            Err(e) => {
                ok = false;
                msgs.push(format!("work {j}: {e}"));
            }
        }
    }
    match blocking {
        Ok(()) if mid[0] == n as i64 => {}
        other => {
            ok = false;
            msgs.push(format!(
                "blocking all_reduce between: {other:?}, value {}",
                mid[0]
            ));
        }
    }
    match ag {
        Ok(v) if v == (0..n as i64).collect::<Vec<_>>() => {}
        other => {
            ok = false;
            msgs.push(format!("all_gather after: {other:?}"));
        }
    }
    ctx.expect(format!("{p}/out_of_order_waits"), ok, || msgs.join("; "));

    // is_completed eventually turns true.
    let name = format!("{p}/is_completed");
    match c.ibarrier() {
        Ok(mut w) => {
            let t = Instant::now();
            let mut done = false;
            while t.elapsed() < Duration::from_secs(30) {
                if w.is_completed() {
                    done = true;
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            let r = w.wait();
            ctx.expect(name, done && r.is_ok(), || {
                format!("completed: {done}, wait: {r:?}")
            });
        }
        Err(e) => ctx.fail(&name, e.to_string()),
    }

    // wait_timeout: rank 0 says "ready", posts a receive and waits 50 ms for it; rank 1 sends
    // 500 ms after "ready". No message flows against the receive while it is pending, so
    // backends that run one communicator's operations strictly in order (NCCL) pass too.
    let name = format!("{p}/wait_timeout");
    if n < 2 {
        ctx.skip(name, "needs 2 ranks");
        return;
    }
    if me == 0 {
        let r = (|| -> grid_core::Result<(bool, Vec<i32>)> {
            c.send_to(&[1i32][..], 1, 30)?;
            let w = c.irecv::<i32>(3, 1, 31)?.into_inner();
            let w = match w.wait_timeout(Duration::from_millis(50)) {
                // Completed long before rank 1 sent: the backend did not wait.
                Ok(_) => return Ok((false, Vec::new())),
                Err(w) => w,
            };
            let v = w.wait()?.into_vec::<i32>()?;
            Ok((true, v))
        })();
        if let Some((timed_out, v)) = ctx.ok(&name, r) {
            ctx.expect(name, timed_out && v == vec![5, 6, 7], || {
                format!("timed out first: {timed_out}, received {v:?} (want [5, 6, 7])")
            });
        }
    } else if me == 1 {
        let mut ready = [0i32];
        let r = c.recv_from(&mut ready[..], 0, 30).and_then(|_| {
            std::thread::sleep(Duration::from_millis(500));
            c.send_to(&[5i32, 6, 7][..], 0, 31)
        });
        if ctx.ok(&name, r).is_some() {
            ctx.pass(name);
        }
    } else {
        ctx.skip(name, "ranks 0 and 1 only");
    }
}
