//! Device buffers: [`NcclDeviceBuffer`] wraps a cudarc `CudaSlice<T>` (which records the stream
//! it was allocated on and the events of its last read and write) and implements
//! [`grid_core::DeviceBuffer`], so it travels through the communicator traits as
//! `BufRef::Device(&buf)` / `BufMut::Device(&mut buf)` / `Tensor::Device(Box::new(buf))`.

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use grid_core::{Bool, DType, DeviceBuffer, Element, HostBuffer, F8E4M3, F8E5M2};
use half::{bf16, f16};
use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
}

/// Element types NCCL moves: every [`grid_core::DType`] (`f32 f64 i32 i64 u8 f16 bf16 i8 u32
/// u64`, `grid_core::Bool`, `grid_core::F8E4M3`, `grid_core::F8E5M2`).
///
/// The device memory of a buffer of `T` is a cudarc `CudaSlice<T::Device>`: `T` itself for the
/// numeric types, `u8` for `Bool` and the fp8 formats (one byte each, the same bits: grid-core's
/// types are `#[repr(transparent)]` over `u8`, and cudarc can only hold its own element types).
pub trait NcclElement: Element + sealed::Sealed {
    /// The element type of the device memory (same size and bits as `Self`).
    type Device: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + Unpin + 'static;
    /// The host values in the device representation (borrowed where it is `Self`).
    fn to_device_repr(host: &[Self]) -> Cow<'_, [Self::Device]>;
    /// Host values read back from the device representation.
    fn from_device_repr(v: Vec<Self::Device>) -> Vec<Self>;
    /// `host` itself as the device representation, where that is `Self` (a copy goes straight
    /// into it); `None` for the byte-represented types.
    fn as_device_repr_mut(host: &mut [Self]) -> Option<&mut [Self::Device]>;
}

macro_rules! native_elements {
    ($($t:ty),*) => { $(
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            type Device = $t;
            fn to_device_repr(host: &[Self]) -> Cow<'_, [Self::Device]> {
                Cow::Borrowed(host)
            }
            fn from_device_repr(v: Vec<Self::Device>) -> Vec<Self> {
                v
            }
            fn as_device_repr_mut(host: &mut [Self]) -> Option<&mut [Self::Device]> {
                Some(host)
            }
        }
    )* };
}
native_elements!(f32, f64, i32, i64, u8, f16, bf16, i8, u32, u64);

macro_rules! byte_elements {
    ($($t:ty => $to:expr, $from:expr);* $(;)?) => { $(
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            type Device = u8;
            fn to_device_repr(host: &[Self]) -> Cow<'_, [u8]> {
                Cow::Owned(host.iter().map($to).collect())
            }
            fn from_device_repr(v: Vec<u8>) -> Vec<Self> {
                v.into_iter().map($from).collect()
            }
            fn as_device_repr_mut(_host: &mut [Self]) -> Option<&mut [u8]> {
                None
            }
        }
    )* };
}
byte_elements!(
    Bool => |b: &Bool| b.to_byte(), Bool::from_byte;
    F8E4M3 => |x: &F8E4M3| x.to_bits(), F8E4M3::from_bits;
    F8E5M2 => |x: &F8E5M2| x.to_bits(), F8E5M2::from_bits;
);

/// Device memory of `len` elements of `T` on one GPU, usable in every collective of an
/// [`crate::NcclCommunicator`] on the same device.
///
/// Create it with [`crate::NcclBackend::to_device`] / [`crate::NcclBackend::zeros`]
/// (allocated on the communicator's stream) or wrap a `CudaSlice` you allocated on your own stream
/// with [`NcclDeviceBuffer::new`]; collectives then run after the work already queued on that
/// stream, and later work on that stream runs after the collective.
///
/// ```no_run
/// # fn f(comm: &backend_nccl::NcclCommunicator) -> grid_core::Result<()> {
/// use grid_core::{BufMut, BufRef, Communicator, ReduceOp};
/// let send = comm.to_device(&[1.0f32, 2.0])?;
/// let mut recv = comm.zeros::<f32>(2)?;
/// comm.all_reduce(BufRef::Device(&send), BufMut::Device(&mut recv), ReduceOp::Sum)?;
/// let sum: Vec<f32> = comm.to_host(&recv)?;
/// # Ok(()) }
/// ```
pub struct NcclDeviceBuffer<T: NcclElement> {
    pub(crate) slice: CudaSlice<T::Device>,
}

impl<T: NcclElement> NcclDeviceBuffer<T> {
    /// Wraps a cudarc slice (allocated on any stream of the communicator's device); for
    /// `Bool` and fp8 a `CudaSlice<u8>` of their bits.
    pub fn new(slice: CudaSlice<T::Device>) -> Self {
        NcclDeviceBuffer { slice }
    }
    /// The cudarc slice.
    pub fn slice(&self) -> &CudaSlice<T::Device> {
        &self.slice
    }
    /// The cudarc slice, mutably (for your own kernels and copies).
    pub fn slice_mut(&mut self) -> &mut CudaSlice<T::Device> {
        &mut self.slice
    }
    /// Unwraps the cudarc slice.
    pub fn into_inner(self) -> CudaSlice<T::Device> {
        self.slice
    }
    /// The stream the memory was allocated on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T: NcclElement> std::fmt::Debug for NcclDeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclDeviceBuffer<{}>[{}] on device {}",
            T::DTYPE,
            self.slice.len(),
            self.slice.ordinal()
        )
    }
}

impl<T: NcclElement> DeviceBuffer for NcclDeviceBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn device(&self) -> usize {
        self.slice.ordinal()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Runs `$body` with `$T` bound to the Rust type of a [`DType`].
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {{
        use grid_core::DType as D__;
        match $dtype {
            D__::F32 => {
                type $T = f32;
                $body
            }
            D__::F64 => {
                type $T = f64;
                $body
            }
            D__::I32 => {
                type $T = i32;
                $body
            }
            D__::I64 => {
                type $T = i64;
                $body
            }
            D__::U8 => {
                type $T = u8;
                $body
            }
            D__::F16 => {
                type $T = half::f16;
                $body
            }
            D__::BF16 => {
                type $T = half::bf16;
                $body
            }
            D__::I8 => {
                type $T = i8;
                $body
            }
            D__::U32 => {
                type $T = u32;
                $body
            }
            D__::U64 => {
                type $T = u64;
                $body
            }
            D__::Bool => {
                type $T = grid_core::Bool;
                $body
            }
            D__::F8E4M3 => {
                type $T = grid_core::F8E4M3;
                $body
            }
            D__::F8E5M2 => {
                type $T = grid_core::F8E5M2;
                $body
            }
        }
    }};
}
pub(crate) use with_dtype;

/// Downcasts an erased device buffer to this backend's type for element type `T`.
pub(crate) fn downcast<'a, T: NcclElement>(
    op: &'static str,
    d: &'a dyn DeviceBuffer,
) -> grid_core::Result<&'a NcclDeviceBuffer<T>> {
    d.as_any()
        .downcast_ref::<NcclDeviceBuffer<T>>()
        .ok_or_else(|| foreign(op, d))
}

/// Mutable form of [`downcast`].
pub(crate) fn downcast_mut<'a, T: NcclElement>(
    op: &'static str,
    d: &'a mut dyn DeviceBuffer,
) -> grid_core::Result<&'a mut NcclDeviceBuffer<T>> {
    let (len, dtype, device) = (d.len(), d.dtype(), d.device());
    d.as_any_mut()
        .downcast_mut::<NcclDeviceBuffer<T>>()
        .ok_or_else(|| foreign_parts(op, len, dtype, device))
}

fn foreign(op: &'static str, d: &dyn DeviceBuffer) -> grid_core::Error {
    foreign_parts(op, d.len(), d.dtype(), d.device())
}

fn foreign_parts(op: &'static str, len: usize, dtype: DType, device: usize) -> grid_core::Error {
    grid_core::Error::Unsupported {
        op,
        backend: crate::error::BACKEND,
        what: format!(
            "device buffers of another backend ({len} {dtype} elements on device {device}): pass a backend_nccl::NcclDeviceBuffer<{dtype}>"
        ),
    }
}

/// Host vector of `T` as an erased host buffer (for staging results).
pub(crate) fn owned<T: NcclElement>(v: Vec<T>) -> HostBuffer {
    T::owned(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Foreign;
    impl DeviceBuffer for Foreign {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn len(&self) -> usize {
            3
        }
        fn device(&self) -> usize {
            0
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    #[test]
    fn foreign_device_buffers_are_rejected() {
        let mut f = Foreign;
        let e = downcast::<f32>("all_reduce", &f).unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_reduce: the nccl backend does not support device buffers of another backend (3 f32 elements on device 0): pass a backend_nccl::NcclDeviceBuffer<f32>"
        );
        assert!(downcast_mut::<f32>("recv", &mut f).is_err());
    }

    #[test]
    fn dispatch_covers_every_dtype() {
        for d in DType::ALL {
            let size = with_dtype!(d, T => std::mem::size_of::<T>());
            assert_eq!(size, d.size_bytes());
            let tag = with_dtype!(d, T => <T as Element>::DTYPE);
            assert_eq!(tag, d);
        }
    }
}
