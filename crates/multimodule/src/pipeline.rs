//! [`MultiModulePipelineCommunicator`]: one communicator per rank that sends and receives by
//! module name (docs/semantics.md §6.4): point-to-point along each module's pipeline, bridges at the
//! module boundaries.

use crate::bridge::{BridgeCommunicator, GroupCache, TAGS_PER_BRIDGE};
use crate::error::{Error, Result};
use crate::ordered::OrderedMap;
use crate::plan::{PipelinePlan, RankModuleInfo, RankPlan};
use crate::pool::BufferPool;
use crate::spec::PipelineSpec;
use crate::tensor::Activation;
use crate::wire::{In, Meta, Out, OutData, ShapeCache, ShapeMode, Wire};
use grid_core::{Communicator, GroupFactory};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Tags per module for its pipeline point-to-point messages.
const TAGS_PER_MODULE: u32 = 4;

#[derive(Debug, Default)]
struct P2pRecords {
    /// Shapes sent forward to the next stage whose gradient has not come back.
    sent: VecDeque<Vec<usize>>,
    /// Shapes received from the previous stage whose gradient has not been sent back.
    received: VecDeque<Vec<usize>>,
}

/// Inputs of a module, keyed by producer: the upstream module's name for an activation that
/// came over a bridge, the module's own name for one from its previous pipeline stage.
pub type ModuleInputs = OrderedMap<Activation>;

/// A rank's communicator for a multi-module pipeline.
///
/// Built from a [`PipelinePlan`] (the same plan on every rank) on every rank of `parent`
/// (collective: it creates each bridge's broadcast groups), then called with the name of the
/// module whose step runs. Everything it knows about stages and bridges is the plan's: its
/// stage numbers are the plan's entry for this rank and each bridge runs the plan's
/// [`crate::BridgePlan`], so `grid pipeline` shows what it does.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use grid_core::GroupFactory;
/// # use multimodule::{Activation, MultiModulePipelineCommunicator, PipelinePlan};
/// # fn f<F: GroupFactory>(factory: &F, world: Arc<F::Comm>) -> multimodule::Result<()> {
/// let plan = PipelinePlan::from_spec_file("pipeline.json")?;   // what `grid pipeline` prints
/// let mm = MultiModulePipelineCommunicator::new(factory, world, &plan, 0)?;
/// for m in mm.modules().to_vec() {
///     let inputs = mm.recv_forward(&m.name)?;            // {"image_encoder": .., "audio_encoder": ..}
///     let out = Activation::from_vec(vec![2, 4, 8], vec![0f32; 64])?; // the module's forward step
///     mm.send_forward(&m.name, &out)?;
///     let grad = mm.recv_backward(&m.name)?;             // summed over downstream modules
///     mm.send_backward(&m.name, &inputs)?;               // gradients keyed like the inputs
/// }
/// # Ok(()) }
/// ```
pub struct MultiModulePipelineCommunicator<C: Communicator> {
    spec: PipelineSpec,
    total_stages: usize,
    /// The plan's entry for this rank (`None`: the rank is in no module).
    rank_plan: Option<RankPlan>,
    me: usize,
    parent: Arc<C>,
    /// One per plan bridge, in the plan's order.
    bridges: Vec<BridgeCommunicator<C>>,
    modules: Vec<RankModuleInfo>,
    records: Vec<Mutex<P2pRecords>>,
    module_tag: u32,
    pool: Arc<BufferPool>,
    /// Shape mode of each spec module (its pipeline p2p and its outgoing bridges).
    modes: Mutex<Vec<ShapeMode>>,
    /// Channel shapes of the pipeline p2p messages (modules in `ShapeMode::Learned`).
    p2p_cache: Mutex<ShapeCache>,
}

impl<C: Communicator> MultiModulePipelineCommunicator<C> {
    /// Builds the communicator of this rank from `plan`. Collective over `parent`, which must
    /// contain every module's ranks; every rank must pass the same plan. Tags `tag_base ..` are
    /// used: [`TAGS_PER_BRIDGE`] per bridge, then 4 per module.
    pub fn new<F: GroupFactory<Comm = C>>(
        factory: &F,
        parent: Arc<C>,
        plan: &PipelinePlan,
        tag_base: u32,
    ) -> Result<Self> {
        let me = *parent
            .global_ranks()
            .get(parent.rank())
            .ok_or_else(|| Error::Usage {
                op: "MultiModulePipelineCommunicator::new",
                message: "the parent communicator has no world rank for this process".into(),
            })?;
        let mut cache = GroupCache::new();
        let mut bridges = Vec::new();
        for (k, bridge) in plan.bridge_plans().iter().enumerate() {
            let tag = tag_base + k as u32 * TAGS_PER_BRIDGE;
            bridges.push(BridgeCommunicator::with_cache(
                factory,
                parent.clone(),
                bridge.clone(),
                tag,
                &mut cache,
            )?);
        }
        let pool = Arc::new(BufferPool::default());
        for b in &mut bridges {
            b.set_pool(pool.clone());
        }
        let module_tag = tag_base + bridges.len() as u32 * TAGS_PER_BRIDGE;
        let modules = plan.rank_modules(me)?;
        let records = modules
            .iter()
            .map(|_| Mutex::new(P2pRecords::default()))
            .collect();
        let spec = plan.spec();
        Ok(MultiModulePipelineCommunicator {
            spec: spec.clone(),
            total_stages: plan.total_stages(),
            rank_plan: plan.rank(me).cloned(),
            me,
            parent,
            bridges,
            modules,
            records,
            module_tag,
            pool,
            modes: Mutex::new(vec![ShapeMode::Variable; spec.modules().len()]),
            p2p_cache: Mutex::new(ShapeCache::default()),
        })
    }

    /// The spec of the plan it was built from.
    pub fn spec(&self) -> &PipelineSpec {
        &self.spec
    }
    /// The plan's entry for this rank ([`PipelinePlan::rank`]; `None` for a rank in no module).
    pub fn rank_plan(&self) -> Option<&RankPlan> {
        self.rank_plan.as_ref()
    }
    /// This rank (world rank).
    pub fn rank(&self) -> usize {
        self.me
    }
    /// The modules this rank belongs to, in spec order.
    pub fn modules(&self) -> &[RankModuleInfo] {
        &self.modules
    }
    /// Total number of pipeline stages (the plan's).
    pub fn total_stages(&self) -> usize {
        self.total_stages
    }
    /// This rank's 0-based stage (the maximum over its modules); [`Error::RankInNoModule`] for
    /// a rank in no module.
    pub fn current_stage(&self) -> Result<usize> {
        self.rank_plan
            .as_ref()
            .map(|p| p.current_stage)
            .ok_or(Error::RankInNoModule { rank: self.me })
    }
    /// Some module of this rank is a source module at its first stage.
    pub fn is_first_stage(&self) -> bool {
        self.rank_plan.as_ref().is_some_and(|p| p.is_first_stage)
    }
    /// Some module of this rank is a sink module at its last stage.
    pub fn is_last_stage(&self) -> bool {
        self.rank_plan.as_ref().is_some_and(|p| p.is_last_stage)
    }
    /// The rank is at `module`'s first pipeline stage.
    pub fn is_module_first_stage(&self, module: &str) -> Result<bool> {
        Ok(self.info("is_module_first_stage", module)?.1.pp_rank == 0)
    }
    /// The rank is at `module`'s last pipeline stage.
    pub fn is_module_last_stage(&self, module: &str) -> Result<bool> {
        let m = self.info("is_module_last_stage", module)?.1;
        Ok(m.pp_rank + 1 == m.pp_size)
    }
    /// The bridge of edge `src -> dst`.
    pub fn bridge(&self, src: &str, dst: &str) -> Option<&BridgeCommunicator<C>> {
        self.bridges
            .iter()
            .find(|b| b.plan().src_name() == src && b.plan().dst_name() == dst)
    }
    /// Hands a tensor (any tensor) to this communicator's pool for reuse as a receive buffer.
    /// Activations and gradients this communicator returned go back on their own when dropped,
    /// so this is only needed for other tensors.
    pub fn recycle(&self, t: Activation) {
        self.pool.put(t);
    }

    /// Sets how receivers learn the shapes of `module`'s outputs ([`ShapeMode`]; the default is
    /// `Variable`): along the module's pipeline (activations forward, gradients back) and over
    /// every bridge out of it. With [`ShapeMode::Static`] the shape is what every rank of the
    /// module passes to `send_forward` for it; no header round trip is paid, and a tensor of
    /// another shape is an error on its sender before anything is sent. Call it on every rank
    /// (any rank may call it for any module of the spec), between transfers.
    ///
    /// ```no_run
    /// # fn f<C: grid_core::Communicator>(mm: &multimodule::MultiModulePipelineCommunicator<C>) -> multimodule::Result<()> {
    /// use multimodule::ShapeMode;
    /// mm.set_shape_mode("llm", ShapeMode::Static { shape: vec![4, 128, 1024], dtype: grid_core::DType::BF16 })?;
    /// mm.set_shape_mode("image_encoder", ShapeMode::Learned)?;
    /// # Ok(()) }
    /// ```
    pub fn set_shape_mode(&self, module: &str, mode: ShapeMode) -> Result<()> {
        let idx = self.spec.module_index(module)?;
        let ndim = self.spec.modules()[idx].output_ndim;
        if let ShapeMode::Static { shape, .. } = &mode {
            if shape.len() != ndim {
                return Err(Error::Usage {
                    op: "set_shape_mode",
                    message: format!(
                        "the static shape {shape:?} of module '{module}' has {} dimensions, but its output_ndim is {ndim}",
                        shape.len()
                    ),
                });
            }
        }
        for b in &self.bridges {
            if b.plan().src_name() == module {
                b.set_shape_mode(mode.clone())?;
            }
        }
        let tag = self.module_tag + idx as u32 * TAGS_PER_MODULE;
        self.p2p_cache
            .lock()
            .map_err(|_| poisoned())?
            .forget(tag..tag + TAGS_PER_MODULE);
        let mut modes = self.modes.lock().map_err(|_| poisoned())?;
        if let Some(m) = modes.get_mut(idx) {
            *m = mode;
        }
        Ok(())
    }

    /// The [`ShapeMode`] of `module`'s outputs.
    pub fn shape_mode(&self, module: &str) -> Result<ShapeMode> {
        let idx = self.spec.module_index(module)?;
        let modes = self.modes.lock().map_err(|_| poisoned())?;
        Ok(modes.get(idx).cloned().unwrap_or_default())
    }

    /// The pool receive buffers come from (shared by the pipeline p2p and every bridge).
    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    /// Every bridge, in the plan's order (bridge `k` runs [`PipelinePlan::bridge_plans`]`()[k]`).
    pub fn bridges(&self) -> &[BridgeCommunicator<C>] {
        &self.bridges
    }

    fn info(&self, op: &'static str, module: &str) -> Result<(usize, &RankModuleInfo)> {
        self.modules
            .iter()
            .enumerate()
            .find(|(_, m)| m.name == module)
            .ok_or_else(|| Error::ModuleNotOnRank {
                op,
                rank: self.me,
                module: module.to_string(),
                held: self.modules.iter().map(|m| m.name.clone()).collect(),
            })
    }

    fn src_name(&self, bridge: usize) -> &str {
        self.bridges
            .get(bridge)
            .map(|b| b.plan().src_name())
            .unwrap_or_default()
    }

    /// (previous, next) stage ranks of this rank in module `m`.
    fn neighbours(&self, m: &RankModuleInfo) -> Result<(Option<usize>, Option<usize>)> {
        let grid = &self.spec.modules()[m.index].grid;
        let d = grid.dim_index("pp")?;
        let stride = grid.strides()[d];
        let prev = (m.pp_rank > 0).then(|| self.me - stride);
        let next = (m.pp_rank + 1 < m.pp_size).then(|| self.me + stride);
        Ok((prev, next))
    }

    fn records(&self, slot: usize) -> Result<std::sync::MutexGuard<'_, P2pRecords>> {
        self.records[slot].lock().map_err(|_| Error::Usage {
            op: "pipeline",
            message: "a previous call panicked while holding the module state".into(),
        })
    }

    fn p2p(
        &self,
        op: &'static str,
        m: &RankModuleInfo,
        send: Option<(usize, Option<&Activation>, u32)>,
        recv: Option<(usize, u32)>,
    ) -> Result<Option<Activation>> {
        let tag = self.module_tag + m.index as u32 * TAGS_PER_MODULE;
        let wire = Wire {
            comm: &*self.parent,
            me: self.me,
            op,
            pool: Some(&self.pool),
        };
        let mode = self
            .modes
            .lock()
            .map_err(|_| poisoned())?
            .get(m.index)
            .cloned()
            .unwrap_or_default();
        let expect = match &mode {
            ShapeMode::Static { shape, dtype } => Some(Meta::new(*dtype, shape.clone())),
            _ => None,
        };
        // Static shapes: a tensor of another shape is not sent (its peer gets an error).
        let mut static_err = None;
        let outs: Vec<Out<'_>> = send
            .map(|(peer, t, k)| {
                let t = t.filter(|t| match &expect {
                    Some(e) if Meta::of(t) != *e => {
                        static_err = Some(Error::StaticShape {
                            op,
                            what: format!("module '{}'", m.name),
                            expected: e.shape.clone(),
                            dtype: e.dtype,
                            actual: t.shape().to_vec(),
                            actual_dtype: t.dtype(),
                        });
                        false
                    }
                    _ => true,
                });
                Out {
                    peer,
                    tag: tag + k,
                    data: match t {
                        Some(t) => OutData::Slice {
                            src: t,
                            range: 0..t.numel(),
                            shape: t.shape().to_vec(),
                        },
                        None => OutData::Failed,
                    },
                    expect: None,
                }
            })
            .into_iter()
            .collect();
        let ins: Vec<In> = recv
            .map(|(peer, k)| In {
                peer,
                tag: tag + k,
                expect: None,
                verify: expect.clone(),
            })
            .into_iter()
            .collect();
        let mut cache = match mode {
            ShapeMode::Variable => None,
            _ => Some(self.p2p_cache.lock().map_err(|_| poisoned())?),
        };
        let mut got = wire
            .exchange(outs, &ins, &[], cache.as_deref_mut())?
            .into_tensors();
        if let Some(e) = static_err {
            return Err(e);
        }
        Ok(got.pop().transpose()?.map(|a| a.pooled(&self.pool)))
    }

    /// Receives `module`'s inputs: at its first stage one activation per incoming bridge, keyed
    /// by the upstream module (nothing for a source module); at later stages the previous
    /// stage's output, keyed by `module` itself.
    pub fn recv_forward(&self, module: &str) -> Result<ModuleInputs> {
        const OP: &str = "recv_forward";
        let (slot, m) = self.info(OP, module)?;
        let mut out = OrderedMap::new();
        if m.pp_rank == 0 {
            for &e in &m.bridges_as_dest {
                if let Some(t) = self.bridges[e].recv_forward()? {
                    out.push(self.src_name(e), t);
                }
            }
        } else {
            let (prev, _) = self.neighbours(m)?;
            if let Some(p) = prev {
                let t = self
                    .p2p(OP, m, None, Some((p, 0)))?
                    .ok_or_else(|| missing(OP, p))?;
                self.records(slot)?.received.push_back(t.shape().to_vec());
                out.push(module, t);
            }
        }
        Ok(out)
    }

    /// Sends `module`'s output: over every outgoing bridge at its last stage (the same tensor to
    /// each downstream module; nothing for a sink), else to the next stage.
    pub fn send_forward(&self, module: &str, output: &Activation) -> Result<()> {
        const OP: &str = "send_forward";
        let (slot, m) = self.info(OP, module)?;
        if m.pp_rank + 1 == m.pp_size {
            for &e in &m.bridges_as_src {
                self.bridges[e].send_forward(output)?;
            }
        } else if let (_, Some(n)) = self.neighbours(m)? {
            self.p2p(OP, m, Some((n, Some(output), 0)), None)?;
            self.records(slot)?.sent.push_back(output.shape().to_vec());
        }
        Ok(())
    }

    /// Receives the gradient of `module`'s output: at its last stage the **sum** over every
    /// outgoing bridge (Megatron keeps only the last one), `None` for a sink; else from the next
    /// stage.
    pub fn recv_backward(&self, module: &str) -> Result<Option<Activation>> {
        const OP: &str = "recv_backward";
        let (slot, m) = self.info(OP, module)?;
        if m.pp_rank + 1 == m.pp_size {
            let mut sum: Option<Activation> = None;
            for &e in &m.bridges_as_src {
                if let Some(g) = self.bridges[e].recv_backward()? {
                    add_grad(&mut sum, g)?;
                }
            }
            Ok(sum)
        } else {
            let (_, next) = self.neighbours(m)?;
            let Some(n) = next else { return Ok(None) };
            let g = self
                .p2p(OP, m, None, Some((n, 2)))?
                .ok_or_else(|| missing(OP, n))?;
            self.check_sent(OP, slot, n, &g)?;
            Ok(Some(g))
        }
    }

    /// Sends the gradients of `module`'s inputs, keyed as [`Self::recv_forward`] returned them.
    pub fn send_backward(&self, module: &str, grads: &ModuleInputs) -> Result<()> {
        const OP: &str = "send_backward";
        let (slot, m) = self.info(OP, module)?;
        if m.pp_rank == 0 {
            for &e in &m.bridges_as_dest {
                let g = self.grad_for(OP, grads, self.src_name(e))?;
                self.bridges[e].send_backward(g)?;
            }
        } else if let (Some(p), _) = self.neighbours(m)? {
            let g = self.grad_for(OP, grads, module)?;
            if let Err(e) = self.check_received(OP, slot, g) {
                // Tell the previous stage instead of leaving it waiting.
                self.p2p(OP, m, Some((p, None, 2)), None)?;
                return Err(e);
            }
            self.p2p(OP, m, Some((p, Some(g), 2)), None)?;
        }
        Ok(())
    }

    /// Fused: sends `module`'s output and receives the gradient of the oldest output in flight
    /// (summed over outgoing bridges at the last stage).
    pub fn send_forward_recv_backward(
        &self,
        module: &str,
        output: &Activation,
    ) -> Result<Option<Activation>> {
        const OP: &str = "send_forward_recv_backward";
        let (slot, m) = self.info(OP, module)?;
        if m.pp_rank + 1 == m.pp_size {
            let mut sum: Option<Activation> = None;
            for &e in &m.bridges_as_src {
                if let Some(g) = self.bridges[e].send_forward_recv_backward(output)? {
                    add_grad(&mut sum, g)?;
                }
            }
            Ok(sum)
        } else {
            let (_, next) = self.neighbours(m)?;
            let Some(n) = next else { return Ok(None) };
            self.records(slot)?.sent.push_back(output.shape().to_vec());
            let g = self
                .p2p(OP, m, Some((n, Some(output), 0)), Some((n, 2)))?
                .ok_or_else(|| missing(OP, n))?;
            self.check_sent(OP, slot, n, &g)?;
            Ok(Some(g))
        }
    }

    /// Fused: sends the gradients of `module`'s inputs and receives its next inputs.
    pub fn send_backward_recv_forward(
        &self,
        module: &str,
        grads: &ModuleInputs,
    ) -> Result<ModuleInputs> {
        const OP: &str = "send_backward_recv_forward";
        let (slot, m) = self.info(OP, module)?;
        let mut out = OrderedMap::new();
        if m.pp_rank == 0 {
            for &e in &m.bridges_as_dest {
                let g = self.grad_for(OP, grads, self.src_name(e))?;
                if let Some(t) = self.bridges[e].send_backward_recv_forward(g)? {
                    out.push(self.src_name(e), t);
                }
            }
        } else if let (Some(p), _) = self.neighbours(m)? {
            let g = self.grad_for(OP, grads, module)?;
            let checked = self.check_received(OP, slot, g);
            let t = self.p2p(
                OP,
                m,
                Some((p, checked.as_ref().ok().map(|_| g), 2)),
                Some((p, 0)),
            );
            checked?;
            let t = t?.ok_or_else(|| missing(OP, p))?;
            self.records(slot)?.received.push_back(t.shape().to_vec());
            out.push(module, t);
        }
        Ok(out)
    }

    fn grad_for<'g>(
        &self,
        op: &'static str,
        grads: &'g ModuleInputs,
        key: &str,
    ) -> Result<&'g Activation> {
        grads.get(key).ok_or_else(|| Error::Usage {
            op,
            message: format!(
                "no gradient for input '{key}' (gradients given for {:?}): key gradients like the inputs recv_forward returned",
                grads.keys().collect::<Vec<_>>()
            ),
        })
    }

    fn check_sent(&self, op: &'static str, slot: usize, peer: usize, g: &Activation) -> Result<()> {
        if let Some(expected) = self.records(slot)?.sent.pop_front() {
            if expected != g.shape() {
                return Err(Error::GradientShape {
                    op,
                    peer,
                    expected,
                    actual: g.shape().to_vec(),
                });
            }
        }
        Ok(())
    }

    fn check_received(&self, op: &'static str, slot: usize, g: &Activation) -> Result<()> {
        if let Some(expected) = self.records(slot)?.received.pop_front() {
            if expected != g.shape() {
                return Err(Error::GradientMismatch {
                    op,
                    expected,
                    actual: g.shape().to_vec(),
                });
            }
        }
        Ok(())
    }
}

fn poisoned() -> Error {
    Error::Usage {
        op: "pipeline",
        message: "a previous call panicked while holding the communicator state".into(),
    }
}

fn missing(op: &'static str, peer: usize) -> Error {
    Error::Protocol {
        op,
        peer,
        message: "no message".into(),
    }
}

fn add_grad(sum: &mut Option<Activation>, g: Activation) -> Result<()> {
    match sum {
        None => *sum = Some(g),
        Some(s) => s.add_assign(&g)?,
    }
    Ok(())
}
