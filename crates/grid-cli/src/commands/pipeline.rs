//! `grid pipeline`: stages and bridges of a multi-module pipeline (crate multimodule).

use crate::error::usage;
use crate::out::Out;
use crate::values::{Format, FormatArg};
use crate::Failure;

const AFTER_HELP: &str = "The spec format is described in crates/multimodule/README.md.
JSON: {\"total_stages\", \"ranks\": {RANK: {\"modules\": {MODULE: {\"pp_rank\", \"pp_size\",
       \"stages_through\"}}, \"current_stage\", \"is_first_stage\", \"is_last_stage\"}},
       \"bridges\": [{\"src\", \"dst\", \"src_leaders\", \"dst_leaders\",
       \"routes\": {RANK: {\"role\": \"sender\"|\"receiver\"|\"sender_receiver\", \"peers\", \"recv_peers\"?}},
       \"src_broadcast_groups\", \"dst_broadcast_groups\"}], \"spec\"}
\"spec\" is the canonical spec the plan was made from, so the JSON reads back as the same plan
(multimodule's PipelinePlan::from_json_str). Every rank of every module appears under
\"ranks\"; stages_through is Megatron's compute_total_pipeline_stages(rank, module) and
current_stage the largest of them minus one.
The bridges are in Megatron's creation order: leaders, routes (peers in message order) and
broadcast groups as its BridgeCommunicator plans them. Where Megatron is defective this
command differs on purpose (any cycle is an error, a module without a topology key is a sink,
a rank in both grids of a bridge is a sender_receiver, current_stage is the maximum over
colocated modules; see crates/multimodule/README.md). An invalid spec exits with status 2, and
so does a spec file over 64 MiB or a plan of more than 4194304 rank entries (every rank of every
module and of both ends of every bridge), too large to print.";

/// Options of `grid pipeline`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// The pipeline spec file: TOML if the name ends in .toml, JSON otherwise
    #[arg(value_name = "SPEC", value_hint = clap::ValueHint::FilePath)]
    spec: String,
    #[command(flatten)]
    format: FormatArg,
    /// Write a picture of the pipeline (SVG) to FILE instead of printing the plan
    #[arg(long, value_name = "FILE", value_hint = clap::ValueHint::FilePath, conflicts_with = "format")]
    svg: Option<String>,
}

/// The largest plan `grid pipeline` makes and prints, in rank entries
/// ([`multimodule::PipelineSpec::plan_size`]: every rank of every module, plus every rank of both
/// ends of every bridge). A 1,048,576-rank fan-in is about 2.1 M; at the cap (a 2,097,151-rank
/// fan-in) the text is 162 MB, the JSON 900 MB and the process holds 1.6 GB.
pub const MAX_PLAN_SIZE: usize = 1 << 22;

/// `grid pipeline`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let path = a.spec.as_str();
    let spec = multimodule::PipelineSpec::from_file(path)
        .map_err(|e| usage!("grid pipeline: {path}: {e}"))?;
    // Refused before planning: a plan is made in memory and printed whole.
    let size = spec.plan_size();
    if size > MAX_PLAN_SIZE {
        return Err(usage!(
            "grid pipeline: {path}: the plan of this spec has {size} rank entries (every rank of every module and of both ends of every bridge), too large to print (at most {MAX_PLAN_SIZE})"
        )
        .into());
    }
    let plan =
        multimodule::PipelinePlan::new(&spec).map_err(|e| usage!("grid pipeline: {path}: {e}"))?;
    if let Some(svg) = &a.svg {
        let pic = crate::picture::PipelinePicture::new(&plan, path)?;
        crate::picture::write_file("pipeline", svg, &pic.to_svg())?;
        out.line(&pic.summary(svg))?;
        return Ok(());
    }
    match a.format.format {
        Format::Json => {
            plan.write_json(&mut *out)?;
            out.raw("\n")?;
        }
        Format::Text => plan.write_text(&mut *out)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The help text states the caps the command applies.
    #[test]
    fn help_names_the_caps() {
        assert!(AFTER_HELP.contains(&format!("a plan of more than {MAX_PLAN_SIZE} rank entries")));
        assert!(AFTER_HELP.contains(&format!("over {} MiB", multimodule::MAX_SPEC_BYTES >> 20)));
    }
}
