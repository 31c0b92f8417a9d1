//! The backend-neutral conformance suite on MPI at 1, 2, 4 and 8 ranks.

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
