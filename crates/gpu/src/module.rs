//! Loaded CUDA modules, their kernel entry points, and launches.

use std::ffi::{CStr, c_void};

use cudarc::driver::{result, sys};

use crate::{Error, Stream, check, cuda};

/// A module loaded into a context. Modules are never unloaded: kernels may still be in flight
/// when their users are dropped, and the driver may be gone at process exit.
#[derive(Clone, Copy, Debug)]
pub struct Module(sys::CUmodule);

// SAFETY: a CUmodule handle is never unloaded (modules live for the process) and the driver API is
// thread-safe.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads the fatbin (or cubin, or PTX) `image` into the context current on this thread. With
    /// `eager`, every function of the module is loaded now rather than at its first launch
    /// (the driver's lazy loading can make a first launch wait for kernels already running in
    /// the context, which deadlocks kernels that wait for each other).
    pub fn load(image: &[u8], eager: bool) -> Result<Module, Error> {
        // SAFETY: `image` is a complete module image that stays alive during the call, which
        // copies what it needs; the caller made a context current (the driver reports an error
        // otherwise).
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(cuda("loading a kernel module"))?;
        if eager {
            load_all_functions(module);
        }
        Ok(Module(module))
    }

    /// The kernel called `name`, if this module defines it.
    pub fn function(&self, name: &CStr) -> Option<Function> {
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `self.0` is a loaded module; `name` is NUL-terminated; `func` is an out-pointer.
        let r = unsafe { sys::cuModuleGetFunction(&mut func, self.0, name.as_ptr()) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(Function(func))
    }
}

impl Module {
    /// The names of every function the module defines.
    pub fn function_names(&self) -> Result<Vec<String>, Error> {
        let mut count: u32 = 0;
        // SAFETY: `self.0` is a loaded module; `count` is an out-pointer.
        let r = unsafe { sys::cuModuleGetFunctionCount(&mut count, self.0) };
        check(r, "counting a module's functions")?;
        let mut funcs: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); count as usize];
        // SAFETY: `funcs` has room for `count` handles; the module is loaded.
        let r = unsafe { sys::cuModuleEnumerateFunctions(funcs.as_mut_ptr(), count, self.0) };
        check(r, "listing a module's functions")?;
        let mut names = Vec::with_capacity(funcs.len());
        for f in funcs {
            let mut name: *const std::ffi::c_char = std::ptr::null();
            // SAFETY: `f` was just enumerated from a loaded module; `name` is an out-pointer.
            let r = unsafe { sys::cuFuncGetName(&mut name, f) };
            check(r, "naming a function")?;
            // SAFETY: the driver returns a NUL-terminated string owned by the module, which is
            // never unloaded.
            let n = unsafe { CStr::from_ptr(name) };
            names.push(n.to_string_lossy().into_owned());
        }
        Ok(names)
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
        unsafe {
            result::function::set_function_attribute(
                self.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(cuda("setting the dynamic shared memory limit"))
    }

    /// How many blocks of `threads` threads fit on one multiprocessor at once.
    pub fn max_active_blocks_per_sm(&self, threads: u32, smem: usize) -> Result<u32, Error> {
        // SAFETY: `self.0` is a valid function handle.
        let n = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(self.0, threads as i32, smem)
        }
        .map_err(cuda("querying occupancy"))?;
        Ok(n.max(0) as u32)
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
    stream: Stream,
    params: &P,
) -> Result<(), Error> {
    let mut args = [params as *const P as *mut c_void];
    // SAFETY: the caller guarantees the parameter layout and pointer lifetimes; the driver copies
    // the parameter bytes at launch (and into the graph node when capturing).
    unsafe {
        result::launch_kernel(
            f.0,
            (cfg.grid, 1, 1),
            (cfg.block, 1, 1),
            cfg.smem,
            stream.0,
            &mut args,
        )
    }
    .map_err(cuda("launching a kernel"))
}

/// Launches `f` like [`launch`], allowed to start before the previous work of `stream` has
/// finished (programmatic stream serialization, compute capability 9.0 and later): the launch
/// overhead then overlaps the tail of that work. The kernel must execute `griddepcontrol.wait`
/// before its first memory access, which waits until the previous work has completed and its
/// memory is visible: the result is the same as a plain launch. Captured into a graph, the edge
/// keeps this meaning.
///
/// # Safety
/// As [`launch`]; and the kernel must wait as described before touching memory.
pub unsafe fn launch_overlapped<P>(
    f: Function,
    cfg: LaunchConfig,
    stream: Stream,
    params: &P,
) -> Result<(), Error> {
    let mut args = [params as *const P as *mut c_void];
    // SAFETY: an all-zero attribute is a valid value of this plain C struct; the fields set
    // below are the ID and the union member that ID selects.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: cfg.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: cfg.smem,
        hStream: stream.0,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` outlive the call; the argument array holds one pointer to the
    // parameter struct, as for `launch`; the caller upholds the rest.
    unsafe { sys::cuLaunchKernelEx(&config, f.0, args.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(cuda("launching a kernel (programmatic serialization)"))
}
