#!/usr/bin/env bash
# One device call: the gpu-marked tests, then timings, results under $OUT.
# usage (on the lent H200, from the repo root):  bash tools/h200_session.sh [pytest-args...]
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest tests -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" "$@" \
  2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
if [ -n "${BENCH:-}" ]; then
  $BENCH 2>&1 | tee "$OUT/bench.txt" | tail -60
fi
# new kernels compiled on the device (should be none): ship them back
find .offline-gpu/tilelang-cache -newer .offline-gpu/activate.sh -type f | head -5
