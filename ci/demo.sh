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
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/results-local}
mkdir -p "$out"
"$root/ci/setup.sh" > /dev/null
# shellcheck disable=SC1091
source "$root/.toolchain/env.sh"
export FLASHCOMM_REQUIRE_KERNELS=1 NCCL_NVLS_ENABLE=0
cd "$root"
cargo build --release -p flashcomm-shim -p flashcomm-perf
lib="$root/target/release/libnccl.so"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -eq 0 ]; then
  echo "no NVIDIA GPU found: the demo needs one" >&2
  exit 1
fi
if [ "$gpus" -gt 1 ]; then mode="--mode gpus --ranks $gpus"; else mode="--mode virtual --ranks 8"; fi
# shellcheck disable=SC2086
target/release/flashcomm-perf $mode -b 8K -e 64M -f 4 --coll allreduce -d bfloat16 --quant 16,4 \
  --json "$out/demo-allreduce.json"
if python3 -c 'import torch' 2>/dev/null; then
  ws=$gpus
  LD_PRELOAD="$lib" python3 tests/python/torch_preload.py --world-size "$ws"
fi
