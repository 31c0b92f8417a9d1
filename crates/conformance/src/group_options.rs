//! Group options on a collection ([`build_collection_with`]): each group carries its name and
//! time limit, a stalled operation on a named group fails with an error naming the group and
//! the limit, and [`grid_core::ProcessGroupCollection::update_pg_timeout`] changes what a
//! stalled operation waits for.
//!
//! Needs a backend whose timed-out blocking collective returns [`Error::Timeout`] (the local
//! and Gloo backends; MPI cannot cancel a blocking collective and ends the job instead).

use grid_core::{
    build_collection_with, CollectionOptions, Communicator, CommunicatorExt, Error, GroupFactory,
    GroupOptions, LayoutConfig, LayoutPlan, PgEntry, ReduceOp, TimeLimit,
};
use std::time::{Duration, Instant};

/// The name given to the `tp` family.
pub const TP_NAME: &str = "TENSOR_MODEL_PARALLEL_GROUP";
/// The `tp` family's time limit given at creation.
pub const TP_CREATED_MS: u64 = 300;
/// The `tp` family's time limit after `update_pg_timeout`.
pub const TP_UPDATED_MS: u64 = 1500;
/// Every other family's time limit (the collection's default options).
pub const DEFAULT_MS: u64 = 400;

/// What one rank saw ([`check_named_timeouts`]).
#[derive(Debug, Clone, Default)]
pub struct StallReport {
    /// The error of this rank's stalled operation, as displayed (ranks 0 and 3 stall).
    pub error: Option<String>,
    /// How long the stalled operation waited.
    pub waited: Option<Duration>,
}

/// Runs on every rank of a world of **4** ranks: builds the collection of a `tp = 2` layout
/// with per-family options (`tp` named [`TP_NAME`] with [`TP_CREATED_MS`]; every other family
/// [`DEFAULT_MS`] and its family name), checks every group's name and limit, raises `tp` to
/// [`TP_UPDATED_MS`] with `update_pg_timeout`, then stalls one operation per group kind: world
/// rank 0 all-reduces on its `tp` group `{0, 1}` and world rank 3 on its `dp` group `{1, 3}`
/// while rank 1 calls neither. Each stalled rank must get [`Error::Timeout`] naming its group
/// and its current limit, after at least that long. `world_barrier` keeps every rank (and its
/// groups) alive until both stalls ended.
pub fn check_named_timeouts<F: GroupFactory>(
    factory: &F,
    world: &F::Comm,
    world_barrier: impl Fn() -> grid_core::Result<()>,
) -> Result<StallReport, String> {
    let me = world.rank();
    let e = |what: &str, err: Error| format!("rank {me}: {what}: {err}");
    if world.size() != 4 {
        return Err(format!(
            "check_named_timeouts needs 4 ranks, got {}",
            world.size()
        ));
    }
    let plan = LayoutPlan::new(LayoutConfig {
        world_size: 4,
        tp: 2,
        ..Default::default()
    })
    .map_err(|x| e("plan", x))?;
    let mut opts = CollectionOptions::new()
        .with_default(GroupOptions::new().with_timeout(Duration::from_millis(DEFAULT_MS)));
    opts.set(
        "tp",
        GroupOptions::new()
            .named(TP_NAME)
            .with_timeout(Duration::from_millis(TP_CREATED_MS)),
    )
    .map_err(|x| e("options", x))?;
    let built = build_collection_with(factory, world, &plan, &opts)
        .map_err(|x| e("build_collection_with", x))?;
    let c = &built.collection;
    let mut bad = Vec::new();
    // Every group: its family's name (or that of the family whose communicator it reuses)
    // and its family's limit.
    for stat in &built.stats {
        let fam = stat.family.family.name();
        let owner = stat.reused_from.unwrap_or(stat.family);
        let want_name = opts.for_level(owner).name.unwrap_or_default();
        let want_ms = if owner.family.name() == "tp" {
            TP_CREATED_MS
        } else {
            DEFAULT_MS
        };
        let comm = match c.entry(fam) {
            Ok(Some(PgEntry::Group(g))) => g.clone(),
            Ok(Some(PgEntry::Levels(l))) => match l.get(stat.family.level) {
                Some(g) => g.clone(),
                None => continue,
            },
            _ => continue,
        };
        if comm.name() != want_name {
            bad.push(format!(
                "{}: name '{}', expected '{want_name}'",
                stat.family,
                comm.name()
            ));
        }
        if comm.time_limit() != TimeLimit::from_millis(want_ms) {
            bad.push(format!(
                "{}: limit {}, expected {want_ms} ms",
                stat.family,
                comm.time_limit()
            ));
        }
    }
    let n = c
        .update_pg_timeout(Some("tp"), Duration::from_millis(TP_UPDATED_MS))
        .map_err(|x| e("update_pg_timeout", x))?;
    if n != 1 {
        bad.push(format!(
            "update_pg_timeout(tp) updated {n} groups, expected 1"
        ));
    }
    let tp =
        c.tp.clone()
            .ok_or_else(|| format!("rank {me}: no tp group"))?;
    let dp =
        c.dp.clone()
            .ok_or_else(|| format!("rank {me}: no dp group"))?;
    let stalled = match me {
        0 => Some((tp, TP_NAME, TP_UPDATED_MS)),
        3 => Some((dp, "dp", DEFAULT_MS)),
        _ => None,
    };
    let mut report = StallReport::default();
    if let Some((g, name, ms)) = stalled {
        let t = Instant::now();
        let r = g.all_reduce_in_place(&mut [1.0f32; 4][..], ReduceOp::Sum);
        let waited = t.elapsed();
        match r {
            Err(err @ Error::Timeout { .. }) => {
                let text = err.to_string();
                for part in [
                    format!("communicator '{name}'"),
                    format!("timed out after {ms} ms"),
                ] {
                    if !text.contains(&part) {
                        bad.push(format!(
                            "the stalled operation's error {text:?} lacks {part:?}"
                        ));
                    }
                }
                if waited < Duration::from_millis(ms) {
                    bad.push(format!(
                        "the stalled operation gave up after {waited:?}, before its {ms} ms"
                    ));
                }
                report.error = Some(text);
                report.waited = Some(waited);
            }
            other => bad.push(format!(
                "a stalled all-reduce on '{name}': expected Error::Timeout, got {other:?}"
            )),
        }
    }
    world_barrier().map_err(|x| e("world barrier after the stalls", x))?;
    // Every group at once.
    let all = c
        .update_pg_timeout(None, TimeLimit::Unlimited)
        .map_err(|x| e("update_pg_timeout(all)", x))?;
    if all != c.len() + c.hcp.as_ref().map_or(0, |h| h.len().saturating_sub(1)) {
        bad.push(format!(
            "update_pg_timeout(None) updated {all} groups of {}",
            c.len()
        ));
    }
    if c.tp.as_ref().map(|g| g.time_limit()) != Some(TimeLimit::Unlimited) {
        bad.push("update_pg_timeout(None) left tp's limit".into());
    }
    if bad.is_empty() {
        Ok(report)
    } else {
        Err(format!("rank {me}: {}", bad.join("; ")))
    }
}
