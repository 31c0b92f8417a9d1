//! # backend-gloo
//!
//! The `grid-core` communicator traits over [Gloo](https://github.com/facebookincubator/gloo),
//! the CPU collective library PyTorch ships, through a small C++ shim over the system
//! `libgloo` (Debian `libgloo-dev`) whose Rust declarations `bindgen` generates at build time.
//!
//! * [`GlooCommunicator`] = [`grid_core::Comm`]`<`[`GlooBackend`]`>`: the grid-core front end
//!   (validation, sequence numbers, tracing) over [`GlooBackend`], which executes the validated
//!   operations: all-reduce (Gloo's ring or BCube, picked by rank count and message size from
//!   measurements, see [`AllreduceAlgorithm`]; in place with no copy, or out of place),
//!   broadcast, all-gather, reduce-scatter (through Gloo's ring all-reduce by default: Gloo's
//!   own `ReduceScatterHalvingDoubling` is opt-in, see [`ReduceScatterAlgorithm`]), all-to-all,
//!   barrier, tagged send/recv and batches of them, and nonblocking forms on a
//!   per-communicator worker thread that keeps call order. All seven dtypes, host memory;
//!   Gloo reduces with grid-core's host kernels ([`grid_core::kernels`]), called from the shim.
//! * [`GlooFactory`] implements [`grid_core::GroupFactory`]: a split all-gathers colours over
//!   the parent, then each colour group meets under its own store prefix (only members take
//!   part), exactly like PyTorch's `new_group` on Gloo.
//! * Rendezvous ([`Rendezvous`]): in-process (ranks as threads, no launcher), a directory, or
//!   Redis; every key lives under the job id, so runs never mix.
//! * Every operation, and each rendezvous as a whole, is bounded by [`GlooConfig::timeout`]
//!   ([`GlooConfig::NO_LIMIT`]: no limit); a rendezvous that times out lists the ranks that
//!   never arrived. A lost or stopped peer turns into [`grid_core::Error::PeerFailed`] (or
//!   [`grid_core::Error::Timeout`]) naming the rank that failed first, found through failure
//!   records in the store.
//! * No disagreement between ranks reaches libgloo (where it would terminate the process or
//!   return wrong data): point-to-point messages carry their element type and count, so a
//!   receive gets exactly its length or an error ([`P2pMismatch`]); collectives are
//!   mismatch-checked by default ([`grid_core::MismatchCheck::All`]; see
//!   [`GlooCommunicator`]).
//!
//! ```
//! use backend_gloo::{run_ranks, GlooConfig};
//! use grid_core::{Communicator, CommunicatorExt, ReduceOp};
//!
//! // Four ranks as threads of this process.
//! let results = run_ranks(4, &GlooConfig::new("doc-lib"), |_factory, world| {
//!     let mut sum = [0.0f32; 3];
//!     world.all_reduce_into(&[world.rank() as f32; 3], &mut sum, ReduceOp::Sum)?;
//!     Ok(sum)
//! })
//! .unwrap();
//! for r in results {
//!     assert_eq!(r.unwrap(), [6.0; 3]);
//! }
//! ```
#![warn(missing_docs)]
// Every `unsafe` block lives in the FFI module `ffi`, next to the invariant it relies on.
#![deny(unsafe_code)]

mod blame;
mod comm;
mod exec;
mod factory;
#[allow(unsafe_code)]
mod ffi;
pub mod testing;
mod tuning;

pub use comm::{GlooBackend, GlooCommunicator, ONE_ROUND_ENV, ONE_ROUND_MAX};
pub use factory::{
    env, init_from_env, run_ranks, run_ranks_with, GlooConfig, GlooFactory, InProcessStore,
    Rendezvous, BROADCAST_BUSY_POLL_BELOW, BUSY_POLL_CROWDED_BELOW, BUSY_POLL_ENV,
};
pub use ffi::{
    p2p_copied_bytes, P2pMismatch, RawBlock, RawContext, RawOp, RawP2p, ReduceScatterAlgorithm,
    ShimCode, ShimError, P2P_INLINE_MAX,
};
pub use tuning::{
    AllreduceAlgorithm, ParseAlgorithmError, TableRow, ALLREDUCE_ENV, ALLREDUCE_TABLE,
    MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES,
};
