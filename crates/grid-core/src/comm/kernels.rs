//! Host reduction kernels: every dtype × every reduction, computed once for every backend that
//! reduces on the host (the in-process backend, and any library without a native kernel for a
//! type).
//!
//! How each pair is computed (the same rules as the MPI backend's staging):
//! * **f32, f64**: in the type itself, over the inputs in rank order. `Avg` is the sum divided
//!   by the number of inputs, in the type.
//! * **f16, bf16**: each input is widened to f32, reduced in f32 in rank order (`Avg`: sum then
//!   division in f32) and rounded back to the half type once (round to nearest even).
//! * **i8, i32, i64, u8, u32, u64**: `Sum` and `Prod` wrap on overflow (two's complement /
//!   modulo 2^bits, as the C arithmetic of the libraries does); `Min`, `Max` exact.
//! * **bool** ([`crate::Bool`]): `Sum` and `Max` are OR, `Prod` and `Min` AND (byte maximum and
//!   minimum, exact for any bytes); `Avg` is an error.
//! * **fp8** (E4M3, E5M2): not reduced on the host (an error; NCCL reduces them on GPUs).
//! * **Min and Max on floats propagate NaN**: a NaN on any rank gives NaN in that position.
//! * **Integer `Avg`** sums in i64 (exact for i8, i32, u8 and u32; wrapping for i64), in u128
//!   for u64 (exact), divides by the number of inputs with **truncation toward zero** (Rust's
//!   `/`: the mean of `[-3, 0]` is `-1`, of `[1, 2]` is `1`) and narrows back, which is exact
//!   because the mean of values of a type fits the type.
//!
//! [`runs`] says which pairs these kernels compute: the answer of every backend that reduces on
//! the host to [`super::Communicator::supports`].
//!
//! ```
//! use grid_core::{kernels, HostSlice, HostSliceMut, ReduceOp};
//! let a = [1i32, -3, 7];
//! let b = [2i32, 0, 7];
//! let mut out = [0i32; 3];
//! kernels::reduce(&[HostSlice::I32(&a), HostSlice::I32(&b)], HostSliceMut::I32(&mut out), ReduceOp::Avg)?;
//! assert_eq!(out, [1, -1, 7]);
//! # Ok::<(), grid_core::Error>(())
//! ```

use super::dtype::{DType, HostSlice, HostSliceMut, ReduceOp};
use super::narrow::Bool;
use crate::error::{Error, Result};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// An integer reduction other than `Avg` as [`fold_same`] with the operation inlined.
macro_rules! int_same {
    ($ins:expr, $o:expr, $t:ty, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => fold_same($ins, $o, <$t>::wrapping_add),
            ReduceOp::Prod => fold_same($ins, $o, <$t>::wrapping_mul),
            ReduceOp::Min => fold_same($ins, $o, |a: $t, b: $t| a.min(b)),
            ReduceOp::Max => fold_same($ins, $o, |a: $t, b: $t| a.max(b)),
        }
    };
}

/// Whether these kernels compute `op` on `dtype` (`None`: the dtype is only moved, which every
/// dtype can be): every reduction of every type except those on fp8 and `Avg` on bool.
///
/// ```
/// use grid_core::{kernels, DType, ReduceOp};
/// assert!(kernels::runs(DType::U64, Some(ReduceOp::Avg)));
/// assert!(kernels::runs(DType::F8E4M3, None));
/// assert!(!kernels::runs(DType::F8E4M3, Some(ReduceOp::Sum)));
/// assert!(!kernels::runs(DType::Bool, Some(ReduceOp::Avg)));
/// ```
pub fn runs(dtype: DType, op: Option<ReduceOp>) -> bool {
    op.is_none_or(|r| !dtype.is_fp8() && dtype.reducible_with(r))
}

/// Reduces `inputs` (one per rank, in rank order; each of `out`'s dtype and length) element by
/// element into `out`.
pub fn reduce(inputs: &[HostSlice<'_>], out: HostSliceMut<'_>, op: ReduceOp) -> Result<()> {
    reduce_range(inputs, 0, out, op)
}

/// Reduces elements `start..start + out.len()` of every input into `out` (the block of one
/// rank in a reduce-scatter). Errors name the input whose dtype or length does not fit.
///
/// ```
/// use grid_core::{kernels, HostSlice, HostSliceMut, ReduceOp};
/// use half::bf16;
/// let x = [bf16::from_f32(1.0), bf16::from_f32(2.0)];
/// let y = [bf16::from_f32(4.0), bf16::from_f32(8.0)];
/// let mut out = [bf16::ZERO];
/// kernels::reduce_range(&[HostSlice::BF16(&x), HostSlice::BF16(&y)], 1, HostSliceMut::BF16(&mut out), ReduceOp::Max)?;
/// assert_eq!(out[0].to_f32(), 8.0);
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn reduce_range(
    inputs: &[HostSlice<'_>],
    start: usize,
    out: HostSliceMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    const OP: &str = "reduce";
    let n = inputs.len();
    if n == 0 {
        return Err(Error::Invalid(
            "reduce: no inputs to reduce (give one input per rank)".into(),
        ));
    }
    let end = start + out.len();
    for s in inputs {
        if s.dtype() != out.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: out.dtype(),
                actual: s.dtype(),
            });
        }
        if s.len() < end {
            return Err(Error::LengthMismatch {
                op: OP,
                what: "input",
                expected: end,
                actual: s.len(),
            });
        }
    }
    macro_rules! typed {
        ($v:ident) => {
            inputs
                .iter()
                .map(|s| match s {
                    HostSlice::$v(x) => Ok(&x[start..end]),
                    other => Err(Error::DTypeMismatch {
                        op: OP,
                        expected: DType::$v,
                        actual: other.dtype(),
                    }),
                })
                .collect::<Result<Vec<_>>>()?
        };
    }
    match out {
        HostSliceMut::F32(o) => float_same(&typed!(F32), o, op),
        HostSliceMut::F64(o) => float_same(&typed!(F64), o, op),
        HostSliceMut::F16(o) => float(&typed!(F16), o, op, f16::to_f32, f16::from_f32),
        HostSliceMut::BF16(o) => float(&typed!(BF16), o, op, bf16::to_f32, bf16::from_f32),
        HostSliceMut::I32(o) => {
            let ins = typed!(I32);
            match op {
                ReduceOp::Avg => fold(&ins, o, i64::from, i64::wrapping_add, |a| {
                    (a / n as i64) as i32
                }),
                _ => int_same!(&ins, o, i32, op),
            }
        }
        HostSliceMut::I64(o) => {
            let ins = typed!(I64);
            match op {
                ReduceOp::Avg => fold(&ins, o, |x| x, i64::wrapping_add, |a| a / n as i64),
                _ => int_same!(&ins, o, i64, op),
            }
        }
        HostSliceMut::U8(o) => {
            let ins = typed!(U8);
            match op {
                ReduceOp::Avg => fold(&ins, o, i64::from, i64::wrapping_add, |a| {
                    (a / n as i64) as u8
                }),
                _ => int_same!(&ins, o, u8, op),
            }
        }
        HostSliceMut::I8(o) => {
            let ins = typed!(I8);
            match op {
                ReduceOp::Avg => fold(&ins, o, i64::from, i64::wrapping_add, |a| {
                    (a / n as i64) as i8
                }),
                _ => int_same!(&ins, o, i8, op),
            }
        }
        HostSliceMut::U32(o) => {
            let ins = typed!(U32);
            match op {
                ReduceOp::Avg => fold(&ins, o, i64::from, i64::wrapping_add, |a| {
                    (a / n as i64) as u32
                }),
                _ => int_same!(&ins, o, u32, op),
            }
        }
        HostSliceMut::U64(o) => {
            let ins = typed!(U64);
            match op {
                ReduceOp::Avg => fold(&ins, o, u128::from, u128::wrapping_add, |a| {
                    (a / n as u128) as u64
                }),
                _ => int_same!(&ins, o, u64, op),
            }
        }
        HostSliceMut::Bool(o) => {
            let ins = typed!(Bool);
            let f = bool_op(op)?;
            fold(&ins, o, Bool::to_byte, f, Bool::from_byte)
        }
        HostSliceMut::F8E4M3(_) | HostSliceMut::F8E5M2(_) => {
            return Err(fp8_error(OP, op, inputs[0].dtype()))
        }
    }
    Ok(())
}

/// The byte operation a reduction of booleans is: `Sum` and `Max` are OR (the byte maximum),
/// `Prod` and `Min` AND (the byte minimum); both are exact for any bytes, not only 0 and 1.
/// `Avg` is an error.
fn bool_op(op: ReduceOp) -> Result<fn(u8, u8) -> u8> {
    match op {
        ReduceOp::Sum | ReduceOp::Max => Ok(std::cmp::max),
        ReduceOp::Prod | ReduceOp::Min => Ok(std::cmp::min),
        ReduceOp::Avg => Err(Error::Unsupported {
            op: "reduce",
            backend: "host kernels",
            what: "the reduction Avg on bool (booleans reduce with Sum or Max = OR, Prod or Min = AND)"
                .into(),
        }),
    }
}

fn fp8_error(op: &'static str, reduce: ReduceOp, dtype: DType) -> Error {
    Error::Unsupported {
        op,
        backend: "host kernels",
        what: format!(
            "the reduction {reduce} on {dtype} (8-bit floats are moved, not reduced, on the host)"
        ),
    }
}

/// Divides a sum in place by `n` to make it a mean, with the rules of the module docs (floats
/// in their type, halves through f32, integers truncating toward zero). For backends whose
/// library sums natively and has no average.
///
/// ```
/// use grid_core::{kernels, HostSliceMut};
/// let mut v = [7i64, -7];
/// kernels::divide(HostSliceMut::I64(&mut v), 2);
/// assert_eq!(v, [3, -3]);
/// ```
pub fn divide(buf: HostSliceMut<'_>, n: usize) {
    let n = n.max(1);
    match buf {
        HostSliceMut::F32(s) => s.iter_mut().for_each(|x| *x /= n as f32),
        HostSliceMut::F64(s) => s.iter_mut().for_each(|x| *x /= n as f64),
        HostSliceMut::F16(s) => s
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32)),
        HostSliceMut::BF16(s) => s
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32)),
        HostSliceMut::I32(s) => s
            .iter_mut()
            .for_each(|x| *x = (*x as i64 / n as i64) as i32),
        HostSliceMut::I64(s) => {
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            s.iter_mut().for_each(|x| *x /= n)
        }
        HostSliceMut::U8(s) => s.iter_mut().for_each(|x| *x = (*x as usize / n) as u8),
        HostSliceMut::I8(s) => s.iter_mut().for_each(|x| *x = (*x as i64 / n as i64) as i8),
        HostSliceMut::U32(s) => s
            .iter_mut()
            .for_each(|x| *x = (*x as u64 / n as u64) as u32),
        HostSliceMut::U64(s) => s.iter_mut().for_each(|x| *x /= n as u64),
        // A mean of booleans or 8-bit floats is never computed (`Avg` is refused for them).
        HostSliceMut::Bool(_) | HostSliceMut::F8E4M3(_) | HostSliceMut::F8E5M2(_) => {}
    }
}

/// Combines `x` into `acc` element by element, in place: `acc[i] = acc[i] op x[i]`, with the
/// rules of the module docs for one pair (f16 and bf16 widened to f32 and rounded back once per
/// call; integers wrapping). This is the two-operand step that libraries reducing over the
/// wire call repeatedly (Gloo's reduction function, MPI user operations); `Avg` combines as a
/// sum here, and the caller divides once at the end ([`divide`]), so integer averages wrap in
/// the type rather than summing in i64 as [`reduce`] does.
///
/// ```
/// use grid_core::{kernels, HostSlice, HostSliceMut, ReduceOp};
/// let mut acc = [1.0f32, 5.0];
/// kernels::accumulate(HostSliceMut::F32(&mut acc), HostSlice::F32(&[2.0, 3.0]), ReduceOp::Max)?;
/// assert_eq!(acc, [2.0, 5.0]);
/// let e = kernels::accumulate(HostSliceMut::F32(&mut acc), HostSlice::F32(&[1.0]), ReduceOp::Sum);
/// assert!(e.is_err());
/// # Ok::<(), grid_core::Error>(())
/// ```
pub fn accumulate(acc: HostSliceMut<'_>, x: HostSlice<'_>, op: ReduceOp) -> Result<()> {
    const OP: &str = "accumulate";
    if acc.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: acc.dtype(),
            actual: x.dtype(),
        });
    }
    if acc.len() != x.len() {
        return Err(Error::LengthMismatch {
            op: OP,
            what: "input",
            expected: acc.len(),
            actual: x.len(),
        });
    }
    match (acc, x) {
        (HostSliceMut::F32(a), HostSlice::F32(x)) => combine(a, x, op, |a, b| a + b, |a, b| a * b),
        (HostSliceMut::F64(a), HostSlice::F64(x)) => combine(a, x, op, |a, b| a + b, |a, b| a * b),
        (HostSliceMut::F16(a), HostSlice::F16(x)) => halves(a, x, op),
        (HostSliceMut::BF16(a), HostSlice::BF16(x)) => halves(a, x, op),
        (HostSliceMut::I32(a), HostSlice::I32(x)) => {
            combine(a, x, op, i32::wrapping_add, i32::wrapping_mul)
        }
        (HostSliceMut::I64(a), HostSlice::I64(x)) => {
            combine(a, x, op, i64::wrapping_add, i64::wrapping_mul)
        }
        (HostSliceMut::U8(a), HostSlice::U8(x)) => {
            combine(a, x, op, u8::wrapping_add, u8::wrapping_mul)
        }
        (HostSliceMut::I8(a), HostSlice::I8(x)) => {
            combine(a, x, op, i8::wrapping_add, i8::wrapping_mul)
        }
        (HostSliceMut::U32(a), HostSlice::U32(x)) => {
            combine(a, x, op, u32::wrapping_add, u32::wrapping_mul)
        }
        (HostSliceMut::U64(a), HostSlice::U64(x)) => {
            combine(a, x, op, u64::wrapping_add, u64::wrapping_mul)
        }
        (HostSliceMut::Bool(a), HostSlice::Bool(x)) => {
            let f = bool_op(op)?;
            for (a, x) in a.iter_mut().zip(x) {
                *a = Bool::from_byte(f(a.to_byte(), x.to_byte()));
            }
        }
        (HostSliceMut::F8E4M3(_), HostSlice::F8E4M3(_))
        | (HostSliceMut::F8E5M2(_), HostSlice::F8E5M2(_)) => {
            return Err(fp8_error(OP, op, x.dtype()))
        }
        // Unreachable: the dtypes were compared above.
        (a, x) => {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: a.dtype(),
                actual: x.dtype(),
            })
        }
    }
    Ok(())
}

/// `a[i] = a[i] op x[i]` for one element type, each reduction its own monomorphic loop (which
/// the compiler vectorises). Min and max compare as [`reduce`] does.
#[inline]
fn combine<T: Copy + PartialOrd>(
    a: &mut [T],
    x: &[T],
    op: ReduceOp,
    add: impl Fn(T, T) -> T,
    mul: impl Fn(T, T) -> T,
) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairwise(a, x, add),
        ReduceOp::Prod => pairwise(a, x, mul),
        ReduceOp::Min => pairwise(a, x, min_nan),
        ReduceOp::Max => pairwise(a, x, max_nan),
    }
}

/// Minimum that propagates NaN: a NaN in either operand gives NaN (as MPI's, NCCL's and
/// torch's `min` do), whichever rank holds it. For integers `b != b` is never true.
#[inline]
#[allow(clippy::eq_op)]
fn min_nan<T: Copy + PartialOrd>(a: T, b: T) -> T {
    if b < a || b != b {
        b
    } else {
        a
    }
}

/// Maximum that propagates NaN (see [`min_nan`]).
#[inline]
#[allow(clippy::eq_op)]
fn max_nan<T: Copy + PartialOrd>(a: T, b: T) -> T {
    if b > a || b != b {
        b
    } else {
        a
    }
}

#[inline]
fn pairwise<T: Copy>(a: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    for (a, &x) in a.iter_mut().zip(x) {
        *a = f(*a, x);
    }
}

/// [`combine`] for f16 and bf16: blocks widened to f32 with the `half` crate's slice
/// conversions (hardware instructions where the CPU has them), combined in f32, rounded back
/// once.
fn halves<H>(a: &mut [H], x: &[H], op: ReduceOp)
where
    [H]: HalfFloatSliceExt,
{
    const BLOCK: usize = 512;
    let mut wa = [0f32; BLOCK];
    let mut wx = [0f32; BLOCK];
    for (a, x) in a.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
        let n = a.len();
        a.convert_to_f32_slice(&mut wa[..n]);
        x.convert_to_f32_slice(&mut wx[..n]);
        combine(&mut wa[..n], &wx[..n], op, |a, b| a + b, |a, b| a * b);
        a.convert_from_f32_slice(&wa[..n]);
    }
}

fn float<T: Copy, A>(
    ins: &[&[T]],
    out: &mut [T],
    op: ReduceOp,
    widen: impl Fn(T) -> A,
    narrow: impl Fn(A) -> T,
) where
    A: Copy
        + std::ops::Add<Output = A>
        + std::ops::Mul<Output = A>
        + std::ops::Div<Output = A>
        + PartialOrd
        + FromCount,
{
    let n = A::from_count(ins.len());
    match op {
        ReduceOp::Sum => fold(ins, out, widen, |a, b| a + b, narrow),
        ReduceOp::Avg => fold(ins, out, widen, |a, b| a + b, |a| narrow(a / n)),
        ReduceOp::Prod => fold(ins, out, widen, |a, b| a * b, narrow),
        ReduceOp::Min => fold(ins, out, widen, min_nan, narrow),
        ReduceOp::Max => fold(ins, out, widen, max_nan, narrow),
    }
}

/// Float accumulators that can hold a rank count.
trait FromCount {
    fn from_count(n: usize) -> Self;
}
impl FromCount for f32 {
    fn from_count(n: usize) -> f32 {
        n as f32
    }
}
impl FromCount for f64 {
    fn from_count(n: usize) -> f64 {
        n as f64
    }
}

/// A reduction of floats that accumulate in their own type (f32, f64) as [`fold_same`]; `Avg`
/// divides the sum by the count at the end, as [`float`] does.
fn float_same<T>(ins: &[&[T]], out: &mut [T], op: ReduceOp)
where
    T: Copy
        + std::ops::Add<Output = T>
        + std::ops::Mul<Output = T>
        + std::ops::Div<Output = T>
        + PartialOrd
        + FromCount,
{
    match op {
        ReduceOp::Sum => fold_same(ins, out, |a, b| a + b),
        ReduceOp::Avg => {
            fold_same(ins, out, |a, b| a + b);
            let n = T::from_count(ins.len());
            out.iter_mut().for_each(|o| *o = *o / n);
        }
        ReduceOp::Prod => fold_same(ins, out, |a, b| a * b),
        ReduceOp::Min => fold_same(ins, out, min_nan),
        ReduceOp::Max => fold_same(ins, out, max_nan),
    }
}

/// [`fold`] where the accumulator is the element type itself: the first input copied into
/// `out`, then every other input combined into it in order, one input at a time (a loop the
/// compiler vectorizes). Each element sees the same operations in the same order as in
/// [`fold`], so the results are the same bits.
fn fold_same<T: Copy>(ins: &[&[T]], out: &mut [T], f: impl Fn(T, T) -> T) {
    let Some((first, rest)) = ins.split_first() else {
        return;
    };
    let n = out.len();
    out.copy_from_slice(&first[..n]);
    for s in rest {
        for (o, &x) in out.iter_mut().zip(&s[..n]) {
            *o = f(*o, x);
        }
    }
}

fn fold<T: Copy, A: Copy>(
    ins: &[&[T]],
    out: &mut [T],
    widen: impl Fn(T) -> A,
    f: impl Fn(A, A) -> A,
    fin: impl Fn(A) -> T,
) {
    let Some((first, rest)) = ins.split_first() else {
        return;
    };
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = widen(first[i]);
        for s in rest {
            acc = f(acc, widen(s[i]));
        }
        *o = fin(acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The input-at-a-time fold gives the bits of the element-at-a-time fold for every float
    /// reduction (including NaN, infinities and signed zeros) and every integer one.
    #[test]
    fn fold_same_gives_the_bits_of_fold() {
        let vals = [
            1.5f32,
            -0.0,
            0.0,
            f32::NAN,
            f32::INFINITY,
            -3.25,
            1e30,
            -1e-30,
            7.0,
        ];
        let ins: Vec<Vec<f32>> = (0..4)
            .map(|r| {
                (0..vals.len() * 3)
                    .map(|i| vals[(i * (r + 2) + r) % vals.len()] * (r as f32 + 0.5))
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        for op in ReduceOp::ALL {
            for k in 1..=refs.len() {
                let mut slow = vec![0f32; refs[0].len()];
                float(&refs[..k], &mut slow, op, |x| x, |x| x);
                let mut fast = vec![0f32; refs[0].len()];
                float_same(&refs[..k], &mut fast, op);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&slow), bits(&fast), "{op} over {k} inputs");
            }
        }
        let ints: Vec<Vec<i32>> = (0..3)
            .map(|r| vec![i32::MAX - r, i32::MIN + r, 7 * r - 5])
            .collect();
        let refs: Vec<&[i32]> = ints.iter().map(|v| v.as_slice()).collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let f: fn(i32, i32) -> i32 = match op {
                ReduceOp::Sum => i32::wrapping_add,
                ReduceOp::Prod => i32::wrapping_mul,
                ReduceOp::Min => std::cmp::min,
                _ => std::cmp::max,
            };
            let mut slow = [0i32; 3];
            fold(&refs, &mut slow, |x| x, f, |x| x);
            let mut fast = [0i32; 3];
            int_same!(&refs, &mut fast, i32, op);
            assert_eq!(slow, fast, "{op}");
        }
    }

    #[test]
    fn every_dtype_and_op() {
        let a = [3i64, -2, 5];
        let b = [1i64, 4, -6];
        let c = [2i64, 1, 1];
        for op in ReduceOp::ALL {
            let want: Vec<i64> = (0..3)
                .map(|i| {
                    let v = [a[i], b[i], c[i]];
                    match op {
                        ReduceOp::Sum => v.iter().sum(),
                        ReduceOp::Prod => v.iter().product(),
                        ReduceOp::Min => *v.iter().min().unwrap(),
                        ReduceOp::Max => *v.iter().max().unwrap(),
                        ReduceOp::Avg => v.iter().sum::<i64>() / 3,
                    }
                })
                .collect();
            let mut o = [0i64; 3];
            reduce(
                &[HostSlice::I64(&a), HostSlice::I64(&b), HostSlice::I64(&c)],
                HostSliceMut::I64(&mut o),
                op,
            )
            .unwrap();
            assert_eq!(o.to_vec(), want, "i64 {op}");
            let (a32, b32, c32) = (
                a.map(|x| x as i32),
                b.map(|x| x as i32),
                c.map(|x| x as i32),
            );
            let mut o = [0i32; 3];
            reduce(
                &[
                    HostSlice::I32(&a32),
                    HostSlice::I32(&b32),
                    HostSlice::I32(&c32),
                ],
                HostSliceMut::I32(&mut o),
                op,
            )
            .unwrap();
            assert_eq!(o.map(i64::from).to_vec(), want, "i32 {op}");
            let f = |v: [i64; 3]| v.map(|x| f16::from_f64(x as f64));
            let (fa, fb, fc) = (f(a), f(b), f(c));
            let mut o = [f16::ZERO; 3];
            reduce(
                &[
                    HostSlice::F16(&fa),
                    HostSlice::F16(&fb),
                    HostSlice::F16(&fc),
                ],
                HostSliceMut::F16(&mut o),
                op,
            )
            .unwrap();
            let wantf: Vec<f64> = if op == ReduceOp::Avg {
                (0..3)
                    .map(|i| f16::from_f32((a[i] + b[i] + c[i]) as f32 / 3.0).to_f64())
                    .collect()
            } else {
                want.iter().map(|&x| x as f64).collect()
            };
            assert_eq!(o.map(f16::to_f64).to_vec(), wantf, "f16 {op}");
        }
    }

    /// The pairwise step agrees with `reduce` over two inputs for every dtype and reduction
    /// (except `Avg`, which combines as a sum), including across the half types' block edge.
    #[test]
    fn accumulate_matches_reduce_of_two() {
        let n = 1100;
        let a: Vec<f64> = (0..n).map(|i| ((i * 7) % 23) as f64 - 9.0).collect();
        let b: Vec<f64> = (0..n).map(|i| ((i * 5) % 19) as f64 - 4.5).collect();
        macro_rules! check {
            ($v:ident, $conv:expr) => {{
                let x: Vec<_> = a.iter().map(|&v| $conv(v)).collect();
                let y: Vec<_> = b.iter().map(|&v| $conv(v)).collect();
                for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                    let mut want = x.clone();
                    reduce(
                        &[HostSlice::$v(&x), HostSlice::$v(&y)],
                        HostSliceMut::$v(&mut want),
                        op,
                    )
                    .unwrap();
                    let mut got = x.clone();
                    accumulate(HostSliceMut::$v(&mut got), HostSlice::$v(&y), op).unwrap();
                    assert_eq!(got, want, "{} {op}", stringify!($v));
                }
                let mut got = x.clone();
                accumulate(HostSliceMut::$v(&mut got), HostSlice::$v(&y), ReduceOp::Avg).unwrap();
                let mut sum = x.clone();
                accumulate(HostSliceMut::$v(&mut sum), HostSlice::$v(&y), ReduceOp::Sum).unwrap();
                assert_eq!(got, sum, "{} avg combines as a sum", stringify!($v));
            }};
        }
        check!(F32, |v: f64| v as f32);
        check!(F64, |v: f64| v);
        check!(F16, f16::from_f64);
        check!(BF16, bf16::from_f64);
        check!(I32, |v: f64| (v * 2.0) as i32);
        check!(I64, |v: f64| (v * 2.0) as i64);
        check!(U8, |v: f64| (v * 2.0 + 40.0) as u8);
        let mut acc = [250u8, 1];
        accumulate(
            HostSliceMut::U8(&mut acc),
            HostSlice::U8(&[10, 2]),
            ReduceOp::Sum,
        )
        .unwrap();
        assert_eq!(acc, [4, 3], "u8 wraps");
        let mut acc = [1.0f32];
        assert!(matches!(
            accumulate(
                HostSliceMut::F32(&mut acc),
                HostSlice::F64(&[1.0]),
                ReduceOp::Sum
            ),
            Err(Error::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn u8_wraps_and_averages_exactly() {
        let a = [250u8, 3];
        let b = [10u8, 4];
        let mut o = [0u8; 2];
        reduce(
            &[HostSlice::U8(&a), HostSlice::U8(&b)],
            HostSliceMut::U8(&mut o),
            ReduceOp::Sum,
        )
        .unwrap();
        assert_eq!(o, [4, 7]);
        reduce(
            &[HostSlice::U8(&a), HostSlice::U8(&b)],
            HostSliceMut::U8(&mut o),
            ReduceOp::Avg,
        )
        .unwrap();
        assert_eq!(o, [130, 3]);
    }

    #[test]
    fn mismatches_are_errors() {
        let a = [1.0f32];
        let b = [1.0f64];
        let mut o = [0f32];
        assert!(matches!(
            reduce(
                &[HostSlice::F32(&a), HostSlice::F64(&b)],
                HostSliceMut::F32(&mut o),
                ReduceOp::Sum
            ),
            Err(Error::DTypeMismatch { .. })
        ));
        let mut o2 = [0f32; 2];
        assert!(matches!(
            reduce(
                &[HostSlice::F32(&a)],
                HostSliceMut::F32(&mut o2),
                ReduceOp::Sum
            ),
            Err(Error::LengthMismatch {
                expected: 2,
                actual: 1,
                ..
            })
        ));
        assert!(reduce(&[], HostSliceMut::F32(&mut o), ReduceOp::Sum).is_err());
    }

    #[test]
    fn min_and_max_propagate_nan_from_any_rank() {
        for op in [ReduceOp::Min, ReduceOp::Max] {
            for nan_first in [true, false] {
                let (a, b) = if nan_first {
                    ([f32::NAN, 1.0], [2.0f32, 3.0])
                } else {
                    ([2.0f32, 1.0], [f32::NAN, 3.0])
                };
                let mut out = [0f32; 2];
                reduce(
                    &[HostSlice::F32(&a), HostSlice::F32(&b)],
                    HostSliceMut::F32(&mut out),
                    op,
                )
                .unwrap();
                assert!(out[0].is_nan(), "{op} nan_first={nan_first}: {out:?}");
                assert!(!out[1].is_nan());
                let mut acc = a;
                accumulate(HostSliceMut::F32(&mut acc), HostSlice::F32(&b), op).unwrap();
                assert!(
                    acc[0].is_nan(),
                    "accumulate {op} nan_first={nan_first}: {acc:?}"
                );
                let ha = a.map(bf16::from_f32);
                let hb = b.map(bf16::from_f32);
                let mut hout = [bf16::ZERO; 2];
                reduce(
                    &[HostSlice::BF16(&ha), HostSlice::BF16(&hb)],
                    HostSliceMut::BF16(&mut hout),
                    op,
                )
                .unwrap();
                assert!(hout[0].is_nan(), "bf16 {op} nan_first={nan_first}");
                let fa = a.map(f16::from_f32);
                let mut facc = fa;
                accumulate(
                    HostSliceMut::F16(&mut facc),
                    HostSlice::F16(&b.map(f16::from_f32)),
                    op,
                )
                .unwrap();
                assert!(
                    facc[0].is_nan(),
                    "f16 accumulate {op} nan_first={nan_first}"
                );
            }
        }
    }
}
