//! The built library's dynamic symbols and SONAME.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::cdylib;

fn tool(name: &str, args: &[&str]) -> String {
    let out = Command::new(name)
        .args(args)
        .arg(cdylib())
        .output()
        .unwrap_or_else(|e| panic!("{name} is needed by this test (binutils): {e}"));
    assert!(
        out.status.success(),
        "{name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn exports_every_public_function_in_both_forms_and_nothing_else() {
    let listed = tool("nm", &["-D", "--defined-only"]);
    let exported: BTreeSet<String> = listed
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "address type name"; only text (function) symbols are exports of ours.
            (f.len() == 3).then(|| (f[1].to_string(), f[2].to_string()))
        })
        .map(|(kind, name)| {
            assert_eq!(kind, "T", "{name} is exported as {kind}, not as a function");
            name
        })
        .collect();
    let mut expected: BTreeSet<String> = BTreeSet::new();
    for f in flashcomm_nccl_sys::FUNCTIONS {
        expected.insert(f.to_string());
        expected.insert(format!("p{f}"));
    }
    for f in [
        "flashcommGetVersion",
        "flashcommGetStats",
        "flashcommGetConfigString",
        "flashcommCommSetQuant",
        "flashcommCommGetQuant",
        "flashcommCommGetInfo",
    ] {
        expected.insert(f.to_string());
    }
    let missing: Vec<_> = expected.difference(&exported).collect();
    let unexpected: Vec<_> = exported.difference(&expected).collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
    assert!(
        unexpected.is_empty(),
        "exported but not expected: {unexpected:?}"
    );
    assert_eq!(exported.len(), 2 * flashcomm_nccl_sys::FUNCTIONS.len() + 6);
}

#[test]
fn soname_is_libnccl_so_2() {
    let dynamic = tool("readelf", &["-d"]);
    let soname: Vec<&str> = dynamic.lines().filter(|l| l.contains("(SONAME)")).collect();
    assert_eq!(soname.len(), 1, "{dynamic}");
    assert!(soname[0].contains("[libnccl.so.2]"), "{}", soname[0]);
}

#[test]
fn does_not_depend_on_nccl_or_cuda_at_load_time() {
    let dynamic = tool("readelf", &["-d"]);
    for line in dynamic.lines().filter(|l| l.contains("(NEEDED)")) {
        assert!(
            !line.contains("nccl") && !line.contains("cuda"),
            "the library must load without NCCL or CUDA: {line}"
        );
    }
}
