//! An all-reduce on the data-parallel group overlapped with point-to-point on the pipeline
//! group, from one tokio task set per rank, through `Arc<dyn AsyncCommunicator>`, on Gloo.
//!
//! Run: `cargo run -p grid-async --example async_overlap_gloo`
//!
//! Four Gloo ranks run as threads of this process (in-process rendezvous); the layout is data
//! parallel 2 × pipeline parallel 2. Each rank drives its own two-thread tokio runtime: per
//! iteration one task all-reduces a gradient over `dp` while another sends (stage 0) or
//! receives (stage 1) an activation over `pp`, and a timer task ticks every 25 ms. In the first
//! two iterations the peers join 600 ms late; the timer keeps ticking all the same, because
//! waiting happens on grid-async's completion threads, not on the runtime's workers. Each rank
//! prints what it saw; the program fails if a result is wrong or the timer stalled.

#[path = "common/overlap.rs"]
mod overlap;

use backend_gloo::{run_ranks, GlooConfig};
use grid_async::{AsyncComm, AsyncCommunicator};
use grid_core::{build_collection, Communicator, Error, LayoutConfig, LayoutPlan};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

const RANKS: usize = 4;

fn main() -> ExitCode {
    let settings = overlap::Settings::default();
    let limit = overlap::gap_limit(&settings);
    let config = GlooConfig::new("async-overlap-gloo").with_timeout(Duration::from_secs(60));
    let results = run_ranks(RANKS, &config, |factory, world| {
        let mut layout = LayoutConfig::new(world.size());
        layout.pp = 2;
        let plan = LayoutPlan::new(layout)?;
        let built = build_collection(factory, &world, &plan)?;
        let family = |name: &str| -> Result<Arc<dyn AsyncCommunicator>, Error> {
            let comm = built.collection.get(name)?.cloned().ok_or_else(|| {
                Error::Invalid(format!("rank {} has no {name} communicator", world.rank()))
            })?;
            Ok(AsyncComm::shared(comm))
        };
        let report =
            overlap::run(family("dp")?, family("pp")?, &settings).map_err(Error::Invalid)?;
        overlap::check(&report, &settings, limit).map_err(Error::Invalid)?;
        Ok(report)
    });
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            eprintln!("async_overlap_gloo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => println!("rank {rank}: {}", overlap::describe(&r, limit)),
            Err(e) => {
                eprintln!("rank {rank}: FAILED: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        println!("async_overlap_gloo: all {RANKS} ranks passed");
        ExitCode::SUCCESS
    }
}
