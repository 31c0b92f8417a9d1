//! Small helpers shared by the xtask commands: locating the workspace, running commands,
//! and the environment every test or demo process gets.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Environment for every process that may launch MPI ranks (tests, demos, benchmarks).
/// See docs/backends.md §1: root is allowed, oversubscription is allowed (2 cores), and all
/// traffic stays on shared memory and loopback.
pub const MPI_ENV: &[(&str, &str)] = &[
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
    ("OMPI_MCA_btl", "self,vader"),
    ("OMPI_MCA_pml", "ob1"),
    ("OMPI_MCA_oob_tcp_if_include", "lo"),
];

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest.to_path_buf())
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                workspace_root().join(d)
            }
        }
        None => workspace_root().join("target"),
    }
}

/// The `cargo` that runs us (cargo sets `CARGO` for `cargo run`), else `cargo` from PATH.
pub fn cargo() -> Command {
    let exe = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut c = Command::new(exe);
    c.current_dir(workspace_root());
    c
}

/// `--color always` when our own stdout is a terminal (output is piped through us).
pub fn color_args() -> &'static [&'static str] {
    if std::io::stdout().is_terminal() {
        &["--color", "always"]
    } else {
        &[]
    }
}

/// Renders a command line for messages.
pub fn show(cmd: &Command) -> String {
    let program = cmd.get_program().to_string_lossy().into_owned();
    // The absolute path of the toolchain's cargo says nothing useful.
    let mut s = if program.ends_with("/cargo") {
        "cargo".to_string()
    } else {
        program
    };
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&quote(a));
    }
    s
}

fn quote(a: &OsStr) -> String {
    let s = a.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@".contains(c))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Runs `cmd` with inherited stdio, printing it first. Returns whether it succeeded.
pub fn run(cmd: &mut Command) -> bool {
    eprintln!("$ {}", show(cmd));
    match cmd.status() {
        Ok(s) => s.success(),
        Err(e) => {
            eprintln!("xtask: cannot start {}: {e}", show(cmd));
            false
        }
    }
}

/// Runs `cmd`, echoing its stdout and stderr live, and returns its status together with every
/// line it printed (both streams), so the caller can read a test runner's summary.
pub fn run_capture(cmd: &mut Command) -> (Option<ExitStatus>, Vec<String>) {
    eprintln!("$ {}", show(cmd));
    let mut child = match cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xtask: cannot start {}: {e}", show(cmd));
            return (None, Vec::new());
        }
    };
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(echo_lines(out, false, Arc::clone(&lines)));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(echo_lines(err, true, Arc::clone(&lines)));
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().ok();
    let lines = match Arc::try_unwrap(lines) {
        Ok(m) => m.into_inner().unwrap_or_default(),
        Err(shared) => shared.lock().map(|v| v.clone()).unwrap_or_default(),
    };
    (status, lines)
}

fn echo_lines<R: std::io::Read + Send + 'static>(
    stream: R,
    to_stderr: bool,
    sink: Arc<Mutex<Vec<String>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if to_stderr {
                        let _ = std::io::stderr().write_all(&buf);
                    } else {
                        let _ = std::io::stdout().write_all(&buf);
                    }
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    if let Ok(mut v) = sink.lock() {
                        v.push(line);
                    }
                }
            }
        }
    })
}

/// Whether a program can be found on PATH.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

/// Formats a duration as seconds with one decimal.
pub fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Times a closure.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}
