//! `fork()`: a child is a new process, and flashcomm works in it as in any other (only state
//! inherited from the parent is left alone: its communicators, its locks, its half-done work);
//! and children forked while the parent's threads are inside flashcomm neither crash nor hang.
//! Each scenario runs in a child process of the test binary, which then forks.

mod common;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use common::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

/// `flashcommCommInfo_t` of `include/flashcomm.h`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CommInfo {
    served: c_int,
    rank: c_int,
    nranks: c_int,
    device: c_int,
    arena_bytes: u64,
    reason: [u8; 256],
}

fn comm_info(n: &Nccl, comm: usize) -> (c_int, CommInfo) {
    let f: unsafe extern "C" fn(usize, *mut CommInfo) -> c_int = n.lib.get("flashcommCommGetInfo");
    let mut info = CommInfo {
        served: -7,
        rank: -7,
        nranks: -7,
        device: -7,
        arena_bytes: 7,
        reason: [0; 256],
    };
    // SAFETY: `info` is a valid out pointer of the header's layout.
    let rc = unsafe { f(comm, &mut info) };
    (rc, info)
}

fn init_rank(n: &Nccl, nranks: c_int, rank: c_int) -> (c_int, usize) {
    let f: unsafe extern "C" fn(*mut usize, c_int, UniqueId, c_int) -> c_int =
        n.lib.get("ncclCommInitRank");
    let mut comm = 0usize;
    // SAFETY: valid out pointer; the id is passed by value as the header declares.
    let rc = unsafe { f(&mut comm, nranks, UniqueId([0; 128]), rank) };
    (rc, comm)
}

/// Forks; the child runs `f` and leaves with its result as the exit status (0: passed), never
/// returning. Returns the child's pid.
fn fork_child(f: impl FnOnce() -> bool) -> libc::pid_t {
    // SAFETY: the child calls into the libraries and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
        // SAFETY: _exit ends the child without running the parent's atexit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    pid
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Passed,
    Failed(i32),
    Signal(i32),
    Hung,
}

/// Waits for `pid` until `deadline`, then kills it.
fn wait_child(pid: libc::pid_t, deadline: Instant) -> Ended {
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return if libc::WIFSIGNALED(status) {
                Ended::Signal(libc::WTERMSIG(status))
            } else if libc::WEXITSTATUS(status) == 0 {
                Ended::Passed
            } else {
                Ended::Failed(libc::WEXITSTATUS(status))
            };
        }
        if Instant::now() > deadline {
            // SAFETY: our own child, which has not been reaped.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Ended::Hung;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn fake_child(name: &str, extra: &[(&str, &str)]) {
    let fake = fake_lib();
    let mut env = vec![("FLASHCOMM_NCCL_LIB", fake.to_str().unwrap())];
    env.extend_from_slice(extra);
    run_child(name, &env, &[]);
}

/// A parent that has used flashcomm forks its peers and is a rank itself (the pattern of
/// launchers that create the unique id first): every process, children included, runs
/// flashcomm's set-up of the new communicator at the same point, so all ranks take the same
/// route. (Before, a fork child skipped the set-up and every later call of the parent paired
/// with the wrong call of its peers.) The fake real library reports each process's rank.
#[test]
fn a_fork_child_sets_up_its_communicators_like_any_process() {
    let name = "a_fork_child_sets_up_its_communicators_like_any_process";
    if is_child(name) {
        let ours = Nccl::open(&cdylib());
        assert_eq!(ours.version(), (SUCCESS, 21903), "flashcomm is initialized");
        let ranks = 4;
        let check = move |rank: c_int| {
            let ours = Nccl::open(&cdylib());
            let (rc, comm) = init_rank(&ours, ranks, rank);
            let (info_rc, info) = comm_info(&ours, comm);
            // Known to flashcomm, set up (not served: no GPU, or the fake has no all-gather),
            // with the rank and size the real library reported in this process.
            rc == SUCCESS
                && info_rc == SUCCESS
                && (info.served, info.rank, info.nranks) == (0, rank, ranks)
                && info.reason[0] != 0
        };
        let children: Vec<_> = (1..ranks).map(|r| fork_child(move || check(r))).collect();
        assert!(check(0), "the parent is rank 0");
        let deadline = Instant::now() + Duration::from_secs(30);
        for (r, pid) in children.into_iter().enumerate() {
            assert_eq!(wait_child(pid, deadline), Ended::Passed, "rank {}", r + 1);
        }
        return;
    }
    fake_child(name, &[]);
}

/// What a child inherits from its parent is left alone: the parent's communicators are unknown
/// to flashcomm in the child (their calls go to the real library, which answers for them), and
/// the child's own are its own.
#[test]
fn a_parents_communicators_are_not_a_fork_childs() {
    let name = "a_parents_communicators_are_not_a_fork_childs";
    if is_child(name) {
        let ours = Nccl::open(&cdylib());
        let fake = Lib::open(std::path::Path::new(
            &std::env::var("FLASHCOMM_NCCL_LIB").unwrap(),
        ));
        let (rc, parents) = init_rank(&ours, 1, 0);
        assert_eq!(rc, SUCCESS);
        assert_eq!(comm_info(&ours, parents).0, SUCCESS);
        let calls = fake.int("fake_allreduce_calls");
        let pid = fork_child(|| {
            let ours = Nccl::open(&cdylib());
            let unknown = comm_info(&ours, parents).0 == INVALID_ARGUMENT
                && ours.last_error().contains("is not known to flashcomm");
            let forwarded = ours.all_reduce(0x1000, 0x2000, 4, 7, 0, parents) == SUCCESS
                && fake.int("fake_allreduce_calls") == calls + 1;
            let (rc, own) = init_rank(&ours, 1, 0);
            let known = rc == SUCCESS && comm_info(&ours, own).0 == SUCCESS;
            unknown && forwarded && known
        });
        assert_eq!(
            wait_child(pid, Instant::now() + Duration::from_secs(30)),
            Ended::Passed
        );
        assert_eq!(
            comm_info(&ours, parents).0,
            SUCCESS,
            "the parent's is unchanged"
        );
        return;
    }
    fake_child(name, &[]);
}

/// Every error flashcomm returns has a message, in a fork child too (a child used to record
/// none, leaving `ncclGetLastError` empty or stale).
#[test]
fn every_error_of_a_fork_child_has_a_message() {
    let name = "every_error_of_a_fork_child_has_a_message";
    if is_child(name) {
        let ours = Nccl::open(&cdylib());
        assert_eq!(ours.version().0, SUCCESS);
        let pid = fork_child(|| {
            let ours = Nccl::open(&cdylib());
            let (rc, _) = init_rank(&ours, 1, 0);
            let injected = rc == INTERNAL_ERROR
                && ours
                    .last_error()
                    .contains("ncclCommInitRank: internal error in flashcomm");
            let own = ours.stats(0x40).0 == INVALID_ARGUMENT
                && ours.last_error().contains("0x40 is not known to flashcomm");
            injected && own
        });
        assert_eq!(
            wait_child(pid, Instant::now() + Duration::from_secs(30)),
            Ended::Passed
        );
        return;
    }
    fake_child(name, &[("FLASHCOMM_DEBUG_PANIC", "ncclCommInitRank")]);
}

/// Children forked while the parent's threads keep calling into flashcomm work: each child's
/// first call initializes the real NCCL (the parent never did), then reads the last error, the
/// version and one of flashcomm's own errors. The parent's threads were inside flashcomm's
/// failure path (a log line and the last error) at every fork; whatever they held, no child
/// crashes or hangs.
#[test]
fn fork_children_work_while_the_parents_threads_are_inside_flashcomm() {
    let name = "fork_children_work_while_the_parents_threads_are_inside_flashcomm";
    if is_child(name) {
        let ours = Nccl::open(&cdylib());
        let version = real_version_from_env();
        // Resolved before any fork: the children call straight in, as a program linked against
        // the library does.
        type AllReduce =
            unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
        type LastError = unsafe extern "C" fn(usize) -> *const std::ffi::c_char;
        type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
        type GetStats = unsafe extern "C" fn(usize, *mut [u64; 48]) -> c_int;
        let all_reduce: AllReduce = ours.lib.get("ncclAllReduce");
        let last_error: LastError = ours.lib.get("ncclGetLastError");
        let get_version: GetVersion = ours.lib.get("ncclGetVersion");
        let get_stats: GetStats = ours.lib.get("flashcommGetStats");
        let message = move || {
            // SAFETY: ncclGetLastError returns a NUL-terminated string (or NULL).
            let p = unsafe { last_error(0) };
            // SAFETY: as above, valid until the thread's next call.
            (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes().to_vec())
        };
        let stop = std::sync::atomic::AtomicBool::new(false);
        let forks: usize = std::env::var("FORKS").unwrap().parse().unwrap();
        let results = std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let mut stats = [0u64; 48];
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        // flashcomm's own failure: a WARN line and this thread's last error.
                        // SAFETY: `stats` has flashcommStats_t's size.
                        assert_eq!(unsafe { get_stats(0x40, &mut stats) }, INVALID_ARGUMENT);
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(20));
            let mut results = Vec::new();
            let mut running = std::collections::VecDeque::new();
            for _ in 0..forks {
                let pid = fork_child(|| {
                    // SAFETY: NCCL's signatures; the real library refuses the call (no
                    // communicator) before it looks at the buffers.
                    let rc = unsafe { all_reduce(0x1000, 0x2000, 4, 7, 0, 0, 0) };
                    let msg = message();
                    let mut v = 0;
                    // SAFETY: a valid out pointer.
                    let vrc = unsafe { get_version(&mut v) };
                    let mut stats = [0u64; 48];
                    // SAFETY: `stats` has flashcommStats_t's size.
                    let own = unsafe { get_stats(0x40, &mut stats) } == INVALID_ARGUMENT
                        && message().is_some_and(|m| {
                            String::from_utf8_lossy(&m).contains("is not known to flashcomm")
                        });
                    rc == INVALID_ARGUMENT
                        && msg.is_some_and(|m| {
                            String::from_utf8_lossy(&m).contains("comm argument is NULL")
                        })
                        && (vrc, v) == (SUCCESS, version)
                        && own
                });
                running.push_back((pid, Instant::now() + Duration::from_secs(20)));
                if running.len() >= 8 {
                    let (pid, deadline) = running.pop_front().unwrap();
                    results.push(wait_child(pid, deadline));
                }
            }
            for (pid, deadline) in running {
                results.push(wait_child(pid, deadline));
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            results
        });
        let bad: Vec<_> = results.iter().filter(|e| **e != Ended::Passed).collect();
        println!(
            "{} children, {} not passed: {bad:?}",
            results.len(),
            bad.len()
        );
        assert!(bad.is_empty(), "{} of {forks} children: {bad:?}", bad.len());
        return;
    }
    run_child(
        name,
        &[
            ("FLASHCOMM_NCCL_LIB", real_lib().to_str().unwrap()),
            ("EXPECT_VERSION", &real_version().to_string()),
            ("FORKS", "300"),
            // The parent's lines go nowhere (they are many); writing them is what matters.
            ("FLASHCOMM_LOG_FILE", "/dev/null"),
        ],
        &[],
    );
}

fn real_version_from_env() -> c_int {
    std::env::var("EXPECT_VERSION").unwrap().parse().unwrap()
}
