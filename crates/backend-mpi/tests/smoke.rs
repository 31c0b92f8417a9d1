//! Small end-to-end checks of the launcher and the backend, beyond the conformance suite.

use backend_mpi::testing::{launch_with_env, under_launcher};
use backend_mpi::{mpi_test, MpiFactory, MpiRuntime};
use grid_core::{Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp};

mpi_test!(mpi_smoke_np2, np = 2, timeout = 60, |rt| {
    let w = rt.world();
    let mut s = [0i64];
    w.all_reduce_into(&[w.rank() as i64 + 1][..], &mut s[..], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if s[0] != 3 {
        return Err(format!("sum {}", s[0]));
    }
    let f = MpiFactory::new();
    let g = f.create_group(w, &[1]).map_err(|e| e.to_string())?;
    if g.is_some() != (w.rank() == 1) {
        return Err("membership".into());
    }
    if f.calls().creates != 1 {
        return Err(format!("calls {:?}", f.calls()));
    }
    // A second initialisation is refused with a clear error.
    match MpiRuntime::init() {
        Err(Error::Invalid(m)) if m.contains("only once") => {}
        other => return Err(format!("second init: {other:?}")),
    }
    // A receive that gets fewer elements than its buffer holds is an error, not silent.
    if w.rank() == 0 {
        w.send_to(&[1i32, 2][..], 1, 5).map_err(|e| e.to_string())?;
    } else {
        let mut buf = [0i32; 3];
        match w.recv_from(&mut buf[..], 0, 5) {
            Err(Error::LengthMismatch {
                expected: 3,
                actual: 2,
                ..
            }) => {}
            other => return Err(format!("short receive: {other:?}")),
        }
    }
    Ok(())
});

// Bodies that fail or hang on purpose, only when the launcher tests below ask for it.
mpi_test!(mpi_helper_fails_np2, np = 2, timeout = 60, |rt| {
    if std::env::var("BACKEND_MPI_SELFTEST").as_deref() == Ok("fail") && rt.world().rank() == 1 {
        return Err("deliberate failure on rank 1".into());
    }
    rt.world().barrier().map_err(|e| e.to_string())
});

mpi_test!(mpi_helper_hangs_np2, np = 2, timeout = 60, |rt| {
    let w = rt.world();
    if std::env::var("BACKEND_MPI_SELFTEST").as_deref() == Ok("hang") && w.rank() == 0 {
        let mut never = [0u8];
        w.recv_from(&mut never[..], 1, 99)
            .map_err(|e| e.to_string())?;
    }
    w.barrier().map_err(|e| e.to_string())
});

// A count of 65536 against 4 made one rank segfault inside Open MPI's all-reduce; with
// mismatch checking on, both ranks get the typed error naming both counts, and the
// communicator stays usable (nothing reached MPI).
mpi_test!(
    mpi_mismatch_check_catches_a_count_mismatch_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let w = rt.world();
        if std::env::var_os("GRID_DEBUG").is_none() {
            // The MPI default: collectives of at least 2 KiB on a rank are checked.
            if w.mismatch_check() != grid_core::MismatchCheck::Above(backend_mpi::CHECK_THRESHOLD) {
                return Err(format!("default mode {:?}", w.mismatch_check()));
            }
            let n = if w.rank() == 0 { 16384 } else { 32768 };
            match w.all_reduce_in_place(&mut vec![1i32; n][..], ReduceOp::Sum) {
                Err(Error::CollectiveMismatch { field: "count", .. }) => {}
                other => return Err(format!("64 KiB against 128 KiB by default: {other:?}")),
            }
        }
        w.set_mismatch_check(grid_core::MismatchCheck::All);
        let n = if w.rank() == 0 { 4 } else { 65536 };
        let mut v = vec![1i32; n];
        match w.all_reduce_in_place(&mut v[..], ReduceOp::Sum) {
            Err(Error::CollectiveMismatch {
                op: "all_reduce",
                field: "count",
                values,
                ..
            }) if values == [(0, "4".to_string()), (1, "65536".to_string())] => {}
            other => return Err(format!("count 4 against 65536: {other:?}")),
        }
        // Same-size disagreements that MPI itself cannot see: element type and broadcast root.
        let r = if w.rank() == 0 {
            w.all_reduce_in_place(&mut [1f32; 4][..], ReduceOp::Sum)
        } else {
            w.all_reduce_in_place(&mut [1i32; 4][..], ReduceOp::Sum)
        };
        if !matches!(r, Err(Error::CollectiveMismatch { field: "dtype", .. })) {
            return Err(format!("f32 against i32: {r:?}"));
        }
        let r = w.broadcast_into(&mut [0u8; 8][..], w.rank());
        if !matches!(r, Err(Error::CollectiveMismatch { field: "root", .. })) {
            return Err(format!("different roots: {r:?}"));
        }
        let mut s = [w.rank() as i64 + 1];
        w.all_reduce_in_place(&mut s[..], ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if s[0] != 3 {
            return Err(format!("sum after the mismatches: {}", s[0]));
        }
        Ok(())
    }
);

fn self_exe() -> String {
    std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[test]
fn mpi_launcher_reports_the_failing_rank() {
    if under_launcher() {
        return;
    }
    let args = [
        "--exact",
        "mpi_helper_fails_np2",
        "--nocapture",
        "--test-threads=1",
    ];
    let out = launch_with_env(
        2,
        60,
        &self_exe(),
        &args,
        &[("BACKEND_MPI_SELFTEST", "fail")],
    )
    .unwrap();
    assert_ne!(out.code, Some(0), "{}", out.output);
    assert!(
        out.output
            .contains("[rank 1/2] FAILED: deliberate failure on rank 1"),
        "{}",
        out.output
    );
}

#[test]
fn mpi_launcher_kills_a_deadlock() {
    if under_launcher() {
        return;
    }
    let args = [
        "--exact",
        "mpi_helper_hangs_np2",
        "--nocapture",
        "--test-threads=1",
    ];
    let out = launch_with_env(
        2,
        3,
        &self_exe(),
        &args,
        &[("BACKEND_MPI_SELFTEST", "hang")],
    )
    .unwrap();
    assert_eq!(
        out.code,
        Some(110),
        "mpirun --timeout exits with 110: {}",
        out.output
    );
    assert!(out.elapsed.as_secs() < 30, "{:?}", out.elapsed);
}

// An MPI failure keeps its cause: the backend, the operation, the communicator, MPI's error
// code and class. A receive buffer shorter than the message is MPI_ERR_TRUNCATE.
mpi_test!(
    mpi_library_errors_keep_their_cause_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let w = rt.world();
        if w.rank() == 0 {
            w.send_to(&[1i32, 2, 3, 4][..], 1, 6)
                .map_err(|e| e.to_string())?;
        } else {
            let mut short = [0i32; 2];
            match w.recv_from(&mut short[..], 0, 6) {
                Err(Error::Library(l)) => {
                    let ok = l.backend == "mpi"
                        && l.op == "recv"
                        && l.comm == "world"
                        && l.code.is_some()
                        && l.class.as_deref().is_some_and(|c| c.contains("TRUNCATE"));
                    if !ok {
                        return Err(format!("library error without its cause: {l:?}"));
                    }
                    let e = Error::Library(l);
                    if !e.is_communication() {
                        return Err("a library error must be a communication error".into());
                    }
                }
                other => return Err(format!("truncated receive: {other:?}")),
            }
        }
        w.barrier().map_err(|e| e.to_string())
    }
);

// The transport settings `MpiRuntime::init` chooses before MPI_Init (only when the launcher
// test below asks, through BACKEND_MPI_EXPECT_FRAGMENTS): the copy-path fragment size, or the
// user's own choice left alone; and a 1 MiB message (eight fragments of 128 KiB) arrives intact.
mpi_test!(
    mpi_helper_transport_settings_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let Ok(want) = std::env::var("BACKEND_MPI_EXPECT_FRAGMENTS") else {
            return Ok(());
        };
        let got = std::env::var(backend_mpi::FRAGMENT_SIZE_VAR).unwrap_or_else(|_| "unset".into());
        if got != want {
            return Err(format!(
                "{}: {got}, expected {want}",
                backend_mpi::FRAGMENT_SIZE_VAR
            ));
        }
        let w = rt.world();
        let sent: Vec<u32> = (0..1u32 << 18).collect();
        if w.rank() == 0 {
            w.send_to(&sent[..], 1, 7).map_err(|e| e.to_string())?;
        } else {
            let mut got = vec![0u32; sent.len()];
            w.recv_from(&mut got[..], 0, 7).map_err(|e| e.to_string())?;
            if got != sent {
                return Err("the 1 MiB message arrived changed".into());
            }
        }
        Ok(())
    }
);

#[test]
fn mpi_runtime_picks_copy_fragments_unless_the_user_chose() {
    if under_launcher() {
        return;
    }
    use backend_mpi::{FRAGMENT_SIZE, FRAGMENT_SIZE_VAR, SINGLE_COPY_VAR};
    let segment = "OMPI_MCA_btl_vader_segment_size";
    let inherited = |k: &str| std::env::var(k).ok();
    // What the runtime should leave in FRAGMENT_SIZE_VAR, given what this test passes on top of
    // its own environment.
    let expect = |fragments: Option<&str>, segment_set: bool| -> String {
        if let Some(f) = fragments
            .map(str::to_string)
            .or_else(|| inherited(FRAGMENT_SIZE_VAR))
        {
            return f;
        }
        let copy_path = inherited(SINGLE_COPY_VAR).is_none_or(|v| v == "none");
        if copy_path && !segment_set && inherited(segment).is_none() {
            FRAGMENT_SIZE.to_string()
        } else {
            "unset".into()
        }
    };
    let args = [
        "--exact",
        "mpi_helper_transport_settings_np2",
        "--nocapture",
        "--test-threads=1",
    ];
    let check = |what: &str, env: &[(&str, &str)], want: String| {
        let mut env = env.to_vec();
        env.push(("BACKEND_MPI_EXPECT_FRAGMENTS", &want));
        let out = launch_with_env(2, 60, &self_exe(), &args, &env).unwrap();
        assert_eq!(out.code, Some(0), "{what}: {}", out.output);
    };
    check("nothing chosen", &[], expect(None, false));
    check(
        "the user's fragment size",
        &[(FRAGMENT_SIZE_VAR, "65536")],
        expect(Some("65536"), false),
    );
    check(
        "the user's segment size",
        &[(segment, "8388608")],
        expect(None, true),
    );
}
