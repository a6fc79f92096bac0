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

    /// Enqueues a wait, in stream order, until the 32-bit word at device address `addr` reaches
    /// `value` as the driver compares (`CU_STREAM_WAIT_VALUE_GEQ`: `(word - value) as i32 >= 0`,
    /// so counters may wrap). No kernel runs for it: the stream's front end polls the word.
    ///
    /// # Safety
    /// `addr` must be a 4-byte aligned device address of memory mapped into the current context
    /// (device memory, or host memory registered as device-mapped) that stays valid until the
    /// wait has completed; `self` must belong to the current context.
    pub unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<(), Error> {
        let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the caller guarantees a valid, aligned, mapped address and a stream of the
        // current context; the driver reads the word only.
        let r = unsafe { sys::cuStreamWaitValue32_v2(self.0, addr, value, flags) };
        check(r, "enqueuing a stream wait on a flag")
    }

    /// Enqueues, in stream order, a system-wide memory fence and then the write of `value` to the
    /// 32-bit word at device address `addr` (`CU_STREAM_WRITE_VALUE_DEFAULT`): everything the
    /// stream wrote before is visible to any observer that sees the new value.
    ///
    /// # Safety
    /// As [`Stream::wait_value32`]; the word is written, so nothing else may own it.
    pub unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<(), Error> {
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: the caller guarantees a valid, aligned, mapped address it may write and a
        // stream of the current context.
        let r = unsafe { sys::cuStreamWriteValue32_v2(self.0, addr, value, flags) };
        check(r, "enqueuing a stream write of a flag")
    }

    /// Enqueues a copy of `bytes` bytes from device address `src` to device address `dst`
    /// (`cuMemcpyAsync`; either may be host memory registered as device-mapped, so the copy
    /// engines move the bytes across PCIe). Nothing is enqueued for zero bytes.
    ///
    /// # Safety
    /// Both ranges must be mapped into the current context, hold `bytes` bytes, not overlap, and
    /// stay valid until the copy has completed; `self` must belong to the current context.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees both ranges and the stream.
        let r = unsafe { sys::cuMemcpyAsync(dst, src, bytes, self.0) };
        check(r, "enqueuing an asynchronous copy")
    }
}
