#!/usr/bin/env bash
# The main job, for a machine with NVIDIA GPUs, Rust and Python: builds the library and
# flashcomm-perf, then
#   1. runs an AllReduce sweep through flashcomm's kernels on the GPUs present (one process per GPU
#      when there are several, eight virtual ranks on one GPU otherwise), lossless and at 4 bits,
#      printing an nccl-tests-style table (size, count, type, time, algbw, busbw, #wrong, and the
#      error columns of the quantized rows);
#   2. if PyTorch is installed, runs torch.distributed all_reduce with the library preloaded and
#      prints PASS/FAIL lines and which route (lossless or NCCL) each call took.
# Results go to the folder given as the first argument (default: ./results-local).
#
# Without a GPU it says so at once, before the toolchain and the CUDA build (minutes), shows what
# runs without one (the CPU reference codec's error table for the default widths, in seconds)
# and exits with status 1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/results-local}

# A GPU first: everything below needs one.
gpus=0 why=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  why="nvidia-smi is not installed"
elif ! listing=$(nvidia-smi -L 2>&1); then
  why="nvidia-smi -L failed: $(head -n 1 <<<"$listing")"
else
  gpus=$(grep -c '^GPU ' <<<"$listing" || true)
  [ "$gpus" -gt 0 ] || why="nvidia-smi lists no GPU"
fi
if [ "$gpus" -eq 0 ]; then
  echo "ci/demo.sh: no NVIDIA GPU found ($why): the demo runs flashcomm's kernels and needs one." >&2
  echo "Without a GPU, this runs: the CPU reference codec's error table for the default widths" >&2
  echo "(docs/codec.md); ci/test.sh runs every CPU test." >&2
  if command -v cargo >/dev/null 2>&1; then
    (cd "$root" && cargo run --quiet -p flashcomm-codec --example error_table)
  else
    echo "(cargo is not installed, so not even that: see README.md, 'Set-up')" >&2
  fi
  exit 1
fi

mkdir -p "$out"
"$root/ci/setup.sh" > /dev/null
# shellcheck disable=SC1091
source "$root/.toolchain/env.sh"
export FLASHCOMM_REQUIRE_KERNELS=1 NCCL_NVLS_ENABLE=0
cd "$root"
cargo build --release -p flashcomm-shim -p flashcomm-perf
lib="$root/target/release/libnccl.so"
if [ "$gpus" -gt 1 ]; then mode="--mode gpus --ranks $gpus"; else mode="--mode virtual --ranks 8"; fi
# shellcheck disable=SC2086
target/release/flashcomm-perf $mode -b 8K -e 64M -f 4 --coll allreduce -d bfloat16 --quant 16,4 \
  --json "$out/demo-allreduce.json"
if python3 -c 'import torch' 2>/dev/null; then
  ws=$gpus
  LD_PRELOAD="$lib" python3 tests/python/torch_preload.py --world-size "$ws"
fi
