//! The blocking all-gather (in place or not), broadcast and all-reduce (in place or not) as one
//! copy of each byte, straight between the ranks' buffers (`process_vm_readv` and
//! `process_vm_writev`, module `raw::peer_read`) instead of `MPI_Allgather`, `MPI_Bcast` and
//! `MPI_Allreduce`, when every rank of the communicator is on one node.
//!
//! Why: this crate runs Open MPI's shared-memory transport on its copy path
//! (`btl_vader_single_copy_mechanism=none`, see `runtime`), which moves every byte twice: into
//! the shared segment and out of it, with a handshake per fragment. Open MPI's own single copy
//! (CMA) is unsafe there (a message longer than its receive overwrote the receiver's heap),
//! but one copy beats two: on an idle 2-core machine mpi4py, which keeps CMA, was 1.3–2 times
//! as fast as this crate's copy path from 32 KiB to 8 MiB (docs/performance.md). Here the
//! copies happen only after the mismatch check (so every rank passes the same type, length and
//! reduction) and only where they pay: buffers of [`PEER_READ_MIN`] bytes or more whose part
//! that the other ranks copy through is at most [`PEER_READ_PLAIN_MAX`] bytes or lies mostly on
//! huge pages (the kernel pins ordinary pages one by one, `PAGEMAP_SCAN` says which), every
//! rank on this node.
//!
//! The protocol, on the communicator's duplicate (where only this crate's own exchanges
//! travel), under the watch of the collective itself:
//! 1. an all-gather of each rank's row (carried in the mismatch check's round of messages where
//!    the check is one, on 2 to `DIRECT_MAX` ranks; else on the duplicate communicator): its
//!    node, process id, the address the others copy from or to (its send buffer for an
//!    all-gather or a reduction out of place, else its buffer), element type, reduction and
//!    count, the address of its result (the all-reduce's others read its reduced block there),
//!    and whether its buffers qualify; unless every rank qualifies, on one node, with the same
//!    type, reduction and count, every rank runs MPI's call instead (all of them decide from
//!    the same gathered rows, so they decide alike);
//! 2. each rank makes the copies of its plan ([`Reads`]): the all-gather's rank reads block
//!    `p` of every other rank `p` from `p`'s buffer (or its send buffer, after copying its own
//!    into place); the broadcast's root writes the head of every other rank's buffer, which
//!    reads the rest from the root's. No rank writes a part that another reads. The
//!    reductions ([`reduce`]): each rank reads its block of every other rank's input and
//!    reduces it, in rank order, into its own block of the result; the all-reduce then runs a
//!    second such step after an exchange, each rank reading the others' reduced blocks;
//! 3. an all-reduce (maximum) of each rank's outcome, which is also the barrier that keeps
//!    every buffer alive and unchanged until every copy is done. If any copy failed (a kernel
//!    or seccomp profile that forbids `process_vm_readv` between these processes, for
//!    instance), every rank runs MPI's call on its buffer, whose source part is untouched (or,
//!    when the all-reduce's second step failed, MPI's all-gather of the reduced blocks), and
//!    the communicator stops trying ([`Outcome::Failed`], [`Outcome::Recovered`]).

use crate::raw::{self, peer_read, RawError};
use crate::ring;
use grid_core::{kernels, DType, HostSlice, HostSliceMut};
use std::sync::OnceLock;

/// Smallest buffer (bytes: the all-gather's receive buffer of `size · k` elements, the
/// broadcast's buffer, the all-reduce's and the reduce-scatter's input) for which a blocking
/// all-gather, broadcast, all-reduce or reduce-scatter copies straight between the ranks'
/// memory: 32 KiB. Measured with the peer benchmark on an idle 2-core machine (docs/performance.md,
/// *One copy instead of two from 32 KiB*): from 32 KiB to 8 MiB the copy path's handshakes and
/// second copy made the 2-rank all-gathers and broadcasts 0.49–0.98 of mpi4py's speed and the
/// all-reduces 0.66–1.15; one copy brought them to 0.92–1.85 and 1.10–1.76. At 8 KiB the
/// protocol's exchanges cost about what one copy saves (the broadcast went from 0.85 to 0.92).
pub const PEER_READ_MIN: usize = 32 << 10;

/// Largest part of a rank's memory (bytes) that the other ranks copy through on ordinary pages:
/// 4 MiB. Above it that part must lie mostly on huge pages (three quarters of its bytes), or
/// the collective keeps to MPI's call: `process_vm_readv` pins ordinary pages one by one
/// (about 175 ns per 4 KiB page here), which at 8 MiB made one copy slower than the copy
/// path's two (docs/performance.md, *The in-place all-gather of 8 MiB*).
pub const PEER_READ_PLAIN_MAX: usize = 4 << 20;

/// Smallest in-place all-reduce (bytes) that copies straight between the ranks' memory on a
/// crowded communicator (more ranks than this node has online processors,
/// [`MpiBackend::crowded`](crate::MpiBackend::crowded)): 512 KiB.
/// There each of the in-place reduction's exchanges (the outcome of its first step, then of the
/// second, after the mismatch check that carries the rows) waits for ranks that have lost their
/// processor. With 4 ranks on 2 processors, MPI's path (the ring, or MPI's in-place call)
/// against the copies in alternation (medians of 4 to 10 sittings each), MPI's path took
/// 0.68–0.84 of the copies' time at 64 KiB in three series of three, 0.58–0.81 at 128 KiB in
/// five of five, and 0.47–0.63 at 256 KiB in three of four (1.16 in the fourth); at 32 KiB
/// (0.83–1.14) and 512 KiB (0.71–1.14) the two were even (docs/performance.md, *The in-place
/// all-reduce on a crowded node*). The broadcasts' series disagreed from one to the next.
pub const PEER_READ_CROWDED_IN_PLACE_MIN: usize = 512 << 10;

/// Whether a communicator of `size` ranks, every one on this node (the only case where the
/// ranks copy between their memory), is crowded: more ranks than the node's online processors
/// (`sysconf(_SC_NPROCESSORS_ONLN)`, not this process's affinity: MPI launchers bind each rank
/// to a processor). A crowded communicator's in-place all-reduces below
/// [`PEER_READ_CROWDED_IN_PLACE_MIN`] keep to MPI's path. Each rank's verdict travels in its row
/// of the copies' first exchange, so the ranks decide alike even if they counted processors
/// differently.
pub(crate) fn crowded(size: usize) -> bool {
    size > peer_read::online_processors()
}

/// What [`run`] or [`reduce`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every copy was made; the buffer holds the result on every rank.
    Done,
    /// Some rank's buffer does not qualify (or the ranks are on different nodes): run MPI's
    /// call.
    NotTaken,
    /// A copy failed on some rank (the largest error number of any rank): run MPI's call, and
    /// do not try again on this communicator.
    Failed(i32),
    /// A copy of the all-reduce's second step failed on some rank (the largest error number):
    /// MPI's all-gather of the reduced blocks completed the buffer on every rank; do not try
    /// again on this communicator.
    Recovered(i32),
    /// A copy of an in-place reduction's first step failed on some rank (the largest error
    /// number) after the probe (see [`reduce`]): the ranks whose copies worked have changed
    /// their blocks, so no buffer holds the result and MPI's call cannot run on them; the
    /// collective fails, and the communicator does not try again.
    Broken(i32),
}

/// Whether `exposed` (the part of this rank's memory the others copy through) lets the copies
/// pay: at most [`PEER_READ_PLAIN_MAX`] bytes, or mostly on huge pages, asked of the kernel at
/// every call (one or a few system calls: 10–15 µs on a busy 2-core machine, where a rank that
/// enters the kernel can lose its core, against the 0.2 ms and more of copying 8 MiB). A
/// verdict kept per address was tried and dropped: a buffer freed and allocated again at the
/// same address on ordinary pages kept the verdict of the huge-page buffer before it, and the
/// copies ran at 0.81 of MPI's speed.
fn qualifies(exposed: HostSlice<'_>) -> bool {
    let bytes = exposed.len().saturating_mul(exposed.dtype().size_bytes());
    bytes <= PEER_READ_PLAIN_MAX || peer_read::mostly_huge(exposed) == Some(true)
}

/// The part of this rank's memory that the other ranks' copies go through (and so what must
/// be small or lie on huge pages, where the kernel pins it page by page): this rank's block of
/// the in-place all-gather, its send buffer of the all-gather, the root's buffer but the head
/// (which the others read) or another rank's head (which the root writes) of the broadcast.
/// `None` when the shape does not fit the plan.
fn exposed<'a>(
    reads: Reads,
    (rank, size): (usize, usize),
    buf: HostSlice<'a>,
    send: Option<HostSlice<'a>>,
) -> Option<HostSlice<'a>> {
    let k = buf.len() / size.max(1);
    match reads {
        Reads::AllGatherInPlace => buf.sub(rank * k, k),
        Reads::AllGather => send,
        Reads::Broadcast { root } if rank == root => buf.sub(k, buf.len() - k),
        Reads::Broadcast { .. } => buf.sub(0, k),
    }
}

/// The fields each rank contributes to step 1: node key, process id, shared address, count,
/// kind (element type and reduction, [`kind`]), whether it qualifies, and the address of its
/// result buffer (the reductions; 0 otherwise).
pub(crate) const FIELDS: usize = 7;

/// Step 1's verdict from the gathered rows (`FIELDS` per rank): every rank on this rank's
/// node (a non-zero key), with the same kind and count, and every buffer qualifying.
fn every_rank_qualifies(rows: &[u64], mine: &[u64; FIELDS]) -> bool {
    mine[0] != 0
        && rows
            .chunks_exact(FIELDS)
            .all(|r| r[0] == mine[0] && r[3] == mine[3] && r[4] == mine[4] && r[5] == 1)
}

/// Field 4 of a row: the element type's index in [`DType::ALL`] and, for an all-reduce, one
/// more than the reduction's index (0 for the other collectives).
fn kind(dtype: DType, reduce: Option<raw::Reduce>) -> u64 {
    let code = DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .unwrap_or(usize::MAX >> 8) as u64;
    let op = match reduce {
        None => 0,
        Some(raw::Reduce::Sum) => 1,
        Some(raw::Reduce::Prod) => 2,
        Some(raw::Reduce::Min) => 3,
        Some(raw::Reduce::Max) => 4,
    };
    (code << 8) | op
}

/// This rank's whole row of step 1 for `row` (`[shared, len, kind, fits, result]`): the node
/// key and process id first.
pub(crate) fn full_row(row: [u64; 5]) -> [u64; FIELDS] {
    let [shared, len, kind, fits, result] = row;
    [
        node_key(),
        u64::from(std::process::id()),
        shared,
        len,
        kind,
        fits,
        result,
    ]
}

/// Step 1: gathers every rank's row on `c` (this rank's `[shared, len, kind, fits, result]`
/// after the node key and process id), or takes `pre`, the rows already gathered with the
/// mismatch check (the rows of [`full_row`] of every rank, in rank order); the rows when every
/// rank qualifies, else `None`.
fn exchange(
    c: &raw::Comm,
    size: usize,
    row: [u64; 5],
    pre: Option<&[u64]>,
) -> Result<Option<Vec<u64>>, RawError> {
    let mine = full_row(row);
    let rows = match pre {
        Some(rows) if rows.len() == FIELDS * size => rows.to_vec(),
        Some(rows) => {
            return Err(RawError::msg(format!(
                "the direct copies' rows: {} values where {} ranks send {}",
                rows.len(),
                size,
                FIELDS * size
            )))
        }
        None => {
            let mut rows = vec![0u64; FIELDS * size];
            c.all_gather(HostSlice::U64(&mine), HostSliceMut::U64(&mut rows))?;
            rows
        }
    };
    Ok(every_rank_qualifies(&rows, &mine).then_some(rows))
}

/// Step 3 (and the all-reduce's middle exchange): the largest error number of any rank (0:
/// every copy was made).
fn agree(c: &raw::Comm, errno: i32) -> Result<i32, RawError> {
    let mut worst = [0i32];
    c.all_reduce(
        HostSlice::I32(&[errno]),
        HostSliceMut::I32(&mut worst),
        raw::Reduce::Max,
    )?;
    Ok(worst[0])
}

/// The error number of a failed copy (`i32::MAX` when the error has none).
fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(i32::MAX).max(1)
}

/// Process id and address of offset `offset` (elements of `width` bytes) in field `field` of
/// `peer`'s row.
fn peer_at(
    rows: &[u64],
    peer: usize,
    field: usize,
    offset: usize,
    width: usize,
) -> Option<(u32, usize)> {
    let row = rows.get(peer * FIELDS..(peer + 1) * FIELDS)?;
    let pid = u32::try_from(row[1]).ok()?;
    let at = usize::try_from(row[field]).ok()?;
    Some((pid, at.wrapping_add(offset.checked_mul(width)?)))
}

/// An identity of this node as the kernel sees it, the same for every process that can read
/// another's memory by process id: a hash of the boot id and the process-id namespace; 0 when
/// either is unknown (never qualifies).
fn node_key() -> u64 {
    static KEY: OnceLock<u64> = OnceLock::new();
    *KEY.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::MetadataExt;
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id");
            let ns = std::fs::metadata("/proc/self/ns/pid");
            if let (Ok(boot), Ok(ns)) = (boot, ns) {
                let mut h = 0xcbf2_9ce4_8422_2325u64; // FNV-1a
                let ids = [ns.dev().to_le_bytes(), ns.ino().to_le_bytes()];
                for b in boot.trim().bytes().chain(ids.iter().flatten().copied()) {
                    h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
                return h.max(1);
            }
        }
        0
    })
}

/// The collectives that copy straight between the ranks' memory, and which parts each rank
/// copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    /// The in-place all-gather of `size · k` elements: each rank reads block `p` (elements
    /// `p · k .. (p + 1) · k`) of every other rank `p`, from `p`'s buffer into its own.
    AllGatherInPlace,
    /// The all-gather of `k` elements per rank into `size · k`: each rank copies its own send
    /// buffer into its block, and reads every other rank `p`'s send buffer into block `p`.
    AllGather,
    /// The broadcast from `root` of `len` elements: the root writes the first `len / size`
    /// elements into every other rank's buffer, and each of them reads the rest from the
    /// root's, so that every rank copies `(size - 1) / size` of the buffer (the root alone
    /// would copy `size - 1` buffers while the others wait; the others alone would leave the
    /// root's core idle, which at 2 ranks on 2 cores was no faster than MPI's two copies).
    Broadcast {
        /// The rank whose buffer is copied.
        root: usize,
    },
}

/// One transfer of a plan, in elements: `count` of them from offset `from` of `peer`'s shared
/// buffer (its send buffer for [`Reads::AllGather`], else its only buffer) to offset `to` of
/// this rank's (`Read`); from offset `from` of this rank's buffer to offset `to` of `peer`'s
/// (`Write`); from this rank's send buffer to offset `to` of its own receive buffer (`Own`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transfer {
    Read {
        peer: usize,
        from: usize,
        to: usize,
        count: usize,
    },
    Write {
        peer: usize,
        from: usize,
        to: usize,
        count: usize,
    },
    Own {
        to: usize,
        count: usize,
    },
}

impl Reads {
    /// The transfers of rank `rank` of `size` on a (receive) buffer of `len` elements. No
    /// element is written by one rank while another reads it: a rank reads only parts no rank
    /// writes (the others' own blocks or send buffers; the root's buffer), and writes only
    /// parts no rank reads.
    fn plan(self, (rank, size): (usize, usize), len: usize) -> Vec<Transfer> {
        let others = (1..size).map(move |step| (rank + step) % size);
        let k = len / size.max(1);
        match self {
            Reads::AllGatherInPlace => others
                .map(|peer| Transfer::Read {
                    peer,
                    from: peer * k,
                    to: peer * k,
                    count: k,
                })
                .collect(),
            Reads::AllGather => std::iter::once(Transfer::Own {
                to: rank * k,
                count: k,
            })
            .chain(others.map(|peer| Transfer::Read {
                peer,
                from: 0,
                to: peer * k,
                count: k,
            }))
            .collect(),
            Reads::Broadcast { root } if rank == root => others
                .map(|peer| Transfer::Write {
                    peer,
                    from: 0,
                    to: 0,
                    count: k,
                })
                .collect(),
            Reads::Broadcast { root } => vec![Transfer::Read {
                peer: root,
                from: k,
                to: k,
                count: len - k,
            }],
        }
    }

    /// Whether a receive buffer of `len` elements (and a send buffer of `send` elements of the
    /// same type, for [`Reads::AllGather`] only) has the shape this collective needs.
    fn fits(self, size: usize, len: usize, send: Option<usize>) -> bool {
        match (self, send) {
            (Reads::AllGatherInPlace, None) => len.is_multiple_of(size.max(1)),
            (Reads::AllGather, Some(s)) => s.checked_mul(size) == Some(len),
            (Reads::Broadcast { root }, None) => root < size,
            _ => false,
        }
    }
}

/// This rank's row of step 1 (`[shared, len, kind, fits, result]`) for collective `reads` on
/// `buf` (and `send`, the send buffer of [`Reads::AllGather`]).
pub(crate) fn reads_row(
    reads: Reads,
    (rank, size): (usize, usize),
    send: Option<HostSlice<'_>>,
    buf: HostSlice<'_>,
) -> [u64; 5] {
    let dtype = buf.dtype();
    let len = buf.len();
    let same_type = send.is_none_or(|s| s.dtype() == dtype);
    let fits = same_type
        && reads.fits(size, len, send.map(|s| s.len()))
        && exposed(reads, (rank, size), buf, send).is_some_and(qualifies);
    // What the other ranks copy from or to: the send buffer of an all-gather, else the buffer.
    let shared = send.unwrap_or(buf).as_ptr() as u64;
    [shared, len as u64, kind(dtype, None), u64::from(fits), 0]
}

/// Runs collective `reads` on `buf` (and `send`, the send buffer of [`Reads::AllGather`]) by
/// copying straight between the ranks' memory (module docs), with the exchanges on `c` (the
/// duplicate communicator); `pre`: step 1's rows, already gathered with the mismatch check.
/// Every rank of `c` must call it for the same collective. `Err` is an MPI failure of step 1
/// or 3.
pub(crate) fn run(
    c: &raw::Comm,
    (rank, size): (usize, usize),
    reads: Reads,
    (send, mut buf): (Option<HostSlice<'_>>, HostSliceMut<'_>),
    pre: Option<&[u64]>,
) -> Result<Outcome, RawError> {
    let dtype = buf.dtype();
    let len = buf.len();
    let row = reads_row(reads, (rank, size), send, buf.as_slice());
    let Some(rows) = exchange(c, size, row, pre)? else {
        return Ok(Outcome::NotTaken);
    };
    let width = dtype.size_bytes();
    let mut errno = 0i32;
    for transfer in reads.plan((rank, size), len) {
        if let Err(e) = make(transfer, &rows, width, send, buf.reborrow()) {
            errno = errno_of(&e);
            break;
        }
    }
    Ok(match agree(c, errno)? {
        0 => Outcome::Done,
        e => Outcome::Failed(e),
    })
}

/// Elements per copy of the all-reduce's first step: 256 KiB of them, so that what a copy
/// brings in is still in the caches when it is reduced.
const REDUCE_CHUNK_BYTES: usize = 256 << 10;

/// The reductions that copy straight between the ranks' memory ([`reduce`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduction {
    /// Every rank ends with the whole reduced buffer.
    AllReduce,
    /// Rank `r` ends with reduced block `r`: in its receive buffer out of place, at `r · k` of
    /// its buffer in place.
    ReduceScatter,
}

/// This rank's row of step 1 (`[shared, len, kind, fits, result]`) for reduction `what` with
/// `r` of `send` (or of `buf` in place) into `buf` on `size` ranks, `crowded` or not
/// ([`crowded`]).
pub(crate) fn reduce_row(
    what: Reduction,
    (size, crowded): (usize, bool),
    (send, buf): (Option<HostSlice<'_>>, HostSlice<'_>),
    r: raw::Reduce,
) -> [u64; 5] {
    let dtype = buf.dtype();
    let n = size.max(1);
    let len = send.map_or(buf.len(), |s| s.len());
    let k = len / n;
    let scattered = what == Reduction::ReduceScatter && send.is_some();
    // The others read every block of this rank's input but its own, and (all-reduce) its own
    // block of the result.
    let small = ((n - 1) * k).saturating_mul(dtype.size_bytes()) <= PEER_READ_PLAIN_MAX;
    let huge = |m: HostSlice<'_>| peer_read::mostly_huge(m) == Some(true);
    let shape = match (what, send) {
        (_, None) => true,
        (Reduction::AllReduce, Some(s)) => s.len() == buf.len(),
        (Reduction::ReduceScatter, Some(s)) => Some(s.len()) == buf.len().checked_mul(n),
    };
    // A crowded communicator's small in-place all-reduces keep to MPI's path.
    let least = match (what, send, crowded) {
        (Reduction::AllReduce, None, true) => PEER_READ_CROWDED_IN_PLACE_MIN,
        _ => 0,
    };
    let fits = shape
        && len.saturating_mul(dtype.size_bytes()) >= least
        && send.is_none_or(|s| s.dtype() == dtype)
        && len.is_multiple_of(n)
        && ring::reduces_on_host(dtype)
        // In place the input is the result buffer: one walk of its pages.
        && (small || (huge(send.unwrap_or(buf)) && (scattered || send.is_none() || huge(buf))));
    [
        send.unwrap_or(buf).as_ptr() as u64,
        len as u64,
        kind(dtype, Some(r)) | if scattered { 1 << 7 } else { 0 },
        u64::from(fits),
        buf.as_ptr() as u64,
    ]
}

/// The reduction `what` with `r` of `send` (or, `None`, of `buf` in place) into `buf` by
/// copying straight between the ranks' memory, with the exchanges on `c` (the duplicate
/// communicator; `pre`: step 1's rows, already gathered with the mismatch check); `scratch`
/// holds the communicator's kept blocks (the ring's; one block of [`REDUCE_CHUNK_BYTES`] here).
/// Every rank of `c` must call it for the same collective, with an input length that `size`
/// divides (else no rank copies).
///
/// Step 2a: rank `r` reduces block `r` of every rank's input into its block `r` (of `buf`; of
/// the receive buffer `buf` itself for a reduce-scatter out of place): in place its own block
/// is the start, out of place the inputs in rank order; the others' parts are copied in chunks
/// into the scratch block and reduced from there. Nobody reads block `r` of rank `r`'s input,
/// and the others' blocks of it stay unchanged. The exchange after it tells every rank whether
/// every rank's copies worked (else MPI's call runs on the untouched inputs); it ends a
/// reduce-scatter. Step 2b, all-reduce only: each rank reads every other rank `p`'s reduced
/// block `p` into its own block `p`; the closing exchange keeps the blocks unchanged until every
/// rank has read them. Every block is reduced by one rank, so every rank ends with the same
/// bits. `Err` is an MPI failure of an exchange.
///
/// In place, a rank whose copies work changes its block in step 2a before it can learn that
/// another rank's copies failed, and then MPI's call cannot run on the inputs: with `probe`
/// (until the communicator has seen every rank read every other), every rank first reads one
/// element of every other rank's buffer, and an exchange tells whether all could
/// ([`Outcome::Failed`] if not, nothing changed). A failure after that, which only a vanished
/// process or buffer could cause, is [`Outcome::Broken`].
pub(crate) fn reduce(
    c: &raw::Comm,
    (rank, size): (usize, usize),
    (what, probe): (Reduction, bool),
    (send, mut buf): (Option<HostSlice<'_>>, HostSliceMut<'_>),
    (r, pre): (raw::Reduce, Option<&[u64]>),
    scratch: &ring::Scratch,
) -> Result<Outcome, RawError> {
    let dtype = buf.dtype();
    let n = size.max(1);
    // The input's length, and where this rank's reduced block goes in `buf`.
    let len = send.map_or(buf.len(), |s| s.len());
    let k = len / n;
    let scattered = what == Reduction::ReduceScatter && send.is_some();
    let dest_at = if scattered { 0 } else { rank * k };
    let width = dtype.size_bytes();
    let crowded = crowded(size);
    let row = reduce_row(what, (size, crowded), (send, buf.as_slice()), r);
    let Some(rows) = exchange(c, size, row, pre)? else {
        return Ok(Outcome::NotTaken);
    };
    let op = ring::kernel_op(r);
    let per_chunk = (REDUCE_CHUNK_BYTES / width).max(1).min(k.max(1));
    let mut guard = scratch.lock().unwrap_or_else(|p| p.into_inner());
    let chunk = ring::block(&mut guard[1], dtype, per_chunk);
    if probe && send.is_none() {
        // In place, a rank whose copies work changes its block before it learns that another
        // rank's failed: make sure first that every rank can read every other.
        let mut errno = 0;
        for peer in (1..n).map(|step| (rank + step) % n) {
            let one = (|| {
                let (pid, there) = peer_at(&rows, peer, 2, 0, width).ok_or_else(out_of_range)?;
                peer_read::read_from(
                    pid,
                    there,
                    chunk
                        .as_mut_slice()
                        .sub_mut(0, 1)
                        .ok_or_else(out_of_range)?,
                )
            })();
            if let Err(e) = one {
                errno = errno_of(&e);
                break;
            }
        }
        match agree(c, errno)? {
            0 => {}
            e => return Ok(Outcome::Failed(e)),
        }
    }
    let first = reduce_own_block(
        (&rows, rank, n),
        send,
        (buf.reborrow(), dest_at),
        chunk.as_mut_slice(),
        (k, per_chunk, op),
    );
    match agree(c, first)? {
        0 => {}
        // In place every rank whose copies worked has changed its block.
        e if send.is_none() => return Ok(Outcome::Broken(e)),
        e => return Ok(Outcome::Failed(e)),
    }
    if what == Reduction::ReduceScatter {
        return Ok(Outcome::Done);
    }
    let mut errno = 0i32;
    for peer in (1..n).map(|step| (rank + step) % n) {
        let read = (|| {
            let (pid, there) = peer_at(&rows, peer, 6, peer * k, width).ok_or_else(out_of_range)?;
            peer_read::read_from(
                pid,
                there,
                buf.sub_mut(peer * k, k).ok_or_else(out_of_range)?,
            )
        })();
        if let Err(e) = read {
            errno = errno_of(&e);
            break;
        }
    }
    match agree(c, errno)? {
        0 => Ok(Outcome::Done),
        e => {
            // Every rank's own block is reduced: gathering them completes every buffer.
            let own = buf.as_slice().sub(rank * k, k).map(|b| b.to_owned_buffer());
            let own = own.ok_or_else(|| RawError::msg("a block out of range".into()))?;
            c.all_gather(own.as_slice(), buf)?;
            Ok(Outcome::Recovered(e))
        }
    }
}

/// Step 2a of [`reduce`] on rank `rank` of `n` (`rows` from step 1): block `rank` (`k`
/// elements) of every rank's input (`send`, or `dest` in place) reduced with `op` into `dest`
/// from element `at`, the others' parts copied `per_chunk` elements at a time into `chunk`.
/// Answers 0, or the error number of a failed copy.
fn reduce_own_block(
    (rows, rank, n): (&[u64], usize, usize),
    send: Option<HostSlice<'_>>,
    (mut dest, at): (HostSliceMut<'_>, usize),
    mut chunk: HostSliceMut<'_>,
    (k, per_chunk, op): (usize, usize, grid_core::ReduceOp),
) -> i32 {
    let width = dest.dtype().size_bytes();
    let mut step = |off: usize, p: usize| -> std::io::Result<()> {
        let m = per_chunk.min(k - off);
        // The chunk's place in every rank's input.
        let from = rank * k + off;
        let kernel = |e: grid_core::Error| std::io::Error::other(e.to_string());
        let acc = dest.sub_mut(at + off, m).ok_or_else(out_of_range)?;
        // Out of place the block starts as the first input in rank order; in place as this
        // rank's own input, to which the others are added in rank order.
        let first = send.is_some() && p == 0;
        match (send, p == rank) {
            (Some(s), true) => {
                let own = s.sub(from, m).ok_or_else(out_of_range)?;
                if first {
                    peer_read::copy(acc, own)?;
                } else {
                    kernels::accumulate(acc, own, op).map_err(kernel)?;
                }
            }
            (None, true) => {}
            (_, false) => {
                let (pid, there) = peer_at(rows, p, 2, from, width).ok_or_else(out_of_range)?;
                if first {
                    peer_read::read_from(pid, there, acc)?;
                } else {
                    let mut theirs = chunk.sub_mut(0, m).ok_or_else(out_of_range)?;
                    peer_read::read_from(pid, there, theirs.reborrow())?;
                    kernels::accumulate(acc, theirs.as_slice(), op).map_err(kernel)?;
                }
            }
        }
        Ok(())
    };
    for off in (0..k).step_by(per_chunk.max(1)) {
        for p in 0..n {
            if let Err(e) = step(off, p) {
                return errno_of(&e);
            }
        }
    }
    0
}

fn out_of_range() -> std::io::Error {
    std::io::Error::other("a block out of range")
}

/// Makes one transfer of a plan, with the peers' process ids and shared addresses from `rows`.
fn make(
    transfer: Transfer,
    rows: &[u64],
    width: usize,
    send: Option<HostSlice<'_>>,
    mut buf: HostSliceMut<'_>,
) -> std::io::Result<()> {
    let peer_at = |peer: usize, offset: usize| peer_at(rows, peer, 2, offset, width);
    match transfer {
        Transfer::Read {
            peer,
            from,
            to,
            count,
        } => {
            let (pid, there) = peer_at(peer, from).ok_or_else(out_of_range)?;
            let dst = buf.sub_mut(to, count).ok_or_else(out_of_range)?;
            peer_read::read_from(pid, there, dst)
        }
        Transfer::Write {
            peer,
            from,
            to,
            count,
        } => {
            let (pid, there) = peer_at(peer, to).ok_or_else(out_of_range)?;
            let src = buf.as_slice().sub(from, count).ok_or_else(out_of_range)?;
            peer_read::write_to(pid, there, src)
        }
        Transfer::Own { to, count } => {
            let src = send.ok_or_else(out_of_range)?;
            let dst = buf.sub_mut(to, count).ok_or_else(out_of_range)?;
            peer_read::copy(dst, src)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_reads_what_only_it_writes() {
        let read = |peer, from, to, count| Transfer::Read {
            peer,
            from,
            to,
            count,
        };
        let write = |peer, from, to, count| Transfer::Write {
            peer,
            from,
            to,
            count,
        };
        let gather = Reads::AllGatherInPlace;
        assert_eq!(
            gather.plan((1, 3), 12),
            vec![read(2, 8, 8, 4), read(0, 0, 0, 4)]
        );
        assert_eq!(gather.plan((0, 1), 5), vec![]);
        assert!(gather.fits(3, 12, None) && !gather.fits(3, 13, None));
        assert!(!gather.fits(3, 12, Some(4)));
        // Out of place: this rank's own block from its send buffer, the others' send buffers.
        let gather = Reads::AllGather;
        assert_eq!(
            gather.plan((1, 3), 12),
            vec![
                Transfer::Own { to: 4, count: 4 },
                read(2, 0, 8, 4),
                read(0, 0, 0, 4)
            ]
        );
        assert!(gather.fits(3, 12, Some(4)) && !gather.fits(3, 12, Some(5)));
        assert!(!gather.fits(3, 12, None));
        // The root writes the head (7 / 3 = 2 elements) to everyone, who read the tail.
        let bcast = Reads::Broadcast { root: 2 };
        assert_eq!(bcast.plan((0, 3), 7), vec![read(2, 2, 2, 5)]);
        assert_eq!(bcast.plan((1, 3), 7), vec![read(2, 2, 2, 5)]);
        assert_eq!(
            bcast.plan((2, 3), 7),
            vec![write(0, 0, 0, 2), write(1, 0, 0, 2)]
        );
        assert!(bcast.fits(3, 7, None) && !Reads::Broadcast { root: 3 }.fits(3, 7, None));
    }

    /// Rows of `n` simulated ranks in this process: rank `p`'s input at `inputs[p]`, its
    /// result buffer at `dests[p]`.
    #[cfg(target_os = "linux")]
    fn rows_of(inputs: &[usize], dests: &[usize]) -> Vec<u64> {
        let pid = u64::from(std::process::id());
        inputs
            .iter()
            .zip(dests)
            .flat_map(|(&i, &d)| [1, pid, i as u64, 0, 0, 1, d as u64])
            .collect()
    }

    // Step 2a of the all-reduce and reduce-scatter, for 3 ranks simulated in this process (a
    // process may read its own memory): each rank's block of the result is the sum of every
    // rank's, in chunks of 2 elements over blocks of 5, in place and out of place.
    #[cfg(target_os = "linux")]
    #[test]
    fn each_rank_reduces_its_block_of_every_input() {
        let (n, k) = (3usize, 5usize);
        let value = |r: usize, i: usize| (r * 100 + i) as f32;
        let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f32>();
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| (0..n * k).map(|i| value(r, i)).collect())
            .collect();
        let mut chunk = vec![0f32; 2];
        // Out of place, into whole buffers (all-reduce) and into blocks (reduce-scatter).
        for scattered in [false, true] {
            let mut dests: Vec<Vec<f32>> = vec![vec![-1.0; if scattered { k } else { n * k }]; n];
            let rows = rows_of(
                &inputs
                    .iter()
                    .map(|v| v.as_ptr() as usize)
                    .collect::<Vec<_>>(),
                &dests
                    .iter_mut()
                    .map(|v| v.as_mut_ptr() as usize)
                    .collect::<Vec<_>>(),
            );
            for (rank, dest) in dests.iter_mut().enumerate() {
                let at = if scattered { 0 } else { rank * k };
                let e = reduce_own_block(
                    (&rows, rank, n),
                    Some(HostSlice::F32(&inputs[rank])),
                    (HostSliceMut::F32(dest), at),
                    HostSliceMut::F32(&mut chunk),
                    (k, 2, grid_core::ReduceOp::Sum),
                );
                assert_eq!(e, 0);
                let want: Vec<f32> = (rank * k..(rank + 1) * k).map(sum).collect();
                assert_eq!(
                    &dest[at..at + k],
                    &want[..],
                    "rank {rank}, scattered {scattered}"
                );
            }
        }
        // In place: each rank's own block of its buffer; the others' blocks stay as they were.
        let mut bufs = inputs.clone();
        let at: Vec<usize> = bufs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
        let rows = rows_of(&at, &at);
        for (rank, buf) in bufs.iter_mut().enumerate() {
            let e = reduce_own_block(
                (&rows, rank, n),
                None,
                (HostSliceMut::F32(buf), rank * k),
                HostSliceMut::F32(&mut chunk),
                (k, 2, grid_core::ReduceOp::Sum),
            );
            assert_eq!(e, 0);
        }
        for (rank, buf) in bufs.iter().enumerate() {
            for (i, x) in buf.iter().enumerate() {
                let want = if i / k == rank {
                    sum(i)
                } else {
                    value(rank, i)
                };
                assert_eq!(*x, want, "rank {rank}, element {i}");
            }
        }
        // A peer that cannot be read: its error number, not a panic.
        let mut dest = vec![0f32; n * k];
        let mut bad = rows_of(&at, &at);
        bad[FIELDS + 1] = u64::from(u32::MAX >> 1);
        let e = reduce_own_block(
            (&bad, 0, n),
            Some(HostSlice::F32(&inputs[0])),
            (HostSliceMut::F32(&mut dest), 0),
            HostSliceMut::F32(&mut chunk),
            (k, 2, grid_core::ReduceOp::Sum),
        );
        assert_eq!(e, libc::ESRCH);
    }

    #[test]
    fn every_row_must_agree_and_qualify() {
        let mine = [7, 100, 0x1000, 1 << 20, 0, 1, 0];
        let other = [7, 101, 0x2000, 1 << 20, 0, 1, 0];
        let rows: Vec<u64> = mine.iter().chain(other.iter()).copied().collect();
        assert!(every_rank_qualifies(&rows, &mine));
        for (field, value) in [(0, 8), (3, 1 << 19), (4, 1), (5, 0)] {
            let mut bad = rows.clone();
            bad[FIELDS + field] = value;
            assert!(
                !every_rank_qualifies(&bad, &mine),
                "field {field} = {value}"
            );
        }
        // A node whose identity is unknown never qualifies, even against itself.
        let unknown = [0, 100, 0x1000, 1 << 20, 0, 1, 0];
        assert!(!every_rank_qualifies(&unknown, &unknown));
    }

    // A crowded communicator keeps its in-place all-reduces below the limit on MPI's path (their
    // rows say they do not qualify, so every rank decides alike); the other reductions, and
    // every one on a communicator that is not crowded, are as before.
    #[test]
    fn a_crowded_communicator_keeps_small_in_place_all_reduces_on_mpi() {
        let fits = |row: [u64; 5]| row[3] == 1;
        let elems = |bytes: usize| bytes / 4;
        let sum = raw::Reduce::Sum;
        let (small, large) = (
            vec![1f32; elems(PEER_READ_CROWDED_IN_PLACE_MIN) - 4],
            vec![1f32; elems(PEER_READ_CROWDED_IN_PLACE_MIN)],
        );
        let in_place = |buf: &[f32], crowded| {
            let row = reduce_row(
                Reduction::AllReduce,
                (4, crowded),
                (None, HostSlice::F32(buf)),
                sum,
            );
            fits(row)
        };
        assert!(!in_place(&small, true));
        assert!(in_place(&large, true));
        assert!(in_place(&small, false));
        // Out of place, and the reduce-scatter in place, keep the general minimum alone.
        let out = vec![0f32; small.len()];
        let send = Some(HostSlice::F32(&small));
        let row = reduce_row(
            Reduction::AllReduce,
            (4, true),
            (send, HostSlice::F32(&out)),
            sum,
        );
        assert!(fits(row), "out of place, crowded");
        let row = reduce_row(
            Reduction::ReduceScatter,
            (4, true),
            (None, HostSlice::F32(&small)),
            sum,
        );
        assert!(fits(row), "reduce-scatter in place, crowded");
    }

    #[test]
    fn crowded_means_more_ranks_than_online_processors() {
        let cpus = peer_read::online_processors();
        assert!(cpus >= 1);
        if cpus < usize::MAX {
            assert!(!crowded(cpus), "as many ranks as processors");
            assert!(crowded(cpus + 1));
        }
        assert!(!crowded(1));
    }

    #[test]
    fn the_node_key_is_stable_and_known_on_linux() {
        assert_eq!(node_key(), node_key());
        if cfg!(target_os = "linux") {
            assert_ne!(node_key(), 0);
        }
    }
}
