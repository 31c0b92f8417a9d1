//! [`MpiConfig`]: the MPI backend's settings (today: the default time limit of operations).

use grid_core::{Error, Result, TimeLimit};
use std::time::Duration;

/// The environment variable that sets [`MpiConfig::timeout`] in [`MpiConfig::from_env`]:
/// milliseconds, `u64::MAX` (18446744073709551615) for no limit.
pub const TIMEOUT_ENV: &str = "GRID_MPI_TIMEOUT_MS";

/// The environment variable that turns [`MpiConfig::sigterm_report`] off (`0`) in
/// [`MpiConfig::from_env`].
pub const SIGTERM_REPORT_ENV: &str = "GRID_MPI_SIGTERM_REPORT";

/// The environment variable that sets the largest payload (bytes) of one message of a checked
/// collective that runs as one round of messages ([`crate::ROUND_MAX`] when unset, and at most
/// [`crate::PAIR_ROUND_MAX`] at 2 ranks but for broadcasts; 0: rounds carry fingerprints
/// alone). The same on every rank; read when a communicator is created.
pub const ROUND_MAX_ENV: &str = "GRID_MPI_ROUND_MAX";

/// The environment variable that sets the largest communicator whose mismatch checks travel as
/// one round of messages ([`crate::DIRECT_MAX`] when unset; 0 or 1: every check is the
/// all-reduce on the duplicate communicator). The same on every rank; read when a communicator
/// is created.
pub const DIRECT_MAX_ENV: &str = "GRID_MPI_DIRECT_MAX";

/// The environment variable that sets the smallest buffer (bytes) of a blocking all-gather
/// (its receive buffer), broadcast, all-reduce or reduce-scatter (its input) that copies
/// straight between the ranks' memory when every rank is on one node
/// ([`crate::PEER_READ_MIN`] when unset; 0: never, always MPI's call or the ring). The same on
/// every rank; read when a communicator is created.
pub const PEER_READ_MIN_ENV: &str = "GRID_MPI_PEER_READ_MIN";

/// The environment variable that says which copies between the ranks' memory go through a
/// staging block placed at the source's offset within a cache line: `auto` (or unset) measures
/// once per process which distances make the kernel's copies slow; `always` stages every copy
/// whose destination lies 1 to 63 bytes after its source in a 4 KiB page; `never` stages none
/// (docs/backends.md §1.2).
/// Read once per process; a communicator created with any other value fails with an error that
/// names it.
pub const STAGE_COPIES_ENV: &str = "GRID_MPI_STAGE_COPIES";

/// [`STAGE_COPIES_ENV`]: `None` for `auto` or unset (measure), the fixed choice for `always`
/// and `never`; an error naming the variable, the value and the valid ones otherwise.
pub(crate) fn stage_copies() -> Result<Option<crate::raw::peer_read::Staging>> {
    stage_copies_from(std::env::var(STAGE_COPIES_ENV))
}

/// [`stage_copies`] of the variable's value as `std::env::var` gives it.
fn stage_copies_from(
    value: std::result::Result<String, std::env::VarError>,
) -> Result<Option<crate::raw::peer_read::Staging>> {
    use crate::raw::peer_read::Staging;
    match value {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => match v.trim() {
            "auto" | "" => Ok(None),
            "always" => Ok(Some(Staging::ALWAYS)),
            "never" => Ok(Some(Staging::NEVER)),
            other => Err(Error::Invalid(format!(
                "{STAGE_COPIES_ENV}={other:?}: expected auto, always or never (unset: auto)"
            ))),
        },
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Invalid(format!(
            "{STAGE_COPIES_ENV}={v:?} is not valid text; expected auto, always or never"
        ))),
    }
}

/// An unsigned integer from environment variable `var` (`default` when unset), at most `most`;
/// anything else is an error naming the variable, the value and what is valid.
pub(crate) fn env_usize(var: &str, default: usize, most: usize) -> Result<usize> {
    let v = match std::env::var(var) {
        Ok(v) => v,
        Err(std::env::VarError::NotPresent) => return Ok(default),
        Err(std::env::VarError::NotUnicode(v)) => {
            return Err(Error::Invalid(format!(
                "{var}={v:?} is not valid text; expected a whole number from 0 to {most}"
            )))
        }
    };
    match v.trim().parse::<usize>() {
        Ok(n) if n <= most => Ok(n),
        _ => Err(Error::Invalid(format!(
            "{var}={v:?}: expected a whole number from 0 to {most} (unset: {default})"
        ))),
    }
}

/// Settings of the MPI backend, given to [`crate::MpiRuntime::init_with`].
///
/// ```
/// use backend_mpi::MpiConfig;
/// use grid_core::TimeLimit;
/// use std::time::Duration;
/// let c = MpiConfig::default();
/// assert_eq!(c.timeout, TimeLimit::After(Duration::from_millis(MpiConfig::DEFAULT_TIMEOUT_MS)));
/// let c = MpiConfig::default().with_timeout(TimeLimit::from_millis(u64::MAX));
/// assert_eq!(c.timeout, TimeLimit::Unlimited);
/// assert_eq!(MpiConfig::parse_timeout("1500").unwrap(), TimeLimit::from_millis(1500));
/// assert!(MpiConfig::parse_timeout("0").is_err());
/// assert!(MpiConfig::parse_timeout("10s").is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiConfig {
    /// The default time limit of every operation of the communicators of this runtime (the
    /// world and everything [`crate::MpiFactory`] creates from it); a program changes it per
    /// communicator ([`grid_core::Communicator::set_time_limit`]) or per operation
    /// ([`grid_core::CommunicatorExt::with_time_limit`]). What happens when it passes is in
    /// the crate documentation ("Time limits and abort"). Default:
    /// [`MpiConfig::DEFAULT_TIMEOUT_MS`].
    pub timeout: TimeLimit,
    /// Whether SIGTERM (what `mpirun` sends every process when one process of the job died)
    /// prints the blocking collectives this process was waiting in and dumps the operation
    /// log before the process ends (a helper thread; see the crate docs). Default on; turn it
    /// off for a program that handles SIGTERM itself. [`MpiConfig::from_env`]:
    /// `GRID_MPI_SIGTERM_REPORT=0` turns it off.
    pub sigterm_report: bool,
}

impl MpiConfig {
    /// The default timeout, 10 minutes: the default of PyTorch's NCCL process groups. Long
    /// enough for a rank that writes a checkpoint while the others wait in a collective;
    /// short enough that a hung job ends the same hour. A timeout on MPI ends the job, so a
    /// program with longer legitimate waits should raise it.
    pub const DEFAULT_TIMEOUT_MS: u64 = 600_000;

    /// The defaults, then [`TIMEOUT_ENV`] when it is set.
    ///
    /// ```
    /// let c = backend_mpi::MpiConfig::from_env()?;
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn from_env() -> Result<MpiConfig> {
        let mut c = MpiConfig::default();
        match std::env::var(TIMEOUT_ENV) {
            Ok(v) => c.timeout = MpiConfig::parse_timeout(&v)?,
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(Error::Invalid(format!(
                    "{TIMEOUT_ENV}={v:?} is not valid text; expected milliseconds (a positive integer, {} for no limit)",
                    u64::MAX
                )))
            }
        }
        match std::env::var(SIGTERM_REPORT_ENV).as_deref() {
            Ok("0") => c.sigterm_report = false,
            Ok("1") | Err(_) => {}
            Ok(other) => {
                return Err(Error::Invalid(format!(
                    "{SIGTERM_REPORT_ENV}={other:?}: expected 0 (off) or 1 (on)"
                )))
            }
        }
        Ok(c)
    }

    /// A timeout in milliseconds as [`TIMEOUT_ENV`] gives it: a positive integer, `u64::MAX`
    /// for no limit.
    pub fn parse_timeout(v: &str) -> Result<TimeLimit> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "{TIMEOUT_ENV}={v:?}: {why}; expected milliseconds, a positive integer ({} for no limit)",
                u64::MAX
            ))
        };
        let ms: u64 = v.trim().parse().map_err(|_| bad("not a whole number"))?;
        if ms == 0 {
            return Err(bad("0 ms would fail every operation"));
        }
        Ok(TimeLimit::from_millis(ms))
    }

    /// This configuration with another timeout.
    pub fn with_timeout(mut self, timeout: impl Into<TimeLimit>) -> MpiConfig {
        self.timeout = timeout.into();
        self
    }
}

impl Default for MpiConfig {
    fn default() -> MpiConfig {
        MpiConfig {
            timeout: TimeLimit::After(Duration::from_millis(MpiConfig::DEFAULT_TIMEOUT_MS)),
            sigterm_report: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::peer_read::Staging;
    use std::env::VarError;

    #[test]
    fn stage_copies_reads_auto_always_never() {
        assert_eq!(stage_copies_from(Err(VarError::NotPresent)).unwrap(), None);
        assert_eq!(stage_copies_from(Ok("auto".into())).unwrap(), None);
        assert_eq!(stage_copies_from(Ok(" ".into())).unwrap(), None);
        assert_eq!(
            stage_copies_from(Ok("always".into())).unwrap(),
            Some(Staging::ALWAYS)
        );
        assert_eq!(
            stage_copies_from(Ok("never\n".into())).unwrap(),
            Some(Staging::NEVER)
        );
        let e = stage_copies_from(Ok("sometimes".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GRID_MPI_STAGE_COPIES=\"sometimes\"")
                && e.contains("expected auto, always or never"),
            "{e}"
        );
    }
}
