//! GRID_GLOO_ALLREDUCE, the environment override of the automatic all-reduce choice. One test
//! in its own binary: the variable is process-wide.

use backend_gloo::{
    run_ranks, AllreduceAlgorithm, GlooConfig, GlooFactory, Rendezvous, ALLREDUCE_ENV,
};
use grid_core::{Communicator, CommunicatorExt, ReduceOp};
use std::time::Duration;

/// (algorithm of the world communicator, the all-reduce of `elements` f32 on each rank).
fn run(config: &GlooConfig, elements: usize) -> grid_core::Result<Vec<AllreduceAlgorithm>> {
    let out = run_ranks(3, config, |_f, w| {
        let mut v = vec![w.rank() as f32 + 1.0; elements];
        w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        assert!(v.iter().all(|&x| x == 6.0), "wrong sum");
        Ok(w.allreduce_algorithm())
    })?;
    out.into_iter().collect()
}

#[test]
fn the_variable_replaces_auto_only_and_bad_values_are_refused() {
    let cfg = |job: &str| GlooConfig::new(job).with_timeout(Duration::from_secs(60));
    // This binary runs this one test: nothing else reads the variable meanwhile.
    std::env::remove_var(ALLREDUCE_ENV);
    assert_eq!(
        run(&cfg("env-unset"), 1000).unwrap(),
        vec![AllreduceAlgorithm::Auto; 3]
    );

    std::env::set_var(ALLREDUCE_ENV, "bcube");
    assert_eq!(
        run(&cfg("env-bcube"), 1000).unwrap(),
        vec![AllreduceAlgorithm::Bcube; 3]
    );
    // An algorithm set in the configuration wins.
    assert_eq!(
        run(
            &cfg("env-explicit").with_allreduce(AllreduceAlgorithm::Ring),
            1000
        )
        .unwrap(),
        vec![AllreduceAlgorithm::Ring; 3]
    );

    // A segment limit that is not a multiple of the element size, on an odd element count.
    std::env::set_var(ALLREDUCE_ENV, " ring:4099 ");
    assert_eq!(
        run(&cfg("env-ring"), 12_345).unwrap(),
        vec![AllreduceAlgorithm::RingSegments(4099); 3]
    );

    for bad in ["ring:5", "tree", ""] {
        std::env::set_var(ALLREDUCE_ENV, bad);
        let e = run(&cfg("env-bad"), 10).unwrap_err().to_string();
        assert!(
            e.contains(ALLREDUCE_ENV) && e.contains(&format!("{bad:?}")) && e.contains("valid:"),
            "{e}"
        );
        let e = GlooFactory::new(&Rendezvous::in_process().unwrap(), cfg("env-bad-factory"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(ALLREDUCE_ENV) && e.contains("valid:"), "{e}");
    }
    std::env::remove_var(ALLREDUCE_ENV);
}
