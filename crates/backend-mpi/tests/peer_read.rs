//! The all-gather (in place or not) and the broadcast that copy straight between the ranks'
//! memory (module `peer_read`; `PEER_READ_MIN`, `MpiBackend::peer_reads`):
//!
//! * on buffers advised to huge pages as numpy advises its arrays, of every element size, at 3
//!   ranks: the right result, and the peers read exactly when the part of every rank's memory
//!   that the others copy through lies on huge pages (as `/proc/self/smaps` bounds it; the
//!   kernel may find none);
//! * on plain buffers, on a mix of both, and below `PEER_READ_MIN`: the right result through
//!   `MPI_Allgather`, no peer read;
//! * broadcasts (the root writes the head of every other rank's buffer, which reads the rest),
//!   of an odd length, from ranks other than 0, and the all-gather out of place (each rank's
//!   send buffer read by the others);
//! * the all-reduce and reduce-scatter (in place or not; sum, maximum and average) at 3 ranks,
//!   with the copies' first exchange in the mismatch check's round and (`GRID_MPI_DIRECT_MAX=0`)
//!   in an exchange of its own:
//!   exact results, the peers read on plain buffers whose others' part is at most
//!   `PEER_READ_PLAIN_MAX`, on large buffers exactly when they lie on huge pages, never below
//!   `PEER_READ_MIN` or on lengths that the ranks do not divide; f16 (reduced as f32) exact;
//! * with `process_vm_readv` forbidden on one rank (a seccomp filter, as container runtimes'
//!   default profiles install): the right result on every rank, and the communicator stops
//!   trying on every rank alike (for the in-place all-reduce too, where a rank's block changes
//!   as soon as it reads).
#![cfg(target_os = "linux")]

use backend_mpi::testing::{launch_with_env, under_launcher};
use backend_mpi::{
    mpi_test, MpiCommunicator, PEER_READ_CROWDED_IN_PLACE_MIN, PEER_READ_MIN, PEER_READ_PLAIN_MAX,
};
use grid_core::{Communicator, CommunicatorExt, Element, GroupFactory, ReduceOp};

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

/// How much of the memory the other ranks copy through lies on huge pages, bounded from what
/// `/proc/self/smaps` reports: a mapping's huge pages (`AnonHugePages`) lie in its 2 MiB-aligned
/// interior, so a range holds at most the part of that interior it covers (and no more than
/// the mapping's huge bytes), and at least that part less the interior's pages that are not
/// huge. The backend counts every page and needs three quarters huge, so the tests expect a
/// verdict only where the bounds are clear: 80% or more surely huge, or under 70% at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Pages {
    Plain = 0,
    Between = 1,
    Huge = 2,
}

const HUGE_PAGE: usize = 2 << 20;

/// Buffers of about this many bytes (a multiple of 24 · ranks): at least `PEER_READ_MIN`, and
/// large enough that each rank's block spans several huge pages even when the buffer is not
/// 2 MiB-aligned (its head and tail then lie on ordinary pages).
fn test_bytes(n: usize) -> usize {
    (PEER_READ_MIN.max(32 << 20) / (24 * n) + 8) * 24 * n
}

fn pages<T>(v: &[T]) -> Pages {
    let (start, end) = (
        v.as_ptr() as usize,
        v.as_ptr() as usize + std::mem::size_of_val(v),
    );
    if end <= start {
        return Pages::Plain;
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let (mut lower, mut upper) = (0usize, 0usize);
    let mut mapping: Option<(usize, usize)> = None;
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
            mapping = (a < end && start < b).then_some((a, b));
        } else if let (Some((a, b)), true) = (mapping, line.starts_with("AnonHugePages:")) {
            let kb: usize = line
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            let huge = kb * 1024;
            let (ia, ib) = (a.div_ceil(HUGE_PAGE) * HUGE_PAGE, b / HUGE_PAGE * HUGE_PAGE);
            let interior = ib.saturating_sub(ia);
            let covered = end.min(ib).saturating_sub(start.max(ia));
            upper += covered.min(huge);
            lower += covered.saturating_sub(interior.saturating_sub(huge));
        }
    }
    let len = end - start;
    if lower * 10 >= len * 8 {
        Pages::Huge
    } else if upper * 10 < len * 7 {
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

/// Whether the one collective since `before` (the communicator's `peer_reads` then) read the
/// peers, with `huge`; an error if it counted more than one.
fn read_once(c: &MpiCommunicator, before: u64, huge: Pages) -> Result<(bool, Pages), String> {
    let read = c.peer_reads() - before;
    if read > 1 {
        return Err(format!("one collective counted {read} peer reads"));
    }
    Ok((read == 1, huge))
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
    // What the other ranks copy from or into (module `peer_read`, `exposed`).
    let mine = match coll {
        Coll::Gather => pages(&buf[me * k..(me + 1) * k]),
        Coll::GatherInto => pages(&send),
        Coll::Broadcast(root) if root == me => pages(&buf[k..]),
        Coll::Broadcast(_) => pages(&buf[..k]),
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
    read_once(c, before, huge)
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
        // Over PEER_READ_MIN (so that the f32 broadcast of all but one element still reaches
        // it), a multiple of 3 ranks · 8 bytes.
        let bytes = test_bytes(n);
        let mut huge_seen = false;
        let mut expect = |what: &str, (read, huge): (bool, Pages), want: bool| {
            huge_seen |= huge == Pages::Huge;
            let right = match huge {
                Pages::Huge => read == want,
                Pages::Plain => !read,
                // Bounds too loose to say what the backend's count decides.
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
        // Plain, small: the part the others copy through is at most PEER_READ_PLAIN_MAX, so
        // the peers are read whatever the pages.
        let mut small_plain = vec![0f32; PEER_READ_PLAIN_MAX / 4 / n * n];
        for coll in [Coll::Gather, Coll::GatherInto, Coll::Broadcast(1)] {
            let (read, _) = run(
                c,
                coll,
                &mut small_plain,
                |r, i| (r * 1_000_000 + i) as f32,
                -1.0,
            )?;
            if !read {
                return Err(format!(
                    "{coll:?} of a small plain buffer did not read the peers"
                ));
            }
        }
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

/// A reduction that can copy straight between the ranks' memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Red {
    AllReduceInPlace,
    AllReduceInto,
    ReduceScatterInPlace,
    ReduceScatterInto,
}

/// One reduction `red` with `op` of an input of `len` elements (allocated by `alloc`, rank r's
/// element i `value(r, i)`), checked element by element against `expect` (of every rank's
/// element i); returns whether the peers were read and the least share of huge pages of the
/// input any rank lends.
fn reduce_run<T: Element + Default + std::fmt::Debug>(
    c: &MpiCommunicator,
    (red, op): (Red, ReduceOp),
    (len, alloc): (usize, &dyn Fn(usize) -> Vec<T>),
    value: impl Fn(usize, usize) -> T,
    expect: impl Fn(usize) -> T,
) -> Result<(bool, Pages), String> {
    let (me, n) = (c.rank(), c.size());
    let k = len / n;
    let mut input = alloc(len);
    for (i, x) in input.iter_mut().enumerate() {
        *x = value(me, i);
    }
    let huge = least(c, pages(&input))?;
    let before = c.peer_reads();
    let (out, at) = match red {
        Red::AllReduceInPlace => {
            c.all_reduce_in_place(&mut input[..], op)
                .map_err(|e| e.to_string())?;
            (input, 0)
        }
        Red::AllReduceInto => {
            let mut recv = alloc(len);
            c.all_reduce_into(&input[..], &mut recv[..], op)
                .map_err(|e| e.to_string())?;
            (recv, 0)
        }
        Red::ReduceScatterInPlace => {
            c.reduce_scatter_in_place(&mut input[..], op)
                .map_err(|e| e.to_string())?;
            (input, me * k)
        }
        Red::ReduceScatterInto => {
            let mut recv = alloc(k);
            c.reduce_scatter_into(&input[..], &mut recv[..], op)
                .map_err(|e| e.to_string())?;
            (recv, me * k)
        }
    };
    // The part of `out` that holds the result, and where it lies in the input.
    let (part, from) = match red {
        Red::AllReduceInPlace | Red::AllReduceInto => (&out[..], 0),
        Red::ReduceScatterInPlace => (&out[at..at + k], at),
        Red::ReduceScatterInto => (&out[..], at),
    };
    for (j, x) in part.iter().enumerate() {
        let want = expect(from + j);
        if *x != want {
            return Err(format!(
                "{red:?} {op:?} of {len}: element {} is {x:?}, expected {want:?}",
                from + j
            ));
        }
    }
    read_once(c, before, huge)
}

// Every reduction on plain buffers whose others' part is at most PEER_READ_PLAIN_MAX (read), on
// large numpy-like and plain buffers (read where the pages are huge), below PEER_READ_MIN and on a
// length 3 does not divide (never read), and in f16: every result exact. The sums are of small
// integers (exact in f32 in any order), the averages of multiples of 3.
mpi_test!(
    mpi_peer_read_reduces_exactly_np3,
    np = 3,
    timeout = 180,
    |rt| {
        let c = rt.world();
        let n = c.size();
        let reds = [
            Red::AllReduceInPlace,
            Red::AllReduceInto,
            Red::ReduceScatterInPlace,
            Red::ReduceScatterInto,
        ];
        let value = |r: usize, i: usize| ((i * 7 + r * 13) % 10_007) as f32;
        let sum = move |i: usize| (0..3).map(|r| value(r, i)).sum::<f32>();
        let plain = |len: usize| vec![0f32; len];
        let numpy = |len: usize| numpy_like::<f32>(len);
        // Plain, the others' part at most PEER_READ_PLAIN_MAX: always read.
        let small = PEER_READ_PLAIN_MAX / 4 / n * n;
        for red in reds {
            let (read, _) = reduce_run(c, (red, ReduceOp::Sum), (small, &plain), value, sum)?;
            if !read {
                return Err(format!(
                    "{red:?} of {small} f32 (plain) did not read the peers"
                ));
            }
            // Maximum of i64 and average of f32, in the same shape.
            let (read, _) = reduce_run(
                c,
                (red, ReduceOp::Max),
                (small / 2 / n * n, &|len| vec![0i64; len]),
                |r, i| ((i as i64) << 2) - r as i64,
                |i| (i as i64) << 2,
            )?;
            if !read {
                return Err(format!("{red:?} max of i64 (plain) did not read the peers"));
            }
            let (read, _) = reduce_run(
                c,
                (red, ReduceOp::Avg),
                (small, &plain),
                |r, i| 3.0 * value(r, i),
                sum,
            )?;
            if !read {
                return Err(format!(
                    "{red:?} average of f32 (plain) did not read the peers"
                ));
            }
        }
        // Large: read exactly where the inputs lie on huge pages (plain memory: only where the
        // kernel's THP mode is `always`).
        let large = test_bytes(n) / 4;
        for red in reds {
            for (what, alloc) in [
                ("numpy-like", &numpy as &dyn Fn(usize) -> Vec<f32>),
                ("plain", &plain),
            ] {
                let (read, huge) = reduce_run(c, (red, ReduceOp::Sum), (large, alloc), value, sum)?;
                let right = match huge {
                    Pages::Huge => read,
                    Pages::Plain => !read,
                    Pages::Between => true,
                };
                if !right {
                    return Err(format!(
                        "{red:?} of {large} f32 ({what}): the peers were {}read, the least \
                         share of huge pages: {huge:?}",
                        if read { "" } else { "not " }
                    ));
                }
            }
        }
        // Never read: below PEER_READ_MIN, a length 3 does not divide.
        let below = PEER_READ_MIN / 4 / 2 / n * n;
        for red in reds {
            for len in [below, small + 1] {
                if matches!(red, Red::ReduceScatterInPlace | Red::ReduceScatterInto) && len % n != 0
                {
                    continue; // a reduce-scatter needs blocks of one size
                }
                let (read, _) = reduce_run(c, (red, ReduceOp::Sum), (len, &plain), value, sum)?;
                if read {
                    return Err(format!("{red:?} of {len} f32 read the peers"));
                }
            }
            // f16 travels as f32 (the all-reduce's staging buffer may be read): exact either way.
            reduce_run(
                c,
                (red, ReduceOp::Sum),
                (small, &|len| vec![half::f16::ZERO; len]),
                |r, i| half::f16::from_f32(((i + r) % 64) as f32),
                |i| half::f16::from_f32((0..3).map(|r| ((i + r) % 64) as f32).sum()),
            )?;
        }
        Ok(())
    }
);

// A crowded communicator (3 ranks on a node of fewer processors, as on the 2-core CI machines)
// keeps its in-place all-reduces below PEER_READ_CROWDED_IN_PLACE_MIN on MPI's path, on every
// rank alike; at that size, and for the other collectives from PEER_READ_MIN, it reads its
// peers. On a node with more processors every one of them reads. Every result exact.
mpi_test!(
    mpi_peer_read_crowded_in_place_minimum_np3,
    np = 3,
    timeout = 120,
    |rt| {
        let c = rt.world();
        let n = c.size();
        let crowded = c.crowded();
        if !agree(c, crowded)? {
            return Err("the ranks disagree on whether the node is crowded".into());
        }
        // Lengths in f32 that 3 ranks divide, of at least `bytes`.
        let len = |bytes: usize| bytes.div_ceil(4 * n) * n;
        let mid = len(PEER_READ_MIN * 4);
        let plain = |len: usize| vec![0f32; len];
        let value = |r: usize, i: usize| ((i * 5 + r * 11) % 4099) as f32;
        let sum = move |i: usize| (0..3).map(|r| value(r, i)).sum::<f32>();
        let expect = |what: &str, read: bool, want: bool| {
            if read == want {
                return Ok(());
            }
            Err(format!(
                "{what} (crowded: {crowded}): the peers were {}read",
                if read { "" } else { "not " }
            ))
        };
        let (read, _) = run(c, Coll::Broadcast(2), &mut plain(mid), value, -1.0)?;
        expect("broadcast", read, true)?;
        let (read, _) = run(c, Coll::Gather, &mut plain(mid), value, -1.0)?;
        expect("in-place all-gather", read, true)?;
        for (red, l, want) in [
            (Red::AllReduceInPlace, mid, !crowded),
            (
                Red::AllReduceInPlace,
                len(PEER_READ_CROWDED_IN_PLACE_MIN),
                true,
            ),
            (Red::AllReduceInto, mid, true),
            (Red::ReduceScatterInPlace, mid, true),
        ] {
            let (read, _) = reduce_run(c, (red, ReduceOp::Sum), (l, &plain), value, sum)?;
            expect(&format!("{red:?} of {l} f32"), read, want)?;
        }
        Ok(())
    }
);

// The reductions again with the mismatch check as an all-reduce instead of a round of messages
// (GRID_MPI_DIRECT_MAX=0, as on communicators of more than DIRECT_MAX ranks): the direct copies
// then gather their rows in an exchange of their own instead of in the check's round.
#[test]
fn mpi_peer_read_reduces_exactly_without_rounds() {
    rerun_with_env(
        "mpi_peer_read_reduces_exactly_np3",
        &[("GRID_MPI_DIRECT_MAX", "0")],
    );
}

/// Runs the 3-rank test `test` of this file again under `mpirun` with the environment `env`
/// added, and asserts that it passed (nothing to do inside a launched rank).
fn rerun_with_env(test: &str, env: &[(&str, &str)]) {
    if under_launcher() {
        return;
    }
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let args = ["--exact", test, "--nocapture", "--test-threads=1"];
    let out = launch_with_env(3, 180, &exe, &args, env).unwrap();
    assert_eq!(out.code, Some(0), "{env:?}: {}", out.output);
    assert!(out.output.contains("1 passed"), "{env:?}: {}", out.output);
}

// Rank 1 cannot read other processes: the first in-place all-reduce finds out before any rank
// changes its block (the probe), runs MPI's call with the right result on every rank, and the
// communicator stops trying; out of place the same, later calls exact.
mpi_test!(
    mpi_peer_read_refused_reduction_falls_back_np2,
    np = 2,
    timeout = 120,
    |rt| {
        let c = rt.world();
        if c.rank() == 1 {
            forbid_process_vm_readv()?;
        }
        let len = (1 << 20) / 4;
        let value = |r: usize, i: usize| ((i * 3 + r) % 1000) as f32;
        let sum = move |i: usize| value(0, i) + value(1, i);
        let plain = |len: usize| vec![0f32; len];
        for red in [
            Red::AllReduceInPlace,
            Red::AllReduceInto,
            Red::ReduceScatterInPlace,
        ] {
            let (read, _) = reduce_run(c, (red, ReduceOp::Sum), (len, &plain), value, sum)?;
            if read {
                return Err(format!(
                    "{red:?}: the peers were read although rank 1 may not read"
                ));
            }
            if c.reads_peers_when_it_pays() {
                return Err(
                    "a failed read did not stop the peer reads of this communicator".into(),
                );
            }
        }
        if !agree(c, c.reads_peers_when_it_pays())? {
            return Err("the ranks disagree on whether to read their peers".into());
        }
        Ok(())
    }
);

// Buffers at every offset within a cache line, each rank's at another, so that every distance of
// destination from source up to 60 bytes occurs (the ranks' buffers start at the same offset in
// a page, both fresh `mmap` blocks) (the kernel's copies at some offsets go through a staging
// block, module raw::peer_read): all-gathers (u8, odd offsets too), broadcasts and every
// reduction of plain buffers of about 1 MiB, read from the peers and exact each time.
mpi_test!(
    mpi_peer_read_at_every_offset_np3,
    np = 3,
    timeout = 180,
    |rt| {
        let c = rt.world();
        let (me, n) = (c.rank(), c.size());
        let e = |e: grid_core::Error| e.to_string();
        // Blocks of more than two staging pieces (128 KiB) and a tail.
        let k = (300 << 10) / 4 + 7;
        let mut input = vec![0f32; n * k + 64];
        let mut out = vec![0f32; n * k + 64];
        let value = |r: usize, i: usize| ((i * 5 + r * 11) % 4096) as f32;
        let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f32>();
        let mut calls = 0u64;
        let before = c.peer_reads();
        for shift in 0..16usize {
            // In f32 elements: 0 to 60 bytes, and another offset on every rank.
            let (s, d) = ((shift + 5 * me) % 16, (shift * 3 + 7 * me) % 16);
            let check = |what: &str, got: &[f32], want: &dyn Fn(usize) -> f32| match (0..got.len())
                .find(|&i| got[i] != want(i))
            {
                Some(i) => Err(format!(
                    "{what}, offsets {s}/{d}: element {i} is {}, expected {}",
                    got[i],
                    want(i)
                )),
                None => Ok(()),
            };
            // All-gather out of place and in place.
            let send = &mut input[s..s + k];
            send.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(me, i));
            let recv = &mut out[d..d + n * k];
            c.all_gather_into(&input[s..s + k], recv).map_err(e)?;
            check("all_gather_into", &out[d..d + n * k], &|i| {
                value(i / k, i % k)
            })?;
            let buf = &mut out[d..d + n * k];
            buf.fill(-1.0);
            buf[me * k..(me + 1) * k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(me, i));
            c.all_gather_in_place(buf).map_err(e)?;
            check("all_gather_in_place", &out[d..d + n * k], &|i| {
                value(i / k, i % k)
            })?;
            // Broadcast from the rank whose turn it is.
            let root = shift % n;
            let buf = &mut out[d..d + n * k];
            if me == root {
                buf.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = value(root, i));
            } else {
                buf.fill(-1.0);
            }
            c.broadcast_into(buf, root).map_err(e)?;
            check("broadcast", &out[d..d + n * k], &|i| value(root, i))?;
            // Reductions: out of place, then in place.
            let fill = |v: &mut [f32]| {
                v.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = value(me, i))
            };
            fill(&mut input[s..s + n * k]);
            c.all_reduce_into(&input[s..s + n * k], &mut out[d..d + n * k], ReduceOp::Sum)
                .map_err(e)?;
            check("all_reduce_into", &out[d..d + n * k], &sum)?;
            c.reduce_scatter_into(&input[s..s + n * k], &mut out[d..d + k], ReduceOp::Sum)
                .map_err(e)?;
            check("reduce_scatter_into", &out[d..d + k], &|i| sum(me * k + i))?;
            c.all_reduce_in_place(&mut input[s..s + n * k], ReduceOp::Sum)
                .map_err(e)?;
            check("all_reduce_in_place", &input[s..s + n * k], &sum)?;
            fill(&mut input[s..s + n * k]);
            c.reduce_scatter_in_place(&mut input[s..s + n * k], ReduceOp::Sum)
                .map_err(e)?;
            check(
                "reduce_scatter_in_place",
                &input[s + me * k..s + (me + 1) * k],
                &|i| sum(me * k + i),
            )?;
            calls += 7;
        }
        // Bytes at odd offsets: the all-gather and the broadcast of u8.
        let kb = (200 << 10) + 3;
        let mut bytes = vec![0u8; n * kb + 64];
        let mut mine = vec![0u8; kb + 64];
        let byte = |r: usize, i: usize| (i * 7 + r * 31 + i / 509) as u8;
        for shift in [1usize, 3, 17, 31, 33, 47, 63] {
            let (s, d) = ((shift + 13 * me) % 64, (shift * 5 + 29 * me) % 64);
            mine[s..s + kb]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = byte(me, i));
            c.all_gather_into(&mine[s..s + kb], &mut bytes[d..d + n * kb])
                .map_err(e)?;
            if let Some(i) = (0..n * kb).find(|&i| bytes[d + i] != byte(i / kb, i % kb)) {
                return Err(format!(
                    "u8 all_gather_into, offsets {s}/{d}: element {i} wrong"
                ));
            }
            let root = shift % n;
            let buf = &mut bytes[d..d + n * kb];
            if me == root {
                buf.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = byte(root, i));
            } else {
                buf.fill(0);
            }
            c.broadcast_into(buf, root).map_err(e)?;
            if let Some(i) = (0..n * kb).find(|&i| bytes[d + i] != byte(root, i)) {
                return Err(format!("u8 broadcast, offsets {s}/{d}: element {i} wrong"));
            }
            calls += 2;
        }
        let read = c.peer_reads() - before;
        if read != calls {
            return Err(format!(
                "{read} of {calls} collectives copied straight between the ranks' memory"
            ));
        }
        Ok(())
    }
);

// The same with every copy at a distance of 1 to 63 bytes staged, and with none, whatever this machine
// measured.
#[test]
fn mpi_peer_read_at_every_offset_staged_or_not() {
    for mode in ["always", "never"] {
        rerun_with_env(
            "mpi_peer_read_at_every_offset_np3",
            &[(backend_mpi::STAGE_COPIES_ENV, mode)],
        );
    }
}

// A communicator created with an unknown GRID_MPI_STAGE_COPIES fails with an error that names
// the variable, the value and the valid ones, on every rank.
mpi_test!(
    mpi_stage_copies_refuses_unknown_values_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let c = rt.world();
        std::env::set_var(backend_mpi::STAGE_COPIES_ENV, "sometimes");
        let split = backend_mpi::MpiFactory::new().split(c, Some(0), c.rank());
        std::env::remove_var(backend_mpi::STAGE_COPIES_ENV);
        match split {
            Ok(_) => Err("a communicator was created with GRID_MPI_STAGE_COPIES=sometimes".into()),
            Err(e) => {
                let e = e.to_string();
                if e.contains("GRID_MPI_STAGE_COPIES=\"sometimes\"")
                    && e.contains("auto, always or never")
                {
                    Ok(())
                } else {
                    Err(format!("unexpected error: {e}"))
                }
            }
        }
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
        let len = test_bytes(2) / 4;
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
        let mut buf = numpy_like::<i32>(test_bytes(3) / 4 + 1);
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
