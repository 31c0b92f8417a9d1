//! Time limits and `abort()` for the operations MPI cannot cancel, and the clean end of the job
//! when one of them must be given up.
//!
//! A blocking collective runs as the blocking MPI call (`MPI_Allreduce`, ...), which is what
//! keeps its cost unchanged: Open MPI's nonblocking collectives (`coll/libnbc`) take 2.5 times
//! as long for 8 bytes on 2 ranks and about 40 % longer for 4 MiB (see docs/performance.md).
//! While it runs, its communicator's [`Watch`] holds the operation (three relaxed stores per
//! call), and one process-wide watchdog thread looks at every watch every [`TICK`]: when the
//! same operation is still in flight past its time limit, or its communicator was aborted, the
//! watchdog ends the job ([`end_job`]). MPI offers no way to take a collective back, and
//! returning while MPI may still write the caller's borrowed buffer would be unsound, so ending
//! the job is the only clean outcome.
//!
//! Point-to-point operations complete on the caller's thread (`raw::wait`): a receive is
//! cancelled and returns an error; a send that cannot complete ends the job the same way.

use crate::raw::{self, Stop};
use grid_core::comm::compact_ranks;
use grid_core::oplog::Recorder;
use grid_core::TimeLimit;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Exit code of a job that one rank ended because an operation passed its time limit
/// (`MPI_Abort(MPI_COMM_WORLD, 124)`; `mpirun` exits with it).
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code of a job that one rank ended because `abort()` was called while an operation MPI
/// cannot cancel was in flight.
pub const EXIT_ABORTED: i32 = 125;

/// How often the watchdog looks at the operations in flight: a blocking collective ends the
/// job between its time limit and its time limit plus this (plus scheduling delays).
pub const TICK: Duration = Duration::from_millis(10);

/// The pause between the message and `MPI_Abort` (so that `mpirun` forwards the message before
/// it kills the job); part of the margin past the time limit.
pub const MESSAGE_GRACE: Duration = Duration::from_millis(200);

/// The operations a watch can hold, by index ([`Watch::enter`] takes the index: no lookup on
/// the fast path).
const OPS: [&str; 14] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "split",
    "create_group",
    "all_to_all_v",
    "all_gather_v",
    "reduce_scatter_v",
    "reduce",
    "gather",
    "scatter",
];
pub(crate) const ALL_REDUCE: usize = 0;
pub(crate) const BROADCAST: usize = 1;
pub(crate) const ALL_GATHER: usize = 2;
pub(crate) const REDUCE_SCATTER: usize = 3;
pub(crate) const ALL_TO_ALL: usize = 4;
pub(crate) const BARRIER: usize = 5;
pub(crate) const SPLIT: usize = 6;
pub(crate) const CREATE_GROUP: usize = 7;
pub(crate) const ALL_TO_ALL_V: usize = 8;
pub(crate) const ALL_GATHER_V: usize = 9;
pub(crate) const REDUCE_SCATTER_V: usize = 10;
pub(crate) const REDUCE: usize = 11;
pub(crate) const GATHER: usize = 12;
pub(crate) const SCATTER: usize = 13;

/// The index in `OPS` of operation `name` (a collective's name as the front end gives it).
pub(crate) fn op_index(name: &str) -> usize {
    OPS.iter().position(|&o| o == name).unwrap_or(BARRIER)
}

/// What a token in flight is: an operation, the mismatch check's exchange before one, or the
/// creation of a sub-communicator (which has no sequence number).
const KIND_OP: u64 = 0;
const KIND_CHECK: u64 = 1;
const KIND_CREATE: u64 = 2;

/// The operation a token names, for messages: `all_reduce #12`, `the mismatch check's exchange
/// (all_reduce) before operation #12`, `split (creating a sub-communicator)`.
fn describe(op: usize, token: u64) -> String {
    let op = OPS.get(op).copied().unwrap_or("operation");
    let (kind, n) = ((token - 1) & 3, (token - 1) >> 2);
    match kind {
        // The exchange's own operation (all_reduce or all_gather), not the checked one's.
        KIND_CHECK => format!("the mismatch check's exchange ({op}) before operation #{n}"),
        KIND_CREATE => format!("{op} (creating a sub-communicator)"),
        _ => format!("{op} #{n}"),
    }
}

/// The blocking collective in flight on one communicator (collectives of one communicator are
/// issued one at a time: MPI requires it), and the communicator's abort flag.
#[derive(Debug)]
pub(crate) struct Watch {
    /// 0: none in flight; otherwise `4 · n + kind + 1` (`n`: the sequence number, or for a
    /// creation the count of creations; `kind`: `KIND_*`).
    token: AtomicU64,
    /// Sub-communicators created from this one so far (their tokens' `n`).
    creations: AtomicU64,
    /// Its time limit in milliseconds (`u64::MAX`: none).
    /// Its time limit: whole seconds (`u64::MAX`: none) and nanoseconds, stored as they are
    /// (no arithmetic on the fast path).
    limit_secs: AtomicU64,
    limit_nanos: AtomicU32,
    /// Its name's index in `OPS`.
    op: AtomicUsize,
    /// Set by `abort()`; checked by every completion loop and by the watchdog.
    pub(crate) aborted: AtomicBool,
    /// What the message names.
    pub(crate) site: Site,
}

/// The communicator a message names.
#[derive(Debug, Clone)]
pub(crate) struct Site {
    pub(crate) comm: String,
    pub(crate) ranks: Vec<usize>,
    pub(crate) world_rank: usize,
}

/// A collective registered with its [`Watch`]; dropping it marks the watch idle.
pub(crate) struct InFlight<'a>(&'a Watch);

impl Drop for InFlight<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.token.store(0, Ordering::Release);
    }
}

impl Watch {
    /// A new watch, registered with the watchdog (started on first use).
    pub(crate) fn new(site: Site) -> Arc<Watch> {
        let w = Arc::new(Watch {
            token: AtomicU64::new(0),
            creations: AtomicU64::new(0),
            limit_secs: AtomicU64::new(u64::MAX),
            limit_nanos: AtomicU32::new(0),
            op: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
            site,
        });
        let dog = watchdog();
        dog.watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&w));
        w
    }

    /// Marks blocking collective `op` #`seq` (or the mismatch check's exchange before it,
    /// `check`) in flight until the guard is dropped.
    #[inline]
    pub(crate) fn enter(&self, op: usize, seq: u64, check: bool, limit: TimeLimit) -> InFlight<'_> {
        let kind = if check { KIND_CHECK } else { KIND_OP };
        self.enter_token(op, (seq << 2 | kind).wrapping_add(1).max(1), limit)
    }

    /// Marks the creation of a sub-communicator from this one (`SPLIT`, `CREATE_GROUP`; a
    /// collective over this communicator) in flight until the guard is dropped.
    pub(crate) fn enter_creation(&self, op: usize, limit: TimeLimit) -> InFlight<'_> {
        let n = self.creations.fetch_add(1, Ordering::Relaxed);
        self.enter_token(op, (n << 2 | KIND_CREATE).wrapping_add(1).max(1), limit)
    }

    #[inline]
    fn enter_token(&self, op: usize, token: u64, limit: TimeLimit) -> InFlight<'_> {
        self.op.store(op, Ordering::Relaxed);
        let (secs, nanos) = match limit {
            TimeLimit::After(d) => (d.as_secs(), d.subsec_nanos()),
            TimeLimit::Unlimited => (u64::MAX, 0),
        };
        self.limit_secs.store(secs, Ordering::Relaxed);
        self.limit_nanos.store(nanos, Ordering::Relaxed);
        self.token.store(token, Ordering::Release);
        InFlight(self)
    }

    /// The time limit of the operation in flight.
    fn limit(&self) -> TimeLimit {
        match self.limit_secs.load(Ordering::Relaxed) {
            u64::MAX => TimeLimit::Unlimited,
            s => TimeLimit::After(Duration::new(s, self.limit_nanos.load(Ordering::Relaxed))),
        }
    }

    /// Marks the communicator aborted and wakes the watchdog.
    pub(crate) fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let dog = watchdog();
        *dog.wake.lock().unwrap_or_else(|p| p.into_inner()) = true;
        dog.cv.notify_all();
    }

    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }
}

/// The process's watchdog: every watch, and how it is woken early (by `abort()`).
struct Watchdog {
    watches: Mutex<Vec<Weak<Watch>>>,
    wake: Mutex<bool>,
    cv: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static DOG: OnceLock<&'static Watchdog> = OnceLock::new();
    DOG.get_or_init(|| {
        let dog: &'static Watchdog = Box::leak(Box::new(Watchdog {
            watches: Mutex::new(Vec::new()),
            wake: Mutex::new(false),
            cv: Condvar::new(),
        }));
        let spawned = std::thread::Builder::new()
            .name("grid-mpi-watchdog".into())
            .spawn(move || watch_loop(dog));
        if let Err(e) = spawned {
            // Without the thread, blocking collectives have no limit; say so once.
            tracing::warn!("backend-mpi: cannot start the watchdog thread ({e}): blocking collectives will not end at their time limit");
        }
        dog
    })
}

fn watch_loop(dog: &'static Watchdog) {
    // (watch, token seen, when it was first seen)
    let mut seen: Vec<(Weak<Watch>, u64, Instant)> = Vec::new();
    loop {
        {
            let woken = dog.wake.lock().unwrap_or_else(|p| p.into_inner());
            let (mut woken, _) = dog
                .cv
                .wait_timeout_while(woken, TICK, |w| !*w)
                .unwrap_or_else(|p| p.into_inner());
            *woken = false;
        }
        if raw::FINALIZED.load(Ordering::Acquire) {
            return;
        }
        let live: Vec<Arc<Watch>> = {
            let mut ws = dog.watches.lock().unwrap_or_else(|p| p.into_inner());
            ws.retain(|w| w.strong_count() > 0);
            ws.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        seen.retain(|(w, _, _)| w.strong_count() > 0);
        for w in &live {
            let token = w.token.load(Ordering::Acquire);
            let slot = seen
                .iter()
                .position(|(s, _, _)| std::ptr::eq(s.as_ptr(), Arc::as_ptr(w)));
            if token == 0 {
                if let Some(i) = slot {
                    seen.swap_remove(i);
                }
                continue;
            }
            let first = match slot {
                Some(i) if seen[i].1 == token => seen[i].2,
                Some(i) => {
                    seen[i] = (Arc::downgrade(w), token, now);
                    now
                }
                None => {
                    seen.push((Arc::downgrade(w), token, now));
                    now
                }
            };
            let limit = w.limit();
            let why = if w.is_aborted() {
                Some(Stop::Abort)
            } else if limit
                .duration()
                .is_some_and(|l| now.duration_since(first) >= l)
            {
                Some(Stop::Timeout)
            } else {
                None
            };
            // The same operation must still be in flight (it may have just finished).
            if let Some(why) = why {
                if w.token.load(Ordering::Acquire) == token {
                    end_job(&Ending {
                        what: describe(w.op.load(Ordering::Relaxed), token),
                        limit,
                        why,
                        site: &w.site,
                    });
                }
            }
        }
    }
}

/// What ended the job, for its message.
pub(crate) struct Ending<'a> {
    /// The operation (`send #3`, see `describe`).
    pub(crate) what: String,
    pub(crate) limit: TimeLimit,
    pub(crate) why: Stop,
    pub(crate) site: &'a Site,
}

impl Ending<'_> {
    /// The exit code the job ends with.
    pub(crate) fn code(&self) -> i32 {
        match self.why {
            Stop::Timeout => EXIT_TIMEOUT,
            Stop::Abort => EXIT_ABORTED,
        }
    }

    /// The one message printed to stderr.
    pub(crate) fn message(&self) -> String {
        let what = &self.what;
        let why = match self.why {
            Stop::Timeout => format!(
                "did not complete within its time limit of {} (timeout)",
                self.limit
            ),
            Stop::Abort => {
                "was still in progress when abort() was called on this rank (abort)".to_string()
            }
        };
        let cause = match self.why {
            Stop::Timeout => " A rank that never entered the operation (stopped, dead, or issuing another operation) is the likely cause; with GRID_TRACE_DIR set, `grid trace DIR` names it.",
            Stop::Abort => "",
        };
        format!(
            "[backend-mpi] world rank {}: ending the job (MPI_Abort, exit code {}): {what} on communicator '{}' (world ranks {}) {why}. MPI cannot cancel this operation, and returning while MPI may still use the caller's buffer would be unsafe, so the job ends here.{cause}",
            self.site.world_rank,
            self.code(),
            self.site.comm,
            compact_ranks(&self.site.ranks),
        )
    }
}

/// Ends the job: prints the message, dumps the operation log (when `GRID_TRACE_DIR` is set),
/// and calls `MPI_Abort` on `MPI_COMM_WORLD` with [`EXIT_TIMEOUT`] or [`EXIT_ABORTED`].
pub(crate) fn end_job(e: &Ending<'_>) -> ! {
    static ENDING: AtomicBool = AtomicBool::new(false);
    let code = e.code();
    // One message per process, even if two threads give up at once.
    if !ENDING.swap(true, Ordering::AcqRel) {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{}", e.message());
        let rec = Recorder::global();
        if rec.trace_dir().is_some() {
            let reason = match e.why {
                Stop::Timeout => "timeout",
                Stop::Abort => "abort",
            };
            match rec.dump(reason) {
                Ok(Some(p)) => {
                    let _ = writeln!(
                        err,
                        "[backend-mpi] operation log written to {}",
                        p.display()
                    );
                }
                Ok(None) => {}
                Err(d) => {
                    let _ = writeln!(err, "[backend-mpi] cannot write the operation log: {d}");
                }
            }
        }
        let _ = err.flush();
        drop(err);
        // mpirun forwards the ranks' output asynchronously and drops what arrives after it
        // began killing the job: give the message time to get out first.
        std::thread::sleep(MESSAGE_GRACE);
        raw::Comm::abort_world(code);
    } else {
        // Another thread is ending the job; wait for MPI_Abort to take the process.
        std::thread::sleep(Duration::from_secs(5));
    }
    std::process::exit(code)
}

/// Makes SIGTERM report what this process was doing before it ends: `mpirun` sends SIGTERM to
/// every process of the job when one process died or exited without `MPI_Finalize` (about one
/// second after the death with Open MPI 4.1, see the crate docs), and on `mpirun --timeout` or a
/// cancelled job. The signal handler only wakes a helper thread (`grid-mpi-sigterm`, through
/// signal-hook's self-pipe, async-signal-safe), which prints one line per blocking collective
/// in flight, dumps the operation log when `GRID_TRACE_DIR` is set (reason `SIGTERM`), and then
/// ends the process as SIGTERM's default action would. Installed once per process, by
/// [`crate::MpiRuntime::init_with`] when [`crate::MpiConfig::sigterm_report`] is on.
#[cfg(unix)]
pub(crate) fn install_sigterm_report() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use signal_hook::consts::SIGTERM;
        let mut signals = match signal_hook::iterator::Signals::new([SIGTERM]) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("backend-mpi: cannot install the SIGTERM report: {e}");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("grid-mpi-sigterm".into())
            .spawn(move || {
                if signals.forever().next().is_some() {
                    report_sigterm();
                    let _ = signal_hook::low_level::emulate_default_handler(SIGTERM);
                    std::process::exit(128 + SIGTERM);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("backend-mpi: cannot start the SIGTERM report thread: {e}");
        }
    });
}

/// What SIGTERM prints: every blocking collective in flight in this process, then the dump.
#[cfg(unix)]
fn report_sigterm() {
    let live: Vec<Arc<Watch>> = {
        let ws = watchdog().watches.lock().unwrap_or_else(|p| p.into_inner());
        ws.iter().filter_map(Weak::upgrade).collect()
    };
    let mut err = std::io::stderr().lock();
    let mut any = false;
    for w in &live {
        let token = w.token.load(Ordering::Acquire);
        if token == 0 {
            continue;
        }
        any = true;
        let what = describe(w.op.load(Ordering::Relaxed), token);
        let _ = writeln!(
            err,
            "[backend-mpi] world rank {}: terminated by SIGTERM (mpirun ends the whole job when a process died or exited without MPI_Finalize) while waiting in {what} on communicator '{}' (world ranks {}); time limit {}. MPI reported no error: a rank that never entered the operation is the likely cause.",
            w.site.world_rank,
            w.site.comm,
            compact_ranks(&w.site.ranks),
            w.limit(),
        );
    }
    if !any {
        let rank = live.first().map(|w| w.site.world_rank.to_string());
        let _ = writeln!(
            err,
            "[backend-mpi] world rank {}: terminated by SIGTERM, no blocking collective in flight",
            rank.as_deref().unwrap_or("?")
        );
    }
    let rec = Recorder::global();
    if rec.trace_dir().is_some() {
        match rec.dump("SIGTERM") {
            Ok(Some(p)) => {
                let _ = writeln!(
                    err,
                    "[backend-mpi] operation log written to {}",
                    p.display()
                );
            }
            Ok(None) => {}
            Err(d) => {
                let _ = writeln!(err, "[backend-mpi] cannot write the operation log: {d}");
            }
        }
    }
    let _ = err.flush();
}
