//! The calling thread's CUDA state, as a library loaded into someone else's process must treat
//! it: whether the process has loaded the driver at all (asked without ever loading it), the
//! device of the current context, the current context saved and made current again around
//! work of ours, and a stream of our own.
//!
//! The NCCL shim uses these around communicator set-up and teardown (which must not change the
//! caller's current device) and in its log lines (which print the current device). None of them
//! loads or initializes the driver: before the process did, they do nothing (`current_device`,
//! `SavedContext`) or fail (`OwnStream::create`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{result, sys};

use crate::{Error, Stream, check};

/// Set once the driver was found loaded (it is never unloaded).
static LOADED: AtomicBool = AtomicBool::new(false);

/// Whether the process has already loaded the CUDA driver (`libcuda.so.1`). Never loads it:
/// a preloaded library lands in every process of a job, and loading the driver in a shell or a
/// compiler would be wrong. Once `true`, it stays `true` (the driver is never unloaded).
///
/// Until then each call asks the dynamic loader (`dlopen` with `RTLD_NOLOAD`, which searches
/// the loader's cache): fine at set-up and teardown, never on a path every call or log line
/// takes. A thread inside the loader when another thread forks leaves the child a loader state
/// caught half-way, in which the child's own first `dlopen` can crash.
pub fn driver_loaded() -> bool {
    if LOADED.load(Ordering::Relaxed) {
        return true;
    }
    for name in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: RTLD_NOLOAD only looks up an object that is already loaded; the name is a
        // valid C string. The handle is kept (never closed): it keeps the driver loaded, which
        // the process had done anyway.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            LOADED.store(true, Ordering::Relaxed);
            return true;
        }
    }
    false
}

/// The device of the calling thread's current context, if the driver is known to be loaded
/// (an earlier [`driver_loaded`] found it), initialized, and a context is current. Never asks
/// the dynamic loader: it runs on every log line.
pub fn current_device() -> Option<i32> {
    if !LOADED.load(Ordering::Relaxed) {
        return None;
    }
    let mut dev: sys::CUdevice = -1;
    // SAFETY: `dev` is a valid out-pointer; the call only reads this thread's driver state (and
    // fails, before cuInit, without side effects).
    let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(dev)
}

/// The calling thread's current context (possibly none), made current again when this value
/// drops, so that work of ours (set-up, teardown) never changes the caller's current device
/// behind its back. Bound to the thread that made it.
#[derive(Debug)]
pub struct SavedContext {
    /// `None`: the driver was not loaded (nothing to restore); `Some(null)`: no context was
    /// current.
    ctx: Option<sys::CUcontext>,
}

impl SavedContext {
    /// Remembers the current context (nothing, when the driver is not loaded).
    pub fn save() -> SavedContext {
        let ctx = if driver_loaded() {
            result::ctx::get_current()
                .ok()
                .map(|c| c.unwrap_or(std::ptr::null_mut()))
        } else {
            None
        };
        SavedContext { ctx }
    }
}

impl Drop for SavedContext {
    fn drop(&mut self) {
        let Some(saved) = self.ctx else {
            return;
        };
        let now = result::ctx::get_current()
            .ok()
            .map(|c| c.unwrap_or(std::ptr::null_mut()));
        if now != Some(saved) {
            // SAFETY: `saved` was this thread's current context (or null) when this value was
            // made; primary contexts are retained by the runtime and by flashcomm for the life
            // of the process, so it is still valid. Setting null is allowed (no context).
            let _ = unsafe { result::ctx::set_current(saved) };
        }
    }
}

/// Streams made by [`OwnStream::create`] and not yet destroyed (for leak tests).
static LIVE_STREAMS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A non-blocking stream of the context that was current when it was made, destroyed on drop.
#[derive(Debug)]
pub struct OwnStream {
    raw: sys::CUstream,
}

// SAFETY: a stream handle is an opaque token that the driver accepts from any thread; the
// stream is destroyed only by `drop`, which takes the value.
unsafe impl Send for OwnStream {}
// SAFETY: as above; shared access only passes the handle by value to the driver.
unsafe impl Sync for OwnStream {}

impl OwnStream {
    /// Creates a stream in the current context. `Err(NoDriver)` when the process has not loaded
    /// the driver.
    pub fn create() -> Result<OwnStream, Error> {
        if !driver_loaded() {
            return Err(Error::NoDriver);
        }
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| {
            Error::Cuda {
                during: "creating a stream",
                detail: format!("{:?}", e.0),
            }
        })?;
        LIVE_STREAMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(OwnStream { raw })
    }

    /// How many streams made by [`OwnStream::create`] are alive in this process: flat across
    /// communicator set-ups and teardowns, or streams leak.
    pub fn live() -> usize {
        LIVE_STREAMS.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The stream as the communicator takes it.
    pub fn stream(&self) -> Stream {
        Stream(self.raw)
    }

    /// The raw handle, as NCCL takes it (`cudaStream_t`).
    pub fn raw(&self) -> *mut c_void {
        self.raw.cast()
    }

    /// `Ok(true)` when all work queued on the stream has finished.
    pub fn is_idle(&self) -> Result<bool, Error> {
        // SAFETY: the stream was created by `create` and is destroyed only when `self` drops.
        let r = unsafe { sys::cuStreamQuery(self.raw) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "querying a stream").map(|()| false),
        }
    }
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        // SAFETY: destroys the stream this value created, exactly once. Work still queued on it
        // completes first (the driver defers the release).
        let _ = unsafe { result::stream::destroy(self.raw) };
        LIVE_STREAMS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_happens_without_a_loaded_driver() {
        // The unit tests of this crate never load the driver, so this is the state a preloaded
        // library meets in a process that does not use CUDA.
        if driver_loaded() {
            return;
        }
        assert_eq!(current_device(), None);
        let saved = SavedContext::save();
        assert!(saved.ctx.is_none());
        drop(saved);
        assert_eq!(OwnStream::create().unwrap_err(), Error::NoDriver);
        assert!(!driver_loaded(), "asking never loads the driver");
    }
}
