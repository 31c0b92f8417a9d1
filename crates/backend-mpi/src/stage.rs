//! How each (dtype, reduction) pair runs on MPI.
//!
//! * f32, f64, i32, i64, u8 with sum, product, min, max: MPI's own operation on the native type.
//!   Integer sums and products wrap on overflow as the C arithmetic of the MPI library does.
//! * Average of f32/f64: MPI sum, then a division by the communicator size on this rank.
//! * f16 and bf16 (MPI has no half types): moved as 16-bit words (exact) by every non-reducing
//!   operation; for reductions the input is converted to f32 on the host, reduced as f32 (average:
//!   sum then division in f32) and rounded back to the half type once (round to nearest even).
//! * Average of i8, i32, u8, u32: the input is widened to i64, summed by MPI, divided by the
//!   size with truncation toward zero (Rust's `/`) and narrowed back. This is exact (the mean
//!   always fits the type). Average of i64: summed by MPI in i64 (wrapping on overflow, as the
//!   in-process backend does), then divided. Average of u64: each element travels as its two
//!   32-bit halves widened to u64 (twice the data), MPI sums both, and the host recombines the
//!   sum in u128 and divides: exact, as the in-process backend's u128 sum.
//! * i8, u32, u64 with sum, product, min, max: MPI's own operation on `MPI_INT8_T`,
//!   `MPI_UINT32_T`, `MPI_UINT64_T` (sums and products wrap).
//! * bool (one byte, any non-zero byte is true): sum and max run as `MPI_MAX`, product and min
//!   as `MPI_MIN` on unsigned bytes, which is OR and AND for any bytes (max(a, b) is non-zero iff
//!   a or b is). No average (`supports` is false).
//! * fp8 (e4m3, e5m2): moved as bytes, never reduced (`supports` is false for every reduction).

use crate::raw::Reduce;
use grid_core::{DType, HostBuffer, HostSlice, HostSliceMut, ReduceOp};
use half::{bf16, f16};

/// The plan for one reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Type that travels through MPI (`None`: the user's type).
    pub wire: Option<DType>,
    /// MPI operation.
    pub op: Reduce,
    /// Divide the result by this (average).
    pub divide: Option<usize>,
    /// Wire elements per element: 2 for the average of u64, which travels as its 32-bit
    /// halves, each widened to u64 (so that the sum is exact, as in the in-process backend's
    /// u128 sum), 1 otherwise.
    pub parts: usize,
}

pub(crate) fn plan(dtype: DType, op: ReduceOp, size: usize) -> Plan {
    let (mpi_op, divide) = match op {
        // Logical: OR and AND as byte maximum and minimum.
        ReduceOp::Sum | ReduceOp::Max if dtype == DType::Bool => (Reduce::Max, None),
        ReduceOp::Prod | ReduceOp::Min if dtype == DType::Bool => (Reduce::Min, None),
        ReduceOp::Sum => (Reduce::Sum, None),
        ReduceOp::Prod => (Reduce::Prod, None),
        ReduceOp::Min => (Reduce::Min, None),
        ReduceOp::Max => (Reduce::Max, None),
        ReduceOp::Avg => (Reduce::Sum, Some(size.max(1))),
    };
    let wire = match (dtype, op) {
        (DType::F16 | DType::BF16, _) => Some(DType::F32),
        (DType::I8 | DType::I32 | DType::U8 | DType::U32, ReduceOp::Avg) => Some(DType::I64),
        (DType::U64, ReduceOp::Avg) => Some(DType::U64),
        _ => None,
    };
    let parts = if (dtype, op) == (DType::U64, ReduceOp::Avg) {
        2
    } else {
        1
    };
    Plan {
        wire,
        op: mpi_op,
        divide,
        parts,
    }
}

/// Converts `src` to the wire type.
pub(crate) fn widen(src: HostSlice<'_>, wire: DType) -> HostBuffer {
    match (src, wire) {
        (HostSlice::F16(s), DType::F32) => HostBuffer::F32(s.iter().map(|x| x.to_f32()).collect()),
        (HostSlice::BF16(s), DType::F32) => HostBuffer::F32(s.iter().map(|x| x.to_f32()).collect()),
        (HostSlice::I32(s), DType::I64) => {
            HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())
        }
        (HostSlice::U8(s), DType::I64) => {
            HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())
        }
        (HostSlice::I8(s), DType::I64) => {
            HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())
        }
        (HostSlice::U32(s), DType::I64) => {
            HostBuffer::I64(s.iter().map(|&x| i64::from(x)).collect())
        }
        // The average of u64: each element as [low 32 bits, high 32 bits], both as u64; sums of
        // up to 2^32 ranks cannot overflow.
        (HostSlice::U64(s), DType::U64) => HostBuffer::U64(
            s.iter()
                .flat_map(|&x| [x & u64::from(u32::MAX), x >> 32])
                .collect(),
        ),
        (other, _) => other.to_owned_buffer(),
    }
}

/// Writes the wire-typed result `wide` (divided by `divide` first) into `dst`.
pub(crate) fn narrow(wide: HostSlice<'_>, dst: HostSliceMut<'_>, divide: Option<usize>) {
    let n = divide.unwrap_or(1).max(1);
    match (wide, dst) {
        (HostSlice::F32(w), HostSliceMut::F16(d)) => {
            for (d, &w) in d.iter_mut().zip(w) {
                *d = f16::from_f32(if n > 1 { w / n as f32 } else { w });
            }
        }
        (HostSlice::F32(w), HostSliceMut::BF16(d)) => {
            for (d, &w) in d.iter_mut().zip(w) {
                *d = bf16::from_f32(if n > 1 { w / n as f32 } else { w });
            }
        }
        (HostSlice::I64(w), HostSliceMut::I32(d)) => {
            let n = n as i64;
            for (d, &w) in d.iter_mut().zip(w) {
                *d = (w / n) as i32;
            }
        }
        (HostSlice::I64(w), HostSliceMut::U8(d)) => {
            let n = n as i64;
            for (d, &w) in d.iter_mut().zip(w) {
                *d = (w / n) as u8;
            }
        }
        (HostSlice::I64(w), HostSliceMut::I8(d)) => {
            let n = n as i64;
            for (d, &w) in d.iter_mut().zip(w) {
                *d = (w / n) as i8;
            }
        }
        (HostSlice::I64(w), HostSliceMut::U32(d)) => {
            let n = n as i64;
            for (d, &w) in d.iter_mut().zip(w) {
                *d = (w / n) as u32;
            }
        }
        (HostSlice::U64(w), HostSliceMut::U64(d)) if w.len() == 2 * d.len() => {
            let n = n as u128;
            for (d, w) in d.iter_mut().zip(w.chunks_exact(2)) {
                let sum = (u128::from(w[1]) << 32) + u128::from(w[0]);
                // The mean of u64 values fits u64.
                *d = (sum / n) as u64;
            }
        }
        (w, mut d) => {
            // Same type: copy (lengths equal by construction).
            let _ = d.copy_from(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        assert_eq!(plan(DType::F32, ReduceOp::Sum, 4).wire, None);
        assert_eq!(plan(DType::BF16, ReduceOp::Max, 4).wire, Some(DType::F32));
        assert_eq!(
            plan(DType::U8, ReduceOp::Avg, 4),
            Plan {
                wire: Some(DType::I64),
                op: Reduce::Sum,
                divide: Some(4),
                parts: 1,
            }
        );
        assert_eq!(plan(DType::I64, ReduceOp::Avg, 3).divide, Some(3));
        assert_eq!(plan(DType::U64, ReduceOp::Avg, 3).wire, Some(DType::U64));
        assert_eq!(plan(DType::U64, ReduceOp::Avg, 3).parts, 2);
        assert_eq!(plan(DType::U64, ReduceOp::Sum, 3).wire, None);
        assert_eq!(plan(DType::I8, ReduceOp::Avg, 3).wire, Some(DType::I64));
        assert_eq!(plan(DType::U32, ReduceOp::Avg, 3).wire, Some(DType::I64));
        assert_eq!(plan(DType::U32, ReduceOp::Sum, 3).wire, None);
        // Bool: OR and AND as byte max and min, never staged.
        for (op, r) in [
            (ReduceOp::Sum, Reduce::Max),
            (ReduceOp::Max, Reduce::Max),
            (ReduceOp::Prod, Reduce::Min),
            (ReduceOp::Min, Reduce::Min),
        ] {
            let p = plan(DType::Bool, op, 4);
            assert_eq!((p.op, p.wire, p.divide), (r, None, None), "{op:?}");
        }
    }

    #[test]
    fn new_integer_averages_are_exact() {
        let w = widen(HostSlice::I8(&[-128, 127]), DType::I64);
        assert_eq!(w, HostBuffer::I64(vec![-128, 127]));
        let mut o = [0i8; 2];
        // Sums of 3 ranks: -128·3 and 127·3 do not fit i8, their means do.
        narrow(
            HostSlice::I64(&[-384, 381]),
            HostSliceMut::I8(&mut o),
            Some(3),
        );
        assert_eq!(o, [-128, 127]);
        let w = widen(HostSlice::U32(&[u32::MAX]), DType::I64);
        assert_eq!(w, HostBuffer::I64(vec![i64::from(u32::MAX)]));
        let mut o = [0u32; 1];
        narrow(
            HostSlice::I64(&[i64::from(u32::MAX) * 4 - 1]),
            HostSliceMut::U32(&mut o),
            Some(4),
        );
        assert_eq!(o, [u32::MAX - 1]);
        // u64: the halves of 3 ranks' u64::MAX sum without overflow; the mean is exact.
        let w = widen(HostSlice::U64(&[u64::MAX, 5]), DType::U64);
        assert_eq!(
            w,
            HostBuffer::U64(vec![u64::from(u32::MAX), u64::from(u32::MAX), 5, 0])
        );
        let three = HostBuffer::U64(vec![3 * u64::from(u32::MAX), 3 * u64::from(u32::MAX), 7, 0]);
        let mut o = [0u64; 2];
        narrow(three.as_slice(), HostSliceMut::U64(&mut o), Some(3));
        assert_eq!(o, [u64::MAX, 2]);
    }

    #[test]
    fn widen_and_narrow_are_exact() {
        let h = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        let w = widen(HostSlice::F16(&h), DType::F32);
        assert_eq!(w, HostBuffer::F32(vec![1.5, -2.0]));
        let mut out = [f16::ZERO; 2];
        narrow(w.as_slice(), HostSliceMut::F16(&mut out), Some(2));
        assert_eq!(out, [f16::from_f32(0.75), f16::from_f32(-1.0)]);
        let mut o = [0u8; 2];
        narrow(
            HostSlice::I64(&[7, 255 * 3]),
            HostSliceMut::U8(&mut o),
            Some(3),
        );
        assert_eq!(o, [2, 255]);
        let mut i = [0i32; 2];
        narrow(HostSlice::I64(&[-7, 7]), HostSliceMut::I32(&mut i), Some(2));
        assert_eq!(i, [-3, 3]);
    }
}
