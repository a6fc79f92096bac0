#!/usr/bin/env bash
# flashcomm's AllReduce beside its competitors in flashcomm-perf (docs/perf-tool.md,
# "Competitors in flashcomm-perf"): the plain reference and the pull reference (1-stage, 2-stage, the better of the
# two), each launched per rank and as one grid for every rank, at 2, 4 and 8 virtual ranks, bf16
# and f16, 8 KiB..16 MiB by factors of 2, eager and under CUDA graphs; one run per rank count.
#
#   ci/perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]     # on the GPU machine
#
# Writes comp-n<n>.json and comp-n<n>.txt into <results-dir>; ci/perf-competitors-table.py
# <results-dir> prints the tables. PERF_MAX (default 16M) lowers the largest size.
set -uo pipefail
here=$(cd "${1:?usage: perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]}" && pwd)
res=${2:?usage: perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]}
shift 2
ranks=("$@")
[ ${#ranks[@]} -eq 0 ] && ranks=(2 4 8)
mkdir -p "$res"
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
[ -d "$here/kernels" ] && export FLASHCOMM_KERNEL_DIR="$here/kernels"
perf="$here/bin/flashcomm-perf"
status=0
for n in "${ranks[@]}"; do
  "$perf" --mode virtual --ranks "$n" --impl reference,pull-reference,flashcomm \
    --ref-launch per-rank,single -d bfloat16,half -b 8K -e "${PERF_MAX:-16M}" -f 2 \
    -n 100 -w 5 -G 20 --launch both --timeout 20 --json "$res/comp-n$n.json" \
    > "$res/comp-n$n.txt" 2>&1 || status=1
done
exit $status
