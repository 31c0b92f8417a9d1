//! The demo pipeline both `multimodule-demo` (ranks as threads) and `multihost-rank --check
//! pipeline` (one process per rank, across hosts) run: two encoders feeding a language model
//! over two stages, which feeds a generator, on 8 ranks; and the tagged tensors whose rows tell
//! a receiver where each row came from.

use multimodule::Activation;

/// The pipeline spec (JSON): `image_encoder` (dp 2, ranks 0-1) and `audio_encoder` (rank 2)
/// feed `llm` (tp 2 × pp 2, ranks 3-6), which feeds `generator` (rank 7).
pub const SPEC: &str = r#"{
  "world_size": 8,
  "modules": {
    "image_encoder": {"dp": 2},
    "audio_encoder": {"offset": 2},
    "llm":           {"tp": 2, "pp": 2, "offset": 3},
    "generator":     {"offset": 7}
  },
  "topology": {"image_encoder": ["llm"], "audio_encoder": ["llm"], "llm": ["generator"]},
  "language_model": "llm"
}"#;

/// Micro-batches per run.
pub const MICROBATCHES: usize = 2;
/// Sequence length of every activation.
pub const SEQ: usize = 3;
/// Hidden size of every activation.
pub const HIDDEN: usize = 4;

/// Sample `b` of source lane `lane` in micro-batch `mb`: a `[batch, SEQ, HIDDEN]` tensor whose
/// row `b` holds `mb·10000 + lane·1000 + b` everywhere, so a receiver can tell where each row
/// came from.
pub fn sample_tensor(mb: usize, lane: usize, batch: usize) -> Result<Activation, String> {
    let data: Vec<f32> = (0..batch * SEQ * HIDDEN)
        .map(|e| (mb * 10000 + lane * 1000 + e / (SEQ * HIDDEN)) as f32)
        .collect();
    Activation::from_vec(vec![batch, SEQ, HIDDEN], data).map_err(|e| e.to_string())
}

/// The per-row tags of a `[B, S, H]` tensor (the value of each row's first element).
pub fn rows(t: &Activation) -> Vec<i64> {
    let v = t.as_slice::<f32>().unwrap_or(&[]);
    let per = t.shape()[1..].iter().product::<usize>().max(1);
    v.chunks(per).map(|c| c[0] as i64).collect()
}

/// `t` with every element multiplied by `k` (the demo's stand-in for a backward pass).
pub fn scale(t: &Activation, k: f32) -> Result<Activation, String> {
    let v: Vec<f32> = t
        .as_slice::<f32>()
        .unwrap_or(&[])
        .iter()
        .map(|x| x * k)
        .collect();
    Activation::from_vec(t.shape().to_vec(), v).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_carry_their_tags() {
        let t = sample_tensor(1, 2, 3).unwrap();
        assert_eq!(t.shape(), &[3, SEQ, HIDDEN]);
        assert_eq!(rows(&t), vec![12000, 12001, 12002]);
        assert_eq!(
            rows(&scale(&t, -1.0).unwrap()),
            vec![-12000, -12001, -12002]
        );
        assert!(multimodule::PipelineSpec::from_json_str(SPEC).is_ok());
    }
}
