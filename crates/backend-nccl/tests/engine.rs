//! The NCCL backend's failure-handling state machine ([`backend_nccl::engine`]) on CPU, driven
//! by a **scripted stand-in for the device runtime** defined in this file: communicators whose
//! creation finishes only when every rank joined, collectives whose completion marker fires only
//! when every rank enqueued them, sends that complete when the matching receive is posted,
//! markers that never fire, and asynchronous errors raised mid-run. The stand-in exists only to
//! test the state machine; it moves no data and is not an NCCL backend.
//!
//! Ranks are threads; each rank has its own watchdog, as each process would. The checks are the
//! CPU half of the NCCL issue's "done when": a stalled creation, a stalled collective and an
//! asynchronous error each end in an error on every rank within the time limit plus one second;
//! `abort()` from another thread returns at once while operations are stalled; dropped
//! unfinished work keeps its buffers until its marker fires; an `isend` on one communicator
//! followed by a blocking collective on another completes, both when the send is enqueued at
//! once on a point-to-point lane (`backend_nccl::p2p`) and when it is held back and posted
//! before the rank blocks anywhere (and, as a control, stalls when it is not); an exchange and
//! rings posted at once on lanes complete, while the same exchange posted at once on one
//! communicator stalls (the serial fabrics model NCCL running one communicator's operations
//! one after the other).

use backend_nccl::engine::{
    launch_plan, Capture, Completion, Deferred, DeviceComm, DeviceEvent, DeviceStream, Job, Kicker,
    Launch, Outbox, Progress, Tracked, Watchdog, WatchdogOptions,
};
use grid_core::{Error, LibraryError, Result, TimeLimit};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One second: the margin the issue allows past a time limit.
const MARGIN: Duration = Duration::from_secs(1);

// ------------------------------------------------------------------------------------------------
// The scripted stand-in
// ------------------------------------------------------------------------------------------------

/// What the ranks of one scripted communicator have done.
#[derive(Default)]
struct FabricState {
    joined: HashSet<usize>,
    aborted: HashSet<usize>,
    async_error: HashMap<usize, Error>,
    /// Collective key -> ranks that enqueued it.
    posted: HashMap<String, HashSet<usize>>,
    /// (from, to, n) -> (send posted, receive posted).
    p2p: HashMap<(usize, usize, usize), (bool, bool)>,
    /// Creation finished (every rank joined before anyone gave up).
    created: bool,
    finalize_stuck: bool,
    finalizing: bool,
    destroyed: HashSet<usize>,
    /// Serial fabrics only: each rank's operations in enqueue order, and how many of them
    /// completed (NCCL runs one communicator's operations one after the other).
    queues: HashMap<usize, Vec<Queued>>,
    completed: HashMap<usize, usize>,
}

/// An operation enqueued on a serial fabric.
#[derive(Clone, PartialEq, Eq, Debug)]
enum Queued {
    Collective(String),
    /// (from, to, n): the n-th message from `from` to `to` on this communicator.
    P2p(usize, usize, usize),
}

impl FabricState {
    /// Serial fabrics: completes operations while possible. A rank's first unfinished
    /// operation is the one its device is running (NCCL serialises one communicator's
    /// kernels); it completes once every rank it needs runs the same operation: every rank for
    /// a collective, the sender and the receiver for a message.
    fn advance(&mut self, n: usize) {
        loop {
            let head = |st: &FabricState, r: usize| -> Option<Queued> {
                let done = st.completed.get(&r).copied().unwrap_or(0);
                st.queues.get(&r).and_then(|q| q.get(done)).cloned()
            };
            let mut progressed = false;
            for r in 0..n {
                let Some(op) = head(self, r) else { continue };
                let needs: Vec<usize> = match &op {
                    Queued::Collective(_) => (0..n).collect(),
                    Queued::P2p(from, to, _) => vec![*from, *to],
                };
                if needs.iter().all(|&x| head(self, x).as_ref() == Some(&op)) {
                    for x in needs {
                        *self.completed.entry(x).or_default() += 1;
                    }
                    progressed = true;
                }
            }
            if !progressed {
                return;
            }
        }
    }
}

/// The "network" of one communicator of `n` ranks.
struct Fabric {
    n: usize,
    st: Mutex<FabricState>,
    kickers: Mutex<Vec<Kicker>>,
}

impl Fabric {
    fn new(n: usize) -> Arc<Fabric> {
        Arc::new(Fabric {
            n,
            st: Mutex::new(FabricState::default()),
            kickers: Mutex::new(Vec::new()),
        })
    }

    fn st(&self) -> std::sync::MutexGuard<'_, FabricState> {
        self.st.lock().unwrap()
    }

    /// Something may have completed on some rank: wake every rank's watchdog (what the CUDA
    /// host function enqueued after each operation does in the real backend).
    fn kick_all(&self) {
        for k in self.kickers.lock().unwrap().iter() {
            k.kick();
        }
    }

    /// Rank `rank` joins (its `ncclCommInitRank` started).
    fn join(self: &Arc<Self>, rank: usize, dog: &Watchdog) -> Arc<ScriptedComm> {
        self.kickers.lock().unwrap().push(dog.kicker());
        self.st().joined.insert(rank);
        self.kick_all();
        Arc::new(ScriptedComm {
            rank,
            fabric: self.clone(),
        })
    }

    /// Rank `rank` enqueues collective `key`; its marker fires once every rank enqueued it.
    fn collective(self: &Arc<Self>, rank: usize, key: &str) -> Box<dyn DeviceEvent> {
        self.st()
            .posted
            .entry(key.to_string())
            .or_default()
            .insert(rank);
        self.kick_all();
        Box::new(ScriptedEvent {
            fabric: self.clone(),
            rank,
            what: What::Collective(key.to_string()),
        })
    }

    /// Rank `from` posts its `n`-th send to `to`, or `to` its receive from `from`.
    fn p2p(
        self: &Arc<Self>,
        rank: usize,
        from: usize,
        to: usize,
        n: usize,
    ) -> Box<dyn DeviceEvent> {
        {
            let mut st = self.st();
            let e = st.p2p.entry((from, to, n)).or_default();
            if rank == from {
                e.0 = true;
            } else {
                e.1 = true;
            }
        }
        self.kick_all();
        Box::new(ScriptedEvent {
            fabric: self.clone(),
            rank,
            what: What::P2p(from, to, n),
        })
    }

    /// Serial fabrics: rank `rank` enqueues `op` behind everything it enqueued before on this
    /// communicator; its marker fires once it completed (see [`FabricState::advance`]).
    fn enqueue(self: &Arc<Self>, rank: usize, op: Queued) -> Box<dyn DeviceEvent> {
        let index = {
            let mut st = self.st();
            let q = st.queues.entry(rank).or_default();
            q.push(op);
            let i = q.len() - 1;
            st.advance(self.n);
            i
        };
        self.kick_all();
        Box::new(ScriptedEvent {
            fabric: self.clone(),
            rank,
            what: What::Queued(index),
        })
    }

    /// NCCL reports an asynchronous error on `rank` (a broken connection).
    fn raise(&self, rank: usize) {
        let e: Error = LibraryError::new("nccl", "ncclCommGetAsyncError", "remote process exited")
            .code(6)
            .class("ncclRemoteError")
            .into();
        self.st().async_error.insert(rank, e);
    }
}

/// One rank's communicator of the stand-in.
struct ScriptedComm {
    rank: usize,
    fabric: Arc<Fabric>,
}

impl DeviceComm for ScriptedComm {
    fn progress(&self) -> Result<Progress> {
        let mut st = self.fabric.st();
        if let Some(e) = st.async_error.get(&self.rank) {
            return Err(e.clone());
        }
        // Creation finishes when every rank joined and none of them gave up meanwhile (a peer
        // that aborted never answers the bootstrap).
        if !st.created {
            if st.joined.len() == self.fabric.n && st.aborted.is_empty() {
                st.created = true;
            } else {
                return Ok(Progress::InProgress);
            }
        }
        if st.finalizing && st.finalize_stuck {
            return Ok(Progress::InProgress);
        }
        Ok(Progress::Done)
    }
    fn abort(&self) {
        self.fabric.st().aborted.insert(self.rank);
        // The device's kernels of this rank exit: its markers fire.
        self.fabric.kick_all();
    }
    fn finalize(&self) -> Result<Progress> {
        let mut st = self.fabric.st();
        st.finalizing = true;
        Ok(if st.finalize_stuck {
            Progress::InProgress
        } else {
            Progress::Done
        })
    }
    fn destroy(&self) {
        self.fabric.st().destroyed.insert(self.rank);
    }
}

enum What {
    Collective(String),
    P2p(usize, usize, usize),
    /// A marker that fires when the gate opens (or never).
    Gate(Arc<AtomicBool>),
    /// The rank's operation number `i` on a serial fabric.
    Queued(usize),
}

struct ScriptedEvent {
    fabric: Arc<Fabric>,
    rank: usize,
    what: What,
}

impl DeviceEvent for ScriptedEvent {
    fn query(&self) -> Result<Progress> {
        let mut st = self.fabric.st();
        st.advance(self.fabric.n);
        let done = match &self.what {
            What::Queued(i) => st.completed.get(&self.rank).copied().unwrap_or(0) > *i,
            What::Collective(k) => st.posted.get(k).is_some_and(|s| s.len() == self.fabric.n),
            What::P2p(from, to, n) => st.p2p.get(&(*from, *to, *n)) == Some(&(true, true)),
            What::Gate(g) => {
                return Ok(if g.load(Ordering::Acquire) {
                    Progress::Done
                } else {
                    Progress::InProgress
                })
            }
        };
        // After ncclCommAbort the rank's kernels exit, so its markers fire.
        Ok(if done || st.aborted.contains(&self.rank) {
            Progress::Done
        } else {
            Progress::InProgress
        })
    }
}

/// A buffer the device "uses": records when it is freed.
struct Buffer(Arc<AtomicBool>);
impl Drop for Buffer {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn dog() -> Watchdog {
    Watchdog::start(WatchdogOptions {
        poll: Duration::from_millis(5),
        close_limit: Duration::from_millis(300),
    })
    .unwrap()
}

/// Creates rank `rank`'s communicator on `fabric` and waits for its creation.
fn create(
    fabric: &Arc<Fabric>,
    rank: usize,
    dog: &Watchdog,
    name: &str,
    job: Option<&Arc<Job>>,
    limit: TimeLimit,
) -> (Arc<Tracked>, Result<()>) {
    let comm = fabric.join(rank, dog);
    let t = dog.track(name, comm, "init", job);
    let r = t.settle("init", limit);
    (t, r)
}

fn limit(ms: u64) -> TimeLimit {
    TimeLimit::from_millis(ms)
}

/// Runs `f(rank)` on `n` threads; results in rank order.
fn ranks<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || f(r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn blocking(
    t: &Arc<Tracked>,
    fabric: &Arc<Fabric>,
    rank: usize,
    key: &str,
    l: TimeLimit,
) -> Result<()> {
    t.check_live("all_reduce")?;
    let ev = fabric.collective(rank, key);
    t.launch("all_reduce", l, ev, Vec::new()).wait().map(|_| ())
}

// ------------------------------------------------------------------------------------------------
// Creation
// ------------------------------------------------------------------------------------------------

#[test]
fn creation_completes_when_every_rank_joined() {
    let fabric = Fabric::new(3);
    let out = ranks(3, |r| {
        let dog = dog();
        let (t, res) = create(&fabric, r, &dog, "world", None, limit(5_000));
        res.map(|()| t.state_name())
    });
    for o in out {
        assert_eq!(o.unwrap(), "live");
    }
}

/// Rank 3 arrives after the others gave up (a late or dead peer): every rank's creation ends
/// in `Timeout` within its limit plus one second, and the late rank cannot finish either.
#[test]
fn a_stalled_creation_fails_every_rank_within_the_limit() {
    let fabric = Fabric::new(4);
    let l = Duration::from_millis(400);
    let out = ranks(4, |r| {
        if r == 3 {
            std::thread::sleep(Duration::from_millis(700));
        }
        let dog = dog();
        let start = Instant::now();
        let (t, res) = create(&fabric, r, &dog, "world", None, l.into());
        (res, start.elapsed(), t.state_name())
    });
    for (r, (res, took, state)) in out.into_iter().enumerate() {
        let e = res.unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    op: "init",
                    millis: 400,
                    ..
                }
            ),
            "rank {r}: {e:?}"
        );
        println!("creation: rank {r} failed after {took:?} (limit {l:?})");
        assert!(took >= l && took < l + MARGIN, "rank {r}: {took:?}");
        assert_eq!(state, "failed", "rank {r}");
    }
    // Every rank aborted its communicator in the library (on a helper thread).
    wait_until("every library abort", Duration::from_secs(2), || {
        fabric.st().aborted.len() == 4
    });
}

// ------------------------------------------------------------------------------------------------
// Stalled collectives and asynchronous errors
// ------------------------------------------------------------------------------------------------

/// Rank 2 skips one all-reduce: every rank's next operation ends in an error within the limit
/// plus one second, and the failure aborts every other communicator of the job too.
#[test]
fn a_stalled_collective_fails_every_rank_and_its_job() {
    let world = Fabric::new(3);
    let tp = Fabric::new(3);
    let l = Duration::from_millis(500);
    let out = ranks(3, |r| {
        let dog = dog();
        let job = Job::new(true);
        let (w, res) = create(&world, r, &dog, "world", Some(&job), limit(5_000));
        res.unwrap();
        let (t, res) = create(&tp, r, &dog, "tp", Some(&job), limit(5_000));
        res.unwrap();
        blocking(&w, &world, r, "ar#0", l.into()).unwrap();
        let start = Instant::now();
        let res = if r == 2 {
            // Skips ar#1 and goes on to the next collective.
            blocking(&w, &world, r, "ar#2", l.into())
        } else {
            blocking(&w, &world, r, "ar#1", l.into())
        };
        let took = start.elapsed();
        // The job aborts its other communicators from the failing rank's watchdog, which may
        // run just after this rank's own error returned: allow it a second.
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut other = t.check_live("all_gather");
        while other.is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            other = t.check_live("all_gather");
        }
        (res, took, other, job.live_count())
    });
    for (r, (res, took, other, live)) in out.into_iter().enumerate() {
        let e = res.unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    op: "all_reduce",
                    millis: 500,
                    ..
                }
            ),
            "rank {r}: {e:?}"
        );
        println!("collective: rank {r} failed after {took:?} (limit {l:?})");
        assert!(took >= l && took < l + MARGIN, "rank {r}: {took:?}");
        let other = other.unwrap_err();
        assert!(
            other.to_string().starts_with("all_gather: communicator 'tp' was aborted (communicator 'world' of the same job failed: all_reduce: timed out after 500 ms)"),
            "rank {r}: {other}"
        );
        assert_eq!(live, 0, "rank {r}");
    }
}

/// NCCL reports an asynchronous error on rank 1 in the middle of a loop: rank 1 fails at once
/// (within a few watchdog rounds), the others within their limit plus one second, and nothing
/// waits for a marker that will never fire.
#[test]
fn an_asynchronous_error_fails_every_rank() {
    let fabric = Fabric::new(3);
    let l = Duration::from_millis(1500);
    let out = ranks(3, |r| {
        let dog = dog();
        let (w, res) = create(&fabric, r, &dog, "world", None, limit(5_000));
        res.unwrap();
        for i in 0..1000 {
            if r == 1 && i == 5 {
                // Enqueued, but the network breaks before it completes: its marker stays
                // unfired and NCCL reports an asynchronous error.
                let (_never, ev) = gate(&fabric);
                let c = w.launch("all_reduce", l.into(), ev, Vec::new());
                fabric.raise(1);
                let start = Instant::now();
                let e = c.wait().unwrap_err();
                return (i, e, start.elapsed());
            }
            let last = Instant::now();
            if let Err(e) = blocking(&w, &fabric, r, &format!("ar#{i}"), l.into()) {
                return (i, e, last.elapsed());
            }
        }
        panic!("rank {r} never failed");
    });
    let (i1, e1, took1) = &out[1];
    assert_eq!(*i1, 5);
    let Error::Aborted { op, reason, .. } = e1 else {
        panic!("rank 1: {e1:?}")
    };
    assert_eq!(*op, "all_reduce");
    assert!(reason.contains("ncclRemoteError"), "{reason}");
    println!("asynchronous error: rank 1 failed {took1:?} after it started waiting");
    for r in [0, 2] {
        println!(
            "asynchronous error: rank {r} failed {:?} after its last operation began (limit {l:?})",
            out[r].2
        );
    }
    assert!(
        *took1 < Duration::from_millis(500),
        "rank 1 noticed after {took1:?}"
    );
    for r in [0, 2] {
        let (i, e, took) = &out[r];
        assert_eq!(*i, 5, "rank {r}");
        assert!(
            matches!(
                e,
                Error::Timeout {
                    op: "all_reduce",
                    ..
                }
            ),
            "rank {r}: {e:?}"
        );
        assert!(*took < l + MARGIN, "rank {r}: {took:?}");
    }
}

// ------------------------------------------------------------------------------------------------
// Abort
// ------------------------------------------------------------------------------------------------

/// While one thread is stalled in a creation and another in an operation with no time limit,
/// `abort()` from a third thread returns at once and both stalled threads return `Aborted`.
#[test]
fn abort_from_another_thread_returns_at_once() {
    let dog = dog();
    // A creation that can never finish (the second rank never arrives).
    let lonely = Fabric::new(2);
    let starting = dog.track("pp", lonely.join(0, &dog), "split", None);
    // A live communicator with an operation whose peer never arrives.
    let pair = Fabric::new(2);
    let (live, res) = {
        let c = pair.join(0, &dog);
        pair.st().joined.insert(1);
        let t = dog.track("world", c, "init", None);
        let r = t.settle("init", limit(5_000));
        (t, r)
    };
    res.unwrap();
    let stalled = live.launch(
        "all_reduce",
        TimeLimit::Unlimited,
        pair.collective(0, "ar#0"),
        Vec::new(),
    );

    std::thread::scope(|s| {
        let a = s.spawn(|| {
            let t = Instant::now();
            (starting.settle("split", TimeLimit::Unlimited), t.elapsed())
        });
        let b = s.spawn(move || {
            let t = Instant::now();
            (stalled.wait(), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        let t0 = Instant::now();
        assert!(starting.abort("abort() was called"));
        assert!(live.abort("abort() was called"));
        let abort_took = t0.elapsed();
        println!("two abort() calls took {abort_took:?}");
        assert!(
            abort_took < Duration::from_millis(250),
            "abort took {abort_took:?}"
        );
        let (ra, ta) = a.join().unwrap();
        let (rb, tb) = b.join().unwrap();
        for (r, t) in [(ra.map(|_| ()), ta), (rb.map(|_| ()), tb)] {
            let e = r.unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e:?}");
            println!("a stalled thread returned {t:?} after it started waiting (abort at 200 ms)");
            assert!(t < Duration::from_millis(200 + 500), "woke after {t:?}");
        }
    });
    // Idempotent, and later operations are refused.
    assert!(!live.abort("again"));
    let e = live.check_live("barrier").unwrap_err();
    assert_eq!(
        e.to_string(),
        "barrier: communicator 'world' was aborted (abort() was called)"
    );
    wait_until("the library aborts", Duration::from_secs(2), || {
        lonely.st().aborted == HashSet::from([0]) && pair.st().aborted == HashSet::from([0])
    });
}

// ------------------------------------------------------------------------------------------------
// Deferred drop of buffers
// ------------------------------------------------------------------------------------------------

fn wait_until(what: &str, deadline: Duration, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < deadline,
            "{what} did not happen within {deadline:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn gate(fabric: &Arc<Fabric>) -> (Arc<AtomicBool>, Box<dyn DeviceEvent>) {
    let g = Arc::new(AtomicBool::new(false));
    let ev = Box::new(ScriptedEvent {
        fabric: fabric.clone(),
        rank: 0,
        what: What::Gate(g.clone()),
    });
    (g, ev)
}

#[test]
fn dropped_unfinished_work_keeps_its_buffers_until_completion() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();

    // Dropped without a wait.
    let (open, ev) = gate(&fabric);
    let freed = Arc::new(AtomicBool::new(false));
    let c = t.launch(
        "all_reduce",
        TimeLimit::Unlimited,
        ev,
        vec![Box::new(Buffer(freed.clone()))],
    );
    drop(c);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !freed.load(Ordering::Acquire),
        "freed while the device still uses it"
    );
    assert_eq!(t.pending(), 1);
    open.store(true, Ordering::Release);
    dog.kick();
    wait_until("the free after completion", Duration::from_secs(2), || {
        freed.load(Ordering::Acquire)
    });
    assert_eq!(t.pending(), 0);

    // Waited for: the buffers come back on success.
    let (open, ev) = gate(&fabric);
    let freed2 = Arc::new(AtomicBool::new(false));
    let c = t.launch(
        "broadcast",
        TimeLimit::Unlimited,
        ev,
        vec![Box::new(Buffer(freed2.clone()))],
    );
    let c = match c.wait_for(Duration::from_millis(30)) {
        Err(c) => c,
        Ok(r) => panic!("completed early: {:?}", r.map(|v| v.len())),
    };
    open.store(true, Ordering::Release);
    dog.kick();
    let back = c.wait().unwrap();
    assert_eq!(back.len(), 1);
    assert!(back[0].downcast_ref::<Buffer>().is_some());
    assert!(!freed2.load(Ordering::Acquire));
}

/// A failed or aborted operation returns its error at once, but its buffers stay alive until
/// the device is done with them (here: until the marker fires long after the abort).
#[test]
fn failed_work_keeps_its_buffers_until_completion() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();
    let (open, ev) = gate(&fabric);
    let freed = Arc::new(AtomicBool::new(false));
    let c = t.launch(
        "all_gather",
        limit(100),
        ev,
        vec![Box::new(Buffer(freed.clone()))],
    );
    let e = c.wait().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Timeout {
                op: "all_gather",
                millis: 100,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(t.state_name(), "failed");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !freed.load(Ordering::Acquire),
        "freed while the device still uses it"
    );
    open.store(true, Ordering::Release);
    dog.kick();
    wait_until("the free after completion", Duration::from_secs(2), || {
        freed.load(Ordering::Acquire)
    });
}

// ------------------------------------------------------------------------------------------------
// Point-to-point: posted before the rank blocks anywhere
// ------------------------------------------------------------------------------------------------

/// A communicator's held-back sends and receives, as the backend holds them (so that an
/// `irecv` + `isend` ring is posted as one group): each is posted to the fabric and launched
/// when the device's [`Outbox`] posts everything.
struct HeldBack {
    rank: usize,
    fabric: Arc<Fabric>,
    tracked: Arc<Tracked>,
    queue: Mutex<Vec<Held>>,
}

/// A held-back operation: from, to, limit, and where its completion goes once posted.
type Held = (usize, usize, TimeLimit, Arc<Mutex<Option<Completion>>>);

impl HeldBack {
    /// `isend`/`irecv` between `from` and `to`: held back; the cell gets its completion once
    /// posted.
    fn start(&self, from: usize, to: usize, limit: TimeLimit) -> Arc<Mutex<Option<Completion>>> {
        let cell = Arc::new(Mutex::new(None));
        self.queue
            .lock()
            .unwrap()
            .push((from, to, limit, cell.clone()));
        cell
    }
}

impl Deferred for HeldBack {
    fn post_deferred(&self) {
        let items = std::mem::take(&mut *self.queue.lock().unwrap());
        for (from, to, limit, cell) in items {
            let op = if from == self.rank { "send" } else { "recv" };
            let ev = self.fabric.p2p(self.rank, from, to, 0);
            *cell.lock().unwrap() = Some(self.tracked.launch(op, limit, ev, Vec::new()));
        }
    }
}

/// Rank 0 starts an `isend` on the pipeline communicator, then blocks in an all-reduce on the
/// data-parallel communicator; rank 1 receives first (blocking), then joins the all-reduce.
/// `post_all` before the blocking all-reduce (what the backend does at every entry point)
/// posts the send, so both ranks finish; `post_all` skipped (`flush = false`, the bug the
/// NCCL issue describes: the send deferred to rank 0's next pipeline call) leaves both ranks
/// waiting until their time limit.
fn isend_then_collective(flush: bool, l: TimeLimit) -> Vec<Result<Duration>> {
    let pp = Fabric::new(2);
    let dp = Fabric::new(2);
    ranks(2, |r| -> Result<Duration> {
        let dog = dog();
        let outbox = Arc::new(Outbox::default());
        let (p, res) = create(&pp, r, &dog, "pp", None, l);
        res?;
        let (d, res) = create(&dp, r, &dog, "dp", None, l);
        res?;
        let held = Arc::new(HeldBack {
            rank: r,
            fabric: pp.clone(),
            tracked: p.clone(),
            queue: Mutex::new(Vec::new()),
        });
        let weak: std::sync::Weak<dyn Deferred> =
            Arc::downgrade(&(held.clone() as Arc<dyn Deferred>));
        outbox.register(weak);
        let start = Instant::now();
        if r == 0 {
            let send = held.start(0, 1, l);
            if flush {
                outbox.post_all();
            }
            blocking(&d, &dp, 0, "ar#0", l)?;
            outbox.post_all();
            let c = send.lock().unwrap().take();
            c.ok_or_else(|| Error::Invalid("send not posted".into()))?
                .wait()?;
        } else {
            let recv = held.start(0, 1, l);
            outbox.post_all();
            let c = recv.lock().unwrap().take();
            c.ok_or_else(|| Error::Invalid("recv not posted".into()))?
                .wait()?;
            blocking(&d, &dp, 1, "ar#0", l)?;
        }
        Ok(start.elapsed())
    })
}

#[test]
fn isend_then_a_blocking_collective_on_another_communicator_completes() {
    for (r, o) in isend_then_collective(true, limit(3_000))
        .into_iter()
        .enumerate()
    {
        let took = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(took < Duration::from_secs(1), "rank {r}: {took:?}");
    }
}

/// The control: without posting the held-back send first, the same program stalls on both
/// ranks (each ends in `Timeout`, within the limit plus one second, instead of hanging).
#[test]
fn a_send_held_back_past_a_blocking_collective_stalls_both_ranks() {
    let l = Duration::from_millis(300);
    for (r, o) in isend_then_collective(false, l.into())
        .into_iter()
        .enumerate()
    {
        let e = o.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "rank {r}: {e:?}");
    }
}

// ------------------------------------------------------------------------------------------------
// Point-to-point posted at once on lanes (serial fabrics: NCCL's one-at-a-time rule)
// ------------------------------------------------------------------------------------------------

/// One rank's view of a communicator with its two point-to-point lanes (`backend_nccl::p2p`):
/// every single send and receive is enqueued when it is called, on the lane
/// `backend_nccl::p2p::lane` picks, exactly as the backend routes them. With `lanes = false`
/// both go on one communicator (the design the lanes replace), as the control.
struct P2pComm {
    rank: usize,
    /// `[up, down]`, or one fabric for both.
    fabrics: Vec<Arc<Fabric>>,
    tracked: Vec<Arc<Tracked>>,
    /// Messages started so far per (from, to) and lane: NCCL pairs them in order.
    counts: Mutex<HashMap<(usize, usize, usize), usize>>,
}

impl P2pComm {
    fn open(
        fabrics: &[Arc<Fabric>],
        rank: usize,
        dog: &Watchdog,
        name: &str,
        l: TimeLimit,
    ) -> Result<P2pComm> {
        let mut tracked = Vec::new();
        for (i, f) in fabrics.iter().enumerate() {
            let (t, res) = create(f, rank, dog, &format!("{name}/{i}"), None, l);
            res?;
            tracked.push(t);
        }
        Ok(P2pComm {
            rank,
            fabrics: fabrics.to_vec(),
            tracked,
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// `isend` (`send = true`) to or `irecv` from `peer`: enqueued now, never held back.
    fn start(&self, send: bool, peer: usize, l: TimeLimit) -> Completion {
        let i = if self.fabrics.len() == 2 {
            backend_nccl::p2p::lane(self.rank, peer, send).index()
        } else {
            0
        };
        let (from, to) = if send {
            (self.rank, peer)
        } else {
            (peer, self.rank)
        };
        let n = {
            let mut c = self.counts.lock().unwrap();
            let e = c.entry((from, to, i)).or_default();
            *e += 1;
            *e - 1
        };
        let ev = self.fabrics[i].enqueue(self.rank, Queued::P2p(from, to, n));
        let op = if send { "send" } else { "recv" };
        self.tracked[i].launch(op, l, ev, Vec::new())
    }
}

fn lanes_or_one(n: usize, lanes: bool) -> Vec<Arc<Fabric>> {
    (0..if lanes { 2 } else { 1 })
        .map(|_| Fabric::new(n))
        .collect()
}

/// Two ranks each `isend` to the other and `irecv` from it (rank 1 in the other order), every
/// call enqueued at once, then wait for both.
fn exchange(lanes: bool, l: TimeLimit) -> Vec<Result<Duration>> {
    let fabrics = lanes_or_one(2, lanes);
    ranks(2, |r| -> Result<Duration> {
        let dog = dog();
        let c = P2pComm::open(&fabrics, r, &dog, "pp", l)?;
        let start = Instant::now();
        let peer = 1 - r;
        let (a, b) = if r == 0 {
            (c.start(true, peer, l), c.start(false, peer, l))
        } else {
            let b = c.start(false, peer, l);
            (c.start(true, peer, l), b)
        };
        a.wait()?;
        b.wait()?;
        Ok(start.elapsed())
    })
}

#[test]
fn an_exchange_posted_at_once_on_lanes_completes() {
    for (r, o) in exchange(true, limit(3_000)).into_iter().enumerate() {
        let took = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(took < Duration::from_secs(1), "rank {r}: {took:?}");
    }
    // Both ranks sending first, too.
    let fabrics = lanes_or_one(2, true);
    for (r, o) in ranks(2, |r| -> Result<()> {
        let dog = dog();
        let l = limit(3_000);
        let c = P2pComm::open(&fabrics, r, &dog, "pp", l)?;
        let s = c.start(true, 1 - r, l);
        let v = c.start(false, 1 - r, l);
        s.wait()?;
        v.wait().map(|_| ())
    })
    .into_iter()
    .enumerate()
    {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// The control: the same calls enqueued at once on one communicator stall on both ranks (each
/// runs its send first and waits for a receive queued behind the other rank's send) and end in
/// `Timeout` within the limit plus one second. This is why single sends and receives are not
/// simply posted on the communicator itself.
#[test]
fn an_exchange_posted_at_once_on_one_communicator_stalls() {
    let fabrics = lanes_or_one(2, false);
    let l = Duration::from_millis(300);
    for (r, o) in ranks(2, |r| -> Result<Duration> {
        let dog = dog();
        let c = P2pComm::open(&fabrics, r, &dog, "pp", l.into())?;
        let start = Instant::now();
        let s = c.start(true, 1 - r, l.into());
        let v = c.start(false, 1 - r, l.into());
        let res = s.wait().and_then(|_| v.wait());
        res.map(|_| start.elapsed()).map_err(|e| match e {
            Error::Timeout { .. } if start.elapsed() < l + MARGIN => e,
            other => panic!("rank {r}: {other:?} after {:?}", start.elapsed()),
        })
    })
    .into_iter()
    .enumerate()
    {
        let e = o.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "rank {r}: {e:?}");
    }
}

/// Rings in both directions on 4 ranks: `irecv(left); isend(right)`, then the reverse ring,
/// every call enqueued at once on its lane.
#[test]
fn rings_posted_at_once_on_lanes_complete() {
    let n = 4;
    let fabrics = lanes_or_one(n, true);
    for (r, o) in ranks(n, |r| -> Result<()> {
        let dog = dog();
        let l = limit(3_000);
        let c = P2pComm::open(&fabrics, r, &dog, "ring", l)?;
        let (left, right) = ((r + n - 1) % n, (r + 1) % n);
        for (from, to) in [(left, right), (right, left)] {
            let v = c.start(false, from, l);
            let s = c.start(true, to, l);
            v.wait()?;
            s.wait()?;
        }
        Ok(())
    })
    .into_iter()
    .enumerate()
    {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// The pattern of the NCCL issue, with posting at once: rank 0 `isend`s on the pipeline
/// communicator (enqueued at once on its lane, nothing held back, no later call posts it) and
/// then blocks in an all-reduce on the data-parallel communicator; rank 1 receives first
/// (blocking), then joins the all-reduce. Both finish.
#[test]
fn isend_on_a_lane_then_a_blocking_collective_on_another_communicator_completes() {
    let pp = lanes_or_one(2, true);
    let dp = Fabric::new(2);
    for (r, o) in ranks(2, |r| -> Result<Duration> {
        let dog = dog();
        let l = limit(3_000);
        let p = P2pComm::open(&pp, r, &dog, "pp", l)?;
        let (d, res) = create(&dp, r, &dog, "dp", None, l);
        res?;
        let start = Instant::now();
        let all_reduce = |key: &str| -> Result<()> {
            let ev = dp.enqueue(r, Queued::Collective(key.to_string()));
            d.launch("all_reduce", l, ev, Vec::new()).wait().map(|_| ())
        };
        if r == 0 {
            let send = p.start(true, 1, l);
            all_reduce("ar#0")?;
            send.wait()?;
        } else {
            p.start(false, 0, l).wait()?;
            all_reduce("ar#0")?;
        }
        Ok(start.elapsed())
    })
    .into_iter()
    .enumerate()
    {
        let took = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(took < Duration::from_secs(1), "rank {r}: {took:?}");
    }
}

// ------------------------------------------------------------------------------------------------
// CUDA graph capture
// ------------------------------------------------------------------------------------------------

/// A stream of the stand-in whose capture state the test sets.
struct ScriptedStream(Mutex<Capture>);

impl DeviceStream for ScriptedStream {
    fn capture(&self) -> Result<Capture> {
        Ok(*self.0.lock().unwrap())
    }
}

/// A marker that fails the test if anything queries it (querying an event recorded during a
/// capture invalidates the capture).
struct MustNotQuery(Arc<AtomicBool>);

impl DeviceEvent for MustNotQuery {
    fn query(&self) -> Result<Progress> {
        self.0.store(true, Ordering::Release);
        Ok(Progress::Done)
    }
}

/// While the stream captures, an operation is not watched: no marker is made or queried, no
/// time limit runs, the buffers come back at once. After the capture ends, eager operations
/// are watched again and complete through their markers (the replayed graph runs outside the
/// state machine). An invalidated capture and host memory during capture are errors that name
/// the operation, before anything would be enqueued.
#[test]
fn captured_work_is_never_watched_and_eager_work_after_it_is() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();
    let stream = ScriptedStream(Mutex::new(Capture::Capturing));
    let queried = Arc::new(AtomicBool::new(false));
    let made = AtomicBool::new(false);
    let freed = Arc::new(AtomicBool::new(false));
    let (c, how) = t
        .launch_on(
            "all_reduce",
            limit(100),
            &stream,
            || {
                made.store(true, Ordering::Release);
                Ok(Box::new(MustNotQuery(queried.clone())) as Box<dyn DeviceEvent>)
            },
            vec![Box::new(Buffer(freed.clone()))],
        )
        .unwrap();
    assert_eq!(how, Launch::Captured);
    assert!(
        !made.load(Ordering::Acquire),
        "a marker was made during capture"
    );
    assert_eq!(t.pending(), 0, "captured work is not pending eager work");
    assert_eq!(t.captured_ops(), 1);
    assert!(matches!(c.outcome(), Some(Ok(()))));
    // Well past the 100 ms limit: nothing times out, nothing is queried.
    std::thread::sleep(Duration::from_millis(250));
    dog.kick();
    assert_eq!(t.state_name(), "live");
    assert!(!queried.load(Ordering::Acquire));
    let back = c.take_stream_ordered();
    assert_eq!(back.len(), 1, "the buffers come back to the caller");
    assert!(!freed.load(Ordering::Acquire));

    // Host memory, a host wait, or an invalidated capture: refused before enqueueing.
    let e = launch_plan("all_gather", Capture::Capturing, true).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unsupported {
                op: "all_gather",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("captured into a CUDA graph"), "{e}");
    *stream.0.lock().unwrap() = Capture::Invalidated;
    let e = t
        .launch_on(
            "broadcast",
            limit(100),
            &stream,
            || unreachable!(),
            Vec::new(),
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("broadcast: the stream's CUDA graph capture was invalidated"),
        "{e}"
    );
    assert_eq!(
        t.state_name(),
        "live",
        "a refused operation does not fail the communicator"
    );

    // Eager again (after the graph was launched): watched, completes through its marker.
    *stream.0.lock().unwrap() = Capture::Eager;
    let (c, how) = t
        .launch_on(
            "all_reduce",
            limit(2_000),
            &stream,
            || Ok(fabric.collective(0, "ar#eager")),
            Vec::new(),
        )
        .unwrap();
    assert_eq!(how, Launch::Watched);
    c.wait().unwrap();
    assert_eq!(t.pending(), 0);

    // Capturing on a communicator that failed: the completion carries its error.
    fabric.raise(0);
    wait_until("the failure", Duration::from_secs(2), || {
        t.state_name() == "failed"
    });
    *stream.0.lock().unwrap() = Capture::Capturing;
    let (c, _) = t
        .launch_on(
            "all_reduce",
            limit(100),
            &stream,
            || unreachable!(),
            Vec::new(),
        )
        .unwrap();
    let e = c.wait().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Aborted {
                op: "all_reduce",
                ..
            }
        ),
        "{e:?}"
    );
}

// ------------------------------------------------------------------------------------------------
// Teardown
// ------------------------------------------------------------------------------------------------

#[test]
fn a_dropped_idle_communicator_is_finalized_and_destroyed() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();
    t.close();
    drop(t);
    wait_until("destroy", Duration::from_secs(2), || {
        fabric.st().destroyed.contains(&0)
    });
    wait_until("untracked", Duration::from_secs(2), || dog.tracked() == 0);
    assert!(fabric.st().aborted.is_empty());
}

/// A dropped communicator whose finalize never finishes (a dead peer) is aborted after the
/// close limit instead of blocking anybody.
#[test]
fn a_dropped_communicator_that_cannot_finalize_is_aborted() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();
    fabric.st().finalize_stuck = true;
    let t0 = Instant::now();
    t.close();
    drop(t);
    wait_until("abort", Duration::from_secs(2), || {
        fabric.st().aborted.contains(&0)
    });
    assert!(t0.elapsed() >= Duration::from_millis(300));
    wait_until("untracked", Duration::from_secs(2), || dog.tracked() == 0);
    assert!(!fabric.st().destroyed.contains(&0));
}

/// A dropped communicator with an operation that never completes: the operation's limit fails
/// it (abort), and its buffers stay with the watchdog until the device lets them go.
#[test]
fn a_dropped_communicator_with_stalled_work_is_aborted_on_the_first_timeout() {
    let dog = dog();
    let fabric = Fabric::new(1);
    let (t, res) = create(&fabric, 0, &dog, "world", None, limit(5_000));
    res.unwrap();
    let (_open, ev) = gate(&fabric);
    let freed = Arc::new(AtomicBool::new(false));
    drop(t.launch(
        "all_reduce",
        limit(200),
        ev,
        vec![Box::new(Buffer(freed.clone()))],
    ));
    t.close();
    wait_until("abort", Duration::from_secs(2), || {
        fabric.st().aborted.contains(&0)
    });
    assert_eq!(t.state_name(), "failed");
    assert!(!freed.load(Ordering::Acquire));
}

// ------------------------------------------------------------------------------------------------
// The event pool
// ------------------------------------------------------------------------------------------------

/// The pool the backend keeps its CUDA events in: objects are reused once given back, no more
/// than the cap wait idle, and a failed creation is an error, not a panic.
#[test]
fn the_event_pool_reuses_and_caps() {
    use backend_nccl::engine::Pool;
    let pool: Pool<usize> = Pool::new(2);
    let mut next = 0usize;
    let mut make = || {
        next += 1;
        Ok(next)
    };
    let a = pool.take(&mut make).unwrap();
    let b = pool.take(&mut make).unwrap();
    let c = pool.take(&mut make).unwrap();
    assert_eq!((a, b, c, pool.created()), (1, 2, 3, 3));
    for x in [a, b, c] {
        pool.give(x);
    }
    assert_eq!(pool.idle(), 2, "at most the cap waits idle");
    // 1000 take/give rounds create nothing new.
    for _ in 0..1000 {
        let x = pool.take(&mut make).unwrap();
        pool.give(x);
    }
    assert_eq!(pool.created(), 3);
    let empty: Pool<usize> = Pool::new(1);
    let e = empty
        .take(|| Err(Error::Invalid("cuEventCreate failed".into())))
        .unwrap_err();
    assert_eq!(e.to_string(), "cuEventCreate failed");
}
