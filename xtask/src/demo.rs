//! `cargo xtask demo`: the main job. The layout of a realistic configuration through the `grid`
//! command, then its communicators on real ranks (MPI when it is installed, else Gloo with ranks
//! as threads), then a multi-module pipeline running forward and backward.

use crate::external::{dispatch, find, run_external, DEMOS};
use crate::packages::ensure_packages;
use crate::util::{cargo, on_path, run, target_dir, workspace_root};
use std::process::Command;

/// The demo's configuration: 64 GPUs, tensor 2 × context 2 × pipeline 2 (so data parallel 8),
/// a mixture-of-experts layer with 4-way expert parallelism and expert tensor parallel 1, and a
/// distributed optimizer sharded over 2 instances.
const LAYOUT: &[&str] = &[
    "layout",
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
];

/// The rank whose view the demo prints.
const RANK: &str = "37";

pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        None => full_demo(),
        Some("layout") => layout_demo(),
        Some("-h" | "--help") => {
            println!(
                "usage: cargo xtask demo                    the whole demo: layout, communicators, multi-module pipeline
       cargo xtask demo layout             only the layout of a realistic configuration
       cargo xtask demo mpi|gloo|multimodule|moe [--np N] [-- ARGS]
                                            one backend demo (examples of crates/grid-programs)"
            );
            0
        }
        Some(name) => dispatch(DEMOS, name, &args[1..]),
    }
}

fn banner(title: &str) {
    println!("==== {title} ====");
    println!();
}

/// Layout, then communicators on real ranks, then the multi-module pipeline.
fn full_demo() -> i32 {
    // Steps 2 and 3 need the backends' system packages: check (as root, install) them before
    // anything is built, so a missing package stops the demo at once with the command to run.
    if let Err(code) = ensure_packages("demo") {
        return code;
    }
    let (Ok(mpi), Ok(gloo), Ok(multimodule)) = (
        find(DEMOS, "mpi"),
        find(DEMOS, "gloo"),
        find(DEMOS, "multimodule"),
    ) else {
        eprintln!("xtask: the demo table lacks mpi, gloo or multimodule");
        return 1;
    };
    banner("1/3 the layout (pure topology, the grid command)");
    let code = layout_demo();
    if code != 0 {
        return code;
    }
    println!();
    let backend = match on_path("mpirun") {
        true => {
            banner("2/3 every communicator of an 8-rank layout over MPI (Open MPI's mpirun is on PATH; 8 processes)");
            mpi
        }
        false => {
            banner(
                "2/3 every communicator of an 8-rank layout over Gloo \
                 (MPI is not installed: no mpirun on PATH; 8 ranks as threads of one process)",
            );
            gloo
        }
    };
    let code = run_external(backend, None, &[]);
    if code != 0 {
        return code;
    }
    println!();
    banner("3/3 a multi-module pipeline: two encoders -> language model -> generator (8 Gloo ranks as threads)");
    run_external(multimodule, None, &[])
}

fn layout_demo() -> i32 {
    if !run(cargo().args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "grid-cli",
        "--bin",
        "grid",
    ])) {
        eprintln!("xtask: building the grid command failed");
        return 1;
    }
    let grid = target_dir().join("release/grid");
    println!("A 64-GPU job: tensor parallel 2, context parallel 2, pipeline parallel 2 (so data parallel 8),");
    println!(
        "experts spread 4 ways (expert tensor parallel 1), distributed optimizer in 2 instances."
    );
    println!("Every process group Megatron-Core's initialize_model_parallel would create, family by family:");
    println!();
    let show = |extra: &[&str]| -> bool {
        let shown: Vec<&str> = LAYOUT.iter().chain(extra).copied().collect();
        println!("$ grid {}", shown.join(" "));
        let ok = Command::new(&grid)
            .args(&shown)
            .current_dir(workspace_root())
            .status()
            .is_ok_and(|s| s.success());
        println!();
        ok
    };
    if !show(&[]) {
        return 1;
    }
    println!("One rank's view (computed arithmetically, without enumerating the world):");
    println!();
    if !show(&["--rank", RANK]) {
        return 1;
    }
    println!("Add --format json for machines; `grid --help` lists the other commands.");
    let shown = grid
        .strip_prefix(workspace_root())
        .map_or_else(|_| grid.display().to_string(), |p| p.display().to_string());
    println!("The command is {shown} (built by cargo build --release).");
    0
}
