//! `cargo xtask test`: system packages, formatting, lints, every test.

use crate::examples;
use crate::hosts;
use crate::packages::{ensure_packages, DEBIAN_PACKAGES};
use crate::util::{self, cargo, color_args, run, run_capture, secs, timed, MPI_ENV};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Outcome of one step.
struct Step {
    name: String,
    ok: bool,
    time: Duration,
    note: String,
}

/// Test counts read from the runners' closing lines.
#[derive(Default)]
struct Counts {
    passed: u64,
    failed: u64,
    skipped: u64,
    seen: bool,
}

pub fn main(args: &[String]) -> i32 {
    let mut gpu = false;
    for a in args {
        match a.as_str() {
            "--gpu" => gpu = true,
            "-h" | "--help" => {
                println!("{}", HELP);
                return 0;
            }
            other => {
                eprintln!("xtask test: unknown argument '{other}'\n\n{HELP}");
                return 2;
            }
        }
    }

    // No incremental compilation caches for the builds of this run and of the processes it
    // starts (tests that bring binaries up to date): the run builds about 60 test and example
    // binaries once, and their caches took 1.3 GB of the 4.7 GB a first run wrote. A value the
    // caller set is kept. (Set before any thread or child process exists.)
    if std::env::var_os("CARGO_INCREMENTAL").is_none() {
        std::env::set_var("CARGO_INCREMENTAL", "0");
    }

    // (1) System packages: a failure here stops everything (nothing else can build).
    let (pk, t) = timed(|| ensure_packages("test"));
    if let Err(code) = pk {
        return code;
    }
    let mut steps = vec![Step {
        name: "system packages".into(),
        ok: true,
        time: t,
        note: DEBIAN_PACKAGES.join(" "),
    }];
    let mut counts = Counts::default();

    // (1b) Disk space: a full disk fails the build halfway with "No space left on device" in
    // some step's output; say up front when that is likely, and which directory it concerns.
    let (disk, disk_free_before) = disk_space_step();
    steps.push(disk);

    // (2) Formatting.
    let (ok, t) = timed(|| run(cargo().args(["fmt", "--all", "--check"])));
    steps.push(Step {
        name: "cargo fmt --check".into(),
        ok,
        time: t,
        note: if ok {
            String::new()
        } else {
            "run `cargo fmt --all`".into()
        },
    });

    // (3) Lints, with the GPU suite's feature on so that every GPU test target compiles on
    // machines without a GPU too (the tests themselves run with `--gpu`).
    let (ok, t) = timed(|| {
        run(cargo()
            .args(["clippy", "--workspace", "--all-targets"])
            .args(["--features", "backend-nccl/gpu-tests"])
            .args(color_args())
            .args(["--", "-D", "warnings"]))
    });
    steps.push(Step {
        name: "cargo clippy -D warnings".into(),
        ok,
        time: t,
        note: String::new(),
    });

    // (3b) API docs: every intra-doc link resolves and rustdoc has nothing to warn about.
    let (ok, t) = timed(|| {
        run(cargo()
            .args(["doc", "--workspace", "--no-deps"])
            .args(color_args())
            .env("RUSTDOCFLAGS", "-D warnings"))
    });
    steps.push(Step {
        name: "cargo doc -D warnings".into(),
        ok,
        time: t,
        note: String::new(),
    });

    // (4) Doc tests (nextest does not run them), then the tests, so that the test runner's
    // summary is the last thing before ours.
    let (ok, t) = timed(|| {
        let mut c = cargo();
        c.args(["test", "--workspace", "--doc"]).args(color_args());
        with_test_env(&mut c);
        let (status, lines) = run_capture(&mut c);
        read_cargo_test_counts(&lines, &mut counts);
        status.is_some_and(|s| s.success())
    });
    steps.push(Step {
        name: "doc tests".into(),
        ok,
        time: t,
        note: String::new(),
    });

    // The examples and binaries first: the process tests start them (`gloo-loop`, `mpi-loop`,
    // `grid`, ...) and bring them up to date with `cargo build` themselves, and a first build
    // from inside one test compiled for tens of seconds on both cores while another test was
    // timing a failure scenario (a rank starved for a second under that load).
    steps.push(build_examples_step());

    let nextest = has_nextest();
    let (ok, t) = timed(|| {
        let mut c = cargo();
        if nextest {
            c.args(["nextest", "run", "--workspace", "--no-fail-fast"]);
        } else {
            c.args(["test", "--workspace", "--no-fail-fast"]);
        }
        c.args(color_args());
        with_test_env(&mut c);
        let (status, lines) = run_capture(&mut c);
        if nextest {
            read_nextest_counts(&lines, &mut counts);
        } else {
            read_cargo_test_counts(&lines, &mut counts);
        }
        status.is_some_and(|s| s.success())
    });
    steps.push(Step {
        name: if nextest {
            "tests (cargo nextest)".into()
        } else {
            "tests (cargo test)".into()
        },
        ok,
        time: t,
        note: if nextest {
            String::new()
        } else {
            "cargo-nextest not installed; used cargo test".into()
        },
    });

    // (5) The examples of the library crates, each run with the command its documentation gives.
    steps.extend(example_steps(&mut counts));

    // (5b) Multi-host: the scenarios of `cargo xtask hosts run` on network namespaces (root
    // only; skipped with the reason otherwise).
    steps.push(multi_host_step(&mut counts));

    // (6) The GPU suite, when asked for.
    if gpu {
        steps.push(gpu_suite(&mut counts));
    }

    if steps.iter().any(|s| !s.ok) {
        if let Some(free) = free_bytes(&util::target_dir()).filter(|&f| f < DISK_LOW) {
            eprintln!(
                "xtask: the disk of {} is full or nearly ({} free, {} at the start): the failures \
                 above may be 'No space left on device'; free space or set CARGO_TARGET_DIR to a \
                 directory on a larger disk",
                util::target_dir().display(),
                gib(free),
                disk_free_before
                    .map(gib)
                    .unwrap_or_else(|| "unknown".into())
            );
        }
    }
    summary(&steps, &counts)
}

/// What a first `cargo xtask test` writes under the target directory, measured on a fresh
/// clone (3.4 GB: debug builds with line tables only, see the workspace's Cargo.toml, and no
/// incremental caches), with a margin.
const DISK_NEEDED: u64 = 4 << 30;

/// Free space under which a failed run is reported as a probable full disk.
const DISK_LOW: u64 = 256 << 20;

/// Free space on the target directory's filesystem, against what a first run needs, and the
/// free bytes it read. Never fails: a target directory built before needs far less, so this
/// only warns.
fn disk_space_step() -> (Step, Option<u64>) {
    let target = util::target_dir();
    let (free, t) = timed(|| free_bytes(&target));
    let note = match free {
        Some(free) if free < DISK_NEEDED => {
            let note = format!(
                "WARNING: {} free for {}; a first run writes about {} there",
                gib(free),
                target.display(),
                gib(DISK_NEEDED)
            );
            eprintln!(
                "xtask: {note}: free space or set CARGO_TARGET_DIR to a directory on a larger disk \
                 if the build fails with 'No space left on device'"
            );
            note
        }
        Some(free) => format!("{} free for {}", gib(free), target.display()),
        None => format!("cannot read the free space of {}", target.display()),
    };
    let step = Step {
        name: "disk space".into(),
        ok: true,
        time: t,
        note,
    };
    (step, free)
}

/// Bytes free to this user on the filesystem of `path` (or of its nearest existing parent),
/// as `df -Pk` reports them; `None` when `df` cannot tell.
fn free_bytes(path: &Path) -> Option<u64> {
    let dir = path.ancestors().find(|p| p.exists())?;
    let out = Command::new("df").arg("-Pk").arg(dir).output().ok()?;
    if !out.status.success() {
        return None;
    }
    parse_df_available(&String::from_utf8_lossy(&out.stdout))
}

/// The "Available" column (KiB) of `df -Pk`'s one data line, in bytes.
fn parse_df_available(text: &str) -> Option<u64> {
    let line = text.lines().nth(1)?;
    let kib: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// `7.4 GiB`.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Builds every example and binary of the workspace (before the tests).
fn build_examples_step() -> Step {
    let (ok, t) = timed(|| {
        let mut c = cargo();
        c.args(["build", "--workspace", "--examples", "--bins"])
            .args(color_args());
        run(&mut c)
    });
    Step {
        name: "build examples".into(),
        ok,
        time: t,
        note: String::new(),
    }
}

/// Runs each library crate's example with its documented command (built by
/// [`build_examples_step`]); one step (and one test count) per example.
fn example_steps(counts: &mut Counts) -> Vec<Step> {
    let mut steps = Vec::new();
    for ex in examples::find_examples() {
        let name = format!("example {}/{}", ex.package, ex.name);
        let (result, t) = timed(|| {
            ex.command
                .clone()
                .and_then(|c| examples::run_documented(&c, examples::EXAMPLE_TIMEOUT))
        });
        counts.seen = true;
        match &result {
            Ok(()) => counts.passed += 1,
            Err(e) => {
                counts.failed += 1;
                eprintln!("xtask: {name}: {e}");
            }
        }
        steps.push(Step {
            name,
            ok: result.is_ok(),
            time: t,
            note: result.err().unwrap_or_default(),
        });
    }
    steps
}

/// The multi-host scenarios as one step (and one test count); skipped, not failed, where network
/// namespaces cannot be made.
fn multi_host_step(counts: &mut Counts) -> Step {
    let name = "multi-host (network namespaces)".to_string();
    let (result, t) = timed(hosts::test_step);
    match result {
        Ok(Some(note)) => {
            counts.seen = true;
            counts.passed += 1;
            Step {
                name,
                ok: true,
                time: t,
                note,
            }
        }
        Ok(None) => {
            counts.seen = true;
            counts.skipped += 1;
            Step {
                name,
                ok: true,
                time: t,
                note: format!("skipped: {}", hosts::available().err().unwrap_or_default()),
            }
        }
        Err(e) => {
            counts.seen = true;
            counts.failed += 1;
            eprintln!("xtask: multi-host: {e}");
            Step {
                name,
                ok: false,
                time: t,
                note: e,
            }
        }
    }
}

const HELP: &str = "usage: cargo xtask test [--gpu]

Checks the Debian packages (installs them when running as root), then runs
cargo fmt --check, cargo clippy -D warnings, cargo doc -D warnings, the doc tests and every test of
the workspace (cargo nextest when installed, else cargo test), then builds the
examples and runs each library crate's example with the command its
documentation gives (`//! Run: `...``), then (as root) the multi-host scenarios of
`cargo xtask hosts run` on network namespaces (skipped with the reason otherwise).
  --gpu   also run the NCCL suite (crates/backend-nccl with feature gpu-tests), one test at a
          time, with NCCL_DEBUG=WARN and GRID_REQUIRE_GPU=1; prints the NCCL version and the
          devices, and fails on any skipped GPU test (no usable GPU); tests that need more
          GPUs or device memory than the machine has are listed as not run";

fn with_test_env(c: &mut Command) {
    for (k, v) in MPI_ENV {
        c.env(k, v);
    }
}

fn has_nextest() -> bool {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `crates/backend-nccl` with a `gpu-tests` feature, if that exists.
fn gpu_suite(counts: &mut Counts) -> Step {
    let manifest = util::workspace_root().join("crates/backend-nccl/Cargo.toml");
    if !has_feature(&manifest, "gpu-tests") {
        eprintln!(
            "xtask: --gpu: no GPU suite exists yet (crates/backend-nccl with a `gpu-tests` feature); nothing to run"
        );
        return Step {
            name: "GPU suite".into(),
            ok: true,
            time: Duration::ZERO,
            note: "no GPU suite exists yet".into(),
        };
    }
    let mut lines = Vec::new();
    let (ok, t) = timed(|| {
        let mut c = cargo();
        c.args([
            "test",
            "-p",
            "backend-nccl",
            "--features",
            "gpu-tests",
            "--no-fail-fast",
        ])
        .args(color_args())
        // One test at a time (two tests' ranks on one GPU would be two NCCL ranks per device),
        // with the test output shown: the NCCL version, the devices, the measurements.
        .args(["--", "--test-threads=1", "--nocapture"]);
        with_test_env(&mut c);
        for (k, v) in GPU_ENV {
            c.env(k, v);
        }
        let (status, out) = run_capture(&mut c);
        read_cargo_test_counts(&out, counts);
        lines = out;
        status.is_some_and(|s| s.success())
    });
    for l in gpu_report(&lines) {
        println!("xtask: {l}");
    }
    let skipped = marked_lines(&lines, "SKIPPED");
    for l in &skipped {
        eprintln!("xtask: --gpu: a GPU test skipped: {l}");
    }
    // Tests that need more GPUs (or device memory) than the machine has, or that cover the
    // no-GPU path: reported, not failed (one GPU is enough for the suite).
    for l in marked_lines(&lines, "NOT RUN") {
        println!("xtask: --gpu: {l}");
    }
    let note = if skipped.is_empty() {
        String::new()
    } else {
        format!(
            "{} GPU test(s) skipped for want of a usable GPU (the GPU suite fails on any skip)",
            skipped.len()
        )
    };
    Step {
        name: "GPU suite (backend-nccl, gpu-tests)".into(),
        ok: ok && skipped.is_empty(),
        time: t,
        note,
    }
}

/// The environment of the GPU suite: NCCL's warnings shown, and every GPU test that would skip
/// for want of a driver, libnccl or GPU fails instead.
const GPU_ENV: [(&str, &str); 2] = [("NCCL_DEBUG", "WARN"), ("GRID_REQUIRE_GPU", "1")];

/// The lines of a GPU suite run that say what ran where (`GPU: ...`: the NCCL version and the
/// devices, printed by the suite's `nccl_version_and_devices` test).
fn gpu_report(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|l| strip_ansi(l))
        .filter_map(|l| l.trim().strip_prefix("GPU: ").map(|r| format!("GPU: {r}")))
        .collect()
}

/// The lines of a GPU suite run that start with `mark`: `SKIPPED: <test>: <reason>` (no
/// usable GPU: the suite fails) or `NOT RUN: ...` (more GPUs or device memory needed than the
/// machine has, or a test of the no-GPU path: reported only).
fn marked_lines(lines: &[String], mark: &str) -> Vec<String> {
    lines
        .iter()
        .map(|l| strip_ansi(l).trim().to_string())
        .filter(|l| l.starts_with(mark))
        .collect()
}

/// Whether `manifest` declares `feature` in its `[features]` table (a plain text scan; enough
/// for our own manifests).
fn has_feature(manifest: &Path, feature: &str) -> bool {
    let Ok(text) = std::fs::read_to_string(manifest) else {
        return false;
    };
    let mut in_features = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_features = l == "[features]";
        } else if in_features {
            let key = l.split('=').next().unwrap_or("").trim().trim_matches('"');
            if key == feature {
                return true;
            }
        }
    }
    false
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The number before `word` in `text` (`"3 passed"` -> 3).
fn count_before(text: &str, word: &str) -> Option<u64> {
    let toks: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == ':')
        .filter(|t| !t.is_empty())
        .collect();
    toks.windows(2)
        .find(|w| w[1] == word)
        .and_then(|w| w[0].parse().ok())
}

/// nextest: `Summary [ 1.2s] 40 tests run: 39 passed, 1 failed, 2 skipped`.
fn read_nextest_counts(lines: &[String], c: &mut Counts) {
    for l in lines.iter().map(|l| strip_ansi(l)) {
        let l = l.trim();
        if l.starts_with("Summary [") {
            c.seen = true;
            c.passed += count_before(l, "passed").unwrap_or(0);
            c.failed += count_before(l, "failed").unwrap_or(0);
            c.failed += count_before(l, "timed").unwrap_or(0);
            c.skipped += count_before(l, "skipped").unwrap_or(0);
        }
    }
}

/// cargo test: `test result: ok. 12 passed; 0 failed; 1 ignored; ...` per binary.
fn read_cargo_test_counts(lines: &[String], c: &mut Counts) {
    for l in lines.iter().map(|l| strip_ansi(l)) {
        if let Some(rest) = l.trim().strip_prefix("test result:") {
            c.seen = true;
            c.passed += count_before(rest, "passed").unwrap_or(0);
            c.failed += count_before(rest, "failed").unwrap_or(0);
            c.skipped += count_before(rest, "ignored").unwrap_or(0);
        }
    }
}

fn summary(steps: &[Step], counts: &Counts) -> i32 {
    let failed: Vec<&str> = steps
        .iter()
        .filter(|s| !s.ok)
        .map(|s| s.name.as_str())
        .collect();
    let width = steps.iter().map(|s| s.name.len()).max().unwrap_or(0);
    println!();
    println!("==== cargo xtask test: summary ====");
    for s in steps {
        let line = format!(
            "  {:<6} {:<width$}  {:>8}  {}",
            if s.ok { "ok" } else { "FAILED" },
            s.name,
            secs(s.time),
            s.note
        );
        println!("{}", line.trim_end());
    }
    if failed.is_empty() {
        println!("all {} steps succeeded", steps.len());
    } else {
        println!("FAILED steps: {}", failed.join(", "));
    }
    if counts.seen {
        println!(
            "tests: {} passed, {} failed, {} skipped",
            counts.passed, counts.failed, counts.skipped
        );
    }
    if failed.is_empty() {
        0
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_df_available() {
        let df = "Filesystem     1024-blocks     Used Available Capacity Mounted on\n\
                  /dev/vda         263174212 88080384   7759872      92% /\n";
        assert_eq!(parse_df_available(df), Some(7_759_872 * 1024));
        assert_eq!(parse_df_available("Filesystem\n"), None);
        assert_eq!(gib(7_759_872 * 1024), "7.4 GiB");
        assert!(free_bytes(Path::new("/definitely/not/here/target")).is_some());
    }

    #[test]
    fn parses_nextest_summary() {
        let mut c = Counts::default();
        read_nextest_counts(
            &["     Summary [   0.5s] 40 tests run: 37 passed, 3 failed, 2 skipped".into()],
            &mut c,
        );
        assert_eq!((c.passed, c.failed, c.skipped, c.seen), (37, 3, 2, true));
    }

    #[test]
    fn parses_cargo_test_results() {
        let mut c = Counts::default();
        read_cargo_test_counts(
            &[
                "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s".into(),
                "\u{1b}[32mtest result: FAILED. 3 passed; 2 failed; 0 ignored".into(),
            ],
            &mut c,
        );
        assert_eq!((c.passed, c.failed, c.skipped), (15, 2, 1));
    }

    #[test]
    fn feature_scan() {
        let dir = std::env::temp_dir().join(format!("xtask-feature-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = dir.join("Cargo.toml");
        std::fs::write(
            &m,
            "[package]\nname = \"x\"\n[features]\ndefault = []\ngpu-tests = []\n[dependencies]\ngpu = \"1\"\n",
        )
        .unwrap();
        assert!(has_feature(&m, "gpu-tests"));
        let run: Vec<String> = [
            "running 3 tests",
            "GPU: NCCL 2.26.2; device 0 of 1: NVIDIA H100, compute capability 9.0, 79 GiB",
            "NOT RUN: isend_irecv_exchange_between_two_ranks: needs 2 GPUs, found 1",
            "NOT RUN: size 1024 MiB of f32: needs about 7168 MiB of free device memory",
            "SKIPPED: nccl_conformance_all_gpus: no usable GPU: nccl: load the CUDA driver failed",
            "test result: ok. 3 passed; 0 failed",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            gpu_report(&run),
            vec!["GPU: NCCL 2.26.2; device 0 of 1: NVIDIA H100, compute capability 9.0, 79 GiB"]
        );
        assert_eq!(marked_lines(&run, "SKIPPED").len(), 1);
        assert_eq!(marked_lines(&run, "NOT RUN").len(), 2);
        assert_eq!(GPU_ENV, [("NCCL_DEBUG", "WARN"), ("GRID_REQUIRE_GPU", "1")]);
        assert!(!has_feature(&m, "gpu"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
