//! `mpi-loop`: a cluster smoke test over MPI, used the way `nccl-tests` is: a loop of f32 sum
//! all-reduces on the world communicator, each result checked.
//!
//! ```text
//! cargo build --release --examples
//! mpirun -np N target/release/examples/mpi-loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER]
//! ```
//!
//! `--bytes` is the size of one all-reduce (a multiple of 4; default 1048576), `--iters` the
//! number of all-reduces (default 100) or `--seconds` how long to loop (the ranks vote after every
//! all-reduce, with a one-element all-reduce, so that all stop together), `--timeout-ms` the time
//! limit of each operation (default 30000; the world communicator's time limit): every
//! operation is started nonblocking and waited for, so that one that passes its limit returns a
//! timeout the rank reports (its buffers are left to MPI) instead of ending the job. With `--trace-dir D`, every rank's operation log is written to
//! `D/rank-<rank>.json` when an operation fails or times out (reason `timeout`), and at the end
//! of a rank that ended by an error; `grid trace D` reads them.
//!
//! `--fault RANK:KIND@ITER` is a testing aid: rank `RANK` misbehaves at iteration `ITER` (needs
//! `--iters`): `kill` (SIGKILL to itself), `skip` (leaves one all-reduce out), `count`, `dtype`,
//! `op`, `root` (disagrees with the others on that field of the collective), `long-send` (sends
//! more than its partner posted to receive), `abort` (stalls, and the others' watchdog threads
//! call `abort()` on their stuck all-reduce). The table in `grid_programs::smoke::FaultKind`
//! says exactly what each does; docs/when-a-job-fails.md shows what the other ranks then see.
//! By default `mpirun` ends the whole job as soon as one rank dies or exits with an error; to
//! let every rank report, run with `--enable-recovery --mca orte_abort_on_non_zero_status 0`.
//!
//! Each rank prints exactly one line when it ends, `{"rank":R,"completed":K,"error":null}` or
//! with `"error":"<message>"`, and exits 0 only if it completed every iteration without error
//! (1 otherwise; 2 with one line on standard error for invalid options). A rank that ended by an
//! error exits without `MPI_Finalize` (which would wait for the operation that never finished);
//! `mpirun` then ends the job.

use grid_core::{Communicator, TimeLimit};
use grid_programs::smoke::{run_loop, Waits};
use mpi_rank::{end_mpi_rank, parse_loop_options, start_mpi_rank};

#[path = "common/mpi_rank.rs"]
mod mpi_rank;
use std::process::ExitCode;

const USAGE: &str = "usage: mpirun -np N mpi-loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER (a testing aid; KIND: kill, skip, count, dtype, op, root, long-send, abort)]";

fn main() -> ExitCode {
    let options = match parse_loop_options("mpi-loop", USAGE) {
        Ok(o) => o,
        Err(status) => return status,
    };
    let rt = match start_mpi_rank("mpi-loop", &options) {
        Ok(rt) => rt,
        Err(status) => return status,
    };
    let world = rt.world();
    world.set_time_limit(TimeLimit::After(options.timeout()));
    let mut completed = 0u64;
    let result = run_loop(world, &options, Waits::Nonblocking, &mut completed);
    end_mpi_rank("mpi-loop", world.rank(), completed, result)
}
