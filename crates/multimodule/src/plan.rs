//! [`PipelinePlan`]: the whole pipeline's stage and bridge plan as one serializable value, the
//! output of `grid pipeline SPEC [--format json]`.

use crate::error::Result;
use crate::ordered::OrderedMap;
use crate::routing::BridgePlan;
use crate::spec::PipelineSpec;
use crate::stages::StageTable;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// A rank's place in one module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModuleStage {
    /// The rank's pipeline coordinate in the module.
    pub pp_rank: usize,
    /// The module's pipeline size.
    pub pp_size: usize,
    /// Stages up to and including this rank's stage of the module.
    pub stages_through: usize,
}

/// One rank's stage information.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    /// Sender or receiver (or both, for colocated modules).
    pub role: Role,
    /// The peers in message order: destinations of a sender, sources of a receiver.
    pub peers: Vec<usize>,
    /// For [`Role::SenderReceiver`] only: the sources it receives from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recv_peers: Option<Vec<usize>>,
}

/// One bridge's summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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

/// The plan of a whole pipeline: total stages, every rank's stages and every bridge's routing.
/// Pure: the same value on every rank, computed without any communicator.
///
/// Serialized (JSON) as
/// `{"total_stages", "ranks": {"<rank>": {"modules": {"<module>": {"pp_rank", "pp_size",
/// "stages_through"}}, "current_stage", "is_first_stage", "is_last_stage"}}, "bridges": [{"src",
/// "dst", "src_leaders", "dst_leaders", "routes": {"<rank>": {"role", "peers"}},
/// "src_broadcast_groups", "dst_broadcast_groups"}]}`.
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
/// assert_eq!(plan.total_stages, 2);
/// assert_eq!(plan.bridges[0].routes[&2].peers, vec![0, 1]);
/// let json: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
/// assert_eq!(json["ranks"]["3"]["current_stage"], 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PipelinePlan {
    /// Total number of stages.
    pub total_stages: usize,
    /// Every rank of every module.
    pub ranks: BTreeMap<usize, RankPlan>,
    /// One entry per edge, in spec order.
    pub bridges: Vec<BridgeSummary>,
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
        let bridges = bridge_plans(spec)?
            .iter()
            .map(BridgeSummary::from_plan)
            .collect();
        Ok(PipelinePlan {
            total_stages: st.total_stages(),
            ranks,
            bridges,
        })
    }

    /// Reads, validates and plans a spec file (TOML if it ends in `.toml`, JSON otherwise).
    pub fn from_spec_file(path: impl AsRef<Path>) -> Result<PipelinePlan> {
        PipelinePlan::new(&PipelineSpec::from_file(path)?)
    }

    /// Pretty JSON.
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

/// What one rank does in one module: Megatron's `RankModuleInfo`, plus the stage count.
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
    /// Edges (indices into [`PipelineSpec::edges`]) leaving the module, if the rank is at the
    /// module's last stage.
    pub bridges_as_src: Vec<usize>,
    /// Edges entering the module, if the rank is at the module's first stage.
    pub bridges_as_dest: Vec<usize>,
}

impl RankModuleInfo {
    /// Every module `rank` belongs to, in spec order.
    ///
    /// ```
    /// use multimodule::{PipelineSpec, RankModuleInfo, StageTable};
    /// let spec = PipelineSpec::from_json_str(r#"{"modules": {"a": {"pp": 2}, "b": {"offset": 2}},
    ///                                          "topology": {"a": ["b"]}}"#).unwrap();
    /// let st = StageTable::new(&spec);
    /// let info = RankModuleInfo::for_rank(&spec, &st, 1);
    /// assert_eq!((info[0].pp_rank, info[0].bridges_as_src.clone()), (1, vec![0]));
    /// assert!(RankModuleInfo::for_rank(&spec, &st, 0)[0].bridges_as_src.is_empty());
    /// ```
    pub fn for_rank(spec: &PipelineSpec, st: &StageTable, rank: usize) -> Vec<RankModuleInfo> {
        let edges = spec.edges();
        spec.modules_of_rank(rank)
            .into_iter()
            .map(|i| {
                let m = &spec.modules()[i];
                let pp_rank = m.pp_rank(rank).unwrap_or(0);
                let pp_size = m.pp_size();
                let pick = |want: bool, f: &dyn Fn(&(usize, usize)) -> bool| -> Vec<usize> {
                    if want {
                        edges
                            .iter()
                            .enumerate()
                            .filter(|(_, e)| f(e))
                            .map(|(k, _)| k)
                            .collect()
                    } else {
                        Vec::new()
                    }
                };
                RankModuleInfo {
                    name: m.name.clone(),
                    index: i,
                    pp_rank,
                    pp_size,
                    stages_through: st.stages_before(i) + pp_rank + 1,
                    bridges_as_src: pick(pp_rank + 1 == pp_size, &|e| e.0 == i),
                    bridges_as_dest: pick(pp_rank == 0, &|e| e.1 == i),
                }
            })
            .collect()
    }
}

/// The bridge plans of every edge of a spec, in Megatron's creation order.
pub fn bridge_plans(spec: &PipelineSpec) -> Result<Vec<BridgePlan>> {
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
