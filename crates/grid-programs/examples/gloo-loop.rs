//! `gloo-loop`: a cluster smoke test over Gloo, one process per rank, used the way
//! `nccl-tests` is: a loop of f32 sum all-reduces on the world communicator, each result checked.
//!
//! ```text
//! cargo build --release --examples
//! target/release/examples/gloo-loop --rank R --world-size N --store file:DIR|redis://HOST:PORT/PREFIX \
//!     [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER]
//! ```
//!
//! Start one process per rank `0..N`, all with the same `--world-size` and `--store`; across
//! hosts, give each rank its host's address in `GRID_GLOO_HOSTNAME` (the address its Gloo device
//! listens on and the others connect to; default 127.0.0.1, this host only):
//! * `file:DIR`: a fresh, empty directory every rank can reach (a shared file system across
//!   hosts);
//! * `redis://HOST:PORT/PREFIX`: a Redis server; `PREFIX` names the job (its keys), so use a new
//!   one per run.
//!
//! `--bytes` is the size of one all-reduce (a multiple of 4; default 1048576), `--iters` the
//! number of all-reduces (default 100) or `--seconds` how long to loop (the ranks vote after every
//! all-reduce, with a one-element all-reduce, so that all stop together), `--timeout-ms` Gloo's
//! time limit on every wait (default 30000). With `--trace-dir D`, every rank's operation log is
//! written to `D/rank-<rank>.json` when an operation fails or times out, and at the end of a
//! rank that ended by an error; `grid trace D` reads them.
//!
//! `--fault RANK:KIND@ITER` is a testing aid: give every rank the same one, and rank `RANK`
//! misbehaves at iteration `ITER` (needs `--iters`): `kill` (SIGKILL to itself), `skip` (leaves
//! one all-reduce out), `count`, `dtype`, `op`, `root` (disagrees with the others on that
//! field of the collective), `long-send` (sends more than its partner posted to receive),
//! `abort` (stalls, and the others' watchdog threads call `abort()` on their stuck all-reduce).
//! The table in `grid_programs::smoke::FaultKind` says exactly what each does;
//! docs/when-a-job-fails.md shows what the other ranks then see.
//!
//! Each rank prints exactly one line when it ends, `{"rank":R,"completed":K,"error":null}` or
//! with `"error":"<message>"`, and exits 0 only if it completed every iteration without error
//! (1 otherwise; 2 with one line on standard error for invalid options).

use backend_gloo::{env, GlooConfig, GlooFactory, Rendezvous};
use grid_programs::smoke::{
    dump_after_error, install_trace_dir, run_loop, LoopOptions, Outcome, Waits,
};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: gloo-loop --rank R --world-size N --store file:DIR|redis://HOST:PORT/PREFIX [--bytes B] [--iters K | --seconds S] [--timeout-ms T] [--trace-dir D] [--fault RANK:KIND@ITER (a testing aid; KIND: kill, skip, count, dtype, op, root, long-send, abort)]";

/// The command line.
struct Args {
    rank: usize,
    world_size: usize,
    store: Rendezvous,
    job: String,
    options: LoopOptions,
}

/// `file:DIR` or `redis://HOST:PORT/PREFIX`, as the rendezvous and the job id.
fn parse_store(s: &str) -> Result<(Rendezvous, String), String> {
    let bad = || {
        format!("--store {s:?}: expected file:DIR or redis://HOST:PORT/PREFIX (a job name after the port)")
    };
    if let Some(rest) = s.strip_prefix("redis://") {
        let (addr, prefix) = rest.split_once('/').ok_or_else(bad)?;
        if prefix.is_empty() || prefix.contains('/') {
            return Err(bad());
        }
        let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        if host.is_empty() {
            return Err(bad());
        }
        let store = Rendezvous::Redis {
            host: host.to_string(),
            port,
        };
        return Ok((store, prefix.to_string()));
    }
    match s.strip_prefix("file:") {
        Some(dir) if !dir.is_empty() => Ok((
            Rendezvous::File(PathBuf::from(dir.strip_prefix("//").unwrap_or(dir))),
            "gloo-loop".to_string(),
        )),
        _ => Err(bad()),
    }
}

fn parse_args() -> Result<Args, String> {
    let mut options = LoopOptions::default();
    let (mut rank, mut world_size, mut store) = (None, None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_string());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {USAGE}"))?;
        if options.flag(&flag, &value)? {
            continue;
        }
        match flag.as_str() {
            "--rank" => {
                rank =
                    Some(value.parse::<usize>().map_err(|_| {
                        format!("--rank {value:?}: expected a rank number (0..N-1)")
                    })?)
            }
            "--world-size" => {
                world_size = Some(value.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(
                    || format!("--world-size {value:?}: expected a positive integer"),
                )?)
            }
            "--store" => store = Some(parse_store(&value)?),
            other => return Err(format!("unknown option {other:?}; {USAGE}")),
        }
    }
    options.check()?;
    let (Some(rank), Some(world_size), Some((store, job))) = (rank, world_size, store) else {
        return Err(format!(
            "--rank, --world-size and --store are required; {USAGE}"
        ));
    };
    if let Some(f) = options.fault.filter(|f| f.rank >= world_size) {
        return Err(format!(
            "--fault {f}: rank {} is outside the world of --world-size {world_size} (valid: 0..={})",
            f.rank,
            world_size - 1
        ));
    }
    if rank >= world_size {
        return Err(format!(
            "--rank {rank}: outside the world of --world-size {world_size} (valid: 0..={})",
            world_size - 1
        ));
    }
    Ok(Args {
        rank,
        world_size,
        store,
        job,
        options,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gloo-loop: {e}");
            return ExitCode::from(2);
        }
    };
    let mut completed = 0u64;
    let result = run(&args, &mut completed);
    let outcome = Outcome {
        rank: args.rank,
        completed,
        error: result.as_ref().err().cloned(),
    };
    println!("{}", outcome.json_line());
    if result.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Meets the other ranks and loops; the error is the line's message.
fn run(args: &Args, completed: &mut u64) -> Result<(), String> {
    if let Some(dir) = &args.options.trace_dir {
        install_trace_dir(dir, Some(args.rank))?;
    }
    let mut config = GlooConfig::new(args.job.clone()).with_timeout(args.options.timeout());
    // Across hosts, each rank listens on its own host's address (default 127.0.0.1).
    if let Ok(h) = std::env::var(env::HOSTNAME) {
        config = config.with_hostname(h);
    }
    let world =
        GlooFactory::new(&args.store, config).and_then(|f| f.world(args.rank, args.world_size));
    let result = match &world {
        Ok(world) => run_loop(world, &args.options, Waits::Blocking, completed),
        Err(err) => Err(err.clone()),
    };
    // Dumped while the world communicator is alive: a dump holds the live communicators' logs.
    if let Err(err) = &result {
        if let Some(warning) = dump_after_error(err) {
            eprintln!("gloo-loop: rank {}: {warning}", args.rank);
        }
    }
    drop(world);
    result.map_err(|e| e.to_string())
}
