//! CPU tests: the in-process bootstrap communicator, the unique-id exchange over it, and the
//! error paths of creating the backend where no driver / libnccl / GPU is available.

use backend_nccl::bootstrap::{exchange_unique_id, ID_BYTES};
use backend_nccl::inproc::{InProcess, InProcessComm};
use backend_nccl::{probe, NcclFactory, NcclOptions};
use grid_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, DeviceBuffer, Error, HostBuffer, P2pOp,
    ReduceOp, Request, Tensor,
};
use half::{bf16, f16};
use std::time::Duration;

/// Runs `f` on every rank of an in-process world, one thread each; results in rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(&InProcessComm) -> T + Sync) -> Vec<T> {
    let comms = InProcess::world_with_timeout(n, Duration::from_secs(20));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

// ----- unique-id exchange -------------------------------------------------------------------

fn id_of(seed: u8) -> [u8; ID_BYTES] {
    let mut id = [0u8; ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = seed.wrapping_add(i as u8);
    }
    id
}

#[test]
fn id_reaches_every_rank() {
    for n in [1, 2, 5] {
        let ids = on_ranks(n, |c| {
            exchange_unique_id(c, Ok(()), &mut || {
                assert_eq!(c.rank(), 0, "only rank 0 creates the id");
                Ok(id_of(42))
            })
        });
        for id in ids {
            assert_eq!(id.unwrap(), id_of(42));
        }
    }
}

#[test]
fn a_rank_without_nccl_fails_everyone_without_hanging() {
    let out = on_ranks(4, |c| {
        let local = if c.rank() == 2 {
            Err(Error::Backend {
                backend: "nccl",
                op: "load libnccl",
                message: "libnccl.so not found".into(),
            })
        } else {
            Ok(())
        };
        exchange_unique_id(c, local, &mut || Ok(id_of(1)))
    });
    for (r, res) in out.into_iter().enumerate() {
        let e = res.unwrap_err();
        if r == 2 {
            assert_eq!(
                e.to_string(),
                "nccl: load libnccl failed: libnccl.so not found"
            );
        } else {
            assert_eq!(
                e.to_string(),
                "nccl init: peer rank 2 failed: bootstrap ranks [2] could not set up NCCL (each reports its reason); no NCCL communicator was created"
            );
        }
    }
}

#[test]
fn rank0_failing_to_create_the_id_fails_everyone() {
    let out = on_ranks(3, |c| {
        exchange_unique_id(c, Ok(()), &mut || {
            Err(Error::Backend {
                backend: "nccl",
                op: "ncclGetUniqueId",
                message: "ncclSystemError".into(),
            })
        })
    });
    assert_eq!(
        out[0].as_ref().unwrap_err().to_string(),
        "nccl: ncclGetUniqueId failed: ncclSystemError"
    );
    for r in [1, 2] {
        assert!(
            matches!(out[r], Err(Error::PeerFailed { peer: 0, .. })),
            "{:?}",
            out[r]
        );
    }
}

// ----- creating the backend without GPU -----------------------------------------------------

#[test]
fn init_without_driver_or_libnccl_is_a_clear_error_on_every_rank() {
    if let Ok(n) = probe::gpu_count() {
        println!("SKIPPED: {n} GPU(s) present; this test covers the no-GPU error path");
        return;
    }
    let out = on_ranks(3, |c| {
        NcclFactory::init(c, NcclOptions::default()).map(|_| ())
    });
    let reason = probe::gpu_count().unwrap_err().to_string();
    for res in out {
        let e = res.unwrap_err();
        // Each rank fails locally with the reason (it is the same on every rank here).
        assert_eq!(e.to_string(), reason);
    }
    println!("no-GPU error: {reason}");
    assert!(reason.starts_with("nccl: "), "{reason}");
}

#[test]
fn missing_library_messages_name_candidates_and_directories() {
    match probe::check_libraries() {
        Ok(()) => println!("SKIPPED: the CUDA driver and libnccl load here; nothing is missing"),
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.contains("could not be loaded: cudarc asks the dynamic loader for"),
                "{m}"
            );
            assert!(m.contains("LD_LIBRARY_PATH="), "{m}");
            if m.contains("the CUDA driver library") {
                assert!(m.contains("\"libcuda.so.1\""), "{m}");
                assert!(
                    m.contains("install the NVIDIA driver") || m.contains("Found on disk"),
                    "{m}"
                );
            } else {
                assert!(m.contains("\"libnccl.so\""), "{m}");
            }
        }
    }
}

#[test]
fn version_and_split_minimum() {
    assert_eq!(backend_nccl::MIN_SPLIT_VERSION, (2, 18, 0));
    if let Err(e) = probe::nccl_version() {
        assert!(e.to_string().contains("could not be loaded"), "{e}");
    }
}

// ----- the in-process communicator ------------------------------------------------------------

#[test]
fn inproc_all_reduce_every_op_and_dtype() {
    let n = 3;
    let out = on_ranks(n, |c| {
        let r = c.rank() as i64;
        let mut res = Vec::new();
        let mut f = vec![0f32; 2];
        c.all_reduce_into(
            &[r as f32 + 1.0, -(r as f32)][..],
            &mut f[..],
            ReduceOp::Sum,
        )
        .unwrap();
        res.push(format!("{f:?}"));
        let mut p = vec![0i64; 1];
        c.all_reduce_into(&[r + 2][..], &mut p[..], ReduceOp::Prod)
            .unwrap();
        res.push(format!("{p:?}"));
        let mut m = vec![0i32; 2];
        c.all_reduce_into(&[r as i32, -(r as i32)][..], &mut m[..], ReduceOp::Max)
            .unwrap();
        res.push(format!("{m:?}"));
        let mut u = vec![0u8; 1];
        c.all_reduce_into(&[(r + 5) as u8][..], &mut u[..], ReduceOp::Min)
            .unwrap();
        res.push(format!("{u:?}"));
        let mut a = vec![0f64; 1];
        c.all_reduce_into(&[r as f64][..], &mut a[..], ReduceOp::Avg)
            .unwrap();
        res.push(format!("{a:?}"));
        let mut h = vec![f16::ZERO; 1];
        c.all_reduce_into(&[f16::from_f32(0.5)][..], &mut h[..], ReduceOp::Sum)
            .unwrap();
        res.push(format!("{h:?}"));
        let mut b = vec![bf16::ZERO; 1];
        c.all_reduce_into(&[bf16::from_f32(r as f32)][..], &mut b[..], ReduceOp::Max)
            .unwrap();
        res.push(format!("{b:?}"));
        let e = c
            .all_reduce_into(&[1i32][..], &mut [0i32][..], ReduceOp::Avg)
            .unwrap_err();
        res.push(e.to_string());
        res
    });
    for res in out {
        assert_eq!(
            res,
            vec![
                "[6.0, -3.0]",
                "[24]",
                "[2, 0]",
                "[5]",
                "[1.0]",
                "[1.5]",
                "[2.0]",
                "all_reduce: the inproc backend does not support Avg on i32 (Avg is for floating-point types)",
            ]
        );
    }
}

#[test]
fn inproc_gather_scatter_broadcast_alltoall() {
    let n = 4;
    let out = on_ranks(n, |c| {
        let r = c.rank() as i32;
        let mut g = vec![0i32; 2 * n];
        c.all_gather_into(&[r, 10 * r][..], &mut g[..]).unwrap();
        let send: Vec<i32> = (0..n as i32).map(|i| i + r).collect();
        let mut rs = vec![0i32; 1];
        c.reduce_scatter_into(&send[..], &mut rs[..], ReduceOp::Sum)
            .unwrap();
        let mut b = vec![r; 3];
        c.broadcast_into(&mut b[..], 2).unwrap();
        let a2a_in: Vec<i32> = (0..n as i32).map(|j| 100 * r + j).collect();
        let mut a2a = vec![0i32; n];
        c.all_to_all_into(&a2a_in[..], &mut a2a[..]).unwrap();
        c.barrier().unwrap();
        (g, rs, b, a2a)
    });
    for (r, (g, rs, b, a2a)) in out.into_iter().enumerate() {
        assert_eq!(g, vec![0, 0, 1, 10, 2, 20, 3, 30]);
        assert_eq!(rs, vec![4 * r as i32 + 6]);
        assert_eq!(b, vec![2, 2, 2]);
        assert_eq!(
            a2a,
            (0..n as i32)
                .map(|j| 100 * j + r as i32)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn inproc_point_to_point_and_nonblocking() {
    let out = on_ranks(3, |c| {
        let (me, n) = (c.rank(), c.size());
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        // Ring with receives posted first: deferred receives cannot deadlock.
        let rw = c.irecv::<i64>(2, left, 7).unwrap();
        let sw = c.isend(vec![me as i64, 1], right, 7).unwrap();
        let got = rw.wait().unwrap();
        assert_eq!(sw.wait().unwrap(), vec![me as i64, 1]);
        // batch_p2p in any order.
        let mut from_left = [0u8; 1];
        c.batch_p2p(vec![
            P2pOp::Recv {
                buf: BufMut::from(&mut from_left[..]),
                peer: left,
                tag: 1,
            },
            P2pOp::Send {
                buf: BufRef::from(&[me as u8][..]),
                peer: right,
                tag: 1,
            },
        ])
        .unwrap();
        // Nonblocking collective.
        let s = c
            .iall_reduce(vec![1.0f32, me as f32], ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        (got, from_left[0], s)
    });
    for (me, (got, fl, s)) in out.into_iter().enumerate() {
        let left = (me + 2) % 3;
        assert_eq!(got, vec![left as i64, 1]);
        assert_eq!(fl, left as u8);
        assert_eq!(s, vec![3.0, 3.0]);
    }
}

#[test]
fn inproc_timeout_names_the_missing_rank() {
    let comms = InProcess::world_with_timeout(3, Duration::from_millis(200));
    // Rank 2 never arrives.
    let errs: Vec<Error> = std::thread::scope(|s| {
        let hs: Vec<_> = comms[..2]
            .iter()
            .map(|c| s.spawn(|| c.barrier().unwrap_err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert_eq!(
            e,
            Error::Timeout {
                op: "barrier",
                millis: 200,
                peer: Some(2)
            }
        );
    }
    // The world is still usable afterwards.
    let ok = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| c.barrier())).collect();
        hs.into_iter().all(|h| h.join().unwrap().is_ok())
    });
    assert!(ok);
}

#[derive(Debug)]
struct FakeGpu;
impl DeviceBuffer for FakeGpu {
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn len(&self) -> usize {
        1
    }
    fn device(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[test]
fn inproc_rejects_device_memory_and_bad_arguments() {
    let c = &InProcess::world(1)[0];
    assert!(!c.accepts(grid_core::Memory::Device));
    let e = c.broadcast(BufMut::Device(&mut FakeGpu), 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "broadcast: the inproc backend does not support device memory (1 f32 elements on device 0): this backend moves host memory only; copy it to the host or use the NCCL backend"
    );
    let e = c.start(Request::Barrier).and_then(|w| w.wait()).unwrap();
    assert_eq!(e.dtype(), DType::U8);
    let e = c
        .all_gather_into(&[1u8][..], &mut [0u8; 2][..])
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "all_gather: recv buffer has 2 elements, expected 1"
    );
    let e = c.send_to(&[1u8][..], 1, 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "send: peer 1 is not a rank of this communicator of size 1 (valid: 0..1)"
    );
    let e = c.start(Request::Recv {
        buf: Tensor::Host(HostBuffer::zeros(DType::I32, 1)),
        peer: 3,
        tag: 0,
    });
    assert!(matches!(e, Err(Error::PeerOutOfRange { .. })));
}
