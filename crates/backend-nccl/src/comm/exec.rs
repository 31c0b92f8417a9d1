//! Blocking execution: validated operations enqueued on the communicator's stream, host memory
//! staged through the GPU, and the helpers the nonblocking path shares (staging, stream joins,
//! enqueueing a collective).

use super::shared::{din, dout, lock, Shared};
use super::NcclBackend;
use crate::buffer::{downcast, downcast_mut, with_dtype, NcclDeviceBuffer, NcclElement};
use crate::error::{cuda, internal};
use crate::ffi::{self, Coll, DevIn, DevOut, P2p};
use crate::plan::{self, Call};
use cudarc::driver::CudaStream;
use grid_core::{
    BufMut, BufRef, DType, DeviceBuffer, Element, Error, HostSlice, HostSliceMut, Op, P2pOp,
    ReduceOp, Result, TimeLimit,
};
use std::any::Any;
use std::sync::Arc;

/// A device buffer handed to the watchdog until the device is done with it.
pub(super) fn hold(b: Box<dyn DeviceBuffer>) -> Box<dyn Any + Send> {
    Box::new(b)
}

/// A buffer given back by the watchdog ([`hold`]).
pub(super) fn unhold(op: &'static str, a: Box<dyn Any + Send>) -> Result<Box<dyn DeviceBuffer>> {
    a.downcast::<Box<dyn DeviceBuffer>>()
        .map(|b| *b)
        .map_err(|_| internal(op, "held buffer type"))
}

/// A point-to-point group posted on a communicator or lane, not yet finished.
struct PostedP2p<'a> {
    completion: crate::engine::Completion,
    /// Per staged buffer (in the completion's order), the host receive buffer it is copied
    /// into; empty when the group has no host receive buffer (nothing to wait for).
    outs: Vec<Option<HostSliceMut<'a>>>,
}

/// What a queued collective does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
    /// All-gather in place: NCCL's send buffer is `recv + rank · count`.
    AllGatherInPlace,
    /// Reduce-scatter in place: NCCL's receive buffer is `send + rank · count`.
    ReduceScatterInPlace(ReduceOp),
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::Broadcast(_) => "broadcast",
            Kind::AllGather | Kind::AllGatherInPlace => "all_gather",
            Kind::ReduceScatter(_) | Kind::ReduceScatterInPlace(_) => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
        }
    }

    /// Whether the receive buffer is also an input: broadcast, and all-reduce in place (no
    /// separate send buffer).
    pub(super) fn reads_recv(self, in_place: bool) -> bool {
        match self {
            Kind::Broadcast(_) | Kind::AllGatherInPlace | Kind::ReduceScatterInPlace(_) => true,
            Kind::AllReduce(_) => in_place,
            _ => false,
        }
    }
}

/// What a planned operation does, without its buffers: enough to compute its [`plan`] on
/// any rank.
#[derive(Debug, Clone, Copy)]
pub(super) enum Shape<'c> {
    AllToAllV {
        send_counts: &'c [usize],
        recv_counts: &'c [usize],
    },
    AllGatherV {
        recv_counts: &'c [usize],
    },
    ReduceScatterV {
        send_counts: &'c [usize],
        op: ReduceOp,
    },
    Reduce {
        count: usize,
        root: usize,
        op: ReduceOp,
    },
    Gather {
        count: usize,
        root: usize,
    },
    Scatter {
        count: usize,
        root: usize,
    },
}

impl Shape<'_> {
    /// The NCCL calls of this operation on `rank` of `size` ([`plan`]).
    pub(super) fn calls(&self, rank: usize, size: usize) -> Result<Vec<Call>> {
        match *self {
            Shape::AllToAllV {
                send_counts,
                recv_counts,
            } => plan::all_to_all_v(rank, send_counts, recv_counts),
            Shape::AllGatherV { recv_counts } => plan::all_gather_v(rank, recv_counts),
            Shape::ReduceScatterV { send_counts, .. } => plan::reduce_scatter_v(rank, send_counts),
            Shape::Reduce { count, root, .. } => plan::reduce(rank, size, root, count),
            Shape::Gather { count, root } => plan::gather(rank, size, root, count),
            Shape::Scatter { count, root } => plan::scatter(rank, size, root, count),
        }
    }

    /// The reduction, for the reducing ones.
    pub(super) fn reduce_op(&self) -> Option<ReduceOp> {
        match *self {
            Shape::ReduceScatterV { op, .. } | Shape::Reduce { op, .. } => Some(op),
            _ => None,
        }
    }
}

/// A device buffer must live on the communicator's GPU: only this backend knows its device.
pub(crate) fn same_device(op: &'static str, buf_device: usize, device: usize) -> Result<()> {
    if buf_device == device {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{op}: the buffer is on device {buf_device} but this communicator runs on device {device} (allocate it on device {device}, e.g. with to_device or zeros of this communicator)"
        )))
    }
}

impl NcclBackend {
    /// Executes one validated blocking operation within `limit`. Every operation is enqueued
    /// when it is called (nonblocking sends and receives too), so they run in call order.
    pub(super) fn exec(&self, op: Op<'_>, limit: TimeLimit) -> Result<()> {
        let name = op.name();
        match op {
            Op::AllReduce { send, recv, op } => {
                self.blocking(Kind::AllReduce(op), Some(send), recv, limit)
            }
            Op::AllReduceInPlace { buf, op } => {
                self.blocking(Kind::AllReduce(op), None, buf, limit)
            }
            Op::Broadcast { buf, root } => self.blocking(Kind::Broadcast(root), None, buf, limit),
            Op::AllGather { send, recv } => self.blocking(Kind::AllGather, Some(send), recv, limit),
            Op::ReduceScatter { send, recv, op } => {
                self.blocking(Kind::ReduceScatter(op), Some(send), recv, limit)
            }
            Op::AllToAll { send, recv } => self.blocking(Kind::AllToAll, Some(send), recv, limit),
            Op::AllGatherInPlace { buf } => self.blocking(Kind::AllGatherInPlace, None, buf, limit),
            Op::ReduceScatterInPlace { buf, op } => {
                self.blocking(Kind::ReduceScatterInPlace(op), None, buf, limit)
            }
            Op::Barrier => {
                self.shared.bind(name)?;
                self.barrier_enqueue(name, limit)?;
                self.shared.sync(name, limit)
            }
            Op::Send { buf, peer, tag } => {
                self.p2p(name, vec![P2pOp::Send { buf, peer, tag }], limit)
            }
            Op::Recv { buf, peer, tag } => {
                self.p2p(name, vec![P2pOp::Recv { buf, peer, tag }], limit)
            }
            Op::Batch(ops) => self.p2p(name, ops, limit),
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => self.planned(
                name,
                Shape::AllToAllV {
                    send_counts,
                    recv_counts,
                },
                Some(send),
                Some(recv),
                limit,
            ),
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            } => self.planned(
                name,
                Shape::AllGatherV { recv_counts },
                Some(send),
                Some(recv),
                limit,
            ),
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => self.planned(
                name,
                Shape::ReduceScatterV { send_counts, op },
                Some(send),
                Some(recv),
                limit,
            ),
            Op::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                let count = send.len();
                self.planned(
                    name,
                    Shape::Reduce { count, root, op },
                    Some(send),
                    recv,
                    limit,
                )
            }
            Op::Gather { send, recv, root } => {
                let count = send.len();
                self.planned(name, Shape::Gather { count, root }, Some(send), recv, limit)
            }
            Op::Scatter { send, recv, root } => {
                let count = recv.len();
                self.planned(
                    name,
                    Shape::Scatter { count, root },
                    send,
                    Some(recv),
                    limit,
                )
            }
        }
    }

    fn same_device(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        same_device(op, d.device(), self.device)
    }

    fn stream_of(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<Arc<CudaStream>> {
        with_dtype!(d.dtype(), T => Ok(downcast::<T>(op, d)?.slice.stream().clone()))
    }

    /// The communicator's stream waits for the work queued so far on `d`'s stream.
    pub(super) fn wait_for(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        self.wait_for_on(&self.shared, op, d)
    }

    /// `sh`'s stream (the communicator's or a lane's) waits for the work queued so far on `d`'s
    /// stream.
    pub(super) fn wait_for_on(
        &self,
        sh: &Shared,
        op: &'static str,
        d: &dyn DeviceBuffer,
    ) -> Result<()> {
        self.same_device(op, d)?;
        let s = self.stream_of(op, d)?;
        if *s != *sh.stream {
            sh.join(op, &sh.stream, &s)?;
        }
        Ok(())
    }

    /// `d`'s stream waits for the work queued so far on the communicator's stream.
    fn join_back(&self, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        self.join_back_on(&self.shared, op, d)
    }

    /// `d`'s stream waits for the work queued so far on `sh`'s stream.
    fn join_back_on(&self, sh: &Shared, op: &'static str, d: &dyn DeviceBuffer) -> Result<()> {
        let s = self.stream_of(op, d)?;
        if *s != *sh.stream {
            sh.join(op, &s, &sh.stream)?;
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

    /// A new device buffer holding a copy of `h`.
    pub(super) fn stage_in(
        &self,
        op: &'static str,
        h: HostSlice<'_>,
    ) -> Result<Box<dyn DeviceBuffer>> {
        with_dtype!(h.dtype(), T => {
            let v = <T as Element>::view(h).ok_or_else(|| internal(op, "staging dtype"))?;
            let v = <T as NcclElement>::to_device_repr(v);
            let s = cuda(op, || self.shared.stream.clone_htod(&*v))?;
            Ok(Box::new(NcclDeviceBuffer::<T>::new(s)) as Box<dyn DeviceBuffer>)
        })
    }

    /// A new zero-filled device buffer of `len` elements of `dtype`.
    pub(super) fn stage_zeros(
        &self,
        op: &'static str,
        dtype: DType,
        len: usize,
    ) -> Result<Box<dyn DeviceBuffer>> {
        with_dtype!(dtype, T => {
            let s = cuda(op, || self.shared.stream.alloc_zeros::<<T as NcclElement>::Device>(len))?;
            Ok(Box::new(NcclDeviceBuffer::<T>::new(s)) as Box<dyn DeviceBuffer>)
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
            match <T as NcclElement>::as_device_repr_mut(&mut *dst) {
                Some(direct) => cuda(op, || self.shared.stream.memcpy_dtoh(&b.slice, direct)),
                None => {
                    // Bool and fp8: read the bytes back, then convert (same length, checked
                    // above, so every element is set).
                    let v = cuda(op, || self.shared.stream.clone_dtoh(&b.slice))?;
                    dst.copy_from_slice(&<T as NcclElement>::from_device_repr(v));
                    Ok(())
                }
            }
        })
    }

    /// Enqueues a collective on device buffers (settling an `ncclInProgress` within `limit`).
    /// `send` is `None` for the in-place operations (all-reduce in place passes `recv` as
    /// NCCL's send buffer too).
    pub(super) fn enqueue(
        &self,
        op: &'static str,
        kind: Kind,
        send: Option<&dyn DeviceBuffer>,
        recv: &mut dyn DeviceBuffer,
        limit: TimeLimit,
    ) -> Result<()> {
        if recv.is_empty() {
            return Ok(());
        }
        if let Some(s) = send {
            self.wait_for(op, s)?;
        }
        self.wait_for(op, &*recv)?;
        let st = &*self.shared.stream;
        let missing = || internal(op, "missing send buffer");
        let coll = match kind {
            Kind::AllReduce(r) => {
                let (dt, rop) = self.reduction(op, recv.dtype(), r)?;
                Coll::AllReduce {
                    send: send
                        .map(|s| self.din(op, s).and_then(|t| t.retype(op, dt)))
                        .transpose()?,
                    recv: self.dout(op, recv)?.retype(op, dt)?,
                    op: rop,
                }
            }
            Kind::Broadcast(root) => Coll::Broadcast {
                buf: self.dout(op, recv)?,
                root,
            },
            Kind::AllGather => Coll::AllGather {
                send: self.din(op, send.ok_or_else(missing)?)?,
                recv: self.dout(op, recv)?,
            },
            Kind::ReduceScatter(r) => {
                let (dt, rop) = self.reduction(op, recv.dtype(), r)?;
                Coll::ReduceScatter {
                    send: self.din(op, send.ok_or_else(missing)?)?.retype(op, dt)?,
                    recv: self.dout(op, recv)?.retype(op, dt)?,
                    op: rop,
                }
            }
            Kind::AllGatherInPlace => Coll::AllGatherInPlace {
                buf: self.dout(op, recv)?,
            },
            Kind::ReduceScatterInPlace(r) => {
                let (dt, rop) = self.reduction(op, recv.dtype(), r)?;
                Coll::ReduceScatterInPlace {
                    buf: self.dout(op, recv)?.retype(op, dt)?,
                    op: rop,
                }
            }
            Kind::AllToAll => {
                let ops = self.all_to_all_ops(op, send.ok_or_else(missing)?, recv)?;
                return self
                    .shared
                    .call(op, limit, || self.shared.raw.p2p_group(op, ops, st));
            }
        };
        self.shared
            .call(op, limit, || self.shared.raw.collective(coll, st))
    }

    /// All-to-all as one group of sends and receives (works on every NCCL version). The front
    /// end checked that both buffers have the same length, a multiple of the size.
    fn all_to_all_ops<'a>(
        &'a self,
        op: &'static str,
        send: &'a dyn DeviceBuffer,
        recv: &'a mut dyn DeviceBuffer,
    ) -> Result<Vec<P2p<'a>>> {
        self.same_device(op, send)?;
        self.same_device(op, &*recv)?;
        let n = self.shared.raw.size();
        with_dtype!(send.dtype(), T => {
            let s = downcast::<T>(op, send)?;
            let r = downcast_mut::<T>(op, recv)?;
            let b = s.slice.len() / n.max(1);
            if b == 0 {
                return Err(internal(op, "all_to_all block size 0"));
            }
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

    /// The blocking form of the collectives: stages host memory, enqueues, and for host
    /// output waits and copies back. Device output returns at once (stream-ordered), with the
    /// operation under the watchdog.
    fn blocking(
        &self,
        kind: Kind,
        send: Option<BufRef<'_>>,
        recv: BufMut<'_>,
        limit: TimeLimit,
    ) -> Result<()> {
        let op = kind.name();
        if recv.is_empty() {
            return Ok(());
        }
        self.shared.bind(op)?;
        let in_place = send.is_none();
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
                if let Err(e) = self.enqueue(op, kind, send_dev, &mut *d, limit) {
                    self.shared
                        .hold_after_error(op, staged_in.into_iter().map(hold).collect());
                    return Err(e);
                }
                self.join_back(op, &*d)?;
                if let Some(BufRef::Device(s)) = send {
                    self.join_back(op, s)?;
                }
                // Watched (time limit, asynchronous error) although nobody waits for it; a
                // staged send buffer stays alive until the device is done with it.
                let keep = staged_in.into_iter().map(hold).collect();
                self.shared.watch(op, limit, keep).map(|_| ())
            }
            BufMut::Host(h) => {
                let mut staged = if kind.reads_recv(in_place) {
                    self.stage_in(op, h.as_slice())?
                } else {
                    self.stage_zeros(op, h.dtype(), h.len())?
                };
                if let Err(e) = self.enqueue(op, kind, send_dev, &mut *staged, limit) {
                    let mut keep = vec![hold(staged)];
                    keep.extend(staged_in.map(hold));
                    self.shared.hold_after_error(op, keep);
                    return Err(e);
                }
                if let Some(BufRef::Device(s)) = send {
                    self.join_back(op, s)?;
                }
                // The staged buffers stay with the watchdog until the device is done with
                // them, also when the wait fails; on success the result comes back.
                let mut keep = vec![hold(staged)];
                keep.extend(staged_in.map(hold));
                let (c, _) = self.shared.watch(op, limit, keep)?;
                let mut back = c.wait()?.into_iter();
                let staged = back
                    .next()
                    .ok_or_else(|| internal(op, "staged result"))
                    .and_then(|b| unhold(op, b))?;
                self.fetch_into(op, &*staged, h)
            }
        }
    }

    /// Point-to-point operations (peers validated by the front end), host buffers staged: one
    /// NCCL group on the communicator itself, or, when it has point-to-point lanes, one group
    /// per lane ([`crate::p2p::split_batch`]), every group posted before any is waited for.
    fn p2p(&self, op: &'static str, ops: Vec<P2pOp<'_>>, limit: TimeLimit) -> Result<()> {
        // NCCL sends a framed message as two (the front end lowers them): none comes here.
        if ops.iter().any(P2pOp::is_framed) {
            return Err(P2pOp::not_lowered(crate::error::BACKEND));
        }
        let ops: Vec<P2pOp<'_>> = ops
            .into_iter()
            .filter(|o| match o {
                P2pOp::Send { buf, .. } | P2pOp::SendFramed { buf, .. } => !buf.is_empty(),
                P2pOp::Recv { buf, .. } | P2pOp::RecvFramed { buf, .. } => !buf.is_empty(),
            })
            .collect();
        if ops.is_empty() {
            return Ok(());
        }
        let Some(lanes) = self.shared.lanes.get() else {
            let posted = self.p2p_post(&self.shared, op, ops, limit)?;
            return self.p2p_finish(op, posted);
        };
        let me = self.shared.raw.rank();
        let mut groups: [Vec<P2pOp<'_>>; 2] = [Vec::new(), Vec::new()];
        for o in ops {
            let (send, peer) = match &o {
                P2pOp::Send { peer, .. } | P2pOp::SendFramed { peer, .. } => (true, *peer),
                P2pOp::Recv { peer, .. } | P2pOp::RecvFramed { peer, .. } => (false, *peer),
            };
            groups[crate::p2p::lane(me, peer, send).index()].push(o);
        }
        let mut posted = Vec::with_capacity(2);
        for (lane, group) in lanes.iter().zip(groups) {
            if !group.is_empty() {
                posted.push(self.p2p_post(lane, op, group, limit)?);
            }
        }
        for p in posted {
            self.p2p_finish(op, p)?;
        }
        Ok(())
    }

    /// Posts non-empty point-to-point operations as one NCCL group on `sh` (the communicator
    /// or one of its lanes); host buffers are staged. Returns what [`Self::p2p_finish`] needs.
    fn p2p_post<'a>(
        &self,
        sh: &Shared,
        op: &'static str,
        ops: Vec<P2pOp<'a>>,
        limit: TimeLimit,
    ) -> Result<PostedP2p<'a>> {
        enum Slot<'a> {
            Send(BufRef<'a>, Option<Box<dyn DeviceBuffer>>, usize),
            Recv(BufMut<'a>, Option<Box<dyn DeviceBuffer>>, usize),
        }
        let mut slots: Vec<Slot<'_>> = ops
            .into_iter()
            .map(|o| match o {
                // Framed operations never get here (`p2p` refuses them).
                P2pOp::Send { buf, peer, .. } | P2pOp::SendFramed { buf, peer, .. } => {
                    Slot::Send(buf, None, peer)
                }
                P2pOp::Recv { buf, peer, .. } | P2pOp::RecvFramed { buf, peer, .. } => {
                    Slot::Recv(buf, None, peer)
                }
            })
            .collect();
        sh.bind(op)?;
        let mut host_out = false;
        for s in slots.iter_mut() {
            match s {
                Slot::Send(BufRef::Host(h), st, _) => {
                    let b = self.stage_in(op, *h)?;
                    self.wait_for_on(sh, op, &*b)?;
                    *st = Some(b);
                }
                Slot::Send(BufRef::Device(d), _, _) => self.wait_for_on(sh, op, *d)?,
                Slot::Recv(BufMut::Host(h), st, _) => {
                    host_out = true;
                    let b = self.stage_zeros(op, h.dtype(), h.len())?;
                    self.wait_for_on(sh, op, &*b)?;
                    *st = Some(b);
                }
                Slot::Recv(BufMut::Device(d), _, _) => self.wait_for_on(sh, op, &**d)?,
            }
        }
        let posted = {
            let st = &*sh.stream;
            let mut tokens = Vec::with_capacity(slots.len());
            for s in slots.iter_mut() {
                tokens.push(match s {
                    Slot::Send(_, Some(b), p) => P2p::Send(din(op, &**b, st)?, *p),
                    Slot::Send(BufRef::Device(d), None, p) => {
                        self.same_device(op, *d)?;
                        P2p::Send(din(op, *d, st)?, *p)
                    }
                    Slot::Recv(_, Some(b), p) => P2p::Recv(dout(op, &mut **b, st)?, *p),
                    Slot::Recv(BufMut::Device(d), None, p) => {
                        self.same_device(op, &**d)?;
                        P2p::Recv(dout(op, &mut **d, st)?, *p)
                    }
                    _ => return Err(internal(op, "unstaged host buffer")),
                });
            }
            sh.call(op, limit, || sh.raw.p2p_group(op, tokens, st))
        };
        if let Err(e) = posted {
            // NCCL may have enqueued part of the group: staged buffers stay with the watchdog.
            let keep = slots
                .into_iter()
                .filter_map(|s| match s {
                    Slot::Send(_, b, _) | Slot::Recv(_, b, _) => b,
                })
                .map(hold)
                .collect();
            sh.hold_after_error(op, keep);
            return Err(e);
        }
        for s in slots.iter() {
            match s {
                Slot::Send(BufRef::Device(d), _, _) => self.join_back_on(sh, op, *d)?,
                Slot::Recv(BufMut::Device(d), _, _) => self.join_back_on(sh, op, &**d)?,
                _ => {}
            }
        }
        // Staged buffers go to the watchdog until the device is done with them; received ones
        // come back (in order) after a successful wait.
        let mut keep = Vec::new();
        let mut outs = Vec::new();
        for s in slots {
            match s {
                Slot::Recv(BufMut::Host(h), Some(b), _) => {
                    keep.push(hold(b));
                    outs.push(Some(h));
                }
                Slot::Send(_, Some(b), _) => {
                    keep.push(hold(b));
                    outs.push(None);
                }
                _ => {}
            }
        }
        let (completion, _) = sh.watch(op, limit, keep)?;
        Ok(PostedP2p {
            completion,
            outs: if host_out { outs } else { Vec::new() },
        })
    }

    /// Waits for a posted group with host receive buffers and copies them out; returns at once
    /// when the group has none (stream-ordered).
    fn p2p_finish(&self, op: &'static str, p: PostedP2p<'_>) -> Result<()> {
        if p.outs.is_empty() {
            return Ok(());
        }
        for (b, h) in p.completion.wait()?.into_iter().zip(p.outs) {
            if let Some(h) = h {
                self.fetch_into(op, &*unhold(op, b)?, h)?;
            }
        }
        Ok(())
    }

    /// The NCCL data type and operation reducing `dtype` with `r` on this communicator
    /// ([`ffi::reduction`] with this GPU's and library's fp8 support).
    pub(super) fn reduction(
        &self,
        op: &'static str,
        dtype: DType,
        r: ReduceOp,
    ) -> Result<(
        cudarc::nccl::sys::ncclDataType_t,
        cudarc::nccl::sys::ncclRedOp_t,
    )> {
        ffi::reduction(dtype, r, self.caps.fp8_reductions()).ok_or_else(|| Error::Unsupported {
            op,
            backend: crate::error::BACKEND,
            what: format!("{r} of {dtype} ({})", self.caps.describe_reductions(dtype)),
        })
    }

    /// Enqueues the calls of a [`plan`] on device buffers (either may be absent or empty:
    /// the rank has none in this operation), settling an `ncclInProgress` within `limit`.
    pub(super) fn enqueue_plan(
        &self,
        op: &'static str,
        calls: &[Call],
        red: Option<ReduceOp>,
        send: Option<&dyn DeviceBuffer>,
        recv: Option<&mut dyn DeviceBuffer>,
        limit: TimeLimit,
    ) -> Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        let send = send.filter(|s| !s.is_empty());
        let mut recv = recv.filter(|r| !r.is_empty());
        if let Some(s) = send {
            self.wait_for(op, s)?;
        }
        if let Some(r) = recv.as_deref() {
            self.wait_for(op, r)?;
        }
        let dtype = match (send, recv.as_deref()) {
            (Some(s), _) => s.dtype(),
            (None, Some(r)) => r.dtype(),
            (None, None) => return Err(internal(op, "a plan without buffers")),
        };
        let reduction = red.map(|r| self.reduction(op, dtype, r)).transpose()?;
        let st = &*self.shared.stream;
        let sin = send.map(|s| self.din(op, s)).transpose()?;
        let rout = match recv.take() {
            Some(r) => Some(self.dout(op, r)?),
            None => None,
        };
        self.shared.call(op, limit, || {
            self.shared
                .raw
                .run_plan(op, calls, sin.as_ref(), rout.as_ref(), reduction, st)
        })
    }

    /// The blocking form of the planned operations (all-to-all-v, all-gather-v,
    /// reduce-scatter-v, reduce, gather, scatter): stages host memory, enqueues the plan, and
    /// for host output waits and copies back; device output returns at once (stream-ordered),
    /// with the operation under the watchdog. `send` / `recv` are `None` where the rank has no
    /// such buffer (off the root).
    fn planned(
        &self,
        op: &'static str,
        shape: Shape<'_>,
        send: Option<BufRef<'_>>,
        recv: Option<BufMut<'_>>,
        limit: TimeLimit,
    ) -> Result<()> {
        let raw = &self.shared.raw;
        let calls = shape.calls(raw.rank(), raw.size())?;
        if calls.is_empty() {
            return Ok(());
        }
        self.shared.bind(op)?;
        let red = shape.reduce_op();
        let staged_in = match send {
            Some(BufRef::Host(h)) if !h.is_empty() => Some(self.stage_in(op, h)?),
            _ => None,
        };
        let send_dev: Option<&dyn DeviceBuffer> = match (send, &staged_in) {
            (Some(BufRef::Device(d)), _) => Some(d),
            (_, Some(b)) => Some(&**b),
            _ => None,
        };
        let join_send = |me: &Self| match send {
            Some(BufRef::Device(s)) => me.join_back(op, s),
            _ => Ok(()),
        };
        match recv {
            Some(BufMut::Host(h)) if !h.is_empty() => {
                // Every element of the receive buffer is written by the plan: no upload.
                let mut staged = self.stage_zeros(op, h.dtype(), h.len())?;
                if let Err(e) =
                    self.enqueue_plan(op, &calls, red, send_dev, Some(&mut *staged), limit)
                {
                    let mut keep = vec![hold(staged)];
                    keep.extend(staged_in.map(hold));
                    self.shared.hold_after_error(op, keep);
                    return Err(e);
                }
                join_send(self)?;
                let mut keep = vec![hold(staged)];
                keep.extend(staged_in.map(hold));
                let (c, _) = self.shared.watch(op, limit, keep)?;
                let mut back = c.wait()?.into_iter();
                let staged = back
                    .next()
                    .ok_or_else(|| internal(op, "staged result"))
                    .and_then(|b| unhold(op, b))?;
                self.fetch_into(op, &*staged, h)
            }
            recv => {
                let mut recv_dev = match recv {
                    Some(BufMut::Device(d)) => Some(d),
                    _ => None,
                };
                let r =
                    self.enqueue_plan(op, &calls, red, send_dev, recv_dev.as_deref_mut(), limit);
                if let Err(e) = r {
                    self.shared
                        .hold_after_error(op, staged_in.into_iter().map(hold).collect());
                    return Err(e);
                }
                if let Some(d) = recv_dev.as_deref() {
                    self.join_back(op, d)?;
                }
                join_send(self)?;
                // Watched (time limit, asynchronous error) although nobody waits for it; a
                // staged send buffer stays alive until the device is done with it.
                let keep = staged_in.into_iter().map(hold).collect();
                self.shared.watch(op, limit, keep).map(|_| ())
            }
        }
    }

    /// Enqueues the barrier: an all-reduce of one float.
    pub(super) fn barrier_enqueue(&self, op: &'static str, limit: TimeLimit) -> Result<()> {
        let mut g = lock(&self.shared.scratch);
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
            .call(op, limit, || self.shared.raw.collective(coll, st))
    }
}
