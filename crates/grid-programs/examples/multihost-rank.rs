//! `multihost-rank`: one rank of a multi-host check, one process per rank, on MPI or Gloo. It is
//! what `cargo xtask hosts run` starts in every test host (network namespace); it works the same
//! on real hosts.
//!
//! ```text
//! cargo build --examples -p grid-programs
//! mpirun -np 8 --hostfile HOSTS target/debug/examples/multihost-rank --backend mpi --check conformance|collection|pipeline
//! RANK=R WORLD_SIZE=N GRID_GLOO_STORE=redis://HOST:PORT|file:DIR GRID_GLOO_JOB_ID=JOB \
//!     GRID_GLOO_HOSTNAME=THIS_HOSTS_ADDRESS [GRID_GLOO_TIMEOUT_MS=T] \
//!     target/debug/examples/multihost-rank --backend gloo --check conformance|collection|pipeline
//! ```
//!
//! The checks, each on every rank:
//! * `conformance`: the backend-neutral conformance suite (`grid_conformance::run_with`: every
//!   operation, dtype and reduction with exact values, sub-groups, `build_collection` on the
//!   suite's layouts, the error cases, the lifecycle);
//! * `conformance-quick`: the same suite with the per-dtype sweeps on the world communicator
//!   only (`Options::quick_subgroups`: the sub-groups are still created and checked, without
//!   repeating every dtype and reduction on each);
//! * `collection`: `build_collection` of the demos' 8-rank layout (`grid_programs::demo::config`),
//!   then an all-reduce on every family, each result and each group's members checked;
//! * `pipeline`: the multi-module pipeline of `multimodule-demo` (image encoder dp 2 and audio
//!   encoder feeding an LLM tp 2 pp 2 feeding a generator, 8 ranks): two micro-batches forward
//!   and backward, every row that arrives checked against its sender;
//! * `loop`: the loop of `gloo-loop` and `mpi-loop` (`grid_programs::smoke::run_loop`, with
//!   their options `--bytes`, `--seconds` or `--iters`, `--timeout-ms`, every operation limited
//!   to the timeout, nonblocking waits on MPI): 3 all-reduces first, then the line
//!   `{"rank":R,"host":"H","check":"loop","looping":true}`, then the loop. The cut-host test
//!   takes a host's link down once every rank has printed it.
//!
//! Each rank prints exactly one line when it ends, `{"rank":R,"host":"H","check":"C","ok":true,
//! "detail":"..."}` (`"ok":false` with the error as the detail), and exits 0 only when its check
//! passed (1 otherwise, 2 with one line on standard error for invalid options). The `loop`
//! check adds `"completed":K`, the all-reduces done and checked. `H` is the
//! kernel's host name (`/proc/sys/kernel/hostname`), so a run shows where each rank ran.
//! Under MPI a failed rank calls `MPI_Abort` after printing its line, so no other rank waits;
//! except in the `loop` check, where it exits with 1 without `MPI_Finalize`, as `mpi-loop` does
//! (mpirun then ends the job).

use backend_gloo::init_from_env;
use backend_mpi::{MpiCommunicator, MpiFactory, MpiRuntime};
use grid_core::{build_collection, Communicator, GroupFactory, LayoutPlan, TimeLimit};
use grid_programs::demo::{all_reduce_every_family, config};
use grid_programs::pipeline_demo::{self, rows, sample_tensor, MICROBATCHES, SPEC};
use grid_programs::smoke::{run_loop, LoopOptions, Stop, Waits};
use multimodule::{
    Activation, ModuleInputs, MultiModulePipelineCommunicator, OrderedMap, PipelinePlan,
    PipelineSpec,
};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

const USAGE: &str = "usage: multihost-rank --backend mpi|gloo --check conformance|conformance-quick|collection|pipeline|loop [--bytes B] [--iters K | --seconds S] [--timeout-ms T]";

/// What a rank checks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Check {
    Conformance,
    ConformanceQuick,
    Collection,
    Pipeline,
    Loop,
}

impl Check {
    fn name(self) -> &'static str {
        match self {
            Check::Conformance => "conformance",
            Check::ConformanceQuick => "conformance-quick",
            Check::Collection => "collection",
            Check::Pipeline => "pipeline",
            Check::Loop => "loop",
        }
    }
}

/// The command line: backend, check, and the loop's options.
type Args = (String, Check, LoopOptions);

fn parse_args() -> Result<Args, String> {
    let (mut backend, mut check) = (None, None);
    let mut options = LoopOptions::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.to_string());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {USAGE}"))?;
        if options.flag(&flag, &value)? {
            if flag == "--fault" {
                return Err(
                    "--fault is not an option of multihost-rank (use gloo-loop or mpi-loop)".into(),
                );
            }
            continue;
        }
        match flag.as_str() {
            "--backend" => match value.as_str() {
                "mpi" | "gloo" => backend = Some(value),
                other => return Err(format!("--backend {other:?}: expected mpi or gloo")),
            },
            "--check" => {
                check = Some(match value.as_str() {
                    "conformance" => Check::Conformance,
                    "conformance-quick" => Check::ConformanceQuick,
                    "collection" => Check::Collection,
                    "pipeline" => Check::Pipeline,
                    "loop" => Check::Loop,
                    other => {
                        return Err(format!(
                            "--check {other:?}: expected conformance, conformance-quick, collection, pipeline or loop"
                        ))
                    }
                })
            }
            other => return Err(format!("unknown option {other:?}; {USAGE}")),
        }
    }
    options.check()?;
    match (backend, check) {
        (Some(b), Some(c)) => Ok((b, c, options)),
        _ => Err(format!("--backend and --check are required; {USAGE}")),
    }
}

/// The kernel's host name (each test host has its own UTS namespace).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".to_string())
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn report(
    rank: Option<usize>,
    check: Check,
    result: &Result<String, String>,
    completed: Option<u64>,
) {
    let (ok, detail) = match result {
        Ok(d) => (true, d.as_str()),
        Err(e) => (false, e.as_str()),
    };
    println!(
        "{{\"rank\":{},\"host\":{},\"check\":\"{}\",\"ok\":{ok},{}\"detail\":{}}}",
        rank.map_or("null".to_string(), |r| r.to_string()),
        json_str(&host_name()),
        check.name(),
        completed.map_or(String::new(), |k| format!("\"completed\":{k},")),
        json_str(detail)
    );
    // Once one rank exits, mpirun may end the others at any moment: the line goes out first.
    let _ = std::io::stdout().flush();
}

fn main() -> ExitCode {
    let (backend, check, options) = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("multihost-rank: {e}");
            return ExitCode::from(2);
        }
    };
    if backend == "mpi" {
        let rt = match MpiRuntime::init() {
            Ok(rt) => rt,
            Err(e) => {
                let rank = std::env::var("OMPI_COMM_WORLD_RANK")
                    .ok()
                    .and_then(|r| r.parse().ok());
                report(rank, check, &Err(format!("MPI initialisation: {e}")), None);
                return ExitCode::FAILURE;
            }
        };
        let factory = MpiFactory::new();
        let world = rt.world();
        let rank = world.rank();
        let mut completed = 0u64;
        let result = factory
            .split(world, Some(0), rank)
            .map_err(|e| e.to_string())
            .and_then(|w| w.ok_or_else(|| "the split of the world returned nothing".to_string()))
            .and_then(|w| {
                // MPI communicators can be finished; the suite checks calls after it.
                let finish: grid_conformance::FinishFn<MpiCommunicator> =
                    Box::new(|c: &MpiCommunicator| c.finish());
                run_check(
                    &factory,
                    Arc::new(w),
                    check,
                    Some(finish),
                    &options,
                    Waits::Nonblocking,
                    &mut completed,
                )
            });
        report(
            Some(rank),
            check,
            &result,
            (check == Check::Loop).then_some(completed),
        );
        if result.is_err() {
            if check == Check::Loop {
                // As mpi-loop: not MPI_Finalize (it would wait for the operation that never
                // finished); mpirun ends the job.
                let _ = std::io::stderr().flush();
                std::process::exit(1);
            }
            // Let the others print their lines, then end the job: nobody waits for this rank.
            std::thread::sleep(std::time::Duration::from_millis(300));
            rt.abort(1);
            return ExitCode::FAILURE;
        }
        drop(rt);
        ExitCode::SUCCESS
    } else {
        let (factory, world) = match init_from_env() {
            Ok(fw) => fw,
            Err(e) => {
                let rank = std::env::var("RANK").ok().and_then(|r| r.parse().ok());
                report(rank, check, &Err(format!("Gloo initialisation: {e}")), None);
                return ExitCode::FAILURE;
            }
        };
        let rank = world.rank();
        let mut completed = 0u64;
        let result = run_check(
            &factory,
            Arc::new(world),
            check,
            None,
            &options,
            Waits::Blocking,
            &mut completed,
        );
        report(
            Some(rank),
            check,
            &result,
            (check == Check::Loop).then_some(completed),
        );
        if result.is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// Runs `check` on this rank; the detail on success, the error otherwise.
fn run_check<F: GroupFactory>(
    factory: &F,
    world: Arc<F::Comm>,
    check: Check,
    finish: Option<grid_conformance::FinishFn<F::Comm>>,
    options: &LoopOptions,
    waits: Waits,
    completed: &mut u64,
) -> Result<String, String> {
    let me = world.rank();
    match check {
        Check::Conformance | Check::ConformanceQuick => {
            let opts = grid_conformance::Options {
                finish,
                quick_subgroups: check == Check::ConformanceQuick,
                ..Default::default()
            };
            let report =
                grid_conformance::run_with(factory, &world, &opts).map_err(|f| f.to_string())?;
            if report.passed() == 0 {
                return Err("the conformance suite ran no check".to_string());
            }
            Ok(format!(
                "{} ranks: {} checks passed, {} skipped",
                world.size(),
                report.passed(),
                report.skipped().len()
            ))
        }
        Check::Collection => {
            let plan = LayoutPlan::new(config()).map_err(|e| e.to_string())?;
            let built = build_collection(factory, &*world, &plan).map_err(|e| e.to_string())?;
            let created: usize = built.stats.iter().map(|s| s.created).sum();
            let (rows, failures) =
                all_reduce_every_family(&plan, &built, me).map_err(|e| e.to_string())?;
            if !failures.is_empty() {
                return Err(failures.join("; "));
            }
            let member = rows.iter().filter(|r| r.group_size.is_some()).count();
            Ok(format!(
                "build_collection: {created} communicators created, member of {member} of {} family levels, every all-reduce checked",
                rows.len()
            ))
        }
        Check::Pipeline => pipeline(factory, world),
        Check::Loop => {
            world.set_time_limit(TimeLimit::After(options.timeout()));
            let mut warm = options.clone();
            warm.stop = Stop::Iters(3);
            run_loop(&*world, &warm, waits, completed).map_err(|e| e.to_string())?;
            println!(
                "{{\"rank\":{me},\"host\":{},\"check\":\"loop\",\"looping\":true}}",
                json_str(&host_name())
            );
            let _ = std::io::stdout().flush();
            let mut more = 0u64;
            let r = run_loop(&*world, options, waits, &mut more);
            *completed += more;
            r.map_err(|e| e.to_string())?;
            Ok(format!("{completed} all-reduces checked"))
        }
    }
}

// ------------------------------------------------------------------------------------------
// The multi-module pipeline: the spec and the row checks of `multimodule-demo`.
// ------------------------------------------------------------------------------------------

fn negate(t: &Activation) -> Result<Activation, String> {
    pipeline_demo::scale(t, -1.0)
}

fn pipeline<F: GroupFactory>(factory: &F, world: Arc<F::Comm>) -> Result<String, String> {
    let spec = PipelineSpec::from_json_str(SPEC).map_err(|e| e.to_string())?;
    let plan = PipelinePlan::new(&spec).map_err(|e| e.to_string())?;
    if world.size() != 8 {
        return Err(format!(
            "the pipeline needs 8 ranks, the job has {}",
            world.size()
        ));
    }
    let mm = MultiModulePipelineCommunicator::new(factory, world, &plan, 0)
        .map_err(|e| e.to_string())?;
    let me = mm.rank();
    let module = mm.modules()[0].name.clone();
    let e = |e: multimodule::Error| e.to_string();
    let mut kept: Vec<ModuleInputs> = Vec::new();
    let mut crossings = 0usize;
    let mut checked = Vec::new();
    for mb in 0..MICROBATCHES {
        let inputs = mm.recv_forward(&module).map_err(e)?;
        let out = match module.as_str() {
            "image_encoder" => sample_tensor(mb, me, 2)?,
            "audio_encoder" => sample_tensor(mb, 5, 4)?,
            "llm" if me < 5 => {
                let i = inputs.get("image_encoder").ok_or("no image input")?;
                let a = inputs.get("audio_encoder").ok_or("no audio input")?;
                let want_i: Vec<i64> = (0..4)
                    .map(|b| (mb * 10000 + (b / 2) * 1000 + b % 2) as i64)
                    .collect();
                let want_a: Vec<i64> = (0..4).map(|b| (mb * 10000 + 5000 + b) as i64).collect();
                if rows(i) != want_i || rows(a) != want_a {
                    return Err(format!(
                        "llm stage 0 on rank {me}, micro-batch {mb}: image rows {:?} (expected {want_i:?}), audio rows {:?} (expected {want_a:?})",
                        rows(i),
                        rows(a)
                    ));
                }
                checked.push(format!("mb{mb} image {:?} audio {:?}", rows(i), rows(a)));
                i.clone()
            }
            _ => inputs
                .iter()
                .next()
                .map(|(_, t)| t.clone())
                .ok_or("no input")?,
        };
        mm.send_forward(&module, &out).map_err(e)?;
        kept.push(inputs);
    }
    for (mb, inputs) in kept.iter().enumerate() {
        let g = mm.recv_backward(&module).map_err(e)?;
        let mut grads = OrderedMap::new();
        for (k, t) in inputs.iter() {
            let grad = match &g {
                Some(g) if g.shape() == t.shape() => g.clone(),
                _ => negate(t)?,
            };
            grads.push(k, grad);
        }
        if let (Some(g), true) = (&g, module.ends_with("encoder")) {
            // The generator sends back -x of what it got (the LLM's output, its image input);
            // the LLM passes that gradient to each input of the same shape.
            let want: Vec<i64> = match module.as_str() {
                "image_encoder" => (0..2)
                    .map(|b| -((mb * 10000 + me * 1000 + b) as i64))
                    .collect(),
                // The LLM's output is its image input, so both inputs get that gradient.
                _ => (0..4)
                    .map(|b| -((mb * 10000 + (b / 2) * 1000 + b % 2) as i64))
                    .collect(),
            };
            if rows(g) != want {
                return Err(format!(
                    "{module} on rank {me}, micro-batch {mb}: gradient rows {:?}, expected {want:?}",
                    rows(g)
                ));
            }
            checked.push(format!("mb{mb} gradient {:?}", rows(g)));
        }
        mm.send_backward(&module, &grads).map_err(e)?;
    }
    for b in mm.bridges() {
        crossings += b.take_crossings().len();
    }
    Ok(format!(
        "{module}: {MICROBATCHES} micro-batches forward and backward, {crossings} bridge crossings{}{}",
        if checked.is_empty() { "" } else { ", checked: " },
        checked.join(", ")
    ))
}
