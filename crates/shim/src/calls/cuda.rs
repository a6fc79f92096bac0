//! Every CUDA driver call the shim makes itself: saving and restoring the calling thread's
//! current context around communicator set-up and teardown, the internal stream of a set-up
//! exchange, the current device (for log lines), and wrapping the caller's buffers of a routed
//! collective as [`DevicePtr`]s.
//!
//! The driver is never loaded from here: its functions are looked up in the `libcuda.so.1` the
//! process already loaded (`RTLD_NOLOAD`; the real NCCL loads it before any communicator exists).
//! Without it, nothing here does anything (saving a context, the current device) or everything
//! fails with a message.
//!
//! Owns: [`SavedContext`], [`OwnStream`], [`current_device`], [`user_buffers`].
//! May import: `types`.

use std::ffi::c_void;
use std::sync::OnceLock;

use flashcomm_comm::{DevicePtr, Stream};

use crate::types::{CollCall, Collective};

type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> i32;
type CtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> i32;
type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> i32;
type StreamOne = unsafe extern "C" fn(*mut c_void) -> i32;
type CtxGetDevice = unsafe extern "C" fn(*mut i32) -> i32;

/// `CUDA_ERROR_NOT_READY`.
const NOT_READY: i32 = 600;
/// `CU_STREAM_NON_BLOCKING`.
const NON_BLOCKING: u32 = 1;

struct Driver {
    ctx_get_current: CtxGetCurrent,
    ctx_set_current: CtxSetCurrent,
    stream_create: StreamCreate,
    stream_destroy: StreamOne,
    stream_query: StreamOne,
    ctx_get_device: CtxGetDevice,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

fn lookup() -> Option<Driver> {
    // SAFETY: RTLD_NOLOAD only looks up an already-loaded object; the name is a valid C string.
    // The handle's reference keeps the driver loaded, which the process had done anyway.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: `h` is a valid handle from dlopen; the name is a valid C string.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let get = sym(c"cuCtxGetCurrent")?;
    let set = sym(c"cuCtxSetCurrent")?;
    let create = sym(c"cuStreamCreate")?;
    let destroy = sym(c"cuStreamDestroy_v2")?;
    let query = sym(c"cuStreamQuery")?;
    let device = sym(c"cuCtxGetDevice")?;
    // SAFETY: each pointer is the driver's function of that name, whose C signature (cuda.h) is
    // the type it is cast to: CUresult is a 32-bit enum, CUcontext and CUstream are pointers,
    // `unsigned int` flags are u32, CUdevice is a 32-bit integer.
    unsafe {
        Some(Driver {
            ctx_get_current: std::mem::transmute::<*mut c_void, CtxGetCurrent>(get),
            ctx_set_current: std::mem::transmute::<*mut c_void, CtxSetCurrent>(set),
            stream_create: std::mem::transmute::<*mut c_void, StreamCreate>(create),
            stream_destroy: std::mem::transmute::<*mut c_void, StreamOne>(destroy),
            stream_query: std::mem::transmute::<*mut c_void, StreamOne>(query),
            ctx_get_device: std::mem::transmute::<*mut c_void, CtxGetDevice>(device),
        })
    }
}

fn driver() -> Option<&'static Driver> {
    if let Some(d) = DRIVER.get() {
        return Some(d);
    }
    let d = lookup()?;
    Some(DRIVER.get_or_init(|| d))
}

fn current_context(d: &Driver) -> Option<*mut c_void> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out pointer; the call only reads this thread's driver state.
    let rc = unsafe { (d.ctx_get_current)(&mut ctx) };
    (rc == 0).then_some(ctx)
}

/// The device of the calling thread's current CUDA context, if the CUDA driver is already loaded
/// and a context is current. Never loads or initializes CUDA.
pub(crate) fn current_device() -> Option<i32> {
    let d = driver()?;
    let mut dev = -1;
    // SAFETY: `dev` is a valid out pointer; the call only reads this thread's driver state.
    let rc = unsafe { (d.ctx_get_device)(&mut dev) };
    (rc == 0).then_some(dev)
}

/// The calling thread's current CUDA context, made current again when this value drops, so that
/// flashcomm's set-up and teardown never change the caller's current device behind its back.
pub(crate) struct SavedContext {
    ctx: Option<usize>,
}

impl SavedContext {
    /// Remembers the current context (nothing, when the driver is not loaded).
    pub(crate) fn save() -> SavedContext {
        SavedContext {
            ctx: driver().and_then(current_context).map(|c| c as usize),
        }
    }
}

impl Drop for SavedContext {
    fn drop(&mut self) {
        let (Some(saved), Some(d)) = (self.ctx, driver()) else {
            return;
        };
        if current_context(d).map(|c| c as usize) != Some(saved) {
            // SAFETY: `saved` was this thread's current context (or null) when this value was
            // made; primary contexts are retained by the runtime and flashcomm for the life of the
            // process, so it is still valid. Setting null is allowed (no context).
            let _ = unsafe { (d.ctx_set_current)(saved as *mut c_void) };
        }
    }
}

/// A non-blocking stream of the context that was current when it was made, destroyed on drop.
pub(crate) struct OwnStream {
    raw: usize,
}

impl OwnStream {
    /// Creates a stream in the current context.
    pub(crate) fn create() -> Result<OwnStream, String> {
        let d = driver().ok_or("the CUDA driver is not loaded in this process")?;
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: `s` is a valid out pointer; the flag is CU_STREAM_NON_BLOCKING.
        let rc = unsafe { (d.stream_create)(&mut s, NON_BLOCKING) };
        if rc != 0 || s.is_null() {
            return Err(format!("cuStreamCreate failed with CUresult {rc}"));
        }
        Ok(OwnStream { raw: s as usize })
    }

    /// The stream as the communicator takes it.
    pub(crate) fn stream(&self) -> Stream {
        Stream((self.raw as *mut c_void).cast())
    }

    /// The raw handle, as NCCL takes it.
    pub(crate) fn raw(&self) -> *mut c_void {
        self.raw as *mut c_void
    }

    /// `Ok(true)` when all work queued on the stream has finished.
    pub(crate) fn is_idle(&self) -> Result<bool, String> {
        let d = driver().ok_or("the CUDA driver is not loaded in this process")?;
        // SAFETY: the stream was created by `create` and is destroyed only when `self` drops.
        let rc = unsafe { (d.stream_query)(self.raw()) };
        match rc {
            0 => Ok(true),
            NOT_READY => Ok(false),
            other => Err(format!("cuStreamQuery failed with CUresult {other}")),
        }
    }
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        if let Some(d) = driver() {
            // SAFETY: destroys the stream this value created, exactly once. Work still queued
            // on it completes first (the driver defers the release).
            let _ = unsafe { (d.stream_destroy)(self.raw()) };
        }
    }
}

/// The caller's send and receive buffers of a routed collective, with the sizes NCCL's contract
/// gives them: `bytes` is the per-rank message of `call` (count x element size), so an
/// AllReduce uses `bytes` of each, a ReduceScatter reads `nranks x bytes` and writes `bytes`,
/// an AllGather reads `bytes` and writes `nranks x bytes`. `None` when a size overflows.
pub(crate) fn user_buffers(call: &CollCall, nranks: u64) -> Option<(DevicePtr, DevicePtr)> {
    let b = call.bytes;
    let all = b.checked_mul(nranks)?;
    let (send, recv) = match call.kind {
        Collective::ReduceScatter => (all, b),
        Collective::AllGather => (b, all),
        _ => (b, b),
    };
    // SAFETY: these are the buffers of an NCCL collective call, for which the caller promises
    // NCCL's contract: device memory of at least these sizes, accessible from the communicator's
    // device, valid until the operation has completed on the caller's stream. flashcomm's kernel
    // is launched on that same stream, so it completes before the caller may free them.
    unsafe {
        Some((
            DevicePtr::from_raw(call.sendbuff as u64, send),
            DevicePtr::from_raw(call.recvbuff as u64, recv),
        ))
    }
}
