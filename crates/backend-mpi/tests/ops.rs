//! The operations and dtypes of issue #16 item 7 on MPI, with exact values, blocking and
//! nonblocking, at 2, 3 and 4 ranks: all-to-all-v, all-gather-v and reduce-scatter-v with uneven
//! counts (zeros included), rooted reduce, gather and scatter from every root, over every dtype
//! (reductions over every dtype and operation MPI supports; fp8 is moved, never reduced).
//!
//! Values are tags that name where an element comes from (`16·source + 4·destination + index`,
//! all below 64, so exact in every type; fp8 values are their bit patterns), so a misplaced
//! element is reported with its origin.

use backend_mpi::{mpi_test, MpiCommunicator};
use grid_core::{
    Backend, Bool, Communicator, CommunicatorExt, DType, Element, ReduceOp, F8E4M3, F8E5M2,
};
use half::{bf16, f16};

/// An element type of the suite: built from a tag or a small number, exactly.
trait Val: Element {
    /// Reduced by MPI (fp8 is only moved).
    const REDUCED: bool = true;
    /// Logical: sums and maxima are OR, products and minima AND, no average.
    const LOGICAL: bool = false;
    /// Integer: averages truncate.
    const INTEGER: bool = true;
    /// A value naming `tag` (< 64).
    fn of(tag: usize) -> Self;
    /// The value `x` (a small integer, or a quotient for float averages).
    fn num(x: f64) -> Self;
}

macro_rules! int_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            fn of(tag: usize) -> Self {
                tag as $t
            }
            fn num(x: f64) -> Self {
                x as $t
            }
        }
    )*};
}
int_val!(i8, u8, i32, i64, u32, u64);

impl Val for f32 {
    const INTEGER: bool = false;
    fn of(tag: usize) -> Self {
        tag as f32
    }
    fn num(x: f64) -> Self {
        x as f32
    }
}
impl Val for f64 {
    const INTEGER: bool = false;
    fn of(tag: usize) -> Self {
        tag as f64
    }
    fn num(x: f64) -> Self {
        x
    }
}
impl Val for f16 {
    const INTEGER: bool = false;
    fn of(tag: usize) -> Self {
        f16::from_f32(tag as f32)
    }
    fn num(x: f64) -> Self {
        f16::from_f32(x as f32)
    }
}
impl Val for bf16 {
    const INTEGER: bool = false;
    fn of(tag: usize) -> Self {
        bf16::from_f32(tag as f32)
    }
    fn num(x: f64) -> Self {
        bf16::from_f32(x as f32)
    }
}
impl Val for Bool {
    const LOGICAL: bool = true;
    fn of(tag: usize) -> Self {
        Bool::from(tag % 2 == 1)
    }
    fn num(x: f64) -> Self {
        Bool::from(x != 0.0)
    }
}
impl Val for F8E4M3 {
    const REDUCED: bool = false;
    fn of(tag: usize) -> Self {
        F8E4M3::from_bits(tag as u8)
    }
    fn num(x: f64) -> Self {
        F8E4M3::from_f32(x as f32)
    }
}
impl Val for F8E5M2 {
    const REDUCED: bool = false;
    fn of(tag: usize) -> Self {
        F8E5M2::from_bits(tag as u8)
    }
    fn num(x: f64) -> Self {
        F8E5M2::from_f32(x as f32)
    }
}

type R = Result<(), String>;

fn e(what: &str) -> impl Fn(grid_core::Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn expect<T: Val>(what: &str, got: &[T], want: &[T]) -> R {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{what} ({:?}): got {got:?}, expected {want:?}",
            T::DTYPE
        ))
    }
}

/// Elements rank `src` sends rank `dst` in the all-to-all-v: 0, 1 or 2 of them.
fn a2a_count(src: usize, dst: usize) -> usize {
    (src + 2 * dst) % 3
}

/// Elements rank `j` contributes to the all-gather-v: 0, 1 or 2.
fn agv_count(j: usize) -> usize {
    j % 3
}

/// Block `j` of the reduce-scatter-v: 1, 2 or 0 elements.
fn rsv_count(j: usize) -> usize {
    (j + 1) % 3
}

fn moving<T: Val>(c: &MpiCommunicator) -> R {
    let (me, n) = (c.rank(), c.size());
    let dt = format!("{:?}", T::DTYPE);
    // All-to-all-v: block for rank j is a2a_count(me, j) elements tagged (me, j, k).
    let send_counts: Vec<usize> = (0..n).map(|j| a2a_count(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| a2a_count(i, me)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..a2a_count(me, j)).map(move |k| T::of(16 * me + 4 * j + k)))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|i| (0..a2a_count(i, me)).map(move |k| T::of(16 * i + 4 * me + k)))
        .collect();
    let mut got = vec![T::of(63); want.len()];
    c.all_to_all_v_into(&send, &send_counts, &mut got, &recv_counts)
        .map_err(e(&format!("all_to_all_v {dt}")))?;
    expect("all_to_all_v", &got, &want)?;
    let got = c
        .iall_to_all_v(send, send_counts, recv_counts)
        .and_then(|w| w.wait())
        .map_err(e(&format!("iall_to_all_v {dt}")))?;
    expect("iall_to_all_v", &got, &want)?;

    // All-gather-v.
    let counts: Vec<usize> = (0..n).map(agv_count).collect();
    let mine: Vec<T> = (0..agv_count(me)).map(|k| T::of(16 * me + k)).collect();
    let want: Vec<T> = (0..n)
        .flat_map(|j| (0..agv_count(j)).map(move |k| T::of(16 * j + k)))
        .collect();
    let mut got = vec![T::of(63); want.len()];
    c.all_gather_v_into(&mine, &mut got, &counts)
        .map_err(e(&format!("all_gather_v {dt}")))?;
    expect("all_gather_v", &got, &want)?;
    let got = c
        .iall_gather_v(mine, counts)
        .and_then(|w| w.wait())
        .map_err(e(&format!("iall_gather_v {dt}")))?;
    expect("iall_gather_v", &got, &want)?;

    for root in 0..n {
        // Gather: 3 elements from every rank, in rank order on the root.
        let mine: Vec<T> = (0..3).map(|k| T::of(16 * me + 4 * root + k)).collect();
        let want: Vec<T> = (0..n)
            .flat_map(|r| (0..3).map(move |k| T::of(16 * r + 4 * root + k)))
            .collect();
        let mut all = vec![T::of(63); 3 * n];
        let recv = (me == root).then_some(&mut all[..]);
        c.gather_into(&mine, recv, root)
            .map_err(e(&format!("gather {dt} root {root}")))?;
        if me == root {
            expect("gather", &all, &want)?;
        }
        let got = c
            .igather(mine.clone(), root)
            .and_then(|w| w.wait())
            .map_err(e(&format!("igather {dt} root {root}")))?;
        expect("igather", &got, if me == root { &want } else { &mine })?;

        // Scatter: block j (2 elements) of the root's buffer goes to rank j.
        let blocks: Vec<T> = (0..n)
            .flat_map(|j| (0..2).map(move |k| T::of(16 * j + 4 * root + k)))
            .collect();
        let want: Vec<T> = (0..2).map(|k| T::of(16 * me + 4 * root + k)).collect();
        let mut got = vec![T::of(63); 2];
        let send = (me == root).then_some(&blocks[..]);
        c.scatter_into(send, &mut got, root)
            .map_err(e(&format!("scatter {dt} root {root}")))?;
        expect("scatter", &got, &want)?;
        let send = (me == root).then(|| blocks.clone());
        let got = c
            .iscatter(send, 2, root)
            .and_then(|w| w.wait())
            .map_err(e(&format!("iscatter {dt} root {root}")))?;
        expect("iscatter", &got, &want)?;
    }
    Ok(())
}

/// Rank `r`'s input number at position `k` (1, 2 or 3; for logical types 0 or 1).
fn input<T: Val>(r: usize, k: usize) -> f64 {
    let v = 1 + (r + k) % 3;
    if T::LOGICAL {
        (v == 2) as u8 as f64
    } else {
        v as f64
    }
}

/// The reduction of position `k` over `n` ranks, as the element type computes it.
fn reduced<T: Val>(op: ReduceOp, n: usize, k: usize) -> T {
    let xs: Vec<f64> = (0..n).map(|r| input::<T>(r, k)).collect();
    let max = xs.iter().cloned().fold(f64::MIN, f64::max);
    let min = xs.iter().cloned().fold(f64::MAX, f64::min);
    let sum: f64 = xs.iter().sum();
    let v = match (op, T::LOGICAL) {
        (ReduceOp::Sum | ReduceOp::Max, true) => max,
        (ReduceOp::Prod | ReduceOp::Min, true) => min,
        (ReduceOp::Sum, false) => sum,
        (ReduceOp::Prod, false) => xs.iter().product(),
        (ReduceOp::Min, false) => min,
        (ReduceOp::Max, false) => max,
        (ReduceOp::Avg, _) if T::INTEGER => (sum / n as f64).trunc(),
        (ReduceOp::Avg, _) => sum / n as f64,
    };
    T::num(v)
}

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
];

fn reducing<T: Val>(c: &MpiCommunicator) -> R {
    let (me, n) = (c.rank(), c.size());
    let dt = T::DTYPE;
    for op in OPS {
        let supported = T::REDUCED && !(T::LOGICAL && op == ReduceOp::Avg);
        if c.inner().supports(dt, Some(op)) != supported {
            return Err(format!("supports({dt:?}, {op:?}) is not {supported}"));
        }
        let what = format!("{dt:?} {op:?}");
        if !supported {
            // The front end refuses it on every rank, before MPI sees it.
            let send = [T::of(1); 2];
            let mut recv = [T::of(1); 2];
            let r = c.reduce_into(&send, (me == 0).then_some(&mut recv[..]), op, 0);
            if r.is_ok() {
                return Err(format!("reduce of {what} was accepted"));
            }
            continue;
        }
        // Reduce-scatter-v: block j has rsv_count(j) elements; position k of block j is
        // input(r, j + k) on rank r.
        let counts: Vec<usize> = (0..n).map(rsv_count).collect();
        let send: Vec<T> = (0..n)
            .flat_map(|j| (0..rsv_count(j)).map(move |k| T::num(input::<T>(me, j + k))))
            .collect();
        let want: Vec<T> = (0..rsv_count(me))
            .map(|k| reduced::<T>(op, n, me + k))
            .collect();
        let mut got = vec![T::of(63); want.len()];
        c.reduce_scatter_v_into(&send, &counts, &mut got, op)
            .map_err(e(&format!("reduce_scatter_v {what}")))?;
        expect(&format!("reduce_scatter_v {op:?}"), &got, &want)?;
        let got = c
            .ireduce_scatter_v(send, counts, op)
            .and_then(|w| w.wait())
            .map_err(e(&format!("ireduce_scatter_v {what}")))?;
        expect(&format!("ireduce_scatter_v {op:?}"), &got, &want)?;

        // Reduce of 5 elements to every root.
        let send: Vec<T> = (0..5).map(|k| T::num(input::<T>(me, k))).collect();
        let want: Vec<T> = (0..5).map(|k| reduced::<T>(op, n, k)).collect();
        for root in 0..n {
            let mut got = vec![T::of(63); 5];
            c.reduce_into(&send, (me == root).then_some(&mut got[..]), op, root)
                .map_err(e(&format!("reduce {what} root {root}")))?;
            if me == root {
                expect(&format!("reduce {op:?}"), &got, &want)?;
            }
            let got = c
                .ireduce(send.clone(), op, root)
                .and_then(|w| w.wait())
                .map_err(e(&format!("ireduce {what} root {root}")))?;
            let want = if me == root { &want } else { &send };
            expect(&format!("ireduce {op:?}"), &got, want)?;
        }
    }
    Ok(())
}

fn every_dtype(rt: &backend_mpi::MpiRuntime) -> R {
    let c = rt.world();
    macro_rules! each {
        ($($t:ty),*) => {$(
            moving::<$t>(c)?;
            reducing::<$t>(c)?;
        )*};
    }
    each!(f32, f64, f16, bf16, i32, i64, u8, i8, u32, u64, Bool, F8E4M3, F8E5M2);
    if DType::ALL.len() != 13 {
        return Err(format!("{} dtypes; this test covers 13", DType::ALL.len()));
    }
    Ok(())
}

mpi_test!(mpi_item7_ops_exact_np2, np = 2, timeout = 120, every_dtype);
mpi_test!(mpi_item7_ops_exact_np3, np = 3, timeout = 120, every_dtype);
mpi_test!(mpi_item7_ops_exact_np4, np = 4, timeout = 180, every_dtype);

// The average of u64 is exact even when the sum overflows u64 (it travels as 32-bit halves):
// rank r contributes u64::MAX - r - k at position k; the mean over 3 ranks is u64::MAX - 1 - k.
mpi_test!(
    mpi_item7_u64_average_is_exact_np3,
    np = 3,
    timeout = 60,
    |rt| {
        let c = rt.world();
        let (me, n) = (c.rank(), c.size());
        let avg = ReduceOp::Avg;
        let mine: Vec<u64> = (0..n as u64).map(|k| u64::MAX - me as u64 - k).collect();
        let want: Vec<u64> = (0..n as u64).map(|k| u64::MAX - 1 - k).collect();
        let err = |what: &'static str| move |e: grid_core::Error| format!("{what}: {e}");
        let mut got = vec![0u64; n];
        c.all_reduce_into(&mine, &mut got, avg)
            .map_err(err("all_reduce"))?;
        expect("all_reduce", &got, &want)?;
        let got = c.iall_reduce(mine.clone(), avg).and_then(|w| w.wait());
        expect("iall_reduce", &got.map_err(err("iall_reduce"))?, &want)?;
        let mut got = vec![0u64; n];
        c.reduce_into(&mine, (me == 2).then_some(&mut got[..]), avg, 2)
            .map_err(err("reduce"))?;
        if me == 2 {
            expect("reduce", &got, &want)?;
        }
        let got = c.ireduce(mine.clone(), avg, 2).and_then(|w| w.wait());
        let got = got.map_err(err("ireduce"))?;
        expect("ireduce", &got, if me == 2 { &want } else { &mine })?;
        // Reduce-scatter-v with one element per rank: rank j gets position j.
        let mut one = [0u64];
        c.reduce_scatter_v_into(&mine, &vec![1; n], &mut one, avg)
            .map_err(err("reduce_scatter_v"))?;
        expect("reduce_scatter_v", &one, &want[me..me + 1])?;
        let got = c
            .ireduce_scatter_v(mine.clone(), vec![1; n], avg)
            .and_then(|w| w.wait());
        expect(
            "ireduce_scatter_v",
            &got.map_err(err("ireduce_scatter_v"))?,
            &want[me..me + 1],
        )?;
        let mut one = [0u64];
        c.reduce_scatter_into(&mine, &mut one, avg)
            .map_err(err("reduce_scatter"))?;
        expect("reduce_scatter", &one, &want[me..me + 1])?;
        Ok(())
    }
);
