//! Every `unsafe` block of the crate lives in this module and its submodules: thin,
//! `Result`-returning calls into the MPI C library (through `mpi::ffi`, rsmpi's raw bindings),
//! and the owned handles that free what they own.
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
//! impls of [`Comm`] and [`Pending`].

use grid_core::{DType, HostSlice, HostSliceMut};
use mpi::ffi;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

// Shared support (errors, conversions, pointers, the finalized flag) is here; the calls are in
// `comm` (handles, blocking calls) and `pending` (nonblocking calls owning their buffers).
mod comm;
pub(crate) mod peer_read;
mod pending;
mod wait;

pub(crate) use comm::{Comm, P2p};
pub(crate) use pending::{Immediate, Pending};
pub(crate) use wait::Stop;

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

/// The per-rank counts and displacements (prefix sums) of a vector collective, as the C `int`s
/// MPI takes, after checking that `counts` has one entry per rank and sums to `len` (the
/// buffer's length). A count or a displacement above `i32::MAX` is an error naming it (MPI's
/// counts and displacements are `int`s; passing it would wrap).
fn layout(what: &str, counts: &[usize], len: usize, size: usize) -> R<(Vec<c_int>, Vec<c_int>)> {
    if counts.len() != size {
        return Err(RawError::msg(format!(
            "internal: {what}: {} counts for {size} ranks",
            counts.len()
        )));
    }
    let mut c = Vec::with_capacity(size);
    let mut d = Vec::with_capacity(size);
    let mut at = 0usize;
    for (j, &n) in counts.iter().enumerate() {
        let limit = |kind: &str, v: usize| {
            RawError::msg(format!(
                "{what}: the {kind} of rank {j}'s block is {v} elements, above the MPI limit of \
                 {} (MPI counts and displacements are C ints; split the operation)",
                c_int::MAX
            ))
        };
        c.push(c_int::try_from(n).map_err(|_| limit("count", n))?);
        d.push(c_int::try_from(at).map_err(|_| limit("displacement", at))?);
        at = at
            .checked_add(n)
            .ok_or_else(|| RawError::msg(format!("internal: {what}: counts overflow")))?;
    }
    if at != len {
        return Err(RawError::msg(format!(
            "internal: {what}: counts sum to {at}, the buffer holds {len}"
        )));
    }
    Ok((c, d))
}

/// The counts and displacements of `size` equal blocks of `n` elements (a rooted gather or
/// scatter run as its vector form).
fn equal_layout(what: &str, n: usize, size: usize) -> R<(Vec<c_int>, Vec<c_int>)> {
    let len = n
        .checked_mul(size)
        .ok_or_else(|| RawError::msg(format!("internal: {what}: {size} blocks of {n} overflow")))?;
    layout(what, &vec![n; size], len, size)
}

#[inline]
fn int(what: &str, n: usize) -> R<c_int> {
    c_int::try_from(n).map_err(|_| RawError::msg(format!("{what} {n} does not fit an MPI int")))
}

/// The MPI datatype that carries `dtype`. Half types travel as 16-bit unsigned integers and
/// bool and fp8 as bytes: MPI has no such types, and moving bits is exact. Reductions never see
/// halves or fp8 (see [`op`]); bool reduces as bytes.
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
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::U32 => ffi::RSMPI_UINT32_T,
            DType::U64 => ffi::RSMPI_UINT64_T,
            // Bytes: bool reduces as unsigned bytes (MPI_MAX / MPI_MIN, see `stage`); fp8 is
            // only moved.
            DType::Bool | DType::F8E4M3 | DType::F8E5M2 => ffi::RSMPI_UINT8_T,
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
    if matches!(
        dtype,
        DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
    ) {
        return Err(RawError::msg(format!(
            "internal: {dtype} reaches an MPI reduction (halves are reduced through f32, fp8 \
             is never reduced)"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_prefix_sums_checked_against_the_buffer() {
        let (c, d) = layout("t", &[2, 0, 3], 5, 3).expect("valid layout");
        assert_eq!((c, d), (vec![2, 0, 3], vec![0, 2, 2]));
        let (c, d) = equal_layout("t", 4, 3).expect("valid layout");
        assert_eq!((c, d), (vec![4, 4, 4], vec![0, 4, 8]));
        // One entry per rank, and the sum must be the buffer's length.
        let e = layout("t", &[1, 2], 3, 3).expect_err("2 counts for 3 ranks");
        assert!(e.message.contains("2 counts for 3 ranks"), "{}", e.message);
        let e = layout("t", &[1, 2, 3], 7, 3).expect_err("sum 6 against 7");
        assert!(
            e.message.contains("sum to 6, the buffer holds 7"),
            "{}",
            e.message
        );
    }

    #[test]
    fn counts_and_displacements_above_i32_max_are_errors_not_wraps() {
        let big = i32::MAX as usize + 1;
        let e = layout("all_to_all_v", &[1, big], big + 1, 2).expect_err("count above i32::MAX");
        assert!(
            e.message
                .contains("the count of rank 1's block is 2147483648 elements")
                && e.message.contains("2147483647"),
            "{}",
            e.message
        );
        // Each count fits, but the displacement of the last block does not.
        let half = i32::MAX as usize;
        let e = layout("all_gather_v", &[half, 1, 1], half + 2, 3).expect_err("displacement");
        assert!(
            e.message
                .contains("the displacement of rank 2's block is 2147483648"),
            "{}",
            e.message
        );
        let e = equal_layout("gather", 1 << 30, 4).expect_err("gather displacement");
        assert!(
            e.message.contains("displacement of rank 2's block"),
            "{}",
            e.message
        );
        assert!(equal_layout("gather", usize::MAX, 2).is_err());
    }
}
