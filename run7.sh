#!/bin/bash
O=/tmp/o; mkdir -p $O; R=$PWD
bash tools/gpu_suite.sh exec $O/setup true >/dev/null 2>&1; export PYTHONPATH=/tmp/elsa_pp:$PWD
cp recipes/bench_attention.py /tmp/ba.py
(cd /tmp && timeout 300 python3 ba.py --backward --dtypes fp32-turbo,fp32-strict,fp32-precise --n 4096 \
     --shapes 16x64,16x128 --causal 0,1 --baselines efficient > $O/bwd_fp32_modes.log 2>&1)
grep -o '"dtype": "[a-z0-9-]*"\|"D": [0-9]*\|"causal": [a-z]*\|"elsa_ms": [0-9.]*\|"efficient_ms": [0-9.]*\|"xefficient": [0-9.]*\|"elsa_mb": [0-9.]*\|"efficient_mb": [0-9.]*\|grad_rel_err": [0-9.e-]*' $O/bwd_fp32_modes.log | paste -sd' ' | sed 's/"dtype"/\n"dtype"/g'
tar czf $OUT/run.tgz -C $O .
