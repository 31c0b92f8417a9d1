//! The backend-neutral conformance suite on MPI at 1, 2, 4 and 8 ranks, and at 4 ranks with
//! every collective checked (`GRID_DEBUG=detail`), so that every small collective of every
//! dtype and reduction also runs in its one-round form (the check and the data in one round of
//! messages, `backend_mpi::ROUND_MAX`).

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

// The suite again, run only by the launcher test below (with every collective checked);
// otherwise it passes at once.
mpi_test!(
    mpi_conformance_checked_helper_np4,
    np = 4,
    timeout = 300,
    |rt| {
        if std::env::var("GRID_DEBUG").as_deref() != Ok("detail") {
            return Ok(());
        }
        suite(rt)
    }
);

#[test]
fn mpi_conformance_with_every_collective_checked() {
    if under_launcher() {
        return;
    }
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let args = [
        "--exact",
        "mpi_conformance_checked_helper_np4",
        "--nocapture",
        "--test-threads=1",
    ];
    let out = launch_with_env(4, 300, &exe, &args, &[("GRID_DEBUG", "detail")]).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.output);
    assert!(out.output.contains("passed"), "{}", out.output);
}
