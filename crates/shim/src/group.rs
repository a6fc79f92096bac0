//! Group state: this thread's `ncclGroupStart`/`ncclGroupEnd` depth, and the communicators
//! created inside the current group, which are set up when the outermost group ends.
//!
//! Thread-local on purpose (NCCL's groups are per thread); reading the depth is a
//! thread-local load.
//!
//! Owns: the depth ([`started`], [`ending`], [`depth`]) and the deferred set-ups ([`defer`],
//! [`take_deferred`]).
//! May import: `types`.

use std::cell::{Cell, RefCell};

use crate::types::CommHandle;

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Communicators created inside the current group, set up when it ends.
    static PENDING: RefCell<Vec<CommHandle>> = const { RefCell::new(Vec::new()) };
}

/// `ncclGroupStart` succeeded on this thread.
pub(crate) fn started() {
    GROUP_DEPTH.with(|d| d.set(d.get().saturating_add(1)));
}

/// `ncclGroupEnd` is about to be forwarded. Returns the depth after it (0: the outermost group
/// ends, which is where deferred work is done).
pub(crate) fn ending() -> u32 {
    GROUP_DEPTH.with(|d| {
        let v = d.get().saturating_sub(1);
        d.set(v);
        v
    })
}

/// The current `ncclGroupStart` depth of this thread.
pub(crate) fn depth() -> u32 {
    GROUP_DEPTH.with(Cell::get)
}

/// Remembers communicators to set up when the outermost group ends.
pub(crate) fn defer(comms: impl IntoIterator<Item = CommHandle>) {
    PENDING.with(|p| p.borrow_mut().extend(comms));
}

/// The communicators deferred so far, forgetting them.
pub(crate) fn take_deferred() -> Vec<CommHandle> {
    PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_depth_is_per_thread() {
        started();
        started();
        assert_eq!(depth(), 2);
        std::thread::spawn(|| assert_eq!(depth(), 0))
            .join()
            .unwrap();
        assert_eq!(ending(), 1);
        assert_eq!(ending(), 0);
        assert_eq!(ending(), 0);
    }
}
