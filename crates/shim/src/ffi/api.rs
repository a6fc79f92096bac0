//! The exports flashcomm inspects before (or instead of) forwarding them: versions, error
//! strings, the last error, every collective, communicator creation and destruction, and group
//! calls. Everything else is a plain forwarder in `forwarders.rs`.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int, c_void};

use flashcomm_nccl_sys::{
    cudaStream_t, ncclCollConfig_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t,
    ncclResult_t, ncclUniqueId,
};

use super::boundary::{call_real, nccl_api, unavailable};
use super::real::{self, Slot};
use super::sys::forked;
use crate::args::Args;
use crate::coll::{Extra, collective};
use crate::error::error_string;
use crate::last_error::{self, Last};
use crate::route::{self, Collective, CommEnd, CommHandle, CommOrigin};

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
static DESTROY: Slot = Slot::new(c"ncclCommDestroy");
static ABORT: Slot = Slot::new(c"ncclCommAbort");
static GROUP_START: Slot = Slot::new(c"ncclGroupStart");
static GROUP_END: Slot = Slot::new(c"ncclGroupEnd");

/// Unwraps a forwarded result, or reports why the call could not be forwarded.
macro_rules! forwarded {
    ($e:expr) => {
        match $e {
            Ok(r) => r,
            Err(e) => return unavailable(e),
        }
    };
}

/// After a creating call: registers the `count` new communicators written to `out`.
fn created(result: ncclResult_t, out: *mut ncclComm_t, count: c_int, origin: CommOrigin) {
    let ok = result == ncclResult_t::ncclSuccess || result == ncclResult_t::ncclInProgress;
    if forked() || !ok || out.is_null() {
        return;
    }
    for i in 0..usize::try_from(count).unwrap_or(0) {
        // SAFETY: NCCL's contract: `out` points to `count` handles (1 except for InitAll), which
        // the real library has just written because it returned success or in-progress.
        let comm = unsafe { out.add(i).read() };
        route::on_comm_created(comm, origin, result == ncclResult_t::ncclSuccess);
    }
}

/// Before an ending call.
fn ending(comm: ncclComm_t, end: CommEnd) {
    if !forked() {
        route::on_comm_destroying(comm, end);
    }
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
    /// library's message. The string stays valid until this thread's next call.
    fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
        let ours = if forked() { None } else { last_error::current() };
        match ours {
            Some(Last::Ours(msg)) => RETURNED.with(|r| {
                let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
                let mut r = r.borrow_mut();
                *r = c;
                r.as_ptr()
            }),
            Some(Last::Real) | None => real::real_last_error(comm).unwrap_or(c"".as_ptr()),
        }
    }

    fn ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t {
        collective(
            Args { api: "ncclAllReduce", kind: Collective::AllReduce, sendbuff, recvbuff, count,
                datatype, op: Some(op), comm },
            Extra { root_or_peer: None, stream, config: std::ptr::null() },
            || call_real!(ALL_REDUCE, (sendbuff, recvbuff, count, datatype, op, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclAllReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
        config: *const ncclCollConfig_t,
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
            Args { api: "ncclBcast", kind: Collective::Broadcast, sendbuff: buff.cast_const(),
                recvbuff: buff, count, datatype, op: None, comm },
            Extra { root_or_peer: Some(root), stream, config: std::ptr::null() },
            || call_real!(BCAST, (buff, count, datatype, root, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
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
    ) -> ncclResult_t {
        collective(
            Args { api: "ncclSend", kind: Collective::Send, sendbuff,
                recvbuff: std::ptr::null_mut(), count, datatype, op: None, comm },
            Extra { root_or_peer: Some(peer), stream, config: std::ptr::null() },
            || call_real!(SEND, (sendbuff, count, datatype, peer, comm, stream) -> ncclResult_t),
        )
    }

    fn ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
        comm: ncclComm_t, stream: cudaStream_t,
    ) -> ncclResult_t {
        collective(
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
        created(r, newcomm, 1, CommOrigin::InitRank);
        r
    }

    /// The caller's config pointer is forwarded untouched (its size and version are the
    /// caller's header's, not ours).
    fn ncclCommInitRankConfig(newcomm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId,
        rank: c_int, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_RANK_CONFIG,
            (newcomm, nranks, comm_id, rank, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::InitRankConfig);
        r
    }

    fn ncclCommInitAll(comms: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_ALL, (comms, ndev, devlist) -> ncclResult_t));
        created(r, comms, ndev, CommOrigin::InitAll);
        r
    }

    fn ncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int,
        n_id: c_int, comm_ids: *mut ncclUniqueId, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(INIT_RANK_SCALABLE,
            (newcomm, nranks, myrank, n_id, comm_ids, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::InitRankScalable);
        r
    }

    fn ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t,
        config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(SPLIT, (comm, color, key, newcomm, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Split { parent: CommHandle::of(comm) });
        r
    }

    fn ncclCommShrink(comm: ncclComm_t, exclude_ranks_list: *mut c_int,
        exclude_ranks_count: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t,
        shrink_flags: c_int,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(SHRINK, (comm, exclude_ranks_list, exclude_ranks_count,
            newcomm, config, shrink_flags) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Shrink { parent: CommHandle::of(comm) });
        r
    }

    fn ncclCommGrow(comm: ncclComm_t, n_ranks: c_int, unique_id: *const ncclUniqueId, rank: c_int,
        newcomm: *mut ncclComm_t, config: *mut ncclConfig_t,
    ) -> ncclResult_t {
        let r = forwarded!(call_real!(GROW,
            (comm, n_ranks, unique_id, rank, newcomm, config) -> ncclResult_t));
        created(r, newcomm, 1, CommOrigin::Grow { parent: CommHandle::of(comm) });
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

    fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
        ending(comm, CommEnd::Destroy);
        forwarded!(call_real!(DESTROY, (comm) -> ncclResult_t))
    }

    fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
        ending(comm, CommEnd::Abort);
        forwarded!(call_real!(ABORT, (comm) -> ncclResult_t))
    }

    fn ncclGroupStart() -> ncclResult_t {
        let r = forwarded!(call_real!(GROUP_START, () -> ncclResult_t));
        if r == ncclResult_t::ncclSuccess && !forked() {
            route::group_started();
        }
        r
    }

    fn ncclGroupEnd() -> ncclResult_t {
        if !forked() {
            route::group_ending();
        }
        forwarded!(call_real!(GROUP_END, () -> ncclResult_t))
    }
}
