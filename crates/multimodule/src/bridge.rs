//! [`BridgeCommunicator`]: moves activations forward and gradients backward between two modules
//! with different grids (docs/semantics.md §5), generic over the `grid-core` communicator traits.
//!
//! # What every call does
//! Each call runs up to three phases, in this order on every rank, so that no combination of
//! roles can deadlock:
//! 1. **cp gather** (only with cp > 1 on the sending end): the boundary ranks of a lane that share
//!    the leader's tp coordinate hand their sequence chunk to the lane leader, which concatenates
//!    them along the sequence dimension in cp order.
//! 2. **bridge**: sending leaders split their lane's batch by the routing plan (torch's
//!    `tensor_split` rule or the tensor's per-sample split sizes; gradients go back with exactly
//!    the sizes the forward pass delivered) and send each part; receiving leaders concatenate
//!    what they get along the batch dimension in sender order. Headers first, then payloads.
//! 3. **broadcast**: the receiving leader broadcasts over its tp × cp group at the boundary stage;
//!    with cp > 1 every rank then keeps its own sequence chunk (`tensor_split` rule).
//!
//! # Beyond Megatron
//! * Overlapping (colocated) grids: a rank may be a sender and a receiver of the same bridge;
//!   messages to itself are handed over locally. On such a rank `send_forward` (`send_backward`)
//!   keeps the tensor and the matching `recv_forward` (`recv_backward`) runs both ends in one
//!   exchange; [`BridgeCommunicator::forward`] and [`BridgeCommunicator::backward`] do it in one
//!   call.
//! * Leader counts that do not divide each other are routed by their least common multiple.
//! * cp > 1 on either end (3-D activations) is re-sharded along the sequence dimension.
//! * Gradient checks: every forward transfer is recorded (FIFO, one record per micro-batch in
//!   flight); a gradient whose shape differs from the forward activation is an error on the rank
//!   that detects it, and its peers get [`Error::PeerError`] instead of hanging.

use crate::error::{Error, Result};
use crate::pool::BufferPool;
use crate::routing::{BridgePlan, Side};
use crate::tensor::{batch_split_sizes, tensor_split_sizes, Activation};
use crate::wire::{distribute, In, Join, Meta, Out, OutData, Part, ShapeCache, ShapeMode, Wire};
use grid_core::{Communicator, DType, GroupFactory};
use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Tags per bridge: four message kinds, header and payload each.
pub const TAGS_PER_BRIDGE: u32 = 8;
const FWD: u32 = 0;
const BWD: u32 = 2;
const FWD_CP: u32 = 4;
const BWD_CP: u32 = 6;

/// Communicators of broadcast groups already created, shared between bridges (two bridges out
/// of one module use the same source groups). Keyed by the full group list, which every rank
/// knows, so all ranks agree on which splits happen.
pub struct GroupCache<C> {
    map: HashMap<Vec<Vec<usize>>, Option<Arc<C>>>,
}

impl<C> Default for GroupCache<C> {
    fn default() -> Self {
        GroupCache {
            map: HashMap::new(),
        }
    }
}

impl<C> GroupCache<C> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Number of distinct group lists created.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// True when nothing was created.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// This rank's communicator for the group of `groups` it belongs to. Collective over `parent`
/// (one split, skipped by every rank when all groups are singletons).
fn group_comm<F: GroupFactory>(
    factory: &F,
    parent: &F::Comm,
    me: usize,
    groups: &[Vec<usize>],
    cache: &mut GroupCache<F::Comm>,
) -> Result<Option<Arc<F::Comm>>> {
    if let Some(c) = cache.map.get(groups) {
        return Ok(c.clone());
    }
    let comm = if groups.iter().all(|g| g.len() <= 1) {
        None
    } else {
        let color = groups
            .iter()
            .position(|g| g.len() > 1 && g.contains(&me))
            .map(|i| i as u32);
        factory.split(parent, color, me)?.map(Arc::new)
    };
    cache.map.insert(groups.to_vec(), comm.clone());
    Ok(comm)
}

#[derive(Debug)]
struct Sent {
    /// This rank's activation shape (what its gradient must look like).
    shape: Vec<usize>,
    /// Leader only: (peer, part shape) per message.
    parts: Vec<(usize, Vec<usize>)>,
}

#[derive(Debug)]
struct Received {
    /// What this rank returned.
    shape: Vec<usize>,
    /// Leader only: the concatenated shape (before cp narrowing) and the batch rows per source.
    full: Vec<usize>,
    rows: Vec<(usize, usize)>,
}

const MAX_CROSSINGS: usize = 1024;

/// One message this rank exchanged with a bridge peer (see
/// [`BridgeCommunicator::take_crossings`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// `true` for an activation (forward), `false` for a gradient.
    pub forward: bool,
    /// `true` if this rank sent it, `false` if it received it.
    pub sent: bool,
    /// The peer's world rank.
    pub peer: usize,
    /// Shape of the part.
    pub shape: Vec<usize>,
}

#[derive(Debug, Default)]
struct State {
    last: Vec<Crossing>,
    fwd_stash: Option<Activation>,
    bwd_stash: Option<Activation>,
    sent: VecDeque<Sent>,
    received: VecDeque<Received>,
    mode: ShapeMode,
    cache: ShapeCache,
}

/// Every message shape of a bridge under [`ShapeMode::Static`], derived from the declared
/// per-rank source shape with the routing's `tensor_split` rule (the same on every rank).
struct StaticShapes {
    declared: Meta,
    /// A source lane's tensor after the cp gather.
    src_full: Vec<usize>,
    /// Batch rows of each of a source lane's parts.
    part_rows: Vec<usize>,
    ps: usize,
    pd: usize,
    bd: usize,
    seq: Option<usize>,
    dst_cp: usize,
}

impl StaticShapes {
    fn new(plan: &BridgePlan, shape: &[usize], dtype: DType) -> StaticShapes {
        let bd = plan.batch_dim();
        let seq = plan.seq_dim();
        let mut src_full = shape.to_vec();
        if let Some(s) = seq {
            src_full[s] *= plan.src().cp_size();
        }
        let ps = plan.parts_per_src();
        StaticShapes {
            declared: Meta::new(dtype, shape.to_vec()),
            part_rows: tensor_split_sizes(shape[bd], ps),
            src_full,
            ps,
            pd: plan.parts_per_dst(),
            bd,
            seq,
            dst_cp: plan.dst().cp_size(),
        }
    }
    fn rows(&self, parts: Range<usize>) -> usize {
        parts.map(|u| self.part_rows[u % self.ps]).sum()
    }
    fn with_rows(&self, rows: usize) -> Vec<usize> {
        let mut s = self.src_full.clone();
        s[self.bd] = rows;
        s
    }
    /// The message carrying global parts `parts` (either direction).
    fn route(&self, parts: Range<usize>) -> Meta {
        Meta::new(self.declared.dtype, self.with_rows(self.rows(parts)))
    }
    /// What destination rank with cp coordinate `cp_rank` of lane `j` gets (and sends back).
    fn dst_chunk(&self, j: usize, cp_rank: usize) -> Meta {
        let mut s = self.with_rows(self.rows(j * self.pd..(j + 1) * self.pd));
        if let (Some(q), true) = (self.seq, self.dst_cp > 1) {
            s[q] = tensor_split_sizes(s[q], self.dst_cp)[cp_rank];
        }
        Meta::new(self.declared.dtype, s)
    }
    fn check(&self, op: &'static str, what: &str, expected: &Meta, t: &Activation) -> Result<()> {
        if t.dtype() == expected.dtype && t.shape() == expected.shape.as_slice() {
            return Ok(());
        }
        Err(Error::StaticShape {
            op,
            what: what.to_string(),
            expected: expected.shape.clone(),
            dtype: expected.dtype,
            actual: t.shape().to_vec(),
            actual_dtype: t.dtype(),
        })
    }
}

/// Moves activations and gradients between a source and a destination module.
///
/// Construction is collective over `parent` (every rank of `parent` calls it, in the same order
/// for every bridge): it creates the broadcast-group communicators. Transfers are addressed by
/// world rank over `parent`.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use grid_core::{GroupFactory, HyperGrid};
/// # use multimodule::{Activation, BridgeCommunicator, BridgePlan, DimMapping};
/// # fn f<F: GroupFactory>(factory: &F, world: Arc<F::Comm>) -> multimodule::Result<()> {
/// let g = |tp, dp, off| HyperGrid::new(vec![tp, 1, 1, dp], &["tp", "cp", "pp", "dp"], off).unwrap();
/// let plan = BridgePlan::new("enc", g(2, 2, 0), "llm", g(1, 4, 4), 3, DimMapping::default())?;
/// let bridge = BridgeCommunicator::new(factory, world, plan, 0)?;
/// if bridge.plan().src().contains(bridge.rank()) {
///     bridge.send_forward(&Activation::from_vec(vec![4, 8, 16], vec![0f32; 512])?)?;
/// } else {
///     let act = bridge.recv_forward()?; // Some([2, 8, 16]) on every destination rank
/// }
/// # Ok(()) }
/// ```
pub struct BridgeCommunicator<C: Communicator> {
    plan: BridgePlan,
    me: usize,
    parent: Arc<C>,
    src_bcast: Option<Arc<C>>,
    dst_bcast: Option<Arc<C>>,
    tag: u32,
    state: Mutex<State>,
    pool: Arc<BufferPool>,
}

impl<C: Communicator> BridgeCommunicator<C> {
    /// Builds the bridge on this rank. Collective over `parent`. `tag` is the first of
    /// [`TAGS_PER_BRIDGE`] message tags this bridge uses; give each bridge on the same parent
    /// its own range.
    pub fn new<F: GroupFactory<Comm = C>>(
        factory: &F,
        parent: Arc<C>,
        plan: BridgePlan,
        tag: u32,
    ) -> Result<Self> {
        Self::with_cache(factory, parent, plan, tag, &mut GroupCache::new())
    }

    /// Like [`BridgeCommunicator::new`], reusing broadcast groups created for earlier bridges.
    pub fn with_cache<F: GroupFactory<Comm = C>>(
        factory: &F,
        parent: Arc<C>,
        plan: BridgePlan,
        tag: u32,
        cache: &mut GroupCache<C>,
    ) -> Result<Self> {
        let ranks = parent.global_ranks();
        let me = *ranks.get(parent.rank()).ok_or_else(|| Error::Usage {
            op: "BridgeCommunicator::new",
            message: format!("communicator rank {} has no world rank", parent.rank()),
        })?;
        for r in [plan.src().grid(), plan.dst().grid()] {
            let last = r.offset() + r.size() - 1;
            if ranks.binary_search(&r.offset()).is_err() || ranks.binary_search(&last).is_err() {
                return Err(Error::BridgeConfig {
                    src: plan.src_name().into(),
                    dst: plan.dst_name().into(),
                    message: format!(
                        "the grid {r} is not inside the parent communicator (world ranks {}..={})",
                        ranks.first().copied().unwrap_or(0),
                        ranks.last().copied().unwrap_or(0)
                    ),
                });
            }
        }
        let src_bcast = group_comm(factory, &parent, me, plan.src().broadcast_groups(), cache)?;
        let dst_bcast = group_comm(factory, &parent, me, plan.dst().broadcast_groups(), cache)?;
        Ok(BridgeCommunicator {
            plan,
            me,
            parent,
            src_bcast,
            dst_bcast,
            tag,
            state: Mutex::new(State::default()),
            pool: Arc::new(BufferPool::default()),
        })
    }

    /// The bridge's static plan.
    pub fn plan(&self) -> &BridgePlan {
        &self.plan
    }
    /// This rank (world rank).
    pub fn rank(&self) -> usize {
        self.me
    }
    /// True if this rank is at both boundaries of the bridge (colocated modules).
    pub fn holds_both_ends(&self) -> bool {
        self.plan.src().at_boundary(self.me) && self.plan.dst().at_boundary(self.me)
    }
    /// Hands a tensor (any tensor) to this bridge's pool for reuse as a receive buffer.
    /// Tensors this bridge returned go back on their own when dropped, so this is only needed
    /// for other tensors (or to give one back before it goes out of scope).
    pub fn recycle(&self, t: Activation) {
        self.pool.put(t);
    }

    /// Sets how receivers learn the shapes of what comes ([`ShapeMode`]; the default is
    /// `Variable`). Call it on every rank of both grids alike, between transfers. Errors: a
    /// static shape whose number of dimensions is not the bridge's `tensor_ndim`.
    ///
    /// ```no_run
    /// # fn f<C: grid_core::Communicator>(bridge: &multimodule::BridgeCommunicator<C>) -> multimodule::Result<()> {
    /// use multimodule::ShapeMode;
    /// // Every micro-batch's activation is [4, 128, 1024] bf16 (Megatron's variable_seq_lengths = False).
    /// bridge.set_shape_mode(ShapeMode::Static { shape: vec![4, 128, 1024], dtype: grid_core::DType::BF16 })?;
    /// # Ok(()) }
    /// ```
    pub fn set_shape_mode(&self, mode: ShapeMode) -> Result<()> {
        if let ShapeMode::Static { shape, .. } = &mode {
            if shape.len() != self.plan.tensor_ndim() {
                return Err(Error::BridgeConfig {
                    src: self.plan.src_name().into(),
                    dst: self.plan.dst_name().into(),
                    message: format!(
                        "the static shape {shape:?} has {} dimensions, but the bridge carries {}-D tensors",
                        shape.len(),
                        self.plan.tensor_ndim()
                    ),
                });
            }
        }
        let mut st = self.lock()?;
        st.mode = mode;
        st.cache = ShapeCache::default();
        Ok(())
    }

    /// [`BridgeCommunicator::set_shape_mode`] as a builder.
    pub fn with_shape_mode(self, mode: ShapeMode) -> Result<Self> {
        self.set_shape_mode(mode)?;
        Ok(self)
    }

    /// The current [`ShapeMode`].
    pub fn shape_mode(&self) -> ShapeMode {
        self.state
            .lock()
            .map(|s| s.mode.clone())
            .unwrap_or_default()
    }

    /// The pool receive buffers come from (and returned tensors go back to).
    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    /// Shares one buffer pool between several bridges.
    pub fn set_pool(&mut self, pool: Arc<BufferPool>) {
        self.pool = pool;
    }

    /// Takes the log of bridge messages (leader to leader) this rank sent and received since the
    /// last call (at most the latest 1024), for logging and demos. Empty on non-leaders.
    pub fn take_crossings(&self) -> Vec<Crossing> {
        self.state
            .lock()
            .map(|mut s| std::mem::take(&mut s.last))
            .unwrap_or_default()
    }

    /// Number of forward transfers whose gradient has not come back yet (source side).
    pub fn in_flight(&self) -> usize {
        self.state.lock().map(|s| s.sent.len()).unwrap_or(0)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| Error::Usage {
            op: "bridge",
            message: "a previous call panicked while holding the bridge state".into(),
        })
    }

    fn require(&self, op: &'static str, side: Side) -> Result<()> {
        if self.plan.end(side).contains(self.me) {
            Ok(())
        } else {
            Err(self.plan.not_in(op, self.me, side))
        }
    }

    /// Sends this source rank's activation. Ranks outside the last source stage do nothing (as
    /// in Megatron); tp peers are assumed to hold the same activation.
    pub fn send_forward(&self, act: &Activation) -> Result<()> {
        const OP: &str = "send_forward";
        self.require(OP, Side::Src)?;
        if self.plan.dst().at_boundary(self.me) && self.plan.src().at_boundary(self.me) {
            self.lock()?.fwd_stash = Some(act.clone());
            return Ok(());
        }
        self.run(OP, Some(act), false, None, false).map(|_| ())
    }

    /// Receives the activation on a destination rank: `Some` on the first destination stage,
    /// `None` elsewhere.
    pub fn recv_forward(&self) -> Result<Option<Activation>> {
        const OP: &str = "recv_forward";
        self.require(OP, Side::Dst)?;
        let stash = self.take_stash(OP, true)?;
        Ok(self.run(OP, stash.as_ref(), true, None, false)?.0)
    }

    /// Sends this destination rank's gradient back (first destination stage; others do nothing).
    pub fn send_backward(&self, grad: &Activation) -> Result<()> {
        const OP: &str = "send_backward";
        self.require(OP, Side::Dst)?;
        if self.holds_both_ends() {
            self.lock()?.bwd_stash = Some(grad.clone());
            return Ok(());
        }
        self.run(OP, None, false, Some(grad), false).map(|_| ())
    }

    /// Receives the gradient on a source rank: `Some` on the last source stage, `None`
    /// elsewhere.
    pub fn recv_backward(&self) -> Result<Option<Activation>> {
        const OP: &str = "recv_backward";
        self.require(OP, Side::Src)?;
        let stash = self.take_stash(OP, false)?;
        Ok(self.run(OP, None, false, stash.as_ref(), true)?.1)
    }

    /// Fused source-side step: sends `act` and receives the gradient of the oldest activation in
    /// flight, in one exchange. On a rank holding both ends it runs as `send_forward` then
    /// `recv_backward`.
    pub fn send_forward_recv_backward(&self, act: &Activation) -> Result<Option<Activation>> {
        const OP: &str = "send_forward_recv_backward";
        self.require(OP, Side::Src)?;
        if self.holds_both_ends() {
            self.send_forward(act)?;
            return self.recv_backward();
        }
        Ok(self.run(OP, Some(act), false, None, true)?.1)
    }

    /// Fused destination-side step: sends `grad` and receives the next activation, in one
    /// exchange. On a rank holding both ends it runs as `send_backward` then `recv_forward`.
    pub fn send_backward_recv_forward(&self, grad: &Activation) -> Result<Option<Activation>> {
        const OP: &str = "send_backward_recv_forward";
        self.require(OP, Side::Dst)?;
        if self.holds_both_ends() {
            self.send_backward(grad)?;
            return self.recv_forward();
        }
        Ok(self.run(OP, None, true, Some(grad), false)?.0)
    }

    /// Both ends of the forward transfer in one call, for any rank of either grid: give the
    /// activation if this rank is a source rank, get the destination activation back if it is a
    /// destination rank at the first stage.
    pub fn forward(&self, act: Option<&Activation>) -> Result<Option<Activation>> {
        let want = self.plan.dst().contains(self.me);
        Ok(self.run("forward", act, want, None, false)?.0)
    }

    /// Both ends of the backward transfer in one call (see [`BridgeCommunicator::forward`]).
    pub fn backward(&self, grad: Option<&Activation>) -> Result<Option<Activation>> {
        let want = self.plan.src().contains(self.me);
        Ok(self.run("backward", None, false, grad, want)?.1)
    }

    fn take_stash(&self, op: &'static str, fwd: bool) -> Result<Option<Activation>> {
        if !self.holds_both_ends() {
            return Ok(None);
        }
        let mut st = self.lock()?;
        let s = if fwd {
            st.fwd_stash.take()
        } else {
            st.bwd_stash.take()
        };
        if s.is_none() {
            let first = if fwd { "send_forward" } else { "send_backward" };
            return Err(Error::Usage {
                op,
                message: format!(
                    "rank {} holds both ends of bridge {} -> {}: call {first} for the other module first, or use forward()/backward()",
                    self.me,
                    self.plan.src_name(),
                    self.plan.dst_name()
                ),
            });
        }
        Ok(s)
    }

    fn check_input(&self, op: &'static str, t: &Activation) -> Result<()> {
        if t.ndim() != self.plan.tensor_ndim() {
            return Err(Error::Tensor {
                op,
                message: format!(
                    "bridge {} -> {} carries {}-D tensors, got shape {:?}",
                    self.plan.src_name(),
                    self.plan.dst_name(),
                    self.plan.tensor_ndim(),
                    t.shape()
                ),
            });
        }
        Ok(())
    }

    /// The engine: every public call is a combination of the four roles.
    fn run(
        &self,
        op: &'static str,
        fwd_in: Option<&Activation>,
        want_fwd: bool,
        bwd_in: Option<&Activation>,
        want_bwd: bool,
    ) -> Result<(Option<Activation>, Option<Activation>)> {
        let me = self.me;
        let plan = &self.plan;
        let (src, dst) = (plan.src(), plan.dst());
        let bd = plan.batch_dim();
        let seq = plan.seq_dim();
        let wire = Wire {
            comm: &*self.parent,
            me,
            op,
            pool: Some(&self.pool),
        };
        let mut st = self.lock()?;

        let fwd_in = fwd_in.filter(|_| src.at_boundary(me));
        let bwd_in = bwd_in.filter(|_| dst.at_boundary(me));
        let want_fwd = want_fwd && dst.at_boundary(me);
        let want_bwd = want_bwd && src.at_boundary(me);
        let src_leader_here = src.leaders().contains(&me) && src.at_boundary(me);
        let dst_leader_here = dst.leaders().contains(&me) && dst.at_boundary(me);
        let stat = match &st.mode {
            ShapeMode::Static { shape, dtype } => Some(StaticShapes::new(plan, shape, *dtype)),
            _ => None,
        };
        // Static and learned shapes: payloads travel with their header once a channel's first
        // message has set both ends' expectation (static ones are also checked against the
        // declared shape, on both ends).
        let cached = !matches!(st.mode, ShapeMode::Variable);
        let what = || format!("bridge {} -> {}", plan.src_name(), plan.dst_name());
        // This destination rank's static chunk (what it receives and sends back).
        let my_dst_chunk = stat
            .as_ref()
            .zip(dst.lane_of(me))
            .map(|(s, j)| s.dst_chunk(j, dst.cp_rank(me)));

        // Local checks, all before anything is sent: a failure here is sent on as error headers
        // (and placeholders where a payload is expected) so peers neither wait nor misread.
        let fwd_err: Option<Error> = fwd_in.and_then(|t| {
            self.check_input(op, t).err().or_else(|| {
                let s = stat.as_ref()?;
                if let Err(e) = s.check(op, &what(), &s.declared, t) {
                    return Some(e);
                }
                let sizes = t.split_sizes().filter(|_| src_leader_here)?;
                match batch_split_sizes(t.shape()[bd], s.ps, Some(sizes)) {
                    Ok(rows) if rows == s.part_rows => None,
                    Ok(rows) => Some(Error::Usage {
                        op,
                        message: format!(
                            "{}: static shapes route parts of {:?} rows (tensor_split), but the tensor's split sizes {sizes:?} give {rows:?}: use ShapeMode::Variable or ShapeMode::Learned for per-sample splits",
                            what(),
                            s.part_rows
                        ),
                    }),
                    Err(e) => Some(e),
                }
            })
        });
        let recv_record = if bwd_in.is_some() {
            st.received.pop_front()
        } else {
            None
        };
        let bwd_err: Option<Error> = bwd_in.and_then(|g| {
            if let Err(e) = self.check_input(op, g) {
                return Some(e);
            }
            match (&recv_record, &my_dst_chunk) {
                (Some(r), _) if r.shape != g.shape() => Some(Error::GradientMismatch {
                    op,
                    expected: r.shape.clone(),
                    actual: g.shape().to_vec(),
                }),
                (_, Some(m)) => stat.as_ref()?.check(op, &what(), m, g).err(),
                _ => None,
            }
        });

        // ----- phase 1: cp gathers --------------------------------------------------------
        let mut outs: Vec<Out<'_>> = Vec::new();
        let mut ins: Vec<In> = Vec::new();
        let mut fwd_chain: Vec<usize> = Vec::new();
        let mut bwd_chain: Vec<usize> = Vec::new();
        if fwd_in.is_some() && src.cp_size() > 1 {
            if src_leader_here {
                fwd_chain = src.cp_chain(me);
                ins.extend(fwd_chain.iter().filter(|&&r| r != me).map(|&peer| In {
                    peer,
                    tag: self.tag + FWD_CP,
                    expect: None,
                    verify: stat.as_ref().map(|s| s.declared.clone()),
                }));
            } else if let Some(l) = src.cp_leader_for(me) {
                outs.push(out_msg(l, self.tag + FWD_CP, fwd_in, fwd_err.is_some()));
            }
        }
        if bwd_in.is_some() && dst.cp_size() > 1 {
            if dst_leader_here {
                bwd_chain = dst.cp_chain(me);
                let j = dst.lane_of(me).unwrap_or(0);
                ins.extend(bwd_chain.iter().filter(|&&r| r != me).map(|&peer| In {
                    peer,
                    tag: self.tag + BWD_CP,
                    expect: None,
                    verify: stat.as_ref().map(|s| s.dst_chunk(j, dst.cp_rank(peer))),
                }));
            } else if let Some(l) = dst.cp_leader_for(me) {
                outs.push(out_msg(l, self.tag + BWD_CP, bwd_in, bwd_err.is_some()));
            }
        }
        let mut got = if outs.is_empty() && ins.is_empty() {
            Vec::new()
        } else {
            let cache = cached.then_some(&mut st.cache);
            wire.exchange(outs, &ins, &[], cache)?.into_tensors()
        }
        .into_iter();
        let alloc = |d: DType, n: usize| self.pool.take(d, n);
        // The lane's full tensors on the leaders.
        let gather = |chain: &[usize],
                      own: Option<&Activation>,
                      own_err: &Option<Error>,
                      got: &mut dyn Iterator<Item = Result<Activation>>|
         -> Result<Activation> {
            let mut received = Vec::with_capacity(chain.len());
            let mut first_err = own_err.clone();
            for &r in chain {
                if r == me {
                    if own.is_none() {
                        first_err = first_err.take().or(Some(Error::PeerError { op, peer: me }))
                    }
                } else {
                    match got.next() {
                        Some(Ok(a)) => received.push(a),
                        Some(Err(e)) => first_err = first_err.take().or(Some(e)),
                        None => {
                            first_err = first_err.take().or(Some(Error::PeerError { op, peer: r }))
                        }
                    }
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            let s = seq.ok_or_else(|| Error::Usage {
                op,
                message: "internal: cp gather without a sequence dimension".into(),
            })?;
            let mut others = received.iter();
            let parts: Vec<&Activation> = chain
                .iter()
                .filter_map(|&r| if r == me { own } else { others.next() })
                .collect();
            let full =
                Activation::concat_with(&parts, s, &alloc).map_err(|e| Error::IncompatibleParts {
                    op,
                    ranks: chain.to_vec(),
                    message: e.to_string(),
                });
            for a in received {
                self.pool.put(a);
            }
            full
        };
        let fwd_full: Option<Result<Cow<'_, Activation>>> = if !fwd_chain.is_empty() {
            Some(gather(&fwd_chain, fwd_in, &fwd_err, &mut got).map(|a| {
                Cow::Owned(match fwd_in.and_then(|t| t.split_sizes()) {
                    Some(s) => a.with_split_sizes(s.to_vec()),
                    None => a,
                })
            }))
        } else if src_leader_here {
            fwd_in.map(|t| match &fwd_err {
                Some(e) => Err(e.clone()),
                None => Ok(Cow::Borrowed(t)),
            })
        } else {
            None
        };
        let bwd_full: Option<Result<Cow<'_, Activation>>> = if !bwd_chain.is_empty() {
            Some(gather(&bwd_chain, bwd_in, &bwd_err, &mut got).map(Cow::Owned))
        } else if dst_leader_here {
            bwd_in.map(|g| match &bwd_err {
                Some(e) => Err(e.clone()),
                None => Ok(Cow::Borrowed(g)),
            })
        } else {
            None
        };

        // ----- phase 2: the bridge ----------------------------------------------------------
        let mut outs: Vec<Out<'_>> = Vec::new();
        let mut ins: Vec<In> = Vec::new();
        let mut sent_parts: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut phase2_err: Option<Error> = None;
        let src_index = src.leaders().iter().position(|&l| l == me);
        let dst_index = dst.leaders().iter().position(|&l| l == me);
        if let (Some(full), Some(i), true) = (&fwd_full, src_index, src_leader_here) {
            let routes = plan.send_routes(i);
            match full {
                Ok(a) => {
                    let ps = plan.parts_per_src();
                    match batch_split_sizes(a.shape()[bd], ps, a.split_sizes()) {
                        Ok(part_rows) => {
                            let rows: Vec<usize> = routes
                                .iter()
                                .map(|r| {
                                    part_rows[r.parts.start - i * ps..r.parts.end - i * ps]
                                        .iter()
                                        .sum()
                                })
                                .collect();
                            let msgs = split_messages(
                                a,
                                bd,
                                &rows,
                                routes.iter().map(|r| r.peer),
                                self.tag + FWD,
                                &alloc,
                            )?;
                            for m in &msgs {
                                if let Some(meta) = m.data.meta() {
                                    sent_parts.push((m.peer, meta.shape));
                                }
                            }
                            outs.extend(msgs);
                        }
                        Err(e) => {
                            phase2_err.get_or_insert(e);
                            outs.extend(routes.iter().map(|r| out_failed(r.peer, self.tag + FWD)));
                        }
                    }
                }
                Err(_) => outs.extend(routes.iter().map(|r| out_failed(r.peer, self.tag + FWD))),
            }
        }
        if let (Some(full), Some(j), true) = (&bwd_full, dst_index, dst_leader_here) {
            let routes = plan.recv_routes(j);
            match full {
                Ok(g) => {
                    let rows: Result<Vec<usize>> = match &recv_record {
                        Some(rec) if rec.full == g.shape() && rec.rows.len() == routes.len() => {
                            Ok(rec.rows.iter().map(|&(_, n)| n).collect())
                        }
                        Some(rec) => Err(Error::GradientMismatch {
                            op,
                            expected: rec.full.clone(),
                            actual: g.shape().to_vec(),
                        }),
                        None => {
                            let pd = plan.parts_per_dst();
                            batch_split_sizes(g.shape()[bd], pd, g.split_sizes()).map(|pr| {
                                routes
                                    .iter()
                                    .map(|r| {
                                        pr[r.parts.start - j * pd..r.parts.end - j * pd]
                                            .iter()
                                            .sum()
                                    })
                                    .collect()
                            })
                        }
                    };
                    match rows {
                        Ok(rows) => outs.extend(split_messages(
                            g,
                            bd,
                            &rows,
                            routes.iter().map(|r| r.peer),
                            self.tag + BWD,
                            &alloc,
                        )?),
                        Err(e) => {
                            phase2_err.get_or_insert(e);
                            outs.extend(routes.iter().map(|r| out_failed(r.peer, self.tag + BWD)));
                        }
                    }
                }
                Err(_) => outs.extend(routes.iter().map(|r| out_failed(r.peer, self.tag + BWD))),
            }
        }
        // Record this forward transfer before taking the oldest record for the gradient, so a
        // fused call with nothing else in flight checks against what it sends now.
        if let Some(t) = fwd_in {
            if fwd_err.is_none() {
                st.sent.push_back(Sent {
                    shape: t.shape().to_vec(),
                    parts: std::mem::take(&mut sent_parts),
                });
            }
        }
        let sent_record = if want_bwd { st.sent.pop_front() } else { None };
        let fwd_routes = match (want_fwd && dst_leader_here, dst_index) {
            (true, Some(j)) => plan.recv_routes(j),
            _ => Vec::new(),
        };
        ins.extend(fwd_routes.iter().map(|r| In {
            peer: r.peer,
            tag: self.tag + FWD,
            expect: None,
            verify: stat.as_ref().map(|s| s.route(r.parts.clone())),
        }));
        let bwd_routes = match (want_bwd && src_leader_here, src_index) {
            (true, Some(i)) => plan.send_routes(i),
            _ => Vec::new(),
        };
        ins.extend(bwd_routes.iter().map(|r| In {
            peer: r.peer,
            tag: self.tag + BWD,
            expect: None,
            verify: stat.as_ref().map(|s| s.route(r.parts.clone())),
        }));
        let (nf, nb) = (fwd_routes.len(), bwd_routes.len());
        // Each direction's parts arrive straight in their slices of one output tensor when the
        // batch dimension is the outermost one (or there is a single part).
        let mut joins = Vec::new();
        if nf > 0 {
            joins.push(Join {
                ins: 0..nf,
                dim: bd,
            });
        }
        if nb > 0 {
            joins.push(Join {
                ins: nf..nf + nb,
                dim: bd,
            });
        }
        let mut crossings: Vec<Crossing> = outs
            .iter()
            .filter_map(|o| {
                Some(Crossing {
                    forward: (o.tag - self.tag) == FWD,
                    sent: true,
                    peer: o.peer,
                    shape: o.data.meta()?.shape,
                })
            })
            .collect();
        let (parts, mut joined) = if outs.is_empty() && ins.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let cache = cached.then_some(&mut st.cache);
            let ex = wire.exchange(outs, &ins, &joins, cache)?;
            (ex.parts, ex.joined)
        };
        for (i, r) in ins.iter().zip(&parts) {
            if let Ok(p) = r {
                crossings.push(Crossing {
                    forward: (i.tag - self.tag) == FWD,
                    sent: false,
                    peer: i.peer,
                    shape: p.meta.shape.clone(),
                });
            }
        }
        st.last.extend(crossings);
        let excess = st.last.len().saturating_sub(MAX_CROSSINGS);
        st.last.drain(..excess);
        let mut joined = joined.drain(..);
        let fwd_joined = if nf > 0 { joined.next() } else { None };
        let bwd_joined = if nb > 0 { joined.next() } else { None };

        // Leaders assemble what they received.
        let mut fwd_rows: Vec<(usize, usize)> = Vec::new();
        let fwd_leader_result: Option<Result<Activation>> = fwd_joined.map(|full| {
            let metas = part_metas(&parts[..nf])?;
            fwd_rows = fwd_routes
                .iter()
                .zip(&metas)
                .map(|(r, m)| (r.peer, m.shape.get(bd).copied().unwrap_or(0)))
                .collect();
            full
        });
        let bwd_leader_result: Option<Result<Activation>> = bwd_joined.map(|full| {
            let metas = part_metas(&parts[nf..nf + nb])?;
            if let Some(rec) = &sent_record {
                for ((peer, expected), m) in rec.parts.iter().zip(&metas) {
                    if *expected != m.shape {
                        if let Ok(a) = full {
                            self.pool.put(a);
                        }
                        return Err(Error::GradientShape {
                            op,
                            peer: *peer,
                            expected: expected.clone(),
                            actual: m.shape.clone(),
                        });
                    }
                }
            }
            full
        });

        // ----- phase 3: broadcasts and cp narrowing --------------------------------------------
        let fwd_out = if want_fwd {
            let leader = dst.leader_of(me).unwrap_or(me);
            let group = dst.broadcast_group_of(me).unwrap_or_else(|| vec![me]);
            let full = distribute(
                Some(&self.pool),
                op,
                self.dst_bcast.as_deref(),
                &group,
                me,
                leader,
                fwd_leader_result,
            )?;
            let full_shape = full.shape().to_vec();
            let mine = narrow_cp(full, seq, dst.cp_size(), dst.cp_rank(me), &self.pool)?;
            st.received.push_back(Received {
                shape: mine.shape().to_vec(),
                full: full_shape,
                rows: fwd_rows,
            });
            Some(mine)
        } else {
            None
        };
        let bwd_out = if want_bwd {
            let leader = src.leader_of(me).unwrap_or(me);
            let group = src.broadcast_group_of(me).unwrap_or_else(|| vec![me]);
            let full = distribute(
                Some(&self.pool),
                op,
                self.src_bcast.as_deref(),
                &group,
                me,
                leader,
                bwd_leader_result,
            )?;
            let mine = narrow_cp(full, seq, src.cp_size(), src.cp_rank(me), &self.pool)?;
            if let Some(rec) = &sent_record {
                if rec.shape != mine.shape() {
                    return Err(Error::GradientMismatch {
                        op,
                        expected: rec.shape.clone(),
                        actual: mine.shape().to_vec(),
                    });
                }
            }
            Some(mine)
        } else {
            None
        };
        if let Some(e) = fwd_err.or(bwd_err).or(phase2_err) {
            return Err(e);
        }
        // A failed gather on a leader (peer error) surfaces here.
        if let Some(Err(e)) = fwd_full {
            return Err(e);
        }
        if let Some(Err(e)) = bwd_full {
            return Err(e);
        }
        // What the caller gets back returns its buffer to the pool when dropped.
        Ok((
            fwd_out.map(|a| a.pooled(&self.pool)),
            bwd_out.map(|a| a.pooled(&self.pool)),
        ))
    }
}

fn out_msg<'a>(peer: usize, tag: u32, t: Option<&'a Activation>, failed: bool) -> Out<'a> {
    match (t, failed) {
        (Some(t), false) => Out {
            peer,
            tag,
            data: OutData::Slice {
                src: t,
                range: 0..t.numel(),
                shape: t.shape().to_vec(),
            },
            expect: None,
        },
        _ => out_failed(peer, tag),
    }
}

fn out_failed(peer: usize, tag: u32) -> Out<'static> {
    Out {
        peer,
        tag,
        data: OutData::Failed,
        expect: None,
    }
}

/// One message per peer with `rows[k]` batch rows each: the caller's buffer itself when there
/// is one message, slices of it when the rows are contiguous, else copies into `alloc`'s
/// buffers (which the exchange hands back to the pool once sent).
fn split_messages<'a>(
    t: &'a Activation,
    bd: usize,
    rows: &[usize],
    peers: impl Iterator<Item = usize>,
    tag: u32,
    alloc: &dyn Fn(DType, usize) -> grid_core::HostBuffer,
) -> Result<Vec<Out<'a>>> {
    let peers: Vec<usize> = peers.collect();
    if rows.len() == 1 {
        return Ok(peers
            .into_iter()
            .take(1)
            .map(|peer| out_msg(peer, tag, Some(t), false))
            .collect());
    }
    let mut start = 0;
    let contiguous = t.contiguous_range(bd, 0..t.shape()[bd]).is_some();
    if contiguous {
        let mut out = Vec::with_capacity(rows.len());
        for (&n, &peer) in rows.iter().zip(&peers) {
            let range = t.contiguous_range(bd, start..start + n).unwrap_or(0..0);
            let mut shape = t.shape().to_vec();
            shape[bd] = n;
            out.push(Out {
                peer,
                tag,
                data: OutData::Slice {
                    src: t,
                    range,
                    shape,
                },
                expect: None,
            });
            start += n;
        }
        Ok(out)
    } else {
        let parts = t.split_along_with(bd, rows, alloc)?;
        Ok(parts
            .into_iter()
            .zip(peers)
            .map(|(p, peer)| Out {
                peer,
                tag,
                data: OutData::Owned(p),
                expect: None,
            })
            .collect())
    }
}

/// The headers of received parts, or the first failure.
fn part_metas(parts: &[Result<Part>]) -> Result<Vec<Meta>> {
    parts
        .iter()
        .map(|p| p.as_ref().map(|p| p.meta.clone()).map_err(Clone::clone))
        .collect()
}

/// This rank's cp chunk of `full` along the sequence (the whole of it with cp = 1).
fn narrow_cp(
    full: Activation,
    seq: Option<usize>,
    cp: usize,
    cp_rank: usize,
    pool: &BufferPool,
) -> Result<Activation> {
    match seq {
        Some(s) if cp > 1 => {
            let sizes = tensor_split_sizes(full.shape()[s], cp);
            let start: usize = sizes[..cp_rank].iter().sum();
            let mine = full.narrow_with(s, start, sizes[cp_rank], &|d, n| pool.take(d, n));
            pool.put(full);
            mine
        }
        _ => Ok(full),
    }
}
