//! What flashcomm's tests and benchmarks need and the product must not carry.
//!
//! * The test-only CUDA modules of `cuda/testing/` (device-side verification, the codec's
//!   buffer-to-buffer kernels), compiled by the top-level `build.rs` for this crate and loaded
//!   into a context beside the product's modules by [`TestKernels`]. The shipped `libnccl.so`
//!   links `flashcomm-kernels` only, so it embeds none of them.
//! * [`reference`]: the plain reference AllReduce that decode-size latency is measured against.
//! * [`pull_reference`]: the pull reference AllReduce (the design of vLLM's and SGLang's custom
//!   all-reduce, written clean-room), a competitor measured beside flashcomm; [`peer_buffers`]:
//!   the buffers its ranks registered with each other.
//! * [`verify`]: integer-valued inputs and their exact collective results, checked on the device.
//! * [`codec`]: launchers of the codec kernels over device buffers, for the codec's GPU tests and
//!   its benchmark.
//! * [`FileBootstrap`]: rank processes of one machine meeting through a folder.
//!
//! A dev-only crate: the product's crates never depend on it (tools and tests do).
#![deny(unsafe_code)]

pub mod codec;
mod codec_launch;
mod file_bootstrap;
pub mod peer_buffers;
pub mod pull_reference;
pub mod reference;
pub mod verify;

pub use file_bootstrap::{FileBootstrap, private_folder};

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

use flashcomm_gpu::{Function, Module};
use flashcomm_kernels::Error;

/// The embedded test modules.
pub mod image {
    /// Forces 16-byte alignment of an embedded image.
    #[repr(C, align(16))]
    pub struct Aligned<T: ?Sized>(pub T);

    include!(concat!(env!("OUT_DIR"), "/images.rs"));
}

/// Names of the embedded test modules (one per `cuda/testing/*.cu`).
pub fn module_names() -> Vec<&'static str> {
    image::IMAGES.iter().map(|(n, _, _)| *n).collect()
}

/// The test modules loaded into one CUDA context (once per context, then shared).
pub struct TestKernels {
    modules: Vec<Module>,
    /// Functions already looked up, by name. Looking a name up in a lazily loaded module (the
    /// codec modules) can make the driver load it, which waits for every kernel running in the
    /// context: with virtual ranks, kernels that spin waiting for this very rank. So each name is
    /// looked up once, before collectives run, and served from here afterwards.
    found: Mutex<HashMap<String, Function>>,
}

impl TestKernels {
    /// Loads every test module into `ctx`, which must be current on the calling thread.
    pub fn for_context(ctx: cudarc::driver::sys::CUcontext) -> Result<Arc<TestKernels>, Error> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<TestKernels>>>> = OnceLock::new();
        if image::IMAGES.is_empty() {
            return Err(Error::NoKernels);
        }
        if !flashcomm_gpu::driver_present() {
            return Err(Error::Cuda(flashcomm_gpu::Error::NoDriver));
        }
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&(ctx as usize)) {
            return Ok(k.clone());
        }
        // The verification module first: it is loaded completely (it runs while collectives of
        // other ranks spin, and a lazy first load can wait behind them), and its kernels are
        // found without touching the codec modules, which never run beside collectives and stay
        // lazy (they are large).
        let mut images: Vec<_> = image::IMAGES.iter().collect();
        images.sort_by_key(|(name, _, _)| name.starts_with("codec"));
        let mut modules = Vec::new();
        for (name, embedded, digest) in images {
            let bytes = flashcomm_kernels::image_bytes(name, embedded, *digest)?;
            modules.push(Module::load(&bytes, !name.starts_with("codec"))?);
        }
        let k = Arc::new(TestKernels {
            modules,
            found: Mutex::new(HashMap::new()),
        });
        map.insert(ctx as usize, k.clone());
        Ok(k)
    }

    /// The test kernel called `name` (looked up in the modules once, then remembered).
    pub fn function(&self, name: &str) -> Result<Function, Error> {
        let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = found.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| Error::MissingKernel(name.to_string()))?;
        let f = self
            .modules
            .iter()
            .find_map(|m| m.function(&cname))
            .ok_or_else(|| Error::MissingKernel(name.to_string()))?;
        found.insert(name.to_string(), f);
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_test_source_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cuda/testing");
        let mut sources: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "cu"))
            .filter_map(|e| {
                e.path()
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
            })
            .collect();
        sources.sort();
        let mut embedded = super::module_names();
        embedded.sort();
        if super::image::IMAGES.is_empty() {
            flashcomm_config::testing::skipped(
                "testkit: every_test_source_is_embedded",
                "built without kernels (nvcc was not found)",
            );
            return;
        }
        assert_eq!(embedded, sources);
    }
}
