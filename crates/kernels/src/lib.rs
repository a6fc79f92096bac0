//! The product's CUDA kernels, embedded as fatbins, and typed access to them.
//!
//! The top-level `build.rs` compiles every `cuda/*.cu` into one module image (fatbin with
//! sm_80/sm_90/sm_100 machine code and PTX for newer GPUs). This crate embeds those images and
//! loads them into a CUDA context on first use ([`Kernels`]), resolving every kernel of the
//! [`catalog`] once into a table, so that a launch is an index, not a name. It owns the kernels'
//! ABI ([`abi`]: constants and parameter layouts, the source of the generated
//! `cuda/include/flashcomm/params.h`) and ties each kernel to its parameter type ([`Kernel`]). It
//! makes no algorithmic decisions. Test-only kernels live in `flashcomm-testkit`, never here.
//!
//! The driver is reached through `flashcomm-gpu`; the launch of a catalogue kernel is the only
//! `unsafe` code here, in the [`ffi`] module.

pub mod abi;
pub mod catalog;
pub mod ffi;

pub use ffi::{Function, Kernel, Kernels, LaunchConfig};

/// The embedded module images.
pub mod image {
    /// Forces 16-byte alignment of an embedded image.
    #[repr(C, align(16))]
    pub struct Aligned<T: ?Sized>(pub T);

    include!(concat!(env!("OUT_DIR"), "/images.rs"));
}

/// FNV-1a of every CUDA source and header the kernels are built from (the kernel ABI, the
/// protocols, the CUDA codec): what two builds must share to run one communicator together.
pub const SOURCE_DIGEST: u64 = include!(concat!(env!("OUT_DIR"), "/source_digest.rs"));

/// Whether this build carries CUDA kernels (false when nvcc was unavailable at build time; every
/// collective then passes through to the real NCCL).
pub fn built_with_kernels() -> bool {
    !image::IMAGES.is_empty()
}

/// The fatbin of module `name`: from `$FLASHCOMM_KERNEL_DIR/<name>.fatbin` when that variable is
/// set (development and GPU test bundles), else the image embedded at build time. A blank value
/// is unset, as the configuration reads every empty variable (it never means the current folder).
pub fn image_bytes(
    name: &str,
    embedded: &'static [u8],
) -> Result<std::borrow::Cow<'static, [u8]>, Error> {
    image_from(
        std::env::var_os("FLASHCOMM_KERNEL_DIR").as_deref(),
        name,
        embedded,
    )
}

/// [`image_bytes`] with the folder given: `dir` is the value of `FLASHCOMM_KERNEL_DIR`.
fn image_from(
    dir: Option<&std::ffi::OsStr>,
    name: &str,
    embedded: &'static [u8],
) -> Result<std::borrow::Cow<'static, [u8]>, Error> {
    if let Some(dir) = dir.filter(|d| !d.to_string_lossy().trim().is_empty()) {
        let path = std::path::Path::new(&dir).join(format!("{name}.fatbin"));
        return std::fs::read(&path)
            .map(std::borrow::Cow::Owned)
            .map_err(|e| {
                Error::Cuda(flashcomm_gpu::Error::Cuda {
                    during: "reading a kernel image",
                    detail: format!("{}: {e}", path.display()),
                })
            });
    }
    if embedded.is_empty() {
        return Err(Error::NoKernels);
    }
    Ok(std::borrow::Cow::Borrowed(embedded))
}

/// Names of the embedded modules (one per `cuda/*.cu`).
pub fn module_names() -> Vec<&'static str> {
    image::IMAGES.iter().map(|(n, _)| *n).collect()
}

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The library was built without kernels.
    NoKernels,
    /// No CUDA driver library could be loaded, or a CUDA driver call failed: the one CUDA error
    /// type, [`flashcomm_gpu::Error`], wrapped.
    Cuda(flashcomm_gpu::Error),
    /// The named kernel is in none of the embedded modules.
    MissingKernel(String),
    /// A launcher refused its arguments (sizes, alignment, formats).
    InvalidArgument(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::NoKernels => write!(
                f,
                "this flashcomm build carries no CUDA kernels (nvcc was not found at build time)"
            ),
            Error::Cuda(e) => e.fmt(f),
            Error::MissingKernel(n) => write!(f, "kernel {n} is not in the embedded CUDA modules"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty (or blank) `FLASHCOMM_KERNEL_DIR` is unset, as the configuration reads every
    /// empty variable: the embedded images, never `<name>.fatbin` of the current folder.
    #[test]
    fn an_empty_kernel_dir_means_the_embedded_images() {
        // (Before, "" named the current folder: `m.fatbin` was read from wherever the process ran.)
        for d in ["", " ", "\t"] {
            let got = image_from(Some(std::ffi::OsStr::new(d)), "m", b"embedded");
            assert_eq!(got.map(|g| g.to_vec()), Ok(b"embedded".to_vec()), "{d:?}");
        }
        // A folder that is set is used.
        let dir = std::env::temp_dir().join(format!("flashcomm-kdir2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("m.fatbin"), b"from the folder").unwrap();
        let g = image_from(Some(dir.as_os_str()), "m", b"embedded").unwrap();
        assert_eq!(g.as_ref(), b"from the folder");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
