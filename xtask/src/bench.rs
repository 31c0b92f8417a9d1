//! `cargo xtask bench`: benchmarks.

use crate::external::{dispatch, BENCHES};

pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("layout") => {
            eprintln!("xtask: bench layout is not implemented yet");
            1
        }
        Some("-h" | "--help") | None => {
            println!("usage: cargo xtask bench layout|mpi|gloo|bridge [--np N] [-- ARGS]");
            i32::from(args.is_empty()) * 2
        }
        Some(name) => dispatch(BENCHES, name, &args[1..]),
    }
}
