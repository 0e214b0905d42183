#!/usr/bin/env bash
# v21 call 2 (tree: main 5e88f42). (1) tune_chunk_bwd on one lease: main, gag, dgscan,
# v21, chaintma, main again (each branch with its own tune script: call 1's failed on
# main's host_chunks import); (2) issue 6's missing training-step rows beside FlashQLA
# 0.1.3 (main). LIMIT=<the run's limit_s>; the archive is rewritten after every step.
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu > /dev/null
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d); MR=$PWD/.main-ref
pp() { echo "$1/flash-qla-sm90/src:$1/flash-qla-core/src:${PYTHONPATH:-}"; }
LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - 25 - SECONDS )); }
save() { tar cJf $OUT/results.tar.xz -C $R .; }
S="16/16@8x4096,4/16@8x4096"
i=0
for v in main gag dgscan v21 chaintma main; do
  i=$((i+1)); P=$MR/$v/packages; T=$MR/$v/benchmark/tune_chunk_bwd.py
  [ $v = main ] && P=$MR/packages && T=benchmark/tune_chunk_bwd.py
  PYTHONPATH=$(pp $P) timeout -s KILL 60 python3 $T --shapes $S > $R/tune-$i-$v.txt 2>&1
  echo "== $i $v rc=$?"; grep -E "8x4096" $R/tune-$i-$v.txt | tail -2
done; save
B="python3 benchmark/bench_gated_delta_rule.py --worker-per mode --flashqla-path .offline-gpu/peers/flashqla"
L=$(left); (( L > 300 )) && L=300
(( L > 60 )) && timeout -s KILL $L $B --out $R/bwd --mode bwd --peers flashqla --tag H200-bwd-v21-fewhead \
  --deadline-s $(( L - 15 )) --shapes "2/4@1x32768,4/8@1x32768,4/4@1x32768,2/4@1x8192,4/8@1x8192,2/8@1x8192" > $R/bwd-fq.txt 2>&1
grep -v "cfg/s" $R/bwd-fq.txt | grep "|" | head -9 | cut -c1-300; save
