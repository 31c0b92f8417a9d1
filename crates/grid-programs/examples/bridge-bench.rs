//! Bridge throughput against plain point-to-point sends of the same bytes between the same ranks,
//! on the same backend in the same run (Gloo, ranks as threads of this process, TCP loopback).
//!
//! Three topologies, each on its own Gloo world:
//! * `1:1`: rank 0 → rank 1; plain p2p is one `send`/`recv`.
//! * `fan-out 1->2`: source lane rank 0 → destination lanes 1 and 2, half the batch each; plain
//!   p2p is rank 0 sending the two halves of its buffer in one `batch_p2p`.
//! * `fan-in 2->1`: source lanes 0 and 1 → destination lane 2, which gets both halves
//!   concatenated; plain p2p is the two sends received straight into the two halves of one
//!   buffer (one `batch_p2p`).
//!
//! "size" is the activation a transfer delivers (f32 `[2·MiB, 512, 256]`, batch first). The
//! bridge kinds are `ShapeMode::Variable` (the default), `ShapeMode::Static` and
//! `ShapeMode::Learned`, outputs simply dropped (their
//! buffers return to the bridge's pool on their own). For every run and size: a fresh Gloo world,
//! one warm-up transfer of each kind (its data checked element by element), then rounds in which
//! every kind runs once, in an order that rotates from round to round; each transfer starts after
//! a barrier and its time is the slowest rank's; the median over rounds. Several runs
//! (`--runs`, default 3) are interleaved over sizes and topologies and the median of the runs is
//! reported, with the spread of each ratio over runs. Throughput = bytes / time; ratio = bridge / p2p.
//!
//! Run: `cargo run --release -p grid-programs --example bridge-bench
//! [-- --runs 3 --max-mib 256 --min-mib 1 --rounds N --topo 1:1|fan-out|fan-in]`
//! (`cargo xtask bench bridge [-- ARGS]` does the same).

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{BufMut, BufRef, Communicator, HyperGrid, P2pOp};
use grid_programs::stats::{load_average, median};
use multimodule::{Activation, BridgeCommunicator, BridgePlan, DimMapping, ShapeMode};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// f32 elements per batch row (512 KiB).
const ROW: usize = 512 * 256;

/// The value after `name` on the command line, parsed; `default` when the option is absent, an
/// error naming the option and the value when it does not parse or has no value.
fn arg<T: std::str::FromStr>(
    args: &[String],
    name: &str,
    default: T,
    what: &str,
) -> Result<T, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args
                .get(i + 1)
                .ok_or_else(|| format!("{name} needs a value ({what})"))?;
            v.parse()
                .map_err(|_| format!("{name} {v:?}: expected {what}"))
        }
    }
}

const USAGE: &str = "usage: bridge-bench [--runs N] [--max-mib N] [--min-mib N] [--rounds N] [--topo 1:1|fan-out|fan-in]";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Topo {
    OneToOne,
    FanOut,
    FanIn,
}

impl Topo {
    fn name(self) -> &'static str {
        match self {
            Topo::OneToOne => "1:1",
            Topo::FanOut => "fan-out 1->2",
            Topo::FanIn => "fan-in 2->1",
        }
    }
    fn world(self) -> usize {
        match self {
            Topo::OneToOne => 2,
            _ => 3,
        }
    }
    /// (source lanes, destination lanes).
    fn lanes(self) -> (usize, usize) {
        match self {
            Topo::OneToOne => (1, 1),
            Topo::FanOut => (1, 2),
            Topo::FanIn => (2, 1),
        }
    }
    fn plan(self) -> Result<BridgePlan, String> {
        let (s, d) = self.lanes();
        let g = |dp, off| {
            HyperGrid::new(vec![1, 1, 1, dp], &["tp", "cp", "pp", "dp"], off)
                .map_err(|e| e.to_string())
        };
        BridgePlan::new("src", g(s, 0)?, "dst", g(d, s)?, 3, DimMapping::default())
            .map_err(|e| e.to_string())
    }
}

/// What one timed transfer runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Plain sends of the same bytes between the same ranks.
    P2p,
    /// `send_forward` / `recv_forward` with variable shapes (the default), the output dropped
    /// (its buffer goes back to the bridge's pool on its own).
    Variable,
    /// The same with static (declared) shapes.
    Static,
    /// The same with learned shapes.
    Learned,
}

/// The default shape mode first.
const KINDS: [Kind; 4] = [Kind::P2p, Kind::Variable, Kind::Static, Kind::Learned];

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::P2p => "p2p",
        Kind::Static => "static",
        Kind::Variable => "variable",
        Kind::Learned => "learned",
    }
}

fn invalid(e: impl std::fmt::Display) -> grid_core::Error {
    grid_core::Error::Invalid(e.to_string())
}

/// Value of element `e` of source lane `lane`'s activation (exact in f32).
fn val(lane: usize, e: usize) -> f32 {
    ((lane * 7 + e) % 4093) as f32
}

/// One rank of one topology: per size, per kind, the elapsed seconds of every round.
fn rank_main(
    topo: Topo,
    sizes: &[usize],
    rounds: usize,
    f: &backend_gloo::GlooFactory,
    w: backend_gloo::GlooCommunicator,
) -> grid_core::Result<Vec<Vec<Vec<f64>>>> {
    let w = Arc::new(w);
    let me = w.rank();
    let plan = topo.plan().map_err(invalid)?;
    let (nsrc, ndst) = topo.lanes();
    let is_src = me < nsrc;
    let bridges: Vec<BridgeCommunicator<_>> = (0..KINDS.len())
        .map(|k| BridgeCommunicator::new(f, w.clone(), plan.clone(), 100 + 16 * k as u32))
        .collect::<Result<_, _>>()
        .map_err(invalid)?;
    let mut out = Vec::new();
    for &mib in sizes {
        let total_rows = 2 * mib;
        let src_rows = total_rows / nsrc;
        let dst_rows = total_rows / ndst;
        for (b, k) in bridges.iter().zip(KINDS) {
            // A fresh mode per size (the learned shapes start over).
            let mode = match k {
                Kind::Static => ShapeMode::Static {
                    shape: vec![src_rows, 512, 256],
                    dtype: grid_core::DType::F32,
                },
                Kind::Learned => ShapeMode::Learned,
                _ => ShapeMode::Variable,
            };
            b.set_shape_mode(mode).map_err(invalid)?;
        }
        let lane = if is_src { me } else { me - nsrc };
        let act = if is_src {
            let n = src_rows * ROW;
            Some(
                Activation::from_vec(
                    vec![src_rows, 512, 256],
                    (0..n).map(|e| val(lane, e)).collect(),
                )
                .map_err(invalid)?,
            )
        } else {
            None
        };
        // What destination lane `lane` must receive: its rows of the lanes' concatenation.
        let expected = |lane: usize, t: &Activation| -> bool {
            let Some(v) = t.as_slice::<f32>() else {
                return false;
            };
            let first = lane * dst_rows * ROW;
            v.len() == dst_rows * ROW
                && v.iter().enumerate().all(|(e, &x)| {
                    let g = first + e;
                    x == val(g / (src_rows * ROW), g % (src_rows * ROW))
                })
        };
        let mut p2p_buf = vec![0f32; if is_src { 0 } else { dst_rows * ROW }];
        let transfer = |kind: Kind, buf: &mut Vec<f32>, check: bool| -> grid_core::Result<()> {
            let bridge = &bridges[KINDS.iter().position(|&k| k == kind).unwrap_or(0)];
            match (kind, is_src) {
                (Kind::P2p, true) => {
                    let v = act
                        .as_ref()
                        .and_then(|a| a.as_slice::<f32>())
                        .unwrap_or(&[]);
                    let dsts: Vec<usize> = (nsrc..nsrc + ndst).collect();
                    let chunk = v.len() / dsts.len();
                    let ops = dsts
                        .iter()
                        .enumerate()
                        .map(|(k, &peer)| P2pOp::Send {
                            buf: BufRef::from(&v[k * chunk..(k + 1) * chunk]),
                            peer,
                            tag: 7,
                        })
                        .collect();
                    w.batch_p2p(ops)
                }
                (Kind::P2p, false) => {
                    let chunk = buf.len() / nsrc;
                    let ops = buf
                        .chunks_mut(chunk.max(1))
                        .enumerate()
                        .map(|(peer, c)| P2pOp::Recv {
                            buf: BufMut::from(c),
                            peer,
                            tag: 7,
                        })
                        .collect();
                    w.batch_p2p(ops)?;
                    if check
                        && !buf.chunks(ROW).enumerate().all(|(r, c)| {
                            let g = lane * dst_rows * ROW + r * ROW;
                            c.iter().enumerate().all(|(e, &x)| {
                                x == val((g + e) / (src_rows * ROW), (g + e) % (src_rows * ROW))
                            })
                        })
                    {
                        return Err(invalid("p2p delivered wrong data"));
                    }
                    Ok(())
                }
                (_, true) => bridge
                    .send_forward(act.as_ref().ok_or_else(|| invalid("no activation"))?)
                    .map_err(invalid),
                (_, false) => {
                    let got = bridge
                        .recv_forward()
                        .map_err(invalid)?
                        .ok_or_else(|| invalid("no activation"))?;
                    if got.shape() != [dst_rows, 512, 256] || (check && !expected(lane, &got)) {
                        return Err(invalid(format!(
                            "{} delivered a wrong tensor {:?}",
                            kind_name(kind),
                            got.shape()
                        )));
                    }
                    Ok(())
                }
            }
        };
        for &k in &KINDS {
            w.barrier()?;
            transfer(k, &mut p2p_buf, true)?;
        }
        let mut times = vec![Vec::with_capacity(rounds); KINDS.len()];
        for r in 0..rounds {
            for s in 0..KINDS.len() {
                let k = (r + s) % KINDS.len();
                w.barrier()?;
                let t = Instant::now();
                transfer(KINDS[k], &mut p2p_buf, false)?;
                times[k].push(t.elapsed().as_secs_f64());
            }
        }
        out.push(times);
    }
    Ok(out)
}

/// Rounds per run for a size: many for small transfers (cheap, and the noisiest).
fn default_rounds(mib: usize) -> usize {
    match mib {
        0..=4 => 101,
        5..=32 => 61,
        _ => 31,
    }
}

/// What one run of one topology at one size gives.
struct RunStats {
    /// Median seconds per transfer, per kind.
    secs: Vec<f64>,
    /// Per kind: the median over rounds of p2p time / this kind's time in the same round
    /// (transfers a few milliseconds apart, so load changes hit both alike).
    paired: Vec<f64>,
}

/// One run of one topology at one size on a fresh Gloo world.
fn run_once(topo: Topo, mib: usize, rounds: usize, tag: &str) -> Result<RunStats, String> {
    let cfg = GlooConfig::new(format!("bridge-bench-{tag}")).with_timeout(Duration::from_secs(600));
    let per_rank = run_ranks(topo.world(), &cfg, |f, w| {
        rank_main(topo, &[mib], rounds, f, w)
    })
    .map_err(|e| format!("{}: {e}", topo.name()))?;
    let mut all = Vec::new();
    for (rank, r) in per_rank.into_iter().enumerate() {
        let mut v = r.map_err(|e| format!("{} {mib} MiB: rank {rank} failed: {e}", topo.name()))?;
        all.push(v.remove(0));
    }
    // Slowest rank per round, then medians over rounds.
    let per_round: Vec<Vec<f64>> = (0..KINDS.len())
        .map(|k| {
            (0..rounds)
                .map(|r| all.iter().map(|t| t[k][r]).fold(0.0, f64::max))
                .collect()
        })
        .collect();
    Ok(RunStats {
        secs: per_round
            .iter()
            .map(|v| median(v).unwrap_or(f64::NAN))
            .collect(),
        paired: (0..KINDS.len())
            .map(|k| {
                median(
                    &(0..rounds)
                        .map(|r| per_round[0][r] / per_round[k][r])
                        .collect::<Vec<f64>>(),
                )
                .unwrap_or(f64::NAN)
            })
            .collect(),
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let known = ["--runs", "--max-mib", "--min-mib", "--rounds", "--topo"];
    if let Some(bad) = args
        .iter()
        .step_by(2)
        .find(|a| !known.contains(&a.as_str()))
    {
        eprintln!("bridge-bench: unknown argument '{bad}'\n{USAGE}");
        return ExitCode::from(2);
    }
    let parsed = (|| -> Result<_, String> {
        let max_mib: usize = arg(&args, "--max-mib", 256, "a size in MiB")?;
        let min_mib: usize = arg(&args, "--min-mib", 1, "a size in MiB")?;
        let rounds: usize = arg(&args, "--rounds", 0, "a number of rounds (0: by size)")?;
        let runs: usize = arg(&args, "--runs", 3, "a positive number of runs")?;
        let only: String = arg(&args, "--topo", String::new(), "1:1, fan-out or fan-in")?;
        if runs == 0 {
            return Err("--runs 0: expected a positive number of runs".into());
        }
        if min_mib == 0 || min_mib > max_mib {
            return Err(format!(
                "--min-mib {min_mib} --max-mib {max_mib}: expected 1 <= min <= max"
            ));
        }
        if !["", "1:1", "fan-out", "fan-in"].contains(&only.as_str()) {
            return Err(format!("--topo {only:?}: expected 1:1, fan-out or fan-in"));
        }
        Ok((max_mib, min_mib, rounds, runs, only))
    })();
    let (max_mib, min_mib, fixed_rounds, runs, only) = match parsed {
        Ok(p) => p,
        Err(e) => {
            eprintln!("bridge-bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let sizes: Vec<usize> = (0..)
        .map(|k| 1usize << k)
        .skip_while(|&m| m < min_mib)
        .take_while(|&m| m <= max_mib)
        .collect();
    let rounds = |mib: usize| {
        if fixed_rounds > 0 {
            fixed_rounds
        } else {
            default_rounds(mib)
        }
    };
    let topos: Vec<Topo> = [Topo::OneToOne, Topo::FanOut, Topo::FanIn]
        .into_iter()
        .filter(|t| only.is_empty() || t.name().starts_with(only.as_str()))
        .collect();
    let load_before = load_average().unwrap_or_else(|| "unknown".into());
    println!("bridge-bench: BridgeCommunicator vs plain point-to-point sends of the same bytes between the same ranks");
    println!("backend: Gloo, ranks as threads of this process, TCP loopback; f32 activations [2*MiB, 512, 256] (batch first)");
    println!("columns: p2p      = plain send/recv (fan-out: the two halves of one buffer; fan-in: received into the two halves of one buffer)");
    println!("         variable = send_forward/recv_forward with ShapeMode::Variable (the default; header and payload in one round once a channel's shape came twice in a row)");
    println!("         static   = the same with ShapeMode::Static (declared shape; header and payload in one round)");
    println!("         learned  = the same with ShapeMode::Learned (after each channel's first message, header and payload in one round)");
    println!("         bridge outputs are simply dropped: their buffers go back to the bridge's pool on their own (the default behaviour)");
    println!("method:  per run and size a fresh world, 1 warm-up transfer per kind (data checked element by element), then rounds of one");
    println!("         transfer per kind in rotating order, each after a barrier, timed as the slowest rank; median over rounds;");
    println!("         ratio = median over rounds of (p2p time / bridge time) in the same round, so load changes hit both alike;");
    println!("         {runs} runs (interleaved over sizes and topologies): medians of the runs shown, (min-max) of each ratio over runs");
    println!("load average before: {load_before}");
    // results[topo][size][run]
    let mut results: Vec<Vec<Vec<RunStats>>> = (0..topos.len())
        .map(|_| (0..sizes.len()).map(|_| Vec::new()).collect())
        .collect();
    for run in 0..runs {
        for (ti, &topo) in topos.iter().enumerate() {
            for (si, &mib) in sizes.iter().enumerate() {
                let tag = format!("{run}-{ti}-{mib}");
                match run_once(topo, mib, rounds(mib), &tag) {
                    Ok(secs) => results[ti][si].push(secs),
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
        }
    }
    let mut worst = vec![(f64::INFINITY, String::new()); KINDS.len()];
    let mut misses: Vec<String> = Vec::new();
    for (ti, &topo) in topos.iter().enumerate() {
        let (s, d) = topo.lanes();
        println!(
            "\n{} (source ranks {:?} -> destination ranks {:?})",
            topo.name(),
            (0..s).collect::<Vec<_>>(),
            (s..s + d).collect::<Vec<_>>()
        );
        print!("{:>8} {:>8} {:>9}", "size", "rounds", "p2p GB/s");
        for kind in &KINDS[1..] {
            print!(
                " {:>13} {:>7} {:>11}",
                format!("{} GB/s", kind_name(*kind)),
                "ratio",
                "(runs)"
            );
        }
        println!();
        for (si, &mib) in sizes.iter().enumerate() {
            let per_run = &results[ti][si];
            let bytes = (mib << 20) as f64;
            let gbs = |k: usize| {
                median(
                    &per_run
                        .iter()
                        .map(|r| bytes / r.secs[k] / 1e9)
                        .collect::<Vec<f64>>(),
                )
                .unwrap_or(f64::NAN)
            };
            print!(
                "{:>4} MiB {:>8} {:>9.3}",
                mib,
                format!("{runs}x{}", rounds(mib)),
                gbs(0)
            );
            for (k, kind) in KINDS.iter().enumerate().skip(1) {
                let rs: Vec<f64> = per_run.iter().map(|r| r.paired[k]).collect();
                let r = median(&rs).unwrap_or(f64::NAN);
                let lo = rs.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = rs.iter().copied().fold(0.0, f64::max);
                if r < worst[k].0 {
                    worst[k] = (r, format!("{} {mib} MiB", topo.name()));
                }
                if r < 0.9 {
                    misses.push(format!(
                        "{} {} {mib} MiB ({:.1}%)",
                        kind_name(*kind),
                        topo.name(),
                        100.0 * r
                    ));
                }
                print!(
                    " {:>13.3} {:>6.1}% {:>11}",
                    gbs(k),
                    100.0 * r,
                    format!("({:.0}-{:.0}%)", 100.0 * lo, 100.0 * hi)
                );
            }
            println!();
        }
    }
    println!();
    for (k, kind) in KINDS.iter().enumerate().skip(1) {
        println!(
            "lowest ratio, {}: {:.1}% at {} (target >= 90%)",
            kind_name(*kind),
            100.0 * worst[k].0,
            worst[k].1
        );
    }
    if misses.is_empty() {
        println!("every shape mode: every size at >= 90% of plain p2p");
    } else {
        println!("under 90%: {}", misses.join(", "));
    }
    let load_after = load_average().unwrap_or_else(|| "unknown".into());
    println!("load average after: {load_after}");
    let busy = |l: &str| {
        l.split_whitespace()
            .next()
            .and_then(|x| x.parse::<f64>().ok())
            .is_some_and(|x| x > 3.0)
    };
    if busy(&load_before) {
        println!("note: the machine was loaded before the run (1-minute load average > 3); numbers are noisier");
    }
    ExitCode::SUCCESS
}
