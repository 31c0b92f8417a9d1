//! The `moe-dispatch` example's logic: Megatron-Core's MoE token dispatcher in miniature, over
//! the expert-parallel groups of a layout.
//!
//! Every rank of an expert-parallel group is a source of tokens and the home of one expert (its
//! rank in the group). Each source draws a number of tokens and routes each token to an expert
//! with a seeded random generator ([`route`]); then the group
//! 1. exchanges the per-expert token counts (an all-to-all of one count per peer),
//! 2. **dispatches** the tokens with an uneven all-to-all (`all_to_all_v`: each source sends
//!    `count · hidden` values to each expert, sorted by expert, in token order),
//! 3. lets every expert check what arrived ([`expert_forward`]: the tags name a source of the
//!    right block, tokens of one source in increasing order, every value as [`token`] made it)
//!    and "compute" ([`expert_compute`], a deterministic function of the token and the expert),
//! 4. **combines** with the reverse uneven all-to-all (the send and receive counts swapped),
//! 5. puts the tokens back into their original order and checks each one against
//!    `expert_compute(expert it was routed to, token(source, index))` ([`combine_check`]).
//!
//! Routing is uneven on purpose: token counts per source are drawn from `0..=2·tokens`, expert
//! [`idle_expert`] of every group receives no token from anyone, and source [`silent_source`]
//! sends none (so one rank sends nothing and one receives nothing in every group of ep ≥ 2).
//!
//! Every value is a small integer, so every `f32` result is exact and compared with `==`.

use grid_core::{
    build_collection, Communicator, CommunicatorExt, Error, GroupFactory, LayoutConfig, LayoutPlan,
    Result,
};

/// The example's configuration: the layout's sizes and the token stream.
///
/// ```
/// let c = grid_programs::moe::MoeConfig::default();
/// assert_eq!((c.world, c.tp, c.pp, c.ep), (8, 1, 1, 4));
/// c.validate()?;
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// World size.
    pub world: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Expert-parallel size (the size of each expert-parallel group).
    pub ep: usize,
    /// Expert tensor-parallel size (`None`: equal to `tp`, Megatron's default).
    pub etp: Option<usize>,
    /// Mean tokens per rank: each rank draws its count from `0..=2·tokens`.
    pub tokens: usize,
    /// Values per token (at least 2: the source-rank tag and the token-index tag).
    pub hidden: usize,
    /// Seed of the routing.
    pub seed: u64,
    /// Use the nonblocking forms (`iall_to_all_v`) instead of the blocking ones.
    pub nonblocking: bool,
}

impl Default for MoeConfig {
    fn default() -> Self {
        MoeConfig {
            world: 8,
            tp: 1,
            pp: 1,
            ep: 4,
            etp: None,
            tokens: 6,
            hidden: 8,
            seed: 7,
            nonblocking: false,
        }
    }
}

/// Largest accepted `tokens`: token indices (up to `2·tokens`) stay exact in `f32` (below 2^24).
pub const MAX_TOKENS: usize = 1 << 20;
/// Largest accepted `hidden`.
pub const MAX_HIDDEN: usize = 1 << 16;
/// Largest accepted world size (ranks and experts stay exact in `f32` through the compute).
pub const MAX_WORLD: usize = 4096;

impl MoeConfig {
    /// The layout: world, tp, pp, ep and etp as given, every other size 1, Megatron's default
    /// order.
    ///
    /// ```
    /// let plan = grid_core::LayoutPlan::new(grid_programs::moe::MoeConfig::default().layout())?;
    /// assert_eq!(plan.expert_dp(), 2);
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn layout(&self) -> LayoutConfig {
        let mut c = LayoutConfig::new(self.world);
        c.tp = self.tp;
        c.pp = self.pp;
        c.ep = self.ep;
        c.etp = self.etp;
        c
    }

    /// Checks the token stream's limits (the layout is checked by `LayoutPlan::new`).
    ///
    /// ```
    /// let mut c = grid_programs::moe::MoeConfig::default();
    /// c.hidden = 1;
    /// assert!(c.validate().unwrap_err().to_string().contains("--hidden 1"));
    /// ```
    pub fn validate(&self) -> Result<()> {
        if self.hidden < 2 || self.hidden > MAX_HIDDEN {
            return Err(Error::Invalid(format!(
                "--hidden {}: a token needs at least 2 values (the source-rank and token-index tags) and at most {MAX_HIDDEN}",
                self.hidden
            )));
        }
        if self.tokens > MAX_TOKENS {
            return Err(Error::Invalid(format!(
                "--tokens {}: at most {MAX_TOKENS} tokens per rank on average (token indices must stay exact in f32)",
                self.tokens
            )));
        }
        if self.world == 0 || self.world > MAX_WORLD {
            return Err(Error::Invalid(format!(
                "--world {}: the example runs 1..={MAX_WORLD} ranks",
                self.world
            )));
        }
        Ok(())
    }
}

/// SplitMix64, the seeded generator of the routing (no dependency, same stream everywhere).
///
/// ```
/// let mut a = grid_programs::moe::Rng::new(7);
/// let mut b = grid_programs::moe::Rng::new(7);
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(5) < 5);
/// ```
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// The expert (group rank) that no source routes a token to, in every group of size `ep ≥ 2`:
/// `seed mod ep`. `None` for `ep = 1` (the only expert gets everything).
///
/// ```
/// assert_eq!(grid_programs::moe::idle_expert(7, 4), Some(3));
/// assert_eq!(grid_programs::moe::idle_expert(7, 1), None);
/// ```
pub fn idle_expert(seed: u64, ep: usize) -> Option<usize> {
    (ep >= 2).then(|| (seed % ep as u64) as usize)
}

/// The source (group rank) that sends no token, in every group of size `ep ≥ 2`: the rank after
/// [`idle_expert`]. `None` for `ep = 1`.
///
/// ```
/// assert_eq!(grid_programs::moe::silent_source(7, 4), Some(0));
/// ```
pub fn silent_source(seed: u64, ep: usize) -> Option<usize> {
    idle_expert(seed, ep).map(|i| (i + 1) % ep)
}

/// One source's routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    /// The expert (group rank) of each token, in token order.
    pub experts: Vec<usize>,
    /// Tokens per expert (`send_counts` of the dispatch, in tokens).
    pub counts: Vec<usize>,
    /// Token indices sorted by expert, in token order within an expert: the dispatch order.
    pub order: Vec<usize>,
}

/// Routes the tokens of the source with world rank `global_rank`, group rank `group_rank` in an
/// expert-parallel group of `ep` ranks: `0..=2·tokens` tokens (none for the [`silent_source`]),
/// each to an expert drawn uniformly from the group's experts except the [`idle_expert`].
///
/// ```
/// use grid_programs::moe::route;
/// let r = route(7, 5, 1, 4, 6);
/// assert_eq!(r.counts.iter().sum::<usize>(), r.experts.len());
/// assert_eq!(r.counts[3], 0); // the idle expert of seed 7
/// assert!(route(7, 4, 0, 4, 6).experts.is_empty()); // the silent source of seed 7
/// ```
pub fn route(
    seed: u64,
    global_rank: usize,
    group_rank: usize,
    ep: usize,
    tokens: usize,
) -> Routing {
    let mut rng = Rng::new(seed ^ (global_rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let idle = idle_expert(seed, ep);
    let n = if silent_source(seed, ep) == Some(group_rank) {
        0
    } else {
        rng.below(2 * tokens + 1)
    };
    let choices: Vec<usize> = (0..ep).filter(|&e| Some(e) != idle).collect();
    let experts: Vec<usize> = (0..n).map(|_| choices[rng.below(choices.len())]).collect();
    let mut counts = vec![0; ep];
    for &e in &experts {
        counts[e] += 1;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&t| experts[t]); // stable: token order within an expert
    Routing {
        experts,
        counts,
        order,
    }
}

/// Token `index` of the source with world rank `src`: `[src, index, v2, v3, ...]` with
/// `v_h = (131·src + 17·index + 7·h) mod 1021`, every value an exact small integer.
///
/// ```
/// assert_eq!(grid_programs::moe::token(2, 3, 4), vec![2.0, 3.0, 327.0, 334.0]);
/// ```
pub fn token(src: usize, index: usize, hidden: usize) -> Vec<f32> {
    (0..hidden)
        .map(|h| match h {
            0 => src as f32,
            1 => index as f32,
            _ => ((131 * src + 17 * index + 7 * h) % 1021) as f32,
        })
        .collect()
}

/// What expert `expert` makes of a token: the two tags unchanged, every other value
/// `x·(expert + 2) + expert + 1` (exact: below 2^24 for `expert < 4096`).
///
/// ```
/// assert_eq!(grid_programs::moe::expert_compute(1, &[2.0, 3.0, 10.0]), vec![2.0, 3.0, 32.0]);
/// ```
pub fn expert_compute(expert: usize, x: &[f32]) -> Vec<f32> {
    let (m, a) = ((expert + 2) as f32, (expert + 1) as f32);
    x.iter()
        .enumerate()
        .map(|(h, &v)| if h < 2 { v } else { v * m + a })
        .collect()
}

/// The dispatch's send buffer of source `src` (world rank): its tokens in [`Routing::order`].
///
/// ```
/// use grid_programs::moe::{pack, route, token};
/// let r = route(1, 3, 2, 4, 6);
/// let buf = pack(&r, 3, 2);
/// assert_eq!(buf.len(), 2 * r.experts.len());
/// if let Some(&t) = r.order.first() { assert_eq!(&buf[..2], &token(3, t, 2)[..]); }
/// ```
pub fn pack(routing: &Routing, src: usize, hidden: usize) -> Vec<f32> {
    routing
        .order
        .iter()
        .flat_map(|&t| token(src, t, hidden))
        .collect()
}

/// Element counts (`tokens · hidden`) from token counts.
///
/// ```
/// assert_eq!(grid_programs::moe::elements(&[1, 0, 3], 4), vec![4, 0, 12]);
/// ```
pub fn elements(token_counts: &[usize], hidden: usize) -> Vec<usize> {
    token_counts.iter().map(|&c| c * hidden).collect()
}

/// The expert's side: checks the dispatched tokens `recv` (blocks of `recv_counts[j]` tokens
/// from the group's rank `j`, whose world rank is `sources[j]`) and returns the computed tokens
/// in the same layout, plus one message per problem (empty when every token is as [`token`]
/// made it, tagged with the block's source, in increasing index order within a block).
///
/// ```
/// use grid_programs::moe::{expert_forward, token};
/// let recv: Vec<f32> = [token(4, 0, 3), token(4, 2, 3)].concat();
/// let (out, problems) = expert_forward(0, &recv, &[0, 2], &[0, 4], 3);
/// assert!(problems.is_empty(), "{problems:?}");
/// assert_eq!(out.len(), 6);
/// let (_, problems) = expert_forward(0, &recv, &[2, 0], &[0, 4], 3);
/// assert!(problems[0].contains("tagged as from world rank 4"), "{problems:?}");
/// ```
pub fn expert_forward(
    expert: usize,
    recv: &[f32],
    recv_counts: &[usize],
    sources: &[usize],
    hidden: usize,
) -> (Vec<f32>, Vec<String>) {
    let mut problems = Vec::new();
    let want_len: usize = recv_counts.iter().sum::<usize>() * hidden;
    if recv.len() != want_len || recv_counts.len() != sources.len() {
        problems.push(format!(
            "expert {expert}: received {} values for counts {recv_counts:?} of {hidden} values (expected {want_len}) from sources {sources:?}",
            recv.len()
        ));
        return (Vec::new(), problems);
    }
    let mut out = Vec::with_capacity(recv.len());
    let mut tokens = recv.chunks_exact(hidden);
    for (j, (&count, &src)) in recv_counts.iter().zip(sources).enumerate() {
        let mut last: Option<usize> = None;
        for k in 0..count {
            let Some(x) = tokens.next() else { break };
            let (tag_src, tag_idx) = (x[0], x[1]);
            let index = tag_idx as usize;
            if tag_src != src as f32 {
                problems.push(format!(
                    "expert {expert}: token {k} of the block from group rank {j} (world rank {src}) is tagged as from world rank {tag_src}"
                ));
            } else if tag_idx < 0.0 || tag_idx.fract() != 0.0 || last.is_some_and(|l| index <= l) {
                problems.push(format!(
                    "expert {expert}: token {k} from world rank {src} has index {tag_idx}, after index {last:?}: tokens of one source must arrive in increasing order"
                ));
            } else if x != token(src, index, hidden).as_slice() {
                problems.push(format!(
                    "expert {expert}: token {index} from world rank {src} arrived as {x:?}, sent as {:?}",
                    token(src, index, hidden)
                ));
            }
            last = Some(index);
            out.extend(expert_compute(expert, x));
        }
    }
    (out, problems)
}

/// The source's side after the combine: `back` holds, per expert in group order, the computed
/// tokens this source sent there. Puts them back in token order and checks each against
/// `expert_compute(routing.experts[t], token(src, t))`; returns one message per problem.
///
/// ```
/// use grid_programs::moe::{combine_check, expert_compute, route, token};
/// let r = route(3, 1, 1, 4, 5);
/// let back: Vec<f32> = r.order.iter().flat_map(|&t| expert_compute(r.experts[t], &token(1, t, 3))).collect();
/// assert!(combine_check(&r, 1, &back, 3).is_empty());
/// ```
pub fn combine_check(routing: &Routing, src: usize, back: &[f32], hidden: usize) -> Vec<String> {
    let n = routing.experts.len();
    if back.len() != n * hidden {
        return vec![format!(
            "source {src}: {} values came back for {n} tokens of {hidden} values (expected {})",
            back.len(),
            n * hidden
        )];
    }
    let mut restored: Vec<Option<&[f32]>> = vec![None; n];
    for (&t, x) in routing.order.iter().zip(back.chunks_exact(hidden)) {
        restored[t] = Some(x);
    }
    let mut problems = Vec::new();
    for (t, x) in restored.into_iter().enumerate() {
        let e = routing.experts[t];
        let want = expert_compute(e, &token(src, t, hidden));
        match x {
            Some(x) if x == want.as_slice() => {}
            Some(x) => problems.push(format!(
                "source {src}: token {t} (routed to expert {e}) came back as {x:?}, expected {want:?}"
            )),
            None => problems.push(format!("source {src}: token {t} did not come back")),
        }
    }
    problems
}

/// What one rank did: its expert-parallel group and the token counts it sent and received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// World rank.
    pub rank: usize,
    /// World ranks of this rank's expert-parallel group, in group order.
    pub group: Vec<usize>,
    /// Tokens this rank (as a source) sent to each expert of its group.
    pub sent: Vec<usize>,
    /// Tokens this rank (as an expert) received from each source of its group.
    pub received: Vec<usize>,
    /// Problems this rank found (as an expert and as a source); 0 when every check passed.
    pub problems: usize,
}

impl RankReport {
    /// Fixed-width encoding (`3 + 3·ep` values) for an all-gather over the world.
    fn encode(&self, ep: usize) -> Vec<i64> {
        let mut v = vec![
            self.rank as i64,
            self.problems as i64,
            self.group.len() as i64,
        ];
        for list in [&self.group, &self.sent, &self.received] {
            v.extend((0..ep).map(|i| list.get(i).map_or(-1, |&x| x as i64)));
        }
        v
    }
    fn decode(v: &[i64], ep: usize) -> Result<RankReport> {
        let bad = || {
            Error::Invalid(format!(
                "moe-dispatch: a rank's report {v:?} is not 3 + 3·{ep} non-negative numbers"
            ))
        };
        let u = |x: i64| usize::try_from(x).map_err(|_| bad());
        if v.len() != 3 + 3 * ep || u(v[2])? != ep {
            return Err(bad());
        }
        let list = |k: usize| -> Result<Vec<usize>> {
            v[3 + k * ep..3 + (k + 1) * ep]
                .iter()
                .map(|&x| u(x))
                .collect()
        };
        Ok(RankReport {
            rank: u(v[0])?,
            problems: u(v[1])?,
            group: list(0)?,
            sent: list(1)?,
            received: list(2)?,
        })
    }
}

/// One rank's outcome of [`run_rank`].
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// This rank's report.
    pub report: RankReport,
    /// This rank's problems, one message each (empty when every check passed).
    pub problems: Vec<String>,
    /// Every rank's report, in world-rank order (an all-gather over the world).
    pub all: Vec<RankReport>,
}

/// Runs the dispatch on this rank; call on every rank of `world` with the same `cfg`. Builds
/// the layout's communicators with [`build_collection`], takes this rank's expert-parallel
/// group (`ep`), and runs the five steps of the [module docs](self): counts all-to-all,
/// dispatch (`all_to_all_v`, or `iall_to_all_v` with [`MoeConfig::nonblocking`]), expert check
/// and compute, combine (the reverse exchange), source check. A failed check is reported in
/// [`RankOutcome::problems`]; a communicator error is returned as the error.
///
/// ```
/// use grid_programs::moe::{run_rank, MoeConfig};
/// let cfg = MoeConfig::default();
/// let out = backend_local::run(cfg.world, &Default::default(), |f, w| run_rank(f, &w, &cfg))?;
/// assert!(out.iter().all(|o| o.problems.is_empty()));
/// assert_eq!(out[0].all.len(), 8);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn run_rank<F: GroupFactory>(
    factory: &F,
    world: &F::Comm,
    cfg: &MoeConfig,
) -> Result<RankOutcome> {
    cfg.validate()?;
    if world.size() != cfg.world {
        return Err(Error::Invalid(format!(
            "moe-dispatch: the layout needs --world {} ranks, but the world communicator has {} (start {} ranks or pass --world {})",
            cfg.world,
            world.size(),
            cfg.world,
            world.size()
        )));
    }
    let plan = LayoutPlan::new(cfg.layout())?;
    let built = build_collection(factory, world, &plan)?;
    let ep = built.collection.ep.clone().ok_or_else(|| {
        Error::Invalid("moe-dispatch: this rank has no expert-parallel group in the layout".into())
    })?;
    let me = world
        .global_ranks()
        .get(world.rank())
        .copied()
        .unwrap_or(world.rank());
    let (n, e) = (ep.size(), ep.rank());
    let members = ep.global_ranks().to_vec();
    let hidden = cfg.hidden;

    // 1. Route and exchange the per-expert token counts.
    let routing = route(cfg.seed, me, e, n, cfg.tokens);
    let counts: Vec<i64> = routing.counts.iter().map(|&c| c as i64).collect();
    let mut incoming = vec![0i64; n];
    ep.all_to_all_into(&counts[..], &mut incoming[..])?;
    let received: Vec<usize> = incoming
        .iter()
        .enumerate()
        .map(|(j, &c)| {
            usize::try_from(c).map_err(|_| {
                Error::Invalid(format!(
                    "moe-dispatch: source {j} announced {c} tokens for expert {e}"
                ))
            })
        })
        .collect::<Result<_>>()?;

    // 2. Dispatch.
    let send = pack(&routing, me, hidden);
    let send_counts = elements(&routing.counts, hidden);
    let recv_counts = elements(&received, hidden);
    let recv_len: usize = recv_counts.iter().sum();
    let dispatched = if cfg.nonblocking {
        ep.iall_to_all_v(send, send_counts.clone(), recv_counts.clone())?
            .wait()?
    } else {
        let mut recv = vec![f32::NAN; recv_len];
        ep.all_to_all_v_into(&send[..], &send_counts, &mut recv[..], &recv_counts)?;
        recv
    };

    // 3. The expert checks and computes.
    let (computed, mut problems) = expert_forward(e, &dispatched, &received, &members, hidden);

    // 4. Combine: the reverse exchange.
    let back = if cfg.nonblocking {
        ep.iall_to_all_v(computed, recv_counts, send_counts)?
            .wait()?
    } else {
        let mut back = vec![f32::NAN; routing.experts.len() * hidden];
        ep.all_to_all_v_into(&computed[..], &recv_counts, &mut back[..], &send_counts)?;
        back
    };

    // 5. The source checks every token.
    problems.extend(combine_check(&routing, me, &back, hidden));

    let report = RankReport {
        rank: me,
        group: members,
        sent: routing.counts.clone(),
        received,
        problems: problems.len(),
    };
    let mine = report.encode(n);
    let mut all = vec![0i64; mine.len() * world.size()];
    world.all_gather_into(&mine[..], &mut all[..])?;
    let all = all
        .chunks_exact(mine.len())
        .map(|c| RankReport::decode(c, n))
        .collect::<Result<Vec<_>>>()?;
    Ok(RankOutcome {
        report,
        problems,
        all,
    })
}

/// The summary the example prints: the configuration, one block per expert-parallel group (the
/// source × expert token matrix, the idle expert and the silent source) and a verdict line.
/// Returns the lines and whether every rank's checks passed.
///
/// ```
/// use grid_programs::moe::{run_rank, summary, MoeConfig};
/// let cfg = MoeConfig::default();
/// let out = backend_local::run(cfg.world, &Default::default(), |f, w| run_rank(f, &w, &cfg))?;
/// let (lines, ok) = summary(&cfg, &out[0].all);
/// assert!(ok && lines.last().unwrap().starts_with("moe-dispatch: ok"));
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn summary(cfg: &MoeConfig, all: &[RankReport]) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut groups: Vec<&Vec<usize>> = all.iter().map(|r| &r.group).collect();
    groups.sort();
    groups.dedup();
    let total: usize = all.iter().map(|r| r.sent.iter().sum::<usize>()).sum();
    let problems: usize = all.iter().map(|r| r.problems).sum();
    for g in &groups {
        let rows: Vec<&RankReport> = g
            .iter()
            .filter_map(|&m| all.iter().find(|r| r.rank == m))
            .collect();
        let idle = idle_expert(cfg.seed, g.len())
            .map(|i| format!("idle expert {i} (world rank {})", g[i]))
            .unwrap_or_else(|| "one expert".into());
        let silent = silent_source(cfg.seed, g.len())
            .map(|i| format!(", silent source {i} (world rank {})", g[i]))
            .unwrap_or_default();
        lines.push(format!("expert-parallel group {g:?}: {idle}{silent}"));
        for r in &rows {
            lines.push(format!(
                "  world rank {:>3} sends {:?} ({}), receives {:?} ({}){}",
                r.rank,
                r.sent,
                tokens(r.sent.iter().sum()),
                r.received,
                tokens(r.received.iter().sum()),
                if r.problems == 0 {
                    String::new()
                } else {
                    format!(" -- {} PROBLEMS", r.problems)
                }
            ));
        }
    }
    let ok = problems == 0 && !all.is_empty();
    lines.push(if ok {
        format!(
            "moe-dispatch: ok: {total} tokens dispatched over {} expert-parallel groups came back to their sources, in order, with the expected values",
            groups.len()
        )
    } else {
        format!("moe-dispatch: FAILED: {problems} problems (see stderr)")
    });
    (lines, ok)
}

/// `1 token`, `3 tokens`.
fn tokens(n: usize) -> String {
    if n == 1 {
        "1 token".into()
    } else {
        format!("{n} tokens")
    }
}

/// The configuration line the example prints first.
///
/// ```
/// let c = grid_programs::moe::MoeConfig::default();
/// let plan = grid_core::LayoutPlan::new(c.layout())?;
/// assert!(grid_programs::moe::describe(&c, &plan).starts_with("moe-dispatch: world 8, tp 1, pp 1, ep 4"));
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn describe(cfg: &MoeConfig, plan: &LayoutPlan) -> String {
    format!(
        "moe-dispatch: world {}, tp {}, pp {}, ep {}, expert tp {}, expert dp {}; tokens per rank drawn from 0..={} ({} f32 values each), seed {}, {} all_to_all_v",
        cfg.world,
        cfg.tp,
        cfg.pp,
        cfg.ep,
        plan.expert_tp(),
        plan.expert_dp(),
        2 * cfg.tokens,
        cfg.hidden,
        cfg.seed,
        if cfg.nonblocking { "nonblocking" } else { "blocking" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole dispatch and combine of one group, simulated without a communicator: what an
    /// uneven all-to-all would deliver, computed from every source's routing.
    fn simulate(seed: u64, members: &[usize], tokens: usize, hidden: usize) -> Vec<String> {
        let ep = members.len();
        let routes: Vec<Routing> = members
            .iter()
            .enumerate()
            .map(|(j, &g)| route(seed, g, j, ep, tokens))
            .collect();
        let sends: Vec<Vec<f32>> = routes
            .iter()
            .zip(members)
            .map(|(r, &g)| pack(r, g, hidden))
            .collect();
        // Block (src j -> expert e) starts at the sum of j's counts before e.
        let block = |j: usize, e: usize| -> &[f32] {
            let start: usize = routes[j].counts[..e].iter().sum::<usize>() * hidden;
            &sends[j][start..start + routes[j].counts[e] * hidden]
        };
        let mut problems = Vec::new();
        let mut outs: Vec<Vec<f32>> = Vec::new();
        let mut recv_counts_of: Vec<Vec<usize>> = Vec::new();
        for e in 0..ep {
            let recv: Vec<f32> = (0..ep).flat_map(|j| block(j, e).to_vec()).collect();
            let counts: Vec<usize> = (0..ep).map(|j| routes[j].counts[e]).collect();
            let (out, p) = expert_forward(e, &recv, &counts, members, hidden);
            problems.extend(p);
            outs.push(out);
            recv_counts_of.push(counts);
        }
        for (j, r) in routes.iter().enumerate() {
            let back: Vec<f32> = (0..ep)
                .flat_map(|e| {
                    let start: usize = recv_counts_of[e][..j].iter().sum::<usize>() * hidden;
                    outs[e][start..start + recv_counts_of[e][j] * hidden].to_vec()
                })
                .collect();
            problems.extend(combine_check(r, members[j], &back, hidden));
        }
        problems
    }

    #[test]
    fn every_token_returns_in_a_simulated_exchange() {
        for seed in 0..20 {
            for members in [
                vec![0],
                vec![1, 5],
                vec![0, 2, 4, 6],
                vec![3, 4, 5, 6, 7, 8, 9, 10],
            ] {
                let p = simulate(seed, &members, 5, 4);
                assert!(p.is_empty(), "seed {seed} members {members:?}: {p:?}");
            }
        }
    }

    #[test]
    fn routing_is_uneven_with_an_idle_expert_and_a_silent_source() {
        let (seed, ep) = (7, 4);
        let idle = idle_expert(seed, ep).unwrap();
        let silent = silent_source(seed, ep).unwrap();
        assert_ne!(idle, silent);
        let routes: Vec<Routing> = (0..ep).map(|j| route(seed, 10 + j, j, ep, 6)).collect();
        assert!(routes[silent].experts.is_empty());
        assert!(routes.iter().all(|r| r.counts[idle] == 0));
        assert!(routes.iter().all(|r| r.counts.len() == ep));
        // Uneven: not every (source, expert) count is the same.
        let all: Vec<usize> = routes.iter().flat_map(|r| r.counts.clone()).collect();
        assert!(all.iter().any(|&c| c != all[0]), "{all:?}");
        // Deterministic per seed and rank, different across ranks.
        assert_eq!(route(seed, 11, 1, ep, 6), routes[1]);
        assert_ne!(route(seed + 1, 11, 1, ep, 6).experts, routes[1].experts);
    }

    #[test]
    fn order_sorts_by_expert_and_keeps_token_order() {
        let r = route(5, 2, 1, 4, 20);
        let keys: Vec<(usize, usize)> = r.order.iter().map(|&t| (r.experts[t], t)).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert_eq!(r.order.len(), r.experts.len());
    }

    #[test]
    fn the_checks_catch_wrong_deliveries() {
        let hidden = 3;
        // A token swapped between two sources' blocks.
        let recv: Vec<f32> = [token(1, 0, hidden), token(2, 0, hidden)].concat();
        let (_, p) = expert_forward(0, &recv, &[1, 1], &[2, 1], hidden);
        assert_eq!(p.len(), 2, "{p:?}");
        // Out of order within a block.
        let recv: Vec<f32> = [token(1, 3, hidden), token(1, 2, hidden)].concat();
        let (_, p) = expert_forward(0, &recv, &[2], &[1], hidden);
        assert!(p[0].contains("increasing order"), "{p:?}");
        // A changed value.
        let mut recv = token(1, 0, hidden);
        recv[2] += 1.0;
        let (_, p) = expert_forward(0, &recv, &[1], &[1], hidden);
        assert!(p[0].contains("arrived as"), "{p:?}");
        // A length that does not match the counts.
        let (_, p) = expert_forward(0, &recv, &[2], &[1], hidden);
        assert!(p[0].contains("expected 6"), "{p:?}");
        // Combine: a token computed by the wrong expert, and a short buffer.
        let r = Routing {
            experts: vec![1, 0],
            counts: vec![1, 1],
            order: vec![1, 0],
        };
        let good: Vec<f32> = [
            expert_compute(0, &token(4, 1, hidden)),
            expert_compute(1, &token(4, 0, hidden)),
        ]
        .concat();
        assert!(combine_check(&r, 4, &good, hidden).is_empty());
        let wrong: Vec<f32> = [
            expert_compute(0, &token(4, 1, hidden)),
            expert_compute(0, &token(4, 0, hidden)),
        ]
        .concat();
        let p = combine_check(&r, 4, &wrong, hidden);
        assert!(
            p.len() == 1 && p[0].contains("token 0 (routed to expert 1)"),
            "{p:?}"
        );
        assert!(combine_check(&r, 4, &good[..3], hidden)[0].contains("expected 6"));
    }

    #[test]
    fn values_stay_exact_at_the_limits() {
        let x = token(MAX_WORLD - 1, 2 * MAX_TOKENS, 4);
        let y = expert_compute(MAX_WORLD - 1, &x);
        for v in x.iter().chain(&y) {
            assert!(v.fract() == 0.0 && *v < (1u32 << 24) as f32, "{v}");
        }
        assert_eq!(y[0] as usize, MAX_WORLD - 1);
        assert_eq!(y[1] as usize, 2 * MAX_TOKENS);
    }

    #[test]
    fn reports_round_trip_and_bad_ones_are_refused() {
        let r = RankReport {
            rank: 5,
            group: vec![1, 3, 5, 7],
            sent: vec![2, 0, 1, 0],
            received: vec![0, 4, 0, 3],
            problems: 0,
        };
        let v = r.encode(4);
        assert_eq!(v.len(), 15);
        assert_eq!(RankReport::decode(&v, 4).unwrap(), r);
        assert!(RankReport::decode(&v[..14], 4).is_err());
        let mut neg = v.clone();
        neg[4] = -1;
        let msg = RankReport::decode(&neg, 4).unwrap_err().to_string();
        assert!(msg.contains("non-negative"), "{msg}");
    }

    #[test]
    fn summary_reports_problems() {
        let cfg = MoeConfig {
            world: 2,
            ep: 2,
            ..MoeConfig::default()
        };
        let rep = |rank: usize, problems: usize| RankReport {
            rank,
            group: vec![0, 1],
            sent: vec![0, 0],
            received: vec![0, 0],
            problems,
        };
        let (lines, ok) = summary(&cfg, &[rep(0, 0), rep(1, 0)]);
        assert!(ok, "{lines:?}");
        assert_eq!(lines.len(), 4, "{lines:?}"); // one group line, two rank lines, the verdict
        let (lines, ok) = summary(&cfg, &[rep(0, 0), rep(1, 2)]);
        assert!(!ok);
        assert!(lines[2].ends_with("-- 2 PROBLEMS"), "{lines:?}");
        assert!(lines[3].contains("FAILED: 2 problems"), "{lines:?}");
        assert!(!summary(&cfg, &[]).1, "no reports is not a success");
    }

    #[test]
    fn config_limits_are_named() {
        let mut c = MoeConfig {
            tokens: MAX_TOKENS + 1,
            ..MoeConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("--tokens"));
        c.tokens = 1;
        c.world = 0;
        assert!(c.validate().unwrap_err().to_string().contains("--world 0"));
    }
}
