//! `grid layout --vpp N --rank R`: the rank's virtual-pipeline state, in text and JSON, on every
//! reference vector that has a `vpp` value.
//!
//! The expected chunk lists are derived from Megatron-Core's formulas
//! (`megatron/core/parallel_state.py`), fed with the globals the vector recorded for the rank:
//! with `ignore_virtual=False` and `vp_stage=c`,
//! * `is_pipeline_first_stage` is `c == 0 and pp_rank == 0`;
//! * `is_pipeline_last_stage` is `c == vpp - 1 and pp_rank == pp_world_size - 1`;
//! * `is_rank_in_embedding_group` is false outside `_EMBEDDING_GLOBAL_RANKS` (E); for
//!   `rank == E[0]` the first-stage answer, else for `rank == E[-1]` the last-stage answer, else
//!   true.
//!
//! `first_stage_chunks` (and the others) list the chunks `c` for which the answer is true.

mod common;
use common::{grid, load, u};
use serde_json::{json, Value};

fn arg_list(input: &Value, rank: usize) -> Vec<String> {
    let mut a: Vec<String> = vec!["layout".into(), "--world-size".into()];
    let world = u(input, "local_world_size")
        .or(u(input, "world_size"))
        .expect("world size");
    a.push(world.to_string());
    for (k, flag) in [
        ("tp", "--tp"),
        ("pp", "--pp"),
        ("cp", "--cp"),
        ("ep", "--ep"),
        ("etp", "--etp"),
        ("vpp", "--vpp"),
        (
            "num_distributed_optimizer_instances",
            "--dist-opt-instances",
        ),
        ("rank_offset", "--rank-offset"),
    ] {
        if let Some(x) = u(input, k) {
            a.push(flag.into());
            a.push(x.to_string());
        }
    }
    if let Some(o) = input.get("order").and_then(Value::as_str) {
        a.push("--order".into());
        a.push(o.into());
    }
    a.extend([
        "--rank".into(),
        rank.to_string(),
        "--format".into(),
        "json".into(),
    ]);
    a
}

fn list(v: &Value) -> Option<Vec<usize>> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize).collect())
}

/// The `vpp` object Megatron's formulas give for `rank` (see the module docs).
fn expected_vpp(rank: usize, vpp: usize, globals: &Value) -> Value {
    let mut pipeline = list(&globals["_PIPELINE_GLOBAL_RANKS"]).expect("pipeline ranks");
    pipeline.sort_unstable();
    let pp_rank = pipeline
        .iter()
        .position(|&r| r == rank)
        .expect("in pipeline");
    let first = |c: usize| c == 0 && pp_rank == 0;
    let last = |c: usize| c == vpp - 1 && pp_rank == pipeline.len() - 1;
    let embedding = |c: usize| match list(&globals["_EMBEDDING_GLOBAL_RANKS"]) {
        Some(e) if e.contains(&rank) => {
            if rank == e[0] {
                first(c)
            } else if rank == e[e.len() - 1] {
                last(c)
            } else {
                true
            }
        }
        _ => false,
    };
    let chunks = |f: &dyn Fn(usize) -> bool| (0..vpp).filter(|&c| f(c)).collect::<Vec<_>>();
    json!({
        "size": vpp,
        "first_stage_chunks": chunks(&first),
        "last_stage_chunks": chunks(&last),
        "embedding_chunks": chunks(&embedding),
    })
}

#[test]
fn vpp_object_matches_megatron_on_every_vpp_vector() {
    let mut checked = 0;
    let mut errors = 0;
    for (name, v) in load("initialize_model_parallel") {
        let input = &v["input"];
        let Some(vpp) = u(input, "vpp") else {
            continue;
        };
        let expected = &v["expected"];
        if expected.get("error").is_some() {
            grid(&arg_list(input, 0))
                .invalid()
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            errors += 1;
            continue;
        }
        for (rank, view) in expected["rank_views"].as_object().expect("rank views") {
            let rank: usize = rank.parse().unwrap();
            let out = grid(&arg_list(input, rank))
                .json()
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let want = expected_vpp(rank, vpp, &view["rank_globals"]);
            assert_eq!(out["vpp"], want, "{name} rank {rank}");
            checked += 1;
        }
    }
    assert!(
        checked >= 3 && errors >= 1,
        "{checked} ranks, {errors} errors"
    );
}

#[test]
fn vpp_text_and_json_exact() {
    let args = |r: &str, json: bool| {
        let mut a: Vec<String> = [
            "layout",
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "4",
            "--vpp",
            "2",
            "--rank",
            r,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if json {
            a.extend(["--format".into(), "json".into()]);
        }
        a
    };
    let text = grid(&args("13", false));
    assert_eq!(text.code, 0, "{}", text.stderr);
    let head: Vec<&str> = text.stdout.lines().take(6).collect();
    assert_eq!(
        head,
        [
            "Rank 13 of a layout of 16 ranks (0..=15), order tp-cp-ep-dp-pp",
            "  dense coordinates:  tp 1, cp 0, dp 0, pp 3",
            "  expert coordinates: expert tp 1, ep 0, expert dp 0, pp 3",
            "  pipeline: stage 3 of 4 (last stage); next rank 1, previous rank 9 (wrapping around)",
            "  virtual pipeline: 2 model chunks per stage; virtual first stage in chunks none, \
             virtual last stage in chunks [1], embedding in chunks [1]",
            "  embedding group: member; position-embedding group: not a member",
        ]
    );
    let v = grid(&args("0", true)).json().unwrap();
    assert_eq!(
        v["vpp"],
        json!({"size": 2, "first_stage_chunks": [0], "last_stage_chunks": [], "embedding_chunks": [0]})
    );
    // Without --vpp there is no virtual-pipeline line and no "vpp" key.
    let plain = grid(
        &[
            "layout",
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "4",
            "--rank",
            "0",
            "--format",
            "json",
        ]
        .map(String::from),
    )
    .json()
    .unwrap();
    assert!(plain.get("vpp").is_none(), "{plain}");
    // --vpp without pipeline parallelism is refused with one line.
    let bad = grid(&["layout", "--world-size", "8", "--vpp", "2", "--rank", "0"].map(String::from));
    bad.invalid().unwrap();
    assert!(
        bad.stderr
            .contains("virtual pipeline size 2 needs a pipeline-parallel size greater than 1"),
        "{}",
        bad.stderr
    );
}
