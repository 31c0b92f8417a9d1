//! `cargo xtask hosts`: test hosts on one machine, and the multi-host scenarios run on them.
//!
//! A test host is a Linux network namespace (`gridhost-<pid>-h<i>`) with its own UTS namespace
//! per process (its own host name), one interface `eth0` with the address `10.231.0.<i+1>/24`,
//! joined by a veth pair to a Linux bridge that lives in a namespace of its own
//! (`gridhost-<pid>-sw`, interfaces `h<i>` on bridge `br0`). Nothing is created in the machine's
//! own network namespace, so parallel runs cannot clash (each has its own namespaces, and the
//! same subnet in each is private to it) and nothing outside the machine is contacted.
//!
//! * `up [--hosts N]`: creates the hosts (`gridhost-up<pid>-h<i>`) and leaves them (prints the
//!   commands to use them);
//! * `down`: removes every `gridhost-` namespace, killing the processes inside, and the run
//!   directories (leftovers of a run that was killed);
//! * `run [SCENARIO...]`: builds the programs, creates 4 hosts, runs the scenarios (all by
//!   default), removes the hosts (also when a scenario fails or panics) and checks that no
//!   namespace or process of the run is left.
//!
//! The scenarios (8 ranks, 2 per host): `mpi-conformance`, `mpi-collection`, `mpi-pipeline`
//! (mpirun with a hostfile; its launch agent enters the namespace named by the host argument;
//! TCP only), `gloo-redis`, `gloo-file` (the conformance suite with its sweeps on the world
//! communicator only, ranks meeting through a Redis server in host 0 or a shared directory), `gloo-pipeline`, and `cut-gloo`, `cut-mpi` (host 3's
//! link taken down while every rank loops over all-reduces: every rank elsewhere must fail within
//! its timeout plus a margin, with the library's errors).

use crate::util::{cargo, color_args, run, target_dir};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Prefix of every namespace and run directory this module creates.
pub const PREFIX: &str = "gridhost-";
/// The private subnet of the test hosts (host `i` is `.i+1`).
const SUBNET: &str = "10.231.0";
/// Ranks per host in the scenarios.
const PER_HOST: usize = 2;
/// Hosts in `run`.
const HOSTS: usize = 4;
/// Time limit of every operation in the cut-host scenarios.
const CUT_TIMEOUT_MS: u64 = 5000;
/// What a survivor may take beyond its time limit (from the moment the link went down) before
/// the cut-host test fails: scheduling of 8 ranks on 2 shared cores, and the ranks' exit.
const CUT_MARGIN: Duration = Duration::from_secs(5);
/// Hard deadline of the cut-host scenarios' processes, from the cut: past it they are killed
/// and the scenario fails as a hang.
const CUT_HARD: Duration = Duration::from_secs(60);
/// How long mpirun may go on after the survivors' limit in the MPI cut-host scenario before
/// the harness ends it (it waits for the cut host's daemon; see [`cut`]).
const MPI_GRACE: Duration = Duration::from_secs(5);
/// mpirun's own `--timeout` in the MPI cut-host scenario.
const MPI_CUT_JOB_TIMEOUT_S: u64 = 150;

const SCENARIOS: &[&str] = &[
    "mpi-conformance",
    "mpi-collection",
    "mpi-pipeline",
    "gloo-redis",
    "gloo-file",
    "gloo-pipeline",
    "cut-gloo",
    "cut-mpi",
];

const HELP: &str = "usage: cargo xtask hosts up [--hosts N] | down | run [SCENARIO...]

Test hosts as Linux network namespaces on one bridge (needs root and `ip netns`):
  up [--hosts N]     create N hosts (default 4) gridhost-up<pid>-h0.. at 10.231.0.1.., leave them
  down               remove every gridhost-* namespace and the processes in it
  run [SCENARIO...]  create 4 hosts, run the scenarios (default: all), remove the hosts
scenarios: mpi-conformance mpi-collection mpi-pipeline gloo-redis gloo-file gloo-pipeline
           cut-gloo cut-mpi";

pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("up") => {
            let n = match args.get(1).map(String::as_str) {
                None => HOSTS,
                Some("--hosts") => match args.get(2).and_then(|v| v.parse::<usize>().ok()) {
                    Some(n) if (1..=200).contains(&n) => n,
                    _ => {
                        eprintln!("xtask hosts up: --hosts needs a number from 1 to 200");
                        return 2;
                    }
                },
                Some(other) => {
                    eprintln!("xtask hosts up: unknown argument '{other}'\n\n{HELP}");
                    return 2;
                }
            };
            up(n)
        }
        Some("down") => match down_all() {
            Ok(removed) => {
                println!(
                    "removed {} namespace(s): {}",
                    removed.len(),
                    removed.join(" ")
                );
                0
            }
            Err(e) => {
                eprintln!("xtask hosts down: {e}");
                1
            }
        },
        Some("run") => {
            let names: Vec<&str> = if args.len() > 1 {
                args[1..].iter().map(String::as_str).collect()
            } else {
                SCENARIOS.to_vec()
            };
            if let Some(bad) = names.iter().find(|n| !SCENARIOS.contains(n)) {
                eprintln!("xtask hosts run: unknown scenario '{bad}'\n\n{HELP}");
                return 2;
            }
            if let Err(why) = available() {
                eprintln!("xtask hosts run: {why}");
                return 1;
            }
            if !build_programs() {
                return 1;
            }
            match run_scenarios(&names) {
                Ok(_) => 0,
                Err(e) => {
                    eprintln!("xtask hosts run: FAILED: {e}");
                    1
                }
            }
        }
        Some("-h" | "--help") => {
            println!("{HELP}");
            0
        }
        _ => {
            eprintln!("{HELP}");
            2
        }
    }
}

/// The step of `cargo xtask test`: `Ok(Some(summary))` when every scenario passed,
/// `Ok(None)` with the reason printed when the step cannot run here (not root, no `ip netns`),
/// `Err(what failed)` otherwise. The programs must have been built (the example step of
/// `cargo xtask test` builds them).
pub fn test_step() -> Result<Option<String>, String> {
    if let Err(why) = available() {
        eprintln!("xtask: multi-host step skipped: {why}");
        return Ok(None);
    }
    // Built by the step before (`cargo build --workspace --examples`); building them again with
    // `-p grid-programs` could unify features differently and rebuild the backends.
    let exe = program("multihost-rank");
    if !exe.is_file() {
        return Err(format!(
            "{} is missing: the examples were not built",
            exe.display()
        ));
    }
    run_scenarios(SCENARIOS)?;
    Ok(Some(format!(
        "{} scenarios, 8 ranks over 4 namespaces",
        SCENARIOS.len()
    )))
}

/// Why the test hosts cannot be made here, if they cannot: not root, or `ip netns` refused.
pub fn available() -> Result<(), String> {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
        })
        .unwrap_or_default();
    if uid != "0" {
        return Err(format!(
            "not root (effective uid {uid}): network namespaces need root"
        ));
    }
    for tool in [
        "ip",
        "unshare",
        "bash",
        "timeout",
        "mpirun",
        "redis-server",
        "redis-cli",
    ] {
        if !crate::util::on_path(tool) {
            return Err(format!("`{tool}` is not installed"));
        }
    }
    let probe = format!("{PREFIX}probe-{}", std::process::id());
    let out = Command::new("ip").args(["netns", "add", &probe]).output();
    match out {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).output();
            Ok(())
        }
        Ok(o) => Err(format!(
            "`ip netns add` is not permitted here: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run `ip`: {e}")),
    }
}

fn build_programs() -> bool {
    run(cargo()
        .args(["build", "-p", "grid-programs", "--examples"])
        .args(color_args()))
}

fn program(name: &str) -> PathBuf {
    target_dir().join("debug/examples").join(name)
}

// ------------------------------------------------------------------------------------------
// The test bed
// ------------------------------------------------------------------------------------------

/// Test hosts: namespaces, the bridge, the run directory (agent script, hostfile, stores).
/// Dropping it removes everything (unless [`Testbed::keep`]).
pub struct Testbed {
    id: String,
    hosts: usize,
    dir: PathBuf,
    /// Inode of each namespace (host namespaces, then the switch): a process still in one after
    /// the teardown is a leftover.
    inodes: Vec<u64>,
    keep: bool,
    removed: bool,
}

/// Runs `ip ARGS`, failing with its error output.
fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

impl Testbed {
    /// Creates `hosts` hosts (named to be kept after this process when `kept`); first removes
    /// the leftovers of dead runs; on any error, removes what it had made.
    pub fn up(hosts: usize, kept: bool) -> Result<Testbed, String> {
        match remove_stale() {
            Ok(stale) if !stale.is_empty() => eprintln!(
                "xtask hosts: removed {} namespace(s) of runs that no longer exist: {}",
                stale.len(),
                stale.join(" ")
            ),
            Ok(_) => {}
            Err(e) => eprintln!("xtask hosts: could not remove the leftovers of earlier runs: {e}"),
        }
        // Hosts made to be kept (`hosts up`) outlive this process: their names carry no bare
        // pid, so that the next run does not take them for a dead run's leftovers.
        let id = if kept {
            format!("{PREFIX}up{}", std::process::id())
        } else {
            format!("{PREFIX}{}", std::process::id())
        };
        let dir = std::env::temp_dir().join(&id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut tb = Testbed {
            id,
            hosts,
            dir,
            inodes: Vec::new(),
            keep: false,
            removed: false,
        };
        tb.create()?;
        Ok(tb)
    }

    fn create(&mut self) -> Result<(), String> {
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..self.hosts {
            let ns = self.ns(i);
            let port = format!("h{i}");
            let cidr = format!("{}/24", self.addr(i));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        for i in 0..=self.hosts {
            let name = if i == self.hosts {
                self.switch()
            } else {
                self.ns(i)
            };
            let md = std::fs::metadata(format!("/run/netns/{name}"))
                .map_err(|e| format!("/run/netns/{name}: {e}"))?;
            self.inodes.push(md.ino());
        }
        // The hostfile and Open MPI's launch agent: `agent HOST COMMAND` runs COMMAND (a shell
        // command line) in the namespace of HOST, under that host's name.
        let mut hostfile = String::new();
        let mut cases = String::new();
        for i in 0..self.hosts {
            hostfile.push_str(&format!("{} slots={PER_HOST}\n", self.addr(i)));
            cases.push_str(&format!(
                "  {}|{}) ns={} ;;\n",
                self.addr(i),
                self.ns(i),
                self.ns(i)
            ));
        }
        std::fs::write(self.hostfile(), hostfile).map_err(|e| format!("hostfile: {e}"))?;
        let agent = format!(
            "#!/bin/sh\n\
             # Open MPI launch agent of the test hosts: AGENT HOST COMMAND... runs COMMAND in\n\
             # the network namespace of HOST (its address or its name), under its host name.\n\
             host=\"$1\"; shift\n\
             case \"$host\" in\n{cases}  *) echo \"launch agent: unknown test host '$host'\" >&2; exit 255 ;;\n\
             esac\n\
             exec ip netns exec \"$ns\" unshare --uts sh -c 'hostname \"$0\" && exec sh -c \"$1\"' \"$ns\" \"$*\"\n"
        );
        let path = self.agent();
        std::fs::write(&path, agent).map_err(|e| format!("agent script: {e}"))?;
        let chmod = Command::new("chmod").arg("755").arg(&path).status();
        if !chmod.is_ok_and(|s| s.success()) {
            return Err(format!("cannot make {} executable", path.display()));
        }
        Ok(())
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.id)
    }
    /// The namespace (and host name) of host `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.id)
    }
    /// The address of host `i`.
    pub fn addr(&self, i: usize) -> String {
        format!("{SUBNET}.{}", i + 1)
    }
    fn hostfile(&self) -> PathBuf {
        self.dir.join("hostfile")
    }
    fn agent(&self) -> PathBuf {
        self.dir.join("agent.sh")
    }

    /// `program args` in host `i`, under its host name: the process started is `ip`, which
    /// execs `unshare`, then `sh`, then the program, so the child's pid is the program's.
    pub fn command(&self, i: usize, program: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i), "unshare", "--uts", "sh", "-c"])
            .arg("hostname \"$0\" && exec \"$@\"")
            .arg(self.ns(i))
            .arg(program)
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// Takes host `i`'s link down (its end on the bridge).
    pub fn cut(&self, i: usize) -> Result<(), String> {
        ip(&[
            "-n",
            &self.switch(),
            "link",
            "set",
            &format!("h{i}"),
            "down",
        ])
    }

    /// Brings every host's link up again (after a cut), forgets the neighbours marked
    /// unreachable meanwhile, and waits (at most 10 s) until every host reaches host 0 again.
    pub fn restore(&self) -> Result<(), String> {
        for i in 0..self.hosts {
            ip(&["-n", &self.switch(), "link", "set", &format!("h{i}"), "up"])?;
        }
        for i in 0..self.hosts {
            ip(&["-n", &self.ns(i), "neigh", "flush", "all"])?;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 1..self.hosts {
            while !self.reaches(i, 0) {
                if Instant::now() > deadline {
                    return Err(format!(
                        "host {} does not reach {} 10 s after its link came back",
                        self.ns(i),
                        self.addr(0)
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    /// Whether host `from` reaches host `to`: a TCP connection to port 9 (nothing listens) is
    /// refused, rather than failing for want of a route or an answer.
    fn reaches(&self, from: usize, to: usize) -> bool {
        let probe = format!("exec 3<>/dev/tcp/{}/9", self.addr(to));
        let out = self
            .command(from, Path::new("timeout"), &["2", "bash", "-c", &probe])
            .output();
        out.is_ok_and(|o| String::from_utf8_lossy(&o.stderr).contains("refused"))
    }

    /// The processes in the namespaces of this test bed.
    fn processes(&self) -> Vec<u32> {
        processes_in(&self.inodes)
    }

    /// Kills every process in the namespaces, removes them and the run directory; then checks
    /// that no namespace and no process of the run is left.
    pub fn down(&mut self) -> Result<(), String> {
        self.removed = true;
        kill_all(&self.inodes);
        let mut errors = Vec::new();
        for i in 0..=self.hosts {
            let name = if i == self.hosts {
                self.switch()
            } else {
                self.ns(i)
            };
            if Path::new("/run/netns").join(&name).exists() {
                if let Err(e) = ip(&["netns", "del", &name]) {
                    errors.push(e);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let left: Vec<String> = list_namespaces()
            .into_iter()
            .filter(|n| n.starts_with(&format!("{}-", self.id)))
            .collect();
        if !left.is_empty() {
            errors.push(format!("namespaces left behind: {}", left.join(" ")));
        }
        let procs = self.processes();
        if !procs.is_empty() {
            errors.push(format!(
                "processes left behind in the test hosts: {procs:?}"
            ));
        }
        if self.dir.exists() {
            errors.push(format!("{} left behind", self.dir.display()));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Leaves the hosts in place when dropped (`hosts up`).
    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if !self.keep && !self.removed {
            if let Err(e) = self.down() {
                eprintln!("xtask hosts: teardown: {e}");
            }
        }
    }
}

fn list_namespaces() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Pids of the processes whose network namespace is one of `inodes`.
fn processes_in(inodes: &[u64]) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(link) = std::fs::read_link(e.path().join("ns/net")) {
            let l = link.to_string_lossy();
            let ino = l
                .strip_prefix("net:[")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u64>().ok());
            if ino.is_some_and(|i| inodes.contains(&i)) {
                out.push(pid);
            }
        }
    }
    out
}

/// SIGKILL to every process in the namespaces, until none is left (at most 5 s).
fn kill_all(inodes: &[u64]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let procs = processes_in(inodes);
        if procs.is_empty() || Instant::now() > deadline {
            return;
        }
        for p in procs {
            let _ = Command::new("kill")
                .args(["-KILL", &p.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn up(n: usize) -> i32 {
    if let Err(why) = available() {
        eprintln!("xtask hosts up: {why}");
        return 1;
    }
    let tb = match Testbed::up(n, true) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("xtask hosts up: {e}");
            return 1;
        }
    };
    println!(
        "{n} test hosts (network namespaces on bridge br0 in {}):",
        tb.switch()
    );
    for i in 0..n {
        println!("  {}  {}", tb.ns(i), tb.addr(i));
    }
    println!("hostfile:     {}", tb.hostfile().display());
    println!("launch agent: {}", tb.agent().display());
    println!(
        "run a command in host 1:  ip netns exec {} COMMAND",
        tb.ns(1)
    );
    println!(
        "cut host 1's link:        ip -n {} link set h1 down",
        tb.switch()
    );
    println!("remove them:              cargo xtask hosts down");
    tb.keep();
    0
}

/// Removes every `gridhost-` namespace (killing its processes) and run directory.
pub fn down_all() -> Result<Vec<String>, String> {
    remove_where(&|_| true)
}

/// The pid in a name `gridhost-<pid>...`.
fn run_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Removes the namespaces and run directories of runs whose process no longer exists (a run
/// killed by a signal cannot clean up after itself); those of live processes are left alone,
/// so parallel runs do not disturb each other.
pub fn remove_stale() -> Result<Vec<String>, String> {
    remove_where(&|name| run_pid(name).is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()))
}

/// Removes the `gridhost-` namespaces and run directories whose name `keep` accepts.
fn remove_where(keep: &dyn Fn(&str) -> bool) -> Result<Vec<String>, String> {
    let names: Vec<String> = list_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(PREFIX) && keep(n))
        .collect();
    let inodes: Vec<u64> = names
        .iter()
        .filter_map(|n| std::fs::metadata(format!("/run/netns/{n}")).ok())
        .map(|m| m.ino())
        .collect();
    kill_all(&inodes);
    let mut errors = Vec::new();
    for n in &names {
        if let Err(e) = ip(&["netns", "del", n]) {
            errors.push(e);
        }
    }
    if let Ok(d) = std::fs::read_dir(std::env::temp_dir()) {
        for e in d.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) && keep(&name) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    if errors.is_empty() {
        Ok(names)
    } else {
        Err(errors.join("; "))
    }
}

// ------------------------------------------------------------------------------------------
// Processes with deadlines
// ------------------------------------------------------------------------------------------

/// What one process did.
struct Finished {
    /// Exit code (`None`: killed by a signal, or by us at the deadline).
    code: Option<i32>,
    killed_at_deadline: bool,
    stdout: String,
    stderr: String,
    /// Each line of its standard output with the moment it arrived.
    lines: Vec<(String, Instant)>,
    /// When it was seen ended (`None`: killed by us).
    ended: Option<Instant>,
}

/// How a process ended: exit code, killed at the deadline, when it was seen ended.
type Ended = (Option<i32>, bool, Option<Instant>);

/// Processes started together, their output read line by line as it comes.
struct Running {
    children: Vec<Child>,
    rx: mpsc::Receiver<(usize, bool, String, Instant)>,
    stdout: Vec<Vec<(String, Instant)>>,
    stderr: Vec<String>,
}

impl Running {
    fn start(commands: Vec<Command>) -> Result<Running, String> {
        let (tx, rx) = mpsc::channel();
        let mut children = Vec::new();
        for (i, c) in commands.into_iter().enumerate() {
            let mut child = match spawn(c) {
                Ok(ch) => ch,
                Err(e) => {
                    for mut ch in children {
                        let _ = Child::kill(&mut ch);
                        let _ = ch.wait();
                    }
                    return Err(e);
                }
            };
            if let Some(o) = child.stdout.take() {
                reader(o, i, false, tx.clone());
            }
            if let Some(e) = child.stderr.take() {
                reader(e, i, true, tx.clone());
            }
            children.push(child);
        }
        let n = children.len();
        Ok(Running {
            children,
            rx,
            stdout: vec![Vec::new(); n],
            stderr: vec![String::new(); n],
        })
    }

    /// Takes the next line, waiting at most 50 ms and not past `deadline`; `false` once every
    /// reader has ended (the channel's senders are the reader threads only).
    fn pump(&mut self, deadline: Instant) -> bool {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(wait.min(Duration::from_millis(50))) {
            Ok((i, is_err, line, at)) => {
                if is_err {
                    self.stderr[i].push_str(&line);
                    self.stderr[i].push('\n');
                } else {
                    self.stdout[i].push((line, at));
                }
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => true,
            Err(mpsc::RecvTimeoutError::Disconnected) => false,
        }
    }

    /// Waits until `count` standard-output lines (of all processes together) satisfy `pred`,
    /// or `deadline`; returns how many did.
    fn wait_lines(
        &mut self,
        pred: &dyn Fn(&str) -> bool,
        count: usize,
        deadline: Instant,
    ) -> usize {
        loop {
            let n = self
                .stdout
                .iter()
                .flatten()
                .filter(|(l, _)| pred(l))
                .count();
            if n >= count || Instant::now() >= deadline || !self.pump(deadline) {
                return n;
            }
        }
    }

    /// Waits for every process, killing those still running at `deadline` together with every
    /// process in the test hosts (so that no pipe stays open), then reads the rest of the output.
    fn finish(mut self, tb: &Testbed, deadline: Instant) -> Vec<Finished> {
        let n = self.children.len();
        let mut done: Vec<Option<Ended>> = vec![None; n];
        while done.iter().any(Option::is_none) {
            let late = Instant::now() >= deadline;
            for (i, c) in self.children.iter_mut().enumerate() {
                if done[i].is_some() {
                    continue;
                }
                match c.try_wait() {
                    Ok(Some(s)) => done[i] = Some((s.code(), false, Some(Instant::now()))),
                    Ok(None) if late => {
                        let _ = c.kill();
                        let _ = c.wait();
                        done[i] = Some((None, true, None));
                    }
                    Ok(None) => {}
                    Err(_) => done[i] = Some((None, false, None)),
                }
            }
            if late {
                kill_all(&tb.inodes);
            }
            self.pump(deadline.max(Instant::now() + Duration::from_millis(20)));
        }
        // The pipes close when the last process holding them ends (mpirun's daemons too).
        let drain = Instant::now() + Duration::from_secs(10);
        while Instant::now() < drain && self.pump(drain) {}
        done.into_iter()
            .enumerate()
            .map(|(i, d)| {
                let (code, killed, ended) = d.unwrap_or((None, false, None));
                let lines = std::mem::take(&mut self.stdout[i]);
                Finished {
                    code,
                    killed_at_deadline: killed,
                    stdout: lines.iter().map(|(l, _)| format!("{l}\n")).collect(),
                    stderr: std::mem::take(&mut self.stderr[i]),
                    lines,
                    ended,
                }
            })
            .collect()
    }
}

/// Sends each line of `r` as `(index, is_stderr, line, when)`.
fn reader<R: Read + Send + 'static>(
    r: R,
    index: usize,
    is_err: bool,
    tx: mpsc::Sender<(usize, bool, String, Instant)>,
) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    if tx.send((index, is_err, line, Instant::now())).is_err() {
                        break;
                    }
                }
            }
        }
    });
}

fn spawn(mut c: Command) -> Result<Child, String> {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", c.get_program()))
}

/// The value of `"key":` in a one-line JSON object written by our programs (a string, a number,
/// `true`, `false` or `null`), unescaped enough for messages.
fn json_field(line: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\":");
    let rest = &line[line.find(&pat)? + pat.len()..];
    if let Some(s) = rest.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => out.push('\n'),
                    Some(o) => out.push(o),
                    None => break,
                },
                '"' => return Some(out),
                c => out.push(c),
            }
        }
        None
    } else {
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        Some(rest[..end].trim().to_string())
    }
}

/// The JSON lines (`{"rank":...`) of an output.
fn rank_lines(out: &str) -> Vec<String> {
    out.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("{\"rank\":"))
        .map(str::to_string)
        .collect()
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ------------------------------------------------------------------------------------------
// The scenarios
// ------------------------------------------------------------------------------------------

/// Creates the test bed, runs `names`, tears it down (also on failure or panic) and checks
/// that nothing is left. Prints one line per scenario as it ends, then one for the cleanup.
fn run_scenarios(names: &[&str]) -> Result<(), String> {
    let started = Instant::now();
    let mut tb = Testbed::up(HOSTS, false)?;
    println!(
        "xtask hosts: {HOSTS} test hosts {}..{} at {SUBNET}.1..{HOSTS}, {PER_HOST} ranks each",
        tb.ns(0),
        tb.ns(HOSTS - 1)
    );
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for name in names {
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| scenario(&tb, name)))
            .unwrap_or_else(|p| {
                Err(format!(
                    "panicked: {}",
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("?")
                ))
            });
        // Whatever the scenario left running in the hosts ends here, and a cut link comes back.
        kill_all(&tb.inodes);
        let r = r.and_then(|d| tb.restore().map(|()| d));
        let secs = t.elapsed().as_secs_f64();
        match r {
            Ok(detail) => lines.push(format!("  ok     {name:<16} {secs:>6.1} s  {detail}")),
            Err(e) => {
                lines.push(format!("  FAILED {name:<16} {secs:>6.1} s  {e}"));
                failed.push(*name);
            }
        }
        println!("{}", lines.last().map(String::as_str).unwrap_or(""));
    }
    let teardown = tb.down();
    lines.push(match &teardown {
        Ok(()) => format!(
            "  ok     {:<16} no namespace, link or process of the run left ({:.1} s in all)",
            "cleanup",
            started.elapsed().as_secs_f64()
        ),
        Err(e) => format!("  FAILED {:<16} {e}", "cleanup"),
    });
    println!("{}", lines.last().map(String::as_str).unwrap_or(""));
    if failed.is_empty() && teardown.is_ok() {
        Ok(())
    } else {
        let mut why: Vec<String> = failed.iter().map(|s| s.to_string()).collect();
        if let Err(e) = teardown {
            why.push(format!("cleanup ({e})"));
        }
        Err(format!("failed: {}", why.join(", ")))
    }
}

fn scenario(tb: &Testbed, name: &str) -> Result<String, String> {
    match name {
        "mpi-conformance" => mpi_check(tb, "conformance", 300),
        "mpi-collection" => mpi_check(tb, "collection", 120),
        "mpi-pipeline" => mpi_check(tb, "pipeline", 120),
        // Gloo across hosts: the suite's sweeps on the world communicator only. At 8 processes
        // on 2 cores the full suite (every dtype and reduction again on each of its three
        // sub-groups) took 102-107 s per store at load 7-9, most of the step's budget; the
        // threads test `backend-gloo::conformance` runs the full suite at 8 ranks.
        "gloo-redis" => gloo_check(tb, "conformance-quick", Store::Redis),
        "gloo-file" => gloo_check(tb, "conformance-quick", Store::Dir),
        "gloo-pipeline" => gloo_check(tb, "pipeline", Store::Redis),
        "cut-gloo" => cut(tb, "gloo"),
        "cut-mpi" => cut(tb, "mpi"),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// The environment of an mpirun over the test hosts: the launch agent, TCP on the test subnet
/// only, no shared memory.
fn mpi_env(tb: &Testbed) -> Vec<(String, String)> {
    let subnet = format!("{SUBNET}.0/24");
    [
        ("OMPI_ALLOW_RUN_AS_ROOT", "1".to_string()),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1".to_string()),
        ("OMPI_MCA_plm_rsh_agent", tb.agent().display().to_string()),
        ("OMPI_MCA_btl", "tcp,self".to_string()),
        ("OMPI_MCA_pml", "ob1".to_string()),
        ("OMPI_MCA_btl_tcp_if_include", subnet.clone()),
        ("OMPI_MCA_oob_tcp_if_include", subnet),
        ("OMPI_MCA_rmaps_base_oversubscribe", "0".to_string()),
        // The hostfile gives 8 slots, so Open MPI does not know that the 8 ranks share 2 cores:
        // without this, every rank spins while it waits.
        ("OMPI_MCA_mpi_yield_when_idle", "1".to_string()),
        // Session directories in the run's directory, removed with it: a scenario that cuts
        // a host leaves mpirun's and the daemons' directories behind (8 MB each in /tmp).
        ("OMPI_MCA_orte_tmpdir_base", tb.dir.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// `mpirun -np 8 --hostfile ... program args`, started in host 0.
fn mpirun(tb: &Testbed, timeout_s: u64, extra: &[&str], program: &Path, args: &[&str]) -> Command {
    let hostfile = tb.hostfile().display().to_string();
    let np = (HOSTS * PER_HOST).to_string();
    let timeout = timeout_s.to_string();
    let mut a: Vec<&str> = vec!["-np", &np, "--hostfile", &hostfile, "--timeout", &timeout];
    a.extend_from_slice(extra);
    let p = program.display().to_string();
    a.push(&p);
    a.extend_from_slice(args);
    let mut c = tb.command(0, Path::new("mpirun"), &a);
    for (k, v) in mpi_env(tb) {
        c.env(k, v);
    }
    c
}

/// Checks the 8 JSON lines of a `multihost-rank` run: every rank reported success from the
/// host it belongs on. Returns rank 0's detail.
fn check_rank_lines(tb: &Testbed, lines: &[String], check: &str) -> Result<String, String> {
    let mut seen = [false; HOSTS * PER_HOST];
    let mut detail0 = String::new();
    for l in lines {
        let rank: usize = json_field(l, "rank")
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| format!("a line without a rank: {l}"))?;
        if rank >= seen.len() {
            return Err(format!("rank {rank} out of range: {l}"));
        }
        if json_field(l, "ok").as_deref() != Some("true") {
            return Err(format!(
                "rank {rank} failed {check}: {}",
                json_field(l, "detail").unwrap_or_default()
            ));
        }
        let host = json_field(l, "host").unwrap_or_default();
        let want = tb.ns(rank / PER_HOST);
        if host != want {
            return Err(format!(
                "rank {rank} ran on host {host:?}, expected {want:?}"
            ));
        }
        seen[rank] = true;
        if rank == 0 {
            detail0 = json_field(l, "detail").unwrap_or_default();
        }
    }
    let missing: Vec<usize> = (0..seen.len()).filter(|r| !seen[*r]).collect();
    if !missing.is_empty() {
        return Err(format!("no result from ranks {missing:?}"));
    }
    Ok(detail0)
}

fn mpi_check(tb: &Testbed, check: &str, timeout_s: u64) -> Result<String, String> {
    let c = mpirun(
        tb,
        timeout_s,
        &[],
        &program("multihost-rank"),
        &["--backend", "mpi", "--check", check],
    );
    let run = Running::start(vec![c])?;
    let f = run
        .finish(tb, Instant::now() + Duration::from_secs(timeout_s + 30))
        .pop()
        .ok_or("no result")?;
    let lines = rank_lines(&f.stdout);
    let r = check_rank_lines(tb, &lines, check);
    if f.code != Some(0) || r.is_err() {
        return Err(format!(
            "mpirun exit {:?}{}: {}\n{}\n{}",
            f.code,
            if f.killed_at_deadline {
                " (killed at the deadline)"
            } else {
                ""
            },
            r.err().unwrap_or_default(),
            tail(&f.stdout, 20),
            tail(&f.stderr, 20)
        ));
    }
    Ok(format!(
        "mpirun --hostfile (4 hosts x 2), tcp only: rank 0: {}",
        r.unwrap_or_default()
    ))
}

#[derive(Clone, Copy)]
enum Store {
    Redis,
    Dir,
}

/// A redis-server in host 0, on its address; killed when dropped.
struct Redis {
    child: Child,
    url: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis(tb: &Testbed) -> Result<Redis, String> {
    let addr = tb.addr(0);
    let port = "6379";
    let mut c = tb.command(
        0,
        Path::new("redis-server"),
        &[
            "--bind",
            &addr,
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ],
    );
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let child = c
        .spawn()
        .map_err(|e| format!("cannot start redis-server: {e}"))?;
    let redis = Redis {
        child,
        url: format!("redis://{addr}:{port}"),
    };
    // Ready when a client in another host gets an answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = tb
            .command(
                1,
                Path::new("redis-cli"),
                &["-h", &addr, "-p", port, "ping"],
            )
            .output()
            .map_err(|e| format!("redis-cli: {e}"))?;
        if String::from_utf8_lossy(&o.stdout).trim() == "PONG" {
            return Ok(redis);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "redis-server in {} did not answer on {addr}:{port} within 10 s",
                tb.ns(0)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The commands of 8 Gloo ranks of `multihost-rank --backend gloo args`, rank `r` in host
/// `r / 2` with its device on the host's address, meeting through `store`.
fn gloo_ranks(tb: &Testbed, args: &[&str], store: &str, job: &str) -> Vec<Command> {
    let mut a = vec!["--backend", "gloo"];
    a.extend_from_slice(args);
    (0..HOSTS * PER_HOST)
        .map(|r| {
            let host = r / PER_HOST;
            let mut c = tb.command(host, &program("multihost-rank"), &a);
            c.env("RANK", r.to_string())
                .env("WORLD_SIZE", (HOSTS * PER_HOST).to_string())
                .env("GRID_GLOO_HOSTNAME", tb.addr(host))
                .env("GRID_GLOO_STORE", store)
                .env("GRID_GLOO_JOB_ID", job)
                .env("GRID_GLOO_TIMEOUT_MS", "60000")
                .env("RUST_BACKTRACE", "0");
            c
        })
        .collect()
}

/// The store of a Gloo scenario: a Redis server in host 0, or a fresh shared directory.
fn gloo_store(
    tb: &Testbed,
    store: Store,
    tag: &str,
) -> Result<(Option<Redis>, String, String), String> {
    match store {
        Store::Redis => {
            let r = start_redis(tb)?;
            let url = r.url.clone();
            let how = format!("redis-server in {} ({url})", tb.ns(0));
            Ok((Some(r), url, how))
        }
        Store::Dir => {
            let d = tb.dir.join(format!("store-{tag}"));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            Ok((
                None,
                format!("file:{}", d.display()),
                format!("the shared directory {}", d.display()),
            ))
        }
    }
}

fn gloo_check(tb: &Testbed, check: &str, store: Store) -> Result<String, String> {
    let job = format!("{check}-{}", std::process::id());
    let (_redis, location, how) = gloo_store(tb, store, check)?;
    let run = Running::start(gloo_ranks(tb, &["--check", check], &location, &job))?;
    let done = run.finish(tb, Instant::now() + Duration::from_secs(240));
    let lines: Vec<String> = done.iter().flat_map(|f| rank_lines(&f.stdout)).collect();
    let r = check_rank_lines(tb, &lines, check);
    let bad: Vec<String> = done
        .iter()
        .enumerate()
        .filter(|(_, f)| f.code != Some(0))
        .map(|(r, f)| {
            format!(
                "rank {r}: exit {:?}{}\n{}",
                f.code,
                if f.killed_at_deadline {
                    " (killed at the deadline)"
                } else {
                    ""
                },
                tail(&f.stderr, 10)
            )
        })
        .collect();
    match r {
        Ok(d) if bad.is_empty() => Ok(format!("gloo through {how}: rank 0: {d}")),
        Ok(_) => Err(bad.join("\n")),
        Err(e) => Err(format!("{e}\n{}", bad.join("\n"))),
    }
}

/// Whether `error` is one of the library's failure errors (Timeout, PeerFailed, Aborted) and
/// names a rank.
fn is_failure_error(error: &str) -> bool {
    let kind = error.contains("timed out after")
        || (error.contains("peer rank ") && error.contains(" failed"))
        || error.contains("aborted");
    let names_rank = error
        .match_indices("rank ")
        .any(|(i, m)| error[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()));
    kind && names_rank
}

/// An MPI collective past its limit cannot tell which peer it waited for: a timeout naming the
/// operation and the communicator with its world ranks.
fn is_mpi_timeout(error: &str) -> bool {
    error.contains("timed out after")
        && error.contains("on communicator '")
        && error.contains("(world ranks ")
}

/// Host 3's link goes down while the 8 ranks loop over checked all-reduces (every operation
/// limited to [`CUT_TIMEOUT_MS`]), once every rank has printed that it loops. Every rank on
/// hosts 0..2 must report, by itself, a failure error naming a rank within the timeout plus
/// [`CUT_MARGIN`] of the cut; nothing may hang (every process has a hard deadline).
///
/// MPI runs under `mpirun --enable-recovery --mca orte_abort_on_non_zero_status 0` (as
/// docs/when-a-job-fails.md says, so that every rank can report); what mpirun itself then does
/// with a daemon it cannot reach is recorded in the result.
fn cut(tb: &Testbed, backend: &str) -> Result<String, String> {
    let timeout = CUT_TIMEOUT_MS.to_string();
    let args = [
        "--check",
        "loop",
        "--seconds",
        "120",
        "--bytes",
        "4096",
        "--timeout-ms",
        &timeout,
    ];
    let start = Instant::now();
    let (_redis, commands) = if backend == "gloo" {
        let (redis, location, _) = gloo_store(tb, Store::Redis, "cut")?;
        let job = format!("cut-{}", std::process::id());
        (redis, gloo_ranks(tb, &args, &location, &job))
    } else {
        let mut a = vec!["--backend", "mpi"];
        a.extend_from_slice(&args);
        let c = mpirun(
            tb,
            MPI_CUT_JOB_TIMEOUT_S,
            &[
                "--enable-recovery",
                "--mca",
                "orte_abort_on_non_zero_status",
                "0",
                // mpirun notices a daemon it cannot reach by TCP keepalive on its out-of-band
                // connection: 300 s + 9 x 20 s by default; here 10 s + 3 x 2 s, after the
                // survivors' own timeouts (5 s).
                "--mca",
                "oob_tcp_keepalive_time",
                "10",
                "--mca",
                "oob_tcp_keepalive_intvl",
                "2",
                "--mca",
                "oob_tcp_keepalive_probes",
                "3",
            ],
            &program("multihost-rank"),
            &a,
        );
        (None, vec![c])
    };
    let mut run = Running::start(commands)?;
    let n = HOSTS * PER_HOST;
    let looping = run.wait_lines(
        &|l| l.contains("\"looping\":true"),
        n,
        start + Duration::from_secs(90),
    );
    if looping < n {
        let done = run.finish(tb, Instant::now());
        let out: Vec<String> = done
            .iter()
            .map(|f| format!("{}{}", tail(&f.stdout, 10), tail(&f.stderr, 10)))
            .collect();
        return Err(format!(
            "only {looping} of {n} ranks reached their loop within 90 s:\n{}",
            out.join("\n")
        ));
    }
    std::thread::sleep(Duration::from_millis(500));
    tb.cut(HOSTS - 1)?;
    let cut = Instant::now();
    let limit = Duration::from_millis(CUT_TIMEOUT_MS) + CUT_MARGIN;
    // Gloo ranks end by themselves (a hang is killed at the hard deadline and fails the test).
    // mpirun does not end while the cut host's daemon is unreachable (Open MPI 4.1 waits for
    // it: until its --timeout, or until TCP keepalive gives up on the daemon's out-of-band
    // connection, 300 s + 9 x 20 s by default): once the survivors have had their timeout plus
    // the margin to report, the harness ends it and every process in the hosts.
    let deadline = if backend == "gloo" {
        cut + CUT_HARD
    } else {
        cut + limit + MPI_GRACE
    };
    let done = run.finish(tb, deadline);
    // The end line of each rank, with when it arrived.
    let mut ends: Vec<Option<(String, Instant)>> = vec![None; n];
    for f in &done {
        for (l, at) in &f.lines {
            if !l.starts_with("{\"rank\":") || json_field(l, "ok").is_none() {
                continue;
            }
            if let Some(r) = json_field(l, "rank").and_then(|r| r.parse::<usize>().ok()) {
                if r < n {
                    ends[r] = Some((l.clone(), *at));
                }
            }
        }
    }
    let mut problems = Vec::new();
    let mut worst = Duration::ZERO;
    let mut sample = String::new();
    for (r, end) in ends.iter().enumerate().take((HOSTS - 1) * PER_HOST) {
        let Some((line, at)) = end else {
            problems.push(format!("rank {r} reported nothing"));
            continue;
        };
        let error = json_field(line, "detail").unwrap_or_default();
        let completed: u64 = json_field(line, "completed")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let after = at.saturating_duration_since(cut);
        worst = worst.max(after);
        if json_field(line, "ok").as_deref() != Some("false") {
            problems.push(format!("rank {r} did not fail: {line}"));
        } else if completed < 3 {
            problems.push(format!(
                "rank {r} completed {completed} all-reduces, not even the 3 before the cut: {line}"
            ));
        } else if !(is_failure_error(&error) || backend == "mpi" && is_mpi_timeout(&error)) {
            problems.push(format!(
                "rank {r}: not a failure error naming a rank: {error:?}"
            ));
        } else if after > limit {
            problems.push(format!(
                "rank {r} reported {:.1} s after the cut, over the timeout plus margin {:.1} s",
                after.as_secs_f64(),
                limit.as_secs_f64()
            ));
        }
        if r == 0 {
            sample = error;
        }
    }
    let processes = if backend == "gloo" {
        for (r, f) in done.iter().enumerate().take((HOSTS - 1) * PER_HOST) {
            if f.killed_at_deadline {
                problems.push(format!("rank {r} hung: killed at the deadline"));
            } else if f.code != Some(1) {
                problems.push(format!(
                    "rank {r}: exit {:?}, expected 1: {}",
                    f.code,
                    tail(&f.stderr, 5)
                ));
            }
        }
        "every survivor exited with 1".to_string()
    } else {
        let f = done.first().ok_or("no mpirun result")?;
        match (f.code, f.ended) {
            (Some(0), _) => {
                problems.push("mpirun exited with 0 after a cut host".into());
                String::new()
            }
            (code, Some(e)) => format!(
                "mpirun exit {code:?} {:.1} s after the cut",
                e.saturating_duration_since(cut).as_secs_f64()
            ),
            (_, None) => format!(
                "mpirun still waiting for the unreachable daemon {:.0} s after the cut, ended by the harness",
                (limit + MPI_GRACE).as_secs_f64()
            ),
        }
    };
    if !problems.is_empty() {
        let out: Vec<String> = done
            .iter()
            .map(|f| format!("{}\n{}", tail(&f.stdout, 12), tail(&f.stderr, 12)))
            .collect();
        return Err(format!("{}\n{}", problems.join("\n"), out.join("\n")));
    }
    Ok(format!(
        "6 survivors reported {:.1} s at worst after the cut (limit {} ms + {} s), {processes}; rank 0: {}",
        worst.as_secs_f64(),
        CUT_TIMEOUT_MS,
        CUT_MARGIN.as_secs(),
        sample.chars().take(200).collect::<String>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_json_fields() {
        let l = r#"{"rank":3,"completed":12,"error":"all_reduce #4: timed out after 5000 ms waiting for rank 7 \"x\""}"#;
        assert_eq!(json_field(l, "rank").as_deref(), Some("3"));
        assert_eq!(json_field(l, "completed").as_deref(), Some("12"));
        assert_eq!(
            json_field(l, "error").as_deref(),
            Some("all_reduce #4: timed out after 5000 ms waiting for rank 7 \"x\"")
        );
        assert_eq!(
            json_field(r#"{"rank":1,"error":null}"#, "error").as_deref(),
            Some("null")
        );
        assert_eq!(json_field(l, "host"), None);
    }

    #[test]
    fn reads_run_pids() {
        assert_eq!(run_pid("gridhost-123-h0"), Some(123));
        assert_eq!(run_pid("gridhost-123"), Some(123));
        assert_eq!(run_pid("gridhost-probe-5"), None);
        assert_eq!(run_pid("gridhost-up77-h0"), None);
        assert_eq!(run_pid("other-123-h0"), None);
    }

    #[test]
    fn recognises_failure_errors() {
        assert!(is_failure_error(
            "all_reduce #4 on communicator 'w0': timed out after 5000 ms waiting for rank 7"
        ));
        assert!(is_failure_error(
            "all_reduce #4: peer rank 6 failed: lost the connection"
        ));
        assert!(!is_failure_error("timed out after 5000 ms"));
        assert!(!is_failure_error(
            "all-reduce 5 returned 7 at element 0, expected 10"
        ));
    }
}
