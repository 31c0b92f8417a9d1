//! `grid layout`: every process group of a Megatron-Core layout, or one rank's view of it.

use crate::error::{usage, Result};
use crate::out::{first_groups, show_group, Out, Table, MAX_ENUMERATED};
use crate::values::{positive, positive_list, uint, Format, FormatArg};
use crate::Failure;
use grid_core::{Family, FamilyLevel, Group, HyperGrid, LayoutConfig, LayoutPlan, RankView};

/// The largest total number of members of one rank's groups that `--rank R --format json`
/// prints (a rank's `intra_dist_opt` group alone spans the whole world).
pub const MAX_VIEW_MEMBERS: usize = 1 << 25;

const AFTER_HELP: &str = "Data parallel size dp = W / (tp·pp·cp); expert dp = W / (etp·ep·pp).
JSON without --rank: {\"world_size\", \"dp\", \"expert_tp\", \"expert_dp\", \"families\": {NAME: [[ranks], ...]}}
JSON with --rank:    {\"world_size\", \"dp\", \"expert_tp\", \"expert_dp\", \"rank\", \"coords\", \"groups\": {NAME: [ranks] or null},
                      \"pp_next\", \"pp_prev\", \"is_first_stage\", \"is_last_stage\"}, and with --vpp N
                      \"vpp\": {\"size\", \"first_stage_chunks\", \"last_stage_chunks\", \"embedding_chunks\"}
                      (the model chunks c for which Megatron's is_pipeline_first_stage /
                      is_pipeline_last_stage / is_rank_in_embedding_group(ignore_virtual=False,
                      vp_stage=c) is true)
Families: tp pp mp embd pos_embd cp tp_cp hcp ep expt_tp tp_ep tp_ep_pp tp_dp tp_dp_cp dp dp_cp
          expt_dp intra_dp_cp intra_expt_dp inter_dist_opt intra_dist_opt
The hcp family (a list of levels) appears only with --hcp, in the text and in the JSON.
--svg FILE writes a picture instead of the listing: one block of cells per pipeline stage, one
row per dp index, one column per (cp, tp) pair, each cell a rank coloured by its group of
--color-by FAMILY (default tp; hcp[L] for a level of --hcp), with a legend and, with
--ranks-per-node N, thick lines between nodes. stdout then shows one line naming the file.
At most 65536 ranks; an unwritable FILE exits with status 2.";

/// The layout options `grid layout` and `grid init-plan` share (`--world-size` to `--vpp`).
#[derive(Debug, clap::Args)]
pub struct LayoutArgs {
    /// Number of ranks the layout covers
    #[arg(long, value_name = "W", value_parser = positive)]
    pub world_size: usize,
    /// Tensor-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub tp: Option<usize>,
    /// Pipeline-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub pp: Option<usize>,
    /// Context-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub cp: Option<usize>,
    /// Expert-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub ep: Option<usize>,
    /// Expert tensor-parallel size (default: --tp)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub etp: Option<usize>,
    /// Dimension order, fastest first (default tp-cp-ep-dp-pp)
    #[arg(long, value_name = "ORDER")]
    pub order: Option<String>,
    /// Partial distributed-optimizer instances (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub dist_opt_instances: Option<usize>,
    /// Hierarchical context-parallel sizes (product = cp)
    #[arg(long, value_name = "A,B,...", value_parser = positive_list)]
    pub hcp: Option<std::vec::Vec<usize>>,
    /// First rank of the layout (default 0)
    #[arg(long, value_name = "O", value_parser = uint)]
    pub rank_offset: Option<usize>,
    /// Virtual pipeline size (needs pp > 1; with --rank, the rank's virtual stages)
    #[arg(long, value_name = "N", value_parser = positive)]
    pub vpp: Option<usize>,
}

impl LayoutArgs {
    /// The layout these options describe (defaults: every size 1, `etp` = `tp`, Megatron's
    /// order, one optimizer instance, offset 0).
    pub fn config(&self) -> LayoutConfig {
        let mut cfg = LayoutConfig::new(self.world_size);
        cfg.tp = self.tp.unwrap_or(1);
        cfg.pp = self.pp.unwrap_or(1);
        cfg.cp = self.cp.unwrap_or(1);
        cfg.ep = self.ep.unwrap_or(1);
        cfg.etp = self.etp;
        if let Some(o) = &self.order {
            cfg.order = o.clone();
        }
        cfg.dist_opt_instances = self.dist_opt_instances.unwrap_or(1);
        cfg.hcp_sizes = self.hcp.clone();
        cfg.rank_offset = self.rank_offset.unwrap_or(0);
        cfg.vpp = self.vpp;
        cfg
    }
}

/// Options of `grid layout`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    #[command(flatten)]
    layout: LayoutArgs,
    /// Expected data-parallel size: an error unless W / (tp·pp·cp) = N
    #[arg(long, value_name = "N", value_parser = positive)]
    dp: Option<usize>,
    /// Only rank R's view: its group in every family
    #[arg(long, value_name = "R", value_parser = uint)]
    rank: Option<usize>,
    #[command(flatten)]
    format: FormatArg,
    /// Write a picture of the layout (SVG) to FILE instead of listing the groups
    #[arg(long, value_name = "FILE", value_hint = clap::ValueHint::FilePath, conflicts_with_all = ["rank", "format"])]
    svg: Option<String>,
    /// With --svg: the family whose groups colour the cells (default tp)
    #[arg(long, value_name = "FAMILY", requires = "svg")]
    color_by: Option<String>,
    /// With --svg: ranks per node, to draw node boundaries
    #[arg(long, value_name = "N", value_parser = positive, requires = "svg")]
    ranks_per_node: Option<usize>,
}

/// The family level named by `--color-by`: a family name, or `hcp[L]` for a level of `--hcp`.
fn color_family(plan: &LayoutPlan, name: &str) -> Result<FamilyLevel> {
    let valid = || {
        let mut v: Vec<String> = Family::ALL
            .iter()
            .filter(|f| plan.has(**f))
            .filter(|f| **f != Family::Hcp)
            .map(|f| f.name().to_string())
            .collect();
        v.extend(hcp_levels(plan).iter().map(|l| l.to_string()));
        v.join(", ")
    };
    let fl = if let Some(level) = name.strip_prefix("hcp[").and_then(|r| r.strip_suffix(']')) {
        let level: usize = level.parse().map_err(|_| {
            usage!(
                "grid layout: unknown --color-by family '{name}': valid families are {}",
                valid()
            )
        })?;
        FamilyLevel {
            family: Family::Hcp,
            level,
        }
    } else {
        let family = Family::from_name(name).map_err(|_| {
            usage!(
                "grid layout: unknown --color-by family '{name}': valid families are {}",
                valid()
            )
        })?;
        if family == Family::Hcp {
            FamilyLevel { family, level: 0 }
        } else {
            family.into()
        }
    };
    let present = if fl.family == Family::Hcp {
        hcp_levels(plan).contains(&fl)
    } else {
        plan.has(fl.family)
    };
    if !present {
        return Err(usage!(
            "grid layout: --color-by {name}: this layout has no {name} groups; valid families are {}",
            valid()
        ));
    }
    Ok(fl)
}

/// `grid layout --svg FILE`.
fn picture(
    a: &Args,
    plan: &LayoutPlan,
    path: &str,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    let family = color_family(plan, a.color_by.as_deref().unwrap_or("tp"))?;
    let pic = crate::picture::LayoutPicture::new(plan, family, a.ranks_per_node)?;
    crate::picture::write_file("layout", path, &pic.to_svg())?;
    out.line(&pic.summary(path, family))?;
    Ok(())
}

fn layout_plan(a: &Args) -> Result<LayoutPlan> {
    let world = a.layout.world_size;
    let cfg = a.layout.config();
    let (tp, pp, cp) = (cfg.tp, cfg.pp, cfg.cp);
    let plan = LayoutPlan::new(cfg)?;
    if let Some(dp) = a.dp {
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
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let plan = layout_plan(a)?;
    if let Some(path) = &a.svg {
        return picture(a, &plan, path, out);
    }
    match a.rank {
        Some(rank) => {
            let view = plan.rank_view(rank)?;
            match a.format.format {
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
        None => match a.format.format {
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
    for (i, f) in Family::ALL.into_iter().enumerate() {
        if f == Family::Hcp {
            // Only with --hcp: no `hcp` key at all otherwise, as in the full layout.
            if let Some(levels) = v.hcp() {
                out.key(f.name(), i == 0)?;
                out.raw("[")?;
                for (j, g) in levels.iter().enumerate() {
                    if j > 0 {
                        out.raw(",")?;
                    }
                    out.group(g)?;
                }
                out.raw("]")?;
            }
        } else {
            out.key(f.name(), i == 0)?;
            match v.group(f) {
                Some(g) => out.group(g)?,
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
    if let Some(size) = v.virtual_pipeline_size() {
        // Only with --vpp, as `hcp` only with --hcp.
        out.key("vpp", false)?;
        out.raw("{")?;
        out.key("size", true)?;
        out.num(size)?;
        for (k, chunks) in [
            ("first_stage_chunks", v.first_stage_chunks()),
            ("last_stage_chunks", v.last_stage_chunks()),
            ("embedding_chunks", v.embedding_chunks()),
        ] {
            out.key(k, false)?;
            out.ranks(&chunks)?;
        }
        out.raw("}")?;
    }
    out.raw("}\n")?;
    Ok(())
}

/// The rank's group rank (its index in the sorted member list), `-` outside the group. Constant
/// time for every group a plan produces (unsorted ones are full lattices).
fn group_rank_text(g: &Group, rank: usize) -> String {
    g.group_rank(rank).map_or("-".into(), |r| r.to_string())
}

/// `[0, 1]`, or `none`.
fn show_chunks(chunks: &[usize]) -> String {
    if chunks.is_empty() {
        "none".into()
    } else {
        format!("{chunks:?}")
    }
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
    if let Some(size) = v.virtual_pipeline_size() {
        out.line(&format!(
            "  virtual pipeline: {size} model chunks per stage; virtual first stage in chunks {}, \
             virtual last stage in chunks {}, embedding in chunks {}",
            show_chunks(&v.first_stage_chunks()),
            show_chunks(&v.last_stage_chunks()),
            show_chunks(&v.embedding_chunks())
        ))?;
    }
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
