//! Nonblocking execution: validated requests enqueued on the communicator's stream (sends and
//! receives deferred into one group), and [`NcclWork`], which completes through a CUDA event.

use super::exec::Kind;
use super::shared::{lock, Shared, Slot};
use super::NcclBackend;
use crate::buffer::{downcast, owned, with_dtype};
use crate::error::{annotate, cuda, internal};
use cudarc::driver::{CudaEvent, CudaStream};
use grid_core::{DType, DeviceBuffer, Error, HostBuffer, Request, Result, Tensor, Work};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A tensor as device memory plus, for host tensors, the original host buffer.
type Operand = (Option<Box<dyn DeviceBuffer>>, Option<HostBuffer>);

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

fn empty() -> Tensor {
    Tensor::Host(HostBuffer::zeros(DType::U8, 0))
}

impl NcclBackend {
    /// Starts one validated nonblocking operation.
    pub(super) fn start_request(&self, request: Request) -> Result<Box<dyn Work>> {
        let op = request.name();
        let p2p = matches!(request, Request::Send { .. } | Request::Recv { .. });
        if !p2p {
            // Pending sends and receives were started first: enqueue them first. Sends and
            // receives themselves are deferred (see `Shared::flush`), not flushed here.
            self.shared.flush(op)?;
        }
        self.shared.bind(op)?;
        let mut keep: Vec<Box<dyn DeviceBuffer>> = Vec::new();
        let mut slot = None;
        let output = match request {
            Request::AllReduce { buf, op: r } => {
                self.start_in_place(op, Kind::AllReduce(r), buf)?
            }
            Request::Broadcast { buf, root } => {
                self.start_in_place(op, Kind::Broadcast(root), buf)?
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
                Output::Ready(empty())
            }
            Request::Send { buf, peer, .. } => match self.operand(op, buf, true)? {
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
            },
            Request::Recv { buf, peer, .. } => match self.operand(op, buf, false)? {
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
            },
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

    /// Turns an owned tensor into device memory: device tensors as they are, host tensors
    /// staged (uploaded when `upload`, else zero-filled). Returns the device operand and, for
    /// host tensors, the original host buffer.
    fn operand(&self, op: &'static str, t: Tensor, upload: bool) -> Result<Operand> {
        match t {
            Tensor::Device(d) => {
                super::exec::same_device(op, d.device(), self.device)?;
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

    /// In-place broadcast or all-reduce of one tensor (NCCL's send buffer is the receive
    /// buffer; a host tensor is uploaded, reduced on the GPU and copied back on completion).
    fn start_in_place(&self, op: &'static str, kind: Kind, buf: Tensor) -> Result<Output> {
        let is_host = matches!(buf, Tensor::Host(_));
        let (dev, host) = self.operand(op, buf, kind.reads_recv(true))?;
        match dev {
            None => Ok(Output::Ready(host.map(Tensor::Host).unwrap_or_else(empty))),
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

    /// A two-buffer collective; the send buffer is kept alive until the work completes.
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
        let out = |r| {
            if recv_host {
                Output::Staged(r)
            } else {
                Output::Device(r)
            }
        };
        match (sdev, rdev) {
            (Some(s), Some(mut r)) => {
                self.enqueue(op, kind, Some(&*s), &mut *r)?;
                keep.push(s);
                Ok(out(r))
            }
            (s, None) => {
                keep.extend(s);
                Ok(Output::Ready(rhost.map(Tensor::Host).unwrap_or_else(empty)))
            }
            (None, Some(r)) => Ok(out(r)),
        }
    }
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
        write!(f, "NcclWork({} on '{}')", self.op, self.shared.name)
    }
}

impl NcclWork {
    fn annotate(&self, e: Error) -> Error {
        annotate(e, self.op, &self.shared.name)
    }

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

    fn wait_inner(mut self) -> Result<Tensor> {
        self.shared.bind(self.op)?;
        let ev = self.event()?;
        self.shared.wait_event(self.op, &ev)?;
        self.finish(&ev)
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

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let (op, shared) = (self.op, self.shared.clone());
        (*self)
            .wait_inner()
            .map_err(|e| annotate(e, op, &shared.name))
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        if let Err(e) = self.shared.bind(self.op) {
            return Ok(Err(self.annotate(e)));
        }
        let ev = match self.event() {
            Ok(ev) => ev,
            Err(e) => return Ok(Err(self.annotate(e))),
        };
        let remaining = self.shared.timeout.saturating_sub(self.started.elapsed());
        match self.shared.poll_event(self.op, &ev, timeout.min(remaining)) {
            Ok(true) => {
                let (op, shared) = (self.op, self.shared.clone());
                Ok(self.finish(&ev).map_err(|e| annotate(e, op, &shared.name)))
            }
            Ok(false) if timeout < remaining => Err(self),
            Ok(false) => {
                let millis = u64::try_from(self.shared.timeout.as_millis()).unwrap_or(u64::MAX);
                Ok(Err(self.shared.failed(Error::Timeout {
                    op: self.op,
                    millis,
                    peer: None,
                    at: None,
                })))
            }
            Err(e) => Ok(Err(self.annotate(e))),
        }
    }
}
