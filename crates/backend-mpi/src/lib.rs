//! # backend-mpi
//!
//! The grid-core communicator traits over MPI: [rsmpi](https://docs.rs/mpi) 0.8 and the
//! system's Open MPI (Debian: `libopenmpi-dev openmpi-bin`, plus `libclang-dev` for rsmpi's
//! bindgen build step).
//!
//! * [`MpiRuntime`] initialises MPI once per process (`MPI_THREAD_MULTIPLE`,
//!   `MPI_ERRORS_RETURN`) and owns the world communicator; dropping it finalizes MPI.
//! * [`MpiCommunicator`] = [`grid_core::Comm`]`<`[`MpiBackend`]`>`: the grid-core front end
//!   (validation, sequence numbers, tracing) over [`MpiBackend`], which executes the validated
//!   operations (all collectives, point to point, batches, nonblocking
//!   [`grid_core::Communicator::start`] as MPI immediate operations on owned buffers). In-place
//!   all-reduce and all-gather pass `MPI_IN_PLACE`, blocking and nonblocking, with no copy; the
//!   in-place reduce-scatter passes `MPI_IN_PLACE` to `MPI_Reduce_scatter_block`, which leaves
//!   the result at the start of the buffer, and moves it to `rank · count` with one
//!   `copy_within` of `count` elements (grid-core's convention, NCCL's). Blocking all-reduces
//!   of 32 MiB and more and reduce-scatters (in place or not) of 512 KiB and more (f32, f64,
//!   i32, i64) run as a ring of `MPI_Sendrecv` steps on the communicator's duplicate, reduced
//!   by grid-core's kernels with a scratch block kept per communicator: from 32 MiB Open MPI
//!   maps and page-faults a fresh temporary buffer for every `MPI_Allreduce` and
//!   `MPI_Reduce_scatter_block`, and from 512 KiB its reduce-scatter was slower than the ring
//!   (docs/performance.md, "Large all-reduces" and "Reduce-scatters from 512 KiB"); the
//!   in-place ring leaves the block at `rank · count` with no copy. Before either, blocking
//!   all-gathers, broadcasts, all-reduces and reduce-scatters (in place or not) of
//!   [`PEER_READ_MIN`] (32 KiB) and more copy straight between the ranks' buffers
//!   (`process_vm_readv` and `process_vm_writev`; the reductions in grid-core's kernels) when
//!   every rank is on one node and the part of each rank's memory that the others copy through
//!   is at most [`PEER_READ_PLAIN_MAX`] (4 MiB) or lies mostly on huge pages: one copy where the
//!   shared-memory transport makes two ([`PEER_READ_MIN_ENV`], [`MpiBackend::peer_reads`],
//!   docs/backends.md §1.2). Where this machine copies slowly at the buffers' distance (a
//!   few bytes apart in a 4 KiB page, measured once per process), those copies go through a staging block or in
//!   vectors instead ([`STAGE_COPIES_ENV`]). It is `Send + Sync` (see the `raw` module for the
//!   invariant).
//! * [`MpiFactory`] implements [`grid_core::GroupFactory`]: `split` is `MPI_Comm_split`,
//!   `create_group` is `MPI_Comm_create` over the parent.
//! * [`testing`] runs multi-rank tests under plain `cargo test` by re-launching the test binary
//!   under `mpirun` ([`mpi_test!`]).
//!
//! # Time limits and abort
//!
//! Every operation runs under a time limit: the communicator's default ([`MpiConfig::timeout`],
//! `GRID_MPI_TIMEOUT_MS`, default 10 minutes; sub-communicators inherit their parent's), or the
//! program's ([`grid_core::Communicator::set_time_limit`],
//! [`grid_core::CommunicatorExt::with_time_limit`]). When it passes, or when
//! [`grid_core::Communicator::abort`] is called while the operation waits:
//!
//! * a **receive** (blocking or nonblocking) is cancelled (`MPI_Cancel`) and returns
//!   [`grid_core::Error::Timeout`] (or `Error::Aborted`); the communicator is then failed and
//!   refuses later operations;
//! * a **nonblocking** collective or send returns the same errors from `wait`; MPI cannot
//!   cancel it, so its owned buffers are leaked (never freed, MPI may still write them) and
//!   the job goes on;
//! * a **blocking collective** (and the mismatch check's exchange), a blocking **send** or a
//!   batch with a send in flight cannot be cancelled, and returning while MPI may still use the
//!   caller's borrowed buffer would be unsound, so the **job is ended**: one message on stderr
//!   naming the operation, its sequence number, the communicator and its ranks, the limit and
//!   the reason; the operation log dumped when `GRID_TRACE_DIR` is set; then `MPI_Abort` with
//!   [`EXIT_TIMEOUT`] (124) or [`EXIT_ABORTED`] (125). Blocking collectives stay blocking MPI
//!   calls (Open MPI's nonblocking collectives are slower): a per-process watchdog thread looks
//!   at the collective in flight of every communicator every [`TICK`] and ends the job within
//!   [`TICK`] + [`MESSAGE_GRACE`] of the limit.
//!
//! Collectives that move at least [`CHECK_THRESHOLD`] bytes on a rank are checked by default
//! (a count mismatch above Open MPI's eager limit corrupts memory). On a communicator of 2 to
//! [`DIRECT_MAX`] ranks the check is one round of messages in which every rank sends every
//! other rank its fingerprint, with the collective's data when each message holds at most
//! [`ROUND_MAX`] bytes of it ([`PAIR_ROUND_MAX`] at 2 ranks) (the collective is then computed from what arrives, with
//! grid-core's host kernels, and costs no exchange beyond its own); larger collectives send the
//! fingerprint alone, then make the MPI call. Other communicators check with an all-reduce.
//! The check's messages travel on a duplicate communicator, so that ranks on both sides of the
//! threshold reach their time limit instead of mixing data. When one rank dies, `mpirun` ends the others with SIGTERM about a
//! second later; with [`MpiConfig::sigterm_report`] each prints the operation it was waiting in
//! first. docs/backends.md §1.7 has the measurements.
//!
//! Element types and reductions: every dtype moves exactly (f16/bf16 as 16-bit words, bool
//! and fp8 as bytes); f16 and bf16 reductions go through f32 on the host; bool reductions are
//! byte maxima (sum, max: OR) and minima (product, min: AND), without average; fp8 is moved,
//! never reduced (`supports(fp8, Some(_))` is false); `Avg` is sum then division (floats: in
//! the float type; integers: in i64 with truncation toward zero, u64 exactly through its 32-bit
//! halves). Details in the `stage` module.
//!
//! The operations of a training framework map to MPI's own calls, blocking and nonblocking
//! (`MPI_I*`): `all_to_all_v` → `MPI_Alltoallv`, `all_gather_v` → `MPI_Allgatherv`,
//! `reduce_scatter_v` → `MPI_Reduce_scatter`, `reduce` → `MPI_Reduce`, and the rooted `gather`
//! and `scatter` → `MPI_Gatherv` / `MPI_Scatterv` with equal blocks: Open MPI's `MPI_Gather`
//! relays blocks through a binomial tree, so a count mismatch that the 2 KiB check lets
//! through (every rank below it) can still send a relay a message past the eager limit (in a
//! gather of 8 ranks a relay hung or crashed); with the vector forms every message goes straight from or
//! to the root and is never larger than its sender's own buffer. Counts and displacements are
//! C `int`s: one above `i32::MAX` is an error, never a wrap.
//!
//! ```no_run
//! use backend_mpi::{MpiFactory, MpiRuntime};
//! use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
//! let rt = MpiRuntime::init()?;
//! let world = rt.world();
//! let f = MpiFactory::new();
//! let pairs = f.split(world, Some((world.rank() / 2) as u32), world.rank())?;
//! if let Some(p) = pairs {
//!     let mut out = vec![0.0f32; 2];
//!     p.all_reduce_into(&[1.0f32, 2.0][..], &mut out[..], ReduceOp::Avg)?;
//! }
//! # Ok::<(), grid_core::Error>(())
//! ```
#![warn(missing_docs)]
// Every `unsafe` block lives in the FFI module `raw`, next to the invariant it relies on.
#![deny(unsafe_code)]

mod comm;
mod config;
mod factory;
mod peer_read;
#[allow(unsafe_code)]
mod raw;
mod ring;
mod runtime;
mod stage;
pub mod testing;
mod watch;

pub use comm::{
    MpiBackend, MpiCommunicator, CHECK_THRESHOLD, DIRECT_MAX, PAIR_ROUND_MAX, ROUND_MAX,
};
pub use config::{
    MpiConfig, DIRECT_MAX_ENV, PEER_READ_MIN_ENV, ROUND_MAX_ENV, SIGTERM_REPORT_ENV,
    STAGE_COPIES_ENV, TIMEOUT_ENV,
};
pub use factory::{FactoryCalls, MpiFactory};
pub use peer_read::{PEER_READ_CROWDED_IN_PLACE_MIN, PEER_READ_MIN, PEER_READ_PLAIN_MAX};
pub use runtime::{MpiRuntime, FRAGMENT_SIZE, FRAGMENT_SIZE_VAR, SINGLE_COPY_VAR};
pub use watch::{EXIT_ABORTED, EXIT_TIMEOUT, MESSAGE_GRACE, TICK};
