//! The initialisation plan of a layout: for every rank, the communicators [`build_collection`]
//! creates, which families share each, and the ordered collective calls that create them — and
//! [`verify_plan`], which proves on a simulated world that those calls match across ranks.
//!
//! Everything here is arithmetic over the [`LayoutPlan`] (no communicator, no group list of the
//! world): one rank's plan costs O(families × dimensions) whatever the world size, the summary
//! over all ranks and the verification cost O(world × families) and run in parallel (rayon).
//!
//! Two creation strategies are described:
//! * [`Creation::Split`] is what [`build_collection`] does: one plan check (an all-gather of the
//!   plan fingerprint over the parent), then, per *distinct* family (families with identical
//!   groups share one communicator, see [`LayoutPlan::group_signature`]), one `split` of the
//!   parent in which **every** parent rank takes part, with colour = the index of its group and
//!   key = its world rank (no colour when it is in no group of the family).
//! * [`Creation::MembersOnly`] is what [`crate::build_collection_with`] does when
//!   [`crate::CollectionOptions::creation`] is set to it: the same plan check, then, per
//!   distinct family the rank is a member of, one creation among that group's members only
//!   ([`crate::GroupFactory::create_members_only`]: `MPI_Comm_create_group` on MPI, a
//!   rendezvous under a store prefix of the group's own on Gloo). Ranks in no group of a family
//!   make no call for it. The group's identity (MPI tag, store prefix, name) is derived from
//!   the family and the members ([`crate::group_identity`]), never from a per-rank counter.
//!
//! ```
//! use grid_core::{Creation, InitPlan, LayoutConfig, LayoutPlan};
//! let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 2, ..LayoutConfig::new(8) })?;
//! let init = InitPlan::new(&plan, Creation::Split)?;
//! let r5 = init.rank(5)?;
//! // The plan check, then one split per distinct family.
//! assert_eq!(r5.collective_calls, 1 + init.shared().len());
//! assert_eq!(r5.calls[1].families[0].to_string(), "tp");
//! assert_eq!(r5.calls[1].colour, Some(2)); // tp group [4, 5] is group 2
//! assert_eq!(r5.calls[1].key, Some(5));
//! let report = grid_core::verify_plan(&plan, Creation::Split)?;
//! assert_eq!(report.ranks, 8);
//! # Ok::<(), grid_core::Error>(())
//! ```
//!
//! [`build_collection`]: crate::build_collection

use crate::error::{Error, Result};
use crate::plan::{FamilyLevel, GroupSignature, LayoutPlan};
use rayon::prelude::*;
use serde::{Serialize, Serializer};
use std::collections::HashMap;
use std::fmt;

/// How the communicators of a collection are created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Creation {
    /// One split of the parent per distinct family, every parent rank taking part (what
    /// [`crate::build_collection`] does by default).
    #[default]
    Split,
    /// Only the members of each group create it, under an identity derived from the family
    /// and the members ([`crate::group_identity`]); [`crate::build_collection_with`] does it
    /// when [`crate::CollectionOptions::creation`] says so, through
    /// [`crate::GroupFactory::create_members_only`].
    MembersOnly,
}

impl Creation {
    /// `split` or `members-only`.
    pub fn name(self) -> &'static str {
        match self {
            Creation::Split => "split",
            Creation::MembersOnly => "members-only",
        }
    }
}

impl fmt::Display for Creation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The kind of one collective call of the initialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallOp {
    /// The plan check: an all-gather over the parent of (plan fingerprint, first plan rank the
    /// parent lacks), two 64-bit values per rank.
    PlanCheck,
    /// A split of the parent (every parent rank takes part).
    Split,
    /// A creation among the group's members only ([`Creation::MembersOnly`]).
    Create,
}

impl CallOp {
    /// `plan_check`, `split` or `create`.
    pub fn name(self) -> &'static str {
        match self {
            CallOp::PlanCheck => "plan_check",
            CallOp::Split => "split",
            CallOp::Create => "create",
        }
    }
}

fn family_names<S: Serializer>(v: &[FamilyLevel], s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|f| f.to_string()))
}

/// One communicator kind of the plan: a distinct family and every family that shares its
/// communicators (identical groups on every rank).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SharedComm {
    /// The families served, the creating one first (Megatron's creation order).
    #[serde(serialize_with = "family_names")]
    pub families: Vec<FamilyLevel>,
    /// Number of groups (communicators in the whole world).
    pub groups: usize,
}

impl SharedComm {
    /// The family whose turn creates the communicator.
    pub fn creator(&self) -> FamilyLevel {
        self.families[0]
    }
}

/// The communicator a call gives this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CommInfo {
    /// Number of members.
    pub size: usize,
    /// This rank's rank in it (its position among the sorted members).
    pub group_rank: usize,
}

/// One collective call of a rank's initialisation, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InitCall {
    /// Position in the rank's sequence (0 is the plan check).
    pub index: usize,
    /// What the call is.
    pub op: CallOp,
    /// The families the resulting communicator serves (empty for the plan check).
    #[serde(serialize_with = "family_names")]
    pub families: Vec<FamilyLevel>,
    /// The index of the rank's group ([`crate::LayoutPlan::group_at`] numbering): the colour
    /// passed to a split, or which group a creation makes (`None`: the rank is in no group of
    /// these families and passes no colour).
    pub colour: Option<usize>,
    /// The key passed to the split: the rank's world rank (`None` for other calls).
    pub key: Option<usize>,
    /// How many ranks take part in the call.
    pub participants: usize,
    /// The communicator the call gives this rank, if any.
    pub communicator: Option<CommInfo>,
}

/// One rank's initialisation plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankInitPlan {
    /// The rank (world rank).
    pub rank: usize,
    /// The creation strategy.
    pub creation: Creation,
    /// Ranks of the parent communicator (the plan's world).
    pub parent_size: usize,
    /// The collective calls, in order.
    pub calls: Vec<InitCall>,
    /// Communicators this rank creates.
    pub communicators: usize,
    /// Family levels served by those communicators.
    pub families_served: usize,
    /// Collective calls this rank makes (the length of `calls`).
    pub collective_calls: usize,
}

/// Smallest, largest and total of a per-rank count, with a rank where each extreme occurs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Spread {
    /// Smallest value.
    pub min: usize,
    /// The first rank with the smallest value.
    pub min_rank: usize,
    /// Largest value.
    pub max: usize,
    /// The first rank with the largest value.
    pub max_rank: usize,
    /// Sum over all ranks.
    pub total: u64,
}

impl Spread {
    fn one(rank: usize, v: usize) -> Spread {
        Spread {
            min: v,
            min_rank: rank,
            max: v,
            max_rank: rank,
            total: v as u64,
        }
    }
    fn merge(a: Spread, b: Spread) -> Spread {
        let (min, min_rank) = if (b.min, b.min_rank) < (a.min, a.min_rank) {
            (b.min, b.min_rank)
        } else {
            (a.min, a.min_rank)
        };
        let (max, max_rank) = if b.max > a.max || (b.max == a.max && b.max_rank < a.max_rank) {
            (b.max, b.max_rank)
        } else {
            (a.max, a.max_rank)
        };
        Spread {
            min,
            min_rank,
            max,
            max_rank,
            total: a.total + b.total,
        }
    }
}

/// Per shared communicator, over the whole world.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SharedCommSummary {
    /// The families served, the creating one first.
    #[serde(serialize_with = "family_names")]
    pub families: Vec<FamilyLevel>,
    /// Number of groups (communicators in the world).
    pub groups: usize,
    /// Ranks that get one of these communicators (the sum of the group sizes).
    pub members: usize,
    /// The size of every group, when they all have one size.
    pub group_size: Option<usize>,
}

/// The initialisation plan summed over every rank of the world.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InitSummary {
    /// Ranks of the plan.
    pub world_size: usize,
    /// First rank.
    pub rank_offset: usize,
    /// The creation strategy.
    pub creation: Creation,
    /// Family levels of the plan.
    pub family_levels: usize,
    /// The communicator kinds, in creation order.
    pub shared: Vec<SharedCommSummary>,
    /// Communicators per rank.
    pub communicators: Spread,
    /// Collective calls per rank.
    pub calls: Spread,
    /// Communicators in the whole world (each counted once, not once per member).
    pub world_communicators: u64,
}

/// What [`verify_plan`] checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VerifyReport {
    /// Ranks simulated.
    pub ranks: usize,
    /// The creation strategy checked.
    pub creation: Creation,
    /// Collective calls per rank (min, max): equal under [`Creation::Split`].
    pub calls_per_rank: (usize, usize),
    /// Distinct families whose colours were checked to partition the parent as the groups say.
    pub splits_checked: usize,
    /// Families served by another family's communicator, checked to have identical groups.
    pub shared_checked: usize,
    /// (rank, family level) memberships checked.
    pub memberships_checked: u64,
}

/// The initialisation plan of a layout; see the module documentation.
#[derive(Debug, Clone)]
pub struct InitPlan<'a> {
    plan: &'a LayoutPlan,
    creation: Creation,
    shared: Vec<SharedComm>,
}

impl<'a> InitPlan<'a> {
    /// Groups the plan's families as [`crate::build_collection`] does: in Megatron's creation
    /// order, a family with the same [`LayoutPlan::group_signature`] as an earlier one shares
    /// its communicator. Fails if a colour would not fit the 32 bits of a split's colour.
    pub fn new(plan: &'a LayoutPlan, creation: Creation) -> Result<InitPlan<'a>> {
        let mut shared: Vec<SharedComm> = Vec::new();
        let mut by_sig: HashMap<GroupSignature, usize> = HashMap::new();
        for fl in plan.family_levels() {
            let sig = plan.group_signature(fl)?;
            if let Some(&i) = by_sig.get(&sig) {
                shared[i].families.push(fl);
                continue;
            }
            let groups = plan.num_groups(fl)?;
            if groups > 1usize << 32 {
                return Err(Error::Invalid(format!(
                    "{fl} has {groups} groups: a split colour is 32 bits, so at most {} groups can be created",
                    1u64 << 32
                )));
            }
            by_sig.insert(sig, shared.len());
            shared.push(SharedComm {
                families: vec![fl],
                groups,
            });
        }
        Ok(InitPlan {
            plan,
            creation,
            shared,
        })
    }

    /// The layout plan.
    pub fn plan(&self) -> &LayoutPlan {
        self.plan
    }

    /// The creation strategy.
    pub fn creation(&self) -> Creation {
        self.creation
    }

    /// The communicator kinds, in creation order (one split each under [`Creation::Split`]).
    pub fn shared(&self) -> &[SharedComm] {
        &self.shared
    }

    /// The colour of `rank` in each shared communicator (`None`: in no group), in order.
    fn colours(&self, rank: usize) -> Result<Vec<Option<usize>>> {
        self.shared
            .iter()
            .map(|s| self.plan.group_index_of(s.creator(), rank))
            .collect()
    }

    /// The plan of one rank: its calls in order, with colours, keys and communicators.
    /// O(families × dimensions): milliseconds at a million ranks.
    pub fn rank(&self, rank: usize) -> Result<RankInitPlan> {
        let plan = self.plan;
        if !plan.contains(rank) {
            let first = plan.rank_offset();
            return Err(Error::RankOutOfRange {
                rank,
                first,
                end: first + plan.world_size(),
            });
        }
        let world = plan.world_size();
        let mut calls = vec![InitCall {
            index: 0,
            op: CallOp::PlanCheck,
            families: Vec::new(),
            colour: None,
            key: None,
            participants: world,
            communicator: None,
        }];
        let (mut communicators, mut families_served) = (0, 0);
        for s in &self.shared {
            let colour = plan.group_index_of(s.creator(), rank)?;
            let communicator = match colour {
                Some(c) => {
                    let g = plan.group_at(s.creator(), c)?;
                    let group_rank = g.group_rank(rank).ok_or_else(|| {
                        Error::Invalid(format!(
                            "{}: rank {rank} has colour {c}, but group {c} ({g}) does not hold it",
                            s.creator()
                        ))
                    })?;
                    Some(CommInfo {
                        size: g.len(),
                        group_rank,
                    })
                }
                None => None,
            };
            if communicator.is_some() {
                communicators += 1;
                families_served += s.families.len();
            }
            let call = match self.creation {
                Creation::Split => InitCall {
                    index: calls.len(),
                    op: CallOp::Split,
                    families: s.families.clone(),
                    colour,
                    key: Some(rank),
                    participants: world,
                    communicator,
                },
                Creation::MembersOnly => match communicator {
                    Some(c) => InitCall {
                        index: calls.len(),
                        op: CallOp::Create,
                        families: s.families.clone(),
                        colour,
                        key: None,
                        participants: c.size,
                        communicator,
                    },
                    None => continue,
                },
            };
            calls.push(call);
        }
        Ok(RankInitPlan {
            rank,
            creation: self.creation,
            parent_size: world,
            collective_calls: calls.len(),
            calls,
            communicators,
            families_served,
        })
    }

    /// The plan summed over every rank (in parallel): communicators and calls per rank (min,
    /// max, total) and, per shared communicator, the groups and members in the world.
    pub fn summary(&self) -> Result<InitSummary> {
        let plan = self.plan;
        let first = plan.rank_offset();
        let n = self.shared.len();
        type Acc = (Option<(Spread, Spread)>, Vec<usize>);
        let fold = |mut acc: Acc, rank: usize| -> Result<Acc> {
            let colours = self.colours(rank)?;
            let mut comms = 0;
            for (i, c) in colours.iter().enumerate() {
                if c.is_some() {
                    comms += 1;
                    acc.1[i] += 1;
                }
            }
            let calls = match self.creation {
                Creation::Split => 1 + n,
                Creation::MembersOnly => 1 + comms,
            };
            let here = (Spread::one(rank, comms), Spread::one(rank, calls));
            acc.0 = Some(match acc.0 {
                None => here,
                Some((a, b)) => (Spread::merge(a, here.0), Spread::merge(b, here.1)),
            });
            Ok(acc)
        };
        let merge = |a: Acc, b: Acc| -> Acc {
            let spreads = match (a.0, b.0) {
                (Some(x), Some(y)) => Some((Spread::merge(x.0, y.0), Spread::merge(x.1, y.1))),
                (x, None) => x,
                (None, y) => y,
            };
            let members = a.1.iter().zip(&b.1).map(|(x, y)| x + y).collect();
            (spreads, members)
        };
        let (spreads, members) = (first..first + plan.world_size())
            .into_par_iter()
            .try_fold(|| (None, vec![0usize; n]), fold)
            .try_reduce(|| (None, vec![0usize; n]), |a, b| Ok(merge(a, b)))?;
        let (communicators, calls) = spreads
            .ok_or_else(|| Error::Invalid("the plan has no rank to summarise".to_string()))?;
        let mut shared = Vec::with_capacity(n);
        let mut world_communicators = 0u64;
        for (s, &m) in self.shared.iter().zip(&members) {
            let size0 = plan.group_at(s.creator(), 0)?.len();
            world_communicators += s.groups as u64;
            shared.push(SharedCommSummary {
                families: s.families.clone(),
                groups: s.groups,
                members: m,
                group_size: (size0 as u128 * s.groups as u128 == m as u128
                    && self.uniform_sizes(s)?)
                .then_some(size0),
            });
        }
        Ok(InitSummary {
            world_size: plan.world_size(),
            rank_offset: first,
            creation: self.creation,
            family_levels: plan.family_levels().len(),
            shared,
            communicators,
            calls,
            world_communicators,
        })
    }

    /// True when every group of `s` has the size of group 0. Only embedding groups can differ
    /// (a custom rule); the others are translates of one lattice.
    fn uniform_sizes(&self, s: &SharedComm) -> Result<bool> {
        let fl = s.creator();
        if !matches!(
            fl.family,
            crate::plan::Family::Embd | crate::plan::Family::PosEmbd
        ) {
            return Ok(true);
        }
        let size0 = self.plan.group_at(fl, 0)?.len();
        (0..s.groups)
            .into_par_iter()
            .map(|i| Ok(self.plan.group_at(fl, i)?.len() == size0))
            .try_reduce(|| true, |a, b| Ok(a && b))
    }
}

/// Checks, on a simulated world, that the initialisation of `plan` is consistent for every
/// rank, in parallel, without creating any communicator:
///
/// 1. **Matching call sequences.** Every rank's sequence of collective calls (computed from its
///    own rank alone, as the rank itself would) is compared: under [`Creation::Split`] every rank
///    makes the same number of calls, of the same kinds, for the same families, in the same
///    order, each over the whole parent; under [`Creation::MembersOnly`] every rank creates its
///    communicators in the plan's one global order (so two ranks never wait on each other's
///    groups in opposite orders), and each creation has as many participants as its group.
/// 2. **Colours partition the parent as the groups say.** For every distinct family, every
///    member of group `c` (enumerated from the plan's group list) computes colour `c` on its
///    own, no rank is in two groups, and the groups hold exactly the ranks that pass a colour.
///    With key = world rank, each communicator's ranks are its members sorted, as torch numbers
///    them.
/// 3. **Shared communicators serve identical groups.** Every family that reuses an earlier
///    family's communicator has, on every rank, the same members as that communicator.
///
/// Costs O(world × families × dimensions); an inconsistency is an error naming the rank, the
/// family and what differs.
pub fn verify_plan(plan: &LayoutPlan, creation: Creation) -> Result<VerifyReport> {
    let init = InitPlan::new(plan, creation)?;
    let first = plan.rank_offset();
    let world = plan.world_size();
    let end = first + world;

    // 1. Call sequences.
    let reference = init.rank(first)?;
    let shape = |p: &RankInitPlan| -> Vec<(CallOp, Vec<FamilyLevel>, usize)> {
        p.calls
            .iter()
            .map(|c| (c.op, c.families.clone(), c.participants))
            .collect()
    };
    let ref_shape = shape(&reference);
    let position: HashMap<FamilyLevel, usize> = init
        .shared
        .iter()
        .enumerate()
        .map(|(i, s)| (s.creator(), i))
        .collect();
    let (min_calls, max_calls) = (first..end)
        .into_par_iter()
        .map(|rank| -> Result<(usize, usize)> {
            let p = init.rank(rank)?;
            match creation {
                Creation::Split => {
                    let mine = shape(&p);
                    if mine != ref_shape {
                        let at = mine
                            .iter()
                            .zip(&ref_shape)
                            .position(|(a, b)| a != b)
                            .unwrap_or(mine.len().min(ref_shape.len()));
                        return Err(Error::Invalid(format!(
                            "rank {rank} makes {} collective calls and rank {first} makes {}; they first differ at call {at}",
                            mine.len(),
                            ref_shape.len()
                        )));
                    }
                }
                Creation::MembersOnly => {
                    let mut last: Option<usize> = None;
                    for c in &p.calls[1..] {
                        let i = c
                            .families
                            .first()
                            .and_then(|f| position.get(f))
                            .copied()
                            .ok_or_else(|| {
                                Error::Invalid(format!(
                                    "rank {rank}: call {} creates a communicator of no known family",
                                    c.index
                                ))
                            })?;
                        if last.is_some_and(|l| l >= i) {
                            return Err(Error::Invalid(format!(
                                "rank {rank}: call {} ({}) is out of the plan's creation order",
                                c.index, c.families[0]
                            )));
                        }
                        last = Some(i);
                        let size = c.communicator.map_or(0, |m| m.size);
                        if c.participants != size {
                            return Err(Error::Invalid(format!(
                                "rank {rank}: call {} ({}) has {} participants for a group of {size}",
                                c.index, c.families[0], c.participants
                            )));
                        }
                    }
                }
            }
            Ok((p.collective_calls, p.collective_calls))
        })
        .try_reduce(|| (usize::MAX, 0), |a, b| Ok((a.0.min(b.0), a.1.max(b.1))))?;

    // 2. and 3. Partitions, one family level at a time (each in parallel over its groups).
    let mut memberships = 0u64;
    let mut shared_checked = 0;
    for s in &init.shared {
        let creator = s.creator();
        memberships += check_partition(plan, creator, None)?;
        for &fl in &s.families[1..] {
            memberships += check_partition(plan, fl, Some((creator, s.groups)))?;
            shared_checked += 1;
        }
    }
    Ok(VerifyReport {
        ranks: world,
        creation,
        calls_per_rank: (min_calls, max_calls),
        splits_checked: init.shared.len(),
        shared_checked,
        memberships_checked: memberships,
    })
}

/// Checks that the groups of `fl` (from [`LayoutPlan::group_at`]) are disjoint and hold exactly
/// the ranks whose own colour computation puts them there. With `against = Some((creator,
/// groups))`, the colours are those of `creator`'s communicator, which `fl` reuses: each group of
/// `fl` must be exactly one group of `creator`. Returns the number of memberships checked.
fn check_partition(
    plan: &LayoutPlan,
    fl: FamilyLevel,
    against: Option<(FamilyLevel, usize)>,
) -> Result<u64> {
    let first = plan.rank_offset();
    let world = plan.world_size();
    let n = plan.num_groups(fl)?;
    let seen: Vec<std::sync::atomic::AtomicBool> = (0..world)
        .map(|_| std::sync::atomic::AtomicBool::new(false))
        .collect();
    let colour_family = against.map_or(fl, |(c, _)| c);
    let members: usize = (0..n)
        .into_par_iter()
        .map(|c| -> Result<usize> {
            let g = plan.group_at(fl, c)?;
            let mut ranks = Vec::with_capacity(g.len());
            g.extend_into(&mut ranks);
            let mut expected: Option<usize> = None;
            for &m in &ranks {
                let slot = m
                    .checked_sub(first)
                    .and_then(|i| seen.get(i))
                    .ok_or_else(|| {
                        Error::Invalid(format!(
                            "{fl}: group {c} holds rank {m}, outside the plan's ranks {first}..{}",
                            first + world
                        ))
                    })?;
                if slot.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    return Err(Error::Invalid(format!(
                        "{fl}: rank {m} is in group {c} and in another group (or twice in group {c})"
                    )));
                }
                let colour = plan.group_index_of(colour_family, m)?;
                match against {
                    None => {
                        if colour != Some(c) {
                            return Err(Error::Invalid(format!(
                                "{fl}: rank {m} is a member of group {c} but computes colour {}",
                                colour.map_or("none".to_string(), |x| x.to_string())
                            )));
                        }
                    }
                    Some((creator, _)) => {
                        let Some(colour) = colour else {
                            return Err(Error::Invalid(format!(
                                "{fl} reuses {creator}'s communicator, but rank {m} of {fl} group {c} is in no {creator} group"
                            )));
                        };
                        match expected {
                            None => expected = Some(colour),
                            Some(e) if e != colour => {
                                return Err(Error::Invalid(format!(
                                    "{fl} reuses {creator}'s communicator, but {fl} group {c} spans {creator} groups {e} and {colour}"
                                )))
                            }
                            Some(_) => {}
                        }
                    }
                }
            }
            if let (Some((creator, _)), Some(e)) = (against, expected) {
                let size = plan.group_at(creator, e)?.len();
                if size != ranks.len() {
                    return Err(Error::Invalid(format!(
                        "{fl} reuses {creator}'s communicator, but {fl} group {c} has {} members and {creator} group {e} has {size}",
                        ranks.len()
                    )));
                }
            }
            Ok(ranks.len())
        })
        .try_reduce(|| 0, |a, b| Ok(a + b))?;
    // Every rank that passes a colour must be in one of the groups: count the coloured ranks.
    let coloured = (first..first + world)
        .into_par_iter()
        .map(|r| -> Result<usize> {
            Ok(usize::from(
                plan.group_index_of(colour_family, r)?.is_some(),
            ))
        })
        .try_reduce(|| 0, |a, b| Ok(a + b))?;
    if coloured != members {
        let what = match against {
            None => format!("{fl}: {coloured} ranks pass a colour"),
            Some((creator, _)) => {
                format!("{creator}'s communicator (reused by {fl}) has {coloured} members")
            }
        };
        return Err(Error::Invalid(format!(
            "{what}, but the {n} groups of {fl} hold {members} ranks"
        )));
    }
    Ok(members as u64)
}
