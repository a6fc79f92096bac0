//! Who a rank is, as set-up compares it: the flashcomm build it runs (two builds whose Rust
//! sources, kernels, wire format or version differ never serve one communicator together), and the process it
//! lives in (ranks of one process reach each other's arenas by address; ranks of other processes
//! through IPC handles or shared segments, so taking one for the other maps the wrong memory).

use std::sync::Mutex;

use crate::gpu::PerProcess;

/// FNV-1a of the Rust sources of every crate of the library (their `src/`, their manifests, the
/// workspace's manifest and lock file, the top-level `build.rs`), computed by this crate's build
/// script: what two builds must share, beside the kernels, to serve one communicator together
/// (the arena's layout, the tags' signature, the set-up's rounds, the plans, the routing rules).
pub const LIBRARY_DIGEST: u64 = include!(concat!(env!("OUT_DIR"), "/library_digest.rs"));

/// The files [`LIBRARY_DIGEST`] covers, relative to the repository, in the order hashed.
pub const LIBRARY_FILES: &[&str] = include!(concat!(env!("OUT_DIR"), "/library_files.rs"));

/// The flashcomm build a rank runs: the crate version, the digest of the Rust sources of the
/// library, the digest of the CUDA sources its kernels are built from (their ABI, protocols and
/// the CUDA codec) and the codec's wire format version. The kernel images themselves are checked
/// against the build when they are loaded (`flashcomm_kernels::image_bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Build {
    /// `CARGO_PKG_VERSION` of the build.
    pub version: String,
    /// [`LIBRARY_DIGEST`].
    pub library: u64,
    /// [`flashcomm_kernels::SOURCE_DIGEST`].
    pub kernels: u64,
    /// [`flashcomm_codec::WIRE_FORMAT_VERSION`].
    pub codec: u32,
}

impl Build {
    /// The build of this library.
    pub fn this() -> Build {
        Build {
            version: env!("CARGO_PKG_VERSION").to_string(),
            library: LIBRARY_DIGEST,
            kernels: flashcomm_kernels::SOURCE_DIGEST,
            codec: flashcomm_codec::WIRE_FORMAT_VERSION,
        }
    }

    /// One number for the whole build (FNV-1a of its parts), as set-up records carry it.
    pub fn id(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self
            .version
            .bytes()
            .chain([0])
            .chain(self.library.to_le_bytes())
            .chain(self.kernels.to_le_bytes())
            .chain(self.codec.to_le_bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }

    /// The build as bytes (library digest, kernels digest, codec version, version text of at
    /// most 64 bytes). The library digest comes first, so that a build from before it, which
    /// reads the kernels' digest there, tells this one apart too.
    pub fn to_bytes(&self) -> Vec<u8> {
        let v = &self.version.as_bytes()[..self.version.len().min(64)];
        let mut out = Vec::with_capacity(21 + v.len());
        out.extend_from_slice(&self.library.to_le_bytes());
        out.extend_from_slice(&self.kernels.to_le_bytes());
        out.extend_from_slice(&self.codec.to_le_bytes());
        out.push(v.len() as u8);
        out.extend_from_slice(v);
        out
    }

    /// The build [`Build::to_bytes`] wrote at the start of `b`, and the bytes after it; `None`
    /// when `b` holds none (a build that sends no such record).
    pub fn from_bytes(b: &[u8]) -> Option<(Build, &[u8])> {
        let library = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
        let kernels = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
        let codec = u32::from_le_bytes(b.get(16..20)?.try_into().ok()?);
        let n = usize::from(*b.get(20)?);
        let version = String::from_utf8_lossy(b.get(21..21 + n)?).into_owned();
        Some((
            Build {
                version,
                library,
                kernels,
                codec,
            },
            &b[21 + n..],
        ))
    }
}

impl std::fmt::Display for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "flashcomm {} (library sources {:016x}, kernel sources {:016x}, codec wire format {})",
            self.version, self.library, self.kernels, self.codec
        )
    }
}

/// This process's identity as set-up records carry it: a random 64-bit token drawn once per
/// process (drawn again in a fork child, whose process id differs). Unlike the process id, it
/// cannot be equal for two processes of one machine in different PID namespaces (containers of
/// one pod share the host and its boot id, and often have equal process ids).
pub fn process_token() -> u64 {
    static TOKEN: PerProcess<Mutex<Option<(u32, u64)>>> = PerProcess::fresh_in_children();
    let pid = std::process::id();
    let mut t = TOKEN
        .get(|| Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    match *t {
        Some((p, token)) if p == pid => token,
        _ => {
            let token = random_u64(pid);
            *t = Some((pid, token));
            token
        }
    }
}

/// 64 random bits: from the kernel (`/dev/urandom`), or, where that cannot be read, a mix of the
/// time, the process id and an address of this process (never 0).
fn random_u64(pid: u32) -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b).max(1);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let addr = std::ptr::addr_of!(local) as u64;
    let mut h = t ^ u64::from(pid).rotate_left(32) ^ addr;
    // splitmix64's finalizer.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (h ^ (h >> 31)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_round_trip_and_differ_in_every_part() {
        let b = Build::this();
        let bytes = b.to_bytes();
        let (back, rest) = Build::from_bytes(&bytes).unwrap();
        assert_eq!(back, b);
        assert!(rest.is_empty());
        assert!(Build::from_bytes(&bytes[..5]).is_none());
        for other in [
            Build {
                version: "0.0.9".into(),
                ..b.clone()
            },
            Build {
                kernels: b.kernels ^ 1,
                ..b.clone()
            },
            Build {
                codec: b.codec + 1,
                ..b.clone()
            },
            Build {
                library: b.library ^ 1,
                ..b.clone()
            },
        ] {
            assert_ne!(other.id(), b.id(), "{other}");
            assert_ne!(other.to_bytes(), b.to_bytes(), "{other}");
            assert_ne!(other.to_string(), b.to_string());
        }
        assert!(b.to_string().contains(env!("CARGO_PKG_VERSION")));
    }

    /// Issue 45, item 8: the build the ranks agree on covered the CUDA sources and a version
    /// fixed at 0.1.0, so two builds that differ in the arena's layout, the tags' signature or
    /// the set-up's rounds (all Rust) passed as one. It now carries a digest of the Rust sources
    /// of every crate of the library (and the build script and lock file), computed at build
    /// time: builds that differ only there do not agree.
    #[test]
    fn the_build_covers_the_rust_sources_of_the_library() {
        let b = Build::this();
        assert_eq!(b.library, LIBRARY_DIGEST);
        assert_ne!(b.library, 0);
        let other = Build {
            library: b.library ^ (1 << 40),
            ..b.clone()
        };
        assert_ne!(other, b);
        assert_ne!(other.id(), b.id());
        let (back, _) = Build::from_bytes(&other.to_bytes()).unwrap();
        assert_ne!(back, b, "a rank of that build is told apart");
        // A rank of a build before this field (kernels, codec, version) is told apart too, and
        // tells this one apart (it reads the library digest where it expects the kernels').
        let mut older = b.kernels.to_le_bytes().to_vec();
        older.extend_from_slice(&b.codec.to_le_bytes());
        older.push(b.version.len() as u8);
        older.extend_from_slice(b.version.as_bytes());
        assert_ne!(Build::from_bytes(&older).map(|(x, _)| x), Some(b.clone()));
        let new = b.to_bytes();
        assert_ne!(
            u64::from_le_bytes(new[..8].try_into().unwrap()),
            b.kernels,
            "an older rank reads another kernel digest"
        );
        // The digest is of the sources: this file is one of them.
        let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/identity.rs");
        assert!(
            LIBRARY_FILES.iter().any(|f| here.ends_with(f)),
            "{LIBRARY_FILES:?}"
        );
        for krate in [
            "codec", "config", "gpu", "kernels", "comm", "shim", "nccl-sys",
        ] {
            let manifest = format!("crates/{krate}/Cargo.toml");
            assert!(LIBRARY_FILES.contains(&manifest.as_str()), "{manifest}");
        }
        for f in ["Cargo.lock", "build.rs", "crates/shim/src/policy.rs"] {
            assert!(LIBRARY_FILES.contains(&f), "{f}");
        }
    }

    #[test]
    fn the_process_token_is_stable_and_random() {
        let a = process_token();
        assert_eq!(a, process_token());
        assert_ne!(a, 0);
        // Another process draws another token (a child of this test binary would too; here the
        // generator itself is checked).
        assert_ne!(random_u64(1), random_u64(1));
    }
}
