//! Arithmetic descriptions of process groups.
//!
//! A [`Group`] never stores its members when it does not have to: most groups of a parallel
//! layout are *lattices* (a base rank plus a few `(size, stride)` terms, first term fastest),
//! possibly cut to a consecutive range of that enumeration. This is the same idea as PyTorch's
//! DeviceMesh layouts: a group of 65,536 ranks in a million-rank world costs a few words, and
//! membership tests, positions and the `i`-th member are O(number of terms).

use serde::{Serialize, Serializer};
use std::fmt;

/// One axis of a lattice: `size` members spaced `stride` ranks apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Term {
    /// Number of values this axis takes.
    pub size: usize,
    /// Rank distance between neighbouring values.
    pub stride: usize,
}

/// A lattice of ranks: member `n` is `base + Σ digit_t(n) · stride_t`, where the digits are the
/// mixed-radix decomposition of `n` over the term sizes, first term fastest. The group is the
/// consecutive range `[start, start + len)` of that enumeration.
///
/// Invariant (checked by the constructors in this crate): the terms are *superincreasing* once
/// sorted by stride, i.e. every stride is larger than the largest offset the smaller-stride terms
/// can reach. This makes the decomposition of a rank unique and lets [`Group::position`] invert
/// it greedily.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Lattice {
    base: usize,
    terms: Vec<Term>,
    start: usize,
    len: usize,
}

impl Lattice {
    fn full_len(&self) -> usize {
        self.terms.iter().map(|t| t.size).product()
    }

    /// The rank at index `n` of the full (uncut) enumeration.
    fn at_full(&self, mut n: usize) -> usize {
        let mut r = self.base;
        for t in &self.terms {
            r += (n % t.size) * t.stride;
            n /= t.size;
        }
        r
    }

    /// Index of `rank` in the full enumeration, if it is a member of the full lattice.
    fn index_full(&self, rank: usize) -> Option<usize> {
        let mut v = rank.checked_sub(self.base)?;
        // Greedy decomposition, largest stride first (valid thanks to superincreasing strides).
        let mut order: Vec<usize> = (0..self.terms.len()).collect();
        order.sort_by(|&a, &b| self.terms[b].stride.cmp(&self.terms[a].stride));
        let mut digits = vec![0usize; self.terms.len()];
        for &i in &order {
            let t = self.terms[i];
            if t.size <= 1 {
                continue;
            }
            let d = v / t.stride;
            if d >= t.size {
                return None;
            }
            digits[i] = d;
            v -= d * t.stride;
        }
        if v != 0 {
            return None;
        }
        let mut n = 0usize;
        for (i, t) in self.terms.iter().enumerate().rev() {
            n = n * t.size + digits[i];
        }
        Some(n)
    }

    /// Digits of enumeration index `n` (first term fastest).
    fn digits(&self, mut n: usize) -> Vec<usize> {
        self.terms
            .iter()
            .map(|t| {
                let d = n % t.size;
                n /= t.size;
                d
            })
            .collect()
    }

    fn is_ascending(&self) -> bool {
        // Enumeration order is ascending iff the terms with size > 1 have increasing strides.
        let mut prev = 0usize;
        for t in self.terms.iter().filter(|t| t.size > 1) {
            if t.stride <= prev {
                return false;
            }
            prev = t.stride;
        }
        true
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Repr {
    Lattice(Lattice),
    List(Vec<usize>),
}

/// A process group: an ordered list of global ranks, usually described arithmetically.
///
/// The order is the order in which Megatron-Core passes the ranks to `new_group` (almost always
/// ascending). The *group rank* that a communicator reports is the position in the **sorted**
/// member list, as torch defines it: see [`Group::group_rank`].
///
/// ```
/// use grid_core::Group;
/// let g = Group::strided(4, 3, 8); // 4, 12, 20
/// assert_eq!(g.to_vec(), vec![4, 12, 20]);
/// assert_eq!(g.position(12), Some(1));
/// assert!(!g.contains(5));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Group(Repr);

impl Group {
    /// `size` ranks starting at `first`, `stride` apart.
    pub fn strided(first: usize, size: usize, stride: usize) -> Group {
        Group::lattice(first, vec![Term { size, stride }])
    }

    /// One rank.
    pub fn single(rank: usize) -> Group {
        Group::strided(rank, 1, 1)
    }

    /// An explicit member list (kept in the given order).
    pub fn from_list(ranks: Vec<usize>) -> Group {
        Group(Repr::List(ranks))
    }

    /// A full lattice. `terms` are listed fastest first and must be superincreasing once sorted
    /// by stride (true for any set of distinct grid dimensions and for sub-divisions of one).
    pub(crate) fn lattice(base: usize, terms: Vec<Term>) -> Group {
        let len = terms.iter().map(|t| t.size).product();
        Group(Repr::Lattice(Lattice {
            base,
            terms,
            start: 0,
            len,
        }))
    }

    /// The consecutive range `[start, start + len)` of this group's enumeration.
    /// Panics never: the range is clamped by the callers in this crate, who validate it first.
    pub(crate) fn slice(&self, start: usize, len: usize) -> Group {
        match &self.0 {
            Repr::Lattice(l) => Group(Repr::Lattice(Lattice {
                base: l.base,
                terms: l.terms.clone(),
                start: l.start + start,
                len,
            })),
            Repr::List(v) => Group(Repr::List(v[start..start + len].to_vec())),
        }
    }

    /// Members `offset + k·step` for `k < count` of this group's enumeration, as a lattice when
    /// possible. Used for hierarchical levels.
    pub(crate) fn select_strided(&self, offset: usize, count: usize, step: usize) -> Group {
        match &self.0 {
            Repr::Lattice(l) if l.terms.len() == 1 && l.start == 0 => {
                let t = l.terms[0];
                Group::strided(l.base + offset * t.stride, count, step * t.stride)
            }
            _ => Group::from_list((0..count).map(|k| self.get(offset + k * step)).collect()),
        }
    }

    /// The lattice terms (empty for an explicit list).
    pub(crate) fn terms(&self) -> &[Term] {
        match &self.0 {
            Repr::Lattice(l) => &l.terms,
            Repr::List(_) => &[],
        }
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Lattice(l) => l.len,
            Repr::List(v) => v.len(),
        }
    }

    /// True when the group has no member (never produced by a plan).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The member at position `i` (in Megatron's order). `i` must be `< len()`.
    pub fn get(&self, i: usize) -> usize {
        match &self.0 {
            Repr::Lattice(l) => l.at_full(l.start + i),
            Repr::List(v) => v[i],
        }
    }

    /// The member at position `i`, or `None` past the end.
    pub fn try_get(&self, i: usize) -> Option<usize> {
        (i < self.len()).then(|| self.get(i))
    }

    /// First member.
    pub fn first(&self) -> usize {
        self.get(0)
    }

    /// Last member.
    pub fn last(&self) -> usize {
        self.get(self.len() - 1)
    }

    /// Position of `rank` in Megatron's member order, or `None` if it is not a member.
    pub fn position(&self, rank: usize) -> Option<usize> {
        match &self.0 {
            Repr::Lattice(l) => {
                let n = l.index_full(rank)?;
                (n >= l.start && n < l.start + l.len).then(|| n - l.start)
            }
            Repr::List(v) => v.iter().position(|&r| r == rank),
        }
    }

    /// True if `rank` is a member.
    pub fn contains(&self, rank: usize) -> bool {
        self.position(rank).is_some()
    }

    /// True when the members are listed in ascending order.
    pub fn is_ascending(&self) -> bool {
        match &self.0 {
            Repr::Lattice(l) => l.is_ascending(),
            Repr::List(v) => v.windows(2).all(|w| w[0] < w[1]),
        }
    }

    /// The rank of `rank` inside the group as a communicator reports it: its index in the
    /// *sorted* member list (torch sorts the list passed to `new_group`).
    pub fn group_rank(&self, rank: usize) -> Option<usize> {
        let pos = self.position(rank)?;
        if self.is_ascending() {
            return Some(pos);
        }
        match &self.0 {
            // A full lattice in sorted order is the same lattice with its terms sorted by
            // stride, so the sorted index is the mixed-radix number of the digits in that order.
            Repr::Lattice(l) if l.start == 0 && l.len == l.full_len() => {
                let mut terms: Vec<(usize, Term)> = l.terms.iter().copied().enumerate().collect();
                terms.sort_by_key(|(_, t)| t.stride);
                let digits = l.digits(pos);
                let (mut index, mut scale) = (0, 1);
                for (i, t) in terms {
                    index += digits[i] * scale;
                    scale *= t.size;
                }
                Some(index)
            }
            _ => Some(self.iter().filter(|&r| r < rank).count()),
        }
    }

    /// Iterates over the members in Megatron's order.
    pub fn iter(&self) -> GroupIter<'_> {
        GroupIter {
            group: self,
            next: 0,
            len: self.len(),
        }
    }

    /// The members as a vector, in Megatron's order.
    pub fn to_vec(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.len());
        self.extend_into(&mut out);
        out
    }

    /// Appends the members to `out` (fast path for lattices).
    pub fn extend_into(&self, out: &mut Vec<usize>) {
        match &self.0 {
            Repr::List(v) => out.extend_from_slice(v),
            Repr::Lattice(l) if l.start == 0 && l.len == l.full_len() => {
                extend_lattice(l.base, &l.terms, out)
            }
            Repr::Lattice(_) => out.extend(self.iter()),
        }
    }

    /// Appends the members at positions `range` (in Megatron's order, clamped to the group) to
    /// `out`, without enumerating the ones before it: a large group can be written in small
    /// chunks through one reused buffer instead of being materialized whole.
    ///
    /// ```
    /// use grid_core::Group;
    /// let g = Group::strided(4, 5, 8); // 4, 12, 20, 28, 36
    /// let mut out = Vec::new();
    /// g.extend_range_into(1..3, &mut out);
    /// g.extend_range_into(4..99, &mut out);
    /// assert_eq!(out, vec![12, 20, 36]);
    /// ```
    pub fn extend_range_into(&self, range: std::ops::Range<usize>, out: &mut Vec<usize>) {
        let end = range.end.min(self.len());
        let start = range.start.min(end);
        match &self.0 {
            Repr::List(v) => out.extend_from_slice(&v[start..end]),
            Repr::Lattice(l) => {
                let mut left = end - start;
                if left == 0 {
                    return;
                }
                out.reserve(left);
                let n = l.start + start;
                let mut digits = l.digits(n);
                let mut r = l.at_full(n);
                let Some(&fast) = l.terms.first() else {
                    // No term: the lattice is its base alone.
                    out.push(r);
                    return;
                };
                loop {
                    // The rest of the fastest term's run, then a carry into the slower terms.
                    let run = fast.size.saturating_sub(digits[0]).min(left);
                    out.extend((0..run).map(|k| r + k * fast.stride));
                    left -= run;
                    if left == 0 {
                        return;
                    }
                    r -= digits[0] * fast.stride;
                    digits[0] = 0;
                    let mut i = 1;
                    loop {
                        // Members are left, so some slower digit can still be incremented.
                        let Some(t) = l.terms.get(i) else { return };
                        digits[i] += 1;
                        if digits[i] < t.size {
                            r += t.stride;
                            break;
                        }
                        r -= (digits[i] - 1) * t.stride;
                        digits[i] = 0;
                        i += 1;
                    }
                }
            }
        }
    }

    /// The members in ascending order.
    pub fn sorted(&self) -> Vec<usize> {
        let mut v = self.to_vec();
        if !self.is_ascending() {
            v.sort_unstable();
        }
        v
    }
}

/// Writes every member of a full lattice, first term fastest, with nested loops.
fn extend_lattice(base: usize, terms: &[Term], out: &mut Vec<usize>) {
    match terms.split_last() {
        None => out.push(base),
        Some((only, [])) => out.extend((0..only.size).map(|k| base + k * only.stride)),
        Some((last, rest)) => {
            for k in 0..last.size {
                extend_lattice(base + k * last.stride, rest, out);
            }
        }
    }
}

/// Iterator over a group's members.
pub struct GroupIter<'a> {
    group: &'a Group,
    next: usize,
    len: usize,
}

impl Iterator for GroupIter<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.next < self.len {
            self.next += 1;
            Some(self.group.get(self.next - 1))
        } else {
            None
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.len - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for GroupIter<'_> {}

impl<'a> IntoIterator for &'a Group {
    type Item = usize;
    type IntoIter = GroupIter<'a>;
    fn into_iter(self) -> GroupIter<'a> {
        self.iter()
    }
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Group {
    /// `[0, 4, 8]`, abbreviated past 16 members: `[0, 1, 2, …, 65535] (65536 ranks)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.len();
        if n <= 16 {
            let v: Vec<String> = self.iter().map(|r| r.to_string()).collect();
            write!(f, "[{}]", v.join(", "))
        } else {
            write!(
                f,
                "[{}, {}, {}, …, {}] ({} ranks)",
                self.get(0),
                self.get(1),
                self.get(2),
                self.get(n - 1),
                n
            )
        }
    }
}

impl Serialize for Group {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl From<Vec<usize>> for Group {
    fn from(v: Vec<usize>) -> Group {
        Group::from_list(v)
    }
}

/// Something with a member count: the group handles a [`crate::ProcessGroupCollection`] holds.
pub trait GroupSize {
    /// Number of ranks in the group.
    fn group_size(&self) -> usize;
}

impl GroupSize for Group {
    fn group_size(&self) -> usize {
        self.len()
    }
}

impl GroupSize for Vec<usize> {
    fn group_size(&self) -> usize {
        self.len()
    }
}

impl<T: GroupSize + ?Sized> GroupSize for std::sync::Arc<T> {
    fn group_size(&self) -> usize {
        (**self).group_size()
    }
}

impl<T: GroupSize + ?Sized> GroupSize for Box<T> {
    fn group_size(&self) -> usize {
        (**self).group_size()
    }
}

impl<T: GroupSize + ?Sized> GroupSize for &T {
    fn group_size(&self) -> usize {
        (**self).group_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lattice_roundtrip() {
        // sizes 2 (stride 1), 3 (stride 4): 0,1,4,5,8,9 + base 10
        let g = Group::lattice(
            10,
            vec![Term { size: 2, stride: 1 }, Term { size: 3, stride: 4 }],
        );
        assert_eq!(g.to_vec(), vec![10, 11, 14, 15, 18, 19]);
        for (i, r) in g.iter().enumerate() {
            assert_eq!(g.position(r), Some(i));
        }
        assert_eq!(g.position(12), None);
        assert_eq!(g.position(9), None);
        assert_eq!(g.position(22), None);
        assert!(g.is_ascending());
    }

    #[test]
    fn unsorted_lattice_group_rank() {
        // pp-like term first (stride 4), then a term of stride 2: 0,4,2,6
        let g = Group::lattice(
            0,
            vec![Term { size: 2, stride: 4 }, Term { size: 2, stride: 2 }],
        );
        assert_eq!(g.to_vec(), vec![0, 4, 2, 6]);
        assert!(!g.is_ascending());
        assert_eq!(g.group_rank(4), Some(2));
        assert_eq!(g.sorted(), vec![0, 2, 4, 6]);
    }

    #[test]
    fn arithmetic_group_rank_matches_counting() {
        let g = Group::lattice(
            3,
            vec![
                Term { size: 2, stride: 1 },
                Term { size: 3, stride: 8 },
                Term { size: 2, stride: 2 },
            ],
        );
        assert!(!g.is_ascending());
        let sorted = g.sorted();
        for r in g.iter() {
            let want = sorted.iter().position(|&x| x == r);
            assert_eq!(g.group_rank(r), want, "rank {r}");
        }
    }

    #[test]
    fn slices_and_display() {
        let g = Group::lattice(
            0,
            vec![Term { size: 4, stride: 2 }, Term { size: 3, stride: 8 }],
        );
        let s = g.slice(6, 6);
        assert_eq!(s.to_vec(), vec![12, 14, 16, 18, 20, 22]);
        assert_eq!(s.position(16), Some(2));
        assert_eq!(s.position(2), None);
        assert_eq!(format!("{}", Group::strided(0, 3, 2)), "[0, 2, 4]");
        assert_eq!(
            format!("{}", Group::strided(0, 100, 1)),
            "[0, 1, 2, …, 99] (100 ranks)"
        );
    }

    #[test]
    fn range_extension_matches_iteration() {
        let full = Group::lattice(
            3,
            vec![
                Term { size: 3, stride: 1 },
                Term {
                    size: 1,
                    stride: 50,
                },
                Term {
                    size: 2,
                    stride: 16,
                },
                Term {
                    size: 4,
                    stride: 100,
                },
            ],
        );
        let unsorted = Group::lattice(
            0,
            vec![Term { size: 2, stride: 4 }, Term { size: 2, stride: 2 }],
        );
        let groups = [
            full.clone(),
            full.slice(5, 13),
            unsorted.clone(),
            unsorted.slice(1, 2),
            Group::lattice(7, vec![]),
            Group::from_list(vec![9, 2, 5]),
        ];
        for g in groups {
            let all: Vec<usize> = g.iter().collect();
            for a in 0..=all.len() + 1 {
                for b in a..=all.len() + 2 {
                    let mut out = vec![42];
                    g.extend_range_into(a..b, &mut out);
                    let lo = a.min(all.len());
                    let hi = b.min(all.len());
                    assert_eq!(out[1..], all[lo..hi], "{g:?} {a}..{b}");
                    assert_eq!(out[0], 42);
                }
            }
        }
    }
}
