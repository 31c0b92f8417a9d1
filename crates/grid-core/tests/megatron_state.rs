//! Megatron-Core's per-rank state beyond the group lists, against the reference vectors
//! (`testdata/vectors/`) and a transcription of Megatron's functions:
//!
//! * the virtual-pipeline answers of a rank view (`is_pipeline_first_stage`,
//!   `is_pipeline_last_stage`, `is_rank_in_embedding_group` with `ignore_virtual` and
//!   `vp_stage`) on every vector that has a `vpp` value, and on a sweep of layouts and embedding
//!   rules;
//! * `default_embedding_ranks` / `default_position_embedding_ranks` on every pipeline group of
//!   every vector;
//! * `use_mpu_process_groups` against the `pg_collection` every vector records (Megatron's
//!   `ProcessGroupCollection.use_mpu_process_groups()` on that rank).
//!
//! The expected virtual-pipeline answers are **derived from Megatron's formulas**
//! (`megatron/core/parallel_state.py` at `d98e8a64`), transcribed in [`Megatron`] below and fed
//! with the globals the vector recorded for the rank (`_PIPELINE_GLOBAL_RANKS`,
//! `_EMBEDDING_GLOBAL_RANKS`) and the vector's `vpp`:
//!
//! ```text
//! is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
//!     if not ignore_virtual and vpp is not None:
//!         assert vp_stage is not None
//!         if vp_stage != 0: return False
//!     return pp_rank == 0
//! is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
//!     if not ignore_virtual and vpp is not None:
//!         assert vp_stage is not None
//!         if vp_stage != vpp - 1: return False
//!     return pp_rank == pp_world_size - 1
//! is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
//!     if _EMBEDDING_GLOBAL_RANKS is None: return False
//!     if ignore_virtual: return rank in _EMBEDDING_GLOBAL_RANKS
//!     if rank in _EMBEDDING_GLOBAL_RANKS:
//!         if rank == _EMBEDDING_GLOBAL_RANKS[0]: return is_pipeline_first_stage(False, vp_stage)
//!         elif rank == _EMBEDDING_GLOBAL_RANKS[-1]: return is_pipeline_last_stage(False, vp_stage)
//!         else: return True
//!     return False
//! ```
//!
//! (`pp_rank` is the rank's position in the *sorted* pipeline group, torch's group rank.) The
//! library deliberately differs in one place, asserted separately: a `vp_stage` outside
//! `0..vpp` (or above 0 without `vpp`, which Megatron's newer `is_vp_first_stage` rejects too)
//! is an error, where `parallel_state` answers `False`.

use grid_core::*;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn vectors_dir() -> PathBuf {
    let dir = std::env::var_os("GRID_VECTORS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vectors")
        });
    assert!(
        dir.join("INDEX.json").is_file(),
        "reference vectors not found at {} (no INDEX.json)",
        dir.display()
    );
    dir
}

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Every `initialize_model_parallel` vector in scope, as (name, document).
fn init_vectors() -> Vec<(String, Value)> {
    let dir = vectors_dir();
    let index = read_json(&dir.join("INDEX.json"));
    let mut out = Vec::new();
    for e in index.as_array().expect("INDEX.json is a list") {
        if e["op"] != "initialize_model_parallel" {
            continue;
        }
        let name = e["name"].as_str().expect("name").to_string();
        let v = read_json(&dir.join(format!("{name}.json")));
        let input = &v["input"];
        let out_of_scope = u(input, "gtp_remat_size", 1) > 1
            || u(input, "expert_gtp_remat_size", 1) > 1
            || input
                .get("hybrid_context_parallel")
                .and_then(Value::as_bool)
                == Some(true)
            || input.get("pipeline_model_parallel_comm_backend").is_some();
        if !out_of_scope {
            out.push((name, v));
        }
    }
    assert!(out.len() > 20, "only {} vectors", out.len());
    out
}

fn u(v: &Value, k: &str, default: usize) -> usize {
    v.get(k)
        .and_then(Value::as_u64)
        .map_or(default, |x| x as usize)
}

fn ranks(v: &Value) -> Option<Vec<usize>> {
    v.as_array().map(|a| {
        a.iter()
            .map(|x| x.as_u64().expect("rank") as usize)
            .collect()
    })
}

fn config_of(input: &Value) -> LayoutConfig {
    let world = u(input, "local_world_size", u(input, "world_size", 1));
    let mut cfg = LayoutConfig {
        tp: u(input, "tp", 1),
        pp: u(input, "pp", 1),
        cp: u(input, "cp", 1),
        ep: u(input, "ep", 1),
        etp: input.get("etp").and_then(Value::as_u64).map(|x| x as usize),
        order: input
            .get("order")
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_ORDER)
            .to_string(),
        vpp: input.get("vpp").and_then(Value::as_u64).map(|x| x as usize),
        dist_opt_instances: u(input, "num_distributed_optimizer_instances", 1),
        hcp_sizes: input
            .get("hierarchical_context_parallel_sizes")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize).collect()),
        rank_offset: u(input, "rank_offset", 0),
        ..LayoutConfig::new(world)
    };
    if let Some(split) = input.get("legacy_split_rank").and_then(Value::as_u64) {
        cfg.embedding = EmbeddingRule::legacy_split_embedding(split as usize);
        cfg.position_embedding = EmbeddingRule::legacy_split_position_embedding(split as usize);
    }
    cfg
}

/// Megatron's globals for one rank, and its functions transcribed (see the module docs).
/// `Err(())` stands for Megatron's `AssertionError`.
struct Megatron {
    rank: usize,
    /// `_PIPELINE_GLOBAL_RANKS`.
    pipeline: Vec<usize>,
    /// `_EMBEDDING_GLOBAL_RANKS`.
    embedding: Option<Vec<usize>>,
    /// `_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE`.
    vpp: Option<usize>,
}

impl Megatron {
    fn pp_rank(&self) -> usize {
        let mut sorted = self.pipeline.clone();
        sorted.sort_unstable();
        sorted
            .iter()
            .position(|&r| r == self.rank)
            .expect("rank in its pipeline")
    }
    fn is_pipeline_first_stage(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool, ()> {
        if !ignore_virtual && self.vpp.is_some() {
            let vp_stage = vp_stage.ok_or(())?;
            if vp_stage != 0 {
                return Ok(false);
            }
        }
        Ok(self.pp_rank() == 0)
    }
    fn is_pipeline_last_stage(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool, ()> {
        if !ignore_virtual {
            if let Some(vpp) = self.vpp {
                let vp_stage = vp_stage.ok_or(())?;
                if vp_stage != vpp - 1 {
                    return Ok(false);
                }
            }
        }
        Ok(self.pp_rank() == self.pipeline.len() - 1)
    }
    fn is_rank_in_embedding_group(
        &self,
        ignore_virtual: bool,
        vp_stage: Option<usize>,
    ) -> Result<bool, ()> {
        let Some(e) = &self.embedding else {
            return Ok(false);
        };
        if ignore_virtual {
            return Ok(e.contains(&self.rank));
        }
        if e.contains(&self.rank) {
            if self.rank == e[0] {
                self.is_pipeline_first_stage(false, vp_stage)
            } else if self.rank == e[e.len() - 1] {
                self.is_pipeline_last_stage(false, vp_stage)
            } else {
                Ok(true)
            }
        } else {
            Ok(false)
        }
    }
}

/// Every (ignore_virtual, vp_stage) query whose `vp_stage` exists, checked against the
/// transcription; a mismatch is returned as text.
fn compare(m: &Megatron, v: &RankView) -> Result<usize, String> {
    let vpp = m.vpp;
    let mut stages: Vec<Option<usize>> = vec![None];
    stages.extend((0..vpp.unwrap_or(1)).map(Some));
    let mut n = 0;
    for ignore in [true, false] {
        for &s in &stages {
            type Q<'a> = (&'a str, Result<bool, ()>, grid_core::Result<bool>);
            let qs: [Q; 3] = [
                (
                    "is_pipeline_first_stage",
                    m.is_pipeline_first_stage(ignore, s),
                    v.is_pipeline_first_stage(ignore, s),
                ),
                (
                    "is_pipeline_last_stage",
                    m.is_pipeline_last_stage(ignore, s),
                    v.is_pipeline_last_stage(ignore, s),
                ),
                (
                    "is_rank_in_embedding_group",
                    m.is_rank_in_embedding_group(ignore, s),
                    v.is_rank_in_embedding_group(ignore, s),
                ),
            ];
            for (what, want, got) in qs {
                let same = match (&want, &got) {
                    (Ok(a), Ok(b)) => a == b,
                    (Err(()), Err(Error::VpStage { .. })) => true,
                    _ => false,
                };
                if !same {
                    return Err(format!(
                        "rank {} {what}(ignore_virtual={ignore}, vp_stage={s:?}): Megatron {want:?}, got {got:?}",
                        m.rank
                    ));
                }
                n += 1;
            }
        }
    }
    // The chunk lists `grid layout` prints are the same questions asked per chunk.
    let per_chunk = |f: &dyn Fn(bool, Option<usize>) -> Result<bool, ()>| -> Vec<usize> {
        (0..vpp.unwrap_or(1))
            .filter(|&c| f(false, vpp.map(|_| c)) == Ok(true))
            .collect()
    };
    let chunks = [
        (
            "first_stage_chunks",
            per_chunk(&|i, s| m.is_pipeline_first_stage(i, s)),
            v.first_stage_chunks(),
        ),
        (
            "last_stage_chunks",
            per_chunk(&|i, s| m.is_pipeline_last_stage(i, s)),
            v.last_stage_chunks(),
        ),
        (
            "embedding_chunks",
            per_chunk(&|i, s| m.is_rank_in_embedding_group(i, s)),
            v.embedding_chunks(),
        ),
    ];
    for (what, want, got) in chunks {
        if want != got {
            return Err(format!(
                "rank {} {what}: Megatron {want:?}, got {got:?}",
                m.rank
            ));
        }
    }
    if v.virtual_pipeline_size() != vpp {
        return Err(format!(
            "rank {}: virtual pipeline size {:?}",
            m.rank,
            v.virtual_pipeline_size()
        ));
    }
    Ok(n)
}

#[test]
fn virtual_pipeline_answers_match_megatron_on_every_vpp_vector() {
    let mut vpp_vectors = 0;
    let mut queries = 0;
    for (name, v) in init_vectors() {
        let input = &v["input"];
        let Some(vpp) = input.get("vpp").and_then(Value::as_u64) else {
            continue;
        };
        vpp_vectors += 1;
        let vpp = vpp as usize;
        let expected = &v["expected"];
        let plan = LayoutPlan::new(config_of(input));
        if let Some(err) = expected.get("error") {
            let want = err["type"].as_str().expect("error type");
            match plan {
                Err(e) => assert_eq!(e.megatron_category(), Some(want), "{name}: {e}"),
                Ok(_) => panic!("{name}: expected {want}, got a plan"),
            }
            continue;
        }
        let plan = plan.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(plan.virtual_pipeline_size(), Some(vpp), "{name}");
        let views = expected["rank_views"].as_object().expect("rank_views");
        assert!(!views.is_empty(), "{name}: no rank views");
        for (rank, rv) in views {
            let rank: usize = rank.parse().expect("rank key");
            let g = &rv["rank_globals"];
            let m = Megatron {
                rank,
                pipeline: ranks(&g["_PIPELINE_GLOBAL_RANKS"]).expect("pipeline ranks"),
                embedding: ranks(&g["_EMBEDDING_GLOBAL_RANKS"]),
                vpp: Some(vpp),
            };
            let view = plan.rank_view(rank).unwrap();
            queries += compare(&m, &view).unwrap_or_else(|e| panic!("{name}: {e}"));
            // The defaults (ignore_virtual = True) are what the vector's rank_info recorded.
            let info = &rv["rank_info"];
            for (k, got) in [
                (
                    "is_pipeline_first_stage",
                    view.is_pipeline_first_stage(true, None),
                ),
                (
                    "is_pipeline_last_stage",
                    view.is_pipeline_last_stage(true, None),
                ),
                (
                    "is_rank_in_embedding_group",
                    view.is_rank_in_embedding_group(true, None),
                ),
                (
                    "is_rank_in_position_embedding_group",
                    Ok(view.is_rank_in_position_embedding_group()),
                ),
            ] {
                assert_eq!(
                    info[k].as_bool(),
                    Some(got.unwrap()),
                    "{name} rank {rank} {k}"
                );
            }
        }
    }
    // init_ws16_pp4_vpp2 and init_err_vpp_without_pp at the time of writing.
    assert!(
        vpp_vectors >= 2,
        "only {vpp_vectors} vectors with a vpp value"
    );
    assert!(queries > 0);
    eprintln!("{vpp_vectors} vpp vectors, {queries} virtual-pipeline queries matched");
}

/// Layouts and embedding rules beyond the vectors: every rank, every query, against the
/// transcription fed with the plan's own pipeline and embedding groups (which the vectors tie
/// to Megatron's).
#[test]
fn virtual_pipeline_answers_match_megatron_on_a_sweep() {
    let rules: Vec<(&str, EmbeddingRule)> = vec![
        ("default", EmbeddingRule::Default),
        ("legacy split 1", EmbeddingRule::legacy_split_embedding(1)),
        ("last then first", EmbeddingRule::Stages(vec![-1, 0])),
        ("middle only", EmbeddingRule::Stages(vec![1])),
        (
            "custom: every stage",
            EmbeddingRule::Custom {
                name: "every".into(),
                rule: Arc::new(|g: &[usize]| g.to_vec()),
            },
        ),
    ];
    let mut n = 0;
    for (tp, pp, world) in [(1, 2, 4), (2, 4, 16), (1, 3, 6), (2, 2, 8)] {
        for vpp in [None, Some(1), Some(2), Some(3)] {
            for (label, rule) in &rules {
                let cfg = LayoutConfig {
                    tp,
                    pp,
                    vpp,
                    embedding: rule.clone(),
                    ..LayoutConfig::new(world)
                };
                let plan = LayoutPlan::new(cfg).unwrap();
                for rank in 0..world {
                    let view = plan.rank_view(rank).unwrap();
                    let m = Megatron {
                        rank,
                        pipeline: view.group(Family::Pp).unwrap().to_vec(),
                        embedding: view.group(Family::Embd).map(|g| g.to_vec()),
                        vpp,
                    };
                    n += compare(&m, &view).unwrap_or_else(|e| {
                        panic!("tp {tp} pp {pp} world {world} vpp {vpp:?} rule {label}: {e}")
                    });
                }
            }
        }
    }
    assert!(n > 1000, "{n} queries");
}

#[test]
fn a_vp_stage_that_does_not_exist_is_an_error() {
    let plan = LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 4,
        vpp: Some(2),
        ..LayoutConfig::new(16)
    })
    .unwrap();
    let first = plan.rank_view(0).unwrap();
    // Megatron answers False for vp_stage 2 of 2; the stage does not exist, so this is an error.
    let e = first.is_pipeline_first_stage(false, Some(2)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "is_pipeline_first_stage: vp_stage 2 is out of range for vpp = 2 (valid vp_stage: 0..=1)"
    );
    assert_eq!(e.megatron_category(), Some("AssertionError"));
    let e = first.is_pipeline_last_stage(false, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "is_pipeline_last_stage: vp_stage must be passed if virtual pipeline is enabled (vpp = 2; valid vp_stage: 0..=1)"
    );
    assert!(first.is_rank_in_embedding_group(false, Some(5)).is_err());
    // With ignore_virtual the stage is not looked at, as in Megatron.
    assert!(first.is_pipeline_first_stage(true, Some(9)).unwrap());
    // A middle stage outside the embedding group answers without looking at vp_stage.
    assert!(!plan
        .rank_view(4)
        .unwrap()
        .is_rank_in_embedding_group(false, None)
        .unwrap());
    // Without vpp: vp_stage None or 0 only.
    let flat = LayoutPlan::new(LayoutConfig {
        pp: 2,
        ..LayoutConfig::new(2)
    })
    .unwrap()
    .rank_view(1)
    .unwrap();
    assert!(flat.is_pipeline_last_stage(false, None).unwrap());
    assert!(flat.is_pipeline_last_stage(false, Some(0)).unwrap());
    let e = flat.is_pipeline_last_stage(false, Some(1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "is_pipeline_last_stage: vp_stage 1 was given but the layout has no virtual pipeline (vpp); pass no vp_stage, or 0"
    );
}

#[test]
fn default_embedding_rank_functions_match_every_vector() {
    let mut groups = 0;
    for (name, v) in init_vectors() {
        let input = &v["input"];
        let g = &v["expected"]["groups"];
        if v["expected"].get("error").is_some() || input.get("legacy_split_rank").is_some() {
            continue;
        }
        let pps = g["PIPELINE_MODEL_PARALLEL_GROUP"]
            .as_array()
            .expect("pp groups");
        let embd = g["EMBEDDING_GROUP"].as_array().expect("embedding groups");
        let pos = g["POSITION_EMBEDDING_GROUP"]
            .as_array()
            .expect("position groups");
        assert_eq!(pps.len(), embd.len(), "{name}");
        for ((p, e), q) in pps.iter().zip(embd).zip(pos) {
            let p = ranks(p).unwrap();
            assert_eq!(
                default_embedding_ranks(&p).unwrap(),
                ranks(e).unwrap(),
                "{name}"
            );
            assert_eq!(
                default_position_embedding_ranks(&p).unwrap(),
                ranks(q).unwrap(),
                "{name}"
            );
            groups += 1;
        }
    }
    assert!(groups > 100, "{groups} pipeline groups");
    let e = default_embedding_ranks(&[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "default_embedding_ranks: the pipeline group is empty; give the ranks of at least one stage"
    );
    assert_eq!(e.megatron_category(), Some("IndexError"));
}

/// Megatron's `ProcessGroupCollection` fields that belong to the out-of-scope gtp_remat feature.
const GTP_FIELDS: &[&str] = &[
    "dp_cp_gtp_remat",
    "expt_dp_gtp_remat",
    "expt_gtp_remat",
    "gtp_remat",
    "tp_ep_pp_with_egtp_remat",
];

#[test]
fn use_mpu_process_groups_matches_every_vector() {
    let mut checked = 0;
    for (name, v) in init_vectors() {
        let expected = &v["expected"];
        let Some(views) = expected.get("rank_views").and_then(Value::as_object) else {
            continue;
        };
        let plan =
            LayoutPlan::new(config_of(&v["input"])).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (rank, rv) in views {
            let rank: usize = rank.parse().unwrap();
            let pgc = rv["pg_collection"].as_object().expect("pg_collection");
            let pgs =
                use_mpu_process_groups(&plan.rank_view(rank).unwrap().collection(), None).unwrap();
            for (field, want) in pgc {
                if GTP_FIELDS.contains(&field.as_str()) {
                    assert!(
                        use_mpu_process_groups(pgs.collection(), Some(&[field.as_str()])).is_err(),
                        "{field} is not a field here"
                    );
                    continue;
                }
                if field == "hcp" {
                    let got = pgs
                        .collection()
                        .hcp
                        .as_ref()
                        .map(|h| h.iter().map(|g| g.to_vec()).collect::<Vec<_>>());
                    let want: Option<Vec<Vec<usize>>> = want
                        .as_array()
                        .map(|a| a.iter().map(|g| ranks(g).unwrap()).collect());
                    assert_eq!(got, want, "{name} rank {rank} hcp");
                    assert_eq!(
                        pgs.explicit_none().contains(&"hcp"),
                        want.is_none(),
                        "{name} rank {rank} hcp"
                    );
                    continue;
                }
                let got = pgs.lookup(field).unwrap();
                match ranks(want) {
                    Some(want) => assert_eq!(
                        got.group().map(|g| g.to_vec()),
                        Some(want),
                        "{name} rank {rank} {field}"
                    ),
                    None => assert_eq!(got, Provided::None, "{name} rank {rank} {field}"),
                }
                checked += 1;
            }
            // Every field of the collection is in Megatron's, but `tp_dp`, which this project
            // adds (Megatron keeps that group only as a global, `_TENSOR_AND_DATA_PARALLEL_GROUP`).
            for f in ProcessGroupCollection::<Group>::FIELDS {
                if *f == "tp_dp" {
                    let want = ranks(&rv["rank_globals"]["_TENSOR_AND_DATA_PARALLEL_GROUP"]);
                    let got = pgs.lookup(f).unwrap().group().map(|g| g.to_vec());
                    assert_eq!(got, want, "{name} rank {rank} tp_dp");
                    continue;
                }
                assert!(pgc.contains_key(*f), "{name}: Megatron has no field {f}");
            }
        }
    }
    assert!(checked > 500, "{checked} fields checked");
}
