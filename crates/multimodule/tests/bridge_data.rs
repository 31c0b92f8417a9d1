//! Bridge transfers with real data on in-memory thread ranks: every element received forward
//! and backward is checked against where it must come from.

mod common;
use common::check::{case, l3};
use common::check::{grid, run_case, Case, Layout};
use common::threads::{run_world, ThreadFactory};
use multimodule::{Activation, BridgeCommunicator, BridgePlan, DimMapping, Error};

/// Runs a case in all four modes (plain/fused × buffered/rendezvous sends).
fn all_modes(mut c: Case) {
    let mut counts = Vec::new();
    for fused in [false, true] {
        for rendezvous in [false, true] {
            c.fused = fused;
            c.rendezvous = rendezvous;
            counts.push(run_case(&c));
        }
    }
    assert!(counts[0] > 0);
    assert!(counts.iter().all(|&n| n == counts[0]), "{counts:?}");
}

#[test]
fn fan_in_dp4_to_tp4() {
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(4, 1, 1, 1, 4),
        l3(2),
        vec![2, 2, 2, 2],
    ));
}

#[test]
fn fan_out_tp2dp2_to_dp4() {
    all_modes(case(
        grid(2, 1, 1, 2, 0),
        grid(1, 1, 1, 4, 4),
        l3(2),
        vec![4, 4],
    ));
}

#[test]
fn one_to_one_tp2() {
    all_modes(case(
        grid(2, 1, 1, 1, 0),
        grid(2, 1, 1, 1, 2),
        l3(3),
        vec![3],
    ));
}

#[test]
fn pp_on_both_sides() {
    // src tp2 pp2 dp2 (0..8) -> dst tp1 pp2 dp4 (8..16): leaders at the last / first stage.
    all_modes(case(
        grid(2, 1, 2, 2, 0),
        grid(1, 1, 2, 4, 8),
        l3(2),
        vec![4, 4],
    ));
}

#[test]
fn two_d_fan_in_and_out() {
    let l2 = Layout {
        ndim: 2,
        dm: DimMapping::default(),
        seq: 1,
        hidden: 4,
    };
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(4, 1, 1, 1, 4),
        l2,
        vec![5, 5, 5, 5],
    ));
    all_modes(case(grid(4, 1, 1, 1, 0), grid(1, 1, 1, 4, 4), l2, vec![10]));
}

#[test]
fn batch_dim_one_mapping() {
    let l = Layout {
        ndim: 3,
        dm: DimMapping::new(0, 1, 2).unwrap(),
        seq: 3,
        hidden: 2,
    };
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(2, 1, 1, 2, 4),
        l,
        vec![2, 2, 2, 2],
    ));
    all_modes(case(grid(2, 1, 1, 1, 0), grid(1, 1, 1, 3, 2), l, vec![7]));
}

#[test]
fn uneven_splits() {
    // 5 rows to 2 destinations (3 + 2), 2 rows to 3 destinations (1 + 1 + 0), uneven lanes.
    all_modes(case(
        grid(2, 1, 2, 2, 0),
        grid(1, 1, 2, 4, 8),
        l3(2),
        vec![5, 5],
    ));
    all_modes(case(
        grid(1, 1, 1, 1, 0),
        grid(1, 1, 1, 3, 1),
        l3(2),
        vec![2],
    ));
    all_modes(case(
        grid(1, 1, 1, 2, 0),
        grid(1, 1, 1, 1, 2),
        l3(2),
        vec![3, 1],
    ));
}

#[test]
fn non_dividing_lanes() {
    all_modes(case(
        grid(1, 1, 1, 3, 0),
        grid(1, 1, 1, 2, 3),
        l3(2),
        vec![4, 4, 4],
    ));
    all_modes(case(
        grid(1, 1, 1, 2, 0),
        grid(2, 1, 1, 3, 2),
        l3(2),
        vec![3, 3],
    ));
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(1, 1, 1, 6, 4),
        l3(1),
        vec![3, 3, 3, 3],
    ));
}

#[test]
fn context_parallel() {
    // cp2 on the source only, on the destination only, and on both (different tp).
    all_modes(case(
        grid(2, 2, 1, 1, 0),
        grid(1, 1, 1, 2, 4),
        l3(5),
        vec![4],
    ));
    all_modes(case(
        grid(1, 1, 1, 2, 0),
        grid(2, 2, 1, 1, 2),
        l3(4),
        vec![2, 2],
    ));
    all_modes(case(
        grid(1, 2, 2, 1, 0),
        grid(2, 2, 1, 1, 4),
        l3(6),
        vec![3],
    ));
    all_modes(case(
        grid(1, 3, 1, 1, 0),
        grid(1, 2, 1, 1, 3),
        l3(7),
        vec![2],
    ));
}

#[test]
fn colocated_grids() {
    // Identical grids, a partial overlap and an overlap with pp > 1 on the source.
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(1, 1, 1, 4, 0),
        l3(2),
        vec![2, 2, 2, 2],
    ));
    all_modes(case(
        grid(2, 1, 1, 2, 0),
        grid(1, 1, 1, 4, 0),
        l3(2),
        vec![4, 4],
    ));
    all_modes(case(
        grid(2, 1, 1, 2, 0),
        grid(1, 1, 1, 4, 2),
        l3(2),
        vec![4, 4],
    ));
    all_modes(case(
        grid(1, 1, 2, 2, 0),
        grid(2, 1, 1, 2, 0),
        l3(2),
        vec![3, 3],
    ));
}

#[test]
fn split_metadata_is_used() {
    // Source lane of 6 samples cut [1, 5] by metadata for two destinations.
    let plan = BridgePlan::new(
        "a",
        grid(1, 1, 1, 1, 0),
        "b",
        grid(1, 1, 1, 2, 1),
        3,
        DimMapping::default(),
    )
    .unwrap();
    let (res, _) = run_world(3, true, |rank, comm| {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 0).unwrap();
        if rank == 0 {
            let t =
                Activation::from_vec(vec![6, 1, 1], (0..6).map(|x| x as f32).collect()).unwrap();
            bridge
                .send_forward(&t.with_split_sizes(vec![1, 5]))
                .unwrap();
            let g = bridge.recv_backward().unwrap().unwrap();
            g.to_vec::<f32>().unwrap()
        } else {
            let t = bridge.recv_forward().unwrap().unwrap();
            let v = t.to_vec::<f32>().unwrap();
            // The gradient goes back with exactly the forward split, whatever tensor_split says.
            bridge
                .send_backward(
                    &Activation::from_vec(t.shape().to_vec(), v.iter().map(|x| x * 10.0).collect())
                        .unwrap(),
                )
                .unwrap();
            v
        }
    });
    assert_eq!(res[0], vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]);
    assert_eq!(res[1], vec![0.0]);
    assert_eq!(res[2], vec![1.0, 2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn gradient_shape_mismatch_is_an_error_not_a_hang() {
    // Fan-in 2 -> 1 (tp2 on the destination): the destination returns a gradient of the wrong
    // batch size. The destination leader refuses it; the sources get PeerError; nobody hangs.
    let plan = BridgePlan::new(
        "a",
        grid(1, 1, 1, 2, 0),
        "b",
        grid(2, 1, 1, 1, 2),
        3,
        DimMapping::default(),
    )
    .unwrap();
    let (res, _) = run_world(4, true, |rank, comm| {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 0).unwrap();
        if rank < 2 {
            bridge
                .send_forward(&Activation::zeros(grid_core::DType::F32, vec![2, 3, 4]).unwrap())
                .unwrap();
            bridge.recv_backward().map(|_| ())
        } else {
            let t = bridge.recv_forward().unwrap().unwrap();
            assert_eq!(t.shape(), &[4, 3, 4]);
            bridge.send_backward(&Activation::zeros(grid_core::DType::F32, vec![3, 3, 4]).unwrap())
        }
    });
    for (r, x) in res.iter().enumerate().take(2) {
        assert!(
            matches!(x, Err(Error::PeerError { peer: 2, .. })),
            "rank {r}: {x:?}"
        );
    }
    for (r, x) in res.iter().enumerate().skip(2) {
        match x {
            Err(Error::GradientMismatch {
                expected, actual, ..
            }) => {
                assert_eq!(expected, &vec![4, 3, 4]);
                assert_eq!(actual, &vec![3, 3, 4]);
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn wrong_side_and_wrong_ndim() {
    let plan = BridgePlan::new(
        "a",
        grid(1, 1, 1, 1, 0),
        "b",
        grid(1, 1, 1, 1, 1),
        3,
        DimMapping::default(),
    )
    .unwrap();
    let (res, _) = run_world(2, false, |rank, comm| {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 0).unwrap();
        if rank == 0 {
            let e1 = bridge.recv_forward().unwrap_err();
            let e2 = bridge
                .send_forward(&Activation::zeros(grid_core::DType::F32, vec![2, 2]).unwrap())
                .unwrap_err();
            (e1.to_string(), e2.to_string())
        } else {
            let e = bridge.recv_forward().unwrap_err();
            (e.to_string(), String::new())
        }
    });
    assert!(
        res[0].0.contains("not in the destination grid"),
        "{}",
        res[0].0
    );
    assert!(res[0].1.contains("3-D"), "{}", res[0].1);
    assert!(res[1].0.contains("rank 0 failed"), "{}", res[1].0);
}
