//! Bridge throughput against plain point-to-point sends of the same bytes, on the same backend
//! in the same run (Gloo, two ranks as threads of this process, TCP loopback).
//!
//! For each size the source rank moves one f32 activation `[rows, 1024, 256]` of that many
//! bytes to the destination rank `iters` times, first with `send`/`recv` on the world
//! communicator, then through a 1:1 [`BridgeCommunicator`] (`send_forward` / `recv_forward`:
//! header exchange, payload, fresh output tensor). Throughput is bytes / (time per transfer),
//! timed on the receiver between two barriers.
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
        let bridge = BridgeCommunicator::new(f, w.clone(), plan.clone(), 100).map_err(inv)?;
        let mut rows_out = Vec::new();
        for &mib in &sizes {
            let iters = if fixed_iters > 0 {
                fixed_iters
            } else {
                (2048 / mib).clamp(5, 100)
            };
            let shape = vec![mib, 1024, 256];
            let act = Activation::from_vec(shape.clone(), vec![1.0f32; mib * ROW]).map_err(inv)?;
            let mut buf = vec![0.0f32; mib * ROW];
            // Warm-up both paths once.
            if me == 0 {
                w.send_to(act.as_slice::<f32>().unwrap_or(&[]), 1, 7)?;
                bridge.send_forward(&act).map_err(inv)?;
            } else {
                w.recv_from(&mut buf, 0, 7)?;
                bridge.recv_forward().map_err(inv)?;
            }
            // Plain point-to-point.
            w.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                if me == 0 {
                    w.send_to(act.as_slice::<f32>().unwrap_or(&[]), 1, 7)?;
                } else {
                    w.recv_from(&mut buf, 0, 7)?;
                }
            }
            w.barrier()?;
            let plain = t.elapsed().as_secs_f64() / iters as f64;
            // Bridge.
            let t = Instant::now();
            for _ in 0..iters {
                if me == 0 {
                    bridge.send_forward(&act).map_err(inv)?;
                } else {
                    let got = bridge.recv_forward().map_err(inv)?;
                    if got.as_ref().map(|g| g.shape()) != Some(&shape[..]) {
                        return Err(grid_core::Error::Invalid(
                            "bridge delivered a wrong shape".into(),
                        ));
                    }
                }
            }
            w.barrier()?;
            let bridged = t.elapsed().as_secs_f64() / iters as f64;
            rows_out.push((mib, iters, plain, bridged));
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
        "{:>8} {:>6} {:>14} {:>14} {:>8}",
        "size", "iters", "p2p GB/s", "bridge GB/s", "ratio"
    );
    let mut worst: f64 = f64::INFINITY;
    for (mib, iters, plain, bridged) in rows {
        let bytes = (mib * ROW * 4) as f64;
        let (p, b) = (bytes / plain / 1e9, bytes / bridged / 1e9);
        worst = worst.min(b / p);
        println!(
            "{:>5} MiB {:>6} {:>14.3} {:>14.3} {:>7.1}%",
            mib,
            iters,
            p,
            b,
            100.0 * b / p
        );
    }
    println!("lowest ratio: {:.1}% (target >= 90%)", 100.0 * worst);
    ExitCode::SUCCESS
}
