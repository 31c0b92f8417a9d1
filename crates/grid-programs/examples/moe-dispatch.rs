//! `moe-dispatch`: Megatron-Core's MoE token dispatch over the expert-parallel groups of a
//! layout. Every rank routes its tokens (vectors of `--hidden` f32 values tagged with the source
//! rank and the token index) to random experts of its expert-parallel group (seeded, uneven
//! counts, one idle expert and one silent source per group), exchanges the counts with an
//! all-to-all, dispatches with `all_to_all_v`, lets each expert check and transform what it got,
//! combines with the reverse `all_to_all_v`, and checks that every token came back to its
//! source, in order, with the expected values. Prints one block per expert-parallel group; exits
//! 1 when a check failed, 2 on bad arguments. The logic is `grid_programs::moe`.
//!
//! Run: `cargo run -p grid-programs --example moe-dispatch` (8 ranks as threads over the
//! in-process backend; `--backend gloo` runs them as threads over Gloo, `--backend mpi`
//! re-launches itself under mpirun with `--world` ranks).
//!
//! Options: `--world N` (8), `--tp N` (1), `--pp N` (1), `--ep N` (4), `--etp N` (tp),
//! `--tokens N` (mean tokens per rank, 6), `--hidden N` (8), `--seed N` (7), `--nonblocking`
//! (`iall_to_all_v` instead of `all_to_all_v`), `--backend local|gloo|mpi` (local).

use backend_gloo::{run_ranks, GlooConfig};
use backend_local::LocalConfig;
use backend_mpi::{testing, MpiFactory, MpiRuntime};
use grid_core::{Communicator, LayoutPlan};
use grid_programs::moe::{describe, run_rank, summary, MoeConfig, RankOutcome};
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "usage: moe-dispatch [--backend local|gloo|mpi] [--world N] [--tp N] [--pp N] [--ep N] [--etp N] [--tokens N] [--hidden N] [--seed N] [--nonblocking]";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Local,
    Gloo,
    Mpi,
}

fn parse(args: &[String]) -> Result<(MoeConfig, Backend), String> {
    let mut cfg = MoeConfig::default();
    let mut backend = Backend::Local;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--nonblocking" {
            cfg.nonblocking = true;
            continue;
        }
        let Some(value) = it.next() else {
            return Err(format!("{a} needs a value; {USAGE}"));
        };
        let number = |what: &str| -> Result<u64, String> {
            value
                .parse::<u64>()
                .map_err(|_| format!("{what} {value:?}: expected a non-negative integer"))
        };
        let size = |what: &str| -> Result<usize, String> {
            usize::try_from(number(what)?).map_err(|_| format!("{what} {value}: too large"))
        };
        match a.as_str() {
            "--backend" => {
                backend = match value.as_str() {
                    "local" => Backend::Local,
                    "gloo" => Backend::Gloo,
                    "mpi" => Backend::Mpi,
                    other => {
                        return Err(format!("--backend {other:?}: expected local, gloo or mpi"))
                    }
                }
            }
            "--world" => cfg.world = size(a)?,
            "--tp" => cfg.tp = size(a)?,
            "--pp" => cfg.pp = size(a)?,
            "--ep" => cfg.ep = size(a)?,
            "--etp" => cfg.etp = Some(size(a)?),
            "--tokens" => cfg.tokens = size(a)?,
            "--hidden" => cfg.hidden = size(a)?,
            "--seed" => cfg.seed = number(a)?,
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    cfg.validate().map_err(|e| e.to_string())?;
    LayoutPlan::new(cfg.layout()).map_err(|e| format!("the layout is invalid: {e}"))?;
    Ok((cfg, backend))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let (cfg, backend) = match parse(&args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("moe-dispatch: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match backend {
        Backend::Local => {
            let config = LocalConfig {
                timeout: Duration::from_secs(60),
                rendezvous: false,
            };
            backend_local::run(cfg.world, &config, |factory, world| {
                Ok(run_rank(factory, &world, &cfg))
            })
            .map_err(|e| e.to_string())
            .and_then(|results| threads(&cfg, "local", results))
        }
        Backend::Gloo => {
            let job = format!("moe-dispatch-{}", std::process::id());
            let gcfg = GlooConfig::new(job).with_timeout(Duration::from_secs(60));
            run_ranks(cfg.world, &gcfg, |factory, world| {
                Ok(run_rank(factory, &world, &cfg))
            })
            .map_err(|e| e.to_string())
            .and_then(|results| {
                let results = results.into_iter().map(|r| r.and_then(|x| x)).collect();
                threads(&cfg, "gloo", results)
            })
        }
        Backend::Mpi if !testing::under_launcher() => return self_launch(&cfg, &args),
        Backend::Mpi => under_mpi(&cfg),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("moe-dispatch: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ranks as threads of this process: prints the summary from rank 0's copy of every report and
/// each rank's problems.
fn threads(
    cfg: &MoeConfig,
    backend: &str,
    results: Vec<grid_core::Result<RankOutcome>>,
) -> Result<bool, String> {
    let mut outcomes = Vec::with_capacity(results.len());
    for (r, res) in results.into_iter().enumerate() {
        outcomes.push(res.map_err(|e| format!("rank {r}: {e}"))?);
    }
    let plan = LayoutPlan::new(cfg.layout()).map_err(|e| e.to_string())?;
    println!(
        "{} ({backend} backend, {} ranks as threads)",
        describe(cfg, &plan),
        cfg.world
    );
    for o in &outcomes {
        for p in &o.problems {
            eprintln!("rank {}: {p}", o.report.rank);
        }
    }
    let all = outcomes.first().map(|o| o.all.clone()).unwrap_or_default();
    let (lines, ok) = summary(cfg, &all);
    for l in lines {
        println!("{l}");
    }
    Ok(ok)
}

/// One MPI process: runs the dispatch; world rank 0 prints the summary.
fn under_mpi(cfg: &MoeConfig) -> Result<bool, String> {
    let rt = MpiRuntime::init().map_err(|e| e.to_string())?;
    let world = rt.world();
    let out = run_rank(&MpiFactory::new(), world, cfg)
        .map_err(|e| format!("world rank {}: {e}", world.rank()))?;
    for p in &out.problems {
        eprintln!("rank {}: {p}", out.report.rank);
    }
    let (lines, ok) = summary(cfg, &out.all);
    if world.rank() == 0 {
        let plan = LayoutPlan::new(cfg.layout()).map_err(|e| e.to_string())?;
        println!(
            "{} (mpi backend, {} processes)",
            describe(cfg, &plan),
            cfg.world
        );
        for l in lines {
            println!("{l}");
        }
    }
    Ok(ok)
}

/// Re-launches this program under mpirun with `--world` processes and the same arguments.
fn self_launch(cfg: &MoeConfig, args: &[String]) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => {
            eprintln!("moe-dispatch: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match testing::launch(cfg.world, 300, &exe, &args) {
        Ok(out) => {
            print!("{}", out.output.replace("\n--- stderr ---\n", ""));
            if out.code == Some(0) {
                ExitCode::SUCCESS
            } else {
                eprintln!("moe-dispatch: mpirun exited with {:?}", out.code);
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("moe-dispatch: {e}");
            ExitCode::FAILURE
        }
    }
}
