//! Options of one process group ([`GroupOptions`]: a name, a time limit, backend options) and
//! of a whole collection ([`CollectionOptions`]: options per family, Megatron's
//! `nccl_comm_cfgs`, readable from Megatron's YAML or JSON file).
//!
//! Megatron's `create_group(ranks, timeout, backend, pg_options, group_desc)` takes the same
//! three things: `timeout` is [`GroupOptions::timeout`], `group_desc` is
//! [`GroupOptions::name`], and `pg_options` (`ProcessGroupNCCL.Options`, made by
//! `get_nccl_options` from the `nccl_comm_cfgs` file) is [`BackendOptions`]. A factory applies
//! them when it creates the communicator ([`crate::GroupFactory::split_with`]): the name is
//! the communicator's name in every error, log line and trace of the group, the time limit is
//! its default operation time limit (changed later with [`crate::Communicator::set_time_limit`]
//! or [`crate::ProcessGroupCollection::update_pg_timeout`]), and backend options are read by
//! the backend they are written for. Options written for another backend are rejected with an
//! error that names both backends, before any communication.

use crate::collection::ProcessGroupCollection;
use crate::comm::TimeLimit;
use crate::error::{Error, Result};
use crate::plan::{Family, FamilyLevel};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The options of one group: what Megatron passes to `create_group` as `timeout`,
/// `group_desc` and `pg_options`.
///
/// ```
/// use grid_core::{BackendOptions, GlooGroupOptions, GroupOptions, TimeLimit};
/// use std::time::Duration;
/// let o = GroupOptions::new()
///     .named("TENSOR_MODEL_PARALLEL_GROUP")
///     .with_timeout(Duration::from_secs(30))
///     .with_backend(BackendOptions::Gloo(GlooGroupOptions { hostname: Some("127.0.0.1".into()), ..Default::default() }));
/// assert_eq!(o.timeout, Some(TimeLimit::After(Duration::from_secs(30))));
/// assert!(o.check_backend("gloo").is_ok());
/// assert_eq!(
///     o.check_backend("mpi").unwrap_err().to_string(),
///     "group 'TENSOR_MODEL_PARALLEL_GROUP': its backend options are for 'gloo', but the factory creating it is 'mpi' (give BackendOptions::None, or options of the backend that creates the group)"
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct GroupOptions {
    /// The descriptive name (Megatron's `group_desc`): the communicator's name in errors,
    /// spans and the operation log. `None`: the factory's own name (a family name when built
    /// by [`crate::build_collection_with`], the key when created by
    /// [`crate::LiveCommGrid::create_pg`]).
    pub name: Option<String>,
    /// The default time limit of the group's operations (Megatron's `timeout`). `None`: the
    /// backend's configured default.
    pub timeout: Option<TimeLimit>,
    /// Options only one backend reads (Megatron's `pg_options`).
    pub backend: BackendOptions,
}

/// Options for one backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum BackendOptions {
    /// None.
    #[default]
    None,
    /// NCCL's communicator configuration (`ncclConfig_t`) and stream.
    Nccl(NcclGroupOptions),
    /// Gloo's options (`ProcessGroupGloo.Options`).
    Gloo(GlooGroupOptions),
}

impl BackendOptions {
    /// The backend these options are for (`None` for [`BackendOptions::None`]).
    pub fn backend(&self) -> Option<&'static str> {
        match self {
            BackendOptions::None => None,
            BackendOptions::Nccl(_) => Some("nccl"),
            BackendOptions::Gloo(_) => Some("gloo"),
        }
    }
}

/// NCCL options of one group: the `ncclConfig_t` fields the NCCL backend sets, and
/// Megatron's `is_high_priority_stream`. `None` fields keep NCCL's default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NcclGroupOptions {
    /// Megatron's `is_high_priority_stream`. The NCCL backend runs every communicator on a
    /// stream of default priority, so it rejects `true` with [`Error::Unsupported`].
    pub is_high_priority_stream: bool,
    /// `cgaClusterSize`.
    pub cga_cluster_size: Option<u32>,
    /// `minCTAs`.
    pub min_ctas: Option<u32>,
    /// `maxCTAs`.
    pub max_ctas: Option<u32>,
    /// `netName` (Megatron accepts `"IB"` or `"Socket"`, any case).
    pub net_name: Option<String>,
    /// `splitShare` (`None`: the factory's setting).
    pub split_share: Option<bool>,
}

/// Gloo options of one group (`ProcessGroupGloo.Options`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct GlooGroupOptions {
    /// Gloo's own timeout for the group: its rendezvous, and the bound Gloo applies to each
    /// operation (`None`: the factory's `GlooConfig::timeout`).
    pub timeout: Option<Duration>,
    /// The address of this host the group's TCP device listens on (the transport device;
    /// `None`: the factory's device).
    pub hostname: Option<String>,
}

impl GroupOptions {
    /// No options: the factory's defaults.
    pub fn new() -> GroupOptions {
        GroupOptions::default()
    }

    /// With a descriptive name.
    pub fn named(mut self, name: impl Into<String>) -> GroupOptions {
        self.name = Some(name.into());
        self
    }

    /// With a default time limit (a [`Duration`] or [`TimeLimit::Unlimited`]).
    pub fn with_timeout(mut self, limit: impl Into<TimeLimit>) -> GroupOptions {
        self.timeout = Some(limit.into());
        self
    }

    /// With backend options.
    pub fn with_backend(mut self, backend: BackendOptions) -> GroupOptions {
        self.backend = backend;
        self
    }

    /// The name to give the group: [`GroupOptions::name`], else `default`.
    pub fn name_or<'a>(&'a self, default: &'a str) -> &'a str {
        self.name.as_deref().unwrap_or(default)
    }

    /// How the group is called in messages: its name, or `(unnamed)`.
    fn label(&self) -> &str {
        self.name.as_deref().unwrap_or("(unnamed)")
    }

    /// Checks the options themselves: a name is non-empty and has no control characters, a
    /// time limit is not zero, NCCL's `min_ctas <= max_ctas` and `net_name` is `IB` or
    /// `Socket` (Megatron's check), Gloo's timeout is not zero and its hostname not empty.
    ///
    /// ```
    /// use grid_core::{GroupOptions, TimeLimit};
    /// assert!(GroupOptions::new().named("tp").validate().is_ok());
    /// assert!(GroupOptions::new().named("").validate().is_err());
    /// assert!(GroupOptions::new().with_timeout(std::time::Duration::ZERO).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Invalid(format!("group '{}': {why}", self.label())));
        if let Some(n) = &self.name {
            if n.is_empty() {
                return bad("the name is empty; give a descriptive name or none".into());
            }
            if n.chars().any(char::is_control) {
                return bad(format!(
                    "the name {n:?} contains control characters; use printable characters"
                ));
            }
        }
        if self.timeout == Some(TimeLimit::After(Duration::ZERO)) {
            return bad(
                "a time limit of 0 ms fails every operation; give a positive limit or TimeLimit::Unlimited"
                    .into(),
            );
        }
        match &self.backend {
            BackendOptions::None => {}
            BackendOptions::Nccl(n) => {
                if let (Some(lo), Some(hi)) = (n.min_ctas, n.max_ctas) {
                    if lo > hi {
                        return bad(format!(
                            "NCCL min_ctas {lo} is larger than max_ctas {hi} (min_ctas must be <= max_ctas)"
                        ));
                    }
                }
                if let Some(net) = &n.net_name {
                    if !["ib", "socket"].contains(&net.to_lowercase().as_str()) {
                        return bad(format!(
                            "NCCL net_name {net:?} is not supported; accepted values: 'IB' or 'Socket'"
                        ));
                    }
                }
            }
            BackendOptions::Gloo(g) => {
                if g.timeout == Some(Duration::ZERO) {
                    return bad(
                        "Gloo timeout 0 fails every operation; give a positive timeout".into(),
                    );
                }
                if g.hostname.as_deref() == Some("") {
                    return bad("Gloo hostname is empty; give an address of this host".into());
                }
            }
        }
        Ok(())
    }

    /// [`GroupOptions::validate`], then an error when the backend options are for another
    /// backend than `backend` (the factory's).
    pub fn check_backend(&self, backend: &str) -> Result<()> {
        self.validate()?;
        match self.backend.backend() {
            Some(b) if b != backend => Err(Error::Invalid(format!(
                "group '{}': its backend options are for '{b}', but the factory creating it is '{backend}' \
                 (give BackendOptions::None, or options of the backend that creates the group)",
                self.label()
            ))),
            _ => Ok(()),
        }
    }

    /// These options over `base`: every field set here wins, the others come from `base`.
    ///
    /// ```
    /// use grid_core::GroupOptions;
    /// use std::time::Duration;
    /// let base = GroupOptions::new().with_timeout(Duration::from_secs(5));
    /// let o = GroupOptions::new().named("dp").over(&base);
    /// assert_eq!((o.name.as_deref(), o.timeout), (Some("dp"), base.timeout));
    /// ```
    pub fn over(&self, base: &GroupOptions) -> GroupOptions {
        GroupOptions {
            name: self.name.clone().or_else(|| base.name.clone()),
            timeout: self.timeout.or(base.timeout),
            backend: match &self.backend {
                BackendOptions::None => base.backend.clone(),
                b => b.clone(),
            },
        }
    }
}

/// Options per family for [`crate::build_collection_with`]: Megatron's `nccl_comm_cfgs` (and
/// `timeout`, `group_desc`) as one value.
///
/// Each family level's options are its family's entry over [`CollectionOptions::default`]
/// ([`GroupOptions::over`]); a family with no name gets its family name (`"tp"`, `"hcp[1]"`).
///
/// ```
/// use grid_core::{CollectionOptions, GroupOptions, Family, FamilyLevel};
/// use std::time::Duration;
/// let mut o = CollectionOptions::new().with_default(GroupOptions::new().with_timeout(Duration::from_secs(60)));
/// o.set("tp", GroupOptions::new().with_timeout(Duration::from_secs(5)))?;
/// assert!(o.set("tpp", GroupOptions::new()).is_err());
/// let tp = o.for_level(FamilyLevel { family: Family::Tp, level: 0 });
/// assert_eq!((tp.name.as_deref(), tp.timeout.map(|t| t.as_millis())), (Some("tp"), Some(5000)));
/// let dp = o.for_level(FamilyLevel { family: Family::Dp, level: 0 });
/// assert_eq!((dp.name.as_deref(), dp.timeout.map(|t| t.as_millis())), (Some("dp"), Some(60000)));
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectionOptions {
    /// Options of every family without its own entry (and under those with one).
    pub default: GroupOptions,
    /// How the communicators are created: one split of the parent per distinct family
    /// ([`crate::Creation::Split`], the default), or by the members of each group only
    /// ([`crate::Creation::MembersOnly`], through [`crate::GroupFactory::create_members_only`]).
    pub creation: crate::Creation,
    families: BTreeMap<String, GroupOptions>,
}

/// The keys of one family's entry in Megatron's `nccl_comm_cfgs` file (`get_nccl_options`).
pub const NCCL_COMM_CFG_KEYS: [&str; 5] = [
    "is_high_priority_stream",
    "cga_cluster_size",
    "max_ctas",
    "min_ctas",
    "net_name",
];

fn check_family_name(name: &str) -> Result<()> {
    if Family::from_name(name).is_ok() || ProcessGroupCollection::<()>::FIELDS.contains(&name) {
        return Ok(());
    }
    let mut valid: Vec<&str> = Family::ALL.iter().map(|f| f.name()).collect();
    for f in ProcessGroupCollection::<()>::FIELDS {
        if !valid.contains(f) {
            valid.push(f);
        }
    }
    Err(Error::UnknownFamily {
        name: name.to_string(),
        valid: valid.join(", "),
    })
}

impl CollectionOptions {
    /// No options: every family gets its family name and the factory's defaults.
    pub fn new() -> CollectionOptions {
        CollectionOptions::default()
    }

    /// With the given creation mode ([`CollectionOptions::creation`]).
    ///
    /// ```
    /// use grid_core::{CollectionOptions, Creation};
    /// let o = CollectionOptions::new().with_creation(Creation::MembersOnly);
    /// assert_eq!(o.creation, Creation::MembersOnly);
    /// assert_eq!(CollectionOptions::new().creation, Creation::Split);
    /// ```
    pub fn with_creation(mut self, creation: crate::Creation) -> CollectionOptions {
        self.creation = creation;
        self
    }

    /// With options for every family.
    pub fn with_default(mut self, default: GroupOptions) -> CollectionOptions {
        self.default = default;
        self
    }

    /// Sets the options of `family` (a family name, `hcp` for every hierarchical level); an
    /// unknown name is an error listing the valid ones.
    pub fn set(&mut self, family: &str, options: GroupOptions) -> Result<()> {
        check_family_name(family)?;
        self.families.insert(family.to_string(), options);
        Ok(())
    }

    /// The options given for `family` (not merged with the default).
    pub fn family(&self, family: &str) -> Option<&GroupOptions> {
        self.families.get(family)
    }

    /// The families with their own options, sorted by name.
    pub fn families(&self) -> impl Iterator<Item = (&str, &GroupOptions)> {
        self.families.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The options of one family level: its family's entry over the default, named after the
    /// family level when no name is given.
    pub fn for_level(&self, fl: FamilyLevel) -> GroupOptions {
        let mut o = match self.families.get(fl.family.name()) {
            Some(f) => f.over(&self.default),
            None => self.default.clone(),
        };
        if o.name.is_none() {
            o.name = Some(fl.to_string());
        } else if fl.family == Family::Hcp {
            // One name per level, so that the levels stay apart in messages.
            o.name = o.name.map(|n| format!("{n}[{}]", fl.level));
        }
        o
    }

    /// Megatron's `nccl_comm_cfgs` from a JSON value: an object mapping family names to
    /// objects with the keys of [`NCCL_COMM_CFG_KEYS`], each family becoming NCCL backend
    /// options. Unknown families or keys, and values of the wrong type, are errors naming
    /// them (Megatron's own check of `net_name` included).
    pub fn from_nccl_comm_cfgs(value: &serde_json::Value) -> Result<CollectionOptions> {
        let top = value.as_object().ok_or_else(|| {
            Error::Invalid(format!(
                "nccl_comm_cfgs: expected a mapping of family names to options, found {value}"
            ))
        })?;
        let mut out = CollectionOptions::new();
        for (family, cfg) in top {
            let bad =
                |why: String| Error::Invalid(format!("nccl_comm_cfgs: family '{family}': {why}"));
            check_family_name(family)?;
            let map = cfg
                .as_object()
                .ok_or_else(|| bad(format!("expected a mapping of options, found {cfg}")))?;
            let mut n = NcclGroupOptions::default();
            for (k, v) in map {
                let uint = || -> Result<Option<u32>> {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .map(Some)
                        .ok_or_else(|| {
                            bad(format!(
                                "{k} must be an integer in 0..={}, found {v}",
                                u32::MAX
                            ))
                        })
                };
                match k.as_str() {
                    "is_high_priority_stream" => {
                        n.is_high_priority_stream = v
                            .as_bool()
                            .ok_or_else(|| bad(format!("{k} must be true or false, found {v}")))?
                    }
                    "cga_cluster_size" => n.cga_cluster_size = uint()?,
                    "max_ctas" => n.max_ctas = uint()?,
                    "min_ctas" => n.min_ctas = uint()?,
                    "net_name" => {
                        n.net_name = Some(
                            v.as_str()
                                .ok_or_else(|| bad(format!("{k} must be a string, found {v}")))?
                                .to_string(),
                        )
                    }
                    _ => {
                        return Err(bad(format!(
                            "unknown option '{k}'; valid: {}",
                            NCCL_COMM_CFG_KEYS.join(", ")
                        )))
                    }
                }
            }
            let o = GroupOptions::new().with_backend(BackendOptions::Nccl(n));
            o.validate().map_err(|e| bad(e.to_string()))?;
            out.families.insert(family.clone(), o);
        }
        Ok(out)
    }

    /// Megatron's `nccl_comm_cfgs` from the text of its file: JSON, or the YAML Megatron
    /// writes (a mapping of family names to mappings of scalars; comments, quotes and `{}`
    /// allowed). See [`CollectionOptions::from_nccl_comm_cfgs`].
    ///
    /// ```
    /// use grid_core::{BackendOptions, CollectionOptions};
    /// let o = CollectionOptions::from_nccl_comm_cfgs_text("# per-family NCCL tuning\ntp:\n  cga_cluster_size: 2\n  max_ctas: 32\n  min_ctas: 1\ndp:\n  net_name: IB\n  is_high_priority_stream: true\n")?;
    /// let BackendOptions::Nccl(tp) = &o.family("tp").unwrap().backend else { panic!() };
    /// assert_eq!((tp.cga_cluster_size, tp.max_ctas, tp.min_ctas), (Some(2), Some(32), Some(1)));
    /// let BackendOptions::Nccl(dp) = &o.family("dp").unwrap().backend else { panic!() };
    /// assert_eq!((dp.net_name.as_deref(), dp.is_high_priority_stream), (Some("IB"), true));
    /// let json = CollectionOptions::from_nccl_comm_cfgs_text(r#"{"tp": {"cga_cluster_size": 2, "max_ctas": 32, "min_ctas": 1}, "dp": {"net_name": "IB", "is_high_priority_stream": true}}"#)?;
    /// assert_eq!(o, json);
    /// assert!(CollectionOptions::from_nccl_comm_cfgs_text("tp:\n  max_cta: 3\n").is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn from_nccl_comm_cfgs_text(text: &str) -> Result<CollectionOptions> {
        let value = if text.trim_start().starts_with('{') {
            serde_json::from_str(text)
                .map_err(|e| Error::Invalid(format!("nccl_comm_cfgs: invalid JSON: {e}")))?
        } else {
            simple_yaml(text)?
        };
        CollectionOptions::from_nccl_comm_cfgs(&value)
    }

    /// Megatron's `nccl_communicator_config_path`: reads the file (YAML or JSON) and parses it
    /// with [`CollectionOptions::from_nccl_comm_cfgs_text`]; errors name the path.
    pub fn from_nccl_comm_cfgs_file(path: impl AsRef<Path>) -> Result<CollectionOptions> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Invalid(format!(
                "cannot read the NCCL communicator config {}: {e}",
                path.display()
            ))
        })?;
        CollectionOptions::from_nccl_comm_cfgs_text(&text)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
    }
}

/// The YAML of Megatron's `nccl_comm_cfgs` file: top-level keys, each a block mapping of
/// scalars one level deeper (or `{}`), `#` comments, blank lines. Anything else is an error
/// naming the line.
fn simple_yaml(text: &str) -> Result<serde_json::Value> {
    use serde_json::{Map, Value};
    let bad = |line: usize, why: &str| {
        Error::Invalid(format!(
            "nccl_comm_cfgs: YAML line {line}: {why} (expected `family:` lines, each followed by indented `option: value` lines)"
        ))
    };
    let mut top = Map::new();
    let mut current: Option<String> = None;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = strip_comment(raw);
        if line.trim().is_empty() || line.trim() == "---" {
            continue;
        }
        let indented = line.starts_with(' ') || line.starts_with('\t');
        let (key, value) = line
            .trim()
            .split_once(':')
            .ok_or_else(|| bad(line_no, "no ':'"))?;
        let key = unquote(key.trim());
        let value = value.trim();
        if !indented {
            let v = match value {
                "" => Value::Object(Map::new()),
                "{}" => Value::Object(Map::new()),
                _ => {
                    return Err(bad(
                        line_no,
                        "a family's options go on indented lines below it",
                    ))
                }
            };
            if top.insert(key.clone(), v).is_some() {
                return Err(bad(line_no, &format!("family '{key}' appears twice")));
            }
            current = Some(key);
        } else {
            let fam = current
                .as_ref()
                .ok_or_else(|| bad(line_no, "an indented option before any family"))?;
            if value.is_empty() {
                return Err(bad(line_no, &format!("option '{key}' has no value")));
            }
            if let Some(Value::Object(m)) = top.get_mut(fam) {
                if m.insert(key.clone(), scalar(value)).is_some() {
                    return Err(bad(line_no, &format!("option '{key}' appears twice")));
                }
            }
        }
    }
    Ok(Value::Object(top))
}

fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if i == 0 || line[..i].ends_with(char::is_whitespace) => return &line[..i],
            _ => {}
        }
    }
    line
}

fn unquote(s: &str) -> String {
    let b = s.as_bytes();
    if s.len() >= 2 && (b[0] == b'"' || b[0] == b'\'') && b[s.len() - 1] == b[0] {
        s[1..s.len() - 1].to_string()
    } else {
        s.to_string()
    }
}

/// A YAML 1.1 scalar as `yaml.safe_load` reads the values of this file.
fn scalar(s: &str) -> serde_json::Value {
    use serde_json::Value;
    if s.starts_with('"') || s.starts_with('\'') {
        return Value::String(unquote(s));
    }
    match s {
        "true" | "True" | "TRUE" | "yes" | "Yes" | "on" | "On" => return Value::Bool(true),
        "false" | "False" | "FALSE" | "no" | "No" | "off" | "Off" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(n) = s.parse::<i64>() {
        return Value::from(n);
    }
    Value::String(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        CollectionOptions::from_nccl_comm_cfgs_text(text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn megatron_yaml_and_json_read_the_same() {
        let yaml = "# Megatron nccl_comm_cfgs\n---\ntp:\n  cga_cluster_size: 4   # Hopper\n  max_ctas: 32\n  min_ctas: 1\n  is_high_priority_stream: True\ndp:\n  net_name: 'Socket'\nmp: {}\n";
        let json = r#"{"tp": {"cga_cluster_size": 4, "max_ctas": 32, "min_ctas": 1, "is_high_priority_stream": true}, "dp": {"net_name": "Socket"}, "mp": {}}"#;
        let a = CollectionOptions::from_nccl_comm_cfgs_text(yaml).unwrap();
        let b = CollectionOptions::from_nccl_comm_cfgs_text(json).unwrap();
        assert_eq!(a, b);
        let names: Vec<&str> = a.families().map(|(n, _)| n).collect();
        assert_eq!(names, ["dp", "mp", "tp"]);
        assert_eq!(
            a.family("tp").unwrap().backend,
            BackendOptions::Nccl(NcclGroupOptions {
                is_high_priority_stream: true,
                cga_cluster_size: Some(4),
                min_ctas: Some(1),
                max_ctas: Some(32),
                net_name: None,
                split_share: None,
            })
        );
        let dir = std::env::temp_dir().join(format!("grid-nccl-cfgs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nccl.yaml");
        std::fs::write(&path, yaml).unwrap();
        assert_eq!(
            CollectionOptions::from_nccl_comm_cfgs_file(&path).unwrap(),
            a
        );
        let missing = dir.join("absent.yaml");
        let e = CollectionOptions::from_nccl_comm_cfgs_file(&missing).unwrap_err();
        assert!(e.to_string().contains("absent.yaml"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_errors_naming_the_problem() {
        assert_eq!(
            err("tp:\n  max_cta: 3\n"),
            "nccl_comm_cfgs: family 'tp': unknown option 'max_cta'; valid: is_high_priority_stream, cga_cluster_size, max_ctas, min_ctas, net_name"
        );
        assert!(err("tpp:\n  max_ctas: 3\n").contains("tpp"));
        assert_eq!(
            err("tp:\n  max_ctas: -1\n"),
            "nccl_comm_cfgs: family 'tp': max_ctas must be an integer in 0..=4294967295, found -1"
        );
        assert_eq!(
            err("tp:\n  is_high_priority_stream: 3\n"),
            "nccl_comm_cfgs: family 'tp': is_high_priority_stream must be true or false, found 3"
        );
        assert_eq!(
            err("dp:\n  net_name: nvlink\n"),
            "nccl_comm_cfgs: family 'dp': group '(unnamed)': NCCL net_name \"nvlink\" is not supported; accepted values: 'IB' or 'Socket'"
        );
        assert!(err("tp:\n  min_ctas: 8\n  max_ctas: 4\n")
            .contains("min_ctas 8 is larger than max_ctas 4"));
        assert!(err("  max_ctas: 4\n").contains("line 1: an indented option before any family"));
        assert!(err("tp: 3\n").contains("line 1"));
        assert!(err("tp:\n  max_ctas\n").contains("line 2: no ':'"));
        assert!(err("tp:\ntp:\n").contains("family 'tp' appears twice"));
        assert!(
            err("tp:\n  max_ctas: 1\n  max_ctas: 2\n").contains("option 'max_ctas' appears twice")
        );
        assert!(err("{\"tp\": 3}").contains("expected a mapping of options, found 3"));
        assert!(err("{\"tp\": ").contains("invalid JSON"));
        assert!(err("[1]").contains("line 1"));
    }

    #[test]
    fn family_levels_get_their_names_and_the_merged_options() {
        let mut o = CollectionOptions::new()
            .with_default(GroupOptions::new().with_timeout(Duration::from_secs(9)));
        o.set("hcp", GroupOptions::new().named("HCP")).unwrap();
        o.set("dp_cp_ag", GroupOptions::new()).unwrap();
        let e = o.set("nope", GroupOptions::new()).unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("tp"), "{e}");
        let l1 = o.for_level(FamilyLevel {
            family: Family::Hcp,
            level: 1,
        });
        assert_eq!(l1.name.as_deref(), Some("HCP[1]"));
        assert_eq!(l1.timeout, Some(TimeLimit::After(Duration::from_secs(9))));
        let pp = o.for_level(FamilyLevel {
            family: Family::Pp,
            level: 0,
        });
        assert_eq!(pp.name.as_deref(), Some("pp"));
    }

    #[test]
    fn options_are_validated() {
        let bad = |o: GroupOptions| o.validate().unwrap_err().to_string();
        assert!(bad(GroupOptions::new().named("a\nb")).contains("control characters"));
        assert!(bad(GroupOptions::new()
            .named("g")
            .with_backend(BackendOptions::Gloo(GlooGroupOptions {
                timeout: Some(Duration::ZERO),
                hostname: None
            })))
        .starts_with("group 'g': Gloo timeout 0"));
        assert!(bad(
            GroupOptions::new().with_backend(BackendOptions::Gloo(GlooGroupOptions {
                timeout: None,
                hostname: Some(String::new())
            }))
        )
        .contains("hostname is empty"));
        assert!(GroupOptions::new()
            .with_timeout(TimeLimit::Unlimited)
            .check_backend("mpi")
            .is_ok());
        assert!(GroupOptions::new()
            .with_backend(BackendOptions::Nccl(NcclGroupOptions::default()))
            .check_backend("nccl")
            .is_ok());
    }
}
