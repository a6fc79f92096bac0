//! The shim's CUDA needs, all through `flashcomm-gpu` (the one crate that calls the driver):
//! the caller's current context saved and restored around communicator set-up and teardown
//! ([`SavedContext`]), the set-up exchange's own stream ([`OwnStream`]), the current device of
//! the log lines ([`current_device`]), and the caller's buffers of a routed collective as
//! [`DevicePtr`]s ([`user_buffers`], the one `unsafe` promise made here).
//!
//! None of these loads the driver: they ask whether the process already loaded it (the real
//! NCCL does before any communicator exists) and otherwise do nothing or fail with a message.
//!
//! Owns: [`user_buffers`].
//! May import: `types`.

pub(crate) use flashcomm_gpu::{OwnStream, SavedContext, current_device};

use flashcomm_comm::DevicePtr;

use crate::types::{CollCall, Collective};

/// The caller's send and receive buffers of a routed collective, with the sizes NCCL's contract
/// gives them: `bytes` is the per-rank message of `call` (count x element size), so an
/// AllReduce uses `bytes` of each, a ReduceScatter reads `nranks x bytes` and writes `bytes`,
/// an AllGather reads `bytes` and writes `nranks x bytes`, an AllToAll (`bytes` per peer) reads
/// and writes `nranks x bytes`. `None` when a size overflows.
pub(crate) fn user_buffers(call: &CollCall, nranks: u64) -> Option<(DevicePtr, DevicePtr)> {
    let b = call.bytes;
    let all = b.checked_mul(nranks)?;
    let (send, recv) = match call.kind {
        Collective::ReduceScatter => (all, b),
        Collective::AllGather => (b, all),
        Collective::AlltoAll => (all, all),
        _ => (b, b),
    };
    // SAFETY: these are the buffers of an NCCL collective call, for which the caller promises
    // NCCL's contract: device memory of at least these sizes, accessible from the communicator's
    // device, valid until the operation has completed on the caller's stream. flashcomm's kernel
    // is launched on that same stream, so it completes before the caller may free them.
    unsafe {
        Some((
            DevicePtr::from_raw(call.sendbuff as u64, send),
            DevicePtr::from_raw(call.recvbuff as u64, recv),
        ))
    }
}
