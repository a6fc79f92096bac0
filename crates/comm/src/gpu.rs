//! The driver layer (`flashcomm-gpu`) as the communicator uses it, and its launch paths.
//!
//! The only module of the crate with `unsafe` code: the launch below.
#![allow(unsafe_code)]

/// The driver layer's error (the communicator's own [`crate::Error`] converts from it).
pub use flashcomm_gpu::Error;
pub use flashcomm_gpu::{
    CtxGuard, Device, DeviceMem, DevicePtr, Event, Function, Graph, HostArena, HostMapped,
    IpcMapping, LaunchConfig, OwnStream, Stream, device_count, driver_present, init, mem_info,
};

use flashcomm_kernels::abi::{self, KernelParams};
use flashcomm_kernels::{Kernel, Kernels};

/// Launches catalogue kernel `k` (its parameter type is tied to it, so the layout is right by
/// construction).
///
/// Sound because of what the communicator guarantees for every launch it makes through this
/// function: every arena address in `params` belongs to an allocation or mapping the communicator
/// keeps alive until its last launch has finished; user buffers come in as [`DevicePtr`]s, whose
/// creators promised they are valid device memory of the right length; the stream belongs to
/// the current context (the communicator activated its device).
pub(crate) fn launch<P: KernelParams>(
    kernels: &Kernels,
    k: Kernel<P>,
    cfg: LaunchConfig,
    stream: Stream,
    params: &P,
) -> Result<(), crate::Error> {
    // SAFETY: see the function's documentation: lifetimes and stream are guaranteed by the
    // communicator (the only caller) and by the DevicePtr contract.
    unsafe { kernels.launch(k, cfg, stream, params) }.map_err(crate::Error::from)
}

/// [`launch`] with programmatic stream serialization, for the collective kernels (each waits for
/// the previous work of its stream before its first memory access; see
/// [`Kernels::launch_overlapped`]). Sound for the reasons [`launch`] gives.
pub(crate) fn launch_overlapped(
    kernels: &Kernels,
    k: Kernel<abi::FcCollParams>,
    cfg: LaunchConfig,
    stream: Stream,
    params: &abi::FcCollParams,
) -> Result<(), crate::Error> {
    // SAFETY: as in `launch`; `k` is a collective kernel (typed FcCollParams), and every
    // collective kernel waits for the previous work first (transport.cuh, begin()).
    unsafe { kernels.launch_overlapped(k, cfg, stream, params) }.map_err(crate::Error::from)
}
