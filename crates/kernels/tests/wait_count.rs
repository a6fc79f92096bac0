//! The kernels' epoch and wait arithmetic (`cuda/include/flashcomm/wait_count.h`), built for the
//! host with the C++ compiler and run: the epoch's period is what docs/protocols.md states, and
//! a wait that polls past 2^31 times never carries its count into the mismatch flag (before, the
//! count's top bit was the flag: 2^31 polls set it by themselves, and the next torn LL line was
//! then confirmed as a mismatch at once). CPU only (no device code is built).

use std::path::Path;
use std::process::Command;

fn run_host_program() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wait_count_host");
    let status = Command::new("c++")
        .args(["-std=c++14", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host/wait_count.cc"))
        .arg("-I")
        .arg(root.join("cuda/include"))
        .status()
        .expect("a C++ compiler `c++` is needed by this test");
    assert!(status.success(), "c++ failed");
    let run = Command::new(&out).output().expect("run the host program");
    assert!(run.status.success());
    String::from_utf8(run.stdout).unwrap()
}

fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("{key} missing in {text}"))
}

#[test]
fn epochs_and_waits_behave_at_their_edges() {
    let out = run_host_program();
    println!("{out}");
    assert_eq!(field(&out, "next_epoch(0xfffffffe)"), "1");
    assert_eq!(field(&out, "next_epoch(0xfffffffd)"), "4294967294");
    assert_eq!(field(&out, "next_epoch(0)"), "1");
    // 1024 polls from 2^31 - 8: the count wrapped, the flag never set by counting.
    assert_eq!(field(&out, "spurious_mismatches"), "0");
    assert_eq!(field(&out, "flag"), "0");
    assert_eq!(field(&out, "slow_checks"), "8");
    assert_eq!(field(&out, "confirmed_across_wrap"), "1");
    // The documented period is the one the code has.
    let period: u64 = field(&out, "period").parse().unwrap();
    assert_eq!(period, (1u64 << 32) - 2);
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/protocols.md"),
    )
    .unwrap();
    let text = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        text.contains("a multiple of 2^32 - 2 calls of the communicator"),
        "docs/protocols.md must state the epoch's period, 2^32 - 2 calls"
    );
}
