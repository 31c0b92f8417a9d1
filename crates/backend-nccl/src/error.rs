//! Conversions of cudarc and NCCL failures (and panics) into [`grid_core::Error::Library`]:
//! the backend, the operation, the communicator, the library's code and class (the
//! `ncclResult_t` or `CUresult` name) and its message.

use cudarc::nccl::sys::ncclResult_t;
use grid_core::{Error, LibraryError};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Backend name used in every error of this crate.
pub(crate) const BACKEND: &str = "nccl";

/// A library failure of this backend (no code or class known).
pub(crate) fn lib(op: &'static str, message: impl Into<String>) -> Error {
    LibraryError::new(BACKEND, op, message).into()
}

/// A broken internal invariant (never caused by arguments: the front end validated them).
pub(crate) fn internal(op: &'static str, what: &str) -> Error {
    LibraryError::new(
        BACKEND,
        op,
        format!("internal error ({what}); please report"),
    )
    .class("internal")
    .into()
}

/// Runs `f`, turning a panic (cudarc panics on a missing library or symbol) into
/// [`Error::Library`] of class `panic`. The last line of defence: [`crate::probe`] checks
/// first. Every call into cudarc in this crate goes through it (directly or through [`cuda`]).
pub(crate) fn guard<T>(
    op: &'static str,
    f: impl FnOnce() -> grid_core::Result<T>,
) -> grid_core::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic payload".into());
            Err(
                LibraryError::new(BACKEND, op, format!("cudarc panicked (caught): {msg}"))
                    .class("panic")
                    .into(),
            )
        }
    }
}

/// An NCCL result code of NCCL function `func`, with NCCL's description and its last-error
/// text: class = the `ncclResult_t` name, code = its number.
pub(crate) fn nccl_err(func: &'static str, code: ncclResult_t, text: &str, last: &str) -> Error {
    let hint = match code {
        ncclResult_t::ncclRemoteError => " (a peer rank failed or a network connection broke)",
        ncclResult_t::ncclUnhandledCudaError => " (a CUDA call inside NCCL failed)",
        ncclResult_t::ncclSystemError => " (a system call or the network failed)",
        ncclResult_t::ncclInvalidUsage => " (the ranks called NCCL inconsistently)",
        _ => "",
    };
    let mut message = format!("{text}{hint}");
    if !last.is_empty() && last != text {
        message.push_str("; last error: ");
        message.push_str(last);
    }
    LibraryError::new(BACKEND, func, message)
        .code(code as i64)
        .class(format!("{code:?}"))
        .into()
}

/// A CUDA driver error: class = the `CUresult` name, code = its number.
pub(crate) fn driver(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    LibraryError::new(BACKEND, op, format!("CUDA driver error {e}"))
        .code(e.0 as i64)
        .class(format!("{:?}", e.0))
        .into()
}

/// Runs a cudarc driver call under [`guard`] and converts its error.
pub(crate) fn cuda<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, cudarc::driver::DriverError>,
) -> grid_core::Result<T> {
    guard(op, || f().map_err(|e| driver(op, e)))
}

/// Puts a library failure in the context of the communicator operation it happened in: the
/// operation becomes `op` (the library function that failed, when different, leads the
/// message) and the communicator's name is filled in. Other errors pass unchanged.
pub(crate) fn annotate(e: Error, op: &'static str, comm: &str) -> Error {
    match e {
        Error::Library(mut l) => {
            if l.op != op {
                l.message = format!("{}: {}", l.op, l.message);
                l.op = op;
            }
            if l.comm.is_empty() {
                l.comm = comm.to_string();
            }
            Error::Library(l)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_library_errors() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r: grid_core::Result<()> = guard("probe", || {
            panic!("Unable to dynamically load the \"nccl\" shared library")
        });
        std::panic::set_hook(prev);
        let e = r.unwrap_err();
        assert_eq!(
            e.to_string(),
            "nccl: probe failed (panic): cudarc panicked (caught): Unable to dynamically load the \"nccl\" shared library"
        );
        assert_eq!(guard("ok", || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn nccl_codes_keep_name_number_and_text() {
        let e = nccl_err(
            "ncclAllReduce",
            ncclResult_t::ncclRemoteError,
            "remote process exited",
            "socket closed",
        );
        let Error::Library(l) = &e else {
            panic!("not a library error: {e:?}")
        };
        assert_eq!(l.backend, "nccl");
        assert_eq!(l.op, "ncclAllReduce");
        assert_eq!(l.code, Some(6));
        assert_eq!(l.class.as_deref(), Some("ncclRemoteError"));
        assert_eq!(
            e.to_string(),
            "nccl: ncclAllReduce failed (ncclRemoteError, code 6): remote process exited (a peer rank failed or a network connection broke); last error: socket closed"
        );
        assert!(e.is_communication());
    }

    #[test]
    fn annotation_names_operation_and_communicator_once() {
        let e = nccl_err(
            "ncclAllReduce",
            ncclResult_t::ncclInvalidUsage,
            "invalid usage",
            "",
        );
        let a = annotate(e, "all_reduce", "tp");
        assert_eq!(
            a.to_string(),
            "nccl: all_reduce on communicator 'tp' failed (ncclInvalidUsage, code 5): ncclAllReduce: invalid usage (the ranks called NCCL inconsistently)"
        );
        // Annotating again (an outer layer) changes nothing.
        assert_eq!(annotate(a.clone(), "all_reduce", "other"), a);
        // Other errors pass unchanged.
        let t = Error::Timeout {
            op: "barrier",
            millis: 5,
            peer: None,
            at: None,
        };
        assert_eq!(annotate(t.clone(), "barrier", "world"), t);
        // An error already named after the operation keeps its message.
        let l = annotate(lib("split", "inconsistent"), "split", "world");
        assert_eq!(
            l.to_string(),
            "nccl: split on communicator 'world' failed: inconsistent"
        );
        let i = internal("recv", "slot");
        assert_eq!(
            i.to_string(),
            "nccl: recv failed (internal): internal error (slot); please report"
        );
    }
}
