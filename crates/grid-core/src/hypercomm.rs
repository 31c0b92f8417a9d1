//! [`CommGrid`]: Megatron's `HyperCommGrid` API (views, keys, create/get of groups) as pure
//! bookkeeping over [`HyperGrid`] arithmetic (docs/semantics.md §2.5).

use crate::comm::{Communicator, GroupFactory, TimeLimit};
use crate::error::{Error, Result};
use crate::grid::{GroupList, HyperGrid};
use crate::group::Group;
use crate::options::GroupOptions;
use serde::{Serialize, Serializer};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

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

    /// The current rank (a world rank).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Where the current rank's group over `dims` (in `view`) lies, computed arithmetically in
    /// O(dimensions): the key, the number of groups, this rank's group index in the canonical
    /// order of [`CommGrid::rank_enum`] and its group (`None` outside the grid). Records
    /// nothing and enumerates nothing.
    ///
    /// ```
    /// use grid_core::CommGrid;
    /// let g = CommGrid::new(vec![2, 2, 2], &["tp", "dp", "pp"], 0, 8, 6).unwrap();
    /// let l = g.locate_pg(&["dp", "tp"], None).unwrap();
    /// assert_eq!((l.key.to_string(), l.num_groups, l.index), ("dp-tp".to_string(), 2, Some(1)));
    /// assert_eq!(g.rank_enum(&["dp", "tp"], None).unwrap().get(1), &l.my_group.unwrap().to_vec()[..]);
    /// ```
    pub fn locate_pg<S: AsRef<str>>(&self, dims: &[S], view: Option<&str>) -> Result<LocatedGroup> {
        let (key, grid) = self.resolve(dims, view)?;
        let mask = grid.mask_of(dims)?;
        let (index, my_group) = if grid.contains(self.rank) {
            (
                Some(grid.group_index_masked(&mask, self.rank)),
                Some(grid.group_of_masked(&mask, self.rank)?),
            )
        } else {
            (None, None)
        };
        Ok(LocatedGroup {
            key,
            num_groups: grid.num_groups_masked(&mask),
            index,
            my_group,
        })
    }

    /// Whether a group was created under `key`.
    pub fn is_created(&self, key: &PgKey) -> bool {
        self.created.contains(key)
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

/// Where this rank's group lies in a family of a [`CommGrid`] ([`CommGrid::locate_pg`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LocatedGroup {
    /// Storage key.
    pub key: PgKey,
    /// Number of groups over the dims.
    pub num_groups: usize,
    /// This rank's group index in the canonical order (`None` outside the grid): the colour
    /// of its split.
    pub index: Option<usize>,
    /// This rank's group (`None` outside the grid).
    pub my_group: Option<Group>,
}

/// Megatron's `HyperCommGrid` with live communicators: a [`CommGrid`] (views, keys, the
/// created-once rules) whose [`LiveCommGrid::create_pg`] creates this rank's communicator for
/// any set of dimensions of the base grid or of a registered view, through any
/// [`GroupFactory`], and keeps it under its key.
///
/// Each `create_pg` is **one** split of the parent, collective over it (every parent rank
/// calls `create_pg` with the same arguments, in the same order, as in Megatron): colour =
/// this rank's group index, computed arithmetically ([`CommGrid::locate_pg`]), key = its
/// world rank, so members are in ascending world-rank order. No rank enumerates the groups of
/// the world. Parent ranks outside the grid take part and get `None`.
///
/// The rules of Megatron's keys hold: a key is created once ([`Error::GroupExists`]), and
/// [`LiveCommGrid::get_pg`] of a key never created is [`Error::GroupMissing`]. Both are
/// decided from arguments that are the same on every rank, before any communication.
///
/// ```
/// use backend_local::{run, LocalConfig};
/// use grid_core::*;
/// let out = run(8, &LocalConfig::default(), |f, world| {
///     let grid = CommGrid::new(vec![2, 2, 2], &["tp", "cp", "dp"], 0, 8, world.rank())?;
///     let mut live = LiveCommGrid::new(grid, f, &world)?;
///     assert!(live.get_pg(&["tp", "dp"], None).is_err()); // not created yet
///     let g = live.create_pg(&["dp", "tp"], None, &GroupOptions::new())?.unwrap();
///     assert!(live.create_pg(&["tp", "dp"], None, &GroupOptions::new()).is_err()); // same key
///     let mut sum = [0i64];
///     g.all_reduce_into(&[g.global_ranks()[g.rank()] as i64], &mut sum, ReduceOp::Sum)?;
///     Ok((g.name().to_string(), g.global_ranks().to_vec(), sum[0]))
/// })?;
/// assert_eq!(out[2], ("dp-tp".to_string(), vec![2, 3, 6, 7], 18)); // rank 2: cp = 1
/// # Ok::<(), Error>(())
/// ```
pub struct LiveCommGrid<'f, F: GroupFactory> {
    grid: CommGrid,
    factory: &'f F,
    parent: &'f F::Comm,
    groups: HashMap<PgKey, Option<Arc<F::Comm>>>,
}

impl<F: GroupFactory> fmt::Debug for LiveCommGrid<'_, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut keys: Vec<String> = self.groups.keys().map(|k| k.to_string()).collect();
        keys.sort();
        f.debug_struct("LiveCommGrid")
            .field("grid", &self.grid)
            .field("groups", &keys)
            .finish()
    }
}

impl<'f, F: GroupFactory> LiveCommGrid<'f, F> {
    /// Live groups of `grid`, created through `factory` from `parent`, whose members'
    /// `global_ranks()` are world ranks: this rank (the grid's current rank) must be the
    /// parent's own world rank, and every rank of the grid one of the parent's members.
    /// Checked locally; no communication.
    pub fn new(grid: CommGrid, factory: &'f F, parent: &'f F::Comm) -> Result<Self> {
        let ranks = parent.global_ranks();
        let me = ranks.get(parent.rank()).copied().unwrap_or(parent.rank());
        if me != grid.rank() {
            return Err(Error::Invalid(format!(
                "LiveCommGrid: the grid is seen from world rank {}, but this process is world rank {me} of the parent communicator '{}'; build the CommGrid with rank {me}",
                grid.rank(),
                parent.name()
            )));
        }
        let base = grid.base();
        let members: HashSet<usize> = ranks.iter().copied().collect();
        if let Some(missing) =
            (base.offset()..base.offset() + base.size()).find(|r| !members.contains(r))
        {
            return Err(Error::Invalid(format!(
                "LiveCommGrid: world rank {missing} of the grid (ranks {}..{}) is not a member of the parent communicator '{}' ({} ranks); give a parent that holds every rank of the grid",
                base.offset(),
                base.offset() + base.size(),
                parent.name(),
                parent.size()
            )));
        }
        Ok(LiveCommGrid {
            grid,
            factory,
            parent,
            groups: HashMap::new(),
        })
    }

    /// The grid (views, keys, memberships).
    pub fn grid(&self) -> &CommGrid {
        &self.grid
    }

    /// The parent communicator.
    pub fn parent(&self) -> &'f F::Comm {
        self.parent
    }

    /// Registers a view ([`CommGrid::register_view`]); local, no communication.
    pub fn register_view<S: AsRef<str>>(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        names: &[S],
        shared: Option<&[S]>,
    ) -> Result<()> {
        self.grid.register_view(name, shape, names, shared)
    }

    /// Megatron's `create_pg(dims, **kwargs)`: creates this rank's communicator over `dims`
    /// (in `view`, default the base) with `options` ([`GroupFactory::split_with`]; unnamed, the
    /// group is named after its key: `"dp-tp"`, or `"expert:ep-expt_tp"` in a view) and
    /// returns it (`None` on a parent rank outside the grid). Collective over the parent: one
    /// split. A key created before is [`Error::GroupExists`] (on every rank, before any
    /// communication).
    pub fn create_pg<S: AsRef<str>>(
        &mut self,
        dims: &[S],
        view: Option<&str>,
        options: &GroupOptions,
    ) -> Result<Option<Arc<F::Comm>>> {
        let located = self.grid.locate_pg(dims, view)?;
        if self.groups.contains_key(&located.key) || self.grid.is_created(&located.key) {
            return Err(Error::GroupExists {
                key: located.key.to_string(),
            });
        }
        let color = match located.index {
            Some(i) => Some(u32::try_from(i).map_err(|_| {
                Error::Invalid(format!(
                    "create_pg {}: group index {i} does not fit a 32-bit colour",
                    located.key
                ))
            })?),
            None => None,
        };
        let name = match &located.key {
            PgKey::Base(k) => k.clone(),
            PgKey::View(v, d) => format!("{v}:{}", d.join("-")),
        };
        let mut options = options.clone();
        if options.name.is_none() {
            options.name = Some(name);
        }
        let comm = self
            .factory
            .split_with(self.parent, color, self.grid.rank(), &options)?
            .map(Arc::new);
        if let (Some(c), Some(g)) = (&comm, &located.my_group) {
            if c.size() != g.len() {
                return Err(Error::Invalid(format!(
                    "create_pg {}: the backend created a communicator of {} ranks for a group of {}",
                    located.key,
                    c.size(),
                    g.len()
                )));
            }
        }
        self.groups.insert(located.key, comm.clone());
        Ok(comm)
    }

    /// Megatron's `get_pg(dims)`: the communicator created for `dims` in `view` (`None` on a
    /// rank outside the grid); [`Error::GroupMissing`] if it was never created.
    pub fn get_pg<S: AsRef<str>>(
        &self,
        dims: &[S],
        view: Option<&str>,
    ) -> Result<Option<Arc<F::Comm>>> {
        let located = self.grid.locate_pg(dims, view)?;
        match self.groups.get(&located.key) {
            Some(c) => Ok(c.clone()),
            None => Err(Error::GroupMissing {
                key: located.key.to_string(),
            }),
        }
    }

    /// Every created key, sorted by its display.
    pub fn keys(&self) -> Vec<&PgKey> {
        let mut k: Vec<&PgKey> = self.groups.keys().collect();
        k.sort_by_key(|k| k.to_string());
        k
    }

    /// Megatron's `update_pg_timeout`: sets the default time limit of the later operations of
    /// the group over `dims` in `view` ([`Error::GroupMissing`] if never created), on this
    /// rank. Returns whether this rank has that group.
    pub fn update_pg_timeout<S: AsRef<str>>(
        &self,
        dims: &[S],
        view: Option<&str>,
        limit: impl Into<TimeLimit>,
    ) -> Result<bool> {
        let limit = limit.into();
        Ok(match self.get_pg(dims, view)? {
            Some(c) => {
                c.set_time_limit(limit);
                true
            }
            None => false,
        })
    }

    /// [`LiveCommGrid::update_pg_timeout`] for every created group; returns how many this rank
    /// has.
    pub fn update_all_pg_timeouts(&self, limit: impl Into<TimeLimit>) -> usize {
        let limit = limit.into();
        self.groups
            .values()
            .flatten()
            .map(|c| c.set_time_limit(limit))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `locate_pg` (the colour of a live group's split) is arithmetic: on a grid of 2^30 ranks,
    /// whose groups could never be listed, it answers at once, and it agrees with the
    /// enumeration on a small grid for every rank and every subset of dims.
    #[test]
    fn locate_pg_never_enumerates_and_agrees_with_rank_enum() {
        let n = 1usize << 30;
        let g = CommGrid::new(
            vec![1 << 10, 1 << 10, 1 << 10],
            &["tp", "dp", "pp"],
            0,
            n,
            n - 3,
        )
        .unwrap();
        let t = std::time::Instant::now();
        let l = g.locate_pg(&["dp"], None).unwrap();
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        // rank n-3: tp = 1021, dp = 1023, pp = 1023; groups over dp are indexed by (pp, tp),
        // the slowest first.
        assert_eq!(l.num_groups, 1 << 20);
        assert_eq!(l.index, Some(1023 * 1024 + 1021));
        let members = l.my_group.unwrap();
        assert_eq!(members.len(), 1024);
        assert_eq!(
            members.to_vec()[..2],
            [1023 * (1 << 20) + 1021, 1023 * (1 << 20) + 1021 + 1024]
        );

        let shape = vec![2, 3, 1, 2];
        let names = ["a", "b", "c", "d"];
        for rank in 0..12 {
            let mut g = CommGrid::new(shape.clone(), &names, 0, 12, rank).unwrap();
            g.register_view("v", vec![6, 2], &["x", "d"], Some(&["d"][..]))
                .unwrap();
            let mut cases: Vec<(Vec<&str>, Option<&str>)> = Vec::new();
            for mask in 1u32..16 {
                let dims: Vec<&str> = (0..4)
                    .filter(|i| mask & (1 << i) != 0)
                    .map(|i| names[i])
                    .collect();
                cases.push((dims, None));
            }
            cases.push((vec!["x"], Some("v")));
            cases.push((vec!["x", "d"], Some("v")));
            cases.push((vec!["d"], Some("v")));
            for (dims, view) in cases {
                let l = g.locate_pg(&dims, view).unwrap();
                let all = g.rank_enum(&dims, view).unwrap();
                let i = l.index.unwrap();
                assert_eq!(all.len(), l.num_groups);
                assert_eq!(
                    all.get(i),
                    &l.my_group.unwrap().to_vec()[..],
                    "{dims:?} {view:?} rank {rank}"
                );
                assert!(all.get(i).contains(&rank));
            }
        }
    }
}
