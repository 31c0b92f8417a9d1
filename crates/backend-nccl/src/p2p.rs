//! How point-to-point operations reach NCCL: which communicator and stream a send or receive is
//! enqueued on, and when. Pure logic (no CUDA), tested on CPU; the backend follows it.
//!
//! # NCCL's rules this relies on
//! 1. **One communicator's operations run one after the other.** Every enqueue on a
//!    communicator makes the launch stream wait for the communicator's internal device stream
//!    and then advances that stream to the kernel's end (`ncclLaunchPrepare` /
//!    `ncclLaunchFinish` in NCCL's `src/enqueue.cc`: `ncclStreamWaitStream(launchStream,
//!    deviceStream, ...)`, `ncclStreamAdvanceToEvent(..., deviceStream, finishedEvent)`). So two
//!    operations of **one** communicator never overlap, whatever CUDA streams they are given, and
//!    communicators created with `splitShare = 1` share that device stream with their parent.
//!    A second stream of the same communicator therefore does not help.
//! 2. **A send and a receive need each other.** "Any point-to-point communication needs two NCCL
//!    calls: a call to ncclSend on one rank and a corresponding ncclRecv on the other rank";
//!    "calls within a group can be seen as progressing independently, hence should never block
//!    each other. It is therefore important to merge calls that need to progress concurrently to
//!    avoid deadlocks" (NCCL user guide, *Point-to-point communication*). Ungrouped calls do
//!    block each other: with rule 1, two ranks that each enqueue `send(peer)` then
//!    `recv(peer)` on one communicator each run the send first and wait for a receive that is
//!    queued behind the other rank's send: a deadlock (unless the message happens to fit in
//!    NCCL's buffers, which nothing promises). An `irecv(left); isend(right)` ring deadlocks the
//!    same way.
//! 3. **Several communicators of one device** may run at the same time on different streams
//!    when their kernels fit on the GPU together (NCCL user guide, *Using multiple NCCL
//!    communicators concurrently*). Since NCCL 2.26, `NCCL_LAUNCH_ORDER_IMPLICIT=1` orders them
//!    by host launch order; with CUDA runtime and driver 12.3 or newer "overlapped execution is
//!    permitted", on older CUDA "the operations will be serialized" (NCCL user guide, environment
//!    variables). The variable is off by default.
//!
//! # The design: two point-to-point lanes per communicator
//! A communicator that posts point-to-point operations at once ([`P2pPosting::Lanes`], the
//! default) gets two extra NCCL communicators with the same ranks, split from it when it is
//! created (creation is the only moment every member is known to make the same call; a split
//! at the first `isend` would be a collective call that the other members never make) and each
//! with its own CUDA stream:
//! * [`Lane::Up`] carries every message from a lower rank to a higher one (sends to a higher
//!   rank, receives from a lower one);
//! * [`Lane::Down`] every message from a higher rank to a lower one.
//!
//! Every single send and receive (`send`, `recv`, `isend`, `irecv`) is enqueued when it is
//! called, alone, on its lane ([`lane`]). Messages of one direction between two ranks are thus
//! on one communicator in call order on both sides, so they pair up in order (rule 1 makes a
//! communicator a FIFO, which is what NCCL's matching needs) and keep MPI's non-overtaking order
//! among themselves. A two-rank exchange (`isend(peer); irecv(peer)` on both ranks, in any
//! order) puts the two directions on different communicators and streams, which run
//! concurrently (rule 3), so it cannot deadlock; rings in either direction neither. An `isend`
//! followed by a blocking collective on another communicator completes because the send is
//! already enqueued when the collective starts (no later call has to post it). `batch_p2p`
//! splits its operations by lane ([`split_batch`]) and posts each lane's share as one NCCL group,
//! both before waiting on either, so a batch still progresses as a whole and stays ordered with
//! the single calls of the same direction.
//!
//! What the lanes do not cover: a pattern among three or more ranks whose per-lane FIFO order
//! forms a cycle (for example rank 0 sends to 2 then to 1, rank 1 receives from 0 only after
//! sending to 2, rank 2 receives from 1 before receiving from 0) can still wait forever, where
//! MPI would complete it; issue such patterns as one `batch_p2p`.
//!
//! # Where operations are still held back
//! With [`P2pPosting::HoldBack`] nonblocking sends and receives are held back and posted as one
//! NCCL group on the communicator itself before this process's next action on the GPU
//! ([`crate::engine::Outbox`]). That is the only safe design when NCCL serialises the kernels of
//! all communicators of a device (rule 3 with `NCCL_LAUNCH_ORDER_IMPLICIT=1` on CUDA older than
//! 12.3): the two lanes of an exchange would then run one after the other and deadlock, while one
//! group progresses as a whole (rule 2). [`resolve_posting`] switches to it in that case, and it
//! can be chosen to save the two extra communicators per communicator
//! ([`crate::NcclOptions::p2p`]). Every rank of a communicator must use the same posting mode
//! (the lanes are split collectively).
//!
//! The cost of the lanes: two more `ncclCommSplit` calls when a communicator is created, and two
//! more NCCL communicators (created with `splitShare = 0`, since a shared device stream would
//! serialise them with the parent by rule 1). NCCL connects peers lazily (on the first operation
//! between two ranks), so a lane that carries nothing costs no connection buffers.
//!
//! PyTorch's `ProcessGroupNCCL` answers the same problem with one two-rank communicator per pair
//! of ranks, created at the first send between them with a unique id passed through its key-value
//! store, and one stream for both directions (`pointToPoint`, "For single P2P, preserve the old
//! two-rank behavior"); this crate has no store, and one stream for both directions would keep
//! the exchange deadlock of rule 2.
//!
//! ```
//! use backend_nccl::p2p::{lane, Lane};
//! assert_eq!(lane(1, 3, true), Lane::Up);    // rank 1 sends to rank 3
//! assert_eq!(lane(3, 1, false), Lane::Up);   // rank 3 receives that message
//! assert_eq!(lane(3, 1, true), Lane::Down);  // the reply
//! assert_eq!(lane(1, 3, false), Lane::Down);
//! ```

/// One of the two point-to-point communicators of a communicator (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Messages from a lower rank to a higher one (and a rank's messages to itself).
    Up,
    /// Messages from a higher rank to a lower one.
    Down,
}

impl Lane {
    /// `"p2p-up"` or `"p2p-down"`: the suffix of the lane's communicator name.
    pub fn suffix(self) -> &'static str {
        match self {
            Lane::Up => "p2p-up",
            Lane::Down => "p2p-down",
        }
    }

    /// The index of the lane in `[Up, Down]`.
    pub fn index(self) -> usize {
        match self {
            Lane::Up => 0,
            Lane::Down => 1,
        }
    }
}

/// The lane of a send from `me` to `peer` (`send = true`) or of a receive by `me` from `peer`:
/// the direction of the message, from its sender's rank to its receiver's. A rank's messages
/// to itself (possible only inside `batch_p2p`) go up, so that both halves are in one group.
pub fn lane(me: usize, peer: usize, send: bool) -> Lane {
    let (from, to) = if send { (me, peer) } else { (peer, me) };
    if from <= to {
        Lane::Up
    } else {
        Lane::Down
    }
}

/// Splits a batch of point-to-point operations, given as `(send, peer)` in call order, into the
/// indices each lane posts as one group, each in call order: `[up, down]`.
///
/// ```
/// use backend_nccl::p2p::split_batch;
/// // Rank 1 of a ring: send to 2, receive from 0, send to 0, receive from 2.
/// let [up, down] = split_batch(1, &[(true, 2), (false, 0), (true, 0), (false, 2)]);
/// assert_eq!(up, vec![0, 1]);
/// assert_eq!(down, vec![2, 3]);
/// ```
pub fn split_batch(me: usize, ops: &[(bool, usize)]) -> [Vec<usize>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    for (i, &(send, peer)) in ops.iter().enumerate() {
        out[lane(me, peer, send).index()].push(i);
    }
    out
}

/// How a communicator posts its single (non-batch) sends and receives. Every rank of a
/// communicator must use the same mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum P2pPosting {
    /// Enqueued when called, on the communicator's two point-to-point lanes (see the module
    /// docs). Costs two extra NCCL communicators per communicator. The default.
    #[default]
    Lanes,
    /// Nonblocking sends and receives are held back and posted as one NCCL group on the
    /// communicator itself before this process's next action on the GPU; blocking ones run
    /// on the communicator itself. No extra communicators.
    HoldBack,
}

/// The CUDA version from which NCCL's implicit launch order lets kernels of different
/// communicators overlap (`12030`, CUDA 12.3).
pub const OVERLAPPED_LAUNCH_ORDER_CUDA: i32 = 12030;

/// The posting mode actually used for `requested`, given the value of the environment variable
/// `NCCL_LAUNCH_ORDER_IMPLICIT` and the CUDA driver version (`cuDriverGetVersion`, e.g. 12040):
/// [`P2pPosting::HoldBack`] with the reason when NCCL would serialise the kernels of all
/// communicators of the device (implicit launch order on, CUDA older than 12.3), since the two
/// lanes of an exchange must then not wait for each other (see the module docs). NCCL reads the
/// variable as an integer; any value other than `0` (after trimming) counts as on.
///
/// ```
/// use backend_nccl::p2p::{resolve_posting, P2pPosting};
/// assert_eq!(resolve_posting(P2pPosting::Lanes, None, Some(12020)).0, P2pPosting::Lanes);
/// assert_eq!(resolve_posting(P2pPosting::Lanes, Some("1"), Some(12040)).0, P2pPosting::Lanes);
/// let (mode, why) = resolve_posting(P2pPosting::Lanes, Some("1"), Some(12020));
/// assert_eq!(mode, P2pPosting::HoldBack);
/// assert!(why.unwrap().contains("NCCL_LAUNCH_ORDER_IMPLICIT=1"));
/// ```
pub fn resolve_posting(
    requested: P2pPosting,
    launch_order_implicit: Option<&str>,
    cuda_driver: Option<i32>,
) -> (P2pPosting, Option<String>) {
    if requested == P2pPosting::HoldBack {
        return (requested, None);
    }
    let implicit = launch_order_implicit
        .map(str::trim)
        .is_some_and(|v| !v.is_empty() && v != "0");
    if !implicit {
        return (requested, None);
    }
    match cuda_driver {
        Some(v) if v >= OVERLAPPED_LAUNCH_ORDER_CUDA => (requested, None),
        other => (
            P2pPosting::HoldBack,
            Some(format!(
                "NCCL_LAUNCH_ORDER_IMPLICIT=1 with CUDA driver {} (< 12.3) makes NCCL serialise the kernels of every communicator of a device, so sends and receives on separate point-to-point communicators could wait for each other; they are held back and posted as one group instead",
                other.map_or("unknown".to_string(), |v| format!("{}.{}", v / 1000, (v % 1000) / 10))
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_of_a_message_agree_on_its_lane() {
        for a in 0..6 {
            for b in 0..6 {
                assert_eq!(lane(a, b, true), lane(b, a, false), "{a} -> {b}");
            }
        }
        assert_eq!(lane(2, 2, true), Lane::Up);
        assert_eq!(lane(2, 2, false), Lane::Up);
    }

    #[test]
    fn an_exchange_uses_both_lanes() {
        // Rank 0 and rank 1 each send to and receive from the other.
        assert_ne!(lane(0, 1, true), lane(0, 1, false));
        assert_ne!(lane(1, 0, true), lane(1, 0, false));
    }

    #[test]
    fn posting_falls_back_only_when_nccl_serialises() {
        use P2pPosting::*;
        assert_eq!(resolve_posting(Lanes, Some("0"), Some(11080)).0, Lanes);
        assert_eq!(resolve_posting(Lanes, Some(" 1 "), None).0, HoldBack);
        assert_eq!(resolve_posting(Lanes, Some("1"), Some(12030)).0, Lanes);
        assert_eq!(resolve_posting(HoldBack, None, None), (HoldBack, None));
        let why = resolve_posting(Lanes, Some("1"), Some(12020)).1.unwrap();
        assert!(why.contains("CUDA driver 12.2"), "{why}");
    }
}
