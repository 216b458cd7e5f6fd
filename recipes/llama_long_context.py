#!/usr/bin/env python
"""LLaMA long-context fp32 prefill: ELSA vs native PyTorch SDPA (tokens/s, peak memory, OOM).

A LLaMA-architecture model with random weights (default: the first ``--layers 4`` layers of Llama-2-13B's
shape: hidden 5120, 40 heads, MLP 13824) runs one prefill forward over ``--seq-lens`` tokens, in fp32,
once with transformers' ``sdpa`` attention and once converted by ``elsa_surgery.convert``. For every
length it records the median latency, tokens/s, peak GPU memory and whether it ran out of memory, and
writes everything as JSON (``--json``). ``--offload`` keeps the weights on the CPU with accelerate
(``cpu_offload``, weights streamed to the GPU layer by layer, as in the paper's Table 5), so the GPU memory
left is what the activations and attention need. ``--memory-gib`` caps the memory PyTorch may use, to ask
"which lengths fit in the same memory".

``--generate`` times greedy generation instead (``--new-tokens`` after a prompt of each ``--seq-lens`` length, HF
``generate`` with the ``--cache`` implementations, dynamic and/or static): the native model and a converted deep copy
held side by side and timed in interleaved rounds (A/B/A/B, ``--iters`` rounds, median), their greedy tokens
compared; it prints native / converted seconds, the ratio (> 1: converted faster), decode tokens/s and whether the
tokens are identical, and where they are not, the first step they differ at and how near a tie the native model's
choice was there against how far the two models' logits differ (``first_divergence``). On a CUDA device
transformers compiles the decode steps of a static cache itself (``torch.compile``, mode ``reduce-overhead``: CUDA
graphs) for both models: such a cell is a compiled one, said so in its line (``decode compiled``), and its dispatch
reasons cover the eager calls alone (the prefill); ``static-eager`` turns that off (session 57: the Qwen2 static
cells of sessions 35-36 were compiled ones).

Examples (the device):
    python recipes/llama_long_context.py --generate --layers 2 --dtype bf16 --seq-lens 4096,32768 --cache dynamic,static
    python recipes/llama_long_context.py --generate --shape qwen2-7b --layers 2 --dtype bf16 --seq-lens 4096
    python recipes/llama_long_context.py --json llama_13b_4l.json
    python recipes/llama_long_context.py --layers 2 --seq-lens 16384,32768,65536 --offload --json off.json
    python recipes/llama_long_context.py --shape tiny --device cpu --seq-lens 64,128 --iters 1   # smoke test

Nothing is downloaded: the config is built here and the weights are random.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from typing import Any, Dict, List

import torch

SHAPES = {
    # hidden, heads, kv heads, intermediate, vocab
    "13b": dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=40, intermediate_size=13824, vocab_size=32000),
    "7b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    "70b-gqa": dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=32000),
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=1000),
    # Qwen2-7B's attention shape (GQA 28:4), built as a LLaMA (same attention; Qwen2's q/k/v biases aside)
    "qwen2-7b": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                     vocab_size=32000),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="13b", help="model shape (default: Llama-2-13B)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers to build (default 4)")
    p.add_argument("--seq-lens", default="4096,8192,16384,32768,65536", help="comma-separated prefill lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--impls", default="sdpa,elsa", help="comma-separated: sdpa, elsa, eager")
    p.add_argument("--sdpa-backend", default="auto", choices=("auto", "math", "efficient", "flash", "cudnn"),
                   help="restrict native SDPA to one backend (default: PyTorch's choice)")
    p.add_argument("--precision", default=None, choices=("strict", "precise", "turbo"), help="ELSA fp32 mode")
    p.add_argument("--backend", default="auto", choices=("auto", "elsa", "reference"),
                   help="ELSA backend (auto falls back to the reference off-GPU; 'elsa' refuses to)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--tf32", action="store_true", help="allow TF32 for the (non-attention) matmuls of both runs")
    p.add_argument("--offload", action="store_true", help="accelerate cpu_offload: weights on CPU, streamed per layer")
    p.add_argument("--memory-gib", type=float, default=None, help="cap PyTorch's GPU memory (same budget for both)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=3, help="timed runs per point (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="skip longer lengths for an implementation once one run exceeds this")
    p.add_argument("--check-parity", type=int, default=2048,
                   help="compare ELSA with SDPA hidden states at this length first (0: skip)")
    p.add_argument("--use-cache", action="store_true", help="build the KV cache during prefill (more memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--generate", action="store_true", help="time greedy generation, native vs converted (A/B)")
    p.add_argument("--new-tokens", type=int, default=128, help="--generate: tokens generated after the prompt")
    p.add_argument("--cache", default="dynamic,static",
                   help="--generate: comma list of dynamic, static, static-eager (a static cache with transformers' "
                        "auto-compile of the decode steps off: generate(disable_compile=True))")
    return p.parse_args(argv)


def _dtype(name):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build_model(args, device):
    from transformers import LlamaConfig, LlamaModel

    shape = dict(SHAPES[args.shape])
    cfg = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.lengths) + 1,
                      rope_theta=10000.0, attn_implementation="sdpa", **shape)
    torch.manual_seed(args.seed)
    target = torch.device("cpu") if args.offload else device
    with torch.device(target):
        model = LlamaModel(cfg).to(_dtype(args.dtype)).eval()
    if args.offload:
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=device)
    return model, cfg


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "outofresources" in type(exc).__name__.lower()


def _sdpa_context(name):
    import contextlib

    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def set_impl(model, impl, args):
    import elsa_surgery

    elsa_surgery.revert(model)
    if impl == "elsa":
        report = elsa_surgery.convert(model, backend=args.backend, precision=args.precision, verify=False)
        return {"converted": report.num_converted}
    model.set_attn_implementation(impl)
    return {}


def forward(model, ids, args):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=args.use_cache).last_hidden_state


def measure(model, impl, n, args, device) -> Dict[str, Any]:
    from elsa_surgery import dispatch

    ids = torch.randint(0, model.config.vocab_size, (args.batch, n), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.seed))
    res: Dict[str, Any] = {"impl": impl, "seq_len": n, "batch": args.batch}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    try:
        with _sdpa_context(args.sdpa_backend if impl == "sdpa" else "auto"), dispatch.record() as log:
            for i in range(args.warmup + args.iters):
                _sync(device)
                t0 = time.perf_counter()
                out = forward(model, ids, args)
                _sync(device)
                dt = time.perf_counter() - t0
                del out
                if i >= args.warmup:
                    times.append(dt)
                if dt > args.max_seconds:
                    break
    except Exception as exc:  # OOM is a result, anything else is an error; both are recorded
        res["status"] = "OOM" if _is_oom(exc) else "error"
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        if device.type == "cuda":
            res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return res
    times = times or [dt]
    times.sort()
    med = times[len(times) // 2]
    res.update(status="ok", latency_s=med, tokens_per_s=args.batch * n / med, runs=len(times))
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        res["peak_extra_mem_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if impl == "elsa":
        used = sorted({d.backend + (f"/{d.precision}" if d.precision else "") for d in log})
        res["elsa_backends"] = used
        fb = sorted({d.reason for d in log if d.fallback})
        if fb:
            res["fallbacks"] = fb
    return res


def parity(model, n, args, device) -> Dict[str, Any]:
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.seed + 1))
    try:
        set_impl(model, "sdpa", args)
        with _sdpa_context(args.sdpa_backend):
            ref = forward(model, ids, args).float()
        set_impl(model, "elsa", args)
        out = forward(model, ids, args).float()
    except Exception as exc:
        return {"seq_len": n, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    d = (out - ref).abs()
    res = {"seq_len": n, "max_abs_diff": d.max().item(), "ref_max_abs": ref.abs().max().item(),
           "rel_l2": (d.norm() / ref.norm()).item()}
    del ref, out
    return res


def first_divergence(seq_c, seq_n, logits_c, logits_n, prompt_len: int, dtype: torch.dtype) -> List[Any]:
    """Where the converted model's greedy tokens first leave the native model's, one entry a batch row: None where
    they agree; else ``step`` (of the generated tokens), the two tokens, ``native_margin`` (the native logit of its
    token minus that of the converted model's token: how far from a tie the native choice was), ``converted_margin``
    (the same the other way), ``margin_ulps`` (the native margin in units of the model dtype's spacing at that logit:
    0 is an exact tie in the dtype the logits were rounded to), ``logit_diff_before`` (the largest difference between
    the two models' logits over the steps before, where their tokens agreed; None at step 0) and ``logit_diff_at`` (at
    the step). ``logits_*``: generate's ``output_logits``, one ``[B, vocab]`` tensor a step.

    ``near_tie``: the margin is at most one spacing of the dtype, or at most twice ``logit_diff_before`` (two logits
    each moved by that much swap a pair that close): the two attentions' rounding decides such a choice either way, as
    it does between two SDPA backends; rows of random-weight models often hold such ties (session 65: 'tokens
    identical False' in bf16 cells, and the same with ``sdpa`` on both sides in earlier logs). A divergence that is
    no near tie is worth a look."""
    rows: List[Any] = []
    steps = min(len(logits_c), len(logits_n), seq_c.shape[1] - prompt_len, seq_n.shape[1] - prompt_len)
    eps = torch.finfo(dtype).eps
    for b in range(seq_n.shape[0]):
        gen_c, gen_n = seq_c[b, prompt_len:prompt_len + steps], seq_n[b, prompt_len:prompt_len + steps]
        differ = (gen_c != gen_n).nonzero()
        if differ.numel() == 0:
            rows.append(None)
            continue
        j = int(differ[0, 0])
        tok_n, tok_c = int(gen_n[j]), int(gen_c[j])
        ln, lc = logits_n[j][b].float(), logits_c[j][b].float()
        diffs = [float((logits_c[i][b].float() - logits_n[i][b].float()).abs().max()) for i in range(j + 1)]
        before = max(diffs[:j]) if j else None
        margin = float(ln[tok_n] - ln[tok_c])
        ulps = margin / (eps * 2.0 ** math.floor(math.log2(max(abs(float(ln[tok_n])), 1e-30))))
        rows.append({"step": j, "native_token": tok_n, "converted_token": tok_c, "native_margin": margin,
                     "converted_margin": float(lc[tok_c] - lc[tok_n]), "margin_ulps": ulps,
                     "logit_diff_before": before, "logit_diff_at": diffs[j],
                     "near_tie": ulps <= 1.0 or (before is not None and margin <= 2 * before)})
    return rows


def _divergence_text(rows: List[Any]) -> str:
    """One line's account of :func:`first_divergence` (empty where every row agrees)."""
    parts = []
    for b, r in enumerate(rows):
        if r is not None:
            before = "no step before" if r["logit_diff_before"] is None else (
                f"logits differed by <= {r['logit_diff_before']:.3g} over the steps before")
            parts.append(f"row {b} first differs at step {r['step']}: native margin {r['native_margin']:.3g} "
                         f"({r['margin_ulps']:.1f} ulps), converted margin {r['converted_margin']:.3g}, {before}"
                         + (" (a near tie)" if r["near_tie"] else " (NOT a near tie)"))
    return "; ".join(parts)


def generate_ab(args, device) -> List[Dict[str, Any]]:
    """--generate: native and converted LlamaForCausalLM (a deep copy) in interleaved rounds, per prompt length and
    cache implementation."""
    import copy

    import elsa_surgery
    from elsa_surgery import callcache
    from transformers import LlamaConfig, LlamaForCausalLM

    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    unknown = sorted(set(caches) - {"dynamic", "static", "static-eager"})
    if unknown:  # (before the models are built)
        raise SystemExit(f"--cache: {unknown} not among dynamic, static, static-eager")
    cfg = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.lengths) + args.new_tokens + 1,
                      rope_theta=10000.0, attn_implementation="sdpa", **SHAPES[args.shape])
    torch.manual_seed(args.seed)
    with torch.device(device):
        native = LlamaForCausalLM(cfg).to(_dtype(args.dtype)).eval()
    converted = copy.deepcopy(native)
    report = elsa_surgery.convert(converted, backend=args.backend, precision=args.precision, verify=False)
    print(f"# converted {report.num_converted} attention modules (backend={args.backend})", flush=True)
    compiled = {"calls": 0}  # transformers' get_compiled_call, asked for by generate's auto-compile

    def spy(model):
        real = model.get_compiled_call

        def counted(*a, **kw):
            compiled["calls"] += 1
            return real(*a, **kw)

        model.get_compiled_call = counted

    for model in (native, converted):
        if hasattr(model, "get_compiled_call"):
            spy(model)
    g = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    for n in args.lengths:
        ids = torch.randint(1, cfg.vocab_size, (args.batch, n), device=device, generator=g)
        for cache in caches:
            kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=0, attention_mask=torch.ones_like(ids))
            if cache.startswith("static"):
                kw["cache_implementation"] = "static"
            if cache == "static-eager":
                kw["disable_compile"] = True

            def run(model, **extra):
                with torch.inference_mode():
                    return model.generate(ids, **kw, **extra)

            # the first generation of each keeps its logits, to tell where and why tokens differ
            first = dict(return_dict_in_generate=True, output_logits=True)

            row: Dict[str, Any] = {"seq_len": n, "cache": cache, "new_tokens": args.new_tokens}
            stage = "converted"  # which model an error came from (the converted one runs first)
            try:
                # the first generation of each: the converted one's includes auto's races (a real user's first
                # call at these lengths pays them), both include their warm-up
                t0 = time.perf_counter()
                compiled["calls"] = 0
                routed = dict(callcache.DIRECT), dict(callcache.KERNEL_FAMILY)
                with elsa_surgery.dispatch.record() as log:
                    res_c = run(converted, **first)
                _sync(device)
                # calls of the first generation run through a direct route (a replayed plan or SDPA), of which
                # through a kernel family's route (a decode step of a growing cache replaying an earlier step's plan)
                row["routes"] = {"direct": callcache.DIRECT["runs"] - routed[0]["runs"],
                                 "kernel_family": callcache.KERNEL_FAMILY["runs"] - routed[1]["runs"]}
                t1 = time.perf_counter()
                stage = "native"
                res_n = run(native, **first)
                stage = "timed rounds"
                _sync(device)
                row["converted_first_s"], row["native_first_s"] = t1 - t0, time.perf_counter() - t1
                row["decode_compiled"] = compiled["calls"] > 0
                out_c, out_n = res_c.sequences, res_n.sequences
                row["tokens_identical"] = bool(torch.equal(out_c, out_n))
                row["tokens_agree"] = float((out_c[:, n:] == out_n[:, n:]).float().mean())
                row["divergence"] = first_divergence(out_c, out_n, res_c.logits, res_n.logits, n,
                                                     next(native.parameters()).dtype)
                del res_c, res_n
                row["backends_used"] = sorted({d.backend + (f"/{d.precision}" if d.precision else "") for d in log})
                # auto's reasons (its race's two timings where it raced), each distinct one with its call count
                reasons: Dict[str, int] = {}
                for d in log:
                    key = f"{d.backend}: {d.reason}"
                    reasons[key] = reasons.get(key, 0) + 1
                row["dispatch_reasons"] = reasons
                times: Dict[str, List[float]] = {"native": [], "converted": []}
                for _ in range(args.iters):
                    for name, model in (("native", native), ("converted", converted)):
                        _sync(device)
                        t0 = time.perf_counter()
                        run(model)
                        _sync(device)
                        times[name].append(time.perf_counter() - t0)
                for name, t in times.items():
                    row[f"{name}_s"] = sorted(t)[len(t) // 2]
                row["ratio"] = row["native_s"] / row["converted_s"]
                row["status"] = "ok"
            except Exception as exc:  # an OOM at one length must not stop the others
                row.update(status="error", error=f"{stage}: {type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            if row["status"] == "ok":
                print(f"generate {n:>6} + {args.new_tokens} {cache:7}: "
                      + ("decode compiled by transformers (its auto-compile of a static cache, reduce-overhead by "
                         "default; the reasons below cover the eager calls), " if row["decode_compiled"] else "")
                      + f"native {row['native_s']:.3f} s, converted "
                      f"{row['converted_s']:.3f} s, ratio {row['ratio']:.3f}, tokens identical {row['tokens_identical']}"
                      f" ({row['tokens_agree']:.0%} agree), {','.join(row['backends_used'])}; first generation "
                      f"(warm-up, races) native {row['native_first_s']:.3f} s, converted "
                      f"{row['converted_first_s']:.3f} s", flush=True)
                if not row["tokens_identical"]:
                    print(f"#   tokens: {_divergence_text(row['divergence'])}", flush=True)
                for reason, calls in row["dispatch_reasons"].items():
                    print(f"#   {calls} call(s): {reason[:300]}", flush=True)
                print(f"#   first generation: {row['routes']['direct']} call(s) through direct routes, "
                      f"{row['routes']['kernel_family']} of them through a kernel family's (callcache)", flush=True)
            else:
                print(f"generate {n:>6} {cache}: {row['error']}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    args.lengths = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU (use --device cpu --shape tiny for a smoke test)", file=sys.stderr)
        return 2
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    import elsa_surgery  # noqa: F401  (registers the transformers attention functions)
    import transformers

    info: Dict[str, Any] = {
        "recipe": "llama_long_context", "argv": sys.argv[1:], "shape": args.shape, "layers": args.layers,
        "dtype": args.dtype, "offload": args.offload, "batch": args.batch, "sdpa_backend": args.sdpa_backend,
        "precision": args.precision, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_mem_gib"] = props.total_memory / 2**30
        if args.memory_gib:
            frac = min(1.0, args.memory_gib * 2**30 / props.total_memory)
            torch.cuda.set_per_process_memory_fraction(frac, device)
            info["memory_cap_gib"] = args.memory_gib
    print(f"# {json.dumps(info)}", flush=True)
    if args.generate:
        rows = generate_ab(args, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"info": info, "generate": rows}, f, indent=2)
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    t0 = time.perf_counter()
    model, cfg = build_model(args, device)
    info["build_s"] = time.perf_counter() - t0
    info["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6

    results: List[Dict[str, Any]] = []
    if args.check_parity and "elsa" in impls and "sdpa" in impls:
        info["parity"] = parity(model, min(args.check_parity, max(args.lengths)), args, device)
        print(f"# parity {json.dumps(info['parity'])}", flush=True)

    stopped = {impl: None for impl in impls}
    header = f"{'impl':6} {'tokens':>7} {'status':>6} {'latency s':>10} {'tokens/s':>10} {'peak GiB':>9}"
    print(header, flush=True)
    for n in args.lengths:
        for impl in impls:
            if stopped[impl] is not None:
                r = {"impl": impl, "seq_len": n, "status": "skipped", "error": stopped[impl]}
            else:
                try:
                    extra = set_impl(model, impl, args)
                except Exception as exc:
                    r = {"impl": impl, "seq_len": n, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
                else:
                    r = measure(model, impl, n, args, device)
                    r.update(extra)
                if r.get("status") == "ok" and r["latency_s"] > args.max_seconds:
                    stopped[impl] = f"a shorter length took {r['latency_s']:.0f} s > --max-seconds"
            results.append(r)
            lat = f"{r['latency_s']:.3f}" if "latency_s" in r else "-"
            tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"
            mem = f"{r['peak_mem_gib']:.2f}" if "peak_mem_gib" in r else "-"
            print(f"{impl:6} {n:>7} {r['status']:>6} {lat:>10} {tps:>10} {mem:>9}"
                  + (f"  {r.get('error', '')}" if r["status"] != "ok" else ""), flush=True)

    # ratios ELSA / SDPA per length
    ratios = []
    for n in args.lengths:
        e = next((r for r in results if r["impl"] == "elsa" and r["seq_len"] == n), None)
        s = next((r for r in results if r["impl"] == "sdpa" and r["seq_len"] == n), None)
        if e and s:
            row = {"seq_len": n, "elsa": e["status"], "sdpa": s["status"]}
            if e["status"] == s["status"] == "ok":
                row["speedup_tokens_per_s"] = e["tokens_per_s"] / s["tokens_per_s"]
                if "peak_mem_gib" in e and "peak_mem_gib" in s:
                    row["memory_ratio"] = e["peak_mem_gib"] / s["peak_mem_gib"]
            ratios.append(row)
    for row in ratios:
        sp = f"{row['speedup_tokens_per_s']:.2f}x" if "speedup_tokens_per_s" in row else f"elsa {row['elsa']} / sdpa {row['sdpa']}"
        print(f"# {row['seq_len']:>7} tokens: ELSA vs SDPA {sp}", flush=True)
    out = {"info": info, "results": results, "ratios": ratios}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
