//! Group state: this thread's `ncclGroupStart`/`ncclGroupEnd` depth, and the communicators
//! created inside the current group, which are set up when the outermost group ends.
//!
//! Thread-local on purpose (NCCL's groups are per thread); reading the depth is a
//! thread-local load.
//!
//! Owns: the depth ([`started`], [`ending`], [`depth`]), the deferred set-ups ([`defer`],
//! [`take_deferred`]), the deferred `flashcommCommSetQuant` calls ([`defer_quant`],
//! [`take_deferred_quant`]), and the failure flashcomm itself gave a call of the group ([`failed`],
//! [`real_failed`], [`take_failure`]). The Send/Recv calls a group holds back are `grouped`'s.
//! May import: `types`.

use std::cell::{Cell, RefCell};

use flashcomm_config::QuantSettings;
use flashcomm_nccl_sys::ncclResult_t;

use crate::types::CommHandle;

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Communicators created inside the current group, set up when it ends.
    static PENDING: RefCell<Vec<CommHandle>> = const { RefCell::new(Vec::new()) };
    /// The newest failure flashcomm itself returned from a call inside the current group (code
    /// and message), unless a later call failed in the real library: the group's result.
    static FAILED: RefCell<Option<(ncclResult_t, String)>> = const { RefCell::new(None) };
    /// `flashcommCommSetQuant` calls made inside the current group, agreed when it ends.
    static QUANT: RefCell<Vec<(CommHandle, GivenQuant)>> = const { RefCell::new(Vec::new()) };
}

/// What one rank gave `flashcommCommSetQuant`: its settings (`None`: NULL, the environment's),
/// or why they are invalid.
pub(crate) type GivenQuant = Result<Option<QuantSettings>, String>;

/// Remembers a `flashcommCommSetQuant` call of communicator `h` made inside a group, to agree
/// on with the other ranks when the outermost group ends (the exchange runs over the real NCCL,
/// which would hold it until then). One per communicator: the last settings given, unless one
/// of the group's calls was invalid, whose reason stays (every rank then fails alike).
pub(crate) fn defer_quant(h: CommHandle, given: GivenQuant) {
    QUANT.with(|q| {
        let mut q = q.borrow_mut();
        match q.iter_mut().find(|(c, _)| *c == h) {
            Some((_, Err(_))) => {}
            Some((_, old)) => *old = given,
            None => q.push((h, given)),
        }
    });
}

/// The `flashcommCommSetQuant` calls deferred so far, forgetting them.
pub(crate) fn take_deferred_quant() -> Vec<(CommHandle, GivenQuant)> {
    QUANT.with(|q| std::mem::take(&mut *q.borrow_mut()))
}

/// flashcomm itself failed a call of the current group with `code` and `message` (the real
/// group never saw the call). The outermost group end returns it, as NCCL's group end returns
/// the error of its newest failed call.
pub(crate) fn failed(code: ncclResult_t, message: &str) {
    FAILED.with(|f| *f.borrow_mut() = Some((code, message.to_string())));
}

/// The real library failed a call of the current group after flashcomm's own failure: its
/// error is the newest, which the real group end returns itself.
pub(crate) fn real_failed() {
    FAILED.with(|f| f.borrow_mut().take());
}

/// The failure flashcomm gave a call of the group that just ended, forgetting it.
pub(crate) fn take_failure() -> Option<(ncclResult_t, String)> {
    FAILED.with(|f| f.borrow_mut().take())
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

    #[test]
    fn a_group_keeps_one_set_quant_per_communicator_and_its_first_invalid_one() {
        let (a, b) = (
            CommHandle::of(0x10usize as flashcomm_nccl_sys::ncclComm_t),
            CommHandle::of(0x20usize as flashcomm_nccl_sys::ncclComm_t),
        );
        let q = |group| {
            Some(QuantSettings {
                group,
                ..flashcomm_config::Config::default().quant_settings()
            })
        };
        defer_quant(a, Ok(q(32)));
        defer_quant(b, Ok(None));
        defer_quant(a, Ok(q(64)));
        defer_quant(b, Err("group 100".into()));
        defer_quant(b, Ok(q(128)));
        assert_eq!(
            take_deferred_quant(),
            vec![(a, Ok(q(64))), (b, Err("group 100".into()))]
        );
        assert!(take_deferred_quant().is_empty());
    }
}
