//! Nonblocking execution: validated requests enqueued on the communicator's stream **when they
//! are started** (sends and receives too), each watched by the process's watchdog, and
//! [`NcclWork`], which completes through the operation's completion marker.

use super::exec::{hold, unhold, Kind, Shape};
use super::shared::PooledEvent;
use super::shared::{din, dout, Cell, Shared};
use super::NcclBackend;
use crate::buffer::{downcast, owned, with_dtype};
use crate::engine::Completion;
use crate::error::{annotate, cuda, internal};
use crate::ffi::P2p;
use grid_core::{DType, DeviceBuffer, Error, HostBuffer, Request, Result, Tensor, TimeLimit, Work};
use std::any::Any;
use std::sync::{Arc, Mutex};
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
    /// Starts one validated nonblocking operation: a collective or barrier is enqueued now and
    /// watched by the watchdog; a send or receive is enqueued now on its point-to-point lane, or
    /// held back where the communicator has no lanes ([`NcclBackend::post_p2p`]).
    pub(super) fn start_request(
        &self,
        request: Request,
        limit: TimeLimit,
    ) -> Result<Box<dyn Work>> {
        let op = request.name();
        match request {
            Request::Send { buf, peer, .. } => {
                self.shared.bind(op)?;
                return match self.operand(op, buf, true)? {
                    (Some(d), host) => {
                        let out = match host {
                            Some(h) => Output::Ready(Tensor::Host(h)),
                            None => Output::Device,
                        };
                        self.post_p2p(op, true, peer, d, out, limit)
                    }
                    (None, Some(h)) => Ok(ready(self, op, Tensor::Host(h))),
                    (None, None) => Err(internal(op, "send operand")),
                };
            }
            Request::Recv { buf, peer, .. } => {
                self.shared.bind(op)?;
                return match self.operand(op, buf, false)? {
                    (Some(d), host) => {
                        let out = if host.is_some() {
                            Output::Staged
                        } else {
                            Output::Device
                        };
                        self.post_p2p(op, false, peer, d, out, limit)
                    }
                    (None, Some(h)) => Ok(ready(self, op, Tensor::Host(h))),
                    (None, None) => Err(internal(op, "recv operand")),
                };
            }
            _ => {}
        }
        // Held-back sends and receives were started first: posted first.
        self.shared.outbox.post_all();
        self.shared.bind(op)?;
        // The buffers the device uses, the result first.
        let mut keep: Vec<Box<dyn DeviceBuffer>> = Vec::new();
        let output = match self.enqueue_request(op, request, &mut keep, limit) {
            Ok(o) => o,
            Err(e) => {
                // NCCL may have enqueued it before failing: the buffers stay with the
                // watchdog until the device is done with them.
                self.shared
                    .hold_after_error(op, keep.into_iter().map(hold).collect());
                return Err(e);
            }
        };
        let output = match output {
            // Nothing was enqueued (empty buffers).
            Output::Ready(t) if keep.is_empty() && op != "barrier" => {
                return Ok(ready(self, op, t));
            }
            other => other,
        };
        let (c, event) = self
            .shared
            .watch(op, limit, keep.into_iter().map(hold).collect())?;
        Ok(work(self, op, Some(c), Some(event), output))
    }

    /// Enqueues a collective or the barrier; `keep` receives the device buffers NCCL uses (the
    /// result first), also when enqueueing fails.
    fn enqueue_request(
        &self,
        op: &'static str,
        request: Request,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
        limit: TimeLimit,
    ) -> Result<Output> {
        Ok(match request {
            Request::AllReduce { buf, op: r } => {
                self.start_in_place(op, Kind::AllReduce(r), buf, keep, limit)?
            }
            Request::Broadcast { buf, root } => {
                self.start_in_place(op, Kind::Broadcast(root), buf, keep, limit)?
            }
            Request::AllReduceInto { send, recv, op: r } => {
                self.start_two(op, Kind::AllReduce(r), send, recv, keep, limit)?
            }
            Request::AllGather { send, recv } => {
                self.start_two(op, Kind::AllGather, send, recv, keep, limit)?
            }
            Request::ReduceScatter { send, recv, op: r } => {
                self.start_two(op, Kind::ReduceScatter(r), send, recv, keep, limit)?
            }
            Request::AllToAll { send, recv } => {
                self.start_two(op, Kind::AllToAll, send, recv, keep, limit)?
            }
            Request::AllGatherInPlace { buf } => {
                self.start_in_place(op, Kind::AllGatherInPlace, buf, keep, limit)?
            }
            Request::ReduceScatterInPlace { buf, op: r } => {
                self.start_in_place(op, Kind::ReduceScatterInPlace(r), buf, keep, limit)?
            }
            Request::Barrier => {
                self.barrier_enqueue(op, limit)?;
                Output::Ready(empty())
            }
            Request::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                let shape = Shape::AllToAllV {
                    send_counts: &send_counts,
                    recv_counts: &recv_counts,
                };
                self.start_planned(op, shape, Some(send), Some(recv), keep, limit)?
            }
            Request::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                let shape = Shape::AllGatherV {
                    recv_counts: &recv_counts,
                };
                self.start_planned(op, shape, Some(send), Some(recv), keep, limit)?
            }
            Request::ReduceScatterV {
                send,
                send_counts,
                recv,
                op: r,
            } => {
                let shape = Shape::ReduceScatterV {
                    send_counts: &send_counts,
                    op: r,
                };
                self.start_planned(op, shape, Some(send), Some(recv), keep, limit)?
            }
            Request::Reduce {
                send,
                recv,
                op: r,
                root,
            } => {
                let shape = Shape::Reduce {
                    count: send.len(),
                    root,
                    op: r,
                };
                self.start_planned(op, shape, Some(send), recv, keep, limit)?
            }
            Request::Gather { send, recv, root } => {
                let shape = Shape::Gather {
                    count: send.len(),
                    root,
                };
                self.start_planned(op, shape, Some(send), recv, keep, limit)?
            }
            Request::Scatter { send, recv, root } => {
                let shape = Shape::Scatter {
                    count: recv.len(),
                    root,
                };
                self.start_planned(op, shape, send, Some(recv), keep, limit)?
            }
            Request::Send { .. } | Request::Recv { .. } => {
                return Err(internal(op, "point-to-point request in enqueue_request"))
            }
        })
    }

    /// Posts a nonblocking send or receive: at once, alone, on its point-to-point lane
    /// ([`crate::p2p`]), watched by the watchdog; or, on a communicator without lanes
    /// ([`crate::p2p::P2pPosting::HoldBack`]), held back ([`NcclBackend::hold_back`]).
    fn post_p2p(
        &self,
        op: &'static str,
        send: bool,
        peer: usize,
        mut d: Box<dyn DeviceBuffer>,
        output: Output,
        limit: TimeLimit,
    ) -> Result<Box<dyn Work>> {
        let Some(lane) = self.shared.lane_for(peer, send) else {
            return self.hold_back(op, send, peer, d, output, limit);
        };
        lane.bind(op)?;
        // The lane's stream waits for the buffer's producer (a staged copy, or the user's work
        // on a device buffer).
        self.wait_for_on(lane, op, &*d)?;
        let st = &*lane.stream;
        let posted = (|| {
            let token = if send {
                P2p::Send(din(op, &*d, st)?, peer)
            } else {
                P2p::Recv(dout(op, &mut *d, st)?, peer)
            };
            lane.call(op, limit, || lane.raw.p2p_group(op, vec![token], st))
        })();
        if let Err(e) = posted {
            // NCCL may have enqueued it before failing: the buffer stays with the watchdog.
            lane.hold_after_error(op, vec![hold(d)]);
            return Err(e);
        }
        let (c, event) = lane.watch(op, limit, vec![hold(d)])?;
        Ok(Box::new(NcclWork {
            shared: lane.clone(),
            op,
            completion: Some(c),
            event: Some(event),
            deferred: None,
            failed: None,
            output: Some(output),
        }))
    }

    /// Holds a nonblocking send or receive back, to be posted (grouped with the others held
    /// back) before this process does anything else on the device: any other operation on any
    /// communicator of the GPU, any wait or poll ([`crate::engine::Outbox`]).
    fn hold_back(
        &self,
        op: &'static str,
        send: bool,
        peer: usize,
        d: Box<dyn DeviceBuffer>,
        output: Output,
        limit: TimeLimit,
    ) -> Result<Box<dyn Work>> {
        if matches!(output, Output::Device) {
            self.wait_for(op, &*d)?;
        }
        let cell = self.shared.defer(send, peer, d, limit);
        Ok(Box::new(NcclWork {
            shared: self.shared.clone(),
            op,
            completion: None,
            event: None,
            deferred: Some(cell),
            failed: None,
            output: Some(output),
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
                let r = self.enqueue(op, kind, None, &mut *d, limit);
                keep.push(d);
                r?;
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
                let res = self.enqueue(op, kind, Some(&*s), &mut *r, limit);
                keep.push(r);
                keep.push(s);
                res?;
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

impl NcclBackend {
    /// A planned operation (all-to-all-v, all-gather-v, reduce-scatter-v, reduce, gather,
    /// scatter) on owned tensors. The work's result is the receive tensor where the rank has
    /// one, else its send tensor back (reduce and gather off the root). `keep` receives the
    /// device buffers NCCL uses, the result first.
    fn start_planned(
        &self,
        op: &'static str,
        shape: Shape<'_>,
        send: Option<Tensor>,
        recv: Option<Tensor>,
        keep: &mut Vec<Box<dyn DeviceBuffer>>,
        limit: TimeLimit,
    ) -> Result<Output> {
        let raw = &self.shared.raw;
        let calls = shape.calls(raw.rank(), raw.size())?;
        if calls.is_empty() {
            // Nothing moves on this rank: the result as it is.
            return Ok(Output::Ready(recv.or(send).unwrap_or_else(empty)));
        }
        let (sdev, shost) = match send {
            Some(t) => self.operand(op, t, true)?,
            None => (None, None),
        };
        match recv {
            Some(r) => {
                let recv_host = matches!(r, Tensor::Host(_));
                let (rdev, rhost) = self.operand(op, r, false)?;
                let Some(mut rdev) = rdev else {
                    // An empty host receive buffer: nothing to receive here; the send (if any)
                    // still has to go out.
                    let res = self.enqueue_plan(
                        op,
                        &calls,
                        shape.reduce_op(),
                        sdev.as_deref(),
                        None,
                        limit,
                    );
                    keep.extend(sdev);
                    res?;
                    return Ok(Output::Ready(rhost.map(Tensor::Host).unwrap_or_else(empty)));
                };
                let res = self.enqueue_plan(
                    op,
                    &calls,
                    shape.reduce_op(),
                    sdev.as_deref(),
                    Some(&mut *rdev),
                    limit,
                );
                keep.push(rdev);
                keep.extend(sdev);
                res?;
                Ok(if recv_host {
                    Output::Staged
                } else {
                    Output::Device
                })
            }
            None => {
                // Off the root of a reduce or gather: the send tensor comes back.
                let res =
                    self.enqueue_plan(op, &calls, shape.reduce_op(), sdev.as_deref(), None, limit);
                let out = match shost {
                    Some(h) => Output::Ready(Tensor::Host(h)),
                    None => Output::Device,
                };
                keep.extend(sdev);
                res?;
                if matches!(out, Output::Device) && keep.is_empty() {
                    return Err(internal(op, "device send tensor missing"));
                }
                Ok(out)
            }
        }
    }
}

fn work(
    b: &NcclBackend,
    op: &'static str,
    completion: Option<Completion>,
    event: Option<Arc<PooledEvent>>,
    output: Output,
) -> Box<dyn Work> {
    Box::new(NcclWork {
        shared: b.shared.clone(),
        op,
        completion,
        event,
        deferred: None,
        failed: None,
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
    event: Option<Arc<PooledEvent>>,
    /// A held-back send or receive: its completion appears here once posted.
    deferred: Option<Arc<Mutex<Cell>>>,
    /// Posting it failed (kept for the wait after an `is_completed`).
    failed: Option<Error>,
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
                    let v = cuda(op, || self.shared.stream.clone_dtoh(&b.slice))?;
                    owned::<T>(<T as crate::buffer::NcclElement>::from_device_repr(v))
                });
                Ok(Tensor::Host(h))
            }
            None => Err(internal(op, "work finished twice")),
        }
    }

    /// For a held-back send or receive: posts everything held back on the device and takes
    /// the completion.
    fn resolve(&mut self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let Some(cell) = self.deferred.take() else {
            return Ok(());
        };
        self.shared.outbox.post_all();
        let taken = std::mem::replace(&mut *super::shared::lock(&cell), Cell::Taken);
        match taken {
            Cell::Posted(c, ev) => {
                self.completion = Some(c);
                self.event = Some(ev);
                Ok(())
            }
            Cell::Failed(e) => {
                self.failed = Some(e.clone());
                Err(e)
            }
            Cell::Waiting | Cell::Taken => {
                let e = internal(self.op, "held-back operation not posted");
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    fn wait_inner(&mut self) -> Result<Tensor> {
        self.resolve()?;
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
        if self.resolve().is_err() {
            return true;
        }
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
        if let Err(e) = self.resolve() {
            return Ok(Err(self.annotate(e)));
        }
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
