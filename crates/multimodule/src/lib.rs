//! # multimodule
//!
//! Stage accounting, bridge communicators and the multi-module pipeline communicator for models
//! built from several modules with different parallel layouts (docs/semantics.md §5–6).
//!
//! # From a spec to running communicators
//! Data flows one way, and nothing downstream recomputes what upstream decided:
//! 1. a [`PipelineSpec`] (JSON or TOML) names the modules, their grids and the topology;
//! 2. [`PipelinePlan::new`] computes, once and without any communicator, the stage numbers of
//!    every rank and the routing ([`BridgePlan`]) of every bridge: the same value on every rank,
//!    printed by `grid pipeline SPEC`, and serializable (its JSON reads back into the same plan);
//! 3. [`MultiModulePipelineCommunicator::new`] turns the plan plus a backend into this rank's
//!    communicator: its stage numbers are the plan's entry for the rank
//!    ([`PipelinePlan::rank`]), its modules are [`PipelinePlan::rank_modules`] and bridge `k`
//!    runs [`PipelinePlan::bridge_plans`]`()[k]`;
//! 4. the communicator carries the user's tensors.
//!
//! ```
//! use multimodule::{PipelinePlan, PipelineSpec};
//! let spec = PipelineSpec::from_json_str(r#"{"modules": {"enc": {"dp": 2}, "llm": {"tp": 2, "offset": 2}},
//!                                          "topology": {"enc": ["llm"]}}"#)?;
//! let plan = PipelinePlan::new(&spec)?;                           // step 2, on every rank
//! let json = plan.to_json();                                      // what `grid pipeline` prints
//! assert_eq!(PipelinePlan::from_json_str(&json)?, plan);          // a stored plan is the plan
//! // step 3: MultiModulePipelineCommunicator::new(&factory, world, &plan, 0)
//! # Ok::<(), multimodule::Error>(())
//! ```
//!
//! # Why there is no multi-module process-group collection
//! Megatron-Core has a `MultiModuleProcessGroupCollection`: a dictionary from module names to
//! each module's `ProcessGroupCollection`, which model code reads (for example the language
//! model's cp size). Its pipeline communicator does not use it, and neither does this crate's:
//! the pipeline moves data point to point over the parent communicator, addressed by world
//! rank, and the only sub-communicators it needs are each bridge's broadcast groups (tp × cp at
//! a boundary stage), which come from the plan's [`BridgePlan`]s and are shared between bridges
//! ([`GroupCache`]). Building every module's full collection (tp, cp, dp, pp, ...) would cost
//! collective splits on every rank for groups that nothing here uses, so grid-core no longer
//! carries an unused copy of that dictionary. A framework that wants per-module collections
//! builds each with grid-core's `build_collection` from that module's layout (the module grid
//! of [`PipelineSpec::modules`], at its rank offset) and keys them by module name.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Calls `$body` with `$v` bound to the typed vector (or slice) inside a
/// [`HostBuffer`](grid_core::HostBuffer)-like enum, whatever the element type.
macro_rules! dispatch {
    ($enum:ident, $buf:expr, $v:ident => $body:expr) => {
        match $buf {
            $enum::F32($v) => $body,
            $enum::F64($v) => $body,
            $enum::I32($v) => $body,
            $enum::I64($v) => $body,
            $enum::U8($v) => $body,
            $enum::F16($v) => $body,
            $enum::BF16($v) => $body,
            $enum::I8($v) => $body,
            $enum::U32($v) => $body,
            $enum::U64($v) => $body,
            $enum::Bool($v) => $body,
            $enum::F8E4M3($v) => $body,
            $enum::F8E5M2($v) => $body,
        }
    };
}

// Modules depend one way (`a ← b`: b uses a). Plan: error, ordered ← spec ← stages, routing ← plan.
// Data path: pool ← tensor ← wire ← bridge (+ routing) ← pipeline (+ plan); `error` under all.
mod bridge;
mod error;
mod ordered;
mod pipeline;
mod plan;
mod pool;
mod routing;
mod spec;
mod stages;
mod tensor;
mod wire;

pub use bridge::{BridgeCommunicator, Crossing, GroupCache, TAGS_PER_BRIDGE};
pub use error::{Error, Result};
pub use ordered::OrderedMap;
pub use pipeline::{ModuleInputs, MultiModulePipelineCommunicator};
pub use plan::{BridgeSummary, ModuleStage, PipelinePlan, RankModuleInfo, RankPlan, Role, Route};
pub use pool::BufferPool;
pub use routing::{BridgeEnd, BridgePlan, PartRoute, Side};
pub use spec::{DimMapping, ModuleSpec, PipelineSpec, MAX_SPEC_BYTES};
pub use stages::StageTable;
pub use tensor::{batch_split_sizes, split_at_batch_dim, tensor_split_sizes, Activation};
pub use wire::ShapeMode;
