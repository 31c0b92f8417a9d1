//! # grid-core
//!
//! The pure topology crate: every process group of an N-dimensional parallel layout, with
//! exactly the groups and member order that Megatron-Core's `initialize_model_parallel`,
//! `RankGenerator` and `HyperCommGrid` produce, and the communicator traits that the MPI, Gloo
//! and NCCL backends implement.
//!
//! No I/O, no `unsafe`, no backend dependency. Groups are arithmetic ([`Group`]): the group of
//! one rank in a million-rank world is computed in time proportional to the number of grid
//! dimensions, never by enumerating the world.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod comm;
mod error;
mod grid;
mod group;
mod rankgen;

pub use comm::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, DeviceBuffer, Element, GroupFactory,
    HostBuffer, HostSlice, HostSliceMut, Memory, P2pOp, ReduceOp, Request, Tensor, TypedWork, Work,
};
pub use error::{Error, Result};
pub use grid::{GridSpec, GroupList, HyperGrid};
pub use group::{Group, GroupIter, GroupSize, Term};
pub use rankgen::{masked_orthogonal_groups, GeneratorSizes, RankGenerator, TOKENS};
mod collection;
mod hierarchical;
mod plan;
mod view;

pub use collection::{
    build_collection, BuiltCollection, FamilyBuildStat, MultiModuleProcessGroupCollection, PgEntry,
    ProcessGroupCollection,
};
pub use hierarchical::{hierarchical_groups, hierarchical_groups_of};
pub use plan::{
    EmbeddingFn, EmbeddingRule, Family, FamilyLevel, GroupSignature, LayoutConfig, LayoutPlan,
    DEFAULT_ORDER,
};
pub use view::{Coords, RankView};
mod hypercomm;
pub use hypercomm::{CommGrid, CreatedGroup, PgKey};
