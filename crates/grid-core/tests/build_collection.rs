//! `build_collection` on an in-memory communicator whose ranks are threads: one split per
//! distinct family, reuse of identical families, no communicator outside a rank's groups, and
//! a plan mismatch that fails every rank instead of hanging.

use grid_core::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Shared state of one communicator's ranks.
struct Hub {
    size: usize,
    state: Mutex<HubState>,
    cv: Condvar,
}

#[derive(Default)]
struct HubState {
    /// Contributions per collective sequence number.
    rounds: HashMap<u64, Vec<Option<Vec<i64>>>>,
    /// Sub-communicator hubs created by splits, per (sequence, colour).
    children: HashMap<(u64, u32), Arc<Hub>>,
}

impl Hub {
    fn new(size: usize) -> Arc<Hub> {
        Arc::new(Hub {
            size,
            state: Mutex::default(),
            cv: Condvar::new(),
        })
    }

    /// Every rank contributes a vector; everyone gets all of them (rank order).
    fn exchange(&self, seq: u64, rank: usize, data: Vec<i64>) -> Result<Vec<Vec<i64>>> {
        let mut st = self.state.lock().unwrap();
        st.rounds
            .entry(seq)
            .or_insert_with(|| vec![None; self.size])[rank] = Some(data);
        self.cv.notify_all();
        loop {
            let round = &st.rounds[&seq];
            if round.iter().all(Option::is_some) {
                return Ok(round.iter().map(|x| x.clone().unwrap()).collect());
            }
            let (s, t) = self.cv.wait_timeout(st, Duration::from_secs(10)).unwrap();
            st = s;
            if t.timed_out() {
                return Err(Error::Timeout {
                    op: "exchange",
                    millis: 10_000,
                    peer: None,
                });
            }
        }
    }
}

struct ThreadComm {
    hub: Arc<Hub>,
    rank: usize,
    global: Vec<usize>,
    seq: AtomicU64,
}

impl ThreadComm {
    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }
}

fn unsupported(op: &'static str) -> Error {
    Error::Unsupported {
        op,
        backend: "thread-test",
        what: "this operation".into(),
    }
}

impl Communicator for ThreadComm {
    fn backend(&self) -> &'static str {
        "thread-test"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.hub.size
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global
    }
    fn accepts(&self, m: Memory) -> bool {
        m == Memory::Host
    }
    fn supports(&self, dtype: DType, _: Option<ReduceOp>) -> bool {
        dtype == DType::I64
    }
    fn all_reduce(&self, send: BufRef<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (BufRef::Host(HostSlice::I64(s)), BufMut::Host(HostSliceMut::I64(r)), ReduceOp::Sum) =
            (send, recv, op)
        else {
            return Err(unsupported("all_reduce"));
        };
        let all = self.hub.exchange(self.next(), self.rank, s.to_vec())?;
        for (i, x) in r.iter_mut().enumerate() {
            *x = all.iter().map(|v| v[i]).sum();
        }
        Ok(())
    }
    fn broadcast(&self, _: BufMut<'_>, _: usize) -> Result<()> {
        Err(unsupported("broadcast"))
    }
    fn all_gather(&self, send: BufRef<'_>, recv: BufMut<'_>) -> Result<()> {
        let (BufRef::Host(HostSlice::I64(s)), BufMut::Host(HostSliceMut::I64(r))) = (send, recv)
        else {
            return Err(unsupported("all_gather"));
        };
        let all = self.hub.exchange(self.next(), self.rank, s.to_vec())?;
        r.copy_from_slice(&all.concat());
        Ok(())
    }
    fn reduce_scatter(&self, _: BufRef<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        Err(unsupported("reduce_scatter"))
    }
    fn all_to_all(&self, _: BufRef<'_>, _: BufMut<'_>) -> Result<()> {
        Err(unsupported("all_to_all"))
    }
    fn barrier(&self) -> Result<()> {
        self.hub
            .exchange(self.next(), self.rank, vec![])
            .map(|_| ())
    }
    fn send(&self, _: BufRef<'_>, _: usize, _: u32) -> Result<()> {
        Err(unsupported("send"))
    }
    fn recv(&self, _: BufMut<'_>, _: usize, _: u32) -> Result<()> {
        Err(unsupported("recv"))
    }
    fn batch_p2p(&self, _: Vec<P2pOp<'_>>) -> Result<()> {
        Err(unsupported("batch_p2p"))
    }
    fn start(&self, _: Request) -> Result<Box<dyn Work>> {
        Err(unsupported("start"))
    }
}

/// Counts the splits it performs.
#[derive(Default)]
struct ThreadFactory {
    splits: AtomicUsize,
}

impl GroupFactory for ThreadFactory {
    type Comm = ThreadComm;
    fn split(
        &self,
        parent: &ThreadComm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<ThreadComm>> {
        self.splits.fetch_add(1, Ordering::SeqCst);
        let seq = parent.next();
        let c = color.map_or(-1, i64::from);
        let all = parent.hub.exchange(seq, parent.rank, vec![c, key as i64])?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, v)| v[0] == i64::from(color))
            .map(|(r, v)| (v[1], r))
            .collect();
        members.sort();
        let pos = members.iter().position(|&(_, r)| r == parent.rank).unwrap();
        let hub = {
            let mut st = parent.hub.state.lock().unwrap();
            st.children
                .entry((seq, color))
                .or_insert_with(|| Hub::new(members.len()))
                .clone()
        };
        Ok(Some(ThreadComm {
            hub,
            rank: pos,
            global: members.iter().map(|&(_, r)| parent.global[r]).collect(),
            seq: AtomicU64::new(0),
        }))
    }
}

/// Runs `body(rank, world)` on `n` threads sharing one world communicator.
fn run_ranks<T: Send + 'static>(
    n: usize,
    body: impl Fn(usize, ThreadComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let hub = Hub::new(n);
    let body = Arc::new(body);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (hub, body) = (hub.clone(), body.clone());
            std::thread::spawn(move || {
                body(
                    r,
                    ThreadComm {
                        hub,
                        rank: r,
                        global: (0..n).collect(),
                        seq: AtomicU64::new(0),
                    },
                )
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn moe_plan() -> LayoutPlan {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        cp: 2,
        ep: 2,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(16)
    })
    .unwrap()
}

#[test]
fn builds_every_family_with_one_split_each() {
    let plan = moe_plan();
    let distinct: std::collections::HashSet<_> = plan
        .family_levels()
        .iter()
        .map(|f| plan.group_signature(*f).unwrap())
        .collect();
    let results = run_ranks(16, move |rank, world| {
        let plan = moe_plan();
        let factory = ThreadFactory::default();
        let built = build_collection(&factory, &world, &plan).unwrap();
        // Every family the rank belongs to has a communicator over exactly the plan's group.
        for fl in plan.family_levels() {
            let want = plan.group_of(fl, rank).unwrap().map(|g| g.sorted());
            let got = match fl.family {
                Family::Hcp => built
                    .collection
                    .hcp
                    .as_ref()
                    .map(|h| h[fl.level].global_ranks().to_vec()),
                f => built
                    .collection
                    .get(f.name())
                    .unwrap()
                    .map(|c| c.global_ranks().to_vec()),
            };
            assert_eq!(got, want, "rank {rank} family {fl}");
        }
        // An all-reduce on each communicator sums the members' world ranks.
        for (name, entry) in built.collection.iter() {
            if let PgEntry::Group(c) = entry {
                let mut out = [0i64];
                c.all_reduce_into(&[rank as i64], &mut out, ReduceOp::Sum)
                    .unwrap();
                let want: usize = c.global_ranks().iter().sum();
                assert_eq!(out[0] as usize, want, "rank {rank} {name}");
            }
        }
        (
            factory.splits.load(Ordering::SeqCst),
            built.collective_calls,
            built.communicators_created(),
            built.stats,
        )
    });
    for (splits, calls, created, stats) in results {
        assert_eq!(splits, distinct.len(), "one split per distinct family");
        assert_eq!(calls, distinct.len() + 1, "plus the plan check");
        assert!(created <= distinct.len());
        // A reused family never creates a communicator and names an earlier family.
        for (i, s) in stats.iter().enumerate() {
            if let Some(from) = s.reused_from {
                assert_eq!(s.created, 0);
                assert!(stats[..i]
                    .iter()
                    .any(|e| e.family == from && e.reused_from.is_none()));
            }
        }
    }
}

#[test]
fn reuses_identical_families() {
    // cp = 1: dp_cp is dp, intra_dp_cp is dp_cp (one instance), ep and cp are singletons.
    let results = run_ranks(8, |_, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let built = build_collection(&ThreadFactory::default(), &world, &plan).unwrap();
        let reused: HashMap<String, String> = built
            .stats
            .iter()
            .filter_map(|s| s.reused_from.map(|f| (s.family.to_string(), f.to_string())))
            .collect();
        let c = &built.collection;
        assert!(Arc::ptr_eq(
            c.dp.as_ref().unwrap(),
            c.dp_cp.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(
            c.dp_cp.as_ref().unwrap(),
            c.intra_dp_cp.as_ref().unwrap()
        ));
        reused
    });
    for r in results {
        assert_eq!(r["dp_cp"], "dp");
        assert_eq!(r["intra_dp_cp"], "dp");
        assert_eq!(r["ep"], "cp"); // both singletons
        assert_eq!(r["expt_tp"], "tp"); // etp = tp and ep = 1
        assert_eq!(r["tp_ep_pp"], "mp");
        assert_eq!(r["expt_dp"], "dp");
    }
}

#[test]
fn ranks_outside_the_layout_get_nothing_but_take_part() {
    let results = run_ranks(12, |rank, world| {
        let plan = LayoutPlan::new(LayoutConfig {
            tp: 2,
            pp: 2,
            rank_offset: 4,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        let built = build_collection(&ThreadFactory::default(), &world, &plan).unwrap();
        (
            rank,
            built.collection.len(),
            built
                .collection
                .tp
                .as_ref()
                .map(|c| c.global_ranks().to_vec()),
        )
    });
    for (rank, n, tp) in results {
        if rank < 4 {
            assert_eq!((n, tp), (0, None));
        } else {
            assert!(n > 0);
            let base = rank - rank % 2;
            assert_eq!(tp, Some(vec![base, base + 1]));
        }
    }
}

#[test]
fn a_different_plan_on_one_rank_fails_every_rank() {
    let results = run_ranks(8, |rank, world| {
        let tp = if rank == 3 { 4 } else { 2 };
        let plan = LayoutPlan::new(LayoutConfig {
            tp,
            ..LayoutConfig::new(8)
        })
        .unwrap();
        build_collection(&ThreadFactory::default(), &world, &plan).err()
    });
    for (rank, err) in results.into_iter().enumerate() {
        match err {
            Some(Error::PlanMismatch { mismatched, .. }) => {
                if rank == 3 {
                    assert_eq!(mismatched.len(), 7);
                } else {
                    assert_eq!(mismatched, vec![3]);
                }
            }
            other => panic!("rank {rank}: expected PlanMismatch, got {other:?}"),
        }
    }
}
