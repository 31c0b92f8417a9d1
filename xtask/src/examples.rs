//! The library crates' `examples/` targets, run by `cargo xtask test` exactly as their documentation
//! tells a user to run them: each example's module documentation has one line
//! ``//! Run: `COMMAND` `` and this step runs `COMMAND` from the workspace root (with the test
//! environment, so `mpirun` works as root). The programs crate's examples (demos and benchmarks)
//! are run by `cargo xtask demo` and `cargo xtask bench` instead.

use crate::external::PROGRAMS;
use crate::util::{show, workspace_root, MPI_ENV};
use std::process::Command;
use std::time::Duration;

/// How long one example may run before it is killed and counted as failed.
pub const EXAMPLE_TIMEOUT: Duration = Duration::from_secs(300);

/// One example of a library crate and its documented command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The package (`grid-core`).
    pub package: String,
    /// The example's name (`layout_and_rank_view`).
    pub name: String,
    /// The documented command, or why there is none.
    pub command: Result<String, String>,
}

/// The command of an example's ``//! Run: `COMMAND` `` line, checked to name the example and
/// its package (`-p PACKAGE` and `--example NAME`), so the documentation cannot go stale.
pub fn documented_command(source: &str, package: &str, name: &str) -> Result<String, String> {
    let line = source
        .lines()
        .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
        .find_map(|l| l.strip_prefix("//! Run: `"))
        .ok_or_else(|| {
            "no line ``//! Run: `COMMAND` `` in the module documentation (the one-line command a user runs)"
                .to_string()
        })?;
    let command = line
        .split_once('`')
        .map(|(c, _)| c.trim())
        .filter(|c| !c.is_empty())
        .ok_or_else(|| format!("the Run: line {line:?} does not close its backquote"))?;
    let words: Vec<&str> = command.split_whitespace().collect();
    let names = |flag: &str, value: &str| words.windows(2).any(|w| w[0] == flag && w[1] == value);
    if !names("-p", package) || !names("--example", name) {
        return Err(format!(
            "the documented command {command:?} does not build this example (it needs `-p {package}` and `--example {name}`)"
        ));
    }
    Ok(command.to_string())
}

/// Every `crates/*/examples/*.rs` except the programs crate's, sorted by package and name.
pub fn find_examples() -> Vec<Example> {
    let mut out = Vec::new();
    let crates = workspace_root().join("crates");
    let Ok(dirs) = std::fs::read_dir(&crates) else {
        return out;
    };
    for dir in dirs.flatten() {
        let package = dir.file_name().to_string_lossy().into_owned();
        if package == PROGRAMS {
            continue;
        }
        let Ok(files) = std::fs::read_dir(dir.path().join("examples")) else {
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let command = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))
                .and_then(|s| documented_command(&s, &package, &name));
            out.push(Example {
                package: package.clone(),
                name,
                command,
            });
        }
    }
    out.sort_by(|a, b| (&a.package, &a.name).cmp(&(&b.package, &b.name)));
    out
}

/// Runs `command` with `sh -c` from the workspace root, with the test environment, under
/// coreutils' `timeout` (which puts the command in its own process group and kills that whole
/// group, mpirun and ranks included, after `timeout`). Returns why it failed, if it did.
pub fn run_documented(command: &str, timeout: Duration) -> Result<(), String> {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &format!("{}s", timeout.as_secs().max(1))])
        .args(["sh", "-c", command])
        .current_dir(workspace_root())
        .stdin(std::process::Stdio::null());
    for (k, v) in MPI_ENV {
        cmd.env(k, v);
    }
    eprintln!("$ {command}");
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        // timeout's own codes: 124 when the time ran out (137 when it had to use SIGKILL).
        Ok(s) if matches!(s.code(), Some(124 | 137)) => {
            Err(format!("killed after {} s", timeout.as_secs().max(1)))
        }
        Ok(s) => Err(format!("exited with {s}")),
        Err(e) => Err(format!("cannot start {}: {e}", show(&cmd))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_run_line() {
        let src = "//! Demo.\n//!\n//! Run: `cargo run -p grid-core --example view -- --rank 5`\n//!\n//! More.\n\nfn main() {}\n";
        assert_eq!(
            documented_command(src, "grid-core", "view"),
            Ok("cargo run -p grid-core --example view -- --rank 5".to_string())
        );
    }

    #[test]
    fn rejects_missing_or_stale_lines() {
        let none = documented_command("//! Demo.\nfn main() {}\n", "a", "b");
        assert!(none.unwrap_err().contains("no line"));
        let stale = documented_command("//! Run: `cargo run -p a --example old`\n", "a", "new");
        assert!(stale.unwrap_err().contains("--example new"));
        let open = documented_command("//! Run: `cargo run -p a --example b\n", "a", "b");
        assert!(open.unwrap_err().contains("backquote"));
        // A Run: line after the module documentation does not count.
        let late = documented_command(
            "//! Demo.\nfn main() {}\n//! Run: `x -p a --example b`\n",
            "a",
            "b",
        );
        assert!(late.is_err());
    }

    #[test]
    fn finds_the_workspace_examples() {
        let all = find_examples();
        assert!(all.iter().all(|e| e.package != PROGRAMS));
        for e in &all {
            assert!(
                e.command.is_ok(),
                "{}/{}: {:?}",
                e.package,
                e.name,
                e.command
            );
        }
    }

    #[test]
    fn a_failing_command_fails() {
        assert!(run_documented("exit 3", EXAMPLE_TIMEOUT).is_err());
        assert!(run_documented("true", EXAMPLE_TIMEOUT).is_ok());
        let slow = run_documented("sleep 5", Duration::from_secs(1));
        assert!(slow.unwrap_err().contains("killed"));
    }
}
