//! `peer-bench`: this project's side of `cargo xtask bench peers` (this project against mpi4py
//! and torch.distributed's Gloo, interleaved in one sitting).
//!
//! The driver (`xtask/src/peers.rs`) listens on a Unix socket; every rank of a job connects to
//! it, says `hello RANK SIZE`, and then runs what the driver asks, one line per command:
//!
//! * `run OP BYTES WARMUP ITERS`: `WARMUP` untimed calls, then `ITERS` timed ones, each after a
//!   barrier; the answer is `ok T1 T2 …` (seconds per timed call, on this rank) or `err MESSAGE`.
//!   `OP` is `all_reduce` (out of place: separate send and receive buffers),
//!   `all_reduce_in_place` (`all_reduce_in_place`: `MPI_IN_PLACE` on MPI, the buffer refilled
//!   before every call, outside the timing), `all_gather`, `reduce_scatter`, `broadcast` (root
//!   0), all f32 sum, with nccl-tests' byte counts ([`Op::shape`]); or `groups` / `groups_local`
//!   (`BYTES` is ignored): [`build_collection_with`] of the demo layout at this world size, every
//!   family's communicators, by a split of the parent per family (`groups`, against torch's
//!   global `new_group`) or members-only ([`Creation::MembersOnly`], `groups_local`, against
//!   torch's `use_local_synchronization=True`), dropped after each call. The results of the last call are checked.
//! * `quit`: the rank ends.
//!
//! The peer scripts (`xtask/peers/*.py`) answer the same commands. Ranks wait for the next
//! command in a blocking read, so an idle job takes no processor time from the job being timed.
//!
//! ```text
//! peer-bench serve --backend mpi --connect SOCKET                      (under mpirun)
//! peer-bench serve --backend gloo --connect SOCKET --rank R --world-size N --store DIR
//! peer-bench serve --backend gloo-threads --connect SOCKET --world-size N
//! peer-bench groups [--world-size N]    the demo layout's groups, per family, as JSON
//! ```
//!
//! Exit status: 0 after `quit`, 1 on an error (one line on standard error), 2 for invalid
//! options.

use backend_gloo::{run_ranks, GlooConfig, GlooFactory, Rendezvous};
use backend_mpi::{MpiFactory, MpiRuntime};
use grid_core::{
    build_collection_with, CollectionOptions, Communicator, CommunicatorExt, Creation,
    GroupFactory, LayoutPlan, ReduceOp,
};
use grid_programs::collectives::Op;
use grid_programs::demo::config;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[path = "common/peer_memory.rs"]
mod peer_memory;
use peer_memory::PeerMemory;

const USAGE: &str = "usage: peer-bench serve --backend mpi|gloo|gloo-threads --connect SOCKET [--rank R] [--world-size N] [--store DIR]
       peer-bench groups [--world-size N]";

/// Gloo's time limit on every wait: long enough for 64 MiB on a loaded machine.
const GLOO_TIMEOUT: Duration = Duration::from_secs(300);

/// The command line.
#[derive(Default)]
struct Args {
    mode: String,
    backend: Option<String>,
    connect: Option<PathBuf>,
    rank: Option<usize>,
    world_size: Option<usize>,
    store: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        mode: it.next().ok_or_else(|| USAGE.to_string())?,
        ..Args::default()
    };
    if a.mode != "serve" && a.mode != "groups" {
        return Err(format!(
            "unknown mode {:?}: expected serve or groups\n{USAGE}",
            a.mode
        ));
    }
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = |what: &str| {
            value
                .parse::<usize>()
                .map_err(|_| format!("{what} {value:?}: expected a non-negative integer"))
        };
        match flag.as_str() {
            "--backend" => match value.as_str() {
                "mpi" | "gloo" | "gloo-threads" => a.backend = Some(value.clone()),
                _ => {
                    return Err(format!(
                        "--backend {value:?}: expected mpi, gloo or gloo-threads"
                    ))
                }
            },
            "--connect" => a.connect = Some(PathBuf::from(&value)),
            "--rank" => a.rank = Some(number("--rank")?),
            "--world-size" => {
                let n = number("--world-size")?;
                if n == 0 {
                    return Err("--world-size 0: expected a positive integer".into());
                }
                a.world_size = Some(n);
            }
            "--store" => a.store = Some(PathBuf::from(&value)),
            other => return Err(format!("unknown option {other:?}\n{USAGE}")),
        }
    }
    if a.mode == "serve" {
        match a.backend.as_deref() {
            None => return Err(format!("serve needs --backend\n{USAGE}")),
            Some("gloo") => {
                let (Some(rank), Some(n), Some(_)) = (a.rank, a.world_size, &a.store) else {
                    return Err(format!(
                        "--backend gloo needs --rank, --world-size and --store\n{USAGE}"
                    ));
                };
                if rank >= n {
                    return Err(format!(
                        "--rank {rank}: outside the world of --world-size {n} (valid: 0..={})",
                        n - 1
                    ));
                }
            }
            Some("gloo-threads") if a.world_size.is_none() => {
                return Err(format!(
                    "--backend gloo-threads needs --world-size\n{USAGE}"
                ))
            }
            _ => {}
        }
        if a.connect.is_none() {
            return Err(format!("serve needs --connect SOCKET\n{USAGE}"));
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("peer-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let r = if args.mode == "groups" {
        groups(args.world_size.unwrap_or(8))
    } else {
        serve_main(&args)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peer-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The demo layout's plan at `world` ranks.
fn plan(world: usize) -> Result<LayoutPlan, String> {
    let mut cfg = config();
    cfg.world_size = world;
    LayoutPlan::new(cfg).map_err(|e| format!("the demo layout at world {world}: {e}"))
}

/// Prints `{"layout": "...", "families": [{"name": "tp", "groups": [[0, 1], ...]}, ...]}`:
/// the groups `build_collection` creates, for the peers to create the same ones.
fn groups(world: usize) -> Result<(), String> {
    let plan = plan(world)?;
    let mut families = Vec::new();
    for fl in plan.family_levels() {
        let g = plan
            .groups(fl)
            .map_err(|e| format!("groups of {fl}: {e}"))?;
        families.push(serde_json::json!({ "name": fl.to_string(), "groups": g.to_vecs() }));
    }
    let doc = serde_json::json!({
        "layout": grid_programs::demo::describe(&plan),
        "families": families,
    });
    println!("{doc}");
    Ok(())
}

fn serve_main(a: &Args) -> Result<(), String> {
    let backend = a
        .backend
        .as_deref()
        .ok_or_else(|| format!("serve needs --backend\n{USAGE}"))?;
    let connect = a
        .connect
        .clone()
        .ok_or_else(|| format!("serve needs --connect SOCKET\n{USAGE}"))?;
    let e = |e: grid_core::Error| e.to_string();
    match backend {
        "mpi" => {
            let rt = MpiRuntime::init().map_err(e)?;
            serve(&MpiFactory::new(), rt.world(), &connect, PeerMemory::Numpy)
        }
        "gloo" => {
            let (Some(rank), Some(n), Some(store)) = (a.rank, a.world_size, a.store.clone()) else {
                return Err(format!(
                    "--backend gloo needs --rank, --world-size and --store\n{USAGE}"
                ));
            };
            if rank >= n {
                return Err(format!(
                    "--rank {rank}: outside the world of --world-size {n} (valid: 0..={})",
                    n - 1
                ));
            }
            let cfg = GlooConfig::new("peer-bench").with_timeout(GLOO_TIMEOUT);
            let factory = GlooFactory::new(&Rendezvous::File(store), cfg).map_err(e)?;
            let world = factory.world(rank, n).map_err(e)?;
            serve(&factory, &world, &connect, PeerMemory::Torch)
        }
        _ => {
            let n = a
                .world_size
                .ok_or_else(|| format!("--backend gloo-threads needs --world-size\n{USAGE}"))?;
            let cfg = GlooConfig::new("peer-bench-threads").with_timeout(GLOO_TIMEOUT);
            let results = run_ranks(n, &cfg, |f, world| {
                serve(f, &world, &connect, PeerMemory::Torch).map_err(grid_core::Error::Invalid)
            })
            .map_err(e)?;
            for (rank, r) in results.into_iter().enumerate() {
                r.map_err(|err| format!("rank {rank}: {err}"))?;
            }
            Ok(())
        }
    }
}

/// Connects to the driver and answers its commands until `quit` (or the driver goes away).
fn serve<F>(
    factory: &F,
    world: &F::Comm,
    connect: &PathBuf,
    memory: PeerMemory,
) -> Result<(), String>
where
    F: GroupFactory,
    F::Comm: Communicator,
{
    let (rank, n) = (world.rank(), world.size());
    let stream = UnixStream::connect(connect)
        .map_err(|e| format!("rank {rank}: cannot connect to {}: {e}", connect.display()))?;
    let mut out = stream
        .try_clone()
        .map_err(|e| format!("rank {rank}: socket: {e}"))?;
    let io = |e: std::io::Error| format!("rank {rank}: the driver's socket: {e}");
    writeln!(out, "hello {rank} {n}").map_err(io)?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(io)?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["quit"] => return Ok(()),
            ["run", op, bytes, warmup, iters] => match command(bytes, warmup, iters) {
                Ok((bytes, warmup, iters)) => run(factory, world, op, bytes, warmup, iters, memory),
                Err(e) => Err(e),
            },
            _ => Err(format!(
                "unknown command {line:?}: expected 'run OP BYTES WARMUP ITERS' or 'quit'"
            )),
        };
        let reply = match answer {
            Ok(times) => {
                let mut s = String::from("ok");
                for t in times {
                    s.push_str(&format!(" {t:e}"));
                }
                s
            }
            Err(e) => format!("err rank {rank}: {}", e.replace('\n', " ")),
        };
        writeln!(out, "{reply}").map_err(io)?;
    }
    Ok(())
}

fn command(bytes: &str, warmup: &str, iters: &str) -> Result<(usize, usize, usize), String> {
    let num = |what: &str, v: &str| {
        v.parse::<usize>()
            .map_err(|_| format!("{what} {v:?}: expected a non-negative integer"))
    };
    let (b, w, i) = (
        num("bytes", bytes)?,
        num("warmup", warmup)?,
        num("iterations", iters)?,
    );
    if i == 0 {
        return Err("iterations 0: expected at least 1".into());
    }
    if b > 1 << 30 {
        return Err(format!("bytes {b}: at most 1 GiB"));
    }
    Ok((b, w, i))
}

/// One command: `warmup + iters` calls, each after a barrier; the timed ones' seconds.
fn run<F>(
    factory: &F,
    c: &F::Comm,
    op: &str,
    bytes: usize,
    warmup: usize,
    iters: usize,
    memory: PeerMemory,
) -> Result<Vec<f64>, String>
where
    F: GroupFactory,
    F::Comm: Communicator,
{
    let e = |e: grid_core::Error| e.to_string();
    let (rank, n) = (c.rank(), c.size());
    let mut times = Vec::with_capacity(iters);
    // torch's global mode (every rank calls new_group for every group) against a split of
    // the parent per family; its local synchronization (only the members of a group create
    // it) against members-only creation.
    if op == "groups" || op == "groups_local" {
        let plan = plan(n)?;
        let mut options = CollectionOptions::new();
        if op == "groups_local" {
            options.creation = Creation::MembersOnly;
        }
        for it in 0..warmup + iters {
            c.barrier().map_err(e)?;
            let t = Instant::now();
            let built = build_collection_with(factory, c, &plan, &options).map_err(e)?;
            let dt = t.elapsed().as_secs_f64();
            if it >= warmup {
                times.push(dt);
            }
            drop(built);
        }
        return Ok(times);
    }
    let (kind, in_place) = match op {
        "all_reduce" => (Op::AllReduce, false),
        "all_reduce_in_place" => (Op::AllReduce, true),
        "all_gather" => (Op::AllGather, false),
        "all_gather_in_place" => (Op::AllGather, true),
        "reduce_scatter" => (Op::ReduceScatter, false),
        "reduce_scatter_in_place" => (Op::ReduceScatter, true),
        "broadcast" => (Op::Broadcast, false),
        other => {
            return Err(format!(
                "unknown operation {other:?}: expected all_reduce, all_reduce_in_place, all_gather, all_gather_in_place, reduce_scatter, reduce_scatter_in_place, broadcast, groups or groups_local"
            ))
        }
    };
    let (send_len, recv_len, _) = kind.shape(bytes, n);
    // Every rank sends rank + 1 (its rank for all_gather), so each result is known exactly.
    let value = match kind {
        Op::AllGather => rank as f32,
        _ => rank as f32 + 1.0,
    };
    let send = memory.filled(send_len, value);
    let mut recv = memory.filled(recv_len, 0.0);
    // The in-place all-gather works on the receive buffer (this rank's block filled, the
    // others' slots zero), as mpi4py's side does: the same allocations in the same order, so
    // that both sides' buffers land alike on huge pages (see docs/performance.md, *The
    // in-place all-gather of 8 MiB*). The in-place reduce-scatter works on one more buffer of
    // size · block elements, the whole input of the scatter (mpi4py's `whole`).
    let block = send_len.min(recv_len);
    let mut whole = memory.filled(
        if in_place && kind == Op::ReduceScatter {
            send_len.max(recv_len)
        } else {
            0
        },
        0.0,
    );
    for it in 0..warmup + iters {
        if in_place || kind == Op::Broadcast {
            match kind {
                Op::AllGather => recv[rank * block..(rank + 1) * block].fill(value),
                Op::ReduceScatter => whole.fill(value),
                _ => recv.copy_from_slice(&send),
            }
        }
        c.barrier().map_err(e)?;
        let t = Instant::now();
        match (kind, in_place) {
            (Op::AllReduce, true) => c.all_reduce_in_place(&mut recv[..], ReduceOp::Sum),
            (Op::AllReduce, false) => c.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum),
            (Op::AllGather, true) => c.all_gather_in_place(&mut recv[..]),
            (Op::AllGather, false) => c.all_gather_into(&send[..], &mut recv[..]),
            (Op::ReduceScatter, true) => c.reduce_scatter_in_place(&mut whole[..], ReduceOp::Sum),
            (Op::ReduceScatter, false) => {
                c.reduce_scatter_into(&send[..], &mut recv[..], ReduceOp::Sum)
            }
            (Op::Broadcast, _) => c.broadcast_into(&mut recv[..], 0),
        }
        .map_err(e)?;
        let dt = t.elapsed().as_secs_f64();
        if it >= warmup {
            times.push(dt);
        }
    }
    // The in-place reduce-scatter's result: this rank's reduced block at rank · block.
    if (kind, in_place) == (Op::ReduceScatter, true) {
        recv.copy_from_slice(&whole[rank * block..(rank + 1) * block]);
    }
    check(kind, &send, &recv, n).map_err(|m| format!("{op} of {bytes} bytes on {n} ranks: {m}"))?;
    Ok(times)
}

/// The last call's result is the exact one.
fn check(op: Op, send: &[f32], recv: &[f32], n: usize) -> Result<(), String> {
    let sum = (n * (n + 1) / 2) as f32;
    let bad = match op {
        Op::AllReduce | Op::ReduceScatter => recv.iter().position(|&x| x != sum),
        Op::Broadcast => recv.iter().position(|&x| x != 1.0),
        Op::AllGather => {
            let per = send.len().max(1);
            recv.iter()
                .enumerate()
                .position(|(i, &x)| x != (i / per) as f32)
        }
    };
    match bad {
        None => Ok(()),
        Some(i) => Err(format!(
            "wrong result: element {i} of {} is {}",
            recv.len(),
            recv[i]
        )),
    }
}
