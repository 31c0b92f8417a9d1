//! Properties of the arithmetic every backend shares: split membership
//! (`grid_core::split_members`) and the host reduction kernels (`grid_core::kernels`).

use grid_core::{kernels, split_members, HostSlice, HostSliceMut, ReduceOp, SplitEntry};
use proptest::prelude::*;

fn entries() -> impl Strategy<Value = Vec<SplitEntry>> {
    prop::collection::vec((prop::option::of(0u32..4), 0usize..6), 1..24).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(p, (color, key))| SplitEntry {
                color,
                key,
                world_rank: 100 + 3 * p,
            })
            .collect()
    })
}

proptest! {
    #[test]
    fn every_coloured_rank_lands_in_exactly_its_colour_group(all in entries()) {
        for (me, e) in all.iter().enumerate() {
            let got = split_members(&all, me);
            match e.color {
                None => prop_assert!(got.is_none()),
                Some(c) => {
                    let m = got.expect("a coloured rank gets a communicator");
                    // Members: exactly the ranks of that colour, ordered by (key, parent rank).
                    let mut want: Vec<(usize, usize)> = all
                        .iter()
                        .enumerate()
                        .filter(|(_, x)| x.color == Some(c))
                        .map(|(p, x)| (x.key, p))
                        .collect();
                    want.sort();
                    let parents: Vec<usize> = want.iter().map(|&(_, p)| p).collect();
                    prop_assert_eq!(&m.parent_ranks, &parents);
                    let world: Vec<usize> = parents.iter().map(|&p| all[p].world_rank).collect();
                    prop_assert_eq!(&m.members, &world);
                    prop_assert_eq!(m.parent_ranks[m.rank], me);
                    // Every member of the group computes the same list.
                    for &p in &parents {
                        let other = split_members(&all, p).expect("member");
                        prop_assert_eq!(&other.members, &m.members);
                    }
                }
            }
        }
    }

    #[test]
    fn split_entries_round_trip(all in entries()) {
        let flat: Vec<i64> = all.iter().flat_map(|e| e.encode()).collect();
        prop_assert_eq!(SplitEntry::decode_all(&flat).unwrap(), all);
    }

    #[test]
    fn integer_kernels_match_plain_arithmetic(
        rows in prop::collection::vec(prop::collection::vec(any::<i32>(), 6), 1..9),
        start in 0usize..6,
    ) {
        let n = rows.len();
        let len = 6 - start;
        let ins: Vec<HostSlice<'_>> = rows.iter().map(|r| HostSlice::I32(&r[..])).collect();
        for op in ReduceOp::ALL {
            let mut out = vec![0i32; len];
            kernels::reduce_range(&ins, start, HostSliceMut::I32(&mut out), op).unwrap();
            for (i, &o) in out.iter().enumerate() {
                let col = rows.iter().map(|r| r[start + i]);
                let want = match op {
                    ReduceOp::Sum => col.fold(0i32, i32::wrapping_add),
                    ReduceOp::Prod => col.fold(1i32, i32::wrapping_mul),
                    ReduceOp::Min => col.min().unwrap(),
                    ReduceOp::Max => col.max().unwrap(),
                    // Exact mean, truncated toward zero.
                    ReduceOp::Avg => (col.map(i64::from).sum::<i64>() / n as i64) as i32,
                };
                prop_assert_eq!(o, want, "{} at {}", op, start + i);
            }
        }
    }

    #[test]
    fn float_kernels_sum_in_rank_order(
        rows in prop::collection::vec(prop::collection::vec(-1.0e6f64..1.0e6, 4), 1..9),
    ) {
        let ins: Vec<HostSlice<'_>> = rows.iter().map(|r| HostSlice::F64(&r[..])).collect();
        let mut sum = vec![0f64; 4];
        kernels::reduce(&ins, HostSliceMut::F64(&mut sum), ReduceOp::Sum).unwrap();
        let mut avg = vec![0f64; 4];
        kernels::reduce(&ins, HostSliceMut::F64(&mut avg), ReduceOp::Avg).unwrap();
        for i in 0..4 {
            let mut s = rows[0][i];
            for r in &rows[1..] {
                s += r[i];
            }
            prop_assert_eq!(sum[i], s);
            prop_assert_eq!(avg[i], s / rows.len() as f64);
        }
    }

    #[test]
    fn divide_is_the_average_of_a_sum(v in prop::collection::vec(any::<i32>(), 0..8), n in 1usize..9) {
        let mut w = v.clone();
        kernels::divide(HostSliceMut::I32(&mut w), n);
        for (a, b) in v.iter().zip(&w) {
            prop_assert_eq!(*b, (i64::from(*a) / n as i64) as i32);
        }
    }
}
