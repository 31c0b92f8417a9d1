//! `grid trace`: reads every rank's operation-log dump in a directory and says what happened
//! (grid-core's `trace` module decides).

use crate::error::usage;
use crate::out::Out;
use crate::values::{Format, FormatArg};
use crate::Failure;
use grid_core::oplog::TraceDump;
use grid_core::trace::{analyze_inputs, RankInput};
use std::collections::BTreeSet;
use std::path::Path;

const AFTER_HELP: &str = "DIR holds the files rank-<world rank>.json that every rank writes with
GRID_TRACE_DIR=DIR set (on a timeout, an abort, a failure, an explicit dump or SIGUSR1).
The expected ranks are those of the files and every member of every communicator they list;
a missing or malformed file is a finding, not an error.
Per communicator: the last sequence number each rank completed, the first one not completed by
every rank (stuck_at), the ranks that never entered it (the likely culprits) and those that
waited in it, and every sequence number where the ranks recorded different operations, dtypes,
counts, roots, reductions or peers (a send facing its receive is not a mismatch).
JSON: {\"ranks\", \"missing_files\", \"malformed_files\": [{\"rank\", \"error\"}],
       \"communicators\": [{\"name\", \"ranks\", \"last_completed\": {RANK: seq|null},
       \"stuck_at\": seq|null, \"stuck_op\", \"missing_ranks\", \"waiting_ranks\",
       \"mismatches\": [{\"seq\", \"field\", \"values\": {RANK: value}}], \"no_log_ranks\"}],
       \"summary\": \"one sentence\"}
An unreadable DIR, or one without rank files, exits with status 2.";

/// Options of `grid trace`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// The directory of the dumps (GRID_TRACE_DIR)
    #[arg(value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
    dir: String,
    #[command(flatten)]
    format: FormatArg,
}

/// The rank of a dump file name: `rank-12.json` is 12.
fn rank_of(file_name: &str) -> Option<usize> {
    let digits = file_name.strip_prefix("rank-")?.strip_suffix(".json")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Reads one file: its dump, or why it cannot be used.
fn read_one(path: &Path, rank: usize) -> RankInput {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return RankInput::Malformed(format!("{}: {e}", path.display())),
    };
    match TraceDump::from_json(&text) {
        Ok(d) if d.rank != rank => RankInput::Malformed(format!(
            "{}: the file says rank {}, its name says rank {rank}",
            path.display(),
            d.rank
        )),
        Ok(d) => RankInput::Dump(d),
        Err(e) => RankInput::Malformed(format!("{}: {e}", path.display())),
    }
}

/// `grid trace`.
pub fn run(a: &Args, out: &mut Out<'_>) -> std::result::Result<(), Failure> {
    let dir = Path::new(&a.dir);
    let entries = std::fs::read_dir(dir)
        .map_err(|e| usage!("grid trace: cannot read directory {}: {e}", a.dir))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry =
            entry.map_err(|e| usage!("grid trace: cannot read directory {}: {e}", a.dir))?;
        let name = entry.file_name();
        if let Some(rank) = name.to_str().and_then(rank_of) {
            files.push((rank, entry.path()));
        }
    }
    if files.is_empty() {
        return Err(usage!(
            "grid trace: no rank files in {} (expected rank-<world rank>.json, as written with GRID_TRACE_DIR={})",
            a.dir,
            a.dir
        )
        .into());
    }
    files.sort();
    let inputs: Vec<(usize, RankInput)> = files
        .iter()
        .map(|(rank, path)| (*rank, read_one(path, *rank)))
        .collect();
    let expected: BTreeSet<usize> = inputs.iter().map(|(r, _)| *r).collect();
    let expected: Vec<usize> = expected.into_iter().collect();
    let report = analyze_inputs(inputs, &expected);
    match a.format.format {
        Format::Json => out.line(&report.to_json())?,
        Format::Text => out.raw(&report.to_text())?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::rank_of;

    #[test]
    fn file_names() {
        assert_eq!(rank_of("rank-0.json"), Some(0));
        assert_eq!(rank_of("rank-123.json"), Some(123));
        for bad in [
            "rank-.json",
            "rank--1.json",
            "rank-1.json.tmp",
            ".rank-1.json.9.tmp",
            "rank-+1.json",
            "x.json",
        ] {
            assert_eq!(rank_of(bad), None, "{bad}");
        }
    }
}
