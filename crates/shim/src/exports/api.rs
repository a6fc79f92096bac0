//! The exports flashcomm inspects before (or instead of) forwarding them: versions, error
//! strings, the last error, every collective, communicator creation and destruction, and group
//! calls. Everything else is a plain forwarder in `forwarders.rs`.
//!
//! Owns: the hand-written `nccl_api!` exports.
//! May import: `exports::boundary`, `exports::collective`, `calls::real`, `args`, `error`,
//! `last_error`, `logging`, `types`, `group`, `dispatch`.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int, c_void};

use flashcomm_nccl_sys::{
    NCCL_SHRINK_ABORT, cudaStream_t, ncclCollConfig_t, ncclComm_t, ncclConfig_t, ncclDataType_t,
    ncclRedOp_t, ncclResult_t, ncclSimInfo_t, ncclUniqueId, ncclWindow_t,
};

use crate::args::Args;
use crate::calls::real::{self, Slot};
use crate::dispatch;
use crate::error::{code_name, error_string};
use crate::exports::boundary::{call_real, nccl_api, unavailable};
use crate::exports::collective::{Extra, collective};
use crate::group;
use crate::grouped;
use crate::last_error::{self, Last};
use crate::logging::{self, Subsys};
use crate::types::{Collective, CommEnd, CommHandle, CommOrigin};

// One slot per real function we call.
static GET_VERSION: Slot = Slot::new(c"ncclGetVersion");
static ALL_REDUCE: Slot = Slot::new(c"ncclAllReduce");
static ALL_REDUCE_CONFIG: Slot = Slot::new(c"ncclAllReduceConfig");
static REDUCE_SCATTER: Slot = Slot::new(c"ncclReduceScatter");
static REDUCE_SCATTER_CONFIG: Slot = Slot::new(c"ncclReduceScatterConfig");
static ALL_GATHER: Slot = Slot::new(c"ncclAllGather");
static ALL_GATHER_CONFIG: Slot = Slot::new(c"ncclAllGatherConfig");
static ALL_TO_ALL: Slot = Slot::new(c"ncclAlltoAll");
static ALL_TO_ALL_CONFIG: Slot = Slot::new(c"ncclAlltoAllConfig");
static BROADCAST: Slot = Slot::new(c"ncclBroadcast");
static BROADCAST_CONFIG: Slot = Slot::new(c"ncclBroadcastConfig");
static BCAST: Slot = Slot::new(c"ncclBcast");
static REDUCE: Slot = Slot::new(c"ncclReduce");
static REDUCE_CONFIG: Slot = Slot::new(c"ncclReduceConfig");
static SEND: Slot = Slot::new(c"ncclSend");
static RECV: Slot = Slot::new(c"ncclRecv");
static INIT_RANK: Slot = Slot::new(c"ncclCommInitRank");
static INIT_RANK_CONFIG: Slot = Slot::new(c"ncclCommInitRankConfig");
static INIT_ALL: Slot = Slot::new(c"ncclCommInitAll");
static INIT_RANK_SCALABLE: Slot = Slot::new(c"ncclCommInitRankScalable");
static SPLIT: Slot = Slot::new(c"ncclCommSplit");
static SHRINK: Slot = Slot::new(c"ncclCommShrink");
static GROW: Slot = Slot::new(c"ncclCommGrow");
static FINALIZE: Slot = Slot::new(c"ncclCommFinalize");
static REVOKE: Slot = Slot::new(c"ncclCommRevoke");
static SUSPEND: Slot = Slot::new(c"ncclCommSuspend");
static RESUME: Slot = Slot::new(c"ncclCommResume");
static DESTROY: Slot = Slot::new(c"ncclCommDestroy");
static ABORT: Slot = Slot::new(c"ncclCommAbort");
static GET_ASYNC_ERROR: Slot = Slot::new(c"ncclCommGetAsyncError");
static REGISTER: Slot = Slot::new(c"ncclCommRegister");
static DEREGISTER: Slot = Slot::new(c"ncclCommDeregister");
static WINDOW_REGISTER: Slot = Slot::new(c"ncclCommWindowRegister");
static WINDOW_DEREGISTER: Slot = Slot::new(c"ncclCommWindowDeregister");
static GROUP_START: Slot = Slot::new(c"ncclGroupStart");
static GROUP_END: Slot = Slot::new(c"ncclGroupEnd");
static GROUP_SIMULATE_END: Slot = Slot::new(c"ncclGroupSimulateEnd");

/// Unwraps a forwarded result, or reports why the call could not be forwarded.
macro_rules! forwarded {
    ($e:expr) => {
        match $e {
            Ok(r) => r,
            Err(e) => return unavailable(e),
        }
    };
}

/// `NCCL_CONFIG_UNDEF_INT`: a field of `ncclConfig_t` the caller left at its default.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// The `blocking` field of the caller's `ncclConfig_t`, if it set one. Only the first four fields
/// (size, magic, version, blocking), present in every version of the struct, are read, and only
/// after the magic and the size say they are there; the struct is never copied.
fn config_blocking(config: *const ncclConfig_t) -> Option<bool> {
    if config.is_null() {
        return None;
    }
    // SAFETY: NCCL's contract: a non-null config points to an ncclConfig_t made with
    // NCCL_CONFIG_INITIALIZER, which starts with `size_t size; unsigned magic; unsigned version;
    // int blocking;` in every NCCL version; `size` and `magic` are read first, through the raw
    // pointer (no reference to the caller's struct is made).
    let (size, magic) = unsafe { ((*config).size, (*config).magic) };
    if magic != flashcomm_nccl_sys::NCCL_API_MAGIC
        || size < std::mem::offset_of!(ncclConfig_t, blocking) + std::mem::size_of::<c_int>()
    {
        return None;
    }
    // SAFETY: the magic and the size say the caller's struct holds this field.
    let blocking = unsafe { (*config).blocking };
    (blocking != CONFIG_UNDEF_INT).then_some(blocking != 0)
}

/// After a creating call: registers the `count` new communicators written to `out` and lets the
/// router set them up.
fn created(
    result: ncclResult_t,
    out: *mut ncclComm_t,
    count: c_int,
    origin: CommOrigin,
    config: *const ncclConfig_t,
) {
    let ok = result == ncclResult_t::ncclSuccess || result == ncclResult_t::ncclInProgress;
    if !ok || out.is_null() {
        return;
    }
    let comms: Vec<ncclComm_t> = (0..usize::try_from(count).unwrap_or(0))
        // SAFETY: NCCL's contract: `out` points to `count` handles (1 except for InitAll), which
        // the real library has just written because it returned success or in-progress.
        .map(|i| unsafe { out.add(i).read() })
        .collect();
    // The real communicator exists now and is the caller's: a panic in flashcomm's hook must
    // not turn the call into a failure (the caller would never destroy it). It is caught here;
    // the communicator then stays with NCCL and the real result is returned.
    let ready = result == ncclResult_t::ncclSuccess;
    let hooked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        dispatch::on_comms_created(&comms, origin, ready, config_blocking(config));
    }));
    if let Err(payload) = hooked {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dispatch::on_creation_hook_panicked(&comms, ready, payload.as_ref());
        }));
    }
}

/// Runs a hook of flashcomm's around a real call that must run whatever the hook does (destroy,
/// abort, finalize, revoke): a panic in the hook is caught and reported here, so that the real
/// call still runs and its result is returned (otherwise the boundary would answer
/// `ncclInternalError` without ever calling it, and the real communicator would leak, or, for an
/// abort, stay stuck).
fn hook<R>(name: &'static str, comm: ncclComm_t, f: impl FnOnce() -> R) -> Option<R> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::init::debug_panic_point(name);
        f()
    })) {
        Ok(r) => Some(r),
        Err(payload) => {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                dispatch::on_end_hook_panicked(name, comm, payload.as_ref());
            }));
            None
        }
    }
}

/// Before an ending call.
fn ending(comm: ncclComm_t, end: CommEnd) {
    hook("flashcommEndHook", comm, || {
        dispatch::on_comm_destroying(comm, end);
    });
}

thread_local! {
    /// Storage of the string `ncclGetLastError` returned last on this thread.
    static RETURNED: RefCell<CString> = RefCell::new(CString::default());
}

nccl_api! {
    /// Reports the version of the real NCCL (frameworks gate features on it).
    fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
        forwarded!(call_real!(GET_VERSION, (version) -> ncclResult_t))
    }

    /// NCCL's wording for each code, from our own table; needs no real library.
    fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
        error_string(result.0).as_ptr()
    }

    /// This thread's last failure if flashcomm detected it, else the process's, else the real
    /// library's message. A failure of the real library that left no message of its own is
    /// described by flashcomm (which function, which code): every error has a message. The
    /// string stays valid until this thread's next call.
    fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
        let ours = |msg: String| RETURNED.with(|r| {
            let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
            let mut r = r.borrow_mut();
            *r = c;
            r.as_ptr()
        });
        match last_error::current() {
            Some(Last::Ours(msg)) => ours(msg),
            Some(Last::Real { api, code }) => match real::real_last_error(comm) {
                // SAFETY: a NUL-terminated string of the real library (non-null).
                Some(p) if unsafe { *p } != 0 => p,
                _ => ours(format!(
                    "{api} returned {} ({}) in the real NCCL, which gave no message",
                    code_name(code),
                    error_string(code).to_string_lossy()
                )),
            },
            None => real::real_last_error(comm).unwrap_or(c"".as_ptr()),
        }
    }

    fn ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAllReduce", kind: Collective::AllReduce, sendbuff, recvbuff, count,
                datatype, op: Some(op), comm },
            Extra { root_or_peer: None, stream, config: std::ptr::null() },
            || call_real!(ALL_REDUCE, (sendbuff, recvbuff, count, datatype, op, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclAllReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAllReduceConfig", kind: Collective::AllReduce, sendbuff, recvbuff,
                count, datatype, op: Some(op), comm },
            Extra { root_or_peer: None, stream, config },
            || match call_real!(ALL_REDUCE_CONFIG,
                (sendbuff, recvbuff, count, datatype, op, comm, stream, config) -> ncclResult_t) {
                // A NULL config means the plain call, which older libraries do have.
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(ALL_REDUCE,
                    (sendbuff, recvbuff, count, datatype, op, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    fn ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclReduceScatter", kind: Collective::ReduceScatter, sendbuff, recvbuff,
                count: recvcount, datatype, op: Some(op), comm },
            Extra { root_or_peer: None, stream, config: std::ptr::null() },
            || call_real!(REDUCE_SCATTER,
                (sendbuff, recvbuff, recvcount, datatype, op, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclReduceScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclReduceScatterConfig", kind: Collective::ReduceScatter, sendbuff,
                recvbuff, count: recvcount, datatype, op: Some(op), comm },
            Extra { root_or_peer: None, stream, config },
            || match call_real!(REDUCE_SCATTER_CONFIG,
                (sendbuff, recvbuff, recvcount, datatype, op, comm, stream, config) -> ncclResult_t) {
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(REDUCE_SCATTER,
                    (sendbuff, recvbuff, recvcount, datatype, op, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    fn ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAllGather", kind: Collective::AllGather, sendbuff, recvbuff,
                count: sendcount, datatype, op: None, comm },
            Extra { root_or_peer: None, stream, config: std::ptr::null() },
            || call_real!(ALL_GATHER,
                (sendbuff, recvbuff, sendcount, datatype, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclAllGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAllGatherConfig", kind: Collective::AllGather, sendbuff, recvbuff,
                count: sendcount, datatype, op: None, comm },
            Extra { root_or_peer: None, stream, config },
            || match call_real!(ALL_GATHER_CONFIG,
                (sendbuff, recvbuff, sendcount, datatype, comm, stream, config) -> ncclResult_t) {
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(ALL_GATHER,
                    (sendbuff, recvbuff, sendcount, datatype, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    fn ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAlltoAll", kind: Collective::AlltoAll, sendbuff, recvbuff, count,
                datatype, op: None, comm },
            Extra { root_or_peer: None, stream, config: std::ptr::null() },
            || call_real!(ALL_TO_ALL,
                (sendbuff, recvbuff, count, datatype, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclAlltoAllConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclAlltoAllConfig", kind: Collective::AlltoAll, sendbuff, recvbuff,
                count, datatype, op: None, comm },
            Extra { root_or_peer: None, stream, config },
            || match call_real!(ALL_TO_ALL_CONFIG,
                (sendbuff, recvbuff, count, datatype, comm, stream, config) -> ncclResult_t) {
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(ALL_TO_ALL,
                    (sendbuff, recvbuff, count, datatype, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    fn ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclBroadcast", kind: Collective::Broadcast, sendbuff, recvbuff, count,
                datatype, op: None, comm },
            Extra { root_or_peer: Some(root), stream, config: std::ptr::null() },
            || call_real!(BROADCAST,
                (sendbuff, recvbuff, count, datatype, root, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclBroadcastConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclBroadcastConfig", kind: Collective::Broadcast, sendbuff, recvbuff,
                count, datatype, op: None, comm },
            Extra { root_or_peer: Some(root), stream, config },
            || match call_real!(BROADCAST_CONFIG,
                (sendbuff, recvbuff, count, datatype, root, comm, stream, config) -> ncclResult_t) {
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(BROADCAST,
                    (sendbuff, recvbuff, count, datatype, root, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    /// In-place broadcast (deprecated in NCCL, still used by PyTorch).
    fn ncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int,
        comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclBcast", kind: Collective::Broadcast, sendbuff: buff.cast_const(),
                recvbuff: buff, count, datatype, op: None, comm },
            Extra { root_or_peer: Some(root), stream, config: std::ptr::null() },
            || call_real!(BCAST, (buff, count, datatype, root, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclReduce", kind: Collective::Reduce, sendbuff, recvbuff, count,
                datatype, op: Some(op), comm },
            Extra { root_or_peer: Some(root), stream, config: std::ptr::null() },
            || call_real!(REDUCE,
                (sendbuff, recvbuff, count, datatype, op, root, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t,
        stream: cudaStream_t, config: *const ncclCollConfig_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclReduceConfig", kind: Collective::Reduce, sendbuff, recvbuff, count,
                datatype, op: Some(op), comm },
            Extra { root_or_peer: Some(root), stream, config },
            || match call_real!(REDUCE_CONFIG,
                (sendbuff, recvbuff, count, datatype, op, root, comm, stream, config) -> ncclResult_t) {
                Err(e) if e.is_missing_function() && config.is_null() => call_real!(REDUCE,
                    (sendbuff, recvbuff, count, datatype, op, root, comm, stream) -> ncclResult_t),
                r => r,
            },
        )
    }

    fn ncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
        comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclSend", kind: Collective::Send, sendbuff,
                recvbuff: std::ptr::null_mut(), count, datatype, op: None, comm },
            Extra { root_or_peer: Some(peer), stream, config: std::ptr::null() },
            || call_real!(SEND, (sendbuff, count, datatype, peer, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
        comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t [state] {
        collective(
            &state.config,
            Args { api: "ncclRecv", kind: Collective::Recv, sendbuff: std::ptr::null(), recvbuff,
                count, datatype, op: None, comm },
            Extra { root_or_peer: Some(peer), stream, config: std::ptr::null() },
            || call_real!(RECV, (recvbuff, count, datatype, peer, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclCommInitRank(newcomm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId,
        rank: c_int,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_RANK, (newcomm, nranks, comm_id, rank) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::InitRank, std::ptr::null());
        r
    }

    /// The caller's config pointer is forwarded untouched (its size and version are the
    /// caller's header's, not ours).
    fn ncclCommInitRankConfig(newcomm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId,
        rank: c_int, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_RANK_CONFIG,
            (newcomm, nranks, comm_id, rank, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::InitRankConfig, config);
        r
    }

    fn ncclCommInitAll(comms: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_ALL, (comms, ndev, devlist) -> ncclResult_t));
        created(r, comms, ndev, CommOrigin::InitAll, std::ptr::null());
        r
    }

    fn ncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int,
        n_id: c_int, comm_ids: *mut ncclUniqueId, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_RANK_SCALABLE,
            (newcomm, nranks, myrank, n_id, comm_ids, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::InitRankScalable, config);
        r
    }

    fn ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t,
        config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(SPLIT, (comm, color, key, newcomm, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Split { parent: CommHandle::of(comm) }, config);
        r
    }

    fn ncclCommShrink(comm: ncclComm_t, exclude_ranks_list: *mut c_int,
        exclude_ranks_count: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t,
        shrink_flags: c_int,
    ) -> ncclResult_t {
        if shrink_flags & NCCL_SHRINK_ABORT as c_int != 0 {
            dispatch::on_comm_shrink_abort(comm);
        }
        let r = forwarded!(call_real!(SHRINK, (comm, exclude_ranks_list, exclude_ranks_count,
            newcomm, config, shrink_flags) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Shrink { parent: CommHandle::of(comm) }, config);
        r
    }

    fn ncclCommGrow(comm: ncclComm_t, n_ranks: c_int, unique_id: *const ncclUniqueId, rank: c_int,
        newcomm: *mut ncclComm_t, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(GROW,
            (comm, n_ranks, unique_id, rank, newcomm, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Grow { parent: CommHandle::of(comm) }, config);
        r
    }

    fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
        ending(comm, CommEnd::Finalize);
        forwarded!(call_real!(FINALIZE, (comm) -> ncclResult_t))
    }

    fn ncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) -> ncclResult_t {
        ending(comm, CommEnd::Revoke);
        forwarded!(call_real!(REVOKE, (comm, revoke_flags) -> ncclResult_t))
    }

    /// flashcomm's operations of the communicator are flushed first, and until a successful
    /// resume every call goes to NCCL, which answers it as on a suspended communicator.
    fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
        let before = dispatch::on_comm_suspend(comm, true);
        let r = call_real!(SUSPEND, (comm, flags) -> ncclResult_t);
        if !matches!(r, Ok(ncclResult_t::ncclSuccess)) {
            dispatch::on_comm_suspend(comm, before);
        }
        forwarded!(r)
    }

    /// After a successful resume flashcomm's kernels take the communicator's calls again.
    fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
        let r = call_real!(RESUME, (comm) -> ncclResult_t);
        if matches!(r, Ok(ncclResult_t::ncclSuccess)) {
            dispatch::on_comm_resumed(comm);
        }
        forwarded!(r)
    }

    fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
        ending(comm, CommEnd::Destroy);
        forwarded!(call_real!(DESTROY, (comm) -> ncclResult_t))
    }

    /// Always returns: flashcomm's kernels are told to leave their waits first, then the real
    /// abort runs (ending any NCCL operation ours may be queued behind), and only then is our
    /// last launch waited for, bounded, before flashcomm's memory is freed.
    fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
        let pending = hook("flashcommAbortHook", comm, || dispatch::on_comm_aborting(comm)).flatten();
        let real = call_real!(ABORT, (comm) -> ncclResult_t);
        if pending.is_some() {
            hook("flashcommAbortedHook", comm, || dispatch::on_comm_aborted(pending));
        }
        forwarded!(real)
    }

    /// The real NCCL registers the buffer; once it has, a communicator flashcomm serves registers
    /// it too (zero-copy for peers of other processes: `dispatch::on_registered`).
    fn ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize,
        handle: *mut *mut c_void) -> ncclResult_t {
        let r = forwarded!(call_real!(REGISTER, (comm, buff, size, handle) -> ncclResult_t));
        if r == ncclResult_t::ncclSuccess && !handle.is_null() {
            // SAFETY: the caller passed a valid out-pointer (NCCL's contract), which the real call
            // just filled.
            let h = unsafe { handle.read() };
            dispatch::on_registered(comm, buff as u64, size as u64, h as usize, false);
        }
        r
    }

    fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
        dispatch::on_deregistering(comm, handle as usize);
        forwarded!(call_real!(DEREGISTER, (comm, handle) -> ncclResult_t))
    }

    /// Collective, like the real one: a communicator flashcomm serves registers the window too and,
    /// outside a group, waits (at most `dispatch::REGISTER_WAIT`) until every peer of another
    /// process that takes part has acknowledged it (`dispatch::on_registered`).
    fn ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize,
        win: *mut ncclWindow_t, win_flags: c_int) -> ncclResult_t {
        let r = forwarded!(call_real!(WINDOW_REGISTER,
            (comm, buff, size, win, win_flags) -> ncclResult_t));
        if r == ncclResult_t::ncclSuccess && !win.is_null() {
            // SAFETY: as for ncclCommRegister's handle (inside a group the real library may fill
            // it only at the group's end: a null window is then not registered with flashcomm).
            let w = unsafe { win.read() };
            dispatch::on_registered(comm, buff as u64, size as u64, w as usize, true);
        }
        r
    }

    fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
        dispatch::on_deregistering(comm, win as usize);
        forwarded!(call_real!(WINDOW_DEREGISTER, (comm, win) -> ncclResult_t))
    }

    /// Inside a group that holds its Send/Recv calls back, a nested start is held with them.
    fn ncclGroupStart() -> ncclResult_t {
        if grouped::hold_group_call(true) {
            group::started();
            return ncclResult_t::ncclSuccess;
        }
        let r = forwarded!(call_real!(GROUP_START, () -> ncclResult_t));
        if r == ncclResult_t::ncclSuccess {
            group::started();
            grouped::group_started(group::depth(), &crate::init::state().config);
        }
        r
    }

    /// The communicators created inside the outermost group are set up after it ended, and its
    /// `flashcommCommSetQuant` calls agreed on (their failure is the group's result). Send/Recv
    /// calls the group held back (`FLASHCOMM_GROUPED_ALLTOALL`) run first, as flashcomm's
    /// AllToAll or given to the real library in their order, inside the real group.
    fn ncclGroupEnd() -> ncclResult_t {
        let depth = group::ending();
        if depth > 0 && grouped::hold_group_call(false) {
            return ncclResult_t::ncclSuccess;
        }
        let held = match depth {
            0 => grouped::group_ending(&crate::init::state().config),
            _ => None,
        };
        let r = forwarded!(call_real!(GROUP_END, () -> ncclResult_t));
        dispatch::group_ended(depth, r);
        // A call of the group that flashcomm failed itself is the group's result (the real
        // group failed too, and discarded its other calls).
        if depth == 0 && let Some((code, msg)) = group::take_failure() {
            last_error::record(&msg);
            return code;
        }
        match held {
            Some(e) if r == ncclResult_t::ncclSuccess => e,
            _ => r,
        }
    }

    /// Ends the group inside NCCL like `ncclGroupEnd` (without running its operations), so the
    /// thread's group depth goes down with it; communicators created inside a simulated group
    /// stay with NCCL (on every rank alike, since every rank makes the same call).
    fn ncclGroupSimulateEnd(sim_info: *mut ncclSimInfo_t) -> ncclResult_t {
        // Held-back Send/Recv calls go to the real library first: it simulates the group as the
        // caller wrote it.
        if group::depth() == 1 {
            let _ = grouped::released(&crate::init::state().config);
        }
        // Only once the real library ran it (a real library without the function ended no
        // group).
        let r = forwarded!(call_real!(GROUP_SIMULATE_END, (sim_info) -> ncclResult_t));
        let depth = group::ending();
        dispatch::group_simulated(depth);
        if depth == 0 && let Some((code, msg)) = group::take_failure() {
            last_error::record(&msg);
            return code;
        }
        r
    }

    /// The real library's asynchronous error; when it has none, a device error of flashcomm's
    /// kernels of this communicator (`ncclRemoteError`). Polled from watchdog threads: no lock
    /// of flashcomm is held across the real call, and the merge is one registry lookup and one
    /// read of host memory.
    fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t {
        let r = forwarded!(call_real!(GET_ASYNC_ERROR, (comm, async_error) -> ncclResult_t));
        if r != ncclResult_t::ncclSuccess || async_error.is_null() {
            return r;
        }
        // SAFETY: the real library returned success, so it wrote the caller's out pointer.
        let real = unsafe { async_error.read() };
        if real != ncclResult_t::ncclSuccess {
            return r;
        }
        if let Some((code, msg, first)) = dispatch::async_error(comm) {
            if first {
                logging::warn(Subsys::Coll, &msg);
            }
            last_error::record(&msg);
            // SAFETY: the caller's out pointer, valid for one ncclResult_t (just written by the
            // real library).
            unsafe { async_error.write(code) };
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(blocking: c_int) -> ncclConfig_t {
        // SAFETY: ncclConfig_t is plain data (integers and pointers); all-zero is a valid value.
        let mut c: ncclConfig_t = unsafe { std::mem::zeroed() };
        c.size = std::mem::size_of::<ncclConfig_t>();
        c.magic = flashcomm_nccl_sys::NCCL_API_MAGIC;
        c.blocking = blocking;
        c
    }

    #[test]
    fn blocking_is_read_only_from_a_valid_config() {
        assert_eq!(config_blocking(std::ptr::null()), None);
        assert_eq!(config_blocking(&config(0)), Some(false));
        assert_eq!(config_blocking(&config(1)), Some(true));
        assert_eq!(config_blocking(&config(CONFIG_UNDEF_INT)), None);
        let mut c = config(0);
        c.magic = 0;
        assert_eq!(config_blocking(&c), None, "no NCCL_CONFIG_INITIALIZER");
        let mut c = config(0);
        c.size = 16;
        assert_eq!(config_blocking(&c), None, "too small to hold `blocking`");
    }
}
