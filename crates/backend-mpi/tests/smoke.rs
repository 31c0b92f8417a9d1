use backend_mpi::{mpi_test, MpiFactory};
use grid_core::{Communicator, CommunicatorExt, GroupFactory, ReduceOp};

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
    let work = w
        .iall_reduce(vec![1.5f32, 2.0], ReduceOp::Avg)
        .map_err(|e| e.to_string())?;
    let v = work.wait().map_err(|e| e.to_string())?;
    if v != vec![1.5f32, 2.0] {
        return Err(format!("{v:?}"));
    }
    Ok(())
});

mpi_test!(mpi_smoke_fails_np2, np = 2, timeout = 60, |rt| {
    if std::env::var("SMOKE_FAIL").is_ok() && rt.world().rank() == 1 {
        return Err("deliberate failure on rank 1".into());
    }
    rt.world().barrier().map_err(|e| e.to_string())
});
