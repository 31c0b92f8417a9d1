//! Large all-reduces and reduce-scatters as a ring of `MPI_Sendrecv` steps reduced by
//! grid-core's kernels, instead of `MPI_Allreduce` and `MPI_Reduce_scatter_block`.
//!
//! Why: Open MPI 4.1's `MPI_Allreduce` (and `MPI_Reduce_scatter_block`) allocates its
//! temporary buffer on every call. From 32 MiB on, glibc serves such an allocation with a
//! fresh `mmap` (its dynamic mmap threshold stops at 32 MiB), so every call page-faults the
//! whole buffer in and unmaps it again: at
//! 2 ranks an f32 sum of 32 MiB took 19–20 ms, and 7.5–8 ms with glibc told to keep large
//! blocks (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=…`, which a library cannot set for its
//! process). The ring keeps one scratch block per communicator across calls, moves
//! `2 (n - 1) / n` of the buffer per rank (recursive doubling at 2 ranks moves all of it) and
//! reduces `(n - 1) / n` of it. Measured figures are in docs/performance.md.
//!
//! The algorithm: the buffer is cut into `n` blocks ([`blocks`], sizes differing by at most
//! one element). Reduce-scatter: in step `s` (`0..n-1`) rank `r` sends block `r - s` to rank
//! `r + 1` and receives block `r - s - 1` from rank `r - 1` into the scratch block, which it
//! reduces into its own copy of that block; afterwards rank `r` holds the fully reduced block
//! `r + 1`. All-gather: in step `s` rank `r` sends block `r + 1 - s` and receives block `r - s`
//! straight into the buffer (all indices modulo `n`). Every block is reduced along the ring in
//! one order and then copied, so every rank ends with the same bits.
//!
//! The reduce-scatter ([`reduce_scatter`]) is the first half with the blocks shifted by one, so
//! that each rank ends with its own block; partial results travel through two scratch blocks
//! and the input is never written.
//!
//! Used, when the ranks do not copy straight between their memory (`crate::peer_read`, tried
//! first), for blocking calls of f32, f64, i32 and i64 (`Sum`, `Prod`, `Min`, `Max`, and `Avg` as
//! a sum divided afterwards, as around the MPI calls): all-reduces from [`RING_MIN_BYTES`] (of
//! the whole buffer), reduce-scatters from [`REDUCE_SCATTER_RING_MIN_BYTES`] (of the input, in
//! place or not), where the ring was as fast as `MPI_Reduce_scatter_block` or faster in the
//! runs measured; the nonblocking forms stay with MPI. The in-place reduce-scatter
//! ([`reduce_scatter_in_place`]) is the all-reduce's first half with the blocks shifted by
//! one: each rank ends with its own block where it lies (no copy to move it there, as after
//! `MPI_Reduce_scatter_block`). The ring runs on the communicator's duplicate (the one the
//! mismatch check uses), so its messages never meet a user's point-to-point messages, and
//! under the same watch as `MPI_Allreduce`: a rank that passes its time limit or is aborted
//! inside it ends the job as a blocking collective does.

use crate::raw;
use grid_core::{kernels, DType, Error, HostBuffer, HostSliceMut, ReduceOp};
use std::sync::Mutex;

/// All-reduces of at least this many bytes (on every rank: the mismatch check makes the sizes
/// agree) take the ring. Below it `MPI_Allreduce` needs no fresh mapping: glibc reuses freed
/// blocks under its 32 MiB dynamic mmap threshold.
pub(crate) const RING_MIN_BYTES: usize = 32 << 20;

/// Reduce-scatters (in place or not) whose input holds at least this many bytes take the ring.
/// Below 32 MiB the reason is not memory but the algorithm: Open MPI 4.1's
/// `MPI_Reduce_scatter_block` on shared memory took 1.3–2.3 times as long as the ring from
/// 512 KiB at 2 ranks, and up to 2.7 times at 4, where some runs were even (peer benchmark,
/// 2026-11-28; docs/performance.md, *Reduce-scatters from 512 KiB*). At 128 KiB the ring did
/// not pay.
pub(crate) const REDUCE_SCATTER_RING_MIN_BYTES: usize = 512 << 10;

/// The tag of the ring's messages (on the duplicate communicator, where nothing else sends).
const TAG: i32 = 1;

/// The `n` blocks of a buffer of `len` elements: `(offset, length)`, the first `len % n`
/// blocks one element longer.
pub(crate) fn blocks(len: usize, n: usize) -> Vec<(usize, usize)> {
    let n = n.max(1);
    let (base, extra) = (len / n, len % n);
    (0..n)
        .map(|i| (i * base + i.min(extra), base + usize::from(i < extra)))
        .collect()
}

/// Whether an all-reduce of `len` elements of `dtype` (the type MPI would reduce: no staged
/// types) takes the ring on `size` ranks.
pub(crate) fn applies(dtype: DType, len: usize, size: usize) -> bool {
    takes_ring(dtype, len, size, RING_MIN_BYTES)
}

/// Whether a reduce-scatter of an input of `len` elements of `dtype` takes the ring on `size`
/// ranks ([`REDUCE_SCATTER_RING_MIN_BYTES`]).
pub(crate) fn applies_to_reduce_scatter(dtype: DType, len: usize, size: usize) -> bool {
    takes_ring(dtype, len, size, REDUCE_SCATTER_RING_MIN_BYTES)
}

fn takes_ring(dtype: DType, len: usize, size: usize, min_bytes: usize) -> bool {
    size >= 2 && reduces_on_host(dtype) && len.saturating_mul(dtype.size_bytes()) >= min_bytes
}

/// Whether this crate reduces `dtype` with grid-core's kernels instead of MPI's (the ring, and
/// the all-reduce that copies between the ranks' memory, `crate::peer_read`).
pub(crate) fn reduces_on_host(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64)
}

/// The reduction of [`raw::Reduce`] in grid-core's kernels.
pub(crate) fn kernel_op(r: raw::Reduce) -> ReduceOp {
    match r {
        raw::Reduce::Sum => ReduceOp::Sum,
        raw::Reduce::Prod => ReduceOp::Prod,
        raw::Reduce::Min => ReduceOp::Min,
        raw::Reduce::Max => ReduceOp::Max,
    }
}

/// The ring reduce-scatter of `send` (`n` blocks of `recv.len()` elements) into `recv` on `c`
/// with `r`: in step `s` rank `r` sends the partial result of block `r - s - 1` right and
/// receives that of block `r - s - 2` from the left, to which it adds its own input of that
/// block; after `n - 1` steps the block it holds is its own, `r`. Partial results travel
/// through the two scratch blocks, so the input is never copied or written.
pub(crate) fn reduce_scatter(
    c: &raw::Comm,
    send: grid_core::HostSlice<'_>,
    mut recv: HostSliceMut<'_>,
    r: raw::Reduce,
    (rank, n): (usize, usize),
    scratch: &Scratch,
) -> std::result::Result<(), RingError> {
    let op = kernel_op(r);
    let k = recv.len();
    let input = |b: usize| {
        send.sub((b % n) * k, k)
            .ok_or_else(|| outside("block outside the input"))
    };
    let mut guard = scratch.lock().unwrap_or_else(|p| p.into_inner());
    let [a, b] = &mut *guard;
    let (theirs, partial) = (block(a, send.dtype(), k), block(b, send.dtype(), k));
    let (mut theirs, mut partial) = (theirs.as_mut_slice(), partial.as_mut_slice());
    let (mut theirs, mut partial) = (
        theirs
            .sub_mut(0, k)
            .ok_or_else(|| outside("scratch block too short"))?,
        partial
            .sub_mut(0, k)
            .ok_or_else(|| outside("scratch block too short"))?,
    );
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    for s in 0..n - 1 {
        let out = if s == 0 {
            input(rank + n - 1)?
        } else {
            partial.as_slice()
        };
        c.sendrecv(out, right, theirs.reborrow(), left, TAG)
            .map_err(RingError::Mpi)?;
        // The block that arrived: `rank - s - 2`; at the last step this rank's own.
        let target = if s == n - 2 {
            recv.reborrow()
        } else {
            partial.reborrow()
        };
        let mut target = target;
        target
            .copy_from(input(rank + 2 * n - s - 2)?)
            .map_err(RingError::Other)?;
        kernels::accumulate(target, theirs.as_slice(), op).map_err(RingError::Other)?;
    }
    Ok(())
}

/// What went wrong inside the ring.
#[derive(Debug)]
pub(crate) enum RingError {
    /// An MPI call failed.
    Mpi(raw::RawError),
    /// A host kernel refused its inputs, or a block did not lie where this module cut it
    /// (neither happens for buffers this module cuts; reported, never a panic).
    Other(Error),
}

fn outside(what: &str) -> RingError {
    RingError::Other(Error::Invalid(format!(
        "all_reduce: internal error in the ring: {what}"
    )))
}

/// A communicator's scratch blocks, kept between calls (the all-reduce uses the first, the
/// reduce-scatter both).
pub(crate) type Scratch = Mutex<[Option<HostBuffer>; 2]>;

/// Scratch block `slot` with room for `len` elements of `dtype` (reallocated when it has not).
pub(crate) fn block(slot: &mut Option<HostBuffer>, dtype: DType, len: usize) -> &mut HostBuffer {
    if !slot
        .as_ref()
        .is_some_and(|s| s.dtype() == dtype && s.len() >= len)
    {
        // The old block (if any) goes first: never two large blocks at once.
        *slot = None;
    }
    slot.get_or_insert_with(|| HostBuffer::zeros(dtype, len))
}

/// The ring all-reduce of `buf` in place on `c` (see the module docs) with `r`; `scratch`
/// holds the communicator's cached blocks.
pub(crate) fn all_reduce(
    c: &raw::Comm,
    mut buf: HostSliceMut<'_>,
    r: raw::Reduce,
    (rank, n): (usize, usize),
    scratch: &Scratch,
) -> std::result::Result<(), RingError> {
    let op = kernel_op(r);
    let parts = blocks(buf.len(), n);
    let mut guard = scratch.lock().unwrap_or_else(|p| p.into_inner());
    // Afterwards this rank holds the fully reduced block `rank + 1`.
    reduce_in_place(c, buf.reborrow(), op, (rank, n), &parts, 0, &mut guard[0])?;
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let at = |i: usize| parts[i % n];
    // All-gather: block `rank + 1 - s` goes right, block `rank - s` comes from the left.
    for s in 0..n - 1 {
        let send = at(rank + 1 + n - s);
        let recv = at(rank + n - s);
        c.sendrecv_within(
            buf.reborrow(),
            (send.0, send.1, right),
            (recv.0, recv.1, left),
            TAG,
        )
        .map_err(RingError::Mpi)?;
    }
    Ok(())
}

/// The reduce-scatter phase of the ring, in place on `buf` cut into `parts`: in step `s`
/// (`0..n-1`) rank `r` sends block `r - s - shift` right and receives block `r - s - shift - 1` from
/// the left into the scratch block, which it reduces into its own copy of that block; afterwards
/// rank `r` holds the fully reduced block `r + 1 - shift` where it lies (shift 0: the
/// all-reduce's first half; shift 1: the in-place reduce-scatter, which ends on its own block).
fn reduce_in_place(
    c: &raw::Comm,
    mut buf: HostSliceMut<'_>,
    op: ReduceOp,
    (rank, n): (usize, usize),
    parts: &[(usize, usize)],
    shift: usize,
    slot: &mut Option<HostBuffer>,
) -> std::result::Result<(), RingError> {
    let longest = parts.iter().map(|p| p.1).max().unwrap_or(0);
    let tmp = block(slot, buf.dtype(), longest);
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let at = |i: usize| parts[i % n];
    for s in 0..n - 1 {
        let (send_at, send_len) = at(rank + 2 * n - s - shift);
        let (recv_at, recv_len) = at(rank + 2 * n - s - shift - 1);
        let mut whole_tmp = tmp.as_mut_slice();
        let mut into = whole_tmp
            .sub_mut(0, recv_len)
            .ok_or_else(|| outside("scratch block too short"))?;
        let out = buf
            .as_slice()
            .sub(send_at, send_len)
            .ok_or_else(|| outside("block outside the buffer"))?;
        c.sendrecv(out, right, into.reborrow(), left, TAG)
            .map_err(RingError::Mpi)?;
        let mine = buf
            .sub_mut(recv_at, recv_len)
            .ok_or_else(|| outside("block outside the buffer"))?;
        kernels::accumulate(mine, into.as_slice(), op).map_err(RingError::Other)?;
    }
    Ok(())
}

/// The ring reduce-scatter of `buf` (`n` blocks of `buf.len() / n` elements) in place on `c`
/// with `r`: this rank's reduced block ends at `rank · k`, where it lies, with no copy (the
/// other blocks hold partial results: unspecified, as the operation allows). The all-reduce's
/// first half with the blocks shifted by one.
pub(crate) fn reduce_scatter_in_place(
    c: &raw::Comm,
    mut buf: HostSliceMut<'_>,
    r: raw::Reduce,
    (rank, n): (usize, usize),
    scratch: &Scratch,
) -> std::result::Result<(), RingError> {
    if !buf.len().is_multiple_of(n.max(1)) {
        return Err(outside(
            "an in-place reduce-scatter buffer that is not n equal blocks",
        ));
    }
    let parts = blocks(buf.len(), n);
    let mut guard = scratch.lock().unwrap_or_else(|p| p.into_inner());
    reduce_in_place(
        c,
        buf.reborrow(),
        kernel_op(r),
        (rank, n),
        &parts,
        1,
        &mut guard[0],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_buffer_in_order_and_differ_by_at_most_one() {
        for n in 1..=9 {
            for len in [0usize, 1, 2, 7, 8, 9, 100, 1001] {
                let b = blocks(len, n);
                assert_eq!(b.len(), n);
                let mut at = 0;
                for &(o, l) in &b {
                    assert_eq!(o, at, "len {len}, n {n}");
                    at += l;
                }
                assert_eq!(at, len);
                let (lo, hi) = (b.iter().map(|p| p.1).min(), b.iter().map(|p| p.1).max());
                assert!(hi.unwrap() - lo.unwrap() <= 1);
            }
        }
    }

    #[test]
    fn the_ring_applies_to_large_native_reductions_only() {
        let big = RING_MIN_BYTES / 4;
        assert!(applies(DType::F32, big, 2));
        assert!(applies(DType::I64, big / 2, 3));
        assert!(!applies(DType::F32, big - 1, 2));
        assert!(!applies(DType::F32, big, 1));
        assert!(!applies(DType::BF16, 2 * big, 2));
        assert!(!applies(DType::U8, 4 * big, 2));
        let rs = REDUCE_SCATTER_RING_MIN_BYTES / 4;
        assert!(applies_to_reduce_scatter(DType::F32, rs, 2));
        assert!(applies_to_reduce_scatter(DType::I32, rs, 4));
        assert!(!applies_to_reduce_scatter(DType::F32, rs - 1, 4));
        assert!(!applies_to_reduce_scatter(DType::F64, rs, 1));
        assert!(!applies_to_reduce_scatter(DType::F16, 2 * rs, 2));
        assert!(!applies(DType::F32, rs, 2));
    }
}
