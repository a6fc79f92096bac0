//! Memory: what the driver knows of an address, device address ranges, device memory owned by
//! this process, peers' allocations opened through IPC handles, and host memory mapped into the
//! device's address space.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::{Device, Error, Stream, check, cuda, driver_loaded};

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

/// One 8-byte attribute of `addr` (the buffer id, an unsigned long long; the host pointer, a
/// void pointer); `None` when the driver does not know the address or has no such attribute of it.
fn pointer_attribute_u64(addr: u64, attr: sys::CUpointer_attribute) -> Option<u64> {
    let mut v: u64 = 0;
    // SAFETY: a valid out pointer of 8 bytes, the size of each attribute asked for; any address
    // may be asked about.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u64).cast(), attr, addr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

/// Stores `value` into the 4-byte word at device address `addr` with a CPU store, when the
/// word is host memory mapped into this process (pinned or registered: the driver knows its host
/// address, `CU_POINTER_ATTRIBUTE_HOST_POINTER`); returns whether it was. Such a store reaches
/// the GPU without any stream: no operation queued on the device, a stream wait among them, can
/// hold it back. Device memory (`false`, nothing written) needs a stream.
///
/// # Safety
/// `addr` is 4-byte aligned and, if it is host memory, stays mapped until this returns; every
/// other access to the word is a volatile or atomic one (the GPU's, or other processes').
pub unsafe fn store_host_word(addr: u64, value: u32) -> bool {
    if !driver_loaded() || !addr.is_multiple_of(4) {
        return false;
    }
    let host = match pointer_attribute_u64(
        addr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
    ) {
        Some(h) if h != 0 => h,
        _ => return false,
    };
    // SAFETY: the driver maps the word at `host` in this process (4-byte aligned: the device
    // address is, and the mapping is page-aligned on both sides), mapped until this returns (the
    // caller's promise); every access to it is atomic or volatile.
    unsafe { std::sync::atomic::AtomicU32::from_ptr(host as *mut u32) }
        .store(value, std::sync::atomic::Ordering::SeqCst);
    true
}

/// How a user allocation travels to peers of other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportKind {
    /// A legacy IPC handle (`cuIpcGetMemHandle`: memory of `cuMemAlloc` / `cudaMalloc`).
    Legacy,
    /// A POSIX file descriptor of the allocation (the virtual memory API's `cuMemCreate` with
    /// that handle type requested, as `ncclMemAlloc` makes it), which a peer takes from this
    /// process with `pidfd_getfd` ([`IpcMapping::open_fd`]).
    Fd,
}

/// What a peer of another process needs to map the allocation that holds a user buffer: the
/// allocation's base and length, its handle, and the driver's id of the allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserAllocation {
    /// Base address of the allocation holding the buffer.
    pub base: u64,
    /// Bytes of that allocation.
    pub len: u64,
    /// How it is exported.
    pub kind: ExportKind,
    /// Legacy: the IPC handle. Fd: this process's id, the descriptor, the length, the buffer id
    /// and the identity descriptor (little-endian u32, i32, u64, u64, i32), unique to the
    /// allocation like a legacy handle.
    pub handle: [u8; 64],
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique to the allocation for the life of the process,
    /// so a buffer freed and allocated again at the same address is told apart.
    pub buffer_id: u64,
    /// Fd: the descriptor this process keeps open while peers may take it (closed with
    /// [`close_export`]); -1 otherwise.
    pub fd: i32,
}

/// Closes the descriptor of an [`ExportKind::Fd`] export (peers that mapped it keep their
/// mappings).
pub fn close_export(a: &UserAllocation) {
    if a.kind == ExportKind::Fd && a.fd >= 0 {
        // SAFETY: closes the descriptor `user_allocation` opened for this export, once.
        unsafe { libc::close(a.fd) };
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed: the driver calls it makes (mapping
/// memory) may then run while some stream captures a graph without invalidating that capture.
fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: an in/out pointer to a valid mode; changes this thread's mode only.
    let ok = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let out = f();
    if ok == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: restores the mode exchanged above.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

/// The allocation holding the device buffer at `addr`, exported for peers of other processes:
/// with a legacy IPC handle (memory of `cuMemAlloc` / `cudaMalloc`), else as a POSIX file
/// descriptor (the virtual memory API's allocations made shareable that way, such as
/// `ncclMemAlloc`'s), which names this process's identity descriptor ([`identity_fd`], holding
/// `token`) so that an importer can tell this process from another of the same id in another PID
/// namespace; anything else is an error, never a wrong handle. The context of the buffer's device
/// must be current.
pub fn user_allocation(addr: u64, token: u64) -> Result<UserAllocation, Error> {
    if !driver_loaded() {
        return Err(Error::NoDriver);
    }
    let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: two out-pointers; any address may be asked about (unknown ones give an error).
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr) };
    check(r, "finding the allocation of a registered buffer")?;
    let buffer_id = buffer_id(addr).ok_or(Error::Cuda {
        during: "finding the allocation of a registered buffer",
        detail: "the driver gives no buffer id".into(),
    })?;
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `base` is the base of a live allocation (just asked); out-pointer.
    let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(UserAllocation {
            base,
            len: len as u64,
            kind: ExportKind::Legacy,
            handle: h.reserved.map(|b| b as u8),
            buffer_id,
            fd: -1,
        });
    }
    let legacy = check(r, "exporting a registered buffer's IPC handle");
    let mut g: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: out-pointer; `base` is mapped (asked above); memory not of the virtual memory API
    // gives an error.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut g, base as *mut c_void) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // Neither kind of export: the legacy export's error says why.
        legacy?;
        return check(r, "exporting a registered buffer").map(|()| unreachable!());
    }
    let mut fd: i32 = -1;
    // SAFETY: out-pointer of the descriptor's size; `g` was just retained (and is released next:
    // the export does not need it retained).
    let r = unsafe {
        let r = sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            g,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        );
        let _ = sys::cuMemRelease(g);
        r
    };
    check(r, "exporting a registered buffer as a file descriptor")?;
    let ident = match identity_fd(token) {
        Ok(i) => i,
        Err(e) => {
            // SAFETY: closes the descriptor just exported, which nothing else holds.
            unsafe { libc::close(fd) };
            return Err(e);
        }
    };
    let mut handle = [0u8; 64];
    handle[0..4].copy_from_slice(&std::process::id().to_le_bytes());
    handle[4..8].copy_from_slice(&fd.to_le_bytes());
    handle[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    handle[16..24].copy_from_slice(&buffer_id.to_le_bytes());
    handle[24..28].copy_from_slice(&ident.to_le_bytes());
    Ok(UserAllocation {
        base,
        len: len as u64,
        kind: ExportKind::Fd,
        handle,
        buffer_id,
        fd,
    })
}

/// This process's identity descriptor: an anonymous file holding `token` (8 bytes), made once
/// per process and token (again in a fork child, whose token differs). A peer that takes a
/// descriptor from this process by its process id first takes this one through the same pidfd
/// and reads `token` back ([`IpcMapping::open_fd`]): a process id means something only in its
/// own PID namespace, and in another namespace the same number may name another process, even
/// the importer itself, whose descriptors would map the wrong memory without an error.
fn identity_fd(token: u64) -> Result<i32, Error> {
    static IDENT: crate::process::PerProcess<std::sync::Mutex<Option<(u64, i32)>>> =
        crate::process::PerProcess::fresh_in_children();
    let mut id = IDENT
        .get(|| std::sync::Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((t, fd)) = *id {
        if t == token {
            return Ok(fd);
        }
        // A fork child's copy of its parent's descriptor: the child proves its own token.
        // SAFETY: closes this process's copy of the descriptor made below, once.
        unsafe { libc::close(fd) };
        *id = None;
    }
    let os = |during: &'static str| Error::Cuda {
        during,
        detail: std::io::Error::last_os_error().to_string(),
    };
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let fd = unsafe { libc::memfd_create(c"flashcomm-identity".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(os("making the identity descriptor (memfd_create)"));
    }
    let b = token.to_le_bytes();
    // SAFETY: writes the 8 bytes of `b` into the descriptor just made.
    let n = unsafe { libc::pwrite(fd, b.as_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let e = os("writing the identity descriptor");
        // SAFETY: closes the descriptor made above.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    *id = Some((token, fd));
    Ok(fd)
}

/// Whether the process behind `pidfd` holds `token` in its identity descriptor `ident`
/// ([`identity_fd`]).
fn proves_identity(pidfd: i32, ident: i32, token: u64) -> bool {
    // SAFETY: plain system call on integers; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, ident, 0) } as i32;
    if fd < 0 {
        return false;
    }
    let mut b = [0u8; 8];
    // SAFETY: reads at most 8 bytes into `b`; `fd` is ours and closed right after.
    let n = unsafe { libc::pread(fd, b.as_mut_ptr().cast(), b.len(), 0) };
    // SAFETY: closes the descriptor taken above.
    unsafe { libc::close(fd) };
    n == b.len() as isize && u64::from_le_bytes(b) == token
}

/// The driver's id of the allocation holding `addr` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`), `None`
/// for an address it does not know.
pub fn buffer_id(addr: u64) -> Option<u64> {
    pointer_attribute_u64(
        addr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    )
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
    /// An empty range: promises nothing, so it is safe to make (a call with it moves nothing).
    pub fn empty() -> DevicePtr {
        DevicePtr { addr: 0, len: 0 }
    }

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

    /// `len` bytes of this range from `offset` (inside it, which the range's promise covers).
    pub fn part(&self, offset: u64, len: u64) -> DevicePtr {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "part out of bounds"
        );
        DevicePtr {
            addr: self.addr + offset,
            len,
        }
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

/// A peer's allocation opened through a legacy IPC handle, or imported from its file descriptor
/// and mapped (`vmm`: the mapped bytes); closed or unmapped on drop.
pub struct IpcMapping {
    ptr: u64,
    vmm: Option<usize>,
}

impl IpcMapping {
    /// Opens `handle` in the current context.
    pub fn open(handle: &[u8; 64]) -> Result<IpcMapping, Error> {
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as _),
        };
        let mut p: sys::CUdeviceptr = 0;
        // Relaxed for this call: a registered buffer may be opened while some stream captures a
        // graph (in global mode, the opening would otherwise invalidate that capture).
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: an in/out pointer to a valid mode; changes this thread's mode only.
        let relaxed = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        // SAFETY: out-pointer; the handle bytes came from a peer's cuIpcGetMemHandle (the driver
        // rejects anything else with an error code).
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        if relaxed == sys::CUresult::CUDA_SUCCESS {
            // SAFETY: restores the mode exchanged above.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
        check(r, "opening a peer's IPC handle")?;
        Ok(IpcMapping { ptr: p, vmm: None })
    }

    /// Maps, in the current context, an allocation that process `pid` exported as a file
    /// descriptor (what [`user_allocation`] puts in an [`ExportKind::Fd`] handle): the
    /// descriptor is taken from that process (`pidfd_getfd`, which needs the right to trace it:
    /// the same user, and a ptrace policy that allows it), imported, and mapped read-write for
    /// this context's device. The process behind `pid` must first prove that it is the owner,
    /// whose identity token is `owner` (its identity descriptor, taken through the same pidfd,
    /// holds it): otherwise an error, never another process's memory.
    pub fn open_fd(handle: &[u8; 64], owner: u64) -> Result<IpcMapping, Error> {
        let pid = u32::from_le_bytes(handle[0..4].try_into().expect("4 bytes"));
        let fd = i32::from_le_bytes(handle[4..8].try_into().expect("4 bytes"));
        let size = u64::from_le_bytes(handle[8..16].try_into().expect("8 bytes")) as usize;
        let ident = i32::from_le_bytes(handle[24..28].try_into().expect("4 bytes"));
        let os = |during: &'static str| Error::Cuda {
            during,
            detail: std::io::Error::last_os_error().to_string(),
        };
        // SAFETY: plain system calls on integers; their results are checked.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
        if pidfd < 0 {
            return Err(os("opening a peer process (pidfd_open)"));
        }
        if !proves_identity(pidfd, ident, owner) {
            // SAFETY: closes the descriptor opened above.
            unsafe { libc::close(pidfd) };
            return Err(Error::Cuda {
                during: "authenticating a peer process",
                detail: format!(
                    "process {pid} as this process sees it is not the buffer's owner (another \
                     PID namespace?)"
                ),
            });
        }
        // SAFETY: as above; `pidfd` is ours and closed right after.
        let local = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as i32;
        // SAFETY: closes the descriptor opened above.
        unsafe { libc::close(pidfd) };
        if local < 0 {
            return Err(os("taking a peer's allocation descriptor (pidfd_getfd)"));
        }
        relaxed(|| {
            let mut g: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: out-pointer; the descriptor is passed by value as the driver expects, and
            // closed right after (the imported handle does not need it).
            let r = unsafe {
                let r = sys::cuMemImportFromShareableHandle(
                    &mut g,
                    local as usize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                );
                libc::close(local);
                r
            };
            check(r, "importing a peer's allocation")?;
            let mut dev: sys::CUdevice = 0;
            // SAFETY: out-pointer.
            let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
            let r = if r == sys::CUresult::CUDA_SUCCESS {
                map_handle(g, size, dev)
            } else {
                // SAFETY: releases the handle imported above.
                let _ = unsafe { sys::cuMemRelease(g) };
                Err(r)
            };
            let va = r.or_else(|r| check(r, "mapping a peer's allocation").map(|()| 0))?;
            Ok(IpcMapping {
                ptr: va,
                vmm: Some(size),
            })
        })
    }

    /// The mapped address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        match self.vmm {
            // SAFETY: closes the mapping this value opened.
            None => unsafe {
                let _ = sys::cuIpcCloseMemHandle(self.ptr);
            },
            // SAFETY: unmaps and frees the reservation this value made.
            Some(size) => unsafe {
                let _ = sys::cuMemUnmap(self.ptr, size);
                let _ = sys::cuMemAddressFree(self.ptr, size);
            },
        }
    }
}

/// Maps allocation handle `g` of `size` bytes at a reservation of its own, read-write for device
/// `dev`, and releases the handle (the mapping holds the memory): the mapped address, or the
/// driver's error with every step undone.
fn map_handle(
    g: sys::CUmemGenericAllocationHandle,
    size: usize,
    dev: sys::CUdevice,
) -> Result<u64, sys::CUresult> {
    let ok = sys::CUresult::CUDA_SUCCESS;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer; a fresh reservation of `size` bytes.
    let mut r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
    if r == ok {
        // SAFETY: maps the whole handle at the reservation just made; undone on failure.
        r = unsafe { sys::cuMemMap(va, size, 0, g, 0) };
        if r != ok {
            // SAFETY: frees the reservation made above.
            let _ = unsafe { sys::cuMemAddressFree(va, size) };
        }
    }
    // SAFETY: the caller's handle, released once (mapped, the mapping holds the memory).
    let _ = unsafe { sys::cuMemRelease(g) };
    if r != ok {
        return Err(r);
    }
    let desc = sys::CUmemAccessDesc_st {
        location: sys::CUmemLocation_st {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is exactly the mapping made above; one valid descriptor.
    r = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) };
    if r != ok {
        // SAFETY: undoes the mapping and the reservation made above.
        unsafe {
            let _ = sys::cuMemUnmap(va, size);
            let _ = sys::cuMemAddressFree(va, size);
        }
        return Err(r);
    }
    Ok(va)
}

/// Device memory of the virtual memory API, shareable as a POSIX file descriptor (what
/// `ncclMemAlloc` allocates when the driver supports it): physical memory of the current
/// context's device, mapped read-write at a reservation of its own. Freed on drop.
pub struct VmmMem {
    ptr: u64,
    size: usize,
}

impl VmmMem {
    /// At least `bytes` (rounded up to the allocation granularity), zero-filled through `stream`
    /// (synchronized), on the current context's device.
    pub fn alloc(bytes: usize, stream: Stream) -> Result<VmmMem, Error> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer.
        let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
        check(r, "reading the context's device")?;
        // SAFETY: all-zero is a valid (default) value of this plain C struct.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = sys::CUmemLocation_st {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        };
        let mut gran = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: out-pointer and a valid property struct.
        let r = unsafe { sys::cuMemGetAllocationGranularity(&mut gran, &prop, minimum) };
        check(r, "reading the allocation granularity")?;
        let size = bytes.max(1).next_multiple_of(gran.max(1));
        let mut g: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer and a valid property struct.
        let r = unsafe { sys::cuMemCreate(&mut g, size, &prop, 0) };
        check(r, "creating physical memory")?;
        let va = map_handle(g, size, dev)
            .or_else(|r| check(r, "mapping physical memory").map(|()| 0))?;
        let m = VmmMem { ptr: va, size };
        // SAFETY: the range is exactly this mapping.
        unsafe { result::memset_d8_async(m.ptr, 0, m.size, stream.0) }
            .map_err(cuda("clearing memory"))?;
        stream.synchronize()?;
        Ok(m)
    }

    /// The mapping as a device range.
    pub fn as_ptr(&self) -> DevicePtr {
        DevicePtr {
            addr: self.ptr,
            len: self.size as u64,
        }
    }

    /// The mapped address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for VmmMem {
    fn drop(&mut self) {
        // SAFETY: unmaps and frees what `alloc` mapped and reserved (callers make sure no kernel
        // still uses it).
        unsafe {
            let _ = sys::cuMemUnmap(self.ptr, self.size);
            let _ = sys::cuMemAddressFree(self.ptr, self.size);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// This test process's token (one for every test: the identity descriptor is per process).
    const TOKEN: u64 = 0x1234_5678_9abc_def0;

    fn pidfd_of_self() -> i32 {
        // SAFETY: plain system call on integers.
        let p = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) } as i32;
        assert!(p >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        p
    }

    #[test]
    fn only_the_owner_proves_its_identity() {
        let ident = identity_fd(TOKEN).unwrap();
        assert_eq!(identity_fd(TOKEN).unwrap(), ident);
        let p = pidfd_of_self();
        assert!(proves_identity(p, ident, TOKEN));
        assert!(!proves_identity(p, ident, TOKEN + 1));
        assert!(!proves_identity(p, 100_000, TOKEN));
        // SAFETY: closes the pidfd opened above.
        unsafe { libc::close(p) };
    }

    /// The case of two containers whose ranks are both pid 1: the handle's pid names the
    /// importer itself, whose identity descriptor holds its own token, not the owner's.
    #[test]
    fn an_import_from_a_process_that_is_not_the_owner_is_refused() {
        let ident = identity_fd(TOKEN).unwrap();
        let mut h = [0u8; 64];
        h[0..4].copy_from_slice(&std::process::id().to_le_bytes());
        h[4..8].copy_from_slice(&ident.to_le_bytes());
        h[8..16].copy_from_slice(&(2u64 << 20).to_le_bytes());
        h[24..28].copy_from_slice(&ident.to_le_bytes());
        let err = IpcMapping::open_fd(&h, 0x5eed_0f0a_e1e1)
            .err()
            .expect("refused");
        assert!(err.to_string().contains("not the buffer's owner"), "{err}");
    }
}
