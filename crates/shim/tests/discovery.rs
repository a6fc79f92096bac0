//! Finding the real NCCL: each scenario runs in a child process with its own environment.

mod common;

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use common::*;

fn symlink(target: &Path, link: &Path) {
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).unwrap();
}

/// In a child: our library, loaded by path.
fn ours() -> Nccl {
    Nccl::open(&cdylib())
}

#[test]
fn refuses_its_own_image_as_the_real_library() {
    let name = "refuses_its_own_image_as_the_real_library";
    if is_child(name) {
        let n = ours();
        let (rc, _) = n.version();
        assert_eq!(rc, SYSTEM_ERROR);
        let msg = n.last_error();
        assert!(msg.contains("is flashcomm itself"), "{msg}");
        assert!(msg.contains("FLASHCOMM_NCCL_LIB"), "{msg}");
        // Every other forwarded call fails the same way, and nothing recursed.
        assert_eq!(n.comm_int("ncclCommCount", 0x10).0, SYSTEM_ERROR);
        assert_eq!(n.error_string(0), "no error");
        return;
    }
    let ours = cdylib();
    let link = scratch("own-image").join("libnccl.so.2");
    symlink(&ours, &link);
    for path in [ours.clone(), link] {
        let out = run_child(name, &[("FLASHCOMM_NCCL_LIB", path.to_str().unwrap())], &[]);
        let err = stderr(&out);
        assert!(
            err.contains("FLASHCOMM WARN no usable real NCCL library found"),
            "{err}"
        );
    }
}

#[test]
fn refuses_a_copy_of_itself() {
    let name = "refuses_a_copy_of_itself";
    if is_child(name) {
        let n = ours();
        assert_eq!(n.version().0, SYSTEM_ERROR);
        let msg = n.last_error();
        assert!(msg.contains("another copy of flashcomm"), "{msg}");
        return;
    }
    let copy = scratch("copy").join("libnccl.so.2");
    std::fs::copy(cdylib(), &copy).unwrap();
    run_child(name, &[("FLASHCOMM_NCCL_LIB", copy.to_str().unwrap())], &[]);
}

#[test]
fn finds_the_real_library_on_ld_library_path() {
    let name = "finds_the_real_library_on_ld_library_path";
    if is_child(name) {
        let n = ours();
        let (rc, v) = n.version();
        assert_eq!(rc, SUCCESS, "{}", n.last_error());
        assert_eq!(
            v,
            std::env::var("EXPECT_VERSION")
                .unwrap()
                .parse::<i32>()
                .unwrap()
        );
        return;
    }
    let expect = real_version().to_string();
    // First folder: a libnccl.so.2 that is flashcomm (must be skipped); second: the real one.
    let decoy = scratch("decoy");
    symlink(&cdylib(), &decoy.join("libnccl.so.2"));
    let real_dir = real_lib().parent().unwrap().to_path_buf();
    let lp = format!("{}:{}", decoy.display(), real_dir.display());
    let out = run_child(
        name,
        &[
            ("LD_LIBRARY_PATH", &lp),
            ("EXPECT_VERSION", &expect),
            ("NCCL_DEBUG", "INFO"),
        ],
        &["FLASHCOMM_NCCL_LIB", "CUDA_HOME"],
    );
    let err = stderr(&out);
    assert!(err.contains("(found via LD_LIBRARY_PATH)"), "{err}");
    assert!(
        err.contains("is flashcomm itself"),
        "the decoy is reported as skipped: {err}"
    );
    assert!(err.contains(" FLASHCOMM INFO using the real NCCL"), "{err}");
}

#[test]
fn finds_an_nccl_that_is_already_loaded() {
    let name = "finds_an_nccl_that_is_already_loaded";
    if is_child(name) {
        // Loaded by path before our library, as torch's preloading does.
        let _real = Lib::open(Path::new(&std::env::var("REAL").unwrap()));
        let n = ours();
        assert_eq!(n.version().0, SUCCESS, "{}", n.last_error());
        return;
    }
    let real = real_lib();
    let out = run_child(
        name,
        &[
            ("REAL", real.to_str().unwrap()),
            ("LD_LIBRARY_PATH", ""),
            ("NCCL_DEBUG", "INFO"),
        ],
        &["FLASHCOMM_NCCL_LIB", "CUDA_HOME"],
    );
    assert!(
        stderr(&out).contains("(found via already loaded in the process)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn finds_the_nccl_wheel_next_to_torch() {
    let name = "finds_the_nccl_wheel_next_to_torch";
    if is_child(name) {
        let _torch = Lib::open(Path::new(&std::env::var("TORCH").unwrap()));
        let n = ours();
        assert_eq!(n.version().0, SUCCESS, "{}", n.last_error());
        return;
    }
    // A fake site-packages: torch/lib/libtorch_cuda.so (an empty library) and the NCCL wheel.
    let sp = scratch("venv").join("lib/python3/site-packages");
    let torch = sp.join("torch/lib/libtorch_cuda.so");
    let wheel = sp.join("nvidia/nccl/lib");
    std::fs::create_dir_all(torch.parent().unwrap()).unwrap();
    std::fs::create_dir_all(&wheel).unwrap();
    let src = torch.with_extension("c");
    std::fs::write(&src, "int fake_torch_symbol = 1;\n").unwrap();
    build_shared(&src, &torch, &[]);
    symlink(&real_lib(), &wheel.join("libnccl.so.2"));
    let out = run_child(
        name,
        &[
            ("TORCH", torch.to_str().unwrap()),
            ("LD_LIBRARY_PATH", ""),
            ("NCCL_DEBUG", "INFO"),
        ],
        &["FLASHCOMM_NCCL_LIB", "CUDA_HOME"],
    );
    let err = stderr(&out);
    assert!(err.contains("(found via the NCCL wheel next to"), "{err}");
    assert!(err.contains("libtorch_cuda.so)"), "{err}");
}

#[test]
fn a_missing_real_library_is_a_clear_error() {
    let name = "a_missing_real_library_is_a_clear_error";
    if is_child(name) {
        let n = ours();
        // Functions that need no real library work.
        assert_eq!(
            n.error_string(5),
            "invalid usage (run with NCCL_DEBUG=WARN for details)"
        );
        // The others fail with ncclSystemError and say what was tried, a call without a
        // communicator too (the real library would answer it).
        assert_eq!(n.all_reduce(0, 0, 4, 7, 0, 0), SYSTEM_ERROR);
        assert_eq!(n.version().0, SYSTEM_ERROR);
        let msg = n.last_error();
        assert!(msg.contains("no usable real NCCL library found"), "{msg}");
        assert!(
            msg.contains("/nonexistent/libnccl.so.2 [LD_LIBRARY_PATH]: not found"),
            "{msg}"
        );
        assert!(
            msg.contains("/usr/local/cuda/lib64/libnccl.so.2 [system library folder]"),
            "{msg}"
        );
        assert!(msg.contains("Set FLASHCOMM_NCCL_LIB"), "{msg}");
        assert_eq!(n.comm_call("ncclCommDestroy", 0x10), SYSTEM_ERROR);
        return;
    }
    // This test assumes no NCCL in the system folders of the test machine.
    if discovery_finds_system_nccl() {
        flashcomm_config::testing::skipped(
            "shim: a_missing_real_library_is_a_clear_error",
            "this machine has an NCCL in a system folder",
        );
        return;
    }
    run_child(
        name,
        &[("LD_LIBRARY_PATH", "/nonexistent")],
        &["FLASHCOMM_NCCL_LIB", "CUDA_HOME"],
    );
}

fn discovery_finds_system_nccl() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
    ]
    .iter()
    .any(|d| Path::new(d).join("libnccl.so.2").exists())
}

/// `FLASHCOMM_NCCL_LIB` naming a file that is no usable library is reported by name, never a
/// crash: a truncated copy of the real library (mapping it would kill the process with SIGBUS at
/// its first page past the end), an empty file, a text file and a folder.
#[test]
fn a_file_that_is_no_usable_library_is_refused_with_a_message() {
    let name = "a_file_that_is_no_usable_library_is_refused_with_a_message";
    if is_child(name) {
        let n = ours();
        let (rc, _) = n.version();
        assert_eq!(rc, SYSTEM_ERROR, "{}", n.last_error());
        let msg = n.last_error();
        let path = std::env::var("FLASHCOMM_NCCL_LIB").unwrap();
        let why = std::env::var("EXPECT_WHY").unwrap();
        assert!(
            msg.contains(&format!("{path} [FLASHCOMM_NCCL_LIB]: {why}")),
            "{msg}"
        );
        assert!(msg.contains("FLASHCOMM_NCCL_LIB"), "{msg}");
        // The process goes on: every call that needs the real library says the same.
        assert_eq!(n.all_reduce(0x1000, 0x2000, 4, 7, 0, 0x10), SYSTEM_ERROR);
        assert_eq!(
            n.error_string(4),
            "invalid argument (run with NCCL_DEBUG=WARN for details)"
        );
        return;
    }
    let dir = scratch("unusable");
    let real = std::fs::read(real_lib()).unwrap();
    let cases: Vec<(std::path::PathBuf, &str)> = vec![
        {
            let p = dir.join("truncated.so");
            // Past the ELF and program headers, short of the segments they describe.
            std::fs::write(&p, &real[..real.len() / 2]).unwrap();
            (p, "truncated")
        },
        {
            let p = dir.join("headers-only.so");
            std::fs::write(&p, &real[..64]).unwrap();
            (p, "truncated")
        },
        {
            let p = dir.join("empty.so");
            std::fs::write(&p, b"").unwrap();
            (p, "not an ELF file")
        },
        {
            let p = dir.join("text.so");
            std::fs::write(&p, b"INPUT(libnccl.so.2)\n").unwrap();
            (p, "not an ELF file")
        },
        (dir.clone(), "not a file"),
    ];
    for (path, why) in cases {
        run_child(
            name,
            &[
                ("FLASHCOMM_NCCL_LIB", path.to_str().unwrap()),
                ("EXPECT_WHY", why),
            ],
            &[],
        );
    }
}

/// A value of `FLASHCOMM_NCCL_LIB` that the configuration refuses (a bare name, not UTF-8) is
/// still an explicit choice: it is never replaced by a library found elsewhere (here one on
/// `LD_LIBRARY_PATH`); every call that needs the real library fails, naming the variable.
#[test]
fn a_bad_flashcomm_nccl_lib_value_is_never_replaced_by_another_library() {
    let name = "a_bad_flashcomm_nccl_lib_value_is_never_replaced_by_another_library";
    if is_child(name) {
        let n = ours();
        assert_eq!(n.version().0, SYSTEM_ERROR, "{}", n.last_error());
        let msg = n.last_error();
        assert!(msg.contains("FLASHCOMM_NCCL_LIB="), "{msg}");
        assert!(msg.contains("is not valid"), "{msg}");
        assert!(
            !msg.contains("LD_LIBRARY_PATH]"),
            "nothing else is tried: {msg}"
        );
        return;
    }
    let dir = scratch("elsewhere");
    symlink(&real_lib(), &dir.join("libnccl.so.2"));
    for value in [
        std::ffi::OsString::from("libnccl.so.2"),
        std::ffi::OsStr::from_bytes(b"/tmp/\xff/libnccl.so.2").to_os_string(),
    ] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, name)
            .env("LD_LIBRARY_PATH", &dir)
            .env("FLASHCOMM_NCCL_LIB", &value)
            .env_remove("CUDA_HOME");
        let out = cmd.output().unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "{value:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
