//! Gloo ranks as separate processes that meet through a directory, then every communicator of a
//! parallel layout with an all-reduce checked on each family.
//!
//! Run: `cargo run -p backend-gloo --example gloo_processes -- --world-size 4`
//!
//! Without `--rank`, the program is the launcher: it creates a fresh temporary directory, starts
//! itself once per rank (`--rank R --world-size N --store-dir DIR`), waits for every rank and
//! removes the directory. Each rank can also be started by hand, one process per rank, all
//! with the same world size and the same fresh, empty directory (for example on a shared file
//! system, adding `GlooConfig::with_hostname` for multi-host jobs):
//!
//! ```text
//! target/debug/examples/gloo_processes --rank 0 --world-size 2 --store-dir /tmp/gloo-job &
//! target/debug/examples/gloo_processes --rank 1 --world-size 2 --store-dir /tmp/gloo-job
//! ```
//!
//! The layout is tensor parallel 2 with data parallel filling the rest, so the world size must be
//! even. A rank that never arrives makes the others fail after the 30-second timeout instead of
//! hanging.

use backend_gloo::{GlooConfig, GlooFactory, Rendezvous};
use grid_core::{build_collection, CommunicatorExt, Family, LayoutConfig, LayoutPlan, ReduceOp};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const USAGE: &str =
    "usage: gloo_processes [--world-size N] [--rank R --store-dir DIR]  (N defaults to 4)";

/// The command line: one rank when `rank` is given, else the launcher.
struct Args {
    world_size: usize,
    rank: Option<usize>,
    store_dir: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        world_size: 4,
        rank: None,
        store_dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--world-size" => {
                let v = value()?;
                args.world_size = v
                    .parse()
                    .map_err(|_| format!("--world-size {v:?}: expected a positive even number"))?;
            }
            "--rank" => {
                let v = value()?;
                let r = v
                    .parse()
                    .map_err(|_| format!("--rank {v:?}: expected a rank number"))?;
                args.rank = Some(r);
            }
            "--store-dir" => args.store_dir = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.rank.is_some() && args.store_dir.is_none() {
        return Err(format!(
            "--rank needs --store-dir DIR (the directory the ranks meet in)\n{USAGE}"
        ));
    }
    Ok(args)
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|args| match (args.rank, &args.store_dir) {
        (Some(rank), Some(dir)) => run_rank(rank, args.world_size, dir),
        _ => launch(args.world_size, args.store_dir),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gloo_processes: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The launcher: one child process per rank, meeting in `dir` (a fresh temporary directory
/// when not given).
fn launch(world_size: usize, dir: Option<PathBuf>) -> Result<(), String> {
    // Validate the layout here first: a bad world size is one clear error, not one per rank.
    LayoutPlan::new(layout(world_size)).map_err(|e| e.to_string())?;
    let fresh = dir.is_none();
    let dir = match dir {
        Some(d) => d,
        None => {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let d =
                std::env::temp_dir().join(format!("gloo-example-{}-{nanos}", std::process::id()));
            std::fs::create_dir(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
            d
        }
    };
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own program: {e}"))?;
    println!(
        "starting {world_size} rank processes meeting in {}",
        dir.display()
    );
    let mut children = Vec::new();
    for rank in 0..world_size {
        let child = Command::new(&exe)
            .args(["--rank", &rank.to_string()])
            .args(["--world-size", &world_size.to_string()])
            .arg("--store-dir")
            .arg(&dir)
            .spawn()
            .map_err(|e| format!("cannot start rank {rank}: {e}"))?;
        children.push(child);
    }
    // Wait for every rank, even after a failure: a failed rank makes the others time out.
    let mut failed = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        match child.wait() {
            Ok(status) if status.success() => {}
            Ok(status) => failed.push(format!("rank {rank} exited with {status}")),
            Err(e) => failed.push(format!("rank {rank}: cannot wait for it: {e}")),
        }
    }
    if fresh {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            eprintln!("gloo_processes: cannot remove {}: {e}", dir.display());
        }
    }
    if failed.is_empty() {
        println!("all {world_size} rank processes succeeded");
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// The layout: tensor parallel 2, data parallel filling the rest of the world.
fn layout(world_size: usize) -> LayoutConfig {
    let mut config = LayoutConfig::new(world_size);
    config.tp = 2;
    config
}

/// One rank: meet the others, build every communicator of the layout, check an all-reduce in
/// each family.
fn run_rank(rank: usize, world_size: usize, dir: &std::path::Path) -> Result<(), String> {
    let e = |e: grid_core::Error| format!("rank {rank}: {e}");

    // 1. The rendezvous: a file store in `dir`. The job id namespaces the keys; every rank of
    //    the job must use the same one. The timeout bounds every wait.
    let config = GlooConfig::new("gloo-example").with_timeout(Duration::from_secs(30));
    let factory = GlooFactory::new(&Rendezvous::File(dir.to_path_buf()), config).map_err(e)?;
    // The world communicator: blocks until all `world_size` ranks have arrived.
    let world = factory.world(rank, world_size).map_err(e)?;

    // 2. The layout (pure arithmetic, the same on every rank) and this rank's communicators.
    let plan = LayoutPlan::new(layout(world_size)).map_err(e)?;
    let built = build_collection(&factory, &world, &plan).map_err(e)?;

    // 3. In every family this rank belongs to, all-reduce the world rank and compare with the
    //    sum of the group's members.
    let (mut checked, mut failures) = (0i64, 0i64);
    for fl in plan.family_levels() {
        if fl.family == Family::Hcp {
            continue; // hierarchical cp levels exist only with `hcp_sizes`
        }
        let (Some(comm), Some(group)) = (
            built.collection.get(fl.family.name()).map_err(e)?,
            plan.group_of(fl, rank).map_err(e)?,
        ) else {
            continue; // not a member
        };
        checked += 1;
        let mut sum = [0i64];
        comm.all_reduce_into(&[rank as i64][..], &mut sum[..], ReduceOp::Sum)
            .map_err(e)?;
        let expected: i64 = group.iter().map(|r| r as i64).sum();
        if sum[0] != expected {
            eprintln!("rank {rank}: {fl}: sum {}, expected {expected}", sum[0]);
            failures += 1;
        }
    }
    println!("rank {rank}: {checked} all-reduces checked, {failures} wrong");

    // 4. The job's verdict, the same on every rank.
    let mut total = [0i64; 2];
    world
        .all_reduce_into(&[checked, failures][..], &mut total[..], ReduceOp::Sum)
        .map_err(e)?;
    if total[1] > 0 {
        return Err(format!(
            "{} of {} checks failed over the job",
            total[1], total[0]
        ));
    }
    if rank == 0 {
        println!(
            "checked on {world_size} Gloo processes ({} families): {} all-reduces, each equal to \
             the sum of the members of the plan's group",
            plan.family_levels().len(),
            total[0]
        );
    }
    Ok(())
}
