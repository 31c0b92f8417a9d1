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
colocated modules; see crates/multimodule/README.md). An invalid spec exits with status 2.";

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

/// `grid pipeline`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let path = a.spec.as_str();
    let plan = multimodule::PipelinePlan::from_spec_file(path)
        .map_err(|e| usage!("grid pipeline: {path}: {e}"))?;
    if let Some(svg) = &a.svg {
        let pic = crate::picture::PipelinePicture::new(&plan, path)?;
        crate::picture::write_file("pipeline", svg, &pic.to_svg())?;
        out.line(&pic.summary(svg))?;
        return Ok(());
    }
    match a.format.format {
        Format::Json => out.line(&plan.to_json())?,
        Format::Text => out.raw(&plan.to_text())?,
    }
    Ok(())
}
