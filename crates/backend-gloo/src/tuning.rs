//! Which Gloo all-reduce runs a call: [`AllreduceAlgorithm`], its automatic choice by rank count
//! and message size ([`ALLREDUCE_TABLE`], from measurements), and the environment override
//! ([`ALLREDUCE_ENV`]).

use std::fmt;
use std::str::FromStr;

/// Which Gloo all-reduce runs (also inside reduce-scatter's
/// [`crate::ReduceScatterAlgorithm::Allreduce`]; small all-reduces run as one round of
/// messages whatever this says: `comm/oneshot.rs`).
///
/// [`AllreduceAlgorithm::Auto`] (the default) picks per call from [`ALLREDUCE_TABLE`]; the other
/// variants force one algorithm. The text forms (`auto`, `ring`, `ring:<bytes>`, `bcube`) are
/// what [`ALLREDUCE_ENV`] takes.
///
/// ```
/// use backend_gloo::AllreduceAlgorithm;
/// assert_eq!(AllreduceAlgorithm::default(), AllreduceAlgorithm::Auto);
/// assert_eq!("ring:4194304".parse(), Ok(AllreduceAlgorithm::RingSegments(4 << 20)));
/// assert_eq!(AllreduceAlgorithm::Auto.resolve(2, 64 << 20), AllreduceAlgorithm::RingSegments(4 << 20));
/// assert_eq!(AllreduceAlgorithm::Auto.resolve(2, 8), AllreduceAlgorithm::Ring);
/// assert_eq!(AllreduceAlgorithm::Bcube.resolve(2, 8), AllreduceAlgorithm::Bcube);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllreduceAlgorithm {
    /// Chosen per call by rank count and message size from [`ALLREDUCE_TABLE`]. The default.
    #[default]
    Auto,
    /// Gloo's ring with Gloo's own segment size (1 MiB).
    Ring,
    /// Gloo's ring with segments of at most this many bytes (the unit in which the ring
    /// overlaps sending one segment with reducing the other; Gloo rounds it to whole elements).
    /// Between [`MIN_SEGMENT_BYTES`] and [`MAX_SEGMENT_BYTES`].
    RingSegments(usize),
    /// Gloo's BCube (hypercube exchanges; `log2(size)` steps when the size is a power of 2).
    Bcube,
}

/// The environment variable that replaces the automatic choice ([`AllreduceAlgorithm::Auto`])
/// of every communicator a [`crate::GlooFactory`] creates: `auto`, `ring`, `ring:<bytes>` or
/// `bcube`. An algorithm set in [`crate::GlooConfig::allreduce`] wins over it; a value that
/// does not parse makes [`crate::GlooFactory::new`] fail with the value and the valid forms.
pub const ALLREDUCE_ENV: &str = "GRID_GLOO_ALLREDUCE";

/// Smallest segment of [`AllreduceAlgorithm::RingSegments`] (4 KiB): below it the ring spends
/// its time on per-message costs.
pub const MIN_SEGMENT_BYTES: usize = 4 << 10;
/// Largest segment of [`AllreduceAlgorithm::RingSegments`] (1 GiB): the ring allocates two
/// segments of scratch memory per call.
pub const MAX_SEGMENT_BYTES: usize = 1 << 30;

/// One row of [`ALLREDUCE_TABLE`]: the algorithm for messages of at least `min_bytes` at up to
/// `max_ranks` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableRow {
    /// Largest rank count the row applies to.
    pub max_ranks: usize,
    /// Smallest message (bytes) the row applies to.
    pub min_bytes: usize,
    /// The algorithm.
    pub algorithm: AllreduceAlgorithm,
}

/// The automatic choice: the first row with `ranks <= max_ranks` and `bytes >= min_bytes`
/// wins; no row: [`AllreduceAlgorithm::Ring`].
///
/// Measured on the development machine (2 shared cores, loopback TCP, ranks as threads and as
/// processes; 2026-11-24, load average 12–18 from other builds, so wall times were noisy and the
/// choice rests on the CPU time per call, which the load inflates far less), f32 sum, in place;
/// `gloo-bench --algorithms` measures the same variants side by side (docs/performance.md,
/// "Gloo all-reduce at large messages"):
///
/// * Gloo's ring with 4 MiB segments used 18 % less CPU per 64 MiB all-reduce than with Gloo's
///   default 1 MiB segments at 2 ranks (54.0 against 66.0 ms per call, all ranks together) and
///   14 % less at 4 ranks (142.3 against 165.3 ms); 2 MiB segments were in between, 8 MiB ones
///   no better than 4 MiB, 256 KiB and 16 MiB ones worse than 1 MiB. At 16 MiB the gain is
///   5–8 %. From 16 MiB on, 4 MiB segments are the choice.
/// * Below that the ring's own segments (at most `bytes / (2 · ranks)`) are small anyway: Gloo's
///   ring as it is, which keeps small messages exactly as they were.
/// * BCube used more CPU than the ring at 8, 32 and 64 MiB (2 and 4 ranks): never chosen.
pub const ALLREDUCE_TABLE: &[TableRow] = &[TableRow {
    max_ranks: usize::MAX,
    min_bytes: 16 << 20,
    algorithm: AllreduceAlgorithm::RingSegments(4 << 20),
}];

impl AllreduceAlgorithm {
    /// The algorithm that runs an all-reduce of `bytes` bytes at `ranks` ranks: itself, or for
    /// [`AllreduceAlgorithm::Auto`] the first matching row of [`ALLREDUCE_TABLE`] (never
    /// `Auto`).
    pub fn resolve(self, ranks: usize, bytes: usize) -> AllreduceAlgorithm {
        match self {
            AllreduceAlgorithm::Auto => ALLREDUCE_TABLE
                .iter()
                .find(|r| ranks <= r.max_ranks && bytes >= r.min_bytes)
                .map(|r| r.algorithm)
                .unwrap_or(AllreduceAlgorithm::Ring),
            other => other,
        }
    }

    /// The algorithm [`ALLREDUCE_ENV`] asks for, if set: `Ok(None)` when it is not set.
    ///
    /// ```
    /// // Not set in doc tests.
    /// assert_eq!(backend_gloo::AllreduceAlgorithm::from_env(), Ok(None));
    /// ```
    pub fn from_env() -> Result<Option<AllreduceAlgorithm>, String> {
        match std::env::var(ALLREDUCE_ENV) {
            Ok(v) => v
                .parse()
                .map(Some)
                .map_err(|e: ParseAlgorithmError| format!("environment variable {ALLREDUCE_ENV}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(format!(
                "environment variable {ALLREDUCE_ENV}={v:?} is not valid UTF-8 (valid: {VALID_FORMS})"
            )),
        }
    }
}

const VALID_FORMS: &str =
    "auto, ring, ring:<segment bytes> with 4096 <= bytes <= 1073741824, bcube";

/// A text that is not an [`AllreduceAlgorithm`]: names the text and the valid forms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseAlgorithmError(String);

impl fmt::Display for ParseAlgorithmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not an all-reduce algorithm (valid: {VALID_FORMS})",
            self.0
        )
    }
}

impl std::error::Error for ParseAlgorithmError {}

impl FromStr for AllreduceAlgorithm {
    type Err = ParseAlgorithmError;

    /// `auto`, `ring`, `ring:<bytes>` (segment size, 4096 to 1073741824), `bcube`; case and
    /// surrounding blanks ignored.
    ///
    /// ```
    /// use backend_gloo::AllreduceAlgorithm;
    /// assert_eq!(" BCube ".parse(), Ok(AllreduceAlgorithm::Bcube));
    /// let e = "ring:12".parse::<AllreduceAlgorithm>().unwrap_err();
    /// assert!(e.to_string().contains("\"ring:12\" is not an all-reduce algorithm"));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || ParseAlgorithmError(s.to_string());
        match t.as_str() {
            "auto" => Ok(AllreduceAlgorithm::Auto),
            "ring" => Ok(AllreduceAlgorithm::Ring),
            "bcube" => Ok(AllreduceAlgorithm::Bcube),
            _ => {
                let bytes: usize = t
                    .strip_prefix("ring:")
                    .and_then(|b| b.trim().parse().ok())
                    .ok_or_else(bad)?;
                if (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&bytes) {
                    Ok(AllreduceAlgorithm::RingSegments(bytes))
                } else {
                    Err(bad())
                }
            }
        }
    }
}

impl fmt::Display for AllreduceAlgorithm {
    /// The text form that [`FromStr`] reads back.
    ///
    /// ```
    /// use backend_gloo::AllreduceAlgorithm;
    /// assert_eq!(AllreduceAlgorithm::RingSegments(1 << 22).to_string(), "ring:4194304");
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllreduceAlgorithm::Auto => f.write_str("auto"),
            AllreduceAlgorithm::Ring => f.write_str("ring"),
            AllreduceAlgorithm::RingSegments(b) => write!(f, "ring:{b}"),
            AllreduceAlgorithm::Bcube => f.write_str("bcube"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms_round_trip() {
        for a in [
            AllreduceAlgorithm::Auto,
            AllreduceAlgorithm::Ring,
            AllreduceAlgorithm::RingSegments(MIN_SEGMENT_BYTES),
            AllreduceAlgorithm::RingSegments(MAX_SEGMENT_BYTES),
            AllreduceAlgorithm::Bcube,
        ] {
            assert_eq!(a.to_string().parse::<AllreduceAlgorithm>(), Ok(a));
        }
    }

    #[test]
    fn bad_text_is_refused_with_the_valid_forms() {
        for s in [
            "",
            "rings",
            "ring:",
            "ring:-1",
            "ring:4095",
            "ring:1073741825",
            "ring:99999999999999999999999",
            "halving",
        ] {
            let e = s.parse::<AllreduceAlgorithm>().unwrap_err().to_string();
            assert!(e.contains(&format!("{s:?}")), "{e}");
            assert!(e.contains("valid: auto, ring, ring:<segment bytes>"), "{e}");
        }
    }

    #[test]
    fn auto_follows_the_table_and_never_stays_auto() {
        for ranks in [1, 2, 3, 4, 8, 1024] {
            for bytes in [
                0,
                8,
                1 << 20,
                (16 << 20) - 1,
                16 << 20,
                64 << 20,
                usize::MAX,
            ] {
                let a = AllreduceAlgorithm::Auto.resolve(ranks, bytes);
                assert_ne!(a, AllreduceAlgorithm::Auto);
                let want = if bytes >= 16 << 20 {
                    AllreduceAlgorithm::RingSegments(4 << 20)
                } else {
                    AllreduceAlgorithm::Ring
                };
                assert_eq!(a, want, "{ranks} ranks, {bytes} bytes");
            }
        }
        // Forced choices are kept as they are.
        assert_eq!(
            AllreduceAlgorithm::Bcube.resolve(2, 64 << 20),
            AllreduceAlgorithm::Bcube
        );
        assert_eq!(
            AllreduceAlgorithm::Ring.resolve(2, 64 << 20),
            AllreduceAlgorithm::Ring
        );
    }

    #[test]
    fn every_table_segment_is_in_range() {
        for r in ALLREDUCE_TABLE {
            if let AllreduceAlgorithm::RingSegments(b) = r.algorithm {
                assert!((MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&b));
            }
            assert_ne!(r.algorithm, AllreduceAlgorithm::Auto);
        }
    }
}
