//! [`GlooBackend`]: the front end's [`Backend`] over one Gloo context, and
//! [`GlooCommunicator`], the communicator users hold (`Comm<GlooBackend>`).

use crate::exec::{panic_message, worker_gone, Completion, GlooWork, Sequencer};
use crate::ffi::{
    AllreduceAlgorithm, Channel, P2pMismatch, RawContext, RawOp, RawP2p, ReduceScatterAlgorithm,
    ShimCode, ShimError, P2P_INLINE_MAX,
};
use grid_core::{
    kernels, Backend, Comm, DType, DeferredCheck, Error, HostBuffer, HostSlice, HostSliceMut,
    LibraryError, Memory, MismatchCheck, Op, P2pOp, ReceivePlacement, ReduceOp, Request, Result,
    Tensor, Validated, Work,
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod check;
mod oneshot;
mod vops;

use grid_core::comm::round::{self, RoundOp};
pub use oneshot::{ONE_ROUND_ENV, ONE_ROUND_MAX};

const BACKEND: &str = "gloo";
/// The failure recorded by [`GlooBackend::abort`].
const ABORTED: &str = "aborted by the user";

/// A communicator over one group of ranks, backed by one Gloo context (a full mesh of TCP
/// connections between the members): the front end ([`grid_core::Comm`]) over [`GlooBackend`].
/// Created by [`crate::GlooFactory`]; its name ([`grid_core::Communicator::name`]) is the store
/// key prefix of its rendezvous (`w0` for the first world, `w0/s3/c1` for colour 1 of the fourth
/// split of it).
///
/// * The front end validates every call (dtypes, lengths, roots, peers, tags, memory) with
///   typed errors before Gloo sees it, numbers it and opens its `tracing` span.
/// * Collectives run in call order on every rank: blocking ones on the caller's thread,
///   nonblocking ones ([`grid_core::Communicator::start`]) on a worker thread of this
///   communicator (created on first use), interleaved in the order they were called.
/// * All-reduce in place ([`grid_core::CommunicatorExt::all_reduce_in_place`], `iall_reduce`)
///   hands the buffer itself to Gloo as its output with no input, which Gloo reduces in place:
///   no copy. Out of place, Gloo reads the input and writes the output.
/// * Point-to-point operations are posted at once (Gloo's unbound buffers), so `isend`/`irecv`
///   pairs in any order cannot deadlock; they complete when the peer matches them.
/// * A receive gets exactly its buffer's length of its element type, or an error: every
///   message carries its element type and count (messages up to 64 KiB travel with this header
///   in one Gloo message, copied once on each side; larger ones as the header and then the
///   payload straight from and into the callers' memory). A message of another length or
///   element type is consumed and discarded, the receive buffer is left unchanged, and the
///   receive returns [`Error::Library`] of class `"message mismatch"` naming the sender (rank
///   and world rank), the tag, both element types and counts and what would be valid. The
///   receiver of a message of more than 64 KiB answers its sender (the answer travels beside
///   the payload: no extra round trip), so that send fails too, with the same class of error
///   naming the receiver; a smaller send completes (as MPI's does: waiting for an answer would
///   double its latency). The communicator remains usable. No message
///   longer than the memory posted for it ever reaches Gloo (whose check would terminate the
///   process).
/// * Every collective is checked by default ([`MismatchCheck::All`], see
///   [`Backend::mismatch_check_default`]): ranks that disagree on a collective's operation,
///   count, element type, root or reduction, or a rank that skipped one, get
///   [`Error::CollectiveMismatch`] on every rank before Gloo sees the collective. A nonblocking
///   collective is checked on the communicator's worker right before it runs
///   ([`Backend::checks_when_run`]): `start` returns at once, and a disagreement fails its
///   `wait`. `GRID_DEBUG=off` or `set_mismatch_check(MismatchCheck::Off)` turns the
///   check off; a disagreement can then terminate the process (libgloo throws on its transport
///   thread) or return wrong data on other ranks.
/// * Every operation is bounded by the communicator's timeout ([`crate::GlooConfig::timeout`]).
///   After a timeout or a lost peer the communicator is unusable (Gloo closes its connections):
///   later calls return [`Error::Finalized`].
/// * All seven dtypes and all reductions are supported, with grid-core's host kernels
///   ([`grid_core::kernels`]) as Gloo's reduction function: integers wrap on overflow, f16 and
///   bf16 are combined in f32 and rounded to nearest even at every step of Gloo's algorithm
///   (their partial results travel as f16/bf16), and `Avg` is the sum divided by the size
///   ([`grid_core::kernels::divide`]: rounded for floats, truncated toward zero for integers;
///   i32 and u8 averages sum in i64, so they are exact, as in the kernels and on MPI).
///   Only host memory is accepted.
///
/// ```
/// use backend_gloo::{run_ranks, GlooConfig};
/// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
///
/// let sums = run_ranks(2, &GlooConfig::new("doc-comm"), |_factory, world| {
///     let mut out = [0i64; 2];
///     world.all_reduce_into(&[world.rank() as i64, 1], &mut out, ReduceOp::Sum)?;
///     let mut v = [world.rank() as f32 + 1.0; 3];
///     world.all_reduce_in_place(&mut v, ReduceOp::Max)?; // no copy
///     assert_eq!(v, [2.0; 3]);
///     Ok(out)
/// })
/// .unwrap();
/// assert!(sums.iter().all(|r| r.as_ref().unwrap() == &[1, 2]));
/// ```
pub type GlooCommunicator = Comm<GlooBackend>;

/// The Gloo backend of one communicator: executes operations that the front end validated.
/// Reached from a [`GlooCommunicator`] through `Deref` (`comm.abort()`, `comm.timeout()`) or
/// `comm.inner()`.
pub struct GlooBackend {
    inner: Arc<Inner>,
    worker: Mutex<Option<Sender<Job>>>,
}

impl std::fmt::Debug for GlooBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlooBackend")
            .field("name", &self.inner.name)
            .field("rank", &self.inner.ctx.rank())
            .field("size", &self.inner.ctx.size())
            .field("global_ranks", &self.inner.global_ranks)
            .finish()
    }
}

struct Job {
    ticket: u64,
    request: Request,
    limit: Duration,
    /// The mismatch check to run, in turn, right before the collective.
    check: Option<DeferredCheck>,
    done: Arc<Completion>,
}

pub(crate) struct Inner {
    ctx: RawContext,
    global_ranks: Vec<usize>,
    name: String,
    timeout: Duration,
    allreduce: AllreduceAlgorithm,
    reduce_scatter: ReduceScatterAlgorithm,
    /// Largest payload of a one-round collective's message (`comm/oneshot.rs`).
    one_round_max: usize,
    seq: Sequencer,
    failure: Mutex<Option<String>>,
    splits: AtomicU64,
    /// The unique name its sub-groups' store prefixes start with (the factory's internal
    /// name; `name` may be a group name that several communicators share).
    store_name: String,
    /// Failure records and blame (`crate::blame`); touched only after a failure.
    blame: Option<crate::blame::Blame>,
    /// The memory of the one-round collectives, kept between calls so that a round in a loop
    /// allocates nothing and touches no fresh pages (`comm/oneshot.rs`).
    rounds: Mutex<round::Memory>,
}

/// The time limit of one operation as Gloo takes it: no limit is the shim's longest timeout
/// ([`crate::ffi::NO_LIMIT`], which every duration handed to the shim is clamped to).
fn op_limit(limit: grid_core::TimeLimit) -> Duration {
    limit
        .duration()
        .unwrap_or(crate::ffi::NO_LIMIT)
        .min(crate::ffi::NO_LIMIT)
}

fn raw_op(op: ReduceOp) -> RawOp {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => RawOp::Sum,
        ReduceOp::Prod => RawOp::Prod,
        ReduceOp::Min => RawOp::Min,
        ReduceOp::Max => RawOp::Max,
    }
}

/// The trait's error for a shim failure of `op` on communicator `comm` (members
/// `global_ranks`, operation time limit `timeout`): see [`Inner::fail`].
fn to_error(
    op: &'static str,
    e: ShimError,
    comm: &str,
    global_ranks: &[usize],
    timeout: Duration,
) -> Error {
    let world = |p: usize| global_ranks.get(p).copied().unwrap_or(p);
    match (e.code, e.peer) {
        (ShimCode::Invalid, _) => Error::Invalid(format!("{op}: {}", e.message)),
        (ShimCode::Aborted, _) => Error::Aborted {
            op,
            reason: e.message,
            at: None,
        },
        (_, Some(peer)) => Error::PeerFailed {
            op,
            peer,
            message: format!(
                "lost the connection to rank {peer} (world rank {}) of communicator '{comm}': {}",
                world(peer),
                e.message
            ),
            at: None,
        },
        (ShimCode::Timeout, None) => Error::Timeout {
            op,
            millis: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            peer: None,
            at: None,
        },
        (code, None) => LibraryError::new(BACKEND, op, e.message)
            .comm(comm)
            .code(code.status())
            .class(code.class())
            .into(),
    }
}

/// The class of [`Error::Library`] for a receive whose message did not match it.
pub(crate) const MESSAGE_MISMATCH: &str = "message mismatch";

/// The error of a send or receive (`op`: `send`, `recv`, or `batch_p2p` with the operation's
/// position) on communicator `comm` whose message's two sides disagreed on its element type or
/// count ([`P2pMismatch`]): [`Error::Library`] of class [`MESSAGE_MISMATCH`], naming the other
/// rank (communicator and world rank), the tag, both element types and counts, and what would
/// be valid. The message was consumed, so the communicator stays usable.
fn message_mismatch(
    op: &'static str,
    m: &P2pMismatch,
    batch: bool,
    comm: &str,
    global_ranks: &[usize],
) -> Error {
    let world = global_ranks.get(m.peer).copied().unwrap_or(m.peer);
    let (posted, sent) = (m.posted, m.sent);
    let (peer, tag) = (m.peer, m.tag);
    let which = |what: &str| {
        if batch {
            format!("{what} #{} of the batch", m.index)
        } else {
            format!("this {what}")
        }
    };
    let framing = |h: u64| {
        if h == 0 {
            "a plain message (no header)".to_string()
        } else {
            format!("a framed message with a header of {h} bytes")
        }
    };
    let message = if m.heads.0 != m.heads.1 {
        let (mine, theirs) = if m.is_recv {
            (m.heads.0, m.heads.1)
        } else {
            (m.heads.1, m.heads.0)
        };
        format!(
            "rank {peer} (world rank {world}) and {} disagree on the form of the message with tag {tag}: this rank's is {}, rank {peer}'s is {}; both sides must frame a message alike (a framed send for a framed receive with the same header length, a plain send for a plain receive); the message was discarded, no buffer was written and the communicator remains usable",
            which(if m.is_recv { "receive" } else { "send" }),
            framing(mine),
            framing(theirs),
        )
    } else if m.is_recv {
        // A sender of more than P2P_INLINE_MAX bytes gets this rank's answer and fails too.
        let bytes = sent.1.saturating_mul(sent.0.size_bytes() as u64);
        let sender = if bytes > P2P_INLINE_MAX as u64 {
            "the sender's send fails too"
        } else {
            "the sender's send completed"
        };
        format!(
            "rank {peer} (world rank {world}) sent {} {} elements with tag {tag}, but {} posted {} {} elements: a receive must post the message's element type and count (here {} {}), or the sender must send {} {}; the message was discarded, the receive buffer is unchanged, {sender} and the communicator remains usable",
            sent.1, sent.0, which("receive"), posted.1, posted.0, sent.1, sent.0, posted.1, posted.0,
        )
    } else {
        format!(
            "rank {peer} (world rank {world}) posted a receive of {} {} elements with tag {tag} for {} of {} {} elements: the receive must post the message's element type and count (here {} {}), or this rank must send {} {}; the receiver discarded the message and the communicator remains usable",
            posted.1, posted.0, which("send"), sent.1, sent.0, sent.1, sent.0, posted.1, posted.0,
        )
    };
    LibraryError::new(BACKEND, op, message)
        .comm(comm)
        .class(MESSAGE_MISMATCH)
        .into()
}

/// For an `Avg` of i32 or u8, `input` widened to i64 (the sum of any number of such values
/// fits, so the mean is exact before truncation, as `grid_core::kernels` defines it); `None`
/// for every other dtype and reduction, which Gloo reduces in the type itself.
fn widened_average(input: HostSlice<'_>, op: ReduceOp) -> Option<HostBuffer> {
    if op != ReduceOp::Avg {
        return None;
    }
    match input {
        HostSlice::I32(s) => Some(HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())),
        HostSlice::U8(s) => Some(HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())),
        _ => None,
    }
}

/// Writes the means of [`widened_average`] back in the narrow type (they fit: a mean of values
/// of a type lies within the type).
fn narrow(op: &'static str, wide: HostSlice<'_>, out: HostSliceMut<'_>) -> Result<()> {
    match (wide, out) {
        (HostSlice::I64(w), HostSliceMut::I32(o)) => {
            o.iter_mut().zip(w).for_each(|(o, &w)| *o = w as i32)
        }
        (HostSlice::I64(w), HostSliceMut::U8(o)) => {
            o.iter_mut().zip(w).for_each(|(o, &w)| *o = w as u8)
        }
        (w, o) => {
            return Err(Error::DTypeMismatch {
                op,
                expected: o.dtype(),
                actual: w.dtype(),
            })
        }
    }
    Ok(())
}

impl Inner {
    fn size(&self) -> usize {
        self.ctx.size()
    }

    fn rank(&self) -> usize {
        self.ctx.rank()
    }

    /// `Err(Finalized)` after [`GlooBackend::abort`] or a communication failure. The front end
    /// calls it before every operation ([`Backend::check_live`]); collectives call it again
    /// when their turn comes, since an operation queued before them may have failed meanwhile.
    fn alive(&self, op: &'static str) -> Result<()> {
        match &*self.failure.lock().unwrap_or_else(|e| e.into_inner()) {
            None => Ok(()),
            Some(m) if m == ABORTED => Err(Error::Finalized {
                op,
                state: "aborted",
            }),
            Some(_) => Err(Error::Finalized {
                op,
                state: "aborted by an earlier failure (a timeout or a lost peer)",
            }),
        }
    }

    /// Maps a shim failure to the trait's error and, unless the shim rejected an argument before
    /// communicating, marks the communicator failed.
    ///
    /// A lost peer becomes [`Error::PeerFailed`] (naming the peer and its world rank), a timeout
    /// [`Error::Timeout`], and every other failure [`Error::Library`] with the operation, this
    /// communicator's name, the shim's status code and the class of the C++ exception.
    fn fail(&self, op: &'static str, e: ShimError) -> Error {
        self.fail_after(op, e, self.timeout)
    }

    /// True once [`GlooBackend::abort`] marked this context aborted.
    fn was_aborted(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_deref()
            == Some(ABORTED)
    }

    /// [`Inner::fail`] for an operation whose time limit was `limit`.
    fn fail_after(&self, op: &'static str, e: ShimError, limit: Duration) -> Error {
        if e.code != ShimCode::Invalid && self.was_aborted() {
            // Woken by this rank's own abort(): nobody else to blame, and no reason to wait
            // for the others' failure records.
            return Error::Aborted {
                op,
                reason: format!(
                    "the communicator was aborted on this rank (abort() was called); Gloo reported: {}",
                    e.message
                ),
                at: None,
            };
        }
        if e.code != ShimCode::Invalid {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some(format!("{op}: {}", e.message));
            }
            tracing::warn!(communicator = %self.name, op, code = ?e.code, peer = ?e.peer, message = %e.message, "gloo operation failed");
        }
        match &self.blame {
            // The rank that failed first, found through the failure records in the store.
            Some(b) => {
                let err = to_error(op, e.clone(), &self.name, &self.global_ranks, limit);
                b.apply(op, &e, err, limit, || self.ctx.close(), &|| {
                    self.was_aborted()
                })
            }
            None => to_error(op, e, &self.name, &self.global_ranks, limit),
        }
    }

    /// A failure of this crate's own machinery (a thread that cannot start, a panic), as
    /// [`Error::Library`] naming the operation and the communicator.
    fn internal(&self, op: &'static str, message: String) -> Error {
        LibraryError::new(BACKEND, op, message)
            .comm(self.name.as_str())
            .into()
    }

    // ---- the collectives (arguments validated by the front end, turn held) ------------------

    /// `send = None`: in place on `recv` (Gloo gets no input and reduces its output buffer).
    fn all_reduce(
        &self,
        check: Option<&DeferredCheck>,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let small = RoundOp::AllReduce {
            send,
            recv: recv.reborrow(),
            op,
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        if let Some(wide) = widened_average(send.unwrap_or(recv.as_slice()), op) {
            // An i32 or u8 average sums in i64 (grid_core::kernels' rule): the conversion is
            // the staging, and the wide buffer is reduced in place.
            let mut wide = wide;
            self.ctx
                .allreduce_in_place(wide.as_mut_slice(), RawOp::Sum, self.allreduce, tag, limit)
                .map_err(|e| self.fail_after(OP, e, limit))?;
            kernels::divide(wide.as_mut_slice(), self.size());
            return narrow(OP, wide.as_slice(), recv);
        }
        let raw = raw_op(op);
        let r = match send {
            Some(s) => self
                .ctx
                .allreduce(s, recv.reborrow(), raw, self.allreduce, tag, limit),
            None => self
                .ctx
                .allreduce_in_place(recv.reborrow(), raw, self.allreduce, tag, limit),
        };
        r.map_err(|e| self.fail_after(OP, e, limit))?;
        if op == ReduceOp::Avg {
            kernels::divide(recv, self.size());
        }
        Ok(())
    }

    fn broadcast(
        &self,
        check: Option<&DeferredCheck>,
        mut buf: HostSliceMut<'_>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "broadcast";
        let small = RoundOp::Broadcast {
            buf: buf.reborrow(),
            root,
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        self.ctx
            .broadcast(buf, root, tag, limit)
            .map_err(|e| self.fail_after(OP, e, limit))
    }

    fn all_gather(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let small = RoundOp::AllGather {
            send: Some(send),
            recv: recv.reborrow(),
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        self.ctx
            .allgather(send, recv, tag, limit)
            .map_err(|e| self.fail_after(OP, e, limit))
    }

    fn reduce_scatter(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let small = RoundOp::ReduceScatter {
            send: Some(send),
            recv: recv.reborrow(),
            op,
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        if self.reduce_scatter == ReduceScatterAlgorithm::Direct {
            let counts = vec![recv.len(); self.size()];
            return self.reduce_scatter_blocks(OP, send, &counts, recv, op, tag, limit);
        }
        self.alive(OP)?;
        if let Some(wide) = widened_average(send, op) {
            // As in all_reduce: an i32 or u8 average sums in i64.
            let mut block = HostBuffer::zeros(DType::I64, recv.len());
            self.ctx
                .reduce_scatter_with(
                    wide.as_slice(),
                    block.as_mut_slice(),
                    RawOp::Sum,
                    self.reduce_scatter,
                    self.allreduce,
                    tag,
                    limit,
                )
                .map_err(|e| self.fail_after(OP, e, limit))?;
            kernels::divide(block.as_mut_slice(), self.size());
            return narrow(OP, block.as_slice(), recv);
        }
        self.ctx
            .reduce_scatter_with(
                send,
                recv.reborrow(),
                raw_op(op),
                self.reduce_scatter,
                self.allreduce,
                tag,
                limit,
            )
            .map_err(|e| self.fail_after(OP, e, limit))?;
        if op == ReduceOp::Avg {
            kernels::divide(recv, self.size());
        }
        Ok(())
    }

    /// All-gather in place: Gloo gets no input and reads this rank's block from `buf`.
    fn all_gather_in_place(
        &self,
        check: Option<&DeferredCheck>,
        mut buf: HostSliceMut<'_>,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let small = RoundOp::AllGather {
            send: None,
            recv: buf.reborrow(),
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        self.ctx
            .allgather_in_place(buf, tag, limit)
            .map_err(|e| self.fail_after(OP, e, limit))
    }

    /// Reduce-scatter in place: this rank's block lands at `rank · k` of `buf`. With the
    /// default algorithm ([`ReduceScatterAlgorithm::Direct`], which would need scratch memory
    /// for `n - 1` blocks here) and with [`ReduceScatterAlgorithm::Allreduce`] the whole buffer
    /// is all-reduced in place (no scratch buffer, no copy: what in place is for; the other
    /// blocks then hold the other ranks' results); the ring writes the block straight into
    /// `buf`; halving-doubling stages a copy as it always does. i32 and u8 averages are summed in i64 (the conversion is the
    /// staging) and the block narrowed back.
    fn reduce_scatter_in_place(
        &self,
        check: Option<&DeferredCheck>,
        mut buf: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let small = RoundOp::ReduceScatter {
            send: None,
            recv: buf.reborrow(),
            op,
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        let k = buf.len() / self.size().max(1);
        let at = self.rank() * k;
        if let Some(mut wide) = widened_average(buf.as_slice(), op) {
            self.scatter_in_place(wide.as_mut_slice(), RawOp::Sum, tag, limit)?;
            let mut w = wide.as_mut_slice();
            let mut mine = self.block(OP, &mut w, at, k)?;
            kernels::divide(mine.reborrow(), self.size());
            return narrow(OP, mine.as_slice(), self.block(OP, &mut buf, at, k)?);
        }
        self.scatter_in_place(buf.reborrow(), raw_op(op), tag, limit)?;
        if op == ReduceOp::Avg {
            kernels::divide(self.block(OP, &mut buf, at, k)?, self.size());
        }
        Ok(())
    }

    /// Elements `at..at + k` of `s` (an internal error when out of bounds, which the front
    /// end's validation rules out).
    fn block<'s>(
        &self,
        op: &'static str,
        s: &'s mut HostSliceMut<'_>,
        at: usize,
        k: usize,
    ) -> Result<HostSliceMut<'s>> {
        let len = s.len();
        s.sub_mut(at, k).ok_or_else(|| {
            self.internal(
                op,
                format!("block {at}..+{k} of {len} elements out of bounds"),
            )
        })
    }

    /// The in-place reduce-scatter of [`Inner::reduce_scatter_in_place`] with the library's
    /// reduction `op` (averages divided by the caller).
    fn scatter_in_place(
        &self,
        buf: HostSliceMut<'_>,
        op: RawOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let r = match self.reduce_scatter {
            ReduceScatterAlgorithm::Allreduce | ReduceScatterAlgorithm::Direct => self
                .ctx
                .allreduce_in_place(buf, op, self.allreduce, tag, limit),
            algorithm => self.ctx.reduce_scatter_in_place_with(
                buf,
                op,
                algorithm,
                self.allreduce,
                tag,
                limit,
            ),
        };
        r.map_err(|e| self.fail_after(OP, e, limit))
    }

    fn all_to_all(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let small = RoundOp::AllToAll {
            send,
            recv: recv.reborrow(),
        };
        if self.one_shot(check, small, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        self.ctx
            .alltoall(send, recv, tag, limit)
            .map_err(|e| self.fail_after(OP, e, limit))
    }

    fn barrier(&self, check: Option<&DeferredCheck>, tag: u32, limit: Duration) -> Result<()> {
        const OP: &str = "barrier";
        if self.one_shot(check, RoundOp::Barrier, tag, limit)? {
            return Ok(());
        }
        self.alive(OP)?;
        self.ctx
            .barrier(tag, limit)
            .map_err(|e| self.fail_after(OP, e, limit))
    }

    /// Runs the mismatch check's exchanges where one round of fingerprints does not decide it
    /// (more than [`check::DIRECT_MAX`] ranks, or an all-to-all-v's counts): its turn held,
    /// right before the collective, with the collective's tag, every exchange on the check's
    /// slots (the exchanges and the collective follow each other on every rank in the same
    /// order).
    fn verify(&self, check: &DeferredCheck, tag: u32, limit: Duration) -> Result<()> {
        let on_check = Channel::Check;
        check.verify(
            &mut |both| self.check_max(both, tag, limit),
            &mut |mine, all| {
                let send = Some(HostSlice::I64(mine));
                let c = RoundOp::AllGather {
                    send,
                    recv: HostSliceMut::I64(all),
                };
                self.round(on_check, None, "all_gather", c, tag, limit)
            },
            &mut |mine, theirs| {
                let send = HostSlice::I64(mine);
                let c = RoundOp::AllToAll {
                    send,
                    recv: HostSliceMut::I64(theirs),
                };
                self.round(on_check, None, "all_to_all", c, tag, limit)
            },
        )
    }

    /// Runs a nonblocking collective (on the worker, its turn held) and returns its result buffer.
    fn exec(
        &self,
        request: Request,
        check: Option<&DeferredCheck>,
        tag: u32,
        limit: Duration,
    ) -> Result<Tensor> {
        let op = request.name();
        // Host memory: the front end accepted nothing else, so this cannot fail.
        fn h<'t>(op: &'static str, t: &'t mut Tensor) -> Result<HostSliceMut<'t>> {
            t.as_mut().host_only(op, BACKEND)
        }
        match request {
            Request::AllReduce { mut buf, op: r } => {
                self.all_reduce(check, None, h(op, &mut buf)?, r, tag, limit)?;
                Ok(buf)
            }
            Request::AllReduceInto {
                mut send,
                mut recv,
                op: r,
            } => {
                self.all_reduce(
                    check,
                    Some(h(op, &mut send)?.as_slice()),
                    h(op, &mut recv)?,
                    r,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::Broadcast { mut buf, root } => {
                self.broadcast(check, h(op, &mut buf)?, root, tag, limit)?;
                Ok(buf)
            }
            Request::AllGather { mut send, mut recv } => {
                self.all_gather(
                    check,
                    h(op, &mut send)?.as_slice(),
                    h(op, &mut recv)?,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::ReduceScatter {
                mut send,
                mut recv,
                op: r,
            } => {
                self.reduce_scatter(
                    check,
                    h(op, &mut send)?.as_slice(),
                    h(op, &mut recv)?,
                    r,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::AllToAll { mut send, mut recv } => {
                self.all_to_all(
                    check,
                    h(op, &mut send)?.as_slice(),
                    h(op, &mut recv)?,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::AllGatherInPlace { mut buf } => {
                self.all_gather_in_place(check, h(op, &mut buf)?, tag, limit)?;
                Ok(buf)
            }
            Request::ReduceScatterInPlace { mut buf, op: r } => {
                self.reduce_scatter_in_place(check, h(op, &mut buf)?, r, tag, limit)?;
                Ok(buf)
            }
            Request::Barrier => {
                self.barrier(check, tag, limit)?;
                Ok(Tensor::Host(HostBuffer::zeros(DType::U8, 0)))
            }
            Request::Send { .. } | Request::Recv { .. } => Err(self.internal(
                op,
                "point-to-point requests are posted directly, never queued on the worker".into(),
            )),
            Request::AllToAllV {
                mut send,
                send_counts,
                mut recv,
                recv_counts,
            } => {
                self.all_to_all_v(
                    check,
                    h(op, &mut send)?.as_slice(),
                    &send_counts,
                    h(op, &mut recv)?,
                    &recv_counts,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::AllGatherV {
                mut send,
                mut recv,
                recv_counts,
            } => {
                self.all_gather_v(
                    check,
                    h(op, &mut send)?.as_slice(),
                    h(op, &mut recv)?,
                    &recv_counts,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            Request::ReduceScatterV {
                mut send,
                send_counts,
                mut recv,
                op: r,
            } => {
                self.reduce_scatter_v(
                    check,
                    h(op, &mut send)?.as_slice(),
                    &send_counts,
                    h(op, &mut recv)?,
                    r,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
            // Rooted: the root's result, or the caller's send buffer back elsewhere.
            Request::Reduce {
                mut send,
                recv,
                op: r,
                root,
            } => {
                let mut recv = recv.filter(|_| self.rank() == root);
                let out = recv.as_mut().map(|t| h(op, t)).transpose()?;
                self.reduce(
                    check,
                    h(op, &mut send)?.as_slice(),
                    out,
                    r,
                    root,
                    tag,
                    limit,
                )?;
                Ok(recv.unwrap_or(send))
            }
            Request::Gather {
                mut send,
                recv,
                root,
            } => {
                let mut recv = recv.filter(|_| self.rank() == root);
                let out = recv.as_mut().map(|t| h(op, t)).transpose()?;
                self.gather(check, h(op, &mut send)?.as_slice(), out, root, tag, limit)?;
                Ok(recv.unwrap_or(send))
            }
            Request::Scatter {
                send,
                mut recv,
                root,
            } => {
                let mut send = send.filter(|_| self.rank() == root);
                let src = send.as_mut().map(|t| h(op, t)).transpose()?;
                self.scatter(
                    check,
                    src.as_ref().map(|s| s.as_slice()),
                    h(op, &mut recv)?,
                    root,
                    tag,
                    limit,
                )?;
                Ok(recv)
            }
        }
    }

    /// Blocking point-to-point operations, posted together and waited for within the timeout.
    fn p2p(&self, op: &'static str, ops: &mut [RawP2p<'_>], limit: Duration) -> Result<()> {
        self.alive(op)?;
        let mismatches = self
            .ctx
            .p2p(ops, limit)
            .map_err(|e| self.fail_after(op, e, limit))?;
        match mismatches.first() {
            None => Ok(()),
            Some(m) => Err(self.mismatch(op, m, ops.len() > 1)),
        }
    }

    /// The error of a message whose two sides disagreed (see [`message_mismatch`]); the
    /// communicator is not marked failed.
    fn mismatch(&self, op: &'static str, m: &P2pMismatch, batch: bool) -> Error {
        tracing::warn!(communicator = %self.name, op, peer = m.peer, tag = m.tag, posted = ?m.posted, sent = ?m.sent, is_recv = m.is_recv, "the two sides of a message disagreed on its element type or count");
        message_mismatch(op, m, batch, &self.name, &self.global_ranks)
    }
}

fn worker_loop(inner: Arc<Inner>, rx: Receiver<Job>) {
    for job in rx {
        let turn = inner.seq.turn(job.ticket);
        let tag = turn.tag();
        let op = job.request.name();
        let r = catch_unwind(AssertUnwindSafe(|| {
            inner.exec(job.request, job.check.as_ref(), tag, job.limit)
        }));
        // Complete before releasing the turn, so that `synchronize` (which waits for the turns)
        // sees every earlier operation completed.
        job.done.complete(r.unwrap_or_else(|p| {
            Err(inner.internal(
                op,
                format!("the operation panicked: {}", panic_message(&*p)),
            ))
        }));
        drop(turn);
    }
}

impl GlooBackend {
    pub(crate) fn new(
        ctx: RawContext,
        global_ranks: Vec<usize>,
        name: String,
        timeout: Duration,
        allreduce: AllreduceAlgorithm,
        reduce_scatter: ReduceScatterAlgorithm,
        one_round_max: usize,
    ) -> GlooBackend {
        GlooBackend {
            inner: Arc::new(Inner {
                ctx,
                global_ranks,
                name,
                timeout,
                allreduce,
                reduce_scatter,
                one_round_max,
                seq: Sequencer::default(),
                failure: Mutex::new(None),
                splits: AtomicU64::new(0),
                store_name: String::new(),
                blame: None,
                rounds: Mutex::new(round::Memory::default()),
            }),
            worker: Mutex::new(None),
        }
    }

    /// Makes failures of this communicator write failure records and blame the rank that
    /// failed first (`crate::blame`). Called by the factory right after [`GlooBackend::new`].
    pub(crate) fn with_blame(mut self, blame: crate::blame::Blame) -> GlooBackend {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.blame = Some(blame);
        }
        self
    }

    /// The time limit of every operation (and of the rendezvous that created it).
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig};
    /// # use std::time::Duration;
    /// let cfg = GlooConfig::new("doc-timeout").with_timeout(Duration::from_secs(7));
    /// let t = run_ranks(1, &cfg, |_f, w| Ok(w.timeout())).unwrap();
    /// assert_eq!(*t[0].as_ref().unwrap(), Duration::from_secs(7));
    /// ```
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The first failure that made this communicator unusable, if any.
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig};
    /// let f = run_ranks(1, &GlooConfig::new("doc-failure"), |_f, w| Ok(w.failure())).unwrap();
    /// assert_eq!(*f[0].as_ref().unwrap(), None);
    /// ```
    pub fn failure(&self) -> Option<String> {
        self.inner
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The underlying Gloo context, for direct calls of Gloo's algorithms without the trait
    /// layer (used by `gloo-bench` to measure the trait's overhead). Calls on it bypass this
    /// communicator's ordering: use it only while no other operation is in flight.
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig, AllreduceAlgorithm, RawOp};
    /// # use grid_core::{HostSlice, HostSliceMut};
    /// # use std::time::Duration;
    /// let r = run_ranks(2, &GlooConfig::new("doc-raw"), |_f, w| {
    ///     let mut out = [0.0f32; 2];
    ///     w.raw()
    ///         .allreduce(HostSlice::F32(&[1.0, 2.0]), HostSliceMut::F32(&mut out), RawOp::Sum,
    ///                    AllreduceAlgorithm::Ring, 7, Duration::from_secs(5))
    ///         .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
    ///     Ok(out)
    /// })
    /// .unwrap();
    /// assert_eq!(r[1].as_ref().unwrap(), &[2.0, 4.0]);
    /// ```
    pub fn raw(&self) -> &RawContext {
        &self.inner.ctx
    }

    /// The all-reduce algorithm of this communicator as configured
    /// ([`crate::GlooConfig::allreduce`], or [`crate::ALLREDUCE_ENV`] in place of
    /// [`AllreduceAlgorithm::Auto`]); [`AllreduceAlgorithm::resolve`] gives the one a call runs.
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig, AllreduceAlgorithm};
    /// let cfg = GlooConfig::new("doc-algo").with_allreduce(AllreduceAlgorithm::Bcube);
    /// let r = run_ranks(1, &cfg, |_f, w| Ok(w.allreduce_algorithm())).unwrap();
    /// assert_eq!(*r[0].as_ref().unwrap(), AllreduceAlgorithm::Bcube);
    /// ```
    pub fn allreduce_algorithm(&self) -> AllreduceAlgorithm {
        self.inner.allreduce
    }

    /// Whether Gloo's transport thread polls while libgloo's collectives run on this
    /// communicator ([`crate::GlooConfig::busy_poll`]).
    ///
    /// ```
    /// use backend_gloo::{run_ranks, GlooConfig};
    /// let cfg = GlooConfig::new("doc-busy-poll").with_busy_poll(false);
    /// let r = run_ranks(1, &cfg, |_f, w| Ok(w.busy_poll())).unwrap();
    /// assert!(!*r[0].as_ref().unwrap());
    /// ```
    pub fn busy_poll(&self) -> bool {
        self.inner.ctx.busy_poll()
    }

    /// The size (bytes of a collective's largest buffer) from which libgloo's collectives on
    /// this communicator run without busy polling: [`crate::BUSY_POLL_CROWDED_BELOW`] on a
    /// crowded communicator (every rank on this host over loopback, more ranks than this
    /// process's cores), `usize::MAX` (never) otherwise. Broadcasts also stop polling from
    /// [`crate::BROADCAST_BUSY_POLL_BELOW`] on every communicator.
    ///
    /// ```
    /// use backend_gloo::{run_ranks, GlooConfig, BUSY_POLL_CROWDED_BELOW};
    /// let cores = std::thread::available_parallelism().map_or(usize::MAX, |n| n.get());
    /// let r = run_ranks(2, &GlooConfig::new("doc-busy-poll-below"), |_f, w| Ok(w.busy_poll_below())).unwrap();
    /// let want = if 2 > cores { BUSY_POLL_CROWDED_BELOW } else { usize::MAX };
    /// assert_eq!(*r[0].as_ref().unwrap(), want);
    /// ```
    pub fn busy_poll_below(&self) -> usize {
        self.inner.ctx.busy_poll_below()
    }

    /// The backend's part of [`grid_core::Communicator::abort`] (call that one: it also marks
    /// the front end, so every later call returns [`Error::Aborted`]): marks the Gloo context
    /// aborted on this rank. Local, like `ncclCommAbort`: the peers see nothing until their
    /// own calls fail or time out.
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig};
    /// # use grid_core::{Communicator, Error};
    /// let r = run_ranks(1, &GlooConfig::new("doc-abort"), |_f, w| {
    ///     w.abort();
    ///     Ok(w.barrier().unwrap_err())
    /// })
    /// .unwrap();
    /// assert!(matches!(r[0].as_ref().unwrap(), Error::Aborted { op: "barrier", .. }));
    /// ```
    pub fn abort(&self) {
        let mut f = self.inner.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(ABORTED.to_string());
        }
    }

    /// Sets the unique name sub-groups' store prefixes start with (default: the name).
    pub(crate) fn with_store_name(mut self, store_name: String) -> GlooBackend {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.store_name = store_name;
        }
        self
    }

    /// The unique name sub-groups' store prefixes start with.
    pub(crate) fn store_name(&self) -> &str {
        if self.inner.store_name.is_empty() {
            &self.inner.name
        } else {
            &self.inner.store_name
        }
    }

    pub(crate) fn next_split(&self) -> u64 {
        self.inner.splits.fetch_add(1, Ordering::Relaxed)
    }

    fn worker(&self) -> Result<Sender<Job>> {
        let mut w = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = w.as_ref() {
            return Ok(s.clone());
        }
        let (tx, rx) = mpsc::channel();
        let inner = self.inner.clone();
        std::thread::Builder::new()
            .name(format!("gloo-{}", self.inner.name))
            .spawn(move || worker_loop(inner, rx))
            .map_err(|e| {
                self.inner.internal(
                    "start",
                    format!("cannot start the communicator's worker thread: {e}"),
                )
            })?;
        *w = Some(tx.clone());
        Ok(tx)
    }

    fn start_p2p(
        &self,
        op: &'static str,
        buf: Tensor,
        peer: usize,
        tag: u32,
        is_recv: bool,
        limit: Duration,
    ) -> Result<Box<dyn Work>> {
        let host = buf.host_only(op, BACKEND)?;
        let pending = self
            .inner
            .ctx
            .post(host, peer, tag, is_recv)
            .map_err(|(e, _)| self.inner.fail(op, e))?;
        let done = Completion::new();
        let d = done.clone();
        let inner = self.inner.clone();
        std::thread::Builder::new()
            .name(format!("gloo-{op}"))
            .spawn(move || {
                let (r, data) = pending.wait(limit);
                d.complete(match r {
                    Ok(None) => Ok(Tensor::Host(data)),
                    Ok(Some(m)) => Err(inner.mismatch(op, &m, false)),
                    Err(e) => Err(inner.fail_after(op, e, limit)),
                });
            })
            .map_err(|e| {
                self.inner.internal(
                    op,
                    format!("cannot start a thread to wait for the operation: {e}"),
                )
            })?;
        Ok(Box::new(GlooWork::new(done)))
    }

    /// A batch: messages of this rank to itself are matched here, in order, by tag (Gloo has
    /// no self-connection); the others go to Gloo together.
    fn batch(&self, ops: Vec<P2pOp<'_>>, limit: Duration) -> Result<()> {
        const OP: &str = "batch_p2p";
        let me = self.inner.rank();
        let mut remote = Vec::with_capacity(ops.len());
        // (tag, header of a framed message, data, used)
        let mut self_sends: Vec<(u32, Option<&[u8]>, HostSlice<'_>, bool)> = Vec::new();
        let mut self_recvs: Vec<(u32, Option<&mut [u8]>, HostSliceMut<'_>)> = Vec::new();
        for op in ops {
            let raw = match op {
                P2pOp::Send { buf, peer, tag } => RawP2p::Send {
                    data: buf.host_only(OP, BACKEND)?,
                    peer,
                    tag,
                    head: None,
                },
                P2pOp::SendFramed {
                    head,
                    buf,
                    peer,
                    tag,
                } => RawP2p::Send {
                    data: buf.host_only(OP, BACKEND)?,
                    peer,
                    tag,
                    head: Some(head),
                },
                P2pOp::Recv { buf, peer, tag } => RawP2p::Recv {
                    data: buf.host_only(OP, BACKEND)?,
                    peer,
                    tag,
                    head: None,
                },
                P2pOp::RecvFramed {
                    head,
                    buf,
                    peer,
                    tag,
                } => RawP2p::Recv {
                    data: buf.host_only(OP, BACKEND)?,
                    peer,
                    tag,
                    head: Some(head),
                },
            };
            match raw {
                RawP2p::Send {
                    data,
                    peer,
                    tag,
                    head,
                } if peer == me => self_sends.push((tag, head, data, false)),
                RawP2p::Recv {
                    data,
                    peer,
                    tag,
                    head,
                } if peer == me => self_recvs.push((tag, head, data)),
                other => remote.push(other),
            }
        }
        // Pairing the messages to itself is this backend's own matching: each receive takes
        // the first unused send of its tag, which must have its dtype and length, and be
        // framed with a header of the same length if the receive is framed (plain if not).
        let mut pairs = Vec::with_capacity(self_recvs.len());
        for (tag, head, dst) in self_recvs {
            let src = self_sends.iter_mut().find(|(t, .., used)| *t == tag && !*used).ok_or_else(|| {
                Error::Invalid(format!(
                    "{OP}: a receive from this rank ({me}) with tag {tag} has no matching send to itself in the batch"
                ))
            })?;
            src.3 = true;
            let framing = |h: Option<usize>| match h {
                Some(n) => format!("framed with a header of {n} bytes"),
                None => "plain".to_string(),
            };
            let (sent, posted) = (src.1.map(<[u8]>::len), head.as_deref().map(<[u8]>::len));
            if sent != posted {
                return Err(Error::Invalid(format!(
                    "{OP}: a send to this rank ({me}) with tag {tag} is {} but its receive is {}: frame both alike",
                    framing(sent),
                    framing(posted)
                )));
            }
            grid_core::comm::check::same_dtype(OP, src.2.dtype(), dst.dtype())?;
            grid_core::comm::check::len(OP, "receive from this rank", src.2.len(), dst.len())?;
            pairs.push((src.1, src.2, head, dst));
        }
        if let Some((tag, ..)) = self_sends.iter().find(|(.., used)| !*used) {
            return Err(Error::Invalid(format!(
                "{OP}: a send to this rank ({me}) with tag {tag} has no matching receive from itself in the batch"
            )));
        }
        for (src_head, src, dst_head, mut dst) in pairs {
            if let (Some(from), Some(to)) = (src_head, dst_head) {
                to.copy_from_slice(from);
            }
            dst.copy_from(src)?;
        }
        if remote.is_empty() {
            return Ok(());
        }
        self.inner.p2p(OP, &mut remote, limit)
    }
}

impl Backend for GlooBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn global_ranks(&self) -> &[usize] {
        &self.inner.global_ranks
    }

    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }

    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        // Every dtype moves; reductions run on the host through grid-core's kernels.
        grid_core::kernels::runs(dtype, op)
    }

    /// Payloads of more than [`crate::P2P_INLINE_MAX`] bytes (and collectives' messages) are
    /// read by the kernel straight into the receiver's memory, each message after libgloo's
    /// 48-byte preamble in the stream; smaller point-to-point payloads are copied out of the
    /// shim's staging buffer (glibc's `memcpy`, never slow). See [`ReceivePlacement`].
    fn receive_placement(&self) -> Option<ReceivePlacement> {
        Some(ReceivePlacement::after_framing(
            crate::ffi::TCP_PREAMBLE,
            crate::P2P_INLINE_MAX + 1,
        ))
    }

    /// A framed message is one message of the length protocol: the caller's header rides
    /// between the protocol's header and the payload (inline), or in the protocol's header
    /// message (a chunked payload).
    fn sends_framed(&self) -> bool {
        true
    }

    /// Every collective is checked by default ([`MismatchCheck::All`]): a count or element size
    /// that differs between ranks, or a rank that skips a collective, makes libgloo throw on
    /// its transport thread, which terminates the process (SIGABRT), or returns wrong data on
    /// the other ranks; the check (a maximum of 16 integers over the ranks before the
    /// collective, exchanged as messages: [`Backend::run_check`]) turns every such disagreement into [`Error::CollectiveMismatch`] on every rank first. Its cost
    /// is in docs/performance.md. `GRID_DEBUG=off` or
    /// [`grid_core::Comm::set_mismatch_check`]`(MismatchCheck::Off)` turns it off; a mismatch
    /// can then terminate the process.
    fn mismatch_check_default(&self) -> MismatchCheck {
        MismatchCheck::All
    }

    /// Gloo runs the check of a nonblocking collective on the communicator's worker, right
    /// before the collective, so `start` never blocks on the other ranks (a legal overlap, such
    /// as a rank that starts an all-reduce and then sends to a peer that starts it only after
    /// receiving, keeps working); a disagreement fails the operation's work on every rank.
    fn checks_when_run(&self, _nonblocking: bool) -> bool {
        true
    }

    fn check_live(&self, op: &'static str) -> Result<()> {
        self.inner.alive(op)
    }

    fn default_time_limit(&self) -> grid_core::TimeLimit {
        grid_core::TimeLimit::After(self.timeout())
    }
    /// Marks the context aborted, wakes every wait of this rank (point-to-point waits through
    /// Gloo's abortWait*, the waits of a collective inside Gloo's algorithms by failing every
    /// TCP pair as a lost connection would) and closes the context's connections, so that the
    /// peers blocked on this rank fail at once too.
    fn abort(&self) {
        GlooBackend::abort(self);
        self.inner.ctx.abort_waits();
        self.inner.ctx.close();
    }

    fn run(&self, mut op: Validated<Op<'_>>) -> Result<()> {
        let inner = &*self.inner;
        let limit = op_limit(op.time_limit());
        let check = op.take_check();
        let check = check.as_ref();
        match op.into_op() {
            Op::AllReduce { send, recv, op } => {
                const OP: &str = "all_reduce";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.all_reduce(check, Some(send), recv, op, turn.tag(), limit)
            }
            Op::AllReduceInPlace { buf, op } => {
                let buf = buf.host_only("all_reduce", BACKEND)?;
                let turn = inner.seq.enter();
                inner.all_reduce(check, None, buf, op, turn.tag(), limit)
            }
            Op::Broadcast { buf, root } => {
                let buf = buf.host_only("broadcast", BACKEND)?;
                let turn = inner.seq.enter();
                inner.broadcast(check, buf, root, turn.tag(), limit)
            }
            Op::AllGather { send, recv } => {
                const OP: &str = "all_gather";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.all_gather(check, send, recv, turn.tag(), limit)
            }
            Op::ReduceScatter { send, recv, op } => {
                const OP: &str = "reduce_scatter";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.reduce_scatter(check, send, recv, op, turn.tag(), limit)
            }
            Op::AllGatherInPlace { buf } => {
                let buf = buf.host_only("all_gather", BACKEND)?;
                let turn = inner.seq.enter();
                inner.all_gather_in_place(check, buf, turn.tag(), limit)
            }
            Op::ReduceScatterInPlace { buf, op } => {
                let buf = buf.host_only("reduce_scatter", BACKEND)?;
                let turn = inner.seq.enter();
                inner.reduce_scatter_in_place(check, buf, op, turn.tag(), limit)
            }
            Op::AllToAll { send, recv } => {
                const OP: &str = "all_to_all";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.all_to_all(check, send, recv, turn.tag(), limit)
            }
            Op::Barrier => {
                let turn = inner.seq.enter();
                inner.barrier(check, turn.tag(), limit)
            }
            Op::Send { buf, peer, tag } => {
                let data = buf.host_only("send", BACKEND)?;
                inner.p2p(
                    "send",
                    &mut [RawP2p::Send {
                        data,
                        peer,
                        tag,
                        head: None,
                    }],
                    limit,
                )
            }
            Op::Recv { buf, peer, tag } => {
                let data = buf.host_only("recv", BACKEND)?;
                inner.p2p(
                    "recv",
                    &mut [RawP2p::Recv {
                        data,
                        peer,
                        tag,
                        head: None,
                    }],
                    limit,
                )
            }
            Op::Batch(ops) => self.batch(ops, limit),
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                const OP: &str = "all_to_all_v";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.all_to_all_v(
                    check,
                    send,
                    send_counts,
                    recv,
                    recv_counts,
                    turn.tag(),
                    limit,
                )
            }
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                const OP: &str = "all_gather_v";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.all_gather_v(check, send, recv, recv_counts, turn.tag(), limit)
            }
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                const OP: &str = "reduce_scatter_v";
                let (send, recv) = (send.host_only(OP, BACKEND)?, recv.host_only(OP, BACKEND)?);
                let turn = inner.seq.enter();
                inner.reduce_scatter_v(check, send, send_counts, recv, op, turn.tag(), limit)
            }
            Op::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                const OP: &str = "reduce";
                let send = send.host_only(OP, BACKEND)?;
                let recv = recv.map(|r| r.host_only(OP, BACKEND)).transpose()?;
                let turn = inner.seq.enter();
                inner.reduce(check, send, recv, op, root, turn.tag(), limit)
            }
            Op::Gather { send, recv, root } => {
                const OP: &str = "gather";
                let send = send.host_only(OP, BACKEND)?;
                let recv = recv.map(|r| r.host_only(OP, BACKEND)).transpose()?;
                let turn = inner.seq.enter();
                inner.gather(check, send, recv, root, turn.tag(), limit)
            }
            Op::Scatter { send, recv, root } => {
                const OP: &str = "scatter";
                let send = send.map(|s| s.host_only(OP, BACKEND)).transpose()?;
                let recv = recv.host_only(OP, BACKEND)?;
                let turn = inner.seq.enter();
                inner.scatter(check, send, recv, root, turn.tag(), limit)
            }
        }
    }

    fn start(&self, request: Validated<Request>) -> Result<Box<dyn Work>> {
        let limit = op_limit(request.time_limit());
        let check = request.check().cloned();
        match request.into_op() {
            Request::Send { buf, peer, tag } => {
                self.start_p2p("send", buf, peer, tag, false, limit)
            }
            Request::Recv { buf, peer, tag } => self.start_p2p("recv", buf, peer, tag, true, limit),
            request => {
                let op = request.name();
                let done = Completion::new();
                let tx = self.worker()?;
                let d = done.clone();
                let inner = &self.inner;
                inner.seq.reserve(move |ticket| {
                    tx.send(Job {
                        ticket,
                        request,
                        limit,
                        check,
                        done: d,
                    })
                    .map_err(|_| worker_gone(op, &inner.name))
                })?;
                Ok(Box::new(GlooWork::new(done)))
            }
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.seq.drain();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shim(code: ShimCode, peer: Option<usize>) -> ShimError {
        ShimError {
            code,
            peer,
            message: "Connection reset by peer".into(),
        }
    }

    #[test]
    fn failures_keep_their_cause() {
        let t = Duration::from_millis(1500);
        let ranks = [4, 5, 6];
        let e = to_error(
            "all_reduce",
            shim(ShimCode::Io, None),
            "w0/s1/c4",
            &ranks,
            t,
        );
        match &e {
            Error::Library(l) => {
                assert_eq!(
                    (l.backend, l.op, l.comm.as_str()),
                    ("gloo", "all_reduce", "w0/s1/c4")
                );
                assert_eq!(l.code, Some(ShimCode::Io.status()));
                assert_eq!(l.class.as_deref(), Some("gloo::IoException"));
                assert_eq!(l.message, "Connection reset by peer");
            }
            other => panic!("{other}"),
        }
        assert!(e.is_communication());
        let e = to_error("barrier", shim(ShimCode::Enforce, None), "w0", &ranks, t);
        assert!(
            matches!(&e, Error::Library(l) if l.class.as_deref() == Some("gloo::EnforceNotMet")),
            "{e}"
        );
        let e = to_error("recv", shim(ShimCode::Io, Some(2)), "w0", &ranks, t);
        assert!(
            matches!(
                &e,
                Error::PeerFailed {
                    op: "recv",
                    peer: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("world rank 6"), "{e}");
        assert!(e.to_string().contains("communicator 'w0'"), "{e}");
        let e = to_error("broadcast", shim(ShimCode::Timeout, None), "w0", &ranks, t);
        assert!(
            matches!(
                e,
                Error::Timeout {
                    op: "broadcast",
                    millis: 1500,
                    peer: None,
                    at: None
                }
            ),
            "{e}"
        );
        let e = to_error("send", shim(ShimCode::Invalid, None), "w0", &ranks, t);
        assert!(matches!(e, Error::Invalid(_)), "{e}");
    }
}
