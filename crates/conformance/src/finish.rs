//! The finish section: calls on a finished (aborted) communicator must fail with
//! [`grid_core::Error::Finalized`].

use crate::ctx::{expect_err, Ctx};
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp, Request};

pub(crate) fn finished<F: GroupFactory>(
    ctx: &mut Ctx,
    factory: &F,
    world: &F::Comm,
    finish: &dyn Fn(&F::Comm),
) {
    let me = Communicator::rank(world);
    let c = match factory.split(world, Some(0), me) {
        Ok(Some(c)) => c,
        Ok(None) => return ctx.fail("finish", "split with colour 0 gave no communicator".into()),
        Err(e) => return ctx.fail("finish", format!("split failed: {e}")),
    };
    finish(&c);
    let fin = |e: &Error| matches!(e, Error::Finalized { .. });
    let mut s = [0f32];
    expect_err(
        ctx,
        "finish/all_reduce".into(),
        c.all_reduce_into(&[1f32][..], &mut s[..], ReduceOp::Sum),
        "Finalized",
        fin,
    );
    expect_err(ctx, "finish/barrier".into(), c.barrier(), "Finalized", fin);
    expect_err(
        ctx,
        "finish/broadcast".into(),
        c.broadcast_into(&mut s[..], 0),
        "Finalized",
        fin,
    );
    expect_err(
        ctx,
        "finish/start".into(),
        c.start(Request::Barrier).map(|_| ()),
        "Finalized",
        fin,
    );
    let r = factory.split(&c, Some(0), 0).map(|_| ());
    expect_err(ctx, "finish/split".into(), r, "Finalized", fin);
}
