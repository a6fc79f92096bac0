//! "flashcomm is on": the engagement line at the first communicator and the summary at exit,
//! against the fake real NCCL (tests/fake/fake_nccl.c), whose communicators flashcomm cannot
//! serve (it has no ncclAllGather for the set-up exchange, and this machine may have no GPU).
//! Each scenario runs in a child process; the exit summary is written when the child exits.

mod common;

use std::ffi::c_int;

use common::*;

const INT32: c_int = 2;
const BF16: c_int = 9;
const SUM: c_int = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

fn ours() -> Nccl {
    let n = Nccl::open(&cdylib());
    assert_eq!(n.version(), (SUCCESS, 21903), "{}", n.last_error());
    n
}

fn init_rank(n: &Nccl) -> usize {
    let f: unsafe extern "C" fn(*mut usize, c_int, UniqueId, c_int) -> c_int =
        n.lib.get("ncclCommInitRank");
    let mut comm = 0usize;
    // SAFETY: valid out pointer; the id is passed by value as the header declares.
    assert_eq!(unsafe { f(&mut comm, 1, UniqueId([0; 128]), 0) }, SUCCESS);
    comm
}

/// Runs child `name` against the fake with `extra` variables; its standard error.
fn child(name: &str, extra: &[(&str, &str)]) -> String {
    let fake = fake_lib();
    let mut env = vec![("FLASHCOMM_NCCL_LIB", fake.to_str().unwrap())];
    env.extend_from_slice(extra);
    stderr(&run_child(name, &env, &[]))
}

fn lines_with<'a>(err: &'a str, part: &str) -> Vec<&'a str> {
    err.lines().filter(|l| l.contains(part)).collect()
}

/// Two communicators, then one all-reduce that flashcomm could have served (bf16 sum) and one
/// it could not (int32), both forwarded.
#[test]
fn one_engagement_line_and_a_summary_when_quantization_is_asked_for() {
    let name = "one_engagement_line_and_a_summary_when_quantization_is_asked_for";
    if is_child(name) {
        let n = ours();
        let comm = init_rank(&n);
        init_rank(&n);
        assert_eq!(n.all_reduce(0x1000, 0x2000, 4, BF16, SUM, comm), SUCCESS);
        assert_eq!(n.all_reduce(0x1000, 0x2000, 4, INT32, SUM, comm), SUCCESS);
        return;
    }
    // No NCCL_DEBUG: shown because a width is set.
    let err = child(name, &[("FLASHCOMM_QUANT_BITS", "4")]);
    let on = lines_with(&err, " is on: ");
    assert_eq!(on.len(), 1, "one line per process: {err}");
    let fake = fake_lib();
    for part in [
        "FLASHCOMM INFO flashcomm 0.1.0 (NCCL API 2.32.3) is on: ",
        &format!(
            "real NCCL 2.19.3 at {} (found via FLASHCOMM_NCCL_LIB)",
            fake.display()
        ),
        "not served by flashcomm's kernels: ",
        "takes allreduce,reducescatter,allgather,alltoall of [0, 1G] bytes per rank",
        "quantizes allreduce of bf16,f16 (rs 4 bits, ag 4 bits, allgather 4 bits, reducescatter 4 \
         bits, alltoall 4 bits, group 128, spikes 2",
        "allreduce where the calibrated cost model predicts it faster",
    ] {
        assert!(on[0].contains(part), "{part}: {}", on[0]);
    }
    let summary = lines_with(&err, "flashcomm summary");
    assert_eq!(summary.len(), 1, "{err}");
    for part in [
        "FLASHCOMM WARN flashcomm summary: calls per route: nccl 2 (allreduce 2), lossless 0, \
         quantized 0; ",
        "1 call(s) went to NCCL that flashcomm's kernels could have taken (communicator not \
         served 1)",
        "none of the calls took flashcomm's kernels",
    ] {
        assert!(summary[0].contains(part), "{part}: {}", summary[0]);
    }

    // NCCL_DEBUG=NONE silences everything but the engagement line a width asks for.
    let err = child(
        name,
        &[("FLASHCOMM_QUANT_BITS", "4"), ("NCCL_DEBUG", "NONE")],
    );
    assert_eq!(lines_with(&err, " is on: ").len(), 1, "{err}");
    assert!(lines_with(&err, "summary").is_empty(), "{err}");
}

#[test]
fn silent_by_default_unless_a_servable_call_went_to_nccl() {
    let name = "silent_by_default_unless_a_servable_call_went_to_nccl";
    if is_child(name) {
        let n = ours();
        let comm = init_rank(&n);
        // Not servable by flashcomm's kernels: an int32 all-reduce.
        assert_eq!(n.all_reduce(0x1000, 0x2000, 4, INT32, SUM, comm), SUCCESS);
        if std::env::var("ENGAGE_TEST_SERVABLE").is_ok() {
            assert_eq!(n.all_reduce(0x1000, 0x2000, 4, BF16, SUM, comm), SUCCESS);
        }
        return;
    }
    let err = child(name, &[]);
    assert!(!err.contains("FLASHCOMM"), "nothing to say: {err}");
    // A servable call that went to NCCL is a warning at exit, even without NCCL_DEBUG.
    let err = child(name, &[("ENGAGE_TEST_SERVABLE", "1")]);
    assert!(lines_with(&err, " is on: ").is_empty(), "{err}");
    let summary = lines_with(&err, "FLASHCOMM WARN flashcomm summary:");
    assert_eq!(summary.len(), 1, "{err}");
    assert!(
        summary[0].contains("nccl 2 (allreduce 2)") && summary[0].contains("not served 1"),
        "{}",
        summary[0]
    );
    // NCCL_DEBUG=VERSION shows the engagement line (besides the version banner).
    let err = child(name, &[("NCCL_DEBUG", "VERSION")]);
    assert!(
        err.contains("FLASHCOMM INFO flashcomm 0.1.0 (NCCL API 2.32.3) forwarding to NCCL 2.19.3")
    );
    let on = lines_with(&err, " is on: ");
    assert_eq!(on.len(), 1, "{err}");
    assert!(on[0].contains("quantization off (lossless)"), "{}", on[0]);
    assert!(lines_with(&err, "summary").is_empty(), "{err}");
}

#[test]
fn calls_kept_from_the_kernels_on_purpose_are_not_reported() {
    let name = "calls_kept_from_the_kernels_on_purpose_are_not_reported";
    if is_child(name) {
        let n = ours();
        let comm = init_rank(&n);
        assert_eq!(n.all_reduce(0x1000, 0x2000, 4, BF16, SUM, comm), SUCCESS);
        return;
    }
    for (var, value, says) in [
        (
            "FLASHCOMM_DISABLE",
            "1",
            "takes nothing: FLASHCOMM_DISABLE is set",
        ),
        ("FLASHCOMM_OPS", "allgather", "takes allgather of"),
    ] {
        let err = child(name, &[(var, value), ("NCCL_DEBUG", "VERSION")]);
        let on = lines_with(&err, " is on: ");
        assert_eq!(on.len(), 1, "{err}");
        assert!(on[0].contains(says), "{says}: {}", on[0]);
        assert!(lines_with(&err, "summary").is_empty(), "{var}: {err}");
    }
    // A bad value forces pass-through: that is reported.
    let err = child(name, &[("FLASHCOMM_PROTO", "fast")]);
    let summary = lines_with(&err, "FLASHCOMM WARN flashcomm summary:");
    assert_eq!(summary.len(), 1, "{err}");
    assert!(
        summary[0].contains("invalid configuration 1"),
        "{}",
        summary[0]
    );
}
