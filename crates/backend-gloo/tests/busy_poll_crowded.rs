//! Busy polling on a crowded host: on a communicator whose ranks all run on this host over
//! loopback and outnumber this process's cores, libgloo's collectives of
//! `BUSY_POLL_CROWDED_BELOW` bytes and more run with the transport thread sleeping; the results
//! are the same either side of the limit, and the limit is set only where the rule says. The
//! broadcasts' own limit (`BROADCAST_BUSY_POLL_BELOW`, on every communicator): exact either side.

use backend_gloo::{run_ranks, GlooConfig, BROADCAST_BUSY_POLL_BELOW, BUSY_POLL_CROWDED_BELOW};
use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
use std::time::Duration;

fn cores() -> usize {
    std::thread::available_parallelism().map_or(usize::MAX, |n| n.get())
}

fn limit_for(ranks: usize) -> usize {
    if ranks > cores() {
        BUSY_POLL_CROWDED_BELOW
    } else {
        usize::MAX
    }
}

// Two ranks (crowded or not), bytes just below and at the broadcasts' limit, from either root.
#[test]
fn broadcasts_either_side_of_their_limit_are_exact() {
    let cfg = GlooConfig::new("poll-broadcast").with_timeout(Duration::from_secs(120));
    let out = run_ranks(2, &cfg, |_f, w| {
        let me = w.rank();
        for (len, root) in [
            (BROADCAST_BUSY_POLL_BELOW / 4 - 1, 0),
            (BROADCAST_BUSY_POLL_BELOW / 4, 1),
        ] {
            let mut b: Vec<f32> = (0..len).map(|i| (i % 1021) as f32 + me as f32).collect();
            w.broadcast_into(&mut b, root)?;
            let wrong = b
                .iter()
                .enumerate()
                .position(|(i, &x)| x != (i % 1021) as f32 + root as f32);
            assert_eq!(wrong, None, "rank {me}: broadcast of {len} from {root}");
        }
        Ok(())
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn collectives_either_side_of_the_limit_are_exact_and_the_limit_follows_the_rule() {
    // f32 elements of the largest buffer: one below the limit, and at it.
    let below = BUSY_POLL_CROWDED_BELOW / 4 - 1;
    let at = BUSY_POLL_CROWDED_BELOW / 4;
    let cfg = GlooConfig::new("poll-crowded").with_timeout(Duration::from_secs(120));
    let out = run_ranks(3, &cfg, |f, w| {
        let (me, n) = (w.rank(), w.size());
        for len in [below, at] {
            let mut sum = vec![me as f32 + 1.0; len];
            w.all_reduce_in_place(&mut sum[..], ReduceOp::Sum)?;
            assert!(
                sum.iter().all(|&x| x == 6.0),
                "rank {me}: all-reduce of {len}"
            );
            let mut b = vec![me as f32; len];
            w.broadcast_into(&mut b, 2)?;
            assert!(b.iter().all(|&x| x == 2.0), "rank {me}: broadcast of {len}");
        }
        // The all-gather's output is its largest buffer: n blocks just under and at the limit.
        for block in [below / n, at / n + 1] {
            let mut g = vec![0.0f32; block * n];
            w.all_gather_into(&vec![me as f32; block], &mut g)?;
            for (j, part) in g.chunks_exact(block).enumerate() {
                assert!(
                    part.iter().all(|&x| x == j as f32),
                    "rank {me}: all-gather block {j} of {block}"
                );
            }
        }
        // Ranks 0 and 2 in a group (rank 1 alone): the group's own limit follows its size.
        let sub = f
            .split(&w, Some(u32::from(me == 1)), me)?
            .expect("every rank has a colour");
        let mut s = vec![1.0f32; at];
        sub.all_reduce_in_place(&mut s[..], ReduceOp::Sum)?;
        let want = sub.size() as f32;
        assert!(s.iter().all(|&x| x == want), "rank {me}: group all-reduce");
        Ok((w.busy_poll_below(), sub.size(), sub.busy_poll_below()))
    })
    .unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let (world, sub_size, sub) = r.unwrap();
        assert_eq!(
            world,
            limit_for(3),
            "rank {rank}: world of 3 on {} cores",
            cores()
        );
        assert_eq!(sub, limit_for(sub_size), "rank {rank}: group of {sub_size}");
    }
}
