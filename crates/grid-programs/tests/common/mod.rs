//! What the tests of the smoke programs share: building a program, fresh directories, a
//! `redis-server` of their own.

#![allow(dead_code)] // each test target uses a part

use backend_gloo::testing::RedisServer;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// `target/<profile>/`, the parent of this test's own `deps/` directory.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// Runs `cargo build --quiet ARGS` in this test's profile (a no-op when the test run already
/// built the target; a run of only one test target does not, and would find a stale program).
fn cargo_build(args: &[&str]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "--quiet"]).args(args);
    if profile_dir().file_name().is_some_and(|p| p == "release") {
        c.arg("--release");
    }
    let status = c.status().expect("cargo runs");
    assert!(status.success(), "cargo build {args:?} failed");
}

/// `target/<profile>/examples/<name>`, brought up to date first.
pub fn example(name: &str) -> PathBuf {
    cargo_build(&["-p", "grid-programs", "--example", name]);
    let path = profile_dir().join("examples").join(name);
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// `target/<profile>/grid`, the `grid` command, brought up to date first.
pub fn grid_command() -> PathBuf {
    cargo_build(&["-p", "grid-cli", "--bin", "grid"]);
    let path = profile_dir().join("grid");
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// A fresh, empty directory under the system's temporary directory.
pub fn fresh_dir(what: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let d = std::env::temp_dir().join(format!("grid-{what}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("create a temporary directory");
    d
}

/// A `redis-server` of the test's own (killed when dropped).
pub fn start_redis() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("{e}"))
}
