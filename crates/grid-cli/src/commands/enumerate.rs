//! `grid enum`: the groups of an N-dimensional grid (Megatron's HyperCommGrid).

use crate::error::usage;
use crate::out::{show_list, Out, MAX_ENUMERATED};
use crate::values::{name_list, positive, positive_list, uint, Format, FormatArg};
use crate::Failure;
use grid_core::{GroupList, HyperGrid};

const AFTER_HELP: &str =
    "Without --raw the groups are the canonical enumeration of create_pg / get_rank_enum: every
group ascending, sorted by first member.
JSON: {\"key\": \"...\", \"groups\": [[...], ...]} (plus \"my_group\" with --rank). The key is the
group's dims sorted slowest first and joined with '-' (a single dim is its own key).";

/// Options of `grid enum`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Size of each dimension, the first varying fastest
    #[arg(long, value_name = "S1,S2,...", value_parser = positive_list)]
    shape: std::vec::Vec<usize>,
    /// One name per dimension
    #[arg(long, value_name = "D1,D2,...", value_parser = name_list)]
    dims: std::vec::Vec<String>,
    /// The dimensions that span a group
    #[arg(long, value_name = "Dx,Dy,...", value_parser = name_list)]
    group: std::vec::Vec<String>,
    /// First rank of the grid (default 0)
    #[arg(long, value_name = "O", value_parser = uint)]
    rank_offset: Option<usize>,
    /// Also check that the grid fits a world of W ranks
    #[arg(long, value_name = "W", value_parser = positive)]
    world_size: Option<usize>,
    /// Also print rank R's group (null outside the grid)
    #[arg(long, value_name = "R", value_parser = uint)]
    rank: Option<usize>,
    #[command(flatten)]
    format: FormatArg,
    /// Megatron's raw _gen_rank_enum: the dims taken literally, the last varying fastest
    #[arg(long)]
    raw: bool,
}

/// `grid enum`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let (shape, dims, group) = (a.shape.clone(), &a.dims, &a.group);
    let offset = a.rank_offset.unwrap_or(0);
    let world = a.world_size;
    let grid = match world {
        Some(w) => HyperGrid::in_world(shape, dims, offset, w)?,
        None => HyperGrid::new(shape, dims, offset)?,
    };
    let rank = a.rank;
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
        grid.key(group)?
    };
    if grid.size() > MAX_ENUMERATED {
        return Err(usage!(
            "grid enum: a grid of {} ranks is too large to enumerate (at most {MAX_ENUMERATED})",
            grid.size()
        )
        .into());
    }
    let raw = a.raw;
    let groups = if raw {
        grid.raw_groups(group)?
    } else {
        grid.groups(group)?
    };
    let mine: Option<Option<&[usize]>> = rank.map(|r| groups.iter().find(|g| g.contains(&r)));
    match a.format.format {
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
        Format::Text => enum_text(&grid, group, &key, raw, &groups, rank, mine, out)?,
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
