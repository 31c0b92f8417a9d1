//! The communicator front end records every operation in its operation log (posted, started,
//! completed, failed) with the right sequence number, operation, dtype, count, root, peer and
//! tag, and dumps on a timeout; on backend-local (ranks as threads).
//!
//! One test in this file: it installs the process's recorder ([`Recorder::set_global`]).

use backend_local::{run, LocalConfig};
use grid_core::oplog::{OpRecord, OpState, Recorder, TraceDump};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::time::Duration;

fn rec(records: &[OpRecord], seq: u64) -> &OpRecord {
    records
        .iter()
        .find(|r| r.seq == seq)
        .unwrap_or_else(|| panic!("no record #{seq} in {records:#?}"))
}

#[test]
fn front_end_records_completed_and_failed_operations_and_dumps_on_timeout() {
    let dir = std::env::temp_dir().join(format!("grid-oplog-front-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Recorder::set_global(Recorder::new(Some(dir.clone()), 64).expect("a recorder"))
        .expect("nothing used the recorder before");

    let config = LocalConfig {
        timeout: Duration::from_millis(300),
        ..LocalConfig::default()
    };
    let logs = run(2, &config, |_, world| {
        let me = world.rank();
        // #0: a blocking all-reduce, completed.
        let mut out = [0f32; 4];
        world.all_reduce_into(&[1f32; 4][..], &mut out[..], ReduceOp::Sum)?;
        assert_eq!(out, [2.0; 4]);
        // Rejected by validation: the caller's bug, not recorded, no sequence number.
        let bad = world.all_reduce_into(&[1f32; 4][..], &mut [0f32; 3][..], ReduceOp::Sum);
        assert!(matches!(bad, Err(Error::LengthMismatch { .. })));
        // #1: broadcast from root 1.
        let mut b = [me as i64; 3];
        world.broadcast_into(&mut b[..], 1)?;
        // #2: point to point with a tag.
        if me == 0 {
            world.send_to(&[7u8; 5][..], 1, 42)?;
        } else {
            let mut r = [0u8; 5];
            world.recv_from(&mut r[..], 0, 42)?;
        }
        // #3: nonblocking; started until waited for, then completed.
        let work = world.iall_reduce(vec![1.5f64; 2], ReduceOp::Max)?;
        let pending = world.op_log().expect("the log is on by default").snapshot();
        let started = rec(&pending.records, 3);
        assert!(
            matches!(started.state, OpState::Started | OpState::Completed),
            "{started:?}"
        );
        assert_eq!(work.wait()?, vec![1.5; 2]);
        // #4: rank 1 waits for a message rank 0 never sends: a timeout, recorded as failed.
        if me == 1 {
            let e = world.recv_from(&mut [0i32; 2][..], 0, 9).unwrap_err();
            assert!(matches!(e, Error::Timeout { .. }), "{e}");
        }
        Ok(world.op_log().expect("the log is on").snapshot())
    })
    .expect("both ranks ran");

    for (rank, log) in logs.iter().enumerate() {
        assert_eq!(log.name, "world");
        assert_eq!(log.ranks, vec![0, 1]);
        let r = &log.records;
        assert_eq!(log.posted, if rank == 1 { 5 } else { 4 }, "{r:#?}");
        let seqs: Vec<u64> = r.iter().map(|x| x.seq).collect();
        assert_eq!(seqs, (0..log.posted).collect::<Vec<_>>());

        let a = rec(r, 0);
        assert_eq!(
            (
                a.op.as_str(),
                a.dtype.as_deref(),
                a.count,
                a.reduce_op.as_deref()
            ),
            ("all_reduce", Some("f32"), 4, Some("sum"))
        );
        assert_eq!((a.root, a.peer, a.tag), (None, None, None));
        assert_eq!(a.state, OpState::Completed);
        assert!(a.started_us.is_some() && a.ended_us.is_some());
        assert!(a.posted_us <= a.ended_us.unwrap_or(0));

        let b = rec(r, 1);
        assert_eq!(
            (b.op.as_str(), b.dtype.as_deref(), b.count, b.root),
            ("broadcast", Some("i64"), 3, Some(1))
        );
        assert_eq!(b.state, OpState::Completed);

        let p = rec(r, 2);
        let (op, peer) = if rank == 0 { ("send", 1) } else { ("recv", 0) };
        assert_eq!(
            (p.op.as_str(), p.dtype.as_deref(), p.count, p.peer, p.tag),
            (op, Some("u8"), 5, Some(peer), Some(42))
        );
        assert_eq!(p.state, OpState::Completed);

        let n = rec(r, 3);
        assert_eq!(
            (
                n.op.as_str(),
                n.dtype.as_deref(),
                n.count,
                n.reduce_op.as_deref()
            ),
            ("all_reduce", Some("f64"), 2, Some("max"))
        );
        assert_eq!(n.state, OpState::Completed);
        assert!(n.started_us.is_some() && n.ended_us.is_some());
    }
    let failed = rec(&logs[1].records, 4);
    assert_eq!(
        (
            failed.op.as_str(),
            failed.dtype.as_deref(),
            failed.count,
            failed.peer,
            failed.tag
        ),
        ("recv", Some("i32"), 2, Some(0), Some(9))
    );
    match &failed.state {
        OpState::Failed { reason } => assert!(reason.contains("timed out"), "{reason}"),
        other => panic!("expected failed, got {other:?}"),
    }

    // The timeout dumped the process's logs (both ranks are threads of this process: one file,
    // named after the world rank of the first communicator created).
    let rank = Recorder::global()
        .world_rank()
        .expect("set by the first communicator");
    assert!(rank < 2);
    let path = dir.join(format!("rank-{rank}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no dump at {}: {e}", path.display()));
    let dump = TraceDump::from_json(&text).expect("a valid dump");
    assert_eq!(dump.reason, "timeout");
    assert_eq!(dump.rank, rank);
    assert!(dump.communicators.iter().any(|c| c
        .records
        .iter()
        .any(|r| matches!(r.state, OpState::Failed { .. }))));
    assert_eq!(Recorder::global().dumps_written(), 1);
    std::fs::remove_dir_all(&dir).expect("remove the dump directory");
}
