//! Releasing a communicator's memory without ever blocking the thread that destroys or aborts
//! it.
//!
//! Freeing device memory (`cuMemFree`), pinned host memory (`cuMemFreeHost`) or a peer's IPC
//! mapping (`cuIpcCloseMemHandle`) waits for the device's outstanding work, and after a fault that
//! work may never end: another communicator's kernel waiting for a dead peer, an operation of the
//! real NCCL stuck the same way. So `ncclCommAbort` and `ncclCommDestroy` hand what they release
//! to a thread of its own, which waits until the communicator's last launch has finished (its
//! memory must outlive every kernel that uses it) and then frees; the caller waits for that at
//! most a bound and returns either way. Whatever never becomes free is leaked, as NCCL leaks what
//! it cannot free; a thread stuck in a free is the only thing that waits.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a release thread frees: something to wait for, then something to drop.
pub(crate) trait Releasable: Send + 'static {
    /// Whether everything that uses the memory has finished (the communicator's last launch);
    /// `Err`: it cannot be told (a failed device), which frees at once.
    fn ready(&mut self) -> Result<bool, String>;
    /// Frees (may block, on its own thread only).
    fn free(self);
}

/// Whether a release has freed its memory.
#[derive(Clone, Debug)]
pub struct Release(Arc<(Mutex<bool>, Condvar)>);

impl Release {
    fn new() -> Release {
        Release(Arc::new((Mutex::new(false), Condvar::new())))
    }

    fn done(&self) {
        let (m, cv) = &*self.0;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    /// Waits at most `limit` for the memory to be freed. `true`: it was.
    pub fn wait(&self, limit: Duration) -> bool {
        let (m, cv) = &*self.0;
        let deadline = Instant::now() + limit;
        let mut freed = m.lock().unwrap_or_else(|e| e.into_inner());
        while !*freed {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            freed = cv
                .wait_timeout(freed, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Whether the memory has been freed.
    pub fn is_done(&self) -> bool {
        *self.0.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Frees `r` on a thread of its own once it is ready, and says when through `done` (a release
/// the caller made beforehand, [`Release`]). A thread that cannot be started leaks `r` (freeing
/// it here could block the caller).
pub(crate) fn in_background<R: Releasable>(r: R, done: Release) {
    let slot = Arc::new(Mutex::new(Some(r)));
    let theirs = slot.clone();
    let started = std::thread::Builder::new()
        .name("flashcomm-release".into())
        .spawn(move || {
            let Some(mut r) = theirs.lock().unwrap_or_else(|e| e.into_inner()).take() else {
                return;
            };
            // Not yet (an error means the device cannot tell: free at once).
            let mut pause = Duration::from_micros(20);
            while let Ok(false) = r.ready() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            r.free();
            done.done();
        });
    if started.is_err()
        && let Some(r) = slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    {
        std::mem::forget(r);
    }
}

/// A new, pending release.
pub(crate) fn pending() -> Release {
    Release::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Stands for a communicator's memory: `ready` after `polls` queries (never, for `None`),
    /// and a free that waits for `gate` (a `cuMemFree` behind device work that never ends, when
    /// the gate is never opened).
    struct Fake {
        polls: Option<u32>,
        freed: Arc<AtomicU32>,
        gate: Option<std::sync::mpsc::Receiver<()>>,
    }

    impl Releasable for Fake {
        fn ready(&mut self) -> Result<bool, String> {
            match &mut self.polls {
                None => Ok(false),
                Some(0) => Ok(true),
                Some(n) => {
                    *n -= 1;
                    Ok(false)
                }
            }
        }
        fn free(self) {
            if let Some(g) = &self.gate {
                let _ = g.recv();
            }
            self.freed.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn release(
        polls: Option<u32>,
        gate: Option<std::sync::mpsc::Receiver<()>>,
    ) -> (Release, Arc<AtomicU32>) {
        let freed = Arc::new(AtomicU32::new(0));
        let done = pending();
        in_background(
            Fake {
                polls,
                freed: freed.clone(),
                gate,
            },
            done.clone(),
        );
        (done, freed)
    }

    /// Fault class 3 without a GPU: whatever the memory's users and the frees do, the caller's
    /// wait ends within its bound; memory is freed once, and only once its users are done.
    #[test]
    fn a_release_returns_within_its_bound_whatever_the_device_does() {
        let bound = Duration::from_millis(100);
        // The last launch finishes after a few polls: freed, and the wait says so.
        let (r, freed) = release(Some(5), None);
        assert!(r.wait(Duration::from_secs(10)));
        assert_eq!(freed.load(Ordering::SeqCst), 1);
        // The last launch never finishes (queued behind a stuck operation): nothing is freed
        // under it, and the caller returns after the bound.
        let t0 = Instant::now();
        let (stuck, never) = release(None, None);
        assert!(!stuck.wait(bound));
        let took = t0.elapsed();
        assert!(took < bound + Duration::from_millis(400), "{took:?}");
        assert_eq!(never.load(Ordering::SeqCst), 0);
        // The free itself blocks (device work that never ends elsewhere): the caller returns
        // after the bound, and other releases are not held up behind it.
        let (open, gate) = std::sync::mpsc::channel();
        let (blocked, blocked_freed) = release(Some(0), Some(gate));
        let t0 = Instant::now();
        assert!(!blocked.wait(bound));
        assert!(t0.elapsed() < bound + Duration::from_millis(400));
        let (other, other_freed) = release(Some(1), None);
        assert!(
            other.wait(Duration::from_secs(10)),
            "not queued behind the blocked free"
        );
        assert_eq!(other_freed.load(Ordering::SeqCst), 1);
        // Once the device work ends, the blocked free completes.
        open.send(()).unwrap();
        assert!(blocked.wait(Duration::from_secs(10)));
        assert_eq!(blocked_freed.load(Ordering::SeqCst), 1);
        assert!(!stuck.is_done());
    }
}
