//! The `grid` command's behaviour: exact text and JSON output, the exit status and one-line
//! message of invalid input, and the consistency of per-rank views with full enumerations.

use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Stdio};

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_grid"))
        .args(args)
        .output()
        .expect("the grid binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A run with `stdin` piped in.
fn run_stdin(args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_grid"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the grid binary runs");
    let mut pipe = child.stdin.take().expect("stdin is piped");
    // The command may exit before reading (invalid arguments): a closed pipe is fine.
    if let Err(e) = pipe.write_all(stdin.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    drop(pipe);
    let out = child.wait_with_output().expect("the grid binary finishes");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// In-process (fast) run of a command that must succeed with JSON output.
fn json(args: &[&str]) -> Value {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let mut out = Vec::new();
    match grid_cli::run(&args, &mut out) {
        Ok(()) => serde_json::from_slice(&out).expect("valid JSON"),
        Err(e) => panic!("grid {}: {e:?}", args.join(" ")),
    }
}

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

#[test]
fn invalid_input_exits_2_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "missing command"),
        (&["frob"], "unknown command 'frob'"),
        (&["layout"], "--world-size is required"),
        (
            &["layout", "--world-size", "0"],
            "--world-size must be a positive integer, got 0",
        ),
        (
            &["layout", "--world-size", "eight"],
            "invalid value 'eight' for --world-size",
        ),
        (
            &["layout", "--world-size", "8", "--tp", "-2"],
            "invalid value '-2' for --tp",
        ),
        (
            &["layout", "--world-size", "8", "--tp", "3"],
            "not divisible by tp·pp·cp = 3·1·1 = 3",
        ),
        (
            &["layout", "--world-size", "8", "--order", "tp-tp-dp-pp"],
            "token 'tp' appears more than once",
        ),
        (
            &["layout", "--world-size", "8", "--order", "tp-xx-dp-pp"],
            "unknown token 'xx'",
        ),
        (
            &[
                "layout",
                "--world-size",
                "16",
                "--cp",
                "2",
                "--order",
                "tp-dp-pp",
            ],
            "the size of cp is 2",
        ),
        (
            &[
                "layout",
                "--world-size",
                "8",
                "--pp",
                "2",
                "--ep",
                "2",
                "--order",
                "tp-pp-ep-dp",
            ],
            "does not end in pp",
        ),
        (
            &["layout", "--world-size", "8", "--rank", "8"],
            "rank 8 is outside the layout",
        ),
        (
            &[
                "layout",
                "--world-size",
                "8",
                "--rank-offset",
                "8",
                "--rank",
                "7",
            ],
            "rank 7 is outside the layout",
        ),
        (
            &["layout", "--world-size", "16", "--cp", "4", "--hcp", "2,4"],
            "multiply to 8",
        ),
        (
            &["layout", "--world-size", "8", "--hcp", "2,0"],
            "every entry of --hcp must be a positive integer",
        ),
        (
            &[
                "layout",
                "--world-size",
                "8",
                "--tp",
                "2",
                "--dist-opt-instances",
                "3",
            ],
            "not divisible by the number of distributed-optimizer instances 3",
        ),
        (
            &["layout", "--world-size", "8", "--vpp", "2"],
            "needs a pipeline-parallel size greater than 1",
        ),
        (
            &["layout", "--world-size", "8", "--dp", "2"],
            "--dp 2 does not match the layout",
        ),
        (
            &["layout", "--world-size", "8", "--format", "yaml"],
            "unknown format 'yaml'",
        ),
        (
            &["layout", "--world-size", "8", "--tp", "2", "--tp", "2"],
            "--tp given more than once",
        ),
        (
            &["layout", "--world-size", "8", "--bogus", "1"],
            "unknown option '--bogus'",
        ),
        (
            &["layout", "--world-size", "8", "extra"],
            "unexpected argument 'extra'",
        ),
        (
            &["layout", "--world-size", "8", "--tp"],
            "--tp needs a value",
        ),
        (
            &["layout", "--world-size", "99999999999999999999999"],
            "too large",
        ),
        (
            &[
                "layout",
                "--world-size",
                "18446744073709551615",
                "--tp",
                "18446744073709551615",
                "--pp",
                "2",
            ],
            "overflow",
        ),
        (
            &["layout", "--world-size", "33554432", "--format", "json"],
            "too large to print as JSON",
        ),
        (
            &[
                "layout",
                "--world-size",
                "18446744073709551615",
                "--rank",
                "3",
                "--format",
                "json",
            ],
            "too many to print as JSON",
        ),
        (
            &["enum", "--shape", "2,2", "--dims", "tp", "--group", "tp"],
            "has 2 entries but dim_names",
        ),
        (
            &["enum", "--shape", "2,2", "--dims", "a,b"],
            "--group is required",
        ),
        (
            &["enum", "--shape", "2,2", "--dims", "a,b", "--group", "c"],
            "'c' is not a dimension",
        ),
        (
            &["enum", "--shape", "2,2", "--dims", "a,a", "--group", "a"],
            "appears more than once",
        ),
        (
            &["enum", "--shape", "2,2", "--dims", "a,b", "--group", "a,a"],
            "appears more than once",
        ),
        (
            &[
                "enum",
                "--shape",
                "2,4",
                "--dims",
                "a,b",
                "--group",
                "a",
                "--rank-offset",
                "1",
                "--world-size",
                "8",
            ],
            "over sized",
        ),
        (
            &[
                "enum",
                "--shape",
                "2,4",
                "--dims",
                "a,b",
                "--group",
                "a",
                "--rank-offset",
                "-1",
            ],
            "invalid value '-1' for --rank-offset",
        ),
        (
            &["enum", "--shape", "2,,4", "--dims", "a,b", "--group", "a"],
            "--shape needs a value",
        ),
        (
            &["enum", "--shape", "2,4", "--dims", "a,", "--group", "a"],
            "without empty entries",
        ),
        (
            &[
                "enum",
                "--shape",
                "2,4",
                "--dims",
                "a,b",
                "--group",
                "a",
                "--world-size",
                "8",
                "--rank",
                "8",
            ],
            "rank 8 is outside the world",
        ),
        (
            &[
                "enum",
                "--shape",
                "4294967296,4294967296",
                "--dims",
                "a,b",
                "--group",
                "a",
            ],
            "overflow",
        ),
        (
            &["enum", "--shape", "33554432", "--dims", "a", "--group", "a"],
            "too large to enumerate",
        ),
        (
            &["hierarchical", "--ranks", "0,1,2", "--sizes", "2"],
            "multiply to 2, but they must multiply to 3",
        ),
        (
            &["hierarchical", "--ranks", "0,1,1,2", "--sizes", "2,2"],
            "lists rank 1 more than once",
        ),
        (
            &[
                "hierarchical",
                "--ranks",
                "0,1,2,3",
                "--sizes",
                "2,2",
                "--rank",
                "7",
            ],
            "rank 7 is not a member",
        ),
        (&["hierarchical", "--sizes", "2,2"], "--ranks is required"),
        (&["rank-generator", "--tp", "2"], "--order is required"),
        (
            &[
                "rank-generator",
                "--order",
                "tp-dp",
                "--tp",
                "2",
                "--pp",
                "2",
            ],
            "the size of pp is 2",
        ),
        (
            &[
                "rank-generator",
                "--order",
                "tp-cp-ep-dp-pp",
                "--ep",
                "2",
                "--cp",
                "2",
            ],
            "ep (2) and cp (2) are both > 1",
        ),
        (
            &["rank-generator", "--order", "tp-dp", "--tokens", "tp,tp"],
            "--tokens lists 'tp' more than once",
        ),
        (&["help", "nope"], "unknown command 'nope'"),
    ];
    for (args, needle) in cases {
        let (code, out, err) = run(args);
        assert_eq!(code, 2, "grid {args:?}: status {code}, stderr {err}");
        assert_eq!(err.lines().count(), 1, "grid {args:?}: stderr {err:?}");
        assert!(err.starts_with("grid: error: "), "grid {args:?}: {err}");
        assert!(
            err.contains(needle),
            "grid {args:?}: '{err}' lacks '{needle}'"
        );
        assert!(!err.contains("panicked"), "grid {args:?}: {err}");
        assert_eq!(out, "", "grid {args:?}: printed {out}");
    }
}

#[test]
fn help_and_version() {
    for args in [
        &["--help"][..],
        &["help"],
        &["help", "layout"],
        &["layout", "--help"],
        &["enum", "-h"],
        &["hierarchical", "--help"],
        &["rank-generator", "--help"],
        &["pipeline", "--help"],
        &["help", "pipeline"],
        &["comm-grid", "--help"],
        &["help", "comm-grid"],
    ] {
        let (code, out, err) = run(args);
        assert_eq!((code, err.as_str()), (0, ""), "grid {args:?}");
        assert!(out.contains("usage"), "grid {args:?}: {out}");
    }
    let (code, out, _) = run(&["--version"]);
    assert_eq!(
        (code, out.trim()),
        (0, concat!("grid ", env!("CARGO_PKG_VERSION")))
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

/// Megatron's HyperCommGrid docstring grid (a, b, c of size 2) seen from rank 5: stateful
/// queries (create twice, get before create, views) replayed in order on one grid.
const COMM_GRID_QUERIES: &str = r#"[
  {"fn": "gen_rank_enum", "dims": ["a", "b"]},
  {"fn": "order_dims", "dims": ["c", "a", "b"]},
  {"fn": "order_dims", "dims": "b"},
  {"fn": "create_pg", "dims": ["a", "b"]},
  {"fn": "get_pg", "dims": ["b", "a"]},
  {"fn": "create_pg", "dims": ["b", "a"]},
  {"fn": "get_pg", "dims": "c"},
  {"fn": "get_rank_enum", "dims": "zz"},
  {"fn": "register_view", "name": "v", "shape": [4, 2], "dim_names": ["x", "c"], "shared_dims": ["c"]},
  {"fn": "create_pg", "dims": "x", "view": "v"},
  {"fn": "create_pg", "dims": "c", "view": "v"},
  {"fn": "get_pg", "dims": "c"},
  {"fn": "get_rank_enum", "dims": "x", "view": "w"},
  {"fn": "is_current_rank_in_grid"}
]"#;

const COMM_GRID_TEXT: &str = r#"Grid a 2 × b 2 × c 2 (first varies fastest), ranks 0..=7 of a world of 8, current rank 5
  #0 gen_rank_enum [a, b]: 2 groups of 4: [0, 2, 1, 3] [4, 6, 5, 7]
  #1 order_dims [c, a, b]: ordered [c, b, a], key c-b-a
  #2 order_dims b: ordered [b], key b
  #3 create_pg [a, b]: created under key b-a, 2 groups of 4: [0, 1, 2, 3] [4, 5, 6, 7]; rank 5's group [4, 5, 6, 7]
  #4 get_pg [b, a]: rank 5's group [4, 5, 6, 7]
  #5 create_pg [b, a]: error (KeyError): process group for b-a has already been created
  #6 get_pg c: error (KeyError): process group for c hasn't been created: call create_pg first
  #7 get_rank_enum zz: error (ValueError): 'zz' is not a dimension of view 'base' with dim_names ["a", "b", "c"]
  #8 register_view v: registered
  #9 create_pg x in view v: created under key x of view v, 2 groups of 4: [0, 1, 2, 3] [4, 5, 6, 7]; rank 5's group [4, 5, 6, 7]
  #10 create_pg c in view v: created under key c, 4 groups of 2: [0, 4] [1, 5] [2, 6] [3, 7]; rank 5's group [1, 5]
  #11 get_pg c: rank 5's group [1, 5]
  #12 get_rank_enum x in view w: error (KeyError): view 'w' is not registered; registered views: ["base", "v"]
  #13 is_current_rank_in_grid: true
"#;

#[test]
fn comm_grid_replays_queries_on_one_grid() {
    let dir = std::env::temp_dir().join(format!("grid-cli-comm-grid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("queries.json");
    std::fs::write(&file, COMM_GRID_QUERIES).expect("write queries");
    let file = file.to_string_lossy().to_string();
    let base = [
        "comm-grid",
        "--shape",
        "2,2,2",
        "--dims",
        "a,b,c",
        "--rank",
        "5",
    ];

    // Text, from a file and from stdin; an object with a "queries" list works too.
    let mut args = base.to_vec();
    args.extend(["--queries", &file]);
    let (code, out, err) = run(&args);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out, COMM_GRID_TEXT);
    let mut args = base.to_vec();
    args.extend(["--queries", "-"]);
    let wrapped = format!("{{\"queries\": {COMM_GRID_QUERIES}}}");
    assert_eq!(
        run_stdin(&args, &wrapped),
        (0, COMM_GRID_TEXT.into(), "".into())
    );

    // JSON: the reference vectors' results format, one entry per query.
    args.extend(["--format", "json"]);
    let (code, out, err) = run_stdin(&args, COMM_GRID_QUERIES);
    assert_eq!((code, err.as_str()), (0, ""));
    let v: Value = serde_json::from_str(&out).expect("JSON");
    let err = |t: &str| json!({"type": t});
    let strip = |r: &Value| {
        let mut r = r.clone();
        if let Some(e) = r.get_mut("error") {
            assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
            e.as_object_mut().expect("error object").remove("message");
        }
        r
    };
    let got: Vec<Value> = v.as_array().expect("a list").iter().map(strip).collect();
    assert_eq!(
        got,
        vec![
            json!({"fn": "gen_rank_enum", "ok": [[0, 2, 1, 3], [4, 6, 5, 7]]}),
            json!({"fn": "order_dims", "ok": {"ordered_dims": ["c", "b", "a"], "key": "c-b-a"}}),
            json!({"fn": "order_dims", "ok": {"ordered_dims": ["b"], "key": "b"}}),
            json!({"fn": "create_pg", "ok": {"key": "b-a", "enumeration": [[0, 1, 2, 3], [4, 5, 6, 7]], "my_group": [4, 5, 6, 7]}}),
            json!({"fn": "get_pg", "ok": [4, 5, 6, 7]}),
            json!({"fn": "create_pg", "error": err("KeyError")}),
            json!({"fn": "get_pg", "error": err("KeyError")}),
            json!({"fn": "get_rank_enum", "error": err("ValueError")}),
            json!({"fn": "register_view", "ok": null}),
            json!({"fn": "create_pg", "ok": {"key": ["v", ["x"]], "enumeration": [[0, 1, 2, 3], [4, 5, 6, 7]], "my_group": [4, 5, 6, 7]}}),
            json!({"fn": "create_pg", "ok": {"key": "c", "enumeration": [[0, 4], [1, 5], [2, 6], [3, 7]], "my_group": [1, 5]}}),
            json!({"fn": "get_pg", "ok": [1, 5]}),
            json!({"fn": "get_rank_enum", "error": err("KeyError")}),
            json!({"fn": "is_current_rank_in_grid", "ok": true}),
        ]
    );

    // Outside the grid: no group of its own, and the default world is offset + grid size.
    let (code, out, _) = run_stdin(
        &[
            "comm-grid",
            "--shape",
            "2",
            "--dims",
            "tp",
            "--rank-offset",
            "4",
            "--rank",
            "1",
            "--queries",
            "-",
            "--format",
            "json",
        ],
        r#"[{"fn": "create_pg", "dims": "tp"}, {"fn": "is_current_rank_in_grid"}]"#,
    );
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&out).expect("JSON"),
        json!([
            {"fn": "create_pg", "ok": {"key": "tp", "enumeration": [[4, 5]], "my_group": null}},
            {"fn": "is_current_rank_in_grid", "ok": false}
        ])
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn comm_grid_invalid_input_exits_2_with_one_line() {
    let grid = [
        "comm-grid",
        "--shape",
        "2,4",
        "--dims",
        "tp,dp",
        "--queries",
        "-",
    ];
    let ok = r#"[{"fn": "is_current_rank_in_grid"}]"#;
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["comm-grid", "--dims", "tp", "--queries", "-"],
            ok,
            "--shape is required",
        ),
        (
            &["comm-grid", "--shape", "2", "--queries", "-"],
            ok,
            "--dims is required",
        ),
        (
            &["comm-grid", "--shape", "2", "--dims", "tp"],
            ok,
            "--queries is required",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "2,2",
                "--dims",
                "tp",
                "--queries",
                "-",
            ],
            ok,
            "give one name per dimension",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "2",
                "--dims",
                "tp",
                "--rank-offset",
                "-1",
                "--queries",
                "-",
            ],
            ok,
            "expected a non-negative integer",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "2,4",
                "--dims",
                "tp,dp",
                "--rank-offset",
                "1",
                "--world-size",
                "8",
                "--queries",
                "-",
            ],
            ok,
            "over sized",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "2,4",
                "--dims",
                "tp,dp",
                "--rank",
                "8",
                "--queries",
                "-",
            ],
            ok,
            "rank 8 is outside the world of 8 ranks",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "2",
                "--dims",
                "tp",
                "--queries",
                "/nonexistent/q.json",
            ],
            ok,
            "cannot read the queries file",
        ),
        (&grid, "[", "stdin is not valid JSON"),
        (&grid, "5", "must hold a list of queries"),
        (&grid, r#"{"q": []}"#, "an object with a \"queries\" list"),
        (&grid, "[7]", "query 0 must be an object"),
        (&grid, r#"[{"dims": "tp"}]"#, "query 0 has no \"fn\""),
        (&grid, r#"[{"fn": "frob"}]"#, "unknown fn 'frob'"),
        (&grid, r#"[{"fn": "create_pg"}]"#, "needs \"dims\""),
        (
            &grid,
            r#"[{"fn": "create_pg", "dims": 3}]"#,
            "\"dims\" must be a dimension name or a list of names",
        ),
        (
            &grid,
            r#"[{"fn": "create_pg", "dims": ["tp", 1]}]"#,
            "\"dims\" must be a list of names",
        ),
        (
            &grid,
            r#"[{"fn": "get_pg", "dims": "tp", "view": 1}]"#,
            "\"view\" must be a view name",
        ),
        (
            &grid,
            r#"[{"fn": "order_dims", "dims": "tp", "view": "v"}]"#,
            "unknown field 'view' (valid: fn, dims)",
        ),
        (
            &grid,
            r#"[{"fn": "register_view", "shape": [8], "dim_names": ["x"]}]"#,
            "needs \"name\"",
        ),
        (
            &grid,
            r#"[{"fn": "register_view", "name": "v", "shape": [-8], "dim_names": ["x"]}]"#,
            "\"shape\" must be a list of non-negative integers",
        ),
        (
            &grid,
            r#"[{"fn": "register_view", "name": "v", "shape": [8], "dim_names": "x"}]"#,
            "\"dim_names\" must be a list of names",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "8192,4096",
                "--dims",
                "a,b",
                "--queries",
                "-",
            ],
            r#"[{"fn": "create_pg", "dims": "a"}]"#,
            "too large to enumerate",
        ),
        (
            &[
                "comm-grid",
                "--shape",
                "4096,4096",
                "--dims",
                "a,b",
                "--queries",
                "-",
            ],
            r#"[{"fn": "create_pg", "dims": "a"}, {"fn": "get_rank_enum", "dims": "a"}, {"fn": "get_rank_enum", "dims": "b"}, {"fn": "gen_rank_enum", "dims": ["b"]}, {"fn": "gen_rank_enum", "dims": ["a"]}]"#,
            "would print more than",
        ),
    ];
    for (args, stdin, needle) in cases {
        let (code, out, err) = run_stdin(args, stdin);
        assert_eq!(
            code, 2,
            "grid {args:?} < {stdin}: status {code}, stderr {err}"
        );
        assert_eq!(err.lines().count(), 1, "grid {args:?}: stderr {err:?}");
        assert!(err.starts_with("grid: error: "), "grid {args:?}: {err}");
        assert!(
            err.contains(needle),
            "grid {args:?} < {stdin}: '{err}' lacks '{needle}'"
        );
        assert_eq!(out, "", "grid {args:?}: printed {out}");
    }
    // A huge grid is fine for queries that enumerate nothing.
    let (code, out, err) = run_stdin(
        &[
            "comm-grid",
            "--shape",
            "65536,65536,65536",
            "--dims",
            "a,b,c",
            "--rank",
            "7",
            "--queries",
            "-",
            "--format",
            "json",
        ],
        r#"[{"fn": "order_dims", "dims": ["a", "c"]}, {"fn": "is_current_rank_in_grid"}, {"fn": "get_pg", "dims": "a"}]"#,
    );
    assert_eq!((code, err.as_str()), (0, ""));
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        v[0]["ok"],
        json!({"ordered_dims": ["c", "a"], "key": "c-a"})
    );
    assert_eq!(v[1]["ok"], json!(true));
    assert_eq!(v[2]["error"]["type"], json!("KeyError"));
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

/// Every kind of argument error clap can report becomes one line naming the command, the
/// option or value, and what is valid; exit status 2, nothing on stdout.
#[test]
fn argument_errors_exit_2_with_one_line() {
    let layout_options = "valid: --world-size, --tp, --pp, --cp, --ep, --etp, --order, \
                          --dist-opt-instances, --hcp, --rank-offset, --vpp, --dp, --rank, --format";
    let cases: &[(&[&str], &str)] = &[
        (
            &[],
            "grid: error: missing command: expected layout, enum, hierarchical, rank-generator, \
             pipeline, comm-grid, trace or completions (see grid --help)",
        ),
        (&["--frob"], "grid: error: unknown command '--frob': expected layout"),
        (&["help", "nope"], "grid: error: help: unknown command 'nope'"),
        (
            &["layout"],
            "grid: error: grid layout: --world-size is required (number of ranks the layout covers)",
        ),
        (
            &["layout", "--world-size", "8", "--tp", "-0"],
            "grid: error: grid layout: invalid value '-0' for --tp: expected a non-negative integer",
        ),
        (
            &["layout", "--world-size", "8", "--pp", "+2"],
            "grid: error: grid layout: invalid value '+2' for --pp: expected an integer",
        ),
        (
            &["layout", "--world-size", "8", "--cp", "1.5"],
            "grid: error: grid layout: invalid value '1.5' for --cp: expected an integer",
        ),
        (
            &["layout", "--world-size", ""],
            "grid: error: grid layout: --world-size needs a value, got an empty string",
        ),
        (
            &["layout", "--world-size", "8", "--rank", "18446744073709551616"],
            "grid: error: grid layout: value '18446744073709551616' for --rank is too large (at most 18446744073709551615)",
        ),
        (
            &["layout", "--world-size", "8", "--tp", "2", "--tp=4"],
            "grid: error: grid layout: --tp given more than once",
        ),
        (
            &["layout", "--world-size", "8", "--format"],
            "grid: error: grid layout: --format needs a value (text or json)",
        ),
        (
            &["layout", "--world-size", "8", "--format", "JSON"],
            "grid: error: grid layout: unknown format 'JSON': valid formats are text and json",
        ),
        (
            &["layout", "--world-size", "8", "--bogus=1"],
            "grid: error: grid layout: unknown option '--bogus' (valid: --world-size",
        ),
        (
            &["layout", "--world-size", "8", "-t", "2"],
            "grid: error: grid layout: unexpected argument '-t' (options start with --;",
        ),
        (&["layout", "--world-size", "8", "--"], layout_options),
        (&["layout", "--world-size", "8", "--", "--tp", "2"], "unexpected argument '--'"),
        (
            &["layout", "--world-size", "8", "--tp", "--pp"],
            "grid: error: grid layout: invalid value '--pp' for --tp: expected a non-negative integer",
        ),
        (
            &["layout", "--world-size", "8", "--version"],
            "grid: error: grid layout: unknown option '--version'",
        ),
        (
            &["layout", "--world-size", "16", "--cp", "4", "--hcp", "2,,4"],
            "grid: error: grid layout: --hcp needs a value, got an empty string",
        ),
        (
            &["layout", "--world-size", "16", "--cp", "4", "--hcp", ""],
            "grid: error: grid layout: --hcp needs a comma-separated list of integers, got an empty string",
        ),
        (
            &["enum"],
            "grid: error: grid enum: --shape, --dims and --group are required",
        ),
        (
            &["enum", "--shape", "2,4", "--dims", "a,b", "--group", "a", "--raw", "--raw"],
            "grid: error: grid enum: --raw given more than once",
        ),
        (
            &["enum", "--shape", "2,4", "--dims", "a,b", "--group", "a", "--raw=1"],
            "grid: error: grid enum: --raw takes no value, got '1'",
        ),
        (
            &["enum", "--shape", "2,0", "--dims", "a,b", "--group", "a"],
            "grid: error: grid enum: every entry of --shape must be a positive integer, got 2,0",
        ),
        (
            &["rank-generator", "--order", "tp-dp", "--tokens", "tp,"],
            "grid: error: grid rank-generator: --tokens needs a comma-separated list of names without empty entries, got 'tp,'",
        ),
        (
            &["hierarchical", "--ranks", "0,-1", "--sizes", "2"],
            "grid: error: grid hierarchical: invalid value '-1' for --ranks: expected a non-negative integer",
        ),
        (&["pipeline"], "grid: error: grid pipeline: SPEC is required"),
        (
            &["pipeline", "a.json", "--bogus"],
            "grid: error: grid pipeline: unknown option '--bogus' (valid: --format)",
        ),
        (
            &["comm-grid", "--shape", "2,2,2", "--dims", "a,b,c"],
            "grid: error: grid comm-grid: --queries is required",
        ),
        (
            &["completions"],
            "grid: error: grid completions: SHELL is required (the shell: bash, zsh or fish)",
        ),
        (
            &["completions", "tcsh"],
            "grid: error: grid completions: unknown shell 'tcsh': valid shells are bash, zsh and fish",
        ),
        (
            &["completions", "--", "bash"],
            "grid: error: grid completions: unexpected argument '--' (it takes no options)",
        ),
        (
            &["completions", "bash", "zsh"],
            "grid: error: grid completions: unexpected argument 'zsh'",
        ),
    ];
    for (args, needle) in cases {
        let (code, out, err) = run(args);
        assert_eq!(code, 2, "grid {args:?}: status {code}, stderr {err}");
        assert_eq!(err.lines().count(), 1, "grid {args:?}: stderr {err:?}");
        assert!(err.starts_with("grid: error: "), "grid {args:?}: {err}");
        assert!(
            err.contains(needle),
            "grid {args:?}: '{err}' lacks '{needle}'"
        );
        assert_eq!(out, "", "grid {args:?}: printed {out}");
    }
}

/// `grid --help` names every command; each command's help names each of its options.
#[test]
fn help_lists_commands_and_options() {
    let (code, out, err) = run(&["--help"]);
    assert_eq!((code, err.as_str()), (0, ""));
    for c in [
        "layout",
        "enum",
        "hierarchical",
        "rank-generator",
        "pipeline",
        "comm-grid",
        "trace",
        "completions",
    ] {
        assert!(
            out.contains(&format!("\n  {c} ")),
            "grid --help lacks {c}: {out}"
        );
        let (code, help, err) = run(&[c, "--help"]);
        assert_eq!((code, err.as_str()), (0, ""), "grid {c} --help");
        assert!(
            help.starts_with(&format!(
                "{}\n\nusage: grid {c} ",
                help.lines().next().unwrap_or_default()
            )),
            "{help}"
        );
        assert_eq!(run(&["help", c]), (0, help.clone(), String::new()));
        assert_eq!(run(&[c, "-h"]), (0, help, String::new()));
    }
    let (_, help, _) = run(&["layout", "--help"]);
    for o in [
        "--world-size <W>",
        "--tp <N>",
        "--pp <N>",
        "--cp <N>",
        "--ep <N>",
        "--etp <N>",
        "--order <ORDER>",
        "--dist-opt-instances <N>",
        "--hcp <A,B,...>",
        "--rank-offset <O>",
        "--vpp <N>",
        "--dp <N>",
        "--rank <R>",
        "--format <FORMAT>",
    ] {
        assert!(help.contains(o), "grid layout --help lacks {o}: {help}");
    }
    // The library entry point prints the same help.
    let mut buf = Vec::new();
    grid_cli::run(&["--help".to_string()], &mut buf).expect("help succeeds");
    assert_eq!(String::from_utf8_lossy(&buf), out);
}

/// `grid completions SHELL` prints a script for that shell; the bash one completes.
#[test]
fn completions_for_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "complete -F _grid"),
        ("zsh", "#compdef grid"),
        ("fish", "complete -c grid"),
    ] {
        let (code, out, err) = run(&["completions", shell]);
        assert_eq!((code, err.as_str()), (0, ""), "grid completions {shell}");
        assert!(out.contains(marker), "{shell}: no '{marker}' in {out}");
        for c in ["layout", "rank-generator", "comm-grid", "completions"] {
            assert!(out.contains(c), "{shell} script lacks {c}");
        }
    }
    // Run the bash script: completing `grid lay`, `grid layout --format ` and `grid completions `.
    let (_, script, _) = run(&["completions", "bash"]);
    let probe = r#"
        eval "$SCRIPT"
        complete_words() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _grid grid "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"; echo "${COMPREPLY[*]}"; }
        complete_words grid lay
        complete_words grid layout --format ''
        complete_words grid completions ''
    "#;
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", probe])
        .env("SCRIPT", &script)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "layout\ntext json\n-h --help bash zsh fish\n"
    );
}
