//! One-byte element types that Rust has no primitive for, or whose primitive is unsafe to
//! receive from a peer: a byte-sized boolean ([`Bool`]) and the two 8-bit floating-point formats
//! of the OCP FP8 specification that NCCL reduces ([`F8E4M3`], [`F8E5M2`]).
//!
//! Each is `#[repr(transparent)]` over `u8` and **every byte is a valid value**, so a backend
//! may write whatever bytes arrive from the network into a slice of them: a Rust `bool` holding
//! any byte but 0 or 1 would be undefined behaviour, a [`Bool`] holding 7 is simply true.

use std::cmp::Ordering;
use std::fmt;

/// A boolean stored in one byte: zero is false, **any** other byte is true.
///
/// Reductions over [`crate::DType::Bool`]: `Sum` and `Max` are logical OR, `Prod` and `Min`
/// logical AND (computed as the byte maximum and minimum, which is exact for any bytes:
/// `max(a, b) != 0` iff `a != 0 || b != 0`); `Avg` has no meaning and is refused.
///
/// ```
/// use grid_core::Bool;
/// let flags = [Bool::from(true), Bool::FALSE];
/// assert!(flags[0].get() && !flags[1].get());
/// assert_eq!(Bool::from_byte(7), Bool::TRUE); // any non-zero byte is true
/// assert_eq!(bool::from(Bool::from_byte(7)), true);
/// ```
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct Bool(u8);

impl Bool {
    /// False (the byte 0).
    pub const FALSE: Bool = Bool(0);
    /// True (the byte 1).
    pub const TRUE: Bool = Bool(1);
    /// The boolean a byte stands for (0: false, anything else: true), keeping the byte.
    #[inline]
    pub const fn from_byte(b: u8) -> Bool {
        Bool(b)
    }
    /// The stored byte (as received: not normalised to 0 or 1).
    #[inline]
    pub const fn to_byte(self) -> u8 {
        self.0
    }
    /// The boolean value.
    #[inline]
    pub const fn get(self) -> bool {
        self.0 != 0
    }
    /// The stored byte as an array (as the integer types' `to_le_bytes`).
    #[inline]
    pub const fn to_le_bytes(self) -> [u8; 1] {
        [self.0]
    }
    /// The value whose stored byte is `b[0]` (as the integer types' `from_le_bytes`).
    #[inline]
    pub const fn from_le_bytes(b: [u8; 1]) -> Bool {
        Bool(b[0])
    }
}

impl From<bool> for Bool {
    #[inline]
    fn from(b: bool) -> Bool {
        Bool(u8::from(b))
    }
}

impl From<Bool> for bool {
    #[inline]
    fn from(b: Bool) -> bool {
        b.get()
    }
}

/// Equality is of the boolean values: `Bool::from_byte(2) == Bool::TRUE`.
impl PartialEq for Bool {
    fn eq(&self, other: &Bool) -> bool {
        self.get() == other.get()
    }
}
impl Eq for Bool {}

impl fmt::Debug for Bool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.get(), f)
    }
}

impl fmt::Display for Bool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.get(), f)
    }
}

/// The parameters of one 8-bit float format: exponent bits, mantissa bits, and whether the
/// all-ones exponent is reserved for infinities and NaNs (IEEE style, E5M2) or only the single
/// all-ones pattern is NaN and there is no infinity (E4M3 "fn").
struct Format {
    exp_bits: u32,
    man_bits: u32,
    ieee: bool,
}

impl Format {
    const fn bias(&self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }
    /// The largest finite positive code.
    const fn max_code(&self) -> u8 {
        if self.ieee {
            // Exponent all ones is inf/NaN: the largest finite has exponent all ones minus one.
            (((1u32 << self.exp_bits) - 2) << self.man_bits | ((1 << self.man_bits) - 1)) as u8
        } else {
            // Only S.1111.111 is NaN: S.1111.110 is the largest finite.
            0x7e
        }
    }
    fn is_nan(&self, bits: u8) -> bool {
        let mag = bits & 0x7f;
        if self.ieee {
            let exp_all = (((1u32 << self.exp_bits) - 1) << self.man_bits) as u8;
            mag & exp_all == exp_all && mag & ((1 << self.man_bits) - 1) != 0
        } else {
            mag == 0x7f
        }
    }
    fn is_inf(&self, bits: u8) -> bool {
        self.ieee && bits & 0x7f == (((1u32 << self.exp_bits) - 1) << self.man_bits) as u8
    }
    /// The value of a code (exact in f32).
    fn decode(&self, bits: u8) -> f32 {
        let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
        if self.is_nan(bits) {
            return f32::NAN;
        }
        if self.is_inf(bits) {
            return sign * f32::INFINITY;
        }
        let mag = u32::from(bits & 0x7f);
        let exp = (mag >> self.man_bits) as i32;
        let man = (mag & ((1 << self.man_bits) - 1)) as f32;
        let scale = (1u32 << self.man_bits) as f32;
        let v = if exp == 0 {
            // Subnormal: 2^(1 - bias) · m / 2^man_bits.
            man / scale * 2f32.powi(1 - self.bias())
        } else {
            (1.0 + man / scale) * 2f32.powi(exp - self.bias())
        };
        sign * v
    }
    /// The nearest code to `x`, ties to the even code; magnitudes beyond the largest finite
    /// value by more than half a step (or by exactly half, when the tie goes up) overflow to infinity (E5M2) or NaN (E4M3, which has no
    /// infinity), as PyTorch's conversions do; NaN stays NaN.
    fn encode(&self, x: f32) -> u8 {
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        let nan = if self.ieee {
            (((1u32 << self.exp_bits) - 1) << self.man_bits | 1) as u8
        } else {
            0x7f
        };
        if x.is_nan() {
            return nan;
        }
        let a = x.abs();
        let max = self.max_code();
        let top = self.decode(max);
        let step = top - self.decode(max - 1);
        let overflow = if self.ieee {
            (((1u32 << self.exp_bits) - 1) << self.man_bits) as u8 // infinity
        } else {
            nan
        };
        let mid = top + step / 2.0;
        // Past the midpoint to the next (unrepresentable) step: overflow. At the midpoint, ties
        // go to the even neighbour: the largest finite code when it is even (E4M3's 0x7e), the
        // overflow otherwise (E5M2's 0x7b is odd), as IEEE and PyTorch round.
        if a > mid || (a == mid && max % 2 == 1) {
            return sign | overflow;
        }
        if a >= top {
            return sign | max;
        }
        // Positive codes 0..=max are increasing in value: binary search the last code <= a.
        let (mut lo, mut hi) = (0u8, max);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.decode(mid) <= a {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let below = self.decode(lo);
        if below == a {
            return sign | lo;
        }
        let above = self.decode(lo + 1);
        let code = match (a - below).partial_cmp(&(above - a)) {
            Some(Ordering::Less) => lo,
            Some(Ordering::Greater) => lo + 1,
            _ => {
                if lo % 2 == 0 {
                    lo
                } else {
                    lo + 1
                }
            }
        };
        sign | code
    }
}

const E4M3: Format = Format {
    exp_bits: 4,
    man_bits: 3,
    ieee: false,
};
const E5M2: Format = Format {
    exp_bits: 5,
    man_bits: 2,
    ieee: true,
};

macro_rules! fp8 {
    ($name:ident, $fmt:ident, $doc:literal, $example:literal) => {
        #[doc = $doc]
        ///
        /// Conversions round to the nearest value, ties to even; see [`Self::from_f32`].
        ///
        /// ```
        #[doc = $example]
        /// ```
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(u8);

        impl $name {
            /// The value with this bit pattern.
            #[inline]
            pub const fn from_bits(bits: u8) -> $name {
                $name(bits)
            }
            /// The bit pattern.
            #[inline]
            pub const fn to_bits(self) -> u8 {
                self.0
            }
            /// The bit pattern as an array (as the integer types' `to_le_bytes`).
            #[inline]
            pub const fn to_le_bytes(self) -> [u8; 1] {
                [self.0]
            }
            /// The value with the bit pattern `b[0]` (as the integer types' `from_le_bytes`).
            #[inline]
            pub const fn from_le_bytes(b: [u8; 1]) -> $name {
                $name(b[0])
            }
            /// The value, exactly, as an `f32`.
            pub fn to_f32(self) -> f32 {
                $fmt.decode(self.0)
            }
            /// The nearest value to `x` (ties to even). Magnitudes that round past the
            /// largest finite value become infinity in E5M2 and NaN in E4M3 (which
            /// has no infinity); NaN stays NaN.
            pub fn from_f32(x: f32) -> $name {
                $name($fmt.encode(x))
            }
            /// True for a NaN pattern.
            pub fn is_nan(self) -> bool {
                $fmt.is_nan(self.0)
            }
            /// The largest finite value.
            pub fn max_value() -> $name {
                $name($fmt.max_code())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.to_f32())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.to_f32(), f)
            }
        }
    };
}

fp8!(
    F8E4M3,
    E4M3,
    "An 8-bit float in the OCP FP8 **E4M3** format (NVIDIA's `e4m3fn`, NCCL's \
     `ncclFloat8e4m3`): 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, NaN \
     only as `S.1111.111`; largest finite value 448, smallest subnormal 2^-9.",
    "use grid_core::F8E4M3;\nassert_eq!(F8E4M3::from_f32(1.5).to_f32(), 1.5);\nassert_eq!(F8E4M3::max_value().to_f32(), 448.0);\nassert_eq!(F8E4M3::from_f32(0.3).to_f32(), 0.3125); // nearest\nassert!(F8E4M3::from_f32(1e6).is_nan()); // no infinity"
);
fp8!(
    F8E5M2,
    E5M2,
    "An 8-bit float in the OCP FP8 **E5M2** format (NCCL's `ncclFloat8e5m2`): 1 sign, \
     5 exponent (bias 15) and 2 mantissa bits, IEEE-style infinities and NaNs; largest finite \
     value 57344, smallest subnormal 2^-16.",
    "use grid_core::F8E5M2;\nassert_eq!(F8E5M2::from_f32(-3.0).to_f32(), -3.0);\nassert_eq!(F8E5M2::max_value().to_f32(), 57344.0);\nassert_eq!(F8E5M2::from_f32(1e6).to_f32(), f32::INFINITY);"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            for (fmt, name) in [(&E4M3, "e4m3"), (&E5M2, "e5m2")] {
                let v = fmt.decode(b);
                if v.is_nan() {
                    assert!(fmt.is_nan(b), "{name} {b:#x}");
                    assert!(fmt.is_nan(fmt.encode(v)));
                } else {
                    // -0.0 and 0.0 keep their sign bit.
                    assert_eq!(fmt.encode(v), b, "{name} {b:#x} = {v}");
                }
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(E4M3.decode(0x7e), 448.0);
        assert_eq!(E4M3.decode(0x38), 1.0);
        assert_eq!(E5M2.decode(0x01), 2f32.powi(-16));
        assert_eq!(E5M2.decode(0x7b), 57344.0);
        assert_eq!(E5M2.decode(0x3c), 1.0);
        assert_eq!(E5M2.decode(0x7c), f32::INFINITY);
        assert_eq!(E5M2.decode(0xfc), f32::NEG_INFINITY);
        assert!(E5M2.decode(0x7d).is_nan());
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        // Between 1.0 (0x38) and 1.125 (0x39) in E4M3: the midpoint goes to the even code.
        assert_eq!(E4M3.encode(1.0625), 0x38);
        assert_eq!(E4M3.encode(1.07), 0x39);
        // Between 1.125 (0x39) and 1.25 (0x3a): the midpoint goes to 0x3a.
        assert_eq!(E4M3.encode(1.1875), 0x3a);
        // Overflow: below the midpoint to the next step saturates to the largest finite.
        assert_eq!(E4M3.encode(460.0), 0x7e);
        assert_eq!(E4M3.encode(464.0), 0x7e); // the midpoint: 0x7e is even
        assert_eq!(E4M3.encode(470.0), 0x7f);
        assert_eq!(E5M2.encode(60000.0), 0x7b);
        assert_eq!(E5M2.encode(61440.0), 0x7c);
        assert_eq!(E5M2.encode(-1e9), 0xfc);
        // Tiny values round to zero or the smallest subnormal.
        assert_eq!(E4M3.encode(2f32.powi(-11)), 0x00);
        assert_eq!(E4M3.encode(2f32.powi(-10) * 1.01), 0x01);
    }

    #[test]
    fn bool_semantics() {
        assert_eq!(Bool::from_byte(200), Bool::TRUE);
        assert_ne!(Bool::FALSE, Bool::TRUE);
        assert_eq!(Bool::from_byte(200).to_byte(), 200);
        assert_eq!(format!("{:?}", Bool::from_byte(3)), "true");
    }
}
