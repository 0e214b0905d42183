#!/usr/bin/env bash
# One device call (fits the 10-minute limit): gpu tests, the chunk_bwd_dh check in its own
# process (a fault there must not take the other tests down), a per-kernel profile of ours
# (forward and backward) and segment-parallel forward timings. Results under $OUT.
# usage (on the lent H200, from the repo root, .offline-gpu carried):
#   bash tools/h200_session.sh                 # everything
#   STAGES="tests profile" bash tools/h200_session.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests dh profile segments"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
PT="python3 -m pytest -q -p no:cacheprovider -rfE --durations=8"
if has tests; then
  timeout 300 $PT tests -m gpu --deselect \
    tests/sm90/test_backward_gpu.py::test_dh_kernel_matches_torch_sweep \
    > "$OUT/gpu-tests.txt" 2>&1
  tail -25 "$OUT/gpu-tests.txt"
fi
if has dh; then
  timeout 90 $PT tests/sm90/test_backward_gpu.py -k dh_kernel > "$OUT/gpu-dh.txt" 2>&1
  tail -8 "$OUT/gpu-dh.txt"
fi
if has profile; then
  timeout 150 python3 profile/profile_gdr.py --set develop --peers none --iters 3 \
    --out "$OUT" > "$OUT/profile.txt" 2>&1
  tail -30 "$OUT/profile.txt"
fi
if has segments; then
  B="python3 benchmark/bench_gated_delta_rule.py --mode fwd --out $OUT --peers none --no-graphs"
  for S in 0 1024 4096; do
    SEG=(); TAG=(--tag H200-unsplit); [ "$S" != 0 ] && SEG=(--ours-segment-len "$S") && TAG=(--tag "H200-seg$S")
    timeout 80 $B "${SEG[@]}" "${TAG[@]}" --deadline-s 60 \
      --shapes '2/8@1x32768,4/16@1x32768,16/16@1x32768' 2>&1 | grep "^|" | tail -4
  done
fi
