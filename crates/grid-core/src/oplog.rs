//! The operation log (flight recorder): the last operations of every communicator of this
//! process, dumped as JSON when something goes wrong, and read across ranks by `grid trace`
//! ([`crate::trace`]).
//!
//! * [`OpLog`] is the log of one communicator: a bounded ring buffer of [`OpRecord`]s (sequence
//!   number, operation, dtype, element count, root or peer, tag, reduce operation, state and
//!   timestamps) plus the communicator's name and member world ranks. The communicator front end
//!   calls [`OpLog::begin`] when an operation is posted, [`OpLog::mark_started`] when the backend
//!   starts it, and [`OpLog::complete`] or [`OpLog::fail`] when it ends. Recording does no I/O and
//!   no allocation once the ring is full: one uncontended lock and one clock read per call (well
//!   under a microsecond; `cargo bench -p grid-core --bench oplog` prints the figures).
//! * [`Recorder`] is the registry of one process: the logs of every live communicator, the
//!   process's world rank, and the dump. [`Recorder::dump`] writes `DIR/rank-<world rank>.json`
//!   atomically (a temporary file in `DIR`, then a rename), in the [`TraceDump`] format. `DIR` is
//!   `GRID_TRACE_DIR`, read once by [`Recorder::global`] (or given to [`Recorder::new`]). The front
//!   end dumps on a timeout, an abort or a failed operation; a program may dump at any time; and
//!   [`Recorder::install_sigusr1_dump`] makes `kill -USR1 PID` dump too.
//!
//! # Turning it on, and where the dumps go
//!
//! * Recording is **on when there is somewhere to dump**: with `GRID_TRACE_DIR=DIR` set (or a
//!   recorder installed with [`Recorder::set_global`]), every communicator ([`crate::Comm`],
//!   whatever the backend) registers an [`OpLog`] of [`DEFAULT_CAPACITY`] operations with
//!   [`Recorder::global`] when it is created. `GRID_TRACE_CAPACITY=N` keeps `N` operations per
//!   communicator (and turns recording on without a directory, for a program that dumps with
//!   [`Recorder::dump_to`]); `GRID_TRACE_CAPACITY=0` turns it off. With neither variable set,
//!   nothing is recorded and an operation costs nothing extra ([`Recorder::off`]). The cost when
//!   on: two short uncontended locks and two clock reads (the time-stamp counter) per
//!   operation, 30-50 ns (`cargo bench -p grid-core --bench oplog`; `docs/performance.md`).
//! * Dumps need a directory: `GRID_TRACE_DIR=DIR` in the environment, or a program's own
//!   recorder installed with [`Recorder::set_global`] before its first communicator (what
//!   `gloo-loop --trace-dir D` and `mpi-loop --trace-dir D` do). Every rank then writes
//!   `DIR/rank-<world rank>.json`:
//!   - when an operation fails with a communication error: reason `timeout`
//!     ([`crate::Error::Timeout`]), `abort` ([`crate::Error::Finalized`]: the communicator was
//!     aborted or finalized under it), or `failure: <op> on <communicator>: <error>` (a peer
//!     that failed, a library error); an argument rejected by validation is the caller's bug,
//!     is not recorded and dumps nothing;
//!   - on `kill -USR1 <pid>`: installed by the first communicator created while a directory is
//!     configured (see [`Recorder::install_sigusr1_dump`]);
//!   - when the program asks: `grid_core::oplog::Recorder::global().dump("explicit")`.
//! * The world rank in the file name is the one set with [`Recorder::set_world_rank`], or else
//!   the process's world rank in the first communicator created (`global_ranks()[rank()]`,
//!   [`Recorder::set_world_rank_if_unset`]). Ranks that are threads of one process (the local
//!   backend) share one recorder and therefore one file.
//!
//! The dump is the only I/O of this crate, and it never runs in a signal handler: the SIGUSR1
//! handler (installed by `signal-hook`) only writes a byte to a self-pipe, which is
//! async-signal-safe; a helper thread reads the pipe and dumps.
//!
//! ```
//! use grid_core::oplog::{OpDesc, OpState, Recorder};
//! let dir = std::env::temp_dir().join(format!("grid-oplog-doc-{}", std::process::id()));
//! let recorder = Recorder::new(Some(dir.clone()), 4096)?;
//! recorder.set_world_rank(2);
//! let log = recorder.register("dp", vec![0, 2, 4, 6]);
//!
//! let op = log.begin(OpDesc::new("all_reduce").dtype("f32").count(1024).reduce_op("sum"));
//! log.mark_started(op);
//! log.complete(op);
//! let stuck = log.begin(OpDesc::new("broadcast").dtype("f32").count(8).root(0));
//! log.fail(stuck, "timed out after 30 s");
//!
//! let path = recorder.dump("timeout")?.expect("a directory is configured");
//! assert_eq!(path, dir.join("rank-2.json"));
//! let dump = grid_core::oplog::TraceDump::from_json(&std::fs::read_to_string(&path)?)?;
//! let records = &dump.communicators[0].records;
//! assert_eq!((records[0].seq, records[0].state.clone()), (0, OpState::Completed));
//! assert_eq!(records[1].op, "broadcast");
//! assert!(matches!(&records[1].state, OpState::Failed { reason } if reason.contains("timed out")));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// The version of the dump format ([`TraceDump::version`]).
pub const TRACE_FORMAT_VERSION: u32 = 1;

/// The number of operations an [`OpLog`] keeps when `GRID_TRACE_CAPACITY` is not set.
pub const DEFAULT_CAPACITY: usize = 4096;

/// The environment variable naming the directory of the dumps.
pub const TRACE_DIR_ENV: &str = "GRID_TRACE_DIR";

/// The environment variable setting the capacity of every [`OpLog`]: a positive integer, or `0`
/// to turn the operation log off in this process (communicators then record nothing and
/// nothing is dumped).
pub const TRACE_CAPACITY_ENV: &str = "GRID_TRACE_CAPACITY";

/// Why a recorder could not be made or a dump could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A log must keep at least one operation.
    #[error("the operation log capacity must be a positive integer, got 0")]
    ZeroCapacity,
    /// An environment variable has a value that cannot be used.
    #[error("{var}={value:?} is invalid: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What would be valid.
        expected: &'static str,
    },
    /// The dump needs the world rank of this process (its file name), which nobody set.
    #[error("cannot dump the operation log: this process's world rank is unknown (call Recorder::set_world_rank first)")]
    RankUnknown,
    /// Reading or writing a file or directory failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("write", "rename to", ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A dump is not valid JSON in the [`TraceDump`] format.
    #[error("not a trace dump: {0}")]
    Json(#[from] serde_json::Error),
    /// [`Recorder::set_global`] after the process's recorder was already in use.
    #[error("the process's operation recorder is already configured (Recorder::set_global must come before the first communicator)")]
    GlobalExists,
    /// The SIGUSR1 handler or its thread could not be installed.
    #[error("cannot install the SIGUSR1 dump handler: {0}")]
    Signal(std::io::Error),
}

/// Microseconds since the Unix epoch, now (0 if the clock is before 1970).
pub fn now_us() -> u64 {
    // The operation log reads the clock twice per operation, so the clock is most of its cost:
    // `SystemTime::now` is a vDSO call of 35-40 ns on this kind of VM, the CPU's time-stamp
    // counter (through `quanta`, which calibrates it against the OS clock and falls back to the
    // monotonic clock where the counter is not invariant) 9-15 ns. The counter is anchored once
    // to the Unix epoch, so timestamps of one process are monotonic and comparable across
    // ranks to the accuracy of the hosts' clocks.
    static ANCHOR: OnceLock<(quanta::Clock, u64, u64)> = OnceLock::new();
    let (clock, raw0, unix0) = ANCHOR.get_or_init(|| {
        let clock = quanta::Clock::new();
        let raw0 = clock.raw();
        (clock, raw0, system_now_us())
    });
    unix0.saturating_add(clock.delta_as_nanos(*raw0, clock.raw()) / 1000)
}

/// Microseconds since the Unix epoch from the OS clock (0 if the clock is before 1970).
fn system_now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        d.as_secs()
            .saturating_mul(1_000_000)
            .saturating_add(u64::from(d.subsec_micros()))
    })
}

/// What the front end knows about an operation when it posts it. Names are `&'static str` so
/// that recording allocates nothing.
///
/// `root` and `peer` are ranks *within the communicator* (group ranks), as the operations take
/// them; [`OpLog::ranks`] maps them to world ranks. A record with a `peer` is a point-to-point
/// operation, one without is a collective.
///
/// ```
/// use grid_core::oplog::OpDesc;
/// let d = OpDesc::new("send").dtype("bf16").count(4096).peer(1).tag(7);
/// assert_eq!((d.op, d.peer, d.root), ("send", Some(1), None));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    /// The operation: `all_reduce`, `broadcast`, `send`, `recv`, ...
    pub op: &'static str,
    /// The element type (`f32`, `bf16`, ...), if the operation has one.
    pub dtype: Option<&'static str>,
    /// The number of elements this rank contributes (or receives, for a receive).
    pub count: usize,
    /// The root of a rooted collective (a group rank).
    pub root: Option<usize>,
    /// The other rank of a point-to-point operation (a group rank).
    pub peer: Option<usize>,
    /// The tag of a point-to-point operation.
    pub tag: Option<u64>,
    /// The reduction (`sum`, `max`, ...) of a reducing collective.
    pub reduce_op: Option<&'static str>,
}

impl OpDesc {
    /// An operation with no dtype, count 0 and no root, peer, tag or reduction.
    pub const fn new(op: &'static str) -> OpDesc {
        OpDesc {
            op,
            dtype: None,
            count: 0,
            root: None,
            peer: None,
            tag: None,
            reduce_op: None,
        }
    }

    /// With this element type.
    pub const fn dtype(mut self, dtype: &'static str) -> OpDesc {
        self.dtype = Some(dtype);
        self
    }

    /// With this element count.
    pub const fn count(mut self, count: usize) -> OpDesc {
        self.count = count;
        self
    }

    /// With this root (group rank).
    pub const fn root(mut self, root: usize) -> OpDesc {
        self.root = Some(root);
        self
    }

    /// With this peer (group rank): a point-to-point operation.
    pub const fn peer(mut self, peer: usize) -> OpDesc {
        self.peer = Some(peer);
        self
    }

    /// With this tag.
    pub const fn tag(mut self, tag: u64) -> OpDesc {
        self.tag = Some(tag);
        self
    }

    /// With this reduction.
    pub const fn reduce_op(mut self, op: &'static str) -> OpDesc {
        self.reduce_op = Some(op);
        self
    }
}

/// Where an operation is: posted by the caller, started by the backend, then completed or
/// failed. In JSON, `"state": "posted"|"started"|"completed"|"failed"`, with `"reason"` beside
/// it when failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum OpState {
    /// Called, not yet started by the backend.
    Posted,
    /// Started by the backend, not finished.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with an error (a timeout, an abort, a backend failure).
    Failed {
        /// The error, in words.
        reason: String,
    },
}

impl OpState {
    /// `posted`, `started`, `completed` or `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            OpState::Posted => "posted",
            OpState::Started => "started",
            OpState::Completed => "completed",
            OpState::Failed { .. } => "failed",
        }
    }
}

/// One operation of a communicator, as dumped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// The operation's sequence number on its communicator (0 for the first), on this rank.
    pub seq: u64,
    /// The operation ([`OpDesc::op`]).
    pub op: String,
    /// The element type.
    #[serde(default)]
    pub dtype: Option<String>,
    /// The element count.
    #[serde(default)]
    pub count: usize,
    /// The root (group rank).
    #[serde(default)]
    pub root: Option<usize>,
    /// The peer (group rank) of a point-to-point operation.
    #[serde(default)]
    pub peer: Option<usize>,
    /// The tag.
    #[serde(default)]
    pub tag: Option<u64>,
    /// The reduction.
    #[serde(default)]
    pub reduce_op: Option<String>,
    /// The state (and the reason of a failure).
    #[serde(flatten)]
    pub state: OpState,
    /// When it was posted (µs since the Unix epoch).
    pub posted_us: u64,
    /// When the backend started it.
    #[serde(default)]
    pub started_us: Option<u64>,
    /// When it completed or failed.
    #[serde(default)]
    pub ended_us: Option<u64>,
}

/// The log of one communicator, as dumped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommDump {
    /// The communicator's name (its family, for example `dp`).
    pub name: String,
    /// Its members' world ranks, in group-rank order.
    pub ranks: Vec<usize>,
    /// How many operations the log keeps.
    #[serde(default)]
    pub capacity: usize,
    /// How many operations were ever posted (the next sequence number); records older than
    /// `posted - capacity` were dropped.
    #[serde(default)]
    pub posted: u64,
    /// The operations kept, oldest first.
    pub records: Vec<OpRecord>,
}

/// One rank's dump: the file `DIR/rank-<rank>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceDump {
    /// The format version ([`TRACE_FORMAT_VERSION`]).
    pub version: u32,
    /// The world rank of the process.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// When it was dumped (µs since the Unix epoch).
    pub dumped_at_us: u64,
    /// Why (`timeout`, `abort`, `failure`, `SIGUSR1`, `explicit`, ...).
    pub reason: String,
    /// Every live communicator's log.
    pub communicators: Vec<CommDump>,
}

impl TraceDump {
    /// Parses a dump, checking the format version.
    ///
    /// ```
    /// let err = grid_core::oplog::TraceDump::from_json("{\"rank\": 1}").unwrap_err();
    /// assert!(err.to_string().contains("missing field"));
    /// ```
    pub fn from_json(text: &str) -> Result<TraceDump, TraceError> {
        let dump: TraceDump = serde_json::from_str(text)?;
        if dump.version != TRACE_FORMAT_VERSION {
            return Err(TraceError::Json(serde::de::Error::custom(format!(
                "format version {} is not supported (this build reads version {TRACE_FORMAT_VERSION})",
                dump.version
            ))));
        }
        Ok(dump)
    }

    /// The dump as pretty JSON.
    pub fn to_json(&self) -> Result<String, TraceError> {
        Ok(serde_json::to_string_pretty(self)?)
    }
}

/// The state of a slot, without allocation except for a failure's reason.
#[derive(Debug, Clone)]
struct Slot {
    seq: u64,
    desc: OpDesc,
    state: OpState,
    posted_us: u64,
    started_us: Option<u64>,
    ended_us: Option<u64>,
}

impl Slot {
    fn record(&self) -> OpRecord {
        OpRecord {
            seq: self.seq,
            op: self.desc.op.to_string(),
            dtype: self.desc.dtype.map(str::to_string),
            count: self.desc.count,
            root: self.desc.root,
            peer: self.desc.peer,
            tag: self.desc.tag,
            reduce_op: self.desc.reduce_op.map(str::to_string),
            state: self.state.clone(),
            posted_us: self.posted_us,
            started_us: self.started_us,
            ended_us: self.ended_us,
        }
    }
}

/// The ring: slot `seq % capacity` holds operation `seq` while it is among the last
/// `capacity` ones (slots are pushed in sequence order until the ring is full).
#[derive(Debug)]
struct Ring {
    next_seq: u64,
    slots: Vec<Slot>,
}

/// The handle of a posted operation: its sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpHandle {
    seq: u64,
}

impl OpHandle {
    /// The operation's sequence number on its communicator.
    pub fn seq(self) -> u64 {
        self.seq
    }
}

/// The operation log of one communicator: its last `capacity` operations. Thread-safe; every
/// call takes one short lock. See the [module](self) documentation for an example.
#[derive(Debug)]
pub struct OpLog {
    name: String,
    ranks: Vec<usize>,
    capacity: usize,
    ring: Mutex<Ring>,
}

impl OpLog {
    /// An empty log for the communicator `name` with these member world ranks (group-rank
    /// order), keeping the last `capacity` operations.
    pub fn new(
        name: impl Into<String>,
        ranks: Vec<usize>,
        capacity: usize,
    ) -> Result<OpLog, TraceError> {
        if capacity == 0 {
            return Err(TraceError::ZeroCapacity);
        }
        Ok(OpLog {
            name: name.into(),
            ranks,
            capacity,
            ring: Mutex::new(Ring {
                next_seq: 0,
                // Grown as operations arrive: an idle communicator costs nothing.
                slots: Vec::new(),
            }),
        })
    }

    /// The communicator's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The member world ranks, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// How many operations the log keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The ring, even if a thread panicked while holding it (the data stays consistent: every
    /// update is a few plain stores).
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a posted operation and returns its handle (sequence numbers start at 0).
    pub fn begin(&self, desc: OpDesc) -> OpHandle {
        self.push(desc, OpState::Posted, false)
    }

    /// Records an operation that is posted and started at once (a blocking call handed straight
    /// to the backend): one lock and one clock read instead of two of each, with
    /// `started_us == posted_us`.
    pub fn begin_started(&self, desc: OpDesc) -> OpHandle {
        self.push(desc, OpState::Started, true)
    }

    fn push(&self, desc: OpDesc, state: OpState, started: bool) -> OpHandle {
        let posted_us = now_us();
        let mut ring = self.lock();
        let seq = ring.next_seq;
        ring.next_seq += 1;
        if self.capacity == 0 {
            // A log of a recorder that records nothing (GRID_TRACE_CAPACITY=0): numbers only.
            return OpHandle { seq };
        }
        let slot = Slot {
            seq,
            desc,
            state,
            posted_us,
            started_us: started.then_some(posted_us),
            ended_us: None,
        };
        if ring.slots.len() < self.capacity {
            ring.slots.push(slot);
        } else {
            let i = (seq % self.capacity as u64) as usize;
            ring.slots[i] = slot;
        }
        OpHandle { seq }
    }

    /// Applies `f` to the slot of `h` if it is still in the ring.
    fn update(&self, h: OpHandle, f: impl FnOnce(&mut Slot) -> bool) -> bool {
        if self.capacity == 0 {
            return false;
        }
        let mut ring = self.lock();
        let i = (h.seq % self.capacity as u64) as usize;
        match ring.slots.get_mut(i) {
            Some(slot) if slot.seq == h.seq => f(slot),
            _ => false,
        }
    }

    /// Marks the operation started. Returns false if it was dropped from the ring or is no
    /// longer posted.
    pub fn mark_started(&self, h: OpHandle) -> bool {
        let t = now_us();
        self.update(h, |s| {
            if s.state != OpState::Posted {
                return false;
            }
            s.state = OpState::Started;
            s.started_us = Some(t);
            true
        })
    }

    /// Marks the operation completed. Returns false if it was dropped from the ring or had
    /// already ended.
    pub fn complete(&self, h: OpHandle) -> bool {
        let t = now_us();
        self.update(h, |s| {
            if matches!(s.state, OpState::Completed | OpState::Failed { .. }) {
                return false;
            }
            s.state = OpState::Completed;
            s.ended_us = Some(t);
            true
        })
    }

    /// Marks the operation failed with `reason`. Returns false if it was dropped from the ring
    /// or had already ended.
    pub fn fail(&self, h: OpHandle, reason: impl Into<String>) -> bool {
        let t = now_us();
        let reason = reason.into();
        self.update(h, move |s| {
            if matches!(s.state, OpState::Completed | OpState::Failed { .. }) {
                return false;
            }
            s.state = OpState::Failed { reason };
            s.ended_us = Some(t);
            true
        })
    }

    /// A copy of the log, oldest operation first.
    pub fn snapshot(&self) -> CommDump {
        let ring = self.lock();
        let mut records = Vec::with_capacity(ring.slots.len());
        let n = ring.slots.len();
        // When full, the oldest slot is the one the next operation will overwrite.
        let start = if n == 0 || n < self.capacity {
            0
        } else {
            (ring.next_seq % self.capacity as u64) as usize
        };
        for k in 0..n {
            records.push(ring.slots[(start + k) % n].record());
        }
        CommDump {
            name: self.name.clone(),
            ranks: self.ranks.clone(),
            capacity: self.capacity,
            posted: ring.next_seq,
            records,
        }
    }
}

/// The operation logs of every live communicator of this process, and their dump. See the
/// [module](self) documentation.
#[derive(Debug)]
pub struct Recorder {
    dir: Option<PathBuf>,
    capacity: usize,
    world_rank: AtomicUsize,
    logs: Mutex<Vec<Weak<OpLog>>>,
    dumps: AtomicUsize,
}

/// The process's recorder ([`Recorder::global`], [`Recorder::set_global`]).
static GLOBAL: OnceLock<Recorder> = OnceLock::new();

/// `world_rank` before [`Recorder::set_world_rank`].
const RANK_UNSET: usize = usize::MAX;

/// What `GRID_TRACE_CAPACITY` accepts.
const CAPACITY_EXPECTED: &str =
    "a non-negative integer (the operations kept per communicator; 0 turns the log off)";

impl Recorder {
    /// A recorder dumping to `dir` (none: [`Recorder::dump`] writes nothing), whose logs keep
    /// `capacity` operations each.
    pub fn new(dir: Option<PathBuf>, capacity: usize) -> Result<Recorder, TraceError> {
        if capacity == 0 {
            return Err(TraceError::ZeroCapacity);
        }
        Ok(Recorder {
            dir,
            capacity,
            world_rank: AtomicUsize::new(RANK_UNSET),
            logs: Mutex::new(Vec::new()),
            dumps: AtomicUsize::new(0),
        })
    }

    /// A recorder that records nothing ([`Recorder::is_recording`] is false): the logs it
    /// registers only count operations, and its dumps list no records. What
    /// `GRID_TRACE_CAPACITY=0` selects.
    pub fn off(dir: Option<PathBuf>) -> Recorder {
        Recorder {
            dir,
            capacity: 0,
            world_rank: AtomicUsize::new(RANK_UNSET),
            logs: Mutex::new(Vec::new()),
            dumps: AtomicUsize::new(0),
        }
    }

    /// Whether this recorder's logs keep operations (false for [`Recorder::off`]). The
    /// communicator front end registers no log at all when it is false.
    pub fn is_recording(&self) -> bool {
        self.capacity > 0
    }

    /// A recorder configured by `GRID_TRACE_DIR` (an empty value is unset) and
    /// `GRID_TRACE_CAPACITY`: recording is on with [`DEFAULT_CAPACITY`] when a directory is set,
    /// with `N` when `GRID_TRACE_CAPACITY=N` is set, and off ([`Recorder::off`]) when neither is
    /// set or the capacity is `0`.
    pub fn from_env() -> Result<Recorder, TraceError> {
        let dir = std::env::var_os(TRACE_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        let capacity = match std::env::var(TRACE_CAPACITY_ENV) {
            Err(std::env::VarError::NotPresent) if dir.is_some() => DEFAULT_CAPACITY,
            Err(std::env::VarError::NotPresent) => 0,
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) => n,
                Err(_) => {
                    return Err(TraceError::InvalidEnv {
                        var: TRACE_CAPACITY_ENV,
                        value: v,
                        expected: CAPACITY_EXPECTED,
                    })
                }
            },
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(TraceError::InvalidEnv {
                    var: TRACE_CAPACITY_ENV,
                    value: v.to_string_lossy().into_owned(),
                    expected: CAPACITY_EXPECTED,
                })
            }
        };
        if capacity == 0 {
            return Ok(Recorder::off(dir));
        }
        Recorder::new(dir, capacity)
    }

    /// The process's recorder, configured from the environment the first time it is asked for
    /// (the variables are read once). An invalid `GRID_TRACE_CAPACITY` is reported with
    /// `tracing::warn!` and the default capacity is used, so that a typo never stops a job.
    pub fn global() -> &'static Recorder {
        GLOBAL.get_or_init(|| {
            Recorder::from_env().unwrap_or_else(|e| {
                tracing::warn!("{e}; using a capacity of {DEFAULT_CAPACITY}");
                let dir = std::env::var_os(TRACE_DIR_ENV)
                    .filter(|d| !d.is_empty())
                    .map(PathBuf::from);
                Recorder {
                    dir,
                    capacity: DEFAULT_CAPACITY,
                    world_rank: AtomicUsize::new(RANK_UNSET),
                    logs: Mutex::new(Vec::new()),
                    dumps: AtomicUsize::new(0),
                }
            })
        })
    }

    /// Makes `recorder` the process's recorder ([`Recorder::global`]) instead of the one the
    /// environment configures: for a program whose command line names the dump directory
    /// (`--trace-dir D`). Must be called before the first communicator is created (and before
    /// anything else asks for [`Recorder::global`]); later, it fails with
    /// [`TraceError::GlobalExists`].
    ///
    /// ```
    /// use grid_core::oplog::Recorder;
    /// let dir = std::env::temp_dir().join("grid-oplog-set-global-doc");
    /// let mine = Recorder::set_global(Recorder::new(Some(dir.clone()), 64)?)?;
    /// assert_eq!(Recorder::global().trace_dir(), Some(dir.as_path()));
    /// assert!(std::ptr::eq(mine, Recorder::global()));
    /// assert!(Recorder::set_global(Recorder::new(None, 64)?).is_err());
    /// # Ok::<(), grid_core::oplog::TraceError>(())
    /// ```
    pub fn set_global(recorder: Recorder) -> Result<&'static Recorder, TraceError> {
        let mut fresh = Some(recorder);
        let global = GLOBAL.get_or_init(|| fresh.take().unwrap_or_else(|| Recorder::off(None)));
        if fresh.is_some() {
            return Err(TraceError::GlobalExists);
        }
        Ok(global)
    }

    /// How many dumps this recorder has written so far (by any cause).
    pub fn dumps_written(&self) -> usize {
        self.dumps.load(Ordering::Relaxed)
    }

    /// The dump directory, if any.
    pub fn trace_dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The capacity of the logs this recorder makes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the world rank of this process (the dump's file name).
    pub fn set_world_rank(&self, rank: usize) {
        self.world_rank.store(rank, Ordering::Relaxed);
    }

    /// Sets the world rank unless one is set already; returns the rank in force afterwards.
    /// The communicator front end calls it with the world rank of this process in the first
    /// communicator it creates (`global_ranks()[rank()]`), so that a program that never calls
    /// [`Recorder::set_world_rank`] still dumps to `rank-<its world rank>.json`.
    pub fn set_world_rank_if_unset(&self, rank: usize) -> usize {
        match self.world_rank.compare_exchange(
            RANK_UNSET,
            rank,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => rank,
            Err(current) => current,
        }
    }

    /// The world rank, once set.
    pub fn world_rank(&self) -> Option<usize> {
        match self.world_rank.load(Ordering::Relaxed) {
            RANK_UNSET => None,
            r => Some(r),
        }
    }

    fn logs(&self) -> MutexGuard<'_, Vec<Weak<OpLog>>> {
        self.logs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new log for a communicator, registered for the dumps while the returned `Arc` (or a
    /// clone) is alive.
    pub fn register(&self, name: impl Into<String>, ranks: Vec<usize>) -> Arc<OpLog> {
        let log = Arc::new(OpLog {
            name: name.into(),
            ranks,
            capacity: self.capacity,
            ring: Mutex::new(Ring {
                next_seq: 0,
                slots: Vec::new(),
            }),
        });
        let mut logs = self.logs();
        logs.retain(|w| w.strong_count() > 0);
        logs.push(Arc::downgrade(&log));
        log
    }

    /// The live logs, in registration order.
    pub fn live_logs(&self) -> Vec<Arc<OpLog>> {
        self.logs().iter().filter_map(Weak::upgrade).collect()
    }

    /// This process's dump (the world rank must be set).
    pub fn snapshot(&self, reason: &str) -> Result<TraceDump, TraceError> {
        let rank = self.world_rank().ok_or(TraceError::RankUnknown)?;
        Ok(TraceDump {
            version: TRACE_FORMAT_VERSION,
            rank,
            pid: std::process::id(),
            host: host_name(),
            dumped_at_us: now_us(),
            reason: reason.to_string(),
            communicators: self.live_logs().iter().map(|l| l.snapshot()).collect(),
        })
    }

    /// Writes `DIR/rank-<world rank>.json` if a directory is configured (`GRID_TRACE_DIR`) and
    /// returns its path; `Ok(None)` without a directory.
    pub fn dump(&self, reason: &str) -> Result<Option<PathBuf>, TraceError> {
        match &self.dir {
            Some(dir) => self.dump_to(dir, reason).map(Some),
            None => Ok(None),
        }
    }

    /// Writes `dir/rank-<world rank>.json` atomically (a temporary file in `dir`, then a
    /// rename), creating `dir` if needed, and returns its path.
    pub fn dump_to(&self, dir: &Path, reason: &str) -> Result<PathBuf, TraceError> {
        let dump = self.snapshot(reason)?;
        let json = dump.to_json()?;
        std::fs::create_dir_all(dir).map_err(|source| TraceError::Io {
            action: "create the directory",
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(format!("rank-{}.json", dump.rank));
        let tmp = dir.join(format!(".rank-{}.json.{}.tmp", dump.rank, dump.pid));
        std::fs::write(&tmp, json).map_err(|source| TraceError::Io {
            action: "write",
            path: tmp.clone(),
            source,
        })?;
        std::fs::rename(&tmp, &path).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            TraceError::Io {
                action: "rename the dump to",
                path: path.clone(),
                source,
            }
        })?;
        self.dumps.fetch_add(1, Ordering::Relaxed);
        Ok(path)
    }

    /// Makes SIGUSR1 dump this recorder (reason `SIGUSR1`) into its directory.
    ///
    /// Nothing is done in the signal handler but what `signal-hook` does: write a byte to a
    /// self-pipe (async-signal-safe). A helper thread named `grid-trace-sigusr1` waits on the
    /// pipe and dumps; a failed dump is reported with `tracing::warn!`. The handler is
    /// process-wide: the first recorder to install it is the one dumped, and later calls (from
    /// any recorder or thread) do nothing.
    #[cfg(unix)]
    pub fn install_sigusr1_dump(&'static self) -> Result<(), TraceError> {
        static INSTALLED: Mutex<bool> = Mutex::new(false);
        let mut installed = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
        if *installed {
            return Ok(());
        }
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
            .map_err(TraceError::Signal)?;
        std::thread::Builder::new()
            .name("grid-trace-sigusr1".into())
            .spawn(move || {
                for _ in signals.forever() {
                    match self.dump("SIGUSR1") {
                        Ok(Some(path)) => {
                            tracing::info!("operation log dumped to {}", path.display())
                        }
                        Ok(None) => tracing::warn!(
                            "SIGUSR1: no dump directory ({TRACE_DIR_ENV} is not set)"
                        ),
                        Err(e) => tracing::warn!("SIGUSR1: {e}"),
                    }
                }
            })
            .map_err(TraceError::Signal)?;
        *installed = true;
        Ok(())
    }
}

/// The host name (Linux: `/proc/sys/kernel/hostname`; otherwise `HOSTNAME`), or `unknown`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_capacity_operations_in_order() {
        let log = OpLog::new("tp", vec![0, 1], 3).unwrap();
        let hs: Vec<OpHandle> = (0..5)
            .map(|i| log.begin(OpDesc::new("all_reduce").count(i)))
            .collect();
        assert_eq!(
            hs.iter().map(|h| h.seq()).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        // Dropped operations are no longer updated.
        assert!(!log.complete(hs[0]));
        assert!(log.mark_started(hs[3]));
        assert!(log.complete(hs[3]));
        assert!(log.fail(hs[4], "timeout"));
        let snap = log.snapshot();
        assert_eq!(snap.posted, 5);
        assert_eq!(snap.capacity, 3);
        let seqs: Vec<u64> = snap.records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [2, 3, 4]);
        assert_eq!(snap.records[0].count, 2);
        assert_eq!(snap.records[0].state, OpState::Posted);
        assert_eq!(snap.records[1].state, OpState::Completed);
        assert!(snap.records[1].started_us.is_some() && snap.records[1].ended_us.is_some());
        assert_eq!(
            snap.records[2].state,
            OpState::Failed {
                reason: "timeout".into()
            }
        );
    }

    #[test]
    fn states_only_move_forward() {
        let log = OpLog::new("pp", vec![0, 4], 8).unwrap();
        let h = log.begin(OpDesc::new("send").peer(1));
        assert!(log.complete(h));
        assert!(!log.mark_started(h));
        assert!(!log.fail(h, "late"));
        assert!(!log.complete(h));
        assert_eq!(log.snapshot().records[0].state, OpState::Completed);
    }

    #[test]
    fn zero_capacity_is_an_error() {
        assert!(matches!(
            OpLog::new("x", vec![0], 0),
            Err(TraceError::ZeroCapacity)
        ));
        assert!(matches!(
            Recorder::new(None, 0),
            Err(TraceError::ZeroCapacity)
        ));
    }

    #[test]
    fn record_json_round_trip_and_shape() {
        let log = OpLog::new("dp", vec![0, 2], 4).unwrap();
        let a = log.begin(
            OpDesc::new("all_reduce")
                .dtype("f32")
                .count(10)
                .reduce_op("sum"),
        );
        log.fail(a, "abort");
        let dump = log.snapshot();
        let v = serde_json::to_value(&dump).unwrap();
        let r = &v["records"][0];
        assert_eq!(r["state"], "failed");
        assert_eq!(r["reason"], "abort");
        assert_eq!(r["op"], "all_reduce");
        assert_eq!(r["reduce_op"], "sum");
        assert_eq!(r["root"], serde_json::Value::Null);
        let back: CommDump = serde_json::from_value(v).unwrap();
        assert_eq!(back, dump);
    }

    #[test]
    fn dump_without_rank_or_dir() {
        let rec = Recorder::new(None, 4).unwrap();
        assert!(matches!(rec.snapshot("x"), Err(TraceError::RankUnknown)));
        rec.set_world_rank(0);
        assert!(rec.dump("x").unwrap().is_none());
    }

    #[test]
    fn dropped_logs_leave_the_dump() {
        let rec = Recorder::new(None, 4).unwrap();
        rec.set_world_rank(1);
        let a = rec.register("a", vec![0, 1]);
        let b = rec.register("b", vec![1]);
        drop(a);
        let dump = rec.snapshot("explicit").unwrap();
        assert_eq!(dump.communicators.len(), 1);
        assert_eq!(dump.communicators[0].name, "b");
        drop(b);
    }

    #[test]
    fn dump_into_an_unwritable_place_is_an_error() {
        let rec = Recorder::new(None, 4).unwrap();
        rec.set_world_rank(0);
        let file = std::env::temp_dir().join(format!("grid-oplog-file-{}", std::process::id()));
        std::fs::write(&file, "not a directory").unwrap();
        let err = rec.dump_to(&file.join("sub"), "x").unwrap_err();
        assert!(matches!(err, TraceError::Io { .. }), "{err}");
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn version_is_checked() {
        let rec = Recorder::new(None, 4).unwrap();
        rec.set_world_rank(3);
        let mut dump = rec.snapshot("x").unwrap();
        dump.version = 99;
        let err = TraceDump::from_json(&dump.to_json().unwrap()).unwrap_err();
        assert!(err.to_string().contains("version 99"), "{err}");
    }
}
