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
//! "size" is the activation a transfer delivers (f32 `[2·MiB, 512, 256]`, batch first). For every
//! size: one warm-up transfer of each kind (its data checked element by element), then rounds in
//! which every kind runs once, in an order that rotates from round to round; each transfer starts
//! after a barrier and its time is the slowest rank's. Throughput = bytes / median time; ratio =
//! bridge / p2p throughput.
//!
//! Run: `cargo run --release -p multimodule --features gloo --bin bridge-bench
//! [-- --max-mib 256 --min-mib 1 --rounds N --topo 1:1|fan-out|fan-in]`

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{BufMut, BufRef, Communicator, HyperGrid, P2pOp};
use multimodule::{Activation, BridgeCommunicator, BridgePlan, DimMapping, ShapeMode};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// f32 elements per batch row (512 KiB).
const ROW: usize = 512 * 256;

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
    /// `send_forward` / `recv_forward` with static shapes, the output dropped (its buffer goes
    /// back to the bridge's pool on its own).
    Static,
    /// The same with variable shapes (a header round trip per transfer).
    Variable,
}

const KINDS: [Kind; 3] = [Kind::P2p, Kind::Static, Kind::Variable];

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::P2p => "p2p",
        Kind::Static => "static",
        Kind::Variable => "variable",
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
            if k == Kind::Static {
                b.set_shape_mode(ShapeMode::Static {
                    shape: vec![src_rows, 512, 256],
                    dtype: grid_core::DType::F32,
                })
                .map_err(invalid)?;
            }
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> ExitCode {
    let max_mib: usize = arg("--max-mib", 256);
    let min_mib: usize = arg("--min-mib", 1);
    let fixed_rounds: usize = arg("--rounds", 0);
    let only: String = arg("--topo", String::new());
    let sizes: Vec<usize> = (0..)
        .map(|k| 1usize << k)
        .skip_while(|&m| m < min_mib)
        .take_while(|&m| m <= max_mib)
        .collect();
    let rounds = |mib: usize| {
        if fixed_rounds > 0 {
            fixed_rounds
        } else {
            (1024 / mib).clamp(7, 31)
        }
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "bridge vs plain point-to-point, Gloo (ranks as threads, TCP loopback), f32 [2*MiB, 512, 256]; load average {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    println!("kinds: {}", KINDS.map(kind_name).join(", "));
    let mut worst = vec![f64::INFINITY; KINDS.len()];
    for topo in [Topo::OneToOne, Topo::FanOut, Topo::FanIn] {
        if !only.is_empty() && !topo.name().starts_with(only.as_str()) {
            continue;
        }
        // Rounds per size are the same on every rank; run each size group with its count.
        let mut rows = Vec::new();
        for &mib in &sizes {
            let cfg = GlooConfig::new(format!("bridge-bench-{}-{mib}", topo.world()))
                .with_timeout(Duration::from_secs(600));
            let n = rounds(mib);
            let res = run_ranks(topo.world(), &cfg, |f, w| rank_main(topo, &[mib], n, f, w));
            let per_rank = match res {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{}: {e}", topo.name());
                    return ExitCode::FAILURE;
                }
            };
            let mut all = Vec::new();
            for (rank, r) in per_rank.into_iter().enumerate() {
                match r {
                    Ok(mut v) => all.push(v.remove(0)),
                    Err(e) => {
                        eprintln!("{} {mib} MiB: rank {rank} failed: {e}", topo.name());
                        return ExitCode::FAILURE;
                    }
                }
            }
            // Slowest rank per round, then the median over rounds.
            let secs: Vec<f64> = (0..KINDS.len())
                .map(|k| {
                    median(
                        (0..n)
                            .map(|r| all.iter().map(|t| t[k][r]).fold(0.0, f64::max))
                            .collect(),
                    )
                })
                .collect();
            rows.push((mib, n, secs));
        }
        println!("\n{} ({} ranks)", topo.name(), topo.world());
        print!("{:>8} {:>6}", "size", "rounds");
        for (k, kind) in KINDS.iter().enumerate() {
            if k == 0 {
                print!(" {:>10}", format!("{} GB/s", kind_name(*kind)));
            } else {
                print!(
                    " {:>14} {:>7}",
                    format!("{} GB/s", kind_name(*kind)),
                    "ratio"
                );
            }
        }
        println!();
        for (mib, n, secs) in rows {
            let gbs: Vec<f64> = secs.iter().map(|s| (mib << 20) as f64 / s / 1e9).collect();
            print!("{:>4} MiB {:>6}", mib, n);
            for (k, g) in gbs.iter().enumerate() {
                if k == 0 {
                    print!(" {:>10.3}", g);
                } else {
                    let ratio = g / gbs[0];
                    worst[k] = worst[k].min(ratio);
                    print!(" {:>14.3} {:>6.1}%", g, 100.0 * ratio);
                }
            }
            println!();
        }
    }
    println!();
    for (k, kind) in KINDS.iter().enumerate().skip(1) {
        println!(
            "lowest ratio, {}: {:.1}% (target >= 90%)",
            kind_name(*kind),
            100.0 * worst[k]
        );
    }
    ExitCode::SUCCESS
}
