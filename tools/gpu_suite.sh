#!/usr/bin/env bash
# The GPU measurements and GPU tests behind docs/PERF.md, as run on the device machine (H100). Each part
# fits one 10-minute call. Usage (from the repository root): bash tools/gpu_suite.sh PART [OUTDIR]
#   PART: tests | tests-kernels | tests-tiles | tests-rest | tests-training | models | llama | vision | train-vision |
#   train-llama | compile | eager-host | host-profiles | bwd-sweep | bwd-split | head-groups | bwd-questions | fuzz |
#   s32m-fuzz | tests-stream | stream-ranks | stream-scaling | stream-32m | long-rows | mask-tiles | compile-inline |
#   races | lowp-bwd | lowp-short | lowp-d128 | lowp-auto | decode-merge | strict-dq | pending | compile-time |
#   compile-time-2 | compile-autotune | generate-eager | grad-fuzz | decode-core | exec (then: OUTDIR COMMAND...,
#   run with the package mapped).
#   A device call brings back at most 8 files from $OUT: write the part's OUTDIR elsewhere and tar it into $OUT
#   (session 31 lost half of a 4-GPU call's logs to that limit).
#   tests = tests-kernels (tests/test_kernels_gpu.py but its tile-configuration tests), tests-tiles (those) and
#   tests-rest (every other GPU test): each part fits one call, the whole suite does not (session 16:
#   tests/test_kernels_gpu.py alone ran past 560 s on a cold machine). train-*: bench_models.py --train (issue 25's
#   training-step targets), split in two so that each fits a call. compile: bench_models.py --compile default on
#   ViT-B/16 and Swin-T (issue 33; other modes and workloads through exec). fuzz: tools/gpu_fuzz.sh (issue 30).
#   train-*, compile and fuzz were written without a GPU run (session 24): their timings are estimates.
# Works from a plain checkout: the package is mapped onto PYTHONPATH (kernels/ -> elsa_surgery.kernels,
# adapters/ -> elsa_surgery.adapters) when it is not installed. open_clip wheels, if carried in .whl/,
# are installed into /tmp/site first.
set -uo pipefail
part=${1:?part: tests|models|llama|vision}
out=${2:-${OUT:-/tmp/elsa_out}}
shift $(( $# >= 2 ? 2 : $# ))
repo=$(pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import elsa_surgery.kernels" 2>/dev/null; then
  pp=/tmp/elsa_pp/elsa_surgery
  rm -rf /tmp/elsa_pp && mkdir -p "$pp"
  ln -s "$repo"/elsa_surgery/*.py "$pp"/
  for sub in "$repo"/elsa_surgery/*/; do  # subpackages (elsa_surgery/stream/)
    [ -f "$sub/__init__.py" ] && ln -s "${sub%/}" "$pp/$(basename "$sub")"
  done
  ln -s "$repo/kernels" "$pp/kernels"
  ln -s "$repo/adapters" "$pp/adapters"
  export PYTHONPATH=/tmp/elsa_pp:$repo${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu_$part.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu_$part.txt"
gpu_tests() {  # $1: log name, then pytest selection; run from outside the checkout so that the repo's unmapped
  # elsa_surgery/ is not imported first. TESTS_TIMEOUT: seconds (default 560; less where a part runs more after it)
  local log=$1; shift
  (cd /tmp && timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider \
     -c "$repo/pyproject.toml" --rootdir "$repo" --tb=short "$@" 2>&1 | tee "$out/$log" | tail -60)
}
decode_merge_checks() {  # sessions 65-66's fused merge: its tests on the compiled kernels (the CPU ones on CUDA too)
  # and the decode GPU tests ($2: seconds), then host and eager time fused against the merge kernel at the shapes $1
  # (decode_host.py --ab-env; $3: seconds)
  (cd /tmp && timeout "$2" python3 -m pytest -q -p no:cacheprovider -c "$repo/pyproject.toml" --rootdir "$repo" \
     --tb=short "$repo/tests/test_decode.py" -k "fused or row_merge or family_on_the_gpu or scratch" 2>&1 \
     | tee "$out/pytest_decode_merge.log" | tail -30)
  timeout "$3" python3 benchmarks/lab/decode_host.py --ab-env ELSA_DECODE_MERGE=kernel --profile 0 \
    --shapes "$1" 2>&1 | tee "$out/decode_host_merge.log" | grep -v Warn
}
strict_dq() {  # session 65: auto's routing of strict calls to atomic dQ (the GPU test; $3: its seconds), then fp32
  # strict's backward with dQ by the row pass (deterministic) against atomic adds from the key-block pass, forward +
  # backward against ME-SDPA at the lengths $1, D = 64 / 128, causal and not ($2: seconds a run)
  TESTS_TIMEOUT=$3 gpu_tests pytest_strict_dq.log "$repo/tests/test_backward.py" -k strict_dq_atomically
  for dq in rows atomic; do
    ELSA_BWD_DQ=$dq timeout "$2" python3 recipes/bench_attention.py --backward --dtypes fp32-strict --n "$1" \
      --shapes 16x64,16x128 --baselines efficient --batch 1 2>&1 | tee "$out/strict_bwd_$dq.log" | grep -v '^ ' \
      | cut -c1-260
  done
}
case "$part" in
  tests-kernels) gpu_tests pytest_gpu_kernels.log "$repo/tests/test_kernels_gpu.py" -k "not every_tile_config" ;;
  tests-tiles) gpu_tests pytest_gpu_tiles.log "$repo/tests/test_kernels_gpu.py" -k "every_tile_config" ;;
  tests-training)  # issue 25: every test of the backward, dropout and training-surgery files on the compiled kernels
    # (their CPU tests run on CUDA here: kernel_env.DEV), not only the gpu-marked, in parallel shards (args: shards
    # [4]); one process ran 59 of the 113 tests in 560 s on a cold H200 (session 29: Triton's compiles dominate)
    shards=${1:-4}; files=("$repo/tests/test_backward.py" "$repo/tests/test_dropout.py"
    "$repo/tests/test_varlen_dropout.py" "$repo/tests/test_train_surgery.py")
    (cd /tmp && python3 -m pytest -q --collect-only -p no:cacheprovider -c "$repo/pyproject.toml" --rootdir "$repo" \
       "${files[@]}" 2>/dev/null | grep '::' > "$out/training_ids.txt")
    for i in $(seq 0 $((shards - 1))); do
      awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/training_ids.txt" > "$out/training_ids_$i.txt"
      (cd /tmp && timeout 560 python3 -m pytest -v -p no:cacheprovider -c "$repo/pyproject.toml" --rootdir "$repo" \
         --tb=short -rf $(sed "s|^tests/|$repo/tests/|" "$out/training_ids_$i.txt") \
         > "$out/pytest_gpu_training_$i.log" 2>&1) &
    done
    wait
    tail -n 3 "$out"/pytest_gpu_training_*.log; grep -h '^FAILED' "$out"/pytest_gpu_training_*.log ;;
  mask-tiles)  # session 33: the mask's tile ranges on the GPU (every test of tests/test_mask_tiles.py on CUDA, the
    # backward's included: ELSA_MASK_TILES=all waits for them), then masked calls timed forward and forward + backward
    (cd /tmp && timeout 300 python3 -m pytest -q -p no:cacheprovider -c "$repo/pyproject.toml" --rootdir "$repo" \
       "$repo/tests/test_mask_tiles.py" 2>&1 | tee "$out/pytest_mask_tiles.log" | tail -15)
    timeout 120 python3 benchmarks/lab/masked_tiles.py --n 4096 --shape 1x16x128 --dtypes bf16,fp32 2>&1 \
      | tee "$out/masked_tiles_fwd.log" | grep -v '^ '
    timeout 120 python3 benchmarks/lab/masked_tiles.py --backward --n 4096 --shape 1x16x128 --dtypes bf16 \
      --masks causal,packed,random --rounds 3 --calls 5 2>&1 | tee "$out/masked_tiles_bwd.log" | grep -v '^ ' ;;
  lowp-bwd)  # sessions 59-62: the fp16/bf16 Gluon backward (ELSA_BWD_DQ=gluon) against float64, cuDNN and the row
    # pass, in the forms plain, ws and ws2 (ELSA_BWD_LOWP; overlap gained nothing in session 61), the kernel alone at
    # 128 x 64 tiles (ws2 takes no other) and through the public call, which picks each form's own tiles
    # (benchmarks/lab/lowp_bwd.py; session 61, H100: ~100 s a run), then its GPU test
    timeout 200 python3 benchmarks/lab/lowp_bwd.py --forms plain,ws,ws2 --tiles '128,64,2,8' 2>&1 \
      | tee "$out/lowp_bwd.log"
    TESTS_TIMEOUT=150 gpu_tests pytest_lowp_bwd.log "$repo/tests/test_backward.py" -k "lowp or dq_auto" ;;
  lowp-short)  # session 63 (first run in session 64): ws2 where auto's bounds had been set from ws's numbers alone
    # (N >= 4K, D <= 64): ws, ws2 and the row pass (auto's choice below 4K) at 1K (B = 16) and 2K (B = 4) query rows,
    # D = 32 and 64, through the public call and alone, against cuDNN (benchmarks/lab/lowp_bwd.py)
    for nb in "1024 16" "2048 4"; do set -- $nb
      timeout 170 python3 benchmarks/lab/lowp_bwd.py --forms ws,ws2 --tiles 128,64,2,8 --shapes 16x32,16x64 \
        --n "$1" --batch "$2" --skip-check 2>&1 | tee "$out/lowp_short_$1.log" | grep -v '^ '
    done ;;
  lowp-d128)  # sessions 62-63, measured and merged in session 64: ws2 at D = 128 (32 query rows a tile, dQ^T =
    # K^T.dS^T) against float64, the row pass, ws (which at D = 128 now also computes dQ^T) and cuDNN: the kernel
    # alone at 2-4 stages and two register splits, the public ws and ws2, at 4K (with the exactness check) and 16K;
    # then the backward's GPU tests (the form test's D = 128 case runs ws2 there). One call, ~450 s estimated.
    timeout 230 python3 benchmarks/lab/lowp_bwd.py --forms ws2 --public-forms ws,ws2 --shapes 16x128 \
      --tiles '128,32,2,8;128,32,3,8;128,32,4,8' --wide-regs '216,80;224,64' 2>&1 | tee "$out/lowp_d128_4k.log" \
      | cut -c1-600
    timeout 120 python3 benchmarks/lab/lowp_bwd.py --forms ws2 --public-forms ws,ws2 --shapes 16x128 --n 16384 \
      --tiles '128,32,2,8;128,32,3,8' --skip-check 2>&1 | tee "$out/lowp_d128_16k.log"
    TESTS_TIMEOUT=150 gpu_tests pytest_lowp_d128.log "$repo/tests/test_backward.py" -k "lowp or dq_auto" ;;
  lowp-auto)  # session 64 (written without a GPU run of it): ELSA_BWD_DQ=auto with ws2's bounds
    # (backward_launch.AUTO_GLUON_MIN_N: ws2 at D <= 64 from 1K rows, causal 256; D = 128 from 1K, causal 2K): the
    # routing test, then forward + backward through auto against cuDNN at D = 64 and 128, 1K to 16K; ~300 s
    TESTS_TIMEOUT=150 gpu_tests pytest_lowp_auto.log "$repo/tests/test_backward.py" -k "lowp or dq_auto"
    timeout 300 python3 recipes/bench_attention.py --backward --dtypes bf16 --n 1024,4096,16384 \
      --shapes 16x64,16x128 --baselines flash,cudnn --batch 1 2>&1 | tee "$out/bwd_auto.log" | grep -v '^ ' ;;
  decode-merge)  # session 65: a packed decode call's phase 2 fused into its launch (ELSA_DECODE_MERGE=fused, the
    # default): decode_merge_checks, then session 62's one-query decode grid
    decode_merge_checks 16x32x8x64x4096,16x32x8x128x4096,1x32x8x128x4096,1x28x4x128x4097 200 150
    timeout 230 python3 recipes/bench_attention.py --decode --dtypes bf16 --shapes 32x128,32x64 --gqa 32:4,32:8 \
      --queries 1 --keys 4096,32768 --batch 1,16 2>&1 | tee "$out/decode_grid.log" | grep DECODE | cut -c1-330 ;;
  pending)  # session 66 (no machine came): what sessions 65-66 landed without a GPU run, in one call (<= 480 s): the
    # fused merge with its states in the stream's buffers (829dead) and one scratch lookup a replay (eb366e2), without
    # the decode grid; strict_dq at 2K and 4K (auto's bound, AUTO_STRICT_ATOMIC_MIN_N)
    decode_merge_checks 16x32x8x64x4096,16x32x8x128x4096,1x32x8x128x4096 150 80
    strict_dq 2048,4096 80 90 ;;
  strict-dq)  # session 65: strict_dq from 1K to 8K
    strict_dq 1024,2048,4096,8192 280 120 ;;
  races)  # session 35: auto's races on the GPU, landed without a GPU run: every test of tests/test_autoselect.py on
    # CUDA (key lengths raced, an SDPA side out of memory keeps ELSA, decode steps sharing a race), BERT-base with
    # padding at batch 32 (its key lengths now raced), Qwen2 fp32 32K generate (its race ran out of memory)
    (cd /tmp && timeout 200 python3 -m pytest -q -p no:cacheprovider -c "$repo/pyproject.toml" --rootdir "$repo" \
       "$repo/tests/test_autoselect.py" 2>&1 | tee "$out/pytest_autoselect.log" | tail -5)
    timeout 120 python3 recipes/bench_models.py --eager --workloads bert_base_128,bert_base_512 --dtypes fp32,bf16 \
      --batches 32 --rounds 3 --calls 5 2>&1 | tee "$out/bert_b32.log" | grep -v '^ '
    timeout 150 python3 recipes/llama_long_context.py --generate --shape qwen2-7b --layers 2 --dtype fp32 \
      --seq-lens 32768 --cache dynamic --iters 2 2>&1 | tee "$out/generate_qwen2_fp32_32k.log" | grep -v '^ ' \
      | cut -c1-300 ;;
  generate-eager)  # session 57: the generate cells with every decode step eager (transformers compiles a static
    # cache's decode steps itself on CUDA: --cache static-eager turns that off), LLaMA-13B- and Qwen2-7B-shaped, 2
    # layers, bf16, 4K (args: lengths [4096], dtype [bf16]); about 1.5 minutes a model at 4K on an H200
    for shape in 13b qwen2-7b; do
      timeout 250 python3 recipes/llama_long_context.py --generate --shape $shape --layers 2 --dtype "${2:-bf16}" \
        --seq-lens "${1:-4096}" --cache dynamic,static-eager --iters 5 2>&1 | tee "$out/generate_eager_$shape.log" \
        | grep -v '^ ' | cut -c1-300
    done ;;
  compile-inline)  # session 34: the inline op (ELSA_COMPILE_OP=inline) on the GPU, then compiled Swin-T inline vs
    # opaque in one call (the ops' host cost decides host-bound compiled models)
    gpu_tests pytest_gpu_inline.log "$repo/tests/test_compile.py" -k "inline"
    for op in inline opaque; do
      ELSA_COMPILE_OP=$op timeout 170 python3 recipes/bench_models.py --compile default --workloads swin_t \
        --dtypes fp32,bf16 --batches 8 --rounds 3 --calls 5 --out "$out/compile_swin_$op.json" 2>&1 \
        | tee "$out/compile_swin_$op.log" | grep -v '^ '
    done ;;
  tests-rest) gpu_tests pytest_gpu_rest.log "$repo/tests" --ignore "$repo/tests/test_kernels_gpu.py" \
    -k "not test_fuzz_every_backend_gpu" ;;  # (the 10,000-case fuzz is the fuzz part's)
  tests)
    gpu_tests pytest_gpu_kernels.log "$repo/tests/test_kernels_gpu.py" -k "not every_tile_config"
    gpu_tests pytest_gpu_tiles.log "$repo/tests/test_kernels_gpu.py" -k "every_tile_config"
    gpu_tests pytest_gpu_rest.log "$repo/tests" --ignore "$repo/tests/test_kernels_gpu.py" \
      -k "not test_fuzz_every_backend_gpu" ;;
  models)
    timeout 560 python3 recipes/bench_models.py --models vit_b16,vit_l14_clip,swin_t --dtypes fp32,bf16 \
      --modes cudagraph --iters 10 --no-verify --out "$out/models.json" 2>&1 | tee "$out/models.log" | tail -60 ;;
  llama)
    timeout 560 python3 recipes/llama_long_context.py --seq-lens 4096,8192,16384,32768,65536 \
      --json "$out/llama.json" 2>&1 | tee "$out/llama.log" | tail -40 ;;
  vision)
    timeout 300 python3 recipes/vggt_eval.py --frames 8,32,64,100,150 --dtypes fp32,bf16 --out "$out/vggt.json" \
      2>&1 | tee "$out/vggt.log" | tail -30
    timeout 120 python3 recipes/hsimae_bench.py --out "$out/hsimae.json" 2>&1 | tee "$out/hsimae.log" | tail -20
    timeout 150 python3 recipes/clip_eval.py --model ViT-L-14 --out "$out/clip.json" 2>&1 | tee "$out/clip.log" | tail -30 ;;
  train-vision)
    timeout 560 python3 recipes/bench_models.py --train --workloads vit_b16,swin_t,vit_l14_clip_336 \
      --dtypes fp32,bf16-autocast --batches 8 --rounds 3 --calls 5 --out "$out/train_vision.json" 2>&1 \
      | tee "$out/train_vision.log" | tail -30 ;;
  train-llama)
    timeout 560 python3 recipes/bench_models.py --train --workloads llama13b_2l_4k,llama13b_2l_16k \
      --dtypes fp32,bf16-autocast --rounds 3 --calls 3 --out "$out/train_llama.json" 2>&1 \
      | tee "$out/train_llama.log" | tail -30 ;;
  bwd-sweep)  # issue 25: the backward's tiles (BLOCK_M, BLOCK_N, warps, stages) x dQ by atomics or the row pass x
    # bwd_kv rows- or keys-major, against flash/cuDNN's backward, N=4K causal (args: dtype [bf16], HxD [16x64],
    # causal head groups [auto; 'auto,1' for session 29's heaviest-first A/B], space, the row pass's tile [same;
    # 'same,swapped': transposed, session 29's second question]);
    # 48 configurations, < 8 min on an H100 (session 28, bf16 16x64; D = 64 defaults taken from it). The space
    # holds the tiles that ptxas compiles without spills (benchmarks/lab/bwd_spills.py, session 27). Gradients vs
    # float64 (a configuration 1.5x worse than the worst baseline is WRONG; session 28 saw 32x128 rows-major with dQ
    # by rows 5e-3 from the others: this tells which side is wrong)
    timeout 560 python3 recipes/bench_attention.py --backward --sweep --dtypes "${1:-bf16}" --n 4096 \
      --shapes "${2:-16x64}" --causal 1 --space "${4:-bm=32,64;bn=32,64,128;w=4,8;s=2}" --baselines flash,cudnn \
      --bwd-head-groups "${3:-auto}" --bwd-row-tiles "${5:-same}" \
      2>&1 | tee "$out/bwd_sweep.log" | grep -E "BEST|baseline|WRONG" ;;
  bwd-split)  # issue 25's fp32 cells left by session 44's split backward (precise D = 128 non-causal 1.97x ME-SDPA,
    # turbo D = 64 causal 3.76x): the split's tiles swept with more stages and wider key blocks, then forward +
    # backward by the rule against ME-SDPA; the sweeps ran 71-145 s each on an H200 (session 45), ~8 min in all
    for cell in "fp32-precise 16x128 0" "fp32-turbo 16x64 1" "fp32-turbo 16x128 0"; do
      set -- $cell
      ELSA_BWD_SPLIT=f16 timeout 170 python3 recipes/bench_attention.py --backward --sweep --dtypes "$1" --n 4096 \
        --shapes "$2" --causal "$3" --space 'bm=32,64,128;bn=64,128;w=4;s=2,3' --baselines efficient 2>&1 \
        | tee "$out/bwd_split_sweep_${1}_${2}_$3.log" | grep -E "BEST|baseline|WRONG"
    done
    timeout 100 python3 recipes/bench_attention.py --backward --no-varlen --dtypes fp32-precise,fp32-turbo \
      --n 4096 --shapes 16x64,16x128 --causal 0,1 --baselines efficient 2>&1 | tee "$out/bwd_split.log" | grep '^{' ;;
  head-groups)  # causal launches' head groups evened out against the groups before (session 45; ~90 s on an
    # H200): forward and forward + backward A/B in one process, fp32 precise/turbo and bf16
    timeout 300 python3 benchmarks/lab/head_groups.py --rounds 3 2>&1 | grep -v -i warn | tee "$out/head_groups.log" ;;
  bwd-questions)  # session 29's two open backward questions in one call (args: HxD [16x64]; ~7 min, untimed
    # estimate): the per-kernel profile of forward + backward, causal and not, then the sweep of the causal
    # backward with the head-group order (auto vs 1: heaviest first over groups of heads vs one head after another)
    # and the row pass's tile (same vs transposed), ranked by the kernels' own GPU time
    timeout 120 python3 benchmarks/lab/bwd_profile.py --shape "${1:-16x64}" 2>&1 | grep -v Warning \
      | tee "$out/bwd_profile_${1:-16x64}.log"
    timeout 450 python3 recipes/bench_attention.py --backward --sweep --dtypes bf16 --n 4096 --shapes "${1:-16x64}" \
      --causal 1 --space 'bm=32,64;bn=64,128;w=4;s=2' --baselines flash,cudnn --bwd-head-groups auto,1 \
      --bwd-row-tiles same,swapped 2>&1 | tee "$out/bwd_questions_${1:-16x64}.log" | grep -E "BEST|baseline|WRONG"
    # Triton's tutorial backward: 32x128 for dK/dV (keys-major), 128x32 for dQ, 4 warps, 5 stages: the stages
    timeout 150 python3 recipes/bench_attention.py --backward --sweep --dtypes bf16 --n 4096 --shapes "${1:-16x64}" \
      --causal 1 --space 'bm=32;bn=128;w=4;s=3,4,5' --baselines flash --bwd-row-tiles swapped 2>&1 \
      | tee "$out/bwd_stages_${1:-16x64}.log" | grep -E "BEST|WRONG" ;;
  eager-host)  # issue 24: the public call's host cost against SDPA's (session 30 cut its routing on the CPU host),
    # then the host-bound small models where auto's SDPA choice still lost (DeiT3-S fp32 0.87x, session 23); ~4 min,
    # untimed estimate
    timeout 200 python3 recipes/profile_host_cost.py 2>&1 | tee "$out/host_cost.log" | tail -25
    timeout 340 python3 recipes/bench_models.py --eager --workloads deit3_s,vit_b16,bert_base_128 --dtypes fp32,bf16 \
      --batches 8 --rounds 3 --calls 5 --out "$out/eager_small.json" 2>&1 | tee "$out/eager_small.log" | tail -20 ;;
  host-profiles)  # issues 24/25/33: where host time goes (session 31): one training call's forward + backward
    # against SDPA's (benchmarks/lab/bwd_host.py), then the compiled ViT-B/16, its training step and BERT with padding
    # under cProfile, with dynamo's graph-break counters (benchmarks/lab/host_profile.py); ~3 min, run alone on the
    # host (host-bound timings move with other jobs)
    timeout 150 python3 benchmarks/lab/bwd_host.py --profile 30 2>&1 | tee "$out/bwd_host.log" | grep -v "^ "
    timeout 400 python3 benchmarks/lab/host_profile.py 2>&1 | tee "$out/host_profile.log" \
      | grep -E "^(GPU|dynamo|compiled|  host|converted step|train|bert)" ;;
  compile-time|compile-time-2)  # issue 33's compile-time target (<= 1.2x native) for every cell of the issue's table
    # and LLaMA 4K prefill (compile_cache.py --side both: each side in processes of its own on caches of its own; COLD
    # cold processes a side (default 2, fresh caches each), WARM warm ones (default 0)), in two parts of ~8 min on an
    # H200 (LLaMA and CLIP: ~45 s a process); NO_EAGER=1: no eager call first (compile_cache.py --no-eager).
    # Args (optional): cells WORKLOAD:DTYPE:BATCH replacing the part's own
    if [ "$part" = compile-time ]; then cells=(llama13b_2l_4k:fp32:1 vit_l14_clip_336:fp32:8 vit_b16:bf16:8)
    else cells=(llama13b_2l_4k:bf16:1 vit_b16:fp32:8 swin_t:fp32:8 deit3_s:bf16:64); fi
    [ $# -gt 0 ] && cells=("$@")
    for c in "${cells[@]}"; do
      IFS=: read -r w dt b <<< "$c"
      timeout 250 python3 benchmarks/lab/compile_cache.py --side both --cold "${COLD:-2}" --warm "${WARM:-0}" \
        --workload "$w" --dtype "$dt" --batch "$b" ${NO_EAGER:+--no-eager} 2>&1 | grep -E '^(GPU|====|\{|summary)' \
        | tee "$out/compile_time_${w}_${dt}.log" | grep -E '^(====|summary)'
    done ;;
  compile-autotune)  # issue 33 under max-autotune: VGGT-shaped 100 frames fp32, then CLIP-L/14-336 fp32 b8 (auto:
    # their long calls on the opaque op inside CUDA graphs). fp32 GEMMs autotune in 30-50 s a shape (session 52), so
    # Inductor's cache goes back as $out/ind.tgz: carry it as .ind/ind.tgz (run's carry) to go on where a call stopped
    mkdir -p /tmp/ind && { [ -f .ind/ind.tgz ] && tar xzf .ind/ind.tgz -C /tmp/ind; true; }
    for w in vggt_100f:1 vit_l14_clip_336:8; do
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind timeout 250 python3 recipes/bench_models.py --compile max-autotune \
        --workloads "${w%%:*}" --dtypes fp32 --batches "${w##*:}" --rounds 5 --calls 5 \
        --out "$out/autotune_${w%%:*}.json" \
        2>&1 | tee "$out/autotune_${w%%:*}.log" | grep -v '^ '
    done
    tar czf "$out/ind.tgz" -C /tmp/ind . ;;
  compile)
    timeout 560 python3 recipes/bench_models.py --compile default --workloads vit_b16,swin_t --dtypes fp32,bf16 \
      --batches 8 --rounds 3 --calls 5 --profile --out "$out/compile.json" 2>&1 | tee "$out/compile.log" | tail -30 ;;
  tests-stream)  # the stream GPU tests alone (the NCCL pair needs >= 2 GPUs), ~1 min; and the GPU fuzz's
    # regression case
    gpu_tests pytest_gpu_stream.log "$repo/tests/test_stream_gpu.py" \
      "$repo/tests/test_sdpa_fidelity.py::test_found_sdpa_backend_min_mask_on_cuda_case" ;;
  stream-ranks)  # issue 31, on a machine with >= 2 GPUs: stream GPU tests (NCCL pair, backward included), then the
    # kill drill at 1M tokens (the rerun must resume and match one GPU bit for bit); ~3 min
    gpu_tests pytest_gpu_stream.log "$repo/tests/test_stream_gpu.py"
    timeout 300 python3 recipes/stream_bench.py --mode drill --ranks 2 --n 1M --budget 1GiB --timeout 120 \
      --data-dir /tmp/stream_drill --no-progress 2>&1 | tee "$out/stream_drill.log" | grep '^{' | tail -3
    # issue 29's 8M target on this GPU kind: the in-core kernel on the 8M plan's 1M tile (~20 s), to set beside
    # stream-scaling's one-GPU stream TFLOP/s
    timeout 120 python3 recipes/stream_bench.py --mode incore --tile 1M 2>&1 | tee "$out/stream_incore.log" \
      | grep '^{' ;;
  stream-scaling)  # issue 31: one GPU then 2 ranks, same call (args: tokens [8M], budget [8GiB]); 8M ~7.5 min on
    # 2x H200; the in-core and spot-row checks are issue 29's target mode (add them back with the target part)
    n=${1:-8M}; b=${2:-8GiB}
    timeout 585 python3 recipes/stream_bench.py --mode scaling --ranks 2 --n "$n" --budget "$b" --no-in-core \
      --no-spot --no-progress --data-dir /tmp/stream_scaling 2>&1 | tee "$out/stream_scaling_$n.log" \
      | grep '^{' | tail -4 ;;
  stream-32m)  # issue 29: 32M tokens, H=1, memory-mapped on disk, one resumable slice a call (rerun until
    # "finished": true); the files stay in /tmp/s32m only while the machine is held. The slice stops starting tasks
    # after 330 s: the first call draws the 16 GiB of inputs first (~2 min) and a task takes up to ~1 min (session
    # 27: with 420 s the first slice ran past the timeout; its checkpoint was resumed by the next call)
    timeout 590 python3 recipes/stream_bench.py --mode slices --n 32M --heads 1 --slice-seconds 330 \
      --checkpoint-every 120 --data-dir /tmp/s32m --no-progress 2>&1 | tee "$out/stream_32m.log" | grep '^{' ;;
  s32m-fuzz)  # on a 2-GPU machine: issue 29's 32M slice on GPU 0 beside the fuzz on GPU 1 (args: first seed [25]);
    # ~9.5 min; rerun stream-32m (or this) until the slice prints "finished": true
    (CUDA_VISIBLE_DEVICES=0 timeout 590 python3 recipes/stream_bench.py --mode slices --n 32M --heads 1 \
      --slice-seconds 330 --checkpoint-every 120 --data-dir /tmp/s32m --no-progress > "$out/stream_32m.log" 2>&1) &
    FUZZ_GPUS=1 bash tools/gpu_fuzz.sh "$out/fuzz" 20 700 520 "${1:-25}" 2>&1 | tee "$out/fuzz.log" | tail -40
    wait
    grep '^{' "$out/stream_32m.log" ;;
  fuzz)  # (args: first seed [1]; processes = the host's cores - 8, at most 24) ~540 s; two calls (seeds 1, then 25)
    # make the 10,000 cases
    procs=$(( $(nproc) - 8 )); [ "$procs" -gt 24 ] && procs=24; [ "$procs" -lt 4 ] && procs=4
    bash tools/gpu_fuzz.sh "$out/fuzz" "$procs" 700 530 "${1:-1}" 2>&1 | tee "$out/fuzz.log" | tail -40 ;;
  grad-fuzz)  # session 67: the gradient fuzzer (tests/test_grad_fuzz.py, issue 25) on the compiled kernels through
    # tools/gpu_fuzz.sh (args: processes [8], cases a process [400], first seed [1]); session 68, H100: 10 processes
    # ran 2,226 cases in 360 s, stopped by the clock (about 0.6 case/s a process). GRAD_FUZZ_PATHS=strict,gluon,...
    # draws only those paths (tests/test_grad_fuzz.py's GPU_PATHS)
    FUZZ_TEST=tests/test_grad_fuzz.py::test_grad_fuzz_gpu bash tools/gpu_fuzz.sh "$out/grad_fuzz" "${1:-8}" \
      "${2:-400}" 500 "${3:-1}" 2>&1 | tee "$out/grad_fuzz.log" | tail -40 ;;
  decode-core)  # session 68 (the --decompose half written without a GPU run): the B = 16 decode cells' packed kernel
    # against a lab kernel of its core (benchmarks/lab/decode_tma.py: pointer and TMA loads, phase 2 untimed), and at
    # each partition count the product beside the core, to split what phase 2 and the general kernel cost; ~250 s
    timeout 400 python3 benchmarks/lab/decode_tma.py --shapes 16x32x8x64x4096,16x32x8x128x4096,16x32x4x64x32768 \
      --parts 1,2,3,4 --bn 64,128 --stages 2,3 --decompose 2>&1 | tee "$out/decode_core.log" ;;
  long-rows)  # issue 29's open question (session 27: the 32M stream's rows 1.05e-2 from float64, 8M's 2.6e-3): the
    # error of one call against float64 as its rows' keys grow from 1M to 16M, ELSA (tensor-core chain or blocked
    # P·V, ELSA_BLOCKED_PV_KEYS) beside SDPA's flash, cuDNN and efficient kernels; ~2 min (untimed estimate)
    timeout 500 python3 benchmarks/lab/long_row_accuracy.py --nk 1M,2M,4M,8M,16M --json "$out/long_rows.json" 2>&1 \
      | tee "$out/long_rows.log" | tail -8 ;;
  exec) "$@" 2>&1 | tee "$out/exec.log" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
