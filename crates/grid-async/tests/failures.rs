//! The failure handling of the backends reaches async callers unchanged: Gloo's per-operation
//! timeout and `abort` resolve the futures with the backend's errors, and the runtime keeps
//! serving other tasks while an operation waits for its timeout.

use backend_gloo::{run_ranks, GlooConfig};
use grid_async::{AsyncComm, AsyncCommunicator, AsyncCommunicatorExt};
use grid_core::{Communicator, Error, GroupFactory, ReduceOp};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[test]
fn gloo_timeout_and_abort_resolve_the_futures() {
    let timeout = Duration::from_millis(500);
    let cfg = GlooConfig::new("grid-async-failures").with_timeout(timeout);
    let gate = Barrier::new(2);
    let out = run_ranks(2, &cfg, |f, world| {
        // A second communicator for the abort (the first one dies with the timeout).
        let other = f
            .create_group(&world, &[0, 1])?
            .ok_or_else(|| Error::Invalid("rank outside [0, 1]".into()))?;
        if world.rank() == 1 {
            // Sends nothing; stays alive until rank 0 is done.
            gate.wait();
            return Ok(None);
        }
        let world: Arc<dyn AsyncCommunicator> = AsyncComm::shared(Arc::new(world));
        let other = AsyncComm::new(Arc::new(other));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let seen = rt.block_on(async {
            let ticker = tokio::spawn(async {
                let mut iv = tokio::time::interval(Duration::from_millis(20));
                let t0 = Instant::now();
                let mut ticks = 0u32;
                while t0.elapsed() < Duration::from_millis(300) {
                    iv.tick().await;
                    ticks += 1;
                }
                ticks
            });
            let t = Instant::now();
            let recv = world.recv_vec::<u8>(4, 1, 3).await;
            let took = t.elapsed();
            let ticks = ticker.await.map_err(|e| Error::Invalid(e.to_string()))?;
            other.inner().abort();
            let aborted = other.all_reduce_vec(vec![1i32], ReduceOp::Sum).await;
            Ok::<_, Error>((recv, took, ticks, aborted))
        });
        gate.wait();
        seen.map(Some)
    })
    .unwrap_or_else(|e| panic!("the Gloo ranks did not start: {e}"));
    let Some((recv, took, ticks, aborted)) = out[0]
        .as_ref()
        .unwrap_or_else(|e| panic!("rank 0: {e}"))
        .clone()
    else {
        panic!("rank 0 reported nothing");
    };
    assert!(
        matches!(recv, Err(Error::Timeout { op: "recv", .. })),
        "{recv:?}"
    );
    assert!(took >= timeout - Duration::from_millis(50), "{took:?}");
    assert!(took <= timeout + Duration::from_millis(1500), "{took:?}");
    // 300 ms of 20 ms ticks while the receive waited: at least half of them.
    assert!(ticks >= 8, "the runtime served only {ticks} ticks");
    assert!(
        matches!(
            aborted,
            Err(Error::Aborted {
                op: "all_reduce",
                ..
            })
        ),
        "{aborted:?}"
    );
}
