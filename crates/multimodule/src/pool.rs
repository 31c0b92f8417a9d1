//! The receive-buffer pool: buffers kept for reuse by a bridge's or pipeline communicator's
//! receives, and returned by the tensors it handed out (see [`crate::Activation`]). Buffers
//! only; [`BufferPool::put`], which takes a tensor, is implemented in `tensor`.

use grid_core::{DType, HostBuffer, ReceivePlacement};

/// A new zero-filled buffer of `len` elements of `dtype` for a receive: placed outside the
/// transport's slow window when it has one ([`ReceivePlacement::zeros`]), else a plain one.
/// What a pool allocates when no kept buffer fits, and what a receive without a pool takes.
pub(crate) fn new_buffer(
    dtype: DType,
    len: usize,
    placement: Option<&ReceivePlacement>,
) -> HostBuffer {
    match placement {
        Some(p) => p.zeros(dtype, len),
        None => HostBuffer::zeros(dtype, len),
    }
}

/// Receive buffers kept for reuse, so that steady-state transfers do not allocate (and
/// page-fault) a fresh buffer for every message, the way torch's caching allocator spares
/// Megatron. Tensors a bridge or pipeline communicator returns give their buffer back here when
/// they are dropped (see [`Activation`](crate::Activation)); `recycle()` and
/// [`BufferPool::put`] do it explicitly.
///
/// A receive takes the kept buffer of its element type that fits best: the same length, else
/// the smallest one holding between 1× and 2× the elements (its length is adjusted, no new
/// memory). Bounded: at most `max_buffers` buffers and `max_bytes` bytes (of capacity) are
/// kept; the oldest go first. Receives on a communicator whose transport copies slowly into
/// memory at some page offsets ([`grid_core::Communicator::receive_placement`]: Gloo) take
/// buffers through [`BufferPool::take_placed`], which passes over kept buffers that start
/// there and allocates new ones elsewhere.
///
/// ```
/// use grid_core::DType;
/// use multimodule::{Activation, BufferPool};
/// let pool = BufferPool::default();
/// pool.put(Activation::from_vec(vec![4], vec![1.0f32; 4]).unwrap());
/// assert_eq!((pool.len(), pool.bytes()), (1, 16));
/// assert_eq!(pool.take(DType::F32, 3).len(), 3); // the 4-element buffer, shortened
/// assert_eq!(pool.len(), 0);
/// assert_eq!(pool.take(DType::F32, 4).len(), 4); // a new one
/// ```
#[derive(Debug)]
pub struct BufferPool {
    free: std::sync::Mutex<Vec<HostBuffer>>,
    max_buffers: usize,
    max_bytes: usize,
}

impl Default for BufferPool {
    fn default() -> BufferPool {
        BufferPool::with_limits(BufferPool::CAPACITY, BufferPool::MAX_BYTES)
    }
}

fn capacity_bytes(b: &HostBuffer) -> usize {
    capacity(b) * b.dtype().size_bytes()
}

impl BufferPool {
    /// Most buffers kept by default.
    pub const CAPACITY: usize = 16;
    /// Most bytes kept by default (2 GiB).
    pub const MAX_BYTES: usize = 2 << 30;

    /// A pool keeping at most `max_buffers` buffers and `max_bytes` bytes.
    ///
    /// ```
    /// use multimodule::{Activation, BufferPool};
    /// let pool = BufferPool::with_limits(1, 1 << 20);
    /// pool.put(Activation::from_vec(vec![2], vec![0u8; 2]).unwrap());
    /// pool.put(Activation::from_vec(vec![3], vec![0u8; 3]).unwrap()); // the first one goes
    /// assert_eq!((pool.len(), pool.bytes()), (1, 3));
    /// ```
    pub fn with_limits(max_buffers: usize, max_bytes: usize) -> BufferPool {
        BufferPool {
            free: std::sync::Mutex::new(Vec::new()),
            max_buffers,
            max_bytes,
        }
    }

    /// Keeps a buffer for a later receive (empty or oversized buffers are not kept).
    pub(crate) fn put_buffer(&self, b: HostBuffer) {
        let size = capacity_bytes(&b);
        if b.is_empty() || size > self.max_bytes || self.max_buffers == 0 {
            return;
        }
        if let Ok(mut f) = self.free.lock() {
            let mut total: usize = f.iter().map(capacity_bytes).sum();
            while !f.is_empty() && (f.len() >= self.max_buffers || total + size > self.max_bytes) {
                total -= capacity_bytes(&f.remove(0));
            }
            f.push(b);
        }
    }

    /// A buffer of `len` elements of `dtype`: a kept one if one fits, else a new one (its
    /// contents are unspecified; receives overwrite all of it).
    pub fn take(&self, dtype: DType, len: usize) -> HostBuffer {
        self.take_placed(dtype, len, None)
    }

    /// [`BufferPool::take`] for a receive on a transport with a slow window of page offsets:
    /// kept buffers that would start in it are passed over (they stay kept), and a new buffer
    /// is allocated outside it ([`ReceivePlacement::zeros`]). `None`: [`BufferPool::take`].
    ///
    /// ```
    /// use grid_core::{DType, ReceivePlacement};
    /// use multimodule::BufferPool;
    /// let pool = BufferPool::default();
    /// let gloo = ReceivePlacement::after_framing(48, 64 << 10);
    /// let b = pool.take_placed(DType::F32, 1 << 20, Some(&gloo));
    /// assert!(b.len() == 1 << 20 && !gloo.is_slow(b.as_slice()));
    /// ```
    pub fn take_placed(
        &self,
        dtype: DType,
        len: usize,
        placement: Option<&ReceivePlacement>,
    ) -> HostBuffer {
        // Whether a kept buffer, `len` elements long, would start outside the slow window.
        let bytes = len.saturating_mul(dtype.size_bytes());
        let placed = |b: &HostBuffer| {
            placement.is_none_or(|p| !p.is_slow_at(b.as_slice().as_ptr() as usize, bytes))
        };
        if let Ok(mut f) = self.free.lock() {
            let usable = |b: &HostBuffer| b.dtype() == dtype && placed(b);
            let exact = f.iter().position(|b| usable(b) && b.len() == len);
            let fit = || {
                f.iter()
                    .enumerate()
                    .filter(|(_, b)| usable(b))
                    .map(|(i, b)| (i, capacity(b)))
                    .filter(|&(_, c)| c >= len && c <= len.saturating_mul(2))
                    .min_by_key(|&(_, c)| c)
                    .map(|(i, _)| i)
            };
            if let Some(i) = exact.or_else(fit) {
                let mut b = f.remove(i);
                set_len(&mut b, len);
                return b;
            }
        }
        new_buffer(dtype, len, placement)
    }
    /// Number of buffers kept.
    pub fn len(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }
    /// True when no buffer is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes kept (capacity).
    pub fn bytes(&self) -> usize {
        self.free
            .lock()
            .map(|f| f.iter().map(capacity_bytes).sum())
            .unwrap_or(0)
    }
}

/// Capacity of a buffer in elements.
pub(crate) fn capacity(b: &HostBuffer) -> usize {
    dispatch!(HostBuffer, b, v => v.capacity())
}

/// Sets a buffer's length to `len` within its capacity (new elements are zero; no allocation
/// when `len <= capacity`).
pub(crate) fn set_len(b: &mut HostBuffer, len: usize) {
    dispatch!(HostBuffer, b, v => v.resize(len, Default::default()))
}
