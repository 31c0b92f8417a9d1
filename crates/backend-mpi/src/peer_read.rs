//! The blocking all-gather (in place or not) and broadcast as one copy of each byte, straight
//! between the ranks' buffers (`process_vm_readv` and `process_vm_writev`, module
//! `raw::peer_read`) instead of `MPI_Allgather` and `MPI_Bcast`, when every rank of the communicator is on one
//! node and every buffer lies mostly on huge pages.
//!
//! Why: this crate runs Open MPI's shared-memory transport on its copy path
//! (`btl_vader_single_copy_mechanism=none`, see `runtime`), which moves every byte twice: into
//! the shared segment and out of it. Open MPI's own single copy (CMA) is unsafe there (a
//! message longer than its receive overwrote the receiver's heap) and slower on ordinary
//! pages, but on huge pages one copy beats two: numpy advises huge pages for every array of
//! 4 MiB or more, and so mpi4py's all-gathers and broadcasts of 32 and 64 MiB were up to
//! twice as fast as this crate's (docs/performance.md). Here the copies happen only after
//! the mismatch check (so every rank passes the same type and length) and only where they
//! pay: whole buffers of [`PEER_READ_MIN`] bytes or more, three quarters of each on huge
//! pages (the kernel says which, `PAGEMAP_SCAN`), every rank on this node.
//!
//! The protocol, on the communicator's duplicate (where only this crate's own exchanges
//! travel), under the watch of the collective itself:
//! 1. an all-gather of each rank's node, process id, the address the others copy from or to
//!    (its send buffer for an all-gather out of place, else its buffer), element type and
//!    count, and whether its buffers qualify; unless every rank qualifies, on one node, with the
//!    same type and count, every rank runs MPI's call instead (all of them decide from the
//!    same gathered rows, so they decide alike);
//! 2. each rank makes the copies of its plan ([`Reads`]): the all-gather's rank reads block
//!    `p` of every other rank `p` from `p`'s buffer (or its send buffer, after copying its own
//!    into place); the broadcast's root writes the head of every other rank's buffer, which
//!    reads the rest from the root's. No rank writes a part that another reads;
//! 3. an all-reduce (maximum) of each rank's outcome, which is also the barrier that keeps
//!    every buffer alive and unchanged until every copy is done. If any copy failed (a kernel
//!    or seccomp profile that forbids `process_vm_readv` between these processes, for
//!    instance), every rank runs MPI's call on its buffer, whose source part is untouched, and
//!    the communicator stops trying ([`Outcome::Failed`]).

use crate::raw::{self, peer_read, RawError};
use grid_core::{DType, HostSlice, HostSliceMut};
use std::sync::OnceLock;

/// Smallest buffer (bytes: the all-gather's receive buffer of `size · k` elements, the
/// broadcast's buffer) for which a blocking all-gather or broadcast copies straight between
/// the ranks' memory: 32 MiB. Measured with `mpi-bench peer-read` (docs/performance.md): the
/// in-place all-gather and the broadcast of 32 and 64 MiB on huge pages took MPI's time divided
/// by 1.08–1.72 at 2 ranks and by 1.05–3.85 at 4; at 8 MiB nothing changed (the data stays in
/// the caches, where two copies cost little), at 16 MiB 0.75–1.57; and every call from the
/// threshold on pays for asking the kernel about its pages and for the exchange of addresses,
/// which on ordinary pages cost 4–7% at 16 MiB and about 1% from 32 MiB.
pub const PEER_READ_MIN: usize = 32 << 20;

/// What [`run`] did.
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
}

/// Whether `buf` lies mostly on huge pages, asked of the kernel at every call (a few system
/// calls: 10–15 µs on a busy 2-core machine, where a rank that enters the kernel can lose its
/// core, against the 0.5 ms and more of copying 16 MiB). A verdict kept per address was tried
/// and dropped: a buffer freed and allocated again at the same address on ordinary pages kept
/// the verdict of the huge-page buffer before it, and the copies ran at 0.81 of MPI's speed.
fn mostly_huge(buf: HostSlice<'_>) -> bool {
    peer_read::mostly_huge(buf) == Some(true)
}

/// The fields each rank contributes to step 1.
const FIELDS: usize = 6;

/// Step 1's verdict from the gathered rows (`FIELDS` per rank): every rank on this rank's
/// node (a non-zero key), with the same type and count, and every buffer qualifying.
fn every_rank_qualifies(rows: &[u64], mine: &[u64; FIELDS]) -> bool {
    mine[0] != 0
        && rows
            .chunks_exact(FIELDS)
            .all(|r| r[0] == mine[0] && r[3] == mine[3] && r[4] == mine[4] && r[5] == 1)
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

/// Runs collective `reads` on `buf` (and `send`, the send buffer of [`Reads::AllGather`]) by
/// copying straight between the ranks' memory (module docs), with the exchanges on `c` (the
/// duplicate communicator). Every rank of `c` must call it for the same collective. `Err` is
/// an MPI failure of step 1 or 3.
pub(crate) fn run(
    c: &raw::Comm,
    (rank, size): (usize, usize),
    reads: Reads,
    send: Option<HostSlice<'_>>,
    mut buf: HostSliceMut<'_>,
) -> Result<Outcome, RawError> {
    let dtype = buf.dtype();
    let len = buf.len();
    let key = node_key();
    let same_type = send.is_none_or(|s| s.dtype() == dtype);
    let fits = key != 0
        && same_type
        && reads.fits(size, len, send.map(|s| s.len()))
        && mostly_huge(buf.as_slice())
        && send.is_none_or(mostly_huge);
    let code = DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .unwrap_or(usize::MAX);
    // What the other ranks copy from or to: the send buffer of an all-gather, else the buffer.
    let shared = match send {
        Some(s) => s.as_ptr() as usize,
        None => buf.as_mut_ptr() as usize,
    };
    let mine: [u64; FIELDS] = [
        key,
        u64::from(std::process::id()),
        shared as u64,
        len as u64,
        code as u64,
        u64::from(fits),
    ];
    let mut rows = vec![0u64; FIELDS * size];
    c.all_gather(HostSlice::U64(&mine), HostSliceMut::U64(&mut rows))?;
    if !every_rank_qualifies(&rows, &mine) {
        return Ok(Outcome::NotTaken);
    }
    let width = dtype.size_bytes();
    let mut errno = 0i32;
    for transfer in reads.plan((rank, size), len) {
        if let Err(e) = make(transfer, &rows, width, send, buf.reborrow()) {
            errno = e.raw_os_error().unwrap_or(i32::MAX).max(1);
            break;
        }
    }
    let mut worst = [0i32];
    c.all_reduce(
        HostSlice::I32(&[errno]),
        HostSliceMut::I32(&mut worst),
        raw::Reduce::Max,
    )?;
    Ok(match worst[0] {
        0 => Outcome::Done,
        e => Outcome::Failed(e),
    })
}

/// Makes one transfer of a plan, with the peers' process ids and shared addresses from `rows`.
fn make(
    transfer: Transfer,
    rows: &[u64],
    width: usize,
    send: Option<HostSlice<'_>>,
    mut buf: HostSliceMut<'_>,
) -> std::io::Result<()> {
    let out_of_range = || std::io::Error::other("a block out of range");
    let peer_at = |peer: usize, offset: usize| {
        let row = rows.get(peer * FIELDS..(peer + 1) * FIELDS)?;
        let pid = u32::try_from(row[1]).ok()?;
        let at = usize::try_from(row[2]).ok()?;
        Some((pid, at.wrapping_add(offset.checked_mul(width)?)))
    };
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
            let mut dst = buf.sub_mut(to, count).ok_or_else(out_of_range)?;
            dst.copy_from(src)
                .map_err(|e| std::io::Error::other(e.to_string()))
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

    #[test]
    fn every_row_must_agree_and_qualify() {
        let mine = [7, 100, 0x1000, 1 << 20, 0, 1];
        let other = [7, 101, 0x2000, 1 << 20, 0, 1];
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
        let unknown = [0, 100, 0x1000, 1 << 20, 0, 1];
        assert!(!every_rank_qualifies(&unknown, &unknown));
    }

    #[test]
    fn the_node_key_is_stable_and_known_on_linux() {
        assert_eq!(node_key(), node_key());
        if cfg!(target_os = "linux") {
            assert_ne!(node_key(), 0);
        }
    }
}
