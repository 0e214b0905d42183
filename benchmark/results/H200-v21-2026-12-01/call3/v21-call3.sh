#!/usr/bin/env bash
# v21 call 3 (tree: main 5e88f42). .main-ref/m-X: next/fused-X merged with main
# (packages + its tune scripts; kernel cache keys unchanged by the merge, checked on the
# CPU). (1) tune_chunk_bwd on one lease: main, m-gag, m-dg-scan, m-v21, m-chain-tma,
# main; (2) the fused GPU tests on m-gag, m-dg-scan, m-v21 (m-chain-tma, holding every
# change, passed 73 in call 1); (3) host time per training step, ours and FlashQLA, at
# two few-head 8192-token rows. LIMIT=<the run's limit_s>.
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu > /dev/null
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d); MR=$PWD/.main-ref; ROOT=$PWD
pp() { echo "$1/flash-qla-sm90/src:$1/flash-qla-core/src:${PYTHONPATH:-}"; }
LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - 25 - SECONDS )); }
save() { tar cJf $OUT/results.tar.xz -C $R .; }
S="16/16@8x4096,4/16@8x4096"
i=0
for v in main m-gag m-dg-scan m-v21 m-chain-tma main; do
  i=$((i+1)); D=$MR/$v; P=$D/packages
  [ $v = main ] && D=$ROOT && P=$MR/packages
  (cd $D/benchmark && PYTHONPATH=$(pp $P) timeout -s KILL 60 python3 tune_chunk_bwd.py --shapes $S) > $R/tune-$i-$v.txt 2>&1
  echo "== $i $v rc=$?"; grep -E "8x4096" $R/tune-$i-$v.txt | tail -2; tail -1 $R/tune-$i-$v.txt | grep -i error
done; save
for v in m-gag m-dg-scan m-v21; do
  L=$(left); (( L > 100 )) && L=100; (( L < 40 )) && break
  PYTHONPATH=$(pp $MR/$v/packages) timeout -s KILL $L python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/sm90/test_bwd_fused_gpu.py > $R/gpu-$v.txt 2>&1
  echo "tests $v rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu-$v.txt | tail -4 | cut -c1-300; save
done
H="4/8@1x8192,2/4@1x8192"
L=$(left); (( L > 60 )) && timeout -s KILL 60 python3 tools/host_cost.py --fwd-bwd --shapes $H > $R/host-ours.txt 2>&1
L=$(left); (( L > 60 )) && timeout -s KILL 60 python3 tools/host_cost.py --fwd-bwd --shapes $H --impl flashqla \
  --flashqla-path .offline-gpu/peers/flashqla > $R/host-flashqla.txt 2>&1
tail -4 $R/host-ours.txt $R/host-flashqla.txt; save
