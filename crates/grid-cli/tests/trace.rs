//! `grid trace DIR` on a directory written by grid-core's `Recorder::dump_to`: text and JSON,
//! a missing and a malformed rank file as findings, and the exit status 2 of a DIR that cannot
//! be read or holds no rank files.

use grid_core::oplog::{OpDesc, Recorder};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_grid"))
        .args(args)
        .output()
        .expect("the grid binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("grid-trace-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// Ranks 0..4 of a job with `dp` = [0, 1, 2, 3] and `tp` = [0, 1] / [2, 3]: 3 training steps
/// (tp all-gather, dp all-reduce), then ranks 0, 1 and 3 enter the dp all-reduce of step 4
/// and rank 2 does not: it stopped after its tp all-gather. Every rank but `skip` dumps.
fn write_job(dir: &Path, skip: Option<usize>) {
    for rank in 0..4usize {
        if Some(rank) == skip {
            continue;
        }
        let rec = Recorder::new(None, 1024).expect("a recorder");
        rec.set_world_rank(rank);
        let tp_ranks = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let tp = rec.register("tp", tp_ranks);
        let dp = rec.register("dp", vec![0, 1, 2, 3]);
        let ag = OpDesc::new("all_gather").dtype("bf16").count(4096);
        let ar = OpDesc::new("all_reduce")
            .dtype("f32")
            .count(1 << 20)
            .reduce_op("sum");
        for _ in 0..3 {
            let h = tp.begin(ag);
            tp.complete(h);
            let h = dp.begin(ar);
            dp.mark_started(h);
            dp.complete(h);
        }
        let h = tp.begin(ag);
        tp.complete(h);
        if rank != 2 {
            let h = dp.begin(ar);
            dp.mark_started(h);
            dp.fail(h, "timed out after 600 s");
        }
        rec.dump_to(dir, "timeout").expect("the dump is written");
    }
}

#[test]
fn trace_of_a_recorder_dump_text_and_json() {
    let dir = temp_dir("job");
    write_job(&dir, None);
    let d = dir.to_str().expect("a UTF-8 path");
    let (code, out, err) = run(&["trace", d]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert_eq!(
        out,
        "4 ranks expected (0, 1, 2, 3), 4 logs read

communicator dp[0, 1, 2, 3] (4 ranks)
  last completed: 0: #2, 1: #2, 2: #2, 3: #2
  stuck at #3 all_reduce
  never entered: 2
  waiting in it: 0, 1, 3

communicator tp[0, 1] (2 ranks)
  last completed: 0: #3, 1: #3
  not stuck: every member with a log completed the same operations

communicator tp[2, 3] (2 ranks)
  last completed: 2: #3, 3: #3
  not stuck: every member with a log completed the same operations

summary: rank 2 never entered all_reduce #3 on communicator dp[0, 1, 2, 3]; ranks 0, 1, 3 waited in it
"
    );
    let (code, out, err) = run(&["trace", d, "--format", "json"]);
    assert_eq!((code, err.as_str()), (0, ""));
    let v: Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["ranks"], json!([0, 1, 2, 3]));
    assert_eq!(v["missing_files"], json!([]));
    assert_eq!(
        v["communicators"][0],
        json!({
            "name": "dp", "ranks": [0, 1, 2, 3],
            "last_completed": {"0": 2, "1": 2, "2": 2, "3": 2},
            "stuck_at": 3, "stuck_op": "all_reduce",
            "missing_ranks": [2], "waiting_ranks": [0, 1, 3],
            "mismatches": [], "no_log_ranks": []
        })
    );
    assert_eq!(v["communicators"][1]["stuck_at"], Value::Null);
    assert_eq!(
        v["summary"],
        "rank 2 never entered all_reduce #3 on communicator dp[0, 1, 2, 3]; ranks 0, 1, 3 waited in it"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn missing_and_malformed_files_are_findings() {
    let dir = temp_dir("findings");
    // Rank 2 died without a dump; rank 3's file is cut short; other files are ignored.
    write_job(&dir, Some(2));
    let r3 = dir.join("rank-3.json");
    let text = std::fs::read_to_string(&r3).expect("rank 3's dump");
    std::fs::write(&r3, &text[..text.len() / 2]).expect("truncate");
    std::fs::write(dir.join("notes.txt"), "not a dump").expect("write");
    let d = dir.to_str().expect("a UTF-8 path");
    let (code, out, err) = run(&["trace", d, "--format", "json"]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    let v: Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["ranks"], json!([0, 1, 2, 3]));
    assert_eq!(v["missing_files"], json!([2]));
    assert_eq!(v["malformed_files"][0]["rank"], 3);
    let dp = &v["communicators"][0];
    assert_eq!(dp["stuck_at"], 3);
    assert_eq!(dp["missing_ranks"], json!([2, 3]));
    assert_eq!(dp["waiting_ranks"], json!([0, 1]));
    assert_eq!(dp["no_log_ranks"], json!([2, 3]));
    assert_eq!(
        v["summary"],
        "ranks 2, 3 never entered all_reduce #3 on communicator dp[0, 1, 2, 3]; \
         ranks 0, 1 waited in it (no file from rank 2 and an unreadable file from rank 3)"
    );
    let (code, out, _) = run(&["trace", d]);
    assert_eq!(code, 0);
    assert!(out.contains("rank 2: no file"), "{out}");
    let bad = out
        .lines()
        .find(|l| l.starts_with("rank 3: unreadable file: "))
        .unwrap_or_else(|| panic!("no line for rank 3: {out}"));
    assert!(bad.contains("rank-3.json: not a trace dump: EOF"), "{bad}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn a_file_whose_rank_disagrees_with_its_name() {
    let dir = temp_dir("renamed");
    write_job(&dir, None);
    std::fs::rename(dir.join("rank-3.json"), dir.join("rank-7.json")).expect("rename");
    let (code, out, _) = run(&["trace", dir.to_str().expect("UTF-8"), "--format", "json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["ranks"], json!([0, 1, 2, 3, 7]));
    assert_eq!(v["missing_files"], json!([3]));
    let m = v["malformed_files"][0]["error"].as_str().expect("an error");
    assert!(
        m.ends_with("the file says rank 3, its name says rank 7"),
        "{m}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn unreadable_or_empty_dir_exits_2_with_one_line() {
    let dir = temp_dir("empty");
    std::fs::write(dir.join("rank-x.json"), "{}").expect("write");
    let d = dir.to_str().expect("UTF-8").to_string();
    let (code, out, err) = run(&["trace", &d]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert_eq!(
        err,
        format!(
            "grid: error: grid trace: no rank files in {d} (expected rank-<world rank>.json, \
             as written with GRID_TRACE_DIR={d})\n"
        )
    );
    let missing = dir.join("nope");
    let m = missing.to_str().expect("UTF-8");
    let (code, out, err) = run(&["trace", m, "--format", "json"]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert!(
        err.starts_with(&format!(
            "grid: error: grid trace: cannot read directory {m}: "
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let (code, _, err) = run(&["trace"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("grid: error: grid trace: DIR is required"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}
