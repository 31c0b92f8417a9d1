//! The sub-group section: split by parity, split with a non-member, create_group of the first
//! and last rank, each checked with identity and the operation sweep, plus the invalid cases.

use crate::collectives::{identity, sweep};
use crate::ctx::{expect_err, Ctx};
use crate::errors::errors;
use crate::nonblocking::nonblocking;
use crate::operations::operations;
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp};

pub(crate) fn subgroups<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm, quick: bool) {
    let parent: &dyn Communicator = world;
    let (n, me) = (parent.size(), parent.rank());
    let pg = parent.global_ranks().to_vec();
    let run = |ctx: &mut Ctx, label: &str, c: &dyn Communicator, members: &[usize]| {
        let global: Vec<usize> = members.iter().map(|&r| pg[r]).collect();
        identity(ctx, label, c, &global);
        if quick {
            let mut s = [0i64];
            let name = format!("{label}/all_reduce_sum");
            if ctx
                .ok(
                    &name,
                    c.all_reduce_into(&[ctx.rank as i64][..], &mut s[..], ReduceOp::Sum),
                )
                .is_some()
            {
                ctx.eq(name, &global.iter().map(|&g| g as i64).sum::<i64>(), &s[0]);
            }
        } else {
            sweep(ctx, label, c);
            nonblocking(ctx, label, c);
            operations(ctx, label, c);
            errors(ctx, label, c);
        }
    };

    // Split by parity, key = parent rank.
    let label = "split_parity";
    match factory.split(world, Some((me % 2) as u32), me) {
        Ok(Some(c)) => {
            let members: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
            run(ctx, label, &c, &members);
        }
        Ok(None) => ctx.fail(
            label,
            "a rank that passed a colour got no communicator".into(),
        ),
        Err(e) => ctx.fail(label, format!("split failed: {e}")),
    }

    // Split where the last rank opts out (None) and the others form one group.
    let label = "split_none";
    let color = (me + 1 != n || n == 1).then_some(3u32);
    match factory.split(world, color, me) {
        Ok(Some(c)) if color.is_some() => {
            let members: Vec<usize> = if n == 1 {
                vec![0]
            } else {
                (0..n - 1).collect()
            };
            run(ctx, label, &c, &members);
        }
        Ok(Some(_)) => ctx.fail(
            label,
            "a rank that passed no colour got a communicator".into(),
        ),
        Ok(None) if color.is_none() => ctx.pass(format!("{label}/non_member_gets_none")),
        Ok(None) => ctx.fail(
            label,
            "a rank that passed a colour got no communicator".into(),
        ),
        Err(e) => ctx.fail(label, format!("split failed: {e}")),
    }

    // create_group of the first and last rank (given unsorted), others get None.
    let label = "create_group_ends";
    let members: Vec<usize> = if n == 1 { vec![0] } else { vec![0, n - 1] };
    let list: Vec<usize> = members.iter().rev().copied().collect();
    match factory.create_group(world, &list) {
        Ok(Some(c)) if members.contains(&me) => run(ctx, label, &c, &members),
        Ok(Some(_)) => ctx.fail(
            label,
            format!("rank {me} is not in {list:?} but got a communicator"),
        ),
        Ok(None) if !members.contains(&me) => ctx.pass(format!("{label}/non_member_gets_none")),
        Ok(None) => ctx.fail(
            label,
            format!("rank {me} is in {list:?} but got no communicator"),
        ),
        Err(e) => ctx.fail(label, format!("create_group failed: {e}")),
    }

    // create_group errors (local validation, every rank makes the same mistake).
    let p = "create_group_errors";
    let r = factory.create_group(world, &[0, n]).map(|_| ());
    expect_err(ctx, format!("{p}/out_of_range"), r, "PeerOutOfRange", |e| {
        matches!(e, Error::PeerOutOfRange { .. })
    });
    let r = factory.create_group(world, &[0, 0]).map(|_| ());
    expect_err(ctx, format!("{p}/duplicate"), r, "Invalid", |e| {
        matches!(e, Error::Invalid(_))
    });
    let r = factory.create_group(world, &[]).map(|_| ());
    expect_err(ctx, format!("{p}/empty"), r, "Invalid", |e| {
        matches!(e, Error::Invalid(_))
    });
}
