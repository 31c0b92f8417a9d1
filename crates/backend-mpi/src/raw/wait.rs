//! Completing MPI requests under a time limit: the completion loop of every nonblocking call
//! (`MPI_Testall` with a short spin, then yields, then short sleeps), and `MPI_Cancel` for
//! receives.
//!
//! Memory safety: none of these functions frees or touches a buffer. A request that is still
//! active when [`wait_all`] gives up keeps every buffer it was posted with in use by MPI; the
//! caller must then either cancel it ([`cancel_all`]) and see it complete, or never release its
//! buffers (end the job, or leak them).

use super::{rc, RawError, FINALIZED, R};
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Why a wait gave up with requests still active.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The time limit passed.
    Timeout,
    /// The communicator was aborted on this rank.
    Abort,
}

/// Tests before the first clock read: a call that completes within them costs no clock read.
const SPINS: u32 = 64;
/// After the spins, the loop yields the core between tests for this long (what a blocking
/// Open MPI call does when the node is oversubscribed), then sleeps [`NAP`] between tests.
pub(crate) const YIELD_FOR: Duration = Duration::from_millis(100);
/// The sleep between tests once an operation waited longer than [`YIELD_FOR`]: it delays the
/// progress of a long operation by at most this much per step, and costs no CPU.
pub(crate) const NAP: Duration = Duration::from_micros(200);

/// Tests `reqs` until every one completed (`Ok(Ok(()))`, statuses in `statuses`), `limit`
/// passed (measured from the first test; `None`: no limit) or `abort` is set. On `Ok(Err(_))`
/// the requests are left as they were (`MPI_Testall` completes all of them or none).
pub(crate) fn wait_all(
    reqs: &mut [ffi::MPI_Request],
    statuses: &mut [ffi::MPI_Status],
    limit: Option<Duration>,
    abort: &AtomicBool,
) -> R<Result<(), Stop>> {
    if reqs.len() != statuses.len() {
        return Err(RawError::msg(format!(
            "internal: {} requests, {} statuses",
            reqs.len(),
            statuses.len()
        )));
    }
    let n = super::count(reqs.len())?;
    let mut spins = 0u32;
    let mut start: Option<Instant> = None;
    loop {
        let mut flag: c_int = 0;
        // SAFETY: `reqs` holds `n` request handles (active ones posted by this crate, or
        // MPI_REQUEST_NULL), `statuses` room for `n` statuses, `flag` a valid out pointer.
        // Testing does not touch the buffers the requests use. One request goes through
        // MPI_Test, which returns the request's own error code (MPI_Testall reports
        // MPI_ERR_IN_STATUS and leaves the code in the status).
        let code = unsafe {
            if n == 1 {
                ffi::MPI_Test(reqs.as_mut_ptr(), &mut flag, statuses.as_mut_ptr())
            } else {
                ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, statuses.as_mut_ptr())
            }
        };
        if code != ffi::MPI_SUCCESS as c_int {
            return Err(in_status(code, statuses));
        }
        if flag != 0 {
            return Ok(Ok(()));
        }
        if abort.load(Ordering::Relaxed) {
            return Ok(Err(Stop::Abort));
        }
        if spins < SPINS {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        if FINALIZED.load(Ordering::Acquire) {
            return Err(RawError::msg(
                "MPI was finalized while the operation was pending".into(),
            ));
        }
        let now = Instant::now();
        let waited = now.duration_since(*start.get_or_insert(now));
        if limit.is_some_and(|l| waited >= l) {
            return Ok(Err(Stop::Timeout));
        }
        if waited < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
}

/// The error of a failed test: with `MPI_ERR_IN_STATUS`, the first request's own error (other
/// than `MPI_ERR_PENDING`), whose message names the real cause (`MPI_ERR_TRUNCATE`, ...).
fn in_status(code: c_int, statuses: &[ffi::MPI_Status]) -> RawError {
    if code == ffi::MPI_ERR_IN_STATUS as c_int {
        let pending = ffi::MPI_ERR_PENDING as c_int;
        let ok = ffi::MPI_SUCCESS as c_int;
        if let Some(s) = statuses
            .iter()
            .find(|s| s.MPI_ERROR != ok && s.MPI_ERROR != pending)
        {
            return RawError::mpi(s.MPI_ERROR);
        }
    }
    RawError::mpi(code)
}

/// The null request handle (what a slot holds before MPI writes a request into it).
pub(crate) fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading the predefined null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// A zeroed status for [`wait_all`] (on the stack: no allocation per call).
#[inline]
pub(crate) fn status() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers, for which all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// A zeroed status array for [`wait_all`].
pub(crate) fn statuses(n: usize) -> Vec<ffi::MPI_Status> {
    (0..n).map(|_| status()).collect()
}

/// Asks MPI to cancel every active request of `reqs` (receives; MPI cannot cancel a collective,
/// and Open MPI's ob1 does not cancel sends) and waits up to `grace` for each to complete,
/// cancelled or not. Returns, per request, whether it was cancelled (`Some(false)`: it completed
/// normally, its status is in `statuses`; `None`: still active after `grace`, left as it is).
pub(crate) fn cancel_all(
    reqs: &mut [ffi::MPI_Request],
    statuses: &mut [ffi::MPI_Status],
    grace: Duration,
) -> R<Vec<Option<bool>>> {
    let null = null_request();
    for r in reqs.iter_mut() {
        if *r != null {
            // SAFETY: `r` is an active request handle; cancelling does not free it.
            rc(unsafe { ffi::MPI_Cancel(r) })?;
        }
    }
    let never = AtomicBool::new(false);
    let mut out = Vec::with_capacity(reqs.len());
    for (r, st) in reqs.iter_mut().zip(statuses.iter_mut()) {
        let done = match wait_all(
            std::slice::from_mut(r),
            std::slice::from_mut(st),
            Some(grace),
            &never,
        ) {
            Ok(d) => d,
            // The request completed with an error (and was freed): not cancelled.
            Err(_) => {
                out.push(Some(false));
                continue;
            }
        };
        match done {
            Ok(()) => {
                let mut flag: c_int = 0;
                // SAFETY: `st` was written by the completing test.
                rc(unsafe { ffi::MPI_Test_cancelled(st, &mut flag) })?;
                out.push(Some(flag != 0));
            }
            Err(_) => out.push(None),
        }
    }
    Ok(out)
}
