//! Communicator traits that every backend (MPI, Gloo, NCCL) implements.
//!
//! # Shape of the API
//! * [`Communicator`] is **object safe**: a `ProcessGroupCollection<Arc<dyn Communicator>>` is
//!   possible (a test pins this). Its methods take *type-erased* buffers ([`BufRef`], [`BufMut`])
//!   that carry their element type, so one trait serves every dtype without generic methods.
//! * [`CommunicatorExt`] (blanket-implemented for every communicator, including `dyn`) adds the
//!   typed forms a user calls: `comm.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum)`.
//! * Nonblocking forms take **owned** buffers ([`Tensor`]) and return a [`Work`] handle; `wait`
//!   hands the result buffer back. Owning the buffer is what makes overlap sound: nothing can
//!   read or free the memory while the backend still uses it, whatever thread runs the
//!   operation, and dropping a handle never leaves a dangling borrow.
//! * [`GroupFactory`] creates communicators: split a parent by colour, create one for a rank
//!   list, and build a whole [`crate::ProcessGroupCollection`] from a plan with one split per
//!   family ([`crate::build_collection`]).
//!
//! # Host and device memory (how NCCL fits without changing these traits)
//! A buffer is either host memory (`BufRef::Host`, a typed slice) or device memory
//! (`BufRef::Device`, a `&dyn DeviceBuffer`). A GPU backend implements [`DeviceBuffer`] for its
//! own allocation type (for example a wrapper over `cudarc`'s `CudaSlice<T>` that records the
//! stream it was written on) and downcasts with [`DeviceBuffer::as_any`]. Collectives on device
//! buffers are *stream-ordered*: a blocking call returns once the operation is enqueued on the
//! communicator's stream after an event recorded on the buffer's stream, exactly as NCCL works;
//! [`Communicator::synchronize`] waits for the communicator's stream. Nonblocking calls complete
//! their [`Work`] when a CUDA event recorded after the operation has fired. CPU backends reject
//! device buffers with [`Error::Unsupported`], and a GPU backend may reject host buffers the
//! same way: which memory a backend accepts is reported by [`Communicator::accepts`].
//!
//! # Ranks
//! `rank()` is the position of this process in `global_ranks()`, the members' world ranks in
//! communicator-rank order. A split orders members by its key; [`crate::build_collection`]
//! keys every split by world rank, so its communicators list members in **ascending** order
//! and `rank()` is the index in the sorted member list, as torch defines group ranks (also for
//! families whose Megatron member order is not sorted, such as `intra_dist_opt`).
//! Roots and peers are given as communicator ranks.
//!
//! # Front end and backends
//! A backend implements the small execution trait [`Backend`] and is wrapped in the front end
//! [`Comm`], which implements [`Communicator`]: validation with typed errors, the sequence
//! number and the `tracing` span happen there, once for every backend. The host reduction
//! kernels ([`kernels`]) and the split arithmetic ([`split_members`]) also live here, for every
//! backend that needs them. Backends that still implement [`Communicator`] directly keep
//! working; they are being moved behind the front end.
//!
//! # Modules
//! `dtype` (element types, reductions, erased host slices), `buffer` (borrowed and owned
//! buffers), `op` (typed operations), `backend` (the execution trait), `front` (the front end),
//! [`kernels`] and `split`.

mod agree;
mod backend;
mod buffer;
mod dtype;
mod front;
pub mod kernels;
mod lifecycle;
mod narrow;
mod op;
mod placement;
pub mod round;
mod split;

pub(crate) use agree::describe_values;
pub use agree::{DeferredCheck, GatherFn, MismatchCheck};
pub use backend::Backend;
pub use buffer::{BufMut, BufRef, DeviceBuffer, Memory, Tensor};
pub use dtype::{DType, Element, HostBuffer, HostSlice, HostSliceMut, ReduceOp};
pub use front::Comm;
pub use lifecycle::{compact_ranks, Failure, OpSite, TimeLimit};
pub use narrow::{Bool, F8E4M3, F8E5M2};
pub use op::{Op, OwnedOp, P2pOp, Request, Validated, FRAME_HEAD_MAX};
pub use placement::ReceivePlacement;
pub use split::{color_key_for, split_members, SplitEntry, SplitMembers};

use crate::error::{Error, Result};
use std::time::Duration;

/// Handle of a started nonblocking operation.
///
/// Collectives started on one communicator run in the order they were started, the same order
/// on every rank. Point-to-point sends and receives are posted at once and complete as their
/// peers match them (as `batch_isend_irecv` does), so matching exchanges posted in any order do
/// not deadlock; NCCL, which executes one communicator's work in stream order, defers them into
/// one group (see its crate docs). Dropping a handle whose operation has not finished **waits** for it, so the owned
/// buffers are never freed while the library still uses them.
pub trait Work: Send {
    /// True once the operation finished (successfully or not); never blocks.
    fn is_completed(&mut self) -> bool;
    /// Blocks until the operation finishes and returns its result buffer: the in-place buffer
    /// for all-reduce, broadcast and receive, `recv` for out-of-place all-reduce, `recv` for all-gather, reduce-scatter and
    /// all-to-all, the sent buffer for send, and an empty host buffer for barrier.
    fn wait(self: Box<Self>) -> Result<Tensor>;
    /// Like [`Work::wait`] with a time limit; on timeout the work is returned so it can be
    /// waited on again (the operation keeps running).
    fn wait_timeout(
        self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>>;
}

/// A communicator over one group of ranks. Object safe.
///
/// Every method validates its arguments (lengths, dtypes, roots and peers, memory kind, state)
/// before reaching the library and reports problems as [`Error`]s; a backend failure becomes
/// [`Error::Library`] (or the legacy [`Error::Backend`]), [`Error::Timeout`] or
/// [`Error::PeerFailed`], never a panic or an abort. Framework code gets a communicator from a
/// backend as [`Comm`]`<B>` (the front end, where that validation is written once); the
/// backends not yet behind the front end implement this trait directly.
pub trait Communicator: Send + Sync {
    /// Backend name (`"mpi"`, `"gloo"`, `"nccl"`, `"local"`).
    fn backend(&self) -> &'static str;
    /// The communicator's descriptive name (`"world"`, a family name, ...); the backend name
    /// for communicators that have none.
    fn name(&self) -> &str {
        self.backend()
    }
    /// This process's rank in the communicator (its index in `global_ranks()`).
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// World ranks of the members, in communicator-rank order (ascending for communicators
    /// made by [`crate::build_collection`] and [`GroupFactory::create_group`]).
    fn global_ranks(&self) -> &[usize];
    /// Which memory this backend's collectives accept.
    fn accepts(&self, memory: Memory) -> bool;
    /// Whether the backend can reduce `dtype` with `op` (`op = None`: can it move `dtype` at all).
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool;
    /// Where in a page host memory for this communicator's large receives should not start
    /// ([`ReceivePlacement`]); `None` (the default) when the transport has no such window.
    fn receive_placement(&self) -> Option<ReceivePlacement> {
        None
    }

    /// Element-wise reduction of `send` over all ranks into `recv` (same dtype and length).
    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Element-wise reduction of `buf` over all ranks, in place. Behind the front end
    /// ([`Comm`]) the backend receives the buffer itself ([`Op::AllReduceInPlace`]; MPI passes
    /// `MPI_IN_PLACE`), with no copy. The default, for communicators implemented directly,
    /// copies host input once and calls [`Communicator::all_reduce`].
    fn in_place_all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let mut host = buf.host_only("all_reduce", self.backend())?;
        let send = host.as_slice().to_owned_buffer();
        self.all_reduce(
            BufRef::Host(send.as_slice()),
            BufMut::Host(host.reborrow()),
            op,
        )
    }
    /// All-gather in place: `buf` holds `size · count` elements with this rank's block already
    /// at `rank · count`; afterwards block `j` holds rank `j`'s block, in rank order. `buf`'s
    /// length must be a multiple of the size ([`Error::Indivisible`] otherwise). Behind the
    /// front end the backend receives the buffer itself ([`Op::AllGatherInPlace`]; MPI passes
    /// `MPI_IN_PLACE`, Gloo gives libgloo no input, NCCL's send buffer is `buf + rank · count`),
    /// with no copy of this rank's block.
    fn in_place_all_gather(&self, buf: BufMut<'_>) -> Result<()> {
        self.call_op(Op::AllGatherInPlace { buf }, None)
    }
    /// Reduce-scatter in place: `buf` holds `size · count` input elements (block `j` for rank
    /// `j`); afterwards this rank's reduced block is at `rank · count..(rank + 1) · count`
    /// (NCCL's and Megatron's convention) and **the rest of `buf` is unspecified** (each backend
    /// leaves there whatever its algorithm left: partial sums, the input, or other ranks'
    /// results). `buf`'s length must be a multiple of the size ([`Error::Indivisible`]
    /// otherwise). Behind the front end the backend receives the buffer itself
    /// ([`Op::ReduceScatterInPlace`]).
    fn in_place_reduce_scatter(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call_op(Op::ReduceScatterInPlace { buf, op }, None)
    }
    /// Copies `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Concatenates every rank's `send` in rank order into `recv` (`size · send.len()` elements).
    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()>;
    /// Reduces `send` (`size · recv.len()` elements) and leaves block `rank` in `recv`.
    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`. Both
    /// buffers have the same length, divisible by the size.
    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()>;
    /// Uneven all-to-all (the exchange of a mixture-of-experts token dispatcher, torch's
    /// `all_to_all_single` with split sizes): the first `send_counts[0]` elements of `send` go
    /// to rank 0, the next `send_counts[1]` to rank 1, and so on; `recv` receives
    /// `recv_counts[j]` elements from rank `j`, in rank order. Both vectors have one entry per
    /// rank and sum to their buffer's length; what rank `i` sends rank `j` must be what `j`
    /// expects from `i` (checked across ranks when the mismatch check applies: see
    /// [`MismatchCheck`]).
    fn all_to_all_v(
        &self,
        send: BufRef<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.call_op(
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            },
            None,
        )
    }
    /// All-gather with per-rank counts: rank `j` contributes `recv_counts[j]` elements (this
    /// rank's `send` has `recv_counts[rank]`); `recv` receives every contribution in rank
    /// order. Every rank passes the same `recv_counts`.
    fn all_gather_v(
        &self,
        send: BufRef<'_>,
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.call_op(
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            },
            None,
        )
    }
    /// Reduce-scatter with per-rank counts: `send` holds one block per rank, block `j` of
    /// `send_counts[j]` elements; `recv` (`send_counts[rank]` elements) receives the reduction
    /// of every rank's block `rank`. Every rank passes the same `send_counts`.
    fn reduce_scatter_v(
        &self,
        send: BufRef<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.call_op(
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            },
            None,
        )
    }
    /// Rooted reduce: the element-wise reduction of every rank's `send` lands in `recv` on
    /// `root`. `recv` is used only on the root (which must pass it, of `send`'s length); other
    /// ranks pass `None` (a buffer they pass is ignored and left untouched).
    fn reduce(
        &self,
        send: BufRef<'_>,
        recv: Option<BufMut<'_>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.call_op(
            Op::Reduce {
                send,
                recv,
                op,
                root,
            },
            None,
        )
    }
    /// Rooted gather: `recv` on `root` (`size · send.len()` elements) receives every rank's
    /// `send` in rank order. `recv` is used only on the root, as for [`Communicator::reduce`].
    fn gather(&self, send: BufRef<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.call_op(Op::Gather { send, recv, root }, None)
    }
    /// Rooted scatter: block `j` (`recv.len()` elements) of `send` on `root` goes to rank `j`.
    /// `send` is used only on the root (`size · recv.len()` elements); other ranks pass `None`.
    fn scatter(&self, send: Option<BufRef<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.call_op(Op::Scatter { send, recv, root }, None)
    }
    /// Blocks until every rank arrived.
    fn barrier(&self) -> Result<()>;
    /// Sends `buf` to communicator rank `peer`. `peer` must differ from `rank()`.
    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()>;
    /// Receives exactly `buf.len()` elements from communicator rank `peer`.
    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()>;
    /// Runs several sends and receives as one batch that cannot deadlock on ordering
    /// (`batch_isend_irecv`; `ncclGroupStart/End` on NCCL). Returns when all completed. A
    /// framed operation ([`P2pOp::SendFramed`]) carries a small header with its payload.
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()>;
    /// Starts a nonblocking operation on owned buffers.
    fn start(&self, request: Request) -> Result<Box<dyn Work>>;
    /// Waits until every operation enqueued so far has completed (a no-op for CPU backends,
    /// stream synchronisation for NCCL).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    // ---- lifecycle (see the `lifecycle` section of the module docs) -------------------------

    /// Aborts this communicator on this rank: non-blocking, thread-safe, idempotent. Every
    /// operation blocked on it (blocking or nonblocking) and every later one returns
    /// [`Error::Aborted`]. Local, like `ncclCommAbort`: the other ranks notice through their own
    /// operations (a lost connection or their time limit). With `GRID_TRACE_DIR` set the first
    /// abort dumps the operation log with reason `abort`.
    fn abort(&self);
    /// Why this communicator can no longer be used: `abort()` was called, or an operation
    /// failed because communication failed ([`Error::Timeout`], [`Error::PeerFailed`],
    /// [`Error::Aborted`]; the first such failure is kept). `None` while it is healthy.
    fn failure(&self) -> Option<Failure>;
    /// The time limit of this communicator's operations (chosen at creation from the
    /// backend's configuration, or set by [`Communicator::set_time_limit`]).
    fn time_limit(&self) -> TimeLimit;
    /// Sets the default time limit of this communicator's later operations on this rank.
    fn set_time_limit(&self, limit: TimeLimit);
    /// Runs a blocking operation given as an [`Op`], with an optional time limit overriding
    /// the communicator's default for this operation only (`None`: the default). The typed
    /// methods ([`Communicator::all_reduce`], ...) are this with `None`;
    /// [`CommunicatorExt::with_time_limit`] is this with `Some`.
    fn call_op(&self, op: Op<'_>, limit: Option<TimeLimit>) -> Result<()>;
    /// Starts a nonblocking operation with an optional per-operation time limit (see
    /// [`Communicator::call_op`]).
    fn start_op(&self, request: Request, limit: Option<TimeLimit>) -> Result<Box<dyn Work>>;
}

/// A communicator whose operations use one time limit instead of the communicator's default:
/// made by [`CommunicatorExt::with_time_limit`]. Everything else (abort, failure, the default
/// limit) is the underlying communicator's.
///
/// ```
/// # use grid_core::*;
/// # use std::time::Duration;
/// # fn f(comm: &dyn Communicator) -> Result<()> {
/// let mut grads = vec![1.0f32; 1024];
/// // This all-reduce may wait 30 s; the communicator's other operations keep their default.
/// comm.with_time_limit(Duration::from_secs(30))
///     .all_reduce_in_place(&mut grads[..], ReduceOp::Sum)?;
/// comm.with_time_limit(TimeLimit::Unlimited).barrier()?;
/// # Ok(()) }
/// ```
pub struct Limited<'a, C: Communicator + ?Sized> {
    comm: &'a C,
    limit: TimeLimit,
}

impl<C: Communicator + ?Sized> Communicator for Limited<'_, C> {
    fn backend(&self) -> &'static str {
        self.comm.backend()
    }
    fn name(&self) -> &str {
        self.comm.name()
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn global_ranks(&self) -> &[usize] {
        self.comm.global_ranks()
    }
    fn accepts(&self, memory: Memory) -> bool {
        self.comm.accepts(memory)
    }
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        self.comm.supports(dtype, op)
    }
    fn receive_placement(&self) -> Option<ReceivePlacement> {
        self.comm.receive_placement()
    }
    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call_op(Op::AllReduce { send, recv, op }, None)
    }
    fn in_place_all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call_op(Op::AllReduceInPlace { buf, op }, None)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.call_op(Op::Broadcast { buf, root }, None)
    }
    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        self.call_op(Op::AllGather { send, recv }, None)
    }
    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call_op(Op::ReduceScatter { send, recv, op }, None)
    }
    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        self.call_op(Op::AllToAll { send, recv }, None)
    }
    fn barrier(&self) -> Result<()> {
        self.call_op(Op::Barrier, None)
    }
    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        self.call_op(Op::Send { buf, peer, tag }, None)
    }
    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        self.call_op(Op::Recv { buf, peer, tag }, None)
    }
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        self.call_op(Op::Batch(ops), None)
    }
    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        self.start_op(request, None)
    }
    fn synchronize(&self) -> Result<()> {
        self.comm.synchronize()
    }
    fn abort(&self) {
        self.comm.abort()
    }
    fn failure(&self) -> Option<Failure> {
        self.comm.failure()
    }
    fn time_limit(&self) -> TimeLimit {
        self.limit
    }
    fn set_time_limit(&self, limit: TimeLimit) {
        self.comm.set_time_limit(limit)
    }
    /// Runs `op` with this view's limit, or with `limit` when one is given.
    fn call_op(&self, op: Op<'_>, limit: Option<TimeLimit>) -> Result<()> {
        self.comm.call_op(op, Some(limit.unwrap_or(self.limit)))
    }
    fn start_op(&self, request: Request, limit: Option<TimeLimit>) -> Result<Box<dyn Work>> {
        self.comm
            .start_op(request, Some(limit.unwrap_or(self.limit)))
    }
}

/// Creates communicators for sub-groups of a parent communicator.
///
/// Implemented by each backend (the factory holds what creation needs: a rendezvous store for
/// Gloo, a device and a bootstrap for NCCL; nothing for MPI). Both methods are **collective over
/// the parent**: every rank of the parent calls them, in the same order, members and
/// non-members alike. [`crate::build_collection`] builds a whole
/// [`crate::ProcessGroupCollection`] on top of [`GroupFactory::split`] with one split per family.
pub trait GroupFactory {
    /// The communicator type this factory creates.
    type Comm: Communicator;

    /// Splits `parent`: ranks passing the same `color` get one new communicator, whose ranks are
    /// ordered by `(key, parent rank)` (pass the world rank as key for torch's sorted order); a rank passing `None` takes part in the call and gets `None`
    /// (`MPI_Comm_split` with `MPI_UNDEFINED`, `ncclCommSplit` with `NCCL_SPLIT_NOCOLOR`).
    fn split(
        &self,
        parent: &Self::Comm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<Self::Comm>>;

    /// The communicator of the group made of `ranks` (parent ranks, any order; the new
    /// communicator orders them ascending). Returns `None` on ranks outside the list.
    fn create_group(&self, parent: &Self::Comm, ranks: &[usize]) -> Result<Option<Self::Comm>> {
        let members = check::group_members("create_group", ranks, parent.size())?;
        let me = parent.rank();
        self.split(parent, members.binary_search(&me).is_ok().then_some(0), me)
    }

    /// [`GroupFactory::split`] with the new group's [`crate::GroupOptions`]: its name (the
    /// communicator's name in errors, spans and the operation log), its default time limit,
    /// and backend options. Options are checked ([`crate::GroupOptions::check_backend`])
    /// before any communication, so every rank (all pass the same options) fails alike.
    ///
    /// Every factory of this workspace overrides it to create the communicator under the
    /// name and with the backend options. This default, for other factories, applies the time
    /// limit only: it rejects a name or backend options with [`Error::Unsupported`] (it
    /// cannot apply them) before the split.
    fn split_with(
        &self,
        parent: &Self::Comm,
        color: Option<u32>,
        key: usize,
        options: &crate::GroupOptions,
    ) -> Result<Option<Self::Comm>> {
        options.check_backend(parent.backend())?;
        if options.name.is_some() || options.backend != crate::BackendOptions::None {
            return Err(Error::Unsupported {
                op: "split_with",
                backend: parent.backend(),
                what: "group names and backend options (this factory does not apply them)".into(),
            });
        }
        let comm = self.split(parent, color, key)?;
        if let (Some(c), Some(t)) = (&comm, options.timeout) {
            c.set_time_limit(t);
        }
        Ok(comm)
    }

    /// Creates the communicator of the group `members` (distinct parent ranks in the order of
    /// their ranks in the new communicator, this rank among them) with **only the members taking part**: ranks outside the group make no
    /// call. `identity` names the group among all groups ever created from `parent`; callers
    /// derive it from the group's family and members ([`crate::group_identity`]), so that it is
    /// the same on every member whatever else each member created before, and a backend
    /// derives from it what its rendezvous needs (MPI: the tag of `MPI_Comm_create_group`;
    /// Gloo and the local backend: a store prefix or registry key, followed by how many times
    /// this rank already created a group of this identity, a count only the group's own members
    /// advance). The communicator is named `options.name`, else `identity`.
    ///
    /// The members must call it for their groups in one order; two ranks that share two groups
    /// and create them in opposite orders wait for each other, as with any blocking creation.
    ///
    /// This default, for factories that cannot create a group without the parent, returns
    /// [`Error::Unsupported`] before any communication; the MPI, Gloo and local factories of
    /// this workspace implement it.
    fn create_members_only(
        &self,
        parent: &Self::Comm,
        members: &[usize],
        identity: &str,
        options: &crate::GroupOptions,
    ) -> Result<Self::Comm> {
        let _ = (members, identity, options);
        Err(Error::Unsupported {
            op: "create_members_only",
            backend: parent.backend(),
            what: "members-only group creation (this factory creates groups collectively over \
                   the parent only: use Creation::Split)"
                .into(),
        })
    }

    /// [`GroupFactory::create_group_with`] under a chosen [`crate::Creation`]:
    /// [`crate::Creation::Split`] is [`GroupFactory::create_group_with`] (collective over the
    /// parent); [`crate::Creation::MembersOnly`] returns `None` at once on ranks outside
    /// `ranks` and, on members, calls [`GroupFactory::create_members_only`] with the identity
    /// [`crate::group_identity`] of (`options.name`, or `"group"`, and the members' global
    /// ranks). Bad `ranks` fail alike on every rank before any communication.
    fn create_group_as(
        &self,
        parent: &Self::Comm,
        ranks: &[usize],
        options: &crate::GroupOptions,
        creation: crate::Creation,
    ) -> Result<Option<Self::Comm>> {
        match creation {
            crate::Creation::Split => self.create_group_with(parent, ranks, options),
            crate::Creation::MembersOnly => {
                options.check_backend(parent.backend())?;
                let members = check::group_members("create_group", ranks, parent.size())?;
                if members.binary_search(&parent.rank()).is_err() {
                    return Ok(None);
                }
                let global: Vec<usize> = members
                    .iter()
                    .map(|&r| parent.global_ranks().get(r).copied().unwrap_or(r))
                    .collect();
                let id = crate::group_identity(options.name.as_deref().unwrap_or("group"), &global);
                self.create_members_only(parent, &members, &id, options)
                    .map(Some)
            }
        }
    }

    /// [`GroupFactory::create_group`] with the group's options ([`GroupFactory::split_with`]).
    fn create_group_with(
        &self,
        parent: &Self::Comm,
        ranks: &[usize],
        options: &crate::GroupOptions,
    ) -> Result<Option<Self::Comm>> {
        let members = check::group_members("create_group", ranks, parent.size())?;
        let me = parent.rank();
        self.split_with(
            parent,
            members.binary_search(&me).is_ok().then_some(0),
            me,
            options,
        )
    }
}

/// Typed conveniences over any [`Communicator`], including `dyn Communicator`.
///
/// ```no_run
/// # use grid_core::{Communicator, CommunicatorExt, ReduceOp};
/// # fn f(comm: &dyn Communicator) -> grid_core::Result<()> {
/// let mut sum = vec![0.0f32; 4];
/// comm.all_reduce_into(&[1.0f32; 4][..], &mut sum[..], ReduceOp::Sum)?;
/// let work = comm.iall_reduce(vec![1i64, 2, 3], ReduceOp::Max)?;
/// let max: Vec<i64> = work.wait()?;
/// # Ok(()) }
/// ```
pub trait CommunicatorExt: Communicator {
    /// This communicator with another time limit for the operations called on the returned
    /// view ([`Limited`]): a [`std::time::Duration`], or [`TimeLimit::Unlimited`].
    fn with_time_limit(&self, limit: impl Into<TimeLimit>) -> Limited<'_, Self> {
        Limited {
            comm: self,
            limit: limit.into(),
        }
    }
    /// Typed all-reduce.
    fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::host(send).into(), T::host_mut(recv).into(), op)
    }
    /// Typed all-reduce in place ([`Communicator::in_place_all_reduce`]: no copy behind the
    /// front end).
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.in_place_all_reduce(T::host_mut(buf).into(), op)
    }
    /// Typed broadcast.
    fn broadcast_into<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::host_mut(buf).into(), root)
    }
    /// Typed all-gather.
    fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather(T::host(send).into(), T::host_mut(recv).into())
    }
    /// Typed reduce-scatter.
    fn reduce_scatter_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter(T::host(send).into(), T::host_mut(recv).into(), op)
    }
    /// Typed all-gather in place ([`Communicator::in_place_all_gather`]): `buf` holds `size ·
    /// count` elements with this rank's block at `rank · count`; afterwards every block is
    /// filled.
    ///
    /// ```
    /// use grid_core::{Communicator, CommunicatorExt};
    /// let got = backend_local::run(3, &Default::default(), |_f, c| {
    ///     let mut buf = vec![0i32; 2 * c.size()];
    ///     let me = c.rank();
    ///     buf[2 * me..2 * me + 2].copy_from_slice(&[10 * me as i32, 10 * me as i32 + 1]);
    ///     c.all_gather_in_place(&mut buf)?;
    ///     Ok(buf)
    /// })?;
    /// assert!(got.iter().all(|b| b == &[0, 1, 10, 11, 20, 21]));
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.in_place_all_gather(T::host_mut(buf).into())
    }
    /// Typed reduce-scatter in place ([`Communicator::in_place_reduce_scatter`]): `buf` holds
    /// `size · count` input elements; afterwards this rank's reduced block is at `rank ·
    /// count..(rank + 1) · count` and the rest of `buf` is unspecified.
    ///
    /// ```
    /// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
    /// let got = backend_local::run(2, &Default::default(), |_f, c| {
    ///     let mut buf = vec![1i64, 2, 3, 4]; // two blocks of 2
    ///     c.reduce_scatter_in_place(&mut buf, ReduceOp::Sum)?;
    ///     let me = c.rank();
    ///     Ok(buf[2 * me..2 * me + 2].to_vec()) // this rank's block; the rest is unspecified
    /// })?;
    /// assert_eq!(got, vec![vec![2, 4], vec![6, 8]]);
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.in_place_reduce_scatter(T::host_mut(buf).into(), op)
    }
    /// Typed all-to-all.
    fn all_to_all_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all(T::host(send).into(), T::host_mut(recv).into())
    }
    /// Typed uneven all-to-all ([`Communicator::all_to_all_v`]).
    ///
    /// ```
    /// use grid_core::{Communicator, CommunicatorExt};
    /// let got = backend_local::run(2, &Default::default(), |_f, c| {
    ///     // Rank r sends r + 1 copies of its rank to rank 0 and one to rank 1.
    ///     let r = c.rank() as i32;
    ///     let send: Vec<i32> = vec![r; c.rank() + 2];
    ///     let send_counts = [c.rank() + 1, 1];
    ///     let recv_counts = if c.rank() == 0 { [1, 2] } else { [1, 1] };
    ///     let mut recv = vec![0i32; recv_counts.iter().sum()];
    ///     c.all_to_all_v_into(&send, &send_counts, &mut recv, &recv_counts)?;
    ///     Ok(recv)
    /// })?;
    /// assert_eq!(got, vec![vec![0, 1, 1], vec![0, 1]]);
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    fn all_to_all_v_into<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v(
            T::host(send).into(),
            send_counts,
            T::host_mut(recv).into(),
            recv_counts,
        )
    }
    /// Typed all-gather with per-rank counts ([`Communicator::all_gather_v`]).
    fn all_gather_v_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_gather_v(T::host(send).into(), T::host_mut(recv).into(), recv_counts)
    }
    /// Typed reduce-scatter with per-rank counts ([`Communicator::reduce_scatter_v`]).
    fn reduce_scatter_v_into<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_v(
            T::host(send).into(),
            send_counts,
            T::host_mut(recv).into(),
            op,
        )
    }
    /// Typed rooted reduce ([`Communicator::reduce`]); `recv` is used only on the root.
    ///
    /// ```
    /// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
    /// let got = backend_local::run(3, &Default::default(), |_f, c| {
    ///     let mut out = vec![0i64; 2];
    ///     let mine = [c.rank() as i64, 10];
    ///     let recv = (c.rank() == 1).then_some(&mut out[..]);
    ///     c.reduce_into(&mine, recv, ReduceOp::Sum, 1)?;
    ///     Ok(out)
    /// })?;
    /// assert_eq!(got[1], vec![3, 30]);
    /// assert_eq!(got[0], vec![0, 0]); // only the root receives
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: Option<&mut [T]>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.reduce(
            T::host(send).into(),
            recv.map(|r| T::host_mut(r).into()),
            op,
            root,
        )
    }
    /// Typed rooted gather ([`Communicator::gather`]); `recv` is used only on the root.
    fn gather_into<T: Element>(
        &self,
        send: &[T],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.gather(
            T::host(send).into(),
            recv.map(|r| T::host_mut(r).into()),
            root,
        )
    }
    /// Typed rooted scatter ([`Communicator::scatter`]); `send` is used only on the root.
    fn scatter_into<T: Element>(
        &self,
        send: Option<&[T]>,
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.scatter(
            send.map(|s| T::host(s).into()),
            T::host_mut(recv).into(),
            root,
        )
    }
    /// Typed send.
    fn send_to<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        self.send(T::host(buf).into(), peer, tag)
    }
    /// Typed receive.
    fn recv_from<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        self.recv(T::host_mut(buf).into(), peer, tag)
    }
    /// Nonblocking in-place all-reduce of an owned vector.
    fn iall_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::AllReduce {
            buf: buf.into(),
            op,
        })?))
    }
    /// Nonblocking out-of-place all-reduce: `send` reduced into `recv` (same length), which
    /// `wait` returns.
    fn iall_reduce_into<T: Element>(
        &self,
        send: Vec<T>,
        recv: Vec<T>,
        op: ReduceOp,
    ) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::AllReduceInto {
            send: send.into(),
            recv: recv.into(),
            op,
        })?))
    }
    /// Nonblocking broadcast of an owned vector.
    fn ibroadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::Broadcast {
            buf: buf.into(),
            root,
        })?))
    }
    /// Nonblocking all-gather; the result has `size · send.len()` elements.
    fn iall_gather<T: Element>(&self, send: Vec<T>) -> Result<TypedWork<T>> {
        let n = send.len() * self.size();
        let recv = T::owned(vec![
            send.first().copied().unwrap_or_else(|| zero_of::<T>());
            n
        ]);
        Ok(TypedWork::new(self.start(Request::AllGather {
            send: send.into(),
            recv: Tensor::Host(recv),
        })?))
    }
    /// Nonblocking reduce-scatter; the result has `send.len() / size` elements.
    fn ireduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Result<TypedWork<T>> {
        let n = send.len() / self.size().max(1);
        let recv = T::owned(vec![
            send.first().copied().unwrap_or_else(|| zero_of::<T>());
            n
        ]);
        Ok(TypedWork::new(self.start(Request::ReduceScatter {
            send: send.into(),
            recv: Tensor::Host(recv),
            op,
        })?))
    }
    /// Nonblocking all-gather in place ([`Communicator::in_place_all_gather`]): `buf` holds
    /// `size · count` elements with this rank's block at `rank · count`; `wait` returns `buf`
    /// with every block filled.
    fn iall_gather_in_place<T: Element>(&self, buf: Vec<T>) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(
            self.start(Request::AllGatherInPlace { buf: buf.into() })?,
        ))
    }
    /// Nonblocking reduce-scatter in place ([`Communicator::in_place_reduce_scatter`]): `wait`
    /// returns `buf` (`size · count` elements) with this rank's reduced block at `rank ·
    /// count..(rank + 1) · count`; the rest of it is unspecified.
    fn ireduce_scatter_in_place<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(
            Request::ReduceScatterInPlace {
                buf: buf.into(),
                op,
            },
        )?))
    }
    /// Nonblocking all-to-all.
    fn iall_to_all<T: Element>(&self, send: Vec<T>) -> Result<TypedWork<T>> {
        let recv = T::owned(send.clone());
        Ok(TypedWork::new(self.start(Request::AllToAll {
            send: send.into(),
            recv: Tensor::Host(recv),
        })?))
    }
    /// Nonblocking uneven all-to-all ([`Communicator::all_to_all_v`]); `wait` returns the
    /// `sum(recv_counts)` received elements, in source order.
    fn iall_to_all_v<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Result<TypedWork<T>> {
        // A sum that overflows gives a length no buffer can have: host_zeros refuses it.
        let n = check::total(&recv_counts).unwrap_or(usize::MAX);
        let recv = host_zeros::<T>(n)?;
        Ok(TypedWork::new(self.start(Request::AllToAllV {
            send: send.into(),
            send_counts,
            recv,
            recv_counts,
        })?))
    }
    /// Nonblocking all-gather with per-rank counts; `wait` returns every contribution in rank
    /// order (`sum(recv_counts)` elements).
    fn iall_gather_v<T: Element>(
        &self,
        send: Vec<T>,
        recv_counts: Vec<usize>,
    ) -> Result<TypedWork<T>> {
        // A sum that overflows gives a length no buffer can have: host_zeros refuses it.
        let n = check::total(&recv_counts).unwrap_or(usize::MAX);
        let recv = host_zeros::<T>(n)?;
        Ok(TypedWork::new(self.start(Request::AllGatherV {
            send: send.into(),
            recv,
            recv_counts,
        })?))
    }
    /// Nonblocking reduce-scatter with per-rank counts; `wait` returns this rank's reduced
    /// block (`send_counts[rank]` elements).
    fn ireduce_scatter_v<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: Vec<usize>,
        op: ReduceOp,
    ) -> Result<TypedWork<T>> {
        let n = send_counts.get(self.rank()).copied().unwrap_or(0);
        let recv = host_zeros::<T>(n)?;
        Ok(TypedWork::new(self.start(Request::ReduceScatterV {
            send: send.into(),
            send_counts,
            recv,
            op,
        })?))
    }
    /// Nonblocking rooted reduce; `wait` returns the result on the root and this rank's
    /// `send` elsewhere.
    fn ireduce<T: Element>(&self, send: Vec<T>, op: ReduceOp, root: usize) -> Result<TypedWork<T>> {
        let recv = if self.rank() == root {
            Some(host_zeros::<T>(send.len())?)
        } else {
            None
        };
        Ok(TypedWork::new(self.start(Request::Reduce {
            send: send.into(),
            recv,
            op,
            root,
        })?))
    }
    /// Nonblocking rooted gather; `wait` returns every rank's block on the root (`size ·
    /// send.len()` elements) and this rank's `send` elsewhere.
    fn igather<T: Element>(&self, send: Vec<T>, root: usize) -> Result<TypedWork<T>> {
        let recv = if self.rank() == root {
            Some(host_zeros::<T>(send.len().saturating_mul(self.size()))?)
        } else {
            None
        };
        Ok(TypedWork::new(self.start(Request::Gather {
            send: send.into(),
            recv,
            root,
        })?))
    }
    /// Nonblocking rooted scatter of `recv_len` elements per rank; `send` is used only on the
    /// root. `wait` returns this rank's block.
    fn iscatter<T: Element>(
        &self,
        send: Option<Vec<T>>,
        recv_len: usize,
        root: usize,
    ) -> Result<TypedWork<T>> {
        let recv = host_zeros::<T>(recv_len)?;
        Ok(TypedWork::new(self.start(Request::Scatter {
            send: send.map(Tensor::from),
            recv,
            root,
        })?))
    }
    /// Nonblocking send; `wait` returns the buffer.
    fn isend<T: Element>(&self, buf: Vec<T>, peer: usize, tag: u32) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::Send {
            buf: buf.into(),
            peer,
            tag,
        })?))
    }
    /// Nonblocking receive of `len` elements.
    fn irecv<T: Element>(&self, len: usize, peer: usize, tag: u32) -> Result<TypedWork<T>> {
        let buf = Tensor::Host(HostBuffer::zeros(T::DTYPE, len));
        Ok(TypedWork::new(self.start(Request::Recv {
            buf,
            peer,
            tag,
        })?))
    }
    /// Nonblocking barrier.
    fn ibarrier(&self) -> Result<Box<dyn Work>> {
        self.start(Request::Barrier)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// A zero-filled host tensor of `n` elements of `T` ([`Tensor::host_zeros`]).
fn host_zeros<T: Element>(n: usize) -> Result<Tensor> {
    Tensor::host_zeros(T::DTYPE, n)
}

fn zero_of<T: Element>() -> T {
    T::from_owned(HostBuffer::zeros(T::DTYPE, 1))
        .ok()
        .and_then(|v| v.first().copied())
        .expect("HostBuffer::zeros returns the requested dtype")
}

/// A [`Work`] whose result is a host vector of `T`.
pub struct TypedWork<T: Element> {
    inner: Box<dyn Work>,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: Element> TypedWork<T> {
    /// Wraps an erased handle.
    pub fn new(inner: Box<dyn Work>) -> Self {
        TypedWork {
            inner,
            _t: std::marker::PhantomData,
        }
    }
    /// True once finished.
    pub fn is_completed(&mut self) -> bool {
        self.inner.is_completed()
    }
    /// Waits and returns the result vector.
    pub fn wait(self) -> Result<Vec<T>> {
        self.inner.wait()?.into_vec()
    }
    /// The erased handle.
    pub fn into_inner(self) -> Box<dyn Work> {
        self.inner
    }
}

/// Checks shared by every backend, so that they all reject the same mistakes with the same
/// messages before reaching their library. The front end ([`Comm`]) uses them; backends behind
/// it need not.
pub mod check {
    use super::*;

    /// Same dtype on both sides.
    pub fn same_dtype(op: &'static str, a: DType, b: DType) -> Result<()> {
        if a == b {
            Ok(())
        } else {
            Err(Error::DTypeMismatch {
                op,
                expected: a,
                actual: b,
            })
        }
    }

    /// A buffer of exactly `expected` elements.
    pub fn len(op: &'static str, what: &'static str, expected: usize, actual: usize) -> Result<()> {
        if expected == actual {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                op,
                what,
                expected,
                actual,
            })
        }
    }

    /// A per-rank counts vector of an uneven collective: exactly `size` entries whose sum
    /// (without overflow) is `len`, the length of `buffer`.
    ///
    /// ```
    /// use grid_core::comm::check;
    /// assert!(check::counts("all_to_all_v", "send_counts", &[1, 0, 2], 3, "send buffer", 3).is_ok());
    /// let e = check::counts("all_to_all_v", "send_counts", &[1, 2], 3, "send buffer", 3).unwrap_err();
    /// assert_eq!(e.to_string(), "all_to_all_v: send_counts [1, 2] has 2 entries: give one per rank of the communicator (3)");
    /// let e = check::counts("all_to_all_v", "recv_counts", &[1, 2, 3], 3, "recv buffer", 5).unwrap_err();
    /// assert_eq!(e.to_string(), "all_to_all_v: recv_counts [1, 2, 3] sums to 6 but the recv buffer has 5 elements");
    /// ```
    pub fn counts(
        op: &'static str,
        what: &'static str,
        counts: &[usize],
        size: usize,
        buffer: &'static str,
        len: usize,
    ) -> Result<()> {
        let bad = |problem: String| Error::BadCounts {
            op,
            what,
            counts: counts.to_vec(),
            problem,
        };
        if counts.len() != size {
            return Err(bad(format!(
                "has {} entries: give one per rank of the communicator ({size})",
                counts.len()
            )));
        }
        let sum =
            total(counts).ok_or_else(|| bad("overflows: its sum does not fit in usize".into()))?;
        if sum != len {
            return Err(bad(format!(
                "sums to {sum} but the {buffer} has {len} elements"
            )));
        }
        Ok(())
    }

    /// The sum of a counts vector, `None` when it does not fit in `usize`.
    ///
    /// ```
    /// use grid_core::comm::check;
    /// assert_eq!(check::total(&[2, 0, 3]), Some(5));
    /// assert_eq!(check::total(&[usize::MAX, 1]), None);
    /// ```
    pub fn total(counts: &[usize]) -> Option<usize> {
        counts.iter().try_fold(0usize, |a, &c| a.checked_add(c))
    }

    /// A communicator rank.
    pub fn rank(op: &'static str, what: &'static str, rank: usize, size: usize) -> Result<()> {
        if rank < size {
            Ok(())
        } else {
            Err(Error::PeerOutOfRange {
                op,
                what,
                rank,
                size,
            })
        }
    }

    /// The member list of [`GroupFactory::create_group`]: every rank below `size`, none twice,
    /// at least one; returned sorted ascending.
    ///
    /// ```
    /// use grid_core::comm::check::group_members;
    /// assert_eq!(group_members("create_group", &[3, 0], 4).unwrap(), vec![0, 3]);
    /// assert!(group_members("create_group", &[0, 0], 4).is_err());
    /// assert!(group_members("create_group", &[4], 4).is_err());
    /// assert!(group_members("create_group", &[], 4).is_err());
    /// ```
    pub fn group_members(op: &'static str, ranks: &[usize], size: usize) -> Result<Vec<usize>> {
        let mut seen = vec![false; size];
        for &r in ranks {
            rank(op, "member", r, size)?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::Invalid(format!(
                    "{op}: rank {r} appears more than once in {ranks:?}; list each member once"
                )));
            }
        }
        if ranks.is_empty() {
            return Err(Error::Invalid(format!(
                "{op}: the rank list is empty; give at least one rank of 0..{size}"
            )));
        }
        Ok((0..size).filter(|&r| seen[r]).collect())
    }

    /// The members of [`GroupFactory::create_members_only`]: [`group_members`]'s rules, and
    /// the calling rank `me` must be one of them (only members call).
    ///
    /// ```
    /// use grid_core::comm::check::members_only;
    /// assert!(members_only("create_members_only", &[3, 1], 4, 1).is_ok());
    /// let e = members_only("create_members_only", &[3, 1], 4, 0).unwrap_err();
    /// assert!(e.to_string().contains("rank 0 is not one of the members [3, 1]"), "{e}");
    /// assert!(members_only("create_members_only", &[1, 1], 4, 1).is_err());
    /// ```
    pub fn members_only(op: &'static str, members: &[usize], size: usize, me: usize) -> Result<()> {
        let sorted = group_members(op, members, size)?;
        if sorted.binary_search(&me).is_err() {
            return Err(Error::Invalid(format!(
                "{op}: rank {me} is not one of the members {members:?}; only a group's members call a members-only creation"
            )));
        }
        Ok(())
    }

    /// Validates the arguments of a collective against a communicator of `size` ranks.
    pub fn collective(
        op: &'static str,
        size: usize,
        send: Option<(DType, usize)>,
        recv: (DType, usize),
    ) -> Result<()> {
        if let Some((sd, sl)) = send {
            same_dtype(op, sd, recv.0)?;
            match op {
                "all_gather" => len(op, "recv buffer", sl * size, recv.1)?,
                "reduce_scatter" => len(op, "send buffer", recv.1 * size, sl)?,
                "all_to_all" => {
                    len(op, "recv buffer", sl, recv.1)?;
                    if size > 0 && sl % size != 0 {
                        return Err(Error::Invalid(format!(
                            "all_to_all: buffer of {sl} elements cannot be cut into {size} equal blocks"
                        )));
                    }
                }
                _ => len(op, "recv buffer", sl, recv.1)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(dead_code)]
    fn object_safe(_: &dyn Communicator, _: Box<dyn Work>, _: &dyn DeviceBuffer) {}

    #[test]
    fn erased_buffers() {
        let v = [1.0f32, 2.0];
        let r: BufRef = (&v[..]).into();
        assert_eq!(r.dtype(), DType::F32);
        assert_eq!(r.len(), 2);
        let t: Tensor = vec![3i64].into();
        assert_eq!(t.into_vec::<i64>().unwrap(), vec![3]);
        let t: Tensor = vec![3i64].into();
        assert!(t.into_vec::<f32>().is_err());
        assert_eq!(HostBuffer::zeros(DType::BF16, 3).len(), 3);
        assert!(check::collective("all_gather", 4, Some((DType::F32, 2)), (DType::F32, 8)).is_ok());
        assert!(
            check::collective("all_gather", 4, Some((DType::F32, 2)), (DType::F32, 7)).is_err()
        );
        assert!(
            check::collective("all_reduce", 4, Some((DType::F32, 2)), (DType::I32, 2)).is_err()
        );
    }
}
