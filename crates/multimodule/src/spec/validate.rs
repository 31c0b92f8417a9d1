//! Validation of a spec: names, grids, the topology (cycles, sinks), the language model, the dim
//! mapping, colocation groups and undeclared rank overlaps.

use super::{DimMapping, ModuleSpec, PipelineSpec};
use crate::error::{Error, Result};
use crate::ordered::OrderedMap;
use std::collections::HashMap;

impl PipelineSpec {
    /// Checks everything (see the module docs of `spec`) and builds the validated spec.
    pub(super) fn validate(
        modules: Vec<ModuleSpec>,
        topology: OrderedMap<Vec<String>>,
        language_model: Option<String>,
        dim_mapping: DimMapping,
        colocated: Vec<Vec<String>>,
        world_size: Option<usize>,
    ) -> Result<PipelineSpec> {
        if modules.is_empty() {
            return Err(Error::EmptySpec);
        }
        let mut index: HashMap<&str, usize> = HashMap::with_capacity(modules.len());
        for (i, m) in modules.iter().enumerate() {
            if m.name.is_empty() {
                return Err(Error::EmptyModuleName);
            }
            if index.insert(m.name.as_str(), i).is_some() {
                return Err(Error::DuplicateModule {
                    name: m.name.clone(),
                });
            }
        }
        let known = || modules.iter().map(|m| m.name.clone()).collect::<Vec<_>>();
        let lookup = |name: &str, context: &str| -> Result<usize> {
            index
                .get(name)
                .copied()
                .ok_or_else(|| Error::UnknownModule {
                    name: name.to_string(),
                    context: context.to_string(),
                    known: known(),
                })
        };
        for m in &modules {
            if m.grid.dim_index("pp").is_err() {
                return Err(Error::MissingPp {
                    module: m.name.clone(),
                    dims: m.grid.dim_names().to_vec(),
                });
            }
            if m.output_ndim != 2 && m.output_ndim != 3 {
                return Err(Error::BadOutputNdim {
                    module: m.name.clone(),
                    value: m.output_ndim,
                });
            }
            if let Some(w) = world_size {
                let (first, end) = m.rank_range();
                if end > w {
                    return Err(Error::GridOutsideWorld {
                        module: m.name.clone(),
                        first,
                        end,
                        world_size: w,
                    });
                }
            }
        }
        // Topology.
        let n = modules.len();
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut seen_key = vec![false; n];
        // last_source[b] == a: edge a -> b is already listed (repeated edges are kept once, in
        // constant time each: a module may have many downstream modules).
        let mut last_source = vec![usize::MAX; n];
        for (k, targets) in topology.iter() {
            let a = lookup(k, "topology key")?;
            if std::mem::replace(&mut seen_key[a], true) {
                return Err(Error::DuplicateTopologyKey {
                    name: k.to_string(),
                });
            }
            for t in targets {
                let b = match index.get(t.as_str()) {
                    Some(&b) => b,
                    None => lookup(t, &format!("topology entry of '{k}'"))?,
                };
                if std::mem::replace(&mut last_source[b], a) != a {
                    succ[a].push(b);
                }
            }
        }
        let mut pred: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (a, s) in succ.iter().enumerate() {
            for &b in s {
                pred[b].push(a);
            }
        }
        let topo = topological_order(&succ, &pred).map_err(|cycle| Error::Cycle {
            cycle: cycle.iter().map(|&i| modules[i].name.clone()).collect(),
        })?;
        if succ.iter().all(|s| !s.is_empty()) {
            return Err(Error::NoSink);
        }
        if let Some(lm) = &language_model {
            lookup(lm, "language_model")?;
        }
        dim_mapping.validate()?;
        // Colocation.
        let mut group_of: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (gi, group) in colocated.iter().enumerate() {
            if group.len() < 2 {
                return Err(Error::BadColocated {
                    group: group.clone(),
                    message: "a colocation group needs at least two modules".into(),
                });
            }
            for name in group {
                let i = lookup(name, "colocated")?;
                // Pushed below for each member: the last entry is this group iff seen before.
                if group_of[i].last() == Some(&gi) {
                    return Err(Error::BadColocated {
                        group: group.clone(),
                        message: format!("module '{name}' appears twice"),
                    });
                }
                group_of[i].push(gi);
            }
        }
        // Overlaps: sort by first rank and sweep, so disjoint layouts cost O(n log n).
        let mut by_start: Vec<usize> = (0..n).collect();
        by_start.sort_by_key(|&i| modules[i].rank_range());
        let mut active: Vec<usize> = Vec::new();
        for &i in &by_start {
            let (first, end) = modules[i].rank_range();
            active.retain(|&j| modules[j].rank_range().1 > first);
            for &j in &active {
                if !group_of[i].iter().any(|g| group_of[j].contains(g)) {
                    let (a, b) = if j < i { (j, i) } else { (i, j) };
                    let (a_first, a_end) = modules[a].rank_range();
                    let (b_first, b_end) = modules[b].rank_range();
                    return Err(Error::UndeclaredOverlap {
                        a: modules[a].name.clone(),
                        b: modules[b].name.clone(),
                        a_first,
                        a_end,
                        b_first,
                        b_end,
                    });
                }
            }
            let _ = end;
            active.push(i);
        }
        Ok(PipelineSpec {
            world_size,
            modules,
            succ,
            pred,
            topo,
            language_model,
            dim_mapping,
            colocated,
        })
    }
}

/// Kahn's algorithm in O(V + E). On a cycle, returns one cycle (module indices, the first
/// repeated at the end).
fn topological_order(
    succ: &[Vec<usize>],
    pred: &[Vec<usize>],
) -> std::result::Result<Vec<usize>, Vec<usize>> {
    let n = succ.len();
    let mut indeg: Vec<usize> = pred.iter().map(Vec::len).collect();
    let mut queue: std::collections::VecDeque<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(a) = queue.pop_front() {
        order.push(a);
        for &b in &succ[a] {
            indeg[b] -= 1;
            if indeg[b] == 0 {
                queue.push_back(b);
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every node left has a predecessor that is also left: walk predecessors until a repeat.
    let left: Vec<bool> = indeg.iter().map(|&d| d > 0).collect();
    let start = (0..n).find(|&i| left[i]).unwrap_or(0);
    let mut pos = vec![usize::MAX; n];
    let mut walk = Vec::new();
    let mut x = start;
    while pos[x] == usize::MAX {
        pos[x] = walk.len();
        walk.push(x);
        match pred[x].iter().copied().find(|&p| left[p]) {
            Some(p) => x = p,
            None => break,
        }
    }
    let mut cycle: Vec<usize> = walk[pos[x].min(walk.len())..].to_vec();
    cycle.reverse();
    if let Some(&f) = cycle.first() {
        cycle.push(f);
    }
    Err(cycle)
}
