#!/usr/bin/env bash
# v21 call 4 (tree: main). .main-ref/ct/packages: next/fused-chain-tma-main (chain-tma's
# dv / dk by TMA through dU's tile, cherry-picked onto main alone). (1) the fused GPU
# tests + the whole backward file on it, (2) tune_chunk_bwd main / ct / main, (3) issue
# 6's training-step rows beside FlashQLA 0.1.3 (ct if its tests passed, else main),
# (4) the forward rows beside FlashQLA if time is left. LIMIT=<the run's limit_s>.
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu > /dev/null
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d); MR=$PWD/.main-ref
pp() { echo "$1/flash-qla-sm90/src:$1/flash-qla-core/src:${PYTHONPATH:-}"; }
LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - 25 - SECONDS )); }
save() { tar cJf $OUT/results.tar.xz -C $R .; }
CT=$(pp $MR/ct/packages)
PYTHONPATH=$CT timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/sm90/test_bwd_fused_gpu.py tests/sm90/test_backward_gpu.py > $R/gpu-ct.txt 2>&1
rc=$?; echo "tests ct rc=$rc"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu-ct.txt | tail -6 | cut -c1-300; save
S="16/16@8x4096,4/16@8x4096"; i=0
for v in main ct main; do
  i=$((i+1)); P=$MR/packages; [ $v = ct ] && P=$MR/ct/packages
  PYTHONPATH=$(pp $P) timeout -s KILL 60 python3 benchmark/tune_chunk_bwd.py --shapes $S > $R/tune-$i-$v.txt 2>&1
  echo "== $i $v rc=$?"; grep -E "8x4096" $R/tune-$i-$v.txt | tail -2
done; save
USE=$MR/packages; TAG=main; [ $rc = 0 ] && USE=$MR/ct/packages && TAG=ct
B="python3 benchmark/bench_gated_delta_rule.py --worker-per mode --flashqla-path .offline-gpu/peers/flashqla"
L=$(left); (( L > 240 )) && L=240
(( L > 60 )) && PYTHONPATH=$(pp $USE) timeout -s KILL $L $B --out $R/bwd --mode bwd --peers flashqla \
  --tag H200-bwd-v21-$TAG --deadline-s $(( L - 15 )) \
  --shapes "16/16@1x32768,8/8@1x32768,4/4@1x32768,4/16@1x32768,2/8@1x32768,2/4@1x32768,4/8@1x32768,4/16@1x8192,2/8@1x8192,2/4@1x8192,4/8@1x8192" > $R/bwd-fq.txt 2>&1
echo "bench bwd ($TAG)"; grep -v "cfg/s" $R/bwd-fq.txt | grep "x" | grep "^|" | head -13 | cut -c1-260; save
L=$(left); (( L > 150 )) && L=150
(( L > 60 )) && PYTHONPATH=$(pp $USE) timeout -s KILL $L $B --out $R/fwd --mode fwd --peers flashqla \
  --tag H200-fwd-v21 --deadline-s $(( L - 15 )) \
  --shapes "16/16@1x32768,8/8@1x32768,4/4@1x32768,2/4@1x32768,2/8@1x32768,4/8@1x32768,4/16@1x32768,2/4@1x8192,2/8@1x8192,4/8@1x8192,4/16@1x8192" > $R/fwd-fq.txt 2>&1
echo "bench fwd"; grep -v "cfg/s" $R/fwd-fq.txt | grep "^|" | head -13 | cut -c1-200; save
