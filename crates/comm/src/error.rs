//! The communicator's error type.

/// Everything that can go wrong in the communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A caller passed something invalid (null buffer, bad count, unsupported combination).
    InvalidArgument(String),
    /// The communicator is in a state where the call is not allowed (aborted, failed earlier).
    InvalidUsage(String),
    /// This communicator, call or machine cannot use flashcomm's kernels; the caller should pass
    /// the call through to the real NCCL.
    Unsupported(String),
    /// A CUDA driver call failed: the one CUDA error type, [`flashcomm_gpu::Error`], wrapped
    /// (always its `Cuda` variant: a missing driver is [`Error::Unsupported`]).
    Cuda(flashcomm_gpu::Error),
    /// The exchange with the other ranks failed.
    Bootstrap(String),
    /// A peer gave up, was aborted, or ran a different collective (reported by the device).
    Remote(String),
    /// A wait of this rank outlasted the configured timeout (`FLASHCOMM_TIMEOUT_MS`; there is
    /// none by default).
    Timeout(String),
    /// A broken invariant.
    Internal(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::InvalidUsage(m) => write!(f, "invalid usage: {m}"),
            Error::Unsupported(m) => write!(f, "not supported by flashcomm kernels: {m}"),
            Error::Cuda(e) => e.fmt(f),
            Error::Bootstrap(m) => write!(f, "exchange between ranks failed: {m}"),
            Error::Remote(m) => write!(f, "remote error: {m}"),
            Error::Timeout(m) => write!(f, "timeout: {m}"),
            Error::Internal(m) => write!(f, "internal error: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<flashcomm_kernels::Error> for Error {
    fn from(e: flashcomm_kernels::Error) -> Self {
        match e {
            flashcomm_kernels::Error::Cuda(e) => e.into(),
            other => Error::Unsupported(other.to_string()),
        }
    }
}

impl From<flashcomm_gpu::Error> for Error {
    fn from(e: flashcomm_gpu::Error) -> Self {
        match e {
            e @ flashcomm_gpu::Error::Cuda { .. } => Error::Cuda(e),
            other => Error::Unsupported(other.to_string()),
        }
    }
}
