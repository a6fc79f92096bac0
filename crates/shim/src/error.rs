//! The one error type of the library and its mapping to `ncclResult_t`.
//!
//! Every failure that flashcomm itself detects becomes an [`Error`]: a result code and a message.
//! [`Error::report`] logs it once at WARN (under the error's subsystem) and records it for
//! `ncclGetLastError`; the export then returns [`Error::code`].
//!
//! Owns: [`Error`], [`Kind`], [`error_string`], [`code_name`].
//! May import: `logging`, `last_error`.

use std::fmt;

use flashcomm_nccl_sys::ncclResult_t;

use crate::logging::Subsys;

/// Why a call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A bad argument: null communicator, unknown datatype or operator, null buffer.
    InvalidArgument,
    /// A call that cannot work here, e.g. a function the real library lacks.
    InvalidUsage,
    /// The real library could not be found or loaded; a set-up exchange failed.
    System,
    /// A CUDA call of flashcomm failed.
    Cuda,
    /// A peer gave up, was aborted, or ran a different collective (reported by the device).
    Remote,
    /// A wait outlasted `FLASHCOMM_TIMEOUT_MS` (reported by the device; no limit by default).
    Timeout,
    /// A broken invariant or a caught panic.
    Internal,
}

/// A failure detected by flashcomm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Error {
    kind: Kind,
    subsys: Subsys,
    message: String,
    /// `Some(name)`: the real library lacks function `name`.
    missing_function: Option<&'static str>,
}

impl Error {
    fn new(kind: Kind, subsys: Subsys, message: impl Into<String>) -> Self {
        Error {
            kind,
            subsys,
            message: message.into(),
            missing_function: None,
        }
    }

    /// `ncclInvalidArgument`.
    pub(crate) fn invalid_argument(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::InvalidArgument, subsys, message)
    }

    /// `ncclSystemError`.
    pub(crate) fn system(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::System, subsys, message)
    }

    /// `ncclInvalidUsage`.
    pub(crate) fn invalid_usage(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::InvalidUsage, subsys, message)
    }

    /// `ncclUnhandledCudaError`.
    pub(crate) fn cuda(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::Cuda, subsys, message)
    }

    /// `ncclRemoteError`.
    pub(crate) fn remote(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::Remote, subsys, message)
    }

    /// `ncclTimeout`.
    pub(crate) fn timeout(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::Timeout, subsys, message)
    }

    /// `ncclInternalError`.
    pub(crate) fn internal(subsys: Subsys, message: impl Into<String>) -> Self {
        Error::new(Kind::Internal, subsys, message)
    }

    /// `ncclInvalidUsage` because the real library lacks `function`.
    pub(crate) fn missing_function(function: &'static str, message: impl Into<String>) -> Self {
        Error {
            missing_function: Some(function),
            ..Error::new(Kind::InvalidUsage, Subsys::Init, message)
        }
    }

    /// Whether the real library lacks the called function (and nothing else went wrong).
    pub(crate) fn is_missing_function(&self) -> bool {
        self.missing_function.is_some()
    }

    /// The message, as `ncclGetLastError` returns it.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// The code the export returns.
    pub(crate) fn code(&self) -> ncclResult_t {
        match self.kind {
            Kind::InvalidArgument => ncclResult_t::ncclInvalidArgument,
            Kind::InvalidUsage => ncclResult_t::ncclInvalidUsage,
            Kind::System => ncclResult_t::ncclSystemError,
            Kind::Internal => ncclResult_t::ncclInternalError,
            Kind::Cuda => ncclResult_t::ncclUnhandledCudaError,
            Kind::Remote => ncclResult_t::ncclRemoteError,
            Kind::Timeout => ncclResult_t::ncclTimeout,
        }
    }

    /// Records the error for `ncclGetLastError` and logs it at WARN; returns its code. Recorded
    /// first, so that the failure keeps its message even if the log line cannot be written.
    pub(crate) fn report(&self) -> ncclResult_t {
        crate::last_error::record(self.message());
        crate::logging::warn(self.subsys, self.message());
        self.code()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The name of a result code (`ncclInvalidArgument`), or its number.
pub(crate) fn code_name(code: u32) -> String {
    const NAMES: [&str; 9] = [
        "ncclSuccess",
        "ncclUnhandledCudaError",
        "ncclSystemError",
        "ncclInternalError",
        "ncclInvalidArgument",
        "ncclInvalidUsage",
        "ncclRemoteError",
        "ncclInProgress",
        "ncclTimeout",
    ];
    NAMES
        .get(code as usize)
        .map_or_else(|| format!("result code {code}"), |n| n.to_string())
}

/// NCCL's own wording for each result code (`ncclGetErrorString`), so that programs matching on
/// the text behave as with NCCL. Works without the real library.
pub(crate) fn error_string(code: u32) -> &'static std::ffi::CStr {
    match code {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"timeout",
        _ => c"unknown result code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let e = Error::invalid_argument(Subsys::Coll, "x");
        assert_eq!(e.code(), ncclResult_t::ncclInvalidArgument);
        assert_eq!(
            Error::system(Subsys::Init, "x").code(),
            ncclResult_t::ncclSystemError
        );
        assert_eq!(
            Error::internal(Subsys::Init, "x").code(),
            ncclResult_t::ncclInternalError
        );
        let m = Error::missing_function("ncclFoo", "no ncclFoo");
        assert!(m.is_missing_function());
        assert_eq!(m.code(), ncclResult_t::ncclInvalidUsage);
        assert!(!Error::system(Subsys::Init, "x").is_missing_function());
        assert_eq!(
            Error::remote(Subsys::Coll, "x").code(),
            ncclResult_t::ncclRemoteError
        );
        assert_eq!(
            Error::timeout(Subsys::Coll, "x").code(),
            ncclResult_t::ncclTimeout
        );
        assert_eq!(
            Error::cuda(Subsys::Coll, "x").code(),
            ncclResult_t::ncclUnhandledCudaError
        );
        assert_eq!(
            Error::invalid_usage(Subsys::Coll, "x").code(),
            ncclResult_t::ncclInvalidUsage
        );
    }

    #[test]
    fn error_strings_cover_every_code() {
        for code in 0..ncclResult_t::ncclNumResults.0 {
            assert_ne!(
                error_string(code).to_bytes(),
                b"unknown result code",
                "{code}"
            );
        }
        assert_eq!(error_string(9).to_bytes(), b"unknown result code");
        assert_eq!(error_string(u32::MAX).to_bytes(), b"unknown result code");
    }
}
