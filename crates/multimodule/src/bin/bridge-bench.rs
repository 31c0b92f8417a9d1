//! Bridge throughput against plain point-to-point sends of the same bytes, on the same backend
//! in the same run (Gloo, two ranks as threads of this process, TCP loopback).
//!
//! For each size the source rank moves one f32 activation `[rows, 1024, 256]` of that many
//! bytes to the destination rank `iters` times, first with `send`/`recv` on the world
//! communicator, then through a 1:1 [`BridgeCommunicator`] (`send_forward` / `recv_forward`:
//! header exchange, payload, fresh output tensor). Throughput is bytes / (time per transfer),
//! timed on the receiver after a barrier; the three kinds alternate round by round and the
//! medians are reported, so load on a shared machine hits them alike.
//!
//! Run: `cargo run --release -p multimodule --features gloo --bin bridge-bench [-- --max-mib 256 --iters N]`

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{Communicator, CommunicatorExt, HyperGrid};
use multimodule::{Activation, BridgeCommunicator, BridgePlan, DimMapping};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROW: usize = 1024 * 256; // f32 elements per batch row (1 MiB)

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> ExitCode {
    let max_mib = arg("--max-mib", 256);
    let fixed_iters = arg("--iters", 0);
    let sizes: Vec<usize> = (0..)
        .map(|k| 1usize << k)
        .take_while(|&m| m <= max_mib)
        .collect();
    let grid = |off| HyperGrid::new(vec![1, 1, 1, 1], &["tp", "cp", "pp", "dp"], off);
    let plan = match (grid(0), grid(1)) {
        (Ok(a), Ok(b)) => BridgePlan::new("src", a, "dst", b, 3, DimMapping::default()),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let plan = match plan {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = GlooConfig::new("bridge-bench").with_timeout(Duration::from_secs(600));
    let res = run_ranks(2, &cfg, |f, w| {
        let w = Arc::new(w);
        let me = w.rank();
        let inv = |e: multimodule::Error| grid_core::Error::Invalid(e.to_string());
        // Two bridges over the same grids: `bridge` gets its outputs back through recycle(),
        // `fresh` never does, so each of its receives allocates a new tensor.
        let bridge = BridgeCommunicator::new(f, w.clone(), plan.clone(), 100).map_err(inv)?;
        let fresh = BridgeCommunicator::new(f, w.clone(), plan.clone(), 200).map_err(inv)?;
        let mut rows_out = Vec::new();
        for &mib in &sizes {
            let iters = if fixed_iters > 0 {
                fixed_iters
            } else {
                (1024 / mib).clamp(9, 60)
            };
            let shape = vec![mib, 1024, 256];
            let act = Activation::from_vec(shape.clone(), vec![1.0f32; mib * ROW]).map_err(inv)?;
            let mut buf = vec![0.0f32; mib * ROW];
            // Warm-up both paths once.
            if me == 0 {
                w.send_to(act.as_slice::<f32>().unwrap_or(&[]), 1, 7)?;
                bridge.send_forward(&act).map_err(inv)?;
                fresh.send_forward(&act).map_err(inv)?;
            } else {
                w.recv_from(&mut buf, 0, 7)?;
                if let Some(g) = bridge.recv_forward().map_err(inv)? {
                    bridge.recycle(g);
                }
                fresh.recv_forward().map_err(inv)?;
            }
            // Interleaved rounds (one transfer of each kind per round, each started after a
            // barrier and timed on the receiver), medians over rounds: robust to load drift.
            let mut times: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..iters {
                for (kind, out) in times.iter_mut().enumerate() {
                    w.barrier()?;
                    let t = Instant::now();
                    if me == 0 {
                        match kind {
                            0 => w.send_to(act.as_slice::<f32>().unwrap_or(&[]), 1, 7)?,
                            1 => fresh.send_forward(&act).map_err(inv)?,
                            _ => bridge.send_forward(&act).map_err(inv)?,
                        }
                    } else {
                        match kind {
                            0 => w.recv_from(&mut buf, 0, 7)?,
                            _ => {
                                let got = if kind == 1 {
                                    fresh.recv_forward()
                                } else {
                                    bridge.recv_forward()
                                };
                                match got.map_err(inv)? {
                                    Some(g) if g.shape() == &shape[..] => {
                                        if kind == 2 {
                                            bridge.recycle(g);
                                        }
                                    }
                                    _ => {
                                        return Err(grid_core::Error::Invalid(
                                            "bridge delivered a wrong shape".into(),
                                        ))
                                    }
                                }
                            }
                        }
                    }
                    out.push(t.elapsed().as_secs_f64());
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.total_cmp(b));
                v[v.len() / 2]
            };
            let [mut a, mut b, mut c] = times;
            let (plain, bridged, recycled) = (median(&mut a), median(&mut b), median(&mut c));
            rows_out.push((mib, iters, plain, bridged, recycled));
        }
        Ok(rows_out)
    });
    let rows = match res {
        Ok(mut r) => match r.pop() {
            Some(Ok(rows)) => rows,
            Some(Err(e)) => {
                eprintln!("rank 1 failed: {e}");
                return ExitCode::FAILURE;
            }
            None => return ExitCode::FAILURE,
        },
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!("bridge vs plain point-to-point, Gloo (2 ranks as threads, TCP loopback), f32 [MiB, 1024, 256]");
    println!(
        "{:>8} {:>6} {:>10} {:>12} {:>7} {:>14} {:>7}",
        "size", "iters", "p2p GB/s", "bridge GB/s", "ratio", "recycled GB/s", "ratio"
    );
    let (mut worst_fresh, mut worst_recycled): (f64, f64) = (f64::INFINITY, f64::INFINITY);
    for (mib, iters, plain, bridged, recycled) in rows {
        let bytes = (mib * ROW * 4) as f64;
        let (p, b, r) = (
            bytes / plain / 1e9,
            bytes / bridged / 1e9,
            bytes / recycled / 1e9,
        );
        worst_fresh = worst_fresh.min(b / p);
        worst_recycled = worst_recycled.min(r / p);
        println!(
            "{:>5} MiB {:>6} {:>10.3} {:>12.3} {:>6.1}% {:>14.3} {:>6.1}%",
            mib,
            iters,
            p,
            b,
            100.0 * b / p,
            r,
            100.0 * r / p
        );
    }
    println!(
        "lowest ratio: {:.1}% with a fresh tensor per transfer, {:.1}% with recycled buffers (target >= 90%)",
        100.0 * worst_fresh,
        100.0 * worst_recycled
    );
    ExitCode::SUCCESS
}
