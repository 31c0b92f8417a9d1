//! An in-memory host communicator for N threads of one process.
//!
//! It serves as the **bootstrap** of a single-process multi-GPU job (one thread per GPU, no MPI
//! or Gloo needed; `nccl-bench` and the GPU tests use it) and as the test double for the
//! bootstrap logic on machines without GPUs. Host memory only; every operation of the
//! [`Communicator`] trait works, with a timeout (default 60 s) instead of a hang when a rank
//! does not arrive.
//!
//! Collectives are rounds: every rank deposits its buffer, the last to arrive publishes all of
//! them, and each rank computes its result from the published set. Point-to-point messages go
//! through FIFO mailboxes keyed by `(source, destination, tag)`; sends never block.

use crate::buffer::with_dtype;
use grid_core::comm::check;
use grid_core::{
    BufMut, BufRef, Communicator, DType, Element, Error, HostBuffer, HostSlice, HostSliceMut,
    Memory, P2pOp, ReduceOp, Request, Result, Tensor, Work,
};
use half::{bf16, f16};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const NAME: &str = "inproc";

#[derive(Default)]
struct State {
    round: u64,
    arrived: usize,
    slots: Vec<Option<HostBuffer>>,
    /// Ranks that gave up on the current round (so they are not blamed by the others).
    withdrawn: Vec<usize>,
    published: Arc<Vec<HostBuffer>>,
    mail: HashMap<(usize, usize, u32), VecDeque<HostBuffer>>,
}

struct Hub {
    state: Mutex<State>,
    cv: Condvar,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Creates the ranks of an in-process world.
#[derive(Debug, Clone, Copy)]
pub struct InProcess;

impl InProcess {
    /// `n` communicators, rank `i` at index `i`, to be moved to (or borrowed by) one thread each.
    ///
    /// ```
    /// use backend_nccl::inproc::InProcess;
    /// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
    /// let comms = InProcess::world(3);
    /// let sums: Vec<Vec<i64>> = std::thread::scope(|s| {
    ///     let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || {
    ///         let mut out = vec![0i64; 2];
    ///         c.all_reduce_into(&[c.rank() as i64, 1][..], &mut out[..], ReduceOp::Sum).unwrap();
    ///         out
    ///     })).collect();
    ///     hs.into_iter().map(|h| h.join().unwrap()).collect()
    /// });
    /// assert_eq!(sums, vec![vec![3, 3]; 3]);
    /// ```
    pub fn world(n: usize) -> Vec<InProcessComm> {
        InProcess::world_with_timeout(n, Duration::from_secs(60))
    }

    /// Like [`InProcess::world`] with a timeout for every wait.
    pub fn world_with_timeout(n: usize, timeout: Duration) -> Vec<InProcessComm> {
        let hub = Arc::new(Hub {
            state: Mutex::new(State {
                slots: vec![None; n],
                ..State::default()
            }),
            cv: Condvar::new(),
        });
        let ranks: Arc<Vec<usize>> = Arc::new((0..n).collect());
        (0..n)
            .map(|rank| InProcessComm {
                rank,
                size: n,
                ranks: ranks.clone(),
                hub: hub.clone(),
                timeout,
            })
            .collect()
    }
}

/// One rank of an in-process world (see the module docs).
pub struct InProcessComm {
    rank: usize,
    size: usize,
    ranks: Arc<Vec<usize>>,
    hub: Arc<Hub>,
    timeout: Duration,
}

impl std::fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InProcessComm(rank {} of {})", self.rank, self.size)
    }
}

fn host_in<'a>(op: &'static str, b: BufRef<'a>) -> Result<HostSlice<'a>> {
    b.host_only(op, NAME)
}

fn host_out<'a>(op: &'static str, b: BufMut<'a>) -> Result<HostSliceMut<'a>> {
    b.host_only(op, NAME)
}

/// Element arithmetic for reductions (f16 and bf16 through f32).
trait Arith: Copy {
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self.wrapping_add(o),
                    ReduceOp::Prod => self.wrapping_mul(o),
                    ReduceOp::Min => self.min(o),
                    ReduceOp::Max => self.max(o),
                }
            }
            fn div_n(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
int_arith!(i32, i64, u8);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self + o,
                    ReduceOp::Prod => self * o,
                    ReduceOp::Min => self.min(o),
                    ReduceOp::Max => self.max(o),
                }
            }
            fn div_n(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
float_arith!(f32, f64);

macro_rules! half_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                <$t>::from_f32(self.to_f32().combine(o.to_f32(), op))
            }
            fn div_n(self, n: usize) -> Self { <$t>::from_f32(self.to_f32() / n as f32) }
        }
    )*};
}
half_arith!(f16, bf16);

/// Reduces the published buffers element-wise in rank order.
fn reduce(op_name: &'static str, bufs: &[HostBuffer], op: ReduceOp) -> Result<HostBuffer> {
    let Some(first) = bufs.first() else {
        return Err(Error::Invalid(format!("{op_name}: no ranks")));
    };
    let n = bufs.len();
    with_dtype!(first.dtype(), T => {
        let mut acc: Vec<T> = <T as Element>::view(first.as_slice()).unwrap_or_default().to_vec();
        for (r, b) in bufs.iter().enumerate().skip(1) {
            let v = <T as Element>::view(b.as_slice()).ok_or(Error::DTypeMismatch { op: op_name, expected: first.dtype(), actual: b.dtype() })?;
            if v.len() != acc.len() {
                return Err(Error::Invalid(format!("{op_name}: rank {r} passed {} elements, rank 0 passed {}", v.len(), acc.len())));
            }
            for (a, x) in acc.iter_mut().zip(v) {
                *a = a.combine(*x, op);
            }
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = a.div_n(n);
            }
        }
        Ok(<T as Element>::owned(acc))
    })
}

/// Copies `src[start..start+dst.len()]` into `dst` (same dtype).
fn copy_range(
    op: &'static str,
    src: &HostBuffer,
    start: usize,
    mut dst: HostSliceMut<'_>,
) -> Result<()> {
    let len = dst.len();
    let d = dst.dtype();
    with_dtype!(d, T => {
        let s = <T as Element>::view(src.as_slice()).ok_or(Error::DTypeMismatch { op, expected: d, actual: src.dtype() })?;
        let part = s.get(start..start + len).ok_or(Error::LengthMismatch { op, what: "received buffer", expected: start + len, actual: s.len() })?;
        dst.copy_from(<T as Element>::host(part))
    })
}

impl InProcessComm {
    /// One collective round: deposits `mine`, returns every rank's deposit in rank order.
    fn exchange(&self, op: &'static str, mine: HostBuffer) -> Result<Arc<Vec<HostBuffer>>> {
        let mut st = self.hub.lock();
        let round = st.round;
        st.slots[self.rank] = Some(mine);
        st.withdrawn.retain(|&r| r != self.rank);
        st.arrived += 1;
        if st.arrived == self.size {
            let all: Vec<HostBuffer> = st
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_else(|| HostBuffer::zeros(DType::U8, 0)))
                .collect();
            st.published = Arc::new(all);
            st.withdrawn.clear();
            st.arrived = 0;
            st.round += 1;
            self.hub.cv.notify_all();
            return Ok(st.published.clone());
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let now = Instant::now();
            if now >= deadline {
                st.slots[self.rank] = None;
                st.arrived -= 1;
                st.withdrawn.push(self.rank);
                let never = |r: &usize| *r != self.rank && !st.withdrawn.contains(r);
                let missing = (0..self.size)
                    .filter(never)
                    .find(|&r| st.slots[r].is_none());
                return Err(Error::Timeout {
                    op,
                    millis: self.timeout.as_millis() as u64,
                    peer: missing,
                });
            }
            st = self
                .hub
                .cv
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
            if st.round != round {
                return Ok(st.published.clone());
            }
        }
    }

    fn post(&self, to: usize, tag: u32, buf: HostBuffer) {
        let mut st = self.hub.lock();
        st.mail
            .entry((self.rank, to, tag))
            .or_default()
            .push_back(buf);
        self.hub.cv.notify_all();
    }

    fn take(
        &self,
        op: &'static str,
        from: usize,
        tag: u32,
        wait: bool,
    ) -> Result<Option<HostBuffer>> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.hub.lock();
        loop {
            if let Some(m) = st
                .mail
                .get_mut(&(from, self.rank, tag))
                .and_then(VecDeque::pop_front)
            {
                return Ok(Some(m));
            }
            let now = Instant::now();
            if !wait {
                return Ok(None);
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    op,
                    millis: self.timeout.as_millis() as u64,
                    peer: Some(from),
                });
            }
            st = self
                .hub
                .cv
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    fn deliver(op: &'static str, msg: HostBuffer, dst: HostSliceMut<'_>) -> Result<()> {
        check::same_dtype(op, dst.dtype(), msg.dtype())?;
        check::len(op, "receive buffer", msg.len(), dst.len())?;
        copy_range(op, &msg, 0, dst)
    }

    fn check_reduce(&self, op: &'static str, dtype: DType, r: ReduceOp) -> Result<()> {
        if self.supports(dtype, Some(r)) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                op,
                backend: NAME,
                what: format!("{r} on {dtype} (Avg is for floating-point types)"),
            })
        }
    }
}

/// A finished (or, for receives, deferred) operation of the in-process communicator.
struct InProcWork {
    result: Option<Result<Tensor>>,
    deferred_recv: Option<(Arc<Hub>, InProcessCommLite, usize, u32, HostBuffer)>,
}

/// What a deferred receive needs from its communicator.
#[derive(Clone)]
struct InProcessCommLite {
    rank: usize,
    timeout: Duration,
}

impl InProcWork {
    fn ready(r: Result<Tensor>) -> Box<dyn Work> {
        Box::new(InProcWork {
            result: Some(r),
            deferred_recv: None,
        })
    }

    fn poll(&mut self, wait: bool) -> Option<Result<Tensor>> {
        if let Some(r) = self.result.take() {
            return Some(r);
        }
        let (hub, lite, from, tag, mut buf) = self.deferred_recv.take()?;
        let c = InProcessComm {
            rank: lite.rank,
            size: 0,
            ranks: Arc::new(Vec::new()),
            hub: hub.clone(),
            timeout: lite.timeout,
        };
        match c.take("recv", from, tag, wait) {
            Ok(Some(msg)) => Some(
                InProcessComm::deliver("recv", msg, buf.as_mut_slice()).map(|_| Tensor::Host(buf)),
            ),
            Ok(None) => {
                self.deferred_recv = Some((hub, lite, from, tag, buf));
                None
            }
            Err(e) => Some(Err(e)),
        }
    }
}

impl Work for InProcWork {
    fn is_completed(&mut self) -> bool {
        if self.result.is_none() {
            self.result = self.poll(false);
        }
        self.result.is_some()
    }
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.poll(true).unwrap_or_else(|| {
            Err(Error::Invalid(
                "recv: the operation was already waited for".into(),
            ))
        })
    }
    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.poll(false) {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                return Err(self);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Communicator for InProcessComm {
    fn backend(&self) -> &'static str {
        NAME
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn global_ranks(&self) -> &[usize] {
        &self.ranks
    }
    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        op != Some(ReduceOp::Avg) || dtype.is_float()
    }

    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let (s, r) = (host_in(OP, send)?, host_out(OP, recv)?);
        check::collective(
            OP,
            self.size,
            Some((s.dtype(), s.len())),
            (r.dtype(), r.len()),
        )?;
        self.check_reduce(OP, s.dtype(), op)?;
        let all = self.exchange(OP, s.to_owned_buffer())?;
        copy_range(OP, &reduce(OP, &all, op)?, 0, r)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let b = host_out(OP, buf)?;
        check::rank(OP, "root", root, self.size)?;
        let mine = if self.rank == root {
            b.as_slice().to_owned_buffer()
        } else {
            HostBuffer::zeros(b.dtype(), 0)
        };
        let all = self.exchange(OP, mine)?;
        let src = &all[root];
        check::same_dtype(OP, b.dtype(), src.dtype())?;
        check::len(OP, "buffer", src.len(), b.len())?;
        copy_range(OP, src, 0, b)
    }

    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let (s, mut r) = (host_in(OP, send)?, host_out(OP, recv)?);
        check::collective(
            OP,
            self.size,
            Some((s.dtype(), s.len())),
            (r.dtype(), r.len()),
        )?;
        let all = self.exchange(OP, s.to_owned_buffer())?;
        let n = s.len();
        with_dtype!(r.dtype(), T => {
            let rd = r.dtype();
            let out = <T as Element>::view_mut(r.reborrow()).ok_or(Error::DTypeMismatch { op: OP, expected: s.dtype(), actual: rd })?;
            for (i, b) in all.iter().enumerate() {
                let v = <T as Element>::view(b.as_slice()).ok_or(Error::DTypeMismatch { op: OP, expected: s.dtype(), actual: b.dtype() })?;
                check::len(OP, "block of a peer", n, v.len())?;
                out[i * n..(i + 1) * n].copy_from_slice(v);
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let (s, r) = (host_in(OP, send)?, host_out(OP, recv)?);
        check::collective(
            OP,
            self.size,
            Some((s.dtype(), s.len())),
            (r.dtype(), r.len()),
        )?;
        self.check_reduce(OP, s.dtype(), op)?;
        let all = self.exchange(OP, s.to_owned_buffer())?;
        let start = self.rank * r.len();
        copy_range(OP, &reduce(OP, &all, op)?, start, r)
    }

    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        const OP: &str = "all_to_all";
        let (s, mut r) = (host_in(OP, send)?, host_out(OP, recv)?);
        check::collective(
            OP,
            self.size,
            Some((s.dtype(), s.len())),
            (r.dtype(), r.len()),
        )?;
        let all = self.exchange(OP, s.to_owned_buffer())?;
        let b = s.len() / self.size.max(1);
        with_dtype!(r.dtype(), T => {
            let rd = r.dtype();
            let out = <T as Element>::view_mut(r.reborrow()).ok_or(Error::DTypeMismatch { op: OP, expected: s.dtype(), actual: rd })?;
            for (i, buf) in all.iter().enumerate() {
                let v = <T as Element>::view(buf.as_slice()).ok_or(Error::DTypeMismatch { op: OP, expected: s.dtype(), actual: buf.dtype() })?;
                let part = v.get(self.rank * b..(self.rank + 1) * b).ok_or(Error::LengthMismatch { op: OP, what: "buffer of a peer", expected: s.len(), actual: v.len() })?;
                out[i * b..(i + 1) * b].copy_from_slice(part);
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", HostBuffer::zeros(DType::U8, 0))
            .map(|_| ())
    }

    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        let b = host_in("send", buf)?;
        check::rank("send", "peer", peer, self.size)?;
        self.post(peer, tag, b.to_owned_buffer());
        Ok(())
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        let b = host_out("recv", buf)?;
        check::rank("recv", "peer", peer, self.size)?;
        let msg = self.take("recv", peer, tag, true)?.ok_or(Error::Timeout {
            op: "recv",
            millis: 0,
            peer: Some(peer),
        })?;
        Self::deliver("recv", msg, b)
    }

    /// Sends first (they never block), then receives: no ordering can deadlock.
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        let mut recvs = Vec::new();
        for o in ops {
            match o {
                P2pOp::Send { buf, peer, tag } => self.send(buf, peer, tag)?,
                P2pOp::Recv { buf, peer, tag } => {
                    check::rank("batch_p2p", "peer", peer, self.size)?;
                    recvs.push((buf, peer, tag));
                }
            }
        }
        for (buf, peer, tag) in recvs {
            self.recv(buf, peer, tag)?;
        }
        Ok(())
    }

    /// Collectives and sends run at once; a receive is deferred to `wait` / `is_completed`.
    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        fn host(op: &'static str, t: Tensor) -> Result<HostBuffer> {
            t.host_only(op, NAME)
        }
        let op = request.name();
        Ok(match request {
            Request::AllReduce { buf, op: r } => {
                let mut out = host(op, buf)?;
                let inp = out.clone();
                self.all_reduce(
                    BufRef::Host(inp.as_slice()),
                    BufMut::Host(out.as_mut_slice()),
                    r,
                )?;
                InProcWork::ready(Ok(Tensor::Host(out)))
            }
            Request::AllReduceInto { send, recv, op: r } => {
                let (s, mut out) = (host(op, send)?, host(op, recv)?);
                self.all_reduce(
                    BufRef::Host(s.as_slice()),
                    BufMut::Host(out.as_mut_slice()),
                    r,
                )?;
                InProcWork::ready(Ok(Tensor::Host(out)))
            }
            Request::Broadcast { buf, root } => {
                let mut b = host(op, buf)?;
                self.broadcast(BufMut::Host(b.as_mut_slice()), root)?;
                InProcWork::ready(Ok(Tensor::Host(b)))
            }
            Request::AllGather { send, recv } => {
                let (s, mut r) = (host(op, send)?, host(op, recv)?);
                self.all_gather(BufRef::Host(s.as_slice()), BufMut::Host(r.as_mut_slice()))?;
                InProcWork::ready(Ok(Tensor::Host(r)))
            }
            Request::ReduceScatter { send, recv, op: o } => {
                let (s, mut r) = (host(op, send)?, host(op, recv)?);
                self.reduce_scatter(
                    BufRef::Host(s.as_slice()),
                    BufMut::Host(r.as_mut_slice()),
                    o,
                )?;
                InProcWork::ready(Ok(Tensor::Host(r)))
            }
            Request::AllToAll { send, recv } => {
                let (s, mut r) = (host(op, send)?, host(op, recv)?);
                self.all_to_all(BufRef::Host(s.as_slice()), BufMut::Host(r.as_mut_slice()))?;
                InProcWork::ready(Ok(Tensor::Host(r)))
            }
            Request::Barrier => {
                self.barrier()?;
                InProcWork::ready(Ok(Tensor::Host(HostBuffer::zeros(DType::U8, 0))))
            }
            Request::Send { buf, peer, tag } => {
                let b = host(op, buf)?;
                self.send(BufRef::Host(b.as_slice()), peer, tag)?;
                InProcWork::ready(Ok(Tensor::Host(b)))
            }
            Request::Recv { buf, peer, tag } => {
                let b = host(op, buf)?;
                check::rank(op, "peer", peer, self.size)?;
                Box::new(InProcWork {
                    result: None,
                    deferred_recv: Some((
                        self.hub.clone(),
                        InProcessCommLite {
                            rank: self.rank,
                            timeout: self.timeout,
                        },
                        peer,
                        tag,
                        b,
                    )),
                })
            }
        })
    }
}
