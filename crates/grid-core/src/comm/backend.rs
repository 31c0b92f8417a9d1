//! The execution trait a backend implements behind the front end ([`super::Comm`]).

use super::agree::{DeferredCheck, MismatchCheck};
use super::buffer::Memory;
use super::dtype::{DType, ReduceOp};
use super::lifecycle::TimeLimit;
use super::op::{Op, Request, Validated};
use super::Work;
use crate::error::Result;

/// What a backend does: execute operations that the front end ([`super::Comm`]) already
/// validated. Framework code never calls this trait; it calls [`super::Communicator`] on a
/// `Comm<B>`.
///
/// # What the front end guarantees before [`Backend::run`] and [`Backend::start`]
/// * [`Backend::check_live`] returned `Ok` for the operation;
/// * every buffer's memory kind is one [`Backend::accepts`], every dtype one
///   [`Backend::supports`] can move, and every reduction a pair it supports;
/// * the buffers of one operation have the same dtype, and the lengths fit the operation:
///   equal for all-reduce and all-to-all, `recv = size · send` for all-gather,
///   `send = size · recv` for reduce-scatter, all-to-all lengths divisible by the size;
/// * roots and peers are ranks of the communicator; a send's or receive's peer is not this
///   rank (batches may include it); tags are at most [`Backend::max_tag`].
///
/// A backend checks only what its library alone can know (a count too large for a C `int`,
/// the length of a message that actually arrived) and reports library failures as
/// [`crate::Error::Library`] with the library's code and class.
///
/// Operations are executed in the order the front end hands them over; nonblocking ones take
/// their place in the communicator's order when [`Backend::start`] is called and must not
/// block the caller beyond enqueueing.
pub trait Backend: Send + Sync + 'static {
    /// Backend name (`"mpi"`, `"local"`, ...).
    fn name(&self) -> &'static str;
    /// This process's rank in the communicator.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// World ranks of the members, in communicator-rank order.
    fn global_ranks(&self) -> &[usize];
    /// Which memory the backend's operations accept.
    fn accepts(&self, memory: Memory) -> bool;
    /// Whether the backend can reduce `dtype` with `op` (`None`: move `dtype` at all).
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool;
    /// Where in a page host memory for large receives should not start
    /// ([`super::ReceivePlacement`], forwarded by [`super::Communicator::receive_placement`]);
    /// `None` (the default) when the transport has no such window.
    fn receive_placement(&self) -> Option<super::ReceivePlacement> {
        None
    }
    /// The largest message tag the backend carries (`u32::MAX` unless the library limits it).
    fn max_tag(&self) -> u32 {
        u32::MAX
    }
    /// Whether [`Backend::run`] takes framed point-to-point operations
    /// ([`super::P2pOp::SendFramed`], [`super::P2pOp::RecvFramed`]) in a batch and sends each as
    /// one message. `false` (the default): the front end hands it the lowered form instead
    /// ([`super::P2pOp::lower_framed`]), and it never sees a framed operation.
    fn sends_framed(&self) -> bool {
        false
    }
    /// `Err(Error::Finalized)` once the communicator can no longer be used (finished,
    /// aborted, library finalized); called before every operation.
    fn check_live(&self, op: &'static str) -> Result<()> {
        let _ = op;
        Ok(())
    }
    /// Executes one validated blocking operation (and its mismatch check,
    /// [`Validated::check`], on a backend that [`Backend::checks_when_run`]).
    fn run(&self, op: Validated<Op<'_>>) -> Result<()>;
    /// Runs the mismatch check ([`MismatchCheck`]) of collective #`seq` that the front end
    /// checks itself, before handing the collective over: a blocking one on a backend that
    /// does not check it when run ([`Backend::checks_when_run`] `(false)`), a nonblocking one
    /// at its start. `Ok` when every rank agrees; the same
    /// [`crate::Error::CollectiveMismatch`] on every rank otherwise. The default runs the
    /// check's exchanges ([`DeferredCheck::verify_with`]: an `i64` all-reduce, then, on a
    /// disagreement, an all-gather) as operations of this communicator ([`Backend::run`]). A
    /// backend whose library matches collectives by their order alone may run them on a
    /// channel of its own (MPI: a duplicate communicator), so that a rank that checks never
    /// meets another rank's real operation when only some ranks check (ranks on both sides of
    /// a [`MismatchCheck::Above`] threshold), or exchange the fingerprints its own way
    /// ([`DeferredCheck::verify_gathered`]); every rank must then run every check the same
    /// way, whichever path brought it.
    fn run_check(&self, check: &DeferredCheck, seq: u64, limit: TimeLimit) -> Result<()> {
        check.verify_with(seq, limit, &mut |op| self.run(op))
    }
    /// Starts one validated nonblocking operation on owned buffers.
    fn start(&self, op: Validated<Request>) -> Result<Box<dyn Work>>;
    /// True when this backend runs the mismatch check of a collective itself, right before
    /// the collective executes in the communicator's order, or with it
    /// ([`Validated::check`], [`super::DeferredCheck::verify`],
    /// [`super::DeferredCheck::verify_gathered`]): the front end then exchanges nothing and
    /// hands the check to [`Backend::run`] (`nonblocking = false`) or [`Backend::start`]
    /// (`nonblocking = true`) with the operation, which must run it before any of the
    /// operation's data reaches the caller's memory. For nonblocking operations that means a
    /// start that never blocks on the other ranks, and a disagreement fails the operation's
    /// [`Work`]. False by default: the front end checks a blocking collective before
    /// [`Backend::run`] ([`Backend::run_check`]) and a nonblocking one at the start, which
    /// blocks until every member started it (so only [`MismatchCheck::All`] checks
    /// nonblocking collectives there).
    fn checks_when_run(&self, nonblocking: bool) -> bool {
        let _ = nonblocking;
        false
    }
    /// The mismatch-checking mode a communicator of this backend starts with when
    /// `GRID_DEBUG` selects none ([`MismatchCheck`]; `Off` unless the backend overrides it).
    fn mismatch_check_default(&self) -> MismatchCheck {
        MismatchCheck::Off
    }
    /// The time limit the communicator's operations get unless the program sets another
    /// ([`super::Communicator::set_time_limit`], or per operation): the backend's configured
    /// timeout.
    fn default_time_limit(&self) -> TimeLimit;
    /// Called by [`super::Communicator::abort`] after the front end marked the communicator
    /// aborted (so no new operation reaches the backend): wake every operation of this rank
    /// that is blocked on the communicator, blocking or nonblocking, so that it returns an
    /// error promptly (the front end reports it as [`crate::Error::Aborted`]). Must not block,
    /// must be safe to call from any thread and more than once, and must leave no buffer in use
    /// by the library once the woken operation has returned (a backend that cannot cancel an
    /// operation in its library must say in its documentation what it does instead).
    fn abort(&self);
    /// Waits for everything enqueued so far (stream synchronisation on GPUs).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
