//! All-reduce hands the caller's buffers to Gloo as they are: in place, the buffer itself is
//! Gloo's output with no input; out of place, the two buffers. No copy of the data is made on
//! the Rust side, blocking or nonblocking. Checked with an allocator that counts the bytes
//! Rust allocates in this test process (Gloo's own C++ scratch memory is not counted: it is
//! Gloo's algorithm, not a copy of the input).

use backend_gloo::{run_ranks, GlooConfig};
use grid_core::{Communicator, CommunicatorExt, ReduceOp};
use half::bf16;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::Duration;

/// The system allocator, counting the bytes it hands out.
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the counter has no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Elements per buffer: 16 MiB of f32, 8 MiB of bf16.
const N: usize = 4 << 20;
/// Rust allocations allowed during one measured call on both ranks together: far below one
/// buffer (what a copy would need), above the small bookkeeping of a call.
const SLACK: usize = 256 << 10;

/// Held by each test for its whole run: the allocation counter is process-wide, so the tests
/// of this file must not run side by side (`cargo test` runs them on parallel threads).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Bytes Rust allocated (on every rank thread) while `f` ran on every rank; ranks meet at a
/// barrier before and after so that the window covers exactly the calls.
fn allocated_during(gate: &Barrier, f: impl FnOnce()) -> usize {
    gate.wait();
    let before = ALLOCATED.load(Ordering::SeqCst);
    gate.wait();
    f();
    gate.wait();
    let after = ALLOCATED.load(Ordering::SeqCst);
    gate.wait();
    after - before
}

#[test]
fn all_reduce_makes_no_copy() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = GlooConfig::new("no-copy").with_timeout(Duration::from_secs(120));
    let gate = Barrier::new(2);
    let out = run_ranks(2, &cfg, |_f, world| {
        let rank = world.rank();
        let mut measured = Vec::new();
        // Blocking, in place, f32 sum and avg (the division is in place too).
        let mut buf = vec![rank as f32 + 1.0; N];
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let bytes = allocated_during(&gate, || {
                world.all_reduce_in_place(&mut buf, op).unwrap();
            });
            measured.push((format!("all_reduce_in_place {op} f32"), bytes));
        }
        // 1 + 2 = 3, then the average of 3 and 3.
        assert!(buf.iter().all(|&x| x == 3.0), "rank {rank}: {}", buf[0]);
        // Blocking, in place, bf16 (widened block by block on the stack, never as a whole).
        let mut halves = vec![bf16::from_f32(rank as f32 + 0.5); N];
        let bytes = allocated_during(&gate, || {
            world
                .all_reduce_in_place(&mut halves, ReduceOp::Max)
                .unwrap();
        });
        measured.push(("all_reduce_in_place max bf16".into(), bytes));
        assert!(halves.iter().all(|&x| x == bf16::from_f32(1.5)));
        // Blocking, out of place.
        let send = vec![rank as f32; N];
        let mut recv = vec![0.0f32; N];
        let bytes = allocated_during(&gate, || {
            world
                .all_reduce_into(&send, &mut recv, ReduceOp::Sum)
                .unwrap();
        });
        measured.push(("all_reduce_into sum f32".into(), bytes));
        assert!(recv.iter().all(|&x| x == 1.0));
        // Nonblocking, in place: the owned buffer goes to the worker and comes back itself.
        let owned = vec![rank as i64; N];
        let ptr = owned.as_ptr();
        let mut back = Vec::new();
        let bytes = allocated_during(&gate, || {
            back = world
                .iall_reduce(owned, ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
        });
        measured.push(("iall_reduce sum i64".into(), bytes));
        assert_eq!(back.as_ptr(), ptr, "the buffer came back reallocated");
        assert!(back.iter().all(|&x| x == 1));
        Ok(measured)
    })
    .unwrap();
    check_no_copy(out);
}

/// The in-place all-gather gives Gloo no input (this rank's block is read where it lies) and
/// the in-place reduce-scatter, with the default algorithm, all-reduces the buffer in place:
/// neither copies the data on the Rust side, blocking or nonblocking.
#[test]
fn in_place_all_gather_and_reduce_scatter_make_no_copy() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = GlooConfig::new("no-copy-ip").with_timeout(Duration::from_secs(120));
    let gate = Barrier::new(2);
    let out = run_ranks(2, &cfg, |_f, world| {
        let (rank, k) = (world.rank(), N / 2);
        let mut measured = Vec::new();
        let mut buf = vec![0.0f32; N];
        buf[rank * k..(rank + 1) * k].fill(rank as f32 + 1.0);
        let bytes = allocated_during(&gate, || world.all_gather_in_place(&mut buf).unwrap());
        measured.push(("all_gather_in_place f32".to_string(), bytes));
        assert!(buf[..k].iter().all(|&x| x == 1.0) && buf[k..].iter().all(|&x| x == 2.0));
        let mut buf = vec![rank as f32 + 1.0; N];
        let bytes = allocated_during(&gate, || {
            world
                .reduce_scatter_in_place(&mut buf, ReduceOp::Avg)
                .unwrap()
        });
        measured.push(("reduce_scatter_in_place avg f32".to_string(), bytes));
        assert!(buf[rank * k..(rank + 1) * k].iter().all(|&x| x == 1.5));
        let owned = vec![rank as i64; N];
        let ptr = owned.as_ptr();
        let mut back = Vec::new();
        let bytes = allocated_during(&gate, || {
            back = world
                .ireduce_scatter_in_place(owned, ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
        });
        measured.push(("ireduce_scatter_in_place sum i64".to_string(), bytes));
        assert_eq!(back.as_ptr(), ptr, "the buffer came back reallocated");
        assert!(back[rank * k..(rank + 1) * k].iter().all(|&x| x == 1));
        let mut owned = vec![0i64; N];
        owned[rank * k..(rank + 1) * k].fill(rank as i64 + 5);
        let ptr = owned.as_ptr();
        let bytes = allocated_during(&gate, || {
            back = world.iall_gather_in_place(owned).unwrap().wait().unwrap();
        });
        measured.push(("iall_gather_in_place i64".to_string(), bytes));
        assert_eq!(back.as_ptr(), ptr, "the buffer came back reallocated");
        assert!(back[..k].iter().all(|&x| x == 5) && back[k..].iter().all(|&x| x == 6));
        Ok(measured)
    })
    .unwrap();
    check_no_copy(out);
}

fn check_no_copy(out: Vec<grid_core::Result<Vec<(String, usize)>>>) {
    for (r, res) in out.into_iter().enumerate() {
        for (what, bytes) in res.unwrap_or_else(|e| panic!("rank {r}: {e}")) {
            assert!(
                bytes < SLACK,
                "{what}: Rust allocated {bytes} bytes during the call (one copy of the smallest buffer here is {} bytes)",
                N * 2
            );
        }
    }
}
