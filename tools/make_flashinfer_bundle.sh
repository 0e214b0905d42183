#!/usr/bin/env bash
# Build .offline-gpu-fi/: FlashInfer 0.7.4 for the offline H200 host, to run as a
# benchmark peer in a device call of its own (see docs/flashinfer-peer.md).
#
#   tools/make_flashinfer_bundle.sh [OUT_DIR=.offline-gpu-fi]     # ~6 min on 2 cores
#
# Output: OUT_DIR/site-flashinfer074.tar.xz (~55 MB) and OUT_DIR/activate.sh. On the
# GPU host: `source .offline-gpu-fi/activate.sh` (run with carry [".offline-gpu-fi"],
# without .offline-gpu: the two bundles together exceed a call's 64 MiB).
#
# FlashInfer 0.7.x runs its SM90 GDN prefill as CuTe-DSL kernels that compile in-process
# on first call (no nvcc), so it needs nvidia-cutlass-dsl: the MLIR compiler
# (_cutlass_ir, 193 MB) and the runtime the compiled host code links
# (libcute_dsl_runtime.so, 44 MB). Only the CUDA 13 flavour travels (the host's driver
# is 580 / CUDA 13.0, and the DSL loads the newest flavour the driver supports).
# Left out because the GDN path never imports them (flashinfer guards every import of
# them): cuda-tile, nvidia-cudnn-frontend, nccl4py, nccl-extensions; already on the
# host: cuda-bindings, cuda-pathfinder, numpy, nvidia-ml-py, requests, tqdm, jinja2,
# filelock, packaging, einops, tabulate, click, ninja, protobuf.
# Wheels are cached in ${OFFLINE_GPU_CACHE:-~/.cache/offline-gpu}/wheels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-.offline-gpu-fi}
OUT=${OUT%/}
PY=${PYTHON:-python3}
CACHE=${OFFLINE_GPU_CACHE:-$HOME/.cache/offline-gpu}
WHEELS=$CACHE/wheels
FI_VERSION=0.7.4
DSL_VERSION=4.8.1
TVM_FFI_VERSION=0.1.15.post2
LIMIT=$((64 * 1048576))
mkdir -p "$OUT" "$WHEELS"
git check-ignore -q "$OUT" || echo "/$OUT/" >> "$(git rev-parse --git-path info/exclude)"

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64 --platform any)
fetch() {  # fetch SPEC GLOB: download SPEC unless a wheel matching GLOB is cached
  compgen -G "$WHEELS/$2" > /dev/null || "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WHEELS" "$1"
  compgen -G "$WHEELS/$2" > /dev/null || { echo "no wheel $2 after downloading $1" >&2; exit 1; }
}
fetch "flashinfer-python==$FI_VERSION" "flashinfer_python-$FI_VERSION-*.whl"
fetch "nvidia-cutlass-dsl==$DSL_VERSION" "nvidia_cutlass_dsl-$DSL_VERSION-*.whl"
fetch "nvidia-cutlass-dsl-libs-core==$DSL_VERSION" "nvidia_cutlass_dsl_libs_core-$DSL_VERSION-*.whl"
fetch "nvidia-cutlass-dsl-libs-base==$DSL_VERSION" "nvidia_cutlass_dsl_libs_base-$DSL_VERSION-cp312-*.whl"
fetch "nvidia-cutlass-dsl-libs-cu13==$DSL_VERSION" "nvidia_cutlass_dsl_libs_cu13-$DSL_VERSION-cp312-*.whl"
fetch "apache-tvm-ffi==$TVM_FFI_VERSION" "apache_tvm_ffi-$TVM_FFI_VERSION-cp312-*.whl"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
site=$stage/site
mkdir -p "$site"
for pat in "flashinfer_python-$FI_VERSION-*.whl" "nvidia_cutlass_dsl-$DSL_VERSION-*.whl" \
           "nvidia_cutlass_dsl_libs_core-$DSL_VERSION-*.whl" \
           "nvidia_cutlass_dsl_libs_base-$DSL_VERSION-cp312-*.whl" \
           "nvidia_cutlass_dsl_libs_cu13-$DSL_VERSION-cp312-*.whl" \
           "apache_tvm_ffi-$TVM_FFI_VERSION-cp312-*.whl"; do
  for w in "$WHEELS"/$pat; do unzip -q -o "$w" -d "$site"; done
done
before=$(du -sb "$site" | cut -f1)

# FlashInfer: what `import flashinfer.gdn_prefill` and the SM90 call can reach
"$PY" tools/flashinfer_bundle_keep.py "$site/flashinfer" --drop > "$stage/drop.txt"
(cd "$site/flashinfer" && tr '\n' '\0' < "$stage/drop.txt" | xargs -0 rm -f)
find "$site/flashinfer" -depth -type d -empty -delete
# CuTe DSL: the CUDA 13 compiler and runtime; no aarch64/QNX link stubs, no static
# runtime or C header (AOT export only), no iket (a profiler the GDN path never loads)
dsl=$site/nvidia_cutlass_dsl
rm -rf "$dsl/cu13/lib/stubs" "$dsl/cu13/lib/libcuda_dialect_runtime_static.a" \
       "$dsl/cu13/include" "$dsl/dsl_packages/iket"
# the FlashInfer wheel's build helpers (top level, never imported); libbacktrace's C
# sources (tvm-ffi builds only)
rm -f "$site/build_backend.py" "$site/build_utils.py"
rm -rf "$site/tvm_ffi/3rdparty/libbacktrace"
find "$site" -name '__pycache__' -prune -exec rm -rf {} +
# RECORD files list what is left only (flashinfer's listed 14705 files: 0.6 MB packed)
for rec in "$site"/*.dist-info/RECORD; do
  (cd "$site" && while IFS= read -r line; do
     if [ -e "${line%%,*}" ]; then printf '%s\n' "$line"; fi
   done < "$rec" > "$rec.kept" && mv "$rec.kept" "$rec")
done
find "$site" -name '*.so*' -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
after=$(du -sb "$site" | cut -f1)

# One xz stream, one block, x86 filter, a window spanning everything: the runtime .so
# shares most of its code with the compiler .so, which a window covering both finds
# (packed apart: ~61 MB; together: ~52 MB).
tar cf - -C "$site" --sort=name --owner=0 --group=0 --numeric-owner \
    --mtime='2026-01-01 00:00:00' . \
  | xz --x86 --lzma2=preset=9e,dict=384MiB -T1 > "$OUT/site-flashinfer074.tar.xz"

cat > "$OUT/activate.sh" <<'ACTIVATE'
# Source from the project root on the offline GPU host:
#   source .offline-gpu-fi/activate.sh [BUNDLE_DIR=.offline-gpu-fi]
# (written by tools/make_flashinfer_bundle.sh; see docs/flashinfer-peer.md)
# - unpacks site-flashinfer074.tar.xz into /tmp/offline-site-fi once per host
#   (~10 s; ~300 MB there; needs ~400 MiB of memory for xz's window)
# - puts it, and CuTe DSL's dsl_packages (its .pth is not read from PYTHONPATH), on
#   PYTHONPATH
# - keeps CuTe DSL's compile cache and dumps under /tmp/offline-site-fi-cache
# - installs each packages/*/ of the project editable, offline (entry points)
_B=${1:-.offline-gpu-fi}
_SITE=/tmp/offline-site-fi
_f="$_B/site-flashinfer074.tar.xz"
if [ -f "$_f" ]; then
  _stamp="$_SITE/.unpacked-$(stat -c %s "$_f")"
  if [ ! -f "$_stamp" ]; then
    rm -rf "$_SITE" && mkdir -p "$_SITE" && tar xJf "$_f" -C "$_SITE" && touch "$_stamp"
  fi
else
  echo "activate.sh: no $_f (run tools/make_flashinfer_bundle.sh on the CPU machine)" >&2
fi
export PYTHONPATH="$_SITE:$_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUTE_DSL_CACHE_DIR=${CUTE_DSL_CACHE_DIR:-/tmp/offline-site-fi-cache}
mkdir -p "$CUTE_DSL_CACHE_DIR"
for _p in packages/*/pyproject.toml; do
  [ -f "$_p" ] || continue
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$(dirname "$_p")" \
    || echo "activate.sh: editable install of $(dirname "$_p") failed" >&2
done
python3 - <<'PY'
import importlib, time
import torch
t = time.time()
out = []
for m in ("flashinfer", "cutlass", "tvm_ffi", "cuda.bindings"):
    try:
        out.append(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - reported
        out.append(f"{m} unavailable ({type(e).__name__}: {str(e)[:120]})")
try:
    import flashinfer.gdn_prefill as g
    ok = g.chunk_gated_delta_rule_sm90 is not None
    out.append("sm90 GDN kernel " + ("importable" if ok else "MISSING (its import failed)"))
except Exception as e:  # noqa: BLE001
    out.append(f"flashinfer.gdn_prefill unavailable ({type(e).__name__}: {str(e)[:120]})")
print("offline-gpu-fi:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
      "| torch", torch.__version__, "|", " | ".join(out), f"| imports {time.time() - t:.1f} s")
PY
unset _B _SITE _f _stamp _p
ACTIVATE

packed=$(stat -c %s "$OUT/site-flashinfer074.tar.xz")
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
other=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
bundle=$(du -sb "$OUT" | cut -f1)
total=$((tree + ${other:-0} + bundle))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "site unpacked $(mib "$before"), pruned $(mib "$after"), packed $(mib "$packed")"
echo "tree $(mib "$tree") + untracked $(mib "${other:-0}") + $OUT $(mib "$bundle") = $(mib "$total") (a call takes <= 64 MiB)"
(( total < LIMIT )) || { echo "too large for one device call" >&2; exit 1; }
echo "on the GPU host: source $OUT/activate.sh $OUT"
