//! Every process group of a parallel layout, and one rank's view of it, with `grid-core` alone
//! (pure arithmetic: no backend, no communication).
//!
//! Run: `cargo run -p grid-core --example layout_and_rank_view -- --rank 5`
//!
//! The layout is a 16-rank job with tensor parallel 2, context parallel 2 and pipeline parallel
//! 2, so data parallel is 16 / (2·2·2) = 2; experts are spread 2 ways. The program prints each
//! family's groups in Megatron-Core's creation order, then the view of the rank given with
//! `--rank R` (default 5), and checks two things a framework relies on: every family (except
//! the embedding ones, which cover only some ranks) splits the world into disjoint groups that
//! cover every rank once, and the per-rank view (computed without enumerating the world) agrees
//! with the enumerated groups.

use grid_core::{Family, LayoutConfig, LayoutPlan};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layout_and_rank_view: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The rank named by `--rank R` (5 when absent).
fn rank_argument() -> Result<usize, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(5),
        [flag, value] if flag == "--rank" => value
            .parse()
            .map_err(|_| format!("--rank {value:?}: expected a rank number (0..=15)")),
        _ => Err(format!(
            "unexpected arguments {args:?}: usage: layout_and_rank_view [--rank R]"
        )),
    }
}

fn run() -> Result<(), String> {
    let rank = rank_argument()?;

    // 1. Describe the layout. Sizes left out stay 1; the order string (fastest dimension first)
    //    is Megatron's default `tp-cp-ep-dp-pp`.
    let mut config = LayoutConfig::new(16);
    config.tp = 2;
    config.cp = 2;
    config.pp = 2;
    config.ep = 2;

    // 2. Validate it once. Every error names the value and what would be valid, e.g. a world
    //    size that tp·cp·pp does not divide.
    let plan = LayoutPlan::new(config).map_err(|e| e.to_string())?;

    // 3. One rank's view: its coordinates, pipeline neighbours and its group in every family,
    //    computed arithmetically (cost independent of the world size). A rank outside the
    //    layout is an error that says which ranks exist.
    let view = plan.rank_view(rank).map_err(|e| e.to_string())?;

    println!(
        "layout: {} ranks, tp {} cp {} pp {} -> dp {}; ep {} (expert tp {}, expert dp {})",
        plan.world_size(),
        plan.config().tp,
        plan.config().cp,
        plan.config().pp,
        plan.dp(),
        plan.config().ep,
        plan.expert_tp(),
        plan.expert_dp()
    );

    // 4. Every family's groups, in the order Megatron creates them. A group lists its members
    //    in Megatron's member order.
    let mut checked = 0;
    for fl in plan.family_levels() {
        let groups = plan.groups(fl).map_err(|e| e.to_string())?;
        let shown: Vec<String> = groups.iter().take(4).map(|g| format!("{g:?}")).collect();
        println!(
            "  {:<16} {:>2} groups: {}{}",
            fl.to_string(),
            groups.len(),
            shown.join(" "),
            if groups.len() > 4 { " ..." } else { "" }
        );

        // Check: the groups of a family are disjoint and cover every rank exactly once (the
        // embedding families hold only the first and last pipeline stages).
        if matches!(fl.family, Family::Embd | Family::PosEmbd) {
            continue;
        }
        let mut seen = vec![0usize; plan.world_size()];
        for g in groups.iter() {
            for &r in g {
                seen[r] += 1;
            }
        }
        if let Some(r) = seen.iter().position(|&n| n != 1) {
            return Err(format!(
                "{fl}: rank {r} is in {} groups, expected 1",
                seen[r]
            ));
        }
        checked += 1;
    }
    println!("checked: {checked} families each cover the 16 ranks exactly once");

    // 5. Print the view, checking it against the enumerated groups.
    let c = &view.coords;
    println!(
        "rank {rank}: tp {} cp {} dp {} pp {} (ep {}); pipeline next {}, previous {}{}{}",
        c.tp,
        c.cp,
        c.dp,
        c.pp,
        c.ep,
        view.pp_next,
        view.pp_prev,
        if view.is_first_stage {
            ", first stage"
        } else {
            ""
        },
        if view.is_last_stage {
            ", last stage"
        } else {
            ""
        }
    );
    for fl in plan.family_levels() {
        let from_view = view.group_at_level(fl);
        // Check: the view agrees with the plan's group of this rank.
        let from_plan = plan.group_of(fl, rank).map_err(|e| e.to_string())?;
        if from_view.map(|g| g.to_vec()) != from_plan.as_ref().map(|g| g.to_vec()) {
            return Err(format!(
                "{fl}: the view of rank {rank} says {from_view:?}, the plan says {from_plan:?}"
            ));
        }
        match from_view {
            Some(g) => println!("  {:<16} {g}", fl.to_string()),
            None => println!("  {:<16} (not a member)", fl.to_string()),
        }
    }
    println!(
        "checked: rank {rank}'s view matches the enumerated groups in all {} families",
        plan.family_levels().len()
    );
    Ok(())
}
