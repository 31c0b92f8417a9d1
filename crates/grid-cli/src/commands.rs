//! The subcommands: `layout`, `enum`, `hierarchical`, `rank-generator`, `pipeline` (and the
//! shared helpers of `comm-grid`, which lives in its own module).

use crate::args::usage;
use crate::args::{Parsed, Result, Spec};
use crate::out::{Out, Table};
use crate::Failure;
use grid_core::{
    hierarchical_groups, hierarchical_groups_of, Family, FamilyLevel, GeneratorSizes, Group,
    GroupList, HyperGrid, LayoutConfig, LayoutPlan, RankGenerator, RankView,
};

/// The largest number of ranks whose every group the command will enumerate (about 150 MB of
/// JSON per family). Larger layouts can still be inspected one rank at a time (`--rank R`).
pub const MAX_ENUMERATED: usize = 1 << 24;

/// The largest total number of members of one rank's groups that `--rank R --format json`
/// prints (a rank's `intra_dist_opt` group alone spans the whole world).
pub const MAX_VIEW_MEMBERS: usize = 1 << 25;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Text,
    Json,
}

pub(crate) fn format_of(p: &Parsed, command: &str) -> Result<Format> {
    match p.get("format") {
        None | Some("text") => Ok(Format::Text),
        Some("json") => Ok(Format::Json),
        Some(other) => Err(usage!(
            "{command}: unknown format '{other}': valid formats are text and json"
        )),
    }
}

/// Help text of one command, if it exists.
pub fn help_of(command: &str) -> Option<&'static str> {
    match command {
        "layout" => Some(LAYOUT_HELP),
        "enum" => Some(ENUM_HELP),
        "hierarchical" => Some(HIER_HELP),
        "rank-generator" => Some(RANKGEN_HELP),
        "pipeline" => Some(PIPELINE_HELP),
        "comm-grid" => Some(crate::comm_grid::HELP),
        _ => None,
    }
}

fn show_group(g: &Group) -> String {
    g.to_string()
}

fn show_list(v: &[usize]) -> String {
    Group::from_list(v.to_vec()).to_string()
}

/// The first groups of a family that fit in about `budget` characters (at least one).
pub(crate) fn first_groups(
    n: usize,
    budget: usize,
    group: impl Fn(usize) -> Result<Group>,
) -> Result<String> {
    let mut s = String::new();
    let mut shown = 0;
    while shown < n {
        let g = show_group(&group(shown)?);
        if shown > 0 && s.len() + 1 + g.len() > budget {
            break;
        }
        if shown > 0 {
            s.push(' ');
        }
        s.push_str(&g);
        shown += 1;
    }
    if shown < n {
        s.push_str(" ...");
    }
    Ok(s)
}

// ------------------------------------------------------------------------------------------------
// grid layout

const LAYOUT: Spec = Spec {
    command: "grid layout",
    values: &[
        "world-size",
        "tp",
        "pp",
        "cp",
        "ep",
        "etp",
        "order",
        "dist-opt-instances",
        "hcp",
        "rank-offset",
        "vpp",
        "dp",
        "rank",
        "format",
    ],
    flags: &[],
    positionals: &[],
};

const LAYOUT_HELP: &str = "grid layout: every process group of a Megatron-Core layout (initialize_model_parallel)

usage: grid layout --world-size W [options] [--rank R] [--format text|json]

  --world-size W            number of ranks the layout covers (required)
  --tp N --pp N --cp N      tensor, pipeline and context parallel sizes (default 1)
  --ep N                    expert parallel size (default 1)
  --etp N                   expert tensor parallel size (default: --tp)
  --order ORDER             dimension order, fastest first (default tp-cp-ep-dp-pp)
  --dist-opt-instances N    partial distributed-optimizer instances (default 1)
  --hcp A,B,...             hierarchical context-parallel sizes (product = cp)
  --rank-offset O           first rank of the layout (default 0)
  --vpp N                   virtual pipeline size (validated only; needs pp > 1)
  --dp N                    expected data-parallel size: an error unless W / (tp·pp·cp) = N
  --rank R                  only rank R's view: its group in every family
  --format text|json        readable text (default) or JSON

Data parallel size dp = W / (tp·pp·cp); expert dp = W / (etp·ep·pp).
JSON without --rank: {\"world_size\", \"dp\", \"expert_tp\", \"expert_dp\", \"families\": {NAME: [[ranks], ...]}}
JSON with --rank:    {\"world_size\", \"dp\", \"expert_tp\", \"expert_dp\", \"rank\", \"coords\", \"groups\": {NAME: [ranks] or null},
                      \"pp_next\", \"pp_prev\", \"is_first_stage\", \"is_last_stage\"}
Families: tp pp mp embd pos_embd cp tp_cp hcp ep expt_tp tp_ep tp_ep_pp tp_dp tp_dp_cp dp dp_cp
          expt_dp intra_dp_cp intra_expt_dp inter_dist_opt intra_dist_opt";

fn layout_plan(p: &Parsed) -> Result<LayoutPlan> {
    let world = p.positive("world-size")?.ok_or_else(|| {
        usage!("grid layout: --world-size is required (the number of ranks the layout covers)")
    })?;
    let mut cfg = LayoutConfig::new(world);
    cfg.tp = p.positive("tp")?.unwrap_or(1);
    cfg.pp = p.positive("pp")?.unwrap_or(1);
    cfg.cp = p.positive("cp")?.unwrap_or(1);
    cfg.ep = p.positive("ep")?.unwrap_or(1);
    cfg.etp = p.positive("etp")?;
    if let Some(o) = p.get("order") {
        cfg.order = o.to_string();
    }
    cfg.dist_opt_instances = p.positive("dist-opt-instances")?.unwrap_or(1);
    cfg.hcp_sizes = p.positive_list("hcp")?;
    cfg.rank_offset = p.uint("rank-offset")?.unwrap_or(0);
    cfg.vpp = p.positive("vpp")?;
    let (tp, pp, cp) = (cfg.tp, cfg.pp, cfg.cp);
    let plan = LayoutPlan::new(cfg)?;
    if let Some(dp) = p.positive("dp")? {
        if dp != plan.dp() {
            return Err(usage!(
                "grid layout: --dp {dp} does not match the layout: world size {world} / (tp·pp·cp = {tp}·{pp}·{cp}) gives dp = {}",
                plan.dp()
            ));
        }
    }
    Ok(plan)
}

/// `grid layout`.
pub fn layout(args: &[String], out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let p = LAYOUT.parse(args)?;
    if p.help {
        out.line(LAYOUT_HELP)?;
        return Ok(());
    }
    let format = format_of(&p, LAYOUT.command)?;
    let plan = layout_plan(&p)?;
    match p.uint("rank")? {
        Some(rank) => {
            let view = plan.rank_view(rank)?;
            match format {
                Format::Json => {
                    let members = Family::ALL
                        .iter()
                        .filter_map(|&f| view.group(f))
                        .chain(view.hcp().unwrap_or_default())
                        .fold(0usize, |acc, g| acc.saturating_add(g.len()));
                    if members > MAX_VIEW_MEMBERS {
                        return Err(usage!(
                            "grid layout: rank {rank}'s groups have {members} members in all, too many to print as JSON (at most {MAX_VIEW_MEMBERS}); the text format abbreviates long groups"
                        )
                        .into());
                    }
                    rank_view_json(&plan, &view, out)?
                }
                Format::Text => rank_view_text(&plan, &view, out)?,
            }
        }
        None => match format {
            Format::Json => {
                if plan.world_size() > MAX_ENUMERATED {
                    return Err(usage!(
                        "grid layout: the full layout of {} ranks is too large to print as JSON (at most {MAX_ENUMERATED}); use --rank R for one rank's groups",
                        plan.world_size()
                    )
                    .into());
                }
                layout_json(&plan, out)?
            }
            Format::Text => layout_text(&plan, out)?,
        },
    }
    Ok(())
}

fn header_json(plan: &LayoutPlan, out: &mut Out<'_>) -> std::io::Result<()> {
    out.raw("{")?;
    out.key("world_size", true)?;
    out.num(plan.world_size())?;
    out.key("dp", false)?;
    out.num(plan.dp())?;
    out.key("expert_tp", false)?;
    out.num(plan.expert_tp())?;
    out.key("expert_dp", false)?;
    out.num(plan.expert_dp())
}

fn hcp_levels(plan: &LayoutPlan) -> Vec<FamilyLevel> {
    plan.family_levels()
        .into_iter()
        .filter(|f| f.family == Family::Hcp)
        .collect()
}

fn layout_json(plan: &LayoutPlan, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    header_json(plan, out)?;
    out.key("families", false)?;
    out.raw("{")?;
    let mut first = true;
    for f in Family::ALL {
        if f == Family::Hcp {
            let levels = hcp_levels(plan);
            if levels.is_empty() {
                continue;
            }
            out.key(f.name(), first)?;
            out.raw("[")?;
            for (i, fl) in levels.into_iter().enumerate() {
                if i > 0 {
                    out.raw(",")?;
                }
                let g = plan.groups(fl)?;
                out.groups(g.iter())?;
            }
            out.raw("]")?;
        } else {
            out.key(f.name(), first)?;
            if plan.has(f) {
                let g = plan.groups(f.into())?;
                out.groups(g.iter())?;
            } else {
                out.raw("null")?;
            }
        }
        first = false;
    }
    out.raw("}}\n")?;
    Ok(())
}

/// "tp 2 × cp 2 × dp 8 × pp 2": the grid's dimensions in order, without the always-1 `gtp_remat`
/// and the dimension this grid never uses (`ep` for the dense grid, `cp` for the expert grid).
fn grid_sizes(g: &HyperGrid, unused: &str, rename: &[(&str, &str)]) -> String {
    g.dim_names()
        .iter()
        .zip(g.shape())
        .filter(|(n, _)| n.as_str() != "gtp_remat" && n.as_str() != unused)
        .map(|(n, s)| {
            let name = rename
                .iter()
                .find(|(from, _)| from == n)
                .map_or(n.as_str(), |(_, to)| to);
            format!("{name} {s}")
        })
        .collect::<Vec<_>>()
        .join(" × ")
}

fn layout_header_text(plan: &LayoutPlan, out: &mut Out<'_>) -> std::io::Result<()> {
    let cfg = plan.config();
    let first = plan.rank_offset();
    out.line(&format!(
        "Layout of {} ranks ({}..={}), order {} (fastest first)",
        plan.world_size(),
        first,
        first + plan.world_size() - 1,
        cfg.order
    ))?;
    out.line(&format!(
        "  dense grid:  {}",
        grid_sizes(plan.dense().grid(), "ep", &[])
    ))?;
    out.line(&format!(
        "  expert grid: {}",
        grid_sizes(
            plan.expert().grid(),
            "cp",
            &[("tp", "expert tp"), ("dp", "expert dp")]
        )
    ))?;
    let mut extra = vec![
        format!("dp {}", plan.dp()),
        format!("expert tp {}", plan.expert_tp()),
        format!("expert dp {}", plan.expert_dp()),
        format!(
            "{} distributed-optimizer instance{}",
            cfg.dist_opt_instances,
            if cfg.dist_opt_instances == 1 { "" } else { "s" }
        ),
    ];
    if let Some(h) = &cfg.hcp_sizes {
        extra.push(format!("hierarchical cp {h:?}"));
    }
    if let Some(v) = cfg.vpp {
        extra.push(format!("virtual pipeline {v}"));
    }
    out.line(&format!("  {}", extra.join(", ")))
}

fn layout_text(plan: &LayoutPlan, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    layout_header_text(plan, out)?;
    out.line("")?;
    let mut t = Table::new(
        &[
            "family",
            "groups",
            "size",
            "first groups (Megatron's order)",
        ],
        &[false, true, true, false],
    );
    for f in Family::ALL {
        let levels: Vec<FamilyLevel> = if f == Family::Hcp {
            hcp_levels(plan)
        } else if plan.has(f) {
            vec![f.into()]
        } else {
            t.row(vec![
                f.name().into(),
                "-".into(),
                "-".into(),
                "(none: one distributed-optimizer instance)".into(),
            ]);
            continue;
        };
        for fl in levels {
            let n = plan.num_groups(fl)?;
            let size = plan.group_at(fl, 0)?.len();
            let firsts = first_groups(n, 64, |i| Ok(plan.group_at(fl, i)?))?;
            t.row(vec![
                fl.to_string(),
                n.to_string(),
                size.to_string(),
                firsts,
            ]);
        }
    }
    t.write(out, "")?;
    Ok(())
}

fn rank_view_json(
    plan: &LayoutPlan,
    v: &RankView,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    header_json(plan, out)?;
    out.key("rank", false)?;
    out.num(v.rank)?;
    out.key("coords", false)?;
    let c = v.coords;
    out.raw("{")?;
    for (i, (k, x)) in [
        ("tp", c.tp),
        ("cp", c.cp),
        ("dp", c.dp),
        ("pp", c.pp),
        ("ep", c.ep),
        ("expt_tp", c.expt_tp),
        ("expt_dp", c.expt_dp),
    ]
    .into_iter()
    .enumerate()
    {
        out.key(k, i == 0)?;
        out.num(x)?;
    }
    out.raw("}")?;
    out.key("groups", false)?;
    out.raw("{")?;
    let mut buf = Vec::new();
    for (i, f) in Family::ALL.into_iter().enumerate() {
        out.key(f.name(), i == 0)?;
        if f == Family::Hcp {
            match v.hcp() {
                Some(levels) => {
                    out.raw("[")?;
                    for (j, g) in levels.iter().enumerate() {
                        if j > 0 {
                            out.raw(",")?;
                        }
                        buf.clear();
                        g.extend_into(&mut buf);
                        out.ranks(&buf)?;
                    }
                    out.raw("]")?;
                }
                None => out.raw("null")?,
            }
        } else {
            match v.group(f) {
                Some(g) => {
                    buf.clear();
                    g.extend_into(&mut buf);
                    out.ranks(&buf)?;
                }
                None => out.raw("null")?,
            }
        }
    }
    out.raw("}")?;
    out.key("pp_next", false)?;
    out.num(v.pp_next)?;
    out.key("pp_prev", false)?;
    out.num(v.pp_prev)?;
    out.key("is_first_stage", false)?;
    out.boolean(v.is_first_stage)?;
    out.key("is_last_stage", false)?;
    out.boolean(v.is_last_stage)?;
    out.raw("}\n")?;
    Ok(())
}

/// The rank's group rank (its index in the sorted member list), `-` outside the group. Constant
/// time for every group a plan produces (unsorted ones are full lattices).
fn group_rank_text(g: &Group, rank: usize) -> String {
    g.group_rank(rank).map_or("-".into(), |r| r.to_string())
}

fn rank_view_text(
    plan: &LayoutPlan,
    v: &RankView,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    let c = v.coords;
    let pp = plan.config().pp;
    out.line(&format!(
        "Rank {} of a layout of {} ranks ({}..={}), order {}",
        v.rank,
        plan.world_size(),
        plan.rank_offset(),
        plan.rank_offset() + plan.world_size() - 1,
        plan.config().order
    ))?;
    out.line(&format!(
        "  dense coordinates:  tp {}, cp {}, dp {}, pp {}",
        c.tp, c.cp, c.dp, c.pp
    ))?;
    out.line(&format!(
        "  expert coordinates: expert tp {}, ep {}, expert dp {}, pp {}",
        c.expt_tp, c.ep, c.expt_dp, c.pp
    ))?;
    let stage = match (v.is_first_stage, v.is_last_stage) {
        (true, true) => " (first and last stage)",
        (true, false) => " (first stage)",
        (false, true) => " (last stage)",
        (false, false) => "",
    };
    out.line(&format!(
        "  pipeline: stage {} of {pp}{stage}; next rank {}, previous rank {} (wrapping around)",
        c.pp, v.pp_next, v.pp_prev
    ))?;
    let member = |b: bool| if b { "member" } else { "not a member" };
    out.line(&format!(
        "  embedding group: {}; position-embedding group: {}",
        member(v.in_embedding_group()),
        member(v.in_position_embedding_group())
    ))?;
    out.line("")?;
    let mut t = Table::new(
        &[
            "family",
            "size",
            "rank in group",
            "group (Megatron's order)",
        ],
        &[false, true, true, false],
    );
    for f in Family::ALL {
        if f == Family::Hcp {
            if let Some(levels) = v.hcp() {
                for (l, g) in levels.iter().enumerate() {
                    let fl = FamilyLevel {
                        family: Family::Hcp,
                        level: l,
                    };
                    t.row(vec![
                        fl.to_string(),
                        g.len().to_string(),
                        group_rank_text(g, v.rank),
                        show_group(g),
                    ]);
                }
            }
            continue;
        }
        match v.group(f) {
            Some(g) => t.row(vec![
                f.name().into(),
                g.len().to_string(),
                group_rank_text(g, v.rank),
                show_group(g),
            ]),
            None => {
                let why = if plan.has(f) {
                    "(not a member of any group)"
                } else {
                    "(none: one distributed-optimizer instance)"
                };
                t.row(vec![f.name().into(), "-".into(), "-".into(), why.into()])
            }
        }
    }
    t.write(out, "")?;
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// grid enum

const ENUM: Spec = Spec {
    command: "grid enum",
    values: &[
        "shape",
        "dims",
        "group",
        "rank-offset",
        "world-size",
        "rank",
        "format",
    ],
    flags: &["raw"],
    positionals: &[],
};

const ENUM_HELP: &str = "grid enum: the groups of an N-dimensional grid (Megatron's HyperCommGrid)

usage: grid enum --shape S1,S2,... --dims D1,D2,... --group Dx,Dy [options]

  --shape S1,S2,...     size of each dimension, the first varying fastest (required)
  --dims D1,D2,...      one name per dimension (required)
  --group Dx,Dy,...     the dimensions that span a group (required)
  --rank-offset O       first rank of the grid (default 0)
  --raw                 Megatron's raw _gen_rank_enum: the dims taken literally, the last one
                        varying fastest inside a group (default: the canonical enumeration of
                        create_pg / get_rank_enum: every group ascending, sorted by first member)
  --world-size W        also check that the grid fits a world of W ranks
  --rank R              also print rank R's group (null outside the grid)
  --format text|json    readable text (default) or JSON

JSON: {\"key\": \"...\", \"groups\": [[...], ...]} (plus \"my_group\" with --rank). The key is the
group's dims sorted slowest first and joined with '-' (a single dim is its own key).";

/// `grid enum`.
pub fn enumerate(args: &[String], out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let p = ENUM.parse(args)?;
    if p.help {
        out.line(ENUM_HELP)?;
        return Ok(());
    }
    let format = format_of(&p, ENUM.command)?;
    let shape = p
        .positive_list("shape")?
        .ok_or_else(|| usage!("grid enum: --shape is required (e.g. --shape 2,4)"))?;
    let dims = p
        .name_list("dims")?
        .ok_or_else(|| usage!("grid enum: --dims is required (e.g. --dims tp,dp)"))?;
    let group = p
        .name_list("group")?
        .ok_or_else(|| usage!("grid enum: --group is required (e.g. --group tp)"))?;
    let offset = p.uint("rank-offset")?.unwrap_or(0);
    let world = p.positive("world-size")?;
    let grid = match world {
        Some(w) => HyperGrid::in_world(shape, &dims, offset, w)?,
        None => HyperGrid::new(shape, &dims, offset)?,
    };
    let rank = p.uint("rank")?;
    if let (Some(r), Some(w)) = (rank, world) {
        if r >= w {
            return Err(
                usage!("grid enum: rank {r} is outside the world of {w} ranks (0..{w})").into(),
            );
        }
    }
    let key = if group.len() == 1 {
        grid.dim_index(&group[0])?;
        group[0].clone()
    } else {
        grid.key(&group)?
    };
    if grid.size() > MAX_ENUMERATED {
        return Err(usage!(
            "grid enum: a grid of {} ranks is too large to enumerate (at most {MAX_ENUMERATED})",
            grid.size()
        )
        .into());
    }
    let raw = p.flag("raw");
    let groups = if raw {
        grid.raw_groups(&group)?
    } else {
        grid.groups(&group)?
    };
    let mine: Option<Option<&[usize]>> = rank.map(|r| groups.iter().find(|g| g.contains(&r)));
    match format {
        Format::Json => {
            out.raw("{")?;
            out.key("key", true)?;
            out.string(&key)?;
            out.key("groups", false)?;
            out.groups(groups.iter())?;
            if let Some(m) = mine {
                out.key("my_group", false)?;
                match m {
                    Some(g) => out.ranks(g)?,
                    None => out.raw("null")?,
                }
            }
            out.raw("}\n")?;
        }
        Format::Text => enum_text(&grid, &group, &key, raw, &groups, rank, mine, out)?,
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn enum_text(
    grid: &HyperGrid,
    group: &[String],
    key: &str,
    raw: bool,
    groups: &GroupList,
    rank: Option<usize>,
    mine: Option<Option<&[usize]>>,
    out: &mut Out<'_>,
) -> std::io::Result<()> {
    const SHOWN: usize = 64;
    let dims: Vec<String> = grid
        .dim_names()
        .iter()
        .zip(grid.shape())
        .map(|(n, s)| format!("{n} {s}"))
        .collect();
    out.line(&format!(
        "Grid {} (first varies fastest), ranks {}..={}",
        dims.join(" × "),
        grid.offset(),
        grid.offset() + grid.size() - 1
    ))?;
    let n = groups.len();
    let size = if n > 0 { groups.get(0).len() } else { 0 };
    if raw {
        out.line(&format!(
            "Raw enumeration over {} (the last dim varies fastest inside a group; canonical key {key}): {n} groups of {size} ranks",
            group.join(", ")
        ))?;
    } else {
        out.line(&format!(
            "Key {key}: {n} groups of {size} ranks (each ascending, sorted by first member)"
        ))?;
    }
    for g in groups.iter().take(SHOWN) {
        out.line(&format!("  {}", show_list(g)))?;
    }
    if n > SHOWN {
        out.line(&format!(
            "  ... and {} more groups (use --format json for every group)",
            n - SHOWN
        ))?;
    }
    if let (Some(r), Some(m)) = (rank, mine) {
        match m {
            Some(g) => out.line(&format!("Rank {r} is in {}", show_list(g)))?,
            None => out.line(&format!("Rank {r} is outside the grid"))?,
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// grid hierarchical

const HIER: Spec = Spec {
    command: "grid hierarchical",
    values: &["ranks", "sizes", "rank", "format"],
    flags: &[],
    positionals: &[],
};

const HIER_HELP: &str = "grid hierarchical: hierarchical sub-groups of one group (Megatron's create_hierarchical_groups)

usage: grid hierarchical --ranks R1,R2,... --sizes A,B,... [--rank R] [--format text|json]

  --ranks R1,R2,...     the parent group's members, in order (required)
  --sizes A,B,...       the level sizes; their product must equal the number of ranks (required)
  --rank R              also print rank R's group at every level
  --format text|json    readable text (default) or JSON

Level k groups the members whose positions differ only in the k-th factor (factor 0 fastest).
JSON: {\"levels\": [[[ranks], ...], ...]} (plus \"rank_groups\": [[ranks], ...] with --rank).";

/// `grid hierarchical`.
pub fn hierarchical(args: &[String], out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let p = HIER.parse(args)?;
    if p.help {
        out.line(HIER_HELP)?;
        return Ok(());
    }
    let format = format_of(&p, HIER.command)?;
    let ranks = p.uint_list("ranks")?.ok_or_else(|| {
        usage!("grid hierarchical: --ranks is required (the parent group, e.g. --ranks 0,4,8,12)")
    })?;
    for (i, r) in ranks.iter().enumerate() {
        if ranks[..i].contains(r) {
            return Err(usage!(
                "grid hierarchical: --ranks lists rank {r} more than once: a group's members are distinct"
            )
            .into());
        }
    }
    let sizes = p
        .positive_list("sizes")?
        .ok_or_else(|| usage!("grid hierarchical: --sizes is required (e.g. --sizes 2,2)"))?;
    let levels = hierarchical_groups(&ranks, &sizes)?;
    let rank = p.uint("rank")?;
    let mine = rank
        .map(|r| hierarchical_groups_of(&ranks, &sizes, r))
        .transpose()?;
    match format {
        Format::Json => {
            out.raw("{")?;
            out.key("levels", true)?;
            out.raw("[")?;
            for (i, l) in levels.iter().enumerate() {
                if i > 0 {
                    out.raw(",")?;
                }
                out.groups(l.iter().map(Vec::as_slice))?;
            }
            out.raw("]")?;
            if let Some(m) = &mine {
                out.key("rank_groups", false)?;
                out.groups(m.iter().map(Vec::as_slice))?;
            }
            out.raw("}\n")?;
        }
        Format::Text => {
            out.line(&format!(
                "Hierarchical groups of {} with level sizes {sizes:?}",
                show_list(&ranks)
            ))?;
            for (i, l) in levels.iter().enumerate() {
                let gs: Vec<String> = l.iter().map(|g| show_list(g)).collect();
                out.line(&format!(
                    "  level {i} (size {}): {}",
                    sizes[i],
                    gs.join(" ")
                ))?;
            }
            if let (Some(r), Some(m)) = (rank, &mine) {
                let gs: Vec<String> = m
                    .iter()
                    .enumerate()
                    .map(|(i, g)| format!("level {i} {}", show_list(g)))
                    .collect();
                out.line(&format!("Rank {r}: {}", gs.join(", ")))?;
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// grid rank-generator

const RANKGEN: Spec = Spec {
    command: "grid rank-generator",
    values: &[
        "tp",
        "ep",
        "dp",
        "pp",
        "cp",
        "order",
        "rank-offset",
        "tokens",
        "format",
    ],
    flags: &[],
    positionals: &[],
};

const RANKGEN_HELP: &str =
    "grid rank-generator: Megatron's RankGenerator (order strings and masked orthogonal groups)

usage: grid rank-generator --order ORDER [--tp N] [--ep N] [--dp N] [--pp N] [--cp N]
                           [--rank-offset O] [--tokens T1,T2,...] [--format text|json]

  --order ORDER         order string, fastest first, e.g. tp-cp-ep-dp-pp (required)
  --tp/--ep/--dp/--pp/--cp N   sizes (default 1); ep and cp cannot both exceed 1
  --rank-offset O       added to every rank (default 0)
  --tokens T1,T2,...    the groupings to enumerate, each a '-'-joined set of tokens
                        (default tp,pp,dp,cp,ep)
  --format text|json    readable text (default) or JSON

JSON: {\"normalized_order\", \"ordered_size\", \"world_size\", \"masks\": {TOKEN: [bool]},
       \"ranks\": {TOKEN: [[ranks], ...] or {\"error\": MESSAGE}}}
A token that names a dimension missing from the order is reported in the output and makes the
command exit with status 2.";

/// One token's mask and groups, or the error message.
type TokenResult = std::result::Result<(Vec<bool>, GroupList), String>;

/// `grid rank-generator`.
pub fn rank_generator(args: &[String], out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let p = RANKGEN.parse(args)?;
    if p.help {
        out.line(RANKGEN_HELP)?;
        return Ok(());
    }
    let format = format_of(&p, RANKGEN.command)?;
    let order = p.required("order")?.to_string();
    let sizes = GeneratorSizes {
        tp: p.positive("tp")?.unwrap_or(1),
        ep: p.positive("ep")?.unwrap_or(1),
        dp: p.positive("dp")?.unwrap_or(1),
        pp: p.positive("pp")?.unwrap_or(1),
        cp: p.positive("cp")?.unwrap_or(1),
        gtp_remat: 1,
    };
    let offset = p.uint("rank-offset")?.unwrap_or(0);
    let tokens = p.name_list("tokens")?.unwrap_or_else(|| {
        ["tp", "pp", "dp", "cp", "ep"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    for (i, t) in tokens.iter().enumerate() {
        if tokens[..i].contains(t) {
            return Err(usage!("grid rank-generator: --tokens lists '{t}' more than once").into());
        }
    }
    let g = RankGenerator::new(sizes, &order, offset)?;
    if g.world_size() > MAX_ENUMERATED {
        return Err(usage!(
            "grid rank-generator: a world of {} ranks is too large to enumerate (at most {MAX_ENUMERATED})",
            g.world_size()
        )
        .into());
    }
    let results: Vec<(String, TokenResult)> = tokens
        .iter()
        .map(|t| {
            let r = g
                .mask(t)
                .and_then(|m| Ok((m, g.get_ranks(t)?)))
                .map_err(|e| e.to_string());
            (t.clone(), r)
        })
        .collect();
    match format {
        Format::Json => {
            out.raw("{")?;
            out.key("normalized_order", true)?;
            out.string(g.normalized_order())?;
            out.key("ordered_size", false)?;
            out.ranks(g.ordered_sizes())?;
            out.key("world_size", false)?;
            out.num(g.world_size())?;
            out.key("masks", false)?;
            out.raw("{")?;
            let mut first = true;
            for (t, r) in &results {
                if let Ok((m, _)) = r {
                    out.key(t, first)?;
                    out.bools(m)?;
                    first = false;
                }
            }
            out.raw("}")?;
            out.key("ranks", false)?;
            out.raw("{")?;
            for (i, (t, r)) in results.iter().enumerate() {
                out.key(t, i == 0)?;
                match r {
                    Ok((_, groups)) => out.groups(groups.iter())?,
                    Err(e) => {
                        out.raw("{")?;
                        out.key("error", true)?;
                        out.string(e)?;
                        out.raw("}")?;
                    }
                }
            }
            out.raw("}}\n")?;
        }
        Format::Text => {
            out.line(&format!(
                "Order {order} -> normalized {} (fastest first), sizes {:?}, world size {}{}",
                g.normalized_order(),
                g.ordered_sizes(),
                g.world_size(),
                if offset > 0 {
                    format!(", ranks offset by {offset}")
                } else {
                    String::new()
                }
            ))?;
            for (t, r) in &results {
                match r {
                    Ok((m, groups)) => {
                        let mask: Vec<&str> =
                            m.iter().map(|&b| if b { "1" } else { "0" }).collect();
                        let n = groups.len();
                        let firsts =
                            first_groups(n, 72, |i| Ok(Group::from_list(groups.get(i).to_vec())))?;
                        out.line(&format!(
                            "  {t} (mask {}): {n} groups of {}: {firsts}",
                            mask.join(""),
                            groups.get(0).len()
                        ))?;
                    }
                    Err(e) => out.line(&format!("  {t}: error: {e}"))?,
                }
            }
        }
    }
    if let Some((t, Err(e))) = results.iter().find(|(_, r)| r.is_err()) {
        out.flush()?;
        return Err(usage!("grid rank-generator: token '{t}': {e}").into());
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// grid pipeline

const PIPELINE: Spec = Spec {
    command: "grid pipeline",
    values: &["format"],
    flags: &[],
    positionals: &["SPEC"],
};

const PIPELINE_HELP: &str = "grid pipeline: stages and bridges of a multi-module pipeline (crate multimodule)

usage: grid pipeline SPEC [--format text|json]

  SPEC                  a pipeline spec file: modules with their grids, topology, ... (TOML if the
                        name ends in .toml, JSON otherwise; see crates/multimodule/README.md)
  --format text|json    readable text (default) or JSON

JSON: {\"total_stages\", \"ranks\": {RANK: {\"modules\": {MODULE: {\"pp_rank\", \"pp_size\",
       \"stages_through\"}}, \"current_stage\", \"is_first_stage\", \"is_last_stage\"}},
       \"bridges\": [{\"src\", \"dst\", \"src_leaders\", \"dst_leaders\",
       \"routes\": {RANK: {\"role\": \"sender\"|\"receiver\"|\"sender_receiver\", \"peers\", \"recv_peers\"?}},
       \"src_broadcast_groups\", \"dst_broadcast_groups\"}]}
Every rank of every module appears under \"ranks\"; stages_through is Megatron's
compute_total_pipeline_stages(rank, module) and current_stage the largest of them minus one.
The bridges are in Megatron's creation order: leaders, routes (peers in message order) and
broadcast groups as its BridgeCommunicator plans them. Where Megatron is defective this
command differs on purpose (any cycle is an error, a module without a topology key is a sink,
a rank in both grids of a bridge is a sender_receiver, current_stage is the maximum over
colocated modules; see crates/multimodule/README.md). An invalid spec exits with status 2.";

/// `grid pipeline`.
pub fn pipeline(args: &[String], out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let p = PIPELINE.parse(args)?;
    if p.help {
        out.line(PIPELINE_HELP)?;
        return Ok(());
    }
    let format = format_of(&p, PIPELINE.command)?;
    let path = p.positional(0).ok_or_else(|| {
        usage!("grid pipeline: the spec file is required (grid pipeline SPEC [--format json])")
    })?;
    let plan = multimodule::PipelinePlan::from_spec_file(path)
        .map_err(|e| usage!("grid pipeline: {path}: {e}"))?;
    match format {
        Format::Json => out.line(&plan.to_json())?,
        Format::Text => out.raw(&plan.to_text())?,
    }
    Ok(())
}
