//! N-dimensional named grids (Megatron-Core's `HyperCommGrid` arithmetic) and flat group lists.

use crate::error::{Error, Result};
use crate::group::{Group, Term};
use rayon::prelude::*;
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;

/// An N-dimensional grid of ranks with named dimensions, the first dimension varying fastest:
/// `rank = offset + Σ_d c_d · Π_{e<d} shape_e`.
///
/// The grid is pure arithmetic; nothing is stored per rank. Groups over any combination of
/// dimensions come out in the canonical order of Megatron's `HyperCommGrid.get_rank_enum`
/// (every group ascending, groups sorted by their smallest member), keyed by the dims sorted
/// slowest first.
///
/// ```
/// use grid_core::HyperGrid;
/// let g = HyperGrid::new(vec![2, 2, 2], &["a", "b", "c"], 0).unwrap();
/// assert_eq!(g.groups(&["a", "b"]).unwrap().to_vecs(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
/// assert_eq!(g.key(&["a", "b"]).unwrap(), "b-a");
/// assert_eq!(g.group_of(5, &["c"]).unwrap().to_vec(), vec![1, 5]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "GridSpec", into = "GridSpec")]
pub struct HyperGrid {
    shape: Vec<usize>,
    names: Vec<String>,
    strides: Vec<usize>,
    offset: usize,
    size: usize,
}

/// The serialized form of a [`HyperGrid`]: `{"shape", "dims", "rank_offset"}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GridSpec {
    /// Size of each dimension, fastest first.
    pub shape: Vec<usize>,
    /// Name of each dimension.
    #[serde(alias = "dim_names")]
    pub dims: Vec<String>,
    /// First rank of the grid.
    #[serde(default)]
    pub rank_offset: usize,
}

impl TryFrom<GridSpec> for HyperGrid {
    type Error = Error;
    fn try_from(s: GridSpec) -> Result<HyperGrid> {
        HyperGrid::new(s.shape, &s.dims, s.rank_offset)
    }
}

impl From<HyperGrid> for GridSpec {
    fn from(g: HyperGrid) -> GridSpec {
        GridSpec {
            shape: g.shape,
            dims: g.names,
            rank_offset: g.offset,
        }
    }
}

/// Product of `sizes`, or an overflow error.
pub(crate) fn checked_product(sizes: &[usize]) -> Result<usize> {
    sizes
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s))
        .ok_or_else(|| Error::SizeOverflow {
            sizes: sizes.to_vec(),
        })
}

impl HyperGrid {
    /// A grid of `shape` (fastest first) with one name per dimension, starting at `offset`.
    ///
    /// Errors: a length mismatch, a zero size, a repeated name (Megatron checks this only for
    /// views; a repeated name in the base grid would make its groups meaningless), overflow.
    pub fn new<S: AsRef<str>>(shape: Vec<usize>, names: &[S], offset: usize) -> Result<HyperGrid> {
        let names: Vec<String> = names.iter().map(|s| s.as_ref().to_string()).collect();
        if shape.len() != names.len() {
            return Err(Error::ShapeNamesMismatch { shape, names });
        }
        for (s, n) in shape.iter().zip(&names) {
            if *s == 0 {
                return Err(Error::NonPositive {
                    what: format!("size of dimension '{n}'"),
                    value: 0,
                });
            }
        }
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(Error::DuplicateDim {
                    name: n.clone(),
                    names: names.clone(),
                });
            }
        }
        let size = checked_product(&shape)?;
        offset
            .checked_add(size)
            .ok_or_else(|| Error::SizeOverflow {
                sizes: shape.clone(),
            })?;
        let mut strides = Vec::with_capacity(shape.len());
        let mut acc = 1;
        for s in &shape {
            strides.push(acc);
            acc *= s;
        }
        Ok(HyperGrid {
            shape,
            names,
            strides,
            offset,
            size,
        })
    }

    /// Like [`HyperGrid::new`], and also checks that the grid fits a world of `world_size` ranks.
    pub fn in_world<S: AsRef<str>>(
        shape: Vec<usize>,
        names: &[S],
        offset: usize,
        world_size: usize,
    ) -> Result<HyperGrid> {
        let g = HyperGrid::new(shape, names, offset)?;
        if g.size > world_size.saturating_sub(offset) || offset > world_size {
            return Err(Error::GridOversized {
                shape: g.shape,
                size: g.size,
                world_size,
                rank_offset: offset,
            });
        }
        Ok(g)
    }

    /// Sizes, fastest first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Dimension names, fastest first.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }
    /// Rank distance between neighbours along each dimension.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// First rank.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
    /// True if `rank` is one of the grid's ranks.
    pub fn contains(&self, rank: usize) -> bool {
        rank >= self.offset && rank - self.offset < self.size
    }

    /// Index of a dimension by name.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| Error::UnknownDim {
                dim: name.to_string(),
                context: "the grid".into(),
                names: self.names.clone(),
            })
    }

    /// Size of a dimension by name.
    pub fn dim_size(&self, name: &str) -> Result<usize> {
        Ok(self.shape[self.dim_index(name)?])
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if self.contains(rank) {
            Ok(())
        } else {
            Err(Error::RankOutOfRange {
                rank,
                first: self.offset,
                end: self.offset + self.size,
            })
        }
    }

    /// Coordinates of `rank`, one per dimension.
    pub fn coords(&self, rank: usize) -> Result<Vec<usize>> {
        self.check_rank(rank)?;
        Ok((0..self.shape.len())
            .map(|d| self.coord_unchecked(rank, d))
            .collect())
    }

    /// Coordinate of `rank` along dimension index `d` (rank must be in the grid).
    pub(crate) fn coord_unchecked(&self, rank: usize, d: usize) -> usize {
        ((rank - self.offset) / self.strides[d]) % self.shape[d]
    }

    /// The rank at `coords`.
    pub fn rank_of(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.shape.len() {
            return Err(Error::Invalid(format!(
                "{} coordinates given for a grid of {} dimensions {:?}",
                coords.len(),
                self.shape.len(),
                self.names
            )));
        }
        let mut r = self.offset;
        for (d, &c) in coords.iter().enumerate() {
            if c >= self.shape[d] {
                return Err(Error::Invalid(format!(
                    "coordinate {c} of dimension '{}' is out of range 0..{}",
                    self.names[d], self.shape[d]
                )));
            }
            r += c * self.strides[d];
        }
        Ok(r)
    }

    /// Resolves names to a mask over the dimensions; errors on unknown or repeated names.
    pub fn mask_of<S: AsRef<str>>(&self, dims: &[S]) -> Result<Vec<bool>> {
        let mut mask = vec![false; self.shape.len()];
        for d in dims {
            let i = self.dim_index(d.as_ref())?;
            if mask[i] {
                return Err(Error::DuplicateDim {
                    name: d.as_ref().to_string(),
                    names: dims.iter().map(|s| s.as_ref().to_string()).collect(),
                });
            }
            mask[i] = true;
        }
        Ok(mask)
    }

    /// The canonical order of `dims`: sorted slowest first (by position in the reversed names).
    pub fn ordered_dims<S: AsRef<str>>(&self, dims: &[S]) -> Result<Vec<String>> {
        let mask = self.mask_of(dims)?;
        Ok((0..self.names.len())
            .rev()
            .filter(|&i| mask[i])
            .map(|i| self.names[i].clone())
            .collect())
    }

    /// The canonical key of a group over `dims`: the dims sorted slowest first, joined by `-`.
    pub fn key<S: AsRef<str>>(&self, dims: &[S]) -> Result<String> {
        Ok(self.ordered_dims(dims)?.join("-"))
    }

    /// Number of groups of the family spanned by `mask`.
    pub fn num_groups_masked(&self, mask: &[bool]) -> usize {
        self.shape
            .iter()
            .zip(mask)
            .filter(|(_, &m)| !m)
            .map(|(s, _)| s)
            .product()
    }

    /// Group number `g` of the family spanned by `mask` (canonical order).
    pub fn group_at_masked(&self, mask: &[bool], mut g: usize) -> Group {
        let mut base = self.offset;
        let mut terms = Vec::new();
        for ((&size, &stride), &m) in self.shape.iter().zip(&self.strides).zip(mask) {
            if m {
                terms.push(Term { size, stride });
            } else {
                base += (g % size) * stride;
                g /= size;
            }
        }
        Group::lattice(base, terms)
    }

    /// Index of the group containing `rank` in the family spanned by `mask`.
    pub fn group_index_masked(&self, mask: &[bool], rank: usize) -> usize {
        let mut g = 0;
        for d in (0..self.shape.len()).rev() {
            if !mask[d] {
                g = g * self.shape[d] + self.coord_unchecked(rank, d);
            }
        }
        g
    }

    /// The group containing `rank` in the family spanned by `mask`, in O(dimensions).
    pub fn group_of_masked(&self, mask: &[bool], rank: usize) -> Result<Group> {
        self.check_rank(rank)?;
        Ok(self.group_at_masked(mask, self.group_index_masked(mask, rank)))
    }

    /// Every group over `dims`, in canonical order (Megatron's `get_rank_enum`).
    pub fn groups<S: AsRef<str>>(&self, dims: &[S]) -> Result<GroupList> {
        let mask = self.mask_of(dims)?;
        Ok(self.groups_masked(&mask))
    }

    /// Every group of the family spanned by `mask`, in canonical order.
    pub fn groups_masked(&self, mask: &[bool]) -> GroupList {
        let n = self.num_groups_masked(mask);
        let size = self.size / n;
        GroupList::uniform(n, size, |g| self.group_at_masked(mask, g))
    }

    /// The group over `dims` that contains `rank`, in time proportional to the number of
    /// dimensions (the members are described, not listed).
    pub fn group_of<S: AsRef<str>>(&self, rank: usize, dims: &[S]) -> Result<Group> {
        let mask = self.mask_of(dims)?;
        self.group_of_masked(&mask, rank)
    }

    /// Megatron's raw `_gen_rank_enum(dims)`: dims taken literally, the **last** requested
    /// dimension varies fastest inside a group; groups ordered by the other dims, first fastest.
    pub fn raw_groups<S: AsRef<str>>(&self, dims: &[S]) -> Result<GroupList> {
        let mask = self.mask_of(dims)?;
        let idx: Vec<usize> = dims
            .iter()
            .map(|d| self.dim_index(d.as_ref()))
            .collect::<Result<_>>()?;
        let terms: Vec<Term> = idx
            .iter()
            .rev()
            .map(|&d| Term {
                size: self.shape[d],
                stride: self.strides[d],
            })
            .collect();
        let n = self.num_groups_masked(&mask);
        Ok(GroupList::uniform(n, self.size / n, |g| {
            let base = self.group_at_masked(&mask, g).first();
            Group::lattice(base, terms.clone())
        }))
    }
}

impl fmt::Display for HyperGrid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self
            .names
            .iter()
            .zip(&self.shape)
            .map(|(n, s)| format!("{n}={s}"))
            .collect();
        write!(f, "grid[{}] at offset {}", dims.join(", "), self.offset)
    }
}

/// A list of groups stored flat (one allocation for all members), as a family's full
/// enumeration. Serializes as a JSON list of lists.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct GroupList {
    ranks: Vec<usize>,
    offsets: Vec<usize>,
}

impl GroupList {
    /// `n` groups of `size` members each, group `g` given by `group(g)`; filled in parallel.
    pub fn uniform<F>(n: usize, size: usize, group: F) -> GroupList
    where
        F: Fn(usize) -> Group + Sync,
    {
        let mut ranks = vec![0usize; n * size];
        const CHUNK: usize = 1 << 14;
        if let Some(per) = CHUNK.checked_div(size) {
            let per = per.max(1);
            ranks
                .par_chunks_mut(per * size)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let mut buf = Vec::with_capacity(size);
                    for (j, out) in chunk.chunks_mut(size).enumerate() {
                        buf.clear();
                        group(c * per + j).extend_into(&mut buf);
                        out.copy_from_slice(&buf);
                    }
                });
        }
        GroupList {
            ranks,
            offsets: (0..=n).map(|g| g * size).collect(),
        }
    }

    /// Groups of possibly different sizes.
    pub fn from_groups<I: IntoIterator<Item = Group>>(groups: I) -> GroupList {
        let mut out = GroupList {
            ranks: Vec::new(),
            offsets: vec![0],
        };
        for g in groups {
            g.extend_into(&mut out.ranks);
            out.offsets.push(out.ranks.len());
        }
        out
    }

    /// Groups from explicit lists.
    pub fn from_vecs(v: Vec<Vec<usize>>) -> GroupList {
        let mut out = GroupList {
            ranks: Vec::new(),
            offsets: vec![0],
        };
        for g in v {
            out.ranks.extend_from_slice(&g);
            out.offsets.push(out.ranks.len());
        }
        out
    }

    /// Appends another list's groups.
    pub fn append(&mut self, other: &GroupList) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        let base = self.ranks.len();
        self.ranks.extend_from_slice(&other.ranks);
        self.offsets
            .extend(other.offsets.iter().skip(1).map(|o| o + base));
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
    /// True when there is no group.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Group `i`'s members.
    pub fn get(&self, i: usize) -> &[usize] {
        &self.ranks[self.offsets[i]..self.offsets[i + 1]]
    }
    /// Iterates over the groups.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[usize]> + '_ {
        (0..self.len()).map(move |i| self.get(i))
    }
    /// Total number of members over all groups.
    pub fn total_members(&self) -> usize {
        self.ranks.len()
    }
    /// The groups as vectors.
    pub fn to_vecs(&self) -> Vec<Vec<usize>> {
        self.iter().map(|g| g.to_vec()).collect()
    }
}

impl fmt::Debug for GroupList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for GroupList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid222() -> HyperGrid {
        HyperGrid::new(vec![2, 2, 2], &["a", "b", "c"], 0).unwrap()
    }

    #[test]
    fn raw_enum_docstring() {
        let g = grid222();
        let r = |d: &[&str]| g.raw_groups(d).unwrap().to_vecs();
        assert_eq!(r(&["a", "b"]), vec![vec![0, 2, 1, 3], vec![4, 6, 5, 7]]);
        assert_eq!(r(&["b", "a"]), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(
            r(&["c"]),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(r(&["a", "c"]), vec![vec![0, 4, 1, 5], vec![2, 6, 3, 7]]);
        assert_eq!(r(&["c", "a"]), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
    }

    #[test]
    fn keys() {
        let g = HyperGrid::new(vec![2, 2, 2], &["tp", "cp", "dp"], 0).unwrap();
        assert_eq!(g.key(&["dp", "tp"]).unwrap(), "dp-tp");
        assert_eq!(g.key(&["tp", "cp"]).unwrap(), "cp-tp");
        assert_eq!(g.key(&["dp", "cp", "tp"]).unwrap(), "dp-cp-tp");
        assert!(g.key(&["pp"]).is_err());
        assert!(g.key(&["tp", "tp"]).is_err());
    }

    #[test]
    fn offset_grid() {
        let g = HyperGrid::in_world(vec![2, 3, 4, 5], &["tp", "cp", "pp", "dp"], 7, 130).unwrap();
        let dp = g.groups(&["dp"]).unwrap();
        assert_eq!(dp.get(0), &[7, 31, 55, 79, 103]);
        assert_eq!(dp.get(1), &[8, 32, 56, 80, 104]);
        assert!(HyperGrid::in_world(vec![2, 4], &["tp", "dp"], 1, 8).is_err());
    }
}
