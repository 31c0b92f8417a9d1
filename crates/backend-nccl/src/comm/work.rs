//! Nonblocking execution: validated requests enqueued on the communicator's stream **when they
//! are started** (sends and receives too), each watched by the process's watchdog, and
//! [`NcclWork`], which completes through the operation's completion marker.

use super::exec::{hold, unhold, Kind};
use super::shared::Shared;
use super::NcclBackend;
use crate::buffer::{downcast, owned, with_dtype};
use crate::engine::Completion;
use crate::error::{annotate, cuda, internal};
use crate::ffi::P2p;
use cudarc::driver::CudaEvent;
use grid_core::{DType, DeviceBuffer, Error, HostBuffer, Request, Result, Tensor, TimeLimit, Work};
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// A tensor as device memory plus, for host tensors, the original host buffer.
type Operand = (Option<Box<dyn DeviceBuffer>>, Option<HostBuffer>);

/// What a finished [`NcclWork`] hands back.
enum Output {
    /// The first held buffer, device memory: returned as is, stream-ordered.
    Device,
    /// The first held buffer, a staged result: copied to the host on completion.
    Staged,
    /// Ready on completion (a sent host buffer, a barrier).
    Ready(Tensor),
}

fn empty() -> Tensor {
    Tensor::Host(HostBuffer::zeros(DType::U8, 0))
}

impl NcclBackend {
    /// Starts one validated nonblocking operation: enqueued now, watched by the watchdog.
    pub(super) fn start_request(
        &self,
        request: Request,
        limit: TimeLimit,
    ) -> Result<Box<dyn Work>> {
        let op = request.name();
        self.shared.bind(op)?;
        // The buffers the device uses, the result first.
        let mut keep: Vec<Box<dyn DeviceBuffer>> = Vec::new();
        let output = match request {
            Request::AllReduce { buf, op: r } => {
                self.start_in_place(op, Kind::AllReduce(r), buf, &mut keep, limit)?
            }
            Request::Broadcast { buf, root } => {
                self.start_in_place(op, Kind::Broadcast(root), buf, &mut keep, limit)?
            }
            Request::AllReduceInto { send, recv, op: r } => {
                self.start_two(op, Kind::AllReduce(r), send, recv, &mut keep, limit)?
            }
            Request::AllGather { send, recv } => {
                self.start_two(op, Kind::AllGather, send, recv, &mut keep, limit)?
            }
            Request::ReduceScatter { send, recv, op: r } => {
                self.start_two(op, Kind::ReduceScatter(r), send, recv, &mut keep, limit)?
            }
            Request::AllToAll { send, recv } => {
                self.start_two(op, Kind::AllToAll, send, recv, &mut keep, limit)?
            }
            Request::Barrier => {
                self.barrier_enqueue(op, limit)?;
                Output::Ready(empty())
            }
            Request::Send { buf, peer, .. } => match self.operand(op, buf, true)? {
                (Some(d), host) => {
                    self.post(op, true, peer, d, &mut keep, host.is_none(), limit)?;
                    match host {
                        Some(h) => Output::Ready(Tensor::Host(h)),
                        None => Output::Device,
                    }
                }
                (None, Some(h)) => return Ok(ready(self, op, Tensor::Host(h))),
                (None, None) => return Err(internal(op, "send operand")),
            },
            Request::Recv { buf, peer, .. } => match self.operand(op, buf, false)? {
                (Some(d), host) => {
                    self.post(op, false, peer, d, &mut keep, host.is_none(), limit)?;
                    if host.is_some() {
                        Output::Staged
                    } else {
                        Output::Device
                    }
                }
                (None, Some(h)) => return Ok(ready(self, op, Tensor::Host(h))),
                (None, None) => return Err(internal(op, "recv operand")),
            },
        };
        if let Output::Ready(t) = output {
            if keep.is_empty() && op != "barrier" {
                // Nothing was enqueued (empty buffers).
                return Ok(ready(self, op, t));
            }
            let (c, event) = self
                .shared
                .watch(op, limit, keep.into_iter().map(hold).collect())?;
            return Ok(work(self, op, Some(c), Some(event), Output::Ready(t)));
        }
        let (c, event) = self
            .shared
            .watch(op, limit, keep.into_iter().map(hold).collect())?;
        Ok(work(self, op, Some(c), Some(event), output))
    }

    /// Posts one send or receive now (a group of one), so it can match a peer's operation
    /// whatever this rank does next on other communicators.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        op: &'static str,
        send: bool,
        peer: usize,
        mut d: Box<dyn DeviceBuffer>,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
        device: bool,
        limit: TimeLimit,
    ) -> Result<()> {
        if device {
            self.wait_for(op, &*d)?;
        }
        let st = &*self.shared.stream;
        let r = {
            let token = if send {
                P2p::Send(super::shared::din(op, &*d, st)?, peer)
            } else {
                P2p::Recv(super::shared::dout(op, &mut *d, st)?, peer)
            };
            self.shared
                .call(op, limit, || self.shared.raw.p2p_group(op, vec![token], st))
        };
        // Held by the work (and the watchdog) whatever happened: NCCL may have enqueued it.
        keep.push(d);
        r
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
    fn start_in_place(
        &self,
        op: &'static str,
        kind: Kind,
        buf: Tensor,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
        limit: TimeLimit,
    ) -> Result<Output> {
        let is_host = matches!(buf, Tensor::Host(_));
        let (dev, host) = self.operand(op, buf, kind.reads_recv(true))?;
        match dev {
            None => Ok(Output::Ready(host.map(Tensor::Host).unwrap_or_else(empty))),
            Some(mut d) => {
                self.enqueue(op, kind, None, &mut *d, limit)?;
                keep.push(d);
                Ok(if is_host {
                    Output::Staged
                } else {
                    Output::Device
                })
            }
        }
    }

    /// A two-buffer collective; the send buffer is held until the work completes.
    fn start_two(
        &self,
        op: &'static str,
        kind: Kind,
        send: Tensor,
        recv: Tensor,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
        limit: TimeLimit,
    ) -> Result<Output> {
        let recv_host = matches!(recv, Tensor::Host(_));
        let (sdev, _) = self.operand(op, send, true)?;
        let (rdev, rhost) = self.operand(op, recv, false)?;
        match (sdev, rdev) {
            (Some(s), Some(mut r)) => {
                self.enqueue(op, kind, Some(&*s), &mut *r, limit)?;
                keep.push(r);
                keep.push(s);
                Ok(if recv_host {
                    Output::Staged
                } else {
                    Output::Device
                })
            }
            (_, None) => Ok(Output::Ready(rhost.map(Tensor::Host).unwrap_or_else(empty))),
            (None, Some(_)) => Err(internal(op, "receive buffer without send buffer")),
        }
    }
}

fn work(
    b: &NcclBackend,
    op: &'static str,
    completion: Option<Completion>,
    event: Option<Arc<CudaEvent>>,
    output: Output,
) -> Box<dyn Work> {
    Box::new(NcclWork {
        shared: b.shared.clone(),
        op,
        completion,
        event,
        output: Some(output),
    })
}

/// A work that nothing was enqueued for (empty buffers): complete at once.
fn ready(b: &NcclBackend, op: &'static str, t: Tensor) -> Box<dyn Work> {
    work(b, op, None, None, Output::Ready(t))
}

/// A started operation: completes when the completion marker recorded after it has fired (the
/// watchdog notices, woken by a CUDA host function).
///
/// * [`Work::wait`] on a **device** result does not block the host: the result buffer's stream
///   is made to wait for the marker and the buffer is returned at once (stream-ordered, like
///   NCCL itself); a failure found later fails the communicator, and the next operation reports
///   it. On a **host** result (staged) it blocks the host until the marker fired and copies the
///   result back.
/// * [`Work::wait_timeout`] always blocks the host (use it when the host needs the data).
/// * Dropping it unfinished is safe: its buffers stay with the watchdog until the device is
///   done with them, and are freed then.
pub struct NcclWork {
    shared: Arc<Shared>,
    op: &'static str,
    completion: Option<Completion>,
    event: Option<Arc<CudaEvent>>,
    output: Option<Output>,
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

    /// Hands back the result once the held buffers are in hand (`held`: the result first).
    fn finish(&mut self, held: Vec<Box<dyn Any + Send>>, host_waited: bool) -> Result<Tensor> {
        let op = self.op;
        let first = || -> Result<Box<dyn DeviceBuffer>> {
            let b = held
                .into_iter()
                .next()
                .ok_or_else(|| internal(op, "held result"))?;
            unhold(op, b)
        };
        match self.output.take() {
            Some(Output::Ready(t)) => Ok(t),
            Some(Output::Device) => {
                let d = first()?;
                if !host_waited {
                    // Stream-ordered: the buffer's stream waits for the marker.
                    let Some(ev) = &self.event else {
                        return Err(internal(op, "device work without marker"));
                    };
                    let s =
                        with_dtype!(d.dtype(), T => downcast::<T>(op, &*d)?.slice.stream().clone());
                    if *s != *self.shared.stream {
                        cuda(op, || s.wait(ev))?;
                    }
                }
                Ok(Tensor::Device(d))
            }
            Some(Output::Staged) => {
                let d = first()?;
                self.shared.bind(op)?;
                let h = with_dtype!(d.dtype(), T => {
                    let b = downcast::<T>(op, &*d)?;
                    owned::<T>(cuda(op, || self.shared.stream.clone_dtoh(&b.slice))?)
                });
                Ok(Tensor::Host(h))
            }
            None => Err(internal(op, "work finished twice")),
        }
    }

    fn wait_inner(&mut self) -> Result<Tensor> {
        let Some(c) = self.completion.take() else {
            return self.finish(Vec::new(), true);
        };
        if matches!(self.output, Some(Output::Device)) {
            if let Some(Err(e)) = c.outcome() {
                return Err(e);
            }
            self.shared.bind(self.op)?;
            return self.finish(c.take_stream_ordered(), false);
        }
        let held = c.wait()?;
        self.finish(held, true)
    }
}

impl Work for NcclWork {
    fn is_completed(&mut self) -> bool {
        self.completion
            .as_ref()
            .is_none_or(|c| c.outcome().is_some())
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        let r = self.wait_inner();
        r.map_err(|e| self.annotate(e))
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        let Some(c) = self.completion.take() else {
            let r = self.finish(Vec::new(), true);
            return Ok(r.map_err(|e| self.annotate(e)));
        };
        match c.wait_for(timeout) {
            Err(c) => {
                self.completion = Some(c);
                Err(self)
            }
            Ok(Err(e)) => Ok(Err(self.annotate(e))),
            Ok(Ok(held)) => {
                let r = self.finish(held, true);
                Ok(r.map_err(|e| self.annotate(e)))
            }
        }
    }
}
