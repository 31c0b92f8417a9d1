//! The failure-handling state machine of the NCCL backend, with no CUDA in it: which
//! communicators are still starting, which operations are still running on the device, when
//! they time out, what an abort or an asynchronous error does to everything pending, and when
//! the buffers of an operation may be freed.
//!
//! The device runtime is reached through two small traits, [`DeviceComm`] (one library
//! communicator: its progress, its asynchronous error, abort, finalize, destroy) and
//! [`DeviceEvent`] (the completion marker recorded after one enqueued operation). The backend
//! implements them over NCCL and CUDA (`ncclCommGetAsyncError`, `ncclCommAbort`,
//! `ncclCommFinalize`, `cuEventQuery`); this crate's CPU tests implement them with a scripted
//! stand-in (events that never complete, an asynchronous error raised mid-run, a peer that
//! never arrives) to check this state machine without a GPU. The stand-in lives in the tests
//! only; it is not a backend.
//!
//! # The pieces
//! * A [`Watchdog`] (one per process for the NCCL backend, [`Watchdog::global`]) owns a thread
//!   that, every [`WatchdogOptions::poll`] and whenever it is [kicked](Watchdog::kick) (the
//!   backend kicks it from a CUDA host function enqueued after each operation, so a completion
//!   is noticed at once), polls every tracked communicator's progress and asynchronous error and
//!   the completion markers of every pending operation. It resolves operations that completed,
//!   fails a communicator whose asynchronous error is set or whose operation passed its time
//!   limit, and drops the buffers of finished operations nobody waits for.
//! * A [`Tracked`] communicator is registered **before** its initialisation finishes (so it can
//!   be aborted while `ncclCommInitRank` or `ncclCommSplit` is still connecting). While a library
//!   call is in progress ([`Tracked::settle`], `ncclInProgress` in NCCL's nonblocking mode) the
//!   caller waits on a condition variable that the watchdog signals; the time limit bounds it.
//! * [`Tracked::launch`] registers one enqueued operation: its completion marker, its time limit
//!   and the buffers the device still uses. It returns a [`Completion`] at once (nothing is
//!   deferred). [`Completion::wait`] blocks on a condition variable, never in a sleep loop;
//!   dropping a [`Completion`] early leaves the buffers with the watchdog until the marker says
//!   the device is done with them.
//! * A failure (an asynchronous error, a time limit, a failed marker) or [`Tracked::abort`]
//!   resolves every pending operation of the communicator with an error **at once**, then asks
//!   the library to abort ([`DeviceComm::abort`], on a helper thread, outside every lock of this
//!   module); with a [`Job`] that aborts on failure, every other communicator of the job is
//!   aborted too, so no rank stays blocked in another group waiting for a failed peer.
//! * [`Tracked::close`] (the communicator was dropped) lets the pending operations finish
//!   (within their limits), then finalizes the communicator without blocking
//!   ([`DeviceComm::finalize`] polled by the watchdog up to [`WatchdogOptions::close_limit`]) and
//!   destroys it, or aborts it when finalizing fails or does not finish in time.
//!
//! Locks: the watchdog's table, each communicator's state and each operation's slot, always
//! taken in that order and never held while a [`DeviceComm`] method runs.

use grid_core::{Error, Result, TimeLimit};
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Whether a step of the device runtime has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Finished.
    Done,
    /// Still running (NCCL's `ncclInProgress`, CUDA's `CUDA_ERROR_NOT_READY`).
    InProgress,
}

/// One communicator of the device runtime, as the state machine sees it. The backend
/// implements it over an `ncclComm_t` in nonblocking mode.
///
/// No method may block on the device or on the network: each returns at once.
pub trait DeviceComm: Send + Sync + 'static {
    /// The communicator's state (`ncclCommGetAsyncError`): `Ok(Done)` when no library call is
    /// in progress and no error was reported, `Ok(InProgress)` while an initialisation, a split
    /// or a group call is still running, `Err` once an asynchronous error was reported.
    fn progress(&self) -> Result<Progress>;
    /// Aborts the communicator in the library (`ncclCommAbort`). Called at most once, on a
    /// helper thread (so neither `abort()` nor the watchdog waits for it), never while this
    /// module holds a lock; must not wait on a lock held by a thread that is blocked inside the
    /// library.
    fn abort(&self);
    /// Starts the orderly shutdown (`ncclCommFinalize`); `InProgress` means the watchdog polls
    /// [`DeviceComm::progress`] until it is done. Called at most once, on an idle communicator.
    fn finalize(&self) -> Result<Progress>;
    /// Frees a finalized communicator (`ncclCommDestroy`). Called at most once, after
    /// finalizing finished.
    fn destroy(&self);
}

/// The completion marker of one enqueued operation (a CUDA event recorded after it on the
/// communicator's stream).
pub trait DeviceEvent: Send + 'static {
    /// `Ok(Done)` once the device finished everything enqueued before the marker; never blocks.
    fn query(&self) -> Result<Progress>;
}

/// Whether a stream is being captured into a CUDA graph (`cuStreamIsCapturing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// Not capturing: work runs when enqueued (eager).
    Eager,
    /// Capturing: work enqueued now becomes part of a graph and runs only when the graph is
    /// launched, possibly many times.
    Capturing,
    /// The capture was invalidated by an earlier call; it can only be ended.
    Invalidated,
}

/// A stream operations are enqueued on, as the state machine sees it. The backend implements it
/// over a CUDA stream.
pub trait DeviceStream {
    /// The stream's capture state; never blocks.
    fn capture(&self) -> Result<Capture>;
}

/// How an operation enqueued under a given [`Capture`] state is followed ([`launch_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// Eager work: a completion marker is recorded after it and the watchdog polls it
    /// (time limit, buffers kept until the device is done).
    Watched,
    /// Captured into a graph: nothing runs now, so there is nothing to poll. No marker is
    /// queried (querying an event recorded during capture invalidates the capture, CUDA's
    /// `CUDA_ERROR_CAPTURED_EVENT`), no host function is enqueued (it would run at every
    /// replay), and the buffers go back to the caller at once: the graph refers to them, so
    /// the caller keeps them alive for as long as it may launch the graph.
    Captured,
}

/// What to do with operation `op` enqueued on a stream in state `capture`; `host_staged` says
/// whether it moves host memory (staged through the GPU with copies and a host wait) or waits
/// on the host (a barrier, `synchronize`). Pure.
///
/// Errors: host staging or a host wait during capture ([`Error::Unsupported`] naming the
/// operation and why), an invalidated capture ([`Error::Invalid`]).
///
/// ```
/// use backend_nccl::engine::{launch_plan, Capture, Launch};
/// assert_eq!(launch_plan("all_reduce", Capture::Eager, true).unwrap(), Launch::Watched);
/// assert_eq!(launch_plan("all_reduce", Capture::Capturing, false).unwrap(), Launch::Captured);
/// let e = launch_plan("all_gather", Capture::Capturing, true).unwrap_err();
/// assert!(e.to_string().contains("all_gather"));
/// assert!(e.to_string().contains("CUDA graph"));
/// ```
pub fn launch_plan(op: &'static str, capture: Capture, host_staged: bool) -> Result<Launch> {
    match (capture, host_staged) {
        (Capture::Eager, _) => Ok(Launch::Watched),
        (Capture::Capturing, false) => Ok(Launch::Captured),
        (Capture::Capturing, true) => Err(Error::Unsupported {
            op,
            backend: "nccl",
            what: "host memory or a host wait while a stream is being captured into a CUDA graph (host buffers are staged with copies and a host wait, which a graph cannot replay; a barrier and synchronize wait on the host); pass device buffers (NcclDeviceBuffer) during capture, and wait after launching the graph".into(),
        }),
        (Capture::Invalidated, _) => Err(Error::Invalid(format!(
            "{op}: the stream's CUDA graph capture was invalidated by an earlier call; end the capture (cuStreamEndCapture) and capture again"
        ))),
    }
}

/// The [`Capture`] state of several streams together: capturing if any is (an operation that
/// joins them is then part of the capture), invalidated if any capture is.
///
/// ```
/// use backend_nccl::engine::{combine_capture, Capture};
/// assert_eq!(combine_capture([Capture::Eager, Capture::Capturing]), Capture::Capturing);
/// assert_eq!(combine_capture([]), Capture::Eager);
/// ```
pub fn combine_capture(states: impl IntoIterator<Item = Capture>) -> Capture {
    states
        .into_iter()
        .fold(Capture::Eager, |a, b| match (a, b) {
            (Capture::Invalidated, _) | (_, Capture::Invalidated) => Capture::Invalidated,
            (Capture::Capturing, _) | (_, Capture::Capturing) => Capture::Capturing,
            _ => Capture::Eager,
        })
}

/// Settings of a [`Watchdog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogOptions {
    /// How often the watchdog polls asynchronous errors, in-progress library calls and
    /// completion markers when nothing kicks it. Completions kick it (CUDA host functions), so
    /// this bounds only how late an asynchronous error, a connection that finished or a time
    /// limit is noticed by the watchdog itself (a waiting thread notices its own time limit on
    /// the dot). Default 10 ms.
    pub poll: Duration,
    /// How long a dropped communicator may take to finalize before it is aborted instead.
    /// Default 30 s.
    pub close_limit: Duration,
}

impl Default for WatchdogOptions {
    fn default() -> Self {
        WatchdogOptions {
            poll: Duration::from_millis(10),
            close_limit: Duration::from_secs(30),
        }
    }
}

/// Locks a mutex, also after a panic of another holder (every critical section of this module
/// leaves the data consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ------------------------------------------------------------------------------------------------
// Watchdog
// ------------------------------------------------------------------------------------------------

/// The watchdog thread and the communicators it watches. See the module docs.
///
/// ```
/// use backend_nccl::engine::{Watchdog, WatchdogOptions};
/// let dog = Watchdog::start(WatchdogOptions::default())?;
/// assert_eq!(dog.tracked(), 0);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub struct Watchdog {
    dog: Arc<Dog>,
    /// Only the process-wide watchdog is never stopped.
    stop_on_drop: bool,
}

struct Dog {
    table: Mutex<Table>,
    wake: Condvar,
    opts: WatchdogOptions,
}

struct Table {
    comms: Vec<Arc<Tracked>>,
    kicked: bool,
    stop: bool,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("tracked", &self.tracked())
            .field("opts", &self.dog.opts)
            .finish()
    }
}

impl Watchdog {
    /// Starts a watchdog thread (stopped when the returned handle is dropped). The backend uses
    /// one per process, [`Watchdog::global`].
    pub fn start(opts: WatchdogOptions) -> Result<Watchdog> {
        Ok(Watchdog {
            dog: Dog::spawn(opts)?,
            stop_on_drop: true,
        })
    }

    /// The process's watchdog (started on first use with the default options); every NCCL
    /// communicator of the process is watched by it.
    pub fn global() -> Result<&'static Watchdog> {
        static G: OnceLock<std::result::Result<Watchdog, Error>> = OnceLock::new();
        G.get_or_init(|| {
            Dog::spawn(WatchdogOptions::default()).map(|dog| Watchdog {
                dog,
                stop_on_drop: false,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// The options it runs with.
    pub fn options(&self) -> &WatchdogOptions {
        &self.dog.opts
    }

    /// Wakes the watchdog now (a completion marker may have fired). Cheap; callable from any
    /// thread, including a CUDA host function (it takes one short lock and makes no CUDA call).
    pub fn kick(&self) {
        self.dog.kick();
    }

    /// A handle to kick the watchdog from elsewhere (a CUDA host function).
    pub fn kicker(&self) -> Kicker {
        Kicker(Arc::downgrade(&self.dog))
    }

    /// How many communicators it still watches (including dropped ones whose operations or
    /// finalization are still pending).
    pub fn tracked(&self) -> usize {
        lock(&self.dog.table).comms.len()
    }

    /// Starts tracking a communicator whose creation is still in progress (`op`, for example
    /// `"init"` or `"split"`): until [`Tracked::settle`] returns, the watchdog polls
    /// [`DeviceComm::progress`] for it, and [`Tracked::abort`] already works. `job` (if any) is
    /// the group of communicators aborted together on a failure.
    pub fn track(
        &self,
        name: impl Into<String>,
        device: Arc<dyn DeviceComm>,
        op: &'static str,
        job: Option<&Arc<Job>>,
    ) -> Arc<Tracked> {
        let t = Arc::new(Tracked {
            name: name.into(),
            device,
            state: Mutex::new(State {
                phase: Phase::Live,
                busy: Some(Busy {
                    op,
                    deadline: None,
                    limit: TimeLimit::Unlimited,
                }),
                entries: Vec::new(),
                closing: false,
            }),
            changed: Condvar::new(),
            device_aborted: AtomicBool::new(false),
            captured_ops: AtomicUsize::new(0),
            dog: Arc::downgrade(&self.dog),
            job: job.map(Arc::downgrade),
        });
        if let Some(j) = job {
            j.register(&t);
        }
        let mut table = lock(&self.dog.table);
        table.comms.push(t.clone());
        table.kicked = true;
        drop(table);
        self.dog.wake.notify_all();
        t
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if self.stop_on_drop {
            lock(&self.dog.table).stop = true;
            self.dog.wake.notify_all();
        }
    }
}

/// Wakes a [`Watchdog`] (see [`Watchdog::kick`]); does nothing once the watchdog is gone.
#[derive(Clone, Debug)]
pub struct Kicker(Weak<Dog>);

impl std::fmt::Debug for Dog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dog")
    }
}

impl Kicker {
    /// Wakes the watchdog.
    pub fn kick(&self) {
        if let Some(d) = self.0.upgrade() {
            d.kick();
        }
    }
}

impl Dog {
    fn spawn(opts: WatchdogOptions) -> Result<Arc<Dog>> {
        if opts.poll.is_zero() {
            return Err(Error::Invalid(
                "watchdog: poll interval 0 (give at least 1 µs; the default is 10 ms)".into(),
            ));
        }
        let dog = Arc::new(Dog {
            table: Mutex::new(Table {
                comms: Vec::new(),
                kicked: false,
                stop: false,
            }),
            wake: Condvar::new(),
            opts,
        });
        let d = dog.clone();
        std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || d.run())
            .map_err(|e| {
                Error::Library(Box::new(grid_core::LibraryError::new(
                    crate::error::BACKEND,
                    "start the watchdog thread",
                    e.to_string(),
                )))
            })?;
        Ok(dog)
    }

    fn kick(&self) {
        lock(&self.table).kicked = true;
        self.wake.notify_all();
    }

    fn run(&self) {
        loop {
            let comms = {
                let mut t = lock(&self.table);
                if t.stop {
                    return;
                }
                if !t.kicked {
                    t = self
                        .wake
                        .wait_timeout(t, self.opts.poll)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                    if t.stop {
                        return;
                    }
                }
                t.kicked = false;
                t.comms.clone()
            };
            let mut finished = Vec::new();
            for c in &comms {
                if c.tick(&self.opts) {
                    finished.push(Arc::as_ptr(c));
                }
            }
            if !finished.is_empty() {
                lock(&self.table)
                    .comms
                    .retain(|c| !finished.contains(&Arc::as_ptr(c)));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// A tracked communicator
// ------------------------------------------------------------------------------------------------

/// What a communicator is doing, as far as the state machine knows.
#[derive(Debug, Clone)]
enum Phase {
    /// Usable.
    Live,
    /// Failed (asynchronous error, time limit, failed marker): the first error.
    Failed(Error),
    /// Aborted: why.
    Aborted(String),
    /// Dropped and finalizing (`ncclCommFinalize` in progress) until the deadline.
    Finalizing(Instant),
    /// Finalized and destroyed.
    Destroyed,
}

/// A library call still in progress (`ncclInProgress`): creation, split, group end.
#[derive(Debug, Clone, Copy)]
struct Busy {
    op: &'static str,
    deadline: Option<Instant>,
    limit: TimeLimit,
}

struct State {
    phase: Phase,
    busy: Option<Busy>,
    entries: Vec<Entry>,
    closing: bool,
}

/// One enqueued operation the device may still be working on.
struct Entry {
    slot: Arc<Slot>,
    event: Box<dyn DeviceEvent>,
    deadline: Option<Instant>,
    limit: TimeLimit,
}

/// One communicator of the device runtime under the watchdog. See the module docs.
pub struct Tracked {
    name: String,
    device: Arc<dyn DeviceComm>,
    state: Mutex<State>,
    /// Signalled when `busy` clears or the phase changes.
    changed: Condvar,
    device_aborted: AtomicBool,
    dog: Weak<Dog>,
    job: Option<Weak<Job>>,
    captured_ops: AtomicUsize,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked")
            .field("name", &self.name)
            .field("state", &self.state_name())
            .field("pending", &self.pending())
            .finish()
    }
}

impl Tracked {
    /// The communicator's name (for errors).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `"live"`, `"failed"`, `"aborted"`, `"finalizing"` or `"destroyed"`.
    pub fn state_name(&self) -> &'static str {
        match lock(&self.state).phase {
            Phase::Live => "live",
            Phase::Failed(_) => "failed",
            Phase::Aborted(_) => "aborted",
            Phase::Finalizing(_) => "finalizing",
            Phase::Destroyed => "destroyed",
        }
    }

    /// True while the communicator can take operations.
    pub fn is_live(&self) -> bool {
        matches!(lock(&self.state).phase, Phase::Live)
    }

    /// How many enqueued operations the device may still be working on (including those whose
    /// [`Completion`] was dropped or failed: their buffers are kept until the device is done).
    pub fn pending(&self) -> usize {
        lock(&self.state).entries.len()
    }

    /// The first failure, when the communicator failed (not when it was aborted on request).
    pub fn failure(&self) -> Option<Error> {
        match &lock(&self.state).phase {
            Phase::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// `Ok` while the communicator can take operation `op`; otherwise the error the operation
    /// gets ([`Error::Aborted`] naming why, or [`Error::Finalized`]).
    pub fn check_live(&self, op: &'static str) -> Result<()> {
        match &lock(&self.state).phase {
            Phase::Live => Ok(()),
            other => Err(refusal(&self.name, op, other)),
        }
    }

    /// Marks a library call of the communicator as in progress (`ncclInProgress` was returned):
    /// the watchdog polls [`DeviceComm::progress`] until it is done. Follow it with
    /// [`Tracked::settle`].
    pub fn begin(&self, op: &'static str) {
        lock(&self.state).busy = Some(Busy {
            op,
            deadline: None,
            limit: TimeLimit::Unlimited,
        });
        self.kick();
    }

    /// Waits until the library call in progress (creation, split, group end: see
    /// [`Tracked::begin`] and [`Watchdog::track`]) has finished, for at most `limit`. Blocks on
    /// a condition variable the watchdog signals. Errors: [`Error::Timeout`] after `limit` (the
    /// communicator is then failed and aborted), the asynchronous error the library reported,
    /// or [`Error::Aborted`] when the communicator was aborted meanwhile.
    pub fn settle(&self, op: &'static str, limit: TimeLimit) -> Result<()> {
        let deadline = limit.deadline_from(Instant::now());
        let mut s = lock(&self.state);
        if let Some(b) = s.busy.as_mut() {
            b.deadline = deadline;
            b.limit = limit;
        }
        loop {
            if !matches!(s.phase, Phase::Live) {
                let e = match &s.phase {
                    Phase::Failed(e) => e.clone(),
                    other => refusal(&self.name, op, other),
                };
                return Err(e);
            }
            if s.busy.is_none() {
                return Ok(());
            }
            match deadline {
                None => s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        drop(s);
                        let busy_op = lock(&self.state).busy.map(|b| b.op).unwrap_or(op);
                        self.fail(Error::Timeout {
                            op: busy_op,
                            millis: limit.as_millis(),
                            peer: None,
                            at: None,
                        });
                        s = lock(&self.state);
                        continue;
                    }
                    s = self
                        .changed
                        .wait_timeout(s, d - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            }
        }
    }

    /// Registers an operation just enqueued on the device: its completion marker, its time
    /// limit (measured from now) and the buffers the device uses until the marker fires
    /// (`keep`). Returns its [`Completion`] at once.
    ///
    /// If the communicator failed or was aborted meanwhile, the operation is still registered
    /// (the device may run it, so its buffers must stay alive until the marker fires) and the
    /// returned completion holds the communicator's error.
    pub fn launch(
        self: &Arc<Self>,
        op: &'static str,
        limit: TimeLimit,
        event: Box<dyn DeviceEvent>,
        keep: Vec<Box<dyn Any + Send>>,
    ) -> Completion {
        let slot = Arc::new(Slot {
            op,
            state: Mutex::new(SlotState {
                outcome: None,
                keep,
            }),
            done: Condvar::new(),
        });
        let deadline = limit.deadline_from(Instant::now());
        let mut s = lock(&self.state);
        if !matches!(s.phase, Phase::Live) {
            let e = match &s.phase {
                Phase::Failed(e) => aborted_by(&self.name, op, e),
                other => refusal(&self.name, op, other),
            };
            lock(&slot.state).outcome = Some(Err(e));
        }
        s.entries.push(Entry {
            slot: slot.clone(),
            event,
            deadline,
            limit,
        });
        drop(s);
        Completion {
            comm: self.clone(),
            slot,
            deadline,
            limit,
        }
    }

    /// Registers an operation just enqueued on `stream` and follows it as its capture state
    /// requires ([`launch_plan`]): eager work gets its completion marker from `marker` and is
    /// watched ([`Tracked::launch`]); captured work is not watched ([`Tracked::captured`]).
    /// `host_staged`: the operation moves host memory or waits on the host (refused during
    /// capture). Call it **before** enqueueing anything that the decision forbids.
    pub fn launch_on(
        self: &Arc<Self>,
        op: &'static str,
        limit: TimeLimit,
        stream: &dyn DeviceStream,
        marker: impl FnOnce() -> Result<Box<dyn DeviceEvent>>,
        keep: Vec<Box<dyn Any + Send>>,
    ) -> Result<(Completion, Launch)> {
        match launch_plan(op, stream.capture()?, false)? {
            Launch::Watched => Ok((self.launch(op, limit, marker()?, keep), Launch::Watched)),
            Launch::Captured => Ok((self.captured(op, keep), Launch::Captured)),
        }
    }

    /// An operation captured into a CUDA graph: nothing runs now, so the watchdog never sees
    /// it (no marker, no time limit, no query). The completion is finished at once (with the
    /// communicator's error if it is no longer live) and hands `keep` back. Launching the
    /// graph later runs the operation outside this state machine: the communicator's
    /// asynchronous-error polling still covers it.
    pub fn captured(
        self: &Arc<Self>,
        op: &'static str,
        keep: Vec<Box<dyn Any + Send>>,
    ) -> Completion {
        let outcome = match &lock(&self.state).phase {
            Phase::Live => Ok(()),
            Phase::Failed(e) => Err(aborted_by(&self.name, op, e)),
            other => Err(refusal(&self.name, op, other)),
        };
        self.captured_ops.fetch_add(1, Ordering::Relaxed);
        Completion {
            comm: self.clone(),
            slot: Arc::new(Slot {
                op,
                state: Mutex::new(SlotState {
                    outcome: Some(outcome),
                    keep,
                }),
                done: Condvar::new(),
            }),
            deadline: None,
            limit: TimeLimit::Unlimited,
        }
    }

    /// How many operations were captured into CUDA graphs on this communicator.
    pub fn captured_ops(&self) -> usize {
        self.captured_ops.load(Ordering::Relaxed)
    }

    /// Aborts the communicator on request: every pending operation returns [`Error::Aborted`]
    /// at once, later ones are refused, then the library is asked to abort
    /// ([`DeviceComm::abort`]). Returns false if it was not live (already failed, aborted or
    /// destroyed; the library is aborted at most once either way). Never waits for the device.
    pub fn abort(&self, reason: &str) -> bool {
        let first = self.stop(Phase::Aborted(reason.to_string()), None);
        self.abort_device();
        first
    }

    /// Fails the communicator with `e` (the first failure wins): every pending operation
    /// returns an error at once, the library is aborted, and so is every other communicator of
    /// the job when it aborts on failure. Returns false if it had already stopped.
    pub fn fail(&self, e: Error) -> bool {
        let first = self.stop(Phase::Failed(e.clone()), Some(&e));
        self.abort_device();
        if first {
            tracing::error!(comm = %self.name, "nccl: {e}; communicator aborted");
            if let Some(job) = self.job.as_ref().and_then(Weak::upgrade) {
                job.member_failed(self, &e);
            }
        }
        first
    }

    /// The communicator was dropped: the watchdog lets its pending operations finish (within
    /// their limits), then finalizes and destroys it without blocking, or aborts it (see the
    /// module docs).
    pub fn close(&self) {
        lock(&self.state).closing = true;
        self.kick();
    }

    fn kick(&self) {
        if let Some(d) = self.dog.upgrade() {
            d.kick();
        }
    }

    /// Moves a live communicator to `phase`, resolving every pending operation with its error.
    fn stop(&self, phase: Phase, cause: Option<&Error>) -> bool {
        let mut s = lock(&self.state);
        if !matches!(s.phase, Phase::Live) {
            return false;
        }
        for en in &s.entries {
            let e = match cause {
                Some(c) => aborted_by(&self.name, en.slot.op, c),
                None => refusal(&self.name, en.slot.op, &phase),
            };
            en.slot.resolve(Err(e));
        }
        s.phase = phase;
        s.busy = None;
        drop(s);
        self.changed.notify_all();
        true
    }

    /// Asks the library to abort, once, on a helper thread: `ncclCommAbort` can take a while
    /// (it stops the communicator's kernels and joins its threads), and neither `abort()` nor
    /// the watchdog may wait for it. The waiting threads were released before.
    fn abort_device(&self) {
        if self.device_aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        let device = self.device.clone();
        let name = self.name.clone();
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                device.abort();
                tracing::debug!(comm = %name, "nccl: communicator aborted in the library");
            });
        if let Err(e) = spawned {
            tracing::warn!(comm = %self.name, "nccl: no thread for the abort ({e}); aborting inline");
            self.device.abort();
        }
    }

    /// One round of the watchdog; true when the communicator is finished with (dropped and
    /// nothing left to watch).
    fn tick(&self, opts: &WatchdogOptions) -> bool {
        let now = Instant::now();
        // Completion markers.
        let mut failure = None;
        {
            let mut s = lock(&self.state);
            s.entries.retain(|en| match en.event.query() {
                Ok(Progress::Done) => {
                    en.slot.resolve(Ok(()));
                    false
                }
                Ok(Progress::InProgress) => {
                    if failure.is_none() && en.deadline.is_some_and(|d| now >= d) {
                        failure = Some(Error::Timeout {
                            op: en.slot.op,
                            millis: en.limit.as_millis(),
                            peer: None,
                            at: None,
                        });
                    }
                    true
                }
                Err(e) => {
                    // The marker itself failed: the device's state is unknown; the buffers go
                    // (nothing will tell us more later) and the communicator fails.
                    en.slot.resolve(Err(e.clone()));
                    if failure.is_none() {
                        failure = Some(e);
                    }
                    false
                }
            });
        }
        if let Some(e) = failure {
            self.fail(e);
        }
        let (live, busy, closing, idle, finalizing) = {
            let s = lock(&self.state);
            (
                matches!(s.phase, Phase::Live),
                s.busy,
                s.closing,
                s.entries.is_empty(),
                match s.phase {
                    Phase::Finalizing(d) => Some(d),
                    _ => None,
                },
            )
        };
        if live {
            // The asynchronous error, and any library call in progress.
            match self.device.progress() {
                Err(e) => {
                    self.fail(e);
                }
                Ok(Progress::Done) => {
                    if busy.is_some() {
                        lock(&self.state).busy = None;
                        self.changed.notify_all();
                    }
                }
                Ok(Progress::InProgress) => {
                    if let Some(b) = busy {
                        if b.deadline.is_some_and(|d| now >= d) {
                            self.fail(Error::Timeout {
                                op: b.op,
                                millis: b.limit.as_millis(),
                                peer: None,
                                at: None,
                            });
                        }
                    }
                }
            }
            if closing && idle && busy.is_none() && self.is_live() {
                match self.device.finalize() {
                    Ok(Progress::Done) => self.destroy(),
                    Ok(Progress::InProgress) => {
                        let d = now + opts.close_limit;
                        let mut s = lock(&self.state);
                        if matches!(s.phase, Phase::Live) {
                            s.phase = Phase::Finalizing(d);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(comm = %self.name, "nccl: finalizing failed, aborting instead: {e}");
                        self.stop(Phase::Aborted(format!("finalizing failed: {e}")), None);
                        self.abort_device();
                    }
                }
            }
        } else if let Some(deadline) = finalizing {
            match self.device.progress() {
                Ok(Progress::Done) => self.destroy(),
                Ok(Progress::InProgress) if now < deadline => {}
                other => {
                    tracing::warn!(comm = %self.name, "nccl: finalizing did not finish ({other:?}), aborting instead");
                    lock(&self.state).phase =
                        Phase::Aborted("finalizing did not finish in time".into());
                    self.abort_device();
                }
            }
        }
        let s = lock(&self.state);
        s.closing
            && s.entries.is_empty()
            && matches!(
                s.phase,
                Phase::Destroyed | Phase::Aborted(_) | Phase::Failed(_)
            )
    }

    fn destroy(&self) {
        lock(&self.state).phase = Phase::Destroyed;
        self.changed.notify_all();
        // Destroyed, not aborted: `abort_device` must not run afterwards.
        if !self.device_aborted.swap(true, Ordering::AcqRel) {
            self.device.destroy();
        }
    }
}

/// The error of operation `op` refused or ended because the communicator is in `phase`.
fn refusal(name: &str, op: &'static str, phase: &Phase) -> Error {
    match phase {
        Phase::Live => Error::Aborted {
            op,
            reason: format!("internal: communicator '{name}' is live"),
            at: None,
        },
        Phase::Failed(e) => aborted_by(name, op, e),
        Phase::Aborted(why) => Error::Aborted {
            op,
            reason: format!("communicator '{name}' was aborted ({why})"),
            at: None,
        },
        Phase::Finalizing(_) | Phase::Destroyed => Error::Finalized {
            op,
            state: "destroyed",
        },
    }
}

/// The error operation `op` gets when its communicator failed with `cause`: the cause itself
/// for the operation that failed, [`Error::Aborted`] naming the cause for the others.
fn aborted_by(name: &str, op: &'static str, cause: &Error) -> Error {
    match cause {
        Error::Timeout { op: o, .. } if *o == op => cause.clone(),
        Error::Library(l) if l.op == op => cause.clone(),
        _ => Error::Aborted {
            op,
            reason: format!("communicator '{name}' was aborted after a failure: {cause}"),
            at: None,
        },
    }
}

// ------------------------------------------------------------------------------------------------
// Completions
// ------------------------------------------------------------------------------------------------

struct Slot {
    op: &'static str,
    state: Mutex<SlotState>,
    done: Condvar,
}

struct SlotState {
    outcome: Option<Result<()>>,
    /// The buffers the device uses until the marker fires. They live as long as the slot: the
    /// watchdog's entry holds the slot until the marker fired, so they are never freed earlier.
    keep: Vec<Box<dyn Any + Send>>,
}

impl Slot {
    fn resolve(&self, r: Result<()>) {
        let mut s = lock(&self.state);
        if s.outcome.is_none() {
            s.outcome = Some(r);
        }
        drop(s);
        self.done.notify_all();
    }
}

/// The handle of one enqueued operation ([`Tracked::launch`]).
pub struct Completion {
    comm: Arc<Tracked>,
    slot: Arc<Slot>,
    deadline: Option<Instant>,
    limit: TimeLimit,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Completion({} on '{}', {:?})",
            self.slot.op,
            self.comm.name,
            self.outcome()
        )
    }
}

impl Completion {
    /// The operation's name.
    pub fn op(&self) -> &'static str {
        self.slot.op
    }

    /// `None` while the device is still working on it; never blocks.
    pub fn outcome(&self) -> Option<Result<()>> {
        lock(&self.slot.state).outcome.clone()
    }

    /// Waits (a condition variable, no sleep) until the operation completed, failed, or its
    /// time limit passed; on the limit the communicator fails (and is aborted) with
    /// [`Error::Timeout`]. On success the kept buffers come back, in the order given to
    /// [`Tracked::launch`]; on an error they stay with the watchdog until the device is done.
    pub fn wait(self) -> Result<Vec<Box<dyn Any + Send>>> {
        match self.wait_until(None) {
            Ok(r) => r,
            Err(me) => Err(Error::Timeout {
                op: me.slot.op,
                millis: me.limit.as_millis(),
                peer: None,
                at: None,
            }),
        }
    }

    /// Like [`Completion::wait`], giving up after `wait` (the completion is handed back and the
    /// operation keeps running) when that comes before the operation's own limit.
    pub fn wait_for(
        self,
        wait: Duration,
    ) -> std::result::Result<Result<Vec<Box<dyn Any + Send>>>, Completion> {
        let until = Instant::now().checked_add(wait);
        self.wait_until(until)
    }

    fn wait_until(
        self,
        until: Option<Instant>,
    ) -> std::result::Result<Result<Vec<Box<dyn Any + Send>>>, Completion> {
        let mut s = lock(&self.slot.state);
        loop {
            if let Some(r) = s.outcome.clone() {
                return Ok(match r {
                    Ok(()) => Ok(std::mem::take(&mut s.keep)),
                    Err(e) => Err(e),
                });
            }
            let now = Instant::now();
            if self.deadline.is_some_and(|d| now >= d) {
                drop(s);
                self.comm.fail(Error::Timeout {
                    op: self.slot.op,
                    millis: self.limit.as_millis(),
                    peer: None,
                    at: None,
                });
                s = lock(&self.slot.state);
                if s.outcome.is_none() {
                    // Stopped earlier by something else, before this operation was launched
                    // into a live communicator: report the limit.
                    s.outcome = Some(Err(Error::Timeout {
                        op: self.slot.op,
                        millis: self.limit.as_millis(),
                        peer: None,
                        at: None,
                    }));
                }
                continue;
            }
            if until.is_some_and(|u| now >= u) {
                drop(s);
                return Err(self);
            }
            let next = match (self.deadline, until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            s = match next {
                None => self.slot.done.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(n) => self
                    .slot
                    .done
                    .wait_timeout(s, n - now)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0),
            };
        }
    }

    /// Takes the kept buffers back **before** the device is done with them, for stream-ordered
    /// use: the caller must already have made every stream that will touch them wait for the
    /// operation's marker (so that reuse and free are ordered after it on the device).
    pub fn take_stream_ordered(self) -> Vec<Box<dyn Any + Send>> {
        std::mem::take(&mut lock(&self.slot.state).keep)
    }
}

// ------------------------------------------------------------------------------------------------
// Jobs
// ------------------------------------------------------------------------------------------------

/// The communicators created through one [`crate::NcclFactory`] (the world and every split):
/// when one fails and the job aborts on failure, every other one is aborted, so that no rank
/// stays blocked in another group waiting for a failed peer.
///
/// ```no_run
/// # fn f(factory: &backend_nccl::NcclFactory) {
/// // Something failed on this rank: interrupt every NCCL operation of the job.
/// let aborted = factory.job().abort_all();
/// println!("aborted {aborted} communicators");
/// # }
/// ```
#[derive(Default)]
pub struct Job {
    members: Mutex<Vec<Weak<Tracked>>>,
    abort_on_failure: bool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({} live communicators)", self.live_count())
    }
}

impl Job {
    /// An empty job; `abort_on_failure`: a failed member aborts all the others.
    pub fn new(abort_on_failure: bool) -> Arc<Job> {
        Arc::new(Job {
            members: Mutex::new(Vec::new()),
            abort_on_failure,
        })
    }

    pub(crate) fn register(&self, t: &Arc<Tracked>) {
        let mut m = lock(&self.members);
        m.retain(|w| w.strong_count() > 0);
        m.push(Arc::downgrade(t));
    }

    fn live(&self) -> Vec<Arc<Tracked>> {
        lock(&self.members)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|t| t.is_live())
            .collect()
    }

    /// Number of communicators of this job that are still live.
    pub fn live_count(&self) -> usize {
        self.live().len()
    }

    /// Aborts every live communicator of the job; returns how many.
    pub fn abort_all(&self) -> usize {
        self.live()
            .into_iter()
            .filter(|t| t.abort("abort_all() was called on its job"))
            .count()
    }

    fn member_failed(&self, failed: &Tracked, e: &Error) {
        if !self.abort_on_failure {
            return;
        }
        let why = format!("communicator '{}' of the same job failed: {e}", failed.name);
        let n = self
            .live()
            .into_iter()
            .filter(|t| !std::ptr::eq(&**t, failed))
            .filter(|t| t.abort(&why))
            .count();
        if n > 0 {
            tracing::error!("nccl: aborted {n} other communicator(s) of the job: {why}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Operations held back
// ------------------------------------------------------------------------------------------------

/// A communicator that holds operations back to post them together (the NCCL backend groups
/// nonblocking sends and receives, so that an `irecv` + `isend` ring cannot deadlock behind
/// itself on one stream).
pub trait Deferred: Send + Sync + 'static {
    /// Posts everything held back, now; never blocks on peers. Failures are recorded on the
    /// held-back operations themselves (their waits report them).
    fn post_deferred(&self);
}

/// The communicators of one device that may hold operations back. Every entry point of the
/// backend that could block this thread or order work after the held-back operations (any
/// other operation on **any** communicator of the device, any wait or poll, a split) posts
/// everything held back first, so an `isend` on one communicator followed by a blocking
/// collective on another cannot leave the send unposted while this rank waits.
///
/// ```
/// use backend_nccl::engine::{Deferred, Outbox};
/// use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
/// struct Held(AtomicUsize);
/// impl Deferred for Held {
///     fn post_deferred(&self) { self.0.fetch_add(1, Ordering::Relaxed); }
/// }
/// let outbox = Outbox::default();
/// let held = Arc::new(Held(AtomicUsize::new(0)));
/// let weak: std::sync::Weak<dyn Deferred> = Arc::downgrade(&(held.clone() as Arc<dyn Deferred>));
/// outbox.register(weak);
/// outbox.post_all();
/// assert_eq!(held.0.load(Ordering::Relaxed), 1);
/// ```
#[derive(Default)]
pub struct Outbox {
    members: Mutex<Vec<Weak<dyn Deferred>>>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Outbox({} members)", lock(&self.members).len())
    }
}

impl Outbox {
    /// Adds a communicator (dropped ones are forgotten).
    pub fn register(&self, d: Weak<dyn Deferred>) {
        let mut m = lock(&self.members);
        m.retain(|w| w.strong_count() > 0);
        m.push(d);
    }

    /// Posts what every live member holds back, in registration order. Call it without holding
    /// any lock a member's [`Deferred::post_deferred`] takes.
    pub fn post_all(&self) {
        let members: Vec<Arc<dyn Deferred>> = lock(&self.members)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for m in members {
            m.post_deferred();
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Pools
// ------------------------------------------------------------------------------------------------

/// A bounded free list of reusable objects. The backend keeps the CUDA events it records
/// (completion markers, stream-to-stream joins) in one per communicator, instead of creating and
/// destroying an event per buffer per call; an event goes back to the pool only when nothing can
/// still wait on it.
///
/// ```
/// use backend_nccl::engine::Pool;
/// let pool: Pool<u32> = Pool::new(2);
/// let a = pool.take(|| Ok(7))?;           // created
/// pool.give(a);
/// assert_eq!(pool.take(|| Ok(8))?, 7);    // reused
/// assert_eq!((pool.created(), pool.idle()), (1, 0));
/// # Ok::<(), grid_core::Error>(())
/// ```
pub struct Pool<T> {
    free: Mutex<Vec<T>>,
    cap: usize,
    created: AtomicUsize,
}

impl<T> std::fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pool({} idle of at most {}, {} created)",
            self.idle(),
            self.cap,
            self.created()
        )
    }
}

impl<T> Pool<T> {
    /// An empty pool keeping at most `cap` idle objects (more are dropped when given back).
    pub fn new(cap: usize) -> Pool<T> {
        Pool {
            free: Mutex::new(Vec::new()),
            cap,
            created: AtomicUsize::new(0),
        }
    }

    /// An idle object, or a new one from `make`.
    pub fn take(&self, make: impl FnOnce() -> Result<T>) -> Result<T> {
        if let Some(t) = lock(&self.free).pop() {
            return Ok(t);
        }
        let t = make()?;
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(t)
    }

    /// Gives an object back for reuse (dropped when the pool is full).
    pub fn give(&self, t: T) {
        let mut free = lock(&self.free);
        if free.len() < self.cap {
            free.push(t);
        }
    }

    /// How many objects wait for reuse.
    pub fn idle(&self) -> usize {
        lock(&self.free).len()
    }

    /// How many objects `make` created so far.
    pub fn created(&self) -> usize {
        self.created.load(Ordering::Relaxed)
    }
}
