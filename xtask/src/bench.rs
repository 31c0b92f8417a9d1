//! `cargo xtask bench`: benchmarks.

use crate::external::{dispatch, BENCHES};
use crate::util::{cargo, run};

const HELP: &str = "usage: cargo xtask bench layout [--quick]   topology benchmarks: one rank's view, every family,
                                            memory, the grid process, Megatron's per-token rows
       cargo xtask bench gloo [--quick]     Gloo (trait and direct) and MPI in one run, side by side
       cargo xtask bench peers [--quick] [--ranks 2,4] [--json PATH]
                                            this project against mpi4py and torch.distributed
                                            (Gloo), interleaved in one run
       cargo xtask bench mpi|bridge|nccl [--np N] [-- ARGS]
                                            backend benchmarks (examples of crates/grid-programs)";

pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("layout") => {
            let mut pass = Vec::new();
            for a in &args[1..] {
                match a.as_str() {
                    "--quick" => pass.push(a.clone()),
                    other => {
                        eprintln!("xtask bench layout: unknown argument '{other}'\n\n{HELP}");
                        return 2;
                    }
                }
            }
            // A release-built benchmark binary (harness = false), not a timed test.
            let ok = run(cargo()
                .args([
                    "bench", "--quiet", "-p", "grid-cli", "--bench", "layout", "--",
                ])
                .args(&pass));
            i32::from(!ok)
        }
        // Gloo's benchmark, then MPI's, then both side by side (issue: same run).
        Some("gloo") => crate::compare::main(&args[1..]),
        // This project against the libraries users would otherwise pick (issue #15).
        Some("peers") => crate::peers::main(&args[1..]),
        Some("-h" | "--help") => {
            println!("{HELP}");
            0
        }
        None => {
            eprintln!("{HELP}");
            2
        }
        Some(name) => dispatch(BENCHES, name, &args[1..]),
    }
}
