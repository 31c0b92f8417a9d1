//! Shared by the `grid` command tests (`cli*.rs`): running the built binary (with or without
//! stdin) and the in-process JSON run.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

/// A run of the built `grid` binary: (exit status, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
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
pub fn run_stdin(args: &[&str], stdin: &str) -> (i32, String, String) {
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
pub fn json(args: &[&str]) -> Value {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let mut out = Vec::new();
    match grid_cli::run(&args, &mut out) {
        Ok(()) => serde_json::from_slice(&out).expect("valid JSON"),
        Err(e) => panic!("grid {}: {e:?}", args.join(" ")),
    }
}
