//! `gloo-demo`: the layout demo without MPI. Runs 8 ranks as threads of this process (Gloo over
//! loopback TCP, meeting through the in-process store), builds every communicator of a realistic
//! layout with `grid_core::build_collection`, runs an all-reduce on every family, checks the
//! results and prints a table.
//!
//! Layout: world 8, tp 2, pp 2, cp 2 (dp 1), experts with ep 4 and expert tp 1, order
//! tp-cp-ep-dp-pp (the same as `mpi-demo`).
//!
//! Usage: `gloo-demo [--store file:<dir>|redis://host:port]` (default: in-process store).

use backend_gloo::{run_ranks_with, GlooConfig, Rendezvous};
use grid_core::{build_collection, Communicator, LayoutPlan};
use grid_programs::demo::{all_reduce_every_family, config, describe, FamilyRow};
use grid_programs::table::header;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// What one rank measured.
struct RankResult {
    build_s: f64,
    created: usize,
    /// Per family level, in the plan's order.
    rows: Vec<FamilyRow>,
    failures: Vec<String>,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut store = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--store" => match it.next().map(|s| Rendezvous::parse(s)) {
                Some(Ok(r)) => store = Some(r),
                Some(Err(e)) => {
                    eprintln!("gloo-demo: {e}");
                    return ExitCode::from(2);
                }
                None => {
                    eprintln!(
                        "gloo-demo: --store needs a location (file:<dir> or redis://host:port)"
                    );
                    return ExitCode::from(2);
                }
            },
            "-h" | "--help" => {
                println!("usage: gloo-demo [--store file:<dir>|redis://host:port]");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!(
                    "gloo-demo: unknown argument '{other}' (usage: gloo-demo [--store LOCATION])"
                );
                return ExitCode::from(2);
            }
        }
    }
    match run(store) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gloo-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(store: Option<Rendezvous>) -> Result<(), String> {
    let e = |e: grid_core::Error| e.to_string();
    let cfg = config();
    let n = cfg.world_size;
    let plan = LayoutPlan::new(cfg).map_err(e)?;
    let (store, where_) = match store {
        Some(s) => {
            let w = format!("{s:?}");
            (s, w)
        }
        None => (
            Rendezvous::in_process().map_err(e)?,
            "the in-process store".to_string(),
        ),
    };
    let job = format!(
        "gloo-demo-{}-{}",
        std::process::id(),
        Instant::now().elapsed().subsec_nanos()
    );
    let gcfg = GlooConfig::new(job).with_timeout(Duration::from_secs(60));
    let t_all = Instant::now();
    let results = run_ranks_with(&store, n, &gcfg, |factory, world| {
        let me = world.rank();
        world.barrier()?;
        let t0 = Instant::now();
        let built = build_collection(factory, &world, &plan)?;
        let build_s = t0.elapsed().as_secs_f64();
        let (rows, failures) = all_reduce_every_family(&plan, &built, me)?;
        world.barrier()?;
        Ok(RankResult {
            build_s,
            created: built.communicators_created(),
            rows,
            failures,
        })
    })
    .map_err(e)?;
    let total_s = t_all.elapsed().as_secs_f64();
    let mut ranks = Vec::with_capacity(n);
    for (r, res) in results.into_iter().enumerate() {
        ranks.push(res.map_err(|err| format!("rank {r}: {err}"))?);
    }

    let fls = plan.family_levels();
    println!(
        "Gloo demo: {n} ranks as threads of one process (Gloo over loopback TCP, rendezvous through {where_}; \
         chosen because it needs no MPI launcher)\nlayout: {}\n",
        describe(&plan)
    );
    println!(
        "{}",
        header(&[
            "family",
            ">group size (rank 0)",
            ">comms created (all ranks)",
            "reused from",
            ">create ms (max over ranks)",
            ">all-reduce µs (median, max over ranks)",
            "check",
        ])
    );
    let mut failed = 0;
    for (i, fl) in fls.iter().enumerate() {
        let (size, reused) = (ranks[0].rows[i].group_size, ranks[0].rows[i].reused_from);
        let created: usize = ranks.iter().map(|r| r.rows[i].created).sum();
        let create_ms = ranks.iter().map(|r| r.rows[i].create_s).fold(0.0, f64::max) * 1e3;
        let lat_us = ranks
            .iter()
            .map(|r| r.rows[i].latency_s)
            .fold(0.0, f64::max)
            * 1e6;
        let bad = ranks
            .iter()
            .flat_map(|r| &r.failures)
            .filter(|f| f.starts_with(&format!("{fl}:")))
            .count();
        failed += bad;
        println!(
            "| {fl} | {} | {created} | {} | {create_ms:.1} | {lat_us:.1} | {} |",
            size.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            reused.map(|r| r.to_string()).unwrap_or_else(|| "-".into()),
            if bad == 0 { "ok" } else { "FAILED" }
        );
    }
    let build_max = ranks.iter().map(|r| r.build_s).fold(0.0, f64::max);
    let comms: usize = ranks.iter().map(|r| r.created).sum();
    println!(
        "\ncommunicators created: {comms} over {n} ranks ({} on rank 0); build_collection {:.3} s (max over ranks); whole run {total_s:.3} s",
        ranks[0].created, build_max
    );
    for r in &ranks {
        for f in &r.failures {
            eprintln!("{f}");
        }
    }
    if failed > 0 {
        return Err(format!("{failed} checks failed"));
    }
    println!(
        "all {} families checked: every all-reduce matched the plan's groups",
        fls.len()
    );
    Ok(())
}
