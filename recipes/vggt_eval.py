"""VGGT's aggregator with ELSA attention: time, peak memory and parity against native SDPA, per frame count.

Model: the real VGGT when the ``vggt`` package is installed **and** ``--checkpoint`` names a local file
(its ``aggregator`` is timed: that is where the frame / global attention lives); otherwise our VGGT-shaped
aggregator (``tests/models/vggt_like.py``) with random weights at VGGT-1B's aggregator shape (dim 1024,
16 heads of 64, 24 frame + 24 global blocks) — attention cost does not depend on the weights.

Inputs: ``S`` frames (``--frames``, default 8, 32, 64, 100, 150) of 392×518 px → 28×37 patches + 5 special
tokens = **1041 tokens per frame**; global attention runs over ``S × 1041`` tokens.

For each frame count and dtype (fp32 and bf16): native (PyTorch SDPA, whatever backend it picks), then
converted (``elsa_surgery.convert``; fp32 in each ``--modes`` precision): median time of ``--iters`` runs after
``--warmup``, peak extra memory, and parity of the converted output against the native one (max |Δ|,
max |Δ| / max |ref|). Target (H100): >= 2.0x faster than native fp32 at 100 frames with no more memory.

Writes JSON (``--out``) and, with matplotlib, a PNG (``--plot``).

Examples::

    python recipes/vggt_eval.py --out vggt.json --plot vggt.png             # full grid (long: fp32 native
                                                                            # at 150 frames is minutes)
    python recipes/vggt_eval.py --frames 100 --dtypes fp32 --depth 4        # 4 of 24 block pairs: same ratio
    python recipes/vggt_eval.py --smoke                                     # CPU, seconds
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
from elsa_surgery.adapters.vggt import VGGTAttention  # noqa: E402
from elsa_surgery.benchmark import (  # noqa: E402
    DTYPES, comma_list, env_info, measure_modes, modes_for, output_diff, peak_text, plot_time_memory, write_json,
)


def last_tensor(out):
    """The aggregator's last returned tensor (VGGT returns (list, patch_start_idx); ours returns a list)."""
    while isinstance(out, (tuple, list)):
        out = out[0] if (isinstance(out, tuple) and isinstance(out[0], list)) else out[-1]
    return out


def build(args, device):
    """(aggregator, name, adapters to convert with)."""
    if args.checkpoint:
        try:
            from vggt.models.vggt import VGGT
        except ImportError:
            print("WARNING: --checkpoint given but the vggt package is not installed: using the VGGT-shaped "
                  "aggregator with random weights", file=sys.stderr)
        else:
            model = VGGT()
            state = torch.load(args.checkpoint, map_location="cpu")
            model.load_state_dict(state.get("model", state) if isinstance(state, dict) else state)
            return model.aggregator.to(device).eval(), "vggt (checkpoint)", None
    from tests.models import vggt_like

    agg = vggt_like.Aggregator(dim=args.dim, depth=args.depth, num_heads=args.heads,
                               keep_layers=[args.depth - 1]).to(device).eval()
    name = "test.vggt_like"
    if name not in elsa_surgery.list_adapters():
        elsa_surgery.register_adapter(VGGTAttention(name=name, classes=(vggt_like.Attention,)))
    return agg, f"vggt_like (random weights, dim {args.dim}, depth {args.depth}, heads {args.heads})", [name]


def run(args):
    device = torch.device(args.device)
    model, model_name, adapters = build(args, device)
    rows = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        model.to(dtype)
        for S in args.frames:
            gen = torch.Generator().manual_seed(S)
            images = torch.rand(1, S, 3, args.height, args.width, generator=gen).to(device, dtype)
            tokens = 5 + (args.height // 14) * (args.width // 14)
            ref = {}

            def parity(row, out):
                y = last_tensor(out).float()
                if row["mode"] == "native":
                    ref["y"] = y
                else:
                    row.update(output_diff(y, ref.get("y")))

            rows += measure_modes(model, lambda: model(images), modes_for(dname, args.modes), device, args.warmup,
                                  args.iters, {"frames": S, "tokens_per_frame": tokens, "global_tokens": S * tokens,
                                               "dtype": dname},
                                  backend=args.backend, adapters=adapters, on_output=parity,
                                  show=lambda row: print(fmt(row), flush=True))
            del ref, images
    return model_name, rows


def fmt(r):
    head = f"S={r['frames']:4d} ({r['global_tokens']:6d} tok) {r['dtype']:4s} {r['mode']:13s}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    s = f"{head} {r['ms']:11.2f} ms  peak {peak_text(r['peak_mib'], 10)} (requested {peak_text(r['peak_requested_mib'], 10)}, reserved {peak_text(r['peak_reserved_mib'], 10)})"
    if "speedup_vs_native" in r:
        s += f"  x{r['speedup_vs_native']:.3f} vs native  max|Δ| {r['max_abs_diff']:.2e} (rel {r['rel_diff']:.2e})"
    return s


def plot(result, path):
    plot_time_memory(result["rows"], path, "frames",
                     dict(xlabel="frames S (x1041 tokens)", ylabel="s / forward", title="VGGT aggregator time"),
                     dict(xlabel="frames S", ylabel="peak extra GiB", title="peak memory"),
                     time_scale=1e-3, memory_scale=1 / 1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="local VGGT checkpoint (needs the vggt package)")
    p.add_argument("--frames", default="8,32,64,100,150")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="precise", help="fp32 precision modes (comma list of strict,precise,turbo)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--height", type=int, default=392)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--depth", type=int, default=24, help="frame+global block pairs (VGGT: 24)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: dim 128, depth 1, 42x56 px, 2-3 frames")
    args = p.parse_args(argv)
    if args.smoke:
        args.dim, args.heads, args.depth, args.height, args.width = 128, 2, 1, 42, 56
        args.frames, args.warmup, args.iters = "2,3", 0, 1
        if args.device == "cpu":
            args.dtypes, args.modes = "fp32", "strict"
    args.frames = comma_list(p, "--frames", args.frames, type=int)
    args.dtypes = comma_list(p, "--dtypes", args.dtypes, DTYPES, "dtype")
    args.modes = comma_list(p, "--modes", args.modes, elsa_surgery.PRECISIONS, "precision")
    if args.dim % args.heads:
        p.error("--dim must be a multiple of --heads")
    return args


def main(argv=None):
    args = parse_args(argv)
    model_name, rows = run(args)
    result = {"recipe": "vggt_eval", "model": model_name, "env": env_info(args.device), "args": vars(args),
              "rows": rows}
    target = [r for r in rows if r.get("frames") == 100 and r["dtype"] == "fp32" and "speedup_vs_native" in r]
    for r in target:
        # memory is judged on the tensors' requested bytes and on the GPU memory reserved (what has to fit);
        # the allocated figure, printed too, also counts the allocator's block rounding, which depends on the
        # cache history (benchmark.PeakMemory)
        fast = r["speedup_vs_native"] >= 2.0
        mem, res, alloc = (r.get(k) for k in ("requested_memory_vs_native", "reserved_memory_vs_native",
                                              "memory_vs_native"))
        lean = mem is not None and res is not None and mem <= 1.0 and res <= 1.0
        mem_text = "not measured" if mem is None else f"{mem:.6f}x native requested"
        more_text = ("" if res is None else f", {res:.6f}x reserved") + ("" if alloc is None else f", {alloc:.6f}x allocated")
        print(f"target (100 frames fp32, >= 2.0x, memory <= native) {r['mode']}: "
              f"{'MET' if fast and lean else 'NOT MET'} (speed {r['speedup_vs_native']:.3f}x: "
              f"{'met' if fast else 'not met'}; memory {mem_text}{more_text}: {'met' if lean else 'not met'})")
    if args.out:
        write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
