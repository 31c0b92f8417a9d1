//! Split arithmetic, once for every backend: from every parent rank's colour and key to each
//! rank's new communicator (members and rank), as `MPI_Comm_split` and `ncclCommSplit` define
//! it; and the colour and key that put a rank into a given group.

use crate::error::{Error, Result};
use crate::Group;

/// One parent rank's arguments to a split, plus its world rank.
///
/// ```
/// use grid_core::SplitEntry;
/// let e = SplitEntry { color: Some(3), key: 1, world_rank: 9 };
/// let n = SplitEntry { color: None, key: 0, world_rank: 4 };
/// let flat: Vec<i64> = [e.encode(), n.encode()].concat();
/// assert_eq!(SplitEntry::decode_all(&flat).unwrap(), vec![e, n]);
/// ```
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
    /// The three integers a backend exchanges for this entry (`color` is -1 for `None`).
    pub fn encode(&self) -> [i64; 3] {
        [
            self.color.map_or(-1, i64::from),
            i64::try_from(self.key).unwrap_or(i64::MAX),
            i64::try_from(self.world_rank).unwrap_or(i64::MAX),
        ]
    }

    /// Decodes the exchanged integers of every parent rank (three per rank, rank order).
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
                    v => Some(u32::try_from(v).map_err(|_| {
                        Error::Invalid(format!(
                            "split: received colour {v} (valid: -1 or 0..=2^32-1)"
                        ))
                    })?),
                };
                let key = usize::try_from(c[1]).map_err(|_| {
                    Error::Invalid(format!("split: received key {} (valid: >= 0)", c[1]))
                })?;
                let world_rank = usize::try_from(c[2]).map_err(|_| {
                    Error::Invalid(format!("split: received rank {} (valid: >= 0)", c[2]))
                })?;
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
    /// The members' parent ranks, in new-communicator rank order.
    pub parent_ranks: Vec<usize>,
    /// The members' world ranks, in new-communicator rank order.
    pub members: Vec<usize>,
    /// This rank's rank in the new communicator.
    pub rank: usize,
}

/// The communicator parent rank `me` gets, from every parent rank's entry (index = parent
/// rank): the ranks of `me`'s colour ordered by `(key, parent rank)`. `None` when `me` passed
/// no colour (or is not a parent rank).
///
/// ```
/// use grid_core::{split_members, SplitEntry};
/// let e = |color, key, world_rank| SplitEntry { color, key, world_rank };
/// let all = [e(Some(1), 0, 10), e(Some(2), 0, 11), e(Some(1), 0, 12), e(None, 0, 13)];
/// let m = split_members(&all, 2).unwrap();
/// assert_eq!((m.members, m.parent_ranks, m.rank), (vec![10, 12], vec![0, 2], 1));
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
        parent_ranks: same.iter().map(|&(_, p)| p).collect(),
        members: same.iter().map(|&(_, p)| entries[p].world_rank).collect(),
        rank,
    })
}

/// The colour and key that put `world_rank` in `group`: colour = the group's smallest member
/// (unique per group of a family, the same on every member), key = the world rank (so new
/// ranks ascend with world ranks). `None` (no colour) when the rank is not a member.
///
/// ```
/// use grid_core::{color_key_for, Group};
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
