//! The lifecycle of a communicator, kept by the front end ([`super::Comm`]) for every backend:
//! time limits (a default per communicator, an override per operation), `abort()`, and the
//! record of the first failure.
//!
//! # Time limits
//! A [`TimeLimit`] bounds how long one operation may wait for its peers. Every communicator has
//! a default chosen when it is created (its backend's configuration:
//! [`super::Backend::default_time_limit`]), which [`super::Communicator::set_time_limit`]
//! changes, and one operation can override it
//! ([`super::CommunicatorExt::with_time_limit`]). The backend receives the operation's limit
//! with the operation ([`super::Validated::time_limit`]) and returns [`Error::Timeout`] when
//! it passes. [`TimeLimit::Unlimited`] (also written `u64::MAX` milliseconds) means no limit.
//!
//! # Abort
//! [`super::Communicator::abort`] is non-blocking, thread-safe and idempotent. It marks the
//! communicator aborted, then asks the backend to wake every operation blocked on it
//! ([`super::Backend::abort`]); every pending operation and every later one returns
//! [`Error::Aborted`]. It is local, like `ncclCommAbort`: the peers notice through their own
//! operations (a lost connection, or their time limit).
//!
//! # Failure
//! The first operation that fails because communication failed ([`Error::Timeout`],
//! [`Error::PeerFailed`], [`Error::Aborted`]) leaves the communicator **failed**: its
//! operations may have been left half done on some ranks, so the ranks no longer agree on what
//! comes next. [`super::Communicator::failure`] says why ([`Failure`]), and every later
//! operation returns [`Error::Aborted`] naming that first failure, instead of running into a
//! second, more confusing one. Errors of the caller's arguments, and
//! [`Error::CollectiveMismatch`] (every rank got it and nothing ran), do not fail the
//! communicator.

use crate::error::Error;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one operation may wait for its peers.
///
/// ```
/// use grid_core::TimeLimit;
/// use std::time::Duration;
/// assert_eq!(TimeLimit::from_millis(1500), TimeLimit::After(Duration::from_millis(1500)));
/// assert_eq!(TimeLimit::from_millis(u64::MAX), TimeLimit::Unlimited);
/// assert_eq!(TimeLimit::Unlimited.as_millis(), u64::MAX);
/// assert_eq!(TimeLimit::After(Duration::MAX).deadline_from(std::time::Instant::now()), None);
/// assert_eq!(TimeLimit::Unlimited.to_string(), "no limit");
/// assert_eq!(TimeLimit::from_millis(250).to_string(), "250 ms");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeLimit {
    /// The operation fails with [`Error::Timeout`] once it waited this long.
    After(Duration),
    /// The operation waits as long as it takes (it still ends on `abort()` or a peer's
    /// failure that the backend detects).
    Unlimited,
}

impl TimeLimit {
    /// `ms` milliseconds; `u64::MAX` means [`TimeLimit::Unlimited`].
    pub const fn from_millis(ms: u64) -> TimeLimit {
        if ms == u64::MAX {
            TimeLimit::Unlimited
        } else {
            TimeLimit::After(Duration::from_millis(ms))
        }
    }

    /// The limit in milliseconds (`u64::MAX` for [`TimeLimit::Unlimited`], saturating for a
    /// duration longer than `u64::MAX - 1` ms).
    pub fn as_millis(&self) -> u64 {
        match self {
            TimeLimit::After(d) => u64::try_from(d.as_millis())
                .unwrap_or(u64::MAX - 1)
                .min(u64::MAX - 1),
            TimeLimit::Unlimited => u64::MAX,
        }
    }

    /// The limit as a duration (`None`: no limit).
    pub fn duration(&self) -> Option<Duration> {
        match self {
            TimeLimit::After(d) => Some(*d),
            TimeLimit::Unlimited => None,
        }
    }

    /// The instant at which an operation that started at `start` times out; `None` when there
    /// is no limit or the limit lies beyond what [`Instant`] can represent (which is the same
    /// thing in practice).
    pub fn deadline_from(&self, start: Instant) -> Option<Instant> {
        self.duration().and_then(|d| start.checked_add(d))
    }
}

impl From<Duration> for TimeLimit {
    fn from(d: Duration) -> TimeLimit {
        TimeLimit::After(d)
    }
}

impl std::fmt::Display for TimeLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TimeLimit::Unlimited => write!(f, "no limit"),
            TimeLimit::After(_) => write!(f, "{} ms", self.as_millis()),
        }
    }
}

/// Why a communicator failed: the first operation that failed because communication failed,
/// or `abort()` ([`super::Communicator::failure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// True when [`super::Communicator::abort`] was called (on this rank).
    pub aborted: bool,
    /// The operation that failed (`"abort"` for an abort outside any operation).
    pub op: &'static str,
    /// Its sequence number on the communicator, when an operation failed.
    pub seq: Option<u64>,
    /// The communicator rank the failure is blamed on, where it is known.
    pub blamed: Option<usize>,
    /// The error, as displayed.
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.aborted && self.seq.is_none() {
            return write!(f, "{}", self.message);
        }
        write!(f, "{}", self.op)?;
        if let Some(s) = self.seq {
            write!(f, " #{s}")?;
        }
        write!(f, " failed: {}", self.message)
    }
}

/// Where an operation ran: the communicator's name, its members' world ranks and the
/// operation's sequence number. The front end adds it to the errors of operations
/// ([`Error::Timeout`], [`Error::PeerFailed`], [`Error::Aborted`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpSite {
    /// The communicator's descriptive name.
    pub comm: String,
    /// The world ranks of its members, in communicator-rank order.
    pub ranks: Vec<usize>,
    /// The operation's sequence number (`None` before it took one).
    pub seq: Option<u64>,
}

impl std::fmt::Display for OpSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(s) = self.seq {
            write!(f, " #{s}")?;
        }
        write!(
            f,
            " on communicator '{}' (world ranks {})",
            self.comm,
            compact_ranks(&self.ranks)
        )
    }
}

/// A rank list for a message: all of them up to 8, else the first 6, an ellipsis, the last and
/// the count (`0, 2, 4, 6, 8, 10, ..., 126 (64 ranks)`).
///
/// ```
/// use grid_core::comm::compact_ranks;
/// assert_eq!(compact_ranks(&[0, 1, 2]), "0, 1, 2");
/// assert_eq!(compact_ranks(&(0..100).collect::<Vec<_>>()), "0, 1, 2, 3, 4, 5, ..., 99 (100 ranks)");
/// assert_eq!(compact_ranks(&[]), "none");
/// ```
pub fn compact_ranks(ranks: &[usize]) -> String {
    let join = |r: &[usize]| {
        r.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match ranks.len() {
        0 => "none".to_string(),
        n if n <= 8 => join(ranks),
        n => format!("{}, ..., {} ({n} ranks)", join(&ranks[..6]), ranks[n - 1]),
    }
}

/// The front end's lifecycle state of one communicator.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    /// Set by `abort()` or the first failure; checked (one relaxed load) before every
    /// operation.
    stopped: AtomicBool,
    /// The default time limit in milliseconds (`u64::MAX`: no limit).
    limit_ms: AtomicU64,
    /// The first failure (or the abort), once there is one.
    failure: Mutex<Option<Failure>>,
}

impl Lifecycle {
    pub(crate) fn new(limit: TimeLimit) -> Lifecycle {
        Lifecycle {
            stopped: AtomicBool::new(false),
            limit_ms: AtomicU64::new(limit.as_millis()),
            failure: Mutex::new(None),
        }
    }

    pub(crate) fn time_limit(&self) -> TimeLimit {
        TimeLimit::from_millis(self.limit_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn set_time_limit(&self, limit: TimeLimit) {
        self.limit_ms.store(limit.as_millis(), Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records `f` unless an earlier failure is recorded; returns true if it was the first.
    pub(crate) fn record(&self, f: Failure) -> bool {
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        let first = slot.is_none();
        if first {
            *slot = Some(f);
        }
        self.stopped.store(true, Ordering::Release);
        first
    }
}

/// True for the errors that fail a communicator (see the module docs).
pub(crate) fn fails_communicator(e: &Error) -> bool {
    matches!(
        e,
        Error::Timeout { .. } | Error::PeerFailed { .. } | Error::Aborted { .. }
    )
}

/// The communicator rank an error blames, where it names one.
pub(crate) fn blamed(e: &Error) -> Option<usize> {
    match e {
        Error::Timeout { peer, .. } => *peer,
        Error::PeerFailed { peer, .. } => Some(*peer),
        _ => None,
    }
}
