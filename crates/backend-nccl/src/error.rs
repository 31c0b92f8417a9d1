//! Conversions of cudarc and NCCL failures (and panics) into [`grid_core::Error`].

use cudarc::nccl::sys::ncclResult_t;
use grid_core::Error;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Backend name used in every error of this crate.
pub(crate) const BACKEND: &str = "nccl";

/// Runs `f`, turning a panic (cudarc panics on a missing library or symbol) into
/// [`Error::Backend`]. The last line of defence: [`crate::probe`] checks first. Every call into
/// cudarc in this crate goes through it (directly or through [`cuda`]).
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
            Err(Error::Backend {
                backend: BACKEND,
                op,
                message: format!("cudarc panicked (caught): {msg}"),
            })
        }
    }
}

/// An NCCL result code with NCCL's description and its last-error text.
pub(crate) fn nccl_err(op: &'static str, code: ncclResult_t, text: &str, last: &str) -> Error {
    let hint = match code {
        ncclResult_t::ncclRemoteError => " (a peer rank failed or a network connection broke)",
        ncclResult_t::ncclUnhandledCudaError => " (a CUDA call inside NCCL failed)",
        ncclResult_t::ncclSystemError => " (a system call or the network failed)",
        ncclResult_t::ncclInvalidUsage => " (the ranks called NCCL inconsistently)",
        _ => "",
    };
    let mut message = format!("{code:?}{hint}: {text}");
    if !last.is_empty() && last != text {
        message.push_str("; last error: ");
        message.push_str(last);
    }
    Error::Backend {
        backend: BACKEND,
        op,
        message,
    }
}

/// A CUDA driver error.
pub(crate) fn driver(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: format!("CUDA driver error {e}"),
    }
}

/// Runs a cudarc driver call under [`guard`] and converts its error.
pub(crate) fn cuda<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, cudarc::driver::DriverError>,
) -> grid_core::Result<T> {
    guard(op, || f().map_err(|e| driver(op, e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_backend_errors() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r: grid_core::Result<()> = guard("probe", || {
            panic!("Unable to dynamically load the \"nccl\" shared library")
        });
        std::panic::set_hook(prev);
        let e = r.unwrap_err();
        assert_eq!(
            e.to_string(),
            "nccl: probe failed: cudarc panicked (caught): Unable to dynamically load the \"nccl\" shared library"
        );
        assert_eq!(guard("ok", || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn nccl_codes_explained() {
        let e = nccl_err(
            "ncclAllReduce",
            ncclResult_t::ncclRemoteError,
            "remote process exited",
            "socket closed",
        );
        assert_eq!(
            e.to_string(),
            "nccl: ncclAllReduce failed: ncclRemoteError (a peer rank failed or a network connection broke): remote process exited; last error: socket closed"
        );
    }
}
