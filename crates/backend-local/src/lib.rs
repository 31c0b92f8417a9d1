//! # backend-local
//!
//! A real backend whose ranks are **threads of one process**: collectives and messages go
//! through shared memory (a mutex and a condition variable per communicator), with no sockets
//! and no library. It implements the front end's [`grid_core::Backend`], so its communicator
//! [`LocalComm`] = [`grid_core::Comm`]`<`[`LocalBackend`]`>` is validated, numbered and traced
//! like every other backend, and [`LocalFactory`] implements [`grid_core::GroupFactory`]. It
//! passes the conformance suite, and is the test double wherever a test needs ranks.
//!
//! Semantics:
//! * a collective waits until every member has arrived (members are matched by the order of
//!   their collective calls on the communicator); ranks that call different collectives, or
//!   the same one with different dtypes, lengths, reductions or roots, all get an error
//!   ([`grid_core::Error::Library`] with class `mismatch`), never wrong data;
//! * point-to-point messages are matched by (source, destination, tag) in the order they were
//!   posted; with [`LocalConfig::rendezvous`] a send completes only once the receiver took the
//!   message (like a large MPI message), so orderings that deadlock on a real backend are
//!   caught here too;
//! * a rank that never arrives is detected: every wait ends after [`LocalConfig::timeout`] with
//!   [`grid_core::Error::Timeout`] naming the world rank waited for;
//! * nonblocking operations ([`grid_core::Communicator::start`]) deposit their input at the
//!   call and never block the caller; `wait` collects the result;
//! * reductions use [`grid_core::kernels`] (every dtype, every reduction; see its docs for
//!   f16/bf16 and integer averages); host memory only.
//!
//! ```
//! use backend_local::{run, LocalConfig};
//! use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
//!
//! let sums = run(4, &LocalConfig::default(), |factory, world| {
//!     let pair = factory.split(&world, Some((world.rank() / 2) as u32), world.rank())?;
//!     let pair = pair.expect("every rank passed a colour");
//!     let mut v = [world.rank() as i64];
//!     pair.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
//!     Ok(v[0])
//! })?;
//! assert_eq!(sums, vec![1, 1, 5, 5]);
//! # Ok::<(), grid_core::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod state;

pub use backend::{LocalBackend, LocalComm, LocalFactory, LocalWork};
pub use state::{LocalConfig, LocalStats, LocalWorld, P2pRecord};

use grid_core::{Error, Result};

/// The workspace README's Rust code (its library quick start), compiled and run as doc tests so
/// the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// Runs `size` ranks as threads of this process over a fresh world configured by `config`;
/// each thread calls `f(factory, world)` with its own [`LocalFactory`] and world communicator.
/// Returns every rank's result in rank order, or the first error (a rank's own error, or
/// [`Error::Invalid`] naming a rank that panicked).
///
/// ```
/// let r = backend_local::run(3, &Default::default(), |_, w| Ok(grid_core::Communicator::rank(&w)))?;
/// assert_eq!(r, vec![0, 1, 2]);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn run<R, F>(size: usize, config: &LocalConfig, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&LocalFactory, LocalComm) -> Result<R> + Sync,
{
    let world = LocalWorld::with_config(size, config.clone())?;
    let comms = world.communicators();
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(&LocalFactory::new(), c))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "(no message)".into());
                    Err(Error::Invalid(format!("rank {rank} panicked: {msg}")))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}
