//! A two-module pipeline joined by a bridge: an encoder with data parallel 2 feeds a language
//! model with tensor parallel 2. Four Gloo ranks run as threads of this process; one
//! micro-batch goes forward and its gradient comes back, and every element is checked.
//!
//! Run: `cargo run -p multimodule --example two_module_pipeline`
//!
//! Ranks 0 and 1 hold the two data-parallel lanes of the encoder, ranks 2 and 3 the language
//! model's tensor-parallel pair. The bridge is a fan-in: both encoder lanes send their half of
//! the batch to the model's leader (rank 2), which receives them concatenated along the batch
//! dimension and shares them with rank 3 (its tensor-parallel peer). Backward, the gradient is
//! split again and each encoder lane gets the rows it sent. The same code runs over MPI or NCCL
//! communicators: only the lines that start the ranks change.

use backend_gloo::{run_ranks, GlooConfig};
use multimodule::{
    Activation, ModuleInputs, MultiModulePipelineCommunicator, PipelinePlan, PipelineSpec,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// The pipeline: modules with their grids (`offset` is the first rank) and who feeds whom.
const SPEC: &str = r#"{
  "world_size": 4,
  "modules": {
    "encoder": {"dp": 2},
    "llm":     {"tp": 2, "offset": 2}
  },
  "topology": {"encoder": ["llm"]},
  "language_model": "llm"
}"#;

/// Samples per encoder lane, sequence length and hidden size of the activations `[B, S, H]`.
const BATCH: usize = 2;
const SEQ: usize = 3;
const HIDDEN: usize = 4;

/// Encoder lane `lane`'s activation: every element of sample `b` holds `100·lane + b`, so a
/// receiver can tell which lane and sample each row came from.
fn encoder_output(lane: usize) -> Result<Activation, String> {
    let data: Vec<f32> = (0..BATCH * SEQ * HIDDEN)
        .map(|e| (100 * lane + e / (SEQ * HIDDEN)) as f32)
        .collect();
    Activation::from_vec(vec![BATCH, SEQ, HIDDEN], data).map_err(|e| e.to_string())
}

/// The first element of every sample (row) of a `[B, S, H]` tensor (exact small integers).
fn row_tags(t: &Activation) -> Vec<i64> {
    let per_row = SEQ * HIDDEN;
    t.as_slice::<f32>()
        .unwrap_or(&[])
        .chunks(per_row)
        .map(|row| row[0] as i64)
        .collect()
}

/// One rank's part of one training step; returns what it checked.
fn step(
    mm: &MultiModulePipelineCommunicator<backend_gloo::GlooCommunicator>,
) -> Result<String, String> {
    let me = mm.rank();
    // The module this rank runs (one per rank here; colocated modules would give several).
    let module = mm
        .modules()
        .first()
        .map(|m| m.name.clone())
        .ok_or(format!("rank {me} runs no module"))?;
    let err = |e: multimodule::Error| format!("rank {me} ({module}): {e}");

    if module == "encoder" {
        // Forward: produce this lane's activation and send it over the bridge.
        mm.send_forward(&module, &encoder_output(me)?)
            .map_err(err)?;
        // Backward: receive the gradient of exactly the rows this lane sent.
        let grad = mm
            .recv_backward(&module)
            .map_err(err)?
            .ok_or(format!("rank {me}: no gradient arrived"))?;
        let want: Vec<i64> = (0..BATCH).map(|b| -((100 * me + b) as i64)).collect();
        if row_tags(&grad) != want {
            return Err(format!(
                "rank {me}: gradient rows {:?}, expected {want:?}",
                row_tags(&grad)
            ));
        }
        return Ok(format!(
            "rank {me} encoder: sent rows {:?}, got their gradient back",
            (0..BATCH).map(|b| 100 * me + b).collect::<Vec<_>>()
        ));
    }

    // The language model: its inputs, keyed by the module that produced them.
    let inputs = mm.recv_forward(&module).map_err(err)?;
    let x = inputs
        .get("encoder")
        .ok_or(format!("rank {me}: no input from the encoder"))?;
    // Both lanes' samples, in lane order, on both tensor-parallel ranks.
    let want = vec![0, 1, 100, 101];
    if x.shape() != [2 * BATCH, SEQ, HIDDEN] || row_tags(x) != want {
        return Err(format!(
            "rank {me}: input {:?} with rows {:?}, expected [4, 3, 4] with rows {want:?}",
            x.shape(),
            row_tags(x)
        ));
    }
    // Backward: a stand-in gradient (-x) for the input, sent back to the encoder.
    let neg: Vec<f32> = x
        .as_slice::<f32>()
        .unwrap_or(&[])
        .iter()
        .map(|v| -v)
        .collect();
    let mut grads = ModuleInputs::new();
    grads.push(
        "encoder",
        Activation::from_vec(x.shape().to_vec(), neg).map_err(|e| e.to_string())?,
    );
    mm.send_backward(&module, &grads).map_err(err)?;
    Ok(format!(
        "rank {me} llm: got rows {:?} from both encoder lanes, sent the gradient back",
        row_tags(x)
    ))
}

fn main() -> ExitCode {
    // 1. Parse and validate the spec (names, grids inside the world, no cycle, ...), then plan
    //    it once: stages and bridge routing, the same value on every rank (what `grid pipeline`
    //    prints for this spec).
    let plan = match PipelineSpec::from_json_str(SPEC).and_then(|spec| PipelinePlan::new(&spec)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("two_module_pipeline: {e}");
            return ExitCode::FAILURE;
        }
    };
    // 2. Start 4 Gloo ranks as threads; each builds its pipeline communicator (collective over
    //    the world: it creates the bridge's groups) and runs one step.
    let config = GlooConfig::new("two-module-pipeline").with_timeout(Duration::from_secs(30));
    let results = run_ranks(4, &config, |factory, world| {
        let mm = MultiModulePipelineCommunicator::new(factory, Arc::new(world), &plan, 0)
            .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
        step(&mm).map_err(grid_core::Error::Invalid)
    });
    // 3. Report every rank; fail if any rank failed.
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            eprintln!("two_module_pipeline: cannot start the ranks: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut ok = true;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("two_module_pipeline: rank {rank}: {e}");
                ok = false;
            }
        }
    }
    if ok {
        println!("checked: the bridge delivered every row forward and every gradient row back");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
