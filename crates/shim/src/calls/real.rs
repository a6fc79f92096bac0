//! The real NCCL: finding it, opening it, resolving its functions.
//!
//! Loaded lazily, at the first call that needs it (never from a constructor: a preloaded library
//! lands in every process of a job, shells and compilers included). The candidates come from
//! [`crate::discovery`]; each is refused if it is flashcomm itself (same device and inode as our
//! own file, found with `dladdr` on one of our symbols), if after opening its `ncclGetVersion`
//! resolves into our image, or if it exports `flashcommGetVersion` (another copy of flashcomm).
//! It is opened with `RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND`, so that the real library's calls to
//! its own exports (`ncclBcast` calls `ncclBroadcast`, ...) stay inside it instead of coming back
//! through ours. The handle is never closed.
//!
//! Owns: [`RealLib`], [`Slot`], [`library`], [`loaded`], [`real_last_error`].
//! May import: `discovery`, `error`, `logging`, `init`, `calls::os`.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};

use flashcomm_nccl_sys::{HEADER_VERSION, version_string};

use crate::calls::os::PerProcess;
use crate::discovery::{self, Candidate, Inputs, Origin};
use crate::error::Error;
use crate::logging::{self, Subsys};

/// The opened real library.
#[derive(Debug)]
pub(crate) struct RealLib {
    /// The `dlopen` handle, as an address (a raw pointer is neither `Send` nor `Sync`; the
    /// handle is valid for the life of the process and `dlsym` is thread-safe).
    handle: usize,
    /// The file that was opened.
    pub(crate) path: PathBuf,
    /// Why it was chosen.
    pub(crate) origin: Origin,
    /// What its `ncclGetVersion` reported at load time.
    pub(crate) version: i32,
}

impl RealLib {
    /// The address of the real library's function `name`, if it has one.
    fn symbol(&self, name: &CStr) -> Option<*mut c_void> {
        // SAFETY: `handle` came from a successful dlopen and is never closed; `name` is a valid C
        // string.
        let p = unsafe { libc::dlsym(self.handle as *mut c_void, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// A fork child uses the library its parent loaded (the same mapping); one a parent's thread
/// was still loading when it forked is loaded again in the child.
static REAL: PerProcess<Result<RealLib, String>> = PerProcess::inherited();

/// The real library, loading it on first use. `Err` (`ncclSystemError`) says what was tried.
pub(crate) fn library() -> Result<&'static RealLib, Error> {
    match REAL.get(load) {
        Ok(lib) => Ok(lib),
        Err(msg) => Err(Error::system(Subsys::Init, msg.clone())),
    }
}

/// The real library if it is already loaded; never loads it.
pub(crate) fn loaded() -> Option<&'static RealLib> {
    REAL.get_made().and_then(|r| r.as_ref().ok())
}

/// A lazily resolved function of the real library. One per export (`ncclX` and `pncclX` share
/// it); the address is cached after the first successful lookup.
pub(crate) struct Slot {
    name: &'static CStr,
    ptr: AtomicPtr<c_void>,
}

impl Slot {
    /// A slot for the real function `name`.
    pub(crate) const fn new(name: &'static CStr) -> Slot {
        Slot {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The function's name.
    pub(crate) fn name(&self) -> &'static str {
        self.name.to_str().unwrap_or("?")
    }

    /// The real function's address, or why there is none: `ncclSystemError` when no real
    /// library could be loaded, `ncclInvalidUsage` when it lacks this function.
    #[inline]
    pub(crate) fn get(&self) -> Result<*mut c_void, Error> {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return Ok(p);
        }
        self.resolve()
    }

    #[cold]
    fn resolve(&self) -> Result<*mut c_void, Error> {
        let lib = library()?;
        match lib.symbol(self.name) {
            Some(p) => {
                self.ptr.store(p, Ordering::Release);
                Ok(p)
            }
            None => Err(Error::missing_function(
                self.name(),
                format!(
                    "{name} is not provided by the real NCCL {real} at {path}; flashcomm exports \
                     the NCCL {HEADER_VERSION} API, so the call fails (ncclInvalidUsage, or the \
                     default documented in docs/abi.md for functions that return no \
                     ncclResult_t)",
                    name = self.name(),
                    real = version_string(lib.version),
                    path = lib.path.display(),
                ),
            )),
        }
    }
}

/// Our own image: where it is loaded and which file it is.
struct OwnImage {
    base: usize,
    path: Option<PathBuf>,
    file_id: Option<(u64, u64)>,
}

static ANCHOR: u8 = 0;

fn own_image() -> OwnImage {
    // SAFETY: Dl_info is plain data; all-zero is a valid value that dladdr overwrites.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: the address is that of a static of this image; `info` is a valid out pointer.
    let rc = unsafe { libc::dladdr(std::ptr::from_ref(&ANCHOR).cast(), &mut info) };
    if rc == 0 {
        return OwnImage {
            base: 0,
            path: None,
            file_id: None,
        };
    }
    let path = (!info.dli_fname.is_null()).then(|| {
        // SAFETY: dladdr returned success, so dli_fname is a NUL-terminated string owned by the
        // dynamic loader that lives as long as the object.
        let name = unsafe { CStr::from_ptr(info.dli_fname) };
        PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes()))
    });
    let file_id = path
        .as_deref()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino()));
    OwnImage {
        base: info.dli_fbase as usize,
        path,
        file_id,
    }
}

/// The base address of the object that contains `addr`.
fn image_base_of(addr: *const c_void) -> Option<usize> {
    // SAFETY: Dl_info is plain data; all-zero is a valid value that dladdr overwrites.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only inspects the loader's tables for `addr`; `info` is a valid out pointer.
    let rc = unsafe { libc::dladdr(addr, &mut info) };
    (rc != 0).then_some(info.dli_fbase as usize)
}

unsafe extern "C" fn collect_object(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut c_void,
) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the duration of the callback, and `data`
    // is the `Vec<PathBuf>` that `loaded_objects` passed in, borrowed mutably for the iteration.
    let (info, out) = unsafe { (&*info, &mut *data.cast::<Vec<PathBuf>>()) };
    if !info.dlpi_name.is_null() {
        // SAFETY: dlpi_name is a NUL-terminated string owned by the loader.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) };
        if !name.is_empty() {
            out.push(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())));
        }
    }
    0
}

/// Paths of every object loaded in the process, in load order.
fn loaded_objects() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    // SAFETY: the callback matches the expected signature and only appends to `out`, which
    // outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(collect_object), (&raw mut out).cast()) };
    out
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: see above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

struct Handle(*mut c_void);

impl Handle {
    fn sym(&self, name: &CStr) -> *mut c_void {
        // SAFETY: the handle came from a successful dlopen and is still open; `name` is a valid C
        // string.
        unsafe { libc::dlsym(self.0, name.as_ptr()) }
    }

    fn close(self) {
        // SAFETY: the handle came from a successful dlopen and is closed exactly once, here.
        unsafe { libc::dlclose(self.0) };
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> flashcomm_nccl_sys::ncclResult_t;

/// Opens one candidate, or says why not.
fn try_open(c: &Candidate, me: &OwnImage) -> Result<RealLib, String> {
    let meta = std::fs::metadata(&c.path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "not found".to_string(),
        _ => e.to_string(),
    })?;
    if !meta.is_file() {
        return Err("not a file".into());
    }
    if me.file_id == Some((meta.dev(), meta.ino())) {
        return Err("is flashcomm itself (same file as this library)".into());
    }
    // The loader maps the file's segments as its program headers describe them; a page past the
    // end of a shorter file would kill the process with SIGBUS at its first touch.
    check_elf(&c.path, meta.len())?;
    let cpath = CString::new(c.path.as_os_str().as_bytes()).map_err(|_| "path contains NUL")?;
    // SAFETY: `cpath` is a valid C string naming a file by path (it contains a `/`), so dlopen
    // does not search for it by name. Opening runs the library's initializers, which is what
    // loading NCCL means.
    let raw = unsafe {
        libc::dlopen(
            cpath.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND,
        )
    };
    if raw.is_null() {
        return Err(format!("dlopen failed: {}", dlerror_text()));
    }
    let h = Handle(raw);
    let gv = h.sym(c"ncclGetVersion");
    if gv.is_null() {
        h.close();
        return Err("has no ncclGetVersion: not an NCCL library".into());
    }
    if image_base_of(gv) == Some(me.base) {
        h.close();
        return Err("resolves ncclGetVersion to flashcomm itself".into());
    }
    if !h.sym(c"flashcommGetVersion").is_null() {
        h.close();
        return Err("is another copy of flashcomm, not the real NCCL".into());
    }
    // SAFETY: `gv` is the real library's ncclGetVersion, declared in nccl.h as
    // `ncclResult_t ncclGetVersion(int*)`.
    let get_version = unsafe { std::mem::transmute::<*mut c_void, GetVersion>(gv) };
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out pointer; the function only writes it.
    let rc = unsafe { get_version(&mut version) };
    if rc.0 != 0 {
        h.close();
        return Err(format!("its ncclGetVersion failed with code {}", rc.0));
    }
    let handle = h.0 as usize;
    Ok(RealLib {
        handle,
        path: c.path.clone(),
        origin: c.origin.clone(),
        version,
    })
}

/// ELF64 header fields: class and data encoding in `e_ident`, then the program header table.
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const ELF_HEADER_BYTES: usize = 64;
const PHDR_BYTES: u64 = 56;

/// Whether the file at `path` (`len` bytes) is a 64-bit little-endian ELF image whose program
/// headers and segments all lie inside the file. `Err` says what is wrong, in words.
fn check_elf(path: &Path, len: u64) -> Result<(), String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut header = [0u8; ELF_HEADER_BYTES];
    let got = read_up_to(&mut f, &mut header).map_err(|e| e.to_string())?;
    let (phoff, phnum) = elf_program_headers(&header[..got], len)?;
    let mut table = vec![0u8; (phnum * PHDR_BYTES) as usize];
    f.seek(SeekFrom::Start(phoff))
        .and_then(|_| f.read_exact(&mut table))
        .map_err(|e| format!("cannot read its program headers: {e}"))?;
    elf_segments_fit(&table, len)
}

fn read_up_to(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// From the first bytes of a file of `len` bytes: the offset and number of its program headers,
/// when it is a 64-bit little-endian ELF image whose header table lies inside the file.
fn elf_program_headers(header: &[u8], len: u64) -> Result<(u64, u64), String> {
    if header.len() < 4 || &header[..4] != ELF_MAGIC {
        return Err("not an ELF file (a shared library starts with \\x7fELF)".into());
    }
    if header.len() < ELF_HEADER_BYTES {
        return Err(format!(
            "truncated: {len} bytes, shorter than an ELF header ({ELF_HEADER_BYTES})"
        ));
    }
    if header[4] != 2 || header[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let u16_at = |i: usize| u64::from(u16::from_le_bytes([header[i], header[i + 1]]));
    let phoff = u64::from_le_bytes(header[0x20..0x28].try_into().unwrap_or_default());
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    if phnum == 0 {
        return Err("an ELF file without program headers (not a shared library)".into());
    }
    if phentsize != PHDR_BYTES {
        return Err(format!(
            "program headers of {phentsize} bytes (not {PHDR_BYTES})"
        ));
    }
    match phoff.checked_add(phnum * PHDR_BYTES) {
        Some(end) if end <= len => Ok((phoff, phnum)),
        _ => Err(format!(
            "truncated: its {phnum} program headers at offset {phoff} end past its {len} bytes"
        )),
    }
}

/// Whether every segment the program headers `table` describe (`p_offset + p_filesz`) lies
/// inside a file of `len` bytes.
fn elf_segments_fit(table: &[u8], len: u64) -> Result<(), String> {
    for (i, ph) in table.chunks_exact(PHDR_BYTES as usize).enumerate() {
        let u64_at = |o: usize| u64::from_le_bytes(ph[o..o + 8].try_into().unwrap_or_default());
        let (offset, filesz) = (u64_at(8), u64_at(0x20));
        if filesz == 0 {
            continue;
        }
        match offset.checked_add(filesz) {
            Some(end) if end <= len => {}
            _ => {
                return Err(format!(
                    "truncated: segment {i} needs bytes {offset}..{} but the file has {len}",
                    offset.saturating_add(filesz)
                ));
            }
        }
    }
    Ok(())
}

fn load() -> Result<RealLib, String> {
    let state = crate::init::state();
    // A value the configuration refused is still an explicit choice: nothing else replaces it.
    if let Some(p) = state
        .config
        .problems
        .iter()
        .find(|p| p.variable == "FLASHCOMM_NCCL_LIB")
    {
        return Err(format!(
            "no usable real NCCL library: {p}. When FLASHCOMM_NCCL_LIB is set it is the only \
             candidate (an explicit choice is never replaced by a library found elsewhere); set \
             it to the path of the real libnccl.so.2"
        ));
    }
    let me = own_image();
    let inputs = Inputs {
        configured: state.config.settings.nccl_lib.as_ref().map(|p| p.0.clone()),
        loaded: loaded_objects(),
        ld_library_path: std::env::var("LD_LIBRARY_PATH").ok(),
        cuda_home: std::env::var("CUDA_HOME").ok(),
    };
    let mut tried = Vec::new();
    for c in discovery::candidates(&inputs) {
        match try_open(&c, &me) {
            Ok(lib) => {
                log_choice(&lib, &me, &tried);
                return Ok(lib);
            }
            Err(why) => tried.push(format!(
                "{} [{}]: {why}",
                c.path.display(),
                c.origin.describe()
            )),
        }
    }
    Err(format!(
        "no usable real NCCL library found (flashcomm forwards to the real libnccl.so.2 and does \
         not contain NCCL itself). Tried: {}. Set FLASHCOMM_NCCL_LIB to the path of the real \
         libnccl.so.2",
        tried.join("; ")
    ))
}

fn log_choice(lib: &RealLib, me: &OwnImage, tried: &[String]) {
    let ours = me
        .path
        .as_deref()
        .unwrap_or(Path::new("?"))
        .display()
        .to_string();
    logging::info(
        Subsys::Init,
        &format!(
            "using the real NCCL {} at {} (found via {}); flashcomm is {ours}",
            version_string(lib.version),
            lib.path.display(),
            lib.origin.describe()
        ),
    );
    for t in tried {
        logging::info(Subsys::Init, &format!("skipped {t}"));
    }
    logging::version_banner(&format!(
        "flashcomm {} (NCCL API {HEADER_VERSION}) forwarding to NCCL {}",
        env!("CARGO_PKG_VERSION"),
        version_string(lib.version)
    ));
    if lib.version < flashcomm_nccl_sys::HEADER_VERSION_CODE {
        logging::info(
            Subsys::Init,
            &format!(
                "the real NCCL {} is older than the NCCL {HEADER_VERSION} API flashcomm exports; \
                 functions it lacks fail with ncclInvalidUsage",
                version_string(lib.version)
            ),
        );
    }
}

/// Pointer to a NUL-terminated string owned by the real library, from its `ncclGetLastError`.
pub(crate) fn real_last_error(comm: flashcomm_nccl_sys::ncclComm_t) -> Option<*const c_char> {
    static SLOT: Slot = Slot::new(c"ncclGetLastError");
    loaded()?;
    let p = SLOT.get().ok()?;
    // SAFETY: `p` is the real library's ncclGetLastError, declared in nccl.h as
    // `const char* ncclGetLastError(ncclComm_t)`.
    let f = unsafe {
        std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(flashcomm_nccl_sys::ncclComm_t) -> *const c_char,
        >(p)
    };
    // SAFETY: the caller's communicator is passed unchanged; NCCL ignores it or reads it as its own.
    let s = unsafe { f(comm) };
    (!s.is_null()).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(phoff: u64, phnum: u16) -> Vec<u8> {
        let mut h = vec![0u8; ELF_HEADER_BYTES];
        h[..4].copy_from_slice(ELF_MAGIC);
        h[4] = 2;
        h[5] = 1;
        h[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        h[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        h[0x38..0x3a].copy_from_slice(&phnum.to_le_bytes());
        h
    }

    fn segment(offset: u64, filesz: u64) -> Vec<u8> {
        let mut p = vec![0u8; 56];
        p[8..16].copy_from_slice(&offset.to_le_bytes());
        p[0x20..0x28].copy_from_slice(&filesz.to_le_bytes());
        p
    }

    #[test]
    fn elf_headers_are_checked_against_the_file_size() {
        assert_eq!(elf_program_headers(&header(64, 2), 176), Ok((64, 2)));
        assert!(
            elf_program_headers(&header(64, 2), 175)
                .unwrap_err()
                .starts_with("truncated")
        );
        assert!(elf_program_headers(&header(u64::MAX, 2), 1 << 20).is_err());
        assert!(
            elf_program_headers(b"INPUT(x)", 8)
                .unwrap_err()
                .starts_with("not an ELF")
        );
        assert!(
            elf_program_headers(b"", 0)
                .unwrap_err()
                .starts_with("not an ELF")
        );
        assert!(
            elf_program_headers(&header(64, 2)[..20], 20)
                .unwrap_err()
                .starts_with("truncated")
        );
        let mut h32 = header(64, 2);
        h32[4] = 1;
        assert!(
            elf_program_headers(&h32, 1000)
                .unwrap_err()
                .contains("64-bit")
        );
        assert!(elf_program_headers(&header(64, 0), 1000).is_err());
    }

    #[test]
    fn every_segment_must_lie_inside_the_file() {
        let table = [segment(0, 4096), segment(4096, 100), segment(9999, 0)].concat();
        assert_eq!(elf_segments_fit(&table, 4196), Ok(()));
        let e = elf_segments_fit(&table, 4195).unwrap_err();
        assert_eq!(
            e,
            "truncated: segment 1 needs bytes 4096..4196 but the file has 4195"
        );
        assert!(elf_segments_fit(&segment(u64::MAX, 2), u64::MAX).is_err());
    }
}
