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

use backend_mpi::MpiRuntime;
use backend_nccl::{NcclFactory, NcclOptions};
use grid_core::{Communicator, Error, TimeLimit};
use grid_programs::smoke::{
    dump_after_error, install_trace_dir, launcher_rank, run_loop, LoopOptions, Outcome, Waits,
};
use std::io::Write;
use std::process::ExitCode;

const USAGE: &str = "usage: mpirun -np N nccl-loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER (a testing aid; KIND: kill, skip, count, dtype, op, root, long-send, abort)]";

fn parse_args() -> Result<LoopOptions, String> {
    LoopOptions::parse(std::env::args().skip(1), USAGE)
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("nccl-loop: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match &options.trace_dir {
        Some(dir) => install_trace_dir(dir, None),
        None => Ok(()),
    }
    .and_then(|()| MpiRuntime::init().map_err(|e| e.to_string()));
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => return report_and_exit(launcher_rank(), 0, Err(e)),
    };
    let boot = rt.world();
    let rank = boot.rank();
    let nccl_options = NcclOptions {
        timeout: options.timeout(),
        ..NcclOptions::default()
    };
    let (_factory, world) = match NcclFactory::init(boot, nccl_options) {
        Ok(made) => made,
        Err(e) => return report_and_exit(rank, 0, Err(e.to_string())),
    };
    world.set_time_limit(TimeLimit::After(options.timeout()));
    let mut completed = 0u64;
    let result = run_loop(&world, &options, Waits::Nonblocking, &mut completed);
    if let Err(e) = &result {
        if let Some(warning) = dump_after_error(e) {
            eprintln!("nccl-loop: rank {rank}: {warning}");
        }
    }
    report_and_exit(rank, completed, result.map_err(|e: Error| e.to_string()))
}

/// Prints the rank's one line and ends the process: status 0 after a complete loop; otherwise
/// status 1 without finalizing MPI (which would wait for the operation that never finished).
fn report_and_exit(rank: usize, completed: u64, result: Result<(), String>) -> ExitCode {
    let ok = result.is_ok();
    let outcome = Outcome {
        rank,
        completed,
        error: result.err(),
    };
    // The line first: once one rank exits, mpirun may end the others at any moment.
    println!("{}", outcome.json_line());
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    if ok {
        ExitCode::SUCCESS
    } else {
        std::process::exit(1)
    }
}
