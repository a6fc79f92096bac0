//! Streams: the handle NCCL callers pass, the default and per-thread streams, and the queries
//! and waits on a stream's work (its graph capture is in `graph`).

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::{Error, check, cuda};

/// A raw stream handle as NCCL callers pass it (`cudaStream_t` and `CUstream` are the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(pub sys::CUstream);

// SAFETY: a stream handle is an opaque token that the driver accepts from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; it is only passed by value to the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// The legacy default stream.
    pub fn null() -> Stream {
        Stream(std::ptr::null_mut())
    }

    /// A new non-blocking stream in the current context (never destroyed: used for tests and
    /// internal work that lives as long as the process).
    pub fn create() -> Result<Stream, Error> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(cuda("creating a stream"))
    }

    /// Whether work is being captured into a graph on this stream.
    pub fn is_capturing(&self) -> Result<bool, Error> {
        // SAFETY: the stream handle came from the caller as a valid stream of the current context
        // (or a special value the driver accepts).
        let st = unsafe { result::stream::is_capturing(self.0) }
            .map_err(cuda("querying stream capture"))?;
        Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`): needs no
    /// creation, so it is there when a stream of our own could not be made.
    pub fn per_thread() -> Stream {
        Stream(2usize as sys::CUstream)
    }

    /// `Ok(true)` when all work queued on the stream has finished.
    pub fn is_idle(&self) -> Result<bool, Error> {
        // SAFETY: a valid stream handle of the current context (or a special value the driver
        // accepts).
        let r = unsafe { sys::cuStreamQuery(self.0) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "querying a stream").map(|()| false),
        }
    }

    /// Blocks until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), Error> {
        // SAFETY: valid stream handle of the current context.
        unsafe { result::stream::synchronize(self.0) }.map_err(cuda("synchronizing a stream"))
    }
}
