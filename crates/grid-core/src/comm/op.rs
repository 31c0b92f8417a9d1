//! Typed descriptions of operations.

use super::agree::DeferredCheck;
use super::buffer::{BufMut, BufRef, Tensor};
use super::dtype::ReduceOp;
use super::lifecycle::TimeLimit;

/// Largest header of a framed message ([`P2pOp::SendFramed`], [`P2pOp::RecvFramed`]), in bytes.
pub const FRAME_HEAD_MAX: usize = 64;

/// One operation of a batched point-to-point exchange ([`super::Communicator::batch_p2p`]).
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send `buf` to communicator rank `peer`.
    Send {
        /// Data.
        buf: BufRef<'a>,
        /// Destination (communicator rank).
        peer: usize,
        /// Message tag (NCCL matches by order and ignores it).
        tag: u32,
    },
    /// Receive into `buf` from communicator rank `peer`.
    Recv {
        /// Destination memory.
        buf: BufMut<'a>,
        /// Source (communicator rank).
        peer: usize,
        /// Message tag.
        tag: u32,
    },
    /// Send a small fixed-size header `head` (at most [`FRAME_HEAD_MAX`] bytes, host memory:
    /// a status, a shape) together with `buf` to `peer`, for a [`P2pOp::RecvFramed`] of the same
    /// tag and header length: one message where the backend can carry both
    /// ([`super::Backend::sends_framed`]; Gloo), with no extra message for the header. Other
    /// backends send two: `head` (as `u8`) with `tag` and `buf` with `tag + 1`
    /// ([`P2pOp::lower_framed`]), so `tag + 1` must be a valid tag too and no other message
    /// between the same two ranks in the batch may use it.
    SendFramed {
        /// The header.
        head: &'a [u8],
        /// The payload.
        buf: BufRef<'a>,
        /// Destination (communicator rank).
        peer: usize,
        /// Message tag (`tag + 1` too where the backend sends two messages).
        tag: u32,
    },
    /// Receive a framed message ([`P2pOp::SendFramed`]): its header into `head` (exactly as
    /// long as the sender's) and its payload into `buf`.
    RecvFramed {
        /// The header's memory.
        head: &'a mut [u8],
        /// The payload's memory.
        buf: BufMut<'a>,
        /// Source (communicator rank).
        peer: usize,
        /// Message tag (`tag + 1` too where the backend receives two messages).
        tag: u32,
    },
}

impl<'a> P2pOp<'a> {
    /// The same exchange without framed operations, for backends that cannot send a header and
    /// a payload as one message: each framed operation becomes two, the header (as `u8`) with
    /// its tag and the payload with the tag + 1, in that order; plain operations stay as they
    /// are. The tag + 1 must exist (the front end refuses a framed operation at the backend's
    /// largest tag).
    ///
    /// ```
    /// use grid_core::{BufRef, P2pOp};
    /// let (head, data) = ([1u8, 2], [3.0f32; 4]);
    /// let ops = vec![P2pOp::SendFramed { head: &head, buf: BufRef::from(&data[..]), peer: 1, tag: 7 }];
    /// let lowered = P2pOp::lower_framed(ops);
    /// assert!(matches!(lowered[..], [
    ///     P2pOp::Send { ref buf, peer: 1, tag: 7 },
    ///     P2pOp::Send { peer: 1, tag: 8, .. },
    /// ] if buf.len() == 2));
    /// ```
    pub fn lower_framed(ops: Vec<P2pOp<'a>>) -> Vec<P2pOp<'a>> {
        let mut out = Vec::with_capacity(ops.len() * 2);
        for op in ops {
            match op {
                P2pOp::SendFramed {
                    head,
                    buf,
                    peer,
                    tag,
                } => {
                    out.push(P2pOp::Send {
                        buf: BufRef::from(head),
                        peer,
                        tag,
                    });
                    out.push(P2pOp::Send {
                        buf,
                        peer,
                        tag: tag.wrapping_add(1),
                    });
                }
                P2pOp::RecvFramed {
                    head,
                    buf,
                    peer,
                    tag,
                } => {
                    out.push(P2pOp::Recv {
                        buf: BufMut::from(head),
                        peer,
                        tag,
                    });
                    out.push(P2pOp::Recv {
                        buf,
                        peer,
                        tag: tag.wrapping_add(1),
                    });
                }
                plain => out.push(plain),
            }
        }
        out
    }

    /// Whether this is a framed operation.
    pub fn is_framed(&self) -> bool {
        matches!(self, P2pOp::SendFramed { .. } | P2pOp::RecvFramed { .. })
    }

    /// The error of a backend that does not send framed messages
    /// ([`super::Backend::sends_framed`] false) and was handed one anyway: the front end lowers
    /// them first ([`P2pOp::lower_framed`]), so only a caller of [`super::Backend::run`] that
    /// bypassed it gets this.
    pub fn not_lowered(backend: &'static str) -> crate::Error {
        crate::Error::Unsupported {
            op: "batch_p2p",
            backend,
            what: "a framed message handed to the backend directly (this backend sends them as two messages: call batch_p2p through the front end, grid_core::Comm, which lowers them)".into(),
        }
    }
}

/// A nonblocking operation to start ([`super::Communicator::start`]). Buffers are owned and come back
/// through [`super::Work::wait`].
#[derive(Debug)]
pub enum Request {
    /// All-reduce `send` into `recv` (out of place; same dtype and length).
    AllReduceInto {
        /// Input.
        send: Tensor,
        /// Result.
        recv: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// All-reduce `buf` in place.
    AllReduce {
        /// Input and result.
        buf: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// Broadcast `buf` from `root` (in place).
    Broadcast {
        /// Input on the root, result everywhere.
        buf: Tensor,
        /// Root (communicator rank).
        root: usize,
    },
    /// All-gather `send` into `recv` (`recv.len() == size · send.len()`).
    AllGather {
        /// This rank's block.
        send: Tensor,
        /// Result.
        recv: Tensor,
    },
    /// Reduce-scatter `send` into `recv` (`send.len() == size · recv.len()`).
    ReduceScatter {
        /// Input.
        send: Tensor,
        /// This rank's reduced block.
        recv: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// All-gather in place: `buf` holds `size · count` elements, this rank's block already at
    /// `rank · count`; afterwards every block is filled. `wait` returns `buf`.
    AllGatherInPlace {
        /// Every rank's block in rank order; this rank's is the input.
        buf: Tensor,
    },
    /// Reduce-scatter in place: `buf` holds `size · count` input elements; afterwards this
    /// rank's reduced block is at `rank · count..(rank + 1) · count` (NCCL's convention) and the
    /// rest of `buf` is unspecified. `wait` returns `buf`.
    ReduceScatterInPlace {
        /// Input; this rank's reduced block afterwards.
        buf: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// All-to-all with equal blocks (`send.len() == recv.len()`, divisible by size).
    AllToAll {
        /// Block `j` goes to rank `j`.
        send: Tensor,
        /// Block `j` comes from rank `j`.
        recv: Tensor,
    },
    /// All-to-all with per-peer counts: the first `send_counts[0]` elements of `send` go to
    /// rank 0, the next `send_counts[1]` to rank 1, ...; `recv` receives `recv_counts[j]`
    /// elements from rank `j`, in rank order. `wait` returns `recv`.
    AllToAllV {
        /// Input, in destination order.
        send: Tensor,
        /// Elements for each rank (`size` entries, summing to `send.len()`).
        send_counts: Vec<usize>,
        /// Result, in source order.
        recv: Tensor,
        /// Elements from each rank (`size` entries, summing to `recv.len()`).
        recv_counts: Vec<usize>,
    },
    /// All-gather with per-rank counts: rank `j` contributes `recv_counts[j]` elements; `wait`
    /// returns `recv`, every rank's contribution in rank order.
    AllGatherV {
        /// This rank's contribution (`recv_counts[rank]` elements).
        send: Tensor,
        /// Result (`sum(recv_counts)` elements).
        recv: Tensor,
        /// Elements from each rank (`size` entries, equal on every rank).
        recv_counts: Vec<usize>,
    },
    /// Reduce-scatter with per-rank counts: `send` holds one block per rank, block `j` of
    /// `send_counts[j]` elements; rank `j` receives the reduction of every rank's block `j`.
    /// `wait` returns `recv`.
    ReduceScatterV {
        /// Input (`sum(send_counts)` elements).
        send: Tensor,
        /// Block sizes (`size` entries, equal on every rank).
        send_counts: Vec<usize>,
        /// This rank's reduced block (`send_counts[rank]` elements).
        recv: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// Rooted reduce: the reduction of every rank's `send` lands in `recv` on `root`. `wait`
    /// returns `recv` on the root and `send` elsewhere.
    Reduce {
        /// Input.
        send: Tensor,
        /// Result, significant only on the root (`Some` there; ignored elsewhere).
        recv: Option<Tensor>,
        /// Reduction.
        op: ReduceOp,
        /// Root (communicator rank).
        root: usize,
    },
    /// Rooted gather: the root's `recv` receives every rank's `send` in rank order. `wait`
    /// returns `recv` on the root and `send` elsewhere.
    Gather {
        /// This rank's block.
        send: Tensor,
        /// Result (`size · send.len()`), significant only on the root.
        recv: Option<Tensor>,
        /// Root.
        root: usize,
    },
    /// Rooted scatter: block `j` (`recv.len()` elements) of the root's `send` goes to rank `j`.
    /// `wait` returns `recv`.
    Scatter {
        /// Input (`size · recv.len()`), significant only on the root.
        send: Option<Tensor>,
        /// This rank's block.
        recv: Tensor,
        /// Root.
        root: usize,
    },
    /// Barrier.
    Barrier,
    /// Send to a peer.
    Send {
        /// Data.
        buf: Tensor,
        /// Destination.
        peer: usize,
        /// Tag.
        tag: u32,
    },
    /// Receive from a peer.
    Recv {
        /// Destination memory (its length is the message length).
        buf: Tensor,
        /// Source.
        peer: usize,
        /// Tag.
        tag: u32,
    },
}

impl Request {
    /// Short name of the operation, for errors and tracing.
    #[inline]
    pub fn name(&self) -> &'static str {
        match self {
            Request::AllReduce { .. } | Request::AllReduceInto { .. } => "all_reduce",
            Request::Broadcast { .. } => "broadcast",
            Request::AllGather { .. } | Request::AllGatherInPlace { .. } => "all_gather",
            Request::ReduceScatter { .. } | Request::ReduceScatterInPlace { .. } => {
                "reduce_scatter"
            }
            Request::AllToAll { .. } => "all_to_all",
            Request::AllToAllV { .. } => "all_to_all_v",
            Request::AllGatherV { .. } => "all_gather_v",
            Request::ReduceScatterV { .. } => "reduce_scatter_v",
            Request::Reduce { .. } => "reduce",
            Request::Gather { .. } => "gather",
            Request::Scatter { .. } => "scatter",
            Request::Barrier => "barrier",
            Request::Send { .. } => "send",
            Request::Recv { .. } => "recv",
        }
    }
}

/// The owned (nonblocking) form of an operation: today's [`Request`].
pub type OwnedOp = Request;

impl Request {
    /// For backends that still implement [`super::Communicator`] directly and do not yet run
    /// [`Request::AllReduceInto`] themselves: validates it (host memory, same dtype and
    /// length), copies `send` into `recv` and returns the in-place [`Request::AllReduce`] on
    /// `recv`; every other request is returned unchanged. Backends behind the front end
    /// ([`super::Comm`]) never need this: they receive the out-of-place form as it is.
    ///
    /// ```
    /// use grid_core::{ReduceOp, Request};
    /// let r = Request::AllReduceInto { send: vec![1i32, 2].into(), recv: vec![0i32; 2].into(), op: ReduceOp::Sum };
    /// match r.into_in_place("gloo").unwrap() {
    ///     Request::AllReduce { buf, .. } => assert_eq!(buf.into_vec::<i32>().unwrap(), vec![1, 2]),
    ///     other => panic!("{other:?}"),
    /// }
    /// ```
    pub fn into_in_place(self, backend: &'static str) -> crate::Result<Request> {
        match self {
            Request::AllReduceInto { send, recv, op } => {
                let send = send.host_only("all_reduce", backend)?;
                let mut recv = recv.host_only("all_reduce", backend)?;
                super::check::same_dtype("all_reduce", send.dtype(), recv.dtype())?;
                super::check::len("all_reduce", "recv buffer", send.len(), recv.len())?;
                recv.as_mut_slice().copy_from(send.as_slice())?;
                Ok(Request::AllReduce {
                    buf: Tensor::Host(recv),
                    op,
                })
            }
            other => Ok(other),
        }
    }

    /// The sizes this request moves, for tracing and errors: (elements of the input, elements
    /// of the output); for the in-place all-gather and reduce-scatter, the whole buffer twice
    /// ([`Request::sizes_on`] counts them as their out-of-place forms do).
    #[inline]
    pub fn sizes(&self) -> (usize, usize) {
        match self {
            Request::AllReduceInto { send, recv, .. }
            | Request::AllGather { send, recv }
            | Request::ReduceScatter { send, recv, .. }
            | Request::AllToAll { send, recv }
            | Request::AllToAllV { send, recv, .. }
            | Request::AllGatherV { send, recv, .. }
            | Request::ReduceScatterV { send, recv, .. } => (send.len(), recv.len()),
            Request::Reduce { send, recv, .. } | Request::Gather { send, recv, .. } => {
                (send.len(), recv.as_ref().map_or(0, Tensor::len))
            }
            Request::Scatter { send, recv, .. } => {
                (send.as_ref().map_or(0, Tensor::len), recv.len())
            }
            Request::AllReduce { buf, .. }
            | Request::AllGatherInPlace { buf }
            | Request::ReduceScatterInPlace { buf, .. }
            | Request::Broadcast { buf, .. }
            | Request::Send { buf, .. }
            | Request::Recv { buf, .. } => (buf.len(), buf.len()),
            Request::Barrier => (0, 0),
        }
    }

    /// [`Request::sizes`] on a communicator of `size` ranks, with the in-place all-gather and
    /// reduce-scatter counted as their out-of-place forms (all-gather: `(count, size · count)`,
    /// reduce-scatter: `(size · count, count)`), so that the two forms of one call trace, log
    /// and fingerprint alike.
    ///
    /// ```
    /// use grid_core::Request;
    /// let r = Request::AllGatherInPlace { buf: vec![0i32; 6].into() };
    /// assert_eq!((r.sizes(), r.sizes_on(3)), ((6, 6), (2, 6)));
    /// ```
    #[inline]
    pub fn sizes_on(&self, size: usize) -> (usize, usize) {
        match self {
            Request::AllGatherInPlace { buf } => (buf.len() / size.max(1), buf.len()),
            Request::ReduceScatterInPlace { buf, .. } => (buf.len(), buf.len() / size.max(1)),
            other => other.sizes(),
        }
    }
}

/// A blocking operation on borrowed buffers, as the front end ([`super::Comm`]) hands it to a
/// [`super::Backend`] after validation.
#[derive(Debug)]
pub enum Op<'a> {
    /// Out-of-place all-reduce: `send` reduced over all ranks into `recv`.
    AllReduce {
        /// Input.
        send: BufRef<'a>,
        /// Result (same dtype and length).
        recv: BufMut<'a>,
        /// Reduction.
        op: ReduceOp,
    },
    /// In-place all-reduce of `buf`.
    AllReduceInPlace {
        /// Input and result.
        buf: BufMut<'a>,
        /// Reduction.
        op: ReduceOp,
    },
    /// Broadcast of `buf` from `root`.
    Broadcast {
        /// Input on the root, result elsewhere.
        buf: BufMut<'a>,
        /// Root (communicator rank).
        root: usize,
    },
    /// All-gather (`recv.len() == size · send.len()`).
    AllGather {
        /// This rank's block.
        send: BufRef<'a>,
        /// Every block, in rank order.
        recv: BufMut<'a>,
    },
    /// Reduce-scatter (`send.len() == size · recv.len()`).
    ReduceScatter {
        /// Input.
        send: BufRef<'a>,
        /// This rank's reduced block.
        recv: BufMut<'a>,
        /// Reduction.
        op: ReduceOp,
    },
    /// In-place all-gather ([`Request::AllGatherInPlace`]): `buf` holds `size · count`
    /// elements, this rank's block at `rank · count` is the input.
    AllGatherInPlace {
        /// Every rank's block in rank order.
        buf: BufMut<'a>,
    },
    /// In-place reduce-scatter ([`Request::ReduceScatterInPlace`]): `buf` holds `size · count`
    /// input elements; afterwards this rank's reduced block is at `rank · count` and the rest
    /// is unspecified.
    ReduceScatterInPlace {
        /// Input; this rank's reduced block afterwards.
        buf: BufMut<'a>,
        /// Reduction.
        op: ReduceOp,
    },
    /// All-to-all with equal blocks.
    AllToAll {
        /// Block `j` goes to rank `j`.
        send: BufRef<'a>,
        /// Block `j` comes from rank `j`.
        recv: BufMut<'a>,
    },
    /// All-to-all with per-peer counts ([`Request::AllToAllV`]).
    AllToAllV {
        /// Input, `send_counts[j]` elements for rank `j`, in rank order.
        send: BufRef<'a>,
        /// Elements for each rank (`size` entries summing to `send.len()`).
        send_counts: &'a [usize],
        /// Result, `recv_counts[j]` elements from rank `j`, in rank order.
        recv: BufMut<'a>,
        /// Elements from each rank (`size` entries summing to `recv.len()`).
        recv_counts: &'a [usize],
    },
    /// All-gather with per-rank counts ([`Request::AllGatherV`]).
    AllGatherV {
        /// This rank's contribution (`recv_counts[rank]` elements).
        send: BufRef<'a>,
        /// Every contribution, in rank order (`sum(recv_counts)` elements).
        recv: BufMut<'a>,
        /// Elements from each rank (`size` entries, equal on every rank).
        recv_counts: &'a [usize],
    },
    /// Reduce-scatter with per-rank counts ([`Request::ReduceScatterV`]).
    ReduceScatterV {
        /// Input, block `j` of `send_counts[j]` elements for rank `j`.
        send: BufRef<'a>,
        /// Block sizes (`size` entries, equal on every rank).
        send_counts: &'a [usize],
        /// This rank's reduced block (`send_counts[rank]` elements).
        recv: BufMut<'a>,
        /// Reduction.
        op: ReduceOp,
    },
    /// Rooted reduce. `recv` is `Some` exactly on the root (same dtype and length as `send`):
    /// the front end drops whatever another rank passed.
    Reduce {
        /// Input.
        send: BufRef<'a>,
        /// Result on the root; `None` elsewhere.
        recv: Option<BufMut<'a>>,
        /// Reduction.
        op: ReduceOp,
        /// Root (communicator rank).
        root: usize,
    },
    /// Rooted gather. `recv` is `Some` exactly on the root (`size · send.len()` elements).
    Gather {
        /// This rank's block.
        send: BufRef<'a>,
        /// Every block in rank order, on the root; `None` elsewhere.
        recv: Option<BufMut<'a>>,
        /// Root.
        root: usize,
    },
    /// Rooted scatter. `send` is `Some` exactly on the root (`size · recv.len()` elements).
    Scatter {
        /// Every rank's block in rank order, on the root; `None` elsewhere.
        send: Option<BufRef<'a>>,
        /// This rank's block.
        recv: BufMut<'a>,
        /// Root.
        root: usize,
    },
    /// Barrier.
    Barrier,
    /// Send to `peer` (never this rank).
    Send {
        /// Data.
        buf: BufRef<'a>,
        /// Destination.
        peer: usize,
        /// Tag.
        tag: u32,
    },
    /// Receive exactly `buf.len()` elements from `peer` (never this rank).
    Recv {
        /// Destination memory.
        buf: BufMut<'a>,
        /// Source.
        peer: usize,
        /// Tag.
        tag: u32,
    },
    /// Sends and receives posted together (peers may include this rank).
    Batch(Vec<P2pOp<'a>>),
}

impl Op<'_> {
    /// Short name of the operation, for errors and tracing.
    ///
    /// ```
    /// assert_eq!(grid_core::Op::Barrier.name(), "barrier");
    /// ```
    #[inline]
    pub fn name(&self) -> &'static str {
        match self {
            Op::AllReduce { .. } | Op::AllReduceInPlace { .. } => "all_reduce",
            Op::Broadcast { .. } => "broadcast",
            Op::AllGather { .. } | Op::AllGatherInPlace { .. } => "all_gather",
            Op::ReduceScatter { .. } | Op::ReduceScatterInPlace { .. } => "reduce_scatter",
            Op::AllToAll { .. } => "all_to_all",
            Op::AllToAllV { .. } => "all_to_all_v",
            Op::AllGatherV { .. } => "all_gather_v",
            Op::ReduceScatterV { .. } => "reduce_scatter_v",
            Op::Reduce { .. } => "reduce",
            Op::Gather { .. } => "gather",
            Op::Scatter { .. } => "scatter",
            Op::Barrier => "barrier",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Batch(_) => "batch_p2p",
        }
    }

    /// (elements of the input, elements of the output), for tracing; for the in-place
    /// all-gather and reduce-scatter, the whole buffer twice ([`Op::sizes_on`] counts them as
    /// their out-of-place forms do).
    #[inline]
    pub fn sizes(&self) -> (usize, usize) {
        match self {
            Op::AllReduce { send, recv, .. }
            | Op::AllGather { send, recv }
            | Op::ReduceScatter { send, recv, .. }
            | Op::AllToAll { send, recv }
            | Op::AllToAllV { send, recv, .. }
            | Op::AllGatherV { send, recv, .. }
            | Op::ReduceScatterV { send, recv, .. } => (send.len(), recv.len()),
            Op::Reduce { send, recv, .. } | Op::Gather { send, recv, .. } => {
                (send.len(), recv.as_ref().map_or(0, BufMut::len))
            }
            Op::Scatter { send, recv, .. } => (send.as_ref().map_or(0, BufRef::len), recv.len()),
            Op::AllReduceInPlace { buf, .. }
            | Op::AllGatherInPlace { buf }
            | Op::ReduceScatterInPlace { buf, .. }
            | Op::Broadcast { buf, .. }
            | Op::Recv { buf, .. } => (buf.len(), buf.len()),
            Op::Send { buf, .. } => (buf.len(), buf.len()),
            Op::Barrier => (0, 0),
            Op::Batch(ops) => ops.iter().fold((0, 0), |(s, r), o| match o {
                P2pOp::Send { buf, .. } | P2pOp::SendFramed { buf, .. } => (s + buf.len(), r),
                P2pOp::Recv { buf, .. } | P2pOp::RecvFramed { buf, .. } => (s, r + buf.len()),
            }),
        }
    }

    /// [`Op::sizes`] on a communicator of `size` ranks, with the in-place all-gather and
    /// reduce-scatter counted as their out-of-place forms (all-gather: `(count, size · count)`,
    /// reduce-scatter: `(size · count, count)`), so that the two forms of one call trace, log
    /// and fingerprint alike.
    ///
    /// ```
    /// use grid_core::{BufMut, Op, ReduceOp};
    /// let mut v = [0f32; 8];
    /// let op = Op::ReduceScatterInPlace { buf: BufMut::from(&mut v[..]), op: ReduceOp::Sum };
    /// assert_eq!((op.sizes(), op.sizes_on(4)), ((8, 8), (8, 2)));
    /// ```
    #[inline]
    pub fn sizes_on(&self, size: usize) -> (usize, usize) {
        match self {
            Op::AllGatherInPlace { buf } => (buf.len() / size.max(1), buf.len()),
            Op::ReduceScatterInPlace { buf, .. } => (buf.len(), buf.len() / size.max(1)),
            other => other.sizes(),
        }
    }
}

/// An operation that passed the front end's validation ([`super::Comm`]): only `grid-core`
/// can build one, so a [`super::Backend`] that receives it may rely on every check listed in
/// [`super::Backend`] (dtype and length agreement, ranks and tags in range, supported dtype,
/// reduction and memory kind, a live communicator). It also carries the operation's sequence
/// number on this communicator.
#[derive(Debug)]
pub struct Validated<T> {
    op: T,
    seq: u64,
    limit: TimeLimit,
    check: Option<DeferredCheck>,
}

impl<T> Validated<T> {
    pub(crate) fn new(op: T, seq: u64, limit: TimeLimit) -> Validated<T> {
        Validated {
            op,
            seq,
            limit,
            check: None,
        }
    }
    pub(crate) fn with_check(mut self, check: Option<DeferredCheck>) -> Validated<T> {
        self.check = check;
        self
    }
    /// The mismatch check to run right before this collective executes, when the backend runs
    /// checks in its own order ([`super::Backend::checks_when_run`]) and the communicator's mode
    /// checks it; `None` otherwise.
    pub fn check(&self) -> Option<&DeferredCheck> {
        self.check.as_ref()
    }
    /// Takes the check out (see [`Validated::check`]), leaving `None`: a backend that runs it
    /// itself keeps it beside the operation without a copy.
    pub fn take_check(&mut self) -> Option<DeferredCheck> {
        self.check.take()
    }
    /// How long the operation may wait for its peers (the communicator's default or the
    /// caller's override, [`super::CommunicatorExt::with_time_limit`]): past it the backend
    /// returns [`crate::Error::Timeout`]. A backend measures it from when it starts waiting.
    pub fn time_limit(&self) -> TimeLimit {
        self.limit
    }
    /// The operation.
    pub fn op(&self) -> &T {
        &self.op
    }
    /// The operation, by value.
    pub fn into_op(self) -> T {
        self.op
    }
    /// Its sequence number on this communicator (0 for the first operation; every blocking or
    /// nonblocking operation of this rank's communicator takes the next number).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}
