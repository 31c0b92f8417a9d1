//! CPU tests of the plans of the operations NCCL has no single call for
//! (`backend_nccl::plan`): exact call lists for small cases, and every plan of every rank run
//! through a simulator of NCCL's matching rules (sends and receives pair up in order per
//! ordered pair of ranks with equal counts; broadcasts and reduces are collectives every rank
//! issues in the same order with the same root and count) whose result must equal the
//! operation's definition, over many sizes and uneven counts (zeros included).

use backend_nccl::plan::{self, Call};
use grid_core::Error;
use std::collections::{HashMap, VecDeque};

// ----- exact call lists ----------------------------------------------------------------------

#[test]
fn all_to_all_v_calls() {
    // Rank 1 of 3: sends 2 to 0, 0 to itself, 3 to 2; receives 1 from 0, 4 from itself, 0 from 2.
    let calls = plan::all_to_all_v(1, &[2, 0, 3], &[1, 4, 0]).unwrap();
    assert_eq!(
        calls,
        vec![
            Call::Recv {
                peer: 0,
                offset: 0,
                count: 1
            },
            Call::Recv {
                peer: 1,
                offset: 1,
                count: 4
            },
            Call::Send {
                peer: 0,
                offset: 0,
                count: 2
            },
            Call::Send {
                peer: 2,
                offset: 2,
                count: 3
            },
        ]
    );
    assert_eq!(plan::all_to_all_v(0, &[0, 0], &[0, 0]).unwrap(), vec![]);
}

#[test]
fn all_gather_v_calls() {
    assert_eq!(
        plan::all_gather_v(2, &[1, 0, 3, 2]).unwrap(),
        vec![
            Call::Broadcast {
                root: 0,
                send_offset: None,
                recv_offset: 0,
                count: 1
            },
            Call::Broadcast {
                root: 2,
                send_offset: Some(0),
                recv_offset: 1,
                count: 3
            },
            Call::Broadcast {
                root: 3,
                send_offset: None,
                recv_offset: 4,
                count: 2
            },
        ]
    );
    // A rank contributing nothing still receives the others' blocks.
    assert_eq!(
        plan::all_gather_v(1, &[2, 0]).unwrap(),
        vec![Call::Broadcast {
            root: 0,
            send_offset: None,
            recv_offset: 0,
            count: 2
        }]
    );
}

#[test]
fn reduce_scatter_v_calls() {
    assert_eq!(
        plan::reduce_scatter_v(1, &[2, 3, 0, 1]).unwrap(),
        vec![
            Call::Reduce {
                root: 0,
                send_offset: 0,
                recv_offset: None,
                count: 2
            },
            Call::Reduce {
                root: 1,
                send_offset: 2,
                recv_offset: Some(0),
                count: 3
            },
            Call::Reduce {
                root: 3,
                send_offset: 5,
                recv_offset: None,
                count: 1
            },
        ]
    );
}

#[test]
fn rooted_calls() {
    assert_eq!(
        plan::reduce(0, 4, 3, 5).unwrap(),
        vec![Call::Reduce {
            root: 3,
            send_offset: 0,
            recv_offset: None,
            count: 5
        }]
    );
    assert_eq!(
        plan::reduce(3, 4, 3, 5).unwrap(),
        vec![Call::Reduce {
            root: 3,
            send_offset: 0,
            recv_offset: Some(0),
            count: 5
        }]
    );
    assert_eq!(
        plan::gather(0, 3, 2, 4).unwrap(),
        vec![Call::Send {
            peer: 2,
            offset: 0,
            count: 4
        }]
    );
    assert_eq!(
        plan::gather(2, 3, 2, 4).unwrap(),
        vec![
            Call::Recv {
                peer: 0,
                offset: 0,
                count: 4
            },
            Call::Recv {
                peer: 1,
                offset: 4,
                count: 4
            },
            Call::Recv {
                peer: 2,
                offset: 8,
                count: 4
            },
            Call::Send {
                peer: 2,
                offset: 0,
                count: 4
            },
        ]
    );
    assert_eq!(
        plan::scatter(1, 3, 0, 2).unwrap(),
        vec![Call::Recv {
            peer: 0,
            offset: 0,
            count: 2
        }]
    );
    assert_eq!(
        plan::scatter(0, 3, 0, 2).unwrap(),
        vec![
            Call::Send {
                peer: 0,
                offset: 0,
                count: 2
            },
            Call::Send {
                peer: 1,
                offset: 2,
                count: 2
            },
            Call::Send {
                peer: 2,
                offset: 4,
                count: 2
            },
            Call::Recv {
                peer: 0,
                offset: 0,
                count: 2
            },
        ]
    );
    for f in [plan::reduce, plan::gather, plan::scatter] {
        assert_eq!(f(1, 3, 0, 0).unwrap(), vec![], "zero elements: no call");
    }
}

// ----- bad input: errors, never panics --------------------------------------------------------

#[test]
fn bad_arguments_are_errors() {
    let e = plan::all_to_all_v(0, &[1, 2], &[1]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "all_to_all_v: recv_counts has 1 entries but the communicator has 2 ranks (give one count per rank)"
    );
    assert!(matches!(
        plan::gather(0, 2, 2, 1).unwrap_err(),
        Error::PeerOutOfRange {
            what: "root",
            rank: 2,
            size: 2,
            ..
        }
    ));
    assert!(matches!(
        plan::all_gather_v(3, &[1, 1]).unwrap_err(),
        Error::PeerOutOfRange {
            what: "rank",
            rank: 3,
            size: 2,
            ..
        }
    ));
    let e = plan::all_gather_v(0, &[usize::MAX, 1, 1]).unwrap_err();
    assert!(e.to_string().contains("add up to more than"), "{e}");
    let e = plan::scatter(0, 3, 0, usize::MAX / 2).unwrap_err();
    assert!(e.to_string().contains("lies beyond"), "{e}");
}

/// `plan::check` (run next to the unsafe NCCL calls) refuses ranges outside the buffers,
/// overlapping writes and peers beyond the size.
#[test]
fn check_refuses_out_of_bounds_and_overlap() {
    let ok = plan::gather(0, 2, 0, 3).unwrap();
    plan::check("gather", &ok, 2, 3, 6).unwrap();
    let e = plan::check("gather", &ok, 2, 3, 5).unwrap_err();
    assert!(
        e.to_string()
            .contains("writes elements 3..6 of a receive buffer of 5"),
        "{e}"
    );
    let e = plan::check("gather", &ok, 2, 2, 6).unwrap_err();
    assert!(
        e.to_string()
            .contains("reads elements 0..3 of a send buffer of 2"),
        "{e}"
    );
    let overlap = [
        Call::Recv {
            peer: 0,
            offset: 0,
            count: 3,
        },
        Call::Recv {
            peer: 1,
            offset: 2,
            count: 3,
        },
    ];
    let e = plan::check("x", &overlap, 2, 0, 5).unwrap_err();
    assert!(
        e.to_string()
            .contains("two receives overlap (elements 0..3 and 2..5)"),
        "{e}"
    );
    let far = [Call::Send {
        peer: 2,
        offset: 0,
        count: 1,
    }];
    assert!(matches!(
        plan::check("x", &far, 2, 1, 0).unwrap_err(),
        Error::PeerOutOfRange {
            rank: 2,
            size: 2,
            ..
        }
    ));
    let wrap = [Call::Send {
        peer: 0,
        offset: usize::MAX,
        count: 2,
    }];
    assert!(plan::check("x", &wrap, 1, 4, 0).is_err());
}

// ----- simulation of NCCL's matching rules ------------------------------------------------------

/// One rank's buffers (values as i64, so reductions are exact sums).
#[derive(Clone, Debug)]
struct Bufs {
    send: Vec<i64>,
    recv: Vec<i64>,
}

/// Runs the plans of every rank the way NCCL pairs them within one group and returns every
/// rank's receive buffer. Panics (a test failure) when the plans do not pair up: a send without
/// its receive, unequal counts, collectives in different orders, roots or counts.
fn simulate(plans: &[Vec<Call>], mut bufs: Vec<Bufs>) -> Vec<Vec<i64>> {
    let n = plans.len();
    for (r, p) in plans.iter().enumerate() {
        plan::check("sim", p, n, bufs[r].send.len(), bufs[r].recv.len())
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    // Point-to-point: per ordered pair (from, to), sends and receives in order.
    let mut sends: HashMap<(usize, usize), VecDeque<(usize, usize)>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), VecDeque<(usize, usize)>> = HashMap::new();
    // Collectives: each rank's sequence.
    let mut colls: Vec<Vec<Call>> = vec![Vec::new(); n];
    for (r, p) in plans.iter().enumerate() {
        for c in p {
            match *c {
                Call::Send {
                    peer,
                    offset,
                    count,
                } => sends
                    .entry((r, peer))
                    .or_default()
                    .push_back((offset, count)),
                Call::Recv {
                    peer,
                    offset,
                    count,
                } => recvs
                    .entry((peer, r))
                    .or_default()
                    .push_back((offset, count)),
                _ => colls[r].push(*c),
            }
        }
    }
    let mut keys: Vec<_> = sends.keys().chain(recvs.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let before = bufs.clone();
    for (from, to) in keys {
        let s = sends.remove(&(from, to)).unwrap_or_default();
        let r = recvs.remove(&(from, to)).unwrap_or_default();
        assert_eq!(
            s.len(),
            r.len(),
            "{from}->{to}: {} sends, {} receives",
            s.len(),
            r.len()
        );
        for ((so, sc), (ro, rc)) in s.into_iter().zip(r) {
            assert_eq!(sc, rc, "{from}->{to}: send of {sc}, receive of {rc}");
            let data = before[from].send[so..so + sc].to_vec();
            bufs[to].recv[ro..ro + rc].copy_from_slice(&data);
        }
    }
    let len = colls[0].len();
    for (r, c) in colls.iter().enumerate() {
        assert_eq!(
            c.len(),
            len,
            "rank {r} issues {} collectives, rank 0 {len}",
            c.len()
        );
    }
    for k in 0..len {
        let (root, count) = (colls[0][k].rank(), count_of(&colls[0][k]));
        for (r, c) in colls.iter().enumerate() {
            assert_eq!(
                (c[k].rank(), count_of(&c[k])),
                (root, count),
                "collective {k}: rank {r} disagrees with rank 0"
            );
            assert_eq!(
                std::mem::discriminant(&c[k]),
                std::mem::discriminant(&colls[0][k]),
                "collective {k}: rank {r} calls another function"
            );
        }
        match colls[root][k] {
            Call::Broadcast { send_offset, .. } => {
                let so = send_offset.expect("the root of a broadcast reads its send buffer");
                let data = before[root].send[so..so + count].to_vec();
                for (r, c) in colls.iter().enumerate() {
                    let Call::Broadcast {
                        recv_offset,
                        send_offset,
                        ..
                    } = c[k]
                    else {
                        unreachable!()
                    };
                    assert_eq!(
                        send_offset.is_some(),
                        r == root,
                        "send offset only on the root"
                    );
                    bufs[r].recv[recv_offset..recv_offset + count].copy_from_slice(&data);
                }
            }
            Call::Reduce { recv_offset, .. } => {
                let ro = recv_offset.expect("the root of a reduce writes its receive buffer");
                let mut sum = vec![0i64; count];
                for (r, c) in colls.iter().enumerate() {
                    let Call::Reduce {
                        send_offset,
                        recv_offset,
                        ..
                    } = c[k]
                    else {
                        unreachable!()
                    };
                    assert_eq!(
                        recv_offset.is_some(),
                        r == root,
                        "recv offset only on the root"
                    );
                    for (s, x) in sum
                        .iter_mut()
                        .zip(&before[r].send[send_offset..send_offset + count])
                    {
                        *s += x;
                    }
                }
                bufs[root].recv[ro..ro + count].copy_from_slice(&sum);
            }
            _ => unreachable!(),
        }
    }
    bufs.into_iter().map(|b| b.recv).collect()
}

fn count_of(c: &Call) -> usize {
    match *c {
        Call::Send { count, .. }
        | Call::Recv { count, .. }
        | Call::Broadcast { count, .. }
        | Call::Reduce { count, .. } => count,
    }
}

/// A deterministic pseudo-random generator (no dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % below as u64) as usize
    }
}

/// The value rank `r` holds at element `i` of its send buffer.
fn val(r: usize, i: usize) -> i64 {
    (r as i64 + 1) * 1000 + i as i64
}

#[test]
fn all_to_all_v_plans_deliver_every_block() {
    let mut g = Lcg(7);
    for n in 1..=6 {
        for _ in 0..20 {
            // m[i][j]: what rank i sends to rank j (zeros included).
            let m: Vec<Vec<usize>> = (0..n)
                .map(|_| (0..n).map(|_| g.next(4)).collect())
                .collect();
            let plans: Vec<_> = (0..n)
                .map(|r| {
                    let recv_counts: Vec<usize> = (0..n).map(|j| m[j][r]).collect();
                    plan::all_to_all_v(r, &m[r], &recv_counts).unwrap()
                })
                .collect();
            let bufs = (0..n)
                .map(|r| Bufs {
                    send: (0..m[r].iter().sum()).map(|i| val(r, i)).collect(),
                    recv: vec![-1; (0..n).map(|j| m[j][r]).sum()],
                })
                .collect();
            let got = simulate(&plans, bufs);
            for r in 0..n {
                let mut want = Vec::new();
                for (j, row) in m.iter().enumerate() {
                    let start: usize = row[..r].iter().sum();
                    want.extend((start..start + row[r]).map(|i| val(j, i)));
                }
                assert_eq!(got[r], want, "n={n} rank {r} counts {m:?}");
            }
        }
    }
}

#[test]
fn all_gather_v_plans_gather_in_rank_order() {
    let mut g = Lcg(11);
    for n in 1..=6 {
        for _ in 0..20 {
            let counts: Vec<usize> = (0..n).map(|_| g.next(5)).collect();
            let total: usize = counts.iter().sum();
            let plans: Vec<_> = (0..n)
                .map(|r| plan::all_gather_v(r, &counts).unwrap())
                .collect();
            let bufs = (0..n)
                .map(|r| Bufs {
                    send: (0..counts[r]).map(|i| val(r, i)).collect(),
                    recv: vec![-1; total],
                })
                .collect();
            let want: Vec<i64> = (0..n)
                .flat_map(|j| (0..counts[j]).map(move |i| val(j, i)))
                .collect();
            for (r, got) in simulate(&plans, bufs).into_iter().enumerate() {
                assert_eq!(got, want, "n={n} rank {r} counts {counts:?}");
            }
        }
    }
}

#[test]
fn reduce_scatter_v_plans_reduce_each_block_onto_its_rank() {
    let mut g = Lcg(13);
    for n in 1..=6 {
        for _ in 0..20 {
            let counts: Vec<usize> = (0..n).map(|_| g.next(5)).collect();
            let total: usize = counts.iter().sum();
            let plans: Vec<_> = (0..n)
                .map(|r| plan::reduce_scatter_v(r, &counts).unwrap())
                .collect();
            let bufs = (0..n)
                .map(|r| Bufs {
                    send: (0..total).map(|i| val(r, i)).collect(),
                    recv: vec![-1; counts[r]],
                })
                .collect();
            let got = simulate(&plans, bufs);
            for r in 0..n {
                let start: usize = counts[..r].iter().sum();
                let want: Vec<i64> = (start..start + counts[r])
                    .map(|i| (0..n).map(|j| val(j, i)).sum())
                    .collect();
                assert_eq!(got[r], want, "n={n} rank {r} counts {counts:?}");
            }
        }
    }
}

#[test]
fn rooted_plans_match_their_definitions() {
    for n in 1..=5 {
        for root in 0..n {
            for count in [0, 1, 3] {
                // reduce
                let plans: Vec<_> = (0..n)
                    .map(|r| plan::reduce(r, n, root, count).unwrap())
                    .collect();
                let bufs = (0..n)
                    .map(|r| Bufs {
                        send: (0..count).map(|i| val(r, i)).collect(),
                        recv: vec![-1; if r == root { count } else { 0 }],
                    })
                    .collect();
                let got = simulate(&plans, bufs);
                let want: Vec<i64> = (0..count)
                    .map(|i| (0..n).map(|j| val(j, i)).sum())
                    .collect();
                assert_eq!(got[root], want, "reduce n={n} root={root} count={count}");

                // gather
                let plans: Vec<_> = (0..n)
                    .map(|r| plan::gather(r, n, root, count).unwrap())
                    .collect();
                let bufs = (0..n)
                    .map(|r| Bufs {
                        send: (0..count).map(|i| val(r, i)).collect(),
                        recv: vec![-1; if r == root { n * count } else { 0 }],
                    })
                    .collect();
                let got = simulate(&plans, bufs);
                let want: Vec<i64> = (0..n)
                    .flat_map(|j| (0..count).map(move |i| val(j, i)))
                    .collect();
                assert_eq!(got[root], want, "gather n={n} root={root} count={count}");

                // scatter
                let plans: Vec<_> = (0..n)
                    .map(|r| plan::scatter(r, n, root, count).unwrap())
                    .collect();
                let bufs = (0..n)
                    .map(|r| Bufs {
                        send: if r == root {
                            (0..n * count).map(|i| val(r, i)).collect()
                        } else {
                            vec![]
                        },
                        recv: vec![-1; count],
                    })
                    .collect();
                for (r, got) in simulate(&plans, bufs).into_iter().enumerate() {
                    let want: Vec<i64> =
                        (r * count..(r + 1) * count).map(|i| val(root, i)).collect();
                    assert_eq!(
                        got, want,
                        "scatter n={n} root={root} count={count} rank {r}"
                    );
                }
            }
        }
    }
}

/// The simulator itself catches plans that would not pair up on NCCL (so the tests above are
/// not vacuous): a rank whose counts disagree with its peers'.
#[test]
#[should_panic(expected = "send of 2, receive of 1")]
fn simulator_catches_disagreeing_counts() {
    let plans = vec![
        plan::all_to_all_v(0, &[0, 2], &[0, 0]).unwrap(),
        plan::all_to_all_v(1, &[0, 0], &[1, 0]).unwrap(),
    ];
    let bufs = vec![
        Bufs {
            send: vec![1, 2],
            recv: vec![],
        },
        Bufs {
            send: vec![],
            recv: vec![0],
        },
    ];
    simulate(&plans, bufs);
}
