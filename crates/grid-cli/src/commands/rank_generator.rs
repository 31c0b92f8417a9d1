//! `grid rank-generator`: Megatron's RankGenerator (order strings and masked orthogonal groups).

use crate::error::usage;
use crate::out::{first_groups, Out, MAX_ENUMERATED};
use crate::values::{name_list, positive, uint, Format, FormatArg};
use crate::Failure;
use grid_core::{GeneratorSizes, Group, GroupList, RankGenerator};

const AFTER_HELP: &str =
    "JSON: {\"normalized_order\", \"ordered_size\", \"world_size\", \"masks\": {TOKEN: [bool]},
       \"ranks\": {TOKEN: [[ranks], ...] or {\"error\": MESSAGE}}}
A token that names a dimension missing from the order is reported in the output and makes the
command exit with status 2.";

/// Options of `grid rank-generator`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Order string, fastest first, e.g. tp-cp-ep-dp-pp
    #[arg(long, value_name = "ORDER")]
    order: String,
    /// Tensor-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    tp: Option<usize>,
    /// Expert-parallel size (default 1; ep and cp cannot both exceed 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    ep: Option<usize>,
    /// Data-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    dp: Option<usize>,
    /// Pipeline-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    pp: Option<usize>,
    /// Context-parallel size (default 1)
    #[arg(long, value_name = "N", value_parser = positive)]
    cp: Option<usize>,
    /// Added to every rank (default 0)
    #[arg(long, value_name = "O", value_parser = uint)]
    rank_offset: Option<usize>,
    /// The groupings to enumerate, each a '-'-joined set of tokens (default tp,pp,dp,cp,ep)
    #[arg(long, value_name = "T1,T2,...", value_parser = name_list)]
    tokens: Option<std::vec::Vec<String>>,
    #[command(flatten)]
    format: FormatArg,
}

/// One token's mask and groups, or the error message.
type TokenResult = std::result::Result<(Vec<bool>, GroupList), String>;

/// `grid rank-generator`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let order = a.order.clone();
    let sizes = GeneratorSizes {
        tp: a.tp.unwrap_or(1),
        ep: a.ep.unwrap_or(1),
        dp: a.dp.unwrap_or(1),
        pp: a.pp.unwrap_or(1),
        cp: a.cp.unwrap_or(1),
        gtp_remat: 1,
    };
    let offset = a.rank_offset.unwrap_or(0);
    let tokens = a.tokens.clone().unwrap_or_else(|| {
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
    match a.format.format {
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
