#!/usr/bin/env bash
# One H200 device call (~9 min of the 10-minute limit) proving issue 33's portable
# Blackwell kernels on Hopper: the sm90 loader serves proof(SM100) / proof(SM120) (the
# same kernels compiled for sm_90a with WGMMA off, flash_qla_sm90.arch) under
# FLASH_QLA_PROOF_ARCH. Stages (STAGES="..."; each skipped once the budget runs low):
#   compile  the SM90 and proof kernels into the writable cache, 14 processes
#            (python -m flash_qla_sm90.precompile --arch sm90,proof-sm100,proof-sm120)
#   sm100    FLASH_QLA_PROOF_ARCH=sm100: the GPU tests of the plan's steps 2-5 (forward,
#            backward, fused and two-kernel, drop-in, compile API, decode), three groups
#            side by side on the one GPU (TEST_GROUPS overrides: ";"-separated)
#   sm120    FLASH_QLA_PROOF_ARCH=sm120: forward, backward (the sub-chunk sweep and
#            gradient kernel; no fused kernel: its tests skip), drop-in, decode and state
#            pool GPU tests, three groups side by side (SM120_GROUPS overrides)
#            (TEST_CAP: seconds the test groups may take, default 450)
#   sm90     the same groups on SM90's own kernels (SM90_GROUPS overrides), beside sm120
#            when both are asked for: the regression check of a shared-source change
#   bench    bench_gated_delta_rule.py (BENCH_ROWS, default --quick) for SM90 beside FLA
#            0.6.0 (BENCH_PEERS), proof(SM100) and proof(SM120) (BENCH_ARCHES, default
#            "sm90 sm100 sm120"), forward and training step, BENCH_ARGS: more options
#            (e.g. --dense-batch): one table of eager ms (same GPU, same lease)
#   profile  profile/profile_gdr.py (per-kernel device time, forward and backward) of
#            ours on PROFILE_SHAPES for each of BENCH_ARCHES, no peers
#            (Nsight Compute of one kernel under a proof build: tools/h200_session.sh's ncu
#            stage with FLASH_QLA_PROOF_ARCH, NCU_KERNEL and NCU_WORKLOAD set)
#   cache    the cache as $OUT/tilelang-cache.tar.xz (carry it next time)
# Results: $OUT/results.tar.xz (logs, bench JSON); the short tables are printed last.
# Usage on the H200, repository root, carry [".offline-gpu"]:
#   bash tools/h200_portable.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
STAGES=${STAGES:-"compile sm100 sm120 bench cache"}
BUDGET=${SESSION_BUDGET:-570}
has() { [[ " $STAGES " == *" $1 "* ]] && (( BUDGET - SECONDS > 30 )); }
cap() { local left=$(( BUDGET - SECONDS - 20 )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }
CACHE=/tmp/tilelang-cache; mkdir -p "$CACHE"
[ -d .offline-gpu/tilelang-cache ] && cp -r .offline-gpu/tilelang-cache/. "$CACHE"/
export TILELANG_CACHE_DIR=$CACHE
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
declare -A STATUS
if has compile; then
  start=$SECONDS
  timeout "$(cap 240)" python3 -m flash_qla_sm90.precompile "$CACHE" --jobs 14 \
    --arch sm90,proof-sm100,proof-sm120 > "$R/compile.txt" 2>&1
  STATUS[compile]="rc=$? $((SECONDS - start)) s: $(tail -1 "$R/compile.txt")"
  echo "compile: ${STATUS[compile]}"
fi
# the plan's H200 checks (docs/blackwell-plan.md section 3, steps 2-5), in three groups
T=tests/sm90
SM100_GROUPS=${TEST_GROUPS:-"$T/test_forward_gpu.py tests/core/test_recurrent.py;$T/test_backward_gpu.py $T/test_drop_in_gpu.py;$T/test_bwd_fused_gpu.py $T/test_compile_api_gpu.py"}
if has sm100; then
  start=$SECONDS
  IFS=';' read -ra groups <<< "$SM100_GROUPS"
  i=0
  for g in "${groups[@]}"; do
    FLASH_QLA_PROOF_ARCH=sm100 timeout "$(cap 330)" python3 -m pytest -q -p no:cacheprovider \
      -rfE --durations=3 -m gpu $g > "$R/sm100-tests-$i.txt" 2>&1 &
    i=$((i + 1))
  done
  wait
  STATUS[sm100]="$((SECONDS - start)) s:"
  for f in "$R"/sm100-tests-*.txt; do STATUS[sm100]+=" [$(tail -1 "$f")]"; done
  echo "sm100 proof tests: ${STATUS[sm100]}"
fi
# SM120's (and, with sm90, SM90's own) groups side by side on the one GPU
SM120_GROUPS=${SM120_GROUPS:-"$T/test_forward_gpu.py tests/core/test_recurrent.py tests/core/test_state_pool.py;$T/test_backward_gpu.py $T/test_bwd_fused_gpu.py;$T/test_drop_in_gpu.py $T/test_compile_api_gpu.py"}
SM90_GROUPS=${SM90_GROUPS:-"$T/test_backward_gpu.py $T/test_drop_in_gpu.py"}
if has sm120 || has sm90; then
  start=$SECONDS
  for arch in sm120 sm90; do
    has $arch || continue
    proof=""; [[ $arch == sm120 ]] && proof=sm120
    var=${arch^^}_GROUPS; IFS=';' read -ra groups <<< "${!var}"
    i=0
    for g in "${groups[@]}"; do
      FLASH_QLA_PROOF_ARCH=$proof timeout "$(cap "${TEST_CAP:-450}")" python3 -m pytest -q \
        -p no:cacheprovider -rfEs --durations=3 -m gpu $g > "$R/$arch-tests-$i.txt" 2>&1 &
      i=$((i + 1))
    done
  done
  wait
  for arch in sm120 sm90; do
    has $arch || continue
    STATUS[$arch]="$((SECONDS - start)) s:"
    for f in "$R"/$arch-tests-*.txt; do STATUS[$arch]+=" [$(tail -1 "$f")]"; done
    echo "$arch tests: ${STATUS[$arch]}"
  done
fi
if has bench; then   # BENCH_ROWS: bench --shapes (default --quick); FLA beside SM90
  rows=${BENCH_ROWS:+--shapes $BENCH_ROWS}; rows=${rows:---quick}
  for arch in ${BENCH_ARCHES:-sm90 sm100 sm120}; do
    proof=""; peers=none; mode=both
    [[ $arch == sm90 ]] && peers=${BENCH_PEERS:-fla}
    [[ $arch != sm90 ]] && proof=$arch
    FLASH_QLA_PROOF_ARCH=$proof timeout "$(cap 200)" python3 benchmark/bench_gated_delta_rule.py \
      $rows ${BENCH_ARGS:-} --mode $mode --peers $peers --fla-tuning cached --out "$R/bench" --tag "H200-$arch" \
      --deadline-s "$(cap 180)" > "$R/bench-$arch.txt" 2>&1
    echo "bench $arch: rc=$?"
  done
fi
PROFILE_SHAPES=${PROFILE_SHAPES:-"16/32@seqs=5000+3000+2500+2000+2384+1500,8/16@4x4096"}
if has profile; then
  for arch in ${BENCH_ARCHES:-sm90 sm100 sm120}; do
    proof=""; [[ $arch != sm90 ]] && proof=$arch
    FLASH_QLA_PROOF_ARCH=$proof timeout "$(cap 200)" python3 profile/profile_gdr.py \
      --shapes "$PROFILE_SHAPES" --peers none --iters 10 --top 14 --out "$R/profile-$arch" \
      > "$R/profile-$arch.txt" 2>&1
    echo "profile $arch: rc=$?"
  done
fi
if has cache; then
  tar cJf "$OUT/tilelang-cache.tar.xz" -C "$CACHE" --exclude='*/cuda-binaries' --exclude='*/.staging' .
fi
tar cJf "$OUT/results.tar.xz" -C "$R" .
for f in "$R"/sm100-tests-*.txt "$R"/sm120-tests-*.txt "$R"/sm90-tests-*.txt; do
  [ -f "$f" ] && grep -E "^FAILED|^ERROR" "$f" | head -12
done
# last: the short tables
python3 - "$R/bench" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(tag):
    path = os.path.join(d, f"{tag}.json")
    if not os.path.exists(path):
        return {}
    return {r["shape"]: r for r in json.load(open(path))["results"]
            if r.get("impl") == "ours" and r.get("status") == "ok"}
base, s100, s120 = rows("H200-sm90"), rows("H200-sm100"), rows("H200-sm120")
if base or s100 or s120:
    print(f"{'shape':<28}{'SM90 ms':>10}{'SM100 build':>13}{'SM120 build':>13}")
    for shape in sorted(set(base) | set(s100) | set(s120)):
        cells = [d.get(shape, {}).get("eager_ms") for d in (base, s100, s120)]
        print(f"{shape:<28}" + "".join(f"{c:>{w}.3f}" if c else f"{'-':>{w}}"
                                       for c, w in zip(cells, (10, 13, 13))))
PY
for f in "$R"/profile-*/*.md; do   # per-kernel shares of the backward, then the summary
  [ -f "$f" ] && { echo "== $f"; grep -E "^\| (ours|config)|chunk_|group_sum|^## " "$f" | cut -c1-150 | head -60; }
done
for stage in compile sm100 sm120 sm90; do [ -n "${STATUS[$stage]:-}" ] && echo "$stage: ${STATUS[$stage]}"; done
