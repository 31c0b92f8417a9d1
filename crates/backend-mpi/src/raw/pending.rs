//! Nonblocking operations on owned host memory: [`Comm::start`] hands the buffers to MPI and
//! [`Pending`] keeps them alive (and out of reach) until the request completed.

use super::comm::{blocks, root_arrays, same_len};
use super::wait::{cancel_all, status, wait_all, Stop};
use super::{
    count, cptr, datatype, equal_layout, finalized, in_place, int, layout, mptr, op, rc, same,
    Comm, RawError, Reduce, R,
};
use grid_core::{DType, HostBuffer};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// What a nonblocking operation runs.
pub(crate) enum Immediate {
    /// `bufs[0]` is the input, `bufs[1]` the result.
    AllReduce(Reduce),
    /// `bufs[0]` reduced in place (`MPI_IN_PLACE`).
    AllReduceInPlace(Reduce),
    /// `bufs[0]` in place.
    Broadcast(usize),
    /// `bufs[0]` input block, `bufs[1]` result.
    AllGather,
    /// `bufs[0]` input, `bufs[1]` this rank's block.
    ReduceScatter(Reduce),
    /// `bufs[0]` (`size · n` elements) gathered in place (`MPI_IN_PLACE`), this rank's block
    /// read at `rank · n`.
    AllGatherInPlace,
    /// `bufs[0]` (`size · n` elements) reduce-scattered in place (`MPI_IN_PLACE`): the result
    /// lands at its start (elements `0..n`).
    ReduceScatterInPlace(Reduce),
    /// `bufs[0]` input, `bufs[1]` result.
    AllToAll,
    /// No buffers.
    Barrier,
    /// `bufs[0]` sent.
    Send(usize, u32),
    /// `bufs[0]` received into.
    Recv(usize, u32),
    /// `bufs[0]` input (blocks of `send_counts` in rank order), `bufs[1]` result (blocks of
    /// `recv_counts`).
    AllToAllV {
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    },
    /// `bufs[0]` this rank's block, `bufs[1]` result (blocks of `recv_counts`).
    AllGatherV { recv_counts: Vec<usize> },
    /// `bufs[0]` input (blocks of `counts`), `bufs[1]` this rank's reduced block.
    ReduceScatterV { counts: Vec<usize>, op: Reduce },
    /// `bufs[0]` input, `bufs[1]` the result on the root (absent elsewhere).
    Reduce { op: Reduce, root: usize },
    /// `bufs[0]` input block, `bufs[1]` the gathered blocks on the root (absent elsewhere);
    /// `MPI_Igatherv`.
    Gather { root: usize },
    /// `bufs[0]` this rank's block, `bufs[1]` the blocks to scatter on the root (absent
    /// elsewhere); `MPI_Iscatterv`.
    Scatter { root: usize },
}

/// What a completed operation hands back: its buffers, and for a receive the element count
/// that arrived.
pub(crate) type Completed = (Vec<HostBuffer>, Option<usize>);

/// A started nonblocking MPI operation that owns its buffers until it completed.
///
/// Invariant: while `req` is active, the heap memory of every buffer in `bufs` is in use by MPI.
/// The buffers are only reachable through this value; they are neither read, written, moved out
/// nor freed before the request completed (`wait_within`, a successful `test`) or was
/// cancelled; an operation given up while active is abandoned: its buffers are leaked, never
/// freed (`wait_within` past its limit, `Drop`).
/// Moving a `Pending` moves the `Vec` headers, not the heap memory MPI holds pointers into.
pub(crate) struct Pending {
    req: ffi::MPI_Request,
    done: bool,
    bufs: Vec<HostBuffer>,
    /// The count and displacement arrays of a vector operation: MPI may read them until the
    /// request completed (MPI 3.1 §5.12), so they live, and are leaked, with the buffers.
    ints: Vec<Vec<c_int>>,
    /// For receives: the element count that arrived.
    pub(crate) received: Option<usize>,
    is_recv: bool,
    dtype: DType,
}

// SAFETY: the request handle may be tested or waited on from any thread under
// MPI_THREAD_MULTIPLE; the owned buffers are plain `Vec`s (Send).
unsafe impl Send for Pending {}

impl Comm {
    /// Starts `what` on owned buffers. Checks lengths against the communicator size before
    /// handing pointers to MPI.
    pub(crate) fn start(&self, what: Immediate, mut bufs: Vec<HostBuffer>) -> R<Pending> {
        let size = self.size()?.max(1);
        let need = |k: usize| -> R<()> {
            if bufs.len() == k {
                Ok(())
            } else {
                Err(RawError::msg(format!(
                    "internal: {k} buffers expected, got {}",
                    bufs.len()
                )))
            }
        };
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        let dtype = bufs.first().map(|b| b.dtype()).unwrap_or(DType::U8);
        let dt = datatype(dtype);
        let is_recv = matches!(what, Immediate::Recv(..));
        let mut ints: Vec<Vec<c_int>> = Vec::new();
        match what {
            Immediate::AllReduce(r) => {
                need(2)?;
                same(
                    "iall_reduce",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                let (n, op) = (count(bufs[0].len())?, op(r, dtype)?);
                let (s, d) = two(&mut bufs);
                // SAFETY: both owned buffers hold n elements of `dt`; they move into the
                // returned `Pending`, which keeps them untouched until completion.
                unsafe {
                    rc(ffi::MPI_Iallreduce(
                        s,
                        d,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::AllReduceInPlace(r) => {
                need(1)?;
                let place = in_place()?;
                let (n, op) = (count(bufs[0].len())?, op(r, dtype)?);
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements of `dt`; it moves into the returned
                // `Pending`, which keeps it untouched until completion; `place` is MPI_IN_PLACE.
                unsafe {
                    rc(ffi::MPI_Iallreduce(
                        place,
                        p,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::Broadcast(root) => {
                need(1)?;
                let (n, root) = (count(bufs[0].len())?, int("root", root)?);
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Ibcast(p, n, dt, root, self.raw, req.as_mut_ptr()))? };
            }
            Immediate::AllGather => {
                need(2)?;
                same(
                    "iall_gather",
                    (bufs[0].dtype(), bufs[0].len() * size),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                let n = count(bufs[0].len())?;
                count(bufs[1].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: send holds n, recv size·n elements of `dt`; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Iallgather(
                        s,
                        n,
                        dt,
                        d,
                        n,
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::ReduceScatter(r) => {
                need(2)?;
                same(
                    "ireduce_scatter",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len() * size),
                )?;
                let (n, op) = (count(bufs[1].len())?, op(r, dtype)?);
                count(bufs[0].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: send holds size·n, recv n elements; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Ireduce_scatter_block(
                        s,
                        d,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::AllGatherInPlace => {
                need(1)?;
                let place = in_place()?;
                let n = blocks("iall_gather", bufs[0].len(), size)?;
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds size·n elements of `dt` (checked by `blocks`);
                // it moves into the returned `Pending`, which keeps it untouched until
                // completion; `place` is MPI_IN_PLACE (send count and type ignored).
                unsafe {
                    rc(ffi::MPI_Iallgather(
                        place,
                        0,
                        dt,
                        p,
                        n,
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::ReduceScatterInPlace(r) => {
                need(1)?;
                let place = in_place()?;
                let n = blocks("ireduce_scatter", bufs[0].len(), size)?;
                let op = op(r, dtype)?;
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds size·n elements of `dt` (checked by `blocks`),
                // the input and (at its start) the result; kept untouched by `Pending` until
                // completion; `place` is MPI_IN_PLACE.
                unsafe {
                    rc(ffi::MPI_Ireduce_scatter_block(
                        place,
                        p,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::AllToAll => {
                need(2)?;
                same(
                    "iall_to_all",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                if !bufs[0].len().is_multiple_of(size) {
                    return Err(RawError::msg(
                        "internal: all_to_all length not divisible".into(),
                    ));
                }
                let n = count(bufs[0].len() / size)?;
                count(bufs[0].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: both hold size·n elements; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Ialltoall(
                        s,
                        n,
                        dt,
                        d,
                        n,
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::Barrier => {
                need(0)?;
                // SAFETY: valid communicator and out pointer.
                unsafe { rc(ffi::MPI_Ibarrier(self.raw, req.as_mut_ptr()))? };
            }
            Immediate::Send(peer, tag) => {
                need(1)?;
                let (n, p, t) = (
                    count(bufs[0].len())?,
                    int("peer", peer)?,
                    int("tag", tag as usize)?,
                );
                let s = cptr(&bufs[0].as_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Isend(s, n, dt, p, t, self.raw, req.as_mut_ptr()))? };
            }
            Immediate::Recv(peer, tag) => {
                need(1)?;
                let (n, p, t) = (
                    count(bufs[0].len())?,
                    int("peer", peer)?,
                    int("tag", tag as usize)?,
                );
                let d = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Irecv(d, n, dt, p, t, self.raw, req.as_mut_ptr()))? };
            }
            Immediate::AllToAllV {
                send_counts,
                recv_counts,
            } => {
                const W: &str = "iall_to_all_v";
                need(2)?;
                same(W, (bufs[0].dtype(), 0), (bufs[1].dtype(), 0))?;
                let (sc, sd) = layout(W, &send_counts, bufs[0].len(), size)?;
                let (rc_, rd) = layout(W, &recv_counts, bufs[1].len(), size)?;
                let (s, d) = two(&mut bufs);
                // SAFETY: `layout` checked that the blocks of each array pair tile exactly
                // their buffer; the buffers move into the returned `Pending`, and the arrays
                // (heap memory, not moved by pushing their `Vec` headers) into its `ints`,
                // which keeps all of them untouched until completion.
                unsafe {
                    rc(ffi::MPI_Ialltoallv(
                        s,
                        sc.as_ptr(),
                        sd.as_ptr(),
                        dt,
                        d,
                        rc_.as_ptr(),
                        rd.as_ptr(),
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
                ints.extend([sc, sd, rc_, rd]);
            }
            Immediate::AllGatherV { recv_counts } => {
                const W: &str = "iall_gather_v";
                need(2)?;
                same(W, (bufs[0].dtype(), 0), (bufs[1].dtype(), 0))?;
                let (c, d) = layout(W, &recv_counts, bufs[1].len(), size)?;
                same_len(W, bufs[0].len(), recv_counts[self.rank])?;
                let n = count(bufs[0].len())?;
                let (s, r) = two(&mut bufs);
                // SAFETY: send holds n elements, recv is tiled by the blocks of `c`/`d`
                // (checked); buffers and arrays kept alive by `Pending` until completion.
                unsafe {
                    rc(ffi::MPI_Iallgatherv(
                        s,
                        n,
                        dt,
                        r,
                        c.as_ptr(),
                        d.as_ptr(),
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
                ints.extend([c, d]);
            }
            Immediate::ReduceScatterV { counts, op: r } => {
                const W: &str = "ireduce_scatter_v";
                need(2)?;
                same(W, (bufs[0].dtype(), 0), (bufs[1].dtype(), 0))?;
                let (c, _) = layout(W, &counts, bufs[0].len(), size)?;
                same_len(W, bufs[1].len(), counts[self.rank])?;
                let op = op(r, dtype)?;
                let (s, d) = two(&mut bufs);
                // SAFETY: send holds sum(counts), recv counts[rank] elements (checked); kept
                // alive by `Pending` with the counts array.
                unsafe {
                    rc(ffi::MPI_Ireduce_scatter(
                        s,
                        d,
                        c.as_ptr(),
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
                ints.push(c);
            }
            Immediate::Reduce { op: r, root } => {
                const W: &str = "ireduce";
                let at_root = self.rooted(W, bufs.len(), root)?;
                if at_root {
                    same(
                        W,
                        (bufs[0].dtype(), bufs[0].len()),
                        (bufs[1].dtype(), bufs[1].len()),
                    )?;
                }
                let (n, op, root) = (count(bufs[0].len())?, op(r, dtype)?, int("root", root)?);
                let (s, d) = if at_root {
                    two(&mut bufs)
                } else {
                    (cptr(&bufs[0].as_slice()), std::ptr::null_mut())
                };
                // SAFETY: send (and on the root recv) hold n elements of `dt`; off the root the
                // receive buffer is not significant (null, never dereferenced). Kept alive by
                // `Pending`.
                unsafe {
                    rc(ffi::MPI_Ireduce(
                        s,
                        d,
                        n,
                        dt,
                        op,
                        root,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::Gather { root } => {
                const W: &str = "igather";
                let at_root = self.rooted(W, bufs.len(), root)?;
                // The root's layout, checked on every rank (see `Comm::gather`).
                let (c, d) = equal_layout(W, bufs[0].len(), size)?;
                let (c, d) = if at_root {
                    same(W, (bufs[0].dtype(), 0), (bufs[1].dtype(), 0))?;
                    same_len(W, bufs[1].len(), bufs[0].len() * size)?;
                    (c, d)
                } else {
                    (Vec::new(), Vec::new())
                };
                let (n, root) = (count(bufs[0].len())?, int("root", root)?);
                let (s, r) = if at_root {
                    two(&mut bufs)
                } else {
                    (cptr(&bufs[0].as_slice()), std::ptr::null_mut())
                };
                let (cp, dp) = root_arrays(&c, &d);
                // SAFETY: send holds n elements; on the root recv is tiled by the `size` blocks
                // of `c`/`d` (checked); off the root the receive arguments are not significant
                // (null). Buffers and arrays kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Igatherv(
                        s,
                        n,
                        dt,
                        r,
                        cp,
                        dp,
                        dt,
                        root,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
                ints.extend([c, d]);
            }
            Immediate::Scatter { root } => {
                const W: &str = "iscatter";
                let at_root = self.rooted(W, bufs.len(), root)?;
                // The root's layout, checked on every rank (see `Comm::gather`).
                let (c, d) = equal_layout(W, bufs[0].len(), size)?;
                let (c, d) = if at_root {
                    same(W, (bufs[0].dtype(), 0), (bufs[1].dtype(), 0))?;
                    same_len(W, bufs[1].len(), bufs[0].len() * size)?;
                    (c, d)
                } else {
                    (Vec::new(), Vec::new())
                };
                let (n, root) = (count(bufs[0].len())?, int("root", root)?);
                let (r, s) = if at_root {
                    let (a, b) = bufs.split_at_mut(1);
                    (mptr(&mut a[0].as_mut_slice()), cptr(&b[0].as_slice()))
                } else {
                    (mptr(&mut bufs[0].as_mut_slice()), std::ptr::null())
                };
                let (cp, dp) = root_arrays(&c, &d);
                // SAFETY: recv holds n elements; on the root send is tiled by the `size` blocks
                // of `c`/`d` (checked); off the root the send arguments are not significant
                // (null). Buffers and arrays kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Iscatterv(
                        s,
                        cp,
                        dp,
                        dt,
                        r,
                        n,
                        dt,
                        root,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
                ints.extend([c, d]);
            }
        }
        Ok(Pending {
            // SAFETY: every branch above returned early unless the MPI call succeeded and
            // wrote the request.
            req: unsafe { req.assume_init() },
            done: false,
            bufs,
            ints,
            received: None,
            is_recv,
            dtype,
        })
    }
}

impl Comm {
    /// For a rooted nonblocking operation: whether this rank is the root, after checking that
    /// it holds the root's buffer (2 buffers) exactly when it is (1 buffer elsewhere).
    fn rooted(&self, what: &str, bufs: usize, root: usize) -> R<bool> {
        if root >= self.size {
            return Err(RawError::msg(format!(
                "internal: {what}: root {root} outside 0..{}",
                self.size
            )));
        }
        let at_root = self.rank == root;
        if bufs != if at_root { 2 } else { 1 } {
            return Err(RawError::msg(format!(
                "internal: {what}: {bufs} buffers on rank {} (root {root})",
                self.rank
            )));
        }
        Ok(at_root)
    }
}

/// Pointers of an input and an output buffer (distinct `Vec`s, so no aliasing).
fn two(bufs: &mut [HostBuffer]) -> (*const c_void, *mut c_void) {
    let (a, b) = bufs.split_at_mut(1);
    (cptr(&a[0].as_slice()), mptr(&mut b[0].as_mut_slice()))
}

impl Pending {
    fn complete(&mut self, status: &ffi::MPI_Status) -> R<()> {
        self.done = true;
        if self.is_recv {
            let mut got: c_int = 0;
            // SAFETY: `status` was filled by the completed MPI_Wait/MPI_Test.
            unsafe { rc(ffi::MPI_Get_count(status, datatype(self.dtype), &mut got))? };
            self.received = usize::try_from(got).ok();
        }
        Ok(())
    }

    /// Non-blocking completion test (`MPI_Test`).
    pub(crate) fn test(&mut self) -> R<bool> {
        if self.done {
            return Ok(true);
        }
        if finalized() {
            return Err(RawError::msg(
                "MPI was finalized while the operation was pending".into(),
            ));
        }
        let mut flag: c_int = 0;
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
        // SAFETY: `req` is an active request owned by this value; out pointers are valid.
        unsafe { rc(ffi::MPI_Test(&mut self.req, &mut flag, status.as_mut_ptr()))? };
        if flag != 0 {
            // SAFETY: zero-initialised and written by MPI_Test on completion.
            let status = unsafe { status.assume_init() };
            self.complete(&status)?;
        }
        Ok(self.done)
    }

    /// Completes the operation under `limit` (measured from this call; `None`: no limit) and
    /// `abort`, and hands the buffers back. When the limit passes or the communicator is
    /// aborted first, a receive is cancelled (its buffer is then freed normally); any other
    /// operation, which MPI cannot cancel, is **abandoned**: its request and buffers are leaked
    /// (never freed, so MPI may still write them safely), and the reason is returned.
    pub(crate) fn wait_within(
        mut self,
        limit: Option<Duration>,
        abort: &AtomicBool,
    ) -> R<Result<Completed, Stop>> {
        if !self.done {
            if finalized() {
                return Err(RawError::msg(
                    "MPI was finalized while the operation was pending".into(),
                ));
            }
            let mut st = [status()];
            let waited = wait_all(std::slice::from_mut(&mut self.req), &mut st, limit, abort);
            match waited {
                Ok(Ok(())) => self.complete(&st[0])?,
                Ok(Err(why)) => {
                    if self.is_recv {
                        let req = std::slice::from_mut(&mut self.req);
                        match cancel_all(req, &mut st, Duration::from_secs(1))?[0] {
                            Some(true) => {
                                self.done = true;
                                return Ok(Err(why));
                            }
                            Some(false) => {
                                // Completed normally just before the cancel.
                                self.complete(&st[0])?;
                                return Ok(Ok((std::mem::take(&mut self.bufs), self.received)));
                            }
                            None => {}
                        }
                    }
                    self.abandon();
                    return Ok(Err(why));
                }
                Err(e) => {
                    // A failed test completes (frees) the request.
                    self.done = true;
                    return Err(e);
                }
            }
        }
        Ok(Ok((std::mem::take(&mut self.bufs), self.received)))
    }

    /// Leaves the operation to MPI: the buffers are leaked, never freed, since MPI may still
    /// read or write them; the request is never tested again.
    fn abandon(&mut self) {
        std::mem::forget(std::mem::take(&mut self.bufs));
        std::mem::forget(std::mem::take(&mut self.ints));
        self.done = true;
    }
}

impl Drop for Pending {
    /// A work dropped before it completed does not wait: one last test; a receive still
    /// active is cancelled; any other operation still active is abandoned (its buffers leaked,
    /// since MPI may still use them) and MPI finishes it on its own.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if finalized() {
            self.abandon();
            return;
        }
        if matches!(self.test(), Ok(true)) {
            return;
        }
        if self.is_recv {
            // A receive left posted would take a later message meant for another receive:
            // cancel it (its buffer is then free).
            let mut st = [status()];
            let req = std::slice::from_mut(&mut self.req);
            if matches!(
                cancel_all(req, &mut st, Duration::from_secs(1)).as_deref(),
                Ok([Some(_)])
            ) {
                self.done = true;
                return;
            }
        }
        self.abandon();
    }
}
