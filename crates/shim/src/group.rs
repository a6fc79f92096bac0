//! Group state: this thread's `ncclGroupStart`/`ncclGroupEnd` depth, and the communicators
//! created inside the current group, which are set up when the outermost group ends.
//!
//! Thread-local on purpose (NCCL's groups are per thread); reading the depth is a
//! thread-local load.
//!
//! Owns: the depth ([`started`], [`ending`], [`depth`]), the deferred set-ups ([`defer`],
//! [`take_deferred`]) and the `ncclSend`/`ncclRecv` calls held back while a group may still turn
//! out to be an all-to-all ([`hold_from_now`], [`holding`], [`hold`], [`take_held`]).
//! May import: `types`.

use std::cell::{Cell, RefCell};

use crate::types::{CommHandle, Held};

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Communicators created inside the current group, set up when it ends.
    static PENDING: RefCell<Vec<CommHandle>> = const { RefCell::new(Vec::new()) };
    /// `Some`: Send/Recv calls (and nested group calls) of the current outermost group held back
    /// so far, in call order (`FLASHCOMM_GROUPED_ALLTOALL`); `None`: not holding (off, outside a
    /// group, or the group already proved not to be an all-to-all and its calls went to NCCL).
    static HELD: RefCell<Option<Vec<Held>>> = const { RefCell::new(None) };
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

/// The outermost group started: hold its Send/Recv calls from now on.
pub(crate) fn hold_from_now() {
    HELD.with(|h| *h.borrow_mut() = Some(Vec::new()));
}

/// Whether this thread's group is holding its Send/Recv calls back.
pub(crate) fn holding() -> bool {
    HELD.with(|h| h.borrow().is_some())
}

/// Holds `p` back (when holding; returns whether it did).
pub(crate) fn hold(p: Held) -> bool {
    HELD.with(|h| match h.borrow_mut().as_mut() {
        Some(v) => {
            v.push(p);
            true
        }
        None => false,
    })
}

/// The calls held back so far, in call order; holding stops.
pub(crate) fn take_held() -> Vec<Held> {
    HELD.with(|h| h.borrow_mut().take().unwrap_or_default())
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
