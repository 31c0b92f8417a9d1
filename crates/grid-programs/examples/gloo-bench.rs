//! `gloo-bench`: collectives through the `grid_core::Communicator` trait against the same Gloo
//! algorithm called directly through the shim ([`backend_gloo::RawContext`]), in the same run.
//!
//! Ranks are threads of this process (Gloo over loopback TCP, in-process rendezvous).
//!
//! * all_reduce (the backend's automatic choice, `AllreduceAlgorithm::Auto`: Gloo's ring, with
//!   4 MiB segments from 16 MiB), all_gather (Gloo ring), reduce_scatter (the default algorithm:
//!   that all-reduce plus a copy; `--rs-halving-doubling` measures Gloo's own one, `--rs-ring`
//!   the shim's ring reduce-scatter),
//!   broadcast, f32 sum, 8 B to 64 MiB (powers of 4, plus 64 MiB), at 2 and 4 ranks.
//! * Time = median over iterations of the slowest rank's time; every iteration starts after a
//!   barrier, and the trait call and the direct call alternate iteration by iteration.
//! * algbw = bytes / time; busbw = algbw · factor (nccl-tests: all_reduce 2(n-1)/n, all_gather
//!   and reduce_scatter (n-1)/n, broadcast 1). Bytes follow nccl-tests: the whole buffer for
//!   all_reduce and broadcast, the gathered buffer for all_gather, the send buffer for
//!   reduce_scatter.
//! * `overhead`: on 1 rank, the fixed cost per call of the trait layer (an 8-byte all_reduce,
//!   which Gloo reduces locally at size 1).
//!
//! * `--check-cost`: instead of the above, all_reduce (f32, max, in place) with mismatch checking
//!   off against on (`MismatchCheck::All`: one 14-integer all-reduce before each call), 8 B to
//!   8 MiB, at each `--ranks` count, alternating sample by sample.
//!
//! * `--p2p`: instead of the above, point-to-point latency between 2 ranks through the trait:
//!   a ping-pong of blocking `send`/`recv` (f32), 8 B to 8 MiB; time = half the round trip
//!   (median over samples of the mean of back-to-back round trips).
//!
//! * `--algorithms`: instead of the above, all_reduce (f32, sum, in place, through the shim)
//!   with each all-reduce algorithm of `--variants` (default `auto,ring,ring:4194304,bcube`,
//!   the forms of `backend_gloo::AllreduceAlgorithm`), alternating variant by variant within
//!   each iteration, at each `--ranks` count and size (`--min-bytes` to `--max-bytes`). Besides
//!   the wall time (median and fastest, slowest rank) it reports the CPU time the whole process
//!   spent per call (every rank and Gloo's I/O threads, from `/proc/self/task/*/schedstat`):
//!   on a shared machine the wall time follows the load, the CPU time much less. This is how
//!   `backend_gloo::ALLREDUCE_TABLE` was measured.
//!
//! * `--min-bytes N` and `--ops all_reduce,...` narrow the default mode to some sizes and
//!   operations.
//!
//! Usage: `gloo-bench [--quick] [--ranks 2,4] [--min-bytes N] [--max-bytes N] [--ops LIST] [--rs-halving-doubling|--rs-ring] [--check-cost] [--p2p] [--algorithms [--variants LIST]]`.

use backend_gloo::{
    run_ranks, AllreduceAlgorithm, GlooCommunicator, GlooConfig, RawContext, RawOp,
    ReduceScatterAlgorithm,
};
use grid_core::{Communicator, CommunicatorExt, HostSlice, HostSliceMut, MismatchCheck, ReduceOp};
use grid_programs::collectives::{bandwidth, sizes, Op};
use grid_programs::stats::{alternating, load_average, median, slowest_per_sample};
use grid_programs::table::{bytes_label, header};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Buffers of one (op, size) on one rank: elements per rank block and the vectors.
struct Bufs {
    send: Vec<f32>,
    recv: Vec<f32>,
    /// Bytes in the nccl-tests sense.
    bytes: usize,
}

fn bufs(op: Op, bytes: usize, n: usize, rank: usize) -> Bufs {
    let (send_len, recv_len, bytes) = op.shape(bytes, n);
    // Every rank sends rank + 1 (its rank for all_gather), so each result is known exactly.
    let value = match op {
        Op::AllGather => rank as f32,
        _ => rank as f32 + 1.0,
    };
    Bufs {
        send: vec![value; send_len],
        recv: vec![0.0; recv_len],
        bytes,
    }
}

fn check(op: Op, b: &Bufs, n: usize, rank: usize) -> Result<(), String> {
    let sum = (n * (n + 1) / 2) as f32;
    let ok = match op {
        Op::AllReduce | Op::ReduceScatter => b.recv.iter().all(|&x| x == sum),
        Op::Broadcast => b.recv.iter().all(|&x| x == 1.0),
        Op::AllGather => {
            let per = b.send.len();
            b.recv
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i / per) as f32)
        }
    };
    if ok {
        Ok(())
    } else {
        let bad = b.recv.iter().position(|&x| x != b.recv[0]).unwrap_or(0);
        Err(format!(
            "{} of {} bytes on rank {rank} of {n}: wrong result (element 0 = {}, element {bad} = {}, {} elements)",
            op.name(),
            b.bytes,
            b.recv[0],
            b.recv[bad],
            b.recv.len()
        ))
    }
}

const TIMEOUT: Duration = Duration::from_secs(120);

/// The reduce-scatter algorithm of this run (the trait uses it through the configuration).
static HALVING_DOUBLING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--rs-ring`: the shim's ring reduce-scatter instead of the default.
static RS_RING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn c_rs(_c: &GlooCommunicator) -> ReduceScatterAlgorithm {
    c_rs_global()
}

fn c_rs_global() -> ReduceScatterAlgorithm {
    if HALVING_DOUBLING.load(std::sync::atomic::Ordering::Relaxed) {
        ReduceScatterAlgorithm::HalvingDoubling
    } else if RS_RING.load(std::sync::atomic::Ordering::Relaxed) {
        ReduceScatterAlgorithm::Ring
    } else {
        ReduceScatterAlgorithm::default()
    }
}

/// One call through the trait.
fn via_trait(c: &GlooCommunicator, op: Op, b: &mut Bufs, rank: usize) -> grid_core::Result<()> {
    match op {
        Op::AllReduce => c.all_reduce_into(&b.send, &mut b.recv, ReduceOp::Sum),
        Op::AllGather => c.all_gather_into(&b.send, &mut b.recv),
        Op::ReduceScatter => c.reduce_scatter_into(&b.send, &mut b.recv, ReduceOp::Sum),
        Op::Broadcast => {
            if rank == 0 {
                b.recv.copy_from_slice(&b.send);
            }
            c.broadcast_into(&mut b.recv, 0)
        }
    }
}

/// The same Gloo algorithm called directly through the shim.
fn direct(
    c: &GlooCommunicator,
    op: Op,
    b: &mut Bufs,
    rank: usize,
    tag: u32,
) -> grid_core::Result<()> {
    let raw = c.raw();
    let r = match op {
        Op::AllReduce => raw.allreduce(
            HostSlice::F32(&b.send),
            HostSliceMut::F32(&mut b.recv),
            RawOp::Sum,
            // What the trait runs (the configuration's default).
            AllreduceAlgorithm::Auto,
            tag,
            TIMEOUT,
        ),
        Op::AllGather => raw.allgather(
            HostSlice::F32(&b.send),
            HostSliceMut::F32(&mut b.recv),
            tag,
            TIMEOUT,
        ),
        Op::ReduceScatter => raw.reduce_scatter(
            HostSlice::F32(&b.send),
            HostSliceMut::F32(&mut b.recv),
            RawOp::Sum,
            c_rs(c),
            tag,
            TIMEOUT,
        ),
        Op::Broadcast => {
            if rank == 0 {
                b.recv.copy_from_slice(&b.send);
            }
            raw.broadcast(HostSliceMut::F32(&mut b.recv), 0, tag, TIMEOUT)
        }
    };
    r.map_err(|e| grid_core::Error::Invalid(e.to_string()))
}

fn iterations(bytes: usize, quick: bool) -> (usize, usize) {
    let (w, i) = if bytes <= 64 * 1024 {
        (10, 100)
    } else if bytes <= 2 << 20 {
        (5, 40)
    } else if bytes <= 16 << 20 {
        (3, 15)
    } else {
        (2, 8)
    };
    if quick {
        (w.min(2), (i / 4).max(3))
    } else {
        (w, i)
    }
}

struct Row {
    op: Op,
    ranks: usize,
    bytes: usize,
    trait_s: f64,
    direct_s: f64,
    /// Fastest iteration of each (the least disturbed by other load on the machine).
    trait_min: f64,
    direct_min: f64,
}

fn collectives(n: usize, sizes: &[usize], ops: &[Op], quick: bool) -> Result<Vec<Row>, String> {
    let cfg = GlooConfig::new(format!("gloo-bench-{n}"))
        .with_timeout(TIMEOUT)
        .with_reduce_scatter(c_rs_global());
    // Per rank: per (op, size): (trait times, direct times, bytes).
    let per_rank = run_ranks(n, &cfg, |_f, world| {
        // The trait layer alone: Gloo checks every collective by default (one 14-integer
        // all-reduce before it), which `--check-cost` measures separately.
        world.set_mismatch_check(MismatchCheck::Off);
        let rank = world.rank();
        let mut out = Vec::new();
        let mut tag = 0x4000_0000u32;
        for &op in ops {
            for &size in sizes {
                let mut b = bufs(op, size, n, rank);
                let (warm, iters) = iterations(b.bytes, quick);
                let mut t_trait = Vec::with_capacity(iters);
                let mut t_direct = Vec::with_capacity(iters);
                for it in 0..warm + iters {
                    // Alternate which variant goes first.
                    for k in 0..2 {
                        let use_trait = (it + k) % 2 == 0;
                        b.recv.iter_mut().for_each(|x| *x = 0.0);
                        world.barrier()?;
                        let t = Instant::now();
                        if use_trait {
                            via_trait(&world, op, &mut b, rank)?;
                        } else {
                            tag = tag.wrapping_add(1);
                            direct(&world, op, &mut b, rank, tag)?;
                        }
                        let dt = t.elapsed().as_secs_f64();
                        if it == 0 {
                            check(op, &b, n, rank).map_err(grid_core::Error::Invalid)?;
                        }
                        if it >= warm {
                            if use_trait {
                                t_trait.push(dt);
                            } else {
                                t_direct.push(dt);
                            }
                        }
                    }
                }
                out.push((op, b.bytes, t_trait, t_direct));
            }
        }
        Ok(out)
    })
    .map_err(|e| e.to_string())?;
    let mut ranks = Vec::new();
    for (r, res) in per_rank.into_iter().enumerate() {
        ranks.push(res.map_err(|e| format!("rank {r}: {e}"))?);
    }
    let mut rows = Vec::new();
    for i in 0..ranks[0].len() {
        let (op, bytes) = (ranks[0][i].0, ranks[0][i].1);
        let t = slowest_per_sample(&ranks.iter().map(|r| r[i].2.clone()).collect::<Vec<_>>());
        let d = slowest_per_sample(&ranks.iter().map(|r| r[i].3.clone()).collect::<Vec<_>>());
        rows.push(Row {
            op,
            ranks: n,
            bytes,
            trait_min: t.iter().copied().fold(f64::MAX, f64::min),
            direct_min: d.iter().copied().fold(f64::MAX, f64::min),
            trait_s: median(&t).unwrap_or(0.0),
            direct_s: median(&d).unwrap_or(0.0),
        });
    }
    Ok(rows)
}

/// Fixed cost per call on one rank: trait vs direct, 8-byte all_reduce.
fn overhead(quick: bool) -> Result<(f64, f64), String> {
    let iters = if quick { 20_000 } else { 200_000 };
    let cfg = GlooConfig::new("gloo-bench-overhead").with_timeout(TIMEOUT);
    let r = run_ranks(1, &cfg, |_f, world| {
        let send = [1.0f32, 2.0];
        let mut recv = [0.0f32; 2];
        let mut best = (f64::MAX, f64::MAX);
        for _round in 0..5 {
            let t = Instant::now();
            for _ in 0..iters {
                world.all_reduce_into(&send, &mut recv, ReduceOp::Sum)?;
            }
            let a = t.elapsed().as_secs_f64() / iters as f64;
            let t = Instant::now();
            for i in 0..iters {
                world
                    .raw()
                    .allreduce(
                        HostSlice::F32(&send),
                        HostSliceMut::F32(&mut recv),
                        RawOp::Sum,
                        AllreduceAlgorithm::Auto,
                        i as u32,
                        TIMEOUT,
                    )
                    .map_err(|e| grid_core::Error::Invalid(e.to_string()))?;
            }
            let b = t.elapsed().as_secs_f64() / iters as f64;
            best = (best.0.min(a), best.1.min(b));
        }
        Ok(best)
    })
    .map_err(|e| e.to_string())?;
    r.into_iter()
        .next()
        .ok_or("no rank")?
        .map_err(|e| e.to_string())
}

/// All-reduce with mismatch checking off against on at `n` ranks, alternating sample by sample;
/// prints one table row per size: (bytes, samples, off µs, checked µs).
fn check_cost(n: usize, quick: bool) -> Result<(), String> {
    let samples = if quick { 10 } else { 40 };
    let plan: [(usize, usize); 5] = [
        (8, 100),
        (4 << 10, 50),
        (64 << 10, 20),
        (1 << 20, 5),
        (8 << 20, 1),
    ];
    let cfg = GlooConfig::new("gloo-bench-check-cost").with_timeout(TIMEOUT);
    let per_rank = run_ranks(n, &cfg, |_f, world| {
        let mut out = Vec::new();
        for (bytes, reps) in plan {
            let mut buf = vec![1.0f32; bytes / 4];
            let (mut off, mut on) = (Vec::new(), Vec::new());
            for it in 0..2 + samples {
                let mut one = |check: bool| -> grid_core::Result<f64> {
                    world.set_mismatch_check(if check {
                        MismatchCheck::All
                    } else {
                        MismatchCheck::Off
                    });
                    world.barrier()?;
                    let t = Instant::now();
                    for _ in 0..reps {
                        // Max keeps the values at 1 however many calls run.
                        world.all_reduce_in_place(&mut buf[..], ReduceOp::Max)?;
                    }
                    Ok(t.elapsed().as_secs_f64() / reps as f64)
                };
                let (a, b) = alternating(it, &mut one)?;
                if it >= 2 {
                    off.push(a);
                    on.push(b);
                }
            }
            world.set_mismatch_check(MismatchCheck::Off);
            if buf.iter().any(|v| *v != 1.0) {
                return Err(grid_core::Error::Invalid(format!(
                    "all_reduce of {bytes} bytes returned a wrong maximum"
                )));
            }
            out.push((off, on));
        }
        Ok(out)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<grid_core::Result<Vec<_>>>()
    .map_err(|e| e.to_string())?;
    for (i, (bytes, _)) in plan.iter().enumerate() {
        let off: Vec<Vec<f64>> = per_rank.iter().map(|r| r[i].0.clone()).collect();
        let on: Vec<Vec<f64>> = per_rank.iter().map(|r| r[i].1.clone()).collect();
        let off = median(&slowest_per_sample(&off)).unwrap_or(0.0);
        let on = median(&slowest_per_sample(&on)).unwrap_or(0.0);
        println!(
            "| {n} | {} | {samples} | {:.1} | {:.1} | {:.1} | {:.1} % |",
            bytes_label(*bytes),
            off * 1e6,
            on * 1e6,
            (on - off) * 1e6,
            if off > 0.0 {
                (on - off) / off * 100.0
            } else {
                0.0
            },
        );
    }
    Ok(())
}

/// CPU time (s) every thread of this process has run so far (`/proc/self/task/*/schedstat`,
/// nanoseconds); `None` where that is not readable.
fn process_cpu() -> Option<f64> {
    let mut ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path().join("schedstat");
        // A thread that ended between the listing and the read has nothing more to add.
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

/// One all-reduce through the shim with `algorithm`.
fn raw_all_reduce(
    raw: &RawContext,
    buf: &mut [f32],
    algorithm: AllreduceAlgorithm,
    tag: u32,
) -> grid_core::Result<()> {
    raw.allreduce_in_place(HostSliceMut::F32(buf), RawOp::Sum, algorithm, tag, TIMEOUT)
        .map_err(|e| grid_core::Error::Invalid(e.to_string()))
}

/// `--algorithms`: every variant at every size at `n` ranks; prints one row per (size,
/// variant): ranks, bytes, variant, median µs, fastest µs, CPU ms per call.
fn algorithms(
    n: usize,
    sizes: &[usize],
    variants: &[AllreduceAlgorithm],
    quick: bool,
) -> Result<(), String> {
    let cfg = GlooConfig::new(format!("gloo-bench-algorithms-{n}")).with_timeout(TIMEOUT);
    let per_rank = run_ranks(n, &cfg, |_f, world| {
        world.set_mismatch_check(MismatchCheck::Off);
        let rank = world.rank();
        let raw = world.raw();
        let mut tag = 0x5000_0000u32;
        // Per size: per variant: (wall times, CPU times (rank 0 only)).
        let mut out = Vec::new();
        for &bytes in sizes {
            let (warm, iters) = iterations(bytes, quick);
            let mut buf = vec![0.0f32; bytes / 4];
            let mut wall = vec![Vec::with_capacity(iters); variants.len()];
            let mut cpu = vec![Vec::with_capacity(iters); variants.len()];
            for it in 0..warm + iters {
                for k in 0..variants.len() {
                    // Rotate which variant goes first.
                    let v = (it + k) % variants.len();
                    buf.iter_mut().for_each(|x| *x = rank as f32 + 1.0);
                    world.barrier()?;
                    let c0 = if rank == 0 { process_cpu() } else { None };
                    world.barrier()?;
                    let t = Instant::now();
                    tag = tag.wrapping_add(1);
                    raw_all_reduce(raw, &mut buf, variants[v], tag)?;
                    let dt = t.elapsed().as_secs_f64();
                    world.barrier()?;
                    let c1 = if rank == 0 { process_cpu() } else { None };
                    if it == 0 {
                        let sum = (n * (n + 1) / 2) as f32;
                        if let Some(bad) = buf.iter().position(|&x| x != sum) {
                            return Err(grid_core::Error::Invalid(format!(
                                "all_reduce {} of {bytes} bytes on rank {rank} of {n}: element {bad} = {}, expected {sum}",
                                variants[v], buf[bad]
                            )));
                        }
                    }
                    if it >= warm {
                        wall[v].push(dt);
                        if let (Some(a), Some(b)) = (c0, c1) {
                            cpu[v].push(b - a);
                        }
                    }
                }
            }
            out.push((wall, cpu));
        }
        Ok(out)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<grid_core::Result<Vec<_>>>()
    .map_err(|e| e.to_string())?;
    for (i, &bytes) in sizes.iter().enumerate() {
        for (v, variant) in variants.iter().enumerate() {
            let wall: Vec<Vec<f64>> = per_rank.iter().map(|r| r[i].0[v].clone()).collect();
            let slowest = slowest_per_sample(&wall);
            let cpu = median(&per_rank[0][i].1[v]).unwrap_or(f64::NAN);
            println!(
                "| {n} | {} | {variant} | {} | {:.1} | {:.1} | {:.2} |",
                bytes_label(bytes),
                variant.resolve(n, bytes),
                median(&slowest).unwrap_or(0.0) * 1e6,
                slowest.iter().copied().fold(f64::MAX, f64::min) * 1e6,
                cpu * 1e3,
            );
        }
    }
    Ok(())
}

/// Ping-pong between 2 ranks through the trait's blocking send/recv; prints one table row per
/// size: (bytes, samples, one-way µs, GB/s).
fn p2p_latency(quick: bool) -> Result<(), String> {
    let samples = if quick { 10 } else { 30 };
    let plan: [(usize, usize); 7] = [
        (8, 200),
        (4 << 10, 100),
        (64 << 10, 40),
        (256 << 10, 20),
        (1 << 20, 10),
        (8 << 20, 2),
        (64 << 20, 1),
    ];
    let cfg = GlooConfig::new("gloo-bench-p2p").with_timeout(TIMEOUT);
    let per_rank = run_ranks(2, &cfg, |_f, world| {
        let me = world.rank();
        let peer = 1 - me;
        let mut out = Vec::new();
        for (bytes, reps) in plan {
            let mut buf = vec![me as f32; bytes / 4];
            let mut times = Vec::new();
            for it in 0..2 + samples {
                world.barrier()?;
                let t = Instant::now();
                for _ in 0..reps {
                    if me == 0 {
                        world.send_to(&buf[..], peer, 1)?;
                        world.recv_from(&mut buf[..], peer, 2)?;
                    } else {
                        world.recv_from(&mut buf[..], peer, 1)?;
                        world.send_to(&buf[..], peer, 2)?;
                    }
                }
                if it >= 2 {
                    times.push(t.elapsed().as_secs_f64() / reps as f64 / 2.0);
                }
            }
            if buf.iter().any(|v| *v != 0.0) {
                return Err(grid_core::Error::Invalid(format!(
                    "ping-pong of {bytes} bytes returned wrong data"
                )));
            }
            out.push(times);
        }
        Ok(out)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<grid_core::Result<Vec<_>>>()
    .map_err(|e| e.to_string())?;
    for (i, (bytes, _)) in plan.iter().enumerate() {
        let all: Vec<Vec<f64>> = per_rank.iter().map(|r| r[i].clone()).collect();
        let t = median(&slowest_per_sample(&all)).unwrap_or(0.0);
        println!(
            "| {} | {samples} | {:.1} | {:.3} |",
            bytes_label(*bytes),
            t * 1e6,
            if t > 0.0 {
                *bytes as f64 / t / 1e9
            } else {
                0.0
            }
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let mut ranks = vec![2usize, 4];
    let mut max_bytes = 64usize << 20;
    let mut min_bytes = 8usize;
    let mut ops: Vec<Op> = Op::ALL.to_vec();
    let mut check = false;
    let mut p2p = false;
    let mut algos = false;
    let mut variants: Vec<AllreduceAlgorithm> = vec![
        AllreduceAlgorithm::Auto,
        AllreduceAlgorithm::Ring,
        AllreduceAlgorithm::RingSegments(4 << 20),
        AllreduceAlgorithm::Bcube,
    ];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => {}
            "--check-cost" => check = true,
            "--p2p" => p2p = true,
            "--algorithms" => algos = true,
            "--variants" => match it.next().map(|v| {
                v.split(',')
                    .map(str::parse)
                    .collect::<Result<Vec<AllreduceAlgorithm>, _>>()
            }) {
                Some(Ok(v)) if !v.is_empty() => variants = v,
                Some(Err(e)) => {
                    eprintln!("gloo-bench: --variants: {e}");
                    return ExitCode::from(2);
                }
                _ => {
                    eprintln!("gloo-bench: --variants needs a list of all-reduce algorithms, e.g. ring,ring:4194304,bcube");
                    return ExitCode::from(2);
                }
            },
            "--rs-ring" => RS_RING.store(true, std::sync::atomic::Ordering::Relaxed),
            "--rs-halving-doubling" => {
                HALVING_DOUBLING.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--ranks" => match it.next().map(|v| {
                v.split(',')
                    .map(str::parse)
                    .collect::<Result<Vec<usize>, _>>()
            }) {
                Some(Ok(v)) if !v.is_empty() && v.iter().all(|&n| n > 0) => ranks = v,
                _ => {
                    eprintln!("gloo-bench: --ranks needs a list of positive integers, e.g. 2,4");
                    return ExitCode::from(2);
                }
            },
            "--min-bytes" => match it.next().and_then(|v| v.parse().ok()) {
                Some(b) if b >= 8 => min_bytes = b,
                _ => {
                    eprintln!("gloo-bench: --min-bytes needs an integer >= 8");
                    return ExitCode::from(2);
                }
            },
            "--ops" => {
                let names: Vec<&str> = it
                    .next()
                    .map(|v| v.split(',').collect())
                    .unwrap_or_default();
                let parsed: Option<Vec<Op>> = names
                    .iter()
                    .map(|n| Op::ALL.into_iter().find(|o| o.name() == *n))
                    .collect();
                match parsed {
                    Some(v) if !v.is_empty() => ops = v,
                    _ => {
                        eprintln!("gloo-bench: --ops needs a list of all_reduce, all_gather, reduce_scatter, broadcast");
                        return ExitCode::from(2);
                    }
                }
            }
            "--max-bytes" => match it.next().and_then(|v| v.parse().ok()) {
                Some(b) if b >= 8 => max_bytes = b,
                _ => {
                    eprintln!("gloo-bench: --max-bytes needs an integer >= 8");
                    return ExitCode::from(2);
                }
            },
            other => {
                eprintln!("gloo-bench: unknown argument '{other}' (usage: gloo-bench [--quick] [--ranks 2,4] [--min-bytes N] [--max-bytes N] [--ops LIST] [--rs-halving-doubling|--rs-ring] [--check-cost] [--p2p] [--algorithms [--variants LIST]])");
                return ExitCode::from(2);
            }
        }
    }
    if p2p {
        println!("## Point-to-point on Gloo (2 ranks, blocking send/recv ping-pong, f32)\n");
        println!("Ranks are threads of one process (loopback TCP). A sample is the mean of back-to-back round trips (200 at 8 B, 100 at 4 KiB, 40 at 64 KiB, 20 at 256 KiB, 10 at 1 MiB, 2 at 8 MiB, 1 at 64 MiB); time = half the round trip, median over samples of the slowest rank. Load average: {}.\n", load_average().unwrap_or_else(|| "unknown".into()));
        println!(
            "{}",
            header(&[">bytes", ">samples", ">one-way µs", ">GB/s"])
        );
        if let Err(e) = p2p_latency(quick) {
            eprintln!("gloo-bench: p2p: {e}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    if check {
        println!("## Cost of mismatch checking on Gloo (all_reduce in place, f32, max)\n");
        println!("Ranks are threads of one process (loopback TCP). Off against `MismatchCheck::All` on the same communicator, alternating sample by sample. A sample is the mean of back-to-back calls (100 at 8 B, 50 at 4 KiB, 20 at 64 KiB, 5 at 1 MiB, 1 at 8 MiB); time = median over samples of the slowest rank. Load average: {}.\n", load_average().unwrap_or_else(|| "unknown".into()));
        println!(
            "{}",
            header(&[
                ">ranks",
                ">bytes",
                ">samples",
                ">off µs",
                ">checked µs",
                ">check µs",
                ">check / off"
            ])
        );
        for &n in &ranks {
            if let Err(e) = check_cost(n, quick) {
                eprintln!("gloo-bench: check-cost at {n} ranks: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
    let sizes: Vec<usize> = sizes(max_bytes)
        .into_iter()
        .filter(|&b| b >= min_bytes)
        .collect();
    if algos {
        println!("## Gloo all-reduce algorithms (f32, sum, in place, through the shim)\n");
        println!("Ranks are threads of one process (loopback TCP). The variants alternate within each iteration (the first one rotates); time = median (and fastest) over iterations of the slowest rank; CPU = median over iterations of the CPU time of the whole process (all ranks and Gloo's threads) per call. Load average: {}.\n", load_average().unwrap_or_else(|| "unknown".into()));
        println!(
            "{}",
            header(&[
                ">ranks",
                ">bytes",
                "variant",
                "runs",
                ">median µs",
                ">fastest µs",
                ">CPU ms"
            ])
        );
        for &n in &ranks {
            if let Err(e) = algorithms(n, &sizes, &variants, quick) {
                eprintln!("gloo-bench: algorithms at {n} ranks: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }

    println!("# gloo-bench\n");
    println!(
        "Ranks are threads of one process (Gloo over loopback TCP, in-process rendezvous); f32 sum; \
         time = median over iterations of the slowest rank (each iteration after a barrier); \
         `trait` = through `grid_core::Communicator`, `direct` = the same Gloo algorithm through the shim; \
         the two alternate iteration by iteration; the trait's mismatch check (on by default on Gloo) is off here, \
         `--check-cost` measures it. algbw/busbw in GB/s (nccl-tests factors).\n"
    );
    match overhead(quick) {
        Ok((t, d)) => println!(
            "Fixed cost per call, 1 rank, 8-byte all_reduce (best of 5 rounds): trait {:.0} ns, direct {:.0} ns, difference {:.0} ns\n",
            t * 1e9,
            d * 1e9,
            (t - d) * 1e9
        ),
        Err(e) => {
            eprintln!("gloo-bench: overhead: {e}");
            return ExitCode::FAILURE;
        }
    }
    println!(
        "{}",
        header(&[
            "op",
            ">ranks",
            ">bytes",
            ">trait µs",
            ">direct µs",
            ">trait/direct − 1",
            ">same, fastest iterations",
            ">algbw",
            ">busbw",
        ])
    );
    let mut ratios = Vec::new();
    let mut min_ratios = Vec::new();
    for &n in &ranks {
        let rows = match collectives(n, &sizes, &ops, quick) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("gloo-bench: {n} ranks: {e}");
                return ExitCode::FAILURE;
            }
        };
        for r in rows {
            let (algbw, busbw) = bandwidth(r.op, r.bytes, r.trait_s, r.ranks);
            let over = r.trait_s / r.direct_s - 1.0;
            let over_min = r.trait_min / r.direct_min - 1.0;
            ratios.push(over);
            min_ratios.push(over_min);
            println!(
                "| {} | {} | {} | {:.1} | {:.1} | {:+.1}% | {:+.1}% | {:.3} | {:.3} |",
                r.op.name(),
                r.ranks,
                bytes_label(r.bytes),
                r.trait_s * 1e6,
                r.direct_s * 1e6,
                over * 100.0,
                over_min * 100.0,
                algbw,
                busbw
            );
        }
    }
    let n_rows = ratios.len();
    println!(
        "\nmedian over all {n_rows} rows of trait/direct − 1: {:+.2}% (medians), {:+.2}% (fastest iterations)",
        median(&ratios).unwrap_or(0.0) * 100.0,
        median(&min_ratios).unwrap_or(0.0) * 100.0
    );
    ExitCode::SUCCESS
}
