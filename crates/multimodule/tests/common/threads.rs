//! A tiny in-memory communicator for tests: one thread per rank, mailboxes keyed by
//! (communicator, source, destination, tag). With `rendezvous` on, a send completes only once the
//! receiver has taken the message (like a large MPI message), so any ordering that would
//! deadlock on a real backend deadlocks here too and fails with a time-out.
#![allow(dead_code)]

use grid_core::{
    BufMut, BufRef, Communicator, DType, Error, GroupFactory, HostBuffer, Memory, P2pOp, ReduceOp,
    Request, Result, Work,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

type Key = (u64, usize, usize, u32);
/// Each parent rank's (colour, key) for one split.
type Board = Vec<Option<(Option<u32>, usize)>>;

#[derive(Default)]
struct HubState {
    mail: HashMap<Key, VecDeque<(u64, HostBuffer)>>,
    consumed: HashSet<u64>,
    next_msg: u64,
    boards: HashMap<(u64, u64), Board>,
    ids: HashMap<(u64, u64, u32), u64>,
    next_id: u64,
    /// (world src, world dst, elements) of every payload-sized message, for inspection.
    log: Vec<(usize, usize, usize)>,
    /// Number of `batch_p2p` calls (exchange rounds) per world rank.
    batches: HashMap<usize, usize>,
}

/// Shared state of one simulated world.
pub struct Hub {
    state: Mutex<HubState>,
    cv: Condvar,
    timeout: Duration,
    rendezvous: bool,
}

impl Hub {
    pub fn new(timeout: Duration, rendezvous: bool) -> Arc<Hub> {
        Arc::new(Hub {
            state: Mutex::new(HubState {
                next_id: 1,
                ..Default::default()
            }),
            cv: Condvar::new(),
            timeout,
            rendezvous,
        })
    }
    pub fn log(&self) -> Vec<(usize, usize, usize)> {
        self.state.lock().unwrap().log.clone()
    }
    /// `batch_p2p` calls made by world rank `rank` so far.
    pub fn batches(&self, rank: usize) -> usize {
        self.state
            .lock()
            .unwrap()
            .batches
            .get(&rank)
            .copied()
            .unwrap_or(0)
    }
}

const COLL_TAG: u32 = u32::MAX - 7;

/// One rank's communicator over a sorted list of world ranks.
pub struct ThreadComm {
    hub: Arc<Hub>,
    id: u64,
    ranks: Vec<usize>,
    me: usize,
    splits: AtomicU64,
}

impl ThreadComm {
    pub fn world(hub: &Arc<Hub>, size: usize, rank: usize) -> ThreadComm {
        ThreadComm {
            hub: hub.clone(),
            id: 0,
            ranks: (0..size).collect(),
            me: rank,
            splits: AtomicU64::new(0),
        }
    }
    fn world_rank(&self) -> usize {
        self.ranks[self.me]
    }

    fn post(&self, buf: HostBuffer, peer: usize, tag: u32) -> Result<u64> {
        if peer >= self.ranks.len() || peer == self.me {
            return Err(Error::PeerOutOfRange {
                op: "send",
                what: "peer",
                rank: peer,
                size: self.ranks.len(),
            });
        }
        let mut st = self.hub.state.lock().unwrap();
        let id = st.next_msg;
        st.next_msg += 1;
        if tag != COLL_TAG && buf.len() > 6 {
            st.log
                .push((self.world_rank(), self.ranks[peer], buf.len()));
        }
        st.mail
            .entry((self.id, self.world_rank(), self.ranks[peer], tag))
            .or_default()
            .push_back((id, buf));
        self.hub.cv.notify_all();
        Ok(id)
    }

    fn wait_consumed(&self, ids: &[u64]) -> Result<()> {
        if !self.hub.rendezvous || ids.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + self.hub.timeout;
        let mut st = self.hub.state.lock().unwrap();
        while !ids.iter().all(|i| st.consumed.contains(i)) {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "send",
                    millis: self.hub.timeout.as_millis() as u64,
                    peer: None,
                });
            }
            st = self.hub.cv.wait_timeout(st, deadline - now).unwrap().0;
        }
        Ok(())
    }

    fn take(&self, peer: usize, tag: u32, buf: BufMut<'_>) -> Result<()> {
        if peer >= self.ranks.len() {
            return Err(Error::PeerOutOfRange {
                op: "recv",
                what: "peer",
                rank: peer,
                size: self.ranks.len(),
            });
        }
        let key = (self.id, self.ranks[peer], self.world_rank(), tag);
        let deadline = Instant::now() + self.hub.timeout;
        let mut st = self.hub.state.lock().unwrap();
        loop {
            if let Some((id, msg)) = st.mail.get_mut(&key).and_then(|q| q.pop_front()) {
                st.consumed.insert(id);
                self.hub.cv.notify_all();
                drop(st);
                let BufMut::Host(mut h) = buf else {
                    return Err(Error::Unsupported {
                        op: "recv",
                        backend: "threads",
                        what: "device memory".into(),
                    });
                };
                if h.len() != msg.len() {
                    return Err(Error::LengthMismatch {
                        op: "recv",
                        what: "receive buffer",
                        expected: msg.len(),
                        actual: h.len(),
                    });
                }
                h.copy_from(msg.as_slice())?;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "recv",
                    millis: self.hub.timeout.as_millis() as u64,
                    peer: Some(self.ranks[peer]),
                });
            }
            st = self.hub.cv.wait_timeout(st, deadline - now).unwrap().0;
        }
    }
}

fn owned(b: BufRef<'_>) -> Result<HostBuffer> {
    match b {
        BufRef::Host(h) => Ok(h.to_owned_buffer()),
        BufRef::Device(_) => Err(Error::Unsupported {
            op: "send",
            backend: "threads",
            what: "device memory".into(),
        }),
    }
}

impl Communicator for ThreadComm {
    fn backend(&self) -> &'static str {
        "threads"
    }
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.ranks.len()
    }
    fn global_ranks(&self) -> &[usize] {
        &self.ranks
    }
    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }
    fn supports(&self, _dtype: DType, op: Option<ReduceOp>) -> bool {
        op.is_none()
    }
    fn all_reduce(&self, _: BufRef<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        Err(unsupported("all_reduce"))
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::PeerOutOfRange {
                op: "broadcast",
                what: "root",
                rank: root,
                size: self.size(),
            });
        }
        if self.me == root {
            let BufMut::Host(h) = buf else {
                return Err(unsupported("broadcast of device memory"));
            };
            let data = h.as_slice().to_owned_buffer();
            let mut ids = Vec::new();
            for p in 0..self.size() {
                if p != root {
                    ids.push(self.post(data.clone(), p, COLL_TAG)?);
                }
            }
            self.wait_consumed(&ids)
        } else {
            self.take(root, COLL_TAG, buf)
        }
    }
    fn all_gather(&self, _: BufRef<'_>, _: BufMut<'_>) -> Result<()> {
        Err(unsupported("all_gather"))
    }
    fn reduce_scatter(&self, _: BufRef<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        Err(unsupported("reduce_scatter"))
    }
    fn all_to_all(&self, _: BufRef<'_>, _: BufMut<'_>) -> Result<()> {
        Err(unsupported("all_to_all"))
    }
    fn barrier(&self) -> Result<()> {
        let mut x = [0u8];
        if self.me == 0 {
            for p in 1..self.size() {
                self.take(p, COLL_TAG - 1, BufMut::from(&mut x[..]))?;
            }
        } else {
            let id = self.post(HostBuffer::U8(vec![0]), 0, COLL_TAG - 1)?;
            self.wait_consumed(&[id])?;
        }
        self.broadcast(BufMut::from(&mut x[..]), 0)
    }
    fn send(&self, buf: BufRef<'_>, peer: usize, tag: u32) -> Result<()> {
        let id = self.post(owned(buf)?, peer, tag)?;
        self.wait_consumed(&[id])
    }
    fn recv(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        self.take(peer, tag, buf)
    }
    fn batch_p2p(&self, ops: Vec<P2pOp<'_>>) -> Result<()> {
        *self
            .hub
            .state
            .lock()
            .unwrap()
            .batches
            .entry(self.world_rank())
            .or_default() += 1;
        let mut ids = Vec::new();
        let mut recvs = Vec::new();
        for op in ops {
            match op {
                P2pOp::Send { buf, peer, tag } => ids.push(self.post(owned(buf)?, peer, tag)?),
                P2pOp::Recv { buf, peer, tag } => recvs.push((buf, peer, tag)),
            }
        }
        for (buf, peer, tag) in recvs {
            self.take(peer, tag, buf)?;
        }
        self.wait_consumed(&ids)
    }
    fn start(&self, request: Request) -> Result<Box<dyn Work>> {
        Err(unsupported(request.name()))
    }
}

fn unsupported(what: &str) -> Error {
    Error::Unsupported {
        op: "threads",
        backend: "threads",
        what: what.to_string(),
    }
}

/// Splits [`ThreadComm`]s.
pub struct ThreadFactory;

impl GroupFactory for ThreadFactory {
    type Comm = ThreadComm;
    fn split(
        &self,
        parent: &ThreadComm,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<ThreadComm>> {
        let seq = parent.splits.fetch_add(1, Ordering::SeqCst);
        let hub = &parent.hub;
        let deadline = Instant::now() + hub.timeout;
        let mut st = hub.state.lock().unwrap();
        let board_key = (parent.id, seq);
        {
            let board = st
                .boards
                .entry(board_key)
                .or_insert_with(|| vec![None; parent.size()]);
            board[parent.me] = Some((color, key));
        }
        hub.cv.notify_all();
        loop {
            let done = st.boards[&board_key].iter().all(Option::is_some);
            if done {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "split",
                    millis: hub.timeout.as_millis() as u64,
                    peer: None,
                });
            }
            st = hub.cv.wait_timeout(st, deadline - now).unwrap().0;
        }
        let Some(c) = color else { return Ok(None) };
        let board: Vec<(Option<u32>, usize)> =
            st.boards[&board_key].iter().map(|x| x.unwrap()).collect();
        let mut members: Vec<(usize, usize)> = board
            .iter()
            .enumerate()
            .filter(|(_, (col, _))| *col == Some(c))
            .map(|(i, (_, k))| (*k, parent.ranks[i]))
            .collect();
        members.sort();
        let mut ranks: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
        ranks.sort();
        let next = st.next_id;
        let id = *st.ids.entry((parent.id, seq, c)).or_insert(next);
        if id == next {
            st.next_id += 1;
        }
        let me = ranks.binary_search(&parent.world_rank()).unwrap();
        Ok(Some(ThreadComm {
            hub: hub.clone(),
            id,
            ranks,
            me,
            splits: AtomicU64::new(0),
        }))
    }
}

/// Runs `body(rank, world)` on `n` threads and returns each rank's result.
pub fn run_world<T: Send>(
    n: usize,
    rendezvous: bool,
    body: impl Fn(usize, Arc<ThreadComm>) -> T + Sync,
) -> (Vec<T>, Arc<Hub>) {
    let hub = Hub::new(Duration::from_secs(10), rendezvous);
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let hub = &hub;
                let body = &body;
                s.spawn(move || body(r, Arc::new(ThreadComm::world(hub, n, r))))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    (out, hub)
}
