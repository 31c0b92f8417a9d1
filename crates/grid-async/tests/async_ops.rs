//! Every async operation on the local backend (ranks as threads), on tokio runtimes: results,
//! errors, start order, dropped futures and the backend's timeout.

use backend_local::{LocalConfig, LocalFactory};
use grid_async::{AsyncComm, AsyncCommunicator, AsyncCommunicatorExt, Completion};
use grid_core::{Communicator, DType, Error, HostBuffer, ReduceOp, Request, Tensor, TimeLimit};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("a tokio runtime for the test")
}

/// Runs `f` on `n` local ranks, each with an `Arc<dyn AsyncCommunicator>` over its world and
/// its own tokio runtime, and returns every rank's result.
fn ranks<R, Fut>(
    n: usize,
    config: LocalConfig,
    f: impl Fn(Arc<dyn AsyncCommunicator>) -> Fut + Sync,
) -> Vec<R>
where
    R: Send,
    Fut: std::future::Future<Output = grid_core::Result<R>>,
{
    backend_local::run(n, &config, |_f: &LocalFactory, world| {
        let comm = AsyncComm::shared(Arc::new(world));
        runtime().block_on(f(comm))
    })
    .unwrap_or_else(|e| panic!("a rank failed: {e}"))
}

#[test]
fn every_collective_point_to_point_and_the_barrier() {
    let out = ranks(4, LocalConfig::default(), |c| async move {
        let (r, n) = (c.rank() as i64, c.size() as i64);
        // Started in this order on every rank, awaited in another order.
        let sum = c.all_reduce_vec(vec![r + 1; 3], ReduceOp::Sum);
        let max = c.all_reduce_vec(vec![r as f32], ReduceOp::Max);
        let bcast = c.broadcast_vec(vec![r * 10; 2], 2);
        let gathered = c.all_gather_vec(vec![r, -r]);
        let scattered = c.reduce_scatter_vec((0..2 * n).collect::<Vec<i64>>(), ReduceOp::Sum);
        let a2a = c.all_to_all_vec((0..n).map(|j| r * 100 + j).collect::<Vec<i64>>());
        let into = c.all_reduce_into(
            Tensor::from(vec![1u8, 2]),
            Tensor::from(vec![0u8; 2]),
            ReduceOp::Sum,
        );
        assert_eq!(a2a.await?, (0..n).map(|j| j * 100 + r).collect::<Vec<_>>());
        assert_eq!(scattered.await?, vec![2 * r * n, (2 * r + 1) * n]);
        assert_eq!(
            gathered.await?,
            (0..n).flat_map(|j| [j, -j]).collect::<Vec<_>>()
        );
        assert_eq!(bcast.await?, vec![20, 20]);
        assert_eq!(max.await?, vec![(n - 1) as f32]);
        assert_eq!(into.await?.into_vec::<u8>()?, vec![4, 8]);
        assert_eq!(sum.await?, vec![n * (n + 1) / 2; 3]);
        // A ring of messages, receives posted before the sends.
        let next = (c.rank() + 1) % c.size();
        let prev = (c.rank() + c.size() - 1) % c.size();
        let recv = c.recv_vec::<i64>(2, prev, 7);
        let sent = c.send_vec(vec![r, r * r], next, 7);
        let p = prev as i64;
        assert_eq!(recv.await?, vec![p, p * p]);
        assert_eq!(sent.await?, vec![r, r * r]);
        c.barrier().await?;
        Ok(c.rank())
    });
    assert_eq!(out, vec![0, 1, 2, 3]);
}

/// The in-place all-gather and reduce-scatter from async code: started together, awaited in
/// the other order; each resolves to the whole buffer (the reduce-scatter's block at rank · 2),
/// and a buffer that is not one block per rank resolves to Indivisible.
#[test]
fn in_place_all_gather_and_reduce_scatter() {
    let out = ranks(3, LocalConfig::default(), |c| async move {
        let (me, n) = (c.rank(), c.size());
        let mut mine = vec![-1i64; 2 * n];
        mine[2 * me] = 10 * me as i64;
        mine[2 * me + 1] = 10 * me as i64 + 1;
        let gathered = c.all_gather_in_place_vec(mine);
        let input: Vec<f64> = (0..2 * n).map(|j| (me + j) as f64).collect();
        let scattered = c.reduce_scatter_in_place_vec(input, ReduceOp::Sum);
        let s = scattered.await?;
        // Element j summed over ranks: n(n-1)/2 + n·j.
        let want: Vec<f64> = (2 * me..2 * me + 2)
            .map(|j| (n * (n - 1) / 2 + n * j) as f64)
            .collect();
        assert_eq!((s.len(), &s[2 * me..2 * me + 2]), (2 * n, &want[..]));
        assert_eq!(
            gathered.await?,
            (0..n as i64)
                .flat_map(|j| [10 * j, 10 * j + 1])
                .collect::<Vec<_>>()
        );
        let bad = c.all_gather_in_place_vec(vec![0u8; 2 * n + 1]).await;
        assert!(
            matches!(bad, Err(grid_core::Error::Indivisible { len, parts: 3, .. }) if len == 2 * n + 1),
            "{bad:?}"
        );
        Ok(me)
    });
    assert_eq!(out, vec![0, 1, 2]);
}

/// The operation set of issue #16 item 7 from async code: uneven all-to-all (rank `s` sends
/// `s + j` elements to rank `j`), all-gather and reduce-scatter with per-rank counts, and the
/// rooted operations from root 1, started together and awaited in another order.
#[test]
fn uneven_and_rooted_operations() {
    let out = ranks(3, LocalConfig::default(), |c| async move {
        let (me, n) = (c.rank(), c.size());
        let send_counts: Vec<usize> = (0..n).map(|j| me + j).collect();
        let recv_counts: Vec<usize> = (0..n).map(|s| s + me).collect();
        let send: Vec<i64> = (0..n)
            .flat_map(|j| (0..me + j).map(move |i| (100 * me + 10 * j + i) as i64))
            .collect();
        let a2a = c.all_to_all_v_vec(send, send_counts, recv_counts);
        let counts = vec![2, 0, 1];
        let agv = c.all_gather_v_vec(vec![me as u32; counts[me]], counts.clone());
        let rsv = c.reduce_scatter_v_vec(vec![me as u64 + 1; 3], counts.clone(), ReduceOp::Sum);
        let red = c.reduce_vec(vec![me as i8, 1], ReduceOp::Max, 1);
        let gat = c.gather_vec(vec![me as f64], 1);
        let sca = c.scatter_vec((me == 1).then(|| vec![5i32, 6, 7, 8, 9, 10]), 2, 1);
        let want: Vec<i64> = (0..n)
            .flat_map(|s| (0..s + me).map(move |i| (100 * s + 10 * me + i) as i64))
            .collect();
        assert_eq!(sca.await?, vec![5 + 2 * me as i32, 6 + 2 * me as i32]);
        let gathered = gat.await?;
        let reduced = red.await?;
        if me == 1 {
            assert_eq!(gathered, vec![0.0, 1.0, 2.0]);
            assert_eq!(reduced, vec![2, 1]);
        } else {
            assert_eq!(gathered, vec![me as f64]);
            assert_eq!(reduced, vec![me as i8, 1]);
        }
        assert_eq!(rsv.await?, vec![6; counts[me]]);
        assert_eq!(agv.await?, vec![0, 0, 2]);
        assert_eq!(a2a.await?, want);
        // Counts that do not describe the buffers resolve to the front end's error.
        let e = c.all_gather_v_vec(vec![1u8], vec![1, 1]).await.unwrap_err();
        assert!(matches!(e, Error::BadCounts { .. }), "{e}");
        let e = c
            .all_to_all_v_vec(vec![1u8], vec![1, 0, 0], vec![usize::MAX, 1, 0])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("does not fit in memory"), "{e}");
        Ok(me)
    });
    assert_eq!(out, vec![0, 1, 2]);
}

#[test]
fn bad_arguments_resolve_to_errors_naming_the_problem() {
    let out = ranks(2, LocalConfig::default(), |c| async move {
        let me = c.rank();
        let self_send = c.send_vec(vec![1i32], me, 0).await;
        assert!(
            matches!(self_send, Err(Error::SelfPeer { peer, size: 2, .. }) if peer == me),
            "{self_send:?}"
        );
        let far = c.recv_vec::<f32>(1, 5, 0).await;
        assert!(
            matches!(
                far,
                Err(Error::PeerOutOfRange {
                    rank: 5,
                    size: 2,
                    ..
                })
            ),
            "{far:?}"
        );
        let uneven = c.reduce_scatter_vec(vec![1i64; 3], ReduceOp::Sum).await;
        assert!(
            matches!(uneven, Err(Error::LengthMismatch { .. })),
            "{uneven:?}"
        );
        let mixed = c
            .all_reduce_into(
                Tensor::from(vec![1i32]),
                Tensor::from(vec![0f32]),
                ReduceOp::Sum,
            )
            .await;
        assert!(
            matches!(
                mixed,
                Err(Error::DTypeMismatch {
                    expected: DType::I32,
                    actual: DType::F32,
                    ..
                })
            ),
            "{mixed:?}"
        );
        let root = c.broadcast_vec(vec![0u8], 9).await;
        assert!(
            matches!(root, Err(Error::PeerOutOfRange { rank: 9, .. })),
            "{root:?}"
        );
        // None of that reached the backend: a collective afterwards still matches.
        c.all_reduce_vec(vec![1i32], ReduceOp::Sum).await
    });
    assert_eq!(out, vec![vec![2], vec![2]]);
}

#[test]
fn a_dropped_future_keeps_its_buffer_until_the_library_is_done() {
    // With rendezvous sends, a send completes only when the receiver took the message, so the
    // send is in flight, using its buffer, long after its future was dropped.
    let config = LocalConfig {
        rendezvous: true,
        ..LocalConfig::default()
    };
    let out = ranks(2, config, |c| async move {
        let payload: Vec<f64> = (0..4096).map(|i| i as f64 * 0.5).collect();
        if c.rank() == 0 {
            let started = c.send_vec(payload.clone(), 1, 3);
            drop(started);
            // Nothing of the send remains on this side except the completion thread's hold.
            c.barrier().await?;
            Ok(true)
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let got = c.recv_vec::<f64>(payload.len(), 0, 3).await?;
            c.barrier().await?;
            Ok(got == payload)
        }
    });
    assert_eq!(out, vec![true, true]);
}

#[test]
fn the_backend_timeout_resolves_the_future_with_its_error() {
    let config = LocalConfig {
        timeout: Duration::from_millis(300),
        ..LocalConfig::default()
    };
    let out = ranks(2, config, |c| async move {
        if c.rank() == 0 {
            // Rank 1 never sends: the receive ends with the backend's timeout, and the runtime
            // serves other tasks meanwhile.
            let t0 = Instant::now();
            let ticker = tokio::spawn(async {
                let mut n = 0u32;
                let mut iv = tokio::time::interval(Duration::from_millis(10));
                while n < 10 {
                    iv.tick().await;
                    n += 1;
                }
                Instant::now()
            });
            let r = c.recv_vec::<i32>(1, 1, 0).await;
            let ticked = ticker.await.map_err(|e| Error::Invalid(e.to_string()))?;
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            assert!(ticked.duration_since(t0) < Duration::from_millis(290));
            Ok(t0.elapsed() >= Duration::from_millis(250))
        } else {
            Ok(true)
        }
    });
    assert_eq!(out, vec![true, true]);
}

#[test]
fn start_returns_a_static_future_that_can_be_spawned() {
    fn spawnable<T: std::future::Future + Send + Unpin + 'static>(_: &T) {}
    let out = backend_local::run(2, &LocalConfig::default(), |_f, world| {
        let comm = AsyncComm::new(Arc::new(world));
        let rt = runtime();
        let done: Completion = comm.start(Request::AllReduce {
            buf: vec![comm.inner().rank() as i32 + 1].into(),
            op: ReduceOp::Prod,
        });
        spawnable(&done);
        let refused = comm.start(Request::Broadcast {
            buf: vec![0u8].into(),
            root: 7,
        });
        assert!(refused.is_completed());
        rt.block_on(async move {
            let joined = tokio::spawn(done)
                .await
                .map_err(|e| Error::Invalid(e.to_string()))?;
            assert!(refused.await.is_err());
            joined?.into_vec::<i32>()
        })
    })
    .unwrap_or_else(|e| panic!("a rank failed: {e}"));
    assert_eq!(out, vec![vec![2], vec![2]]);
}

#[test]
fn abort_from_another_task_and_a_per_operation_limit_resolve_pending_futures() {
    // The default limit is long: the receives below end early only because of the per-operation
    // limit and the abort.
    let config = LocalConfig {
        timeout: Duration::from_secs(60),
        ..LocalConfig::default()
    };
    let out = ranks(2, config, |c| async move {
        assert_eq!(c.time_limit(), TimeLimit::After(Duration::from_secs(60)));
        if c.rank() == 0 {
            // Rank 1 never sends. A 200 ms limit for this receive only.
            let t0 = Instant::now();
            let buf = Tensor::Host(HostBuffer::zeros(DType::I32, 1));
            let r = c
                .run_limited(
                    Request::Recv {
                        buf,
                        peer: 1,
                        tag: 7,
                    },
                    TimeLimit::After(Duration::from_millis(200)),
                )
                .await;
            let took = t0.elapsed();
            assert!(
                matches!(r, Err(Error::Timeout { millis: 200, .. })),
                "{r:?}"
            );
            assert!(took < Duration::from_secs(3), "{took:?}");
            assert!(c.failure().is_some_and(|f| f.op == "recv" && !f.aborted));
            Ok(true)
        } else {
            // A receive nobody sends to, aborted from another task after 200 ms.
            let aborter = {
                let c = Arc::clone(&c);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    c.abort();
                })
            };
            let t0 = Instant::now();
            let r = c.recv_vec::<i32>(1, 0, 8).await;
            let took = t0.elapsed();
            aborter.await.map_err(|e| Error::Invalid(e.to_string()))?;
            assert!(matches!(r, Err(Error::Aborted { .. })), "{r:?}");
            assert!(took < Duration::from_secs(3), "{took:?}");
            assert!(c.failure().is_some_and(|f| f.aborted));
            let later = c.barrier().await;
            assert!(matches!(later, Err(Error::Aborted { .. })), "{later:?}");
            Ok(true)
        }
    });
    assert_eq!(out, vec![true, true]);
}
