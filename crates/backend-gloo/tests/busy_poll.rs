//! `GlooConfig::busy_poll` and GRID_GLOO_BUSY_POLL: libgloo's collectives give the same results
//! with the transport thread polling or sleeping, on the world and on sub-groups, and the
//! variable is applied only to the default and refused when it is not a switch. One test in its
//! own binary: the variable is process-wide.

use backend_gloo::{run_ranks, GlooConfig, GlooFactory, Rendezvous, BUSY_POLL_ENV};
use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
use std::time::Duration;

/// Elements per rank: 1 MiB of f32, past the one-round limit, so every collective below runs
/// libgloo's algorithm.
const K: usize = 1 << 18;

/// Runs libgloo's collectives on 3 ranks and on a sub-group of 2, checking every result; returns
/// each rank's `busy_poll()` of the world and of its group.
fn run(config: &GlooConfig) -> grid_core::Result<Vec<(bool, bool)>> {
    let out = run_ranks(3, config, |f, w| {
        let (me, n) = (w.rank(), w.size());
        let mut sum = vec![me as f32 + 1.0; K];
        w.all_reduce_in_place(&mut sum[..], ReduceOp::Sum)?;
        assert!(sum.iter().all(|&x| x == 6.0), "rank {me}: all-reduce");
        let mut b = vec![me as i32; K];
        w.broadcast_into(&mut b, 1)?;
        assert!(b.iter().all(|&x| x == 1), "rank {me}: broadcast");
        let mut g = vec![0i32; K * n];
        w.all_gather_into(&vec![me as i32; K], &mut g)?;
        for (j, block) in g.chunks_exact(K).enumerate() {
            assert!(
                block.iter().all(|&x| x == j as i32),
                "rank {me}: all-gather block {j}"
            );
        }
        let mut rs = vec![0i64; K];
        w.reduce_scatter_into(&vec![me as i64 + 1; K * n], &mut rs, ReduceOp::Sum)?;
        assert!(rs.iter().all(|&x| x == 6), "rank {me}: reduce-scatter");
        let mut a = vec![0u8; 4 * K * n];
        w.all_to_all_into(&vec![me as u8; 4 * K * n], &mut a)?;
        for (j, block) in a.chunks_exact(4 * K).enumerate() {
            assert!(
                block.iter().all(|&x| x == j as u8),
                "rank {me}: all-to-all block {j}"
            );
        }
        w.barrier()?;
        // Ranks 0 and 2 in a group of their own (rank 1 alone in another).
        let sub = f
            .split(&w, Some(u32::from(me == 1)), me)?
            .expect("every rank has a colour");
        let mut s = vec![1.0f32; K];
        sub.all_reduce_in_place(&mut s[..], ReduceOp::Sum)?;
        let want = sub.size() as f32;
        assert!(s.iter().all(|&x| x == want), "rank {me}: group all-reduce");
        Ok((w.busy_poll(), sub.busy_poll()))
    })?;
    out.into_iter().collect()
}

#[test]
fn results_are_the_same_polling_or_not_and_the_variable_sets_the_default_only() {
    let cfg = |job: &str| GlooConfig::new(job).with_timeout(Duration::from_secs(60));
    // This binary runs this one test: nothing else reads the variable meanwhile.
    std::env::remove_var(BUSY_POLL_ENV);
    assert_eq!(run(&cfg("poll-default")).unwrap(), vec![(true, true); 3]);
    assert_eq!(
        run(&cfg("poll-off").with_busy_poll(false)).unwrap(),
        vec![(false, false); 3]
    );

    std::env::set_var(BUSY_POLL_ENV, " 0 ");
    assert_eq!(run(&cfg("poll-env-off")).unwrap(), vec![(false, false); 3]);
    std::env::set_var(BUSY_POLL_ENV, "1");
    assert_eq!(
        run(&cfg("poll-env-on-explicit-off").with_busy_poll(false)).unwrap(),
        vec![(false, false); 3],
        "a value set in the configuration stays"
    );

    for bad in ["yes", "2", ""] {
        std::env::set_var(BUSY_POLL_ENV, bad);
        let e = GlooFactory::new(&Rendezvous::in_process().unwrap(), cfg("poll-env-bad"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains(BUSY_POLL_ENV) && e.contains(&format!("{bad:?}")) && e.contains("use 1"),
            "{e}"
        );
    }
    std::env::remove_var(BUSY_POLL_ENV);
}
