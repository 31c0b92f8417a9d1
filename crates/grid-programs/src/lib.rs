//! The code the workspace's demos and benchmarks share, written once.
//!
//! The programs themselves are this crate's `examples/` targets (`cargo build --release -p
//! grid-programs --examples` puts them in `target/release/examples/`); `cargo xtask demo` and
//! `cargo xtask bench` build and run them. No library crate of the workspace exports program
//! code: timing statistics, nccl-tests' bus-bandwidth conventions, Markdown tables and the demo
//! layout's per-family check live here.
//!
//! * [`stats`]: the median every benchmark reports, the slowest rank per sample, the load average;
//! * [`collectives`]: the benchmarked collectives, their buffer shapes and bus-bandwidth factors;
//! * [`table`]: byte and duration labels, Markdown table headers;
//! * [`demo`]: the 8-rank demo layout and an all-reduce checked on every family of it;
//! * [`pipeline_demo`]: the demo's multi-module pipeline spec and its tagged tensors;
//! * [`moe`]: the `moe-dispatch` example's routing, token values and checks;
//! * [`smoke`]: the options, loop and JSON line of the cluster smoke tests `gloo-loop` and
//!   `mpi-loop`.

#![warn(missing_docs)]

pub mod collectives;
pub mod demo;
pub mod moe;
pub mod pipeline_demo;
pub mod smoke;
pub mod stats;
pub mod table;
