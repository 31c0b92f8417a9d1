//! Where in a 4 KiB page the memory of a backend's large receives should start.
//!
//! x86 processors copy with `rep movsb` (the kernel's `copy_to_user` does, and so every socket
//! receive) at about half speed when the destination lies 1 to 63 bytes after the source in a
//! 4 KiB page: the loads and stores alias in the processor's 4 KiB store-forwarding check
//! (glibc's `memmove` avoids `rep movsb` at such distances for this reason; its other paths
//! are never slow). A transport that carries a payload after `lead` bytes of its own framing
//! in each message of its byte stream puts the payload's first byte `lead` bytes into a page
//! of the kernel's socket memory, so its receives are slow into memory that starts `lead + 1`
//! to `lead + 63` bytes into a page. Measured with Gloo on an AMD EPYC (Zen 3, docs/performance.md,
//! *Receive buffers a few bytes into a page*): 8 MiB over loopback took 4.9–6.7 ms into such
//! buffers and 2.1–4.7 ms into any other, and the bridge benchmark's fan-in of 16 MiB ran at
//! 74–81 % of point-to-point whenever its receive buffer sat 64 bytes into a page (libgloo's
//! 48-byte preamble before every message) and at 98–103 % otherwise.
//!
//! A buffer's place in its page is the allocator's choice: glibc puts a block it maps on its own
//! 16 bytes into a page, and carves others out of its heaps at any multiple of 16 (each new
//! heap of a thread's arena held its first block at 64 here, the next ones at 80 and 96, so
//! allocating again does not escape). [`ReceivePlacement::zeros`] keeps the first allocation
//! when it lies outside the slow window, and otherwise allocates again, larger than
//! [`ReceivePlacement::MAPPED_BYTES`], which glibc always maps on its own, 16 bytes into a page
//! (jemalloc and mimalloc also serve such sizes from page-aligned mappings of their own; not
//! tried here): only the first `len` elements' pages are ever touched, the rest of the mapping
//! stays virtual.
//! [`crate::Communicator::receive_placement`] says what a communicator's transport needs;
//! memory that a program allocates for receives it makes again and again (a pool of receive
//! buffers) is worth placing this way.

use super::dtype::{DType, HostBuffer};

/// Page size of the aliasing check.
const PAGE: usize = 4096;

/// Distances in a page at which a copy is slow: the destination 1 to 63 bytes after the source.
const SLOW_DISTANCES: std::ops::RangeInclusive<usize> = 1..=63;

/// Where a transport's large receives should not start in a page: after `lead` bytes of
/// framing before each payload in its byte stream ([`ReceivePlacement::after_framing`]), the
/// page offsets `lead + 1 ..= lead + 63` (mod 4096), for receives of at least `min_bytes`.
///
/// ```
/// use grid_core::{DType, ReceivePlacement};
/// let gloo = ReceivePlacement::after_framing(48, 64 << 10);
/// assert!(gloo.is_slow_offset(64) && gloo.is_slow_offset(111));
/// assert!(!gloo.is_slow_offset(16) && !gloo.is_slow_offset(48) && !gloo.is_slow_offset(112));
/// let b = gloo.zeros(DType::F32, 1 << 20); // 4 MiB, zero-filled
/// assert!(!gloo.is_slow(b.as_slice()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceivePlacement {
    lead: usize,
    min_bytes: usize,
}

impl ReceivePlacement {
    /// An allocation of more than this (bytes: 32 MiB, glibc's largest dynamic mmap threshold
    /// on 64-bit systems) is mapped by glibc on its own, 16 bytes into a page.
    pub const MAPPED_BYTES: usize = 32 << 20;

    /// The placement for a transport with `lead` bytes of framing before each payload in its
    /// stream, for receives of `min_bytes` and more (`lead` is taken mod 4096).
    pub const fn after_framing(lead: usize, min_bytes: usize) -> ReceivePlacement {
        ReceivePlacement {
            lead: lead % PAGE,
            min_bytes,
        }
    }

    /// Bytes of framing before each payload.
    pub fn lead(&self) -> usize {
        self.lead
    }

    /// Smallest receive (bytes) the placement matters for.
    pub fn min_bytes(&self) -> usize {
        self.min_bytes
    }

    /// Whether memory starting `offset` bytes into a page (`offset` taken mod 4096) receives
    /// slowly.
    pub fn is_slow_offset(&self, offset: usize) -> bool {
        let distance = (offset % PAGE + PAGE - self.lead) % PAGE;
        SLOW_DISTANCES.contains(&distance)
    }

    /// Whether a receive of `bytes` into memory starting at address `start` is slow: at least
    /// `min_bytes`, at a slow page offset.
    pub fn is_slow_at(&self, start: usize, bytes: usize) -> bool {
        bytes >= self.min_bytes && self.is_slow_offset(start)
    }

    /// Whether `buf` is a receive of at least `min_bytes` that starts at a slow page offset.
    pub fn is_slow(&self, buf: super::HostSlice<'_>) -> bool {
        let bytes = buf.len().saturating_mul(buf.dtype().size_bytes());
        self.is_slow_at(buf.as_ptr() as usize, bytes)
    }

    /// A zero-filled buffer of `len` elements of `dtype` that does not start at a slow page
    /// offset where the allocator allows it: the first allocation if it lies outside the window
    /// (or the buffer is under `min_bytes`), else a second one of more than
    /// [`ReceivePlacement::MAPPED_BYTES`] of capacity (the first is freed after it, so the two
    /// are different blocks), returned wherever it lies.
    pub fn zeros(&self, dtype: DType, len: usize) -> HostBuffer {
        let mapped = Self::MAPPED_BYTES / dtype.size_bytes() + 1;
        first_or_second(
            HostBuffer::zeros(dtype, len),
            |b| self.is_slow(b.as_slice()),
            || HostBuffer::zeros_in(dtype, len, mapped),
        )
    }
}

/// `first` unless it is `slow`, else `second()`, made while `first` is still held (so that
/// the allocator hands out another block) and returned wherever it lies.
fn first_or_second<T>(first: T, slow: impl Fn(&T) -> bool, second: impl FnOnce() -> T) -> T {
    if !slow(&first) {
        return first;
    }
    let b = second();
    drop(first);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_follows_the_framing_and_wraps_around_the_page() {
        let p = ReceivePlacement::after_framing(48, 0);
        let slow: Vec<usize> = (0..PAGE).filter(|&o| p.is_slow_offset(o)).collect();
        assert_eq!(slow, (49..=111).collect::<Vec<_>>());
        // Offsets are taken mod the page.
        assert!(p.is_slow_offset(PAGE + 64) && !p.is_slow_offset(3 * PAGE + 16));
        // A lead near the end of a page wraps into the next.
        let q = ReceivePlacement::after_framing(4090, 0);
        assert!(q.is_slow_offset(4091) && q.is_slow_offset(4095) && q.is_slow_offset(0));
        assert!(q.is_slow_offset(57) && !q.is_slow_offset(58) && !q.is_slow_offset(4090));
        assert_eq!(ReceivePlacement::after_framing(PAGE + 8, 0).lead(), 8);
    }

    #[test]
    fn small_receives_and_other_offsets_are_never_slow() {
        let p = ReceivePlacement::after_framing(0, 1024);
        let v = vec![0u8; 8192];
        let at = |o: usize| {
            let start = (PAGE - v.as_ptr() as usize % PAGE) % PAGE + o;
            grid_core_slice(&v[start..start + 2048])
        };
        assert!(p.is_slow(at(16)));
        assert!(!p.is_slow(at(0)) && !p.is_slow(at(64)));
        // Below min_bytes: never slow.
        let short = &v[..];
        let start = (PAGE - short.as_ptr() as usize % PAGE) % PAGE + 16;
        assert!(!p.is_slow(grid_core_slice(&short[start..start + 512])));
    }

    fn grid_core_slice(s: &[u8]) -> super::super::HostSlice<'_> {
        super::super::HostSlice::U8(s)
    }

    #[test]
    fn the_first_block_outside_the_window_is_kept_else_a_second_made_while_it_is_held() {
        use std::cell::RefCell;
        // Blocks numbered in allocation order; `live` counts those not yet dropped.
        struct Block<'a>(usize, &'a RefCell<usize>);
        impl Drop for Block<'_> {
            fn drop(&mut self) {
                *self.1.borrow_mut() -= 1;
            }
        }
        let live = RefCell::new(0);
        let peak = RefCell::new(0);
        let made = RefCell::new(0);
        let alloc = || {
            *made.borrow_mut() += 1;
            *live.borrow_mut() += 1;
            let l = *live.borrow();
            let mut p = peak.borrow_mut();
            *p = (*p).max(l);
            Block(*made.borrow(), &live)
        };
        // The first block outside the window: kept, no second one made.
        let b = first_or_second(alloc(), |b| b.0 != 1, alloc);
        assert_eq!((b.0, *made.borrow(), *live.borrow()), (1, 1, 1));
        drop(b);
        // The first misplaced: the second is returned, both were live at once, the first is
        // freed.
        *made.borrow_mut() = 0;
        let b = first_or_second(alloc(), |b| b.0 == 1, alloc);
        assert_eq!(
            (b.0, *made.borrow(), *live.borrow(), *peak.borrow()),
            (2, 2, 1, 2)
        );
        drop(b);
        // Both misplaced: the second all the same.
        *made.borrow_mut() = 0;
        let b = first_or_second(alloc(), |_| true, alloc);
        assert_eq!((b.0, *live.borrow()), (2, 1));
    }

    #[test]
    fn a_buffer_larger_than_the_mapped_size_starts_outside_the_gloo_window() {
        // What the second try of `zeros` relies on: a mapping of its own, 16 bytes into a page
        // (glibc, the allocator of these tests), whatever its heaps look like.
        let gloo = ReceivePlacement::after_framing(48, 64 << 10);
        let mapped = ReceivePlacement::MAPPED_BYTES / 4 + 1;
        for len in [1usize << 16, 3 << 20, mapped] {
            let b = HostBuffer::zeros_in(DType::F32, len, mapped);
            assert_eq!(b.len(), len);
            assert!(b == HostBuffer::zeros(DType::F32, len));
            let offset = b.as_slice().as_ptr() as usize % PAGE;
            assert!(
                offset <= 16 && !gloo.is_slow(b.as_slice()),
                "{len}: {offset}"
            );
        }
    }

    #[test]
    fn zeros_is_a_zero_filled_buffer_of_the_asked_shape() {
        let p = ReceivePlacement::after_framing(48, 64 << 10);
        for (dtype, len) in [
            (DType::F32, 1usize << 18),
            (DType::U8, 100),
            (DType::I64, 0),
        ] {
            let b = p.zeros(dtype, len);
            assert_eq!((b.dtype(), b.len()), (dtype, len));
            assert!(b == HostBuffer::zeros(dtype, len));
        }
    }
}
