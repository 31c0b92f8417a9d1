//! `grid layout`, `grid enum`, `grid hierarchical` and `grid rank-generator`: exact text and JSON
//! output, and the consistency of per-rank views with full enumerations.

mod common;
use common::cli::{json, run};
use serde_json::{json, Value};

const LAYOUT_TEXT: &str = r#"Layout of 8 ranks (0..=7), order tp-cp-ep-dp-pp (fastest first)
  dense grid:  tp 2 × cp 1 × dp 2 × pp 2
  expert grid: expert tp 2 × ep 1 × expert dp 2 × pp 2
  dp 2, expert tp 2, expert dp 2, 1 distributed-optimizer instance

family          groups  size  first groups (Megatron's order)
tp                   4     2  [0, 1] [2, 3] [4, 5] [6, 7]
pp                   4     2  [0, 4] [1, 5] [2, 6] [3, 7]
mp                   2     4  [0, 1, 4, 5] [2, 3, 6, 7]
embd                 4     2  [0, 4] [1, 5] [2, 6] [3, 7]
pos_embd             4     1  [0] [1] [2] [3]
cp                   8     1  [0] [1] [2] [3] [4] [5] [6] [7]
tp_cp                4     2  [0, 1] [2, 3] [4, 5] [6, 7]
ep                   8     1  [0] [1] [2] [3] [4] [5] [6] [7]
expt_tp              4     2  [0, 1] [2, 3] [4, 5] [6, 7]
tp_ep                4     2  [0, 1] [2, 3] [4, 5] [6, 7]
tp_ep_pp             2     4  [0, 1, 4, 5] [2, 3, 6, 7]
tp_dp                2     4  [0, 1, 2, 3] [4, 5, 6, 7]
tp_dp_cp             2     4  [0, 1, 2, 3] [4, 5, 6, 7]
dp                   4     2  [0, 2] [1, 3] [4, 6] [5, 7]
dp_cp                4     2  [0, 2] [1, 3] [4, 6] [5, 7]
expt_dp              4     2  [0, 2] [1, 3] [4, 6] [5, 7]
intra_dp_cp          4     2  [0, 2] [1, 3] [4, 6] [5, 7]
intra_expt_dp        4     2  [0, 2] [1, 3] [4, 6] [5, 7]
inter_dist_opt       -     -  (none: one distributed-optimizer instance)
intra_dist_opt       1     8  [0, 1, 4, 5, 2, 3, 6, 7]
"#;

const RANK_TEXT: &str = r#"Rank 5 of a layout of 8 ranks (0..=7), order tp-cp-ep-dp-pp
  dense coordinates:  tp 1, cp 0, dp 0, pp 1
  expert coordinates: expert tp 1, ep 0, expert dp 0, pp 1
  pipeline: stage 1 of 2 (last stage); next rank 1, previous rank 1 (wrapping around)
  embedding group: member; position-embedding group: not a member

family          size  rank in group  group (Megatron's order)
tp                 2              1  [4, 5]
pp                 2              1  [1, 5]
mp                 4              3  [0, 1, 4, 5]
embd               2              1  [1, 5]
pos_embd           -              -  (not a member of any group)
cp                 1              0  [5]
tp_cp              2              1  [4, 5]
ep                 1              0  [5]
expt_tp            2              1  [4, 5]
tp_ep              2              1  [4, 5]
tp_ep_pp           4              3  [0, 1, 4, 5]
tp_dp              4              1  [4, 5, 6, 7]
tp_dp_cp           4              1  [4, 5, 6, 7]
dp                 2              0  [5, 7]
dp_cp              2              0  [5, 7]
expt_dp            2              0  [5, 7]
intra_dp_cp        2              0  [5, 7]
intra_expt_dp      2              0  [5, 7]
inter_dist_opt     -              -  (none: one distributed-optimizer instance)
intra_dist_opt     8              5  [0, 1, 4, 5, 2, 3, 6, 7]
"#;

#[test]
fn layout_text_is_a_readable_table() {
    let (code, out, err) = run(&["layout", "--world-size", "8", "--tp", "2", "--pp", "2"]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out, LAYOUT_TEXT);
}

#[test]
fn rank_view_text() {
    let (code, out, err) = run(&[
        "layout",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--rank",
        "5",
    ]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out, RANK_TEXT);
}

#[test]
fn rank_view_json_exact() {
    let v = json(&[
        "layout",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--rank",
        "5",
        "--format",
        "json",
    ]);
    assert_eq!(
        v,
        json!({
            "world_size": 8, "dp": 2, "expert_tp": 2, "expert_dp": 2, "rank": 5,
            "coords": {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "ep": 0, "expt_tp": 1, "expt_dp": 0},
            "groups": {
                "tp": [4, 5], "pp": [1, 5], "mp": [0, 1, 4, 5], "embd": [1, 5], "pos_embd": null,
                "cp": [5], "tp_cp": [4, 5], "ep": [5], "expt_tp": [4, 5],
                "tp_ep": [4, 5], "tp_ep_pp": [0, 1, 4, 5], "tp_dp": [4, 5, 6, 7],
                "tp_dp_cp": [4, 5, 6, 7], "dp": [5, 7], "dp_cp": [5, 7], "expt_dp": [5, 7],
                "intra_dp_cp": [5, 7], "intra_expt_dp": [5, 7], "inter_dist_opt": null,
                "intra_dist_opt": [0, 1, 4, 5, 2, 3, 6, 7]
            },
            "pp_next": 1, "pp_prev": 1, "is_first_stage": false, "is_last_stage": true
        })
    );
    // Key order is part of the contract's readability: the families in collection order.
    let (_, raw, _) = run(&[
        "layout",
        "--world-size",
        "8",
        "--rank",
        "0",
        "--format",
        "json",
    ]);
    let keys: Vec<&str> = [
        "\"world_size\"",
        "\"dp\"",
        "\"expert_tp\"",
        "\"expert_dp\"",
        "\"rank\"",
        "\"coords\"",
        "\"groups\"",
        "\"pp_next\"",
        "\"pp_prev\"",
        "\"is_first_stage\"",
        "\"is_last_stage\"",
    ]
    .to_vec();
    let pos: Vec<usize> = keys
        .iter()
        .map(|k| raw.find(k).expect("key present"))
        .collect();
    assert!(
        pos.windows(2).all(|w| w[0] < w[1]),
        "keys out of order: {raw}"
    );
}

#[test]
fn full_layout_json_shape() {
    let v = json(&[
        "layout",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--dist-opt-instances",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(
        (
            v["dp"].clone(),
            v["expert_tp"].clone(),
            v["expert_dp"].clone()
        ),
        (json!(8), json!(2), json!(8))
    );
    let f = &v["families"];
    assert!(f.get("hcp").is_none(), "hcp only with --hcp");
    assert_eq!(
        f["intra_dp_cp"],
        json!([[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]])
    );
    assert_eq!(
        f["intra_dist_opt"],
        json!([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]])
    );
    // One instance: intra_dp_cp is dp_cp, intra_expt_dp is expt_dp, inter_dist_opt is null.
    let v = json(&[
        "layout",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--pp",
        "4",
        "--format",
        "json",
    ]);
    let f = &v["families"];
    assert_eq!(f["intra_dp_cp"], f["dp_cp"]);
    assert_eq!(f["intra_expt_dp"], f["expt_dp"]);
    assert_eq!(f["inter_dist_opt"], Value::Null);
    assert_eq!(
        f["intra_dist_opt"],
        json!([[0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]])
    );
    assert_eq!(f["embd"], json!([[0, 12], [1, 13], [2, 14], [3, 15]]));
    // Hierarchical cp: a list of levels.
    let v = json(&[
        "layout",
        "--world-size",
        "32",
        "--cp",
        "8",
        "--pp",
        "2",
        "--hcp",
        "2,4",
        "--format",
        "json",
    ]);
    let hcp = v["families"]["hcp"].as_array().expect("hcp levels");
    assert_eq!(hcp.len(), 2);
    assert_eq!(hcp[0][0], json!([0, 1]));
    assert_eq!(hcp[1][0], json!([0, 2, 4, 6]));
    assert_eq!(hcp[1][2], json!([8, 10, 12, 14]));
}

/// Every rank's view equals its group in the full enumeration, for every family.
#[test]
fn per_rank_views_match_full_enumeration() {
    let configs: &[&[&str]] = &[
        &[
            "--world-size",
            "64",
            "--tp",
            "2",
            "--pp",
            "2",
            "--cp",
            "2",
            "--ep",
            "4",
            "--etp",
            "1",
            "--dist-opt-instances",
            "2",
        ],
        &[
            "--world-size",
            "32",
            "--cp",
            "8",
            "--pp",
            "2",
            "--hcp",
            "2,4",
            "--rank-offset",
            "5",
        ],
        &[
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--cp",
            "2",
            "--ep",
            "4",
            "--etp",
            "1",
            "--order",
            "tp-cp-ep-pp-dp",
        ],
    ];
    for cfg in configs {
        let mut full_args = vec!["layout"];
        full_args.extend_from_slice(cfg);
        full_args.extend(["--format", "json"]);
        let full = json(&full_args);
        let world = full["world_size"].as_u64().expect("world") as usize;
        let offset = cfg
            .iter()
            .position(|a| *a == "--rank-offset")
            .map_or(0, |i| cfg[i + 1].parse().expect("offset"));
        for rank in offset..offset + world {
            let r = rank.to_string();
            let mut args = full_args.clone();
            args.extend(["--rank", &r]);
            let v = json(&args);
            for (name, g) in v["groups"].as_object().expect("groups") {
                let fam = &full["families"][name];
                match (name.as_str(), g) {
                    (_, Value::Null) => {
                        if !["pos_embd", "embd", "inter_dist_opt", "hcp"].contains(&name.as_str()) {
                            panic!("{cfg:?} rank {rank}: no {name} group");
                        }
                        if let Some(all) = fam.as_array() {
                            assert!(
                                !all.iter()
                                    .any(|x| x.as_array().expect("group").contains(&json!(rank))),
                                "{name}: rank {rank} is in a group"
                            );
                        }
                    }
                    ("hcp", Value::Array(levels)) => {
                        for (l, g) in levels.iter().enumerate() {
                            assert!(
                                fam[l].as_array().expect("level").contains(g),
                                "hcp level {l} of rank {rank}"
                            );
                        }
                    }
                    (_, g) => {
                        assert!(
                            g.as_array().expect("list").contains(&json!(rank)),
                            "{cfg:?} rank {rank} not in its {name} group {g}"
                        );
                        assert!(
                            fam.as_array().expect("family").contains(g),
                            "{cfg:?} rank {rank}: {name} group {g} not in the enumeration"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn enum_json_and_text() {
    let v = json(&[
        "enum",
        "--shape",
        "2,3,4,5",
        "--dims",
        "tp,cp,pp,dp",
        "--rank-offset",
        "7",
        "--group",
        "dp,tp",
        "--rank",
        "33",
        "--format",
        "json",
    ]);
    assert_eq!(v["key"], "dp-tp");
    assert_eq!(
        v["groups"][0],
        json!([7, 8, 31, 32, 55, 56, 79, 80, 103, 104])
    );
    assert_eq!(v["groups"].as_array().map(Vec::len), Some(12));
    assert_eq!(
        v["my_group"],
        json!([9, 10, 33, 34, 57, 58, 81, 82, 105, 106])
    );
    let v = json(&[
        "enum", "--shape", "2,2,2", "--dims", "a,b,c", "--group", "a,c", "--raw", "--format",
        "json",
    ]);
    assert_eq!(
        v,
        json!({"key": "c-a", "groups": [[0, 4, 1, 5], [2, 6, 3, 7]]})
    );
    let (code, out, _) = run(&[
        "enum", "--shape", "2,2,2", "--dims", "a,b,c", "--group", "a,b",
    ]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "Grid a 2 × b 2 × c 2 (first varies fastest), ranks 0..=7\nKey b-a: 2 groups of 4 ranks (each ascending, sorted by first member)\n  [0, 1, 2, 3]\n  [4, 5, 6, 7]\n"
    );
}

#[test]
fn hierarchical_and_rank_generator() {
    let v = json(&[
        "hierarchical",
        "--ranks",
        "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
        "--sizes",
        "2,2,4",
        "--rank",
        "5",
        "--format",
        "json",
    ]);
    assert_eq!(v["rank_groups"], json!([[4, 5], [5, 7], [1, 5, 9, 13]]));
    assert_eq!(
        v["levels"][2],
        json!([[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]])
    );
    let v = json(&[
        "rank-generator",
        "--order",
        "TP-PP-DP",
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--tokens",
        "dp,pp-tp",
        "--format",
        "json",
    ]);
    assert_eq!(
        v,
        json!({
            "normalized_order": "tp-pp-dp-ep-cp-gtp_remat",
            "ordered_size": [2, 2, 2, 1, 1, 1],
            "world_size": 8,
            "masks": {"dp": [false, false, true, false, false, false], "pp-tp": [true, true, false, false, false, false]},
            "ranks": {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "pp-tp": [[0, 1, 2, 3], [4, 5, 6, 7]]}
        })
    );
    // A token missing from the order: the output is printed, then exit 2 names the token.
    let (code, out, err) = run(&[
        "rank-generator",
        "--order",
        "tp-dp",
        "--tp",
        "2",
        "--dp",
        "2",
        "--tokens",
        "tp,xx",
        "--format",
        "json",
    ]);
    assert_eq!(code, 2);
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["ranks"]["tp"], json!([[0, 1], [2, 3]]));
    assert!(v["ranks"]["xx"]["error"].is_string());
    assert_eq!(err.lines().count(), 1);
    assert!(
        err.starts_with("grid: error: grid rank-generator: token 'xx'"),
        "{err}"
    );
}

/// Huge worlds: one rank's view is arithmetic, whatever the size.
#[test]
fn huge_world_rank_view_text() {
    let (code, out, err) = run(&[
        "layout",
        "--world-size",
        "4611686018427387904",
        "--tp",
        "8",
        "--pp",
        "16",
        "--cp",
        "2",
        "--ep",
        "8",
        "--rank",
        "4611686018427387903",
    ]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("dense coordinates:  tp 7, cp 1, dp 18014398509481983, pp 15"),
        "{out}"
    );
    assert!(out.contains("next rank 288230376151711743"), "{out}");
    let (code, out, _) = run(&[
        "layout",
        "--world-size",
        "4611686018427387904",
        "--tp",
        "8",
        "--pp",
        "16",
        "--cp",
        "2",
        "--ep",
        "8",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("intra_dist_opt                    1  4611686018427387904  [0, 1, 2, …, 4611686018427387903] (4611686018427387904 ranks)"), "{out}");
}

/// The `hcp` contract: without `--hcp` no `hcp` key or row anywhere in `grid layout` output
/// (text or JSON, with or without `--rank`); with `--hcp`, a list of levels.
#[test]
fn hcp_appears_only_with_hcp() {
    let base = ["layout", "--world-size", "16", "--tp", "2", "--pp", "2"];
    for extra in [
        &["--rank", "0", "--format", "json"][..],
        &["--format", "json"],
        &["--rank", "0"],
        &[],
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (code, out, err) = run(&args);
        assert_eq!((code, err.as_str()), (0, ""), "grid {args:?}");
        assert!(!out.contains("hcp"), "grid {args:?} mentions hcp: {out}");
    }
    let v = json(&[
        "layout",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--pp",
        "2",
        "--rank",
        "0",
        "--format",
        "json",
    ]);
    let groups = v["groups"].as_object().expect("groups");
    assert!(!groups.contains_key("hcp"));
    assert_eq!(groups.len(), 20, "every family but hcp: {groups:?}");

    // With --hcp: levels in the JSON of one rank and of the layout, rows in the text.
    let hcp = [
        "layout",
        "--world-size",
        "32",
        "--cp",
        "8",
        "--pp",
        "2",
        "--hcp",
        "2,4",
    ];
    let mut args = hcp.to_vec();
    args.extend(["--rank", "13", "--format", "json"]);
    let v = json(&args);
    assert_eq!(v["groups"]["hcp"], json!([[12, 13], [9, 11, 13, 15]]));
    assert_eq!(v["groups"].as_object().map(|g| g.len()), Some(21));
    let mut args = hcp.to_vec();
    args.extend(["--rank", "13"]);
    let (code, out, _) = run(&args);
    assert_eq!(code, 0);
    assert!(out.contains("\nhcp[0]  "), "{out}");
    assert!(out.contains("\nhcp[1]  "), "{out}");
    let (code, out, _) = run(&hcp);
    assert_eq!(code, 0);
    assert!(out.contains("hierarchical cp [2, 4]"), "{out}");
    assert!(out.contains("\nhcp[1]  "), "{out}");
}

/// Options in any order, `--name=value` and `--name value`, blanks around numbers: one output.
#[test]
fn option_spellings_give_the_same_output() {
    let want = run(&[
        "layout",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--rank",
        "3",
        "--format",
        "json",
    ]);
    assert_eq!(want.0, 0);
    for args in [
        &[
            "layout",
            "--world-size=8",
            "--tp=2",
            "--rank=3",
            "--format=json",
        ][..],
        &[
            "layout",
            "--format",
            "json",
            "--rank",
            "3",
            "--tp",
            "2",
            "--world-size",
            "8",
        ],
        &[
            "layout",
            "--world-size",
            " 8 ",
            "--tp",
            "2",
            "--rank",
            "3",
            "--format",
            "json",
        ],
    ] {
        assert_eq!(run(args), want, "grid {args:?}");
    }
}

/// `grid layout --rank R --format json` writes its JSON by hand (groups in chunks, numbers
/// formatted in place): byte for byte it is serde_json's compact form of the same document,
/// built here from the library's view, for layouts with every optional part and for the
/// million-rank view of the performance target.
#[test]
fn rank_view_json_equals_serde() {
    use grid_core::{Family, LayoutConfig, LayoutPlan};
    use serde_json::{Map, Value};
    // (world, tp, pp, cp, ep, etp, order, dist-opt instances, hcp, rank offset, rank)
    type Case<'a> = (
        usize,
        usize,
        usize,
        usize,
        usize,
        Option<usize>,
        &'a str,
        usize,
        Option<Vec<usize>>,
        usize,
        usize,
    );
    let cases: Vec<Case> = vec![
        (8, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp", 1, None, 0, 5),
        (
            64,
            2,
            2,
            4,
            2,
            Some(1),
            "tp-cp-ep-dp-pp",
            2,
            Some(vec![2, 2]),
            0,
            37,
        ),
        (96, 2, 3, 2, 4, None, "tp-dp-cp-ep-pp", 1, None, 1000, 1077),
        (
            4096,
            4,
            4,
            2,
            8,
            Some(2),
            "tp-cp-ep-dp-pp",
            4,
            None,
            0,
            4095,
        ),
        (
            1 << 20,
            8,
            16,
            2,
            8,
            None,
            "tp-cp-ep-dp-pp",
            1,
            None,
            0,
            654_321,
        ),
    ];
    for (world, tp, pp, cp, ep, etp, order, instances, hcp, offset, rank) in cases {
        let mut cfg = LayoutConfig::new(world);
        (cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.etp) = (tp, pp, cp, ep, etp);
        cfg.order = order.into();
        cfg.dist_opt_instances = instances;
        cfg.hcp_sizes = hcp.clone();
        cfg.rank_offset = offset;
        let plan = LayoutPlan::new(cfg).expect("valid layout");
        let v = plan.rank_view(rank).expect("a rank of the layout");
        let mut doc = Map::new();
        doc.insert("world_size".into(), world.into());
        doc.insert("dp".into(), plan.dp().into());
        doc.insert("expert_tp".into(), plan.expert_tp().into());
        doc.insert("expert_dp".into(), plan.expert_dp().into());
        doc.insert("rank".into(), rank.into());
        let c = v.coords;
        doc.insert(
            "coords".into(),
            json!({"tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp, "ep": c.ep,
                   "expt_tp": c.expt_tp, "expt_dp": c.expt_dp}),
        );
        let mut groups = Map::new();
        for f in Family::ALL {
            if f == Family::Hcp {
                if let Some(levels) = v.hcp() {
                    let levels: Vec<Vec<usize>> = levels.iter().map(|g| g.to_vec()).collect();
                    groups.insert(f.name().into(), json!(levels));
                }
            } else {
                groups.insert(
                    f.name().into(),
                    v.group(f).map_or(Value::Null, |g| json!(g.to_vec())),
                );
            }
        }
        doc.insert("groups".into(), Value::Object(groups));
        doc.insert("pp_next".into(), v.pp_next.into());
        doc.insert("pp_prev".into(), v.pp_prev.into());
        doc.insert("is_first_stage".into(), v.is_first_stage.into());
        doc.insert("is_last_stage".into(), v.is_last_stage.into());
        let want = serde_json::to_string(&Value::Object(doc)).expect("serializable") + "\n";

        let mut args: Vec<String> = [
            "layout",
            "--world-size",
            &world.to_string(),
            "--tp",
            &tp.to_string(),
            "--pp",
            &pp.to_string(),
            "--cp",
            &cp.to_string(),
            "--ep",
            &ep.to_string(),
            "--order",
            order,
            "--dist-opt-instances",
            &instances.to_string(),
            "--rank-offset",
            &offset.to_string(),
            "--rank",
            &rank.to_string(),
            "--format",
            "json",
        ]
        .map(String::from)
        .to_vec();
        if let Some(e) = etp {
            args.extend(["--etp".into(), e.to_string()]);
        }
        if let Some(h) = &hcp {
            let h: Vec<String> = h.iter().map(|x| x.to_string()).collect();
            args.extend(["--hcp".into(), h.join(",")]);
        }
        let mut out = Vec::new();
        grid_cli::run(&args, &mut out).expect("grid layout runs");
        let got = String::from_utf8(out).expect("UTF-8");
        assert!(
            got == want,
            "grid {}: differs from serde_json's form",
            args.join(" ")
        );
    }
}
