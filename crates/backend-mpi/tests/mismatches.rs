//! Count mismatches in the operations of issue #16 item 7 (all-to-all-v, all-gather-v,
//! reduce-scatter-v, reduce, gather, scatter) with the default checking mode
//! (`MismatchCheck::Above(CHECK_THRESHOLD)`), under `mpirun`: no rank crashes or hangs, and no
//! rank returns success where MPI can tell that the data is wrong.
//!
//! * every rank at or above the 2 KiB threshold (the threshold counts the block of a rooted
//!   operation and the total of a vector one; an all-to-all-v is always checked):
//!   `Error::CollectiveMismatch` on every rank;
//! * ranks on both sides of it: the job ends at the time limit (exit code 124), nobody returns;
//! * every rank below it (every message eager): `MPI_ERR_TRUNCATE` on a rank that receives more
//!   than it expected, including a rooted gather of 8 ranks whose relays would carry larger
//!   messages if it ran as `MPI_Gather` (it runs as `MPI_Gatherv`);
//! * nonblocking operations (not checked under a threshold, see `grid_core::MismatchCheck`):
//!   `MPI_ERR_TRUNCATE` on the rank that receives too much.
//!
//! The `mpi_mismatch_helper_*` bodies misbehave on purpose only when the launcher test below
//! runs them with `BACKEND_MPI_SCENARIO` set; otherwise they pass at once.

use backend_mpi::testing::{launch_with_env, under_launcher};
use backend_mpi::{mpi_test, MpiRuntime, EXIT_TIMEOUT};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::time::Duration;

const OPS: [&str; 6] = [
    "all_to_all_v",
    "all_gather_v",
    "reduce_scatter_v",
    "reduce",
    "gather",
    "scatter",
];

/// Runs `op` with `m` elements per block on this rank (its view of every rank's count is `m`):
/// all-to-all-v sends and expects `m` per peer, all-gather-v contributes `m` and expects `m`
/// from everyone, reduce-scatter-v reduces blocks of `m`, reduce reduces `m` elements to rank
/// `root`, gather sends `m` to `root`, scatter receives `m` from `root`.
fn run<C: Communicator>(c: &C, op: &str, m: usize, root: usize) -> grid_core::Result<()> {
    let (me, n) = (c.rank(), c.size());
    let counts = vec![m; n];
    let send = vec![me as i32 + 1; m * n];
    let mut big = vec![0i32; m * n];
    let mut small = vec![0i32; m];
    match op {
        "all_to_all_v" => c.all_to_all_v_into(&send, &counts, &mut big, &counts),
        "all_gather_v" => c.all_gather_v_into(&send[..m], &mut big, &counts),
        "reduce_scatter_v" => c.reduce_scatter_v_into(&send, &counts, &mut small, ReduceOp::Sum),
        "reduce" => c.reduce_into(
            &send[..m],
            (me == root).then_some(&mut small[..]),
            ReduceOp::Sum,
            root,
        ),
        "gather" => c.gather_into(&send[..m], (me == root).then_some(&mut big[..]), root),
        "scatter" => c.scatter_into((me == root).then_some(&send[..]), &mut small, root),
        other => Err(Error::Invalid(format!("unknown operation {other}"))),
    }
}

// Every rank moves at least 2 KiB (1024 i32 against 1000): every rank checks, and every rank
// returns the same CollectiveMismatch, for every operation.
mpi_test!(
    mpi_item7_mismatch_above_the_threshold_np3,
    np = 3,
    timeout = 120,
    |rt| {
        let c = rt.world();
        let m = if c.rank() == 0 { 1024 } else { 1000 };
        for op in OPS {
            match run(c, op, m, 1) {
                Err(e @ Error::CollectiveMismatch { .. }) => {
                    if c.rank() == 0 {
                        println!("{op}: {e}");
                    }
                }
                other => return Err(format!("{op}: {other:?}")),
            }
        }
        // The communicator is still usable and in step.
        let mut s = [0i64];
        c.all_reduce_into(&[1i64][..], &mut s[..], ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if s[0] != 3 {
            return Err(format!("sum {}", s[0]));
        }
        Ok(())
    }
);

/// Expects an MPI truncation error on the rank that receives more than it posted.
fn truncated(what: &str, r: grid_core::Result<()>) -> Result<(), String> {
    match r {
        Err(Error::Library(l)) if l.to_string().contains("MPI_ERR_TRUNCATE") => {
            println!("{what}: {l}");
            Ok(())
        }
        other => Err(format!("{what}: expected MPI_ERR_TRUNCATE, got {other:?}")),
    }
}

// Every rank below the threshold: every message is eager, MPI reports the truncation on the
// rank that receives too much. Rank 0 contributes 200 i32 to an all-gather-v (1600 bytes in
// all), rank 1 expects 4 from it. (An all-to-all-v is always checked.)
mpi_test!(
    mpi_item7_mismatch_below_the_threshold_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let c = rt.world().with_time_limit(Duration::from_secs(20));
        let me = c.rank();
        let m = if me == 0 { 200 } else { 4 };
        // An all-to-all-v is checked whatever its size (no rank knows the others' sizes).
        match run(&c, "all_to_all_v", m, 0) {
            Err(Error::CollectiveMismatch { .. }) => {}
            other => return Err(format!("all_to_all_v: {other:?}")),
        }
        let r = run(&c, "all_gather_v", m, 0);
        if me == 1 {
            truncated("all_gather_v on rank 1", r)?;
        }
        Ok(())
    }
);

// A gather of 8 ranks, all below the threshold: the root expects 4 i32 from everyone (128
// bytes in all), the others send 500 (2000 bytes). As MPI_Gather (a binomial tree whose relays
// forward 4 blocks, 8000 bytes, past the eager limit) a relay crashed or hung; as MPI_Gatherv
// every rank sends straight to the root, which reports the truncation.
mpi_test!(
    mpi_item7_gather_mismatch_below_the_threshold_np8,
    np = 8,
    timeout = 120,
    |rt| {
        let c = rt.world().with_time_limit(Duration::from_secs(30));
        let me = c.rank();
        let m = if me == 0 { 4 } else { 500 };
        let r = run(&c, "gather", m, 0);
        if me == 0 {
            truncated("gather on the root", r)?;
        }
        Ok(())
    }
);

// Nonblocking operations are not checked under a threshold (a start never blocks for the
// check): the rank that receives too much gets MPI_ERR_TRUNCATE from `wait`, and no rank
// crashes (Open MPI copies through its own buffers: `MpiRuntime` sets
// btl_vader_single_copy_mechanism=none).
mpi_test!(
    mpi_item7_nonblocking_mismatch_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let c = rt.world().with_time_limit(Duration::from_secs(20));
        let me = c.rank();
        let m = if me == 0 { 65536 } else { 4 };
        let r = c
            .iall_to_all_v(vec![1i32; 2 * m], vec![m; 2], vec![m; 2])
            .and_then(|w| w.wait())
            .map(drop);
        if me == 1 {
            truncated("iall_to_all_v on rank 1", r)?;
        }
        let r = c
            .iall_gather_v(vec![1i32; m], vec![m; 2])
            .and_then(|w| w.wait())
            .map(drop);
        if me == 1 {
            truncated("iall_gather_v on rank 1", r)?;
        }
        Ok(())
    }
);

/// Runs scenario `name` of `mpi_mismatch_helper_np2` under mpirun.
fn scenario(name: &str, env: &[(&str, &str)]) -> backend_mpi::testing::LaunchOutput {
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let args = [
        "--exact",
        "mpi_mismatch_helper_np2",
        "--nocapture",
        "--test-threads=1",
    ];
    let mut all = vec![("BACKEND_MPI_SCENARIO", name)];
    all.extend_from_slice(env);
    match launch_with_env(2, 60, &exe, &args, &all) {
        Ok(o) => o,
        Err(err) => panic!("{name}: {err}"),
    }
}

fn helper(rt: &MpiRuntime) -> Result<(), String> {
    let c = rt.world();
    let me = c.rank();
    if std::env::var("BACKEND_MPI_SCENARIO").as_deref() != Ok("straddle") {
        return Ok(());
    }
    // Rank 0 at 65536 elements per block (checked), rank 1 at 4 (not checked); rank 1 is the
    // root of the rooted operations, except scatter (rank 0 is its root: the sender of the
    // large blocks).
    let op = std::env::var("OP").unwrap_or_default();
    let m = if me == 0 { 65536 } else { 4 };
    let root = if op == "scatter" { 0 } else { 1 };
    let r = run(
        &c.with_time_limit(Duration::from_millis(1000)),
        &op,
        m,
        root,
    );
    Err(format!("rank {me}: {op} of {m} returned {r:?}"))
}

mpi_test!(mpi_mismatch_helper_np2, np = 2, timeout = 60, helper);

// Ranks on both sides of the threshold: the checking rank waits in the check's exchange (on
// the duplicate communicator), the other in the real operation; neither meets the other's
// data, both reach the 1 s limit and the job ends with exit code 124, for every operation.
#[test]
fn mpi_job_item7_straddling_the_threshold_ends_cleanly() {
    if under_launcher() {
        return;
    }
    // An all-to-all-v is checked on every rank whatever its size: it cannot straddle.
    for op in &OPS[1..] {
        let out = scenario("straddle", &[("OP", op)]);
        assert_eq!(out.code, Some(EXIT_TIMEOUT), "{op}: {}", out.output);
        for bad in ["returned", "Segmentation fault", "FAILED:", "signal 11"] {
            assert!(!out.output.contains(bad), "{op}: {bad}:\n{}", out.output);
        }
        assert!(
            out.output
                .contains("did not complete within its time limit of 1000 ms (timeout)"),
            "{op}:\n{}",
            out.output
        );
    }
}
