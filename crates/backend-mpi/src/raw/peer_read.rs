//! The kernel calls behind the collectives that copy straight between the ranks' memory
//! (`crate::peer_read`): whether memory is backed by transparent huge pages (the
//! `PAGEMAP_SCAN` ioctl of `/proc/self/pagemap`, Linux 6.7 and later), and a copy from or to
//! another process's memory (`process_vm_readv` and `process_vm_writev`, the calls behind
//! Open MPI's CMA).
//!
//! All are Linux-only; elsewhere [`mostly_huge`] answers `None` and [`read_from`] and
//! [`write_to`] an `Unsupported` error, so the callers keep MPI's path.
//!
//! The kernel copies these calls make (`copy_to_user` / `copy_from_user`, `rep movsb` on
//! x86-64 processors with fast short `rep mov`) can be several times slower when the
//! destination sits a few bytes after the source in a 4 KiB page: on an AMD EPYC (Zen 3,
//! family 25) `process_vm_readv` of 1 MiB took 140–210 µs when `(destination − source) mod
//! 4096` was 0, 36 to 60 or 64 and more, and 455–580 µs when it was 4 to 28 (80, 2064: fast;
//! the first version of this module took the distance modulo a cache line, which staged
//! copies that were already fast). Two ranks running the same program place their heap blocks
//! at the same offsets in a page give or take a few allocations (the heap starts on a page;
//! glibc's blocks are 16-byte aligned), and glibc's `mmap`'d blocks all start 16 bytes into a
//! page, so such distances are common. A copy at a slow distance goes through a staging block
//! placed at the source's offset in a cache line: the kernel copies into (or out of) it at a
//! good distance, then an ordinary copy moves the bytes while they are still in the cache.
//! Whether a distance class is slow is measured once per process ([`Staging`]);
//! [`STAGE_COPIES_ENV`](crate::STAGE_COPIES_ENV) overrides it.
//!
//! Invariants:
//! - `sysconf(_SC_NPROCESSORS_ONLN)` ([`online_processors`]) takes and returns plain integers.
//! - `PAGEMAP_SCAN` only walks this process's page tables over the address range it is given;
//!   it dereferences none of that memory, and writes only the region array passed with it
//!   (`vec`, `vec_len` entries, owned by `huge_bytes`).
//! - `process_vm_readv` writes at most the local iovec's length, which is exactly the
//!   exclusively borrowed destination slice or a part of this thread's staging block;
//!   `process_vm_writev` only reads the borrowed source slice or the staging block here. The
//!   staging block is a thread-local buffer, borrowed mutably for one copy at a time, never
//!   lent to another process. Every element type of this crate accepts any bit pattern
//!   (numbers and one-byte wrappers), so whatever bytes arrive leave valid values, and the
//!   caller copies only between buffers of the same type.
//! - What is read or written in the other process is the caller's protocol: memory that
//!   process lent to the same collective and does not touch until the collective's closing
//!   exchange.

use grid_core::{HostSlice, HostSliceMut};
use std::io;

/// Whether at least three quarters of `mem` (its whole pages) are mapped by huge pages in this
/// process; `None` when the kernel cannot tell (no `PAGEMAP_SCAN`, not Linux).
///
/// Every page of the range is counted, not a sample: the copies run at the speed of their
/// slowest part, and a buffer that is not 2 MiB-aligned has ordinary pages at its head and
/// tail (up to 2 MiB each), which may be most of the block another rank reads. The kernel
/// reports the huge runs in a few regions; walking 4 MiB of ordinary pages costs about 2 µs,
/// 64 MiB 30–40 µs.
pub(crate) fn mostly_huge(mem: HostSlice<'_>) -> Option<bool> {
    let bytes = mem.len().checked_mul(mem.dtype().size_bytes())?;
    let huge = imp::huge_bytes(mem.as_ptr() as usize, bytes)?;
    // A range without a whole page (an empty one included) has no huge bytes: not mostly huge.
    Some(huge > 0 && huge.saturating_mul(4) >= bytes.saturating_mul(3))
}

/// This node's online processors (`sysconf(_SC_NPROCESSORS_ONLN)`, whatever this process's
/// affinity), asked once; `usize::MAX` when unknown.
pub(crate) fn online_processors() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        // SAFETY: sysconf only reads a system setting: no pointers, no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        usize::try_from(n)
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or(usize::MAX)
    })
}

/// Reads `dst.len()` elements of `dst`'s type from address `src` of process `pid` into `dst`:
/// `Ok` only when every byte arrived. Through the staging block when the offsets make the
/// kernel's copy slow (module docs).
pub(crate) fn read_from(pid: u32, src: usize, mut dst: HostSliceMut<'_>) -> io::Result<()> {
    let bytes = dst
        .len()
        .checked_mul(dst.dtype().size_bytes())
        .ok_or_else(|| io::Error::other("buffer size overflows"))?;
    let to = dst.as_mut_ptr();
    if staging().stages(src, to as usize, bytes) {
        imp::read_staged(pid, src, to, bytes)
    } else {
        imp::read_from(pid, src, to, bytes)
    }
}

/// Writes the elements of `src` at address `dst` of process `pid`: `Ok` only when every byte
/// was written. The caller makes sure the other process lent that memory to the same
/// collective and neither reads nor writes it until the collective's closing exchange.
/// Through the staging block when the offsets make the kernel's copy slow (module docs).
pub(crate) fn write_to(pid: u32, dst: usize, src: HostSlice<'_>) -> io::Result<()> {
    let bytes = src
        .len()
        .checked_mul(src.dtype().size_bytes())
        .ok_or_else(|| io::Error::other("buffer size overflows"))?;
    let from = src.as_ptr();
    if staging().stages(from as usize, dst, bytes) {
        imp::write_staged(pid, dst, from, bytes)
    } else {
        imp::write_to(pid, dst, from, bytes)
    }
}

/// Copies `src` into `dst` (same type and length, else grid-core's error naming both): grid-core's
/// `copy_from` (glibc's `memcpy`), or, where this process measured `memcpy` slow at these
/// buffers' distance (its `rep movsb` range, module docs), a copy in 16-byte vectors with
/// aligned stores, which runs at `memcpy`'s best speed whatever the distance.
pub(crate) fn copy(mut dst: HostSliceMut<'_>, src: HostSlice<'_>) -> io::Result<()> {
    let bytes = src.len() * src.dtype().size_bytes();
    let (to, from) = (dst.as_mut_ptr(), src.as_ptr());
    let fits = dst.dtype() == src.dtype() && dst.len() == src.len();
    if !(fits && staging().copies_by_vectors(from as usize, to as usize, bytes)) {
        return dst
            .copy_from(src)
            .map_err(|e| io::Error::other(e.to_string()));
    }
    // SAFETY: `dst` and `src` are live slices of `bytes` bytes each (same type and length,
    // checked above); `dst` is borrowed exclusively, so the two cannot overlap; any bytes are
    // valid values of this crate's element types (module docs).
    unsafe { imp::copy_bytes(to, from, bytes, true) };
    Ok(())
}

/// A cache line: the staging block is placed at the source's offset in one.
const LINE: usize = 64;

/// The period of the slow distances: a copy's speed depends on `(destination − source) mod
/// PAGE` (measured on an AMD EPYC, Zen 3: distances of 4, 16 and 28 bytes made `rep movsb`
/// copies 3 times slower; 36 to 60, 80, 144, 272, 528, 1040, 2064, 3088, 4048 and 4080 bytes
/// did not, so a destination 16 bytes after its source's offset in a cache line is slow only
/// when it is also 16 bytes after it in a 4 KiB page: the processor's 4 KiB address aliasing
/// between the copy's loads and stores, docs/performance.md).
const PAGE: usize = 4096;

/// The staging block (bytes, plus [`LINE`] of room to place it at any offset): copies go
/// through it in pieces this large, small enough to stay in the cache between the two copies.
const STAGE_BYTES: usize = 128 << 10;

/// Copies shorter than this go straight, whatever the offsets: the second copy's fixed cost
/// would eat what a short copy could save.
const STAGE_MIN: usize = 4 << 10;

/// User-space copies below this size go to `memcpy` whatever the offsets (below its `rep movsb`
/// range).
const VECTORS_MIN: usize = 2 << 10;

/// User-space copies from this size on go to `memcpy` whatever the offsets (above its `rep
/// movsb` range, which glibc ends at the L2 cache's size on AMD processors and at the
/// non-temporal threshold on others; measured equal at every offset from 512 KiB here).
const VECTORS_MAX: usize = 1 << 20;

/// Which distances `(destination − source) mod 4096` of copies are slow on this machine, by
/// class of [`Staging::class`] (0: 0 or 64 and more, never slow; 1: 1–31; 2: 32; 3: 33–63):
/// those of the kernel's copies go through the staging block, those of `memcpy` are made in
/// vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Staging {
    /// The kernel's copies (`process_vm_readv` / `_writev`).
    slow: [bool; 4],
    /// `memcpy` in its `rep movsb` range.
    memcpy_slow: [bool; 4],
}

impl Staging {
    /// No copy staged or made in vectors.
    pub(crate) const NEVER: Staging = Staging {
        slow: [false; 4],
        memcpy_slow: [false; 4],
    };
    /// Every copy whose destination lies 1 to 63 bytes after its source in a page staged or
    /// made in vectors.
    pub(crate) const ALWAYS: Staging = Staging {
        slow: [false, true, true, true],
        memcpy_slow: [false, true, true, true],
    };

    /// The distance class of a copy from `src` to `dst`, by `(dst − src) mod 4096` ([`PAGE`]):
    /// 1 for 1–31, 2 for 32, 3 for 33–63, else 0 (equal offsets, or 64 bytes and more apart,
    /// never slow).
    pub(crate) fn class(src: usize, dst: usize) -> usize {
        match dst.wrapping_sub(src) % PAGE {
            1..=31 => 1,
            32 => 2,
            33..=63 => 3,
            _ => 0,
        }
    }

    /// Whether a kernel copy of `bytes` bytes from `src` to `dst` goes through the staging
    /// block.
    pub(crate) fn stages(self, src: usize, dst: usize, bytes: usize) -> bool {
        bytes >= STAGE_MIN && self.slow[Self::class(src, dst)]
    }

    /// Whether a user-space copy of `bytes` bytes from `src` to `dst` is made in vectors
    /// instead of by `memcpy`.
    pub(crate) fn copies_by_vectors(self, src: usize, dst: usize, bytes: usize) -> bool {
        (VECTORS_MIN..VECTORS_MAX).contains(&bytes) && self.memcpy_slow[Self::class(src, dst)]
    }

    /// The verdict of a measurement: `kernel[c]` and `memcpy[c]`, the fastest of several
    /// copies of one size at offset class `c` (any unit). A class is slow when its copies took
    /// more than 1.5 times the aligned ones: staging then more than pays for the second copy
    /// (about a third of an aligned kernel copy, measured), and the vectors run at `memcpy`'s
    /// aligned speed.
    pub(crate) fn from_times(kernel: [f64; 4], memcpy: [f64; 4]) -> Staging {
        let slow = |best: [f64; 4]| {
            let mut slow = [false; 4];
            for c in 1..4 {
                slow[c] = best[0] > 0.0 && best[c] > 1.5 * best[0];
            }
            slow
        };
        Staging {
            slow: slow(kernel),
            memcpy_slow: slow(memcpy),
        }
    }
}

/// This process's [`Staging`]: from [`STAGE_COPIES_ENV`](crate::STAGE_COPIES_ENV) when it
/// says `always` or `never`, else measured once ([`imp::measure`]; nothing staged where the
/// kernel cannot copy, and `memcpy` alone off x86-64).
pub(crate) fn staging() -> Staging {
    static STAGING: std::sync::OnceLock<Staging> = std::sync::OnceLock::new();
    *STAGING.get_or_init(|| match crate::config::stage_copies() {
        Ok(Some(fixed)) => fixed,
        // Communicator creation reports a bad value; the copies measure.
        Ok(None) | Err(_) => {
            let (kernel, memcpy) = imp::measure();
            let staging = Staging::from_times(kernel.unwrap_or([0.0; 4]), memcpy);
            tracing::debug!(?kernel, ?memcpy, ?staging, "copy offsets measured");
            staging
        }
    })
}

#[cfg(target_os = "linux")]
mod imp {
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;
    use std::sync::Mutex;

    /// `struct page_region` of `<linux/fs.h>` (6.7).
    #[repr(C)]
    #[derive(Default)]
    struct PageRegion {
        start: u64,
        end: u64,
        categories: u64,
    }

    /// `struct pm_scan_arg` of `<linux/fs.h>` (6.7).
    #[repr(C)]
    #[derive(Default)]
    struct PmScanArg {
        size: u64,
        flags: u64,
        start: u64,
        end: u64,
        walk_end: u64,
        vec: u64,
        vec_len: u64,
        max_pages: u64,
        category_inverted: u64,
        category_mask: u64,
        category_anyof_mask: u64,
        return_mask: u64,
    }

    /// `PAGE_IS_HUGE`: a page of a huge (PMD) mapping.
    const PAGE_IS_HUGE: u64 = 1 << 6;
    /// `_IOWR('f', 16, struct pm_scan_arg)`.
    const PAGEMAP_SCAN: u64 =
        (3 << 30) | ((std::mem::size_of::<PmScanArg>() as u64) << 16) | (0x66 << 8) | 16;
    const PAGE: usize = 4096;

    /// This process's `/proc/self/pagemap`, opened once, with the id of the process that
    /// opened it.
    static PAGEMAP: Mutex<Option<(u32, File)>> = Mutex::new(None);

    /// Regions the kernel fills per `PAGEMAP_SCAN` call (runs of huge pages; a buffer of a
    /// few mappings has one or two).
    const REGIONS: usize = 8;

    /// How many bytes of the whole pages of `[addr, addr + bytes)` are mapped by huge pages
    /// (0 when the range holds no whole page).
    pub(super) fn huge_bytes(addr: usize, bytes: usize) -> Option<usize> {
        let start = addr.checked_add(PAGE - 1)? & !(PAGE - 1);
        let end = addr.checked_add(bytes)? & !(PAGE - 1);
        if end <= start {
            return Some(0);
        }
        let mut open = PAGEMAP.lock().unwrap_or_else(|p| p.into_inner());
        let me = std::process::id();
        // Opening it took 25–30 µs in an MPI process, so it is kept, with the process id that
        // opened it: a forked child opens its own instead of reading its parent's page tables.
        if open.as_ref().is_none_or(|(pid, _)| *pid != me) {
            *open = Some((me, File::open("/proc/self/pagemap").ok()?));
        }
        let f = &open.as_ref()?.1;
        let mut huge = 0usize;
        let mut from = start;
        while from < end {
            let mut regions: [PageRegion; REGIONS] = Default::default();
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                start: from as u64,
                end: end as u64,
                vec: regions.as_mut_ptr() as u64,
                vec_len: REGIONS as u64,
                category_mask: PAGE_IS_HUGE,
                return_mask: PAGE_IS_HUGE,
                ..PmScanArg::default()
            };
            // SAFETY: PAGEMAP_SCAN reads `arg` and writes `arg.walk_end` and at most
            // `vec_len` (REGIONS) entries at `vec`, `regions`, both alive and exclusively
            // borrowed here; it walks this process's page tables over [from, end) without
            // touching that memory (module docs). An older kernel fails with ENOTTY or
            // EINVAL, answered as None.
            let n = unsafe {
                libc::ioctl(f.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg as *mut PmScanArg)
            };
            let n = usize::try_from(n).ok()?.min(REGIONS);
            for r in &regions[..n] {
                let (a, b) = (r.start.max(from as u64), r.end.min(end as u64));
                huge += usize::try_from(b.saturating_sub(a)).ok()?;
            }
            // Fewer regions than room for: the walk reached `end`. Else go on from where it
            // stopped (always past `from`, or the walk would have found nothing).
            let stop = usize::try_from(arg.walk_end).ok()?;
            if n < REGIONS || stop <= from {
                break;
            }
            from = stop;
        }
        Some(huge.min(end - start))
    }

    pub(super) fn read_from(pid: u32, src: usize, dst: *mut u8, bytes: usize) -> io::Result<()> {
        transfer(pid, bytes, "process_vm_readv", |done| {
            let local = libc::iovec {
                // SAFETY (pointer arithmetic): done < bytes, within the destination.
                iov_base: unsafe { dst.add(done) }.cast(),
                iov_len: bytes - done,
            };
            let remote = libc::iovec {
                iov_base: src.wrapping_add(done) as *mut libc::c_void,
                iov_len: bytes - done,
            };
            // SAFETY: the kernel writes at most `local.iov_len` bytes at `local.iov_base`,
            // the rest of the destination slice, which the caller borrows exclusively; any
            // bytes are valid values of this crate's element types (module docs). The remote
            // range is checked by the kernel against the other process's mappings.
            unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) }
        })
    }

    pub(super) fn write_to(pid: u32, dst: usize, src: *const u8, bytes: usize) -> io::Result<()> {
        transfer(pid, bytes, "process_vm_writev", |done| {
            let local = libc::iovec {
                // SAFETY (pointer arithmetic): done < bytes, within the source. The kernel
                // only reads through this iovec.
                iov_base: unsafe { src.add(done) }.cast_mut().cast(),
                iov_len: bytes - done,
            };
            let remote = libc::iovec {
                iov_base: dst.wrapping_add(done) as *mut libc::c_void,
                iov_len: bytes - done,
            };
            // SAFETY: the kernel reads at most `local.iov_len` bytes of the source slice,
            // which the caller borrows; it writes only the other process's memory, checked
            // against that process's mappings (what that memory means there is the caller's
            // protocol: a buffer lent to the same collective, module docs).
            unsafe { libc::process_vm_writev(pid as libc::pid_t, &local, 1, &remote, 1, 0) }
        })
    }

    /// The span of memory [`measure`] walks: larger than the L2 cache of the processors it
    /// was measured on (512 KiB to 2 MiB per core).
    const MEASURE_SPAN: usize = 2 << 20;

    thread_local! {
        /// This thread's staging block ([`super::STAGE_BYTES`] + [`super::LINE`] bytes, made
        /// on first use).
        static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Runs `f` with a part of this thread's staging block of [`super::STAGE_BYTES`] bytes
    /// that starts at offset `at mod 64` (a cache line), as the address it will be copied
    /// with.
    fn with_stage<R>(at: usize, f: impl FnOnce(*mut u8) -> io::Result<R>) -> io::Result<R> {
        STAGE.with(|cell| {
            let mut block = cell
                .try_borrow_mut()
                .map_err(|_| io::Error::other("staging block already in use"))?;
            if block.len() < super::STAGE_BYTES + super::LINE {
                block.resize(super::STAGE_BYTES + super::LINE, 0);
            }
            let base = block.as_mut_ptr();
            let skip = at.wrapping_sub(base as usize) % super::LINE;
            // SAFETY (pointer arithmetic): skip < LINE, and the block holds STAGE_BYTES +
            // LINE bytes, so [base + skip, base + skip + STAGE_BYTES) lies inside it.
            f(unsafe { base.add(skip) })
        })
    }

    /// [`read_from`] through the staging block: each piece read by the kernel into the block
    /// at the source's offset, then copied to `dst`.
    pub(super) fn read_staged(pid: u32, src: usize, dst: *mut u8, bytes: usize) -> io::Result<()> {
        let mut done = 0usize;
        while done < bytes {
            let piece = (bytes - done).min(super::STAGE_BYTES);
            let from = src.wrapping_add(done);
            with_stage(from, |stage| {
                read_from(pid, from, stage, piece)?;
                // SAFETY (pointer arithmetic): done + piece <= bytes, inside the destination.
                let to = unsafe { dst.add(done) };
                let vectors =
                    super::staging().copies_by_vectors(stage as usize, to as usize, piece);
                // SAFETY: `stage` holds `piece` bytes just written by the kernel (piece <=
                // STAGE_BYTES, inside the staging block); the destination's bytes [done,
                // done + piece) lie inside the caller's exclusively borrowed slice of `bytes`
                // bytes; the thread-local block never overlaps a caller's buffer.
                unsafe { copy_bytes(to, stage, piece, vectors) };
                Ok(())
            })?;
            done += piece;
        }
        Ok(())
    }

    /// [`write_to`] through the staging block: each piece copied into the block at the
    /// destination's offset, then written by the kernel.
    pub(super) fn write_staged(
        pid: u32,
        dst: usize,
        src: *const u8,
        bytes: usize,
    ) -> io::Result<()> {
        let mut done = 0usize;
        while done < bytes {
            let piece = (bytes - done).min(super::STAGE_BYTES);
            let to = dst.wrapping_add(done);
            with_stage(to, |stage| {
                // SAFETY (pointer arithmetic): done + piece <= bytes, inside the source.
                let from = unsafe { src.add(done) };
                let vectors =
                    super::staging().copies_by_vectors(from as usize, stage as usize, piece);
                // SAFETY: the source's bytes [done, done + piece) lie inside the caller's
                // borrowed slice of `bytes` bytes; `stage` has room for `piece` <= STAGE_BYTES
                // bytes inside the staging block, which never overlaps a caller's buffer.
                unsafe { copy_bytes(stage, from, piece, vectors) };
                write_to(pid, to, stage, piece)
            })?;
            done += piece;
        }
        Ok(())
    }

    /// The fastest of several copies of 32 KiB of this process's own memory at each distance
    /// class of [`super::Staging::class`] (the destination 0, 16, 32 and 48 bytes after the
    /// source's offset in a 4 KiB page), interleaved, in seconds: by `process_vm_readv`
    /// (`None` when the kernel refuses it) and by `memcpy`.
    ///
    /// The slow offsets are slow only for memory outside the core's own caches (measured: 64
    /// KiB copied again and again took the same time at every offset), so the copies walk two
    /// buffers of [`MEASURE_SPAN`] bytes: each piece was last touched two spans of traffic ago.
    /// 1.5 MiB copied in all, about 2 ms once per process.
    pub(super) fn measure() -> (Option<[f64; 4]>, [f64; 4]) {
        const PIECE: usize = 32 << 10;
        const ROUNDS: usize = 3;
        const PER_ROUND: usize = 2;
        let pieces = MEASURE_SPAN / PIECE;
        let src = vec![1u8; MEASURE_SPAN + super::PAGE];
        // Written once, so that no copy below pays for a first touch.
        let mut dst = vec![1u8; MEASURE_SPAN + super::PAGE + super::LINE];
        let me = std::process::id();
        // Both start on a page: the source at its first one, the destination 0, 16, 32 or 48
        // bytes after its own (pieces are multiples of a page apart, so every copy keeps the
        // distance of its class).
        let page = |p: usize| p.wrapping_neg() % super::PAGE;
        let from0 = src.as_ptr() as usize + page(src.as_ptr() as usize);
        let to0 = page(dst.as_ptr() as usize);
        let mut kernel = Some([f64::INFINITY; 4]);
        let mut memcpy = [f64::INFINITY; 4];
        let mut next = 0usize;
        for _ in 0..ROUNDS {
            for (c, off) in [0usize, 16, 32, 48].into_iter().enumerate() {
                for by_kernel in [true, false] {
                    for _ in 0..PER_ROUND {
                        let at = (next % pieces) * PIECE;
                        next += 1;
                        let from = from0 + at;
                        // SAFETY (pointer arithmetic): to0 + off + at + PIECE < PAGE + LINE +
                        // MEASURE_SPAN, inside `dst`, which is exclusively borrowed here.
                        let to = unsafe { dst.as_mut_ptr().add(to0 + off + at) };
                        let t = std::time::Instant::now();
                        if by_kernel {
                            let Some(best) = kernel.as_mut() else {
                                continue;
                            };
                            match read_from(me, from, to, PIECE) {
                                Ok(()) => best[c] = best[c].min(t.elapsed().as_secs_f64()),
                                Err(_) => kernel = None,
                            }
                        } else {
                            // SAFETY: `from` and `to` each start PIECE bytes inside `src` and
                            // `dst` (from + PIECE <= src + PAGE + MEASURE_SPAN), two different
                            // allocations.
                            unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to, PIECE) };
                            std::hint::black_box(&mut dst);
                            memcpy[c] = memcpy[c].min(t.elapsed().as_secs_f64());
                        }
                    }
                }
            }
        }
        (kernel, memcpy)
    }

    /// Copies `bytes` bytes from `src` to `dst`: by `memcpy`, or with `vectors` (x86-64) in
    /// 16-byte vectors, unaligned loads and aligned stores, 64 bytes per step.
    ///
    /// # Safety
    /// `src` must be valid for reading and `dst` for writing `bytes` bytes, and the two ranges
    /// must not overlap.
    pub(super) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize, vectors: bool) {
        #[cfg(target_arch = "x86_64")]
        if vectors {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_store_si128};
            // The head up to the destination's first 16-byte boundary, by memcpy.
            let head = (dst as usize).wrapping_neg() % 16;
            let head = head.min(bytes);
            // SAFETY: the caller's contract; head <= bytes.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
            let mut i = head;
            while i + 64 <= bytes {
                // SAFETY: [i, i + 64) lies inside both ranges (i + 64 <= bytes); SSE2 is part
                // of x86-64; the stores are 16-byte aligned (dst + head is, and i - head is a
                // multiple of 64); the loads need no alignment.
                unsafe {
                    let (s, d) = (src.add(i), dst.add(i));
                    let a = _mm_loadu_si128(s.cast::<__m128i>());
                    let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
                    let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
                    let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
                    _mm_store_si128(d.cast::<__m128i>(), a);
                    _mm_store_si128(d.add(16).cast::<__m128i>(), b);
                    _mm_store_si128(d.add(32).cast::<__m128i>(), c);
                    _mm_store_si128(d.add(48).cast::<__m128i>(), e);
                }
                i += 64;
            }
            // SAFETY: the tail [i, bytes) lies inside both ranges.
            unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), bytes - i) };
            return;
        }
        let _ = vectors;
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    }

    /// Repeats `call(bytes done so far)` (one `process_vm_readv` or `_writev` of the rest)
    /// until `bytes` bytes moved; a call that moves nothing or fails (but for `EINTR`) ends it.
    fn transfer(
        pid: u32,
        bytes: usize,
        what: &str,
        mut call: impl FnMut(usize) -> isize,
    ) -> io::Result<()> {
        libc::pid_t::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
        let mut done = 0usize;
        while done < bytes {
            match call(done) {
                g if g > 0 => done += g as usize,
                0 => return Err(io::Error::other(format!("{what} moved nothing"))),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;

    pub(super) fn huge_bytes(_addr: usize, _bytes: usize) -> Option<usize> {
        None
    }

    pub(super) fn read_from(
        _pid: u32,
        _src: usize,
        _dst: *mut u8,
        _bytes: usize,
    ) -> io::Result<()> {
        Err(unsupported())
    }

    pub(super) fn write_to(
        _pid: u32,
        _dst: usize,
        _src: *const u8,
        _bytes: usize,
    ) -> io::Result<()> {
        Err(unsupported())
    }

    // Staged or not, nothing copies here.
    pub(super) use self::{read_from as read_staged, write_to as write_staged};

    pub(super) fn measure() -> (Option<[f64; 4]>, [f64; 4]) {
        (None, [0.0; 4])
    }

    /// # Safety
    /// As the Linux version: `src` readable and `dst` writable for `bytes` bytes, no overlap.
    pub(super) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize, _vectors: bool) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    }

    fn unsupported() -> io::Error {
        io::Error::new(
            io::ErrorKind::Unsupported,
            "process_vm_readv and process_vm_writev are Linux-only",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_this_process_copies_every_byte() {
        let src: Vec<u32> = (0..300_000).collect();
        let mut dst = vec![0u32; src.len()];
        let at = src.as_ptr() as usize;
        let got = read_from(std::process::id(), at, HostSliceMut::U32(&mut dst));
        if cfg!(target_os = "linux") {
            // A process may always read itself.
            got.expect("process_vm_readv of this process");
            assert_eq!(dst, src);
        } else {
            assert_eq!(got.unwrap_err().kind(), io::ErrorKind::Unsupported);
        }
    }

    #[test]
    fn writing_this_process_copies_every_byte() {
        let src: Vec<u64> = (0..100_000).map(|i| i * 3).collect();
        let mut dst = vec![0u64; src.len()];
        let at = dst.as_mut_ptr() as usize;
        let got = write_to(std::process::id(), at, HostSlice::U64(&src));
        if cfg!(target_os = "linux") {
            got.expect("process_vm_writev of this process");
            // The kernel wrote `dst` behind the compiler's back; read it through a barrier.
            assert_eq!(std::hint::black_box(&dst), &src);
        } else {
            assert_eq!(got.unwrap_err().kind(), io::ErrorKind::Unsupported);
        }
    }

    /// A source and a destination with room to place either at any offset in a cache line.
    fn offset_buffers(len: usize) -> (Vec<u8>, Vec<u8>) {
        let src: Vec<u8> = (0..len + 2 * LINE)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        (src, vec![0u8; len + 2 * LINE])
    }

    /// The byte offset at which `v`'s contents sit `off` bytes past a cache line.
    fn at_line(v: &[u8], off: usize) -> usize {
        (v.as_ptr() as usize).wrapping_neg() % LINE + off
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn staged_copies_move_every_byte_at_every_offset() {
        let me = std::process::id();
        // One piece and a short tail, several pieces and a tail, and one under STAGE_MIN.
        for len in [STAGE_BYTES + 5, 3 * STAGE_BYTES + 123, 1000] {
            let (src, mut dst) = offset_buffers(len);
            for (s_off, d_off) in [(0, 0), (0, 16), (16, 0), (5, 60), (63, 1), (32, 0), (7, 7)] {
                let from = at_line(&src, s_off);
                let to = at_line(&dst, d_off);
                dst.fill(0);
                imp::read_staged(
                    me,
                    src[from..].as_ptr() as usize,
                    dst[to..].as_mut_ptr(),
                    len,
                )
                .expect("staged read of this process");
                assert!(
                    dst[to..to + len] == src[from..from + len],
                    "staged read, {len} bytes, offsets {s_off} -> {d_off}"
                );
                // Nothing written around the destination.
                assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0));
                dst.fill(0);
                imp::write_staged(me, dst[to..].as_ptr() as usize, src[from..].as_ptr(), len)
                    .expect("staged write of this process");
                assert!(
                    std::hint::black_box(&dst)[to..to + len] == src[from..from + len],
                    "staged write, {len} bytes, offsets {s_off} -> {d_off}"
                );
                assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn copies_in_vectors_move_every_byte_at_every_offset() {
        for len in [0, 1, 15, 16, 63, 64, 65, 200, 4096 + 13, 70_001] {
            let (src, mut dst) = offset_buffers(len);
            for s_off in [0, 1, 16, 33] {
                for d_off in 0..LINE {
                    let (from, to) = (at_line(&src, s_off), at_line(&dst, d_off));
                    dst.fill(0);
                    // SAFETY: both ranges lie inside their vectors (offsets < 2 * LINE - len
                    // of room), two different allocations.
                    unsafe {
                        imp::copy_bytes(dst[to..].as_mut_ptr(), src[from..].as_ptr(), len, true)
                    };
                    assert!(
                        dst[to..to + len] == src[from..from + len],
                        "{len} bytes, offsets {s_off} -> {d_off}"
                    );
                    assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0));
                }
            }
        }
        // Through the typed entry point, whatever this machine measured.
        let src: Vec<f32> = (0..50_000).map(|i| i as f32 * 0.5).collect();
        let mut dst = vec![0f32; 50_004];
        for off in 0..4 {
            copy(
                HostSliceMut::F32(&mut dst[off..off + 50_000]),
                HostSlice::F32(&src),
            )
            .unwrap();
            assert_eq!(&dst[off..off + 50_000], &src[..]);
        }
        let e = copy(HostSliceMut::F32(&mut dst[..3]), HostSlice::F32(&src[..4])).unwrap_err();
        assert!(
            e.to_string()
                .contains("copy of 4 f32 elements into 3 f32 elements"),
            "{e}"
        );
    }

    #[test]
    fn offset_classes_and_the_verdict() {
        assert_eq!(Staging::class(64, 128), 0);
        assert_eq!(Staging::class(16, 32), 1);
        assert_eq!(Staging::class(0, 31), 1);
        assert_eq!(Staging::class(0, 32), 2);
        assert_eq!(Staging::class(0, 33), 3);
        assert_eq!(Staging::class(0, 63), 3);
        assert_eq!(Staging::class(usize::MAX, 0), 1);
        // The distance counts in a 4 KiB page, not in a cache line: 16 bytes after the
        // source's offset in a line but 80, 2064 or 4080 bytes after it in a page is fast
        // (measured), and so is a destination before its source.
        assert_eq!(Staging::class(0, 80), 0);
        assert_eq!(Staging::class(0, 2064), 0);
        assert_eq!(Staging::class(0, 4096 + 16), 1);
        assert_eq!(Staging::class(48, 16), 0);
        assert_eq!(Staging::class(32, 16), 0);
        assert_eq!(Staging::class(1 << 20, (1 << 20) + 8192 + 40), 3);
        // AMD EPYC (Zen 3), measured: destinations 16 bytes after the source 2-7x slower.
        let s = Staging::from_times(
            [8.2e-6, 2.9e-5, 8.4e-6, 8.0e-6],
            [3.3e-6, 1.1e-5, 3.3e-6, 3.2e-6],
        );
        assert!(s.stages(0, 16, 1 << 20) && s.copies_by_vectors(0, 16, 64 << 10));
        assert!(!s.stages(0, 48, 1 << 20) && !s.stages(0, 64, 1 << 20));
        assert!(!s.stages(0, 80, 1 << 20) && !s.copies_by_vectors(0, 2064, 64 << 10));
        assert!(!s.copies_by_vectors(0, 32, 64 << 10));
        // Short copies go straight; memcpy's large copies are fast at any offset.
        assert!(!s.stages(0, 16, STAGE_MIN - 1));
        assert!(!s.copies_by_vectors(0, 16, VECTORS_MIN - 1));
        assert!(!s.copies_by_vectors(0, 16, VECTORS_MAX));
        // Equal times, or no measurement (the kernel refused): nothing slow.
        assert_eq!(Staging::from_times([1.0; 4], [1.0; 4]), Staging::NEVER);
        assert_eq!(Staging::from_times([0.0; 4], [0.0; 4]), Staging::NEVER);
        assert!(!Staging::ALWAYS.stages(8, 8, 1 << 20));
        assert!(Staging::ALWAYS.stages(8, 40, 1 << 20));
    }

    #[test]
    fn plain_memory_is_not_mostly_huge() {
        // Ten bytes hold no whole page; a small heap block is never mostly on 2 MiB pages.
        let v = vec![1u8; 3 * 4096];
        let at = 4096 - v.as_ptr() as usize % 4096 + 1;
        if cfg!(target_os = "linux") {
            assert_eq!(mostly_huge(HostSlice::U8(&v[at..at + 10])), Some(false));
        }
        assert_ne!(mostly_huge(HostSlice::U8(&v)), Some(true));
        assert_eq!(mostly_huge(HostSlice::U8(&v[..0])), Some(false));
    }

    /// The scan's verdict on a 32 MiB mapping advised to huge pages agrees with what the kernel
    /// reports for that mapping in `/proc/self/smaps` (whether the kernel found huge pages for
    /// it depends on its THP mode and free memory, so both answers are possible).
    #[cfg(target_os = "linux")]
    #[test]
    fn the_verdict_matches_smaps() {
        const LEN: usize = 32 << 20;
        // SAFETY: a fresh private anonymous mapping, used only through the slice below and
        // unmapped at the end; madvise only changes how it is backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: as above.
        unsafe { libc::madvise(p, LEN, libc::MADV_HUGEPAGE) };
        // SAFETY: the mapping is LEN bytes, readable and writable, and nothing else uses it.
        let mem = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), LEN) };
        mem.fill(1);
        let verdict = mostly_huge(HostSlice::U8(mem));
        let whole = imp::huge_bytes(p as usize, LEN);
        // A range that starts and ends inside huge pages counts the bytes within it: 2 MiB
        // from the middle of the first huge page on, when every page is huge.
        let inner = imp::huge_bytes(p as usize + (1 << 20), 2 << 20);
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let (start, end) = (p as usize, p as usize + LEN);
        let mut inside = false;
        let mut huge_kb = 0usize;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first
                .split_once('-')
                .filter(|(a, _)| a.chars().all(|c| c.is_ascii_hexdigit()) && !a.is_empty())
            {
                let (a, b) = (
                    usize::from_str_radix(a, 16).unwrap_or(0),
                    usize::from_str_radix(b, 16).unwrap_or(0),
                );
                inside = a < end && start < b;
            } else if inside && line.starts_with("AnonHugePages:") {
                huge_kb += line
                    .split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
            }
        }
        // SAFETY: unmapping the mapping created above; `mem` is not used afterwards.
        unsafe { libc::munmap(p, LEN) };
        if let Some(v) = verdict {
            assert_eq!(
                v,
                huge_kb * 1024 * 4 >= LEN * 3,
                "scan {v}, smaps {huge_kb} kB huge"
            );
        }
        if let (Some(whole), Some(inner)) = (whole, inner) {
            // smaps may add a neighbouring mapping merged with this one, never less.
            assert!(
                whole <= LEN && whole <= huge_kb * 1024,
                "scan {whole} B, smaps {huge_kb} kB"
            );
            assert!(
                inner <= 2 << 20 && inner <= whole,
                "inner {inner} B of {whole} B"
            );
            if whole == LEN {
                assert_eq!(
                    inner,
                    2 << 20,
                    "every page huge, yet {inner} B of 2 MiB counted"
                );
            }
        }
    }

    #[test]
    fn a_range_without_a_whole_page_has_no_huge_bytes() {
        let v = vec![0u8; 3 * 4096];
        let at = v.as_ptr() as usize + 1;
        assert_eq!(imp::huge_bytes(at, 4095).unwrap_or(0), 0);
        assert_eq!(imp::huge_bytes(at, 0).unwrap_or(0), 0);
        // Ordinary heap pages: none huge, whole pages or not.
        assert!(imp::huge_bytes(at, 2 * 4096).unwrap_or(0) <= 4096);
    }
}
