//! The start and end of a rank of a loop under `mpirun`, shared by `mpi-loop` and `nccl-loop`
//! (included with `#[path]`: the library crate builds no backend).

use backend_mpi::MpiRuntime;
use grid_core::{Error, Result};
use grid_programs::smoke::{dump_after_error, install_trace_dir, LoopOptions, Outcome};
use std::io::Write;
use std::process::ExitCode;

/// The options of a loop under `mpirun` from the command line; invalid ones print one line
/// (`program: ...`, with `usage`) on standard error and give status 2, before MPI starts.
pub fn parse_loop_options(
    program: &str,
    usage: &str,
) -> std::result::Result<LoopOptions, ExitCode> {
    LoopOptions::parse(std::env::args().skip(1), usage).map_err(|e| {
        eprintln!("{program}: {e}");
        ExitCode::from(2)
    })
}

/// The start of a rank of a loop under `mpirun` (`mpi-loop`, `nccl-loop`): the recorder of
/// `--trace-dir` first (initialising MPI creates the world communicator, whose world rank then
/// names the dump file), then MPI. When either fails the rank has printed its one line, with
/// the launcher's rank (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`; MPI gives none), and `Err` is the
/// status to exit with.
pub fn start_mpi_rank(
    program: &str,
    options: &LoopOptions,
) -> std::result::Result<MpiRuntime, ExitCode> {
    let started = match &options.trace_dir {
        Some(dir) => install_trace_dir(dir, None),
        None => Ok(()),
    }
    .and_then(|()| MpiRuntime::init().map_err(|e| e.to_string()));
    started.map_err(|e| {
        let rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
            .iter()
            .find_map(|v| std::env::var(v).ok()?.parse().ok())
            .unwrap_or(0);
        let outcome = Outcome {
            rank,
            completed: 0,
            error: Some(e),
        };
        print_line(program, rank, outcome);
        ExitCode::FAILURE
    })
}

/// The end of a rank of a loop under `mpirun`: its one line first (once one rank exits,
/// `mpirun` may end the others at any moment), then, after an error, the operation log's dump
/// (a warning about it on standard error, after `program: rank R: `) and exit status 1 without
/// finalizing MPI, which would wait for the operation that never finished; status 0 after a
/// complete loop.
pub fn end_mpi_rank(program: &str, rank: usize, completed: u64, result: Result<()>) -> ExitCode {
    let outcome = Outcome {
        rank,
        completed,
        error: result.as_ref().err().map(Error::to_string),
    };
    print_line(program, rank, outcome);
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    if let Some(warning) = dump_after_error(&e) {
        eprintln!("{program}: rank {rank}: {warning}");
    }
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(1)
}

/// The longest line a rank prints whole. Open MPI forwards a rank's output in reads that can be
/// shorter than the line, so a longer line can arrive cut, with another rank's line in between
/// (seen with nccl-loop's error naming every directory the loader searched for libcuda: at 4096
/// bytes, and again, on 2026-11-25, a line of about 2.5 KB cut after 2050 bytes, the size of a
/// pseudo-terminal's read). 1024 bytes stays well under both.
const LINE_MAX: usize = 1024;

/// Prints the rank's one line in a single write. An error too long for [`LINE_MAX`] goes
/// whole to standard error (after `program: rank R: `) and shortened into the line, which says
/// so.
fn print_line(program: &str, rank: usize, mut outcome: Outcome) {
    let mut line = outcome.json_line();
    if line.len() > LINE_MAX {
        if let Some(full) = outcome.error.take() {
            eprintln!("{program}: rank {rank}: {full}");
            let mut keep = full.len().min(LINE_MAX);
            loop {
                while !full.is_char_boundary(keep) {
                    keep -= 1;
                }
                outcome.error = Some(format!(
                    "{} ... (cut: {} of {} bytes here, the whole error is on standard error)",
                    &full[..keep],
                    keep,
                    full.len()
                ));
                line = outcome.json_line();
                if line.len() <= LINE_MAX || keep == 0 {
                    break;
                }
                keep = keep.saturating_sub(line.len() - LINE_MAX + 16);
            }
        }
    }
    line.push('\n');
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}
