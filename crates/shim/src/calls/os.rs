//! Small operating-system services: the thread id, fork detection, exit handlers.
//!
//! Owns: [`thread_id`], [`forked`], [`watch_fork`], [`at_exit`].
//! May import: nothing of this crate.

use std::sync::atomic::{AtomicBool, Ordering};

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

/// Registers the fork handler (once, from `init`; never from a library constructor). `Err`:
/// `pthread_atfork`'s error code (fork children will then not be detected).
pub(crate) fn watch_fork() -> Result<(), i32> {
    // SAFETY: the handler is a plain function of this library that only stores to an atomic;
    // this library is never unloaded (the real NCCL pins no reference to us, and we do not
    // dlclose ourselves), so the pointer stays valid.
    let rc = unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    if rc == 0 { Ok(()) } else { Err(rc) }
}

/// Registers `handler` to run at process exit (C `atexit`); false if it could not be.
///
/// `handler` must not unwind (wrap its body in `catch_unwind`).
pub(crate) fn at_exit(handler: extern "C" fn()) -> bool {
    // SAFETY: `handler` takes no arguments, must not unwind (the caller's contract above) and is
    // code of this image, which is never unloaded before exit (the real library's handle and the
    // preloaded image stay open; a `dlclose` of this image would run the handler first, since
    // glibc ties `atexit` handlers to their object).
    unsafe { libc::atexit(handler) == 0 }
}
