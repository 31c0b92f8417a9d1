//! The plan is what runs: a `PipelinePlan` written as JSON (what `grid pipeline SPEC --format
//! json` prints) and read back is the same plan, it drives the multi-module pipeline with every
//! element checked, the communicator's stages and bridges are exactly the plan's, and a document
//! that is not its spec's plan is refused.

mod common;
use common::scenarios::{two_encoders_rank, two_encoders_spec, TWO_ENCODERS_PER_MB};
use common::threads::{run_world, ThreadComm, ThreadFactory};
use multimodule::{
    BridgeSummary, Error, MultiModulePipelineCommunicator, PipelinePlan, PipelineSpec, Role,
};
use serde_json::{json, Value};
use std::sync::Arc;

/// Specs covering every kind of route: fan-in, fan-out, pp > 1, lcm routing (3 -> 2), cp on
/// the source, colocated modules (sender_receiver ranks) and 2-D outputs.
fn specs() -> Vec<PipelineSpec> {
    let texts = [
        r#"{"modules": {"a": {"dp": 3}, "b": {"dp": 2, "offset": 3}}, "topology": {"a": ["b"]}}"#,
        r#"{"modules": {"enc": {"tp": 2, "cp": 2}, "llm": {"dp": 2, "pp": 2, "offset": 4}},
            "topology": {"enc": ["llm"]}}"#,
        r#"{"modules": {"enc": {"dp": 2}, "llm": {"dp": 2, "pp": 2}}, "topology": {"enc": ["llm"]},
            "colocated": [["enc", "llm"]]}"#,
        r#"{"modules": {"A": {"dp": 2, "output_ndim": 2}, "B": {"offset": 2}, "C": {"dp": 2, "offset": 3}},
            "topology": {"A": ["B", "C"]}, "dim_mapping": {"s": 0, "b": 1, "h": 2}}"#,
    ];
    let mut v: Vec<PipelineSpec> = texts
        .iter()
        .map(|t| PipelineSpec::from_json_str(t).unwrap())
        .collect();
    v.push(two_encoders_spec());
    v
}

#[test]
fn json_round_trip_is_the_same_plan() {
    let mut roles = Vec::new();
    for spec in specs() {
        let plan = PipelinePlan::new(&spec).unwrap();
        let text = plan.to_json();
        let back = PipelinePlan::from_json_str(&text).unwrap();
        assert_eq!(back, plan, "{text}");
        assert_eq!(back.to_json(), text);
        assert_eq!(back.to_text(), plan.to_text());
        // Through serde as well (the form a framework embeds in its own configuration).
        let value: Value = serde_json::from_str(&text).unwrap();
        let via_serde: PipelinePlan = serde_json::from_value(value.clone()).unwrap();
        assert_eq!(via_serde, plan);
        // The summaries are the routing objects' summaries, and the spec is the spec.
        assert_eq!(back.bridges().len(), back.bridge_plans().len());
        for (summary, routing) in back.bridges().iter().zip(back.bridge_plans()) {
            assert_eq!(summary, &BridgeSummary::from_plan(routing));
        }
        assert_eq!(back.spec(), &spec);
        assert_eq!(
            value["spec"],
            serde_json::from_str::<Value>(&spec.to_json()).unwrap()
        );
        roles.extend(
            back.bridges()
                .iter()
                .flat_map(|b| b.routes.values().map(|r| r.role)),
        );
    }
    // The specs above exercise every role, sender_receiver (with recv_peers) included.
    for role in [Role::Sender, Role::Receiver, Role::SenderReceiver] {
        assert!(roles.contains(&role), "{role:?}");
    }
}

/// `grid pipeline SPEC --format json > plan.json`, then every rank builds its communicator from
/// `plan.json`: the run is the two-encoder pipeline with every element checked, and on every
/// rank the communicator's stage numbers, modules and bridges are the plan's.
#[test]
fn a_plan_read_back_from_json_drives_the_pipeline() {
    let dir = std::env::temp_dir().join(format!("multimodule-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec_path = dir.join("pipeline.json");
    std::fs::write(&spec_path, two_encoders_spec().to_json()).unwrap();
    let printed = PipelinePlan::from_spec_file(&spec_path).unwrap().to_json();
    std::fs::remove_dir_all(&dir).unwrap();
    let plan = PipelinePlan::from_json_str(&printed).unwrap();
    let printed: Value = serde_json::from_str(&printed).unwrap();

    let n = 3;
    let (res, _) = run_world(8, true, |rank, comm: Arc<ThreadComm>| -> usize {
        {
            let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm.clone(), &plan, 0)
                .unwrap();
            assert_eq!(mm.total_stages(), plan.total_stages());
            assert_eq!(mm.rank_plan(), plan.rank(rank));
            let rp = plan.rank(rank).unwrap();
            assert_eq!(mm.current_stage().unwrap(), rp.current_stage);
            assert_eq!(mm.is_first_stage(), rp.is_first_stage);
            assert_eq!(mm.is_last_stage(), rp.is_last_stage);
            assert_eq!(mm.modules(), &plan.rank_modules(rank).unwrap()[..]);
            let mine = &printed["ranks"][rank.to_string()];
            assert_eq!(mine["current_stage"], json!(mm.current_stage().unwrap()));
            for m in mm.modules() {
                assert_eq!(mine["modules"][&m.name]["pp_rank"], json!(m.pp_rank));
                assert_eq!(
                    mine["modules"][&m.name]["stages_through"],
                    json!(m.stages_through)
                );
            }
            assert_eq!(mm.bridges().len(), plan.bridge_plans().len());
            for (k, b) in mm.bridges().iter().enumerate() {
                assert_eq!(b.plan(), &plan.bridge_plans()[k]);
                // What was printed for the bridge is the summary of the routing that runs.
                let runs = serde_json::to_value(BridgeSummary::from_plan(b.plan())).unwrap();
                assert_eq!(runs, printed["bridges"][k]);
            }
        }
        two_encoders_rank(&ThreadFactory, comm, &plan, rank, n)
    });
    assert_eq!(res.iter().sum::<usize>(), n * TWO_ENCODERS_PER_MB);
}

/// A rank of the parent that no module holds gets a communicator with no module and says so.
#[test]
fn a_rank_outside_every_module() {
    let spec = PipelineSpec::from_json_str(
        r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["b"]}}"#,
    )
    .unwrap();
    let plan = PipelinePlan::new(&spec).unwrap();
    assert!(plan.rank(2).is_none());
    let (res, _) = run_world(3, true, |rank, comm: Arc<ThreadComm>| {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        if rank == 2 {
            assert!(mm.modules().is_empty() && mm.rank_plan().is_none());
            assert!(!mm.is_first_stage() && !mm.is_last_stage());
            let e = mm.current_stage().unwrap_err();
            assert!(matches!(e, Error::RankInNoModule { rank: 2 }), "{e}");
            assert!(matches!(
                mm.recv_forward("a"),
                Err(Error::ModuleNotOnRank { .. })
            ));
        } else {
            assert_eq!(mm.current_stage().unwrap(), rank);
        }
        rank
    });
    assert_eq!(res, vec![0, 1, 2]);
}

/// A document that is not exactly its spec's plan is refused, naming what differs.
#[test]
fn stale_or_edited_plans_are_refused() {
    let plan = PipelinePlan::new(&two_encoders_spec()).unwrap();
    let good: Value = serde_json::from_str(&plan.to_json()).unwrap();
    let edit = |f: &dyn Fn(&mut Value)| -> Error {
        let mut v = good.clone();
        f(&mut v);
        PipelinePlan::from_json_str(&v.to_string()).unwrap_err()
    };
    let mismatch = |e: Error, want: &str| match &e {
        Error::PlanMismatch { what } => assert!(what.contains(want), "{want:?} not in {e}"),
        other => panic!("expected PlanMismatch, got {other}"),
    };
    mismatch(
        edit(&|v| v["total_stages"] = json!(5)),
        "total_stages is 5 in the document, 4 by its spec",
    );
    mismatch(
        edit(&|v| v["ranks"]["4"]["current_stage"] = json!(2)),
        "rank 4 is",
    );
    mismatch(
        edit(&|v| {
            v["ranks"].as_object_mut().unwrap().remove("7");
        }),
        "rank 7 is missing from the document, but its spec has it in modules [\"generator\"]",
    );
    mismatch(
        edit(&|v| v["ranks"]["8"] = v["ranks"]["7"].clone()),
        "the document lists rank 8, which is in no module of its spec",
    );
    mismatch(
        edit(&|v| v["bridges"][0]["routes"]["1"]["peers"] = json!([4])),
        "bridge image_encoder -> llm is",
    );
    mismatch(
        edit(&|v| {
            v["bridges"].as_array_mut().unwrap().pop();
        }),
        "the document has 2 bridges, its spec 3",
    );
    // The spec changed under the plan: the image encoder's two ranks became one tp group
    // (one lane instead of two), so the plan printed for the old spec is not this spec's plan.
    mismatch(
        edit(&|v| v["spec"]["modules"]["image_encoder"]["grid"]["shape"] = json!([2, 1, 1, 1])),
        "bridge image_encoder -> llm is",
    );
    let message = edit(&|v| v["total_stages"] = json!(5)).to_string();
    assert!(
        message.starts_with("the pipeline plan does not match its spec: ")
            && message
                .ends_with("regenerate the plan from the spec (grid pipeline SPEC --format json)"),
        "{message}"
    );
    // Not a plan, an invalid spec inside, unknown fields: parse errors with the reason.
    let parse = |e: Error, want: &str| match &e {
        Error::Parse { message, .. } => assert!(message.contains(want), "{want:?} not in {e}"),
        other => panic!("expected Parse, got {other}"),
    };
    parse(
        edit(&|v| {
            v.as_object_mut().unwrap().remove("spec");
        }),
        "missing field `spec`",
    );
    parse(edit(&|v| v["extra"] = json!(1)), "unknown field `extra`");
    parse(
        edit(&|v| v["spec"]["topology"]["generator"] = json!(["llm"])),
        "cycle",
    );
    parse(
        edit(&|v| v["ranks"]["0"]["modules"]["image_encoder"]["stage"] = json!(0)),
        "unknown field `stage`",
    );
    assert!(matches!(
        PipelinePlan::from_json_str("[1, 2]"),
        Err(Error::Parse { .. })
    ));
    // Through serde the same checks apply.
    let mut v = good.clone();
    v["total_stages"] = json!(9);
    let e = serde_json::from_value::<PipelinePlan>(v).unwrap_err();
    assert!(e.to_string().contains("does not match its spec"), "{e}");
}
