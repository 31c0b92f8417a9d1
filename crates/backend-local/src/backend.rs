//! [`LocalBackend`] (the execution trait over shared memory), [`LocalWork`] and
//! [`LocalFactory`].

use crate::state::{mismatch, Group, Kind, Part, Ticket, Until, BACKEND};
use grid_core::{
    kernels, split_members, Backend, BufMut, BufRef, Comm, DType, Error, GroupFactory, HostBuffer,
    HostSlice, HostSliceMut, Memory, Op, P2pOp, ReduceOp, Request, Result, SplitEntry, Tensor,
    TimeLimit, Validated, Work,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A communicator of the local backend: the front end over [`LocalBackend`].
pub type LocalComm = Comm<LocalBackend>;

/// One rank's handle on a communicator whose ranks are threads of this process. Created by
/// [`crate::LocalWorld`] (the world) and [`LocalFactory`] (splits); used through
/// [`LocalComm`].
#[derive(Debug)]
pub struct LocalBackend {
    group: Arc<Group>,
    rank: usize,
    /// Collective calls so far (the round number of the next one).
    coll: AtomicU64,
    finished: AtomicBool,
    /// Set by `abort()` (through the front end); every wait of this rank checks it.
    aborted: Arc<AtomicBool>,
}

impl LocalBackend {
    pub(crate) fn new(group: Arc<Group>, rank: usize) -> LocalBackend {
        LocalBackend {
            group,
            rank,
            coll: AtomicU64::new(0),
            finished: AtomicBool::new(false),
            aborted: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Marks this rank's communicator finished: every later call on it returns
    /// [`Error::Finalized`]. Local, not collective; operations already started complete.
    ///
    /// ```
    /// use grid_core::Communicator;
    /// let c = backend_local::LocalWorld::new(1)?.communicators().remove(0);
    /// c.finish();
    /// assert!(c.barrier().is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// True after [`LocalBackend::finish`].
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    fn next(&self) -> u64 {
        self.coll.fetch_add(1, Ordering::Relaxed)
    }

    fn until(&self, limit: TimeLimit) -> Until<'_> {
        Until::limit(limit, &self.aborted)
    }

    /// Deposits this rank's part of the next collective round and returns its number.
    fn begin(&self, kind: Kind, data: Option<HostBuffer>) -> Result<u64> {
        self.begin_counted(kind, data, None)
    }

    /// [`LocalBackend::begin`] with an all-to-all-v's counts.
    fn begin_counted(
        &self,
        kind: Kind,
        data: Option<HostBuffer>,
        counts: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<u64> {
        let seq = self.next();
        self.group.deposit(
            seq,
            self.rank,
            Part {
                kind,
                data,
                split: None,
                counts,
            },
        )?;
        Ok(seq)
    }

    /// Blocks until round `seq` is complete and writes this rank's result into `out`.
    fn end(
        &self,
        seq: u64,
        kind: &Kind,
        out: Option<HostSliceMut<'_>>,
        limit: TimeLimit,
    ) -> Result<()> {
        let parts = self
            .group
            .collect(seq, kind.name(), &self.until(limit), true)?
            .ok_or_else(|| Error::Invalid("local: a strict wait returned nothing".into()))?;
        complete(&self.group, self.rank, kind, &parts, out)
    }

    fn collective(
        &self,
        kind: Kind,
        data: Option<HostBuffer>,
        out: Option<HostSliceMut<'_>>,
        limit: TimeLimit,
    ) -> Result<()> {
        let seq = self.begin(kind.clone(), data)?;
        self.end(seq, &kind, out, limit)
    }

    fn recv_into(
        &self,
        t: &Ticket,
        op: &'static str,
        mut out: HostSliceMut<'_>,
        until: &Until<'_>,
    ) -> Result<()> {
        let msg = self
            .group
            .take(t, op, until, true)?
            .ok_or_else(|| Error::Invalid("local: a strict wait returned nothing".into()))?;
        deliver(op, &msg, &mut out)
    }
}

fn host<'a>(op: &'static str, b: BufRef<'a>) -> Result<HostSlice<'a>> {
    b.host_only(op, BACKEND)
}

fn host_mut<'a>(op: &'static str, b: BufMut<'a>) -> Result<HostSliceMut<'a>> {
    b.host_only(op, BACKEND)
}

/// Copies a received message into the receive buffer, which must match it exactly.
fn deliver(op: &'static str, msg: &HostBuffer, out: &mut HostSliceMut<'_>) -> Result<()> {
    if msg.dtype() != out.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: msg.dtype(),
            actual: out.dtype(),
        });
    }
    if msg.len() != out.len() {
        return Err(Error::LengthMismatch {
            op,
            what: "receive buffer (the message that arrived)",
            expected: msg.len(),
            actual: out.len(),
        });
    }
    out.copy_from(msg.as_slice())
}

fn data<'a>(p: &'a Part, op: &'static str) -> Result<HostSlice<'a>> {
    p.data
        .as_ref()
        .map(HostBuffer::as_slice)
        .ok_or_else(|| Error::Invalid(format!("local: {op}: a rank contributed no data")))
}

/// Every rank's contribution to a round, in rank order.
fn inputs<'a>(parts: &'a [Arc<Part>], op: &'static str) -> Result<Vec<HostSlice<'a>>> {
    parts.iter().map(|p| data(p, op)).collect()
}

/// Elements `at..at + k` of a rank's contribution.
fn take<'a>(src: HostSlice<'a>, at: usize, k: usize, op: &'static str) -> Result<HostSlice<'a>> {
    src.sub(at, k)
        .ok_or_else(|| Error::Invalid(format!("local: {op}: input too short")))
}

/// Copies `src` into elements `at..at + k` of `out` (a length other than `k` is an error).
fn place(
    out: &mut HostSliceMut<'_>,
    at: usize,
    k: usize,
    src: HostSlice<'_>,
    op: &'static str,
) -> Result<()> {
    out.sub_mut(at, k)
        .ok_or_else(|| Error::Invalid(format!("local: {op}: output too short")))?
        .copy_from(src)
}

/// This rank's result of a complete round.
fn complete(
    group: &Group,
    rank: usize,
    kind: &Kind,
    parts: &[Arc<Part>],
    out: Option<HostSliceMut<'_>>,
) -> Result<()> {
    let op = kind.name();
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| &p.kind != kind) {
        return Err(mismatch(
            op,
            "",
            format!(
                "ranks {:?} disagree about collective call: this rank (world {}) called {kind:?}, world rank {} called {:?}",
                group.global, group.global[rank], group.global[r], p.kind
            ),
        ));
    }
    let n = parts.len();
    let missing_out = || Error::Invalid(format!("local: {op}: no output buffer"));
    match kind {
        Kind::Barrier | Kind::Split => Ok(()),
        // The rooted operations: only the root receives.
        Kind::Reduce(_, root, ..) | Kind::Gather(root, ..) if *root != rank => Ok(()),
        Kind::AllReduce(r, ..) | Kind::Reduce(r, ..) => {
            kernels::reduce(&inputs(parts, op)?, out.ok_or_else(missing_out)?, *r)
        }
        Kind::ReduceScatter(r, _, len) => {
            let k = len / n.max(1);
            kernels::reduce_range(
                &inputs(parts, op)?,
                rank * k,
                out.ok_or_else(missing_out)?,
                *r,
            )
        }
        Kind::Broadcast(root, ..) => {
            if *root == rank {
                return Ok(());
            }
            let src = parts
                .get(*root)
                .ok_or_else(|| Error::Invalid(format!("local: {op}: root {root} missing")))?;
            out.ok_or_else(missing_out)?.copy_from(data(src, op)?)
        }
        Kind::AllGather(_, k) | Kind::Gather(_, _, k) => {
            let mut out = out.ok_or_else(missing_out)?;
            for (r, p) in parts.iter().enumerate() {
                place(&mut out, r * k, *k, data(p, op)?, op)?;
            }
            Ok(())
        }
        Kind::AllToAllV(_) => {
            let counts = parts
                .iter()
                .map(|p| {
                    p.counts.as_ref().ok_or_else(|| {
                        Error::Invalid(format!("local: {op}: a rank deposited no counts"))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // Every rank sees every rank's counts, so every rank finds the same first
            // disagreement and returns the same error.
            for (i, (send, _)) in counts.iter().enumerate() {
                for (j, (_, recv)) in counts.iter().enumerate() {
                    if send[j] != recv[i] {
                        return Err(mismatch(
                            op,
                            "",
                            format!(
                                "world rank {} sends {} elements to world rank {}, which expects {}",
                                group.global[i], send[j], group.global[j], recv[i]
                            ),
                        ));
                    }
                }
            }
            let mut out = out.ok_or_else(missing_out)?;
            let mut at = 0;
            for (r, p) in parts.iter().enumerate() {
                let sent = &counts[r].0;
                let (from, k) = (sent[..rank].iter().sum::<usize>(), sent[rank]);
                place(&mut out, at, k, take(data(p, op)?, from, k, op)?, op)?;
                at += k;
            }
            Ok(())
        }
        Kind::AllGatherV(_, counts) => {
            let mut out = out.ok_or_else(missing_out)?;
            let mut at = 0;
            for (p, &k) in parts.iter().zip(counts) {
                place(&mut out, at, k, data(p, op)?, op)?;
                at += k;
            }
            Ok(())
        }
        Kind::ReduceScatterV(r, _, counts) => {
            let from = counts[..rank].iter().sum();
            kernels::reduce_range(&inputs(parts, op)?, from, out.ok_or_else(missing_out)?, *r)
        }
        Kind::Scatter(root, _, k) => {
            let src = parts
                .get(*root)
                .ok_or_else(|| Error::Invalid(format!("local: {op}: root {root} missing")))?;
            out.ok_or_else(missing_out)?
                .copy_from(take(data(src, op)?, rank * k, *k, op)?)
        }
        Kind::AllToAll(_, len) => {
            let k = len / n.max(1);
            let mut out = out.ok_or_else(missing_out)?;
            for (r, p) in parts.iter().enumerate() {
                place(&mut out, r * k, k, take(data(p, op)?, rank * k, k, op)?, op)?;
            }
            Ok(())
        }
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.group.size()
    }
    fn global_ranks(&self) -> &[usize] {
        &self.group.global
    }
    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        // Every dtype moves; reductions run on the host through grid-core's kernels.
        grid_core::kernels::runs(dtype, op)
    }
    fn check_live(&self, op: &'static str) -> Result<()> {
        if self.is_finished() {
            Err(Error::Finalized {
                op,
                state: "finished",
            })
        } else {
            Ok(())
        }
    }

    fn default_time_limit(&self) -> TimeLimit {
        TimeLimit::After(self.group.timeout())
    }

    /// Sets this rank's abort flag and wakes every wait of the group; the woken waits of this
    /// rank return [`Error::Aborted`] (their deposits stay on the board: the other ranks see
    /// this rank's part of a collective it had entered, and time out on the ones it never
    /// enters).
    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.group.wake_all();
    }

    fn run(&self, op: Validated<Op<'_>>) -> Result<()> {
        let limit = op.time_limit();
        match op.into_op() {
            Op::AllReduce { send, recv, op } => {
                let (s, r) = (host("all_reduce", send)?, host_mut("all_reduce", recv)?);
                let kind = Kind::AllReduce(op, s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::AllReduceInPlace { buf, op } => {
                // The shared-memory transport needs this rank's contribution where the other
                // threads can read it: that deposit is the message, and the result is reduced
                // straight into `buf`.
                let b = host_mut("all_reduce", buf)?;
                let kind = Kind::AllReduce(op, b.dtype(), b.len());
                self.collective(kind, Some(b.as_slice().to_owned_buffer()), Some(b), limit)
            }
            Op::Broadcast { buf, root } => {
                let b = host_mut("broadcast", buf)?;
                let kind = Kind::Broadcast(root, b.dtype(), b.len());
                let d = (root == self.rank).then(|| b.as_slice().to_owned_buffer());
                self.collective(kind, d, Some(b), limit)
            }
            Op::AllGather { send, recv } => {
                let (s, r) = (host("all_gather", send)?, host_mut("all_gather", recv)?);
                let kind = Kind::AllGather(s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::AllGatherInPlace { buf } => {
                // The round of the out-of-place all-gather (so the two forms meet), with this
                // rank's block as its deposit; every block, its own included, is placed
                // straight into `buf`.
                const OP: &str = "all_gather";
                let b = host_mut(OP, buf)?;
                let k = b.len() / self.group.size().max(1);
                let mine = take(b.as_slice(), self.rank * k, k, OP)?.to_owned_buffer();
                let kind = Kind::AllGather(b.dtype(), k);
                self.collective(kind, Some(mine), Some(b), limit)
            }
            Op::ReduceScatter { send, recv, op } => {
                let (s, r) = (
                    host("reduce_scatter", send)?,
                    host_mut("reduce_scatter", recv)?,
                );
                let kind = Kind::ReduceScatter(op, s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::ReduceScatterInPlace { buf, op } => {
                // The deposit is the whole input (the other threads read their blocks of it);
                // this rank's block is reduced straight into `buf` at rank · count, and the
                // rest of `buf` keeps the input.
                const OP: &str = "reduce_scatter";
                let mut b = host_mut(OP, buf)?;
                let k = b.len() / self.group.size().max(1);
                let kind = Kind::ReduceScatter(op, b.dtype(), b.len());
                let input = b.as_slice().to_owned_buffer();
                let out = b
                    .sub_mut(self.rank * k, k)
                    .ok_or_else(|| Error::Invalid(format!("local: {OP}: output too short")))?;
                self.collective(kind, Some(input), Some(out), limit)
            }
            Op::AllToAll { send, recv } => {
                let (s, r) = (host("all_to_all", send)?, host_mut("all_to_all", recv)?);
                let kind = Kind::AllToAll(s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                let (s, r) = (host("all_to_all_v", send)?, host_mut("all_to_all_v", recv)?);
                let kind = Kind::AllToAllV(s.dtype());
                let counts = (send_counts.to_vec(), recv_counts.to_vec());
                let seq =
                    self.begin_counted(kind.clone(), Some(s.to_owned_buffer()), Some(counts))?;
                self.end(seq, &kind, Some(r), limit)
            }
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                let (s, r) = (host("all_gather_v", send)?, host_mut("all_gather_v", recv)?);
                let kind = Kind::AllGatherV(s.dtype(), recv_counts.to_vec());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                let (s, r) = (
                    host("reduce_scatter_v", send)?,
                    host_mut("reduce_scatter_v", recv)?,
                );
                let kind = Kind::ReduceScatterV(op, s.dtype(), send_counts.to_vec());
                self.collective(kind, Some(s.to_owned_buffer()), Some(r), limit)
            }
            Op::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                let s = host("reduce", send)?;
                let r = recv.map(|r| host_mut("reduce", r)).transpose()?;
                let kind = Kind::Reduce(op, root, s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), r, limit)
            }
            Op::Gather { send, recv, root } => {
                let s = host("gather", send)?;
                let r = recv.map(|r| host_mut("gather", r)).transpose()?;
                let kind = Kind::Gather(root, s.dtype(), s.len());
                self.collective(kind, Some(s.to_owned_buffer()), r, limit)
            }
            Op::Scatter { send, recv, root } => {
                let r = host_mut("scatter", recv)?;
                let s = send.map(|s| host("scatter", s)).transpose()?;
                let kind = Kind::Scatter(root, r.dtype(), r.len());
                self.collective(kind, s.map(|s| s.to_owned_buffer()), Some(r), limit)
            }
            Op::Barrier => self.collective(Kind::Barrier, None, None, limit),
            Op::Send { buf, peer, tag } => {
                let b = host("send", buf)?;
                let t = self.group.post(self.rank, peer, tag, b.to_owned_buffer());
                self.group
                    .wait_consumed(&t, "send", &self.until(limit), true)
                    .map(|_| ())
            }
            Op::Recv { buf, peer, tag } => {
                let b = host_mut("recv", buf)?;
                let t = self.group.reserve(peer, self.rank, tag);
                self.recv_into(&t, "recv", b, &self.until(limit))
            }
            Op::Batch(ops) => {
                const OP: &str = "batch_p2p";
                self.group.world.stats.batch(self.group.global[self.rank]);
                let mut sends = Vec::new();
                let mut recvs = Vec::new();
                for o in ops {
                    match o {
                        P2pOp::Send { buf, peer, tag } => {
                            let b = host(OP, buf)?;
                            sends.push(self.group.post(self.rank, peer, tag, b.to_owned_buffer()));
                        }
                        P2pOp::Recv { buf, peer, tag } => {
                            let t = self.group.reserve(peer, self.rank, tag);
                            recvs.push((t, host_mut(OP, buf)?));
                        }
                        P2pOp::SendFramed { .. } | P2pOp::RecvFramed { .. } => {
                            return Err(P2pOp::not_lowered(BACKEND));
                        }
                    }
                }
                let until = self.until(limit);
                for (t, b) in recvs {
                    self.recv_into(&t, OP, b, &until)?;
                }
                for t in &sends {
                    self.group.wait_consumed(t, OP, &until, true)?;
                }
                Ok(())
            }
        }
    }

    fn start(&self, op: Validated<Request>) -> Result<Box<dyn Work>> {
        let owned = |name, t: Tensor| t.host_only(name, BACKEND);
        let limit = op.time_limit();
        let request = op.into_op();
        let name = request.name();
        let pending = match request {
            Request::AllReduceInto { send, recv, op } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::AllReduce(op, s.dtype(), s.len());
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::AllReduce { buf, op } => {
                let b = owned(name, buf)?;
                let kind = Kind::AllReduce(op, b.dtype(), b.len());
                let seq = self.begin(kind.clone(), Some(b.clone()))?;
                Pending::Coll { seq, kind, out: b }
            }
            Request::Broadcast { buf, root } => {
                let b = owned(name, buf)?;
                let kind = Kind::Broadcast(root, b.dtype(), b.len());
                let d = (root == self.rank).then(|| b.clone());
                let seq = self.begin(kind.clone(), d)?;
                Pending::Coll { seq, kind, out: b }
            }
            Request::AllGather { send, recv } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::AllGather(s.dtype(), s.len());
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::ReduceScatter { send, recv, op } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::ReduceScatter(op, s.dtype(), s.len());
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::AllGatherInPlace { buf } => {
                let b = owned(name, buf)?;
                let k = b.len() / self.group.size().max(1);
                let mine = take(b.as_slice(), self.rank * k, k, name)?.to_owned_buffer();
                let kind = Kind::AllGather(b.dtype(), k);
                let seq = self.begin(kind.clone(), Some(mine))?;
                Pending::Coll { seq, kind, out: b }
            }
            Request::ReduceScatterInPlace { buf, op } => {
                let b = owned(name, buf)?;
                let k = b.len() / self.group.size().max(1);
                let kind = Kind::ReduceScatter(op, b.dtype(), b.len());
                let seq = self.begin(kind.clone(), Some(b.clone()))?;
                Pending::Block {
                    seq,
                    kind,
                    out: b,
                    at: self.rank * k,
                    len: k,
                }
            }
            Request::AllToAll { send, recv } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::AllToAll(s.dtype(), s.len());
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::AllToAllV(s.dtype());
                let seq =
                    self.begin_counted(kind.clone(), Some(s), Some((send_counts, recv_counts)))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::AllGatherV(s.dtype(), recv_counts);
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                let (s, r) = (owned(name, send)?, owned(name, recv)?);
                let kind = Kind::ReduceScatterV(op, s.dtype(), send_counts);
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                let s = owned(name, send)?;
                let kind = Kind::Reduce(op, root, s.dtype(), s.len());
                // The root's result buffer; elsewhere the input comes back.
                let out = match recv {
                    Some(r) => owned(name, r)?,
                    None => s.clone(),
                };
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out }
            }
            Request::Gather { send, recv, root } => {
                let s = owned(name, send)?;
                let kind = Kind::Gather(root, s.dtype(), s.len());
                let out = match recv {
                    Some(r) => owned(name, r)?,
                    None => s.clone(),
                };
                let seq = self.begin(kind.clone(), Some(s))?;
                Pending::Coll { seq, kind, out }
            }
            Request::Scatter { send, recv, root } => {
                let r = owned(name, recv)?;
                let s = send.map(|s| owned(name, s)).transpose()?;
                let kind = Kind::Scatter(root, r.dtype(), r.len());
                let seq = self.begin(kind.clone(), s)?;
                Pending::Coll { seq, kind, out: r }
            }
            Request::Barrier => {
                let seq = self.begin(Kind::Barrier, None)?;
                Pending::Coll {
                    seq,
                    kind: Kind::Barrier,
                    out: HostBuffer::zeros(DType::U8, 0),
                }
            }
            Request::Send { buf, peer, tag } => {
                let b = owned(name, buf)?;
                let t = self.group.post(self.rank, peer, tag, b.clone());
                Pending::Send { t, buf: b }
            }
            Request::Recv { buf, peer, tag } => {
                let b = owned(name, buf)?;
                let t = self.group.reserve(peer, self.rank, tag);
                Pending::Recv { t, buf: b }
            }
        };
        Ok(Box::new(LocalWork {
            group: self.group.clone(),
            rank: self.rank,
            op: name,
            limit,
            aborted: Arc::clone(&self.aborted),
            pending: Some(pending),
        }))
    }
}

#[derive(Debug)]
enum Pending {
    Coll {
        seq: u64,
        kind: Kind,
        out: HostBuffer,
    },
    /// A collective whose result is elements `at..at + len` of `out` (the in-place
    /// reduce-scatter); `wait` returns all of `out`.
    Block {
        seq: u64,
        kind: Kind,
        out: HostBuffer,
        at: usize,
        len: usize,
    },
    Send {
        t: Ticket,
        buf: HostBuffer,
    },
    Recv {
        t: Ticket,
        buf: HostBuffer,
    },
}

/// The [`Work`] handle of the local backend. The input was deposited when the operation
/// started; waiting collects the result, for at most the operation's time limit (counted from
/// the wait). Dropping an unfinished handle waits for it (up to that limit, or until the
/// communicator is aborted), so the other ranks' rounds and messages are not left behind.
#[derive(Debug)]
pub struct LocalWork {
    group: Arc<Group>,
    rank: usize,
    op: &'static str,
    limit: TimeLimit,
    aborted: Arc<AtomicBool>,
    pending: Option<Pending>,
}

impl LocalWork {
    /// Finishes the operation by `deadline`: `Ok(None)` (pending kept) when it passed and
    /// `strict` is false.
    fn finish(&mut self, until: &Until<'_>, strict: bool) -> Result<Option<Tensor>> {
        let g = self.group.clone();
        let op = self.op;
        let Some(p) = self.pending.take() else {
            return Err(Error::Invalid(format!(
                "{op}: the work was already waited on"
            )));
        };
        match p {
            Pending::Coll { seq, kind, mut out } => match g.collect(seq, op, until, strict)? {
                None => {
                    self.pending = Some(Pending::Coll { seq, kind, out });
                    Ok(None)
                }
                Some(parts) => {
                    let o = match kind {
                        Kind::Barrier | Kind::Split => None,
                        _ => Some(out.as_mut_slice()),
                    };
                    complete(&g, self.rank, &kind, &parts, o)?;
                    Ok(Some(Tensor::Host(out)))
                }
            },
            Pending::Block {
                seq,
                kind,
                mut out,
                at,
                len,
            } => match g.collect(seq, op, until, strict)? {
                None => {
                    self.pending = Some(Pending::Block {
                        seq,
                        kind,
                        out,
                        at,
                        len,
                    });
                    Ok(None)
                }
                Some(parts) => {
                    let mut whole = out.as_mut_slice();
                    let block = whole
                        .sub_mut(at, len)
                        .ok_or_else(|| Error::Invalid(format!("local: {op}: output too short")))?;
                    complete(&g, self.rank, &kind, &parts, Some(block))?;
                    Ok(Some(Tensor::Host(out)))
                }
            },
            Pending::Send { t, buf } => {
                if g.wait_consumed(&t, op, until, strict)? {
                    Ok(Some(Tensor::Host(buf)))
                } else {
                    self.pending = Some(Pending::Send { t, buf });
                    Ok(None)
                }
            }
            Pending::Recv { t, mut buf } => match g.take(&t, op, until, strict)? {
                None => {
                    self.pending = Some(Pending::Recv { t, buf });
                    Ok(None)
                }
                Some(msg) => {
                    deliver(op, &msg, &mut buf.as_mut_slice())?;
                    Ok(Some(Tensor::Host(buf)))
                }
            },
        }
    }
}

impl Work for LocalWork {
    fn is_completed(&mut self) -> bool {
        match &self.pending {
            None => true,
            Some(Pending::Coll { seq, .. } | Pending::Block { seq, .. }) => {
                self.group.arrived(*seq)
            }
            Some(Pending::Send { t, .. }) => self.group.consumed(t),
            Some(Pending::Recv { t, .. }) => self.group.posted(t),
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        let aborted = Arc::clone(&self.aborted);
        let until = Until::limit(self.limit, &aborted);
        self.finish(&until, true)?
            .ok_or_else(|| Error::Invalid("local: a strict wait returned nothing".into()))
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        let aborted = Arc::clone(&self.aborted);
        let until = Until::limit(TimeLimit::After(timeout), &aborted);
        match self.finish(&until, false) {
            Ok(Some(t)) => Ok(Ok(t)),
            Ok(None) => Err(self),
            Err(e) => Ok(Err(e)),
        }
    }
}

impl Drop for LocalWork {
    fn drop(&mut self) {
        if self.pending.is_some() {
            let aborted = Arc::clone(&self.aborted);
            let until = Until::limit(self.limit, &aborted);
            // Errors cannot be reported from drop; the wait only keeps the rounds in step.
            let _ = self.finish(&until, true);
        }
    }
}

/// Creates sub-communicators of local communicators ([`GroupFactory`]). Both methods are
/// collective over the parent. Counts its splits ([`LocalFactory::splits`]).
///
/// ```
/// use backend_local::{run, LocalConfig};
/// use grid_core::{Communicator, GroupFactory};
/// let sizes = run(3, &LocalConfig::default(), |f, world| {
///     let g = f.create_group(&world, &[2, 0])?;
///     Ok((g.as_ref().map(|c| c.global_ranks().to_vec()), f.splits()))
/// })?;
/// assert_eq!(sizes[0], (Some(vec![0, 2]), 1));
/// assert_eq!(sizes[1], (None, 1));
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct LocalFactory {
    splits: AtomicUsize,
    /// Members-only creations made per group identity (and parent).
    identities: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl LocalFactory {
    /// A new factory.
    pub fn new() -> LocalFactory {
        LocalFactory::default()
    }
    /// The splits this factory performed on this rank.
    pub fn splits(&self) -> usize {
        self.splits.load(Ordering::Relaxed)
    }
}

impl GroupFactory for LocalFactory {
    type Comm = LocalComm;

    fn split(
        &self,
        parent: &LocalComm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<LocalComm>> {
        self.split_named(parent, color, key, None)
    }

    /// The split, creating the communicator under the options' name with their time limit.
    /// The local backend has no backend options: options for another backend are rejected.
    fn split_with(
        &self,
        parent: &LocalComm,
        color: Option<u32>,
        key: usize,
        options: &grid_core::GroupOptions,
    ) -> Result<Option<LocalComm>> {
        options.check_backend(grid_core::Communicator::backend(parent))?;
        let comm = self.split_named(parent, color, key, options.name.as_deref())?;
        if let (Some(c), Some(t)) = (&comm, options.timeout) {
            c.set_time_limit(t);
        }
        Ok(comm)
    }

    /// Members-only creation: the members pick up one shared child registered under
    /// `<identity>/<k>` in the parent, where `k` counts the groups of this identity this rank
    /// created from this parent before (a count only the group's members advance). Ranks
    /// outside the group make no call; no parent round is used.
    fn create_members_only(
        &self,
        parent: &LocalComm,
        members: &[usize],
        identity: &str,
        options: &grid_core::GroupOptions,
    ) -> Result<LocalComm> {
        const OP: &str = "create_members_only";
        parent.ensure_usable(OP)?;
        options.check_backend(grid_core::Communicator::backend(parent))?;
        let b = parent.inner();
        grid_core::comm::check::members_only(OP, members, b.group.size(), b.rank)?;
        let rank = members.iter().position(|&r| r == b.rank).ok_or_else(|| {
            Error::Invalid(format!(
                "{OP}: rank {} is not one of the members {members:?}",
                b.rank
            ))
        })?;
        let global: Vec<usize> = members
            .iter()
            .map(|&r| b.group.global.get(r).copied().unwrap_or(r))
            .collect();
        let k = {
            let mut counts = self.identities.lock().unwrap_or_else(|e| e.into_inner());
            // Per parent and per calling rank: a factory may serve several ranks.
            let key = format!("{:p}/{}/{identity}", Arc::as_ptr(&b.group), b.rank);
            let c = counts.entry(key).or_insert(0);
            let k = *c;
            *c += 1;
            k
        };
        let child = b.group.named_child(&format!("{identity}/{k}"), &global);
        let name = options.name.as_deref().unwrap_or(identity);
        tracing::debug!(comm = %name, rank, members = ?global, "local communicator created members-only");
        let comm = Comm::new(LocalBackend::new(child, rank), name);
        if let Some(t) = options.timeout {
            comm.set_time_limit(t);
        }
        Ok(comm)
    }
}

impl LocalFactory {
    fn split_named(
        &self,
        parent: &LocalComm,
        color: Option<u32>,
        key: usize,
        name: Option<&str>,
    ) -> Result<Option<LocalComm>> {
        const OP: &str = "split";
        parent.ensure_usable(OP)?;
        let b = parent.inner();
        self.splits.fetch_add(1, Ordering::Relaxed);
        let seq = b.next();
        b.group.deposit(
            seq,
            b.rank,
            Part {
                kind: Kind::Split,
                data: None,
                split: Some((color, key)),
                counts: None,
            },
        )?;
        let parts = b
            .group
            .collect(
                seq,
                OP,
                &b.until(grid_core::Communicator::time_limit(parent)),
                true,
            )?
            .ok_or_else(|| Error::Invalid("local: a strict wait returned nothing".into()))?;
        complete(&b.group, b.rank, &Kind::Split, &parts, None)?;
        let entries = parts
            .iter()
            .zip(&b.group.global)
            .map(|(p, &w)| {
                let (color, key) = p.split.ok_or_else(|| {
                    Error::Invalid("local: split: a rank contributed no colour".into())
                })?;
                Ok(SplitEntry {
                    color,
                    key,
                    world_rank: w,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (Some(color), Some(m)) = (color, split_members(&entries, b.rank)) else {
            return Ok(None);
        };
        let child = b.group.child(seq, color, &m.members);
        let name = match name {
            Some(n) => n.to_string(),
            None => format!("{}/split{seq}.{color}", parent.comm_name()),
        };
        tracing::debug!(comm = %name, rank = m.rank, members = ?m.members, "local communicator created");
        Ok(Some(Comm::new(LocalBackend::new(child, m.rank), name)))
    }
}
