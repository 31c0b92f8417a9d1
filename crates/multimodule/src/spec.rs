//! The pipeline spec: modules (in file order) with their grids, the module topology, per-module
//! output dimensionality, the language-model module, the dim mapping and the colocation groups.
//!
//! # File format (JSON; TOML has the same structure)
//! ```json
//! {
//!   "world_size": 8,
//!   "modules": {
//!     "image_encoder": {"grid": {"shape": [1, 1, 1, 1], "dims": ["tp", "cp", "pp", "dp"], "rank_offset": 0}},
//!     "audio_encoder": {"tp": 1, "offset": 1},
//!     "llm":           {"tp": 2, "pp": 2, "offset": 2, "output_ndim": 3},
//!     "generator":     {"tp": 2, "offset": 6}
//!   },
//!   "topology": {"image_encoder": ["llm"], "audio_encoder": ["llm"], "llm": ["generator"]},
//!   "language_model": "llm",
//!   "dim_mapping": {"s": 1, "b": 0, "h": 2},
//!   "colocated": []
//! }
//! ```
//! * `modules` is a map (kept in file order) or a list of entries with a `name` field. A module's
//!   grid is either under `grid` or written inline; either form is the full one
//!   (`shape`, `dims` (alias `dim_names`), `rank_offset`) or the short one
//!   (`tp`, `cp`, `pp`, `dp`, `gtp_remat`, `offset`, each defaulting to 1 / 0; dims
//!   `[tp, cp, pp, dp]`, or `[tp, gtp_remat, cp, pp, dp]` when `gtp_remat` is given).
//!   `output_ndim` (2 or 3, default 3) may be given per module or in a top-level
//!   `module_output_ndim` map (Megatron's name).
//! * `topology` maps a module to its downstream modules. A module without a key is a sink
//!   (Megatron's constructor raises `KeyError` there). Repeated edges are kept once.
//! * `language_model` (alias `language_model_module_name`) names one module, optional.
//! * `colocated` lists groups of modules that are *meant* to share ranks. Any two modules whose
//!   rank ranges overlap must appear together in one group; otherwise the spec is rejected,
//!   because overlapping rank ranges are far more often a wrong `rank_offset` than a design.
//! * `world_size` is optional; when given every grid must fit in it.
//!
//! Validation rejects: no module, empty or repeated names, unknown names anywhere, a cycle
//! **anywhere** in the graph (Megatron only notices cycles upstream of the queried module), no
//! sink, a grid without `pp`, undeclared overlaps, a bad `output_ndim` or `dim_mapping`.

use crate::error::{Error, Result};
use crate::ordered::OrderedMap;
use grid_core::HyperGrid;
use serde::{Deserialize, Serialize};
use std::path::Path;

// Text to spec and back: `raw` parses the file form and lowers it to modules, `validate` checks
// them and builds the [`PipelineSpec`], `canon` serializes it (and deserializes through `raw`).
mod canon;
mod raw;
mod validate;

use raw::RawSpec;

/// Where the sequence (`s`), batch (`b`) and hidden (`h`) dimensions sit in a 3-D activation.
/// Megatron's default is `{s: 1, b: 0, h: 2}`; 2-D activations (`[B·S, H]`) always use dim 0 as
/// the batch dimension, whatever the mapping says.
///
/// ```
/// use multimodule::DimMapping;
/// let m = DimMapping::default();
/// assert_eq!((m.s, m.b, m.h), (1, 0, 2));
/// assert!(DimMapping::new(0, 0, 2).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DimMapping {
    /// Sequence dimension.
    pub s: usize,
    /// Batch dimension.
    pub b: usize,
    /// Hidden dimension.
    pub h: usize,
}

impl Default for DimMapping {
    fn default() -> Self {
        DimMapping { s: 1, b: 0, h: 2 }
    }
}

impl DimMapping {
    /// A mapping; `s`, `b` and `h` must be 0, 1 and 2 in some order.
    pub fn new(s: usize, b: usize, h: usize) -> Result<DimMapping> {
        let m = DimMapping { s, b, h };
        m.validate()?;
        Ok(m)
    }
    /// Checks that the mapping is a permutation of 0, 1, 2.
    pub fn validate(&self) -> Result<()> {
        let mut seen = [false; 3];
        for v in [self.s, self.b, self.h] {
            if v > 2 || std::mem::replace(&mut seen[v], true) {
                return Err(Error::BadDimMapping {
                    s: self.s,
                    b: self.b,
                    h: self.h,
                });
            }
        }
        Ok(())
    }
    /// The batch dimension of a tensor with `ndim` dimensions: `b` for 3-D, 0 for 2-D.
    pub fn batch_dim(&self, ndim: usize) -> usize {
        if ndim == 3 {
            self.b
        } else {
            0
        }
    }
    /// The sequence dimension of a tensor with `ndim` dimensions (`None` for 2-D, where the
    /// sequence is folded into dim 0 together with the batch).
    pub fn seq_dim(&self, ndim: usize) -> Option<usize> {
        (ndim == 3).then_some(self.s)
    }
}

/// One module of a pipeline: its name, grid and output dimensionality.
///
/// ```
/// use grid_core::HyperGrid;
/// use multimodule::ModuleSpec;
/// let g = HyperGrid::new(vec![2, 1, 2, 1], &["tp", "cp", "pp", "dp"], 4).unwrap();
/// let m = ModuleSpec::new("llm", g);
/// assert_eq!(m.pp_size(), 2);
/// assert_eq!(m.output_ndim, 3);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleSpec {
    /// Module name.
    pub name: String,
    /// The module's grid (it must have a `pp` dimension).
    pub grid: HyperGrid,
    /// Dimensionality of the module's output activations (2 or 3).
    pub output_ndim: usize,
}

impl ModuleSpec {
    /// A module with 3-D outputs.
    pub fn new(name: impl Into<String>, grid: HyperGrid) -> ModuleSpec {
        ModuleSpec {
            name: name.into(),
            grid,
            output_ndim: 3,
        }
    }
    /// The same module with another output dimensionality.
    pub fn with_output_ndim(mut self, ndim: usize) -> ModuleSpec {
        self.output_ndim = ndim;
        self
    }
    /// The size of the `pp` dimension (1 if the grid has none; validated specs always have one).
    pub fn pp_size(&self) -> usize {
        self.grid.dim_size("pp").unwrap_or(1)
    }
    /// The pipeline coordinate of `rank` in this module, if the rank is in the grid.
    pub fn pp_rank(&self, rank: usize) -> Option<usize> {
        if !self.grid.contains(rank) {
            return None;
        }
        match self.grid.dim_index("pp") {
            Ok(d) => self.grid.coords(rank).ok().map(|c| c[d]),
            Err(_) => Some(0),
        }
    }
    /// First rank and end (exclusive) of the module's rank range.
    pub fn rank_range(&self) -> (usize, usize) {
        (self.grid.offset(), self.grid.offset() + self.grid.size())
    }
}

/// A validated pipeline spec. Build one from a file ([`PipelineSpec::from_file`]), from text
/// ([`PipelineSpec::from_json_str`], [`PipelineSpec::from_toml_str`]) or in code
/// ([`PipelineSpec::new`]). It serializes back to the canonical JSON form (full grids, every
/// module in the topology).
///
/// ```
/// use multimodule::PipelineSpec;
/// let spec = PipelineSpec::from_json_str(r#"{
///   "modules": {"enc": {"dp": 2}, "llm": {"tp": 2, "pp": 2, "offset": 2}},
///   "topology": {"enc": ["llm"]}
/// }"#).unwrap();
/// assert_eq!(spec.module_names(), vec!["enc", "llm"]);
/// assert_eq!(spec.downstream("enc"), vec!["llm"]);
/// assert!(PipelineSpec::from_json_str(r#"{"modules": {"a": {}}, "topology": {"a": ["a"]}}"#).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSpec {
    world_size: Option<usize>,
    modules: Vec<ModuleSpec>,
    /// Downstream module indices of each module, deduplicated, in file order.
    succ: Vec<Vec<usize>>,
    /// Upstream module indices of each module, in (source index, edge) order.
    pred: Vec<Vec<usize>>,
    /// A topological order of module indices.
    topo: Vec<usize>,
    language_model: Option<String>,
    dim_mapping: DimMapping,
    colocated: Vec<Vec<String>>,
}

/// The largest spec file [`PipelineSpec::from_file`] reads (64 MiB); a larger or endless input
/// is an [`Error::Io`] at once.
pub const MAX_SPEC_BYTES: u64 = 64 << 20;

impl PipelineSpec {
    /// Builds and validates a spec from modules (in order) and edges `(upstream, downstream)`.
    ///
    /// ```
    /// use grid_core::HyperGrid;
    /// use multimodule::{ModuleSpec, PipelineSpec, DimMapping};
    /// let g = |off| HyperGrid::new(vec![1, 1, 1, 1], &["tp", "cp", "pp", "dp"], off).unwrap();
    /// let spec = PipelineSpec::new(
    ///     vec![ModuleSpec::new("a", g(0)), ModuleSpec::new("b", g(1))],
    ///     &[("a", "b")], None, DimMapping::default(), vec![], Some(2),
    /// ).unwrap();
    /// assert_eq!(spec.sinks(), vec!["b"]);
    /// ```
    pub fn new(
        modules: Vec<ModuleSpec>,
        edges: &[(&str, &str)],
        language_model: Option<String>,
        dim_mapping: DimMapping,
        colocated: Vec<Vec<String>>,
        world_size: Option<usize>,
    ) -> Result<PipelineSpec> {
        let mut topology: OrderedMap<Vec<String>> = OrderedMap::new();
        let mut key_of: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (a, b) in edges {
            match key_of.get(a) {
                Some(&k) => topology.0[k].1.push(b.to_string()),
                None => {
                    key_of.insert(a, topology.len());
                    topology.push(*a, vec![b.to_string()]);
                }
            }
        }
        Self::validate(
            modules,
            topology,
            language_model,
            dim_mapping,
            colocated,
            world_size,
        )
    }

    /// Reads a spec file: TOML if the name ends in `.toml`, JSON otherwise.
    pub fn from_file(path: impl AsRef<Path>) -> Result<PipelineSpec> {
        use std::io::Read;
        let path = path.as_ref();
        let io = |message: String| Error::Io {
            path: path.display().to_string(),
            message,
        };
        // Read at most one byte past the cap, so that an endless or huge input (`/dev/zero`, a
        // wrong file) is refused at once instead of filling the memory.
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_SPEC_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| io(e.to_string()))?;
        if text.len() as u64 > MAX_SPEC_BYTES {
            return Err(io(format!(
                "the file is larger than {} MiB, the limit for a pipeline spec (a spec names \
                 modules by their grid sizes, so even a million-rank pipeline needs a few KB)",
                MAX_SPEC_BYTES >> 20
            )));
        }
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
        {
            Self::from_toml_str(&text)
        } else {
            Self::from_json_str(&text)
        }
    }

    /// Parses and validates JSON text.
    pub fn from_json_str(text: &str) -> Result<PipelineSpec> {
        let raw: RawSpec = serde_json::from_str(text).map_err(|e| Error::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        Self::from_raw(raw)
    }

    /// Parses and validates TOML text (same structure as the JSON form).
    ///
    /// ```
    /// use multimodule::PipelineSpec;
    /// let spec = PipelineSpec::from_toml_str(r#"
    /// [modules.enc]
    /// dp = 2
    /// [modules.llm]
    /// tp = 2
    /// offset = 2
    /// [topology]
    /// enc = ["llm"]
    /// "#).unwrap();
    /// assert_eq!(spec.module_names(), vec!["enc", "llm"]);
    /// ```
    pub fn from_toml_str(text: &str) -> Result<PipelineSpec> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| Error::Parse {
            format: "TOML",
            message: e.to_string().trim().replace('\n', " "),
        })?;
        Self::from_raw(raw)
    }

    /// Validates a spec given as a `serde_json::Value` (as found inside other documents).
    pub fn from_json_value(value: serde_json::Value) -> Result<PipelineSpec> {
        let raw: RawSpec = serde_json::from_value(value).map_err(|e| Error::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        Self::from_raw(raw)
    }

    /// The declared world size, if any.
    pub fn world_size(&self) -> Option<usize> {
        self.world_size
    }
    /// Number of ranks the modules need: the end of the highest rank range (or the declared
    /// world size, if larger).
    pub fn ranks_needed(&self) -> usize {
        let end = self
            .modules
            .iter()
            .map(|m| m.rank_range().1)
            .max()
            .unwrap_or(0);
        end.max(self.world_size.unwrap_or(0))
    }
    /// The modules in file order.
    pub fn modules(&self) -> &[ModuleSpec] {
        &self.modules
    }
    /// Module names in file order.
    pub fn module_names(&self) -> Vec<&str> {
        self.modules.iter().map(|m| m.name.as_str()).collect()
    }
    /// Index of a module by name.
    pub fn module_index(&self, name: &str) -> Result<usize> {
        self.modules
            .iter()
            .position(|m| m.name == name)
            .ok_or_else(|| Error::UnknownModule {
                name: name.to_string(),
                context: "the query".into(),
                known: self.modules.iter().map(|m| m.name.clone()).collect(),
            })
    }
    /// A module by name.
    pub fn module(&self, name: &str) -> Result<&ModuleSpec> {
        Ok(&self.modules[self.module_index(name)?])
    }
    /// Downstream module names of `name` (empty for a sink or an unknown name).
    pub fn downstream(&self, name: &str) -> Vec<&str> {
        match self.module_index(name) {
            Ok(i) => self.succ[i]
                .iter()
                .map(|&j| self.modules[j].name.as_str())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
    /// Upstream module names of `name`.
    pub fn upstream(&self, name: &str) -> Vec<&str> {
        match self.module_index(name) {
            Ok(i) => self.pred[i]
                .iter()
                .map(|&j| self.modules[j].name.as_str())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
    /// Downstream module indices by module index.
    pub fn successors(&self) -> &[Vec<usize>] {
        &self.succ
    }
    /// Upstream module indices by module index.
    pub fn predecessors(&self) -> &[Vec<usize>] {
        &self.pred
    }
    /// Module indices in a topological order.
    pub fn topological_order(&self) -> &[usize] {
        &self.topo
    }
    /// The edges `(upstream, downstream)` in bridge-creation order: modules in file order,
    /// then each module's downstream list in file order (Megatron's order).
    pub fn edges(&self) -> Vec<(usize, usize)> {
        self.succ
            .iter()
            .enumerate()
            .flat_map(|(a, s)| s.iter().map(move |&b| (a, b)))
            .collect()
    }
    /// Modules with no downstream module.
    pub fn sinks(&self) -> Vec<&str> {
        (0..self.modules.len())
            .filter(|&i| self.succ[i].is_empty())
            .map(|i| self.modules[i].name.as_str())
            .collect()
    }
    /// The language-model module, if named.
    pub fn language_model(&self) -> Option<&str> {
        self.language_model.as_deref()
    }
    /// The activation dim mapping.
    pub fn dim_mapping(&self) -> DimMapping {
        self.dim_mapping
    }
    /// The declared colocation groups.
    pub fn colocated(&self) -> &[Vec<String>] {
        &self.colocated
    }
    /// The size of this spec's [`crate::PipelinePlan`], in rank entries: every rank of every
    /// module (a rank of colocated modules once per module) plus, for every edge, every rank of
    /// both its modules (a bridge's leaders, routes and broadcast groups are drawn from them).
    /// The plan's memory, the time to make it and the length of its JSON and text are linear in
    /// it; it is computed in O(modules + edges), before any of that, so that a caller can refuse
    /// a spec too large for it (`grid pipeline` does). Saturates at `usize::MAX`.
    ///
    /// ```
    /// use multimodule::PipelineSpec;
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"enc": {"dp": 4}, "llm": {"tp": 2, "offset": 4}},
    ///                                          "topology": {"enc": ["llm"]}}"#).unwrap();
    /// assert_eq!(spec.plan_size(), (4 + 2) + (4 + 2));
    /// ```
    pub fn plan_size(&self) -> usize {
        let size = |i: usize| self.modules[i].grid.size();
        let ranks = (0..self.modules.len()).fold(0usize, |acc, i| acc.saturating_add(size(i)));
        self.succ.iter().enumerate().fold(ranks, |acc, (a, s)| {
            s.iter().fold(acc, |acc, &b| {
                acc.saturating_add(size(a)).saturating_add(size(b))
            })
        })
    }
    /// Indices of the modules whose grid contains `rank`, in file order.
    pub fn modules_of_rank(&self, rank: usize) -> Vec<usize> {
        (0..self.modules.len())
            .filter(|&i| self.modules[i].grid.contains(rank))
            .collect()
    }

    /// The canonical JSON form (full grids, every module in the topology).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_full_forms() {
        let s = PipelineSpec::from_json_str(
            r#"{"modules": [{"name": "a", "grid": {"shape": [2, 1], "dims": ["tp", "pp"]}},
                            {"name": "b", "tp": 2, "gtp_remat": 2, "offset": 2}],
                "topology": {"a": ["b", "b"]}}"#,
        )
        .unwrap();
        assert_eq!(s.modules()[0].grid.dim_names(), &["tp", "pp"]);
        assert_eq!(
            s.modules()[1].grid.dim_names(),
            &["tp", "gtp_remat", "cp", "pp", "dp"]
        );
        assert_eq!(s.modules()[1].grid.offset(), 2);
        assert_eq!(s.downstream("a"), vec!["b"]);
    }

    #[test]
    fn errors() {
        let e = |t: &str| PipelineSpec::from_json_str(t).unwrap_err();
        assert!(matches!(e(r#"{"modules": {}}"#), Error::EmptySpec));
        assert!(matches!(
            e(r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["z"]}}"#),
            Error::UnknownModule { .. }
        ));
        // A cycle that is not upstream of the sink is still a cycle.
        match e(
            r#"{"modules": {"a": {}, "b": {"offset": 1}, "c": {"offset": 2}},
                    "topology": {"a": ["b"], "b": ["a"], "c": []}}"#,
        ) {
            Error::Cycle { cycle } => assert_eq!(cycle.len(), 3),
            other => panic!("{other}"),
        }
        assert!(matches!(
            e(r#"{"modules": {"a": {"shape": [2], "dims": ["tp"]}}}"#),
            Error::MissingPp { .. }
        ));
        assert!(matches!(
            e(r#"{"modules": {"a": {"dp": 2}, "b": {"offset": 1}}, "topology": {"a": ["b"]}}"#),
            Error::UndeclaredOverlap { .. }
        ));
        assert!(PipelineSpec::from_json_str(
            r#"{"modules": {"a": {"dp": 2}, "b": {"offset": 1}}, "topology": {"a": ["b"]},
                "colocated": [["a", "b"]]}"#
        )
        .is_ok());
        match e(
            r#"{"modules": {"a": {"dp": 2}, "b": {"offset": 1}, "c": {"offset": 1}},
                     "topology": {"a": ["b", "c"]}, "colocated": [["a", "b"], ["c", "a", "c"]]}"#,
        ) {
            Error::BadColocated { group, message } => {
                assert_eq!(group, ["c", "a", "c"]);
                assert_eq!(message, "module 'c' appears twice");
            }
            other => panic!("{other}"),
        }
        assert!(matches!(
            e(r#"{"modules": {"a": {"tp": 2, "shape": [2], "dims": ["pp"]}}}"#),
            Error::GridForm { .. }
        ));
        assert!(matches!(
            e(r#"{"modules": {"a": {"output_ndim": 4}}}"#),
            Error::BadOutputNdim { .. }
        ));
        assert!(matches!(
            e(r#"{"modules": {"a": {}}, "dim_mapping": {"s": 1, "b": 1, "h": 2}}"#),
            Error::BadDimMapping { .. }
        ));
        assert!(matches!(
            e(r#"{"modules": {"a": {}}, "world_size": 0}"#),
            Error::GridOutsideWorld { .. }
        ));
        assert!(matches!(
            e(r#"{"modules": {"a": {"bogus": 1}}}"#),
            Error::Parse { .. }
        ));
    }

    #[test]
    fn toml_keeps_file_order() {
        let s = PipelineSpec::from_toml_str(
            "colocated = []\n[modules.zeta]\npp = 2\n[modules.alpha]\noffset = 2\n\
             [[modules_unused]]\n",
        );
        assert!(matches!(s, Err(Error::Parse { .. })));
        let s = PipelineSpec::from_toml_str(
            "[modules.zeta]\npp = 2\n[modules.alpha]\noffset = 2\n[modules.mid]\noffset = 3\n\
             [topology]\nzeta = [\"mid\", \"alpha\"]\n",
        )
        .unwrap();
        assert_eq!(s.module_names(), vec!["zeta", "alpha", "mid"]);
        assert_eq!(s.downstream("zeta"), vec!["mid", "alpha"]);
        let s = PipelineSpec::from_toml_str(
            "[[modules]]\nname = \"b\"\n[[modules]]\nname = \"a\"\noffset = 1\n",
        )
        .unwrap();
        assert_eq!(s.module_names(), vec!["b", "a"]);
    }

    #[test]
    fn round_trip() {
        let s = PipelineSpec::from_json_str(
            r#"{"modules": {"z": {"pp": 2}, "a": {"offset": 2, "output_ndim": 2}},
                "topology": {"z": ["a"]}, "language_model": "z"}"#,
        )
        .unwrap();
        let back = PipelineSpec::from_json_str(&s.to_json()).unwrap();
        assert_eq!(s, back);
        assert_eq!(back.module_names(), vec!["z", "a"]);
    }
}
