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
//! it cannot free.
//!
//! A free that waits is not harmless even on a thread of its own: while `cuMemFree` waits for
//! the device, the driver holds other threads' launches behind it, so a free that waits for a
//! stuck kernel stops every thread of the process at its next launch, including the thread that
//! would end the stuck kernel with `ncclCommAbort`. So the thread frees only while no watched
//! communicator of the process ([`Registry::watch`]) looks stuck: work outstanding and no new
//! launch seen (for [`STUCK_AFTER`] since the last). A busy communicator whose ranks are in
//! processes of their own (a server's other communicator, launching all the time) holds nothing
//! back, since what a free waits for then ends; one with several ranks as threads of this
//! process holds every free while it has work outstanding (its kernels wait for
//! launches of this process that the free holds back: [`Activity::threads_here`]); one that
//! stopped behind unfinished work holds every free until it ends or is aborted, and memory that
//! never becomes free that way is leaked. Work the application or the real NCCL leaves stuck is not seen; a
//! free can wait behind that, as the real NCCL's own frees do. A communicator that only replays
//! graphs, back to back, launches nothing the host sees: it holds frees until it pauses.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::gpu::PerProcess;

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

/// Something whose device work a free must not wait behind: a live communicator's launches.
pub(crate) trait Activity: Send + Sync + 'static {
    /// `Ok(true)`: nothing of it is outstanding on the device; `Err`: it cannot be told (a
    /// failed device), which does not hold frees back.
    fn idle(&self) -> Result<bool, String>;
    /// How many operations it has enqueued so far (a count that moves while it makes progress).
    fn launches(&self) -> u64;
    /// Whether several of its ranks are threads of this process. A free of device
    /// memory is a synchronization point of the device: it waits for the kernels launched before
    /// it, and launches of this process after it wait for it. A kernel of such a communicator
    /// that waits for a rank whose launch came after the free would wait for its timeout (seen
    /// on the GPU: 1 MiB AllReduces of two threads beside a release, stuck at their 42nd call).
    /// So such a communicator holds every free while it has work outstanding, busy or not
    /// (ranks on several devices of one process included: whether a free on one device holds
    /// launches to another back is not known). Ranks in processes of their own never wait for a
    /// launch of this process.
    fn threads_here(&self) -> bool {
        false
    }
}

/// How long a communicator with work outstanding may go without a new launch before it holds
/// frees back (a collective that takes longer than this while its host thread launches nothing
/// else holds them for its duration only).
pub(crate) const STUCK_AFTER: Duration = Duration::from_millis(200);

/// What one release has seen of each watched communicator with work outstanding: its address,
/// its launch count, and when that count was first seen if it had moved (a communicator holds
/// frees until this release has seen it launch).
type Seen = Vec<(usize, u64, Option<Instant>)>;

/// The communicators of the process whose work holds frees back (weakly held: a dropped one
/// leaves by itself). Per process: a fork child neither sees its parent's communicators nor
/// waits for a lock a parent's thread held at the fork.
pub(crate) struct Registry(PerProcess<Mutex<Vec<Weak<dyn Activity>>>>);

/// Every communicator of the process.
pub(crate) static LIVE: Registry = Registry::new();

impl Registry {
    pub(crate) const fn new() -> Registry {
        Registry(PerProcess::fresh_in_children())
    }

    fn list(&'static self) -> std::sync::MutexGuard<'static, Vec<Weak<dyn Activity>>> {
        self.0
            .get(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// From now on, no release frees while `a` has work outstanding. Once at set-up, never on a
    /// call.
    pub(crate) fn watch(&'static self, a: Weak<dyn Activity>) {
        let mut live = self.list();
        live.retain(|w| w.strong_count() > 0);
        live.push(a);
    }

    /// Whether some watched communicator looks stuck: work outstanding, and no new launch since
    /// this release first saw it or for [`STUCK_AFTER`] (`seen`: what this release saw before).
    fn holds(&'static self, seen: &mut Seen) -> bool {
        let live: Vec<Arc<dyn Activity>> = self.list().iter().filter_map(Weak::upgrade).collect();
        let now = Instant::now();
        live.iter().any(|a| {
            if !matches!(a.idle(), Ok(false)) {
                return false;
            }
            if a.threads_here() {
                return true;
            }
            let (id, n) = (Arc::as_ptr(a) as *const () as usize, a.launches());
            match seen.iter_mut().find(|e| e.0 == id) {
                // Unchanged since first seen, or since its last change long enough ago.
                Some(e) if e.1 == n => e.2.is_none_or(|t| now.duration_since(t) >= STUCK_AFTER),
                Some(e) => {
                    *e = (id, n, Some(now));
                    false
                }
                None => {
                    seen.push((id, n, None));
                    true
                }
            }
        })
    }
}

/// Frees `r` on a thread of its own once it is ready and no communicator of `registry` looks
/// stuck, and says when through `done` (a release the caller made beforehand,
/// [`Release`]). A thread that cannot be started leaks `r` (freeing it here could block the
/// caller).
pub(crate) fn in_background<R: Releasable>(r: R, done: Release, registry: &'static Registry) {
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
            let mut seen = Seen::new();
            loop {
                match r.ready() {
                    Ok(false) => {}
                    Ok(true) if registry.holds(&mut seen) => {}
                    _ => break,
                }
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

    fn release_in(
        polls: Option<u32>,
        gate: Option<std::sync::mpsc::Receiver<()>>,
        registry: &'static Registry,
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
            registry,
        );
        (done, freed)
    }

    fn release(
        polls: Option<u32>,
        gate: Option<std::sync::mpsc::Receiver<()>>,
    ) -> (Release, Arc<AtomicU32>) {
        static NONE: Registry = Registry::new();
        release_in(polls, gate, &NONE)
    }

    /// Another communicator's kernel, stuck until `stuck` is cleared; `launches` counts what its
    /// host thread enqueued.
    struct Kernel {
        stuck: std::sync::atomic::AtomicBool,
        launches: std::sync::atomic::AtomicU64,
        threads_here: bool,
    }

    impl Kernel {
        fn new(stuck: bool) -> Arc<Kernel> {
            Arc::new(Kernel {
                stuck: std::sync::atomic::AtomicBool::new(stuck),
                launches: std::sync::atomic::AtomicU64::new(0),
                threads_here: false,
            })
        }
    }

    impl Activity for Kernel {
        fn idle(&self) -> Result<bool, String> {
            Ok(!self.stuck.load(Ordering::SeqCst))
        }
        fn launches(&self) -> u64 {
            self.launches.load(Ordering::SeqCst)
        }
        fn threads_here(&self) -> bool {
            self.threads_here
        }
    }

    /// A host thread launching on `Kernel` every millisecond until dropped.
    struct Launching(
        Arc<std::sync::atomic::AtomicBool>,
        Option<std::thread::JoinHandle<()>>,
    );

    impl Launching {
        fn start(busy: &Arc<Kernel>) -> Launching {
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (busy, theirs) = (busy.clone(), stop.clone());
            Launching(
                stop,
                Some(std::thread::spawn(move || {
                    while !theirs.load(Ordering::SeqCst) {
                        busy.launches.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })),
            )
        }
    }

    impl Drop for Launching {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
            if let Some(t) = self.1.take() {
                let _ = t.join();
            }
        }
    }

    /// A busy communicator with several ranks as threads of this process holds
    /// every free while it has work outstanding, however often it launches, and lets it go once
    /// it is idle.
    #[test]
    fn a_busy_communicator_of_threads_here_holds_frees_until_idle() {
        static LIVE: Registry = Registry::new();
        let busy = Arc::new(Kernel {
            stuck: std::sync::atomic::AtomicBool::new(true),
            launches: std::sync::atomic::AtomicU64::new(0),
            threads_here: true,
        });
        let weak: Weak<dyn Activity> = Arc::downgrade(&(busy.clone() as Arc<dyn Activity>));
        LIVE.watch(weak);
        let launcher = Launching::start(&busy);
        let (r, freed) = release_in(Some(0), None, &LIVE);
        assert!(
            !r.wait(Duration::from_millis(500)),
            "freed beside a busy communicator of threads here"
        );
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        busy.stuck.store(false, Ordering::SeqCst);
        assert!(r.wait(Duration::from_secs(10)), "freed once it was idle");
        drop(launcher);
    }

    /// Issue 45, item 5: a communicator that is busy (work always outstanding, new launches all
    /// the time, as a server's other communicator) holds no free back: the release completes in
    /// well under a second, where before it waited for an idle moment that never came.
    #[test]
    fn a_busy_communicator_holds_no_free_back() {
        static LIVE: Registry = Registry::new();
        let busy = Kernel::new(true);
        let weak: Weak<dyn Activity> = Arc::downgrade(&(busy.clone() as Arc<dyn Activity>));
        LIVE.watch(weak);
        let launcher = Launching::start(&busy);
        let t0 = Instant::now();
        let (r, freed) = release_in(Some(0), None, &LIVE);
        assert!(
            r.wait(Duration::from_secs(10)),
            "never freed beside a busy communicator"
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert_eq!(freed.load(Ordering::SeqCst), 1);
        drop(launcher);
    }

    /// Fault class 3, the other communicators: a communicator whose own work is done is not
    /// freed while another communicator of the process is stuck (the free would hold every
    /// thread's launches, the abort's too), and is freed once that one ends; a dropped
    /// communicator holds nothing back.
    #[test]
    fn nothing_is_freed_while_another_communicator_is_stuck() {
        static LIVE: Registry = Registry::new();
        let stuck = Kernel::new(true);
        let weak: Weak<dyn Activity> = Arc::downgrade(&(stuck.clone() as Arc<dyn Activity>));
        LIVE.watch(weak);
        let (r, freed) = release_in(Some(0), None, &LIVE);
        assert!(
            !r.wait(Duration::from_millis(200)),
            "freed under a stuck kernel"
        );
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        stuck.stuck.store(false, Ordering::SeqCst);
        assert!(
            r.wait(Duration::from_secs(10)),
            "freed once the kernel ended"
        );
        assert_eq!(freed.load(Ordering::SeqCst), 1);
        // Stuck again, then dropped (its communicator destroyed): it no longer holds frees.
        stuck.stuck.store(true, Ordering::SeqCst);
        drop(stuck);
        let (r, _) = release_in(Some(0), None, &LIVE);
        assert!(r.wait(Duration::from_secs(10)));
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
