#!/usr/bin/env bash
# Runs every GPU test of a bundle made by ci/gpu-bundle.sh, on a machine with NVIDIA GPUs.
#   run.sh <results-dir> [filter]
# Writes one log per test and summary.json into <results-dir>; the last line is
# "N passed, N failed". A filter (substring) runs only the matching tests.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
res=${1:?usage: run.sh <results-dir> [filter]}
filter=${2:-}
mkdir -p "$res/logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Bundles ship the kernels once, next to the binaries (see ci/gpu-bundle.sh).
[ -d "$here/kernels" ] && export FLASHCOMM_KERNEL_DIR="$here/kernels"
passed=0; failed=0
summary="$res/summary.json"; echo "[" > "$summary"; first=1

record() { # name status seconds
  local sep=","; [ $first -eq 1 ] && sep="" && first=0
  printf '%s{"test":"%s","status":"%s","seconds":%s}\n' "$sep" "$1" "$2" "$3" >> "$summary"
}

run_one() { # name timeout cmd...
  local name=$1 limit=$2; shift 2
  if [ -n "$filter" ] && [[ "$name" != *"$filter"* ]]; then return; fi
  local t0=$(date +%s.%N)
  local log="$res/logs/$(echo "$name" | tr -c 'A-Za-z0-9._\n-' '_').log"
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local dt=$(python3 -c "print(round($(date +%s.%N)-$t0,1))")
  if [ $rc -eq 0 ]; then passed=$((passed+1)); record "$name" pass "$dt"; echo "PASS $name (${dt}s)"
  else
    failed=$((failed+1)); record "$name" fail "$dt"; echo "FAIL $name (rc=$rc, ${dt}s)"
    { grep -m 6 -A 2 -E "panicked|Error|error:|FAIL" "$log" || tail -n 12 "$log"; } | cut -c1-400 | sed 's/^/    /'
  fi
  # Keep the archive current, so the logs come back even if the whole run is cut short.
  tar -C "$res" -czf "$res/logs.tar.gz" logs 2>/dev/null
}

{
  echo "commit: $(cat "$here/COMMIT" 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  ldd --version 2>&1 | head -n 1
  python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
} > "$res/environment.txt"
cat "$res/environment.txt"

# Cargo test executables: each #[test] counts; one executable per invocation for clean logs.
for t in "$here"/tests/*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  for case in $("$t" --list 2>/dev/null | sed -n 's/: test$//p'); do
    run_one "$name::$case" "${FLASHCOMM_TEST_LIMIT:-300}" "$t" --exact "$case" --nocapture --test-threads=1
  done
done

# C and Python programs (registered by the scripts that exist in this bundle).
lib="$here/lib/libnccl.so.2"
# The C and ctypes programs load flashcomm by path in a process without torch, so flashcomm
# cannot find torch's NCCL by itself: point it at the NCCL wheel torch uses (unless set already).
# The torch scripts find it themselves (torch has loaded it), which is part of what they test.
real_nccl=${FLASHCOMM_NCCL_LIB:-$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib','libnccl.so.2'))" 2>/dev/null)}
if [ -n "$real_nccl" ] && [ -f "$real_nccl" ]; then
  echo "real NCCL for the C and ctypes programs: $real_nccl"
else
  echo "note: no real libnccl.so.2 found for the C and ctypes programs (set FLASHCOMM_NCCL_LIB)"
  real_nccl=""
fi
with_real=(env "FLASHCOMM_NCCL_LIB=$real_nccl")
[ -x "$here/c/abi_smoke" ] && run_one "c::abi_smoke_gpu" 120 "${with_real[@]}" "$here/c/abi_smoke" --gpu
[ -x "$here/c/overhead" ] && run_one "c::overhead" 300 "${with_real[@]}" "$here/c/overhead" "$lib"
[ -f "$here/python/ctypes_load.py" ] && run_one "python::ctypes_load_gpu" 300 "${with_real[@]}" python3 "$here/python/ctypes_load.py" --lib "$lib" --gpu
[ -f "$here/python/torch_preload.py" ] && run_one "python::torch_preload_ws1" 600 env LD_PRELOAD="$lib" python3 "$here/python/torch_preload.py" --world-size 1
[ -f "$here/python/torch_quant.py" ] && run_one "python::torch_quant_ws1" 600 python3 "$here/python/torch_quant.py" --lib "$lib" --world-size 1
[ -f "$here/python/torch_quant.py" ] && run_one "python::torch_quant_ws1_twostep_4_8" 600 python3 "$here/python/torch_quant.py" --lib "$lib" --world-size 1 --algo twoshot --bits 4 --ag-bits 8

echo "]" >> "$summary"
# Results come back as a few files: the summary, the environment and one archive of all logs.
tar -C "$res" -czf "$res/logs.tar.gz" logs && rm -rf "$res/logs"
echo "$passed passed, $failed failed"
