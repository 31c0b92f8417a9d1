//! Completion of started operations without blocking the caller: a shared pool of completion
//! threads, each of which blocks in [`Work::wait`] for one operation at a time and then wakes
//! the future's [`Waker`].
//!
//! Why threads: the [`Work`] API has no waker hook (adding one would change every backend), so
//! something has to block in `wait` or poll `is_completed`. Blocking happens here, on threads
//! that belong to this crate and are never executor threads; nothing polls in a loop.
//!
//! The pool grows to the number of operations in flight at once (each in-flight operation
//! holds one thread, so completions never wait behind each other: a receive that completes
//! late does not hold back a send that completed early) and shrinks again: a thread that has
//! been idle for [`IDLE_EXIT`] exits. Cost per operation: a channel send to an idle thread
//! (a thread start only when none is idle), the `wait` itself, and one wake.

use grid_core::{Error, Result, Tensor, Work};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// How long a completion thread waits for another operation before it exits.
pub const IDLE_EXIT: Duration = Duration::from_secs(10);

/// What an operation's future and its completion thread share.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// The operation's outcome, once its completion thread has it.
    result: Option<Result<Tensor>>,
    /// The waker of the last poll that found no result.
    waker: Option<Waker>,
    /// The future has returned its result.
    delivered: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent data (plain assignments), so a
    // poisoned lock is used as it is rather than turned into a second panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slot {
    fn fill(&self, result: Result<Tensor>) {
        let waker = {
            let mut s = lock(&self.state);
            s.result = Some(result);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The future of one started operation: resolves to the operation's result buffer (as
/// [`Work::wait`] returns it) once the library is done with it.
///
/// The operation was started when this future was made, not when it is first polled; awaiting
/// only waits for completion. Dropping the future before completion does not cancel anything:
/// the completion thread owns the operation's [`Work`] and waits for it to the end, so the
/// buffers stay alive until the library is done, as with a dropped `Work`. The future is
/// `Send`, `Unpin` and `'static`, so it can be spawned as a task of its own.
pub struct Completion {
    inner: Inner,
}

enum Inner {
    /// Finished before it started (the start was refused), or already delivered.
    Ready {
        op: &'static str,
        result: Option<Result<Tensor>>,
    },
    /// Running; the completion thread fills the slot.
    Running { op: &'static str, slot: Arc<Slot> },
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Ready { op, result } => f
                .debug_struct("Completion")
                .field("op", op)
                .field(
                    "state",
                    &if result.is_some() {
                        "ready"
                    } else {
                        "delivered"
                    },
                )
                .finish(),
            Inner::Running { op, .. } => f
                .debug_struct("Completion")
                .field("op", op)
                .field("state", &"running")
                .finish(),
        }
    }
}

impl Completion {
    /// A future that resolves at once to `result`, for the operation `op` (used for an
    /// operation whose start failed: the error is delivered by the first poll).
    pub fn ready(op: &'static str, result: Result<Tensor>) -> Completion {
        Completion {
            inner: Inner::Ready {
                op,
                result: Some(result),
            },
        }
    }

    /// Hands the started operation `work` (named `op` in errors) to a completion thread and
    /// returns the future of its result.
    pub fn spawn(op: &'static str, work: Box<dyn Work>) -> Completion {
        let slot = Arc::new(Slot::default());
        pool().submit(Job {
            op,
            work,
            slot: Arc::clone(&slot),
        });
        Completion {
            inner: Inner::Running { op, slot },
        }
    }

    /// True once the result is available (a poll would return it), or was returned.
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            Inner::Ready { .. } => true,
            Inner::Running { slot, .. } => {
                let s = lock(&slot.state);
                s.result.is_some() || s.delivered
            }
        }
    }
}

fn polled_again(op: &str) -> Error {
    Error::Invalid(format!(
        "{op}: the operation's future was polled again after it returned its result; a future \
         returns its result once"
    ))
}

impl Future for Completion {
    type Output = Result<Tensor>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Tensor>> {
        match &mut self.inner {
            Inner::Ready { op, result } => {
                Poll::Ready(result.take().unwrap_or_else(|| Err(polled_again(op))))
            }
            Inner::Running { op, slot } => {
                let mut s = lock(&slot.state);
                if let Some(r) = s.result.take() {
                    s.delivered = true;
                    return Poll::Ready(r);
                }
                if s.delivered {
                    return Poll::Ready(Err(polled_again(op)));
                }
                match &s.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// One operation for a completion thread.
struct Job {
    op: &'static str,
    work: Box<dyn Work>,
    slot: Arc<Slot>,
}

impl Job {
    /// Waits for the operation (on the calling thread) and delivers its outcome. A panic in the
    /// backend's `wait` becomes an error for the future instead of a lost thread and a future
    /// that never resolves.
    fn run(self) {
        let Job { op, work, slot } = self;
        let result = catch_unwind(AssertUnwindSafe(|| work.wait())).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(Error::Invalid(format!(
                "{op}: the backend panicked while completing the operation: {msg}"
            )))
        });
        slot.fill(result);
    }
}

/// The shared pool: idle threads wait on their own channel; a submission takes one, or starts
/// a new thread when none is idle.
struct Pool {
    idle: Mutex<Vec<(u64, Sender<Job>)>>,
    next_id: AtomicU64,
    live: AtomicUsize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        idle: Mutex::new(Vec::new()),
        next_id: AtomicU64::new(0),
        live: AtomicUsize::new(0),
    })
}

/// How many completion threads exist now (busy or idle). At most the largest number of
/// operations that were in flight at once in the last [`IDLE_EXIT`].
pub fn completion_threads() -> usize {
    pool().live.load(Ordering::Relaxed)
}

impl Pool {
    fn submit(&'static self, mut job: Job) {
        loop {
            let idle = lock(&self.idle).pop();
            match idle {
                Some((_, tx)) => match tx.send(job) {
                    Ok(()) => return,
                    // That thread is gone (it cannot be: a thread leaves the idle list before
                    // it exits); take another.
                    Err(mpsc::SendError(j)) => job = j,
                },
                None => return self.start_thread(job),
            }
        }
    }

    fn start_thread(&'static self, job: Job) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<Job>();
        // The first job travels through a shared cell so that it can be taken back if the
        // thread cannot be started.
        let first = Arc::new(Mutex::new(Some(job)));
        let cell = Arc::clone(&first);
        self.live.fetch_add(1, Ordering::Relaxed);
        let started = std::thread::Builder::new()
            .name(format!("grid-async-{id}"))
            .spawn(move || {
                if let Some(job) = lock(&cell).take() {
                    job.run();
                }
                self.serve(id, tx, rx);
                self.live.fetch_sub(1, Ordering::Relaxed);
            });
        if let Err(e) = started {
            self.live.fetch_sub(1, Ordering::Relaxed);
            // No thread: complete the operation here (this blocks the caller until it is
            // done, which is still correct, and is said in the log).
            if let Some(job) = lock(&first).take() {
                tracing::warn!(
                    op = job.op,
                    error = %e,
                    "grid-async: cannot start a completion thread; waiting for the operation on the calling thread"
                );
                job.run();
            }
        }
    }

    /// A completion thread's life after its first job: announce itself idle, take the next
    /// job, and exit after [`IDLE_EXIT`] without one.
    fn serve(&self, id: u64, tx: Sender<Job>, rx: mpsc::Receiver<Job>) {
        loop {
            lock(&self.idle).push((id, tx.clone()));
            let job = loop {
                match rx.recv_timeout(IDLE_EXIT) {
                    Ok(job) => break job,
                    Err(RecvTimeoutError::Timeout) => {
                        let mut idle = lock(&self.idle);
                        if let Some(i) = idle.iter().position(|(t, _)| *t == id) {
                            idle.swap_remove(i);
                            return;
                        }
                        // A submitter took this thread off the idle list: its job is on the
                        // way.
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            job.run();
        }
    }
}
