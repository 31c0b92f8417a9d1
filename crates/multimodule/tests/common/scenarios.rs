//! Scenarios shared by the thread, Gloo and MPI tests.
#![allow(dead_code)]

use super::check::{grad_of, value, Layout};
use grid_core::GroupFactory;
use multimodule::{
    Activation, DimMapping, ModuleInputs, MultiModulePipelineCommunicator, OrderedMap,
    PipelinePlan, PipelineSpec, ShapeMode,
};
use std::sync::Arc;

pub const LAY: Layout = Layout {
    ndim: 3,
    dm: DimMapping { s: 1, b: 0, h: 2 },
    seq: 2,
    hidden: 3,
};

pub fn map(f: impl Fn(f64) -> f64, t: &Activation) -> Activation {
    Activation::from_vec(
        t.shape().to_vec(),
        t.to_vec::<f64>().unwrap().into_iter().map(f).collect(),
    )
    .unwrap()
}

pub fn add(a: &Activation, b: &Activation) -> Activation {
    let mut s = a.clone();
    s.add_assign(b).unwrap();
    s
}

pub fn one(k: &str, t: Activation) -> ModuleInputs {
    let mut m = OrderedMap::new();
    m.push(k, t);
    m
}

pub const AUDIO_LANE: usize = 5;

/// Image encoder value of LLM input row b (rows 0-1 from image rank 0, 2-3 from image rank 1).
pub fn img(mb: usize, b: usize, s: usize, h: usize) -> f64 {
    value(mb, b / 2, b % 2, s, h)
}
pub fn aud(mb: usize, b: usize, s: usize, h: usize) -> f64 {
    value(mb, AUDIO_LANE, b, s, h)
}

pub fn two_encoders_spec() -> PipelineSpec {
    PipelineSpec::from_json_str(
        r#"{"world_size": 8,
            "modules": {"image_encoder": {"dp": 2}, "audio_encoder": {"offset": 2},
                        "llm": {"tp": 2, "pp": 2, "offset": 3}, "generator": {"offset": 7}},
            "topology": {"image_encoder": ["llm"], "audio_encoder": ["llm"], "llm": ["generator"]},
            "language_model": "llm"}"#,
    )
    .unwrap()
}

/// Two encoders -> LLM (tp2 pp2) -> generator, 4 micro-batches forward then backward; every
/// element checked on every rank.
pub fn two_encoders_rank<F: GroupFactory>(
    factory: &F,
    comm: Arc<F::Comm>,
    plan: &PipelinePlan,
    rank: usize,
    n: usize,
) -> usize {
    two_encoders_rank_with(factory, comm, plan, rank, n, &[])
}

/// Every module's static output shape in the two-encoder scenario (f64).
pub fn two_encoders_static_modes() -> Vec<(&'static str, ShapeMode)> {
    let s = |b: usize| ShapeMode::Static {
        shape: LAY.shape(b, 2),
        dtype: grid_core::DType::F64,
    };
    vec![
        ("image_encoder", s(2)),
        ("audio_encoder", s(4)),
        ("llm", s(4)),
        ("generator", s(4)),
    ]
}

/// [`two_encoders_rank`] with shape modes set per module first.
pub fn two_encoders_rank_with<F: GroupFactory>(
    factory: &F,
    comm: Arc<F::Comm>,
    plan: &PipelinePlan,
    rank: usize,
    n: usize,
    modes: &[(&str, ShapeMode)],
) -> usize {
    {
        let mm = MultiModulePipelineCommunicator::new(factory, comm, plan, 0).unwrap();
        for (m, mode) in modes {
            mm.set_shape_mode(m, mode.clone()).unwrap();
            assert_eq!(&mm.shape_mode(m).unwrap(), mode);
        }
        assert_eq!(mm.total_stages(), 4);
        let stage = [0, 0, 0, 1, 1, 2, 2, 3][rank];
        assert_eq!(mm.current_stage().unwrap(), stage);
        assert_eq!(mm.is_first_stage(), rank < 3);
        assert_eq!(mm.is_last_stage(), rank == 7);
        let module = mm.modules()[0].name.clone();
        let mut checked = 0;
        let mut saved: Vec<ModuleInputs> = Vec::new();
        // Forward.
        for mb in 0..n {
            let inputs = mm.recv_forward(&module).unwrap();
            let out = match module.as_str() {
                "image_encoder" => {
                    assert!(inputs.is_empty());
                    LAY.build(2, 2, |b, s, h| value(mb, rank, b, s, h))
                }
                "audio_encoder" => LAY.build(4, 2, |b, s, h| aud(mb, b, s, h)),
                "llm" if rank < 5 => {
                    assert_eq!(
                        inputs.keys().collect::<Vec<_>>(),
                        vec!["image_encoder", "audio_encoder"]
                    );
                    let (i, a) = (
                        inputs.get("image_encoder").unwrap(),
                        inputs.get("audio_encoder").unwrap(),
                    );
                    LAY.check(i, 4, 2, "llm image input", |b, s, h| img(mb, b, s, h));
                    LAY.check(a, 4, 2, "llm audio input", |b, s, h| aud(mb, b, s, h));
                    checked += i.numel() + a.numel();
                    add(i, a)
                }
                "llm" => {
                    let x = inputs.get("llm").unwrap();
                    LAY.check(x, 4, 2, "llm stage 1 input", |b, s, h| {
                        img(mb, b, s, h) + aud(mb, b, s, h)
                    });
                    checked += x.numel();
                    map(|v| 2.0 * v, x)
                }
                "generator" => {
                    let x = inputs.get("llm").unwrap();
                    LAY.check(x, 4, 2, "generator input", |b, s, h| {
                        2.0 * (img(mb, b, s, h) + aud(mb, b, s, h))
                    });
                    checked += x.numel();
                    x.clone()
                }
                m => panic!("{m}"),
            };
            mm.send_forward(&module, &out).unwrap();
            saved.push(inputs);
        }
        // Backward, same order.
        for (mb, inputs) in saved.iter().enumerate() {
            let g = mm.recv_backward(&module).unwrap();
            let gen_grad = |b, s, h| grad_of(2.0 * (img(mb, b, s, h) + aud(mb, b, s, h)));
            match module.as_str() {
                "generator" => {
                    assert!(g.is_none());
                    let x = inputs.get("llm").unwrap();
                    mm.send_backward(&module, &one("llm", map(grad_of, x)))
                        .unwrap();
                }
                "llm" if rank >= 5 => {
                    let g = g.unwrap();
                    LAY.check(&g, 4, 2, "llm stage 1 grad", gen_grad);
                    checked += g.numel();
                    mm.send_backward(&module, &one("llm", map(|v| 2.0 * v, &g)))
                        .unwrap();
                }
                "llm" => {
                    let g = g.unwrap();
                    LAY.check(&g, 4, 2, "llm stage 0 grad", |b, s, h| {
                        2.0 * gen_grad(b, s, h)
                    });
                    checked += g.numel();
                    let mut grads = OrderedMap::new();
                    grads.push("image_encoder", g.clone());
                    grads.push("audio_encoder", g);
                    mm.send_backward(&module, &grads).unwrap();
                }
                "image_encoder" => {
                    let g = g.unwrap();
                    LAY.check(&g, 2, 2, "image grad", |b, s, h| {
                        2.0 * gen_grad(2 * rank + b, s, h)
                    });
                    checked += g.numel();
                }
                "audio_encoder" => {
                    let g = g.unwrap();
                    LAY.check(&g, 4, 2, "audio grad", |b, s, h| 2.0 * gen_grad(b, s, h));
                    checked += g.numel();
                }
                m => panic!("{m}"),
            }
        }
        checked
    }
}

/// Elements checked per micro-batch over all ranks: llm stage 0 checks 2 inputs + 1 grad of
/// 24 elements, stage 1 one input and one grad, generator one input, image ranks 12 each,
/// audio 24.
pub const TWO_ENCODERS_PER_MB: usize = 2 * (3 * 24) + 2 * (2 * 24) + 24 + 2 * 12 + 24;
