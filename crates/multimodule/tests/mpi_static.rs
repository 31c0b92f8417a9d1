//! Static and learned shapes on MPI (`mpirun -np 8`, re-launched by `backend_mpi::mpi_test!`):
//! exact data in both modes, and a tensor that does not match the static shape fails on its
//! sender and on its receiver without a hang.

mod common;
use backend_mpi::{mpi_test, MpiFactory};
use common::check::l3;
use common::check::{dst_rows, grid, plan_of, run_rank, value, Case};
use common::scenarios::{
    two_encoders_rank_with, two_encoders_spec, two_encoders_static_modes, TWO_ENCODERS_PER_MB,
};
use grid_core::{Communicator, CommunicatorExt, DType, GroupFactory, ReduceOp};
use multimodule::{BridgeCommunicator, Error, PipelinePlan, ShapeMode};
use std::sync::Arc;

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

fn sum(w: &backend_mpi::MpiCommunicator, mine: usize) -> Result<usize, String> {
    let mut total = [0i64];
    w.all_reduce_into(&[mine as i64][..], &mut total[..], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    Ok(total[0] as usize)
}

mpi_test!(mpi_static_shapes, np = 8, timeout = 180, |rt| {
    let f = MpiFactory::new();
    let w = world(rt, &f)?;
    let rank = w.rank();
    let mk = |src, dst, batches: Vec<usize>, fused| Case {
        src,
        dst,
        layout: l3(2),
        batches,
        microbatches: 3,
        fused,
        rendezvous: false,
    };
    let mut tag = 40;
    for fused in [false, true] {
        let cases = [
            mk(grid(1, 1, 1, 4, 0), grid(4, 1, 1, 1, 4), vec![2; 4], fused),
            mk(grid(2, 1, 1, 2, 0), grid(1, 1, 1, 4, 4), vec![5, 5], fused),
            mk(grid(2, 1, 2, 1, 0), grid(1, 1, 2, 2, 4), vec![4], fused),
            mk(grid(1, 1, 1, 3, 0), grid(1, 1, 1, 2, 3), vec![4; 3], fused),
        ];
        for (k, case) in cases.iter().enumerate() {
            let stat = ShapeMode::Static {
                shape: case.layout.shape(case.batches[0], 2),
                dtype: DType::F64,
            };
            for mode in [stat, ShapeMode::Learned] {
                let bridge = BridgeCommunicator::new(&f, w.clone(), plan_of(case), tag)
                    .and_then(|b| b.with_shape_mode(mode))
                    .map_err(|e| e.to_string())?;
                tag += 8;
                let p = bridge.plan();
                let mine = if p.src().contains(rank) || p.dst().contains(rank) {
                    run_rank(case, &bridge, rank)
                } else {
                    0
                };
                if sum(&w, mine)? == 0 {
                    return Err(format!("case {k}: nothing checked"));
                }
            }
        }
    }
    // Fan-in 4 -> 1 with a wrong tensor on lane 0, then exact data.
    let case = mk(grid(1, 1, 1, 4, 0), grid(1, 1, 1, 1, 4), vec![2; 4], false);
    let plan = plan_of(&case);
    let bridge = BridgeCommunicator::new(&f, w.clone(), plan.clone(), tag)
        .and_then(|b| {
            b.with_shape_mode(ShapeMode::Static {
                shape: vec![2, 2, 3],
                dtype: DType::F64,
            })
        })
        .map_err(|e| e.to_string())?;
    let good = |mb| l3(2).build(2, 2, move |b, s, h| value(mb, rank, b, s, h));
    let mine = if rank < 4 {
        let first = if rank == 0 {
            l3(2).build(3, 2, |b, s, h| value(0, 0, b, s, h))
        } else {
            good(0)
        };
        match (rank, bridge.send_forward(&first)) {
            (0, Err(Error::StaticShape { .. })) | (1..=3, Ok(())) => {}
            (r, other) => return Err(format!("rank {r}: {other:?}")),
        }
        bridge.send_forward(&good(1)).map_err(|e| e.to_string())?;
        0
    } else if rank == 4 {
        match bridge.recv_forward() {
            Err(Error::PeerError { peer: 0, .. }) => {}
            other => return Err(format!("rank 4: {other:?}")),
        }
        let t = bridge
            .recv_forward()
            .map_err(|e| e.to_string())?
            .ok_or("no tensor")?;
        let rows = dst_rows(&plan, &case.batches, 0);
        l3(2).check(&t, 8, 2, "mpi fan-in", |b, s, h| {
            value(1, rows[b].0, rows[b].1, s, h)
        });
        t.numel()
    } else {
        0
    };
    if sum(&w, mine)? != 8 * 2 * 3 {
        return Err("the fan-in after the error did not arrive".into());
    }
    // The two-encoder pipeline with static shapes.
    let n = 4;
    let mine = two_encoders_rank_with(
        &f,
        w.clone(),
        &PipelinePlan::new(&two_encoders_spec()).unwrap(),
        rank,
        n,
        &two_encoders_static_modes(),
    );
    let total = sum(&w, mine)?;
    if total != n * TWO_ENCODERS_PER_MB {
        return Err(format!(
            "checked {total} elements, expected {}",
            n * TWO_ENCODERS_PER_MB
        ));
    }
    Ok(())
});
