#!/usr/bin/env bash
# v21 call 1 (tree: main). .main-ref/{dgscan,gag,v21}/packages: next/fused-dg-scan
# (dbeta / dg's reverse cumsum by one warp's shuffles), next/fused-gag (G and Ag by the
# load role), next/fused-v21 (both), next/fused-chain-tma (v21 + dv / dk by TMA).
# (1) the fused GPU tests + the whole backward file on chaintma, which holds every change
# (on a failure: bisect in call 2 with the fused tests on v21, dgscan, gag), (2)
# tune_chunk_bwd main / dgscan / gag / v21 / chaintma on one lease, (3) where the eager
# training step's host time goes, ours and FlashQLA (tools/host_cost.py --fwd-bwd, with
# the torch profiler's trace of ours), (4) training steps beside FlashQLA (chaintma) if
# time is left. LIMIT=<the run's limit_s>; the archive is rewritten after every step.
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu > /dev/null
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d); MR=$PWD/.main-ref
pp() { echo "$1/flash-qla-sm90/src:$1/flash-qla-core/src:${PYTHONPATH:-}"; }
LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - 25 - SECONDS )); }
save() { tar cJf $OUT/results.tar.xz -C $R .; }
DG=$(pp $MR/chaintma/packages)
PYTHONPATH=$DG timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/sm90/test_bwd_fused_gpu.py tests/sm90/test_backward_gpu.py > $R/gpu-chaintma.txt 2>&1
echo "tests chaintma rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu-chaintma.txt | tail -6 | cut -c1-300; save
S="16/16@8x4096,4/16@8x4096"
for v in main dgscan gag v21 chaintma; do
  P=$MR/$v/packages; [ $v = main ] && P=$MR/packages
  PYTHONPATH=$(pp $P) timeout -s KILL 40 python3 benchmark/tune_chunk_bwd.py --shapes $S > $R/tune-$v.txt 2>&1
  echo "== $v"; tail -2 $R/tune-$v.txt
done; save
H="16/16@1x32768,4/16@1x8192"
timeout -s KILL 90 python3 tools/host_cost.py --fwd-bwd --shapes $H --trace $R/trace > $R/host-ours.txt 2>&1
timeout -s KILL 90 python3 tools/host_cost.py --fwd-bwd --shapes $H --impl flashqla \
  --flashqla-path .offline-gpu/peers/flashqla > $R/host-flashqla.txt 2>&1
grep -E "^\|" $R/host-ours.txt $R/host-flashqla.txt | head -12 | cut -c1-200; save
B="python3 benchmark/bench_gated_delta_rule.py --worker-per mode --flashqla-path .offline-gpu/peers/flashqla"
L=$(left); (( L > 150 )) && L=150
(( L > 60 )) && PYTHONPATH=$DG timeout -s KILL $L $B --out $R/bwd --mode bwd --peers flashqla --tag H200-bwd-v21-chaintma \
  --deadline-s $(( L - 15 )) --shapes "16/16@1x32768,4/16@1x32768,8/8@1x32768" > $R/bwd-fq.txt 2>&1
grep -v "cfg/s" $R/bwd-fq.txt | grep "|" | head -6 | cut -c1-300; save
