//! Small collectives as **one round of messages** that carry their own mismatch check, for
//! backends that move bytes between ranks (Gloo, MPI): the part of that form that holds for
//! every backend. The backend moves the messages; this module says what each message holds and
//! computes every result from what arrived.
//!
//! In one round every rank sends every other rank one message, `[fingerprint | payload]`, and
//! computes its result locally:
//! * all-reduce: its whole input to every rank; each rank reduces the `n` inputs in rank order
//!   with the host kernels ([`kernels::reduce`]), so every rank holds the same bits (those of
//!   the host kernels, `Avg` included);
//! * all-gather: its block to every rank; reduce-scatter: block `j` of its input to rank `j`,
//!   which reduces the `n` blocks in rank order; all-to-all: block `j` to rank `j`;
//! * broadcast: the root's buffer to every rank (the others send their fingerprint alone);
//! * barrier: fingerprints alone (a rank leaves once every rank has arrived).
//!
//! The fingerprint ([`DeferredCheck::fingerprint`], [`FP_BYTES`] little-endian bytes) is the
//! check: every rank receives every rank's, so a disagreement is the same
//! [`crate::Error::CollectiveMismatch`] on every rank ([`verify_fingerprints`]), and no payload
//! reaches the caller's memory before the fingerprints agree. Ranks that disagree may disagree
//! on the message lengths too, so a backend must receive a message of any length without
//! writing past its memory and hand over at least its first [`FP_BYTES`] bytes. A collective
//! too large for one round sends its fingerprint alone the same way ([`RoundOp::Barrier`]
//! carrying the check), then runs its usual algorithm: a rank that runs one form and a rank
//! that runs the other still exchange fingerprints, and both report the mismatch.
//!
//! Without a check (`head` = 0) the same rounds carry the payloads alone.

use super::agree::DeferredCheck;
use super::dtype::{DType, HostBuffer, HostSlice, HostSliceMut, ReduceOp};
use super::kernels;
use crate::error::{Error, Result};

/// Bytes of a fingerprint at the start of a checked message (little-endian `i64`s).
pub const FP_BYTES: usize = DeferredCheck::FINGERPRINT_LEN * 8;

/// A collective that can run as one round of messages, on host memory whose lengths the front
/// end validated. `send`: this rank's input; `recv`: its output; `op`: the reduction.
#[derive(Debug)]
pub enum RoundOp<'a> {
    /// All-reduce; `send = None`: in place on `recv`.
    #[allow(missing_docs)]
    AllReduce {
        send: Option<HostSlice<'a>>,
        recv: HostSliceMut<'a>,
        op: ReduceOp,
    },
    /// Broadcast of `buf` from rank `root`.
    #[allow(missing_docs)]
    Broadcast { buf: HostSliceMut<'a>, root: usize },
    /// All-gather; `send = None`: in place, this rank's block at `rank · k` of `recv`.
    #[allow(missing_docs)]
    AllGather {
        send: Option<HostSlice<'a>>,
        recv: HostSliceMut<'a>,
    },
    /// Reduce-scatter; `send = None`: in place, `recv` is the whole input and this rank's
    /// block lands at `rank · k` of it.
    #[allow(missing_docs)]
    ReduceScatter {
        send: Option<HostSlice<'a>>,
        recv: HostSliceMut<'a>,
        op: ReduceOp,
    },
    /// All-to-all: block `j` of `send` to rank `j`, block `j` of `recv` from rank `j`.
    #[allow(missing_docs)]
    AllToAll {
        send: HostSlice<'a>,
        recv: HostSliceMut<'a>,
    },
    /// No data: the round is the barrier (or carries a check alone).
    Barrier,
}

/// One outgoing message of a round, for rank `peer`: `len` bytes at `offset` of
/// [`Outgoing::bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Message {
    pub peer: usize,
    pub offset: usize,
    pub len: usize,
}

/// Every message a rank sends in one round: the `bytes` of all of them and one [`Message`] per
/// peer in `messages` (in rank order, this rank left out). Messages with the same contents share
/// their bytes.
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct Outgoing {
    pub bytes: Vec<u8>,
    pub messages: Vec<Message>,
}

impl RoundOp<'_> {
    /// The operation's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            RoundOp::AllReduce { .. } => "all_reduce",
            RoundOp::Broadcast { .. } => "broadcast",
            RoundOp::AllGather { .. } => "all_gather",
            RoundOp::ReduceScatter { .. } => "reduce_scatter",
            RoundOp::AllToAll { .. } => "all_to_all",
            RoundOp::Barrier => "barrier",
        }
    }

    /// Element type of the payloads (bytes for a barrier, which has none).
    pub fn dtype(&self) -> DType {
        match self {
            RoundOp::AllReduce { recv, .. }
            | RoundOp::AllGather { recv, .. }
            | RoundOp::ReduceScatter { recv, .. }
            | RoundOp::AllToAll { recv, .. } => recv.dtype(),
            RoundOp::Broadcast { buf, .. } => buf.dtype(),
            RoundOp::Barrier => DType::U8,
        }
    }

    /// Element size of the payloads.
    pub fn width(&self) -> usize {
        self.dtype().size_bytes()
    }

    /// `k`: the elements of one rank's block (all-gather, reduce-scatter, all-to-all).
    fn block(&self, n: usize) -> usize {
        match self {
            RoundOp::AllGather { recv, .. } => recv.len() / n,
            RoundOp::ReduceScatter {
                send: Some(_),
                recv,
                ..
            } => recv.len(),
            RoundOp::ReduceScatter {
                send: None, recv, ..
            } => recv.len() / n,
            RoundOp::AllToAll { send, .. } => send.len() / n,
            _ => 0,
        }
    }

    /// Elements this rank expects from rank `j` (not itself).
    fn incoming(&self, j: usize, n: usize) -> usize {
        match self {
            RoundOp::AllReduce { recv, .. } => recv.len(),
            RoundOp::Broadcast { buf, root } => {
                if j == *root {
                    buf.len()
                } else {
                    0
                }
            }
            RoundOp::Barrier => 0,
            _ => self.block(n),
        }
    }

    /// Whether this rank sends the same payload to every rank (else block `j` to rank `j`).
    fn same_to_all(&self) -> bool {
        !matches!(
            self,
            RoundOp::ReduceScatter { .. } | RoundOp::AllToAll { .. }
        )
    }

    /// The payload this rank sends to rank `j` (`me`: this rank of `n`); out-of-range blocks
    /// (ruled out by the front end's validation) are an error.
    fn outgoing(&self, j: usize, me: usize, n: usize) -> Result<Option<HostSlice<'_>>> {
        let (k, op) = (self.block(n), self.name());
        Ok(match self {
            RoundOp::AllReduce { send, recv, .. } => Some(send.unwrap_or(recv.as_slice())),
            RoundOp::Broadcast { buf, root } => (me == *root).then(|| buf.as_slice()),
            RoundOp::AllGather { send: Some(s), .. } => Some(*s),
            RoundOp::AllGather { send: None, recv } => Some(part(op, recv.as_slice(), me * k, k)?),
            RoundOp::ReduceScatter { send: Some(s), .. } => Some(part(op, *s, j * k, k)?),
            RoundOp::ReduceScatter {
                send: None, recv, ..
            } => Some(part(op, recv.as_slice(), j * k, k)?),
            RoundOp::AllToAll { send, .. } => Some(part(op, *send, j * k, k)?),
            RoundOp::Barrier => None,
        })
    }

    /// The largest payload of any message of this rank (bytes), sent or expected.
    pub fn largest_message(&self, me: usize, n: usize) -> usize {
        let w = self.width();
        (0..n)
            .filter(|&j| j != me)
            .map(|j| {
                let out = self
                    .outgoing(j, me, n)
                    .ok()
                    .flatten()
                    .map_or(0, |s| s.len());
                out.max(self.incoming(j, n)) * w
            })
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the message this rank expects from rank `j` when every rank agrees, with a
    /// fingerprint of `head` bytes (0 or [`FP_BYTES`]).
    pub fn expected(&self, j: usize, n: usize, head: usize) -> usize {
        head + self.incoming(j, n) * self.width()
    }

    /// The messages of this rank (`me` of `n`): `check`'s fingerprint first when given, then
    /// the payload (little-endian).
    pub fn outgoing_messages(
        &self,
        check: Option<&DeferredCheck>,
        me: usize,
        n: usize,
    ) -> Result<Outgoing> {
        let mut out = Outgoing::default();
        self.outgoing_messages_into(check, me, n, &mut out)?;
        Ok(out)
    }

    /// [`RoundOp::outgoing_messages`] into `out`, whose memory is reused (its contents are
    /// replaced): a round in a loop allocates nothing for its messages.
    pub fn outgoing_messages_into(
        &self,
        check: Option<&DeferredCheck>,
        me: usize,
        n: usize,
        out: &mut Outgoing,
    ) -> Result<()> {
        let w = self.width();
        let head = if check.is_some() { FP_BYTES } else { 0 };
        out.bytes.clear();
        out.messages.clear();
        for j in (0..n).filter(|&j| j != me) {
            if let (true, Some(first)) = (self.same_to_all(), out.messages.first()) {
                out.messages.push(Message { peer: j, ..*first });
                continue;
            }
            let payload = self.outgoing(j, me, n)?;
            let len = head + payload.map_or(0, |p| p.len() * w);
            let at = out.bytes.len();
            out.bytes.resize(at + len, 0u8);
            if let Some(ch) = check {
                HostSlice::I64(ch.fingerprint()).write_le_bytes(&mut out.bytes[at..at + head])?;
            }
            if let Some(p) = payload {
                p.write_le_bytes(&mut out.bytes[at + head..at + len])?;
            }
            out.messages.push(Message {
                peer: j,
                offset: at,
                len,
            });
        }
        Ok(())
    }

    /// Computes this rank's result from the payloads that arrived: `payload(j)` is the payload
    /// (fingerprint stripped) from rank `j`, of the expected length ([`RoundOp::expected`]).
    /// Call it only once the fingerprints agree ([`verify_fingerprints`]). A backend that runs
    /// rounds in a loop keeps a [`Scratch`] and calls [`Scratch::finish`] instead, which
    /// reuses the memory of the decoded payloads.
    pub fn finish<'p>(
        self,
        me: usize,
        n: usize,
        payload: &dyn Fn(usize) -> &'p [u8],
    ) -> Result<()> {
        Scratch::default().finish(self, me, n, payload)
    }
}

/// Everything a backend keeps per communicator for its rounds: the bytes it received (laid out
/// as the backend moves them) and the [`Scratch`]. A backend keeps one behind a lock and takes
/// a fresh one when the lock is held (collectives on one communicator from several threads).
#[derive(Debug, Default)]
pub struct Memory {
    /// The received messages, reused from round to round (the backend sizes and clears it).
    pub received: Vec<u8>,
    /// The outgoing messages and the decoded payloads.
    pub scratch: Scratch,
}

/// Memory a backend keeps from one round to the next, so that a round in a loop (the same
/// collective, dtype and count) allocates nothing for its messages or for the payloads it
/// decodes: the outgoing messages ([`Scratch::outgoing`]) and the decoded inputs of a
/// reduction ([`Scratch::finish`]). It holds no state between rounds that changes a result.
#[derive(Debug, Default)]
pub struct Scratch {
    out: Outgoing,
    /// The reductions' inputs: the peers' payloads decoded, in rank order without this rank,
    /// then this rank's own input where the output overwrites it (in place).
    inputs: Vec<HostBuffer>,
}

impl Scratch {
    /// This rank's messages for round `c` ([`RoundOp::outgoing_messages`]), built in this
    /// scratch's memory.
    pub fn outgoing(
        &mut self,
        c: &RoundOp<'_>,
        check: Option<&DeferredCheck>,
        me: usize,
        n: usize,
    ) -> Result<&Outgoing> {
        c.outgoing_messages_into(check, me, n, &mut self.out)?;
        Ok(&self.out)
    }

    /// [`RoundOp::finish`]: this rank's result of `c` from the payloads that arrived, the
    /// decoded payloads kept in this scratch's memory.
    pub fn finish<'p>(
        &mut self,
        c: RoundOp<'_>,
        me: usize,
        n: usize,
        payload: &dyn Fn(usize) -> &'p [u8],
    ) -> Result<()> {
        let op = c.name();
        let w = c.width();
        let k = c.block(n);
        let peers = || (0..n).filter(move |&j| j != me);
        match c {
            RoundOp::Barrier => Ok(()),
            RoundOp::Broadcast { mut buf, root } => {
                if root == me {
                    Ok(())
                } else {
                    buf.read_le_bytes(payload(root))
                }
            }
            RoundOp::AllToAll { send, mut recv } => {
                copy_into(op, &mut recv, me * k, part(op, send, me * k, k)?)?;
                for j in peers() {
                    read_at(op, &mut recv, j * k, k, payload(j))?;
                }
                Ok(())
            }
            RoundOp::AllGather { send, mut recv } => {
                if let Some(s) = send {
                    copy_into(op, &mut recv, me * k, s)?;
                }
                for j in peers() {
                    read_at(op, &mut recv, j * k, k, payload(j))?;
                }
                Ok(())
            }
            RoundOp::AllReduce { send, recv, op: r } => {
                let dtype = recv.dtype();
                self.decode_peers(me, n, dtype, w, payload)?;
                let (others, spare) = self.inputs.split_at_mut(n - 1);
                // In place, this rank's input is the output: reduce from a copy.
                let own = match send {
                    Some(s) => s,
                    None => keep(&mut spare[0], recv.as_slice())?,
                };
                kernels::reduce(&in_rank_order(me, own, others), recv, r)
            }
            RoundOp::ReduceScatter {
                send,
                mut recv,
                op: r,
            } => {
                let dtype = recv.dtype();
                self.decode_peers(me, n, dtype, w, payload)?;
                let (others, spare) = self.inputs.split_at_mut(n - 1);
                match send {
                    Some(s) => {
                        let own = part(op, s, me * k, k)?;
                        kernels::reduce(&in_rank_order(me, own, others), recv, r)
                    }
                    None => {
                        // This rank's block is an input and the output: reduce from a copy.
                        let own = keep(&mut spare[0], part(op, recv.as_slice(), me * k, k)?)?;
                        let inputs = in_rank_order(me, own, others);
                        let len = recv.len();
                        let out = recv
                            .sub_mut(me * k, k)
                            .ok_or_else(|| outside(op, me * k, k, len))?;
                        kernels::reduce(&inputs, out, r)
                    }
                }
            }
        }
    }

    /// Decodes every peer's payload (`dtype`, `w` bytes an element) into `inputs[..n - 1]`,
    /// in rank order, reusing the buffers of the last round where they fit.
    fn decode_peers<'p>(
        &mut self,
        me: usize,
        n: usize,
        dtype: DType,
        w: usize,
        payload: &dyn Fn(usize) -> &'p [u8],
    ) -> Result<()> {
        if self.inputs.len() < n {
            self.inputs
                .resize_with(n, || HostBuffer::zeros(DType::U8, 0));
        }
        for (slot, j) in self.inputs.iter_mut().zip((0..n).filter(|&j| j != me)) {
            let bytes = payload(j);
            resize(slot, dtype, bytes.len() / w);
            slot.as_mut_slice().read_le_bytes(bytes)?;
        }
        Ok(())
    }
}

/// A copy of `own` in `slot` (for a reduction whose output overwrites this rank's input).
fn keep<'s>(slot: &'s mut HostBuffer, own: HostSlice<'_>) -> Result<HostSlice<'s>> {
    resize(slot, own.dtype(), own.len());
    slot.as_mut_slice().copy_from(own)?;
    Ok(slot.as_slice())
}

/// Makes `slot` a buffer of `len` elements of `dtype`, keeping its memory when it already is
/// one (its contents are then the last round's: the caller overwrites them).
fn resize(slot: &mut HostBuffer, dtype: DType, len: usize) {
    if slot.dtype() != dtype || slot.len() != len {
        *slot = HostBuffer::zeros(dtype, len);
    }
}

/// The check of one round: every rank's fingerprint, this rank's (`me` of `n`) from `check`
/// and rank `j`'s from the first [`FP_BYTES`] of `head(j)` (a message too short to hold one,
/// from another version of this library, counts as a fingerprint of zeros, which differs).
/// `Ok` when all agree, otherwise the same [`crate::Error::CollectiveMismatch`] on every rank
/// ([`DeferredCheck::compare_gathered`]; an all-to-all-v's counts still need
/// [`DeferredCheck::verify`]).
pub fn verify_fingerprints<'h>(
    check: &DeferredCheck,
    me: usize,
    n: usize,
    head: &dyn Fn(usize) -> &'h [u8],
) -> Result<()> {
    // Every fingerprint equal to this rank's: the check passes, nothing to build.
    let mut mine = [0u8; FP_BYTES];
    HostSlice::I64(check.fingerprint()).write_le_bytes(&mut mine)?;
    if (0..n)
        .filter(|&j| j != me)
        .all(|j| head(j).get(..FP_BYTES) == Some(&mine[..]))
    {
        return Ok(());
    }
    // A disagreement: the table of every rank's fingerprint, from which every rank builds the
    // same error.
    let fp = DeferredCheck::FINGERPRINT_LEN;
    let mut all = vec![0i64; n * fp];
    all[me * fp..(me + 1) * fp].copy_from_slice(check.fingerprint());
    for j in (0..n).filter(|&j| j != me) {
        if let Some(bytes) = head(j).get(..FP_BYTES) {
            HostSliceMut::I64(&mut all[j * fp..(j + 1) * fp]).read_le_bytes(bytes)?;
        }
    }
    check.compare_gathered(&all)
}

/// The inputs of a reduction in rank order: this rank's at `me`, the others' around it.
fn in_rank_order<'a>(
    me: usize,
    own: HostSlice<'a>,
    others: &'a [HostBuffer],
) -> Vec<HostSlice<'a>> {
    let (before, after) = others.split_at(me.min(others.len()));
    let mut inputs: Vec<HostSlice<'a>> = Vec::with_capacity(others.len() + 1);
    inputs.extend(before.iter().map(HostBuffer::as_slice));
    inputs.push(own);
    inputs.extend(after.iter().map(HostBuffer::as_slice));
    inputs
}

/// A sub-slice that must exist (the front end checked the lengths; an unchecked disagreement
/// between ranks is reported, not a panic).
pub fn part<'a>(
    op: &'static str,
    s: HostSlice<'a>,
    start: usize,
    len: usize,
) -> Result<HostSlice<'a>> {
    s.sub(start, len)
        .ok_or_else(|| outside(op, start, len, s.len()))
}

/// The error of elements `at..at + len` outside a buffer of `of` elements (ruled out by the
/// front end's validation: an unchecked disagreement between ranks, reported, never a panic).
fn outside(op: &'static str, at: usize, len: usize, of: usize) -> Error {
    Error::Invalid(format!(
        "{op}: elements {at}..{} do not lie inside a buffer of {of} elements",
        at.saturating_add(len)
    ))
}

/// Copies `src` into `dst` at element `at`.
pub fn copy_into(
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

/// Reads `k` elements from `bytes` into `dst` at element `at`.
fn read_at(
    op: &'static str,
    dst: &mut HostSliceMut<'_>,
    at: usize,
    k: usize,
    bytes: &[u8],
) -> Result<()> {
    let len = dst.len();
    dst.sub_mut(at, k)
        .ok_or_else(|| outside(op, at, k, len))?
        .read_le_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one round among `n` simulated ranks: every rank's messages, delivered to every
    /// other rank, then every rank's result.
    fn simulate(ops: Vec<RoundOp<'_>>, checks: Option<&[DeferredCheck]>) -> Vec<Result<()>> {
        let mut scratches: Vec<Scratch> = ops.iter().map(|_| Scratch::default()).collect();
        simulate_with(ops, checks, &mut scratches)
    }

    /// [`simulate`] with each rank's [`Scratch`] kept by the caller (as a backend keeps it
    /// from one round to the next).
    fn simulate_with(
        mut ops: Vec<RoundOp<'_>>,
        checks: Option<&[DeferredCheck]>,
        scratches: &mut [Scratch],
    ) -> Vec<Result<()>> {
        let n = ops.len();
        let outs: Vec<Outgoing> = ops
            .iter()
            .enumerate()
            .map(|(me, o)| {
                let mut out = Outgoing::default();
                // Through the scratch, then copied out: every rank's messages must outlive
                // the other ranks' calls here.
                let sent = scratches[me]
                    .outgoing(o, checks.map(|c| &c[me]), me, n)
                    .unwrap();
                out.bytes.extend_from_slice(&sent.bytes);
                out.messages.extend_from_slice(&sent.messages);
                out
            })
            .collect();
        let head = if checks.is_some() { FP_BYTES } else { 0 };
        let msg = |from: usize, to: usize| -> &[u8] {
            let m = outs[from].messages.iter().find(|m| m.peer == to).unwrap();
            &outs[from].bytes[m.offset..m.offset + m.len]
        };
        ops.drain(..)
            .enumerate()
            .map(|(me, o)| {
                if let Some(c) = checks {
                    verify_fingerprints(&c[me], me, n, &|j| msg(j, me))?;
                }
                scratches[me].finish(o, me, n, &|j| &msg(j, me)[head..])
            })
            .collect()
    }

    /// A scratch kept from round to round gives every round the result of a fresh one,
    /// whatever the rounds before it were (other dtypes, counts, forms, a failed check).
    #[test]
    fn a_kept_scratch_never_leaks_one_round_into_the_next() {
        let n = 3;
        let mut scratches: Vec<Scratch> = (0..n).map(|_| Scratch::default()).collect();
        for round in 0..4 {
            // In-place f32 sum of 4 elements: sum over ranks of (rank + 1) · (i + round).
            let mut bufs: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..4).map(|i| ((r + 1) * (i + round)) as f32).collect())
                .collect();
            let ops = bufs
                .iter_mut()
                .map(|b| RoundOp::AllReduce {
                    send: None,
                    recv: HostSliceMut::F32(b),
                    op: ReduceOp::Sum,
                })
                .collect();
            assert!(simulate_with(ops, None, &mut scratches)
                .iter()
                .all(Result::is_ok));
            let want: Vec<f32> = (0..4).map(|i| (6 * (i + round)) as f32).collect();
            assert!(bufs.iter().all(|b| *b == want), "round {round}: {bufs:?}");

            // Out-of-place i32 max of 2 + round elements.
            let len = 2 + round;
            let ins: Vec<Vec<i32>> = (0..n)
                .map(|r| (0..len).map(|i| (r * 10 + i) as i32 - 7).collect())
                .collect();
            let mut outs = vec![vec![0i32; len]; n];
            let ops = ins
                .iter()
                .zip(outs.iter_mut())
                .map(|(i, o)| RoundOp::AllReduce {
                    send: Some(HostSlice::I32(i)),
                    recv: HostSliceMut::I32(o),
                    op: ReduceOp::Max,
                })
                .collect();
            assert!(simulate_with(ops, None, &mut scratches)
                .iter()
                .all(Result::is_ok));
            assert!(outs.iter().all(|o| *o == ins[n - 1]), "round {round}");

            // In-place reduce-scatter of f64, blocks of 2: rank r keeps block r.
            let mut bufs: Vec<Vec<f64>> = (0..n)
                .map(|r| (0..2 * n).map(|i| (r * 100 + i) as f64).collect())
                .collect();
            let ops = bufs
                .iter_mut()
                .map(|b| RoundOp::ReduceScatter {
                    send: None,
                    recv: HostSliceMut::F64(b),
                    op: ReduceOp::Sum,
                })
                .collect();
            assert!(simulate_with(ops, None, &mut scratches)
                .iter()
                .all(Result::is_ok));
            for (r, b) in bufs.iter().enumerate() {
                let want: Vec<f64> = (2 * r..2 * r + 2).map(|i| (300 + 3 * i) as f64).collect();
                assert_eq!(b[2 * r..2 * r + 2], want[..], "round {round}, rank {r}");
            }

            // A disagreement in between: the same error everywhere, nothing written.
            let fp = |count: usize| DeferredCheck::for_test("all_reduce", DType::F32, count, n);
            let checks = [fp(2), fp(2), fp(3)];
            let mut bufs = [vec![1.0f32; 2], vec![1.0; 2], vec![1.0; 3]];
            let ops = bufs
                .iter_mut()
                .map(|b| RoundOp::AllReduce {
                    send: None,
                    recv: HostSliceMut::F32(b),
                    op: ReduceOp::Sum,
                })
                .collect();
            let errs: Vec<String> = simulate_with(ops, Some(&checks), &mut scratches)
                .into_iter()
                .map(|r| r.unwrap_err().to_string())
                .collect();
            assert!(errs.iter().all(|e| *e == errs[0]), "{errs:?}");
            assert!(bufs.iter().all(|b| b.iter().all(|&v| v == 1.0)));
        }
    }

    #[test]
    fn every_form_computes_what_the_collective_defines() {
        // All-reduce, out of place and in place, 3 ranks.
        let ins = [[1.0f32, 2.0], [10.0, 20.0], [100.0, 200.0]];
        let mut outs = [[0.0f32; 2]; 3];
        let ops = ins
            .iter()
            .zip(outs.iter_mut())
            .map(|(i, o)| RoundOp::AllReduce {
                send: Some(HostSlice::F32(i)),
                recv: HostSliceMut::F32(o),
                op: ReduceOp::Sum,
            })
            .collect();
        assert!(simulate(ops, None).iter().all(Result::is_ok));
        assert!(outs.iter().all(|o| *o == [111.0, 222.0]));

        // In-place all-gather and reduce-scatter, 2 ranks.
        let mut bufs = [[1i32, 0], [0, 2]];
        let ops = bufs
            .iter_mut()
            .map(|b| RoundOp::AllGather {
                send: None,
                recv: HostSliceMut::I32(b),
            })
            .collect();
        assert!(simulate(ops, None).iter().all(Result::is_ok));
        assert_eq!(bufs, [[1, 2], [1, 2]]);
        let mut bufs = [[1i32, 2], [10, 20]];
        let ops = bufs
            .iter_mut()
            .map(|b| RoundOp::ReduceScatter {
                send: None,
                recv: HostSliceMut::I32(b),
                op: ReduceOp::Max,
            })
            .collect();
        assert!(simulate(ops, None).iter().all(Result::is_ok));
        assert_eq!((bufs[0][0], bufs[1][1]), (10, 20));

        // Broadcast from rank 1 of 3.
        let mut bufs = [[0u8; 3], [7, 8, 9], [0; 3]];
        let ops = bufs
            .iter_mut()
            .map(|b| RoundOp::Broadcast {
                buf: HostSliceMut::U8(b),
                root: 1,
            })
            .collect();
        assert!(simulate(ops, None).iter().all(Result::is_ok));
        assert!(bufs.iter().all(|b| *b == [7, 8, 9]));
    }

    #[test]
    fn a_disagreement_is_the_same_error_on_every_rank_and_writes_nothing() {
        let fp = |count: usize| DeferredCheck::for_test("all_reduce", DType::F32, count, 2);
        let checks = [fp(2), fp(3)];
        let (mut a, mut b) = ([1.0f32; 2], [1.0f32; 3]);
        let ops = vec![
            RoundOp::AllReduce {
                send: None,
                recv: HostSliceMut::F32(&mut a),
                op: ReduceOp::Sum,
            },
            RoundOp::AllReduce {
                send: None,
                recv: HostSliceMut::F32(&mut b),
                op: ReduceOp::Sum,
            },
        ];
        let results = simulate(ops, Some(&checks));
        let errs: Vec<String> = results
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        assert_eq!(errs[0], errs[1]);
        assert!(
            errs[0].contains("count") && errs[0].contains("rank 0: 2"),
            "{}",
            errs[0]
        );
        assert_eq!((a, b), ([1.0; 2], [1.0; 3]));
        // A message too short to hold a fingerprint is a disagreement, not a panic.
        let e = verify_fingerprints(&checks[0], 0, 2, &|_| &[1u8, 2][..]).unwrap_err();
        assert!(e.to_string().contains("rank 1: "), "{e}");
    }
}
