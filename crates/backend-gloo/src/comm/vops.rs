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
use crate::ffi::{Channel, P2pMismatch, RawBlock};
use grid_core::comm::round::{copy_into, part};
use grid_core::{
    kernels, DeferredCheck, Error, HostBuffer, HostSlice, HostSliceMut, LibraryError, ReduceOp,
    Result,
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
        self.exchange_on(
            Channel::Collective,
            op,
            send,
            sends,
            recv,
            recvs,
            tag,
            limit,
        )
    }

    /// [`Inner::exchange`] on the slots of `channel` (the mismatch check's exchanges use
    /// [`Channel::Check`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn exchange_on(
        &self,
        channel: Channel,
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
            .exchange_on(channel, send, sends, recv, recvs, tag, limit)
            .map_err(|e| self.fail_after(op, e, limit))?;
        match mismatches.first() {
            None => Ok(()),
            Some(m) => Err(self.block_mismatch(op, m)),
        }
    }

    /// The error of a block whose two sides disagreed (possible only with the mismatch check
    /// off): [`Error::Library`] of class [`MESSAGE_MISMATCH`]. The communicator stays usable.
    pub(super) fn block_mismatch(&self, op: &'static str, m: &P2pMismatch) -> Error {
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
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_to_all_v(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        send_counts: &[usize],
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
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
        // This rank's own block first, so that it is in place even when a peer's block fails.
        let own = send_counts[me] == recv_counts[me];
        if own {
            copy_into(
                OP,
                &mut recv,
                ro[me],
                part(OP, send, so[me], send_counts[me])?,
            )?;
        }
        self.exchange(OP, send, &sends, recv.reborrow(), &recvs, tag, limit)?;
        if !own {
            return Err(self.self_mismatch(OP, send_counts[me], recv_counts[me]));
        }
        Ok(())
    }

    /// All-gather with per-rank counts: rank `j` contributes `recv_counts[j]` elements.
    pub(super) fn all_gather_v(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        recv_counts: &[usize],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
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
        // This rank's own block first, so that it is in place even when a peer's block fails.
        let own = send.len() == recv_counts[me];
        if own {
            copy_into(OP, &mut recv, ro[me], send)?;
        }
        self.exchange(OP, send, &sends, recv.reborrow(), &recvs, tag, limit)?;
        if !own {
            return Err(self.self_mismatch(OP, send.len(), recv_counts[me]));
        }
        Ok(())
    }

    /// Reduce-scatter with per-rank counts: block `j` of `send` (`send_counts[j]` elements)
    /// goes to rank `j`, which reduces every rank's block `j` into `recv`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce_scatter_v(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        send_counts: &[usize],
        recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
        self.reduce_scatter_blocks("reduce_scatter_v", send, send_counts, recv, op, tag, limit)
    }

    /// [`Inner::reduce_scatter_v`] as collective `name` (also the even reduce-scatter's
    /// [`crate::ReduceScatterAlgorithm::Direct`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce_scatter_blocks(
        &self,
        name: &'static str,
        send: HostSlice<'_>,
        send_counts: &[usize],
        recv: HostSliceMut<'_>,
        op: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.alive(name)?;
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
        let others = self.receive_every_other(name, send, &sends, n, tag, limit)?;
        if send_counts[me] != n {
            return Err(self.self_mismatch(name, send_counts[me], n));
        }
        let own = part(name, send, so[me], n)?;
        self.reduce_in_rank_order(name, own, others.as_slice(), recv, op)
    }

    /// Rooted reduce: `recv` on `root` (None elsewhere) = the reduction of every rank's `send`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        op: ReduceOp,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
        const OP: &str = "reduce";
        self.alive(OP)?;
        let (me, n) = (self.rank(), send.len());
        let Some(recv) = recv.filter(|_| me == root) else {
            return self.send_to_root(OP, send, root, tag, limit);
        };
        let others = self.receive_every_other(OP, send, &[], n, tag, limit)?;
        self.reduce_in_rank_order(OP, send, others.as_slice(), recv, op)
    }

    /// Rooted gather: `recv` on `root` = every rank's `send` in rank order.
    pub(super) fn gather(
        &self,
        check: Option<&DeferredCheck>,
        send: HostSlice<'_>,
        recv: Option<HostSliceMut<'_>>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
        const OP: &str = "gather";
        self.alive(OP)?;
        let (me, size, n) = (self.rank(), self.size(), send.len());
        let Some(mut recv) = recv.filter(|_| me == root) else {
            return self.send_to_root(OP, send, root, tag, limit);
        };
        let recvs: Vec<RawBlock> = (0..size)
            .filter(|&j| j != me)
            .map(|j| RawBlock {
                peer: j,
                offset: j * n,
                count: n,
            })
            .collect();
        // The root's own block first, so that it is in place even when a peer's block fails.
        copy_into(OP, &mut recv, me * n, send)?;
        self.exchange(OP, send, &[], recv.reborrow(), &recvs, tag, limit)
    }

    /// Rooted scatter: block `j` of `send` on `root` (`recv.len()` elements) to rank `j`.
    pub(super) fn scatter(
        &self,
        check: Option<&DeferredCheck>,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        self.check_only(check, tag, limit)?;
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
        recv.copy_from(part(OP, send, me * n, n)?)?;
        self.exchange(OP, send, &sends, recv, &[], tag, limit)
    }

    /// Sends the `sends` blocks of `send` and receives `n` elements from every other rank into
    /// scratch memory, whose slot `k` (elements `k·n..(k+1)·n`) holds the block of the `k`-th
    /// other rank in rank order.
    fn receive_every_other(
        &self,
        op: &'static str,
        send: HostSlice<'_>,
        sends: &[RawBlock],
        n: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<HostBuffer> {
        let me = self.rank();
        let mut scratch = HostBuffer::zeros(send.dtype(), n * (self.size() - 1));
        let recvs: Vec<RawBlock> = (0..self.size())
            .filter(|&j| j != me)
            .enumerate()
            .map(|(k, j)| RawBlock {
                peer: j,
                offset: k * n,
                count: n,
            })
            .collect();
        self.exchange(op, send, sends, scratch.as_mut_slice(), &recvs, tag, limit)?;
        Ok(scratch)
    }

    /// Reduces this rank's block `own` with the other ranks' blocks (`others`, as
    /// [`Inner::receive_every_other`] lays them out) into `recv`, in rank order, so that the result
    /// is that of the host kernels over the ranks' inputs in order.
    fn reduce_in_rank_order(
        &self,
        op: &'static str,
        own: HostSlice<'_>,
        others: HostSlice<'_>,
        recv: HostSliceMut<'_>,
        r: ReduceOp,
    ) -> Result<()> {
        let (me, n) = (self.rank(), own.len());
        let mut inputs = Vec::with_capacity(self.size());
        for j in 0..self.size() {
            inputs.push(match j.cmp(&me) {
                std::cmp::Ordering::Equal => own,
                std::cmp::Ordering::Less => part(op, others, j * n, n)?,
                std::cmp::Ordering::Greater => part(op, others, (j - 1) * n, n)?,
            });
        }
        kernels::reduce(&inputs, recv, r)
    }

    /// The part of a non-root rank in a rooted reduce or gather: its whole `send` to `root`.
    fn send_to_root(
        &self,
        op: &'static str,
        send: HostSlice<'_>,
        root: usize,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        let to_root = [RawBlock {
            peer: root,
            offset: 0,
            count: send.len(),
        }];
        let mut none = HostBuffer::zeros(send.dtype(), 0);
        self.exchange(op, send, &to_root, none.as_mut_slice(), &[], tag, limit)
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
        "reduce_scatter" => "recv.len() equal on every rank and send.len() == size * recv.len()",
        "scatter" => {
            "recv.len() equal on every rank, and the root's send holding size blocks of it"
        }
        _ => "send.len() equal on every rank, and the same root",
    }
}

/// The algorithms called directly (no front end, so no mismatch check: the unchecked path),
/// ranks as threads: exact values, and disagreements reported by the receiving rank.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::{run_ranks, GlooConfig};

    const T: Duration = Duration::from_secs(60);

    fn on_ranks<R: Send>(n: usize, job: &str, f: impl Fn(&Inner) -> Result<R> + Sync) -> Vec<R> {
        let cfg = GlooConfig::new(job).with_timeout(T);
        run_ranks(n, &cfg, |_f, w| f(&w.inner().inner))
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect()
    }

    #[test]
    fn every_operation_is_exact_at_1_to_4_ranks() {
        for n in [1usize, 2, 3, 4] {
            on_ranks(n, &format!("vops-unit-{n}"), |c| {
                let me = c.rank();
                let v = |from: usize, to: usize, i: usize| (from * 100 + to * 10 + i) as i64;
                // all_to_all_v: rank r sends (r + j) % 3 elements to rank j.
                let sc: Vec<usize> = (0..n).map(|j| (me + j) % 3).collect();
                let rc: Vec<usize> = (0..n).map(|j| (j + me) % 3).collect();
                let send: Vec<i64> = (0..n)
                    .flat_map(|j| (0..sc[j]).map(move |i| v(me, j, i)))
                    .collect();
                let mut recv = vec![-1i64; rc.iter().sum()];
                c.all_to_all_v(
                    None,
                    HostSlice::I64(&send),
                    &sc,
                    HostSliceMut::I64(&mut recv),
                    &rc,
                    1,
                    T,
                )?;
                let want: Vec<i64> = (0..n)
                    .flat_map(|j| (0..rc[j]).map(move |i| v(j, me, i)))
                    .collect();
                assert_eq!(recv, want, "all_to_all_v");
                // all_gather_v: rank j contributes j + 1 elements.
                let counts: Vec<usize> = (0..n).map(|j| j + 1).collect();
                let mine: Vec<i64> = (0..=me).map(|i| v(me, 0, i)).collect();
                let mut recv = vec![0i64; counts.iter().sum()];
                c.all_gather_v(
                    None,
                    HostSlice::I64(&mine),
                    HostSliceMut::I64(&mut recv),
                    &counts,
                    2,
                    T,
                )?;
                let want: Vec<i64> = (0..n)
                    .flat_map(|j| (0..=j).map(move |i| v(j, 0, i)))
                    .collect();
                assert_eq!(recv, want, "all_gather_v");
                // reduce_scatter_v (Sum) with the same counts.
                let total: usize = counts.iter().sum();
                let send: Vec<i64> = (0..total).map(|i| v(me, 1, i)).collect();
                let mut recv = vec![0i64; me + 1];
                c.reduce_scatter_v(
                    None,
                    HostSlice::I64(&send),
                    &counts,
                    HostSliceMut::I64(&mut recv),
                    ReduceOp::Sum,
                    3,
                    T,
                )?;
                let off = me * (me + 1) / 2;
                let want: Vec<i64> = (0..=me)
                    .map(|i| (0..n).map(|r| v(r, 1, off + i)).sum())
                    .collect();
                assert_eq!(recv, want, "reduce_scatter_v");
                for root in 0..n {
                    let tag = 10 + 3 * root as u32;
                    // reduce (Max), gather, scatter
                    let send: Vec<i64> = (0..4).map(|i| v(me, root, i)).collect();
                    let mut out = vec![0i64; 4];
                    let o = (me == root).then_some(HostSliceMut::I64(&mut out));
                    c.reduce(None, HostSlice::I64(&send), o, ReduceOp::Max, root, tag, T)?;
                    if me == root {
                        assert_eq!(
                            out,
                            (0..4).map(|i| v(n - 1, root, i)).collect::<Vec<_>>(),
                            "reduce"
                        );
                    }
                    let mut all = vec![0i64; 4 * n];
                    let o = (me == root).then_some(HostSliceMut::I64(&mut all));
                    c.gather(None, HostSlice::I64(&send), o, root, tag + 1, T)?;
                    if me == root {
                        let want: Vec<i64> = (0..n)
                            .flat_map(|j| (0..4).map(move |i| v(j, root, i)))
                            .collect();
                        assert_eq!(all, want, "gather");
                    }
                    let blocks: Vec<i64> = (0..n)
                        .flat_map(|j| (0..4).map(move |i| v(root, j, i)))
                        .collect();
                    let mut got = vec![0i64; 4];
                    let s = (me == root).then_some(HostSlice::I64(&blocks));
                    c.scatter(None, s, HostSliceMut::I64(&mut got), root, tag + 2, T)?;
                    assert_eq!(
                        got,
                        (0..4).map(|i| v(root, me, i)).collect::<Vec<_>>(),
                        "scatter"
                    );
                }
                Ok(())
            });
        }
    }

    /// Unchecked disagreements: the receiving rank gets `message mismatch` naming the sender
    /// and both counts, its memory for the block is unchanged, and the communicator works on.
    #[test]
    fn disagreements_are_reported_by_the_receiver() {
        let out = on_ranks(3, "vops-unit-mismatch", |c| {
            let (me, n) = (c.rank(), 3);
            let mut errs = Vec::new();
            // all_to_all_v: rank 1 sends 3 elements to rank 0, which expects 2.
            let sc: Vec<usize> = (0..n)
                .map(|j| if me == 1 && j == 0 { 3 } else { 2 })
                .collect();
            let send = vec![7i32; sc.iter().sum()];
            let mut recv = vec![-1i32; 2 * n];
            let r = c.all_to_all_v(
                None,
                HostSlice::I32(&send),
                &sc,
                HostSliceMut::I32(&mut recv),
                &[2; 3],
                1,
                T,
            );
            if me == 0 {
                assert_eq!(&recv[2..4], &[-1, -1], "the discarded block was written");
            }
            errs.push(r.err().map(|e| e.to_string()));
            // gather to root 0: rank 2 sends 5 elements where the root expects 4.
            let send = vec![1.5f32; if me == 2 { 5 } else { 4 }];
            let mut all = vec![0.0f32; 12];
            let o = (me == 0).then_some(HostSliceMut::F32(&mut all));
            errs.push(
                c.gather(None, HostSlice::F32(&send), o, 0, 2, T)
                    .err()
                    .map(|e| e.to_string()),
            );
            // The communicator works on.
            let mut all = vec![0u8; 3];
            let o = (me == 1).then_some(HostSliceMut::U8(&mut all));
            c.gather(None, HostSlice::U8(&[me as u8]), o, 1, 3, T)?;
            if me == 1 {
                assert_eq!(all, [0, 1, 2]);
            }
            Ok(errs)
        });
        let e = out[0][0].as_deref().expect("rank 0 is told");
        assert!(
            e.contains("all_to_all_v") && e.contains("message mismatch"),
            "{e}"
        );
        assert!(e.contains("rank 1 (world rank 1) sent a block of 3 i32 elements to this rank, which expected 2 i32 elements"), "{e}");
        assert!(out[1][0].is_none() && out[2][0].is_none(), "{:?}", out);
        let e = out[0][1].as_deref().expect("the root is told");
        assert!(e.contains("rank 2 (world rank 2) sent a block of 5 f32 elements to this rank, which expected 4 f32"), "{e}");
        assert!(out[1][1].is_none() && out[2][1].is_none(), "{:?}", out);
    }
}
