//! The all-gather (in place or not) and the broadcast that copy straight between the ranks'
//! memory (module `peer_read`; `PEER_READ_MIN`, `MpiBackend::peer_reads`):
//!
//! * on buffers advised to huge pages as numpy advises its arrays, of every element size, at 3
//!   ranks: the right result, and the peers read exactly when every rank's buffer lies on huge
//!   pages (as `/proc/self/smaps` reports; the kernel may find none);
//! * on plain buffers, on a mix of both, and below `PEER_READ_MIN`: the right result through
//!   `MPI_Allgather`, no peer read;
//! * broadcasts (the root writes the head of every other rank's buffer, which reads the rest),
//!   of an odd length, from ranks other than 0, and the all-gather out of place (each rank's
//!   send buffer read by the others);
//! * with `process_vm_readv` forbidden on one rank (a seccomp filter, as container runtimes'
//!   default profiles install): the right result on every rank, and the communicator stops
//!   trying on every rank alike.
#![cfg(target_os = "linux")]

use backend_mpi::{mpi_test, MpiCommunicator, PEER_READ_MIN};
use grid_core::{Communicator, CommunicatorExt, Element, ReduceOp};

/// A vector of `len` zeros allocated as numpy allocates an array of 4 MiB or more: huge pages
/// advised (`madvise(MADV_HUGEPAGE)`) from the first page boundary, before the first write.
fn numpy_like<T: Element + Default>(len: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    let bytes = len * std::mem::size_of::<T>();
    let start = v.as_ptr() as usize;
    let offset = 4096 - start % 4096;
    if bytes > offset {
        // SAFETY: [start + offset, start + bytes) lies inside the vector's allocation and starts
        // on a page boundary; MADV_HUGEPAGE only changes how the kernel backs those pages.
        unsafe {
            libc::madvise(
                (start + offset) as *mut libc::c_void,
                bytes - offset,
                libc::MADV_HUGEPAGE,
            )
        };
    }
    v.resize(len, T::default());
    v
}

/// How much of a buffer lies on huge pages, as `/proc/self/smaps` reports it (`AnonHugePages`
/// of the mappings that overlap it, capped at its length). The backend samples a few pages
/// instead, and needs three quarters of them huge, so the tests expect a verdict only where
/// the share is clear: 90% or more, or under half.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Pages {
    Plain = 0,
    Between = 1,
    Huge = 2,
}

fn pages<T>(v: &[T]) -> Pages {
    let (start, end) = (
        v.as_ptr() as usize,
        v.as_ptr() as usize + std::mem::size_of_val(v),
    );
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let (mut inside, mut huge) = (false, 0usize);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        let range = first.split_once('-').and_then(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        // A mapping's first line starts with its address range; its fields follow.
        if let Some((a, b)) = range {
            inside = a < end && start < b;
        } else if inside && line.starts_with("AnonHugePages:") {
            let kb = line.split_whitespace().nth(1).and_then(|x| x.parse().ok());
            huge += kb.unwrap_or(0usize) * 1024;
        }
    }
    let (huge, len) = (huge.min(end - start), end - start);
    if huge * 10 >= len * 9 {
        Pages::Huge
    } else if huge * 2 < len {
        Pages::Plain
    } else {
        Pages::Between
    }
}

/// The least of every rank's `p`.
fn least(c: &MpiCommunicator, p: Pages) -> Result<Pages, String> {
    let mut v = [p as i32];
    c.all_reduce_in_place(&mut v[..], ReduceOp::Min)
        .map_err(|e| e.to_string())?;
    Ok(match v[0] {
        2 => Pages::Huge,
        1 => Pages::Between,
        _ => Pages::Plain,
    })
}

/// Whether every rank passed the same `b`.
fn agree(c: &MpiCommunicator, b: bool) -> Result<bool, String> {
    let mut v = [i32::from(b), -i32::from(b)];
    c.all_reduce_in_place(&mut v[..], ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    Ok(v[0] == -v[1])
}

/// A collective that can copy straight between the ranks' memory.
#[derive(Clone, Copy, Debug)]
enum Coll {
    /// The in-place all-gather: rank r's block holds `value(r, i)`.
    Gather,
    /// The broadcast from this root: its buffer holds `value(root, i)`.
    Broadcast(usize),
    /// The all-gather from a send buffer of `len / size` elements allocated as numpy does
    /// (huge pages advised), holding `value(rank, i)`.
    GatherInto,
}

/// One collective on `buf` (filled with `filler` but for this rank's part, see [`Coll`]),
/// checked element by element; returns whether the ranks' memory was copied directly (the
/// change of `peer_reads`) and the least share of huge pages of any rank's buffers.
fn run<T: Element + Default + std::fmt::Debug>(
    c: &MpiCommunicator,
    coll: Coll,
    buf: &mut [T],
    value: impl Fn(usize, usize) -> T,
    filler: T,
) -> Result<(bool, Pages), String> {
    let (me, n) = (c.rank(), c.size());
    let k = buf.len() / n;
    buf.fill(filler);
    match coll {
        Coll::Gather => {
            for (i, x) in buf[me * k..(me + 1) * k].iter_mut().enumerate() {
                *x = value(me, i);
            }
        }
        Coll::Broadcast(root) if root == me => {
            for (i, x) in buf.iter_mut().enumerate() {
                *x = value(root, i);
            }
        }
        Coll::Broadcast(_) | Coll::GatherInto => {}
    }
    let mut send = numpy_like::<T>(if matches!(coll, Coll::GatherInto) {
        k
    } else {
        0
    });
    for (i, x) in send.iter_mut().enumerate() {
        *x = value(me, i);
    }
    let mine = if send.is_empty() {
        pages(buf)
    } else {
        pages(buf).min(pages(&send))
    };
    let huge = least(c, mine)?;
    let before = c.peer_reads();
    match coll {
        Coll::Gather => c.all_gather_in_place(&mut buf[..]),
        Coll::GatherInto => c.all_gather_into(&send[..], &mut buf[..]),
        Coll::Broadcast(root) => c.broadcast_into(&mut buf[..], root),
    }
    .map_err(|e| e.to_string())?;
    for (at, x) in buf.iter().enumerate() {
        let want = match coll {
            Coll::Gather | Coll::GatherInto => value(at / k, at % k),
            Coll::Broadcast(root) => value(root, at),
        };
        if *x != want {
            return Err(format!(
                "{coll:?}: element {at} of {} ({} bytes each) is {x:?}, expected {want:?}",
                buf.len(),
                std::mem::size_of::<T>()
            ));
        }
    }
    let read = c.peer_reads() - before;
    if read > 1 {
        return Err(format!("one collective counted {read} peer reads"));
    }
    Ok((read == 1, huge))
}

// Numpy-like buffers of 1-, 2-, 4- and 8-byte elements, plain buffers, a mix, and a buffer below
// PEER_READ_MIN, gathered in place and out of place and broadcast: every result exact; the
// ranks' memory copied directly exactly when every buffer lies on huge pages.
mpi_test!(
    mpi_peer_read_gathers_exactly_np3,
    np = 3,
    timeout = 180,
    |rt| {
        let c = rt.world();
        let n = c.size();
        if !c.reads_peers_when_it_pays() {
            return Err("a new communicator of 3 ranks does not try to read its peers".into());
        }
        // A little over PEER_READ_MIN (so that the f32 broadcast of all but one element still
        // reaches it), a multiple of 3 ranks · 8 bytes.
        let bytes = (PEER_READ_MIN / (24 * n) + 8) * 24 * n;
        let mut huge_seen = false;
        let mut expect = |what: &str, (read, huge): (bool, Pages), want: bool| {
            huge_seen |= huge == Pages::Huge;
            let right = match huge {
                Pages::Huge => read == want,
                Pages::Plain => !read,
                // A share of huge pages the backend's sample may judge either way.
                Pages::Between => true,
            };
            if !right {
                return Err(format!(
                    "{what}: the peers were {}read, the least share of huge pages: {huge:?}",
                    if read { "" } else { "not " }
                ));
            }
            Ok(())
        };
        let mut b8 = numpy_like::<u8>(bytes);
        let r = run(c, Coll::Gather, &mut b8, |r, i| (r * 7 + i) as u8, 255)?;
        expect("u8, numpy-like", r, true)?;
        let mut b16 = numpy_like::<i16_as_f16::T>(bytes / 2);
        let r = run(
            c,
            Coll::Gather,
            &mut b16,
            i16_as_f16::value,
            i16_as_f16::filler(),
        )?;
        expect("f16, numpy-like", r, true)?;
        let mut b32 = numpy_like::<f32>(bytes / 4);
        let r = run(
            c,
            Coll::Gather,
            &mut b32,
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        expect("f32, numpy-like", r, true)?;
        // The same buffer again: the verdict on its pages is kept, the result still exact.
        let r = run(
            c,
            Coll::Gather,
            &mut b32,
            |r, i| (r * 1_000_000 + i) as f32 + 0.5,
            -2.0,
        )?;
        expect("f32, numpy-like, again", r, true)?;
        // Broadcasts from rank 1, of an odd length: the root writes the head (len / 3 elements)
        // into the others' buffers, they read the rest from the root's.
        let r = run(
            c,
            Coll::Broadcast(1),
            &mut b32[1..],
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        expect("f32 broadcast, numpy-like", r, true)?;
        let r = run(
            c,
            Coll::Broadcast(2),
            &mut b8[..],
            |r, i| (r * 3 + i) as u8,
            0,
        )?;
        expect("u8 broadcast, numpy-like", r, true)?;
        // Out of place: each rank's send buffer read by the others.
        let r = run(
            c,
            Coll::GatherInto,
            &mut b32,
            |r, i| (r * 1_000_000 + i) as f32 + 0.25,
            -3.0,
        )?;
        expect("f32 all-gather out of place, numpy-like", r, true)?;
        let mut b64 = numpy_like::<i64>(bytes / 8);
        let r = run(
            c,
            Coll::Gather,
            &mut b64,
            |r, i| (r << 40) as i64 + i as i64,
            -1,
        )?;
        expect("i64, numpy-like", r, true)?;
        drop((b8, b16, b64));
        // Plain memory: huge only where the kernel's THP mode is `always`.
        let mut plain = vec![0f32; bytes / 4];
        let r = run(
            c,
            Coll::Gather,
            &mut plain,
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        expect("f32, plain", r, true)?;
        // Rank 0 numpy-like, the others plain: every rank decides alike.
        let mut mixed = if c.rank() == 0 {
            numpy_like::<f32>(bytes / 4)
        } else {
            vec![0f32; bytes / 4]
        };
        let r = run(
            c,
            Coll::Gather,
            &mut mixed,
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        expect("f32, numpy-like on rank 0 only", r, true)?;
        // Below PEER_READ_MIN: always MPI_Allgather.
        let mut small = numpy_like::<f32>(PEER_READ_MIN / 4 / 2 / n * n);
        let r = run(
            c,
            Coll::Gather,
            &mut small,
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        expect("f32, below PEER_READ_MIN", r, false)?;
        if !huge_seen && c.rank() == 0 {
            eprintln!(
            "note: the kernel gave no huge pages to these buffers (THP mode or memory), so only \
             MPI_Allgather's path was exercised"
        );
        }
        Ok(())
    }
);

/// f16 elements (2 bytes) built from bits, every one a distinct finite value.
mod i16_as_f16 {
    pub type T = half::f16;
    pub fn value(r: usize, i: usize) -> T {
        half::f16::from_bits(((r * 131 + i) % 30_000) as u16)
    }
    pub fn filler() -> T {
        half::f16::from_bits(0x7bff)
    }
}

// Rank 1 cannot read other processes (a seccomp filter answers process_vm_readv with EPERM):
// when the buffers qualify, the read fails there, every rank falls back to MPI_Allgather with the
// right result, and the communicator stops trying on every rank.
mpi_test!(
    mpi_peer_read_refused_falls_back_np2,
    np = 2,
    timeout = 120,
    |rt| {
        let c = rt.world();
        if c.rank() == 1 {
            forbid_process_vm_readv()?;
        }
        let len = PEER_READ_MIN / 4;
        let mut buf = numpy_like::<f32>(len);
        let (read, huge) = run(
            c,
            Coll::Gather,
            &mut buf,
            |r, i| (r * 1_000_000 + i) as f32,
            -1.0,
        )?;
        if read {
            return Err("the peers were read although rank 1 may not read".into());
        }
        if huge == Pages::Huge && c.reads_peers_when_it_pays() {
            return Err("a failed read did not stop the peer reads of this communicator".into());
        }
        if huge != Pages::Huge && c.rank() == 0 {
            eprintln!("note: the kernel gave few huge pages to these buffers ({huge:?})");
        }
        // Later calls keep to MPI_Allgather and stay exact.
        let (read, _) = run(
            c,
            Coll::Gather,
            &mut buf,
            |r, i| (r * 1_000_000 + i) as f32 + 0.5,
            -2.0,
        )?;
        if read {
            return Err("the peers were read after a failed read".into());
        }
        if !agree(c, c.reads_peers_when_it_pays())? {
            return Err("the ranks disagree on whether to read their peers".into());
        }
        Ok(())
    }
);

// Rank 2 of 3 cannot read other processes: a broadcast from rank 0 (which writes the head into
// ranks 1 and 2, who read the rest) fails on rank 2 alone, and every rank falls back to MPI_Bcast
// with the right result.
mpi_test!(
    mpi_peer_read_refused_broadcast_falls_back_np3,
    np = 3,
    timeout = 120,
    |rt| {
        let c = rt.world();
        if c.rank() == 2 {
            forbid_process_vm_readv()?;
        }
        let mut buf = numpy_like::<i32>(PEER_READ_MIN / 4 + 1);
        let value = |r: usize, i: usize| (r * 7 + i) as i32;
        let (read, huge) = run(c, Coll::Broadcast(0), &mut buf, value, -1)?;
        if read {
            return Err("the broadcast copied directly although rank 2 may not read".into());
        }
        if huge == Pages::Huge && c.reads_peers_when_it_pays() {
            return Err("a failed read did not stop the direct copies".into());
        }
        if !agree(c, c.reads_peers_when_it_pays())? {
            return Err("the ranks disagree on whether to copy directly".into());
        }
        let (read, _) = run(c, Coll::Broadcast(1), &mut buf, value, -1)?;
        if read {
            return Err("the ranks' memory was copied directly after a failed read".into());
        }
        Ok(())
    }
);

/// Installs a seccomp filter on this thread that answers `process_vm_readv` with `EPERM`.
fn forbid_process_vm_readv() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xc000_003e; // AUDIT_ARCH_X86_64
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xc000_00b7; // AUDIT_ARCH_AARCH64
    const NR: u32 = libc::SYS_process_vm_readv as u32;
    let stmt = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u16, k: u32, jt: u8, jf: u8| libc::sock_filter { code, jt, jf, k };
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let filter = [
        stmt(LD_W_ABS, 4), // seccomp_data.arch
        jump(JEQ_K, ARCH, 0, 3),
        stmt(LD_W_ABS, 0), // seccomp_data.nr
        jump(JEQ_K, NR, 0, 1),
        stmt(RET_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(RET_K, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments; PR_SET_SECCOMP reads `prog`, which
    // points at `filter`, both alive for the call (the kernel copies the program).
    let rc = unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            -1
        } else {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            )
        }
    };
    if rc != 0 {
        return Err(format!(
            "installing the seccomp filter failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
