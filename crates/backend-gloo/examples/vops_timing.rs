//! Side-by-side timing of the operations built from the shim's length protocol against Gloo's
//! own algorithm for the same data: `all_to_all_v` with equal counts against `all_to_all`
//! (Gloo's `alltoall`), and `all_gather_v` with equal counts against `all_gather` (Gloo's ring
//! `allgather`), alternating call by call on one communicator (ranks as threads). The mismatch
//! check is off, so the algorithms are compared, not the checks (the all-to-all-v's check
//! exchanges the counts as well: docs/operations.md).
//!
//! Run: `cargo run -p backend-gloo --example vops_timing -- 2 3`
//!
//! The arguments are the number of ranks and of repetitions (default 4 and 15; `cargo xtask
//! test` runs the quick form above, as a check that it works). It prints, per block size, the
//! median time of each and their ratio; for figures worth comparing, build it with `--release`
//! and keep the defaults.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{Communicator, CommunicatorExt, MismatchCheck};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let ranks: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(15);
    // Bytes per block (one peer's share).
    let sizes = [1usize << 10, 64 << 10, 1 << 20, 8 << 20];
    let cfg = GlooConfig::new("vops-timing").with_timeout(Duration::from_secs(120));
    let results = run_ranks(ranks, &cfg, move |_f, w| {
        w.set_mismatch_check(MismatchCheck::Off);
        let n = w.size();
        let mut rows = Vec::new();
        for &bytes in &sizes {
            let block = bytes / 4;
            let send = vec![1.0f32; block * n];
            let mut recv = vec![0.0f32; block * n];
            let counts = vec![block; n];
            let (mut a2a, mut a2av, mut ag, mut agv) = (vec![], vec![], vec![], vec![]);
            // One warm-up call of each.
            w.all_to_all_into(&send, &mut recv)?;
            w.all_to_all_v_into(&send, &counts, &mut recv, &counts)?;
            for _ in 0..reps {
                w.barrier()?;
                let t = Instant::now();
                w.all_to_all_into(&send, &mut recv)?;
                a2a.push(t.elapsed());
                w.barrier()?;
                let t = Instant::now();
                w.all_to_all_v_into(&send, &counts, &mut recv, &counts)?;
                a2av.push(t.elapsed());
                w.barrier()?;
                let t = Instant::now();
                w.all_gather_into(&send[..block], &mut recv)?;
                ag.push(t.elapsed());
                w.barrier()?;
                let t = Instant::now();
                w.all_gather_v_into(&send[..block], &mut recv, &counts)?;
                agv.push(t.elapsed());
            }
            rows.push((bytes, median(a2a), median(a2av), median(ag), median(agv)));
        }
        Ok(rows)
    })
    .expect("ranks");
    let rows = match &results[0] {
        Ok(r) => r.clone(),
        Err(e) => panic!("rank 0: {e}"),
    };
    println!(
        "{ranks} ranks (threads), {reps} reps, medians of rank 0, mismatch check off; block = bytes per peer"
    );
    println!("| block | all_to_all | all_to_all_v | ratio | all_gather | all_gather_v | ratio |");
    println!("|---|---|---|---|---|---|---|");
    for (bytes, a, av, g, gv) in rows {
        println!(
            "| {} KiB | {:.1?} | {:.1?} | {:.2} | {:.1?} | {:.1?} | {:.2} |",
            bytes / 1024,
            a,
            av,
            av.as_secs_f64() / a.as_secs_f64(),
            g,
            gv,
            gv.as_secs_f64() / g.as_secs_f64()
        );
    }
}
