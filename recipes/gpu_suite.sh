#!/usr/bin/env bash
# Every GPU measurement and GPU test behind docs/PERF.md, in the order they were run on the device
# machine (each part fits one 10-minute call). Usage: bash recipes/gpu_suite.sh PART OUTDIR
#   PART: tests | models | llama | vision
set -uo pipefail
part=${1:?part: tests|models|llama|vision}
out=${2:-${OUT:-/tmp/elsa_out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
case "$part" in
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log" ;;
  models)
    python3 recipes/bench_models.py --models vit_b16,vit_l14_clip,swin_t --modes cudagraph --out "$out/models.json" 2>&1 | tee "$out/models.log" ;;
  llama)
    python3 recipes/llama_long_context.py --json "$out/llama.json" 2>&1 | tee "$out/llama.log" ;;
  vision)
    python3 recipes/vggt_eval.py --frames 8,32,64,100,150 --dtypes fp32,bf16 --out "$out/vggt.json" 2>&1 | tee "$out/vggt.log"
    python3 recipes/hsimae_bench.py --out "$out/hsimae.json" 2>&1 | tee "$out/hsimae.log"
    python3 recipes/clip_eval.py --model ViT-L-14 --out "$out/clip.json" 2>&1 | tee "$out/clip.log" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
