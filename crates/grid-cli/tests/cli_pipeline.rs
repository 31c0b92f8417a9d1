//! `grid pipeline SPEC`: the plan of a multi-module pipeline spec file.

mod common;
use common::cli::{json, run};
use serde_json::{json, Value};

/// `grid pipeline SPEC`: Megatron's unit-test topology (docs/semantics.md §6.3): two one-rank encoders
/// feed a tp 2 × pp 2 language model, which feeds a generator; 4 stages in all.
#[test]
fn pipeline_spec_file() {
    let dir = std::env::temp_dir().join(format!("grid-cli-pipeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let spec = dir.join("pipeline.json");
    std::fs::write(
        &spec,
        r#"{"world_size": 8,
            "modules": {"image_encoder": {}, "audio_encoder": {"offset": 1},
                        "llm": {"tp": 2, "pp": 2, "offset": 2}, "generator": {"tp": 2, "offset": 6}},
            "topology": {"image_encoder": ["llm"], "audio_encoder": ["llm"], "llm": ["generator"]}}"#,
    )
    .expect("write spec");
    let path = spec.to_string_lossy().to_string();
    let v = json(&["pipeline", &path, "--format", "json"]);
    assert_eq!(v["total_stages"], 4);
    let stages: Vec<Value> = (0..8)
        .map(|r| v["ranks"][r.to_string()]["current_stage"].clone())
        .collect();
    assert_eq!(stages, [0, 0, 1, 1, 2, 2, 3, 3].map(|s| json!(s)).to_vec());
    let first: Vec<bool> = (0..8)
        .map(|r| v["ranks"][r.to_string()]["is_first_stage"] == true)
        .collect();
    let last: Vec<bool> = (0..8)
        .map(|r| v["ranks"][r.to_string()]["is_last_stage"] == true)
        .collect();
    assert_eq!(
        first,
        [true, true, false, false, false, false, false, false]
    );
    assert_eq!(last, [false, false, false, false, false, false, true, true]);
    let (code, text, _) = run(&["pipeline", &path]);
    assert_eq!(code, 0);
    assert!(text.starts_with("total stages: 4\n"), "{text}");

    // A cycle, a missing file, a missing argument: exit 2 with one line.
    let bad = dir.join("cycle.json");
    std::fs::write(
        &bad,
        r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["b"], "b": ["a"]}}"#,
    )
    .expect("write spec");
    let bad = bad.to_string_lossy().to_string();
    let missing = dir.join("nope.json").to_string_lossy().to_string();
    for args in [
        vec!["pipeline", bad.as_str()],
        vec!["pipeline", missing.as_str()],
        vec!["pipeline"],
        vec!["pipeline", "a", "b"],
    ] {
        let (code, out, err) = run(&args);
        assert_eq!((code, out.as_str()), (2, ""), "grid {args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "grid {args:?}: {err}");
        assert!(
            err.starts_with("grid: error: grid pipeline"),
            "grid {args:?}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// An endless or huge input is refused at once (status 2, one line), never read into memory.
#[test]
fn pipeline_refuses_an_endless_input() {
    let started = std::time::Instant::now();
    let (code, out, err) = run(&["pipeline", "/dev/zero"]);
    assert_eq!(code, 2, "stdout {out:?} stderr {err:?}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("larger than 64 MiB"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}
