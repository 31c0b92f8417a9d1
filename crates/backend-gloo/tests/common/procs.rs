//! Helpers of the tests that run ranks as processes: a throw-away Redis server and the
//! forwarding of a rank process's output lines.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Set to `1` to skip the Redis tests on a machine without `redis-server` (they say so).
pub const SKIP_REDIS: &str = "GRID_GLOO_SKIP_REDIS";

/// A `redis-server` on a free loopback port, without persistence; killed on drop.
pub struct Redis {
    pub child: Child,
    pub port: u16,
}

impl Redis {
    /// Starts one and waits until it listens; `None` when [`SKIP_REDIS`] is `1`.
    pub fn start() -> Option<Redis> {
        if std::env::var(SKIP_REDIS).as_deref() == Ok("1") {
            eprintln!("skipping: {SKIP_REDIS}=1");
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}): install it (Debian: apt-get install redis-server) or set {SKIP_REDIS}=1")
            });
        let mut redis = Redis { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(s)) = redis.child.try_wait() {
                panic!("redis-server exited at once: {s}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(redis)
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends every line `child` writes on its stdout and stderr to `tx` as `(rank, line)`, from
/// one thread per pipe, until the pipe closes or the receiver is gone.
pub fn forward_output(child: &mut Child, rank: usize, tx: &mpsc::Sender<(usize, String)>) {
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
                if tx.send((rank, line)).is_err() {
                    break;
                }
            }
        });
    }
}
