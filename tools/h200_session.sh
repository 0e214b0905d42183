#!/usr/bin/env bash
# One device call (fits the 10-minute limit). Stages, chosen with STAGES="...":
#   smoke     one short run of the forward's two kernels with tune_chunk_fwd.py under
#             SMOKE_TIMEOUT (default 60 s); if it fails (a hang, a
#             fault), every later stage is skipped (they all run the default kernels), so
#             a broken kernel costs a minute instead of the call
#   tests     pytest -m gpu (forward, backward, segments), TEST_FILTER (-k) selecting
#   dh        the reverse-sweep kernel check (isolated: it is the slowest)
#   tune      benchmark/tune_chunk_fwd.py: the prepare and the recurrence, checked and timed
#   bwd       forward+backward timings of ours and BWD_PEERS (bench --mode bwd), once per
#             BWD_SEG_LENS (default "auto"; "off" / lengths as in seg)
#   fwd       forward timings of ours, eager and graphed (bench --mode fwd)
#   evidence  forward table (eager + CUDA graph) of ours beside EVIDENCE_PEERS on
#             EVIDENCE_SHAPES, tag H200 (the file benchmark/results/H200.md is made of)
#   profile   per-kernel profile of ours, develop set
#   seg       forward of ours on SEG_SHAPES for each of SEG_LENS (default "auto off 1024
#             2048 4096": the backend's choice, never split, forced lengths; issue 6;
#             "exact": the backend's choice with segment_shortcut_bound=0),
#             then, if SEG_PROFILE is set, the kernel profile of the segment path with
#             SEG_PROFILE_LEN on those rows of SEG_PROFILE_SET (default develop;
#             SEG_PROFILE_HOST=1: host ops)
#   fla       (FLA_RESUME: continue that earlier H200-fla.json, bench --resume)
#             forward beside FLA_PEERS (default fla; "fla,flashqla" adds FlashQLA 0.1.3,
#             whose kernels the bundle precompiles) on FLA_SHAPES (FLA autotunes every
#             shape, each config timed FLA_TUNE_REP_MS, default 20 ms, not Triton's 100)
#   host      tools/host_cost.py on HOST_SHAPES (host wall per eager call, each TileLang
#             launch alone, cProfile); with the FlashQLA peer in the bundle, its wall too;
#             HOST_ARGS: more options (--backward: ours only; --fwd-bwd: the training step);
#             HOST_TRACE (any non-empty value): the torch profiler's timelines too
#             (trace-<impl>/*.json.gz)
#   ncu       Nsight Compute warp-stall breakdown of one launch of NCU_KERNEL (a regex,
#             default chunk_fwd: the recurrence) on NCU_SHAPE (if ncu exists);
#             NCU_SOURCE=1 adds the stall samples per SASS instruction (ncu-sass.csv);
#             NCU_WORKLOAD: another command to profile (e.g. profile/profile_gdr.py on a
#             backward shape, for NCU_KERNEL=chunk_bwd_intra)
# Results: one archive $OUT/results.tar.xz (the device returns at most 8 files); tables
# printed last. Usage (on the lent H200, repo root, .offline-gpu carried):
#   STAGES="tests tune" bash tools/h200_session.sh
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu
export TILELANG_PRINT_ON_COMPILATION=0
# the tables go to a scratch folder and come back as one archive (the device returns at
# most 8 files, so they must not lie under $OUT one by one)
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
STAGES=${STAGES:-"tests tune bwd"}
# SESSION_BUDGET (default 560 s, the device kills a call at 600): every stage's timeout is
# capped by what is left, a stage is skipped with < 20 s left, so the archive always comes
has() { [[ " $STAGES " == *" $1 "* ]] && (( ${SESSION_BUDGET:-560} - SECONDS > 20 )); }
cap() { local left=$(( ${SESSION_BUDGET:-560} - SECONDS - 5 )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }
# bench options of one split setting: auto (the backend's choice), exact (that with
# segment_shortcut_bound=0), off (never split) or a segment length
split_args() {
  case "$1" in
    auto) ;;
    exact) echo --ours-shortcut-bound 0 ;;
    *) echo --ours-segment-len "$1" ;;
  esac
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
PT="python3 -m pytest -q -p no:cacheprovider -rfE --durations=5"
# the peer FlashQLA 0.1.3 when the bundle has it (its kernels precompiled in the cache)
FQ=""; [ -d .offline-gpu/peers/flashqla ] && FQ="--flashqla-path .offline-gpu/peers/flashqla"
# FLA_TUNING=cached: FLA reuses its on-disk tunings across shapes (bench --fla-tuning);
# WORKER_PER=heads: one process per (implementation, heads group) (bench --worker-per);
# MIN_SEQ_HEADS=64: only rows with sequences x value heads >= 64 (bench --min-seq-heads;
# e.g. FLA_SHAPES='*@*' MIN_SEQ_HEADS=64: issue 4's 57 forward rows; MAX_SEQ_HEADS=64:
# the other 42, the few-head rows)
B="python3 benchmark/bench_gated_delta_rule.py --out $R --no-graphs $FQ ${FLA_TUNING:+--fla-tuning $FLA_TUNING} ${WORKER_PER:+--worker-per $WORKER_PER} ${MIN_SEQ_HEADS:+--min-seq-heads $MIN_SEQ_HEADS} ${MAX_SEQ_HEADS:+--max-seq-heads $MAX_SEQ_HEADS}"
if has smoke; then
  if ! timeout "$(cap "${SMOKE_TIMEOUT:-60}")" python3 benchmark/tune_chunk_fwd.py \
      --shapes 2/8@1x2048 > "$R/smoke.txt" 2>&1; then
    echo "smoke failed: skipping the stages after it ($STAGES)" | tee -a "$R/smoke.txt"
    STAGES=""
  fi
fi
if has tests; then
  timeout "$(cap "${TEST_TIMEOUT:-240}")" $PT tests -m gpu -k "${TEST_FILTER:-not dh_kernel}" > "$R/gpu-tests.txt" 2>&1
fi
if has dh; then
  timeout "$(cap 60)" $PT tests/sm90/test_backward_gpu.py -k dh_kernel > "$R/gpu-dh.txt" 2>&1
fi
if has tune; then
  timeout "$(cap "${TUNE_TIMEOUT:-150}")" python3 benchmark/tune_chunk_fwd.py ${TUNE_ARGS:-} > "$R/tune.txt" 2>&1
fi
# bwd: each run stops starting shapes BWD_TIMEOUT - 80 s in (FLA's autotuning of one
# shape takes ~45 s): BWD_TIMEOUT >= 150 for two shapes
if has bwd; then   # BWD_SEG_LENS: "auto" (default), "off" or lengths, one run each
  for len in ${BWD_SEG_LENS:-auto}; do
    timeout "$(cap "${BWD_TIMEOUT:-120}")" $B --mode bwd --peers "${BWD_PEERS:-none}" --tag "H200-bwd-$len" \
      --deadline-s $(( ${BWD_TIMEOUT:-120} - 80 )) --fla-tune-rep-ms "${FLA_TUNE_REP_MS:-20}" \
      $(split_args "$len") --shapes "${BWD_SHAPES:-16/16@1x8192,16/16@1x32768,4/4@1x32768}" \
      > "$R/bwd-$len.txt" 2>&1
  done
fi
if has fwd; then   # ours alone on forward-grid rows, eager and CUDA-graph replay
  timeout "$(cap 150)" python3 benchmark/bench_gated_delta_rule.py --out "$R" --mode fwd --peers none \
    --tag H200-fwd --deadline-s 120 --shapes "${FWD_SHAPES:-2/8@1x32768,16/32@1x8192}" \
    > "$R/fwd.txt" 2>&1
fi
if has evidence; then   # the headline table: ours beside EVIDENCE_PEERS, eager and graphed
  timeout "$(cap "${EVIDENCE_TIMEOUT:-240}")" python3 benchmark/bench_gated_delta_rule.py --out "$R" $FQ \
    --mode fwd --peers "${EVIDENCE_PEERS:-flashinfer}" --tag H200 \
    --fla-tune-rep-ms "${FLA_TUNE_REP_MS:-20}" --shapes "${EVIDENCE_SHAPES:-16/32@8x4096}" \
    > "$R/evidence.txt" 2>&1
fi
if has profile; then
  timeout "$(cap 120)" python3 profile/profile_gdr.py --set develop --peers none --iters 3 \
    --shapes "${PROFILE_SHAPES:-16/16@*}" --out "$R" > "$R/profile.txt" 2>&1
fi
if has seg; then
  for len in ${SEG_LENS:-auto off 1024 2048 4096}; do
    timeout "$(cap 100)" python3 benchmark/bench_gated_delta_rule.py --out "$R" --mode fwd --peers none \
      --tag "H200-seg-$len" --deadline-s 85 $(split_args "$len") \
      --shapes "${SEG_SHAPES:-2/8@1x32768,4/16@1x32768,16/16@1x32768,2/8@1x8192}" > "$R/seg-$len.txt" 2>&1
  done
  if [ -n "${SEG_PROFILE:-}" ]; then   # e.g. SEG_PROFILE="4/4@*" SEG_PROFILE_LEN=4096
    # SEG_PROFILE_SET: the profile set SEG_PROFILE filters (develop; few-head for GVA rows)
    timeout "$(cap 120)" python3 profile/profile_gdr.py --set "${SEG_PROFILE_SET:-develop}" \
      --peers none --iters 3 \
      --skip-bwd --shapes "$SEG_PROFILE" --ours-segment-len "${SEG_PROFILE_LEN:-4096}" \
      ${SEG_PROFILE_HOST:+--host} \
      --out "$R/seg-profile" > "$R/seg-profile.txt" 2>&1
  fi
fi
if has host; then
  HS=${HOST_SHAPES:-2/8@1x32768,2/8@1x8192,16/16@1x32768}
  timeout "$(cap 90)" python3 tools/host_cost.py --shapes "$HS" ${HOST_ARGS:-} \
    ${HOST_TRACE:+--trace "$R/trace-ours"} > "$R/host-ours.txt" 2>&1
  if [ -n "$FQ" ] && [[ "${HOST_ARGS:-}" != *--backward* ]]; then
    timeout "$(cap 90)" python3 tools/host_cost.py --impl flashqla $FQ --shapes "$HS" ${HOST_ARGS:-} \
      ${HOST_TRACE:+--trace "$R/trace-flashqla"} \
      > "$R/host-flashqla.txt" 2>&1
  fi
fi
if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    timeout "$(cap 150)" "$NCU" --kernel-name "regex:${NCU_KERNEL:-chunk_fwd}" --launch-count 1 \
      --section WarpStateStats --section SchedulerStats --section LaunchStats \
      --section Occupancy --section ComputeWorkloadAnalysis --section SpeedOfLight \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      ${NCU_SOURCE:+--section SourceCounters --import-source no -o "$R/ncu-report"} \
      ${NCU_WORKLOAD:-python3 benchmark/tune_chunk_fwd.py \
      --shapes "${NCU_SHAPE:-2/8@1x8192}"} \
      > "$R/ncu.txt" 2>&1
    if [ -n "${NCU_SOURCE:-}" ] && [ -f "$R/ncu-report.ncu-rep" ]; then   # per-SASS stalls
      "$NCU" --import "$R/ncu-report.ncu-rep" --page details >> "$R/ncu.txt" 2>&1
      "$NCU" --import "$R/ncu-report.ncu-rep" --page source --csv --print-source sass \
        > "$R/ncu-sass.csv" 2>&1
      rm -f "$R/ncu-report.ncu-rep"
    fi
  else
    echo "no ncu on this host" > "$R/ncu.txt"
  fi
fi
if has fla; then   # FLA_RESUME: an H200-fla.json of an earlier call to continue (--resume)
  [ -n "${FLA_RESUME:-}" ] && cp "$FLA_RESUME" "$R/H200-fla.json"
  timeout "$(cap "${FLA_TIMEOUT:-200}")" $B --mode fwd --peers "${FLA_PEERS:-fla}" --tag H200-fla \
    --deadline-s $(( ${FLA_TIMEOUT:-200} - 70 )) \
    --fla-tune-rep-ms "${FLA_TUNE_REP_MS:-20}" ${FLA_RESUME:+--resume} \
    --shapes "${FLA_SHAPES:-16/64@1x32768,16/32@8x4096}" > "$R/fla.txt" 2>&1
fi
tar cJf "$OUT/results.tar.xz" -C "$R" .
[ -f "$R/smoke.txt" ] && tail -3 "$R/smoke.txt"
for f in gpu-tests gpu-dh; do [ -f "$R/$f.txt" ] && grep -E "passed|failed|error" "$R/$f.txt" | tail -3; done
cat "$R"/gpu-*.txt 2>/dev/null | grep -E "^FAILED|^ERROR" | head -20
[ -f "$R/ncu.txt" ] && grep -E "stalled|Stall|Warp Cycles|Issued|Eligible|Active Warps|Duration|Registers|Theoretical Occ|No Eligible|One or More" "$R/ncu.txt" | sort -k3 -rn | head -40
for f in "$R"/{fwd,evidence,profile,fla}.txt "$R"/bwd-*.txt "$R"/seg-*.txt; do   # <stage>-<len>
  [ -f "$f" ] && grep "^|" "$f" | head -12
done
[ -f "$R/tune.txt" ] && tail -22 "$R/tune.txt"
for f in "$R"/host-*.txt; do [ -f "$f" ] && tail -6 "$f"; done
exit 0   # a stage that failed says so in its file; the summary lines above are the result
