//! Live groups of a [`CommGrid`] ([`LiveCommGrid`]): a communicator for **every** non-empty
//! subset of the dimensions of a grid, and of a registered view, checked against the
//! membership `grid enum` prints (the same library code: [`CommGrid::rank_enum`], which is
//! [`grid_core::HyperGrid::groups`]), with an all-gather and an all-reduce over each group and
//! Megatron's key rules (`get_pg` before `create_pg`, a key created twice, a view's dims that
//! are all shared with the base resolving to the base's key).

use grid_core::{
    CommGrid, Communicator, CommunicatorExt, Error, GroupFactory, GroupOptions, LiveCommGrid,
    PgKey, ReduceOp,
};
use std::sync::Arc;

/// A registered view of a [`LiveGridCase`].
#[derive(Debug, Clone)]
pub struct ViewCase {
    /// The view's name.
    pub name: &'static str,
    /// Its shape (same size as the grid).
    pub shape: Vec<usize>,
    /// Its dimension names.
    pub names: Vec<&'static str>,
    /// Dims shared with the base grid.
    pub shared: Vec<&'static str>,
}

/// A grid over the whole world (offset 0) and an optional view.
#[derive(Debug, Clone)]
pub struct LiveGridCase {
    /// The base grid's shape (its product is the world size).
    pub shape: Vec<usize>,
    /// Its dimension names.
    pub names: Vec<&'static str>,
    /// A view to register, whose every subset of dims is created too.
    pub view: Option<ViewCase>,
}

/// What [`check_live_groups`] did on this rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveReport {
    /// Groups created (one split each).
    pub created: usize,
    /// View subsets that resolved to a base key created before (rejected as Megatron does).
    pub shared_with_base: usize,
}

/// Every non-empty subset of `names`, each in the given order or reversed (odd masks), so that
/// keys are checked to be canonical whatever order the dims are given in.
fn subsets(names: &[&'static str]) -> Vec<Vec<&'static str>> {
    (1u32..(1 << names.len()))
        .map(|mask| {
            let mut d: Vec<&'static str> = names
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, n)| *n)
                .collect();
            if mask % 2 == 1 {
                d.reverse();
            }
            d
        })
        .collect()
}

/// Runs on every rank of `world` (same case everywhere): creates a live group for every
/// non-empty subset of the grid's dims, then of the view's, and checks each one's members
/// (`global_ranks()` against this rank's group of [`CommGrid::rank_enum`], sorted), its name
/// (the key), an all-gather of world ranks (the members in order) and an all-reduce (sum of
/// members and count). Library errors end the run at once (they happen on every rank alike);
/// wrong values are collected and returned together, after every collective ran.
pub fn check_live_groups<F: GroupFactory>(
    factory: &F,
    world: &F::Comm,
    case: &LiveGridCase,
) -> Result<LiveReport, String> {
    let n = world.size();
    let me = world
        .global_ranks()
        .get(world.rank())
        .copied()
        .unwrap_or(world.rank());
    let e = |what: &str, err: Error| format!("rank {me}: {what}: {err}");
    let grid = CommGrid::new(case.shape.clone(), &case.names, 0, n, me)
        .map_err(|x| e("CommGrid::new", x))?;
    let mut live =
        LiveCommGrid::new(grid, factory, world).map_err(|x| e("LiveCommGrid::new", x))?;
    let mut bad: Vec<String> = Vec::new();
    let mut report = LiveReport::default();

    // Megatron: get_pg before create_pg is an error.
    match live.get_pg(&case.names[..1], None) {
        Err(Error::GroupMissing { .. }) => {}
        other => bad.push(format!(
            "get_pg before create_pg: expected GroupMissing, got {:?}",
            other.map(|c| c.map(|c| c.name().to_string()))
        )),
    }

    let mut run = |live: &mut LiveCommGrid<'_, F>,
                   dims: &[&'static str],
                   view: Option<&str>,
                   bad: &mut Vec<String>|
     -> Result<(), String> {
        let located = live
            .grid()
            .locate_pg(dims, view)
            .map_err(|x| e("locate_pg", x))?;
        let where_ = format!("{dims:?} in {}", view.unwrap_or("base"));
        let comm = match live.create_pg(dims, view, &GroupOptions::new()) {
            Ok(c) => c,
            Err(Error::GroupExists { key }) if view.is_some() => {
                // A view whose dims are all shared resolves to the base key, created before.
                if !matches!(located.key, PgKey::Base(_)) {
                    bad.push(format!("{where_}: GroupExists {key} for a view key"));
                }
                let base = live.get_pg(dims, view).map_err(|x| e("get_pg", x))?;
                if base.is_none() {
                    bad.push(format!(
                        "{where_}: the base group of a shared key is missing"
                    ));
                }
                report.shared_with_base += 1;
                return Ok(());
            }
            Err(x) => return Err(e(&format!("create_pg {where_}"), x)),
        };
        let comm = comm.ok_or_else(|| format!("rank {me}: {where_}: no communicator"))?;
        report.created += 1;
        // The membership `grid enum` prints: this rank's group of the canonical enumeration.
        let groups = live
            .grid()
            .rank_enum(dims, view)
            .map_err(|x| e("rank_enum", x))?;
        let mut expected: Vec<usize> = groups
            .iter()
            .find(|g| g.contains(&me))
            .map(|g| g.to_vec())
            .unwrap_or_default();
        expected.sort_unstable();
        if comm.global_ranks() != &expected[..] {
            bad.push(format!(
                "{where_}: members {:?}, grid enum says {expected:?}",
                comm.global_ranks()
            ));
        }
        let key = match &located.key {
            PgKey::Base(k) => k.clone(),
            PgKey::View(v, d) => format!("{v}:{}", d.join("-")),
        };
        if comm.name() != key {
            bad.push(format!(
                "{where_}: name '{}', expected '{key}'",
                comm.name()
            ));
        }
        let mut gathered = vec![0i64; comm.size()];
        comm.all_gather_into(&[me as i64], &mut gathered)
            .map_err(|x| e(&format!("all_gather on {where_}"), x))?;
        let gathered: Vec<usize> = gathered.into_iter().map(|x| x as usize).collect();
        if gathered != expected {
            bad.push(format!(
                "{where_}: all-gather of world ranks {gathered:?}, expected {expected:?}"
            ));
        }
        let mut sum = [0i64; 2];
        comm.all_reduce_into(&[me as i64, 1], &mut sum, ReduceOp::Sum)
            .map_err(|x| e(&format!("all_reduce on {where_}"), x))?;
        let want = [expected.iter().sum::<usize>() as i64, expected.len() as i64];
        if sum != want {
            bad.push(format!(
                "{where_}: all-reduce (sum of world ranks, count) {sum:?}, expected {want:?}"
            ));
        }
        // Created once per key: the same dims in another order are the same key.
        let mut again = dims.to_vec();
        again.reverse();
        match live.create_pg(&again, view, &GroupOptions::new()) {
            Err(Error::GroupExists { .. }) => {}
            other => bad.push(format!(
                "{where_}: a second create_pg: expected GroupExists, got {:?}",
                other.map(|c| c.map(|c| c.global_ranks().to_vec()))
            )),
        }
        match live.get_pg(&again, view) {
            Ok(Some(c)) if Arc::ptr_eq(&c, &comm) => {}
            other => bad.push(format!(
                "{where_}: get_pg returned another communicator: {:?}",
                other.map(|c| c.map(|c| c.name().to_string()))
            )),
        }
        Ok(())
    };

    for dims in subsets(&case.names) {
        run(&mut live, &dims, None, &mut bad)?;
    }
    if let Some(v) = &case.view {
        live.register_view(v.name, v.shape.clone(), &v.names, Some(&v.shared))
            .map_err(|x| e("register_view", x))?;
        for dims in subsets(&v.names) {
            run(&mut live, &dims, Some(v.name), &mut bad)?;
        }
    }
    if bad.is_empty() {
        Ok(report)
    } else {
        Err(format!("rank {me}: {}", bad.join("; ")))
    }
}
