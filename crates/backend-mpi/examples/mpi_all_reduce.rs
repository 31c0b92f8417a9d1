//! Every communicator of a parallel layout over MPI, one process per rank, with an all-reduce
//! checked on each family.
//!
//! Run: `cargo build -p backend-mpi --example mpi_all_reduce && mpirun -np 4 target/debug/examples/mpi_all_reduce`
//!
//! (As root, Open MPI also wants `--allow-run-as-root`; on a machine with fewer cores than
//! ranks, `--oversubscribe`.) The layout is tensor parallel 2 × pipeline parallel 2, with data
//! parallel filling the rest, so the job needs a multiple of 4 ranks; any other count stops
//! with the layout's error on every rank.
//!
//! What a framework does at start-up, in four steps: initialise MPI, validate the layout (the
//! same on every rank), build this rank's communicator of every family with
//! `grid_core::build_collection` (one `MPI_Comm_split` per distinct family), and use them.

use backend_mpi::{MpiFactory, MpiRuntime};
use grid_core::{
    build_collection, Communicator, CommunicatorExt, Family, LayoutConfig, LayoutPlan, ReduceOp,
};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi_all_reduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), grid_core::Error> {
    // 1. MPI, once per process. Dropping the runtime at the end of `run` finalizes MPI.
    let runtime = MpiRuntime::init()?;
    let world = runtime.world();
    let (me, n) = (world.rank(), world.size());

    // 2. The layout, validated identically on every rank (it is pure arithmetic). A world size
    //    that tp · pp does not divide is an error naming both numbers.
    let mut config = LayoutConfig::new(n);
    config.tp = 2;
    config.pp = 2;
    let plan = LayoutPlan::new(config)?;

    // 3. This rank's communicator of every family. `build_collection` first checks that every
    //    rank holds the same plan, then splits the world once per distinct family (families
    //    with identical groups share one communicator).
    let built = build_collection(&MpiFactory::new(), world, &plan)?;

    // 4. Use them: in every family this rank belongs to, all-reduce the rank's world rank. The
    //    sum must be the sum of the members the plan computed for this rank's group.
    let (mut checked, mut failures) = (0i64, 0i64);
    for fl in plan.family_levels() {
        if fl.family == Family::Hcp {
            continue; // hierarchical cp levels exist only with `hcp_sizes`
        }
        let (Some(comm), Some(group)) = (
            built.collection.get(fl.family.name())?,
            plan.group_of(fl, me)?,
        ) else {
            continue; // not a member (the embedding families cover only some ranks)
        };
        checked += 1;
        let mut sum = [0i64];
        comm.all_reduce_into(&[me as i64][..], &mut sum[..], ReduceOp::Sum)?;
        let expected: i64 = group.iter().map(|r| r as i64).sum();
        if sum[0] != expected || comm.global_ranks() != group.sorted().as_slice() {
            eprintln!(
                "rank {me}: {fl}: sum {} over {:?}, expected {expected} over {:?}",
                sum[0],
                comm.global_ranks(),
                group.sorted()
            );
            failures += 1;
        }
    }

    // Every rank's counts, summed on the world communicator, so all ranks agree on the verdict.
    let mut total = [0i64; 2];
    world.all_reduce_into(&[checked, failures][..], &mut total[..], ReduceOp::Sum)?;
    if total[1] > 0 {
        return Err(grid_core::Error::Invalid(format!(
            "{} of {} family checks failed over {n} ranks",
            total[1], total[0]
        )));
    }
    if me == 0 {
        println!(
            "checked on {n} MPI ranks ({} families, {} communicators on rank 0): {} all-reduces, \
             each equal to the sum of the members of the plan's group",
            plan.family_levels().len(),
            built.communicators_created(),
            total[0]
        );
    }
    Ok(())
}
