//! The canonical JSON form of a spec (full grids, every module in the topology), and reading a
//! spec back through the file form.

use super::raw::RawSpec;
use super::{DimMapping, PipelineSpec};
use crate::ordered::OrderedMap;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
struct CanonGrid<'a> {
    shape: &'a [usize],
    dims: &'a [String],
    rank_offset: usize,
}

#[derive(Serialize)]
struct CanonModule<'a> {
    grid: CanonGrid<'a>,
    output_ndim: usize,
}

#[derive(Serialize)]
struct CanonSpec<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    world_size: Option<usize>,
    modules: OrderedMap<CanonModule<'a>>,
    topology: OrderedMap<Vec<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    language_model: Option<&'a str>,
    dim_mapping: DimMapping,
    colocated: &'a [Vec<String>],
}

impl Serialize for PipelineSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let modules = OrderedMap(
            self.modules
                .iter()
                .map(|m| {
                    (
                        m.name.clone(),
                        CanonModule {
                            grid: CanonGrid {
                                shape: m.grid.shape(),
                                dims: m.grid.dim_names(),
                                rank_offset: m.grid.offset(),
                            },
                            output_ndim: m.output_ndim,
                        },
                    )
                })
                .collect(),
        );
        let topology = OrderedMap(
            self.modules
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    (
                        m.name.clone(),
                        self.succ[i]
                            .iter()
                            .map(|&j| self.modules[j].name.as_str())
                            .collect(),
                    )
                })
                .collect(),
        );
        CanonSpec {
            world_size: self.world_size,
            modules,
            topology,
            language_model: self.language_model.as_deref(),
            dim_mapping: self.dim_mapping,
            colocated: &self.colocated,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for PipelineSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let raw = RawSpec::deserialize(d)?;
        PipelineSpec::from_raw(raw).map_err(de::Error::custom)
    }
}
