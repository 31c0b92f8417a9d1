//! The collectives the benchmarks time, with nccl-tests' conventions (the MPI, Gloo and NCCL
//! benchmarks all report them the same way):
//! * **bytes**: the whole buffer for all_reduce and broadcast, the gathered (receive) buffer for
//!   all_gather, the send buffer for reduce_scatter;
//! * **algbw** = bytes / time;
//! * **busbw** = algbw · factor: all_reduce `2(n-1)/n`, all_gather and reduce_scatter
//!   `(n-1)/n`, broadcast `1`.

/// A benchmarked collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// all_reduce (sum).
    AllReduce,
    /// all_gather.
    AllGather,
    /// reduce_scatter (sum).
    ReduceScatter,
    /// broadcast from rank 0.
    Broadcast,
}

impl Op {
    /// Every benchmarked collective, in table order.
    pub const ALL: [Op; 4] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
    ];

    /// Name in the tables.
    ///
    /// ```
    /// assert_eq!(grid_programs::collectives::Op::ReduceScatter.name(), "reduce_scatter");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks (0 ranks count as 1).
    ///
    /// ```
    /// use grid_programs::collectives::Op;
    /// assert_eq!(Op::AllReduce.busbw_factor(4), 1.5);
    /// assert_eq!(Op::AllGather.busbw_factor(4), 0.75);
    /// assert_eq!(Op::Broadcast.busbw_factor(4), 1.0);
    /// ```
    pub fn busbw_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    /// `(send elements, receive elements, counted bytes)` of f32 buffers for a nominal size of
    /// `bytes` on `n` ranks (per-rank blocks of at least one element).
    ///
    /// ```
    /// use grid_programs::collectives::Op;
    /// assert_eq!(Op::AllGather.shape(1024, 4), (64, 256, 1024));
    /// assert_eq!(Op::ReduceScatter.shape(1024, 4), (256, 64, 1024));
    /// assert_eq!(Op::AllReduce.shape(8, 4), (2, 2, 8));
    /// ```
    pub fn shape(self, bytes: usize, n: usize) -> (usize, usize, usize) {
        let n = n.max(1);
        let elems = (bytes / 4).max(1);
        let block = (elems / n).max(1);
        match self {
            Op::AllReduce | Op::Broadcast => (elems, elems, elems * 4),
            Op::AllGather => (block, block * n, block * n * 4),
            Op::ReduceScatter => (block * n, block, block * n * 4),
        }
    }
}

/// Algorithm bandwidth and bus bandwidth in GB/s of `bytes` moved in `secs` seconds by `op` on
/// `n` ranks: `(algbw, busbw)`; both 0 when `secs` is not positive.
///
/// ```
/// use grid_programs::collectives::{bandwidth, Op};
/// let (alg, bus) = bandwidth(Op::AllReduce, 1_000_000_000, 0.5, 4);
/// assert_eq!((alg, bus), (2.0, 3.0));
/// assert_eq!(bandwidth(Op::Broadcast, 8, 0.0, 2), (0.0, 0.0));
/// ```
pub fn bandwidth(op: Op, bytes: usize, secs: f64, n: usize) -> (f64, f64) {
    if secs > 0.0 {
        let alg = bytes as f64 / secs / 1e9;
        (alg, alg * op.busbw_factor(n))
    } else {
        (0.0, 0.0)
    }
}

/// Nominal sizes, ascending: 8 B, then ×4 up to `max_bytes`, plus 64 MiB when `max_bytes` reaches
/// it (8 B to 32 MiB in powers of 4, then 64 MiB, for `max_bytes` = 64 MiB).
///
/// ```
/// let s = grid_programs::collectives::sizes(64 << 20);
/// assert_eq!((s[0], s[1], s[11], *s.last().unwrap(), s.len()), (8, 32, 32 << 20, 64 << 20, 13));
/// assert_eq!(grid_programs::collectives::sizes(100), vec![8, 32]);
/// ```
pub fn sizes(max_bytes: usize) -> Vec<usize> {
    let mut s: Vec<usize> = std::iter::successors(Some(8usize), |&b| b.checked_mul(4))
        .take_while(|&b| b <= max_bytes)
        .collect();
    if max_bytes >= 64 << 20 && !s.contains(&(64 << 20)) {
        s.push(64 << 20);
        s.sort_unstable();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_nccl_tests() {
        // 8 bytes on 4 ranks: blocks round up to one element.
        assert_eq!(Op::AllGather.shape(8, 4), (1, 4, 16));
        assert_eq!(Op::ReduceScatter.shape(8, 4), (4, 1, 16));
        assert_eq!(
            Op::Broadcast.shape(64 << 20, 8),
            (16 << 20, 16 << 20, 64 << 20)
        );
        assert_eq!(Op::AllReduce.busbw_factor(1), 0.0);
        assert_eq!(Op::AllReduce.busbw_factor(0), 0.0);
        assert_eq!(Op::ReduceScatter.busbw_factor(8), 0.875);
    }

    #[test]
    fn size_lists() {
        assert_eq!(sizes(7), Vec::<usize>::new());
        assert_eq!(sizes(8), vec![8]);
        let all = sizes(usize::MAX);
        assert_eq!(all.last(), Some(&(8usize << 60)));
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert!(all.contains(&(64 << 20)));
    }
}
