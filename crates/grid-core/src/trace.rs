//! The analyser of operation-log dumps ([`crate::oplog`]): what `grid trace DIR` says.
//!
//! [`analyze`] takes every rank's [`TraceDump`] (or the fact that a rank's file is missing or
//! malformed, which is itself a finding, never an error) and returns a [`TraceReport`]. It
//! decides as follows, for each communicator, identified by its name and member world ranks:
//!
//! * **`last_completed`**: for each member, the largest sequence number it completed (null if
//!   it completed none, or has no log of this communicator).
//! * **`stuck_at`**: the smallest sequence number that some member posted and that not every
//!   member *with a log* completed; null if there is none. For a member, a sequence number
//!   older than its oldest kept record counts as completed (the ring dropped it); a newer one it
//!   has no record of was never posted. Members without a log (file missing or malformed, or
//!   the communicator absent from their dump) do not decide `stuck_at`: where they are is
//!   unknown.
//! * **`missing_ranks`**: the members that never posted `stuck_at` (the likely culprits),
//!   including those without a log. When `stuck_at` is null, the members without a log.
//! * **`waiting_ranks`**: the members that posted or started `stuck_at` and did not complete it,
//!   or whose record of it failed (a timeout is a failure after a wait).
//! * **`mismatches`**: every sequence number (not only `stuck_at`) at which the members'
//!   records disagree. For a collective (a record without a peer) every member must record the
//!   same `op`, `dtype`, `count`, `root` and `reduce_op`; when the `op`s differ only the `op` is
//!   reported (the other fields of different operations are not comparable). A point-to-point
//!   operation (a record with a peer) is matched with its peer's record at the same sequence
//!   number, by relation rather than equality: if rank A (group rank i) records `send` to peer
//!   j, the member with group rank j must record a receive (`recv`, `irecv`, ...) from peer i,
//!   with the same `dtype` and `count`; a send matched with a send (or a receive with a
//!   receive) is an `op` mismatch, a peer that does not point back is a `peer` mismatch, a peer
//!   outside the communicator is a `peer` mismatch, and a collective facing a point-to-point
//!   operation is an `op` mismatch. A peer whose record at that sequence number is absent is
//!   not a mismatch (it may not have got there yet: that is `stuck_at`'s business). Operations
//!   whose name contains both `send` and `recv` (`send_recv`) must match the same name.
//!   `values` maps each member with a record at that sequence number to its value of the field
//!   (roots and peers as recorded: group ranks).
//!
//! The **`summary`** is one sentence about the likeliest culprit. Of the communicators with a
//! `stuck_at` and missing ranks, the one whose stuck operation was posted first (by its waiting
//! ranks) is named: a later hang is usually a consequence of the first. Without one, the
//! mismatch with the smallest sequence number is named (the members that disagree with the
//! majority, or every member's value when there is no strict majority, as with two ranks); then
//! a communicator whose members are all waiting; then missing files; otherwise the sentence says
//! that every rank completed the same operations. Missing and malformed files are appended in
//! parentheses.
//!
//! ```
//! use grid_core::oplog::{OpDesc, Recorder};
//! use grid_core::trace::analyze;
//! // Ranks 0 and 1 of a 3-rank communicator enter all_reduce #1; rank 2 never does.
//! let dumps = (0..3usize)
//!     .map(|r| {
//!         let rec = Recorder::new(None, 16).unwrap();
//!         rec.set_world_rank(r);
//!         let log = rec.register("dp", vec![0, 1, 2]);
//!         let h = log.begin(OpDesc::new("all_reduce").dtype("f32").count(4).reduce_op("sum"));
//!         log.complete(h);
//!         if r != 2 {
//!             log.begin(OpDesc::new("all_reduce").dtype("f32").count(4).reduce_op("sum"));
//!         }
//!         (r, Some(rec.snapshot("timeout").unwrap()))
//!     })
//!     .collect();
//! let report = analyze(dumps, &[0, 1, 2]);
//! let c = &report.communicators[0];
//! assert_eq!(c.stuck_at, Some(1));
//! assert_eq!((c.missing_ranks.clone(), c.waiting_ranks.clone()), (vec![2], vec![0, 1]));
//! assert_eq!(
//!     report.summary,
//!     "rank 2 never entered all_reduce #1 on communicator dp[0, 1, 2]; ranks 0, 1 waited in it"
//! );
//! ```

use crate::oplog::{OpRecord, OpState, TraceDump};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// What is known of one rank: its dump, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankInput {
    /// The rank's dump.
    Dump(TraceDump),
    /// No file for this rank (the rank likely died before it could dump).
    Missing,
    /// A file that could not be read or parsed, and why.
    Malformed(String),
}

/// A rank whose file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MalformedFile {
    /// The rank.
    pub rank: usize,
    /// What was wrong.
    pub error: String,
}

/// One disagreement between the members' records at one sequence number.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mismatch {
    /// The sequence number.
    pub seq: u64,
    /// `op`, `dtype`, `count`, `root`, `reduce_op` or `peer`.
    pub field: &'static str,
    /// Each member's value (world rank as the key).
    pub values: BTreeMap<usize, Value>,
}

/// The findings of one communicator. See the [module](self) documentation for the rules.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommReport {
    /// Its name.
    pub name: String,
    /// Its members' world ranks, in group-rank order.
    pub ranks: Vec<usize>,
    /// Each member's last completed sequence number (null: none, or no log).
    pub last_completed: BTreeMap<usize, Option<u64>>,
    /// The first sequence number not completed by every member with a log.
    pub stuck_at: Option<u64>,
    /// The operation at `stuck_at` (as the first waiting rank recorded it, or, if none waits,
    /// the first member that completed it).
    pub stuck_op: Option<String>,
    /// Members that never posted `stuck_at` (or have no log).
    pub missing_ranks: Vec<usize>,
    /// Members that posted `stuck_at` and did not complete it.
    pub waiting_ranks: Vec<usize>,
    /// Every disagreement, by sequence number.
    pub mismatches: Vec<Mismatch>,
    /// Members without a log of this communicator (their file is missing or malformed, or
    /// their dump does not have it).
    pub no_log_ranks: Vec<usize>,
    /// When the first waiting rank posted `stuck_at` (µs since the Unix epoch).
    #[serde(skip)]
    stuck_posted_us: Option<u64>,
}

impl CommReport {
    /// `dp[0, 2, 4, 6]`.
    pub fn label(&self) -> String {
        format!("{}{}", self.name, list(&self.ranks, true))
    }
}

/// What `grid trace` says about a set of dumps. Its JSON form is
/// `{"ranks", "missing_files", "malformed_files", "communicators": [{"name", "ranks",
/// "last_completed": {"<rank>": seq}, "stuck_at", "stuck_op", "missing_ranks", "waiting_ranks",
/// "mismatches": [{"seq", "field", "values": {"<rank>": value}}], "no_log_ranks"}], "summary"}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceReport {
    /// Every rank expected (sorted).
    pub ranks: Vec<usize>,
    /// Ranks without a file.
    pub missing_files: Vec<usize>,
    /// Ranks whose file could not be used.
    pub malformed_files: Vec<MalformedFile>,
    /// One report per communicator, sorted by name then members.
    pub communicators: Vec<CommReport>,
    /// One sentence naming the likely culprit.
    pub summary: String,
}

/// Analyses the dumps of `expected` ranks; `None` is a rank whose file is missing. A rank
/// neither in `dumps` nor with a dump is missing too.
pub fn analyze(dumps: Vec<(usize, Option<TraceDump>)>, expected: &[usize]) -> TraceReport {
    analyze_inputs(
        dumps
            .into_iter()
            .map(|(r, d)| (r, d.map_or(RankInput::Missing, RankInput::Dump)))
            .collect(),
        expected,
    )
}

/// Where one member is at one sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At<'a> {
    /// No log of the communicator.
    Unknown,
    /// Older than its oldest record: counted as completed.
    Dropped,
    /// Its record.
    Record(&'a OpRecord),
    /// No record, newer than its oldest: never posted.
    NotPosted,
}

/// One member's log of one communicator.
struct MemberLog<'a> {
    by_seq: BTreeMap<u64, &'a OpRecord>,
    oldest: Option<u64>,
}

impl<'a> MemberLog<'a> {
    fn at(&self, seq: u64) -> At<'a> {
        if let Some(r) = self.by_seq.get(&seq) {
            return At::Record(r);
        }
        match self.oldest {
            Some(o) if seq < o => At::Dropped,
            _ => At::NotPosted,
        }
    }
}

/// [`analyze`] with malformed files too.
pub fn analyze_inputs(inputs: Vec<(usize, RankInput)>, expected: &[usize]) -> TraceReport {
    let mut dumps: BTreeMap<usize, TraceDump> = BTreeMap::new();
    let mut malformed = Vec::new();
    let mut ranks: BTreeSet<usize> = expected.iter().copied().collect();
    for (rank, input) in inputs {
        ranks.insert(rank);
        match input {
            RankInput::Dump(d) => {
                dumps.insert(rank, d);
            }
            RankInput::Malformed(error) => malformed.push(MalformedFile { rank, error }),
            RankInput::Missing => {}
        }
    }
    // Every communicator, by name and members.
    let mut comms: BTreeSet<(String, Vec<usize>)> = BTreeSet::new();
    for d in dumps.values() {
        for c in &d.communicators {
            ranks.extend(c.ranks.iter().copied());
            comms.insert((c.name.clone(), c.ranks.clone()));
        }
    }
    let malformed_ranks: BTreeSet<usize> = malformed.iter().map(|m| m.rank).collect();
    let missing_files: Vec<usize> = ranks
        .iter()
        .copied()
        .filter(|r| !dumps.contains_key(r) && !malformed_ranks.contains(r))
        .collect();
    malformed.sort_by_key(|m| m.rank);

    let communicators: Vec<CommReport> = comms
        .into_iter()
        .map(|(name, members)| analyze_comm(name, members, &dumps))
        .collect();
    let summary = summarize(&communicators, &missing_files, &malformed);
    TraceReport {
        ranks: ranks.into_iter().collect(),
        missing_files,
        malformed_files: malformed,
        communicators,
        summary,
    }
}

fn analyze_comm(
    name: String,
    members: Vec<usize>,
    dumps: &BTreeMap<usize, TraceDump>,
) -> CommReport {
    // Each member's log (None: unknown). A rank's dump is read for a communicator it is a
    // member of; if it somehow lists the same communicator twice, the first one counts.
    let logs: Vec<Option<MemberLog<'_>>> = members
        .iter()
        .map(|r| {
            let c = dumps
                .get(r)?
                .communicators
                .iter()
                .find(|c| c.name == name && c.ranks == members)?;
            let by_seq: BTreeMap<u64, &OpRecord> = c.records.iter().map(|r| (r.seq, r)).collect();
            let oldest = by_seq.keys().next().copied().or(Some(c.posted));
            Some(MemberLog { by_seq, oldest })
        })
        .collect();
    let at = |i: usize, seq: u64| logs[i].as_ref().map_or(At::Unknown, |l| l.at(seq));

    let mut last_completed = BTreeMap::new();
    let mut no_log_ranks = Vec::new();
    for (i, &r) in members.iter().enumerate() {
        let last = logs[i].as_ref().and_then(|l| {
            l.by_seq
                .values()
                .filter(|rec| rec.state == OpState::Completed)
                .map(|rec| rec.seq)
                .max()
        });
        if logs[i].is_none() {
            no_log_ranks.push(r);
        }
        last_completed.insert(r, last);
    }

    let seqs: BTreeSet<u64> = logs
        .iter()
        .flatten()
        .flat_map(|l| l.by_seq.keys().copied())
        .collect();
    let done = |a: At<'_>| match a {
        At::Dropped => true,
        At::Record(rec) => rec.state == OpState::Completed,
        At::Unknown | At::NotPosted => false,
    };
    let stuck_at = seqs
        .iter()
        .copied()
        .find(|&s| (0..members.len()).any(|i| logs[i].is_some() && !done(at(i, s))));

    let mut missing_ranks = Vec::new();
    let mut waiting_ranks = Vec::new();
    let mut stuck_op = None;
    let mut stuck_posted_us: Option<u64> = None;
    let (mut done_op, mut done_posted_us): (Option<String>, Option<u64>) = (None, None);
    match stuck_at {
        Some(s) => {
            for (i, &r) in members.iter().enumerate() {
                match at(i, s) {
                    At::Unknown | At::NotPosted => missing_ranks.push(r),
                    At::Record(rec) if rec.state != OpState::Completed => {
                        waiting_ranks.push(r);
                        stuck_op.get_or_insert_with(|| rec.op.clone());
                        stuck_posted_us =
                            Some(stuck_posted_us.map_or(rec.posted_us, |t| t.min(rec.posted_us)));
                    }
                    At::Record(rec) => {
                        // Completed here (an eager send, a root that finished first): names
                        // the operation when nobody waits in it.
                        done_op.get_or_insert_with(|| rec.op.clone());
                        done_posted_us =
                            Some(done_posted_us.map_or(rec.posted_us, |t| t.min(rec.posted_us)));
                    }
                    At::Dropped => {}
                }
            }
            stuck_op = stuck_op.or(done_op);
            stuck_posted_us = stuck_posted_us.or(done_posted_us);
        }
        None => missing_ranks = no_log_ranks.clone(),
    }

    let mut mismatches = Vec::new();
    for &s in &seqs {
        let recs: Vec<(usize, &OpRecord)> = (0..members.len())
            .filter_map(|i| match at(i, s) {
                At::Record(rec) => Some((i, rec)),
                _ => None,
            })
            .collect();
        compare(s, &members, &recs, &mut mismatches);
    }

    CommReport {
        name,
        ranks: members,
        last_completed,
        stuck_at,
        stuck_op,
        missing_ranks,
        waiting_ranks,
        mismatches,
        no_log_ranks,
        stuck_posted_us,
    }
}

/// The direction of a point-to-point operation, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Send,
    Recv,
    Both,
}

fn direction(op: &str) -> Dir {
    let op = op.to_ascii_lowercase();
    match (op.contains("send"), op.contains("recv")) {
        (true, false) => Dir::Send,
        (false, true) => Dir::Recv,
        _ => Dir::Both,
    }
}

fn opt_str(v: &Option<String>) -> Value {
    v.as_ref().map_or(Value::Null, |s| Value::String(s.clone()))
}

fn opt_num(v: Option<usize>) -> Value {
    v.map_or(Value::Null, |n| Value::from(n as u64))
}

/// One field of a record as a JSON value.
type Field = fn(&OpRecord) -> Value;

const OP: Field = |r| Value::String(r.op.clone());
const DTYPE: Field = |r| opt_str(&r.dtype);
const COUNT: Field = |r| Value::from(r.count as u64);
const ROOT: Field = |r| opt_num(r.root);
const REDUCE_OP: Field = |r| opt_str(&r.reduce_op);
const PEER: Field = |r| opt_num(r.peer);

/// The mismatches at sequence number `seq` among `recs` (member index, record).
fn compare(seq: u64, members: &[usize], recs: &[(usize, &OpRecord)], out: &mut Vec<Mismatch>) {
    if recs.len() < 2 && recs.iter().all(|(_, r)| r.peer.is_none()) {
        return;
    }
    let values = |f: Field, who: &[(usize, &OpRecord)]| {
        who.iter()
            .map(|&(i, r)| (members[i], f(r)))
            .collect::<BTreeMap<usize, Value>>()
    };
    let differ = |m: &BTreeMap<usize, Value>| {
        let mut it = m.values();
        let first = it.next();
        it.any(|v| Some(v) != first)
    };
    let any_collective = recs.iter().any(|(_, r)| r.peer.is_none());
    if any_collective {
        let ops = values(OP, recs);
        if differ(&ops) {
            out.push(Mismatch {
                seq,
                field: "op",
                values: ops,
            });
            return;
        }
        let fields = [
            ("dtype", DTYPE),
            ("count", COUNT),
            ("root", ROOT),
            ("reduce_op", REDUCE_OP),
        ];
        for (field, f) in fields {
            let v = values(f, recs);
            if differ(&v) {
                out.push(Mismatch {
                    seq,
                    field,
                    values: v,
                });
            }
        }
        return;
    }
    // Point to point: each record against its peer's, each pair once.
    let by_index: BTreeMap<usize, &OpRecord> = recs.iter().copied().collect();
    let mut seen: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &(i, r) in recs {
        let Some(p) = r.peer else { continue };
        if p >= members.len() {
            out.push(Mismatch {
                seq,
                field: "peer",
                values: values(PEER, &[(i, r)]),
            });
            continue;
        }
        let Some(&q) = by_index.get(&p) else { continue };
        if !seen.insert((i.min(p), i.max(p))) {
            continue;
        }
        let pair = [(i, r), (p, q)];
        if q.peer != Some(i) {
            out.push(Mismatch {
                seq,
                field: "peer",
                values: values(PEER, &pair),
            });
            continue;
        }
        let ok_dirs = match (direction(&r.op), direction(&q.op)) {
            (Dir::Send, Dir::Recv) | (Dir::Recv, Dir::Send) => true,
            (Dir::Both, Dir::Both) => r.op == q.op,
            _ => false,
        };
        if !ok_dirs {
            out.push(Mismatch {
                seq,
                field: "op",
                values: values(OP, &pair),
            });
            continue;
        }
        for (field, f) in [("dtype", DTYPE), ("count", COUNT)] {
            let v = values(f, &pair);
            if differ(&v) {
                out.push(Mismatch {
                    seq,
                    field,
                    values: v,
                });
            }
        }
    }
}

/// `[0, 2, 4]` (brackets) or `0, 2, 4`.
fn list(v: &[usize], brackets: bool) -> String {
    let s = v
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if brackets {
        format!("[{s}]")
    } else {
        s
    }
}

/// `rank 3` or `ranks 0, 2`.
fn ranks_phrase(v: &[usize]) -> String {
    match v {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", list(v, false)),
    }
}

/// A JSON value as text (strings without quotes).
fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The members whose value differs from the most common one, and that value; `None` when no
/// value is held by more members than every other (then nobody can be singled out).
fn odd_ones(values: &BTreeMap<usize, Value>) -> Option<(Vec<usize>, Value)> {
    let mut counts: Vec<(String, usize, Value)> = Vec::new();
    for v in values.values() {
        let key = v.to_string();
        match counts.iter_mut().find(|(k, _, _)| *k == key) {
            Some(c) => c.1 += 1,
            None => counts.push((key, 1, v.clone())),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    match counts.as_slice() {
        [first, second, ..] if first.1 == second.1 => None,
        [first, ..] => {
            let majority = first.2.clone();
            let odd: Vec<usize> = values
                .iter()
                .filter(|(_, v)| **v != majority)
                .map(|(r, _)| *r)
                .collect();
            (!odd.is_empty()).then_some((odd, majority))
        }
        [] => None,
    }
}

fn summarize(comms: &[CommReport], missing: &[usize], malformed: &[MalformedFile]) -> String {
    let files = || {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!("no file from {}", ranks_phrase(missing)));
        }
        if !malformed.is_empty() {
            let m: Vec<usize> = malformed.iter().map(|m| m.rank).collect();
            parts.push(format!("an unreadable file from {}", ranks_phrase(&m)));
        }
        parts.join(" and ")
    };
    let with_files = |s: String| {
        let f = files();
        if f.is_empty() {
            s
        } else {
            format!("{s} ({f})")
        }
    };
    // The earliest hang with culprits.
    let hang = comms
        .iter()
        .filter(|c| c.stuck_at.is_some() && !c.missing_ranks.is_empty())
        .min_by_key(|c| (c.stuck_posted_us.unwrap_or(u64::MAX), c.label()));
    if let Some(c) = hang {
        let op = c.stuck_op.as_deref().unwrap_or("operation");
        let seq = c.stuck_at.unwrap_or_default();
        let waited = if c.waiting_ranks.is_empty() {
            String::new()
        } else {
            format!("; {} waited in it", ranks_phrase(&c.waiting_ranks))
        };
        return with_files(format!(
            "{} never entered {op} #{seq} on communicator {}{waited}",
            ranks_phrase(&c.missing_ranks),
            c.label()
        ));
    }
    if let Some((c, m)) = comms
        .iter()
        .flat_map(|c| c.mismatches.iter().map(move |m| (c, m)))
        .min_by_key(|(c, m)| (m.seq, c.label()))
    {
        let Some((odd, majority)) = odd_ones(&m.values) else {
            // No majority (two ranks, or a send facing a send): list everyone's value.
            let each: Vec<String> = m
                .values
                .iter()
                .map(|(r, v)| format!("rank {r} {}", show(v)))
                .collect();
            return with_files(format!(
                "the ranks disagree on {} at #{} on communicator {}: {}",
                m.field,
                m.seq,
                c.label(),
                each.join(", ")
            ));
        };
        let odd_vals: Vec<String> = odd
            .iter()
            .map(|r| m.values.get(r).map_or_else(String::new, show))
            .collect();
        let odd_vals: BTreeSet<String> = odd_vals.into_iter().collect();
        let others: Vec<usize> = m
            .values
            .keys()
            .copied()
            .filter(|r| !odd.contains(r))
            .collect();
        return with_files(format!(
            "{} recorded {} {} at #{} on communicator {} where {} recorded {}",
            ranks_phrase(&odd),
            m.field,
            odd_vals.into_iter().collect::<Vec<_>>().join(" / "),
            m.seq,
            c.label(),
            ranks_phrase(&others),
            show(&majority)
        ));
    }
    if let Some(c) = comms.iter().find(|c| c.stuck_at.is_some()) {
        return with_files(format!(
            "{} waited in {} #{} on communicator {} and none of its members is missing from it",
            ranks_phrase(&c.waiting_ranks),
            c.stuck_op.as_deref().unwrap_or("operation"),
            c.stuck_at.unwrap_or_default(),
            c.label()
        ));
    }
    let f = files();
    if !f.is_empty() {
        let who = if missing.len() + malformed.len() == 1 {
            "that rank"
        } else {
            "they"
        };
        return format!(
            "the ranks with a log completed the same operations on every communicator; {f}, \
             so where {who} stopped is unknown"
        );
    }
    if comms.is_empty() {
        return "no communicator recorded any operation".to_string();
    }
    "every rank completed the same operations on every communicator: no divergence".to_string()
}

impl TraceReport {
    /// The report as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| format!("{{\"error\": \"cannot serialize the report: {e}\"}}"))
    }

    /// The report as readable text.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let logs = self
            .ranks
            .len()
            .saturating_sub(self.missing_files.len() + self.malformed_files.len());
        let _ = writeln!(
            s,
            "{} ranks expected ({}), {} logs read",
            self.ranks.len(),
            list(&self.ranks, false),
            logs
        );
        for r in &self.missing_files {
            let _ = writeln!(
                s,
                "rank {r}: no file (the rank may have died before dumping)"
            );
        }
        for m in &self.malformed_files {
            let _ = writeln!(s, "rank {}: unreadable file: {}", m.rank, m.error);
        }
        for c in &self.communicators {
            let _ = writeln!(s);
            let _ = writeln!(s, "communicator {} ({} ranks)", c.label(), c.ranks.len());
            let lc: Vec<String> = c
                .last_completed
                .iter()
                .map(|(r, v)| match v {
                    Some(v) => format!("{r}: #{v}"),
                    None => format!("{r}: -"),
                })
                .collect();
            let _ = writeln!(s, "  last completed: {}", lc.join(", "));
            match c.stuck_at {
                Some(seq) => {
                    let _ = writeln!(
                        s,
                        "  stuck at #{seq} {}",
                        c.stuck_op.as_deref().unwrap_or("(operation unknown)")
                    );
                    let _ = writeln!(s, "  never entered: {}", none_or(&c.missing_ranks));
                    let _ = writeln!(s, "  waiting in it: {}", none_or(&c.waiting_ranks));
                }
                None => {
                    let _ = writeln!(
                        s,
                        "  not stuck: every member with a log completed the same operations"
                    );
                }
            }
            if !c.no_log_ranks.is_empty() {
                let _ = writeln!(s, "  no log from: {}", list(&c.no_log_ranks, false));
            }
            for m in &c.mismatches {
                let v: Vec<String> = m
                    .values
                    .iter()
                    .map(|(r, v)| format!("rank {r} {}", show(v)))
                    .collect();
                let _ = writeln!(
                    s,
                    "  mismatch at #{}: {} differs: {}",
                    m.seq,
                    m.field,
                    v.join(", ")
                );
            }
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "summary: {}", self.summary);
        s
    }
}

fn none_or(v: &[usize]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        list(v, false)
    }
}
