//! The overlap scenario of the examples `async_overlap_mpi` and `async_overlap_gloo` and of the
//! test `tests/overlap.rs` (included by path; not an example of its own).
//!
//! One rank of a data parallel × pipeline parallel (pp = 2) layout, on a tokio runtime with two
//! worker threads. Each iteration spawns, in one `JoinSet`, a task that all-reduces a gradient
//! on the data-parallel group and a task that moves an activation over the pipeline group
//! (stage 0 sends, stage 1 receives), so the two are in flight at the same time. Meanwhile a
//! timer task records a tick every `tick`. In the first `slow_iterations` iterations the second
//! data-parallel rank and pipeline stage 0 join `delay` late (an async sleep), so on the rank
//! that is data-parallel rank 0 and pipeline stage 1 both operations wait `delay` for their
//! peers. If waiting blocked a worker thread, both workers would be blocked for `delay` and the
//! timer would miss its ticks; the report's `max_gap` shows that it did not.

// Shared by the examples and the test; each uses part of it.
#![allow(dead_code)]

use grid_async::{AsyncCommunicator, AsyncCommunicatorExt};
use grid_core::ReduceOp;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Iterations (each: one all-reduce and one pipeline message, overlapped).
    pub iterations: usize,
    /// The first iterations in which the late ranks join after `delay`.
    pub slow_iterations: usize,
    /// How late they join.
    pub delay: Duration,
    /// Elements of the gradient and the activation (f32).
    pub len: usize,
    /// The timer task's period.
    pub tick: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            iterations: 20,
            slow_iterations: 2,
            delay: Duration::from_millis(600),
            len: 1024,
            tick: Duration::from_millis(25),
        }
    }
}

/// What one rank saw.
#[derive(Debug, Clone)]
pub struct Report {
    /// Iterations run, all with correct results.
    pub iterations: usize,
    /// Ticks the timer recorded.
    pub ticks: usize,
    /// The longest time between two ticks (or between the start and the first tick).
    pub max_gap: Duration,
    /// On the rank whose two operations both wait for late peers (data-parallel rank 0,
    /// pipeline stage 1): whether, in every slow iteration, both were in flight at the same
    /// time for at least half of `delay`. `None` on the other ranks.
    pub overlapped: Option<bool>,
    /// The shortest time an operation of that rank was in flight in a slow iteration.
    pub shortest_slow_wait: Option<Duration>,
    /// Wall time of the iterations.
    pub elapsed: Duration,
    /// Completion threads alive at the end (shared by the process).
    pub completion_threads: usize,
}

/// The data-parallel gradient element `i` of world rank `g` in iteration `it` (exact in f32).
fn gradient(g: usize, i: usize, it: usize) -> f32 {
    (g * 1000 + i % 1000 + it) as f32
}

/// The pipeline activation element `i` sent by world rank `g` in iteration `it`.
fn activation(g: usize, i: usize, it: usize) -> f32 {
    (g * 100 + i % 997 + 7 * it) as f32
}

type Span = (Instant, Instant);

async fn dp_step(
    dp: Arc<dyn AsyncCommunicator>,
    it: usize,
    delay: Option<Duration>,
    len: usize,
) -> Result<Span, String> {
    if let Some(d) = delay {
        if dp.rank() == 1 {
            tokio::time::sleep(d).await;
        }
    }
    let me = dp.global_ranks()[dp.rank()];
    let grad: Vec<f32> = (0..len).map(|i| gradient(me, i, it)).collect();
    let t0 = Instant::now();
    let sum = dp
        .all_reduce_vec(grad, ReduceOp::Sum)
        .await
        .map_err(|e| format!("iteration {it}: dp all_reduce: {e}"))?;
    let t1 = Instant::now();
    for (i, v) in sum.iter().enumerate() {
        let want: f32 = dp.global_ranks().iter().map(|&g| gradient(g, i, it)).sum();
        if *v != want {
            return Err(format!(
                "iteration {it}: dp all_reduce element {i} is {v}, expected {want}"
            ));
        }
    }
    Ok((t0, t1))
}

async fn pp_step(
    pp: Arc<dyn AsyncCommunicator>,
    it: usize,
    delay: Option<Duration>,
    len: usize,
) -> Result<Span, String> {
    let tag = it as u32;
    let first = pp.global_ranks()[0];
    if pp.rank() == 0 {
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let act: Vec<f32> = (0..len).map(|i| activation(first, i, it)).collect();
        let t0 = Instant::now();
        let back = pp
            .send_vec(act.clone(), 1, tag)
            .await
            .map_err(|e| format!("iteration {it}: pp send: {e}"))?;
        if back != act {
            return Err(format!(
                "iteration {it}: the send returned a different buffer"
            ));
        }
        Ok((t0, Instant::now()))
    } else {
        let t0 = Instant::now();
        let got = pp
            .recv_vec::<f32>(len, 0, tag)
            .await
            .map_err(|e| format!("iteration {it}: pp recv: {e}"))?;
        let t1 = Instant::now();
        for (i, v) in got.iter().enumerate() {
            let want = activation(first, i, it);
            if *v != want {
                return Err(format!(
                    "iteration {it}: pp recv element {i} is {v}, expected {want}"
                ));
            }
        }
        Ok((t0, t1))
    }
}

/// Runs the scenario on this rank's data-parallel and pipeline communicators (the pipeline
/// group must have 2 ranks).
pub fn run(
    dp: Arc<dyn AsyncCommunicator>,
    pp: Arc<dyn AsyncCommunicator>,
    s: &Settings,
) -> Result<Report, String> {
    if pp.size() != 2 {
        return Err(format!(
            "the pipeline group has {} ranks; this scenario needs pp = 2",
            pp.size()
        ));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .map_err(|e| format!("cannot build the tokio runtime: {e}"))?;
    let s = s.clone();
    rt.block_on(async move {
        let ticks = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let timer = tokio::spawn({
            let (ticks, stop, period) = (Arc::clone(&ticks), Arc::clone(&stop), s.tick);
            async move {
                let mut iv = tokio::time::interval(period);
                iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while !stop.load(Ordering::Relaxed) {
                    iv.tick().await;
                    ticks
                        .lock()
                        .map_err(|e| e.to_string())?
                        .push(Instant::now());
                }
                Ok::<(), String>(())
            }
        });
        let watched = dp.rank() == 0 && pp.rank() == 1;
        let mut overlapped = watched.then_some(true);
        let mut shortest: Option<Duration> = None;
        let start = Instant::now();
        for it in 0..s.iterations {
            let delay = (it < s.slow_iterations).then_some(s.delay);
            let mut set = tokio::task::JoinSet::new();
            let dp_task = set.spawn(dp_step(Arc::clone(&dp), it, delay, s.len)).id();
            set.spawn(pp_step(Arc::clone(&pp), it, delay, s.len));
            let (mut dp_span, mut pp_span) = (None, None);
            while let Some(done) = set.join_next_with_id().await {
                let (id, r) = done.map_err(|e| format!("iteration {it}: a task failed: {e}"))?;
                let span = r?;
                if id == dp_task {
                    dp_span = Some(span);
                } else {
                    pp_span = Some(span);
                }
            }
            if let (true, Some(_), Some(a), Some(b)) = (watched, delay, dp_span, pp_span) {
                let both = a.0.max(b.0);
                let together = a.1.min(b.1).saturating_duration_since(both);
                let wait =
                    a.1.saturating_duration_since(a.0)
                        .min(b.1.saturating_duration_since(b.0));
                shortest = Some(shortest.map_or(wait, |w| w.min(wait)));
                if together < s.delay / 2 {
                    overlapped = Some(false);
                }
            }
        }
        let elapsed = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        timer
            .await
            .map_err(|e| format!("the timer task failed: {e}"))??;
        // Both groups end together, so no rank leaves while a peer still sends to it.
        dp.barrier().await.map_err(|e| format!("dp barrier: {e}"))?;
        pp.barrier().await.map_err(|e| format!("pp barrier: {e}"))?;
        let ticks = ticks.lock().map_err(|e| e.to_string())?.clone();
        let mut max_gap = ticks
            .first()
            .map_or(elapsed, |t| t.saturating_duration_since(start));
        for w in ticks.windows(2) {
            max_gap = max_gap.max(w[1].saturating_duration_since(w[0]));
        }
        Ok(Report {
            iterations: s.iterations,
            ticks: ticks.len(),
            max_gap,
            overlapped,
            shortest_slow_wait: shortest,
            elapsed,
            completion_threads: grid_async::completion_threads(),
        })
    })
}

/// Checks a report against the scenario's promises; returns what broke.
pub fn check(r: &Report, s: &Settings, limit: Duration) -> Result<(), String> {
    if r.max_gap > limit {
        return Err(format!(
            "the timer task went {:?} without a tick (period {:?}, limit {limit:?}): a worker thread was blocked",
            r.max_gap, s.tick
        ));
    }
    if r.overlapped == Some(false) {
        return Err(format!(
            "the dp all-reduce and the pp receive were not in flight together for {:?} in a slow iteration",
            s.delay / 2
        ));
    }
    if let Some(w) = r.shortest_slow_wait {
        if w < s.delay / 2 {
            return Err(format!(
                "an operation waiting for a late peer finished after {w:?}, before the peer joined ({:?} late)",
                s.delay
            ));
        }
    }
    Ok(())
}

/// The longest gap between timer ticks the scenario accepts: 6 periods (150 ms by default).
/// A blocked pair of workers would show a gap of about `delay` (600 ms by default); the margin
/// above one period absorbs scheduling noise on a loaded machine.
pub fn gap_limit(s: &Settings) -> Duration {
    s.tick * 6
}

/// One line about a rank's report.
pub fn describe(r: &Report, limit: Duration) -> String {
    format!(
        "{} iterations correct in {:.2} s; timer: {} ticks, longest gap {} ms (limit {} ms); {} completion threads{}",
        r.iterations,
        r.elapsed.as_secs_f64(),
        r.ticks,
        r.max_gap.as_millis(),
        limit.as_millis(),
        r.completion_threads,
        match (r.overlapped, r.shortest_slow_wait) {
            (Some(true), Some(w)) => format!(
                "; dp all-reduce and pp receive in flight together, each >= {} ms",
                w.as_millis()
            ),
            _ => String::new(),
        }
    )
}
