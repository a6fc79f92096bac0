#!/usr/bin/env bash
# Builds everything the GPU tests need into one folder that can be copied to a GPU machine that
# has no Rust toolchain and no network: the library (as libnccl.so.2) and the Python wheel made
# from it, the GPU test executables, the tools, the C and Python test programs, and run.sh, which
# runs them all there.
#
#   ci/gpu-bundle.sh [--cuda 12] <bundle-dir>   # here (needs ci/setup.sh's toolchain)
#   <bundle-dir>/run.sh <results-dir>           # on the GPU machine; ends with "N passed, N failed"
#
# --cuda 12 bundles the CUDA 12 build (docs/cuda12.md): the library, the GPU test executables and
# every kernel compiled by `ci/setup.sh --cuda 12`'s compiler (in target/bundle-cu12 unless
# CARGO_TARGET_DIR is set), and the flashcomm-cu12 wheel; run.sh records the compiler
# (<bundle-dir>/COMPILER) in environment.txt. The host link probes of bin/ stay CUDA 13 builds
# (ci/host-link.sh: they link the CUDA runtime; run.sh does not run them).
#
# FLASHCOMM_CUDA_ARCHS (default 90, the H200) selects the GPU architectures compiled in. The
# binaries do not embed the kernels: the fatbins (machine code only) are shipped once in
# <bundle-dir>/kernels and run.sh points FLASHCOMM_KERNEL_DIR there, which keeps the bundle small.
#
# The check of a machine with several GPUs, <bundle-dir>/multi-gpu-check.sh (ci/multi-gpu-check.sh,
# docs/testing.md), can also use, when these are set:
#   NCCL_TESTS_SRC=<dir>          a source tree of NVIDIA's nccl-tests (a tagged release, for
#                                 example v2.19.6 of github.com/NVIDIA/nccl-tests), copied into
#                                 <bundle-dir>/nccl-tests and built on the GPU machine (about 1 MiB)
#   FLASHCOMM_BUNDLE_MODEL=<file> SmolLM2-135M-Instruct.Q4_1.gguf (ci/get-model.sh), copied into
#                                 <bundle-dir>/model (94 MiB)
#   FLASHCOMM_BUNDLE_TEXT=<file>  WikiText-2's test.txt: its first 8,192 token ids, as the accuracy
#                                 study's tokenizer encodes them, go to
#                                 <bundle-dir>/model/wikitext2-test.ids (needs the model)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cuda=13
if [ "${1:-}" = --cuda ]; then cuda=${2:?--cuda takes 12 or 13}; shift 2; fi
out=${1:?usage: ci/gpu-bundle.sh [--cuda 12] <bundle-dir>}
mkdir -p "$out"
out=$(cd "$out" && pwd)
case "$cuda" in
  13) envsh=env.sh target="$root/target/bundle";;
  12) envsh=env-cu12.sh target="$root/target/bundle-cu12";;
  *) echo "gpu-bundle: --cuda takes 12 or 13" >&2; exit 2;;
esac
"$root/ci/setup.sh" --cuda "$cuda" >/dev/null
# shellcheck disable=SC1090
source "$root/.toolchain/$envsh"
export FLASHCOMM_REQUIRE_KERNELS=1 FLASHCOMM_EMBED_KERNELS=0 FLASHCOMM_CUDA_PTX=0
export FLASHCOMM_CUDA_ARCHS=${FLASHCOMM_CUDA_ARCHS:-90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$target}
cd "$root"

rm -rf "$out/bin" "$out/lib" "$out/tests" "$out/python" "$out/c" "$out/kernels" "$out/wheel" \
  "$out/nccl-tests" "$out/model"
mkdir -p "$out/bin" "$out/lib" "$out/tests" "$out/python" "$out/c" "$out/kernels"

# The library and the tools.
cargo build --release -p flashcomm-shim --quiet
cp "$CARGO_TARGET_DIR/release/libnccl.so" "$out/lib/libnccl.so.2"
cargo build --release -p flashcomm-perf -p flashcomm-testkit --features flashcomm-testkit/gpu --examples --bins --quiet \
  && cp "$CARGO_TARGET_DIR/release/flashcomm-perf" "$out/bin/" \
  && { cp "$CARGO_TARGET_DIR/release/examples/codec_bench" "$out/bin/" 2>/dev/null || true; }
# The host link probes (cuda/bench/host_link.cu, host_schedules.cu; docs/experiments.md).
"$root/ci/host-link.sh" "$out/bin" >/dev/null
# The fatbins of the build that produced these binaries: the product's modules and the test-only
# ones (both crates load theirs from FLASHCOMM_KERNEL_DIR in a bundle).
# The newest complete kernel build (an interrupted build can leave fatbins without images.rs).
for crate in flashcomm-kernels flashcomm-testkit; do
  fatdir=$(dirname "$(ls -t "$CARGO_TARGET_DIR"/release/build/$crate-*/out/images.rs | head -n 1)")
  for m in $(sed -n 's/^ *("\([a-z0-9_]*\)", .*/\1/p' "$fatdir/images.rs"); do cp "$fatdir/$m.fatbin" "$out/kernels/"; done
done

# GPU test executables (cargo test --features gpu --no-run), one per test target.
python3 - "$out/tests" <<'PY'
import json, os, shutil, subprocess, sys
dest = sys.argv[1]
pkgs = ["flashcomm-comm", "flashcomm-kernels", "flashcomm-testkit"]
cmd = ["cargo", "test", "--release", "--no-run", "--message-format=json", "--features", ",".join(p + "/gpu" for p in pkgs)]
for p in pkgs:
    cmd += ["-p", p]
res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
if res.returncode != 0:
    sys.exit("building the GPU tests failed")
for line in res.stdout.splitlines():
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        name = m["target"]["name"]
        if not name.startswith("gpu"):
            continue
        exe = m["executable"]
        pkg = m["target"]["src_path"].split("/crates/")[1].split("/")[0]
        shutil.copy(exe, os.path.join(dest, f"{pkg}-{name}"))
PY
for f in "$out"/tests/* "$out"/bin/*; do [ -f "$f" ] && strip "$f" 2>/dev/null || true; done
strip --strip-debug "$out/lib/libnccl.so.2"
# The Python wheel, packaged from this library by the same script as the shipped wheel (this one
# loads its kernels from FLASHCOMM_KERNEL_DIR, like every binary of the bundle); run.sh installs it
# and runs the torch test through its launcher.
"$root/ci/build-wheel.sh" --cuda "$cuda" --lib "$out/lib/libnccl.so.2" --out "$out/wheel" >/dev/null

# C and Python test programs.
if [ -d tests/c ]; then
  cp tests/c/*.c "$out/c/" 2>/dev/null || true
  for src in tests/c/*.c; do
    [ -f "$src" ] || continue
    exe="$out/c/$(basename "${src%.c}")"
    cc -O2 -o "$exe" "$src" -I"$FLASHCOMM_NCCL_HOME/include" -I"$FLASHCOMM_CUDA_INCLUDE" \
      -L"$out/lib" -l:libnccl.so.2 -ldl -Wl,-rpath,'$ORIGIN/../lib' 2>"$exe.build.log" || echo "note: $src did not build (see $exe.build.log)"
  done
  # The one-rank stand-in for the real NCCL of the long lifecycle test.
  cc -O2 -shared -fPIC -o "$out/c/libsolo_nccl.so" tests/c/solo/solo_nccl.c -ldl \
    2>"$out/c/libsolo_nccl.build.log" || echo "note: tests/c/solo/solo_nccl.c did not build"
fi
cp tests/python/*.py "$out/python/" 2>/dev/null || true
cp ci/gpu-run.sh "$out/run.sh"
chmod +x "$out/run.sh"
# The check of a machine with several GPUs, its summary and the nccl-tests table.
cp ci/multi-gpu-check.sh ci/multi-gpu-summary.py ci/nccl-tests-table.py "$out/"
if [ -n "${NCCL_TESTS_SRC:-}" ]; then
  [ -f "$NCCL_TESTS_SRC/src/Makefile" ] || { echo "NCCL_TESTS_SRC=$NCCL_TESTS_SRC is not an nccl-tests source tree" >&2; exit 1; }
  mkdir -p "$out/nccl-tests"
  tar -C "$NCCL_TESTS_SRC" --exclude=.git --exclude=./build -cf - . | tar -C "$out/nccl-tests" -xf -
fi
if [ -n "${FLASHCOMM_BUNDLE_MODEL:-}" ]; then
  mkdir -p "$out/model"
  cp "$FLASHCOMM_BUNDLE_MODEL" "$out/model/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -n "${FLASHCOMM_BUNDLE_TEXT:-}" ]; then
    (cd tools/research && cargo build --release --quiet -p flashcomm-study --example encode)
    ids=$(mktemp)
    "$CARGO_TARGET_DIR/release/examples/encode" "$FLASHCOMM_BUNDLE_MODEL" "$FLASHCOMM_BUNDLE_TEXT" "$ids"
    head -n 8192 "$ids" > "$out/model/wikitext2-test.ids"
    rm -f "$ids"
  fi
fi
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
"$NVCC" --version | tail -n 1 > "$out/COMPILER"
du -sh "$out"
