//! `cargo xtask`: the project's own automation.
//!
//! * `cargo xtask test [--gpu]`: system packages, `cargo fmt --check`, clippy, every test.
//! * `cargo xtask demo [layout|mpi|gloo|multimodule|moe]`: the main job (layout, communicators,
//!   multi-module pipeline), or one of its steps.
//! * `cargo xtask bench layout|mpi|gloo|peers|bridge|nccl`: benchmarks.
//! * `cargo xtask hosts up|down|run`: test hosts as network namespaces, and the multi-host
//!   scenarios run on them (also a step of `cargo xtask test`, as root).
//!
//! The alias lives in `.cargo/config.toml` (`xtask = "run --quiet --package xtask --"`).

mod bench;
mod compare;
mod demo;
mod examples;
mod external;
mod hosts;
mod packages;
mod peers;
mod test;
mod util;

const HELP: &str = "usage: cargo xtask <command> [args]

commands:
  test [--gpu]                     check system packages, fmt, clippy, run every test
  demo                             the main job: layout, communicators on real ranks, pipeline
  demo layout                      only the layout of a realistic configuration (grid command)
  demo mpi|gloo|multimodule|moe    the backend demos (examples of crates/grid-programs)
  bench layout [--quick]           topology benchmarks (library and grid command)
  bench peers [--quick]            this project against mpi4py and torch.distributed (Gloo)
  bench mpi|gloo|bridge|nccl [-- ARGS]  backend benchmarks (examples of crates/grid-programs)
  hosts up|down|run [SCENARIO...]  test hosts as network namespaces (root): MPI, Gloo, the
                                   pipeline and a cut host across them (docs/multi-host.md)";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("test") => test::main(&args[1..]),
        Some("demo") => demo::main(&args[1..]),
        Some("bench") => bench::main(&args[1..]),
        Some("hosts") => hosts::main(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{HELP}");
            0
        }
        Some(other) => {
            eprintln!("xtask: unknown command '{other}'\n\n{HELP}");
            2
        }
        None => {
            eprintln!("{HELP}");
            2
        }
    };
    std::process::exit(code);
}
