//! [`Shared`]: the state one NCCL communicator shares with its pending [`grid_core::Work`]
//! handles — the NCCL handle, the CUDA stream, the queue of deferred sends and receives, and
//! the waits on CUDA events with the timeout and failure handling.

use crate::buffer::{downcast, downcast_mut, with_dtype};
use crate::error::{annotate, cuda};
use crate::ffi::{DevIn, DevOut, P2p, RawComm};
use crate::job::Job;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use grid_core::{DeviceBuffer, Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The state shared by a communicator and its pending work handles.
pub(crate) struct Shared {
    pub(crate) raw: RawComm,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The communicator's descriptive name (the front end's name), for errors.
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) abort_on_failure: bool,
    pub(crate) job: Arc<Job>,
    /// One float the barrier all-reduces (allocated on first use).
    pub(super) scratch: Mutex<Option<CudaSlice<f32>>>,
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
pub(super) enum Slot {
    Waiting(Box<dyn DeviceBuffer>),
    Enqueued(Box<dyn DeviceBuffer>, Arc<CudaEvent>),
    Failed(Error),
    Taken,
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

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        raw: RawComm,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        name: String,
        timeout: Duration,
        abort_on_failure: bool,
        job: Arc<Job>,
    ) -> Shared {
        Shared {
            raw,
            ctx,
            stream,
            name,
            timeout,
            abort_on_failure,
            job,
            scratch: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
        }
    }

    /// Enqueues the pending nonblocking sends and receives as **one** NCCL group, so that
    /// `irecv` + `isend` patterns (rings, pipeline exchanges) cannot deadlock on the stream.
    /// Called before any other operation of the communicator and when a pending work is
    /// waited on or polled; the queue lock is held throughout, so flushes are serialised.
    pub(super) fn flush(&self, op: &'static str) -> Result<()> {
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
        let event = event.map_err(|e| annotate(e, op, &self.name));
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
    pub(super) fn defer(
        &self,
        send: bool,
        peer: usize,
        buf: Box<dyn DeviceBuffer>,
    ) -> Arc<Mutex<Slot>> {
        let slot = Arc::new(Mutex::new(Slot::Waiting(buf)));
        lock(&self.pending).push(Pending {
            send,
            peer,
            slot: slot.clone(),
        });
        slot
    }

    /// Makes the device's context current on this thread.
    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        cuda(op, || self.ctx.bind_to_thread())
    }

    /// Reports a failure: aborts the job's communicators first when configured to.
    pub(super) fn failed(&self, e: Error) -> Error {
        if self.abort_on_failure {
            let n = self.job.abort_all();
            tracing::error!("nccl: {e}; aborted {n} communicator(s) of the job");
        }
        e
    }

    /// [`Error::Finalized`] with the communicator's state.
    pub(super) fn state_error(&self, op: &'static str) -> Error {
        Error::Finalized {
            op,
            state: if self.raw.state_name() == "destroyed" {
                "destroyed"
            } else {
                "aborted"
            },
        }
    }

    /// `Ok` while the communicator is live.
    pub(super) fn check_live(&self, op: &'static str) -> Result<()> {
        if self.raw.is_live() {
            Ok(())
        } else {
            Err(self.state_error(op))
        }
    }

    /// Polls `ev` for at most `limit`: `Ok(true)` when it fired, `Ok(false)` at the limit.
    /// Errors: the communicator was aborted, NCCL reported an asynchronous error, or the driver
    /// failed.
    pub(super) fn poll_event(
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
    pub(super) fn wait_event(&self, op: &'static str, ev: &CudaEvent) -> Result<()> {
        if self.poll_event(op, ev, self.timeout)? {
            Ok(())
        } else {
            Err(self.failed(Error::Timeout {
                op,
                millis: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                peer: None,
                at: None,
            }))
        }
    }

    /// Waits until everything enqueued on the stream so far has completed.
    pub(super) fn sync(&self, op: &'static str) -> Result<()> {
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
