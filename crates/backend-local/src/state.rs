//! Shared state: the world (configuration and statistics) and one `Group` per communicator,
//! holding the rounds of its collectives and the mailboxes of its messages.

use crate::backend::{LocalBackend, LocalComm};
use grid_core::{Comm, DType, Error, HostBuffer, LibraryError, ReduceOp, Result, TimeLimit};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(crate) const BACKEND: &str = "local";

/// Configuration of a local world.
///
/// ```
/// use std::time::Duration;
/// let c = backend_local::LocalConfig { timeout: Duration::from_secs(5), rendezvous: true };
/// assert!(c.rendezvous);
/// assert_eq!(backend_local::LocalConfig::default().timeout, Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalConfig {
    /// How long any operation waits for the other ranks before failing with
    /// [`Error::Timeout`] (default 60 s).
    pub timeout: Duration,
    /// Sends complete only once the receiver took the message (default `false`: a send
    /// completes when the message is posted, like a small MPI message).
    pub rendezvous: bool,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            timeout: Duration::from_secs(60),
            rendezvous: false,
        }
    }
}

/// One point-to-point message, as recorded in [`LocalStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pRecord {
    /// World rank of the sender.
    pub src: usize,
    /// World rank of the receiver.
    pub dst: usize,
    /// Elements carried.
    pub len: usize,
    /// Their element type.
    pub dtype: DType,
}

/// What a world's ranks did, for tests that check traffic: every point-to-point message and
/// the number of `batch_p2p` calls per world rank.
///
/// ```
/// let w = backend_local::LocalWorld::new(2)?;
/// assert!(w.stats().messages().is_empty());
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct LocalStats {
    messages: Mutex<Vec<P2pRecord>>,
    batches: Mutex<HashMap<usize, usize>>,
}

impl LocalStats {
    /// Every point-to-point message so far (sends and batch sends), in posting order.
    pub fn messages(&self) -> Vec<P2pRecord> {
        lock(&self.messages).clone()
    }
    /// The `batch_p2p` calls world rank `rank` made so far.
    pub fn batches(&self, rank: usize) -> usize {
        lock(&self.batches).get(&rank).copied().unwrap_or(0)
    }
    pub(crate) fn message(&self, r: P2pRecord) {
        lock(&self.messages).push(r);
    }
    pub(crate) fn batch(&self, rank: usize) {
        *lock(&self.batches).entry(rank).or_default() += 1;
    }
}

/// A mutex poisoned by a panicking rank still holds consistent state here (every critical
/// section leaves it consistent before anything can panic), so the lock is taken anyway.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The world all communicators of one [`LocalWorld`] belong to.
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) config: LocalConfig,
    pub(crate) stats: Arc<LocalStats>,
}

/// A world of ranks that are threads of this process.
///
/// ```
/// use grid_core::{Communicator, CommunicatorExt};
/// let world = backend_local::LocalWorld::new(2)?;
/// let stats = world.stats();
/// let comms = world.communicators();
/// std::thread::scope(|s| {
///     for c in comms {
///         s.spawn(move || {
///             let mut all = [0i32; 2];
///             c.all_gather_into(&[c.rank() as i32][..], &mut all[..]).unwrap();
///             assert_eq!(all, [0, 1]);
///         });
///     }
/// });
/// assert_eq!(stats.messages().len(), 0);
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug)]
pub struct LocalWorld {
    group: Arc<Group>,
    world: Arc<World>,
}

impl LocalWorld {
    /// A world of `size` ranks with the default configuration.
    pub fn new(size: usize) -> Result<LocalWorld> {
        LocalWorld::with_config(size, LocalConfig::default())
    }
    /// A world of `size` ranks (at least 1).
    pub fn with_config(size: usize, config: LocalConfig) -> Result<LocalWorld> {
        if size == 0 {
            return Err(Error::NonPositive {
                what: "the size of a local world".into(),
                value: 0,
            });
        }
        let world = Arc::new(World {
            config,
            stats: Arc::new(LocalStats::default()),
        });
        let group = Group::new(world.clone(), (0..size).collect());
        Ok(LocalWorld { group, world })
    }
    /// The traffic statistics of this world.
    pub fn stats(&self) -> Arc<LocalStats> {
        self.world.stats.clone()
    }
    /// The world communicator of every rank, in rank order, named `"world"`; hand each to its
    /// own thread.
    pub fn communicators(self) -> Vec<LocalComm> {
        (0..self.group.global.len())
            .map(|r| Comm::new(LocalBackend::new(self.group.clone(), r), "world"))
            .collect()
    }
}

/// What one rank contributes to a collective round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp, DType, usize),
    Broadcast(usize, DType, usize),
    AllGather(DType, usize),
    ReduceScatter(ReduceOp, DType, usize),
    AllToAll(DType, usize),
    /// Per-rank counts travel in [`Part::counts`] (they differ between ranks).
    AllToAllV(DType),
    /// The receive counts, which every rank passes equal.
    AllGatherV(DType, Vec<usize>),
    /// The block sizes, which every rank passes equal.
    ReduceScatterV(ReduceOp, DType, Vec<usize>),
    /// Reduction, root, dtype, elements per rank.
    Reduce(ReduceOp, usize, DType, usize),
    /// Root, dtype, elements per rank.
    Gather(usize, DType, usize),
    /// Root, dtype, elements per rank.
    Scatter(usize, DType, usize),
    Barrier,
    Split,
}

impl Kind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::AllReduce(..) => "all_reduce",
            Kind::Broadcast(..) => "broadcast",
            Kind::AllGather(..) => "all_gather",
            Kind::ReduceScatter(..) => "reduce_scatter",
            Kind::AllToAll(..) => "all_to_all",
            Kind::AllToAllV(..) => "all_to_all_v",
            Kind::AllGatherV(..) => "all_gather_v",
            Kind::ReduceScatterV(..) => "reduce_scatter_v",
            Kind::Reduce(..) => "reduce",
            Kind::Gather(..) => "gather",
            Kind::Scatter(..) => "scatter",
            Kind::Barrier => "barrier",
            Kind::Split => "split",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Part {
    pub(crate) kind: Kind,
    pub(crate) data: Option<HostBuffer>,
    pub(crate) split: Option<(Option<u32>, usize)>,
    /// An all-to-all-v's counts: (sent to each rank, expected from each rank).
    pub(crate) counts: Option<(Vec<usize>, Vec<usize>)>,
}

#[derive(Debug)]
struct Round {
    parts: Vec<Option<Arc<Part>>>,
    collected: usize,
}

type Lane = (usize, usize, u32);

#[derive(Debug, Default)]
struct LaneState {
    sent: u64,
    posted: u64,
    msgs: HashMap<u64, HostBuffer>,
    consumed: HashSet<u64>,
}

#[derive(Debug, Default)]
struct GroupState {
    rounds: HashMap<u64, Round>,
    lanes: HashMap<Lane, LaneState>,
    /// Children made by a split (round, colour) and how many members still have to pick
    /// theirs up.
    children: HashMap<(u64, u32), (Arc<Group>, usize)>,
    /// Children made by members-only creations, by name, and how many members still have to
    /// pick theirs up.
    named: HashMap<String, (Arc<Group>, usize)>,
}

/// The shared state of one communicator's ranks.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) world: Arc<World>,
    pub(crate) global: Vec<usize>,
    state: Mutex<GroupState>,
    cv: Condvar,
}

/// A message slot: the lane and the message's index on it.
pub(crate) type Ticket = (Lane, u64);

impl Group {
    pub(crate) fn new(world: Arc<World>, global: Vec<usize>) -> Arc<Group> {
        Arc::new(Group {
            world,
            global,
            state: Mutex::new(GroupState::default()),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn size(&self) -> usize {
        self.global.len()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.world.config.timeout
    }

    /// Wakes every wait on this group (after a rank's abort flag was set), under the lock so
    /// that no waiter can miss it between its check and its sleep.
    pub(crate) fn wake_all(&self) {
        let _st = lock(&self.state);
        self.cv.notify_all();
    }

    /// Waits on the condition variable until woken, the deadline passed or the rank aborted.
    fn wait<'a>(
        &self,
        st: MutexGuard<'a, GroupState>,
        until: &Until<'_>,
    ) -> (MutexGuard<'a, GroupState>, Waited) {
        if until.abort.load(Ordering::Acquire) {
            return (st, Waited::Aborted);
        }
        let st = match until.deadline {
            None => self.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    return (st, Waited::Expired);
                }
                self.cv
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
        (st, Waited::Woken)
    }

    /// The error of a wait that ended without its message or round: aborted, or (strict)
    /// timed out waiting for communicator rank `peer`; `Ok(())` for an expired non-strict wait.
    fn ended(
        &self,
        w: Waited,
        until: &Until<'_>,
        op: &'static str,
        peer: usize,
        strict: bool,
    ) -> Result<()> {
        match w {
            Waited::Aborted => Err(Error::Aborted {
                op,
                reason: "the communicator was aborted on this rank".into(),
                at: None,
            }),
            Waited::Expired if strict => Err(Error::Timeout {
                op,
                millis: until.limit.as_millis(),
                peer: Some(peer),
                at: None,
            }),
            _ => Ok(()),
        }
    }

    // ---- collectives -------------------------------------------------------------------------

    /// Puts `rank`'s part of round `seq` on the board (never blocks).
    pub(crate) fn deposit(&self, seq: u64, rank: usize, part: Part) -> Result<()> {
        let n = self.size();
        let mut st = lock(&self.state);
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            parts: vec![None; n],
            collected: 0,
        });
        let slot = round.parts.get_mut(rank).ok_or_else(|| {
            Error::Invalid(format!("local: rank {rank} outside a communicator of {n}"))
        })?;
        if slot.is_some() {
            return Err(Error::Invalid(format!(
                "local: rank {rank} contributed twice to collective {seq}"
            )));
        }
        *slot = Some(Arc::new(part));
        self.cv.notify_all();
        Ok(())
    }

    /// True once every rank contributed to round `seq` (or the round was already collected by
    /// everyone).
    pub(crate) fn arrived(&self, seq: u64) -> bool {
        let st = lock(&self.state);
        st.rounds
            .get(&seq)
            .is_none_or(|r| r.parts.iter().all(Option::is_some))
    }

    /// Waits until every rank contributed to round `seq`, then returns the parts (rank order).
    /// `Ok(None)` if `deadline` passed first and `strict` is false; [`Error::Timeout`] naming
    /// the first missing rank if it is true.
    pub(crate) fn collect(
        &self,
        seq: u64,
        op: &'static str,
        until: &Until<'_>,
        strict: bool,
    ) -> Result<Option<Vec<Arc<Part>>>> {
        let n = self.size();
        let mut st = lock(&self.state);
        loop {
            let missing = match st.rounds.get(&seq) {
                Some(r) => r.parts.iter().position(Option::is_none),
                None => {
                    return Err(Error::Invalid(format!(
                        "local: collective {seq} was already collected"
                    )))
                }
            };
            match missing {
                None => {
                    let round = st.rounds.get_mut(&seq).ok_or_else(|| {
                        Error::Invalid(format!("local: collective {seq} vanished"))
                    })?;
                    let parts: Vec<Arc<Part>> = round.parts.iter().flatten().cloned().collect();
                    round.collected += 1;
                    if round.collected == n {
                        st.rounds.remove(&seq);
                    }
                    return Ok(Some(parts));
                }
                Some(peer) => {
                    let (s, w) = self.wait(st, until);
                    st = s;
                    if w != Waited::Woken {
                        self.ended(w, until, op, peer, strict)?;
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// The child communicator group of split round `seq` for `color`, created by the first
    /// member that asks; the entry is dropped once all `members` picked it up.
    pub(crate) fn child(&self, seq: u64, color: u32, members: &[usize]) -> Arc<Group> {
        let mut st = lock(&self.state);
        let key = (seq, color);
        let (g, left) = st.children.entry(key).or_insert_with(|| {
            (
                Group::new(self.world.clone(), members.to_vec()),
                members.len(),
            )
        });
        let g = g.clone();
        *left -= 1;
        if *left == 0 {
            st.children.remove(&key);
        }
        g
    }

    /// The child communicator group of the members-only creation `name` (members: global
    /// ranks), created by the first member that asks; the entry is dropped once all members
    /// picked it up. Only members call it; nobody waits here (the child's first collective
    /// meets its members).
    pub(crate) fn named_child(&self, name: &str, members: &[usize]) -> Arc<Group> {
        let mut st = lock(&self.state);
        let (g, left) = st.named.entry(name.to_string()).or_insert_with(|| {
            (
                Group::new(self.world.clone(), members.to_vec()),
                members.len(),
            )
        });
        let g = g.clone();
        *left -= 1;
        if *left == 0 {
            st.named.remove(name);
        }
        g
    }

    // ---- point to point ----------------------------------------------------------------------

    /// Posts a message from `src` to `dst` (communicator ranks); never blocks.
    pub(crate) fn post(&self, src: usize, dst: usize, tag: u32, data: HostBuffer) -> Ticket {
        let (len, dtype) = (data.len(), data.dtype());
        let lane = (src, dst, tag);
        let idx = {
            let mut st = lock(&self.state);
            let l = st.lanes.entry(lane).or_default();
            let idx = l.sent;
            l.sent += 1;
            l.msgs.insert(idx, data);
            self.cv.notify_all();
            idx
        };
        self.world.stats.message(P2pRecord {
            src: self.global[src],
            dst: self.global[dst],
            len,
            dtype,
        });
        (lane, idx)
    }

    /// Reserves the next receive slot from `src` to `dst`; never blocks.
    pub(crate) fn reserve(&self, src: usize, dst: usize, tag: u32) -> Ticket {
        let lane = (src, dst, tag);
        let mut st = lock(&self.state);
        let l = st.lanes.entry(lane).or_default();
        let idx = l.posted;
        l.posted += 1;
        (lane, idx)
    }

    /// True once the message of `ticket` was posted.
    pub(crate) fn posted(&self, t: &Ticket) -> bool {
        lock(&self.state)
            .lanes
            .get(&t.0)
            .is_some_and(|l| l.msgs.contains_key(&t.1))
    }

    /// Takes the message of `ticket`, waiting for it until `deadline`.
    pub(crate) fn take(
        &self,
        t: &Ticket,
        op: &'static str,
        until: &Until<'_>,
        strict: bool,
    ) -> Result<Option<HostBuffer>> {
        let mut st = lock(&self.state);
        loop {
            let rendezvous = self.world.config.rendezvous;
            if let Some(l) = st.lanes.get_mut(&t.0) {
                if let Some(m) = l.msgs.remove(&t.1) {
                    if rendezvous {
                        l.consumed.insert(t.1);
                        self.cv.notify_all();
                    }
                    return Ok(Some(m));
                }
            }
            let (s, w) = self.wait(st, until);
            st = s;
            if w != Waited::Woken {
                self.ended(w, until, op, t.0 .0, strict)?;
                return Ok(None);
            }
        }
    }

    /// True once the message of `ticket` was taken (always, without rendezvous).
    pub(crate) fn consumed(&self, t: &Ticket) -> bool {
        if !self.world.config.rendezvous {
            return true;
        }
        lock(&self.state)
            .lanes
            .get(&t.0)
            .is_some_and(|l| l.consumed.contains(&t.1))
    }

    /// With rendezvous: waits until the receiver took the message of `ticket`. A strict wait
    /// that times out withdraws the message (the failed send delivers nothing).
    pub(crate) fn wait_consumed(
        &self,
        t: &Ticket,
        op: &'static str,
        until: &Until<'_>,
        strict: bool,
    ) -> Result<bool> {
        if !self.world.config.rendezvous {
            return Ok(true);
        }
        let mut st = lock(&self.state);
        loop {
            if let Some(l) = st.lanes.get_mut(&t.0) {
                if l.consumed.remove(&t.1) {
                    return Ok(true);
                }
            }
            let (s, w) = self.wait(st, until);
            st = s;
            if w != Waited::Woken {
                if w == Waited::Expired && !strict {
                    return Ok(false);
                }
                // A send that failed delivers nothing: withdraw the message unless the
                // receiver took it in the meantime.
                if let Some(l) = st.lanes.get_mut(&t.0) {
                    if l.consumed.remove(&t.1) {
                        return Ok(true);
                    }
                    l.msgs.remove(&t.1);
                }
                drop(st);
                self.ended(w, until, op, t.0 .1, true)?;
                return Ok(false);
            }
        }
    }
}

/// How long a wait may last and what ends it early: the deadline (`None`: no limit), the time
/// limit it came from (for the error), and the rank's abort flag.
#[derive(Debug)]
pub(crate) struct Until<'a> {
    pub(crate) deadline: Option<Instant>,
    pub(crate) limit: TimeLimit,
    pub(crate) abort: &'a AtomicBool,
}

impl<'a> Until<'a> {
    /// A wait bounded by `limit` from now.
    pub(crate) fn limit(limit: TimeLimit, abort: &'a AtomicBool) -> Until<'a> {
        Until {
            deadline: limit.deadline_from(Instant::now()),
            limit,
            abort,
        }
    }
}

/// How one sleep on the condition variable ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waited {
    Woken,
    Expired,
    Aborted,
}

/// The error for ranks that disagree about a collective.
pub(crate) fn mismatch(op: &'static str, comm: &str, message: String) -> Error {
    LibraryError::new(BACKEND, op, message)
        .comm(comm)
        .class("mismatch")
        .into()
}
