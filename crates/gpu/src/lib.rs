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
//! It imports nothing of flashcomm (it is the bottom of the dependency graph with the NCCL
//! bindings and the CPU codec).

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

mod caller;
mod host_arena;
mod module;

pub use caller::{OwnStream, SavedContext, current_device, driver_loaded};
pub use host_arena::{HostArena, remove_stale_segments};
pub use module::{Function, LaunchConfig, Module, launch, launch_overlapped};

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
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the driver library by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// A raw stream handle as NCCL callers pass it (`cudaStream_t` and `CUstream` are the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(pub sys::CUstream);

// SAFETY: a stream handle is an opaque token that the driver accepts from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; it is only passed by value to the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// The legacy default stream.
    pub fn null() -> Stream {
        Stream(std::ptr::null_mut())
    }

    /// A new non-blocking stream in the current context (never destroyed: used for tests and
    /// internal work that lives as long as the process).
    pub fn create() -> Result<Stream, Error> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(cuda("creating a stream"))
    }

    /// Whether work is being captured into a graph on this stream.
    pub fn is_capturing(&self) -> Result<bool, Error> {
        // SAFETY: the stream handle came from the caller as a valid stream of the current context
        // (or a special value the driver accepts).
        let st = unsafe { result::stream::is_capturing(self.0) }
            .map_err(cuda("querying stream capture"))?;
        Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`): needs no
    /// creation, so it is there when a stream of our own could not be made.
    pub fn per_thread() -> Stream {
        Stream(2usize as sys::CUstream)
    }

    /// `Ok(true)` when all work queued on the stream has finished.
    pub fn is_idle(&self) -> Result<bool, Error> {
        // SAFETY: a valid stream handle of the current context (or a special value the driver
        // accepts).
        let r = unsafe { sys::cuStreamQuery(self.0) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "querying a stream").map(|()| false),
        }
    }

    /// Blocks until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), Error> {
        // SAFETY: valid stream handle of the current context.
        unsafe { result::stream::synchronize(self.0) }.map_err(cuda("synchronizing a stream"))
    }
}

/// Initializes the driver API (idempotent).
pub fn init() -> Result<(), Error> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    result::init().map_err(cuda("initializing the CUDA driver"))
}

/// Number of CUDA devices.
pub fn device_count() -> Result<i32, Error> {
    init()?;
    result::device::get_count().map_err(cuda("counting devices"))
}

/// Free and total bytes of device memory of the current context's device (`cuMemGetInfo`).
pub fn mem_info() -> Result<(u64, u64), Error> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two valid out-pointers; the caller made a context current.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    check(r, "querying device memory")?;
    Ok((free as u64, total as u64))
}

/// A device and its primary context (the one PyTorch and the CUDA runtime use), retained for
/// the life of the process.
pub struct Device {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    sms: u32,
    uuid: [u8; 16],
    numa: Option<u32>,
    overlap: bool,
}

// SAFETY: CUdevice is an integer and CUcontext an opaque handle that the driver accepts from any
// thread; the primary context is never released (see Device::open).
unsafe impl Send for Device {}
// SAFETY: as above; all methods only pass the handles to the driver.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal` (cached: one `Device` per ordinal per process).
    pub fn open(ordinal: i32) -> Result<Arc<Device>, Error> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
        init()?;
        let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let dev = result::device::get(ordinal).map_err(cuda("getting a device"))?;
        // SAFETY: `dev` is valid. The retain is never released: the primary context must outlive
        // kernels that may still run when a communicator is dropped.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(cuda("retaining the primary context"))?;
        // SAFETY: valid device and attribute.
        let sms = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }
        .map_err(cuda("querying the SM count"))?;
        let uuid = result::device::get_uuid(dev).map_err(cuda("querying the device UUID"))?;
        // Programmatic launches (launch_overlapped) need compute capability 9.0 and a CUDA 12
        // driver (cuLaunchKernelEx).
        // SAFETY: valid device and attribute.
        let major = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }
        .unwrap_or(0);
        let mut driver = 0;
        // SAFETY: a valid out pointer.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) }
            .result()
            .is_ok();
        let overlap = major >= 9 && driver_ok && driver >= 12000;
        let numa = numa_node_of(dev);
        let d = Arc::new(Device {
            ordinal,
            dev,
            ctx,
            sms: sms.max(1) as u32,
            uuid: uuid.bytes.map(|b| b as u8),
            numa,
            overlap,
        });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sms
    }

    /// Whether kernels on this device can be launched with [`launch_overlapped`] (compute
    /// capability 9.0 or later, CUDA 12 driver).
    pub fn supports_overlapped_launch(&self) -> bool {
        self.overlap
    }

    /// The device UUID.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The NUMA node of the host memory nearest to the device (from the PCI device's
    /// `numa_node` in sysfs), `None` where the machine does not say.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa
    }

    /// The primary context handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx
    }

    /// Makes this device's primary context current on the calling thread until the guard drops
    /// (restoring whatever was current before; nothing is pushed when it already is current).
    pub fn activate(&self) -> Result<CtxGuard, Error> {
        let cur = result::ctx::get_current().map_err(cuda("reading the current context"))?;
        if cur == Some(self.ctx) {
            return Ok(CtxGuard { pushed: false });
        }
        // SAFETY: `self.ctx` is a retained primary context.
        let r = unsafe { sys::cuCtxPushCurrent_v2(self.ctx) };
        check(r, "making the context current")?;
        Ok(CtxGuard { pushed: true })
    }

    /// Whether this device can map memory of `other` (always true for itself).
    pub fn can_access_peer(&self, other: &Device) -> Result<bool, Error> {
        if other.dev == self.dev {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: out-pointer; both devices are valid.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut ok, self.dev, other.dev) };
        check(r, "querying peer access")?;
        Ok(ok != 0)
    }

    /// Enables access from this device's context to `other`'s memory (in-process peers).
    pub fn enable_peer_access(&self, other: &Device) -> Result<(), Error> {
        if other.dev == self.dev {
            return Ok(());
        }
        let _g = self.activate()?;
        // SAFETY: both contexts are retained primary contexts; flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(other.ctx, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(r, "enabling peer access")
    }
}

/// The NUMA node sysfs gives for the PCI device of `dev` (`None`: unknown, or a machine of one
/// node, where sysfs says -1).
fn numa_node_of(dev: sys::CUdevice) -> Option<u32> {
    use sys::CUdevice_attribute as A;
    let attr = |a| {
        // SAFETY: valid device and attribute.
        unsafe { result::device::get_attribute(dev, a) }.ok()
    };
    let (domain, bus, device) = (
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
    );
    let path = format!("/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/numa_node");
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// Restores the previously current context on drop.
pub struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly the context this guard pushed.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

/// What the driver knows of an address (NCCL_CHECK_POINTERS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    /// Device memory of this device ordinal.
    Device(i32),
    /// Managed (unified) memory, usable from every device.
    Managed,
    /// Host memory the driver knows (pinned or registered).
    Host,
    /// An address the driver does not know (pageable host memory, freed memory, garbage).
    Unknown,
}

/// The kind of memory at `addr`, as `cudaPointerGetAttributes` tells NCCL when
/// `NCCL_CHECK_POINTERS=1`. Needs the driver loaded; an address it does not know is
/// [`PointerKind::Unknown`], not an error.
pub fn pointer_kind(addr: u64) -> Result<PointerKind, Error> {
    if !driver_loaded() {
        return Err(Error::NoDriver);
    }
    use sys::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_IS_MANAGED,
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    };
    let Some(managed) = pointer_attribute(addr, CU_POINTER_ATTRIBUTE_IS_MANAGED) else {
        return Ok(PointerKind::Unknown);
    };
    if managed != 0 {
        return Ok(PointerKind::Managed);
    }
    match pointer_attribute(addr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
        None => Ok(PointerKind::Unknown),
        Some(t) if t != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => Ok(PointerKind::Host),
        Some(_) => pointer_attribute(addr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
            .map(|d| PointerKind::Device(d as i32))
            .ok_or(Error::Cuda {
                during: "querying a pointer's device",
                detail: "the driver knows the address but not its device".into(),
            }),
    }
}

/// One 4-byte attribute of `addr` (the three `pointer_kind` asks for are an unsigned int, a
/// `CUmemorytype` and an int); `None` when the driver does not know the address.
fn pointer_attribute(addr: u64, attr: sys::CUpointer_attribute) -> Option<u32> {
    let mut v: u32 = 0;
    // SAFETY: a valid out pointer of 4 bytes, the size of each attribute asked for; any address
    // may be asked about.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast(), attr, addr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

/// A device address range that the holder promises is valid device memory for as long as the
/// work it is used for runs. Obtained safely from a [`DeviceMem`] (which owns the memory) or
/// unsafely from a raw address (the NCCL entry points, whose callers make that promise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePtr {
    addr: u64,
    len: u64,
}

impl DevicePtr {
    /// Wraps a raw device address range.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be device memory accessible from the communicator's device,
    /// valid until every kernel that uses it has finished.
    pub unsafe fn from_raw(addr: u64, len: u64) -> DevicePtr {
        DevicePtr { addr, len }
    }

    /// The address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes the range covers.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the first `bytes` bytes of `src` into this range on `stream`
    /// (`cuMemcpyDtoDAsync`: asynchronous, a single copy node under graph capture). The context
    /// of the memory's device must be current.
    pub fn copy_from(&self, src: DevicePtr, bytes: u64, stream: Stream) -> Result<(), Error> {
        assert!(
            bytes <= self.len && bytes <= src.len,
            "device copy out of bounds"
        );
        // SAFETY: both ranges hold at least `bytes` bytes (asserted) of device memory that their
        // creators promised valid until the work on `stream` has finished (DevicePtr's contract).
        unsafe { result::memcpy_dtod_async(self.addr, src.addr, bytes as usize, stream.0) }
            .map_err(cuda("copying device memory"))
    }
}

/// Device memory owned by this process (`cuMemAlloc`, so it can be exported with legacy IPC).
/// Every operation makes the owning device's context current for its duration.
pub struct DeviceMem {
    ptr: u64,
    bytes: usize,
    device: Arc<Device>,
}

impl DeviceMem {
    /// Allocates `bytes` on `device`, zero-filled.
    pub fn alloc_zeroed(device: &Arc<Device>, bytes: usize) -> Result<DeviceMem, Error> {
        let _ctx = device.activate()?;
        // SAFETY: this device's context is current (the guard above).
        let p = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(cuda("allocating device memory"))?;
        let m = DeviceMem {
            ptr: p,
            bytes,
            device: device.clone(),
        };
        // The plain cuMemsetD8 runs on the legacy default stream and may return before it
        // finishes; non-blocking streams (every stream here) are not ordered after it, so a
        // kernel could see the zeroing land after its own writes (a peer's first LL line, a
        // test's input). Clear on a private stream and wait for exactly that work: never for
        // other streams, whose kernels may be waiting for this rank.
        let s = Stream::create()?;
        // SAFETY: `p` points to `bytes` freshly allocated bytes; `s` is a stream of the current
        // context.
        let waited = unsafe { result::memset_d8_async(p, 0, bytes, s.0) }
            .map_err(cuda("clearing device memory"))
            .and_then(|_| s.synchronize());
        // SAFETY: `s` was created above and nothing else refers to it.
        let d = unsafe { result::stream::destroy(s.0) };
        waited?;
        d.map_err(cuda("destroying a stream"))?;
        Ok(m)
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// The whole allocation as a [`DevicePtr`].
    pub fn as_ptr(&self) -> DevicePtr {
        DevicePtr {
            addr: self.ptr,
            len: self.bytes as u64,
        }
    }

    /// `len` bytes at `offset` as a [`DevicePtr`] (any alignment; panics if out of bounds).
    pub fn slice(&self, offset: usize, len: usize) -> DevicePtr {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.bytes),
            "slice out of bounds"
        );
        DevicePtr {
            addr: self.ptr + offset as u64,
            len: len as u64,
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `src` to byte `offset`, ordered on `stream`, and waits for it. Memory operations
    /// of one rank never go through the legacy default stream: with several ranks in one
    /// context (virtual ranks), a default-stream operation would serialize with the other ranks'
    /// kernels, which wait for this rank.
    pub fn upload(&self, offset: usize, src: &[u8], stream: Stream) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        assert!(offset + src.len() <= self.bytes, "upload out of bounds");
        // SAFETY: the destination range lies inside this allocation (asserted); `src` stays valid
        // until the stream synchronization below.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, src, stream.0) }
            .map_err(cuda("copying to the device"))?;
        stream.synchronize()
    }

    /// Copies bytes at `offset` into `dst`, ordered on `stream`, and waits for it.
    pub fn download(&self, offset: usize, dst: &mut [u8], stream: Stream) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        assert!(offset + dst.len() <= self.bytes, "download out of bounds");
        // SAFETY: the source range lies inside this allocation (asserted); `dst` stays valid
        // until the stream synchronization below.
        unsafe { result::memcpy_dtoh_async(dst, self.ptr + offset as u64, stream.0) }
            .map_err(cuda("copying to the host"))?;
        stream.synchronize()
    }

    /// Fills the allocation with `byte`, ordered on `stream` (asynchronous).
    pub fn fill(&self, byte: u8, stream: Stream) -> Result<(), Error> {
        let _ctx = self.device.activate()?;
        // SAFETY: the range is exactly this allocation.
        unsafe { result::memset_d8_async(self.ptr, byte, self.bytes, stream.0) }
            .map_err(cuda("filling device memory"))
    }

    /// The 64-byte legacy IPC handle of this allocation.
    pub fn ipc_handle(&self) -> Result<[u8; 64], Error> {
        let _ctx = self.device.activate()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `self.ptr` is the base of a cuMemAlloc allocation; out-pointer.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) };
        check(r, "exporting an IPC handle")?;
        Ok(h.reserved.map(|b| b as u8))
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let _ctx = self.device.activate();
        // SAFETY: frees the allocation this value owns; callers make sure no kernel still uses
        // it (communicators wait for their last launch before dropping their arena).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A peer's allocation opened through a legacy IPC handle; closed on drop.
pub struct IpcMapping {
    ptr: u64,
}

impl IpcMapping {
    /// Opens `handle` in the current context.
    pub fn open(handle: &[u8; 64]) -> Result<IpcMapping, Error> {
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as _),
        };
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer; the handle bytes came from a peer's cuIpcGetMemHandle (the driver
        // rejects anything else with an error code).
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        check(r, "opening a peer's IPC handle")?;
        Ok(IpcMapping { ptr: p })
    }

    /// The mapped address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: closes the mapping this value opened.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// Pinned host memory mapped into the device address space (abort flag, status words).
pub struct HostMapped {
    host: *mut u8,
    dev: u64,
    bytes: usize,
}

// SAFETY: the allocation is owned by this value; all host accesses are volatile reads/writes of
// plain words, which any thread may do.
unsafe impl Send for HostMapped {}
// SAFETY: as above.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// Allocates `bytes` zeroed bytes (a context must be current).
    pub fn alloc(bytes: usize) -> Result<HostMapped, Error> {
        // SAFETY: portable + device-mapped pinned memory; a context is current.
        let h = unsafe {
            result::malloc_host(
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(cuda("allocating host-mapped memory"))?;
        // SAFETY: `h` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(h as *mut u8, 0, bytes) };
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `h` is a device-mapped pinned allocation; out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, h, 0) };
        check(r, "mapping host memory")?;
        Ok(HostMapped {
            host: h as *mut u8,
            dev: d,
            bytes,
        })
    }

    /// Device address of the allocation.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// Volatile read of the u32 at byte `offset`.
    pub fn read_u32(&self, offset: usize) -> u32 {
        assert!(offset + 4 <= self.bytes && offset.is_multiple_of(4));
        // SAFETY: in bounds and aligned (asserted); the device writes the word concurrently, hence
        // the volatile read of a plain integer.
        unsafe { std::ptr::read_volatile(self.host.add(offset) as *const u32) }
    }

    /// Volatile read of the u64 at byte `offset`.
    pub fn read_u64(&self, offset: usize) -> u64 {
        assert!(offset + 8 <= self.bytes && offset.is_multiple_of(8));
        // SAFETY: in bounds and aligned (asserted); volatile for concurrent device writes.
        unsafe { std::ptr::read_volatile(self.host.add(offset) as *const u64) }
    }

    /// Copies `src` to byte `offset` (volatile stores: the device may read the memory).
    pub fn write_bytes(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= self.bytes),
            "host-mapped write out of bounds"
        );
        for (i, b) in src.iter().enumerate() {
            // SAFETY: in bounds (asserted); a plain byte store, volatile for the device's reads.
            unsafe { std::ptr::write_volatile(self.host.add(offset + i), *b) };
        }
    }

    /// Copies bytes at `offset` into `dst` (volatile loads: the device may have written them).
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= self.bytes),
            "host-mapped read out of bounds"
        );
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: in bounds (asserted); a plain byte load, volatile for the device's writes.
            *d = unsafe { std::ptr::read_volatile(self.host.add(offset + i)) };
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Volatile write of the u32 at byte `offset`.
    pub fn write_u32(&self, offset: usize, v: u32) {
        assert!(offset + 4 <= self.bytes && offset.is_multiple_of(4));
        // SAFETY: in bounds and aligned (asserted); volatile so the device sees the store.
        unsafe { std::ptr::write_volatile(self.host.add(offset) as *mut u32, v) }
    }
}

impl HostMapped {
    /// A value that owns nothing (dropping it frees nothing): what an owner leaves in place of
    /// words it hands on to be freed elsewhere.
    pub fn empty() -> HostMapped {
        HostMapped {
            host: std::ptr::null_mut(),
            dev: 0,
            bytes: 0,
        }
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if self.host.is_null() {
            return;
        }
        // SAFETY: frees the allocation this value owns (kernels that read it have finished).
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}

/// A CUDA event (timing disabled unless asked for).
pub struct Event(sys::CUevent);

// SAFETY: an event handle may be recorded, queried and synchronized from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A value that owns no event (dropping it destroys nothing; it must not be used): what an
    /// owner leaves in place of an event it hands on.
    pub fn empty() -> Event {
        Event(std::ptr::null_mut())
    }

    /// Creates an event in the current context.
    pub fn new(timing: bool) -> Result<Event, Error> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        result::event::create(flags)
            .map(Event)
            .map_err(cuda("creating an event"))
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream of the current context.
        unsafe { result::event::record(self.0, stream.0) }.map_err(cuda("recording an event"))
    }

    /// Records the event on `stream`; in a graph capture, as an event-record node that records
    /// the event at every replay (`CU_EVENT_RECORD_EXTERNAL`), so that work outside the graph can
    /// wait for it.
    pub fn record_external(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream of the current context.
        check(
            unsafe {
                sys::cuEventRecordWithFlags(
                    self.0,
                    stream.0,
                    sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            },
            "recording an event",
        )
    }

    /// Makes `stream` wait for the event; in a graph capture, as an event-wait node that waits at
    /// every replay for the event's last record (`CU_EVENT_WAIT_EXTERNAL`).
    pub fn wait_on_external(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream.
        unsafe {
            result::stream::wait_event(
                stream.0,
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL,
            )
        }
        .map_err(cuda("waiting on an event"))
    }

    /// On a capturing `stream`: an event-record node that records the event at every replay and
    /// depends on the capture's current dependencies, beside the captured chain: the stream's
    /// dependencies are left as they are, so no later captured node waits for the record (the
    /// next captured kernel keeps its direct, programmatic edge to the previous one). Later
    /// captured work joins it with [`CaptureRecord::join`].
    pub fn record_beside(&self, stream: Stream) -> Result<CaptureRecord, Error> {
        let cap = stream.capture()?;
        let mut node: sys::CUgraphNode = std::ptr::null_mut();
        // SAFETY: `cap.graph` is the graph being captured on `stream` (valid until the capture
        // ends); the node is created without dependencies and `node` is a local out-pointer.
        let r = unsafe {
            sys::cuGraphAddEventRecordNode(&mut node, cap.graph, std::ptr::null(), 0, self.0)
        };
        check(r, "adding an event-record node to a capture")?;
        let mut rec = CaptureRecord {
            id: cap.id,
            graph: cap.graph as usize,
            node: node as usize,
            linked: Vec::new(),
        };
        rec.join(stream, &[])?;
        Ok(rec)
    }

    /// Makes `stream` wait for the event.
    pub fn wait_on(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid event and stream.
        unsafe {
            result::stream::wait_event(
                stream.0,
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda("waiting on an event"))
    }

    /// Whether the recorded work has finished.
    pub fn is_done(&self) -> Result<bool, Error> {
        // SAFETY: valid event.
        match unsafe { result::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(cuda("querying an event")(e)),
        }
    }

    /// Milliseconds between `start` and this event (both recorded with timing).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, Error> {
        // SAFETY: both events are valid and completed (callers synchronize first).
        unsafe { result::event::elapsed(start.0, self.0) }.map_err(cuda("reading event time"))
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<(), Error> {
        // SAFETY: valid event.
        unsafe { result::event::synchronize(self.0) }.map_err(cuda("waiting for an event"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: destroys the event this value owns.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A CUDA graph captured from a stream and instantiated.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles may be launched and destroyed from any thread.
unsafe impl Send for Graph {}

/// An event-record node beside a capture's chain ([`Event::record_beside`]), kept as plain
/// integers (graph and node handles) so that a communicator can hold it between calls without
/// owning it; meaningful only while that capture lasts.
#[derive(Debug)]
pub struct CaptureRecord {
    /// The capture's unique id.
    pub id: u64,
    graph: usize,
    node: usize,
    /// The nodes with an edge to the record node.
    linked: Vec<usize>,
}

impl CaptureRecord {
    /// Makes the record node depend also on everything captured on `stream` so far (the
    /// capture's current dependencies), without changing the stream's dependencies. `covered`
    /// are nodes that every current dependency is known to depend on (for example the
    /// dependencies that the last captured kernel was launched after): their edges to the record
    /// node are removed, as the new edges imply them, so that back-to-back captured operations
    /// leave the record node with one incoming edge rather than one per operation.
    pub fn join(&mut self, stream: Stream, covered: &[usize]) -> Result<(), Error> {
        let cap = stream.capture()?;
        if cap.id != self.id || cap.graph as usize != self.graph {
            return Err(Error::Cuda {
                during: "joining a captured node",
                detail: "the stream's capture is another one".into(),
            });
        }
        let to_node = self.node as sys::CUgraphNode;
        let from: Vec<sys::CUgraphNode> = cap
            .deps
            .iter()
            .copied()
            .filter(|d| !self.linked.contains(&(*d as usize)) && *d as usize != self.node)
            .collect();
        if !from.is_empty() {
            let to = vec![to_node; from.len()];
            // SAFETY: `cap.graph` is the graph under capture; `from` are its nodes and `to` names
            // a node of the same graph, as many entries as `from`; default edges.
            let r = unsafe {
                sys::cuGraphAddDependencies(cap.graph, from.as_ptr(), to.as_ptr(), to.len())
            };
            check(r, "adding dependencies to a captured node")?;
            self.linked.extend(from.iter().map(|d| *d as usize));
        }
        let frontier: Vec<usize> = cap.deps.iter().map(|d| *d as usize).collect();
        let stale: Vec<sys::CUgraphNode> = self
            .linked
            .iter()
            .copied()
            .filter(|n| covered.contains(n) && !frontier.contains(n))
            .map(|n| n as sys::CUgraphNode)
            .collect();
        if !stale.is_empty() {
            let to = vec![to_node; stale.len()];
            // SAFETY: as above; every edge named exists (`linked`). Removing edges (not nodes) is
            // allowed while the capture is in progress.
            let r = unsafe {
                sys::cuGraphRemoveDependencies(cap.graph, stale.as_ptr(), to.as_ptr(), to.len())
            };
            check(r, "removing dependencies of a captured node")?;
            self.linked
                .retain(|n| !stale.contains(&(*n as sys::CUgraphNode)));
        }
        Ok(())
    }
}

/// What [`Stream::capture`] reports of a capture in progress.
struct Capture {
    id: u64,
    graph: sys::CUgraph,
    deps: Vec<sys::CUgraphNode>,
}

impl Stream {
    /// The capture in progress on this stream: its unique id, its graph and the nodes the next
    /// captured node will depend on (copied).
    fn capture(&self) -> Result<Capture, Error> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0u64;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let mut deps: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut n = 0usize;
        // SAFETY: valid stream; every out-pointer is a local; the array the driver returns stays
        // valid until the next capture operation on the stream and is copied before it. Edge
        // data is asked for so that the query is never lossy; it is not needed here.
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.0,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        };
        check(r, "reading a capture's state")?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return Err(Error::Cuda {
                during: "reading a capture's state",
                detail: "the stream is not capturing".into(),
            });
        }
        let deps = if deps.is_null() || n == 0 {
            Vec::new()
        } else {
            // SAFETY: the driver returned `n` valid node handles at `deps` (see above).
            unsafe { std::slice::from_raw_parts(deps, n) }.to_vec()
        };
        Ok(Capture { id, graph, deps })
    }

    /// The capture in progress on this stream: its unique id (never reused in a process) and the
    /// nodes the next captured node will depend on, as integers (for [`CaptureRecord::join`]).
    pub fn capture_point(&self) -> Result<(u64, Vec<usize>), Error> {
        self.capture()
            .map(|c| (c.id, c.deps.iter().map(|d| *d as usize).collect()))
    }
}

impl Stream {
    /// Starts capturing the work of this stream (relaxed mode: other threads may keep making
    /// driver calls meanwhile).
    pub fn begin_capture(&self) -> Result<(), Error> {
        // SAFETY: valid stream of the current context.
        unsafe {
            result::stream::begin_capture(
                self.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(cuda("beginning stream capture"))
    }

    /// Ends the capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph, Error> {
        // SAFETY: valid stream that is capturing.
        let graph = unsafe { result::stream::end_capture(self.0) }
            .map_err(cuda("ending stream capture"))?;
        // SAFETY: `graph` was just captured; no flags.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        let exec = match exec {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: destroys the graph captured above, which nothing else refers to.
                let _ = unsafe { result::graph::destroy(graph) };
                return Err(cuda("instantiating a graph")(e));
            }
        };
        let g = Graph { graph, exec };
        // Upload now, not at the first launch: the upload allocates device memory, and with
        // several ranks in one context that waits for the kernels already running, which may be
        // other ranks' replays waiting for this rank (a deadlock until the timeout). Callers meet
        // the other ranks after this returns and before launching.
        // SAFETY: valid instantiated graph and stream of the current context.
        unsafe { result::graph::upload(g.exec, self.0) }.map_err(cuda("uploading a graph"))?;
        self.synchronize()?;
        Ok(g)
    }
}

impl Graph {
    /// Launches the whole graph on `stream`.
    pub fn launch(&self, stream: Stream) -> Result<(), Error> {
        // SAFETY: valid instantiated graph and stream.
        unsafe { result::graph::launch(self.exec, stream.0) }.map_err(cuda("launching a graph"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: destroys the handles this value owns.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
