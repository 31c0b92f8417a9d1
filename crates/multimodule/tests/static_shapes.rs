//! Static, learned and variable shapes (`ShapeMode`) on thread ranks and on Gloo: every element
//! checked, the header round trip gone where the shape is expected (counted in `batch_p2p`
//! rounds), and a tensor that does not match the declared shape is an error on its sender
//! before anything is sent, with an error (never a hang, never misread data) on its peers; the
//! bridge keeps working afterwards.

mod common;
use backend_gloo::{run_ranks, GlooConfig};
use common::check::{case, l3};
use common::check::{dst_rows, grad_of, grid, plan_of, run_rank, value, world_of, Case, Layout};
use common::scenarios::{
    two_encoders_rank_with, two_encoders_spec, two_encoders_static_modes, LAY, TWO_ENCODERS_PER_MB,
};
use common::threads::{run_world, ThreadComm, ThreadFactory};
use grid_core::{Communicator, DType};
use multimodule::{
    Activation, BridgeCommunicator, DimMapping, Error, MultiModulePipelineCommunicator,
    PipelinePlan, PipelineSpec, ShapeMode,
};
use std::sync::Arc;
use std::time::Duration;

/// The static mode of a case: every source rank's tensor (equal batches on every lane, its cp
/// chunk of the sequence, which must divide evenly).
fn static_mode(c: &Case) -> ShapeMode {
    let cp = plan_of(c).src().cp_size();
    assert!(c.batches.iter().all(|&b| b == c.batches[0]));
    assert_eq!(c.layout.seq_len() % cp, 0);
    ShapeMode::Static {
        shape: c.layout.shape(c.batches[0], c.layout.seq_len() / cp),
        dtype: DType::F64,
    }
}

/// Runs `c` on thread ranks in `mode`: (elements checked, `batch_p2p` rounds of every rank).
fn run_in(c: &Case, mode: &ShapeMode) -> (usize, Vec<usize>) {
    let plan = plan_of(c);
    let world = world_of(c);
    let (res, hub) = run_world(world, c.rendezvous, |rank, comm: Arc<ThreadComm>| {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40)
            .unwrap()
            .with_shape_mode(mode.clone())
            .unwrap();
        assert_eq!(&bridge.shape_mode(), mode);
        run_rank(c, &bridge, rank)
    });
    (
        res.iter().sum(),
        (0..world).map(|r| hub.batches(r)).collect(),
    )
}

/// Static and learned modes check exactly the elements the variable mode checks, in every
/// schedule, and never take more rounds.
fn all_modes(mut c: Case) {
    let stat = static_mode(&c);
    for fused in [false, true] {
        for rendezvous in [false, true] {
            c.fused = fused;
            c.rendezvous = rendezvous;
            let (n_var, r_var) = run_in(&c, &ShapeMode::Variable);
            let (n_stat, r_stat) = run_in(&c, &stat);
            let (n_learn, r_learn) = run_in(&c, &ShapeMode::Learned);
            assert!(n_var > 0);
            assert_eq!((n_stat, n_learn), (n_var, n_var));
            for r in 0..r_var.len() {
                assert!(
                    r_stat[r] <= r_learn[r] && r_learn[r] <= r_var[r],
                    "rank {r}"
                );
            }
            assert!(r_stat.iter().sum::<usize>() < r_var.iter().sum::<usize>());
        }
    }
}

#[test]
fn static_shapes_one_to_one_take_one_round_per_transfer() {
    // 3 micro-batches forward then backward, tp 1. A rank that only sends in an exchange posts
    // header and payload in one round whatever the mode; a receiver takes one round per
    // transfer once both ends expect the shape, two (header, then payload) before: with static
    // and learned shapes from each channel's second message on, with variable shapes from its
    // third (once the same shape came twice in a row). Each side sends 3 and receives 3:
    // static and learned 3 + (2 + 1 + 1), variable 3 + (2 + 2 + 1).
    let c = case(grid(1, 1, 1, 1, 0), grid(1, 1, 1, 1, 1), l3(2), vec![3]);
    assert_eq!(run_in(&c, &ShapeMode::Variable).1, vec![8, 8]);
    assert_eq!(run_in(&c, &static_mode(&c)).1, vec![7, 7]);
    assert_eq!(run_in(&c, &ShapeMode::Learned).1, vec![7, 7]);
    // 10 micro-batches: 21 rounds per side with static shapes, 22 with variable ones (the
    // header round trip everywhere would be 40).
    let c = Case {
        microbatches: 10,
        ..c
    };
    assert_eq!(run_in(&c, &ShapeMode::Variable).1, vec![22, 22]);
    assert_eq!(run_in(&c, &static_mode(&c)).1, vec![21, 21]);
}

#[test]
fn static_shapes_fan_in_fan_out_one_to_one() {
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(4, 1, 1, 1, 4),
        l3(2),
        vec![2; 4],
    ));
    all_modes(case(
        grid(2, 1, 1, 2, 0),
        grid(1, 1, 1, 4, 4),
        l3(2),
        vec![4, 4],
    ));
    all_modes(case(
        grid(2, 1, 1, 1, 0),
        grid(2, 1, 1, 1, 2),
        l3(3),
        vec![3],
    ));
}

#[test]
fn static_shapes_pp_uneven_lcm_2d() {
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
        grid(1, 1, 1, 3, 0),
        grid(1, 1, 1, 2, 3),
        l3(2),
        vec![4; 3],
    ));
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
        vec![5; 4],
    ));
}

#[test]
fn static_shapes_cp_colocated_batch_dim_one() {
    all_modes(case(
        grid(2, 2, 1, 1, 0),
        grid(1, 1, 1, 2, 4),
        l3(6),
        vec![4],
    ));
    all_modes(case(
        grid(1, 1, 1, 2, 0),
        grid(2, 2, 1, 1, 2),
        l3(5),
        vec![2, 2],
    ));
    all_modes(case(
        grid(1, 2, 2, 1, 0),
        grid(2, 2, 1, 1, 4),
        l3(6),
        vec![3],
    ));
    all_modes(case(
        grid(2, 1, 1, 2, 0),
        grid(1, 1, 1, 4, 0),
        l3(2),
        vec![4, 4],
    ));
    let sbh = Layout {
        ndim: 3,
        dm: DimMapping::new(0, 1, 2).unwrap(),
        seq: 3,
        hidden: 2,
    };
    all_modes(case(
        grid(1, 1, 1, 4, 0),
        grid(2, 1, 1, 2, 4),
        sbh,
        vec![2; 4],
    ));
    all_modes(case(grid(2, 1, 1, 1, 0), grid(1, 1, 1, 3, 2), sbh, vec![7]));
}

/// A model of the rounds a receiver pays for a sequence of shapes.
type RoundsFn<T> = fn(&[T]) -> usize;

/// A shape mode with its round models for one source lane and for the fan-in destination.
type Mode = (
    ShapeMode,
    RoundsFn<(usize, usize)>,
    RoundsFn<([usize; 2], usize)>,
);

/// Rounds a receiving rank pays for a sequence of messages on one channel group under learned
/// shapes: one per message, plus one whenever the shapes differ from the previous message's (or
/// for the first).
fn learned_rounds<T: PartialEq>(shapes: &[T]) -> usize {
    shapes
        .iter()
        .enumerate()
        .map(|(k, s)| if k > 0 && shapes[k - 1] == *s { 1 } else { 2 })
        .sum()
}

/// The same under variable shapes: one round only for a message whose shape is that of the two
/// messages before it (the receiver expects a shape once it came twice in a row), else two.
fn variable_rounds<T: PartialEq>(shapes: &[T]) -> usize {
    shapes
        .iter()
        .enumerate()
        .map(|(k, s)| {
            if k > 1 && shapes[k - 1] == *s && shapes[k - 2] == *s {
                1
            } else {
                2
            }
        })
        .sum()
}

#[test]
fn learned_and_variable_shapes_follow_changes() {
    // Fan-in 2 -> 1; the lanes' batch rows and the sequence change from micro-batch to
    // micro-batch, sometimes on one lane only (the destination's in-place receive of both parts
    // then falls back to a copy). Every element is checked, forward and backward, in learned
    // and in variable shapes (which expect a shape once it came twice in a row: a run of three
    // equal shapes, then a change that arrives as a placeholder and a resend).
    let c = case(grid(1, 1, 1, 2, 0), grid(1, 1, 1, 1, 2), l3(2), vec![2, 2]);
    let plan = plan_of(&c);
    let steps: Vec<([usize; 2], usize)> = vec![
        ([2, 2], 2),
        ([2, 2], 2),
        ([2, 2], 2),
        ([3, 2], 2),
        ([3, 2], 3),
        ([2, 2], 3),
        ([2, 2], 3),
        ([2, 2], 3),
        ([2, 2], 3),
        ([2, 3], 3),
    ];
    let modes: [Mode; 2] = [
        (ShapeMode::Learned, learned_rounds, learned_rounds),
        (ShapeMode::Variable, variable_rounds, variable_rounds),
    ];
    for ((mode, lane_rounds, dst_rounds), rendezvous) in modes
        .iter()
        .flat_map(|m| [(m.clone(), false), (m.clone(), true)])
    {
        let (res, hub) = run_world(3, rendezvous, |rank, comm: Arc<ThreadComm>| -> usize {
            let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40)
                .unwrap()
                .with_shape_mode(mode.clone())
                .unwrap();
            let mut checked = 0;
            let mut kept = Vec::new();
            for (mb, (batches, seq)) in steps.iter().enumerate() {
                let lay = l3(*seq);
                if rank < 2 {
                    let t = lay.build(batches[rank], *seq, |b, s, h| value(mb, rank, b, s, h));
                    bridge.send_forward(&t).unwrap();
                } else {
                    let t = bridge.recv_forward().unwrap().unwrap();
                    let rows = dst_rows(&plan, batches, 0);
                    lay.check(&t, rows.len(), *seq, "forward", |b, s, h| {
                        value(mb, rows[b].0, rows[b].1, s, h)
                    });
                    checked += t.numel();
                    kept.push(t);
                }
            }
            for (mb, (batches, seq)) in steps.iter().enumerate() {
                let lay = l3(*seq);
                if rank < 2 {
                    let g = bridge.recv_backward().unwrap().unwrap();
                    lay.check(&g, batches[rank], *seq, "backward", |b, s, h| {
                        grad_of(value(mb, rank, b, s, h))
                    });
                    checked += g.numel();
                } else {
                    let t = &kept[mb];
                    let g: Vec<f64> = t
                        .to_vec::<f64>()
                        .unwrap()
                        .into_iter()
                        .map(grad_of)
                        .collect();
                    bridge
                        .send_backward(&Activation::from_vec(t.shape().to_vec(), g).unwrap())
                        .unwrap();
                }
            }
            checked
        });
        let rows: usize = steps.iter().map(|(b, s)| (b[0] + b[1]) * s * 3).sum();
        assert_eq!(res.iter().sum::<usize>(), 2 * rows);
        // Forward then backward over the same channels. Sending only, a rank takes one round
        // per transfer (a changed shape's placeholder and its real payload go together);
        // receiving, a second round wherever the shape was not expected.
        let n = steps.len();
        for lane in 0..2 {
            let shapes: Vec<(usize, usize)> = steps.iter().map(|(b, s)| (b[lane], *s)).collect();
            assert_eq!(
                hub.batches(lane),
                n + lane_rounds(&shapes),
                "{mode:?} lane {lane}"
            );
        }
        assert_eq!(hub.batches(2), dst_rounds(&steps) + n, "{mode:?}");
        // Payload-sized messages per lane and direction: one per transfer, plus a placeholder
        // wherever an expected shape changed (learned: any change; variable: only a change
        // after the same shape came twice in a row; never while shapes keep changing).
        let log = hub.log();
        for lane in 0..2 {
            let shapes: Vec<(usize, usize)> = steps.iter().map(|(b, s)| (b[lane], *s)).collect();
            let placeholders = (1..n)
                .filter(|&k| {
                    let expected = match mode {
                        ShapeMode::Variable => k > 1 && shapes[k - 1] == shapes[k - 2],
                        _ => true,
                    };
                    expected && shapes[k] != shapes[k - 1]
                })
                .count();
            for (from, to) in [(lane, 2), (2, lane)] {
                let sent = log.iter().filter(|m| (m.0, m.1) == (from, to)).count();
                assert_eq!(sent, n + placeholders, "{mode:?} {from} -> {to}");
            }
        }
    }
}

/// 1:1 or fan-in (`lanes` sources) with a static shape: a wrong tensor on source 0 fails there
/// before anything of it is sent, the destination gets `PeerError`, and the transfers around
/// it deliver exact values. With `first`, the wrong tensor is the channel's first message.
fn mismatch_then_recover(
    lanes: usize,
    rendezvous: bool,
    first: bool,
    wrong: Activation,
    expect: fn(&Error) -> bool,
) {
    let c = case(
        grid(1, 1, 1, lanes, 0),
        grid(1, 1, 1, 1, lanes),
        l3(2),
        vec![2; lanes],
    );
    let plan = plan_of(&c);
    let mode = static_mode(&c);
    let mbs: Vec<usize> = if first { vec![1] } else { vec![0, 1] };
    let (res, hub) = run_world(lanes + 1, rendezvous, |rank, comm: Arc<ThreadComm>| {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40)
            .unwrap()
            .with_shape_mode(mode.clone())
            .unwrap();
        let good = |mb: usize| l3(2).build(2, 2, |b, s, h| value(mb, rank, b, s, h));
        let check = |mb: usize| {
            let t = bridge.recv_forward().unwrap().unwrap();
            let rows = dst_rows(&plan, &c.batches, 0);
            l3(2).check(&t, rows.len(), 2, "around the error", |b, s, h| {
                value(mb, rows[b].0, rows[b].1, s, h)
            });
            t.numel()
        };
        if rank < lanes {
            if !first {
                bridge.send_forward(&good(0)).unwrap();
            }
            // The other lanes' part of this transfer is never delivered: rank 0's failed.
            let other = good(7);
            let mine = if rank == 0 { &wrong } else { &other };
            match (rank, bridge.send_forward(mine)) {
                (0, Err(e)) => assert!(expect(&e), "rank 0: {e}"),
                (0, Ok(())) => panic!("rank 0 sent a tensor that does not match the static shape"),
                (_, r) => r.unwrap(),
            }
            bridge.send_forward(&good(1)).unwrap();
            0
        } else {
            let mut n = if first { 0 } else { check(0) };
            match bridge.recv_forward() {
                Err(Error::PeerError { peer: 0, .. }) => {}
                other => panic!("destination: {other:?}"),
            }
            n += check(1);
            n
        }
    });
    assert_eq!(res.iter().sum::<usize>(), mbs.len() * lanes * 2 * 2 * 3);
    // What rank 0 sent with a payload's size: its good tensors and, when the channel already
    // had a message, a placeholder in place of the wrong one (never the wrong one's data; the
    // destination checked every element it got).
    let sent = hub.log().iter().filter(|(s, _, _)| *s == 0).count();
    assert_eq!(sent, if first { 1 } else { 3 });
}

#[test]
fn static_shape_mismatch_is_an_error_before_sending() {
    let shape = |r: &Error| matches!(r, Error::StaticShape { expected, actual, .. } if expected == &vec![2, 2, 3] && actual == &vec![3, 2, 3]);
    let dtype = |r: &Error| {
        matches!(
            r,
            Error::StaticShape {
                dtype: DType::F64,
                actual_dtype: DType::F32,
                ..
            }
        )
    };
    for rendezvous in [false, true] {
        for lanes in [1, 2] {
            for first in [false, true] {
                let wrong_shape = l3(2).build(3, 2, |b, s, h| value(9, 0, b, s, h));
                mismatch_then_recover(lanes, rendezvous, first, wrong_shape, shape);
                let wrong_dtype = Activation::from_vec(vec![2, 2, 3], vec![1f32; 12]).unwrap();
                mismatch_then_recover(lanes, rendezvous, first, wrong_dtype, dtype);
            }
        }
    }
    // The message names the declared shape and the way out.
    let e = Error::StaticShape {
        op: "send_forward",
        what: "bridge a -> b".into(),
        expected: vec![2, 2, 3],
        dtype: DType::F64,
        actual: vec![3, 2, 3],
        actual_dtype: DType::F64,
    };
    assert_eq!(
        e.to_string(),
        "send_forward: the tensor is f64 [3, 2, 3], but bridge a -> b declares the static shape f64 [2, 2, 3]; nothing was sent: give tensors of the declared shape, or use ShapeMode::Variable or ShapeMode::Learned"
    );
}

#[test]
fn static_shape_errors_for_split_sizes_gradients_and_bad_modes() {
    // Fan-out 1 -> 2 of 4 rows: split sizes [1, 3] are not tensor_split's [2, 2]; a gradient of
    // the wrong dtype is caught on the destination; a static shape of the wrong rank is refused.
    let c = case(grid(1, 1, 1, 1, 0), grid(1, 1, 1, 2, 1), l3(2), vec![4]);
    let plan = plan_of(&c);
    let mode = static_mode(&c);
    let (res, _) = run_world(3, true, |rank, comm: Arc<ThreadComm>| -> usize {
        let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40).unwrap();
        let bad = ShapeMode::Static {
            shape: vec![4, 2],
            dtype: DType::F64,
        };
        assert!(matches!(
            bridge.set_shape_mode(bad),
            Err(Error::BridgeConfig { .. })
        ));
        bridge.set_shape_mode(mode.clone()).unwrap();
        let x = |mb| l3(2).build(4, 2, move |b, s, h| value(mb, 0, b, s, h));
        if rank == 0 {
            let e = bridge
                .send_forward(&x(0).with_split_sizes(vec![1, 3]))
                .unwrap_err();
            assert!(
                e.to_string().contains("split sizes [1, 3] give [1, 3]"),
                "{e}"
            );
            bridge
                .send_forward(&x(1).with_split_sizes(vec![2, 2]))
                .unwrap();
            match bridge.recv_backward() {
                Err(Error::PeerError { .. }) => {}
                other => panic!("source: {other:?}"),
            }
            0
        } else {
            assert!(matches!(
                bridge.recv_forward(),
                Err(Error::PeerError { peer: 0, .. })
            ));
            let t = bridge.recv_forward().unwrap().unwrap();
            let off = 2 * (rank - 1);
            l3(2).check(&t, 2, 2, "fan-out", |b, s, h| value(1, 0, b + off, s, h));
            let g32 = Activation::from_vec(t.shape().to_vec(), vec![0f32; t.numel()]).unwrap();
            assert!(matches!(
                bridge.send_backward(&g32),
                Err(Error::StaticShape {
                    actual_dtype: DType::F32,
                    ..
                })
            ));
            t.numel()
        }
    });
    assert_eq!(res.iter().sum::<usize>(), 2 * 12);
}

/// Source and destination declare different static shapes (the source's is larger): every
/// transfer is a `Protocol` error on the destination naming both shapes, never a length
/// mismatch in the backend (Gloo aborts the process on a message longer than the receive) and
/// never a hang. Returns the number of errors seen.
fn misdeclared<C: grid_core::Communicator>(bridge: &BridgeCommunicator<C>, rank: usize) -> usize {
    let declared = |b: usize| ShapeMode::Static {
        shape: vec![b, 2, 3],
        dtype: DType::F64,
    };
    bridge
        .set_shape_mode(declared(if rank == 0 { 3 } else { 2 }))
        .unwrap();
    let mut errors = 0;
    for mb in 0..3 {
        if rank == 0 {
            bridge
                .send_forward(&l3(2).build(3, 2, |b, s, h| value(mb, 0, b, s, h)))
                .unwrap();
        } else {
            match bridge.recv_forward() {
                Err(Error::Protocol {
                    peer: 0, message, ..
                }) => {
                    assert!(message.contains("[3, 2, 3]") && message.contains("[2, 2, 3]"));
                    errors += 1;
                }
                other => panic!("{other:?}"),
            }
        }
    }
    errors
}

#[test]
fn static_shapes_declared_differently_are_an_error_not_an_abort() {
    let c = case(grid(1, 1, 1, 1, 0), grid(1, 1, 1, 1, 1), l3(2), vec![2]);
    let plan = plan_of(&c);
    for rendezvous in [false, true] {
        let (res, _) = run_world(2, rendezvous, |rank, comm: Arc<ThreadComm>| {
            let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40).unwrap();
            misdeclared(&bridge, rank)
        });
        assert_eq!(res, vec![0, 3]);
    }
    let res = run_ranks(2, &cfg("mm-static-misdeclared"), |f, w| {
        let rank = w.rank();
        let bridge = BridgeCommunicator::new(f, Arc::new(w), plan.clone(), 40)
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        Ok(misdeclared(&bridge, rank))
    })
    .unwrap();
    let res: Vec<usize> = res.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(res, vec![0, 3]);
}

fn three_stage_spec() -> PipelineSpec {
    PipelineSpec::from_json_str(
        r#"{"modules": {"enc": {"pp": 2}, "dec": {"offset": 2}}, "topology": {"enc": ["dec"]}}"#,
    )
    .unwrap()
}

#[test]
fn pipeline_static_and_learned_shapes() {
    // Two encoders -> LLM (tp 2, pp 2) -> generator, every element checked, with every module
    // static, then every module learned.
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let n = 4;
    let learned: Vec<(&str, ShapeMode)> = two_encoders_static_modes()
        .into_iter()
        .map(|(m, _)| (m, ShapeMode::Learned))
        .collect();
    for modes in [two_encoders_static_modes(), learned] {
        for rendezvous in [false, true] {
            let (res, _) = run_world(8, rendezvous, |rank, comm: Arc<ThreadComm>| {
                two_encoders_rank_with(&ThreadFactory, comm, &plan, rank, n, &modes)
            });
            assert_eq!(res.iter().sum::<usize>(), n * TWO_ENCODERS_PER_MB);
        }
    }
}

#[test]
fn pipeline_static_shape_mismatch() {
    // enc (pp 2) -> dec: a wrong tensor between enc's stages, then one over the bridge; each
    // fails on its sender and on its receiver, and the next transfer is exact.
    let spec = three_stage_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let mode = ShapeMode::Static {
        shape: LAY.shape(2, 2),
        dtype: DType::F64,
    };
    let (res, _) = run_world(3, true, |rank, comm: Arc<ThreadComm>| -> usize {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        assert!(matches!(
            mm.set_shape_mode(
                "enc",
                ShapeMode::Static {
                    shape: vec![2, 2],
                    dtype: DType::F64
                }
            ),
            Err(Error::Usage { .. })
        ));
        assert!(matches!(
            mm.set_shape_mode("nope", ShapeMode::Learned),
            Err(Error::UnknownModule { .. })
        ));
        mm.set_shape_mode("enc", mode.clone()).unwrap();
        let good = |mb| LAY.build(2, 2, move |b, s, h| value(mb, 0, b, s, h));
        let wrong = LAY.build(3, 2, |b, s, h| value(0, 0, b, s, h));
        match rank {
            0 => {
                assert!(matches!(
                    mm.send_forward("enc", &wrong),
                    Err(Error::StaticShape { .. })
                ));
                mm.send_forward("enc", &good(1)).unwrap();
                0
            }
            1 => {
                assert!(matches!(
                    mm.recv_forward("enc"),
                    Err(Error::PeerError { peer: 0, .. })
                ));
                let x = mm.recv_forward("enc").unwrap();
                let x = x.get("enc").unwrap();
                LAY.check(x, 2, 2, "enc stage 1", |b, s, h| value(1, 0, b, s, h));
                assert!(matches!(
                    mm.send_forward("enc", &wrong),
                    Err(Error::StaticShape { .. })
                ));
                mm.send_forward("enc", x).unwrap();
                x.numel()
            }
            _ => {
                assert!(matches!(
                    mm.recv_forward("dec"),
                    Err(Error::PeerError { peer: 1, .. })
                ));
                let x = mm.recv_forward("dec").unwrap();
                let x = x.get("enc").unwrap();
                LAY.check(x, 2, 2, "dec", |b, s, h| value(1, 0, b, s, h));
                x.numel()
            }
        }
    });
    assert_eq!(res.iter().sum::<usize>(), 24);
}

// ----- Gloo ----------------------------------------------------------------------------------

fn cfg(job: &str) -> GlooConfig {
    GlooConfig::new(job).with_timeout(Duration::from_secs(60))
}

#[test]
fn gloo_static_shapes() {
    let cases = [
        case(grid(1, 1, 1, 4, 0), grid(4, 1, 1, 1, 4), l3(2), vec![2; 4]),
        case(grid(2, 1, 1, 2, 0), grid(1, 1, 1, 4, 4), l3(2), vec![5, 5]),
        case(grid(2, 1, 2, 1, 0), grid(1, 1, 2, 2, 4), l3(2), vec![4]),
        case(grid(1, 1, 1, 3, 0), grid(1, 1, 1, 2, 3), l3(2), vec![4; 3]),
        case(grid(1, 2, 2, 1, 0), grid(2, 2, 1, 1, 4), l3(6), vec![3]),
        case(grid(2, 1, 1, 2, 0), grid(1, 1, 1, 4, 0), l3(2), vec![4, 4]),
    ];
    for (k, mut c) in cases.into_iter().enumerate() {
        for fused in [false, true] {
            c.fused = fused;
            for (m, mode) in [static_mode(&c), ShapeMode::Learned]
                .into_iter()
                .enumerate()
            {
                let plan = plan_of(&c);
                let job = format!("mm-static-{k}-{fused}-{m}");
                let res = run_ranks(world_of(&c), &cfg(&job), |f, w| {
                    let rank = w.rank();
                    let bridge = BridgeCommunicator::new(f, Arc::new(w), plan.clone(), 40)
                        .and_then(|b| b.with_shape_mode(mode.clone()))
                        .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
                    Ok(run_rank(&c, &bridge, rank))
                })
                .unwrap();
                let n: usize = res
                    .into_iter()
                    .enumerate()
                    .map(|(r, x)| x.unwrap_or_else(|e| panic!("case {k} rank {r}: {e}")))
                    .sum();
                assert!(n > 0);
            }
        }
    }
}

#[test]
fn gloo_static_shape_mismatch_and_pipeline() {
    // Fan-in 2 -> 1 on Gloo: a wrong tensor from lane 0 fails there and on the destination
    // (no hang), then exact data.
    let c = case(grid(1, 1, 1, 2, 0), grid(1, 1, 1, 1, 2), l3(2), vec![2, 2]);
    let plan = plan_of(&c);
    let mode = static_mode(&c);
    let res = run_ranks(3, &cfg("mm-static-mismatch"), |f, w| {
        let rank = w.rank();
        let bridge = BridgeCommunicator::new(f, Arc::new(w), plan.clone(), 40)
            .and_then(|b| b.with_shape_mode(mode.clone()))
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        let good = |mb| l3(2).build(2, 2, move |b, s, h| value(mb, rank, b, s, h));
        Ok(if rank < 2 {
            let first = if rank == 0 {
                l3(2).build(2, 3, |b, s, h| value(0, 0, b, s, h))
            } else {
                good(0)
            };
            let r = bridge.send_forward(&first);
            assert_eq!(r.is_err(), rank == 0, "{r:?}");
            bridge.send_forward(&good(1)).unwrap();
            0
        } else {
            assert!(matches!(
                bridge.recv_forward(),
                Err(Error::PeerError { peer: 0, .. })
            ));
            let t = bridge.recv_forward().unwrap().unwrap();
            let rows = dst_rows(&plan, &c.batches, 0);
            l3(2).check(&t, 4, 2, "gloo fan-in", |b, s, h| {
                value(1, rows[b].0, rows[b].1, s, h)
            });
            t.numel()
        })
    })
    .unwrap();
    let n: usize = res.into_iter().map(|x| x.unwrap()).sum();
    assert_eq!(n, 24);
    // The two-encoder pipeline with static shapes on Gloo.
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let res = run_ranks(8, &cfg("mm-static-two-enc"), |f, w| {
        let rank = w.rank();
        Ok(two_encoders_rank_with(
            f,
            Arc::new(w),
            &plan,
            rank,
            4,
            &two_encoders_static_modes(),
        ))
    })
    .unwrap();
    let total: usize = res.into_iter().map(|x| x.unwrap()).sum();
    assert_eq!(total, 4 * TWO_ENCODERS_PER_MB);
}
