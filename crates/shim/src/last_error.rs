//! The last error, for `ncclGetLastError`.
//!
//! NCCL keeps one process-wide message. We keep one per thread and one for the process, and we
//! remember when the newest failure came from the real library instead, so that
//! `ncclGetLastError` can answer with the message that belongs to the failure the caller saw:
//! this thread's last failure if it was ours; the real library's own message if the thread's last
//! failure came from there; else the process-wide one, with the same rule.
//!
//! Recorded only on failures, never on the per-call path of a successful call.
//!
//! Owns: [`Last`], [`record`], [`record_real_failure`], [`current`], [`thread_last`].
//! May import: `calls::os`.

use std::cell::RefCell;
use std::sync::Mutex;

use crate::calls::os::PerProcess;

/// Where the newest failure was detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Last {
    /// By flashcomm, with this message.
    Ours(String),
    /// By the real library, which holds the message: its function `api` returned `code`.
    Real {
        /// The real function that failed.
        api: &'static str,
        /// What it returned.
        code: u32,
    },
}

thread_local! {
    static THREAD: RefCell<Option<Last>> = const { RefCell::new(None) };
}

/// The process's newest failure. A fork child starts its own: a lock one of its parent's
/// threads held at the fork (they record failures all the time) would stay held in it.
static PROCESS: PerProcess<Mutex<Option<Last>>> = PerProcess::fresh_in_children();

fn process() -> std::sync::MutexGuard<'static, Option<Last>> {
    // A poisoned lock only means another thread panicked while holding it; the value is a plain
    // Option and always consistent.
    PROCESS
        .get(|| Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn set(last: Last) {
    THREAD.with(|t| *t.borrow_mut() = Some(last.clone()));
    *process() = Some(last);
}

/// Records a failure detected by flashcomm.
pub(crate) fn record(message: &str) {
    set(Last::Ours(message.to_string()));
}

/// Records that the real library's function `api` returned the failure `code` (its message is
/// its own).
pub(crate) fn record_real_failure(api: &'static str, code: u32) {
    set(Last::Real { api, code });
}

/// This thread's newest failure.
pub(crate) fn thread_last() -> Option<Last> {
    THREAD.with(|t| t.borrow().clone())
}

/// What `ncclGetLastError` should answer: this thread's newest failure, else the process's.
/// `None`: no failure seen at all (ask the real library, which may still know of one).
pub(crate) fn current() -> Option<Last> {
    THREAD
        .with(|t| t.borrow().clone())
        .or_else(|| process().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_first_then_process() {
        std::thread::spawn(|| {
            record("from another thread");
        })
        .join()
        .unwrap();
        // This thread has no failure yet: the process-wide one answers (unless a parallel test
        // set one meanwhile, which is also process-wide).
        assert!(matches!(
            current(),
            Some(Last::Ours(_)) | Some(Last::Real { .. })
        ));
        record("mine");
        assert_eq!(current(), Some(Last::Ours("mine".into())));
        record_real_failure("ncclX", 4);
        assert_eq!(
            current(),
            Some(Last::Real {
                api: "ncclX",
                code: 4
            })
        );
    }
}
