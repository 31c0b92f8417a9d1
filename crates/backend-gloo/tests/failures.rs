//! Failures with ranks as real processes (this test binary started once per rank, the
//! torchrun way): timeouts that are real bounds, "no limit", rendezvous timeouts that list the
//! ranks that never arrived, and the rank that failed first blamed by every survivor.
//!
//! Margins asserted here (documented in docs/backends.md §2.4):
//! * a rendezvous fails within its timeout + 1.5 s (the deadline is shared by every phase; the
//!   store is polled every 10 ms at most), or + 2 s when the Redis server stops answering;
//! * an operation that fails because a rank was killed or stopped fails within the timeout +
//!   3 s: up to 2 s to find the rank that failed first (`GRACE`, twice when several ranks are
//!   silent), the rest for the scheduling of 6 to 8 processes on a loaded 2-core machine.
//!
//! Every child is killed when the test's deadline passes, so a hang fails the test instead of
//! blocking it.

mod common;

use common::procs::{forward_output, start_redis};

use backend_gloo::{env, init_from_env};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Set in the environment of the child processes.
const CHILD: &str = "GRID_GLOO_TEST_CHILD";
/// Milliseconds a child waits before its collective (the "no limit" test).
const DELAY_MS: &str = "GRID_GLOO_TEST_DELAY_MS";

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{tag}-{}-{nanos}", std::process::id())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

// ---- what a child reports ----------------------------------------------------------------------

/// `peer=<p or -> kind=<variant>`: the blamed rank and the kind of `e`.
fn describe(e: &Error) -> String {
    let (peer, kind) = match e {
        Error::PeerFailed { peer, .. } => (Some(*peer), "PeerFailed"),
        Error::Timeout { peer, .. } => (*peer, "Timeout"),
        Error::Library(_) => (None, "Library"),
        _ => (None, "Other"),
    };
    let peer = peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
    format!("peer={peer} kind={kind} :: {e}")
}

/// Child body of the rendezvous tests: meet, report, leave.
fn child_rendezvous() {
    let t = Instant::now();
    match init_from_env() {
        Ok((_f, world)) => {
            world.barrier().unwrap_or_else(|e| panic!("barrier: {e}"));
            println!("@@OK ms={}", t.elapsed().as_millis());
        }
        Err(e) => println!("@@FAILED ms={} {}", t.elapsed().as_millis(), describe(&e)),
    }
}

/// Child body of the blame tests: all-reduces until one fails, report, leave at once (the
/// connections of this rank close right away, as in a job whose ranks exit on error).
fn child_loop() {
    let (_factory, world) = init_from_env().unwrap_or_else(|e| panic!("init: {e}"));
    world.barrier().unwrap_or_else(|e| panic!("barrier: {e}"));
    println!("READY {}", world.rank());
    let start = Instant::now();
    let err = loop {
        let mut x = [0i64; 64];
        if let Err(e) = world.all_reduce_into(&[1i64; 64], &mut x, ReduceOp::Sum) {
            break e;
        }
        assert_eq!(x, [world.size() as i64; 64]);
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no failure within 120 s"
        );
    };
    println!("@@FAILED {}", describe(&err));
}

// ---- processes -------------------------------------------------------------------------------

/// Rank processes of one test, and every line they print with the time it arrived.
struct Ranks {
    test: &'static str,
    children: Vec<Option<Child>>,
    started: Vec<Option<Instant>>,
    tx: mpsc::Sender<(usize, String)>,
    rx: mpsc::Receiver<(usize, String)>,
    output: Vec<Vec<(String, Instant)>>,
}

impl Ranks {
    fn new(test: &'static str, n: usize) -> Ranks {
        let (tx, rx) = mpsc::channel();
        Ranks {
            test,
            children: (0..n).map(|_| None).collect(),
            started: vec![None; n],
            tx,
            rx,
            output: vec![Vec::new(); n],
        }
    }

    /// Starts rank `rank` of a world of `world` ranks (which may be larger than the number of
    /// processes of the test).
    fn start(&mut self, rank: usize, world: usize, store: &str, job: &str, timeout_ms: u64) {
        self.start_with(rank, world, store, job, timeout_ms, &[]);
    }

    fn start_with(
        &mut self,
        rank: usize,
        world: usize,
        store: &str,
        job: &str,
        timeout_ms: u64,
        extra: &[(&str, String)],
    ) {
        let exe = std::env::current_exe().expect("test binary path");
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", self.test, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, world.to_string())
            .env(env::STORE, store)
            .env(env::JOB_ID, job)
            .env(env::TIMEOUT_MS, timeout_ms.to_string())
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start a rank process");
        forward_output(&mut child, rank, &self.tx);
        self.started[rank] = Some(Instant::now());
        self.children[rank] = Some(child);
    }

    fn pid(&self, rank: usize) -> String {
        self.children[rank]
            .as_ref()
            .map(|c| c.id().to_string())
            .expect("a started rank")
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`) to rank `rank`.
    fn signal(&self, rank: usize, signal: &str) {
        let ok = Command::new("kill")
            .args([format!("-{signal}"), self.pid(rank)])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{signal} rank {rank}");
    }

    fn drain(&mut self) {
        while let Ok((r, line)) = self.rx.try_recv() {
            self.output[r].push((line, Instant::now()));
        }
    }

    /// The first line of `rank` containing `needle`, waiting until `deadline`.
    fn wait_line(
        &mut self,
        rank: usize,
        needle: &str,
        deadline: Instant,
    ) -> Option<(String, Instant)> {
        let mut exited: Option<Instant> = None;
        loop {
            self.drain();
            if let Some((l, t)) = self.output[rank].iter().find(|(l, _)| l.contains(needle)) {
                return Some((l.clone(), *t));
            }
            // A rank that has exited prints nothing more: stop waiting once its last lines
            // had time to arrive, instead of waiting out the deadline.
            if self.gone_for(rank, &mut exited) {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if let Ok((r, line)) = self.rx.recv_timeout(left.min(Duration::from_millis(50))) {
                self.output[r].push((line, Instant::now()));
            }
        }
    }

    /// Waits for `rank`'s report (`FAILED ...` or `OK ...`, printed after `@@`: the test
    /// harness may print on the same line first) until `deadline`; panics with every rank's
    /// output if it does not come.
    fn outcome(&mut self, rank: usize, deadline: Instant) -> (String, Instant) {
        let mut exited: Option<Instant> = None;
        loop {
            self.drain();
            if let Some((l, t)) = self.output[rank]
                .iter()
                .find_map(|(l, t)| l.split_once("@@").map(|(_, r)| (r, t)))
            {
                return (l.to_string(), *t);
            }
            if Instant::now() >= deadline {
                panic!("rank {rank} reported nothing in time\n{}", self.report());
            }
            if self.gone_for(rank, &mut exited) {
                panic!("rank {rank} exited without a report\n{}", self.report());
            }
            if let Ok((r, line)) = self.rx.recv_timeout(Duration::from_millis(20)) {
                self.output[r].push((line, Instant::now()));
            }
        }
    }

    /// Whether `rank`'s process has exited at least half a second ago (`exited` keeps when it
    /// was first seen gone), so that the lines it printed last have been forwarded.
    fn gone_for(&mut self, rank: usize, exited: &mut Option<Instant>) -> bool {
        if exited.is_none() {
            let gone = self.children[rank]
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if gone {
                *exited = Some(Instant::now());
            }
        }
        exited.is_some_and(|t| t.elapsed() >= Duration::from_millis(500))
    }

    fn report(&mut self) -> String {
        self.drain();
        self.output
            .iter()
            .enumerate()
            .map(|(r, lines)| {
                let text: Vec<&str> = lines.iter().map(|(l, _)| l.as_str()).collect();
                format!("--- rank {r}\n{}", text.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits for every started child until `deadline` (killing the rest then); returns
    /// whether each exited successfully.
    fn finish(&mut self, deadline: Instant) -> Vec<Option<bool>> {
        let mut status: Vec<Option<bool>> = vec![None; self.children.len()];
        loop {
            for (i, c) in self.children.iter_mut().enumerate() {
                if let (Some(c), None) = (c.as_mut(), status[i]) {
                    if let Ok(Some(s)) = c.try_wait() {
                        status[i] = Some(s.success());
                    }
                }
            }
            let running = self
                .children
                .iter()
                .zip(&status)
                .any(|(c, s)| c.is_some() && s.is_none());
            if !running || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for c in self.children.iter_mut().flatten() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.drain();
        status
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The value after `key=` in `line`, up to the next space.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..].split(' ').next()
}

fn file_store(job: &str) -> (PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("gloo-fail-{job}"));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("file:{}", dir.display());
    (dir, url)
}

/// Number of keys in a file store (its files, not the temporary ones being written).
fn key_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .count()
        })
        .unwrap_or(0)
}

fn wait_for(what: &str, deadline: Instant, mut cond: impl FnMut() -> bool) {
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

// ---- Redis -----------------------------------------------------------------------------------

// ---- rendezvous ------------------------------------------------------------------------------

/// Two rendezvous that cannot complete, side by side in one store: a world of 5 of which ranks
/// 1 and 3 never start, and a world mistyped as 30,000 of which ranks 0 and 1 start. Every
/// rank fails within the timeout + 1.5 s, and the error lists the ranks that never arrived.
fn missing_ranks_are_listed(test: &'static str, store: &str) {
    let timeout = secs(2.0);
    let mut ranks = Ranks::new(test, 7);
    let (small, huge) = (unique("five"), unique("huge"));
    for r in [0, 2, 4] {
        ranks.start(r, 5, store, &small, timeout.as_millis() as u64);
    }
    // Slots 5 and 6 of this test are ranks 0 and 1 of the mistyped world.
    for (slot, r) in [(5usize, 0usize), (6, 1)] {
        ranks.start_slot(slot, r, 30_000, store, &huge, timeout.as_millis() as u64);
    }
    for slot in [0, 2, 4, 5, 6] {
        let (line, at) = ranks.outcome(slot, Instant::now() + timeout + secs(30.0));
        let took = at - ranks.started[slot].expect("started");
        eprintln!("slot {slot}: {took:?}: {line}");
        assert!(line.starts_with("FAILED"), "slot {slot}: {line}");
        assert_eq!(field(&line, "kind"), Some("Library"), "slot {slot}: {line}");
        assert!(
            line.contains("timed out after 2000 ms"),
            "slot {slot}: {line}"
        );
        if slot < 5 {
            assert!(
                line.contains("2 ranks of 4 never arrived: ranks 1, 3"),
                "slot {slot}: {line}"
            );
        } else {
            assert!(
                line.contains("29998 ranks of 29999 never arrived: ranks 2-29999"),
                "slot {slot}: {line}"
            );
        }
        // The child's own clock: from its start to its error.
        let ms: u64 = field(&line, "ms")
            .and_then(|m| m.parse().ok())
            .expect("ms=");
        assert!(
            Duration::from_millis(ms) <= timeout + secs(1.5),
            "slot {slot} failed after {ms} ms: {line}"
        );
    }
    ranks.finish(Instant::now() + secs(10.0));
}

impl Ranks {
    /// [`Ranks::start`] for rank `rank` in output slot `slot` (several worlds in one test).
    fn start_slot(
        &mut self,
        slot: usize,
        rank: usize,
        world: usize,
        store: &str,
        job: &str,
        timeout_ms: u64,
    ) {
        // Start under the slot's number, then fix the rank in the environment.
        self.start_with(
            slot,
            world,
            store,
            job,
            timeout_ms,
            &[(env::RANK, rank.to_string())],
        );
    }
}

#[test]
fn rendezvous_lists_missing_ranks_file() {
    if in_child() {
        return child_rendezvous();
    }
    let (dir, url) = file_store(&unique("missing"));
    missing_ranks_are_listed("rendezvous_lists_missing_ranks_file", &url);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rendezvous_lists_missing_ranks_redis() {
    if in_child() {
        return child_rendezvous();
    }
    let Some(redis) = start_redis() else { return };
    missing_ranks_are_listed("rendezvous_lists_missing_ranks_redis", &redis.url());
}

/// Rank 3 of 4 arrives, publishes its addresses and is then killed (or stopped) before anyone
/// connects to it; the other ranks were held (SIGSTOP) meanwhile. Gloo alone would wait 5 ×
/// the timeout for its connection; here every other rank fails within the timeout + 1.5 s of
/// its own start, blaming rank 3.
fn dies_during_rendezvous(test: &'static str, signal: &str) {
    let timeout = secs(3.0);
    let job = unique("rdv-die");
    let (dir, url) = file_store(&job);
    let mut ranks = Ranks::new(test, 4);
    let deadline = Instant::now() + secs(60.0);
    for r in 0..3 {
        ranks.start(r, 4, &url, &job, timeout.as_millis() as u64);
    }
    // Their arrival keys.
    wait_for("ranks 0-2 to arrive", deadline, || key_files(&dir) >= 3);
    for r in 0..3 {
        ranks.signal(r, "STOP");
    }
    ranks.start(3, 4, &url, &job, timeout.as_millis() as u64);
    // Its arrival key and its addresses.
    wait_for("rank 3 to publish its addresses", deadline, || {
        key_files(&dir) >= 5
    });
    ranks.signal(3, signal);
    for r in 0..3 {
        ranks.signal(r, "CONT");
    }
    for r in 0..3 {
        let (line, at) = ranks.outcome(r, deadline);
        let took = at - ranks.started[r].expect("started");
        eprintln!("rank {r}: {took:?} after its start: {line}");
        assert!(
            line.starts_with("FAILED"),
            "rank {r}: {line}\n{}",
            ranks.report()
        );
        assert_eq!(field(&line, "peer"), Some("3"), "rank {r}: {line}");
        assert!(
            took <= timeout + secs(1.5),
            "rank {r} took {took:?}: {line}"
        );
    }
    if signal == "STOP" {
        ranks.signal(3, "KILL");
    }
    let status = ranks.finish(Instant::now() + secs(20.0));
    for (r, s) in status.iter().enumerate().take(3) {
        assert_eq!(*s, Some(true), "rank {r}\n{}", ranks.report());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killed_during_rendezvous() {
    if in_child() {
        return child_rendezvous();
    }
    dies_during_rendezvous("killed_during_rendezvous", "KILL");
}

#[test]
fn stopped_during_rendezvous() {
    if in_child() {
        return child_rendezvous();
    }
    dies_during_rendezvous("stopped_during_rendezvous", "STOP");
}

/// Child of the "no limit" test: rendezvous, then an all-reduce after `DELAY_MS`.
fn child_unlimited() {
    let t = Instant::now();
    let (_f, world) = init_from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let met = t.elapsed();
    let delay: u64 = std::env::var(DELAY_MS)
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    std::thread::sleep(Duration::from_millis(delay));
    let t = Instant::now();
    let mut sum = [0i32];
    world
        .all_reduce_into(&[1i32], &mut sum, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("all_reduce: {e}"));
    assert_eq!(sum, [2]);
    println!(
        "@@OK rendezvous_ms={} all_reduce_ms={}",
        met.as_millis(),
        t.elapsed().as_millis()
    );
}

/// `GRID_GLOO_TIMEOUT_MS=18446744073709551615` (u64::MAX) means no limit: rank 0 waits 3 s for
/// rank 1 to arrive and 2 s more for its all-reduce, and both succeed.
#[test]
fn u64_max_timeout_means_no_limit() {
    if in_child() {
        return child_unlimited();
    }
    let job = unique("unlimited");
    let (dir, url) = file_store(&job);
    let mut ranks = Ranks::new("u64_max_timeout_means_no_limit", 2);
    ranks.start(0, 2, &url, &job, u64::MAX);
    std::thread::sleep(secs(3.0));
    ranks.start_with(1, 2, &url, &job, u64::MAX, &[(DELAY_MS, "2000".into())]);
    let deadline = Instant::now() + secs(60.0);
    let (line0, _) = ranks.outcome(0, deadline);
    let (line1, _) = ranks.outcome(1, deadline);
    eprintln!("rank 0: {line0}\nrank 1: {line1}");
    let num = |l: &str, k: &str| -> u64 { field(l, k).and_then(|v| v.parse().ok()).unwrap_or(0) };
    assert!(line0.starts_with("OK"), "{line0}\n{}", ranks.report());
    assert!(line1.starts_with("OK"), "{line1}\n{}", ranks.report());
    assert!(num(&line0, "rendezvous_ms") >= 2500, "{line0}");
    assert!(num(&line0, "all_reduce_ms") >= 1500, "{line0}");
    let status = ranks.finish(Instant::now() + secs(20.0));
    assert_eq!(status, vec![Some(true), Some(true)], "{}", ranks.report());
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- blame -----------------------------------------------------------------------------------

/// `n` ranks loop over all-reduces; rank `victim` gets `signal` (KILL or STOP). Every survivor
/// must fail within the timeout + 3 s of the signal, blaming the victim, although survivors
/// exit as soon as they fail (so the others see their connections close too).
fn survivors_blame_the_victim(
    test: &'static str,
    n: usize,
    victim: usize,
    signal: &str,
    redis: Option<&backend_gloo::testing::RedisServer>,
) {
    let timeout = secs(3.0);
    let job = unique("blame");
    let (dir, mut url) = file_store(&job);
    if let Some(r) = redis {
        url = r.url();
    }
    let mut ranks = Ranks::new(test, n);
    for r in 0..n {
        ranks.start(r, n, &url, &job, timeout.as_millis() as u64);
    }
    let deadline = Instant::now() + secs(120.0);
    for r in 0..n {
        assert!(
            ranks.wait_line(r, "READY", deadline).is_some(),
            "rank {r} not ready\n{}",
            ranks.report()
        );
    }
    std::thread::sleep(secs(0.5));
    ranks.signal(victim, signal);
    let hit = Instant::now();
    let mut worst = Duration::ZERO;
    for r in (0..n).filter(|&r| r != victim) {
        let (line, at) = ranks.outcome(r, hit + timeout + secs(30.0));
        let took = at - hit;
        worst = worst.max(took);
        eprintln!("rank {r}: {took:?} after SIG{signal}: {line}");
        assert!(line.starts_with("FAILED"), "rank {r}: {line}");
        assert_eq!(
            field(&line, "peer"),
            Some(victim.to_string().as_str()),
            "rank {r} blamed another rank: {line}\n{}",
            ranks.report()
        );
        assert!(
            line.contains(&format!("world rank {victim}"))
                || field(&line, "kind") == Some("Timeout"),
            "rank {r}: {line}"
        );
        assert!(
            took <= timeout + secs(3.0),
            "rank {r} took {took:?}: {line}"
        );
    }
    eprintln!("slowest survivor: {worst:?} after SIG{signal}");
    if signal == "STOP" {
        ranks.signal(victim, "KILL");
    }
    let status = ranks.finish(Instant::now() + secs(20.0));
    for r in (0..n).filter(|&r| r != victim) {
        assert_eq!(status[r], Some(true), "rank {r}\n{}", ranks.report());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killed_rank_is_blamed_by_every_survivor() {
    if in_child() {
        return child_loop();
    }
    survivors_blame_the_victim(
        "killed_rank_is_blamed_by_every_survivor",
        8,
        3,
        "KILL",
        None,
    );
}

#[test]
fn stopped_rank_is_blamed_by_every_survivor() {
    if in_child() {
        return child_loop();
    }
    survivors_blame_the_victim(
        "stopped_rank_is_blamed_by_every_survivor",
        6,
        2,
        "STOP",
        None,
    );
}

/// The same with the failure records in Redis.
#[test]
fn killed_rank_is_blamed_by_every_survivor_redis() {
    if in_child() {
        return child_loop();
    }
    let Some(redis) = start_redis() else { return };
    survivors_blame_the_victim(
        "killed_rank_is_blamed_by_every_survivor_redis",
        6,
        1,
        "KILL",
        Some(&redis),
    );
}

/// A Redis server that stops answering (SIGSTOP) in the middle of a rendezvous: the rendezvous
/// still ends, within the timeout + 2 s (a request to the server is bounded by the time left
/// plus one second), with an error that says the server did not answer.
#[test]
fn redis_stopped_during_rendezvous() {
    if in_child() {
        return;
    }
    let Some(redis) = start_redis() else { return };
    let timeout = secs(3.0);
    let store = backend_gloo::Rendezvous::parse(&redis.url()).expect("a Redis location");
    let factory = backend_gloo::GlooFactory::new(
        &store,
        backend_gloo::GlooConfig::new(unique("redis-stop")).with_timeout(timeout),
    )
    .expect("a factory");
    let pid = redis.process().id().to_string();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(secs(0.5));
        Command::new("kill").args(["-STOP", &pid]).status()
    });
    let t = Instant::now();
    // Ranks 1 and 2 never come: rank 0 polls the server when it stops.
    let e = factory.world(0, 3).map(|_| ()).unwrap_err();
    let took = t.elapsed();
    let stopped = stopper.join().expect("the stopping thread");
    let _ = Command::new("kill")
        .args(["-CONT", &redis.process().id().to_string()])
        .status();
    assert!(
        stopped.map(|s| s.success()).unwrap_or(false),
        "kill -STOP redis-server"
    );
    eprintln!("{took:?}: {e}");
    assert!(took <= timeout + secs(2.0), "took {took:?}: {e}");
    match &e {
        Error::Library(l) => {
            assert_eq!(
                (l.op, l.class.as_deref()),
                ("rendezvous", Some("timeout")),
                "{e}"
            );
            assert!(l.message.contains("Redis server"), "{e}");
        }
        other => panic!("expected a rendezvous timeout, got {other}"),
    }
}
