//! Inputs and expected values: the element types the suite computes with ([`Num`]), each
//! rank's input for a reduction, the exact reduced value and the tolerance for averages.

use grid_core::{Element, ReduceOp};
use half::{bf16, f16};

/// Element types the suite can compute expected values for.
pub(crate) trait Num: Element {
    const SIGNED: bool;
    /// Unit roundoff (0 for integers).
    const EPS: f64;
    fn of(v: i64) -> Self;
    fn of_f64(v: f64) -> Self;
    fn f64(self) -> f64;
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
num_int!(u8, false);

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
    let vals = (0..n).map(|r| input(op, T::SIGNED, r, i));
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
