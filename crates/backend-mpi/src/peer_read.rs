//! The blocking in-place all-gather and broadcast as one copy of each byte, straight between
//! the ranks' buffers (`process_vm_readv` and `process_vm_writev`, module `raw::peer_read`)
//! instead of `MPI_Allgather` and `MPI_Bcast`, when every rank of the communicator is on one
//! node and every buffer lies mostly on huge pages.
//!
//! Why: this crate runs Open MPI's shared-memory transport on its copy path
//! (`btl_vader_single_copy_mechanism=none`, see `runtime`), which moves every byte twice: into
//! the shared segment and out of it. Open MPI's own single copy (CMA) is unsafe there (a
//! message longer than its receive overwrote the receiver's heap) and slower on ordinary
//! pages, but on huge pages one copy beats two: numpy advises huge pages for every array of
//! 4 MiB or more, and so mpi4py's in-place all-gathers and broadcasts of 32 and 64 MiB were up
//! to twice as fast as this crate's (docs/performance.md). Here the copies happen only after
//! the mismatch check (so every rank passes the same type and length) and only where they
//! pay: whole buffers of [`PEER_READ_MIN`] bytes or more, three quarters of each on huge
//! pages (the kernel says which, `PAGEMAP_SCAN`), every rank on this node.
//!
//! The protocol, on the communicator's duplicate (where only this crate's own exchanges
//! travel), under the watch of the collective itself:
//! 1. an all-gather of each rank's node, process id, buffer address, element type and count,
//!    and whether its buffer qualifies; unless every rank qualifies, on one node, with the
//!    same type and count, every rank runs MPI's call instead (all of them decide from the
//!    same gathered rows, so they decide alike);
//! 2. each rank makes the copies of its plan ([`Reads`]): the all-gather's rank reads block
//!    `p` of every other rank `p` from `p`'s buffer; the broadcast's root writes the head of
//!    every other rank's buffer, which reads the rest from the root's. No rank writes a part
//!    that another reads;
//! 3. an all-reduce (maximum) of each rank's outcome, which is also the barrier that keeps
//!    every buffer alive and unchanged until every copy is done. If any copy failed (a kernel
//!    or seccomp profile that forbids `process_vm_readv` between these processes, for
//!    instance), every rank runs MPI's call on its buffer, whose source part is untouched, and
//!    the communicator stops trying ([`Outcome::Failed`]).

use crate::raw::{self, peer_read, RawError};
use grid_core::{DType, HostSlice, HostSliceMut};
use std::sync::{Mutex, OnceLock};

/// Smallest buffer (bytes: the whole in-place all-gather buffer of `size · k` elements, the
/// broadcast's buffer) for which a blocking in-place all-gather or broadcast copies straight
/// between the ranks' memory: 16 MiB. Below it the data stays in the caches, where MPI's two
/// copies cost little, and the exchanges around the copies cost more than they save (measured
/// at 2 ranks: 0.74–0.87 of `MPI_Allgather`'s time at 8 MiB, even at 16 MiB;
/// docs/performance.md).
pub const PEER_READ_MIN: usize = 16 << 20;

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

/// Calls after which [`PageVerdicts`] asks the kernel again about a buffer it has seen.
const RESCAN_AFTER: u32 = 64;

/// The last buffer whose pages were looked at, and the verdict: asking the kernel is a few
/// system calls, which cost 10–15 µs on a busy 2-core machine (a rank that enters the kernel
/// can lose its core), while training loops pass the same buffers call after call. A stale
/// verdict costs speed, never correctness (reading works on any pages), and is renewed every
/// [`RESCAN_AFTER`] calls.
#[derive(Debug, Default)]
pub(crate) struct PageVerdicts(Mutex<Option<Seen>>);

#[derive(Debug)]
struct Seen {
    addr: usize,
    len: usize,
    huge: bool,
    uses: u32,
}

impl PageVerdicts {
    /// Whether `buf` lies mostly on huge pages (`raw::peer_read::mostly_huge`), from the last
    /// answer for the same address and length when there is a fresh one.
    fn mostly_huge(&self, buf: HostSlice<'_>) -> bool {
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = seen.as_mut() {
            if s.addr == addr && s.len == len && s.uses < RESCAN_AFTER {
                s.uses += 1;
                return s.huge;
            }
        }
        let huge = peer_read::mostly_huge(buf) == Some(true);
        *seen = Some(Seen {
            addr,
            len,
            huge,
            uses: 1,
        });
        huge
    }
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

/// One transfer of a plan: elements `offset .. offset + count` from `peer`'s buffer to the same
/// place in this rank's (`Read`), or from this rank's to `peer`'s (`Write`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transfer {
    Read {
        peer: usize,
        offset: usize,
        count: usize,
    },
    Write {
        peer: usize,
        offset: usize,
        count: usize,
    },
}

impl Reads {
    /// The copies of rank `rank` of `size` on a buffer of `len` elements. No element is
    /// written by one rank while another reads it: a rank reads only parts no rank writes
    /// (the others' own blocks; the root's buffer), and writes only parts no rank reads.
    fn plan(self, (rank, size): (usize, usize), len: usize) -> Vec<Transfer> {
        match self {
            Reads::AllGatherInPlace => {
                let k = len / size.max(1);
                (1..size)
                    .map(|step| (rank + step) % size)
                    .map(|peer| Transfer::Read {
                        peer,
                        offset: peer * k,
                        count: k,
                    })
                    .collect()
            }
            Reads::Broadcast { root } => {
                let head = len / size.max(1);
                if rank == root {
                    (1..size)
                        .map(|step| (rank + step) % size)
                        .map(|peer| Transfer::Write {
                            peer,
                            offset: 0,
                            count: head,
                        })
                        .collect()
                } else {
                    vec![Transfer::Read {
                        peer: root,
                        offset: head,
                        count: len - head,
                    }]
                }
            }
        }
    }

    /// Whether a buffer of `len` elements has the shape this collective needs.
    fn fits(self, size: usize, len: usize) -> bool {
        match self {
            Reads::AllGatherInPlace => len.is_multiple_of(size.max(1)),
            Reads::Broadcast { root } => root < size,
        }
    }
}

/// Runs collective `reads` on `buf` by reading the other ranks' memory (module docs), with
/// the exchanges on `c` (the duplicate communicator). Every rank of `c` must call it for the
/// same collective. `Err` is an MPI failure of step 1 or 3.
pub(crate) fn run(
    c: &raw::Comm,
    (rank, size): (usize, usize),
    reads: Reads,
    verdicts: &PageVerdicts,
    mut buf: HostSliceMut<'_>,
) -> Result<Outcome, RawError> {
    let dtype = buf.dtype();
    let len = buf.len();
    let key = node_key();
    let fits = key != 0 && reads.fits(size, len) && verdicts.mostly_huge(buf.as_slice());
    let code = DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .unwrap_or(usize::MAX);
    let mine: [u64; FIELDS] = [
        key,
        u64::from(std::process::id()),
        buf.as_mut_ptr() as usize as u64,
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
    for copy in reads.plan((rank, size), len) {
        let (Transfer::Read {
            peer,
            offset,
            count,
        }
        | Transfer::Write {
            peer,
            offset,
            count,
        }) = copy;
        let row = &rows[peer * FIELDS..(peer + 1) * FIELDS];
        let (Ok(pid), Ok(at)) = (u32::try_from(row[1]), usize::try_from(row[2])) else {
            errno = i32::MAX;
            break;
        };
        let there = at.wrapping_add(offset * width);
        let done = match copy {
            Transfer::Read { .. } => match buf.sub_mut(offset, count) {
                Some(dst) => peer_read::read_from(pid, there, dst),
                None => Err(std::io::Error::other("block out of range")),
            },
            Transfer::Write { .. } => match buf.as_slice().sub(offset, count) {
                Some(src) => peer_read::write_to(pid, there, src),
                None => Err(std::io::Error::other("block out of range")),
            },
        };
        if let Err(e) = done {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_reads_what_only_it_writes() {
        let read = |peer, offset, count| Transfer::Read {
            peer,
            offset,
            count,
        };
        let write = |peer, offset, count| Transfer::Write {
            peer,
            offset,
            count,
        };
        let gather = Reads::AllGatherInPlace;
        assert_eq!(gather.plan((1, 3), 12), vec![read(2, 8, 4), read(0, 0, 4)]);
        assert_eq!(gather.plan((0, 1), 5), vec![]);
        assert!(gather.fits(3, 12) && !gather.fits(3, 13));
        // The root writes the head (7 / 3 = 2 elements) to everyone, who read the tail.
        let bcast = Reads::Broadcast { root: 2 };
        assert_eq!(bcast.plan((0, 3), 7), vec![read(2, 2, 5)]);
        assert_eq!(bcast.plan((1, 3), 7), vec![read(2, 2, 5)]);
        assert_eq!(bcast.plan((2, 3), 7), vec![write(0, 0, 2), write(1, 0, 2)]);
        assert!(bcast.fits(3, 7) && !Reads::Broadcast { root: 3 }.fits(3, 7));
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
