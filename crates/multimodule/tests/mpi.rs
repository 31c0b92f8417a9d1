//! The same data checks on MPI: each test re-launches this binary under `mpirun -np 8`
//! (`backend_mpi::mpi_test!`), shared memory and loopback only.

mod common;
use backend_mpi::{mpi_test, MpiFactory};
use common::check::l3;
use common::check::{grid, plan_of, run_rank, Case, Layout};
use common::scenarios::{two_encoders_rank, two_encoders_spec, TWO_ENCODERS_PER_MB};
use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};
use multimodule::{BridgeCommunicator, DimMapping, PipelinePlan};
use std::sync::Arc;

/// An owned world communicator (a split of the runtime's world with one colour).
fn world(
    rt: &backend_mpi::MpiRuntime,
    f: &MpiFactory,
) -> Result<Arc<backend_mpi::MpiCommunicator>, String> {
    let w = rt.world();
    f.split(w, Some(0), w.rank())
        .map_err(|e| e.to_string())?
        .map(Arc::new)
        .ok_or_else(|| "split returned no communicator".to_string())
}

mpi_test!(
    mpi_two_encoders_llm_generator,
    np = 8,
    timeout = 120,
    |rt| {
        let f = MpiFactory::new();
        let w = world(rt, &f)?;
        let rank = w.rank();
        let spec = two_encoders_spec();
        let plan = PipelinePlan::new(&spec).unwrap();
        let n = 4;
        let mine = two_encoders_rank(&f, w.clone(), &plan, rank, n) as i64;
        let mut total = [0i64];
        w.all_reduce_into(&[mine][..], &mut total[..], ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if total[0] as usize != n * TWO_ENCODERS_PER_MB {
            return Err(format!(
                "checked {} elements, expected {}",
                total[0],
                n * TWO_ENCODERS_PER_MB
            ));
        }
        Ok(())
    }
);

mpi_test!(mpi_bridge_cases, np = 8, timeout = 180, |rt| {
    let f = MpiFactory::new();
    let w = world(rt, &f)?;
    let rank = w.rank();
    let l2 = Layout {
        ndim: 2,
        dm: DimMapping::default(),
        seq: 1,
        hidden: 4,
    };
    let mk = |src, dst, layout, batches: Vec<usize>, fused| Case {
        src,
        dst,
        layout,
        batches,
        microbatches: 3,
        fused,
        rendezvous: false,
    };
    for fused in [false, true] {
        let cases = vec![
            mk(
                grid(1, 1, 1, 4, 0),
                grid(4, 1, 1, 1, 4),
                l3(2),
                vec![2; 4],
                fused,
            ),
            mk(
                grid(2, 1, 1, 2, 0),
                grid(1, 1, 1, 4, 4),
                l3(2),
                vec![5, 5],
                fused,
            ),
            mk(
                grid(2, 1, 1, 1, 0),
                grid(2, 1, 1, 1, 2),
                l3(3),
                vec![3],
                fused,
            ),
            mk(
                grid(2, 1, 2, 1, 0),
                grid(1, 1, 2, 2, 4),
                l3(2),
                vec![4],
                fused,
            ),
            mk(
                grid(1, 1, 1, 4, 0),
                grid(4, 1, 1, 1, 4),
                l2,
                vec![5; 4],
                fused,
            ),
            mk(
                grid(1, 1, 1, 3, 0),
                grid(1, 1, 1, 2, 3),
                l3(2),
                vec![4; 3],
                fused,
            ),
            mk(
                grid(1, 2, 2, 1, 0),
                grid(2, 2, 1, 1, 4),
                l3(6),
                vec![3],
                fused,
            ),
            mk(
                grid(2, 1, 1, 2, 0),
                grid(1, 1, 1, 4, 0),
                l3(2),
                vec![4, 4],
                fused,
            ),
            mk(
                grid(2, 1, 2, 2, 0),
                grid(1, 1, 1, 4, 4),
                l3(2),
                vec![7, 3],
                fused,
            ),
        ];
        for (k, case) in cases.iter().enumerate() {
            // Every case runs on all 8 ranks; ranks outside both grids only build the bridge.
            let bridge = BridgeCommunicator::new(&f, w.clone(), plan_of(case), 40 + 8 * k as u32)
                .map_err(|e| e.to_string())?;
            let mine = if bridge.plan().src().contains(rank) || bridge.plan().dst().contains(rank) {
                run_rank(case, &bridge, rank)
            } else {
                0
            };
            let mut total = [0i64];
            w.all_reduce_into(&[mine as i64][..], &mut total[..], ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if total[0] == 0 {
                return Err(format!("case {k}: nothing checked"));
            }
        }
    }
    Ok(())
});
