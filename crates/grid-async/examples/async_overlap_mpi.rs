//! An all-reduce on the data-parallel group overlapped with point-to-point on the pipeline
//! group, from one tokio task set per rank, through `Arc<dyn AsyncCommunicator>`, on MPI.
//!
//! Run: `cargo build -p grid-async --example async_overlap_mpi && mpirun -np 4 target/debug/examples/async_overlap_mpi`
//!
//! (As root, Open MPI also wants `--allow-run-as-root`; on a machine with fewer cores than
//! ranks, `--oversubscribe`.) The layout is pipeline parallel 2 with data parallel filling the
//! rest (2 at 4 ranks). Each rank drives a two-thread tokio runtime: per iteration one task
//! all-reduces a gradient over `dp` while another sends (stage 0) or receives (stage 1) an
//! activation over `pp`, and a timer task ticks every 25 ms. In the first two iterations the
//! peers join 600 ms late; the timer keeps ticking all the same, because waiting happens on
//! grid-async's completion threads, not on the runtime's workers. Every rank prints what it
//! saw; the job fails if a result is wrong or a timer stalled on any rank.

#[path = "common/overlap.rs"]
mod overlap;

use backend_mpi::{MpiFactory, MpiRuntime};
use grid_async::{AsyncComm, AsyncCommunicator};
use grid_core::{
    build_collection, Communicator, CommunicatorExt, Error, LayoutConfig, LayoutPlan, ReduceOp,
};
use std::process::ExitCode;
use std::sync::Arc;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("async_overlap_mpi: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, Error> {
    // MPI, once per process; dropping the runtime at the end of `run` finalizes MPI.
    let runtime = MpiRuntime::init()?;
    let world = runtime.world();
    let me = world.rank();
    let mut layout = LayoutConfig::new(world.size());
    layout.pp = 2;
    let plan = LayoutPlan::new(layout)?;
    let built = build_collection(&MpiFactory::new(), world, &plan)?;
    let family = |name: &str| -> Result<Arc<dyn AsyncCommunicator>, Error> {
        // Through `Arc<dyn Communicator>`, as a framework holding erased communicators would.
        let comm: Arc<dyn Communicator> = built
            .collection
            .get(name)?
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("rank {me} has no {name} communicator")))?;
        Ok(AsyncComm::shared(comm))
    };
    let settings = overlap::Settings::default();
    let limit = overlap::gap_limit(&settings);
    let outcome = overlap::run(family("dp")?, family("pp")?, &settings)
        .and_then(|r| overlap::check(&r, &settings, limit).map(|()| r));
    let ok = match &outcome {
        Ok(r) => {
            println!("rank {me}: {}", overlap::describe(r, limit));
            true
        }
        Err(e) => {
            eprintln!("rank {me}: FAILED: {e}");
            false
        }
    };
    // Every rank's verdict, summed on the world communicator, so all ranks agree on the exit.
    let mut failures = [0i64];
    world.all_reduce_into(&[i64::from(!ok)], &mut failures[..], ReduceOp::Sum)?;
    if me == 0 {
        if failures[0] == 0 {
            println!("async_overlap_mpi: all {} ranks passed", world.size());
        } else {
            eprintln!("async_overlap_mpi: {} rank(s) failed", failures[0]);
        }
    }
    Ok(failures[0] == 0)
}
