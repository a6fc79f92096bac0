//! What a test does when something it needs is missing from the machine (nvcc, bindgen's
//! libclang, the CUDA or NCCL headers, numpy): it never passes silently. [`skipped`] records the
//! test by name in the file [`SKIP_LOG`] names, which `ci/test.sh` sets and reports in its
//! summary (and does not count as passed); with no such file the test fails.

use std::io::Write;

/// The variable naming the file in which tests record that they were skipped.
pub const SKIP_LOG: &str = "FLASHCOMM_TEST_SKIPS";

/// Test `test` cannot run because of `why`. With [`SKIP_LOG`] set, appends `test: why` to that
/// file and returns (the caller then returns); otherwise panics, failing the test.
pub fn skipped(test: &str, why: &str) {
    let why = why.replace(['\n', '\r'], " ");
    let Some(path) = std::env::var_os(SKIP_LOG).filter(|p| !p.is_empty()) else {
        panic!(
            "{test} cannot run: {why} (set {SKIP_LOG}=<file> to record it as skipped instead, \
             as ci/test.sh does)"
        );
    };
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{test}: {why}\n").as_bytes()));
    if let Err(e) = written {
        panic!(
            "{test} cannot run ({why}), and {SKIP_LOG}={} cannot record it: {e}",
            path.to_string_lossy()
        );
    }
    eprintln!("skipped: {test}: {why}");
}
