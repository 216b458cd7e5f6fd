"""HSIMAE with ELSA attention: images/s and peak memory, native vs converted, HSIMAE-B/L/H shapes, fp32.

Model: our HSIMAE-shaped encoder + decoder (``tests/models/hsimae_like.py``, random weights): 9×9 px × 64-band
patches → 36 tokens (Conv3d spectral-spatial embedding), head_dim 16; B = dim 144 / 9 heads, L = 256 / 16,
H = 512 / 32, depth 12, decoder 72 / 9 heads, depth 1. Its attention is HSIMAE's explicit-softmax one (the
native baseline); the converted model calls the ELSA kernels through the ``hsimae.attention`` adapter.

Per shape and batch size (``--batch``, default 1024 and 4096: HSIMAE classifies whole scenes pixel by
pixel): images/s (median of ``--iters`` after ``--warmup``), peak extra memory and the output parity.
Target: converted not slower than native; report the gain.

Examples::

    python recipes/hsimae_bench.py --out hsimae.json
    python recipes/hsimae_bench.py --shapes B --batch 4096 --modes precise,turbo
    python recipes/hsimae_bench.py --smoke                                   # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import elsa_surgery  # noqa: E402
from elsa_surgery import dispatch  # noqa: E402


def measure(fn, device, warmup, iters):
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, out = [], None
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append((time.perf_counter() - t0) * 1e3)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    return statistics.median(times), peak, out



def dispatch_summary(log) -> dict:
    """What the converted calls ran on: {"backend/precision": calls}, plus distinct fallback reasons."""
    used = Counter(d.backend + (f"/{d.precision}" if d.precision else "") for d in log)
    return {"backends": dict(used), "fallbacks": sorted({d.reason for d in log if d.fallback})}


def run(args):
    from tests.models import hsimae_like

    device = torch.device(args.device)
    rows = []
    for shape in args.shapes:
        torch.manual_seed(0)
        overrides = {"depth": args.depth} if args.depth else {}
        model = hsimae_like.build(shape, **overrides).to(device).eval()
        for batch in args.batch:
            x = torch.rand(batch, 1, 64, 9, 9, device=device)
            ref, native = None, None
            for label, precision in [("native", None)] + [(f"elsa-{m}", m) for m in args.modes]:
                row = {"shape": f"HSIMAE-{shape}", "batch": batch, "mode": label, "dtype": "fp32"}
                try:
                    if precision is not None:
                        rep = elsa_surgery.convert(model, backend=args.backend, precision=precision, verify=False)
                        row["converted_modules"] = rep.num_converted
                    with dispatch.record() as log:
                        ms, peak, out = measure(lambda: model(x), device, args.warmup, args.iters)
                    if label != "native":
                        row.update(dispatch_summary(log))
                    row.update(ms=ms, images_per_s=batch / (ms / 1e3), peak_mib=peak)
                    latent = out[0].float()
                    if label == "native":
                        ref, native = latent, row
                    else:
                        d = (latent - ref).abs().max().item()
                        row.update(speedup_vs_native=native["ms"] / ms, max_abs_diff=d,
                                   rel_diff=d / max(ref.abs().max().item(), 1e-30))
                        if peak is not None and native["peak_mib"]:
                            row["memory_vs_native"] = peak / native["peak_mib"]
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                finally:
                    elsa_surgery.revert(model)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                print(fmt(row), flush=True)
        del model
    return rows


def fmt(r):
    head = f"{r['shape']:9s} batch {r['batch']:6d} {r['mode']:13s}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:9.1f} MiB"
    s = f"{head} {r['ms']:9.3f} ms  {r['images_per_s']:12.0f} img/s  peak {peak}"
    if "speedup_vs_native" in r:
        s += f"  x{r['speedup_vs_native']:.3f} vs native  max|Δ| {r['max_abs_diff']:.2e}"
    return s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="B,L", help="comma list of B, L, H")
    p.add_argument("--batch", default="1024,4096")
    p.add_argument("--modes", default="precise", help="fp32 precision modes (comma list of strict,precise,turbo)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--depth", type=int, default=None, help="override the encoder depth (12)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: HSIMAE-B at depth 2, batch 64")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.batch, args.depth, args.warmup, args.iters = "B", "64", 2, 1, 2
        if args.device == "cpu":
            args.modes = "strict"
    from tests.models.hsimae_like import SHAPES

    args.shapes = [s for s in str(args.shapes).split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown shape {s!r} (choose from {', '.join(SHAPES)})")
    args.batch = [int(b) for b in str(args.batch).split(",") if b]
    args.modes = [m for m in str(args.modes).split(",") if m]
    for m in args.modes:
        if m not in elsa_surgery.PRECISIONS:
            p.error(f"--modes: unknown precision {m!r} (choose from {', '.join(elsa_surgery.PRECISIONS)})")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = run(args)
    env = {"torch": torch.__version__, "device": args.device}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    for r in rows:
        if "speedup_vs_native" in r:
            verdict = "not slower: MET" if r["speedup_vs_native"] >= 1.0 else "SLOWER than native"
            print(f"target {r['shape']} batch {r['batch']} {r['mode']}: x{r['speedup_vs_native']:.3f} ({verdict})")
    result = {"recipe": "hsimae_bench", "env": env, "args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"json: {args.out}")
    return result


if __name__ == "__main__":
    main()
