//! Small operating-system services: the thread id, exit handlers, and writes to standard error
//! that take no lock; and, from the driver layer (`flashcomm_gpu::process`), the fork
//! generation and the state a fork child makes its own ([`PerProcess`]).
//!
//! Owns: [`thread_id`], [`at_exit`], [`RawStderr`].
//! May import: nothing of this crate.

pub(crate) use flashcomm_gpu::process::{PerProcess, fork_generation, watch_fork};

/// The kernel's id of the calling thread (NCCL prints it in every log line).
pub(crate) fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
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

/// Standard error through `write(2)`, without the lock of Rust's `Stderr` (a lock a thread of
/// the parent held at a fork would stay held in the child). The logger formats each line first
/// and writes it with one call, so lines of different threads do not mix.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawStderr;

impl std::io::Write for RawStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for `buf.len()` bytes; fd 2 is the process's standard error
            // (a closed descriptor is an error, not undefined behavior).
            let n = unsafe { libc::write(2, buf.as_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
