//! `cargo xtask demo`: the layout of a realistic configuration, through the `grid` command.

use crate::external::{dispatch, DEMOS};
use crate::util::{cargo, run, target_dir, workspace_root};
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
        None => layout_demo(),
        Some("-h" | "--help") => {
            println!(
                "usage: cargo xtask demo                    the layout of a realistic configuration
       cargo xtask demo mpi|gloo|multimodule [--np N] [-- ARGS]
                                            the backend demos (binaries of the backend crates)"
            );
            0
        }
        Some(name) => dispatch(DEMOS, name, &args[1..]),
    }
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
