//! The shim's CUDA needs, all through `flashcomm-gpu` (the one crate that calls the driver):
//! the caller's current context saved and restored around communicator set-up and teardown
//! ([`SavedContext`]), the set-up exchange's own stream ([`OwnStream`]), the current device of
//! the log lines ([`current_device`]), and the caller's buffers of a routed collective as
//! [`DevicePtr`]s ([`user_buffers`], the one `unsafe` promise made here), and NCCL's pointer
//! check of those buffers ([`check_pointers`], `NCCL_CHECK_POINTERS=1`).
//!
//! None of these loads the driver: they ask whether the process already loaded it (the real
//! NCCL does before any communicator exists) and otherwise do nothing or fail with a message.
//!
//! Owns: [`user_buffers`], [`user_blocks`], [`check_pointers`].
//! May import: `types`.

pub(crate) use flashcomm_gpu::{OwnStream, SavedContext, current_device, driver_loaded};
use flashcomm_gpu::{PointerKind, pointer_kind};

use flashcomm_comm::DevicePtr;

use crate::types::CollCall;

/// The caller's send and receive buffers of a routed collective, with the sizes NCCL's contract
/// gives them (`Collective::buffer_bytes` of the call's per-rank bytes). `None` when a size
/// overflows.
pub(crate) fn user_buffers(call: &CollCall, nranks: u64) -> Option<(DevicePtr, DevicePtr)> {
    let (send, recv) = call.req.coll.buffer_bytes(call.bytes, nranks)?;
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

/// The caller's blocks of a group of `ncclSend`/`ncclRecv` (at `addrs`, `bytes` each), as device
/// ranges.
pub(crate) fn user_blocks(addrs: &[u64], bytes: u64) -> Vec<DevicePtr> {
    addrs
        .iter()
        // SAFETY: each is the buffer of one of the caller's ncclSend/ncclRecv calls, for which the
        // caller promises NCCL's contract: device memory of at least `bytes` bytes, valid until
        // the operation has completed on the caller's stream, on which flashcomm runs it.
        .map(|&a| unsafe { DevicePtr::from_raw(a, bytes) })
        .collect()
}

/// NCCL's pointer check (`NCCL_CHECK_POINTERS=1`) of a routed call's buffers: each non-empty
/// buffer must be device memory of `device` or managed memory. `Err` names the buffer and what
/// it is, in NCCL's words.
pub(crate) fn check_pointers(
    call: &CollCall,
    send: &DevicePtr,
    recv: &DevicePtr,
    device: i32,
) -> Result<(), String> {
    for (name, p) in [("sendbuff", send), ("recvbuff", recv)] {
        if p.is_empty() {
            continue;
        }
        let what = match pointer_kind(p.addr()) {
            Ok(PointerKind::Device(d)) if d == device => continue,
            Ok(PointerKind::Managed) => continue,
            Ok(PointerKind::Device(d)) => {
                format!(
                    "allocated on device {d} mismatches with the communicator's device {device}"
                )
            }
            Ok(PointerKind::Host) => "is host memory, not a valid device pointer".to_string(),
            Ok(PointerKind::Unknown) => "is not a valid pointer".to_string(),
            Err(e) => format!("could not be checked ({e})"),
        };
        return Err(format!(
            "{} : {name} {:#x} {what} (NCCL_CHECK_POINTERS=1)",
            call.api,
            p.addr()
        ));
    }
    Ok(())
}
