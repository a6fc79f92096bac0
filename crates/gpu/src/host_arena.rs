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

/// What a peer's segment must be before it is mapped: a regular file of exactly `bytes` (a
/// shorter one would fault the first access past its end; a longer one is not the segment the
/// set-up record describes), owned by this process's user (the creator makes it `0600`). A
/// segment that fails these checks is refused with the reason; nothing is mapped.
fn check_segment(fd: i32, bytes: usize) -> Result<(), Error> {
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is an open descriptor; `st` is a valid out pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(os_error("checking a shared host arena"));
    }
    let refuse = |detail: String| Error::Cuda {
        during: "checking a shared host arena",
        detail,
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(refuse("it is not a shared-memory segment".into()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if st.st_uid != me {
        return Err(refuse(format!(
            "it belongs to user {}, not to this process's user {me}",
            st.st_uid
        )));
    }
    if u64::try_from(st.st_size).ok() != Some(bytes as u64) {
        return Err(refuse(format!(
            "it holds {} bytes, the set-up record says {bytes}",
            st.st_size
        )));
    }
    Ok(())
}

/// Whether process `pid` exists (in this process's PID namespace).
fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the names of shared segments that a process which no longer exists created and could
/// not remove (it died before every peer had mapped them): `/dev/shm/<prefix><pid>-...` owned by
/// this process's user whose `<pid>` is gone. The prefix names this process's PID namespace
/// (the caller's choice), so a live process of another namespace that shares `/dev/shm` is never
/// taken for a dead one. Returns how many names were removed. Memory a surviving peer still maps
/// stays with that peer; only the name goes.
pub fn remove_stale_segments(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some(pid) = rest
            .split('-')
            .next()
            .and_then(|p| p.parse::<i32>().ok())
            .filter(|&p| p > 0)
        else {
            continue;
        };
        use std::os::unix::fs::MetadataExt;
        let mine = entry.metadata().is_ok_and(|m| m.uid() == me);
        if !mine || process_exists(pid) {
            continue;
        }
        let Ok(c) = CString::new(format!("/{}", name.to_string_lossy())) else {
            continue;
        };
        // SAFETY: removes a name (not memory) of a segment whose creator is gone.
        if unsafe { libc::shm_unlink(c.as_ptr()) } == 0 {
            removed += 1;
        }
    }
    removed
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
        if !create && let Err(e) = check_segment(fd, bytes) {
            // SAFETY: closes the descriptor opened above.
            unsafe { libc::close(fd) };
            return Err(e);
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

    /// Loads the 8-byte word at `offset` (8-byte aligned) with acquire ordering: words that other
    /// processes store with [`HostArena::store_u64`].
    pub fn load_u64(&self, offset: usize) -> u64 {
        self.word(offset).load(std::sync::atomic::Ordering::Acquire)
    }

    /// Stores the 8-byte word at `offset` (8-byte aligned) with release ordering.
    pub fn store_u64(&self, offset: usize, v: u64) {
        self.word(offset)
            .store(v, std::sync::atomic::Ordering::Release);
    }

    fn word(&self, offset: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.bytes,
            "host arena word out of bounds or unaligned"
        );
        // SAFETY: in bounds and aligned (asserted; the mapping is page-aligned); the memory lives
        // as long as `self`; every access to these words, in any process, is atomic.
        unsafe { &*(self.host.add(offset) as *const std::sync::atomic::AtomicU64) }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment made here by hand, as another rank (or someone else) would have made it.
    fn make_segment(name: &str, bytes: usize) {
        let c = CString::new(name).unwrap();
        // SAFETY: valid name; creates a fresh segment.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        assert!(fd >= 0, "{name}: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just opened.
        unsafe {
            assert_eq!(libc::ftruncate(fd, bytes as libc::off_t), 0);
            libc::close(fd);
        }
    }

    fn unlink(name: &str) {
        let c = CString::new(name).unwrap();
        // SAFETY: valid name.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }

    /// A peer's segment shorter than the set-up record says (a bad record, or a planted name) is
    /// refused before it is mapped: mapped, the first access past its end would kill the process
    /// (SIGBUS), and registered with the GPU, a kernel's.
    #[test]
    fn a_segment_of_the_wrong_size_or_owner_is_refused_before_mapping() {
        let name = format!("/flashcomm-test-size-{}", std::process::id());
        make_segment(&name, 4096);
        let e = HostArena::open_shared(&name, 1 << 20)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("holds 4096 bytes"), "{e}");
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            // Another user's segment (only root can make one here).
            let c = CString::new(name.as_str()).unwrap();
            // SAFETY: valid name; the descriptor is closed right after the chown.
            unsafe {
                let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
                assert!(fd >= 0);
                assert_eq!(libc::fchown(fd, 65534, 65534), 0);
                libc::close(fd);
            }
            let e = HostArena::open_shared(&name, 4096).err().expect("refused");
            assert!(e.to_string().contains("belongs to user 65534"), "{e}");
        }
        unlink(&name);
    }

    /// A creator that died before its peers mapped its segment leaves the name behind; the next
    /// set-up of this user in this namespace removes it. Live creators' names stay, and so do
    /// names of other namespaces (their processes are not visible from here).
    #[test]
    fn names_of_dead_creators_are_removed() {
        let prefix = format!("flashcomm-test-{}-", std::process::id());
        let dead = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            c.wait().unwrap();
            pid
        };
        let stale = format!("/{prefix}{dead}-0-0");
        let live = format!("/{prefix}{}-0-0", std::process::id());
        let other = format!("/flashcomm-test-other-{}-{dead}-0-0", std::process::id());
        for n in [&stale, &live, &other] {
            make_segment(n, 64);
        }
        assert_eq!(remove_stale_segments(&prefix), 1);
        let exists = |n: &str| std::path::Path::new(&format!("/dev/shm{n}")).exists();
        assert!(!exists(&stale), "the dead creator's name is gone");
        assert!(exists(&live) && exists(&other));
        unlink(&live);
        unlink(&other);
    }
}
