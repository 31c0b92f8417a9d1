//! [`MpiCommunicator`]: the grid-core [`Communicator`] over one MPI communicator.

use crate::raw::{self, Immediate, P2p, Pending, RawError};
use crate::stage::{self, Plan};
use grid_core::comm::check;
use grid_core::{
    BufMut, BufRef, Communicator, DType, Error, HostBuffer, HostSlice, HostSliceMut, Memory, P2pOp,
    ReduceOp, Request, Result, Tensor, Work,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const BACKEND: &str = "mpi";

/// A `trace`-level event for one operation. An event rather than a span: a disabled event
/// costs one static check, while even a disabled span costs a call when dropped, which is a
/// measurable share of an 8-byte collective.
macro_rules! trace_op {
    ($name:literal, $($fields:tt)*) => {
        tracing::trace!(target: "backend_mpi", op = $name, $($fields)*)
    };
}

pub(crate) fn backend_err(op: &'static str, e: RawError) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: e.0,
    }
}

/// A communicator over one MPI communicator (`MPI_Comm`), created by [`crate::MpiRuntime`]
/// (the world) or by [`crate::MpiFactory`] (sub-groups). The MPI communicator is freed
/// (`MPI_Comm_free`) when this value is dropped.
///
/// Errors come back as [`Error`]s: arguments are validated with [`grid_core::comm::check`]
/// before MPI sees them, and MPI itself runs with `MPI_ERRORS_RETURN`, so its failures become
/// [`Error::Backend`] with MPI's message.
///
/// Ordering: as in MPI, collectives on one communicator must be called in the same order on
/// every member. Nonblocking operations ([`Communicator::start`]) are MPI immediate operations
/// issued at the call, so they take their place in that order when they are started, and
/// blocking and nonblocking calls may be mixed.
///
/// ```no_run
/// use backend_mpi::MpiRuntime;
/// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
/// let rt = MpiRuntime::init()?;
/// let world = rt.world();
/// let mut sum = [0i64];
/// world.all_reduce_into(&[world.rank() as i64][..], &mut sum[..], ReduceOp::Sum)?;
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug)]
pub struct MpiCommunicator {
    raw: raw::Comm,
    rank: usize,
    size: usize,
    global: Vec<usize>,
    finished: AtomicBool,
}

impl MpiCommunicator {
    pub(crate) fn from_raw(raw: raw::Comm, op: &'static str) -> Result<MpiCommunicator> {
        let rank = raw.rank().map_err(|e| backend_err(op, e))?;
        let size = raw.size().map_err(|e| backend_err(op, e))?;
        let global = raw.world_ranks().map_err(|e| backend_err(op, e))?;
        tracing::debug!(op, rank, size, ?global, "mpi communicator created");
        Ok(MpiCommunicator {
            raw,
            rank,
            size,
            global,
            finished: AtomicBool::new(false),
        })
    }

    pub(crate) fn raw(&self) -> &raw::Comm {
        &self.raw
    }

    /// Marks the communicator finished: every later call returns [`Error::Finalized`]. Local,
    /// not collective. The MPI communicator itself is freed when the value is dropped.
    /// Operations already started complete normally.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// use grid_core::Communicator;
    /// let f = backend_mpi::MpiFactory::new();
    /// # use grid_core::GroupFactory;
    /// let sub = f.split(rt.world(), Some(0), rt.world().rank())?.expect("every rank is a member");
    /// sub.finish();
    /// assert!(sub.barrier().is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// True after [`MpiCommunicator::finish`] or after MPI was finalized.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// assert!(!rt.world().is_finished());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire) || raw::FINALIZED.load(Ordering::Acquire)
    }

    #[inline]
    pub(crate) fn live(&self, op: &'static str) -> Result<()> {
        if self.finished.load(Ordering::Acquire) {
            return Err(Error::Finalized {
                op,
                state: "finished",
            });
        }
        if raw::FINALIZED.load(Ordering::Acquire) {
            return Err(Error::Finalized {
                op,
                state: "finalized (MPI_Finalize ran)",
            });
        }
        Ok(())
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<()> {
        check::rank(op, "peer", peer, self.size)?;
        if peer == self.rank {
            return Err(Error::Invalid(format!(
                "{op}: peer {peer} is this rank; send and receive need another rank (valid: 0..{} except {peer})",
                self.size
            )));
        }
        Ok(())
    }

    fn tag(op: &'static str, tag: u32) -> Result<()> {
        if tag > i32::MAX as u32 {
            return Err(Error::Invalid(format!(
                "{op}: tag {tag} exceeds the MPI tag limit {}",
                i32::MAX
            )));
        }
        Ok(())
    }
}

impl MpiCommunicator {
    /// All-reduce through a wider wire type (halves via f32, integer averages via i64); kept
    /// out of line so the common path stays small.
    #[cold]
    #[inline(never)]
    fn all_reduce_staged(
        &self,
        send: HostSlice<'_>,
        recv: HostSliceMut<'_>,
        plan: Plan,
    ) -> Result<()> {
        let w = plan.wire.unwrap_or(send.dtype());
        let s = stage::widen(send, w);
        let mut r = HostBuffer::zeros(w, s.len());
        self.raw
            .all_reduce(s.as_slice(), r.as_mut_slice(), plan.op)
            .map_err(|e| backend_err("all_reduce", e))?;
        stage::narrow(r.as_slice(), recv, plan.divide);
        Ok(())
    }
}

fn host<'a>(op: &'static str, b: BufRef<'a>) -> Result<HostSlice<'a>> {
    b.host_only(op, BACKEND)
}

fn host_mut<'a>(op: &'static str, b: BufMut<'a>) -> Result<HostSliceMut<'a>> {
    b.host_only(op, BACKEND)
}

fn owned(op: &'static str, t: Tensor) -> Result<HostBuffer> {
    t.host_only(op, BACKEND)
}

impl Communicator for MpiCommunicator {
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global
    }
    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }
    fn supports(&self, _dtype: DType, _op: Option<ReduceOp>) -> bool {
        // Every dtype moves; every reduction runs (halves via f32, integer averages via i64;
        // see the `stage` module docs).
        true
    }

    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        self.live(OP)?;
        let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
        check::same_dtype(OP, send.dtype(), recv.dtype())?;
        check::len(OP, "recv buffer", send.len(), recv.len())?;
        trace_op!("mpi.all_reduce", n = send.len());
        let plan = stage::plan(send.dtype(), op, self.size);
        if plan.wire.is_some() {
            return self.all_reduce_staged(send, recv, plan);
        }
        self.raw
            .all_reduce(send, recv.reborrow(), plan.op)
            .map_err(|e| backend_err(OP, e))?;
        if let Some(n) = plan.divide {
            stage::divide_in_place(recv, n);
        }
        Ok(())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.live(OP)?;
        let buf = host_mut(OP, buf)?;
        check::rank(OP, "root", root, self.size)?;
        trace_op!("mpi.broadcast", n = buf.len());
        self.raw
            .broadcast(buf, root)
            .map_err(|e| backend_err(OP, e))
    }

    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        self.live(OP)?;
        let (send, recv) = (host(OP, send)?, host_mut(OP, recv)?);
        check::same_dtype(OP, send.dtype(), recv.dtype())?;
        check::len(OP, "recv buffer", send.len() * self.size, recv.len())?;
        trace_op!("mpi.all_gather", n = send.len());
        self.raw
            .all_gather(send, recv)
            .map_err(|e| backend_err(OP, e))
    }

    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.live(OP)?;
        let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
        check::same_dtype(OP, send.dtype(), recv.dtype())?;
        check::len(OP, "send buffer", recv.len() * self.size, send.len())?;
        trace_op!("mpi.reduce_scatter", n = recv.len());
        match stage::plan(send.dtype(), op, self.size) {
            Plan {
                wire: None,
                op,
                divide,
            } => {
                self.raw
                    .reduce_scatter(send, recv.reborrow(), op)
                    .map_err(|e| backend_err(OP, e))?;
                if let Some(n) = divide {
                    stage::divide_in_place(recv, n);
                }
            }
            Plan {
                wire: Some(w),
                op,
                divide,
            } => {
                let s = stage::widen(send, w);
                let mut r = HostBuffer::zeros(w, recv.len());
                self.raw
                    .reduce_scatter(s.as_slice(), r.as_mut_slice(), op)
                    .map_err(|e| backend_err(OP, e))?;
                stage::narrow(r.as_slice(), recv, divide);
            }
        }
        Ok(())
    }

    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_to_all";
        self.live(OP)?;
        let (send, recv) = (host(OP, send)?, host_mut(OP, recv)?);
        check::collective(
            OP,
            self.size,
            Some((send.dtype(), send.len())),
            (recv.dtype(), recv.len()),
        )?;
        trace_op!("mpi.all_to_all", n = send.len());
        self.raw
            .all_to_all(send, recv)
            .map_err(|e| backend_err(OP, e))
    }

    fn barrier(&self) -> Result<()> {
        self.live("barrier")?;
        self.raw.barrier().map_err(|e| backend_err("barrier", e))
    }

    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        const OP: &str = "send";
        self.live(OP)?;
        let buf = host(OP, buf)?;
        self.peer(OP, peer)?;
        Self::tag(OP, tag)?;
        trace_op!("mpi.send", n = buf.len(), peer);
        self.raw
            .send(buf, peer, tag)
            .map_err(|e| backend_err(OP, e))
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        const OP: &str = "recv";
        self.live(OP)?;
        let buf = host_mut(OP, buf)?;
        self.peer(OP, peer)?;
        Self::tag(OP, tag)?;
        let expected = buf.len();
        trace_op!("mpi.recv", n = expected, peer);
        let got = self
            .raw
            .recv(buf, peer, tag)
            .map_err(|e| backend_err(OP, e))?;
        check::len(OP, "received message", expected, got)
    }

    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        const OP: &str = "batch_p2p";
        self.live(OP)?;
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for op in ops {
            match op {
                P2pOp::Send { buf, peer, tag } => {
                    check::rank(OP, "peer", peer, self.size)?;
                    Self::tag(OP, tag)?;
                    sends.push((host(OP, buf)?, peer, tag));
                }
                P2pOp::Recv { buf, peer, tag } => {
                    check::rank(OP, "peer", peer, self.size)?;
                    Self::tag(OP, tag)?;
                    recvs.push((host_mut(OP, buf)?, peer, tag));
                }
            }
        }
        let mut raw_ops: Vec<P2p<'_, '_>> = Vec::with_capacity(sends.len() + recvs.len());
        // Receives first: posting them early lets matching sends complete eagerly.
        for (buf, peer, tag) in recvs.iter_mut() {
            raw_ops.push(P2p::Recv {
                buf,
                peer: *peer,
                tag: *tag,
            });
        }
        for (buf, peer, tag) in sends {
            raw_ops.push(P2p::Send { buf, peer, tag });
        }
        self.raw.batch(&mut raw_ops).map_err(|e| backend_err(OP, e))
    }

    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        let name = request.name();
        self.live(name)?;
        let size = self.size;
        let (what, bufs, post) = match request {
            Request::AllReduce { buf, op } => {
                let buf = owned(name, buf)?;
                let plan = stage::plan(buf.dtype(), op, size);
                match plan.wire {
                    None => {
                        let recv = buf.clone();
                        (
                            Immediate::AllReduce(plan.op),
                            vec![buf, recv],
                            post_native(1, plan.divide),
                        )
                    }
                    Some(w) => {
                        let s = stage::widen(buf.as_slice(), w);
                        let r = HostBuffer::zeros(w, s.len());
                        (
                            Immediate::AllReduce(plan.op),
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: buf,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::Broadcast { buf, root } => {
                let buf = owned(name, buf)?;
                check::rank(name, "root", root, size)?;
                (Immediate::Broadcast(root), vec![buf], Post::Take(0))
            }
            Request::AllGather { send, recv } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                check::same_dtype(name, send.dtype(), recv.dtype())?;
                check::len(name, "recv buffer", send.len() * size, recv.len())?;
                (Immediate::AllGather, vec![send, recv], Post::Take(1))
            }
            Request::ReduceScatter { send, recv, op } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                check::same_dtype(name, send.dtype(), recv.dtype())?;
                check::len(name, "send buffer", recv.len() * size, send.len())?;
                let plan = stage::plan(send.dtype(), op, size);
                match plan.wire {
                    None => (
                        Immediate::ReduceScatter(plan.op),
                        vec![send, recv],
                        post_native(1, plan.divide),
                    ),
                    Some(w) => {
                        let s = stage::widen(send.as_slice(), w);
                        let r = HostBuffer::zeros(w, recv.len());
                        (
                            Immediate::ReduceScatter(plan.op),
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: recv,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::AllToAll { send, recv } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                check::collective(
                    name,
                    size,
                    Some((send.dtype(), send.len())),
                    (recv.dtype(), recv.len()),
                )?;
                (Immediate::AllToAll, vec![send, recv], Post::Take(1))
            }
            Request::Barrier => (Immediate::Barrier, vec![], Post::Empty),
            Request::Send { buf, peer, tag } => {
                let buf = owned(name, buf)?;
                self.peer(name, peer)?;
                Self::tag(name, tag)?;
                (Immediate::Send(peer, tag), vec![buf], Post::Take(0))
            }
            Request::Recv { buf, peer, tag } => {
                let buf = owned(name, buf)?;
                self.peer(name, peer)?;
                Self::tag(name, tag)?;
                let expected = buf.len();
                (
                    Immediate::Recv(peer, tag),
                    vec![buf],
                    Post::Received { expected },
                )
            }
        };
        let pending = self
            .raw
            .start(what, bufs)
            .map_err(|e| backend_err(name, e))?;
        Ok(Box::new(MpiWork {
            op: name,
            pending: Some(pending),
            post: Some(post),
        }))
    }
}

fn post_native(idx: usize, divide: Option<usize>) -> Post {
    match divide {
        Some(n) => Post::Divide { idx, n },
        None => Post::Take(idx),
    }
}

/// How a completed operation's buffers become its result.
enum Post {
    Take(usize),
    Divide {
        idx: usize,
        n: usize,
    },
    Narrow {
        idx: usize,
        out: HostBuffer,
        divide: Option<usize>,
    },
    Received {
        expected: usize,
    },
    Empty,
}

/// The [`Work`] handle of the MPI backend: an MPI request plus the buffers it owns.
/// Dropping it before completion waits for the operation (MPI may still use the buffers).
struct MpiWork {
    op: &'static str,
    pending: Option<Pending>,
    post: Option<Post>,
}

impl MpiWork {
    fn finish(&mut self) -> Result<Tensor> {
        let op = self.op;
        let pending = self
            .pending
            .take()
            .ok_or_else(|| Error::Invalid(format!("{op}: work already waited on")))?;
        let (mut bufs, received) = pending.wait().map_err(|e| backend_err(op, e))?;
        let take = |bufs: &mut Vec<HostBuffer>, i: usize| -> Result<HostBuffer> {
            if i < bufs.len() {
                Ok(bufs.swap_remove(i))
            } else {
                Err(Error::Invalid(format!(
                    "{op}: internal: result buffer {i} missing"
                )))
            }
        };
        let out = match self.post.take() {
            Some(Post::Take(i)) => take(&mut bufs, i)?,
            Some(Post::Divide { idx, n }) => {
                let mut b = take(&mut bufs, idx)?;
                stage::divide_in_place(b.as_mut_slice(), n);
                b
            }
            Some(Post::Narrow {
                idx,
                mut out,
                divide,
            }) => {
                let wide = take(&mut bufs, idx)?;
                stage::narrow(wide.as_slice(), out.as_mut_slice(), divide);
                out
            }
            Some(Post::Received { expected }) => {
                let b = take(&mut bufs, 0)?;
                check::len(
                    op,
                    "received message",
                    expected,
                    received.unwrap_or(expected),
                )?;
                b
            }
            Some(Post::Empty) | None => HostBuffer::zeros(DType::U8, 0),
        };
        Ok(Tensor::Host(out))
    }
}

impl Work for MpiWork {
    fn is_completed(&mut self) -> bool {
        match self.pending.as_mut() {
            Some(p) => p.test().unwrap_or(true),
            None => true,
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.finish()
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            let done = match self.pending.as_mut() {
                Some(p) => match p.test() {
                    Ok(d) => d,
                    Err(e) => return Ok(Err(backend_err(self.op, e))),
                },
                None => true,
            };
            if done {
                return Ok(self.finish());
            }
            if Instant::now() >= deadline {
                return Err(self);
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
