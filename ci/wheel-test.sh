#!/usr/bin/env bash
# CPU test of the Python wheel: builds it with ci/build-wheel.sh from a library that is already
# built (by default the one `cargo test` builds, target/debug/deps/libnccl.so: no second CUDA
# compile), installs it into a fresh virtual environment and runs python/tests/check_wheel.py there with
# FLASHCOMM_NCCL_LIB and LD_PRELOAD unset (import, library_path() loads and exports the NCCL API,
# env(), stats(), the launcher on a program that reads its own environment). Ends with
# "N passed, N failed".
#
#   ci/wheel-test.sh [--lib FILE] [--from-pypi] [--cuda 12]
#
# --cuda 12 tests the CUDA 12 build's wheel, flashcomm-cu12 (ci/build-wheel.sh --cuda 12), made
# from FILE, which must then be given (a library built with `ci/setup.sh --cuda 12`'s compiler),
# against nvidia-nccl-cu12 in place of nvidia-nccl-cu13 below.
#
# The real NCCL dependency (nvidia-nccl-cu13): by default the one ci/setup.sh installed is made
# visible to the virtual environment (a .pth file), and the wheel is installed with --no-deps
# --no-index, so the test needs no network; `pip check` then verifies that it satisfies the
# wheel's requirement. --from-pypi installs the wheel with its dependencies from PyPI instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# `cargo test` leaves its library in deps/ (a `cargo build` copies it one folder up).
debug="${CARGO_TARGET_DIR:-$root/target}/debug"
lib="$debug/deps/libnccl.so" pypi=0 cuda=13 given=0
[ -f "$lib" ] || lib="$debug/libnccl.so"
while [ $# -gt 0 ]; do
  case "$1" in
    --lib) lib=${2:?--lib needs a file}; given=1; shift 2;;
    --from-pypi) pypi=1; shift;;
    --cuda) cuda=${2:?--cuda takes 12 or 13}; shift 2;;
    -h|--help) awk 'NR > 1 && /^set /{exit} NR > 1' "$0"; exit 0;;
    *) echo "wheel-test: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
case "$cuda" in
  13) envsh=env.sh;;
  12) envsh=env-cu12.sh
      [ $given -eq 1 ] || { echo "wheel-test: --cuda 12 needs --lib (a CUDA 12 build)" >&2; exit 2; };;
  *) echo "wheel-test: --cuda takes 12 or 13" >&2; exit 2;;
esac
# (The CUDA 12 test always takes its environment: the caller's is usually the default one.)
if [ $pypi -eq 0 ] && { [ -z "${FLASHCOMM_NCCL_HOME:-}" ] || [ "$cuda" = 12 ]; }; then
  "$root/ci/setup.sh" --cuda "$cuda" >/dev/null
  # shellcheck disable=SC1090
  source "$root/.toolchain/$envsh"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-wheel-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "== wheel: build from $lib"
wheel=$("$root/ci/build-wheel.sh" --cuda "$cuda" --lib "$lib" --out "$work/dist" | tail -n 1)
echo "== wheel: install $(basename "$wheel") into a fresh virtual environment"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
if [ $pypi -eq 1 ]; then
  "$py" -m pip install --quiet --disable-pip-version-check "$wheel"
else
  # nvidia.nccl and its metadata from the toolchain, as if nvidia-nccl-cu13 were installed.
  mkdir -p "$work/nccl-site/nvidia"
  ln -s "$FLASHCOMM_NCCL_HOME" "$work/nccl-site/nvidia/nccl"
  for d in "$(dirname "$(dirname "$FLASHCOMM_NCCL_HOME")")"/nvidia_nccl_cu"$cuda"-*.dist-info; do
    ln -s "$d" "$work/nccl-site/$(basename "$d")"
  done
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$work/nccl-site" > "$site/nvidia-nccl-cu$cuda-from-toolchain.pth"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-index "$wheel"
fi
"$py" -m pip check --disable-pip-version-check
echo "== wheel: checks"
cd "$work"
env -u FLASHCOMM_NCCL_LIB -u LD_PRELOAD -u VLLM_NCCL_SO_PATH -u SGLANG_NCCL_SO_PATH \
  "$py" "$root/python/tests/check_wheel.py"
