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
//!   all-reduce passes `MPI_IN_PLACE`, blocking and nonblocking, with no copy. It is
//!   `Send + Sync` (see the `raw` module for the invariant).
//! * [`MpiFactory`] implements [`grid_core::GroupFactory`]: `split` is `MPI_Comm_split`,
//!   `create_group` is `MPI_Comm_create` over the parent.
//! * [`testing`] runs multi-rank tests under plain `cargo test` by re-launching the test binary
//!   under `mpirun` ([`mpi_test!`]).
//!
//! Element types and reductions: every dtype moves exactly (f16/bf16 as 16-bit words); f16 and
//! bf16 reductions go through f32 on the host; `Avg` is sum then division (floats: in the
//! float type; integers: in i64 with truncation toward zero). Details in the `stage` module.
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
#[allow(unsafe_code)]
mod raw;
mod runtime;
mod stage;
pub mod testing;
mod watch;

pub use comm::{MpiBackend, MpiCommunicator, CHECK_THRESHOLD};
pub use config::{MpiConfig, SIGTERM_REPORT_ENV, TIMEOUT_ENV};
pub use watch::{EXIT_ABORTED, EXIT_TIMEOUT, MESSAGE_GRACE, TICK};
pub use factory::{FactoryCalls, MpiFactory};
pub use runtime::MpiRuntime;
