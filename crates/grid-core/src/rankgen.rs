//! Order-string layouts with the semantics of Megatron-Core's `RankGenerator` and
//! `generate_masked_orthogonal_rank_groups` (docs/semantics.md §1).

use crate::error::{Error, Result};
use crate::grid::{checked_product, GroupList, HyperGrid};
use crate::group::Group;

/// The tokens an order string may use, in the sequence Megatron visits them when it appends
/// missing size-1 tokens.
pub const TOKENS: [&str; 6] = ["tp", "pp", "dp", "ep", "cp", "gtp_remat"];

/// Sizes of the parallel dimensions a [`RankGenerator`] lays out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GeneratorSizes {
    /// Tensor parallel.
    pub tp: usize,
    /// Expert parallel.
    pub ep: usize,
    /// Data parallel.
    pub dp: usize,
    /// Pipeline parallel.
    pub pp: usize,
    /// Context parallel.
    pub cp: usize,
    /// Megatron's `gtp_remat` axis (1 unless you model that feature).
    pub gtp_remat: usize,
}

impl GeneratorSizes {
    /// All sizes 1.
    pub const ONES: GeneratorSizes = GeneratorSizes {
        tp: 1,
        ep: 1,
        dp: 1,
        pp: 1,
        cp: 1,
        gtp_remat: 1,
    };

    fn of(&self, token: &str) -> usize {
        match token {
            "tp" => self.tp,
            "pp" => self.pp,
            "dp" => self.dp,
            "ep" => self.ep,
            "cp" => self.cp,
            _ => self.gtp_remat,
        }
    }
}

/// Megatron's `RankGenerator`: a grid whose dimensions are the tokens of an order string,
/// the first token varying fastest.
///
/// Differences from Megatron, all deliberate (see the README):
/// * a token is "present" when it is a `-`-separated token of the order, not a substring of it,
///   so an order without `tp` works with tp = 1 (as it did before Megatron's 2026 GTP change);
/// * a repeated token is rejected ([`Error::RepeatedToken`]) instead of producing ranks outside
///   the world.
///
/// ```
/// use grid_core::{RankGenerator, GeneratorSizes};
/// let sizes = GeneratorSizes { tp: 2, dp: 3, pp: 2, cp: 2, ..GeneratorSizes::ONES };
/// let g = RankGenerator::new(sizes, "tp-cp-ep-dp-pp", 0).unwrap();
/// assert_eq!(g.normalized_order(), "tp-cp-ep-dp-pp-gtp_remat");
/// assert_eq!(g.get_ranks("dp").unwrap().get(0), &[0, 4, 8]);
/// assert_eq!(g.get_ranks("tp-pp").unwrap().get(1), &[2, 3, 14, 15]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankGenerator {
    sizes: GeneratorSizes,
    order: String,
    grid: HyperGrid,
}

impl RankGenerator {
    /// Builds the generator. `order` is case-insensitive; missing size-1 tokens are appended in
    /// the order tp, pp, dp, ep, cp, gtp_remat.
    pub fn new(sizes: GeneratorSizes, order: &str, rank_offset: usize) -> Result<RankGenerator> {
        if sizes.ep > 1 && sizes.cp > 1 {
            return Err(Error::EpAndCp {
                ep: sizes.ep,
                cp: sizes.cp,
            });
        }
        for t in TOKENS {
            if sizes.of(t) == 0 {
                return Err(Error::NonPositive {
                    what: format!("{t} size"),
                    value: 0,
                });
            }
        }
        let lower = order.to_lowercase();
        let mut tokens: Vec<String> = lower.split('-').map(str::to_string).collect();
        // Missing tokens first (Megatron's order of checks), then unknown, then repeated.
        for t in TOKENS {
            if !tokens.iter().any(|x| x == t) {
                let size = sizes.of(t);
                if size != 1 {
                    return Err(Error::MissingToken {
                        token: t.to_string(),
                        size,
                        order: order.to_string(),
                    });
                }
                tokens.push(t.to_string());
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if !TOKENS.contains(&t.as_str()) {
                return Err(Error::UnknownToken {
                    token: t.clone(),
                    order: order.to_string(),
                });
            }
            if tokens[..i].contains(t) {
                return Err(Error::RepeatedToken {
                    token: t.clone(),
                    order: order.to_string(),
                });
            }
        }
        let shape: Vec<usize> = tokens.iter().map(|t| sizes.of(t)).collect();
        let grid = HyperGrid::new(shape, &tokens, rank_offset)?;
        Ok(RankGenerator {
            sizes,
            order: tokens.join("-"),
            grid,
        })
    }

    /// The normalized order: lower-cased, missing size-1 tokens appended.
    pub fn normalized_order(&self) -> &str {
        &self.order
    }

    /// The sizes in normalized-order position.
    pub fn ordered_sizes(&self) -> &[usize] {
        self.grid.shape()
    }

    /// The sizes this generator was built with.
    pub fn sizes(&self) -> GeneratorSizes {
        self.sizes
    }

    /// Number of ranks (the product of the sizes).
    pub fn world_size(&self) -> usize {
        self.grid.size()
    }

    /// The underlying grid (dimension names are the tokens).
    pub fn grid(&self) -> &HyperGrid {
        &self.grid
    }

    /// Megatron's `get_mask(order, token)`: which positions of the normalized order the
    /// `-`-separated `token` selects (its pieces may come in any order).
    pub fn mask(&self, token: &str) -> Result<Vec<bool>> {
        let names = self.grid.dim_names();
        let mut mask = vec![false; names.len()];
        for piece in token.split('-') {
            let i =
                names
                    .iter()
                    .position(|n| n == piece)
                    .ok_or_else(|| Error::TokenNotInOrder {
                        token: piece.to_string(),
                        order: self.order.clone(),
                    })?;
            mask[i] = true;
        }
        Ok(mask)
    }

    /// Megatron's `get_ranks(token)`: every group spanned by the token's dimensions.
    pub fn get_ranks(&self, token: &str) -> Result<GroupList> {
        Ok(self.grid.groups_masked(&self.mask(token)?))
    }

    /// The group of `token` that contains `rank`, without enumerating the others.
    pub fn group_of(&self, rank: usize, token: &str) -> Result<Group> {
        self.grid.group_of_masked(&self.mask(token)?, rank)
    }

    /// Coordinate of `rank` along one token.
    pub fn coord(&self, rank: usize, token: &str) -> Result<usize> {
        let d = self.grid.dim_index(token)?;
        if !self.grid.contains(rank) {
            return Err(Error::RankOutOfRange {
                rank,
                first: self.grid.offset(),
                end: self.grid.offset() + self.grid.size(),
            });
        }
        Ok(self.grid.coord_unchecked(rank, d))
    }

    /// Stride of a token (rank distance between neighbours along it).
    pub fn stride(&self, token: &str) -> Result<usize> {
        Ok(self.grid.strides()[self.grid.dim_index(token)?])
    }
}

/// Megatron's `generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask)`:
/// `parallel_size` is listed fastest first; the masked dimensions span a group.
///
/// ```
/// use grid_core::masked_orthogonal_groups;
/// let g = masked_orthogonal_groups(24, &[2, 3, 4], &[false, true, false]).unwrap();
/// assert_eq!(g.get(0), &[0, 2, 4]);
/// assert_eq!(g.len(), 8);
/// ```
pub fn masked_orthogonal_groups(
    world_size: usize,
    parallel_size: &[usize],
    mask: &[bool],
) -> Result<GroupList> {
    if mask.len() != parallel_size.len() {
        return Err(Error::MaskLength {
            mask: mask.len(),
            sizes: parallel_size.len(),
        });
    }
    let product = checked_product(parallel_size)?;
    if product != world_size {
        return Err(Error::WorldNotProduct {
            world_size,
            product,
            sizes: parallel_size.to_vec(),
        });
    }
    let names: Vec<String> = (0..parallel_size.len()).map(|i| format!("d{i}")).collect();
    let grid = HyperGrid::new(parallel_size.to_vec(), &names, 0)?;
    Ok(grid.groups_masked(mask))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uppercase_and_missing() {
        let s = GeneratorSizes {
            tp: 2,
            dp: 2,
            pp: 2,
            ..GeneratorSizes::ONES
        };
        let g = RankGenerator::new(s, "TP-PP-DP", 0).unwrap();
        assert_eq!(g.normalized_order(), "tp-pp-dp-ep-cp-gtp_remat");
        assert_eq!(g.ordered_sizes(), &[2, 2, 2, 1, 1, 1]);
        assert!(matches!(
            RankGenerator::new(s, "tp-dp", 0),
            Err(Error::MissingToken { .. })
        ));
        assert!(matches!(
            RankGenerator::new(s, "tp-tp-dp-pp", 0),
            Err(Error::RepeatedToken { .. })
        ));
        assert!(matches!(
            RankGenerator::new(s, "tp-xx-dp-pp", 0),
            Err(Error::UnknownToken { .. })
        ));
        assert_eq!(
            RankGenerator::new(s, "tp-dp-pp", 0)
                .unwrap()
                .get_ranks("dp")
                .unwrap()
                .to_vecs(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
    }
}
