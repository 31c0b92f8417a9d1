//! The crate's one error type.

use crate::comm::{DType, OpSite};

/// ` #seq on communicator 'name' (world ranks ...)`, or nothing when the site is unknown.
fn site(at: &Option<Box<OpSite>>) -> String {
    at.as_ref().map(|a| a.to_string()).unwrap_or_default()
}

/// Everything that can go wrong in `grid-core`: invalid layouts (each variant names the violated
/// condition and the numbers involved) and communication failures reported by a backend through
/// the communicator traits.
/// Variant fields are the numbers and names the message shows.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ----- grids -------------------------------------------------------------------------------
    /// `shape` and `dim_names` have different lengths.
    #[error("grid shape {shape:?} has {} entries but dim_names {names:?} has {}: give one name per dimension", shape.len(), names.len())]
    ShapeNamesMismatch {
        shape: Vec<usize>,
        names: Vec<String>,
    },
    /// A grid dimension or parallel size of zero.
    #[error("{what} must be a positive integer, got {value}")]
    NonPositive { what: String, value: i64 },
    /// A dimension name appears twice.
    #[error(
        "dimension '{name}' appears more than once in {names:?}: dimension names must be unique"
    )]
    DuplicateDim { name: String, names: Vec<String> },
    /// A dimension that the grid or view does not have.
    #[error("'{dim}' is not a dimension of {context} with dim_names {names:?}")]
    UnknownDim {
        dim: String,
        context: String,
        names: Vec<String>,
    },
    /// The grid does not fit the world.
    #[error("grid shape {shape:?} ({size} ranks) is over sized with world size {world_size} and rank offset {rank_offset}: it needs size + offset <= world size")]
    GridOversized {
        shape: Vec<usize>,
        size: usize,
        world_size: usize,
        rank_offset: usize,
    },
    /// The rank count overflows the machine word.
    #[error("the product of the sizes {sizes:?} overflows")]
    SizeOverflow { sizes: Vec<usize> },
    /// A rank outside the layout.
    #[error(
        "rank {rank} is outside the layout, which covers ranks {first}..{end} (end exclusive)"
    )]
    RankOutOfRange {
        rank: usize,
        first: usize,
        end: usize,
    },
    /// `create_pg` twice for the same key.
    #[error("process group for {key} has already been created")]
    GroupExists { key: String },
    /// `get_pg` before `create_pg`.
    #[error("process group for {key} hasn't been created: call create_pg first")]
    GroupMissing { key: String },
    /// A view name that is not registered.
    #[error("view '{name}' is not registered; registered views: {registered:?}")]
    UnknownView {
        name: String,
        registered: Vec<String>,
    },
    /// A view that cannot be registered.
    #[error("cannot register view '{name}': {reason}")]
    InvalidView { name: String, reason: String },

    // ----- order strings (Megatron's RankGenerator) -------------------------------------------
    /// An order-string token that is not one of tp, pp, dp, ep, cp (gtp_remat).
    #[error("unknown token '{token}' in order '{order}': valid tokens are tp, cp, ep, dp, pp (and gtp_remat)")]
    UnknownToken { token: String, order: String },
    /// A token repeated in the order string (Megatron silently produces ranks outside the world).
    #[error(
        "token '{token}' appears more than once in order '{order}': each dimension may appear once"
    )]
    RepeatedToken { token: String, order: String },
    /// A parallel size > 1 whose token is missing from the order string.
    #[error("the size of {token} is {size}, but the order '{order}' does not name it: add '{token}' to the order")]
    MissingToken {
        token: String,
        size: usize,
        order: String,
    },
    /// A group query naming a token that is not in the order.
    #[error("'{token}' is not in the order {order}")]
    TokenNotInOrder { token: String, order: String },
    /// ep > 1 and cp > 1 in one rank generator.
    #[error("ep ({ep}) and cp ({cp}) are both > 1 in one rank generator: cp belongs to the decoder grid and ep to the expert grid")]
    EpAndCp { ep: usize, cp: usize },
    /// Megatron's masked generator got inconsistent sizes.
    #[error(
        "world size {world_size} is not the product {product} of the parallel sizes {sizes:?}"
    )]
    WorldNotProduct {
        world_size: usize,
        product: usize,
        sizes: Vec<usize>,
    },
    /// mask and sizes of different length.
    #[error("mask has {mask} entries but there are {sizes} parallel sizes")]
    MaskLength { mask: usize, sizes: usize },

    // ----- initialize_model_parallel validation ----------------------------------------------
    /// world % (tp·pp·cp) != 0.
    #[error(
        "world size {world_size} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {model_size}"
    )]
    WorldNotDivisible {
        world_size: usize,
        tp: usize,
        pp: usize,
        cp: usize,
        model_size: usize,
    },
    /// world % (etp·ep·pp) != 0.
    #[error(
        "world size {world_size} is not divisible by expert tp·ep·pp = {etp}·{ep}·{pp} = {size}"
    )]
    ExpertWorldNotDivisible {
        world_size: usize,
        etp: usize,
        ep: usize,
        pp: usize,
        size: usize,
    },
    /// Virtual pipeline without a pipeline.
    #[error(
        "virtual pipeline size {vpp} needs a pipeline-parallel size greater than 1 (pp is {pp})"
    )]
    VppWithoutPp { vpp: usize, pp: usize },
    /// Non-pp-last order whose expert and dense data-parallel sizes differ.
    #[error("order '{order}' does not end in pp and pp = {pp}, so the data-parallel sizes of the dense ({dp}) and expert ({expert_dp}) layers must be equal: make etp·ep equal tp·cp, or put pp last")]
    DpMismatchNotPpLast {
        order: String,
        pp: usize,
        dp: usize,
        expert_dp: usize,
    },
    /// The two grids disagree on the pipeline groups.
    #[error("pipeline groups differ between the dense grid (pp stride {dense_stride}) and the expert grid (pp stride {expert_stride}) for order '{order}': the tokens before pp must have the same total size in both grids")]
    PpGroupsDiffer {
        order: String,
        dense_stride: usize,
        expert_stride: usize,
    },
    /// dp·cp not divisible by the number of distributed-optimizer instances.
    #[error("data parallel size with cp, dp·cp = {dp_cp}, is not divisible by the number of distributed-optimizer instances {instances}")]
    DistOptDpCp { dp_cp: usize, instances: usize },
    /// expert dp not divisible by the number of distributed-optimizer instances.
    #[error("expert data parallel size {expert_dp} is not divisible by the number of distributed-optimizer instances {instances}")]
    DistOptExpertDp { expert_dp: usize, instances: usize },
    /// Hierarchical sizes that do not multiply to the group size.
    #[error("hierarchical sizes {sizes:?} multiply to {product}, but they must multiply to {expected} ({what})")]
    HierarchicalProduct {
        sizes: Vec<usize>,
        product: usize,
        expected: usize,
        what: String,
    },
    /// An embedding rule that picks ranks outside the pipeline group.
    #[error("embedding rule for {family} returned {returned:?}, which is not a non-empty subset of the pipeline group {pp_group:?}")]
    BadEmbeddingRule {
        family: String,
        returned: Vec<usize>,
        pp_group: Vec<usize>,
    },
    /// An unknown family name.
    #[error("unknown process-group family '{name}': valid names are {valid}")]
    UnknownFamily { name: String, valid: String },
    /// A virtual-pipeline query without the `vp_stage` it needs, or with one out of range.
    #[error("{function}: {problem}")]
    VpStage {
        function: &'static str,
        problem: String,
    },
    /// An empty pipeline group given to an embedding-rank function.
    #[error("{function}: the pipeline group is empty; give the ranks of at least one stage")]
    EmptyPipelineGroup { function: &'static str },
    /// The optimizer/DDP wiring lacks a group it needs.
    #[error("{function}: the {group} process group is required but not provided in the collection: {why}")]
    WiringGroupMissing {
        function: &'static str,
        group: String,
        why: String,
    },
    /// Names that are not process groups of a collection.
    #[error("{function}: invalid process groups requested: {invalid:?} (valid names: {valid})")]
    InvalidGroupNames {
        function: &'static str,
        invalid: Vec<String>,
        valid: String,
    },
    /// A general invalid argument with an explanation.
    #[error("{0}")]
    Invalid(String),

    // ----- communication ----------------------------------------------------------------------
    /// Two buffers whose lengths do not fit the operation.
    #[error("{op}: {what} has {actual} elements, expected {expected}")]
    LengthMismatch {
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// Send and receive buffers of different element types.
    #[error("{op}: element types differ: {expected} and {actual}")]
    DTypeMismatch {
        op: &'static str,
        expected: DType,
        actual: DType,
    },
    /// An element type or reduction the backend cannot do.
    #[error("{op}: the {backend} backend does not support {what}")]
    Unsupported {
        op: &'static str,
        backend: &'static str,
        what: String,
    },
    /// A root or peer that is not a rank of the communicator.
    #[error(
        "{op}: {what} {rank} is not a rank of this communicator of size {size} (valid: 0..{size})"
    )]
    PeerOutOfRange {
        op: &'static str,
        what: &'static str,
        rank: usize,
        size: usize,
    },
    /// A call on a communicator that was finalized or aborted.
    #[error("{op}: the communicator was {state}; create a new one")]
    Finalized {
        op: &'static str,
        state: &'static str,
    },
    /// Ranks disagree on the plan they build communicators from.
    #[error("ranks hold different layout plans (hash of this rank {mine:#018x}; ranks {mismatched:?} hold another): every rank must build the same plan")]
    PlanMismatch { mine: u64, mismatched: Vec<usize> },
    /// The plan's ranks are not all ranks of the communicator it is built on.
    #[error("the plan covers ranks {first}..{end} (world size {world_size} from rank offset {first}) but the parent communicator has {parent_size} ranks and rank {missing} is not one of them: a plan must fit its parent (world size + rank offset <= {parent_size} for a parent over ranks 0..{parent_size}); no group was created", first = rank_offset, end = rank_offset.saturating_add(*world_size))]
    PlanDoesNotFit {
        world_size: usize,
        rank_offset: usize,
        parent_size: usize,
        missing: usize,
    },
    /// An operation that did not finish within its time limit ([`crate::TimeLimit`]): the
    /// operation, where it ran (communicator, members, sequence number; added by the front
    /// end), how long it waited, and the communicator rank it was waiting for where known.
    #[error("{op}{}: timed out after {millis} ms{}", site(at), peer.map(|p| format!(" waiting for rank {p}")).unwrap_or_default())]
    Timeout {
        op: &'static str,
        millis: u64,
        peer: Option<usize>,
        at: Option<Box<OpSite>>,
    },
    /// A peer rank failed or disappeared: the operation, where it ran (added by the front
    /// end), the communicator rank blamed, and what this rank saw.
    #[error("{op}{}: peer rank {peer} failed: {message}", site(at))]
    PeerFailed {
        op: &'static str,
        peer: usize,
        message: String,
        at: Option<Box<OpSite>>,
    },
    /// An operation on a communicator that was aborted ([`crate::Communicator::abort`]) or
    /// failed earlier ([`crate::Communicator::failure`]): every pending and later operation
    /// returns this, with the reason.
    #[error("{op}{}: {reason}", site(at))]
    Aborted {
        op: &'static str,
        reason: String,
        at: Option<Box<OpSite>>,
    },
    /// A failure reported by the backend library, with its message only (the form of the
    /// backends not yet behind the front end; [`Error::Library`] carries more).
    #[error("{backend}: {op} failed: {message}")]
    Backend {
        backend: &'static str,
        op: &'static str,
        message: String,
    },
    /// A failure reported by a backend library: which backend, operation and communicator, the
    /// library's own error code and class where it has them, and its message.
    #[error("{0}")]
    Library(Box<LibraryError>),
    /// A send or receive whose peer is this rank.
    #[error("{op}: peer {peer} is this rank; send and receive need another rank (valid: 0..{size} except {peer}), or use batch_p2p")]
    SelfPeer {
        op: &'static str,
        peer: usize,
        size: usize,
    },
    /// A message tag above what the backend can carry.
    #[error("{op}: tag {tag} exceeds the {backend} backend's tag limit {max} (valid: 0..={max})")]
    TagOutOfRange {
        op: &'static str,
        backend: &'static str,
        tag: u32,
        max: u32,
    },
    /// A buffer that cannot be cut into one equal block per rank.
    #[error("{op}: {what} of {len} elements cannot be cut into {parts} equal blocks (give a multiple of {parts})")]
    Indivisible {
        op: &'static str,
        what: &'static str,
        len: usize,
        parts: usize,
    },
    /// A per-rank counts vector of an uneven collective (`all_to_all_v`, `all_gather_v`,
    /// `reduce_scatter_v`) that does not fit the communicator or the buffer: `problem` says how.
    #[error("{op}: {what} {counts:?} {problem}")]
    BadCounts {
        op: &'static str,
        what: &'static str,
        counts: Vec<usize>,
        problem: String,
    },
    /// The root of a rooted operation (`reduce`, `gather`, `scatter`) did not pass the buffer
    /// that only the root uses.
    #[error("{op}: this rank ({root}) is the root and must pass the {what} (it is used only on the root; the other ranks pass None)")]
    MissingRootBuffer {
        op: &'static str,
        what: &'static str,
        root: usize,
    },
    /// Mismatch checking ([`crate::MismatchCheck`]) found that the ranks disagree about a
    /// collective: which operation (as this rank called it), on which communicator, this
    /// rank's sequence number, the first field that differs, and every rank's value of it
    /// (communicator rank, value). Every rank of the communicator gets this error.
    #[error(
        "{op} #{seq} on communicator '{comm}': ranks disagree on {field}: {} (every rank must make the same collective call)",
        crate::comm::describe_values(values)
    )]
    CollectiveMismatch {
        op: &'static str,
        comm: String,
        seq: u64,
        field: &'static str,
        values: Vec<(usize, String)>,
    },
}

/// The details of [`Error::Library`]: a backend library's failure with everything known about
/// it.
///
/// ```
/// use grid_core::{Error, LibraryError};
/// let e = Error::from(LibraryError::new("mpi", "all_reduce", "MPI_ERR_TRUNCATE: message truncated")
///     .comm("tp")
///     .code(15)
///     .class("MPI_ERR_TRUNCATE"));
/// assert!(e.is_communication());
/// assert_eq!(e.to_string(), "mpi: all_reduce on communicator 'tp' failed (MPI_ERR_TRUNCATE, code 15): MPI_ERR_TRUNCATE: message truncated");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryError {
    /// Backend name (`"mpi"`, `"gloo"`, `"nccl"`, `"local"`).
    pub backend: &'static str,
    /// The operation that failed.
    pub op: &'static str,
    /// The communicator's descriptive name (empty when unknown).
    pub comm: String,
    /// The operation's sequence number on the communicator (set by the front end).
    pub seq: Option<u64>,
    /// The library's error code (`MPI_ERR_*` number, `ncclResult_t`, ...), when it has one.
    pub code: Option<i64>,
    /// The library's error class or kind (`MPI_ERR_TRUNCATE`, `ncclRemoteError`, ...).
    pub class: Option<String>,
    /// The library's message.
    pub message: String,
}

impl LibraryError {
    /// A failure of `op` on `backend` with `message`; add the rest with the builder methods.
    pub fn new(backend: &'static str, op: &'static str, message: impl Into<String>) -> Self {
        LibraryError {
            backend,
            op,
            comm: String::new(),
            seq: None,
            code: None,
            class: None,
            message: message.into(),
        }
    }
    /// Names the communicator.
    pub fn comm(mut self, comm: impl Into<String>) -> Self {
        self.comm = comm.into();
        self
    }
    /// Sets the library's error code.
    pub fn code(mut self, code: i64) -> Self {
        self.code = Some(code);
        self
    }
    /// Sets the library's error class.
    pub fn class(mut self, class: impl Into<String>) -> Self {
        self.class = Some(class.into());
        self
    }
}

impl std::fmt::Display for LibraryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.backend, self.op)?;
        if let Some(s) = self.seq {
            write!(f, " #{s}")?;
        }
        if !self.comm.is_empty() {
            write!(f, " on communicator '{}'", self.comm)?;
        }
        write!(f, " failed")?;
        match (&self.class, self.code) {
            (Some(c), Some(n)) => write!(f, " ({c}, code {n})")?,
            (Some(c), None) => write!(f, " ({c})")?,
            (None, Some(n)) => write!(f, " (code {n})")?,
            (None, None) => {}
        }
        write!(f, ": {}", self.message)
    }
}

impl From<LibraryError> for Error {
    fn from(e: LibraryError) -> Error {
        Error::Library(Box::new(e))
    }
}

impl Error {
    /// Adds where an operation ran (communicator name, members, sequence number) to the errors
    /// that carry it ([`Error::Timeout`], [`Error::PeerFailed`], [`Error::Aborted`], and the
    /// name and number of an [`Error::Library`]) when the backend left it out; other errors are
    /// returned unchanged. The front end calls it for every failed operation.
    ///
    /// ```
    /// use grid_core::{Error, OpSite};
    /// let e = Error::Timeout { op: "barrier", millis: 10, peer: Some(1), at: None };
    /// let site = || OpSite { comm: "tp".into(), ranks: vec![4, 5], seq: Some(7) };
    /// assert_eq!(
    ///     e.with_site(site).to_string(),
    ///     "barrier #7 on communicator 'tp' (world ranks 4, 5): timed out after 10 ms waiting for rank 1"
    /// );
    /// ```
    pub fn with_site(mut self, site: impl FnOnce() -> OpSite) -> Error {
        match &mut self {
            Error::Timeout { at, .. }
            | Error::PeerFailed { at, .. }
            | Error::Aborted { at, .. }
                if at.is_none() =>
            {
                *at = Some(Box::new(site()));
            }
            Error::Library(l) if l.comm.is_empty() || l.seq.is_none() => {
                let s = site();
                if l.comm.is_empty() {
                    l.comm = s.comm;
                }
                if l.seq.is_none() {
                    l.seq = s.seq;
                }
            }
            _ => {}
        }
        self
    }

    /// The same failure attributed to the operation `op`: the name in [`Error::Timeout`],
    /// [`Error::PeerFailed`], [`Error::Aborted`] and [`Error::Library`] becomes `op`; other
    /// errors are returned unchanged. The mismatch check calls it, so that a rank that times
    /// out or is aborted while the check of a `gather` runs hears about its `gather`, not about
    /// the check's internal all-reduce.
    pub(crate) fn in_op(mut self, name: &'static str) -> Error {
        match &mut self {
            Error::Timeout { op, .. }
            | Error::PeerFailed { op, .. }
            | Error::Aborted { op, .. } => *op = name,
            Error::Library(l) => l.op = name,
            _ => {}
        }
        self
    }

    /// True for errors of communication (arguments of a communicator call, a backend or peer
    /// failure, a time-out, a finished communicator, a plan mismatch between ranks); false for
    /// errors of topology (layouts, grids, order strings, groups).
    ///
    /// ```
    /// use grid_core::Error;
    /// assert!(Error::Timeout { op: "barrier", millis: 10, peer: None, at: None }.is_communication());
    /// assert!(!Error::NonPositive { what: "tp".into(), value: 0 }.is_communication());
    /// ```
    pub fn is_communication(&self) -> bool {
        use Error::*;
        matches!(
            self,
            LengthMismatch { .. }
                | DTypeMismatch { .. }
                | Unsupported { .. }
                | PeerOutOfRange { .. }
                | Finalized { .. }
                | PlanMismatch { .. }
                | PlanDoesNotFit { .. }
                | Timeout { .. }
                | PeerFailed { .. }
                | Aborted { .. }
                | Backend { .. }
                | Library(_)
                | SelfPeer { .. }
                | TagOutOfRange { .. }
                | Indivisible { .. }
                | BadCounts { .. }
                | MissingRootBuffer { .. }
                | CollectiveMismatch { .. }
        )
    }

    /// The Python exception class Megatron-Core raises for the same condition (`RuntimeError`,
    /// `AssertionError`, `KeyError`, `ValueError`), or `None` where Megatron has no equivalent.
    /// Used to check parity with Megatron's reference vectors.
    pub fn megatron_category(&self) -> Option<&'static str> {
        use Error::*;
        Some(match self {
            ShapeNamesMismatch { .. } | UnknownDim { .. } | TokenNotInOrder { .. } => "ValueError",
            InvalidView { .. } | NonPositive { .. } | DuplicateDim { .. } => "ValueError",
            GridOversized { .. } | MissingToken { .. } | WorldNotDivisible { .. } => "RuntimeError",
            ExpertWorldNotDivisible { .. } | VppWithoutPp { .. } => "RuntimeError",
            GroupExists { .. } | GroupMissing { .. } | UnknownView { .. } | UnknownToken { .. } => {
                "KeyError"
            }
            EpAndCp { .. } | DpMismatchNotPpLast { .. } | PpGroupsDiffer { .. } => "AssertionError",
            DistOptDpCp { .. } | DistOptExpertDp { .. } | HierarchicalProduct { .. } => {
                "AssertionError"
            }
            UnknownFamily { .. } | WiringGroupMissing { .. } | InvalidGroupNames { .. } => {
                "ValueError"
            }
            VpStage { .. } => "AssertionError",
            EmptyPipelineGroup { .. } => "IndexError",
            _ => return None,
        })
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
