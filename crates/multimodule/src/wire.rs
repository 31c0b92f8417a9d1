//! The wire format and the two primitives every transfer is built from.
//!
//! A message is a header, `[status, dtype, ndim, d0, d1, d2]` as six `i64`s, and a payload
//! (skipped when it would be empty or when the status is an error). A rank that failed before
//! sending still sends headers with an error status (and, where its peer expects a payload in
//! the same round, a placeholder of the expected size), so its peers fail with
//! [`Error::PeerError`] instead of waiting forever or taking garbage for data.
//!
//! Two ways a payload travels, chosen per message by what the receiver knows in advance:
//! * **shape unknown** (a channel's first messages): the receiver takes the headers in one
//!   `batch_p2p` and the payloads in a second one (Megatron exchanges shapes first the same way),
//!   so it knows what to allocate. A rank that receives nothing from another rank in the
//!   exchange (a pure sender) posts such payloads in its first round, right behind their
//!   headers, so only the receiver pays the second round; a rank that also receives sends them
//!   in its second round.
//! * **shape expected**, once a channel's (one peer's and message kind's) history has set the
//!   expectation on both ends (static and learned shapes: after its first message; variable
//!   shapes: once the same shape came twice in a row): header and payload travel in the
//!   **same** `batch_p2p`, as one framed message ([`P2pOp::SendFramed`]: one message on Gloo,
//!   no message of its own for the header), the payload straight into a buffer of the
//!   expected size; the header is checked afterwards. If the sender's tensor no longer has the expected shape, it sends
//!   status `RESEND` and a placeholder, and the real payload follows (in the receiver's second
//!   round; only that message pays it).
//!
//! Every exchange is deadlock-free whatever the backend's send protocol: each round is one
//! `batch_p2p` on every rank, and both ends of a message agree on which round its payload uses
//! (a pure sender's first round holds the payloads its receivers take in their second: it
//! waits for them, but nothing waits for its own second round, since it has none).
//!
//! Receives of several messages meant to be concatenated along one dimension (a fan-in) go
//! straight into their slices of one output buffer when the parts are contiguous in it; no
//! concatenation copy.

use crate::error::{Error, Result};
use crate::pool::BufferPool;
use crate::tensor::{chunks_mut, sub_slice, Activation};
use grid_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, HostBuffer, HostSlice, HostSliceMut,
    P2pOp,
};
use std::ops::Range;

pub(crate) const HDR: usize = 6;
const OK: i64 = 0;
const FAILED: i64 = 1;
/// The payload in the header's round was a placeholder; the real one follows in the next round.
const RESEND: i64 = 2;

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I32 => 2,
        DType::I64 => 3,
        DType::U8 => 4,
        DType::F16 => 5,
        DType::BF16 => 6,
        DType::I8 => 7,
        DType::U32 => 8,
        DType::U64 => 9,
        DType::Bool => 10,
        DType::F8E4M3 => 11,
        DType::F8E5M2 => 12,
    }
}

fn dtype_of(code: i64) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_code(d) == code)
}

/// How the receiving end of a bridge (or of a pipeline stage) learns the shape of what comes, and
/// so whether a transfer pays a header round trip before its payload (Megatron's
/// `variable_seq_lengths`). Every rank of a bridge (both grids) or of a module must use the same
/// mode; set it before the first transfer, or between transfers on every rank alike.
///
/// ```
/// use grid_core::DType;
/// use multimodule::ShapeMode;
/// assert_eq!(ShapeMode::default(), ShapeMode::Variable);
/// // Megatron's `variable_seq_lengths = False`: every micro-batch's activation is [4, 128, 1024].
/// let fixed = ShapeMode::Static { shape: vec![4, 128, 1024], dtype: DType::BF16 };
/// assert_ne!(fixed, ShapeMode::Learned);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ShapeMode {
    /// Shapes may change from message to message (the default; Megatron's
    /// `variable_seq_lengths = True`). While a channel's (peer's and message kind's) shape
    /// repeats, the receiver expects it: once the same shape came twice in a row, header and
    /// payload travel in one round, no header round trip. Otherwise each message goes header
    /// first (the receiver takes the header, then the payload: one round trip). A shape that
    /// breaks a repeat costs one placeholder of the expected size and a second round for that
    /// message; shapes that keep changing never do (they are never expected). This holds for
    /// bridges; the pipeline communicator's messages between the stages of one module send
    /// every header first in this mode.
    #[default]
    Variable,
    /// Every activation handed to the sending side has this shape and dtype (for a bridge: what
    /// each rank at the source's last stage passes to `send_forward`, i.e. the per-rank tensor
    /// when the source has cp > 1). A header travels **with** its payload in one round, no
    /// round trip, except on each channel's (peer's and message kind's) first message, which
    /// goes header first: both ends then know the size for sure, so ranks that declared
    /// different shapes get a clear error instead of a length mismatch in the backend. A
    /// tensor of another shape or dtype is [`crate::Error::StaticShape`] on its sender before
    /// anything of it is sent, and its peers get [`crate::Error::PeerError`] (never a hang,
    /// never misread data); a received part whose shape differs from what this rank's declared
    /// shape gives (with the same `tensor_split` rule the senders use) is
    /// [`crate::Error::Protocol`]. Per-sample split sizes that differ from the `tensor_split`
    /// rule are rejected on the sender too.
    Static {
        /// The activation shape.
        shape: Vec<usize>,
        /// The element type.
        dtype: DType,
    },
    /// Explicit opt-in: the first message on each channel (one peer and message kind) carries
    /// its shape as in `Variable`; later messages are expected with the same shape and travel
    /// with their header, without the round trip. A message whose shape changed still arrives
    /// correctly: it sends a placeholder and then the real payload (one extra round for that
    /// message), and the new shape is expected from then on.
    Learned,
}

/// The shape of the last message on each channel, both directions ([`ShapeMode::Learned`] and
/// [`ShapeMode::Static`]; with `repeats_only`, [`ShapeMode::Variable`]). Both ends of a channel
/// update it from the same headers, so they agree on what to expect.
#[derive(Debug, Default)]
pub(crate) struct ShapeCache {
    sent: std::collections::HashMap<(usize, u32), Seen>,
    received: std::collections::HashMap<(usize, u32), Seen>,
    /// Expect a channel's shape only once it came twice in a row ([`ShapeMode::Variable`]: a
    /// channel whose shapes keep changing never pays a placeholder, one whose shape repeats
    /// pays no header round trip).
    repeats_only: bool,
}

/// The last shape seen on a channel, and whether the one before it was the same.
#[derive(Debug)]
struct Seen {
    meta: Meta,
    repeated: bool,
}

impl ShapeCache {
    /// The cache a bridge in `mode` uses.
    pub fn for_mode(mode: &ShapeMode) -> ShapeCache {
        ShapeCache {
            repeats_only: matches!(mode, ShapeMode::Variable),
            ..ShapeCache::default()
        }
    }

    /// Forgets the channels with a tag in `tags` (both directions).
    pub fn forget(&mut self, tags: Range<u32>) {
        self.sent.retain(|k, _| !tags.contains(&k.1));
        self.received.retain(|k, _| !tags.contains(&k.1));
    }

    fn expect(&self, sent: bool, key: (usize, u32)) -> Option<Meta> {
        let map = if sent { &self.sent } else { &self.received };
        map.get(&key)
            .filter(|s| s.repeated || !self.repeats_only)
            .map(|s| s.meta.clone())
    }

    fn record(&mut self, sent: bool, key: (usize, u32), meta: Meta) {
        let map = if sent {
            &mut self.sent
        } else {
            &mut self.received
        };
        let repeated = map.get(&key).is_some_and(|s| s.meta == meta);
        map.insert(key, Seen { meta, repeated });
    }
}

/// The element type and shape of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Meta {
    pub fn new(dtype: DType, shape: Vec<usize>) -> Meta {
        Meta { dtype, shape }
    }
    pub fn of(t: &Activation) -> Meta {
        Meta::new(t.dtype(), t.shape().to_vec())
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn header(&self, status: i64) -> [i64; HDR] {
        let mut h = [0i64; HDR];
        h[0] = status;
        h[1] = dtype_code(self.dtype);
        h[2] = self.shape.len() as i64;
        for (k, &s) in self.shape.iter().take(3).enumerate() {
            h[3 + k] = s as i64;
        }
        h
    }
}

impl std::fmt::Display for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.dtype, self.shape)
    }
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
    /// Dtype and shape (`None` for a failure).
    pub fn meta(&self) -> Option<Meta> {
        match self {
            OutData::Slice { src, shape, .. } => Some(Meta::new(src.dtype(), shape.clone())),
            OutData::Owned(a) => Some(Meta::of(a)),
            OutData::Failed => None,
        }
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
    fn into_activation(self, pool: Option<&BufferPool>) -> Result<Activation> {
        match self {
            OutData::Slice { src, range, shape } => {
                let from = sub_slice(src.data().as_slice(), range);
                let mut buf = match pool {
                    Some(p) => p.take(from.dtype(), from.len()),
                    None => HostBuffer::zeros(from.dtype(), from.len()),
                };
                buf.as_mut_slice().copy_from(from)?;
                Activation::new(shape, buf)
            }
            OutData::Owned(a) => Ok(a),
            OutData::Failed => Err(Error::Usage {
                op: "exchange",
                message: "internal: a failed message has no data".into(),
            }),
        }
    }
}

/// One outgoing message: world rank of the peer, header tag (a payload sent apart from its
/// header uses `tag + 1`, as does one framed with it on a backend that sends two messages), and
/// what the receiver expects if it knows the shape in advance (then the payload travels in the
/// header's round; see the module docs).
pub(crate) struct Out<'a> {
    pub peer: usize,
    pub tag: u32,
    pub data: OutData<'a>,
    pub expect: Option<Meta>,
}

/// One expected incoming message, with its shape if this rank knows it in advance (`expect`:
/// the sender must then know it too, as both ends do from a channel's history), and the shape
/// it must have (`verify`: a static shape; another one is an error once received).
#[derive(Clone)]
pub(crate) struct In {
    pub peer: usize,
    pub tag: u32,
    pub expect: Option<Meta>,
    pub verify: Option<Meta>,
}

/// Consecutive `ins` to be returned as one tensor, concatenated along `dim` in order.
pub(crate) struct Join {
    pub ins: Range<usize>,
    pub dim: usize,
}

/// One received message: its dtype and shape, and its data unless it went into a join.
pub(crate) struct Part {
    pub meta: Meta,
    pub data: Option<Activation>,
}

/// What [`Wire::exchange`] received.
pub(crate) struct Exchanged {
    /// Per `In`, in order.
    pub parts: Vec<Result<Part>>,
    /// Per `Join`, in order: the concatenation, or the first failure among its parts.
    pub joined: Vec<Result<Activation>>,
}

impl Exchanged {
    /// The received tensors, for exchanges without joins.
    pub fn into_tensors(self) -> Vec<Result<Activation>> {
        self.parts
            .into_iter()
            .map(|p| {
                p.and_then(|p| {
                    p.data.ok_or_else(|| Error::Usage {
                        op: "exchange",
                        message: "internal: a joined part has no data of its own".into(),
                    })
                })
            })
            .collect()
    }
}

/// Point-to-point and broadcast over one parent communicator, addressed by world rank.
pub(crate) struct Wire<'a, C: Communicator + ?Sized> {
    pub comm: &'a C,
    pub me: usize,
    pub op: &'static str,
    pub pool: Option<&'a BufferPool>,
}

/// When a sender's payload travels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pay {
    /// No payload (failure without an expectation, or a message to this rank itself).
    No,
    /// The tensor, in the header's round.
    Now,
    /// A placeholder of the expected size in the header's round (failure or changed shape).
    Placeholder,
}

/// Bytes of a header sent framed with its payload (little-endian `i64`s).
const HDR_BYTES: usize = HDR * 8;

fn header_bytes(h: &[i64; HDR]) -> [u8; HDR_BYTES] {
    let mut b = [0u8; HDR_BYTES];
    for (chunk, v) in b.chunks_exact_mut(8).zip(h) {
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    b
}

fn header_of_bytes(b: &[u8; HDR_BYTES]) -> [i64; HDR] {
    let mut h = [0i64; HDR];
    for (v, chunk) in h.iter_mut().zip(b.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *v = i64::from_le_bytes(word);
    }
    h
}

fn failed_header() -> [i64; HDR] {
    let mut h = [0i64; HDR];
    h[0] = FAILED;
    h
}

/// The dtype and shape of `metas` concatenated along `dim`, if they fit together **and** each
/// part is one contiguous block of the result (so it can be received in place).
fn joinable<'m>(metas: impl Iterator<Item = &'m Meta>, dim: usize) -> Option<Meta> {
    let metas: Vec<&Meta> = metas.collect();
    let first = metas.first()?;
    if metas.iter().any(|m| m.dtype != first.dtype) {
        return None;
    }
    let shapes: Vec<&[usize]> = metas.iter().map(|m| m.shape.as_slice()).collect();
    let shape = Activation::concat_shape(&shapes, dim)?;
    let outer: usize = shape[..dim].iter().product();
    (metas.len() == 1 || outer == 1).then(|| Meta::new(first.dtype, shape))
}

impl<C: Communicator + ?Sized> Wire<'_, C> {
    /// A receive buffer: from the pool if there is one, placed where the communicator's
    /// transport receives at full speed ([`Communicator::receive_placement`]).
    fn alloc(&self, dtype: DType, len: usize) -> HostBuffer {
        let placement = self.comm.receive_placement();
        match self.pool {
            Some(p) => p.take_placed(dtype, len, placement.as_ref()),
            None => crate::pool::new_buffer(dtype, len, placement.as_ref()),
        }
    }

    fn give_back(&self, b: HostBuffer) {
        if let Some(p) = self.pool {
            p.put_buffer(b);
        }
    }

    fn internal(&self, what: &str) -> Error {
        Error::Usage {
            op: self.op,
            message: format!("internal: {what}"),
        }
    }

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

    /// Sends `outs` and receives `ins`; `joins` name runs of `ins` to be returned concatenated.
    /// Messages to this rank itself are handed over locally, matched by tag in order.
    ///
    /// At most two `batch_p2p` rounds: headers with the payloads whose shape the receiver
    /// expects, then the other payloads (skipped when there are none on this rank).
    ///
    /// With a `cache` ([`ShapeMode::Learned`]), messages without an expected shape get the last
    /// shape of their channel, and the cache learns what went through.
    pub fn exchange(
        &self,
        mut outs: Vec<Out<'_>>,
        ins: &[In],
        joins: &[Join],
        cache: Option<&mut ShapeCache>,
    ) -> Result<Exchanged> {
        let me = self.me;
        let n = ins.len();
        let learned_ins: Vec<In>;
        let ins: &[In] = match cache.as_deref() {
            Some(c) => {
                for o in outs
                    .iter_mut()
                    .filter(|o| o.peer != me && o.expect.is_none())
                {
                    o.expect = c.expect(true, (o.peer, o.tag));
                }
                learned_ins = ins
                    .iter()
                    .map(|i| In {
                        expect: i.expect.clone().or_else(|| {
                            (i.peer != me)
                                .then(|| c.expect(false, (i.peer, i.tag)))
                                .flatten()
                        }),
                        ..i.clone()
                    })
                    .collect();
                &learned_ins
            }
            None => ins,
        };
        let sent_metas: Vec<(usize, u32, Meta)> = outs
            .iter()
            .filter(|o| o.peer != me)
            .filter_map(|o| Some((o.peer, o.tag, o.data.meta()?)))
            .collect();
        let mut join_of: Vec<Option<usize>> = vec![None; n];
        for (j, jn) in joins.iter().enumerate() {
            for k in jn.ins.clone() {
                match join_of.get_mut(k) {
                    Some(slot @ None) => *slot = Some(j),
                    _ => return Err(self.internal("overlapping or out-of-range join")),
                }
            }
        }

        // ----- sender plan --------------------------------------------------------------------
        let mut out_hdr: Vec<[i64; HDR]> = Vec::with_capacity(outs.len());
        let mut first: Vec<Pay> = Vec::with_capacity(outs.len());
        let mut second: Vec<bool> = Vec::with_capacity(outs.len());
        let mut placeholders: Vec<Option<HostBuffer>> = Vec::with_capacity(outs.len());
        for o in &outs {
            let meta = o.data.meta();
            let (h, p1, p2, ph) = match (&o.expect, &meta) {
                _ if o.peer == me => ([0; HDR], Pay::No, false, None),
                (Some(e), Some(m)) if m == e => (m.header(OK), Pay::Now, false, None),
                (Some(e), Some(m)) => (m.header(RESEND), Pay::Placeholder, true, Some(e)),
                (Some(e), None) => (failed_header(), Pay::Placeholder, false, Some(e)),
                (None, Some(m)) => (m.header(OK), Pay::No, true, None),
                (None, None) => (failed_header(), Pay::No, false, None),
            };
            out_hdr.push(h);
            first.push(p1);
            second.push(p2);
            placeholders.push(
                ph.filter(|e| e.numel() > 0)
                    .map(|e| self.alloc(e.dtype, e.numel())),
            );
        }

        // ----- receiver plan ------------------------------------------------------------------
        // A join is received in place in round 1 if every part's shape is expected and the
        // parts fit; otherwise it may still be received in place in round 2 (decided once the
        // headers are in), else part by part and copied.
        let mut jmeta: Vec<Option<Meta>> = Vec::with_capacity(joins.len());
        let mut jround: Vec<u8> = vec![0; joins.len()];
        let mut jbuf: Vec<Option<HostBuffer>> = Vec::with_capacity(joins.len());
        let mut jlens: Vec<Vec<usize>> = Vec::with_capacity(joins.len());
        for (j, jn) in joins.iter().enumerate() {
            let members = &ins[jn.ins.clone()];
            let eager = members.iter().all(|i| i.peer != me && i.expect.is_some());
            let m = if eager {
                joinable(members.iter().filter_map(|i| i.expect.as_ref()), jn.dim)
            } else {
                None
            };
            match m {
                Some(m) => {
                    jround[j] = 1;
                    jbuf.push(Some(self.alloc(m.dtype, m.numel())));
                    jlens.push(
                        members
                            .iter()
                            .filter_map(|i| i.expect.as_ref().map(Meta::numel))
                            .collect(),
                    );
                    jmeta.push(Some(m));
                }
                None => {
                    jbuf.push(None);
                    jlens.push(Vec::new());
                    jmeta.push(None);
                }
            }
        }
        let mut dest: Vec<Option<HostBuffer>> = Vec::with_capacity(n);
        for (k, i) in ins.iter().enumerate() {
            let in_place = join_of[k].is_some_and(|j| jround[j] == 1);
            dest.push(match &i.expect {
                Some(e) if i.peer != me && !in_place => Some(self.alloc(e.dtype, e.numel())),
                _ => None,
            });
        }

        // A rank that receives nothing from another rank in this exchange (a pure sender) posts
        // its header-first payloads in round 1 too, after its other messages: its receivers
        // still take the header before posting the payload's receive (their round 2), but
        // nothing here waits for the header to arrive before the payload is on its way. No
        // cycle: such a rank's round 1 waits for its receivers' round 2, and their round 1
        // never waits for this rank (it receives nothing, so no round 2 of its own is needed).
        // Ranks that also receive keep the two rounds (two ranks sending payloads eagerly to
        // each other while each waits for the other's header would deadlock).
        let eager = ins.iter().all(|i| i.peer == me);

        // ----- round 1: headers, and the payloads whose shape is expected -------------------
        // Each header with its payload, in the order the receivers post their receives (also
        // for backends that match by order alone); a pure sender's late payloads after all of
        // them, as its receivers post those in their second round (a resend's placeholder
        // before its real payload).
        // A header with a payload travels framed: one message where the backend can
        // (`P2pOp::SendFramed`; elsewhere the header on `tag` and the payload on `tag + 1`, as
        // plain messages do). Both ends frame a message alike: a sender sends a payload in this
        // round exactly when its receiver expects one (the same expected shape on both ends).
        let out_bytes: Vec<[u8; HDR_BYTES]> = out_hdr.iter().map(header_bytes).collect();
        let mut in_hdr: Vec<[i64; HDR]> = vec![[0; HDR]; n];
        let mut in_bytes: Vec<[u8; HDR_BYTES]> = vec![[0; HDR_BYTES]; n];
        let mut framed_in: Vec<bool> = vec![false; n];
        {
            let mut ops = Vec::new();
            let mut eager_ops = Vec::new();
            for (k, o) in outs.iter().enumerate() {
                if o.peer == me {
                    continue;
                }
                let peer = self.prank(o.peer)?;
                let payload = match first[k] {
                    Pay::Now => o.data.payload(),
                    Pay::Placeholder => placeholders[k].as_ref().map(HostBuffer::as_slice),
                    Pay::No => None,
                };
                match payload.filter(|p| !p.is_empty()) {
                    Some(p) => ops.push(P2pOp::SendFramed {
                        head: &out_bytes[k][..],
                        buf: BufRef::Host(p),
                        peer,
                        tag: o.tag,
                    }),
                    None => ops.push(P2pOp::Send {
                        buf: BufRef::from(&out_hdr[k][..]),
                        peer,
                        tag: o.tag,
                    }),
                }
                // A payload its receiver takes in its round 2 (its shape was unknown there, or
                // a placeholder went first).
                if eager && second[k] {
                    if let Some(p) = o.data.payload().filter(|p| !p.is_empty()) {
                        eager_ops.push(P2pOp::Send {
                            buf: BufRef::Host(p),
                            peer,
                            tag: o.tag + 1,
                        });
                    }
                }
            }
            ops.append(&mut eager_ops);
            if eager {
                second.iter_mut().for_each(|s| *s = false);
            }
            let mut slots: Vec<Vec<Option<HostSliceMut<'_>>>> = jbuf
                .iter_mut()
                .zip(&jlens)
                .map(|(b, lens)| match b {
                    Some(b) => chunks_mut(b.as_mut_slice(), lens)
                        .into_iter()
                        .map(Some)
                        .collect(),
                    None => Vec::new(),
                })
                .collect();
            for (k, (i, ((h, hb), d))) in ins
                .iter()
                .zip(
                    in_hdr
                        .iter_mut()
                        .zip(in_bytes.iter_mut())
                        .zip(dest.iter_mut()),
                )
                .enumerate()
            {
                if i.peer == me {
                    continue;
                }
                let peer = self.prank(i.peer)?;
                let target = match (&i.expect, join_of[k]) {
                    (None, _) => None,
                    (Some(_), Some(j)) if jround[j] == 1 => slots[j]
                        .get_mut(k - joins[j].ins.start)
                        .and_then(Option::take),
                    (Some(_), _) => d.as_mut().map(HostBuffer::as_mut_slice),
                };
                match target.filter(|t| !t.is_empty()) {
                    Some(t) => {
                        framed_in[k] = true;
                        ops.push(P2pOp::RecvFramed {
                            head: &mut hb[..],
                            buf: BufMut::Host(t),
                            peer,
                            tag: i.tag,
                        });
                    }
                    None => ops.push(P2pOp::Recv {
                        buf: BufMut::from(&mut h[..]),
                        peer,
                        tag: i.tag,
                    }),
                }
            }
            if !ops.is_empty() {
                self.comm.batch_p2p(ops)?;
            }
        }
        for ((h, hb), _) in in_hdr
            .iter_mut()
            .zip(&in_bytes)
            .zip(&framed_in)
            .filter(|(_, &framed)| framed)
        {
            *h = header_of_bytes(hb);
        }
        for b in placeholders.into_iter().flatten() {
            self.give_back(b);
        }

        // ----- decode the headers -------------------------------------------------------------
        let mut metas: Vec<Option<Meta>> = vec![None; n];
        let mut errs: Vec<Option<Error>> = vec![None; n];
        // Shapes that arrived (for the channel cache, whatever this rank thinks of them), and
        // static-shape violations (reported once the payload is in, so the sender is not left
        // waiting).
        let mut arrived: Vec<(usize, u32, Meta)> = Vec::new();
        let mut vfail: Vec<Option<Error>> = vec![None; n];
        let mut late: Vec<bool> = vec![false; n];
        let mut broken: Vec<bool> = vec![false; joins.len()];
        for (k, i) in ins.iter().enumerate() {
            if i.peer == me {
                continue;
            }
            let decoded = self.decode(i.peer, &in_hdr[k]);
            if let Ok((_, m)) = &decoded {
                arrived.push((i.peer, i.tag, m.clone()));
                if let Some(v) = i.verify.as_ref().filter(|v| *v != m) {
                    vfail[k] = Some(Error::Protocol {
                        op: self.op,
                        peer: i.peer,
                        message: format!(
                            "it sent {m} where this rank's static shape gives {v}: declare the same static shape on every rank"
                        ),
                    });
                }
            }
            match (decoded, &i.expect) {
                (Err(e), _) => errs[k] = Some(e),
                (Ok((OK, m)), Some(e)) if m != *e => {
                    errs[k] = Some(Error::Protocol {
                        op: self.op,
                        peer: i.peer,
                        message: format!(
                            "it sent {m} where this rank expected {e}: give every rank the same static shape"
                        ),
                    })
                }
                (Ok((OK, m)), e) => {
                    late[k] = e.is_none();
                    metas[k] = Some(m);
                }
                (Ok((_, m)), Some(_)) => {
                    // RESEND: the payload that came was a placeholder.
                    late[k] = true;
                    metas[k] = Some(m);
                    if let Some(b) = dest[k].take() {
                        self.give_back(b);
                    }
                    if let Some(j) = join_of[k] {
                        broken[j] = true;
                    }
                }
                (Ok(_), None) => {
                    errs[k] = Some(Error::Protocol {
                        op: self.op,
                        peer: i.peer,
                        message: "a resend on a channel without an expected shape".into(),
                    })
                }
            }
        }
        for (j, jn) in joins.iter().enumerate() {
            if jround[j] != 0 {
                continue;
            }
            let all_late = jn.ins.clone().all(|k| late[k] && errs[k].is_none());
            if let Some(m) = all_late
                .then(|| joinable(jn.ins.clone().filter_map(|k| metas[k].as_ref()), jn.dim))
                .flatten()
            {
                jround[j] = 2;
                jbuf[j] = Some(self.alloc(m.dtype, m.numel()));
                jlens[j] = jn
                    .ins
                    .clone()
                    .filter_map(|k| metas[k].as_ref().map(Meta::numel))
                    .collect();
                jmeta[j] = Some(m);
            }
        }
        for k in 0..n {
            let in_place = join_of[k].is_some_and(|j| jround[j] == 2);
            if late[k] && !in_place {
                if let Some(m) = &metas[k] {
                    dest[k] = Some(self.alloc(m.dtype, m.numel()));
                }
            }
        }

        // ----- round 2: the other payloads ------------------------------------------------------
        {
            let mut ops = Vec::new();
            for (k, o) in outs.iter().enumerate() {
                if !second[k] {
                    continue;
                }
                if let Some(p) = o.data.payload().filter(|p| !p.is_empty()) {
                    ops.push(P2pOp::Send {
                        buf: BufRef::Host(p),
                        peer: self.prank(o.peer)?,
                        tag: o.tag + 1,
                    });
                }
            }
            let mut slots: Vec<Vec<Option<HostSliceMut<'_>>>> = jbuf
                .iter_mut()
                .zip(&jlens)
                .zip(&jround)
                .map(|((b, lens), &r)| match b {
                    Some(b) if r == 2 => chunks_mut(b.as_mut_slice(), lens)
                        .into_iter()
                        .map(Some)
                        .collect(),
                    _ => Vec::new(),
                })
                .collect();
            for (k, (i, d)) in ins.iter().zip(dest.iter_mut()).enumerate() {
                if !late[k] {
                    continue;
                }
                let target = match join_of[k] {
                    Some(j) if jround[j] == 2 => slots[j]
                        .get_mut(k - joins[j].ins.start)
                        .and_then(Option::take),
                    _ => d.as_mut().map(HostBuffer::as_mut_slice),
                };
                if let Some(t) = target.filter(|t| !t.is_empty()) {
                    ops.push(P2pOp::Recv {
                        buf: BufMut::Host(t),
                        peer: self.prank(i.peer)?,
                        tag: i.tag + 1,
                    });
                }
            }
            if !ops.is_empty() {
                self.comm.batch_p2p(ops)?;
            }
        }

        for (e, v) in errs.iter_mut().zip(vfail) {
            if e.is_none() {
                *e = v;
            }
        }

        // ----- hand-over of messages to this rank itself; sent buffers back to the pool -------
        let mut own: Vec<Option<Out<'_>>> = Vec::new();
        for o in outs {
            if o.peer == me {
                own.push(Some(o));
            } else if let OutData::Owned(a) = o.data {
                self.give_back(a.into_data());
            }
        }
        let mut local: Vec<Option<Activation>> = (0..n).map(|_| None).collect();
        for (k, i) in ins.iter().enumerate() {
            if i.peer != me {
                continue;
            }
            let slot = own
                .iter_mut()
                .find(|o| o.as_ref().is_some_and(|o| o.tag == i.tag))
                .and_then(Option::take);
            match slot {
                Some(o) => match o.data {
                    OutData::Failed => errs[k] = Some(Error::PeerError { op: self.op, peer: me }),
                    data => {
                        let a = data.into_activation(self.pool)?;
                        metas[k] = Some(Meta::of(&a));
                        local[k] = Some(a);
                    }
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

        // ----- joins ----------------------------------------------------------------------------
        let mut joined = Vec::with_capacity(joins.len());
        for (j, jn) in joins.iter().enumerate() {
            let members = jn.ins.clone();
            if let Some(e) = members.clone().find_map(|k| errs[k].clone()) {
                if let Some(b) = jbuf[j].take() {
                    self.give_back(b);
                }
                joined.push(Err(e));
                continue;
            }
            if !broken[j] {
                if let (Some(b), Some(m)) = (jbuf[j].take(), jmeta[j].take()) {
                    joined.push(Activation::new(m.shape, b));
                    continue;
                }
            }
            // Part by part, then one copy into the output.
            let old = jbuf[j].take();
            let mut pieces: Vec<Activation> = Vec::with_capacity(members.len());
            let mut off = 0;
            for (x, k) in members.clone().enumerate() {
                let m = metas[k]
                    .clone()
                    .ok_or_else(|| self.internal("a joined part without a header"))?;
                let expected_len = jlens[j].get(x).copied().unwrap_or(0);
                let piece = if let Some(a) = local[k].take() {
                    a
                } else if let Some(b) = dest[k].take() {
                    Activation::new(m.shape, b)?
                } else if let Some(ob) = &old {
                    let from = sub_slice(ob.as_slice(), off..off + m.numel());
                    let mut b = self.alloc(from.dtype(), from.len());
                    b.as_mut_slice().copy_from(from)?;
                    Activation::new(m.shape, b)?
                } else {
                    return Err(self.internal("a joined part without data"));
                };
                off += expected_len;
                pieces.push(piece);
            }
            if let Some(b) = old {
                self.give_back(b);
            }
            let refs: Vec<&Activation> = pieces.iter().collect();
            let peers: Vec<usize> = members.map(|k| ins[k].peer).collect();
            joined.push(
                Activation::concat_with(&refs, jn.dim, &|d, len| self.alloc(d, len)).map_err(|e| {
                    Error::IncompatibleParts {
                        op: self.op,
                        ranks: peers,
                        message: e.to_string(),
                    }
                }),
            );
            for p in pieces {
                self.give_back(p.into_data());
            }
        }

        // ----- per-message results --------------------------------------------------------------
        let mut parts = Vec::with_capacity(n);
        for k in 0..n {
            if let Some(e) = errs[k].take() {
                if let Some(b) = dest[k].take() {
                    self.give_back(b);
                }
                parts.push(Err(e));
                continue;
            }
            let meta = metas[k]
                .take()
                .ok_or_else(|| self.internal("a message without a header"))?;
            let data = if join_of[k].is_some() {
                None
            } else if let Some(a) = local[k].take() {
                Some(a)
            } else {
                let b = dest[k]
                    .take()
                    .ok_or_else(|| self.internal("a message without a buffer"))?;
                Some(Activation::new(meta.shape.clone(), b)?)
            };
            parts.push(Ok(Part { meta, data }));
        }
        if let Some(c) = cache {
            for (peer, tag, m) in sent_metas {
                c.record(true, (peer, tag), m);
            }
            for (peer, tag, m) in arrived {
                c.record(false, (peer, tag), m);
            }
        }
        Ok(Exchanged { parts, joined })
    }

    /// Status and dtype/shape of a header; a failure status is [`Error::PeerError`].
    fn decode(&self, peer: usize, h: &[i64; HDR]) -> Result<(i64, Meta)> {
        if h[0] == FAILED {
            return Err(Error::PeerError { op: self.op, peer });
        }
        let bad = |m: String| Error::Protocol {
            op: self.op,
            peer,
            message: m,
        };
        if h[0] != OK && h[0] != RESEND {
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
        Ok((h[0], Meta::new(dtype, shape)))
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
            Ok(a) => Meta::of(a).header(OK),
            Err(_) => failed_header(),
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
        let (_, m) = w.decode(leader, &h).map_err(|e| match e {
            Error::Protocol { .. } => e,
            _ => Error::PeerError { op, peer: leader },
        })?;
        let n = m.numel();
        let mut a = Activation::new(m.shape, w.alloc(m.dtype, n))?;
        if a.numel() > 0 {
            comm.broadcast(BufMut::Host(a.data_mut()), root)?;
        }
        Ok(a)
    }
}
