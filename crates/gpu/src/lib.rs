//! The one layer of flashcomm that calls the CUDA driver: whether the driver is present (and
//! already loaded), the primary context of a device, device and host-mapped memory, IPC handles,
//! events, streams and graphs, module loading and kernel launches, and the calling thread's own
//! state as a library inside someone else's process sees it (`caller`: the current device, the
//! current context saved and restored, a stream of our own).
//!
//! Every other crate reaches the driver through this one; it is the only crate whose code calls
//! `cudarc`'s driver bindings, and each `unsafe` block states why it is sound. Calls go through
//! cudarc's `result` layer (typed results, out-parameters handled there); the few calls that
//! layer does not wrap (context push and pop, peer access, legacy IPC, host-memory device
//! pointers, module enumeration, occupancy with a raw function, the kernel launch with a by-value
//! parameter struct) use `sys` and convert their result the same way ([`check`]). Everything here
//! works on raw device addresses (`u64`), which callers never dereference on the host.
//!
//! One file per CUDA object, all re-exported here under the names callers use: `device` (the
//! driver's initialization, devices and their primary contexts), `stream`, `memory` (device,
//! IPC and host-mapped memory, what the driver knows of an address), `event`, `graph` (a
//! stream's capture and the instantiated graph), `module` (modules, functions, launches),
//! `host_arena` (shared host memory), `caller` and `process` (the state a fork child makes
//! afresh, which every crate's process-wide locks and caches use). This file keeps the one CUDA error type,
//! [`Error`], which the other crates wrap.
//!
//! It imports nothing of flashcomm (it is the bottom of the dependency graph with the NCCL
//! bindings and the CPU codec).

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

mod caller;
mod device;
mod event;
mod graph;
mod host_arena;
mod memory;
mod module;
pub mod process;
mod stream;

pub use caller::{OwnStream, SavedContext, current_device, driver_loaded};
pub use device::{CtxGuard, Device, device_count, init, mem_info};
pub use event::Event;
pub use graph::{CaptureRecord, Graph};
pub use host_arena::{HostArena, remove_stale_segments};
pub use memory::{
    DeviceMem, DevicePtr, ExportKind, HostMapped, IpcMapping, PointerKind, UserAllocation, VmmMem,
    buffer_id, close_export, pointer_kind, store_host_word, user_allocation,
};
pub use module::{Function, LaunchConfig, Module, launch, launch_overlapped};
pub use stream::Stream;

/// What can go wrong in a driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// No CUDA driver library could be loaded.
    NoDriver,
    /// A CUDA driver call failed.
    Cuda {
        /// What was being done.
        during: &'static str,
        /// The driver's error name.
        detail: String,
    },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::NoDriver => write!(
                f,
                "the CUDA driver library (libcuda.so.1) could not be loaded"
            ),
            Error::Cuda { during, detail } => write!(f, "CUDA error while {during}: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

/// The error of a driver call that failed while doing `during`.
pub(crate) fn cuda(during: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        during,
        detail: format!("{:?}", e.0),
    }
}

/// Converts the raw result of a call that cudarc's `result` layer does not wrap.
pub(crate) fn check(r: sys::CUresult, during: &'static str) -> Result<(), Error> {
    r.result().map_err(cuda(during))
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    static PRESENT: process::PerProcess<bool> = process::PerProcess::inherited();
    // SAFETY: is_culib_present only tries to dlopen the driver library by its usual names.
    *PRESENT.get(|| unsafe { sys::is_culib_present() })
}
