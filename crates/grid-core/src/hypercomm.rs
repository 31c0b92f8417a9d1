//! [`CommGrid`]: Megatron's `HyperCommGrid` API (views, keys, create/get of groups) as pure
//! bookkeeping over [`HyperGrid`] arithmetic (docs/semantics.md §2.5).

use crate::error::{Error, Result};
use crate::grid::{GroupList, HyperGrid};
use crate::group::Group;
use serde::{Serialize, Serializer};
use std::collections::HashSet;
use std::fmt;

/// The key a group is stored under: the canonical dims string for the base view (or for a view
/// whose requested dims are all shared with the base), else the view name and the dims.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PgKey {
    /// `"dp-tp"`.
    Base(String),
    /// `("expert", ["ep", "expt_tp"])`.
    View(String, Vec<String>),
}

impl Serialize for PgKey {
    /// A string for the base view, `[view, [dims]]` otherwise (as the reference vectors write it).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PgKey::Base(k) => s.serialize_str(k),
            PgKey::View(v, d) => (v, d).serialize(s),
        }
    }
}

impl fmt::Display for PgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PgKey::Base(k) => f.write_str(k),
            PgKey::View(v, d) => write!(f, "{d:?} of view '{v}'"),
        }
    }
}

/// What [`CommGrid::create_pg`] planned: the key, every group, and this rank's group.
#[derive(Debug, Clone)]
pub struct CreatedGroup {
    /// Storage key.
    pub key: PgKey,
    /// Every group (canonical order): what a backend creates communicators for.
    pub enumeration: GroupList,
    /// The current rank's group, `None` outside the grid.
    pub my_group: Option<Group>,
}

#[derive(Debug, Clone)]
struct View {
    name: String,
    grid: HyperGrid,
    shared: Vec<String>,
}

/// Megatron's `HyperCommGrid` without a backend: views over the same ranks, canonical keys,
/// and the record of which groups were created, so that creating one twice or reading one that
/// was never created is an error exactly where Megatron raises.
///
/// ```
/// use grid_core::CommGrid;
/// let mut g = CommGrid::new(vec![2, 2, 2], &["tp", "dp", "pp"], 0, 8, 6).unwrap();
/// let c = g.create_pg(&["dp", "tp"], None).unwrap();
/// assert_eq!(c.key.to_string(), "dp-tp");
/// assert_eq!(c.my_group.unwrap().to_vec(), vec![4, 5, 6, 7]);
/// assert!(g.create_pg(&["tp", "dp"], None).is_err()); // same key
/// ```
#[derive(Debug, Clone)]
pub struct CommGrid {
    views: Vec<View>,
    rank: usize,
    created: HashSet<PgKey>,
}

impl CommGrid {
    /// The base view `"base"` over `shape`/`names` at `offset`, in a world of `world_size` ranks,
    /// seen from `rank`.
    pub fn new<S: AsRef<str>>(
        shape: Vec<usize>,
        names: &[S],
        offset: usize,
        world_size: usize,
        rank: usize,
    ) -> Result<CommGrid> {
        let grid = HyperGrid::in_world(shape, names, offset, world_size)?;
        Ok(CommGrid {
            views: vec![View {
                name: "base".into(),
                grid,
                shared: Vec::new(),
            }],
            rank,
            created: HashSet::new(),
        })
    }

    /// The base grid.
    pub fn base(&self) -> &HyperGrid {
        &self.views[0].grid
    }

    /// True if the current rank is in the grid.
    pub fn is_current_rank_in_grid(&self) -> bool {
        self.base().contains(self.rank)
    }

    fn view(&self, name: Option<&str>) -> Result<&View> {
        let name = name.unwrap_or("base");
        self.views
            .iter()
            .find(|v| v.name == name)
            .ok_or_else(|| Error::UnknownView {
                name: name.to_string(),
                registered: self.views.iter().map(|v| v.name.clone()).collect(),
            })
    }

    /// Registers a view: another factorization of the same ranks. `shared` dims must have the
    /// same groups in the base and in the view (checked each and, when several, together).
    pub fn register_view<S: AsRef<str>>(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        names: &[S],
        shared: Option<&[S]>,
    ) -> Result<()> {
        let bad = |reason: String| Error::InvalidView {
            name: name.to_string(),
            reason,
        };
        if self.views.iter().any(|v| v.name == name) {
            return Err(bad("a view with this name is already registered".into()));
        }
        let base = self.base().clone();
        let grid =
            HyperGrid::new(shape.clone(), names, base.offset()).map_err(|e| bad(e.to_string()))?;
        if grid.size() != base.size() {
            return Err(bad(format!(
                "shape {shape:?} has size {}, but the grid size is {}",
                grid.size(),
                base.size()
            )));
        }
        let shared: Vec<String> = shared
            .unwrap_or(&[])
            .iter()
            .map(|s| s.as_ref().to_string())
            .collect();
        for (i, d) in shared.iter().enumerate() {
            if shared[..i].contains(d) {
                return Err(bad(format!("shared dim '{d}' is listed twice")));
            }
            base.dim_index(d).map_err(|e| bad(e.to_string()))?;
            grid.dim_index(d).map_err(|e| bad(e.to_string()))?;
            let (a, b) = (base.groups(&[d])?, grid.groups(&[d])?);
            if a != b {
                return Err(bad(format!(
                    "shared dim '{d}' has different membership: base {:?} != view {:?}",
                    a.to_vecs(),
                    b.to_vecs()
                )));
            }
        }
        if shared.len() > 1 && base.groups(&shared)? != grid.groups(&shared)? {
            return Err(bad(format!(
                "shared dims {shared:?} together have different membership in the base and the view"
            )));
        }
        self.views.push(View {
            name: name.to_string(),
            grid,
            shared,
        });
        Ok(())
    }

    /// The key and the grid whose enumeration is used for `dims` in `view`.
    fn resolve<S: AsRef<str>>(
        &self,
        dims: &[S],
        view: Option<&str>,
    ) -> Result<(PgKey, &HyperGrid)> {
        let v = self.view(view)?;
        for d in dims {
            v.grid
                .dim_index(d.as_ref())
                .map_err(|_| Error::UnknownDim {
                    dim: d.as_ref().to_string(),
                    context: format!("view '{}'", v.name),
                    names: v.grid.dim_names().to_vec(),
                })?;
        }
        let ordered = v.grid.ordered_dims(dims)?;
        let all_shared = dims
            .iter()
            .all(|d| v.shared.iter().any(|s| s == d.as_ref()));
        if v.name == "base" || all_shared {
            let base = self.base();
            Ok((PgKey::Base(base.ordered_dims(dims)?.join("-")), base))
        } else {
            Ok((PgKey::View(v.name.clone(), ordered), &v.grid))
        }
    }

    /// Megatron's `get_rank_enum`: every group over `dims` in canonical order; creates nothing.
    pub fn rank_enum<S: AsRef<str>>(&self, dims: &[S], view: Option<&str>) -> Result<GroupList> {
        let (_, grid) = self.resolve(dims, view)?;
        grid.groups(dims)
    }

    /// Megatron's `create_pg`: records the key (an error if it exists) and returns every group
    /// and the current rank's.
    pub fn create_pg<S: AsRef<str>>(
        &mut self,
        dims: &[S],
        view: Option<&str>,
    ) -> Result<CreatedGroup> {
        let (key, grid) = self.resolve(dims, view)?;
        if self.created.contains(&key) {
            return Err(Error::GroupExists {
                key: key.to_string(),
            });
        }
        let enumeration = grid.groups(dims)?;
        let my_group = if grid.contains(self.rank) {
            Some(grid.group_of(self.rank, dims)?)
        } else {
            None
        };
        self.created.insert(key.clone());
        Ok(CreatedGroup {
            key,
            enumeration,
            my_group,
        })
    }

    /// Megatron's `get_pg`: the current rank's group for a created key (`None` outside the
    /// grid); an error if the key was never created.
    pub fn get_pg<S: AsRef<str>>(&self, dims: &[S], view: Option<&str>) -> Result<Option<Group>> {
        let (key, grid) = self.resolve(dims, view)?;
        if !self.created.contains(&key) {
            return Err(Error::GroupMissing {
                key: key.to_string(),
            });
        }
        if grid.contains(self.rank) {
            Ok(Some(grid.group_of(self.rank, dims)?))
        } else {
            Ok(None)
        }
    }
}
