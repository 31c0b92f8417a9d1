//! Pipeline stage accounting over the module DAG (docs/semantics.md §6.2–6.3), in linear time.
//!
//! A module weighs its pipeline size. The total number of stages is the heaviest path through
//! the DAG; the stage count of a rank in module `m` is the heaviest path *into* `m` plus the
//! rank's pipeline coordinate plus one. Megatron computes the same numbers with an unmemoized
//! recursion that is exponential in stacked diamonds; here one pass over a topological order
//! computes every module's value once (O(modules + edges)).

use crate::error::{Error, Result};
use crate::spec::PipelineSpec;

/// Stage numbers of a validated spec.
///
/// ```
/// use multimodule::{PipelineSpec, StageTable};
/// let spec = PipelineSpec::from_json_str(r#"{
///   "modules": {"A": {"pp": 2}, "B": {"pp": 3, "offset": 2}, "C": {"offset": 5}, "D": {"pp": 2, "offset": 6}},
///   "topology": {"A": ["B", "C"], "B": ["D"], "C": ["D"], "D": []}}"#).unwrap();
/// let st = StageTable::new(&spec);
/// assert_eq!(st.total_stages(), 7);
/// assert_eq!(st.stages_through(&spec, 5, "C").unwrap(), 3);
/// assert_eq!(st.stages_through(&spec, 7, "D").unwrap(), 7);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageTable {
    /// Heaviest path ending just before each module (0 for a source).
    before: Vec<usize>,
    /// Heaviest path ending with each module (before + pp size).
    through: Vec<usize>,
    total: usize,
}

impl StageTable {
    /// Computes every module's stage offsets in O(modules + edges).
    pub fn new(spec: &PipelineSpec) -> StageTable {
        let n = spec.modules().len();
        let mut before = vec![0usize; n];
        let mut through = vec![0usize; n];
        for &m in spec.topological_order() {
            let b = spec.predecessors()[m]
                .iter()
                .map(|&p| through[p])
                .max()
                .unwrap_or(0);
            before[m] = b;
            through[m] = b + spec.modules()[m].pp_size();
        }
        let total = through.iter().copied().max().unwrap_or(0);
        StageTable {
            before,
            through,
            total,
        }
    }

    /// Total number of pipeline stages: the heaviest path, each module weighing its pp size
    /// (Megatron's `compute_total_pipeline_stages` with `rank=None`).
    pub fn total_stages(&self) -> usize {
        self.total
    }

    /// Number of stages before module `index` starts (heaviest path into it).
    pub fn stages_before(&self, index: usize) -> usize {
        self.before.get(index).copied().unwrap_or(0)
    }

    /// Number of stages up to and including the last stage of module `index`.
    pub fn stages_through_module(&self, index: usize) -> usize {
        self.through.get(index).copied().unwrap_or(0)
    }

    /// Megatron's `compute_total_pipeline_stages(rank, module_name)`: the number of stages up to
    /// and including `rank`'s stage of `module`.
    pub fn stages_through(&self, spec: &PipelineSpec, rank: usize, module: &str) -> Result<usize> {
        let i = spec.module_index(module)?;
        let m = &spec.modules()[i];
        let pp = m.pp_rank(rank).ok_or_else(|| {
            let (first, end) = m.rank_range();
            Error::RankNotInModule {
                rank,
                module: module.to_string(),
                first,
                end,
            }
        })?;
        Ok(self.before[i] + pp + 1)
    }

    /// The stage count of a rank with no module named: the **maximum** over every module the
    /// rank belongs to (what Megatron's docstring promises; its code raises instead).
    pub fn rank_stages_through(&self, spec: &PipelineSpec, rank: usize) -> Result<usize> {
        spec.modules_of_rank(rank)
            .into_iter()
            .filter_map(|i| {
                spec.modules()[i]
                    .pp_rank(rank)
                    .map(|pp| self.before[i] + pp + 1)
            })
            .max()
            .ok_or(Error::RankInNoModule { rank })
    }

    /// 0-based current stage of a rank: `rank_stages_through − 1` (the maximum over colocated
    /// modules; Megatron uses only the first module of the rank).
    pub fn current_stage(&self, spec: &PipelineSpec, rank: usize) -> Result<usize> {
        Ok(self.rank_stages_through(spec, rank)? - 1)
    }

    /// True if some module of the rank is at its first pp stage and has no upstream module.
    pub fn is_first_stage(&self, spec: &PipelineSpec, rank: usize) -> bool {
        spec.modules_of_rank(rank).into_iter().any(|i| {
            spec.predecessors()[i].is_empty() && spec.modules()[i].pp_rank(rank) == Some(0)
        })
    }

    /// True if some module of the rank is at its last pp stage and has no downstream module.
    pub fn is_last_stage(&self, spec: &PipelineSpec, rank: usize) -> bool {
        spec.modules_of_rank(rank).into_iter().any(|i| {
            let m = &spec.modules()[i];
            spec.successors()[i].is_empty() && m.pp_rank(rank) == Some(m.pp_size() - 1)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write;

    /// 60 diamonds stacked in series: Megatron's recursion visits 2^60 paths.
    #[test]
    fn stacked_diamonds_are_linear() {
        let k = 60;
        let mut modules = String::new();
        let mut topo = String::new();
        let mut off = 0;
        let mut add = |name: String, pp: usize, modules: &mut String| {
            write!(modules, "\"{name}\": {{\"pp\": {pp}, \"offset\": {off}}},").unwrap();
            off += pp;
        };
        add("n0".into(), 1, &mut modules);
        for i in 0..k {
            add(format!("l{i}"), 2, &mut modules);
            add(format!("r{i}"), 1, &mut modules);
            add(format!("n{}", i + 1), 1, &mut modules);
            write!(
                topo,
                "\"n{i}\": [\"l{i}\", \"r{i}\"], \"l{i}\": [\"n{j}\"], \"r{i}\": [\"n{j}\"],",
                j = i + 1
            )
            .unwrap();
        }
        modules.pop();
        topo.pop();
        let text = format!("{{\"modules\": {{{modules}}}, \"topology\": {{{topo}}}}}");
        let start = std::time::Instant::now();
        let spec = PipelineSpec::from_json_str(&text).unwrap();
        let st = StageTable::new(&spec);
        // 1 + 60 * (2 + 1)
        assert_eq!(st.total_stages(), 1 + 3 * k);
        let last = spec.modules().last().unwrap();
        assert_eq!(
            st.stages_through(&spec, last.grid.offset(), &last.name)
                .unwrap(),
            1 + 3 * k
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn colocated_maximum() {
        let spec = PipelineSpec::from_json_str(
            r#"{"modules": {"enc": {"tp": 2, "pp": 2}, "llm": {"pp": 4}},
                "topology": {"enc": ["llm"], "llm": []}, "colocated": [["enc", "llm"]]}"#,
        )
        .unwrap();
        let st = StageTable::new(&spec);
        assert_eq!(st.total_stages(), 6);
        assert_eq!(st.stages_through(&spec, 0, "enc").unwrap(), 1);
        assert_eq!(st.stages_through(&spec, 0, "llm").unwrap(), 3);
        assert_eq!(st.rank_stages_through(&spec, 0).unwrap(), 3);
        assert_eq!(st.current_stage(&spec, 3).unwrap(), 5);
        assert!(matches!(
            st.rank_stages_through(&spec, 9),
            Err(Error::RankInNoModule { rank: 9 })
        ));
    }
}
