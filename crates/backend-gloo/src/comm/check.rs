//! The mismatch check's all-reduce as messages of the length protocol instead of a Gloo
//! all-reduce.
//!
//! Every checked collective first runs grid-core's check ([`grid_core::DeferredCheck`]): the
//! maximum, over the ranks, of a few `i64`s. Through libgloo's all-reduce that costs about as
//! much as the collective it guards at small sizes (at 2 ranks on loopback a broadcast of 8 B
//! took 56 µs alone and 250 µs checked): the check is latency, not bandwidth. Here it is one
//! round of messages: every rank sends its integers to every other rank and takes the maximum
//! of what arrives (one message's latency, `n - 1` messages per rank), up to [`DIRECT_MAX`]
//! ranks; above that, a dissemination all-reduce (in round `k` each rank sends what it has to
//! rank `r + 2^k` and receives from rank `r - 2^k`; the maximum is idempotent, so after
//! `ceil(log2 n)` rounds every rank has every rank's values): `log2 n` latencies, one message
//! per round. Both exchange each ordered pair of ranks at most once per call (`2^a ≢ 2^b`
//! modulo `n` for `2^a < 2^b < n`), so one slot per call suffices.
//!
//! The messages travel on slots of their own ([`crate::RawContext`]'s check channel) under the
//! checked collective's tag, so they never meet that collective's messages, a user's
//! point-to-point messages or another collective's; time limit, abort and failure records are
//! those of every other operation.

use super::Inner;
use crate::ffi::{Channel, RawBlock};
use grid_core::{HostSlice, HostSliceMut, Result};
use std::time::Duration;

/// Largest communicator whose check sends directly to every peer (one round); above it, the
/// dissemination rounds (fewer messages per rank).
pub(crate) const DIRECT_MAX: usize = 16;

impl Inner {
    /// Replaces `values` by the element-wise maximum over every rank's `values` (every rank
    /// passes the same length: the check's buffers are fixed-size and built by grid-core).
    pub(super) fn check_max(&self, values: &mut [i64], tag: u32, limit: Duration) -> Result<()> {
        const OP: &str = "all_reduce";
        self.alive(OP)?;
        let (me, n, len) = (self.rank(), self.size(), values.len());
        if n < 2 || len == 0 {
            return Ok(());
        }
        let block = |peer: usize, slot: usize| RawBlock {
            peer,
            offset: slot * len,
            count: len,
        };
        if n <= DIRECT_MAX {
            let peers: Vec<usize> = (0..n).filter(|&j| j != me).collect();
            let sends: Vec<RawBlock> = peers.iter().map(|&j| block(j, 0)).collect();
            let recvs: Vec<RawBlock> = peers
                .iter()
                .enumerate()
                .map(|(i, &j)| block(j, i))
                .collect();
            let mut theirs = vec![0i64; len * peers.len()];
            self.check_round(values, &sends, &mut theirs, &recvs, tag, limit)?;
            for chunk in theirs.chunks_exact(len) {
                max_into(values, chunk);
            }
            return Ok(());
        }
        let mut theirs = vec![0i64; len];
        for (to, from) in dissemination(me, n) {
            self.check_round(
                values,
                &[block(to, 0)],
                &mut theirs,
                &[block(from, 0)],
                tag,
                limit,
            )?;
            max_into(values, &theirs);
        }
        Ok(())
    }

    fn check_round(
        &self,
        send: &[i64],
        sends: &[RawBlock],
        recv: &mut [i64],
        recvs: &[RawBlock],
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        // Every rank sends the same fixed number of integers; a message of another length
        // means a peer runs a different version of this library.
        self.exchange_on(
            Channel::Check,
            "all_reduce",
            HostSlice::I64(send),
            sends,
            HostSliceMut::I64(recv),
            recvs,
            tag,
            limit,
        )
    }
}

/// The rounds of a dissemination exchange at rank `me` of `n`: in round `k`, send to
/// `me + 2^k` and receive from `me - 2^k` (modulo `n`), for every `2^k < n`.
fn dissemination(me: usize, n: usize) -> Vec<(usize, usize)> {
    let mut rounds = Vec::new();
    let mut distance = 1usize;
    while distance < n {
        rounds.push(((me + distance) % n, (me + n - distance) % n));
        distance *= 2;
    }
    rounds
}

fn max_into(acc: &mut [i64], other: &[i64]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = (*a).max(*b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the rounds on sets of ranks: after the last round every rank has heard from
    /// every rank, each ordered pair meets at most once, and every send has its receive.
    #[test]
    #[allow(clippy::needless_range_loop)] // round `k` indexes every rank's plan
    fn dissemination_reaches_every_rank_and_uses_each_pair_once() {
        for n in 2..=70usize {
            let mut known: Vec<Vec<bool>> =
                (0..n).map(|r| (0..n).map(|j| j == r).collect()).collect();
            let plans: Vec<_> = (0..n).map(|r| dissemination(r, n)).collect();
            let rounds = plans[0].len();
            assert_eq!(rounds, (n as f64).log2().ceil() as usize, "n = {n}");
            let mut pairs = std::collections::HashSet::new();
            for k in 0..rounds {
                let before = known.clone();
                for r in 0..n {
                    let (to, from) = plans[r][k];
                    assert_eq!(
                        plans[to][k].1, r,
                        "n = {n}: round {k}: {r} sends to {to}, which receives elsewhere"
                    );
                    assert!(
                        pairs.insert((r, to)),
                        "n = {n}: pair {r} -> {to} used twice"
                    );
                    for j in 0..n {
                        known[r][j] |= before[from][j];
                    }
                }
            }
            for (r, row) in known.iter().enumerate() {
                assert!(row.iter().all(|&b| b), "n = {n}: rank {r} misses some rank");
            }
        }
    }
}
