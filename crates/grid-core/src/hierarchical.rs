//! Hierarchical sub-groups (Megatron's `create_hierarchical_groups`, docs/semantics.md §3.7).

use crate::error::{Error, Result};
use crate::grid::checked_product;
use crate::group::Group;

/// Shape of one hierarchical level over a parent group of `n = Π sizes` members: the level
/// views the parent as `(outer, size, inner)` (inner fastest) and groups the members that
/// differ only in the middle factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Level {
    /// Π sizes[..level]: distance between members of one level group, in parent positions.
    pub inner: usize,
    /// sizes[level]: members per level group.
    pub size: usize,
    /// Π sizes[level+1..].
    pub outer: usize,
}

impl Level {
    pub(crate) fn of(sizes: &[usize], level: usize) -> Level {
        Level {
            inner: sizes[..level].iter().product(),
            size: sizes[level],
            outer: sizes[level + 1..].iter().product(),
        }
    }
    /// Number of level groups per parent group.
    pub(crate) fn groups_per_parent(&self) -> usize {
        self.outer * self.inner
    }
    /// The parent positions of level group `g` (ordered by outer index, then inner index).
    pub(crate) fn first_position(&self, g: usize) -> usize {
        let (i, j) = (g / self.inner, g % self.inner);
        i * self.size * self.inner + j
    }
    /// Which level group a parent position falls in.
    pub(crate) fn group_of_position(&self, pos: usize) -> usize {
        let i = pos / (self.size * self.inner);
        let j = pos % self.inner;
        i * self.inner + j
    }
    /// Level group `g` of `parent`.
    pub(crate) fn select(&self, parent: &Group, g: usize) -> Group {
        parent.select_strided(self.first_position(g), self.size, self.inner)
    }
}

/// A parent rank list may not repeat a rank.
fn check_parent(ranks: &[usize]) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(ranks.len());
    match ranks.iter().find(|r| !seen.insert(**r)) {
        Some(r) => Err(Error::Invalid(format!(
            "rank {r} appears more than once in the parent group {ranks:?}"
        ))),
        None => Ok(()),
    }
}

/// Validates hierarchical sizes against a parent group size.
pub(crate) fn check_sizes(sizes: &[usize], expected: usize, what: &str) -> Result<()> {
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(Error::Invalid(format!(
            "hierarchical sizes {sizes:?} must be a non-empty list of positive integers ({what})"
        )));
    }
    let product = checked_product(sizes)?;
    if product != expected {
        return Err(Error::HierarchicalProduct {
            sizes: sizes.to_vec(),
            product,
            expected,
            what: what.to_string(),
        });
    }
    Ok(())
}

/// The levels of hierarchical groups over a parent rank list: level `k` groups the members
/// whose positions differ only in the `k`-th factor of `sizes` (factor 0 fastest).
///
/// ```
/// use grid_core::hierarchical_groups;
/// let levels = hierarchical_groups(&[0, 4, 8, 12, 16, 20], &[3, 2]).unwrap();
/// assert_eq!(levels[0], vec![vec![0, 4, 8], vec![12, 16, 20]]);
/// assert_eq!(levels[1], vec![vec![0, 12], vec![4, 16], vec![8, 20]]);
/// ```
pub fn hierarchical_groups(ranks: &[usize], sizes: &[usize]) -> Result<Vec<Vec<Vec<usize>>>> {
    check_parent(ranks)?;
    check_sizes(sizes, ranks.len(), "the parent group's size")?;
    let parent = Group::from_list(ranks.to_vec());
    Ok((0..sizes.len())
        .map(|l| {
            let level = Level::of(sizes, l);
            (0..level.groups_per_parent())
                .map(|g| level.select(&parent, g).to_vec())
                .collect()
        })
        .collect())
}

/// The group of `rank` at every level (see [`hierarchical_groups`]), or an error if `rank` is
/// not in `ranks`.
pub fn hierarchical_groups_of(
    ranks: &[usize],
    sizes: &[usize],
    rank: usize,
) -> Result<Vec<Vec<usize>>> {
    check_parent(ranks)?;
    check_sizes(sizes, ranks.len(), "the parent group's size")?;
    let pos = ranks.iter().position(|&r| r == rank).ok_or_else(|| {
        Error::Invalid(format!(
            "rank {rank} is not a member of the parent group {ranks:?}"
        ))
    })?;
    let parent = Group::from_list(ranks.to_vec());
    Ok((0..sizes.len())
        .map(|l| {
            let level = Level::of(sizes, l);
            level.select(&parent, level.group_of_position(pos)).to_vec()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docstring_2_2_4() {
        let ranks: Vec<usize> = (0..16).collect();
        let l = hierarchical_groups(&ranks, &[2, 2, 4]).unwrap();
        assert_eq!(l[0][0], vec![0, 1]);
        assert_eq!(l[1][..2], [vec![0, 2], vec![1, 3]]);
        assert_eq!(l[2][0], vec![0, 4, 8, 12]);
        assert_eq!(
            hierarchical_groups_of(&ranks, &[2, 2, 4], 5).unwrap(),
            vec![vec![4, 5], vec![5, 7], vec![1, 5, 9, 13]]
        );
        assert!(hierarchical_groups(&ranks, &[2, 4]).is_err());
        assert!(hierarchical_groups(&[1, 2, 1, 3], &[2, 2]).is_err());
    }
}
