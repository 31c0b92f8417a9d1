//! Who failed first: failure records in the rendezvous store.
//!
//! When one rank of a Gloo job dies, its neighbours see their connections to it break, fail,
//! and (usually) exit; the ranks further away then see the connections to those survivors
//! break, and Gloo alone would have them blame a survivor. A stopped rank breaks nothing: the
//! others time out without a peer to name.
//!
//! So each rank, when an operation of a communicator fails because communication failed,
//! writes one **failure record** into the store the communicator met through, under the
//! communicator's prefix (`<prefix>/fail/<rank>`): its rank, what it saw (a lost connection to
//! rank P, a timeout, or a failure of its own), whom it blamed at that moment, the operation and
//! the time. The record is written before the error reaches the caller, so before this rank can
//! close its connections or exit; a rank whose connection broke therefore either wrote a record
//! first or failed without reporting (died, was stopped, or left without an error).
//!
//! Then it finds the rank that failed first:
//! * it lost the connection to P: it follows the records from P (P lost Q, Q lost R, ...) to the
//!   first rank with no record, and blames that one; a rank whose record says it failed on its
//!   own (a library error, not a lost peer) is blamed itself;
//! * it timed out (or the chain ends at a rank that timed out): in a collective, every member
//!   is in the same operation, so it blames the member that wrote no record while the others
//!   did (a stopped rank writes nothing). A timeout of a point-to-point operation blames
//!   nobody this way: the other members are not waiting with it. An operation that ran to its
//!   own time limit and only then found a connection closed (by a peer that timed out a moment
//!   earlier) is reported as the timeout it is, blaming the silent member.
//!
//! A record can lag behind the broken connection it explains by a few milliseconds (Gloo closes
//! every connection of a rank that times out before the rank can write), so a rank without a
//! record is blamed only after [`GRACE`] (twice that while several members are silent: one of
//! them may only be late); the lookups poll every 20 ms until then. Nothing of this runs
//! unless an operation failed: the success path does not touch the store.
//!
//! Records are best effort: a store that cannot be read or written leaves the error as Gloo
//! reported it.

use crate::ffi::{RawStore, ShimCode, ShimError};
use grid_core::Error;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a rank waits for a peer's failure record before it blames the peer for having
/// none: what blaming adds to a failed operation (plus the store's own latency), or twice that
/// when several members of a collective are silent.
pub(crate) const GRACE: Duration = Duration::from_secs(1);

/// Interval of the lookups while waiting for records.
const POLL: Duration = Duration::from_millis(20);

/// Operations that wait for one peer, not for every member: a timeout of one of them says
/// nothing about the members that wrote no record.
const POINT_TO_POINT: [&str; 3] = ["send", "recv", "batch_p2p"];

/// What a rank saw when its operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Saw {
    /// The connection to this communicator rank broke.
    Lost(usize),
    /// The operation timed out, or a connection broke without Gloo saying which.
    Timeout,
    /// A failure of its own (a library error), not caused by a peer.
    Own,
}

/// One rank's failure record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    rank: usize,
    saw: Saw,
    blamed: Option<usize>,
    unix_ms: u128,
    op: String,
    message: String,
}

const MAGIC: &str = "grid-gloo failure v1";

impl Record {
    fn encode(&self) -> Vec<u8> {
        let saw = match self.saw {
            Saw::Lost(p) => format!("lost {p}"),
            Saw::Timeout => "timeout".into(),
            Saw::Own => "own".into(),
        };
        let blamed = self
            .blamed
            .map(|b| b.to_string())
            .unwrap_or_else(|| "-".into());
        format!(
            "{MAGIC}\nrank {}\nsaw {saw}\nblamed {blamed}\ntime_ms {}\nop {}\nmessage {}\n",
            self.rank,
            self.unix_ms,
            self.op,
            self.message.replace('\n', " ")
        )
        .into_bytes()
    }

    /// `None` for anything that is not a record of this format.
    fn decode(bytes: &[u8]) -> Option<Record> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != MAGIC {
            return None;
        }
        let mut fields: HashMap<&str, &str> = HashMap::new();
        for line in lines {
            let (k, v) = line.split_once(' ').unwrap_or((line, ""));
            fields.insert(k, v);
        }
        let saw = match fields.get("saw")?.split_once(' ') {
            Some(("lost", p)) => Saw::Lost(p.parse().ok()?),
            None if fields.get("saw") == Some(&"timeout") => Saw::Timeout,
            None if fields.get("saw") == Some(&"own") => Saw::Own,
            _ => return None,
        };
        Some(Record {
            rank: fields.get("rank")?.parse().ok()?,
            saw,
            blamed: fields.get("blamed").and_then(|b| b.parse().ok()),
            unix_ms: fields.get("time_ms")?.parse().ok()?,
            op: fields.get("op").unwrap_or(&"").to_string(),
            message: fields.get("message").unwrap_or(&"").to_string(),
        })
    }
}

/// The rank found to have failed first, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Communicator rank blamed.
    pub(crate) blamed: usize,
    /// One sentence: who failed first and how that is known.
    pub(crate) why: String,
    /// Blamed for its silence in a collective (it wrote no record while every other member
    /// did: it never arrived or stopped), not for a connection that broke.
    pub(crate) silent: bool,
}

/// The store handle that failure records go through: one per factory, shared by its
/// communicators, used only after a failure. Requests to a store server are bounded.
pub(crate) type SharedStore = Arc<Mutex<RawStore>>;

/// The failure bookkeeping of one communicator on one rank.
pub(crate) struct Blame {
    store: SharedStore,
    /// The communicator's store prefix (its rendezvous keys live under it too).
    prefix: String,
    rank: usize,
    global_ranks: Vec<usize>,
    grace: Duration,
    /// The first failure's verdict, reused by every later failure of the communicator.
    verdict: Mutex<Option<Option<Verdict>>>,
}

impl std::fmt::Debug for Blame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blame")
            .field("prefix", &self.prefix)
            .field("rank", &self.rank)
            .finish()
    }
}

fn key(rank: usize) -> String {
    format!("fail/{rank}")
}

impl Blame {
    pub(crate) fn new(
        store: SharedStore,
        prefix: String,
        rank: usize,
        global_ranks: Vec<usize>,
    ) -> Blame {
        Blame {
            store,
            prefix,
            rank,
            global_ranks,
            grace: GRACE,
            verdict: Mutex::new(None),
        }
    }

    fn size(&self) -> usize {
        self.global_ranks.len()
    }

    fn world(&self, r: usize) -> usize {
        self.global_ranks.get(r).copied().unwrap_or(r)
    }

    fn named(&self, r: usize) -> String {
        format!("rank {r} (world rank {})", self.world(r))
    }

    /// Records this rank's failure of `op` (`e`: what the shim reported) and returns the rank
    /// that failed first where it can be known. Called once per failed operation; the first
    /// call of a communicator does the work, later ones return its verdict.
    ///
    /// `close` closes this rank's connections of the communicator: called once the record is
    /// written (for a lost connection or a timeout), so that the peers blocked on this rank
    /// fail now, find the record, and look further, instead of waiting for their timeout.
    ///
    /// `stop` is polled while waiting for the others' records: once it returns true (this rank
    /// was aborted meanwhile: the caller reports that instead), the wait ends with no verdict.
    pub(crate) fn assign(
        &self,
        op: &'static str,
        e: &ShimError,
        close: impl FnOnce() + Send,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Option<Verdict> {
        let mut cached = self.verdict.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = cached.as_ref() {
            return v.clone();
        }
        let saw = match (e.code, e.peer) {
            (ShimCode::Io | ShimCode::Timeout, Some(p)) if p < self.size() && p != self.rank => {
                Saw::Lost(p)
            }
            (ShimCode::Io | ShimCode::Timeout, _) => Saw::Timeout,
            _ => Saw::Own,
        };
        let record = Record {
            rank: self.rank,
            saw,
            blamed: match saw {
                Saw::Lost(p) => Some(p),
                _ => None,
            },
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0),
            op: op.to_string(),
            message: e.message.clone(),
        };
        let written = self
            .lock()
            .set(&self.prefix, &key(self.rank), &record.encode());
        if let Err(w) = &written {
            tracing::warn!(prefix = %self.prefix, rank = self.rank, error = %w, "gloo: cannot record this rank's failure in the store");
        }
        let verdict = match saw {
            Saw::Own => None,
            _ if written.is_err() => None,
            // Closing waits for a tick of the transport's event loop once per connection
            // (tens of microseconds while the shim keeps the loop ticking, up to 10 ms when it
            // cannot): it runs beside the lookups, which take the grace period anyway.
            _ => std::thread::scope(|s| {
                let closing = std::thread::Builder::new()
                    .name("gloo-close".into())
                    .spawn_scoped(s, close);
                if let Err(e) = &closing {
                    tracing::warn!(error = %e, "gloo: no thread to close the connections; they close when the communicator is dropped");
                }
                self.resolve(op, saw, stop)
            }),
        };
        if let Some(v) = &verdict {
            tracing::warn!(prefix = %self.prefix, rank = self.rank, blamed = v.blamed, why = %v.why, "gloo: failure blamed");
        }
        *cached = Some(verdict.clone());
        verdict
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RawStore> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The record of `rank`, from `known` or the store; `Err` when the store cannot be read.
    fn lookup(
        &self,
        known: &mut HashMap<usize, Record>,
        rank: usize,
    ) -> Result<Option<Record>, ShimError> {
        if let Some(r) = known.get(&rank) {
            return Ok(Some(r.clone()));
        }
        let got = self.lock().try_get(&self.prefix, &key(rank))?;
        match got.as_deref().and_then(Record::decode) {
            Some(r) => {
                known.insert(rank, r.clone());
                Ok(Some(r))
            }
            None => Ok(None),
        }
    }

    /// Polls the records until [`Blame::grace`] has passed or the answer is certain.
    fn resolve(
        &self,
        op: &'static str,
        saw: Saw,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Option<Verdict> {
        let start = Instant::now();
        let deadline = start + self.grace;
        // While several members are silent, one of them may only be late: wait up to twice
        // the grace period for them to report before naming the first.
        let late = start + self.grace * 2;
        let mut known = HashMap::new();
        let collective = !POINT_TO_POINT.contains(&op);
        loop {
            if stop() {
                return None;
            }
            match self.step(&mut known, saw, collective) {
                Ok(Step::Done(v)) => return v,
                Ok(Step::Suspect(v)) => {
                    if Instant::now() >= deadline {
                        return Some(v);
                    }
                }
                Ok(Step::Several(v)) => {
                    if Instant::now() >= late {
                        return Some(v);
                    }
                }
                Err(e) => {
                    tracing::warn!(prefix = %self.prefix, error = %e, "gloo: cannot read the failure records; blaming as Gloo reported");
                    return None;
                }
            }
            let now = Instant::now();
            let until = if now < deadline { deadline } else { late };
            std::thread::sleep(POLL.min(until.saturating_duration_since(now)));
        }
    }

    /// One look at the records.
    fn step(
        &self,
        known: &mut HashMap<usize, Record>,
        saw: Saw,
        collective: bool,
    ) -> Result<Step, ShimError> {
        // Follow the lost connections from the peer this rank lost.
        if let Saw::Lost(first) = saw {
            let mut path = vec![first];
            let mut cur = first;
            loop {
                match self.lookup(known, cur)? {
                    None => {
                        let why = if path.len() == 1 {
                            format!(
                                "{} failed first: this rank lost its connection to it, and it reported no failure of its own (it died, was stopped, or left without an error)",
                                self.named(cur)
                            )
                        } else {
                            let chain: Vec<String> = path[..path.len() - 1]
                                .iter()
                                .map(|r| format!("rank {r}"))
                                .collect();
                            format!(
                                "{} failed first: {} had lost its connection to it (in that order), and it reported no failure of its own (it died, was stopped, or left without an error)",
                                self.named(cur),
                                chain.join(", then ")
                            )
                        };
                        return Ok(Step::Suspect(Verdict {
                            blamed: cur,
                            why,
                            silent: false,
                        }));
                    }
                    Some(rec) => match rec.saw {
                        Saw::Own => {
                            return Ok(Step::Done(Some(Verdict {
                                blamed: cur,
                                silent: false,
                                why: format!(
                                    "{} failed first, on its own: {}: {}",
                                    self.named(cur),
                                    rec.op,
                                    rec.message
                                ),
                            })))
                        }
                        Saw::Lost(next) if next != self.rank && !path.contains(&next) => {
                            path.push(next);
                            cur = next;
                        }
                        // A rank that timed out, or a cycle of survivors.
                        _ => break,
                    },
                }
            }
        }
        if !collective {
            // Only the peer of a point-to-point operation waits with it: the silence of the
            // other members means nothing.
            return Ok(Step::Done(None));
        }
        // Every member is in this collective: the one that wrote no record is the one that
        // stopped (or died without breaking a connection this rank used).
        let mut silent = Vec::new();
        for r in 0..self.size() {
            if r != self.rank && self.lookup(known, r)?.is_none() {
                silent.push(r);
            }
        }
        match silent.as_slice() {
            [] => Ok(Step::Done(None)),
            [one] => Ok(Step::Suspect(Verdict {
                blamed: *one,
                silent: true,
                why: format!(
                    "{} failed first: every other member reported a failure of this collective and it reported none (it died or was stopped)",
                    self.named(*one)
                ),
            })),
            [first, ..] => Ok(Step::Several(Verdict {
                blamed: *first,
                silent: true,
                why: format!(
                    "{} ranks reported no failure of this collective while the others did ({}); the first is named",
                    silent.len(),
                    silent
                        .iter()
                        .take(12)
                        .map(|r| self.named(*r))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })),
        }
    }

    /// `err` (the error Gloo's report maps to) with the rank that failed first: the blamed peer
    /// of [`Error::PeerFailed`] (its message then says what this rank saw and who failed
    /// first) and of [`Error::Timeout`].
    ///
    /// An operation that ran to its own time limit `limit` and then found a connection broken
    /// is a [`Error::Timeout`] when the blame falls on a silent member: the broken connection
    /// was a peer that timed out a moment earlier and closed its connections, not the cause.
    pub(crate) fn apply(
        &self,
        op: &'static str,
        e: &ShimError,
        mut err: Error,
        limit: Duration,
        close: impl FnOnce() + Send,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Error {
        if e.code == ShimCode::Invalid {
            return err;
        }
        let Some(v) = self.assign(op, e, close, stop) else {
            return err;
        };
        if e.code == ShimCode::Timeout && v.silent {
            if let Error::PeerFailed { op, at, .. } = err {
                return Error::Timeout {
                    op,
                    millis: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
                    peer: Some(v.blamed),
                    at,
                };
            }
        }
        match &mut err {
            Error::PeerFailed { peer, message, .. } => {
                *peer = v.blamed;
                message.push_str("; ");
                message.push_str(&v.why);
            }
            Error::Timeout { peer, .. } => *peer = Some(v.blamed),
            _ => {}
        }
        err
    }
}

/// The result of one look at the records.
enum Step {
    /// Certain (or nothing more to learn).
    Done(Option<Verdict>),
    /// The best answer so far, certain once the grace period has passed without a change.
    Suspect(Verdict),
    /// Several members are silent: the first is named after twice the grace period.
    Several(Verdict),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for saw in [Saw::Lost(3), Saw::Timeout, Saw::Own] {
            let r = Record {
                rank: 5,
                saw,
                blamed: Some(3),
                unix_ms: 1_700_000_000_123,
                op: "all_reduce".into(),
                message: "Connection reset\nby peer".into(),
            };
            let back = Record::decode(&r.encode()).unwrap();
            assert_eq!(back.saw, saw);
            assert_eq!(
                (back.rank, back.blamed, back.unix_ms),
                (5, Some(3), r.unix_ms)
            );
            assert_eq!(back.message, "Connection reset by peer");
        }
        assert_eq!(Record::decode(b"something else"), None);
        assert_eq!(Record::decode(b"grid-gloo failure v1\nrank x\n"), None);
    }

    /// Ranks as records in an in-memory store: the chains and the silent member.
    #[test]
    fn follows_chains_and_finds_the_silent_member() {
        let store: SharedStore = Arc::new(Mutex::new(RawStore::hash().unwrap()));
        let blame = |rank: usize| {
            let mut b = Blame::new(store.clone(), "p".into(), rank, (10..16).collect());
            b.grace = Duration::from_millis(100);
            b
        };
        let lost = |peer| ShimError {
            code: ShimCode::Io,
            peer: Some(peer),
            message: "Connection closed by peer".into(),
        };
        let timeout = ShimError {
            code: ShimCode::Timeout,
            peer: None,
            message: "Timed out".into(),
        };
        // Rank 2 dies (no record); rank 1 loses it; rank 0 loses rank 1 (which exited).
        let v1 = blame(1)
            .assign("all_reduce", &lost(2), || {}, &|| false)
            .unwrap();
        assert_eq!(v1.blamed, 2, "{}", v1.why);
        let v0 = blame(0)
            .assign("all_reduce", &lost(1), || {}, &|| false)
            .unwrap();
        assert_eq!(v0.blamed, 2, "{}", v0.why);
        assert!(
            v0.why.contains("rank 1 had lost its connection"),
            "{}",
            v0.why
        );
        assert!(v0.why.contains("world rank 12"), "{}", v0.why);
        // A rank that failed on its own is blamed itself.
        let own = ShimError {
            code: ShimCode::Enforce,
            peer: None,
            message: "enforce fail".into(),
        };
        assert_eq!(blame(4).assign("broadcast", &own, || {}, &|| false), None);
        let v5 = blame(5)
            .assign("broadcast", &lost(4), || {}, &|| false)
            .unwrap();
        assert_eq!(v5.blamed, 4);
        assert!(v5.why.contains("on its own"), "{}", v5.why);
        // Rank 3 times out: every member but rank 2 has reported.
        let v3 = blame(3)
            .assign("all_reduce", &timeout, || {}, &|| false)
            .unwrap();
        assert_eq!(v3.blamed, 2, "{}", v3.why);
        assert!(v3.why.contains("every other member"), "{}", v3.why);
        // A rank aborted while it waits for the others' records stops waiting at once (with
        // the full grace period of 1 s it would wait 2 s here: two members are silent).
        let t = std::time::Instant::now();
        let aborted = Blame::new(store.clone(), "q".into(), 0, vec![0, 1, 2]);
        assert_eq!(aborted.assign("barrier", &timeout, || {}, &|| true), None);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        // Two silent members: the first is named, and the message says so.
        let b = Blame::new(store.clone(), "r".into(), 0, vec![0, 1, 2]);
        let v = b.assign("barrier", &timeout, || {}, &|| false).unwrap();
        assert_eq!(v.blamed, 1);
        assert!(
            v.why.starts_with("2 ranks reported no failure"),
            "{}",
            v.why
        );
        // A point-to-point timeout blames nobody by silence.
        let b = Blame::new(store.clone(), "q".into(), 0, vec![0, 1, 2]);
        assert_eq!(b.assign("recv", &timeout, || {}, &|| false), None);
        // The verdict is computed once per communicator.
        assert_eq!(b.assign("recv", &lost(1), || {}, &|| false), None);
    }

    /// Rank 2 never joins; rank 1 times out and closes its connections a moment before rank 0
    /// reaches its own limit and finds the connection to rank 1 broken. Rank 0's error is a
    /// timeout blaming rank 2, as rank 1's is, not a lost connection; a connection that broke
    /// before this rank's own limit stays a peer failure (blamed on rank 2 as well).
    #[test]
    fn a_timeout_that_finds_a_timed_out_peer_closed_is_a_timeout() {
        let store: SharedStore = Arc::new(Mutex::new(RawStore::hash().unwrap()));
        let blame = |prefix: &str, rank: usize| {
            let mut b = Blame::new(store.clone(), prefix.into(), rank, vec![0, 1, 2]);
            b.grace = Duration::from_millis(100);
            b
        };
        let limit = Duration::from_millis(800);
        let lost_1 = |op| Error::PeerFailed {
            op,
            peer: 1,
            message: "lost the connection to rank 1".into(),
            at: None,
        };
        for (prefix, code, timeout) in [("t", ShimCode::Timeout, true), ("u", ShimCode::Io, false)]
        {
            let timed_out = ShimError {
                code: ShimCode::Timeout,
                peer: None,
                message: "Timed out".into(),
            };
            let found_closed = ShimError {
                code,
                peer: Some(1),
                message: "Connection closed by peer".into(),
            };
            // Both fail at about the same time, each waiting for the other's record.
            let (e0, e1) = std::thread::scope(|s| {
                let r1 = s.spawn(|| {
                    let err = Error::Timeout {
                        op: "all_to_all_v",
                        millis: 800,
                        peer: None,
                        at: None,
                    };
                    blame(prefix, 1).apply("all_to_all_v", &timed_out, err, limit, || {}, &|| false)
                });
                let e0 = blame(prefix, 0).apply(
                    "all_to_all_v",
                    &found_closed,
                    lost_1("all_to_all_v"),
                    limit,
                    || {},
                    &|| false,
                );
                (e0, r1.join().unwrap())
            });
            assert!(
                matches!(
                    e1,
                    Error::Timeout {
                        peer: Some(2),
                        millis: 800,
                        ..
                    }
                ),
                "{e1}"
            );
            if timeout {
                assert!(
                    matches!(
                        e0,
                        Error::Timeout {
                            op: "all_to_all_v",
                            peer: Some(2),
                            millis: 800,
                            ..
                        }
                    ),
                    "{e0}"
                );
            } else {
                assert!(
                    matches!(&e0, Error::PeerFailed { peer: 2, message, .. }
                        if message.contains("rank 2 (world rank 2) failed first")),
                    "{e0}"
                );
            }
        }
    }
}
