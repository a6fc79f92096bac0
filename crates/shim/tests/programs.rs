//! The C and Python programs of `tests/c` and `tests/python`, in their CPU modes, against the
//! built library.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn env_dir(name: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(v) => PathBuf::from(v),
        None => panic!("{name} is not set: run ci/setup.sh, then `source .toolchain/env.sh`"),
    }
}

/// A folder where `-lnccl` and the loader find flashcomm: libnccl.so and libnccl.so.2 links.
fn link_dir() -> PathBuf {
    let dir = scratch("link");
    for name in ["libnccl.so", "libnccl.so.2"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(cdylib(), &link).unwrap();
    }
    dir
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}\n--- stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{cmd:?} failed ({:?}):\n{text}",
        out.status
    );
    text
}

#[test]
fn c_program_linked_with_lnccl() {
    let expect = real_version().to_string();
    let nccl_include = env_dir("FLASHCOMM_NCCL_HOME").join("include");
    let cuda_include = env_dir("FLASHCOMM_CUDA_INCLUDE");
    let dir = link_dir();
    let exe = dir.join("abi_smoke");
    run(Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(&nccl_include)
        .arg("-I")
        .arg(&cuda_include)
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join("tests/c/abi_smoke.c"))
        .arg("-L")
        .arg(&dir)
        .args(["-lnccl", "-ldl"])
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-o")
        .arg(&exe));
    // The program binds to flashcomm through DT_NEEDED libnccl.so.2 and the run path.
    let needed = run(Command::new("readelf").arg("-d").arg(&exe));
    assert!(needed.contains("[libnccl.so.2]"), "{needed}");
    let out = run(Command::new(&exe)
        .args(["--expect-version", &expect])
        .env("FLASHCOMM_NCCL_LIB", real_lib()));
    assert!(out.contains("PASS: 0 failure(s)"), "{out}");
    assert!(!out.contains("FAIL "), "{out}");
    assert!(
        out.contains("FLASHCOMM WARN ncclAllReduce: comm argument is NULL"),
        "{out}"
    );
}

#[test]
fn python_ctypes_like_vllm() {
    let expect = real_version().to_string();
    let script = repo().join("tests/python/ctypes_load.py");
    let out = run(Command::new("python3")
        .arg(&script)
        .arg("--lib")
        .arg(cdylib())
        .args(["--expect-version", &expect])
        .env("FLASHCOMM_NCCL_LIB", real_lib()));
    assert!(out.contains("PASS: 0 failure(s)"), "{out}");
}

#[test]
fn overhead_program_cpu_part() {
    let dir = scratch("overhead");
    let exe = dir.join("overhead");
    run(Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror"])
        .arg(repo().join("tests/c/overhead.c"))
        .args(["-ldl", "-o"])
        .arg(&exe));
    let out = run(Command::new(&exe)
        .arg("--ours")
        .arg(cdylib())
        .arg("--real")
        .arg(real_lib())
        .args(["--iters", "20000"]));
    assert!(
        out.contains("ncclGetVersion") && out.contains("overhead"),
        "{out}"
    );
}
