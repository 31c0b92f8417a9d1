//! A multi-module pipeline on 8 real ranks (Gloo, ranks as threads of this process): an image
//! encoder (dp 2) and an audio encoder feed an LLM (tp 2, pp 2), which feeds a generator.
//! Two micro-batches go forward and backward; the demo prints each rank's stage and every
//! message that crossed a bridge, and checks every element that arrived.
//!
//! Run: `cargo run --release -p grid-programs --example multimodule-demo` (what `cargo xtask demo
//! multimodule` runs)

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::Communicator;
use grid_programs::pipeline_demo::{self, rows, MICROBATCHES, SPEC};
use multimodule::{
    Activation, ModuleInputs, MultiModulePipelineCommunicator, OrderedMap, PipelinePlan,
    PipelineSpec,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

fn sample_tensor(mb: usize, lane: usize, batch: usize) -> Activation {
    pipeline_demo::sample_tensor(mb, lane, batch).unwrap_or_else(|e| panic!("{e}"))
}

fn scale(t: &Activation, k: f32) -> Activation {
    pipeline_demo::scale(t, k).unwrap_or_else(|e| panic!("{e}"))
}

type Log = Vec<(usize, usize, usize, String)>; // (micro-batch, phase, rank, line)

fn rank_main(mm: &MultiModulePipelineCommunicator<impl Communicator>) -> Result<Log, String> {
    let me = mm.rank();
    let module = mm.modules()[0].name.clone();
    let mut log = Log::new();
    let mut inputs_kept: Vec<ModuleInputs> = Vec::new();
    let note_bridges = |log: &mut Log, mb: usize, phase: usize| {
        for b in mm.bridges() {
            for c in b.take_crossings() {
                if c.sent {
                    continue;
                }
                log.push((
                    mb,
                    phase,
                    me,
                    format!(
                        "  {:<28} rank {} -> rank {me}: {} {:?}",
                        format!("{} -> {}", b.plan().src_name(), b.plan().dst_name()),
                        c.peer,
                        if c.forward {
                            "activation"
                        } else {
                            "gradient  "
                        },
                        c.shape
                    ),
                ));
            }
        }
    };
    for mb in 0..MICROBATCHES {
        let inputs = mm.recv_forward(&module).map_err(|e| e.to_string())?;
        note_bridges(&mut log, mb, 0);
        let out = match module.as_str() {
            "image_encoder" => sample_tensor(mb, me, 2),
            "audio_encoder" => sample_tensor(mb, 5, 4),
            "llm" if me < 5 => {
                let i = inputs.get("image_encoder").ok_or("no image input")?;
                let a = inputs.get("audio_encoder").ok_or("no audio input")?;
                let want_i: Vec<i64> = (0..4)
                    .map(|b| (mb * 10000 + (b / 2) * 1000 + b % 2) as i64)
                    .collect();
                let want_a: Vec<i64> = (0..4).map(|b| (mb * 10000 + 5000 + b) as i64).collect();
                if rows(i) != want_i || rows(a) != want_a {
                    return Err(format!("rank {me}: llm inputs {:?} {:?}", rows(i), rows(a)));
                }
                log.push((
                    mb,
                    0,
                    me,
                    format!(
                        "  llm stage 0 on rank {me} got image rows {:?} and audio rows {:?}",
                        rows(i),
                        rows(a)
                    ),
                ));
                i.clone()
            }
            _ => inputs
                .iter()
                .next()
                .map(|(_, t)| t.clone())
                .ok_or("no input")?,
        };
        mm.send_forward(&module, &out).map_err(|e| e.to_string())?;
        note_bridges(&mut log, mb, 0);
        inputs_kept.push(inputs);
    }
    for (mb, inputs) in inputs_kept.iter().enumerate() {
        let g = mm.recv_backward(&module).map_err(|e| e.to_string())?;
        note_bridges(&mut log, mb, 1);
        let mut grads = OrderedMap::new();
        for (k, t) in inputs.iter() {
            // The gradient of each input: the incoming gradient (or -x at the generator).
            let grad = match &g {
                Some(g) if g.shape() == t.shape() => g.clone(),
                _ => scale(t, -1.0),
            };
            grads.push(k, grad);
        }
        if let Some(g) = &g {
            if module.ends_with("encoder") {
                log.push((
                    mb,
                    1,
                    me,
                    format!(
                        "  {module} on rank {me} got its gradient rows {:?}",
                        rows(g)
                    ),
                ));
            }
        }
        mm.send_backward(&module, &grads)
            .map_err(|e| e.to_string())?;
        note_bridges(&mut log, mb, 1);
    }
    Ok(log)
}

fn main() -> ExitCode {
    let spec = match PipelineSpec::from_json_str(SPEC) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let plan = match PipelinePlan::new(&spec) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    println!("multi-module pipeline on 8 Gloo ranks (threads): image_encoder (dp2) + audio_encoder -> llm (tp2 pp2) -> generator");
    print!("{}", plan.to_text());
    let cfg = GlooConfig::new("multimodule-demo").with_timeout(Duration::from_secs(60));
    let started = std::time::Instant::now();
    let results = run_ranks(8, &cfg, |f, w| {
        let mm = MultiModulePipelineCommunicator::new(f, Arc::new(w), &plan, 0)
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        let stage = mm
            .current_stage()
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        let mut log = vec![(
            usize::MAX,
            0,
            mm.rank(),
            format!(
                "rank {} runs {:?} at stage {stage}",
                mm.rank(),
                mm.modules().iter().map(|m| &m.name).collect::<Vec<_>>()
            ),
        )];
        log.extend(rank_main(&mm).map_err(grid_core::Error::Invalid)?);
        Ok(log)
    });
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the ranks: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut all = Log::new();
    let mut failed = false;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(l) => all.extend(l),
            Err(e) => {
                eprintln!("rank {r} failed: {e}");
                failed = true;
            }
        }
    }
    all.sort_by_key(|(mb, phase, rank, _)| {
        (
            if *mb == usize::MAX {
                0
            } else {
                1 + *phase * 100 + *mb
            },
            *rank,
        )
    });
    let mut header = None;
    for (mb, phase, _, line) in &all {
        let h = if *mb == usize::MAX {
            "ranks:".to_string()
        } else {
            format!(
                "{} micro-batch {mb}:",
                if *phase == 0 { "forward" } else { "backward" }
            )
        };
        if header.as_ref() != Some(&h) {
            println!("{h}");
            header = Some(h);
        }
        println!("{}{line}", if *mb == usize::MAX { "  " } else { "" });
    }
    println!(
        "done in {:.2} s: {}",
        started.elapsed().as_secs_f64(),
        if failed {
            "FAILED"
        } else {
            "LLM inputs checked row by row"
        }
    );
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
