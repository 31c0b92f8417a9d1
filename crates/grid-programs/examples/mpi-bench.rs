//! `mpi-bench`: collectives through this crate against the same calls made directly through
//! rsmpi in the same run, and building the demo layout's communicators with `build_collection`
//! against the naive approach (every rank creating every group of the world).
//!
//! Modes (under mpirun):
//! * `mpi-bench collectives`: all_reduce, all_gather, reduce_scatter, broadcast of f32 from 8 B
//!   to 64 MiB (powers of 4, plus 64 MiB). Time = median over iterations of the slowest rank's
//!   time (each iteration starts after a barrier); ours and rsmpi alternate iteration by
//!   iteration. algbw = bytes / time; busbw = algbw · factor with the nccl-tests factors
//!   (all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1). Bytes follow
//!   nccl-tests: the whole buffer for all_reduce and broadcast, the gathered (receive) buffer for
//!   all_gather, the send buffer for reduce_scatter.
//! * `mpi-bench collection`: on 8 ranks, the demo layout (tp2 pp2 cp2, ep4 etp1).
//! * `mpi-bench overhead`: on 1 rank, the fixed cost per call of this crate against rsmpi.
//! * `mpi-bench in-place`: all_reduce in place (`all_reduce_in_place`, `MPI_IN_PLACE`, no copy)
//!   against out of place (`all_reduce_into`, separate send and receive buffers) through this
//!   crate, 1 MiB to 64 MiB, alternating iteration by iteration.
//! * `mpi-bench check-cost`: all_reduce (f32, in place) with mismatch checking off against
//!   on (`MismatchCheck::All`: one 14-integer all-reduce before each call), max, 8 B to 8 MiB,
//!   alternating sample by sample; the cost of the check in µs and as a fraction of the call.
//!
//! * `mpi-bench peer-read`: the all-gather (in place and not) and the broadcast (f32, 2 to
//!   64 MiB) copying straight between the ranks' memory (backend-mpi's default from `PEER_READ_MIN` on one node when the
//!   buffers lie on huge pages) against `MPI_Allgather` / `MPI_Bcast` (a communicator created
//!   with `GRID_MPI_PEER_READ_MIN=0`), on numpy-like buffers (huge pages advised) and on plain
//!   ones (where both take MPI's call), alternating iteration by iteration.
//! * `mpi-bench p2p`: on 2 ranks, a ping-pong of 8 B (`send_to` then `recv_from`, which run as
//!   `MPI_Isend`/`MPI_Irecv` completed under the time limit) against rsmpi's blocking
//!   `send`/`receive_into` in the same run, alternating sample by sample: time per round trip.
//!
//! Without a launcher, `mpi-bench` runs itself: `overhead` at 1 rank, `collectives` and
//! `in-place`, `check-cost` and `peer-read` at 2 and 4 ranks and `collection` at 8 ranks, and prints one markdown report. `--quick` uses fewer iterations.

use backend_mpi::{testing, MpiFactory, MpiRuntime};
use grid_core::{
    build_collection, Communicator, CommunicatorExt, GroupFactory, LayoutPlan, MismatchCheck,
    ReduceOp,
};
use grid_programs::collectives::{bandwidth, sizes, Op};
use grid_programs::demo::config;
use grid_programs::stats::{alternating, load_average, median};
use grid_programs::table::{bytes_label, header};
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::topology::Communicator as _;
use std::process::ExitCode;
use std::time::Instant;

#[path = "common/peer_memory.rs"]
mod peer_memory;
use peer_memory::PeerMemory;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let r = if testing::under_launcher() {
        match args
            .iter()
            .find(|a| !a.starts_with("--"))
            .map(String::as_str)
        {
            Some("collectives") | None => collectives(quick),
            Some("collection") => collection(quick),
            Some("overhead") => overhead(quick),
            Some("in-place") => in_place(quick),
            Some("check-cost") => check_cost(quick),
            Some("peer-read") => peer_read(quick),
            Some("p2p") => p2p(quick),
            Some(other) => Err(format!(
                "unknown mode '{other}': use collectives, collection, overhead, in-place, check-cost, peer-read or p2p"
            )),
        }
    } else {
        driver(quick)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The all-gather (in place and not) and the broadcast copying straight between the ranks'
/// memory (the world, with backend-mpi's defaults) against `MPI_Allgather` / `MPI_Bcast` (a split of the world created
/// with `GRID_MPI_PEER_READ_MIN=0`), on numpy-like and on plain buffers, alternating iteration
/// by iteration.
fn peer_read(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let reads = rt.world();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (reads.rank(), reads.size());
    // Every rank sets the variable before the split and removes it after, so the new
    // communicator (and only it) never reads its peers.
    std::env::set_var(backend_mpi::PEER_READ_MIN_ENV, "0");
    let mpi_only = MpiFactory::new().split(reads, Some(0), me);
    std::env::remove_var(backend_mpi::PEER_READ_MIN_ENV);
    let mpi_only = mpi_only
        .map_err(e)?
        .ok_or("every rank is a member of the split")?;
    if me == 0 {
        println!("## Reading the peers' memory against MPI's calls, {n} ranks (f32)\n");
        println!("All-gather (in place and not) and broadcast (from rank 0), both through this crate with the mismatch check on: the world (copies straight between the ranks' memory from {} MiB when every buffer lies mostly on huge pages) and a communicator created with `{}=0` (always `MPI_Allgather` / `MPI_Bcast`). numpy memory: huge pages advised from 4 MiB as numpy does; plain: no advice (both take MPI's call). Time: median over iterations of the slowest rank; the two alternate iteration by iteration.\n", backend_mpi::PEER_READ_MIN >> 20, backend_mpi::PEER_READ_MIN_ENV);
        println!(
            "{}",
            header(&[
                "op",
                "memory",
                ">bytes",
                ">samples",
                ">default µs",
                ">MPI µs",
                ">MPI / default",
            ])
        );
    }
    for op in ["all_gather (in place)", "all_gather", "broadcast"] {
        for (memory, label) in [(PeerMemory::Numpy, "numpy"), (PeerMemory::Plain, "plain")] {
            for bytes in [2usize << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20] {
                let iters = match (quick, bytes > 8 << 20) {
                    (true, _) => 5,
                    (false, false) => 30,
                    (false, true) => 15,
                };
                let block = bytes / 4 / n;
                let gather = op != "broadcast";
                let in_place = op != "all_gather";
                let mut buf = memory.filled(block * n, 0.0);
                let mut send = memory.filled(if in_place { 0 } else { block }, 0.0);
                // The gather's element i comes from rank i / block; the broadcast's from rank 0.
                // Call c's values: the gather's element i comes from rank i / block, the
                // broadcast's from rank 0; odd and even calls differ, so a result left over
                // from the call before never passes for this one.
                let want = |i: usize, c: usize| {
                    let base = (c % 2) as f32 * 1e6;
                    if gather {
                        (i / block) as f32 + 1.0 + base
                    } else {
                        (i % 1000) as f32 + base
                    }
                };
                let mut t_reads = Vec::with_capacity(iters);
                let mut t_mpi = Vec::with_capacity(iters);
                let mut calls = 0usize;
                for it in 0..2 + iters {
                    let mut one = |read: bool| -> Result<f64, String> {
                        // As the peer programs prepare: only what this rank contributes.
                        calls += 1;
                        if !in_place {
                            send.fill(want(me * block, calls));
                        } else if gather {
                            let mine = &mut buf[me * block..(me + 1) * block];
                            mine.fill(want(me * block, calls));
                        } else if me == 0 {
                            buf.iter_mut()
                                .enumerate()
                                .for_each(|(i, x)| *x = want(i, calls));
                        }
                        let c = if read { reads } else { &mpi_only };
                        c.barrier().map_err(e)?;
                        let t = Instant::now();
                        if !in_place {
                            c.all_gather_into(&send[..], &mut buf[..])
                        } else if gather {
                            c.all_gather_in_place(&mut buf[..])
                        } else {
                            c.broadcast_into(&mut buf[..], 0)
                        }
                        .map_err(e)?;
                        let dt = t.elapsed().as_secs_f64();
                        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want(i, calls)) {
                            return Err(format!(
                                "{op} of {bytes} bytes: element {i} is {}, expected {}",
                                buf[i],
                                want(i, calls)
                            ));
                        }
                        Ok(dt)
                    };
                    let (mpi, read) = alternating(it, &mut one)?;
                    if it >= 2 {
                        t_reads.push(read);
                        t_mpi.push(mpi);
                    }
                }
                let (m_mpi, m_reads, ratio) = slowest_pair(reads, &t_mpi, &t_reads)?;
                if me == 0 {
                    println!(
                        "| {op} | {label} | {} | {iters} | {:.1} | {:.1} | {ratio:.2} |",
                        bytes_label(bytes),
                        m_reads * 1e6,
                        m_mpi * 1e6,
                    );
                }
            }
        }
    }
    if me == 0 {
        println!();
    }
    Ok(())
}

/// Two series timed alternately, sample by sample, on every rank: the slowest rank's time per
/// sample, then the median of each series and the median of the per-sample ratios `a / b`.
fn slowest_pair(
    comm: &backend_mpi::MpiCommunicator,
    a: &[f64],
    b: &[f64],
) -> Result<(f64, f64, f64), String> {
    let e = |e: grid_core::Error| e.to_string();
    let (mut ma, mut mb) = (vec![0f64; a.len()], vec![0f64; b.len()]);
    comm.all_reduce_into(a, &mut ma[..], ReduceOp::Max)
        .map_err(e)?;
    comm.all_reduce_into(b, &mut mb[..], ReduceOp::Max)
        .map_err(e)?;
    let ratios: Vec<f64> = ma.iter().zip(&mb).map(|(x, y)| x / y).collect();
    Ok((
        median(&ma).unwrap_or(0.0),
        median(&mb).unwrap_or(0.0),
        median(&ratios).unwrap_or(0.0),
    ))
}

/// All-reduce in place against out of place through this crate, same communicator, alternating
/// iteration by iteration: what the in-place form saves (the copy the out-of-place form's
/// separate receive buffer costs in memory traffic, and the buffer itself).
fn in_place(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let comm = rt.world();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (comm.rank(), comm.size());
    if me == 0 {
        println!("## All-reduce in place against out of place, {n} ranks (f32, sum)\n");
        println!("Both through this crate: `all_reduce_in_place` (MPI_IN_PLACE, no copy) and `all_reduce_into` (separate send and receive buffers). Time: median over iterations of the slowest rank; the two alternate iteration by iteration.\n");
        println!(
            "{}",
            header(&[
                ">bytes",
                ">samples",
                ">in place µs",
                ">out of place µs",
                ">in place / out of place"
            ])
        );
    }
    for bytes in [1usize << 20, 8 << 20, 64 << 20] {
        let iters = match bytes {
            b if b <= 1 << 20 => {
                if quick {
                    10
                } else {
                    40
                }
            }
            b if b <= 8 << 20 => {
                if quick {
                    6
                } else {
                    20
                }
            }
            _ => {
                if quick {
                    4
                } else {
                    15
                }
            }
        };
        let len = bytes / 4;
        let send: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
        let mut recv = vec![0f32; len];
        let mut buf = send.clone();
        let mut t_in = Vec::with_capacity(iters);
        let mut t_out = Vec::with_capacity(iters);
        for it in 0..2 + iters {
            let mut one = |in_place: bool| -> Result<f64, String> {
                // Refill the in-place buffer so every call reduces the same values (and the
                // sums stay small); the out-of-place call reads `send` and writes `recv`.
                if in_place {
                    buf.copy_from_slice(&send);
                }
                comm.barrier().map_err(e)?;
                let t = Instant::now();
                if in_place {
                    comm.all_reduce_in_place(&mut buf[..], ReduceOp::Sum)
                } else {
                    comm.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum)
                }
                .map_err(e)?;
                Ok(t.elapsed().as_secs_f64())
            };
            let (out_of_place, in_place) = alternating(it, &mut one)?;
            if it >= 2 {
                t_in.push(in_place);
                t_out.push(out_of_place);
            }
        }
        // The results agree (and are the sum over ranks).
        let expect = |i: usize| (i % 7) as f32 * n as f32;
        if buf.iter().enumerate().any(|(i, v)| *v != expect(i))
            || recv.iter().enumerate().any(|(i, v)| *v != expect(i))
        {
            return Err(format!("all_reduce of {bytes} bytes returned a wrong sum"));
        }
        let (m_in, m_out, ratio) = slowest_pair(comm, &t_in, &t_out)?;
        if me == 0 {
            println!(
                "| {} | {iters} | {:.1} | {:.1} | {ratio:.3} |",
                bytes_label(bytes),
                m_in * 1e6,
                m_out * 1e6,
            );
        }
    }
    if me == 0 {
        println!();
    }
    Ok(())
}

/// A ping-pong of 8 bytes between ranks 0 and 1 through this crate and through rsmpi directly,
/// alternating sample by sample.
fn p2p(quick: bool) -> Result<(), String> {
    use mpi::point_to_point::{Destination, Source};
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let ours = rt.world();
    let direct = rt.rsmpi_world().duplicate();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (ours.rank(), ours.size());
    if n != 2 {
        return Err(format!("p2p runs on 2 ranks, not {n}"));
    }
    let peer = 1 - me;
    let (rounds, samples) = if quick { (2_000, 9) } else { (20_000, 21) };
    let out = [1f32, 2.0];
    let mut back = [0f32; 2];
    let mut t_ours = Vec::new();
    let mut t_direct = Vec::new();
    for i in 0..samples {
        let (a, b) = alternating(i, |rsmpi| -> Result<f64, String> {
            ours.barrier().map_err(e)?;
            let t = Instant::now();
            for _ in 0..rounds {
                match (rsmpi, me) {
                    (false, 0) => {
                        ours.send_to(&out[..], peer, 1).map_err(e)?;
                        ours.recv_from(&mut back[..], peer, 1).map_err(e)?;
                    }
                    (false, _) => {
                        ours.recv_from(&mut back[..], peer, 1).map_err(e)?;
                        ours.send_to(&out[..], peer, 1).map_err(e)?;
                    }
                    (true, 0) => {
                        direct.process_at_rank(peer as i32).send(&out[..]);
                        direct
                            .process_at_rank(peer as i32)
                            .receive_into(&mut back[..]);
                    }
                    (true, _) => {
                        direct
                            .process_at_rank(peer as i32)
                            .receive_into(&mut back[..]);
                        direct.process_at_rank(peer as i32).send(&out[..]);
                    }
                }
            }
            Ok(t.elapsed().as_secs_f64() / rounds as f64)
        })?;
        t_ours.push(a);
        t_direct.push(b);
    }
    if me == 0 {
        let (o, d) = (
            median(&t_ours).unwrap_or(0.0),
            median(&t_direct).unwrap_or(0.0),
        );
        println!("## Point to point, 2 ranks, 8 B ping-pong\n");
        println!("Round trip (a send and a receive on each rank), median of {samples} samples of {rounds} round trips, this crate and rsmpi alternating. Load average: {}.\n", load_average().unwrap_or_else(|| "unknown".into()));
        println!(
            "{}",
            header(&[
                ">this crate µs",
                ">rsmpi µs",
                ">difference ns per round trip"
            ])
        );
        println!(
            "| {:.3} | {:.3} | {:+.0} |\n",
            o * 1e6,
            d * 1e6,
            (o - d) * 1e9
        );
    }
    Ok(())
}

/// All-reduce with mismatch checking off against on, same communicator, alternating sample by
/// sample: what the check costs per call (at 2 ranks one all-reduce of 16 integers before the
/// call; from 3 to 16 ranks one round of messages that carries the data up to 8 KiB a message,
/// the fingerprints alone above).
fn check_cost(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let comm = rt.world();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (comm.rank(), comm.size());
    if me == 0 {
        println!("## Cost of mismatch checking, {n} ranks (all_reduce in place, f32, max)\n");
        println!("Off against `MismatchCheck::All` on the same communicator, alternating sample by sample. A sample is the mean of back-to-back calls (100 at 8 B, 50 at 2 and 4 KiB, 30 at 16 KiB, 20 at 64 KiB, 5 at 1 MiB, 1 at 8 MiB); time = median over samples of the slowest rank. Load average: {}.\n", load_average().unwrap_or_else(|| "unknown".into()));
        println!(
            "{}",
            header(&[
                ">bytes",
                ">samples",
                ">off µs",
                ">checked µs",
                ">check µs",
                ">check / off"
            ])
        );
    }
    for (bytes, reps) in [
        (8usize, 100usize),
        (2 << 10, 50),
        (4 << 10, 50),
        (16 << 10, 30),
        (64 << 10, 20),
        (1 << 20, 5),
        (8 << 20, 1),
    ] {
        let samples = if quick { 10 } else { 40 };
        let len = bytes / 4;
        let mut buf: Vec<f32> = vec![1.0; len];
        let mut t_off = Vec::with_capacity(samples);
        let mut t_on = Vec::with_capacity(samples);
        for it in 0..2 + samples {
            let mut one = |on: bool| -> Result<f64, String> {
                comm.set_mismatch_check(if on {
                    MismatchCheck::All
                } else {
                    MismatchCheck::Off
                });
                comm.barrier().map_err(e)?;
                let t = Instant::now();
                for _ in 0..reps {
                    // Max keeps the values at 1 however many calls run.
                    comm.all_reduce_in_place(&mut buf[..], ReduceOp::Max)
                        .map_err(e)?;
                }
                Ok(t.elapsed().as_secs_f64() / reps as f64)
            };
            let (a, b) = alternating(it, &mut one)?;
            if it >= 2 {
                t_off.push(a);
                t_on.push(b);
            }
        }
        comm.set_mismatch_check(MismatchCheck::Off);
        if buf.iter().any(|v| *v != 1.0) {
            return Err(format!(
                "all_reduce of {bytes} bytes returned a wrong maximum"
            ));
        }
        let mut m_off = vec![0f64; samples];
        let mut m_on = vec![0f64; samples];
        comm.all_reduce_into(&t_off[..], &mut m_off[..], ReduceOp::Max)
            .map_err(e)?;
        comm.all_reduce_into(&t_on[..], &mut m_on[..], ReduceOp::Max)
            .map_err(e)?;
        let off = median(&m_off).unwrap_or(0.0);
        let on = median(&m_on).unwrap_or(0.0);
        if me == 0 {
            println!(
                "| {} | {samples} | {:.1} | {:.1} | {:.1} | {:.1} % |",
                bytes_label(bytes),
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
    }
    if me == 0 {
        println!();
    }
    Ok(())
}

fn driver(quick: bool) -> Result<(), String> {
    let exe = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .to_string_lossy()
        .into_owned();
    let q = if quick { vec!["--quick"] } else { vec![] };
    println!("# MPI benchmark (backend-mpi vs rsmpi called directly)\n");
    println!(
        "Open MPI via rsmpi 0.8, {} cores, load average at start: {}, env: {}\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        load_average().unwrap_or_else(|| "unknown".into()),
        testing::launch_env()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for (np, mode) in [
        (1, "overhead"),
        (2, "collectives"),
        (2, "in-place"),
        (2, "check-cost"),
        (2, "peer-read"),
        (4, "collectives"),
        (4, "in-place"),
        (4, "check-cost"),
        (4, "peer-read"),
        (8, "collection"),
    ] {
        let mut a = vec![mode];
        a.extend(q.iter().copied());
        let out = testing::launch(np, 1200, &exe, &a)?;
        let text = out.output.replace("\n--- stderr ---\n", "");
        print!("{text}");
        if out.code != Some(0) {
            return Err(format!(
                "{mode} at {np} ranks: mpirun exited with {:?}",
                out.code
            ));
        }
    }
    Ok(())
}

fn collectives(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let ours = rt.world();
    // A duplicate of the world, like the communicator `ours` wraps, so both sides run on the
    // same kind of communicator.
    let direct = rt.rsmpi_world().duplicate();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (ours.rank(), ours.size());
    let sizes = sizes(64 << 20); // 8 B .. 32 MiB in powers of 4, then 64 MiB
    if me == 0 {
        println!("## Collectives, {n} ranks (f32, sum)\n");
        println!("Time: median over samples of the slowest rank (µs per call; up to 64 KiB a sample is the mean of 50 back-to-back calls, up to 1 MiB of 5). Overhead = median over sample pairs of ours / rsmpi, minus 1.\n");
        println!(
            "{}",
            header(&[
                "op",
                ">bytes",
                ">samples",
                ">ours µs",
                ">rsmpi µs",
                ">overhead",
                ">ours algbw GB/s",
                ">ours busbw GB/s",
                ">rsmpi busbw GB/s",
            ])
        );
    }
    let mut worst: f64 = f64::MIN;
    for op in Op::ALL {
        for &bytes in &sizes {
            // Element counts (per-rank blocks for all_gather and reduce_scatter) and the bytes
            // counted, as nccl-tests counts them.
            let (send_len, recv_len, actual_bytes) = op.shape(bytes, n);
            // Small messages: each sample times `inner` back-to-back calls (the clock costs
            // about as much as an 8-byte operation), so the sample is the mean per call.
            let (warm, iters, inner) = match bytes {
                b if b <= 64 << 10 => (5, if quick { 15 } else { 60 }, 50),
                b if b <= 1 << 20 => (3, if quick { 10 } else { 40 }, 5),
                b if b <= 8 << 20 => (2, if quick { 6 } else { 20 }, 1),
                _ => (2, if quick { 4 } else { 15 }, 1),
            };
            let send: Vec<f32> = (0..send_len).map(|i| (i % 7) as f32).collect();
            let mut recv = vec![0f32; recv_len];
            let mut t_ours = Vec::with_capacity(iters);
            let mut t_direct = Vec::with_capacity(iters);
            let run_ours = |recv: &mut [f32]| -> Result<f64, String> {
                ours.barrier().map_err(e)?;
                let t = Instant::now();
                for _ in 0..inner {
                    match op {
                        Op::AllReduce => ours.all_reduce_into(&send[..], recv, ReduceOp::Sum),
                        Op::AllGather => ours.all_gather_into(&send[..], recv),
                        Op::ReduceScatter => {
                            ours.reduce_scatter_into(&send[..], recv, ReduceOp::Sum)
                        }
                        Op::Broadcast => ours.broadcast_into(recv, 0),
                    }
                    .map_err(e)?;
                }
                Ok(t.elapsed().as_secs_f64() / inner as f64)
            };
            let run_direct = |recv: &mut [f32]| -> Result<f64, String> {
                ours.barrier().map_err(e)?;
                let t = Instant::now();
                for _ in 0..inner {
                    match op {
                        Op::AllReduce => {
                            direct.all_reduce_into(&send[..], recv, SystemOperation::sum())
                        }
                        Op::AllGather => direct.all_gather_into(&send[..], recv),
                        Op::ReduceScatter => direct.reduce_scatter_block_into(
                            &send[..],
                            recv,
                            SystemOperation::sum(),
                        ),
                        Op::Broadcast => direct.process_at_rank(0).broadcast_into(recv),
                    }
                }
                Ok(t.elapsed().as_secs_f64() / inner as f64)
            };
            for it in 0..warm + iters {
                // Alternate which goes first, so drift and cache effects hit both equally.
                let (a, b) = alternating(it, |direct| {
                    if direct {
                        run_direct(&mut recv[..])
                    } else {
                        run_ours(&mut recv[..])
                    }
                })?;
                if it >= warm {
                    t_ours.push(a);
                    t_direct.push(b);
                }
            }
            // Slowest rank per iteration.
            let mut m_ours = vec![0f64; iters];
            let mut m_direct = vec![0f64; iters];
            ours.all_reduce_into(&t_ours[..], &mut m_ours[..], ReduceOp::Max)
                .map_err(e)?;
            ours.all_reduce_into(&t_direct[..], &mut m_direct[..], ReduceOp::Max)
                .map_err(e)?;
            // Overhead: median of the paired ratios (the two samples of a pair ran back to
            // back, so machine noise cancels far better than in a ratio of medians).
            let ratios: Vec<f64> = m_ours.iter().zip(&m_direct).map(|(o, d)| o / d).collect();
            let over = (median(&ratios).unwrap_or(0.0) - 1.0) * 100.0;
            let (a, b) = (
                median(&m_ours).unwrap_or(0.0),
                median(&m_direct).unwrap_or(0.0),
            );
            worst = worst.max(over);
            if me == 0 {
                let (algbw, busbw) = bandwidth(op, actual_bytes, a, n);
                println!(
                    "| {} | {} | {iters} | {:.3} | {:.3} | {:+.1}% | {:.3} | {:.3} | {:.3} |",
                    op.name(),
                    bytes_label(actual_bytes),
                    a * 1e6,
                    b * 1e6,
                    over,
                    algbw,
                    busbw,
                    bandwidth(op, actual_bytes, b, n).1
                );
            }
        }
    }
    if me == 0 {
        println!("\nLargest overhead at {n} ranks: {worst:+.1}%\n");
    }
    Ok(())
}

/// The fixed cost per call, measured on one rank where MPI does no communication (a local
/// copy): what this crate adds on top of rsmpi, free of network and scheduling noise.
fn overhead(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let ours = rt.world();
    let direct = rt.rsmpi_world().duplicate();
    let e = |e: grid_core::Error| e.to_string();
    let (calls, samples) = if quick { (20_000, 9) } else { (200_000, 21) };
    let send = [1f32, 2.0];
    let mut recv = [0f32; 2];
    println!("## Fixed cost per call, 1 rank, 8 bytes (f32)\n");
    println!("MPI only copies locally here, so the difference is this crate's own work per call (argument checks, dispatch). Median of {samples} paired samples of {calls} calls.\n");
    println!(
        "{}",
        header(&["op", ">ours ns/call", ">rsmpi ns/call", ">difference ns",])
    );
    for op in Op::ALL {
        let mut o = Vec::new();
        let mut d = Vec::new();
        let mut diff = Vec::new();
        for _ in 0..samples {
            let t = Instant::now();
            for _ in 0..calls {
                match op {
                    Op::AllReduce => ours.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum),
                    Op::AllGather => ours.all_gather_into(&send[..], &mut recv[..]),
                    Op::ReduceScatter => {
                        ours.reduce_scatter_into(&send[..], &mut recv[..], ReduceOp::Sum)
                    }
                    Op::Broadcast => ours.broadcast_into(&mut recv[..], 0),
                }
                .map_err(e)?;
            }
            let a = t.elapsed().as_secs_f64() / calls as f64 * 1e9;
            let t = Instant::now();
            for _ in 0..calls {
                match op {
                    Op::AllReduce => {
                        direct.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum())
                    }
                    Op::AllGather => direct.all_gather_into(&send[..], &mut recv[..]),
                    Op::ReduceScatter => direct.reduce_scatter_block_into(
                        &send[..],
                        &mut recv[..],
                        SystemOperation::sum(),
                    ),
                    Op::Broadcast => direct.process_at_rank(0).broadcast_into(&mut recv[..]),
                }
            }
            let b = t.elapsed().as_secs_f64() / calls as f64 * 1e9;
            o.push(a);
            d.push(b);
            diff.push(a - b);
        }
        println!(
            "| {} | {:.1} | {:.1} | {:+.1} |",
            op.name(),
            median(&o).unwrap_or(0.0),
            median(&d).unwrap_or(0.0),
            median(&diff).unwrap_or(0.0)
        );
    }
    println!();
    Ok(())
}

fn collection(quick: bool) -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let world = rt.world();
    let e = |e: grid_core::Error| e.to_string();
    let (me, n) = (world.rank(), world.size());
    let mut cfg = config();
    cfg.world_size = n;
    let plan = LayoutPlan::new(cfg).map_err(e)?;
    let reps = if quick { 3 } else { 7 };
    let mut t_built = Vec::new();
    let mut t_naive = Vec::new();
    let (mut built_comms, mut built_calls, mut naive_comms, mut naive_calls) =
        (0usize, 0usize, 0usize, 0usize);
    for _ in 0..reps {
        // build_collection: one plan check plus one split per distinct family.
        world.barrier().map_err(e)?;
        let t = Instant::now();
        let built = build_collection(&MpiFactory::new(), world, &plan).map_err(e)?;
        t_built.push(t.elapsed().as_secs_f64());
        built_comms = built.communicators_created();
        built_calls = built.collective_calls;
        drop(built);
        // Naive: every rank takes part in MPI_Comm_create for every group of every family.
        world.barrier().map_err(e)?;
        let f = MpiFactory::new();
        let t = Instant::now();
        let mut comms = Vec::new();
        for fl in plan.family_levels() {
            let groups = plan.groups(fl).map_err(e)?;
            for g in groups.iter() {
                if let Some(c) = f.create_group(world, g).map_err(e)? {
                    comms.push(c);
                }
            }
        }
        t_naive.push(t.elapsed().as_secs_f64());
        naive_comms = comms.len();
        naive_calls = f.calls().creates;
    }
    let mut mb = vec![0f64; reps];
    let mut mn = vec![0f64; reps];
    world
        .all_reduce_into(&t_built[..], &mut mb[..], ReduceOp::Max)
        .map_err(e)?;
    world
        .all_reduce_into(&t_naive[..], &mut mn[..], ReduceOp::Max)
        .map_err(e)?;
    let mut counts = [0i64; 4];
    let mine = [
        built_comms as i64,
        built_calls as i64,
        naive_comms as i64,
        naive_calls as i64,
    ];
    world
        .all_reduce_into(&mine[..], &mut counts[..], ReduceOp::Max)
        .map_err(e)?;
    if me == 0 {
        let c = plan.config();
        println!(
            "## Building the demo layout's communicators, {n} ranks (tp {} pp {} cp {}, ep {} etp {}, {} families)\n",
            c.tp,
            c.pp,
            c.cp,
            c.ep,
            plan.expert_tp(),
            plan.family_levels().len()
        );
        println!("Median of {reps} repetitions of the slowest rank.\n");
        println!(
            "{}",
            header(&[
                "approach",
                ">time ms",
                ">communicators per rank (max)",
                ">collective calls per rank",
            ])
        );
        println!(
            "| build_collection (split per distinct family) | {:.2} | {} | {} |",
            median(&mb).unwrap_or(0.0) * 1e3,
            counts[0],
            counts[1]
        );
        println!(
            "| naive (MPI_Comm_create over the world for every group of every family) | {:.2} | {} | {} |",
            median(&mn).unwrap_or(0.0) * 1e3,
            counts[2],
            counts[3]
        );
        println!();
    }
    Ok(())
}
