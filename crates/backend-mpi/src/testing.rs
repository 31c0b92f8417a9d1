//! Multi-rank tests under plain `cargo test`: a test re-launches its own test binary under
//! `mpirun -np N`, and each rank runs the test body.
//!
//! ```no_run
//! use backend_mpi::mpi_test;
//! use grid_core::{Communicator, CommunicatorExt, ReduceOp};
//!
//! // Expands to `#[test] fn mpi_sum_np4()`: outside mpirun it launches 4 ranks of this test
//! // binary (serialised with every other launch of the process, killed after 60 s) and fails
//! // with every rank's output if any rank fails; inside mpirun it runs the closure as a rank.
//! mpi_test!(mpi_sum_np4, np = 4, timeout = 60, |rt| {
//!     let w = rt.world();
//!     let mut s = [0i64];
//!     w.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum).map_err(|e| e.to_string())?;
//!     if s[0] != 4 { return Err(format!("sum {} != 4", s[0])); }
//!     Ok(())
//! });
//! ```
//!
//! The launch uses `mpirun -np N --oversubscribe --timeout T <test binary> --exact <test>
//! --nocapture --test-threads=1` with the environment of [`launch_env`]: Open MPI's run-as-root
//! permission, shared memory and loopback only (`btl self,vader`, `pml ob1`, out-of-band TCP on
//! `lo`). Variables already set in the caller's environment win, so a container that forbids
//! `process_vm_readv` can add `OMPI_MCA_btl_vader_single_copy_mechanism=none`. `MPIRUN`
//! overrides the launcher path. Test names should contain `mpi_` so that nextest can put them in
//! a serial test group.

use crate::MpiRuntime;
use grid_core::Communicator;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static LAUNCH: Mutex<()> = Mutex::new(());

/// The environment every launch sets (unless the caller's environment already sets a variable).
///
/// ```
/// assert!(backend_mpi::testing::launch_env().iter().any(|(k, _)| *k == "OMPI_MCA_btl"));
/// ```
pub fn launch_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        ("OMPI_MCA_btl", "self,vader"),
        ("OMPI_MCA_pml", "ob1"),
        ("OMPI_MCA_oob_tcp_if_include", "lo"),
        ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
    ]
}

/// True inside a process started by an MPI launcher (`OMPI_COMM_WORLD_SIZE` or `PMI_SIZE` set).
///
/// ```
/// let _ = backend_mpi::testing::under_launcher();
/// ```
pub fn under_launcher() -> bool {
    crate::raw::env_world().is_some()
}

/// The `mpirun` command line (program and arguments) that runs `program args…` on `np` ranks
/// with a job timeout of `timeout_secs`.
///
/// ```
/// let c = backend_mpi::testing::mpirun_command(2, 30, "prog", &["--x"]);
/// assert_eq!(c[1..], ["-np", "2", "--oversubscribe", "--timeout", "30", "prog", "--x"]);
/// ```
pub fn mpirun_command(np: usize, timeout_secs: u64, program: &str, args: &[&str]) -> Vec<String> {
    let mpirun = std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".to_string());
    let mut v = vec![
        mpirun,
        "-np".into(),
        np.to_string(),
        "--oversubscribe".into(),
        "--timeout".into(),
        timeout_secs.to_string(),
        program.to_string(),
    ];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

/// What a launch produced.
///
/// ```no_run
/// let out = backend_mpi::testing::launch(2, 30, "hostname", &[]).unwrap();
/// println!("exit {:?} after {:?}:\n{}", out.code, out.elapsed, out.output);
/// ```
#[derive(Debug)]
pub struct LaunchOutput {
    /// Exit code of mpirun (`None` when killed by a signal or by the local deadline).
    pub code: Option<i32>,
    /// Everything the ranks and mpirun wrote to stdout and stderr.
    pub output: String,
    /// Wall time.
    pub elapsed: Duration,
}

/// Runs `program args…` on `np` ranks with [`launch_env`], at most `timeout_secs` (mpirun's
/// `--timeout`; the process is also killed 30 s after that if mpirun itself hangs). Launches
/// from one process are serialised.
///
/// ```no_run
/// let out = backend_mpi::testing::launch(2, 30, "/bin/true", &[]).unwrap();
/// assert_eq!(out.code, Some(0));
/// ```
pub fn launch(
    np: usize,
    timeout_secs: u64,
    program: &str,
    args: &[&str],
) -> Result<LaunchOutput, String> {
    launch_with_env(np, timeout_secs, program, args, &[])
}

/// [`launch`] with extra environment variables for the ranks.
///
/// ```no_run
/// let out = backend_mpi::testing::launch_with_env(2, 30, "/usr/bin/env", &[], &[("X", "1")]).unwrap();
/// assert!(out.output.contains("X=1"));
/// ```
pub fn launch_with_env(
    np: usize,
    timeout_secs: u64,
    program: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<LaunchOutput, String> {
    let _guard = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
    let argv = mpirun_command(np, timeout_secs, program, args);
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in launch_env() {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        format!(
            "cannot start `{}`: {e}. Install Open MPI: apt-get install -y openmpi-bin libopenmpi-dev \
             (or set MPIRUN to the launcher's path)",
            argv[0]
        )
    })?;
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|mut r| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    })
    .collect();
    let deadline = start + Duration::from_secs(timeout_secs + 30);
    let code = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.code(),
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("waiting for mpirun: {e}")),
        }
    };
    let output: Vec<String> = readers
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    Ok(LaunchOutput {
        code,
        output: output.join("\n--- stderr ---\n"),
        elapsed: start.elapsed(),
    })
}

/// The body of an [`crate::mpi_test!`] test; see the module docs. Outside a launcher it runs
/// `np` ranks of the current test binary restricted to this test and panics (fails the test)
/// with all output unless every rank passed; inside a launcher it initialises MPI, runs `body`
/// and, if `body` fails or panics on this rank, prints `[rank r/n] FAILED: …` and aborts the
/// job so no rank waits forever.
///
/// ```no_run
/// #[test]
/// fn mpi_two_ranks() {
///     backend_mpi::testing::run_test(module_path!(), "mpi_two_ranks", 2, 60, |rt| {
///         use grid_core::Communicator;
///         rt.world().barrier().map_err(|e| e.to_string())
///     });
/// }
/// ```
pub fn run_test<F>(module_path: &str, name: &str, np: usize, timeout_secs: u64, body: F)
where
    F: FnOnce(&MpiRuntime) -> Result<(), String>,
{
    let test_path = match module_path.split_once("::") {
        Some((_, rest)) => format!("{rest}::{name}"),
        None => name.to_string(),
    };
    if under_launcher() {
        run_rank(np, body);
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => panic!("{test_path}: cannot find the test binary: {e}"),
    };
    let args = [
        "--exact",
        test_path.as_str(),
        "--nocapture",
        "--test-threads=1",
    ];
    // Each rank that passes writes a marker file after finalizing MPI: mpirun's forwarding of
    // the ranks' stdout can lose the last lines, so output is for diagnostics only.
    let markers = marker_dir(&test_path);
    let marker_env = markers.to_string_lossy().into_owned();
    let out = match launch_with_env(np, timeout_secs, &exe, &args, &[(MARKER_ENV, &marker_env)]) {
        Ok(o) => o,
        Err(e) => panic!("{test_path}: {e}"),
    };
    let passed = (0..np)
        .filter(|r| markers.join(format!("rank-{r}.ok")).exists())
        .count();
    let _ = std::fs::remove_dir_all(&markers);
    if out.code != Some(0) || passed != np {
        let why = match out.code {
            Some(110) => {
                format!("timed out after {timeout_secs} s (mpirun --timeout; a deadlock?)")
            }
            None => "killed (mpirun did not finish in time)".to_string(),
            Some(c) => format!("mpirun exit code {c}"),
        };
        let failed: Vec<&str> = out
            .output
            .lines()
            .filter(|l| l.contains("FAILED:"))
            .collect();
        panic!(
            "{test_path} on {np} ranks failed: {why}; {passed} of {np} ranks passed.\n\
             Rank failures:\n{}\n===== full output ({:.2} s) =====\n{}",
            if failed.is_empty() {
                "(none reported)".to_string()
            } else {
                failed.join("\n")
            },
            out.elapsed.as_secs_f64(),
            out.output
        );
    }
}

fn run_rank<F>(np: usize, body: F)
where
    F: FnOnce(&MpiRuntime) -> Result<(), String>,
{
    let rt = match MpiRuntime::init() {
        Ok(rt) => rt,
        Err(e) => panic!("[rank ?] FAILED: MPI initialisation: {e}"),
    };
    let (rank, size) = (rt.world().rank(), rt.world().size());
    let result = if size != np {
        Err(format!("the job has {size} ranks, the test asked for {np}"))
    } else {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&rt))) {
            Ok(r) => r,
            Err(p) => Err(format!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)")
            )),
        }
    };
    if let Err(msg) = result {
        eprintln!("[rank {rank}/{size}] FAILED: {msg}");
        let _ = std::io::stderr().flush();
        // Let ranks that fail at the same moment print too, then end the whole job.
        std::thread::sleep(Duration::from_millis(300));
        rt.abort(1);
        panic!("[rank {rank}/{size}] FAILED: {msg}");
    }
    drop(rt);
    if let Some(dir) = std::env::var_os(MARKER_ENV) {
        let path = std::path::Path::new(&dir).join(format!("rank-{rank}.ok"));
        if let Err(e) = std::fs::write(&path, b"ok") {
            panic!(
                "[rank {rank}/{size}] FAILED: cannot write {}: {e}",
                path.display()
            );
        }
    }
}

/// Environment variable naming the directory where passing ranks leave their marker files.
const MARKER_ENV: &str = "GRID_MPI_TEST_MARKERS";

/// A fresh, empty marker directory for one launch.
fn marker_dir(test_path: &str) -> std::path::PathBuf {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let safe: String = test_path
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let dir = std::env::temp_dir().join(format!("grid-mpi-test-{}-{n}-{safe}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!(
            "{test_path}: cannot create the marker directory {}: {e}",
            dir.display()
        );
    }
    dir
}

/// Declares a multi-rank test; see the [`testing`](crate::testing) module docs.
///
/// `mpi_test!(NAME, np = N, timeout = SECONDS, |rt| { … Ok(()) })` where the closure takes
/// `&MpiRuntime` and returns `Result<(), String>`.
#[macro_export]
macro_rules! mpi_test {
    ($name:ident, np = $np:expr, timeout = $t:expr, $body:expr) => {
        #[test]
        fn $name() {
            $crate::testing::run_test(module_path!(), stringify!($name), $np, $t, $body);
        }
    };
}
