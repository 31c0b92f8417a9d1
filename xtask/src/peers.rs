//! `cargo xtask bench peers`: this project against the libraries a user would otherwise pick,
//! side by side in one sitting: mpi4py (over the same Open MPI) and torch.distributed's Gloo.
//!
//! 1. A virtual environment under the target directory (`target/peers-venv`) gets numpy and
//!    mpi4py, and torch from PyPI with only the CUDA runtime wheels `import torch` needs on a
//!    machine without a GPU ([`TORCH_WHEELS`]). A peer that cannot be installed is reported in
//!    one line; the rest is benchmarked.
//! 2. Per rank count, every job starts once and stays up: this project on MPI (`mpirun`), on
//!    Gloo as processes and as threads of one process (the `peer-bench` example), mpi4py
//!    (`mpirun`, `xtask/peers/peer_mpi4py.py`) and torch's Gloo (`xtask/peers/peer_torch.py`).
//!    Every rank connects to a Unix socket of this driver and waits, in a blocking read, for a
//!    command (`run OP BYTES WARMUP ITERS`); so an idle job takes no processor time, and the
//!    driver can alternate ours and the peer's at every size (the order flips from one size to
//!    the next, and with `--repeat` rotates from one run to the next: [`cell_order`]), letting
//!    load drifts and the place in a cell hit both sides.
//! 3. Statistic: every rank times every call after a barrier; per call the slowest rank's time
//!    (the max over ranks), then the median over calls ([`slowest_median`]).
//! 4. One table (op, backend, ranks, size, ours, peer, ratio = peer time / ours, > 1 means this
//!    project is faster) and a JSON file.

use crate::external::{build_example, External, Launch};
use crate::util::{target_dir, workspace_root, MPI_ENV};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const HELP: &str =
    "usage: cargo xtask bench peers [--quick] [--ranks 2,4] [--only mpi,gloo,groups] [--ops OPS]
                               [--sizes SIZES] [--repeat N] [--json PATH]

This project (MPI; Gloo as processes and as threads) against mpi4py and torch.distributed's Gloo,
interleaved in one sitting: all_reduce (out of place and in place), all_gather and reduce_scatter
(out of place and in place; torch has no in-place form of these two: its rows show none),
broadcast, 8 B to 64 MiB, at each rank count; and building the demo layout's communicators at
world 8 (build_collection against torch's new_group for every group, global and with
use_local_synchronization=True). The peers are installed into target/peers-venv.
--only runs some of the parts (default: all); --ops some of the collectives (all_reduce,
all_reduce_in_place, all_gather, all_gather_in_place, reduce_scatter, reduce_scatter_in_place,
broadcast; default: all); --sizes some sizes in bytes, with an optional KiB or MiB suffix
(e.g. 128KiB,2MiB; default: 8 B and every power of 4 up to 32 MiB, then 64 MiB); --repeat runs
the whole sitting N times in a row (default 1) and adds the run-to-run table: each row's ratio
in every run, and whether it was ahead (at or above 1 in every run), behind (below 1 in every
run) or even (on both sides of 1: within the noise); the tables of times are the last run's.
The jobs take turns in each cell, in an order reversed from one size to the next and rotated
from one run to the next, so over the runs every job measures in every place of a cell.
--json names the JSON file (default: target/peers.json; with --repeat, every run's ratio per
row).";

/// torch from PyPI, installed with `--no-deps`, and the CUDA runtime wheels its libraries load
/// when imported. The default PyPI wheel is the CUDA build: `libtorch_cuda.so` (loaded by
/// `libtorch.so` at `import torch`, GPU or not) has `DT_NEEDED` entries for cudart, cublas and
/// cublasLt, cufft, cufile, cusparse (which needs nvJitLink), cusparseLt, nccl, cudnn, nvrtc and
/// nvshmem (through `libtorch_nvshmem.so`), and `libtorch_cpu.so` for cupti; `readelf -d` on
/// torch 2.15.0's `torch/lib/*.so`. Left out, as `import torch` and Gloo work without them:
/// cusolver and the linear-algebra library that loads it lazily, nvtx, cccl (headers),
/// cuda-bindings, cuda-pathfinder, the cuda-toolkit meta package and triton.
pub const TORCH_WHEELS: &[&str] = &[
    "torch==2.15.0",
    "nvidia-cuda-runtime==13.2.86",
    "nvidia-cublas==13.4.1.3",
    "nvidia-cufft==12.2.0.57",
    "nvidia-cufile==1.17.1.22",
    "nvidia-cuda-cupti==13.2.86",
    "nvidia-cusparse==12.7.10.12",
    "nvidia-nvjitlink==13.5.37",
    "nvidia-cuda-nvrtc==13.2.86",
    "nvidia-cudnn-cu13==9.26.0.51",
    "nvidia-cusparselt-cu13==0.8.1",
    "nvidia-nccl-cu13==2.30.7",
    "nvidia-nvshmem-cu13==3.7.2",
];

/// torch's pure-Python requirements (its metadata's `Requires-Dist`, without the CUDA ones).
pub const TORCH_PURE_DEPS: &[&str] = &[
    "filelock",
    "typing-extensions>=4.13.0",
    "setuptools>=77.0.3",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    "fsspec>=0.8.5",
];

/// mpi4py and the array library its benchmark uses.
pub const MPI4PY_WHEELS: &[&str] = &["numpy", "mpi4py"];

/// The collectives, in table order: (command name, table name).
const OPS: &[(&str, &str)] = &[
    ("all_reduce", "all_reduce (out of place)"),
    ("all_reduce_in_place", "all_reduce (in place)"),
    ("all_gather", "all_gather"),
    ("all_gather_in_place", "all_gather (in place)"),
    ("reduce_scatter", "reduce_scatter"),
    ("reduce_scatter_in_place", "reduce_scatter (in place)"),
    ("broadcast", "broadcast"),
];

/// Group creation, in table order: (command name, table name).
const GROUP_OPS: &[(&str, &str)] = &[
    ("groups", "groups (global)"),
    ("groups_local", "groups (local sync)"),
];

/// The operations torch.distributed has no in-place form of: no torch job runs them, and their
/// Gloo rows name the peer [`NO_TORCH_PEER`] with no time and no ratio.
const NO_TORCH: &[&str] = &["all_gather_in_place", "reduce_scatter_in_place"];

/// The peer column of a Gloo row of an operation in [`NO_TORCH`].
const NO_TORCH_PEER: &str = "torch (has no in-place form)";

/// World size of the group-creation rows (the demo layout's).
const GROUPS_WORLD: usize = 8;

/// The longest a job may take to answer one command, or to start and connect.
const ANSWER_LIMIT: Duration = Duration::from_secs(300);

/// `peer-bench`, this project's side.
const PEER_BENCH: External = External {
    what: "bench peers",
    example: "peer-bench",
    launch: Launch::Direct,
};

/// The options.
#[derive(Debug, Clone, PartialEq)]
struct Options {
    quick: bool,
    ranks: Vec<usize>,
    json: Option<PathBuf>,
    /// Which parts run: `mpi`, `gloo`, `groups` (all three by default).
    parts: Vec<String>,
    /// The collectives measured (command names of [`OPS`]; all by default).
    ops: Vec<&'static str>,
    /// The sizes measured (`None`: [`sizes`]).
    sizes: Option<Vec<u64>>,
    /// How many times the whole sitting runs (`--repeat`).
    repeat: usize,
}

/// Most runs `--repeat` takes.
const REPEAT_MAX: usize = 20;

/// The parts of a run, for `--only`.
const PARTS: &[&str] = &["mpi", "gloo", "groups"];

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        quick: false,
        ranks: vec![2, 4],
        json: None,
        parts: PARTS.iter().map(|p| p.to_string()).collect(),
        ops: OPS.iter().map(|&(op, _)| op).collect(),
        sizes: None,
        repeat: 1,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--ranks" => {
                let v = it.next().ok_or("--ranks needs a value, e.g. 2,4")?;
                let mut ranks = Vec::new();
                for p in v.split(',') {
                    match p.trim().parse::<usize>() {
                        Ok(n) if (2..=64).contains(&n) => ranks.push(n),
                        _ => {
                            return Err(format!(
                                "--ranks {v:?}: {p:?} is not a rank count from 2 to 64 (e.g. --ranks 2,4)"
                            ))
                        }
                    }
                }
                o.ranks = ranks;
            }
            "--only" => {
                let v = it.next().ok_or("--only needs a value, e.g. mpi,groups")?;
                let mut parts = Vec::new();
                for p in v.split(',').map(str::trim) {
                    if !PARTS.contains(&p) {
                        return Err(format!(
                            "--only {v:?}: {p:?} is not a part; valid: {}",
                            PARTS.join(", ")
                        ));
                    }
                    parts.push(p.to_string());
                }
                o.parts = parts;
            }
            "--ops" => {
                let v = it
                    .next()
                    .ok_or("--ops needs a value, e.g. all_gather,broadcast")?;
                let mut ops = Vec::new();
                for p in v.split(',').map(str::trim) {
                    match OPS.iter().find(|&&(op, _)| op == p) {
                        Some(&(op, _)) => ops.push(op),
                        None => {
                            return Err(format!(
                                "--ops {v:?}: {p:?} is not a collective; valid: {}",
                                OPS.iter().map(|&(op, _)| op).collect::<Vec<_>>().join(", ")
                            ))
                        }
                    }
                }
                o.ops = ops;
            }
            "--sizes" => {
                let v = it.next().ok_or("--sizes needs a value, e.g. 128KiB,2MiB")?;
                let mut sizes = Vec::new();
                for p in v.split(',').map(str::trim) {
                    sizes.push(parse_size(p).ok_or_else(|| {
                        format!(
                            "--sizes {v:?}: {p:?} is not a size from 4 B to 1 GiB, a multiple of 4 \
                             (bytes, or with a KiB or MiB suffix: 8, 128KiB, 2MiB)"
                        )
                    })?);
                }
                o.sizes = Some(sizes);
            }
            "--repeat" => {
                let v = it.next().ok_or("--repeat needs a value, e.g. 3")?;
                o.repeat = match v.trim().parse::<usize>() {
                    Ok(n) if (1..=REPEAT_MAX).contains(&n) => n,
                    _ => {
                        return Err(format!(
                            "--repeat {v:?}: expected a number of runs from 1 to {REPEAT_MAX}"
                        ))
                    }
                };
            }
            "--json" => {
                let v = it.next().ok_or("--json needs a file path")?;
                o.json = Some(PathBuf::from(v));
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

/// One `--sizes` entry: bytes (bare or with a `B` suffix), or with a `KiB` or `MiB` suffix; a
/// multiple of 4 (whole f32s) from 4 B to 1 GiB.
fn parse_size(s: &str) -> Option<u64> {
    let (digits, unit) = match s {
        _ if s.ends_with("KiB") => (&s[..s.len() - 3], 1u64 << 10),
        _ if s.ends_with("MiB") => (&s[..s.len() - 3], 1 << 20),
        _ if s.ends_with('B') => (&s[..s.len() - 1], 1),
        _ => (s, 1),
    };
    let bytes = digits.trim().parse::<u64>().ok()?.checked_mul(unit)?;
    ((4..=1 << 30).contains(&bytes) && bytes % 4 == 0).then_some(bytes)
}

/// Sizes of a run: 8 B, then every power of 4 up to 32 MiB, then 64 MiB; `--quick`: four of
/// them.
fn sizes(quick: bool) -> Vec<u64> {
    if quick {
        return vec![8, 8 << 10, 2 << 20, 64 << 20];
    }
    let mut s: Vec<u64> = std::iter::successors(Some(8u64), |b| Some(b * 4))
        .take_while(|&b| b <= 32 << 20)
        .collect();
    s.push(64 << 20);
    s
}

/// (untimed, timed) calls per size.
fn iterations(bytes: u64, quick: bool) -> (usize, usize) {
    match (bytes, quick) {
        (b, false) if b <= 32 << 10 => (5, 50),
        (b, false) if b <= 512 << 10 => (3, 30),
        (b, false) if b <= 8 << 20 => (2, 12),
        (_, false) => (1, 7),
        (b, true) if b <= 32 << 10 => (3, 15),
        (b, true) if b <= 8 << 20 => (2, 7),
        (_, true) => (1, 3),
    }
}

/// The statistic of a cell: per call, the slowest rank's time (max over ranks), then the median
/// over calls (the upper middle one for an even count, as `grid_programs::stats::median`).
/// `None` without calls or when a rank has fewer calls than another.
pub fn slowest_median(per_rank: &[Vec<f64>]) -> Option<f64> {
    let calls = per_rank.first()?.len();
    if calls == 0
        || per_rank
            .iter()
            .any(|r| r.len() != calls || r.iter().any(|t| !t.is_finite()))
    {
        return None;
    }
    let mut slowest: Vec<f64> = (0..calls)
        .map(|k| per_rank.iter().map(|r| r[k]).fold(f64::MIN, f64::max))
        .collect();
    slowest.sort_by(f64::total_cmp);
    Some(slowest[calls / 2])
}

/// `8 B`, `32 KiB`, `64 MiB`.
fn size_label(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Seconds as `12.3 µs`, `4.56 ms` or `1.23 s` (three significant digits).
fn time_label(secs: f64) -> String {
    let (v, unit) = if secs < 1e-3 {
        (secs * 1e6, "µs")
    } else if secs < 1.0 {
        (secs * 1e3, "ms")
    } else {
        (secs, "s")
    };
    let decimals = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.decimals$} {unit}")
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Table name of the operation.
    pub op: String,
    /// This project's backend and how its ranks run (`mpi`, `gloo`, `gloo-threads`).
    pub backend: String,
    /// The peer (`mpi4py`, `torch`).
    pub peer: String,
    /// Ranks.
    pub ranks: usize,
    /// Bytes (nccl-tests' count); `None` for group creation.
    pub bytes: Option<u64>,
    /// Timed calls per side.
    pub calls: usize,
    /// This project's time in seconds, or why there is none.
    pub ours: Result<f64, String>,
    /// The peer's time in seconds, or why there is none.
    pub theirs: Result<f64, String>,
}

impl Row {
    /// Peer time / ours (> 1: this project is faster), when both were measured.
    pub fn ratio(&self) -> Option<f64> {
        match (&self.ours, &self.theirs) {
            (Ok(o), Ok(p)) if *o > 0.0 => Some(p / o),
            _ => None,
        }
    }
}

/// The Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| op | backend | ranks | size | ours | peer | ratio |\n|---|---|--:|--:|--:|--:|--:|\n",
    );
    for r in rows {
        let ours = r.ours.as_ref().map_or("—".to_string(), |t| time_label(*t));
        let peer = match &r.theirs {
            Ok(t) => format!("{} {}", r.peer, time_label(*t)),
            Err(_) => format!("{} —", r.peer),
        };
        let ratio = r.ratio().map_or("—".to_string(), |x| format!("{x:.2}×"));
        let size = r.bytes.map_or("—".to_string(), size_label);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.op, r.backend, r.ranks, size, ours, peer, ratio
        );
    }
    s
}

/// The ratios only, one row per (op, backend, ranks) and one column per size (in the order
/// the rows give them): the table to read first. Group creation has one `—` size column.
pub fn summary(rows: &[Row]) -> String {
    let mut sizes: Vec<Option<u64>> = Vec::new();
    let mut keys: Vec<(String, String, usize)> = Vec::new();
    for r in rows {
        if !sizes.contains(&r.bytes) {
            sizes.push(r.bytes);
        }
        let k = (r.op.clone(), format!("{} / {}", r.backend, r.peer), r.ranks);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut s = String::from("| op | ours / peer | ranks |");
    for b in &sizes {
        let _ = write!(s, " {} |", b.map_or("—".to_string(), size_label));
    }
    s.push_str("\n|---|---|--:|");
    s.push_str(&"--:|".repeat(sizes.len()));
    s.push('\n');
    for (op, pair, ranks) in &keys {
        let _ = write!(s, "| {op} | {pair} | {ranks} |");
        for b in &sizes {
            let cell = rows
                .iter()
                .find(|r| {
                    &r.op == op
                        && format!("{} / {}", r.backend, r.peer) == *pair
                        && r.ranks == *ranks
                        && r.bytes == *b
                })
                .map_or(String::new(), |r| {
                    r.ratio().map_or("—".to_string(), |x| format!("{x:.2}"))
                });
            let _ = write!(s, " {cell} |");
        }
        s.push('\n');
    }
    s
}

/// Where a row stands over the runs of a sitting ([`verdict`]); in the order of the run-to-run
/// table's columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The ratio at or above one in every run.
    Ahead,
    /// On both sides of one: within the run-to-run noise.
    Even,
    /// Below one in every run.
    Behind,
}

impl Verdict {
    /// The word in the tables and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Ahead => "ahead",
            Verdict::Even => "even",
            Verdict::Behind => "behind",
        }
    }
}

/// Whether a row was *ahead* in every run (ratio at or above one), *behind* in every run
/// (below one) or *even* (on both sides of one: within the run-to-run noise); `None` when no
/// run has a ratio.
pub fn verdict(ratios: &[Option<f64>]) -> Option<Verdict> {
    let r: Vec<f64> = ratios.iter().flatten().copied().collect();
    if r.is_empty() {
        None
    } else if r.iter().all(|&x| x >= 1.0) {
        Some(Verdict::Ahead)
    } else if r.iter().all(|&x| x < 1.0) {
        Some(Verdict::Behind)
    } else {
        Some(Verdict::Even)
    }
}

/// What a row measures: the same in every run of a sitting.
fn row_key(r: &Row) -> (&str, &str, &str, usize, Option<u64>) {
    (&r.op, &r.backend, &r.peer, r.ranks, r.bytes)
}

/// For each row of the last run, its ratio in every run, in run order (`None` where a run has
/// no ratio for it).
pub fn ratios_by_row(runs: &[Vec<Row>]) -> Vec<Vec<Option<f64>>> {
    let Some(last) = runs.last() else {
        return Vec::new();
    };
    // Each run's ratios by what its rows measure (the first row of a key, as a search would).
    let by_key: Vec<HashMap<_, Option<f64>>> = runs
        .iter()
        .map(|run| {
            let mut m = HashMap::with_capacity(run.len());
            for x in run {
                m.entry(row_key(x)).or_insert_with(|| x.ratio());
            }
            m
        })
        .collect();
    last.iter()
        .map(|row| {
            by_key
                .iter()
                .map(|m| m.get(&row_key(row)).copied().flatten())
                .collect()
        })
        .collect()
}

/// The run-to-run tables of a repeated sitting, from its last run's `rows` and their `ratios`
/// in every run ([`ratios_by_row`]): per pair of libraries and rank count, how many rows were
/// ahead, even and behind ([`verdict`]); then every row that was not ahead in every run, with
/// its ratio in each run.
pub fn run_to_run(rows: &[Row], ratios: &[Vec<Option<f64>>]) -> String {
    let runs = ratios.first().map_or(0, Vec::len);
    let mut s = format!(
        "A row is *ahead* when its ratio is at or above 1 in every one of the {runs} runs, *behind* \
         when it is below 1 in every run, and *even* when its runs fall on both sides of 1 (the \
         difference is within the run-to-run noise).\n\n"
    );
    let mut parts: Vec<((String, usize), [usize; 3])> = Vec::new();
    for (r, v) in rows.iter().zip(ratios) {
        let Some(verdict) = verdict(v) else { continue };
        let key = (format!("{} / {}", r.backend, r.peer), r.ranks);
        let at = match parts.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                parts.push((key, [0; 3]));
                parts.len() - 1
            }
        };
        parts[at].1[verdict as usize] += 1;
    }
    s.push_str("| ours / peer | ranks | ahead | even | behind |\n|---|--:|--:|--:|--:|\n");
    for ((pair, ranks), [ahead, even, behind]) in &parts {
        let _ = writeln!(s, "| {pair} | {ranks} | {ahead} | {even} | {behind} |");
    }
    let not_ahead: Vec<(&Row, &Vec<Option<f64>>, Verdict)> = rows
        .iter()
        .zip(ratios)
        .filter_map(|(r, v)| Some((r, v, verdict(v).filter(|&v| v != Verdict::Ahead)?)))
        .collect();
    if not_ahead.is_empty() {
        s.push_str("\nEvery row with a ratio was ahead in every run.\n");
        return s;
    }
    s.push_str(
        "\nRows not ahead in every run:\n\n| op | ours / peer | ranks | size | ratio in each run | verdict |\n|---|---|--:|--:|---|---|\n",
    );
    for (r, v, verdict) in not_ahead {
        let each: Vec<String> = v
            .iter()
            .map(|x| x.map_or("—".to_string(), |x| format!("{x:.2}")))
            .collect();
        let _ = writeln!(
            s,
            "| {} | {} / {} | {} | {} | {} | {} |",
            r.op,
            r.backend,
            r.peer,
            r.ranks,
            r.bytes.map_or("—".to_string(), size_label),
            each.join(", "),
            verdict.name()
        );
    }
    s
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number, or `null` for a value JSON cannot hold.
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:e}")
    } else {
        "null".into()
    }
}

/// The run's JSON: `meta` (string fields) and one object per row, times in seconds; with the
/// row's ratio in each run of the sitting (`ratios`, one list per row, [`ratios_by_row`]) and,
/// over two or more runs, its [`verdict`].
pub fn to_json(meta: &[(&str, String)], rows: &[Row], ratios: &[Vec<Option<f64>>]) -> String {
    let mut s = String::from("{\n");
    for (k, v) in meta {
        let _ = writeln!(s, "  {}: {},", json_str(k), json_str(v));
    }
    s.push_str("  \"rows\": [\n");
    for (i, r) in rows.iter().enumerate() {
        let side = |t: &Result<f64, String>| match t {
            Ok(x) => (json_num(*x), "null".to_string()),
            Err(e) => ("null".to_string(), json_str(e)),
        };
        let (ours, ours_err) = side(&r.ours);
        let (peer, peer_err) = side(&r.theirs);
        let runs = ratios.get(i).map_or(&[][..], Vec::as_slice);
        let each: Vec<String> = runs
            .iter()
            .map(|x| x.map_or("null".into(), json_num))
            .collect();
        let verdict = match verdict(runs) {
            Some(v) if runs.len() > 1 => json_str(v.name()),
            _ => "null".into(),
        };
        let _ = write!(
            s,
            "    {{\"op\": {}, \"backend\": {}, \"peer\": {}, \"ranks\": {}, \"bytes\": {}, \"calls\": {}, \"ours_s\": {ours}, \"peer_s\": {peer}, \"ratio\": {}, \"ours_error\": {ours_err}, \"peer_error\": {peer_err}, \"ratios\": [{}], \"verdict\": {verdict}}}",
            json_str(&r.op),
            json_str(&r.backend),
            json_str(&r.peer),
            r.ranks,
            r.bytes.map_or("null".into(), |b| b.to_string()),
            r.calls,
            r.ratio().map_or("null".into(), json_num),
            each.join(", "),
        );
        s.push_str(if i + 1 < rows.len() { ",\n" } else { "\n" });
    }
    s.push_str("  ]\n}\n");
    s
}

// ---- installing the peers ------------------------------------------------------------------

/// What could be installed: the venv's python, and per peer its version or why not.
struct Peers {
    python: Option<PathBuf>,
    mpi4py: Result<String, String>,
    torch: Result<String, String>,
}

/// Runs `cmd` quietly, its output appended to `log`; `Err(last line)` on failure.
fn quiet(cmd: &mut Command, log: &Path) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        let _ = f.write_all(&out.stdout);
        let _ = f.write_all(&out.stderr);
    }
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        let err = text(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message")
            .to_string();
        Err(format!("{} ({last})", out.status))
    }
}

/// The version a module reports, when it imports.
fn probe(python: &Path, code: &str, log: &Path) -> Result<String, String> {
    quiet(Command::new(python).args(["-c", code]), log)
}

fn setup_peers(log: &Path) -> Peers {
    let venv = target_dir().join("peers-venv");
    let python = venv.join("bin/python");
    let none = |why: String| Peers {
        python: None,
        mpi4py: Err(why.clone()),
        torch: Err(why),
    };
    if !python.is_file() {
        eprintln!("peers: creating {}", venv.display());
        if let Err(e) = quiet(Command::new("python3").args(["-m", "venv"]).arg(&venv), log) {
            let why = format!("cannot create a virtual environment with `python3 -m venv`: {e}");
            eprintln!("peers: {why}; benchmarking this project alone");
            return none(why);
        }
    }
    let pip = |args: &[&str]| {
        quiet(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(args),
            log,
        )
    };
    const MPI4PY_PROBE: &str =
        "import numpy, mpi4py; from mpi4py import MPI; print(mpi4py.__version__)";
    const TORCH_PROBE: &str = "import torch, torch.distributed as d; assert d.is_gloo_available(), 'no Gloo'; print(torch.__version__)";
    let mpi4py = probe(&python, MPI4PY_PROBE, log).or_else(|_| {
        eprintln!("peers: installing {} (pip)", MPI4PY_WHEELS.join(" "));
        pip(MPI4PY_WHEELS).and_then(|_| probe(&python, MPI4PY_PROBE, log))
    });
    let torch = probe(&python, TORCH_PROBE, log).or_else(|_| {
        eprintln!(
            "peers: installing {} with only the CUDA runtime wheels `import torch` needs (pip, --no-deps)",
            TORCH_WHEELS[0]
        );
        let mut no_deps = vec!["--no-deps"];
        no_deps.extend_from_slice(TORCH_WHEELS);
        pip(&no_deps)
            .and_then(|_| pip(TORCH_PURE_DEPS))
            .and_then(|_| probe(&python, TORCH_PROBE, log))
    });
    for (name, r) in [("mpi4py", &mpi4py), ("torch", &torch)] {
        match r {
            Ok(v) => eprintln!("peers: {name} {v}"),
            Err(e) => eprintln!(
                "peers: {name} cannot be installed or imported: {e} (log {}); benchmarking the rest",
                log.display()
            ),
        }
    }
    Peers {
        python: Some(python),
        mpi4py,
        torch,
    }
}

// ---- jobs ----------------------------------------------------------------------------------

/// One running job: its processes and one socket per rank, in rank order.
struct Job {
    name: String,
    children: Vec<Child>,
    ranks: Vec<(BufReader<UnixStream>, UnixStream)>,
    log: PathBuf,
}

/// The last lines of a log, for an error message.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(3);
    lines[start..].join(" | ")
}

impl Job {
    /// Starts `commands` (their output goes to `log`) and waits until `n` ranks have connected
    /// to `socket` and said hello.
    fn start(
        name: &str,
        log: PathBuf,
        socket: &Path,
        n: usize,
        commands: Vec<Command>,
    ) -> Result<Job, String> {
        let listener = UnixListener::bind(socket)
            .map_err(|e| format!("{name}: cannot listen on {}: {e}", socket.display()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("{name}: {e}"))?;
        let mut job = Job {
            name: name.to_string(),
            children: Vec::new(),
            ranks: Vec::new(),
            log: log.clone(),
        };
        File::create(&log).map_err(|e| format!("{name}: cannot write {}: {e}", log.display()))?;
        for mut cmd in commands {
            // Every process appends to the same log.
            let f = std::fs::OpenOptions::new()
                .append(true)
                .open(&log)
                .map_err(|e| format!("{name}: cannot write {}: {e}", log.display()))?;
            let f2 = f.try_clone().map_err(|e| format!("{name}: {e}"))?;
            cmd.stdin(Stdio::null()).stdout(f).stderr(f2);
            let child = cmd
                .spawn()
                .map_err(|e| format!("{name}: cannot start {:?}: {e}", cmd.get_program()))?;
            job.children.push(child);
        }
        let deadline = Instant::now() + ANSWER_LIMIT;
        let mut hello: Vec<Option<(BufReader<UnixStream>, UnixStream)>> =
            (0..n).map(|_| None).collect();
        let mut connected = 0;
        while connected < n {
            match listener.accept() {
                Ok((stream, _)) => {
                    let (rank, pair) = job.greet(stream, n)?;
                    if hello[rank].is_some() {
                        return Err(format!("{name}: rank {rank} connected twice"));
                    }
                    hello[rank] = Some(pair);
                    connected += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    for c in &mut job.children {
                        if let Ok(Some(status)) = c.try_wait() {
                            return Err(format!(
                                "{name}: a process ended ({status}) before every rank connected: {}",
                                tail(&log)
                            ));
                        }
                    }
                    if Instant::now() > deadline {
                        return Err(format!(
                            "{name}: {connected} of {n} ranks connected within {} s: {}",
                            ANSWER_LIMIT.as_secs(),
                            tail(&log)
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("{name}: accepting a rank: {e}")),
            }
        }
        job.ranks = hello.into_iter().flatten().collect();
        Ok(job)
    }

    /// Reads `hello RANK SIZE` from a new connection.
    #[allow(clippy::type_complexity)]
    fn greet(
        &self,
        stream: UnixStream,
        n: usize,
    ) -> Result<(usize, (BufReader<UnixStream>, UnixStream)), String> {
        let name = &self.name;
        let e = |e: std::io::Error| format!("{name}: a rank's socket: {e}");
        stream.set_nonblocking(false).map_err(e)?;
        stream.set_read_timeout(Some(ANSWER_LIMIT)).map_err(e)?;
        let write = stream.try_clone().map_err(e)?;
        let mut read = BufReader::new(stream);
        let mut line = String::new();
        read.read_line(&mut line).map_err(e)?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["hello", r, s] => match (r.parse::<usize>(), s.parse::<usize>()) {
                (Ok(r), Ok(s)) if s == n && r < n => Ok((r, (read, write))),
                _ => Err(format!(
                    "{name}: a rank said {:?}; expected hello RANK {n} with RANK below {n}",
                    line.trim()
                )),
            },
            _ => Err(format!(
                "{name}: a rank said {:?} instead of hello RANK SIZE",
                line.trim()
            )),
        }
    }

    /// Sends one command to every rank and reads every rank's seconds.
    fn run(
        &mut self,
        op: &str,
        bytes: u64,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<Vec<f64>>, String> {
        let name = self.name.clone();
        let cmd = format!("run {op} {bytes} {warmup} {iters}\n");
        for (rank, (_, w)) in self.ranks.iter_mut().enumerate() {
            w.write_all(cmd.as_bytes())
                .map_err(|e| format!("{name}: rank {rank}: {e}"))?;
        }
        let mut all = Vec::new();
        let mut first_err = None;
        for (rank, (r, _)) in self.ranks.iter_mut().enumerate() {
            let mut line = String::new();
            match r.read_line(&mut line) {
                Ok(0) => {
                    return Err(format!(
                        "{name}: rank {rank} went away: {}",
                        tail(&self.log)
                    ))
                }
                Ok(_) => {}
                Err(e) => {
                    return Err(format!(
                        "{name}: rank {rank} did not answer {op} of {bytes} bytes: {e}"
                    ))
                }
            }
            let line = line.trim();
            if let Some(times) = line.strip_prefix("ok") {
                let t: Result<Vec<f64>, _> = times.split_whitespace().map(str::parse).collect();
                match t {
                    Ok(t) if t.len() == iters => all.push(t),
                    _ => {
                        first_err.get_or_insert(format!("{name}: rank {rank} answered {line:?}"));
                    }
                }
            } else {
                first_err.get_or_insert(format!("{name}: {}", line.trim_start_matches("err ")));
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(all),
        }
    }

    /// Asks every rank to end and waits for the processes (killing what is left after a while).
    fn quit(mut self) {
        for (_, w) in &mut self.ranks {
            let _ = w.write_all(b"quit\n");
        }
        self.reap();
    }

    fn reap(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for c in &mut self.children {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        self.children.clear();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // A job given up on (an error) is ended by its process ids: only what we started.
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A job's slot: running, or why not.
type Slot = Result<Job, String>;

/// The commands of one job, by kind.
struct Launcher {
    exe: PathBuf,
    python: Option<PathBuf>,
    peers_dir: PathBuf,
    dir: PathBuf,
    /// Jobs started so far: each job's socket, store and log are its own (`NAME.K.sock`), so
    /// that a job of a later sitting (`--repeat`) never meets an earlier one's files.
    started: std::cell::Cell<usize>,
}

impl Launcher {
    fn mpirun(&self, n: usize, program: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("mpirun");
        c.args(["-np", &n.to_string(), "--timeout", "1800"])
            .arg(program)
            .args(args);
        for (k, v) in MPI_ENV {
            c.env(k, v);
        }
        c
    }

    /// Starts job `kind` at `n` ranks: `ours-mpi`, `ours-gloo`, `ours-gloo-threads`, `mpi4py`,
    /// `torch`.
    fn start(&self, kind: &str, n: usize) -> Slot {
        let name = format!("{kind}-{n}");
        let k = self.started.get() + 1;
        self.started.set(k);
        let socket = self.dir.join(format!("{name}.{k}.sock"));
        let sock = socket.to_string_lossy().into_owned();
        let python = || {
            self.python
                .clone()
                .ok_or_else(|| "no Python environment".to_string())
        };
        let store = self.dir.join(format!("{name}.{k}.store"));
        let commands = match kind {
            "ours-mpi" => vec![self.mpirun(
                n,
                &self.exe,
                &["serve", "--backend", "mpi", "--connect", &sock],
            )],
            "ours-gloo" => {
                std::fs::create_dir_all(&store).map_err(|e| format!("{name}: {e}"))?;
                (0..n)
                    .map(|r| {
                        let mut c = Command::new(&self.exe);
                        c.args(["serve", "--backend", "gloo", "--connect", &sock])
                            .args(["--rank", &r.to_string(), "--world-size", &n.to_string()])
                            .arg("--store")
                            .arg(&store);
                        c
                    })
                    .collect()
            }
            "ours-gloo-threads" => {
                let mut c = Command::new(&self.exe);
                c.args(["serve", "--backend", "gloo-threads", "--connect", &sock])
                    .args(["--world-size", &n.to_string()]);
                vec![c]
            }
            "mpi4py" => {
                let py = python()?;
                let script = self.peers_dir.join("peer_mpi4py.py");
                let mut c = self.mpirun(n, &py, &[]);
                c.arg(&script).args(["--connect", &sock]);
                vec![c]
            }
            "torch" => {
                let py = python()?;
                let groups = self.dir.join("groups.json");
                (0..n)
                    .map(|r| {
                        let mut c = Command::new(&py);
                        c.arg(self.peers_dir.join("peer_torch.py"))
                            .args(["--connect", &sock])
                            .args(["--rank", &r.to_string(), "--world-size", &n.to_string()])
                            .arg("--store")
                            .arg(&store)
                            .arg("--groups")
                            .arg(&groups)
                            // Loopback, as this project's Gloo.
                            .env("GLOO_SOCKET_IFNAME", "lo");
                        c
                    })
                    .collect()
            }
            other => return Err(format!("unknown job {other}")),
        };
        let log = self.dir.join(format!("{name}.{k}.log"));
        Job::start(&name, log, &socket, n, commands)
    }
}

/// Runs one measurement on a slot; a failed job is ended and its slot keeps the reason.
fn measure(
    slot: &mut Slot,
    op: &str,
    bytes: u64,
    warmup: usize,
    iters: usize,
) -> Result<f64, String> {
    let job = match slot {
        Ok(j) => j,
        Err(e) => return Err(e.clone()),
    };
    // Every job starts on a settled machine: the job measured just before may still have
    // threads finishing their work for a few milliseconds (seen after torch's Gloo: the next
    // job's 128 KiB all-reduce took 3.7-4.1 ms where it took 0.3 ms after a job of this
    // project), and the order of jobs flips from cell to cell, so without a pause each job
    // pays for its predecessor in every other cell.
    std::thread::sleep(SETTLE);
    match job.run(op, bytes, warmup, iters) {
        Ok(per_rank) => slowest_median(&per_rank)
            .ok_or_else(|| format!("{}: no complete set of timings", job.name)),
        Err(e) => {
            eprintln!("peers: {e}; leaving that job out from here on");
            *slot = Err(e.clone());
            Err(e)
        }
    }
}

/// The order in which `jobs` jobs measure cell `cell` (0, 1, ... within a backend's jobs) of run
/// `run` (0, 1, ... of `--repeat`): the jobs in their order, rotated left by `run`, and reversed
/// in every other cell. The reversal lets a load drift hit both sides within a run; the rotation
/// moves every job through every place over the runs: without it a cell's order was the same in
/// every run (with the Gloo jobs torch always measured second, between this project's two), so
/// whatever the place costs (the job before it still finishing, the caches it left) fell on the
/// same side of a row in every run and repeating could not show it.
fn cell_order(jobs: usize, cell: usize, run: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..jobs).collect();
    if jobs > 0 {
        order.rotate_left(run % jobs);
    }
    if cell % 2 == 1 {
        order.reverse();
    }
    order
}

/// The pause before each job's cell ([`measure`]).
const SETTLE: std::time::Duration = std::time::Duration::from_millis(30);

/// (row backend, our job kind, peer name, peer job kind) at every rank count.
const PAIRS: &[(&str, &str, &str, &str)] = &[
    ("mpi", "ours-mpi", "mpi4py", "mpi4py"),
    ("gloo", "ours-gloo", "torch", "torch"),
    ("gloo-threads", "ours-gloo-threads", "torch", "torch"),
];

fn date_utc() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

pub fn main(args: &[String]) -> i32 {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{HELP}");
        return 0;
    }
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("xtask bench peers: {e}\n\n{HELP}");
            return 2;
        }
    };
    let Some(exe) = build_example(&PEER_BENCH) else {
        return 1;
    };
    let exe = workspace_root().join(exe);
    let dir = std::env::temp_dir().join(format!("grid-peers-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("xtask bench peers: cannot create {}: {e}", dir.display());
        return 1;
    }
    let code = run_all(&o, &exe, &dir);
    if code == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("peers: logs kept in {}", dir.display());
    }
    code
}

/// One sitting: every part of `o` measured once (each backend's jobs at each rank count, then
/// group creation), the rows in the table's order. `start` starts a job; `started` is when the
/// whole command began (for the progress lines).
fn sitting(
    o: &Options,
    run: usize,
    start: &dyn Fn(&str, usize) -> Slot,
    started: Instant,
) -> Vec<Row> {
    let sizes = o.sizes.clone().unwrap_or_else(|| sizes(o.quick));
    // Each backend's jobs run alone (this project's and its peer's, started for the rank count
    // and quit before the next backend's start): an idle job is not idle (libgloo's event-loop
    // threads wake about 100 times a second each), and on a 2-core machine this project's
    // 4-rank MPI broadcast of 128 B took 5.6-6.0 us beside the idle Gloo jobs and 0.9-1.6 us
    // with the MPI jobs alone (docs/performance.md). Rows are printed in the same order as
    // before: by rank count, operation, size, then backend.
    let mut backends: Vec<&[&str]> = Vec::new();
    if o.parts.iter().any(|p| p == "mpi") {
        backends.push(&["ours-mpi", "mpi4py"]);
    }
    if o.parts.iter().any(|p| p == "gloo") {
        backends.push(&["ours-gloo", "torch", "ours-gloo-threads"]);
    }
    let ops: Vec<(usize, &str, &str)> = OPS
        .iter()
        .enumerate()
        .filter(|(_, (op, _))| o.ops.contains(op))
        .map(|(i, &(op, label))| (i, op, label))
        .collect();
    // Each row with its (rank count, operation, size, pair) indices, for the table's order.
    let mut keyed: Vec<((usize, usize, usize, usize), Row)> = Vec::new();
    for (rank_index, &n) in o.ranks.iter().enumerate() {
        for kinds in &backends {
            eprintln!(
                "peers: {n} ranks, {} ({:.0} s so far)",
                kinds.join(", "),
                started.elapsed().as_secs_f64()
            );
            let rows = backend_rows(kinds, n, &ops, &sizes, (o.quick, run), start);
            keyed.extend(
                rows.into_iter()
                    .map(|((op, size, pair), row)| ((rank_index, op, size, pair), row)),
            );
        }
    }
    keyed.sort_by_key(|(key, _)| *key);
    let mut rows: Vec<Row> = keyed.into_iter().map(|(_, row)| row).collect();
    if o.parts.iter().any(|p| p == "groups") {
        // Group creation at world 8: build_collection against torch's new_group.
        eprintln!(
            "peers: group creation at world {GROUPS_WORLD} ({:.0} s so far)",
            started.elapsed().as_secs_f64()
        );
        let kinds = ["ours-gloo", "torch", "ours-gloo-threads"];
        let mut slots: Vec<Slot> = kinds.iter().map(|k| start(k, GROUPS_WORLD)).collect();
        let (warmup, iters) = if o.quick { (1, 3) } else { (1, 7) };
        for (c, &(op, label)) in GROUP_OPS.iter().enumerate() {
            let mut t: Vec<Result<f64, String>> = vec![Err(String::new()); kinds.len()];
            for i in cell_order(kinds.len(), c, run) {
                t[i] = measure(&mut slots[i], op, 0, warmup, iters);
            }
            for (backend, ours) in [("gloo", 0), ("gloo-threads", 2)] {
                rows.push(Row {
                    op: label.to_string(),
                    backend: backend.to_string(),
                    peer: "torch".to_string(),
                    ranks: GROUPS_WORLD,
                    bytes: None,
                    calls: iters,
                    ours: t[ours].clone(),
                    theirs: t[1].clone(),
                });
            }
        }
        for s in slots.into_iter().flatten() {
            s.quit();
        }
    }
    rows
}

/// The rows of one backend's jobs at `n` ranks (`kinds`: this project's and its peer's): the
/// jobs started alone, every operation of `ops` ((index in [`OPS`], name, label)) and size
/// measured by each job in turn ([`cell_order`] for cell after cell of run `run`), then the
/// jobs quit. Each row comes with its (operation, size, pair) indices.
fn backend_rows(
    kinds: &[&str],
    n: usize,
    ops: &[(usize, &str, &str)],
    sizes: &[u64],
    (quick, run): (bool, usize),
    start: &dyn Fn(&str, usize) -> Slot,
) -> Vec<((usize, usize, usize), Row)> {
    let mut rows = Vec::new();
    let mut slots: Vec<Slot> = kinds.iter().map(|k| start(k, n)).collect();
    let slot_of = |k: &str| kinds.iter().position(|x| *x == k);
    let mut cell = 0usize;
    for &(op_index, op, label) in ops {
        for (size_index, &bytes) in sizes.iter().enumerate() {
            let (warmup, iters) = iterations(bytes, quick);
            let order = cell_order(kinds.len(), cell, run);
            cell += 1;
            let mut t: Vec<Result<f64, String>> = vec![Err(String::new()); kinds.len()];
            let no_torch = NO_TORCH.contains(&op);
            for i in order {
                t[i] = if no_torch && kinds[i] == "torch" {
                    Err("torch.distributed has no in-place form of this operation".into())
                } else {
                    measure(&mut slots[i], op, bytes, warmup, iters)
                };
            }
            for (pair, &(backend, ours, peer, theirs)) in PAIRS.iter().enumerate() {
                let (Some(ours), Some(theirs)) = (slot_of(ours), slot_of(theirs)) else {
                    continue;
                };
                let peer = if no_torch && peer == "torch" {
                    NO_TORCH_PEER
                } else {
                    peer
                };
                let row = Row {
                    op: label.to_string(),
                    backend: backend.to_string(),
                    peer: peer.to_string(),
                    ranks: n,
                    bytes: Some(bytes),
                    calls: iters,
                    ours: t[ours].clone(),
                    theirs: t[theirs].clone(),
                };
                rows.push(((op_index, size_index, pair), row));
            }
        }
    }
    for s in slots.into_iter().flatten() {
        s.quit();
    }
    rows
}

fn run_all(o: &Options, exe: &Path, dir: &Path) -> i32 {
    let started = Instant::now();
    // Kept after the run (the temporary directory is removed): the place to look when a peer
    // could not be installed.
    let peers = setup_peers(&target_dir().join("peers-pip.log"));
    // The groups torch creates: the same plan build_collection builds.
    let groups = Command::new(exe)
        .args(["groups", "--world-size", &GROUPS_WORLD.to_string()])
        .output();
    match groups {
        Ok(out) if out.status.success() => {
            if let Err(e) = std::fs::write(dir.join("groups.json"), &out.stdout) {
                eprintln!("xtask bench peers: cannot write the group list: {e}");
                return 1;
            }
        }
        Ok(out) => {
            eprintln!(
                "xtask bench peers: peer-bench groups failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return 1;
        }
        Err(e) => {
            eprintln!("xtask bench peers: cannot run {}: {e}", exe.display());
            return 1;
        }
    }
    let launcher = Launcher {
        exe: exe.to_path_buf(),
        python: peers.python.clone(),
        peers_dir: workspace_root().join("xtask/peers"),
        dir: dir.to_path_buf(),
        started: std::cell::Cell::new(0),
    };
    let load_before = load_average();
    let date = date_utc();
    let peer_ok = |kind: &str| -> Result<(), String> {
        match kind {
            "mpi4py" => peers
                .mpi4py
                .as_ref()
                .map(|_| ())
                .map_err(|e| format!("mpi4py not installed: {e}")),
            "torch" => peers
                .torch
                .as_ref()
                .map(|_| ())
                .map_err(|e| format!("torch not installed: {e}")),
            _ => Ok(()),
        }
    };
    let start = |kind: &str, n: usize| -> Slot {
        peer_ok(kind)?;
        let s = launcher.start(kind, n);
        if let Err(e) = &s {
            eprintln!("peers: {e}");
        }
        s
    };
    let mut runs: Vec<Vec<Row>> = Vec::with_capacity(o.repeat);
    for run in 0..o.repeat {
        if o.repeat > 1 {
            eprintln!(
                "peers: run {} of {} ({:.0} s so far)",
                run + 1,
                o.repeat,
                started.elapsed().as_secs_f64()
            );
        }
        runs.push(sitting(o, run, &start, started));
    }
    let ratios = ratios_by_row(&runs);
    let rows = runs.last().cloned().unwrap_or_default();
    let load_after = load_average();
    let elapsed = started.elapsed().as_secs_f64();
    let only = if o.parts.len() == PARTS.len() {
        String::new()
    } else {
        format!(" --only {}", o.parts.join(","))
    };
    let ops = if o.ops.len() == OPS.len() {
        String::new()
    } else {
        format!(" --ops {}", o.ops.join(","))
    };
    let sizes_arg = o.sizes.as_ref().map_or(String::new(), |s| {
        let labels: Vec<String> = s.iter().map(|&b| size_label(b).replace(' ', "")).collect();
        format!(" --sizes {}", labels.join(","))
    });
    let repeat = if o.repeat > 1 {
        format!(" --repeat {}", o.repeat)
    } else {
        String::new()
    };
    let command = format!(
        "cargo xtask bench peers{}{only}{ops}{sizes_arg}{repeat}{}",
        if o.quick { " --quick" } else { "" },
        if o.ranks == [2, 4] {
            String::new()
        } else {
            format!(
                " --ranks {}",
                o.ranks
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
    );
    let version =
        |r: &Result<String, String>| r.clone().unwrap_or_else(|e| format!("not installed ({e})"));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("## This project against mpi4py and torch.distributed (Gloo)\n");
    println!(
        "`{command}`, {date}, {cores} cores, load average {load_before} before and {load_after} after, {elapsed:.0} s. \
         mpi4py {} over the same Open MPI; torch {} (Gloo, CPU). f32, sum; time = median over calls of the slowest rank \
         (every call after a barrier); ours and the peer alternate size by size. ratio = peer time / ours (> 1: this project is faster). \
         torch has no out-of-place all-reduce: its row is `recv.copy_(send)` + `all_reduce(recv)`. \
         groups: the demo layout at world {GROUPS_WORLD}, build_collection (a split per family; members-only for local sync) against `new_group` for every group of every family.\n",
        version(&peers.mpi4py),
        version(&peers.torch),
    );
    let last = if runs.len() > 1 {
        format!(", the last of {} runs", runs.len())
    } else {
        String::new()
    };
    println!("### Ratio (peer time / ours) by size{last}\n");
    println!("{}", summary(&rows));
    println!("### Times{last}\n");
    print!("{}", table(&rows));
    if runs.len() > 1 {
        println!("\n### Run to run ({} runs)\n", runs.len());
        print!("{}", run_to_run(&rows, &ratios));
    }
    let json_path = o
        .json
        .clone()
        .unwrap_or_else(|| target_dir().join("peers.json"));
    let meta = [
        ("command", command.clone()),
        ("date", date),
        ("cores", cores.to_string()),
        ("load_average_before", load_before),
        ("load_average_after", load_after),
        ("elapsed_s", format!("{elapsed:.0}")),
        ("mpi4py", version(&peers.mpi4py)),
        ("torch", version(&peers.torch)),
        (
            "statistic",
            "median over calls of the slowest rank's time (max over ranks per call), seconds"
                .into(),
        ),
    ];
    match std::fs::write(&json_path, to_json(&meta, &rows, &ratios)) {
        Ok(()) => println!("\nJSON: {}", json_path.display()),
        Err(e) => {
            eprintln!(
                "xtask bench peers: cannot write {}: {e}",
                json_path.display()
            );
            return 1;
        }
    }
    // Our side must have run everywhere; a missing peer is reported, not a failure.
    let ours_failed = rows.iter().filter(|r| r.ours.is_err()).count();
    if ours_failed > 0 {
        eprintln!("peers: {ours_failed} rows have no time for this project");
        return 1;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_median_takes_the_max_per_call_then_the_median() {
        // Calls: max over ranks = [3, 5, 4] -> median 4.
        let per_rank = vec![vec![1.0, 5.0, 2.0], vec![3.0, 1.0, 4.0]];
        assert_eq!(slowest_median(&per_rank), Some(4.0));
        // Even count: the upper middle one (as grid_programs::stats::median).
        assert_eq!(slowest_median(&[vec![1.0, 2.0, 3.0, 4.0]]), Some(3.0));
        assert_eq!(slowest_median(&[]), None);
        assert_eq!(slowest_median(&[vec![]]), None);
        assert_eq!(slowest_median(&[vec![1.0], vec![1.0, 2.0]]), None);
        assert_eq!(slowest_median(&[vec![f64::NAN, 1.0]]), None);
    }

    #[test]
    fn sizes_cover_8_bytes_to_64_mib_in_powers_of_4() {
        let s = sizes(false);
        assert_eq!(s.len(), 13);
        assert_eq!((s[0], s[1], s[11], s[12]), (8, 32, 32 << 20, 64 << 20));
        assert_eq!(sizes(true), vec![8, 8 << 10, 2 << 20, 64 << 20]);
        for b in s {
            let (w, i) = iterations(b, false);
            assert!(w >= 1 && i >= 7, "{b}: {w} {i}");
        }
    }

    #[test]
    fn cell_order_flips_by_cell_and_rotates_by_run() {
        // Two jobs: the first run as before (forward, reversed, forward, ...), the second
        // starts the other way round.
        assert_eq!(cell_order(2, 0, 0), vec![0, 1]);
        assert_eq!(cell_order(2, 1, 0), vec![1, 0]);
        assert_eq!(cell_order(2, 0, 1), vec![1, 0]);
        assert_eq!(cell_order(2, 1, 1), vec![0, 1]);
        // Three jobs: over three runs every job takes every place in a cell exactly once, in
        // even and odd cells alike (before, the middle job was always the same one).
        for cell in 0..4 {
            let orders: Vec<Vec<usize>> = (0..3).map(|run| cell_order(3, cell, run)).collect();
            for place in 0..3 {
                let mut at: Vec<usize> = orders.iter().map(|o| o[place]).collect();
                at.sort_unstable();
                assert_eq!(at, vec![0, 1, 2], "cell {cell}, place {place}: {orders:?}");
            }
            for o in &orders {
                let mut sorted = o.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, vec![0, 1, 2], "each job once per cell: {o:?}");
            }
        }
        assert_eq!(cell_order(3, 1, 1), vec![0, 2, 1]);
        assert_eq!(
            cell_order(3, 0, 4),
            cell_order(3, 0, 1),
            "the rotation repeats"
        );
        assert!(cell_order(0, 3, 2).is_empty());
    }

    #[test]
    fn ops_and_sizes_can_be_chosen() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let o = parse(&args(&[
            "--ops",
            "broadcast,all_gather",
            "--sizes",
            "8B,128KiB,2MiB,64",
        ]))
        .unwrap();
        assert_eq!(o.ops, vec!["broadcast", "all_gather"]);
        assert_eq!(o.sizes, Some(vec![8, 128 << 10, 2 << 20, 64]));
        let all = parse(&[]).unwrap();
        assert_eq!(all.ops.len(), OPS.len());
        assert_eq!(all.sizes, None);
        let e = parse(&args(&["--ops", "all_gather,gather"])).unwrap_err();
        assert!(
            e.contains("\"gather\" is not a collective") && e.contains("reduce_scatter_in_place"),
            "{e}"
        );
        for bad in ["3", "0", "2GiB", "1.5MiB", "KiB", "-8"] {
            let e = parse(&args(&["--sizes", bad])).unwrap_err();
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
        // Every label of the default sizes reads back (the command line printed with a run).
        for b in sizes(false) {
            assert_eq!(parse_size(&size_label(b).replace(' ', "")), Some(b));
        }
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(8), "8 B");
        assert_eq!(size_label(32 << 10), "32 KiB");
        assert_eq!(size_label(64 << 20), "64 MiB");
        assert_eq!(time_label(1.04e-6), "1.04 µs");
        assert_eq!(time_label(0.0456), "45.6 ms");
        assert_eq!(time_label(0.1234), "123 ms");
        assert_eq!(time_label(2.5), "2.50 s");
    }

    fn row(ours: Result<f64, String>, theirs: Result<f64, String>) -> Row {
        Row {
            op: "all_reduce (in place)".into(),
            backend: "mpi".into(),
            peer: "mpi4py".into(),
            ranks: 2,
            bytes: Some(8),
            calls: 50,
            ours,
            theirs,
        }
    }

    #[test]
    fn table_has_the_ratio_peer_over_ours() {
        let rows = vec![
            row(Ok(0.5), Ok(1.25)),
            row(Ok(2e-3), Err("mpi4py not installed".into())),
        ];
        assert_eq!(rows[0].ratio(), Some(2.5));
        assert_eq!(rows[1].ratio(), None);
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "| op | backend | ranks | size | ours | peer | ratio |"
        );
        assert_eq!(
            lines[2],
            "| all_reduce (in place) | mpi | 2 | 8 B | 500 ms | mpi4py 1.25 s | 2.50× |"
        );
        assert_eq!(
            lines[3],
            "| all_reduce (in place) | mpi | 2 | 8 B | 2.00 ms | mpi4py — | — |"
        );
    }

    #[test]
    fn summary_has_one_row_per_op_and_one_column_per_size() {
        let mut a = row(Ok(1.0), Ok(2.0));
        let mut b = row(Ok(1.0), Ok(0.5));
        b.bytes = Some(64 << 20);
        let mut g = row(Ok(4.0), Ok(1.0));
        (g.op, g.bytes, g.backend, g.peer) = (
            "groups (global)".into(),
            None,
            "gloo".into(),
            "torch".into(),
        );
        a.ranks = 2;
        let t = summary(&[a, b, g]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| op | ours / peer | ranks | 8 B | 64 MiB | — |");
        assert_eq!(lines[1], "|---|---|--:|--:|--:|--:|");
        assert_eq!(
            lines[2],
            "| all_reduce (in place) | mpi / mpi4py | 2 | 2.00 | 0.50 |  |"
        );
        assert_eq!(
            lines[3],
            "| groups (global) | gloo / torch | 2 |  |  | 0.25 |"
        );
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn json_holds_every_row_and_escapes_strings() {
        let mut failed = row(Err("no \"job\"\n".into()), Ok(1.0));
        failed.ranks += 2;
        let rows = vec![row(Ok(1e-6), Ok(2e-6)), failed];
        let one_run = ratios_by_row(std::slice::from_ref(&rows));
        let j = to_json(&[("date", "2026-11-24".into())], &rows, &one_run);
        assert!(j.starts_with("{\n  \"date\": \"2026-11-24\",\n  \"rows\": [\n"));
        assert!(j.contains("\"ours_s\": 1e-6, \"peer_s\": 2e-6, \"ratio\": 2e0,"));
        // One run: its ratio, no verdict.
        assert!(j.contains("\"ratios\": [2e0], \"verdict\": null}"));
        assert!(j.contains("\"ratios\": [null], \"verdict\": null}"));
        assert!(j.contains("\"ours_s\": null,"));
        assert!(j.contains("\"ours_error\": \"no \\\"job\\\"\\n\""));
        assert_eq!(j.matches("\"op\":").count(), 2);
        assert!(j.ends_with("  ]\n}\n"));
        assert_eq!(json_num(f64::INFINITY), "null");
    }

    #[test]
    fn options() {
        let a = |v: &[&str]| parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            a(&[]),
            Ok(Options {
                quick: false,
                ranks: vec![2, 4],
                json: None,
                parts: vec!["mpi".into(), "gloo".into(), "groups".into()],
                ops: OPS.iter().map(|&(op, _)| op).collect(),
                sizes: None,
                repeat: 1,
            })
        );
        let o = a(&["--quick", "--ranks", "2", "--json", "x.json"]);
        assert_eq!(
            o,
            Ok(Options {
                quick: true,
                ranks: vec![2],
                json: Some("x.json".into()),
                parts: vec!["mpi".into(), "gloo".into(), "groups".into()],
                ops: OPS.iter().map(|&(op, _)| op).collect(),
                sizes: None,
                repeat: 1,
            })
        );
        let o = a(&["--only", "mpi,groups"]);
        assert_eq!(o.map(|o| o.parts), Ok(vec!["mpi".into(), "groups".into()]));
        assert!(a(&["--only", "nccl"]).is_err_and(|e| e.contains("valid: mpi, gloo, groups")));
        assert!(a(&["--ranks", "1"]).is_err_and(|e| e.contains("from 2 to 64")));
        assert!(a(&["--ranks"]).is_err());
        assert!(a(&["--bogus"]).is_err_and(|e| e.contains("--bogus")));
        assert_eq!(a(&["--repeat", "3"]).map(|o| o.repeat), Ok(3));
        for bad in ["0", "21", "x", "-1"] {
            assert!(
                a(&["--repeat", bad]).is_err_and(|e| e.contains("from 1 to 20")),
                "--repeat {bad}"
            );
        }
        assert!(a(&["--repeat"]).is_err_and(|e| e.contains("--repeat needs a value")));
    }

    #[test]
    fn a_verdict_needs_every_run_on_one_side_of_1() {
        assert_eq!(verdict(&[Some(1.0), Some(2.5)]), Some(Verdict::Ahead));
        assert_eq!(verdict(&[Some(0.99), Some(0.5)]), Some(Verdict::Behind));
        assert_eq!(
            verdict(&[Some(0.9), Some(1.1), Some(1.2)]),
            Some(Verdict::Even)
        );
        // Runs without a ratio (a peer missing, a failed job) do not count.
        assert_eq!(verdict(&[None, Some(0.9)]), Some(Verdict::Behind));
        assert_eq!(verdict(&[None, None]), None);
        assert_eq!(verdict(&[]), None);
    }

    #[test]
    fn run_to_run_counts_verdicts_per_pair_and_lists_rows_not_ahead() {
        let at = |backend: &str, bytes: u64, ours: f64| Row {
            op: "broadcast".into(),
            backend: backend.into(),
            peer: "torch".into(),
            ranks: 4,
            bytes: Some(bytes),
            calls: 5,
            ours: Ok(ours),
            theirs: Ok(1.0),
        };
        // Ratios 1/ours: 8 B ahead in both runs, 2 MiB even, 32 MiB behind; threads even.
        let run1 = vec![
            at("gloo", 8, 0.5),
            at("gloo", 2 << 20, 0.8),
            at("gloo", 32 << 20, 1.25),
            at("gloo-threads", 8, 2.0),
        ];
        let run2 = vec![
            at("gloo", 8, 0.9),
            at("gloo", 2 << 20, 1.25),
            at("gloo", 32 << 20, 1.1),
            at("gloo-threads", 8, 0.5),
        ];
        let runs = vec![run1, run2];
        let r = ratios_by_row(&runs);
        assert_eq!(r[2], vec![Some(0.8), Some(1.0 / 1.1)]);
        let t = run_to_run(&runs[1], &r);
        assert!(t.contains("every one of the 2 runs"), "{t}");
        assert!(t.contains("| gloo / torch | 4 | 1 | 1 | 1 |"), "{t}");
        assert!(
            t.contains("| gloo-threads / torch | 4 | 0 | 1 | 0 |"),
            "{t}"
        );
        assert!(
            t.contains("| broadcast | gloo / torch | 4 | 2 MiB | 1.25, 0.80 | even |"),
            "{t}"
        );
        assert!(
            t.contains("| broadcast | gloo / torch | 4 | 32 MiB | 0.80, 0.91 | behind |"),
            "{t}"
        );
        assert!(
            !t.contains("| 8 B | 2.00, 1.11"),
            "ahead rows are not listed: {t}"
        );
        let ahead = vec![vec![runs[0][0].clone()], vec![runs[1][0].clone()]];
        assert!(run_to_run(&ahead[1], &ratios_by_row(&ahead))
            .ends_with("\nEvery row with a ratio was ahead in every run.\n"));
        // The JSON of the sitting: every run's ratio and the verdict.
        let j = to_json(&[], &runs[1], &r);
        assert!(
            j.contains("\"ratios\": [8e-1, 9.090909090909091e-1], \"verdict\": \"behind\""),
            "{j}"
        );
        // Rows are matched by what they measure, not by position.
        let mut shuffled = runs.clone();
        shuffled[0].reverse();
        assert_eq!(ratios_by_row(&shuffled), r);
    }
}
