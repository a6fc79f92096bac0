//! Forwarding semantics against a fake "older real NCCL" (tests/fake/fake_nccl.c: version
//! 2.19.3, records what it receives, lacks many functions). Each scenario runs in a child process
//! with `FLASHCOMM_NCCL_LIB` pointing at the fake.

mod common;

use std::ffi::c_int;

use common::*;

const FLOAT32: c_int = 7;
const BF16: c_int = 9;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
struct Team {
    n_ranks: c_int,
    rank: c_int,
    stride: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

struct Both {
    ours: Nccl,
    fake: Lib,
}

/// In a child: our library and the fake it forwards to (the same object our library opened).
fn both() -> Both {
    let ours = Nccl::open(&cdylib());
    assert_eq!(ours.version(), (SUCCESS, 21903), "{}", ours.last_error());
    let fake = Lib::open(std::path::Path::new(
        &std::env::var("FLASHCOMM_NCCL_LIB").unwrap(),
    ));
    Both { ours, fake }
}

fn child(name: &str, extra: &[(&str, &str)]) -> std::process::Output {
    let fake = fake_lib();
    let mut env = vec![("FLASHCOMM_NCCL_LIB", fake.to_str().unwrap())];
    env.extend_from_slice(extra);
    run_child(name, &env, &[])
}

fn init_rank(n: &Nccl) -> usize {
    let f: unsafe extern "C" fn(*mut usize, c_int, UniqueId, c_int) -> c_int =
        n.lib.get("ncclCommInitRank");
    let mut comm = 0usize;
    // SAFETY: valid out pointer; the id is passed by value as the header declares.
    assert_eq!(unsafe { f(&mut comm, 1, UniqueId([0; 128]), 0) }, SUCCESS);
    comm
}

#[test]
fn functions_the_real_library_lacks() {
    let name = "functions_the_real_library_lacks";
    if is_child(name) {
        let Both { ours, .. } = both();
        type Shrink =
            unsafe extern "C" fn(usize, *mut c_int, c_int, *mut usize, usize, c_int) -> c_int;
        let shrink: Shrink = ours.lib.get("ncclCommShrink");
        let mut out = 0usize;
        // SAFETY: the call fails before anything is used.
        let rc = unsafe { shrink(0x10, std::ptr::null_mut(), 0, &mut out, 0, 0) };
        assert_eq!(rc, INVALID_USAGE);
        let msg = ours.last_error();
        for part in [
            "ncclCommShrink",
            "2.19.3",
            "2.32.3",
            "is not provided by the real NCCL",
        ] {
            assert!(msg.contains(part), "{part}: {msg}");
        }
        // Functions without an ncclResult_t return their documented defaults.
        let world: unsafe extern "C" fn(usize) -> Team = ours.lib.get("ncclTeamWorld");
        // SAFETY: the fake lacks the function; nothing is dereferenced.
        let rc = unsafe { world(0x10) };
        assert_eq!(
            rc,
            Team {
                n_ranks: 0,
                rank: 0,
                stride: 0
            }
        );
        assert!(ours.last_error().contains("ncclTeamWorld"));
        let to_world: unsafe extern "C" fn(usize, Team, c_int) -> c_int =
            ours.lib.get("pncclTeamRankToWorld");
        let team = Team {
            n_ranks: 1,
            rank: 0,
            stride: 1,
        };
        // SAFETY: as above.
        let rc = unsafe { to_world(0x10, team, 0) };
        assert_eq!(rc, -1);
        let dump: unsafe extern "C" fn() = ours.lib.get("ncclParamDumpAll");
        // SAFETY: no arguments.
        unsafe { dump() };
        assert!(ours.last_error().contains("ncclParamDumpAll"));
        return;
    }
    let out = child(name, &[]);
    assert!(
        stderr(&out).contains("FLASHCOMM WARN ncclCommShrink is not provided"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn config_collectives_fall_back_to_the_plain_ones_when_config_is_null() {
    let name = "config_collectives_fall_back_to_the_plain_ones_when_config_is_null";
    if is_child(name) {
        let Both { ours, fake } = both();
        let before = fake.int("fake_allreduce_calls");
        assert_eq!(ours.all_reduce_config(4, FLOAT32, 0, 0x10, 0), SUCCESS);
        assert_eq!(fake.int("fake_allreduce_calls"), before + 1);
        let config = [0u8; 64];
        assert_eq!(
            ours.all_reduce_config(4, FLOAT32, 0, 0x10, config.as_ptr() as usize),
            INVALID_USAGE
        );
        assert_eq!(fake.int("fake_allreduce_calls"), before + 1);
        assert!(
            ours.last_error()
                .contains("ncclAllReduceConfig is not provided")
        );
        return;
    }
    child(name, &[]);
}

#[test]
fn handles_configs_and_operators_pass_through_unchanged() {
    let name = "handles_configs_and_operators_pass_through_unchanged";
    if is_child(name) {
        let Both { ours, fake } = both();
        let fake_comm = fake.addr("fake_comm_object") as usize;
        let comm = init_rank(&ours);
        assert_eq!(comm, fake_comm, "the real handle is returned unchanged");

        // The config pointer reaches the real library untouched, whatever the struct holds.
        type InitConfig =
            unsafe extern "C" fn(*mut usize, c_int, UniqueId, c_int, *const u8) -> c_int;
        let init_config: InitConfig = ours.lib.get("ncclCommInitRankConfig");
        let config = [0xa5u8; 200]; // larger than our header's ncclConfig_t
        let mut comm2 = 0usize;
        // SAFETY: valid pointers; the fake only records the config address.
        let rc = unsafe { init_config(&mut comm2, 1, UniqueId([0; 128]), 0, config.as_ptr()) };
        assert_eq!(rc, SUCCESS);
        assert_eq!(fake.ptr("fake_last_config"), config.as_ptr() as usize);

        // PreMulSum handles (>= ncclNumOps) are forwarded as they are.
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 8, comm),
            SUCCESS
        );
        assert_eq!(fake.int("fake_last_op"), 8);
        assert_eq!(fake.ptr("fake_last_comm"), comm);
        let calls = fake.int("fake_allreduce_calls");
        // So is a negative operator: the real library answers it.
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, -3, comm),
            SUCCESS
        );
        assert_eq!(fake.int("fake_allreduce_calls"), calls + 1);
        assert_eq!(fake.int("fake_last_op"), -3);

        // Statistics: per communicator, both names count.
        assert_eq!(
            ours.all_reduce_named("pncclAllReduce", 0x1000, 0x2000, 10, FLOAT32, 0, comm),
            SUCCESS
        );
        let (rc, s) = ours.stats(comm);
        assert_eq!(rc, SUCCESS);
        // The call with the negative operator was forwarded as it is, not counted.
        assert_eq!(s.calls[0][0], 2, "{s:?}");
        assert_eq!(s.bytes[0][0], 4 * 4 + 10 * 4);
        assert_eq!(s.calls[1], [0; 8]);
        let (_, total) = ours.stats(0);
        assert!(total.calls[0][0] >= 2);

        // Destroy: the communicator leaves the registry; totals stay.
        assert_eq!(ours.comm_call("ncclCommDestroy", comm), SUCCESS);
        assert_eq!(ours.stats(comm).0, INVALID_ARGUMENT);
        assert_eq!(ours.stats(0).1.calls[0][0], total.calls[0][0]);
        return;
    }
    child(name, &[]);
}

#[test]
fn the_real_librarys_failures_keep_its_message() {
    let name = "the_real_librarys_failures_keep_its_message";
    if is_child(name) {
        let Both { ours, fake } = both();
        type SendFn = unsafe extern "C" fn(usize, usize, c_int, c_int, usize, usize) -> c_int;
        let send: SendFn = ours.lib.get("ncclSend");
        // Ours first (a communicator flashcomm does not know)...
        assert_eq!(ours.stats(0x40).0, INVALID_ARGUMENT);
        assert!(ours.last_error().contains("is not known to flashcomm"));
        // ...then the real library fails: its own message answers.
        // SAFETY: the fake ignores every argument.
        let rc = unsafe { send(0x1000, 4, FLOAT32, 1, 0x10, 0) };
        assert_eq!(rc, INVALID_USAGE);
        assert_eq!(fake.int("fake_send_calls"), 1);
        assert_eq!(ours.last_error(), "fake: send refused");
        // ...and ours again.
        assert_eq!(ours.stats(0x42).0, INVALID_ARGUMENT);
        assert!(ours.last_error().contains("0x42 is not known to flashcomm"));
        return;
    }
    child(name, &[]);
}

/// flashcomm refuses nothing its kernels do not serve: datatypes and operators a newer real
/// library knows, calls without a communicator and empty calls reach the real library unchanged
/// (the fake takes any of them), and its answer is the answer.
#[test]
fn datatypes_and_operators_past_the_pinned_header_reach_the_real_library() {
    let name = "datatypes_and_operators_past_the_pinned_header_reach_the_real_library";
    if is_child(name) {
        let Both { ours, fake } = both();
        let comm = init_rank(&ours);
        for (dt, op) in [
            (12, 0),
            (13, 0),
            (64, 0),
            (i32::MAX, 0),
            (-1, 0),
            (BF16, 5),
            (BF16, -1),
        ] {
            let calls = fake.int("fake_allreduce_calls");
            assert_eq!(
                ours.all_reduce(0x1000, 0x2000, 4, dt, op, comm),
                SUCCESS,
                "datatype {dt} operator {op}"
            );
            assert_eq!(fake.int("fake_allreduce_calls"), calls + 1);
            assert_eq!(
                (fake.int("fake_last_dt"), fake.int("fake_last_op")),
                (dt, op),
                "unchanged"
            );
        }
        // An empty call and a call without a communicator: the real library's to answer.
        let calls = fake.int("fake_allreduce_calls");
        assert_eq!(ours.all_reduce(0, 0, 0, FLOAT32, 0, comm), SUCCESS);
        assert_eq!(fake.int("fake_last_count"), 0);
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, 12, 0, 0),
            INVALID_ARGUMENT
        );
        assert_eq!(ours.last_error(), "fake: comm argument is NULL");
        assert_eq!(fake.ptr("fake_last_comm"), 0);
        assert_eq!(fake.int("fake_allreduce_calls"), calls + 2);
        // Only the call flashcomm could route (a PreMulSum handle, op 5) is counted, as NCCL's.
        let (_, s) = ours.stats(comm);
        assert_eq!(s.calls[0][0], 1, "{s:?}");
        return;
    }
    child(name, &[]);
}

/// Every error flashcomm returns has a message: when the real library fails a call without
/// one (here the fake's ncclCommFinalize of NULL), `ncclGetLastError` says which call failed,
/// with which code, in the real library; a message of the real library's own is returned as it
/// is.
#[test]
fn a_real_failure_without_a_message_gets_one() {
    let name = "a_real_failure_without_a_message_gets_one";
    if is_child(name) {
        let Both { ours, .. } = both();
        assert_eq!(ours.comm_call("ncclCommFinalize", 0), INVALID_ARGUMENT);
        assert_eq!(
            ours.last_error(),
            "ncclCommFinalize returned ncclInvalidArgument (invalid argument (run with \
             NCCL_DEBUG=WARN for details)) in the real NCCL, which gave no message"
        );
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 0, 0),
            INVALID_ARGUMENT
        );
        assert_eq!(ours.last_error(), "fake: comm argument is NULL");
        return;
    }
    child(name, &[]);
}

#[test]
fn a_panic_becomes_an_internal_error() {
    let name = "a_panic_becomes_an_internal_error";
    if is_child(name) {
        let Both { ours, .. } = both();
        for f in ["ncclCommCount", "pncclCommCount"] {
            let (rc, _) = ours.comm_int(f, 0x10);
            assert_eq!(rc, INTERNAL_ERROR, "{f}");
            let msg = ours.last_error();
            assert!(
                msg.contains("ncclCommCount: internal error in flashcomm"),
                "{msg}"
            );
            assert!(msg.contains("FLASHCOMM_DEBUG_PANIC"), "{msg}");
        }
        // The library keeps working.
        assert_eq!(ours.version(), (SUCCESS, 21903));
        return;
    }
    let out = child(name, &[("FLASHCOMM_DEBUG_PANIC", "ncclCommCount")]);
    let err = stderr(&out);
    assert!(
        err.contains("FLASHCOMM WARN ncclCommCount: internal error in flashcomm"),
        "{err}"
    );
    assert!(
        !err.contains("thread '"),
        "the default panic hook must not print: {err}"
    );
}

/// Every error has a message, a panic of `ncclGetLastError` itself included: before, it returned
/// an empty string (the boundary's default for string functions), so the caller's failure was
/// left without a word. It says that flashcomm failed and where to look, and
/// `ncclGetErrorString`, which did not panic, answers as always.
#[test]
fn a_panic_in_get_last_error_still_gives_a_message() {
    let name = "a_panic_in_get_last_error_still_gives_a_message";
    if is_child(name) {
        let Both { ours, .. } = both();
        assert_eq!(ours.comm_call("ncclCommFinalize", 0), INVALID_ARGUMENT);
        let msg = ours.last_error();
        assert!(
            msg.contains("flashcomm") && msg.contains("internal error"),
            "{msg:?}"
        );
        assert_eq!(ours.error_string(SUCCESS), "no error");
        return;
    }
    let out = child(name, &[("FLASHCOMM_DEBUG_PANIC", "ncclGetLastError")]);
    assert!(
        stderr(&out).contains("FLASHCOMM WARN ncclGetLastError: internal error in flashcomm"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_panic_in_the_creation_hook_leaves_the_communicator_to_nccl() {
    let name = "a_panic_in_the_creation_hook_leaves_the_communicator_to_nccl";
    if is_child(name) {
        let Both { ours, .. } = both();
        // The real init succeeded, so the call succeeds and the communicator is the caller's.
        let comm = init_rank(&ours);
        assert_ne!(comm, 0);
        let (rc, count) = ours.comm_int("ncclCommCount", comm);
        assert_eq!((rc, count), (SUCCESS, 1));
        let destroy: unsafe extern "C" fn(usize) -> c_int = ours.lib.get("ncclCommDestroy");
        // SAFETY: a communicator the (fake) real library created.
        assert_eq!(unsafe { destroy(comm) }, SUCCESS);
        return;
    }
    let out = child(name, &[("FLASHCOMM_DEBUG_PANIC", "flashcommCreationHook")]);
    let err = stderr(&out);
    assert!(
        err.contains("internal error in flashcomm while setting it up")
            && err.contains("it stays with NCCL"),
        "{err}"
    );
}

/// A panic in flashcomm's hook around ncclCommDestroy or ncclCommAbort (a bug) must not skip the
/// real call: the real communicator would leak, or an abort would not end its operations.
#[test]
fn a_panic_in_the_destroy_or_abort_hook_still_runs_the_real_call() {
    let name = "a_panic_in_the_destroy_or_abort_hook_still_runs_the_real_call";
    if is_child(name) {
        let Both { ours, fake } = both();
        let comm = init_rank(&ours);
        let abort = std::env::var("FLASHCOMM_DEBUG_PANIC").unwrap() == "flashcommAbortHook";
        let (call, counter) = if abort {
            ("ncclCommAbort", "fake_abort_calls")
        } else {
            ("ncclCommDestroy", "fake_destroy_calls")
        };
        assert_eq!(
            ours.comm_call(call, comm),
            SUCCESS,
            "the real call's result"
        );
        assert_eq!(fake.int(counter), 1, "the real {call} ran");
        // The communicator is gone for flashcomm too.
        let (rc, _) = ours.stats(comm);
        assert_eq!(rc, INVALID_ARGUMENT);
        return;
    }
    for hook in ["flashcommEndHook", "flashcommAbortHook"] {
        let out = child(name, &[("FLASHCOMM_DEBUG_PANIC", hook)]);
        let err = stderr(&out);
        assert!(
            err.contains(&format!("internal error in flashcomm's {hook}"))
                && err.contains("the real library's call runs all the same"),
            "{err}"
        );
    }
}

#[test]
fn a_panic_in_a_function_without_result_code_returns_its_default() {
    let name = "a_panic_in_a_function_without_result_code_returns_its_default";
    if is_child(name) {
        let Both { ours, .. } = both();
        let world: unsafe extern "C" fn(usize) -> Team = ours.lib.get("ncclTeamWorld");
        // SAFETY: the boundary panics before anything is used.
        let rc = unsafe { world(0x10) };
        assert_eq!(
            rc,
            Team {
                n_ranks: 0,
                rank: 0,
                stride: 0
            }
        );
        let es: unsafe extern "C" fn(c_int) -> *const std::ffi::c_char =
            ours.lib.get("ncclGetErrorString");
        // SAFETY: returns a static string.
        let s = unsafe { std::ffi::CStr::from_ptr(es(0)) };
        assert_eq!(s.to_bytes(), b"no error", "only the named function panics");
        return;
    }
    child(name, &[("FLASHCOMM_DEBUG_PANIC", "pncclTeamWorld")]);
}

/// `flashcommQuantConfig_t` of `include/flashcomm.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct QuantConfig {
    rs_bits: c_int,
    ag_bits: c_int,
    group: c_int,
    spikes: c_int,
    min_bytes: usize,
    max_bytes: usize,
    allgather_bits: c_int,
    reducescatter_bits: c_int,
    alltoall_bits: c_int,
}

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
        reason: [0xff; 256],
    };
    // SAFETY: `info` is a valid out pointer of the header's layout.
    let rc = unsafe { f(comm, &mut info) };
    (rc, info)
}

fn reason(info: &CommInfo) -> String {
    let end = info
        .reason
        .iter()
        .position(|&b| b == 0)
        .expect("NUL-terminated");
    String::from_utf8_lossy(&info.reason[..end]).into_owned()
}

fn set_quant(n: &Nccl, comm: usize, q: Option<&QuantConfig>) -> c_int {
    let f: unsafe extern "C" fn(usize, *const QuantConfig) -> c_int =
        n.lib.get("flashcommCommSetQuant");
    // SAFETY: NULL or a valid pointer of the header's layout.
    unsafe {
        f(
            comm,
            q.map_or(std::ptr::null(), |q| q as *const QuantConfig),
        )
    }
}

fn get_quant(n: &Nccl, comm: usize) -> (c_int, QuantConfig) {
    let f: unsafe extern "C" fn(usize, *mut QuantConfig) -> c_int =
        n.lib.get("flashcommCommGetQuant");
    let mut q = QuantConfig::default();
    // SAFETY: valid out pointer of the header's layout.
    let rc = unsafe { f(comm, &mut q) };
    (rc, q)
}

#[test]
fn a_communicator_flashcomm_cannot_serve_stays_with_nccl() {
    let name = "a_communicator_flashcomm_cannot_serve_stays_with_nccl";
    if is_child(name) {
        let Both { ours, fake } = both();
        let comm = init_rank(&ours);
        // The fake reports rank 0 of 1 on device 0 but has no ncclAllGather for the set-up
        // exchange (and this machine may have no GPU at all): not served, with a reason.
        let (rc, info) = comm_info(&ours, comm);
        assert_eq!(rc, SUCCESS);
        assert_eq!(
            (
                info.served,
                info.rank,
                info.nranks,
                info.device,
                info.arena_bytes
            ),
            (0, 0, 1, 0, 0)
        );
        assert!(!reason(&info).is_empty());
        // Its calls go to NCCL, counted as such.
        let calls = fake.int("fake_allreduce_calls");
        assert_eq!(ours.all_reduce(0x1000, 0x2000, 4, BF16, 0, comm), SUCCESS);
        assert_eq!(fake.int("fake_allreduce_calls"), calls + 1);
        let (_, s) = ours.stats(comm);
        assert_eq!((s.calls[0][0], s.calls[1][0], s.calls[2][0]), (1, 0, 0));
        // The asynchronous error is the real library's (no device error of ours to merge).
        let get: unsafe extern "C" fn(usize, *mut c_int) -> c_int =
            ours.lib.get("ncclCommGetAsyncError");
        let mut state = -1;
        // SAFETY: valid out pointer.
        assert_eq!(unsafe { get(comm, &mut state) }, SUCCESS);
        assert_eq!(state, SUCCESS);
        // Unknown communicators and NULL pointers are invalid arguments.
        assert_eq!(comm_info(&ours, 0x40).0, INVALID_ARGUMENT);
        assert!(ours.last_error().contains("is not known to flashcomm"));
        assert_eq!(comm_info(&ours, 0).0, INVALID_ARGUMENT);
        let f: unsafe extern "C" fn(usize, *mut CommInfo) -> c_int =
            ours.lib.get("flashcommCommGetInfo");
        // SAFETY: NULL is refused before anything is written.
        assert_eq!(unsafe { f(comm, std::ptr::null_mut()) }, INVALID_ARGUMENT);
        assert_eq!(ours.comm_call("ncclCommDestroy", comm), SUCCESS);
        assert_eq!(comm_info(&ours, comm).0, INVALID_ARGUMENT);
        return;
    }
    let out = child(name, &[("NCCL_DEBUG", "INFO")]);
    let err = stderr(&out);
    assert!(err.contains("stays with NCCL"), "{err}");
    assert!(
        err.contains("ncclAllReduce on communicator") && err.contains("route nccl"),
        "the first route is logged: {err}"
    );
}

#[test]
fn flashcomm_disable_builds_nothing() {
    let name = "flashcomm_disable_builds_nothing";
    if is_child(name) {
        let Both { ours, .. } = both();
        let comm = init_rank(&ours);
        let (rc, info) = comm_info(&ours, comm);
        assert_eq!(rc, SUCCESS);
        assert_eq!((info.served, info.rank, info.nranks), (0, 0, 1));
        assert_eq!(reason(&info), "FLASHCOMM_DISABLE is set");
        return;
    }
    child(name, &[("FLASHCOMM_DISABLE", "1")]);
}

#[test]
fn quantization_settings_per_communicator() {
    let name = "quantization_settings_per_communicator";
    if is_child(name) {
        let Both { ours, .. } = both();
        let comm = init_rank(&ours);
        // The environment's settings first (FLASHCOMM_QUANT_BITS=4 in this child).
        let env = QuantConfig {
            rs_bits: 4,
            ag_bits: 4,
            group: 128,
            spikes: 2,
            min_bytes: 0,
            max_bytes: 1 << 30,
            allgather_bits: 4,
            reducescatter_bits: 4,
            alltoall_bits: 4,
        };
        assert_eq!(get_quant(&ours, comm), (SUCCESS, env));
        let own = QuantConfig {
            rs_bits: 2,
            ag_bits: 8,
            group: 64,
            spikes: 0,
            min_bytes: 4096,
            max_bytes: 1 << 20,
            allgather_bits: 8,
            reducescatter_bits: 16,
            alltoall_bits: 3,
        };
        assert_eq!(set_quant(&ours, comm, Some(&own)), SUCCESS);
        assert_eq!(get_quant(&ours, comm), (SUCCESS, own));
        // Lossless is 16 (0 is accepted when setting).
        let lossless = QuantConfig {
            rs_bits: 0,
            ag_bits: 16,
            ..own
        };
        assert_eq!(set_quant(&ours, comm, Some(&lossless)), SUCCESS);
        let (_, got) = get_quant(&ours, comm);
        assert_eq!((got.rs_bits, got.ag_bits), (16, 16));
        // Invalid settings change nothing.
        for bad in [
            QuantConfig { rs_bits: 9, ..own },
            QuantConfig {
                alltoall_bits: 1,
                ..own
            },
            QuantConfig { group: 100, ..own },
            QuantConfig { spikes: 1, ..own },
            QuantConfig {
                min_bytes: 2,
                max_bytes: 1,
                ..own
            },
        ] {
            assert_eq!(
                set_quant(&ours, comm, Some(&bad)),
                INVALID_ARGUMENT,
                "{bad:?}"
            );
            assert!(ours.last_error().contains("flashcommCommSetQuant: invalid"));
            assert_eq!(get_quant(&ours, comm).1.group, 64);
        }
        // NULL: back to the environment's.
        assert_eq!(set_quant(&ours, comm, None), SUCCESS);
        assert_eq!(get_quant(&ours, comm), (SUCCESS, env));
        assert_eq!(set_quant(&ours, 0x40, Some(&own)), INVALID_ARGUMENT);
        assert_eq!(get_quant(&ours, 0x40).0, INVALID_ARGUMENT);
        return;
    }
    child(name, &[("FLASHCOMM_QUANT_BITS", "4")]);
}

#[test]
fn a_simulated_group_end_ends_the_group() {
    let name = "a_simulated_group_end_ends_the_group";
    if is_child(name) {
        let Both { ours, fake } = both();
        let group: unsafe extern "C" fn() -> c_int = ours.lib.get("ncclGroupStart");
        let simulate: unsafe extern "C" fn(usize) -> c_int = ours.lib.get("ncclGroupSimulateEnd");
        for _ in 0..2 {
            // SAFETY: plain calls; the fake ignores the (NULL) simulation info.
            assert_eq!(unsafe { group() }, SUCCESS);
            // SAFETY: as above.
            assert_eq!(unsafe { simulate(0) }, SUCCESS);
        }
        assert_eq!(fake.int("fake_simulate_calls"), 2);
        // The thread is outside any group again: a new communicator is set up at once (not
        // "set-up pending" until a group end that never comes), and its calls are decided
        // outside a group.
        let comm = init_rank(&ours);
        let (rc, info) = comm_info(&ours, comm);
        assert_eq!(rc, SUCCESS);
        assert_eq!(reason(&info), "FLASHCOMM_DISABLE is set");
        let calls = fake.int("fake_allreduce_calls");
        assert_eq!(ours.all_reduce(0x1000, 0x2000, 4, BF16, 0, comm), SUCCESS);
        assert_eq!(fake.int("fake_allreduce_calls"), calls + 1);
        return;
    }
    child(name, &[("FLASHCOMM_DISABLE", "1")]);
}

type SendRecvFn = unsafe extern "C" fn(usize, usize, c_int, c_int, usize, usize) -> c_int;

/// Send/Recv groups reach the real library exactly as the caller wrote them (same calls, same
/// order, one real group), whether flashcomm holds them back (`FLASHCOMM_GROUPED_ALLTOALL=1`:
/// held until the group ends or proves not to be an all-to-all) or not. The fake's communicator
/// is not served (no GPU here), so even the group that forms an all-to-all goes to it: what is
/// checked is that holding and giving back lose, add and reorder nothing.
#[test]
fn send_recv_groups_reach_the_real_library_as_written() {
    let name = "send_recv_groups_reach_the_real_library_as_written";
    if is_child(name) {
        let holding = std::env::var("FLASHCOMM_GROUPED_ALLTOALL").as_deref() == Ok("1");
        let Both { ours, fake } = both();
        fake.set_int("fake_send_ok", 1);
        let start: unsafe extern "C" fn() -> c_int = ours.lib.get("ncclGroupStart");
        let end: unsafe extern "C" fn() -> c_int = ours.lib.get("ncclGroupEnd");
        let send: SendRecvFn = ours.lib.get("ncclSend");
        let recv: SendRecvFn = ours.lib.get("ncclRecv");
        let comm = init_rank(&ours);
        let s = |peer: c_int, buf: usize| {
            // SAFETY: the fake takes any buffer and stream and never touches them.
            unsafe { send(buf, 64, FLOAT32, peer, comm, 0) }
        };
        let r = |peer: c_int, buf: usize| {
            // SAFETY: as above.
            unsafe { recv(buf, 64, FLOAT32, peer, comm, 0) }
        };
        let g = |f: unsafe extern "C" fn() -> c_int| {
            // SAFETY: ncclGroupStart/End take no arguments.
            unsafe { f() }
        };
        let log = || fake.text("fake_log");

        // 1. An all-to-all of one rank: held while the group is open, then given back.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(s(0, 0x1000), SUCCESS);
        assert_eq!(
            log().contains("send"),
            !holding,
            "held iff holding: {}",
            log()
        );
        assert_eq!(r(0, 0x2000), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        // 2. A collective inside the group: what was held goes first.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(r(0, 0x3000), SUCCESS);
        assert_eq!(ours.all_reduce(0x5000, 0x6000, 4, BF16, 0, comm), SUCCESS);
        assert_eq!(s(0, 0x4000), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        // 3. A peer outside the communicator: NCCL's answer, in the caller's order.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(s(0, 0x1000), SUCCESS);
        assert_eq!(s(5, 0x1100), SUCCESS);
        assert_eq!(r(0, 0x2000), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        // 4. Nested groups, and two sends to one peer (not an all-to-all).
        assert_eq!(g(start), SUCCESS);
        assert_eq!(g(start), SUCCESS);
        assert_eq!(s(0, 0x1000), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        assert_eq!(s(0, 0x1100), SUCCESS);
        assert_eq!(r(0, 0x2000), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        let want = "start;send:0:64:7:1000;recv:0:64:7:2000;end;\
                    start;recv:0:64:7:3000;allreduce;send:0:64:7:4000;end;\
                    start;send:0:64:7:1000;send:5:64:7:1100;recv:0:64:7:2000;end;\
                    start;start;send:0:64:7:1000;end;send:0:64:7:1100;recv:0:64:7:2000;end;";
        assert_eq!(log(), want);
        println!("holding {holding}: {}", log());
        return;
    }
    for extra in [&[][..], &[("FLASHCOMM_GROUPED_ALLTOALL", "1")][..]] {
        let out = child(name, extra);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
    }
}

/// A held call that the real library refuses when it finally receives it (here when a collective
/// ends the holding; the fake refuses every send) makes `ncclGroupEnd` fail, as NCCL's group end
/// returns a failed call's error again.
#[test]
fn a_held_call_the_real_library_refuses_fails_the_group_end() {
    let name = "a_held_call_the_real_library_refuses_fails_the_group_end";
    if is_child(name) {
        let Both { ours, fake } = both();
        let start: unsafe extern "C" fn() -> c_int = ours.lib.get("ncclGroupStart");
        let end: unsafe extern "C" fn() -> c_int = ours.lib.get("ncclGroupEnd");
        let send: SendRecvFn = ours.lib.get("ncclSend");
        let comm = init_rank(&ours);
        // SAFETY: plain calls; the fake takes any buffer and stream and never touches them.
        unsafe {
            assert_eq!(start(), SUCCESS);
            assert_eq!(send(0x1000, 64, FLOAT32, 0, comm, 0), SUCCESS, "held");
        }
        assert_eq!(ours.all_reduce(0x5000, 0x6000, 4, BF16, 0, comm), SUCCESS);
        assert_eq!(
            fake.int("fake_send_calls"),
            1,
            "given back before the all-reduce"
        );
        // SAFETY: as above.
        let ended = unsafe { end() };
        assert_eq!(ended, 5, "ncclInvalidUsage from the refused send");
        // The next group starts clean.
        // SAFETY: as above.
        unsafe {
            assert_eq!(start(), SUCCESS);
            assert_eq!(end(), SUCCESS);
        }
        return;
    }
    let out = child(name, &[("FLASHCOMM_GROUPED_ALLTOALL", "1")]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A collective called inside `ncclGroupStart`/`ncclGroupEnd` is routed as one called alone, at
/// the call (docs/abi.md, "The routing seam"): it goes through the router (counted under its
/// route) and, here where the fake's communicator is not served (no GPU), reaches the real
/// library before the group ends, inside the real group. Nothing is deferred to the group's end,
/// with or without `FLASHCOMM_GROUPED_ALLTOALL` (which holds only Send/Recv); a collective
/// flashcomm's kernels take is launched at the same point, and the route itself does not read
/// the group depth (`policy::tests::the_route_is_the_same_under_every_fact_nccl_lets_differ`).
#[test]
fn a_grouped_collective_goes_through_the_router_at_the_call() {
    let name = "a_grouped_collective_goes_through_the_router_at_the_call";
    if is_child(name) {
        let Both { ours, fake } = both();
        let start: GroupFn = ours.lib.get("ncclGroupStart");
        let end: GroupFn = ours.lib.get("ncclGroupEnd");
        let comm = init_rank(&ours);
        let g = |f: GroupFn| {
            // SAFETY: ncclGroupStart/End take no arguments.
            unsafe { f() }
        };
        // Route 0 is NCCL's, collective 0 AllReduce (`include/flashcomm.h`).
        let counted = || ours.stats(comm).1.calls[0][0];
        let log = || fake.text("fake_log");

        // Alone: forwarded and counted.
        let (calls, seen) = (fake.int("fake_allreduce_calls"), counted());
        assert_eq!(ours.all_reduce(0x1000, 0x2000, 4, BF16, 0, comm), SUCCESS);
        assert_eq!(fake.int("fake_allreduce_calls"), calls + 1);
        assert_eq!(counted(), seen + 1);

        // Grouped, at one and two levels: the same, before the group ends.
        for depth in [1, 2] {
            let (calls, seen) = (fake.int("fake_allreduce_calls"), counted());
            for _ in 0..depth {
                assert_eq!(g(start), SUCCESS);
            }
            assert_eq!(ours.all_reduce(0x1000, 0x2000, 4, BF16, 0, comm), SUCCESS);
            assert_eq!(
                fake.int("fake_allreduce_calls"),
                calls + 1,
                "at depth {depth} the call reached the real library at the call: {}",
                log()
            );
            assert_eq!(counted(), seen + 1, "routed and counted at the call");
            let (starts, ends) = ("start;".repeat(depth), "end;".repeat(depth));
            assert!(log().ends_with(&format!("{starts}allreduce;")), "{}", log());
            for _ in 0..depth {
                assert_eq!(g(end), SUCCESS);
            }
            let whole = format!("{starts}allreduce;{ends}");
            assert!(log().ends_with(&whole), "{}", log());
            assert_eq!(fake.int("fake_allreduce_calls"), calls + 1, "and only then");
            assert_eq!(counted(), seen + 1);
        }
        return;
    }
    for extra in [&[][..], &[("FLASHCOMM_GROUPED_ALLTOALL", "1")][..]] {
        let out = child(name, extra);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
    }
}

type GroupFn = unsafe extern "C" fn() -> c_int;

/// A call flashcomm fails itself inside a group (here: a function the real library lacks, or a
/// panic in flashcomm), which the real group never saw, makes the group's result, as NCCL's
/// group end returns a failed call's error: the outermost `ncclGroupEnd` returns its code and
/// message, and the real group fails too, discarding its other calls as NCCL does. A later
/// failure in the real library is the newer one, and wins, as in NCCL.
#[test]
fn a_call_flashcomm_fails_inside_a_group_is_the_groups_result() {
    let name = "a_call_flashcomm_fails_inside_a_group_is_the_groups_result";
    if is_child(name) {
        let Both { ours, fake } = both();
        let start: GroupFn = ours.lib.get("ncclGroupStart");
        let end: GroupFn = ours.lib.get("ncclGroupEnd");
        let comm = init_rank(&ours);
        let g = |f: GroupFn| {
            // SAFETY: ncclGroupStart/End take no arguments.
            unsafe { f() }
        };
        let panicking = std::env::var("FLASHCOMM_DEBUG_PANIC").is_ok();
        // The fake lacks ncclAllGather; FLASHCOMM_DEBUG_PANIC makes ncclBroadcast panic.
        let (culprit, code, words) = if panicking {
            (
                "ncclBroadcast",
                INTERNAL_ERROR,
                "internal error in flashcomm",
            )
        } else {
            (
                "ncclAllGather",
                INVALID_USAGE,
                "ncclAllGather is not provided",
            )
        };
        let a = CollArgs::on(comm);
        for nested in [false, true] {
            let log_before = fake.text("fake_log").len();
            assert_eq!(g(start), SUCCESS);
            if nested {
                assert_eq!(g(start), SUCCESS);
            }
            assert_eq!(
                ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 0, comm),
                SUCCESS
            );
            assert_eq!(call_collective(&ours.lib, culprit, &a), code);
            if nested {
                assert_eq!(g(end), SUCCESS, "an inner end");
            }
            assert_eq!(g(end), code, "the group's result is the failed call's");
            assert!(ours.last_error().contains(words), "{}", ours.last_error());
            let log = fake.text("fake_log");
            assert!(
                log[log_before..].ends_with("end;discarded;"),
                "the real group failed and discarded its calls: {log}"
            );
        }
        // The next group starts clean.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 0, comm),
            SUCCESS
        );
        assert_eq!(g(end), SUCCESS);
        // A failure of the real library after flashcomm's is the newer one: NCCL's group end
        // returns it.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(call_collective(&ours.lib, culprit, &a), code);
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 0, 0),
            INVALID_ARGUMENT
        );
        assert_eq!(g(end), INVALID_ARGUMENT);
        assert_eq!(ours.last_error(), "fake: comm argument is NULL");
        // And the other way round.
        assert_eq!(g(start), SUCCESS);
        assert_eq!(
            ours.all_reduce(0x1000, 0x2000, 4, FLOAT32, 0, 0),
            INVALID_ARGUMENT
        );
        assert_eq!(call_collective(&ours.lib, culprit, &a), code);
        assert_eq!(g(end), code);
        // Outside a group nothing is left over.
        assert_eq!(call_collective(&ours.lib, culprit, &a), code);
        assert_eq!(g(start), SUCCESS);
        assert_eq!(g(end), SUCCESS);
        return;
    }
    child(name, &[]);
    child(name, &[("FLASHCOMM_DEBUG_PANIC", "ncclBroadcast")]);
}
