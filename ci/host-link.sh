#!/usr/bin/env bash
# Builds the host link probes (cuda/bench/host_link.cu and host_schedules.cu) into <dir>:
#
#   ci/host-link.sh <dir>            # here (needs the CUDA toolchain of ci/setup.sh)
#   <dir>/host_link [MiB...]         # on the GPU machine (no toolchain needed)
#   <dir>/host_schedules [MiB...]
#
# FLASHCOMM_CUDA_ARCHS picks the architecture (default 90).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: ci/host-link.sh <dir>}
mkdir -p "$out"
out=$(cd "$out" && pwd)
"$root/ci/setup.sh" >/dev/null
source "$root/.toolchain/env.sh"
arch=${FLASHCOMM_CUDA_ARCHS:-90}
arch=${arch%%;*}
# From the repository root with relative paths, so that the probes' messages (__FILE__) name
# cuda/bench/..., not the folder this was built in.
cd "$root"
for probe in host_link host_schedules; do
  "$NVCC" -std=c++17 -O3 -arch="sm_$arch" -I cuda/include -cudart static -L "$CUDA_HOME/lib" \
    -o "$out/$probe" "cuda/bench/$probe.cu"
done
