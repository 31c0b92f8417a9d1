//! The arguments NCCL itself limits: `ncclCommSplit` takes its colour and key as C `int`s.
//! The split arithmetic (which ranks a split puts together, in which order) is grid-core's
//! ([`grid_core::split_members`], [`grid_core::SplitEntry`], [`grid_core::color_key_for`]); the
//! tests below check it reproduces a grid's groups the way [`crate::NcclFactory`] uses it.
//!
//! `ncclCommSplit(parent, color, key)` puts ranks of equal `color` in one new communicator,
//! ordered by `(key, parent rank)`; `NCCL_SPLIT_NOCOLOR` (-1) opts out. NCCL does not tell a rank
//! who its new peers are, so the factory all-gathers each rank's [`grid_core::SplitEntry`] over
//! the parent first and computes the member list with [`grid_core::split_members`].

use grid_core::{Error, Result};
use std::ffi::c_int;

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
    use grid_core::{color_key_for, split_members, Group, HyperGrid, SplitEntry};

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
