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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import elsa_surgery  # noqa: E402
from elsa_surgery.benchmark import (  # noqa: E402
    comma_list, env_info, measure_modes, modes_for, output_diff, peak_text, write_json,
)


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
            ref = {}

            def parity(row, out):
                row["images_per_s"] = batch / (row["ms"] / 1e3)
                latent = out[0].float()
                if row["mode"] == "native":
                    ref["latent"] = latent
                else:
                    row.update(output_diff(latent, ref.get("latent")))

            rows += measure_modes(model, lambda: model(x), modes_for("fp32", args.modes), device, args.warmup,
                                  args.iters, {"shape": f"HSIMAE-{shape}", "batch": batch, "dtype": "fp32"},
                                  backend=args.backend, on_output=parity, show=lambda row: print(fmt(row), flush=True))
            del ref, x
        del model
    return rows


def fmt(r):
    head = f"{r['shape']:9s} batch {r['batch']:6d} {r['mode']:13s}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    s = f"{head} {r['ms']:9.3f} ms  {r['images_per_s']:12.0f} img/s  peak {peak_text(r['peak_mib'])}"
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

    args.shapes = comma_list(p, "--shapes", args.shapes, SHAPES, "shape")
    args.batch = comma_list(p, "--batch", args.batch, type=int)
    args.modes = comma_list(p, "--modes", args.modes, elsa_surgery.PRECISIONS, "precision")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = run(args)
    for r in rows:
        if "speedup_vs_native" in r:
            verdict = "not slower: MET" if r["speedup_vs_native"] >= 1.0 else "SLOWER than native"
            print(f"target {r['shape']} batch {r['batch']} {r['mode']}: x{r['speedup_vs_native']:.3f} ({verdict})")
    result = {"recipe": "hsimae_bench", "env": env_info(args.device), "args": vars(args), "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
