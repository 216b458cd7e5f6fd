#!/bin/bash
O=/tmp/o; mkdir -p $O; R=$PWD
bash tools/gpu_suite.sh exec $O/setup true >/dev/null 2>&1; export PYTHONPATH=/tmp/elsa_pp:$PWD
cp recipes/bench_attention.py /tmp/ba.py
(cd /tmp && timeout 280 python3 ba.py --backward --sweep --dtypes fp32-strict --n 2048 --shapes 16x128 --causal 0 \
   --baselines efficient --space "bm=16,32,64;bn=32,64;w=4,8;s=1" > $O/strict_sweep.log 2>&1)
grep -E "BEST|baseline|WRONG|failed" $O/strict_sweep.log | cut -c1-220; grep "sweep backward" $O/strict_sweep.log | sort -t'(' -k2 | head -12 | cut -c1-200
tar czf $OUT/run.tgz -C $O .
