//! # grid-conformance
//!
//! One backend-neutral conformance suite for the [`grid_core::Communicator`] and
//! [`grid_core::GroupFactory`] traits. Every backend (MPI, Gloo, NCCL) runs it on each of its
//! ranks; it exercises every operation, every dtype the communicator
//! [`supports`](grid_core::Communicator::supports) and every reduction with **exact** expected
//! values computed from rank numbers, on
//! 1. the parent (world) communicator,
//! 2. sub-groups made by [`GroupFactory::split`] and [`GroupFactory::create_group`] (and checks
//!    that non-members get `None`),
//! 3. every family of realistic layouts built with [`grid_core::build_collection`]: each group's
//!    `global_ranks()` must equal the plan's group (sorted) and an all-reduce of the global rank
//!    must sum to the group's member sum,
//!
//! All-reduce is checked in all four forms: blocking out of place (`all_reduce_into`) and in
//! place (`all_reduce_in_place`), nonblocking in place (`iall_reduce`) and out of place
//! (`iall_reduce_into`), each with every supported dtype and reduction. All-gather and
//! reduce-scatter likewise in place (`all_gather_in_place`, `reduce_scatter_in_place` and
//! their `i…` forms: this rank's block at `rank · count`, the rest of a reduce-scatter's buffer
//! unchecked since it is unspecified) as well as out of place, every dtype and reduction, with
//! their error cases (a buffer that is not one block per rank is `Indivisible` with its length
//! and the size); and, when [`Options::mismatch_check`] is given, with the mismatch check on,
//! one form on some ranks and the other on the rest must agree (same counts) or fail with
//! `CollectiveMismatch` on `count` on every rank (different counts).
//!
//! The operation set of a training framework (the `ops` checks) is checked the same way, blocking
//! and nonblocking, for every dtype (all 13 of [`grid_core::DType::ALL`]: bool with OR/AND
//! semantics, fp8 moved bit-exactly and reduced only where `supports` says so): the uneven
//! all-to-all (`all_to_all_v`, with a rank that sends nothing and one that receives nothing),
//! all-gather and reduce-scatter with per-rank counts (rank 0's block empty), and rooted
//! `reduce`, `gather` and `scatter` from every root, with every reduction; their error cases
//! (counts vectors of the wrong length, counts that do not sum to the buffer, roots out of range,
//! the root's buffer missing or of the wrong length, unsupported reductions) are each the typed
//! error with its numbers.
//!
//! plus the error cases (typed, with the numbers: `LengthMismatch { expected, actual }`, ...):
//! mismatched lengths, mismatched dtypes, roots and peers out of range,
//! unsupported dtypes or memory, calls on a finished communicator (when the backend exposes a
//! finish operation, see [`Options::finish`]), the lifecycle on every backend (the default
//! time limit and its per-operation override, `abort()` from another thread unblocking a stuck
//! receive, `Error::Aborted` for every later call, `failure()`), and a plan mismatch across ranks
//! (`build_collection` must fail with [`grid_core::Error::PlanMismatch`] on every rank).
//!
//! # How to call it
//! Run it on **every rank** of the parent, with the same options everywhere:
//! ```no_run
//! # fn demo<F: grid_core::GroupFactory>(factory: &F, world: &F::Comm) {
//! match grid_conformance::run_all(factory, world) {
//!     Ok(report) => println!("{report}"),          // every check passed on every rank
//!     Err(failure) => panic!("{failure}"),         // rank, check, expected vs actual
//! }
//! # }
//! ```
//! A backend with a finish operation passes it through [`Options`]:
//! ```no_run
//! # fn demo<F: grid_core::GroupFactory>(factory: &F, world: &F::Comm, finish: fn(&F::Comm)) where F::Comm: 'static {
//! let opts = grid_conformance::Options { finish: Some(Box::new(finish)), ..Default::default() };
//! let report = grid_conformance::run_with(factory, world, &opts);
//! # }
//! ```
//! A single communicator behind `&dyn Communicator` can be checked with
//! [`check_communicator`].
//!
//! # Failures
//! Checks of one section run to the end on every rank even after a mismatch (so no rank
//! leaves a collective the others are in); then the ranks agree over the parent (an
//! all-gather of failure counts) and **every** rank returns the same [`Failure`], listing the
//! failed ranks and this rank's messages. A collective that hangs cannot be detected from
//! inside; the launcher's timeout must end the run.
//!
//! # Expected values and their limits
//! Inputs are small integers derived from the communicator rank `r` and the element index `i`,
//! chosen so that every result is exactly representable in every dtype (u8, f16 and bf16
//! included) for groups of up to 16 ranks; u8/f16/bf16 reductions on larger groups are skipped
//! and recorded. Sums use `(r % 8 + 1)·(±1) + i % 5` (no sign for u8), products use factors in
//! {1, 2, -1}, min/max use `(3r + i) % 7 - 3`. `Avg` expects the exact mean for floats
//! (rounded to the type; within one unit in the last place when the group size is not a power
//! of two) and the sum divided with truncation toward zero (Rust's `/`) for integers.
//! i8 reductions are checked on groups of up to 8 ranks (where the averaged sums stay within
//! `-128..=127`); u32 and u64 use the unsigned inputs. Bool inputs are 0/1 patterns (false
//! everywhere, true everywhere, true on even ranks, true on rank 0 only), so sum and max are OR,
//! product and min AND, and mixed elements tell them apart. fp8 (E4M3, E5M2) is moved as finite
//! bit patterns (no -0, infinity or NaN, so value and bit equality agree) and, where a backend
//! reduces it, summed from inputs in {-1, 0, 1} (every sum of up to 16 ranks is exact in both
//! formats). Data that is only moved uses distinct tags (`i mod 251`, bool: `i` odd).

#![warn(missing_docs)]

// One module per section of the suite, in the order `run_with` runs them; `values` (inputs and
// expected values) and `ctx` (check bookkeeping and agreement) are shared by all of them.
mod collectives;
mod ctx;
mod errors;
mod finish;
pub mod group_options;
mod in_place;
mod layouts;
mod lifecycle;
pub mod live;
pub mod members_only;
mod nonblocking;
mod operations;
mod subgroups;
mod values;

use collectives::{identity, sweep};
use ctx::Ctx;
use errors::errors;
use finish::finished;
use grid_core::{Communicator, GroupFactory, LayoutConfig, MismatchCheck};
use in_place::in_place_mismatch;
use layouts::{layout, plan_mismatch};
use lifecycle::lifecycle;
use nonblocking::nonblocking;
use operations::operations;
use std::fmt;
use subgroups::subgroups;

// ------------------------------------------------------------------------------------------
// Report and failure
// ------------------------------------------------------------------------------------------

/// How one check ended.
///
/// ```
/// use grid_conformance::Outcome;
/// assert_ne!(Outcome::Passed, Outcome::Skipped("needs 2 ranks".into()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The check ran and matched.
    Passed,
    /// The check did not run, with the reason (unsupported dtype, world too small, ...).
    Skipped(String),
}

/// One check of the report.
///
/// ```
/// let c = grid_conformance::CheckRecord { name: "parent/f32/barrier".into(), outcome: grid_conformance::Outcome::Passed };
/// assert!(c.name.ends_with("barrier"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckRecord {
    /// `section/communicator/operation/dtype/...`.
    pub name: String,
    /// Result.
    pub outcome: Outcome,
}

/// What ran on this rank, when every check passed on every rank.
///
/// ```
/// let r = grid_conformance::Report::default();
/// assert_eq!(r.passed(), 0);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// World rank (position in the parent's `global_ranks`).
    pub rank: usize,
    /// Size of the parent.
    pub world_size: usize,
    /// Every check, in order.
    pub checks: Vec<CheckRecord>,
}

impl Report {
    /// Number of passed checks.
    pub fn passed(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| c.outcome == Outcome::Passed)
            .count()
    }
    /// The skipped checks with their reasons.
    pub fn skipped(&self) -> Vec<&CheckRecord> {
        self.checks
            .iter()
            .filter(|c| c.outcome != Outcome::Passed)
            .collect()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance: rank {} of {}: {} checks passed, {} skipped",
            self.rank,
            self.world_size,
            self.passed(),
            self.skipped().len()
        )?;
        for s in self.skipped() {
            if let Outcome::Skipped(why) = &s.outcome {
                write!(f, "\n  skipped {}: {why}", s.name)?;
            }
        }
        Ok(())
    }
}

/// The suite failed. Returned on every rank of the parent.
///
/// ```
/// let f = grid_conformance::Failure { rank: 1, section: "parent".into(), failed_ranks: vec![1], messages: vec!["x".into()] };
/// assert!(f.to_string().contains("rank 1"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// World rank reporting.
    pub rank: usize,
    /// The section that failed.
    pub section: String,
    /// World ranks that had failing checks in the section.
    pub failed_ranks: Vec<usize>,
    /// This rank's failure messages (check name, expected vs actual); empty when only other
    /// ranks failed.
    pub messages: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance section '{}' failed on ranks {:?} (this is rank {})",
            self.section, self.failed_ranks, self.rank
        )?;
        if self.messages.is_empty() {
            write!(f, "; this rank passed its checks")?;
        }
        for m in &self.messages {
            write!(f, "\n  rank {}: {m}", self.rank)?;
        }
        Ok(())
    }
}

impl std::error::Error for Failure {}

/// A backend's local finish/abort operation on one communicator.
///
/// ```
/// let f: grid_conformance::FinishFn<u32> = Box::new(|_c: &u32| {});
/// f(&0);
/// ```
pub type FinishFn<C> = Box<dyn Fn(&C)>;

/// Sets a communicator's mismatch-checking mode and returns the mode it had
/// ([`Options::mismatch_check`]); [`comm_mismatch_check`] is the one for every
/// [`grid_core::Comm`].
pub type MismatchFn<C> = Box<dyn Fn(&C, MismatchCheck) -> MismatchCheck>;

/// The [`MismatchFn`] of a front-end communicator ([`grid_core::Comm`], which every backend's
/// communicator is): [`grid_core::Comm::set_mismatch_check`], returning the previous mode.
///
/// ```
/// # fn demo<B: grid_core::Backend>() {
/// let opts = grid_conformance::Options::<grid_core::Comm<B>> {
///     mismatch_check: Some(grid_conformance::comm_mismatch_check()),
///     ..Default::default()
/// };
/// # let _ = opts;
/// # }
/// ```
pub fn comm_mismatch_check<B: grid_core::Backend>() -> MismatchFn<grid_core::Comm<B>> {
    Box::new(|c: &grid_core::Comm<B>, mode| {
        let old = c.mismatch_check();
        c.set_mismatch_check(mode);
        old
    })
}

/// Options of [`run_with`].
///
/// ```
/// let o = grid_conformance::Options::<u32> { quick_subgroups: true, ..Default::default() };
/// assert!(o.finish.is_none() && o.layouts.is_none());
/// ```
pub struct Options<C> {
    /// Marks a communicator finished/aborted (local). When given, the suite finishes a fresh
    /// sub-communicator and expects [`Error::Finalized`](grid_core::Error::Finalized) from later calls.
    pub finish: Option<FinishFn<C>>,
    /// Layouts for the collection section; `None` picks [`default_layouts`] for the world size.
    pub layouts: Option<Vec<LayoutConfig>>,
    /// Skip the whole per-dtype sweep on sub-groups (only the parent gets it), to save time.
    pub quick_subgroups: bool,
    /// Sets the parent's mismatch-checking mode and returns the previous one. When given, the
    /// suite turns the check on ([`MismatchCheck::All`]) for the in-place mismatch checks of
    /// the parent (one rank in place, another out of place) and restores the mode afterwards;
    /// `None` records them as skipped.
    pub mismatch_check: Option<MismatchFn<C>>,
}

impl<C> Default for Options<C> {
    fn default() -> Self {
        Options {
            finish: None,
            layouts: None,
            quick_subgroups: false,
            mismatch_check: None,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Entry points
// ------------------------------------------------------------------------------------------

/// Runs every section with default options. Call on every rank of `world`.
///
/// ```no_run
/// # fn demo<F: grid_core::GroupFactory>(factory: &F, world: &F::Comm) {
/// let report = grid_conformance::run_all(factory, world).unwrap_or_else(|f| panic!("{f}"));
/// assert!(report.passed() > 0);
/// # }
/// ```
pub fn run_all<F: GroupFactory>(factory: &F, world: &F::Comm) -> Result<Report, Failure> {
    run_with(factory, world, &Options::default())
}

/// Runs every section: `parent` (every operation, dtype and reduction, nonblocking forms,
/// the operation set, error cases), `subgroups` (split by parity, split with a non-member, create_group of the
/// first and last rank, each with the operation sweep), `finish` (if [`Options::finish`]),
/// `lifecycle` (time limits, `abort()`, `failure()`), `layouts` (every family of each layout through `build_collection`) and `plan_mismatch`.
///
/// ```no_run
/// # fn demo<F: grid_core::GroupFactory>(factory: &F, world: &F::Comm) {
/// let opts = grid_conformance::Options { quick_subgroups: true, ..Default::default() };
/// let report = grid_conformance::run_with(factory, world, &opts);
/// # }
/// ```
pub fn run_with<F: GroupFactory>(
    factory: &F,
    world: &F::Comm,
    opts: &Options<F::Comm>,
) -> Result<Report, Failure> {
    let parent: &dyn Communicator = world;
    let rank = parent
        .global_ranks()
        .get(parent.rank())
        .copied()
        .unwrap_or(parent.rank());
    let mut ctx = Ctx {
        rank,
        report: Report {
            rank,
            world_size: parent.size(),
            checks: Vec::new(),
        },
        failures: Vec::new(),
    };

    // 1. The parent.
    identity(&mut ctx, "parent", parent, parent.global_ranks());
    sweep(&mut ctx, "parent", parent);
    nonblocking(&mut ctx, "parent", parent);
    operations(&mut ctx, "parent", parent);
    errors(&mut ctx, "parent", parent);
    match &opts.mismatch_check {
        Some(set) => {
            let old = set(world, MismatchCheck::All);
            in_place_mismatch(&mut ctx, "parent", parent);
            set(world, old);
        }
        None => ctx.skip(
            "parent/in_place_mismatch".into(),
            "the backend gave no way to turn the mismatch check on (Options::mismatch_check is None)",
        ),
    }
    ctx.agree(parent, "parent")?;

    // 2. Sub-groups.
    subgroups(&mut ctx, factory, world, opts.quick_subgroups);
    ctx.agree(parent, "subgroups")?;

    // 3. Finish.
    match &opts.finish {
        Some(finish) => finished(&mut ctx, factory, world, finish.as_ref()),
        None => ctx.skip(
            "finish".into(),
            "the backend exposes no finish operation (Options::finish is None)",
        ),
    }
    ctx.agree(parent, "finish")?;

    // 3b. Lifecycle: time limits and abort, on every backend.
    lifecycle(&mut ctx, factory, world);
    ctx.agree(parent, "lifecycle")?;

    // 4. Layouts.
    let layouts = opts
        .layouts
        .clone()
        .unwrap_or_else(|| default_layouts(parent.size()));
    for cfg in layouts {
        layout(&mut ctx, factory, world, cfg);
        ctx.agree(parent, "layouts")?;
    }

    // 5. Plan mismatch.
    plan_mismatch(&mut ctx, factory, world);
    ctx.agree(parent, "plan_mismatch")?;
    Ok(ctx.report)
}

/// Runs the operation sweep, nonblocking forms and error cases on one communicator, agreeing
/// over `agree_over` (a communicator all of whose ranks call this function, possibly `comm`
/// itself).
///
/// ```no_run
/// # fn demo(comm: &dyn grid_core::Communicator) {
/// let report = grid_conformance::check_communicator(comm, comm, "mine").unwrap_or_else(|f| panic!("{f}"));
/// # }
/// ```
pub fn check_communicator(
    comm: &dyn Communicator,
    agree_over: &dyn Communicator,
    label: &str,
) -> Result<Report, Failure> {
    let rank = agree_over
        .global_ranks()
        .get(agree_over.rank())
        .copied()
        .unwrap_or(agree_over.rank());
    let mut ctx = Ctx {
        rank,
        report: Report {
            rank,
            world_size: agree_over.size(),
            checks: Vec::new(),
        },
        failures: Vec::new(),
    };
    sweep(&mut ctx, label, comm);
    nonblocking(&mut ctx, label, comm);
    operations(&mut ctx, label, comm);
    errors(&mut ctx, label, comm);
    ctx.agree(agree_over, label)?;
    Ok(ctx.report)
}

/// Layouts for the collection section, by world size: world 1 all sizes 1; world 2 tp2, pp2,
/// ep2; world 4 tp2·pp2, tp2·cp2 with ep2 etp1, cp4 with hierarchical cp [2, 2], dp4 with two
/// distributed-optimizer instances; world 8 tp2·pp2·cp2, tp2 with ep2 etp1, tp2·pp2·cp2 with
/// ep2 etp1, the order tp-cp-ep-pp-dp with tp2 cp2 ep4 etp1 pp2, tp2·pp2 with two
/// distributed-optimizer instances;
/// other worlds: dp only, plus tp2 when even.
///
/// ```
/// assert_eq!(grid_conformance::default_layouts(8).len(), 5);
/// ```
pub fn default_layouts(world: usize) -> Vec<LayoutConfig> {
    let cfg = |f: &dyn Fn(&mut LayoutConfig)| {
        let mut c = LayoutConfig::new(world);
        f(&mut c);
        c
    };
    match world {
        1 => vec![cfg(&|_| {})],
        2 => vec![cfg(&|c| c.tp = 2), cfg(&|c| c.pp = 2), cfg(&|c| c.ep = 2)],
        4 => vec![
            cfg(&|c| {
                c.tp = 2;
                c.pp = 2
            }),
            cfg(&|c| {
                c.tp = 2;
                c.cp = 2;
                c.ep = 2;
                c.etp = Some(1)
            }),
            cfg(&|c| {
                c.cp = 4;
                c.hcp_sizes = Some(vec![2, 2])
            }),
            cfg(&|c| c.dist_opt_instances = 2),
        ],
        8 => vec![
            cfg(&|c| {
                c.tp = 2;
                c.pp = 2;
                c.cp = 2
            }),
            cfg(&|c| {
                c.tp = 2;
                c.ep = 2;
                c.etp = Some(1)
            }),
            cfg(&|c| {
                c.tp = 2;
                c.pp = 2;
                c.cp = 2;
                c.ep = 2;
                c.etp = Some(1)
            }),
            cfg(&|c| {
                c.tp = 2;
                c.cp = 2;
                c.ep = 4;
                c.etp = Some(1);
                c.pp = 2;
                c.order = "tp-cp-ep-pp-dp".into()
            }),
            cfg(&|c| {
                c.tp = 2;
                c.pp = 2;
                c.dist_opt_instances = 2
            }),
        ],
        n if n % 2 == 0 => vec![cfg(&|_| {}), cfg(&|c| c.tp = 2)],
        _ => vec![cfg(&|_| {})],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::{input, reduce_expected};
    use grid_core::{LayoutPlan, ReduceOp};
    use half::bf16;

    #[test]
    fn expected_values_fit_every_dtype() {
        for n in 1..=16 {
            for op in ReduceOp::ALL {
                for i in 0..2 * n {
                    let e = reduce_expected::<i64>(op, n, i);
                    assert!(e.abs() < 250, "{op} n={n} i={i}: {e}");
                    let u = reduce_expected::<u8>(op, n, i);
                    let us: i64 = match op {
                        ReduceOp::Sum => (0..n).map(|r| input(op, false, r, i)).sum(),
                        ReduceOp::Avg => {
                            (0..n).map(|r| input(op, false, r, i)).sum::<i64>() / n as i64
                        }
                        ReduceOp::Prod => (0..n).map(|r| input(op, false, r, i)).product(),
                        ReduceOp::Min => (0..n).map(|r| input(op, false, r, i)).min().unwrap(),
                        ReduceOp::Max => (0..n).map(|r| input(op, false, r, i)).max().unwrap(),
                    };
                    assert_eq!(u as i64, us, "u8 {op} n={n} i={i}");
                    // bf16 holds every integer below 256 exactly.
                    if op != ReduceOp::Avg {
                        assert_eq!(reduce_expected::<bf16>(op, n, i).to_f64(), e as f64);
                    }
                }
            }
        }
        assert_eq!(reduce_expected::<f32>(ReduceOp::Avg, 2, 0), 1.5);
        assert_eq!(
            reduce_expected::<i32>(ReduceOp::Avg, 4, 1),
            (-1 - 2 - 3 - 4 + 4) / 4
        );
    }

    /// The new dtypes' expected values: i8 sums and averages stay in range up to 8 ranks, u32/u64
    /// use the unsigned inputs, bool results are the OR/AND of the inputs and tell them apart,
    /// fp8 inputs and results are exactly representable up to 16 ranks, and move tags are
    /// distinct and finite.
    #[test]
    fn expected_values_of_the_new_dtypes() {
        use crate::values::{value_in, Num};
        use grid_core::{Bool, F8E4M3, F8E5M2};
        for n in 1..=8 {
            for op in ReduceOp::ALL {
                for i in 0..2 * n {
                    let wide: i64 = reduce_expected::<i64>(op, n, i);
                    assert_eq!(
                        i64::from(reduce_expected::<i8>(op, n, i)),
                        wide,
                        "i8 {op} n={n} i={i}"
                    );
                    let sum: i64 = (0..n).map(|r| input(op, false, r, i)).sum();
                    if op == ReduceOp::Sum {
                        assert_eq!(reduce_expected::<u64>(op, n, i), sum as u64);
                        assert_eq!(reduce_expected::<u32>(op, n, i), sum as u32);
                    }
                }
            }
        }
        // Bool: sum/max = OR, prod/min = AND, and both occur.
        let (mut or_not_and, mut any_false) = (false, false);
        for n in 1..=16 {
            for i in 0..8 {
                let bits: Vec<bool> = (0..n)
                    .map(|r| value_in::<Bool>(ReduceOp::Sum, r, i).get())
                    .collect();
                let (or, and) = (bits.iter().any(|&b| b), bits.iter().all(|&b| b));
                for (op, want) in [
                    (ReduceOp::Sum, or),
                    (ReduceOp::Max, or),
                    (ReduceOp::Prod, and),
                    (ReduceOp::Min, and),
                ] {
                    assert_eq!(
                        reduce_expected::<Bool>(op, n, i).get(),
                        want,
                        "bool {op} n={n} i={i}"
                    );
                }
                or_not_and |= or && !and;
                any_false |= !or;
            }
        }
        assert!(or_not_and && any_false);
        // fp8: every input and every expected value (but averages over non-powers of two) is
        // exact in both formats.
        fn exact<T: Num>(v: f64) -> bool {
            T::of_f64(v).f64() == v
        }
        for n in 1..=16 {
            for op in ReduceOp::ALL {
                for i in 0..2 * n {
                    for r in 0..n {
                        let x = value_in::<F8E4M3>(op, r, i).f64();
                        assert!(
                            exact::<F8E4M3>(x) && exact::<F8E5M2>(x),
                            "{op} r={r} i={i}: {x}"
                        );
                    }
                    let vals = (0..n).map(|r| F8E4M3::input_of(op, r, i) as f64);
                    let want = match op {
                        ReduceOp::Sum => vals.sum::<f64>(),
                        ReduceOp::Prod => vals.product(),
                        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
                        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
                        ReduceOp::Avg if n.is_power_of_two() => vals.sum::<f64>() / n as f64,
                        ReduceOp::Avg => continue,
                    };
                    assert_eq!(
                        reduce_expected::<F8E4M3>(op, n, i).f64(),
                        want,
                        "e4m3 {op} n={n} i={i}"
                    );
                    assert_eq!(
                        reduce_expected::<F8E5M2>(op, n, i).f64(),
                        want,
                        "e5m2 {op} n={n} i={i}"
                    );
                }
            }
        }
        // Tags: distinct over 0..240 and finite for fp8; distinct over 0..251 for the others.
        let e4: Vec<u8> = (0..240).map(|v| F8E4M3::tag(v).to_bits()).collect();
        let e5: Vec<u8> = (0..240).map(|v| F8E5M2::tag(v).to_bits()).collect();
        for (bits, name) in [(&e4, "e4m3"), (&e5, "e5m2")] {
            let mut s = bits.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 240, "{name} tags collide");
        }
        assert!((0..240)
            .all(|v| F8E4M3::tag(v).to_f32().is_finite() && F8E5M2::tag(v).to_f32().is_finite()));
        assert!((0..240).all(|v| F8E4M3::tag(v).to_bits() != 0x80));
        let i8s: Vec<i8> = (0..251).map(i8::tag).collect();
        let mut s = i8s.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 251);
    }

    #[test]
    fn default_layouts_are_valid() {
        for w in [1, 2, 3, 4, 6, 8] {
            for cfg in default_layouts(w) {
                LayoutPlan::new(cfg.clone()).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
            }
        }
    }

    #[test]
    fn failure_message_names_rank_and_check() {
        let f = Failure {
            rank: 3,
            section: "parent".into(),
            failed_ranks: vec![3],
            messages: vec!["parent/f32/all_reduce/Sum: expected [1], got [2]".into()],
        };
        let s = f.to_string();
        assert!(
            s.contains("rank 3")
                && s.contains("all_reduce/Sum")
                && s.contains("expected [1], got [2]"),
            "{s}"
        );
    }
}
