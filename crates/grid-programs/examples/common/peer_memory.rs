//! The memory a benchmark's buffers live in, shared by `peer-bench` and `mpi-bench`: plain heap
//! memory, or numpy's (huge pages advised from 4 MiB).

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
/// docs/performance.md. torch's CPU allocator advises nothing unless `THP_MEM_ALLOC_ENABLE=1`
/// (`strace` of `torch.full` and `torch.zeros` of 16 MiB: no `madvise`), so the Gloo rows use
/// plain allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerMemory {
    /// As numpy's arrays: huge pages advised from 4 MiB.
    Numpy,
    /// As torch's tensors: plain heap memory.
    Torch,
}

impl PeerMemory {
    /// numpy's threshold: `size >= (1u << 22u)` bytes.
    const NUMPY_HUGE_PAGES_FROM: usize = 1 << 22;

    /// `len` elements of `value`, allocated as the peer allocates: the advice (if any) is given
    /// before the first write, as numpy gives it before filling.
    pub fn filled(self, len: usize, value: f32) -> Vec<f32> {
        let mut v: Vec<f32> = Vec::with_capacity(len);
        let bytes = len * std::mem::size_of::<f32>();
        if self == PeerMemory::Numpy && bytes >= Self::NUMPY_HUGE_PAGES_FROM {
            advise_huge_pages(v.as_ptr().cast(), bytes);
        }
        v.resize(len, value);
        v
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
