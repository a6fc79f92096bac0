//! Build script of `flashcomm-comm`: `$OUT_DIR/library_digest.rs`, the digest of the Rust sources
//! of the whole library, which ranks compare at set-up (`identity::Build`).
//!
//! The arena's layout, the tags' signature, the set-up's rounds, the plan every rank must pick
//! alike and the routing rules are Rust, spread over the library's crates; two builds that differ
//! in any of them must not serve one communicator together, whatever their version number says.
//! So the digest is FNV-1a over the path (relative to the repository) and contents of every file
//! under `src/` of each crate the library is built from, their manifests, the workspace's
//! manifest and lock file and the top-level `build.rs` (which compiles the kernels), in path
//! order. Independent of the compiler and of where the checkout lies: two builds of the same
//! sources agree, wherever and however they were built. (The CUDA sources have their own digest,
//! `flashcomm_kernels::SOURCE_DIGEST`, and the kernel images theirs.)

use std::fs;
use std::path::{Path, PathBuf};

/// The crates of the library (`crates/<name>`): every crate `libnccl.so` is linked from.
const CRATES: &[&str] = &[
    "codec", "config", "gpu", "kernels", "comm", "shim", "nccl-sys",
];

/// Files of the workspace that shape the build of every crate.
const WORKSPACE_FILES: &[&str] = &["Cargo.toml", "Cargo.lock", "build.rs"];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest
        .ancestors()
        .nth(2)
        .expect("the repository holds crates/comm")
        .to_path_buf();
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));

    let mut files = Vec::new();
    for f in WORKSPACE_FILES {
        files.push(root.join(f));
    }
    for krate in CRATES {
        let dir = root.join("crates").join(krate);
        files.push(dir.join("Cargo.toml"));
        files.push(dir.join("build.rs"));
        let src = dir.join("src");
        // The folder too: a file added to it or removed from it changes the digest.
        println!("cargo:rerun-if-changed={}", src.display());
        walk(&src, &mut files);
    }
    let mut named: Vec<(String, PathBuf)> = files
        .into_iter()
        .filter(|p| p.is_file())
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .unwrap_or(&p)
                .to_string_lossy()
                .replace('\\', "/");
            (rel, p)
        })
        .collect();
    named.sort();
    named.dedup_by(|a, b| a.0 == b.0);

    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (rel, p) in &named {
        println!("cargo:rerun-if-changed={}", p.display());
        eat(rel.as_bytes());
        eat(&[0]);
        eat(&fs::read(p).unwrap_or_default());
        eat(&[0]);
    }
    fs::write(out.join("library_digest.rs"), format!("{h:#018x}\n"))
        .expect("write library_digest.rs");
    let list: Vec<String> = named.iter().map(|(rel, _)| format!("{rel:?}")).collect();
    fs::write(
        out.join("library_files.rs"),
        format!("&[{}]\n", list.join(", ")),
    )
    .expect("write library_files.rs");
    println!("cargo:rerun-if-changed=build.rs");
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}
