//! `grid comm-grid`: replays a list of Megatron `HyperCommGrid` queries on one
//! [`grid_core::CommGrid`] (the reference vectors' `queries` format) and prints every result.

use crate::error::{usage, Result};
use crate::out::{first_groups, Out, MAX_ENUMERATED};
use crate::values::{name_list, positive, positive_list, uint, Format, FormatArg};
use crate::Failure;
use grid_core::{CommGrid, CreatedGroup, Group, GroupList, HyperGrid};
use serde_json::Value;
use std::io::Read;

/// The largest total number of group members the enumerating queries of one run may print.
pub const MAX_PRINTED_MEMBERS: usize = 1 << 26;

const AFTER_HELP: &str = "The queries run in order on one grid, so created groups and registered views persist between
them. The file holds a JSON list (or an object with a \"queries\" list) of
  {\"fn\": \"gen_rank_enum\", \"dims\": D}       Megatron's raw _gen_rank_enum, dims taken literally
  {\"fn\": \"order_dims\", \"dims\": D}          {\"ordered_dims\", \"key\"}: slowest first, '-'-joined
  {\"fn\": \"get_rank_enum\", \"dims\": D, \"view\"?: V}   every group (canonical order)
  {\"fn\": \"create_pg\", \"dims\": D, \"view\"?: V}       {\"key\", \"enumeration\", \"my_group\"}
  {\"fn\": \"get_pg\", \"dims\": D, \"view\"?: V}          the current rank's group of a created key
  {\"fn\": \"register_view\", \"name\": N, \"shape\": [..], \"dim_names\": [..], \"shared_dims\"?: [..]}
  {\"fn\": \"is_current_rank_in_grid\"}
where D is a dimension name or a list of names (a plain name is its own key in order_dims).
JSON: [{\"fn\", \"ok\": VALUE} or {\"fn\", \"error\": {\"type\", \"message\"}}, ...], one entry per query;
\"type\" is the exception class Megatron raises for the same condition (ValueError, KeyError,
RuntimeError, AssertionError), or null where it has none. A query that fails is a result, not
a failure of the command: the exit status is 0. A malformed query file or an invalid grid exits
with status 2, and so do enumerating queries (gen_rank_enum, get_rank_enum, create_pg,
register_view with shared_dims) on a grid of more than 16,777,216 ranks.";

/// Options of `grid comm-grid`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Size of each dimension, the first varying fastest
    #[arg(long, value_name = "S1,S2,...", value_parser = positive_list)]
    shape: std::vec::Vec<usize>,
    /// One name per dimension
    #[arg(long, value_name = "D1,D2,...", value_parser = name_list)]
    dims: std::vec::Vec<String>,
    /// First rank of the grid (default 0)
    #[arg(long, value_name = "O", value_parser = uint)]
    rank_offset: Option<usize>,
    /// The world size; the grid must fit (default: offset + grid size)
    #[arg(long, value_name = "W", value_parser = positive)]
    world_size: Option<usize>,
    /// The current rank, below W (default 0)
    #[arg(long, value_name = "R", value_parser = uint)]
    rank: Option<usize>,
    /// The queries, a JSON file or - for stdin
    #[arg(long, value_name = "FILE|-", value_hint = clap::ValueHint::FilePath)]
    queries: String,
    #[command(flatten)]
    format: FormatArg,
}

/// A query's `dims`: one name (kept as is by `order_dims`) or a list.
#[derive(Debug)]
enum Dims {
    One(String),
    List(Vec<String>),
}

impl Dims {
    fn names(&self) -> &[String] {
        match self {
            Dims::One(s) => std::slice::from_ref(s),
            Dims::List(l) => l,
        }
    }

    fn show(&self) -> String {
        match self {
            Dims::One(s) => s.clone(),
            Dims::List(l) => format!("[{}]", l.join(", ")),
        }
    }
}

#[derive(Debug)]
enum Op {
    GenRankEnum(Dims),
    OrderDims(Dims),
    GetRankEnum(Dims, Option<String>),
    CreatePg(Dims, Option<String>),
    GetPg(Dims, Option<String>),
    RegisterView {
        name: String,
        shape: Vec<usize>,
        dim_names: Vec<String>,
        shared: Option<Vec<String>>,
    },
    IsCurrentRankInGrid,
}

const FNS: &str = "gen_rank_enum, order_dims, get_rank_enum, create_pg, get_pg, register_view, is_current_rank_in_grid";

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::GenRankEnum(_) => "gen_rank_enum",
            Op::OrderDims(_) => "order_dims",
            Op::GetRankEnum(..) => "get_rank_enum",
            Op::CreatePg(..) => "create_pg",
            Op::GetPg(..) => "get_pg",
            Op::RegisterView { .. } => "register_view",
            Op::IsCurrentRankInGrid => "is_current_rank_in_grid",
        }
    }

    /// Whether the query walks every group of the grid: the answer holds them all, or (a view
    /// with shared dims) the check compares them.
    fn enumerates(&self) -> bool {
        match self {
            Op::GenRankEnum(_) | Op::GetRankEnum(..) | Op::CreatePg(..) => true,
            Op::RegisterView { shared, .. } => shared.as_ref().is_some_and(|s| !s.is_empty()),
            _ => false,
        }
    }

    fn describe(&self) -> String {
        let in_view = |v: &Option<String>| match v {
            Some(v) => format!(" in view {v}"),
            None => String::new(),
        };
        match self {
            Op::GenRankEnum(d) | Op::OrderDims(d) => format!("{} {}", self.name(), d.show()),
            Op::GetRankEnum(d, v) | Op::CreatePg(d, v) | Op::GetPg(d, v) => {
                format!("{} {}{}", self.name(), d.show(), in_view(v))
            }
            Op::RegisterView { name, .. } => format!("register_view {name}"),
            Op::IsCurrentRankInGrid => self.name().to_string(),
        }
    }
}

/// Reads one query; every problem names the query's position.
fn parse_query(i: usize, q: &Value) -> Result<Op> {
    let obj = q.as_object().ok_or_else(|| {
        usage!("grid comm-grid: query {i} must be an object like {{\"fn\": \"create_pg\", \"dims\": [\"tp\"]}}, got {q}")
    })?;
    let f = match obj.get("fn") {
        Some(Value::String(f)) => f.as_str(),
        Some(other) => {
            return Err(usage!(
                "grid comm-grid: query {i}: \"fn\" must be a string ({FNS}), got {other}"
            ))
        }
        None => {
            return Err(usage!(
                "grid comm-grid: query {i} has no \"fn\" (one of {FNS})"
            ))
        }
    };
    let fields: &[&str] = match f {
        "gen_rank_enum" | "order_dims" => &["fn", "dims"],
        "get_rank_enum" | "create_pg" | "get_pg" => &["fn", "dims", "view"],
        "register_view" => &["fn", "name", "shape", "dim_names", "shared_dims"],
        "is_current_rank_in_grid" => &["fn"],
        other => {
            return Err(usage!(
                "grid comm-grid: query {i}: unknown fn '{other}' (valid: {FNS})"
            ))
        }
    };
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(usage!(
            "grid comm-grid: query {i} ({f}): unknown field '{k}' (valid: {})",
            fields.join(", ")
        ));
    }
    let names = |key: &str, v: &Value| -> Result<Vec<String>> {
        let bad = || {
            usage!("grid comm-grid: query {i} ({f}): \"{key}\" must be a list of names, got {v}")
        };
        v.as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(bad))
            .collect()
    };
    let dims = || -> Result<Dims> {
        match obj.get("dims") {
            Some(Value::String(s)) => Ok(Dims::One(s.clone())),
            Some(v @ Value::Array(_)) => Ok(Dims::List(names("dims", v)?)),
            Some(v) => Err(usage!(
                "grid comm-grid: query {i} ({f}): \"dims\" must be a dimension name or a list of names, got {v}"
            )),
            None => Err(usage!(
                "grid comm-grid: query {i} ({f}) needs \"dims\" (a dimension name or a list of names)"
            )),
        }
    };
    let view = || -> Result<Option<String>> {
        match obj.get("view") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(usage!(
                "grid comm-grid: query {i} ({f}): \"view\" must be a view name, got {v}"
            )),
        }
    };
    Ok(match f {
        "gen_rank_enum" => Op::GenRankEnum(dims()?),
        "order_dims" => Op::OrderDims(dims()?),
        "get_rank_enum" => Op::GetRankEnum(dims()?, view()?),
        "create_pg" => Op::CreatePg(dims()?, view()?),
        "get_pg" => Op::GetPg(dims()?, view()?),
        "register_view" => {
            let need = |k: &str| {
                obj.get(k).ok_or_else(|| {
                    usage!("grid comm-grid: query {i} (register_view) needs \"{k}\"")
                })
            };
            let name = match need("name")? {
                Value::String(s) => s.clone(),
                v => {
                    return Err(usage!(
                    "grid comm-grid: query {i} (register_view): \"name\" must be a string, got {v}"
                ))
                }
            };
            let sv = need("shape")?;
            let bad_shape = || {
                usage!(
                    "grid comm-grid: query {i} (register_view): \"shape\" must be a list of non-negative integers, got {sv}"
                )
            };
            let shape = sv
                .as_array()
                .ok_or_else(bad_shape)?
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(bad_shape)
                })
                .collect::<Result<Vec<usize>>>()?;
            let dim_names = names("dim_names", need("dim_names")?)?;
            let shared = match obj.get("shared_dims") {
                None | Some(Value::Null) => None,
                Some(v) => Some(names("shared_dims", v)?),
            };
            Op::RegisterView {
                name,
                shape,
                dim_names,
                shared,
            }
        }
        _ => Op::IsCurrentRankInGrid,
    })
}

fn parse_queries(text: &str, source: &str) -> Result<Vec<Op>> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| usage!("grid comm-grid: {source} is not valid JSON: {e}"))?;
    let list = match &v {
        Value::Array(a) => a,
        Value::Object(o) => match o.get("queries") {
            Some(Value::Array(a)) => a,
            _ => {
                return Err(usage!(
                    "grid comm-grid: {source} must hold a list of queries or an object with a \"queries\" list"
                ))
            }
        },
        _ => {
            return Err(usage!(
                "grid comm-grid: {source} must hold a list of queries, got {}",
                if v.is_string() { "a string" } else { "a scalar" }
            ))
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, q)| parse_query(i, q))
        .collect()
}

fn read_queries(arg: &str) -> Result<(String, String)> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| usage!("grid comm-grid: cannot read the queries from stdin: {e}"))?;
        Ok((s, "stdin".into()))
    } else {
        let s = std::fs::read_to_string(arg)
            .map_err(|e| usage!("grid comm-grid: cannot read the queries file '{arg}': {e}"))?;
        Ok((s, format!("queries file '{arg}'")))
    }
}

/// A successful answer.
enum Answer {
    Groups(GroupList),
    Ordered(Vec<String>, String),
    Created(CreatedGroup),
    MaybeGroup(Option<Group>),
    Null,
    Bool(bool),
}

fn answer(g: &mut CommGrid, op: &Op) -> grid_core::Result<Answer> {
    Ok(match op {
        Op::GenRankEnum(d) => Answer::Groups(g.base().raw_groups(d.names())?),
        // Megatron keeps a plain name as it is (no lookup); a list is sorted slowest first.
        Op::OrderDims(Dims::One(s)) => Answer::Ordered(vec![s.clone()], s.clone()),
        Op::OrderDims(Dims::List(l)) => {
            let o = g.base().ordered_dims(l)?;
            let key = o.join("-");
            Answer::Ordered(o, key)
        }
        Op::GetRankEnum(d, v) => Answer::Groups(g.rank_enum(d.names(), v.as_deref())?),
        Op::CreatePg(d, v) => Answer::Created(g.create_pg(d.names(), v.as_deref())?),
        Op::GetPg(d, v) => Answer::MaybeGroup(g.get_pg(d.names(), v.as_deref())?),
        Op::RegisterView {
            name,
            shape,
            dim_names,
            shared,
        } => {
            g.register_view(name, shape.clone(), dim_names, shared.as_deref())?;
            Answer::Null
        }
        Op::IsCurrentRankInGrid => Answer::Bool(g.is_current_rank_in_grid()),
    })
}

fn json_strings(out: &mut Out<'_>, v: &[String]) -> std::io::Result<()> {
    out.raw("[")?;
    for (i, s) in v.iter().enumerate() {
        if i > 0 {
            out.raw(",")?;
        }
        out.string(s)?;
    }
    out.raw("]")
}

fn json_group(out: &mut Out<'_>, g: &Option<Group>) -> std::io::Result<()> {
    match g {
        Some(g) => out.ranks(&g.to_vec()),
        None => out.raw("null"),
    }
}

fn write_json(
    out: &mut Out<'_>,
    op: &Op,
    r: &grid_core::Result<Answer>,
) -> std::result::Result<(), Failure> {
    out.raw("{")?;
    out.key("fn", true)?;
    out.string(op.name())?;
    match r {
        Ok(a) => {
            out.key("ok", false)?;
            match a {
                Answer::Groups(g) => out.groups(g.iter())?,
                Answer::Ordered(o, key) => {
                    out.raw("{")?;
                    out.key("ordered_dims", true)?;
                    json_strings(out, o)?;
                    out.key("key", false)?;
                    out.string(key)?;
                    out.raw("}")?;
                }
                Answer::Created(c) => {
                    out.raw("{")?;
                    out.key("key", true)?;
                    let key = serde_json::to_string(&c.key).map_err(std::io::Error::from)?;
                    out.raw(&key)?;
                    out.key("enumeration", false)?;
                    out.groups(c.enumeration.iter())?;
                    out.key("my_group", false)?;
                    json_group(out, &c.my_group)?;
                    out.raw("}")?;
                }
                Answer::MaybeGroup(g) => json_group(out, g)?,
                Answer::Null => out.raw("null")?,
                Answer::Bool(b) => out.boolean(*b)?,
            }
        }
        Err(e) => {
            out.key("error", false)?;
            out.raw("{")?;
            out.key("type", true)?;
            match e.megatron_category() {
                Some(t) => out.string(t)?,
                None => out.raw("null")?,
            }
            out.key("message", false)?;
            out.string(&e.to_string())?;
            out.raw("}")?;
        }
    }
    out.raw("}")?;
    Ok(())
}

/// "4 groups of 2: [0, 4] [1, 5] ..." in about `budget` characters.
fn groups_text(g: &GroupList, budget: usize) -> Result<String> {
    let n = g.len();
    let size = if n > 0 { g.get(0).len() } else { 0 };
    let firsts = first_groups(n, budget, |i| Ok(Group::from_list(g.get(i).to_vec())))?;
    Ok(format!(
        "{n} group{} of {size}: {firsts}",
        if n == 1 { "" } else { "s" }
    ))
}

fn text_line(rank: usize, op: &Op, r: &grid_core::Result<Answer>) -> Result<String> {
    const BUDGET: usize = 96;
    let group = |g: &Option<Group>| match g {
        Some(g) => g.to_string(),
        None => format!("none (rank {rank} is outside the grid)"),
    };
    let body = match r {
        Ok(Answer::Groups(g)) => groups_text(g, BUDGET)?,
        Ok(Answer::Ordered(o, key)) => {
            let key = if key.is_empty() { "\"\"" } else { key };
            format!("ordered [{}], key {key}", o.join(", "))
        }
        Ok(Answer::Created(c)) => {
            let key = match &c.key {
                grid_core::PgKey::Base(k) if k.is_empty() => "\"\"".to_string(),
                grid_core::PgKey::Base(k) => k.clone(),
                grid_core::PgKey::View(v, d) => format!("{} of view {v}", d.join("-")),
            };
            format!(
                "created under key {key}, {}; rank {rank}'s group {}",
                groups_text(&c.enumeration, BUDGET)?,
                group(&c.my_group)
            )
        }
        Ok(Answer::MaybeGroup(g)) => format!("rank {rank}'s group {}", group(g)),
        Ok(Answer::Null) => "registered".into(),
        Ok(Answer::Bool(b)) => b.to_string(),
        Err(e) => match e.megatron_category() {
            Some(t) => format!("error ({t}): {e}"),
            None => format!("error: {e}"),
        },
    };
    Ok(format!("{}: {body}", op.describe()))
}

/// `grid comm-grid`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let (shape, dims) = (a.shape.clone(), &a.dims);
    let offset = a.rank_offset.unwrap_or(0);
    let queries_arg = a.queries.as_str();
    let world = match a.world_size {
        Some(w) => w,
        None => {
            let g = HyperGrid::new(shape.clone(), dims, offset)?;
            g.offset() + g.size()
        }
    };
    let rank = a.rank.unwrap_or(0);
    if rank >= world {
        return Err(usage!(
            "grid comm-grid: rank {rank} is outside the world of {world} ranks (0..{world})"
        )
        .into());
    }
    let mut grid = CommGrid::new(shape, dims, offset, world, rank)?;
    let (text, source) = read_queries(queries_arg)?;
    let ops = parse_queries(&text, &source)?;
    let size = grid.base().size();
    let enumerating = ops.iter().filter(|o| o.enumerates()).count();
    if enumerating > 0 && size > MAX_ENUMERATED {
        return Err(usage!(
            "grid comm-grid: a grid of {size} ranks is too large to enumerate (at most {MAX_ENUMERATED}); \
             gen_rank_enum, get_rank_enum and create_pg print every group, register_view with shared_dims compares them"
        )
        .into());
    }
    if size.saturating_mul(enumerating) > MAX_PRINTED_MEMBERS {
        return Err(usage!(
            "grid comm-grid: {enumerating} enumerating queries on a grid of {size} ranks would print more than {MAX_PRINTED_MEMBERS} ranks"
        )
        .into());
    }
    match a.format.format {
        Format::Json => {
            out.raw("[")?;
            for (i, op) in ops.iter().enumerate() {
                if i > 0 {
                    out.raw(",")?;
                }
                let r = answer(&mut grid, op);
                write_json(out, op, &r)?;
            }
            out.raw("]\n")?;
        }
        Format::Text => {
            let b = grid.base();
            let dims: Vec<String> = b
                .dim_names()
                .iter()
                .zip(b.shape())
                .map(|(n, s)| format!("{n} {s}"))
                .collect();
            out.line(&format!(
                "Grid {} (first varies fastest), ranks {}..={} of a world of {world}, current rank {rank}",
                dims.join(" × "),
                b.offset(),
                b.offset() + b.size() - 1
            ))?;
            for (i, op) in ops.iter().enumerate() {
                let r = answer(&mut grid, op);
                out.line(&format!("  #{i} {}", text_line(rank, op, &r)?))?;
            }
        }
    }
    Ok(())
}
