//! # multimodule
//!
//! Stage accounting, bridge communicators and the multi-module pipeline communicator for models
//! built from several modules with different parallel layouts (docs/semantics.md §5–6).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bridge;
mod error;
mod ordered;
mod pipeline;
mod plan;
mod routing;
mod spec;
mod stages;
mod tensor;
mod wire;

pub use bridge::{BridgeCommunicator, Crossing, GroupCache, TAGS_PER_BRIDGE};
pub use error::{Error, Result};
pub use ordered::OrderedMap;
pub use pipeline::{ModuleInputs, MultiModulePipelineCommunicator};
pub use plan::{
    bridge_plans, BridgeSummary, ModuleStage, PipelinePlan, RankModuleInfo, RankPlan, Role, Route,
};
pub use routing::{BridgeEnd, BridgePlan, PartRoute, Side};
pub use spec::{DimMapping, ModuleSpec, PipelineSpec};
pub use stages::StageTable;
pub use tensor::{batch_split_sizes, split_at_batch_dim, tensor_split_sizes, Activation};
pub use wire::{BufferPool, ShapeMode};
