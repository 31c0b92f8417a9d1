//! The static plan of one bridge (docs/semantics.md §5.2–5.5): data-lane leaders, broadcast groups at
//! the boundary stages and the routing between leaders. Pure arithmetic, the same on every rank.
//!
//! # Routing by parts
//! With `S` source leaders and `D` destination leaders, let `L = lcm(S, D)`. Each source lane's
//! batch is cut into `L/S` consecutive parts (torch's `tensor_split` rule, or the per-sample
//! split metadata), giving `L` parts in lane order; part `u` goes to destination leader
//! `u / (L/D)`. Consecutive parts for the same destination travel as one message. When one
//! count divides the other this is exactly Megatron's fan-in (`S = f·D`: destination `i`
//! receives sources `i·f .. i·f+f−1`, each whole) and fan-out (`D = f·S`: source `i` cuts its
//! batch into `f` parts for destinations `i·f ..`); when neither divides, Megatron raises and
//! this routes by the least common multiple.

use crate::error::{Error, Result};
use crate::spec::DimMapping;
use grid_core::HyperGrid;
use std::ops::Range;

/// Which end of a bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The upstream module (sends activations, receives gradients).
    Src,
    /// The downstream module (receives activations, sends gradients).
    Dst,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Src => "source",
            Side::Dst => "destination",
        }
    }
}

/// One end of a bridge: a grid and the roles its ranks play.
///
/// A *data lane* is one combination of the grid's `dp` and `gtp_remat` coordinates. Its leader
/// is the lane's **largest** rank on the source side (last tp and cp coordinates at the last pp
/// stage) and its **smallest** rank on the destination side (first stage), as Megatron's code
/// (not its docstring) does. Dimensions `tp`, `cp` and `pp` are optional (size 1 if absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeEnd {
    side: Side,
    grid: HyperGrid,
    /// Mask of the dims that are *not* lane dims (everything but dp and gtp_remat).
    inner_mask: Vec<bool>,
    /// Mask of the tp and cp dims (the broadcast group).
    tpcp_mask: Vec<bool>,
    pp_dim: Option<usize>,
    cp_dim: Option<usize>,
    leaders: Vec<usize>,
    broadcast: Vec<Vec<usize>>,
}

impl BridgeEnd {
    /// The end of a bridge on `grid`.
    pub fn new(side: Side, grid: HyperGrid) -> BridgeEnd {
        let names = grid.dim_names().to_vec();
        let inner_mask: Vec<bool> = names
            .iter()
            .map(|n| n != "dp" && n != "gtp_remat")
            .collect();
        let tpcp_mask: Vec<bool> = names.iter().map(|n| n == "tp" || n == "cp").collect();
        let pp_dim = grid.dim_index("pp").ok();
        let cp_dim = grid.dim_index("cp").ok();
        let lanes = grid.num_groups_masked(&inner_mask);
        let leaders = (0..lanes)
            .map(|g| {
                let grp = grid.group_at_masked(&inner_mask, g);
                match side {
                    Side::Src => grp.iter().max().unwrap_or(grp.first()),
                    Side::Dst => grp.iter().min().unwrap_or(grp.first()),
                }
            })
            .collect();
        let boundary = |r: usize| -> bool {
            match pp_dim {
                None => true,
                Some(d) => {
                    let c = grid.coords(r).map(|c| c[d]).unwrap_or(usize::MAX);
                    match side {
                        Side::Src => c + 1 == grid.shape()[d],
                        Side::Dst => c == 0,
                    }
                }
            }
        };
        let broadcast = grid
            .groups_masked(&tpcp_mask)
            .iter()
            .filter(|g| g.first().is_some_and(|&r| boundary(r)))
            .map(|g| g.to_vec())
            .collect();
        BridgeEnd {
            side,
            grid,
            inner_mask,
            tpcp_mask,
            pp_dim,
            cp_dim,
            leaders,
            broadcast,
        }
    }

    /// Which end this is.
    pub fn side(&self) -> Side {
        self.side
    }
    /// The grid.
    pub fn grid(&self) -> &HyperGrid {
        &self.grid
    }
    /// The lane leaders, in lane order (ascending).
    pub fn leaders(&self) -> &[usize] {
        &self.leaders
    }
    /// The broadcast groups (tp × cp at the boundary stage), each ascending, in lane order.
    pub fn broadcast_groups(&self) -> &[Vec<usize>] {
        &self.broadcast
    }
    /// Size of the `cp` dimension (1 if absent).
    pub fn cp_size(&self) -> usize {
        self.cp_dim.map(|d| self.grid.shape()[d]).unwrap_or(1)
    }
    /// True if the grid contains `rank`.
    pub fn contains(&self, rank: usize) -> bool {
        self.grid.contains(rank)
    }
    /// True if `rank` is at this end's boundary stage (last pp stage of the source, first of the
    /// destination).
    pub fn at_boundary(&self, rank: usize) -> bool {
        if !self.grid.contains(rank) {
            return false;
        }
        match self.pp_dim {
            None => true,
            Some(d) => {
                let c = self.coord(rank, d);
                match self.side {
                    Side::Src => c + 1 == self.grid.shape()[d],
                    Side::Dst => c == 0,
                }
            }
        }
    }
    fn coord(&self, rank: usize, d: usize) -> usize {
        self.grid.coords(rank).map(|c| c[d]).unwrap_or(0)
    }
    /// Index of `rank`'s data lane (= index of its leader in [`BridgeEnd::leaders`]).
    pub fn lane_of(&self, rank: usize) -> Option<usize> {
        self.grid
            .contains(rank)
            .then(|| self.grid.group_index_masked(&self.inner_mask, rank))
    }
    /// The leader of `rank`'s lane.
    pub fn leader_of(&self, rank: usize) -> Option<usize> {
        self.lane_of(rank)
            .and_then(|l| self.leaders.get(l).copied())
    }
    /// The broadcast group of `rank` (only at the boundary stage).
    pub fn broadcast_group_of(&self, rank: usize) -> Option<Vec<usize>> {
        if !self.at_boundary(rank) {
            return None;
        }
        self.grid
            .group_of_masked(&self.tpcp_mask, rank)
            .ok()
            .map(|g| g.sorted())
    }
    /// The ranks whose sequence chunks a leader gathers (cp > 1): the boundary ranks of the
    /// leader's lane with the leader's tp coordinate, in cp order. `[leader]` when cp = 1.
    pub fn cp_chain(&self, leader: usize) -> Vec<usize> {
        match self.cp_dim {
            Some(d) if self.grid.shape()[d] > 1 => {
                let mut mask = vec![false; self.grid.shape().len()];
                mask[d] = true;
                self.grid
                    .group_of_masked(&mask, leader)
                    .map(|g| g.to_vec())
                    .unwrap_or_else(|_| vec![leader])
            }
            _ => vec![leader],
        }
    }
    /// The cp coordinate of `rank` (0 if no cp dimension).
    pub fn cp_rank(&self, rank: usize) -> usize {
        self.cp_dim.map(|d| self.coord(rank, d)).unwrap_or(0)
    }
    /// If `rank` must hand its sequence chunk to (or get it from) its lane leader in the cp
    /// exchange, the leader; `None` for the leader itself and for ranks outside the chain.
    pub fn cp_leader_for(&self, rank: usize) -> Option<usize> {
        if self.cp_size() <= 1 || !self.at_boundary(rank) {
            return None;
        }
        let leader = self.leader_of(rank)?;
        (leader != rank && self.cp_chain(leader).contains(&rank)).then_some(leader)
    }
}

/// One message route: the peer's leader index and rank, and the range of parts it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartRoute {
    /// Index of the peer among the other end's leaders.
    pub peer_index: usize,
    /// The peer's rank.
    pub peer: usize,
    /// Global part indices `[start, end)` this message carries.
    pub parts: Range<usize>,
}

/// The static plan of one bridge between a source and a destination module.
///
/// ```
/// use grid_core::HyperGrid;
/// use multimodule::{BridgePlan, DimMapping};
/// let g = |tp, dp, off| HyperGrid::new(vec![tp, 1, 1, dp], &["tp", "cp", "pp", "dp"], off).unwrap();
/// let plan = BridgePlan::new("enc", g(2, 2, 0), "llm", g(1, 4, 4), 3, DimMapping::default()).unwrap();
/// assert_eq!(plan.src().leaders(), &[1, 3]);
/// assert_eq!(plan.dst().leaders(), &[4, 5, 6, 7]);
/// assert_eq!(plan.send_peers(1), vec![4, 5]);
/// assert_eq!(plan.recv_peers(6), vec![3]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgePlan {
    src_name: String,
    dst_name: String,
    src: BridgeEnd,
    dst: BridgeEnd,
    tensor_ndim: usize,
    dim_mapping: DimMapping,
    parts: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl BridgePlan {
    /// The plan of a bridge from `src_grid` to `dst_grid` carrying `tensor_ndim`-dimensional
    /// activations laid out as `dim_mapping` says.
    ///
    /// Errors: `tensor_ndim` not 2 or 3, an invalid mapping, or cp > 1 with 2-D activations
    /// (the sequence is folded into the batch dimension there and cannot be re-sharded).
    pub fn new(
        src_name: impl Into<String>,
        src_grid: HyperGrid,
        dst_name: impl Into<String>,
        dst_grid: HyperGrid,
        tensor_ndim: usize,
        dim_mapping: DimMapping,
    ) -> Result<BridgePlan> {
        let src_name = src_name.into();
        let dst_name = dst_name.into();
        let cfg = |message: String| Error::BridgeConfig {
            src: src_name.clone(),
            dst: dst_name.clone(),
            message,
        };
        if tensor_ndim != 2 && tensor_ndim != 3 {
            return Err(cfg(format!(
                "tensor_ndim is {tensor_ndim}; it must be 2 or 3"
            )));
        }
        dim_mapping.validate()?;
        let src = BridgeEnd::new(Side::Src, src_grid);
        let dst = BridgeEnd::new(Side::Dst, dst_grid);
        if tensor_ndim == 2 && (src.cp_size() > 1 || dst.cp_size() > 1) {
            return Err(cfg(format!(
                "cp is {} on the source and {} on the destination, but 2-D activations fold the sequence into the batch dimension, so they cannot be re-sharded along the sequence: use 3-D activations",
                src.cp_size(),
                dst.cp_size()
            )));
        }
        let (s, d) = (src.leaders.len(), dst.leaders.len());
        let parts = (s / gcd(s, d).max(1)).checked_mul(d).ok_or_else(|| {
            cfg(format!(
                "{s} source and {d} destination lanes need lcm({s}, {d}) batch parts, more than a usize holds"
            ))
        })?;
        Ok(BridgePlan {
            src_name,
            dst_name,
            src,
            dst,
            tensor_ndim,
            dim_mapping,
            parts,
        })
    }

    /// Source module name.
    pub fn src_name(&self) -> &str {
        &self.src_name
    }
    /// Destination module name.
    pub fn dst_name(&self) -> &str {
        &self.dst_name
    }
    /// The source end.
    pub fn src(&self) -> &BridgeEnd {
        &self.src
    }
    /// The destination end.
    pub fn dst(&self) -> &BridgeEnd {
        &self.dst
    }
    /// One end by side.
    pub fn end(&self, side: Side) -> &BridgeEnd {
        match side {
            Side::Src => &self.src,
            Side::Dst => &self.dst,
        }
    }
    /// Dimensionality of the activations.
    pub fn tensor_ndim(&self) -> usize {
        self.tensor_ndim
    }
    /// The dim mapping.
    pub fn dim_mapping(&self) -> DimMapping {
        self.dim_mapping
    }
    /// The batch dimension (`dim_mapping.b` for 3-D, 0 for 2-D).
    pub fn batch_dim(&self) -> usize {
        self.dim_mapping.batch_dim(self.tensor_ndim)
    }
    /// The sequence dimension (3-D only).
    pub fn seq_dim(&self) -> Option<usize> {
        self.dim_mapping.seq_dim(self.tensor_ndim)
    }
    /// `lcm(S, D)`: the number of batch parts the bridge routes.
    pub fn parts(&self) -> usize {
        self.parts
    }
    /// Parts per source lane.
    pub fn parts_per_src(&self) -> usize {
        self.parts / self.src.leaders.len().max(1)
    }
    /// Parts per destination lane.
    pub fn parts_per_dst(&self) -> usize {
        self.parts / self.dst.leaders.len().max(1)
    }
    /// True if one leader count divides the other (Megatron's supported case).
    pub fn is_divisible(&self) -> bool {
        let (s, d) = (self.src.leaders.len(), self.dst.leaders.len());
        s % d == 0 || d % s == 0
    }

    /// The messages source leader number `i` sends, in order.
    pub fn send_routes(&self, i: usize) -> Vec<PartRoute> {
        let (ps, pd) = (self.parts_per_src(), self.parts_per_dst());
        group_routes(i * ps..(i + 1) * ps, pd, &self.dst.leaders)
    }
    /// The messages destination leader number `j` receives, in order.
    pub fn recv_routes(&self, j: usize) -> Vec<PartRoute> {
        let (ps, pd) = (self.parts_per_src(), self.parts_per_dst());
        group_routes(j * pd..(j + 1) * pd, ps, &self.src.leaders)
    }
    /// The destination ranks `rank` sends to as a source leader (empty otherwise).
    pub fn send_peers(&self, rank: usize) -> Vec<usize> {
        match self.src.leaders.iter().position(|&l| l == rank) {
            Some(i) => self.send_routes(i).into_iter().map(|r| r.peer).collect(),
            None => Vec::new(),
        }
    }
    /// The source ranks `rank` receives from as a destination leader (empty otherwise).
    pub fn recv_peers(&self, rank: usize) -> Vec<usize> {
        match self.dst.leaders.iter().position(|&l| l == rank) {
            Some(j) => self.recv_routes(j).into_iter().map(|r| r.peer).collect(),
            None => Vec::new(),
        }
    }

    /// Every rank of either grid, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (self.src.grid.offset()
            ..self.src.grid.offset() + self.src.grid.size())
            .chain(self.dst.grid.offset()..self.dst.grid.offset() + self.dst.grid.size())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// True if the two grids share ranks (colocated modules).
    pub fn overlapping(&self) -> bool {
        let (a0, a1) = (
            self.src.grid.offset(),
            self.src.grid.offset() + self.src.grid.size(),
        );
        let (b0, b1) = (
            self.dst.grid.offset(),
            self.dst.grid.offset() + self.dst.grid.size(),
        );
        a0 < b1 && b0 < a1
    }

    /// An error naming this bridge, for callers on a rank without the needed role.
    pub(crate) fn not_in(&self, op: &'static str, rank: usize, side: Side) -> Error {
        Error::NotInGrid {
            op,
            rank,
            side: side.name(),
            what: format!("bridge {} -> {}", self.src_name, self.dst_name),
        }
    }
}

/// The messages for the consecutive `parts`, one per peer they go to (peer `j` takes parts
/// `j·per_peer ..`). Arithmetic per message, not per part: a range of `lcm(S, D)`-sized parts
/// costs as many steps as it has peers, however large the lcm.
fn group_routes(parts: Range<usize>, per_peer: usize, peers: &[usize]) -> Vec<PartRoute> {
    let per_peer = per_peer.max(1);
    let mut out: Vec<PartRoute> = Vec::new();
    let mut u = parts.start;
    while u < parts.end {
        let j = u / per_peer;
        let end = parts.end.min(j.saturating_add(1).saturating_mul(per_peer));
        out.push(PartRoute {
            peer_index: j,
            peer: peers.get(j).copied().unwrap_or(usize::MAX),
            parts: u..end,
        });
        u = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(tp: usize, cp: usize, pp: usize, dp: usize, off: usize) -> HyperGrid {
        HyperGrid::new(vec![tp, cp, pp, dp], &["tp", "cp", "pp", "dp"], off).unwrap()
    }

    #[test]
    fn leaders_table() {
        // docs/semantics.md §5.2, the leaders table.
        for (tp, pp, dp, s, d) in [
            (2, 2, 2, vec![3, 7], vec![0, 4]),
            (4, 2, 1, vec![7], vec![0]),
            (1, 2, 4, vec![1, 3, 5, 7], vec![0, 2, 4, 6]),
            (2, 4, 1, vec![7], vec![0]),
        ] {
            assert_eq!(
                BridgeEnd::new(Side::Src, g(tp, 1, pp, dp, 0)).leaders(),
                &s[..]
            );
            assert_eq!(
                BridgeEnd::new(Side::Dst, g(tp, 1, pp, dp, 0)).leaders(),
                &d[..]
            );
        }
    }

    #[test]
    fn lcm_routing() {
        let p = BridgePlan::new(
            "a",
            g(1, 1, 1, 3, 0),
            "b",
            g(1, 1, 1, 2, 3),
            3,
            DimMapping::default(),
        )
        .unwrap();
        assert_eq!(p.parts(), 6);
        assert_eq!(p.send_peers(0), vec![3]);
        assert_eq!(p.send_peers(1), vec![3, 4]);
        assert_eq!(p.send_peers(2), vec![4]);
        assert_eq!(p.recv_peers(3), vec![0, 1]);
        assert_eq!(p.recv_peers(4), vec![1, 2]);
        assert_eq!(p.send_routes(1)[1].parts, 3..4);
    }

    #[test]
    fn cp_chain() {
        let e = BridgeEnd::new(Side::Src, g(2, 2, 1, 1, 0));
        assert_eq!(e.leaders(), &[3]);
        assert_eq!(e.cp_chain(3), vec![1, 3]);
        assert_eq!(e.cp_leader_for(1), Some(3));
        assert_eq!(e.cp_leader_for(0), None);
        let d = BridgeEnd::new(Side::Dst, g(2, 2, 1, 1, 0));
        assert_eq!(d.cp_chain(0), vec![0, 2]);
        assert_eq!(d.cp_leader_for(2), Some(0));
    }

    /// The routes computed per message are those of the per-part walk (one step per part), for
    /// every pair of leader counts up to 12.
    #[test]
    fn routes_per_message_equal_the_part_walk() {
        fn walk(parts: Range<usize>, per_peer: usize, peers: &[usize]) -> Vec<PartRoute> {
            let mut out: Vec<PartRoute> = Vec::new();
            for u in parts {
                let j = u / per_peer.max(1);
                match out.last_mut() {
                    Some(r) if r.peer_index == j => r.parts.end = u + 1,
                    _ => out.push(PartRoute {
                        peer_index: j,
                        peer: peers.get(j).copied().unwrap_or(usize::MAX),
                        parts: u..u + 1,
                    }),
                }
            }
            out
        }
        for s in 1..=12 {
            for d in 1..=12 {
                let p = BridgePlan::new(
                    "a",
                    g(1, 1, 1, s, 0),
                    "b",
                    g(1, 1, 1, d, s),
                    3,
                    DimMapping::default(),
                )
                .unwrap();
                let (ps, pd) = (p.parts_per_src(), p.parts_per_dst());
                for i in 0..s {
                    let want = walk(i * ps..(i + 1) * ps, pd, p.dst().leaders());
                    assert_eq!(p.send_routes(i), want, "{s} -> {d}, source {i}");
                }
                for j in 0..d {
                    let want = walk(j * pd..(j + 1) * pd, ps, p.src().leaders());
                    assert_eq!(p.recv_routes(j), want, "{s} -> {d}, destination {j}");
                }
            }
        }
    }

    /// Coprime leader counts near a million: lcm(S, D) is about 10^12 parts, routed in as many
    /// steps as there are messages.
    #[test]
    fn coprime_lane_counts_route_in_messages() {
        let p = BridgePlan::new(
            "a",
            g(1, 1, 1, 1 << 20, 0),
            "b",
            g(1, 1, 1, (1 << 20) - 1, 1 << 20),
            3,
            DimMapping::default(),
        )
        .unwrap();
        assert_eq!(p.parts(), (1 << 20) * ((1 << 20) - 1));
        let routes = p.send_routes(5);
        assert_eq!(routes.len(), 2);
        assert_eq!(routes[0].parts.end, routes[1].parts.start);
        assert_eq!(p.recv_routes(0).len(), 2);
    }
}
