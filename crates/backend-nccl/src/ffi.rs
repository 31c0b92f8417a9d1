//! The crate's only `unsafe` code: a thin owned wrapper over `cudarc::nccl::sys` (the raw NCCL
//! bindings), used where cudarc's safe `Comm` lacks what this backend needs (split, abort,
//! finalize-then-destroy, use from several threads, asynchronous-error polling).
//!
//! Every `unsafe` block states the invariant it relies on. Three rules hold for the whole module:
//! * **Library presence.** No function here may be reached before [`crate::probe`] confirmed that
//!   the CUDA driver library and libnccl load (cudarc panics on a missing library or symbol). As a
//!   last line of defence every call into cudarc runs under [`crate::error::guard`], which turns a
//!   panic into an [`Error`].
//! * **Device pointers come from cudarc slices.** Collectives take [`DevIn`] / [`DevOut`]
//!   tokens, which can only be built from a `cudarc` slice or view; the pointer, the element
//!   count and the NCCL data type in a token therefore describe live device memory of that many
//!   elements of that type, and the token's borrow keeps the slice alive (and its stream-ordered
//!   free after the operation) for as long as the token exists.
//! * **One thread at a time per communicator.** NCCL forbids concurrent calls on one
//!   communicator; [`RawComm`] keeps the handle behind a mutex, and a handle that was destroyed
//!   or aborted is never passed to NCCL again. Every communicator is nonblocking
//!   (`blocking = 0`), so each call returns at once and the mutex is never held while a thread
//!   waits for peers: `ncclCommAbort` (which takes it too) never waits behind a stuck call.
//! * **Host functions make no CUDA call and never unwind** ([`kick_when_reached`]).

#![allow(unsafe_code)]

use crate::buffer::NcclElement;
use crate::engine::{DeviceComm, Kicker, Progress};
use crate::error::{cuda, guard, internal, nccl_err};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nccl::sys;
use grid_core::{DType, Error, Result};
use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// `NCCL_SPLIT_NOCOLOR` from `nccl.h` (a `#define`, so not in the generated bindings).
pub(crate) const NCCL_SPLIT_NOCOLOR: c_int = -1;

// ------------------------------------------------------------------------------------------------
// Library probes
// ------------------------------------------------------------------------------------------------

/// Whether the dynamic loader opens the CUDA driver library under one of cudarc's names.
pub(crate) fn driver_library_loadable() -> bool {
    // SAFETY: `is_culib_present` dlopens each candidate name (running the library's
    // initialisers, which the CUDA driver library supports: every CUDA program does this) and
    // closes it again. It touches no other state.
    guard("probe the CUDA driver library", || {
        Ok(unsafe { cudarc::driver::sys::is_culib_present() })
    })
    .unwrap_or(false)
}

/// Whether the dynamic loader opens libnccl under one of cudarc's names.
pub(crate) fn nccl_library_loadable() -> bool {
    // SAFETY: as above; libnccl's initialisers only set up its own state.
    guard("probe libnccl", || {
        Ok(unsafe { cudarc::nccl::sys::is_culib_present() })
    })
    .unwrap_or(false)
}

/// Tries to dlopen one library file and closes it again; `Err` carries the loader's message
/// (for example a missing dependency). Used only for diagnostics on files found on disk.
pub(crate) fn try_dlopen(path: &std::path::Path) -> std::result::Result<(), String> {
    // SAFETY: loading runs the library's initialisers. This is only called on files named like
    // the CUDA driver library or libnccl, whose initialisers are safe to run (they are loaded the
    // same way by cudarc); the handle is dropped (dlclose) immediately.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            drop(lib);
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The NCCL version as `major * 10000 + minor * 100 + patch` (NCCL >= 2.9 encoding).
pub(crate) fn nccl_version() -> Result<i32> {
    guard("ncclGetVersion", || {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid, writable `int`; libnccl is loaded (module rule 1).
        check(
            "ncclGetVersion",
            unsafe { sys::ncclGetVersion(&mut v) },
            None,
        )?;
        Ok(v)
    })
}

/// The CUDA driver's version (`cuDriverGetVersion`, e.g. 12040 for 12.4).
pub(crate) fn driver_version() -> Result<i32> {
    guard("cuDriverGetVersion", || {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid, writable `int`; the driver library is loaded (module rule 1).
        // cuDriverGetVersion needs no initialised driver or context.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        r.result()
            .map_err(|e| crate::error::driver("cuDriverGetVersion", e))?;
        Ok(v)
    })
}

/// Puts the calling thread in CUDA's *relaxed* stream-capture mode, once per thread. The
/// watchdog thread queries completion markers of eager work; in the default (global) mode a
/// CUDA graph capture started by another thread prohibits "potentially unsafe" calls on every
/// thread, so a query could fail or invalidate that capture. Relaxed mode lifts the prohibition
/// for this thread only (the events it queries are never recorded in a capture: see
/// [`crate::engine::Launch::Captured`]).
pub(crate) fn relax_capture_mode() {
    thread_local! {
        static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if RELAXED.with(|r| r.replace(true)) {
        return;
    }
    let r = guard("cuThreadExchangeStreamCaptureMode", || {
        let mut mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid, writable CUstreamCaptureMode; the call only swaps this
        // thread's capture mode (the previous one is written back into `mode`, and dropped: the
        // thread stays relaxed for its lifetime). The driver library is loaded (rule 1).
        let r = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        r.result()
            .map_err(|e| crate::error::driver("cuThreadExchangeStreamCaptureMode", e))
    });
    if let Err(e) = r {
        tracing::debug!("nccl: {e}; the watchdog keeps the default capture mode");
    }
}

/// A fresh `ncclUniqueId` as its 128 raw bytes.
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    guard("ncclGetUniqueId", || {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid, writable `ncclUniqueId`; libnccl is loaded (module rule 1).
        check(
            "ncclGetUniqueId",
            unsafe { sys::ncclGetUniqueId(&mut id) },
            None,
        )?;
        Ok(id.internal.map(|c| c as u8))
    })
}

// ------------------------------------------------------------------------------------------------
// Results and error strings
// ------------------------------------------------------------------------------------------------

/// Turns an `ncclResult_t` into `Ok` or an [`Error::Library`] with NCCL's code, name and text.
fn check(op: &'static str, r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> Result<()> {
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(()),
        other => {
            // SAFETY: `ncclGetErrorString` accepts any result code and returns a pointer to a
            // static NUL-terminated string (or NULL, handled by `cstr`).
            let text = cstr(unsafe { sys::ncclGetErrorString(other) });
            // SAFETY: `ncclGetLastError` accepts a live communicator or NULL and returns a
            // pointer to a NUL-terminated string owned by NCCL, valid until the next NCCL call on
            // this thread; it is copied out at once.
            let last = cstr(unsafe { sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) });
            Err(nccl_err(op, other, &text, &last))
        }
    }
}

/// Like [`check`], but `ncclInProgress` (a nonblocking communicator still working on the call)
/// is [`Progress::InProgress`] rather than an error.
fn check_progress(
    op: &'static str,
    r: sys::ncclResult_t,
    comm: Option<sys::ncclComm_t>,
) -> Result<Progress> {
    match r {
        sys::ncclResult_t::ncclInProgress => Ok(Progress::InProgress),
        other => check(op, other, comm).map(|()| Progress::Done),
    }
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns NUL-terminated strings from its error functions (see `check`); `p`
    // is non-null and the bytes are copied before any other NCCL call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ------------------------------------------------------------------------------------------------
// Data types
// ------------------------------------------------------------------------------------------------

/// The NCCL data type a grid-core dtype **moves** as (every operation that does not reduce).
/// `Bool` and both fp8 formats move as `ncclUint8`: their bytes arrive unchanged, on every NCCL
/// version and every GPU (NCCL refuses its fp8 types in some operations below compute
/// capability 9.0).
pub(crate) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as N;
    match d {
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        DType::I32 => N::ncclInt32,
        DType::I64 => N::ncclInt64,
        DType::U8 => N::ncclUint8,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::I8 => N::ncclInt8,
        DType::U32 => N::ncclUint32,
        DType::U64 => N::ncclUint64,
        DType::Bool | DType::F8E4M3 | DType::F8E5M2 => N::ncclUint8,
    }
}

/// `ncclFloat8e4m3` and `ncclFloat8e5m2` from NCCL's `nccl.h` (`src/nccl.h.in`: `ncclFloat8e4m3
/// = 10, ncclFloat8e5m2 = 11`, `ncclNumTypes = 12`), present since NCCL 2.24.0
/// ([`crate::comm::FP8_VERSION`]). cudarc's bindings for NCCL >= 2.24 carry the same values;
/// the test `fp8_enum_values_match_nccl_h` pins them.
pub(crate) const NCCL_FLOAT8E4M3: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat8e4m3;
/// See [`NCCL_FLOAT8E4M3`].
pub(crate) const NCCL_FLOAT8E5M2: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat8e5m2;

/// The NCCL data type and operation that **reduce** `d` with `op`, or `None` when NCCL cannot:
/// * `Bool`: logical OR (`Sum`, `Max`) and AND (`Prod`, `Min`) as `ncclMax` / `ncclMin` of
///   `ncclUint8`, exact for any bytes (max(a, b) != 0 iff a != 0 or b != 0); no `Avg`;
/// * fp8: `ncclFloat8e4m3` / `ncclFloat8e5m2` with every operation when `fp8` (the library has
///   them and the GPU reduces them, [`crate::comm::Capabilities::fp8_reductions`]), else none;
/// * integers: every operation but `Avg` (`ncclAvg` is defined for floating point only);
/// * f32, f64, f16, bf16: every operation.
pub(crate) fn reduction(
    d: DType,
    op: grid_core::ReduceOp,
    fp8: bool,
) -> Option<(sys::ncclDataType_t, sys::ncclRedOp_t)> {
    use grid_core::ReduceOp as R;
    use sys::ncclRedOp_t as N;
    match d {
        DType::Bool => match op {
            R::Sum | R::Max => Some((sys::ncclDataType_t::ncclUint8, N::ncclMax)),
            R::Prod | R::Min => Some((sys::ncclDataType_t::ncclUint8, N::ncclMin)),
            R::Avg => None,
        },
        DType::F8E4M3 => fp8.then_some((NCCL_FLOAT8E4M3, nccl_op(op))),
        DType::F8E5M2 => fp8.then_some((NCCL_FLOAT8E5M2, nccl_op(op))),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Some((nccl_dtype(d), nccl_op(op))),
        DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64 => {
            (op != R::Avg).then_some((nccl_dtype(d), nccl_op(op)))
        }
    }
}

/// Bytes per element of an NCCL data type (as `nccl.h` defines them).
pub(crate) fn nccl_dtype_size(d: sys::ncclDataType_t) -> usize {
    use sys::ncclDataType_t as N;
    match d {
        N::ncclInt8 | N::ncclUint8 | N::ncclFloat8e4m3 | N::ncclFloat8e5m2 => 1,
        N::ncclFloat16 | N::ncclBfloat16 => 2,
        N::ncclInt32 | N::ncclUint32 | N::ncclFloat32 => 4,
        N::ncclInt64 | N::ncclUint64 | N::ncclFloat64 => 8,
        N::ncclNumTypes => 0,
    }
}

/// The NCCL reduction of a grid-core reduction.
pub(crate) fn nccl_op(op: grid_core::ReduceOp) -> sys::ncclRedOp_t {
    use grid_core::ReduceOp as R;
    use sys::ncclRedOp_t as N;
    match op {
        R::Sum => N::ncclSum,
        R::Prod => N::ncclProd,
        R::Min => N::ncclMin,
        R::Max => N::ncclMax,
        R::Avg => N::ncclAvg,
    }
}

/// The NCCL data type of `T`, after checking that the element sizes agree (the pointer
/// arithmetic NCCL does is `count * size(dtype)` bytes, so a mismatch would be out of bounds).
fn typed<T: NcclElement>(op: &'static str) -> Result<sys::ncclDataType_t> {
    let dt = nccl_dtype(T::DTYPE);
    if nccl_dtype_size(dt) != std::mem::size_of::<T::Device>() {
        return Err(crate::error::internal(
            op,
            &format!(
                "element type {} is {} bytes but NCCL type {dt:?} is {} bytes",
                T::DTYPE,
                std::mem::size_of::<T::Device>(),
                nccl_dtype_size(dt)
            ),
        ));
    }
    Ok(dt)
}

// ------------------------------------------------------------------------------------------------
// Device-memory tokens
// ------------------------------------------------------------------------------------------------

/// Read access to device memory for one NCCL call. Only constructible from a cudarc slice or
/// view, so `ptr` / `count` / `dtype` always describe live device memory (module rule 2).
pub(crate) struct DevIn<'a> {
    ptr: u64,
    count: usize,
    dtype: sys::ncclDataType_t,
    _sync: SyncOnDrop<'a>,
}

/// Write access to device memory for one NCCL call (see [`DevIn`]).
pub(crate) struct DevOut<'a> {
    ptr: u64,
    count: usize,
    dtype: sys::ncclDataType_t,
    _sync: SyncOnDrop<'a>,
}

impl<'a> DevIn<'a> {
    /// Borrows `src` for reading on `stream`: `stream` first waits for earlier writes to `src`
    /// (cudarc's event tracking), and dropping the token records the read on `stream`.
    pub(crate) fn new<T: NcclElement, S: DevicePtr<T::Device>>(
        src: &'a S,
        stream: &'a CudaStream,
    ) -> Result<Self> {
        let dtype = typed::<T>("device buffer")?;
        let count = src.len();
        let (ptr, sync) = guard("device_ptr", || Ok(src.device_ptr(stream)))?;
        forgive_captured_event_waits(stream.context());
        Ok(DevIn {
            ptr,
            count,
            dtype,
            _sync: sync,
        })
    }
    /// Takes a sub-view for reading (see [`DevIn::new`]).
    pub(crate) fn from_view<T: NcclElement>(
        v: CudaView<'a, T::Device>,
        stream: &'a CudaStream,
    ) -> Result<Self> {
        let dtype = typed::<T>("device buffer")?;
        let count = v.len();
        let (ptr, sync) = guard("view_ptr", || Ok(v.view_ptr(stream)))?;
        forgive_captured_event_waits(stream.context());
        Ok(DevIn {
            ptr,
            count,
            dtype,
            _sync: sync,
        })
    }
}

impl<'a> DevOut<'a> {
    /// Takes a mutable sub-view for writing (see [`DevIn::new`]).
    pub(crate) fn from_view<T: NcclElement>(
        v: CudaViewMut<'a, T::Device>,
        stream: &'a CudaStream,
    ) -> Result<Self> {
        let dtype = typed::<T>("device buffer")?;
        let count = v.len();
        let (ptr, sync) = guard("view_ptr_mut", || Ok(v.view_ptr_mut(stream)))?;
        forgive_captured_event_waits(stream.context());
        Ok(DevOut {
            ptr,
            count,
            dtype,
            _sync: sync,
        })
    }
    /// Borrows `dst` for writing on `stream` (see [`DevIn::new`]).
    pub(crate) fn new<T: NcclElement, D: DevicePtrMut<T::Device>>(
        dst: &'a mut D,
        stream: &'a CudaStream,
    ) -> Result<Self> {
        let dtype = typed::<T>("device buffer")?;
        let count = dst.len();
        let (ptr, sync) = guard("device_ptr_mut", || Ok(dst.device_ptr_mut(stream)))?;
        forgive_captured_event_waits(stream.context());
        Ok(DevOut {
            ptr,
            count,
            dtype,
            _sync: sync,
        })
    }
}

/// Clears a `CUDA_ERROR_CAPTURED_EVENT` that cudarc stored in `ctx` (other stored errors stay).
///
/// cudarc orders each buffer's uses across streams with per-buffer events (waits before a use,
/// a record after it) and stores the error of a wait it cannot return, reporting it at the
/// context's next bind. A buffer used by an operation captured into a CUDA graph has its events
/// last recorded in that capture, and CUDA refuses to wait eagerly on such an event
/// (`CUDA_ERROR_CAPTURED_EVENT`) — so the first eager use of that buffer after the capture
/// would fail an unrelated later call. The refused wait ordered the eager use after nothing
/// (the capture ran nothing; a replay of the graph is ordered by the stream it is launched on,
/// which cudarc's events never tracked), so forgetting the error loses no ordering.
pub(crate) fn forgive_captured_event_waits(ctx: &cudarc::driver::CudaContext) {
    if let Err(e) = ctx.check_err() {
        if e.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_CAPTURED_EVENT {
            ctx.record_err::<()>(Err(e));
        } else {
            tracing::debug!("nccl: a buffer's first eager use after a CUDA graph capture: cudarc's wait on its captured event was skipped");
        }
    }
}

/// Reinterprets a token's elements as NCCL data type `dt` of the same size (a reduction's wire
/// type: `Bool` as `ncclUint8`, fp8 as `ncclFloat8e4m3` / `ncclFloat8e5m2`).
fn retyped(
    op: &'static str,
    from: sys::ncclDataType_t,
    dt: sys::ncclDataType_t,
) -> Result<sys::ncclDataType_t> {
    if nccl_dtype_size(from) == nccl_dtype_size(dt) && nccl_dtype_size(dt) > 0 {
        Ok(dt)
    } else {
        Err(crate::error::internal(
            op,
            &format!("reinterpreting {from:?} as {dt:?}: element sizes differ"),
        ))
    }
}

impl DevIn<'_> {
    /// The same memory as NCCL data type `dt`, which must have the same element size (so the
    /// token still describes exactly its memory, rule 2).
    pub(crate) fn retype(mut self, op: &'static str, dt: sys::ncclDataType_t) -> Result<Self> {
        self.dtype = retyped(op, self.dtype, dt)?;
        Ok(self)
    }
}

impl DevOut<'_> {
    /// See [`DevIn::retype`].
    pub(crate) fn retype(mut self, op: &'static str, dt: sys::ncclDataType_t) -> Result<Self> {
        self.dtype = retyped(op, self.dtype, dt)?;
        Ok(self)
    }
}

/// One operation of a grouped point-to-point batch.
pub(crate) enum P2p<'a> {
    /// `ncclSend` of the whole token.
    Send(DevIn<'a>, usize),
    /// `ncclRecv` into the whole token.
    Recv(DevOut<'a>, usize),
}

/// A collective and its buffers. Buffer sizes are checked against the communicator size in
/// [`RawComm::collective`] before NCCL sees the pointers.
pub(crate) enum Coll<'a> {
    /// `ncclAllReduce`; `send: None` means in place (`recv` is also the input).
    AllReduce {
        send: Option<DevIn<'a>>,
        recv: DevOut<'a>,
        op: sys::ncclRedOp_t,
    },
    /// `ncclBroadcast` in place.
    Broadcast { buf: DevOut<'a>, root: usize },
    /// `ncclAllGather`: `recv` holds `size · send` elements.
    AllGather { send: DevIn<'a>, recv: DevOut<'a> },
    /// `ncclReduceScatter`: `send` holds `size · recv` elements.
    ReduceScatter {
        send: DevIn<'a>,
        recv: DevOut<'a>,
        op: sys::ncclRedOp_t,
    },
    /// `ncclAllGather` in place: `buf` holds `size · count` elements and the send buffer is
    /// `buf + rank · count` (NCCL's in-place convention), so nothing is copied.
    AllGatherInPlace { buf: DevOut<'a> },
    /// `ncclReduceScatter` in place: `buf` holds `size · count` input elements and the receive
    /// buffer is `buf + rank · count` (NCCL's in-place convention); the rest of `buf` is left
    /// as NCCL leaves it.
    ReduceScatterInPlace {
        buf: DevOut<'a>,
        op: sys::ncclRedOp_t,
    },
}

// ------------------------------------------------------------------------------------------------
// The owned communicator handle
// ------------------------------------------------------------------------------------------------

/// Per-communicator NCCL configuration (`ncclConfig_t`); see [`crate::NcclConfig`].
#[derive(Debug, Clone, Default)]
pub(crate) struct CommConfig {
    pub(crate) split_share: bool,
    pub(crate) cga_cluster_size: Option<c_int>,
    pub(crate) min_ctas: Option<c_int>,
    pub(crate) max_ctas: Option<c_int>,
    pub(crate) net_name: Option<CString>,
}

/// `NCCL_CONFIG_UNDEF_INT` from `nccl.h`: "not set, use NCCL's default".
const UNDEF_INT: c_int = c_int::MIN;
/// `0xcafebeef`, the magic `NCCL_CONFIG_INITIALIZER` writes.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_VERSION(2, 30, 0)`: the version of the `nccl.h` the bindings were generated from (the
/// `nccl` feature of cudarc 0.19), which `NCCL_CONFIG_INITIALIZER` writes into `version`.
/// NCCL copies at most its own `sizeof(ncclConfig_t)` and reads only the fields its version
/// knows (the struct only grows at the end), so an older libnccl reads the fields it has.
const CONFIG_VERSION: u32 = 2 * 10000 + 30 * 100;

/// What `NCCL_CONFIG_INITIALIZER` produces, with `blocking = 0` (nonblocking: every call returns
/// at once, `ncclInProgress` while it is still working) and the options of `c`. The returned
/// struct borrows `c.net_name`'s bytes: keep `c` alive until the NCCL call returned.
fn nccl_config(c: &CommConfig) -> sys::ncclConfig_t {
    let opt = |v: Option<c_int>| v.unwrap_or(UNDEF_INT);
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: opt(c.cga_cluster_size),
        minCTAs: opt(c.min_ctas),
        maxCTAs: opt(c.max_ctas),
        netName: c
            .net_name
            .as_ref()
            .map(|n| n.as_ptr())
            .unwrap_or(std::ptr::null()),
        splitShare: c_int::from(c.split_share),
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

const LIVE: u8 = 0;
const FINALIZED: u8 = 1;
const ABORTED: u8 = 2;

struct Handle(sys::ncclComm_t);

// SAFETY: an `ncclComm_t` is an opaque handle that NCCL lets any host thread use, one thread at
// a time; `RawComm` only touches it with its mutex held (module rule 3).
unsafe impl Send for Handle {}

/// An owned `ncclComm_t` of a **nonblocking** communicator (`blocking = 0`): every NCCL call on
/// it returns at once (`ncclInProgress` while NCCL is still connecting or enqueueing), so the
/// mutex that serialises calls is only ever held for one short call, never while waiting for
/// peers; waiting happens in [`crate::engine`], which polls [`RawComm::progress`]. Destroyed
/// (finalize, then destroy) or aborted exactly once.
pub(crate) struct RawComm {
    handle: Mutex<Handle>,
    state: AtomicU8,
    rank: AtomicUsize,
    size: AtomicUsize,
}

impl std::fmt::Debug for RawComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawComm")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("state", &self.state_name())
            .finish()
    }
}

fn to_int(op: &'static str, what: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| {
        Error::Invalid(format!(
            "{op}: {what} {v} does not fit NCCL's int (max {})",
            c_int::MAX
        ))
    })
}

impl RawComm {
    /// `ncclCommInitRankConfig` (one id) or `ncclCommInitRankScalable` (several ids, NCCL >=
    /// 2.23, checked by the caller) in nonblocking mode: starts joining the communicator of
    /// `nranks` ranks named by `ids` as `rank` and returns at once; the creation is finished
    /// when [`RawComm::progress`] says `Done` (see [`crate::engine::Watchdog::track`]). The CUDA
    /// context of the device must be current.
    pub(crate) fn init_rank(
        nranks: usize,
        ids: &[[u8; 128]],
        rank: usize,
        cfg: &CommConfig,
    ) -> Result<RawComm> {
        const OP: &str = "ncclCommInitRankConfig";
        let n = to_int(OP, "size", nranks)?;
        let r = to_int(OP, "rank", rank)?;
        let nids = to_int(OP, "number of unique ids", ids.len())?;
        if ids.is_empty() {
            return Err(crate::error::internal(OP, "no unique id"));
        }
        let mut uids: Vec<sys::ncclUniqueId> = ids
            .iter()
            .map(|id| sys::ncclUniqueId {
                internal: id.map(|b| b as std::ffi::c_char),
            })
            .collect();
        let mut config = nccl_config(cfg);
        let comm = if uids.len() == 1 {
            guard(OP, || {
                let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                // SAFETY: `comm` is a valid out-pointer; the id is passed by value; `config` is a
                // fully initialised ncclConfig_t (NCCL_CONFIG_INITIALIZER's values) whose
                // `netName` points into `cfg`, alive for the call; libnccl is loaded (module
                // rule 1). In nonblocking mode NCCL writes the handle before returning
                // ncclInProgress.
                check_progress(
                    OP,
                    unsafe { sys::ncclCommInitRankConfig(&mut comm, n, uids[0], r, &mut config) },
                    None,
                )?;
                Ok(comm)
            })?
        } else {
            guard("ncclCommInitRankScalable", || {
                let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                // SAFETY: as for ncclCommInitRankConfig; `uids` holds exactly `nids` ids, alive
                // for the call (NCCL copies what it needs before returning). The caller checked
                // that the library is NCCL >= 2.23, which exports the symbol (a missing symbol
                // would make cudarc panic, which `guard` turns into an error).
                check_progress(
                    "ncclCommInitRankScalable",
                    unsafe {
                        sys::ncclCommInitRankScalable(
                            &mut comm,
                            n,
                            r,
                            nids,
                            uids.as_mut_ptr(),
                            &mut config,
                        )
                    },
                    None,
                )?;
                Ok(comm)
            })?
        };
        if comm.is_null() {
            return Err(crate::error::internal(OP, "NCCL returned no communicator"));
        }
        Ok(RawComm::wrap(comm, rank, nranks))
    }

    fn wrap(comm: sys::ncclComm_t, rank: usize, size: usize) -> RawComm {
        RawComm {
            handle: Mutex::new(Handle(comm)),
            state: AtomicU8::new(LIVE),
            rank: AtomicUsize::new(rank),
            size: AtomicUsize::new(size),
        }
    }

    /// Rank in this communicator.
    pub(crate) fn rank(&self) -> usize {
        self.rank.load(Ordering::Relaxed)
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }

    /// `"live"`, `"destroyed"` or `"aborted"`.
    pub(crate) fn state_name(&self) -> &'static str {
        match self.state.load(Ordering::Acquire) {
            LIVE => "live",
            FINALIZED => "destroyed",
            _ => "aborted",
        }
    }

    /// True until destroyed or aborted.
    pub(crate) fn is_live(&self) -> bool {
        self.state.load(Ordering::Acquire) == LIVE
    }

    /// Locks the handle of a live communicator.
    fn live(&self, op: &'static str) -> Result<MutexGuard<'_, Handle>> {
        let g = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        match self.state.load(Ordering::Acquire) {
            LIVE => Ok(g),
            FINALIZED => Err(Error::Finalized {
                op,
                state: "destroyed",
            }),
            _ => Err(Error::Finalized {
                op,
                state: "aborted",
            }),
        }
    }

    /// `ncclCommSplit` in nonblocking mode: collective over this communicator; returns at once.
    /// `color = None` passes `NCCL_SPLIT_NOCOLOR` and returns `None`. The new communicator's
    /// rank and size are known once its creation finished ([`RawComm::learn_identity`]).
    /// Needs NCCL >= 2.18 (checked by the caller).
    pub(crate) fn split(
        &self,
        color: Option<c_int>,
        key: c_int,
        cfg: &CommConfig,
    ) -> Result<(Option<RawComm>, Progress)> {
        let h = self.live("split")?;
        let c = color.unwrap_or(NCCL_SPLIT_NOCOLOR);
        let mut config = nccl_config(cfg);
        let (new, progress) = guard("ncclCommSplit", || {
            let mut new: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `h.0` is a live communicator (state checked under the lock); `new` is a
            // valid out-pointer; `config` is a fully initialised ncclConfig_t (see `init_rank`).
            let p = check_progress(
                "ncclCommSplit",
                unsafe { sys::ncclCommSplit(h.0, c, key, &mut new, &mut config) },
                Some(h.0),
            )?;
            Ok((new, p))
        })?;
        drop(h);
        if new.is_null() {
            return Ok((None, progress));
        }
        Ok((Some(RawComm::wrap(new, 0, 0)), progress))
    }

    /// Reads the rank and size NCCL gave this communicator (after its creation finished).
    pub(crate) fn learn_identity(&self) -> Result<(usize, usize)> {
        let h = self.live("split")?;
        let (rank, count) = guard("ncclCommCount", || {
            let (mut rank, mut count): (c_int, c_int) = (0, 0);
            // SAFETY: live handle under the lock whose creation finished; valid out-pointers.
            check(
                "ncclCommUserRank",
                unsafe { sys::ncclCommUserRank(h.0, &mut rank) },
                Some(h.0),
            )?;
            // SAFETY: as above.
            check(
                "ncclCommCount",
                unsafe { sys::ncclCommCount(h.0, &mut count) },
                Some(h.0),
            )?;
            Ok((rank, count))
        })?;
        let (rank, count) = (rank.max(0) as usize, count.max(0) as usize);
        self.rank.store(rank, Ordering::Relaxed);
        self.size.store(count, Ordering::Relaxed);
        Ok((rank, count))
    }

    /// `ncclCommGetAsyncError`: `Done` while no call is in progress and no error was reported,
    /// `InProgress` while NCCL is still working on a call (creation, split, group end,
    /// finalize), the error otherwise. Never blocks.
    pub(crate) fn progress_of(&self, op: &'static str) -> Result<Progress> {
        let h = self.live(op)?;
        guard("ncclCommGetAsyncError", || {
            let mut e = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live handle under the lock; `e` is a valid out-pointer.
            check(
                "ncclCommGetAsyncError",
                unsafe { sys::ncclCommGetAsyncError(h.0, &mut e) },
                Some(h.0),
            )?;
            check_progress("ncclCommGetAsyncError", e, Some(h.0))
        })
    }

    /// Enqueues a collective on `stream`; `InProgress` when the nonblocking communicator is
    /// still working on the call (the caller settles it before the next call). Buffer sizes and roots are re-checked here, next to
    /// the `unsafe` call whose soundness depends on them: the front end validated them already,
    /// so these checks are assertions of this module's invariants, not argument validation.
    pub(crate) fn collective(&self, c: Coll<'_>, stream: &CudaStream) -> Result<Progress> {
        let n = self.size();
        let s = stream.cu_stream() as sys::cudaStream_t;
        match c {
            Coll::AllReduce { send, recv, op } => {
                let count = recv.count;
                let (sp, sdt) = match &send {
                    Some(x) => {
                        same(x.dtype, recv.dtype, x.count, count, "all_reduce")?;
                        (x.ptr, x.dtype)
                    }
                    None => (recv.ptr, recv.dtype),
                };
                let h = self.live("all_reduce")?;
                guard("ncclAllReduce", || {
                    // SAFETY: `sp` and `recv.ptr` address `count` elements of `sdt` (tokens,
                    // rule 2; lengths equal as checked above); live handle under the lock.
                    let r = unsafe {
                        sys::ncclAllReduce(
                            sp as *const c_void,
                            recv.ptr as *mut c_void,
                            count,
                            sdt,
                            op,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclAllReduce", r, Some(h.0))
                })
            }
            Coll::Broadcast { buf, root } => {
                let root = to_int("broadcast", "root", root)?;
                if root as usize >= n {
                    return Err(Error::PeerOutOfRange {
                        op: "broadcast",
                        what: "root",
                        rank: root as usize,
                        size: n,
                    });
                }
                let h = self.live("broadcast")?;
                guard("ncclBroadcast", || {
                    // SAFETY: in place: send and receive are the same `buf.count` elements of
                    // `buf.dtype` (token, rule 2); root < size checked; live handle under lock.
                    let r = unsafe {
                        sys::ncclBroadcast(
                            buf.ptr as *const c_void,
                            buf.ptr as *mut c_void,
                            buf.count,
                            buf.dtype,
                            root,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclBroadcast", r, Some(h.0))
                })
            }
            Coll::AllGather { send, recv } => {
                same(
                    send.dtype,
                    recv.dtype,
                    send.count.saturating_mul(n),
                    recv.count,
                    "all_gather",
                )?;
                let h = self.live("all_gather")?;
                guard("ncclAllGather", || {
                    // SAFETY: `send` has `send.count` elements and `recv` exactly `n · send.count`
                    // (checked above), as ncclAllGather reads and writes; live handle.
                    let r = unsafe {
                        sys::ncclAllGather(
                            send.ptr as *const c_void,
                            recv.ptr as *mut c_void,
                            send.count,
                            send.dtype,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclAllGather", r, Some(h.0))
                })
            }
            Coll::AllGatherInPlace { buf } => {
                let (count, at) = self.in_place_block("all_gather", buf.count, buf.dtype)?;
                let h = self.live("all_gather")?;
                guard("ncclAllGather", || {
                    // SAFETY: `buf` has size · count elements of `buf.dtype` (checked by
                    // `in_place_block`), all of which ncclAllGather writes; the send buffer is
                    // its own block at byte offset rank · count · width, inside it (rank < size):
                    // NCCL's in-place form, which it reads before overwriting; live handle.
                    let r = unsafe {
                        sys::ncclAllGather(
                            (buf.ptr + at) as *const c_void,
                            buf.ptr as *mut c_void,
                            count,
                            buf.dtype,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclAllGather", r, Some(h.0))
                })
            }
            Coll::ReduceScatterInPlace { buf, op } => {
                let (count, at) = self.in_place_block("reduce_scatter", buf.count, buf.dtype)?;
                let h = self.live("reduce_scatter")?;
                guard("ncclReduceScatter", || {
                    // SAFETY: `buf` has size · count elements of `buf.dtype` (checked by
                    // `in_place_block`), the input ncclReduceScatter reads; the receive buffer
                    // is this rank's block at byte offset rank · count · width, inside it:
                    // NCCL's in-place form; live handle under the lock.
                    let r = unsafe {
                        sys::ncclReduceScatter(
                            buf.ptr as *const c_void,
                            (buf.ptr + at) as *mut c_void,
                            count,
                            buf.dtype,
                            op,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclReduceScatter", r, Some(h.0))
                })
            }
            Coll::ReduceScatter { send, recv, op } => {
                same(
                    send.dtype,
                    recv.dtype,
                    send.count,
                    recv.count.saturating_mul(n),
                    "reduce_scatter",
                )?;
                let h = self.live("reduce_scatter")?;
                guard("ncclReduceScatter", || {
                    // SAFETY: `recv` has `recv.count` elements and `send` exactly
                    // `n · recv.count` (checked above); live handle under the lock.
                    let r = unsafe {
                        sys::ncclReduceScatter(
                            send.ptr as *const c_void,
                            recv.ptr as *mut c_void,
                            recv.count,
                            send.dtype,
                            op,
                            h.0,
                            s,
                        )
                    };
                    check_progress("ncclReduceScatter", r, Some(h.0))
                })
            }
        }
    }

    /// The block count and the byte offset of this rank's block of an in-place collective on
    /// `count` elements of `dtype` (`size · block` of them), checked next to the `unsafe` calls
    /// that offset a device pointer by it.
    fn in_place_block(
        &self,
        op: &'static str,
        count: usize,
        dtype: sys::ncclDataType_t,
    ) -> Result<(usize, u64)> {
        let n = self.size().max(1);
        if !count.is_multiple_of(n) {
            return Err(Error::Indivisible {
                op,
                what: "in-place device buffer",
                len: count,
                parts: n,
            });
        }
        let block = count / n;
        let width = match nccl_dtype_size(dtype) {
            0 => return Err(internal(op, "an in-place buffer of no NCCL data type")),
            w => w as u64,
        };
        let offset = (self.rank() as u64)
            .checked_mul(block as u64)
            .and_then(|e| e.checked_mul(width))
            .ok_or_else(|| internal(op, "block offset overflows"))?;
        Ok((block, offset))
    }

    /// Enqueues point-to-point operations between `ncclGroupStart` and `ncclGroupEnd` (always
    /// closed, also on error); `InProgress` as for [`RawComm::collective`]. Peers are re-checked against the size here, next to the `unsafe`
    /// calls (an invariant of this module; the front end validated them already).
    pub(crate) fn p2p_group(
        &self,
        op: &'static str,
        ops: Vec<P2p<'_>>,
        stream: &CudaStream,
    ) -> Result<Progress> {
        for o in &ops {
            let peer = match o {
                P2p::Send(_, p) | P2p::Recv(_, p) => *p,
            };
            if peer >= self.size() {
                return Err(Error::PeerOutOfRange {
                    op,
                    what: "peer",
                    rank: peer,
                    size: self.size(),
                });
            }
        }
        let s = stream.cu_stream() as sys::cudaStream_t;
        let h = self.live(op)?;
        guard("ncclGroupStart", || {
            // SAFETY: no arguments; group state is per thread and closed below on every path.
            check("ncclGroupStart", unsafe { sys::ncclGroupStart() }, None)
        })?;
        let mut result = Ok(());
        for o in &ops {
            let r = match o {
                P2p::Send(b, peer) => guard("ncclSend", || {
                    // SAFETY: `b` addresses `b.count` elements of `b.dtype` (token, rule 2) and
                    // stays borrowed until after ncclGroupEnd (the tokens live in `ops`);
                    // peer < size checked above; live handle under the lock.
                    let r = unsafe {
                        sys::ncclSend(
                            b.ptr as *const c_void,
                            b.count,
                            b.dtype,
                            *peer as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclSend", r, Some(h.0))
                }),
                P2p::Recv(b, peer) => guard("ncclRecv", || {
                    // SAFETY: as for the send, with write access through the `DevOut` token.
                    let r = unsafe {
                        sys::ncclRecv(
                            b.ptr as *mut c_void,
                            b.count,
                            b.dtype,
                            *peer as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclRecv", r, Some(h.0))
                }),
            };
            if let Err(e) = r {
                result = Err(e);
                break;
            }
        }
        let end = guard("ncclGroupEnd", || {
            // SAFETY: closes the group opened above on this thread. In nonblocking mode it may
            // return ncclInProgress: the operations are then still being enqueued and the
            // caller settles the communicator (polls ncclCommGetAsyncError) before its next call.
            check_progress("ncclGroupEnd", unsafe { sys::ncclGroupEnd() }, Some(h.0))
        });
        drop(h);
        // The tokens (and their event records) drop here, after the operations were enqueued.
        drop(ops);
        result.and(end)
    }

    /// Enqueues a [`crate::plan`] (sends, receives, broadcasts, reduces) between
    /// `ncclGroupStart` and `ncclGroupEnd` (always closed, also on error); `InProgress` as for
    /// [`RawComm::collective`]. `send` / `recv` are the operation's whole buffers on this rank
    /// (`None` where the rank has none, for example the receive buffer of a gather off the
    /// root); every call's range is checked against them ([`crate::plan::check`]: in bounds,
    /// writes disjoint, peers below the size) before any pointer is formed. Sends, receives and
    /// broadcasts move the tokens' data type; reduces use `reduction` (the data type and
    /// operation [`reduction`] chose, of the same element size).
    pub(crate) fn run_plan(
        &self,
        op: &'static str,
        calls: &[crate::plan::Call],
        send: Option<&DevIn<'_>>,
        recv: Option<&DevOut<'_>>,
        reduction: Option<(sys::ncclDataType_t, sys::ncclRedOp_t)>,
        stream: &CudaStream,
    ) -> Result<Progress> {
        use crate::plan::Call;
        let moved = match (send, recv) {
            (Some(s), Some(r)) if s.dtype != r.dtype => {
                return Err(Error::Invalid(format!(
                    "{op}: NCCL data types differ ({:?} and {:?})",
                    s.dtype, r.dtype
                )))
            }
            (Some(s), _) => s.dtype,
            (None, Some(r)) => r.dtype,
            (None, None) if calls.is_empty() => return Ok(Progress::Done),
            (None, None) => return Err(crate::error::internal(op, "a plan without buffers")),
        };
        let elem = nccl_dtype_size(moved);
        if let Some((dt, _)) = reduction {
            if nccl_dtype_size(dt) != elem {
                return Err(crate::error::internal(op, "reduction data type size"));
            }
        }
        crate::plan::check(
            op,
            calls,
            self.size(),
            send.map_or(0, |s| s.count),
            recv.map_or(0, |r| r.count),
        )?;
        // Byte addresses of the checked ranges: `base + offset · elem` with `offset + count` at
        // most the token's element count (checked above), so every address lies within (or
        // one past the end of) the token's live device memory.
        let at = |base: u64, offset: usize| base + (offset * elem) as u64;
        let (sp, rp) = (send.map_or(0, |s| s.ptr), recv.map_or(0, |r| r.ptr));
        let s = stream.cu_stream() as sys::cudaStream_t;
        let h = self.live(op)?;
        guard("ncclGroupStart", || {
            // SAFETY: no arguments; group state is per thread and closed below on every path.
            check("ncclGroupStart", unsafe { sys::ncclGroupStart() }, None)
        })?;
        let mut result = Ok(());
        for c in calls {
            let r = match *c {
                Call::Send {
                    peer,
                    offset,
                    count,
                } => guard("ncclSend", || {
                    // SAFETY: `offset..offset + count` lies within the send token (checked by
                    // `plan::check`), whose borrow outlives the group; peer < size checked
                    // there too; live handle under the lock.
                    let r = unsafe {
                        sys::ncclSend(
                            at(sp, offset) as *const c_void,
                            count,
                            moved,
                            peer as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclSend", r, Some(h.0))
                }),
                Call::Recv {
                    peer,
                    offset,
                    count,
                } => guard("ncclRecv", || {
                    // SAFETY: as for the send, within the receive token (write access through
                    // the `DevOut`), disjoint from every other write of the plan.
                    let r = unsafe {
                        sys::ncclRecv(
                            at(rp, offset) as *mut c_void,
                            count,
                            moved,
                            peer as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclRecv", r, Some(h.0))
                }),
                Call::Broadcast {
                    root,
                    send_offset,
                    recv_offset,
                    count,
                } => guard("ncclBroadcast", || {
                    let dst = at(rp, recv_offset);
                    // Off the root NCCL neither checks nor reads the send pointer: it gets the
                    // receive range (NCCL's in-place form).
                    let src = send_offset.map_or(dst, |o| at(sp, o));
                    // SAFETY: both ranges checked by `plan::check` (the read on the root within
                    // the send token, the write within the receive token); root < size.
                    let r = unsafe {
                        sys::ncclBroadcast(
                            src as *const c_void,
                            dst as *mut c_void,
                            count,
                            moved,
                            root as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclBroadcast", r, Some(h.0))
                }),
                Call::Reduce {
                    root,
                    send_offset,
                    recv_offset,
                    count,
                } => guard("ncclReduce", || {
                    let Some((dt, rop)) = reduction else {
                        return Err(crate::error::internal(op, "a reduce without a reduction"));
                    };
                    // Off the root NCCL neither checks nor writes the receive pointer (NULL).
                    let dst =
                        recv_offset.map_or(std::ptr::null_mut(), |o| at(rp, o) as *mut c_void);
                    // SAFETY: the read range within the send token and, on the root, the write
                    // range within the receive token (`plan::check`); `dt` has the tokens'
                    // element size (checked above); root < size; live handle under the lock.
                    let r = unsafe {
                        sys::ncclReduce(
                            at(sp, send_offset) as *const c_void,
                            dst,
                            count,
                            dt,
                            rop,
                            root as c_int,
                            h.0,
                            s,
                        )
                    };
                    check("ncclReduce", r, Some(h.0))
                }),
            };
            if let Err(e) = r {
                result = Err(e);
                break;
            }
        }
        let end = guard("ncclGroupEnd", || {
            // SAFETY: closes the group opened above on this thread (see `p2p_group`).
            check_progress("ncclGroupEnd", unsafe { sys::ncclGroupEnd() }, Some(h.0))
        });
        drop(h);
        result.and(end)
    }

    /// `ncclCommAbort`: frees the communicator at once, interrupting its pending operations.
    /// Returns false when it was already destroyed or aborted. The lock it takes is only ever
    /// held for one nonblocking NCCL call (module docs), never while a thread waits for peers.
    pub(crate) fn abort(&self) -> bool {
        let h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(Ordering::Acquire) != LIVE {
            return false;
        }
        self.state.store(ABORTED, Ordering::Release);
        // SAFETY: the handle is live (state checked under the lock) and is never used again:
        // the state is no longer LIVE, which every other entry point checks under this lock.
        let _ = guard("ncclCommAbort", || Ok(unsafe { sys::ncclCommAbort(h.0) }));
        true
    }

    /// `ncclCommFinalize` in nonblocking mode: starts flushing the communicator's operations;
    /// `InProgress` until [`RawComm::progress_of`] says `Done`, then [`RawComm::destroy`].
    pub(crate) fn finalize(&self) -> Result<Progress> {
        let h = self.live("finalize")?;
        guard("ncclCommFinalize", || {
            // SAFETY: live handle under the lock; finalize only starts the flush here.
            check_progress(
                "ncclCommFinalize",
                unsafe { sys::ncclCommFinalize(h.0) },
                Some(h.0),
            )
        })
    }

    /// `ncclCommDestroy` of a finalized communicator. No-op unless live.
    pub(crate) fn destroy(&self) {
        let h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(Ordering::Acquire) != LIVE {
            return;
        }
        self.state.store(FINALIZED, Ordering::Release);
        // SAFETY: a finalized, live handle (finalize finished, checked by the caller through
        // `progress_of`), destroyed exactly once (the state is no longer LIVE).
        let r = guard("ncclCommDestroy", || {
            check(
                "ncclCommDestroy",
                unsafe { sys::ncclCommDestroy(h.0) },
                None,
            )
        });
        if let Err(e) = r {
            tracing::warn!("nccl: {e}");
        }
    }
}

/// The NCCL communicator as the engine's device runtime sees it.
impl DeviceComm for RawComm {
    fn progress(&self) -> Result<Progress> {
        self.progress_of("watchdog")
    }
    fn abort(&self) {
        RawComm::abort(self);
    }
    fn finalize(&self) -> Result<Progress> {
        RawComm::finalize(self)
    }
    fn destroy(&self) {
        RawComm::destroy(self)
    }
}

/// Enqueues a CUDA host function on `stream` that kicks the watchdog when the device reaches it
/// (right after the operation just enqueued), so a completion is noticed at once instead of at
/// the watchdog's next poll.
pub(crate) fn kick_when_reached(stream: &CudaStream, kicker: Kicker) -> Result<()> {
    let arg = Box::into_raw(Box::new(kicker)) as *mut c_void;
    let r = cuda("cuLaunchHostFunc", || {
        // SAFETY: `kick` is an `extern "C"` function that takes back ownership of `arg` (a
        // leaked `Box<Kicker>`) exactly once, makes no CUDA call (CUDA forbids that in host
        // functions: it takes one short mutex and signals a condition variable) and cannot
        // unwind (panics are caught). The stream is live (owned by `stream`).
        unsafe {
            cudarc::driver::result::stream::launch_host_function(stream.cu_stream(), kick, arg)
        }
    });
    if r.is_err() {
        // SAFETY: the host function was not enqueued, so `arg` was not handed over: reclaim it.
        drop(unsafe { Box::from_raw(arg as *mut Kicker) });
    }
    r
}

unsafe extern "C" fn kick(arg: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: `arg` is the `Box<Kicker>` leaked by `kick_when_reached`; CUDA runs each host
        // function exactly once.
        let k = unsafe { Box::from_raw(arg as *mut Kicker) };
        k.kick();
    });
}

fn same(
    a: sys::ncclDataType_t,
    b: sys::ncclDataType_t,
    expected: usize,
    actual: usize,
    op: &'static str,
) -> Result<()> {
    if a != b {
        return Err(Error::Invalid(format!(
            "{op}: NCCL data types differ ({a:?} and {b:?})"
        )));
    }
    if expected != actual {
        return Err(Error::LengthMismatch {
            op,
            what: "device buffer",
            expected,
            actual,
        });
    }
    Ok(())
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // The engine finalizes and destroys (or aborts) every communicator it tracks before the
        // last reference goes; one still live here was never handed to it (its creation failed
        // before tracking): abort, which never blocks on a peer.
        if self.is_live() {
            self.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config every communicator is created with: NCCL_CONFIG_INITIALIZER's values,
    /// nonblocking, and only the options given set.
    #[test]
    fn config_is_nonblocking_and_leaves_unset_fields_undefined() {
        let c = nccl_config(&CommConfig::default());
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 23000);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.splitShare, 0);
        for v in [
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.trafficClass,
            c.collnetEnable,
            c.CTAPolicy,
            c.shrinkShare,
            c.nvlsCTAs,
            c.nChannelsPerNetPeer,
            c.nvlinkCentricSched,
            c.graphUsageMode,
            c.numRmaCtx,
            c.maxP2pPeers,
        ] {
            assert_eq!(v, c_int::MIN, "NCCL_CONFIG_UNDEF_INT");
        }
        assert!(c.netName.is_null() && c.commName.is_null());

        let net = CString::new("IB").unwrap();
        let set = CommConfig {
            split_share: true,
            cga_cluster_size: Some(2),
            min_ctas: Some(4),
            max_ctas: Some(16),
            net_name: Some(net.clone()),
        };
        let c = nccl_config(&set);
        assert_eq!(
            (
                c.blocking,
                c.splitShare,
                c.cgaClusterSize,
                c.minCTAs,
                c.maxCTAs
            ),
            (0, 1, 2, 4, 16)
        );
        // SAFETY (test): netName points into `set.net_name`, alive here.
        assert_eq!(unsafe { CStr::from_ptr(c.netName) }, net.as_c_str());
    }

    /// The fp8 values of `nccl.h` (`ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11`, NCCL >= 2.24),
    /// and the other values this backend passes, as the header numbers them.
    #[test]
    fn fp8_enum_values_match_nccl_h() {
        use sys::ncclDataType_t as N;
        assert_eq!(NCCL_FLOAT8E4M3 as u32, 10);
        assert_eq!(NCCL_FLOAT8E5M2 as u32, 11);
        let header = [
            (N::ncclInt8, 0),
            (N::ncclUint8, 1),
            (N::ncclInt32, 2),
            (N::ncclUint32, 3),
            (N::ncclInt64, 4),
            (N::ncclUint64, 5),
            (N::ncclFloat16, 6),
            (N::ncclFloat32, 7),
            (N::ncclFloat64, 8),
            (N::ncclBfloat16, 9),
            (N::ncclNumTypes, 12),
        ];
        for (t, v) in header {
            assert_eq!(t as u32, v, "{t:?}");
        }
        use sys::ncclRedOp_t as R;
        for (o, v) in [
            (R::ncclSum, 0),
            (R::ncclProd, 1),
            (R::ncclMax, 2),
            (R::ncclMin, 3),
            (R::ncclAvg, 4),
        ] {
            assert_eq!(o as u32, v, "{o:?}");
        }
    }

    /// What every dtype moves as: its own NCCL type, `Bool` and fp8 as bytes; the sizes agree
    /// with grid-core's.
    #[test]
    fn every_dtype_moves_as_its_type_or_bytes() {
        use sys::ncclDataType_t as N;
        let want = [
            (DType::F32, N::ncclFloat32),
            (DType::F64, N::ncclFloat64),
            (DType::I32, N::ncclInt32),
            (DType::I64, N::ncclInt64),
            (DType::U8, N::ncclUint8),
            (DType::F16, N::ncclFloat16),
            (DType::BF16, N::ncclBfloat16),
            (DType::I8, N::ncclInt8),
            (DType::U32, N::ncclUint32),
            (DType::U64, N::ncclUint64),
            (DType::Bool, N::ncclUint8),
            (DType::F8E4M3, N::ncclUint8),
            (DType::F8E5M2, N::ncclUint8),
        ];
        assert_eq!(want.len(), DType::ALL.len());
        for (d, t) in want {
            assert_eq!(nccl_dtype(d), t, "{d}");
            assert_eq!(nccl_dtype_size(t), d.size_bytes(), "{d}");
        }
    }

    /// The reduction table: the NCCL type and operation of every (dtype, reduction), with and
    /// without fp8 support.
    #[test]
    fn reduction_table() {
        use grid_core::ReduceOp as Op;
        use sys::ncclDataType_t as N;
        use sys::ncclRedOp_t as R;
        for fp8 in [false, true] {
            for d in DType::ALL {
                for op in Op::ALL {
                    let got = reduction(d, op, fp8);
                    let want = match d {
                        DType::Bool => match op {
                            Op::Sum | Op::Max => Some((N::ncclUint8, R::ncclMax)),
                            Op::Prod | Op::Min => Some((N::ncclUint8, R::ncclMin)),
                            Op::Avg => None,
                        },
                        DType::F8E4M3 if fp8 => Some((N::ncclFloat8e4m3, nccl_op(op))),
                        DType::F8E5M2 if fp8 => Some((N::ncclFloat8e5m2, nccl_op(op))),
                        DType::F8E4M3 | DType::F8E5M2 => None,
                        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                            Some((nccl_dtype(d), nccl_op(op)))
                        }
                        _ if op == Op::Avg => None,
                        _ => Some((nccl_dtype(d), nccl_op(op))),
                    };
                    assert_eq!(got, want, "{d} {op} fp8={fp8}");
                    if let Some((t, _)) = got {
                        assert_eq!(nccl_dtype_size(t), d.size_bytes(), "{d}: same element size");
                    }
                }
            }
        }
        assert_eq!(
            reduction(DType::I8, Op::Sum, false),
            Some((N::ncclInt8, R::ncclSum))
        );
        assert_eq!(
            reduction(DType::U64, Op::Max, false),
            Some((N::ncclUint64, R::ncclMax))
        );
    }

    #[test]
    fn retyping_keeps_the_element_size() {
        use sys::ncclDataType_t as N;
        assert_eq!(
            retyped("x", N::ncclUint8, N::ncclFloat8e4m3).unwrap(),
            N::ncclFloat8e4m3
        );
        assert!(retyped("x", N::ncclUint8, N::ncclFloat16).is_err());
        assert!(retyped("x", N::ncclNumTypes, N::ncclNumTypes).is_err());
    }

    #[test]
    fn in_progress_is_not_an_error() {
        assert_eq!(
            check_progress("ncclGroupEnd", sys::ncclResult_t::ncclInProgress, None).unwrap(),
            Progress::InProgress
        );
        assert_eq!(
            check_progress("ncclGroupEnd", sys::ncclResult_t::ncclSuccess, None).unwrap(),
            Progress::Done
        );
    }
}
