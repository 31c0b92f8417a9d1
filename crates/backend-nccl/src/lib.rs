//! # backend-nccl
//!
//! The grid-core communicator traits over NCCL, through [`cudarc`] with **dynamic loading**: the
//! crate builds and its CPU tests run on machines with no CUDA toolkit, no driver, no GPU and
//! no libnccl. On such a machine creating the backend returns a clear error saying what was
//! looked for and where ([`probe`]); nothing panics.
//!
//! * [`NcclFactory::init`] creates the world communicator; the first NCCL unique id travels
//!   over a *bootstrap* [`grid_core::Communicator`] of another backend (MPI, Gloo, or
//!   [`inproc`] for one process with one thread per GPU) — see [`bootstrap`].
//! * [`grid_core::GroupFactory::split`] uses `ncclCommSplit` of the parent (non-members pass
//!   `NCCL_SPLIT_NOCOLOR`), so a whole process-group collection needs no further id exchange.
//! * [`NcclCommunicator`] implements [`grid_core::Communicator`]: collectives enqueue on the
//!   communicator's CUDA stream, device buffers are [`NcclDeviceBuffer`]s, host buffers are
//!   staged, nonblocking operations complete through CUDA events (see [`comm`]'s docs).
//! * Communicators are destroyed (finalize, then destroy) or aborted on drop;
//!   [`NcclFactory::abort_all`] / [`abort_all`] abort every communicator of a job / process
//!   when one fails.
//!
//! All `unsafe` code lives in one private module (`ffi`), a thin owned wrapper over
//! `cudarc::nccl::sys`, with the invariant written next to each block.
//!
//! ```no_run
//! use backend_nccl::{inproc::InProcess, NcclFactory, NcclOptions};
//! use grid_core::{Communicator, CommunicatorExt, ReduceOp};
//! let boots = InProcess::world(1);
//! match NcclFactory::init(&boots[0], NcclOptions::default()) {
//!     Ok((_factory, world)) => {
//!         let mut out = vec![0.0f32; 2];
//!         world.all_reduce_into(&[1.0f32, 2.0][..], &mut out[..], ReduceOp::Sum).unwrap();
//!     }
//!     Err(e) => println!("SKIPPED: {e}"), // no driver / libnccl / GPU here
//! }
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod bootstrap;
mod buffer;
mod checks;
pub mod comm;
mod error;
mod factory;
mod ffi;
pub mod inproc;
mod job;
pub mod plan;
pub mod probe;

pub use buffer::{NcclDeviceBuffer, NcclElement};
pub use comm::{NcclCommunicator, NcclWork};
pub use factory::{NcclFactory, NcclOptions, MIN_SPLIT_VERSION};
pub use job::{abort_all, Job};

/// Re-export of the cudarc version this crate is built against (for `CudaSlice`, streams).
pub use cudarc;
