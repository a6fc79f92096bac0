//! The C API of the built library, in this process, forwarding to the real NCCL at
//! `$FLASHCOMM_NCCL_LIB` (the environment of `cargo test` after `source .toolchain/env.sh`).

mod common;

use std::sync::OnceLock;

use common::*;

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
/// A communicator address the library must never dereference in these tests (every call that
/// gets it fails its checks first, or has count 0).
const BOGUS_COMM: usize = 0x10;

#[test]
fn version_is_the_real_librarys() {
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

#[test]
fn null_comm_is_an_invalid_argument_with_a_message() {
    let n = ours();
    assert_eq!(
        n.all_reduce(0x1000, 0x2000, 8, FLOAT32, SUM, 0),
        INVALID_ARGUMENT
    );
    assert_eq!(n.last_error(), "ncclAllReduce: comm argument is NULL");
    // Even with count 0: the communicator is checked first, as NCCL does.
    assert_eq!(n.all_reduce(0, 0, 0, FLOAT32, SUM, 0), INVALID_ARGUMENT);
    assert_eq!(
        n.all_reduce_named("pncclAllReduce", 0, 0, 4, FLOAT32, SUM, 0),
        INVALID_ARGUMENT
    );
    assert_eq!(n.last_error(), "ncclAllReduce: comm argument is NULL");
}

#[test]
fn unknown_datatypes_and_negative_operators_are_refused() {
    let n = ours();
    for dt in [12, 13, 1000, -1] {
        assert_eq!(
            n.all_reduce(0x1000, 0x2000, 8, dt, SUM, BOGUS_COMM),
            INVALID_ARGUMENT
        );
        let msg = n.last_error();
        assert!(msg.contains(&format!("invalid datatype {dt}")), "{msg}");
    }
    for op in [-1, -5, i32::MIN] {
        assert_eq!(
            n.all_reduce(0x1000, 0x2000, 8, FLOAT32, op, BOGUS_COMM),
            INVALID_ARGUMENT
        );
        let msg = n.last_error();
        assert!(
            msg.contains(&format!("invalid reduction operation {op}")),
            "{msg}"
        );
    }
}

#[test]
fn null_buffers_with_a_count_are_refused() {
    let n = ours();
    assert_eq!(
        n.all_reduce(0, 0x2000, 8, FLOAT32, SUM, BOGUS_COMM),
        INVALID_ARGUMENT
    );
    assert_eq!(
        n.last_error(),
        "ncclAllReduce: sendbuff is NULL with count 8"
    );
    assert_eq!(
        n.all_reduce(0x1000, 0, 8, FLOAT32, SUM, BOGUS_COMM),
        INVALID_ARGUMENT
    );
    assert_eq!(
        n.last_error(),
        "ncclAllReduce: recvbuff is NULL with count 8"
    );
}

#[test]
fn zero_count_succeeds_without_any_work() {
    let n = ours();
    let (_, before) = n.stats(0);
    // Null buffers and a communicator the real library would crash on: nothing is touched.
    assert_eq!(n.all_reduce(0, 0, 0, FLOAT32, SUM, BOGUS_COMM), SUCCESS);
    assert_eq!(n.all_reduce_config(0, FLOAT32, SUM, BOGUS_COMM, 0), SUCCESS);
    type SendFn = unsafe extern "C" fn(usize, usize, i32, i32, usize, usize) -> i32;
    for name in ["ncclSend", "ncclRecv", "pncclSend"] {
        let f: SendFn = n.lib.get(name);
        // SAFETY: count 0 with a valid datatype and a non-null communicator: checked, not used.
        let rc = unsafe { f(0, 0, FLOAT32, 1, BOGUS_COMM, 0) };
        assert_eq!(rc, SUCCESS, "{name}");
    }
    let (rc, after) = n.stats(0);
    assert_eq!(rc, SUCCESS);
    assert_eq!(
        before.calls, after.calls,
        "zero-count calls are not counted"
    );
}

#[test]
fn send_and_receive_have_the_same_checks() {
    let n = ours();
    type SendFn = unsafe extern "C" fn(usize, usize, i32, i32, usize, usize) -> i32;
    let send: SendFn = n.lib.get("ncclSend");
    // SAFETY: the checks refuse these before anything is used.
    let rc = unsafe { send(0x1000, 4, FLOAT32, 0, 0, 0) };
    assert_eq!(rc, INVALID_ARGUMENT);
    assert_eq!(n.last_error(), "ncclSend: comm argument is NULL");
    // SAFETY: as above.
    let rc = unsafe { send(0, 4, FLOAT32, 0, BOGUS_COMM, 0) };
    assert_eq!(rc, INVALID_ARGUMENT);
    assert_eq!(n.last_error(), "ncclSend: sendbuff is NULL with count 4");
    let recv: SendFn = n.lib.get("ncclRecv");
    // SAFETY: as above.
    let rc = unsafe { recv(0x1000, 4, 99, 0, BOGUS_COMM, 0) };
    assert_eq!(rc, INVALID_ARGUMENT);
    assert!(n.last_error().contains("ncclRecv: invalid datatype 99"));
}

#[test]
fn last_error_is_per_thread_first() {
    let n = ours();
    assert_eq!(
        n.all_reduce(0x1000, 0x2000, 8, 55, SUM, BOGUS_COMM),
        INVALID_ARGUMENT
    );
    let mine = n.last_error();
    assert!(mine.contains("invalid datatype 55"), "{mine}");
    std::thread::scope(|s| {
        s.spawn(|| {
            // Another thread's failure does not replace this thread's message...
            assert_eq!(n.all_reduce(0, 0, 1, FLOAT32, SUM, 0), INVALID_ARGUMENT);
            assert_eq!(n.last_error(), "ncclAllReduce: comm argument is NULL");
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
