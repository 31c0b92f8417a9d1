//! `mpi-demo`: builds every communicator of a realistic layout on 8 MPI ranks, runs an
//! all-reduce on every family, checks the results and prints a table on rank 0.
//!
//! Layout: world 8, tp 2, pp 2, cp 2 (dp 1), experts with ep 4 and expert tp 1 (expert dp 1),
//! order tp-cp-ep-dp-pp.
//!
//! Run: `mpirun -np 8 --oversubscribe target/release/examples/mpi-demo` (with the Open MPI root
//! variables when root; `cargo xtask demo mpi` does both), or just
//! `target/release/examples/mpi-demo`, which re-launches itself under mpirun with the environment
//! of `backend_mpi::testing::launch_env`. `--np N` changes the world size of the self-launch (the
//! layout needs 8).

use backend_mpi::{testing, MpiFactory, MpiRuntime};
use grid_core::{build_collection, Communicator, CommunicatorExt, LayoutPlan, ReduceOp};
use grid_programs::demo::{all_reduce_every_family, config, describe};
use grid_programs::table::header;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    if !testing::under_launcher() {
        return self_launch();
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn self_launch() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let np = args
        .iter()
        .position(|a| a == "--np")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => {
            eprintln!("mpi-demo: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    match testing::launch(np, 300, &exe, &[]) {
        Ok(out) => {
            print!("{}", out.output.replace("\n--- stderr ---\n", ""));
            if out.code == Some(0) {
                ExitCode::SUCCESS
            } else {
                eprintln!("mpi-demo: mpirun exited with {:?}", out.code);
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("mpi-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let world = rt.world();
    let (me, n) = (world.rank(), world.size());
    let e = |e: grid_core::Error| e.to_string();
    let cfg = config();
    if n != cfg.world_size {
        return Err(format!(
            "the demo layout needs {} ranks, the job has {n}: run mpirun -np {}",
            cfg.world_size, cfg.world_size
        ));
    }
    let plan = LayoutPlan::new(cfg).map_err(e)?;
    let factory = MpiFactory::new();

    world.barrier().map_err(e)?;
    let t0 = Instant::now();
    let built = build_collection(&factory, world, &plan).map_err(e)?;
    let build_s = t0.elapsed().as_secs_f64();

    // One all-reduce per family (every rank walks the families in the same order), timed and
    // checked against the plan's groups.
    let fls = plan.family_levels();
    let (rows, failures) = all_reduce_every_family(&plan, &built, me).map_err(e)?;
    let lat: Vec<f64> = rows.iter().map(|r| r.latency_s).collect();

    // Per family: creation time and latency, max over ranks; failures summed.
    let create: Vec<f64> = built.stats.iter().map(|s| s.seconds).collect();
    let mut create_max = vec![0.0f64; create.len()];
    world
        .all_reduce_into(&create[..], &mut create_max[..], ReduceOp::Max)
        .map_err(e)?;
    let mut lat_max = vec![0.0f64; lat.len()];
    world
        .all_reduce_into(&lat[..], &mut lat_max[..], ReduceOp::Max)
        .map_err(e)?;
    let mut comms = [0i64];
    world
        .all_reduce_into(
            &[built.communicators_created() as i64][..],
            &mut comms[..],
            ReduceOp::Max,
        )
        .map_err(e)?;
    let mut nfail = [0i64];
    world
        .all_reduce_into(&[failures.len() as i64][..], &mut nfail[..], ReduceOp::Sum)
        .map_err(e)?;
    let mut build_max = [0.0f64];
    world
        .all_reduce_into(&[build_s][..], &mut build_max[..], ReduceOp::Max)
        .map_err(e)?;
    for f in &failures {
        eprintln!("rank {me}: {f}");
    }

    if me == 0 {
        println!("MPI demo: {}\n", describe(&plan));
        println!(
            "{}",
            header(&[
                "family",
                ">group size",
                ">comms created (rank 0)",
                "reused from",
                ">create ms (max over ranks)",
                ">all-reduce µs (median, max over ranks)",
                "check",
            ])
        );
        for (i, fl) in fls.iter().enumerate() {
            let st = built.stats.iter().position(|s| s.family == *fl);
            let (size, created, reused, cms) = match st {
                Some(j) => {
                    let s = &built.stats[j];
                    (
                        s.group_size
                            .map(|g| g.to_string())
                            .unwrap_or_else(|| "-".into()),
                        s.created,
                        s.reused_from
                            .map(|r| r.to_string())
                            .unwrap_or_else(|| "-".into()),
                        create_max[j] * 1e3,
                    )
                }
                None => ("?".into(), 0, "-".into(), 0.0),
            };
            println!(
                "| {fl} | {size} | {created} | {reused} | {cms:.3} | {:.1} | {} |",
                lat_max[i] * 1e6,
                if nfail[0] == 0 { "ok" } else { "see errors" }
            );
        }
        println!(
            "\nbuild_collection: {:.1} ms (max over ranks), {} communicators on rank 0 (max over ranks {}), {} collective calls per rank (1 plan check + one split per distinct family)",
            build_max[0] * 1e3,
            built.communicators_created(),
            comms[0],
            built.collective_calls
        );
        if nfail[0] == 0 {
            println!("all-reduce results: correct on every family of every rank ({n} ranks)");
        } else {
            println!("all-reduce results: {} FAILURES (see stderr)", nfail[0]);
        }
    }
    if nfail[0] != 0 {
        return Err(format!("{} check(s) failed", nfail[0]));
    }
    Ok(())
}
