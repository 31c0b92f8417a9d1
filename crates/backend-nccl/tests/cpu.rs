//! CPU tests: the unique-id exchange over a bootstrap communicator (backend-local, ranks as
//! threads), the error paths of creating the backend where no driver / libnccl / GPU is
//! available, and what the backend declares to the front end.

use backend_local::{LocalComm, LocalConfig, LocalWorld};
use backend_nccl::bootstrap::{exchange_unique_id, ID_BYTES};
use backend_nccl::{probe, NcclFactory, NcclOptions};
use grid_core::{Communicator, DType, Error, LibraryError, ReduceOp};
use std::time::Duration;

/// Runs `f` on every rank of a local world, one thread each; results in rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(&LocalComm) -> T + Sync) -> Vec<T> {
    let config = LocalConfig {
        timeout: Duration::from_secs(20),
        ..LocalConfig::default()
    };
    let comms = LocalWorld::with_config(n, config)
        .expect("a local world of a valid size")
        .communicators();
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
            Err(LibraryError::new("nccl", "load libnccl", "libnccl.so not found").into())
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
            Err(
                LibraryError::new("nccl", "ncclGetUniqueId", "unhandled system error")
                    .code(2)
                    .class("ncclSystemError")
                    .into(),
            )
        })
    });
    assert_eq!(
        out[0].as_ref().unwrap_err().to_string(),
        "nccl: ncclGetUniqueId failed (ncclSystemError, code 2): unhandled system error"
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
        println!("NOT RUN: {n} GPU(s) present; this test covers the no-GPU error path");
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
        Ok(()) => println!("NOT RUN: the CUDA driver and libnccl load here; nothing is missing"),
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

// ----- what the backend declares to the front end ------------------------------------------

/// The front end rejects unsupported reductions from this table before NCCL sees them: every
/// dtype moves; every reduction works except `Avg` (ncclAvg) on integers and `Bool`; fp8
/// reduces only with NCCL >= 2.24 on compute capability 9.0 or newer.
#[test]
fn supported_dtypes_and_reductions() {
    use backend_nccl::comm::Capabilities;
    let hopper_new = Capabilities::new((2, 24, 0), (9, 0));
    let hopper_old = Capabilities::new((2, 23, 4), (9, 0));
    let ampere_new = Capabilities::new((2, 30, 1), (8, 6));
    let blackwell = Capabilities::new((3, 0, 0), (10, 0));
    for caps in [hopper_new, hopper_old, ampere_new, blackwell] {
        let fp8 = caps == hopper_new || caps == blackwell;
        assert_eq!(caps.fp8_reductions(), fp8, "{caps:?}");
        for d in DType::ALL {
            assert!(caps.supports(d, None), "{d} moves");
            for r in ReduceOp::ALL {
                let want = match d {
                    DType::F8E4M3 | DType::F8E5M2 => fp8,
                    DType::Bool => r != ReduceOp::Avg,
                    DType::F32 | DType::F64 | DType::F16 | DType::BF16 => true,
                    _ => r != ReduceOp::Avg,
                };
                assert_eq!(caps.supports(d, Some(r)), want, "{d} {r} {caps:?}");
            }
        }
    }
    // The version decision alone, a pure function of the version number.
    use backend_nccl::comm::has_fp8_types;
    for (v, want) in [
        ((2, 18, 5), false),
        ((2, 23, 4), false),
        ((2, 24, 0), true),
        ((2, 24, 3), true),
        ((2, 30, 1), true),
        ((3, 0, 0), true),
    ] {
        assert_eq!(has_fp8_types(v), want, "{v:?}");
    }
    assert_eq!(backend_nccl::comm::FP8_VERSION, (2, 24, 0));
    // The reasons an unsupported reduction names.
    assert_eq!(
        hopper_old.describe_reductions(DType::F8E4M3),
        "NCCL 2.23.4 has no fp8 types (NCCL >= 2.24.0 reduces fp8); fp8 is only moved, as bytes"
    );
    assert_eq!(
        ampere_new.describe_reductions(DType::F8E5M2),
        "NCCL reduces fp8 on compute capability 9.0 or newer, this GPU has 8.6; fp8 is only moved, as bytes"
    );
}

/// Errors of setting up NCCL are library errors naming the backend, so callers can tell them
/// from argument errors.
#[test]
fn setup_errors_are_library_errors() {
    match probe::gpu_count() {
        Ok(n) => println!("NOT RUN: {n} GPU(s) present; this test covers the no-GPU error path"),
        Err(e) => {
            let Error::Library(l) = &e else {
                panic!("not a library error: {e:?}")
            };
            assert_eq!(l.backend, "nccl");
            assert!(e.is_communication());
        }
    }
}

// ----- device choice ------------------------------------------------------------------------

/// Two NCCL ranks of one process asking for one GPU: the second is refused at once, naming the
/// device and what to do (NCCL would hang); the GPU is free again once the first lets go.
#[test]
fn two_ranks_of_one_process_cannot_claim_one_gpu() {
    use backend_nccl::bootstrap::{choose_device, claim_device};
    // Threads of one process with an explicit device each get distinct GPUs...
    let a = claim_device(choose_device(Some(2), None, 0, 4).unwrap()).unwrap();
    let b = claim_device(choose_device(Some(3), None, 1, 4).unwrap()).unwrap();
    assert_eq!((a.device(), b.device()), (2, 3));
    // ...and a third asking for device 2 is refused.
    let e = claim_device(2).unwrap_err();
    assert_eq!(
        e.to_string(),
        "nccl init: device 2 is already used by another NCCL rank of this process (NCCL does not support two ranks on one GPU and may hang); give each rank its own GPU: NcclOptions::device, CUDA_VISIBLE_DEVICES, or a node-local rank (LOCAL_RANK, ...) per process"
    );
    drop(a);
    assert_eq!(claim_device(2).unwrap().device(), 2);
}

/// Several unique ids (`ncclCommInitRankScalable`): each root creates one, every rank gets all
/// of them in root order; a root that cannot set up fails every rank without a hang.
#[test]
fn several_roots_exchange_their_ids() {
    use backend_nccl::bootstrap::{exchange_unique_ids, root_count, root_ranks};
    let roots = root_ranks(7, root_count(7, 3, true));
    assert_eq!(roots, vec![0, 3, 5]);
    let out = on_ranks(7, |c| {
        let me = c.rank() as u8;
        exchange_unique_ids(c, Ok(()), &roots, &mut || Ok(id_of(me)))
    });
    for res in out {
        assert_eq!(res.unwrap(), vec![id_of(0), id_of(3), id_of(5)]);
    }
    let out = on_ranks(7, |c| {
        let local = if c.rank() == 3 {
            Err(LibraryError::new("nccl", "load libnccl", "libnccl.so not found").into())
        } else {
            Ok(())
        };
        exchange_unique_ids(c, local, &roots, &mut || Ok(id_of(9)))
    });
    for (r, res) in out.into_iter().enumerate() {
        let e = res.unwrap_err().to_string();
        if r != 3 {
            assert!(
                e.contains("bootstrap ranks [3] could not set up NCCL"),
                "{e}"
            );
        }
    }
}
