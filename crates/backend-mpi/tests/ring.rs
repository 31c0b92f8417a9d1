//! All-reduces of 32 MiB and more and reduce-scatters of 512 KiB and more run as a ring of
//! `MPI_Sendrecv` steps (the crate's `ring` module) instead of `MPI_Allreduce` /
//! `MPI_Reduce_scatter_block`: exact values at 2, 3 and 4 ranks, every reduction, all-reduce in
//! place and out of place with a length that does not divide by the rank count (blocks of
//! unequal length), reduce-scatters just above both thresholds, every type the ring takes, and
//! the same bits on every rank.

use backend_mpi::mpi_test;
use grid_core::{Communicator, CommunicatorExt, Element, ReduceOp};

/// Bytes of the buffers: above the ring's 32 MiB threshold, and 3 elements past a multiple of
/// 4, so that no rank count of the tests divides the length.
const BYTES: usize = (32 << 20) + 24;

/// Rank `r`'s element `i`: small integers (exact sums and products in every type).
fn value(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 5) as i64 + 1
}

/// The exact result (an average as the quotient; the types tested with `Avg` are floats).
fn expected(n: usize, i: usize, op: ReduceOp) -> f64 {
    let all = (0..n).map(|r| value(r, i));
    (match op {
        ReduceOp::Sum | ReduceOp::Avg => all.sum(),
        ReduceOp::Prod => all.product(),
        ReduceOp::Min => all.min().unwrap_or(0),
        ReduceOp::Max => all.max().unwrap_or(0),
    }) as f64
        / if op == ReduceOp::Avg { n as f64 } else { 1.0 }
}

fn check<T: Element + PartialEq + Copy + std::fmt::Debug>(
    c: &backend_mpi::MpiCommunicator,
    conv: fn(f64) -> T,
    ops: &[ReduceOp],
) -> Result<(), String> {
    let (me, n) = (c.rank(), c.size());
    let len = BYTES / std::mem::size_of::<T>();
    let mine: Vec<T> = (0..len).map(|i| conv(value(me, i) as f64)).collect();
    for &op in ops {
        let want = |i: usize| conv(expected(n, i, op));
        let mut out = vec![conv(0.0); len];
        c.all_reduce_into(&mine[..], &mut out[..], op)
            .map_err(|e| format!("{op:?} out of place: {e}"))?;
        if let Some(i) = (0..len).find(|&i| out[i] != want(i)) {
            return Err(format!(
                "{op:?} out of place, {} elements: element {i} is {:?}, expected {:?}",
                len,
                out[i],
                want(i)
            ));
        }
        let mut buf = mine.clone();
        c.all_reduce_in_place(&mut buf[..], op)
            .map_err(|e| format!("{op:?} in place: {e}"))?;
        if buf != out {
            return Err(format!("{op:?}: in place differs from out of place"));
        }
        // Every rank holds the same bits: the maximum over the ranks of the result equals it.
        let mut max = out.clone();
        c.all_reduce_in_place(&mut max[..], ReduceOp::Max)
            .map_err(|e| format!("{op:?} agreement: {e}"))?;
        if max != out {
            return Err(format!("{op:?}: the ranks' results differ"));
        }
    }
    Ok(())
}

/// Bytes just above the reduce-scatter's ring threshold (512 KiB), 3 elements past a multiple
/// of 4 as [`BYTES`].
const SCATTER_BYTES: usize = (512 << 10) + 24;

/// Reduce-scatter of `n` blocks of `k` elements (`n · k` elements, just above `bytes`), out of
/// place and in place.
fn check_scatter<T: Element + PartialEq + Copy + std::fmt::Debug>(
    c: &backend_mpi::MpiCommunicator,
    conv: fn(f64) -> T,
    ops: &[ReduceOp],
    bytes: usize,
) -> Result<(), String> {
    let (me, n) = (c.rank(), c.size());
    let k = bytes / std::mem::size_of::<T>() / n + 1;
    let mine: Vec<T> = (0..n * k).map(|i| conv(value(me, i) as f64)).collect();
    for &op in ops {
        let mut out = vec![conv(0.0); k];
        c.reduce_scatter_into(&mine[..], &mut out[..], op)
            .map_err(|e| format!("reduce_scatter {op:?}: {e}"))?;
        let want = |j: usize| conv(expected(n, me * k + j, op));
        if let Some(j) = (0..k).find(|&j| out[j] != want(j)) {
            return Err(format!(
                "reduce_scatter {op:?}, blocks of {k}: element {j} is {:?}, expected {:?}",
                out[j],
                want(j)
            ));
        }
        // The input is left as it was.
        if (0..n * k).any(|i| mine[i] != conv(value(me, i) as f64)) {
            return Err(format!("reduce_scatter {op:?} changed its input"));
        }
        // In place: this rank's block ends at me · k (the rest is unspecified).
        let mut buf = mine.clone();
        c.reduce_scatter_in_place(&mut buf[..], op)
            .map_err(|e| format!("reduce_scatter_in_place {op:?}: {e}"))?;
        if let Some(j) = (0..k).find(|&j| buf[me * k + j] != want(j)) {
            return Err(format!(
                "reduce_scatter_in_place {op:?}, blocks of {k}: element {j} of this rank's block is {:?}, expected {:?}",
                buf[me * k + j],
                want(j)
            ));
        }
    }
    Ok(())
}

fn every_type(rt: &backend_mpi::MpiRuntime) -> Result<(), String> {
    let c = rt.world();
    let all = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];
    check::<f32>(c, |x| x as f32, &all)?;
    check::<f64>(c, |x| x, &[ReduceOp::Sum, ReduceOp::Avg])?;
    check::<i32>(c, |x| x as i32, &[ReduceOp::Sum, ReduceOp::Max])?;
    check::<i64>(c, |x| x as i64, &[ReduceOp::Sum, ReduceOp::Min])?;
    for bytes in [SCATTER_BYTES, BYTES] {
        check_scatter::<f32>(c, |x| x as f32, &all, bytes)?;
        check_scatter::<f64>(c, |x| x, &[ReduceOp::Max], bytes)?;
        check_scatter::<i32>(c, |x| x as i32, &[ReduceOp::Sum], bytes)?;
        check_scatter::<i64>(c, |x| x as i64, &[ReduceOp::Prod], bytes)?;
    }
    Ok(())
}

mpi_test!(mpi_ring_all_reduce_np2, np = 2, timeout = 180, every_type);
mpi_test!(mpi_ring_all_reduce_np3, np = 3, timeout = 180, every_type);
mpi_test!(mpi_ring_all_reduce_np4, np = 4, timeout = 240, every_type);
