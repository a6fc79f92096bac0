#!/usr/bin/env bash
# Builds the codec ablation benchmark (cuda/bench/codec_ablation.cu) into <dir>, once per
# FC_CODEC_ABLATE setting, plus <dir>/run.sh which runs them all on a GPU machine:
#
#   ci/codec-ablation.sh <dir>          # here (needs the CUDA toolchain of ci/setup.sh)
#   <dir>/run.sh [MiB] [spikes] [group] # on the GPU machine (no toolchain needed)
#
# Settings: 0 = the real kernels; 5 = encode without the range/spike plan, decode without writing
# spikes; 15 = also without the code arithmetic (encode) and the range arithmetic (decode);
# 31 = decode without extracting codes either (memory traffic and staging only). Results with a
# nonzero setting are wrong by design; only their times matter. FLASHCOMM_CUDA_ARCHS picks the
# architecture (default 90); FC_BENCH_BITS the width (default 4).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: ci/codec-ablation.sh <dir>}
mkdir -p "$out"
"$root/ci/setup.sh" >/dev/null
source "$root/.toolchain/env.sh"
arch=${FLASHCOMM_CUDA_ARCHS:-90}
arch=${arch%%;*}
bits=${FC_BENCH_BITS:-4}
for a in 0 5 15 31; do
  "$NVCC" -std=c++17 -O3 -fmad=false --expt-relaxed-constexpr -arch="sm_$arch" -I "$root/cuda/include" \
    -DFC_CODEC_ABLATE=$a -DFC_BENCH_BITS="$bits" -cudart static -L "$CUDA_HOME/lib" \
    -o "$out/codec_ablation_$a" "$root/cuda/bench/codec_ablation.cu" &
done
wait
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every codec_ablation build next to this script; arguments go to each (MiB spikes group).
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
for a in 0 5 15 31; do
  red=1; [ "$a" = 0 ] || red=0
  "$here/codec_ablation_$a" "${1:-256}" "${2:-2}" "${3:-128}" "$red"
done
RUN
chmod +x "$out/run.sh"
ls "$out"
