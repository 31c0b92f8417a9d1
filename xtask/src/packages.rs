//! The Debian packages the backends need, checked (and installed as root) by every command that
//! builds them: `cargo xtask test`, `cargo xtask demo` and the backend benchmarks. One list, one
//! function.

use crate::util::{on_path, run};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// The Debian packages the workspace needs to build and test (the MPI, Gloo and bindgen
/// dependencies of the backend crates, a Redis server for Gloo's rendezvous store (with
/// `redis-cli`, from its dependency redis-tools), the C++ compiler that builds backend-gloo's
/// shim: a machine with Rust has a C compiler, not necessarily a C++ one; and iproute2, whose
/// `ip netns` makes the test hosts of `cargo xtask hosts`).
/// This list is the one place they are named; the README points here.
pub const DEBIAN_PACKAGES: &[&str] = &[
    "libopenmpi-dev",
    "openmpi-bin",
    "libclang-dev",
    "libgloo-dev",
    "redis-server",
    "g++",
    "iproute2",
];

/// Checks the Debian packages before anything is built: present, it says so; missing and root, it
/// installs them with `apt-get`; missing otherwise, it prints the exact `apt-get` command and
/// returns `Err(1)`, so the caller stops at once. `command` is the `cargo xtask` command to run
/// again afterwards (`test`, `demo`, `bench mpi`).
pub fn ensure_packages(command: &str) -> Result<(), i32> {
    // One check per xtask process (the full demo builds several programs).
    if CHECKED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let r = check_and_install(command);
    if r.is_ok() {
        CHECKED.store(true, Ordering::Relaxed);
    }
    r
}

/// Whether this process has already found (or installed) every package.
static CHECKED: AtomicBool = AtomicBool::new(false);

fn check_and_install(command: &str) -> Result<(), i32> {
    if !on_path("dpkg-query") {
        eprintln!(
            "xtask: dpkg-query not found (not a Debian system?); cannot check for the packages {}. \
             Continuing: install their equivalents if the build fails.",
            DEBIAN_PACKAGES.join(" ")
        );
        return Ok(());
    }
    let missing = missing_packages();
    if missing.is_empty() {
        eprintln!(
            "xtask: system packages present: {}",
            DEBIAN_PACKAGES.join(" ")
        );
        return Ok(());
    }
    let list = missing.join(" ");
    if !is_root() {
        eprintln!("xtask: missing Debian packages: {list}");
        eprintln!("xtask: install them as root, then run `cargo xtask {command}` again:");
        eprintln!(
            "  sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {list}"
        );
        return Err(1);
    }
    eprintln!("xtask: installing missing Debian packages: {list}");
    if !run(Command::new("apt-get").arg("update").arg("-qq")) {
        eprintln!("xtask: apt-get update failed");
        return Err(1);
    }
    let ok = run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing));
    let still = missing_packages();
    if !ok || !still.is_empty() {
        eprintln!(
            "xtask: apt-get install failed; still missing: {}",
            still.join(" ")
        );
        return Err(1);
    }
    Ok(())
}

fn missing_packages() -> Vec<&'static str> {
    DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            let out = Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output();
            match out {
                Ok(o) => {
                    !(o.status.success()
                        && String::from_utf8_lossy(&o.stdout).trim() == "install ok installed")
                }
                Err(_) => true,
            }
        })
        .collect()
}

/// Effective user id 0, read from /proc (no libc), else from `id -u`.
fn is_root() -> bool {
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        if let Some(line) = status.lines().find(|l| l.starts_with("Uid:")) {
            let mut f = line.split_whitespace().skip(1);
            let _real = f.next();
            if let Some(euid) = f.next() {
                return euid == "0";
            }
        }
    }
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
