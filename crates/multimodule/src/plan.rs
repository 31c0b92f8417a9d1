//! [`PipelinePlan`]: the whole pipeline's stage and bridge plan as one serializable value, the
//! output of `grid pipeline SPEC [--format json]` and the one input of
//! [`crate::MultiModulePipelineCommunicator`].

use crate::error::{Error, Result};
use crate::ordered::OrderedMap;
use crate::routing::BridgePlan;
use crate::spec::PipelineSpec;
use crate::stages::StageTable;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// A rank's place in one module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleStage {
    /// The rank's pipeline coordinate in the module.
    pub pp_rank: usize,
    /// The module's pipeline size.
    pub pp_size: usize,
    /// Stages up to and including this rank's stage of the module.
    pub stages_through: usize,
}

/// One rank's stage information (its entry under `"ranks"` in [`PipelinePlan`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankPlan {
    /// The modules the rank belongs to, in spec order.
    pub modules: OrderedMap<ModuleStage>,
    /// 0-based stage: the maximum `stages_through` over the rank's modules, minus one.
    pub current_stage: usize,
    /// Some module of the rank is a source module at its first pp stage.
    pub is_first_stage: bool,
    /// Some module of the rank is a sink module at its last pp stage.
    pub is_last_stage: bool,
}

/// A leader's role in one bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A source leader: sends activations, receives gradients.
    Sender,
    /// A destination leader: receives activations, sends gradients.
    Receiver,
    /// Both (only with colocated modules): `peers` are the destinations, `recv_peers` the sources.
    SenderReceiver,
}

/// A leader's route in one bridge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Sender or receiver (or both, for colocated modules).
    pub role: Role,
    /// The peers in message order: destinations of a sender, sources of a receiver.
    pub peers: Vec<usize>,
    /// For [`Role::SenderReceiver`] only: the sources it receives from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recv_peers: Option<Vec<usize>>,
}

/// One bridge's summary: what `grid pipeline` prints of a [`BridgePlan`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSummary {
    /// Upstream module.
    pub src: String,
    /// Downstream module.
    pub dst: String,
    /// Source lane leaders (largest rank of each lane).
    pub src_leaders: Vec<usize>,
    /// Destination lane leaders (smallest rank of each lane).
    pub dst_leaders: Vec<usize>,
    /// Every leader's route, by rank.
    pub routes: BTreeMap<usize, Route>,
    /// tp × cp groups at the source's last stage.
    pub src_broadcast_groups: Vec<Vec<usize>>,
    /// tp × cp groups at the destination's first stage.
    pub dst_broadcast_groups: Vec<Vec<usize>>,
}

impl BridgeSummary {
    /// The summary of a bridge plan.
    pub fn from_plan(p: &BridgePlan) -> BridgeSummary {
        let mut routes: BTreeMap<usize, Route> = BTreeMap::new();
        for &r in p.src().leaders() {
            routes.insert(
                r,
                Route {
                    role: Role::Sender,
                    peers: p.send_peers(r),
                    recv_peers: None,
                },
            );
        }
        for &r in p.dst().leaders() {
            let peers = p.recv_peers(r);
            match routes.get_mut(&r) {
                Some(route) => {
                    route.role = Role::SenderReceiver;
                    route.recv_peers = Some(peers);
                }
                None => {
                    routes.insert(
                        r,
                        Route {
                            role: Role::Receiver,
                            peers,
                            recv_peers: None,
                        },
                    );
                }
            }
        }
        BridgeSummary {
            src: p.src_name().to_string(),
            dst: p.dst_name().to_string(),
            src_leaders: p.src().leaders().to_vec(),
            dst_leaders: p.dst().leaders().to_vec(),
            routes,
            src_broadcast_groups: p.src().broadcast_groups().to_vec(),
            dst_broadcast_groups: p.dst().broadcast_groups().to_vec(),
        }
    }
}

/// The plan of a whole pipeline: total stages, every rank's stages and every bridge's routing,
/// computed once from a validated [`PipelineSpec`]. Pure: the same value on every rank, computed
/// without any communicator.
///
/// It is the one input of [`crate::MultiModulePipelineCommunicator::new`]: the communicator takes
/// its stage numbers, its modules and every bridge's [`BridgePlan`] from it and recomputes
/// nothing, so what `grid pipeline` prints for a spec is what runs on every rank. A plan can only
/// be made by [`PipelinePlan::new`] (or [`PipelinePlan::from_spec_file`]) or read back from its
/// own JSON ([`PipelinePlan::from_json_str`], serde), so its parts always agree with each other.
///
/// Serialized (JSON) as
/// `{"total_stages", "ranks": {"<rank>": {"modules": {"<module>": {"pp_rank", "pp_size",
/// "stages_through"}}, "current_stage", "is_first_stage", "is_last_stage"}}, "bridges": [{"src",
/// "dst", "src_leaders", "dst_leaders", "routes": {"<rank>": {"role", "peers"}},
/// "src_broadcast_groups", "dst_broadcast_groups"}], "spec"}`, where `spec` is the spec in its
/// canonical form ([`PipelineSpec::to_json`]). Reading a plan back validates the spec and checks
/// that every other field is exactly the spec's plan, so a stale or hand-edited document is an
/// [`Error::PlanMismatch`] naming the first difference, never a plan that says one thing and
/// runs another.
///
/// # For the `grid pipeline SPEC [--format json|text]` command
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let plan = multimodule::PipelinePlan::from_spec_file("pipeline.json")?; // or .toml
/// println!("{}", plan.to_json()); // --format json
/// println!("{}", plan.to_text()); // --format text
/// # Ok(()) }
/// ```
/// On an invalid spec `from_spec_file` returns an [`crate::Error`] whose `Display` is one line:
/// print it and exit with status 2.
///
/// ```
/// use multimodule::{PipelinePlan, PipelineSpec};
/// let spec = PipelineSpec::from_json_str(r#"{"modules": {"enc": {"dp": 2}, "llm": {"tp": 2, "offset": 2}},
///                                          "topology": {"enc": ["llm"]}}"#).unwrap();
/// let plan = PipelinePlan::new(&spec).unwrap();
/// assert_eq!(plan.total_stages(), 2);
/// assert_eq!(plan.bridges()[0].routes[&2].peers, vec![0, 1]);
/// assert_eq!(plan.rank(3).unwrap().current_stage, 1);
/// let json: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
/// assert_eq!(json["ranks"]["3"]["current_stage"], 1);
/// // The JSON is the plan: reading it back gives the same value.
/// assert_eq!(PipelinePlan::from_json_str(&plan.to_json()).unwrap(), plan);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelinePlan {
    spec: PipelineSpec,
    total_stages: usize,
    ranks: BTreeMap<usize, RankPlan>,
    /// The routing of every edge, in spec order ([`PipelineSpec::edges`]).
    bridge_plans: Vec<BridgePlan>,
    /// `BridgeSummary::from_plan` of each entry of `bridge_plans`.
    bridges: Vec<BridgeSummary>,
}

/// The serialized form (borrowed, for writing).
#[derive(Serialize)]
struct PlanOut<'a> {
    total_stages: usize,
    ranks: &'a BTreeMap<usize, RankPlan>,
    bridges: &'a [BridgeSummary],
    spec: &'a PipelineSpec,
}

/// The serialized form (owned, for reading; checked against the spec before it becomes a plan).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanIn {
    total_stages: usize,
    ranks: BTreeMap<usize, RankPlan>,
    bridges: Vec<BridgeSummary>,
    spec: PipelineSpec,
}

impl PipelinePlan {
    /// The plan of a validated spec.
    pub fn new(spec: &PipelineSpec) -> Result<PipelinePlan> {
        let st = StageTable::new(spec);
        let mut ranks = BTreeMap::new();
        for m in spec.modules() {
            let (first, end) = m.rank_range();
            for r in first..end {
                if ranks.contains_key(&r) {
                    continue;
                }
                let mut modules = OrderedMap::new();
                for i in spec.modules_of_rank(r) {
                    let mm = &spec.modules()[i];
                    let pp_rank = mm.pp_rank(r).unwrap_or(0);
                    modules.push(
                        mm.name.clone(),
                        ModuleStage {
                            pp_rank,
                            pp_size: mm.pp_size(),
                            stages_through: st.stages_before(i) + pp_rank + 1,
                        },
                    );
                }
                ranks.insert(
                    r,
                    RankPlan {
                        modules,
                        current_stage: st.current_stage(spec, r)?,
                        is_first_stage: st.is_first_stage(spec, r),
                        is_last_stage: st.is_last_stage(spec, r),
                    },
                );
            }
        }
        let bridge_plans = bridge_plans(spec)?;
        let bridges = bridge_plans.iter().map(BridgeSummary::from_plan).collect();
        Ok(PipelinePlan {
            spec: spec.clone(),
            total_stages: st.total_stages(),
            ranks,
            bridge_plans,
            bridges,
        })
    }

    /// Reads, validates and plans a spec file (TOML if it ends in `.toml`, JSON otherwise).
    pub fn from_spec_file(path: impl AsRef<Path>) -> Result<PipelinePlan> {
        PipelinePlan::new(&PipelineSpec::from_file(path)?)
    }

    /// Reads a plan from its JSON ([`PipelinePlan::to_json`]). The embedded spec is validated
    /// and every other field must be exactly that spec's plan; otherwise the error is
    /// [`Error::Parse`] (not a plan document, or an invalid spec in it) or
    /// [`Error::PlanMismatch`] (naming the first field that differs).
    ///
    /// ```
    /// use multimodule::{Error, PipelinePlan, PipelineSpec};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["b"]}}"#).unwrap();
    /// let json = PipelinePlan::new(&spec).unwrap().to_json();
    /// let edited = json.replacen("\"total_stages\": 2", "\"total_stages\": 3", 1);
    /// assert!(matches!(PipelinePlan::from_json_str(&edited), Err(Error::PlanMismatch { .. })));
    /// ```
    pub fn from_json_str(text: &str) -> Result<PipelinePlan> {
        let doc: PlanIn = serde_json::from_str(text).map_err(|e| Error::Parse {
            format: "JSON",
            message: format!("pipeline plan: {e}"),
        })?;
        PipelinePlan::from_document(doc)
    }

    /// The plan of `doc.spec`, if the rest of `doc` is exactly that plan.
    fn from_document(doc: PlanIn) -> Result<PipelinePlan> {
        let plan = PipelinePlan::new(&doc.spec)?;
        let mismatch = |what: String| Err(Error::PlanMismatch { what });
        if doc.total_stages != plan.total_stages {
            return mismatch(format!(
                "total_stages is {} in the document, {} by its spec",
                doc.total_stages, plan.total_stages
            ));
        }
        if let Some((r, rp)) = plan.ranks.iter().find(|(r, _)| !doc.ranks.contains_key(r)) {
            return mismatch(format!(
                "rank {r} is missing from the document, but its spec has it in modules {:?}",
                rp.modules.keys().collect::<Vec<_>>()
            ));
        }
        if let Some(r) = doc.ranks.keys().find(|r| !plan.ranks.contains_key(r)) {
            return mismatch(format!(
                "the document lists rank {r}, which is in no module of its spec"
            ));
        }
        for ((r, ours), theirs) in plan.ranks.iter().zip(doc.ranks.values()) {
            if ours != theirs {
                return mismatch(format!(
                    "rank {r} is {} in the document, {} by its spec",
                    compact(theirs),
                    compact(ours)
                ));
            }
        }
        if doc.bridges.len() != plan.bridges.len() {
            return mismatch(format!(
                "the document has {} bridges, its spec {}",
                doc.bridges.len(),
                plan.bridges.len()
            ));
        }
        for (ours, theirs) in plan.bridges.iter().zip(&doc.bridges) {
            if ours != theirs {
                return mismatch(format!(
                    "bridge {} -> {} is {} in the document, {} by its spec",
                    ours.src,
                    ours.dst,
                    compact(theirs),
                    compact(ours)
                ));
            }
        }
        Ok(plan)
    }

    /// The spec the plan was made from.
    pub fn spec(&self) -> &PipelineSpec {
        &self.spec
    }
    /// Total number of stages (the heaviest path, each module weighing its pp size).
    pub fn total_stages(&self) -> usize {
        self.total_stages
    }
    /// Every rank of every module, ascending.
    pub fn ranks(&self) -> &BTreeMap<usize, RankPlan> {
        &self.ranks
    }
    /// One rank's stage information (`None` for a rank in no module).
    pub fn rank(&self, rank: usize) -> Option<&RankPlan> {
        self.ranks.get(&rank)
    }
    /// Every bridge's summary (what `grid pipeline` prints), one per edge in spec order.
    pub fn bridges(&self) -> &[BridgeSummary] {
        &self.bridges
    }
    /// Every bridge's routing, one per edge in spec order: what the bridge communicators run.
    /// Entry `k` is the plan that [`PipelinePlan::bridges`]`()[k]` summarizes.
    pub fn bridge_plans(&self) -> &[BridgePlan] {
        &self.bridge_plans
    }

    /// What `rank` does in each of its modules, in spec order (empty for a rank in no module):
    /// the stage numbers of [`PipelinePlan::rank`] plus the bridges (indices into
    /// [`PipelinePlan::bridge_plans`]) it serves at a module boundary.
    ///
    /// ```
    /// use multimodule::{PipelinePlan, PipelineSpec};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {"pp": 2}, "b": {"offset": 2}},
    ///                                          "topology": {"a": ["b"]}}"#).unwrap();
    /// let plan = PipelinePlan::new(&spec).unwrap();
    /// let info = plan.rank_modules(1).unwrap();
    /// assert_eq!((info[0].pp_rank, info[0].bridges_as_src.clone()), (1, vec![0]));
    /// assert!(plan.rank_modules(0).unwrap()[0].bridges_as_src.is_empty());
    /// assert!(plan.rank_modules(9).unwrap().is_empty());
    /// ```
    pub fn rank_modules(&self, rank: usize) -> Result<Vec<RankModuleInfo>> {
        let Some(rp) = self.ranks.get(&rank) else {
            return Ok(Vec::new());
        };
        let serving = |want: bool, end: &dyn Fn(&BridgePlan) -> &str, name: &str| -> Vec<usize> {
            if !want {
                return Vec::new();
            }
            self.bridge_plans
                .iter()
                .enumerate()
                .filter(|(_, b)| end(b) == name)
                .map(|(k, _)| k)
                .collect()
        };
        let edges = self.spec.edges();
        rp.modules
            .iter()
            .map(|(name, ms)| {
                let index = self.spec.module_index(name)?;
                let first = ms.pp_rank == 0;
                let last = ms.pp_rank + 1 == ms.pp_size;
                Ok(RankModuleInfo {
                    name: name.to_string(),
                    index,
                    pp_rank: ms.pp_rank,
                    pp_size: ms.pp_size,
                    stages_through: ms.stages_through,
                    bridges_as_src: serving(ms.pp_rank + 1 == ms.pp_size, &|b| b.src_name(), name),
                    bridges_as_dest: serving(ms.pp_rank == 0, &|b| b.dst_name(), name),
                    is_source_stage: first && !edges.iter().any(|&(_, b)| b == index),
                    is_terminal_stage: last && !edges.iter().any(|&(a, _)| a == index),
                })
            })
            .collect()
    }

    /// Pretty JSON (the form [`PipelinePlan::from_json_str`] reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// A short human-readable summary: one line per rank and per bridge.
    ///
    /// ```
    /// # use multimodule::{PipelinePlan, PipelineSpec};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["b"]}}"#).unwrap();
    /// let text = PipelinePlan::new(&spec).unwrap().to_text();
    /// assert!(text.starts_with("total stages: 2\n"));
    /// assert!(text.contains("bridge a -> b: leaders [0] -> [1]"));
    /// ```
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "total stages: {}", self.total_stages);
        for (r, p) in &self.ranks {
            let mods: Vec<String> = p
                .modules
                .iter()
                .map(|(n, m)| {
                    format!(
                        "{n} pp {}/{} through {}",
                        m.pp_rank, m.pp_size, m.stages_through
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "rank {r}: stage {}{}{} [{}]",
                p.current_stage,
                if p.is_first_stage { " first" } else { "" },
                if p.is_last_stage { " last" } else { "" },
                mods.join("; ")
            );
        }
        for b in &self.bridges {
            let routes: Vec<String> = b
                .routes
                .iter()
                .filter(|(_, r)| r.role != Role::Receiver)
                .map(|(r, route)| format!("{r}->{:?}", route.peers))
                .collect();
            let _ = writeln!(
                s,
                "bridge {} -> {}: leaders {:?} -> {:?}; sends {}",
                b.src,
                b.dst,
                b.src_leaders,
                b.dst_leaders,
                routes.join(" ")
            );
        }
        s
    }
}

impl Serialize for PipelinePlan {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        PlanOut {
            total_stages: self.total_stages,
            ranks: &self.ranks,
            bridges: &self.bridges,
            spec: &self.spec,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for PipelinePlan {
    /// Validates the embedded spec and checks the rest against it (see
    /// [`PipelinePlan::from_json_str`]).
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let doc = PlanIn::deserialize(d)?;
        PipelinePlan::from_document(doc).map_err(serde::de::Error::custom)
    }
}

/// Compact JSON of a value a mismatch message shows.
fn compact<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("<{e}>"))
}

/// What one rank does in one module: Megatron's `RankModuleInfo`, plus the stage count
/// ([`PipelinePlan::rank_modules`]).
///
/// Megatron's `p2p_communicator` field (a `P2PCommunicator` over the module's pp group) has no
/// counterpart: this is plan data, computed without communicators, and the pipeline
/// communicator exchanges a module's activations point to point over its parent by world rank
/// (the previous and next stage are the world ranks one `pp` stride away).
///
/// ```
/// use multimodule::{PipelinePlan, PipelineSpec};
/// let spec = PipelineSpec::from_json_str(r#"{"modules": {"enc": {}, "llm": {"pp": 2, "offset": 1}},
///                                          "topology": {"enc": ["llm"]}}"#).unwrap();
/// let plan = PipelinePlan::new(&spec).unwrap();
/// let enc = &plan.rank_modules(0).unwrap()[0];
/// assert!(enc.is_source_stage && !enc.is_terminal_stage);
/// let (first, last) = (&plan.rank_modules(1).unwrap()[0], &plan.rank_modules(2).unwrap()[0]);
/// assert!(!first.is_source_stage && !first.is_terminal_stage);
/// assert!(!last.is_source_stage && last.is_terminal_stage);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankModuleInfo {
    /// Module name.
    pub name: String,
    /// Module index in the spec.
    pub index: usize,
    /// The rank's pipeline coordinate in the module.
    pub pp_rank: usize,
    /// The module's pipeline size.
    pub pp_size: usize,
    /// Stages up to and including this rank's stage of the module.
    pub stages_through: usize,
    /// Bridges (indices into [`PipelinePlan::bridge_plans`], i.e. [`PipelineSpec::edges`]) leaving the module, if the rank is at the
    /// module's last stage.
    pub bridges_as_src: Vec<usize>,
    /// Edges entering the module, if the rank is at the module's first stage.
    pub bridges_as_dest: Vec<usize>,
    /// True if the rank is at an absolute first stage of the whole model: the first stage of a
    /// module with no incoming edge (Megatron's documented meaning of
    /// `RankModuleInfo.is_source_stage`; Megatron itself never sets the field, which keeps its
    /// default `True` on every rank).
    pub is_source_stage: bool,
    /// True if the rank is at an absolute last stage of the whole model: the last stage of a
    /// module with no outgoing edge (Megatron's documented meaning of `is_terminal_stage`;
    /// Megatron leaves it at its default `True`, as above).
    pub is_terminal_stage: bool,
}

/// The bridge plans of every edge of a spec, in Megatron's creation order (computed once, by
/// [`PipelinePlan::new`]).
fn bridge_plans(spec: &PipelineSpec) -> Result<Vec<BridgePlan>> {
    spec.edges()
        .into_iter()
        .map(|(a, b)| {
            let (ma, mb) = (&spec.modules()[a], &spec.modules()[b]);
            BridgePlan::new(
                ma.name.clone(),
                ma.grid.clone(),
                mb.name.clone(),
                mb.grid.clone(),
                ma.output_ndim,
                spec.dim_mapping(),
            )
        })
        .collect()
}
