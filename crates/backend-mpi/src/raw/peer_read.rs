//! The kernel calls behind the collectives that copy straight between the ranks' memory
//! (`crate::peer_read`): whether memory is backed by transparent huge pages (the
//! `PAGEMAP_SCAN` ioctl of `/proc/self/pagemap`, Linux 6.7 and later), and a copy from or to
//! another process's memory (`process_vm_readv` and `process_vm_writev`, the calls behind
//! Open MPI's CMA).
//!
//! All are Linux-only; elsewhere [`mostly_huge`] answers `None` and [`read_from`] and
//! [`write_to`] an `Unsupported` error, so the callers keep MPI's path.
//!
//! Invariants:
//! - `PAGEMAP_SCAN` only walks this process's page tables over the address range it is given;
//!   it dereferences none of that memory, and writes only the region array passed with it
//!   (`vec`, `vec_len` entries, owned by `huge_bytes`).
//! - `process_vm_readv` writes at most the local iovec's length, which is exactly the
//!   exclusively borrowed destination slice; `process_vm_writev` only reads the borrowed
//!   source slice here. Every element type of this crate accepts any bit pattern (numbers and
//!   one-byte wrappers), so whatever bytes arrive leave valid values, and the caller copies
//!   only between buffers of the same type.
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

/// Reads `dst.len()` elements of `dst`'s type from address `src` of process `pid` into `dst`:
/// `Ok` only when every byte arrived.
pub(crate) fn read_from(pid: u32, src: usize, mut dst: HostSliceMut<'_>) -> io::Result<()> {
    let bytes = dst
        .len()
        .checked_mul(dst.dtype().size_bytes())
        .ok_or_else(|| io::Error::other("buffer size overflows"))?;
    imp::read_from(pid, src, dst.as_mut_ptr(), bytes)
}

/// Writes the elements of `src` at address `dst` of process `pid`: `Ok` only when every byte
/// was written. The caller makes sure the other process lent that memory to the same
/// collective and neither reads nor writes it until the collective's closing exchange.
pub(crate) fn write_to(pid: u32, dst: usize, src: HostSlice<'_>) -> io::Result<()> {
    let bytes = src
        .len()
        .checked_mul(src.dtype().size_bytes())
        .ok_or_else(|| io::Error::other("buffer size overflows"))?;
    imp::write_to(pid, dst, src.as_ptr(), bytes)
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
