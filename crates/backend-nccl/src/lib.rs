//! # backend-nccl
//!
//! The grid-core communicator traits over NCCL, through [`cudarc`] with **dynamic loading**: the
//! crate builds and its CPU tests run on machines with no CUDA toolkit, no driver, no GPU and
//! no libnccl. On such a machine creating the backend returns a clear error saying what was
//! looked for and where ([`probe`]); nothing panics.
//!
//! * [`NcclFactory::init`] creates the world communicator; the first NCCL unique id travels
//!   over a *bootstrap* [`grid_core::Communicator`] of another backend (MPI or Gloo for one
//!   process per GPU, `backend-local` for one process with one thread per GPU) — see
//!   [`bootstrap`].
//! * [`grid_core::GroupFactory::split`] uses `ncclCommSplit` of the parent (non-members pass
//!   `NCCL_SPLIT_NOCOLOR`), so a whole process-group collection needs no further id exchange;
//!   which ranks a split groups is grid-core's split arithmetic ([`grid_core::split_members`]).
//! * [`NcclCommunicator`] is grid-core's front end ([`grid_core::Comm`]) over [`NcclBackend`]:
//!   the front end validates every operation, the backend enqueues it on the communicator's
//!   CUDA stream; device buffers are [`NcclDeviceBuffer`]s, host buffers are staged,
//!   all-reduce runs in place or out of place natively, nonblocking operations complete
//!   through CUDA events (see [`comm`]'s docs). Failures are [`grid_core::Error::Library`]
//!   with NCCL's `ncclResult_t` name and number.
//! * Failure handling is [`engine`], a state machine with no CUDA in it behind a small seam
//!   ([`engine::DeviceComm`], [`engine::DeviceEvent`]): nonblocking creation and split that a
//!   time limit or `abort()` can end, one watchdog per process (asynchronous errors, time
//!   limits, completion markers of every operation), buffers of dropped work kept until the
//!   device is done, non-blocking teardown. [`NcclFactory::abort_all`] / [`abort_all`] abort
//!   every communicator of a job / process.
//!
//! * Point-to-point: every `send`/`recv`/`isend`/`irecv` is enqueued when called, on one of two
//!   point-to-point lanes of its communicator (one per message direction), so exchanges, rings
//!   and an `isend` followed by a collective on another communicator cannot deadlock; see
//!   [`p2p`] for NCCL's rules and where sends are still held back.
//! * CUDA graph capture: operations on device buffers can be captured; captured work is never
//!   watched ([`engine::launch_plan`]).
//!
//! All `unsafe` code lives in one private module (`ffi`), a thin owned wrapper over
//! `cudarc::nccl::sys` (and one CUDA host function), with the invariant written next to each
//! block.
//!
//! ```no_run
//! use backend_local::LocalWorld;
//! use backend_nccl::{NcclFactory, NcclOptions};
//! use grid_core::{Communicator, CommunicatorExt, ReduceOp};
//! // One rank: the bootstrap is a local (in-process) world of one thread.
//! let boots = LocalWorld::new(1)?.communicators();
//! match NcclFactory::init(&boots[0], NcclOptions::default()) {
//!     Ok((_factory, world)) => {
//!         let mut out = vec![0.0f32; 2];
//!         world.all_reduce_into(&[1.0f32, 2.0][..], &mut out[..], ReduceOp::Sum).unwrap();
//!     }
//!     Err(e) => println!("SKIPPED: {e}"), // no driver / libnccl / GPU here
//! }
//! # Ok::<(), grid_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod bootstrap;
mod buffer;
pub mod comm;
pub mod engine;
mod error;
mod factory;
mod ffi;
mod job;
pub mod p2p;
pub mod plan;
pub mod probe;
mod split;

pub use buffer::{NcclDeviceBuffer, NcclElement};
pub use comm::{NcclBackend, NcclCommunicator, NcclWork};
pub use factory::{NcclConfig, NcclFactory, NcclOptions, MIN_SPLIT_VERSION, SCALABLE_INIT_VERSION};
pub use job::{abort_all, Job};

/// Re-export of the cudarc version this crate is built against (for `CudaSlice`, streams).
pub use cudarc;
