//! `cargo xtask demo`: the layout of a realistic configuration.

use crate::external::{dispatch, DEMOS};

pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        None => {
            eprintln!("xtask: the layout demo is not implemented yet");
            1
        }
        Some("-h" | "--help") => {
            println!("usage: cargo xtask demo [mpi|gloo|multimodule] [--np N] [-- ARGS]");
            0
        }
        Some(name) => dispatch(DEMOS, name, &args[1..]),
    }
}
