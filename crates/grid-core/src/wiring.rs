//! The optimizer and DDP wiring of Megatron-Core's `ProcessGroupCollection`
//! (`megatron/core/process_groups_config.py`): [`use_mpu_process_groups`],
//! [`setup_process_groups_for_optimizer`] and [`setup_process_groups_for_ddp`], with Megatron's
//! checks, in Megatron's order, and its fallbacks (docs/semantics.md §4.1).
//!
//! Everything here is generic over the group handle `G`: membership [`crate::Group`]s (from
//! [`crate::RankView::collection`]) and live communicators (`Arc<C>` from
//! [`crate::build_collection`]) go through the same code, and a fallback hands out a clone of
//! the same handle (`intra_dp_cp` *is* `dp_cp` with one optimizer instance, as in Megatron).
//!
//! Megatron tells a field that was never set (`name not in vars(pg_collection)`) from one set
//! to `None` on purpose ("Please explicitly set it to None if you don't need it"). A
//! [`ProcessGroupCollection`] has only "set" and "unset", so [`ProvidedGroups`] adds the names
//! explicitly set to none.

use crate::collection::ProcessGroupCollection;
use crate::error::{Error, Result};
use crate::group::GroupSize;
use std::collections::BTreeSet;
use std::fmt;

/// One field as Megatron's wiring sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Provided<'a, G> {
    /// Never set (`name not in vars(pg_collection)`).
    Absent,
    /// Set explicitly to none (`pg_collection.name is None`).
    None,
    /// Set to a group.
    Group(&'a G),
}

impl<'a, G> Provided<'a, G> {
    /// True unless [`Provided::Absent`] (Megatron's `name in pg_set`).
    pub fn is_provided(&self) -> bool {
        !matches!(self, Provided::Absent)
    }
    /// The group, if one is set.
    pub fn group(&self) -> Option<&'a G> {
        match self {
            Provided::Group(g) => Some(g),
            _ => None,
        }
    }
}

/// A collection as handed to Megatron's wiring: the set groups plus the names set explicitly
/// to none.
///
/// ```
/// use grid_core::{Group, ProcessGroupCollection, Provided, ProvidedGroups};
/// let mut c = ProcessGroupCollection::new();
/// c.set("dp", Group::strided(0, 2, 1))?;
/// let p = ProvidedGroups::new(c).with_none("expt_dp")?;
/// assert!(matches!(p.lookup("dp")?, Provided::Group(_)));
/// assert_eq!(p.lookup("expt_dp")?, Provided::None);
/// assert_eq!(p.lookup("mp")?, Provided::Absent);
/// assert!(p.lookup("nope").is_err());
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct ProvidedGroups<G> {
    collection: ProcessGroupCollection<G>,
    none: BTreeSet<&'static str>,
}

impl<G: GroupSize> fmt::Debug for ProvidedGroups<G> {
    /// `ProvidedGroups(ProcessGroupCollection(dp(2)), none: ["expt_dp"])`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ProvidedGroups({}, none: {:?})",
            self.collection, self.none
        )
    }
}

impl<G> From<ProcessGroupCollection<G>> for ProvidedGroups<G> {
    fn from(collection: ProcessGroupCollection<G>) -> Self {
        ProvidedGroups::new(collection)
    }
}

fn field_name(function: &'static str, name: &str) -> Result<&'static str> {
    ProcessGroupCollection::<()>::FIELDS
        .iter()
        .find(|f| **f == name)
        .copied()
        .ok_or_else(|| invalid_names(function, vec![name.to_string()]))
}

fn invalid_names(function: &'static str, invalid: Vec<String>) -> Error {
    Error::InvalidGroupNames {
        function,
        invalid,
        valid: ProcessGroupCollection::<()>::FIELDS.join(", "),
    }
}

impl<G> ProvidedGroups<G> {
    /// The collection's set groups; nothing set explicitly to none.
    pub fn new(collection: ProcessGroupCollection<G>) -> Self {
        ProvidedGroups {
            collection,
            none: BTreeSet::new(),
        }
    }

    /// Marks `name` as explicitly set to none (Megatron: `ProcessGroupCollection(name=None)`).
    /// An unknown name, or one whose group is set, is an error.
    pub fn with_none(mut self, name: &str) -> Result<Self> {
        let field = field_name("ProvidedGroups::with_none", name)?;
        let set = if field == "hcp" {
            self.collection.hcp.is_some()
        } else {
            self.collection.get(field)?.is_some()
        };
        if set {
            return Err(Error::Invalid(format!(
                "ProvidedGroups::with_none: the {field} group is set; a field is either a group or explicitly none"
            )));
        }
        self.none.insert(field);
        Ok(self)
    }

    /// The field `name` (any name of [`ProcessGroupCollection::FIELDS`] but `hcp`, which holds
    /// a list: read it from [`ProvidedGroups::collection`]).
    pub fn lookup(&self, name: &str) -> Result<Provided<'_, G>> {
        let field = field_name("ProvidedGroups::lookup", name)?;
        if field == "hcp" {
            return Err(Error::Invalid(
                "ProvidedGroups::lookup: 'hcp' holds one group per level: read collection().hcp"
                    .into(),
            ));
        }
        Ok(match self.collection.get(field)? {
            Some(g) => Provided::Group(g),
            None if self.none.contains(field) => Provided::None,
            None => Provided::Absent,
        })
    }

    /// The set groups.
    pub fn collection(&self) -> &ProcessGroupCollection<G> {
        &self.collection
    }

    /// The names set explicitly to none, in alphabetical order.
    pub fn explicit_none(&self) -> Vec<&'static str> {
        self.none.iter().copied().collect()
    }

    /// The collection, dropping the explicit nones.
    pub fn into_collection(self) -> ProcessGroupCollection<G> {
        self.collection
    }
}

/// Megatron's `ProcessGroupCollection.use_mpu_process_groups(required_pgs)`: the groups named
/// in `required` (every field when `None`) taken from `all`, this rank's full collection (the
/// equivalent of Megatron's `parallel_state` globals: [`crate::RankView::collection`], or
/// [`crate::BuiltCollection::collection`]). A requested name whose group `all` does not have
/// (`embd` on a rank outside the embedding group, `inter_dist_opt` with one optimizer
/// instance, `dp_cp_ag` and `expt_dp_ag`, which Megatron always returns as `None`) comes back
/// explicitly none, as Megatron's getters return `None` for it.
///
/// Unknown names are one error listing them all ([`Error::InvalidGroupNames`], Megatron's
/// `ValueError`). Megatron's `gtp_remat` fields (`gtp_remat`, `dp_cp_gtp_remat`, ...) are not
/// fields here (that feature is out of scope) and count as unknown.
///
/// ```
/// use grid_core::{use_mpu_process_groups, LayoutConfig, LayoutPlan, Provided};
/// let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 2, ..LayoutConfig::new(8) })?;
/// let view = plan.rank_view(2)?;
/// let pgs = use_mpu_process_groups(&view.collection(), Some(&["tp", "dp", "inter_dist_opt"]))?;
/// assert_eq!(pgs.lookup("tp")?.group().unwrap().to_vec(), vec![2, 3]);
/// assert_eq!(pgs.lookup("inter_dist_opt")?, Provided::None);
/// assert_eq!(pgs.lookup("pp")?, Provided::Absent);
/// assert!(use_mpu_process_groups(&view.collection(), Some(&["tp", "gtp_remat"])).is_err());
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn use_mpu_process_groups<G: Clone>(
    all: &ProcessGroupCollection<G>,
    required: Option<&[&str]>,
) -> Result<ProvidedGroups<G>> {
    const F: &str = "use_mpu_process_groups";
    let fields = ProcessGroupCollection::<G>::FIELDS;
    let required: Vec<&str> = required.map_or_else(|| fields.to_vec(), |r| r.to_vec());
    let invalid: Vec<String> = required
        .iter()
        .filter(|n| !fields.contains(n))
        .map(|n| n.to_string())
        .collect();
    if !invalid.is_empty() {
        return Err(invalid_names(F, invalid));
    }
    let mut out = ProvidedGroups::new(ProcessGroupCollection::new());
    for name in required {
        let field = field_name(F, name)?;
        if field == "hcp" {
            // Megatron's getter returns the level list, or None without hierarchical cp.
            match &all.hcp {
                Some(levels) => out.collection.hcp = Some(levels.clone()),
                None => {
                    out.none.insert(field);
                }
            }
            continue;
        }
        match all.get(field)? {
            Some(g) => out.collection.set(field, g.clone())?,
            None => {
                out.none.insert(field);
            }
        }
    }
    Ok(out)
}

/// The parts of Megatron's `DistributedDataParallelConfig` the wiring reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpSettings {
    /// `num_distributed_optimizer_instances` (at least 1).
    pub num_distributed_optimizer_instances: usize,
    /// `use_distributed_optimizer`.
    pub use_distributed_optimizer: bool,
}

impl Default for DdpSettings {
    /// One instance, no distributed optimizer (Megatron's defaults).
    fn default() -> Self {
        DdpSettings {
            num_distributed_optimizer_instances: 1,
            use_distributed_optimizer: false,
        }
    }
}

impl DdpSettings {
    fn check(&self) -> Result<()> {
        if self.num_distributed_optimizer_instances == 0 {
            return Err(Error::NonPositive {
                what: "num_distributed_optimizer_instances".into(),
                value: 0,
            });
        }
        Ok(())
    }
}

/// The inputs of [`setup_process_groups_for_optimizer`] besides the collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerWiring {
    /// The model's `context_parallel_size` (read only when `dp_cp` is absent).
    pub context_parallel_size: usize,
    /// The first model chunk's `ddp_config`, or `None` when it has none (Megatron's
    /// `hasattr(model_chunks[0], 'ddp_config')`).
    pub ddp: Option<DdpSettings>,
    /// `use_gloo_process_groups` (Megatron's default is true, and true is an error together
    /// with a collection).
    pub use_gloo_process_groups: bool,
}

/// What [`setup_process_groups_for_optimizer`] returns: Megatron's dictionary, one field per
/// key (`dp_group` is `dp`, ...), without the out-of-scope `gtp_remat` entries. A field is
/// `None` where Megatron's value is `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerGroups<G> {
    /// `dp_group`.
    pub dp: Option<G>,
    /// `dp_cp_group` (falls back to `dp` when absent and cp = 1).
    pub dp_cp: Option<G>,
    /// `intra_dp_cp_group` (`dp_cp` with one optimizer instance).
    pub intra_dp_cp: Option<G>,
    /// `expt_dp_group`.
    pub expt_dp: Option<G>,
    /// `intra_expt_dp_group` (`expt_dp` with one optimizer instance).
    pub intra_expt_dp: Option<G>,
    /// `mp_group`.
    pub mp: Option<G>,
    /// `expt_tp_pp_group` (the collection's `tp_ep_pp`).
    pub expt_tp_pp: Option<G>,
    /// `inter_dist_opt_group` (only with more than one optimizer instance).
    pub inter_dist_opt: Option<G>,
    /// `intra_dist_opt_group` (only with the distributed optimizer).
    pub intra_dist_opt: Option<G>,
    /// `intra_dp_cp_group_gloo`: always `None` here, as in Megatron when a collection is given.
    pub intra_dp_cp_gloo: Option<G>,
    /// `intra_expt_dp_group_gloo`: always `None`, as above.
    pub intra_expt_dp_gloo: Option<G>,
}

fn missing(function: &'static str, group: &str, why: &str) -> Error {
    Error::WiringGroupMissing {
        function,
        group: group.to_string(),
        why: why.to_string(),
    }
}

/// `dp` and `dp_cp` with Megatron's fallback (steps 1 and 2 of both setups).
fn dp_and_dp_cp<G: Clone>(
    function: &'static str,
    p: &ProvidedGroups<G>,
    cp: usize,
) -> Result<(Option<G>, Option<G>)> {
    let dp = p.lookup("dp")?;
    if !dp.is_provided() {
        return Err(missing(function, "dp", "it is always required"));
    }
    let dp = dp.group().cloned();
    let dp_cp = match p.lookup("dp_cp")? {
        Provided::Absent if cp == 1 => dp.clone(),
        Provided::Absent => {
            return Err(missing(
                function,
                "dp_cp",
                &format!(
                    "it is required when context_parallel_size > 1 (it is {cp}); without context \
                     parallelism it falls back to dp"
                ),
            ))
        }
        other => other.group().cloned(),
    };
    Ok((dp, dp_cp))
}

/// The names among `names` that `p` lacks, joined with ", ".
fn absent<G>(p: &ProvidedGroups<G>, names: &[&str]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for n in names {
        if !p.lookup(n)?.is_provided() {
            out.push(n.to_string());
        }
    }
    Ok(out)
}

fn required<G: Clone>(
    function: &'static str,
    p: &ProvidedGroups<G>,
    name: &str,
) -> Result<Option<G>> {
    let v = p.lookup(name)?;
    if !v.is_provided() {
        return Err(missing(
            function,
            name,
            "set it explicitly to none (ProvidedGroups::with_none) if you don't need it",
        ));
    }
    Ok(v.group().cloned())
}

/// Megatron's `ProcessGroupCollection.setup_process_groups_for_optimizer(pg_collection,
/// model_chunks, use_gloo_process_groups)` with a collection given, checked in Megatron's
/// order:
///
/// 1. `dp` must be provided;
/// 2. `dp_cp`: provided, else `dp` when `context_parallel_size` is 1, else an error;
/// 3. `expt_dp` must be provided (possibly explicitly none);
/// 4. with a `ddp` config of one optimizer instance, `intra_dp_cp` = `dp_cp`, `intra_expt_dp` =
///    `expt_dp` and no `inter_dist_opt`; of several, `intra_dp_cp`, `intra_expt_dp`,
///    `inter_dist_opt` and `intra_dist_opt` must all be provided (the error names the absent
///    ones); with `use_distributed_optimizer`, `intra_dist_opt` must be provided, else it is
///    none. Without a `ddp` config: the one-instance fallbacks and no `intra_dist_opt`;
/// 5. `mp` and `tp_ep_pp` must be provided;
/// 6. `use_gloo_process_groups` must be false (Megatron does not build Gloo groups from a
///    collection).
///
/// Each missing group is an [`Error::WiringGroupMissing`] naming it (Megatron's `ValueError`).
/// Megatron's path without a collection reads its global groups; here pass the rank's full
/// collection through [`use_mpu_process_groups`] instead.
///
/// ```
/// use grid_core::*;
/// let plan = LayoutPlan::new(LayoutConfig { tp: 2, cp: 2, ..LayoutConfig::new(8) })?;
/// let pgs = use_mpu_process_groups(&plan.rank_view(5)?.collection(), None)?;
/// let wiring = OptimizerWiring {
///     context_parallel_size: 2,
///     ddp: Some(DdpSettings { num_distributed_optimizer_instances: 1, use_distributed_optimizer: true }),
///     use_gloo_process_groups: false,
/// };
/// let g = setup_process_groups_for_optimizer(&pgs, &wiring)?;
/// assert_eq!(g.intra_dp_cp, g.dp_cp);
/// assert_eq!(g.dp_cp.unwrap().to_vec(), vec![1, 3, 5, 7]);
/// assert!(g.inter_dist_opt.is_none());
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn setup_process_groups_for_optimizer<G: Clone>(
    pgs: &ProvidedGroups<G>,
    wiring: &OptimizerWiring,
) -> Result<OptimizerGroups<G>> {
    const F: &str = "setup_process_groups_for_optimizer";
    if let Some(d) = &wiring.ddp {
        d.check()?;
    }
    let (dp, dp_cp) = dp_and_dp_cp(F, pgs, wiring.context_parallel_size)?;
    let expt_dp = match pgs.lookup("expt_dp")? {
        Provided::Absent => {
            return Err(missing(
                F,
                "expt_dp",
                "set it explicitly to none (ProvidedGroups::with_none) if you don't need it",
            ))
        }
        v => v.group().cloned(),
    };
    let (intra_dp_cp, intra_expt_dp, inter_dist_opt, intra_dist_opt);
    match &wiring.ddp {
        Some(ddp) => {
            if ddp.num_distributed_optimizer_instances == 1 {
                intra_dp_cp = dp_cp.clone();
                intra_expt_dp = expt_dp.clone();
                inter_dist_opt = None;
            } else {
                let lacking = absent(
                    pgs,
                    &[
                        "intra_dp_cp",
                        "intra_expt_dp",
                        "inter_dist_opt",
                        "intra_dist_opt",
                    ],
                )?;
                if !lacking.is_empty() {
                    return Err(missing(
                        F,
                        &lacking.join(", "),
                        &format!(
                            "intra_dp_cp, intra_expt_dp, inter_dist_opt and intra_dist_opt are \
                             required with {} distributed-optimizer instances (> 1)",
                            ddp.num_distributed_optimizer_instances
                        ),
                    ));
                }
                intra_dp_cp = pgs.lookup("intra_dp_cp")?.group().cloned();
                intra_expt_dp = pgs.lookup("intra_expt_dp")?.group().cloned();
                inter_dist_opt = pgs.lookup("inter_dist_opt")?.group().cloned();
            }
            intra_dist_opt = if ddp.use_distributed_optimizer {
                required(F, pgs, "intra_dist_opt")?
            } else {
                None
            };
        }
        None => {
            intra_dp_cp = dp_cp.clone();
            intra_expt_dp = expt_dp.clone();
            inter_dist_opt = None;
            intra_dist_opt = None;
        }
    }
    let mp = required(F, pgs, "mp")?;
    let expt_tp_pp = required(F, pgs, "tp_ep_pp")?;
    if wiring.use_gloo_process_groups {
        return Err(Error::Invalid(format!(
            "{F}: Gloo process groups are not supported when a collection is provided: set \
             use_gloo_process_groups to false"
        )));
    }
    Ok(OptimizerGroups {
        dp,
        dp_cp,
        intra_dp_cp,
        expt_dp,
        intra_expt_dp,
        mp,
        expt_tp_pp,
        inter_dist_opt,
        intra_dist_opt,
        intra_dp_cp_gloo: None,
        intra_expt_dp_gloo: None,
    })
}

/// The inputs of [`setup_process_groups_for_ddp`] besides the collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpWiring {
    /// The model config's `context_parallel_size` (read only when `dp_cp` is absent).
    pub context_parallel_size: usize,
    /// The DDP config.
    pub ddp: DdpSettings,
}

/// What [`setup_process_groups_for_ddp`] returns: Megatron's dictionary, one field per key,
/// without the out-of-scope `gtp_remat` entries.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpGroups<G> {
    /// `dp_group`.
    pub dp: Option<G>,
    /// `dp_cp_group` (falls back to `dp` when absent and cp = 1).
    pub dp_cp: Option<G>,
    /// `expt_dp_group`: the collection's, or a new group of this rank alone.
    pub expt_dp: G,
    /// True when `expt_dp` is the new group of this rank alone (Megatron logs a warning).
    pub expt_dp_is_singleton: bool,
    /// `intra_dp_cp_group` (`dp_cp` with one optimizer instance).
    pub intra_dp_cp: Option<G>,
    /// `intra_expt_dp_group` (`expt_dp` with one optimizer instance).
    pub intra_expt_dp: Option<G>,
    /// `inter_dist_opt_group` (only with more than one optimizer instance).
    pub inter_dist_opt: Option<G>,
    /// `tp_group`.
    pub tp: Option<G>,
    /// `pp_group`.
    pub pp: Option<G>,
    /// `ep_group`.
    pub ep: Option<G>,
}

/// Megatron's `ProcessGroupCollection.setup_process_groups_for_ddp(pg_collection, config,
/// ddp_config)` with a collection given, checked in Megatron's order:
///
/// 1. `dp` must be provided;
/// 2. `dp_cp`: provided, else `dp` when `context_parallel_size` is 1, else an error;
/// 3. `expt_dp`: the collection's when it is a group; when absent or none, a new group of this
///    rank alone, made by `singleton` (called only then; Megatron calls
///    `torch.distributed.new_group(ranks=[rank])` and logs a warning);
/// 4. one optimizer instance: `intra_dp_cp` = `dp_cp`, `intra_expt_dp` = `expt_dp`, no
///    `inter_dist_opt`; several: `intra_dp_cp`, `intra_expt_dp` and `inter_dist_opt` must be
///    provided (the error names the absent ones);
/// 5. `tp`, `pp` and `ep` must be provided (the error names the absent ones).
///
/// `singleton` makes the one-rank group: `Group::single(rank)` for memberships; for live
/// communicators a split of a parent where every rank passes its own colour
/// (`factory.split(parent, Some(rank), rank)`), which like torch's `new_group` is collective:
/// every rank of the parent must then reach this call.
///
/// ```
/// use grid_core::*;
/// let mut c = ProcessGroupCollection::new();
/// for name in ["dp", "tp", "pp", "ep"] {
///     c.set(name, Group::single(3))?;
/// }
/// let wiring = DdpWiring { context_parallel_size: 1, ddp: DdpSettings::default() };
/// let g = setup_process_groups_for_ddp(&c.into(), &wiring, || Ok(Group::single(3)))?;
/// assert!(g.expt_dp_is_singleton);
/// assert_eq!(g.dp_cp, g.dp);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn setup_process_groups_for_ddp<G: Clone>(
    pgs: &ProvidedGroups<G>,
    wiring: &DdpWiring,
    singleton: impl FnOnce() -> Result<G>,
) -> Result<DdpGroups<G>> {
    const F: &str = "setup_process_groups_for_ddp";
    wiring.ddp.check()?;
    let (dp, dp_cp) = dp_and_dp_cp(F, pgs, wiring.context_parallel_size)?;
    let (expt_dp, expt_dp_is_singleton) = match pgs.lookup("expt_dp")?.group() {
        Some(g) => (g.clone(), false),
        None => {
            tracing::warn!(
                "No expert data parallel group provided in the collection, creating a new one with just the current rank"
            );
            (singleton()?, true)
        }
    };
    let (intra_dp_cp, intra_expt_dp, inter_dist_opt) =
        if wiring.ddp.num_distributed_optimizer_instances == 1 {
            (dp_cp.clone(), Some(expt_dp.clone()), None)
        } else {
            let lacking = absent(pgs, &["intra_dp_cp", "intra_expt_dp", "inter_dist_opt"])?;
            if !lacking.is_empty() {
                return Err(missing(
                    F,
                    &lacking.join(", "),
                    &format!(
                        "intra_dp_cp, intra_expt_dp and inter_dist_opt are required with {} \
                         distributed-optimizer instances (> 1)",
                        wiring.ddp.num_distributed_optimizer_instances
                    ),
                ));
            }
            (
                pgs.lookup("intra_dp_cp")?.group().cloned(),
                pgs.lookup("intra_expt_dp")?.group().cloned(),
                pgs.lookup("inter_dist_opt")?.group().cloned(),
            )
        };
    let lacking = absent(pgs, &["tp", "pp", "ep"])?;
    if !lacking.is_empty() {
        return Err(missing(
            F,
            &lacking.join(", "),
            "tp, pp and ep are always required",
        ));
    }
    Ok(DdpGroups {
        dp,
        dp_cp,
        expt_dp,
        expt_dp_is_singleton,
        intra_dp_cp,
        intra_expt_dp,
        inter_dist_opt,
        tp: pgs.lookup("tp")?.group().cloned(),
        pp: pgs.lookup("pp")?.group().cloned(),
        ep: pgs.lookup("ep")?.group().cloned(),
    })
}
