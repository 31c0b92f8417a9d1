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
use grid_core::{Error, Result};
use std::path::{Path, PathBuf};
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
    stop_given: bool,
}

impl Default for LoopOptions {
    fn default() -> LoopOptions {
        LoopOptions {
            bytes: 1 << 20,
            stop: Stop::Iters(100),
            timeout_ms: 30_000,
            trace_dir: None,
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
            _ => return Ok(false),
        }
        Ok(true)
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

/// Runs the loop: f32 sum all-reduces of `options.bytes` bytes through `all_reduce(send,
/// recv)`, each result checked (rank `r` contributes `r + 1` in every element, so every element
/// must be `size·(size+1)/2`). `completed` counts the all-reduces done and checked, also when
/// the loop ends by an error.
pub fn run_loop(
    rank: usize,
    size: usize,
    options: &LoopOptions,
    completed: &mut u64,
    mut all_reduce: impl FnMut(&[f32], &mut [f32]) -> Result<()>,
) -> Result<()> {
    let n = options.elements();
    let send = vec![(rank + 1) as f32; n];
    let mut recv = vec![0f32; n];
    let expected = (size * (size + 1) / 2) as f32;
    let start = Instant::now();
    loop {
        if let Stop::Iters(k) = options.stop {
            if *completed >= k {
                return Ok(());
            }
        }
        recv.fill(0.0);
        all_reduce(&send, &mut recv)?;
        if let Some((i, v)) = recv.iter().enumerate().find(|(_, v)| **v != expected) {
            return Err(Error::Invalid(format!(
                "all-reduce {} returned {v} at element {i}, expected {expected} (the sum of 1..={size})",
                *completed
            )));
        }
        *completed += 1;
        if let Stop::Seconds(s) = options.stop {
            // Every rank must stop after the same iteration: vote.
            let mine = [f32::from(start.elapsed().as_secs_f64() >= s)];
            let mut votes = [0f32];
            all_reduce(&mine, &mut votes)?;
            if votes[0] > 0.0 {
                return Ok(());
            }
        }
    }
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

/// At the end of a rank that ended by an error: writes its operation log with `reason` unless
/// the front end already did (an operation that failed dumps by itself, with the more precise
/// reason). Covers a failure to meet the others, a wrong result and a program-side timeout.
/// Returns a warning to print when the dump fails.
pub fn dump_after_error(reason: &str) -> Option<String> {
    let recorder = Recorder::global();
    if recorder.trace_dir().is_none() || recorder.dumps_written() > 0 {
        return None;
    }
    recorder
        .dump(reason)
        .err()
        .map(|e| format!("cannot dump the operation log: {e}"))
}
