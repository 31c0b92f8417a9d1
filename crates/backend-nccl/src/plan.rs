//! Split planning: the colour and key each rank passes to `ncclCommSplit`, and which members
//! the new communicator has. Pure arithmetic, tested on CPU.
//!
//! `ncclCommSplit(parent, color, key)` puts ranks of equal `color` in one new communicator,
//! ordered by `(key, parent rank)`; `NCCL_SPLIT_NOCOLOR` (-1) opts out. NCCL does not tell a rank
//! who its new peers are, so [`crate::NcclFactory`] all-gathers each rank's
//! [`SplitEntry`] over the parent first and computes the member list with [`split_members`].

use grid_core::{Error, Group, Result};
use std::ffi::c_int;

/// One parent rank's arguments to a split, plus its world rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitEntry {
    /// Colour (`None`: takes part, gets no communicator).
    pub color: Option<u32>,
    /// Ordering key.
    pub key: usize,
    /// World rank of this parent rank.
    pub world_rank: usize,
}

impl SplitEntry {
    /// The three integers all-gathered for this entry (`color` is -1 for `None`).
    pub fn encode(&self) -> [i64; 3] {
        [
            self.color.map_or(-1, i64::from),
            self.key as i64,
            self.world_rank as i64,
        ]
    }

    /// Decodes the all-gathered integers of every parent rank.
    ///
    /// ```
    /// use backend_nccl::plan::SplitEntry;
    /// let e = SplitEntry { color: Some(3), key: 1, world_rank: 9 };
    /// let n = SplitEntry { color: None, key: 0, world_rank: 4 };
    /// let flat: Vec<i64> = [e.encode(), n.encode()].concat();
    /// assert_eq!(SplitEntry::decode_all(&flat).unwrap(), vec![e, n]);
    /// ```
    pub fn decode_all(flat: &[i64]) -> Result<Vec<SplitEntry>> {
        if !flat.len().is_multiple_of(3) {
            return Err(Error::Invalid(format!(
                "split: {} integers do not form (color, key, rank) triples",
                flat.len()
            )));
        }
        flat.chunks_exact(3)
            .map(|c| {
                let color = match c[0] {
                    -1 => None,
                    v => Some(
                        u32::try_from(v)
                            .map_err(|_| Error::Invalid(format!("split: received colour {v}")))?,
                    ),
                };
                let key = usize::try_from(c[1])
                    .map_err(|_| Error::Invalid(format!("split: received key {}", c[1])))?;
                let world_rank = usize::try_from(c[2])
                    .map_err(|_| Error::Invalid(format!("split: received rank {}", c[2])))?;
                Ok(SplitEntry {
                    color,
                    key,
                    world_rank,
                })
            })
            .collect()
    }
}

/// The communicator a rank gets from a split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMembers {
    /// World ranks of the members in new-communicator rank order.
    pub members: Vec<usize>,
    /// This rank's rank in the new communicator.
    pub rank: usize,
}

/// The members of the communicator parent rank `me` gets, from every parent rank's entry (index
/// = parent rank): ranks of `me`'s colour ordered by `(key, parent rank)`, as `ncclCommSplit`
/// and `MPI_Comm_split` order them. `None` when `me` passed no colour.
///
/// ```
/// use backend_nccl::plan::{split_members, SplitEntry};
/// let e = |color, key, world_rank| SplitEntry { color, key, world_rank };
/// let all = [e(Some(1), 0, 10), e(Some(2), 0, 11), e(Some(1), 0, 12), e(None, 0, 13)];
/// let m = split_members(&all, 2).unwrap();
/// assert_eq!((m.members, m.rank), (vec![10, 12], 1));
/// assert!(split_members(&all, 3).is_none());
/// ```
pub fn split_members(entries: &[SplitEntry], me: usize) -> Option<SplitMembers> {
    let color = entries.get(me)?.color?;
    let mut same: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.color == Some(color))
        .map(|(p, e)| (e.key, p))
        .collect();
    same.sort_unstable();
    let rank = same.iter().position(|&(_, p)| p == me)?;
    Some(SplitMembers {
        members: same.iter().map(|&(_, p)| entries[p].world_rank).collect(),
        rank,
    })
}

/// The colour and key that put `world_rank` in `group`: colour = the group's smallest member
/// (unique per group of a family, the same on every member), key = the world rank (so new
/// ranks ascend with world ranks, as grid-core's `rank()` is defined). `None` (no colour) when
/// the rank is not a member.
///
/// ```
/// use backend_nccl::plan::color_key_for;
/// use grid_core::Group;
/// let g = Group::strided(1, 4, 2); // ranks 1 3 5 7
/// assert_eq!(color_key_for(Some(&g), 5), (Some(1), 5));
/// assert_eq!(color_key_for(Some(&g), 4), (None, 4));
/// assert_eq!(color_key_for(None, 4), (None, 4));
/// ```
pub fn color_key_for(group: Option<&Group>, world_rank: usize) -> (Option<u32>, usize) {
    let color = group
        .filter(|g| g.contains(world_rank))
        .and_then(|g| g.iter().min())
        .and_then(|m| u32::try_from(m).ok());
    (color, world_rank)
}

/// The `color` argument of `ncclCommSplit`: `None` → `NCCL_SPLIT_NOCOLOR`; colours must fit a
/// non-negative C `int`.
pub(crate) fn nccl_color(color: Option<u32>) -> Result<Option<c_int>> {
    match color {
        None => Ok(None),
        Some(c) => c_int::try_from(c).map(Some).map_err(|_| {
            Error::Invalid(format!(
                "split: colour {c} is too large for NCCL (valid: 0..={})",
                c_int::MAX
            ))
        }),
    }
}

/// The `key` argument of `ncclCommSplit`.
pub(crate) fn nccl_key(key: usize) -> Result<c_int> {
    c_int::try_from(key).map_err(|_| {
        Error::Invalid(format!(
            "split: key {key} is too large for NCCL (valid: 0..={})",
            c_int::MAX
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use grid_core::HyperGrid;

    #[test]
    fn colours_and_keys_fit_nccl() {
        assert_eq!(nccl_color(None).unwrap(), None);
        assert_eq!(nccl_color(Some(7)).unwrap(), Some(7));
        assert_eq!(
            nccl_color(Some(u32::MAX)).unwrap_err().to_string(),
            "split: colour 4294967295 is too large for NCCL (valid: 0..=2147483647)"
        );
        assert_eq!(nccl_key(3).unwrap(), 3);
        assert!(nccl_key(usize::MAX).is_err());
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(SplitEntry::decode_all(&[1, 2]).is_err());
        assert!(SplitEntry::decode_all(&[-5, 0, 0]).is_err());
        assert!(SplitEntry::decode_all(&[0, -1, 0]).is_err());
    }

    #[test]
    fn key_orders_before_parent_rank() {
        let e = |color, key, world_rank| SplitEntry {
            color: Some(color),
            key,
            world_rank,
        };
        // Reversed keys reverse the order; equal keys fall back to the parent rank.
        let all = [e(0, 2, 100), e(0, 1, 101), e(0, 1, 102), e(0, 0, 103)];
        let m = split_members(&all, 0).unwrap();
        assert_eq!(m.members, vec![103, 101, 102, 100]);
        assert_eq!(m.rank, 3);
        assert_eq!(split_members(&all, 2).unwrap().rank, 2);
    }

    /// Every family of a 3-D grid, split as the factory does it: each rank computes its colour
    /// and key from its group, the entries are "all-gathered", and each rank's member list must
    /// be its group in ascending world-rank order.
    #[test]
    fn splitting_a_grid_reproduces_its_groups() {
        let grid = HyperGrid::new(vec![2, 3, 2], &["tp", "dp", "pp"], 0).unwrap();
        let world = grid.size();
        for dims in [
            vec!["tp"],
            vec!["dp"],
            vec!["pp"],
            vec!["tp", "dp"],
            vec!["dp", "pp"],
            vec!["tp", "dp", "pp"],
        ] {
            let entries: Vec<SplitEntry> = (0..world)
                .map(|r| {
                    let g = grid.group_of(r, &dims[..]).unwrap();
                    let (color, key) = color_key_for(Some(&g), r);
                    SplitEntry {
                        color,
                        key,
                        world_rank: r,
                    }
                })
                .collect();
            // Through the wire format.
            let flat: Vec<i64> = entries.iter().flat_map(|e| e.encode()).collect();
            let entries = SplitEntry::decode_all(&flat).unwrap();
            for r in 0..world {
                let m = split_members(&entries, r).unwrap();
                let g = grid.group_of(r, &dims[..]).unwrap();
                assert_eq!(m.members, g.sorted(), "dims {dims:?} rank {r}");
                assert_eq!(m.members[m.rank], r);
            }
        }
    }

    /// A family where only some ranks are members (like the embedding group): non-members pass
    /// no colour and get nothing; members get exactly the listed ranks.
    #[test]
    fn partial_membership() {
        let members = Group::from_list(vec![0, 5, 7]);
        let entries: Vec<SplitEntry> = (0..8)
            .map(|r| {
                let (color, key) = color_key_for(Some(&members), r);
                SplitEntry {
                    color,
                    key,
                    world_rank: r,
                }
            })
            .collect();
        for r in 0..8 {
            let m = split_members(&entries, r);
            if members.contains(r) {
                assert_eq!(m.unwrap().members, vec![0, 5, 7]);
            } else {
                assert!(m.is_none());
            }
        }
    }
}
