//! Small operating-system services: thread id, fork detection, the current CUDA device.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// The kernel's id of the calling thread (NCCL prints it in every log line).
pub(crate) fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn in_forked_child() {
    // Only an atomic store: nothing else is safe in a child of a multithreaded process.
    FORKED.store(true, Ordering::Relaxed);
}

/// Whether this process is a `fork()` child of a process in which flashcomm was initialized. Such
/// a child bypasses all of flashcomm's state (locks, registries, logging) and only forwards.
#[inline]
pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Registers the fork handler (once, from `init`; never from a library constructor).
pub(crate) fn watch_fork() {
    // SAFETY: the handler is a plain function of this library that only stores to an atomic;
    // this library is never unloaded (the real NCCL pins no reference to us, and we do not
    // dlclose ourselves), so the pointer stays valid.
    let rc = unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    if rc != 0 {
        crate::logging::warn(
            crate::logging::Subsys::Init,
            &format!("pthread_atfork failed ({rc}); fork children will not be detected"),
        );
    }
}

type CuCtxGetDevice = unsafe extern "C" fn(*mut i32) -> i32;
static CU_CTX_GET_DEVICE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The device of the calling thread's current CUDA context, if the CUDA driver is already loaded
/// and a context is current. Never loads or initializes CUDA.
pub(crate) fn cuda_device() -> Option<i32> {
    let mut f = CU_CTX_GET_DEVICE.load(Ordering::Relaxed);
    if f.is_null() {
        // SAFETY: RTLD_NOLOAD only looks up an already-loaded object; the name is a valid C string.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            return None;
        }
        // SAFETY: `h` is a valid handle from dlopen; the name is a valid C string.
        f = unsafe { libc::dlsym(h, c"cuCtxGetDevice".as_ptr()) };
        // The handle's reference keeps the driver loaded, which the process had done anyway.
        if f.is_null() {
            return None;
        }
        CU_CTX_GET_DEVICE.store(f, Ordering::Relaxed);
    }
    // SAFETY: `f` is the driver's cuCtxGetDevice, whose C signature is
    // `CUresult cuCtxGetDevice(CUdevice*)` with CUresult and CUdevice 32-bit integers.
    let get = unsafe { std::mem::transmute::<*mut c_void, CuCtxGetDevice>(f) };
    let mut dev = -1;
    // SAFETY: `dev` is a valid out pointer; the call only reads thread-local driver state.
    let rc = unsafe { get(&mut dev) };
    (rc == 0).then_some(dev)
}
