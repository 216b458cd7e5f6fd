#!/usr/bin/env bash
# session 56: where the converted side's cold compile time goes (LLaMA bf16 1.49x, ViT-B/16 fp32 1.25x)
bash tools/gpu_suite.sh exec /tmp/setup true >/dev/null 2>&1
export PYTHONPATH=/tmp/elsa_pp:$PWD PYTHONUNBUFFERED=1
R=$PWD; mkdir -p /tmp/p
one() {  # name side workload dtype batch [env...]
  local n=$1 s=$2 w=$3 d=$4 b=$5; shift 5
  rm -rf /tmp/c_$n; mkdir -p /tmp/c_$n
  env TORCHINDUCTOR_CACHE_DIR=/tmp/c_$n/ind TRITON_CACHE_DIR=/tmp/c_$n/tri "$@" python3 $R/benchmarks/lab/compile_cache.py \
    --side $s --workload $w --dtype $d --batch $b --profile /tmp/p/$n.prof > /tmp/p/$n.log 2>&1
  echo "== $n: $(grep -o '"compile_s": [0-9.]*' /tmp/p/$n.log) $(grep -o '"precompile": {[^}]*}' /tmp/p/$n.log)"
}
cd /tmp
one llc converted llama13b_2l_4k bf16 1
one lln native llama13b_2l_4k bf16 1
one llc0 converted llama13b_2l_4k bf16 1 ELSA_PRECOMPILE=0
one vic converted vit_b16 fp32 8
one vin native vit_b16 fp32 8
one vio converted vit_b16 fp32 8 ELSA_COMPILE_OP=opaque
tar czf $OUT/prof.tgz -C /tmp/p .
