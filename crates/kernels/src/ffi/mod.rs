//! CUDA driver calls: module loading, function lookup and kernel launch.
//!
//! Every `unsafe` block of the crate is here (this module and its children), each with the reason
//! it is sound.

pub mod codec;

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

use crate::Error;

/// Converts a driver result into this crate's error.
pub(crate) fn check(r: sys::CUresult, during: &'static str) -> Result<(), Error> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            during,
            detail: format!("{r:?}"),
        })
    }
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the driver library by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// A kernel entry point in a loaded module.
#[derive(Clone, Copy, Debug)]
pub struct Function(sys::CUfunction);

// SAFETY: a CUfunction is an immutable handle owned by its module, which lives as long as the
// process (modules are never unloaded); the driver API is thread-safe.
unsafe impl Send for Function {}
// SAFETY: as above; the handle is only passed by value to the driver.
unsafe impl Sync for Function {}

impl Function {
    /// The raw handle.
    pub fn raw(&self) -> sys::CUfunction {
        self.0
    }

    /// Allows launches with up to `bytes` of dynamic shared memory (needed above 48 KiB).
    pub fn set_max_dynamic_smem(&self, bytes: u32) -> Result<(), Error> {
        // SAFETY: `self.0` is a valid function handle; the attribute takes a plain integer.
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    self.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
            "setting the dynamic shared memory limit",
        )
    }

    /// How many blocks of `threads` threads fit on one multiprocessor at once.
    pub fn max_active_blocks_per_sm(&self, threads: u32, smem: usize) -> Result<u32, Error> {
        let mut n: i32 = 0;
        // SAFETY: `self.0` is a valid function handle; `n` is a valid out-pointer.
        let r = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.0, threads as i32, smem)
        };
        check(r, "querying occupancy")?;
        Ok(n.max(0) as u32)
    }
}

/// Every embedded module loaded into one CUDA context; functions are looked up by name on first
/// use and cached.
pub struct Kernels {
    modules: Vec<(&'static str, Module)>,
    functions: Mutex<HashMap<String, Function>>,
}

#[derive(Clone, Copy)]
struct Module(sys::CUmodule);

// SAFETY: a CUmodule handle is never unloaded (modules live for the process) and the driver API is
// thread-safe.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Kernels {
    /// Loads (once per context, then cached) every embedded module into `ctx`, which must be
    /// current on the calling thread.
    pub fn for_context(ctx: sys::CUcontext) -> Result<Arc<Kernels>, Error> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        if !crate::built_with_kernels() {
            return Err(Error::NoKernels);
        }
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&(ctx as usize)) {
            return Ok(k.clone());
        }
        let mut modules = Vec::new();
        for (name, embedded) in crate::image::IMAGES {
            let bytes = crate::image_bytes(name, embedded)?;
            let mut module: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: `bytes` is a complete fatbin image (embedded at build time or read from the
            // kernel folder) that stays alive during the call, which copies what it needs;
            // `module` is a valid out-pointer; the caller made the context current.
            let r = unsafe { sys::cuModuleLoadData(&mut module, bytes.as_ptr() as *const c_void) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Cuda {
                    during: "loading a kernel module",
                    detail: format!("{name}: {r:?}"),
                });
            }
            // The collective modules are loaded completely now. With the driver's lazy loading
            // (the default since CUDA 12.2) a kernel's first launch loads it, which can wait for
            // the kernels already running in the context; a rank whose first launch waits behind
            // peers that spin waiting for that very rank would deadlock until the timeout (seen
            // on the GPU with eight ranks in one process). The codec modules, which are never
            // launched while collectives spin, stay lazy (they are large).
            if !name.starts_with("codec") {
                load_all_functions(module);
            }
            // Modules stay loaded for the life of the process: kernels may still be in flight when
            // a communicator is dropped, and the driver may be gone at exit.
            modules.push((*name, Module(module)));
        }
        let k = Arc::new(Kernels {
            modules,
            functions: Mutex::new(HashMap::new()),
        });
        map.insert(ctx as usize, k.clone());
        Ok(k)
    }

    /// The function called `name`, from whichever module defines it.
    pub fn function(&self, name: &str) -> Result<Function, Error> {
        let mut fns = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = fns.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| Error::MissingKernel(name.to_string()))?;
        for (_, m) in &self.modules {
            let mut func: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `m` is a loaded module; `cname` is NUL-terminated; `func` is an out-pointer.
            let r = unsafe { sys::cuModuleGetFunction(&mut func, m.0, cname.as_ptr()) };
            if r == sys::CUresult::CUDA_SUCCESS {
                fns.insert(name.to_string(), Function(func));
                return Ok(Function(func));
            }
        }
        Err(Error::MissingKernel(name.to_string()))
    }

    /// Names of the loaded modules.
    pub fn modules(&self) -> Vec<&'static str> {
        self.modules.iter().map(|(n, _)| *n).collect()
    }
}

/// Forces every function of `module` to be loaded (best effort: drivers older than CUDA 12.4 lack
/// the calls, and there every function is loaded eagerly anyway unless lazy loading was asked for).
fn load_all_functions(module: sys::CUmodule) {
    let mut count: u32 = 0;
    // SAFETY: `module` was just loaded; `count` is an out-pointer.
    let r = unsafe { sys::cuModuleGetFunctionCount(&mut count, module) };
    if r != sys::CUresult::CUDA_SUCCESS || count == 0 {
        return;
    }
    let mut funcs: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); count as usize];
    // SAFETY: `funcs` has room for `count` handles; `module` is loaded.
    let r = unsafe { sys::cuModuleEnumerateFunctions(funcs.as_mut_ptr(), count, module) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return;
    }
    for f in funcs {
        // SAFETY: `f` is a function handle the driver just enumerated from a loaded module.
        let _ = unsafe { sys::cuFuncLoad(f) };
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory bytes.
    pub smem: u32,
}

/// Launches `f` with one by-value parameter struct.
///
/// # Safety
/// * `P` must be exactly the layout of the kernel's single parameter (a `#[repr(C)]` mirror whose
///   size and offsets are asserted against the CUDA header).
/// * Every device pointer inside `params` must stay valid until the kernel has finished.
/// * `stream` must belong to the context that is current on this thread.
pub unsafe fn launch<P>(
    f: Function,
    cfg: LaunchConfig,
    stream: sys::CUstream,
    params: &P,
) -> Result<(), Error> {
    let mut args = [params as *const P as *mut c_void];
    // SAFETY: the caller guarantees the parameter layout and pointer lifetimes; the driver copies
    // the parameter bytes at launch (and into the graph node when capturing).
    let r = unsafe {
        sys::cuLaunchKernel(
            f.0,
            cfg.grid,
            1,
            1,
            cfg.block,
            1,
            1,
            cfg.smem,
            stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    check(r, "launching a kernel")
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_cuda_source_is_embedded() {
        if !crate::built_with_kernels() {
            eprintln!("built without kernels (no nvcc): nothing to check");
            return;
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cuda");
        let mut sources: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.path()
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .filter(|_| e.path().extension().is_some_and(|x| x == "cu"))
            })
            .collect();
        sources.sort();
        let mut embedded = crate::module_names();
        embedded.sort();
        assert_eq!(embedded, sources);
        for (_, img) in crate::image::IMAGES
            .iter()
            .filter(|(_, img)| !img.is_empty())
        {
            assert!(img.len() > 1000, "suspiciously small image");
            assert_eq!(img.as_ptr() as usize % 16, 0, "image not 16-byte aligned");
        }
    }
}
