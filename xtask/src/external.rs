//! The demos and benchmarks that are programs: the `examples/` targets of `crates/grid-programs`.
//!
//! Each entry names the example and how it is launched: `cargo xtask demo mpi` checks the Debian
//! packages, builds the example in release mode (`target/release/examples/<name>`) and runs it.

use crate::packages::ensure_packages;
use crate::util::{cargo, run, target_dir, workspace_root, MPI_ENV};
use std::path::PathBuf;
use std::process::Command;

/// The crate whose examples are the demos and benchmarks.
pub const PROGRAMS: &str = "grid-programs";

/// How an external program is started.
#[derive(Clone, Copy)]
pub enum Launch {
    /// `mpirun -np N <program> ARGS` with the MPI environment of the tests.
    Mpirun { np: usize },
    /// `<program> ARGS` (the program starts its own ranks, e.g. as threads or child processes).
    Direct,
}

/// A demo or benchmark program (an example of [`PROGRAMS`]).
pub struct External {
    /// What `cargo xtask` calls it (`demo mpi`, `bench gloo`, ...).
    pub what: &'static str,
    /// The example's name (`crates/grid-programs/examples/<name>.rs`).
    pub example: &'static str,
    /// How it is started.
    pub launch: Launch,
}

// ---- demos -------------------------------------------------------------------------------------
/// `cargo xtask demo mpi|gloo|multimodule|moe`.
pub const DEMOS: &[(&str, External)] = &[
    // mpi-demo: builds the demo layout's process groups over MPI and checks a collective on each.
    (
        "mpi",
        External {
            what: "demo mpi",
            example: "mpi-demo",
            launch: Launch::Mpirun { np: 8 },
        },
    ),
    // gloo-demo: the same without MPI (the fallback), 8 ranks as threads.
    (
        "gloo",
        External {
            what: "demo gloo",
            example: "gloo-demo",
            launch: Launch::Direct,
        },
    ),
    // multimodule-demo: two encoders -> language model -> generator, with bridge communicators,
    // 8 Gloo ranks as threads.
    (
        "multimodule",
        External {
            what: "demo multimodule",
            example: "multimodule-demo",
            launch: Launch::Direct,
        },
    ),
    // moe-dispatch: MoE token dispatch with uneven all-to-all over the expert-parallel groups,
    // 8 ranks as threads (in-process backend; `-- --backend gloo|mpi` for the others).
    (
        "moe",
        External {
            what: "demo moe",
            example: "moe-dispatch",
            launch: Launch::Direct,
        },
    ),
];

// ---- benchmarks --------------------------------------------------------------------------------
/// `cargo xtask bench mpi|gloo|bridge|nccl` (`bench layout` is built in, see bench.rs). Each
/// program starts its own ranks (re-launching itself under mpirun where needed) and prints a
/// Markdown report.
pub const BENCHES: &[(&str, External)] = &[
    (
        "mpi",
        External {
            what: "bench mpi",
            example: "mpi-bench",
            launch: Launch::Direct,
        },
    ),
    (
        "gloo",
        External {
            what: "bench gloo",
            example: "gloo-bench",
            launch: Launch::Direct,
        },
    ),
    (
        "bridge",
        External {
            what: "bench bridge",
            example: "bridge-bench",
            launch: Launch::Direct,
        },
    ),
    // Prints `SKIPPED: <reason>` without a usable GPU.
    (
        "nccl",
        External {
            what: "bench nccl",
            example: "nccl-bench",
            launch: Launch::Direct,
        },
    ),
];

/// The table entry named `name`, or a message listing the valid names.
pub fn find<'a>(table: &'a [(&str, External)], name: &str) -> Result<&'a External, String> {
    table
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, e)| e)
        .ok_or_else(|| {
            let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
            format!("unknown target '{name}': valid are {}", names.join(", "))
        })
}

/// Checks the packages, builds the example in release mode and returns its path, relative to the
/// workspace root when it lies inside it (the commands run there, and the echo reads better).
pub fn build_example(e: &External) -> Option<PathBuf> {
    let source = workspace_root()
        .join("crates")
        .join(PROGRAMS)
        .join("examples")
        .join(format!("{}.rs", e.example));
    if !source.is_file() {
        eprintln!(
            "xtask: `cargo xtask {}` needs {}, which does not exist",
            e.what,
            source.display()
        );
        return None;
    }
    if ensure_packages(e.what).is_err() {
        return None;
    }
    if !run(cargo().args(["build", "--release", "-p", PROGRAMS, "--example", e.example])) {
        eprintln!("xtask: building {} failed", e.example);
        return None;
    }
    let exe = target_dir().join("release/examples").join(e.example);
    Some(
        exe.strip_prefix(workspace_root())
            .map(PathBuf::from)
            .unwrap_or(exe),
    )
}

/// Builds and runs an external program. Exit code 1 when it cannot be built or fails.
pub fn run_external(e: &External, np_override: Option<usize>, extra: &[String]) -> i32 {
    let Some(exe) = build_example(e) else {
        return 1;
    };
    let mut cmd = match e.launch {
        Launch::Mpirun { np } => {
            let mut c = Command::new("mpirun");
            c.args([
                "-np",
                &np_override.unwrap_or(np).to_string(),
                "--timeout",
                "600",
            ])
            .arg(&exe);
            c
        }
        Launch::Direct => {
            if np_override.is_some() {
                eprintln!(
                    "xtask: --np does not apply to `cargo xtask {}`: {} starts its own ranks",
                    e.what, e.example
                );
                return 2;
            }
            Command::new(&exe)
        }
    };
    cmd.args(extra).current_dir(workspace_root());
    for (k, v) in MPI_ENV {
        cmd.env(k, v);
    }
    if run(&mut cmd) {
        0
    } else {
        1
    }
}

/// Builds an external program that starts its own ranks and runs it with `extra`, returning its
/// standard output (also on failure, after reporting it), or `None` when it could not run.
pub fn run_external_capture(e: &External, extra: &[String]) -> Option<String> {
    let exe = build_example(e)?;
    let mut cmd = Command::new(&exe);
    cmd.args(extra).current_dir(workspace_root());
    for (k, v) in MPI_ENV {
        cmd.env(k, v);
    }
    eprintln!("$ {} {}", exe.display(), extra.join(" "));
    match cmd.stderr(std::process::Stdio::inherit()).output() {
        Ok(o) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => {
            print!("{}", String::from_utf8_lossy(&o.stdout));
            eprintln!("xtask: {} failed with {}", e.example, o.status);
            None
        }
        Err(err) => {
            eprintln!("xtask: cannot run {}: {err}", exe.display());
            None
        }
    }
}

/// Looks `name` up in `table` and runs it; parses `--np N` and passes `-- ARGS` through.
pub fn dispatch(table: &[(&str, External)], name: &str, args: &[String]) -> i32 {
    let e = match find(table, name) {
        Ok(e) => e,
        Err(msg) => {
            eprintln!("xtask: {msg}");
            return 2;
        }
    };
    let mut np = None;
    let mut extra = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--np" => match it.next().and_then(|v| v.parse::<usize>().ok()) {
                Some(n) if n > 0 => np = Some(n),
                _ => {
                    eprintln!("xtask: --np needs a positive integer");
                    return 2;
                }
            },
            "--" => {
                extra.extend(it.by_ref().cloned());
            }
            other => {
                eprintln!("xtask: unknown argument '{other}' (pass program arguments after `--`)");
                return 2;
            }
        }
    }
    run_external(e, np, &extra)
}
