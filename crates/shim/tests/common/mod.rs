//! Helpers of the shim's integration tests: the built library, the real one, child processes,
//! and a thin typed view of the C API.
#![allow(dead_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// `ncclResult_t` values used by the tests.
pub const SUCCESS: c_int = 0;
pub const SYSTEM_ERROR: c_int = 2;
pub const INTERNAL_ERROR: c_int = 3;
pub const INVALID_ARGUMENT: c_int = 4;
pub const INVALID_USAGE: c_int = 5;

/// The cdylib built by this `cargo test` (target/<profile>/deps/libnccl.so, next to the test
/// binary; or target/<profile>/libnccl.so after `cargo build`).
pub fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps folder");
    for p in [
        deps.join("libnccl.so"),
        deps.parent().unwrap().join("libnccl.so"),
    ] {
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "the built libnccl.so was not found next to {}",
        exe.display()
    );
}

/// The real NCCL the tests forward to: `$FLASHCOMM_NCCL_LIB`.
pub fn real_lib() -> PathBuf {
    match std::env::var_os("FLASHCOMM_NCCL_LIB") {
        Some(p) if Path::new(&p).is_file() => PathBuf::from(p),
        Some(p) => panic!(
            "FLASHCOMM_NCCL_LIB={} does not exist: run ci/setup.sh, then source .toolchain/env.sh",
            Path::new(&p).display()
        ),
        None => panic!(
            "FLASHCOMM_NCCL_LIB is not set; these tests need the real libnccl.so.2: run \
             ci/setup.sh, then `source .toolchain/env.sh` before `cargo test`"
        ),
    }
}

/// A scratch folder for this test process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles a C file into a shared library (once per process and output).
pub fn build_shared(src: &Path, out: &Path, extra: &[&str]) {
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(out)
        .arg(src)
        .args(extra)
        .status()
        .expect("a C compiler `cc` is needed by the tests");
    assert!(status.success(), "cc failed for {}", src.display());
}

/// The fake "older real NCCL" (tests/fake/fake_nccl.c), built once per test process.
pub fn fake_lib() -> PathBuf {
    static FAKE: OnceLock<PathBuf> = OnceLock::new();
    FAKE.get_or_init(|| {
        let dir = scratch("fake-nccl");
        let out = dir.join("libnccl.so.2");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake/fake_nccl.c");
        build_shared(&src, &out, &["-Wl,-soname,libnccl.so.2"]);
        out
    })
    .clone()
}

/// The environment variable that selects a child's scenario.
pub const CHILD: &str = "FLASHCOMM_TEST_CHILD";

/// Whether this process is the child running scenario `name`.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD).as_deref() == Ok(name)
}

/// Re-runs test `name` of this binary in a child process with a changed environment: `set`
/// adds variables, `unset` removes them (every `FLASHCOMM_*` and `NCCL_DEBUG*` variable of the
/// parent is removed unless set again). Returns the output; panics with it if the child failed.
pub fn run_child(name: &str, set: &[(&str, &str)], unset: &[&str]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]);
    for (k, _) in std::env::vars() {
        if (k.starts_with("FLASHCOMM_")
            && k != "FLASHCOMM_NCCL_HOME"
            && k != "FLASHCOMM_CUDA_INCLUDE")
            || k.starts_with("NCCL_")
        {
            cmd.env_remove(&k);
        }
    }
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in set {
        cmd.env(k, v);
    }
    cmd.env(CHILD, name);
    let out = cmd.output().expect("re-run the test binary");
    let text = format!(
        "--- child {name} stdout:\n{}\n--- stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "child {name} failed ({:?})\n{text}",
        out.status
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "child {name} ran no test\n{text}"
    );
    out
}

/// Standard error of a child as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A `dlopen` handle.
pub struct Lib {
    handle: *mut c_void,
    pub path: PathBuf,
}

// SAFETY: a dlopen handle may be used from any thread; dlsym is thread-safe.
unsafe impl Send for Lib {}
// SAFETY: see above.
unsafe impl Sync for Lib {}

impl Lib {
    /// Opens `path` with `RTLD_NOW | RTLD_LOCAL`.
    pub fn open(path: &Path) -> Lib {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid C string naming a file by path.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a valid C string after a failed dlopen.
            let e = unsafe { CStr::from_ptr(libc::dlerror()) };
            panic!("dlopen {}: {}", path.display(), e.to_string_lossy());
        }
        Lib {
            handle,
            path: path.to_path_buf(),
        }
    }

    /// The address of symbol `name`, or null.
    pub fn addr(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).unwrap();
        // SAFETY: the handle is open and `c` is a valid C string.
        unsafe { libc::dlsym(self.handle, c.as_ptr()) }
    }

    /// Symbol `name` as a value of type `F` (a function pointer type of the right signature).
    pub fn get<F: Copy>(&self, name: &str) -> F {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let p = self.addr(name);
        assert!(!p.is_null(), "{} has no symbol {name}", self.path.display());
        // SAFETY: F is pointer-sized (asserted) and the caller names the symbol's true type.
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
    }

    /// An `int` global of the library.
    pub fn int(&self, name: &str) -> c_int {
        let p = self.addr(name).cast::<c_int>();
        assert!(!p.is_null(), "no {name}");
        // SAFETY: the symbol is an `int` variable of the library (the caller knows).
        unsafe { p.read_volatile() }
    }

    /// Sets an `int` global of the library.
    pub fn set_int(&self, name: &str, v: c_int) {
        let p = self.addr(name).cast::<c_int>();
        assert!(!p.is_null(), "no {name}");
        // SAFETY: the symbol is an `int` variable of the library (the caller knows); the tests
        // run one thread.
        unsafe { p.write_volatile(v) }
    }

    /// A NUL-terminated `char[]` global of the library.
    pub fn text(&self, name: &str) -> String {
        let p = self.addr(name).cast::<c_char>();
        assert!(!p.is_null(), "no {name}");
        // SAFETY: the symbol is a NUL-terminated character array of the library.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// A pointer global of the library.
    pub fn ptr(&self, name: &str) -> usize {
        let p = self.addr(name).cast::<usize>();
        assert!(!p.is_null(), "no {name}");
        // SAFETY: the symbol is a pointer variable of the library (the caller knows).
        unsafe { p.read_volatile() }
    }
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type StrFn = unsafe extern "C" fn(c_int) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type AllReduceFn = unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
type AllReduceConfigFn =
    unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize, usize) -> c_int;
type CommFn = unsafe extern "C" fn(usize) -> c_int;
type CommIntFn = unsafe extern "C" fn(usize, *mut c_int) -> c_int;

/// Stats as `include/flashcomm.h` lays them out.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub calls: [[u64; 8]; 3],
    pub bytes: [[u64; 8]; 3],
}

/// Typed calls into an NCCL library (ours or the real one). Pointers are passed as addresses,
/// exactly as a C caller would pass them; the tests pass null, or values the library under
/// test never dereferences (its checks fail first, or the fake library ignores them).
pub struct Nccl {
    pub lib: Lib,
}

fn cstr(p: *const c_char) -> String {
    assert!(!p.is_null(), "NULL string");
    // SAFETY: the library returns NUL-terminated strings that stay valid until the next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Nccl {
    pub fn open(path: &Path) -> Nccl {
        Nccl {
            lib: Lib::open(path),
        }
    }

    /// `ncclGetVersion` (or the `p` twin with `prefix = "p"`).
    pub fn version(&self) -> (c_int, c_int) {
        let f: GetVersionFn = self.lib.get("ncclGetVersion");
        let mut v = 0;
        // SAFETY: `v` is a valid out pointer.
        let rc = unsafe { f(&mut v) };
        (rc, v)
    }

    pub fn error_string(&self, code: c_int) -> String {
        let f: StrFn = self.lib.get("ncclGetErrorString");
        // SAFETY: any int is a valid argument.
        cstr(unsafe { f(code) })
    }

    pub fn last_error(&self) -> String {
        let f: LastErrorFn = self.lib.get("ncclGetLastError");
        // SAFETY: NULL is a valid communicator argument for ncclGetLastError.
        cstr(unsafe { f(std::ptr::null_mut()) })
    }

    /// `ncclAllReduce` (or `name`, one of its twins) with addresses.
    pub fn all_reduce_named(
        &self,
        name: &str,
        send: usize,
        recv: usize,
        count: usize,
        dt: c_int,
        op: c_int,
        comm: usize,
    ) -> c_int {
        let f: AllReduceFn = self.lib.get(name);
        // SAFETY: see the type's documentation.
        unsafe { f(send, recv, count, dt, op, comm, 0) }
    }

    pub fn all_reduce(
        &self,
        send: usize,
        recv: usize,
        count: usize,
        dt: c_int,
        op: c_int,
        comm: usize,
    ) -> c_int {
        self.all_reduce_named("ncclAllReduce", send, recv, count, dt, op, comm)
    }

    pub fn all_reduce_config(
        &self,
        count: usize,
        dt: c_int,
        op: c_int,
        comm: usize,
        config: usize,
    ) -> c_int {
        let f: AllReduceConfigFn = self.lib.get("ncclAllReduceConfig");
        // SAFETY: see the type's documentation.
        unsafe { f(0x1000, 0x2000, count, dt, op, comm, 0, config) }
    }

    pub fn comm_call(&self, name: &str, comm: usize) -> c_int {
        let f: CommFn = self.lib.get(name);
        // SAFETY: see the type's documentation.
        unsafe { f(comm) }
    }

    pub fn comm_int(&self, name: &str, comm: usize) -> (c_int, c_int) {
        let f: CommIntFn = self.lib.get(name);
        let mut v = -7;
        // SAFETY: `v` is a valid out pointer; see the type's documentation for `comm`.
        let rc = unsafe { f(comm, &mut v) };
        (rc, v)
    }

    /// `flashcommGetStats`.
    pub fn stats(&self, comm: usize) -> (c_int, Stats) {
        let f: unsafe extern "C" fn(usize, *mut Stats) -> c_int = self.lib.get("flashcommGetStats");
        let mut s = Stats::default();
        // SAFETY: `s` is a valid out pointer of the header's layout.
        let rc = unsafe { f(comm, &mut s) };
        (rc, s)
    }

    /// `flashcommGetConfigString`.
    pub fn config_string(&self) -> String {
        let f: unsafe extern "C" fn(*mut c_char, usize) -> c_int =
            self.lib.get("flashcommGetConfigString");
        let mut buf = vec![0 as c_char; 8192];
        // SAFETY: `buf` has the length passed.
        let rc = unsafe { f(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(rc, SUCCESS);
        cstr(buf.as_ptr())
    }
}

/// The real library's version, from the real library opened directly.
pub fn real_version() -> c_int {
    static V: OnceLock<c_int> = OnceLock::new();
    *V.get_or_init(|| {
        let real = Nccl::open(&real_lib());
        let (rc, v) = real.version();
        assert_eq!(rc, SUCCESS);
        v
    })
}

/// A handle that is not a communicator but that NCCL can read without faulting: 64 MiB of
/// zeroed memory (NCCL answers "corrupted comm object detected"). One per process, never freed.
pub fn foreign_handle() -> usize {
    static H: OnceLock<usize> = OnceLock::new();
    *H.get_or_init(|| {
        // SAFETY: an anonymous private mapping; no file, no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                64 << 20,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        p as usize
    })
}

/// The arguments of a collective export (`ncclAllReduce`, ..., `ncclSend`, `ncclRecv`, and the
/// `*Config` forms), as addresses and integers, exactly as a C caller passes them. Fields a
/// function does not take are ignored (`root` is broadcast's and reduce's root, the peer of
/// send and receive; `send` is the one buffer of `ncclBcast` and `ncclSend`, `recv` that of
/// `ncclRecv`).
#[derive(Debug, Clone, Copy)]
pub struct CollArgs {
    pub send: usize,
    pub recv: usize,
    pub count: usize,
    pub dt: c_int,
    pub op: c_int,
    pub root: c_int,
    pub comm: usize,
    pub stream: usize,
    pub config: usize,
}

impl CollArgs {
    /// One float32 sum of one element on `comm`, with non-null buffers.
    pub fn on(comm: usize) -> CollArgs {
        CollArgs {
            send: 0x1000,
            recv: 0x2000,
            count: 1,
            dt: 7,
            op: 0,
            root: 0,
            comm,
            stream: 0,
            config: 0,
        }
    }
}

/// Every collective export of the NCCL API (`ncclX` form): those of flashcomm's collective kinds,
/// and the rooted Gather and Scatter, which flashcomm only forwards.
pub fn collective_exports() -> Vec<&'static str> {
    flashcomm_codec::Collective::ALL
        .iter()
        .flat_map(|k| k.exports().iter().copied())
        .chain(["ncclGather", "ncclScatter"])
        .collect()
}

/// Calls the collective export `name` (or its `pncclX` twin) of `lib` with `a`.
pub fn call_collective(lib: &Lib, name: &str, a: &CollArgs) -> c_int {
    type Reducing = unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
    type ReducingConfig =
        unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize, usize) -> c_int;
    type Moving = unsafe extern "C" fn(usize, usize, usize, c_int, usize, usize) -> c_int;
    type MovingConfig =
        unsafe extern "C" fn(usize, usize, usize, c_int, usize, usize, usize) -> c_int;
    type Rooted = unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize) -> c_int;
    type RootedConfig =
        unsafe extern "C" fn(usize, usize, usize, c_int, c_int, usize, usize, usize) -> c_int;
    type Reduce =
        unsafe extern "C" fn(usize, usize, usize, c_int, c_int, c_int, usize, usize) -> c_int;
    type ReduceConfig = unsafe extern "C" fn(
        usize,
        usize,
        usize,
        c_int,
        c_int,
        c_int,
        usize,
        usize,
        usize,
    ) -> c_int;
    type OneBuffer = unsafe extern "C" fn(usize, usize, c_int, c_int, usize, usize) -> c_int;
    let base = name.strip_prefix('p').unwrap_or(name);
    // SAFETY: in every arm, `name` is looked up in `lib` and called with the signature nccl.h
    // declares for it; the addresses are the test's to choose, as a C caller's are.
    unsafe {
        match base {
            "ncclAllReduce" | "ncclReduceScatter" => {
                lib.get::<Reducing>(name)(a.send, a.recv, a.count, a.dt, a.op, a.comm, a.stream)
            }
            "ncclAllReduceConfig" | "ncclReduceScatterConfig" => lib.get::<ReducingConfig>(name)(
                a.send, a.recv, a.count, a.dt, a.op, a.comm, a.stream, a.config,
            ),
            "ncclAllGather" | "ncclAlltoAll" => {
                lib.get::<Moving>(name)(a.send, a.recv, a.count, a.dt, a.comm, a.stream)
            }
            "ncclAllGatherConfig" | "ncclAlltoAllConfig" => lib.get::<MovingConfig>(name)(
                a.send, a.recv, a.count, a.dt, a.comm, a.stream, a.config,
            ),
            "ncclBroadcast" | "ncclGather" | "ncclScatter" => {
                lib.get::<Rooted>(name)(a.send, a.recv, a.count, a.dt, a.root, a.comm, a.stream)
            }
            "ncclBroadcastConfig" => lib.get::<RootedConfig>(name)(
                a.send, a.recv, a.count, a.dt, a.root, a.comm, a.stream, a.config,
            ),
            "ncclReduce" => lib.get::<Reduce>(name)(
                a.send, a.recv, a.count, a.dt, a.op, a.root, a.comm, a.stream,
            ),
            "ncclReduceConfig" => lib.get::<ReduceConfig>(name)(
                a.send, a.recv, a.count, a.dt, a.op, a.root, a.comm, a.stream, a.config,
            ),
            "ncclBcast" | "ncclSend" => {
                lib.get::<OneBuffer>(name)(a.send, a.count, a.dt, a.root, a.comm, a.stream)
            }
            "ncclRecv" => {
                lib.get::<OneBuffer>(name)(a.recv, a.count, a.dt, a.root, a.comm, a.stream)
            }
            other => panic!("{other} is not a collective export"),
        }
    }
}
