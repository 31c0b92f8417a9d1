//! [`NcclCommunicator`]: the grid-core [`Communicator`] over one NCCL communicator.
//!
//! # Memory and streams
//! * **Device buffers** ([`NcclDeviceBuffer`]) are the native form. A blocking call makes the
//!   communicator's stream wait for the work already queued on each buffer's stream, enqueues
//!   the NCCL operation on the communicator's stream and makes each buffer's stream wait for it,
//!   then returns **without waiting for the GPU** (stream-ordered, as NCCL and PyTorch work).
//!   [`Communicator::synchronize`] waits for the communicator's stream.
//! * **Host buffers are staged** (so the trait's typed helpers and the shared conformance suite
//!   work unchanged): the input is copied to a temporary device buffer, the operation runs, and
//!   the call waits for it and copies the result back before returning. This costs two copies
//!   and a synchronisation per call; use device buffers where speed matters.
//! * **Nonblocking** [`Communicator::start`] enqueues and records a CUDA event; the [`Work`]
//!   completes when the event has fired. `wait` hands back device tensors as they are (their
//!   stream is made to wait for the event) and host tensors after copying the result back.
//! * **Nonblocking sends and receives are deferred** and enqueued together as one
//!   `ncclGroupStart/End` group when one of their works is polled or waited on, or before the
//!   communicator's next other operation. Separately enqueued NCCL sends and receives run in
//!   stream order, so `irecv(left); isend(right); wait` would deadlock in a ring; grouped they
//!   cannot. (A receive whose matching send is only issued *after* waiting on it, on the same
//!   communicator, still deadlocks: NCCL executes one communicator's operations in order.)
//!
//! # Failure handling
//! Every wait polls the event, NCCL's asynchronous error (`ncclCommGetAsyncError`) and the
//! communicator's state, and gives up after [`crate::NcclOptions::timeout`]. On an error or a
//! timeout the communicator's [`crate::Job`] aborts every communicator of the job (unless
//! [`crate::NcclOptions::abort_on_failure`] is off), so no rank stays blocked in another group.
//!
//! # Ranks and tags
//! `rank()` is the NCCL rank. NCCL matches point-to-point messages by order, not by tag: the
//! `tag` arguments are accepted and ignored.

use crate::buffer::{downcast, downcast_mut, owned, with_dtype, NcclDeviceBuffer, NcclElement};
use crate::checks::{self, Kind, Shape};
use crate::error::{cuda, BACKEND};
use crate::ffi::{self, Coll, DevIn, DevOut, P2p, RawComm};
use crate::job::Job;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use grid_core::comm::check;
use grid_core::{
    BufMut, BufRef, Communicator, DType, DeviceBuffer, Element, Error, HostBuffer, HostSlice,
    HostSliceMut, Memory, P2pOp, ReduceOp, Request, Result, Tensor, Work,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The state shared by a communicator and its pending [`Work`] handles.
pub(crate) struct Shared {
    pub(crate) raw: RawComm,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) timeout: Duration,
    pub(crate) abort_on_failure: bool,
    pub(crate) job: Arc<Job>,
    scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Nonblocking sends and receives not yet handed to NCCL (see [`Shared::flush`]).
    pending: Mutex<Vec<Pending>>,
}

/// A nonblocking send or receive waiting to be enqueued.
struct Pending {
    send: bool,
    peer: usize,
    slot: Arc<Mutex<Slot>>,
}

/// The buffer of a nonblocking point-to-point operation, shared by the queue and its work.
enum Slot {
    Waiting(Box<dyn DeviceBuffer>),
    Enqueued(Box<dyn DeviceBuffer>, Arc<CudaEvent>),
    Failed(Error),
    Taken,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn din<'a>(op: &'static str, d: &'a dyn DeviceBuffer, stream: &'a CudaStream) -> Result<DevIn<'a>> {
    with_dtype!(d.dtype(), T => DevIn::new::<T, _>(&downcast::<T>(op, d)?.slice, stream))
}

fn dout<'a>(
    op: &'static str,
    d: &'a mut dyn DeviceBuffer,
    stream: &'a CudaStream,
) -> Result<DevOut<'a>> {
    with_dtype!(d.dtype(), T => DevOut::new::<T, _>(&mut downcast_mut::<T>(op, d)?.slice, stream))
}

impl Shared {
    /// Enqueues the pending nonblocking sends and receives as **one** NCCL group, so that
    /// `irecv` + `isend` patterns (rings, pipeline exchanges) cannot deadlock on the stream.
    /// Called before any other operation of the communicator and when a pending work is
    /// waited on or polled; the queue lock is held throughout, so flushes are serialised.
    fn flush(&self, op: &'static str) -> Result<()> {
        let mut queue = lock(&self.pending);
        if queue.is_empty() {
            return Ok(());
        }
        let items = std::mem::take(&mut *queue);
        self.bind(op)?;
        let mut guards: Vec<_> = items.iter().map(|p| lock(&p.slot)).collect();
        let enqueued = {
            let mut tokens = Vec::with_capacity(items.len());
            let mut err = None;
            for (p, g) in items.iter().zip(guards.iter_mut()) {
                if let Slot::Waiting(b) = &mut **g {
                    let t = if p.send {
                        din(op, &**b, &self.stream).map(|t| P2p::Send(t, p.peer))
                    } else {
                        dout(op, &mut **b, &self.stream).map(|t| P2p::Recv(t, p.peer))
                    };
                    match t {
                        Ok(t) => tokens.push(t),
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
            }
            match err {
                Some(e) => Err(e),
                None => self.raw.p2p_group(op, tokens, &self.stream),
            }
        };
        let event =
            enqueued.and_then(|_| cuda(op, || self.stream.record_event(None)).map(Arc::new));
        for g in guards.iter_mut() {
            let prev = std::mem::replace(&mut **g, Slot::Taken);
            **g = match (prev, &event) {
                (Slot::Waiting(b), Ok(ev)) => Slot::Enqueued(b, ev.clone()),
                (Slot::Waiting(_), Err(e)) => Slot::Failed(e.clone()),
                (other, _) => other,
            };
        }
        event.map(|_| ()).map_err(|e| self.failed(e))
    }

    /// Queues a nonblocking send or receive; returns its slot.
    fn defer(&self, send: bool, peer: usize, buf: Box<dyn DeviceBuffer>) -> Arc<Mutex<Slot>> {
        let slot = Arc::new(Mutex::new(Slot::Waiting(buf)));
        lock(&self.pending).push(Pending {
            send,
            peer,
            slot: slot.clone(),
        });
        slot
    }

    fn bind(&self, op: &'static str) -> Result<()> {
        cuda(op, || self.ctx.bind_to_thread())
    }

    /// Reports a failure: aborts the job's communicators first when configured to.
    fn failed(&self, e: Error) -> Error {
        if self.abort_on_failure {
            let n = self.job.abort_all();
            tracing::error!("nccl: {e}; aborted {n} communicator(s) of the job");
        }
        e
    }

    fn state_error(&self, op: &'static str) -> Error {
        Error::Finalized {
            op,
            state: if self.raw.state_name() == "destroyed" {
                "destroyed"
            } else {
                "aborted"
            },
        }
    }

    /// Polls `ev` for at most `limit`: `Ok(true)` when it fired, `Ok(false)` at the limit.
    /// Errors: the communicator was aborted, NCCL reported an asynchronous error, or the driver
    /// failed.
    pub(crate) fn poll_event(
        &self,
        op: &'static str,
        ev: &CudaEvent,
        limit: Duration,
    ) -> Result<bool> {
        let start = Instant::now();
        let mut n: u32 = 0;
        loop {
            if !self.raw.is_live() {
                return Err(self.state_error(op));
            }
            match cuda(op, || ev.try_is_complete()) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(e) => return Err(self.failed(e)),
            }
            if n % 64 == 63 {
                if let Err(e) = self.raw.async_error(op) {
                    return Err(match e {
                        Error::Finalized { .. } => e,
                        other => self.failed(other),
                    });
                }
            }
            if start.elapsed() >= limit {
                return Ok(false);
            }
            if n < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
            n = n.wrapping_add(1);
        }
    }

    /// Waits for `ev` up to the communicator's timeout; a timeout is a failure.
    pub(crate) fn wait_event(&self, op: &'static str, ev: &CudaEvent) -> Result<()> {
        if self.poll_event(op, ev, self.timeout)? {
            Ok(())
        } else {
            Err(self.failed(Error::Timeout {
                op,
                millis: self.timeout.as_millis() as u64,
                peer: None,
            }))
        }
    }

    /// Waits until everything enqueued on the stream so far has completed.
    pub(crate) fn sync(&self, op: &'static str) -> Result<()> {
        self.bind(op)?;
        let ev = cuda(op, || self.stream.record_event(None))?;
        self.wait_event(op, &ev)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Orderly destruction needs an idle stream; if the stream does not drain (a peer died,
        // an error is pending) the communicator is aborted instead of hanging in finalize.
        if self.raw.is_live() {
            let idle = self
                .flush("drop")
                .and_then(|_| self.bind("drop"))
                .and_then(|_| {
                    let ev = cuda("drop", || self.stream.record_event(None))?;
                    self.poll_event("drop", &ev, self.timeout)
                });
            if !matches!(idle, Ok(true)) {
                self.raw.abort();
            }
        }
        // `raw` drops next: finalize + destroy if still live (see `RawComm`'s Drop).
    }
}

/// A grid-core communicator over one NCCL communicator on one GPU.
///
/// Created by [`crate::NcclFactory::init`] (the world) and [`grid_core::GroupFactory::split`]
/// (sub-groups). `Send + Sync`: calls from several threads are serialised per communicator.
/// Dropping it destroys the NCCL communicator (finalize, then destroy) once its stream is idle,
/// or aborts it if the stream does not drain within the timeout.
///
/// ```no_run
/// # fn f(comm: &backend_nccl::NcclCommunicator) -> grid_core::Result<()> {
/// use grid_core::{CommunicatorExt, ReduceOp};
/// // Host buffers are staged through the GPU:
/// let mut out = vec![0.0f32; 4];
/// comm.all_reduce_into(&[1.0f32; 4][..], &mut out[..], ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
pub struct NcclCommunicator {
    shared: Arc<Shared>,
    global_ranks: Vec<usize>,
    device: usize,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("device", &self.device)
            .field("global_ranks", &self.global_ranks)
            .field("state", &self.shared.raw.state_name())
            .finish()
    }
}

impl NcclCommunicator {
    pub(crate) fn new(
        raw: RawComm,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        global_ranks: Vec<usize>,
        timeout: Duration,
        abort_on_failure: bool,
        job: Arc<Job>,
    ) -> NcclCommunicator {
        let device = ctx.ordinal();
        let shared = Arc::new(Shared {
            raw,
            ctx,
            stream,
            timeout,
            abort_on_failure,
            job: job.clone(),
            scratch: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
        });
        job.register(&shared);
        crate::job::process().register(&shared);
        NcclCommunicator {
            shared,
            global_ranks,
            device,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The GPU (CUDA ordinal) this communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The CUDA stream every operation of this communicator is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// `"live"`, `"destroyed"` or `"aborted"`.
    pub fn state(&self) -> &'static str {
        self.shared.raw.state_name()
    }

    /// Aborts this communicator now (`ncclCommAbort`): pending operations are interrupted and
    /// every later call fails with [`Error::Finalized`]. Returns false if it was not live.
    pub fn abort(&self) -> bool {
        self.shared.raw.abort()
    }

    /// `Ok` while NCCL reports no asynchronous error on this communicator.
    pub fn check_async_error(&self) -> Result<()> {
        self.shared.raw.async_error("check_async_error")
    }

    /// Copies host data to a new device buffer on this communicator's device and stream.
    pub fn to_device<T: NcclElement>(&self, data: &[T]) -> Result<NcclDeviceBuffer<T>> {
        self.shared.bind("to_device")?;
        if data.is_empty() {
            return Err(Error::Invalid(
                "to_device: cannot allocate an empty device buffer".into(),
            ));
        }
        Ok(NcclDeviceBuffer::new(cuda("to_device", || {
            self.shared.stream.clone_htod(data)
        })?))
    }

    /// A new zero-filled device buffer of `len` elements on this communicator's stream.
    pub fn zeros<T: NcclElement>(&self, len: usize) -> Result<NcclDeviceBuffer<T>> {
        self.shared.bind("zeros")?;
        if len == 0 {
            return Err(Error::Invalid(
                "zeros: cannot allocate an empty device buffer".into(),
            ));
        }
        Ok(NcclDeviceBuffer::new(cuda("zeros", || {
            self.shared.stream.alloc_zeros::<T>(len)
        })?))
    }

    /// Copies a device buffer back to the host, after everything queued on this communicator's
    /// stream (waits with the communicator's timeout and failure checks).
    pub fn to_host<T: NcclElement>(&self, buf: &NcclDeviceBuffer<T>) -> Result<Vec<T>> {
        self.begin("to_host")?;
        self.shared.bind("to_host")?;
        self.wait_for("to_host", buf)?;
        self.shared.sync("to_host")?;
        cuda("to_host", || self.shared.stream.clone_dtoh(&buf.slice))
    }

    // ----- helpers ------------------------------------------------------------------------------

    fn live(&self, op: &'static str) -> Result<()> {
        if self.shared.raw.is_live() {
            Ok(())
        } else {
            Err(self.shared.state_error(op))
        }
    }

    /// Start of every operation except nonblocking send/recv: live, and pending
    /// point-to-point operations enqueued first (they were started first).
    fn begin(&self, op: &'static str) -> Result<()> {
        self.live(op)?;
        self.shared.flush(op)
    }

    fn shape(&self) -> Shape {
        Shape {
            size: self.size(),
            rank: self.rank(),
            device: self.device,
        }
    }

    fn same_device(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        self.shape().device(op, d.device())
    }

    fn stream_of(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<Arc<CudaStream>> {
        with_dtype!(d.dtype(), T => Ok(downcast::<T>(op, d)?.slice.stream().clone()))
    }

    /// The communicator's stream waits for the work queued so far on `d`'s stream.
    fn wait_for(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        self.same_device(op, d)?;
        let s = self.stream_of(op, d)?;
        if *s != *self.shared.stream {
            cuda(op, || self.shared.stream.join(&s))?;
        }
        Ok(())
    }

    /// `d`'s stream waits for the work queued so far on the communicator's stream.
    fn join_back(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        let s = self.stream_of(op, d)?;
        if *s != *self.shared.stream {
            cuda(op, || s.join(&self.shared.stream))?;
        }
        Ok(())
    }

    fn din<'a>(&'a self, op: &'static str, d: &'a dyn DeviceBuffer) -> Result<DevIn<'a>> {
        self.same_device(op, d)?;
        din(op, d, &self.shared.stream)
    }

    fn dout<'a>(&'a self, op: &'static str, d: &'a mut dyn DeviceBuffer) -> Result<DevOut<'a>> {
        self.same_device(op, &*d)?;
        dout(op, d, &self.shared.stream)
    }

    fn stage_in(&self, op: &'static str, h: HostSlice<'_>) -> Result<Box<dyn DeviceBuffer>> {
        with_dtype!(h.dtype(), T => {
            let v = <T as Element>::view(h).ok_or_else(|| internal(op, "staging dtype"))?;
            let s = cuda(op, || self.shared.stream.clone_htod(v))?;
            Ok(Box::new(NcclDeviceBuffer::new(s)) as Box<dyn DeviceBuffer>)
        })
    }

    fn stage_zeros(
        &self,
        op: &'static str,
        dtype: DType,
        len: usize,
    ) -> Result<Box<dyn DeviceBuffer>> {
        with_dtype!(dtype, T => {
            let s = cuda(op, || self.shared.stream.alloc_zeros::<T>(len))?;
            Ok(Box::new(NcclDeviceBuffer::new(s)) as Box<dyn DeviceBuffer>)
        })
    }

    /// Copies a staged device buffer into host memory (the stream must have been waited for).
    fn fetch_into(
        &self,
        op: &'static str,
        d: &dyn DeviceBuffer,
        h: HostSliceMut<'_>,
    ) -> Result<()> {
        with_dtype!(d.dtype(), T => {
            let b = downcast::<T>(op, d)?;
            let dst = <T as Element>::view_mut(h).ok_or_else(|| internal(op, "fetch dtype"))?;
            if dst.len() != b.slice.len() {
                return Err(internal(op, "fetch length"));
            }
            cuda(op, || self.shared.stream.memcpy_dtoh(&b.slice, dst))
        })
    }

    /// Enqueues a collective on device buffers (already validated). `send` is `None` for the
    /// in-place operations.
    fn enqueue(
        &self,
        op: &'static str,
        kind: Kind,
        send: Option<&dyn DeviceBuffer>,
        recv: &mut dyn DeviceBuffer,
    ) -> Result<()> {
        if recv.is_empty() {
            return Ok(());
        }
        if let Some(s) = send {
            self.wait_for(op, s)?;
        }
        self.wait_for(op, &*recv)?;
        let st = &*self.shared.stream;
        let coll = match kind {
            Kind::AllReduce(r) => Coll::AllReduce {
                send: send.map(|s| self.din(op, s)).transpose()?,
                recv: self.dout(op, recv)?,
                op: ffi::nccl_op(r),
            },
            Kind::Broadcast(root) => Coll::Broadcast {
                buf: self.dout(op, recv)?,
                root,
            },
            Kind::AllGather => Coll::AllGather {
                send: self.din(op, send.ok_or_else(|| internal(op, "missing send buffer"))?)?,
                recv: self.dout(op, recv)?,
            },
            Kind::ReduceScatter(r) => Coll::ReduceScatter {
                send: self.din(op, send.ok_or_else(|| internal(op, "missing send buffer"))?)?,
                recv: self.dout(op, recv)?,
                op: ffi::nccl_op(r),
            },
            Kind::AllToAll => {
                let ops = self.all_to_all_ops(
                    op,
                    send.ok_or_else(|| internal(op, "missing send buffer"))?,
                    recv,
                )?;
                return self
                    .shared
                    .raw
                    .p2p_group(op, ops, st)
                    .map_err(|e| self.shared.failed(e));
            }
        };
        self.shared
            .raw
            .collective(coll, st)
            .map_err(|e| self.shared.failed(e))
    }

    /// All-to-all as one group of sends and receives (works on every NCCL version).
    fn all_to_all_ops<'a>(
        &'a self,
        op: &'static str,
        send: &'a dyn DeviceBuffer,
        recv: &'a mut dyn DeviceBuffer,
    ) -> Result<Vec<P2p<'a>>> {
        self.same_device(op, send)?;
        self.same_device(op, &*recv)?;
        let n = self.size();
        with_dtype!(send.dtype(), T => {
            let s = downcast::<T>(op, send)?;
            let r = downcast_mut::<T>(op, recv)?;
            let len = s.slice.len();
            if n == 0 || !len.is_multiple_of(n) || r.slice.len() != len || len == 0 {
                return Err(internal(op, "all_to_all block sizes"));
            }
            let b = len / n;
            let st = &*self.shared.stream;
            let mut ops = Vec::with_capacity(2 * n);
            for (j, v) in r.slice.as_view_mut().chunks_exact_mut(b).enumerate() {
                ops.push(P2p::Recv(DevOut::from_view::<T>(v, st)?, j));
            }
            for j in 0..n {
                let v = s.slice.try_slice(j * b..(j + 1) * b).ok_or_else(|| internal(op, "all_to_all view"))?;
                ops.push(P2p::Send(DevIn::from_view::<T>(v, st)?, j));
            }
            Ok(ops)
        })
    }

    /// The blocking form shared by the collectives: stages host memory, enqueues, and for host
    /// output waits and copies back.
    fn blocking(&self, kind: Kind, send: Option<BufRef<'_>>, recv: BufMut<'_>) -> Result<()> {
        let op = kind.name();
        self.begin(op)?;
        if recv.is_empty() {
            return Ok(());
        }
        self.shared.bind(op)?;
        let staged_in = match send {
            Some(BufRef::Host(h)) => Some(self.stage_in(op, h)?),
            _ => None,
        };
        let send_dev: Option<&dyn DeviceBuffer> = match (send, &staged_in) {
            (Some(BufRef::Device(d)), _) => Some(d),
            (_, Some(b)) => Some(&**b),
            _ => None,
        };
        match recv {
            BufMut::Device(d) => {
                self.enqueue(op, kind, send_dev, &mut *d)?;
                self.join_back(op, &*d)?;
                if let Some(BufRef::Device(s)) = send {
                    self.join_back(op, s)?;
                }
                Ok(())
            }
            BufMut::Host(h) => {
                let mut staged = if kind.reads_recv() {
                    self.stage_in(op, h.as_slice())?
                } else {
                    self.stage_zeros(op, h.dtype(), h.len())?
                };
                self.enqueue(op, kind, send_dev, &mut *staged)?;
                if let Some(BufRef::Device(s)) = send {
                    self.join_back(op, s)?;
                }
                self.shared.sync(op)?;
                self.fetch_into(op, &*staged, h)
            }
        }
    }

    /// Grouped point-to-point operations, host buffers staged.
    fn p2p(&self, op: &'static str, ops: Vec<P2pOp<'_>>) -> Result<()> {
        enum Slot<'a> {
            Send(BufRef<'a>, Option<Box<dyn DeviceBuffer>>, usize),
            Recv(BufMut<'a>, Option<Box<dyn DeviceBuffer>>, usize),
        }
        self.begin(op)?;
        let mut slots = Vec::with_capacity(ops.len());
        for o in ops {
            match o {
                P2pOp::Send { buf, peer, .. } => {
                    check::rank(op, "peer", peer, self.size())?;
                    if !buf.is_empty() {
                        slots.push(Slot::Send(buf, None, peer));
                    }
                }
                P2pOp::Recv { buf, peer, .. } => {
                    check::rank(op, "peer", peer, self.size())?;
                    if !buf.is_empty() {
                        slots.push(Slot::Recv(buf, None, peer));
                    }
                }
            }
        }
        if slots.is_empty() {
            return Ok(());
        }
        self.shared.bind(op)?;
        let mut host_out = false;
        for s in slots.iter_mut() {
            match s {
                Slot::Send(BufRef::Host(h), st, _) => *st = Some(self.stage_in(op, *h)?),
                Slot::Send(BufRef::Device(d), _, _) => self.wait_for(op, *d)?,
                Slot::Recv(BufMut::Host(h), st, _) => {
                    host_out = true;
                    *st = Some(self.stage_zeros(op, h.dtype(), h.len())?)
                }
                Slot::Recv(BufMut::Device(d), _, _) => self.wait_for(op, &**d)?,
            }
        }
        {
            let mut tokens = Vec::with_capacity(slots.len());
            for s in slots.iter_mut() {
                tokens.push(match s {
                    Slot::Send(_, Some(b), p) => P2p::Send(self.din(op, &**b)?, *p),
                    Slot::Send(BufRef::Device(d), None, p) => P2p::Send(self.din(op, *d)?, *p),
                    Slot::Recv(_, Some(b), p) => P2p::Recv(self.dout(op, &mut **b)?, *p),
                    Slot::Recv(BufMut::Device(d), None, p) => {
                        P2p::Recv(self.dout(op, &mut **d)?, *p)
                    }
                    _ => return Err(internal(op, "unstaged host buffer")),
                });
            }
            self.shared
                .raw
                .p2p_group(op, tokens, &self.shared.stream)
                .map_err(|e| self.shared.failed(e))?;
        }
        for s in slots.iter() {
            match s {
                Slot::Send(BufRef::Device(d), _, _) => self.join_back(op, *d)?,
                Slot::Recv(BufMut::Device(d), _, _) => self.join_back(op, &**d)?,
                _ => {}
            }
        }
        if host_out {
            self.shared.sync(op)?;
            for s in slots {
                if let Slot::Recv(BufMut::Host(h), Some(b), _) = s {
                    self.fetch_into(op, &*b, h)?;
                }
            }
        }
        Ok(())
    }

    fn barrier_enqueue(&self, op: &'static str) -> Result<()> {
        let mut g = self
            .shared
            .scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(cuda(op, || self.shared.stream.alloc_zeros::<f32>(1))?);
        }
        let Some(s) = g.as_mut() else {
            return Err(internal(op, "scratch"));
        };
        let st = &*self.shared.stream;
        let coll = Coll::AllReduce {
            send: None,
            recv: DevOut::new::<f32, _>(s, st)?,
            op: ffi::nccl_op(ReduceOp::Sum),
        };
        self.shared
            .raw
            .collective(coll, st)
            .map_err(|e| self.shared.failed(e))
    }

    /// Turns an owned tensor into device memory: device tensors as they are, host tensors
    /// staged (uploaded when `upload`, else zero-filled). Returns the device operand and, for
    /// host tensors, the original host buffer.
    fn operand(&self, op: &'static str, t: Tensor, upload: bool) -> Result<Operand> {
        match t {
            Tensor::Device(d) => {
                self.same_device(op, &*d)?;
                Ok((Some(d), None))
            }
            Tensor::Host(h) if h.is_empty() => Ok((None, Some(h))),
            Tensor::Host(h) => {
                let d = if upload {
                    self.stage_in(op, h.as_slice())?
                } else {
                    self.stage_zeros(op, h.dtype(), h.len())?
                };
                Ok((Some(d), Some(h)))
            }
        }
    }
}

/// A tensor as device memory plus, for host tensors, the original host buffer.
type Operand = (Option<Box<dyn DeviceBuffer>>, Option<HostBuffer>);

fn internal(op: &'static str, what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: format!("internal error ({what}); please report"),
    }
}

/// What a finished [`NcclWork`] hands back.
enum Output {
    /// Device memory: returned as is.
    Device(Box<dyn DeviceBuffer>),
    /// A staged result: copied to the host on completion.
    Staged(Box<dyn DeviceBuffer>),
    /// The buffer of a deferred send or receive (copied to the host if `staged`).
    Slot { staged: bool },
    /// Ready now (sent host buffer, empty buffers, barrier).
    Ready(Tensor),
}

/// A started operation: completes when the CUDA event recorded after it has fired.
/// Nonblocking sends and receives are enqueued (as one group with the other pending ones) when
/// their work is first polled or waited on, or when the communicator runs any other operation.
pub struct NcclWork {
    shared: Arc<Shared>,
    comm_stream: Arc<CudaStream>,
    op: &'static str,
    event: Option<Arc<CudaEvent>>,
    slot: Option<Arc<Mutex<Slot>>>,
    started: Instant,
    output: Option<Output>,
    /// Buffers NCCL still reads (staged inputs, device inputs) until the event fires.
    _keep: Vec<Box<dyn DeviceBuffer>>,
}

impl std::fmt::Debug for NcclWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclWork({})", self.op)
    }
}

impl NcclWork {
    /// The completion event, enqueueing a deferred send/receive first.
    fn event(&mut self) -> Result<Arc<CudaEvent>> {
        if let Some(ev) = &self.event {
            return Ok(ev.clone());
        }
        let Some(slot) = self.slot.clone() else {
            return Err(internal(self.op, "work without event"));
        };
        self.shared.flush(self.op)?;
        let ev = match &*lock(&slot) {
            Slot::Enqueued(_, ev) => ev.clone(),
            Slot::Failed(e) => return Err(e.clone()),
            Slot::Waiting(_) | Slot::Taken => {
                return Err(internal(self.op, "deferred operation not enqueued"))
            }
        };
        self.event = Some(ev.clone());
        Ok(ev)
    }

    fn finish(mut self, event: &CudaEvent) -> Result<Tensor> {
        let out = self.output.take();
        let (d, staged) = match out {
            Some(Output::Ready(t)) => return Ok(t),
            Some(Output::Device(d)) => (d, false),
            Some(Output::Staged(d)) => (d, true),
            Some(Output::Slot { staged }) => {
                let Some(slot) = self.slot.take() else {
                    return Err(internal(self.op, "slot"));
                };
                let prev = std::mem::replace(&mut *lock(&slot), Slot::Taken);
                match prev {
                    Slot::Enqueued(d, _) => (d, staged),
                    Slot::Failed(e) => return Err(e),
                    _ => return Err(internal(self.op, "slot state")),
                }
            }
            None => return Err(internal(self.op, "work finished twice")),
        };
        if staged {
            self.shared.bind(self.op)?;
            let h = with_dtype!(d.dtype(), T => {
                let b = downcast::<T>(self.op, &*d)?;
                owned::<T>(cuda(self.op, || self.comm_stream.clone_dtoh(&b.slice))?)
            });
            Ok(Tensor::Host(h))
        } else {
            let s =
                with_dtype!(d.dtype(), T => downcast::<T>(self.op, &*d)?.slice.stream().clone());
            if *s != *self.comm_stream {
                cuda(self.op, || s.wait(event))?;
            }
            Ok(Tensor::Device(d))
        }
    }
}

impl Work for NcclWork {
    fn is_completed(&mut self) -> bool {
        if !self.shared.raw.is_live() {
            return true;
        }
        match self.event() {
            Ok(ev) => !matches!(cuda(self.op, || ev.try_is_complete()), Ok(false)),
            Err(_) => true,
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.shared.bind(self.op)?;
        let ev = self.event()?;
        self.shared.wait_event(self.op, &ev)?;
        self.finish(&ev)
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        if let Err(e) = self.shared.bind(self.op) {
            return Ok(Err(e));
        }
        let ev = match self.event() {
            Ok(ev) => ev,
            Err(e) => return Ok(Err(e)),
        };
        let remaining = self.shared.timeout.saturating_sub(self.started.elapsed());
        match self.shared.poll_event(self.op, &ev, timeout.min(remaining)) {
            Ok(true) => Ok(self.finish(&ev)),
            Ok(false) if timeout < remaining => Err(self),
            Ok(false) => {
                let millis = self.shared.timeout.as_millis() as u64;
                Ok(Err(self.shared.failed(Error::Timeout {
                    op: self.op,
                    millis,
                    peer: None,
                })))
            }
            Err(e) => Ok(Err(e)),
        }
    }
}

impl Communicator for NcclCommunicator {
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn rank(&self) -> usize {
        self.shared.raw.rank()
    }
    fn size(&self) -> usize {
        self.shared.raw.size()
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }
    /// Device memory natively; host memory through staging (see the module docs).
    fn accepts(&self, _memory: Memory) -> bool {
        true
    }
    /// Every dtype moves; every reduction on every dtype except `Avg` on integers.
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        checks::supports(dtype, op)
    }

    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let kind = Kind::AllReduce(op);
        self.shape().collective(
            kind,
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        self.blocking(kind, Some(send), recv)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let kind = Kind::Broadcast(root);
        self.shape()
            .collective(kind, None, (buf.dtype(), buf.len()))?;
        self.blocking(kind, None, buf)
    }

    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        let kind = Kind::AllGather;
        self.shape().collective(
            kind,
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        self.blocking(kind, Some(send), recv)
    }

    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let kind = Kind::ReduceScatter(op);
        self.shape().collective(
            kind,
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        self.blocking(kind, Some(send), recv)
    }

    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        let kind = Kind::AllToAll;
        self.shape().collective(
            kind,
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        self.blocking(kind, Some(send), recv)
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        self.begin(OP)?;
        self.shared.bind(OP)?;
        self.barrier_enqueue(OP)?;
        self.shared.sync(OP)
    }

    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        self.shape().peer("send", peer)?;
        self.p2p("send", vec![P2pOp::Send { buf, peer, tag }])
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        self.shape().peer("recv", peer)?;
        self.p2p("recv", vec![P2pOp::Recv { buf, peer, tag }])
    }

    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        self.p2p("batch_p2p", ops)
    }

    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        let op = request.name();
        let p2p = matches!(request, Request::Send { .. } | Request::Recv { .. });
        if p2p {
            // Deferred: enqueued together with the other pending sends and receives (see
            // `Shared::flush`), not flushed here.
            self.live(op)?;
        } else {
            self.begin(op)?;
        }
        self.shape().request(&request)?;
        self.shared.bind(op)?;
        let mut keep: Vec<Box<dyn DeviceBuffer>> = Vec::new();
        let mut slot = None;
        let output = match request {
            Request::AllReduce { buf, op: r } => {
                self.start_in_place(op, Kind::AllReduce(r), buf, false)?
            }
            Request::Broadcast { buf, root } => {
                self.start_in_place(op, Kind::Broadcast(root), buf, true)?
            }
            Request::AllReduceInto { send, recv, op: r } => {
                self.start_two(op, Kind::AllReduce(r), send, recv, &mut keep)?
            }
            Request::AllGather { send, recv } => {
                self.start_two(op, Kind::AllGather, send, recv, &mut keep)?
            }
            Request::ReduceScatter { send, recv, op: r } => {
                self.start_two(op, Kind::ReduceScatter(r), send, recv, &mut keep)?
            }
            Request::AllToAll { send, recv } => {
                self.start_two(op, Kind::AllToAll, send, recv, &mut keep)?
            }
            Request::Barrier => {
                self.barrier_enqueue(op)?;
                Output::Ready(Tensor::Host(HostBuffer::zeros(DType::U8, 0)))
            }
            Request::Send { buf, peer, .. } => {
                let (dev, host) = self.operand(op, buf, true)?;
                match (dev, host) {
                    (Some(d), host) => {
                        if host.is_none() {
                            self.wait_for(op, &*d)?;
                        }
                        slot = Some(self.shared.defer(true, peer, d));
                        match host {
                            Some(h) => Output::Ready(Tensor::Host(h)),
                            None => Output::Slot { staged: false },
                        }
                    }
                    (None, Some(h)) => Output::Ready(Tensor::Host(h)),
                    (None, None) => return Err(internal(op, "send operand")),
                }
            }
            Request::Recv { buf, peer, .. } => {
                let (dev, host) = self.operand(op, buf, false)?;
                match (dev, host) {
                    (Some(d), host) => {
                        if host.is_none() {
                            self.wait_for(op, &*d)?;
                        }
                        slot = Some(self.shared.defer(false, peer, d));
                        Output::Slot {
                            staged: host.is_some(),
                        }
                    }
                    (None, Some(h)) => Output::Ready(Tensor::Host(h)),
                    (None, None) => return Err(internal(op, "recv operand")),
                }
            }
        };
        let event = match slot {
            Some(_) => None,
            None => Some(Arc::new(cuda(op, || {
                self.shared.stream.record_event(None)
            })?)),
        };
        Ok(Box::new(NcclWork {
            shared: self.shared.clone(),
            comm_stream: self.shared.stream.clone(),
            op,
            event,
            slot,
            started: Instant::now(),
            output: Some(output),
            _keep: keep,
        }))
    }

    fn synchronize(&self) -> Result<()> {
        self.begin("synchronize")?;
        self.shared.sync("synchronize")
    }
}

impl NcclCommunicator {
    fn start_in_place(
        &self,
        op: &'static str,
        kind: Kind,
        buf: Tensor,
        upload: bool,
    ) -> Result<Output> {
        let is_host = matches!(buf, Tensor::Host(_));
        // In-place all-reduce reads the buffer too.
        let upload = upload || matches!(kind, Kind::AllReduce(_));
        let (dev, host) = self.operand(op, buf, upload)?;
        match dev {
            None => Ok(Output::Ready(Tensor::Host(
                host.unwrap_or_else(|| HostBuffer::zeros(DType::U8, 0)),
            ))),
            Some(mut d) => {
                self.enqueue(op, kind, None, &mut *d)?;
                Ok(if is_host {
                    Output::Staged(d)
                } else {
                    Output::Device(d)
                })
            }
        }
    }

    fn start_two(
        &self,
        op: &'static str,
        kind: Kind,
        send: Tensor,
        recv: Tensor,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
    ) -> Result<Output> {
        let recv_host = matches!(recv, Tensor::Host(_));
        let (sdev, _) = self.operand(op, send, true)?;
        let (rdev, rhost) = self.operand(op, recv, false)?;
        match (sdev, rdev) {
            (Some(s), Some(mut r)) => {
                self.enqueue(op, kind, Some(&*s), &mut *r)?;
                keep.push(s);
                Ok(if recv_host {
                    Output::Staged(r)
                } else {
                    Output::Device(r)
                })
            }
            (s, None) => {
                keep.extend(s);
                Ok(Output::Ready(Tensor::Host(
                    rhost.unwrap_or_else(|| HostBuffer::zeros(DType::U8, 0)),
                )))
            }
            (None, Some(r)) => Ok(if recv_host {
                Output::Staged(r)
            } else {
                Output::Device(r)
            }),
        }
    }
}
