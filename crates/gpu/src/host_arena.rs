//! Pinned host memory mapped into the GPU, large enough to hold a communicator's arena: the host
//! transport's memory. Within one process it is one `cuMemHostAlloc` (portable, device-mapped:
//! every context of the process reaches it at the same address). Between processes it is a POSIX
//! shared-memory segment that every rank maps and registers with `cuMemHostRegister` (portable,
//! device-mapped), named by its creator and opened by the others through the set-up exchange.

use std::ffi::{CString, c_void};

use cudarc::driver::{result, sys};

use crate::{Error, check, cuda};

/// `MPOL_PREFERRED` of `<linux/mempolicy.h>`.
const MPOL_PREFERRED: i32 = 1;

/// Where the memory came from, and what dropping it undoes.
enum Backing {
    /// `cuMemHostAlloc`.
    Alloc,
    /// A mapped shared-memory segment, registered with the driver. `owner`: this process created
    /// the name (and removes it, if [`HostArena::unlink`] did not already).
    Shared { name: CString, owner: bool },
}

/// Pinned, device-mapped host memory, zero-filled when created.
pub struct HostArena {
    host: *mut u8,
    dev: u64,
    bytes: usize,
    backing: Backing,
}

// SAFETY: the memory is owned by this value; the host only reads it through `read`, which copies
// with volatile loads (the GPU writes it concurrently), and never hands out references.
unsafe impl Send for HostArena {}
// SAFETY: as above.
unsafe impl Sync for HostArena {}

fn os_error(during: &'static str) -> Error {
    Error::Cuda {
        during,
        detail: std::io::Error::last_os_error().to_string(),
    }
}

impl HostArena {
    /// `bytes` of pinned host memory for ranks of this process (a context must be current).
    pub fn alloc(bytes: usize) -> Result<HostArena, Error> {
        // SAFETY: portable + device-mapped pinned memory; a context is current.
        let h = unsafe {
            result::malloc_host(
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(cuda("allocating the host arena"))?;
        // SAFETY: `h` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(h as *mut u8, 0, bytes) };
        let mut a = HostArena {
            host: h as *mut u8,
            dev: 0,
            bytes,
            backing: Backing::Alloc,
        };
        a.dev = a.device_pointer()?;
        Ok(a)
    }

    /// Creates the shared segment `name` (a POSIX shared-memory name, `/` then up to 250
    /// characters without `/`) of `bytes`, zero-filled, mapped and registered in this process,
    /// its pages placed on NUMA node `numa` where given (the node nearest the GPU; a preference:
    /// the kernel falls back to other nodes when that one is full).
    pub fn create_shared(name: &str, bytes: usize, numa: Option<u32>) -> Result<HostArena, Error> {
        Self::shared(name, bytes, true, numa)
    }

    /// Opens the segment `name` another rank created with [`HostArena::create_shared`].
    pub fn open_shared(name: &str, bytes: usize) -> Result<HostArena, Error> {
        Self::shared(name, bytes, false, None)
    }

    fn shared(
        name: &str,
        bytes: usize,
        create: bool,
        numa: Option<u32>,
    ) -> Result<HostArena, Error> {
        let cname = CString::new(name).map_err(|_| Error::Cuda {
            during: "naming a shared host arena",
            detail: "the name contains a NUL byte".into(),
        })?;
        let flags = if create {
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
        } else {
            libc::O_RDWR
        };
        // SAFETY: `cname` is NUL-terminated; the call has no other preconditions.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(os_error("opening a shared host arena"));
        }
        let unlink_on_error = |e: Error| {
            if create {
                // SAFETY: removes the name this call created.
                unsafe { libc::shm_unlink(cname.as_ptr()) };
            }
            e
        };
        // SAFETY: `fd` is the descriptor just opened.
        if create && unsafe { libc::ftruncate(fd, bytes as libc::off_t) } != 0 {
            let e = os_error("sizing a shared host arena");
            // SAFETY: closes the descriptor opened above.
            unsafe { libc::close(fd) };
            return Err(unlink_on_error(e));
        }
        // SAFETY: maps `bytes` of the segment (its size is `bytes`: set above, or by the creator)
        // shared and writable; the descriptor may be closed once mapped.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: the mapping keeps the segment; the descriptor is no longer needed.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            return Err(unlink_on_error(os_error("mapping a shared host arena")));
        }
        if create {
            if let Some(node) = numa.filter(|&n| n < 64) {
                let mask: u64 = 1 << node;
                // SAFETY: a placement policy for the mapping made above (no page is touched
                // yet); `mask` outlives the call and holds 64 bits. A failure leaves the default
                // policy, which is only slower.
                unsafe {
                    libc::syscall(
                        libc::SYS_mbind,
                        p,
                        bytes.max(1),
                        MPOL_PREFERRED,
                        &mask as *const u64,
                        65u64,
                        0u32,
                    )
                };
            }
            // SAFETY: `p` maps `bytes` writable bytes (ftruncate already zero-fills; this also
            // places the pages, first touch, under the policy above).
            unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        }
        // SAFETY: `p` is a page-aligned mapping of `bytes` bytes that outlives the registration
        // (unregistered in Drop before the unmap).
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                p,
                bytes.max(1),
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if let Err(e) = check(r, "registering a shared host arena with the GPU") {
            // SAFETY: unmaps the mapping made above, which nothing else refers to.
            unsafe { libc::munmap(p, bytes.max(1)) };
            return Err(unlink_on_error(e));
        }
        let mut a = HostArena {
            host: p as *mut u8,
            dev: 0,
            bytes,
            backing: Backing::Shared {
                name: cname.clone(),
                owner: create,
            },
        };
        a.dev = a.device_pointer()?;
        Ok(a)
    }

    fn device_pointer(&self) -> Result<u64, Error> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `self.host` is device-mapped pinned memory; out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.host as *mut c_void, 0) };
        check(r, "mapping the host arena into the GPU")?;
        Ok(d)
    }

    /// Device address of the arena.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies bytes at `offset` into `dst` with volatile loads (the GPU may write them meanwhile).
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= self.bytes),
            "host arena read out of bounds"
        );
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: in bounds (asserted); a plain byte read, volatile for concurrent writes.
            *d = unsafe { std::ptr::read_volatile(self.host.add(offset + i)) };
        }
    }

    /// Removes the segment's name (the memory stays until every process unmaps it). The creator
    /// calls this once every peer has opened it, so that no name outlives a crashed job.
    pub fn unlink(&mut self) {
        if let Backing::Shared { name, owner } = &mut self.backing
            && *owner
        {
            // SAFETY: removes the name this process created.
            unsafe { libc::shm_unlink(name.as_ptr()) };
            *owner = false;
        }
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Alloc => {
                // SAFETY: frees the allocation this value owns (kernels that use it have finished).
                let _ = unsafe { result::free_host(self.host as *mut c_void) };
            }
            Backing::Shared { name, owner } => {
                // SAFETY: undoes the registration and the mapping this value made, in that order.
                unsafe {
                    let _ = sys::cuMemHostUnregister(self.host as *mut c_void);
                    libc::munmap(self.host as *mut c_void, self.bytes.max(1));
                    if *owner {
                        libc::shm_unlink(name.as_ptr());
                    }
                }
            }
        }
    }
}
