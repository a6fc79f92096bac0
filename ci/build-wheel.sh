#!/usr/bin/env bash
# Builds the Python wheel flashcomm-cu13: flashcomm's libnccl.so.2 as flashcomm/lib/libnccl.so.2,
# the Python API and the launcher (python/), depending on nvidia-nccl-cu13.
#
#   ci/build-wheel.sh [--out DIR]                 # the shipped wheel: a --release build of the
#                                                 # library with every GPU architecture and PTX,
#                                                 # kernels embedded
#   ci/build-wheel.sh --lib FILE [--out DIR]      # package a library that is already built (the
#                                                 # CPU test packages the one `cargo test` built;
#                                                 # the GPU bundle packages its own)
#
# --cuda 12 (with either) makes the CUDA 12 build's wheel, flashcomm-cu12, depending on
# nvidia-nccl-cu12: the library is built with `ci/setup.sh --cuda 12`'s compiler (in
# target/cu12 unless CARGO_TARGET_DIR is set), or FILE is taken as such a build (docs/cuda12.md).
#
# Both ways go through the same packaging: the python/ folder is staged with the library, the
# version (the workspace's, from Cargo.toml), a record of how the library was built
# (flashcomm/_build.py) and the platform tag, and `pip wheel` builds it with setuptools (fetched
# from PyPI into pip's isolated build environment). The platform tag is manylinux_2_<N>_<arch>,
# N being the newest glibc symbol version the library needs, at least 17 (linux_<arch> if it needs
# a library outside the manylinux set). Prints the wheel's path last. Default DIR: target/wheels.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lib="" out="$root/target/wheels" cuda=13
while [ $# -gt 0 ]; do
  case "$1" in
    --lib) lib=${2:?--lib needs a file}; shift 2;;
    --cuda) cuda=${2:?--cuda takes 12 or 13}; shift 2;;
    --out) out=${2:?--out needs a folder}; shift 2;;
    -h|--help) awk 'NR > 1 && /^set /{exit} NR > 1' "$0"; exit 0;;
    *) echo "build-wheel: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
case "$cuda" in 12|13) ;; *) echo "build-wheel: --cuda takes 12 or 13" >&2; exit 2;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [ -z "$lib" ]; then
  "$root/ci/setup.sh" --cuda "$cuda" >/dev/null
  if [ "$cuda" = 12 ]; then
    # shellcheck disable=SC1091
    source "$root/.toolchain/env-cu12.sh"
    # Its own target folder: switching compilers in one folder would rebuild the kernels each time.
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/cu12}
  else
    # shellcheck disable=SC1091
    source "$root/.toolchain/env.sh"
  fi
  # The shipped library: every architecture (build.rs's default list) with PTX, kernels embedded;
  # a kernel that does not compile fails the build instead of producing a pass-through library.
  unset FLASHCOMM_CUDA_ARCHS FLASHCOMM_CUDA_PTX FLASHCOMM_EMBED_KERNELS FLASHCOMM_NO_KERNELS
  export FLASHCOMM_REQUIRE_KERNELS=1
  (cd "$root" && cargo build --release -p flashcomm-shim --quiet)
  lib="${CARGO_TARGET_DIR:-$root/target}/release/libnccl.so"
  built="cargo build --release, every GPU architecture of build.rs with PTX, kernels embedded"
  if [ "$cuda" = 12 ]; then built="$built, compiled by $("$NVCC" --version | tail -n 1)"; fi
else
  built="packaged from an existing build ($(basename "$lib"))"
fi
[ -f "$lib" ] || { echo "build-wheel: no library at $lib" >&2; exit 1; }

# The library must be flashcomm's libnccl.so.2.
# (Outputs are captured first: `grep -q` stopping early would fail the pipe under pipefail.)
dynamic=$(readelf -d "$lib")
symbols=$(nm -D --defined-only "$lib")
grep -q 'SONAME.*\[libnccl\.so\.2\]' <<<"$dynamic" \
  || { echo "build-wheel: $lib has no SONAME libnccl.so.2" >&2; exit 1; }
grep -q ' T flashcommGetVersion$' <<<"$symbols" \
  || { echo "build-wheel: $lib is not flashcomm's library (no flashcommGetVersion)" >&2; exit 1; }

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$root/Cargo.toml")
[ -n "$version" ] || { echo "build-wheel: no version in Cargo.toml" >&2; exit 1; }
arch=$(uname -m)
glibc=$(objdump -T "$lib" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_2\.//' | sort -n | tail -n 1)
# (2.17, manylinux2014, is the oldest glibc a manylinux tag of today's pip still names.)
[ "${glibc:-0}" -ge 17 ] || glibc=17
platform="manylinux_2_${glibc}_${arch}"
# manylinux allows only these shared libraries (PEP 600's policy list, the ones a Rust cdylib needs).
while read -r needed; do
  case "$needed" in
    libc.so.6|libm.so.6|libgcc_s.so.1|libpthread.so.0|libdl.so.2|librt.so.1|ld-linux-*) ;;
    *) platform="linux_${arch}"; echo "build-wheel: $needed is outside the manylinux set: tag $platform" >&2;;
  esac
done < <(sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' <<<"$dynamic")

stage=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$root/python/pyproject.toml" "$root/python/setup.py" "$root/python/README.md" "$stage/"
# The CUDA 12 wheel: its name, its NCCL and its classifier say 12 where python/ says 13.
if [ "$cuda" = 12 ]; then
  sed -i 's/cu13/cu12/g; s/NVIDIA CUDA :: 13/NVIDIA CUDA :: 12/' "$stage/pyproject.toml" "$stage/README.md"
fi
mkdir -p "$stage/flashcomm/lib"
cp "$root/python/flashcomm/"*.py "$stage/flashcomm/"
cp "$lib" "$stage/flashcomm/lib/libnccl.so.2"
chmod 755 "$stage/flashcomm/lib/libnccl.so.2"
strip --strip-debug "$stage/flashcomm/lib/libnccl.so.2"
echo "$platform" > "$stage/wheel-platform.txt"
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
cat > "$stage/flashcomm/_build.py" <<PY
# Written by ci/build-wheel.sh.
VERSION = "$version"
NCCL_PACKAGE = "nvidia-nccl-cu$cuda"
BUILD = {
    "version": "$version",
    "cuda": "$cuda",
    "commit": "$commit",
    "library": "$built",
    "platform": "$platform",
}
PY

rm -f "$out"/flashcomm_cu"$cuda"-"$version"-*.whl
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$out" "$stage" >&2
wheel=$(ls "$out"/flashcomm_cu"$cuda"-"$version"-*.whl)
echo "build-wheel: $(du -h "$wheel" | cut -f1) $built" >&2
echo "$wheel"
