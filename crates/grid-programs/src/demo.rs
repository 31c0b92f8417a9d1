//! The demos' layout and the check they run on every family of it, written once for every
//! backend (`mpi-demo` and `gloo-demo` differ only in how their ranks start).

use grid_core::{
    BuiltCollection, Communicator, CommunicatorExt, Family, FamilyLevel, LayoutConfig, LayoutPlan,
    ProcessGroupCollection, ReduceOp,
};
use std::sync::Arc;
use std::time::Instant;

/// All-reduces per family before timing starts.
pub const WARMUP: usize = 3;
/// Timed all-reduces per family.
pub const ITERS: usize = 30;

/// The demo layout: world 8, tensor 2 × pipeline 2 × context 2 (data parallel 1), experts 4 ways
/// with expert tensor parallel 1 (expert data parallel 1), order `tp-cp-ep-dp-pp`.
///
/// ```
/// let plan = grid_core::LayoutPlan::new(grid_programs::demo::config()).unwrap();
/// assert_eq!((plan.world_size(), plan.dp(), plan.expert_dp()), (8, 1, 1));
/// ```
pub fn config() -> LayoutConfig {
    let mut c = LayoutConfig::new(8);
    c.tp = 2;
    c.pp = 2;
    c.cp = 2;
    c.ep = 4;
    c.etp = Some(1);
    c
}

/// The layout in one line, as the demos print it: `world 8, tp 2 pp 2 cp 2 dp 1, expert: ep 4
/// etp 1 edp 1, order tp-cp-ep-dp-pp (19 families)`.
///
/// ```
/// let plan = grid_core::LayoutPlan::new(grid_programs::demo::config()).unwrap();
/// assert_eq!(
///     grid_programs::demo::describe(&plan),
///     "world 8, tp 2 pp 2 cp 2 dp 1, expert: ep 4 etp 1 edp 1, order tp-cp-ep-dp-pp (19 families)"
/// );
/// ```
pub fn describe(plan: &LayoutPlan) -> String {
    let c = plan.config();
    format!(
        "world {}, tp {} pp {} cp {} dp {}, expert: ep {} etp {} edp {}, order {} ({} families)",
        plan.world_size(),
        c.tp,
        c.pp,
        c.cp,
        plan.dp(),
        c.ep,
        plan.expert_tp(),
        plan.expert_dp(),
        c.order,
        plan.family_levels().len()
    )
}

/// The communicator of family level `fl` in a built collection (`hcp` levels included), or
/// `None` where this rank is not a member.
pub fn comm_of<G>(c: &ProcessGroupCollection<Arc<G>>, fl: FamilyLevel) -> Option<&G> {
    if fl.family == Family::Hcp {
        return c.hcp.as_ref().and_then(|v| v.get(fl.level)).map(|a| &**a);
    }
    c.get(fl.family.name()).ok().flatten().map(|a| &**a)
}

/// What one rank measured on one family level.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyRow {
    /// The family level.
    pub family: FamilyLevel,
    /// Size of this rank's group (`None`: not a member).
    pub group_size: Option<usize>,
    /// Communicators this rank created for the family (0 when reused).
    pub created: usize,
    /// The family whose communicator was reused, if any.
    pub reused_from: Option<FamilyLevel>,
    /// Seconds `build_collection` spent on the family on this rank.
    pub create_s: f64,
    /// Median seconds of one all-reduce of one `i64` (0 where not a member).
    pub latency_s: f64,
}

/// Every family level of `plan`, in order, on rank `me`: checks that the communicator built for
/// the family lists exactly the plan's group, runs [`WARMUP`] + [`ITERS`] all-reduces of the
/// rank's number and checks each result against the sum of the group's members.
///
/// Returns one row per family level and the failed checks as messages that start with the
/// family's name (`"tp: ..."`). A backend error stops the walk and is returned as the error.
pub fn all_reduce_every_family<C: Communicator>(
    plan: &LayoutPlan,
    built: &BuiltCollection<C>,
    me: usize,
) -> grid_core::Result<(Vec<FamilyRow>, Vec<String>)> {
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for fl in plan.family_levels() {
        let stat = built.stats.iter().find(|s| s.family == fl);
        let mut row = FamilyRow {
            family: fl,
            group_size: stat.and_then(|s| s.group_size),
            created: stat.map_or(0, |s| s.created),
            reused_from: stat.and_then(|s| s.reused_from),
            create_s: stat.map_or(0.0, |s| s.seconds),
            latency_s: 0.0,
        };
        let group = plan.group_of(fl, me)?;
        let comm = comm_of(&built.collection, fl);
        let (Some(g), Some(c)) = (group.as_ref(), comm) else {
            if group.is_some() != comm.is_some() {
                failures.push(format!(
                    "{fl}: group present {} but communicator present {}",
                    group.is_some(),
                    comm.is_some()
                ));
            }
            rows.push(row);
            continue;
        };
        if c.global_ranks() != g.sorted().as_slice() {
            failures.push(format!(
                "{fl}: global_ranks {:?} != plan group {:?}",
                c.global_ranks(),
                g.sorted()
            ));
        }
        let want: i64 = g.iter().map(|r| r as i64).sum();
        let mut times = Vec::with_capacity(ITERS);
        for i in 0..WARMUP + ITERS {
            let mut out = [0i64];
            let t = Instant::now();
            c.all_reduce_into(&[me as i64][..], &mut out[..], ReduceOp::Sum)?;
            let dt = t.elapsed().as_secs_f64();
            if out[0] != want {
                failures.push(format!(
                    "{fl}: all_reduce of the members' world ranks gave {}, expected {want} (members {:?})",
                    out[0],
                    g.sorted()
                ));
            }
            if i >= WARMUP {
                times.push(dt);
            }
        }
        row.latency_s = crate::stats::median(&times).unwrap_or(0.0);
        rows.push(row);
    }
    Ok((rows, failures))
}
