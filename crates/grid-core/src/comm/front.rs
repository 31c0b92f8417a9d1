//! The front end: [`Comm`], one communicator type over any [`Backend`], where every operation of
//! every backend is validated, numbered and traced in one place.

use super::backend::Backend;
use super::buffer::{BufMut, BufRef, Memory, Tensor};
use super::dtype::{DType, ReduceOp};
use super::lifecycle::{blamed, fails_communicator, Failure, Lifecycle, OpSite, TimeLimit};
use super::op::{Op, P2pOp, Request, Validated, FRAME_HEAD_MAX};
use super::{Communicator, Work};
use crate::error::{Error, Result};
use crate::oplog::{OpDesc, OpHandle, OpLog, Recorder};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A communicator: a [`Backend`] behind the front end. Implements [`Communicator`] (so
/// `Arc<dyn Communicator>` and [`super::CommunicatorExt`] work as for any communicator).
///
/// Every call goes through the same steps, for every backend:
/// 1. [`Backend::check_live`];
/// 2. validation of the arguments (memory kind, dtype and reduction support, dtype and length
///    agreement, roots, peers and tags), with typed errors that carry the numbers
///    ([`Error::LengthMismatch`], [`Error::DTypeMismatch`], [`Error::PeerOutOfRange`],
///    [`Error::SelfPeer`], [`Error::TagOutOfRange`], [`Error::Indivisible`],
///    [`Error::Unsupported`]);
/// 3. the next sequence number of this communicator, and a `trace`-level `tracing` span
///    `comm` with the operation, the communicator's name, the backend, the sequence number and
///    the sizes;
/// 4. the operation log (below): the operation is recorded as posted (and started, for a
///    blocking call);
/// 5. for a collective, when mismatch checking is on ([`crate::MismatchCheck`],
///    [`Comm::set_mismatch_check`], `GRID_DEBUG=detail`): one small exchange through the
///    backend in which every rank checks that all ranks agree on the operation, dtype, counts,
///    root and reduction; on disagreement every rank returns [`Error::CollectiveMismatch`]
///    naming the ranks and their values (recorded as the operation's failure), and the backend
///    never sees the operation;
/// 6. the backend, which receives the operation as a [`Validated`] value;
/// 7. the operation log again: completed, or failed with the error (a nonblocking operation is
///    recorded started when the backend accepted it and completed or failed when its [`Work`]
///    is waited for).
///
/// # The operation log (flight recorder)
///
/// When recording is on (`GRID_TRACE_DIR` set, or `GRID_TRACE_CAPACITY=N`; see
/// [`crate::oplog`]), every communicator owns an [`OpLog`] registered with the process's
/// [`Recorder::global`] under the communicator's name and member world ranks: its last
/// `GRID_TRACE_CAPACITY` operations (default [`crate::oplog::DEFAULT_CAPACITY`]) with sequence
/// number, operation, dtype, element count, root or peer, tag, reduction, state and timestamps,
/// for two short uncontended locks and two clock reads per operation (30-50 ns). With neither
/// variable set nothing is registered, recorded or dumped, and an operation costs nothing
/// extra. Arguments rejected by validation are the caller's own bug: they
/// take no sequence number and are not recorded.
///
/// With `GRID_TRACE_DIR=DIR` set, the process writes every live communicator's log as JSON to
/// `DIR/rank-<world rank>.json` ([`crate::oplog`] has the format; `grid trace DIR` reads the
/// files of every rank):
/// * when an operation fails with a communication error ([`Error::is_communication`]):
///   reason `timeout` for [`Error::Timeout`], `abort` for [`Error::Finalized`] (an aborted or
///   finalized communicator), otherwise `failure: <op> on <communicator>: <error>`;
/// * on `kill -USR1 <pid>` (installed by the first communicator created while
///   `GRID_TRACE_DIR` is set; the signal handler only wakes a helper thread, which dumps);
/// * when the program asks: `grid_core::oplog::Recorder::global().dump("explicit")`.
///
/// The world rank in the file name is the one the program set with
/// [`Recorder::set_world_rank`], or else this process's world rank in the first communicator
/// created (`global_ranks()[rank()]`). A failed dump is reported with `tracing::warn!` and never
/// changes the operation's own result.
///
/// The communicator has a descriptive name (`"world"`, a family name such as `"tp"`, or what
/// its factory chose) that appears in spans and errors.
///
/// Backend-specific methods are reached through `Deref` (`comm.finish()` on an MPI
/// communicator) or [`Comm::inner`].
///
/// ```
/// # use grid_core::*;
/// # struct Solo([usize; 1]);
/// # impl Backend for Solo {
/// #     fn name(&self) -> &'static str { "solo" }
/// #     fn rank(&self) -> usize { 0 }
/// #     fn size(&self) -> usize { 1 }
/// #     fn global_ranks(&self) -> &[usize] { &self.0 }
/// #     fn accepts(&self, m: Memory) -> bool { m == Memory::Host }
/// #     fn supports(&self, _: DType, _: Option<ReduceOp>) -> bool { true }
/// #     fn run(&self, op: Validated<Op<'_>>) -> Result<()> {
/// #         match op.into_op() {
/// #             Op::AllReduce { send: BufRef::Host(s), recv: BufMut::Host(mut r), .. } => r.copy_from(s),
/// #             _ => Ok(()),
/// #         }
/// #     }
/// #     fn start(&self, _: Validated<Request>) -> Result<Box<dyn Work>> {
/// #         Err(Error::Unsupported { op: "start", backend: "solo", what: "nonblocking operations".into() })
/// #     }
/// #     fn default_time_limit(&self) -> TimeLimit { TimeLimit::Unlimited }
/// #     fn abort(&self) {}
/// # }
/// let comm = Comm::new(Solo([0]), "world");
/// let mut out = [0i32; 2];
/// comm.all_reduce_into(&[1, 2][..], &mut out[..], ReduceOp::Sum)?;
/// assert_eq!(out, [1, 2]);
/// // Validation happens before the backend sees anything:
/// let e = comm.all_reduce_into(&[1, 2][..], &mut [0i32; 3][..], ReduceOp::Sum).unwrap_err();
/// assert!(matches!(e, Error::LengthMismatch { expected: 2, actual: 3, .. }));
/// # Ok::<(), Error>(())
/// ```
#[derive(Debug)]
pub struct Comm<B: Backend> {
    backend: B,
    /// The descriptive name and the members, shared with the [`Work`] of nonblocking
    /// operations for their errors.
    ident: Arc<Ident>,
    life: Arc<Lifecycle>,
    seq: AtomicU64,
    recorder: &'static Recorder,
    log: Option<Arc<OpLog>>,
    pub(super) agree: super::agree::Agreement,
}

impl<B: Backend> Comm<B> {
    /// Puts `backend` behind the front end, with a descriptive `name`; its operation log is
    /// registered with [`Recorder::global`] (see the [type](Comm) documentation).
    pub fn new(backend: B, name: impl Into<String>) -> Comm<B> {
        Comm::with_recorder(backend, name, Recorder::global())
    }

    /// Like [`Comm::new`], with the operation log registered with `recorder` instead of the
    /// process's global one (tests, or a program that manages its own dump directory). The
    /// recorder's world rank is set from this communicator if it has none yet, and its
    /// SIGUSR1 dump is installed if it has a directory and no recorder installed it yet.
    pub fn with_recorder(
        backend: B,
        name: impl Into<String>,
        recorder: &'static Recorder,
    ) -> Comm<B> {
        let name = name.into();
        if let Some(&world_rank) = backend.global_ranks().get(backend.rank()) {
            recorder.set_world_rank_if_unset(world_rank);
        }
        let log = recorder
            .is_recording()
            .then(|| recorder.register(name.clone(), backend.global_ranks().to_vec()));
        #[cfg(unix)]
        if log.is_some() && recorder.trace_dir().is_some() {
            if let Err(e) = recorder.install_sigusr1_dump() {
                tracing::warn!("{e}; SIGUSR1 will not dump the operation log");
            }
        }
        let agree = super::agree::Agreement::new(&backend);
        let ident = Arc::new(Ident {
            name,
            ranks: backend.global_ranks().to_vec(),
        });
        let life = Arc::new(Lifecycle::new(backend.default_time_limit()));
        Comm {
            backend,
            ident,
            life,
            seq: AtomicU64::new(0),
            recorder,
            log,
            agree,
        }
    }

    /// This communicator's operation log (`None` when the recorder records nothing,
    /// `GRID_TRACE_CAPACITY=0`).
    pub fn op_log(&self) -> Option<&Arc<OpLog>> {
        self.log.as_ref()
    }
    /// The backend.
    pub fn inner(&self) -> &B {
        &self.backend
    }
    /// The communicator's descriptive name.
    pub fn comm_name(&self) -> &str {
        &self.ident.name
    }
    /// Aborts the communicator on this rank ([`Communicator::abort`]; here so that it is
    /// found before a backend method of the same name reached through `Deref`).
    pub fn abort(&self) {
        Communicator::abort(self)
    }
    /// Why the communicator can no longer be used ([`Communicator::failure`]).
    pub fn failure(&self) -> Option<Failure> {
        self.life.failure()
    }
    /// The default time limit of its operations ([`Communicator::time_limit`]).
    pub fn time_limit(&self) -> TimeLimit {
        self.life.time_limit()
    }
    /// Sets the default time limit of its later operations ([`Communicator::set_time_limit`]).
    pub fn set_time_limit(&self, limit: TimeLimit) {
        self.life.set_time_limit(limit)
    }
    /// `Ok` while the communicator can be used for `op`: not aborted, not failed
    /// ([`Error::Aborted`] naming why otherwise), and live for its backend
    /// ([`Backend::check_live`]). Factories call it before a split, which does not pass
    /// through the operations of the front end.
    pub fn ensure_usable(&self, op: &'static str) -> Result<()> {
        if self.life.is_stopped() {
            return Err(self.refused(op));
        }
        self.backend.check_live(op)
    }
    /// How many operations were handed to the backend so far (the next sequence number).
    pub fn ops_issued(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    // ---- validation ------------------------------------------------------------------------

    fn memory(
        &self,
        op: &'static str,
        memory: Memory,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if self.backend.accepts(memory) {
            return Ok(());
        }
        let alt = match memory {
            Memory::Device => {
                "this backend moves host memory only; copy it to the host or use the NCCL backend"
            }
            Memory::Host => "this backend moves device memory only; copy it to the device first",
        };
        Err(Error::Unsupported {
            op,
            backend: self.backend.name(),
            what: format!("{} ({}): {alt}", memory_name(memory), what()),
        })
    }

    fn input(&self, op: &'static str, b: &BufRef<'_>) -> Result<()> {
        self.memory(op, b.memory(), || describe_ref(b))?;
        self.movable(op, b.dtype())
    }

    fn output(&self, op: &'static str, b: &BufMut<'_>) -> Result<()> {
        self.memory(op, b.memory(), || describe_mut(b))?;
        self.movable(op, b.dtype())
    }

    fn owned(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.input(op, &t.as_ref())
    }

    fn movable(&self, op: &'static str, d: DType) -> Result<()> {
        if self.backend.supports(d, None) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                op,
                backend: self.backend.name(),
                what: format!("element type {d}"),
            })
        }
    }

    fn reduces(&self, op: &'static str, d: DType, r: ReduceOp) -> Result<()> {
        if d.reducible_with(r) && self.backend.supports(d, Some(r)) {
            Ok(())
        } else {
            let why = if !d.reducible_with(r) {
                " (booleans reduce with Sum or Max = OR, Prod or Min = AND)"
            } else if d.is_fp8() {
                " (this backend moves 8-bit floats but does not reduce them)"
            } else {
                ""
            };
            Err(Error::Unsupported {
                op,
                backend: self.backend.name(),
                what: format!("the reduction {r} on {d}{why}"),
            })
        }
    }

    fn root(&self, op: &'static str, root: usize) -> Result<()> {
        super::check::rank(op, "root", root, self.backend.size())
    }

    fn peer(&self, op: &'static str, peer: usize, tag: u32, allow_self: bool) -> Result<()> {
        let size = self.backend.size();
        super::check::rank(op, "peer", peer, size)?;
        if !allow_self && peer == self.backend.rank() {
            return Err(Error::SelfPeer { op, peer, size });
        }
        let max = self.backend.max_tag();
        if tag > max {
            return Err(Error::TagOutOfRange {
                op,
                backend: self.backend.name(),
                tag,
                max,
            });
        }
        Ok(())
    }

    /// A framed operation's header length, peer and tags (its own and, where the backend sends
    /// two messages, the next: refused at the backend's largest tag whatever the backend, so a
    /// program behaves the same on every backend).
    fn framed(&self, op: &'static str, head: usize, peer: usize, tag: u32) -> Result<()> {
        if head > FRAME_HEAD_MAX {
            return Err(Error::Invalid(format!(
                "{op}: a framed message's header of {head} bytes is longer than {FRAME_HEAD_MAX} bytes, the most a header can hold; send a longer one as a message of its own"
            )));
        }
        self.peer(op, peer, tag, true)?;
        let max = self.backend.max_tag();
        if tag >= max {
            return Err(Error::Invalid(format!(
                "{op}: a framed message with tag {tag} also takes tag {tag} + 1, above the largest tag of {} ({max}); use a tag of at most {}",
                self.backend.name(),
                max.saturating_sub(1)
            )));
        }
        Ok(())
    }

    /// Dtype and length rules of the two-buffer collectives.
    fn shapes(
        &self,
        op: &'static str,
        kind: Shape,
        send: (DType, usize),
        recv: (DType, usize),
    ) -> Result<()> {
        super::check::same_dtype(op, send.0, recv.0)?;
        let n = self.backend.size();
        match kind {
            Shape::Equal => super::check::len(op, "recv buffer", send.1, recv.1),
            Shape::Gather => super::check::len(op, "recv buffer", send.1 * n, recv.1),
            Shape::Scatter => super::check::len(op, "send buffer", recv.1 * n, send.1),
            Shape::Blocks => {
                super::check::len(op, "recv buffer", send.1, recv.1)?;
                if n > 0 && !send.1.is_multiple_of(n) {
                    return Err(Error::Indivisible {
                        op,
                        what: "send buffer",
                        len: send.1,
                        parts: n,
                    });
                }
                Ok(())
            }
        }
    }

    fn validate(&self, op: &Op<'_>) -> Result<()> {
        let name = op.name();
        let m = |b: &BufRef<'_>| (b.dtype(), b.len());
        let mm = |b: &BufMut<'_>| (b.dtype(), b.len());
        match op {
            Op::AllReduce { send, recv, op: r } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.shapes(name, Shape::Equal, m(send), mm(recv))?;
                self.reduces(name, send.dtype(), *r)
            }
            Op::AllReduceInPlace { buf, op: r } => {
                self.output(name, buf)?;
                self.reduces(name, buf.dtype(), *r)
            }
            Op::Broadcast { buf, root } => {
                self.output(name, buf)?;
                self.root(name, *root)
            }
            Op::AllGather { send, recv } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.shapes(name, Shape::Gather, m(send), mm(recv))
            }
            Op::AllGatherInPlace { buf } => {
                self.output(name, buf)?;
                self.blocks(name, buf.len())
            }
            Op::ReduceScatterInPlace { buf, op: r } => {
                self.output(name, buf)?;
                self.blocks(name, buf.len())?;
                self.reduces(name, buf.dtype(), *r)
            }
            Op::ReduceScatter { send, recv, op: r } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.shapes(name, Shape::Scatter, m(send), mm(recv))?;
                self.reduces(name, send.dtype(), *r)
            }
            Op::AllToAll { send, recv } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.shapes(name, Shape::Blocks, m(send), mm(recv))
            }
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.exchange_counts(name, m(send), send_counts, mm(recv), recv_counts)
            }
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.uneven(name, m(send), mm(recv), recv_counts, true)
            }
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op: r,
            } => {
                self.input(name, send)?;
                self.output(name, recv)?;
                self.uneven(name, m(send), mm(recv), send_counts, false)?;
                self.reduces(name, send.dtype(), *r)
            }
            Op::Reduce {
                send,
                recv,
                op: r,
                root,
            } => {
                self.input(name, send)?;
                self.root(name, *root)?;
                self.reduces(name, send.dtype(), *r)?;
                match self.root_buffer(name, *root, recv.as_ref(), "recv buffer")? {
                    Some(recv) => {
                        self.output(name, recv)?;
                        self.shapes(name, Shape::Equal, m(send), mm(recv))
                    }
                    None => Ok(()),
                }
            }
            Op::Gather { send, recv, root } => {
                self.input(name, send)?;
                self.root(name, *root)?;
                match self.root_buffer(name, *root, recv.as_ref(), "recv buffer")? {
                    Some(recv) => {
                        self.output(name, recv)?;
                        self.shapes(name, Shape::Gather, m(send), mm(recv))
                    }
                    None => Ok(()),
                }
            }
            Op::Scatter { send, recv, root } => {
                self.output(name, recv)?;
                self.root(name, *root)?;
                match self.root_buffer(name, *root, send.as_ref(), "send buffer")? {
                    Some(send) => {
                        self.input(name, send)?;
                        self.shapes(name, Shape::Scatter, m(send), mm(recv))
                    }
                    None => Ok(()),
                }
            }
            Op::Barrier => Ok(()),
            Op::Send { buf, peer, tag } => {
                self.input(name, buf)?;
                self.peer(name, *peer, *tag, false)
            }
            Op::Recv { buf, peer, tag } => {
                self.output(name, buf)?;
                self.peer(name, *peer, *tag, false)
            }
            Op::Batch(ops) => {
                for o in ops {
                    match o {
                        P2pOp::Send { buf, peer, tag } => {
                            self.input(name, buf)?;
                            self.peer(name, *peer, *tag, true)?;
                        }
                        P2pOp::Recv { buf, peer, tag } => {
                            self.output(name, buf)?;
                            self.peer(name, *peer, *tag, true)?;
                        }
                        P2pOp::SendFramed {
                            head,
                            buf,
                            peer,
                            tag,
                        } => {
                            self.input(name, buf)?;
                            self.framed(name, head.len(), *peer, *tag)?;
                        }
                        P2pOp::RecvFramed {
                            head,
                            buf,
                            peer,
                            tag,
                        } => {
                            self.output(name, buf)?;
                            self.framed(name, head.len(), *peer, *tag)?;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    fn validate_request(&self, r: &Request) -> Result<()> {
        let name = r.name();
        let m = |t: &Tensor| (t.dtype(), t.len());
        match r {
            Request::AllReduceInto { send, recv, op } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.shapes(name, Shape::Equal, m(send), m(recv))?;
                self.reduces(name, send.dtype(), *op)
            }
            Request::AllReduce { buf, op } => {
                self.owned(name, buf)?;
                self.reduces(name, buf.dtype(), *op)
            }
            Request::Broadcast { buf, root } => {
                self.owned(name, buf)?;
                self.root(name, *root)
            }
            Request::AllGather { send, recv } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.shapes(name, Shape::Gather, m(send), m(recv))
            }
            Request::AllGatherInPlace { buf } => {
                self.owned(name, buf)?;
                self.blocks(name, buf.len())
            }
            Request::ReduceScatterInPlace { buf, op } => {
                self.owned(name, buf)?;
                self.blocks(name, buf.len())?;
                self.reduces(name, buf.dtype(), *op)
            }
            Request::ReduceScatter { send, recv, op } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.shapes(name, Shape::Scatter, m(send), m(recv))?;
                self.reduces(name, send.dtype(), *op)
            }
            Request::AllToAll { send, recv } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.shapes(name, Shape::Blocks, m(send), m(recv))
            }
            Request::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.exchange_counts(name, m(send), send_counts, m(recv), recv_counts)
            }
            Request::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.uneven(name, m(send), m(recv), recv_counts, true)
            }
            Request::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                self.owned(name, send)?;
                self.owned(name, recv)?;
                self.uneven(name, m(send), m(recv), send_counts, false)?;
                self.reduces(name, send.dtype(), *op)
            }
            Request::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                self.owned(name, send)?;
                self.root(name, *root)?;
                self.reduces(name, send.dtype(), *op)?;
                match self.root_buffer(name, *root, recv.as_ref(), "recv buffer")? {
                    Some(recv) => {
                        self.owned(name, recv)?;
                        self.shapes(name, Shape::Equal, m(send), m(recv))
                    }
                    None => Ok(()),
                }
            }
            Request::Gather { send, recv, root } => {
                self.owned(name, send)?;
                self.root(name, *root)?;
                match self.root_buffer(name, *root, recv.as_ref(), "recv buffer")? {
                    Some(recv) => {
                        self.owned(name, recv)?;
                        self.shapes(name, Shape::Gather, m(send), m(recv))
                    }
                    None => Ok(()),
                }
            }
            Request::Scatter { send, recv, root } => {
                self.owned(name, recv)?;
                self.root(name, *root)?;
                match self.root_buffer(name, *root, send.as_ref(), "send buffer")? {
                    Some(send) => {
                        self.owned(name, send)?;
                        self.shapes(name, Shape::Scatter, m(send), m(recv))
                    }
                    None => Ok(()),
                }
            }
            Request::Barrier => Ok(()),
            Request::Send { buf, peer, tag } | Request::Recv { buf, peer, tag } => {
                self.owned(name, buf)?;
                self.peer(name, *peer, *tag, false)
            }
        }
    }

    /// The length rule of the in-place all-gather and reduce-scatter: one buffer of `size`
    /// equal blocks (`len` a multiple of the communicator's size), else
    /// [`Error::Indivisible`] naming the length and the size.
    fn blocks(&self, op: &'static str, len: usize) -> Result<()> {
        let n = self.backend.size();
        if n > 0 && !len.is_multiple_of(n) {
            return Err(Error::Indivisible {
                op,
                what: "in-place buffer (one block of count elements per rank)",
                len,
                parts: n,
            });
        }
        Ok(())
    }

    /// The counts rules of all-to-all-v: one entry per rank in each vector, each summing to its
    /// buffer's length; same dtype on both sides.
    fn exchange_counts(
        &self,
        op: &'static str,
        send: (DType, usize),
        send_counts: &[usize],
        recv: (DType, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        super::check::same_dtype(op, send.0, recv.0)?;
        let n = self.backend.size();
        super::check::counts(op, "send_counts", send_counts, n, "send buffer", send.1)?;
        super::check::counts(op, "recv_counts", recv_counts, n, "recv buffer", recv.1)
    }

    /// The counts rules of all-gather-v (`gather`: `counts` are the receive counts, this
    /// rank's entry is the send length) and reduce-scatter-v (`!gather`: `counts` are the send
    /// blocks, this rank's entry is the receive length); same dtype on both sides.
    fn uneven(
        &self,
        op: &'static str,
        send: (DType, usize),
        recv: (DType, usize),
        counts: &[usize],
        gather: bool,
    ) -> Result<()> {
        super::check::same_dtype(op, send.0, recv.0)?;
        let (n, me) = (self.backend.size(), self.backend.rank());
        if gather {
            super::check::counts(op, "recv_counts", counts, n, "recv buffer", recv.1)?;
            super::check::len(op, "send buffer (recv_counts[rank])", counts[me], send.1)
        } else {
            super::check::counts(op, "send_counts", counts, n, "send buffer", send.1)?;
            super::check::len(op, "recv buffer (send_counts[rank])", counts[me], recv.1)
        }
    }

    /// The buffer of a rooted operation that only the root uses: on the root it must be
    /// given (returned), elsewhere it is ignored (`None`).
    fn root_buffer<'b, T>(
        &self,
        op: &'static str,
        root: usize,
        buf: Option<&'b T>,
        what: &'static str,
    ) -> Result<Option<&'b T>> {
        if self.backend.rank() != root {
            return Ok(None);
        }
        buf.map(Some)
            .ok_or(Error::MissingRootBuffer { op, what, root })
    }

    // ---- the one place every operation passes ------------------------------------------------

    /// Takes the next sequence number and records the operation in the log (posted, or
    /// posted and started at once). With a log, the log's number is the operation's number
    /// (the two counters agree; the log's is the one taken under its lock).
    fn number(&self, desc: impl FnOnce() -> OpDesc, started: bool) -> (u64, Option<OpHandle>) {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        match &self.log {
            Some(log) => {
                let h = if started {
                    log.begin_started(desc())
                } else {
                    log.begin(desc())
                };
                (h.seq(), Some(h))
            }
            None => (n, None),
        }
    }

    /// The `trace`-level span of one operation: the operation, the communicator's name, the
    /// backend, the sequence number and the elements sent and received.
    #[inline]
    fn span(
        &self,
        op: &'static str,
        seq: u64,
        (send, recv): (usize, usize),
        nonblocking: bool,
    ) -> tracing::Span {
        tracing::trace_span!(
            "comm",
            op,
            comm = %self.ident.name,
            backend = self.backend.name(),
            seq,
            send,
            recv,
            nonblocking
        )
    }

    /// The error of an operation refused because the communicator was aborted or failed.
    #[cold]
    fn refused(&self, op: &'static str) -> Error {
        refusal(&self.life, &self.ident, op)
    }

    /// Validates, numbers, records, traces and runs a blocking operation.
    fn call(&self, op: Op<'_>, limit: Option<TimeLimit>) -> Result<()> {
        let name = op.name();
        if self.life.is_stopped() {
            return Err(self.refused(name));
        }
        self.backend.check_live(name)?;
        let op = only_at_root(op, self.backend.rank());
        self.validate(&op)?;
        let op = match op {
            Op::Batch(ops) if !self.backend.sends_framed() && ops.iter().any(P2pOp::is_framed) => {
                Op::Batch(P2pOp::lower_framed(ops))
            }
            op => op,
        };
        let limit = limit.unwrap_or_else(|| self.life.time_limit());
        let size = self.backend.size();
        let (seq, handle) = self.number(|| describe_op(&op, size), true);
        let span = self.span(name, seq, op.sizes_on(size), false);
        let _g = span.enter();
        let result = self
            .agree_op(&op, seq, limit)
            .and_then(|check| {
                self.backend
                    .run(Validated::new(op, seq, limit).with_check(check))
            })
            .map_err(|e| op_failed(&self.life, &self.ident, name, seq, e));
        if let (Some(log), Some(h)) = (&self.log, handle) {
            ended(log, self.recorder, name, h, &result);
        }
        result
    }

    /// Validates, numbers, records, traces and starts a nonblocking operation.
    fn call_start(&self, r: Request, limit: Option<TimeLimit>) -> Result<Box<dyn Work>> {
        let name = r.name();
        if self.life.is_stopped() {
            return Err(self.refused(name));
        }
        self.backend.check_live(name)?;
        let r = request_only_at_root(r, self.backend.rank());
        self.validate_request(&r)?;
        let limit = limit.unwrap_or_else(|| self.life.time_limit());
        let size = self.backend.size();
        let (seq, handle) = self.number(|| describe_request(&r, size), false);
        let span = self.span(name, seq, r.sizes_on(size), true);
        let _g = span.enter();
        let started = self
            .agree_request(&r, seq, limit)
            .and_then(|check| {
                self.backend
                    .start(Validated::new(r, seq, limit).with_check(check))
            })
            .map_err(|e| op_failed(&self.life, &self.ident, name, seq, e));
        let log = match (&self.log, handle) {
            (Some(log), Some(h)) => match &started {
                Ok(_) => {
                    log.mark_started(h);
                    Some((Arc::clone(log), self.recorder, h))
                }
                Err(e) => {
                    failed(log, self.recorder, name, h, e);
                    None
                }
            },
            _ => None,
        };
        let inner = started?;
        Ok(Box::new(FrontWork {
            inner,
            life: Arc::clone(&self.life),
            ident: Arc::clone(&self.ident),
            op: name,
            seq,
            log,
        }))
    }
}

/// A communicator's name and members, for the errors of its operations.
#[derive(Debug)]
struct Ident {
    name: String,
    ranks: Vec<usize>,
}

impl Ident {
    fn site(&self, seq: Option<u64>) -> OpSite {
        OpSite {
            comm: self.name.clone(),
            ranks: self.ranks.clone(),
            seq,
        }
    }
}

/// What an operation on an aborted or failed communicator returns.
#[cold]
fn refusal(life: &Lifecycle, ident: &Ident, op: &'static str) -> Error {
    let reason = match life.failure() {
        Some(f) if f.aborted => {
            "the communicator was aborted on this rank (abort() was called); create a new one"
                .to_string()
        }
        Some(f) => format!("the communicator failed earlier ({f}); create a new one"),
        None => "the communicator was aborted; create a new one".to_string(),
    };
    Error::Aborted {
        op,
        reason,
        at: Some(Box::new(ident.site(None))),
    }
}

/// The error of operation `op` #`seq` that failed with `e`: an error of an aborted
/// communicator becomes [`Error::Aborted`] (whatever the backend reported when it was woken),
/// the site is added, and a communication failure fails the communicator.
#[cold]
fn op_failed(life: &Lifecycle, ident: &Ident, op: &'static str, seq: u64, e: Error) -> Error {
    let e = match life.failure() {
        Some(f) if f.aborted && !matches!(e, Error::Aborted { .. }) => Error::Aborted {
            op,
            reason: format!(
                "the communicator was aborted on this rank (abort() was called) while the operation was in progress (the backend reported: {e})"
            ),
            at: None,
        },
        _ => e,
    };
    let e = e.with_site(|| ident.site(Some(seq)));
    if fails_communicator(&e) {
        life.record(Failure {
            aborted: matches!(e, Error::Aborted { .. }),
            op,
            seq: Some(seq),
            blamed: blamed(&e),
            message: e.to_string(),
        });
    }
    e
}

/// Records the end of an operation: completed, or failed (and dumped, see [`failed`]).
fn ended<T>(log: &OpLog, recorder: &Recorder, op: &'static str, h: OpHandle, r: &Result<T>) {
    match r {
        Ok(_) => {
            log.complete(h);
        }
        Err(e) => failed(log, recorder, op, h, e),
    }
}

/// Records a failed operation and, for a communication error, dumps the process's logs (when
/// the recorder has a directory).
#[cold]
fn failed(log: &OpLog, recorder: &Recorder, op: &'static str, h: OpHandle, e: &Error) {
    log.fail(h, e.to_string());
    if !e.is_communication() || recorder.trace_dir().is_none() {
        return;
    }
    let reason = dump_reason(op, log.name(), e);
    match recorder.dump(&reason) {
        Ok(Some(path)) => tracing::info!("operation log dumped to {} ({reason})", path.display()),
        Ok(None) => {}
        Err(d) => tracing::warn!("cannot dump the operation log ({reason}): {d}"),
    }
}

/// The reason a failed operation gives its dump: `timeout`, `abort`, or
/// `failure: <op> on <communicator>: <error>`.
fn dump_reason(op: &str, comm: &str, e: &Error) -> String {
    match e {
        Error::Timeout { .. } => "timeout".to_string(),
        Error::Finalized { .. } | Error::Aborted { .. } => "abort".to_string(),
        other => format!("failure: {op} on {comm}: {other}"),
    }
}

/// A nonblocking operation's [`Work`] behind the front end: its error gets the site and fails
/// the communicator as a blocking operation's would, and with an operation log it records the
/// operation's end when it is waited for (a work dropped without a wait stays `started` in the
/// log).
struct FrontWork {
    inner: Box<dyn Work>,
    life: Arc<Lifecycle>,
    ident: Arc<Ident>,
    op: &'static str,
    seq: u64,
    log: Option<(Arc<OpLog>, &'static Recorder, OpHandle)>,
}

impl FrontWork {
    fn finish(&self, r: Result<Tensor>) -> Result<Tensor> {
        let r = r.map_err(|e| op_failed(&self.life, &self.ident, self.op, self.seq, e));
        if let Some((log, recorder, h)) = &self.log {
            ended(log, recorder, self.op, *h, &r);
        }
        r
    }
}

impl Work for FrontWork {
    fn is_completed(&mut self) -> bool {
        self.inner.is_completed()
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let mut me = *self;
        let inner = std::mem::replace(&mut me.inner, Box::new(Done));
        let r = inner.wait();
        me.finish(r)
    }

    fn wait_timeout(
        self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        let mut me = *self;
        let inner = std::mem::replace(&mut me.inner, Box::new(Done));
        match inner.wait_timeout(timeout) {
            Ok(r) => Ok(me.finish(r)),
            Err(inner) => {
                me.inner = inner;
                Err(Box::new(me))
            }
        }
    }
}

/// The placeholder left in a [`FrontWork`] while its real work is being waited for.
struct Done;

impl Work for Done {
    fn is_completed(&mut self) -> bool {
        true
    }
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Err(Error::Invalid(
            "internal: a finished work was waited for twice".into(),
        ))
    }
    fn wait_timeout(
        self: Box<Self>,
        _: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        Ok(self.wait())
    }
}

/// The reduction's name as the log records it (`sum`, `max`, ...).
fn reduce_name(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "sum",
        ReduceOp::Prod => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Avg => "avg",
    }
}

/// A rooted operation with the buffer that only the root uses dropped on every other rank
/// (whatever a non-root passed there is ignored, as MPI's "significant only at root"), so that
/// backends see `Some` exactly on the root.
fn only_at_root(op: Op<'_>, me: usize) -> Op<'_> {
    match op {
        Op::Reduce {
            send,
            recv: Some(_),
            op,
            root,
        } if root != me => Op::Reduce {
            send,
            recv: None,
            op,
            root,
        },
        Op::Gather {
            send,
            recv: Some(_),
            root,
        } if root != me => Op::Gather {
            send,
            recv: None,
            root,
        },
        Op::Scatter {
            send: Some(_),
            recv,
            root,
        } if root != me => Op::Scatter {
            send: None,
            recv,
            root,
        },
        other => other,
    }
}

/// [`only_at_root`] for nonblocking requests.
fn request_only_at_root(r: Request, me: usize) -> Request {
    match r {
        Request::Reduce {
            send,
            recv: Some(_),
            op,
            root,
        } if root != me => Request::Reduce {
            send,
            recv: None,
            op,
            root,
        },
        Request::Gather {
            send,
            recv: Some(_),
            root,
        } if root != me => Request::Gather {
            send,
            recv: None,
            root,
        },
        Request::Scatter {
            send: Some(_),
            recv,
            root,
        } if root != me => Request::Scatter {
            send: None,
            recv,
            root,
        },
        other => other,
    }
}

/// The log's description of a blocking operation: the dtype and the elements this rank sends
/// (for a receive or a broadcast, the buffer's; for the in-place all-gather and reduce-scatter
/// what their out-of-place forms send, so both forms log alike), root or peer and tag; a batch
/// records the dtype of its first operation and the elements of all of them. `size`: the
/// communicator's.
fn describe_op(op: &Op<'_>, size: usize) -> OpDesc {
    let d = OpDesc::new(op.name());
    let reducing = |d: OpDesc, b: &BufRef<'_>, r: ReduceOp| {
        d.dtype(b.dtype().name())
            .count(b.len())
            .reduce_op(reduce_name(r))
    };
    match op {
        Op::AllReduce { send, op: r, .. } | Op::ReduceScatter { send, op: r, .. } => {
            reducing(d, send, *r)
        }
        Op::AllReduceInPlace { buf, op: r } | Op::ReduceScatterInPlace { buf, op: r } => d
            .dtype(buf.dtype().name())
            .count(buf.len())
            .reduce_op(reduce_name(*r)),
        Op::AllGatherInPlace { buf } => d.dtype(buf.dtype().name()).count(op.sizes_on(size).0),
        Op::Broadcast { buf, root } => d.dtype(buf.dtype().name()).count(buf.len()).root(*root),
        Op::AllGather { send, .. }
        | Op::AllToAll { send, .. }
        | Op::AllToAllV { send, .. }
        | Op::AllGatherV { send, .. } => d.dtype(send.dtype().name()).count(send.len()),
        Op::ReduceScatterV { send, op: r, .. } => reducing(d, send, *r),
        Op::Reduce {
            send, op: r, root, ..
        } => reducing(d, send, *r).root(*root),
        Op::Gather { send, root, .. } => d.dtype(send.dtype().name()).count(send.len()).root(*root),
        Op::Scatter { send, recv, root } => d
            .dtype(recv.dtype().name())
            .count(send.as_ref().map_or(0, BufRef::len))
            .root(*root),
        Op::Barrier => d,
        Op::Send { buf, peer, tag } => d
            .dtype(buf.dtype().name())
            .count(buf.len())
            .peer(*peer)
            .tag(u64::from(*tag)),
        Op::Recv { buf, peer, tag } => d
            .dtype(buf.dtype().name())
            .count(buf.len())
            .peer(*peer)
            .tag(u64::from(*tag)),
        Op::Batch(ops) => {
            let (send, recv) = op.sizes();
            let first = ops.first().map(|o| match o {
                P2pOp::Send { buf, .. } | P2pOp::SendFramed { buf, .. } => buf.dtype(),
                P2pOp::Recv { buf, .. } | P2pOp::RecvFramed { buf, .. } => buf.dtype(),
            });
            let d = d.count(send + recv);
            match first {
                Some(t) => d.dtype(t.name()),
                None => d,
            }
        }
    }
}

/// The log's description of a nonblocking operation (as [`describe_op`]).
fn describe_request(r: &Request, size: usize) -> OpDesc {
    let d = OpDesc::new(r.name());
    let t = |d: OpDesc, b: &Tensor| d.dtype(b.dtype().name()).count(b.len());
    match r {
        Request::AllReduceInto { send, op, .. } | Request::ReduceScatter { send, op, .. } => {
            t(d, send).reduce_op(reduce_name(*op))
        }
        Request::AllReduce { buf, op } | Request::ReduceScatterInPlace { buf, op } => {
            t(d, buf).reduce_op(reduce_name(*op))
        }
        Request::AllGatherInPlace { buf } => d.dtype(buf.dtype().name()).count(r.sizes_on(size).0),
        Request::Broadcast { buf, root } => t(d, buf).root(*root),
        Request::AllGather { send, .. }
        | Request::AllToAll { send, .. }
        | Request::AllToAllV { send, .. }
        | Request::AllGatherV { send, .. } => t(d, send),
        Request::ReduceScatterV { send, op, .. } => t(d, send).reduce_op(reduce_name(*op)),
        Request::Reduce { send, op, root, .. } => {
            t(d, send).reduce_op(reduce_name(*op)).root(*root)
        }
        Request::Gather { send, root, .. } => t(d, send).root(*root),
        Request::Scatter { send, recv, root } => d
            .dtype(recv.dtype().name())
            .count(send.as_ref().map_or(0, Tensor::len))
            .root(*root),
        Request::Barrier => d,
        Request::Send { buf, peer, tag } | Request::Recv { buf, peer, tag } => {
            t(d, buf).peer(*peer).tag(u64::from(*tag))
        }
    }
}

#[derive(Clone, Copy)]
enum Shape {
    Equal,
    Gather,
    Scatter,
    Blocks,
}

fn memory_name(m: Memory) -> &'static str {
    match m {
        Memory::Host => "host memory",
        Memory::Device => "device memory",
    }
}

fn describe_ref(b: &BufRef<'_>) -> String {
    match b {
        BufRef::Host(h) => format!("{} {} elements", h.len(), h.dtype()),
        BufRef::Device(d) => format!(
            "{} {} elements on device {}",
            d.len(),
            d.dtype(),
            d.device()
        ),
    }
}

fn describe_mut(b: &BufMut<'_>) -> String {
    match b {
        BufMut::Host(h) => format!("{} {} elements", h.len(), h.dtype()),
        BufMut::Device(d) => format!(
            "{} {} elements on device {}",
            d.len(),
            d.dtype(),
            d.device()
        ),
    }
}

impl<B: Backend> std::ops::Deref for Comm<B> {
    type Target = B;
    fn deref(&self) -> &B {
        &self.backend
    }
}

impl<B: Backend> Communicator for Comm<B> {
    fn backend(&self) -> &'static str {
        self.backend.name()
    }
    fn name(&self) -> &str {
        &self.ident.name
    }
    fn rank(&self) -> usize {
        self.backend.rank()
    }
    fn size(&self) -> usize {
        self.backend.size()
    }
    fn global_ranks(&self) -> &[usize] {
        self.backend.global_ranks()
    }
    fn accepts(&self, memory: Memory) -> bool {
        self.backend.accepts(memory)
    }
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        self.backend.supports(dtype, op)
    }
    fn receive_placement(&self) -> Option<super::ReceivePlacement> {
        self.backend.receive_placement()
    }
    fn abort(&self) {
        let first = self.life.record(Failure {
            aborted: true,
            op: "abort",
            seq: None,
            blamed: None,
            message: "aborted on this rank (abort() was called)".to_string(),
        });
        self.backend.abort();
        if first && self.log.is_some() && self.recorder.trace_dir().is_some() {
            match self.recorder.dump("abort") {
                Ok(Some(path)) => {
                    tracing::info!("operation log dumped to {} (abort)", path.display())
                }
                Ok(None) => {}
                Err(d) => tracing::warn!("cannot dump the operation log (abort): {d}"),
            }
        }
    }
    fn failure(&self) -> Option<Failure> {
        self.life.failure()
    }
    fn time_limit(&self) -> TimeLimit {
        self.life.time_limit()
    }
    fn set_time_limit(&self, limit: TimeLimit) {
        self.life.set_time_limit(limit)
    }
    fn call_op(&self, op: Op<'_>, limit: Option<TimeLimit>) -> Result<()> {
        self.call(op, limit)
    }
    fn start_op(&self, request: Request, limit: Option<TimeLimit>) -> Result<Box<dyn Work>> {
        self.call_start(request, limit)
    }
    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call(Op::AllReduce { send, recv, op }, None)
    }
    fn in_place_all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call(Op::AllReduceInPlace { buf, op }, None)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.call(Op::Broadcast { buf, root }, None)
    }
    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        self.call(Op::AllGather { send, recv }, None)
    }
    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.call(Op::ReduceScatter { send, recv, op }, None)
    }
    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        self.call(Op::AllToAll { send, recv }, None)
    }
    fn barrier(&self) -> Result<()> {
        self.call(Op::Barrier, None)
    }
    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        self.call(Op::Send { buf, peer, tag }, None)
    }
    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        self.call(Op::Recv { buf, peer, tag }, None)
    }
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        self.call(Op::Batch(ops), None)
    }
    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        self.call_start(request, None)
    }
    fn synchronize(&self) -> Result<()> {
        if self.life.is_stopped() {
            return Err(self.refused("synchronize"));
        }
        self.backend.check_live("synchronize")?;
        self.backend.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommunicatorExt;
    use std::sync::Mutex;

    /// Records what reaches the backend: (op, sequence number, address of an in-place buffer).
    struct Recorder {
        ranks: Vec<usize>,
        seen: Mutex<Vec<(&'static str, u64, usize)>>,
    }

    impl Backend for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            self.ranks.len()
        }
        fn global_ranks(&self) -> &[usize] {
            &self.ranks
        }
        fn accepts(&self, m: Memory) -> bool {
            m == Memory::Host
        }
        fn supports(&self, d: DType, op: Option<ReduceOp>) -> bool {
            !(d == DType::U8 && op == Some(ReduceOp::Prod))
        }
        fn max_tag(&self) -> u32 {
            100
        }
        fn run(&self, v: Validated<Op<'_>>) -> Result<()> {
            let seq = v.seq();
            let mut op = v.into_op();
            let addr = match &mut op {
                Op::AllReduceInPlace {
                    buf: BufMut::Host(h),
                    ..
                }
                | Op::AllGatherInPlace {
                    buf: BufMut::Host(h),
                }
                | Op::ReduceScatterInPlace {
                    buf: BufMut::Host(h),
                    ..
                } => h.as_mut_ptr() as usize,
                _ => 0,
            };
            self.seen.lock().unwrap().push((op.name(), seq, addr));
            Ok(())
        }
        fn start(&self, v: Validated<Request>) -> Result<Box<dyn Work>> {
            self.seen.lock().unwrap().push((v.op().name(), v.seq(), 0));
            Err(Error::Unsupported {
                op: "start",
                backend: "recorder",
                what: "nonblocking operations".into(),
            })
        }
        fn default_time_limit(&self) -> TimeLimit {
            TimeLimit::from_millis(100)
        }
        fn abort(&self) {}
    }

    /// Framed operations are validated on every backend (header length, both tags) and reach a
    /// backend that does not send them as the two plain operations each stands for.
    #[test]
    fn framed_operations_are_validated_then_lowered() {
        let c = Comm::new(
            Recorder {
                ranks: vec![5, 7],
                seen: Mutex::new(Vec::new()),
            },
            "pp",
        );
        let data = [1.0f32; 2];
        let framed = |head: &'static [u8], tag: u32| {
            vec![P2pOp::SendFramed {
                head,
                buf: BufRef::from(&data[..]),
                peer: 1,
                tag,
            }]
        };
        static LONG: [u8; FRAME_HEAD_MAX + 1] = [0; FRAME_HEAD_MAX + 1];
        let e = c.batch_p2p(framed(&LONG, 3)).unwrap_err();
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("65 bytes is longer than 64 bytes")),
            "{e}"
        );
        // Tag 100 is this backend's largest: the payload would need 101.
        let e = c.batch_p2p(framed(&[1, 2], 100)).unwrap_err();
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("tag 100 also takes tag 100 + 1") && m.contains("at most 99")),
            "{e}"
        );
        assert!(matches!(
            c.batch_p2p(framed(&[1, 2], 101)),
            Err(Error::TagOutOfRange { tag: 101, .. })
        ));
        // None of those reached the backend; a valid one does, lowered.
        assert!(c.inner().seen.lock().unwrap().is_empty());
        c.batch_p2p(framed(&[1, 2], 99)).unwrap();
        assert_eq!(c.inner().seen.lock().unwrap().len(), 1);
        let mut ops = P2pOp::lower_framed(framed(&[1, 2], 99));
        assert!(matches!(
            &ops[..],
            [P2pOp::Send { buf: h, peer: 1, tag: 99 }, P2pOp::Send { buf: d, peer: 1, tag: 100 }]
                if h.len() == 2 && h.dtype() == DType::U8 && d.len() == 2
        ));
        let (mut head, mut got) = ([0u8; 2], [0f32; 2]);
        ops = P2pOp::lower_framed(vec![P2pOp::RecvFramed {
            head: &mut head,
            buf: BufMut::from(&mut got[..]),
            peer: 1,
            tag: 4,
        }]);
        assert!(matches!(
            &ops[..],
            [P2pOp::Recv { tag: 4, .. }, P2pOp::Recv { tag: 5, .. }]
        ));
    }

    #[test]
    fn validation_happens_before_the_backend_and_numbers_only_issued_ops() {
        let c = Comm::new(
            Recorder {
                ranks: vec![5, 7],
                seen: Mutex::new(Vec::new()),
            },
            "tp",
        );
        let mut buf = [1.0f32; 4];
        let addr = buf.as_mut_ptr() as usize;
        c.all_reduce_in_place(&mut buf[..], ReduceOp::Sum).unwrap();
        assert!(matches!(
            c.send_to(&[1f32][..], 0, 0),
            Err(Error::SelfPeer {
                peer: 0,
                size: 2,
                ..
            })
        ));
        assert!(matches!(
            c.send_to(&[1f32][..], 1, 101),
            Err(Error::TagOutOfRange {
                tag: 101,
                max: 100,
                ..
            })
        ));
        assert!(matches!(
            c.all_to_all_into(&[1f32; 3][..], &mut [0f32; 3][..]),
            Err(Error::Indivisible {
                len: 3,
                parts: 2,
                ..
            })
        ));
        assert!(matches!(
            c.all_reduce_into(&[1u8][..], &mut [0u8][..], ReduceOp::Prod),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            c.all_gather_into(&[1i64][..], &mut [0i64; 3][..]),
            Err(Error::LengthMismatch {
                expected: 2,
                actual: 3,
                ..
            })
        ));
        assert!(matches!(
            c.iall_reduce_into(vec![1i32], vec![0i32; 2], ReduceOp::Sum),
            Err(Error::LengthMismatch {
                expected: 1,
                actual: 2,
                ..
            })
        ));
        // The in-place all-gather and reduce-scatter: one block per rank, else Indivisible
        // naming the length and the size.
        let e = c.all_gather_in_place(&mut [0i32; 3][..]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Indivisible {
                    op: "all_gather",
                    len: 3,
                    parts: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "all_gather: in-place buffer (one block of count elements per rank) of 3 elements cannot be cut into 2 equal blocks (give a multiple of 2)"
        );
        assert!(matches!(
            c.reduce_scatter_in_place(&mut [0f64; 5][..], ReduceOp::Sum),
            Err(Error::Indivisible {
                op: "reduce_scatter",
                len: 5,
                parts: 2,
                ..
            })
        ));
        assert!(matches!(
            c.reduce_scatter_in_place(&mut [0u8; 4][..], ReduceOp::Prod),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            c.iall_gather_in_place(vec![0i32; 7]),
            Err(Error::Indivisible {
                len: 7,
                parts: 2,
                ..
            })
        ));
        let mut gathered = [0i32; 4];
        let gaddr = gathered.as_mut_ptr() as usize;
        c.all_gather_in_place(&mut gathered[..]).unwrap();
        let mut scattered = [0i32; 6];
        let saddr = scattered.as_mut_ptr() as usize;
        c.reduce_scatter_in_place(&mut scattered[..], ReduceOp::Max)
            .unwrap();
        c.barrier().unwrap();
        assert!(c.ibarrier().is_err());
        // The in-place all-reduce reached the backend as the caller's own buffer (no copy);
        // rejected calls never reached it and took no sequence number.
        assert_eq!(
            *c.inner().seen.lock().unwrap(),
            vec![
                ("all_reduce", 0, addr),
                ("all_gather", 1, gaddr),
                ("reduce_scatter", 2, saddr),
                ("barrier", 3, 0),
                ("barrier", 4, 0)
            ]
        );
        assert_eq!(c.ops_issued(), 5);
        assert_eq!(Communicator::name(&c), "tp");
        assert_eq!(c.global_ranks(), &[5, 7]);
    }
}
