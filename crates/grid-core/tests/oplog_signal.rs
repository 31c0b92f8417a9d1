//! SIGUSR1 makes the recorder dump (from its helper thread, not from the signal handler), and
//! concurrent recording from several threads loses nothing. Its own test binary: the signal
//! handler is process-wide.

#![cfg(unix)]

use grid_core::oplog::{OpDesc, OpState, Recorder, TraceDump};
use std::time::{Duration, Instant};

#[test]
fn sigusr1_dumps_every_live_log() {
    let dir = std::env::temp_dir().join(format!("grid-oplog-sigusr1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let recorder: &'static Recorder = Box::leak(Box::new(
        Recorder::new(Some(dir.clone()), 128).expect("a recorder"),
    ));
    recorder.set_world_rank(5);
    recorder
        .install_sigusr1_dump()
        .expect("the handler installs");
    recorder
        .install_sigusr1_dump()
        .expect("a second install is harmless");
    let log = recorder.register("tp", vec![4, 5]);

    // Four threads record 100 operations each on the same log.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for i in 0..100 {
                    let h = log.begin(OpDesc::new("all_gather").dtype("bf16").count(i));
                    log.mark_started(h);
                    log.complete(h);
                }
            });
        }
    });
    let stuck = log.begin(OpDesc::new("all_reduce").dtype("f32").count(3));
    log.mark_started(stuck);

    let status = std::process::Command::new("kill")
        .args(["-USR1", &std::process::id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let path = dir.join("rank-5.json");
    let deadline = Instant::now() + Duration::from_secs(20);
    let dump = loop {
        // The rename makes the file appear complete or not at all.
        if let Ok(text) = std::fs::read_to_string(&path) {
            break TraceDump::from_json(&text).expect("a complete dump");
        }
        assert!(
            Instant::now() < deadline,
            "no dump at {} after SIGUSR1",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!((dump.rank, dump.reason.as_str()), (5, "SIGUSR1"));
    assert_eq!(dump.pid, std::process::id());
    assert_eq!(dump.version, 1);
    let c = &dump.communicators[0];
    assert_eq!((c.name.as_str(), c.ranks.clone()), ("tp", vec![4, 5]));
    assert_eq!((c.posted, c.capacity, c.records.len()), (401, 128, 128));
    let seqs: Vec<u64> = c.records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (273..401).collect::<Vec<u64>>());
    assert!(c.records[..127]
        .iter()
        .all(|r| r.state == OpState::Completed));
    assert_eq!(c.records[127].state, OpState::Started);
    // No temporary file is left behind.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("the dump directory")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    assert_eq!(names, ["rank-5.json"]);
    std::fs::remove_dir_all(&dir).expect("clean up");
}
