//! The lifecycle section, on every backend (the front end writes it once, each backend wakes
//! its own blocked operations): the default time limit comes from the backend's configuration
//! and can be changed; a per-operation limit overrides it and fails the operation promptly with
//! a [`Error::Timeout`] that names the communicator and the sequence number; `abort()` from
//! another thread unblocks an operation stuck waiting for a peer; an aborted or failed
//! communicator refuses every later operation with [`Error::Aborted`], splits included, and says
//! why through `failure()`.
//!
//! The stuck operation is a receive from rank 1 that rank 1 never sends: every backend can
//! abandon a receive (MPI cancels it). Only rank 0 waits; the other ranks only take part in the
//! splits, so the section never leaves a collective half done.

use crate::ctx::{expect_err, Ctx};
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp, Request, TimeLimit};
use std::time::{Duration, Instant};

/// How late a woken or timed-out operation may return (a loaded 2-core machine, a backend's
/// polling interval).
const MARGIN: Duration = Duration::from_secs(3);
/// The override of the per-operation check.
const SHORT: Duration = Duration::from_millis(300);
/// The default the communicators get for the section (far above `SHORT` + `MARGIN`, so that an
/// operation that ends early did so because of the override or the abort).
const LONG: Duration = Duration::from_secs(60);
/// When the helper thread aborts.
const ABORT_AFTER: Duration = Duration::from_millis(200);

pub(crate) fn lifecycle<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm) {
    let me = Communicator::rank(world);
    let split = |ctx: &mut Ctx, what: &str| match factory.split(world, Some(0), me) {
        Ok(Some(c)) => Some(c),
        Ok(None) => {
            ctx.fail(
                &format!("lifecycle/{what}"),
                "split with colour 0 gave no communicator".into(),
            );
            None
        }
        Err(e) => {
            ctx.fail(&format!("lifecycle/{what}"), format!("split failed: {e}"));
            None
        }
    };

    // 1. The default limit: the backend's configured one on a new communicator, settable.
    let Some(c) = split(ctx, "default_limit") else {
        return;
    };
    ctx.eq(
        "lifecycle/default_limit/inherited".into(),
        &world.time_limit(),
        &c.time_limit(),
    );
    c.set_time_limit(TimeLimit::After(Duration::from_millis(1234)));
    ctx.eq(
        "lifecycle/default_limit/set".into(),
        &TimeLimit::After(Duration::from_millis(1234)),
        &c.time_limit(),
    );
    ctx.eq(
        "lifecycle/default_limit/view".into(),
        &TimeLimit::Unlimited,
        &c.with_time_limit(TimeLimit::Unlimited).time_limit(),
    );
    let mut v = [1i32];
    let ok = c.all_reduce_in_place(&mut v[..], ReduceOp::Sum);
    ctx.expect(
        "lifecycle/healthy".into(),
        ok.is_ok() && c.failure().is_none(),
        || format!("a healthy communicator: {ok:?}, failure {:?}", c.failure()),
    );

    // 2. Abort, on this rank only: every later call is refused, splits included.
    let Some(a) = split(ctx, "abort") else {
        return;
    };
    a.abort();
    a.abort(); // idempotent
    let aborted = |e: &Error| matches!(e, Error::Aborted { .. });
    let mut s = [0f32];
    expect_err(
        ctx,
        "lifecycle/abort/all_reduce".into(),
        a.all_reduce_into(&[1f32][..], &mut s[..], ReduceOp::Sum),
        "Aborted",
        aborted,
    );
    expect_err(
        ctx,
        "lifecycle/abort/barrier".into(),
        a.barrier(),
        "Aborted",
        aborted,
    );
    expect_err(
        ctx,
        "lifecycle/abort/broadcast".into(),
        a.broadcast_into(&mut s[..], 0),
        "Aborted",
        aborted,
    );
    expect_err(
        ctx,
        "lifecycle/abort/start".into(),
        a.start(Request::Barrier).map(|_| ()),
        "Aborted",
        aborted,
    );
    let r = factory.split(&a, Some(0), 0).map(|_| ());
    expect_err(ctx, "lifecycle/abort/split".into(), r, "Aborted", aborted);
    let f = a.failure();
    ctx.expect(
        "lifecycle/abort/failure".into(),
        f.as_ref().is_some_and(|f| f.aborted),
        || format!("failure() after abort(): {f:?}"),
    );

    if world.size() < 2 {
        ctx.skip(
            "lifecycle/limit_override".into(),
            "needs 2 ranks (a receive from a peer that never sends)",
        );
        ctx.skip(
            "lifecycle/abort_unblocks".into(),
            "needs 2 ranks (a receive from a peer that never sends)",
        );
        return;
    }

    // 3. A per-operation limit overrides the default and fails the communicator.
    let Some(t) = split(ctx, "limit_override") else {
        return;
    };
    t.set_time_limit(TimeLimit::After(LONG));
    if me == 0 {
        let mut b = [0u8; 4];
        // The receive is the first operation on the new communicator: sequence number 0.
        let issued = Some(0);
        let start = Instant::now();
        let r = t.with_time_limit(SHORT).recv_from(&mut b[..], 1, 77);
        let took = start.elapsed();
        let name = t.name().to_string();
        match &r {
            Err(Error::Timeout {
                op: "recv",
                millis,
                at: Some(at),
                ..
            }) => {
                ctx.eq(
                    "lifecycle/limit_override/millis".into(),
                    &(SHORT.as_millis() as u64),
                    millis,
                );
                ctx.eq(
                    "lifecycle/limit_override/site".into(),
                    &(name.as_str(), t.global_ranks(), issued),
                    &(at.comm.as_str(), at.ranks.as_slice(), at.seq),
                );
            }
            other => ctx.fail(
                "lifecycle/limit_override",
                format!("expected Timeout of recv after {SHORT:?} with its site, got {other:?}"),
            ),
        }
        ctx.expect(
            "lifecycle/limit_override/prompt".into(),
            took + Duration::from_millis(20) >= SHORT && took <= SHORT + MARGIN,
            || format!("the 300 ms receive returned after {took:?}"),
        );
        let f = t.failure();
        ctx.expect(
            "lifecycle/limit_override/failure".into(),
            f.as_ref()
                .is_some_and(|f| !f.aborted && f.op == "recv" && f.seq == issued),
            || format!("failure() after the timeout: {f:?}"),
        );
        expect_err(
            ctx,
            "lifecycle/limit_override/refused".into(),
            t.send_to(&[1u8][..], 1, 79),
            "Aborted naming the earlier failure",
            |e| matches!(e, Error::Aborted { reason, .. } if reason.contains("failed earlier")),
        );
    }

    // The other ranks keep `t` open until rank 0 is done with it (a rank that drops its end
    // closes the connections on some backends, which would end rank 0's receive early).
    let r = world.barrier();
    ctx.ok("lifecycle/limit_override/barrier", r);
    drop(t);

    // 4. abort() from another thread unblocks a stuck operation.
    let Some(u) = split(ctx, "abort_unblocks") else {
        return;
    };
    u.set_time_limit(TimeLimit::After(LONG));
    if me == 0 {
        let (r, took) = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(ABORT_AFTER);
                u.abort();
            });
            let mut b = [0u8; 4];
            let start = Instant::now();
            let r = u.recv_from(&mut b[..], 1, 78);
            (r, start.elapsed())
        });
        expect_err(
            ctx,
            "lifecycle/abort_unblocks/error".into(),
            r,
            "Aborted",
            aborted,
        );
        ctx.expect(
            "lifecycle/abort_unblocks/prompt".into(),
            took <= ABORT_AFTER + MARGIN,
            || format!("the receive returned {took:?} after it started; abort() came after {ABORT_AFTER:?}"),
        );
        expect_err(
            ctx,
            "lifecycle/abort_unblocks/later".into(),
            u.barrier(),
            "Aborted",
            aborted,
        );
    }
    let r = world.barrier();
    ctx.ok("lifecycle/abort_unblocks/barrier", r);
    drop(u);
}
