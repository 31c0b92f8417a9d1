//! The cluster smoke tests `gloo-loop` and `mpi-loop` (examples of this crate): their shared
//! command-line options, the loop of checked f32 sum all-reduces, and the one JSON line each
//! rank prints when it ends.
//!
//! ```
//! use grid_programs::smoke::{LoopOptions, Outcome, Stop};
//! let mut o = LoopOptions::default();
//! assert!(o.flag("--iters", "20").unwrap());
//! assert!(!o.flag("--rank", "0").unwrap()); // not a loop option: the program's own
//! assert_eq!(o.stop, Stop::Iters(20));
//! assert!(o.flag("--bytes", "6").unwrap_err().contains("multiple of 4"));
//! let line = Outcome { rank: 1, completed: 20, error: None }.json_line();
//! assert_eq!(line, r#"{"rank":1,"completed":20,"error":null}"#);
//! ```

use grid_core::oplog::Recorder;
use grid_core::{Communicator, CommunicatorExt, Element, Error, ReduceOp, Result};
use std::path::{Path, PathBuf};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

/// When the loop ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// After this many all-reduces (`--iters K`).
    Iters(u64),
    /// After this many seconds (`--seconds S`): the ranks vote after every all-reduce with a
    /// one-element f32 sum all-reduce, so that every rank runs the same number of iterations.
    Seconds(f64),
}

/// The options both loop programs take.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopOptions {
    /// Bytes per all-reduce (`--bytes B`, a positive multiple of 4; default 1 MiB).
    pub bytes: usize,
    /// When to stop (default `--iters 100`).
    pub stop: Stop,
    /// The time limit of one all-reduce in milliseconds (`--timeout-ms T`, default 30000).
    pub timeout_ms: u64,
    /// Where the operation log goes (`--trace-dir D`): `D/rank-<world rank>.json`.
    pub trace_dir: Option<PathBuf>,
    /// A fault to inject (`--fault RANK:KIND@ITER`, a testing aid; see [`Fault`]).
    pub fault: Option<Fault>,
    stop_given: bool,
}

impl Default for LoopOptions {
    fn default() -> LoopOptions {
        LoopOptions {
            bytes: 1 << 20,
            stop: Stop::Iters(100),
            timeout_ms: 30_000,
            trace_dir: None,
            fault: None,
            stop_given: false,
        }
    }
}

impl LoopOptions {
    /// Takes one `flag value` pair if it is a loop option: `Ok(true)` when taken, `Ok(false)`
    /// when the flag is not a loop option, `Err` (one line naming the flag, the value and what
    /// is valid) when the value is invalid.
    pub fn flag(&mut self, flag: &str, value: &str) -> std::result::Result<bool, String> {
        match flag {
            "--bytes" => {
                let b: usize = value.parse().map_err(|_| {
                    format!("--bytes {value:?}: expected a positive multiple of 4 (bytes per all-reduce)")
                })?;
                if b == 0 || !b.is_multiple_of(4) {
                    return Err(format!(
                        "--bytes {b}: expected a positive multiple of 4 (the buffer is f32)"
                    ));
                }
                self.bytes = b;
            }
            "--iters" | "--seconds" if self.stop_given => {
                return Err(format!(
                    "{flag} {value}: give one of --iters K and --seconds S, once"
                ));
            }
            "--iters" => {
                let k: u64 = value
                    .parse()
                    .ok()
                    .filter(|k| *k > 0)
                    .ok_or_else(|| format!("--iters {value:?}: expected a positive integer"))?;
                self.stop = Stop::Iters(k);
                self.stop_given = true;
            }
            "--seconds" => {
                let s: f64 = value
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| {
                        format!("--seconds {value:?}: expected a positive number of seconds")
                    })?;
                self.stop = Stop::Seconds(s);
                self.stop_given = true;
            }
            "--timeout-ms" => {
                let t: u64 = value.parse().ok().filter(|t| *t > 0).ok_or_else(|| {
                    format!("--timeout-ms {value:?}: expected a positive number of milliseconds")
                })?;
                self.timeout_ms = t;
            }
            "--trace-dir" => {
                if value.is_empty() {
                    return Err("--trace-dir \"\": expected a directory".to_string());
                }
                self.trace_dir = Some(PathBuf::from(value));
            }
            "--fault" => {
                if self.fault.is_some() {
                    return Err(format!("--fault {value}: give --fault once"));
                }
                self.fault = Some(value.parse()?);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks what no single flag can: a `--fault` needs `--iters K` with its iteration below
    /// `K`. Call once every flag is taken; the error is one line naming the options.
    ///
    /// ```
    /// use grid_programs::smoke::LoopOptions;
    /// let mut o = LoopOptions::default();
    /// o.flag("--fault", "2:kill@100").unwrap();
    /// assert!(o.check().unwrap_err().contains("--iters 100"));
    /// o.flag("--iters", "200").unwrap();
    /// assert!(o.check().is_ok());
    /// ```
    pub fn check(&self) -> std::result::Result<(), String> {
        let Some(fault) = &self.fault else {
            return Ok(());
        };
        match self.stop {
            Stop::Iters(k) if fault.iter < k => Ok(()),
            Stop::Iters(k) => Err(format!(
                "--fault {fault}: iteration {} is not below --iters {k} (valid: 0..={})",
                fault.iter,
                k - 1
            )),
            Stop::Seconds(s) => Err(format!(
                "--fault {fault} with --seconds {s}: a fault needs --iters K (every rank must run the same, fixed iterations)"
            )),
        }
    }

    /// The options of a program whose command line holds nothing but loop options
    /// (`mpi-loop`, `nccl-loop`): `--flag value` pairs, checked ([`LoopOptions::check`]).
    /// `--help` or `-h`, an unknown flag or a flag without its value is an `Err` of one line
    /// that ends with `usage`.
    ///
    /// ```
    /// use grid_programs::smoke::LoopOptions;
    /// let args = ["--iters", "5"].map(String::from);
    /// assert!(LoopOptions::parse(args.into_iter(), "usage: x").is_ok());
    /// let e = LoopOptions::parse(["--bogus", "1"].map(String::from).into_iter(), "usage: x");
    /// assert_eq!(e.unwrap_err(), "unknown option \"--bogus\"; usage: x");
    /// ```
    pub fn parse(
        mut args: impl Iterator<Item = String>,
        usage: &str,
    ) -> std::result::Result<LoopOptions, String> {
        let mut options = LoopOptions::default();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(usage.to_string());
            }
            let value = args
                .next()
                .ok_or_else(|| format!("{flag} needs a value; {usage}"))?;
            if !options.flag(&flag, &value)? {
                return Err(format!("unknown option {flag:?}; {usage}"));
            }
        }
        options.check()?;
        Ok(options)
    }

    /// The time limit of one all-reduce.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Elements per all-reduce.
    pub fn elements(&self) -> usize {
        self.bytes / 4
    }
}

/// How a rank ended: the one JSON line it prints.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Outcome {
    /// The rank.
    pub rank: usize,
    /// All-reduces completed (and checked).
    pub completed: u64,
    /// The error that ended the loop, if any.
    pub error: Option<String>,
}

impl Outcome {
    /// `{"rank": R, "completed": N, "error": null | "<message>"}` on one line.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            // Serializing three plain fields cannot fail; keep the line well-formed anyway.
            format!(
                "{{\"rank\":{},\"completed\":{},\"error\":{:?}}}",
                self.rank,
                self.completed,
                e.to_string()
            )
        })
    }
}

/// What a fault does (the `KIND` of `--fault RANK:KIND@ITER`). Every rank is given the same
/// `--fault`; rank `RANK` is the faulty one, at iteration `ITER` (0 for the first all-reduce).
/// Where every rank does something else at that iteration (`root`, `long-send`), that
/// operation stands for the iteration's all-reduce, in `completed` too.
///
/// | kind | what happens at iteration `ITER` |
/// |---|---|
/// | `kill` | rank `RANK` sends itself SIGKILL before the all-reduce |
/// | `skip` | rank `RANK` leaves the all-reduce out and goes on with the next; when its loop ends it keeps its connections open for the timeout plus 2 s (a rank busy elsewhere), then ends with an error naming the fault |
/// | `count` | rank `RANK` all-reduces twice as many elements |
/// | `dtype` | rank `RANK` all-reduces i32 instead of f32 (same count, same bytes) |
/// | `op` | rank `RANK` reduces with max instead of sum |
/// | `root` | every rank broadcasts instead of all-reducing, from root 0, except rank `RANK`, which names root 1 |
/// | `long-send` | every rank exchanges with its pair instead of all-reducing (ranks 2i and 2i+1; `RANK` sends in its pair, the even rank in the others; an even world size is needed); rank `RANK` sends twice as many elements as its partner posted |
/// | `abort` | rank `RANK` stalls for the timeout without entering the all-reduce, then ends with an error naming the fault; every other rank is stuck in the all-reduce, and a second thread of each calls [`Communicator::abort`] on the world communicator after a third of the timeout |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `kill`.
    Kill,
    /// `skip`.
    Skip,
    /// `count`.
    Count,
    /// `dtype`.
    DType,
    /// `op`.
    Op,
    /// `root`.
    Root,
    /// `long-send`.
    LongSend,
    /// `abort`.
    Abort,
}

impl FaultKind {
    /// Every kind, in the order of the table above.
    pub const ALL: [FaultKind; 8] = [
        FaultKind::Kill,
        FaultKind::Skip,
        FaultKind::Count,
        FaultKind::DType,
        FaultKind::Op,
        FaultKind::Root,
        FaultKind::LongSend,
        FaultKind::Abort,
    ];

    /// The kind's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Skip => "skip",
            FaultKind::Count => "count",
            FaultKind::DType => "dtype",
            FaultKind::Op => "op",
            FaultKind::Root => "root",
            FaultKind::LongSend => "long-send",
            FaultKind::Abort => "abort",
        }
    }
}

/// A fault to inject, `--fault RANK:KIND@ITER`: a **testing aid** that makes one rank do what
/// a failing node or a buggy program would (see [`FaultKind`]), so that the failure handling
/// of a backend can be checked end to end with real processes. Needs `--iters K` with
/// `ITER < K` ([`LoopOptions::check`]) and `RANK` below the world size.
///
/// ```
/// use grid_programs::smoke::{Fault, FaultKind};
/// let f: Fault = "2:long-send@5".parse().unwrap();
/// assert_eq!((f.rank, f.kind, f.iter), (2, FaultKind::LongSend, 5));
/// assert_eq!(f.to_string(), "2:long-send@5");
/// let e = "2:crash@5".parse::<Fault>().unwrap_err();
/// assert!(e.contains("kill, skip, count, dtype, op, root, long-send, abort"), "{e}");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The faulty rank (world rank).
    pub rank: usize,
    /// What it does.
    pub kind: FaultKind,
    /// At which iteration (0-based: the number of all-reduces before it).
    pub iter: u64,
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Fault, String> {
        let kinds: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
        let bad = |why: String| {
            format!(
                "--fault {s:?}: {why}; expected RANK:KIND@ITER with KIND one of {}",
                kinds.join(", ")
            )
        };
        let (rank, rest) = s
            .split_once(':')
            .ok_or_else(|| bad("no ':' after the rank".into()))?;
        let (kind, iter) = rest
            .split_once('@')
            .ok_or_else(|| bad("no '@' before the iteration".into()))?;
        let rank = rank
            .parse()
            .map_err(|_| bad(format!("rank {rank:?} is not a rank number")))?;
        let kind = FaultKind::ALL
            .into_iter()
            .find(|k| k.name() == kind)
            .ok_or_else(|| bad(format!("unknown kind {kind:?}")))?;
        let iter = iter.parse().map_err(|_| {
            bad(format!(
                "iteration {iter:?} is not a number (0 for the first)"
            ))
        })?;
        Ok(Fault { rank, kind, iter })
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}@{}", self.rank, self.kind.name(), self.iter)
    }
}

/// How the loop calls its operations. Either way the communicator's time limit
/// ([`Communicator::set_time_limit`]) bounds every wait and `abort()` ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waits {
    /// Blocking calls (`gloo-loop`).
    Blocking,
    /// Every operation started nonblocking, then waited for (`mpi-loop`: MPI cannot take back
    /// a blocking collective that passed its limit and ends the job, while a nonblocking one
    /// returns [`Error::Timeout`] from its wait, so the rank can report it).
    Nonblocking,
}

/// The operations of the loop on one communicator, called as [`Waits`] says.
struct Exec<'a, C: ?Sized> {
    comm: &'a C,
    waits: Waits,
}

impl<C: Communicator + ?Sized> Exec<'_, C> {
    fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        match self.waits {
            Waits::Blocking => self.comm.all_reduce_into(send, recv, op),
            Waits::Nonblocking => {
                let out = self
                    .comm
                    .iall_reduce_into(send.to_vec(), recv.to_vec(), op)?
                    .wait()?;
                recv.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        match self.waits {
            Waits::Blocking => self.comm.broadcast_into(buf, root),
            Waits::Nonblocking => {
                let out = self.comm.ibroadcast(buf.to_vec(), root)?.wait()?;
                buf.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    fn send(&self, buf: &[f32], peer: usize) -> Result<()> {
        match self.waits {
            Waits::Blocking => self.comm.send_to(buf, peer, FAULT_TAG),
            Waits::Nonblocking => self
                .comm
                .isend(buf.to_vec(), peer, FAULT_TAG)?
                .wait()
                .map(|_| ()),
        }
    }

    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<()> {
        match self.waits {
            Waits::Blocking => self.comm.recv_from(buf, peer, FAULT_TAG),
            Waits::Nonblocking => {
                let out = self.comm.irecv::<f32>(buf.len(), peer, FAULT_TAG)?.wait()?;
                buf.copy_from_slice(&out);
                Ok(())
            }
        }
    }
}

/// The tag of the `long-send` fault's messages.
const FAULT_TAG: u32 = 7;

/// `Err` unless every element of `got` is `expected`.
fn check_values<T: PartialEq + std::fmt::Display + Copy>(
    what: &str,
    got: &[T],
    expected: T,
    why: &str,
) -> Result<()> {
    match got.iter().enumerate().find(|(_, v)| **v != expected) {
        None => Ok(()),
        Some((i, v)) => Err(Error::Invalid(format!(
            "{what} returned {v} at element {i}, expected {expected} ({why})"
        ))),
    }
}

/// Runs the loop on `comm`: f32 sum all-reduces of `options.bytes` bytes, each result checked
/// (rank `r` contributes `r + 1` in every element, so every element must be
/// `size·(size+1)/2`), with `options.fault` injected where it applies (see [`FaultKind`]).
/// `completed` counts the all-reduces done and checked, also when the loop ends by an error.
pub fn run_loop<C: Communicator + ?Sized>(
    comm: &C,
    options: &LoopOptions,
    waits: Waits,
    completed: &mut u64,
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let exec = Exec { comm, waits };
    let fault = options.fault;
    if let Some(f) = fault {
        if f.rank >= size || size < 2 {
            return Err(Error::Invalid(format!(
                "--fault {f}: rank {} is not a faulty rank of this world of {size} (valid: 0..{size}, and at least 2 ranks)",
                f.rank
            )));
        }
        if f.kind == FaultKind::LongSend && size % 2 != 0 {
            return Err(Error::Invalid(format!(
                "--fault {f}: long-send pairs the ranks (2i, 2i+1), which needs an even world size, not {size}"
            )));
        }
    }
    let n = options.elements();
    let send = vec![(rank + 1) as f32; n];
    let mut recv = vec![0f32; n];
    let expected = (size * (size + 1) / 2) as f32;
    let why = format!("the sum of 1..={size}");
    let start = Instant::now();
    let mut skipped = false;
    for iter in 0u64.. {
        if let Stop::Iters(k) = options.stop {
            if iter >= k {
                break;
            }
        }
        let what = format!("all-reduce {iter}");
        let here = fault.filter(|f| f.iter == iter);
        let mine = here.is_some_and(|f| f.rank == rank);
        recv.fill(0.0);
        match here.map(|f| f.kind) {
            Some(FaultKind::Kill) if mine => return kill_self(),
            Some(FaultKind::Skip) if mine => {
                skipped = true;
                continue;
            }
            Some(FaultKind::Count) if mine => {
                let send2 = vec![(rank + 1) as f32; 2 * n];
                let mut recv2 = vec![0f32; 2 * n];
                exec.all_reduce(&send2, &mut recv2, ReduceOp::Sum)?;
                check_values(&what, &recv2, expected, &why)?;
            }
            Some(FaultKind::DType) if mine => {
                let send_i = vec![(rank + 1) as i32; n];
                let mut recv_i = vec![0i32; n];
                exec.all_reduce(&send_i, &mut recv_i, ReduceOp::Sum)?;
                check_values(&what, &recv_i, (size * (size + 1) / 2) as i32, &why)?;
            }
            Some(FaultKind::Op) if mine => {
                exec.all_reduce(&send, &mut recv, ReduceOp::Max)?;
                check_values(&what, &recv, expected, &why)?;
            }
            Some(FaultKind::Root) => {
                let root = if mine { 1 } else { 0 };
                recv.copy_from_slice(&send);
                exec.broadcast(&mut recv, root)?;
                check_values(
                    &format!("broadcast {iter}"),
                    &recv,
                    1.0,
                    "the value of root 0",
                )?;
            }
            Some(FaultKind::LongSend) => {
                let faulty = here.map_or(0, |f| f.rank);
                let partner = rank ^ 1;
                let sender = if rank / 2 == faulty / 2 {
                    faulty
                } else {
                    rank & !1
                };
                if rank == sender {
                    let len = if mine { 2 * n } else { n };
                    exec.send(&vec![(rank + 1) as f32; len], partner)?;
                } else {
                    exec.recv(&mut recv, partner)?;
                    check_values(
                        &format!("receive {iter} from rank {partner}"),
                        &recv,
                        (partner + 1) as f32,
                        "the sender's value",
                    )?;
                }
            }
            Some(FaultKind::Abort) if mine => {
                std::thread::sleep(options.timeout());
                return Err(fault_error(
                    here,
                    "stalled for the timeout instead of entering all-reduce",
                ));
            }
            Some(FaultKind::Abort) => {
                let delay = options.timeout() / 3;
                std::thread::scope(|s| {
                    let (tx, rx) = std::sync::mpsc::channel::<()>();
                    s.spawn(move || {
                        // A watchdog: abort the world communicator unless the all-reduce
                        // finished first.
                        if rx.recv_timeout(delay) == Err(RecvTimeoutError::Timeout) {
                            comm.abort();
                        }
                    });
                    let r = exec.all_reduce(&send, &mut recv, ReduceOp::Sum);
                    drop(tx);
                    r
                })?;
                check_values(&what, &recv, expected, &why)?;
            }
            _ => {
                exec.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
                check_values(&what, &recv, expected, &why)?;
            }
        }
        *completed += 1;
        if let Stop::Seconds(s) = options.stop {
            // Every rank must stop after the same iteration: vote.
            let mine = [f32::from(start.elapsed().as_secs_f64() >= s)];
            let mut votes = [0f32];
            exec.all_reduce(&mine, &mut votes, ReduceOp::Sum)?;
            if votes[0] > 0.0 {
                break;
            }
        }
    }
    if skipped {
        // A rank still busy elsewhere: the others must find the missing call by their timeout.
        std::thread::sleep(options.timeout() + Duration::from_secs(2));
        return Err(fault_error(fault, "left out all-reduce"));
    }
    Ok(())
}

/// The error a faulty rank ends with.
fn fault_error(fault: Option<Fault>, what: &str) -> Error {
    match fault {
        Some(f) => Error::Invalid(format!(
            "fault injected (--fault {f}): rank {} {what} {}",
            f.rank, f.iter
        )),
        None => Error::Invalid(format!("fault injected: {what}")),
    }
}

/// `kill`: SIGKILL to this process (through `sh`'s `kill`, so no `unsafe` here). Returns only
/// if the signal could not be sent.
fn kill_self() -> Result<()> {
    let pid = std::process::id();
    let status = std::process::Command::new("sh")
        .args(["-c", &format!("kill -KILL {pid}")])
        .status()
        .map_err(|e| {
            Error::Invalid(format!(
                "--fault kill: cannot run sh to send SIGKILL to process {pid}: {e}"
            ))
        })?;
    // The signal is on its way (delivery is asynchronous); wait for it.
    std::thread::sleep(Duration::from_secs(5));
    Err(Error::Invalid(format!(
        "--fault kill: SIGKILL to process {pid} did not end it (sh exited with {status})"
    )))
}

/// `--trace-dir D`: makes the process's recorder ([`Recorder::set_global`]) record and dump
/// into `D`, keeping `GRID_TRACE_CAPACITY` (default [`grid_core::oplog::DEFAULT_CAPACITY`])
/// operations per communicator, as `world_rank` (`None`: the
/// first communicator created sets it). Must run before the first communicator is created.
pub fn install_trace_dir(dir: &Path, world_rank: Option<usize>) -> std::result::Result<(), String> {
    let failed = |e: grid_core::oplog::TraceError| format!("--trace-dir {}: {e}", dir.display());
    // A trace directory turns recording on, as `GRID_TRACE_DIR` does: `GRID_TRACE_CAPACITY`
    // if set (0 keeps it off), else the default capacity.
    let capacity = match std::env::var_os(grid_core::oplog::TRACE_CAPACITY_ENV) {
        Some(_) => Recorder::from_env().map_err(failed)?.capacity(),
        None => grid_core::oplog::DEFAULT_CAPACITY,
    };
    let recorder = if capacity > 0 {
        Recorder::new(Some(dir.to_path_buf()), capacity).map_err(failed)?
    } else {
        Recorder::off(Some(dir.to_path_buf()))
    };
    let recorder = Recorder::set_global(recorder).map_err(failed)?;
    if let Some(rank) = world_rank {
        recorder.set_world_rank(rank);
    }
    Ok(())
}

/// At the end of a rank that ended by `error`: writes its operation log (again, if an
/// operation that failed, an `abort()` or SIGUSR1 dumped it earlier), so that the file holds
/// every communicator's state when the rank gave up, dumped at that moment. The reason is the
/// front end's: `timeout`, `abort`, or `failure: <error>` (a failure to meet the others, a wrong
/// result, an injected fault). Returns a warning to print when the dump fails.
pub fn dump_after_error(error: &Error) -> Option<String> {
    let recorder = Recorder::global();
    recorder.trace_dir()?;
    let reason = match error {
        Error::Timeout { .. } => "timeout".to_string(),
        Error::Aborted { .. } | Error::Finalized { .. } => "abort".to_string(),
        other => format!("failure: {other}"),
    };
    recorder
        .dump(&reason)
        .err()
        .map(|e| format!("cannot dump the operation log: {e}"))
}
