//! `grid init-plan`: before launching a job, what building every rank's process groups will
//! cost: the communicators each rank creates (and which families share each), the ordered
//! collective calls that create them, and an estimate of their memory; `--verify` checks on a
//! simulated world that the calls match across ranks (library: [`grid_core::InitPlan`],
//! [`grid_core::verify_plan`]).

use super::layout::LayoutArgs;
use crate::error::{usage, Result};
use crate::out::Out;
use crate::values::{uint, Format, FormatArg};
use crate::Failure;
use grid_core::{
    verify_plan, CallOp, Creation, InitPlan, InitSummary, LayoutPlan, RankInitPlan, Spread,
    VerifyReport,
};
use serde_json::{json, Value};

const AFTER_HELP: &str = "\
Creation: split (default) is what build_collection does: one all-gather of the plan fingerprint
over the world (the plan check), then one split of the world per distinct family (families whose
groups are identical share one communicator), every rank taking part, colour = the index of its
group, key = its world rank. members-only is NOT implemented by build_collection: it describes a
creation where only a group's members create it (MPI_Comm_create_group, ncclCommInitRank with an
id per group): the same plan check, then one creation per group the rank is in, among its members.
Memory (an estimate per communicator; --comm-memory BYTES overrides --backend):
  nccl  688 MiB of GPU memory: measured for a group of more than 2 GPUs (544 MB for 2) on 4 A100s
        with NVLink after a 4 MB all-reduce (NVIDIA/nccl issue 964); issue 864 reports about
        1.6 GB for one communicator. It grows with the channels NCCL uses (buffers of
        NCCL_BUFFSIZE, 4 MiB by default in NCCL's src/init.cc, per channel and connection)
        and the algorithms; splits that share resources cost less (NVIDIA/nccl issue 986).
  gloo, mpi  0 bytes of GPU memory: their communicators live in host memory (socket pairs,
        MPI contexts); pass --comm-memory to estimate that.
BYTES: an integer with an optional unit: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB.
--verify checks every rank of the world (see docs/grid-command.md): matching call sequences,
colours that partition the world as the groups say, shared communicators serving equal groups.
JSON without --rank: {\"world_size\", \"rank_offset\", \"creation\", \"family_levels\", \"shared\": [{\"families\",
  \"groups\", \"members\", \"group_size\"}], \"communicators\": {\"min\", \"min_rank\", \"max\", \"max_rank\", \"total\"},
  \"calls\": {...}, \"world_communicators\", \"memory\", \"verify\"}
JSON with --rank:    {\"rank\", \"creation\", \"parent_size\", \"calls\": [{\"index\", \"op\", \"families\", \"colour\",
  \"key\", \"participants\", \"communicator\": {\"size\", \"group_rank\"} or null}], \"communicators\",
  \"families_served\", \"collective_calls\", \"memory\"}";

/// `--creation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CreationArg {
    /// One split of the world per distinct family (build_collection's default)
    Split,
    /// Only each group's members create it (CollectionOptions::creation = MembersOnly)
    MembersOnly,
}

/// `--backend`: where the default memory per communicator comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// NCCL: 688 MiB of GPU memory per communicator (an estimate, see below)
    Nccl,
    /// Gloo: no GPU memory
    Gloo,
    /// MPI: no GPU memory
    Mpi,
}

/// Options of `grid init-plan`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    #[command(flatten)]
    layout: LayoutArgs,
    /// How communicators are created: split (default) or members-only
    #[arg(long, value_enum, value_name = "CREATION", hide_possible_values = true)]
    creation: Option<CreationArg>,
    /// Only rank R's plan: its calls in order
    #[arg(long, value_name = "R", value_parser = uint, conflicts_with = "verify")]
    rank: Option<usize>,
    /// Check the plan of every rank of the world (matching calls, exact partitions)
    #[arg(long)]
    verify: bool,
    /// Default memory per communicator: nccl, gloo or mpi
    #[arg(long, value_enum, value_name = "BACKEND", hide_possible_values = true)]
    backend: Option<BackendArg>,
    /// Memory per communicator (overrides --backend's figure)
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    comm_memory: Option<u64>,
    #[command(flatten)]
    format: FormatArg,
}

/// `688MiB`, `1.6` is not accepted: an integer with an optional unit.
fn bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    const UNITS: &str = "B, KiB, MiB, GiB, TiB, KB, MB, GB or TB";
    if digits.is_empty() {
        return Err(format!(
            "expected a number of bytes: an integer with an optional unit ({UNITS})"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{digits} is too large (at most {} bytes)", u64::MAX))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => return Err(format!("unknown unit '{other}': valid units are {UNITS}")),
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{t} is more than {} bytes", u64::MAX))
}

/// NCCL's figure per communicator (see `AFTER_HELP` for the sources): an estimate.
pub const NCCL_COMM_BYTES: u64 = 688 << 20;

/// The memory per communicator and where the figure comes from.
struct MemoryPer {
    bytes: u64,
    source: String,
}

fn memory_per(a: &Args) -> Option<MemoryPer> {
    match (a.comm_memory, a.backend) {
        (Some(bytes), _) => Some(MemoryPer {
            bytes,
            source: "--comm-memory".to_string(),
        }),
        (None, Some(BackendArg::Nccl)) => Some(MemoryPer {
            bytes: NCCL_COMM_BYTES,
            source: "nccl estimate, 688 MiB of GPU memory per communicator: NVIDIA/nccl issues 964 and 864".to_string(),
        }),
        (None, Some(BackendArg::Gloo)) => Some(MemoryPer {
            bytes: 0,
            source: "gloo: no GPU memory; host memory is not estimated, give --comm-memory".to_string(),
        }),
        (None, Some(BackendArg::Mpi)) => Some(MemoryPer {
            bytes: 0,
            source: "mpi: no GPU memory; host memory is not estimated, give --comm-memory".to_string(),
        }),
        (None, None) => None,
    }
}

/// `1.23 GiB (1320702443 bytes)`-style binary units, two decimals.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

fn times(per: u64, n: u64, what: &str) -> Result<u64> {
    per.checked_mul(n).ok_or_else(|| {
        usage!(
            "grid init-plan: the memory estimate of {what} ({n} communicators of {per} bytes) is more than {} bytes",
            u64::MAX
        )
    })
}

fn layout_plan(a: &Args) -> Result<LayoutPlan> {
    Ok(LayoutPlan::new(a.layout.config())?)
}

/// `tp 2, pp 2, cp 2, ep 4, etp 1, dp 16384, expert dp 16384, 2 distributed-optimizer instances`.
fn layout_words(plan: &LayoutPlan) -> String {
    let c = plan.config();
    let mut v = vec![
        format!("tp {}", c.tp),
        format!("pp {}", c.pp),
        format!("cp {}", c.cp),
        format!("ep {}", c.ep),
        format!("etp {}", plan.expert_tp()),
        format!("dp {}", plan.dp()),
        format!("expert dp {}", plan.expert_dp()),
    ];
    if c.dist_opt_instances > 1 {
        v.push(format!(
            "{} distributed-optimizer instances",
            c.dist_opt_instances
        ));
    }
    if let Some(h) = &c.hcp_sizes {
        v.push(format!("hierarchical cp {h:?}"));
    }
    if let Some(vpp) = c.vpp {
        v.push(format!("virtual pipeline {vpp}"));
    }
    if c.order != grid_core::DEFAULT_ORDER {
        v.push(format!("order {}", c.order));
    }
    v.join(", ")
}

fn ranks_words(plan: &LayoutPlan) -> String {
    let first = plan.rank_offset();
    if first == 0 {
        format!("{} ranks", plan.world_size())
    } else {
        format!(
            "{} ranks ({first}..={})",
            plan.world_size(),
            first + plan.world_size() - 1
        )
    }
}

/// A library value as JSON (an error here is an output error, not the user's).
macro_rules! to_value {
    ($v:expr) => {
        serde_json::to_value($v).map_err(|e| Failure::Io(std::io::Error::other(e)))
    };
}

fn write_json(v: &Value, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let text = serde_json::to_string(v).map_err(|e| Failure::Io(std::io::Error::other(e)))?;
    out.line(&text)?;
    Ok(())
}

/// `grid init-plan`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let plan = layout_plan(a)?;
    let creation = match a.creation.unwrap_or(CreationArg::Split) {
        CreationArg::Split => Creation::Split,
        CreationArg::MembersOnly => Creation::MembersOnly,
    };
    let init = InitPlan::new(&plan, creation)?;
    let memory = memory_per(a);
    if let Some(rank) = a.rank {
        let first = plan.rank_offset();
        let end = first + plan.world_size();
        if !plan.contains(rank) {
            return Err(usage!(
                "grid init-plan: --rank {rank} is not a rank of the layout (valid: {first}..={})",
                end - 1
            )
            .into());
        }
        let p = init.rank(rank)?;
        return match a.format.format {
            Format::Json => rank_json(&p, memory.as_ref(), out),
            Format::Text => rank_text(&plan, &p, memory.as_ref(), out),
        };
    }
    let summary = init.summary()?;
    let verified = if a.verify {
        Some(verify_plan(&plan, creation)?)
    } else {
        None
    };
    match a.format.format {
        Format::Json => summary_json(&summary, memory.as_ref(), verified.as_ref(), out),
        Format::Text => summary_text(&plan, &summary, memory.as_ref(), verified.as_ref(), out),
    }
}

fn rank_json(
    p: &RankInitPlan,
    memory: Option<&MemoryPer>,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    let mut v = to_value!(p)?;
    let m = match memory {
        Some(m) => json!({
            "bytes_per_communicator": m.bytes,
            "source": m.source,
            "bytes": times(m.bytes, p.communicators as u64, "this rank")?,
        }),
        None => Value::Null,
    };
    if let Value::Object(o) = &mut v {
        o.insert("memory".into(), m);
    }
    write_json(&v, out)
}

fn rank_text(
    plan: &LayoutPlan,
    p: &RankInitPlan,
    memory: Option<&MemoryPer>,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    out.line(&format!(
        "Init plan of rank {} in {} ({}), {} creation",
        p.rank,
        ranks_words(plan),
        layout_words(plan),
        p.creation
    ))?;
    let dash = || "-".to_string();
    let comms: Vec<String> = p
        .calls
        .iter()
        .map(|c| match c.communicator {
            Some(m) if m.size == 1 => "1 rank, rank 0".to_string(),
            Some(m) => format!("{} ranks, rank {}", m.size, m.group_rank),
            None => dash(),
        })
        .collect();
    let width = comms.iter().map(String::len).max().unwrap_or(0).max(18);
    out.line(&format!(
        "  {:>4}  {:<10}  {:>8}  {:>8}  {:>12}  {:<width$}  families",
        "call", "op", "colour", "key", "participants", "communicator"
    ))?;
    for (c, comm) in p.calls.iter().zip(comms) {
        let families = if c.op == CallOp::PlanCheck {
            "(all-gather of the plan fingerprint)".to_string()
        } else {
            c.families
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let colour = match (c.op, c.colour) {
            (CallOp::Split, None) => "none".to_string(),
            (_, Some(x)) => x.to_string(),
            (_, None) => dash(),
        };
        out.line(&format!(
            "  {:>4}  {:<10}  {:>8}  {:>8}  {:>12}  {:<width$}  {}",
            c.index,
            c.op.name(),
            colour,
            c.key.map_or_else(dash, |k| k.to_string()),
            c.participants,
            comm,
            families
        ))?;
    }
    out.line(&format!(
        "Rank {}: {} communicators serving {} of {} family levels, {} collective calls",
        p.rank,
        p.communicators,
        p.families_served,
        plan.family_levels().len(),
        p.collective_calls
    ))?;
    if let Some(m) = memory {
        let total = times(m.bytes, p.communicators as u64, "this rank")?;
        out.line(&format!(
            "Memory: {} communicators × {} = {} ({})",
            p.communicators,
            human(m.bytes),
            human(total),
            m.source
        ))?;
    }
    Ok(())
}

fn spread_json(s: &Spread) -> Value {
    json!({"min": s.min, "min_rank": s.min_rank, "max": s.max, "max_rank": s.max_rank, "total": s.total})
}

fn summary_json(
    s: &InitSummary,
    memory: Option<&MemoryPer>,
    verified: Option<&VerifyReport>,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    let mut v = to_value!(s)?;
    let m = match memory {
        Some(m) => {
            let c = &s.communicators;
            json!({
                "bytes_per_communicator": m.bytes,
                "source": m.source,
                "per_rank": {
                    "min": times(m.bytes, c.min as u64, "one rank")?,
                    "min_rank": c.min_rank,
                    "max": times(m.bytes, c.max as u64, "one rank")?,
                    "max_rank": c.max_rank,
                    "total": times(m.bytes, c.total, "the world")?,
                },
            })
        }
        None => Value::Null,
    };
    if let Value::Object(o) = &mut v {
        o.insert("communicators".into(), spread_json(&s.communicators));
        o.insert("calls".into(), spread_json(&s.calls));
        o.insert("memory".into(), m);
        o.insert(
            "verify".into(),
            match verified {
                Some(r) => to_value!(r)?,
                None => Value::Null,
            },
        );
    }
    write_json(&v, out)
}

fn spread_text(s: &Spread, unit: impl Fn(u64) -> String) -> String {
    if s.min == s.max {
        format!("{} on every rank", unit(s.min as u64))
    } else {
        format!(
            "{} (rank {}) to {} (rank {})",
            unit(s.min as u64),
            s.min_rank,
            unit(s.max as u64),
            s.max_rank
        )
    }
}

fn summary_text(
    plan: &LayoutPlan,
    s: &InitSummary,
    memory: Option<&MemoryPer>,
    verified: Option<&VerifyReport>,
    out: &mut Out<'_>,
) -> std::result::Result<(), Failure> {
    out.line(&format!(
        "Init plan of {} ({}), {} creation",
        ranks_words(plan),
        layout_words(plan),
        s.creation
    ))?;
    let how = match s.creation {
        Creation::Split => format!(
            "one split of the {}-rank world each, in this order",
            s.world_size
        ),
        Creation::MembersOnly => {
            "one creation among each group's members, in this order".to_string()
        }
    };
    out.line(&format!(
        "{} communicator kinds for {} family levels ({how}):",
        s.shared.len(),
        s.family_levels
    ))?;
    let names: Vec<String> = s
        .shared
        .iter()
        .map(|sh| {
            sh.families
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .collect();
    let width = names.iter().map(String::len).max().unwrap_or(0);
    for (i, (sh, names)) in s.shared.iter().zip(&names).enumerate() {
        let groups = match sh.groups {
            1 => "1 group".to_string(),
            n => format!("{n} groups"),
        };
        let size = match sh.group_size {
            Some(g) => format!("{groups} of {g}"),
            None => groups,
        };
        let who = if sh.members == s.world_size {
            String::new()
        } else {
            format!(", {} of {} ranks in one", sh.members, s.world_size)
        };
        out.line(&format!("  {:>3}  {names:<width$}  {size}{who}", i + 1))?;
    }
    let n = |v: u64| v.to_string();
    out.line(&format!(
        "Communicators per rank: {}; {} in the world",
        spread_text(&s.communicators, n),
        s.world_communicators
    ))?;
    let calls_how = match s.creation {
        Creation::Split => format!(" (1 plan check + {} splits)", s.shared.len()),
        Creation::MembersOnly => " (1 plan check + 1 creation per communicator)".to_string(),
    };
    out.line(&format!(
        "Collective calls per rank: {}{calls_how}; {} in all",
        spread_text(&s.calls, n),
        s.calls.total
    ))?;
    if let Some(m) = memory {
        let c = &s.communicators;
        let per = |k: u64| human(m.bytes.saturating_mul(k));
        times(m.bytes, c.max as u64, "one rank")?;
        let total = times(m.bytes, c.total, "the world")?;
        let range = if m.bytes == 0 {
            "0 B on every rank".to_string()
        } else {
            spread_text(c, per)
        };
        out.line(&format!(
            "Memory per rank: {range}; {} in the world ({})",
            human(total),
            m.source
        ))?;
    }
    if let Some(r) = verified {
        let calls = if r.calls_per_rank.0 == r.calls_per_rank.1 {
            format!("{} calls on every rank", r.calls_per_rank.0)
        } else {
            format!(
                "{} to {} calls per rank, in one global order",
                r.calls_per_rank.0, r.calls_per_rank.1
            )
        };
        out.line(&format!(
            "Verified: {} ranks, {calls}; the colours of all {} communicator kinds partition the world as the groups say; {} shared families serve identical groups ({} memberships checked)",
            r.ranks, r.splits_checked, r.shared_checked, r.memberships_checked
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_amounts() {
        assert_eq!(bytes("688MiB"), Ok(688 << 20));
        assert_eq!(bytes("1 GB"), Ok(1_000_000_000));
        assert_eq!(bytes("17"), Ok(17));
        assert!(bytes("1.5GiB")
            .unwrap_err()
            .contains("unknown unit '.5GiB'"));
        assert!(bytes("GiB").unwrap_err().contains("expected a number"));
        assert!(bytes("99999999999TiB").unwrap_err().contains("more than"));
        assert_eq!(human(0), "0 B");
        assert_eq!(human(688 << 20), "688.00 MiB");
        assert_eq!(human(3 << 30), "3.00 GiB");
    }
}
