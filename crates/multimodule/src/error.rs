//! The crate's one error type.

/// Everything that can go wrong in `multimodule`: an invalid pipeline spec (each variant names
/// the problem and what would be valid), a bad tensor or split request, a rank asking for a role
/// it does not have, a gradient that does not match what was sent forward, and communication
/// failures reported by a backend (wrapped [`grid_core::Error`]).
///
/// ```
/// use multimodule::{Error, PipelineSpec};
/// let err = PipelineSpec::from_json_str(r#"{"modules": {}, "topology": {}}"#).unwrap_err();
/// assert!(matches!(err, Error::EmptySpec));
/// ```
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ----- reading a spec ----------------------------------------------------------------------
    /// The file could not be read.
    #[error("cannot read pipeline spec {path}: {message}")]
    Io { path: String, message: String },
    /// The text is not valid JSON/TOML or does not have the spec's shape.
    #[error("invalid {format} pipeline spec: {message}")]
    Parse {
        format: &'static str,
        message: String,
    },

    // ----- validating a spec -------------------------------------------------------------------
    /// No module at all.
    #[error("the pipeline spec has no module: give at least one entry under \"modules\"")]
    EmptySpec,
    /// A module name given twice.
    #[error("module '{name}' is defined more than once: module names must be unique")]
    DuplicateModule { name: String },
    /// A module name that is empty.
    #[error("a module has an empty name: every module needs a non-empty name")]
    EmptyModuleName,
    /// A name (in the topology, the language-model field or a colocation group) that is not a
    /// module.
    #[error("{context} names unknown module '{name}': known modules are {known:?}")]
    UnknownModule {
        name: String,
        context: String,
        known: Vec<String>,
    },
    /// A topology key given twice.
    #[error("topology lists module '{name}' more than once: give each module one list of downstream modules")]
    DuplicateTopologyKey { name: String },
    /// The module graph has a cycle (anywhere, not only upstream of a sink).
    #[error("the module topology has a cycle {}: the topology must be a DAG", cycle.join(" -> "))]
    Cycle { cycle: Vec<String> },
    /// Every module has a downstream module.
    #[error("the module topology has no sink: at least one module must have no downstream module")]
    NoSink,
    /// A module grid without a `pp` dimension.
    #[error("grid of module '{module}' has no 'pp' dimension (dims {dims:?}): every module grid needs one, of size 1 if the module is not pipelined")]
    MissingPp { module: String, dims: Vec<String> },
    /// A module grid that grid-core rejects.
    #[error("grid of module '{module}' is invalid: {source}")]
    Grid {
        module: String,
        source: grid_core::Error,
    },
    /// A grid given in both the full and the short form, or with other problems of form.
    #[error("grid of module '{module}': {message}")]
    GridForm { module: String, message: String },
    /// A grid that does not fit the declared world.
    #[error("grid of module '{module}' covers ranks {first}..{end} but the world has {world_size} ranks")]
    GridOutsideWorld {
        module: String,
        first: usize,
        end: usize,
        world_size: usize,
    },
    /// Two modules share ranks without being declared colocated.
    #[error("modules '{a}' and '{b}' share ranks ({a}: {a_first}..{a_end}, {b}: {b_first}..{b_end}) but are not declared colocated: add [\"{a}\", \"{b}\"] to \"colocated\" if this is intended, or move one grid with its rank_offset")]
    UndeclaredOverlap {
        a: String,
        b: String,
        a_first: usize,
        a_end: usize,
        b_first: usize,
        b_end: usize,
    },
    /// A colocation group that is not a list of at least two distinct modules.
    #[error("colocated group {group:?} is invalid: {message}")]
    BadColocated { group: Vec<String>, message: String },
    /// An output dimensionality other than 2 or 3.
    #[error("output_ndim of module '{module}' is {value}: it must be 2 ([B*S, H]) or 3 ([S, B, H] or as dim_mapping says)")]
    BadOutputNdim { module: String, value: usize },
    /// A dim mapping that is not a permutation of 0, 1, 2.
    #[error("dim_mapping {{s: {s}, b: {b}, h: {h}}} is invalid: s, b and h must be 0, 1 and 2 in some order")]
    BadDimMapping { s: usize, b: usize, h: usize },

    // ----- reading a plan ----------------------------------------------------------------------
    /// A plan document ([`crate::PipelinePlan::from_json_str`]) whose stages or bridges are not
    /// the plan of the spec it contains (stale or edited by hand).
    #[error("the pipeline plan does not match its spec: {what}; regenerate the plan from the spec (grid pipeline SPEC --format json)")]
    PlanMismatch { what: String },

    // ----- stage queries -----------------------------------------------------------------------
    /// A rank that the named module's grid does not contain.
    #[error("rank {rank} is not in module '{module}', which covers ranks {first}..{end}")]
    RankNotInModule {
        rank: usize,
        module: String,
        first: usize,
        end: usize,
    },
    /// A rank that no module contains.
    #[error("rank {rank} is in no module of the pipeline")]
    RankInNoModule { rank: usize },

    // ----- tensors and splitting ---------------------------------------------------------------
    /// A tensor whose data length does not match its shape, or of the wrong rank.
    #[error("{op}: {message}")]
    Tensor { op: &'static str, message: String },
    /// A split into zero parts.
    #[error("cannot split a tensor into {parts} parts: the number of splits must be positive")]
    ZeroSplits { parts: usize },
    /// Per-sample split metadata with the wrong number of entries.
    #[error(
        "bridge split metadata has {entries} entries, but communication requires {splits} splits"
    )]
    SplitMetadataCount { entries: usize, splits: usize },
    /// Per-sample split metadata whose sum is not the batch size.
    #[error("bridge split metadata {sizes:?} sums to {sum}, but the tensor's batch dimension has {batch} rows")]
    SplitMetadataSum {
        sizes: Vec<usize>,
        sum: usize,
        batch: usize,
    },

    // ----- bridges and the pipeline communicator ----------------------------------------------
    /// An operation called on a rank that has no part in it.
    #[error("{op}: rank {rank} is not in the {side} grid of {what}")]
    NotInGrid {
        op: &'static str,
        rank: usize,
        side: &'static str,
        what: String,
    },
    /// A configuration that a bridge cannot carry.
    #[error("bridge {src} -> {dst}: {message}")]
    BridgeConfig {
        src: String,
        dst: String,
        message: String,
    },
    /// A gradient whose shape differs from what the forward pass sent.
    #[error("{op}: gradient from rank {peer} has shape {actual:?}, but the forward pass sent shape {expected:?} to it")]
    GradientShape {
        op: &'static str,
        peer: usize,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// A gradient handed to a backward send whose shape differs from the forward activation.
    #[error("{op}: gradient has shape {actual:?}, but the activation it belongs to has shape {expected:?}")]
    GradientMismatch {
        op: &'static str,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// Received parts that cannot be concatenated (different dtypes or non-batch dimensions).
    #[error("{op}: parts received from ranks {ranks:?} do not fit together: {message}")]
    IncompatibleParts {
        op: &'static str,
        ranks: Vec<usize>,
        message: String,
    },
    /// A tensor that does not have the static shape declared for a bridge or module
    /// ([`crate::ShapeMode::Static`]). Detected before anything is sent; the peers get
    /// [`Error::PeerError`].
    #[error("{op}: the tensor is {actual_dtype} {actual:?}, but {what} declares the static shape {dtype} {expected:?}; nothing was sent: give tensors of the declared shape, or use ShapeMode::Variable or ShapeMode::Learned")]
    StaticShape {
        op: &'static str,
        what: String,
        expected: Vec<usize>,
        dtype: grid_core::DType,
        actual: Vec<usize>,
        actual_dtype: grid_core::DType,
    },
    /// A peer reported a failure instead of sending data.
    #[error("{op}: rank {peer} failed on its side of the exchange and sent no data")]
    PeerError { op: &'static str, peer: usize },
    /// A message that does not follow the wire format.
    #[error("{op}: malformed message from rank {peer}: {message}")]
    Protocol {
        op: &'static str,
        peer: usize,
        message: String,
    },
    /// Calls in an order that cannot work.
    #[error("{op}: {message}")]
    Usage { op: &'static str, message: String },
    /// A module name that this rank does not hold.
    #[error("{op}: rank {rank} does not hold module '{module}'; it holds {held:?}")]
    ModuleNotOnRank {
        op: &'static str,
        rank: usize,
        module: String,
        held: Vec<String>,
    },
    /// A failure reported by the communicator backend.
    #[error(transparent)]
    Comm(#[from] grid_core::Error),
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
