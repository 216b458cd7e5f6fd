"""Full-model forward latency and peak memory: native timm vs converted (ELSA), same process, same inputs.

Models (random weights, 1000-class head): timm ViT-B/16 and ViT-L/14 (CLIP) at 224/336/448/560 px,
Swin-T at 224/384 px (window 7 at 224, window 12 at 384 — 7 does not tile 384/4 = 96). Batch 8,
fp32 and bf16. Execution modes, each applied identically to the native and the converted model:

* ``eager``: plain ``model(x)`` under ``torch.inference_mode``.
* ``cudagraph``: the forward captured once in a CUDA graph and replayed (what a latency-bound
  inference service does); peak memory then includes the graph's private pool.
* ``compile``: ``torch.compile(model)`` (default mode). Slow to build: select few configurations.

Timing (``elsa_surgery.benchmark.measure``, as in every recipe): ``--warmup`` calls, then ``--iters`` calls
each timed with CUDA events, median. Peak memory: ``max_memory_allocated`` above what was allocated before
the mode's setup and first call (weights and the input excluded). The converted model is
checked against the native one on the benchmark inputs (relative max error) and its dispatch decisions are
recorded: any fallback is printed and stored, never hidden.

``--eager`` runs the never-slower suite instead: native and converted models held side by side in one process
and timed in interleaved rounds (A/B/A/B, ``benchmark.interleaved_ms``: host and GPU time per eager call, median
of the rounds), with PyTorch's default settings (IEEE fp32 matmuls; ``fp32-tf32`` turns TF32 on for both sides),
over timm (ViT-B/16, ViT-L/14 CLIP 336, DeiT3-S, EVA02-B, Swin-T, SwinV2-T), Hugging Face LLaMA-13B- and
Qwen2-7B-shaped 2-layer models (prefill), BERT-base with padding, the CLIP ViT-L/14 towers and a VGGT-shaped
aggregator at 100 frames (``vggt_100f``). Each cell prints
native ms, converted ms, their ratio (> 1: the converted model is faster), the attention share of the native
time (``torch.profiler``), the backends the converted calls ran, and the output difference; ``--out`` writes
JSON and ``--plot`` a PNG heat map of the ratios (matplotlib). ``--control`` times an A/A pair instead (both sides
the native model: the method's noise floor on the host at hand), ``--cpu-smoke`` checks the flow on the CPU.

``--compile MODES`` (``default``, ``max-autotune``, ``reduce-overhead``; a comma list) runs the same workloads under
``torch.compile`` (issue 33): the native model compiled against a deep copy converted with ``convert(verify=False)``
and then compiled (the converted one compiled first, so it never reuses kernels Inductor built for the native one,
``--native-first`` the other way round; a tiny function compiled before the first cell takes Inductor's start-up),
timed in interleaved rounds in one process. Whichever side compiles second reuses kernels the first left in
Inductor's and Triton's caches; ``--isolated-compile`` also times each side's first compiled call in processes of its
own with caches of its own, cold (fresh caches) and warm (a second process on them); ``--isolated-only`` times only
those.
Each row has the compile time of each side (the first call's wall time, synchronised), their ratio, ``auto``'s
trace-time choices (``compiled_decisions``), native ms / converted ms and the output difference; ``--control``
replaces the converted copy with an unconverted one (an A/A run: the ratio the method alone makes, e.g. in host-
bound cells); ``--processes N`` runs each cell in N processes of its own, alternating which side compiles first, and
reports their geometric mean (a host-bound compiled cell leans on that order by a few per cent); ``--profile`` adds
where one compiled call's device time goes on each side, by kind: ``elsa`` (the package's kernels), ``inductor``
(Inductor's fused ``triton_*`` kernels), ``copy`` (copies and transposes), ``sdpa``, ``gemm`` and ``other``, with the
largest kernels of each. ``--cpu-smoke`` checks the flow on the CPU with
one-block models.

``--train`` times training steps (issue 25): forward, a loss (the mean square of the output), backward and an
``AdamW`` step (gradients freed after each step), eager, the native model against a deep copy converted with
``convert(verify=False)``, in interleaved rounds in one process. Dtypes: ``fp32``, ``fp32-tf32``, ``bf16`` (the
model cast) and ``bf16-autocast`` (fp32 weights, bf16 autocast: mixed-precision training). Default workloads:
ViT-B/16, Swin-T, ViT-L/14 CLIP 336, LLaMA-13B-shaped 2 layers at 4K and 16K tokens; fp32 and bf16 autocast.
Each row has native and converted ms per step, their ratio (> 1: the converted step is faster), the peak memory of
one step on each side (MiB above the weights and optimizer state), the backends the converted forward ran, and the
first step's loss and gradient difference from native; ``--cpu-smoke`` runs one one-block model on the CPU
(reference backend): a check of the script, not a measurement.

Examples::

    python recipes/bench_models.py --out bench_models.json                      # everything, eager + cudagraph
    python recipes/bench_models.py --eager --workloads vit_b16,swin_t --dtypes fp32,bf16 --batches 1,8
    python recipes/bench_models.py --eager --list
    python recipes/bench_models.py --compile default,max-autotune --workloads vit_b16,swin_t --dtypes fp32,bf16 \
        --batches 8 --profile --out compiled.json
    python recipes/bench_models.py --compile default --cpu-smoke --profile     # a check of the flow on the CPU
    python recipes/bench_models.py --train --out train.json                    # the training-step suite
    python recipes/bench_models.py --train --workloads vit_b16 --dtypes fp32,bf16-autocast --batches 8,64
    python recipes/bench_models.py --train --cpu-smoke                          # a check of the flow on the CPU
    python recipes/bench_models.py --models vit_l14_clip --sizes 336 --dtypes fp32 --modes eager,cudagraph,compile
    python recipes/bench_models.py --models swin_t --dtypes bf16 --batch 16
    python recipes/bench_models.py --list
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from elsa_surgery import benchmark
from elsa_surgery.benchmark import DTYPES, comma_list

MODELS = {
    # name: (timm architecture, default sizes, extra kwargs per size)
    "vit_b16": ("vit_base_patch16_224", (224, 336, 448, 560), {}),
    "vit_l14_clip": ("vit_large_patch14_clip_224", (224, 336, 448, 560), {}),
    "swin_t": ("swin_tiny_patch4_window7_224", (224, 384), {384: {"window_size": 12}}),
}
MODES = ("eager", "cudagraph", "compile")


# --eager: workload -> (family, what, default batches); the builders are in ab_build
WORKLOADS = {
    "vit_b16": ("timm", "vit_base_patch16_224", (1, 8, 64)),
    "vit_l14_clip_336": ("timm", "vit_large_patch14_clip_336", (1, 8)),
    "deit3_s": ("timm", "deit3_small_patch16_224", (1, 8, 64)),
    "eva02_b": ("timm", "eva02_base_patch14_224", (1, 8)),
    "swin_t": ("timm", "swin_tiny_patch4_window7_224", (1, 8, 64)),
    "swinv2_t": ("timm", "swinv2_tiny_window8_256", (1, 8)),
    "llama13b_2l_512": ("llama13b", 512, (1,)),
    "llama13b_2l_4k": ("llama13b", 4096, (1,)),
    "llama13b_2l_16k": ("llama13b", 16384, (1,)),
    "llama13b_2l_32k": ("llama13b", 32768, (1,)),
    "qwen2_7b_2l_512": ("qwen2_7b", 512, (1,)),
    "qwen2_7b_2l_4k": ("qwen2_7b", 4096, (1,)),
    "qwen2_7b_2l_32k": ("qwen2_7b", 32768, (1,)),
    "bert_base_128": ("bert", 128, (32,)),
    "bert_base_512": ("bert", 512, (32,)),
    "clip_l14_text": ("clip_text", 77, (1, 8, 64)),
    "clip_l14_vision": ("clip_vision", 224, (1, 8)),
    # VGGT-shaped aggregator (tests/models/vggt_like.py, VGGT-1B's dim 1024 and 16 heads of 64) at 100 frames of
    # 392x518 px (1041 tokens each: global attention over 104,100 tokens), one frame and one global block (the ratio
    # of the 24 block pairs, at a fraction of the time)
    "vggt_100f": ("vggt", 100, (1,)),
}
AB_DTYPES = {"fp32": (torch.float32, False), "fp32-tf32": (torch.float32, True), "bf16": (torch.bfloat16, False),
             "fp16": (torch.float16, False)}
HF_SHAPES = {  # 2-layer models of these shapes (random weights, no LM head)
    "llama13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                     vocab_size=32000),
    "qwen2_7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=32000),
}


# --train: dtype -> (model dtype, TF32 matmuls, autocast dtype or None); default workloads -> batches
TRAIN_DTYPES = {"fp32": (torch.float32, False, None), "fp32-tf32": (torch.float32, True, None),
                "bf16": (torch.bfloat16, False, None), "bf16-autocast": (torch.float32, False, torch.bfloat16)}
TRAIN_WORKLOADS = {"vit_b16": (8, 64), "swin_t": (8, 64), "vit_l14_clip_336": (8,), "llama13b_2l_4k": (1,),
                   "llama13b_2l_16k": (1,)}
TRAIN_SMOKE_WORKLOAD = "deit3_s"


# --cpu-smoke with --compile: the workloads it can shrink (a check of the script on the CPU, not a measurement)
SMOKE_TIMM = dict(depth=1, img_size=32)  # ViT-style timm models: one block, 32 px
SMOKE_HF = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
SMOKE_WORKLOADS = ("vit_b16", "deit3_s", "llama13b_2l_512", "qwen2_7b_2l_512")


def ab_build(name, dtype, batch, device, smoke=False):
    """``(model, call)``: the model (random weights, eval) and a zero-argument forward on fixed random inputs;
    ``smoke``: a one-block model of the workload's family on short inputs (``SMOKE_WORKLOADS``)."""
    family, what, _ = WORKLOADS[name]
    if smoke and name not in SMOKE_WORKLOADS:
        raise ValueError(f"--cpu-smoke runs the workloads {', '.join(SMOKE_WORKLOADS)}, not {name}")
    g = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    if family == "timm":
        import timm

        model = timm.create_model(what, pretrained=False, device=device, **(SMOKE_TIMM if smoke else {}))
        model = model.eval().to(device, dtype)
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1] if not smoke else SMOKE_TIMM["img_size"]
        x = torch.randn(batch, 3, size, size, device=device, dtype=dtype, generator=g)

        def call(m):
            return m(x)

        call.example = x  # (benchmarks/lab/compile_gap.py checks the compiled frame's guards on it)
        return model, call
    if family in HF_SHAPES:
        import transformers

        cls_cfg = transformers.LlamaConfig if family == "llama13b" else transformers.Qwen2Config
        cls_model = transformers.LlamaModel if family == "llama13b" else transformers.Qwen2Model
        what = 16 if smoke else what
        cfg = cls_cfg(num_hidden_layers=1 if smoke else 2, max_position_embeddings=what + 1,
                      attn_implementation="sdpa", **(SMOKE_HF if smoke else HF_SHAPES[family]))
        with torch.device(device):
            model = cls_model(cfg).to(dtype).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, what), device=device, generator=g)
        return model, lambda m: m(input_ids=ids, use_cache=False).last_hidden_state
    if family == "vggt":
        import elsa_surgery
        from elsa_surgery.adapters.vggt import VGGTAttention

        root = str(Path(__file__).resolve().parents[1])  # tests/models/vggt_like.py, as recipes/vggt_eval.py
        if root not in sys.path:
            sys.path.insert(0, root)
        from tests.models import vggt_like

        model = vggt_like.Aggregator(dim=1024, depth=1, num_heads=16).to(device, dtype).eval()
        if "test.vggt_like" not in elsa_surgery.list_adapters():
            elsa_surgery.register_adapter(VGGTAttention(name="test.vggt_like", classes=(vggt_like.Attention,)))
        images = torch.rand(1, what, 3, 392, 518, device=device, dtype=dtype, generator=g)
        return model, lambda m: m(images)[-1]
    if family == "bert":
        import transformers

        cfg = transformers.BertConfig(attn_implementation="sdpa")  # BERT-base
        with torch.device(device):
            model = transformers.BertModel(cfg).to(dtype).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, what), device=device, generator=g)
        lengths = torch.randint(what // 4, what + 1, (batch,), device=device, generator=g)
        am = (torch.arange(what, device=device)[None] < lengths[:, None]).long()  # right padding
        return model, lambda m: m(input_ids=ids, attention_mask=am).last_hidden_state
    import transformers

    if family == "clip_text":
        cfg = transformers.CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                          num_hidden_layers=12, attn_implementation="sdpa")
        with torch.device(device):
            model = transformers.CLIPTextModel(cfg).to(dtype).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, what), device=device, generator=g)
        return model, lambda m: m(input_ids=ids).last_hidden_state
    cfg = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                        num_hidden_layers=24, patch_size=14, image_size=what, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.CLIPVisionModel(cfg).to(dtype).eval()
    x = torch.randn(batch, 3, what, what, device=device, dtype=dtype, generator=g)
    return model, lambda m: m(pixel_values=x).last_hidden_state


def attention_share(fn) -> float:
    """The share of one native call's GPU time spent inside ``aten::scaled_dot_product_attention`` (whichever kernels
    SDPA dispatched to, math included), from ``torch.profiler``: the op's device time over the sum of every kernel's
    own device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(getattr(ev, "self_device_time_total", 0.0) for ev in events)
    attn = sum(getattr(ev, "device_time_total", 0.0) for ev in events if ev.key == "aten::scaled_dot_product_attention")
    return attn / total if total > 0 else float("nan")


def ab_cell(name, dt, batch, args):
    """One never-slower cell: native and converted (a deep copy) timed in interleaved rounds. ``--control``: the A/A
    control, the second side an unconverted copy (the method's noise floor: session 57 read native ViT-B/16 bf16 at
    2.66 ms in one process and 5.00 ms in the next); ``--cpu-smoke``: a one-block model on the CPU (the flow only)."""
    import copy

    import elsa_surgery

    dtype, tf32 = AB_DTYPES[dt]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    device = "cpu" if args.cpu_smoke else "cuda"
    rec = dict(workload=name, dtype=dt, batch=batch, backend=args.backend)
    try:
        native, call = ab_build(name, dtype, batch, device, smoke=args.cpu_smoke)
        converted = copy.deepcopy(native)
        if args.control:
            rec["control"] = True
            rec["converted_modules"] = 0
        else:
            report = elsa_surgery.convert(converted, backend=args.backend, precision=args.precision, verify=False)
            rec["converted_modules"] = report.num_converted
        with torch.inference_mode():
            ref = call(native).float()
            with elsa_surgery.dispatch.record() as log:
                out = call(converted).float()
            used = benchmark.dispatch_summary(log)
            rec["backends_used"], rec["fallbacks"] = used["backends"], used["fallbacks"]
            rec["reasons"] = sorted({d.reason for d in log})[:4]
            rec["rel_err_vs_native"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
            del out, ref
            times = benchmark.interleaved_ms({"native": lambda: call(native), "converted": lambda: call(converted)},
                                             rounds=args.rounds, calls=args.calls, device=device)
            rec["native_ms"], rec["converted_ms"] = times["native"], times["converted"]
            rec["ratio"] = times["native"] / times["converted"]
            if args.attn_share and not args.cpu_smoke:
                rec["attention_share"] = attention_share(lambda: call(native))
    except Exception as exc:  # one cell failing (OOM) must not stop the sweep
        rec["error"] = benchmark.error_text(exc)
    finally:
        native = converted = None
        gc.collect()
        torch.cuda.empty_cache()
    return rec


def sweep(cells, run, describe, out, env) -> list:
    """``run(*cell)`` for every cell (its record gets ``wall_s``), ``describe(cell, record)``'s lines printed, and
    the records so far written to ``out`` after every cell: a cut-off run keeps what it measured."""
    records = []
    for cell in cells:
        t0 = time.perf_counter()
        rec = run(*cell)
        rec["wall_s"] = time.perf_counter() - t0
        records.append(rec)
        for line in describe(cell, rec):
            print(line, flush=True)
        if out:
            benchmark.write_json(out, dict(env=env, records=records), announce=False)
    return records


def ab_main(args) -> int:
    cells = [(w, d, b) for w in args.workloads for d in args.ab_dtypes
             for b in (args.batches or WORKLOADS[w][2])]
    if args.list:
        for c in cells:
            print(*c)
        return 0
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench_models.py --eager needs a CUDA GPU (or --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    env = benchmark.env_info("cpu" if args.cpu_smoke else "cuda")
    print(f"# never-slower suite: {env.get('gpu', 'cpu (smoke run)')}, torch {env['torch']}; eager, interleaved "
          f"rounds ({args.rounds} x {args.calls} calls), ratio = native ms / converted ms"
          + ("; A/A control: both sides native" if args.control else ""), flush=True)

    def describe(cell, rec):
        w, d, b = cell
        if "error" in rec:
            return [f"{w} {d} b{b}: {rec['error'][:160]}"]
        share = rec.get("attention_share")
        return [f"{w} {d} b{b}: " + ("[A/A control: both sides native] " if rec.get("control") else "")
                + f"native {rec['native_ms']:.3f} ms, converted {rec['converted_ms']:.3f} ms, "
                f"ratio {rec['ratio']:.3f}" + (f", attention {share:.0%} of native" if share is not None else "")
                + f", {','.join(rec['backends_used']) or 'no ELSA call'}, rel {rec['rel_err_vs_native']:.1e} "
                f"({rec['wall_s']:.0f} s)"]

    records = sweep(cells, lambda w, d, b: ab_cell(w, d, b, args), describe, args.out, env)
    if args.plot:
        ab_heatmap(records, args.plot)
    return 0


# --compile: native compiled vs converted-then-compiled
# --------------------------------------------------------------------------------------------------

COMPILE_MODES = ("default", "max-autotune", "reduce-overhead")
COPY_WORDS = ("copy", "memcpy", "transpose", "clone", "contiguous", "permute")
# the ops of an Inductor kernel that only moves data (triton_poi_fused_clone_transpose_0, cpp_fused_clone_0)
_MOVES = set(COPY_WORDS) | {"view", "unsafe", "expand", "reshape", "t"}


def _inductor_copy(n: str) -> bool:
    fused = n.split("fused_", 1)[-1].rsplit("_", 1)[0]
    return all(word in _MOVES for word in fused.split("_") if word)


# profile categories, first match wins: (category, test of a lower-cased kernel / op name)
KERNEL_KINDS = (
    ("elsa", lambda n: "elsa" in n),  # the package's Triton kernels (_elsa_fwd*, elsa_merge_rows) and custom ops
    ("copy", lambda n: _inductor_copy(n) if n.startswith(("triton_", "cpp_fused"))
        else any(w in n for w in COPY_WORDS)),
    ("inductor", lambda n: n.startswith(("triton_", "cpp_fused"))),  # Inductor's fused kernels
    ("sdpa", lambda n: any(w in n for w in ("flash", "fmha", "attention", "cudnn"))),
    ("gemm", lambda n: any(w in n for w in ("gemm", "gemv", "cutlass", "xmma", "aten::mm", "aten::addmm",
                                            "aten::bmm", "matmul"))),
)


def kernel_kind(name: str) -> str:
    n = name.lower()
    return next((kind for kind, test in KERNEL_KINDS if test(n)), "other")


def compile_profile(fn, device, top: int = 3) -> dict:
    """Where one call's time goes (``torch.profiler``): the self device time of every kernel (on the CPU, the self
    CPU time of every op) summed by :func:`kernel_kind`, with the ``top`` names of each kind."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    fn()
    benchmark.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        benchmark.synchronize(device)
    kinds = {}
    for ev in prof.key_averages():
        if cuda:  # the kernels
            us = ev.self_device_time_total if ev.device_type == torch.autograd.DeviceType.CUDA else 0.0
        else:  # the ops, less the wrappers of the compiled region
            us = 0.0 if ev.key.startswith(("Torch-Compiled", "TorchDynamo", "CompiledFunction", "## ")) \
                else ev.self_cpu_time_total
        if us <= 0:
            continue
        kind = kinds.setdefault(kernel_kind(ev.key), dict(us=0.0, calls=0, top=[]))
        kind["us"] += us
        kind["calls"] += ev.count
        kind["top"].append((ev.key[:80], round(us, 1)))
    total = sum(k["us"] for k in kinds.values()) or float("nan")
    for k in kinds.values():
        k["share"] = k["us"] / total
        k["top"] = sorted(k["top"], key=lambda t: -t[1])[:top]
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]["us"]))


def compile_first_call(model, call, mode, args, device):
    """``(compiled model, seconds of its first call)``: compile and run once, synchronised, then two more calls
    (reduce-overhead records its CUDA graphs there)."""
    kw = dict(backend=args.compile_backend)
    if args.compile_backend == "inductor" and mode != "default":
        kw["mode"] = mode
    compiled = torch.compile(model, **kw)
    t0 = time.perf_counter()
    call(compiled)
    benchmark.synchronize(device)
    seconds = time.perf_counter() - t0
    for _ in range(2):
        call(compiled)
    benchmark.synchronize(device)
    return compiled, seconds


def isolated_compile_times(name, dt, batch, mode, args) -> dict:
    """``--isolated-compile``: each side's first compiled call (``compile_child``) in a process of its own whose
    Inductor and Triton caches are a fresh directory of its own, twice: ``<side>_compile_cold_s`` (empty caches) and
    ``<side>_compile_warm_s`` (a second process on the first one's caches), and the converted / native ratios. The
    cold processes run first (native, converted), then the warm ones, and each prints its seconds when it ends: a
    device call that ends before the cell does keeps what finished (session 51 lost three cells' children whole)."""
    rec, caches, children = {}, {}, {}
    try:
        for side in ("native", "converted"):  # (each side's command and caches: the same for its cold and warm runs)
            caches[side] = tempfile.mkdtemp(prefix=f"elsa_compile_{side}_")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches[side], "inductor"),
                       TRITON_CACHE_DIR=os.path.join(caches[side], "triton"))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--compile", mode, "--compile-child",
                   f"{side},{name},{dt},{batch},{mode}", "--compile-backend", args.compile_backend,
                   "--backend", args.backend, *(["--precision", args.precision] if args.precision else []),
                   *(["--cpu-smoke"] if args.cpu_smoke else [])]
            children[side] = cmd, env
        for run in ("cold", "warm"):
            for side in ("native", "converted"):
                cmd, env = children[side]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                if done.returncode or not lines:
                    raise RuntimeError(f"the {side} compile child failed ({done.returncode}): "
                                       f"{(done.stderr or done.stdout).strip()[-400:]}")
                got = json.loads(lines[-1])
                rec[f"{side}_compile_{run}_s"] = got["compile_s"]
                if side == "converted":
                    rec[f"ttir_memo_{run}"] = got.get("ttir_memo")
                    rec[f"precompile_{run}"] = got.get("precompile")
                print(f"  isolated compile, {name} {dt} b{batch} {mode}, {side} {run}: "
                      f"{rec[f'{side}_compile_{run}_s']:.1f} s (process {time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    for run in ("cold", "warm"):
        rec[f"compile_{run}_ratio"] = rec[f"converted_compile_{run}_s"] / rec[f"native_compile_{run}_s"]
    return rec


def balanced_compile_cell(name, dt, batch, mode, args) -> dict:
    """``--processes N``: the cell run in ``N`` processes of its own (this script, one cell each), the side compiled
    first alternating (converted first, native first, ...): a compiled cell's ratio leans on which side compiles
    first by a few per cent (session 47, ViT-B/16 bf16 b8 on an H200: 0.917-0.971 converted first, 0.978-1.044
    native first, identical kernels), so the cell's ``ratio`` is the geometric mean over the processes, with each
    process's ratio, its order, and each order's geometric mean beside it."""
    runs = []
    for i in range(args.processes):
        native_first = i % 2 == 1
        fd, out = tempfile.mkstemp(prefix="elsa_compile_cell_", suffix=".json")
        os.close(fd)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile", mode, "--workloads", name, "--dtypes", dt,
               "--batches", str(batch), "--rounds", str(args.rounds), "--calls", str(args.calls),
               "--compile-backend", args.compile_backend, "--backend", args.backend, "--out", out,
               *(["--precision", args.precision] if args.precision else []),
               *(["--native-first"] if native_first else []), *(["--control"] if args.control else []),
               *(["--cpu-smoke"] if args.cpu_smoke else [])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            text = Path(out).read_text()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"compile cell process {i + 1} failed: {exc}") from exc
        finally:
            os.unlink(out)
        try:  # (a child that died before writing its records left the file empty: its stderr says why, below)
            got = json.loads(text) if text else {}
        except ValueError:
            got = {}
        rec = next((r for r in got.get("records", []) if r.get("workload") == name), None)
        if done.returncode or rec is None or "error" in rec:
            # (the child's last output line: a traceback's exception, kept on the one line a record's error shows)
            why = (rec or {}).get("error") or ((done.stderr or done.stdout).strip().splitlines() or [""])[-1][-400:]
            raise RuntimeError(f"compile cell process {i + 1} failed ({done.returncode}): {why}")
        runs.append(rec)

    def gmean(xs):
        return statistics.geometric_mean(xs) if xs else None

    first = runs[0]
    rec = {k: first[k] for k in ("workload", "dtype", "batch", "mode", "backend", "compile_backend", "compile_op",
                                 "converted_modules", "backends_used", "fallbacks", "control") if k in first}
    rec["processes"] = [{k: r[k] for k in ("compiled_first", "ratio", "native_ms", "converted_ms",
                                           "compile_time_ratio", "rel_err_vs_native", "compiled_decisions")}
                        for r in runs]
    rec["ratio"] = gmean([r["ratio"] for r in runs])
    for order in ("converted", "native"):
        rec[f"ratio_{order}_first"] = gmean([r["ratio"] for r in runs if r["compiled_first"] == order])
    for k in ("native_ms", "converted_ms", "native_compile_s", "converted_compile_s", "compile_time_ratio"):
        rec[k] = gmean([r[k] for r in runs])
    rec["rel_err_vs_native"] = max(r["rel_err_vs_native"] for r in runs)
    rec["compiled_decisions"] = sorted({d for r in runs for d in r.get("compiled_decisions", [])})
    return rec


def compile_child(args) -> int:
    """One side of ``--isolated-compile`` (``--compile-child SIDE,WORKLOAD,DTYPE,BATCH,MODE``): the model built (and
    converted), one eager call (as the in-process cell makes: the converted side's kernels compile there), Inductor's
    start-up taken by a tiny function, then the seconds of the first compiled call, printed as JSON."""
    import elsa_surgery
    from elsa_surgery.kernels import launch, replay  # (torch's analysis of ELSA's kernels, memoised; precompiles)

    side, name, dt, batch, mode = args.compile_child.split(",")
    device = "cpu" if args.cpu_smoke else "cuda"
    dtype, tf32 = AB_DTYPES[dt]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    model, call = ab_build(name, dtype, int(batch), device, smoke=args.cpu_smoke)
    if side == "converted":
        elsa_surgery.convert(model, backend=args.backend, precision=args.precision, verify=False)
    with torch.inference_mode():
        call(model)
        benchmark.synchronize(device)
        warm_up_compiler(args, device)
        _, seconds = compile_first_call(model, call, mode, args, device)
    print(json.dumps({"side": side, "compile_s": seconds, "ttir_memo": dict(replay.TTIR_MEMO),
                      "precompile": dict(launch.PRECOMPILE)}), flush=True)
    return 0


def compile_cell(name, dt, batch, mode, args):
    """One compiled cell: native and converted (a deep copy, ``convert(verify=False)``) each compiled, the converted
    one first (so that it never reuses kernels Inductor built for the native one), timed in interleaved rounds."""
    import copy

    import elsa_surgery
    from elsa_surgery.kernels import knobs

    if args.processes > 1:
        try:
            rec = balanced_compile_cell(name, dt, batch, mode, args)
        except Exception as exc:  # one cell failing must not stop the sweep
            rec = dict(workload=name, dtype=dt, batch=batch, mode=mode, error=benchmark.error_text(exc))
        return rec
    device = "cpu" if args.cpu_smoke else "cuda"
    dtype, tf32 = AB_DTYPES[dt]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    rec = dict(workload=name, dtype=dt, batch=batch, mode=mode, backend=args.backend,
               compile_backend=args.compile_backend)
    rec["compile_op"] = knobs.get(knobs.COMPILE_OP)  # the op ELSA's calls trace to (ELSA_COMPILE_OP)
    if args.isolated_only:
        try:
            rec.update(isolated_compile_times(name, dt, batch, mode, args))
        except Exception as exc:  # one cell failing must not stop the sweep
            rec["error"] = benchmark.error_text(exc)
        return rec
    try:
        torch._dynamo.reset()
        native, call = ab_build(name, dtype, batch, device, smoke=args.cpu_smoke)
        converted = copy.deepcopy(native)
        if args.control:  # the A/A control: the "converted" side is an unconverted copy (the method's noise floor)
            rec["control"] = True
            rec["converted_modules"] = 0
        else:
            report = elsa_surgery.convert(converted, backend=args.backend, precision=args.precision, verify=False)
            rec["converted_modules"] = report.num_converted
        with torch.inference_mode():
            with elsa_surgery.dispatch.record() as log:  # compiled code records nothing: the eager call's decisions
                call(converted)
            used = benchmark.dispatch_summary(log)
            rec["backends_used"], rec["fallbacks"] = used["backends"], used["fallbacks"]
            before = set(elsa_surgery.autoselect.compiled_decisions())
            rec["compiled_first"] = "native" if args.native_first else "converted"
            if args.native_first:
                nc, rec["native_compile_s"] = compile_first_call(native, call, mode, args, device)
            cc, rec["converted_compile_s"] = compile_first_call(converted, call, mode, args, device)
            # auto's trace-time choices (what the compiled graph holds; backends_used is the eager call's)
            rec["compiled_decisions"] = sorted({d.reason for sig, d in elsa_surgery.autoselect.compiled_decisions()
                                                .items() if sig not in before})
            if not args.native_first:
                nc, rec["native_compile_s"] = compile_first_call(native, call, mode, args, device)
            rec["compile_time_ratio"] = rec["converted_compile_s"] / rec["native_compile_s"]
            # (copies: under CUDA graphs, max-autotune's and reduce-overhead's, an fp32 output is a buffer of the
            # graphs' shared pool that the next compiled call may overwrite; ``.float()`` copies only other dtypes.
            # Session 51: max-autotune LLaMA 4K fp32 read rel 1.2 without them; under reduce-overhead the held
            # outputs differed by 1.22, the copied ones by 4.7e-6, compiled converted vs eager converted 4.5e-6)
            ref = call(nc).float().clone()
            out = call(cc).float().clone()
            rec["rel_err_vs_native"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
            del out, ref
            # the compiles' cyclic garbage, collected before the clock starts: left in place, Python's collector
            # ran into it during the timed calls (session 33, benchmarks/lab/process_slowdown.py: a compiled
            # ViT-B/16 at 3.45 ms per call after a second model's compile, 2.10 ms after a gc.collect())
            gc.collect()
            times = benchmark.interleaved_ms({"native": lambda: call(nc), "converted": lambda: call(cc)},
                                             rounds=args.rounds, calls=args.calls, device=device)
            rec["native_ms"], rec["converted_ms"] = times["native"], times["converted"]
            rec["ratio"] = times["native"] / times["converted"]
            if args.profile:
                rec["profile"] = {side: compile_profile(lambda: call(m), device) for side, m in
                                  (("native", nc), ("converted", cc))}
        if args.isolated_compile:
            rec.update(isolated_compile_times(name, dt, batch, mode, args))
    except Exception as exc:  # one cell failing (OOM, a compile error) must not stop the sweep
        rec["error"] = benchmark.error_text(exc)
        rec["traceback"] = traceback.format_exc(limit=8)
    finally:
        native = converted = nc = cc = None
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec


def profile_lines(profile) -> list:
    """``"  native: gemm 61% (…), inductor 20% (…)"`` per side: the kinds and their largest kernels."""
    lines = []
    for side, kinds in profile.items():
        parts = [f"{kind} {k['share']:.0%} {k['us']:.0f} us ({', '.join(n for n, _ in k['top'][:2])})"
                 for kind, k in kinds.items()]
        lines.append(f"  {side}: " + "; ".join(parts))
    return lines


def open_suite(args, cells, flag):
    """``(exit code, None)`` where a suite ends before measuring (``--list``: the cells printed, 0; no GPU and no
    ``--cpu-smoke``: 2), else ``(None, the environment record)``."""
    if args.list:
        for c in cells:
            print(*c)
        return 0, None
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"bench_models.py {flag} needs a CUDA GPU (or --cpu-smoke to check the script)", file=sys.stderr)
        return 2, None
    env = benchmark.env_info("cpu" if args.cpu_smoke else "cuda")
    env.setdefault("gpu", "cpu (smoke run: tiny models, not a measurement)")
    return None, env


def warm_up_compiler(args, device) -> float:
    """Seconds of one tiny compiled function, before the first cell: the process's first compile pays Inductor's
    start-up (imports, its compile workers), which belongs to neither side (session 31's first cell, compiled
    converted-first, read 2.11x native's compile time where the later cells read 0.90-1.16x)."""
    kw = dict(backend=args.compile_backend)
    t0 = time.perf_counter()
    f = torch.compile(lambda x: torch.relu(x @ x) + 1, **kw)
    f(torch.randn(64, 64, device=device))
    benchmark.synchronize(device)
    torch._dynamo.reset()
    return time.perf_counter() - t0


def compile_main(args) -> int:
    cells = [(w, d, b, m) for w in args.workloads for d in args.ab_dtypes
             for b in (args.batches or WORKLOADS[w][2]) for m in args.compile_modes]
    code, env = open_suite(args, cells, "--compile")
    if env is None:
        return code
    # (--processes, --isolated-only: the cells' own processes compile, each after its own warm-up)
    env["inductor_warmup_s"] = 0.0 if args.processes > 1 or args.isolated_only else warm_up_compiler(
        args, "cpu" if args.cpu_smoke else "cuda")
    print(f"# compiled never-slower suite: {env.get('gpu')}, torch {env['torch']}; torch.compile "
          f"({args.compile_backend}), interleaved rounds ({args.rounds} x {args.calls} calls), "
          f"ratio = native ms / converted ms; Inductor warm-up {env['inductor_warmup_s']:.1f} s", flush=True)
    def describe(cell, rec):
        head = "{} {} b{} {}: ".format(*cell) + ("[A/A control: both sides native] " if rec.get("control") else "")
        if "error" in rec:
            return [head + rec["error"][:160]]
        isolated = [f"  isolated compile (own process and caches): cold {rec['native_compile_cold_s']:.1f} s -> "
                    f"{rec['converted_compile_cold_s']:.1f} s ({rec['compile_cold_ratio']:.2f}x), warm "
                    f"{rec['native_compile_warm_s']:.1f} s -> {rec['converted_compile_warm_s']:.1f} s "
                    f"({rec['compile_warm_ratio']:.2f}x)"] if "compile_cold_ratio" in rec else []
        if "ratio" not in rec:  # (--isolated-only)
            return [head + isolated[0].strip()]
        balanced = []
        if "processes" in rec:
            head += f"{len(rec['processes'])} processes, geometric means: "
            orders = ", ".join(f"{o} first {rec[f'ratio_{o}_first']:.3f}" for o in ("converted", "native")
                               if rec[f"ratio_{o}_first"] is not None)
            balanced = [f"  processes: {orders}; each: "
                        + ", ".join(f"{r['ratio']:.3f} ({r['compiled_first']} first)" for r in rec["processes"])]
        return [head + f"native {rec['native_ms']:.3f} ms, converted {rec['converted_ms']:.3f} ms, "
                f"ratio {rec['ratio']:.3f}; compile {rec['native_compile_s']:.1f} s -> "
                f"{rec['converted_compile_s']:.1f} s ({rec['compile_time_ratio']:.2f}x), "
                f"eager call {','.join(rec['backends_used'])} ({rec['compile_op']} op"
                f"{'; the graph: traced below' if rec.get('compiled_decisions') else ''}), "
                f"rel {rec['rel_err_vs_native']:.1e} "
                f"({rec['wall_s']:.0f} s)"] + balanced + isolated \
            + [f"  traced: {r}" for r in rec.get("compiled_decisions", [])] \
            + profile_lines(rec.get("profile", {}))

    sweep(cells, lambda w, d, b, m: compile_cell(w, d, b, m, args), describe, args.out, env)
    return 0


# --train: training steps (forward + backward + AdamW), native vs converted
# --------------------------------------------------------------------------------------------------


def train_step(model, call, opt, autocast_dtype, device):
    """A zero-argument training step: forward (under autocast when ``autocast_dtype``), the mean square of the
    output as the loss, backward, ``opt.step()``, gradients freed (so a step's peak holds one set of gradients)."""
    device_type = torch.device(device).type

    def step():
        with torch.autocast(device_type, autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = call(model).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def first_step_diff(native, converted, call, autocast_dtype, device) -> dict:
    """Loss and parameter-gradient differences of one forward/backward on each side (same weights, same inputs),
    before any optimizer step: ``loss_rel_err`` and ``grad_rel_err`` (the gradients' relative L2 distance, all
    parameters as one vector, summed parameter by parameter: no second copy of a large model's gradients); with
    the backends the converted forward ran. The gradients are freed afterwards."""
    from elsa_surgery import dispatch

    losses = {}
    for side, m in (("native", native), ("converted", converted)):
        torch.manual_seed(0)  # the same stochastic-depth draws on both sides (timm Swin trains with drop_path 0.1:
        # session 29's first run compared different draws and read 3.3e-1)
        with dispatch.record() as log:  # (the native model calls no elsa_surgery code: an empty log)
            with torch.autocast(torch.device(device).type, autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                loss = call(m).float().square().mean()
            loss.backward()
        losses[side] = loss.detach().double()
    used = benchmark.dispatch_summary(log)
    diff2 = ref2 = 0.0
    for (name, a), b in zip(native.named_parameters(), converted.parameters()):
        if (a.grad is None) != (b.grad is None):
            raise RuntimeError(f"parameter {name}: a gradient on one side only (native "
                               f"{a.grad is not None}, converted {b.grad is not None})")
        if a.grad is not None:
            diff2 += float((b.grad.float() - a.grad.float()).norm()) ** 2
            ref2 += float(a.grad.float().norm()) ** 2
    native.zero_grad(set_to_none=True)
    converted.zero_grad(set_to_none=True)
    return dict(loss_rel_err=float((losses["converted"] - losses["native"]).abs() / losses["native"].abs()),
                grad_rel_err=(diff2 / max(ref2, 1e-60)) ** 0.5, backends_used=used["backends"],
                fallbacks=used["fallbacks"])


def train_cell(name, dt, batch, args):
    """One training cell: native and converted (a deep copy, ``convert(verify=False)``), each with its own AdamW,
    timed in interleaved rounds of training steps; then one step of each under :class:`benchmark.PeakMemory`."""
    import copy

    import elsa_surgery

    device = "cpu" if args.cpu_smoke else "cuda"
    dtype, tf32, autocast_dtype = TRAIN_DTYPES[dt]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    rec = dict(workload=name, dtype=dt, batch=batch, backend=args.backend, precision=args.precision)
    native = converted = steps = None
    try:
        native, call = ab_build(name, dtype, batch, device, smoke=args.cpu_smoke)
        native.train()
        converted = copy.deepcopy(native)
        report = elsa_surgery.convert(converted, backend=args.backend, precision=args.precision, verify=False)
        rec["converted_modules"] = report.num_converted
        rec.update(first_step_diff(native, converted, call, autocast_dtype, device))
        steps = {side: train_step(m, call, torch.optim.AdamW(m.parameters(), lr=1e-6), autocast_dtype, device)
                 for side, m in (("native", native), ("converted", converted))}
        times = benchmark.interleaved_ms(steps, rounds=args.rounds, calls=args.calls, device=device)
        rec["native_ms"], rec["converted_ms"] = times["native"], times["converted"]
        rec["ratio"] = times["native"] / times["converted"]
        for side, step in steps.items():  # AdamW's state exists by now: the peak is one step's own
            with benchmark.PeakMemory(device) as mem:
                step()
            rec[f"{side}_peak_mib"], rec[f"{side}_peak_reserved_mib"] = mem.mib, mem.reserved_mib
        if rec["native_peak_mib"]:
            rec["memory_ratio"] = rec["converted_peak_mib"] / rec["native_peak_mib"]
    except Exception as exc:  # one cell failing (OOM) must not stop the sweep
        rec["error"] = benchmark.error_text(exc)
        rec["traceback"] = traceback.format_exc(limit=8)
    finally:
        native = converted = steps = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec


def train_main(args) -> int:
    cells = [(w, d, b) for w in args.workloads for d in args.ab_dtypes
             for b in (args.batches or TRAIN_WORKLOADS.get(w) or WORKLOADS[w][2])]
    code, env = open_suite(args, cells, "--train")
    if env is None:
        return code
    print(f"# training-step suite: {env.get('gpu')}, torch {env['torch']}; forward + backward + AdamW, eager, "
          f"interleaved rounds ({args.rounds} x {args.calls} steps), ratio = native ms / converted ms", flush=True)

    def describe(cell, rec):
        head = "{} {} b{}: ".format(*cell)
        if "error" in rec:
            return [head + rec["error"][:160]]
        peaks = (benchmark.peak_text(rec[f"{side}_peak_mib"], 0) for side in ("native", "converted"))
        mem = "peak {} -> {}, ".format(*peaks)
        return [head + f"native {rec['native_ms']:.3f} ms, converted {rec['converted_ms']:.3f} ms, ratio "
                f"{rec['ratio']:.3f}, {mem}{','.join(rec['backends_used'])}, loss rel {rec['loss_rel_err']:.1e}, "
                f"grad rel {rec['grad_rel_err']:.1e} ({rec['wall_s']:.0f} s)"]

    sweep(cells, lambda w, d, b: train_cell(w, d, b, args), describe, args.out, env)
    return 0


def ab_heatmap(records, path) -> None:
    """A PNG heat map of the ratios: rows workload x batch, columns dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return
    rows = sorted({(r["workload"], r["batch"]) for r in records})
    cols = [d for d in AB_DTYPES if any(r["dtype"] == d for r in records)]
    grid = [[float("nan")] * len(cols) for _ in rows]
    for r in records:
        if "ratio" in r:
            grid[rows.index((r["workload"], r["batch"]))][cols.index(r["dtype"])] = r["ratio"]
    fig, ax = plt.subplots(figsize=(2 + 1.4 * len(cols), 1 + 0.32 * len(rows)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), [f"{w} b{b}" for w, b in rows])
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, label="native ms / converted ms")
    ax.set_title("converted vs native, eager")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eager", action="store_true", help="the never-slower suite (interleaved native/converted A/B)")
    p.add_argument("--compile", default=None, metavar="MODES",
                   help="the never-slower suite under torch.compile: comma list of " + ", ".join(COMPILE_MODES)
                        + " (takes --eager's workload options)")
    p.add_argument("--train", action="store_true",
                   help="the training-step suite: forward + backward + AdamW, native vs converted, interleaved "
                        "(takes --eager's workload options; dtypes " + ", ".join(TRAIN_DTYPES) + ")")
    p.add_argument("--compile-backend", default="inductor",
                   help="--compile: torch.compile's backend (modes apply to inductor only)")
    p.add_argument("--profile", action="store_true",
                   help="--compile: profile one native and one converted compiled call (where device time goes)")
    p.add_argument("--control", action="store_true",
                   help="--compile, --eager: an A/A control: the second side is an unconverted deep copy of the native "
                        "model, (compiled and) timed the same way (the ratio any difference in the method alone makes)")
    p.add_argument("--isolated-compile", action="store_true",
                   help="--compile: also time each side's first compiled call in processes of its own, with Inductor "
                        "and Triton caches of its own: cold (fresh caches: a first run on a new machine), then warm "
                        "(a second process on the same caches); neither side reuses the other's kernels")
    p.add_argument("--isolated-only", action="store_true",
                   help="--compile --isolated-compile: only the isolated compile times, without the in-process "
                        "cell (its two compiles and timed rounds: 35-75 s a fp32 cell on an H200)")
    p.add_argument("--compile-child", default=None, help=argparse.SUPPRESS)  # SIDE,WORKLOAD,DTYPE,BATCH,MODE
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="--compile: run each cell in N processes of its own, alternating which side compiles first "
                        "(converted first, then native first, ...); the ratio is their geometric mean")
    p.add_argument("--native-first", action="store_true",
                   help="--compile: compile the native model first (default: the converted one first). The side "
                        "compiled second reuses what the first left in Inductor's and Triton's caches (the kernels "
                        "outside attention are the same), so each order biases the compile-time ratio its own way")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"--eager: comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--batches", default=None, help="--eager: comma list of batch sizes (default: each workload's)")
    p.add_argument("--rounds", type=int, default=3, help="--eager: interleaved rounds (median reported)")
    p.add_argument("--calls", type=int, default=10, help="--eager: back-to-back calls per side and round")
    p.add_argument("--no-attn-share", dest="attn_share", action="store_false",
                   help="--eager: skip the profiler run measuring attention's share of the native time")
    p.add_argument("--plot", default=None, help="--eager: write a PNG heat map of the ratios here")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--sizes", default=None, help="comma list of image sizes (default: each model's own list)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    p.add_argument("--modes", default="eager,cudagraph", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--precision", default=None, choices=["strict", "precise", "turbo"],
                   help="ELSA fp32 mode (default: precise on sm80+)")
    p.add_argument("--backend", default="auto", choices=["auto", "elsa"],
                   help="backend of the converted model ('elsa' refuses to fall back)")
    p.add_argument("--matmul-tf32", action="store_true",
                   help="allow TF32 in the models' fp32 matmuls (both native and converted)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before the timed ones")
    p.add_argument("--iters", type=int, default=20, help="timed calls (the median is reported)")
    p.add_argument("--no-verify", action="store_true", help="skip convert()'s parity check (saves time)")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the flow on the CPU (eager only, wall-clock timing of 3 calls, no memory numbers; "
                        f"with --compile and --eager: one-block models of {', '.join(SMOKE_WORKLOADS)}, batch 1, at "
                        f"most 2 rounds of 2 calls; with --train: {TRAIN_SMOKE_WORKLOAD} one block, fp32, batch 2, "
                        "reference backend): a check of this script, not a measurement")
    a = p.parse_args(argv)
    if a.eager + (a.compile is not None) + a.train > 1:
        p.error("--eager, --compile and --train are separate suites: choose one")
    if a.train:
        if a.workloads == p.get_default("workloads"):
            a.workloads = TRAIN_SMOKE_WORKLOAD if a.cpu_smoke else ",".join(TRAIN_WORKLOADS)
        if a.dtypes == p.get_default("dtypes"):
            a.dtypes = "fp32" if a.cpu_smoke else "fp32,bf16-autocast"
        if a.cpu_smoke:
            _shrink_for_smoke(p, a, "--train", "2")
    if a.processes != 1 and a.compile is None:
        p.error("--processes runs --compile cells in processes of their own: use it with --compile")
    if a.compile is not None:
        a.compile_modes = comma_list(p, "--compile", a.compile, COMPILE_MODES, "mode")
        if not a.compile_modes:
            p.error("--compile: name at least one mode")
        if a.processes < 1:
            p.error(f"--processes must be >= 1, got {a.processes}")
        if a.processes > 1 and (a.profile or a.isolated_compile or a.native_first):
            p.error("--processes N alternates the side compiled first in processes of its own; --profile, "
                    "--isolated-compile and --native-first run in one process: choose one")
        if a.isolated_only and (not a.isolated_compile or a.profile or a.control or a.native_first):
            p.error("--isolated-only needs --isolated-compile and times no in-process cell: no --profile, "
                    "--control or --native-first")
        if a.cpu_smoke:  # tiny models, few calls: a check of the script
            a.rounds, a.calls = min(a.rounds, 2), min(a.calls, 2)
            a.batches = a.batches or "1"
            if a.workloads == p.get_default("workloads"):
                a.workloads = ",".join(SMOKE_WORKLOADS)
    if a.eager and a.cpu_smoke:  # one-block models, few calls: a check of the script
        if a.workloads == p.get_default("workloads"):
            a.workloads = ",".join(SMOKE_WORKLOADS)
        _shrink_for_smoke(p, a, "--eager", "1")
    if a.control and not (a.eager or a.compile is not None):
        p.error("--control is the A/A control of --eager and --compile")
    if a.eager or a.compile is not None or a.train:
        a.workloads = comma_list(p, "--workloads", a.workloads, WORKLOADS, "workload")
        a.ab_dtypes = comma_list(p, "--dtypes", a.dtypes, TRAIN_DTYPES if a.train else AB_DTYPES, "dtype")
        a.batches = None if a.batches is None else comma_list(p, "--batches", a.batches, type=int)
        if a.rounds < 1 or a.calls < 1:
            p.error("--rounds and --calls must be >= 1")
        return a
    a.models = comma_list(p, "--models", a.models, MODELS, "model")
    a.dtypes = comma_list(p, "--dtypes", a.dtypes, DTYPES, "dtype")
    a.modes = comma_list(p, "--modes", a.modes, MODES, "mode")
    a.sizes = None if a.sizes is None else comma_list(p, "--sizes", a.sizes, type=int)
    if a.batch < 1:
        p.error("--batch must be >= 1")
    if a.cpu_smoke:
        a.warmup, a.iters = 0, 3
    if a.warmup < 0 or a.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    return a


def _shrink_for_smoke(p, a, suite: str, batch: str) -> None:
    """``--cpu-smoke`` for ``suite``: the one-block workloads only (``SMOKE_WORKLOADS``), at most 2 rounds of 2 calls,
    batch ``batch`` unless given."""
    smoke = set(comma_list(p, "--workloads", a.workloads, WORKLOADS, "workload")) - set(SMOKE_WORKLOADS)
    if smoke:
        p.error(f"{suite} --cpu-smoke runs the workloads {', '.join(SMOKE_WORKLOADS)}, not {', '.join(sorted(smoke))}")
    a.rounds, a.calls = min(a.rounds, 2), min(a.calls, 2)
    a.batches = a.batches or batch


def configs(args):
    for name in args.models:
        arch, sizes, _ = MODELS[name]
        for size in (args.sizes or sizes):
            for dt in args.dtypes:
                yield name, size, dt


def build(name, size, dtype, device="cuda", **smoke):
    import timm

    arch, _, extra = MODELS[name]
    torch.manual_seed(0)
    # initialised on the device directly (random init of ViT-L on the host takes seconds)
    model = timm.create_model(arch, pretrained=False, img_size=size, device=device, **dict(extra.get(size, {}), **smoke))
    return model.eval().to(device, dtype)


def runner(model, x, mode):
    """A zero-argument callable running one forward in ``mode`` (setup cost paid here)."""
    if mode == "eager":
        def fn():
            with torch.inference_mode():
                return model(x)
        return fn
    if mode == "compile":
        compiled = torch.compile(model)

        def fn():
            with torch.inference_mode():
                return compiled(x)
        for _ in range(3):  # compile + autotune outside the timing
            fn()
        return fn
    if mode == "cudagraph":
        static_x = x.clone()

        def call():
            with torch.no_grad():
                return model(static_x)
        return benchmark.cuda_graph(call, warmup=3)  # warm-up: Triton compiles, cuBLAS workspaces
    raise ValueError(mode)


def measure(model, x, mode, args):
    """(median ms, peak extra MiB of the mode's setup and first call, setup seconds, first output)."""
    gc.collect()
    with benchmark.PeakMemory(x.device) as mem:  # setup included: a CUDA graph's private pool counts
        t0 = time.perf_counter()
        fn = runner(model, x, mode)
        out = fn()
    setup_s = time.perf_counter() - t0
    peak_mb = 0.0 if mem.mib is None else mem.mib
    ms = benchmark.measure(fn, x.device, args.warmup, args.iters)[0]
    out = out.detach().float().clone()
    del fn
    if mode == "compile":
        torch._dynamo.reset()
    return ms, peak_mb, setup_s, out


def bench_one(name, size, dt, mode, args):
    import elsa_surgery
    from elsa_surgery.surgery import convert, revert

    dtype = DTYPES[dt]
    rec = dict(model=name, arch=MODELS[name][0], img_size=size, dtype=dt, mode=mode, batch=args.batch,
               backend=args.backend, precision=args.precision)
    device = "cpu" if args.cpu_smoke else "cuda"
    smoke = dict(depth=2) if args.cpu_smoke and name.startswith("vit") else {}
    if args.cpu_smoke and name.startswith("swin"):
        smoke = dict(depths=(2, 2))
    model = build(name, size, dtype, device, **smoke)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch, 3, size, size, device=device, dtype=dtype, generator=g)
    try:
        rec["native_ms"], rec["native_peak_mb"], rec["native_setup_s"], ref = measure(model, x, mode, args)
        rep = convert(model, backend=args.backend, precision=args.precision, verify=not args.no_verify)
        rec["converted_modules"] = rep.num_converted
        rec["counts"] = rep.counts
        if rep.parity is not None:
            rec["parity"] = {k: rep.parity.to_dict()[k] for k in ("verified", "passed", "rel_err", "rtol", "atol")}
        with elsa_surgery.dispatch.record() as log:
            rec["elsa_ms"], rec["elsa_peak_mb"], rec["elsa_setup_s"], out = measure(model, x, mode, args)
        used = benchmark.dispatch_summary(log)
        rec["backends_used"] = sorted(used["backends"]) or rep.backends_used  # a graph replay records nothing
        rec["fallbacks"] = used["fallbacks"] + rep.fallbacks
        rec["rel_err_vs_native"] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        rec["speedup"] = rec["native_ms"] / rec["elsa_ms"]
        rec["memory_ratio"] = rec["elsa_peak_mb"] / rec["native_peak_mb"] if rec["native_peak_mb"] > 0 else None
        revert(model)
    except Exception as exc:  # one configuration failing (OOM, capture error) must not stop the sweep
        rec["error"] = benchmark.error_text(exc)
        rec["traceback"] = traceback.format_exc(limit=6)
    finally:
        del model, x
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec


def table(records):
    head = ("model", "px", "dtype", "mode", "native ms", "elsa ms", "speedup", "native MiB", "elsa MiB", "rel err", "notes")
    rows = []
    for r in records:
        if "error" in r:
            rows.append((r["model"], r["img_size"], r["dtype"], r["mode"], "-", "-", "-", "-", "-", "-", r["error"][:60]))
            continue
        notes = "FALLBACK: " + "; ".join(r["fallbacks"])[:60] if r["fallbacks"] else ",".join(r["backends_used"])
        rows.append((r["model"], r["img_size"], r["dtype"], r["mode"], f"{r['native_ms']:.3f}", f"{r['elsa_ms']:.3f}",
                     f"{r['speedup']:.3f}x", f"{r['native_peak_mb']:.0f}", f"{r['elsa_peak_mb']:.0f}",
                     f"{r['rel_err_vs_native']:.1e}", notes))
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.eager:
        return ab_main(args)
    if args.compile_child is not None:
        return compile_child(args)
    if args.compile is not None:
        return compile_main(args)
    if args.train:
        return train_main(args)
    todo = [(n, s, d, m) for n, s, d in configs(args) for m in args.modes]
    if args.list:
        for t in todo:
            print(*t)
        return 0
    if args.cpu_smoke:
        if set(args.modes) - {"eager"}:
            print("--cpu-smoke runs --modes eager only", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("bench_models.py needs a CUDA GPU (or --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = bool(args.matmul_tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.matmul_tf32)
    import timm
    import triton

    env = benchmark.env_info("cpu" if args.cpu_smoke else "cuda")
    env.setdefault("gpu", "cpu (smoke run)")
    env.setdefault("capability", [])
    env.update(triton=triton.__version__, timm=timm.__version__, matmul_tf32=bool(args.matmul_tf32))
    print(f"# {env['gpu']} (sm{''.join(map(str, env['capability']))}), torch {env['torch']}, triton {env['triton']}, "
          f"timm {env['timm']}, batch {args.batch}", flush=True)
    def describe(cell, rec):
        brief = rec.get("error") or (f"native {rec['native_ms']:.3f} ms, elsa {rec['elsa_ms']:.3f} ms, "
                                     f"{rec['speedup']:.3f}x, mem {rec['native_peak_mb']:.0f} -> {rec['elsa_peak_mb']:.0f} MiB")
        return ["{} {}px {} {}: ".format(*cell) + f"{brief} ({rec['wall_s']:.0f} s)"]

    records = sweep(todo, lambda n, s, d, m: bench_one(n, s, d, m, args), describe, args.out, env)
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
