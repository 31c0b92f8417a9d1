//! The memory a benchmark's buffers live in, shared by `peer-bench` and `mpi-bench`: plain heap
//! memory, numpy's (huge pages advised from 4 MiB) or torch's (64-byte aligned).

/// The memory this side's buffers live in: the same as the peer's, so that a row compares the
/// libraries and not the allocators.
///
/// numpy (the buffers of mpi4py's side) advises transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`) for every array of 4 MiB or more on Linux, from the first page
/// boundary after the array's start (`indicate_hugepages` in numpy's `alloc.c`; `strace` of
/// numpy 2.4.6 here: `np.full` of 2^20 f32 makes one such call, of 2^20 - 1 none). With this
/// kernel's THP mode `madvise`, those arrays get 2 MiB pages, and Open MPI copies them faster:
/// measured, the 32 and 64 MiB all-gather and broadcast rows were behind mpi4py with plain
/// buffers here and ahead once numpy's advice was turned off (`NUMPY_MADVISE_HUGEPAGE=0`),
/// docs/performance.md. numpy's data comes from `malloc` (16-byte aligned; glibc's `mmap`'d
/// blocks start 16 bytes into a page), as a `Vec`'s does.
///
/// torch's CPU allocator advises nothing unless `THP_MEM_ALLOC_ENABLE=1` (`strace` of
/// `torch.full` and `torch.zeros` of 16 MiB: no `madvise`), but aligns every tensor to 64 bytes
/// (`posix_memalign` with c10's `gAlignment`; `data_ptr() % 4096` of torch 2.15's tensors of
/// 1 MiB and more is 64, numpy's 16). The offset matters on some CPUs: the kernel's TCP
/// receive copy into a buffer 1-31 bytes into a 4 KiB page ran at half speed on the AMD EPYC
/// machine of docs/performance.md (*Receive buffers a few bytes into a page*), so the Gloo
/// rows allocate as torch does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)] // each example that includes this file uses some of the kinds
pub enum PeerMemory {
    /// As numpy's arrays: `malloc`'d, huge pages advised from 4 MiB.
    Numpy,
    /// As torch's tensors: 64-byte aligned, no advice.
    Torch,
    /// Plain `malloc`'d memory (a `Vec`), no advice.
    Plain,
}

impl PeerMemory {
    /// numpy's threshold: `size >= (1u << 22u)` bytes.
    const NUMPY_HUGE_PAGES_FROM: usize = 1 << 22;
    /// torch's alignment (c10's `gAlignment`).
    const TORCH_ALIGN: usize = 64;

    /// `len` elements of `value`, allocated as the peer allocates: the advice (if any) is given
    /// before the first write, as numpy gives it before filling.
    pub fn filled(self, len: usize, value: f32) -> PeerBuf {
        let mut b = match self {
            PeerMemory::Torch => PeerBuf::Aligned(aligned::AlignedF32::new(len, Self::TORCH_ALIGN)),
            PeerMemory::Numpy | PeerMemory::Plain => PeerBuf::Heap(Vec::with_capacity(len)),
        };
        let bytes = len * std::mem::size_of::<f32>();
        if self == PeerMemory::Numpy && bytes >= Self::NUMPY_HUGE_PAGES_FROM {
            advise_huge_pages(b.as_ptr().cast(), bytes);
        }
        match &mut b {
            PeerBuf::Heap(v) => v.resize(len, value),
            PeerBuf::Aligned(a) => a.as_mut_slice().fill(value),
        }
        b
    }
}

/// A benchmark buffer of f32: a `Vec`, or a block of the global allocator at a larger
/// alignment (which a `Vec<f32>` cannot hold: it frees with `f32`'s alignment).
pub enum PeerBuf {
    Heap(Vec<f32>),
    Aligned(aligned::AlignedF32),
}

impl std::ops::Deref for PeerBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            PeerBuf::Heap(v) => v,
            PeerBuf::Aligned(a) => a.as_slice(),
        }
    }
}

impl std::ops::DerefMut for PeerBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            PeerBuf::Heap(v) => v,
            PeerBuf::Aligned(a) => a.as_mut_slice(),
        }
    }
}

/// The one unsafe allocation: f32s at a chosen alignment.
mod aligned {
    use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
    use std::ptr::NonNull;

    /// `len` f32s (zeroed when made) at `layout.align()`, owned.
    ///
    /// Invariants: `ptr` came from `alloc_zeroed(layout)` (or is dangling and aligned when
    /// `len == 0`, with nothing allocated), `layout.size() == len * 4`, and the block is freed
    /// once, in `drop`, with the same layout. Zero bytes are a valid f32 (0.0), so the slices
    /// are always initialized.
    pub struct AlignedF32 {
        ptr: NonNull<f32>,
        len: usize,
        layout: Layout,
    }

    impl AlignedF32 {
        /// Panics on a size that overflows `isize` (as `Vec` does); calls `handle_alloc_error`
        /// when the allocator fails (as `Vec` does).
        pub fn new(len: usize, align: usize) -> AlignedF32 {
            let layout = Layout::array::<f32>(len)
                .and_then(|l| l.align_to(align))
                .expect("benchmark buffer size overflows isize");
            if len == 0 {
                return AlignedF32 {
                    ptr: NonNull::dangling(),
                    len,
                    layout,
                };
            }
            // SAFETY: the layout's size is nonzero (len > 0).
            let raw = unsafe { alloc_zeroed(layout) };
            let Some(ptr) = NonNull::new(raw.cast::<f32>()) else {
                handle_alloc_error(layout)
            };
            AlignedF32 { ptr, len, layout }
        }

        pub fn as_slice(&self) -> &[f32] {
            // SAFETY: ptr is valid for len initialized f32s (the invariants), or dangling and
            // aligned with len == 0; &self keeps the block alive and unwritten.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }

        pub fn as_mut_slice(&mut self) -> &mut [f32] {
            // SAFETY: as in as_slice; &mut self makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }
    }

    impl Drop for AlignedF32 {
        fn drop(&mut self) {
            if self.len > 0 {
                // SAFETY: allocated with this layout in new, freed only here.
                unsafe { dealloc(self.ptr.as_ptr().cast(), self.layout) }
            }
        }
    }
}

/// numpy's `indicate_hugepages`: `madvise(MADV_HUGEPAGE)` from the first page boundary after
/// `start` (one whole page further when `start` is page-aligned, as numpy computes it) to
/// `start + bytes`. Errors are ignored, as numpy ignores them (an older kernel, THP off): the
/// advice only changes how fast the memory is, never what it holds.
fn advise_huge_pages(start: *const u8, bytes: usize) {
    const PAGE: usize = 4096;
    let offset = PAGE - (start as usize % PAGE);
    if bytes <= offset {
        return;
    }
    // SAFETY: the range [start + offset, start + bytes) lies inside one live allocation of
    // `bytes` bytes (offset < bytes), and starts on a page boundary as madvise requires.
    // MADV_HUGEPAGE changes only how the kernel backs these pages (it may use 2 MiB pages);
    // it neither reads, writes nor unmaps them, so no Rust reference is affected.
    unsafe {
        libc::madvise(
            start.add(offset).cast_mut().cast(),
            bytes - offset,
            libc::MADV_HUGEPAGE,
        );
    }
}
