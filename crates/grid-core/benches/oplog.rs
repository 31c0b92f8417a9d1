//! `cargo bench -p grid-core --bench oplog`: the cost of recording one operation in an
//! [`OpLog`] (begin, mark_started, complete: what the communicator front end calls per
//! nonblocking operation; begin_started and complete: what it calls per blocking one),
//! single-threaded and with several threads sharing one log, and the cost of a snapshot of a
//! full log. Printed, never asserted. `--quick` runs fewer iterations.

use grid_core::oplog::{now_us, OpDesc, OpLog};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

/// Nanoseconds per operation (begin + mark_started + complete), median of `runs` runs.
fn per_op(log: &OpLog, iters: u64, runs: usize) -> f64 {
    let desc = OpDesc::new("all_reduce")
        .dtype("f32")
        .count(1 << 20)
        .reduce_op("sum");
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                let h = log.begin(black_box(desc));
                log.mark_started(h);
                log.complete(h);
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (iters, runs) = if quick { (20_000, 3) } else { (1_000_000, 7) };
    println!("| what | ns per operation (median of {runs} runs) |");
    println!("|---|---:|");
    let log = match OpLog::new("dp", (0..8).collect(), 4096) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("oplog bench: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "| begin + mark_started + complete, one thread, capacity 4096 | {:.1} |",
        per_op(&log, iters, runs)
    );
    // What the front end does for a blocking call: posted and started at once, then completed.
    let desc = OpDesc::new("all_reduce")
        .dtype("f32")
        .count(1 << 20)
        .reduce_op("sum");
    let mut blocking: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                let h = log.begin_started(black_box(desc));
                log.complete(h);
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    blocking.sort_by(f64::total_cmp);
    println!(
        "| begin_started + complete (a blocking call through the front end: 2 locks, 2 clock reads) | {:.1} |",
        blocking[blocking.len() / 2]
    );
    // The clock read that each of the three calls makes (the rest is one uncontended lock).
    let mut clock: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                black_box(now_us());
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    clock.sort_by(f64::total_cmp);
    println!(
        "| of which: one clock read (now_us), 3 per operation | {:.1} |",
        clock[clock.len() / 2]
    );
    let shared = Arc::new(log);
    for threads in [2usize, 4] {
        let t = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let l = Arc::clone(&shared);
                std::thread::spawn(move || per_op(&l, iters / threads as u64, 1))
            })
            .collect();
        let per: Vec<f64> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
        let wall = t.elapsed().as_nanos() as f64 / iters as f64;
        println!(
            "| the same, {threads} threads sharing one log (per thread: {}) | {wall:.1} wall |",
            per.iter()
                .map(|p| format!("{p:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let t = Instant::now();
    let snaps = if quick { 3 } else { 20 };
    for _ in 0..snaps {
        black_box(shared.snapshot());
    }
    println!(
        "| snapshot of a full 4096-record log (µs) | {:.1} |",
        t.elapsed().as_secs_f64() * 1e6 / snaps as f64
    );
}
