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
//!    what they get along the batch dimension in sender order. Each part travels with a small
//!    header (its status and shape); when the receiver cannot expect the shape yet (see
//!    [`ShapeMode`]), it takes the headers first, then the payloads.
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
use crate::tensor::Activation;
use crate::wire::{ShapeCache, ShapeMode};
use grid_core::{Communicator, GroupFactory};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

// The public type and its calls are here; the engine they all run is in `exchange`.
mod exchange;

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

#[derive(Debug)]
struct State {
    last: Vec<Crossing>,
    fwd_stash: Option<Activation>,
    bwd_stash: Option<Activation>,
    sent: VecDeque<Sent>,
    received: VecDeque<Received>,
    mode: ShapeMode,
    cache: ShapeCache,
}

impl Default for State {
    fn default() -> Self {
        let mode = ShapeMode::default();
        State {
            last: Vec::new(),
            fwd_stash: None,
            bwd_stash: None,
            sent: VecDeque::new(),
            received: VecDeque::new(),
            cache: ShapeCache::for_mode(&mode),
            mode,
        }
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
        st.cache = ShapeCache::for_mode(&mode);
        st.mode = mode;
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
}
