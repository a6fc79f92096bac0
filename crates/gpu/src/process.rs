//! Per-process state that a fork child makes afresh ([`PerProcess`]) and the fork generation
//! it is told apart by.
//!
//! A fork child is a new process: flashcomm works in it as in any other. What it must not trust
//! is what it inherited from the parent's other threads, which do not exist in the child: a lock
//! one of them held at the fork stays held forever, and a value one of them was making is half
//! made. The only thing that happens at the fork itself is an atomic increment (the child
//! handler, registered before the first value is made); every value that a child must make
//! afresh notices the new generation at its next use, and a value still being made by a thread
//! of another process is made again. Every crate's process-wide locks and caches (devices,
//! loaded kernels, the communicators' ledgers, the shim's registry) live in one.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};

/// Forks since flashcomm was first used in this address space's ancestry (each child adds one).
static FORKS: AtomicU32 = AtomicU32::new(0);
/// Whether the fork handler is registered (inherited by children, which keep it).
static WATCHING: AtomicBool = AtomicBool::new(false);

extern "C" fn in_forked_child() {
    // Only an atomic increment: everything else is done lazily, by each value that notices the
    // new generation (the child has one thread now, but its memory holds whatever the parent's
    // other threads were doing).
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation: it differs from the parent's in every fork child.
#[inline]
pub fn fork_generation() -> u32 {
    FORKS.load(Ordering::Relaxed)
}

/// Registers the fork handler, once per address space (at the first value made, or earlier;
/// never from a library constructor). `Err`: `pthread_atfork`'s error code (a fork child will then take its parent's
/// state for its own).
pub fn watch_fork() -> Result<(), i32> {
    if WATCHING.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    // SAFETY: the handler is a plain function of this library that only increments an atomic;
    // this library is never unloaded (the real NCCL pins no reference to us, and we do not
    // dlclose ourselves), so the pointer stays valid.
    let rc = unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    if rc == 0 {
        Ok(())
    } else {
        WATCHING.store(false, Ordering::Release);
        Err(rc)
    }
}

/// Phases of [`PerProcess`]'s word (its low two bits).
const EMPTY: u64 = 0;
const MAKING: u64 = 1;
const READY: u64 = 2;
const PHASE: u64 = 3;

/// A value made once per process, on first use, that never blocks a fork child on its parent.
///
/// * `inherited` values (the configuration, the loaded real library): a fork child uses what
///   its parent had finished making.
/// * the others (the registry of communicators, the process-wide last error, the engagement
///   line): a fork child makes its own at first use, and never touches its parent's (leaked, with
///   any lock a parent's thread held in it).
///
/// Either way, a value that a thread of another process was making when it forked (so, in a
/// child, a thread that no longer exists) is made again. Reading a made value is two atomic
/// loads and a comparison: no lock, no allocation, no system call. Making one must not read the
/// same value (it would wait for itself).
pub struct PerProcess<T: 'static> {
    /// `EMPTY`; `pid << 32 | MAKING` (a thread of process `pid` is making it);
    /// `generation << 2 | READY` (made in fork generation `generation`, modulo 2^30).
    word: AtomicU64,
    value: AtomicPtr<T>,
    inherited: bool,
}

impl<T: 'static> PerProcess<T> {
    /// A value that fork children take from their parent once it is made.
    pub const fn inherited() -> Self {
        PerProcess {
            word: AtomicU64::new(EMPTY),
            value: AtomicPtr::new(std::ptr::null_mut()),
            inherited: true,
        }
    }

    /// A value every fork child makes afresh.
    pub const fn fresh_in_children() -> Self {
        PerProcess {
            word: AtomicU64::new(EMPTY),
            value: AtomicPtr::new(std::ptr::null_mut()),
            inherited: false,
        }
    }

    fn ready_here(&self, word: u64) -> bool {
        word & PHASE == READY
            && (self.inherited || (word >> 2) as u32 == fork_generation() & (u32::MAX >> 2))
    }

    fn value(&self) -> &'static T {
        // SAFETY: READY is stored (Release, read with Acquire before this) only after `value`
        // holds a pointer from `Box::into_raw` of a fully made `T`; no value is ever freed (an
        // old one is leaked when a fork child makes its own), so the reference lives for the
        // rest of the process.
        unsafe { &*self.value.load(Ordering::Acquire) }
    }

    /// The value of this process, made by `make` on first use.
    #[inline]
    pub fn get(&'static self, make: impl FnOnce() -> T) -> &'static T {
        if self.ready_here(self.word.load(Ordering::Acquire)) {
            return self.value();
        }
        self.make(make)
    }

    /// The value, if this process has made (or, `inherited`, received) it.
    pub fn get_made(&'static self) -> Option<&'static T> {
        self.ready_here(self.word.load(Ordering::Acquire))
            .then(|| self.value())
    }

    #[cold]
    fn make(&'static self, make: impl FnOnce() -> T) -> &'static T {
        let me = u64::from(std::process::id());
        loop {
            let word = self.word.load(Ordering::Acquire);
            if self.ready_here(word) {
                return self.value();
            }
            if word & PHASE == MAKING && word >> 32 == me {
                // Another thread of this process is making it.
                std::thread::yield_now();
                continue;
            }
            // Never made, made in another fork generation (not inherited), or being made by a
            // thread of another process (a parent's thread, gone in this child): make it here.
            if self
                .word
                .compare_exchange(word, me << 32 | MAKING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // If `make` panics, the value is left unmade for the next caller to try again.
            struct Unmade<'a>(&'a AtomicU64, Option<u64>);
            impl Drop for Unmade<'_> {
                fn drop(&mut self) {
                    if let Some(w) = self.1 {
                        self.0.store(w, Ordering::Release);
                    }
                }
            }
            let mut unmade = Unmade(&self.word, Some(word));
            // A fork after this value exists must be noticed: the handler is in place first.
            let _ = watch_fork();
            let generation = u64::from(fork_generation() & (u32::MAX >> 2));
            let v = Box::into_raw(Box::new(make()));
            self.value.store(v, Ordering::Release);
            unmade.1 = None;
            self.word.store(generation << 2 | READY, Ordering::Release);
            return self.value();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_made_once_per_process() {
        static V: PerProcess<String> = PerProcess::fresh_in_children();
        static MADE: AtomicU32 = AtomicU32::new(0);
        assert!(V.get_made().is_none());
        let make = || {
            MADE.fetch_add(1, Ordering::Relaxed);
            "made".to_string()
        };
        let a = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| V.get(make).as_str())).collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(a.iter().all(|v| *v == "made"));
        assert_eq!(MADE.load(Ordering::Relaxed), 1);
        assert_eq!(V.get_made().map(String::as_str), Some("made"));
    }

    #[test]
    fn a_value_whose_maker_panicked_is_made_again() {
        static V: PerProcess<u32> = PerProcess::inherited();
        let r = std::panic::catch_unwind(|| *V.get(|| panic!("no")));
        assert!(r.is_err());
        assert!(V.get_made().is_none());
        assert_eq!(*V.get(|| 7), 7);
    }

    /// Issue 45, item 7: a fork child never waits for a lock a thread of its parent held at the
    /// fork. Parent threads hold a per-process lock most of the time (as set-up and release hold
    /// the caches and ledgers of the communicator crates); every child takes it at once. A plain
    /// `static Mutex` there leaves children blocked for ever (killed after 10 s here).
    #[test]
    fn a_fork_child_never_waits_for_a_lock_its_parent_held() {
        use std::sync::Mutex;
        use std::time::{Duration, Instant};
        static LOCK: PerProcess<Mutex<u64>> = PerProcess::fresh_in_children();
        let stop = AtomicBool::new(false);
        let hung = std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let mut g = LOCK.get(|| Mutex::new(0)).lock().unwrap();
                        *g += 1;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(5));
            let mut hung = 0;
            for _ in 0..20 {
                // SAFETY: the child only takes the lock, then leaves with _exit.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork");
                if pid == 0 {
                    let ok = LOCK.get(|| Mutex::new(0)).try_lock().is_ok()
                        && *LOCK.get(|| Mutex::new(0)).lock().unwrap() == 0;
                    // SAFETY: ends the child without the parent's exit handlers.
                    unsafe { libc::_exit(if ok { 0 } else { 1 }) };
                }
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut status = 0;
                loop {
                    // SAFETY: our own child, without blocking.
                    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                    if r == pid {
                        assert!(
                            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                            "the child found its parent's value or lock: status {status}"
                        );
                        break;
                    }
                    if Instant::now() > deadline {
                        // SAFETY: our own child, not reaped yet.
                        unsafe {
                            libc::kill(pid, libc::SIGKILL);
                            libc::waitpid(pid, &mut status, 0);
                        }
                        hung += 1;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            stop.store(true, Ordering::Relaxed);
            hung
        });
        assert_eq!(
            hung, 0,
            "{hung} of 20 children waited for their parent's lock"
        );
    }

    #[test]
    fn a_value_being_made_by_another_process_is_made_here() {
        static V: PerProcess<u32> = PerProcess::fresh_in_children();
        // As a child finds it when a thread of its parent (no process of ours has this pid) was
        // making it at the fork.
        V.word
            .store(u64::from(u32::MAX) << 32 | MAKING, Ordering::Release);
        assert_eq!(*V.get(|| 5), 5);
    }
}
