//! The driver layer (`flashcomm-gpu`) as the communicator uses it, and its launch paths.
//!
//! The only module of the crate with `unsafe` code: the launch below, and the write of a rank's
//! epoch words that tests use to cross the epoch's wrap-around.
#![allow(unsafe_code)]

/// The driver layer's error (the communicator's own [`crate::Error`] converts from it).
pub use flashcomm_gpu::Error;
pub use flashcomm_gpu::{
    CaptureRecord, CtxGuard, Device, DeviceMem, DevicePtr, Event, Function, Graph, HostArena,
    HostMapped, IpcMapping, LaunchConfig, OwnStream, Stream, device_count, driver_present, init,
    mem_info, remove_stale_segments,
};

use flashcomm_kernels::abi::{self, KernelParams};
use flashcomm_kernels::{Kernel, Kernels};

/// Launches catalogue kernel `k` (its parameter type is tied to it, so the layout is right by
/// construction); with `overlapped`, with programmatic stream serialization, which only the
/// collective kernels allow (each waits for the previous work of its stream before its first
/// memory access: transport.cuh, `wait_for_previous_work`).
///
/// Sound because of what the communicator guarantees for every launch it makes through this
/// function: every arena address in `params` belongs to an allocation or mapping the communicator
/// keeps alive until its last launch has finished; user buffers come in as [`DevicePtr`]s, whose
/// creators promised they are valid device memory of the right length; the stream belongs to
/// the current context (the communicator activated its device); `overlapped` is set only for
/// `FcCollParams` kernels, the collective kernels.
pub(crate) fn launch<P: KernelParams + 'static>(
    kernels: &Kernels,
    k: Kernel<P>,
    cfg: LaunchConfig,
    stream: Stream,
    params: &P,
    overlapped: bool,
) -> Result<(), crate::Error> {
    let overlapped =
        overlapped && std::any::TypeId::of::<P>() == std::any::TypeId::of::<abi::FcCollParams>();
    // SAFETY: see the function's documentation: lifetimes and stream are guaranteed by the
    // communicator (the only caller) and by the DevicePtr contract; `overlapped` holds only for
    // the collective kernels (checked above by the parameter type).
    unsafe { kernels.launch(k, cfg, stream, params, overlapped) }.map_err(crate::Error::from)
}

/// Sets all of a rank's epoch words (`abi::MAX_BLOCKS` u32 at `words_addr`, inside the
/// communicator's own arena) to `seq`, and waits for it. For tests only (the epoch's wrap-around);
/// no kernel of the communicator may be running.
pub(crate) fn write_epoch_words(
    dev: &std::sync::Arc<Device>,
    words_addr: u64,
    seq: u32,
) -> Result<(), crate::Error> {
    let bytes: Vec<u8> = (0..abi::MAX_BLOCKS)
        .flat_map(|_| seq.to_le_bytes())
        .collect();
    let tmp = DeviceMem::alloc_zeroed(dev, bytes.len())?;
    let stream = Stream::null();
    tmp.upload(0, &bytes, stream)?;
    // SAFETY: `words_addr` is the epoch area of the calling communicator's own arena
    // (abi::MAX_BLOCKS words, device-accessible: device memory or mapped pinned host memory),
    // which outlives this synchronous copy; `tmp` holds exactly that many bytes.
    let dst = unsafe { DevicePtr::from_raw(words_addr, bytes.len() as u64) };
    let _ctx = dev.activate()?;
    dst.copy_from(tmp.as_ptr(), bytes.len() as u64, stream)?;
    stream.synchronize()?;
    Ok(())
}
