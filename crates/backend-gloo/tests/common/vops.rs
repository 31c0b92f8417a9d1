//! Exact-value checks of the operations of issue #16 item 7 (all-to-all-v, all-gather-v,
//! reduce-scatter-v, reduce, gather, scatter), blocking and nonblocking, over every dtype, and
//! of the new dtypes (i8, u32, u64, bool, fp8) through every operation that moves or reduces
//! them. Every rank of a communicator calls [`suite`] with the same arguments.

use super::{expected, value, Val};
use grid_core::{Bool, Communicator, CommunicatorExt, DType, Element, ReduceOp, F8E4M3, F8E5M2};
use half::{bf16, f16};

impl Val for i8 {
    fn of(x: f64) -> Self {
        (x as i64) as i8
    }
}
impl Val for u32 {
    fn of(x: f64) -> Self {
        (x as i64) as u32
    }
}
impl Val for u64 {
    fn of(x: f64) -> Self {
        (x as i64) as u64
    }
}

/// Element types made from a small number and compared by their bits (fp8 and bool included:
/// they are moved as bytes, so every bit pattern must arrive unchanged).
pub trait Mv: Element + Copy {
    fn mk(x: usize) -> Self;
    fn key(self) -> u64;
}
macro_rules! mv_int {
    ($($t:ty),*) => {$(
        impl Mv for $t {
            fn mk(x: usize) -> Self { (x % 100) as $t }
            fn key(self) -> u64 { self as u64 }
        }
    )*};
}
mv_int!(i8, u8, i32, i64, u32, u64);
impl Mv for f32 {
    fn mk(x: usize) -> Self {
        x as f32 + 0.5
    }
    fn key(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Mv for f64 {
    fn mk(x: usize) -> Self {
        x as f64 + 0.25
    }
    fn key(self) -> u64 {
        self.to_bits()
    }
}
impl Mv for f16 {
    fn mk(x: usize) -> Self {
        f16::from_f64((x % 1000) as f64)
    }
    fn key(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Mv for bf16 {
    fn mk(x: usize) -> Self {
        bf16::from_f64((x % 200) as f64)
    }
    fn key(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Mv for Bool {
    fn mk(x: usize) -> Self {
        Bool::from(x.is_multiple_of(3))
    }
    fn key(self) -> u64 {
        u64::from(self.get())
    }
}
impl Mv for F8E4M3 {
    // Every byte, NaN patterns included, must arrive as it was sent.
    fn mk(x: usize) -> Self {
        F8E4M3::from_bits((x % 256) as u8)
    }
    fn key(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Mv for F8E5M2 {
    fn mk(x: usize) -> Self {
        F8E5M2::from_bits((x * 7 % 256) as u8)
    }
    fn key(self) -> u64 {
        u64::from(self.to_bits())
    }
}

/// The value of element `i` of what rank `from` sends to rank `to` (distinct per triple as far
/// as the type allows).
fn v<T: Mv>(from: usize, to: usize, i: usize) -> T {
    T::mk(from * 37 + to * 11 + i * 3 + 1)
}

fn keys<T: Mv>(s: &[T]) -> Vec<u64> {
    s.iter().map(|x| x.key()).collect()
}

/// Uneven counts: rank `from` sends `cnt(from, to, scale)` elements to `to` (some zero).
fn cnt(from: usize, to: usize, scale: usize) -> usize {
    ((from * 2 + to * 3) % 4) * scale
}

/// All-to-all-v, all-gather-v, gather and scatter (every root) of `T`, blocking and
/// nonblocking, with exact values.
pub fn movement<T: Mv>(c: &dyn Communicator, scale: usize) {
    let (me, n) = (c.rank(), c.size());
    let dt = T::DTYPE;
    assert!(c.supports(dt, None), "{dt} is moved");
    // all_to_all_v
    let send_counts: Vec<usize> = (0..n).map(|j| cnt(me, j, scale)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| cnt(j, me, scale)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..send_counts[j]).map(move |i| v::<T>(me, j, i)))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|j| (0..recv_counts[j]).map(move |i| v::<T>(j, me, i)))
        .collect();
    let mut recv = vec![T::mk(0); want.len()];
    c.all_to_all_v_into(&send, &send_counts, &mut recv, &recv_counts)
        .unwrap_or_else(|e| panic!("all_to_all_v {dt}: {e}"));
    assert_eq!(keys(&recv), keys(&want), "all_to_all_v {dt} rank {me}");
    let got = c
        .iall_to_all_v(send.clone(), send_counts.clone(), recv_counts.clone())
        .and_then(|w| w.wait())
        .unwrap_or_else(|e| panic!("iall_to_all_v {dt}: {e}"));
    assert_eq!(keys(&got), keys(&want), "iall_to_all_v {dt} rank {me}");

    // all_gather_v: rank j contributes cnt(j, j + 1) + 1 elements (never all empty).
    let counts: Vec<usize> = (0..n).map(|j| cnt(j, j + 1, scale) + 1).collect();
    let mine: Vec<T> = (0..counts[me]).map(|i| v::<T>(me, 0, i)).collect();
    let want: Vec<T> = (0..n)
        .flat_map(|j| (0..counts[j]).map(move |i| v::<T>(j, 0, i)))
        .collect();
    let mut recv = vec![T::mk(0); want.len()];
    c.all_gather_v_into(&mine, &mut recv, &counts)
        .unwrap_or_else(|e| panic!("all_gather_v {dt}: {e}"));
    assert_eq!(keys(&recv), keys(&want), "all_gather_v {dt} rank {me}");
    let got = c
        .iall_gather_v(mine.clone(), counts.clone())
        .and_then(|w| w.wait())
        .unwrap_or_else(|e| panic!("iall_gather_v {dt}: {e}"));
    assert_eq!(keys(&got), keys(&want), "iall_gather_v {dt} rank {me}");

    // gather and scatter, every root.
    let len = scale + 1;
    for root in 0..n {
        let mine: Vec<T> = (0..len).map(|i| v::<T>(me, root, i)).collect();
        let all: Vec<T> = (0..n)
            .flat_map(|j| (0..len).map(move |i| v::<T>(j, root, i)))
            .collect();
        let mut recv = vec![T::mk(0); n * len];
        let out = (me == root).then_some(&mut recv[..]);
        c.gather_into(&mine, out, root)
            .unwrap_or_else(|e| panic!("gather {dt} root {root}: {e}"));
        if me == root {
            assert_eq!(keys(&recv), keys(&all), "gather {dt} root {root}");
        }
        let got = c
            .igather(mine.clone(), root)
            .and_then(|w| w.wait())
            .unwrap_or_else(|e| panic!("igather {dt} root {root}: {e}"));
        let expect = if me == root { &all } else { &mine };
        assert_eq!(
            keys(&got),
            keys(expect),
            "igather {dt} root {root} rank {me}"
        );

        // scatter: the root's block j goes to rank j.
        let blocks: Vec<T> = (0..n)
            .flat_map(|j| (0..len).map(move |i| v::<T>(root, j, i)))
            .collect();
        let want: Vec<T> = (0..len).map(|i| v::<T>(root, me, i)).collect();
        let mut recv = vec![T::mk(0); len];
        let src = (me == root).then_some(&blocks[..]);
        c.scatter_into(src, &mut recv, root)
            .unwrap_or_else(|e| panic!("scatter {dt} root {root}: {e}"));
        assert_eq!(
            keys(&recv),
            keys(&want),
            "scatter {dt} root {root} rank {me}"
        );
        let got = c
            .iscatter((me == root).then(|| blocks.clone()), len, root)
            .and_then(|w| w.wait())
            .unwrap_or_else(|e| panic!("iscatter {dt} root {root}: {e}"));
        assert_eq!(
            keys(&got),
            keys(&want),
            "iscatter {dt} root {root} rank {me}"
        );
    }
}

/// Reduce-scatter-v and reduce (every root) of `T` with every reduction, blocking and
/// nonblocking, against the exact results of the shared suite's values.
pub fn reductions<T: Val + Mv>(c: &dyn Communicator, scale: usize) {
    let (me, n) = (c.rank(), c.size());
    let dt = <T as Element>::DTYPE;
    for op in ReduceOp::ALL {
        assert!(c.supports(dt, Some(op)), "{op} on {dt}");
        // reduce_scatter_v: block j has counts[j] elements; element i of block j is element
        // off[j] + i of the whole, whose value on each rank is value(op, rank, off[j] + i).
        let counts: Vec<usize> = (0..n).map(|j| cnt(j, j, scale) + j % 2).collect();
        let off: Vec<usize> = counts
            .iter()
            .scan(0, |a, &c| {
                *a += c;
                Some(*a - c)
            })
            .collect();
        let total: usize = counts.iter().sum();
        let send: Vec<T> = (0..total).map(|i| T::of(value(op, me, i, n))).collect();
        let want: Vec<T> = (0..counts[me])
            .map(|i| T::of(expected(op, off[me] + i, n)))
            .collect();
        let mut recv = vec![T::of(0.0); counts[me]];
        c.reduce_scatter_v_into(&send, &counts, &mut recv, op)
            .unwrap_or_else(|e| panic!("reduce_scatter_v {dt} {op}: {e}"));
        assert_eq!(
            keys(&recv),
            keys(&want),
            "reduce_scatter_v {dt} {op} rank {me}"
        );
        let got = c
            .ireduce_scatter_v(send.clone(), counts.clone(), op)
            .and_then(|w| w.wait())
            .unwrap_or_else(|e| panic!("ireduce_scatter_v {dt} {op}: {e}"));
        assert_eq!(
            keys(&got),
            keys(&want),
            "ireduce_scatter_v {dt} {op} rank {me}"
        );

        // reduce, every root.
        let len = scale + 2;
        let send: Vec<T> = (0..len).map(|i| T::of(value(op, me, i, n))).collect();
        let want: Vec<T> = (0..len).map(|i| T::of(expected(op, i, n))).collect();
        for root in 0..n {
            let mut recv = vec![T::of(0.0); len];
            let out = (me == root).then_some(&mut recv[..]);
            c.reduce_into(&send, out, op, root)
                .unwrap_or_else(|e| panic!("reduce {dt} {op} root {root}: {e}"));
            if me == root {
                assert_eq!(keys(&recv), keys(&want), "reduce {dt} {op} root {root}");
            }
            let got = c
                .ireduce(send.clone(), op, root)
                .and_then(|w| w.wait())
                .unwrap_or_else(|e| panic!("ireduce {dt} {op} root {root}: {e}"));
            let expect = if me == root { &want } else { &send };
            assert_eq!(
                keys(&got),
                keys(expect),
                "ireduce {dt} {op} root {root} rank {me}"
            );
        }
    }
}

/// Bool: Sum and Max are OR, Prod and Min are AND, through every reducing operation; any
/// non-zero byte is true (foreign bytes such as 2 or 255 reduce as true); Avg is refused.
pub fn bools(c: &dyn Communicator) {
    let (me, n) = (c.rank(), c.size());
    assert!(!c.supports(DType::Bool, Some(ReduceOp::Avg)));
    // Element i on rank r: true when (r + i) % 3 == 0; element 0 true everywhere, element 1
    // true only on rank 1 (or false when n == 1), element 2 false everywhere.
    let len = 7;
    let val = |r: usize, i: usize| match i {
        0 => true,
        1 => r == 1,
        2 => false,
        _ => (r + i).is_multiple_of(3),
    };
    let send: Vec<Bool> = (0..len).map(|i| Bool::from(val(me, i))).collect();
    let any: Vec<bool> = (0..len).map(|i| (0..n).any(|r| val(r, i))).collect();
    let all: Vec<bool> = (0..len).map(|i| (0..n).all(|r| val(r, i))).collect();
    let get = |s: &[Bool]| s.iter().map(|b| b.get()).collect::<Vec<bool>>();
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod, ReduceOp::Min] {
        assert!(c.supports(DType::Bool, Some(op)));
        let want = if matches!(op, ReduceOp::Sum | ReduceOp::Max) {
            &any
        } else {
            &all
        };
        let mut out = vec![Bool::FALSE; len];
        c.all_reduce_into(&send, &mut out, op).unwrap();
        assert_eq!(&get(&out), want, "all_reduce bool {op}");
        for root in 0..n {
            let mut out = vec![Bool::FALSE; len];
            c.reduce_into(&send, (me == root).then_some(&mut out[..]), op, root)
                .unwrap();
            if me == root {
                assert_eq!(&get(&out), want, "reduce bool {op} root {root}");
            }
        }
        // reduce_scatter_v: every rank gets the whole vector's reduction in its block when the
        // counts put all of it there; here block j is the whole vector for j == 0.
        let mut counts = vec![0usize; n];
        counts[0] = len;
        let mut out = vec![Bool::FALSE; counts[me]];
        c.reduce_scatter_v_into(&send, &counts, &mut out, op)
            .unwrap();
        if me == 0 {
            assert_eq!(&get(&out), want, "reduce_scatter_v bool {op}");
        }
    }
    // Avg is refused by the front end before anything moves.
    let mut out = vec![Bool::FALSE; len];
    assert!(c.all_reduce_into(&send, &mut out, ReduceOp::Avg).is_err());
}

/// fp8 is moved (checked by [`movement`]) and never reduced on Gloo.
pub fn fp8(c: &dyn Communicator) {
    for dt in [DType::F8E4M3, DType::F8E5M2] {
        assert!(c.supports(dt, None), "{dt} is moved");
        for op in ReduceOp::ALL {
            assert!(
                !c.supports(dt, Some(op)),
                "{dt} {op} must not be reduced on Gloo"
            );
        }
    }
    let send = vec![F8E4M3::from_f32(1.0); 3];
    let mut out = vec![F8E4M3::from_f32(0.0); 3];
    let e = c
        .all_reduce_into(&send, &mut out, ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("f8"), "{e}");
    let e = c
        .reduce_into(
            &send,
            (c.rank() == 0).then_some(&mut out[..]),
            ReduceOp::Max,
            0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("f8"), "{e}");
}

/// The operations that existed before item 7 (broadcast, all-gather, all-to-all, send/recv,
/// blocking and nonblocking) with `T`: the new dtypes travel through every one of them.
pub fn older_ops<T: Mv>(c: &dyn Communicator) {
    let (me, n) = (c.rank(), c.size());
    let dt = T::DTYPE;
    let len = 5;
    let mut b: Vec<T> = (0..len).map(|i| v::<T>(me, 0, i)).collect();
    c.broadcast_into(&mut b, 0).unwrap();
    let want: Vec<T> = (0..len).map(|i| v::<T>(0, 0, i)).collect();
    assert_eq!(keys(&b), keys(&want), "broadcast {dt}");
    let mine: Vec<T> = (0..len).map(|i| v::<T>(me, 1, i)).collect();
    let mut all = vec![T::mk(0); len * n];
    c.all_gather_into(&mine, &mut all).unwrap();
    let want: Vec<T> = (0..n)
        .flat_map(|j| (0..len).map(move |i| v::<T>(j, 1, i)))
        .collect();
    assert_eq!(keys(&all), keys(&want), "all_gather {dt}");
    let got = c.iall_gather(mine).and_then(|w| w.wait()).unwrap();
    assert_eq!(keys(&got), keys(&want), "iall_gather {dt}");
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..len).map(move |i| v::<T>(me, j, i)))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|j| (0..len).map(move |i| v::<T>(j, me, i)))
        .collect();
    let mut recv = vec![T::mk(0); len * n];
    c.all_to_all_into(&send, &mut recv).unwrap();
    assert_eq!(keys(&recv), keys(&want), "all_to_all {dt}");
    if n > 1 {
        // A ring: send to the next rank, receive from the previous one.
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let w = c
            .isend((0..len).map(|i| v::<T>(me, next, i)).collect(), next, 5)
            .unwrap();
        let mut got = vec![T::mk(0); len];
        c.recv_from(&mut got, prev, 5).unwrap();
        w.wait().unwrap();
        let want: Vec<T> = (0..len).map(|i| v::<T>(prev, me, i)).collect();
        assert_eq!(keys(&got), keys(&want), "send/recv {dt}");
    }
}

/// Every check of this module.
pub fn suite(c: &dyn Communicator) {
    for scale in [1usize, 5] {
        movement::<f32>(c, scale);
        movement::<f64>(c, scale);
        movement::<i32>(c, scale);
        movement::<i64>(c, scale);
        movement::<u8>(c, scale);
        movement::<f16>(c, scale);
        movement::<bf16>(c, scale);
        movement::<i8>(c, scale);
        movement::<u32>(c, scale);
        movement::<u64>(c, scale);
        movement::<Bool>(c, scale);
        movement::<F8E4M3>(c, scale);
        movement::<F8E5M2>(c, scale);
    }
    for scale in [1usize, 3] {
        reductions::<f32>(c, scale);
        reductions::<f64>(c, scale);
        reductions::<i32>(c, scale);
        reductions::<i64>(c, scale);
        reductions::<u8>(c, scale);
        reductions::<f16>(c, scale);
        reductions::<bf16>(c, scale);
        reductions::<i8>(c, scale);
        reductions::<u32>(c, scale);
        reductions::<u64>(c, scale);
    }
    older_ops::<i8>(c);
    older_ops::<u32>(c);
    older_ops::<u64>(c);
    older_ops::<Bool>(c);
    older_ops::<F8E4M3>(c);
    older_ops::<F8E5M2>(c);
    bools(c);
    fp8(c);
}
