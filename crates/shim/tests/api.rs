//! The C API of the built library, in this process, forwarding to the real NCCL at
//! `$FLASHCOMM_NCCL_LIB` (the environment of `cargo test` after `source .toolchain/env.sh`).

mod common;

use std::sync::OnceLock;

use common::*;

/// The tests of this file run one at a time: the real library keeps one message for the whole
/// process, which the tests compare.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Our library, loaded once for this process (its configuration is read once).
fn ours() -> &'static Nccl {
    static OURS: OnceLock<Nccl> = OnceLock::new();
    OURS.get_or_init(|| {
        real_lib(); // fail early, with the setup message, when the real library is not set up
        Nccl::open(&cdylib())
    })
}

const FLOAT32: i32 = 7;
const SUM: i32 = 0;
/// A communicator address for flashcomm's own API, which only looks it up.
const BOGUS_COMM: usize = 0x10;

#[test]
fn version_is_the_real_librarys() {
    let _serial = serial();
    let (rc, v) = ours().version();
    assert_eq!(rc, SUCCESS, "{}", ours().last_error());
    assert_eq!(v, real_version());
    let f: unsafe extern "C" fn(*mut i32) -> i32 = ours().lib.get("pncclGetVersion");
    let mut pv = 0;
    // SAFETY: valid out pointer.
    assert_eq!(unsafe { f(&mut pv) }, SUCCESS);
    assert_eq!(pv, v);
}

#[test]
fn error_strings_match_the_real_library() {
    let _serial = serial();
    let real = Nccl::open(&real_lib());
    for code in [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, i32::MAX] {
        assert_eq!(
            ours().error_string(code),
            real.error_string(code),
            "code {code}"
        );
    }
    assert_eq!(
        ours().error_string(4),
        "invalid argument (run with NCCL_DEBUG=WARN for details)"
    );
}

/// The real library, opened directly in this process (the same object flashcomm forwards to).
fn real() -> &'static Nccl {
    static REAL: OnceLock<Nccl> = OnceLock::new();
    REAL.get_or_init(|| Nccl::open(&real_lib()))
}

/// `name` called through flashcomm and on the real library directly: the same code and the same
/// `ncclGetLastError` (flashcomm's answer is the real library's).
fn same_answer(name: &str, a: &CollArgs) {
    let mine = call_collective(&ours().lib, name, a);
    let mine_msg = ours().last_error();
    let theirs = call_collective(&real().lib, name, a);
    let theirs_msg = real().last_error();
    assert_eq!(
        (mine, mine_msg.as_str()),
        (theirs, theirs_msg.as_str()),
        "{name} {a:?}"
    );
}

#[test]
fn count_zero_on_a_handle_that_is_not_a_communicator_is_the_real_librarys_error() {
    let _serial = serial();
    for name in collective_exports() {
        for (send, recv) in [(0, 0), (0x1000, 0x2000)] {
            let a = CollArgs {
                send,
                recv,
                count: 0,
                ..CollArgs::on(foreign_handle())
            };
            let rc = call_collective(&ours().lib, name, &a);
            assert_eq!(rc, INVALID_ARGUMENT, "{name}: not success");
            assert_eq!(
                ours().last_error(),
                "Error: corrupted comm object detected",
                "{name}"
            );
            same_answer(name, &a);
        }
    }
}

#[test]
fn calls_flashcomm_does_not_route_get_the_real_librarys_answer() {
    let _serial = serial();
    for name in collective_exports() {
        // No communicator, with and without a count.
        for count in [0, 8] {
            same_answer(
                name,
                &CollArgs {
                    count,
                    ..CollArgs::on(0)
                },
            );
        }
        // Datatypes and operators past the pinned header, null buffers, a count that overflows.
        for dt in [-1, 12, 13, 64, i32::MAX] {
            same_answer(
                name,
                &CollArgs {
                    dt,
                    ..CollArgs::on(foreign_handle())
                },
            );
        }
        for op in [-1, -5, i32::MIN, 5, 64, i32::MAX] {
            same_answer(
                name,
                &CollArgs {
                    op,
                    ..CollArgs::on(foreign_handle())
                },
            );
        }
        same_answer(
            name,
            &CollArgs {
                send: 0,
                recv: 0,
                ..CollArgs::on(foreign_handle())
            },
        );
        same_answer(
            name,
            &CollArgs {
                count: usize::MAX,
                dt: 10,
                ..CollArgs::on(foreign_handle())
            },
        );
    }
    // The message is the real library's own, not flashcomm's.
    assert_eq!(
        call_collective(&ours().lib, "pncclAllReduce", &CollArgs::on(0)),
        INVALID_ARGUMENT
    );
    assert_eq!(ours().last_error(), "AllReduce : comm argument is NULL");
}

/// NCCL's group end returns the error of a call that failed inside the group; so does
/// flashcomm's, for the calls it once refused itself (which the real group never saw).
#[test]
fn an_error_inside_a_group_is_the_groups_result() {
    let _serial = serial();
    type GroupFn = unsafe extern "C" fn() -> i32;
    let foreign = foreign_handle();
    let cases: [(&str, CollArgs); 5] = [
        ("ncclAllReduce", CollArgs::on(0)),
        (
            "ncclAllReduce",
            CollArgs {
                dt: 12,
                ..CollArgs::on(foreign)
            },
        ),
        ("ncclSend", CollArgs::on(0)),
        ("ncclRecv", CollArgs::on(0)),
        (
            "ncclAllGather",
            CollArgs {
                count: 0,
                ..CollArgs::on(foreign)
            },
        ),
    ];
    for (name, a) in cases {
        let mut results = Vec::new();
        for lib in [&ours().lib, &real().lib] {
            let start: GroupFn = lib.get("ncclGroupStart");
            let end: GroupFn = lib.get("ncclGroupEnd");
            // SAFETY: ncclGroupStart/End take no arguments.
            let started = unsafe { start() };
            let rc = call_collective(lib, name, &a);
            // SAFETY: as above.
            let ended = unsafe { end() };
            results.push((started, rc, ended));
        }
        assert_eq!(results[0], results[1], "{name} {a:?}: flashcomm, then NCCL");
        assert_eq!(results[0].2, INVALID_ARGUMENT, "{name}: the group's result");
    }
}

#[test]
fn last_error_is_per_thread_first() {
    let _serial = serial();
    let n = ours();
    // A failure of flashcomm's own (a communicator it does not know).
    let (rc, _) = n.stats(0x40);
    assert_eq!(rc, INVALID_ARGUMENT);
    let mine = n.last_error();
    assert!(mine.contains("is not known to flashcomm"), "{mine}");
    std::thread::scope(|s| {
        s.spawn(|| {
            // Another thread's failure does not replace this thread's message...
            assert_eq!(n.all_reduce(0, 0, 1, FLOAT32, SUM, 0), INVALID_ARGUMENT);
            assert_eq!(n.last_error(), "AllReduce : comm argument is NULL");
        });
    });
    assert_eq!(n.last_error(), mine);
    // ...and a thread without failures sees the process's last one (non-empty).
    std::thread::scope(|s| {
        s.spawn(|| assert!(!n.last_error().is_empty()));
    });
}

#[test]
fn extension_api() {
    let _serial = serial();
    let n = ours();
    let f: unsafe extern "C" fn(*mut i32) -> i32 = n.lib.get("flashcommGetVersion");
    let mut v = 0;
    // SAFETY: valid out pointer.
    assert_eq!(unsafe { f(&mut v) }, SUCCESS);
    assert_eq!(v, 100, "flashcomm 0.1.0");
    // SAFETY: NULL is refused.
    assert_eq!(unsafe { f(std::ptr::null_mut()) }, INVALID_ARGUMENT);

    let cfg = n.config_string();
    assert!(
        cfg.contains(&format!("FLASHCOMM_NCCL_LIB={}\n", real_lib().display())),
        "{cfg}"
    );
    assert!(cfg.contains("FLASHCOMM_QUANT_BITS=off  # default"), "{cfg}");
    assert!(cfg.ends_with("passthrough=no\n"), "{cfg}");

    let (rc, _) = n.stats(0);
    assert_eq!(rc, SUCCESS);
    let (rc, _) = n.stats(BOGUS_COMM);
    assert_eq!(rc, INVALID_ARGUMENT);
    assert!(n.last_error().contains("is not known to flashcomm"));

    // A buffer that is too small: truncated, NUL-terminated, and an error saying what is needed.
    let g: unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> i32 =
        n.lib.get("flashcommGetConfigString");
    let mut small = [1 as std::ffi::c_char; 8];
    // SAFETY: the buffer has the length passed.
    let rc = unsafe { g(small.as_mut_ptr(), small.len()) };
    assert_eq!(rc, INVALID_ARGUMENT);
    assert_eq!(small[7], 0);
    assert!(
        n.last_error().contains("is too small"),
        "{}",
        n.last_error()
    );
}

#[test]
fn plain_forwarders_reach_the_real_library() {
    let _serial = serial();
    // ncclCommCount with a NULL communicator is refused by the real NCCL, not by us: the call
    // went through the generated forwarder.
    let n = ours();
    let (rc, _) = n.comm_int("ncclCommCount", 0);
    assert_eq!(rc, INVALID_ARGUMENT);
    let (rc2, _) = n.comm_int("pncclCommCount", 0);
    assert_eq!(rc2, INVALID_ARGUMENT);
    // The real library holds the message of its own failure.
    let msg = n.last_error();
    let real = Nccl::open(&real_lib());
    assert_eq!(msg, real.last_error());
}
