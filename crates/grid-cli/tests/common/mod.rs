//! Shared by the integration tests: loading `testdata/vectors` and running the built `grid` binary
//! (the `cli` submodule holds the helpers of the `grid` command tests, `cli*.rs`).
#![allow(dead_code)]

use serde_json::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub mod cli;

/// The reference vectors: `<workspace root>/testdata/vectors` (see `testdata/README.md`), or the
/// folder named by `GRID_VECTORS_DIR`. Missing vectors fail the test; they never skip it.
pub fn vectors_dir() -> PathBuf {
    let dir = std::env::var_os("GRID_VECTORS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vectors")
        });
    assert!(
        dir.join("INDEX.json").is_file(),
        "reference vectors not found at {} (no INDEX.json): they live in the repository's \
         testdata/vectors; restore that folder, or point GRID_VECTORS_DIR at a copy",
        dir.display()
    );
    dir
}

/// Every vector of `op`, as (name, document), in INDEX.json order. Fails without any.
pub fn load(op: &str) -> Vec<(String, Value)> {
    let dir = vectors_dir();
    let read = |p: PathBuf| -> Value {
        let text = std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", p.display()))
    };
    let index = read(dir.join("INDEX.json"));
    let mut out = Vec::new();
    for e in index.as_array().expect("INDEX.json is a list") {
        if e["op"] == op {
            let name = e["name"].as_str().expect("vector name").to_string();
            let v = read(dir.join(format!("{name}.json")));
            out.push((name, v));
        }
    }
    assert!(
        !out.is_empty(),
        "no vectors of op {op} in {}",
        dir.display()
    );
    out
}

/// Output of one `grid` run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub cmd: String,
}

impl Run {
    /// The JSON output of a successful run.
    pub fn json(&self) -> Result<Value, String> {
        if self.code != 0 {
            return Err(format!(
                "`{}` exited {}: {}",
                self.cmd,
                self.code,
                self.stderr.trim()
            ));
        }
        if !self.stderr.is_empty() {
            return Err(format!(
                "`{}` succeeded but wrote to stderr: {}",
                self.cmd,
                self.stderr.trim()
            ));
        }
        serde_json::from_str(&self.stdout)
            .map_err(|e| format!("`{}` printed invalid JSON: {e}", self.cmd))
    }

    /// Invalid input: status 2, one line `grid: error: ...` on stderr, no panic.
    pub fn invalid(&self) -> Result<(), String> {
        let lines: Vec<&str> = self.stderr.lines().collect();
        if self.code != 2 {
            return Err(format!(
                "`{}`: expected exit status 2, got {} (stderr: {})",
                self.cmd,
                self.code,
                self.stderr.trim()
            ));
        }
        if lines.len() != 1 || !lines[0].starts_with("grid: error: ") || lines[0].len() < 20 {
            return Err(format!(
                "`{}`: expected one line 'grid: error: ...' on stderr, got {:?}",
                self.cmd, self.stderr
            ));
        }
        Ok(())
    }
}

/// Runs the built `grid` binary.
pub fn grid(args: &[String]) -> Run {
    grid_with_stdin(args, None)
}

/// Runs the built `grid` binary with `stdin` piped in (or no stdin at all).
pub fn grid_with_stdin(args: &[String], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_grid"));
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
    let mut child = cmd.spawn().expect("the grid binary runs");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        // The command may exit before reading (invalid arguments): a closed pipe is fine.
        if let Err(e) = pipe.write_all(text.as_bytes()) {
            assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
        }
    }
    let out = child.wait_with_output().expect("the grid binary finishes");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        cmd: format!(
            "grid {}{}",
            args.join(" "),
            if stdin.is_some() { " < (stdin)" } else { "" }
        ),
    }
}

/// `v[k]` as a usize.
pub fn u(v: &Value, k: &str) -> Option<usize> {
    v.get(k).and_then(Value::as_u64).map(|x| x as usize)
}

/// Runs `check` on every vector of `op`; `check` returns `Ok(None)` for a pass and
/// `Ok(Some(reason))` for a vector the command cannot express (printed, counted).
pub fn run_all(
    op: &str,
    check: impl Fn(&str, &Value, &Value) -> Result<Option<String>, String>,
) -> usize {
    let mut failures = Vec::new();
    let (mut passed, mut skipped) = (0, 0);
    for (name, v) in load(op) {
        match check(&name, &v["input"], &v["expected"]) {
            Ok(None) => passed += 1,
            Ok(Some(reason)) => {
                skipped += 1;
                eprintln!("skipped {name}: {reason}");
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    eprintln!("{op}: {passed} vectors passed through the grid command, {skipped} skipped");
    assert!(
        failures.is_empty(),
        "{} {op} vectors failed through the grid command:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(passed > 0, "no {op} vector passed");
    passed
}
