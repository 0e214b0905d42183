#!/usr/bin/env bash
# One device call (fits the 10-minute limit): gpu tests, then forward timings beside FLA,
# then ours with segment parallelism. Results under $OUT; tables printed last.
# usage (on the lent H200, from the repo root, .offline-gpu carried):
#   bash tools/h200_session.sh            # all three parts
#   SKIP_TESTS=1 bash tools/h200_session.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -15 \
    | tee "$OUT/gpu-tests.txt"
fi
B="python3 benchmark/bench_gated_delta_rule.py --mode fwd --out $OUT --resume"
# FLA re-autotunes in every worker (~60 s per shape): few shapes per call
timeout 200 $B --peers fla --deadline-s 140 \
  --shapes '16/64@1x32768,16/32@8x4096,2/8@1x32768' 2>&1 | grep "^|" | tail -8
timeout 100 $B --peers none --tag H200-seg2048 --ours-segment-len 2048 --deadline-s 60 \
  --shapes '2/8@1x32768,4/16@1x32768,16/64@1x32768' 2>&1 | grep "^|" | tail -6
