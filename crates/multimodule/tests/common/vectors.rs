//! Loading the reference vectors of `<workspace root>/testdata/vectors` (see `testdata/README.md`).
#![allow(dead_code)]

use serde_json::{json, Value};
use std::path::PathBuf;

/// The vectors directory: `<workspace root>/testdata/vectors`, or the folder named by
/// `GRID_VECTORS_DIR`. Panics (failing the test, never skipping it) with a clear message when it
/// is missing.
pub fn dir() -> PathBuf {
    let d = std::env::var_os("GRID_VECTORS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vectors")
        });
    assert!(
        d.join("INDEX.json").is_file(),
        "reference vectors not found at {} (no INDEX.json): they live in the repository's \
         testdata/vectors; restore that folder, or point GRID_VECTORS_DIR at a copy",
        d.display()
    );
    d
}

/// Every vector of one op, as (name, document), in INDEX.json order. Fails without any.
pub fn of_op(op: &str) -> Vec<(String, Value)> {
    let d = dir();
    let read = |p: PathBuf| -> Value {
        let text = std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", p.display()))
    };
    let index = read(d.join("INDEX.json"));
    let entries = index
        .as_array()
        .unwrap_or_else(|| panic!("{}/INDEX.json is not a list", d.display()));
    let mut out = Vec::new();
    for e in entries {
        if e["op"] == op {
            let name = e["name"]
                .as_str()
                .unwrap_or_else(|| panic!("INDEX.json entry without a name: {e}"))
                .to_string();
            let v = read(d.join(format!("{name}.json")));
            out.push((name, v));
        }
    }
    assert!(!out.is_empty(), "no vector of op {op} in {}", d.display());
    out
}

/// A grid in the vectors' form (short or full) converted to our full form.
pub fn grid(v: &Value) -> grid_core::HyperGrid {
    if let Some(shape) = v.get("shape") {
        let shape: Vec<usize> = serde_json::from_value(shape.clone()).unwrap();
        let dims: Vec<String> = serde_json::from_value(v["dim_names"].clone()).unwrap();
        let off = v.get("rank_offset").and_then(Value::as_u64).unwrap_or(0) as usize;
        return grid_core::HyperGrid::new(shape, &dims, off).unwrap();
    }
    let g = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(1) as usize;
    let off = v.get("offset").and_then(Value::as_u64).unwrap_or(0) as usize;
    if v.get("gtp_remat").is_some() {
        grid_core::HyperGrid::new(
            vec![g("tp"), g("gtp_remat"), g("cp"), g("pp"), g("dp")],
            &["tp", "gtp_remat", "cp", "pp", "dp"],
            off,
        )
        .unwrap()
    } else {
        grid_core::HyperGrid::new(
            vec![g("tp"), g("cp"), g("pp"), g("dp")],
            &["tp", "cp", "pp", "dp"],
            off,
        )
        .unwrap()
    }
}

/// A spec document built from a vector's input. The vectors predate our `colocated` field, so
/// every pair of modules whose ranks overlap is declared colocated here.
pub fn spec_json(input: &Value) -> Value {
    let mut spec = json!({
        "world_size": input["world_size"],
        "modules": input["modules"],
        "topology": input["topology"],
    });
    for k in ["module_output_ndim", "dim_mapping"] {
        if let Some(v) = input.get(k) {
            if !v.is_null() {
                spec[k] = v.clone();
            }
        }
    }
    let mods: Vec<(String, grid_core::HyperGrid)> = input["modules"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), grid(v)))
        .collect();
    let mut colocated = Vec::new();
    for (i, (a, ga)) in mods.iter().enumerate() {
        for (b, gb) in &mods[i + 1..] {
            let (a0, a1) = (ga.offset(), ga.offset() + ga.size());
            let (b0, b1) = (gb.offset(), gb.offset() + gb.size());
            if a0 < b1 && b0 < a1 {
                colocated.push(json!([a, b]));
            }
        }
    }
    spec["colocated"] = Value::Array(colocated);
    spec
}

/// A tensor of `shape` whose every element holds its index along `batch_dim` plus `base`.
pub fn tagged(shape: &[usize], batch_dim: usize, base: f32) -> multimodule::Activation {
    let n: usize = shape.iter().product();
    let inner: usize = shape[batch_dim + 1..].iter().product();
    let rows = shape[batch_dim];
    let data: Vec<f32> = (0..n)
        .map(|e| base + ((e / inner.max(1)) % rows.max(1)) as f32)
        .collect();
    multimodule::Activation::from_vec(shape.to_vec(), data).unwrap()
}

/// The batch ids of a tagged tensor: the value at the start of each row along `batch_dim`,
/// after checking that the whole row holds that value.
pub fn batch_ids(t: &multimodule::Activation, batch_dim: usize) -> Vec<i64> {
    let shape = t.shape();
    let v = t.to_vec::<f32>().unwrap();
    let inner: usize = shape[batch_dim + 1..].iter().product();
    let rows = shape[batch_dim];
    let mut ids = vec![None::<f32>; rows];
    for (e, &x) in v.iter().enumerate() {
        let r = (e / inner.max(1)) % rows.max(1);
        match ids[r] {
            None => ids[r] = Some(x),
            Some(y) => assert_eq!(x, y, "row {r} along dim {batch_dim} holds mixed values"),
        }
    }
    ids.into_iter().map(|x| x.unwrap_or(-1.0) as i64).collect()
}
