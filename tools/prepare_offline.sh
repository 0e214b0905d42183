#!/usr/bin/env bash
# Prepare the offline GPU bundle on the CPU machine, once per checkout (~6 min):
# TileLang + FLA (+ FlashQLA 0.1.3 as a peer) wheels, and every sm90 kernel compiled for
# sm_90a into .offline-gpu/tilelang-cache, so device minutes go to running, not compiling.
# Then: `run` with carry [".offline-gpu"] and `bash tools/h200_session.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.offline-gpu/' .git/info/exclude 2>/dev/null || echo /.offline-gpu/ >> .git/info/exclude
FLASHQLA_PEER=1 ../shared/offline-gpu/make-bundle .offline-gpu --no-flashinfer
python3 -m pip install -q torch==2.13.0 tilelang==0.1.15   # the compiler, CPU side
TILELANG_PRINT_ON_COMPILATION=0 \
  PYTHONPATH=packages/flash-qla-sm90/src:packages/flash-qla-core/src \
  python3 -m flash_qla_sm90.kernels.kernel_cache .offline-gpu/tilelang-cache
du -sh .offline-gpu
