//! `nccl-bench`: all_reduce, all_gather, reduce_scatter and broadcast of f32 device buffers
//! from 8 B to 64 MiB through `backend-nccl`, one rank per GPU (threads of this process,
//! bootstrapped over `backend-local`), with nccl-tests' bus-bandwidth conventions (see
//! `grid_programs::collectives`). Prints a markdown table like `mpi-bench`.
//!
//! ```text
//! nccl-bench [--quick] [--ranks N] [--host]
//! ```
//! * `--ranks N`: use the first N GPUs (default: all visible GPUs);
//! * `--host`: time host buffers (staged through the GPU) instead of device buffers;
//! * `--quick`: fewer samples.
//!
//! Without a usable GPU it prints `SKIPPED: <reason>` and exits with status 0.

use backend_local::{LocalComm, LocalConfig, LocalWorld};
use backend_nccl::cudarc::driver::sys::CUevent_flags;
use backend_nccl::{probe, NcclCommunicator, NcclDeviceBuffer, NcclFactory, NcclOptions};
use grid_core::{BufMut, BufRef, Communicator, CommunicatorExt, ReduceOp};
use grid_programs::collectives::{bandwidth, sizes, Op};
use grid_programs::stats::median;
use grid_programs::table::header;
use std::process::ExitCode;
use std::time::{Duration, Instant};

struct Args {
    quick: bool,
    ranks: Option<usize>,
    host: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        ranks: None,
        host: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--quick" => a.quick = true,
            "--host" => a.host = true,
            "--ranks" => {
                let v = it.next().ok_or("--ranks needs a number")?;
                a.ranks = Some(
                    v.parse()
                        .map_err(|_| format!("--ranks: '{v}' is not a number"))?,
                );
            }
            "-h" | "--help" => {
                return Err("usage: nccl-bench [--quick] [--ranks N] [--host]".into())
            }
            other => {
                return Err(format!(
                    "unknown argument '{other}' (usage: nccl-bench [--quick] [--ranks N] [--host])"
                ))
            }
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nccl-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gpus = match probe::gpu_count() {
        Ok(n) => n,
        Err(e) => {
            println!("SKIPPED: nccl-bench needs a GPU: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let n = args.ranks.unwrap_or(gpus);
    if n == 0 || n > gpus {
        eprintln!("nccl-bench: --ranks {n}: valid values are 1..={gpus} (one rank per GPU)");
        return ExitCode::FAILURE;
    }
    if let Ok((a, b, c)) = probe::nccl_version() {
        println!("# NCCL benchmark (backend-nccl)\n\nNCCL {a}.{b}.{c}, {n} GPU(s), one rank per GPU (threads of one process)\n");
    }
    let config = LocalConfig {
        timeout: Duration::from_secs(600),
        ..LocalConfig::default()
    };
    let boots = match LocalWorld::with_config(n, config) {
        Ok(w) => w.communicators(),
        Err(e) => {
            eprintln!("nccl-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let args = &args;
                s.spawn(move || rank(i, b, args))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let mut ok = true;
    for (i, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            eprintln!("nccl-bench: rank {i}: {e}");
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn rank(i: usize, boot: &LocalComm, args: &Args) -> Result<(), String> {
    let e = |e: grid_core::Error| e.to_string();
    let opts = NcclOptions {
        device: Some(i),
        ..NcclOptions::default()
    };
    let (_factory, world) = NcclFactory::init(boot, opts).map_err(e)?;
    let n = world.size();
    if i == 0 {
        let what = if args.host {
            "host buffers, staged"
        } else {
            "device buffers"
        };
        println!("## NCCL collectives, {n} ranks ({what}, f32, sum)\n");
        let clock = if args.host {
            "host wall-clock time from before the calls to the end of one stream synchronisation"
        } else {
            "CUDA events recorded on the communicator's stream before and after the calls, as nccl-tests times"
        };
        println!("Time: median over samples of the slowest rank (µs per call; a sample is the mean of several back-to-back calls, timed by {clock}). algbw = bytes / time, busbw = algbw · factor (nccl-tests conventions).\n");
        println!(
            "{}",
            header(&[
                "op",
                ">bytes",
                ">count",
                ">samples",
                ">time µs",
                ">algbw GB/s",
                ">busbw GB/s",
            ])
        );
    }
    // Device buffers are timed on the GPU: two timing events on the communicator's stream.
    let timing = |what: &str| {
        world
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|err| format!("cuEventCreate ({what}): {err:?}"))
    };
    let (start, end) = (timing("start")?, timing("end")?);
    for op in Op::ALL {
        for bytes in sizes(64 << 20) {
            let (send_len, recv_len, counted) = op.shape(bytes, n);
            let (warm, samples, inner) = samples_per_size(bytes, args.quick);
            let mut times = Vec::with_capacity(samples);
            let mut runner = Runner::new(&world, args.host, send_len, recv_len).map_err(e)?;
            for it in 0..warm + samples {
                boot.barrier().map_err(e)?;
                let t = Instant::now();
                if !args.host {
                    start
                        .record(world.stream())
                        .map_err(|err| format!("cuEventRecord: {err:?}"))?;
                }
                for _ in 0..inner {
                    runner.run(op).map_err(e)?;
                }
                let secs = if args.host {
                    world.synchronize().map_err(e)?;
                    t.elapsed().as_secs_f64()
                } else {
                    end.record(world.stream())
                        .map_err(|err| format!("cuEventRecord: {err:?}"))?;
                    world.synchronize().map_err(e)?;
                    f64::from(
                        start
                            .elapsed_ms(&end)
                            .map_err(|err| format!("cuEventElapsedTime: {err:?}"))?,
                    ) / 1e3
                };
                if it >= warm {
                    times.push(secs / inner as f64);
                }
            }
            let mut slowest = vec![0f64; samples];
            boot.all_reduce_into(&times[..], &mut slowest[..], ReduceOp::Max)
                .map_err(e)?;
            if i == 0 {
                let secs = median(&slowest).unwrap_or(0.0);
                let (algbw, busbw) = bandwidth(op, counted, secs, n);
                println!(
                    "| {} | {counted} | {} | {samples} | {:.1} | {algbw:.2} | {busbw:.2} |",
                    op.name(),
                    recv_len.max(send_len),
                    secs * 1e6
                );
            }
        }
    }
    Ok(())
}

/// `(warm-up samples, timed samples, calls per sample)` for a size: small messages time many
/// back-to-back calls per sample so the clock does not dominate.
fn samples_per_size(bytes: usize, quick: bool) -> (usize, usize, usize) {
    match bytes {
        b if b <= 64 << 10 => (5, if quick { 10 } else { 40 }, 50),
        b if b <= 1 << 20 => (3, if quick { 8 } else { 30 }, 10),
        b if b <= 8 << 20 => (2, if quick { 5 } else { 20 }, 2),
        _ => (2, if quick { 4 } else { 15 }, 1),
    }
}

/// The buffers of one size, device or host.
enum Runner<'a> {
    Device {
        w: &'a NcclCommunicator,
        send: NcclDeviceBuffer<f32>,
        recv: NcclDeviceBuffer<f32>,
    },
    Host {
        w: &'a NcclCommunicator,
        send: Vec<f32>,
        recv: Vec<f32>,
    },
}

impl<'a> Runner<'a> {
    fn new(
        w: &'a NcclCommunicator,
        host: bool,
        send_len: usize,
        recv_len: usize,
    ) -> grid_core::Result<Self> {
        let send: Vec<f32> = (0..send_len).map(|i| (i % 7) as f32).collect();
        if host {
            Ok(Runner::Host {
                w,
                send,
                recv: vec![0.0; recv_len],
            })
        } else {
            Ok(Runner::Device {
                w,
                send: w.to_device(&send)?,
                recv: w.zeros(recv_len)?,
            })
        }
    }

    fn run(&mut self, op: Op) -> grid_core::Result<()> {
        match self {
            Runner::Device { w, send, recv } => {
                let (s, r) = (BufRef::Device(&*send), BufMut::Device(&mut *recv));
                match op {
                    Op::AllReduce => w.all_reduce(s, r, ReduceOp::Sum),
                    Op::AllGather => w.all_gather(s, r),
                    Op::ReduceScatter => w.reduce_scatter(s, r, ReduceOp::Sum),
                    Op::Broadcast => w.broadcast(r, 0),
                }
            }
            Runner::Host { w, send, recv } => match op {
                Op::AllReduce => w.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum),
                Op::AllGather => w.all_gather_into(&send[..], &mut recv[..]),
                Op::ReduceScatter => w.reduce_scatter_into(&send[..], &mut recv[..], ReduceOp::Sum),
                Op::Broadcast => w.broadcast_into(&mut recv[..], 0),
            },
        }
    }
}
