//! One rank's view of a plan: its coordinates and its group in every family.

use crate::collection::ProcessGroupCollection;
use crate::error::{Error, Result};
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
    /// The virtual pipeline world size of the plan (`None` without `vpp`).
    vpp: Option<usize>,
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
            vpp: self.virtual_pipeline_size(),
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
    /// The virtual pipeline world size (Megatron's
    /// `get_virtual_pipeline_model_parallel_world_size()`): the number of model chunks each
    /// pipeline stage holds, `None` without `vpp`.
    pub fn virtual_pipeline_size(&self) -> Option<usize> {
        self.vpp
    }

    /// The virtual stage check shared by the first/last-stage questions: `Ok(None)` when the
    /// virtual stage does not matter, `Ok(Some(stage))` when it does.
    fn vp_stage(
        &self,
        function: &'static str,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<Option<usize>> {
        if ignore_virtual {
            return Ok(None);
        }
        match (self.vpp, vp_stage) {
            (None, None | Some(0)) => Ok(None),
            (None, Some(s)) => Err(Error::VpStage {
                function,
                problem: format!(
                    "vp_stage {s} was given but the layout has no virtual pipeline (vpp); pass \
                     no vp_stage, or 0"
                ),
            }),
            (Some(v), None) => Err(Error::VpStage {
                function,
                problem: format!(
                    "vp_stage must be passed if virtual pipeline is enabled (vpp = {v}; valid \
                     vp_stage: 0..={})",
                    v - 1
                ),
            }),
            (Some(v), Some(s)) if s >= v => Err(Error::VpStage {
                function,
                problem: format!(
                    "vp_stage {s} is out of range for vpp = {v} (valid vp_stage: 0..={})",
                    v - 1
                ),
            }),
            (Some(_), Some(s)) => Ok(Some(s)),
        }
    }

    /// Megatron's `is_pipeline_first_stage(ignore_virtual, vp_stage)`: with `ignore_virtual`
    /// (Megatron's default) or without `vpp`, true on the first physical stage; otherwise true
    /// only on the first physical stage **and** the first model chunk (`vp_stage == 0`).
    ///
    /// Errors where Megatron asserts (`vp_stage` missing while `vpp` is set and virtual stages
    /// count) and where Megatron silently answers `false` for a stage that does not exist
    /// (`vp_stage >= vpp`, or `vp_stage > 0` without `vpp`, which Megatron's newer
    /// `is_vp_first_stage` rejects too): [`Error::VpStage`]. With `ignore_virtual`, `vp_stage`
    /// is not looked at, as in Megatron.
    ///
    /// ```
    /// use grid_core::{LayoutConfig, LayoutPlan};
    /// let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 4, vpp: Some(2), ..LayoutConfig::new(16) })?;
    /// let first = plan.rank_view(1)?; // pipeline [1, 5, 9, 13], stage 0
    /// assert!(first.is_pipeline_first_stage(true, None)?);
    /// assert!(first.is_pipeline_first_stage(false, Some(0))?);
    /// assert!(!first.is_pipeline_first_stage(false, Some(1))?);
    /// assert!(first.is_pipeline_first_stage(false, None).is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn is_pipeline_first_stage(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool> {
        let stage = self.vp_stage("is_pipeline_first_stage", ignore_virtual, vp_stage)?;
        Ok(stage.map_or(self.is_first_stage, |c| self.first_in_chunk(c)))
    }

    /// Megatron's `is_pipeline_last_stage(ignore_virtual, vp_stage)`: with `ignore_virtual` or
    /// without `vpp`, true on the last physical stage; otherwise true only on the last physical
    /// stage **and** the last model chunk (`vp_stage == vpp - 1`). Errors as
    /// [`RankView::is_pipeline_first_stage`].
    ///
    /// ```
    /// use grid_core::{LayoutConfig, LayoutPlan};
    /// let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 4, vpp: Some(2), ..LayoutConfig::new(16) })?;
    /// let last = plan.rank_view(13)?; // pipeline [1, 5, 9, 13], stage 3
    /// assert!(last.is_pipeline_last_stage(true, None)?);
    /// assert!(!last.is_pipeline_last_stage(false, Some(0))?);
    /// assert!(last.is_pipeline_last_stage(false, Some(1))?);
    /// assert!(last.is_pipeline_last_stage(false, Some(2)).is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn is_pipeline_last_stage(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool> {
        let stage = self.vp_stage("is_pipeline_last_stage", ignore_virtual, vp_stage)?;
        Ok(stage.map_or(self.is_last_stage, |c| self.last_in_chunk(c)))
    }

    /// Megatron's `is_rank_in_embedding_group(ignore_virtual, vp_stage)`: with `ignore_virtual`,
    /// whether the rank is in its pipeline's embedding group. Otherwise a member that is the
    /// group's **first** listed rank answers [`RankView::is_pipeline_first_stage`]`(false,
    /// vp_stage)`, one that is its **last** listed rank answers
    /// [`RankView::is_pipeline_last_stage`]`(false, vp_stage)` (the first test wins when the
    /// group has one rank), any other member (a custom rule's middle stage) answers true, and
    /// a non-member false. With the default rule and `vpp`, the first stage's embedding lives
    /// in chunk 0 and the last stage's in chunk `vpp - 1`.
    ///
    /// Errors as [`RankView::is_pipeline_first_stage`] when the answer depends on `vp_stage`;
    /// a non-member or middle member answers without looking at it, as in Megatron.
    ///
    /// ```
    /// use grid_core::{LayoutConfig, LayoutPlan};
    /// let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 4, vpp: Some(2), ..LayoutConfig::new(16) })?;
    /// let last = plan.rank_view(13)?; // embedding group [1, 13]
    /// assert!(last.is_rank_in_embedding_group(true, None)?);
    /// assert!(!last.is_rank_in_embedding_group(false, Some(0))?);
    /// assert!(last.is_rank_in_embedding_group(false, Some(1))?);
    /// assert!(!plan.rank_view(5)?.is_rank_in_embedding_group(false, Some(0))?);
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn is_rank_in_embedding_group(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool> {
        let Some(g) = self.group(Family::Embd) else {
            return Ok(false);
        };
        if ignore_virtual {
            return Ok(true);
        }
        if self.rank == g.first() {
            self.is_pipeline_first_stage(false, vp_stage)
        } else if self.rank == g.last() {
            self.is_pipeline_last_stage(false, vp_stage)
        } else {
            Ok(true)
        }
    }

    /// Megatron's `is_rank_in_position_embedding_group()`: whether the rank is in its
    /// pipeline's position-embedding group. Megatron's function takes no virtual-pipeline
    /// arguments, so neither does this one (the same answer as
    /// [`RankView::in_position_embedding_group`]).
    pub fn is_rank_in_position_embedding_group(&self) -> bool {
        self.in_position_embedding_group()
    }

    /// Chunk `c` (a valid `vp_stage`, or 0 without `vpp`) is on the virtual first stage.
    fn first_in_chunk(&self, c: usize) -> bool {
        c == 0 && self.is_first_stage
    }
    /// Chunk `c` is on the virtual last stage.
    fn last_in_chunk(&self, c: usize) -> bool {
        c + 1 == self.vpp.unwrap_or(1) && self.is_last_stage
    }
    /// Chunk `c` holds the embedding: [`RankView::is_rank_in_embedding_group`]`(false, c)`.
    fn embedding_in_chunk(&self, c: usize) -> bool {
        match self.group(Family::Embd) {
            None => false,
            Some(g) if self.rank == g.first() => self.first_in_chunk(c),
            Some(g) if self.rank == g.last() => self.last_in_chunk(c),
            Some(_) => true,
        }
    }
    /// The chunks `0..vpp` (just 0 without `vpp`) for which `f` holds.
    fn chunks_where(&self, f: impl Fn(&Self, usize) -> bool) -> Vec<usize> {
        (0..self.vpp.unwrap_or(1)).filter(|&c| f(self, c)).collect()
    }

    /// The model chunks of this rank that sit on the virtual first stage: `[0]` on the first
    /// physical stage, `[]` elsewhere (what `grid layout --vpp N --rank R` prints).
    pub fn first_stage_chunks(&self) -> Vec<usize> {
        self.chunks_where(Self::first_in_chunk)
    }

    /// The model chunks of this rank that sit on the virtual last stage: `[vpp - 1]` (`[0]`
    /// without `vpp`) on the last physical stage, `[]` elsewhere.
    pub fn last_stage_chunks(&self) -> Vec<usize> {
        self.chunks_where(Self::last_in_chunk)
    }

    /// The model chunks for which [`RankView::is_rank_in_embedding_group`]`(false, chunk)` is
    /// true.
    pub fn embedding_chunks(&self) -> Vec<usize> {
        self.chunks_where(Self::embedding_in_chunk)
    }

    /// The view as a collection of arithmetic groups: every group of the rank, the counterpart
    /// of Megatron's `parallel_state` globals that [`crate::use_mpu_process_groups`] picks from.
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
