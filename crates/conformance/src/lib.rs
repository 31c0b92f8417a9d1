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
//! (`iall_reduce_into`), each with every supported dtype and reduction.
//!
//! plus the error cases (typed, with the numbers: `LengthMismatch { expected, actual }`, ...):
//! mismatched lengths, mismatched dtypes, roots and peers out of range,
//! unsupported dtypes or memory, calls on a finished communicator (when the backend exposes a
//! finish operation, see [`Options::finish`]), and a plan mismatch across ranks
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
//! A backend with a finish/abort operation passes it through [`Options`]:
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

#![warn(missing_docs)]

use grid_core::{
    build_collection, BufMut, BufRef, Communicator, CommunicatorExt, DType, DeviceBuffer, Element,
    Error, FamilyLevel, GroupFactory, LayoutConfig, LayoutPlan, P2pOp, ReduceOp, Request, Tensor,
};
use half::{bf16, f16};
use std::any::Any;
use std::fmt;
use std::time::{Duration, Instant};

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

/// Options of [`run_with`].
///
/// ```
/// let o = grid_conformance::Options::<u32> { quick_subgroups: true, ..Default::default() };
/// assert!(o.finish.is_none() && o.layouts.is_none());
/// ```
pub struct Options<C> {
    /// Marks a communicator finished/aborted (local). When given, the suite finishes a fresh
    /// sub-communicator and expects [`Error::Finalized`] from later calls.
    pub finish: Option<FinishFn<C>>,
    /// Layouts for the collection section; `None` picks [`default_layouts`] for the world size.
    pub layouts: Option<Vec<LayoutConfig>>,
    /// Skip the whole per-dtype sweep on sub-groups (only the parent gets it), to save time.
    pub quick_subgroups: bool,
}

impl<C> Default for Options<C> {
    fn default() -> Self {
        Options {
            finish: None,
            layouts: None,
            quick_subgroups: false,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Numbers
// ------------------------------------------------------------------------------------------

/// Element types the suite can compute expected values for.
trait Num: Element {
    const SIGNED: bool;
    /// Unit roundoff (0 for integers).
    const EPS: f64;
    fn of(v: i64) -> Self;
    fn of_f64(v: f64) -> Self;
    fn f64(self) -> f64;
}

macro_rules! num_int {
    ($t:ty, $signed:expr) => {
        impl Num for $t {
            const SIGNED: bool = $signed;
            const EPS: f64 = 0.0;
            fn of(v: i64) -> Self {
                v as $t
            }
            fn of_f64(v: f64) -> Self {
                v as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
        }
    };
}
num_int!(i32, true);
num_int!(i64, true);
num_int!(u8, false);

impl Num for f32 {
    const SIGNED: bool = true;
    const EPS: f64 = f32::EPSILON as f64;
    fn of(v: i64) -> Self {
        v as f32
    }
    fn of_f64(v: f64) -> Self {
        v as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}
impl Num for f64 {
    const SIGNED: bool = true;
    const EPS: f64 = f64::EPSILON;
    fn of(v: i64) -> Self {
        v as f64
    }
    fn of_f64(v: f64) -> Self {
        v
    }
    fn f64(self) -> f64 {
        self
    }
}
impl Num for f16 {
    const SIGNED: bool = true;
    const EPS: f64 = 0.0009765625; // 2^-10
    fn of(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
    fn of_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn f64(self) -> f64 {
        self.to_f64()
    }
}
impl Num for bf16 {
    const SIGNED: bool = true;
    const EPS: f64 = 0.0078125; // 2^-7
    fn of(v: i64) -> Self {
        bf16::from_f64(v as f64)
    }
    fn of_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn f64(self) -> f64 {
        self.to_f64()
    }
}

/// Input of rank `r`, element `i`, for reduction `op` (see the crate docs).
fn input(op: ReduceOp, signed: bool, r: usize, i: usize) -> i64 {
    let (r, i) = (r as i64, i as i64);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let a = r % 8 + 1;
            let s = if signed && i % 2 == 1 { -a } else { a };
            s + i % 5
        }
        ReduceOp::Prod => {
            let m = if (r + i) % 3 == 0 { 2 } else { 1 };
            if signed && (r + 2 * i) % 4 == 1 {
                -m
            } else {
                m
            }
        }
        ReduceOp::Min | ReduceOp::Max => {
            let v = (3 * r + i) % 7;
            if signed {
                v - 3
            } else {
                v
            }
        }
    }
}

/// Exact reduction over ranks `0..n` of element `i`, as an i64 (and the float mean for Avg).
fn reduce_expected<T: Num>(op: ReduceOp, n: usize, i: usize) -> T {
    let vals = (0..n).map(|r| input(op, T::SIGNED, r, i));
    match op {
        ReduceOp::Sum => T::of(vals.sum()),
        ReduceOp::Prod => T::of(vals.product()),
        ReduceOp::Min => T::of(vals.min().unwrap_or(0)),
        ReduceOp::Max => T::of(vals.max().unwrap_or(0)),
        ReduceOp::Avg => {
            let s: i64 = vals.sum();
            if T::EPS > 0.0 {
                T::of_f64(s as f64 / n as f64)
            } else {
                T::of(s / n as i64)
            }
        }
    }
}

fn close<T: Num>(op: ReduceOp, n: usize, e: T, a: T) -> bool {
    if e == a {
        return true;
    }
    // Averages over group sizes that are not powers of two may differ by double rounding.
    op == ReduceOp::Avg
        && T::EPS > 0.0
        && !n.is_power_of_two()
        && (e.f64() - a.f64()).abs() <= e.f64().abs() * 2.0 * T::EPS
}

/// A small byte-sized value (exact in every dtype).
fn small(v: usize) -> i64 {
    (v % 251) as i64
}

// ------------------------------------------------------------------------------------------
// Context
// ------------------------------------------------------------------------------------------

struct Ctx {
    rank: usize,
    report: Report,
    failures: Vec<String>,
}

impl Ctx {
    fn pass(&mut self, name: String) {
        self.report.checks.push(CheckRecord {
            name,
            outcome: Outcome::Passed,
        });
    }
    fn skip(&mut self, name: String, why: impl Into<String>) {
        self.report.checks.push(CheckRecord {
            name,
            outcome: Outcome::Skipped(why.into()),
        });
    }
    fn fail(&mut self, name: &str, msg: String) {
        self.failures.push(format!("{name}: {msg}"));
    }
    /// Records `ok` as passed, else the message.
    fn expect(&mut self, name: String, ok: bool, msg: impl FnOnce() -> String) {
        if ok {
            self.pass(name);
        } else {
            let m = msg();
            self.fail(&name, m);
        }
    }
    fn eq<T: PartialEq + fmt::Debug>(&mut self, name: String, expected: &T, actual: &T) {
        self.expect(name, expected == actual, || {
            format!("expected {expected:?}, got {actual:?}")
        });
    }
    /// Unwraps a communicator call, recording an error as a failure.
    fn ok<T>(&mut self, name: &str, r: grid_core::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(name, format!("unexpected error: {e}"));
                None
            }
        }
    }
    fn values<T: Num>(
        &mut self,
        name: String,
        op: ReduceOp,
        n: usize,
        expected: &[T],
        actual: &[T],
    ) {
        let ok = expected.len() == actual.len()
            && expected
                .iter()
                .zip(actual)
                .all(|(&e, &a)| close(op, n, e, a));
        self.expect(name, ok, || {
            format!("expected {expected:?}, got {actual:?}")
        });
    }

    /// Agreement over `parent`: every rank learns whether any rank failed in this section.
    fn agree(&mut self, parent: &dyn Communicator, section: &str) -> Result<(), Failure> {
        let mine = self.failures.len() as i64;
        let mut all = vec![0i64; parent.size()];
        if let Err(e) = parent.all_gather_into(&[mine], &mut all[..]) {
            self.failures.push(format!(
                "{section}: agreement all_gather over the parent failed: {e}"
            ));
            return Err(self.failure(section, vec![self.rank]));
        }
        let failed: Vec<usize> = all
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 0)
            .map(|(i, _)| parent.global_ranks().get(i).copied().unwrap_or(i))
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(self.failure(section, failed))
        }
    }

    fn failure(&mut self, section: &str, failed_ranks: Vec<usize>) -> Failure {
        Failure {
            rank: self.rank,
            section: section.to_string(),
            failed_ranks,
            messages: std::mem::take(&mut self.failures),
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
/// error cases), `subgroups` (split by parity, split with a non-member, create_group of the
/// first and last rank, each with the operation sweep), `finish` (if [`Options::finish`]),
/// `layouts` (every family of each layout through `build_collection`) and `plan_mismatch`.
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
    errors(&mut ctx, "parent", parent);
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

// ------------------------------------------------------------------------------------------
// Sections
// ------------------------------------------------------------------------------------------

fn identity(ctx: &mut Ctx, label: &str, c: &dyn Communicator, expected_global: &[usize]) {
    let n = c.size();
    ctx.expect(format!("{label}/rank_in_range"), c.rank() < n, || {
        format!("rank {} not below size {n}", c.rank())
    });
    ctx.eq(
        format!("{label}/global_ranks_len"),
        &n,
        &c.global_ranks().len(),
    );
    ctx.eq(
        format!("{label}/global_ranks"),
        &expected_global.to_vec(),
        &c.global_ranks().to_vec(),
    );
    let sorted = c.global_ranks().windows(2).all(|w| w[0] < w[1]);
    ctx.expect(format!("{label}/global_ranks_ascending"), sorted, || {
        format!("{:?} is not ascending", c.global_ranks())
    });
    // The rank is this process's position: all-gather the world rank and compare.
    let me = ctx.rank as i64;
    let mut all = vec![0i64; n];
    if ctx
        .ok(
            &format!("{label}/all_gather_identity"),
            c.all_gather_into(&[me], &mut all[..]),
        )
        .is_some()
    {
        let want: Vec<i64> = c.global_ranks().iter().map(|&g| g as i64).collect();
        ctx.eq(format!("{label}/ranks_match_global_ranks"), &want, &all);
    }
}

fn sweep(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    for d in DType::ALL {
        if !c.supports(d, None) {
            ctx.skip(
                format!("{label}/{d}"),
                format!("the {} backend cannot move {d}", c.backend()),
            );
            continue;
        }
        match d {
            DType::F32 => typed::<f32>(ctx, label, c),
            DType::F64 => typed::<f64>(ctx, label, c),
            DType::I32 => typed::<i32>(ctx, label, c),
            DType::I64 => typed::<i64>(ctx, label, c),
            DType::U8 => typed::<u8>(ctx, label, c),
            DType::F16 => typed::<f16>(ctx, label, c),
            DType::BF16 => typed::<bf16>(ctx, label, c),
        }
    }
}

const K: usize = 5;

fn typed<T: Num>(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me, d) = (c.size(), c.rank(), T::DTYPE);
    let p = format!("{label}/{d}");
    let narrow = matches!(d, DType::U8 | DType::F16 | DType::BF16);
    // Reductions.
    for op in ReduceOp::ALL {
        let name = format!("{p}/all_reduce/{op}");
        if !c.supports(d, Some(op)) {
            ctx.skip(
                name.clone(),
                format!("the {} backend does not reduce {d} with {op}", c.backend()),
            );
            ctx.skip(format!("{p}/reduce_scatter/{op}"), "unsupported");
            continue;
        }
        if narrow && n > 16 {
            ctx.skip(
                name,
                "exact values need groups of at most 16 ranks for u8/f16/bf16",
            );
            continue;
        }
        let send: Vec<T> = (0..K).map(|i| T::of(input(op, T::SIGNED, me, i))).collect();
        let mut recv = vec![T::of(0); K];
        if ctx
            .ok(&name, c.all_reduce_into(&send[..], &mut recv[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name.clone(), op, n, &want, &recv);
        }
        // The same reduction in place: the input buffer receives the result.
        let name = format!("{p}/all_reduce_in_place/{op}");
        let mut buf = send.clone();
        if ctx
            .ok(&name, c.all_reduce_in_place(&mut buf[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..K).map(|i| reduce_expected::<T>(op, n, i)).collect();
            ctx.values(name, op, n, &want, &buf);
        }
        // Reduce-scatter: element j of rank r's input is input(op, r, j).
        let name = format!("{p}/reduce_scatter/{op}");
        let k = 2;
        let send: Vec<T> = (0..n * k)
            .map(|j| T::of(input(op, T::SIGNED, me, j)))
            .collect();
        let mut recv = vec![T::of(0); k];
        if ctx
            .ok(&name, c.reduce_scatter_into(&send[..], &mut recv[..], op))
            .is_some()
        {
            let want: Vec<T> = (0..k)
                .map(|i| reduce_expected::<T>(op, n, me * k + i))
                .collect();
            ctx.values(name, op, n, &want, &recv);
        }
    }
    // Empty all-reduce.
    let name = format!("{p}/all_reduce/empty");
    let mut empty: Vec<T> = Vec::new();
    if ctx
        .ok(
            &name,
            c.all_reduce_into(&[][..], &mut empty[..], ReduceOp::Sum),
        )
        .is_some()
    {
        ctx.pass(name);
    }
    // Broadcast from every root.
    for root in 0..n {
        let name = format!("{p}/broadcast/root{root}");
        let want: Vec<T> = (0..K).map(|i| T::of(small(root % 16 * 10 + i))).collect();
        let mut buf: Vec<T> = if me == root {
            want.clone()
        } else {
            vec![T::of(99); K]
        };
        if ctx
            .ok(&name, c.broadcast_into(&mut buf[..], root))
            .is_some()
        {
            ctx.eq(name, &want, &buf);
        }
    }
    // All-gather.
    let name = format!("{p}/all_gather");
    let k = 3;
    let send: Vec<T> = (0..k).map(|i| T::of(small(me * k + i))).collect();
    let mut recv = vec![T::of(0); n * k];
    if ctx
        .ok(&name, c.all_gather_into(&send[..], &mut recv[..]))
        .is_some()
    {
        let want: Vec<T> = (0..n * k).map(|j| T::of(small(j))).collect();
        ctx.eq(name, &want, &recv);
    }
    // All-to-all: from rank r to rank j, element i: (r·n + j)·2 + i.
    let name = format!("{p}/all_to_all");
    let k = 2;
    let send: Vec<T> = (0..n * k)
        .map(|x| T::of(small((me * n + x / k) * k + x % k)))
        .collect();
    let mut recv = vec![T::of(0); n * k];
    if ctx
        .ok(&name, c.all_to_all_into(&send[..], &mut recv[..]))
        .is_some()
    {
        let want: Vec<T> = (0..n * k)
            .map(|x| T::of(small(((x / k) * n + me) * k + x % k)))
            .collect();
        ctx.eq(name, &want, &recv);
    }
    // Barrier.
    let name = format!("{p}/barrier");
    if ctx.ok(&name, c.barrier()).is_some() {
        ctx.pass(name);
    }
    if n < 2 {
        ctx.skip(format!("{p}/send_recv"), "needs 2 ranks");
        ctx.skip(format!("{p}/batch_p2p"), "needs 2 ranks");
        return;
    }
    // Ring: rank 0 sends first, every other rank receives first (no deadlock at any size).
    let name = format!("{p}/send_recv");
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let out: Vec<T> = (0..4).map(|i| T::of(small(me * 10 + i))).collect();
    let mut inb = vec![T::of(0); 4];
    let r = if me == 0 {
        c.send_to(&out[..], right, 7)
            .and_then(|_| c.recv_from(&mut inb[..], left, 7))
    } else {
        c.recv_from(&mut inb[..], left, 7)
            .and_then(|_| c.send_to(&out[..], right, 7))
    };
    if ctx.ok(&name, r).is_some() {
        let want: Vec<T> = (0..4).map(|i| T::of(small(left * 10 + i))).collect();
        ctx.eq(name, &want, &inb);
    }
    // Batch: send [16r + j, 16r + j + 1] to every other rank j, receive from every other rank.
    let name = format!("{p}/batch_p2p");
    let outs: Vec<Vec<T>> = (0..n)
        .map(|j| vec![T::of(small(16 * me + j)), T::of(small(16 * me + j + 1))])
        .collect();
    let mut ins: Vec<Vec<T>> = vec![vec![T::of(0); 2]; n];
    let mut ops: Vec<P2pOp<'_>> = Vec::new();
    for (j, (o, i)) in outs.iter().zip(ins.iter_mut()).enumerate() {
        if j == me {
            continue;
        }
        ops.push(P2pOp::Send {
            buf: BufRef::from(&o[..]),
            peer: j,
            tag: 11,
        });
        ops.push(P2pOp::Recv {
            buf: BufMut::from(&mut i[..]),
            peer: j,
            tag: 11,
        });
    }
    if ctx.ok(&name, c.batch_p2p(ops)).is_some() {
        let want: Vec<Vec<T>> = (0..n)
            .map(|j| {
                if j == me {
                    vec![T::of(0); 2]
                } else {
                    vec![T::of(small(16 * j + me)), T::of(small(16 * j + me + 1))]
                }
            })
            .collect();
        ctx.eq(name, &want, &ins);
    }
}

fn nonblocking(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
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
        }
    }
    nb_ordering(ctx, label, c);
}

fn nb_typed<T: Num>(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me, d) = (c.size(), c.rank(), T::DTYPE);
    let p = format!("{label}/nonblocking/{d}");
    let narrow = matches!(d, DType::U8 | DType::F16 | DType::BF16);
    for op in ReduceOp::ALL {
        let name = format!("{p}/iall_reduce/{op}");
        if !c.supports(d, Some(op)) || (narrow && n > 16) {
            ctx.skip(name, "unsupported or group too large for exact values");
            continue;
        }
        let send: Vec<T> = (0..K).map(|i| T::of(input(op, T::SIGNED, me, i))).collect();
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
        let send: Vec<T> = (0..n * 2)
            .map(|j| T::of(input(op, T::SIGNED, me, j)))
            .collect();
        if let Some(v) = ctx.ok(&name, c.ireduce_scatter(send, op).and_then(|w| w.wait())) {
            let want: Vec<T> = (0..2)
                .map(|i| reduce_expected::<T>(op, n, me * 2 + i))
                .collect();
            ctx.values(name, op, n, &want, &v);
        }
    }
    let root = n - 1;
    let name = format!("{p}/ibroadcast");
    let want: Vec<T> = (0..K).map(|i| T::of(small(root % 16 * 10 + i))).collect();
    let buf = if me == root {
        want.clone()
    } else {
        vec![T::of(99); K]
    };
    if let Some(v) = ctx.ok(&name, c.ibroadcast(buf, root).and_then(|w| w.wait())) {
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/iall_gather");
    let send: Vec<T> = (0..3).map(|i| T::of(small(me * 3 + i))).collect();
    if let Some(v) = ctx.ok(&name, c.iall_gather(send).and_then(|w| w.wait())) {
        let want: Vec<T> = (0..n * 3).map(|j| T::of(small(j))).collect();
        ctx.eq(name, &want, &v);
    }
    let name = format!("{p}/iall_to_all");
    let send: Vec<T> = (0..n * 2)
        .map(|x| T::of(small((me * n + x / 2) * 2 + x % 2)))
        .collect();
    if let Some(v) = ctx.ok(&name, c.iall_to_all(send).and_then(|w| w.wait())) {
        let want: Vec<T> = (0..n * 2)
            .map(|x| T::of(small(((x / 2) * n + me) * 2 + x % 2)))
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
    let out: Vec<T> = (0..len).map(|i| T::of(small(me + i))).collect();
    let r = c.irecv::<T>(len, left, 21).and_then(|rw| {
        let sw = c.isend(out.clone(), right, 21)?;
        let got = rw.wait()?;
        let sent = sw.wait()?;
        Ok((got, sent))
    });
    if let Some((got, sent)) = ctx.ok(&name, r) {
        let want: Vec<T> = (0..len).map(|i| T::of(small(left + i))).collect();
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

/// A fake device buffer, for checking that host-only backends reject device memory.
#[derive(Debug)]
struct FakeDevice(usize);

impl DeviceBuffer for FakeDevice {
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn len(&self) -> usize {
        self.0
    }
    fn device(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

fn expect_err(
    ctx: &mut Ctx,
    name: String,
    r: grid_core::Result<()>,
    want: &str,
    pred: impl Fn(&Error) -> bool,
) {
    match r {
        Err(e) if pred(&e) => ctx.pass(name),
        Err(e) => ctx.fail(&name, format!("expected {want}, got error {e:?}")),
        Ok(()) => ctx.fail(&name, format!("expected {want}, got Ok")),
    }
}

fn errors(ctx: &mut Ctx, label: &str, c: &dyn Communicator) {
    let (n, me) = (c.size(), c.rank());
    let p = format!("{label}/errors");
    let len = |e: &Error| matches!(e, Error::LengthMismatch { .. });
    let dty = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
    let range = |e: &Error| matches!(e, Error::PeerOutOfRange { .. });
    let unsup = |e: &Error| matches!(e, Error::Unsupported { .. });
    let mut out3 = [0f32; 3];
    let mut out_i = [0i32; 2];
    expect_err(
        ctx,
        format!("{p}/all_reduce_length"),
        c.all_reduce_into(&[1f32, 2.0][..], &mut out3[..], ReduceOp::Sum),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/all_reduce_dtype"),
        c.all_reduce(
            BufRef::from(&[1f32, 2.0][..]),
            BufMut::from(&mut out_i[..]),
            ReduceOp::Sum,
        ),
        "DTypeMismatch",
        dty,
    );
    let mut ag = vec![0f32; n * 2 + 1];
    expect_err(
        ctx,
        format!("{p}/all_gather_length"),
        c.all_gather_into(&[1f32, 2.0][..], &mut ag[..]),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/all_gather_dtype"),
        c.all_gather(
            BufRef::from(&[1f32][..]),
            BufMut::from(&mut vec![0i32; n][..]),
        ),
        "DTypeMismatch",
        dty,
    );
    let rs = vec![0f32; n * 2 + 1];
    expect_err(
        ctx,
        format!("{p}/reduce_scatter_length"),
        c.reduce_scatter_into(&rs[..], &mut [0f32; 2][..], ReduceOp::Sum),
        "LengthMismatch",
        len,
    );
    let a2a = vec![0f32; n * 2];
    expect_err(
        ctx,
        format!("{p}/all_to_all_length"),
        c.all_to_all_into(&a2a[..], &mut vec![0f32; n * 2 + 1][..]),
        "LengthMismatch",
        len,
    );
    if n > 1 {
        let odd = vec![0f32; n + 1];
        expect_err(
            ctx,
            format!("{p}/all_to_all_indivisible"),
            c.all_to_all_into(&odd[..], &mut vec![0f32; n + 1][..]),
            "Invalid, LengthMismatch or Indivisible",
            |e| {
                matches!(
                    e,
                    Error::Invalid(_) | Error::LengthMismatch { .. } | Error::Indivisible { .. }
                )
            },
        );
    }
    expect_err(
        ctx,
        format!("{p}/broadcast_root"),
        c.broadcast_into(&mut [0f32; 2][..], n),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/send_peer"),
        c.send_to(&[0f32][..], n, 0),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/recv_peer"),
        c.recv_from(&mut [0f32][..], n + 3, 0),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/send_self"),
        c.send_to(&[0f32][..], me, 0),
        "an error",
        |_| true,
    );
    expect_err(
        ctx,
        format!("{p}/batch_peer"),
        c.batch_p2p(vec![P2pOp::Send {
            buf: BufRef::from(&[0f32][..]),
            peer: n,
            tag: 0,
        }]),
        "PeerOutOfRange",
        range,
    );
    // The errors carry the numbers involved.
    expect_err(
        ctx,
        format!("{p}/all_reduce_length_numbers"),
        c.all_reduce_into(&[1f32, 2.0][..], &mut out3[..], ReduceOp::Sum),
        "LengthMismatch { expected: 2, actual: 3 }",
        |e| {
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/all_gather_length_numbers"),
        c.all_gather_into(&[1f32, 2.0][..], &mut ag[..]),
        "LengthMismatch with expected = 2·size",
        |e| matches!(e, Error::LengthMismatch { expected, actual, .. } if *expected == 2 * n && *actual == 2 * n + 1),
    );
    expect_err(
        ctx,
        format!("{p}/all_reduce_dtype_numbers"),
        c.all_reduce(
            BufRef::from(&[1f32, 2.0][..]),
            BufMut::from(&mut out_i[..]),
            ReduceOp::Sum,
        ),
        "DTypeMismatch { expected: f32, actual: i32 }",
        |e| {
            matches!(
                e,
                Error::DTypeMismatch {
                    expected: DType::F32,
                    actual: DType::I32,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/broadcast_root_numbers"),
        c.broadcast_into(&mut [0f32; 2][..], n),
        "PeerOutOfRange { rank: size, size }",
        |e| matches!(e, Error::PeerOutOfRange { rank, size, .. } if *rank == n && *size == n),
    );
    // Out-of-place nonblocking all-reduce validates at start too.
    expect_err(
        ctx,
        format!("{p}/start_all_reduce_into_length"),
        c.start(Request::AllReduceInto {
            send: vec![1f32, 2.0].into(),
            recv: vec![0f32; 3].into(),
            op: ReduceOp::Sum,
        })
        .map(|_| ()),
        "LengthMismatch { expected: 2, actual: 3 }",
        |e| {
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 2,
                    actual: 3,
                    ..
                }
            )
        },
    );
    expect_err(
        ctx,
        format!("{p}/start_all_reduce_into_dtype"),
        c.start(Request::AllReduceInto {
            send: vec![1f32, 2.0].into(),
            recv: vec![0i32; 2].into(),
            op: ReduceOp::Sum,
        })
        .map(|_| ()),
        "DTypeMismatch",
        dty,
    );
    // Nonblocking forms validate at start.
    let start = |r: Request| c.start(r).map(|_| ());
    expect_err(
        ctx,
        format!("{p}/start_all_gather_length"),
        start(Request::AllGather {
            send: vec![1f32].into(),
            recv: vec![0f32; n + 1].into(),
        }),
        "LengthMismatch",
        len,
    );
    expect_err(
        ctx,
        format!("{p}/start_reduce_scatter_dtype"),
        start(Request::ReduceScatter {
            send: vec![1f32; n].into(),
            recv: vec![0i32; 1].into(),
            op: ReduceOp::Sum,
        }),
        "DTypeMismatch",
        dty,
    );
    expect_err(
        ctx,
        format!("{p}/start_broadcast_root"),
        start(Request::Broadcast {
            buf: vec![1f32].into(),
            root: n,
        }),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/start_send_peer"),
        start(Request::Send {
            buf: vec![1f32].into(),
            peer: n,
            tag: 0,
        }),
        "PeerOutOfRange",
        range,
    );
    expect_err(
        ctx,
        format!("{p}/start_recv_peer"),
        start(Request::Recv {
            buf: vec![1f32].into(),
            peer: n,
            tag: 0,
        }),
        "PeerOutOfRange",
        range,
    );
    // Unsupported dtype/op pairs must say so.
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            if c.supports(d, Some(op)) {
                continue;
            }
            let name = format!("{p}/unsupported/{d}/{op}");
            if !c.supports(d, None) {
                ctx.skip(name, "dtype not movable");
                continue;
            }
            let send = grid_core::HostBuffer::zeros(d, 2);
            let mut recv = grid_core::HostBuffer::zeros(d, 2);
            expect_err(
                ctx,
                name,
                c.all_reduce(
                    BufRef::Host(send.as_slice()),
                    BufMut::Host(recv.as_mut_slice()),
                    op,
                ),
                "Unsupported",
                unsup,
            );
        }
    }
    // Device memory on a host-only backend.
    if !c.accepts(grid_core::Memory::Device) {
        let dev = FakeDevice(2);
        let mut out = [0f32; 2];
        expect_err(
            ctx,
            format!("{p}/device_memory"),
            c.all_reduce(
                BufRef::Device(&dev),
                BufMut::from(&mut out[..]),
                ReduceOp::Sum,
            ),
            "Unsupported",
            unsup,
        );
        let mut dev_out = FakeDevice(2);
        expect_err(
            ctx,
            format!("{p}/device_memory_in_place"),
            c.in_place_all_reduce(BufMut::Device(&mut dev_out), ReduceOp::Sum),
            "Unsupported",
            unsup,
        );
        expect_err(
            ctx,
            format!("{p}/device_memory_start"),
            c.start(Request::AllReduce {
                buf: Tensor::Device(Box::new(FakeDevice(2))),
                op: ReduceOp::Sum,
            })
            .map(|_| ()),
            "Unsupported",
            unsup,
        );
    } else {
        ctx.skip(
            format!("{p}/device_memory"),
            "the backend accepts device memory",
        );
    }
    // The communicator still works after all of the above.
    let name = format!("{p}/still_usable");
    let mut s = [0i64];
    if ctx
        .ok(
            &name,
            c.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum),
        )
        .is_some()
    {
        ctx.eq(name, &(n as i64), &s[0]);
    }
}

fn subgroups<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm, quick: bool) {
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

fn finished<F: GroupFactory>(
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

fn layout<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm, cfg: LayoutConfig) {
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

fn plan_mismatch<F: GroupFactory>(ctx: &mut Ctx, factory: &F, world: &F::Comm) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
