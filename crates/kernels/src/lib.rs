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
/// An image read from the folder must be the one this build compiled (`digest`, its
/// [`image_digest`], from the module's line of `image::IMAGES`): another build's kernels would
/// run under this build's identity, which the ranks agree on at set-up, with other layouts and
/// tags ([`Error::ForeignImage`] otherwise).
pub fn image_bytes(
    name: &str,
    embedded: &'static [u8],
    digest: u64,
) -> Result<std::borrow::Cow<'static, [u8]>, Error> {
    image_from(
        std::env::var_os("FLASHCOMM_KERNEL_DIR").as_deref(),
        name,
        embedded,
        digest,
    )
}

/// [`image_bytes`] with the folder given: `dir` is the value of `FLASHCOMM_KERNEL_DIR`.
fn image_from(
    dir: Option<&std::ffi::OsStr>,
    name: &str,
    embedded: &'static [u8],
    digest: u64,
) -> Result<std::borrow::Cow<'static, [u8]>, Error> {
    if let Some(dir) = dir.filter(|d| !d.to_string_lossy().trim().is_empty()) {
        let path = std::path::Path::new(&dir).join(format!("{name}.fatbin"));
        let bytes = std::fs::read(&path).map_err(|e| {
            Error::Cuda(flashcomm_gpu::Error::Cuda {
                during: "reading a kernel image",
                detail: format!("{}: {e}", path.display()),
            })
        })?;
        let got = image_digest(&bytes);
        if got != digest {
            return Err(Error::ForeignImage(format!(
                "{} (from FLASHCOMM_KERNEL_DIR) is not the kernel image this flashcomm build was \
                 compiled with: its digest is {got:016x}, the build's {digest:016x}; the folder \
                 must hold the .fatbin files of this very build (a GPU bundle's kernels/ folder, \
                 or the build's own), or leave FLASHCOMM_KERNEL_DIR unset to use the embedded \
                 images",
                path.display()
            )));
        }
        return Ok(std::borrow::Cow::Owned(bytes));
    }
    if embedded.is_empty() {
        return Err(Error::NoKernels);
    }
    Ok(std::borrow::Cow::Borrowed(embedded))
}

/// The digest of a kernel image (FNV-1a over its 64-bit little-endian words, then its last
/// bytes, seeded with its length): computed by the build script for every image it compiles, and
/// again for an image loaded from `FLASHCOMM_KERNEL_DIR`. Words rather than bytes keep it fast
/// on images of tens of MiB; each step is a bijection of the state, so images that differ in one
/// word never share a digest.
pub fn image_digest(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(b)).wrapping_mul(0x0100_0000_01b3);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Names of the embedded modules (one per `cuda/*.cu`).
pub fn module_names() -> Vec<&'static str> {
    image::IMAGES.iter().map(|(n, _, _)| *n).collect()
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
    /// An image in `FLASHCOMM_KERNEL_DIR` is not the one this build compiled (the message says
    /// which and what to do).
    ForeignImage(String),
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
            Error::ForeignImage(m) => f.write_str(m),
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
            let got = image_from(
                Some(std::ffi::OsStr::new(d)),
                "m",
                b"embedded",
                image_digest(b"embedded"),
            );
            assert_eq!(got.map(|g| g.to_vec()), Ok(b"embedded".to_vec()), "{d:?}");
        }
        // A folder that is set is used (its image is the build's).
        let dir = std::env::temp_dir().join(format!("flashcomm-kdir2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("m.fatbin"), b"embedded").unwrap();
        let g = image_from(
            Some(dir.as_os_str()),
            "m",
            b"embedded",
            image_digest(b"embedded"),
        )
        .unwrap();
        assert_eq!(g.as_ref(), b"embedded");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 45, item 8: an image loaded from `FLASHCOMM_KERNEL_DIR` must be the one this
    /// build was compiled with (its digest is embedded at build time, with or without the
    /// image). Before, any `<name>.fatbin` there was loaded: kernels of another build, with
    /// other layouts or tags, ran under this build's identity, which the ranks agree on.
    #[test]
    fn a_kernel_image_that_is_not_the_builds_is_refused() {
        let dir = std::env::temp_dir().join(format!("flashcomm-kdir3-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        const BUILT: &[u8] = b"the fatbin this build compiled";
        let built = BUILT.to_vec();
        let digest = image_digest(BUILT);
        // A library that embeds no images (a GPU bundle): the folder's image must match the
        // digest; so must one that overrides an embedded image.
        for embedded in [&b""[..], BUILT] {
            std::fs::write(dir.join("m.fatbin"), &built).unwrap();
            let got = image_from(Some(dir.as_os_str()), "m", embedded, digest).unwrap();
            assert_eq!(got.as_ref(), &built[..]);
            for other in [
                &b"another build's fatbin"[..],
                &built[..built.len() - 1],
                b"",
            ] {
                std::fs::write(dir.join("m.fatbin"), other).unwrap();
                let err = image_from(Some(dir.as_os_str()), "m", embedded, digest).unwrap_err();
                assert!(matches!(err, Error::ForeignImage(_)), "{err:?}");
                let msg = err.to_string();
                for part in [
                    "m.fatbin",
                    "FLASHCOMM_KERNEL_DIR",
                    "not the kernel image this flashcomm build was compiled with",
                    &format!("{digest:016x}"),
                ] {
                    assert!(msg.contains(part), "{part}: {msg}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        // One changed byte anywhere, or a length that differs, changes the digest.
        let mut flipped = built.clone();
        for i in 0..flipped.len() {
            flipped[i] ^= 0x80;
            assert_ne!(image_digest(&flipped), digest, "byte {i}");
            flipped[i] ^= 0x80;
        }
        assert_ne!(image_digest(&[0; 8]), image_digest(&[0; 16]));
        // Every image of this build carries its digest.
        for (name, bytes, d) in image::IMAGES {
            if !bytes.is_empty() {
                assert_eq!(image_digest(bytes), *d, "{name}");
            }
        }
    }
}
