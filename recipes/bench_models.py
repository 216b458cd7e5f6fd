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

Examples::

    python recipes/bench_models.py --out bench_models.json                      # everything, eager + cudagraph
    python recipes/bench_models.py --models vit_l14_clip --sizes 336 --dtypes fp32 --modes eager,cudagraph,compile
    python recipes/bench_models.py --models swin_t --dtypes bf16 --batch 16
    python recipes/bench_models.py --list
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="run the flow on the CPU (eager only, wall-clock timing of 3 calls, no memory numbers): "
                        "a check of this script, not a measurement")
    a = p.parse_args(argv)
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
    records = []
    for n, s, d, m in todo:
        t0 = time.perf_counter()
        rec = bench_one(n, s, d, m, args)
        rec["wall_s"] = time.perf_counter() - t0
        records.append(rec)
        brief = rec.get("error") or (f"native {rec['native_ms']:.3f} ms, elsa {rec['elsa_ms']:.3f} ms, "
                                     f"{rec['speedup']:.3f}x, mem {rec['native_peak_mb']:.0f} -> {rec['elsa_peak_mb']:.0f} MiB")
        print(f"{n} {s}px {d} {m}: {brief} ({rec['wall_s']:.0f} s)", flush=True)
        if args.out:  # written after every configuration: a cut-off run keeps what it measured
            benchmark.write_json(args.out, dict(env=env, records=records), announce=False)
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
