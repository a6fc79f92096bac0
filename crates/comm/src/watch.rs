//! The watchdog of the copy-engine schedule (docs/protocols.md "The copy-engine schedule").
//!
//! A stream wait on a flag (`cuStreamWaitValue32`) cannot be aborted from the GPU, and no kernel
//! of the schedule polls an abort word. So one thread per process watches every call in flight:
//! when the application aborts, when a rank has failed (its abort word is set) or when the call
//! outlives `FLASHCOMM_TIMEOUT_MS`, it releases the call in three steps, in this order:
//!
//! 1. records the reason (what the communicator then reports),
//! 2. sets every rank's abort word (so the peers' watchdogs and kernels stop too),
//! 3. writes every flag the rank waits for, so every wait of the call is met and its streams drain.
//!
//! A released call stays watched until its streams drained; one that has not drained
//! [`RELEASE_AGAIN`] after its release has its flags written again (step 3 only, idempotent), and
//! so on, so a write that was lost or failed is not the end of the call.
//!
//! Without a timeout there is no limit, as with NCCL. What a call is (its flags, abort words,
//! status record) is behind [`Watched`], so the logic is tested on the CPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a call was released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The application aborted the communicator (`ncclCommAbort`, `ncclCommRevoke`).
    Abort,
    /// This rank set its abort word: it failed or gave up.
    PeerFailed(usize),
    /// The call outlived the configured time limit.
    Timeout(Duration),
}

/// A call in flight, as the watchdog sees it.
pub trait Watched: Send + Sync {
    /// Whether the call has finished (its streams drained); then it is forgotten.
    fn done(&self) -> bool;
    /// Whether the application asked this rank to abort.
    fn abort_requested(&self) -> bool;
    /// A rank whose abort word is set, if any.
    fn failed_peer(&self) -> Option<usize>;
    /// Step 1: records the reason where the communicator reports it.
    fn record(&self, reason: &Reason);
    /// Step 2: sets every rank's abort word.
    fn set_abort_words(&self);
    /// Step 3: writes every flag this rank waits for to a value past the call's last.
    fn release_flags(&self);
}

/// Whether a call started at `started` must be released now (`timeout`: none when `None`).
pub fn check(call: &dyn Watched, started: Instant, timeout: Option<Duration>) -> Option<Reason> {
    if call.abort_requested() {
        return Some(Reason::Abort);
    }
    if let Some(r) = call.failed_peer() {
        return Some(Reason::PeerFailed(r));
    }
    match timeout {
        Some(t) if started.elapsed() >= t => Some(Reason::Timeout(t)),
        _ => None,
    }
}

/// Releases a call: the three steps, in order.
pub fn release(call: &dyn Watched, reason: &Reason) {
    call.record(reason);
    call.set_abort_words();
    call.release_flags();
}

struct Entry {
    call: Arc<dyn Watched>,
    started: Instant,
    timeout: Option<Duration>,
    /// When the call was released (or its flags last written again).
    released: Option<Instant>,
}

/// How long a released call may take to drain before its flags are written again.
pub const RELEASE_AGAIN: Duration = Duration::from_millis(100);

struct Shared {
    calls: Mutex<Vec<Entry>>,
    stop: AtomicBool,
    /// Signalled when a call is watched or the watchdog stops: an idle watchdog sleeps on it
    /// instead of waking every `poll` in a job that has no call in flight.
    wake: Condvar,
}

/// The longest an idle watchdog sleeps without being woken (it is woken by every `watch` and
/// by its drop; the bound only limits what a missed wake-up could cost).
const IDLE: Duration = Duration::from_secs(1);

/// A thread that watches calls in flight ([`Watchdog::process`]: the one of the process).
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// A watchdog that looks at its calls every `poll`.
    pub fn new(poll: Duration) -> Watchdog {
        let shared = Arc::new(Shared {
            calls: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            wake: Condvar::new(),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("flashcomm-watch".into())
            .spawn(move || {
                while !s.stop.load(Ordering::Acquire) {
                    Self::sweep(&s);
                    let calls = s.calls.lock().unwrap_or_else(|e| e.into_inner());
                    if calls.is_empty() && !s.stop.load(Ordering::Acquire) {
                        drop(s.wake.wait_timeout(calls, IDLE));
                    } else {
                        drop(calls);
                        std::thread::sleep(poll);
                    }
                }
            })
            .ok();
        Watchdog { shared, thread }
    }

    /// The process's watchdog (started at its first use; it looks every 100 microseconds).
    pub fn process() -> &'static Watchdog {
        // Per process: a fork child has no thread of its parent's.
        static W: crate::gpu::PerProcess<Watchdog> = crate::gpu::PerProcess::fresh_in_children();
        W.get(|| Watchdog::new(Duration::from_micros(100)))
    }

    /// Watches `call` from now until it is done or released.
    pub fn watch(&self, call: Arc<dyn Watched>, timeout: Option<Duration>) {
        let mut calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.push(Entry {
            call,
            started: Instant::now(),
            timeout,
            released: None,
        });
        self.shared.wake.notify_one();
    }

    /// Calls still watched.
    pub fn watched(&self) -> usize {
        self.shared
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    fn sweep(s: &Shared) {
        let mut fired = Vec::new();
        let mut again = Vec::new();
        {
            let mut calls = s.calls.lock().unwrap_or_else(|e| e.into_inner());
            calls.retain_mut(|e| {
                if e.call.done() {
                    return false;
                }
                match e.released {
                    Some(t) if t.elapsed() >= RELEASE_AGAIN => {
                        again.push(Arc::clone(&e.call));
                        e.released = Some(Instant::now());
                    }
                    Some(_) => {}
                    None => {
                        if let Some(r) = check(e.call.as_ref(), e.started, e.timeout) {
                            fired.push((Arc::clone(&e.call), r));
                            e.released = Some(Instant::now());
                        }
                    }
                }
                true
            });
        }
        // Released outside the lock: a release may take a while (it writes peers' memory).
        for (call, r) in fired {
            release(call.as_ref(), &r);
        }
        for call in again {
            tracing::warn!(
                "a released copy-engine call has not drained after {RELEASE_AGAIN:?}: its flags are written again"
            );
            call.release_flags();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            // Under the lock: the thread is either before its check of `stop` or waiting.
            let _calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A call whose streams drain once every flag it waits for is written.
    #[derive(Default)]
    struct Mock {
        abort: AtomicBool,
        peer: AtomicUsize,
        released: AtomicBool,
        finished: AtomicBool,
        steps: Mutex<Vec<String>>,
        /// Times its flags were written, and how many writes its streams need to drain (0: 1).
        writes: AtomicUsize,
        drain_after: AtomicUsize,
    }

    impl Watched for Mock {
        fn done(&self) -> bool {
            self.finished.load(Ordering::Acquire)
                || self.writes.load(Ordering::Acquire)
                    >= self.drain_after.load(Ordering::Acquire).max(1)
        }
        fn abort_requested(&self) -> bool {
            self.abort.load(Ordering::Acquire)
        }
        fn failed_peer(&self) -> Option<usize> {
            match self.peer.load(Ordering::Acquire) {
                0 => None,
                r => Some(r - 1),
            }
        }
        fn record(&self, reason: &Reason) {
            self.steps
                .lock()
                .unwrap()
                .push(format!("record {reason:?}"));
        }
        fn set_abort_words(&self) {
            self.steps.lock().unwrap().push("abort words".into());
        }
        fn release_flags(&self) {
            self.steps.lock().unwrap().push("flags".into());
            self.writes.fetch_add(1, Ordering::AcqRel);
            self.released.store(true, Ordering::Release);
        }
    }

    fn wait_until(f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the watchdog did not act"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn no_reason_no_limit() {
        let m = Mock::default();
        let long_ago = Instant::now() - Duration::from_secs(3600);
        assert_eq!(check(&m, long_ago, None), None);
        assert_eq!(
            check(&m, long_ago, Some(Duration::from_secs(1))),
            Some(Reason::Timeout(Duration::from_secs(1)))
        );
        m.peer.store(3, Ordering::Release);
        assert_eq!(check(&m, Instant::now(), None), Some(Reason::PeerFailed(2)));
        m.abort.store(true, Ordering::Release);
        assert_eq!(check(&m, Instant::now(), None), Some(Reason::Abort));
    }

    #[test]
    fn releases_in_three_steps_in_order() {
        let w = Watchdog::new(Duration::from_millis(1));
        for (i, cause) in ["abort", "peer", "timeout"].into_iter().enumerate() {
            let m = Arc::new(Mock::default());
            let timeout = (cause == "timeout").then_some(Duration::from_millis(20));
            w.watch(m.clone(), timeout);
            std::thread::sleep(Duration::from_millis(5));
            assert!(!m.released.load(Ordering::Acquire), "{i}: released early");
            match cause {
                "abort" => m.abort.store(true, Ordering::Release),
                "peer" => m.peer.store(2, Ordering::Release),
                _ => {}
            }
            wait_until(|| m.released.load(Ordering::Acquire));
            let steps = m.steps.lock().unwrap().clone();
            let want = match cause {
                "abort" => "record Abort".to_string(),
                "peer" => "record PeerFailed(1)".to_string(),
                _ => "record Timeout(20ms)".to_string(),
            };
            assert_eq!(steps, [want, "abort words".into(), "flags".into()]);
            wait_until(|| w.watched() == 0);
        }
    }

    /// An idle watchdog sleeps (up to [`IDLE`]) but wakes for a call watched, and for its drop.
    #[test]
    fn an_idle_watchdog_wakes_for_a_call_and_for_its_drop() {
        let w = Watchdog::new(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(50));
        let m = Arc::new(Mock::default());
        m.abort.store(true, Ordering::Release);
        let t = Instant::now();
        w.watch(m.clone(), None);
        wait_until(|| m.released.load(Ordering::Acquire));
        assert!(t.elapsed() < IDLE / 2, "released after {:?}", t.elapsed());
        wait_until(|| w.watched() == 0);
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        drop(w);
        assert!(t.elapsed() < IDLE / 2, "dropped after {:?}", t.elapsed());
    }

    /// A released call whose streams did not drain stays watched, and its flags are written
    /// again every RELEASE_AGAIN (and nothing else again) until it drains.
    #[test]
    fn a_released_call_that_does_not_drain_has_its_flags_written_again() {
        let w = Watchdog::new(Duration::from_millis(1));
        let m = Arc::new(Mock::default());
        m.drain_after.store(3, Ordering::Release);
        m.abort.store(true, Ordering::Release);
        let t = Instant::now();
        w.watch(m.clone(), None);
        wait_until(|| w.watched() == 0);
        assert!(t.elapsed() >= 2 * RELEASE_AGAIN, "{:?}", t.elapsed());
        let steps = m.steps.lock().unwrap().clone();
        assert_eq!(
            steps,
            ["record Abort", "abort words", "flags", "flags", "flags"]
        );
    }

    #[test]
    fn a_finished_call_is_forgotten_unreleased() {
        let w = Watchdog::new(Duration::from_millis(1));
        let m = Arc::new(Mock::default());
        w.watch(m.clone(), Some(Duration::from_secs(3600)));
        m.finished.store(true, Ordering::Release);
        wait_until(|| w.watched() == 0);
        m.abort.store(true, Ordering::Release);
        std::thread::sleep(Duration::from_millis(10));
        assert!(m.steps.lock().unwrap().is_empty());
    }
}
