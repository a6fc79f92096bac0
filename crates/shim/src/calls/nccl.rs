//! Calls flashcomm makes to the real NCCL on its own behalf (not forwarding a caller's call as
//! it is made): the identity of a new communicator, the all-gather of the set-up exchange, the
//! communicator's asynchronous error, and the `ncclSend`/`ncclRecv` calls a group held back
//! (given to the real library later, unchanged). They never record a last error; failures come
//! back as messages or result codes for the caller.
//!
//! Owns: [`Identity`], [`identity`], [`all_gather_bytes`], [`async_error`], [`send_recv`],
//! [`group_call`], [`fail_real_group`].
//! May import: `calls::real`, `error`.

use std::ffi::{c_int, c_void};

use flashcomm_nccl_sys::{ncclComm_t, ncclDataType_t, ncclResult_t};

use crate::calls::real::Slot;
use crate::error::error_string;

static USER_RANK: Slot = Slot::new(c"ncclCommUserRank");
static COUNT: Slot = Slot::new(c"ncclCommCount");
static CU_DEVICE: Slot = Slot::new(c"ncclCommCuDevice");
static ALL_GATHER: Slot = Slot::new(c"ncclAllGather");
static ASYNC_ERROR: Slot = Slot::new(c"ncclCommGetAsyncError");
static SEND: Slot = Slot::new(c"ncclSend");
static RECV: Slot = Slot::new(c"ncclRecv");
static GROUP_START: Slot = Slot::new(c"ncclGroupStart");
static GROUP_END: Slot = Slot::new(c"ncclGroupEnd");
static GROUP_FAILER: Slot = Slot::new(c"ncclAllReduce");

type CommIntFn = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> ncclResult_t;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    *mut c_void,
) -> ncclResult_t;
/// `ncclSend(const void*, ...)` and `ncclRecv(void*, ...)`: the same ABI (the buffer is a
/// pointer either way).
type SendRecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    *mut c_void,
) -> ncclResult_t;
type AsyncErrorFn = unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;

fn describe(api: &str, r: ncclResult_t) -> String {
    format!(
        "{api} returned {} ({})",
        r.0,
        error_string(r.0).to_string_lossy()
    )
}

fn comm_int(slot: &Slot, comm: ncclComm_t) -> Result<i32, String> {
    let p = slot.get().map_err(|e| e.message().to_string())?;
    // SAFETY: `p` is the real library's function of the slot's name; ncclCommUserRank,
    // ncclCommCount and ncclCommCuDevice are all declared `ncclResult_t f(ncclComm_t, int*)`.
    let f = unsafe { std::mem::transmute::<*mut c_void, CommIntFn>(p) };
    let mut v: c_int = -1;
    // SAFETY: `comm` is a communicator the real library has just created (it returned success);
    // `v` is a valid out pointer.
    let r = unsafe { f(comm, &mut v) };
    if r != ncclResult_t::ncclSuccess {
        return Err(describe(slot.name(), r));
    }
    Ok(v)
}

/// What the real library says about a communicator it has created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    /// This rank.
    pub(crate) rank: i32,
    /// Number of ranks.
    pub(crate) nranks: i32,
    /// CUDA device ordinal.
    pub(crate) device: i32,
}

/// Rank, size and device of `comm`, from the real library.
pub(crate) fn identity(comm: ncclComm_t) -> Result<Identity, String> {
    Ok(Identity {
        rank: comm_int(&USER_RANK, comm)?,
        nranks: comm_int(&COUNT, comm)?,
        device: comm_int(&CU_DEVICE, comm)?,
    })
}

/// The real `ncclAllGather` of `bytes` bytes (`ncclUint8`) per rank from device address `send`
/// to `recv` on `stream`. `Ok(r)`: what it returned.
///
/// The caller owns both allocations (at least `bytes` and `bytes x nranks` bytes on the
/// communicator's device) and keeps them until the stream has finished the operation.
pub(crate) fn all_gather_bytes(
    send: u64,
    recv: u64,
    bytes: usize,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> Result<ncclResult_t, String> {
    let p = ALL_GATHER.get().map_err(|e| e.message().to_string())?;
    // SAFETY: `p` is the real ncclAllGather, declared `ncclResult_t ncclAllGather(const void*,
    // void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t)`; cudaStream_t is a pointer.
    let f = unsafe { std::mem::transmute::<*mut c_void, AllGatherFn>(p) };
    // SAFETY: the buffers are device allocations of flashcomm with the sizes NCCL needs (see
    // the function's contract), `comm` is a ready blocking communicator of the real library and
    // `stream` a stream of its device's context.
    let r = unsafe {
        f(
            send as *const c_void,
            recv as *mut c_void,
            bytes,
            ncclDataType_t::ncclUint8,
            comm,
            stream,
        )
    };
    Ok(r)
}

/// The real `ncclCommGetAsyncError` of `comm`.
pub(crate) fn async_error(comm: ncclComm_t) -> Result<ncclResult_t, String> {
    let p = ASYNC_ERROR.get().map_err(|e| e.message().to_string())?;
    // SAFETY: `p` is the real ncclCommGetAsyncError, declared
    // `ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t*)`.
    let f = unsafe { std::mem::transmute::<*mut c_void, AsyncErrorFn>(p) };
    let mut state = ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator of the real library; `state` is a valid out pointer.
    let r = unsafe { f(comm, &mut state) };
    if r != ncclResult_t::ncclSuccess {
        return Err(describe("ncclCommGetAsyncError", r));
    }
    Ok(state)
}

/// The real `ncclSend` (`send` true) or `ncclRecv` with the caller's arguments, unchanged: a call
/// the caller made inside a group, held back by flashcomm and now given to the real library
/// (still inside the real group). `Err`: the real library lacks the function.
pub(crate) fn send_recv(
    send: bool,
    buf: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> Result<ncclResult_t, String> {
    let p = if send { &SEND } else { &RECV }
        .get()
        .map_err(|e| e.message().to_string())?;
    // SAFETY: `p` is the real ncclSend or ncclRecv, declared `ncclResult_t f(const void* or
    // void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)`; both pointers have one ABI.
    let f = unsafe { std::mem::transmute::<*mut c_void, SendRecvFn>(p) };
    // SAFETY: the arguments are the caller's, passed on unchanged, as the caller made the call.
    Ok(unsafe { f(buf, count, datatype, peer, comm, stream) })
}

/// The real `ncclGroupStart` (`start` true) or `ncclGroupEnd`: a nested group call the caller
/// made while flashcomm held the group's calls back, given to the real library in its place.
pub(crate) fn group_call(start: bool) -> Result<ncclResult_t, String> {
    let p = if start { &GROUP_START } else { &GROUP_END }
        .get()
        .map_err(|e| e.message().to_string())?;
    // SAFETY: `p` is the real ncclGroupStart or ncclGroupEnd, declared `ncclResult_t f(void)`.
    let f =
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> ncclResult_t>(p) };
    // SAFETY: no arguments; the caller made this call.
    Ok(unsafe { f() })
}

/// Makes the real library's current group fail the way it fails after a call it refuses: the
/// real `ncclAllReduce` without a communicator (count 0), which NCCL refuses and records as the
/// group's error (`ncclGroupErrCheck`), so that its group end discards the group's other calls
/// and returns an error. For a call flashcomm failed itself inside a group, which the real group
/// never saw. Does nothing when the real library cannot be reached.
pub(crate) fn fail_real_group() {
    let Ok(p) = GROUP_FAILER.get() else {
        return;
    };
    // SAFETY: `p` is the real ncclAllReduce, declared `ncclResult_t ncclAllReduce(const void*,
    // void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)`; ncclRedOp_t is a
    // C enum, passed as an int.
    let f = unsafe {
        std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(
                *const c_void,
                *mut c_void,
                usize,
                ncclDataType_t,
                c_int,
                ncclComm_t,
                *mut c_void,
            ) -> ncclResult_t,
        >(p)
    };
    // SAFETY: NULL buffers with count 0 and a NULL communicator: NCCL checks the communicator
    // first and touches nothing else.
    let _ = unsafe {
        f(
            std::ptr::null(),
            std::ptr::null_mut(),
            0,
            ncclDataType_t::ncclInt8,
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
}
