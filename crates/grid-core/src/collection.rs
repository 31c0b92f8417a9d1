//! `ProcessGroupCollection` (docs/semantics.md §4), generic over the group handle, and
//! [`build_collection`], which fills one with live communicators.

use crate::comm::TimeLimit;
use crate::comm::{Communicator, CommunicatorExt, GroupFactory};
use crate::error::{Error, Result};
use crate::group::GroupSize;
use crate::initplan::Creation;
use crate::options::{CollectionOptions, GroupOptions};
use crate::plan::{Family, FamilyLevel, GroupSignature, LayoutPlan};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

/// One entry of a collection: a single group, or the per-level list of `hcp`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PgEntry<'a, G> {
    /// A group.
    Group(&'a G),
    /// One group per hierarchical level.
    Levels(&'a [G]),
}

macro_rules! collection {
    ($($field:ident),* $(,)?) => {
        /// This rank's process groups, one field per family (Megatron's `ProcessGroupCollection`).
        ///
        /// Generic over the handle: [`crate::Group`] (pure membership, from
        /// [`crate::RankView::collection`]), or a backend communicator such as
        /// `Arc<dyn Communicator>` (from [`build_collection`]). Unset fields are `None`.
        /// Besides `hcp`, the fields `dp_cp_ag` and `expt_dp_ag` exist for parity with Megatron,
        /// which creates them elsewhere; plans never set them.
        ///
        /// ```
        /// use grid_core::{ProcessGroupCollection, Group};
        /// let mut c = ProcessGroupCollection::new();
        /// c.set("tp", Group::strided(0, 2, 1)).unwrap();
        /// c.hcp = Some(vec![Group::strided(0, 2, 1), Group::strided(0, 4, 2)]);
        /// assert_eq!(c.to_string(), "ProcessGroupCollection(tp(2), hcp([2, 4]))");
        /// assert!(c.get("pp").unwrap().is_none());
        /// assert!(c.get("nope").is_err());
        /// ```
        #[derive(Clone, PartialEq)]
        pub struct ProcessGroupCollection<G> {
            $( #[doc = concat!("The `", stringify!($field), "` group.")] pub $field: Option<G>, )*
            /// Hierarchical context-parallel groups, one per level.
            pub hcp: Option<Vec<G>>,
        }

        impl<G> ProcessGroupCollection<G> {
            /// Every field name, in declaration order (`hcp` included).
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*, "hcp"];

            /// An empty collection.
            pub fn new() -> Self {
                ProcessGroupCollection { $($field: None,)* hcp: None }
            }

            fn slot(&self, name: &str) -> Option<&Option<G>> {
                match name { $(stringify!($field) => Some(&self.$field),)* _ => None }
            }
            fn slot_mut(&mut self, name: &str) -> Option<&mut Option<G>> {
                match name { $(stringify!($field) => Some(&mut self.$field),)* _ => None }
            }

            /// Applies `f` to every group, keeping the field structure.
            pub fn try_map<H, E>(self, mut f: impl FnMut(&str, G) -> std::result::Result<H, E>) -> std::result::Result<ProcessGroupCollection<H>, E> {
                Ok(ProcessGroupCollection {
                    $($field: match self.$field { Some(g) => Some(f(stringify!($field), g)?), None => None },)*
                    hcp: match self.hcp { Some(v) => Some(v.into_iter().map(|g| f("hcp", g)).collect::<std::result::Result<_, E>>()?), None => None },
                })
            }

            /// The set entries in declaration order (`hcp` after `tp_cp`).
            pub fn iter(&self) -> impl Iterator<Item = (&'static str, PgEntry<'_, G>)> + '_ {
                let mut v: Vec<(&'static str, PgEntry<'_, G>)> = Vec::new();
                $( if let Some(g) = &self.$field { v.push((stringify!($field), PgEntry::Group(g))); } )*
                if let Some(h) = &self.hcp { v.push(("hcp", PgEntry::Levels(h))); }
                v.sort_by_key(|(n, _)| DISPLAY_ORDER.iter().position(|d| d == n));
                v.into_iter()
            }
        }
    };
}

collection!(
    tp,
    pp,
    mp,
    embd,
    pos_embd,
    cp,
    tp_cp,
    ep,
    expt_tp,
    tp_ep,
    tp_ep_pp,
    tp_dp,
    tp_dp_cp,
    dp,
    dp_cp,
    dp_cp_ag,
    expt_dp,
    expt_dp_ag,
    intra_dp_cp,
    intra_expt_dp,
    inter_dist_opt,
    intra_dist_opt,
);

/// Megatron's declaration order, with `hcp` after `tp_cp`.
const DISPLAY_ORDER: [&str; 23] = [
    "tp",
    "pp",
    "mp",
    "embd",
    "pos_embd",
    "cp",
    "tp_cp",
    "hcp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "tp_dp",
    "tp_dp_cp",
    "dp",
    "dp_cp",
    "dp_cp_ag",
    "expt_dp",
    "expt_dp_ag",
    "intra_dp_cp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
];

impl<G> Default for ProcessGroupCollection<G> {
    fn default() -> Self {
        Self::new()
    }
}

fn unknown_field(name: &str) -> Error {
    Error::UnknownFamily {
        name: name.to_string(),
        valid: DISPLAY_ORDER.join(", "),
    }
}

impl<G> ProcessGroupCollection<G> {
    /// The group named `name` (`Ok(None)` when unset); an unknown name is an error. For `hcp`
    /// use the `hcp` field or [`ProcessGroupCollection::entry`].
    pub fn get(&self, name: &str) -> Result<Option<&G>> {
        match self.slot(name) {
            Some(s) => Ok(s.as_ref()),
            None if name == "hcp" => Err(Error::Invalid(
                "'hcp' holds one group per level: read the hcp field or use entry(\"hcp\")".into(),
            )),
            None => Err(unknown_field(name)),
        }
    }

    /// The entry named `name`, `hcp` included.
    pub fn entry(&self, name: &str) -> Result<Option<PgEntry<'_, G>>> {
        if name == "hcp" {
            return Ok(self.hcp.as_deref().map(PgEntry::Levels));
        }
        Ok(self.get(name)?.map(PgEntry::Group))
    }

    /// Sets the group named `name`; an unknown name is an error (Megatron's `ValueError`).
    pub fn set(&mut self, name: &str, group: G) -> Result<()> {
        match self.slot_mut(name) {
            Some(s) => {
                *s = Some(group);
                Ok(())
            }
            None => Err(unknown_field(name)),
        }
    }

    /// Sets a family's group (for `hcp`, appends a level).
    pub fn set_family(&mut self, family: Family, group: G) {
        if family == Family::Hcp {
            self.hcp.get_or_insert_with(Vec::new).push(group);
        } else if let Some(s) = self.slot_mut(family.name()) {
            *s = Some(group);
        }
    }

    /// Names of the set entries, in declaration order.
    pub fn keys(&self) -> Vec<&'static str> {
        self.iter().map(|(n, _)| n).collect()
    }

    /// Number of set entries.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// True when nothing is set.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills a collection for `rank` from `plan`, calling `factory` once for each group the rank
    /// belongs to (every family, every hcp level), in Megatron's creation order.
    pub fn from_plan(
        plan: &LayoutPlan,
        rank: usize,
        mut factory: impl FnMut(FamilyLevel, &crate::Group) -> Result<G>,
    ) -> Result<Self> {
        let mut c = ProcessGroupCollection::new();
        for fl in plan.family_levels() {
            if let Some(g) = plan.group_of(fl, rank)? {
                c.set_family(fl.family, factory(fl, &g)?);
            }
        }
        Ok(c)
    }
}

impl<C: Communicator + ?Sized> ProcessGroupCollection<Arc<C>> {
    /// Megatron's `update_pg_timeout`: sets the default time limit of later operations of the
    /// group of `family` (`"hcp"`: every level), or of every group when `family` is `None`,
    /// on this rank. Returns how many communicators were updated (a communicator shared by
    /// several families counts once per family). An unknown family name is an error; a family
    /// this rank has no group of updates nothing.
    ///
    /// ```
    /// use backend_local::{run, LocalConfig};
    /// use grid_core::*;
    /// use std::time::Duration;
    /// let plan = LayoutPlan::new(LayoutConfig { world_size: 2, tp: 2, ..Default::default() })?;
    /// let out = run(2, &LocalConfig::default(), |f, world| {
    ///     let c = build_collection(f, &world, &plan)?.collection;
    ///     c.update_pg_timeout(Some("tp"), Duration::from_millis(200))?;
    ///     let tp = c.tp.as_ref().unwrap().time_limit();
    ///     let n = c.update_pg_timeout(None, TimeLimit::Unlimited)?;
    ///     Ok((tp, n, c.pp.as_ref().unwrap().time_limit()))
    /// })?;
    /// assert_eq!(out[0].0, TimeLimit::After(Duration::from_millis(200)));
    /// assert_eq!(out[0].2, TimeLimit::Unlimited);
    /// # Ok::<(), Error>(())
    /// ```
    pub fn update_pg_timeout(
        &self,
        family: Option<&str>,
        limit: impl Into<TimeLimit>,
    ) -> Result<usize> {
        let limit = limit.into();
        let mut n = 0;
        let mut apply = |e: PgEntry<'_, Arc<C>>| match e {
            PgEntry::Group(g) => {
                g.set_time_limit(limit);
                n += 1;
            }
            PgEntry::Levels(l) => {
                for g in l {
                    g.set_time_limit(limit);
                    n += 1;
                }
            }
        };
        match family {
            Some(name) => {
                if let Some(e) = self.entry(name)? {
                    apply(e);
                }
            }
            None => self.iter().for_each(|(_, e)| apply(e)),
        }
        Ok(n)
    }
}

impl<G: GroupSize> fmt::Display for ProcessGroupCollection<G> {
    /// `ProcessGroupCollection(tp(2), pp(4), hcp([2, 4]))`, or `ProcessGroupCollection(empty)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .iter()
            .map(|(n, e)| match e {
                PgEntry::Group(g) => format!("{n}({})", g.group_size()),
                PgEntry::Levels(l) => format!(
                    "{n}([{}])",
                    l.iter()
                        .map(|g| g.group_size().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
            .collect();
        if parts.is_empty() {
            write!(f, "ProcessGroupCollection(empty)")
        } else {
            write!(f, "ProcessGroupCollection({})", parts.join(", "))
        }
    }
}

impl<G: GroupSize> fmt::Debug for ProcessGroupCollection<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What [`build_collection`] did for one family level.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyBuildStat {
    /// The family level.
    pub family: FamilyLevel,
    /// Size of this rank's group (`None`: the rank is in no group of this family).
    pub group_size: Option<usize>,
    /// Communicators this rank created for the family (0 or 1).
    pub created: usize,
    /// The earlier family whose communicator was reused (identical groups).
    pub reused_from: Option<FamilyLevel>,
    /// Seconds spent (the split, or nothing when reused).
    pub seconds: f64,
}

/// A collection of live communicators plus what building it cost.
pub struct BuiltCollection<C> {
    /// The communicators, one per family the rank belongs to.
    pub collection: ProcessGroupCollection<Arc<C>>,
    /// Per family level, in creation order.
    pub stats: Vec<FamilyBuildStat>,
    /// Collective calls made on the parent (the plan check plus one split per distinct family).
    pub collective_calls: usize,
}

impl<C> BuiltCollection<C> {
    /// Communicators created on this rank.
    pub fn communicators_created(&self) -> usize {
        self.stats.iter().map(|s| s.created).sum()
    }
}

/// The first rank of `plan` (in increasing order) that is none of `parent`'s global ranks, or
/// `None` when the plan fits. Costs O(parent size): at most `parent.size() + 1` plan ranks are
/// looked at before one is missing.
fn first_missing_rank<C: Communicator + ?Sized>(parent: &C, plan: &LayoutPlan) -> Option<usize> {
    let ranks: std::collections::HashSet<usize> = (0..parent.size())
        .map(|i| parent.global_ranks().get(i).copied().unwrap_or(i))
        .collect();
    let cfg = plan.config();
    let end = cfg.rank_offset.saturating_add(cfg.world_size);
    (cfg.rank_offset..end).find(|r| !ranks.contains(r))
}

/// The identity of a group for members-only creation
/// ([`GroupFactory::create_members_only`]): `label` (a family level such as `tp` or `hcp[1]`,
/// or a group's name), then the first and last member, the member count and a 64-bit FNV-1a
/// hash of the members (global ranks, in the order given). It depends on nothing but the label
/// and the members, so every member computes the same identity without communication, and it
/// stays short whatever the group size.
///
/// ```
/// let id = grid_core::group_identity("tp", &[4, 5]);
/// assert!(id.starts_with("tp/4-5n2-"), "{id}");
/// assert_eq!(id, grid_core::group_identity("tp", &[4, 5]));
/// assert_ne!(id, grid_core::group_identity("dp", &[4, 5]));
/// assert_ne!(id, grid_core::group_identity("tp", &[4, 6]));
/// ```
pub fn group_identity(label: &str, members: &[usize]) -> String {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in label
        .bytes()
        .chain([0u8])
        .chain(members.iter().flat_map(|m| (*m as u64).to_le_bytes()))
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    let first = members.first().copied().unwrap_or(0);
    let last = members.last().copied().unwrap_or(0);
    format!("{label}/{first}-{last}n{}-{h:016x}", members.len())
}

/// Builds this rank's [`ProcessGroupCollection`] of live communicators from `plan`.
///
/// 1. Every rank of `parent` all-gathers the plan's [`LayoutPlan::fingerprint`] together with
///    whether the plan fits the parent (every plan rank, `rank_offset .. rank_offset +
///    world_size`, is one of the parent's `global_ranks()`). If any rank holds another plan,
///    **every** rank returns [`Error::PlanMismatch`]; otherwise, if the plan does not fit,
///    every rank returns [`Error::PlanDoesNotFit`] naming both sizes. Both are decided from the
///    gathered values, which are the same on every rank, before any split: nobody hangs in a
///    split that the others never enter.
/// 2. For each family level in Megatron's creation order, families whose groups are identical
///    to an earlier one's (same [`LayoutPlan::group_signature`], e.g. `dp` and `dp_cp` when
///    cp = 1) reuse its communicator; every other family costs **one** `split` of the parent,
///    with colour = the index of this rank's group and key = its world rank, so communicator
///    ranks are sorted positions, as torch defines them. Ranks in no group of a family pass no
///    colour and get no communicator.
///
/// The parent's `global_ranks()` map its ranks to the plan's ranks; the parent may be larger
/// than the plan (a plan over a sub-range, with a rank offset): ranks of the parent outside the
/// plan take part in every call and get an empty collection.
pub fn build_collection<F: GroupFactory>(
    factory: &F,
    parent: &F::Comm,
    plan: &LayoutPlan,
) -> Result<BuiltCollection<F::Comm>> {
    build(factory, parent, plan, None, None)
}

/// [`build_collection`] with options per family (Megatron's `timeout`, `group_desc` and
/// `nccl_comm_cfgs`): each family level's communicator is created with
/// [`CollectionOptions::for_level`] through [`GroupFactory::split_with`], so it carries its
/// family's name (`"tp"`, `"hcp[1]"`, or the name given) in every error, span and operation
/// log, its time limit, and its backend options.
///
/// A family reuses an earlier family's communicator (identical groups, as in
/// [`build_collection`]) only when both were given the same options (apart from the automatic
/// family name): the reused communicator keeps the first family's name (`dp` for `dp_cp` when
/// cp = 1). A family with its own name, time limit or backend options gets its own
/// communicator. Every family's options are checked against the factory's backend before the
/// first collective call, so bad options fail on every rank alike without communication.
///
/// ```
/// use backend_local::{run, LocalConfig};
/// use grid_core::*;
/// use std::time::Duration;
/// let plan = LayoutPlan::new(LayoutConfig { world_size: 4, tp: 2, ..Default::default() })?;
/// let mut opts = CollectionOptions::new();
/// opts.set("tp", GroupOptions::new().named("TENSOR_MODEL_PARALLEL_GROUP").with_timeout(Duration::from_secs(3)))?;
/// let out = run(4, &LocalConfig::default(), |f, world| {
///     let built = build_collection_with(f, &world, &plan, &opts)?;
///     let tp = built.collection.tp.clone().unwrap();
///     let dp = built.collection.dp.clone().unwrap();
///     Ok((tp.name().to_string(), tp.time_limit(), dp.name().to_string()))
/// })?;
/// assert_eq!(out[0].0, "TENSOR_MODEL_PARALLEL_GROUP");
/// assert_eq!(out[0].1, TimeLimit::After(Duration::from_secs(3)));
/// assert_eq!(out[0].2, "dp");
/// # Ok::<(), Error>(())
/// ```
pub fn build_collection_with<F: GroupFactory>(
    factory: &F,
    parent: &F::Comm,
    plan: &LayoutPlan,
    options: &CollectionOptions,
) -> Result<BuiltCollection<F::Comm>> {
    build(factory, parent, plan, Some(options), None)
}

/// The families Megatron's `create_gloo_process_groups` makes a Gloo (CPU) twin of, next to
/// the GPU groups: `dp` (`DATA_PARALLEL_GROUP_GLOO`), `dp_cp` (`DATA_PARALLEL_GROUP_WITH_CP_GLOO`),
/// `expt_dp` (`EXPERT_DATA_PARALLEL_GROUP_GLOO`), and for the distributed optimizer
/// `intra_dp_cp` (`INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO`) and `intra_expt_dp`
/// (`INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO`).
pub const GLOO_TWIN_FAMILIES: [Family; 5] = [
    Family::Dp,
    Family::DpCp,
    Family::ExptDp,
    Family::IntraDpCp,
    Family::IntraExptDp,
];

/// Megatron's Gloo twins (`create_gloo_process_groups=True`): builds, on a CPU backend's
/// factory (Gloo or MPI, or the local backend), **only** the data-parallel families of
/// [`GLOO_TWIN_FAMILIES`] of `plan`, the same plan the GPU collection was built from, in one
/// call. It is [`build_collection_with`] restricted to those families: the plan check, then
/// one creation per distinct family among them (families with identical groups, such as `dp`
/// and `dp_cp` when cp = 1, share one communicator), by split or members-only as
/// `options.creation` says; no other family is created or set. Use `CollectionOptions::new()`
/// for the defaults.
///
/// A parent whose communicators do not take host memory (NCCL) is refused with
/// [`Error::Unsupported`] before any communication: twins exist to hold CPU tensors.
///
/// ```
/// use backend_local::{run, LocalConfig};
/// use grid_core::*;
/// let plan = LayoutPlan::new(LayoutConfig { tp: 2, cp: 2, ..LayoutConfig::new(8) })?;
/// let out = run(8, &LocalConfig::default(), |f, world| {
///     let twins = build_gloo_twins(f, &world, &plan, &CollectionOptions::new())?;
///     Ok(twins.collection.keys())
/// })?;
/// assert_eq!(out[0], ["dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp"]);
/// # Ok::<(), Error>(())
/// ```
pub fn build_gloo_twins<F: GroupFactory>(
    factory: &F,
    parent: &F::Comm,
    plan: &LayoutPlan,
    options: &CollectionOptions,
) -> Result<BuiltCollection<F::Comm>> {
    if !parent.accepts(crate::comm::Memory::Host) {
        return Err(Error::Unsupported {
            op: "build_gloo_twins",
            backend: parent.backend(),
            what:
                "Gloo twins hold CPU tensors: build them on a CPU backend's factory (Gloo or MPI)"
                    .into(),
        });
    }
    build(
        factory,
        parent,
        plan,
        Some(options),
        Some(&GLOO_TWIN_FAMILIES),
    )
}

fn build<F: GroupFactory>(
    factory: &F,
    parent: &F::Comm,
    plan: &LayoutPlan,
    options: Option<&CollectionOptions>,
    only: Option<&[Family]>,
) -> Result<BuiltCollection<F::Comm>> {
    // The families built: all, or those of `only` (the same on every rank).
    let levels: Vec<FamilyLevel> = plan
        .family_levels()
        .into_iter()
        .filter(|fl| only.is_none_or(|o| o.contains(&fl.family)))
        .collect();
    // Options are the same on every rank: checked before any communication.
    if let Some(o) = options {
        for &fl in &levels {
            o.for_level(fl).check_backend(parent.backend())?;
        }
    }
    let _span = tracing::debug_span!("build_collection", backend = parent.backend()).entered();
    let fp = plan.fingerprint() as i64;
    // -1: the plan fits this rank's view of the parent; else the first plan rank it lacks.
    let missing = first_missing_rank(parent, plan).map_or(-1, |r| r as i64);
    let mut all = vec![0i64; 2 * parent.size()];
    parent.all_gather_into(&[fp, missing], &mut all)?;
    let mismatched: Vec<usize> = all
        .chunks_exact(2)
        .enumerate()
        .filter(|(_, v)| v[0] != fp)
        .map(|(i, _)| parent.global_ranks().get(i).copied().unwrap_or(i))
        .collect();
    if !mismatched.is_empty() {
        // Report from the majority's point of view too: every rank sees some mismatch.
        return Err(Error::PlanMismatch {
            mine: fp as u64,
            mismatched,
        });
    }
    // Every rank gathered the same values, so every rank takes the same decision.
    if let Some(missing) = all
        .chunks_exact(2)
        .filter_map(|v| usize::try_from(v[1]).ok())
        .min()
    {
        let cfg = plan.config();
        return Err(Error::PlanDoesNotFit {
            world_size: cfg.world_size,
            rank_offset: cfg.rank_offset,
            parent_size: parent.size(),
            missing,
        });
    }
    let me = parent
        .global_ranks()
        .get(parent.rank())
        .copied()
        .unwrap_or(parent.rank());
    let in_plan = plan.contains(me);
    // Members-only creation names members by parent rank: the parent's global ranks, indexed.
    let members_only = options.is_some_and(|o| o.creation == Creation::MembersOnly);
    let by_global: HashMap<usize, usize> = if members_only && in_plan {
        (0..parent.size())
            .map(|i| (parent.global_ranks().get(i).copied().unwrap_or(i), i))
            .collect()
    } else {
        HashMap::new()
    };
    let parent_rank_of = |global: usize, fl: FamilyLevel| -> Result<usize> {
        by_global.get(&global).copied().ok_or_else(|| {
            Error::Invalid(format!(
                "{fl}: member {global} of this rank's group is none of the parent's ranks"
            ))
        })
    };
    let mut collection = ProcessGroupCollection::new();
    let mut stats = Vec::new();
    // Reuse needs identical groups and, with options, identical explicit options.
    type Made<C> = HashMap<(GroupSignature, Option<GroupOptions>), (FamilyLevel, Option<Arc<C>>)>;
    let mut made: Made<F::Comm> = HashMap::new();
    let mut calls = 1;
    for &fl in &levels {
        let sig = (
            plan.group_signature(fl)?,
            options.map(|o| match o.family(fl.family.name()) {
                Some(f) => f.over(&o.default),
                None => o.default.clone(),
            }),
        );
        let group = if in_plan {
            plan.group_of(fl, me)?
        } else {
            None
        };
        let size = group.as_ref().map(|g| g.len());
        if let Some((from, comm)) = made.get(&sig) {
            if let Some(c) = comm {
                collection.set_family(fl.family, c.clone());
            }
            stats.push(FamilyBuildStat {
                family: fl,
                group_size: size,
                created: 0,
                reused_from: Some(*from),
                seconds: 0.0,
            });
            continue;
        }
        let color = if in_plan {
            plan.group_index_of(fl, me)?
        } else {
            None
        };
        let color = match color {
            Some(c) => Some(u32::try_from(c).map_err(|_| {
                Error::Invalid(format!(
                    "{fl}: group index {c} does not fit a 32-bit colour"
                ))
            })?),
            None => None,
        };
        let t = Instant::now();
        let comm = match (options, &group) {
            (Some(o), group) if o.creation == Creation::MembersOnly => {
                // Only members call; ranks in no group of this family make no call.
                match group {
                    Some(g) => {
                        let _s =
                            tracing::trace_span!("create_members_only", family = %fl).entered();
                        // Communicator ranks follow the world ranks, as the split's keys.
                        let mut global: Vec<usize> = g.iter().collect();
                        global.sort_unstable();
                        let members = global
                            .iter()
                            .map(|&r| parent_rank_of(r, fl))
                            .collect::<Result<Vec<usize>>>()?;
                        let id = group_identity(&fl.to_string(), &global);
                        calls += 1;
                        Some(factory.create_members_only(
                            parent,
                            &members,
                            &id,
                            &o.for_level(fl),
                        )?)
                    }
                    None => None,
                }
            }
            _ => {
                let _s = tracing::trace_span!("split", family = %fl).entered();
                calls += 1;
                match options {
                    None => factory.split(parent, color, me)?,
                    Some(o) => factory.split_with(parent, color, me, &o.for_level(fl))?,
                }
            }
        }
        .map(Arc::new);
        if let (Some(c), Some(g)) = (&comm, &group) {
            if c.size() != g.len() {
                return Err(Error::Invalid(format!(
                    "{fl}: the backend created a communicator of {} ranks for a group of {}",
                    c.size(),
                    g.len()
                )));
            }
            collection.set_family(fl.family, c.clone());
        }
        stats.push(FamilyBuildStat {
            family: fl,
            group_size: size,
            created: usize::from(comm.is_some()),
            reused_from: None,
            seconds: t.elapsed().as_secs_f64(),
        });
        made.insert(sig, (fl, comm));
    }
    Ok(BuiltCollection {
        collection,
        stats,
        collective_calls: calls,
    })
}
