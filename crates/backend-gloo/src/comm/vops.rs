//! The collectives that Gloo runs as point-to-point messages of the shim's length protocol
//! ([`RawContext::exchange`](crate::RawContext::exchange)): all-to-all-v, all-gather-v,
//! reduce-scatter-v, and the rooted reduce, gather and scatter.
//!
//! Why not libgloo's `alltoallv`, `allgatherv`, `gather`, `scatter` and `reduce`: they post
//! Gloo's unbound buffers with the lengths each rank computes for itself, and a message longer
//! than the memory its receiver posted makes libgloo throw on its transport thread, which
//! terminates the process; a shorter one completes with stale bytes. With the mismatch check
//! on (Gloo's default) the front end rules both out before any data moves, but with
//! `GRID_DEBUG=off` nothing would. Here every block travels with its element type and count,
//! so a rank that disagrees on the counts gets an error naming the peer and both counts, its
//! receive memory for that block stays untouched, and the process survives. Every message of
//! one call is posted at once (no step waits for another), on slots derived from the call's
//! ticket that no user tag or Gloo collective uses; the time limit, abort and failure records
//! are those of every other operation. Each rank sends and receives exactly the data of the
//! operation once (direct exchange): the volume of Gloo's own algorithms.
//!
//! Reductions (reduce-scatter-v, reduce) gather the blocks to reduce into scratch memory and
//! combine them with [`kernels::reduce`], in rank order: the results are those of the host
//! kernels, bit for bit (the same as the in-process backend), including `Avg`.

use super::{Inner, BACKEND, MESSAGE_MISMATCH};
use crate::ffi::{P2pMismatch, RawBlock};
use grid_core::{
    kernels, Error, HostBuffer, HostSlice, HostSliceMut, LibraryError, ReduceOp, Result,
};
use std::time::Duration;

/// Element offsets of consecutive blocks of `counts` elements.
fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = 0usize;
    counts
        .iter()
        .map(|&c| {
            let o = at;
            at = at.saturating_add(c);
            o
        })
        .collect()
}

/// A sub-slice that must exist (the front end checked the lengths; an unchecked disagreement
/// between ranks is reported, not a panic).
fn part<'a>(op: &'static str, s: HostSlice<'a>, start: usize, len: usize) -> Result<HostSlice<'a>> {
    s.sub(start, len).ok_or_else(|| {
        Error::Invalid(format!(
            "{op}: elements {start}..{} do not lie inside a buffer of {} elements",
            start.saturating_add(len),
            s.len()
        ))
    })
}

impl Inner {
    /// One exchange of blocks within `limit`; a block whose two sides disagreed is an error
    /// naming the peer, both sides' counts and what would be valid.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        op: &'static str,
        send: HostSlice<'_>,
        sends: &[RawBlock],
        recv: HostSliceMut<'_>,
        recvs: &[RawBlock],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let mismatches = self
            .ctx
            .exchange(send, sends, recv, recvs, tag, limit)
            .map_err(|e| self.fail_after(op, e, limit))?;
        match mismatches.first() {
            None => Ok(()),
            Some(m) => Err(self.block_mismatch(op, m)),
        }
    }

    /// The error of a block whose two sides disagreed (possible only with the mismatch check
    /// off): [`Error::Library`] of class [`MESSAGE_MISMATCH`]. The communicator stays usable.
    fn block_mismatch(&self, op: &'static str, m: &P2pMismatch) -> Error {
        let world = self.global_ranks.get(m.peer).copied().unwrap_or(m.peer);
        let peer = m.peer;
        tracing::warn!(communicator = %self.name, op, peer, posted = ?m.posted, sent = ?m.sent, is_recv = m.is_recv, "the ranks disagreed on a block of a collective");
        let what = if m.is_recv {
            format!(
                "rank {peer} (world rank {world}) sent a block of {} {} elements to this rank, which expected {} {} elements from it",
                m.sent.1, m.sent.0, m.posted.1, m.posted.0
            )
        } else {
            format!(
                "rank {peer} (world rank {world}) expected a block of {} {} elements from this rank, which sent {} {} elements",
                m.posted.1, m.posted.0, m.sent.1, m.sent.0
            )
        };
        let message = format!(
            "{what}: the ranks disagree on this {op}'s counts or element type. Valid: the same dtype on every rank and {}; the mismatch check (on unless GRID_DEBUG=off or MismatchCheck::Off) reports this on every rank before any data moves. The block was discarded (this rank's memory for it is unchanged; other blocks may have arrived) and the communicator remains usable",
            valid_counts(op)
        );
        LibraryError::new(BACKEND, op, message)
            .comm(self.name.as_str())
            .class(MESSAGE_MISMATCH)
            .into()
    }

    /// A block this rank sends to itself whose two counts differ (mismatch check off).
    fn self_mismatch(&self, op: &'static str, sent: usize, expected: usize) -> Error {
        Error::Invalid(format!(
            "{op}: this rank ({}) sends {sent} elements to itself but expects {expected}: {}",
            self.rank(),
            valid_counts(op)
        ))
    }

    /// Uneven all-to-all: `send_counts[j]` elements (consecutive, in peer order) to rank `j`,
    /// `recv_counts[j]` from rank `j` into `recv` in peer order.
    pub(super) fn all_to_all_v(
        &self,
        send: HostSlice<'_>,
        send_counts: &[usize],
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        self.alive(OP)?;
        let me = self.rank();
        let (so, ro) = (offsets(send_counts), offsets(recv_counts));
        let blocks = |off: &[usize], counts: &[usize]| -> Vec<RawBlock> {
            (0..self.size())
                .filter(|&j| j != me)
                .map(|j| RawBlock {
                    peer: j,
                    offset: off[j],
                    count: counts[j],
                })
                .collect()
        };
        let (sends, recvs) = (blocks(&so, send_counts), blocks(&ro, recv_counts));
        self.exchange(OP, send, &sends, recv.reborrow(), &recvs, tag, limit)?;
        if send_counts[me] != recv_counts[me] {
            return Err(self.self_mismatch(OP, send_counts[me], recv_counts[me]));
        }
        let mine = part(OP, send, so[me], send_counts[me])?;
        copy_into(OP, &mut recv, ro[me], mine)
    }

    /// All-gather with per-rank counts: rank `j` contributes `recv_counts[j]` elements.
    pub(super) fn all_gather_v(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_gather_v";
        self.alive(OP)?;
        let me = self.rank();
        let ro = offsets(recv_counts);
        let others = (0..self.size()).filter(|&j| j != me);
        let sends: Vec<RawBlock> = others
            .clone()
            .map(|j| RawBlock {
                peer: j,
                offset: 0,
                count: send.len(),
            })
            .collect();
        let recvs: Vec<RawBlock> = others
            .map(|j| RawBlock {
                peer: j,
                offset: ro[j],
                count: recv_counts[j],
            })
            .collect();
        self.exchange(OP, send, &sends, recv.reborrow(), &recvs, tag, limit)?;
        if send.len() != recv_counts[me] {
            return Err(self.self_mismatch(OP, send.len(), recv_counts[me]));
        }
        copy_into(OP, &mut recv, ro[me], send)
    }

    /// Reduce-scatter with per-rank counts: block `j` of `send` (`send_counts[j]` elements)
    /// goes to rank `j`, which reduces every rank's block `j` into `recv`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce_scatter_v(
        &self,
        send: HostSlice<'_>,
        send_counts: &[usize],
        recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter_v";
        self.alive(OP)?;
        let (me, size, n) = (self.rank(), self.size(), recv.len());
        let so = offsets(send_counts);
        let sends: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .map(|j| RawBlock {
                peer: j,
                offset: so[j],
                count: send_counts[j],
            })
            .collect();
        // Slot k of the scratch memory holds the block of the k-th other rank.
        let mut scratch = HostBuffer::zeros(send.dtype(), n * (size - 1));
        let recvs: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .enumerate()
            .map(|(k, j)| RawBlock {
                peer: j,
                offset: k * n,
                count: n,
            })
            .collect();
        self.exchange(OP, send, &sends, scratch.as_mut_slice(), &recvs, tag, limit)?;
        if send_counts[me] != n {
            return Err(self.self_mismatch(OP, send_counts[me], n));
        }
        let scratch = scratch.as_slice();
        let mut inputs = Vec::with_capacity(size);
        for j in 0..size {
            inputs.push(match j.cmp(&me) {
                std::cmp::Ordering::Equal => part(OP, send, so[me], n)?,
                std::cmp::Ordering::Less => part(OP, scratch, j * n, n)?,
                std::cmp::Ordering::Greater => part(OP, scratch, (j - 1) * n, n)?,
            });
        }
        kernels::reduce(&inputs, recv, op)
    }

    /// Rooted reduce: `recv` on `root` (None elsewhere) = the reduction of every rank's `send`.
    pub(super) fn reduce(
        &self,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        op: ReduceOp,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce";
        self.alive(OP)?;
        let (me, size, n) = (self.rank(), self.size(), send.len());
        let Some(recv) = recv.filter(|_| me == root) else {
            let to_root = [RawBlock {
                peer: root,
                offset: 0,
                count: n,
            }];
            let mut none = HostBuffer::zeros(send.dtype(), 0);
            return self.exchange(OP, send, &to_root, none.as_mut_slice(), &[], tag, limit);
        };
        let mut scratch = HostBuffer::zeros(send.dtype(), n * (size - 1));
        let recvs: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .enumerate()
            .map(|(k, j)| RawBlock {
                peer: j,
                offset: k * n,
                count: n,
            })
            .collect();
        self.exchange(OP, send, &[], scratch.as_mut_slice(), &recvs, tag, limit)?;
        let scratch = scratch.as_slice();
        let mut inputs = Vec::with_capacity(size);
        for j in 0..size {
            inputs.push(match j.cmp(&me) {
                std::cmp::Ordering::Equal => send,
                std::cmp::Ordering::Less => part(OP, scratch, j * n, n)?,
                std::cmp::Ordering::Greater => part(OP, scratch, (j - 1) * n, n)?,
            });
        }
        kernels::reduce(&inputs, recv, op)
    }

    /// Rooted gather: `recv` on `root` = every rank's `send` in rank order.
    pub(super) fn gather(
        &self,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "gather";
        self.alive(OP)?;
        let (me, size, n) = (self.rank(), self.size(), send.len());
        let Some(mut recv) = recv.filter(|_| me == root) else {
            let to_root = [RawBlock {
                peer: root,
                offset: 0,
                count: n,
            }];
            let mut none = HostBuffer::zeros(send.dtype(), 0);
            return self.exchange(OP, send, &to_root, none.as_mut_slice(), &[], tag, limit);
        };
        let recvs: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .map(|j| RawBlock {
                peer: j,
                offset: j * n,
                count: n,
            })
            .collect();
        self.exchange(OP, send, &[], recv.reborrow(), &recvs, tag, limit)?;
        copy_into(OP, &mut recv, me * n, send)
    }

    /// Rooted scatter: block `j` of `send` on `root` (`recv.len()` elements) to rank `j`.
    pub(super) fn scatter(
        &self,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "scatter";
        self.alive(OP)?;
        let (me, size, n) = (self.rank(), self.size(), recv.len());
        let Some(send) = send.filter(|_| me == root) else {
            let from_root = [RawBlock {
                peer: root,
                offset: 0,
                count: n,
            }];
            let none = HostBuffer::zeros(recv.dtype(), 0);
            return self.exchange(OP, none.as_slice(), &[], recv, &from_root, tag, limit);
        };
        let sends: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .map(|j| RawBlock {
                peer: j,
                offset: j * n,
                count: n,
            })
            .collect();
        self.exchange(OP, send, &sends, recv.reborrow(), &[], tag, limit)?;
        let mine = part(OP, send, me * n, n)?;
        recv.copy_from(mine)
    }
}

/// Copies `src` into `dst` at element `at`.
fn copy_into(
    op: &'static str,
    dst: &mut HostSliceMut<'_>,
    at: usize,
    src: HostSlice<'_>,
) -> Result<()> {
    let len = dst.len();
    match dst.sub_mut(at, src.len()) {
        Some(mut d) => d.copy_from(src),
        None => Err(Error::Invalid(format!(
            "{op}: elements {at}..{} do not lie inside the receive buffer of {len} elements",
            at.saturating_add(src.len())
        ))),
    }
}

/// What agreeing ranks pass to `op`.
fn valid_counts(op: &str) -> &'static str {
    match op {
        "all_to_all_v" => {
            "send_counts[j] on rank i equal to recv_counts[i] on rank j for every pair of ranks"
        }
        "all_gather_v" => {
            "the same recv_counts on every rank, with send.len() == recv_counts[rank]"
        }
        "reduce_scatter_v" => {
            "the same send_counts on every rank, with recv.len() == send_counts[rank]"
        }
        "scatter" => {
            "recv.len() equal on every rank, and the root's send holding size blocks of it"
        }
        _ => "send.len() equal on every rank, and the same root",
    }
}
