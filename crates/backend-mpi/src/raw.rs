//! Every `unsafe` block of the crate lives here: thin, `Result`-returning calls into the MPI C
//! library (through `mpi::ffi`, rsmpi's raw bindings), and the owned handles that free what they
//! own.
//!
//! Why raw calls instead of rsmpi's safe API: rsmpi discards the return codes of the MPI
//! functions (it relies on the default `MPI_ERRORS_ARE_FATAL` handler). This crate installs
//! `MPI_ERRORS_RETURN`, so every return code must be checked, which only the raw calls allow.
//!
//! The functions here are *safe* to call: each checks, before its `unsafe` block, every fact the
//! C call relies on for memory safety (buffer lengths against counts, `int` ranges). The front
//! end (`grid_core::Comm`) validates the arguments before, to give users precise errors.
//!
//! Thread safety: MPI is initialised with `MPI_THREAD_MULTIPLE` (checked in
//! [`crate::MpiRuntime::init`]; initialisation fails otherwise), under which every MPI function
//! may be called from any thread concurrently. That is the invariant behind the `Send`/`Sync`
//! impls below.

use grid_core::{DType, HostBuffer, HostSlice, HostSliceMut};
use mpi::ffi;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set just before `MPI_Finalize` runs; afterwards no MPI call may be made (handles are leaked,
/// operations report `Finalized`).
pub(crate) static FINALIZED: AtomicBool = AtomicBool::new(false);

/// True once MPI was finalized (by our runtime or by anyone else).
pub(crate) fn finalized() -> bool {
    if FINALIZED.load(Ordering::Acquire) {
        return true;
    }
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, even before MPI_Init and after
    // MPI_Finalize; `flag` is a valid out pointer.
    unsafe { ffi::MPI_Finalized(&mut flag) };
    flag != 0
}

/// A failure of a raw call: an MPI error code with its class and message, or an argument that
/// cannot be passed to MPI at all (no code).
#[derive(Debug, Clone)]
pub(crate) struct RawError {
    pub(crate) message: String,
    /// The MPI error code returned.
    pub(crate) code: Option<i32>,
    /// The MPI error class of the code (`MPI_Error_class`) and its description.
    pub(crate) class: Option<String>,
}

impl RawError {
    pub(crate) fn msg(message: String) -> RawError {
        RawError {
            message,
            code: None,
            class: None,
        }
    }

    fn mpi(code: c_int) -> RawError {
        let mut class: c_int = 0;
        // SAFETY: MPI_Error_class may be called with any code; `class` is a valid out pointer.
        let rc = unsafe { ffi::MPI_Error_class(code, &mut class) };
        let class = (rc == 0).then(|| match error_text(class) {
            Some(t) => format!("class {class}: {t}"),
            None => format!("class {class}"),
        });
        RawError {
            message: error_string(code),
            code: Some(code),
            class,
        }
    }
}

type R<T> = Result<T, RawError>;

/// MPI's description of an error code or class, if it has one.
fn error_text(code: c_int) -> Option<String> {
    let mut buf = vec![0 as c_char; 512]; // MPI_MAX_ERROR_STRING is 256 in Open MPI and MPICH
    let mut len: c_int = 0;
    // SAFETY: `buf` has 512 bytes, more than MPI_MAX_ERROR_STRING, which bounds what MPI writes;
    // `len` is a valid out pointer.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return None;
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
    Some(
        String::from_utf8_lossy(&bytes)
            .trim_end_matches('\0')
            .to_string(),
    )
}

fn error_string(code: c_int) -> String {
    match error_text(code) {
        Some(t) => format!("{t} (MPI error code {code})"),
        None => format!("MPI error code {code}"),
    }
}

#[inline]
fn rc(code: c_int) -> R<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(RawError::mpi(code))
    }
}

#[inline]
fn count(n: usize) -> R<c_int> {
    c_int::try_from(n).map_err(|_| {
        RawError::msg(format!(
            "{n} elements exceed the MPI count limit of {} (split the buffer)",
            c_int::MAX
        ))
    })
}

#[inline]
fn int(what: &str, n: usize) -> R<c_int> {
    c_int::try_from(n).map_err(|_| RawError::msg(format!("{what} {n} does not fit an MPI int")))
}

/// The MPI datatype that carries `dtype`. Half types travel as 16-bit unsigned integers: MPI has
/// no half-precision type, and moving bits is exact. Reductions never see them (see
/// [`Reduce`]).
#[inline]
fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the constant datatype handles exported by rsmpi's C shim; they are
    // initialised statics of the C library.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
        }
    }
}

/// The four MPI reductions this crate uses (average is a sum followed by a division).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Prod,
    Min,
    Max,
}

#[inline]
fn op(reduce: Reduce, dtype: DType) -> R<ffi::MPI_Op> {
    if matches!(dtype, DType::F16 | DType::BF16) {
        return Err(RawError::msg(format!(
            "internal: {dtype} reaches an MPI reduction (halves are reduced through f32)"
        )));
    }
    // SAFETY: reading the constant operation handles exported by rsmpi's C shim.
    Ok(unsafe {
        match reduce {
            Reduce::Sum => ffi::RSMPI_SUM,
            Reduce::Prod => ffi::RSMPI_PROD,
            Reduce::Min => ffi::RSMPI_MIN,
            Reduce::Max => ffi::RSMPI_MAX,
        }
    })
}

/// The value of `MPI_IN_PLACE`, which rsmpi does not export: `(void *) 1` in Open MPI and
/// `(void *) -1` in MPICH and its derivatives, told apart by `MPI_Get_library_version` once.
/// Any other library gets an error (the callers then stage through a copy).
pub(crate) fn in_place() -> R<*const c_void> {
    static IN_PLACE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let v = IN_PLACE.get_or_init(|| {
        let version = library_version();
        if version.contains("Open MPI") {
            Some(1)
        } else if version.contains("MPICH") {
            Some(usize::MAX)
        } else {
            None
        }
    });
    v.map(|a| a as *const c_void).ok_or_else(|| {
        RawError::msg(format!(
            "MPI_IN_PLACE is not known for this MPI library ({}); supported: Open MPI, MPICH",
            library_version().lines().next().unwrap_or("unknown")
        ))
    })
}

/// True when [`in_place`] knows this library's `MPI_IN_PLACE`.
pub(crate) fn in_place_supported() -> bool {
    in_place().is_ok()
}

fn library_version() -> String {
    // MPI_MAX_LIBRARY_VERSION_STRING is 256 in Open MPI and 8192 in MPICH.
    let mut buf = vec![0 as c_char; 8193];
    let mut len: c_int = 0;
    // SAFETY: `buf` is larger than MPI_MAX_LIBRARY_VERSION_STRING of the supported libraries,
    // which bounds what MPI writes; `len` is a valid out pointer. Callable before MPI_Init.
    let rc = unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return String::new();
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Scratch memory handed to MPI instead of the pointer of an empty slice: an empty `Vec<u8>`
/// points at address 1, which Open MPI reads as `MPI_IN_PLACE`.
static EMPTY: [u64; 1] = [0];

#[inline]
fn cptr(s: &HostSlice<'_>) -> *const c_void {
    if s.is_empty() {
        EMPTY.as_ptr() as *const c_void
    } else {
        s.as_ptr() as *const c_void
    }
}

/// The mutable counterpart of [`cptr`]. MPI writes nothing through the scratch pointer: it is
/// only used with a count of zero.
#[inline]
fn mptr(s: &mut HostSliceMut<'_>) -> *mut c_void {
    if s.is_empty() {
        EMPTY.as_ptr() as *mut c_void
    } else {
        s.as_mut_ptr() as *mut c_void
    }
}

#[inline]
fn same(what: &str, a: (DType, usize), b: (DType, usize)) -> R<()> {
    if a == b {
        Ok(())
    } else {
        Err(RawError::msg(format!(
            "internal: {what}: {} {} vs {} {}",
            a.1, a.0, b.1, b.0
        )))
    }
}

// ------------------------------------------------------------------------------------------
// Communicator handles
// ------------------------------------------------------------------------------------------

/// An owned MPI communicator handle (never a predefined one), freed on drop.
#[derive(Debug)]
pub(crate) struct Comm {
    raw: ffi::MPI_Comm,
    /// `MPI_Comm_size`, cached: it never changes and is needed for every length check.
    size: usize,
}

// SAFETY: an `MPI_Comm` is a handle (a pointer to an opaque object under Open MPI, an int under
// MPICH). With MPI_THREAD_MULTIPLE, which `MpiRuntime::init` requires, MPI functions may be
// called with the same handle from any thread, concurrently; the handle itself is never
// mutated after creation except by `Drop`, which has exclusive access.
unsafe impl Send for Comm {}
// SAFETY: see `Send`; shared access only passes the handle by value to thread-safe MPI calls.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if finalized() {
            return; // MPI_Finalize released every communicator; no MPI call is allowed now
        }
        // SAFETY: `self.raw` is a valid communicator created by this module and owned by this
        // value alone (never a predefined communicator); nothing uses it after drop.
        // Errors cannot be reported from drop; MPI_ERRORS_RETURN makes them non-fatal.
        unsafe { ffi::MPI_Comm_free(&mut self.raw) };
    }
}

impl Comm {
    /// A duplicate of `MPI_COMM_WORLD` with `MPI_ERRORS_RETURN` installed on both.
    pub(crate) fn world_dup() -> R<Comm> {
        // SAFETY: MPI is initialised (the caller is `MpiRuntime::init`); the predefined world
        // handle and error handler are valid statics.
        unsafe {
            rc(ffi::MPI_Comm_set_errhandler(
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_ERRORS_RETURN,
            ))?;
            rc(ffi::MPI_Comm_set_errhandler(
                ffi::RSMPI_COMM_SELF,
                ffi::RSMPI_ERRORS_RETURN,
            ))?;
        }
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `out` is a valid out pointer; MPI_Comm_dup writes it on success. The
        // duplicate inherits the error handler of its parent.
        unsafe {
            rc(ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, out.as_mut_ptr()))?;
            Comm::owned(out.assume_init())
        }
    }

    fn adopt(raw: ffi::MPI_Comm) -> R<Option<Comm>> {
        // SAFETY: comparing a handle with the predefined null handle reads a static.
        if raw == unsafe { ffi::RSMPI_COMM_NULL } {
            return Ok(None);
        }
        let c = Comm::owned(raw)?;
        // SAFETY: `c.raw` is a valid new communicator; children inherit the error handler, this
        // sets it explicitly in case an implementation does not.
        unsafe {
            rc(ffi::MPI_Comm_set_errhandler(
                c.raw,
                ffi::RSMPI_ERRORS_RETURN,
            ))?
        };
        Ok(Some(c))
    }

    /// `MPI_Comm_split`; `color = None` passes `MPI_UNDEFINED` and gets `None`.
    pub(crate) fn split(&self, color: Option<usize>, key: usize) -> R<Option<Comm>> {
        let color = match color {
            // SAFETY: reading the MPI_UNDEFINED constant.
            None => unsafe { ffi::RSMPI_UNDEFINED },
            Some(c) => int("colour", c)?,
        };
        let key = int("key", key)?;
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is a valid communicator, `out` a valid out pointer written by
        // MPI_Comm_split on success (MPI_COMM_NULL for MPI_UNDEFINED).
        let raw = unsafe {
            rc(ffi::MPI_Comm_split(self.raw, color, key, out.as_mut_ptr()))?;
            out.assume_init()
        };
        Comm::adopt(raw)
    }

    /// `MPI_Comm_create` over this communicator for the group of `ranks` (ranks of this
    /// communicator, in the order they get in the new one). Collective over this communicator.
    pub(crate) fn create(&self, ranks: &[usize]) -> R<Option<Comm>> {
        let size = self.size()?;
        let list = ranks
            .iter()
            .map(|&r| {
                if r < size {
                    int("rank", r)
                } else {
                    Err(RawError::msg(format!(
                        "internal: rank {r} outside 0..{size}"
                    )))
                }
            })
            .collect::<R<Vec<c_int>>>()?;
        let n = count(list.len())?;
        let mut parent = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: valid communicator; out pointers valid; `list` holds `n` valid ranks of the
        // parent group (checked above). Both groups are freed before returning.
        unsafe {
            rc(ffi::MPI_Comm_group(self.raw, parent.as_mut_ptr()))?;
            let mut parent = parent.assume_init();
            let r = rc(ffi::MPI_Group_incl(
                parent,
                n,
                list.as_ptr(),
                group.as_mut_ptr(),
            ));
            if let Err(e) = r {
                ffi::MPI_Group_free(&mut parent);
                return Err(e);
            }
            let mut group = group.assume_init();
            let r = rc(ffi::MPI_Comm_create(self.raw, group, out.as_mut_ptr()));
            ffi::MPI_Group_free(&mut group);
            ffi::MPI_Group_free(&mut parent);
            r?;
            Comm::adopt(out.assume_init())
        }
    }

    pub(crate) fn rank(&self) -> R<usize> {
        let mut r: c_int = 0;
        // SAFETY: valid communicator and out pointer.
        unsafe { rc(ffi::MPI_Comm_rank(self.raw, &mut r))? };
        usize::try_from(r).map_err(|_| RawError::msg(format!("MPI returned rank {r}")))
    }

    /// Takes ownership of a valid, non-null communicator handle (freed on drop).
    fn owned(raw: ffi::MPI_Comm) -> R<Comm> {
        let mut c = Comm { raw, size: 0 };
        let mut s: c_int = 0;
        // SAFETY: `raw` is a valid communicator (the caller created it); `s` a valid out pointer.
        // If this fails, `c` is dropped and frees the handle.
        unsafe { rc(ffi::MPI_Comm_size(c.raw, &mut s))? };
        c.size = usize::try_from(s).map_err(|_| RawError::msg(format!("MPI returned size {s}")))?;
        Ok(c)
    }

    #[inline]
    pub(crate) fn size(&self) -> R<usize> {
        Ok(self.size)
    }

    /// The `MPI_COMM_WORLD` rank of every member, in this communicator's rank order.
    pub(crate) fn world_ranks(&self) -> R<Vec<usize>> {
        let n = self.size()?;
        let ranks: Vec<c_int> = (0..n).map(|r| int("rank", r)).collect::<R<_>>()?;
        let mut out: Vec<c_int> = vec![0; n];
        let mut mine = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        let mut world = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
        // SAFETY: valid communicators and out pointers; `ranks` and `out` both hold `n`
        // entries, the count passed. Both groups are freed before returning.
        unsafe {
            rc(ffi::MPI_Comm_group(self.raw, mine.as_mut_ptr()))?;
            let mut mine = mine.assume_init();
            let r = rc(ffi::MPI_Comm_group(
                ffi::RSMPI_COMM_WORLD,
                world.as_mut_ptr(),
            ));
            if let Err(e) = r {
                ffi::MPI_Group_free(&mut mine);
                return Err(e);
            }
            let mut world = world.assume_init();
            let r = rc(ffi::MPI_Group_translate_ranks(
                mine,
                count(n)?,
                ranks.as_ptr(),
                world,
                out.as_mut_ptr(),
            ));
            ffi::MPI_Group_free(&mut world);
            ffi::MPI_Group_free(&mut mine);
            r?;
        }
        out.into_iter()
            .map(|r| usize::try_from(r).map_err(|_| RawError::msg(format!("no world rank ({r})"))))
            .collect()
    }

    // --------------------------------------------------------------------------------------
    // Blocking operations on borrowed host memory
    // --------------------------------------------------------------------------------------

    #[inline]
    pub(crate) fn all_reduce(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        r: Reduce,
    ) -> R<()> {
        same(
            "all_reduce",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
        )?;
        let (n, dt, op) = (
            count(send.len())?,
            datatype(send.dtype()),
            op(r, send.dtype())?,
        );
        // SAFETY: both buffers hold `n` elements of the datatype passed (checked above) and
        // stay borrowed for the whole blocking call.
        unsafe {
            rc(ffi::MPI_Allreduce(
                cptr(&send),
                mptr(&mut recv),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    /// `MPI_Allreduce(MPI_IN_PLACE, buf, ...)`: the result replaces `buf`, with no copy.
    #[inline]
    pub(crate) fn all_reduce_in_place(&self, mut buf: HostSliceMut<'_>, r: Reduce) -> R<()> {
        let place = in_place()?;
        let (n, dt, op) = (
            count(buf.len())?,
            datatype(buf.dtype()),
            op(r, buf.dtype())?,
        );
        // SAFETY: `buf` holds `n` elements of the datatype passed and stays exclusively
        // borrowed for the whole blocking call; `place` is this library's MPI_IN_PLACE, which
        // MPI never dereferences.
        unsafe {
            rc(ffi::MPI_Allreduce(
                place,
                mptr(&mut buf),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn broadcast(&self, mut buf: HostSliceMut<'_>, root: usize) -> R<()> {
        let (n, dt, root) = (count(buf.len())?, datatype(buf.dtype()), int("root", root)?);
        // SAFETY: `buf` holds `n` elements of `dt` and stays borrowed for the call.
        unsafe { rc(ffi::MPI_Bcast(mptr(&mut buf), n, dt, root, self.raw)) }
    }

    #[inline]
    pub(crate) fn all_gather(&self, send: HostSlice<'_>, mut recv: HostSliceMut<'_>) -> R<()> {
        let size = self.size()?;
        same(
            "all_gather",
            (send.dtype(), send.len() * size),
            (recv.dtype(), recv.len()),
        )?;
        let (n, dt) = (count(send.len())?, datatype(send.dtype()));
        count(recv.len())?;
        // SAFETY: `send` holds n elements and `recv` size·n elements of `dt` (checked above),
        // which is what MPI_Allgather reads and writes; both borrowed for the call.
        unsafe {
            rc(ffi::MPI_Allgather(
                cptr(&send),
                n,
                dt,
                mptr(&mut recv),
                n,
                dt,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn reduce_scatter(
        &self,
        send: HostSlice<'_>,
        mut recv: HostSliceMut<'_>,
        r: Reduce,
    ) -> R<()> {
        let size = self.size()?;
        same(
            "reduce_scatter",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len() * size),
        )?;
        let (n, dt, op) = (
            count(recv.len())?,
            datatype(recv.dtype()),
            op(r, recv.dtype())?,
        );
        count(send.len())?;
        // SAFETY: `send` holds size·n and `recv` n elements of `dt` (checked above).
        unsafe {
            rc(ffi::MPI_Reduce_scatter_block(
                cptr(&send),
                mptr(&mut recv),
                n,
                dt,
                op,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn all_to_all(&self, send: HostSlice<'_>, mut recv: HostSliceMut<'_>) -> R<()> {
        let size = self.size()?.max(1);
        same(
            "all_to_all",
            (send.dtype(), send.len()),
            (recv.dtype(), recv.len()),
        )?;
        if !send.len().is_multiple_of(size) {
            return Err(RawError::msg(format!(
                "internal: all_to_all of {} elements over {size}",
                send.len()
            )));
        }
        let (n, dt) = (count(send.len() / size)?, datatype(send.dtype()));
        count(send.len())?;
        // SAFETY: both buffers hold size·n elements of `dt` (checked above).
        unsafe {
            rc(ffi::MPI_Alltoall(
                cptr(&send),
                n,
                dt,
                mptr(&mut recv),
                n,
                dt,
                self.raw,
            ))
        }
    }

    #[inline]
    pub(crate) fn barrier(&self) -> R<()> {
        // SAFETY: valid communicator.
        unsafe { rc(ffi::MPI_Barrier(self.raw)) }
    }

    #[inline]
    pub(crate) fn send(&self, buf: HostSlice<'_>, peer: usize, tag: u32) -> R<()> {
        let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
        let (peer, tag) = (int("peer", peer)?, int("tag", tag as usize)?);
        // SAFETY: `buf` holds n elements of `dt`, borrowed for the blocking call.
        unsafe { rc(ffi::MPI_Send(cptr(&buf), n, dt, peer, tag, self.raw)) }
    }

    /// Receives into `buf`; returns the number of elements that arrived.
    #[inline]
    pub(crate) fn recv(&self, mut buf: HostSliceMut<'_>, peer: usize, tag: u32) -> R<usize> {
        let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
        let (peer, tag) = (int("peer", peer)?, int("tag", tag as usize)?);
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
        let mut got: c_int = 0;
        // SAFETY: `buf` holds n elements of `dt` (MPI writes at most n, else MPI_ERR_TRUNCATE);
        // `status` is written by MPI_Recv on success and only read after that.
        unsafe {
            rc(ffi::MPI_Recv(
                mptr(&mut buf),
                n,
                dt,
                peer,
                tag,
                self.raw,
                status.as_mut_ptr(),
            ))?;
            rc(ffi::MPI_Get_count(status.as_ptr(), dt, &mut got))?;
        }
        usize::try_from(got).map_err(|_| RawError::msg(format!("MPI_Get_count returned {got}")))
    }

    /// Posts every send and receive, then waits for all of them. Borrowed buffers are safe
    /// because this function does not return before every posted request completed.
    pub(crate) fn batch(&self, ops: &mut [P2p<'_, '_>]) -> R<()> {
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(ops.len());
        let mut first_err = None;
        for op in ops.iter_mut() {
            let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            let posted = match op {
                P2p::Send { buf, peer, tag } => (|| {
                    let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
                    let (p, t) = (int("peer", *peer)?, int("tag", *tag as usize)?);
                    // SAFETY: `buf` holds n elements of `dt` and is borrowed until this
                    // function returns, which is after the request completed (waitall below).
                    unsafe {
                        rc(ffi::MPI_Isend(
                            cptr(buf),
                            n,
                            dt,
                            p,
                            t,
                            self.raw,
                            req.as_mut_ptr(),
                        ))
                    }
                })(),
                P2p::Recv { buf, peer, tag } => (|| {
                    let (n, dt) = (count(buf.len())?, datatype(buf.dtype()));
                    let (p, t) = (int("peer", *peer)?, int("tag", *tag as usize)?);
                    // SAFETY: as for sends; the receive buffer is exclusively borrowed.
                    unsafe {
                        rc(ffi::MPI_Irecv(
                            mptr(buf),
                            n,
                            dt,
                            p,
                            t,
                            self.raw,
                            req.as_mut_ptr(),
                        ))
                    }
                })(),
            };
            match posted {
                // SAFETY: MPI_Isend/MPI_Irecv wrote the request on success.
                Ok(()) => reqs.push(unsafe { req.assume_init() }),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        let n = count(reqs.len())?;
        // SAFETY: `reqs` holds n requests posted above; statuses are ignored. Waiting on all of
        // them before returning keeps every borrowed buffer alive while MPI uses it.
        let waited = unsafe {
            rc(ffi::MPI_Waitall(
                n,
                reqs.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            ))
        };
        match first_err {
            Some(e) => Err(e),
            None => waited,
        }
    }

    /// Terminates every process of the job (`MPI_Abort`); used by the test launcher after a
    /// rank failed, so that the other ranks do not wait for it forever.
    pub(crate) fn abort_world(code: i32) {
        if finalized() {
            return;
        }
        // SAFETY: MPI is initialised and not finalized (checked); aborting is always allowed.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
    }
}

/// One operation of [`Comm::batch`].
pub(crate) enum P2p<'s, 'b> {
    Send {
        buf: HostSlice<'b>,
        peer: usize,
        tag: u32,
    },
    Recv {
        buf: &'s mut HostSliceMut<'b>,
        peer: usize,
        tag: u32,
    },
}

// ------------------------------------------------------------------------------------------
// Nonblocking operations on owned host memory
// ------------------------------------------------------------------------------------------

/// What a nonblocking operation runs.
pub(crate) enum Immediate {
    /// `bufs[0]` is the input, `bufs[1]` the result.
    AllReduce(Reduce),
    /// `bufs[0]` reduced in place (`MPI_IN_PLACE`).
    AllReduceInPlace(Reduce),
    /// `bufs[0]` in place.
    Broadcast(usize),
    /// `bufs[0]` input block, `bufs[1]` result.
    AllGather,
    /// `bufs[0]` input, `bufs[1]` this rank's block.
    ReduceScatter(Reduce),
    /// `bufs[0]` input, `bufs[1]` result.
    AllToAll,
    /// No buffers.
    Barrier,
    /// `bufs[0]` sent.
    Send(usize, u32),
    /// `bufs[0]` received into.
    Recv(usize, u32),
}

/// A started nonblocking MPI operation that owns its buffers until it completed.
///
/// Invariant: while `req` is active, the heap memory of every buffer in `bufs` is in use by MPI.
/// The buffers are only reachable through this value; they are neither read, written, moved out
/// nor freed before the request completed (`wait`, a successful `test`, or `Drop`, which waits).
/// Moving a `Pending` moves the `Vec` headers, not the heap memory MPI holds pointers into.
pub(crate) struct Pending {
    req: ffi::MPI_Request,
    done: bool,
    bufs: Vec<HostBuffer>,
    /// For receives: the element count that arrived.
    pub(crate) received: Option<usize>,
    is_recv: bool,
    dtype: DType,
}

// SAFETY: the request handle may be tested or waited on from any thread under
// MPI_THREAD_MULTIPLE; the owned buffers are plain `Vec`s (Send).
unsafe impl Send for Pending {}

impl Comm {
    /// Starts `what` on owned buffers. Checks lengths against the communicator size before
    /// handing pointers to MPI.
    pub(crate) fn start(&self, what: Immediate, mut bufs: Vec<HostBuffer>) -> R<Pending> {
        let size = self.size()?.max(1);
        let need = |k: usize| -> R<()> {
            if bufs.len() == k {
                Ok(())
            } else {
                Err(RawError::msg(format!(
                    "internal: {k} buffers expected, got {}",
                    bufs.len()
                )))
            }
        };
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        let dtype = bufs.first().map(|b| b.dtype()).unwrap_or(DType::U8);
        let dt = datatype(dtype);
        let is_recv = matches!(what, Immediate::Recv(..));
        match what {
            Immediate::AllReduce(r) => {
                need(2)?;
                same(
                    "iall_reduce",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                let (n, op) = (count(bufs[0].len())?, op(r, dtype)?);
                let (s, d) = two(&mut bufs);
                // SAFETY: both owned buffers hold n elements of `dt`; they move into the
                // returned `Pending`, which keeps them untouched until completion.
                unsafe {
                    rc(ffi::MPI_Iallreduce(
                        s,
                        d,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::AllReduceInPlace(r) => {
                need(1)?;
                let place = in_place()?;
                let (n, op) = (count(bufs[0].len())?, op(r, dtype)?);
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements of `dt`; it moves into the returned
                // `Pending`, which keeps it untouched until completion; `place` is MPI_IN_PLACE.
                unsafe {
                    rc(ffi::MPI_Iallreduce(
                        place,
                        p,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::Broadcast(root) => {
                need(1)?;
                let (n, root) = (count(bufs[0].len())?, int("root", root)?);
                let p = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Ibcast(p, n, dt, root, self.raw, req.as_mut_ptr()))? };
            }
            Immediate::AllGather => {
                need(2)?;
                same(
                    "iall_gather",
                    (bufs[0].dtype(), bufs[0].len() * size),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                let n = count(bufs[0].len())?;
                count(bufs[1].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: send holds n, recv size·n elements of `dt`; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Iallgather(
                        s,
                        n,
                        dt,
                        d,
                        n,
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::ReduceScatter(r) => {
                need(2)?;
                same(
                    "ireduce_scatter",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len() * size),
                )?;
                let (n, op) = (count(bufs[1].len())?, op(r, dtype)?);
                count(bufs[0].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: send holds size·n, recv n elements; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Ireduce_scatter_block(
                        s,
                        d,
                        n,
                        dt,
                        op,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::AllToAll => {
                need(2)?;
                same(
                    "iall_to_all",
                    (bufs[0].dtype(), bufs[0].len()),
                    (bufs[1].dtype(), bufs[1].len()),
                )?;
                if !bufs[0].len().is_multiple_of(size) {
                    return Err(RawError::msg(
                        "internal: all_to_all length not divisible".into(),
                    ));
                }
                let n = count(bufs[0].len() / size)?;
                count(bufs[0].len())?;
                let (s, d) = two(&mut bufs);
                // SAFETY: both hold size·n elements; kept alive by `Pending`.
                unsafe {
                    rc(ffi::MPI_Ialltoall(
                        s,
                        n,
                        dt,
                        d,
                        n,
                        dt,
                        self.raw,
                        req.as_mut_ptr(),
                    ))?
                };
            }
            Immediate::Barrier => {
                need(0)?;
                // SAFETY: valid communicator and out pointer.
                unsafe { rc(ffi::MPI_Ibarrier(self.raw, req.as_mut_ptr()))? };
            }
            Immediate::Send(peer, tag) => {
                need(1)?;
                let (n, p, t) = (
                    count(bufs[0].len())?,
                    int("peer", peer)?,
                    int("tag", tag as usize)?,
                );
                let s = cptr(&bufs[0].as_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Isend(s, n, dt, p, t, self.raw, req.as_mut_ptr()))? };
            }
            Immediate::Recv(peer, tag) => {
                need(1)?;
                let (n, p, t) = (
                    count(bufs[0].len())?,
                    int("peer", peer)?,
                    int("tag", tag as usize)?,
                );
                let d = mptr(&mut bufs[0].as_mut_slice());
                // SAFETY: the owned buffer holds n elements; kept alive by `Pending`.
                unsafe { rc(ffi::MPI_Irecv(d, n, dt, p, t, self.raw, req.as_mut_ptr()))? };
            }
        }
        Ok(Pending {
            // SAFETY: every branch above returned early unless the MPI call succeeded and
            // wrote the request.
            req: unsafe { req.assume_init() },
            done: false,
            bufs,
            received: None,
            is_recv,
            dtype,
        })
    }
}

/// Pointers of an input and an output buffer (distinct `Vec`s, so no aliasing).
fn two(bufs: &mut [HostBuffer]) -> (*const c_void, *mut c_void) {
    let (a, b) = bufs.split_at_mut(1);
    (cptr(&a[0].as_slice()), mptr(&mut b[0].as_mut_slice()))
}

impl Pending {
    fn complete(&mut self, status: &ffi::MPI_Status) -> R<()> {
        self.done = true;
        if self.is_recv {
            let mut got: c_int = 0;
            // SAFETY: `status` was filled by the completed MPI_Wait/MPI_Test.
            unsafe { rc(ffi::MPI_Get_count(status, datatype(self.dtype), &mut got))? };
            self.received = usize::try_from(got).ok();
        }
        Ok(())
    }

    /// Non-blocking completion test (`MPI_Test`).
    pub(crate) fn test(&mut self) -> R<bool> {
        if self.done {
            return Ok(true);
        }
        if finalized() {
            return Err(RawError::msg(
                "MPI was finalized while the operation was pending".into(),
            ));
        }
        let mut flag: c_int = 0;
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
        // SAFETY: `req` is an active request owned by this value; out pointers are valid.
        unsafe { rc(ffi::MPI_Test(&mut self.req, &mut flag, status.as_mut_ptr()))? };
        if flag != 0 {
            // SAFETY: zero-initialised and written by MPI_Test on completion.
            let status = unsafe { status.assume_init() };
            self.complete(&status)?;
        }
        Ok(self.done)
    }

    /// Blocks until completion (`MPI_Wait`) and hands the buffers back.
    pub(crate) fn wait(mut self) -> R<(Vec<HostBuffer>, Option<usize>)> {
        if !self.done {
            if finalized() {
                return Err(RawError::msg(
                    "MPI was finalized while the operation was pending".into(),
                ));
            }
            let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
            // SAFETY: `req` is an active request owned by this value.
            let r = unsafe { rc(ffi::MPI_Wait(&mut self.req, status.as_mut_ptr())) };
            // An error from MPI_Wait still completes (frees) the request.
            self.done = true;
            r?;
            // SAFETY: zero-initialised and written by MPI_Wait.
            let status = unsafe { status.assume_init() };
            self.complete(&status)?;
        }
        Ok((std::mem::take(&mut self.bufs), self.received))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if finalized() {
            // MPI may still hold pointers into the buffers and can no longer be asked: leak
            // them rather than free memory that might be written.
            std::mem::forget(std::mem::take(&mut self.bufs));
            return;
        }
        // SAFETY: `req` is active and owned; waiting keeps the buffers alive until MPI is done.
        let r = unsafe { ffi::MPI_Wait(&mut self.req, ffi::RSMPI_STATUS_IGNORE) };
        if r != 0 {
            // The request state is unknown: leak the buffers to stay memory safe.
            std::mem::forget(std::mem::take(&mut self.bufs));
        }
    }
}

/// The job's world size and this process's world rank as the launcher's environment gives
/// them, without touching MPI.
pub(crate) fn env_world() -> Option<(usize, usize)> {
    let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let size = get("OMPI_COMM_WORLD_SIZE").or_else(|| get("PMI_SIZE"))?;
    let rank = get("OMPI_COMM_WORLD_RANK")
        .or_else(|| get("PMI_RANK"))
        .unwrap_or(0);
    Some((size, rank))
}

/// Marks MPI as finalized from now on (called right before `MPI_Finalize`).
pub(crate) fn mark_finalized() {
    FINALIZED.store(true, Ordering::Release);
}
