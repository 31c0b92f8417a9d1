//! # grid-async
//!
//! An **async communicator** for frameworks that drive their loops from an async runtime
//! (tokio or any other executor): [`AsyncCommunicator`], object safe (declared with
//! `async-trait`), used as `Arc<dyn AsyncCommunicator>`, with every collective, the
//! point-to-point operations and the barrier as methods that return futures. It is implemented
//! once, by [`AsyncComm`], over grid-core's [`Communicator`] front end, so it works for every
//! backend (MPI, Gloo, NCCL, local) with the same validation, errors, timeouts and abort.
//!
//! ```
//! use grid_async::{AsyncComm, AsyncCommunicator, AsyncCommunicatorExt};
//! use grid_core::ReduceOp;
//! use std::sync::Arc;
//!
//! # fn block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     // A minimal executor for the example (tokio or any other works the same way).
//! #     struct Wake(std::thread::Thread);
//! #     impl std::task::Wake for Wake { fn wake(self: Arc<Self>) { self.0.unpark() } }
//! #     let waker = Arc::new(Wake(std::thread::current())).into();
//! #     let mut cx = std::task::Context::from_waker(&waker);
//! #     let mut f = std::pin::pin!(f);
//! #     loop {
//! #         if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; }
//! #         std::thread::park();
//! #     }
//! # }
//! let sums = backend_local::run(2, &Default::default(), |_factory, world| {
//!     let comm: Arc<dyn AsyncCommunicator> = AsyncComm::shared(Arc::new(world));
//!     block_on(async {
//!         let sum = comm.all_reduce_vec(vec![comm.rank() as i64 + 1; 3], ReduceOp::Sum);
//!         let all = comm.all_gather_vec(vec![comm.rank() as i32]);
//!         // Both are in flight now; await them in any order.
//!         assert_eq!(all.await?, vec![0, 1]);
//!         sum.await
//!     })
//! })?;
//! assert_eq!(sums, vec![vec![3, 3, 3], vec![3, 3, 3]]);
//! # Ok::<(), grid_core::Error>(())
//! ```
//!
//! ## How an operation completes
//! * Calling a method **starts** the operation at once, through [`Communicator::start`] (so
//!   arguments are validated, and a refused start is an error from the returned future), just
//!   as `start` does; awaiting only waits for completion. Collectives on one communicator are
//!   therefore started in the order of the calls, which must be the same on every rank, as
//!   for blocking calls, whatever order the futures are awaited or polled in.
//! * The started operation's [`Work`](grid_core::Work) goes to a **completion thread** of a
//!   small shared pool (module [`completion`]), which blocks in
//!   [`Work::wait`](grid_core::Work::wait) and then wakes the future's waker. No executor
//!   thread blocks while an operation is in flight, and nothing polls in a loop: the blocking
//!   happens on the completion thread, which is not an executor thread.
//!   The pool keeps one thread per operation in flight (so completions never queue behind each
//!   other) and lets a thread idle for [`completion::IDLE_EXIT`] exit. Cost per operation: a
//!   channel send to an idle completion thread (a thread start when none is idle), and one
//!   wake. The `Work` API has no waker hook; a backend with one could complete without the
//!   thread, but that would change every backend, so it is not done.
//! * **Dropping a future** before completion does not cancel the operation: the completion
//!   thread owns its `Work` and waits for it to the end, so the buffers stay alive until the
//!   library is done with them — the guarantee of dropping a `Work`.
//! * **Timeouts and abort** are the backend's, unchanged: an operation that times out (Gloo's
//!   per-operation timeout, the local backend's) or is aborted resolves its future with that
//!   error ([`grid_core::Error::Timeout`], [`grid_core::Error::PeerFailed`],
//!   [`grid_core::Error::Library`]).
//!
//! ## Buffers
//! Buffers are **owned**: a method takes its input as a [`Tensor`] (or a `Vec<T>` through
//! [`AsyncCommunicatorExt`]) and its future returns the result buffer, as
//! [`Work::wait`](grid_core::Work::wait) does.
//! Owning is what makes a dropped future sound: a future that borrowed the caller's buffer
//! could be dropped (or leaked) while the library still writes into it.
//! Point-to-point batches ([`Communicator::batch_p2p`]) have no nonblocking form in grid-core
//! and so none here; start the sends and receives one by one (they are posted at once and
//! match in any order).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod completion;

pub use completion::{completion_threads, Completion};

use async_trait::async_trait;
use grid_core::{
    Communicator, Element, Error, Failure, HostBuffer, ReduceOp, Request, Result, Tensor, TimeLimit,
};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// A boxed future of an operation's result, as the methods of [`AsyncCommunicator`] return it
/// (the form `async-trait` gives an `async fn`).
pub type OpFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// An object-safe async communicator: `Arc<dyn AsyncCommunicator>`.
///
/// One required async method, [`AsyncCommunicator::run`], starts a [`Request`] and resolves
/// to its result buffer; every collective, point-to-point operation and the barrier are
/// provided on top of it. Each provided method starts its operation when called (see the
/// crate docs) and returns its future; `comm.all_reduce(buf, op).await` reads as an `async fn`.
/// Implementations of `run` should start the operation in the call, as [`AsyncComm`] does,
/// so that the start order is the call order.
///
/// The typed forms on vectors (`all_reduce_vec`, `send_vec`, ...) are in
/// [`AsyncCommunicatorExt`].
#[async_trait]
pub trait AsyncCommunicator: Send + Sync {
    /// Backend name (`"mpi"`, `"gloo"`, `"nccl"`, `"local"`).
    fn backend(&self) -> &'static str;
    /// The communicator's descriptive name (`"world"`, a family name such as `"dp"`, ...).
    fn name(&self) -> &str;
    /// This process's rank in the communicator.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// World ranks of the members, in communicator-rank order.
    fn global_ranks(&self) -> &[usize];

    /// Starts `request` and resolves to its result buffer (the buffer
    /// [`Work::wait`](grid_core::Work::wait) returns:
    /// the in-place buffer for all-reduce, broadcast and receive, `recv` for the two-buffer
    /// collectives, the sent buffer for a send, an empty buffer for the barrier).
    async fn run(&self, request: Request) -> Result<Tensor>;
    /// [`AsyncCommunicator::run`] with a time limit for this operation only, instead of the
    /// communicator's default ([`grid_core::Communicator::call_op`]).
    async fn run_limited(&self, request: Request, limit: TimeLimit) -> Result<Tensor>;

    /// Aborts the communicator on this rank ([`grid_core::Communicator::abort`]): every pending
    /// future resolves to `Error::Aborted`, and so does every later operation.
    fn abort(&self);
    /// Why the communicator can no longer be used ([`grid_core::Communicator::failure`]).
    fn failure(&self) -> Option<Failure>;
    /// The default time limit of its operations ([`grid_core::Communicator::time_limit`]).
    fn time_limit(&self) -> TimeLimit;
    /// Sets that default ([`grid_core::Communicator::set_time_limit`]).
    fn set_time_limit(&self, limit: TimeLimit);

    /// All-reduce of `buf` over all ranks, in place; resolves to the reduced buffer.
    fn all_reduce(&self, buf: Tensor, op: ReduceOp) -> OpFuture<'_, Tensor> {
        self.run(Request::AllReduce { buf, op })
    }
    /// All-reduce of `send` into `recv` (same dtype and length); resolves to `recv`.
    fn all_reduce_into(&self, send: Tensor, recv: Tensor, op: ReduceOp) -> OpFuture<'_, Tensor> {
        self.run(Request::AllReduceInto { send, recv, op })
    }
    /// Broadcast of `buf` from communicator rank `root`; resolves to the buffer, now holding
    /// the root's data.
    fn broadcast(&self, buf: Tensor, root: usize) -> OpFuture<'_, Tensor> {
        self.run(Request::Broadcast { buf, root })
    }
    /// All-gather of `send` into `recv` (`size · send.len()` elements); resolves to `recv`.
    fn all_gather(&self, send: Tensor, recv: Tensor) -> OpFuture<'_, Tensor> {
        self.run(Request::AllGather { send, recv })
    }
    /// Reduce-scatter of `send` (`size · recv.len()` elements) into `recv`; resolves to
    /// `recv`, this rank's reduced block.
    fn reduce_scatter(&self, send: Tensor, recv: Tensor, op: ReduceOp) -> OpFuture<'_, Tensor> {
        self.run(Request::ReduceScatter { send, recv, op })
    }
    /// All-gather in place: `buf` holds `size · count` elements with this rank's block at
    /// `rank · count`; resolves to `buf` with every block filled
    /// ([`grid_core::Communicator::in_place_all_gather`]).
    fn all_gather_in_place(&self, buf: Tensor) -> OpFuture<'_, Tensor> {
        self.run(Request::AllGatherInPlace { buf })
    }
    /// Reduce-scatter in place: `buf` holds `size · count` input elements; resolves to `buf`
    /// with this rank's reduced block at `rank · count..(rank + 1) · count` and the rest
    /// unspecified ([`grid_core::Communicator::in_place_reduce_scatter`]).
    fn reduce_scatter_in_place(&self, buf: Tensor, op: ReduceOp) -> OpFuture<'_, Tensor> {
        self.run(Request::ReduceScatterInPlace { buf, op })
    }
    /// All-to-all with equal blocks (same length, divisible by the size); resolves to `recv`.
    fn all_to_all(&self, send: Tensor, recv: Tensor) -> OpFuture<'_, Tensor> {
        self.run(Request::AllToAll { send, recv })
    }
    /// All-to-all with per-peer counts: `send_counts[j]` elements of `send` (in rank order) go
    /// to rank `j`, `recv_counts[j]` arrive from it; resolves to `recv`.
    fn all_to_all_v(
        &self,
        send: Tensor,
        send_counts: Vec<usize>,
        recv: Tensor,
        recv_counts: Vec<usize>,
    ) -> OpFuture<'_, Tensor> {
        self.run(Request::AllToAllV {
            send,
            send_counts,
            recv,
            recv_counts,
        })
    }
    /// All-gather with per-rank counts (rank `j` contributes `recv_counts[j]` elements);
    /// resolves to `recv`.
    fn all_gather_v(
        &self,
        send: Tensor,
        recv: Tensor,
        recv_counts: Vec<usize>,
    ) -> OpFuture<'_, Tensor> {
        self.run(Request::AllGatherV {
            send,
            recv,
            recv_counts,
        })
    }
    /// Reduce-scatter with per-rank counts (block `j` of `send` has `send_counts[j]`
    /// elements); resolves to `recv`, this rank's reduced block.
    fn reduce_scatter_v(
        &self,
        send: Tensor,
        send_counts: Vec<usize>,
        recv: Tensor,
        op: ReduceOp,
    ) -> OpFuture<'_, Tensor> {
        self.run(Request::ReduceScatterV {
            send,
            send_counts,
            recv,
            op,
        })
    }
    /// Rooted reduce: resolves to `recv` (the reduction) on `root`, to `send` elsewhere
    /// (`recv` is significant only at the root).
    fn reduce(
        &self,
        send: Tensor,
        recv: Option<Tensor>,
        op: ReduceOp,
        root: usize,
    ) -> OpFuture<'_, Tensor> {
        self.run(Request::Reduce {
            send,
            recv,
            op,
            root,
        })
    }
    /// Rooted gather: resolves to `recv` (`size · send.len()` elements, rank order) on `root`,
    /// to `send` elsewhere.
    fn gather(&self, send: Tensor, recv: Option<Tensor>, root: usize) -> OpFuture<'_, Tensor> {
        self.run(Request::Gather { send, recv, root })
    }
    /// Rooted scatter: block `j` of the root's `send` (`recv.len()` elements each) to rank
    /// `j`; resolves to `recv` (`send` is significant only at the root).
    fn scatter(&self, send: Option<Tensor>, recv: Tensor, root: usize) -> OpFuture<'_, Tensor> {
        self.run(Request::Scatter { send, recv, root })
    }
    /// Barrier; resolves once every rank arrived.
    fn barrier(&self) -> OpFuture<'_, ()> {
        let started = self.run(Request::Barrier);
        Box::pin(async move { started.await.map(|_| ()) })
    }
    /// Sends `buf` to communicator rank `peer` with `tag`; resolves to the sent buffer.
    fn send(&self, buf: Tensor, peer: usize, tag: u32) -> OpFuture<'_, Tensor> {
        self.run(Request::Send { buf, peer, tag })
    }
    /// Receives `buf.len()` elements from communicator rank `peer` with `tag` into `buf`;
    /// resolves to the filled buffer.
    fn recv(&self, buf: Tensor, peer: usize, tag: u32) -> OpFuture<'_, Tensor> {
        self.run(Request::Recv { buf, peer, tag })
    }
}

/// The future of a typed operation ([`AsyncCommunicatorExt`]): the erased result buffer,
/// checked to hold `T` (a different element type is an error, never reinterpreted data).
pub struct Typed<'a, T: Element> {
    inner: OpFuture<'a, Tensor>,
    _t: PhantomData<fn() -> T>,
}

impl<'a, T: Element> Typed<'a, T> {
    fn new(inner: OpFuture<'a, Tensor>) -> Self {
        Typed {
            inner,
            _t: PhantomData,
        }
    }
}

impl<T: Element> Typed<'_, T> {
    /// A future that resolves to `e` at once (an argument refused before anything started).
    fn failed(e: Error) -> Self {
        Typed::new(Box::pin(std::future::ready(Err(e))))
    }
}

/// The zero-filled receive buffer of `sum(counts)` elements of `T` (a sum that overflows, or
/// bytes that do not fit in memory, is an error).
fn zeros_for<T: Element>(counts: &[usize]) -> Result<Tensor> {
    let n = grid_core::comm::check::total(counts).unwrap_or(usize::MAX);
    Tensor::host_zeros(T::DTYPE, n)
}

impl<T: Element> std::fmt::Debug for Typed<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Typed").field("dtype", &T::DTYPE).finish()
    }
}

impl<T: Element> Future for Typed<'_, T> {
    type Output = Result<Vec<T>>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Vec<T>>> {
        self.inner
            .as_mut()
            .poll(cx)
            .map(|r| r.and_then(Tensor::into_vec))
    }
}

/// Typed forms of [`AsyncCommunicator`] on owned vectors, for every async communicator
/// (including `dyn AsyncCommunicator`). Each starts its operation when called.
pub trait AsyncCommunicatorExt: AsyncCommunicator {
    /// All-reduce of `buf` in place; resolves to the reduced vector.
    fn all_reduce_vec<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Typed<'_, T> {
        Typed::new(self.all_reduce(buf.into(), op))
    }
    /// Broadcast from `root`; resolves to the root's vector (`buf` has the same length on
    /// every rank).
    fn broadcast_vec<T: Element>(&self, buf: Vec<T>, root: usize) -> Typed<'_, T> {
        Typed::new(self.broadcast(buf.into(), root))
    }
    /// All-gather; resolves to the `size · send.len()` elements of every rank in rank order.
    fn all_gather_vec<T: Element>(&self, send: Vec<T>) -> Typed<'_, T> {
        let n = match send.len().checked_mul(self.size()) {
            Some(n) => n,
            None => {
                return Typed::new(Box::pin(std::future::ready(Err(Error::Invalid(format!(
                    "all_gather: {} elements times {} ranks overflows a buffer length",
                    send.len(),
                    self.size()
                ))))))
            }
        };
        let recv = Tensor::Host(HostBuffer::zeros(T::DTYPE, n));
        Typed::new(self.all_gather(send.into(), recv))
    }
    /// Reduce-scatter; resolves to this rank's reduced block of `send.len() / size` elements
    /// (`send.len()` must be divisible by the size, or the future resolves to the error).
    fn reduce_scatter_vec<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Typed<'_, T> {
        let size = self.size().max(1);
        // An indivisible length gives a recv length that the front end rejects, naming both.
        let recv = Tensor::Host(HostBuffer::zeros(T::DTYPE, send.len() / size));
        Typed::new(self.reduce_scatter(send.into(), recv, op))
    }
    /// All-gather in place ([`AsyncCommunicator::all_gather_in_place`]); resolves to `buf`
    /// (`size · count` elements) with every block filled.
    fn all_gather_in_place_vec<T: Element>(&self, buf: Vec<T>) -> Typed<'_, T> {
        Typed::new(self.all_gather_in_place(buf.into()))
    }
    /// Reduce-scatter in place ([`AsyncCommunicator::reduce_scatter_in_place`]); resolves to
    /// `buf` with this rank's reduced block at `rank · count` (the rest unspecified).
    fn reduce_scatter_in_place_vec<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Typed<'_, T> {
        Typed::new(self.reduce_scatter_in_place(buf.into(), op))
    }
    /// All-to-all with equal blocks; resolves to the received blocks in rank order.
    fn all_to_all_vec<T: Element>(&self, send: Vec<T>) -> Typed<'_, T> {
        let recv = Tensor::Host(HostBuffer::zeros(T::DTYPE, send.len()));
        Typed::new(self.all_to_all(send.into(), recv))
    }
    /// All-to-all with per-peer counts; resolves to the `sum(recv_counts)` received elements
    /// (rank order).
    fn all_to_all_v_vec<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Typed<'_, T> {
        match zeros_for::<T>(&recv_counts) {
            Ok(recv) => Typed::new(self.all_to_all_v(send.into(), send_counts, recv, recv_counts)),
            Err(e) => Typed::failed(e),
        }
    }
    /// All-gather with per-rank counts; resolves to the `sum(recv_counts)` gathered elements.
    fn all_gather_v_vec<T: Element>(&self, send: Vec<T>, recv_counts: Vec<usize>) -> Typed<'_, T> {
        match zeros_for::<T>(&recv_counts) {
            Ok(recv) => Typed::new(self.all_gather_v(send.into(), recv, recv_counts)),
            Err(e) => Typed::failed(e),
        }
    }
    /// Reduce-scatter with per-rank counts; resolves to this rank's reduced block of
    /// `send_counts[rank]` elements.
    fn reduce_scatter_v_vec<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: Vec<usize>,
        op: ReduceOp,
    ) -> Typed<'_, T> {
        // A counts vector without this rank's entry is rejected by the front end, naming it.
        let n = send_counts.get(self.rank()).copied().unwrap_or(0);
        match Tensor::host_zeros(T::DTYPE, n) {
            Ok(recv) => Typed::new(self.reduce_scatter_v(send.into(), send_counts, recv, op)),
            Err(e) => Typed::failed(e),
        }
    }
    /// Rooted reduce; resolves to the reduction on `root`, to `send` elsewhere.
    fn reduce_vec<T: Element>(&self, send: Vec<T>, op: ReduceOp, root: usize) -> Typed<'_, T> {
        let recv =
            (self.rank() == root).then(|| Tensor::Host(HostBuffer::zeros(T::DTYPE, send.len())));
        Typed::new(self.reduce(send.into(), recv, op, root))
    }
    /// Rooted gather; resolves to every rank's `send` in rank order on `root`, to `send`
    /// elsewhere.
    fn gather_vec<T: Element>(&self, send: Vec<T>, root: usize) -> Typed<'_, T> {
        let recv = if self.rank() == root {
            let n = send.len().saturating_mul(self.size());
            match Tensor::host_zeros(T::DTYPE, n) {
                Ok(recv) => Some(recv),
                Err(e) => return Typed::failed(e),
            }
        } else {
            None
        };
        Typed::new(self.gather(send.into(), recv, root))
    }
    /// Rooted scatter of the root's `send` (`size · recv_len` elements; `None` elsewhere);
    /// resolves to this rank's block of `recv_len` elements.
    fn scatter_vec<T: Element>(
        &self,
        send: Option<Vec<T>>,
        recv_len: usize,
        root: usize,
    ) -> Typed<'_, T> {
        match Tensor::host_zeros(T::DTYPE, recv_len) {
            Ok(recv) => Typed::new(self.scatter(send.map(Tensor::from), recv, root)),
            Err(e) => Typed::failed(e),
        }
    }
    /// Sends `buf` to `peer`; resolves to the sent vector.
    fn send_vec<T: Element>(&self, buf: Vec<T>, peer: usize, tag: u32) -> Typed<'_, T> {
        Typed::new(self.send(buf.into(), peer, tag))
    }
    /// Receives exactly `len` elements from `peer`; resolves to them.
    fn recv_vec<T: Element>(&self, len: usize, peer: usize, tag: u32) -> Typed<'_, T> {
        Typed::new(self.recv(Tensor::Host(HostBuffer::zeros(T::DTYPE, len)), peer, tag))
    }
}

impl<C: AsyncCommunicator + ?Sized> AsyncCommunicatorExt for C {}

/// The async communicator over a [`Communicator`]: every backend, through its front end.
///
/// `AsyncComm<dyn Communicator>` (the default) wraps an `Arc<dyn Communicator>`;
/// `AsyncComm<C>` wraps a concrete communicator such as `Arc<MpiCommunicator>`. The blocking
/// communicator stays usable beside it (`inner`).
pub struct AsyncComm<C: Communicator + ?Sized = dyn Communicator> {
    comm: Arc<C>,
}

impl<C: Communicator + ?Sized> Clone for AsyncComm<C> {
    fn clone(&self) -> Self {
        AsyncComm {
            comm: Arc::clone(&self.comm),
        }
    }
}

impl<C: Communicator + ?Sized> std::fmt::Debug for AsyncComm<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncComm")
            .field("backend", &self.comm.backend())
            .field("name", &self.comm.name())
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .finish()
    }
}

impl<C: Communicator + ?Sized> AsyncComm<C> {
    /// The async form of `comm`.
    pub fn new(comm: Arc<C>) -> AsyncComm<C> {
        AsyncComm { comm }
    }

    /// The blocking communicator underneath.
    pub fn inner(&self) -> &Arc<C> {
        &self.comm
    }

    /// Starts `request` now and returns the `'static` future of its result (what
    /// [`AsyncCommunicator::run`] returns, unboxed: it can be spawned as a task of its own).
    pub fn start(&self, request: Request) -> Completion {
        self.start_limited(request, None)
    }

    /// [`AsyncComm::start`] with a time limit for this operation (`None`: the communicator's
    /// default).
    pub fn start_limited(&self, request: Request, limit: Option<TimeLimit>) -> Completion {
        let op = request.name();
        match self.comm.start_op(request, limit) {
            Ok(work) => Completion::spawn(op, work),
            Err(e) => Completion::ready(op, Err(e)),
        }
    }
}

impl<C: Communicator + ?Sized + 'static> AsyncComm<C> {
    /// The async form of `comm`, shared: `Arc<dyn AsyncCommunicator>`.
    pub fn shared(comm: Arc<C>) -> Arc<dyn AsyncCommunicator> {
        Arc::new(AsyncComm::new(comm))
    }
}

impl<C: Communicator + ?Sized> AsyncCommunicator for AsyncComm<C> {
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
    // Written out instead of `async fn` so that the operation starts in the call, not at the
    // first poll (the signature is the one `async-trait` declares).
    fn run<'life0, 'async_trait>(&'life0 self, request: Request) -> OpFuture<'async_trait, Tensor>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.start(request))
    }
    fn run_limited<'life0, 'async_trait>(
        &'life0 self,
        request: Request,
        limit: TimeLimit,
    ) -> OpFuture<'async_trait, Tensor>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.start_limited(request, Some(limit)))
    }
    fn abort(&self) {
        self.comm.abort()
    }
    fn failure(&self) -> Option<Failure> {
        self.comm.failure()
    }
    fn time_limit(&self) -> TimeLimit {
        self.comm.time_limit()
    }
    fn set_time_limit(&self, limit: TimeLimit) {
        self.comm.set_time_limit(limit)
    }
}
