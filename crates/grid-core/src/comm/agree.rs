//! Mismatch checking: before a collective runs, every rank checks that all ranks agree on
//! what it is (operation, element type, counts, root, reduction, position among the
//! communicator's collectives), so that a disagreement becomes a typed error on **every** rank
//! ([`Error::CollectiveMismatch`]) instead of a hang, a crash inside the library or wrong data.
//!
//! # How
//! Each rank describes the collective as a [`Fingerprint`] of `k` integers `f`, and the ranks
//! run **one small all-reduce** through the backend itself (so it works on every backend;
//! [`Backend::run_check`] lets a backend run it its own way): the maximum of the `2k` integers
//! `[f, -f]`, which yields every field's maximum and (negated)
//! minimum. If they are equal for every field, everyone agrees and the real operation runs.
//! Otherwise the ranks all-gather their fingerprints (`k` integers each), and every rank
//! returns the same error naming the first field that differs and every rank's value of it.
//! Both exchanges are fixed-size `i64` collectives on host memory, built by the front end and
//! always well formed, so they cannot themselves disagree.
//!
//! # Sequence numbers
//! The exchanges take no sequence number of their own: they reach the backend under the
//! checked operation's number, so `seq` keeps counting the operations the user issued (the
//! same on every rank whether the check is on or off) and errors and the operation log name
//! the user's operation. The fingerprint carries a separate **collective number** (how many
//! collectives this rank issued on the communicator, while checking was on, before this one;
//! all ranks switch modes at the same collective, so the counts agree), not `seq`, because
//! point-to-point operations also take sequence numbers and ranks of a pipeline legitimately
//! issue different numbers of them.
//!
//! # What is checked
//! * every collective: all-reduce, all-gather and reduce-scatter (in place and out of place
//!   compare alike: an in-place all-gather of `size · count` elements is an all-gather of
//!   `count`, an in-place reduce-scatter of `size · count` a reduce-scatter into `count`),
//!   broadcast, all-to-all, and barrier (its operation only: it has no data);
//! * nonblocking collectives: on a backend that runs checks in its own order
//!   ([`Backend::checks_when_run`], Gloo) the check travels with the request
//!   ([`Validated::check`], a [`DeferredCheck`]) and the backend runs it right before the
//!   collective executes, so `start` never blocks and every mode applies; a disagreement fails
//!   the operation's [`super::Work`] on every rank. Elsewhere they are checked when they are
//!   started, and **only in the `All` mode** (`GRID_DEBUG=detail`, or
//!   [`super::Comm::set_mismatch_check`]): [`super::Communicator::start`] then blocks for the
//!   exchange until every member has started the same collective (on a backend that runs one
//!   communicator's collectives in order it also waits for those started before). That turns a
//!   legal overlap into a deadlock when one rank's start depends on a message another rank
//!   sends only after its own start (a data-parallel all-reduce started before a pipeline send
//!   the peer needs before it starts its own), so a size threshold ([`MismatchCheck::Above`], a
//!   backend's default) never applies to them there: a debugging mode may change timing, a
//!   default must not;
//! * **point-to-point is not checked**: a send and its receive concern two ranks, not the whole
//!   group, so a group-wide exchange would make every rank wait for pairs it is not part of;
//!   the backends check a received message's length against the buffer instead;
//! * a communicator of one rank is never checked (nothing to disagree with).
//!
//! # Modes
//! [`MismatchCheck::Off`], [`MismatchCheck::All`] and [`MismatchCheck::Above`] (only collectives
//! that move at least that many bytes on this rank). A communicator starts with
//! `GRID_DEBUG=detail` → `All`, `GRID_DEBUG=off` → `Off`, otherwise its backend's default
//! ([`super::Backend::mismatch_check_default`], `Off` unless the backend says otherwise); then
//! [`super::Comm::set_mismatch_check`] changes it for that communicator. Communicators split
//! from it start from the same rules (environment, then backend default), not from the
//! parent's setter.
//!
//! `Above(bytes)` is decided by each rank from its own operation. When every rank's operation
//! is at or above the threshold every disagreement is caught; when every rank's is below,
//! nothing is checked. When ranks straddle it (one rank's count is large, another's small) the
//! ranks above run the exchange while the ranks below run their real operation against it: the
//! outcome is then the backend's (usually an error, but not guaranteed). Use `All` where that
//! matters: every rank then checks every collective.

use super::backend::Backend;
use super::buffer::{BufMut, BufRef, Tensor};
use super::dtype::{DType, ReduceOp};
use super::front::Comm;
use super::lifecycle::TimeLimit;
use super::op::{Op, Request, Validated};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};

/// When a communicator checks that all ranks agree on a collective before running it.
///
/// ```
/// use grid_core::MismatchCheck;
/// assert!(MismatchCheck::All.applies(0));
/// assert!(!MismatchCheck::Off.applies(1 << 30));
/// assert!(MismatchCheck::Above(65536).applies(65536));
/// assert!(!MismatchCheck::Above(65536).applies(65535));
/// assert_eq!(MismatchCheck::from_env_value("DETAIL"), Some(MismatchCheck::All));
/// assert_eq!(MismatchCheck::from_env_value("info"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MismatchCheck {
    /// No check.
    Off,
    /// Every collective (including barriers).
    All,
    /// Collectives whose larger buffer on this rank holds at least this many bytes.
    Above(usize),
}

const OFF: u64 = u64::MAX;

impl MismatchCheck {
    /// Whether a collective moving `bytes` (its larger buffer on this rank) is checked.
    pub fn applies(self, bytes: usize) -> bool {
        match self {
            MismatchCheck::Off => false,
            MismatchCheck::All => true,
            MismatchCheck::Above(t) => bytes >= t,
        }
    }

    /// The mode a value of `GRID_DEBUG` selects: `detail` → `All`, `off` → `Off` (either
    /// case); any other value (`info`, empty) selects nothing, leaving the backend's default.
    pub fn from_env_value(v: &str) -> Option<MismatchCheck> {
        if v.eq_ignore_ascii_case("detail") {
            Some(MismatchCheck::All)
        } else if v.eq_ignore_ascii_case("off") {
            Some(MismatchCheck::Off)
        } else {
            None
        }
    }

    fn encode(self) -> u64 {
        match self {
            MismatchCheck::Off => OFF,
            MismatchCheck::All => 0,
            MismatchCheck::Above(t) => (t as u64).min(OFF - 1),
        }
    }

    fn decode(v: u64) -> MismatchCheck {
        match v {
            OFF => MismatchCheck::Off,
            0 => MismatchCheck::All,
            t => MismatchCheck::Above(usize::try_from(t).unwrap_or(usize::MAX)),
        }
    }
}

/// The per-communicator state of the check: the mode and the number of collectives issued.
#[derive(Debug)]
pub(super) struct Agreement {
    mode: AtomicU64,
    collectives: AtomicU64,
}

impl Agreement {
    /// The starting mode: `GRID_DEBUG` when it selects one, else the backend's default.
    pub(super) fn new<B: Backend>(backend: &B) -> Agreement {
        let env = std::env::var("GRID_DEBUG").ok();
        let mode = env
            .as_deref()
            .and_then(MismatchCheck::from_env_value)
            .unwrap_or_else(|| backend.mismatch_check_default());
        Agreement {
            mode: AtomicU64::new(mode.encode()),
            collectives: AtomicU64::new(0),
        }
    }
}

/// What each rank says a collective is. Fields, in the order they are compared and reported:
/// operation, collective number, element type, count (send side), receive count, root,
/// reduction; `-1` where the operation has no such field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint([i64; FIELDS]);

const FIELDS: usize = 8;
const FIELD_NAMES: [&str; FIELDS] = [
    "operation",
    "collective number",
    "dtype",
    "count",
    "receive count",
    "root",
    "reduce op",
    "counts",
];
/// Index of the `counts` field: a hash of the per-rank counts vector of all-gather-v and
/// reduce-scatter-v (which every rank passes equal), `-1` for other operations.
const COUNTS: usize = 7;
const OPS: [&str; 12] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "all_to_all_v",
    "all_gather_v",
    "reduce_scatter_v",
    "reduce",
    "gather",
    "scatter",
];

/// A 63-bit hash of a counts vector (FNV-1a over the counts as little-endian u64), the same in
/// every process, for the `counts` field.
fn counts_hash(counts: &[usize]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in counts {
        for b in (c as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    (h >> 1) as i64
}

fn int(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn code<T: PartialEq>(all: &[T], v: T) -> i64 {
    all.iter().position(|x| *x == v).map_or(-1, int)
}

/// What a fingerprint is made of, kept as it is until the mode says the operation is checked:
/// encoding it (the operation's code is found by name) is skipped for the operations a size
/// threshold lets through.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    name: &'static str,
    dtype: Option<DType>,
    sizes: (usize, usize),
    root: Option<usize>,
    reduce: Option<ReduceOp>,
    /// The hash of an all-gather-v's or reduce-scatter-v's counts.
    counts: Option<i64>,
    /// An all-to-all-v's counts (sent to each rank, expected from each rank), which the check
    /// exchanges and compares after the fingerprints agree.
    exchange: Option<(Vec<i64>, Vec<i64>)>,
}

impl Pending {
    fn fingerprint(&self) -> Fingerprint {
        let mut f = Fingerprint::new(self.name, self.dtype, self.sizes, self.root, self.reduce);
        f.0[COUNTS] = self.counts.unwrap_or(-1);
        f
    }
}

fn wide(counts: &[usize]) -> Vec<i64> {
    counts.iter().map(|&c| int(c)).collect()
}

impl Fingerprint {
    fn new(
        op: &'static str,
        dtype: Option<DType>,
        counts: (usize, usize),
        root: Option<usize>,
        reduce: Option<ReduceOp>,
    ) -> Fingerprint {
        Fingerprint([
            code(&OPS, op),
            0,
            dtype.map_or(-1, |d| code(&DType::ALL, d)),
            int(counts.0),
            int(counts.1),
            root.map_or(-1, int),
            reduce.map_or(-1, |r| code(&ReduceOp::ALL, r)),
            -1,
        ])
    }

    /// The fingerprint of a blocking operation, with the bytes of its larger buffer; `None`
    /// for point-to-point operations (not checked).
    ///
    /// Sizes and bytes are chosen so that every rank of a well-formed call computes the same
    /// fingerprint and the same byte count (so a threshold decides alike on every rank): the
    /// block of a rooted operation rather than the root's whole buffer, the total of an
    /// all-gather-v or reduce-scatter-v; an all-to-all-v, whose sizes no rank knows for the
    /// others, counts as `usize::MAX` bytes (checked in every mode but `Off`).
    ///
    /// The in-place all-gather and reduce-scatter count as their out-of-place forms
    /// ([`Op::sizes_on`] of the communicator's `size`), so a rank that calls one form and a rank
    /// that calls the other with the same counts agree.
    pub(crate) fn of_op(op: &Op<'_>, size: usize) -> Option<(Pending, usize)> {
        let name = op.name();
        let sizes = op.sizes_on(size);
        let (dtype, root, reduce) = match op {
            Op::AllReduce { send, op, .. } => (Some(send.dtype()), None, Some(*op)),
            Op::AllReduceInPlace { buf, op } => (Some(buf.dtype()), None, Some(*op)),
            Op::Broadcast { buf, root } => (Some(buf.dtype()), Some(*root), None),
            Op::AllGather { send, .. } | Op::AllToAll { send, .. } => {
                (Some(send.dtype()), None, None)
            }
            Op::AllGatherInPlace { buf } => (Some(buf.dtype()), None, None),
            Op::ReduceScatter { send, op, .. } => (Some(send.dtype()), None, Some(*op)),
            Op::ReduceScatterInPlace { buf, op } => (Some(buf.dtype()), None, Some(*op)),
            Op::Barrier => (None, None, None),
            Op::AllToAllV {
                send,
                send_counts,
                recv_counts,
                ..
            } => return Some(Self::exchange(name, send.dtype(), send_counts, recv_counts)),
            Op::AllGatherV {
                send, recv_counts, ..
            } => return Some(Self::uneven(name, send.dtype(), recv_counts, None)),
            Op::ReduceScatterV {
                send,
                send_counts,
                op,
                ..
            } => return Some(Self::uneven(name, send.dtype(), send_counts, Some(*op))),
            Op::Reduce { send, op, root, .. } => {
                return Some(Self::rooted(
                    name,
                    send.dtype(),
                    send.len(),
                    *root,
                    Some(*op),
                ))
            }
            Op::Gather { send, root, .. } => {
                return Some(Self::rooted(name, send.dtype(), send.len(), *root, None))
            }
            Op::Scatter { recv, root, .. } => {
                return Some(Self::rooted(name, recv.dtype(), recv.len(), *root, None))
            }
            Op::Send { .. } | Op::Recv { .. } | Op::Batch(_) => return None,
        };
        Some(Self::with_bytes(name, dtype, sizes, root, reduce))
    }

    fn exchange(
        name: &'static str,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> (Pending, usize) {
        let (mut p, _) = Self::with_bytes(name, Some(dtype), (0, 0), None, None);
        p.exchange = Some((wide(send_counts), wide(recv_counts)));
        (p, usize::MAX)
    }

    fn uneven(
        name: &'static str,
        dtype: DType,
        counts: &[usize],
        reduce: Option<ReduceOp>,
    ) -> (Pending, usize) {
        let total = super::check::total(counts).unwrap_or(usize::MAX);
        let (mut p, bytes) = Self::with_bytes(name, Some(dtype), (total, total), None, reduce);
        p.counts = Some(counts_hash(counts));
        (p, bytes)
    }

    fn rooted(
        name: &'static str,
        dtype: DType,
        block: usize,
        root: usize,
        reduce: Option<ReduceOp>,
    ) -> (Pending, usize) {
        Self::with_bytes(name, Some(dtype), (block, block), Some(root), reduce)
    }

    /// The fingerprint of a nonblocking operation, with the bytes of its larger buffer; `None`
    /// for point-to-point operations (not checked). In-place forms count as in [`Self::of_op`].
    pub(crate) fn of_request(r: &Request, size: usize) -> Option<(Pending, usize)> {
        let name = r.name();
        let sizes = r.sizes_on(size);
        let d = |t: &Tensor| Some(t.dtype());
        let (dtype, root, reduce) = match r {
            Request::AllReduceInto { send, op, .. } => (d(send), None, Some(*op)),
            Request::AllReduce { buf, op } => (d(buf), None, Some(*op)),
            Request::Broadcast { buf, root } => (d(buf), Some(*root), None),
            Request::AllGather { send, .. } | Request::AllToAll { send, .. } => {
                (d(send), None, None)
            }
            Request::AllGatherInPlace { buf } => (d(buf), None, None),
            Request::ReduceScatter { send, op, .. } => (d(send), None, Some(*op)),
            Request::ReduceScatterInPlace { buf, op } => (d(buf), None, Some(*op)),
            Request::Barrier => (None, None, None),
            Request::AllToAllV {
                send,
                send_counts,
                recv_counts,
                ..
            } => return Some(Self::exchange(name, send.dtype(), send_counts, recv_counts)),
            Request::AllGatherV {
                send, recv_counts, ..
            } => return Some(Self::uneven(name, send.dtype(), recv_counts, None)),
            Request::ReduceScatterV {
                send,
                send_counts,
                op,
                ..
            } => return Some(Self::uneven(name, send.dtype(), send_counts, Some(*op))),
            Request::Reduce { send, op, root, .. } => {
                return Some(Self::rooted(
                    name,
                    send.dtype(),
                    send.len(),
                    *root,
                    Some(*op),
                ))
            }
            Request::Gather { send, root, .. } => {
                return Some(Self::rooted(name, send.dtype(), send.len(), *root, None))
            }
            Request::Scatter { recv, root, .. } => {
                return Some(Self::rooted(name, recv.dtype(), recv.len(), *root, None))
            }
            Request::Send { .. } | Request::Recv { .. } => return None,
        };
        Some(Self::with_bytes(name, dtype, sizes, root, reduce))
    }

    fn with_bytes(
        name: &'static str,
        dtype: Option<DType>,
        sizes: (usize, usize),
        root: Option<usize>,
        reduce: Option<ReduceOp>,
    ) -> (Pending, usize) {
        let width = dtype.map_or(0, DType::size_bytes);
        let bytes = sizes.0.max(sizes.1).saturating_mul(width);
        (
            Pending {
                name,
                dtype,
                sizes,
                root,
                reduce,
                counts: None,
                exchange: None,
            },
            bytes,
        )
    }

    /// Field `i`'s value as an error message shows it.
    fn show(field: usize, v: i64) -> String {
        let pick = |names: &[String]| {
            usize::try_from(v)
                .ok()
                .and_then(|i| names.get(i).cloned())
                .unwrap_or_else(|| format!("none ({v})"))
        };
        match field {
            0 => pick(&OPS.map(String::from)),
            2 => pick(&DType::ALL.map(|d| d.to_string())),
            6 => pick(&ReduceOp::ALL.map(|r| r.to_string())),
            5 | COUNTS if v < 0 => "none".to_string(),
            COUNTS => format!("counts vector with hash {v:#x}"),
            _ => v.to_string(),
        }
    }

    /// The first field on which the ranks' fingerprints (`all`, `FIELDS` integers per rank, in
    /// rank order) differ, with every rank's value of it; `None` when they all agree.
    fn first_difference(all: &[i64]) -> Option<(&'static str, Vec<(usize, String)>)> {
        let ranks: Vec<&[i64]> = all.chunks_exact(FIELDS).collect();
        let first = ranks.first()?;
        (0..FIELDS)
            .find(|&f| ranks.iter().any(|r| r[f] != first[f]))
            .map(|f| {
                let values = ranks
                    .iter()
                    .enumerate()
                    .map(|(rank, r)| (rank, Fingerprint::show(f, r[f])))
                    .collect();
                (FIELD_NAMES[f], values)
            })
    }
}

/// Formats the ranks' values of a mismatch, grouping ranks that hold the same value:
/// `rank 0: 4, rank 1: 65536` or `ranks 0, 2, 3: 4, rank 1: 65536`.
pub(crate) fn describe_values(values: &[(usize, String)]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, v) in values {
        match groups.iter_mut().find(|(g, _)| *g == v.as_str()) {
            Some((_, ranks)) => ranks.push(*rank),
            None => groups.push((v.as_str(), vec![*rank])),
        }
    }
    groups
        .iter()
        .map(|(v, ranks)| {
            let list = ranks
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            let word = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{word} {list}: {v}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl<B: Backend> Comm<B> {
    /// This communicator's mismatch-checking mode (see [`MismatchCheck`] and the module docs
    /// of the front end).
    pub fn mismatch_check(&self) -> MismatchCheck {
        MismatchCheck::decode(self.agree.mode.load(Ordering::Relaxed))
    }

    /// Sets this communicator's mismatch-checking mode. Every rank of the communicator must
    /// set the same mode before the same collective (a rank that checks while another does not
    /// runs the check's exchange against the other's real operation). Communicators split from
    /// this one do not inherit it.
    pub fn set_mismatch_check(&self, mode: MismatchCheck) {
        self.agree.mode.store(mode.encode(), Ordering::Relaxed);
    }

    /// The check for a blocking operation, after validation and before the backend runs it.
    ///
    /// On a backend that runs checks in its own order ([`Backend::checks_when_run`]) nothing is
    /// exchanged here: the check is returned, to travel with the operation
    /// ([`Validated::check`]); the backend runs it right before the collective, or sends the
    /// fingerprints with the collective's own data (Gloo's small collectives).
    pub(super) fn agree_op(
        &self,
        op: &Op<'_>,
        seq: u64,
        limit: TimeLimit,
    ) -> Result<Option<DeferredCheck>> {
        if self.mismatch_check() == MismatchCheck::Off {
            return Ok(None); // nothing to count or compare: one relaxed load per operation
        }
        match Fingerprint::of_op(op, self.inner().size()) {
            Some((f, bytes)) => self.agree(op.name(), f, bytes, seq, limit, false),
            None => Ok(None),
        }
    }

    /// The check for a nonblocking operation, after validation and before the backend starts it.
    ///
    /// On a backend that runs checks in its own order ([`Backend::checks_when_run`]) nothing
    /// is exchanged here: the check is returned, to travel with the request
    /// ([`Validated::check`]) and run right before the collective executes, so `start` never
    /// blocks.
    pub(super) fn agree_request(
        &self,
        r: &Request,
        seq: u64,
        limit: TimeLimit,
    ) -> Result<Option<DeferredCheck>> {
        if self.mismatch_check() == MismatchCheck::Off {
            return Ok(None);
        }
        let Some((pending, bytes)) = Fingerprint::of_request(r, self.inner().size()) else {
            return Ok(None);
        };
        if !self.inner().checks_when_run(true) {
            return self.agree(r.name(), pending, bytes, seq, limit, true);
        }
        let n = self.count_collective();
        let size = self.inner().size();
        if size < 2 || !self.mismatch_check().applies(bytes) {
            return Ok(None);
        }
        Ok(Some(self.check_of(r.name(), pending, n, seq, size)))
    }

    /// The check of collective `op` (`n`-th collective while checking, sequence number `seq`)
    /// on this communicator of `size` ranks.
    fn check_of(
        &self,
        op: &'static str,
        pending: Pending,
        n: u64,
        seq: u64,
        size: usize,
    ) -> DeferredCheck {
        let mut f = pending.fingerprint();
        f.0[1] = i64::try_from(n).unwrap_or(i64::MAX);
        DeferredCheck {
            op,
            comm: self.comm_name().to_string(),
            seq,
            size,
            fingerprint: f.0,
            exchange: pending.exchange,
        }
    }

    /// The number of collectives issued before this one while checking was on, counting this
    /// one. Collectives of one communicator are issued in one order by one thread at a time
    /// (concurrent collectives on one communicator have no defined order on any backend), so a
    /// plain load and store suffices: no read-modify-write on every operation.
    fn count_collective(&self) -> u64 {
        let n = self.agree.collectives.load(Ordering::Relaxed);
        self.agree.collectives.store(n + 1, Ordering::Relaxed);
        n
    }

    fn agree(
        &self,
        op: &'static str,
        pending: Pending,
        bytes: usize,
        seq: u64,
        limit: TimeLimit,
        nonblocking: bool,
    ) -> Result<Option<DeferredCheck>> {
        let n = self.count_collective();
        let size = self.inner().size();
        let check = match self.mismatch_check() {
            MismatchCheck::All => true,
            // A threshold never blocks a nonblocking start (see the module docs).
            mode @ MismatchCheck::Above(_) => !nonblocking && mode.applies(bytes),
            MismatchCheck::Off => false,
        };
        if size < 2 || !check {
            return Ok(None);
        }
        let deferred = self.check_of(op, pending, n, seq, size);
        if self.inner().checks_when_run(nonblocking) {
            return Ok(Some(deferred)); // a blocking operation's check, run by the backend
        }
        self.inner().run_check(&deferred, seq, limit).map(|()| None)
    }
}

/// The all-gather a [`DeferredCheck`] is given: this rank's slice into every rank's (rank
/// order).
pub type GatherFn<'a> = dyn FnMut(&[i64], &mut [i64]) -> Result<()> + 'a;

/// The mismatch check of one collective, with this rank's fingerprint: run by the front end
/// before a blocking collective, and by a backend that runs checks in its own order
/// ([`Backend::checks_when_run`]) right before a nonblocking collective executes (it travels
/// with the request: [`Validated::check`]), so that starting one never blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeferredCheck {
    op: &'static str,
    comm: String,
    seq: u64,
    size: usize,
    fingerprint: [i64; FIELDS],
    /// All-to-all-v: the counts this rank sends to each rank and expects from each rank.
    exchange: Option<(Vec<i64>, Vec<i64>)>,
}

impl DeferredCheck {
    /// Runs the check over the communicator: `max_in_place` must all-reduce the given `i64`
    /// buffer in place with [`ReduceOp::Max`] over every rank, and `all_gather` must gather
    /// every rank's slice into the second buffer (rank order); each is called at most once, in
    /// that order, by every rank alike (both are fixed-size, so they cannot disagree). `Ok` when
    /// every rank has the same fingerprint; otherwise [`Error::CollectiveMismatch`] naming the
    /// first field that differs and every rank's value, the same on every rank.
    ///
    /// An all-to-all-v's check goes on once the fingerprints agree (so every rank is in the
    /// same all-to-all-v): `all_to_all` must send element `j` of the first buffer to rank `j`
    /// and receive element `j` of the second from rank `j` (an `i64` all-to-all of one element
    /// per rank); each rank compares what every rank sends it with what it expects, the ranks
    /// agree on the outcome with one more `max_in_place` (of one integer) and, when a rank
    /// disagrees, gather three integers each, so that every rank returns the same
    /// [`Error::CollectiveMismatch`] naming each disagreeing rank, the peer and both counts.
    ///
    /// A failure of those exchanges (a time-out, a failed peer, an abort, a library error) is
    /// returned as a failure of the checked operation: the caller called `op`, not the check.
    pub fn verify(
        &self,
        max_in_place: &mut dyn FnMut(&mut [i64]) -> Result<()>,
        all_gather: &mut GatherFn<'_>,
        all_to_all: &mut GatherFn<'_>,
    ) -> Result<()> {
        let op = self.op;
        self.verify_fingerprints(
            &mut |buf| max_in_place(buf).map_err(|e| e.in_op(op)),
            &mut |mine, all| all_gather(mine, all).map_err(|e| e.in_op(op)),
            &mut |mine, theirs| all_to_all(mine, theirs).map_err(|e| e.in_op(op)),
        )
    }

    /// [`DeferredCheck::verify`] with its exchanges as the front end builds them for
    /// collective #`seq` under `limit` (an in-place `i64` all-reduce with `Max`, then `i64`
    /// all-gathers or an all-to-all), each handed to `run`: what [`Backend::run_check`] does by
    /// default with [`Backend::run`], and what a backend that runs them on a channel of its
    /// own passes there.
    pub fn verify_with(
        &self,
        seq: u64,
        limit: TimeLimit,
        run: &mut dyn FnMut(Validated<Op<'_>>) -> Result<()>,
    ) -> Result<()> {
        // Three closures call `run`, one at a time.
        let run = std::cell::RefCell::new(run);
        self.verify(
            &mut |both| {
                (run.borrow_mut())(Validated::new(
                    Op::AllReduceInPlace {
                        buf: BufMut::from(both),
                        op: ReduceOp::Max,
                    },
                    seq,
                    limit,
                ))
            },
            &mut |mine, all| {
                (run.borrow_mut())(Validated::new(
                    Op::AllGather {
                        send: BufRef::from(mine),
                        recv: BufMut::from(all),
                    },
                    seq,
                    limit,
                ))
            },
            &mut |mine, theirs| {
                (run.borrow_mut())(Validated::new(
                    Op::AllToAll {
                        send: BufRef::from(mine),
                        recv: BufMut::from(theirs),
                    },
                    seq,
                    limit,
                ))
            },
        )
    }

    fn verify_fingerprints(
        &self,
        max_in_place: &mut dyn FnMut(&mut [i64]) -> Result<()>,
        all_gather: &mut GatherFn<'_>,
        all_to_all: &mut GatherFn<'_>,
    ) -> Result<()> {
        let (op, seq) = (self.op, self.seq);
        let mut both = [0i64; 2 * FIELDS];
        for (i, v) in self.fingerprint.iter().enumerate() {
            both[i] = *v;
            both[FIELDS + i] = -*v;
        }
        max_in_place(&mut both[..])?;
        if (0..FIELDS).all(|i| both[i] == -both[FIELDS + i]) {
            return match &self.exchange {
                Some((send, expect)) => {
                    self.verify_exchange(send, expect, max_in_place, all_gather, all_to_all)
                }
                None => Ok(()),
            };
        }
        let mut all = vec![0i64; FIELDS * self.size];
        all_gather(&self.fingerprint[..], &mut all[..])?;
        let (field, values) = Fingerprint::first_difference(&all).ok_or_else(|| {
            // The all-reduce saw a difference that the all-gather does not show: a rank
            // changed its fingerprint between the two, which the front end never does.
            Error::Invalid(format!(
                "{op} #{seq} on communicator '{}': the mismatch check's two exchanges disagree",
                self.comm
            ))
        })?;
        Err(Error::CollectiveMismatch {
            op,
            comm: self.comm.clone(),
            seq,
            field,
            values,
        })
    }

    /// Number of integers in a fingerprint ([`DeferredCheck::fingerprint`]).
    pub const FINGERPRINT_LEN: usize = FIELDS;

    /// The checked operation's name (a failure of the check's exchanges is a failure of it).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// This rank's fingerprint: the integers that describe the collective (operation,
    /// collective number, element type, counts, root, reduction), which a backend running the
    /// check its own way sends to every rank ([`DeferredCheck::verify_gathered`]).
    pub fn fingerprint(&self) -> &[i64] {
        &self.fingerprint
    }

    /// True when the fingerprints alone decide the check: every collective but all-to-all-v,
    /// whose per-peer counts need a second exchange ([`DeferredCheck::verify`]).
    pub fn fingerprints_suffice(&self) -> bool {
        self.exchange.is_none()
    }

    /// The check from every rank's fingerprint, gathered by the backend (`all`: rank `r`'s
    /// [`DeferredCheck::fingerprint`] at `r · FINGERPRINT_LEN`): `Ok` when they are all equal,
    /// otherwise the same [`Error::CollectiveMismatch`] as [`DeferredCheck::verify`] returns,
    /// naming the first field that differs and every rank's value. Only for checks whose
    /// fingerprints suffice ([`DeferredCheck::fingerprints_suffice`]); `all` of another length
    /// is an error naming both lengths.
    pub fn verify_gathered(&self, all: &[i64]) -> Result<()> {
        if !self.fingerprints_suffice() {
            return Err(Error::Invalid(format!(
                "{} #{} on communicator '{}': an all_to_all_v's check needs DeferredCheck::verify (its counts), not only the gathered fingerprints",
                self.op, self.seq, self.comm
            )));
        }
        self.compare_gathered(all)
    }

    /// The first stage of every check, from every rank's gathered fingerprint (as
    /// [`DeferredCheck::verify_gathered`]): `Ok` when they are all equal, otherwise the same
    /// [`Error::CollectiveMismatch`] on every rank. For an all-to-all-v, `Ok` says only that
    /// every rank runs the same all-to-all-v: its counts still need [`DeferredCheck::verify`].
    /// `all` of another length is an error naming both lengths.
    pub fn compare_gathered(&self, all: &[i64]) -> Result<()> {
        let (op, seq) = (self.op, self.seq);
        if all.len() != FIELDS * self.size {
            return Err(Error::Invalid(format!(
                "{op} #{seq} on communicator '{}': the mismatch check got {} gathered integers, expected {} ({} ranks of {FIELDS})",
                self.comm,
                all.len(),
                FIELDS * self.size,
                self.size,
            )));
        }
        match Fingerprint::first_difference(all) {
            None => Ok(()),
            Some((field, values)) => Err(Error::CollectiveMismatch {
                op,
                comm: self.comm.clone(),
                seq,
                field,
                values,
            }),
        }
    }

    /// The second stage of an all-to-all-v's check (see [`DeferredCheck::verify`]).
    fn verify_exchange(
        &self,
        send: &[i64],
        expect: &[i64],
        max_in_place: &mut dyn FnMut(&mut [i64]) -> Result<()>,
        all_gather: &mut GatherFn<'_>,
        all_to_all: &mut GatherFn<'_>,
    ) -> Result<()> {
        let mut got = vec![0i64; self.size];
        all_to_all(send, &mut got[..])?;
        // This rank's verdict: the first peer whose count differs, what it sends, what this
        // rank expects; -1s when every count agrees.
        let verdict = got
            .iter()
            .zip(expect)
            .enumerate()
            .find(|(_, (g, e))| g != e)
            .map_or([-1, -1, -1], |(peer, (g, e))| [int(peer), *g, *e]);
        let mut any = [verdict[0]];
        max_in_place(&mut any[..])?;
        if any[0] < 0 {
            return Ok(());
        }
        let mut all = vec![0i64; 3 * self.size];
        all_gather(&verdict[..], &mut all[..])?;
        let values = all
            .chunks_exact(3)
            .enumerate()
            .map(|(rank, v)| {
                let text = if v[0] < 0 {
                    "agrees".to_string()
                } else {
                    format!(
                        "expects {} elements from rank {}, which sends {}",
                        v[2], v[0], v[1]
                    )
                };
                (rank, text)
            })
            .collect();
        Err(Error::CollectiveMismatch {
            op: self.op,
            comm: self.comm.clone(),
            seq: self.seq,
            field: "the counts each rank sends and receives",
            values,
        })
    }
}

#[cfg(test)]
impl DeferredCheck {
    /// The check of collective `op` #5 on communicator "world" of `size` ranks, with `count`
    /// elements of `dtype` on this rank (tests of the backends' own forms of the check).
    pub(crate) fn for_test(op: &'static str, dtype: DType, count: usize, size: usize) -> Self {
        DeferredCheck {
            op,
            comm: "world".into(),
            seq: 5,
            size,
            fingerprint: Fingerprint::new(op, Some(dtype), (count, count), None, None).0,
            exchange: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_name_the_first_differing_field_and_every_rank() {
        let a = Fingerprint::new(
            "all_reduce",
            Some(DType::F32),
            (4, 4),
            None,
            Some(ReduceOp::Sum),
        );
        let b = Fingerprint::new(
            "all_reduce",
            Some(DType::I32),
            (4, 4),
            None,
            Some(ReduceOp::Max),
        );
        let all = [a.0, a.0, b.0].concat();
        let (field, values) = Fingerprint::first_difference(&all).unwrap();
        assert_eq!(field, "dtype");
        assert_eq!(
            values,
            vec![(0, "f32".into()), (1, "f32".into()), (2, "i32".into())]
        );
        assert_eq!(describe_values(&values), "ranks 0, 1: f32, rank 2: i32");
        assert_eq!(Fingerprint::first_difference(&[a.0, a.0].concat()), None);
        let bar = Fingerprint::new("barrier", None, (0, 0), None, None);
        let (field, values) = Fingerprint::first_difference(&[a.0, bar.0].concat()).unwrap();
        assert_eq!(field, "operation");
        assert_eq!(
            describe_values(&values),
            "rank 0: all_reduce, rank 1: barrier"
        );
        let r0 = Fingerprint::new("broadcast", Some(DType::U8), (8, 8), Some(0), None);
        let r1 = Fingerprint::new("broadcast", Some(DType::U8), (8, 8), Some(1), None);
        let (field, values) = Fingerprint::first_difference(&[r0.0, r1.0].concat()).unwrap();
        assert_eq!(
            (field, describe_values(&values).as_str()),
            ("root", "rank 0: 0, rank 1: 1")
        );
    }

    /// An in-place all-gather or reduce-scatter fingerprints (and counts bytes) exactly as its
    /// out-of-place form with the same counts; another count differs in `count`.
    #[test]
    fn in_place_forms_fingerprint_as_their_out_of_place_forms() {
        let fp = |op: &Op<'_>| {
            let (p, bytes) = Fingerprint::of_op(op, 4).unwrap();
            (p.fingerprint(), bytes)
        };
        let block = [0i32; 3];
        let mut whole = [0i32; 12];
        let mut other = [0i32; 12];
        let gather = fp(&Op::AllGather {
            send: BufRef::from(&block[..]),
            recv: BufMut::from(&mut whole[..]),
        });
        assert_eq!(
            gather,
            fp(&Op::AllGatherInPlace {
                buf: BufMut::from(&mut other[..])
            })
        );
        let mut bigger = [0i32; 16];
        let (f, _) = Fingerprint::of_op(
            &Op::AllGatherInPlace {
                buf: BufMut::from(&mut bigger[..]),
            },
            4,
        )
        .unwrap();
        let all = [gather.0 .0, f.fingerprint().0].concat();
        let (field, values) = Fingerprint::first_difference(&all).unwrap();
        assert_eq!(
            (field, describe_values(&values)),
            ("count", "rank 0: 3, rank 1: 4".into())
        );
        let scatter = fp(&Op::ReduceScatter {
            send: BufRef::from(&whole[..]),
            recv: BufMut::from(&mut [0i32; 3][..]),
            op: ReduceOp::Max,
        });
        assert_eq!(
            scatter,
            fp(&Op::ReduceScatterInPlace {
                buf: BufMut::from(&mut other[..]),
                op: ReduceOp::Max
            })
        );
        let r = Request::ReduceScatterInPlace {
            buf: vec![0i32; 12].into(),
            op: ReduceOp::Max,
        };
        let (p, bytes) = Fingerprint::of_request(&r, 4).unwrap();
        assert_eq!((p.fingerprint(), bytes), scatter);
    }

    #[test]
    fn modes_round_trip_and_thresholds_count_the_larger_buffer() {
        for m in [
            MismatchCheck::Off,
            MismatchCheck::All,
            MismatchCheck::Above(1),
            MismatchCheck::Above(65536),
        ] {
            assert_eq!(MismatchCheck::decode(m.encode()), m);
        }
        let send = [0f64; 3];
        let mut recv = [0f64; 6];
        let (_, bytes) = Fingerprint::of_op(
            &Op::AllGather {
                send: BufRef::from(&send[..]),
                recv: BufMut::from(&mut recv[..]),
            },
            2,
        )
        .unwrap();
        assert_eq!(bytes, 48);
        assert!(Fingerprint::of_op(
            &Op::Send {
                buf: BufRef::from(&send[..]),
                peer: 1,
                tag: 0
            },
            2
        )
        .is_none());
        assert_eq!(Fingerprint::of_request(&Request::Barrier, 2).unwrap().1, 0);
    }
}
