//! # grid-core
//!
//! The pure topology crate: every process group of an N-dimensional parallel layout, with
//! exactly the groups and member order that Megatron-Core's `initialize_model_parallel`,
//! `RankGenerator` and `HyperCommGrid` produce, and the communicator traits that the MPI, Gloo
//! and NCCL backends implement.
//!
//! It also holds the communicator **front end** ([`Comm`] over a backend's [`Backend`]):
//! operations validated once with typed errors, numbered and traced for every backend, plus
//! the host reduction [`kernels`] and the split arithmetic ([`split_members`]) backends share.
//!
//! No `unsafe`, no backend dependency, and no I/O except the operation log's dump ([`oplog`]:
//! the flight recorder of every communicator, read across ranks by [`trace`] and `grid trace`).
//! Groups are arithmetic ([`Group`]): the group of one rank in a million-rank world is computed
//! in time proportional to the number of grid dimensions, never by enumerating the world.
//!
//! ```
//! use grid_core::{Family, LayoutConfig, LayoutPlan};
//! // 16 GPUs, tp 2, pp 4: Megatron's docstring example.
//! let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 4, ..LayoutConfig::new(16) })?;
//! assert_eq!(plan.groups(Family::Dp.into())?.get(1), &[1, 3]);
//! assert_eq!(plan.groups(Family::Embd.into())?.get(0), &[0, 12]);
//! let view = plan.rank_view(9)?;
//! assert_eq!(view.group(Family::Pp).unwrap().to_vec(), vec![1, 5, 9, 13]);
//! assert_eq!(view.group_rank(Family::Pp), Some(2));
//! # Ok::<(), grid_core::Error>(())
//! ```
//!
//! ## Where this crate deliberately differs from Megatron-Core
//! Megatron-Core `d98e8a64` is matched group for group and member for member on every
//! reference vector in scope. Where Megatron fails by accident or silently produces garbage,
//! this crate chooses:
//! * **Order strings are parsed as tokens.** Megatron tests `name in order` as a *substring*;
//!   since its 2026 GTP change `"tp"` is always "found" inside the injected `gtp_remat` token,
//!   so an order without `tp` fails even with tp = 1. Here a missing size-1 token is appended
//!   (the pre-2026 behaviour), and a missing token of size > 1 is [`Error::MissingToken`].
//! * **A repeated order token is rejected** ([`Error::RepeatedToken`]); Megatron returns
//!   groups with ranks outside the world.
//! * **Everything is validated before any group exists.** Megatron checks the hierarchical cp
//!   sizes and the pipeline backend inside its creation loops, after creating some groups.
//!   The checks and their order are otherwise Megatron's, and each error maps to Megatron's
//!   exception class ([`Error::megatron_category`]).
//! * **The pp-last test uses the last token**, case-insensitively (Megatron tests the raw string
//!   with `endswith("pp")`, so `"TP-PP"` fails it).
//! * **Repeated dimension names are rejected in a base [`HyperGrid`]** (Megatron checks them
//!   only for views).
//! * **No `gtp_remat` injection** in [`LayoutPlan`]: that feature is out of scope, and with
//!   size 1 it changes no group. [`RankGenerator`] still accepts the `gtp_remat` token.
//! * `world_size` in [`LayoutConfig`] is the number of ranks the layout covers (Megatron's
//!   `local_world_size`); with `rank_offset` O it covers ranks O..O+world_size.
//! * The removed `pipeline_model_parallel_split_rank` and Megatron's embedding-rank callables
//!   are both expressed by [`EmbeddingRule`].
//! * **A virtual pipeline stage that does not exist is an error** ([`Error::VpStage`]) in
//!   [`RankView::is_pipeline_first_stage`] and its siblings, where Megatron answers `False`.
//! * The optimizer/DDP wiring ([`setup_process_groups_for_optimizer`],
//!   [`setup_process_groups_for_ddp`], [`use_mpu_process_groups`]) expresses Megatron's
//!   "explicitly set to None" with [`ProvidedGroups::with_none`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod comm;
mod error;
mod grid;
mod group;
mod rankgen;

pub use comm::{
    color_key_for, compact_ranks, kernels, split_members, Backend, Bool, BufMut, BufRef, Comm,
    Communicator, CommunicatorExt, DType, DeferredCheck, DeviceBuffer, Element, Failure,
    GroupFactory, HostBuffer, HostSlice, HostSliceMut, Limited, Memory, MismatchCheck, Op, OpSite,
    OwnedOp, P2pOp, ReceivePlacement, ReduceOp, Request, SplitEntry, SplitMembers, Tensor,
    TimeLimit, TypedWork, Validated, Work, F8E4M3, F8E5M2, FRAME_HEAD_MAX,
};
pub use error::{Error, LibraryError, Result};
pub use grid::{GridSpec, GroupList, HyperGrid};
pub use group::{Group, GroupIter, GroupSize, Term};
pub use rankgen::{masked_orthogonal_groups, GeneratorSizes, RankGenerator, TOKENS};
mod collection;
mod hierarchical;
mod plan;
mod view;
mod wiring;

pub use collection::{
    build_collection, build_collection_with, build_gloo_twins, group_identity, BuiltCollection,
    FamilyBuildStat, PgEntry, ProcessGroupCollection, GLOO_TWIN_FAMILIES,
};
pub use hierarchical::{hierarchical_groups, hierarchical_groups_of};
pub use plan::{
    default_embedding_ranks, default_position_embedding_ranks, EmbeddingFn, EmbeddingRule, Family,
    FamilyLevel, GroupSignature, LayoutConfig, LayoutPlan, CUSTOM_RULE_SAMPLE, DEFAULT_ORDER,
};
pub use view::{Coords, RankView};
pub use wiring::{
    setup_process_groups_for_ddp, setup_process_groups_for_optimizer, use_mpu_process_groups,
    DdpGroups, DdpSettings, DdpWiring, OptimizerGroups, OptimizerWiring, Provided, ProvidedGroups,
};
mod hypercomm;
pub use hypercomm::{CommGrid, CreatedGroup, LiveCommGrid, LocatedGroup, PgKey};
mod options;
pub use options::{
    BackendOptions, CollectionOptions, GlooGroupOptions, GroupOptions, NcclGroupOptions,
    NCCL_COMM_CFG_KEYS,
};
pub mod oplog;
pub mod trace;
pub use oplog::{OpDesc, OpHandle, OpLog, OpRecord, OpState, Recorder, TraceDump, TraceError};
pub use trace::{analyze, TraceReport};
mod initplan;
pub use initplan::{
    verify_plan, CallOp, CommInfo, Creation, InitCall, InitPlan, InitSummary, RankInitPlan,
    SharedComm, SharedCommSummary, Spread, VerifyReport,
};
