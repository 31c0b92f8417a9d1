//! `nccl-loop`: the NCCL form of `mpi-loop`, one process per GPU: a loop of f32 sum all-reduces
//! on an NCCL world communicator, each result checked, bootstrapped over MPI (the NCCL unique id
//! travels over `MPI_COMM_WORLD`; each process takes the GPU of its node-local rank).
//!
//! ```text
//! cargo build --release --examples
//! mpirun -np N target/release/examples/nccl-loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER]
//! ```
//!
//! The options are `mpi-loop`'s (`grid_programs::smoke::LoopOptions`): `--timeout-ms` is the
//! NCCL world's time limit, enforced by the backend's watchdog, which aborts the communicator
//! when an operation passes it. The point of the program is the killed rank of the GPU suite
//! (crates/backend-nccl/README.md):
//!
//! ```text
//! mpirun -np 8 --enable-recovery --mca orte_abort_on_non_zero_status 0 \
//!     target/release/examples/nccl-loop --iters 200 --timeout-ms 5000 --fault 3:kill@50
//! ```
//!
//! rank 3 sends itself SIGKILL at iteration 50; every other rank must print one line with the
//! 50 completed iterations and a `Timeout`, `PeerFailed` or `Aborted` error, within the 5 s limit
//! plus one second. Each rank prints exactly one line when it ends,
//! `{"rank":R,"completed":K,"error":null}` or with `"error":"<message>"`, and exits 0 only if it
//! completed every iteration (1 otherwise, including no usable GPU, whose reason is the error;
//! 2 with one line on standard error for invalid options). A rank that ended by an error exits
//! without finalizing MPI.

use backend_nccl::{NcclFactory, NcclOptions};
use grid_core::{Communicator, TimeLimit};
use grid_programs::smoke::{run_loop, Waits};
use mpi_rank::{end_mpi_rank, parse_loop_options, start_mpi_rank};

#[path = "common/mpi_rank.rs"]
mod mpi_rank;
use std::process::ExitCode;

const USAGE: &str = "usage: mpirun -np N nccl-loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER (a testing aid; KIND: kill, skip, count, dtype, op, root, long-send, abort)]";

fn main() -> ExitCode {
    let options = match parse_loop_options("nccl-loop", USAGE) {
        Ok(o) => o,
        Err(status) => return status,
    };
    let rt = match start_mpi_rank("nccl-loop", &options) {
        Ok(rt) => rt,
        Err(status) => return status,
    };
    let boot = rt.world();
    let rank = boot.rank();
    let nccl_options = NcclOptions {
        timeout: options.timeout(),
        ..NcclOptions::default()
    };
    let (_factory, world) = match NcclFactory::init(boot, nccl_options) {
        Ok(made) => made,
        Err(e) => return end_mpi_rank("nccl-loop", rank, 0, Err(e)),
    };
    world.set_time_limit(TimeLimit::After(options.timeout()));
    let mut completed = 0u64;
    let result = run_loop(&world, &options, Waits::Nonblocking, &mut completed);
    end_mpi_rank("nccl-loop", rank, completed, result)
}
