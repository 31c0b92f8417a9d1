//! The in-place mismatch section: with the mismatch check on (`MismatchCheck::All`, set
//! through [`crate::Options::mismatch_check`]), an in-place all-gather or reduce-scatter on some
//! ranks and the out-of-place form with the same counts on the others must agree and give the
//! right values; different counts must be [`grid_core::Error::CollectiveMismatch`] on every
//! rank, naming the field `count`.

use crate::ctx::Ctx;
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};

/// Runs the section on `c` (every rank of `c` calls it, with the check on in mode `All`).
pub(crate) fn in_place_mismatch(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/in_place_mismatch");
    if n < 2 {
        ctx.skip(p, "needs 2 ranks");
        return;
    }
    // Even ranks in place, odd ranks out of place: both forms of one call agree.
    let k = 3;
    let tag = |j: usize| (j * 7 + 1) as i32;
    let name = format!("{p}/all_gather_mixed_forms_agree");
    let mut got = vec![-1i32; n * k];
    let r = if me % 2 == 0 {
        for (j, x) in got.iter_mut().enumerate().skip(me * k).take(k) {
            *x = tag(j);
        }
        c.all_gather_in_place(&mut got[..])
    } else {
        let mine: Vec<i32> = (me * k..(me + 1) * k).map(tag).collect();
        c.all_gather_into(&mine[..], &mut got[..])
    };
    if ctx.ok(&name, r).is_some() {
        let want: Vec<i32> = (0..n * k).map(tag).collect();
        ctx.eq(name, &want, &got);
    }
    // Rank r's input element j is r + j; the sum over ranks of element j is n(n-1)/2 + n·j.
    let input: Vec<i64> = (0..n * k).map(|j| (me + j) as i64).collect();
    let want: Vec<i64> = (me * k..(me + 1) * k)
        .map(|j| (n * (n - 1) / 2 + n * j) as i64)
        .collect();
    let name = format!("{p}/reduce_scatter_mixed_forms_agree");
    let r = if me % 2 == 1 {
        let mut buf = input.clone();
        c.reduce_scatter_in_place(&mut buf[..], ReduceOp::Sum)
            .map(|()| buf[me * k..(me + 1) * k].to_vec())
    } else {
        let mut out = vec![0i64; k];
        c.reduce_scatter_into(&input[..], &mut out[..], ReduceOp::Sum)
            .map(|()| out)
    };
    if let Some(v) = ctx.ok(&name, r) {
        ctx.eq(name, &want, &v);
    }
    // The same, nonblocking.
    let name = format!("{p}/iall_gather_mixed_forms_agree");
    let mine: Vec<i32> = (me * k..(me + 1) * k).map(tag).collect();
    let r = if me % 2 == 0 {
        let mut buf = vec![-1i32; n * k];
        buf[me * k..(me + 1) * k].copy_from_slice(&mine);
        c.iall_gather_in_place(buf).and_then(|w| w.wait())
    } else {
        c.iall_gather(mine).and_then(|w| w.wait())
    };
    if let Some(v) = ctx.ok(&name, r) {
        let want: Vec<i32> = (0..n * k).map(tag).collect();
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/ireduce_scatter_mixed_forms_agree");
    let r = if me % 2 == 1 {
        c.ireduce_scatter_in_place(input.clone(), ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map(|v| v.get(me * k..(me + 1) * k).map(<[i64]>::to_vec))
    } else {
        c.ireduce_scatter(input.clone(), ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map(Some)
    };
    if let Some(v) = ctx.ok(&name, r) {
        ctx.eq(name, &Some(want), &v);
    }
    // Rank 0 in place with blocks of 3, the others out of place with blocks of 2: every rank
    // gets CollectiveMismatch on `count` (3 against 2; a reduce-scatter's count is its input's,
    // size · block) before anything moves.
    let expect_count = |ctx: &mut Ctx,
                        name: String,
                        r: grid_core::Result<()>,
                        a: usize,
                        b: usize| {
        let (a, b) = (a.to_string(), b.to_string());
        match r {
            Err(Error::CollectiveMismatch { field, values, .. }) => {
                let ok = field == "count"
                    && values.len() == n
                    && values
                        .iter()
                        .all(|(r, v)| *v == if *r == 0 { a.as_str() } else { b.as_str() });
                ctx.expect(name, ok, || {
                    format!(
                        "expected CollectiveMismatch on count (rank 0: {a}, the others: {b}), got field {field} with {values:?}"
                    )
                });
            }
            Err(e) => ctx.fail(&name, format!("expected CollectiveMismatch, got {e:?}")),
            Ok(()) => ctx.fail(&name, "expected CollectiveMismatch, got Ok".into()),
        }
    };
    let name = format!("{p}/all_gather_different_counts");
    let r = if me == 0 {
        c.all_gather_in_place(&mut vec![0i32; n * 3][..])
    } else {
        c.all_gather_into(&[0i32; 2][..], &mut vec![0i32; n * 2][..])
    };
    expect_count(ctx, name, r, 3, 2);
    let name = format!("{p}/reduce_scatter_different_counts");
    let r = if me == 0 {
        c.reduce_scatter_in_place(&mut vec![0i32; n * 3][..], ReduceOp::Sum)
    } else {
        c.reduce_scatter_into(&vec![0i32; n * 2][..], &mut [0i32; 2][..], ReduceOp::Sum)
    };
    expect_count(ctx, name, r, n * 3, n * 2);
    let name = format!("{p}/ireduce_scatter_different_counts");
    let r = if me == 0 {
        c.ireduce_scatter_in_place(vec![0i32; n * 3], ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map(|_| ())
    } else {
        c.ireduce_scatter(vec![0i32; n * 2], ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map(|_| ())
    };
    expect_count(ctx, name, r, n * 3, n * 2);
    // The communicator is still usable afterwards (nothing ran, nothing failed).
    let name = format!("{p}/usable_after_mismatch");
    let mut v = [1i32; 2];
    if ctx
        .ok(&name, c.all_reduce_in_place(&mut v[..], ReduceOp::Sum))
        .is_some()
    {
        ctx.eq(name, &[n as i32; 2], &v);
    }
}
