//! The overlap scenario (examples/common/overlap.rs) as tests, on Gloo (ranks as threads) and
//! on MPI (4 processes under mpirun): results are checked, the dp all-reduce and the pp receive
//! are in flight together, and each rank's two-thread tokio runtime keeps serving a timer task
//! at its period while operations wait for late peers (600 ms) — so no worker thread is
//! blocked. Everything goes through `Arc<dyn AsyncCommunicator>`.

#[path = "../examples/common/overlap.rs"]
mod overlap;

use grid_async::{AsyncComm, AsyncCommunicator};
use grid_core::{build_collection, Communicator, Error, GroupFactory, LayoutConfig, LayoutPlan};
use std::sync::Arc;
use std::time::Duration;

/// Builds the dp × pp (pp = 2) collection on `world` and runs the scenario on this rank.
fn scenario<F>(factory: &F, world: &F::Comm) -> Result<overlap::Report, String>
where
    F: GroupFactory,
    F::Comm: 'static,
{
    let mut layout = LayoutConfig::new(world.size());
    layout.pp = 2;
    let plan = LayoutPlan::new(layout).map_err(|e| e.to_string())?;
    let built = build_collection(factory, world, &plan).map_err(|e| e.to_string())?;
    let family = |name: &str| -> Result<Arc<dyn AsyncCommunicator>, String> {
        let comm: Arc<dyn Communicator> = built
            .collection
            .get(name)
            .map_err(|e| e.to_string())?
            .cloned()
            .ok_or_else(|| format!("rank {} has no {name} communicator", world.rank()))?;
        Ok(AsyncComm::shared(comm))
    };
    let settings = overlap::Settings::default();
    let report = overlap::run(family("dp")?, family("pp")?, &settings)?;
    overlap::check(&report, &settings, overlap::gap_limit(&settings))?;
    // The rank whose two operations both waited must have seen them together.
    if world.rank() == 2 && report.overlapped != Some(true) {
        return Err(format!("rank 2 did not report its overlap: {report:?}"));
    }
    Ok(report)
}

#[test]
fn gloo_threads_overlap_keeps_the_runtime_serving() {
    let config = backend_gloo::GlooConfig::new("grid-async-overlap-test")
        .with_timeout(Duration::from_secs(60));
    let results = backend_gloo::run_ranks(4, &config, |factory, world| {
        scenario(factory, &world).map_err(Error::Invalid)
    })
    .unwrap_or_else(|e| panic!("the Gloo ranks did not start: {e}"));
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                assert_eq!(r.iterations, overlap::Settings::default().iterations);
                assert!(r.ticks > 10, "rank {rank}: only {} timer ticks", r.ticks);
            }
            Err(e) => panic!("rank {rank}: {e}"),
        }
    }
}

backend_mpi::mpi_test!(mpi_async_overlap_np4, np = 4, timeout = 120, |rt| {
    let report = scenario(&backend_mpi::MpiFactory::new(), rt.world())?;
    if report.ticks <= 10 {
        return Err(format!("only {} timer ticks", report.ticks));
    }
    Ok(())
});
