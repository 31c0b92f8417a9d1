//! Statistics of timed samples.

use std::time::{Duration, Instant};

/// The median of `values`: the upper median (`sorted[len / 2]`) for an even count, so the value
/// reported is always one that was measured. `None` for an empty slice.
///
/// Works for any ordered sample type (`f64` seconds, `Duration`); a value that does not compare
/// with itself (NaN) is not a measurement and is left out.
///
/// ```
/// use grid_programs::stats::median;
/// use std::time::Duration;
/// assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
/// assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(3.0));
/// assert_eq!(median(&[Duration::from_millis(5), Duration::from_millis(1)]), Some(Duration::from_millis(5)));
/// assert_eq!(median(&[f64::NAN, 1.0]), Some(1.0));
/// assert_eq!(median::<f64>(&[]), None);
/// ```
pub fn median<T: Copy + PartialOrd>(values: &[T]) -> Option<T> {
    let mut v: Vec<T> = values
        .iter()
        .copied()
        .filter(|x| x.partial_cmp(x).is_some())
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v.get(v.len() / 2).copied()
}

/// Per sample, the slowest rank's time: `per_rank[r][k]` is rank `r`'s time of sample `k`; the
/// result has one entry per sample (the shortest rank's sample count).
///
/// A collective is as slow as its slowest member, so benchmarks report this, not one rank's view.
///
/// ```
/// use grid_programs::stats::slowest_per_sample;
/// let per_rank = vec![vec![1.0, 5.0, 2.0], vec![3.0, 4.0, 2.5]];
/// assert_eq!(slowest_per_sample(&per_rank), vec![3.0, 5.0, 2.5]);
/// assert!(slowest_per_sample(&[]).is_empty());
/// ```
pub fn slowest_per_sample(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let samples = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..samples)
        .map(|k| per_rank.iter().map(|r| r[k]).fold(f64::MIN, f64::max))
        .collect()
}

/// The 1-, 5- and 15-minute load averages from `/proc/loadavg` (`"0.52 0.61 0.70"`), or `None`
/// where that file cannot be read (not Linux). Benchmarks print it: a busy machine explains
/// noisy numbers.
///
/// ```
/// if let Some(load) = grid_programs::stats::load_average() {
///     assert_eq!(load.split_whitespace().count(), 3);
/// }
/// ```
pub fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let fields: Vec<&str> = text.split_whitespace().take(3).collect();
    (fields.len() == 3).then(|| fields.join(" "))
}

/// The 1-minute load average as `/proc/loadavg` writes it (the first field of
/// [`load_average`]).
///
/// ```
/// if let Some(one) = grid_programs::stats::load_average_1min() {
///     assert!(one.parse::<f64>().is_ok());
/// }
/// ```
pub fn load_average_1min() -> Option<String> {
    Some(load_average()?.split_whitespace().next()?.to_string())
}

/// Runs `f` `runs` times and returns the median wall time of one run (zero when `runs` is 0).
/// The result of `f` goes through [`std::hint::black_box`] so the work is not optimised away.
///
/// ```
/// let t = grid_programs::stats::timed_median(5, || (0..1000u64).sum::<u64>());
/// assert!(t < std::time::Duration::from_secs(1));
/// assert_eq!(grid_programs::stats::timed_median(0, || ()), std::time::Duration::ZERO);
/// ```
pub fn timed_median<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    let times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .collect();
    median(&times).unwrap_or(Duration::ZERO)
}

/// One paired sample of two alternatives, A = `run(false)` and B = `run(true)`, run back to back
/// with the order alternating by `iteration` (A first on even iterations, B first on odd ones),
/// so drift and cache effects hit both alike. Returns `(A, B)`.
///
/// ```
/// let mut order = Vec::new();
/// for it in 0..2 {
///     grid_programs::stats::alternating(it, |b| { order.push(b); Ok::<_, ()>(0.0) }).unwrap();
/// }
/// assert_eq!(order, [false, true, true, false]);
/// ```
pub fn alternating<E>(
    iteration: usize,
    mut run: impl FnMut(bool) -> Result<f64, E>,
) -> Result<(f64, f64), E> {
    if iteration.is_multiple_of(2) {
        let a = run(false)?;
        Ok((a, run(true)?))
    } else {
        let b = run(true)?;
        Ok((run(false)?, b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_median_is_a_measured_value() {
        assert_eq!(median(&[5]), Some(5));
        assert_eq!(median(&[2, 1]), Some(2));
        assert_eq!(
            median(&[9.0, f64::NAN, 1.0]).map(|m| m.is_nan()),
            Some(false)
        );
        // The input is left as it was.
        let v = [3.0, 1.0, 2.0];
        assert_eq!(median(&v), Some(2.0));
        assert_eq!(v, [3.0, 1.0, 2.0]);
    }

    #[test]
    fn slowest_uses_the_shortest_rank() {
        assert_eq!(
            slowest_per_sample(&[vec![1.0, 2.0, 3.0], vec![4.0]]),
            vec![4.0]
        );
    }
}
