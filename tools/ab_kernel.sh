#!/usr/bin/env bash
# One device call: a kernel file of the working tree against a saved copy of it (the
# kernel alone, tune_chunk_fwd.py, one process per run), then every `gpu` test of the
# working tree's kernels in four pytest processes side by side (one GPU suffices).
#
#   KERNEL   the file compared (default: the recurrence, kernels/chunk_state_output.py)
#   BASE     the saved copy, e.g. `git show main:$KERNEL > .offline-gpu/ab/base.py`
#            (under .offline-gpu/ so that it travels with the bundle's carry)
#   AB       the runs in order, "new" (working tree), "base" or the path of another saved
#            copy (a third arm; default "new base new base")
#   SH       tune_chunk_fwd.py's shapes; TESTS=0 skips the tests; END: seconds of the
#            call the tests may run until (default 560)
# Both versions' kernels must be in the carried cache (python -m flash_qla_sm90.precompile
# once per version; the kernel index keys on the kernel files' text, so each swap finds
# its own). Results: $OUT/ab.tar.xz; the table and the test summaries are printed last.
#   KERNEL=... BASE=.offline-gpu/ab/base.py bash tools/ab_kernel.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$R/gpu.txt"
KERNEL=${KERNEL:-packages/flash-qla-tilelang/src/flash_qla_tl/kernels/chunk_state_output.py}
BASE=${BASE:-.offline-gpu/ab/base.py}
SH=${SH:-"16/32@seqs=5000+3000+2500+2000+2384+1500,16/16@1x32768,2/8@1x32768"}
cp "$KERNEL" "$R/new.py"
for v in ${AB:-new base new base}; do
  case $v in new) cp "$R/new.py" "$KERNEL" ;; base) cp "$BASE" "$KERNEL" ;; *) cp "$v" "$KERNEL" ;; esac
  echo "== $v" >> "$R/ab.txt"
  timeout 70 python3 benchmark/tune_chunk_fwd.py --shapes "$SH" >> "$R/ab.txt" 2>&1
done
cp "$R/new.py" "$KERNEL"
if [ "${TESTS:-1}" != 0 ]; then
  L=$(( ${END:-560} - SECONDS ))
  PT="python3 -m pytest -q -p no:cacheprovider -rfE --durations=3 -m gpu"
  timeout $L $PT tests/sm90/test_forward_gpu.py > "$R/t-forward.txt" 2>&1 &
  timeout $L $PT tests/sm90/test_drop_in_gpu.py tests/sm90/test_compile_api_gpu.py tests/core \
    tests/sm90/test_chunk_layout.py tests/test_gdr_unit.py > "$R/t-dropin-core.txt" 2>&1 &
  timeout $L $PT tests/sm90/test_backward_gpu.py > "$R/t-backward.txt" 2>&1 &
  timeout $L $PT tests/sm90/test_bwd_fused_gpu.py > "$R/t-fused.txt" 2>&1 &
  wait
fi
tar cJf "$OUT/ab.tar.xz" -C "$R" .
grep -E "^==|ws " "$R/ab.txt" | grep -v prepare
for f in "$R"/t-*.txt; do
  [ -f "$f" ] && { echo "== $(basename "$f")"; tail -2 "$f"; grep -E "^FAILED|^ERROR" "$f" | head -5; }
done
