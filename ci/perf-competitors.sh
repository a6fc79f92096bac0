#!/usr/bin/env bash
# flashcomm's AllReduce beside its competitors in flashcomm-perf (docs/perf-tool.md,
# "Competitors in flashcomm-perf"): the plain reference and the pull reference (1-stage, 2-stage, the better of the
# two), each launched per rank and as one grid for every rank, at 2, 4 and 8 virtual ranks (or
# rank processes: PERF_MODE below), bf16 and f16, 8 KiB..16 MiB by factors of 2, eager and under
# CUDA graphs; one run per rank count.
#
#   ci/perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]     # on the GPU machine
#
# Writes comp-n<n>.json and comp-n<n>.txt into <results-dir>; ci/perf-competitors-table.py
# <results-dir> prints the tables. PERF_MAX (default 16M) lowers the largest size. PERF_MODE
# (default virtual) is the tool's --mode: with procs-one-gpu every rank is a process of its own on
# one GPU, as in a serving stack (the references' buffers mapped through CUDA IPC at set-up), under
# the CUDA MPS daemon that the script starts and stops; the references are then launched per rank
# only (one grid for every rank needs the ranks in one process). Give each mode its own
# <results-dir> (the JSON's settings.mode says which ran).
set -uo pipefail
here=$(cd "${1:?usage: perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]}" && pwd)
res=${2:?usage: perf-competitors.sh <bundle-dir> <results-dir> [ranks ...]}
shift 2
ranks=("$@")
[ ${#ranks[@]} -eq 0 ] && ranks=(2 4 8)
mode=${PERF_MODE:-virtual}
# Threads of one process (virtual, gpus): a hardware queue per stream. One rank per process: no
# queue sharing to avoid, and under MPS 32 queues per client exhaust the server (as ci/gpu-run.sh
# runs rank processes). One grid for every rank needs every rank in one process on one GPU.
case "$mode" in
  virtual) ref_launch=per-rank,single ;;
  gpus) ref_launch=per-rank ;;
  procs | procs-one-gpu) ref_launch=per-rank; unset CUDA_DEVICE_MAX_CONNECTIONS ;;
  *) echo "perf-competitors.sh: PERF_MODE=$mode: virtual, gpus, procs or procs-one-gpu" >&2; exit 2 ;;
esac
case "$mode" in virtual | gpus) export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} ;; esac
mkdir -p "$res"
export NCCL_NVLS_ENABLE=0
if [ "$mode" = procs-one-gpu ]; then
  # Rank processes sharing one GPU need CUDA MPS to run their kernels concurrently.
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
[ -d "$here/kernels" ] && export FLASHCOMM_KERNEL_DIR="$here/kernels"
perf="$here/bin/flashcomm-perf"
status=0
for n in "${ranks[@]}"; do
  "$perf" --mode "$mode" --ranks "$n" --impl reference,pull-reference,flashcomm \
    --ref-launch "$ref_launch" -d bfloat16,half -b 8K -e "${PERF_MAX:-16M}" -f 2 \
    -n 100 -w 5 -G 20 --launch both --timeout 20 --json "$res/comp-n$n.json" \
    > "$res/comp-n$n.txt" 2>&1 || status=1
done
exit $status
