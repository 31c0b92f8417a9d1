//! `grid hierarchical`: hierarchical sub-groups of one group (Megatron's
//! create_hierarchical_groups).

use crate::error::usage;
use crate::out::{show_list, Out};
use crate::values::{positive_list, uint, uint_list, Format, FormatArg};
use crate::Failure;
use grid_core::{hierarchical_groups, hierarchical_groups_of};

const AFTER_HELP: &str =
    "Level k groups the members whose positions differ only in the k-th factor (factor 0 fastest).
JSON: {\"levels\": [[[ranks], ...], ...]} (plus \"rank_groups\": [[ranks], ...] with --rank).";

/// Options of `grid hierarchical`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// The parent group's members, in order
    #[arg(long, value_name = "R1,R2,...", value_parser = uint_list)]
    ranks: std::vec::Vec<usize>,
    /// The level sizes; their product must equal the number of ranks
    #[arg(long, value_name = "A,B,...", value_parser = positive_list)]
    sizes: std::vec::Vec<usize>,
    /// Also print rank R's group at every level
    #[arg(long, value_name = "R", value_parser = uint)]
    rank: Option<usize>,
    #[command(flatten)]
    format: FormatArg,
}

/// `grid hierarchical`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let (ranks, sizes) = (&a.ranks, &a.sizes);
    for (i, r) in ranks.iter().enumerate() {
        if ranks[..i].contains(r) {
            return Err(usage!(
                "grid hierarchical: --ranks lists rank {r} more than once: a group's members are distinct"
            )
            .into());
        }
    }
    let levels = hierarchical_groups(ranks, sizes)?;
    let rank = a.rank;
    let mine = rank
        .map(|r| hierarchical_groups_of(ranks, sizes, r))
        .transpose()?;
    match a.format.format {
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
                show_list(ranks)
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
