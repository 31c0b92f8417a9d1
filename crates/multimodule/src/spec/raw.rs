//! The file form of a spec, as written (modules as a map or a list, grids full, short or
//! inline, `module_output_ndim`), and its lowering to [`ModuleSpec`]s before validation.

use super::{DimMapping, ModuleSpec, PipelineSpec};
use crate::error::{Error, Result};
use crate::ordered::OrderedMap;
use grid_core::HyperGrid;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGrid {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shape: Option<Vec<usize>>,
    #[serde(default, alias = "dim_names", skip_serializing_if = "Option::is_none")]
    dims: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rank_offset: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tp: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cp: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pp: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dp: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gtp_remat: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    offset: Option<usize>,
}

impl RawGrid {
    fn is_empty(&self) -> bool {
        self.shape.is_none()
            && self.dims.is_none()
            && self.rank_offset.is_none()
            && self.tp.is_none()
            && self.cp.is_none()
            && self.pp.is_none()
            && self.dp.is_none()
            && self.gtp_remat.is_none()
            && self.offset.is_none()
    }

    fn build(self, module: &str) -> Result<HyperGrid> {
        let short = [
            self.tp,
            self.cp,
            self.pp,
            self.dp,
            self.gtp_remat,
            self.offset,
        ];
        let has_short = short.iter().any(Option::is_some);
        let has_full = self.shape.is_some() || self.dims.is_some() || self.rank_offset.is_some();
        let form = |message: &str| Error::GridForm {
            module: module.to_string(),
            message: message.to_string(),
        };
        let grid = if has_full {
            if has_short {
                return Err(form("give either the full form (shape, dims, rank_offset) or the short form (tp, cp, pp, dp, gtp_remat, offset), not both"));
            }
            let shape = self.shape.ok_or_else(|| {
                form("the full form needs \"shape\" (sizes, fastest dimension first)")
            })?;
            let dims = self.dims.ok_or_else(|| {
                form("the full form needs \"dims\" (one name per entry of shape)")
            })?;
            HyperGrid::new(shape, &dims, self.rank_offset.unwrap_or(0))
        } else {
            let tp = self.tp.unwrap_or(1);
            let cp = self.cp.unwrap_or(1);
            let pp = self.pp.unwrap_or(1);
            let dp = self.dp.unwrap_or(1);
            let off = self.offset.unwrap_or(0);
            match self.gtp_remat {
                Some(g) => HyperGrid::new(
                    vec![tp, g, cp, pp, dp],
                    &["tp", "gtp_remat", "cp", "pp", "dp"],
                    off,
                ),
                None => HyperGrid::new(vec![tp, cp, pp, dp], &["tp", "cp", "pp", "dp"], off),
            }
        };
        grid.map_err(|source| Error::Grid {
            module: module.to_string(),
            source,
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModule {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    grid: Option<RawGrid>,
    #[serde(default)]
    output_ndim: Option<usize>,
    #[serde(default)]
    shape: Option<Vec<usize>>,
    #[serde(default, alias = "dim_names")]
    dims: Option<Vec<String>>,
    #[serde(default)]
    rank_offset: Option<usize>,
    #[serde(default)]
    tp: Option<usize>,
    #[serde(default)]
    cp: Option<usize>,
    #[serde(default)]
    pp: Option<usize>,
    #[serde(default)]
    dp: Option<usize>,
    #[serde(default)]
    gtp_remat: Option<usize>,
    #[serde(default)]
    offset: Option<usize>,
}

impl RawModule {
    fn split(self) -> (Option<RawGrid>, RawGrid, Option<usize>) {
        let inline = RawGrid {
            shape: self.shape,
            dims: self.dims,
            rank_offset: self.rank_offset,
            tp: self.tp,
            cp: self.cp,
            pp: self.pp,
            dp: self.dp,
            gtp_remat: self.gtp_remat,
            offset: self.offset,
        };
        (self.grid, inline, self.output_ndim)
    }
}

/// Modules as a map (file order) or as a list of entries with `name`.
#[derive(Debug, Clone, Default)]
struct RawModules(Vec<(String, RawModule)>);

impl<'de> Deserialize<'de> for RawModules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Vis;
        impl<'de> Visitor<'de> for Vis {
            type Value = RawModules;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a map from module names to modules, or a list of modules with a \"name\"",
                )
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut a: A,
            ) -> std::result::Result<RawModules, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = a.next_entry::<String, RawModule>()? {
                    if let Some(n) = &v.name {
                        if *n != k {
                            return Err(de::Error::custom(format!(
                                "module '{k}' has a different \"name\" field '{n}'"
                            )));
                        }
                    }
                    out.push((k, v));
                }
                Ok(RawModules(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> std::result::Result<RawModules, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element::<RawModule>()? {
                    let name = v.name.clone().ok_or_else(|| {
                        de::Error::custom(format!(
                            "module number {} of the list has no \"name\"",
                            out.len()
                        ))
                    })?;
                    out.push((name, v));
                }
                Ok(RawModules(out))
            }
        }
        d.deserialize_any(Vis)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpec {
    #[serde(default)]
    world_size: Option<usize>,
    modules: RawModules,
    #[serde(default)]
    topology: OrderedMap<Vec<String>>,
    #[serde(default, alias = "language_model_module_name")]
    language_model: Option<String>,
    #[serde(default)]
    dim_mapping: Option<DimMapping>,
    #[serde(default)]
    module_output_ndim: OrderedMap<usize>,
    #[serde(default)]
    colocated: Vec<Vec<String>>,
}

impl PipelineSpec {
    /// Lowers the file form to modules and validates the whole spec.
    pub(super) fn from_raw(raw: RawSpec) -> Result<PipelineSpec> {
        if raw.modules.0.is_empty() {
            return Err(Error::EmptySpec);
        }
        let mut modules = Vec::with_capacity(raw.modules.0.len());
        for (name, m) in raw.modules.0 {
            let (grid, inline, ndim) = m.split();
            let grid = match grid {
                Some(g) => {
                    if !inline.is_empty() {
                        return Err(Error::GridForm {
                            module: name,
                            message:
                                "the grid is given both under \"grid\" and inline: give it once"
                                    .into(),
                        });
                    }
                    g
                }
                None => inline,
            };
            let grid = grid.build(&name)?;
            modules.push(ModuleSpec {
                name,
                grid,
                output_ndim: ndim.unwrap_or(0),
            });
        }
        // Megatron's top-level module_output_ndim map.
        // First module of each name (repeated names are reported by the validation).
        let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (i, m) in modules.iter().enumerate() {
            index.entry(m.name.clone()).or_insert(i);
        }
        for (k, v) in raw.module_output_ndim.iter() {
            let m = match index.get(k) {
                Some(&i) => &mut modules[i],
                None => {
                    return Err(Error::UnknownModule {
                        name: k.to_string(),
                        context: "module_output_ndim".into(),
                        known: modules.iter().map(|m| m.name.clone()).collect(),
                    })
                }
            };
            if m.output_ndim != 0 && m.output_ndim != *v {
                return Err(Error::GridForm {
                    module: k.to_string(),
                    message: format!(
                        "output_ndim is {} in the module but {} in module_output_ndim",
                        m.output_ndim, v
                    ),
                });
            }
            m.output_ndim = *v;
        }
        for m in &mut modules {
            if m.output_ndim == 0 {
                m.output_ndim = 3;
            }
        }
        Self::validate(
            modules,
            raw.topology,
            raw.language_model,
            raw.dim_mapping.unwrap_or_default(),
            raw.colocated,
            raw.world_size,
        )
    }
}
