//! flashcomm's own C API (`include/flashcomm.h`, generated from this file by
//! `cargo run -p xtask -- gen-header`). Small on purpose: the version, the routing statistics,
//! and the effective configuration. Every function returns an `ncclResult_t` and runs inside the
//! same panic boundary as the NCCL exports.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int};

use flashcomm_nccl_sys::{ncclComm_t, ncclResult_t};

use crate::error::Error;
use crate::ffi::boundary::guard;
use crate::logging::Subsys;
use crate::route::{self, Collective, Route};

/// flashcomm's version as `major * 10000 + minor * 100 + patch`.
pub const FLASHCOMM_VERSION_CODE: c_int = version_code();

const fn version_code() -> c_int {
    const fn num(s: &str) -> c_int {
        let b = s.as_bytes();
        let mut v = 0;
        let mut i = 0;
        while i < b.len() {
            v = v * 10 + (b[i] - b'0') as c_int;
            i += 1;
        }
        v
    }
    num(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + num(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + num(env!("CARGO_PKG_VERSION_PATCH"))
}

/// Number of routes: the first index of the arrays of `flashcommStats_t`.
pub const FLASHCOMM_NUM_ROUTES: usize = 3;
/// Route index: forwarded to the real NCCL.
pub const FLASHCOMM_ROUTE_NCCL: usize = 0;
/// Route index: flashcomm's lossless kernels.
pub const FLASHCOMM_ROUTE_LOSSLESS: usize = 1;
/// Route index: flashcomm's quantized kernels.
pub const FLASHCOMM_ROUTE_QUANTIZED: usize = 2;

/// Number of collective kinds: the second index of the arrays of `flashcommStats_t`.
pub const FLASHCOMM_NUM_COLLS: usize = 8;
/// Kind index: `ncclAllReduce` (and `ncclAllReduceConfig`).
pub const FLASHCOMM_COLL_ALLREDUCE: usize = 0;
/// Kind index: `ncclReduceScatter`.
pub const FLASHCOMM_COLL_REDUCESCATTER: usize = 1;
/// Kind index: `ncclAllGather`.
pub const FLASHCOMM_COLL_ALLGATHER: usize = 2;
/// Kind index: `ncclAlltoAll`.
pub const FLASHCOMM_COLL_ALLTOALL: usize = 3;
/// Kind index: `ncclBroadcast` and `ncclBcast`.
pub const FLASHCOMM_COLL_BROADCAST: usize = 4;
/// Kind index: `ncclReduce`.
pub const FLASHCOMM_COLL_REDUCE: usize = 5;
/// Kind index: `ncclSend`.
pub const FLASHCOMM_COLL_SEND: usize = 6;
/// Kind index: `ncclRecv`.
pub const FLASHCOMM_COLL_RECV: usize = 7;

const _: () = {
    assert!(FLASHCOMM_NUM_ROUTES == Route::COUNT);
    assert!(FLASHCOMM_NUM_COLLS == Collective::COUNT);
    assert!(FLASHCOMM_ROUTE_NCCL == Route::Nccl as usize);
    assert!(FLASHCOMM_ROUTE_LOSSLESS == Route::Lossless as usize);
    assert!(FLASHCOMM_ROUTE_QUANTIZED == Route::Quantized as usize);
    assert!(FLASHCOMM_COLL_ALLREDUCE == Collective::AllReduce as usize);
    assert!(FLASHCOMM_COLL_REDUCESCATTER == Collective::ReduceScatter as usize);
    assert!(FLASHCOMM_COLL_ALLGATHER == Collective::AllGather as usize);
    assert!(FLASHCOMM_COLL_ALLTOALL == Collective::AlltoAll as usize);
    assert!(FLASHCOMM_COLL_BROADCAST == Collective::Broadcast as usize);
    assert!(FLASHCOMM_COLL_REDUCE == Collective::Reduce as usize);
    assert!(FLASHCOMM_COLL_SEND == Collective::Send as usize);
    assert!(FLASHCOMM_COLL_RECV == Collective::Recv as usize);
};

/// Calls and bytes per route and collective kind, indexed `[FLASHCOMM_ROUTE_*][FLASHCOMM_COLL_*]`.
/// Bytes are `count x element size` as passed to each call (per rank; for all-gather the send
/// count, for reduce-scatter the receive count, for all-to-all the per-peer count). Calls with
/// `count == 0` and calls refused by the argument checks are not counted.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct flashcommStats_t {
    /// Number of calls.
    pub calls: [[u64; FLASHCOMM_NUM_COLLS]; FLASHCOMM_NUM_ROUTES],
    /// Number of bytes.
    pub bytes: [[u64; FLASHCOMM_NUM_COLLS]; FLASHCOMM_NUM_ROUTES],
}

/// Writes flashcomm's own version, `major * 10000 + minor * 100 + patch`, to `*version` (the
/// NCCL version is `ncclGetVersion`'s).
///
/// # Safety
/// `version` is NULL or points to writable memory for one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetVersion(version: *mut c_int) -> ncclResult_t {
    guard("flashcommGetVersion", || {
        if version.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommGetVersion: version is NULL")
                .report();
        }
        // SAFETY: checked non-null; the caller guarantees it points to a writable int.
        unsafe { version.write(FLASHCOMM_VERSION_CODE) };
        ncclResult_t::ncclSuccess
    })
}

/// Writes the statistics of communicator `comm` to `*stats`, or the process totals (every
/// communicator, destroyed ones included) when `comm` is NULL. A communicator flashcomm did not
/// see created, or that was destroyed, is `ncclInvalidArgument`.
///
/// # Safety
/// `stats` is NULL or points to writable memory for one `flashcommStats_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetStats(
    comm: ncclComm_t,
    stats: *mut flashcommStats_t,
) -> ncclResult_t {
    guard("flashcommGetStats", || {
        if stats.is_null() {
            return Error::invalid_argument(Subsys::Call, "flashcommGetStats: stats is NULL")
                .report();
        }
        let snap = if comm.is_null() {
            route::totals()
        } else {
            match route::comm(comm) {
                Some(state) => state.counters.snapshot(),
                None => {
                    return Error::invalid_argument(
                        Subsys::Call,
                        format!(
                            "flashcommGetStats: communicator {comm:p} is not known to flashcomm \
                             (not created through it, or already destroyed)"
                        ),
                    )
                    .report();
                }
            }
        };
        let out = flashcommStats_t {
            calls: snap.calls,
            bytes: snap.bytes,
        };
        // SAFETY: checked non-null; the caller guarantees it points to a writable
        // flashcommStats_t.
        unsafe { stats.write(out) };
        ncclResult_t::ncclSuccess
    })
}

/// Writes the effective configuration as text (`NAME=value` lines, then `passthrough=...`) to
/// `buf`, NUL-terminated, truncated to `len` bytes. Returns `ncclInvalidArgument` when `buf` is
/// NULL or too small (the message of `ncclGetLastError` gives the size needed).
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcommGetConfigString(buf: *mut c_char, len: usize) -> ncclResult_t {
    guard("flashcommGetConfigString", || {
        let text = crate::init::state().config.describe();
        let need = text.len() + 1;
        if buf.is_null() || len == 0 {
            return Error::invalid_argument(
                Subsys::Call,
                format!("flashcommGetConfigString: no buffer; {need} bytes are needed"),
            )
            .report();
        }
        let n = text.len().min(len - 1);
        // SAFETY: `buf` is non-null and the caller guarantees `len` writable bytes; we write
        // `n + 1 <= len` bytes and the source is a distinct Rust string.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            buf.add(n).write(0);
        }
        if n < text.len() {
            return Error::invalid_argument(
                Subsys::Call,
                format!("flashcommGetConfigString: buffer of {len} bytes is too small; {need} are needed"),
            )
            .report();
        }
        ncclResult_t::ncclSuccess
    })
}
