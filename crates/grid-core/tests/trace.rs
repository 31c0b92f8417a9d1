//! The trace analyser on synthetic dumps, one scenario each: a rank killed mid-loop (file
//! missing, or its last record posted and never completed), a rank that skipped a collective,
//! count / dtype / root / reduce-op mismatches, point-to-point pairs, dropped records, and a
//! clean run. The dumps are made by real `OpLog`s through a `Recorder`, as a front end would.

use grid_core::oplog::{OpDesc, OpHandle, OpLog, Recorder, TraceDump};
use grid_core::trace::{analyze, analyze_inputs, RankInput, TraceReport};
use serde_json::{json, Value};
use std::sync::Arc;

/// One rank's recorder with its communicators' logs.
struct Rank {
    rec: Recorder,
    logs: Vec<Arc<OpLog>>,
}

impl Rank {
    fn new(rank: usize, comms: &[(&str, &[usize])], capacity: usize) -> Rank {
        let rec = Recorder::new(None, capacity).unwrap();
        rec.set_world_rank(rank);
        let logs = comms
            .iter()
            .map(|(n, r)| rec.register(*n, r.to_vec()))
            .collect();
        Rank { rec, logs }
    }

    /// Posts, starts and completes `d` on communicator `c`.
    fn done(&self, c: usize, d: OpDesc) {
        let h = self.logs[c].begin(d);
        self.logs[c].mark_started(h);
        self.logs[c].complete(h);
    }

    /// Posts and starts `d` without completing it.
    fn hang(&self, c: usize, d: OpDesc) -> OpHandle {
        let h = self.logs[c].begin(d);
        self.logs[c].mark_started(h);
        h
    }

    fn dump(&self) -> TraceDump {
        self.rec.snapshot("timeout").unwrap()
    }
}

fn ar(count: usize) -> OpDesc {
    OpDesc::new("all_reduce")
        .dtype("f32")
        .count(count)
        .reduce_op("sum")
}

fn bc(root: usize) -> OpDesc {
    OpDesc::new("broadcast").dtype("f32").count(16).root(root)
}

const DP: (&str, &[usize]) = ("dp", &[0, 2, 4, 6]);

/// Four dp ranks that ran `steps` all-reduces; `f` changes rank r's run.
fn dp_world(steps: usize, f: impl Fn(usize, &Rank)) -> Vec<(usize, Option<TraceDump>)> {
    [0usize, 2, 4, 6]
        .iter()
        .map(|&r| {
            let rank = Rank::new(r, &[DP], 64);
            for _ in 0..steps {
                rank.done(0, ar(1024));
            }
            f(r, &rank);
            (r, Some(rank.dump()))
        })
        .collect()
}

fn json_of(report: &TraceReport) -> Value {
    serde_json::from_str(&report.to_json()).unwrap()
}

#[test]
fn all_completed_is_no_finding() {
    let report = analyze(dp_world(5, |_, _| {}), &[0, 2, 4, 6]);
    let v = json_of(&report);
    assert_eq!(
        v["communicators"],
        json!([{
            "name": "dp", "ranks": [0, 2, 4, 6],
            "last_completed": {"0": 4, "2": 4, "4": 4, "6": 4},
            "stuck_at": null, "stuck_op": null, "missing_ranks": [], "waiting_ranks": [],
            "mismatches": [], "no_log_ranks": []
        }])
    );
    assert_eq!(v["ranks"], json!([0, 2, 4, 6]));
    assert_eq!(v["missing_files"], json!([]));
    assert_eq!(
        report.summary,
        "every rank completed the same operations on every communicator: no divergence"
    );
    assert!(
        report.to_text().contains("not stuck"),
        "{}",
        report.to_text()
    );
}

#[test]
fn killed_rank_with_its_file_missing() {
    // Rank 4 died after step 2 (3 all-reduces); the others entered #3 and waited.
    let mut dumps = dp_world(3, |r, rank| {
        if r != 4 {
            rank.hang(0, ar(1024));
        }
    });
    dumps[2].1 = None;
    let report = analyze(dumps, &[0, 2, 4, 6]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(3));
    assert_eq!(c.missing_ranks, [4]);
    assert_eq!(c.waiting_ranks, [0, 2, 6]);
    assert_eq!(c.no_log_ranks, [4]);
    assert_eq!(c.last_completed.get(&4), Some(&None));
    assert_eq!(c.last_completed.get(&0), Some(&Some(2)));
    assert_eq!(report.missing_files, [4]);
    assert!(c.mismatches.is_empty());
    assert_eq!(
        report.summary,
        "rank 4 never entered all_reduce #3 on communicator dp[0, 2, 4, 6]; \
         ranks 0, 2, 6 waited in it (no file from rank 4)"
    );
    let text = report.to_text();
    assert!(text.contains("rank 4: no file"), "{text}");
    assert!(text.contains("stuck at #3 all_reduce"), "{text}");
    assert!(text.contains("never entered: 4"), "{text}");
}

#[test]
fn a_rank_missing_from_the_expected_world_is_a_missing_file() {
    // No entry at all for rank 6: the expected world says it should be there.
    let dumps: Vec<_> = dp_world(2, |_, _| {})
        .into_iter()
        .filter(|(r, _)| *r != 6)
        .collect();
    let report = analyze(dumps, &[0, 2, 4, 6]);
    assert_eq!(report.missing_files, [6]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, None);
    assert_eq!(c.missing_ranks, [6]);
    assert_eq!(
        report.summary,
        "the ranks with a log completed the same operations on every communicator; \
         no file from rank 6, so where that rank stopped is unknown"
    );
}

#[test]
fn killed_rank_whose_last_record_was_never_completed() {
    // Everyone entered #3; rank 6 died inside it (its dump, from an earlier SIGUSR1, shows it
    // started), the others timed out.
    let dumps = dp_world(3, |r, rank| {
        let h = rank.hang(0, ar(1024));
        if r != 6 {
            rank.logs[0].fail(h, "timed out after 30 s");
        }
    });
    let report = analyze(dumps, &[0, 2, 4, 6]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(3));
    assert!(c.missing_ranks.is_empty());
    assert_eq!(c.waiting_ranks, [0, 2, 4, 6]);
    assert_eq!(
        report.summary,
        "ranks 0, 2, 4, 6 waited in all_reduce #3 on communicator dp[0, 2, 4, 6] \
         and none of its members is missing from it"
    );
}

#[test]
fn a_rank_that_skipped_a_collective() {
    // Step: all_reduce then broadcast. Rank 2 skips the all_reduce of step 1, so its #2 is the
    // broadcast while the others' #2 is the all_reduce.
    let dumps = dp_world(0, |r, rank| {
        rank.done(0, ar(8));
        rank.done(0, bc(0));
        if r == 2 {
            rank.hang(0, bc(0));
        } else {
            rank.hang(0, ar(8));
        }
    });
    let report = analyze(dumps, &[0, 2, 4, 6]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(2));
    assert!(c.missing_ranks.is_empty());
    let v = json_of(&report);
    assert_eq!(
        v["communicators"][0]["mismatches"],
        json!([{"seq": 2, "field": "op",
                "values": {"0": "all_reduce", "2": "broadcast", "4": "all_reduce", "6": "all_reduce"}}])
    );
    assert_eq!(
        report.summary,
        "rank 2 recorded op broadcast at #2 on communicator dp[0, 2, 4, 6] \
         where ranks 0, 4, 6 recorded all_reduce"
    );
}

#[test]
fn a_rank_that_skipped_a_collective_and_waits_elsewhere() {
    // Rank 6 skips the tp all-reduce and goes on to the dp one, where the others never arrive.
    let comms: [(&str, &[usize]); 2] = [("tp", &[0, 6]), ("dp", &[0, 6])];
    let dumps: Vec<_> = [0usize, 6]
        .iter()
        .map(|&r| {
            // Rank 6 runs later: its hang is posted after rank 0's.
            std::thread::sleep(std::time::Duration::from_millis(2));
            let rank = Rank::new(r, &comms, 16);
            rank.done(0, ar(4));
            rank.done(1, ar(4));
            if r == 0 {
                rank.hang(0, ar(4));
            } else {
                rank.hang(1, ar(4));
            }
            (r, Some(rank.dump()))
        })
        .collect();
    let report = analyze(dumps, &[0, 6]);
    let dp = &report.communicators[0];
    let tp = &report.communicators[1];
    assert_eq!((dp.name.as_str(), tp.name.as_str()), ("dp", "tp"));
    assert_eq!((tp.stuck_at, tp.missing_ranks.clone()), (Some(1), vec![6]));
    assert_eq!((dp.stuck_at, dp.missing_ranks.clone()), (Some(1), vec![0]));
    // Both hangs have a culprit; the summary names the earliest (tp's #1, posted first).
    assert_eq!(
        report.summary,
        "rank 6 never entered all_reduce #1 on communicator tp[0, 6]; rank 0 waited in it"
    );
}

#[test]
fn count_dtype_root_and_reduce_op_mismatches() {
    let dumps = dp_world(1, |r, rank| {
        // #1: count differs on rank 4. #2: dtype differs on rank 6. #3: root differs on
        // rank 0. #4: reduction differs on ranks 2 and 4 (a tie: the smaller value wins).
        rank.done(0, ar(if r == 4 { 999 } else { 1000 }));
        rank.done(
            0,
            OpDesc::new("all_reduce")
                .dtype(if r == 6 { "bf16" } else { "f32" })
                .count(10)
                .reduce_op("sum"),
        );
        rank.done(0, bc(if r == 0 { 1 } else { 0 }));
        rank.done(
            0,
            OpDesc::new("reduce")
                .dtype("f32")
                .count(3)
                .root(0)
                .reduce_op(if r == 2 || r == 4 { "max" } else { "sum" }),
        );
    });
    let report = analyze(dumps, &[0, 2, 4, 6]);
    let v = json_of(&report);
    assert_eq!(
        v["communicators"][0]["mismatches"],
        json!([
            {"seq": 1, "field": "count", "values": {"0": 1000, "2": 1000, "4": 999, "6": 1000}},
            {"seq": 2, "field": "dtype", "values": {"0": "f32", "2": "f32", "4": "f32", "6": "bf16"}},
            {"seq": 3, "field": "root", "values": {"0": 1, "2": 0, "4": 0, "6": 0}},
            {"seq": 4, "field": "reduce_op", "values": {"0": "sum", "2": "max", "4": "max", "6": "sum"}}
        ])
    );
    assert_eq!(v["communicators"][0]["stuck_at"], Value::Null);
    assert_eq!(
        report.summary,
        "rank 4 recorded count 999 at #1 on communicator dp[0, 2, 4, 6] \
         where ranks 0, 2, 6 recorded 1000"
    );
    let text = report.to_text();
    assert!(
        text.contains("mismatch at #3: root differs: rank 0 1, rank 2 0, rank 4 0, rank 6 0"),
        "{text}"
    );
}

#[test]
fn send_recv_pairs_are_not_mismatches() {
    // A 4-rank pipeline communicator: at each seq, group rank 2k sends to 2k+1, which receives.
    let pp: (&str, &[usize]) = ("pp", &[10, 11, 12, 13]);
    let dumps: Vec<_> = (0..4usize)
        .map(|g| {
            let rank = Rank::new(10 + g, &[pp], 16);
            let peer = g ^ 1;
            let op = if g % 2 == 0 { "send" } else { "irecv" };
            rank.done(0, OpDesc::new(op).dtype("bf16").count(64).peer(peer).tag(3));
            rank.done(0, ar(1));
            (10 + g, Some(rank.dump()))
        })
        .collect();
    let report = analyze(dumps, &[]);
    assert_eq!(report.ranks, [10, 11, 12, 13]);
    let c = &report.communicators[0];
    assert!(c.mismatches.is_empty(), "{:?}", c.mismatches);
    assert_eq!(c.stuck_at, None);
}

#[test]
fn point_to_point_mismatches() {
    let pp: (&str, &[usize]) = ("pp", &[0, 1, 2]);
    // #0: 0 sends to 1, 1 sends to 0 (both send: op). #1: 0 sends to 1, 1 receives from 2
    // (peer). #2: 0 sends 64 to 1, 1 receives 32 (count). #3: 2 sends to group rank 7 (peer out
    // of range). #4: 0 sends to 1 while 1 is in an all_reduce (op).
    let plan: [[OpDesc; 3]; 5] = [
        [
            OpDesc::new("send").count(8).peer(1),
            OpDesc::new("send").count(8).peer(0),
            ar(1),
        ],
        [
            OpDesc::new("send").count(8).peer(1),
            OpDesc::new("recv").count(8).peer(2),
            OpDesc::new("send").count(8).peer(1),
        ],
        [
            OpDesc::new("send").count(64).peer(1),
            OpDesc::new("recv").count(32).peer(0),
            // An exchange with itself: consistent, and no collective at this seq.
            OpDesc::new("send_recv").count(8).peer(2),
        ],
        [
            OpDesc::new("recv").count(8).peer(1),
            OpDesc::new("send").count(8).peer(0),
            OpDesc::new("send").count(8).peer(7),
        ],
        [OpDesc::new("send").count(8).peer(1), ar(1), ar(1)],
    ];
    let dumps: Vec<_> = (0..3usize)
        .map(|r| {
            let rank = Rank::new(r, &[pp], 16);
            for step in &plan {
                rank.done(0, step[r]);
            }
            (r, Some(rank.dump()))
        })
        .collect();
    let report = analyze(dumps, &[0, 1, 2]);
    let v = json_of(&report);
    let got: Vec<(u64, String)> = report.communicators[0]
        .mismatches
        .iter()
        .map(|m| (m.seq, m.field.to_string()))
        .collect();
    assert_eq!(
        got,
        [
            (0, "op".to_string()),
            (1, "peer".to_string()),
            (2, "count".to_string()),
            (3, "peer".to_string()),
            (4, "op".to_string())
        ],
        "{v}"
    );
    let m = &v["communicators"][0]["mismatches"];
    // At #0 there is a collective on rank 2 beside the two sends: the op field, all three.
    assert_eq!(
        m[0]["values"],
        json!({"0": "send", "1": "send", "2": "all_reduce"})
    );
    assert_eq!(m[1]["values"], json!({"0": 1, "1": 2}));
    assert_eq!(m[2]["values"], json!({"0": 64, "1": 32}));
    assert_eq!(m[3]["values"], json!({"2": 7}));
}

#[test]
fn two_sends_face_to_face_are_an_op_mismatch() {
    let pp: (&str, &[usize]) = ("pp", &[0, 1]);
    let dumps: Vec<_> = (0..2usize)
        .map(|r| {
            let rank = Rank::new(r, &[pp], 16);
            rank.hang(0, OpDesc::new("send").count(8).peer(1 - r));
            (r, Some(rank.dump()))
        })
        .collect();
    let report = analyze(dumps, &[0, 1]);
    let c = &report.communicators[0];
    assert_eq!(c.mismatches.len(), 1);
    assert_eq!(c.mismatches[0].field, "op");
    assert_eq!(c.stuck_at, Some(0));
    assert_eq!(c.waiting_ranks, [0, 1]);
    assert_eq!(
        report.summary,
        "the ranks disagree on op at #0 on communicator pp[0, 1]: rank 0 send, rank 1 send"
    );
}

#[test]
fn dropped_records_count_as_completed() {
    // Capacity 4: rank 0 completed #0..#9 and keeps #6..#9; rank 2 completed #0..#6 and hangs
    // in #7, keeping #4..#7. #4 and #5 are gone from rank 0's ring: counted as completed
    // there, so the first operation not completed by both is #7, where rank 2 waits.
    let comm: (&str, &[usize]) = ("dp", &[0, 2]);
    let r0 = Rank::new(0, &[comm], 4);
    for _ in 0..10 {
        r0.done(0, ar(1));
    }
    let r2 = Rank::new(2, &[comm], 4);
    for _ in 0..7 {
        r2.done(0, ar(1));
    }
    r2.hang(0, ar(1));
    let report = analyze(vec![(0, Some(r0.dump())), (2, Some(r2.dump()))], &[0, 2]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(7));
    assert_eq!(c.waiting_ranks, [2]);
    assert!(c.missing_ranks.is_empty());
    assert!(c.mismatches.is_empty());
    assert_eq!(c.last_completed.get(&0), Some(&Some(9)));
    assert_eq!(c.last_completed.get(&2), Some(&Some(6)));
}

#[test]
fn a_communicator_absent_from_a_rank_dump() {
    // Rank 1 never created "ep" (or already destroyed it): it has no log of it.
    let ep: (&str, &[usize]) = ("ep", &[0, 1]);
    let r0 = Rank::new(0, &[ep], 8);
    r0.hang(0, ar(2));
    let r1 = Rank::new(1, &[], 8);
    let report = analyze(vec![(0, Some(r0.dump())), (1, Some(r1.dump()))], &[0, 1]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(0));
    assert_eq!(c.missing_ranks, [1]);
    assert_eq!(c.no_log_ranks, [1]);
    assert!(report.missing_files.is_empty());
    assert_eq!(
        report.summary,
        "rank 1 never entered all_reduce #0 on communicator ep[0, 1]; rank 0 waited in it"
    );
}

#[test]
fn malformed_files_are_findings() {
    let mut inputs: Vec<(usize, RankInput)> = dp_world(1, |_, _| {})
        .into_iter()
        .map(|(r, d)| (r, RankInput::Dump(d.unwrap())))
        .collect();
    inputs[1].1 = RankInput::Malformed("rank-2.json: expected value at line 1 column 1".into());
    let report = analyze_inputs(inputs, &[0, 2, 4, 6]);
    let v = json_of(&report);
    assert_eq!(
        v["malformed_files"],
        json!([{"rank": 2, "error": "rank-2.json: expected value at line 1 column 1"}])
    );
    assert_eq!(v["missing_files"], json!([]));
    assert_eq!(v["communicators"][0]["no_log_ranks"], json!([2]));
    assert!(
        report.summary.contains("an unreadable file from rank 2"),
        "{}",
        report.summary
    );
    assert!(report.to_text().contains("rank 2: unreadable file"));
}

#[test]
fn no_dumps_at_all() {
    let report = analyze(vec![(0, None), (1, None)], &[0, 1]);
    assert!(report.communicators.is_empty());
    assert_eq!(report.missing_files, [0, 1]);
    assert_eq!(
        report.summary,
        "the ranks with a log completed the same operations on every communicator; \
         no file from ranks 0, 1, so where they stopped is unknown"
    );
}

#[test]
fn an_eager_send_completed_while_its_receiver_never_arrived() {
    let pp: (&str, &[usize]) = ("pp", &[0, 1]);
    let r0 = Rank::new(0, &[pp], 8);
    let r1 = Rank::new(1, &[pp], 8);
    r0.done(0, ar(2));
    r1.done(0, ar(2));
    r0.done(0, OpDesc::new("send").count(8).peer(1));
    let report = analyze(vec![(0, Some(r0.dump())), (1, Some(r1.dump()))], &[0, 1]);
    let c = &report.communicators[0];
    assert_eq!(c.stuck_at, Some(1));
    assert_eq!(c.stuck_op.as_deref(), Some("send"));
    assert_eq!(
        (c.missing_ranks.clone(), c.waiting_ranks.clone()),
        (vec![1], vec![])
    );
    assert_eq!(
        report.summary,
        "rank 1 never entered send #1 on communicator pp[0, 1]"
    );
}
