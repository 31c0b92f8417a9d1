//! Helpers of the tests that run ranks as processes: a throw-away Redis server and the
//! forwarding of a rank process's output lines.
#![allow(dead_code)]

use backend_gloo::testing::RedisServer;
use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::mpsc;

/// Set to `1` to skip the Redis tests on a machine without `redis-server` (they say so).
pub const SKIP_REDIS: &str = "GRID_GLOO_SKIP_REDIS";

/// A `redis-server` of the test's own (killed when dropped); `None` when [`SKIP_REDIS`] is `1`.
pub fn start_redis() -> Option<RedisServer> {
    if std::env::var(SKIP_REDIS).as_deref() == Ok("1") {
        eprintln!("skipping: {SKIP_REDIS}=1");
        return None;
    }
    Some(RedisServer::start().unwrap_or_else(|e| panic!("{e}, or set {SKIP_REDIS}=1")))
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
