//! The backend-neutral conformance suite on MPI at 1, 2, 4 and 8 ranks, and at 2 and 4 ranks
//! with every collective checked (`GRID_DEBUG=detail`), so that every small collective of every
//! dtype and reduction also runs in its one-round form (the check and the data in one round of
//! messages, `backend_mpi::ROUND_MAX`, `PAIR_ROUND_MAX` at 2 ranks).

use backend_mpi::testing::{launch_with_env, under_launcher};
use backend_mpi::{mpi_test, MpiCommunicator, MpiFactory};
use grid_conformance::{run_with, Options};

fn suite(rt: &backend_mpi::MpiRuntime) -> Result<(), String> {
    let opts = Options::<MpiCommunicator> {
        finish: Some(Box::new(|c: &MpiCommunicator| c.finish())),
        mismatch_check: Some(grid_conformance::comm_mismatch_check()),
        ..Default::default()
    };
    let report = run_with(&MpiFactory::new(), rt.world(), &opts).map_err(|f| f.to_string())?;
    println!("{report}");
    Ok(())
}

mpi_test!(mpi_conformance_np1, np = 1, timeout = 120, suite);
mpi_test!(mpi_conformance_np2, np = 2, timeout = 120, suite);
mpi_test!(mpi_conformance_np4, np = 4, timeout = 180, suite);
mpi_test!(mpi_conformance_np8, np = 8, timeout = 300, suite);

// The suite again, run only by the launcher tests below (with every collective checked);
// otherwise it passes at once.
fn checked_suite(rt: &backend_mpi::MpiRuntime) -> Result<(), String> {
    if std::env::var("GRID_DEBUG").as_deref() != Ok("detail") {
        return Ok(());
    }
    suite(rt)
}

mpi_test!(
    mpi_conformance_checked_helper_np4,
    np = 4,
    timeout = 300,
    checked_suite
);
mpi_test!(
    mpi_conformance_checked_helper_np2,
    np = 2,
    timeout = 300,
    checked_suite
);

/// Runs helper `name` on `np` ranks with every collective checked.
fn with_every_collective_checked(np: usize, name: &str) {
    if under_launcher() {
        return;
    }
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let args = ["--exact", name, "--nocapture", "--test-threads=1"];
    let out = launch_with_env(np, 300, &exe, &args, &[("GRID_DEBUG", "detail")]).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.output);
    assert!(out.output.contains("passed"), "{}", out.output);
}

#[test]
fn mpi_conformance_with_every_collective_checked() {
    with_every_collective_checked(4, "mpi_conformance_checked_helper_np4");
}

#[test]
fn mpi_conformance_with_every_collective_checked_np2() {
    with_every_collective_checked(2, "mpi_conformance_checked_helper_np2");
}
