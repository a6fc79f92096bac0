//! The product's modules in a context: loading them (through `flashcomm-gpu`), resolving the
//! catalogue into a table, and the launch of a catalogue kernel.
//!
//! The crate's only `unsafe` block is here (the launch), with the reason it is sound.

use std::collections::HashMap;
use std::ffi::CString;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use flashcomm_gpu::Module;
use flashcomm_gpu::process::PerProcess;
pub use flashcomm_gpu::{Function, LaunchConfig, driver_present};

use crate::Error;
use crate::abi::{FcCollParams, FcProbeParams, FcReduceParams, KernelParams};
use crate::catalog::{self, Algorithm, DType, Protocol, QuantOp};

impl From<flashcomm_gpu::Error> for Error {
    fn from(e: flashcomm_gpu::Error) -> Self {
        Error::Cuda(e)
    }
}

/// A kernel of the [catalogue](crate::catalog), tied to the one parameter type it takes.
#[derive(Debug)]
pub struct Kernel<P> {
    index: usize,
    _params: PhantomData<fn(&P)>,
}

impl<P> Clone for Kernel<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for Kernel<P> {}

impl Kernel<FcCollParams> {
    /// The lossless AllReduce kernel.
    pub const fn allreduce(algo: Algorithm, proto: Protocol, t: DType) -> Self {
        Kernel::at(catalog::allreduce(algo, proto, t))
    }

    /// The lossless ReduceScatter kernel.
    pub const fn reducescatter(proto: Protocol, t: DType) -> Self {
        Kernel::at(catalog::reducescatter(proto, t))
    }

    /// The AllGather kernel.
    pub const fn allgather(proto: Protocol) -> Self {
        Kernel::at(catalog::allgather(proto))
    }

    /// The AllToAll kernel.
    pub const fn alltoall(proto: Protocol) -> Self {
        Kernel::at(catalog::alltoall(proto))
    }

    /// The one-shot quantized AllReduce kernel at `bits`, if it exists.
    pub const fn quant_oneshot(t: DType, bits: u8) -> Option<Self> {
        match catalog::quant_oneshot(t, bits) {
            Some(i) => Some(Kernel::at(i)),
            None => None,
        }
    }

    /// The quantized AllGather, AllToAll or ReduceScatter kernel at `bits`, if it exists.
    pub const fn quant_op(op: QuantOp, t: DType, bits: u8) -> Option<Self> {
        match catalog::quant_op(op, t, bits) {
            Some(i) => Some(Kernel::at(i)),
            None => None,
        }
    }

    /// The two-step quantized AllReduce kernel, if it exists for these widths.
    pub const fn quant_twostep(t: DType, rs_bits: u8, ag_bits: u8) -> Option<Self> {
        match catalog::quant_twostep(t, rs_bits, ag_bits) {
            Some(i) => Some(Kernel::at(i)),
            None => None,
        }
    }
}

impl Kernel<FcProbeParams> {
    /// The set-up probe.
    pub const fn probe() -> Self {
        Kernel::at(catalog::probe())
    }
}

impl Kernel<FcReduceParams> {
    /// The copy-engine schedule's reduction of type `t`.
    pub const fn copy_reduce(t: DType) -> Self {
        Kernel::at(catalog::copy_reduce(t))
    }
}

impl<P> Kernel<P> {
    const fn at(index: usize) -> Self {
        Kernel {
            index,
            _params: PhantomData,
        }
    }

    /// Index in the catalogue.
    pub const fn index(self) -> usize {
        self.index
    }
}

/// Every embedded module loaded into one CUDA context, and every kernel of the
/// [catalogue](crate::catalog) resolved once, at load: a launch indexes a table.
pub struct Kernels {
    modules: Vec<(&'static str, Module)>,
    table: Box<[Function]>,
}

impl Kernels {
    /// Loads (once per context, then cached) every embedded module into `ctx`, which must be
    /// current on the calling thread, and resolves the catalogue.
    pub fn for_context(ctx: sys::CUcontext) -> Result<Arc<Kernels>, Error> {
        // Per process: a fork child never waits for a lock a parent's thread held at the fork.
        static CACHE: PerProcess<Mutex<HashMap<usize, Arc<Kernels>>>> =
            PerProcess::fresh_in_children();
        if !crate::built_with_kernels() {
            return Err(Error::NoKernels);
        }
        if !driver_present() {
            return Err(Error::Cuda(flashcomm_gpu::Error::NoDriver));
        }
        let cache = CACHE.get(|| Mutex::new(HashMap::new()));
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&(ctx as usize)) {
            return Ok(k.clone());
        }
        let mut modules = Vec::new();
        for (name, embedded, digest) in crate::image::IMAGES {
            let bytes = crate::image_bytes(name, embedded, *digest)?;
            // The collective modules are loaded completely now. With the driver's lazy loading
            // (the default since CUDA 12.2) a kernel's first launch loads it, which can wait for
            // the kernels already running in the context; a rank whose first launch waits behind
            // peers that spin waiting for that very rank would deadlock until the timeout (seen
            // on the GPU with eight ranks in one process). The codec modules, which are never
            // launched while collectives spin, stay lazy (they are large).
            let module = Module::load(&bytes, !name.starts_with("codec")).map_err(|e| match e {
                flashcomm_gpu::Error::Cuda { during, detail } => {
                    Error::Cuda(flashcomm_gpu::Error::Cuda {
                        during,
                        detail: format!("{name}: {detail}"),
                    })
                }
                other => other.into(),
            })?;
            // Modules stay loaded for the life of the process: kernels may still be in flight when
            // a communicator is dropped, and the driver may be gone at exit.
            modules.push((*name, module));
        }
        let mut table = Vec::with_capacity(catalog::COUNT);
        let mut name = String::new();
        for i in 0..catalog::COUNT {
            catalog::name(i, &mut name);
            table.push(find(&modules, &name)?);
        }
        let k = Arc::new(Kernels {
            modules,
            table: table.into_boxed_slice(),
        });
        map.insert(ctx as usize, k.clone());
        Ok(k)
    }

    /// The function of a catalogue kernel (an index into the table resolved at load).
    pub fn get<P>(&self, k: Kernel<P>) -> Function {
        self.table[k.index]
    }

    /// Launches catalogue kernel `k` with its parameter block; with `overlapped`, through
    /// [`flashcomm_gpu::launch_overlapped`] (programmatic stream serialization).
    ///
    /// # Safety
    /// Every device pointer inside `params` must stay valid until the kernel has finished, and
    /// `stream` must belong to the context that is current on this thread. (The parameter layout
    /// is right by construction: `k` is tied to `P`.) `overlapped` only for kernels that execute
    /// `griddepcontrol.wait` before their first memory access (the collective kernels).
    pub unsafe fn launch<P: KernelParams>(
        &self,
        k: Kernel<P>,
        cfg: LaunchConfig,
        stream: flashcomm_gpu::Stream,
        params: &P,
        overlapped: bool,
    ) -> Result<(), Error> {
        // SAFETY: `P` is the parameter type of kernel `k` (the catalogue ties them) and one of the
        // layout-asserted mirrors of `abi`; the caller upholds pointer lifetimes, the stream and
        // the wait that `overlapped` needs.
        unsafe {
            if overlapped {
                flashcomm_gpu::launch_overlapped(self.get(k), cfg, stream, params)
            } else {
                flashcomm_gpu::launch(self.get(k), cfg, stream, params)
            }
        }
        .map_err(Error::from)
    }

    /// The name of every kernel in the loaded modules.
    pub fn kernel_names(&self) -> Result<Vec<String>, Error> {
        let mut v = Vec::new();
        for (_, m) in &self.modules {
            v.extend(m.function_names()?);
        }
        v.sort();
        Ok(v)
    }

    /// Names of the loaded modules.
    pub fn modules(&self) -> Vec<&'static str> {
        self.modules.iter().map(|(n, _)| *n).collect()
    }
}

fn find(modules: &[(&'static str, Module)], name: &str) -> Result<Function, Error> {
    let cname = CString::new(name).map_err(|_| Error::MissingKernel(name.to_string()))?;
    modules
        .iter()
        .find_map(|(_, m)| m.function(&cname))
        .ok_or_else(|| Error::MissingKernel(name.to_string()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_cuda_source_is_embedded() {
        if !crate::built_with_kernels() {
            flashcomm_config::testing::skipped(
                "kernels: every_cuda_source_is_embedded",
                "built without kernels (nvcc was not found)",
            );
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
        for (_, img, _) in crate::image::IMAGES
            .iter()
            .filter(|(_, img, _)| !img.is_empty())
        {
            assert!(img.len() > 1000, "suspiciously small image");
            assert_eq!(img.as_ptr() as usize % 16, 0, "image not 16-byte aligned");
        }
    }
}
