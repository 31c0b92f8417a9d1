//! `cargo xtask bench layout`: the topology benchmarks of issue 2 §5, printed as Markdown.
//!
//! * one rank's complete view (every family) at world 1,048,576 (tp 8, cp 2, pp 16, ep 8):
//!   library time, and the whole `grid layout --rank R --format json` process;
//! * every family of that world (library time);
//! * the per-rank view's memory at 1k, 16k, 128k and 1M ranks (heap bytes, process max RSS);
//! * the per-token rows of `docs/performance.md` § "Megatron-Core reference timings"
//!   (Megatron-Core's Python), side by side.
//!
//! Every figure is the median of several runs. Run with `--quick` for a fast smoke run.

use grid_core::{GeneratorSizes, GroupList, HyperGrid, LayoutConfig, LayoutPlan, RankGenerator};
use grid_programs::stats::{load_average_1min, median, timed_median};
use grid_programs::table::{duration_label, thousands};
use std::collections::HashMap;
use std::hint::black_box;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Counts heap bytes so that the per-rank view's memory can be reported exactly.
mod counting_alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    pub struct Counting;
    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    static TOTAL: AtomicUsize = AtomicUsize::new(0);

    // SAFETY: every method forwards to the system allocator with the caller's arguments
    // unchanged, so System's guarantees hold; the counters are plain atomics and never touch
    // the memory.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            // SAFETY: same layout as the caller gave us (GlobalAlloc contract passed through).
            let p = unsafe { System.alloc(l) };
            if !p.is_null() {
                let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
                PEAK.fetch_max(live, Relaxed);
                TOTAL.fetch_add(l.size(), Relaxed);
            }
            p
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: `p` was allocated by `alloc` above with this layout.
            unsafe { System.dealloc(p, l) };
            LIVE.fetch_sub(l.size(), Relaxed);
        }
    }

    /// Starts a measurement: returns the live bytes now and resets the peak to them.
    pub fn start() -> (usize, usize) {
        let live = LIVE.load(Relaxed);
        PEAK.store(live, Relaxed);
        (live, TOTAL.load(Relaxed))
    }

    /// (peak live bytes above the start, bytes allocated since the start).
    pub fn since(start: (usize, usize)) -> (usize, usize) {
        (
            PEAK.load(Relaxed).saturating_sub(start.0),
            TOTAL.load(Relaxed) - start.1,
        )
    }

    /// Runs a child process to completion and returns (exit code, max RSS in KiB).
    pub fn wait_child(child: std::process::Child) -> (i32, i64) {
        let pid = child.id() as libc::pid_t;
        let mut status: libc::c_int = 0;
        // SAFETY: `rusage` is plain old data, zero is a valid bit pattern for it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our own un-waited child; `status` and `usage` are valid, exclusive
        // pointers for the duration of the call. std's Child does not wait on drop.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r != pid {
            return (-1, 0);
        }
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            -1
        };
        (code, usage.ru_maxrss)
    }
}

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

const WORLDS: [usize; 4] = [1 << 10, 1 << 14, 1 << 17, 1 << 20];
const TP: usize = 8;
const CP: usize = 2;
const PP: usize = 16;
const EP: usize = 8;

fn plan(world: usize) -> LayoutPlan {
    let cfg = LayoutConfig {
        tp: TP,
        cp: CP,
        pp: PP,
        ep: EP,
        ..LayoutConfig::new(world)
    };
    match LayoutPlan::new(cfg) {
        Ok(p) => p,
        Err(e) => panic!("benchmark layout of {world} ranks is invalid: {e}"),
    }
}

/// One rank's view: median per call over `calls` ranks spread over the world, `batches` times.
fn view_time(p: &LayoutPlan, batches: usize, calls: usize) -> Duration {
    let w = p.world_size();
    let step = (w / calls).max(1) | 1;
    let per_batch: Vec<Duration> = (0..batches)
        .map(|b| {
            let t = Instant::now();
            for i in 0..calls {
                let rank = (b * 7919 + i * step) % w;
                black_box(p.rank_view(rank).map(|v| v.pp_next).unwrap_or(0));
            }
            t.elapsed() / calls as u32
        })
        .collect();
    median(&per_batch).unwrap_or(Duration::ZERO)
}

fn grid_args(world: usize, rank: usize) -> Vec<String> {
    [
        "layout",
        "--world-size",
        &world.to_string(),
        "--tp",
        "8",
        "--cp",
        "2",
        "--pp",
        "16",
        "--ep",
        "8",
        "--rank",
        &rank.to_string(),
        "--format",
        "json",
    ]
    .map(String::from)
    .to_vec()
}

/// The whole `grid` process: (median wall time, max RSS in KiB, bytes of output).
fn process(args: &[String], runs: usize) -> (Duration, i64, usize) {
    let exe = env!("CARGO_BIN_EXE_grid");
    let bytes = Command::new(exe)
        .args(args)
        .output()
        .map(|o| {
            assert!(
                o.status.success(),
                "grid {args:?} failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            o.stdout.len()
        })
        .unwrap_or(0);
    let mut times = Vec::new();
    let mut rss = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let child = match Command::new(exe).args(args).stdout(Stdio::null()).spawn() {
            Ok(c) => c,
            Err(e) => panic!("cannot start {exe}: {e}"),
        };
        let (code, maxrss) = counting_alloc::wait_child(child);
        times.push(t.elapsed());
        assert_eq!(code, 0, "grid {args:?} exited {code}");
        rss = rss.max(maxrss);
    }
    (median(&times).unwrap_or(Duration::ZERO), rss, bytes)
}

/// The heading of the section of `docs/performance.md` that holds Megatron-Core's figures.
const MEGATRON_SECTION: &str = "## Megatron-Core reference timings";

/// Megatron's figures: (world, row key) -> (seconds, max RSS MB), both as printed.
type MegatronFigures = HashMap<(usize, String), (String, String)>;

/// Megatron's figures from `docs/performance.md` § "Megatron-Core reference timings":
/// (world, row key) -> (seconds, max RSS MB). Only the rows of that section are read. A missing
/// file, section or table is an error naming the file: the figures are part of the repository.
fn megatron_figures() -> Result<MegatronFigures, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/performance.md");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read Megatron's reference timings {}: {e}",
            path.display()
        )
    })?;
    let Some(start) = text.find(MEGATRON_SECTION) else {
        return Err(format!(
            "{} has no section \"{MEGATRON_SECTION}\" (Megatron's reference timings)",
            path.display()
        ));
    };
    let section = &text[start + MEGATRON_SECTION.len()..];
    let section = section.find("\n## ").map_or(section, |end| &section[..end]);
    let mut out = HashMap::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 6 {
            continue;
        }
        let Ok(world) = cells[1].replace(',', "").parse::<usize>() else {
            continue;
        };
        let t = cells[2];
        let key = if t.contains("_gen_rank_enum") {
            "hcg_raw"
        } else if t.contains("get_rank_enum") {
            "hcg_enum"
        } else if t.starts_with("initialize_model_parallel") {
            "init"
        } else if t.starts_with("ep") {
            "ep"
        } else {
            t
        };
        out.insert(
            (world, key.to_string()),
            (cells[3].to_string(), cells[5].to_string()),
        );
    }
    if out.is_empty() {
        return Err(format!(
            "the section \"{MEGATRON_SECTION}\" of {} has no table rows \
             (| world | grouping | seconds | #groups x size | max RSS MB |)",
            path.display()
        ));
    }
    Ok(out)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // Read Megatron's figures first, so that a broken docs/performance.md fails at once.
    let mega = match megatron_figures() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let runs = |world: usize| -> usize {
        match (quick, world) {
            (true, _) => 3,
            (false, w) if w <= 1 << 14 => 11,
            _ => 5,
        }
    };
    let one = match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
        Ok(p) => p,
        Err(e) => panic!("cannot build a 1-thread pool: {e}"),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load_before = load_average_1min().unwrap_or_else(|| "unknown".into());
    eprintln!("benchmarking (medians; {cores} cores; quick = {quick}) ...");

    // ---- 1. one rank's view, memory, and the grid process, per world size -------------------
    let mut view_rows = Vec::new();
    let mut view_1m = Duration::ZERO;
    let mut proc_1m = Duration::ZERO;
    for &w in &WORLDS {
        let build = timed_median(runs(w), || plan(w));
        let p = plan(w);
        let vt = view_time(
            &p,
            if quick { 3 } else { 11 },
            if quick { 200 } else { 2000 },
        );
        // Memory of one view: warm up once, then measure a rank in the middle.
        let _ = p.rank_view(w / 2 + 3);
        let m = counting_alloc::start();
        let v = p.rank_view(w / 2 + 3);
        let (peak, total) = counting_alloc::since(m);
        let held = std::mem::size_of_val(&v);
        drop(v);
        let (pt, rss, bytes) = process(&grid_args(w, w / 2 + 3), if quick { 5 } else { 31 });
        if w == 1 << 20 {
            view_1m = vt;
            proc_1m = pt;
        }
        view_rows.push(format!(
            "| {} | {} | {} | {} B (peak {} B, struct {} B) | {} | {:.1} MB | {} |",
            thousands(w),
            duration_label(build),
            duration_label(vt),
            thousands(total),
            thousands(peak),
            held,
            duration_label(pt),
            rss as f64 / 1024.0,
            thousands(bytes),
        ));
    }

    // ---- 2. every family of the 1M world ------------------------------------------------------
    let p = plan(1 << 20);
    let all_runs = if quick { 1 } else { 5 };
    let all_2 = timed_median(all_runs, || p.all_groups().map(|v| v.len()).unwrap_or(0));
    let all_1 =
        one.install(|| timed_median(all_runs, || p.all_groups().map(|v| v.len()).unwrap_or(0)));
    let members: usize = p
        .all_groups()
        .map(|v| v.iter().map(|(_, g)| g.total_members()).sum())
        .unwrap_or(0);
    let (full_proc, full_rss, full_bytes) = {
        let mut a = grid_args(1 << 20, 0);
        a.truncate(a.len() - 4);
        a.extend(["--format".into(), "json".into()]);
        process(&a, if quick { 1 } else { 3 })
    };

    // ---- 3. the per-token rows of docs/performance.md (Megatron-Core reference timings) -----
    let mut token_rows = Vec::new();
    for &w in &WORLDS {
        let n = runs(w);
        let dense = RankGenerator::new(
            GeneratorSizes {
                tp: TP,
                ep: 1,
                dp: w / 256,
                pp: PP,
                cp: CP,
                gtp_remat: 1,
            },
            "tp-gtp_remat-cp-ep-dp-pp",
            0,
        );
        let expert = RankGenerator::new(
            GeneratorSizes {
                tp: TP,
                ep: EP,
                dp: w / 1024,
                pp: PP,
                cp: 1,
                gtp_remat: 1,
            },
            "tp-cp-ep-gtp_remat-dp-pp",
            0,
        );
        let (dense, expert) = match (dense, expert) {
            (Ok(d), Ok(e)) => (d, e),
            (d, e) => panic!("generators: {d:?} {e:?}"),
        };
        let hcg = match HyperGrid::new(vec![TP, CP, w / 256, PP], &["tp", "cp", "dp", "pp"], 0) {
            Ok(g) => g,
            Err(e) => panic!("grid: {e}"),
        };
        type Job<'a> = Box<dyn Fn() -> GroupList + Send + Sync + 'a>;
        let jobs: Vec<(&str, &str, Job)> = vec![
            (
                "tp",
                "tp",
                Box::new(|| dense.get_ranks("tp").unwrap_or_default()),
            ),
            (
                "pp",
                "pp",
                Box::new(|| dense.get_ranks("pp").unwrap_or_default()),
            ),
            (
                "dp",
                "dp",
                Box::new(|| dense.get_ranks("dp").unwrap_or_default()),
            ),
            (
                "cp",
                "cp",
                Box::new(|| dense.get_ranks("cp").unwrap_or_default()),
            ),
            (
                "ep",
                "ep (expert gen)",
                Box::new(|| expert.get_ranks("ep").unwrap_or_default()),
            ),
            (
                "tp-pp",
                "tp-pp",
                Box::new(|| dense.get_ranks("tp-pp").unwrap_or_default()),
            ),
            (
                "tp-dp-cp",
                "tp-dp-cp",
                Box::new(|| dense.get_ranks("tp-dp-cp").unwrap_or_default()),
            ),
            (
                "hcg_raw",
                "HyperGrid::raw_groups(dp) (`_gen_rank_enum`)",
                Box::new(|| hcg.raw_groups(&["dp"]).unwrap_or_default()),
            ),
            (
                "hcg_enum",
                "HyperGrid::groups(dp) (`get_rank_enum`)",
                Box::new(|| hcg.groups(&["dp"]).unwrap_or_default()),
            ),
        ];
        for (key, label, job) in &jobs {
            let g = job();
            let shape = format!("{} x {}", thousands(g.len()), thousands(g.get(0).len()));
            drop(g);
            let m = counting_alloc::start();
            let g = job();
            let (peak, _) = counting_alloc::since(m);
            drop(g);
            let t1 = one.install(|| timed_median(n, job));
            let t2 = timed_median(n, job);
            let (ms, mrss) = mega
                .get(&(w, key.to_string()))
                .cloned()
                .unwrap_or_else(|| ("n/a".into(), "n/a".into()));
            let speedup = ms
                .parse::<f64>()
                .map(|s| format!("{:.0}x", s / t1.as_secs_f64()))
                .unwrap_or_else(|_| "".into());
            token_rows.push(format!(
                "| {} | {label} | {shape} | {} | {} | {:.1} MB | {ms} s | {mrss} MB | {speedup} |",
                thousands(w),
                duration_label(t1),
                duration_label(t2),
                peak as f64 / 1e6,
            ));
        }
        // Megatron's whole initialize_model_parallel on one rank enumerates every family.
        let p = plan(w);
        let inits = if w >= 1 << 20 && quick { 1 } else { n.min(5) };
        let t1 =
            one.install(|| timed_median(inits, || p.all_groups().map(|v| v.len()).unwrap_or(0)));
        let t2 = timed_median(inits, || p.all_groups().map(|v| v.len()).unwrap_or(0));
        let (ms, mrss) = mega
            .get(&(w, "init".to_string()))
            .cloned()
            .unwrap_or_else(|| ("n/a".into(), "n/a".into()));
        let speedup = ms
            .parse::<f64>()
            .map(|s| format!("{:.0}x", s / t1.as_secs_f64()))
            .unwrap_or_default();
        token_rows.push(format!(
            "| {} | every family (`initialize_model_parallel`, 1 rank) | {} families | {} | {} | | {ms} s | {mrss} MB | {speedup} |",
            thousands(w),
            p.family_levels().len(),
            duration_label(t1),
            duration_label(t2),
        ));
        let t = timed_median(n, || {
            plan(w).rank_view(w / 3).map(|v| v.pp_next).unwrap_or(0)
        });
        token_rows.push(format!(
            "| {} | plan + one rank's view (what a rank needs) | {} families | {} | | | | | |",
            thousands(w),
            p.family_levels().len(),
            duration_label(t),
        ));
    }

    // ---- report -----------------------------------------------------------------------------
    let ok = |b: bool| if b { "met" } else { "MISSED" };
    println!(
        "Machine: {cores} cores; load average {load_before} before the run, {} after (other jobs share the machine).\n",
        load_average_1min().unwrap_or_else(|| "unknown".into())
    );
    println!("### Targets (world 1,048,576: tp 8, cp 2, pp 16, ep 8; medians)\n");
    println!("| measurement | target | measured | |");
    println!("|---|---:|---:|---|");
    println!(
        "| one rank's complete view (every family), library | < 100 µs | {} | {} |",
        duration_label(view_1m),
        ok(view_1m < Duration::from_micros(100))
    );
    println!(
        "| `grid layout --rank R --format json`, whole process | < 20 ms | {} | {} |",
        duration_label(proc_1m),
        ok(proc_1m < Duration::from_millis(20))
    );
    println!(
        "| every family ({} families, {} members), library, {cores} threads | < 2 s | {} | {} |",
        p.family_levels().len(),
        thousands(members),
        duration_label(all_2),
        ok(all_2 < Duration::from_secs(2))
    );
    println!(
        "| every family, library, 1 thread | | {} | |",
        duration_label(all_1)
    );
    println!(
        "| `grid layout --format json` (every family, {} MB of JSON to /dev/null), whole process | | {} (max RSS {:.0} MB) | |",
        full_bytes / 1_000_000,
        duration_label(full_proc),
        full_rss as f64 / 1024.0
    );
    println!("\n### One rank's view against the world size\n");
    println!("| world | plan construction | one rank's view | heap allocated by one view | `grid layout --rank R --format json` process | its max RSS | its output bytes |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for r in &view_rows {
        println!("{r}");
    }
    println!("\n### Per-token enumeration beside Megatron-Core (docs/performance.md)\n");
    println!("grid-core materializes every group (flat `GroupList`); Megatron's figures are its pure-Python");
    println!("`generate_masked_orthogonal_rank_groups` (best of 1-5 runs) and numpy `HyperCommGrid`. Orders as");
    println!("Megatron builds them: dense `tp-gtp_remat-cp-ep-dp-pp`, expert `tp-cp-ep-gtp_remat-dp-pp`.");
    println!("Heap = peak bytes of the result; Megatron's RSS is its whole process (about 35 MB at baseline).\n");
    println!("| world | grouping | #groups x size | grid-core 1 thread | grid-core {cores} threads | grid-core heap | Megatron | Megatron max RSS | speed-up (1 thread) |");
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &token_rows {
        println!("{r}");
    }
}
