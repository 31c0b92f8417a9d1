//! One rank's view of a plan: its coordinates and its group in every family.

use crate::collection::ProcessGroupCollection;
use crate::error::Result;
use crate::group::Group;
use crate::plan::{Family, FamilyLevel, LayoutPlan};
use serde::Serialize;

/// A rank's coordinates in the dense and expert grids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Coords {
    /// Tensor-parallel coordinate (dense grid).
    pub tp: usize,
    /// Context-parallel coordinate.
    pub cp: usize,
    /// Data-parallel coordinate.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Expert-parallel coordinate (expert grid).
    pub ep: usize,
    /// Expert tensor-parallel coordinate.
    pub expt_tp: usize,
    /// Expert data-parallel coordinate.
    pub expt_dp: usize,
}

/// Everything one rank needs from a plan, computed without enumerating the world: its
/// coordinates, its group in every family (arithmetic [`Group`]s, so memory does not grow with
/// the world size), and the pipeline neighbours.
///
/// ```
/// use grid_core::{LayoutConfig, LayoutPlan, Family};
/// let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 2, ..LayoutConfig::new(8) }).unwrap();
/// let v = plan.rank_view(5).unwrap();
/// assert_eq!(v.group(Family::Tp).unwrap().to_vec(), vec![4, 5]);
/// assert_eq!(v.group(Family::Pp).unwrap().to_vec(), vec![1, 5]);
/// assert_eq!((v.pp_next, v.pp_prev, v.is_last_stage), (1, 1, true));
/// ```
#[derive(Debug, Clone)]
pub struct RankView {
    /// The rank.
    pub rank: usize,
    /// Its coordinates.
    pub coords: Coords,
    groups: [Option<Group>; Family::ALL.len()],
    hcp: Option<Vec<Group>>,
    /// Next pipeline rank (wraps from the last stage to the first, as Megatron's getter does).
    pub pp_next: usize,
    /// Previous pipeline rank (wraps).
    pub pp_prev: usize,
    /// Pipeline stage 0.
    pub is_first_stage: bool,
    /// Last pipeline stage.
    pub is_last_stage: bool,
}

impl LayoutPlan {
    /// The view of `rank`: O(families × dimensions), independent of the world size.
    pub fn rank_view(&self, rank: usize) -> Result<RankView> {
        let d = self.dense();
        let x = self.expert();
        let coords = Coords {
            tp: d.coord(rank, "tp")?,
            cp: d.coord(rank, "cp")?,
            dp: d.coord(rank, "dp")?,
            pp: d.coord(rank, "pp")?,
            ep: x.coord(rank, "ep")?,
            expt_tp: x.coord(rank, "tp")?,
            expt_dp: x.coord(rank, "dp")?,
        };
        let mut groups: [Option<Group>; Family::ALL.len()] = Default::default();
        let mut hcp: Option<Vec<Group>> = None;
        for fl in self.family_levels() {
            let g = self.group_of(fl, rank)?;
            if fl.family == Family::Hcp {
                if let Some(g) = g {
                    hcp.get_or_insert_with(Vec::new).push(g);
                }
            } else {
                groups[fl.family as usize] = g;
            }
        }
        let (n, pos, pp_next, pp_prev) = {
            let pp = groups[Family::Pp as usize].as_ref();
            let (n, pos) = match pp {
                Some(p) => (p.len(), p.position(rank).unwrap_or(0)),
                None => (1, 0),
            };
            let at = |i: usize| pp.map_or(rank, |p| p.get(i));
            (n, pos, at((pos + 1) % n), at((pos + n - 1) % n))
        };
        Ok(RankView {
            rank,
            coords,
            groups,
            hcp,
            pp_next,
            pp_prev,
            is_first_stage: pos == 0,
            is_last_stage: pos + 1 == n,
        })
    }
}

impl RankView {
    /// The rank's group in `family`, or `None` if it belongs to none (`embd`, `pos_embd`) or
    /// the plan has no such family (`inter_dist_opt` with one instance, `hcp`: see
    /// [`RankView::hcp`]).
    pub fn group(&self, family: Family) -> Option<&Group> {
        self.groups[family as usize].as_ref()
    }
    /// The hierarchical context-parallel groups, one per level.
    pub fn hcp(&self) -> Option<&[Group]> {
        self.hcp.as_deref()
    }
    /// The group of a family level.
    pub fn group_at_level(&self, fl: FamilyLevel) -> Option<&Group> {
        if fl.family == Family::Hcp {
            self.hcp.as_ref().and_then(|h| h.get(fl.level))
        } else {
            self.group(fl.family)
        }
    }
    /// The rank's group rank in `family` (its index in the sorted member list, as torch
    /// reports it).
    pub fn group_rank(&self, family: Family) -> Option<usize> {
        self.group(family).and_then(|g| g.group_rank(self.rank))
    }
    /// True if the rank is in its pipeline's embedding group.
    pub fn in_embedding_group(&self) -> bool {
        self.group(Family::Embd).is_some()
    }
    /// True if the rank is in its pipeline's position-embedding group.
    pub fn in_position_embedding_group(&self) -> bool {
        self.group(Family::PosEmbd).is_some()
    }
    /// The view as a collection of arithmetic groups (Megatron's `use_mpu_process_groups`).
    pub fn collection(&self) -> ProcessGroupCollection<Group> {
        let mut c = ProcessGroupCollection::new();
        for f in Family::ALL {
            if let Some(g) = self.group(f) {
                c.set_family(f, g.clone());
            }
        }
        if let Some(h) = &self.hcp {
            c.hcp = Some(h.clone());
        }
        c
    }
}
