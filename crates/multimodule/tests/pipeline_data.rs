//! The multi-module pipeline communicator with real data on thread ranks.

mod common;
use common::check::{grad_of, value};
use common::scenarios::{map, one, two_encoders_rank, two_encoders_spec, LAY, TWO_ENCODERS_PER_MB};
use common::threads::{run_world, ThreadComm, ThreadFactory};
use multimodule::{Activation, Error, MultiModulePipelineCommunicator, PipelinePlan, PipelineSpec};
use std::sync::Arc;

/// Two encoders -> LLM (tp2 pp2) -> generator, 4 micro-batches forward then backward; every
/// element checked on every rank.
fn two_encoders_into_llm(rendezvous: bool) {
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let n = 4;
    let (res, _) = run_world(8, rendezvous, |rank, comm: Arc<ThreadComm>| -> usize {
        two_encoders_rank(&ThreadFactory, comm, &plan, rank, n)
    });
    assert_eq!(res.iter().sum::<usize>(), n * TWO_ENCODERS_PER_MB);
}

#[test]
fn two_encoders_llm_generator() {
    two_encoders_into_llm(false);
}

#[test]
fn two_encoders_llm_generator_rendezvous() {
    two_encoders_into_llm(true);
}

#[test]
fn fan_out_gradients_are_summed() {
    // A feeds B and C; B returns grad_of(x), C returns 2x: A gets their sum (Megatron keeps
    // only C's).
    let spec = PipelineSpec::from_json_str(
        r#"{"modules": {"A": {"tp": 2}, "B": {"offset": 2}, "C": {"dp": 2, "offset": 3}},
            "topology": {"A": ["B", "C"]}}"#,
    )
    .unwrap();
    let plan = PipelinePlan::new(&spec).unwrap();
    let (res, _) = run_world(5, true, |rank, comm| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        let module = mm.modules()[0].name.clone();
        let x = LAY.build(4, 2, |b, s, h| value(0, 0, b, s, h));
        match module.as_str() {
            "A" => {
                mm.send_forward("A", &x).unwrap();
                let g = mm.recv_backward("A").unwrap().unwrap();
                LAY.check(&g, 4, 2, "A grad", |b, s, h| {
                    let v = value(0, 0, b, s, h);
                    grad_of(v) + 2.0 * v
                });
                g.numel()
            }
            m => {
                let inp = mm.recv_forward(m).unwrap();
                let t = inp.get("A").unwrap();
                let rows = if m == "B" { 4 } else { 2 };
                let off = if m == "C" { 2 * (rank - 3) } else { 0 };
                LAY.check(t, rows, 2, m, |b, s, h| value(0, 0, b + off, s, h));
                let g = if m == "B" {
                    map(grad_of, t)
                } else {
                    map(|v| 2.0 * v, t)
                };
                mm.send_backward(m, &one("A", g)).unwrap();
                t.numel()
            }
        }
    });
    assert_eq!(res, vec![24, 24, 24, 12, 12]);
}

#[test]
fn colocated_modules() {
    // enc (tp2 dp2) and llm (tp4) on the same ranks 0..3.
    let spec = PipelineSpec::from_json_str(
        r#"{"modules": {"enc": {"tp": 2, "dp": 2}, "llm": {"tp": 4}},
            "topology": {"enc": ["llm"]}, "colocated": [["enc", "llm"]]}"#,
    )
    .unwrap();
    let plan = PipelinePlan::new(&spec).unwrap();
    let (res, _) = run_world(4, true, |rank, comm| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        assert_eq!(mm.modules().len(), 2);
        assert_eq!(mm.current_stage().unwrap(), 1);
        let lane = rank / 2;
        let mut checked = 0;
        for mb in 0..3 {
            assert!(mm.recv_forward("enc").unwrap().is_empty());
            let out = LAY.build(2, 2, |b, s, h| value(mb, lane, b, s, h));
            mm.send_forward("enc", &out).unwrap();
            let inp = mm.recv_forward("llm").unwrap();
            let t = inp.get("enc").unwrap();
            LAY.check(t, 4, 2, "llm input", |b, s, h| {
                value(mb, b / 2, b % 2, s, h)
            });
            checked += t.numel();
            assert!(mm.recv_backward("llm").unwrap().is_none());
            mm.send_backward("llm", &one("enc", map(grad_of, t)))
                .unwrap();
            let g = mm.recv_backward("enc").unwrap().unwrap();
            LAY.check(&g, 2, 2, "enc grad", |b, s, h| {
                grad_of(value(mb, lane, b, s, h))
            });
            checked += g.numel();
        }
        checked
    });
    assert_eq!(res, vec![108; 4]);
}

#[test]
fn fused_chain_one_f_one_b() {
    // A (pp2) -> B (pp2): Megatron's 1F1B schedule (warm-up, fused steady state, cool-down)
    // across a p2p link, the bridge and another p2p link, with rendezvous sends.
    let spec = PipelineSpec::from_json_str(
        r#"{"modules": {"A": {"pp": 2}, "B": {"pp": 2, "offset": 2}}, "topology": {"A": ["B"]}}"#,
    )
    .unwrap();
    let plan = PipelinePlan::new(&spec).unwrap();
    let n = 5;
    let (res, _) = run_world(4, true, |rank, comm| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        let m = mm.modules()[0].clone();
        let name = m.name.as_str();
        // Every stage adds 1; the last stage's gradient is grad_of(its output) and it passes
        // through unchanged, so stage k sees grad_of(value + 4) for its input value + k.
        let stage = mm.current_stage().unwrap();
        let last = mm.total_stages() - 1;
        let producer = if m.pp_rank == 0 && name == "B" {
            "A"
        } else {
            name
        };
        let check_in = |mb: usize, t: &Activation| {
            LAY.check(t, 2, 2, &format!("rank {rank} input mb {mb}"), |b, s, h| {
                value(mb, 0, b, s, h) + stage as f64
            });
        };
        let check_grad = |mb: usize, g: &Activation| {
            LAY.check(g, 2, 2, &format!("rank {rank} grad mb {mb}"), |b, s, h| {
                grad_of(value(mb, 0, b, s, h) + 4.0)
            });
        };
        let recv_in = |mb: usize| -> Activation {
            if stage == 0 {
                LAY.build(2, 2, |b, s, h| value(mb, 0, b, s, h))
            } else {
                let i = mm.recv_forward(name).unwrap();
                let t = i.get(producer).unwrap().clone();
                check_in(mb, &t);
                t
            }
        };
        let warmup = (last - stage).min(n);
        let remaining = n - warmup;
        let mut checked = 0;
        let mut bwd_mb = 0;
        for mb in 0..warmup {
            let x = recv_in(mb);
            mm.send_forward(name, &map(|v| v + 1.0, &x)).unwrap();
        }
        let mut next = (remaining > 0).then(|| recv_in(warmup));
        for i in 0..remaining {
            let x = next.take().unwrap();
            let y = map(|v| v + 1.0, &x);
            let g = if stage == last {
                map(grad_of, &y)
            } else {
                mm.send_forward_recv_backward(name, &y).unwrap().unwrap()
            };
            check_grad(bwd_mb, &g);
            checked += g.numel();
            bwd_mb += 1;
            let mb = warmup + i + 1;
            if stage == 0 {
                next = (i + 1 < remaining).then(|| recv_in(mb));
            } else if i + 1 == remaining {
                mm.send_backward(name, &one(producer, g)).unwrap();
            } else {
                let got = mm
                    .send_backward_recv_forward(name, &one(producer, g))
                    .unwrap();
                let t = got.get(producer).unwrap().clone();
                check_in(mb, &t);
                next = Some(t);
            }
        }
        for _ in 0..warmup {
            let g = mm.recv_backward(name).unwrap().unwrap();
            check_grad(bwd_mb, &g);
            checked += g.numel();
            bwd_mb += 1;
            if stage > 0 {
                mm.send_backward(name, &one(producer, g)).unwrap();
            }
        }
        checked
    });
    assert_eq!(res, vec![60; 4]);
}

#[test]
fn p2p_gradient_mismatch_fails_both_stages() {
    let spec = PipelineSpec::from_json_str(r#"{"modules": {"A": {"pp": 2}}}"#).unwrap();
    let plan = PipelinePlan::new(&spec).unwrap();
    let (res, _) = run_world(2, true, |rank, comm| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        let x = Activation::zeros(grid_core::DType::F32, vec![2, 2, 2]).unwrap();
        if rank == 0 {
            mm.send_forward("A", &x).unwrap();
            mm.recv_backward("A").map(|_| ())
        } else {
            mm.recv_forward("A").unwrap();
            let bad = Activation::zeros(grid_core::DType::F32, vec![1, 2, 2]).unwrap();
            mm.send_backward("A", &one("A", bad))
        }
    });
    assert!(
        matches!(res[0], Err(Error::PeerError { peer: 1, .. })),
        "{:?}",
        res[0]
    );
    assert!(
        matches!(res[1], Err(Error::GradientMismatch { .. })),
        "{:?}",
        res[1]
    );
}

#[test]
fn unknown_module_and_missing_gradient_key() {
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let (res, _) = run_world(8, false, |rank, comm| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        if rank == 7 {
            let e1 = mm.recv_forward("llm").unwrap_err();
            assert!(matches!(e1, Error::ModuleNotOnRank { .. }), "{e1}");
            let x = LAY.build(4, 2, |_, _, _| 0.0);
            let e2 = mm.send_backward("generator", &one("nope", x)).unwrap_err();
            assert!(
                e2.to_string().contains("no gradient for input 'llm'"),
                "{e2}"
            );
        }
        true
    });
    assert!(res.iter().all(|&x| x));
}
