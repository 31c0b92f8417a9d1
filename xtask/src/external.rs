//! Extension points: demos and benchmarks that live in other crates as binaries.
//!
//! Each entry names the crate that provides the binary and how it is launched. When a crate
//! lands, its owner only needs to provide the binary named here (or adjust its entry):
//! `cargo xtask demo mpi` then builds it in release mode and runs it.

use crate::util::{cargo, run, target_dir, workspace_root, MPI_ENV};
use std::process::Command;

/// How an external binary is started.
#[derive(Clone, Copy)]
pub enum Launch {
    /// `mpirun -np N <binary> ARGS` with the MPI environment of the tests.
    Mpirun { np: usize },
    /// `<binary> ARGS` (the binary starts its own ranks, e.g. as threads or child processes).
    Direct,
}

/// A demo or benchmark provided by another crate.
pub struct External {
    /// What `cargo xtask` calls it (`demo mpi`, `bench gloo`, ...).
    pub what: &'static str,
    /// The package that provides the binary.
    pub package: &'static str,
    /// The binary's name (`[[bin]] name` or `src/bin/<name>.rs`).
    pub bin: &'static str,
    /// Cargo features the binary needs.
    pub features: &'static [&'static str],
    /// How it is started.
    pub launch: Launch,
}

// ---- EXTENSION POINT: demos --------------------------------------------------------------------
/// `cargo xtask demo mpi|gloo|multimodule`.
pub const DEMOS: &[(&str, External)] = &[
    // crates/backend-mpi/src/bin/mpi-demo.rs: builds the demo layout's process groups over MPI
    // and checks a collective on each.
    (
        "mpi",
        External {
            what: "demo mpi",
            package: "backend-mpi",
            bin: "mpi-demo",
            features: &[],
            launch: Launch::Mpirun { np: 8 },
        },
    ),
    // crates/backend-gloo/src/bin/gloo-demo.rs: the same without MPI (the fallback), 8 ranks as
    // threads of one process.
    (
        "gloo",
        External {
            what: "demo gloo",
            package: "backend-gloo",
            bin: "gloo-demo",
            features: &[],
            launch: Launch::Direct,
        },
    ),
    // crates/multimodule/src/bin/multimodule-demo.rs: two encoders -> language model ->
    // generator, with bridge communicators, 8 Gloo ranks as threads.
    (
        "multimodule",
        External {
            what: "demo multimodule",
            package: "multimodule",
            bin: "multimodule-demo",
            features: &["gloo"],
            launch: Launch::Direct,
        },
    ),
];

// ---- EXTENSION POINT: benchmarks ---------------------------------------------------------------
/// `cargo xtask bench mpi|gloo|bridge|nccl` (`bench layout` is built in, see bench.rs). Each
/// binary starts its own ranks (re-launching itself under mpirun where needed) and prints a
/// Markdown report.
pub const BENCHES: &[(&str, External)] = &[
    (
        "mpi",
        External {
            what: "bench mpi",
            package: "backend-mpi",
            bin: "mpi-bench",
            features: &[],
            launch: Launch::Direct,
        },
    ),
    (
        "gloo",
        External {
            what: "bench gloo",
            package: "backend-gloo",
            bin: "gloo-bench",
            features: &[],
            launch: Launch::Direct,
        },
    ),
    (
        "bridge",
        External {
            what: "bench bridge",
            package: "multimodule",
            bin: "bridge-bench",
            features: &["gloo"],
            launch: Launch::Direct,
        },
    ),
    // Prints `SKIPPED: <reason>` without a usable GPU.
    (
        "nccl",
        External {
            what: "bench nccl",
            package: "backend-nccl",
            bin: "nccl-bench",
            features: &[],
            launch: Launch::Direct,
        },
    ),
];

/// Whether the package's directory declares the binary (`src/bin/<bin>.rs`,
/// `src/bin/<bin>/main.rs`, or a `name = "<bin>"` line in its manifest).
fn provides(package: &str, bin: &str) -> bool {
    let dir = workspace_root().join("crates").join(package);
    if dir.join("src/bin").join(format!("{bin}.rs")).is_file()
        || dir.join("src/bin").join(bin).join("main.rs").is_file()
    {
        return true;
    }
    std::fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|m| {
        m.lines()
            .any(|l| l.replace(' ', "") == format!("name=\"{bin}\""))
    })
}

/// Builds and runs an external binary. Exit code 1 when it does not exist yet.
pub fn run_external(e: &External, np_override: Option<usize>, extra: &[String]) -> i32 {
    if !provides(e.package, e.bin) {
        eprintln!(
            "xtask: `cargo xtask {}` is not available yet: crates/{} does not provide the binary `{}`",
            e.what, e.package, e.bin
        );
        return 1;
    }
    let mut build = cargo();
    build.args(["build", "--release", "-p", e.package, "--bin", e.bin]);
    if !e.features.is_empty() {
        build.args(["--features", &e.features.join(",")]);
    }
    if !run(&mut build) {
        eprintln!("xtask: building {} failed", e.bin);
        return 1;
    }
    let exe = target_dir().join("release").join(e.bin);
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
                    e.what, e.bin
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

/// Builds an external binary that starts its own ranks and runs it with `extra`, returning its
/// standard output (also on failure, after reporting it), or `None` when it could not run.
pub fn run_external_capture(e: &External, extra: &[String]) -> Option<String> {
    if !provides(e.package, e.bin) {
        eprintln!(
            "xtask: crates/{} does not provide the binary `{}`",
            e.package, e.bin
        );
        return None;
    }
    let mut build = cargo();
    build.args(["build", "--release", "-p", e.package, "--bin", e.bin]);
    if !e.features.is_empty() {
        build.args(["--features", &e.features.join(",")]);
    }
    if !run(&mut build) {
        eprintln!("xtask: building {} failed", e.bin);
        return None;
    }
    let exe = target_dir().join("release").join(e.bin);
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
            eprintln!("xtask: {} failed with {}", e.bin, o.status);
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
    let Some((_, e)) = table.iter().find(|(n, _)| *n == name) else {
        let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
        eprintln!(
            "xtask: unknown target '{name}': valid are {}",
            names.join(", ")
        );
        return 2;
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
