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
    /// The summary of a bridge plan, in time linear in its leaders and routes.
    pub fn from_plan(p: &BridgePlan) -> BridgeSummary {
        let mut routes: BTreeMap<usize, Route> = BTreeMap::new();
        // Leaders by index: the peers of leader `i` are its routes' peers (no search by rank).
        let peers = |routes: Vec<crate::routing::PartRoute>| -> Vec<usize> {
            routes.into_iter().map(|r| r.peer).collect()
        };
        for (i, &r) in p.src().leaders().iter().enumerate() {
            routes.insert(
                r,
                Route {
                    role: Role::Sender,
                    peers: peers(p.send_routes(i)),
                    recv_peers: None,
                },
            );
        }
        for (j, &r) in p.dst().leaders().iter().enumerate() {
            let peers = peers(p.recv_routes(j));
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
    /// The plan of a validated spec, in time linear in the ranks, modules and bridge members
    /// (plus a sort of the modules by first rank).
    pub fn new(spec: &PipelineSpec) -> Result<PipelinePlan> {
        let st = StageTable::new(spec);
        let ranks = rank_plans(spec, &st);
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

    /// Writes [`PipelinePlan::to_json`] to `w` as it is produced, without holding the text
    /// (hundreds of MB for a million-rank pipeline) in memory.
    ///
    /// ```
    /// # use multimodule::{PipelinePlan, PipelineSpec};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {}, "b": {"offset": 1}}, "topology": {"a": ["b"]}}"#).unwrap();
    /// let plan = PipelinePlan::new(&spec).unwrap();
    /// let mut out = Vec::new();
    /// plan.write_json(&mut out).unwrap();
    /// assert_eq!(String::from_utf8(out).unwrap(), plan.to_json());
    /// ```
    pub fn write_json<W: std::io::Write>(&self, w: W) -> std::io::Result<()> {
        serde_json::to_writer_pretty(w, self).map_err(std::io::Error::from)
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
        let mut out = Vec::new();
        match self.write_text(&mut out) {
            Ok(()) => String::from_utf8_lossy(&out).into_owned(),
            Err(e) => format!("error: {e}"),
        }
    }

    /// Writes [`PipelinePlan::to_text`] to `w` as it is produced.
    ///
    /// ```
    /// # use multimodule::{PipelinePlan, PipelineSpec};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {"pp": 2}, "b": {"offset": 2}}, "topology": {"a": ["b"]}}"#).unwrap();
    /// let mut out = Vec::new();
    /// PipelinePlan::new(&spec).unwrap().write_text(&mut out).unwrap();
    /// assert_eq!(String::from_utf8(out).unwrap(), "total stages: 3
    /// rank 0: stage 0 first [a pp 0/2 through 1]
    /// rank 1: stage 1 [a pp 1/2 through 2]
    /// rank 2: stage 2 last [b pp 0/1 through 3]
    /// bridge a -> b: leaders [1] -> [2]; sends 1->[2]
    /// ");
    /// ```
    pub fn write_text<W: std::io::Write>(&self, mut w: W) -> std::io::Result<()> {
        // Lines are assembled in one buffer handed to `w` in large pieces (a million-rank plan
        // is tens of MB of text: no formatting machinery per number, no write per piece).
        let mut buf: Vec<u8> = Vec::with_capacity(TEXT_CHUNK + 4096);
        let spill = |buf: &mut Vec<u8>, w: &mut W| -> std::io::Result<()> {
            if buf.len() >= TEXT_CHUNK {
                w.write_all(buf)?;
                buf.clear();
            }
            Ok(())
        };
        buf.extend_from_slice(b"total stages: ");
        push_num(&mut buf, self.total_stages);
        buf.push(b'\n');
        for (r, p) in &self.ranks {
            buf.extend_from_slice(b"rank ");
            push_num(&mut buf, *r);
            buf.extend_from_slice(b": stage ");
            push_num(&mut buf, p.current_stage);
            if p.is_first_stage {
                buf.extend_from_slice(b" first");
            }
            if p.is_last_stage {
                buf.extend_from_slice(b" last");
            }
            buf.extend_from_slice(b" [");
            for (i, (n, m)) in p.modules.iter().enumerate() {
                if i > 0 {
                    buf.extend_from_slice(b"; ");
                }
                buf.extend_from_slice(n.as_bytes());
                buf.extend_from_slice(b" pp ");
                push_num(&mut buf, m.pp_rank);
                buf.push(b'/');
                push_num(&mut buf, m.pp_size);
                buf.extend_from_slice(b" through ");
                push_num(&mut buf, m.stages_through);
            }
            buf.extend_from_slice(b"]\n");
            spill(&mut buf, &mut w)?;
        }
        for b in &self.bridges {
            buf.extend_from_slice(b"bridge ");
            buf.extend_from_slice(b.src.as_bytes());
            buf.extend_from_slice(b" -> ");
            buf.extend_from_slice(b.dst.as_bytes());
            buf.extend_from_slice(b": leaders ");
            push_list(&mut buf, &b.src_leaders);
            buf.extend_from_slice(b" -> ");
            push_list(&mut buf, &b.dst_leaders);
            buf.extend_from_slice(b"; sends ");
            let senders = b.routes.iter().filter(|(_, r)| r.role != Role::Receiver);
            for (i, (r, route)) in senders.enumerate() {
                if i > 0 {
                    buf.push(b' ');
                }
                push_num(&mut buf, *r);
                buf.extend_from_slice(b"->");
                push_list(&mut buf, &route.peers);
                spill(&mut buf, &mut w)?;
            }
            buf.push(b'\n');
            spill(&mut buf, &mut w)?;
        }
        w.write_all(&buf)
    }
}

/// How much text [`PipelinePlan::write_text`] collects before handing it on.
const TEXT_CHUNK: usize = 1 << 16;

/// Appends the decimal digits of `n`.
fn push_num(buf: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// `[1, 2, 3]`, as `{:?}` prints a list of ranks.
fn push_list(buf: &mut Vec<u8>, v: &[usize]) {
    buf.push(b'[');
    for (i, &x) in v.iter().enumerate() {
        if i > 0 {
            buf.extend_from_slice(b", ");
        }
        push_num(buf, x);
    }
    buf.push(b']');
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

/// Every rank's [`RankPlan`], in one ascending sweep over the ranks: the modules are sorted by
/// first rank and the sweep keeps those covering the current rank (several only where modules
/// are colocated), so the cost is the number of (rank, module) pairs, not ranks × modules.
fn rank_plans(spec: &PipelineSpec, st: &StageTable) -> BTreeMap<usize, RankPlan> {
    /// What a rank's entry needs of one module, computed once per module.
    struct Span<'a> {
        index: usize,
        name: &'a str,
        offset: usize,
        end: usize,
        pp_stride: usize,
        pp_size: usize,
        before: usize,
        is_source: bool,
        is_sink: bool,
    }
    let spans: Vec<Span<'_>> = spec
        .modules()
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let (offset, end) = m.rank_range();
            let pp = m.grid.dim_index("pp").ok();
            Span {
                index,
                name: &m.name,
                offset,
                end,
                pp_stride: pp.map_or(1, |d| m.grid.strides()[d]),
                pp_size: m.pp_size(),
                before: st.stages_before(index),
                is_source: spec.predecessors()[index].is_empty(),
                is_sink: spec.successors()[index].is_empty(),
            }
        })
        .collect();
    let mut by_start: Vec<&Span<'_>> = spans.iter().filter(|s| s.offset < s.end).collect();
    by_start.sort_by_key(|s| (s.offset, s.index));
    let mut ranks = BTreeMap::new();
    // The modules containing rank `r`, in spec (file) order.
    let mut active: Vec<&Span<'_>> = Vec::new();
    let mut next = 0;
    let mut r = 0;
    loop {
        active.retain(|s| s.end > r);
        if active.is_empty() {
            match by_start.get(next) {
                Some(s) => r = r.max(s.offset),
                None => break,
            }
        }
        while let Some(&s) = by_start.get(next).filter(|s| s.offset <= r) {
            let at = active.partition_point(|a| a.index < s.index);
            active.insert(at, s);
            next += 1;
        }
        let mut modules = OrderedMap::new();
        let (mut through, mut first, mut last) = (0, false, false);
        for s in &active {
            let pp_rank = (r - s.offset) / s.pp_stride % s.pp_size.max(1);
            let stages_through = s.before + pp_rank + 1;
            through = through.max(stages_through);
            first |= s.is_source && pp_rank == 0;
            last |= s.is_sink && pp_rank + 1 == s.pp_size;
            modules.push(
                s.name,
                ModuleStage {
                    pp_rank,
                    pp_size: s.pp_size,
                    stages_through,
                },
            );
        }
        ranks.insert(
            r,
            RankPlan {
                modules,
                current_stage: through - 1,
                is_first_stage: first,
                is_last_stage: last,
            },
        );
        r += 1;
    }
    ranks
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The rank plans as they were first computed: for each rank, a scan of every module.
    fn rank_plans_by_scan(spec: &PipelineSpec) -> BTreeMap<usize, RankPlan> {
        let st = StageTable::new(spec);
        let mut ranks = BTreeMap::new();
        for m in spec.modules() {
            let (first, end) = m.rank_range();
            for r in first..end {
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
                let plan = RankPlan {
                    modules,
                    current_stage: st.current_stage(spec, r).unwrap(),
                    is_first_stage: st.is_first_stage(spec, r),
                    is_last_stage: st.is_last_stage(spec, r),
                };
                ranks.insert(r, plan);
            }
        }
        ranks
    }

    /// A bridge summary as it was first computed: each leader's peers by searching its rank.
    fn summary_by_search(p: &BridgePlan) -> BridgeSummary {
        let mut routes: BTreeMap<usize, Route> = BTreeMap::new();
        for &r in p.src().leaders() {
            let route = Route {
                role: Role::Sender,
                peers: p.send_peers(r),
                recv_peers: None,
            };
            routes.insert(r, route);
        }
        for &r in p.dst().leaders() {
            let peers = p.recv_peers(r);
            match routes.get_mut(&r) {
                Some(route) => {
                    route.role = Role::SenderReceiver;
                    route.recv_peers = Some(peers);
                }
                None => {
                    let route = Route {
                        role: Role::Receiver,
                        peers,
                        recv_peers: None,
                    };
                    routes.insert(r, route);
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

    /// The sweep and the indexed summaries give what the per-rank scans gave: gaps between
    /// modules, modules out of rank order, colocated modules (nested and partly overlapping),
    /// pp > 1 in every position of the dims, fan-in, fan-out and lcm routing.
    #[test]
    fn linear_plan_equals_the_scans() {
        let specs = [
            r#"{"modules": {"enc": {"dp": 2}, "llm": {"tp": 2, "offset": 2}}, "topology": {"enc": ["llm"]}}"#,
            r#"{"modules": {"late": {"tp": 2, "pp": 2, "offset": 9}, "early": {"dp": 3, "pp": 2, "offset": 1},
                            "mid": {"dp": 2, "offset": 7}},
                "topology": {"early": ["mid", "late"], "mid": ["late"]}}"#,
            r#"{"modules": {"enc": {"tp": 2, "pp": 2, "dp": 2}, "llm": {"pp": 4, "dp": 2}, "gen": {"dp": 3, "offset": 4}},
                "topology": {"enc": ["llm", "gen"], "llm": ["gen"]},
                "colocated": [["enc", "llm", "gen"]]}"#,
            r#"{"modules": {"a": {"grid": {"shape": [2, 3, 2], "dims": ["pp", "dp", "tp"], "rank_offset": 3}},
                            "b": {"cp": 2, "dp": 5, "offset": 15}, "c": {"dp": 4, "gtp_remat": 2, "offset": 25}},
                "topology": {"a": ["b"], "b": ["c"]}}"#,
        ];
        for text in specs {
            let spec = PipelineSpec::from_json_str(text).unwrap();
            let plan = PipelinePlan::new(&spec).unwrap();
            assert_eq!(plan.ranks, rank_plans_by_scan(&spec), "{text}");
            for (b, p) in plan.bridges().iter().zip(plan.bridge_plans()) {
                assert_eq!(*b, summary_by_search(p), "{text}");
            }
        }
    }

    /// 20,000 modules in a chain: the scan is 4·10^8 steps, the sweep 2·10^4 (this finished in
    /// seconds only with the sweep in a debug build).
    #[test]
    fn long_chain_is_linear() {
        let n = 20_000;
        let modules: Vec<String> = (0..n)
            .map(|i| format!("\"m{i}\": {{\"offset\": {i}}}"))
            .collect();
        let topology: Vec<String> = (0..n - 1)
            .map(|i| format!("\"m{i}\": [\"m{}\"]", i + 1))
            .collect();
        let text = format!(
            "{{\"modules\": {{{}}}, \"topology\": {{{}}}}}",
            modules.join(","),
            topology.join(",")
        );
        let started = std::time::Instant::now();
        let spec = PipelineSpec::from_json_str(&text).unwrap();
        let plan = PipelinePlan::new(&spec).unwrap();
        assert_eq!(plan.total_stages(), n);
        assert_eq!(plan.ranks().len(), n);
        assert_eq!(plan.rank(n - 1).unwrap().current_stage, n - 1);
        assert_eq!(plan.bridges().len(), n - 1);
        let mut text = Vec::new();
        plan.write_text(&mut text).unwrap();
        assert_eq!(
            text.iter().filter(|&&b| b == b'\n').count(),
            1 + n + (n - 1)
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
    }
}
