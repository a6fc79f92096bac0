#!/usr/bin/env bash
# CPU test of ci/demo.sh on a machine without a GPU (what ci/test.sh runs): with an nvidia-smi
# that lists no GPU first on PATH (so the test means the same on a machine that has one), the
# demo must say so on its first line, before any set-up or build, show the CPU reference codec's
# error table, exit non-zero, and end within a minute. Prints PASS/FAIL lines and ends with
# "N passed, N failed".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-demo-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() {
  local what=$1; shift
  if "$@"; then passed=$((passed + 1)); echo "PASS demo: $what"
  else failed=$((failed + 1)); echo "FAIL demo: $what"; fi
}

mkdir -p "$work/bin"
printf '#!/bin/sh\necho "No devices were found"\nexit 6\n' > "$work/bin/nvidia-smi"
chmod +x "$work/bin/nvidia-smi"
start=$(date +%s)
PATH="$work/bin:$PATH" timeout 60 "$root/ci/demo.sh" "$work/results" > "$work/out" 2>&1
status=$?
elapsed=$(( $(date +%s) - start ))
check "exits non-zero without a GPU (status $status)" test "$status" -ne 0 -a "$status" -ne 124
check "ends within a minute (${elapsed} s)" test "$elapsed" -lt 60
check "says so on its first line" grep -q "^ci/demo.sh: no NVIDIA GPU found" <(head -n 1 "$work/out")
check "shows the CPU reference codec's error table" grep -q '^| 4 | one-shot | 4.750 |' "$work/out"
check "sets nothing up and builds nothing before that" test ! -e "$work/results"
if [ "$failed" -gt 0 ]; then sed 's/^/    /' "$work/out"; fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
