//! The layout section (every family of each layout through [`grid_core::build_collection`]) and
//! the plan mismatch across ranks.

use crate::ctx::Ctx;
use grid_core::{
    build_collection, Communicator, CommunicatorExt, Error, FamilyLevel, GroupFactory,
    LayoutConfig, LayoutPlan, ReduceOp,
};

pub(crate) fn layout<F: GroupFactory>(
    ctx: &mut Ctx,
    factory: &F,
    world: &F::Comm,
    cfg: LayoutConfig,
) {
    let parent: &dyn Communicator = world;
    let desc = format!(
        "layout[w{} tp{} pp{} cp{} ep{} etp{} {} ndo{}{}]",
        cfg.world_size,
        cfg.tp,
        cfg.pp,
        cfg.cp,
        cfg.ep,
        cfg.etp
            .map(|e| e.to_string())
            .unwrap_or_else(|| "=tp".into()),
        cfg.order,
        cfg.dist_opt_instances,
        cfg.hcp_sizes
            .as_ref()
            .map(|h| format!(" hcp{h:?}"))
            .unwrap_or_default()
    );
    let plan = match LayoutPlan::new(cfg) {
        Ok(p) => p,
        Err(e) => return ctx.fail(&desc, format!("invalid layout: {e}")),
    };
    let built = match build_collection(factory, world, &plan) {
        Ok(b) => b,
        Err(e) => return ctx.fail(&desc, format!("build_collection failed: {e}")),
    };
    ctx.pass(format!("{desc}/build_collection"));
    let me = ctx.rank;
    let in_plan = plan.contains(me);
    for fl in plan.family_levels() {
        let name = format!("{desc}/{fl}");
        let group = if in_plan {
            match plan.group_of(fl, me) {
                Ok(g) => g,
                Err(e) => {
                    ctx.fail(&name, format!("plan.group_of: {e}"));
                    continue;
                }
            }
        } else {
            None
        };
        let comm = comm_of(&built.collection, fl);
        match (group, comm) {
            (None, None) => ctx.pass(format!("{name}/no_group_no_communicator")),
            (None, Some(_)) => ctx.fail(
                &name,
                "the plan puts this rank in no group, but it got a communicator".into(),
            ),
            (Some(g), None) => {
                ctx.fail(&name, format!("no communicator for group {:?}", g.to_vec()))
            }
            (Some(g), Some(c)) => {
                let want = g.sorted();
                ctx.eq(
                    format!("{name}/global_ranks"),
                    &want,
                    &c.global_ranks().to_vec(),
                );
                let mut s = [0i64];
                let n2 = format!("{name}/all_reduce_global_rank");
                if ctx
                    .ok(
                        &n2,
                        c.all_reduce_into(&[me as i64][..], &mut s[..], ReduceOp::Sum),
                    )
                    .is_some()
                {
                    ctx.eq(n2, &want.iter().map(|&r| r as i64).sum::<i64>(), &s[0]);
                }
            }
        }
    }
    // Parent still in step.
    let _ = parent;
}

fn comm_of<G>(
    c: &grid_core::ProcessGroupCollection<std::sync::Arc<G>>,
    fl: FamilyLevel,
) -> Option<&G> {
    if fl.family == grid_core::Family::Hcp {
        return c.hcp.as_ref().and_then(|v| v.get(fl.level)).map(|a| &**a);
    }
    c.get(fl.family.name()).ok().flatten().map(|a| &**a)
}

pub(crate) fn plan_mismatch<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm) {
    let parent: &dyn Communicator = world;
    let n = parent.size();
    let name = "plan_mismatch".to_string();
    if n < 2 {
        return ctx.skip(name, "needs 2 ranks");
    }
    // Rank 0 holds tp = 2 (or a different order), everyone else the default.
    let mut cfg = LayoutConfig::new(n);
    if parent.rank() == 0 {
        if n.is_multiple_of(2) {
            cfg.tp = 2;
        } else {
            cfg.order = "tp-cp-ep-pp-dp".into();
        }
    }
    let plan = match LayoutPlan::new(cfg) {
        Ok(p) => p,
        Err(e) => return ctx.fail(&name, format!("invalid layout: {e}")),
    };
    match build_collection(factory, world, &plan) {
        Err(Error::PlanMismatch { .. }) => ctx.pass(name.clone()),
        Err(e) => ctx.fail(&name, format!("expected PlanMismatch, got {e}")),
        Ok(_) => ctx.fail(
            &name,
            "expected PlanMismatch, build_collection succeeded".into(),
        ),
    }
    // Nobody is stuck: the parent still works.
    let mut s = [0i64];
    let n2 = format!("{name}/parent_usable");
    if ctx
        .ok(
            &n2,
            parent.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum),
        )
        .is_some()
    {
        ctx.eq(n2, &(n as i64), &s[0]);
    }
}
