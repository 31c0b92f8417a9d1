//! Inputs and expected values: the element types the suite computes with ([`Num`]), each
//! rank's input for a reduction, the exact reduced value and the tolerance for averages.

use grid_core::{Bool, Element, ReduceOp, F8E4M3, F8E5M2};
use half::{bf16, f16};

/// Element types the suite can compute expected values for.
pub(crate) trait Num: Element {
    const SIGNED: bool;
    /// Unit roundoff (0 for integers and bool).
    const EPS: f64;
    /// The largest group whose reductions have exact expected values in this type (larger
    /// groups skip the reductions, recorded).
    const EXACT_UP_TO: usize = usize::MAX;
    /// The number `v` in this type (bool: `v != 0`).
    fn of(v: i64) -> Self;
    fn of_f64(v: f64) -> Self;
    fn f64(self) -> f64;
    /// A value for moving data (no arithmetic): distinct for distinct `v` in `0..251` in every
    /// type with at least 251 values; fp8 maps `v` to a finite bit pattern, bool to `v` odd.
    fn tag(v: usize) -> Self {
        Self::of(small(v))
    }
    /// Input of rank `r`, element `i`, for reduction `op`, as an integer.
    fn input_of(op: ReduceOp, r: usize, i: usize) -> i64 {
        input(op, Self::SIGNED, r, i)
    }
}

/// Input of rank `r`, element `i`, for reduction `op`, in `T`.
pub(crate) fn value_in<T: Num>(op: ReduceOp, r: usize, i: usize) -> T {
    T::of(T::input_of(op, r, i))
}

macro_rules! num_int {
    ($t:ty, $signed:expr) => {
        impl Num for $t {
            const SIGNED: bool = $signed;
            const EPS: f64 = 0.0;
            fn of(v: i64) -> Self {
                v as $t
            }
            fn of_f64(v: f64) -> Self {
                v as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
        }
    };
}
num_int!(i32, true);
num_int!(i64, true);
num_int!(u32, false);
num_int!(u64, false);

impl Num for u8 {
    const SIGNED: bool = false;
    const EPS: f64 = 0.0;
    const EXACT_UP_TO: usize = 16;
    fn of(v: i64) -> Self {
        v as u8
    }
    fn of_f64(v: f64) -> Self {
        v as u8
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

/// i8: sums wrap like the i64 expected value cast to i8, but the average divides the wrapped
/// sum, so groups stay at 8 ranks (sums of the inputs stay within -128..=127 there).
impl Num for i8 {
    const SIGNED: bool = true;
    const EPS: f64 = 0.0;
    const EXACT_UP_TO: usize = 8;
    fn of(v: i64) -> Self {
        v as i8
    }
    fn of_f64(v: f64) -> Self {
        v as i8
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

/// Bool: sums and maxima are OR, products and minima AND, computed here on 0/1 inputs as the
/// integer reduction (sum != 0 is OR, product of 0/1 is AND). Inputs: element `i % 4 == 0`
/// false everywhere, `== 1` true everywhere, `== 2` true on even ranks, `== 3` true on rank 0
/// only, so OR and AND differ on mixed elements.
impl Num for Bool {
    const SIGNED: bool = false;
    const EPS: f64 = 0.0;
    fn of(v: i64) -> Self {
        Bool::from(v != 0)
    }
    fn of_f64(v: f64) -> Self {
        Bool::from(v != 0.0)
    }
    fn f64(self) -> f64 {
        if self.get() {
            1.0
        } else {
            0.0
        }
    }
    fn tag(v: usize) -> Self {
        Bool::from(v % 2 == 1)
    }
    fn input_of(_op: ReduceOp, r: usize, i: usize) -> i64 {
        let b = match i % 4 {
            0 => false,
            1 => true,
            2 => r.is_multiple_of(2),
            _ => r == 0,
        };
        i64::from(b)
    }
}

/// A finite fp8 bit pattern for `v`: `v mod 240` → positive patterns 0x00..=0x77, then the
/// negative ones 0x81..=0xf8 (no -0, no infinity, no NaN in either format), so equality of
/// values and of bits agree.
fn fp8_bits(v: usize) -> u8 {
    let b = v % 240;
    if b < 120 {
        b as u8
    } else {
        0x80 | (b - 119) as u8
    }
}

/// fp8 sum/avg inputs are 0 or ±1 (sums of up to 16 ranks are integers within ±8, exact in
/// both formats); products and min/max use the common inputs (powers of two up to 2^6, and
/// -3..=3).
fn fp8_input(op: ReduceOp, r: usize, i: usize) -> i64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let on = (r + i).is_multiple_of(3);
            let v = i64::from(on);
            if i % 2 == 1 && r % 2 == 1 {
                -v
            } else {
                v
            }
        }
        _ => input(op, true, r, i),
    }
}

macro_rules! num_fp8 {
    ($t:ty, $eps:expr) => {
        impl Num for $t {
            const SIGNED: bool = true;
            const EPS: f64 = $eps;
            const EXACT_UP_TO: usize = 16;
            fn of(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
            fn of_f64(v: f64) -> Self {
                <$t>::from_f32(v as f32)
            }
            fn f64(self) -> f64 {
                self.to_f32() as f64
            }
            fn tag(v: usize) -> Self {
                <$t>::from_bits(fp8_bits(v))
            }
            fn input_of(op: ReduceOp, r: usize, i: usize) -> i64 {
                fp8_input(op, r, i)
            }
        }
    };
}
num_fp8!(F8E4M3, 0.0625); // 3 mantissa bits: 2^-4
num_fp8!(F8E5M2, 0.125); // 2 mantissa bits: 2^-3

impl Num for f32 {
    const SIGNED: bool = true;
    const EPS: f64 = f32::EPSILON as f64;
    fn of(v: i64) -> Self {
        v as f32
    }
    fn of_f64(v: f64) -> Self {
        v as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}
impl Num for f64 {
    const SIGNED: bool = true;
    const EPS: f64 = f64::EPSILON;
    fn of(v: i64) -> Self {
        v as f64
    }
    fn of_f64(v: f64) -> Self {
        v
    }
    fn f64(self) -> f64 {
        self
    }
}
impl Num for f16 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: usize = 16;
    const EPS: f64 = 0.0009765625; // 2^-10
    fn of(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
    fn of_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn f64(self) -> f64 {
        self.to_f64()
    }
}
impl Num for bf16 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: usize = 16;
    const EPS: f64 = 0.0078125; // 2^-7
    fn of(v: i64) -> Self {
        bf16::from_f64(v as f64)
    }
    fn of_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn f64(self) -> f64 {
        self.to_f64()
    }
}

/// Input of rank `r`, element `i`, for reduction `op` (see the crate docs).
pub(crate) fn input(op: ReduceOp, signed: bool, r: usize, i: usize) -> i64 {
    let (r, i) = (r as i64, i as i64);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let a = r % 8 + 1;
            let s = if signed && i % 2 == 1 { -a } else { a };
            s + i % 5
        }
        ReduceOp::Prod => {
            let m = if (r + i) % 3 == 0 { 2 } else { 1 };
            if signed && (r + 2 * i) % 4 == 1 {
                -m
            } else {
                m
            }
        }
        ReduceOp::Min | ReduceOp::Max => {
            let v = (3 * r + i) % 7;
            if signed {
                v - 3
            } else {
                v
            }
        }
    }
}

/// Exact reduction over ranks `0..n` of element `i`, as an i64 (and the float mean for Avg).
pub(crate) fn reduce_expected<T: Num>(op: ReduceOp, n: usize, i: usize) -> T {
    let vals = (0..n).map(|r| T::input_of(op, r, i));
    match op {
        ReduceOp::Sum => T::of(vals.sum()),
        ReduceOp::Prod => T::of(vals.product()),
        ReduceOp::Min => T::of(vals.min().unwrap_or(0)),
        ReduceOp::Max => T::of(vals.max().unwrap_or(0)),
        ReduceOp::Avg => {
            let s: i64 = vals.sum();
            if T::EPS > 0.0 {
                T::of_f64(s as f64 / n as f64)
            } else {
                T::of(s / n as i64)
            }
        }
    }
}

pub(crate) fn close<T: Num>(op: ReduceOp, n: usize, e: T, a: T) -> bool {
    if e == a {
        return true;
    }
    // Averages over group sizes that are not powers of two may differ by double rounding.
    op == ReduceOp::Avg
        && T::EPS > 0.0
        && !n.is_power_of_two()
        && (e.f64() - a.f64()).abs() <= e.f64().abs() * 2.0 * T::EPS
}

/// A small byte-sized value (exact in every dtype).
pub(crate) fn small(v: usize) -> i64 {
    (v % 251) as i64
}

/// Elements per rank in the per-dtype reduction checks.
pub(crate) const K: usize = 5;
