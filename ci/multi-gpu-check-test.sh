#!/usr/bin/env bash
# CPU test of the multi-GPU check (ci/multi-gpu-check.sh), so that it cannot rot while no machine
# of several GPUs is at hand: the scripts parse (bash -n, py_compile; shellcheck when installed),
# the dry run plans every step with the right commands for 2, 4 and 8 GPUs and for one GPU, the
# time limits add up to what the script's header says, the nccl-tests table reads nccl-tests'
# output (a fixture: one clean run, one with a wrong element) and the summary is written. Needs
# no GPU, no build and no network; takes a few seconds. Ends with "N passed, N failed".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
script="$root/ci/multi-gpu-check.sh"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-multigpu-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; }
check() { # description command...
  local what=$1; shift
  if "$@" > "$tmp/out" 2>&1; then ok "$what"; else bad "$what"; sed 's/^/     /' "$tmp/out" | tail -n 20; fi
}
has() { grep -qF -- "$2" "$1" || { echo "missing: $2"; return 1; }; }

for f in ci/multi-gpu-check.sh ci/multi-gpu-check-test.sh ci/gpu-run.sh ci/gpu-bundle.sh; do
  check "bash -n $f" bash -n "$root/$f"
done
for f in ci/nccl-tests-table.py ci/multi-gpu-summary.py tests/python/tp_forward.py; do
  check "py_compile $f" python3 -c "import sys, py_compile; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)" "$root/$f" "$tmp/x.pyc"
done
if command -v shellcheck > /dev/null; then
  check "shellcheck ci/multi-gpu-check.sh" shellcheck -S error "$script"
else
  echo "note shellcheck is not installed: only bash -n checked the scripts"
fi

# The dry run for each machine size.
header_sum() { sed -n "s/^# Sum: \([0-9]*\) s .* with several GPUs, \([0-9]*\) s with one.*/\1 \2/p" "$script"; }
read -r sum_multi sum_one <<<"$(header_sum)"
plan_ok() { # gpus|one file
  local n=$1 f=$2 s
  for s in 0 1 2 3 4; do has "$f" "step $s: " || return 1; done
  if [ "$n" = one ]; then
    has "$f" "sum to ${sum_one}s" && has "$f" "FLASHCOMM_TEST_PROCESSES=4" && has "$f" "nvidia-cuda-mps-control -d" \
      && has "$f" " -g 1 -b 8 -e 16M" && has "$f" "--mode virtual --ranks 8" && has "$f" "--world-size 1" \
      && has "$f" "sweep_4_ranks" && has "$f" "--mode procs --ranks 1 --impl flashcomm,nccl"
  else
    has "$f" "sum to ${sum_multi}s" && has "$f" "FLASHCOMM_TEST_GPUS=$n FLASHCOMM_TEST_PROCESSES=$n" \
      && has "$f" "FLASHCOMM_TRANSPORT=p2p" && has "$f" "FLASHCOMM_TRANSPORT=host" \
      && has "$f" " -t 1 -g $n -b 8 -e 16M -f 8 -d all" && has "$f" " -G 10 " \
      && has "$f" "LD_PRELOAD=" && has "$f" "--mode gpus --ranks $n --impl nccl,reference,pull-reference,flashcomm" \
      && has "$f" "--impl nccl,reference,flashcomm" && has "$f" "-b 2M -e 256M" && has "$f" "-b 8K -e 1M" \
      && has "$f" "--world-size $n" && has "$f" "tp_forward.py" && has "$f" "sweep_${n}_ranks" \
      && has "$f" "quantized_${n}_ranks" && ! grep -q "nvidia-cuda-mps-control" "$f"
  fi
}
for n in 2 4 8 one; do
  args=(--gpus "$n"); [ "$n" = one ] && args=(--one-gpu)
  if "$script" /bundle /results --dry-run "${args[@]}" > "$tmp/plan-$n" 2>&1; then
    check "dry run ($n): every step and the commands of this size" plan_ok "$n" "$tmp/plan-$n"
  else
    bad "dry run ($n) exits 0"; tail -n 5 "$tmp/plan-$n"
  fi
done
check "the limits add up: 9.5 minutes at most with several GPUs" test "${sum_multi:-999}" -le 570
check "a bad option is refused" bash -c "! '$script' /b /r --bogus 2>/dev/null"
check "run.sh runs the one-GPU mode" has "$root/ci/gpu-run.sh" 'add "multigpu::one_gpu_mode"'
check "the bundle carries the check, its summary and table scripts" has "$root/ci/gpu-bundle.sh" \
  "cp ci/multi-gpu-check.sh ci/multi-gpu-summary.py ci/nccl-tests-table.py"

# The nccl-tests table on a fixture in nccl-tests' format.
mkdir -p "$tmp/nt"
row() { printf '%12s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n' "$@"; }
{
  echo "# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809"
  echo "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
  row 8 2 float sum -1 10.50 0.00 0.00 0 9.80 0.00 0.00 0
  row 1024 512 bfloat16 sum -1 12.00 0.09 0.13 0 11.00 0.09 0.14 0
  echo "# Out of bounds values : 0 OK"
  echo "# Avg bus bandwidth    : 0.07 "
} > "$tmp/nt/all_reduce.eager.nccl.log"
{
  echo "# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809"
  row 8 2 float sum -1 5.25 0.00 0.00 0 5.00 0.00 0.00 0
  row 1024 512 bfloat16 sum -1 6.00 0.17 0.26 3 6.10 0.17 0.25 0
  echo "# Out of bounds values : 3 FAILED"
} > "$tmp/nt/all_reduce.eager.flashcomm.log"
echo "0 1.5" > "$tmp/nt/all_reduce.eager.nccl.rc"
echo "1 1.2" > "$tmp/nt/all_reduce.eager.flashcomm.rc"
table_ok() {
  python3 "$root/ci/nccl-tests-table.py" "$tmp/nt" --json "$tmp/nt.json" --md "$tmp/nt.md" > "$tmp/nt.out" || return 1
  has "$tmp/nt.out" "nccl-tests: 2 runs, 1 passed, 1 failed" \
    && has "$tmp/nt.md" "| 1K | bfloat16 | sum | 12.00 | 6.00 | 0.50 | 0.13 | 0.26 | 0/0 | 3/0 |" \
    && has "$tmp/nt.md" "| all_reduce | eager | flashcomm | 1024 | bfloat16 | sum | 3 | 0 |" \
    && python3 -c "
import json, sys
runs = {r['impl']: r for r in json.load(open(sys.argv[1]))['runs']}
assert runs['nccl']['passed'] and not runs['flashcomm']['passed'], runs
assert runs['flashcomm']['wrong'] == 3 and runs['flashcomm']['out_of_bounds'] == 3
assert len(runs['nccl']['rows']) == 2 and runs['nccl']['rows'][1]['in_place']['time_us'] == 11.0
" "$tmp/nt.json"
}
check "nccl-tests table: side by side, #wrong and out-of-bounds found" table_ok

# The summary of a (made-up) partial run.
mkdir -p "$tmp/work/logs" "$tmp/res"
printf '20\n150\n190\n100\n100\n' > "$tmp/work/limits"
printf 'mode: 2 GPUs\n' > "$tmp/work/environment.txt"
printf '0\tset-up\tpass\t3\t20\t\n1\tsuite::p2p::processes::x\tpass\t4.5\t60\t\n2\tnccl-tests::build\tskipped\t0\t150\tnot run: no nccl-tests source in the bundle\n3\tperf::a\tnot-run\t0\t45\tthe step'"'"'s time limit was reached\n' > "$tmp/work/records.tsv"
summary_ok() {
  python3 "$root/ci/multi-gpu-summary.py" "$tmp/work" "$tmp/res" || return 1
  has "$tmp/res/summary.md" "1 passed, 0 failed, 1 not run (time limit), 1 not run (missing" \
    && has "$tmp/res/summary.md" "| 1 | GPU test suite | 150 | 4.5 | 1 | 0 | 0 |" \
    && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['counts']=={'pass':1,'fail':0,'not-run':1,'skipped':1}, d['counts']" "$tmp/res/summary.json"
}
check "summary.md and summary.json of a partial run" summary_ok

echo "multi-gpu-check: $passed passed, $failed failed"
[ $failed -eq 0 ]
