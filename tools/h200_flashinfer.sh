#!/usr/bin/env bash
# One device call measuring FlashInfer 0.7.x (the bundle of tools/make_flashinfer_bundle.sh)
# on the forward rows FI_SHAPES, to be merged with ours measured in another call
# (docs/flashinfer-peer.md). Ours runs here only as the reference of FlashInfer's error
# columns, on its torch backend (TileLang is not in this bundle), and is not timed.
#
# Usage (device `run`, carry [".offline-gpu-fi"], repo root):
#   FI_RESUME=.offline-gpu-fi/resume/H200.json FI_SHAPES='16/32@8x4096,16/64@1x32768' \
#     bash tools/h200_flashinfer.sh
# FI_RESUME  results JSON of the call that measured ours on the same shapes (tag, seed and
#            gate as here): its rows are kept, FlashInfer's are added (bench --resume).
#            Without it the "ours" rows are timings of the torch reference: meaningless.
# FI_SHAPES  bench --shapes (default: the four rows of benchmark/results/H200.md)
# FI_TAG     results file stem (default H200, as FI_RESUME's name should be)
# FI_CP      bench --flashinfer-cp: auto (default), on, off
# FI_WORKER_PER  bench --worker-per (default mode: one FlashInfer process compiles its
#            CuTe-DSL kernels once for every row; "config" pays that per row)
# FI_GRAPHS  1 (default): also the CUDA-graph column; 0: eager only
# FI_TIMEOUT seconds for the benchmark (default 480; the device stops a call at 600)
# FI_ARGS    more bench options, e.g. '--grid serve' (with FI_SHAPES='*@*': the serving
#            grid, FlashInfer through its state_indices)
# Results: $OUT/results.tar.xz (the benchmark's md/csv/json and its log).
set -uo pipefail
T0=$SECONDS
source .offline-gpu-fi/activate.sh .offline-gpu-fi
echo "activate: $((SECONDS - T0)) s"
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
TAG=${FI_TAG:-H200}
TIMEOUT=${FI_TIMEOUT:-480}
RESUME=()
if [ -n "${FI_RESUME:-}" ]; then
  cp "$FI_RESUME" "$R/$TAG.json" && RESUME=(--resume)
else
  echo "note: no FI_RESUME: the 'ours' rows will be timings of the torch reference" >&2
fi
GRAPHS=(); [ "${FI_GRAPHS:-1}" = 0 ] && GRAPHS=(--no-graphs)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "$TIMEOUT" python3 benchmark/bench_gated_delta_rule.py --out "$R" --mode fwd \
  --peers flashinfer --tag "$TAG" --ours-backend torch "${RESUME[@]}" "${GRAPHS[@]}" \
  --flashinfer-cp "${FI_CP:-auto}" --worker-per "${FI_WORKER_PER:-mode}" \
  --deadline-s $((TIMEOUT - 90)) --worker-timeout $((TIMEOUT - 30)) \
  --shapes "${FI_SHAPES:-16/32@8x4096,16/64@2x16384,16/64@1x32768,16/16@4x8192}" \
  ${FI_ARGS:-} > "$R/flashinfer.txt" 2>&1
echo "benchmark exit $? after $((SECONDS - T0)) s"
tar cJf "$OUT/results.tar.xz" -C "$R" .
tail -n 40 "$R/flashinfer.txt"
