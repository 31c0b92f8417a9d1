//! Ordering of collectives and completion handles for nonblocking operations.
//!
//! Gloo matches the messages of a collective by a tag that every rank must derive the same way,
//! so collectives on one communicator must run in the same order everywhere. A [`Sequencer`]
//! hands out tickets in call order: blocking collectives run on the caller's thread when their
//! ticket comes up, nonblocking ones on the communicator's worker thread, and the ticket doubles
//! as the Gloo tag. An idle communicator therefore runs a blocking collective with no thread
//! hand-off at all.

use grid_core::{Error, LibraryError, Result, Tensor, Work};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Default)]
struct SeqState {
    next: u64,
    serving: u64,
}

/// Tickets in call order; one runs at a time.
#[derive(Debug, Default)]
pub(crate) struct Sequencer {
    state: Mutex<SeqState>,
    cv: Condvar,
}

/// The right to run one collective; finishing (or dropping) it lets the next ticket run.
pub(crate) struct Turn<'a> {
    seq: &'a Sequencer,
    ticket: u64,
}

impl Turn<'_> {
    /// The Gloo tag of this collective (the ticket, wrapped to 32 bits).
    pub(crate) fn tag(&self) -> u32 {
        self.ticket as u32
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.seq.state);
        s.serving = self.ticket + 1;
        drop(s);
        self.seq.cv.notify_all();
    }
}

impl Sequencer {
    /// Takes the next ticket, running `enqueue` with it under the lock (so that tickets reach
    /// the worker in order); the ticket is consumed only if `enqueue` succeeds.
    pub(crate) fn reserve<T>(&self, enqueue: impl FnOnce(u64) -> Result<T>) -> Result<T> {
        let mut s = lock(&self.state);
        let t = s.next;
        let out = enqueue(t)?;
        s.next = t + 1;
        Ok(out)
    }

    /// Blocks until `ticket` may run.
    pub(crate) fn turn(&self, ticket: u64) -> Turn<'_> {
        let mut s = lock(&self.state);
        while s.serving != ticket {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        Turn { seq: self, ticket }
    }

    /// Takes a ticket and waits for it (a blocking collective).
    pub(crate) fn enter(&self) -> Turn<'_> {
        let t = {
            let mut s = lock(&self.state);
            let t = s.next;
            s.next += 1;
            t
        };
        self.turn(t)
    }

    /// Waits until every ticket taken so far has finished.
    pub(crate) fn drain(&self) {
        let mut s = lock(&self.state);
        let target = s.next;
        while s.serving < target {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Where a nonblocking operation leaves its result.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<Tensor>>>,
    cv: Condvar,
}

impl Completion {
    pub(crate) fn new() -> Arc<Completion> {
        Arc::new(Completion::default())
    }

    pub(crate) fn complete(&self, r: Result<Tensor>) {
        *lock(&self.result) = Some(r);
        self.cv.notify_all();
    }
}

/// The [`Work`] handle of every nonblocking Gloo operation.
#[derive(Debug)]
pub(crate) struct GlooWork {
    c: Arc<Completion>,
}

impl GlooWork {
    pub(crate) fn new(c: Arc<Completion>) -> GlooWork {
        GlooWork { c }
    }
}

impl Work for GlooWork {
    fn is_completed(&mut self) -> bool {
        lock(&self.c.result).is_some()
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let mut g = lock(&self.c.result);
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = self.c.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn wait_timeout(
        self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        // `None`: a timeout beyond what `Instant` can hold, which is no limit.
        let deadline = grid_core::TimeLimit::After(timeout).deadline_from(Instant::now());
        {
            let mut g = lock(&self.c.result);
            loop {
                if let Some(r) = g.take() {
                    return Ok(r);
                }
                g = match deadline {
                    None => self.c.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                    Some(deadline) => {
                        let now = Instant::now();
                        if now >= deadline {
                            break;
                        }
                        self.c
                            .cv
                            .wait_timeout(g, deadline - now)
                            .map(|(g, _)| g)
                            .unwrap_or_else(|e| e.into_inner().0)
                    }
                };
            }
        }
        Err(self)
    }
}

/// Turns a panic payload into a message.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// An error for a worker that could not be reached.
pub(crate) fn worker_gone(op: &'static str, comm: &str) -> Error {
    LibraryError::new("gloo", op, "the communicator's worker thread is gone")
        .comm(comm)
        .into()
}
