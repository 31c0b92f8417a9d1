//! Communicator traits that every backend (MPI, Gloo, NCCL) implements.
//!
//! # Shape of the API
//! * [`Communicator`] is **object safe**: a `ProcessGroupCollection<Arc<dyn Communicator>>` is
//!   possible (a test pins this). Its methods take *type-erased* buffers ([`BufRef`], [`BufMut`])
//!   that carry their element type, so one trait serves every dtype without generic methods.
//! * [`CommunicatorExt`] (blanket-implemented for every communicator, including `dyn`) adds the
//!   typed forms a user calls: `comm.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum)`.
//! * Nonblocking forms take **owned** buffers ([`Tensor`]) and return a [`Work`] handle; `wait`
//!   hands the result buffer back. Owning the buffer is what makes overlap sound: nothing can
//!   read or free the memory while the backend still uses it, whatever thread runs the
//!   operation, and dropping a handle never leaves a dangling borrow.
//! * [`GroupFactory`] creates communicators: split a parent by colour, create one for a rank
//!   list, and build a whole [`crate::ProcessGroupCollection`] from a plan with one split per
//!   family ([`crate::build_collection`]).
//!
//! # Host and device memory (how NCCL fits without changing these traits)
//! A buffer is either host memory (`BufRef::Host`, a typed slice) or device memory
//! (`BufRef::Device`, a `&dyn DeviceBuffer`). A GPU backend implements [`DeviceBuffer`] for its
//! own allocation type (for example a wrapper over `cudarc`'s `CudaSlice<T>` that records the
//! stream it was written on) and downcasts with [`DeviceBuffer::as_any`]. Collectives on device
//! buffers are *stream-ordered*: a blocking call returns once the operation is enqueued on the
//! communicator's stream after an event recorded on the buffer's stream, exactly as NCCL works;
//! [`Communicator::synchronize`] waits for the communicator's stream. Nonblocking calls complete
//! their [`Work`] when a CUDA event recorded after the operation has fired. CPU backends reject
//! device buffers with [`Error::Unsupported`], and a GPU backend may reject host buffers the
//! same way: which memory a backend accepts is reported by [`Communicator::accepts`].
//!
//! # Ranks
//! `rank()` is the position of this process in `global_ranks()`, the members' world ranks in
//! communicator-rank order. A split orders members by its key; [`crate::build_collection`]
//! keys every split by world rank, so its communicators list members in **ascending** order
//! and `rank()` is the index in the sorted member list, as torch defines group ranks (also for
//! families whose Megatron member order is not sorted, such as `intra_dist_opt`).
//! Roots and peers are given as communicator ranks.

use crate::error::{Error, Result};
use half::{bf16, f16};
use std::any::Any;
use std::fmt;
use std::time::Duration;

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
}

impl DType {
    /// Every dtype.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::F16,
        DType::BF16,
    ];
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// True for floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        };
        f.write_str(s)
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

        impl HostSlice<'_> {
            /// Element type.
            pub fn dtype(&self) -> DType { match self { $( HostSlice::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            pub fn len(&self) -> usize { match self { $( HostSlice::$variant(s) => s.len(), )* } }
            /// True when empty.
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// Start of the memory.
            pub fn as_ptr(&self) -> *const u8 { match self { $( HostSlice::$variant(s) => s.as_ptr() as *const u8, )* } }
            /// An owned copy.
            pub fn to_owned_buffer(&self) -> HostBuffer { match self { $( HostSlice::$variant(s) => HostBuffer::$variant(s.to_vec()), )* } }
        }
        impl<'a> HostSliceMut<'a> {
            /// Element type.
            pub fn dtype(&self) -> DType { match self { $( HostSliceMut::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            pub fn len(&self) -> usize { match self { $( HostSliceMut::$variant(s) => s.len(), )* } }
            /// True when empty.
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// Start of the memory.
            pub fn as_mut_ptr(&mut self) -> *mut u8 { match self { $( HostSliceMut::$variant(s) => s.as_mut_ptr() as *mut u8, )* } }
            /// A shorter-lived reborrow.
            pub fn reborrow(&mut self) -> HostSliceMut<'_> { match self { $( HostSliceMut::$variant(s) => HostSliceMut::$variant(&mut s[..]), )* } }
            /// A shared view.
            pub fn as_slice(&self) -> HostSlice<'_> { match self { $( HostSliceMut::$variant(s) => HostSlice::$variant(&s[..]), )* } }
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
            pub fn dtype(&self) -> DType { match self { $( HostBuffer::$variant(_) => DType::$variant, )* } }
            /// Number of elements.
            pub fn len(&self) -> usize { match self { $( HostBuffer::$variant(s) => s.len(), )* } }
            /// True when empty.
            pub fn is_empty(&self) -> bool { self.len() == 0 }
            /// A borrowed view.
            pub fn as_slice(&self) -> HostSlice<'_> { match self { $( HostBuffer::$variant(s) => HostSlice::$variant(&s[..]), )* } }
            /// A mutable view.
            pub fn as_mut_slice(&mut self) -> HostSliceMut<'_> { match self { $( HostBuffer::$variant(s) => HostSliceMut::$variant(&mut s[..]), )* } }
            /// A zero-filled buffer of `len` elements of `dtype`.
            pub fn zeros(dtype: DType, len: usize) -> HostBuffer {
                match dtype { $( DType::$variant => HostBuffer::$variant(vec![<$t as Zero>::ZERO; len]), )* }
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

dtypes! { F32 => f32, F64 => f64, I32 => i32, I64 => i64, U8 => u8, F16 => f16, BF16 => bf16 }

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
    pub fn dtype(&self) -> DType {
        match self {
            BufRef::Host(h) => h.dtype(),
            BufRef::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufRef::Host(h) => h.len(),
            BufRef::Device(d) => d.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the memory is.
    pub fn memory(&self) -> Memory {
        match self {
            BufRef::Host(_) => Memory::Host,
            BufRef::Device(_) => Memory::Device,
        }
    }
}

impl BufMut<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::Host(h) => h.dtype(),
            BufMut::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufMut::Host(h) => h.len(),
            BufMut::Device(d) => d.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the memory is.
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
    pub fn host_only(self, op: &'static str, backend: &'static str) -> Result<HostSlice<'a>> {
        match self {
            BufRef::Host(h) => Ok(h),
            BufRef::Device(d) => Err(device_memory_error(op, backend, d)),
        }
    }
}

impl<'a> BufMut<'a> {
    /// The host slice, or [`Error::Unsupported`] for device memory (see [`BufRef::host_only`]).
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
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::Host(h) => h.dtype(),
            Tensor::Device(d) => d.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Tensor::Host(h) => h.len(),
            Tensor::Device(d) => d.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Borrowed view.
    pub fn as_ref(&self) -> BufRef<'_> {
        match self {
            Tensor::Host(h) => BufRef::Host(h.as_slice()),
            Tensor::Device(d) => BufRef::Device(&**d),
        }
    }
    /// Mutable view.
    pub fn as_mut(&mut self) -> BufMut<'_> {
        match self {
            Tensor::Host(h) => BufMut::Host(h.as_mut_slice()),
            Tensor::Device(d) => BufMut::Device(&mut **d),
        }
    }
    /// The host buffer, or [`Error::Unsupported`] for device memory (see [`BufRef::host_only`]).
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

/// One operation of a batched point-to-point exchange ([`Communicator::batch_p2p`]).
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send `buf` to communicator rank `peer`.
    Send {
        /// Data.
        buf: BufRef<'a>,
        /// Destination (communicator rank).
        peer: usize,
        /// Message tag (NCCL matches by order and ignores it).
        tag: u32,
    },
    /// Receive into `buf` from communicator rank `peer`.
    Recv {
        /// Destination memory.
        buf: BufMut<'a>,
        /// Source (communicator rank).
        peer: usize,
        /// Message tag.
        tag: u32,
    },
}

/// A nonblocking operation to start ([`Communicator::start`]). Buffers are owned and come back
/// through [`Work::wait`].
#[derive(Debug)]
pub enum Request {
    /// All-reduce `buf` in place.
    AllReduce {
        /// Input and result.
        buf: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// Broadcast `buf` from `root` (in place).
    Broadcast {
        /// Input on the root, result everywhere.
        buf: Tensor,
        /// Root (communicator rank).
        root: usize,
    },
    /// All-gather `send` into `recv` (`recv.len() == size · send.len()`).
    AllGather {
        /// This rank's block.
        send: Tensor,
        /// Result.
        recv: Tensor,
    },
    /// Reduce-scatter `send` into `recv` (`send.len() == size · recv.len()`).
    ReduceScatter {
        /// Input.
        send: Tensor,
        /// This rank's reduced block.
        recv: Tensor,
        /// Reduction.
        op: ReduceOp,
    },
    /// All-to-all with equal blocks (`send.len() == recv.len()`, divisible by size).
    AllToAll {
        /// Block `j` goes to rank `j`.
        send: Tensor,
        /// Block `j` comes from rank `j`.
        recv: Tensor,
    },
    /// Barrier.
    Barrier,
    /// Send to a peer.
    Send {
        /// Data.
        buf: Tensor,
        /// Destination.
        peer: usize,
        /// Tag.
        tag: u32,
    },
    /// Receive from a peer.
    Recv {
        /// Destination memory (its length is the message length).
        buf: Tensor,
        /// Source.
        peer: usize,
        /// Tag.
        tag: u32,
    },
}

impl Request {
    /// Short name of the operation, for errors and tracing.
    pub fn name(&self) -> &'static str {
        match self {
            Request::AllReduce { .. } => "all_reduce",
            Request::Broadcast { .. } => "broadcast",
            Request::AllGather { .. } => "all_gather",
            Request::ReduceScatter { .. } => "reduce_scatter",
            Request::AllToAll { .. } => "all_to_all",
            Request::Barrier => "barrier",
            Request::Send { .. } => "send",
            Request::Recv { .. } => "recv",
        }
    }
}

/// Handle of a started nonblocking operation.
///
/// Collectives started on one communicator run in the order they were started, the same order
/// on every rank. Point-to-point sends and receives are posted at once and complete as their
/// peers match them (as `batch_isend_irecv` does), so matching exchanges posted in any order do
/// not deadlock; NCCL, which executes one communicator's work in stream order, defers them into
/// one group (see its crate docs). Dropping a handle whose operation has not finished **waits** for it, so the owned
/// buffers are never freed while the library still uses them.
pub trait Work: Send {
    /// True once the operation finished (successfully or not); never blocks.
    fn is_completed(&mut self) -> bool;
    /// Blocks until the operation finishes and returns its result buffer: the in-place buffer
    /// for all-reduce, broadcast and receive, `recv` for all-gather, reduce-scatter and
    /// all-to-all, the sent buffer for send, and an empty host buffer for barrier.
    fn wait(self: Box<Self>) -> Result<Tensor>;
    /// Like [`Work::wait`] with a time limit; on timeout the work is returned so it can be
    /// waited on again (the operation keeps running).
    fn wait_timeout(
        self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>>;
}

/// A communicator over one group of ranks. Object safe.
///
/// Every method validates its arguments (lengths, dtypes, roots and peers, memory kind, state)
/// before reaching the library and reports problems as [`Error`]s; a backend failure becomes
/// [`Error::Backend`], [`Error::Timeout`] or [`Error::PeerFailed`], never a panic or an abort.
pub trait Communicator: Send + Sync {
    /// Backend name (`"mpi"`, `"gloo"`, `"nccl"`).
    fn backend(&self) -> &'static str;
    /// This process's rank in the communicator (its index in `global_ranks()`).
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// World ranks of the members, in communicator-rank order (ascending for communicators
    /// made by [`crate::build_collection`] and [`GroupFactory::create_group`]).
    fn global_ranks(&self) -> &[usize];
    /// Which memory this backend's collectives accept.
    fn accepts(&self, memory: Memory) -> bool;
    /// Whether the backend can reduce `dtype` with `op` (`op = None`: can it move `dtype` at all).
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool;

    /// Element-wise reduction of `send` over all ranks into `recv` (same dtype and length).
    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Copies `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Concatenates every rank's `send` in rank order into `recv` (`size · send.len()` elements).
    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()>;
    /// Reduces `send` (`size · recv.len()` elements) and leaves block `rank` in `recv`.
    fn reduce_scatter(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`. Both
    /// buffers have the same length, divisible by the size.
    fn all_to_all(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()>;
    /// Blocks until every rank arrived.
    fn barrier(&self) -> Result<()>;
    /// Sends `buf` to communicator rank `peer`. `peer` must differ from `rank()`.
    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()>;
    /// Receives exactly `buf.len()` elements from communicator rank `peer`.
    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()>;
    /// Runs several sends and receives as one batch that cannot deadlock on ordering
    /// (`batch_isend_irecv`; `ncclGroupStart/End` on NCCL). Returns when all completed.
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()>;
    /// Starts a nonblocking operation on owned buffers.
    fn start(&self, request: Request) -> Result<Box<dyn Work>>;
    /// Waits until every operation enqueued so far has completed (a no-op for CPU backends,
    /// stream synchronisation for NCCL).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// Creates communicators for sub-groups of a parent communicator.
///
/// Implemented by each backend (the factory holds what creation needs: a rendezvous store for
/// Gloo, a device and a bootstrap for NCCL; nothing for MPI). Both methods are **collective over
/// the parent**: every rank of the parent calls them, in the same order, members and
/// non-members alike. [`crate::build_collection`] builds a whole
/// [`crate::ProcessGroupCollection`] on top of [`GroupFactory::split`] with one split per family.
pub trait GroupFactory {
    /// The communicator type this factory creates.
    type Comm: Communicator;

    /// Splits `parent`: ranks passing the same `color` get one new communicator, whose ranks are
    /// ordered by `(key, parent rank)` (pass the world rank as key for torch's sorted order); a rank passing `None` takes part in the call and gets `None`
    /// (`MPI_Comm_split` with `MPI_UNDEFINED`, `ncclCommSplit` with `NCCL_SPLIT_NOCOLOR`).
    fn split(
        &self,
        parent: &Self::Comm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<Self::Comm>>;

    /// The communicator of the group made of `ranks` (parent ranks, any order; the new
    /// communicator orders them ascending). Returns `None` on ranks outside the list.
    fn create_group(&self, parent: &Self::Comm, ranks: &[usize]) -> Result<Option<Self::Comm>> {
        let size = parent.size();
        let mut seen = vec![false; size];
        for &r in ranks {
            check::rank("create_group", "member", r, size)?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::Invalid(format!(
                    "create_group: rank {r} appears more than once in {ranks:?}"
                )));
            }
        }
        if ranks.is_empty() {
            return Err(Error::Invalid(
                "create_group: the rank list is empty".into(),
            ));
        }
        let me = parent.rank();
        self.split(parent, seen[me].then_some(0), me)
    }
}

/// Typed conveniences over any [`Communicator`], including `dyn Communicator`.
///
/// ```no_run
/// # use grid_core::{Communicator, CommunicatorExt, ReduceOp};
/// # fn f(comm: &dyn Communicator) -> grid_core::Result<()> {
/// let mut sum = vec![0.0f32; 4];
/// comm.all_reduce_into(&[1.0f32; 4][..], &mut sum[..], ReduceOp::Sum)?;
/// let work = comm.iall_reduce(vec![1i64, 2, 3], ReduceOp::Max)?;
/// let max: Vec<i64> = work.wait()?;
/// # Ok(()) }
/// ```
pub trait CommunicatorExt: Communicator {
    /// Typed all-reduce.
    fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::host(send).into(), T::host_mut(recv).into(), op)
    }
    /// All-reduce in place (through one copy of the input).
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let send = buf.to_vec();
        self.all_reduce(T::host(&send).into(), T::host_mut(buf).into(), op)
    }
    /// Typed broadcast.
    fn broadcast_into<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::host_mut(buf).into(), root)
    }
    /// Typed all-gather.
    fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather(T::host(send).into(), T::host_mut(recv).into())
    }
    /// Typed reduce-scatter.
    fn reduce_scatter_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter(T::host(send).into(), T::host_mut(recv).into(), op)
    }
    /// Typed all-to-all.
    fn all_to_all_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all(T::host(send).into(), T::host_mut(recv).into())
    }
    /// Typed send.
    fn send_to<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        self.send(T::host(buf).into(), peer, tag)
    }
    /// Typed receive.
    fn recv_from<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        self.recv(T::host_mut(buf).into(), peer, tag)
    }
    /// Nonblocking all-reduce of an owned vector.
    fn iall_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::AllReduce {
            buf: buf.into(),
            op,
        })?))
    }
    /// Nonblocking broadcast of an owned vector.
    fn ibroadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::Broadcast {
            buf: buf.into(),
            root,
        })?))
    }
    /// Nonblocking all-gather; the result has `size · send.len()` elements.
    fn iall_gather<T: Element>(&self, send: Vec<T>) -> Result<TypedWork<T>> {
        let n = send.len() * self.size();
        let recv = T::owned(vec![
            send.first().copied().unwrap_or_else(|| zero_of::<T>());
            n
        ]);
        Ok(TypedWork::new(self.start(Request::AllGather {
            send: send.into(),
            recv: Tensor::Host(recv),
        })?))
    }
    /// Nonblocking reduce-scatter; the result has `send.len() / size` elements.
    fn ireduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Result<TypedWork<T>> {
        let n = send.len() / self.size().max(1);
        let recv = T::owned(vec![
            send.first().copied().unwrap_or_else(|| zero_of::<T>());
            n
        ]);
        Ok(TypedWork::new(self.start(Request::ReduceScatter {
            send: send.into(),
            recv: Tensor::Host(recv),
            op,
        })?))
    }
    /// Nonblocking all-to-all.
    fn iall_to_all<T: Element>(&self, send: Vec<T>) -> Result<TypedWork<T>> {
        let recv = T::owned(send.clone());
        Ok(TypedWork::new(self.start(Request::AllToAll {
            send: send.into(),
            recv: Tensor::Host(recv),
        })?))
    }
    /// Nonblocking send; `wait` returns the buffer.
    fn isend<T: Element>(&self, buf: Vec<T>, peer: usize, tag: u32) -> Result<TypedWork<T>> {
        Ok(TypedWork::new(self.start(Request::Send {
            buf: buf.into(),
            peer,
            tag,
        })?))
    }
    /// Nonblocking receive of `len` elements.
    fn irecv<T: Element>(&self, len: usize, peer: usize, tag: u32) -> Result<TypedWork<T>> {
        let buf = Tensor::Host(HostBuffer::zeros(T::DTYPE, len));
        Ok(TypedWork::new(self.start(Request::Recv {
            buf,
            peer,
            tag,
        })?))
    }
    /// Nonblocking barrier.
    fn ibarrier(&self) -> Result<Box<dyn Work>> {
        self.start(Request::Barrier)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

fn zero_of<T: Element>() -> T {
    T::from_owned(HostBuffer::zeros(T::DTYPE, 1))
        .ok()
        .and_then(|v| v.first().copied())
        .expect("HostBuffer::zeros returns the requested dtype")
}

/// A [`Work`] whose result is a host vector of `T`.
pub struct TypedWork<T: Element> {
    inner: Box<dyn Work>,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: Element> TypedWork<T> {
    /// Wraps an erased handle.
    pub fn new(inner: Box<dyn Work>) -> Self {
        TypedWork {
            inner,
            _t: std::marker::PhantomData,
        }
    }
    /// True once finished.
    pub fn is_completed(&mut self) -> bool {
        self.inner.is_completed()
    }
    /// Waits and returns the result vector.
    pub fn wait(self) -> Result<Vec<T>> {
        self.inner.wait()?.into_vec()
    }
    /// The erased handle.
    pub fn into_inner(self) -> Box<dyn Work> {
        self.inner
    }
}

/// Checks shared by every backend, so that they all reject the same mistakes with the same
/// messages before reaching their library.
pub mod check {
    use super::*;

    /// Same dtype on both sides.
    pub fn same_dtype(op: &'static str, a: DType, b: DType) -> Result<()> {
        if a == b {
            Ok(())
        } else {
            Err(Error::DTypeMismatch {
                op,
                expected: a,
                actual: b,
            })
        }
    }

    /// A buffer of exactly `expected` elements.
    pub fn len(op: &'static str, what: &'static str, expected: usize, actual: usize) -> Result<()> {
        if expected == actual {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                op,
                what,
                expected,
                actual,
            })
        }
    }

    /// A communicator rank.
    pub fn rank(op: &'static str, what: &'static str, rank: usize, size: usize) -> Result<()> {
        if rank < size {
            Ok(())
        } else {
            Err(Error::PeerOutOfRange {
                op,
                what,
                rank,
                size,
            })
        }
    }

    /// Validates the arguments of a collective against a communicator of `size` ranks.
    pub fn collective(
        op: &'static str,
        size: usize,
        send: Option<(DType, usize)>,
        recv: (DType, usize),
    ) -> Result<()> {
        if let Some((sd, sl)) = send {
            same_dtype(op, sd, recv.0)?;
            match op {
                "all_gather" => len(op, "recv buffer", sl * size, recv.1)?,
                "reduce_scatter" => len(op, "send buffer", recv.1 * size, sl)?,
                "all_to_all" => {
                    len(op, "recv buffer", sl, recv.1)?;
                    if size > 0 && sl % size != 0 {
                        return Err(Error::Invalid(format!(
                            "all_to_all: buffer of {sl} elements cannot be cut into {size} equal blocks"
                        )));
                    }
                }
                _ => len(op, "recv buffer", sl, recv.1)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(dead_code)]
    fn object_safe(_: &dyn Communicator, _: Box<dyn Work>, _: &dyn DeviceBuffer) {}

    #[test]
    fn erased_buffers() {
        let v = [1.0f32, 2.0];
        let r: BufRef = (&v[..]).into();
        assert_eq!(r.dtype(), DType::F32);
        assert_eq!(r.len(), 2);
        let t: Tensor = vec![3i64].into();
        assert_eq!(t.into_vec::<i64>().unwrap(), vec![3]);
        let t: Tensor = vec![3i64].into();
        assert!(t.into_vec::<f32>().is_err());
        assert_eq!(HostBuffer::zeros(DType::BF16, 3).len(), 3);
        assert!(check::collective("all_gather", 4, Some((DType::F32, 2)), (DType::F32, 8)).is_ok());
        assert!(
            check::collective("all_gather", 4, Some((DType::F32, 2)), (DType::F32, 7)).is_err()
        );
        assert!(
            check::collective("all_reduce", 4, Some((DType::F32, 2)), (DType::I32, 2)).is_err()
        );
    }
}
