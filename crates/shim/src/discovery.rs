//! Where to look for the real NCCL: the ordered list of candidate files.
//!
//! Pure logic over the inputs (the configured path, the objects loaded in the process, the
//! environment), so that the order can be tested; `calls::real` opens the candidates and refuses
//! any that is flashcomm itself. Every candidate is a path with a `/`: `dlopen` of a bare
//! `libnccl.so.2` would return this very library.
//!
//! Owns: [`Candidate`], [`Origin`], [`Inputs`], [`candidates`].
//! May import: nothing of this crate.

use std::path::{Component, Path, PathBuf};

/// Why a candidate is on the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Origin {
    /// `FLASHCOMM_NCCL_LIB`.
    Configured,
    /// An NCCL already loaded in the process (torch may preload it by path).
    AlreadyLoaded,
    /// The NCCL wheel next to a loaded object under `site-packages` (what torch's run path finds).
    NextTo(PathBuf),
    /// A folder of `LD_LIBRARY_PATH`.
    LdLibraryPath,
    /// `$CUDA_HOME/lib64`.
    CudaHome,
    /// A system folder.
    System,
}

impl Origin {
    /// For log lines: why this file was chosen.
    pub(crate) fn describe(&self) -> String {
        match self {
            Origin::Configured => "FLASHCOMM_NCCL_LIB".into(),
            Origin::AlreadyLoaded => "already loaded in the process".into(),
            Origin::NextTo(obj) => format!("the NCCL wheel next to {}", obj.display()),
            Origin::LdLibraryPath => "LD_LIBRARY_PATH".into(),
            Origin::CudaHome => "CUDA_HOME".into(),
            Origin::System => "system library folder".into(),
        }
    }
}

/// One file to try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The file.
    pub(crate) path: PathBuf,
    /// Why it is tried.
    pub(crate) origin: Origin,
}

/// What discovery looks at.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inputs {
    /// `FLASHCOMM_NCCL_LIB`, validated by the configuration.
    pub(crate) configured: Option<String>,
    /// Paths of the objects loaded in the process, in load order.
    pub(crate) loaded: Vec<PathBuf>,
    /// `LD_LIBRARY_PATH`.
    pub(crate) ld_library_path: Option<String>,
    /// `CUDA_HOME`.
    pub(crate) cuda_home: Option<String>,
}

/// System folders, tried last.
pub(crate) const SYSTEM_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
];

const SONAME: &str = "libnccl.so.2";

/// Whether a file name is an NCCL library (`libnccl.so`, `libnccl.so.2`, `libnccl.so.2.32.3`).
fn is_nccl_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "libnccl.so" || n.starts_with("libnccl.so."))
}

/// The `site-packages` (or `dist-packages`) folder that contains `path`, if any.
fn site_packages_of(path: &Path) -> Option<PathBuf> {
    let mut prefix = PathBuf::new();
    for c in path.components() {
        prefix.push(c.as_os_str());
        if let Component::Normal(name) = c
            && (name == "site-packages" || name == "dist-packages")
        {
            return Some(prefix);
        }
    }
    None
}

/// The candidates, in the order they are tried. With `FLASHCOMM_NCCL_LIB` set it is the only
/// candidate: an explicit choice that fails is reported, not silently replaced.
pub(crate) fn candidates(inputs: &Inputs) -> Vec<Candidate> {
    if let Some(p) = &inputs.configured {
        return vec![Candidate {
            path: PathBuf::from(p),
            origin: Origin::Configured,
        }];
    }
    let mut out: Vec<Candidate> = Vec::new();
    let mut push = |path: PathBuf, origin: Origin| {
        if !out.iter().any(|c| c.path == path) {
            out.push(Candidate { path, origin });
        }
    };
    for obj in &inputs.loaded {
        if obj.is_absolute() && is_nccl_name(obj) {
            push(obj.clone(), Origin::AlreadyLoaded);
        }
    }
    for obj in &inputs.loaded {
        if let Some(sp) = site_packages_of(obj) {
            push(
                sp.join("nvidia/nccl/lib").join(SONAME),
                Origin::NextTo(obj.clone()),
            );
        }
    }
    if let Some(lp) = &inputs.ld_library_path {
        for dir in lp.split(':').filter(|d| !d.is_empty()) {
            push(Path::new(dir).join(SONAME), Origin::LdLibraryPath);
        }
    }
    if let Some(home) = inputs.cuda_home.as_deref().filter(|h| !h.is_empty()) {
        push(Path::new(home).join("lib64").join(SONAME), Origin::CudaHome);
    }
    for dir in SYSTEM_DIRS {
        push(Path::new(dir).join(SONAME), Origin::System);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_path_is_the_only_candidate() {
        let c = candidates(&Inputs {
            configured: Some("/opt/nccl/libnccl.so.2".into()),
            ld_library_path: Some("/x".into()),
            ..Default::default()
        });
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].origin, Origin::Configured);
    }

    #[test]
    fn order_without_configuration() {
        let torch = PathBuf::from("/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so");
        let c = candidates(&Inputs {
            configured: None,
            loaded: vec![
                PathBuf::from("/usr/lib/libc.so.6"),
                torch.clone(),
                PathBuf::from("/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"),
                PathBuf::from("/venv/lib/python3.12/site-packages/numpy/core/x.so"),
                PathBuf::from("relative/libnccl.so.2"),
            ],
            ld_library_path: Some("/a::/b".into()),
            cuda_home: Some("/cuda".into()),
        });
        let paths: Vec<String> = c.iter().map(|c| c.path.display().to_string()).collect();
        assert_eq!(
            paths,
            [
                "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
                "/a/libnccl.so.2",
                "/b/libnccl.so.2",
                "/cuda/lib64/libnccl.so.2",
                "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
                "/usr/lib64/libnccl.so.2",
                "/usr/local/lib/libnccl.so.2",
                "/usr/local/cuda/lib64/libnccl.so.2",
            ]
        );
        assert_eq!(c[0].origin, Origin::AlreadyLoaded);
        assert!(c.iter().all(|c| c.path.to_string_lossy().contains('/')));
    }

    #[test]
    fn wheel_next_to_torch() {
        let torch = PathBuf::from("/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so");
        let c = candidates(&Inputs {
            loaded: vec![torch.clone()],
            ..Default::default()
        });
        assert_eq!(
            c[0].path,
            PathBuf::from("/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2")
        );
        assert_eq!(c[0].origin, Origin::NextTo(torch));
    }

    #[test]
    fn names() {
        assert!(is_nccl_name(Path::new("/x/libnccl.so")));
        assert!(is_nccl_name(Path::new("/x/libnccl.so.2.32.3")));
        assert!(!is_nccl_name(Path::new("/x/libnccl_net.so")));
        assert!(!is_nccl_name(Path::new("/x/libnccl-net.so.2")));
    }
}
