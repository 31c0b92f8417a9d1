//! Owned communicator handles and the blocking calls on borrowed host memory: point to point,
//! batches of it, collectives, splits and group creation, abort.

use super::wait::{cancel_all, null_request, status, statuses, wait_all, Stop};
use super::{
    count, cptr, datatype, equal_layout, finalized, in_place, int, layout, mptr, op, rc, same,
    RawError, Reduce, R,
};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// How long a cancelled request may take to complete before it counts as not cancellable.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

use grid_core::{HostSlice, HostSliceMut};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

/// An owned MPI communicator handle (never a predefined one), freed on drop.
#[derive(Debug)]
pub(crate) struct Comm {
    pub(super) raw: ffi::MPI_Comm,
    /// `MPI_Comm_size`, cached: it never changes and is needed for every length check.
    pub(super) size: usize,
    /// `MPI_Comm_rank`, cached for the same reason (rooted and vector collectives).
    pub(super) rank: usize,
}

// SAFETY: an `MPI_Comm` is a handle (a pointer to an opaque object under Open MPI, an int under
// MPICH). With MPI_THREAD_MULTIPLE, which `MpiRuntime::init` requires, MPI functions may be
// called with the same handle from any thread, concurrently; the handle itself is never
// mutated after creation except by `Drop`, which has exclusive access.
unsafe impl Send for Comm {}
// SAFETY: see `Send`; shared access only passes the handle by value to thread-safe MPI calls.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if finalized() {
            return; // MPI_Finalize released every communicator; no MPI call is allowed now
        }
        // SAFETY: `self.raw` is a valid communicator created by this module and owned by this
        // value alone (never a predefined communicator); nothing uses it after drop.
        // Errors cannot be reported from drop; MPI_ERRORS_RETURN makes them non-fatal.
        unsafe { ffi::MPI_Comm_free(&mut self.raw) };
    }
}

impl Comm {
    /// A duplicate of `MPI_COMM_WORLD` with `MPI_ERRORS_RETURN` installed on both.
    pub(crate) fn world_dup() -> R<Comm> {
        // SAFETY: MPI is initialised (the caller is `MpiRuntime::init`); the predefined world
        // handle and error handler are valid statics.
        unsafe {
            rc(ffi::MPI_Comm_set_errhandler(
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_ERRORS_RETURN,
            ))?;
            rc(ffi::MPI_Comm_set_errhandler(
                ffi::RSMPI_COMM_SELF,
                ffi::RSMPI_ERRORS_RETURN,
            ))?;
        }
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `out` is a valid out pointer; MPI_Comm_dup writes it on success. The
        // duplicate inherits the error handler of its parent.
        unsafe {
            rc(ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, out.as_mut_ptr()))?;
            Comm::owned(out.assume_init())
        }
    }

    fn adopt(raw: ffi::MPI_Comm) -> R<Option<Comm>> {
        // SAFETY: comparing a handle with the predefined null handle reads a static.
        if raw == unsafe { ffi::RSMPI_COMM_NULL } {
            return Ok(None);
        }
        let c = Comm::owned(raw)?;
        // SAFETY: `c.raw` is a valid new communicator; children inherit the error handler, this
        // sets it explicitly in case an implementation does not.
        unsafe {
            rc(ffi::MPI_Comm_set_errhandler(
                c.raw,
                ffi::RSMPI_ERRORS_RETURN,
            ))?
        };
        Ok(Some(c))
    }

    /// `MPI_Comm_split`; `color = None` passes `MPI_UNDEFINED` and gets `None`.
    pub(crate) fn split(&self, color: Option<usize>, key: usize) -> R<Option<Comm>> {
        let color = match color {
            // SAFETY: reading the MPI_UNDEFINED constant.
            None => unsafe { ffi::RSMPI_UNDEFINED },
            Some(c) => int("colour", c)?,
        };
        let key = int("key", key)?;
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is a valid communicator, `out` a valid out pointer written by
        // MPI_Comm_split on success (MPI_COMM_NULL for MPI_UNDEFINED).
        let raw = unsafe {
            rc(ffi::MPI_Comm_split(self.raw, color, key, out.as_mut_ptr()))?;
            out.assume_init()
        };
        Comm::adopt(raw)
    }

    /// `MPI_Comm_create` over this communicator for the group of `ranks` (ranks of this
    /// communicator, in the order they get in the new one). Collective over this communicator.
    pub(crate) fn create(&self, ranks: &[usize]) -> R<Option<Comm>> {
        let raw = self.with_group(ranks, |group, out| {
            // SAFETY: valid communicator and group (from `with_group`), valid out pointer.
            rc(unsafe { ffi::MPI_Comm_create(self.raw, group, out) })
        })?;
        Comm::adopt(raw)
    }

    /// `MPI_Comm_create_group` over this communicator for the group of `ranks` (ranks of this
    /// communicator, in the order they get in the new one) with `tag`: collective over the
    /// members of the group only (MPI 3.0). This rank must be one of `ranks`.
    pub(crate) fn create_group(&self, ranks: &[usize], tag: i32) -> R<Comm> {
        let raw = self.with_group(ranks, |group, out| {
            // SAFETY: valid communicator and group (from `with_group`), valid out pointer.
            // Only the group's members call MPI_Comm_create_group (the caller's contract).
            rc(unsafe { ffi::MPI_Comm_create_group(self.raw, group, tag, out) })
        })?;
        Comm::adopt(raw)?.ok_or_else(|| {
            RawError::msg("MPI_Comm_create_group gave MPI_COMM_NULL to a member".into())
        })
    }

    /// Builds the MPI group of `ranks` (ranks of this communicator, checked) and hands it to
    /// `create` with an out pointer for the new communicator; frees both groups whatever
    /// happens and returns the handle `create` wrote.
    fn with_group(
        &self,
        ranks: &[usize],
        create: impl FnOnce(ffi::MPI_Group, *mut ffi::MPI_Comm) -> R<()>,
    ) -> R<ffi::MPI_Comm> {
        let size = self.size()?;
        let list = ranks
            .iter()
            .map(|&r| {
                if r < size {
                    int("rank", r)
                } else {
                    Err(RawError::msg(format!(
                        "internal: rank {r} outside 0..{size}"
                    )))
                }
            })
            .collect::<R<Vec<c_int>>>()?;
        let n = count(list.len())?;
        let mut parent = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: valid communicator; out pointers valid; `list` holds `n` valid ranks of the
        // parent group (checked above). Both groups are freed before returning; `out` is read
        // only after `create` succeeded, which means MPI wrote it.
        unsafe {
            rc(ffi::MPI_Comm_group(self.raw, parent.as_mut_ptr()))?;
            let mut parent = parent.assume_init();
            let r = rc(ffi::MPI_Group_incl(
                parent,
                n,
                list.as_ptr(),
                group.as_mut_ptr(),
            ));
            if let Err(e) = r {
                ffi::MPI_Group_free(&mut parent);
                return Err(e);
            }
            let mut group = group.assume_init();
            let r = create(group, out.as_mut_ptr());
            ffi::MPI_Group_free(&mut group);
            ffi::MPI_Group_free(&mut parent);
            r?;
            Ok(out.assume_init())
        }
    }

    pub(crate) fn rank(&self) -> R<usize> {
        let mut r: c_int = 0;
        // SAFETY: valid communicator and out pointer.
        unsafe { rc(ffi::MPI_Comm_rank(self.raw, &mut r))? };
        usize::try_from(r).map_err(|_| RawError::msg(format!("MPI returned rank {r}")))
    }

    /// Takes ownership of a valid, non-null communicator handle (freed on drop).
    fn owned(raw: ffi::MPI_Comm) -> R<Comm> {
        let mut c = Comm {
            raw,
            size: 0,
            rank: 0,
        };
        let mut s: c_int = 0;
        // SAFETY: `raw` is a valid communicator (the caller created it); `s` a valid out pointer.
        // If this fails, `c` is dropped and frees the handle.
        unsafe { rc(ffi::MPI_Comm_size(c.raw, &mut s))? };
        c.size = usize::try_from(s).map_err(|_| RawError::msg(format!("MPI returned size {s}")))?;
        c.rank = c.rank()?;
        Ok(c)
    }

    #[inline]
    pub(crate) fn size(&self) -> R<usize> {
        Ok(self.size)
    }

    /// The `MPI_COMM_WORLD` rank of every member, in this communicator's rank order.
    pub(crate) fn world_ranks(&self) -> R<Vec<usize>> {
        let n = self.size()?;
        let ranks: Vec<c_int> = (0..n).map(|r| int("rank", r)).collect::<R<_>>()?;
        let mut out: Vec<c_int> = vec![0; n];
        let mut mine = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut world = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        // SAFETY: valid communicators and out pointers; `ranks` and `out` both hold `n`
        // entries, the count passed. Both groups are freed before returning.
        unsafe {
            rc(ffi::MPI_Comm_group(self.raw, mine.as_mut_ptr()))?;
            let mut mine = mine.assume_init();
            let r = rc(ffi::MPI_Comm_group(
                ffi::RSMPI_COMM_WORLD,
                world.as_mut_ptr(),
            ));
            if let Err(e) = r {
                ffi::MPI_Group_free(&mut mine);
                return Err(e);
            }
            let mut world = world.assume_init();
            let r = rc(ffi::MPI_Group_translate_ranks(
                mine,
                count(n)?,
                ranks.as_ptr(),
                world,
                out.as_mut_ptr(),
            ));
            ffi::MPI_Group_free(&mut world);
            ffi::MPI_Group_free(&mut mine);
            r?;
        }
        out.into_iter()
            .map(|r| usize::try_from(r).map_err(|_| RawError::msg(format!("no world rank ({r})"))))
            .collect()
    }

    // --------------------------------------------------------------------------------------
    // Blocking operations on borrowed host memory
    // --------------------------------------------------------------------------------------

    #[inline]
    pub(crate) fn all_reduce(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        r: Reduce,
    ) -> R<()> {
        same(
            "all_reduce",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
        )?;
        let (n, dt, op) = (
            count(send.len())?,
            datatype(send.dtype()),
            op(r, send.dtype())?,
        );
        // SAFETY: both buffers hold `n` elements of the datatype passed (checked above) and
        // stay borrowed for the whole blocking call.
        unsafe {
            rc(ffi::MPI_Allreduce(
                cptr(&send),
                mptr(&mut recv),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    /// One step of a ring (`MPI_Sendrecv`): `send` to rank `to` while receiving
    /// `recv.len()` elements from rank `from` (the lengths may differ; the dtypes may not),
    /// both with `tag`. The two buffers are distinct borrows.
    pub(crate) fn sendrecv(
        &self,
        send: HostSlice<'_>,
        to: usize,
        mut recv: HostSliceMut<'_>,
        from: usize,
        tag: i32,
    ) -> R<()> {
        same("sendrecv", (send.dtype(), 0), (recv.dtype(), 0))?;
        let (ns, nr, dt) = (
            count(send.len())?,
            count(recv.len())?,
            datatype(send.dtype()),
        );
        let (to, from) = (int("peer", to)?, int("peer", from)?);
        // SAFETY: `send` holds `ns` elements of `dt` (readable, shared borrow) and `recv` holds
        // `nr` elements of `dt` (writable, unique borrow, so it cannot overlap `send`); both
        // stay borrowed for the whole blocking call.
        unsafe { self.sendrecv_raw((cptr(&send), ns, to), (mptr(&mut recv), nr, from), dt, tag) }
    }

    /// The one `MPI_Sendrecv` call of [`Comm::sendrecv`] and [`Comm::sendrecv_within`]:
    /// `(pointer, count, peer)` of the send and of the receive, both of `dt`, both with `tag`.
    /// A message longer than the receive's count is an MPI error (`MPI_ERR_TRUNCATE`), not a
    /// write past it; the status is ignored.
    ///
    /// # Safety
    ///
    /// `send.0` points to `send.1` readable elements of `dt` and `recv.0` to `recv.1` writable
    /// ones, the two ranges do not overlap, and both stay valid and unused by anything else
    /// until this blocking call returns.
    unsafe fn sendrecv_raw(
        &self,
        send: (*const c_void, c_int, c_int),
        recv: (*mut c_void, c_int, c_int),
        dt: ffi::MPI_Datatype,
        tag: i32,
    ) -> R<()> {
        // SAFETY: the caller's contract (above) covers both buffers; `self.raw` is a live
        // communicator for as long as `self` exists.
        unsafe {
            rc(ffi::MPI_Sendrecv(
                send.0,
                send.1,
                dt,
                send.2,
                tag,
                recv.0,
                recv.1,
                dt,
                recv.2,
                tag,
                self.raw,
                ffi::RSMPI_STATUS_IGNORE,
            ))
        }
    }

    /// [`Comm::sendrecv`] between two blocks of one buffer, each `(offset, length, peer)`:
    /// the send block goes to its peer while the receive block comes from its peer. The blocks
    /// must lie inside `buf` and not overlap (checked).
    pub(crate) fn sendrecv_within(
        &self,
        mut buf: HostSliceMut<'_>,
        (send_at, send_len, to): (usize, usize, usize),
        (recv_at, recv_len, from): (usize, usize, usize),
        tag: i32,
    ) -> R<()> {
        let total = buf.len();
        let inside = |at: usize, len: usize| at.checked_add(len).is_some_and(|end| end <= total);
        if !inside(send_at, send_len) || !inside(recv_at, recv_len) {
            return Err(RawError::msg(format!(
                "sendrecv_within: blocks {send_at}+{send_len} and {recv_at}+{recv_len} do not lie inside a buffer of {total} elements"
            )));
        }
        let overlap = send_len > 0
            && recv_len > 0
            && send_at < recv_at + recv_len
            && recv_at < send_at + send_len;
        if overlap {
            return Err(RawError::msg(format!(
                "sendrecv_within: blocks {send_at}+{send_len} and {recv_at}+{recv_len} overlap"
            )));
        }
        let (ns, nr, dt) = (count(send_len)?, count(recv_len)?, datatype(buf.dtype()));
        let (to, from) = (int("peer", to)?, int("peer", from)?);
        let width = buf.dtype().size_bytes();
        let base = mptr(&mut buf).cast::<u8>();
        // Only formed here (wrapping_add: no unsafe); dereferenced by MPI inside `buf`.
        let (sp, rp) = (
            base.wrapping_add(send_at * width),
            base.wrapping_add(recv_at * width),
        );
        // SAFETY: both blocks lie inside `buf` (checked: `at + len <= total`, so the byte
        // ranges `at · width .. (at + len) · width` are inside its allocation) and do not
        // overlap (checked), so MPI reads `ns` elements of `dt` at `sp` and writes at most `nr`
        // at `rp` without touching the same bytes; `buf` is uniquely borrowed for the whole
        // blocking call.
        unsafe {
            self.sendrecv_raw(
                (sp.cast_const().cast(), ns, to),
                (rp.cast(), nr, from),
                dt,
                tag,
            )
        }
    }

    /// `MPI_Allreduce(MPI_IN_PLACE, buf, ...)`: the result replaces `buf`, with no copy.
    #[inline]
    pub(crate) fn all_reduce_in_place(&self, mut buf: HostSliceMut<'_>, r: Reduce) -> R<()> {
        let place = in_place()?;
        let (n, dt, op) = (
            count(buf.len())?,
            datatype(buf.dtype()),
            op(r, buf.dtype())?,
        );
        // SAFETY: `buf` holds `n` elements of the datatype passed and stays exclusively
        // borrowed for the whole blocking call; `place` is this library's MPI_IN_PLACE, which
        // MPI never dereferences.
        unsafe {
            rc(ffi::MPI_Allreduce(
                place,
                mptr(&mut buf),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn broadcast(&self, mut buf: HostSliceMut<'_>, root: usize) -> R<()> {
        let (n, dt, root) = (count(buf.len())?, datatype(buf.dtype()), int("root", root)?);
        // SAFETY: `buf` holds `n` elements of `dt` and stays borrowed for the call.
        unsafe { rc(ffi::MPI_Bcast(mptr(&mut buf), n, dt, root, self.raw)) }
    }

    #[inline]
    pub(crate) fn all_gather(&self, send: HostSlice<'_>, mut recv: HostSliceMut<'_>) -> R<()> {
        let size = self.size()?;
        same(
            "all_gather",
            (send.dtype(), send.len() * size),
            (recv.dtype(), recv.len()),
        )?;
        let (n, dt) = (count(send.len())?, datatype(send.dtype()));
        count(recv.len())?;
        // SAFETY: `send` holds n elements and `recv` size·n elements of `dt` (checked above),
        // which is what MPI_Allgather reads and writes; both borrowed for the call.
        unsafe {
            rc(ffi::MPI_Allgather(
                cptr(&send),
                n,
                dt,
                mptr(&mut recv),
                n,
                dt,
                self.raw,
            ))
        }
    }

    /// `MPI_Allgather(MPI_IN_PLACE, ...)` on `buf` of `size · n` elements: this rank's block
    /// is read from `buf` at `rank · n` and every block is written around it, with no copy.
    #[inline]
    pub(crate) fn all_gather_in_place(&self, mut buf: HostSliceMut<'_>) -> R<()> {
        let place = in_place()?;
        let n = blocks("all_gather", buf.len(), self.size)?;
        let dt = datatype(buf.dtype());
        // SAFETY: `buf` holds size·n elements of `dt` (checked by `blocks`), which is what
        // MPI_Allgather writes (and reads this rank's block of) with MPI_IN_PLACE, and stays
        // exclusively borrowed for the whole blocking call; `place` is this library's
        // MPI_IN_PLACE, which MPI never dereferences (the send count and type are ignored).
        unsafe {
            rc(ffi::MPI_Allgather(
                place,
                0,
                dt,
                mptr(&mut buf),
                n,
                dt,
                self.raw,
            ))
        }
    }

    /// `MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, n, ...)` on `buf` of `size · n` input
    /// elements. MPI leaves this rank's reduced block at the **start** of `buf` (elements
    /// `0..n`), not at `rank · n`; the caller moves it. The rest of `buf` is left as MPI left it.
    #[inline]
    pub(crate) fn reduce_scatter_in_place(&self, mut buf: HostSliceMut<'_>, r: Reduce) -> R<()> {
        let place = in_place()?;
        let n = blocks("reduce_scatter", buf.len(), self.size)?;
        let (dt, op) = (datatype(buf.dtype()), op(r, buf.dtype())?);
        // SAFETY: `buf` holds size·n elements of `dt` (checked by `blocks`): the input MPI reads
        // with MPI_IN_PLACE and the n-element result it writes at its start; exclusively
        // borrowed for the whole blocking call; `place` is MPI_IN_PLACE, never dereferenced.
        unsafe {
            rc(ffi::MPI_Reduce_scatter_block(
                place,
                mptr(&mut buf),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn reduce_scatter(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        r: Reduce,
    ) -> R<()> {
        let size = self.size()?;
        same(
            "reduce_scatter",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len() * size),
        )?;
        let (n, dt, op) = (
            count(recv.len())?,
            datatype(recv.dtype()),
            op(r, recv.dtype())?,
        );
        count(send.len())?;
        // SAFETY: `send` holds size·n and `recv` n elements of `dt` (checked above).
        unsafe {
            rc(ffi::MPI_Reduce_scatter_block(
                cptr(&send),
                mptr(&mut recv),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn all_to_all(&self, send: HostSlice<'_>, mut recv: HostSliceMut<'_>) -> R<()> {
        let size = self.size()?.max(1);
        same(
            "all_to_all",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
        )?;
        if !send.len().is_multiple_of(size) {
            return Err(RawError::msg(format!(
                "internal: all_to_all of {} elements over {size}",
                send.len()
            )));
        }
        let (n, dt) = (count(send.len() / size)?, datatype(send.dtype()));
        count(send.len())?;
        // SAFETY: both buffers hold size·n elements of `dt` (checked above).
        unsafe {
            rc(ffi::MPI_Alltoall(
                cptr(&send),
                n,
                dt,
                mptr(&mut recv),
                n,
                dt,
                self.raw,
            ))
        }
    }

    /// `MPI_Alltoallv`: `send_counts[j]` elements of `send` (contiguous, in rank order) go to
    /// rank j; `recv_counts[j]` elements from rank j land in `recv`, in rank order.
    pub(crate) fn all_to_all_v(
        &self,
        send: HostSlice<'_>,
        send_counts: &[usize],
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
    ) -> R<()> {
        const W: &str = "all_to_all_v";
        same(W, (send.dtype(), 0), (recv.dtype(), 0))?;
        let (sc, sd) = layout(W, send_counts, send.len(), self.size)?;
        let (rc_, rd) = layout(W, recv_counts, recv.len(), self.size)?;
        let dt = datatype(send.dtype());
        // SAFETY: `layout` checked that each count array has `size` entries and that the blocks
        // it describes (counts at the displacements) tile exactly the `len` elements of each
        // buffer; both buffers and the four arrays stay borrowed for the whole blocking call.
        unsafe {
            rc(ffi::MPI_Alltoallv(
                cptr(&send),
                sc.as_ptr(),
                sd.as_ptr(),
                dt,
                mptr(&mut recv),
                rc_.as_ptr(),
                rd.as_ptr(),
                dt,
                self.raw,
            ))
        }
    }

    /// `MPI_Allgatherv`: rank j contributes `recv_counts[j]` elements (this rank: `send`);
    /// `recv` holds every contribution in rank order.
    pub(crate) fn all_gather_v(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
    ) -> R<()> {
        const W: &str = "all_gather_v";
        same(W, (send.dtype(), 0), (recv.dtype(), 0))?;
        let (c, d) = layout(W, recv_counts, recv.len(), self.size)?;
        same_len(W, send.len(), recv_counts[self.rank])?;
        let (n, dt) = (count(send.len())?, datatype(send.dtype()));
        // SAFETY: `send` holds n elements; `recv` is tiled exactly by the blocks of `c`/`d`
        // (checked by `layout`); all borrowed for the blocking call.
        unsafe {
            rc(ffi::MPI_Allgatherv(
                cptr(&send),
                n,
                dt,
                mptr(&mut recv),
                c.as_ptr(),
                d.as_ptr(),
                dt,
                self.raw,
            ))
        }
    }

    /// `MPI_Reduce_scatter`: `send` holds `size` blocks, block j has `counts[j]` elements;
    /// this rank receives the reduction of its block (`recv.len() == counts[rank]`).
    pub(crate) fn reduce_scatter_v(
        &self,
        send: HostSlice<'_>,
        counts: &[usize],
        mut recv: HostSliceMut<'_>,
        r: Reduce,
    ) -> R<()> {
        const W: &str = "reduce_scatter_v";
        same(W, (send.dtype(), 0), (recv.dtype(), 0))?;
        let (c, _) = layout(W, counts, send.len(), self.size)?;
        same_len(W, recv.len(), counts[self.rank])?;
        let (dt, op) = (datatype(send.dtype()), op(r, send.dtype())?);
        // SAFETY: `send` holds sum(counts) elements, `recv` counts[rank] (checked above), which
        // is what MPI_Reduce_scatter reads and writes; all borrowed for the blocking call.
        unsafe {
            rc(ffi::MPI_Reduce_scatter(
                cptr(&send),
                mptr(&mut recv),
                c.as_ptr(),
                dt,
                op,
                self.raw,
            ))
        }
    }

    /// `MPI_Reduce` to `root`: `recv` is `Some` exactly on the root (same length as `send`).
    pub(crate) fn reduce(
        &self,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        r: Reduce,
        root: usize,
    ) -> R<()> {
        const W: &str = "reduce";
        let mut recv = self.at_root(W, recv, root)?;
        if let Some(b) = &recv {
            same(W, (send.dtype(), send.len()), (b.dtype(), b.len()))?;
        }
        let (n, dt, op) = (
            count(send.len())?,
            datatype(send.dtype()),
            op(r, send.dtype())?,
        );
        let root = int("root", root)?;
        // A null receive buffer off the root, where MPI never touches it.
        let rp = recv.as_mut().map_or(std::ptr::null_mut(), mptr);
        // SAFETY: `send` (and on the root `recv`) hold n elements of `dt`; off the root the
        // receive buffer is not significant (MPI 3.1 §5.9.1) and never dereferenced.
        unsafe { rc(ffi::MPI_Reduce(cptr(&send), rp, n, dt, op, root, self.raw)) }
    }

    /// Gather to `root` (`recv` is `Some` exactly on the root, `size · send.len()` elements),
    /// run as `MPI_Gatherv` (see the `stage` module docs: every message then goes straight to
    /// the root, none is relayed through another rank).
    pub(crate) fn gather(
        &self,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        root: usize,
    ) -> R<()> {
        const W: &str = "gather";
        let mut recv = self.at_root(W, recv, root)?;
        let (n, dt) = (count(send.len())?, datatype(send.dtype()));
        // Every rank checks the root's layout (the same on every rank of a well-formed call),
        // so that a block too large for MPI's int displacements fails everywhere at once.
        let (c, d) = equal_layout(W, send.len(), self.size)?;
        if let Some(b) = &recv {
            same(W, (send.dtype(), 0), (b.dtype(), 0))?;
            same_len(W, b.len(), send.len() * self.size)?;
        }
        let (c, d) = if recv.is_some() {
            (c, d)
        } else {
            (Vec::new(), Vec::new())
        };
        let root = int("root", root)?;
        let rp = recv.as_mut().map_or(std::ptr::null_mut(), mptr);
        let (cp, dp) = root_arrays(&c, &d);
        // SAFETY: `send` holds n elements of `dt`; on the root `recv` is tiled exactly by the
        // `size` blocks of `c`/`d` (checked); off the root the receive arguments are not
        // significant (null) and never dereferenced. All borrowed for the blocking call.
        unsafe {
            rc(ffi::MPI_Gatherv(
                cptr(&send),
                n,
                dt,
                rp,
                cp,
                dp,
                dt,
                root,
                self.raw,
            ))
        }
    }

    /// Scatter from `root` (`send` is `Some` exactly on the root, `size · recv.len()`
    /// elements), run as `MPI_Scatterv` (no relays, as [`Comm::gather`]).
    pub(crate) fn scatter(
        &self,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        root: usize,
    ) -> R<()> {
        const W: &str = "scatter";
        let send = self.at_root(W, send, root)?;
        let (n, dt) = (count(recv.len())?, datatype(recv.dtype()));
        // Checked on every rank, as for `gather`.
        let (c, d) = equal_layout(W, recv.len(), self.size)?;
        if let Some(b) = &send {
            same(W, (recv.dtype(), 0), (b.dtype(), 0))?;
            same_len(W, b.len(), recv.len() * self.size)?;
        }
        let (c, d) = if send.is_some() {
            (c, d)
        } else {
            (Vec::new(), Vec::new())
        };
        let root = int("root", root)?;
        let sp = send.as_ref().map_or(std::ptr::null(), cptr);
        let (cp, dp) = root_arrays(&c, &d);
        // SAFETY: `recv` holds n elements of `dt`; on the root `send` is tiled exactly by the
        // `size` blocks of `c`/`d` (checked); off the root the send arguments are not
        // significant (null) and never dereferenced. All borrowed for the blocking call.
        unsafe {
            rc(ffi::MPI_Scatterv(
                sp,
                cp,
                dp,
                dt,
                mptr(&mut recv),
                n,
                dt,
                root,
                self.raw,
            ))
        }
    }

    /// Checks the "significant only at the root" buffer: `Some` on the root, `None` elsewhere.
    pub(super) fn at_root<B>(&self, what: &str, b: Option<B>, root: usize) -> R<Option<B>> {
        if root >= self.size {
            return Err(RawError::msg(format!(
                "internal: {what}: root {root} outside 0..{}",
                self.size
            )));
        }
        match (self.rank == root, b.is_some()) {
            (true, true) | (false, false) => Ok(b),
            (true, false) => Err(RawError::msg(format!(
                "internal: {what}: the root has no root buffer"
            ))),
            (false, true) => Ok(None), // not significant here: never handed to MPI
        }
    }

    #[inline]
    pub(crate) fn barrier(&self) -> R<()> {
        // SAFETY: valid communicator.
        unsafe { rc(ffi::MPI_Barrier(self.raw)) }
    }

    /// `MPI_Comm_dup`: a communicator with the same members whose messages and collectives
    /// never match this one's (the mismatch check's own channel). Collective.
    pub(crate) fn dup(&self) -> R<Comm> {
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is a valid communicator, `out` a valid out pointer written by
        // MPI_Comm_dup on success.
        let raw = unsafe {
            rc(ffi::MPI_Comm_dup(self.raw, out.as_mut_ptr()))?;
            out.assume_init()
        };
        Comm::adopt(raw)?.ok_or_else(|| RawError::msg("MPI_Comm_dup returned MPI_COMM_NULL".into()))
    }

    /// Sends `buf` (`MPI_Isend`, completed under `limit` and `abort`). Open MPI cannot cancel a
    /// send, so when the limit passes or the communicator is aborted with the send still
    /// active, this function does not return: it calls `stuck`, which ends the job.
    // `stuck` never returns (it ends the process): what follows its call is unreachable.
    #[allow(unreachable_code)]
    pub(crate) fn send_within(
        &self,
        buf: HostSlice<'_>,
        peer: usize,
        tag: u32,
        limit: Option<Duration>,
        abort: &AtomicBool,
        stuck: &dyn Fn(Stop) -> std::convert::Infallible,
    ) -> R<()> {
        let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
        let (peer, tag) = (int("peer", peer)?, int("tag", tag as usize)?);
        let mut req = [null_request()];
        // SAFETY: `buf` holds n elements of `dt` and stays borrowed until this function returns,
        // which is only after the request completed (or never: `stuck` ends the process).
        unsafe {
            rc(ffi::MPI_Isend(
                cptr(&buf),
                n,
                dt,
                peer,
                tag,
                self.raw,
                &mut req[0],
            ))?
        };
        let mut st = [status()];
        match wait_all(&mut req, &mut st, limit, abort)? {
            Ok(()) => Ok(()),
            Err(why) => match stuck(why) {},
        }
    }

    /// Receives into `buf` (`MPI_Irecv`, completed under `limit` and `abort`); returns the
    /// number of elements that arrived, or the reason the receive was cancelled. A receive
    /// that MPI could not cancel within a second (a message already arriving) calls `stuck`.
    // `stuck` never returns (it ends the process): what follows its call is unreachable.
    #[allow(unreachable_code)]
    pub(crate) fn recv_within(
        &self,
        mut buf: HostSliceMut<'_>,
        peer: usize,
        tag: u32,
        limit: Option<Duration>,
        abort: &AtomicBool,
        stuck: &dyn Fn(Stop) -> std::convert::Infallible,
    ) -> R<Result<usize, Stop>> {
        let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
        let (peer, tag) = (int("peer", peer)?, int("tag", tag as usize)?);
        let mut req = [null_request()];
        // SAFETY: `buf` holds n elements of `dt` (MPI writes at most n, else MPI_ERR_TRUNCATE)
        // and stays borrowed until this function returns, which is only after the request
        // completed or was cancelled (or never: `stuck` ends the process).
        unsafe {
            rc(ffi::MPI_Irecv(
                mptr(&mut buf),
                n,
                dt,
                peer,
                tag,
                self.raw,
                &mut req[0],
            ))?
        };
        let mut st = [status()];
        if let Err(why) = wait_all(&mut req, &mut st, limit, abort)? {
            match cancel_all(&mut req, &mut st, CANCEL_GRACE)?[0] {
                Some(true) => return Ok(Err(why)),
                Some(false) => {} // the message arrived before the cancel: a normal receive
                None => match stuck(why) {},
            }
        }
        let mut got: c_int = 0;
        // SAFETY: `st[0]` was written by the completing test.
        rc(unsafe { ffi::MPI_Get_count(&st[0], dt, &mut got) })?;
        usize::try_from(got)
            .map(Ok)
            .map_err(|_| RawError::msg(format!("MPI_Get_count returned {got}")))
    }

    /// Posts every send and receive, then completes all of them under `limit` and `abort`;
    /// returns the number of elements each receive got, in the order of `ops`.
    /// Borrowed buffers are safe because this function returns only once no request is active:
    /// when the limit passes or the communicator is aborted, the receives are cancelled, and if
    /// a send (which Open MPI cannot cancel) or a receive is still active, it calls `stuck`.
    // `stuck` never returns (it ends the process): what follows its call is unreachable.
    #[allow(unreachable_code)]
    pub(crate) fn batch_within(
        &self,
        ops: &mut [P2p<'_, '_>],
        limit: Option<Duration>,
        abort: &AtomicBool,
        stuck: &dyn Fn(Stop) -> std::convert::Infallible,
    ) -> R<Result<Vec<usize>, Stop>> {
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(ops.len());
        let mut first_err = None;
        for op in ops.iter_mut() {
            let mut req = null_request();
            let posted = match op {
                P2p::Send { buf, peer, tag } => (|| {
                    let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
                    let (p, t) = (int("peer", *peer)?, int("tag", *tag as usize)?);
                    // SAFETY: `buf` holds n elements of `dt` and is borrowed until this
                    // function returns, which is after no request is active any more.
                    unsafe { rc(ffi::MPI_Isend(cptr(buf), n, dt, p, t, self.raw, &mut req)) }
                })(),
                P2p::Recv { buf, peer, tag } => (|| {
                    let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
                    let (p, t) = (int("peer", *peer)?, int("tag", *tag as usize)?);
                    // SAFETY: as for sends; the receive buffer is exclusively borrowed.
                    unsafe { rc(ffi::MPI_Irecv(mptr(buf), n, dt, p, t, self.raw, &mut req)) }
                })(),
            };
            match posted {
                Ok(()) => reqs.push(req),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        let mut st = statuses(reqs.len());
        let why =
            match wait_all(&mut reqs, &mut st, limit, abort) {
                // Every posted request completed; a post that failed is reported now.
                Ok(Ok(())) => {
                    if let Some(e) = first_err {
                        return Err(e);
                    }
                    let mut got = Vec::new();
                    for (op, st) in ops.iter().zip(&st) {
                        if let P2p::Recv { buf, .. } = op {
                            let mut n: c_int = 0;
                            // SAFETY: `st` was written by the completing test.
                            rc(unsafe { ffi::MPI_Get_count(st, datatype(buf.dtype()), &mut n) })?;
                            got.push(usize::try_from(n).map_err(|_| {
                                RawError::msg(format!("MPI_Get_count returned {n}"))
                            })?);
                        }
                    }
                    return Ok(Ok(got));
                }
                Ok(Err(why)) => why,
                Err(e) => {
                    // A request failed: the others may still be active. Cancel what can be.
                    let left = cancel_all(&mut reqs, &mut st, CANCEL_GRACE)?;
                    if left.iter().any(Option::is_none) {
                        match stuck(Stop::Timeout) {}
                    }
                    return Err(first_err.unwrap_or(e));
                }
            };
        let left = cancel_all(&mut reqs, &mut st, CANCEL_GRACE)?;
        if left.iter().any(Option::is_none) {
            match stuck(why) {}
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(Err(why)),
        }
    }

    /// Terminates every process of the job (`MPI_Abort`); used by the test launcher after a
    /// rank failed, so that the other ranks do not wait for it forever.
    pub(crate) fn abort_world(code: i32) {
        if finalized() {
            return;
        }
        // SAFETY: MPI is initialised and not finalized (checked); aborting is always allowed.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
    }
}

/// An internal length check (the front end guarantees it; MPI would read or write out of
/// bounds otherwise).
pub(super) fn same_len(what: &str, got: usize, want: usize) -> R<()> {
    if got == want {
        Ok(())
    } else {
        Err(RawError::msg(format!(
            "internal: {what}: {got} elements where {want} are needed"
        )))
    }
}

/// The count and displacement arrays of a rooted vector call: their pointers on the root,
/// null elsewhere (not significant there).
pub(super) fn root_arrays(c: &[c_int], d: &[c_int]) -> (*const c_int, *const c_int) {
    if c.is_empty() {
        (std::ptr::null(), std::ptr::null())
    } else {
        (c.as_ptr(), d.as_ptr())
    }
}

/// One operation of [`Comm::batch_within`].
pub(crate) enum P2p<'s, 'b> {
    Send {
        buf: HostSlice<'b>,
        peer: usize,
        tag: u32,
    },
    Recv {
        buf: &'s mut HostSliceMut<'b>,
        peer: usize,
        tag: u32,
    },
}

/// The block count `n` (as MPI's `int`) of an in-place all-gather or reduce-scatter of `len`
/// elements over `size` ranks; an error unless `len` is `size · n` and fits MPI's counts.
pub(super) fn blocks(what: &str, len: usize, size: usize) -> R<c_int> {
    let size = size.max(1);
    if !len.is_multiple_of(size) {
        return Err(RawError::msg(format!(
            "internal: in-place {what} of {len} elements over {size} ranks"
        )));
    }
    count(len)?;
    count(len / size)
}
