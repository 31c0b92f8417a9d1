//! The arithmetic of `nccl-bench` (sizes, buffer shapes, bus bandwidth, table rows), kept
//! apart from the GPU so it is tested on CPU. Conventions are nccl-tests' (and the MPI
//! benchmark's):
//! * **bytes**: the whole buffer for all_reduce and broadcast, the gathered (receive) buffer for
//!   all_gather, the send buffer for reduce_scatter;
//! * **algbw** = bytes / time;
//! * **busbw** = algbw · factor: all_reduce `2(n-1)/n`, all_gather and reduce_scatter
//!   `(n-1)/n`, broadcast `1`.

use std::fmt::Write as _;

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

    /// Name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    ///
    /// ```
    /// use backend_nccl::bench::Op;
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

    /// `(send elements, receive elements, counted bytes)` of f32 buffers for a nominal size on
    /// `n` ranks (per-rank blocks of at least one element).
    ///
    /// ```
    /// use backend_nccl::bench::Op;
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

/// Nominal sizes: 8 B to 32 MiB in powers of 4, then 64 MiB.
///
/// ```
/// let s = backend_nccl::bench::sizes();
/// assert_eq!((s[0], s[1], *s.last().unwrap()), (8, 32, 64 << 20));
/// ```
pub fn sizes() -> Vec<usize> {
    let mut s: Vec<usize> = (0..12).map(|k| 8usize << (2 * k)).collect();
    s.push(64 << 20);
    s
}

/// `(warm-up samples, timed samples, calls per sample)` for a size: small messages time many
/// back-to-back calls per sample so the clock does not dominate.
pub fn plan(bytes: usize, quick: bool) -> (usize, usize, usize) {
    match bytes {
        b if b <= 64 << 10 => (5, if quick { 10 } else { 40 }, 50),
        b if b <= 1 << 20 => (3, if quick { 8 } else { 30 }, 10),
        b if b <= 8 << 20 => (2, if quick { 5 } else { 20 }, 2),
        _ => (2, if quick { 4 } else { 15 }, 1),
    }
}

/// Median (upper median for even lengths); 0 for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The markdown table header.
pub fn header(n: usize, what: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## NCCL collectives, {n} ranks ({what}, f32, sum)\n");
    let _ = writeln!(
        s,
        "Time: median over samples of the slowest rank (µs per call; a sample is the mean of several back-to-back calls followed by one stream synchronisation). algbw = bytes / time, busbw = algbw · factor (nccl-tests conventions).\n"
    );
    let _ = writeln!(
        s,
        "| op | bytes | count | samples | time µs | algbw GB/s | busbw GB/s |"
    );
    let _ = write!(s, "|---|---:|---:|---:|---:|---:|---:|");
    s
}

/// One table row; `secs` is the time per call.
///
/// ```
/// use backend_nccl::bench::{row, Op};
/// assert_eq!(
///     row(Op::AllReduce, 1 << 20, 262144, 20, 1e-4, 4),
///     "| all_reduce | 1048576 | 262144 | 20 | 100.0 | 10.49 | 15.73 |"
/// );
/// ```
pub fn row(op: Op, bytes: usize, count: usize, samples: usize, secs: f64, n: usize) -> String {
    let algbw = if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    };
    let busbw = algbw * op.busbw_factor(n);
    format!(
        "| {} | {bytes} | {count} | {samples} | {:.1} | {algbw:.2} | {busbw:.2} |",
        op.name(),
        secs * 1e6
    )
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
        assert_eq!(Op::ReduceScatter.busbw_factor(8), 0.875);
    }

    #[test]
    fn sizes_and_plans() {
        let s = sizes();
        assert_eq!(s.len(), 13);
        assert_eq!(s[11], 32 << 20);
        assert_eq!(plan(8, false), (5, 40, 50));
        assert_eq!(plan(64 << 20, true), (2, 4, 1));
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn table() {
        let h = header(2, "device buffers");
        assert!(h.starts_with("## NCCL collectives, 2 ranks (device buffers, f32, sum)\n"));
        assert!(h.ends_with("|---|---:|---:|---:|---:|---:|---:|"));
        assert_eq!(
            row(Op::Broadcast, 8, 2, 40, 2e-6, 2),
            "| broadcast | 8 | 2 | 40 | 2.0 | 0.00 | 0.00 |"
        );
        assert_eq!(
            row(Op::AllGather, 1 << 30, 1 << 28, 4, 0.1, 2),
            "| all_gather | 1073741824 | 268435456 | 4 | 100000.0 | 10.74 | 5.37 |"
        );
    }
}
