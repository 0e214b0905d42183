#!/usr/bin/env bash
# v21 call 5: the eager puzzle (see v21-call5.py), ours then FlashQLA 0.1.3.
set -uo pipefail
source .offline-gpu/activate.sh .offline-gpu > /dev/null
export TILELANG_PRINT_ON_COMPILATION=0
R=$(mktemp -d)
timeout -s KILL 80 python3 .main-ref/v21-call5.py ours $R > $R/ours.txt 2>&1; echo "ours rc=$?"
tar cJf $OUT/results.tar.xz -C $R .
timeout -s KILL 110 python3 .main-ref/v21-call5.py flashqla $R --flashqla-path .offline-gpu/peers/flashqla > $R/flashqla.txt 2>&1; echo "flashqla rc=$?"
tar cJf $OUT/results.tar.xz -C $R .
grep -h "^|" $R/ours.txt $R/flashqla.txt; tail -n 3 $R/ours.txt | grep -i error; tail -n 3 $R/flashqla.txt | grep -i error
