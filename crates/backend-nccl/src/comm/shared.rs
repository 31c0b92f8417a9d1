//! [`Shared`]: the state one NCCL communicator shares with its pending [`grid_core::Work`]
//! handles — the NCCL handle, the CUDA stream, and its entry in the process's watchdog
//! ([`crate::engine`]), through which every enqueued operation is watched (completion marker,
//! time limit, asynchronous error) and every wait blocks on a condition variable, never in a
//! sleep loop.

use super::exec::hold;
use crate::buffer::{downcast, downcast_mut, with_dtype};
use crate::engine::Pool;
use crate::engine::{
    Capture, Completion, Deferred, DeviceEvent, DeviceStream, Launch, Outbox, Progress, Tracked,
    Watchdog,
};
use crate::error::{annotate, cuda};
use crate::ffi::{kick_when_reached, DevIn, DevOut, P2p, RawComm};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use grid_core::{DeviceBuffer, Error, Result, TimeLimit};
use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// The state shared by a communicator and its pending work handles.
pub(crate) struct Shared {
    pub(crate) raw: Arc<RawComm>,
    pub(crate) tracked: Arc<Tracked>,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The communicator's descriptive name (the front end's name), for errors.
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    /// One float the barrier all-reduces (allocated on first use).
    pub(super) scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Serialises NCCL calls (and the settling of an `ncclInProgress`) of every communicator
    /// of this device in this process ([`device_lock`]).
    device_calls: Arc<Mutex<()>>,
    /// The held-back sends and receives of every communicator of this device ([`outbox`]).
    pub(crate) outbox: Arc<Outbox>,
    /// This communicator's held-back sends and receives, posted as one group.
    pending: Mutex<Vec<PendingP2p>>,
    /// The two point-to-point lanes (`[up, down]`, see [`crate::p2p`]), when the communicator
    /// posts sends and receives at once; unset with [`crate::p2p::P2pPosting::HoldBack`] and on
    /// a lane itself.
    pub(crate) lanes: OnceLock<[Arc<Shared>; 2]>,
    /// The CUDA events this communicator records ([`PooledEvent`]).
    events: Arc<Pool<CudaEvent>>,
}

/// How many idle CUDA events one communicator keeps for reuse.
const EVENT_POOL: usize = 64;

/// A CUDA event from a communicator's [`Pool`]: it goes back to the pool when the last handle
/// drops, that is when no completion, work or wait can still refer to it (a stream wait that was
/// already enqueued keeps the state the event had then, so re-recording it later is safe).
pub(crate) struct PooledEvent {
    event: Option<CudaEvent>,
    pool: Arc<Pool<CudaEvent>>,
}

impl std::ops::Deref for PooledEvent {
    type Target = CudaEvent;
    fn deref(&self) -> &CudaEvent {
        // Set from construction until drop.
        self.event
            .as_ref()
            .unwrap_or_else(|| unreachable!("a pooled event is taken only in drop"))
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            self.pool.give(e);
        }
    }
}

/// A nonblocking send or receive held back until the next [`Outbox::post_all`].
struct PendingP2p {
    send: bool,
    peer: usize,
    buf: Box<dyn DeviceBuffer>,
    limit: TimeLimit,
    cell: Arc<Mutex<Cell>>,
}

/// Where a held-back operation's work finds its completion once posted.
pub(super) enum Cell {
    Waiting,
    Posted(Completion, Arc<PooledEvent>),
    Failed(Error),
    Taken,
}

/// The [`Outbox`] of GPU `ordinal` in this process.
pub(crate) fn outbox(ordinal: usize) -> Arc<Outbox> {
    static BOXES: Mutex<Vec<(usize, Arc<Outbox>)>> = Mutex::new(Vec::new());
    let mut l = lock(&BOXES);
    if let Some((_, b)) = l.iter().find(|(o, _)| *o == ordinal) {
        return b.clone();
    }
    let b = Arc::new(Outbox::default());
    l.push((ordinal, b.clone()));
    b
}

/// The shorter of two limits.
fn shorter(a: TimeLimit, b: TimeLimit) -> TimeLimit {
    match (a.duration(), b.duration()) {
        (Some(x), Some(y)) => TimeLimit::After(x.min(y)),
        (Some(_), None) => a,
        _ => b,
    }
}

/// The lock that serialises the NCCL calls of every communicator of GPU `ordinal` in this
/// process: NCCL forbids concurrent calls on one communicator, and calls on several
/// communicators of one device from several threads must not interleave (before NCCL 2.26 they
/// must even be issued in one global order). It is held for one enqueue and, when NCCL answers
/// `ncclInProgress`, until that call settled (within the operation's time limit); never while a
/// thread waits for an operation to complete, and never by `abort()` or the watchdog.
pub(crate) fn device_lock(ordinal: usize) -> Arc<Mutex<()>> {
    static LOCKS: Mutex<Vec<(usize, Arc<Mutex<()>>)>> = Mutex::new(Vec::new());
    let mut l = lock(&LOCKS);
    if let Some((_, m)) = l.iter().find(|(o, _)| *o == ordinal) {
        return m.clone();
    }
    let m = Arc::new(Mutex::new(()));
    l.push((ordinal, m.clone()));
    m
}

/// Locks a mutex, also after a panic of another holder (the data stays consistent: every
/// critical section here only moves values in and out).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A read token for an erased device buffer of this backend on `stream`.
pub(super) fn din<'a>(
    op: &'static str,
    d: &'a dyn DeviceBuffer,
    stream: &'a CudaStream,
) -> Result<DevIn<'a>> {
    with_dtype!(d.dtype(), T => DevIn::new::<T, _>(&downcast::<T>(op, d)?.slice, stream))
}

/// A write token for an erased device buffer of this backend on `stream`.
pub(super) fn dout<'a>(
    op: &'static str,
    d: &'a mut dyn DeviceBuffer,
    stream: &'a CudaStream,
) -> Result<DevOut<'a>> {
    with_dtype!(d.dtype(), T => DevOut::new::<T, _>(&mut downcast_mut::<T>(op, d)?.slice, stream))
}

/// A CUDA stream as the state machine sees it: its graph-capture state.
pub(crate) struct StreamState<'a>(pub(crate) &'a CudaStream);

impl DeviceStream for StreamState<'_> {
    fn capture(&self) -> Result<Capture> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        cuda("cuStreamIsCapturing", || self.0.capture_status()).map(|s| match s {
            S::CU_STREAM_CAPTURE_STATUS_NONE => Capture::Eager,
            S::CU_STREAM_CAPTURE_STATUS_ACTIVE => Capture::Capturing,
            S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Capture::Invalidated,
        })
    }
}

/// The completion marker of one operation: a CUDA event recorded right after it on the
/// communicator's stream.
pub(super) struct Marker {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) event: Arc<PooledEvent>,
}

impl DeviceEvent for Marker {
    fn query(&self) -> Result<Progress> {
        const OP: &str = "cuEventQuery";
        crate::ffi::relax_capture_mode();
        cuda(OP, || self.ctx.bind_to_thread())?;
        cuda(OP, || self.event.try_is_complete()).map(|done| {
            if done {
                Progress::Done
            } else {
                Progress::InProgress
            }
        })
    }
}

impl Shared {
    pub(crate) fn new(
        raw: Arc<RawComm>,
        tracked: Arc<Tracked>,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        name: String,
        timeout: Duration,
    ) -> Shared {
        let device_calls = device_lock(ctx.ordinal());
        let outbox = outbox(ctx.ordinal());
        Shared {
            outbox,
            pending: Mutex::new(Vec::new()),
            raw,
            tracked,
            ctx,
            stream,
            name,
            timeout,
            scratch: Mutex::new(None),
            device_calls,
            lanes: OnceLock::new(),
            events: Arc::new(Pool::new(EVENT_POOL)),
        }
    }

    /// Records a pooled event on `stream` (this communicator's device) after everything
    /// enqueued on it so far.
    pub(crate) fn record(&self, op: &'static str, stream: &CudaStream) -> Result<PooledEvent> {
        let event = self.events.take(|| cuda(op, || self.ctx.new_event(None)))?;
        let event = PooledEvent {
            event: Some(event),
            pool: self.events.clone(),
        };
        cuda(op, || event.record(stream))?;
        Ok(event)
    }

    /// `waiter` waits for the work enqueued so far on `on` (a pooled event instead of cudarc's
    /// `join`, which creates and destroys one per call). The event goes back to the pool at once:
    /// the wait keeps the state it was recorded with.
    pub(crate) fn join(
        &self,
        op: &'static str,
        waiter: &CudaStream,
        on: &CudaStream,
    ) -> Result<()> {
        let event = self.record(op, on)?;
        cuda(op, || waiter.wait(&event))
    }

    /// The lane a send to (`send`) or receive from `peer` is posted on, when this communicator
    /// has lanes ([`crate::p2p::lane`]).
    pub(crate) fn lane_for(&self, peer: usize, send: bool) -> Option<&Arc<Shared>> {
        let lanes = self.lanes.get()?;
        Some(&lanes[crate::p2p::lane(self.raw.rank(), peer, send).index()])
    }

    /// Aborts the communicator and its lanes; true if the communicator itself was live.
    pub(crate) fn abort(&self, why: &str) -> bool {
        let first = self.tracked.abort(why);
        for l in self.lanes.get().into_iter().flatten() {
            l.tracked.abort(why);
        }
        first
    }

    /// Waits (host) until everything enqueued so far on the communicator and on its lanes has
    /// completed, within `limit` each.
    pub(crate) fn sync_all(&self, op: &'static str, limit: TimeLimit) -> Result<()> {
        self.sync(op, limit)?;
        for l in self.lanes.get().into_iter().flatten() {
            l.sync(op, limit)?;
        }
        Ok(())
    }

    /// Holds this device's NCCL call lock ([`device_lock`]).
    pub(crate) fn device_guard(&self) -> MutexGuard<'_, ()> {
        lock(&self.device_calls)
    }

    /// Runs one NCCL call on the communicator under the device's call lock, then settles an
    /// `ncclInProgress` within `limit` (still under the lock) or fails the communicator on an
    /// error ([`Shared::after_call`]).
    pub(crate) fn call(
        &self,
        op: &'static str,
        limit: TimeLimit,
        f: impl FnOnce() -> Result<Progress>,
    ) -> Result<()> {
        let _g = self.device_guard();
        // Nothing more is enqueued on a communicator that failed or was aborted (its library
        // abort may still be running on its helper thread).
        self.tracked.check_live(op)?;
        let r = f();
        self.after_call(op, r, limit)
    }

    /// Makes the device's context current on this thread.
    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        crate::ffi::forgive_captured_event_waits(&self.ctx);
        cuda(op, || self.ctx.bind_to_thread())
    }

    /// `Ok` while the communicator is live (not failed, aborted or destroyed).
    pub(super) fn check_live(&self, op: &'static str) -> Result<()> {
        self.tracked.check_live(op)
    }

    /// After an NCCL call on the communicator: `InProgress` (nonblocking mode) is settled under
    /// `limit` before anything else is called on it; a synchronous NCCL error fails the
    /// communicator (and, per the job's setting, aborts the job).
    pub(super) fn after_call(
        &self,
        op: &'static str,
        r: Result<Progress>,
        limit: TimeLimit,
    ) -> Result<()> {
        match r {
            Ok(Progress::Done) => Ok(()),
            Ok(Progress::InProgress) => {
                self.tracked.begin(op);
                self.tracked.settle(op, limit)
            }
            Err(e) => Err(self.failed_call(op, e)),
        }
    }

    /// A synchronous NCCL error of a call on this communicator: fails it (and, per the job's
    /// setting, aborts the job); returns the error named after `op` and the communicator.
    pub(crate) fn failed_call(&self, op: &'static str, e: grid_core::Error) -> grid_core::Error {
        let e = annotate(e, op, &self.name);
        self.tracked.fail(e.clone());
        e
    }

    /// Registers everything enqueued on the stream so far as operation `op` with the watchdog:
    /// records the completion marker, enqueues the host function that kicks the watchdog when
    /// the device reaches it, and hands `keep` (buffers the device uses) to the watchdog until
    /// then. Returns the completion and its event (for streams that must wait on it).
    ///
    /// While the stream is being captured into a CUDA graph nothing is watched
    /// ([`Launch::Captured`]): the event is recorded (a node of the graph, for stream-ordered
    /// waits inside the capture) but never queried, and no host function is enqueued.
    pub(crate) fn watch(
        &self,
        op: &'static str,
        limit: TimeLimit,
        keep: Vec<Box<dyn Any + Send>>,
    ) -> Result<(Completion, Arc<PooledEvent>)> {
        let mut eager = None;
        let (c, launch) = self.tracked.launch_on(
            op,
            limit,
            &StreamState(&self.stream),
            || {
                let event = self.mark(op)?;
                eager = Some(event.clone());
                Ok(Box::new(Marker {
                    ctx: self.ctx.clone(),
                    event,
                }) as Box<dyn DeviceEvent>)
            },
            keep,
        )?;
        let event = match (launch, eager) {
            (Launch::Watched, Some(ev)) => ev,
            _ => Arc::new(self.record(op, &self.stream)?),
        };
        Ok((c, event))
    }

    /// The capture state of this communicator's stream together with `others` (the streams of
    /// an operation's device buffers, which it joins).
    pub(crate) fn capture_with(&self, others: &[Arc<CudaStream>]) -> Result<Capture> {
        let mut states = vec![StreamState(&self.stream).capture()?];
        for s in others {
            states.push(StreamState(s).capture()?);
        }
        Ok(crate::engine::combine_capture(states))
    }

    /// After an enqueue that failed: NCCL may have enqueued part of it, so `keep` stays with the
    /// watchdog until the device is done with it (the communicator has failed, so the marker
    /// fires once NCCL's abort stopped its kernels).
    pub(crate) fn hold_after_error(&self, op: &'static str, keep: Vec<Box<dyn Any + Send>>) {
        if keep.is_empty() {
            return;
        }
        match self.watch(op, TimeLimit::Unlimited, keep) {
            Ok((c, _)) => drop(c),
            Err(e) => tracing::warn!("nccl: {op}: cannot hold its buffers after a failure: {e}"),
        }
    }

    /// Records a completion marker after everything enqueued so far, and the host function
    /// that kicks the watchdog when the device reaches it.
    fn mark(&self, op: &'static str) -> Result<Arc<PooledEvent>> {
        let event = Arc::new(self.record(op, &self.stream)?);
        let dog = Watchdog::global()?;
        if let Err(e) = kick_when_reached(&self.stream, dog.kicker()) {
            // Without the host function the watchdog still notices at its next poll.
            tracing::debug!("nccl: {e}; completion noticed at the watchdog's next poll");
        }
        Ok(event)
    }

    /// Holds a nonblocking send or receive back until the next [`Outbox::post_all`] (the
    /// buffer's stream already joined the communicator's stream).
    pub(super) fn defer(
        &self,
        send: bool,
        peer: usize,
        buf: Box<dyn DeviceBuffer>,
        limit: TimeLimit,
    ) -> Arc<Mutex<Cell>> {
        let cell = Arc::new(Mutex::new(Cell::Waiting));
        lock(&self.pending).push(PendingP2p {
            send,
            peer,
            buf,
            limit,
            cell: cell.clone(),
        });
        cell
    }

    /// Posts the held-back sends and receives as one NCCL group; each gets its own completion
    /// (one marker after the group) holding its buffer until the device is done with it.
    fn post_pending(&self) {
        const OP: &str = "isend/irecv";
        let mut items = std::mem::take(&mut *lock(&self.pending));
        if items.is_empty() {
            return;
        }
        if let Err(e) = self.tracked.check_live(OP) {
            // Never enqueued: the buffers can go now.
            for p in items {
                *lock(&p.cell) = Cell::Failed(e.clone());
            }
            return;
        }
        let limit = items
            .iter()
            .fold(TimeLimit::Unlimited, |l, p| shorter(l, p.limit));
        let posted = self.bind(OP).and_then(|()| {
            let st = &*self.stream;
            let mut tokens = Vec::with_capacity(items.len());
            for p in items.iter_mut() {
                tokens.push(if p.send {
                    P2p::Send(din(OP, &*p.buf, st)?, p.peer)
                } else {
                    P2p::Recv(dout(OP, &mut *p.buf, st)?, p.peer)
                });
            }
            self.call(OP, limit, || self.raw.p2p_group(OP, tokens, st))
        });
        // The buffers go to the watchdog whatever happened (NCCL may have enqueued part of
        // the group); a failure is what every work of the group reports. Each gets its own
        // marker (or, during a graph capture, none: see `watch`).
        for p in items {
            let op = if p.send { "send" } else { "recv" };
            let watched = self.watch(op, p.limit, vec![hold(p.buf)]);
            let outcome = match (&posted, watched) {
                (Ok(()), Ok((c, ev))) => Cell::Posted(c, ev),
                (Err(e), Ok((c, _))) => {
                    drop(c);
                    Cell::Failed(e.clone())
                }
                (_, Err(e)) => Cell::Failed(e),
            };
            *lock(&p.cell) = outcome;
        }
    }

    /// Waits (host) until everything enqueued on the stream so far has completed, within
    /// `limit`.
    pub(crate) fn sync(&self, op: &'static str, limit: TimeLimit) -> Result<()> {
        self.bind(op)?;
        let (c, _) = self.watch(op, limit, Vec::new())?;
        c.wait().map(|_| ())
    }
}

impl Deferred for Shared {
    fn post_deferred(&self) {
        self.post_pending();
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Held-back operations whose works were dropped are still owed to their peers.
        self.post_pending();
        // The watchdog lets the pending operations finish (within their limits), then
        // finalizes and destroys the communicator without blocking, or aborts it.
        self.tracked.close();
    }
}
