//! RoundOp collectives in one round of messages that carry their own mismatch check.
//!
//! A checked collective used to cost two exchanges in sequence: the check's round of messages
//! (`check.rs`), then libgloo's algorithm (a ring: `2(n - 1)` dependent steps for an
//! all-reduce). On a loaded machine each dependent message is a chance for a receiving thread
//! to wait for a scheduler time slice (4 ms on these machines), and a collective that follows
//! another one right away loses such a slice far more often than one that follows a barrier
//! (docs/performance.md, "Where this project is behind").
//!
//! Here a collective whose every message fits the shim's inline limit ([`ONE_ROUND_MAX`] bytes
//! of payload) on a communicator of at most [`DIRECT_MAX`] ranks is **one** round: every rank
//! sends every other rank one message, `[fingerprint | payload]`, and computes its result
//! locally from what arrives:
//! * all-reduce: its whole input to every rank; each rank reduces the `n` inputs in rank order
//!   with grid-core's kernels ([`kernels::reduce`]), so every rank holds the same bits (those
//!   of the host kernels, `Avg` included);
//! * all-gather: its block to every rank; reduce-scatter: block `j` of its input to rank `j`,
//!   which reduces the `n` blocks in rank order; all-to-all: block `j` to rank `j`;
//! * broadcast: the root's buffer to every rank (the others send their fingerprint alone);
//! * barrier: fingerprints alone (a rank leaves once every rank has arrived).
//!
//! The fingerprint is the check ([`DeferredCheck::fingerprint`]): every rank receives every
//! rank's, so a disagreement is the same [`Error::CollectiveMismatch`] on every rank
//! ([`DeferredCheck::verify_gathered`]) and no payload reaches the caller's memory before the
//! fingerprints agree. Ranks that disagree may disagree on the message lengths too: the
//! messages travel on the check's slots ([`Channel::Check`]), whose receives keep the first
//! bytes of a message of another length, so the fingerprint arrives whatever follows it. A
//! collective too large for one round sends its fingerprint alone the same way (one round),
//! then runs libgloo's algorithm; so a rank that runs one form and a rank that runs the other
//! still exchange fingerprints and both report the mismatch.
//!
//! An all-reduce too large for one round whose `n` blocks each fit a message runs as two: a
//! one-round reduce-scatter that carries the check, then a one-round all-gather of the reduced
//! blocks (each block reduced once, by its owner: the same bits everywhere).
//!
//! With the check off (`GRID_DEBUG=off`, [`grid_core::MismatchCheck::Off`]) the same rounds
//! carry the payloads alone on the collective's slots; ranks that disagree on a length then
//! get the length protocol's error naming the peer and both counts. An unchecked broadcast's
//! other ranks send nothing.
//!
//! [`crate::GlooConfig::one_round_max`] (or [`ONE_ROUND_ENV`]) lowers the limit; 0 sends every
//! collective with data through libgloo's algorithms.
//!
//! Volume: an all-reduce sends its input `n - 1` times (a ring sends about twice the input in
//! all), which at most 64 KiB per message and 16 ranks is at most 1 MiB per rank per call:
//! latency, not bandwidth, decides at these sizes.

use super::check::DIRECT_MAX;
use super::Inner;
use crate::ffi::{Channel, P2pMismatch, RawBlock, P2P_INLINE_MAX};
use grid_core::comm::round::{self, RoundOp, FP_BYTES};
use grid_core::{DeferredCheck, HostBuffer, HostSlice, HostSliceMut, ReduceOp, Result};
use std::time::Duration;

/// Largest payload (bytes) of one message of a one-round collective: the shim's inline limit
/// (64 KiB; the check's slots carry a fingerprint more inline), so that every message is one
/// Gloo message. The default and the largest value of [`crate::GlooConfig::one_round_max`].
pub const ONE_ROUND_MAX: usize = P2P_INLINE_MAX;

/// Environment variable that sets [`crate::GlooConfig::one_round_max`] (bytes, 0 to
/// [`ONE_ROUND_MAX`]) when the program leaves it at its default; the same on every rank.
pub const ONE_ROUND_ENV: &str = "GRID_GLOO_ONE_ROUND_MAX";

// The check's slots carry a fingerprint more than the inline limit in one message.
const _: () = assert!(crate::ffi::CHECK_INLINE_EXTRA == FP_BYTES);

impl Inner {
    /// Runs `c` as one round of messages when it fits ([`ONE_ROUND_MAX`], [`DIRECT_MAX`]),
    /// checked by `check` when there is one: `Ok(true)` when `c` has run. Otherwise runs the
    /// check alone (`Ok(false)`: the caller then runs `c` its usual way).
    pub(super) fn one_shot(
        &self,
        check: Option<&DeferredCheck>,
        c: RoundOp<'_>,
        tag: u32,
        limit: Duration,
    ) -> Result<bool> {
        let (me, n) = (self.rank(), self.size());
        let op = c.name();
        self.alive(op)?;
        let direct = n <= DIRECT_MAX && check.is_none_or(|c| c.fingerprints_suffice());
        let most = self.one_round_max;
        if n >= 2 && direct && c.largest_message(me, n) <= most {
            self.round(channel_of(check), check, op, c, tag, limit)?;
            return Ok(true);
        }
        if let RoundOp::AllReduce { send, recv, op: r } = c {
            let (len, w) = (recv.len(), recv.dtype().size_bytes());
            if n >= 2 && direct && len % n == 0 && len / n * w <= most {
                self.all_reduce_two_rounds(check, send, recv, r, tag, limit)?;
                return Ok(true);
            }
        }
        self.check_only(check, tag, limit)?;
        Ok(false)
    }

    /// An all-reduce whose `n` blocks each fit one message: a one-round reduce-scatter that
    /// carries the check (block `j` to rank `j`, each rank reducing its block in rank order),
    /// then a one-round all-gather of the reduced blocks. Two message latencies where
    /// libgloo's ring takes `2 (n - 1)` dependent steps after the check's round; every rank
    /// holds the same bits (each block reduced once, by its owner, with the kernels).
    fn all_reduce_two_rounds(
        &self,
        check: Option<&DeferredCheck>,
        send: Option<HostSlice<'_>>,
        mut recv: HostSliceMut<'_>,
        r: ReduceOp,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let k = recv.len() / self.size();
        let mut mine = HostBuffer::zeros(recv.dtype(), k);
        let scatter = RoundOp::ReduceScatter {
            send: Some(send.unwrap_or(recv.as_slice())),
            recv: mine.as_mut_slice(),
            op: r,
        };
        self.round(channel_of(check), check, OP, scatter, tag, limit)?;
        let gather = RoundOp::AllGather {
            send: Some(mine.as_slice()),
            recv: recv.reborrow(),
        };
        self.round(Channel::Collective, None, OP, gather, tag, limit)
    }

    /// The checks of collectives that never run as one round (the rooted and uneven ones):
    /// the fingerprints in one round where they suffice, else the check's exchanges.
    pub(super) fn check_only(
        &self,
        check: Option<&DeferredCheck>,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        let Some(ch) = check else { return Ok(()) };
        if self.size() <= DIRECT_MAX && ch.fingerprints_suffice() {
            self.round(
                Channel::Check,
                Some(ch),
                ch.op(),
                RoundOp::Barrier,
                tag,
                limit,
            )
        } else {
            self.verify(ch, tag, limit)
        }
    }

    /// The round itself (see the module docs) on the slots of `channel` (the check's when
    /// `check` is given; a check's own exchanges, [`Inner::verify`], use them too); `c` fits.
    /// Failures are those of operation `op` (the checked one: the check alone runs as a
    /// barrier's round, a two-round all-reduce as a reduce-scatter's and an all-gather's).
    pub(super) fn round(
        &self,
        channel: Channel,
        check: Option<&DeferredCheck>,
        op: &'static str,
        c: RoundOp<'_>,
        tag: u32,
        limit: Duration,
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let w = c.width();
        let head = if check.is_some() { FP_BYTES } else { 0 };
        // The memory kept from the last round; a round that finds it in use (collectives on
        // one communicator from several threads) takes memory of its own.
        let mut kept = self.rounds.try_lock().ok();
        let mut fresh = round::Memory::default();
        let round::Memory {
            received: recv,
            scratch,
        } = kept.as_deref_mut().unwrap_or(&mut fresh);
        let out = scratch.outgoing(&c, check, me, n)?;
        // An unchecked broadcast's other ranks have nothing to say: only the root's messages
        // travel (every rank knows the root; ranks that disagree on it wait until the time
        // limit). Every other form sends every message, empty or not (a barrier's are all
        // empty: they are the barrier).
        let root_only = check.is_none() && matches!(c, RoundOp::Broadcast { .. });
        let travels = |b: &RawBlock| !root_only || b.count > 0;
        let sent: Vec<RawBlock> = out
            .messages
            .iter()
            .map(|m| RawBlock {
                peer: m.peer,
                offset: m.offset,
                count: m.len,
            })
            .filter(travels)
            .collect();

        // Incoming: one slot per peer, of the length an agreeing peer sends.
        let mut recvs = Vec::with_capacity(n);
        let mut at = 0usize;
        for j in (0..n).filter(|&j| j != me) {
            let len = c.expected(j, n, head);
            recvs.push(RawBlock {
                peer: j,
                offset: at,
                count: len,
            });
            at += len;
        }
        // Zeroed: a peer whose message is shorter than expected (another version of this
        // library) leaves zeros, never the last round's bytes, where its fingerprint belongs.
        recv.clear();
        recv.resize(at, 0);
        let received: Vec<RawBlock> = recvs.iter().copied().filter(travels).collect();
        let mismatches = self
            .ctx
            .exchange_on(
                channel,
                HostSlice::U8(&out.bytes),
                &sent,
                HostSliceMut::U8(recv),
                &received,
                tag,
                limit,
            )
            .map_err(|e| self.fail_after(op, e, limit))?;
        // Rank `j`'s slot (`j != me`).
        let slot = |j: usize| {
            let b = &recvs[if j < me { j } else { j - 1 }];
            &recv[b.offset..b.offset + b.count]
        };
        if let Some(ch) = check {
            // A peer whose message was too short to hold a fingerprint (another version of
            // this library) is a mismatch too.
            round::verify_fingerprints(ch, me, n, &slot)?;
        }
        // The fingerprints agree (or there are none): a message of another length is a peer
        // that disagrees anyway (check off) or runs another version of this library.
        if let Some(m) = mismatches.first() {
            // In the collective's elements (the message is bytes after the fingerprint).
            let elements = |bytes: u64| bytes.saturating_sub(head as u64) / w as u64;
            let m = P2pMismatch {
                posted: (c.dtype(), elements(m.posted.1)),
                sent: (c.dtype(), elements(m.sent.1)),
                ..*m
            };
            return Err(self.block_mismatch(op, &m));
        }
        scratch.finish(c, me, n, &|j| &slot(j)[head..])
    }
}

/// The slots a round travels on: the check's when it carries the check's fingerprints (so
/// that it meets every other form of the same check), the collective's otherwise.
fn channel_of(check: Option<&DeferredCheck>) -> Channel {
    match check {
        Some(_) => Channel::Check,
        None => Channel::Collective,
    }
}
