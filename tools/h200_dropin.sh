#!/usr/bin/env bash
# One device call for the drop-in work (fits the 10-minute limit). Stages (STAGES="..."):
#   compile  every shipped sm90 kernel into the writable cache (14 processes, ~1-2 min on a
#            fresh H200 host; cache hits from a carried .offline-gpu/tilelang-cache.tar.xz)
#   tests    pytest -m gpu on TEST_PATHS (default: all of tests/)
#   ptests   pytest on each ";"-separated group of TEST_GROUPS, side by side (one GPU)
#   fwd/bwd  bench on FWD_ROWS / BWD_ROWS (bench --shapes; default: README's rows) with
#            PEERS (FWD_PEERS / BWD_PEERS: per mode), one worker per implementation
#            and mode; BENCH_ARGS: options
#            (default --dense-batch); FWD_TAG / BWD_TAG: results file
#            stems (default H200-fwd / H200-bwd)
#   proof    pytest on PROOF_TESTS under FLASH_QLA_PROOF_ARCH=${PROOF_ARCH:-sm100} (the
#            Blackwell kernels' Hopper build; needs them in the cache), side by side with
#            ptests when both are asked for
#   decode   benchmark/bench_decode.py (DECODE_ARGS) -> decode.json
#   first    tools/first_use.py in fresh processes (first forward / first training step)
#   host     tools/host_cost.py (host wall and GPU time per call) for each of HOST_IMPLS
#            (default: ours flashqla fla) on HOST_SHAPES, forward and training step;
#            HOST_ARGS: more options (e.g. --dense-batch); HOST_TRACE=1: torch profiler
#            timelines too (in results.tar.xz)
#   cache    the cache as $OUT/tilelang-cache.tar.xz (for the next call's carry), and
#            Triton's autotune results (FLA's tunings, *.autotune.json) as
#            $OUT/triton-autotune.tar.xz: put it in .offline-gpu/ and the next call's FLA
#            skips the autotune of every (kernel, key) tuned before (H100 and H200 share
#            Triton's target, sm_90)
# Results: $OUT/results.tar.xz, tables printed last. Usage, on the H200, repo root:
#   STAGES="compile tests cache" bash tools/h200_dropin.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
STAGES=${STAGES:-"compile tests cache"}
BUDGET=${SESSION_BUDGET:-560}
has() { [[ " $STAGES " == *" $1 "* ]] && (( BUDGET - SECONDS > 20 )); }
cap() { local left=$(( BUDGET - SECONDS - 15 )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }
CACHE=/tmp/tilelang-cache; mkdir -p "$CACHE"
[ -d .offline-gpu/tilelang-cache ] && cp -r .offline-gpu/tilelang-cache/. "$CACHE"/
export TILELANG_CACHE_DIR=$CACHE
export TRITON_CACHE_DIR=/tmp/triton-cache; mkdir -p "$TRITON_CACHE_DIR"
[ -f .offline-gpu/triton-autotune.tar.xz ] && tar xJf .offline-gpu/triton-autotune.tar.xz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if has compile; then
  start=$SECONDS
  timeout "$(cap 300)" python3 -m flash_qla_sm90.precompile "$CACHE" --jobs 14 \
    > "$R/compile.txt" 2>&1
  echo "compile: rc=$? $((SECONDS - start)) s: $(tail -1 "$R/compile.txt")"
fi
if has tests; then
  timeout "$(cap ${TEST_TIMEOUT:-300})" python3 -m pytest -q -p no:cacheprovider -rfE \
    --durations=5 ${TEST_PATHS:-tests} -m gpu > "$R/gpu-tests.txt" 2>&1
  echo "tests: $(tail -1 "$R/gpu-tests.txt")"
fi
# the README's rows: one long sequence at few heads, one at many, an RL batch of 6, 64 short
# sequences, a dense batch (--dense-batch); the default peers: ours with host offsets, FLA
# routed to ours, FlashQLA 0.1.3 (its kernels precompiled by tools/prepare_flashqla_peer.py)
S6=seqs=5000+3000+2500+2000+2384+1500
S64=seqs=$(python3 -c "print('+'.join(str(200 + (i * 131) % 700) for i in range(64)))")
FWD_ROWS=${FWD_ROWS:-"fwd:4/8@1x65536,fwd:16/64@1x24576,fwd:16/32@$S6,fwd:2/4@$S64"}
BWD_ROWS=${BWD_ROWS:-"bwd:4/8@1x65536,bwd:16/64@1x24576,bwd:16/32@$S6,bwd:2/4@$S64,bwd:8/16@4x4096"}
if has proof; then
  FLASH_QLA_PROOF_ARCH=${PROOF_ARCH:-sm100} timeout "$(cap ${TEST_TIMEOUT:-300})" \
    python3 -m pytest -q -p no:cacheprovider -rfE --tb=short ${PROOF_TESTS:-tests/sm90} \
    > "$R/proof-tests.txt" 2>&1 &
fi
if has ptests; then   # TEST_GROUPS: ";"-separated pytest targets, run side by side on the GPU
  IFS=';' read -ra groups <<< "${TEST_GROUPS:-tests}"
  i=0
  for g in "${groups[@]}"; do
    timeout "$(cap ${TEST_TIMEOUT:-300})" python3 -m pytest -q -p no:cacheprovider -rfE \
      --durations=3 $g > "$R/gpu-tests-$i.txt" 2>&1 &
    i=$((i + 1))
  done
fi
wait
for f in "$R"/gpu-tests-*.txt; do [ -f "$f" ] && echo "$f: $(tail -1 "$f")"; done
[ -f "$R/proof-tests.txt" ] && echo "proof: $(tail -1 "$R/proof-tests.txt")"
if has decode; then
  timeout "$(cap 120)" python3 benchmark/bench_decode.py --out "$R/decode.json" ${DECODE_ARGS:-} \
    > "$R/decode.txt" 2>&1
  echo "decode: rc=$?"
fi
FQ=""; [ -d .offline-gpu/peers/flashqla ] && FQ="--flashqla-path .offline-gpu/peers/flashqla"
B="python3 benchmark/bench_gated_delta_rule.py --out $R --worker-per mode $FQ --fla-tuning cached --fla-tune-rep-ms ${FLA_TUNE_REP_MS:-10} ${BENCH_ARGS:---dense-batch}"
PEERS=${PEERS:-host-offsets,fla-routed,flashqla}
if has first; then
  for order in "" --step-first; do
    timeout "$(cap 60)" python3 tools/first_use.py $order > "$R/first-use${order}.txt" 2>&1
  done
fi
if has host; then   # one process per implementation and call: host timings alone on the GPU
  for impl in ${HOST_IMPLS:-ours flashqla fla}; do
    for step in "" --fwd-bwd; do
      f="$R/host-$impl${step:+-step}.txt"
      FLA_CACHE_RESULTS=1 timeout "$(cap 120)" python3 tools/host_cost.py --impl "$impl" $FQ $step \
        ${HOST_ARGS:-} ${HOST_TRACE:+--trace "$R/trace-$impl${step:+-step}"} \
        --profile-top 15 --shapes "${HOST_SHAPES:-2/8@1x8192,4/8@1x8192,16/32@$S6}" > "$f" 2>&1
      echo "host $impl ${step:-fwd}: rc=$?"
    done
  done
fi
if has fwd; then
  timeout "$(cap ${FWD_TIMEOUT:-240})" $B --mode fwd --peers "${FWD_PEERS:-$PEERS}" --shapes "$FWD_ROWS" --tag "${FWD_TAG:-H200-fwd}" \
    --deadline-s "$(cap 200)" > "$R/fwd.txt" 2>&1
fi
if has bwd; then
  timeout "$(cap ${BWD_TIMEOUT:-300})" $B --mode bwd --peers "${BWD_PEERS:-$PEERS}" --shapes "$BWD_ROWS" --tag "${BWD_TAG:-H200-bwd}" \
    --deadline-s "$(cap 260)" > "$R/bwd.txt" 2>&1
fi
if has cache; then
  tar cJf "$OUT/tilelang-cache.tar.xz" -C "$CACHE" --exclude='*/cuda-binaries' --exclude='*/.staging' .
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | grep -q . &&
     find . -name '*.autotune.json' | tar cJf "$OUT/triton-autotune.tar.xz" -T -)
fi
tar cJf "$OUT/results.tar.xz" -C "$R" .
for f in "$R"/gpu-tests*.txt; do [ -f "$f" ] && grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -8; done
for f in "$R"/first-use*.txt; do [ -f "$f" ] && { echo "== $f"; tail -12 "$f"; }; done
for f in "$R"/host-*.txt; do [ -f "$f" ] && { echo "== $f"; tail -5 "$f"; }; done
[ -f "$R/proof-tests.txt" ] && grep -E "^FAILED|^ERROR|Error|passed|failed" "$R/proof-tests.txt" | tail -30
[ -f "$R/decode.txt" ] && tail -15 "$R/decode.txt"
for f in "$R"/fwd.txt "$R"/bwd.txt; do [ -f "$f" ] && tail -40 "$f"; done
