//! [`NcclCommunicator`] = [`grid_core::Comm`]`<`[`NcclBackend`]`>`: one NCCL communicator
//! behind grid-core's front end, which validates every operation (memory kind, dtypes,
//! lengths, roots, peers, tags, liveness) before this backend sees it. The backend checks only
//! what NCCL alone knows: that device buffers are this backend's and live on the
//! communicator's GPU.
//!
//! The code is split by concern:
//! * this module: [`NcclBackend`], its [`Backend`] implementation (dispatch) and the
//!   device-memory helpers users call (`to_device`, `zeros`, `to_host`, `abort`, ...);
//! * `shared`: the state a communicator shares with its pending work (NCCL handle, stream,
//!   its entry in the watchdog, held-back sends and receives);
//! * `exec`: blocking operations (staging of host memory, enqueueing on the stream);
//! * `work`: nonblocking operations and [`NcclWork`].
//!
//! # Memory and streams
//! * **Device buffers** ([`crate::NcclDeviceBuffer`]) are the native form. A blocking call
//!   makes the communicator's stream wait for the work already queued on each buffer's stream,
//!   enqueues the NCCL operation on the communicator's stream and makes each buffer's stream
//!   wait for it, then returns **without waiting for the GPU** (stream-ordered, as NCCL and
//!   PyTorch work). [`grid_core::Communicator::synchronize`] waits for the communicator's stream.
//! * **In place and out of place**: `all_reduce` (out of place) passes distinct send and
//!   receive buffers to `ncclAllReduce`; `all_reduce_in_place` passes the same buffer as both
//!   (NCCL's native in-place form, no copy). Both have nonblocking forms
//!   (`iall_reduce_into`, `iall_reduce`).
//! * **Host buffers are staged** (so the typed helpers and the shared conformance suite work
//!   unchanged): the input is copied to a temporary device buffer, the operation runs, and
//!   the call waits for it and copies the result back before returning. This costs two copies
//!   and a synchronisation per call; use device buffers where speed matters.
//! * **Nonblocking** [`grid_core::Communicator::start`] enqueues the operation at once and
//!   records a completion marker (a CUDA event, plus a CUDA host function that wakes the
//!   watchdog when the device reaches it). `wait` on a **device** result does not block the
//!   host: the result's stream is made to wait for the marker and the buffer comes back at once
//!   (stream-ordered); on a **host** result it blocks the host on a condition variable until
//!   the marker fired, then copies the result back. `wait_timeout` always blocks the host.
//!   Dropping an unfinished work is safe: its buffers stay with the watchdog until the device
//!   is done with them.
//! * **Sends and receives are enqueued when they are called** ([`crate::p2p`]): every
//!   communicator has two point-to-point lanes (NCCL communicators of the same ranks split from
//!   it when it is created, one per direction of a message, each with its own stream), and every
//!   `send`, `recv`, `isend` and `irecv` is posted at once, alone, on the lane of its direction;
//!   `batch_p2p` posts one group per lane, both before waiting. So an exchange
//!   (`isend(peer); irecv(peer)` on both ranks) and rings cannot deadlock behind themselves
//!   (NCCL runs one communicator's kernels one after the other, so both directions on one
//!   communicator would), and an `isend` followed by a blocking collective on another
//!   communicator is already posted when the collective starts. With
//!   [`crate::p2p::P2pPosting::HoldBack`] (chosen, or forced where NCCL serialises all
//!   communicators of a device) nonblocking sends and receives are instead held back per
//!   communicator and posted as one `ncclGroupStart/End` group **before this process does
//!   anything else on the device** ([`crate::engine::Outbox`]). Either way a receive whose
//!   matching send is only issued *after* waiting on it, in the same direction, cannot
//!   complete; use `batch_p2p` or start both first.
//!
//! * **CUDA graph capture**: when the communicator's stream, or the stream of a device buffer
//!   the operation joins, is capturing, the operation is enqueued into the graph without a
//!   completion marker, host function or watchdog entry ([`crate::engine::launch_plan`]); host
//!   memory, the blocking barrier, `synchronize` and `to_host` are refused with
//!   [`Error::Unsupported`] naming the operation, before anything is enqueued.
//!
//! # Failure handling
//! Failure handling is [`crate::engine`]: the state machine that the CPU tests drive with a
//! scripted device runtime. Every communicator is **nonblocking** (`ncclConfig_t.blocking =
//! 0`): creation and split return at once and the communicator is watched, and abortable,
//! while it connects; every NCCL call that answers `ncclInProgress` is settled under the
//! operation's time limit (the front end's [`grid_core::Validated::time_limit`]), with the lock
//! that serialises NCCL calls of one device held only for that call, never by `abort()` or the
//! watchdog. One watchdog thread per process polls `ncclCommGetAsyncError` of every
//! communicator and the completion markers of every enqueued operation (waited on or not). On
//! an asynchronous error or a time limit it fails the communicator: every pending operation
//! returns an error at once, NCCL is aborted, and so is every other communicator of the
//! [`crate::Job`] (unless [`crate::NcclOptions::abort_on_failure`] is off), so no rank stays
//! blocked in another group; later operations return [`Error::Aborted`] naming the first
//! failure. Nothing sleeps to wait for device work: waits block on condition variables that the
//! watchdog signals. NCCL and CUDA failures are [`grid_core::Error::Library`] naming the
//! operation, the communicator, the NCCL function, and NCCL's `ncclResult_t` (or CUDA's
//! `CUresult`) name and number.
//!
//! # Ranks and tags
//! `rank()` is the NCCL rank. NCCL matches point-to-point messages by order, not by tag: the
//! `tag` arguments are accepted and ignored.

mod exec;
mod shared;
mod work;

pub(crate) use shared::Shared;
pub use work::NcclWork;

use crate::buffer::{NcclDeviceBuffer, NcclElement};
use crate::engine::Tracked;
use crate::error::{annotate, cuda, BACKEND};
use crate::ffi::RawComm;
use cudarc::driver::{CudaContext, CudaStream};
use grid_core::{
    Backend, Comm, DType, Error, Memory, Op, ReduceOp, Request, Result, TimeLimit, Validated, Work,
};
use std::sync::Arc;
use std::time::Duration;

/// A grid-core communicator over one NCCL communicator on one GPU: the front end
/// ([`grid_core::Comm`]) over [`NcclBackend`].
///
/// Created by [`crate::NcclFactory::init`] (the world, named `"world"`) and
/// [`grid_core::GroupFactory::split`] (sub-groups). `Send + Sync`: NCCL calls from several
/// threads are serialised per device. Dropping it hands the NCCL communicator to the watchdog,
/// which lets its pending operations finish (within their limits), then finalizes and destroys
/// it without blocking, or aborts it if finalizing fails or does not finish in time. Backend methods ([`NcclBackend::to_device`], [`NcclBackend::abort`], ...) are
/// reached through `Deref`.
///
/// ```no_run
/// # fn f(comm: &backend_nccl::NcclCommunicator) -> grid_core::Result<()> {
/// use grid_core::{BufMut, Communicator, CommunicatorExt, ReduceOp};
/// // Host buffers are staged through the GPU:
/// let mut out = vec![0.0f32; 4];
/// comm.all_reduce_into(&[1.0f32; 4][..], &mut out[..], ReduceOp::Sum)?;
/// // Device buffers in place: ncclAllReduce with the same send and receive buffer.
/// let mut buf = comm.to_device(&[1.0f32, 2.0])?;
/// comm.in_place_all_reduce(BufMut::Device(&mut buf), ReduceOp::Max)?;
/// # Ok(()) }
/// ```
pub type NcclCommunicator = Comm<NcclBackend>;

/// The NCCL backend of one communicator: executes operations the front end validated.
/// Reached from an [`NcclCommunicator`] through `Deref` or `comm.inner()`.
pub struct NcclBackend {
    shared: Arc<Shared>,
    global_ranks: Vec<usize>,
    device: usize,
    caps: Capabilities,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("name", &self.shared.name)
            .field("rank", &self.shared.raw.rank())
            .field("size", &self.shared.raw.size())
            .field("device", &self.device)
            .field("global_ranks", &self.global_ranks)
            .field("state", &self.shared.raw.state_name())
            .finish()
    }
}

/// The first NCCL version with the fp8 data types `ncclFloat8e4m3` and `ncclFloat8e5m2`
/// (`NCCL_VERSION(2, 24, 0)` = 22400).
pub const FP8_VERSION: (u32, u32, u32) = (2, 24, 0);

/// The first compute capability on which NCCL reduces fp8 (below it NCCL answers "FP8
/// reduction support begins with sm90 capable devices").
pub const FP8_COMPUTE_CAPABILITY: (u32, u32) = (9, 0);

/// Whether NCCL `version` (as [`crate::probe::nccl_version`] returns it) has the fp8 data types:
/// NCCL >= 2.24.0. A pure function of the version.
///
/// ```
/// use backend_nccl::comm::has_fp8_types;
/// assert!(has_fp8_types((2, 24, 0)) && has_fp8_types((2, 30, 1)) && has_fp8_types((3, 0, 0)));
/// assert!(!has_fp8_types((2, 23, 4)) && !has_fp8_types((2, 18, 5)));
/// ```
pub fn has_fp8_types(version: (u32, u32, u32)) -> bool {
    version >= FP8_VERSION
}

/// What the loaded NCCL library and this communicator's GPU can do, as far as the front end
/// needs to know ([`grid_core::Backend::supports`]).
///
/// * Every dtype **moves** (every operation that does not reduce): `Bool` and fp8 as
///   `ncclUint8` bytes, on every version and GPU.
/// * Reductions: every operation on f32, f64, f16, bf16; every operation but `Avg` on the
///   integers (`ncclAvg` is floating point only); on `Bool` logical OR (`Sum`, `Max`) and AND
///   (`Prod`, `Min`) as `ncclMax` / `ncclMin` of bytes, no `Avg`; on fp8 every operation when
///   [`Capabilities::fp8_reductions`], none otherwise.
///
/// ```
/// use backend_nccl::comm::Capabilities;
/// use grid_core::{DType, ReduceOp};
/// let h100 = Capabilities::new((2, 26, 2), (9, 0));
/// let a100 = Capabilities::new((2, 26, 2), (8, 0));
/// let old = Capabilities::new((2, 21, 5), (9, 0));
/// assert!(h100.supports(DType::F8E4M3, Some(ReduceOp::Sum)));
/// assert!(!a100.supports(DType::F8E4M3, Some(ReduceOp::Sum)));
/// assert!(!old.supports(DType::F8E5M2, Some(ReduceOp::Max)));
/// assert!(old.supports(DType::F8E5M2, None)); // moved as bytes
/// assert!(h100.supports(DType::Bool, Some(ReduceOp::Sum)) && !h100.supports(DType::Bool, Some(ReduceOp::Avg)));
/// assert!(!h100.supports(DType::I32, Some(ReduceOp::Avg)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The loaded NCCL version `(major, minor, patch)`.
    pub nccl_version: (u32, u32, u32),
    /// The GPU's compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
}

impl Capabilities {
    /// The capabilities of NCCL `nccl_version` on a GPU of `compute_capability`.
    pub fn new(nccl_version: (u32, u32, u32), compute_capability: (u32, u32)) -> Self {
        Capabilities {
            nccl_version,
            compute_capability,
        }
    }

    /// Whether fp8 is reduced: the library has the fp8 types ([`has_fp8_types`]) and the GPU
    /// has compute capability 9.0 or newer ([`FP8_COMPUTE_CAPABILITY`]).
    pub fn fp8_reductions(&self) -> bool {
        has_fp8_types(self.nccl_version) && self.compute_capability >= FP8_COMPUTE_CAPABILITY
    }

    /// Whether `dtype` moves (`op = None`) or reduces with `op`; see the type's docs.
    pub fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        match op {
            None => true,
            Some(r) => crate::ffi::reduction(dtype, r, self.fp8_reductions()).is_some(),
        }
    }

    /// Which reductions of `dtype` this communicator has, and why not the others (for the
    /// error of an unsupported reduction).
    pub fn describe_reductions(&self, dtype: DType) -> String {
        let (a, b, p) = self.nccl_version;
        let (ma, mi) = self.compute_capability;
        match dtype {
            DType::F8E4M3 | DType::F8E5M2 if !has_fp8_types(self.nccl_version) => format!(
                "NCCL {a}.{b}.{p} has no fp8 types (NCCL >= 2.24.0 reduces fp8); fp8 is only moved, as bytes"
            ),
            DType::F8E4M3 | DType::F8E5M2 if !self.fp8_reductions() => format!(
                "NCCL reduces fp8 on compute capability 9.0 or newer, this GPU has {ma}.{mi}; fp8 is only moved, as bytes"
            ),
            DType::Bool => "bool reduces with sum and max (logical or), prod and min (logical and); avg is not defined".into(),
            DType::F8E4M3 | DType::F8E5M2 | DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                "every reduction".into()
            }
            _ => "integers reduce with sum, prod, min and max; NCCL's avg is floating point only".into(),
        }
    }
}

impl NcclBackend {
    /// Puts a created NCCL communicator (already under the watchdog, its creation settled)
    /// behind the front end under `name`; `gpu` is its device's context and what NCCL and the
    /// device can do.
    pub(crate) fn create(
        raw: Arc<RawComm>,
        tracked: Arc<Tracked>,
        gpu: (Arc<CudaContext>, Capabilities),
        stream: Arc<CudaStream>,
        global_ranks: Vec<usize>,
        name: String,
        timeout: Duration,
    ) -> NcclCommunicator {
        let (ctx, caps) = gpu;
        let device = ctx.ordinal();
        let shared = Arc::new(Shared::new(
            raw,
            tracked,
            ctx,
            stream,
            name.clone(),
            timeout,
        ));
        let weak = Arc::downgrade(&shared);
        let deferred: std::sync::Weak<dyn crate::engine::Deferred> = weak;
        shared.outbox.register(deferred);
        Comm::new(
            NcclBackend {
                shared,
                global_ranks,
                device,
                caps,
            },
            name,
        )
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// What NCCL and this GPU can do (which reductions, fp8).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// The GPU (CUDA ordinal) this communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The CUDA stream every operation of this communicator is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// `"live"`, `"failed"`, `"aborted"`, `"finalizing"` or `"destroyed"`.
    pub fn state(&self) -> &'static str {
        self.shared.tracked.state_name()
    }

    /// Aborts this communicator now: every pending operation returns an error at once, later
    /// ones are refused, and NCCL is asked to abort (`ncclCommAbort`, which never waits for a
    /// thread blocked in NCCL: the communicator is nonblocking). Returns false if it was not
    /// live. The front end's [`grid_core::Communicator::abort`] calls it.
    pub fn abort(&self) -> bool {
        self.shared.abort("abort() was called")
    }

    /// How this communicator posts single sends and receives: on its two point-to-point lanes
    /// at once, or held back ([`crate::p2p`]).
    pub fn p2p_posting(&self) -> crate::p2p::P2pPosting {
        if self.shared.lanes.get().is_some() {
            crate::p2p::P2pPosting::Lanes
        } else {
            crate::p2p::P2pPosting::HoldBack
        }
    }

    /// `Ok` while NCCL reports no asynchronous error on this communicator (the watchdog checks
    /// this on its own; this asks now).
    pub fn check_async_error(&self) -> Result<()> {
        const OP: &str = "check_async_error";
        self.shared.check_live(OP)?;
        match self.shared.raw.progress_of(OP) {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = annotate(e, OP, &self.shared.name);
                self.shared.tracked.fail(e.clone());
                Err(e)
            }
        }
    }

    /// Copies host data to a new device buffer on this communicator's device and stream.
    pub fn to_device<T: NcclElement>(&self, data: &[T]) -> Result<NcclDeviceBuffer<T>> {
        const OP: &str = "to_device";
        if data.is_empty() {
            return Err(Error::Invalid(
                "to_device: cannot allocate an empty device buffer (give at least one element)"
                    .into(),
            ));
        }
        self.shared.bind(OP)?;
        let data = T::to_device_repr(data);
        cuda(OP, || self.shared.stream.clone_htod(&*data))
            .map(NcclDeviceBuffer::new)
            .map_err(|e| annotate(e, OP, &self.shared.name))
    }

    /// A new zero-filled device buffer of `len` elements on this communicator's stream.
    pub fn zeros<T: NcclElement>(&self, len: usize) -> Result<NcclDeviceBuffer<T>> {
        const OP: &str = "zeros";
        if len == 0 {
            return Err(Error::Invalid(
                "zeros: cannot allocate an empty device buffer (give a length of at least 1)"
                    .into(),
            ));
        }
        self.shared.bind(OP)?;
        cuda(OP, || self.shared.stream.alloc_zeros::<T::Device>(len))
            .map(NcclDeviceBuffer::new)
            .map_err(|e| annotate(e, OP, &self.shared.name))
    }

    /// Copies a device buffer back to the host, after everything queued on this communicator's
    /// stream (waits with the communicator's timeout and failure checks).
    pub fn to_host<T: NcclElement>(&self, buf: &NcclDeviceBuffer<T>) -> Result<Vec<T>> {
        const OP: &str = "to_host";
        let run = || {
            self.shared.check_live(OP)?;
            self.capture_check(OP, true, &[buffer_stream(buf)])?;
            self.shared.outbox.post_all();
            self.shared.bind(OP)?;
            self.wait_for(OP, buf)?;
            self.shared
                .sync(OP, TimeLimit::After(self.shared.timeout))?;
            cuda(OP, || self.shared.stream.clone_dtoh(&buf.slice)).map(T::from_device_repr)
        };
        run().map_err(|e| annotate(e, OP, &self.shared.name))
    }
}

impl NcclBackend {
    /// Refuses what a CUDA graph capture cannot hold before anything is enqueued
    /// ([`crate::engine::launch_plan`]): `host` (the operation stages host memory or waits on
    /// the host) while this communicator's stream or one of `streams` (the operation's device
    /// buffers' streams, which it joins) is capturing, or any use of an invalidated capture.
    fn capture_check(
        &self,
        op: &'static str,
        host: bool,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        self.shared.bind(op)?;
        let capture = self.shared.capture_with(streams)?;
        crate::engine::launch_plan(op, capture, host).map(|_| ())
    }
}

/// The stream a device buffer of this backend is ordered on.
fn buffer_stream<T: NcclElement>(b: &NcclDeviceBuffer<T>) -> Arc<CudaStream> {
    b.slice.stream().clone()
}

/// The stream of an erased device buffer of this backend (`None` for another backend's, which
/// the operation itself refuses with its own error).
fn erased_stream(d: &dyn grid_core::DeviceBuffer) -> Option<Arc<CudaStream>> {
    crate::buffer::with_dtype!(d.dtype(), T => crate::buffer::downcast::<T>("capture", d)
        .ok()
        .map(|b| b.slice.stream().clone()))
}

/// Collects what the capture check needs from a list of buffers.
#[derive(Default)]
struct MemoryUse {
    host: bool,
    streams: Vec<Arc<CudaStream>>,
}

impl MemoryUse {
    fn device(&mut self, d: &dyn grid_core::DeviceBuffer) {
        if let Some(s) = erased_stream(d) {
            if !self.streams.iter().any(|x| **x == *s) {
                self.streams.push(s);
            }
        }
    }
    fn r(&mut self, b: &grid_core::BufRef<'_>) {
        match b {
            grid_core::BufRef::Host(_) => self.host = true,
            grid_core::BufRef::Device(d) => self.device(*d),
        }
    }
    fn m(&mut self, b: &grid_core::BufMut<'_>) {
        match b {
            grid_core::BufMut::Host(_) => self.host = true,
            grid_core::BufMut::Device(d) => self.device(&**d),
        }
    }
    fn t(&mut self, t: &grid_core::Tensor) {
        match t {
            grid_core::Tensor::Host(_) => self.host = true,
            grid_core::Tensor::Device(d) => self.device(&**d),
        }
    }
}

/// Whether a blocking operation stages host memory or waits on the host (a barrier), and the
/// streams of its device buffers.
fn op_memory(op: &Op<'_>) -> (bool, Vec<Arc<CudaStream>>) {
    let mut u = MemoryUse::default();
    match op {
        Op::AllReduce { send, recv, .. }
        | Op::AllGather { send, recv }
        | Op::ReduceScatter { send, recv, .. }
        | Op::AllToAll { send, recv }
        | Op::AllToAllV { send, recv, .. }
        | Op::AllGatherV { send, recv, .. }
        | Op::ReduceScatterV { send, recv, .. } => {
            u.r(send);
            u.m(recv);
        }
        Op::AllReduceInPlace { buf, .. }
        | Op::AllGatherInPlace { buf }
        | Op::ReduceScatterInPlace { buf, .. }
        | Op::Broadcast { buf, .. }
        | Op::Recv { buf, .. } => u.m(buf),
        Op::Send { buf, .. } => u.r(buf),
        Op::Reduce { send, recv, .. } | Op::Gather { send, recv, .. } => {
            u.r(send);
            if let Some(r) = recv {
                u.m(r);
            }
        }
        Op::Scatter { send, recv, .. } => {
            if let Some(s) = send {
                u.r(s);
            }
            u.m(recv);
        }
        Op::Batch(ops) => {
            for o in ops {
                match o {
                    grid_core::P2pOp::Send { buf, .. } => u.r(buf),
                    grid_core::P2pOp::Recv { buf, .. } => u.m(buf),
                    // A framed message's header is host memory.
                    grid_core::P2pOp::SendFramed { buf, .. } => {
                        u.host = true;
                        u.r(buf)
                    }
                    grid_core::P2pOp::RecvFramed { buf, .. } => {
                        u.host = true;
                        u.m(buf)
                    }
                }
            }
        }
        Op::Barrier => u.host = true,
    }
    (u.host, u.streams)
}

/// [`op_memory`] of a nonblocking request. A nonblocking barrier does not wait on the host
/// (its work does), so it may be captured.
fn request_memory(r: &Request) -> (bool, Vec<Arc<CudaStream>>) {
    let mut u = MemoryUse::default();
    match r {
        Request::AllReduceInto { send, recv, .. }
        | Request::AllGather { send, recv }
        | Request::ReduceScatter { send, recv, .. }
        | Request::AllToAll { send, recv }
        | Request::AllToAllV { send, recv, .. }
        | Request::AllGatherV { send, recv, .. }
        | Request::ReduceScatterV { send, recv, .. } => {
            u.t(send);
            u.t(recv);
        }
        Request::AllReduce { buf, .. }
        | Request::AllGatherInPlace { buf }
        | Request::ReduceScatterInPlace { buf, .. }
        | Request::Broadcast { buf, .. }
        | Request::Send { buf, .. }
        | Request::Recv { buf, .. } => u.t(buf),
        Request::Reduce { send, recv, .. } | Request::Gather { send, recv, .. } => {
            u.t(send);
            if let Some(r) = recv {
                u.t(r);
            }
        }
        Request::Scatter { send, recv, .. } => {
            if let Some(s) = send {
                u.t(s);
            }
            u.t(recv);
        }
        Request::Barrier => {}
    }
    (u.host, u.streams)
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }
    fn rank(&self) -> usize {
        self.shared.raw.rank()
    }
    fn size(&self) -> usize {
        self.shared.raw.size()
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }
    /// Device memory natively; host memory through staging (see the module docs).
    fn accepts(&self, _memory: Memory) -> bool {
        true
    }
    /// See [`Capabilities`].
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        self.caps.supports(dtype, op)
    }
    fn check_live(&self, op: &'static str) -> Result<()> {
        self.shared.check_live(op)
    }
    fn default_time_limit(&self) -> grid_core::TimeLimit {
        grid_core::TimeLimit::After(self.shared.timeout)
    }
    /// [`NcclBackend::abort`]: every waiting operation returns at once; `ncclCommAbort` runs on
    /// a helper thread. NCCL cannot hand buffers back before its kernels stopped, so the buffers
    /// of a woken nonblocking operation (and staged copies) stay with the watchdog until the
    /// device is done with them; device buffers the caller owns are freed stream-ordered by
    /// cudarc after the operation.
    fn abort(&self) {
        NcclBackend::abort(self);
    }
    fn run(&self, op: Validated<Op<'_>>) -> Result<()> {
        let limit = op.time_limit();
        let op = op.into_op();
        let name = op.name();
        self.shared.check_live(name)?;
        let (host, streams) = op_memory(&op);
        self.capture_check(name, host, &streams)
            .map_err(|e| annotate(e, name, &self.shared.name))?;
        // Held-back sends and receives of this device were started first: posted first.
        self.shared.outbox.post_all();
        self.exec(op, limit)
            .map_err(|e| annotate(e, name, &self.shared.name))
    }
    fn start(&self, op: Validated<grid_core::Request>) -> Result<Box<dyn Work>> {
        let limit = op.time_limit();
        let request: Request = op.into_op();
        let name = request.name();
        self.shared.check_live(name)?;
        let (host, streams) = request_memory(&request);
        self.capture_check(name, host, &streams)
            .map_err(|e| annotate(e, name, &self.shared.name))?;
        self.start_request(request, limit)
            .map_err(|e| annotate(e, name, &self.shared.name))
    }
    /// Waits (host, on a condition variable) until everything enqueued so far completed,
    /// within the communicator's configured timeout.
    fn synchronize(&self) -> Result<()> {
        const OP: &str = "synchronize";
        self.capture_check(OP, true, &[])
            .map_err(|e| annotate(e, OP, &self.shared.name))?;
        self.shared.outbox.post_all();
        self.shared
            .sync_all(OP, TimeLimit::After(self.shared.timeout))
            .map_err(|e| annotate(e, OP, &self.shared.name))
    }
}
