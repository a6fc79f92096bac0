#!/usr/bin/env bash
# Runs every GPU test of a bundle made by ci/gpu-bundle.sh, on a machine with NVIDIA GPUs.
#
#   run.sh <results-dir> [pattern ...]
#
# Each pattern (a bash regular expression over test names) selects tests, in the order given;
# without patterns every test runs. FLASHCOMM_DEADLINE=<seconds> stops starting new tests after
# that long (they are reported as not run, never as passed). Writes summary.json, environment.txt,
# logs.tar.gz (one log per test) and the benchmark JSON files into <results-dir>; the last line
# is "N passed, N failed" (plus how many were not run, if any).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
res=${1:?usage: run.sh <results-dir> [pattern ...]}
shift
mkdir -p "$res/logs"
res=$(cd "$res" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Virtual ranks: one hardware work queue per stream (the driver's default of 8 makes ranks'
# streams share queues, where one rank's ordered command can hold a peer's kernel: docs/testing.md).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
# Bundles ship the kernels once, next to the binaries (see ci/gpu-bundle.sh).
[ -d "$here/kernels" ] && export FLASHCOMM_KERNEL_DIR="$here/kernels"
lib="$here/lib/libnccl.so.2"
# The real NCCL for programs that do not load PyTorch (C, ctypes): the one PyTorch's wheel ships.
real=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib','libnccl.so.2'))" 2>/dev/null || true)

{
  echo "commit: $(cat "$here/COMMIT" 2>/dev/null)"
  echo "kernels compiled by: $(cat "$here/COMPILER" 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  ldd --version 2>&1 | head -n 1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
  echo "real NCCL for C/ctypes programs: $real"
} > "$res/environment.txt"

# The Python wheel of the bundle (ci/build-wheel.sh), installed into a fresh virtual environment
# that sees this machine's packages (torch, nvidia-nccl-cu13 or -cu12), without network: the torch
# test runs through its launcher, as users run it. Without venv's pip, the machine's pip installs
# into the environment (--python) or, failing that, into a folder run through PYTHONPATH.
launcher=""
whl=$(ls "$here"/wheel/flashcomm_cu*-*.whl 2>/dev/null | head -n 1)
if [ -n "$whl" ]; then
  venv=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-venv.XXXXXX")
  {
    if python3 -m venv --system-site-packages "$venv/env"; then
      "$venv/env/bin/python" -m pip install --no-deps --no-index "$whl"
    elif python3 -m venv --without-pip --system-site-packages "$venv/env"; then
      python3 -m pip --python "$venv/env/bin/python" install --no-deps --no-index "$whl"
    fi
  } > "$res/logs/wheel-install.log" 2>&1
  if [ -x "$venv/env/bin/flashcomm" ]; then
    launcher="$venv/env/bin/flashcomm"
  elif python3 -m pip install --no-deps --no-index --target "$venv/site" "$whl" >> "$res/logs/wheel-install.log" 2>&1; then
    printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m flashcomm "$@"\n' "$venv/site" > "$venv/flashcomm"
    chmod +x "$venv/flashcomm"
    launcher="$venv/flashcomm"
  fi
fi
echo "flashcomm wheel: ${whl:-none in the bundle}; launcher: ${launcher:-not installed (logs/wheel-install.log)}" >> "$res/environment.txt"
cat "$res/environment.txt"

# Runs a command, shows its output, and fails unless it succeeded and printed a line matching the
# pattern (first argument, an extended regular expression).
expect_line() {
  local pat=$1 out rc
  shift
  out=$("$@" 2>&1); rc=$?
  printf '%s\n' "$out"
  [ $rc -eq 0 ] || return $rc
  grep -qE -- "$pat" <<<"$out" || { echo "FAIL no line matches: $pat"; return 1; }
}
export -f expect_line

# Every test: name, time limit (s), command.
names=(); limits=(); cmds=()
add() { names+=("$1"); limits+=("$2"); cmds+=("$3"); }
for t in "$here"/tests/*; do
  [ -x "$t" ] || continue
  for case in $("$t" --list 2>/dev/null | sed -n 's/: test$//p'); do
    # Entry points of child processes are not tests of their own.
    [ "$case" = child_process_entry ] && continue
    cmd="'$t' --exact '$case' --nocapture --test-threads=1"
    # Rank processes sharing one GPU need CUDA MPS to run their kernels concurrently.
    case "$(basename "$t")" in *gpu_processes)
      # One rank per process: no queue sharing to avoid, and under MPS 32 queues per client
      # exhaust the server (context creation fails with CUDA_ERROR_OUT_OF_MEMORY).
      cmd="unset CUDA_DEVICE_MAX_CONNECTIONS; nvidia-cuda-mps-control -d; $cmd; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc";;
    esac
    add "$(basename "$t")::$case" "${FLASHCOMM_TEST_LIMIT:-300}" "$cmd"
    # The collectives in rank processes run with zero-copy (the default) and without it.
    case "$(basename "$t")::$case" in *gpu_processes::processes_exchange_through_ipc|*gpu_processes::stress_100k_random_collectives_across_processes)
      add "$(basename "$t")::${case}_zero_copy_off" "${FLASHCOMM_TEST_LIMIT:-300}" "export FLASHCOMM_ZERO_COPY=0; $cmd";;
    esac
  done
done
[ -x "$here/c/abi_smoke" ] && add "c::abi_smoke_gpu" 120 "FLASHCOMM_NCCL_LIB='$real' '$here/c/abi_smoke' --gpu"
[ -x "$here/c/abi_smoke" ] && add "c::abi_smoke_gpu_grouped_alltoall" 120 "FLASHCOMM_GROUPED_ALLTOALL=1 FLASHCOMM_NCCL_LIB='$real' '$here/c/abi_smoke' --gpu"
[ -x "$here/c/abi_smoke" ] && add "c::abi_smoke_gpu_check_pointers" 120 "NCCL_CHECK_POINTERS=1 FLASHCOMM_NCCL_LIB='$real' '$here/c/abi_smoke' --gpu"
[ -x "$here/c/overhead" ] && add "c::overhead" 300 "FLASHCOMM_NCCL_LIB='$real' '$here/c/overhead' '$lib'"
# Communicator lifecycles through the real NCCL (init, split, destroy): 100 cycles by default,
# because the real ncclCommDestroy alone takes about 0.5 s per communicator on the H200 (1,000
# cycles take about 18 minutes; FLASHCOMM_LIFECYCLE_CYCLES=1000 runs them).
[ -x "$here/c/lifecycle" ] && add "c::lifecycle_cycles" 600 "FLASHCOMM_NCCL_LIB='$real' '$here/c/lifecycle' '$lib' \${FLASHCOMM_LIFECYCLE_CYCLES:-100}"
# The same program for 1,000 cycles with a one-rank stand-in for the real NCCL
# (tests/c/solo/solo_nccl.c), whose destroy is free: everything flashcomm does per communicator.
[ -x "$here/c/lifecycle" ] && [ -f "$here/c/libsolo_nccl.so" ] && add "c::lifecycle_1000_cycles_solo_nccl" 300 "FLASHCOMM_NCCL_LIB='$here/c/libsolo_nccl.so' '$here/c/lifecycle' '$lib' 1000"
[ -x "$here/c/alloc_count" ] && add "c::alloc_count" 120 "FLASHCOMM_NCCL_LIB='$real' '$here/c/alloc_count' '$lib'"
# Bad input on a served communicator: NULL buffers refused by flashcomm, the rest the real library's.
[ -x "$here/c/served_bad_input" ] && add "c::served_bad_input" 120 "FLASHCOMM_NCCL_LIB='$real' '$here/c/served_bad_input' '$lib'"
[ -x "$here/c/served_bad_input" ] && [ -f "$here/c/libsolo_nccl.so" ] && add "c::served_bad_input_solo_nccl" 120 "FLASHCOMM_NCCL_LIB='$here/c/libsolo_nccl.so' '$here/c/served_bad_input' '$lib'"
[ -f "$here/python/ctypes_load.py" ] && add "python::ctypes_load_gpu" 300 "FLASHCOMM_NCCL_LIB='$real' python3 '$here/python/ctypes_load.py' --lib '$lib' --gpu"
# Through the installed wheel's launcher (no hand-set LD_PRELOAD), with the engagement line shown.
[ -f "$here/python/torch_preload.py" ] && add "python::torch_preload_ws1" 600 "[ -n '$launcher' ] || { echo 'FAIL the wheel is not installed (logs/wheel-install.log)'; exit 1; }; expect_line 'FLASHCOMM INFO flashcomm .* is on: .* served by flashcomm' '$launcher' run --debug VERSION -- python3 '$here/python/torch_preload.py' --world-size 1"
[ -f "$here/python/torch_preload.py" ] && add "python::torch_preload_ws1_grouped_alltoall" 600 "FLASHCOMM_GROUPED_ALLTOALL=1 python3 '$here/python/torch_preload.py' --lib '$lib' --world-size 1"
[ -f "$here/python/torch_quant.py" ] && add "python::torch_quant_ws1" 600 "python3 '$here/python/torch_quant.py' --lib '$lib' --world-size 1"
[ -f "$here/python/torch_quant.py" ] && add "python::torch_quant_ws1_ops" 600 "python3 '$here/python/torch_quant.py' --lib '$lib' --world-size 1 --ops --max-bytes 16M"
[ -f "$here/python/torch_quant.py" ] && add "python::torch_quant_ws1_twostep_4_8" 600 "python3 '$here/python/torch_quant.py' --lib '$lib' --world-size 1 --algo twoshot --bits 4 --ag-bits 8"
if [ -x "$here/bin/flashcomm-perf" ]; then
  add "perf::latency_8_virtual_ranks" 300 "'$here/bin/flashcomm-perf' --preset latency --json '$res/perf-latency.json'"
  # The reference kernels (plain and pull, launched per rank and as one grid) beside flashcomm at
  # sizes that end in a partial 16-byte vector (6 B, 30 B, ... by factors of 5), every type, eager
  # and graph, each row checked (#wrong makes the tool exit 1).
  add "perf::references_odd_sizes_3_and_8_virtual_ranks" 300 "for n in 3 8; do '$here/bin/flashcomm-perf' --mode virtual --ranks \$n --impl reference,pull-reference,flashcomm --ref-launch per-rank,single -d all -b 6 -e 4M -f 5 -n 3 -w 1 -G 2 --launch both --timeout 20 --json '$res/perf-references-n'\$n'.json' || exit 1; done"
  add "perf::allreduce_quant_sweep_8_virtual_ranks" 300 "'$here/bin/flashcomm-perf' --mode virtual --ranks 8 -b 4K -e 64M -f 4 -d bfloat16 --quant sweep --copy-baseline --json '$res/perf-quant.json'"
  # One process per rank: 4 rank processes on one GPU under CUDA MPS (lossless and quantized,
  # checked, with a plot), and one rank process side by side with the real NCCL.
  # The quantized AllToAll, AllGather and ReduceScatter across 4 rank processes under MPS, every
  # checked value against the CPU reference (#wrong makes the tool exit 1).
  add "perf::procs_one_gpu_4_ranks_quant_collectives" 300 "unset CUDA_DEVICE_MAX_CONNECTIONS; nvidia-cuda-mps-control -d; rc=0; for c in alltoall allgather reducescatter; do '$here/bin/flashcomm-perf' --mode procs-one-gpu --ranks 4 --coll \$c -b 4K -e 16M -f 4 -d bfloat16 --quant 8,4,2 --json '$res/perf-procs-'\$c'.json' || rc=1; done; echo quit | nvidia-cuda-mps-control; exit \$rc"
  add "perf::procs_one_gpu_4_ranks" 300 "unset CUDA_DEVICE_MAX_CONNECTIONS; nvidia-cuda-mps-control -d; '$here/bin/flashcomm-perf' --mode procs-one-gpu --ranks 4 -b 4K -e 16M -f 4 -d bfloat16 --quant 8,4,2 --copy-baseline --json '$res/perf-procs.json' --svg '$res/perf-procs.svg'; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc"
  [ -n "$real" ] && add "perf::procs_1_rank_vs_nccl" 300 "'$here/bin/flashcomm-perf' --mode procs --ranks 1 --impl flashcomm,nccl --nccl-lib '$real' -b 4K -e 16M -f 4 -d bfloat16 --json '$res/perf-procs-nccl.json'"
  # A plot of the quantized sweep of 8 virtual ranks (latency and algbw against size per width).
  # The host transport: every byte crosses the GPU's PCIe link twice, where quantization can pay.
  # From 8 KiB, where the link's latency (the link-rtt row beside each size) is the floor.
  add "perf::host_transport_2_ranks" 300 "'$here/bin/flashcomm-perf' --mode virtual --ranks 2 --transport host -b 8K -e 64M -f 4 -d bfloat16 --quant 8,4 -G 5 --json '$res/perf-host.json'"
  # The host transport in rank processes, as users run it (2 processes on one GPU under MPS).
  add "perf::host_transport_procs_one_gpu_2_ranks" 300 "unset CUDA_DEVICE_MAX_CONNECTIONS; nvidia-cuda-mps-control -d; '$here/bin/flashcomm-perf' --mode procs-one-gpu --ranks 2 --transport host -b 8K -e 64M -f 4 -d bfloat16 --quant 8,4 -G 5 --json '$res/perf-host-procs.json'; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc"
  # The same with the library's choice (FLASHCOMM_QUANT_CHOICE=auto): quantized only where the
  # cost model calibrated at set-up predicts it faster; the plan column names the kernels that ran.
  add "perf::host_transport_2_ranks_quant_auto" 300 "'$here/bin/flashcomm-perf' --mode virtual --ranks 2 --transport host -b 64K -e 64M -f 4 -d bfloat16 --quant 8,4 --quant-choice auto -G 5 --json '$res/perf-host-auto.json'"
  add "perf::allreduce_quant_plot_8_virtual_ranks" 300 "'$here/bin/flashcomm-perf' --mode virtual --ranks 8 -b 4K -e 256M -f 4 -d bfloat16 --quant 8,6,4,3,2 -G 5 --copy-baseline --json '$res/perf-quant-graph.json' --svg '$res/perf-quant-graph.svg'"
fi
# The check of a machine with several GPUs (multi-gpu-check.sh, docs/testing.md) in its one-GPU
# mode: each step's one-GPU equivalent, so that the script runs before such a machine is at hand.
# Its summary.md, summary.json and multigpu.tar.gz land in logs/multigpu-one-gpu (in logs.tar.gz).
[ -x "$here/multi-gpu-check.sh" ] && add "multigpu::one_gpu_mode" 480 "'$here/multi-gpu-check.sh' '$here' '$res/logs/multigpu-one-gpu' --one-gpu"
[ -x "$here/bin/codec_bench" ] && add "perf::codec_bench" 300 "'$here/bin/codec_bench' --quick '$res/codec-bench.json'"

passed=0; failed=0; skipped=0; start=$(date +%s)
declare -A done_
summary="$res/summary.json"; echo "[" > "$summary"; first=1
record() { # name status seconds
  local sep=","; [ $first -eq 1 ] && sep="" && first=0
  printf '%s{"test":"%s","status":"%s","seconds":%s}\n' "$sep" "$1" "$2" "$3" >> "$summary"
}
run_one() { # index
  local i=$1 name=${names[$1]}
  if [ -n "${FLASHCOMM_DEADLINE:-}" ] && [ $(( $(date +%s) - start )) -ge "$FLASHCOMM_DEADLINE" ]; then
    skipped=$((skipped+1)); record "$name" "not-run" 0; echo "SKIP $name (time budget)"; return
  fi
  local log="$res/logs/$(echo "$name" | tr -c 'A-Za-z0-9._\n-' '_').log"
  local t0; t0=$(date +%s.%N)
  timeout -k 10 "${limits[$i]}" bash -c "${cmds[$i]}" > "$log" 2>&1
  local rc=$?
  local dt; dt=$(python3 -c "print(round($(date +%s.%N)-$t0,1))")
  if [ $rc -eq 0 ]; then
    passed=$((passed+1)); record "$name" pass "$dt"; echo "PASS $name (${dt}s)"
  else
    failed=$((failed+1)); record "$name" fail "$dt"; echo "FAIL $name (rc=$rc, ${dt}s)"
    { grep -m 6 -A 2 -E "panicked|Error|error:|FAIL" "$log" || tail -n 12 "$log"; } | cut -c1-400 | sed 's/^/    /'
  fi
  # Keep the archive current, so the logs come back even if the whole run is cut short.
  tar -C "$res" -czf "$res/logs.tar.gz" logs 2>/dev/null
}

patterns=("$@"); [ ${#patterns[@]} -eq 0 ] && patterns=(".*")
for pat in "${patterns[@]}"; do
  for i in "${!names[@]}"; do
    [ -n "${done_[$i]:-}" ] && continue
    if [[ "${names[$i]}" =~ $pat ]]; then done_[$i]=1; run_one "$i"; fi
  done
done

echo "]" >> "$summary"
tar -C "$res" -czf "$res/logs.tar.gz" logs && rm -rf "$res/logs"
if [ $skipped -gt 0 ]; then echo "$passed passed, $failed failed ($skipped not run: time budget)"; else echo "$passed passed, $failed failed"; fi
