//! How each (dtype, reduction) pair runs on MPI.
//!
//! * f32, f64, i32, i64, u8 with sum, product, min, max: MPI's own operation on the native type.
//!   Integer sums and products wrap on overflow as the C arithmetic of the MPI library does.
//! * Average of f32/f64: MPI sum, then a division by the communicator size on this rank.
//! * f16 and bf16 (MPI has no half types): moved as 16-bit words (exact) by every non-reducing
//!   operation; for reductions the input is converted to f32 on the host, reduced as f32 (average:
//!   sum then division in f32) and rounded back to the half type once (round to nearest even).
//! * Average of i32, i64, u8: the input is widened to i64, summed by MPI, divided by the size with
//!   truncation toward zero (Rust's `/`) and narrowed back. This is exact for i32 and u8 (the mean
//!   always fits the type); for i64 the sum wraps if it overflows i64.

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
}

pub(crate) fn plan(dtype: DType, op: ReduceOp, size: usize) -> Plan {
    let (mpi_op, divide) = match op {
        ReduceOp::Sum => (Reduce::Sum, None),
        ReduceOp::Prod => (Reduce::Prod, None),
        ReduceOp::Min => (Reduce::Min, None),
        ReduceOp::Max => (Reduce::Max, None),
        ReduceOp::Avg => (Reduce::Sum, Some(size.max(1))),
    };
    let wire = match (dtype, op) {
        (DType::F16 | DType::BF16, _) => Some(DType::F32),
        (DType::I32 | DType::U8, ReduceOp::Avg) => Some(DType::I64),
        _ => None,
    };
    Plan {
        wire,
        op: mpi_op,
        divide,
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
                divide: Some(4)
            }
        );
        assert_eq!(plan(DType::I64, ReduceOp::Avg, 3).divide, Some(3));
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
