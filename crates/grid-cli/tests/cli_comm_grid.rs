//! `grid comm-grid`: queries replayed on one grid, and its invalid input.

mod common;
use common::cli::{run, run_stdin};
use serde_json::{json, Value};

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
