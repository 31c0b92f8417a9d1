//! [`GlooCommunicator`]: the `grid_core::Communicator` traits over one Gloo context.

use crate::exec::{panic_message, worker_gone, Completion, GlooWork, Sequencer};
use crate::ffi::{
    AllreduceAlgorithm, RawContext, RawOp, RawP2p, ReduceScatterAlgorithm, ShimCode, ShimError,
};
use grid_core::comm::check;
use grid_core::{
    BufMut, BufRef, Communicator, DType, Error, HostBuffer, HostSlice, HostSliceMut, Memory, P2pOp,
    ReduceOp, Request, Result, Tensor, Work,
};
use half::{bf16, f16};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BACKEND: &str = "gloo";
/// The failure recorded by [`GlooCommunicator::abort`].
const ABORTED: &str = "aborted by the user";

/// A communicator over one group of ranks, backed by one Gloo context (a full mesh of TCP
/// connections between the members).
///
/// * Collectives run in call order on every rank: blocking ones on the caller's thread,
///   nonblocking ones ([`Communicator::start`]) on a worker thread of this communicator (created
///   on first use), interleaved in the order they were called.
/// * Point-to-point operations are posted at once (Gloo's unbound buffers), so `isend`/`irecv`
///   pairs in any order cannot deadlock; they complete when the peer matches them.
/// * Every operation is bounded by the communicator's timeout ([`crate::GlooConfig::timeout`]).
///   After a timeout or a lost peer the communicator is unusable (Gloo closes its connections):
///   later calls return [`Error::Finalized`].
/// * All seven dtypes and all reductions are supported: integers wrap on overflow, f16 and bf16
///   are reduced in f32 and rounded to nearest even, min/max propagate NaN, and `Avg` is the
///   sum divided by the size (rounded for floats, truncated toward zero for integers). Only
///   host memory is accepted.
///
/// ```
/// use backend_gloo::{run_ranks, GlooConfig};
/// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
///
/// let sums = run_ranks(2, &GlooConfig::new("doc-comm"), |_factory, world| {
///     let mut out = [0i64; 2];
///     world.all_reduce_into(&[world.rank() as i64, 1], &mut out, ReduceOp::Sum)?;
///     Ok(out)
/// })
/// .unwrap();
/// assert!(sums.iter().all(|r| r.as_ref().unwrap() == &[1, 2]));
/// ```
pub struct GlooCommunicator {
    inner: Arc<Inner>,
    worker: Mutex<Option<Sender<Job>>>,
}

impl std::fmt::Debug for GlooCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlooCommunicator")
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
    done: Arc<Completion>,
}

pub(crate) struct Inner {
    ctx: RawContext,
    global_ranks: Vec<usize>,
    name: String,
    timeout: Duration,
    allreduce: AllreduceAlgorithm,
    reduce_scatter: ReduceScatterAlgorithm,
    seq: Sequencer,
    failure: Mutex<Option<String>>,
    splits: AtomicU64,
}

fn host_ref<'a>(op: &'static str, b: BufRef<'a>) -> Result<HostSlice<'a>> {
    b.host_only(op, BACKEND)
}

fn host_mut<'a>(op: &'static str, b: BufMut<'a>) -> Result<HostSliceMut<'a>> {
    b.host_only(op, BACKEND)
}

fn raw_op(op: ReduceOp) -> RawOp {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => RawOp::Sum,
        ReduceOp::Prod => RawOp::Prod,
        ReduceOp::Min => RawOp::Min,
        ReduceOp::Max => RawOp::Max,
    }
}

/// Divides every element by `n` (the second half of `Avg`): rounded for floats (f16 and bf16
/// through f32), truncated toward zero for integers.
fn divide(buf: HostSliceMut<'_>, n: usize) {
    match buf {
        HostSliceMut::F32(s) => s.iter_mut().for_each(|x| *x /= n as f32),
        HostSliceMut::F64(s) => s.iter_mut().for_each(|x| *x /= n as f64),
        HostSliceMut::F16(s) => s
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32)),
        HostSliceMut::BF16(s) => s
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32)),
        HostSliceMut::I32(s) => {
            let n = i32::try_from(n).unwrap_or(i32::MAX);
            s.iter_mut().for_each(|x| *x /= n)
        }
        HostSliceMut::I64(s) => {
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            s.iter_mut().for_each(|x| *x /= n)
        }
        HostSliceMut::U8(s) => {
            let n = u8::try_from(n).unwrap_or(u8::MAX);
            s.iter_mut().for_each(|x| *x /= n)
        }
    }
}

impl Inner {
    fn size(&self) -> usize {
        self.ctx.size()
    }

    fn rank(&self) -> usize {
        self.ctx.rank()
    }

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
    fn fail(&self, op: &'static str, e: ShimError) -> Error {
        if e.code != ShimCode::Invalid {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some(format!("{op}: {}", e.message));
            }
            tracing::warn!(communicator = %self.name, op, code = ?e.code, peer = ?e.peer, message = %e.message, "gloo operation failed");
        }
        let world = |p: usize| self.global_ranks.get(p).copied().unwrap_or(p);
        match (e.code, e.peer) {
            (ShimCode::Invalid, _) => Error::Invalid(format!("{op}: {}", e.message)),
            (_, Some(peer)) => Error::PeerFailed {
                op,
                peer,
                message: format!(
                    "lost the connection to rank {peer} (world rank {}) of communicator '{}': {}",
                    world(peer),
                    self.name,
                    e.message
                ),
            },
            (ShimCode::Timeout, None) => Error::Timeout {
                op,
                millis: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                peer: None,
            },
            _ => Error::Backend {
                backend: BACKEND,
                op,
                message: e.message,
            },
        }
    }

    // ---- argument checks, shared by the blocking and nonblocking forms ------------------------

    fn check_reduce(
        &self,
        op_name: &'static str,
        send: (DType, usize),
        recv: (DType, usize),
    ) -> Result<()> {
        check::collective(op_name, self.size(), Some(send), recv)
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        check::rank(op, "peer", peer, self.size())?;
        if peer == self.rank() {
            return Err(Error::Invalid(format!(
                "{op}: peer {peer} is this rank; send to or receive from another rank (0..{} except {peer}), or use batch_p2p, which matches a rank's messages to itself",
                self.size()
            )));
        }
        Ok(())
    }

    fn validate(&self, r: &Request) -> Result<()> {
        let mem = |op, t: &Tensor| t.as_ref().host_only(op, BACKEND).map(|_| ());
        match r {
            Request::AllReduce { buf, .. } => mem("all_reduce", buf),
            Request::AllReduceInto { send, recv, .. } => {
                mem("all_reduce", send)?;
                mem("all_reduce", recv)?;
                self.check_reduce(
                    "all_reduce",
                    (send.dtype(), send.len()),
                    (recv.dtype(), recv.len()),
                )
            }
            Request::Broadcast { buf, root } => {
                mem("broadcast", buf)?;
                check::rank("broadcast", "root", *root, self.size())
            }
            Request::AllGather { send, recv } => {
                mem("all_gather", send)?;
                mem("all_gather", recv)?;
                check::collective(
                    "all_gather",
                    self.size(),
                    Some((send.dtype(), send.len())),
                    (recv.dtype(), recv.len()),
                )
            }
            Request::ReduceScatter { send, recv, .. } => {
                mem("reduce_scatter", send)?;
                mem("reduce_scatter", recv)?;
                self.check_reduce(
                    "reduce_scatter",
                    (send.dtype(), send.len()),
                    (recv.dtype(), recv.len()),
                )
            }
            Request::AllToAll { send, recv } => {
                mem("all_to_all", send)?;
                mem("all_to_all", recv)?;
                check::collective(
                    "all_to_all",
                    self.size(),
                    Some((send.dtype(), send.len())),
                    (recv.dtype(), recv.len()),
                )
            }
            Request::Barrier => Ok(()),
            Request::Send { buf, peer, .. } => {
                mem("send", buf)?;
                self.check_peer("send", *peer)
            }
            Request::Recv { buf, peer, .. } => {
                mem("recv", buf)?;
                self.check_peer("recv", *peer)
            }
        }
    }

    // ---- the operations themselves (arguments already checked, turn held) --------------------

    fn all_reduce(
        &self,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        self.alive(OP)?;
        let raw = raw_op(op);
        if recv.is_empty() {
            return Ok(());
        }
        let r = match send {
            Some(s) => {
                self.ctx
                    .allreduce(s, recv.reborrow(), raw, self.allreduce, tag, self.timeout)
            }
            None => {
                self.ctx
                    .allreduce_in_place(recv.reborrow(), raw, self.allreduce, tag, self.timeout)
            }
        };
        r.map_err(|e| self.fail(OP, e))?;
        if op == ReduceOp::Avg {
            divide(recv, self.size());
        }
        Ok(())
    }

    fn broadcast(&self, buf: HostSliceMut<'_>, root: usize, tag: u32) -> Result<()> {
        const OP: &str = "broadcast";
        self.alive(OP)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.ctx
            .broadcast(buf, root, tag, self.timeout)
            .map_err(|e| self.fail(OP, e))
    }

    fn all_gather(&self, send: HostSlice<'_>, recv: HostSliceMut<'_>, tag: u32) -> Result<()> {
        const OP: &str = "all_gather";
        self.alive(OP)?;
        if send.is_empty() {
            return Ok(());
        }
        self.ctx
            .allgather(send, recv, tag, self.timeout)
            .map_err(|e| self.fail(OP, e))
    }

    fn reduce_scatter(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.alive(OP)?;
        let raw = raw_op(op);
        if recv.is_empty() {
            return Ok(());
        }
        self.ctx
            .reduce_scatter(
                send,
                recv.reborrow(),
                raw,
                self.reduce_scatter,
                tag,
                self.timeout,
            )
            .map_err(|e| self.fail(OP, e))?;
        if op == ReduceOp::Avg {
            divide(recv, self.size());
        }
        Ok(())
    }

    fn all_to_all(&self, send: HostSlice<'_>, recv: HostSliceMut<'_>, tag: u32) -> Result<()> {
        const OP: &str = "all_to_all";
        self.alive(OP)?;
        if send.is_empty() {
            return Ok(());
        }
        self.ctx
            .alltoall(send, recv, tag, self.timeout)
            .map_err(|e| self.fail(OP, e))
    }

    fn barrier(&self, tag: u32) -> Result<()> {
        const OP: &str = "barrier";
        self.alive(OP)?;
        self.ctx
            .barrier(tag, self.timeout)
            .map_err(|e| self.fail(OP, e))
    }

    /// Runs a nonblocking collective (on the worker, its turn held) and returns its result buffer.
    fn exec(&self, request: Request, tag: u32) -> Result<Tensor> {
        fn h(t: &mut Tensor) -> Result<HostSliceMut<'_>> {
            t.as_mut().host_only("start", BACKEND)
        }
        match request {
            Request::AllReduce { mut buf, op } => {
                self.all_reduce(None, h(&mut buf)?, op, tag)?;
                Ok(buf)
            }
            Request::AllReduceInto {
                mut send,
                mut recv,
                op,
            } => {
                self.all_reduce(Some(h(&mut send)?.as_slice()), h(&mut recv)?, op, tag)?;
                Ok(recv)
            }
            Request::Broadcast { mut buf, root } => {
                self.broadcast(h(&mut buf)?, root, tag)?;
                Ok(buf)
            }
            Request::AllGather { mut send, mut recv } => {
                self.all_gather(h(&mut send)?.as_slice(), h(&mut recv)?, tag)?;
                Ok(recv)
            }
            Request::ReduceScatter {
                mut send,
                mut recv,
                op,
            } => {
                self.reduce_scatter(h(&mut send)?.as_slice(), h(&mut recv)?, op, tag)?;
                Ok(recv)
            }
            Request::AllToAll { mut send, mut recv } => {
                self.all_to_all(h(&mut send)?.as_slice(), h(&mut recv)?, tag)?;
                Ok(recv)
            }
            Request::Barrier => {
                self.barrier(tag)?;
                Ok(Tensor::Host(HostBuffer::zeros(DType::U8, 0)))
            }
            Request::Send { .. } | Request::Recv { .. } => Err(Error::Invalid(
                "start: point-to-point requests are posted directly, not queued".into(),
            )),
        }
    }
}

fn worker_loop(inner: Arc<Inner>, rx: Receiver<Job>) {
    for job in rx {
        let turn = inner.seq.turn(job.ticket);
        let tag = turn.tag();
        let r = catch_unwind(AssertUnwindSafe(|| inner.exec(job.request, tag)));
        // Complete before releasing the turn, so that `synchronize` (which waits for the turns)
        // sees every earlier operation completed.
        job.done.complete(r.unwrap_or_else(|p| {
            Err(Error::Backend {
                backend: BACKEND,
                op: "start",
                message: format!("the operation panicked: {}", panic_message(&*p)),
            })
        }));
        drop(turn);
    }
}

impl GlooCommunicator {
    pub(crate) fn new(
        ctx: RawContext,
        global_ranks: Vec<usize>,
        name: String,
        timeout: Duration,
        allreduce: AllreduceAlgorithm,
        reduce_scatter: ReduceScatterAlgorithm,
    ) -> GlooCommunicator {
        GlooCommunicator {
            inner: Arc::new(Inner {
                ctx,
                global_ranks,
                name,
                timeout,
                allreduce,
                reduce_scatter,
                seq: Sequencer::default(),
                failure: Mutex::new(None),
                splits: AtomicU64::new(0),
            }),
            worker: Mutex::new(None),
        }
    }

    /// The communicator's name: unique within its job and the store key prefix of its
    /// rendezvous (`w0` for the first world, `w0/s3/c1` for colour 1 of the fourth split of it).
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig};
    /// let names = run_ranks(1, &GlooConfig::new("doc-name"), |_f, w| Ok(w.name().to_string())).unwrap();
    /// assert_eq!(names[0].as_ref().unwrap(), "w0");
    /// ```
    pub fn name(&self) -> &str {
        &self.inner.name
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

    /// Marks this communicator aborted on this rank: later calls return [`Error::Finalized`]
    /// (operations already started finish first). Local, like `ncclCommAbort`: the peers see
    /// nothing until their own calls fail or time out.
    ///
    /// ```
    /// # use backend_gloo::{run_ranks, GlooConfig};
    /// # use grid_core::{Communicator, Error};
    /// let r = run_ranks(1, &GlooConfig::new("doc-abort"), |_f, w| {
    ///     w.abort();
    ///     Ok(w.barrier().unwrap_err())
    /// })
    /// .unwrap();
    /// assert!(matches!(r[0].as_ref().unwrap(), Error::Finalized { state: "aborted", .. }));
    /// ```
    pub fn abort(&self) {
        let mut f = self.inner.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(ABORTED.to_string());
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
            .map_err(|e| Error::Backend {
                backend: BACKEND,
                op: "start",
                message: format!("cannot start the communicator's worker thread: {e}"),
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
    ) -> Result<Box<dyn Work>> {
        self.inner.alive(op)?;
        let host = buf.host_only(op, BACKEND)?;
        let pending = self
            .inner
            .ctx
            .post(host, peer, tag, is_recv)
            .map_err(|(e, _)| self.inner.fail(op, e))?;
        let done = Completion::new();
        let d = done.clone();
        let inner = self.inner.clone();
        let timeout = self.inner.timeout;
        std::thread::Builder::new()
            .name(format!("gloo-{op}"))
            .spawn(move || {
                let (r, data) = pending.wait(timeout);
                d.complete(r.map(|_| Tensor::Host(data)).map_err(|e| inner.fail(op, e)));
            })
            .map_err(|e| Error::Backend {
                backend: BACKEND,
                op,
                message: format!("cannot start a thread to wait for the operation: {e}"),
            })?;
        Ok(Box::new(GlooWork::new(done)))
    }
}

impl Communicator for GlooCommunicator {
    fn backend(&self) -> &'static str {
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

    fn supports(&self, _dtype: DType, _op: Option<ReduceOp>) -> bool {
        true
    }

    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let send = host_ref(OP, send)?;
        let recv = host_mut(OP, recv)?;
        self.inner
            .check_reduce(OP, (send.dtype(), send.len()), (recv.dtype(), recv.len()))?;
        let turn = self.inner.seq.enter();
        self.inner.all_reduce(Some(send), recv, op, turn.tag())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let buf = host_mut(OP, buf)?;
        check::rank(OP, "root", root, self.size())?;
        let turn = self.inner.seq.enter();
        self.inner.broadcast(buf, root, turn.tag())
    }

    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let send = host_ref(OP, send)?;
        let recv = host_mut(OP, recv)?;
        check::collective(
            OP,
            self.size(),
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        let turn = self.inner.seq.enter();
        self.inner.all_gather(send, recv, turn.tag())
    }

    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let send = host_ref(OP, send)?;
        let recv = host_mut(OP, recv)?;
        self.inner
            .check_reduce(OP, (send.dtype(), send.len()), (recv.dtype(), recv.len()))?;
        let turn = self.inner.seq.enter();
        self.inner.reduce_scatter(send, recv, op, turn.tag())
    }

    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_to_all";
        let send = host_ref(OP, send)?;
        let recv = host_mut(OP, recv)?;
        check::collective(
            OP,
            self.size(),
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        let turn = self.inner.seq.enter();
        self.inner.all_to_all(send, recv, turn.tag())
    }

    fn barrier(&self) -> Result<()> {
        let turn = self.inner.seq.enter();
        self.inner.barrier(turn.tag())
    }

    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        const OP: &str = "send";
        let data = host_ref(OP, buf)?;
        self.inner.check_peer(OP, peer)?;
        self.inner.alive(OP)?;
        self.inner
            .ctx
            .p2p(&mut [RawP2p::Send { data, peer, tag }], self.inner.timeout)
            .map_err(|e| self.inner.fail(OP, e))
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        const OP: &str = "recv";
        let data = host_mut(OP, buf)?;
        self.inner.check_peer(OP, peer)?;
        self.inner.alive(OP)?;
        self.inner
            .ctx
            .p2p(&mut [RawP2p::Recv { data, peer, tag }], self.inner.timeout)
            .map_err(|e| self.inner.fail(OP, e))
    }

    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        const OP: &str = "batch_p2p";
        let me = self.rank();
        let size = self.size();
        let mut remote = Vec::with_capacity(ops.len());
        // Messages of this rank to itself are matched here, in order, by tag.
        let mut self_sends: Vec<(u32, HostSlice<'_>, bool)> = Vec::new();
        let mut self_recvs: Vec<(u32, HostSliceMut<'_>)> = Vec::new();
        for op in ops {
            match op {
                P2pOp::Send { buf, peer, tag } => {
                    let data = host_ref(OP, buf)?;
                    check::rank(OP, "peer", peer, size)?;
                    if peer == me {
                        self_sends.push((tag, data, false));
                    } else {
                        remote.push(RawP2p::Send { data, peer, tag });
                    }
                }
                P2pOp::Recv { buf, peer, tag } => {
                    let data = host_mut(OP, buf)?;
                    check::rank(OP, "peer", peer, size)?;
                    if peer == me {
                        self_recvs.push((tag, data));
                    } else {
                        remote.push(RawP2p::Recv { data, peer, tag });
                    }
                }
            }
        }
        let mut pairs = Vec::with_capacity(self_recvs.len());
        for (tag, dst) in self_recvs {
            let src = self_sends.iter_mut().find(|(t, _, used)| *t == tag && !*used).ok_or_else(|| {
                Error::Invalid(format!(
                    "{OP}: a receive from this rank ({me}) with tag {tag} has no matching send to itself in the batch"
                ))
            })?;
            src.2 = true;
            check::same_dtype(OP, src.1.dtype(), dst.dtype())?;
            check::len(OP, "receive from this rank", src.1.len(), dst.len())?;
            pairs.push((src.1, dst));
        }
        if let Some((tag, ..)) = self_sends.iter().find(|(_, _, used)| !*used) {
            return Err(Error::Invalid(format!(
                "{OP}: a send to this rank ({me}) with tag {tag} has no matching receive from itself in the batch"
            )));
        }
        self.inner.alive(OP)?;
        for (src, mut dst) in pairs {
            dst.copy_from(src)?;
        }
        if remote.is_empty() {
            return Ok(());
        }
        self.inner
            .ctx
            .p2p(&mut remote, self.inner.timeout)
            .map_err(|e| self.inner.fail(OP, e))
    }

    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        self.inner.validate(&request)?;
        self.inner.alive(request.name())?;
        match request {
            Request::Send { buf, peer, tag } => self.start_p2p("send", buf, peer, tag, false),
            Request::Recv { buf, peer, tag } => self.start_p2p("recv", buf, peer, tag, true),
            request => {
                let op = request.name();
                let done = Completion::new();
                let tx = self.worker()?;
                let d = done.clone();
                self.inner.seq.reserve(move |ticket| {
                    tx.send(Job {
                        ticket,
                        request,
                        done: d,
                    })
                    .map_err(|_| worker_gone(op))
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
