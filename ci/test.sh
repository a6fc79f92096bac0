#!/usr/bin/env bash
# The test command (README, CI): installs the toolchain if needed, then checks formatting, lints,
# generated files (docs/perf.md's tables and plots among them: ci/perf-doc.py --check), builds
# everything including the CUDA kernels, and runs every CPU test, of the product's workspace and
# of the research tools' own (tools/research, which shares target/), then the Python wheel's test
# (ci/wheel-test.sh), the multi-GPU check's (ci/multi-gpu-check-test.sh) and ci/demo.sh's on a
# machine without a GPU (ci/demo-test.sh), then the CUDA 12 build (docs/cuda12.md): the library
# compiled by `ci/setup.sh --cuda 12`'s compiler, for sm_90 only (each architecture costs minutes),
# packaged as flashcomm-cu12 and tested by ci/wheel-test.sh --cuda 12.
# GPU tests are not run here (see ci/gpu-bundle.sh and docs/testing.md). A test that cannot run
# for want of a tool is listed by name as skipped in the summary, never counted as passed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/ci/setup.sh" --cuda 12 > /dev/null
# shellcheck disable=SC1091
source "$root/.toolchain/env.sh"
# A kernel that does not compile must fail the tests, not silently build a pass-through library.
export FLASHCOMM_REQUIRE_KERNELS=1
# The research tools' workspace (its own lockfile; the same target/ through .cargo/config.toml).
research() { (cd "$root/tools/research" && cargo "$@"); }

echo "== cargo fmt --check"
cargo fmt --all -- --check
research fmt --all -- --check
echo "== generated files are current (bindings, exports, env table, header, docs tables)"
cargo run --quiet -p xtask -- check
echo "== docs/perf.md's tables and plots match their JSON (ci/perf-doc.py)"
python3 "$root/ci/perf-doc.py" --check
echo "== cargo clippy"
# --all-features: the GPU tests (feature `gpu`) are compiled and linted here too, though they run
# only on a GPU machine.
cargo clippy --workspace --all-targets --all-features -- -D warnings
research clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
log=$(mktemp)
# A test that finds something it needs missing (nvcc, libclang, headers, numpy) records itself
# here instead of passing (crates/config/src/testing.rs); the summary names it as skipped.
skips=$(mktemp)
export FLASHCOMM_TEST_SKIPS="$skips"
trap 'rm -f "$log" "$skips"' EXIT
set +e
cargo test --workspace 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
research test --workspace 2>&1 | tee -a "$log"
research_status=${PIPESTATUS[0]}
echo "== the Python wheel (packaged from the library cargo test built), in a fresh virtual environment"
"$root/ci/wheel-test.sh" 2>&1 | tee -a "$log"
wheel_status=${PIPESTATUS[0]}
echo "== the multi-GPU check (ci/multi-gpu-check.sh): syntax, dry runs, its tables"
"$root/ci/multi-gpu-check-test.sh" 2>&1 | tee -a "$log"
multigpu_status=${PIPESTATUS[0]}
echo "== ci/demo.sh on a machine without a GPU"
"$root/ci/demo-test.sh" 2>&1 | tee -a "$log"
demo_status=${PIPESTATUS[0]}
echo "== the CUDA 12 build (sm_90) and its wheel flashcomm-cu12, in a fresh virtual environment"
cu12_target="$root/target/cu12"
(
  # shellcheck disable=SC1091
  source "$root/.toolchain/env-cu12.sh"
  FLASHCOMM_CUDA_ARCHS=90 CARGO_TARGET_DIR="$cu12_target" cargo build --quiet -p flashcomm-shim
) 2>&1 | tee -a "$log"
cu12_status=${PIPESTATUS[0]}
if [ "$cu12_status" -eq 0 ]; then
  "$root/ci/wheel-test.sh" --cuda 12 --lib "$cu12_target/debug/libnccl.so" 2>&1 | tee -a "$log"
  cu12_status=${PIPESTATUS[0]}
fi
set -e
passed=$(grep -o '[0-9]* passed' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -o '[0-9]* failed' "$log" | awk '{s+=$1} END {print s+0}')
skipped=$(grep -c . "$skips" || true)
# A skipped test returned without failing, so cargo counted it as passed: it is not.
passed=$((passed - skipped))
if [ "$skipped" -gt 0 ]; then
  echo "skipped (something they need is missing):"
  sed 's/^/  /' "$skips"
fi
# A step that stopped before its tests could count anything (a build that failed, a full disk)
# is a failure too: the summary never says 0 failed while the run fails.
broken=0
for step in "cargo test:$status" "research tools:$research_status" "wheel:$wheel_status" \
  "multi-gpu check:$multigpu_status" "demo:$demo_status" "CUDA 12 build:$cu12_status"; do
  if [ "${step##*:}" -ne 0 ]; then
    echo "step failed: ${step%:*} (status ${step##*:})"
    broken=$((broken + 1))
  fi
done
if [ "$failed" -lt "$broken" ]; then failed=$broken; fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$status" -eq 0 ] && [ "$research_status" -eq 0 ] && [ "$wheel_status" -eq 0 ] \
  && [ "$multigpu_status" -eq 0 ] && [ "$demo_status" -eq 0 ] && [ "$cu12_status" -eq 0 ] \
  && [ "$failed" -eq 0 ]
