//! Build script of the two crates that embed CUDA modules (both manifests point at this file):
//!
//! * `crates/kernels` (the product): every `cuda/*.cu`, for the architectures in
//!   `FLASHCOMM_CUDA_ARCHS` (default `80;90;100`, filtered by what the nvcc found supports) plus
//!   PTX of the highest one, so newer GPUs can JIT it. The shipped `libnccl.so` carries these.
//! * `crates/testkit` (tests and benchmarks only): every `cuda/testing/*.cu` (verification and
//!   codec buffer kernels), for `FLASHCOMM_TEST_CUDA_ARCHS` (default `90`, the GPU machine's
//!   H200) without PTX unless `FLASHCOMM_CUDA_PTX=1`: they never ship, so they need not run on
//!   every GPU, and compiling them once keeps the test command short.
//!
//! Each source becomes one CUDA module (one fatbin); the generated `$OUT_DIR/images.rs` lists the
//! modules as `(name, bytes, digest)`: the digest of each image compiled here, which an image
//! loaded at run time from `FLASHCOMM_KERNEL_DIR` must have.
//!
//! nvcc is found through `NVCC`, then `$CUDA_HOME/bin/nvcc`, then `PATH`; `ci/setup.sh` installs
//! the pinned toolchain (CUDA 13.0 from PyPI). Without nvcc the build still succeeds with no
//! kernels (every collective then passes through to the real NCCL) and prints a warning, unless
//! `FLASHCOMM_REQUIRE_KERNELS=1`, which turns that into an error (CI and GPU bundles set it).
//!
//! Kernels are compiled with `-fmad=false`: the codec and the reductions must match the CPU
//! reference bit for bit, so no multiply-add may be contracted.
//!
//! For GPU test bundles (which must stay small): `FLASHCOMM_CUDA_PTX=0` leaves the PTX out, and
//! `FLASHCOMM_EMBED_KERNELS=0` embeds no images (the binaries then load `<name>.fatbin` from the
//! folder named by `FLASHCOMM_KERNEL_DIR` at run time); the fatbins stay in `$OUT_DIR`.
//!
//! This file stays at the top of the repository, beside `cuda/`, as the project's layout names it:
//! it builds the CUDA sources of the whole tree, for whichever of the two crates runs it.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest
        .ancestors()
        .find(|p| p.join("cuda").is_dir() && p.join("Cargo.toml").is_file())
        .expect("repository root with cuda/")
        .to_path_buf();
    let testkit = env::var("CARGO_PKG_NAME").is_ok_and(|n| n == "flashcomm-testkit");
    let cuda_dir = if testkit {
        root.join("cuda/testing")
    } else {
        root.join("cuda")
    };
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));

    println!("cargo::rustc-check-cfg=cfg(flashcomm_kernels)");
    println!("cargo:rerun-if-changed={}", cuda_dir.display());
    for var in [
        "NVCC",
        "NVCC_CCBIN",
        "CUDA_HOME",
        "CUDA_PATH",
        "FLASHCOMM_CUDA_ARCHS",
        "FLASHCOMM_TEST_CUDA_ARCHS",
        "FLASHCOMM_REQUIRE_KERNELS",
        "FLASHCOMM_NO_KERNELS",
        "FLASHCOMM_CUDA_PTX",
        "FLASHCOMM_EMBED_KERNELS",
        "FLASHCOMM_KERNEL_CACHE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = list_sources(&cuda_dir);
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    let headers = root.join("cuda/include");
    if headers.is_dir() {
        for h in walk(&headers) {
            println!("cargo:rerun-if-changed={}", h.display());
        }
    }

    write_source_digest(&out_dir, &root, &sources, &headers);

    let require = env::var("FLASHCOMM_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
    let nvcc = if env::var_os("FLASHCOMM_NO_KERNELS").is_some() {
        None
    } else {
        find_nvcc(&root)
    };
    let Some(nvcc) = nvcc else {
        if require {
            panic!(
                "FLASHCOMM_REQUIRE_KERNELS=1 but nvcc was not found (set NVCC or CUDA_HOME, or run ci/setup.sh)"
            );
        }
        println!(
            "cargo:warning=nvcc not found: building without CUDA kernels (every collective passes through to the real NCCL); run ci/setup.sh"
        );
        write_images(&out_dir, &[]);
        return;
    };

    let supported = Command::new(&nvcc)
        .arg("--list-gpu-code")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let wanted = if testkit {
        env::var("FLASHCOMM_TEST_CUDA_ARCHS").unwrap_or_else(|_| "90".to_string())
    } else {
        env::var("FLASHCOMM_CUDA_ARCHS").unwrap_or_else(|_| "80;90;100".to_string())
    };
    let ptx = match env::var("FLASHCOMM_CUDA_PTX") {
        Ok(v) => v != "0",
        Err(_) => !testkit,
    };
    let archs: Vec<String> = wanted
        .split([';', ','])
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .filter(|a| supported.is_empty() || supported.contains(&format!("sm_{a}")))
        .map(str::to_string)
        .collect();
    assert!(
        !archs.is_empty(),
        "no CUDA architecture of '{wanted}' is supported by {}",
        nvcc.display()
    );

    // Compile the modules in parallel: nvcc is single-threaded per file and there are several.
    let results: Vec<(String, Result<PathBuf, String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                let nvcc = &nvcc;
                let archs = &archs;
                let out_dir = &out_dir;
                let headers = &headers;
                scope.spawn(move || {
                    let name = src.file_stem().unwrap().to_string_lossy().into_owned();
                    let out = out_dir.join(format!("{name}.fatbin"));
                    (
                        name,
                        compile_cached(nvcc, src, &out, archs, ptx, headers).map(|()| out),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("nvcc thread"))
            .collect()
    });

    let mut images = Vec::new();
    let mut failures = Vec::new();
    for (name, r) in results {
        match r {
            Ok(path) => images.push((name, path)),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    if !failures.is_empty() {
        panic!("CUDA compilation failed:\n{}", failures.join("\n"));
    }
    images.sort();
    if env::var("FLASHCOMM_EMBED_KERNELS").is_ok_and(|v| v == "0") {
        write_names_only(&out_dir, &images);
        println!("cargo:rustc-cfg=flashcomm_kernels");
        return;
    }
    write_images(&out_dir, &images);
    println!("cargo:rustc-cfg=flashcomm_kernels");
}

/// The nvcc arguments of one module (everything but the output path and the source).
fn nvcc_args(archs: &[String], ptx: bool, include: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "--fatbin",
        "-std=c++17",
        "-O3",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-fmad=false",
        "-Xptxas=-warn-spills",
    ]
    .iter()
    .map(Into::into)
    .collect();
    if let Some(cc) = env::var_os("NVCC_CCBIN") {
        args.push("-ccbin".into());
        args.push(cc);
    }
    args.push("-I".into());
    args.push(include.into());
    for a in archs {
        args.push(format!("-gencode=arch=compute_{a},code=sm_{a}").into());
    }
    if ptx {
        let hi = archs.last().unwrap();
        args.push(format!("-gencode=arch=compute_{hi},code=compute_{hi}").into());
    }
    args
}

/// Compiles `src` into `out`, or copies the fatbin an earlier build script run made from exactly
/// the same inputs (the source, every header, the arguments and the nvcc).
///
/// One `ci/test.sh` run builds the kernels crate twice (clippy's build and the tests' build hash
/// the crate differently, so each runs this script in its own `OUT_DIR`); nvcc is most of the
/// run's time, so the second build takes the first one's fatbins from a cache shared by every
/// build of one target folder (`<target>/flashcomm-kernel-cache`, or `FLASHCOMM_KERNEL_CACHE`).
/// A source that does not compile is never cached, so it fails every build.
fn compile_cached(
    nvcc: &Path,
    src: &Path,
    out: &Path,
    archs: &[String],
    ptx: bool,
    include: &Path,
) -> Result<(), String> {
    let args = nvcc_args(archs, ptx, include);
    let Some(cache) = cache_dir(out) else {
        return compile(nvcc, src, out, &args);
    };
    let key = input_hash(nvcc, src, include, &args);
    let stem = src.file_stem().unwrap().to_string_lossy();
    let cached = cache.join(format!("{stem}-{key:016x}.fatbin"));
    if cached.is_file() && fs::copy(&cached, out).is_ok() {
        println!("cargo:warning={stem}.cu: fatbin taken from the kernel cache (same inputs)");
        return Ok(());
    }
    compile(nvcc, src, out, &args)?;
    // Publish atomically: a concurrent build sees either nothing or the whole file.
    let _ = fs::create_dir_all(&cache);
    let tmp = cache.join(format!(".{stem}-{key:016x}.{}", std::process::id()));
    if fs::copy(out, &tmp).is_ok() {
        let _ = fs::rename(&tmp, &cached);
    }
    Ok(())
}

/// `FLASHCOMM_KERNEL_CACHE`, else `flashcomm-kernel-cache` in the target folder of `out`
/// (`<target>/[<triple>/]<profile>/build/<crate>-<hash>/out/<name>.fatbin`); `0` turns caching off.
fn cache_dir(out: &Path) -> Option<PathBuf> {
    match env::var_os("FLASHCOMM_KERNEL_CACHE") {
        Some(v) if v == "0" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => out
            .ancestors()
            .find(|p| p.file_name().is_some_and(|n| n == "build"))
            .and_then(Path::parent)
            .and_then(Path::parent)
            .map(|t| t.join("flashcomm-kernel-cache")),
    }
}

/// A hash of everything nvcc's output depends on: the compiler (its version banner), the
/// arguments, the source and every header under `include` (by path relative to it).
fn input_hash(nvcc: &Path, src: &Path, include: &Path, args: &[std::ffi::OsString]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // The compiler by its version banner, not its path: two installs of one nvcc share entries.
    Command::new(nvcc)
        .arg("--version")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default()
        .hash(&mut h);
    // Paths are hashed relative to the include folder, so every checkout of the same sources
    // (a second clone, a worktree) shares one cache.
    for a in args {
        if a.as_os_str() == include.as_os_str() {
            "<include>".hash(&mut h);
        } else {
            a.hash(&mut h);
        }
    }
    fs::read(src).unwrap_or_default().hash(&mut h);
    src.file_name().hash(&mut h);
    let mut headers = walk(include);
    headers.sort();
    for p in headers {
        p.strip_prefix(include).unwrap_or(&p).hash(&mut h);
        fs::read(&p).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

fn compile(nvcc: &Path, src: &Path, out: &Path, args: &[std::ffi::OsString]) -> Result<(), String> {
    let mut cmd = Command::new(nvcc);
    cmd.args(args);
    cmd.arg("-o").arg(out).arg(src);
    let output = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    // ptxas warnings (spills) are worth seeing but must not fail the build.
    let stderr = String::from_utf8_lossy(&output.stderr);
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!(
            "cargo:warning={}: {line}",
            src.file_name().unwrap().to_string_lossy()
        );
    }
    Ok(())
}

/// The digest of a kernel image, as `flashcomm_kernels::image_digest` computes it at run time
/// (the same function: the image loaded from `FLASHCOMM_KERNEL_DIR` must have this one).
fn image_digest(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x0100_0000_01b3);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// One `(name, bytes, digest)` line of `images.rs` (`bytes`: the expression of the image).
fn image_line(name: &str, bytes: &str, path: &Path) -> String {
    let digest = image_digest(&fs::read(path).expect("read a compiled fatbin"));
    format!("    ({name:?}, {bytes}, {digest:#018x}),\n")
}

fn write_images(out_dir: &Path, images: &[(String, PathBuf)]) {
    let mut code = String::from(
        "/// Every CUDA module this crate embeds, as `(module name, fatbin bytes, image digest)`.\n",
    );
    code.push_str("pub static IMAGES: &[(&str, &[u8], u64)] = &[\n");
    for (name, path) in images {
        let bytes = format!(
            "&crate::image::Aligned(*include_bytes!({:?})).0",
            path.display().to_string()
        );
        code.push_str(&image_line(name, &bytes, path));
    }
    code.push_str("];\n");
    fs::write(out_dir.join("images.rs"), code).expect("write images.rs");
}

/// Lists the modules without embedding them (their bytes are loaded at run time, and must have
/// the digest of the image compiled here).
fn write_names_only(out_dir: &Path, images: &[(String, PathBuf)]) {
    let mut code = String::from(
        "/// Every CUDA module of this crate; not embedded in this build (loaded from FLASHCOMM_KERNEL_DIR, checked against the digest).\n",
    );
    code.push_str("pub static IMAGES: &[(&str, &[u8], u64)] = &[\n");
    for (name, path) in images {
        code.push_str(&image_line(name, "&[]", path));
    }
    code.push_str("];\n");
    fs::write(out_dir.join("images.rs"), code).expect("write images.rs");
}

/// `$OUT_DIR/source_digest.rs`: FNV-1a over the path (relative to the repository) and contents of
/// every CUDA source and header of the crate's modules, in path order: the kernels' ABI (the
/// generated `params.h`, `instances.h`), their protocols and the CUDA codec. Ranks compare it at
/// set-up (with the version and the codec's wire format) so that builds whose kernels differ never
/// serve one communicator together. Independent of the compiler and of where the checkout lies.
fn write_source_digest(out_dir: &Path, root: &Path, sources: &[PathBuf], headers: &Path) {
    let mut files: Vec<PathBuf> = sources.to_vec();
    if headers.is_dir() {
        files.extend(walk(headers));
    }
    let mut named: Vec<(String, PathBuf)> = files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(root)
                .unwrap_or(&p)
                .to_string_lossy()
                .into_owned();
            (rel, p)
        })
        .collect();
    named.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (rel, p) in &named {
        eat(rel.as_bytes());
        eat(&[0]);
        eat(&fs::read(p).unwrap_or_default());
        eat(&[0]);
    }
    fs::write(out_dir.join("source_digest.rs"), format!("{h:#018x}\n"))
        .expect("write source_digest.rs");
}

fn list_sources(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "cu"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from)
        && p.is_file()
    {
        return Some(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = env::var_os(var) {
            let p = PathBuf::from(d).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        for d in env::split_paths(&paths) {
            let p = d.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    // The toolchain that ci/setup.sh installs into the repository, then the usual system place.
    [
        root.join(".toolchain/py/nvidia/cu13/bin/nvcc"),
        PathBuf::from("/usr/local/cuda/bin/nvcc"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}
