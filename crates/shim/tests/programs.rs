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
        out.contains("FLASHCOMM WARN flashcommGetStats: communicator 0x10 is not known"),
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

/// Python with numpy on its path: the system's, or the one ci/setup.sh installs into
/// `$FLASHCOMM_TOOLCHAIN/pytest`.
fn python3() -> Command {
    let mut c = Command::new("python3");
    if let Some(tc) = std::env::var_os("FLASHCOMM_TOOLCHAIN") {
        let dir = std::path::Path::new(&tc).join("pytest");
        if dir.is_dir() {
            let mut path = std::ffi::OsString::from(dir.as_os_str());
            if let Some(old) = std::env::var_os("PYTHONPATH") {
                path.push(":");
                path.push(old);
            }
            c.env("PYTHONPATH", path);
        }
    }
    c
}

fn numpy_available() -> bool {
    python3()
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success())
}

use flashcomm_codec::rng::Rng;

/// Values that exercise the codec: spread, outliers, zeros of both signs, exact ties.
fn test_values(rng: &mut Rng, n: usize, scale: f32) -> Vec<flashcomm_codec::bf16> {
    (0..n)
        .map(|i| {
            let u = rng.signed_unit() as f32;
            let v = match i % 97 {
                0 => 0.0,
                1 => -0.0,
                2..=9 => (u * 4.0).round() / 4.0, // ties
                10 if u > 0.5 => u * 60.0,        // outliers
                _ => u * scale,
            };
            flashcomm_codec::bf16::from_f32(v)
        })
        .collect()
}

/// `tests/python/torch_quant.py` checks the GPU's quantized all-reduce bit for bit against its
/// numpy emulation of docs/codec.md, and against an error bound it computes. Both are checked
/// here against flashcomm's CPU reference (crates/codec), when numpy is installed.
#[test]
fn torch_quant_emulation_matches_the_cpu_reference() {
    if !numpy_available() {
        flashcomm_config::testing::skipped(
            "shim: torch_quant_emulation_matches_the_cpu_reference",
            "numpy is not installed (torch_quant.py's emulation needs it)",
        );
        return;
    }
    use flashcomm_codec::{DType, Format, bf16, reference};
    let script = repo().join("tests/python/torch_quant.py");
    let dir = scratch("emulation");
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    // (ranks, bits of the first step, bits of the all-gather step, group, spikes, values)
    let cases: [(usize, u8, u8, u16, u8, usize); 8] = [
        (1, 4, 4, 128, 2, 3 * 1024 + 333),
        (1, 4, 8, 128, 2, 5 * 1024),
        (1, 2, 2, 32, 0, 2048),
        (1, 8, 8, 256, 4, 1024),
        (3, 3, 8, 64, 4, 3 * 1024 + 500),
        (2, 8, 8, 256, 2, 4096),
        (4, 5, 5, 128, 4, 4 * 1024 + 777),
        (1, 6, 6, 32, 2, 100),
    ];
    for (case, &(ranks, bits, ag_bits, group, spikes, n)) in cases.iter().enumerate() {
        let inputs: Vec<Vec<bf16>> = (0..ranks)
            .map(|r| test_values(&mut rng, n, 0.5 + r as f32))
            .collect();
        let input = dir.join(format!("in{case}.bin"));
        let output = dir.join(format!("out{case}.bin"));
        let bytes: Vec<u8> = inputs
            .iter()
            .flatten()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        std::fs::write(&input, bytes).unwrap();
        run(python3()
            .arg(&script)
            .arg("--emulate")
            .arg(&input)
            .arg(&output)
            .args(["--ranks", &ranks.to_string()])
            .args(["--bits", &bits.to_string()])
            .args(["--ag-bits", &ag_bits.to_string()])
            .args(["--group", &group.to_string()])
            .args(["--spikes", &spikes.to_string()]));
        let got: Vec<u16> = std::fs::read(&output)
            .unwrap()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let bound: Vec<f64> = std::fs::read(output.with_extension("bin.bound"))
            .unwrap()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let bound2: Vec<f64> = std::fs::read(output.with_extension("bin.bound2"))
            .unwrap()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let fmt = Format::new(DType::Bf16, bits, group, spikes).unwrap();
        let fmt_ag = Format::new(DType::Bf16, ag_bits, group, spikes).unwrap();
        let refs: Vec<&[bf16]> = inputs.iter().map(Vec::as_slice).collect();
        let want = reference::allreduce_oneshot(fmt, &refs);
        let two = reference::allreduce_twostep(fmt, fmt_ag, &refs);
        assert_eq!(got.len(), n, "case {case}");
        assert_eq!(bound.len(), n, "case {case}");
        for i in 0..n {
            let what = format!(
                "case {case} ({ranks} ranks, {bits} bits, group {group}, spikes {spikes}) element {i}"
            );
            assert_eq!(
                got[i],
                want[i].to_bits(),
                "{what}: emulation differs from the reference"
            );
            let exact: f64 = inputs.iter().map(|x| f64::from(x[i].to_f32())).sum();
            let err = (f64::from(want[i].to_f32()) - exact).abs();
            assert!(
                err <= bound[i],
                "{what}: error {err} of the reference exceeds torch_quant.py's bound {}",
                bound[i]
            );
            let err2 = (f64::from(two[i].to_f32()) - exact).abs();
            assert!(
                err2 <= bound2[i],
                "{what}: error {err2} of the two-step reference exceeds torch_quant.py's \
                 two-step bound {}",
                bound2[i]
            );
            assert!(
                bound2[i] >= bound[i],
                "{what}: the two-step bound covers one-shot"
            );
        }
    }
}

#[test]
fn python_scripts_parse_their_arguments_without_a_gpu() {
    for script in ["torch_quant.py", "torch_preload.py", "ctypes_load.py"] {
        let out = run(Command::new("python3")
            .arg(repo().join("tests/python").join(script))
            .arg("--help"));
        assert!(out.contains("usage:"), "{script}: {out}");
    }
}
