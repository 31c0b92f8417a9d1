//! The NCCL calls of the operations NCCL has no single call for (and of the rooted reduce), as
//! pure functions of the ranks and counts: which call, with which peer or root, at which offset
//! of which buffer, for how many elements. The backend issues a plan's calls between one
//! `ncclGroupStart` / `ncclGroupEnd` (so NCCL schedules them together and no ordering of the
//! calls can deadlock), after checking every range against the buffers next to the `unsafe`
//! calls; these functions only compute, so the CPU tests check them exactly.
//!
//! | operation | calls (one group) |
//! |---|---|
//! | `all_to_all_v` | `ncclRecv` from every peer `j` with `recv_counts[j] > 0` at the prefix sum of `recv_counts`, `ncclSend` to every `j` with `send_counts[j] > 0` at the prefix sum of `send_counts` (rank itself included: NCCL copies a send to oneself) |
//! | `all_gather_v` | one `ncclBroadcast` per rank `j` with `recv_counts[j] > 0`, root `j`: rank `j` sends its whole send buffer, every rank receives at the prefix sum of `recv_counts` |
//! | `reduce_scatter_v` | one `ncclReduce` per rank `j` with `send_counts[j] > 0`, root `j`, of block `j` of the send buffer; rank `j` receives the result at offset 0 |
//! | `reduce` | one `ncclReduce` to the root |
//! | `gather` | on the root, `ncclRecv` of `count` elements from every rank `j` at `j · count`; on every rank, `ncclSend` of its buffer to the root |
//! | `scatter` | on the root, `ncclSend` of block `j` (`j · count`) to every rank `j`; on every rank, `ncclRecv` of `count` elements from the root |
//!
//! All-gather-v is a group of broadcasts rather than `size²` sends and receives: each block
//! then travels along NCCL's broadcast ring or tree (every link carries it once, as in
//! `ncclAllGather`), instead of its owner pushing it `size - 1` times over its own links; this is
//! also how PyTorch's `ProcessGroupNCCL` gathers tensors of unequal sizes. Reduce-scatter-v is
//! a group of reduces for the same reason (NCCL has no reduce-scatter with per-rank counts).
//!
//! Calls of zero elements are left out on every rank alike (the counts are the same on every
//! rank when the front end's agreement check applies); a rank whose counts disagree with its
//! peers' makes the group wait for a partner that never comes, which ends in
//! [`grid_core::Error::Timeout`] under the operation's time limit, never in a hang.
//!
//! ```
//! use backend_nccl::plan::{self, Call};
//! // Rank 1 of 3 gathers 2 elements per rank on root 1: three receives, one send to itself.
//! let calls = plan::gather(1, 3, 1, 2)?;
//! assert_eq!(calls, vec![
//!     Call::Recv { peer: 0, offset: 0, count: 2 },
//!     Call::Recv { peer: 1, offset: 2, count: 2 },
//!     Call::Recv { peer: 2, offset: 4, count: 2 },
//!     Call::Send { peer: 1, offset: 0, count: 2 },
//! ]);
//! # Ok::<(), grid_core::Error>(())
//! ```

use grid_core::{Error, Result};

/// One NCCL call of a plan. Offsets and counts are in elements; "send buffer" and "receive
/// buffer" are the operation's two buffers on the calling rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `ncclSend` of `count` elements of the send buffer, from `offset`, to `peer`.
    Send {
        /// The receiving rank.
        peer: usize,
        /// First element in the send buffer.
        offset: usize,
        /// Number of elements.
        count: usize,
    },
    /// `ncclRecv` of `count` elements from `peer` into the receive buffer at `offset`.
    Recv {
        /// The sending rank.
        peer: usize,
        /// First element in the receive buffer.
        offset: usize,
        /// Number of elements.
        count: usize,
    },
    /// `ncclBroadcast` of `count` elements from `root`. On the root NCCL reads the send buffer
    /// at `send_offset` (`Some` only there); every rank (the root too) writes its receive buffer
    /// at `recv_offset`.
    Broadcast {
        /// The broadcasting rank.
        root: usize,
        /// First element read on the root (`None` on the other ranks).
        send_offset: Option<usize>,
        /// First element written, on every rank.
        recv_offset: usize,
        /// Number of elements.
        count: usize,
    },
    /// `ncclReduce` of `count` elements of the send buffer at `send_offset` onto `root`, where
    /// the result is written to the receive buffer at `recv_offset` (`Some` only on the root;
    /// NCCL ignores the receive buffer elsewhere).
    Reduce {
        /// The rank receiving the reduction.
        root: usize,
        /// First element reduced, on every rank.
        send_offset: usize,
        /// First element written on the root (`None` on the other ranks).
        recv_offset: Option<usize>,
        /// Number of elements.
        count: usize,
    },
}

impl Call {
    /// The range of the send buffer this call reads on this rank, as `(offset, count)`.
    pub fn reads(&self) -> Option<(usize, usize)> {
        match *self {
            Call::Send { offset, count, .. } => Some((offset, count)),
            Call::Recv { .. } => None,
            Call::Broadcast {
                send_offset, count, ..
            } => send_offset.map(|o| (o, count)),
            Call::Reduce {
                send_offset, count, ..
            } => Some((send_offset, count)),
        }
    }

    /// The range of the receive buffer this call writes on this rank, as `(offset, count)`.
    pub fn writes(&self) -> Option<(usize, usize)> {
        match *self {
            Call::Send { .. } => None,
            Call::Recv { offset, count, .. } => Some((offset, count)),
            Call::Broadcast {
                recv_offset, count, ..
            } => Some((recv_offset, count)),
            Call::Reduce {
                recv_offset, count, ..
            } => recv_offset.map(|o| (o, count)),
        }
    }

    /// The other rank this call talks to (peer or root).
    pub fn rank(&self) -> usize {
        match *self {
            Call::Send { peer, .. } | Call::Recv { peer, .. } => peer,
            Call::Broadcast { root, .. } | Call::Reduce { root, .. } => root,
        }
    }
}

fn check_rank(op: &'static str, what: &'static str, rank: usize, size: usize) -> Result<()> {
    if rank < size {
        Ok(())
    } else {
        Err(Error::PeerOutOfRange {
            op,
            what,
            rank,
            size,
        })
    }
}

fn check_counts(op: &'static str, what: &str, counts: &[usize], size: usize) -> Result<()> {
    if counts.len() == size {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{op}: {what} has {} entries but the communicator has {size} ranks (give one count per rank)",
            counts.len()
        )))
    }
}

/// The start of every block: the exclusive prefix sums of `counts` (an error when the total
/// overflows `usize`).
pub fn offsets(op: &'static str, counts: &[usize]) -> Result<Vec<usize>> {
    let mut at = 0usize;
    let mut out = Vec::with_capacity(counts.len());
    for &c in counts {
        out.push(at);
        at = at.checked_add(c).ok_or_else(|| {
            Error::Invalid(format!(
                "{op}: the counts {counts:?} add up to more than {} elements",
                usize::MAX
            ))
        })?;
    }
    Ok(out)
}

/// The start of block `j` of `count` elements (an error when the block ends beyond `usize`).
fn block(op: &'static str, j: usize, count: usize) -> Result<usize> {
    j.checked_mul(count)
        .filter(|start| start.checked_add(count).is_some())
        .ok_or_else(|| {
            Error::Invalid(format!(
                "{op}: block {j} of {count} elements lies beyond {} elements",
                usize::MAX
            ))
        })
}

/// All-to-all with per-peer counts on `rank` of `send_counts.len()` ranks: the receives (peer
/// order), then the sends (peer order); zero counts are left out.
///
/// ```
/// use backend_nccl::plan::{self, Call};
/// let calls = plan::all_to_all_v(0, &[1, 0, 2], &[3, 1, 0])?;
/// assert_eq!(calls, vec![
///     Call::Recv { peer: 0, offset: 0, count: 3 },
///     Call::Recv { peer: 1, offset: 3, count: 1 },
///     Call::Send { peer: 0, offset: 0, count: 1 },
///     Call::Send { peer: 2, offset: 1, count: 2 },
/// ]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn all_to_all_v(
    rank: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<Vec<Call>> {
    const OP: &str = "all_to_all_v";
    let size = send_counts.len();
    check_counts(OP, "recv_counts", recv_counts, size)?;
    check_rank(OP, "rank", rank, size)?;
    let so = offsets(OP, send_counts)?;
    let ro = offsets(OP, recv_counts)?;
    let recvs = (0..size)
        .filter(|&j| recv_counts[j] > 0)
        .map(|j| Call::Recv {
            peer: j,
            offset: ro[j],
            count: recv_counts[j],
        });
    let sends = (0..size)
        .filter(|&j| send_counts[j] > 0)
        .map(|j| Call::Send {
            peer: j,
            offset: so[j],
            count: send_counts[j],
        });
    Ok(recvs.chain(sends).collect())
}

/// All-gather with per-rank counts on `rank`: one broadcast per rank with a non-empty block,
/// in rank order.
///
/// ```
/// use backend_nccl::plan::{self, Call};
/// let calls = plan::all_gather_v(1, &[2, 3, 0])?;
/// assert_eq!(calls, vec![
///     Call::Broadcast { root: 0, send_offset: None, recv_offset: 0, count: 2 },
///     Call::Broadcast { root: 1, send_offset: Some(0), recv_offset: 2, count: 3 },
/// ]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn all_gather_v(rank: usize, recv_counts: &[usize]) -> Result<Vec<Call>> {
    const OP: &str = "all_gather_v";
    let size = recv_counts.len();
    check_rank(OP, "rank", rank, size)?;
    let ro = offsets(OP, recv_counts)?;
    Ok((0..size)
        .filter(|&j| recv_counts[j] > 0)
        .map(|j| Call::Broadcast {
            root: j,
            send_offset: (j == rank).then_some(0),
            recv_offset: ro[j],
            count: recv_counts[j],
        })
        .collect())
}

/// Reduce-scatter with per-rank counts on `rank`: one reduce per rank with a non-empty block,
/// in rank order; the block of `rank` lands at offset 0 of its receive buffer.
///
/// ```
/// use backend_nccl::plan::{self, Call};
/// let calls = plan::reduce_scatter_v(2, &[1, 0, 4])?;
/// assert_eq!(calls, vec![
///     Call::Reduce { root: 0, send_offset: 0, recv_offset: None, count: 1 },
///     Call::Reduce { root: 2, send_offset: 1, recv_offset: Some(0), count: 4 },
/// ]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn reduce_scatter_v(rank: usize, send_counts: &[usize]) -> Result<Vec<Call>> {
    const OP: &str = "reduce_scatter_v";
    let size = send_counts.len();
    check_rank(OP, "rank", rank, size)?;
    let so = offsets(OP, send_counts)?;
    Ok((0..size)
        .filter(|&j| send_counts[j] > 0)
        .map(|j| Call::Reduce {
            root: j,
            send_offset: so[j],
            recv_offset: (j == rank).then_some(0),
            count: send_counts[j],
        })
        .collect())
}

/// Rooted reduce of `count` elements on `rank` of `size`: one `ncclReduce` (none for 0
/// elements).
pub fn reduce(rank: usize, size: usize, root: usize, count: usize) -> Result<Vec<Call>> {
    const OP: &str = "reduce";
    check_rank(OP, "rank", rank, size)?;
    check_rank(OP, "root", root, size)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    Ok(vec![Call::Reduce {
        root,
        send_offset: 0,
        recv_offset: (rank == root).then_some(0),
        count,
    }])
}

/// Rooted gather of `count` elements per rank on `rank` of `size`: on the root a receive from
/// every rank (rank order) into block `j`; then, on every rank, the send to the root.
pub fn gather(rank: usize, size: usize, root: usize, count: usize) -> Result<Vec<Call>> {
    const OP: &str = "gather";
    check_rank(OP, "rank", rank, size)?;
    check_rank(OP, "root", root, size)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut calls = Vec::with_capacity(size + 1);
    if rank == root {
        for j in 0..size {
            calls.push(Call::Recv {
                peer: j,
                offset: block(OP, j, count)?,
                count,
            });
        }
    }
    calls.push(Call::Send {
        peer: root,
        offset: 0,
        count,
    });
    Ok(calls)
}

/// Rooted scatter of `count` elements per rank on `rank` of `size`: on the root a send of
/// block `j` to every rank (rank order); then, on every rank, the receive from the root.
pub fn scatter(rank: usize, size: usize, root: usize, count: usize) -> Result<Vec<Call>> {
    const OP: &str = "scatter";
    check_rank(OP, "rank", rank, size)?;
    check_rank(OP, "root", root, size)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut calls = Vec::with_capacity(size + 1);
    if rank == root {
        for j in 0..size {
            calls.push(Call::Send {
                peer: j,
                offset: block(OP, j, count)?,
                count,
            });
        }
    }
    calls.push(Call::Recv {
        peer: root,
        offset: 0,
        count,
    });
    Ok(calls)
}

/// Checks a plan against the buffers it will be issued on, before any pointer is formed:
/// every read lies within `send_len` elements, every write within `recv_len`, no two writes
/// overlap, and every peer or root is below `size`. The backend calls it next to the `unsafe`
/// NCCL calls; a failure is an internal error (the front end validated the arguments).
pub fn check(
    op: &'static str,
    calls: &[Call],
    size: usize,
    send_len: usize,
    recv_len: usize,
) -> Result<()> {
    let mut writes = Vec::new();
    for c in calls {
        check_rank(op, "peer", c.rank(), size)?;
        if let Some((o, n)) = c.reads() {
            if o.checked_add(n).is_none_or(|end| end > send_len) {
                return Err(Error::Invalid(format!(
                    "{op}: {c:?} reads elements {o}..{} of a send buffer of {send_len}",
                    o.saturating_add(n)
                )));
            }
        }
        if let Some((o, n)) = c.writes() {
            if o.checked_add(n).is_none_or(|end| end > recv_len) {
                return Err(Error::Invalid(format!(
                    "{op}: {c:?} writes elements {o}..{} of a receive buffer of {recv_len}",
                    o.saturating_add(n)
                )));
            }
            if n > 0 {
                writes.push((o, o + n));
            }
        }
    }
    writes.sort_unstable();
    if let Some(w) = writes.windows(2).find(|w| w[0].1 > w[1].0) {
        return Err(Error::Invalid(format!(
            "{op}: two receives overlap (elements {}..{} and {}..{})",
            w[0].0, w[0].1, w[1].0, w[1].1
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_plan_passes_its_own_check() {
        let counts = [3usize, 0, 2, 5];
        let n = counts.len();
        let total: usize = counts.iter().sum();
        for r in 0..n {
            let a = all_to_all_v(r, &counts, &[1, 1, 0, 4]).unwrap();
            check("all_to_all_v", &a, n, total, 6).unwrap();
            let g = all_gather_v(r, &counts).unwrap();
            check("all_gather_v", &g, n, counts[r], total).unwrap();
            let s = reduce_scatter_v(r, &counts).unwrap();
            check("reduce_scatter_v", &s, n, total, counts[r]).unwrap();
            for root in 0..n {
                let recv = if r == root { n * 2 } else { 0 };
                check("gather", &gather(r, n, root, 2).unwrap(), n, 2, recv).unwrap();
                check("scatter", &scatter(r, n, root, 2).unwrap(), n, recv, 2).unwrap();
                let rl = if r == root { 2 } else { 0 };
                check("reduce", &reduce(r, n, root, 2).unwrap(), n, 2, rl).unwrap();
            }
        }
    }
}
