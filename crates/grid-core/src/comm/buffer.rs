//! Borrowed and owned buffers: host slices or device memory.

use super::dtype::{DType, Element, HostBuffer, HostSlice, HostSliceMut};
use crate::error::{Error, Result};
use std::any::Any;
use std::fmt;

/// Device memory owned by a GPU backend. Implemented by the backend for its allocation type;
/// CPU backends never see one except to reject it.
pub trait DeviceBuffer: Send + Sync + Any + fmt::Debug {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device ordinal the memory lives on.
    fn device(&self) -> usize;
    /// For the owning backend to downcast.
    fn as_any(&self) -> &dyn Any;
    /// For the owning backend to downcast.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A borrowed input buffer: host slice or device memory.
#[derive(Debug, Clone, Copy)]
pub enum BufRef<'a> {
    /// Host memory.
    Host(HostSlice<'a>),
    /// Device memory.
    Device(&'a dyn DeviceBuffer),
}

/// A borrowed output buffer: host slice or device memory.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// Host memory.
    Host(HostSliceMut<'a>),
    /// Device memory.
    Device(&'a mut dyn DeviceBuffer),
}

impl BufRef<'_> {
    /// Element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        match self {
            BufRef::Host(h) => h.dtype(),
            BufRef::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            BufRef::Host(h) => h.len(),
            BufRef::Device(d) => d.len(),
        }
    }
    /// True when empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the memory is.
    #[inline]
    pub fn memory(&self) -> Memory {
        match self {
            BufRef::Host(_) => Memory::Host,
            BufRef::Device(_) => Memory::Device,
        }
    }
}

impl BufMut<'_> {
    /// Element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::Host(h) => h.dtype(),
            BufMut::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            BufMut::Host(h) => h.len(),
            BufMut::Device(d) => d.len(),
        }
    }
    /// True when empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the memory is.
    #[inline]
    pub fn memory(&self) -> Memory {
        match self {
            BufMut::Host(_) => Memory::Host,
            BufMut::Device(_) => Memory::Device,
        }
    }
}

/// The error a host-only backend returns for device memory.
fn device_memory_error(op: &'static str, backend: &'static str, d: &dyn DeviceBuffer) -> Error {
    Error::Unsupported {
        op,
        backend,
        what: format!(
            "device memory ({} {} elements on device {}): this backend moves host memory only; copy it to the host or use the NCCL backend",
            d.len(),
            d.dtype(),
            d.device()
        ),
    }
}

impl<'a> BufRef<'a> {
    /// The host slice, or [`Error::Unsupported`] naming `op` and `backend` for device memory:
    /// what a host-only backend does with its inputs.
    #[inline]
    pub fn host_only(self, op: &'static str, backend: &'static str) -> Result<HostSlice<'a>> {
        match self {
            BufRef::Host(h) => Ok(h),
            BufRef::Device(d) => Err(device_memory_error(op, backend, d)),
        }
    }
}

impl<'a> BufMut<'a> {
    /// The host slice, or [`Error::Unsupported`] for device memory (see [`BufRef::host_only`]).
    #[inline]
    pub fn host_only(self, op: &'static str, backend: &'static str) -> Result<HostSliceMut<'a>> {
        match self {
            BufMut::Host(h) => Ok(h),
            BufMut::Device(d) => Err(device_memory_error(op, backend, &*d)),
        }
    }
}

impl<'a, T: Element> From<&'a [T]> for BufRef<'a> {
    fn from(s: &'a [T]) -> BufRef<'a> {
        BufRef::Host(T::host(s))
    }
}
impl<'a, T: Element> From<&'a Vec<T>> for BufRef<'a> {
    fn from(s: &'a Vec<T>) -> BufRef<'a> {
        BufRef::Host(T::host(s))
    }
}
impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(s: &'a mut [T]) -> BufMut<'a> {
        BufMut::Host(T::host_mut(s))
    }
}
impl<'a, T: Element> From<&'a mut Vec<T>> for BufMut<'a> {
    fn from(s: &'a mut Vec<T>) -> BufMut<'a> {
        BufMut::Host(T::host_mut(s))
    }
}

impl<'a> From<HostSlice<'a>> for BufRef<'a> {
    fn from(s: HostSlice<'a>) -> BufRef<'a> {
        BufRef::Host(s)
    }
}
impl<'a> From<HostSliceMut<'a>> for BufMut<'a> {
    fn from(s: HostSliceMut<'a>) -> BufMut<'a> {
        BufMut::Host(s)
    }
}

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Memory {
    /// Host (CPU) memory.
    Host,
    /// Device (GPU) memory.
    Device,
}

/// An owned buffer, for nonblocking operations.
#[derive(Debug)]
pub enum Tensor {
    /// Host memory.
    Host(HostBuffer),
    /// Device memory.
    Device(Box<dyn DeviceBuffer>),
}

impl Tensor {
    /// A zero-filled host tensor of `n` elements of `dtype` (the receive buffer of an
    /// operation that returns its result); a length whose bytes do not fit in memory is an
    /// error naming it, rather than an allocation failure.
    ///
    /// ```
    /// use grid_core::{DType, Tensor};
    /// assert_eq!(Tensor::host_zeros(DType::U64, 3).unwrap().len(), 3);
    /// assert!(Tensor::host_zeros(DType::U64, usize::MAX / 2).is_err());
    /// ```
    pub fn host_zeros(dtype: DType, n: usize) -> crate::Result<Tensor> {
        if n.checked_mul(dtype.size_bytes())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(crate::Error::Invalid(format!(
                "a receive buffer of {n} {dtype} elements does not fit in memory"
            )));
        }
        Ok(Tensor::Host(HostBuffer::zeros(dtype, n)))
    }

    /// Element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::Host(h) => h.dtype(),
            Tensor::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Tensor::Host(h) => h.len(),
            Tensor::Device(d) => d.len(),
        }
    }
    /// True when empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Borrowed view.
    #[inline]
    pub fn as_ref(&self) -> BufRef<'_> {
        match self {
            Tensor::Host(h) => BufRef::Host(h.as_slice()),
            Tensor::Device(d) => BufRef::Device(&**d),
        }
    }
    /// Mutable view.
    #[inline]
    pub fn as_mut(&mut self) -> BufMut<'_> {
        match self {
            Tensor::Host(h) => BufMut::Host(h.as_mut_slice()),
            Tensor::Device(d) => BufMut::Device(&mut **d),
        }
    }
    /// The host buffer, or [`Error::Unsupported`] for device memory (see [`BufRef::host_only`]).
    #[inline]
    pub fn host_only(self, op: &'static str, backend: &'static str) -> Result<HostBuffer> {
        match self {
            Tensor::Host(h) => Ok(h),
            Tensor::Device(d) => Err(device_memory_error(op, backend, &*d)),
        }
    }
    /// The host vector, if this is host memory of type `T`.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        match self {
            Tensor::Host(h) => T::from_owned(h).map_err(|h| Error::DTypeMismatch {
                op: "into_vec",
                expected: T::DTYPE,
                actual: h.dtype(),
            }),
            Tensor::Device(d) => Err(Error::Invalid(format!(
                "into_vec: the tensor is device memory ({} {} elements on device {}); copy it to the host first",
                d.len(),
                d.dtype(),
                d.device()
            ))),
        }
    }
}

impl<T: Element> From<Vec<T>> for Tensor {
    fn from(v: Vec<T>) -> Tensor {
        Tensor::Host(T::owned(v))
    }
}
