//! The wire format and the two primitives every transfer is built from.
//!
//! A message is a header, `[status, dtype, ndim, d0, d1, d2]` as six `i64`s, followed by the
//! payload (skipped when it would be empty or when the status is an error). Headers travel in one
//! `batch_p2p`, payloads in a second one (Megatron exchanges shapes first the same way), so a
//! receiver always knows what to allocate and every exchange is deadlock-free whatever the
//! backend's send protocol. A rank that failed before sending still sends headers with an error
//! status, so its peers fail with [`Error::PeerError`] instead of waiting forever.

use crate::error::{Error, Result};
use crate::tensor::{sub_slice, Activation};
use grid_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, HostBuffer, HostSlice, P2pOp,
};
use std::ops::Range;

pub(crate) const HDR: usize = 6;
const OK: i64 = 0;
const FAILED: i64 = 1;

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I32 => 2,
        DType::I64 => 3,
        DType::U8 => 4,
        DType::F16 => 5,
        DType::BF16 => 6,
    }
}

fn dtype_of(code: i64) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_code(d) == code)
}

/// What one outgoing message carries.
pub(crate) enum OutData<'a> {
    /// Elements `range` of a tensor, shaped `shape` (no copy).
    Slice {
        src: &'a Activation,
        range: Range<usize>,
        shape: Vec<usize>,
    },
    /// An owned tensor.
    Owned(Activation),
    /// The sender failed: an error header and no payload.
    Failed,
}

impl OutData<'_> {
    fn header(&self) -> [i64; HDR] {
        let mut h = [0i64; HDR];
        let (dtype, shape) = match self {
            OutData::Slice { src, shape, .. } => (src.dtype(), shape.as_slice()),
            OutData::Owned(a) => (a.dtype(), a.shape()),
            OutData::Failed => {
                h[0] = FAILED;
                return h;
            }
        };
        h[0] = OK;
        h[1] = dtype_code(dtype);
        h[2] = shape.len() as i64;
        for (k, &s) in shape.iter().take(3).enumerate() {
            h[3 + k] = s as i64;
        }
        h
    }
    fn payload(&self) -> Option<HostSlice<'_>> {
        match self {
            OutData::Slice { src, range, .. } => {
                Some(sub_slice(src.data().as_slice(), range.clone()))
            }
            OutData::Owned(a) => Some(a.data().as_slice()),
            OutData::Failed => None,
        }
    }
    fn into_activation(self) -> Result<Activation> {
        match self {
            OutData::Slice { src, range, shape } => Activation::new(
                shape,
                sub_slice(src.data().as_slice(), range).to_owned_buffer(),
            ),
            OutData::Owned(a) => Ok(a),
            OutData::Failed => Err(Error::Usage {
                op: "exchange",
                message: "internal: a failed message has no data".into(),
            }),
        }
    }
}

/// One outgoing message: world rank of the peer, header tag (the payload uses `tag + 1`).
pub(crate) struct Out<'a> {
    pub peer: usize,
    pub tag: u32,
    pub data: OutData<'a>,
}

/// One expected incoming message.
#[derive(Clone, Copy)]
pub(crate) struct In {
    pub peer: usize,
    pub tag: u32,
}

/// Receive buffers handed back by the user for reuse, so that steady-state transfers do not
/// allocate (and page-fault) a fresh buffer for every message, the way torch's caching allocator
/// spares Megatron. Bounded: at most [`BufferPool::CAPACITY`] buffers are kept.
///
/// ```
/// use multimodule::{Activation, BufferPool};
/// let pool = BufferPool::default();
/// pool.put(Activation::from_vec(vec![4], vec![1.0f32; 4]).unwrap());
/// assert_eq!(pool.len(), 1);
/// assert_eq!(pool.take(grid_core::DType::F32, 4).len(), 4);
/// assert_eq!(pool.len(), 0);
/// ```
#[derive(Debug, Default)]
pub struct BufferPool {
    free: std::sync::Mutex<Vec<HostBuffer>>,
}

impl BufferPool {
    /// Most buffers kept.
    pub const CAPACITY: usize = 16;
    /// Keeps `t`'s buffer for a later receive of the same dtype and length.
    pub fn put(&self, t: Activation) {
        if let Ok(mut f) = self.free.lock() {
            if f.len() >= Self::CAPACITY {
                f.remove(0);
            }
            f.push(t.into_data());
        }
    }
    /// A buffer of `len` elements of `dtype`: a recycled one if any fits, else a new one (its
    /// contents are unspecified; receives overwrite all of it).
    pub fn take(&self, dtype: DType, len: usize) -> HostBuffer {
        if let Ok(mut f) = self.free.lock() {
            if let Some(i) = f.iter().position(|b| b.dtype() == dtype && b.len() == len) {
                return f.swap_remove(i);
            }
        }
        HostBuffer::zeros(dtype, len)
    }
    /// Number of buffers kept.
    pub fn len(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }
    /// True when no buffer is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Point-to-point and broadcast over one parent communicator, addressed by world rank.
pub(crate) struct Wire<'a, C: Communicator + ?Sized> {
    pub comm: &'a C,
    pub me: usize,
    pub op: &'static str,
    pub pool: Option<&'a BufferPool>,
}

impl<C: Communicator + ?Sized> Wire<'_, C> {
    fn alloc(&self, dtype: DType, len: usize) -> HostBuffer {
        match self.pool {
            Some(p) => p.take(dtype, len),
            None => HostBuffer::zeros(dtype, len),
        }
    }
}

impl<C: Communicator + ?Sized> Wire<'_, C> {
    fn prank(&self, world: usize) -> Result<usize> {
        self.comm.global_ranks().binary_search(&world).map_err(|_| Error::Usage {
            op: self.op,
            message: format!(
                "rank {world} is not a member of the {} communicator the pipeline was built on (members {:?}…)",
                self.comm.backend(),
                &self.comm.global_ranks()[..self.comm.global_ranks().len().min(8)]
            ),
        })
    }

    /// Sends `outs` and receives `ins` (results in `ins` order). Messages to this rank itself
    /// are handed over locally, matched by tag in order.
    pub fn exchange(&self, outs: Vec<Out<'_>>, ins: &[In]) -> Result<Vec<Result<Activation>>> {
        let me = self.me;
        // Round 1: headers.
        let out_hdr: Vec<[i64; HDR]> = outs.iter().map(|o| o.data.header()).collect();
        let mut in_hdr: Vec<[i64; HDR]> = vec![[0; HDR]; ins.len()];
        {
            let mut ops = Vec::new();
            for (o, h) in outs.iter().zip(&out_hdr) {
                if o.peer != me {
                    ops.push(P2pOp::Send {
                        buf: BufRef::from(&h[..]),
                        peer: self.prank(o.peer)?,
                        tag: o.tag,
                    });
                }
            }
            for (i, h) in ins.iter().zip(in_hdr.iter_mut()) {
                if i.peer != me {
                    ops.push(P2pOp::Recv {
                        buf: BufMut::from(&mut h[..]),
                        peer: self.prank(i.peer)?,
                        tag: i.tag,
                    });
                }
            }
            if !ops.is_empty() {
                self.comm.batch_p2p(ops)?;
            }
        }
        // Decode the received headers and allocate.
        let mut results: Vec<Option<Result<Activation>>> = Vec::with_capacity(ins.len());
        let mut bufs: Vec<Option<(Vec<usize>, HostBuffer)>> = Vec::with_capacity(ins.len());
        for (i, h) in ins.iter().zip(&in_hdr) {
            if i.peer == me {
                results.push(None);
                bufs.push(None);
                continue;
            }
            match self.decode(i.peer, h) {
                Ok((dtype, shape)) => {
                    let n: usize = shape.iter().product();
                    bufs.push(Some((shape, self.alloc(dtype, n))));
                    results.push(None);
                }
                Err(e) => {
                    bufs.push(None);
                    results.push(Some(Err(e)));
                }
            }
        }
        // Round 2: payloads.
        {
            let mut ops = Vec::new();
            for (o, h) in outs.iter().zip(&out_hdr) {
                if o.peer == me || h[0] != OK {
                    continue;
                }
                if let Some(p) = o.data.payload() {
                    if !p.is_empty() {
                        ops.push(P2pOp::Send {
                            buf: BufRef::Host(p),
                            peer: self.prank(o.peer)?,
                            tag: o.tag + 1,
                        });
                    }
                }
            }
            for (i, b) in ins.iter().zip(bufs.iter_mut()) {
                if let Some((_, buf)) = b {
                    if !buf.is_empty() {
                        ops.push(P2pOp::Recv {
                            buf: BufMut::Host(buf.as_mut_slice()),
                            peer: self.prank(i.peer)?,
                            tag: i.tag + 1,
                        });
                    }
                }
            }
            if !ops.is_empty() {
                self.comm.batch_p2p(ops)?;
            }
        }
        // Local hand-over of messages to self, matched by tag in order.
        let mut own: Vec<Option<Out<'_>>> = outs
            .into_iter()
            .filter(|o| o.peer == me)
            .map(Some)
            .collect();
        let mut out = Vec::with_capacity(ins.len());
        for ((i, r), b) in ins.iter().zip(results).zip(bufs) {
            if let Some(r) = r {
                out.push(r);
            } else if let Some((shape, buf)) = b {
                out.push(Activation::new(shape, buf));
            } else {
                let slot = own
                    .iter_mut()
                    .find(|o| o.as_ref().is_some_and(|o| o.tag == i.tag));
                match slot.and_then(Option::take) {
                    Some(o) => match o.data {
                        OutData::Failed => out.push(Err(Error::PeerError { op: self.op, peer: me })),
                        data => out.push(data.into_activation()),
                    },
                    None => {
                        return Err(Error::Usage {
                            op: self.op,
                            message: format!(
                                "rank {me} expects a message from itself (tag {}) but sends none: on a rank that holds both ends of a bridge, give the sending side's tensor in the same call",
                                i.tag
                            ),
                        })
                    }
                }
            }
        }
        Ok(out)
    }

    fn decode(&self, peer: usize, h: &[i64; HDR]) -> Result<(DType, Vec<usize>)> {
        if h[0] == FAILED {
            return Err(Error::PeerError { op: self.op, peer });
        }
        let bad = |m: String| Error::Protocol {
            op: self.op,
            peer,
            message: m,
        };
        if h[0] != OK {
            return Err(bad(format!("status {}", h[0])));
        }
        let dtype = dtype_of(h[1]).ok_or_else(|| bad(format!("unknown dtype code {}", h[1])))?;
        let ndim = h[2];
        if !(0..=3).contains(&ndim) {
            return Err(bad(format!("{ndim} dimensions")));
        }
        let mut shape = Vec::with_capacity(ndim as usize);
        for &d in &h[3..3 + ndim as usize] {
            if d < 0 {
                return Err(bad(format!("negative size {d}")));
            }
            shape.push(d as usize);
        }
        Ok((dtype, shape))
    }
}

/// Broadcasts `mine` (meaningful on the root, `leader` in world ranks) over `comm` (a group
/// whose members are `group`, ascending). Returns the tensor everywhere, or the root's failure.
/// `comm = None` means the group is this rank alone.
pub(crate) fn distribute<C: Communicator + ?Sized>(
    pool: Option<&BufferPool>,
    op: &'static str,
    comm: Option<&C>,
    group: &[usize],
    me: usize,
    leader: usize,
    mine: Option<Result<Activation>>,
) -> Result<Activation> {
    let Some(comm) = comm else {
        return mine.unwrap_or_else(|| {
            Err(Error::Usage {
                op,
                message: format!("rank {me} has no data and no broadcast group"),
            })
        });
    };
    let root = group
        .iter()
        .position(|&r| r == leader)
        .ok_or_else(|| Error::Usage {
            op,
            message: format!("leader {leader} is not in broadcast group {group:?}"),
        })?;
    if me == leader {
        let mine = mine.unwrap_or_else(|| {
            Err(Error::Usage {
                op,
                message: "internal: the leader has nothing to broadcast".into(),
            })
        });
        let mut h = match &mine {
            Ok(a) => OutData::Slice {
                src: a,
                range: 0..0,
                shape: a.shape().to_vec(),
            }
            .header(),
            Err(_) => OutData::Failed.header(),
        };
        comm.broadcast_into(&mut h[..], root)?;
        let mut a = mine?;
        if a.numel() > 0 {
            comm.broadcast(BufMut::Host(a.data_mut()), root)?;
        }
        Ok(a)
    } else {
        let mut h = [0i64; HDR];
        comm.broadcast_into(&mut h[..], root)?;
        let w = Wire { comm, me, op, pool };
        let (dtype, shape) = w.decode(leader, &h).map_err(|e| match e {
            Error::Protocol { .. } => e,
            _ => Error::PeerError { op, peer: leader },
        })?;
        let n = shape.iter().product();
        let mut a = Activation::new(shape, w.alloc(dtype, n))?;
        if a.numel() > 0 {
            comm.broadcast(BufMut::Host(a.data_mut()), root)?;
        }
        Ok(a)
    }
}
