//! The whole model-parallel plan that Megatron-Core's `initialize_model_parallel` builds
//! (docs/semantics.md §3): the dense ("decoder") and expert grids, every group family with
//! Megatron's exact group lists and member order, distributed-optimizer instances,
//! hierarchical context parallelism and the embedding groups.

use crate::error::{Error, Result};
use crate::grid::GroupList;
use crate::group::{Group, Term};
use crate::hierarchical::{check_sizes, Level};
use crate::rankgen::{GeneratorSizes, RankGenerator};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The default order string (fastest dimension first).
pub const DEFAULT_ORDER: &str = "tp-cp-ep-dp-pp";

macro_rules! families {
    ($($variant:ident => $name:literal : $doc:literal),* $(,)?) => {
        /// A family of process groups: the field names of Megatron's `ProcessGroupCollection`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Family { $( #[doc = $doc] $variant, )* }

        impl Family {
            /// Every family, in the order of the `grid layout` output.
            pub const ALL: [Family; 21] = [$(Family::$variant),*];
            /// The family's name (`tp`, `dp_cp`, `expt_dp`, ...).
            pub fn name(self) -> &'static str {
                match self { $(Family::$variant => $name,)* }
            }
            /// The family with this name.
            pub fn from_name(name: &str) -> Result<Family> {
                match name {
                    $($name => Ok(Family::$variant),)*
                    _ => Err(Error::UnknownFamily {
                        name: name.to_string(),
                        valid: Family::ALL.iter().map(|f| f.name()).collect::<Vec<_>>().join(", "),
                    }),
                }
            }
        }
    };
}

families! {
    Tp => "tp": "Tensor parallel (`TENSOR_MODEL_PARALLEL_GROUP`).",
    Pp => "pp": "Pipeline stages of one model replica.",
    Mp => "mp": "Model parallel: tp × pp.",
    Embd => "embd": "Embedding group: per pipeline, the first and last stage (by default).",
    PosEmbd => "pos_embd": "Position-embedding group: per pipeline, the first stage (by default).",
    Cp => "cp": "Context parallel.",
    TpCp => "tp_cp": "tp × cp.",
    Hcp => "hcp": "Hierarchical context parallel: one group per level.",
    Ep => "ep": "Expert parallel (expert grid).",
    ExptTp => "expt_tp": "Expert tensor parallel.",
    TpEp => "tp_ep": "Expert tp × ep.",
    TpEpPp => "tp_ep_pp": "Expert tp × ep × pp.",
    TpDp => "tp_dp": "tp × dp without cp (the FP8 amax group, `TENSOR_AND_DATA_PARALLEL_GROUP`).",
    TpDpCp => "tp_dp_cp": "tp × dp × cp.",
    Dp => "dp": "Data parallel.",
    DpCp => "dp_cp": "Data parallel with context parallel (dp × cp).",
    ExptDp => "expt_dp": "Data parallel of the expert grid.",
    IntraDpCp => "intra_dp_cp": "dp_cp cut into one slice per distributed-optimizer instance.",
    IntraExptDp => "intra_expt_dp": "Level 0 of expert dp split into [expert dp / instances, instances].",
    InterDistOpt => "inter_dist_opt": "Level 1 of the same split (only with more than one instance).",
    IntraDistOpt => "intra_dist_opt": "Concatenation of consecutive tp_ep_pp groups, one per instance (unsorted).",
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A family and, for `hcp`, the level: the unit that gets one communicator per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FamilyLevel {
    /// The family.
    pub family: Family,
    /// The hierarchical level (0 for every family but `hcp`).
    pub level: usize,
}

impl From<Family> for FamilyLevel {
    fn from(family: Family) -> FamilyLevel {
        FamilyLevel { family, level: 0 }
    }
}

impl fmt::Display for FamilyLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.family == Family::Hcp {
            write!(f, "hcp[{}]", self.level)
        } else {
            f.write_str(self.family.name())
        }
    }
}

/// A user rule for embedding groups: pipeline group in, members out.
pub type EmbeddingFn = Arc<dyn Fn(&[usize]) -> Vec<usize> + Send + Sync>;

/// Which ranks of each pipeline group form the embedding (or position-embedding) group.
#[derive(Clone, Default)]
pub enum EmbeddingRule {
    /// Megatron's default: first and last stage for `embd`, first stage for `pos_embd`.
    #[default]
    Default,
    /// These pipeline stages (indices into the pipeline group; negative counts from the end),
    /// duplicates removed, in the given order. `Stages(vec![0, 2, -1])` is the removed
    /// `pipeline_model_parallel_split_rank = 2` rule of older Megatron releases.
    Stages(Vec<i64>),
    /// Any rule: gets the pipeline group (Megatron's order) and returns the members.
    /// `name` and the rule's output on the plan's pipeline groups (a bounded sample on very
    /// large plans, see [`LayoutPlan::fingerprint`]) enter the plan's fingerprint, so all ranks
    /// must use one name and one behaviour.
    Custom {
        /// Identifies the rule (part of the plan fingerprint).
        name: String,
        /// The rule.
        rule: EmbeddingFn,
    },
}

impl fmt::Debug for EmbeddingRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EmbeddingRule::Default => f.write_str("Default"),
            EmbeddingRule::Stages(s) => write!(f, "Stages({s:?})"),
            EmbeddingRule::Custom { name, .. } => write!(f, "Custom({name})"),
        }
    }
}

impl PartialEq for EmbeddingRule {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (EmbeddingRule::Default, EmbeddingRule::Default) => true,
            (EmbeddingRule::Stages(a), EmbeddingRule::Stages(b)) => a == b,
            (EmbeddingRule::Custom { name: a, .. }, EmbeddingRule::Custom { name: b, .. }) => {
                a == b
            }
            _ => false,
        }
    }
}

impl EmbeddingRule {
    /// Older Megatron's embedding rule with `pipeline_model_parallel_split_rank = split`.
    pub fn legacy_split_embedding(split: usize) -> EmbeddingRule {
        EmbeddingRule::Stages(vec![0, split as i64, -1])
    }
    /// Older Megatron's position-embedding rule with `pipeline_model_parallel_split_rank = split`.
    pub fn legacy_split_position_embedding(split: usize) -> EmbeddingRule {
        EmbeddingRule::Stages(vec![0, split as i64])
    }
}

/// Megatron's `default_embedding_ranks(pp_ranks)`: the ranks of one pipeline group (its stages
/// in order) on which the word embeddings live, the first and the last stage, or only the
/// first when the pipeline has one stage (docs/semantics.md §1.4). This is the rule
/// [`EmbeddingRule::Default`] applies to every pipeline group of a plan.
///
/// An empty pipeline group is [`Error::EmptyPipelineGroup`] (Megatron's `IndexError`).
///
/// ```
/// use grid_core::default_embedding_ranks;
/// assert_eq!(default_embedding_ranks(&[1, 5, 9, 13]).unwrap(), vec![1, 13]);
/// assert_eq!(default_embedding_ranks(&[7]).unwrap(), vec![7]);
/// assert!(default_embedding_ranks(&[]).is_err());
/// ```
pub fn default_embedding_ranks(pp_ranks: &[usize]) -> Result<Vec<usize>> {
    match pp_ranks {
        [] => Err(Error::EmptyPipelineGroup {
            function: "default_embedding_ranks",
        }),
        [only] => Ok(vec![*only]),
        [first, .., last] => Ok(vec![*first, *last]),
    }
}

/// Megatron's `default_position_embedding_ranks(pp_ranks)`: the first stage of the pipeline
/// group, on which the position embeddings live (docs/semantics.md §1.4); the rule
/// [`EmbeddingRule::Default`] applies to the `pos_embd` family.
///
/// An empty pipeline group is [`Error::EmptyPipelineGroup`] (Megatron's `IndexError`).
///
/// ```
/// use grid_core::default_position_embedding_ranks;
/// assert_eq!(default_position_embedding_ranks(&[1, 5, 9, 13]).unwrap(), vec![1]);
/// assert!(default_position_embedding_ranks(&[]).is_err());
/// ```
pub fn default_position_embedding_ranks(pp_ranks: &[usize]) -> Result<Vec<usize>> {
    match pp_ranks.first() {
        Some(first) => Ok(vec![*first]),
        None => Err(Error::EmptyPipelineGroup {
            function: "default_position_embedding_ranks",
        }),
    }
}

/// The inputs of `initialize_model_parallel` that shape the groups.
///
/// ```
/// use grid_core::{LayoutConfig, LayoutPlan, Family};
/// let cfg = LayoutConfig { tp: 2, pp: 4, ..LayoutConfig::new(16) };
/// let plan = LayoutPlan::new(cfg).unwrap();
/// assert_eq!(plan.dp(), 2);
/// assert_eq!(plan.groups(Family::Pp.into()).unwrap().get(0), &[0, 4, 8, 12]);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LayoutConfig {
    /// Number of ranks the layout covers (Megatron's `local_world_size`, else the world size).
    pub world_size: usize,
    /// Tensor parallel size.
    pub tp: usize,
    /// Pipeline parallel size.
    pub pp: usize,
    /// Context parallel size.
    pub cp: usize,
    /// Expert parallel size.
    pub ep: usize,
    /// Expert tensor parallel size (`None`: equal to `tp`).
    pub etp: Option<usize>,
    /// Order string, fastest dimension first.
    pub order: String,
    /// Virtual pipeline size (Megatron's `virtual_pipeline_model_parallel_size`): needs pp > 1
    /// and changes no group; a rank view answers the virtual first/last-stage and embedding
    /// questions with it ([`crate::RankView::is_pipeline_first_stage`]).
    pub vpp: Option<usize>,
    /// Number of partial distributed-optimizer instances.
    pub dist_opt_instances: usize,
    /// Hierarchical context-parallel sizes (product must equal cp).
    pub hcp_sizes: Option<Vec<usize>>,
    /// First rank of the layout.
    pub rank_offset: usize,
    /// Rule for the embedding groups.
    #[serde(skip)]
    pub embedding: EmbeddingRule,
    /// Rule for the position-embedding groups.
    #[serde(skip)]
    pub position_embedding: EmbeddingRule,
}

impl Default for LayoutConfig {
    fn default() -> Self {
        LayoutConfig::new(1)
    }
}

impl LayoutConfig {
    /// Every size 1, the default order, no offset.
    pub fn new(world_size: usize) -> LayoutConfig {
        LayoutConfig {
            world_size,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            etp: None,
            order: DEFAULT_ORDER.to_string(),
            vpp: None,
            dist_opt_instances: 1,
            hcp_sizes: None,
            rank_offset: 0,
            embedding: EmbeddingRule::Default,
            position_embedding: EmbeddingRule::Default,
        }
    }
}

/// How a family's groups are derived.
#[derive(Debug, Clone)]
enum Def {
    /// Groups spanned by the masked dims of the dense (`expert = false`) or expert grid.
    Masked { expert: bool, mask: Vec<bool> },
    /// Per pipeline group, the members the rule picks.
    Embedding { position: bool },
    /// Each dp_cp group cut into `instances` consecutive slices.
    Slices { instances: usize },
    /// Hierarchical level over the groups of a masked parent family.
    Levels {
        expert: bool,
        parent_mask: Vec<bool>,
        level: Level,
    },
    /// `instances` concatenations of consecutive expert tp_ep_pp groups.
    Instances { instances: usize },
}

/// A validated layout: every family of every rank, computed arithmetically.
///
/// Construction validates everything Megatron validates, in the same order, up front (Megatron
/// checks some conditions after it created groups). Nothing is enumerated until asked for:
/// [`LayoutPlan::rank_view`] costs O(families × dimensions) whatever the world size.
#[derive(Debug, Clone)]
pub struct LayoutPlan {
    cfg: LayoutConfig,
    dense: RankGenerator,
    expert: RankGenerator,
    dp: usize,
    etp: usize,
    edp: usize,
    defs: Vec<(FamilyLevel, Def)>,
}

fn positive(what: &str, v: usize) -> Result<()> {
    if v == 0 {
        Err(Error::NonPositive {
            what: what.to_string(),
            value: 0,
        })
    } else {
        Ok(())
    }
}

impl LayoutPlan {
    /// Validates `cfg` and builds the plan.
    pub fn new(cfg: LayoutConfig) -> Result<LayoutPlan> {
        positive("world size", cfg.world_size)?;
        positive("tp", cfg.tp)?;
        positive("pp", cfg.pp)?;
        positive("cp", cfg.cp)?;
        positive("ep", cfg.ep)?;
        positive(
            "number of distributed-optimizer instances",
            cfg.dist_opt_instances,
        )?;
        let etp = cfg.etp.unwrap_or(cfg.tp);
        positive("expert tp", etp)?;
        let w = cfg.world_size;
        let model = cfg
            .tp
            .checked_mul(cfg.pp)
            .and_then(|x| x.checked_mul(cfg.cp))
            .unwrap_or(usize::MAX);
        if !w.is_multiple_of(model) {
            return Err(Error::WorldNotDivisible {
                world_size: w,
                tp: cfg.tp,
                pp: cfg.pp,
                cp: cfg.cp,
                model_size: model,
            });
        }
        let dp = w / model;
        if let Some(vpp) = cfg.vpp {
            positive("virtual pipeline size", vpp)?;
            if cfg.pp <= 1 {
                return Err(Error::VppWithoutPp { vpp, pp: cfg.pp });
            }
        }
        let dense = RankGenerator::new(
            GeneratorSizes {
                tp: cfg.tp,
                ep: 1,
                dp,
                pp: cfg.pp,
                cp: cfg.cp,
                gtp_remat: 1,
            },
            &cfg.order,
            cfg.rank_offset,
        )?;
        let emodel = etp
            .checked_mul(cfg.ep)
            .and_then(|x| x.checked_mul(cfg.pp))
            .unwrap_or(usize::MAX);
        if !w.is_multiple_of(emodel) {
            return Err(Error::ExpertWorldNotDivisible {
                world_size: w,
                etp,
                ep: cfg.ep,
                pp: cfg.pp,
                size: emodel,
            });
        }
        let edp = w / emodel;
        let expert = RankGenerator::new(
            GeneratorSizes {
                tp: etp,
                ep: cfg.ep,
                dp: edp,
                pp: cfg.pp,
                cp: 1,
                gtp_remat: 1,
            },
            &cfg.order,
            cfg.rank_offset,
        )?;
        let pp_last = cfg.order.to_lowercase().split('-').next_back() == Some("pp");
        if !pp_last && cfg.pp > 1 && edp != dp {
            return Err(Error::DpMismatchNotPpLast {
                order: cfg.order.clone(),
                pp: cfg.pp,
                dp,
                expert_dp: edp,
            });
        }
        if cfg.pp > 1 {
            let (ds, es) = (dense.stride("pp")?, expert.stride("pp")?);
            if ds != es {
                return Err(Error::PpGroupsDiffer {
                    order: cfg.order.clone(),
                    dense_stride: ds,
                    expert_stride: es,
                });
            }
        }
        let ndo = cfg.dist_opt_instances;
        if !(dp * cfg.cp).is_multiple_of(ndo) {
            return Err(Error::DistOptDpCp {
                dp_cp: dp * cfg.cp,
                instances: ndo,
            });
        }
        if let Some(h) = &cfg.hcp_sizes {
            check_sizes(h, cfg.cp, "the context-parallel size")?;
        }
        if !edp.is_multiple_of(ndo) {
            return Err(Error::DistOptExpertDp {
                expert_dp: edp,
                instances: ndo,
            });
        }
        let mut plan = LayoutPlan {
            cfg,
            dense,
            expert,
            dp,
            etp,
            edp,
            defs: Vec::new(),
        };
        plan.defs = plan.build_defs()?;
        Ok(plan)
    }

    fn build_defs(&self) -> Result<Vec<(FamilyLevel, Def)>> {
        let d = |t: &str| -> Result<Def> {
            Ok(Def::Masked {
                expert: false,
                mask: self.dense.mask(t)?,
            })
        };
        let x = |t: &str| -> Result<Def> {
            Ok(Def::Masked {
                expert: true,
                mask: self.expert.mask(t)?,
            })
        };
        let ndo = self.cfg.dist_opt_instances;
        let mut defs: Vec<(FamilyLevel, Def)> = vec![
            (Family::Tp.into(), d("tp")?),
            (Family::Pp.into(), d("pp")?),
            (Family::Mp.into(), d("tp-pp")?),
            (Family::Embd.into(), Def::Embedding { position: false }),
            (Family::PosEmbd.into(), Def::Embedding { position: true }),
            (Family::Cp.into(), d("cp")?),
            (Family::TpCp.into(), d("tp-cp")?),
        ];
        if let Some(h) = &self.cfg.hcp_sizes {
            for l in 0..h.len() {
                defs.push((
                    FamilyLevel {
                        family: Family::Hcp,
                        level: l,
                    },
                    Def::Levels {
                        expert: false,
                        parent_mask: self.dense.mask("cp")?,
                        level: Level::of(h, l),
                    },
                ));
            }
        }
        defs.extend([
            (Family::Ep.into(), x("ep")?),
            (Family::ExptTp.into(), x("tp")?),
            (Family::TpEp.into(), x("tp-ep")?),
            (Family::TpEpPp.into(), x("tp-ep-pp")?),
            (Family::TpDp.into(), d("tp-dp")?),
            (Family::TpDpCp.into(), d("tp-dp-cp")?),
            (Family::Dp.into(), d("dp")?),
            (Family::DpCp.into(), d("dp-cp")?),
            (Family::ExptDp.into(), x("dp")?),
        ]);
        if ndo == 1 {
            defs.push((Family::IntraDpCp.into(), d("dp-cp")?));
            defs.push((Family::IntraExptDp.into(), x("dp")?));
        } else {
            let sizes = [self.edp / ndo, ndo];
            defs.push((Family::IntraDpCp.into(), Def::Slices { instances: ndo }));
            for (fam, l) in [(Family::IntraExptDp, 0), (Family::InterDistOpt, 1)] {
                defs.push((
                    fam.into(),
                    Def::Levels {
                        expert: true,
                        parent_mask: self.expert.mask("dp")?,
                        level: Level::of(&sizes, l),
                    },
                ));
            }
        }
        defs.push((
            Family::IntraDistOpt.into(),
            Def::Instances { instances: ndo },
        ));
        Ok(defs)
    }

    /// The configuration.
    pub fn config(&self) -> &LayoutConfig {
        &self.cfg
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.cfg.world_size
    }
    /// First rank.
    pub fn rank_offset(&self) -> usize {
        self.cfg.rank_offset
    }
    /// The virtual pipeline world size (Megatron's
    /// `get_virtual_pipeline_model_parallel_world_size()`): `None` without `vpp`.
    pub fn virtual_pipeline_size(&self) -> Option<usize> {
        self.cfg.vpp
    }
    /// Data-parallel size: world / (tp·pp·cp).
    pub fn dp(&self) -> usize {
        self.dp
    }
    /// Expert tensor-parallel size.
    pub fn expert_tp(&self) -> usize {
        self.etp
    }
    /// Expert data-parallel size: world / (etp·ep·pp).
    pub fn expert_dp(&self) -> usize {
        self.edp
    }
    /// The dense (decoder) generator.
    pub fn dense(&self) -> &RankGenerator {
        &self.dense
    }
    /// The expert generator.
    pub fn expert(&self) -> &RankGenerator {
        &self.expert
    }
    /// True if `rank` is one of the layout's ranks.
    pub fn contains(&self, rank: usize) -> bool {
        self.dense.grid().contains(rank)
    }

    /// The families (and hcp levels) this plan has, in Megatron's creation order:
    /// `inter_dist_opt` only with more than one instance, `hcp` only with hierarchical sizes.
    pub fn family_levels(&self) -> Vec<FamilyLevel> {
        self.defs.iter().map(|(f, _)| *f).collect()
    }

    /// True if the plan has this family.
    pub fn has(&self, family: Family) -> bool {
        self.defs.iter().any(|(f, _)| f.family == family)
    }

    fn def(&self, fl: FamilyLevel) -> Result<&Def> {
        self.defs
            .iter()
            .find(|(f, _)| *f == fl)
            .map(|(_, d)| d)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "this plan has no {fl} groups (it has: {})",
                    self.family_levels()
                        .iter()
                        .map(|f| f.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }

    fn gen(&self, expert: bool) -> &RankGenerator {
        if expert {
            &self.expert
        } else {
            &self.dense
        }
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if self.contains(rank) {
            Ok(())
        } else {
            Err(Error::RankOutOfRange {
                rank,
                first: self.cfg.rank_offset,
                end: self.cfg.rank_offset + self.cfg.world_size,
            })
        }
    }

    /// Number of groups in a family.
    pub fn num_groups(&self, fl: FamilyLevel) -> Result<usize> {
        Ok(match self.def(fl)? {
            Def::Masked { expert, mask } => self.gen(*expert).grid().num_groups_masked(mask),
            Def::Embedding { .. } => self.num_pp_groups(),
            Def::Slices { instances } => self.num_dp_cp_groups() * instances,
            Def::Levels {
                expert,
                parent_mask,
                level,
            } => {
                self.gen(*expert).grid().num_groups_masked(parent_mask) * level.groups_per_parent()
            }
            Def::Instances { instances } => *instances,
        })
    }

    fn num_pp_groups(&self) -> usize {
        self.cfg.world_size / self.cfg.pp
    }
    fn num_dp_cp_groups(&self) -> usize {
        self.cfg.world_size / (self.dp * self.cfg.cp)
    }
    fn dp_cp_mask(&self) -> Vec<bool> {
        self.dense.grid().mask_of(&["dp", "cp"]).unwrap_or_default()
    }
    fn pp_mask(&self) -> Vec<bool> {
        self.dense.grid().mask_of(&["pp"]).unwrap_or_default()
    }

    fn embedding_members(&self, pp_group: &Group, position: bool) -> Result<Group> {
        let (rule, family) = if position {
            (&self.cfg.position_embedding, Family::PosEmbd)
        } else {
            (&self.cfg.embedding, Family::Embd)
        };
        let n = pp_group.len();
        match rule {
            EmbeddingRule::Default => Ok(if position || n == 1 {
                Group::single(pp_group.first())
            } else {
                let (a, b) = (pp_group.first(), pp_group.last());
                Group::strided(a, 2, b - a)
            }),
            EmbeddingRule::Stages(stages) => {
                let mut out: Vec<usize> = Vec::new();
                for &s in stages {
                    let idx = if s < 0 { n as i64 + s } else { s };
                    if idx < 0 || idx >= n as i64 {
                        return Err(Error::Invalid(format!(
                            "{family} rule: stage {s} is outside the pipeline of {n} stages (valid: {} ..= {})",
                            -(n as i64),
                            n - 1
                        )));
                    }
                    let r = pp_group.get(idx as usize);
                    if !out.contains(&r) {
                        out.push(r);
                    }
                }
                if out.is_empty() {
                    return Err(Error::Invalid(format!(
                        "{family} rule: the stage list is empty"
                    )));
                }
                Ok(Group::from_list(out))
            }
            EmbeddingRule::Custom { rule, .. } => {
                let members = pp_group.to_vec();
                let out = rule(&members);
                let mut seen = Vec::with_capacity(out.len());
                for &r in &out {
                    if !pp_group.contains(r) || seen.contains(&r) {
                        return Err(Error::BadEmbeddingRule {
                            family: family.name().into(),
                            returned: out.clone(),
                            pp_group: members,
                        });
                    }
                    seen.push(r);
                }
                if out.is_empty() {
                    return Err(Error::BadEmbeddingRule {
                        family: family.name().into(),
                        returned: out,
                        pp_group: members,
                    });
                }
                Ok(Group::from_list(out))
            }
        }
    }

    /// Group number `index` of a family, in Megatron's creation order.
    pub fn group_at(&self, fl: FamilyLevel, index: usize) -> Result<Group> {
        let n = self.num_groups(fl)?;
        if index >= n {
            return Err(Error::Invalid(format!(
                "{fl} has {n} groups; index {index} is out of range"
            )));
        }
        Ok(match self.def(fl)? {
            Def::Masked { expert, mask } => self.gen(*expert).grid().group_at_masked(mask, index),
            Def::Embedding { position } => {
                let pp = self.dense.grid().group_at_masked(&self.pp_mask(), index);
                self.embedding_members(&pp, *position)?
            }
            Def::Slices { instances } => {
                let parent = self
                    .dense
                    .grid()
                    .group_at_masked(&self.dp_cp_mask(), index / instances);
                let len = parent.len() / instances;
                parent.slice((index % instances) * len, len)
            }
            Def::Levels {
                expert,
                parent_mask,
                level,
            } => {
                let per = level.groups_per_parent();
                let parent = self
                    .gen(*expert)
                    .grid()
                    .group_at_masked(parent_mask, index / per);
                level.select(&parent, index % per)
            }
            Def::Instances { instances } => self.instance_group(index, *instances),
        })
    }

    /// Distributed-optimizer instance `i`: consecutive expert tp_ep_pp groups concatenated.
    fn instance_group(&self, i: usize, instances: usize) -> Group {
        let grid = self.expert.grid();
        let per = self.edp / instances;
        let dp_dim = grid.dim_index("dp").unwrap_or(0);
        let mut terms = Vec::new();
        for (d, (&size, &stride)) in grid.shape().iter().zip(grid.strides()).enumerate() {
            if d != dp_dim {
                terms.push(Term { size, stride });
            }
        }
        let dp_stride = grid.strides()[dp_dim];
        terms.push(Term {
            size: per,
            stride: dp_stride,
        });
        Group::lattice(grid.offset() + i * per * dp_stride, terms)
    }

    /// Index (in [`LayoutPlan::group_at`] numbering) of the group of `fl` that holds `rank`,
    /// or `None` if the rank is in none (embedding groups).
    pub fn group_index_of(&self, fl: FamilyLevel, rank: usize) -> Result<Option<usize>> {
        self.check_rank(rank)?;
        Ok(match self.def(fl)? {
            Def::Masked { expert, mask } => {
                Some(self.gen(*expert).grid().group_index_masked(mask, rank))
            }
            Def::Embedding { position } => {
                let mask = self.pp_mask();
                let grid = self.dense.grid();
                let pp = grid.group_of_masked(&mask, rank)?;
                let members = self.embedding_members(&pp, *position)?;
                members
                    .contains(rank)
                    .then(|| grid.group_index_masked(&mask, rank))
            }
            Def::Slices { instances } => {
                let mask = self.dp_cp_mask();
                let grid = self.dense.grid();
                let parent = grid.group_of_masked(&mask, rank)?;
                let len = parent.len() / instances;
                let pos = parent.position(rank).unwrap_or(0);
                Some(grid.group_index_masked(&mask, rank) * instances + pos / len)
            }
            Def::Levels {
                expert,
                parent_mask,
                level,
            } => {
                let grid = self.gen(*expert).grid();
                let parent = grid.group_of_masked(parent_mask, rank)?;
                let pos = parent.position(rank).unwrap_or(0);
                Some(
                    grid.group_index_masked(parent_mask, rank) * level.groups_per_parent()
                        + level.group_of_position(pos),
                )
            }
            Def::Instances { instances } => {
                let dp = self.expert.coord(rank, "dp")?;
                Some(dp / (self.edp / instances))
            }
        })
    }

    /// The group of `fl` that holds `rank` (`None` if none does), in time independent of the
    /// world size.
    pub fn group_of(&self, fl: FamilyLevel, rank: usize) -> Result<Option<Group>> {
        self.check_rank(rank)?;
        if let Def::Masked { expert, mask } = self.def(fl)? {
            return self
                .gen(*expert)
                .grid()
                .group_of_masked(mask, rank)
                .map(Some);
        }
        match self.group_index_of(fl, rank)? {
            Some(i) => self.group_at(fl, i).map(Some),
            None => Ok(None),
        }
    }

    /// Every group of a family, in Megatron's creation order (filled in parallel).
    pub fn groups(&self, fl: FamilyLevel) -> Result<GroupList> {
        let n = self.num_groups(fl)?;
        let def = self.def(fl)?;
        if let Def::Masked { expert, mask } = def {
            return Ok(self.gen(*expert).grid().groups_masked(mask));
        }
        if matches!(def, Def::Embedding { .. }) {
            // Custom rules may give groups of different sizes; validate every group.
            let groups: Vec<Group> = (0..n)
                .into_par_iter()
                .map(|i| self.group_at(fl, i))
                .collect::<Result<_>>()?;
            return Ok(GroupList::from_groups(groups));
        }
        let size = self.group_at(fl, 0)?.len();
        Ok(GroupList::uniform(n, size, |i| {
            self.group_at(fl, i)
                .unwrap_or_else(|_| Group::from_list(Vec::new()))
        }))
    }

    /// Every family's groups, families computed in parallel.
    pub fn all_groups(&self) -> Result<Vec<(FamilyLevel, GroupList)>> {
        self.family_levels()
            .into_par_iter()
            .map(|fl| Ok((fl, self.groups(fl)?)))
            .collect()
    }

    /// A key such that two families with equal keys have identical groups (as sets) on every
    /// rank, so one communicator can serve both (for example `dp` and `dp_cp` when cp = 1).
    pub fn group_signature(&self, fl: FamilyLevel) -> Result<GroupSignature> {
        let def = self.def(fl)?;
        let terms: Option<Vec<Term>> = match def {
            Def::Masked { expert, mask } => {
                let g = self.gen(*expert).grid();
                Some(
                    g.shape()
                        .iter()
                        .zip(g.strides())
                        .zip(mask)
                        .filter(|(_, &m)| m)
                        .map(|((&size, &stride), _)| Term { size, stride })
                        .collect(),
                )
            }
            Def::Levels {
                expert,
                parent_mask,
                level,
            } => {
                let g = self.gen(*expert).grid();
                let parent: Vec<usize> = (0..g.shape().len()).filter(|&d| parent_mask[d]).collect();
                match parent.as_slice() {
                    [d] => Some(vec![Term {
                        size: level.size,
                        stride: level.inner * g.strides()[*d],
                    }]),
                    _ => None,
                }
            }
            Def::Instances { instances } => {
                let g = self.instance_group(0, *instances);
                Some(g.terms().to_vec())
            }
            // With one stage and the default rule every rank is its own embedding group.
            Def::Embedding { position } => {
                let rule = if *position {
                    &self.cfg.position_embedding
                } else {
                    &self.cfg.embedding
                };
                (self.cfg.pp == 1 && *rule == EmbeddingRule::Default).then(Vec::new)
            }
            Def::Slices { .. } => None,
        };
        Ok(match terms {
            Some(t) => GroupSignature::Lattice(normalize_terms(t)),
            None => GroupSignature::Family(fl),
        })
    }

    /// A 64-bit fingerprint of everything that shapes the groups; equal on every rank that
    /// holds the same plan. Stable across runs and machines (FNV-1a over a canonical text).
    ///
    /// A [`EmbeddingRule::Custom`] rule enters with its name **and its behaviour**: its output
    /// for every pipeline group of the plan, or, past [`CUSTOM_RULE_SAMPLE`] pipeline groups, for
    /// that many evenly spaced ones (the first and last included). Two rules under one name
    /// that pick different members on any of those pipelines give different fingerprints, so
    /// `build_collection` fails with `PlanMismatch` on every rank instead of hanging. What
    /// still collides: rules that differ only on pipelines outside the sample (plans of more
    /// than [`CUSTOM_RULE_SAMPLE`] pipelines), and 64-bit hash collisions. The default and
    /// [`EmbeddingRule::Stages`] rules are fully determined by their parameters and cost
    /// nothing more; a custom rule costs one call per sampled pipeline.
    ///
    /// ```
    /// use grid_core::{EmbeddingRule, LayoutConfig, LayoutPlan};
    /// use std::sync::Arc;
    /// let with = |rule: EmbeddingRule| {
    ///     let cfg = LayoutConfig { pp: 4, embedding: rule, ..LayoutConfig::new(8) };
    ///     LayoutPlan::new(cfg).unwrap().fingerprint()
    /// };
    /// let first = EmbeddingRule::Custom { name: "mine".into(), rule: Arc::new(|g| vec![g[0]]) };
    /// let last = EmbeddingRule::Custom { name: "mine".into(), rule: Arc::new(|g| vec![g[g.len() - 1]]) };
    /// let first_again = EmbeddingRule::Custom { name: "mine".into(), rule: Arc::new(|g| g[..1].to_vec()) };
    /// assert_ne!(with(first.clone()), with(last));
    /// assert_eq!(with(first), with(first_again));
    /// ```
    pub fn fingerprint(&self) -> u64 {
        let c = &self.cfg;
        let text = format!(
            "grid-core plan v1|w={}|tp={}|pp={}|cp={}|ep={}|etp={}|order={}|vpp={:?}|ndo={}|hcp={:?}|off={}|embd={:?}{}|pos={:?}{}",
            c.world_size,
            c.tp,
            c.pp,
            c.cp,
            c.ep,
            self.etp,
            self.dense.normalized_order(),
            c.vpp,
            c.dist_opt_instances,
            c.hcp_sizes,
            c.rank_offset,
            c.embedding,
            self.rule_behaviour(&c.embedding),
            c.position_embedding,
            self.rule_behaviour(&c.position_embedding)
        );
        let mut h = Fnv1a::default();
        text.hash(&mut h);
        h.finish()
    }

    /// For a custom rule, `#` and a hash of its raw output on the sampled pipeline groups (see
    /// [`LayoutPlan::fingerprint`]); empty for the rules their parameters determine.
    fn rule_behaviour(&self, rule: &EmbeddingRule) -> String {
        let EmbeddingRule::Custom { rule, .. } = rule else {
            return String::new();
        };
        let n = self.num_pp_groups();
        let mask = self.pp_mask();
        let grid = self.dense.grid();
        let mut h = Fnv1a::default();
        for i in sample_indices(n, CUSTOM_RULE_SAMPLE) {
            let members = grid.group_at_masked(&mask, i).to_vec();
            (i, rule(&members)).hash(&mut h);
        }
        format!("#{:016x}", h.finish())
    }
}

/// How many pipeline groups at most [`LayoutPlan::fingerprint`] asks a custom embedding rule
/// about (all of them when the plan has no more).
pub const CUSTOM_RULE_SAMPLE: usize = 1024;

/// `0..n` when `n <= k`, else `k` (at least 2) evenly spaced indices from 0 to `n - 1` inclusive.
fn sample_indices(n: usize, k: usize) -> impl Iterator<Item = usize> {
    let k = k.max(2);
    let (count, dense) = if n <= k { (n, true) } else { (k, false) };
    (0..count).map(move |j| {
        if dense {
            j
        } else {
            // j * (n - 1) / (k - 1) without overflow: both factors are below n.
            ((j as u128 * (n - 1) as u128) / (k - 1) as u128) as usize
        }
    })
}

/// Identifies the group structure of a family; see [`LayoutPlan::group_signature`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GroupSignature {
    /// Every rank's group is the translate of this lattice through the rank (terms normalized).
    Lattice(Vec<Term>),
    /// A family whose groups are not compared with others.
    Family(FamilyLevel),
}

/// Sorts terms by stride, drops size-1 terms and merges contiguous ones, so that equal
/// partitions have equal term lists.
fn normalize_terms(mut t: Vec<Term>) -> Vec<Term> {
    t.retain(|x| x.size > 1);
    t.sort_by_key(|x| x.stride);
    let mut out: Vec<Term> = Vec::with_capacity(t.len());
    for x in t {
        match out.last_mut() {
            Some(last) if last.stride * last.size == x.stride => last.size *= x.size,
            _ => out.push(x),
        }
    }
    out
}

#[derive(Default)]
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}
