//! `RankModuleInfo::is_source_stage` / `is_terminal_stage` on every `multimodule` reference
//! vector: Megatron documents them as "at the absolute first (last) stage in the overall model
//! (no incoming (outgoing) connections)" but never sets them (both stay `True`), so the
//! expected values follow the documented meaning, computed from the edges and per-module
//! stages the vector recorded.

mod common;
use common::vectors::{self, spec_json};
use multimodule::{PipelinePlan, PipelineSpec};

#[test]
fn source_and_terminal_stages_follow_megatrons_documented_meaning() {
    let mut checked = 0;
    for (name, doc) in vectors::of_op("multimodule") {
        let exp = &doc["expected"];
        if exp.get("error").is_some() {
            continue;
        }
        let spec = PipelineSpec::from_json_value(spec_json(&doc["input"]))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan = PipelinePlan::new(&spec).unwrap();
        let edges: Vec<[String; 2]> = serde_json::from_value(exp["bridges"].clone()).unwrap();
        for (rank, pr) in exp["per_rank"].as_object().unwrap() {
            let r: usize = rank.parse().unwrap();
            let modules = pr["modules"].as_object().unwrap();
            for info in plan.rank_modules(r).unwrap() {
                let e = &modules[&info.name];
                let pp_rank = e["pp_rank"].as_u64().unwrap();
                let pp_size = e["pp_size"].as_u64().unwrap();
                let incoming = edges.iter().any(|[_, b]| *b == info.name);
                let outgoing = edges.iter().any(|[a, _]| *a == info.name);
                assert_eq!(
                    info.is_source_stage,
                    pp_rank == 0 && !incoming,
                    "{name} rank {r} {}",
                    info.name
                );
                assert_eq!(
                    info.is_terminal_stage,
                    pp_rank + 1 == pp_size && !outgoing,
                    "{name} rank {r} {}",
                    info.name
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "{checked} (rank, module) pairs");
}
