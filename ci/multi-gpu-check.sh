#!/usr/bin/env bash
# Verifies flashcomm on a GPU machine of 2, 4 or 8 GPUs in one command of under ten minutes: the
# GPU test suite with one rank per GPU, NVIDIA's nccl-tests through the real NCCL and through
# flashcomm, flashcomm-perf against NCCL and custom all-reduce kernels on the GPUs' links, and
# PyTorch (tests and a tensor-parallel forward of a real small model) through the wheel's launcher.
#
#   ci/multi-gpu-check.sh <bundle> <results> [--gpus N] [--one-gpu] [--dry-run]
#                         [--model FILE.gguf] [--tokens FILE] [--deadline S] [--work DIR]
#
# <bundle>: a folder made by ci/gpu-bundle.sh (with NCCL_TESTS_SRC, FLASHCOMM_BUNDLE_MODEL and
# FLASHCOMM_BUNDLE_TEXT set to carry nccl-tests' source, the model and its token ids). <results>
# receives three files, rewritten after every test so that a run cut short still leaves what it
# did: summary.md (every step's results and tables), summary.json, and multigpu.tar.gz (every log
# and JSON file). The last line printed is "N passed, N failed" (plus what was not run and why).
#
# The GPUs are counted with nvidia-smi; --gpus N uses the first N. --one-gpu runs each step's
# one-GPU equivalent (virtual ranks for steps 1 and 3, nccl-tests with -g 1, PyTorch at world size
# 1), which is what one GPU can show; a machine with one GPU gets it without asking. --dry-run
# prints the steps and their commands without running anything (with --gpus N, default 8).
# --model and --tokens override the bundle's model/ folder.
#
# Steps, in this order, each under its own time limit (seconds; several GPUs / one GPU):
#   0  set-up: the wheel into a virtual environment, nccl-tests' build started in the
#      background (it runs during step 1)                                         20 /  20
#   1  GPU test suite, one rank process per GPU, no MPS (FLASHCOMM_TEST_GPUS=N,
#      FLASHCOMM_TEST_PROCESSES=N), transports p2p and host: lossless collectives,
#      quantized AllReduce bit for bit the CPU reference, graph replay, a killed rank,
#      abort; then the thread-rank sweeps with one rank per GPU                  150 / 120
#   2  nccl-tests (unmodified, built here against the real NCCL's headers): every
#      collective and datatype, 8 B..16 MiB, eager and CUDA graphs (-G), once with
#      the real NCCL and once with flashcomm preloaded; a side-by-side table      190 / 100
#   3  flashcomm-perf --mode gpus: NCCL, the reference kernels and flashcomm
#      (lossless and quantized), 8 KiB..256 MiB                                   100 /  80
#   4  PyTorch through `flashcomm run`: torch_preload, torch_quant (one-shot, bit for
#      bit the numpy emulation), tp_forward (tensor-parallel SmolLM2-135M)        100 / 100
# Sum: 560 s (9 min 20 s) with several GPUs, 420 s with one. --deadline (default the sum plus
# 10 s) stops starting new tests after that many seconds from the start; every test also has its
# own limit, and a test not started for lack of time is reported as not run, never as passed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

usage() { awk 'NR > 1 && /^set /{exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'; }

bundle="" res="" gpus="" one_gpu=0 dry=0 model="" tokens="" deadline="" work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus=${2:?--gpus needs a number}; shift 2;;
    --one-gpu) one_gpu=1; shift;;
    --dry-run) dry=1; shift;;
    --model) model=${2:?--model needs a file}; shift 2;;
    --tokens) tokens=${2:?--tokens needs a file}; shift 2;;
    --deadline) deadline=${2:?--deadline needs seconds}; shift 2;;
    --work) work=${2:?--work needs a folder}; shift 2;;
    -h|--help) usage; exit 0;;
    -*) echo "multi-gpu-check: unknown option $1 (see --help)" >&2; exit 2;;
    *) if [ -z "$bundle" ]; then bundle=$1; elif [ -z "$res" ]; then res=$1; else
         echo "multi-gpu-check: unexpected argument $1 (see --help)" >&2; exit 2; fi; shift;;
  esac
done
if [ -z "$bundle" ] || [ -z "$res" ]; then usage >&2; exit 2; fi
if [ -n "$gpus" ] && ! [[ "$gpus" =~ ^[1-8]$ ]]; then
  echo "multi-gpu-check: --gpus $gpus: 1..8" >&2; exit 2
fi
q() { printf '%q' "$1"; }

# ---------------------------------------------------------------------------------------------
# How many GPUs, and which mode.
if [ $dry -eq 1 ]; then
  n=${gpus:-8}
else
  bundle=$(cd "$bundle" 2>/dev/null && pwd) || { echo "multi-gpu-check: no bundle folder" >&2; exit 2; }
  found=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  [ "$found" -ge 1 ] || { echo "multi-gpu-check: nvidia-smi finds no GPU" >&2; exit 2; }
  n=${gpus:-$found}
  if [ "$n" -gt "$found" ]; then echo "multi-gpu-check: --gpus $n but $found found" >&2; exit 2; fi
fi
[ "$n" -eq 1 ] && one_gpu=1
[ $one_gpu -eq 1 ] && n=1
if [ $one_gpu -eq 1 ]; then
  limits=(20 120 100 80 100); mode="one GPU (virtual ranks, world size 1)"
else
  limits=(20 150 190 100 100); mode="$n GPUs, one rank per GPU"
fi
total=0; for l in "${limits[@]}"; do total=$((total + l)); done
deadline=${deadline:-$((total + 10))}
step_names=("set-up" "GPU test suite" "nccl-tests, NCCL and flashcomm side by side"
  "flashcomm-perf against NCCL and the reference kernels" "PyTorch through the launcher")

# ---------------------------------------------------------------------------------------------
# Paths on this machine (placeholders in a dry run).
lib="$bundle/lib/libnccl.so.2"
perf="$bundle/bin/flashcomm-perf"
tests="$bundle/tests"
model=${model:-$bundle/model/SmolLM2-135M-Instruct.Q4_1.gguf}
tokens=${tokens:-$bundle/model/wikitext2-test.ids}
real=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib','libnccl.so.2'))" 2>/dev/null || true)
[ -n "$real" ] || real="<the real libnccl.so.2 (python's nvidia/nccl)>"
if [ -z "$work" ]; then
  if [ $dry -eq 1 ]; then work="<work folder>"; else work=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-multigpu.XXXXXX"); fi
fi
logs="$work/logs" ntdir="$work/nccl-tests" ntbuild="$work/build/nccl-tests"
launcher="$work/venv/bin/flashcomm"

# ---------------------------------------------------------------------------------------------
# The plan: every test as (step, name, time limit, command). A command that exits 77 was not
# run for want of something (its last line says what).
E_step=(); E_name=(); E_limit=(); E_cmd=()
add() { E_step+=("$1"); E_name+=("$2"); E_limit+=("$3"); E_cmd+=("$4"); }

# Step 1: the GPU test suite.
procs="comm-gpu_processes"
proc_tests=(processes_exchange_through_ipc killed_process_gives_errors_not_hangs
  abort_from_a_watchdog_thread_ends_the_wait_in_every_process
  abort_returns_in_every_process_when_the_launch_is_queued_behind_a_stuck_operation)
if [ $one_gpu -eq 1 ]; then
  # Four rank processes on the one GPU under CUDA MPS (as run.sh runs them).
  prefix="unset CUDA_DEVICE_MAX_CONNECTIONS; nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT; FLASHCOMM_TEST_PROCESSES=4"
  tn=4
else
  prefix="unset CUDA_DEVICE_MAX_CONNECTIONS; FLASHCOMM_TEST_GPUS=$n FLASHCOMM_TEST_PROCESSES=$n"
  tn=$n
fi
for tr in p2p host; do
  for t in "${proc_tests[@]}"; do
    add 1 "suite::$tr::processes::$t" 60 "$prefix FLASHCOMM_TRANSPORT=$tr $(q "$tests/$procs") --exact $t --nocapture --test-threads=1"
  done
done
threads="FLASHCOMM_TEST_GPUS=$n FLASHCOMM_SWEEP_MAX_MIB=16"
case $tn in
  2|4|8)
    add 1 "suite::p2p::threads::sweep_${tn}_ranks" 60 "$threads FLASHCOMM_TRANSPORT=p2p $(q "$tests/comm-gpu_collectives") --exact sweep_${tn}_ranks --nocapture --test-threads=1"
    add 1 "suite::p2p::threads::quantized_${tn}_ranks" 90 "$threads FLASHCOMM_TRANSPORT=p2p $(q "$tests/comm-gpu_quant") --exact quantized_${tn}_ranks --nocapture --test-threads=1";;
esac
add 1 "suite::p2p::threads::graph_capture_and_replay" 60 "$threads FLASHCOMM_TRANSPORT=p2p $(q "$tests/comm-gpu_collectives") --exact graph_capture_and_replay --nocapture --test-threads=1"
add 1 "suite::host::threads::host_transport_sweep_2_ranks" 60 "$threads $(q "$tests/comm-gpu_collectives") --exact host_transport_sweep_2_ranks --nocapture --test-threads=1"

# Step 2: nccl-tests. The flashcomm-served collectives first (eager, then graphs), then the
# others, which flashcomm forwards to NCCL.
ntg=$n
nt_cmd() { # collective launch impl
  local coll=$1 launch=$2 impl=$3 graph="" envs
  [ "$launch" = graph ] && graph=" -G 10"
  local stem="$ntdir/$coll.$launch.$impl" exe="$ntbuild/${coll}_perf"
  envs="LD_LIBRARY_PATH=\$(cat $(q "$ntdir/ld-path") 2>/dev/null)"
  [ "$impl" = flashcomm ] && envs="$envs LD_PRELOAD=$(q "$lib") FLASHCOMM_NCCL_LIB=$(q "$real")"
  printf '%s' "[ -x $(q "$exe") ] || { echo 'not run: nccl-tests was not built (see nccl-tests::build)'; exit 77; }; " \
    "$envs $(q "$exe") -t 1 -g $ntg -b 8 -e 16M -f 8 -d all -n 10 -w 3 -c 1$graph > $(q "$stem.log") 2>&1; " \
    "rc=\$?; echo \"\$rc \$SECONDS\" > $(q "$stem.rc"); cat $(q "$stem.log"); [ \$rc -eq 0 ] || exit \$rc; " \
    "grep -Eq 'Out of bounds values *: 0 OK' $(q "$stem.log") || { echo 'FAIL wrong elements (Out of bounds values)'; exit 1; }; " \
    "awk '\$1 ~ /^[0-9]+\$/ && NF >= 13 && ((\$9 != \"N/A\" && \$9 + 0 > 0) || (\$13 != \"N/A\" && \$13 + 0 > 0)) { n++ } END { exit n > 0 }' $(q "$stem.log") || { echo 'FAIL rows with wrong elements (#wrong)'; exit 1; }"
}
add 2 "nccl-tests::build" 150 "[ -f $(q "$bundle/nccl-tests/src/Makefile") ] || { echo 'not run: no nccl-tests source in the bundle (ci/gpu-bundle.sh with NCCL_TESTS_SRC)'; exit 77; }; while [ ! -f $(q "$ntdir/build.rc") ]; do sleep 1; done; tail -n 40 $(q "$ntdir/build.log"); exit \$(cat $(q "$ntdir/build.rc"))"
served=(all_reduce all_gather reduce_scatter alltoall)
others=(broadcast reduce sendrecv scatter gather alltoallv hypercube)
for launch in eager graph; do
  for c in "${served[@]}"; do
    for impl in nccl flashcomm; do add 2 "nccl-tests::$c::$launch::$impl" 40 "$(nt_cmd "$c" "$launch" "$impl")"; done
  done
done
for launch in eager graph; do
  for c in "${others[@]}"; do
    for impl in nccl flashcomm; do add 2 "nccl-tests::$c::$launch::$impl" 40 "$(nt_cmd "$c" "$launch" "$impl")"; done
  done
done

# Step 3: flashcomm-perf. pull-reference is newer than some bundles' flashcomm-perf: a run it
# refuses is repeated without it, and says so.
perf_cmd() { # json-name arguments (IMPLS stands for the list) impls-with impls-without
  local json=$1 args=$2 with without
  with=${args//IMPLS/$3}; without=${args//IMPLS/$4}
  printf '%s' "$(q "$perf") $with --json $(q "$work/$json") 2>&1 | tee $(q "$work/$json.out"); rc=\${PIPESTATUS[0]}; " \
    "if [ \$rc -eq 2 ] && grep -q 'pull-reference' $(q "$work/$json.out"); then " \
    "echo 'NOTE this flashcomm-perf refuses --impl pull-reference: run again without it'; " \
    "$(q "$perf") $without --json $(q "$work/$json"); rc=\$?; fi; exit \$rc"
}
if [ $one_gpu -eq 1 ]; then
  add 3 "perf::virtual_8_ranks_8K_1M" 35 "$(perf_cmd perf-small.json "--mode virtual --ranks 8 --impl IMPLS -b 8K -e 1M -f 2 -d bfloat16 --quant 8,6,4,3,2 --launch both -G 20" reference,pull-reference,flashcomm reference,flashcomm)"
  add 3 "perf::virtual_8_ranks_2M_64M" 30 "$(perf_cmd perf-large.json "--mode virtual --ranks 8 --impl IMPLS -b 2M -e 64M -f 2 -d bfloat16 --quant 8,4" reference,pull-reference,flashcomm reference,flashcomm)"
  add 3 "perf::procs_1_rank_vs_nccl" 20 "$(q "$perf") --mode procs --ranks 1 --impl flashcomm,nccl --nccl-lib $(q "$real") -b 8K -e 16M -f 4 -d bfloat16 --json $(q "$work/perf-nccl-1.json")"
else
  add 3 "perf::gpus_${n}_ranks_8K_1M" 45 "$(perf_cmd perf-small.json "--mode gpus --ranks $n --impl IMPLS --nccl-lib $(q "$real") -b 8K -e 1M -f 2 -d bfloat16 --quant 8,6,4,3,2 --launch both -G 20" nccl,reference,pull-reference,flashcomm nccl,reference,flashcomm)"
  add 3 "perf::gpus_${n}_ranks_2M_256M" 55 "$(perf_cmd perf-large.json "--mode gpus --ranks $n --impl IMPLS --nccl-lib $(q "$real") -b 2M -e 256M -f 2 -d bfloat16 --quant 8,4" nccl,reference,pull-reference,flashcomm nccl,reference,flashcomm)"
fi

# Step 4: PyTorch through the wheel's launcher.
need_launcher="[ -x $(q "$launcher") ] || { echo 'FAIL the wheel is not installed (logs/wheel-install.log)'; exit 1; }; "
py="$bundle/python"
add 4 "torch::preload_ws$n" 45 "$need_launcher expect_line 'FLASHCOMM INFO flashcomm .* is on: .* served by flashcomm' $(q "$launcher") run --debug VERSION -- python3 $(q "$py/torch_preload.py") --world-size $n"
add 4 "torch::quant_ws${n}_oneshot" 60 "$need_launcher $(q "$launcher") run -- python3 $(q "$py/torch_quant.py") --world-size $n --algo oneshot --max-bytes 16M"
add 4 "torch::tp_forward_ws$n" 90 "$need_launcher [ -f $(q "$model") ] || { echo 'not run: no model in the bundle (ci/gpu-bundle.sh with FLASHCOMM_BUNDLE_MODEL, or --model)'; exit 77; }; [ -f $(q "$tokens") ] || { echo 'not run: no token ids in the bundle (ci/gpu-bundle.sh with FLASHCOMM_BUNDLE_TEXT, or --tokens)'; exit 77; }; $(q "$launcher") run -- python3 $(q "$py/tp_forward.py") --model $(q "$model") --tokens $(q "$tokens") --world-size $n --json $(q "$work/tp-forward.json")"
add 4 "torch::quant_ws${n}_ops" 60 "$need_launcher $(q "$launcher") run -- python3 $(q "$py/torch_quant.py") --world-size $n --ops --max-bytes 16M"

# ---------------------------------------------------------------------------------------------
if [ $dry -eq 1 ]; then
  echo "multi-gpu-check plan: $mode; results in $res; time limits sum to ${total}s (deadline ${deadline}s)"
  for s in 0 1 2 3 4; do
    echo "step $s: ${step_names[$s]} [limit ${limits[$s]}s]"
    [ $s -eq 0 ] && echo "    the wheel into $work/venv; nccl-tests built from $bundle/nccl-tests into $ntbuild (-g $ntg)"
    for i in "${!E_name[@]}"; do
      [ "${E_step[$i]}" -eq $s ] || continue
      echo "  ${E_name[$i]} [limit ${E_limit[$i]}s]"
      echo "    ${E_cmd[$i]}"
    done
  done
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Running.
mkdir -p "$res" "$logs" "$ntdir" || exit 2
res=$(cd "$res" && pwd)
start=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
[ -d "$bundle/kernels" ] && export FLASHCOMM_KERNEL_DIR="$bundle/kernels"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((n - 1)))}
records="$work/records.tsv"; : > "$records"
printf '%s\n' "${limits[@]}" > "$work/limits"
{
  echo "mode: $mode"
  echo "commit: $(cat "$bundle/COMMIT" 2>/dev/null)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
  echo "real NCCL: $real"
} > "$work/environment.txt"

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

summarize() { python3 "$here/multi-gpu-summary.py" "$work" "$res" >/dev/null 2>&1 || true
  tar -C "$work" --exclude=./build --exclude=./venv -czf "$res/multigpu.tar.gz.part" . 2>/dev/null \
    && mv "$res/multigpu.tar.gz.part" "$res/multigpu.tar.gz"; }
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$records"; }

# Step 0: set-up.
t0=$(date +%s)
# The Python wheel of the bundle, installed as run.sh installs it (without network): into a virtual
# environment that sees this machine's packages; without venv's pip, the machine's pip installs
# into it or, failing that, into a folder run through PYTHONPATH.
whl=$(ls "$bundle"/wheel/flashcomm_cu*-*.whl 2>/dev/null | head -n 1)
if [ -n "$whl" ]; then
  {
    if python3 -m venv --system-site-packages "$work/venv"; then
      "$work/venv/bin/python" -m pip install --no-deps --no-index "$whl"
    elif python3 -m venv --without-pip --system-site-packages "$work/venv"; then
      python3 -m pip --python "$work/venv/bin/python" install --no-deps --no-index "$whl"
    fi
    if [ ! -x "$launcher" ] && python3 -m pip install --no-deps --no-index --target "$work/venv/site" "$whl"; then
      mkdir -p "$work/venv/bin"
      printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m flashcomm "$@"\n' "$work/venv/site" > "$launcher"
      chmod +x "$launcher"
    fi
  } > "$logs/wheel-install.log" 2>&1
fi
echo "flashcomm wheel: ${whl:-none in the bundle}; launcher: $([ -x "$launcher" ] && echo "$launcher" || echo "not installed (logs/wheel-install.log)")" >> "$work/environment.txt"
# nccl-tests, built in the background with this machine's nvcc against the real NCCL's headers.
ntpid=""
if [ -f "$bundle/nccl-tests/src/Makefile" ]; then
  nvcc=${NVCC:-$(command -v nvcc || true)}
  for c in /usr/local/cuda/bin/nvcc "$(python3 -c 'import nvidia.cu13,os;print(os.path.join(list(nvidia.cu13.__path__)[0],"bin","nvcc"))' 2>/dev/null)"; do
    [ -z "$nvcc" ] && [ -x "$c" ] && nvcc=$c
  done
  cudart=""
  for d in "$(dirname "$(dirname "${nvcc:-/x/x}")")"/lib64 "$(dirname "$(dirname "${nvcc:-/x/x}")")"/lib /usr/local/cuda/lib64 \
      "$(python3 -c 'import nvidia.cu13,os;print(os.path.join(list(nvidia.cu13.__path__)[0],"lib"))' 2>/dev/null)" \
      "$(python3 -c 'import nvidia.cuda_runtime,os;print(os.path.join(list(nvidia.cuda_runtime.__path__)[0],"lib"))' 2>/dev/null)"; do
    f=$(ls "$d"/libcudart.so* 2>/dev/null | head -n 1)
    [ -z "$cudart" ] && [ -n "$f" ] && cudart=$f
  done
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  links="$work/build/links"
  mkdir -p "$links/cuda" "$links/nccl/lib" "$ntbuild"
  echo "$(dirname "$real"):$(dirname "${cudart:-/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" > "$ntdir/ld-path"
  if [ -z "$nvcc" ] || [ -z "$cudart" ] || [ ! -f "$real" ] || [ -z "$cc" ]; then
    echo "not run: cannot build nccl-tests (nvcc '${nvcc}', libcudart '${cudart}', NCCL '$real', compute capability '$cc')" > "$ntdir/build.log"
    echo 77 > "$ntdir/build.rc"
  else
    ln -sf "$cudart" "$links/cuda/libcudart.so"
    # nvcc's link step wants these too, where a pip-installed nvcc does not look for them.
    for a in libcudart_static.a libcudadevrt.a; do
      [ -f "$(dirname "$cudart")/$a" ] && ln -sf "$(dirname "$cudart")/$a" "$links/cuda/"
    done
    ln -sf "$real" "$links/nccl/lib/libnccl.so"
    ln -sfn "$(dirname "$(dirname "$real")")/include" "$links/nccl/include"
    (
      cd "$bundle/nccl-tests" && timeout $((limits[1] + limits[2])) \
        make -C src -j"$(nproc)" BUILDDIR="$ntbuild" CUDA_HOME="$(dirname "$(dirname "$nvcc")")" \
        NVCC="$nvcc" CUDA_LIB="$links/cuda" NCCL_HOME="$links/nccl" \
        NVCC_GENCODE="-gencode=arch=compute_$cc,code=sm_$cc" > "$ntdir/build.log" 2>&1
      echo $? > "$ntdir/build.rc"
    ) &
    ntpid=$!
    echo "nccl-tests: building with $nvcc for sm_$cc against $(dirname "$(dirname "$real")")/include" >> "$work/environment.txt"
  fi
fi
record 0 "set-up" "$([ -x "$launcher" ] && echo pass || echo fail)" $(( $(date +%s) - t0 )) "${limits[0]}" "launcher: $([ -x "$launcher" ] && echo installed || echo missing)"
cat "$work/environment.txt"
summarize

passed=0; failed=0; notrun=0; skipped=0
for s in 1 2 3 4; do
  now=$(date +%s)
  step_end=$(( now + limits[s] )); global_end=$(( start + deadline ))
  [ $step_end -gt $global_end ] && step_end=$global_end
  echo "== step $s: ${step_names[$s]} (limit ${limits[$s]}s)"
  for i in "${!E_name[@]}"; do
    [ "${E_step[$i]}" -eq $s ] || continue
    name=${E_name[$i]}
    left=$(( step_end - $(date +%s) ))
    if [ $left -lt 5 ]; then
      notrun=$((notrun + 1)); record "$s" "$name" not-run 0 "${E_limit[$i]}" "the step's time limit was reached"
      echo "SKIP $name (time limit of the step)"; continue
    fi
    lim=${E_limit[$i]}; [ "$lim" -gt "$left" ] && lim=$left
    log="$logs/$(echo "$name" | tr -c 'A-Za-z0-9._\n-' '_').log"
    t1=$EPOCHREALTIME
    timeout -k 5 "$lim" bash -c "${E_cmd[$i]}" > "$log" 2>&1
    rc=$?
    dt=$(awk -v a="$t1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    if [ $rc -eq 0 ]; then
      passed=$((passed + 1)); record "$s" "$name" pass "$dt" "$lim" ""
      echo "PASS $name (${dt}s)"
    elif [ $rc -eq 77 ]; then
      why=$(grep -m 1 '^not run' "$log" || tail -n 1 "$log")
      skipped=$((skipped + 1)); record "$s" "$name" skipped "$dt" "$lim" "$why"
      echo "SKIP $name: $why"
    else
      why=$(grep -m 1 -E "panicked|FAIL|Error|error:" "$log" | cut -c1-300)
      [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after ${lim}s${why:+; $why}"
      failed=$((failed + 1)); record "$s" "$name" fail "$dt" "$lim" "rc=$rc${why:+: $why}"
      echo "FAIL $name (rc=$rc, ${dt}s)"
      { grep -m 6 -A 2 -E "panicked|Error|error:|FAIL" "$log" || tail -n 12 "$log"; } | cut -c1-400 | sed 's/^/    /'
    fi
    [ "$s" -eq 2 ] && python3 "$here/nccl-tests-table.py" "$ntdir" --json "$work/nccl-tests.json" --md "$work/nccl-tests.md" >/dev/null 2>&1
    summarize
  done
done
[ -n "$ntpid" ] && kill "$ntpid" 2>/dev/null
[ -f "$work/nccl-tests.md" ] && python3 "$here/nccl-tests-table.py" "$ntdir" --json "$work/nccl-tests.json" --md "$work/nccl-tests.md"
summarize
echo "results: $res/summary.md, $res/summary.json, $res/multigpu.tar.gz"
extra=""
[ $notrun -gt 0 ] && extra="$notrun not run: time limit"
[ $skipped -gt 0 ] && extra="${extra:+$extra; }$skipped not run: missing from the bundle or this machine"
echo "$passed passed, $failed failed${extra:+ ($extra)}"
[ $failed -eq 0 ]
