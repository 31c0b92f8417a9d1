//! The default mismatch check never turns a legal overlap into a hang: a nonblocking
//! collective is checked on the communicator's worker right before it runs, so starting it
//! returns at once even when a peer starts it only after a message this rank sends next.

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{Communicator, CommunicatorExt, MismatchCheck, ReduceOp};
use std::time::{Duration, Instant};

#[test]
fn a_checked_nonblocking_start_does_not_wait_for_the_peers() {
    let cfg = GlooConfig::new("checked-overlap").with_timeout(Duration::from_secs(5));
    let out = run_ranks(2, &cfg, |_f, world| {
        assert_eq!(world.mismatch_check(), MismatchCheck::All);
        let t = Instant::now();
        let sum = if world.rank() == 0 {
            // Start the all-reduce, then send what rank 1 needs before it starts its own.
            let w = world.iall_reduce(vec![1i32, 2], ReduceOp::Sum)?;
            world.send_to(&[7u8][..], 1, 5)?;
            w.wait()?
        } else {
            let mut b = [0u8];
            world.recv_from(&mut b[..], 0, 5)?;
            assert_eq!(b, [7]);
            world.iall_reduce(vec![10i32, 20], ReduceOp::Sum)?.wait()?
        };
        Ok((sum, t.elapsed()))
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let (sum, took) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(sum, vec![11, 22], "rank {rank}");
        // A start that waited for the peer would end at the 5 s time limit.
        assert!(took < Duration::from_secs(3), "rank {rank} took {took:?}");
    }
}
