//! Element types, reductions and type-erased host slices.

use super::narrow::{Bool, F8E4M3, F8E5M2};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::fmt;

/// Element types the traits can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit signed integer.
    I8,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit unsigned integer.
    U64,
    /// A boolean in one byte ([`super::Bool`]: zero false, any other byte true). Reductions:
    /// `Sum` and `Max` are OR, `Prod` and `Min` AND; `Avg` is refused.
    Bool,
    /// 8-bit float, OCP FP8 E4M3 ([`super::F8E4M3`]).
    F8E4M3,
    /// 8-bit float, OCP FP8 E5M2 ([`super::F8E5M2`]).
    F8E5M2,
}

impl DType {
    /// Every dtype (the first seven in the order they were added; codes derived from positions
    /// in this list stay stable as types are added at the end).
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U32,
        DType::U64,
        DType::Bool,
        DType::F8E4M3,
        DType::F8E5M2,
    ];
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::U8 | DType::I8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// True for floating-point types (the 8-bit floats included).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }
    /// True for the two 8-bit float formats, which the host backends move but do not reduce.
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }
    /// True for the integer types (signed and unsigned; not [`DType::Bool`]).
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64
        )
    }
    /// Whether `op` has a meaning for this type at all, whatever the backend: `Avg` of
    /// booleans does not. (Which pairs a backend actually runs is its
    /// [`super::Communicator::supports`].)
    pub fn reducible_with(self, op: ReduceOp) -> bool {
        !(self == DType::Bool && op == ReduceOp::Avg)
    }
}

impl DType {
    /// The lowercase name (`f32`, `bf16`, ...), as `Display` writes it and the operation log
    /// records it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the communicator size (floats only; integer division where a backend
    /// documents it).
    Avg,
}

impl ReduceOp {
    /// Every reduction.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type that can travel through a communicator.
pub trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static + sealed::Sealed {
    /// The dtype tag.
    const DTYPE: DType;
    /// Wraps a slice.
    fn host(s: &[Self]) -> HostSlice<'_>;
    /// Wraps a mutable slice.
    fn host_mut(s: &mut [Self]) -> HostSliceMut<'_>;
    /// Wraps a vector.
    fn owned(v: Vec<Self>) -> HostBuffer;
    /// Unwraps a vector of this type.
    fn from_owned(b: HostBuffer) -> std::result::Result<Vec<Self>, HostBuffer>;
    /// Views an erased slice as this type.
    fn view(s: HostSlice<'_>) -> Option<&[Self]>;
    /// Views an erased mutable slice as this type.
    fn view_mut(s: HostSliceMut<'_>) -> Option<&mut [Self]>;
}

macro_rules! dtypes {
    ($($variant:ident => $t:ty),* $(,)?) => {
        /// A borrowed host slice of any supported element type.
        #[derive(Debug, Clone, Copy)]
        pub enum HostSlice<'a> { $( #[doc = stringify!($t)] $variant(&'a [$t]), )* }
        /// A mutably borrowed host slice of any supported element type.
        #[derive(Debug)]
        pub enum HostSliceMut<'a> { $( #[doc = stringify!($t)] $variant(&'a mut [$t]), )* }
        /// An owned host buffer of any supported element type.
        #[derive(Debug, Clone, PartialEq)]
        pub enum HostBuffer { $( #[doc = stringify!($t)] $variant(Vec<$t>), )* }

        impl<'a> HostSlice<'a> {
            /// Elements `start..start + len`, or `None` when that range is out of bounds.
            pub fn sub(&self, start: usize, len: usize) -> Option<HostSlice<'a>> {
                let end = start.checked_add(len)?;
                match *self { $( HostSlice::$variant(s) => s.get(start..end).map(HostSlice::$variant), )* }
            }
            /// Element type.
            #[inline]
            pub fn dtype(&self) -> DType { match self { $( HostSlice::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            #[inline]
            pub fn len(&self) -> usize { match self { $( HostSlice::$variant(s) => s.len(), )* } }
            /// True when empty.
            #[inline]
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// Start of the memory.
            #[inline]
            pub fn as_ptr(&self) -> *const u8 { match self { $( HostSlice::$variant(s) => s.as_ptr() as *const u8, )* } }
            /// An owned copy.
            pub fn to_owned_buffer(&self) -> HostBuffer { match self { $( HostSlice::$variant(s) => HostBuffer::$variant(s.to_vec()), )* } }
            /// Writes the elements as little-endian bytes into `out`, which must hold exactly
            /// `len · dtype size` bytes (an error naming both lengths otherwise; nothing
            /// written). Messages that mix element types travel as bytes this way.
            pub fn write_le_bytes(&self, out: &mut [u8]) -> Result<()> {
                match self { $( HostSlice::$variant(s) => {
                    const W: usize = std::mem::size_of::<$t>();
                    if out.len() != s.len() * W {
                        return Err(Error::Invalid(format!("{} {} elements are {} bytes, not {}", s.len(), DType::$variant, s.len() * W, out.len())));
                    }
                    for (o, x) in out.chunks_exact_mut(W).zip(s.iter()) { o.copy_from_slice(&x.to_le_bytes()); }
                    Ok(())
                } )* }
            }
        }
        impl<'a> HostSliceMut<'a> {
            /// Element type.
            #[inline]
            pub fn dtype(&self) -> DType { match self { $( HostSliceMut::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            #[inline]
            pub fn len(&self) -> usize { match self { $( HostSliceMut::$variant(s) => s.len(), )* } }
            /// True when empty.
            #[inline]
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// Start of the memory.
            #[inline]
            pub fn as_mut_ptr(&mut self) -> *mut u8 { match self { $( HostSliceMut::$variant(s) => s.as_mut_ptr() as *mut u8, )* } }
            /// Elements `start..start + len`, mutably, or `None` when that range is out of bounds.
            pub fn sub_mut(&mut self, start: usize, len: usize) -> Option<HostSliceMut<'_>> {
                let end = start.checked_add(len)?;
                match self { $( HostSliceMut::$variant(s) => s.get_mut(start..end).map(|x| HostSliceMut::$variant(x)), )* }
            }
            /// Copies elements `src..src + len` to `dest..dest + len` within this slice (the two
            /// ranges may overlap, as `slice::copy_within`); an error, with nothing copied, when
            /// either range ends past the slice.
            pub fn copy_within(&mut self, src: usize, len: usize, dest: usize) -> Result<()> {
                let n = self.len();
                let fits = |at: usize| at.checked_add(len).is_some_and(|end| end <= n);
                if !fits(src) || !fits(dest) {
                    return Err(Error::Invalid(format!("copy of elements {src}..+{len} to {dest}..+{len} within a slice of {n} elements")));
                }
                match self { $( HostSliceMut::$variant(s) => s.copy_within(src..src + len, dest), )* }
                Ok(())
            }
            /// A shorter-lived reborrow.
            #[inline]
            pub fn reborrow(&mut self) -> HostSliceMut<'_> { match self { $( HostSliceMut::$variant(s) => HostSliceMut::$variant(&mut s[..]), )* } }
            /// A shared view.
            #[inline]
            pub fn as_slice(&self) -> HostSlice<'_> { match self { $( HostSliceMut::$variant(s) => HostSlice::$variant(&s[..]), )* } }
            /// Reads the elements from little-endian `bytes` ([`HostSlice::write_le_bytes`]),
            /// which must hold exactly `len · dtype size` bytes (an error naming both lengths
            /// otherwise; nothing read).
            pub fn read_le_bytes(&mut self, bytes: &[u8]) -> Result<()> {
                match self { $( HostSliceMut::$variant(s) => {
                    const W: usize = std::mem::size_of::<$t>();
                    if bytes.len() != s.len() * W {
                        return Err(Error::Invalid(format!("{} {} elements are {} bytes, not {}", s.len(), DType::$variant, s.len() * W, bytes.len())));
                    }
                    for (x, b) in s.iter_mut().zip(bytes.chunks_exact(W)) {
                        let mut a = [0u8; W];
                        a.copy_from_slice(b);
                        *x = <$t>::from_le_bytes(a);
                    }
                    Ok(())
                } )* }
            }
            /// Copies `src` (same dtype and length) into this slice.
            pub fn copy_from(&mut self, src: HostSlice<'_>) -> Result<()> {
                match (self, src) {
                    $( (HostSliceMut::$variant(d), HostSlice::$variant(s)) if d.len() == s.len() => { d.copy_from_slice(s); Ok(()) } )*
                    (d, s) => Err(Error::Invalid(format!("copy of {} {} elements into {} {} elements", s.len(), s.dtype(), d.len(), d.dtype()))),
                }
            }
        }
        impl HostBuffer {
            /// Element type.
            #[inline]
            pub fn dtype(&self) -> DType { match self { $( HostBuffer::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            #[inline]
            pub fn len(&self) -> usize { match self { $( HostBuffer::$variant(s) => s.len(), )* } }
            /// True when empty.
            #[inline]
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// A borrowed view.
            #[inline]
            pub fn as_slice(&self) -> HostSlice<'_> { match self { $( HostBuffer::$variant(s) => HostSlice::$variant(&s[..]), )* } }
            /// A mutable view.
            #[inline]
            pub fn as_mut_slice(&mut self) -> HostSliceMut<'_> { match self { $( HostBuffer::$variant(s) => HostSliceMut::$variant(&mut s[..]), )* } }
            /// A zero-filled buffer of `len` elements of `dtype`.
            pub fn zeros(dtype: DType, len: usize) -> HostBuffer {
                match dtype { $( DType::$variant => HostBuffer::$variant(vec![<$t as Zero>::ZERO; len]), )* }
            }
            /// A zero-filled buffer of `len` elements of `dtype` in an allocation of
            /// `max(len, capacity)` elements (zero-filled too, so that memory the operating
            /// system maps fresh is not written: only the pages a program uses are ever touched).
            pub fn zeros_in(dtype: DType, len: usize, capacity: usize) -> HostBuffer {
                match dtype { $( DType::$variant => HostBuffer::$variant({
                    let mut v = vec![<$t as Zero>::ZERO; len.max(capacity)];
                    v.truncate(len);
                    v
                }), )* }
            }
        }
        $(
            impl sealed::Sealed for $t {}
            impl Element for $t {
                const DTYPE: DType = DType::$variant;
                fn host(s: &[Self]) -> HostSlice<'_> { HostSlice::$variant(s) }
                fn host_mut(s: &mut [Self]) -> HostSliceMut<'_> { HostSliceMut::$variant(s) }
                fn owned(v: Vec<Self>) -> HostBuffer { HostBuffer::$variant(v) }
                fn from_owned(b: HostBuffer) -> std::result::Result<Vec<Self>, HostBuffer> {
                    match b { HostBuffer::$variant(v) => Ok(v), other => Err(other) }
                }
                fn view(s: HostSlice<'_>) -> Option<&[Self]> {
                    match s { HostSlice::$variant(v) => Some(v), _ => None }
                }
                fn view_mut(s: HostSliceMut<'_>) -> Option<&mut [Self]> {
                    match s { HostSliceMut::$variant(v) => Some(v), _ => None }
                }
            }
        )*
    };
}

trait Zero {
    const ZERO: Self;
}
impl Zero for f32 {
    const ZERO: f32 = 0.0;
}
impl Zero for f64 {
    const ZERO: f64 = 0.0;
}
impl Zero for i32 {
    const ZERO: i32 = 0;
}
impl Zero for i64 {
    const ZERO: i64 = 0;
}
impl Zero for u8 {
    const ZERO: u8 = 0;
}
impl Zero for f16 {
    const ZERO: f16 = f16::ZERO;
}
impl Zero for bf16 {
    const ZERO: bf16 = bf16::ZERO;
}
impl Zero for i8 {
    const ZERO: i8 = 0;
}
impl Zero for u32 {
    const ZERO: u32 = 0;
}
impl Zero for u64 {
    const ZERO: u64 = 0;
}
impl Zero for Bool {
    const ZERO: Bool = Bool::FALSE;
}
impl Zero for F8E4M3 {
    const ZERO: F8E4M3 = F8E4M3::from_bits(0);
}
impl Zero for F8E5M2 {
    const ZERO: F8E5M2 = F8E5M2::from_bits(0);
}

dtypes! {
    F32 => f32, F64 => f64, I32 => i32, I64 => i64, U8 => u8, F16 => f16, BF16 => bf16,
    I8 => i8, U32 => u32, U64 => u64, Bool => Bool, F8E4M3 => F8E4M3, F8E5M2 => F8E5M2,
}
