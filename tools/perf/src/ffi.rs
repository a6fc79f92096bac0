//! The only `unsafe` code of flashcomm-perf (foreign calls):
//!
//! * the real NCCL, loaded by path with `libloading` (never by bare name) and called through
//!   typed function pointers whose types are proven at compile time to be the signatures of
//!   `flashcomm-nccl-sys`'s declarations of the pinned `nccl.h`;
//! * the copy baseline's `cuMemcpyDtoDAsync`, the one driver call that `flashcomm-comm` does
//!   not wrap;
//! * setting `CUDA_DEVICE_MAX_CONNECTIONS` at program start (`std::env::set_var`);
//! * viewing rank 0's output, opened in another rank process through CUDA IPC, as a
//!   `DevicePtr` (`DevicePtr::from_raw`).
//!
//! Every entry point here is a safe function whose arguments carry the guarantees the foreign
//! call needs: buffers come as `flashcomm_comm::DevicePtr` (valid device memory of the stated
//! length, by that type's contract) and lengths are checked before any call.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use flashcomm_codec::DType;
use flashcomm_comm::gpu::{HostArena, IpcMapping};
use flashcomm_comm::{DevicePtr, Stream};
use flashcomm_nccl_sys as nccl;

/// The hardware work queues a CUDA context may use (the driver's maximum).
pub const MAX_CONNECTIONS: &str = "32";

/// Gives every stream of the process its own hardware work queue, unless the caller chose
/// `CUDA_DEVICE_MAX_CONNECTIONS` already. With the default 8 queues, the streams of virtual ranks
/// share queues, and an ordered command of one rank (an event record after its kernel, which
/// waits for a peer) can hold another rank's kernel behind it: a deadlock until the timeout.
/// Must run before the first CUDA call and before any other thread exists.
pub fn use_all_hardware_queues() {
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: called first thing in `main`, while the process has a single thread, so no
        // other thread reads or writes the environment concurrently.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", MAX_CONNECTIONS) };
        QUEUES_SET_HERE.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

static QUEUES_SET_HERE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`use_all_hardware_queues`] chose `CUDA_DEVICE_MAX_CONNECTIONS` (not the user).
pub fn queues_set_here() -> bool {
    QUEUES_SET_HERE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Rank 0's output buffer of `len` bytes, opened in this process through CUDA IPC, as a range
/// the comparison kernel can read.
pub fn peer_range(m: &IpcMapping, len: u64) -> DevicePtr {
    // SAFETY: the mapping is rank 0's receive allocation, which is at least `len` bytes long
    // (every rank allocates the same sizes; the caller passes its own receive length), opened in
    // the current context with peer access enabled; the caller keeps `m` alive, and rank 0 keeps
    // the allocation, until the last comparison has finished (a barrier follows each one).
    unsafe { DevicePtr::from_raw(m.ptr(), len) }
}

/// A pinned, device-mapped host buffer as a range the copy engine can copy to and from.
pub fn host_range(h: &HostArena) -> DevicePtr {
    // SAFETY: the device address of a device-mapped host allocation of `h.len()` bytes, valid in
    // every context of the process (portable); the caller keeps `h` alive until the copies that
    // use it have finished (rank 0 synchronizes after each job).
    unsafe { DevicePtr::from_raw(h.dev_ptr(), h.len() as u64) }
}

/// `len` bytes of a device-mapped host allocation from byte `offset` on, as a device range.
pub fn host_part(h: &HostArena, offset: u64, len: u64) -> DevicePtr {
    assert!(offset + len <= h.len() as u64, "host range out of bounds");
    // SAFETY: a sub-range (checked above) of the device address range of a device-mapped host
    // allocation, valid in every context of the process; the caller keeps `h` alive until the
    // copies that use it have finished (rank 0 synchronizes after each job).
    unsafe { DevicePtr::from_raw(h.dev_ptr() + offset, len) }
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> nccl::ncclResult_t;
type GetErrorStringFn = unsafe extern "C" fn(nccl::ncclResult_t) -> *const c_char;
type CommInitAllFn =
    unsafe extern "C" fn(*mut nccl::ncclComm_t, c_int, *const c_int) -> nccl::ncclResult_t;
type CommDestroyFn = unsafe extern "C" fn(nccl::ncclComm_t) -> nccl::ncclResult_t;
type GetUniqueIdFn = unsafe extern "C" fn(*mut nccl::ncclUniqueId) -> nccl::ncclResult_t;
type CommInitRankFn = unsafe extern "C" fn(
    *mut nccl::ncclComm_t,
    c_int,
    nccl::ncclUniqueId,
    c_int,
) -> nccl::ncclResult_t;
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nccl::ncclDataType_t,
    nccl::ncclRedOp_t,
    nccl::ncclComm_t,
    nccl::cudaStream_t,
) -> nccl::ncclResult_t;
type GatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nccl::ncclDataType_t,
    nccl::ncclComm_t,
    nccl::cudaStream_t,
) -> nccl::ncclResult_t;

// Compile-time proof that the pointer types are the header's signatures (a mismatch does not
// compile). These constants are never used, so nothing refers to the symbols at link time.
const _: GetVersionFn = nccl::decls::ncclGetVersion;
const _: GetErrorStringFn = nccl::decls::ncclGetErrorString;
const _: CommInitAllFn = nccl::decls::ncclCommInitAll;
const _: CommDestroyFn = nccl::decls::ncclCommDestroy;
const _: GetUniqueIdFn = nccl::decls::ncclGetUniqueId;
const _: CommInitRankFn = nccl::decls::ncclCommInitRank;
const _: ReduceFn = nccl::decls::ncclAllReduce;
const _: ReduceFn = nccl::decls::ncclReduceScatter;
const _: GatherFn = nccl::decls::ncclAllGather;
// ncclAlltoAll has AllGather's signature (count per peer instead of per rank).
const _: GatherFn = nccl::decls::ncclAlltoAll;

/// The NCCL number of an element type.
fn nccl_raw(t: DType) -> nccl::ncclDataType_t {
    match t {
        DType::Bf16 => nccl::ncclDataType_t::ncclBfloat16,
        DType::F16 => nccl::ncclDataType_t::ncclFloat16,
        DType::F32 => nccl::ncclDataType_t::ncclFloat32,
    }
}

/// The real NCCL library and the functions flashcomm-perf calls.
pub struct Nccl {
    path: PathBuf,
    version: i32,
    get_error_string: GetErrorStringFn,
    comm_init_all: CommInitAllFn,
    comm_destroy: CommDestroyFn,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    all_reduce: ReduceFn,
    reduce_scatter: ReduceFn,
    all_gather: GatherFn,
    all_to_all: GatherFn,
    // Keeps the library mapped for as long as the function pointers above may be called.
    _lib: libloading::Library,
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    let cname = format!("{name}\0");
    // SAFETY: every `T` this module asks for is one of the function pointer types above, proven
    // equal to the header's signature of the symbol of the same name; the pointer is copied out
    // and only used while `lib` (kept in `Nccl`) stays loaded.
    let s =
        unsafe { lib.get::<T>(cname.as_bytes()) }.map_err(|e| format!("{name} not found: {e}"))?;
    Ok(*s)
}

impl Nccl {
    /// Loads the library at `path` (must name a file: a bare `libnccl.so.2` could find flashcomm's
    /// own library through the search path).
    pub fn load(path: &Path) -> Result<Nccl, String> {
        if !path.to_string_lossy().contains('/') {
            return Err(format!(
                "--nccl-lib {}: give a path (with a '/'), not a bare library name",
                path.display()
            ));
        }
        // SAFETY: loading a shared library runs its initializers. The user names the NCCL build
        // to benchmark; NCCL's initializers only set up its own state. RTLD_LOCAL (libloading's
        // default) keeps its symbols out of the global scope.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        let get_version: GetVersionFn = symbol(&lib, "ncclGetVersion")?;
        let mut version: c_int = 0;
        // SAFETY: typed pointer from this library; `version` is a valid out-pointer.
        let r = unsafe { get_version(&mut version) };
        let n = Nccl {
            path: path.to_path_buf(),
            version,
            get_error_string: symbol(&lib, "ncclGetErrorString")?,
            comm_init_all: symbol(&lib, "ncclCommInitAll")?,
            comm_destroy: symbol(&lib, "ncclCommDestroy")?,
            get_unique_id: symbol(&lib, "ncclGetUniqueId")?,
            comm_init_rank: symbol(&lib, "ncclCommInitRank")?,
            all_reduce: symbol(&lib, "ncclAllReduce")?,
            reduce_scatter: symbol(&lib, "ncclReduceScatter")?,
            all_gather: symbol(&lib, "ncclAllGather")?,
            all_to_all: symbol(&lib, "ncclAlltoAll")?,
            _lib: lib,
        };
        n.check(r, "ncclGetVersion")?;
        Ok(n)
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `ncclGetVersion`'s code.
    pub fn version(&self) -> i32 {
        self.version
    }

    fn check(&self, r: nccl::ncclResult_t, what: &str) -> Result<(), String> {
        if r == nccl::ncclResult_t::ncclSuccess {
            return Ok(());
        }
        // SAFETY: typed pointer from the loaded library; NCCL returns a static string (or null).
        let msg = unsafe { (self.get_error_string)(r) };
        let text = if msg.is_null() {
            String::from("unknown error")
        } else {
            // SAFETY: non-null, NUL-terminated static string owned by NCCL.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        Err(format!("{what} failed: {text} (ncclResult_t {})", r.0))
    }

    /// One communicator per device of `devices`, rank i on `devices[i]` (`ncclCommInitAll`).
    pub fn init_all(&self, devices: &[i32]) -> Result<Vec<NcclComm>, String> {
        let mut comms: Vec<nccl::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        let n = c_int::try_from(devices.len()).map_err(|_| "too many devices".to_string())?;
        // SAFETY: `comms` has room for `n` handles and `devices` holds `n` ordinals.
        let r = unsafe { (self.comm_init_all)(comms.as_mut_ptr(), n, devices.as_ptr()) };
        self.check(r, "ncclCommInitAll")?;
        Ok(comms.into_iter().map(NcclComm).collect())
    }

    /// `ncclGetUniqueId`: the 128 bytes rank 0 hands to every rank process.
    pub fn unique_id(&self) -> Result<Vec<u8>, String> {
        let mut id = nccl::ncclUniqueId {
            internal: [0; nccl::NCCL_UNIQUE_ID_BYTES as usize],
        };
        // SAFETY: typed pointer from the loaded library; `id` is a valid out-pointer.
        let r = unsafe { (self.get_unique_id)(&mut id) };
        self.check(r, "ncclGetUniqueId")?;
        Ok(id.internal.iter().map(|&b| b as u8).collect())
    }

    /// Rank `rank` of `nranks` in this process (`ncclCommInitRank`), on the device of the CUDA
    /// context current on this thread, joined through rank 0's `id` (from [`Nccl::unique_id`]).
    pub fn init_rank(&self, nranks: u32, id: &[u8], rank: u32) -> Result<NcclComm, String> {
        let mut uid = nccl::ncclUniqueId {
            internal: [0; nccl::NCCL_UNIQUE_ID_BYTES as usize],
        };
        if id.len() != uid.internal.len() {
            return Err(format!("an NCCL unique id has 128 bytes, not {}", id.len()));
        }
        for (d, &b) in uid.internal.iter_mut().zip(id) {
            *d = b as c_char;
        }
        let n = c_int::try_from(nranks).map_err(|_| "too many ranks".to_string())?;
        let r = c_int::try_from(rank).map_err(|_| "rank out of range".to_string())?;
        let mut comm: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: typed pointer from the loaded library; `comm` is a valid out-pointer and the
        // id is passed by value, as the header declares.
        let res = unsafe { (self.comm_init_rank)(&mut comm, n, uid, r) };
        self.check(res, "ncclCommInitRank")?;
        Ok(NcclComm(comm))
    }

    /// `ncclCommDestroy`.
    pub fn destroy(&self, comm: NcclComm) -> Result<(), String> {
        // SAFETY: `comm` came from `init_all` or `init_rank` of this library and is destroyed
        // once (consumed).
        let r = unsafe { (self.comm_destroy)(comm.0) };
        self.check(r, "ncclCommDestroy")
    }

    /// Sum AllReduce of `count` elements on `stream`.
    pub fn all_reduce(
        &self,
        comm: &NcclComm,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        ty: DType,
        stream: Stream,
    ) -> Result<(), String> {
        let bytes = count * ty.bytes();
        fits(send, bytes)?;
        fits(recv, bytes)?;
        // SAFETY: both ranges are valid device memory of at least `bytes` bytes (DevicePtr's
        // contract, lengths checked above); `comm` is a live communicator of this library used by
        // one thread at a time; `stream` is a stream of the comm's device's context.
        let r = unsafe {
            (self.all_reduce)(
                send.addr() as *const c_void,
                recv.addr() as *mut c_void,
                count as usize,
                nccl_raw(ty),
                nccl::ncclRedOp_t::ncclSum,
                comm.0,
                stream.0 as nccl::cudaStream_t,
            )
        };
        self.check(r, "ncclAllReduce")
    }

    /// Sum ReduceScatter: `recvcount` elements per rank.
    pub fn reduce_scatter(
        &self,
        comm: &NcclComm,
        send: DevicePtr,
        recv: DevicePtr,
        recvcount: u64,
        nranks: u32,
        ty: DType,
        stream: Stream,
    ) -> Result<(), String> {
        fits(send, recvcount * u64::from(nranks) * ty.bytes())?;
        fits(recv, recvcount * ty.bytes())?;
        // SAFETY: as in `all_reduce`, with the send buffer checked for all ranks' blocks.
        let r = unsafe {
            (self.reduce_scatter)(
                send.addr() as *const c_void,
                recv.addr() as *mut c_void,
                recvcount as usize,
                nccl_raw(ty),
                nccl::ncclRedOp_t::ncclSum,
                comm.0,
                stream.0 as nccl::cudaStream_t,
            )
        };
        self.check(r, "ncclReduceScatter")
    }

    /// AllGather: `sendcount` elements from every rank.
    pub fn all_gather(
        &self,
        comm: &NcclComm,
        send: DevicePtr,
        recv: DevicePtr,
        sendcount: u64,
        nranks: u32,
        ty: DType,
        stream: Stream,
    ) -> Result<(), String> {
        fits(send, sendcount * ty.bytes())?;
        fits(recv, sendcount * u64::from(nranks) * ty.bytes())?;
        // SAFETY: as in `all_reduce`, with the receive buffer checked for all ranks' blocks.
        let r = unsafe {
            (self.all_gather)(
                send.addr() as *const c_void,
                recv.addr() as *mut c_void,
                sendcount as usize,
                nccl_raw(ty),
                comm.0,
                stream.0 as nccl::cudaStream_t,
            )
        };
        self.check(r, "ncclAllGather")
    }

    /// AllToAll: `count` elements to and from every rank.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all(
        &self,
        comm: &NcclComm,
        send: DevicePtr,
        recv: DevicePtr,
        count: u64,
        nranks: u32,
        ty: DType,
        stream: Stream,
    ) -> Result<(), String> {
        let all = count * u64::from(nranks) * ty.bytes();
        fits(send, all)?;
        fits(recv, all)?;
        // SAFETY: as in `all_reduce`, with both buffers checked for every rank's block.
        let r = unsafe {
            (self.all_to_all)(
                send.addr() as *const c_void,
                recv.addr() as *mut c_void,
                count as usize,
                nccl_raw(ty),
                comm.0,
                stream.0 as nccl::cudaStream_t,
            )
        };
        self.check(r, "ncclAlltoAll")
    }
}

fn fits(p: DevicePtr, bytes: u64) -> Result<(), String> {
    if p.len() < bytes {
        return Err(format!(
            "buffer of {} bytes is too small for {bytes}",
            p.len()
        ));
    }
    Ok(())
}

/// One rank's NCCL communicator.
pub struct NcclComm(nccl::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; flashcomm-perf hands each one to exactly one rank thread, which makes every call.
unsafe impl Send for NcclComm {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_and_missing_files_are_refused_with_a_message() {
        let e = Nccl::load(Path::new("libnccl.so.2")).err().unwrap();
        assert!(e.contains("give a path"), "{e}");
        let e = Nccl::load(Path::new("/nonexistent/libnccl.so.2"))
            .err()
            .unwrap();
        assert!(e.contains("cannot load /nonexistent/libnccl.so.2"), "{e}");
    }

    /// Loads the real NCCL when `FLASHCOMM_NCCL_LIB` names one (ci/setup.sh's toolchain has
    /// it): every symbol resolves and `ncclGetVersion` works without a GPU.
    #[test]
    fn real_nccl_loads_when_present() {
        let Some(path) = std::env::var_os("FLASHCOMM_NCCL_LIB").map(PathBuf::from) else {
            return;
        };
        if !path.is_file() {
            return;
        }
        let n = Nccl::load(&path).unwrap();
        assert!(n.version() >= 22000, "version code {}", n.version());
        assert_eq!(n.path(), path.as_path());
    }

    #[test]
    fn type_codes_are_nccls() {
        assert_eq!(nccl_raw(DType::Bf16).0, 9);
        assert_eq!(nccl_raw(DType::F16).0, 6);
        assert_eq!(nccl_raw(DType::F32).0, 7);
    }
}
