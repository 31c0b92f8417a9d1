//! Exact-value checks of bridge transfers: every element encodes (micro-batch, source lane,
//! sample, sequence position, hidden index), so a received tensor is checked element by element
//! against where it must have come from.
#![allow(dead_code)]

use super::threads::{run_world, ThreadComm, ThreadFactory};
use grid_core::HyperGrid;
use multimodule::{tensor_split_sizes, Activation, BridgeCommunicator, BridgePlan, DimMapping};

/// The plan of a case.
pub fn plan_of(case: &Case) -> BridgePlan {
    BridgePlan::new(
        "src",
        case.src.clone(),
        "dst",
        case.dst.clone(),
        case.layout.ndim,
        case.layout.dm,
    )
    .unwrap()
}

/// World size of a case.
pub fn world_of(case: &Case) -> usize {
    [&case.src, &case.dst]
        .iter()
        .map(|g| g.offset() + g.size())
        .max()
        .unwrap()
}
use std::sync::Arc;

pub fn grid(tp: usize, cp: usize, pp: usize, dp: usize, off: usize) -> HyperGrid {
    HyperGrid::new(vec![tp, cp, pp, dp], &["tp", "cp", "pp", "dp"], off).unwrap()
}

/// The value of element (lane, b, s, h) of micro-batch `mb`.
pub fn value(mb: usize, lane: usize, b: usize, s: usize, h: usize) -> f64 {
    (mb as f64) * 1e9 + (lane as f64) * 1e6 + (b as f64) * 1e3 + (s as f64) * 10.0 + h as f64
}

/// The gradient the destination sends back for an activation value.
pub fn grad_of(x: f64) -> f64 {
    -x - 0.5
}

/// Layout of an activation: ndim 2 is `[B·S, H]` with S = 1, ndim 3 follows the mapping.
#[derive(Clone, Copy)]
pub struct Layout {
    pub ndim: usize,
    pub dm: DimMapping,
    pub seq: usize,
    pub hidden: usize,
}

impl Layout {
    pub fn shape(&self, b: usize, s: usize) -> Vec<usize> {
        if self.ndim == 2 {
            return vec![b, self.hidden];
        }
        let mut shape = vec![0; 3];
        shape[self.dm.b] = b;
        shape[self.dm.s] = s;
        shape[self.dm.h] = self.hidden;
        shape
    }
    /// Builds a tensor with `b` rows and `s` sequence positions; `f(b, s, h)` gives each value.
    pub fn build(&self, b: usize, s: usize, f: impl Fn(usize, usize, usize) -> f64) -> Activation {
        let shape = self.shape(b, s);
        let n: usize = shape.iter().product();
        let mut data = vec![0f64; n];
        for (e, x) in data.iter_mut().enumerate() {
            let (bi, si, hi) = self.index(&shape, e);
            *x = f(bi, si, hi);
        }
        Activation::from_vec(shape, data).unwrap()
    }
    fn index(&self, shape: &[usize], e: usize) -> (usize, usize, usize) {
        if self.ndim == 2 {
            return (e / shape[1], 0, e % shape[1]);
        }
        let c = [
            e / (shape[1] * shape[2]),
            (e / shape[2]) % shape[1],
            e % shape[2],
        ];
        (c[self.dm.b], c[self.dm.s], c[self.dm.h])
    }
    /// Checks every element of `t` against `f`.
    pub fn check(
        &self,
        t: &Activation,
        b: usize,
        s: usize,
        what: &str,
        f: impl Fn(usize, usize, usize) -> f64,
    ) {
        assert_eq!(t.shape(), &self.shape(b, s)[..], "{what}: shape");
        let v = t.to_vec::<f64>().unwrap();
        for (e, &x) in v.iter().enumerate() {
            let (bi, si, hi) = self.index(t.shape(), e);
            let want = f(bi, si, hi);
            assert_eq!(x, want, "{what}: element (b {bi}, s {si}, h {hi})");
        }
    }
    pub fn seq_len(&self) -> usize {
        if self.ndim == 2 {
            1
        } else {
            self.seq
        }
    }
}

/// Source (lane, sample) of every row of destination lane `j`, following the documented routing.
pub fn dst_rows(plan: &BridgePlan, batches: &[usize], j: usize) -> Vec<(usize, usize)> {
    let ps = plan.parts_per_src();
    let pd = plan.parts_per_dst();
    let mut parts = Vec::new(); // (lane, start, len) for u in 0..L
    for (i, &b) in batches.iter().enumerate() {
        let mut start = 0;
        for n in tensor_split_sizes(b, ps) {
            parts.push((i, start, n));
            start += n;
        }
    }
    parts[j * pd..(j + 1) * pd]
        .iter()
        .flat_map(|&(i, s, n)| (s..s + n).map(move |b| (i, b)))
        .collect()
}

/// (start, len) of the sequence chunk of cp rank `c`.
pub fn seq_chunk(seq: usize, cp: usize, c: usize) -> (usize, usize) {
    let sizes = tensor_split_sizes(seq, cp);
    (sizes[..c].iter().sum(), sizes[c])
}

pub struct Case {
    pub src: HyperGrid,
    pub dst: HyperGrid,
    pub layout: Layout,
    /// Batch rows of each source lane.
    pub batches: Vec<usize>,
    pub microbatches: usize,
    /// 1F1B-style fused calls instead of all forwards then all backwards.
    pub fused: bool,
    pub rendezvous: bool,
}

/// Runs `case` on threads and checks every element received, forward and backward. Returns
/// the number of elements checked.
pub fn run_case(case: &Case) -> usize {
    let plan = BridgePlan::new(
        "src",
        case.src.clone(),
        "dst",
        case.dst.clone(),
        case.layout.ndim,
        case.layout.dm,
    )
    .unwrap();
    let world = [&case.src, &case.dst]
        .iter()
        .map(|g| g.offset() + g.size())
        .max()
        .unwrap();
    let (res, _) = run_world(
        world,
        case.rendezvous,
        |rank, comm: Arc<ThreadComm>| -> usize {
            let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40).unwrap();
            run_rank(case, &bridge, rank)
        },
    );
    res.into_iter().sum()
}

/// One rank's side of `case` over any backend; returns the number of elements checked.
pub fn run_rank<C: grid_core::Communicator>(
    case: &Case,
    bridge: &BridgeCommunicator<C>,
    rank: usize,
) -> usize {
    let p = bridge.plan();
    let lay = case.layout;
    let seq = lay.seq_len();
    let (src, dst) = (p.src(), p.dst());
    let mut checked = 0;
    // This rank's source activation for micro-batch mb.
    let my_act = |mb: usize| -> Option<Activation> {
        if !src.contains(rank) {
            return None;
        }
        let lane = src.lane_of(rank).unwrap();
        let (s0, sl) = seq_chunk(seq, src.cp_size(), src.cp_rank(rank));
        Some(lay.build(case.batches[lane], sl, |b, s, h| {
            value(mb, lane, b, s + s0, h)
        }))
    };
    let expected_act = |mb: usize, t: &Activation, what: &str| -> usize {
        let j = dst.lane_of(rank).unwrap();
        let rows = dst_rows(p, &case.batches, j);
        let (s0, sl) = seq_chunk(seq, dst.cp_size(), dst.cp_rank(rank));
        lay.check(t, rows.len(), sl, what, |b, s, h| {
            value(mb, rows[b].0, rows[b].1, s + s0, h)
        });
        t.numel()
    };
    let grad_for = |t: &Activation| -> Activation {
        let v: Vec<f64> = t
            .to_vec::<f64>()
            .unwrap()
            .into_iter()
            .map(grad_of)
            .collect();
        Activation::from_vec(t.shape().to_vec(), v).unwrap()
    };
    let check_grad = |mb: usize, g: &Activation, what: &str| -> usize {
        let a = my_act(mb).unwrap();
        let want: Vec<f64> = a
            .to_vec::<f64>()
            .unwrap()
            .into_iter()
            .map(grad_of)
            .collect();
        assert_eq!(g.shape(), a.shape(), "{what}: gradient shape");
        assert_eq!(g.to_vec::<f64>().unwrap(), want, "{what}: gradient values");
        g.numel()
    };
    let n = case.microbatches;
    let both = bridge.holds_both_ends();
    let in_src = src.contains(rank);
    let in_dst = dst.contains(rank);
    let at_src = src.at_boundary(rank);
    let at_dst = dst.at_boundary(rank);
    // With colocated ranks every rank uses the plain schedule (a colocated rank runs both
    // modules one after the other, so 1F1B between them is not a schedule it can follow).
    let _ = both;
    if p.overlapping() || !case.fused {
        // All forwards, then all backwards (FIFO order).
        let mut received = Vec::new();
        for mb in 0..n {
            let what = format!("rank {rank} forward mb {mb}");
            if in_src {
                bridge.send_forward(&my_act(mb).unwrap()).unwrap();
            }
            if in_dst {
                let t = bridge.recv_forward().unwrap();
                assert_eq!(t.is_some(), at_dst, "{what}");
                if let Some(t) = t {
                    checked += expected_act(mb, &t, &what);
                    received.push(t);
                }
            }
        }
        let mut received = received.into_iter();
        for mb in 0..n {
            let what = format!("rank {rank} backward mb {mb}");
            if in_dst && at_dst {
                bridge
                    .send_backward(&grad_for(&received.next().unwrap()))
                    .unwrap();
            }
            if in_src {
                let g = bridge.recv_backward().unwrap();
                assert_eq!(g.is_some(), at_src, "{what}");
                if let Some(g) = g {
                    checked += check_grad(mb, &g, &what);
                }
            }
        }
    } else if in_src {
        bridge.send_forward(&my_act(0).unwrap()).unwrap();
        for mb in 1..=n {
            let what = format!("rank {rank} fused mb {mb}");
            let g = if mb < n {
                bridge
                    .send_forward_recv_backward(&my_act(mb).unwrap())
                    .unwrap()
            } else {
                bridge.recv_backward().unwrap()
            };
            assert_eq!(g.is_some(), at_src, "{what}");
            if let Some(g) = g {
                checked += check_grad(mb - 1, &g, &what);
            }
        }
    } else if in_dst {
        let mut last = bridge.recv_forward().unwrap();
        for mb in 0..n {
            let what = format!("rank {rank} fused mb {mb}");
            assert_eq!(last.is_some(), at_dst, "{what}");
            let Some(t) = last.take() else { continue };
            checked += expected_act(mb, &t, &what);
            let g = grad_for(&t);
            last = if mb + 1 < n {
                bridge.send_backward_recv_forward(&g).unwrap()
            } else {
                bridge.send_backward(&g).unwrap();
                None
            };
        }
    }
    checked
}

/// A 3-D activation layout `[s, b, h]` (the default mapping) with `seq` rows per sample.
pub fn l3(seq: usize) -> Layout {
    Layout {
        ndim: 3,
        dm: DimMapping::default(),
        seq,
        hidden: 3,
    }
}

/// A bridge case with 3 micro-batches, unfused, without the rendezvous check.
pub fn case(
    src: grid_core::HyperGrid,
    dst: grid_core::HyperGrid,
    layout: Layout,
    batches: Vec<usize>,
) -> Case {
    Case {
        src,
        dst,
        layout,
        batches,
        microbatches: 3,
        fused: false,
        rendezvous: false,
    }
}
