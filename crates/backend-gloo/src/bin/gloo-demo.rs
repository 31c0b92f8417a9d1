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
use grid_core::{
    build_collection, Communicator, CommunicatorExt, Family, FamilyLevel, LayoutConfig, LayoutPlan,
    ProcessGroupCollection, ReduceOp,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WARMUP: usize = 3;
const ITERS: usize = 30;

fn config() -> LayoutConfig {
    let mut c = LayoutConfig::new(8);
    c.tp = 2;
    c.pp = 2;
    c.cp = 2;
    c.ep = 4;
    c.etp = Some(1);
    c
}

fn comm_of<G>(c: &ProcessGroupCollection<Arc<G>>, fl: FamilyLevel) -> Option<&G> {
    if fl.family == Family::Hcp {
        return c.hcp.as_ref().and_then(|v| v.get(fl.level)).map(|a| &**a);
    }
    c.get(fl.family.name()).ok().flatten().map(|a| &**a)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// One family level on one rank: (group size, created here, reused from, creation s, latency s).
type FamilyRow = (Option<usize>, usize, Option<FamilyLevel>, f64, f64);

/// What one rank measured.
struct RankResult {
    build_s: f64,
    created: usize,
    /// Per family level: (group size, created here, reused from, creation s, latency s).
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
        let mut rows = Vec::new();
        let mut failures = Vec::new();
        for fl in plan.family_levels() {
            let stat = built.stats.iter().find(|s| s.family == fl);
            let (size, created, reused, secs) = stat
                .map(|s| (s.group_size, s.created, s.reused_from, s.seconds))
                .unwrap_or((None, 0, None, 0.0));
            let group = plan.group_of(fl, me)?;
            let comm = comm_of(&built.collection, fl);
            let (Some(g), Some(c)) = (group.as_ref(), comm) else {
                if group.is_some() != comm.is_some() {
                    failures.push(format!(
                        "{fl}: group present {} but communicator present {}",
                        group.is_some(),
                        comm.is_some()
                    ));
                }
                rows.push((size, created, reused, secs, 0.0));
                continue;
            };
            let want: i64 = g.iter().map(|r| r as i64).sum();
            if c.global_ranks() != g.sorted().as_slice() {
                failures.push(format!(
                    "{fl}: global_ranks {:?} != plan group {:?}",
                    c.global_ranks(),
                    g.sorted()
                ));
            }
            let mut times = Vec::with_capacity(ITERS);
            for i in 0..WARMUP + ITERS {
                let mut out = [0i64];
                let t = Instant::now();
                c.all_reduce_into(&[me as i64], &mut out, ReduceOp::Sum)?;
                let dt = t.elapsed().as_secs_f64();
                if out[0] != want {
                    failures.push(format!("{fl}: all_reduce gave {}, expected {want}", out[0]));
                }
                if i >= WARMUP {
                    times.push(dt);
                }
            }
            rows.push((size, created, reused, secs, median(&mut times)));
        }
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

    let c = plan.config();
    let fls = plan.family_levels();
    println!(
        "Gloo demo: {n} ranks as threads of one process (Gloo over loopback TCP, rendezvous through {where_}; \
         chosen because it needs no MPI launcher)\nlayout: world {n}, tp {} pp {} cp {} dp {}, expert: ep {} etp {} edp {}, order {} ({} families)\n",
        c.tp,
        c.pp,
        c.cp,
        plan.dp(),
        c.ep,
        plan.expert_tp(),
        plan.expert_dp(),
        c.order,
        fls.len()
    );
    println!("| family | group size (rank 0) | comms created (all ranks) | reused from | create ms (max over ranks) | all-reduce µs (median, max over ranks) | check |");
    println!("|---|---:|---:|---|---:|---:|---|");
    let mut failed = 0;
    for (i, fl) in fls.iter().enumerate() {
        let (size, _, reused, _, _) = ranks[0].rows[i];
        let created: usize = ranks.iter().map(|r| r.rows[i].1).sum();
        let create_ms = ranks.iter().map(|r| r.rows[i].3).fold(0.0, f64::max) * 1e3;
        let lat_us = ranks.iter().map(|r| r.rows[i].4).fold(0.0, f64::max) * 1e6;
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
