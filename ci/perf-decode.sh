#!/usr/bin/env bash
# The decode-latency measurements (docs/perf.md, "Decode latency"): flashcomm's AllReduce
# against the plain reference kernel and the pull reference (1-stage, 2-stage) at 2, 4 and 8
# virtual ranks, bf16, 8 KiB..1 MiB by factors of 2, under CUDA graphs: the selector's plan with
# the reference rows of the same run, then every forced plan (one-shot/two-shot x LL/BLOCK) for
# the "best forced plan" column; and the one-rank communicator against a device copy, out of
# place and in place.
#
#   ci/perf-decode.sh <bundle-dir> <results-dir> [ranks ...]     # on the GPU machine
#
# Writes one JSON file and one table per run into <results-dir>. The run with the reference is
# repeated PERF_RUNS times (default 3: ref-n<n>-r<i>.json); ci/perf-decode-table.py reports the
# medians and whether the selector chose the same plans in every run.
set -uo pipefail
here=$(cd "${1:?usage: perf-decode.sh <bundle-dir> <results-dir> [ranks ...]}" && pwd)
res=${2:?usage: perf-decode.sh <bundle-dir> <results-dir> [ranks ...]}
shift 2
ranks=("$@")
[ ${#ranks[@]} -eq 0 ] && ranks=(2 4 8)
mkdir -p "$res"
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
[ -d "$here/kernels" ] && export FLASHCOMM_KERNEL_DIR="$here/kernels"
perf="$here/bin/flashcomm-perf"
common=(--mode virtual -d bfloat16 -b 8K -e 1M -f 2 -n 100 -w 5 -G 20 --timeout 20)
status=0
runs=${PERF_RUNS:-3}
for n in "${ranks[@]}"; do
  for i in $(seq 1 "$runs"); do
    "$perf" --ranks "$n" --impl reference,pull-reference,flashcomm "${common[@]}" --json "$res/ref-n$n-r$i.json" \
      > "$res/ref-n$n-r$i.txt" 2>&1 || status=1
  done
  for a in oneshot twoshot; do
    for p in ll block; do
      "$perf" --ranks "$n" --impl flashcomm --algo $a --proto $p --calibrate 0 "${common[@]}" \
        --json "$res/forced-n$n-$a-$p.json" > "$res/forced-n$n-$a-$p.txt" 2>&1 || status=1
    done
  done
done
"$perf" --ranks 1 --impl flashcomm --copy-baseline --inplace 1 "${common[@]}" \
  --json "$res/one-rank.json" > "$res/one-rank.txt" 2>&1 || status=1
exit $status
