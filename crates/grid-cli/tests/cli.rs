//! The `grid` command as a whole: the exit status and one-line message of invalid input and bad
//! arguments for every subcommand, help, version and shell completions. Each subcommand's own
//! output is checked in `cli_layout.rs`, `cli_pipeline.rs` and `cli_comm_grid.rs`.

mod common;
use common::cli::run;
use std::process::Command;

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
             pipeline, comm-grid, trace, init-plan or completions (see grid --help)",
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
            "grid: error: grid pipeline: unknown option '--bogus' (valid: --format, --svg)",
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
        "init-plan",
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
