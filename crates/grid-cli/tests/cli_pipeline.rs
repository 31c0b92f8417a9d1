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

/// A spec whose plan is larger than the cap (here a 2^26-rank fan-in, which once grew to 8 GB
/// and aborted) is refused before planning: status 2, one line naming the size and the cap.
#[test]
fn pipeline_refuses_a_plan_too_large_to_print() {
    let dir = std::env::temp_dir().join(format!("grid-cli-pipeline-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let spec = dir.join("huge.json");
    let n = 1usize << 26;
    std::fs::write(
        &spec,
        format!(r#"{{"modules": {{"enc": {{"dp": {n}}}, "llm": {{"offset": {n}}}}}, "topology": {{"enc": ["llm"]}}}}"#),
    )
    .expect("write spec");
    let path = spec.to_string_lossy().to_string();
    for format in ["text", "json"] {
        let started = std::time::Instant::now();
        let (code, out, err) = run(&["pipeline", &path, "--format", format]);
        assert_eq!((code, out.as_str()), (2, ""), "{err}");
        assert_eq!(
            err,
            format!(
                "grid: error: grid pipeline: {path}: the plan of this spec has {} rank entries (every rank of every module and of both ends of every bridge), too large to print (at most 4194304)\n",
                2 * (n + 1)
            )
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// Planning and printing are linear: a 262,144-rank fan-in (25 s in release when the bridge
/// summary searched each leader) and a 20,000-module chain finish in a debug build, whole.
#[test]
fn pipeline_large_specs_complete() {
    let dir = std::env::temp_dir().join(format!("grid-cli-pipeline-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let n = 1usize << 18;
    let fan_in = dir.join("fan_in.json");
    std::fs::write(
        &fan_in,
        format!(r#"{{"modules": {{"enc": {{"dp": {n}}}, "llm": {{"offset": {n}}}}}, "topology": {{"enc": ["llm"]}}}}"#),
    )
    .expect("write spec");
    let m = 20_000;
    let chain = dir.join("chain.json");
    let modules: Vec<String> = (0..m)
        .map(|i| format!(r#""m{i}": {{"offset": {i}}}"#))
        .collect();
    let topology: Vec<String> = (0..m - 1)
        .map(|i| format!(r#""m{i}": ["m{}"]"#, i + 1))
        .collect();
    std::fs::write(
        &chain,
        format!(
            r#"{{"modules": {{{}}}, "topology": {{{}}}}}"#,
            modules.join(","),
            topology.join(",")
        ),
    )
    .expect("write spec");
    let started = std::time::Instant::now();
    let (code, text, err) = run(&["pipeline", &fan_in.to_string_lossy()]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + (n + 1) + 1);
    assert_eq!(lines[0], "total stages: 2");
    assert_eq!(
        lines[n + 1],
        format!("rank {n}: stage 1 last [llm pp 0/1 through 2]")
    );
    let bridge = lines[n + 2];
    assert!(
        bridge.starts_with("bridge enc -> llm: leaders [0, 1, 2, "),
        "{}",
        &bridge[..80]
    );
    assert!(
        bridge.ends_with(&format!(" {}->[{n}]", n - 1)),
        "{}",
        &bridge[bridge.len() - 80..]
    );
    let (code, text, err) = run(&["pipeline", &chain.to_string_lossy(), "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["total_stages"], m);
    assert_eq!(v["ranks"].as_object().map(|o| o.len()), Some(m));
    assert_eq!(v["bridges"].as_array().map(|b| b.len()), Some(m - 1));
    assert_eq!(
        v["bridges"][m - 2]["routes"][(m - 2).to_string()]["peers"],
        json!([m - 1])
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(120));
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
