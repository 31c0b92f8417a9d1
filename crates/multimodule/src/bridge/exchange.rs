//! The exchange engine behind every [`BridgeCommunicator`] call: the cp gather, the bridge
//! proper and the broadcast (see the module docs of `bridge`), the message shapes of
//! [`ShapeMode::Static`] and the helpers that build and take apart the messages.

use super::{
    BridgeCommunicator, Crossing, Received, Sent, BWD, BWD_CP, FWD, FWD_CP, MAX_CROSSINGS,
};
use crate::error::{Error, Result};
use crate::pool::BufferPool;
use crate::routing::BridgePlan;
use crate::tensor::{batch_split_sizes, tensor_split_sizes, Activation};
use crate::wire::{distribute, In, Join, Meta, Out, OutData, Part, ShapeMode, Wire};
use grid_core::{Communicator, DType};
use std::borrow::Cow;
use std::ops::Range;

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

impl<C: Communicator> BridgeCommunicator<C> {
    /// The engine: every public call is a combination of the four roles.
    pub(super) fn run(
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
        // Payloads travel with their header once a channel's history has set both ends'
        // expectation: its first message in static and learned shapes (static ones are also
        // checked against the declared shape, on both ends), the same shape twice in a row in
        // variable shapes (see `ShapeCache`).
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
            let cache = Some(&mut st.cache);
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
            let cache = Some(&mut st.cache);
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
