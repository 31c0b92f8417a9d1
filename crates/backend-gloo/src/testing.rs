//! Test support: a throw-away `redis-server` for tests that rendezvous through Redis (this
//! crate's process tests, and the failure scenarios of `grid-programs`).
//!
//! ```no_run
//! let redis = backend_gloo::testing::RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
//! let store = format!("{}/my-job", redis.url()); // GRID_GLOO_STORE=redis://127.0.0.1:PORT/my-job
//! # let _ = store;
//! ```

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` on a free loopback port, without persistence; killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    /// Starts one and waits (up to 10 s) until it accepts connections. The error says why it
    /// could not, and how to install it.
    pub fn start() -> Result<RedisServer, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free loopback port for redis-server: {e}"))?;
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
            .map_err(|e| {
                format!(
                    "cannot start redis-server ({e}): install it (Debian: apt-get install redis-server)"
                )
            })?;
        let mut redis = RedisServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(s)) = redis.child.try_wait() {
                return Err(format!("redis-server exited at once: {s}"));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "redis-server did not listen on port {port} within 10 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(redis)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL) and waits for it; dropping does the same.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The server's process (to stop or continue it with a signal).
    pub fn process(&self) -> &Child {
        &self.child
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
