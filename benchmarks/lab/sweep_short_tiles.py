"""Lab: Which tiles are fastest at model shapes (ViT/BERT token counts, Swin windows with their mask)?
Answered in docs/perf/history.md, section "Version 16 (and Versions 5-6)". A one-off investigation, not a recipe.

Tile sweep at model shapes (batch 8): ViT/BERT token counts and Swin windows with their per-window mask.

For each shape: SDPA's backends (auto, flash, efficient, cuDNN) and the ELSA kernel under every tile config
of the sweep space, each call captured in a CUDA graph and replayed (``triton.testing.do_bench`` median), so
the numbers are GPU time without Python launch cost. ``default`` is what the tile table picks today. This is
the measurement behind the length buckets of ``kernels/occupancy._TABLE`` (docs/perf/raw/tiles_h200_v5.log).

    python benchmarks/lab/sweep_short_tiles.py --group vit      # bf16 ViT token counts, D=64
    python benchmarks/lab/sweep_short_tiles.py --group swin     # bf16 Swin windows (49, 144 tokens) with masks
    python benchmarks/lab/sweep_short_tiles.py --group fp32     # fp32 precise/turbo/strict, ViT and Swin shapes
    python benchmarks/lab/sweep_short_tiles.py --group n1k      # bench_attention's N=1K cells (B=1), causal and not
    python benchmarks/lab/sweep_short_tiles.py --group vit-hopper   # ViT token counts on the Hopper (Gluon) kernel's tiles

``vit-hopper`` times the Gluon kernel (``kernels/hopper.py``) under each of its tile configurations
(``ELSA_HOPPER_TILES``), and the portable kernel's default (``ELSA_HOPPER=0``), at the ViT shapes, fp16/bf16.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import occupancy as occ

T0 = time.time()
DEFAULT_ONLY = False


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(benchmark.cuda_graph(fn, warmup=2), warmup=5, rep=30, return_mode="median")


def qkv(B, N, H, D, dtype):
    """q, k, v as the strided views a fused qkv projection gives (timm's layout)."""
    t = torch.randn(B, N, 3, H, D, device="cuda", dtype=dtype)
    return t.permute(2, 0, 3, 1, 4).unbind(0)


def sdpa_times(q, k, v, mask, causal=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    res = {"auto": bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal))}
    for name, be in backends.items():
        def run(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        try:
            res[name] = bench(run)
        except RuntimeError:  # backend refuses the case (flash with a mask, cuDNN with fp32, ...)
            res[name] = None
    return res


def sweep(tag, q, k, v, mask, windowed, precision, cfgs, best_sdpa, causal=False):
    rows = []
    for cfg in [None] + ([] if DEFAULT_ONLY else cfgs):
        occ.set_config_override(cfg)
        try:
            ms = bench(lambda: elsa_surgery.attention(q, k, v, attn_mask=mask, windowed_mask=windowed,
                                                      is_causal=causal, backend="elsa", precision=precision))
            rows.append((ms, "default" if cfg is None else (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)))
        except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"   {tag} {cfg}: failed ({str(exc).splitlines()[0][:90]})", flush=True)
        finally:
            occ.set_config_override(None)
    report(tag, rows, best_sdpa)


def report(tag, rows, best_sdpa):
    """One line per shape: the default's time (``rows[0]``), the best, and every ``(ms, name)`` row sorted."""
    default = rows[0][0]
    rows = sorted(rows, key=lambda r: r[0])
    listing = " ".join(f"{name}={ms:.4f}" for ms, name in rows)
    print(f"{tag}: default {default:.4f} ms (x{best_sdpa / default:.3f} best SDPA) | best {rows[0][0]:.4f} "
          f"(x{best_sdpa / rows[0][0]:.3f}) | {listing}  [{time.time() - T0:.0f}s]", flush=True)


def header(tag, times):
    print(f"{tag} SDPA " + " ".join(f"{n}={t:.4f}" if t else f"{n}=NA" for n, t in times.items()), flush=True)
    return min(t for t in times.values() if t)


def window_mask(BW, nW, H, N, dtype):
    """Swin's per-window additive mask [nW, H, N, N] (bias + shift mask) and native's expanded [B*nW, H, N, N]."""
    bias = torch.randn(1, H, N, N, device="cuda")
    shift = torch.where(torch.rand(nW, 1, N, N, device="cuda") < 0.3, -100.0, 0.0)
    wmask = (bias + shift).to(dtype)
    return wmask, wmask.repeat(BW // nW, 1, 1, 1)


LOWP = [occ.TileConfig(*c) for c in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])]
LOWP += [occ.TileConfig(*c) for c in [(32, 32, 4, 2), (32, 64, 4, 2), (32, 32, 2, 2), (64, 16, 4, 3)]]
TC32 = [occ.TileConfig(*c) for c in [(64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2),
                                     (128, 32, 8, 2), (32, 32, 2, 2), (128, 64, 4, 2)]]
IEEE = [occ.TileConfig(*c) for c in [(64, 64, 4, 1), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1),
                                     (32, 32, 2, 2), (64, 64, 8, 2)]]
N1K_LOWP = [occ.TileConfig(*c) for c in [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                                         (64, 64, 4, 2), (64, 128, 4, 3), (32, 64, 4, 2), (128, 32, 4, 3)]]
HOPPER_LOWP = [(64, 64, 2, 4), (64, 128, 2, 4), (128, 64, 2, 8), (128, 128, 2, 8), (64, 128, 3, 4)]
# where 64-row tiles stop paying: longer keys at D = 64 (bench_attention's B = 1 cells among them), and D = 128
HOPPER_LONGER = [(8, 12, 2048, 64), (2, 12, 2048, 64), (1, 8, 2048, 64), (8, 12, 3072, 64), (1, 8, 4096, 64),
                 (4, 8, 4096, 64), (1, 8, 8192, 64), (8, 16, 577, 128), (8, 16, 1025, 128), (1, 32, 2048, 128)]


def hopper_sweep(tag, q, k, v, best_sdpa, causal=False):
    """The Gluon kernel under its default tiles and each of ``HOPPER_LOWP``, and the portable kernel's default."""
    from elsa_surgery.kernels import hopper

    rows = []
    for name, env in [("default", {}), ("portable", {hopper.ENV: "0"})] + [
            (c, {hopper.ENV_TILES: ",".join(map(str, c))}) for c in HOPPER_LOWP]:
        try:
            with benchmark.environ(env):
                ms = bench(lambda: elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa"))
            rows.append((ms, name))
        except Exception as exc:  # a tile that does not fit is reported, not fatal
            print(f"   {tag} {name}: failed ({str(exc).splitlines()[0][:90]})", flush=True)
    report(tag, rows, best_sdpa)


VIT = [(8, 12, 197), (8, 16, 257), (8, 12, 325), (8, 12, 442), (8, 16, 577), (8, 12, 785), (8, 12, 901),
       (8, 16, 1025), (8, 12, 1226), (8, 16, 1601)]
SWIN = [(512, 64, 3, 49), (128, 16, 6, 49), (32, 4, 12, 49), (512, 64, 3, 144), (128, 16, 12, 144)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=["vit", "swin", "fp32", "n1k", "vit-hopper"], required=True)
    ap.add_argument("--default-only", action="store_true", help="time only the table's own tile (no sweep)")
    a = ap.parse_args(argv)
    global DEFAULT_ONLY
    DEFAULT_ONLY = a.default_only
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    if a.group == "vit":
        for B, H, N in VIT:
            q, k, v = qkv(B, N, H, 64, torch.bfloat16)
            best = header(f"ViT bf16 B={B} H={H} N={N} D=64", sdpa_times(q, k, v, None))
            sweep(f"  ELSA bf16 N={N}", q, k, v, None, False, None, LOWP, best)
    elif a.group == "vit-hopper":
        shapes = [(B, H, N, 64) for B, H, N in VIT + [(32, 12, 197), (1, 12, 197)]] + HOPPER_LONGER
        for (B, H, N, D), (name, dtype) in itertools.product(shapes, [("bf16", torch.bfloat16)]):
            q, k, v = qkv(B, N, H, D, dtype)
            best = header(f"ViT {name} B={B} H={H} N={N} D={D}", sdpa_times(q, k, v, None))
            hopper_sweep(f"  ELSA-Gluon {name} B={B} H={H} N={N} D={D}", q, k, v, best)
    elif a.group == "swin":
        for BW, nW, H, N in SWIN:
            q, k, v = qkv(BW, N, H, 32, torch.bfloat16)
            wmask, full = window_mask(BW, nW, H, N, torch.bfloat16)
            best = header(f"Swin bf16 B*nW={BW} H={H} N={N} D=32", sdpa_times(q, k, v, full))
            sweep(f"  ELSA bf16 window N={N} H={H}", q, k, v, wmask, True, None, LOWP, best)
    elif a.group == "n1k":
        for (H, D), causal in itertools.product([(8, 64), (32, 128)], [False, True]):
            for name, dtype, precs in [("bf16", torch.bfloat16, [None]), ("fp16", torch.float16, [None]),
                                       ("fp32", torch.float32, ["precise", "turbo", "strict"])]:
                q, k, v = (torch.randn(1, H, 1024, D, device="cuda", dtype=dtype) for _ in range(3))
                best = header(f"N=1K {name} H={H} D={D} causal={int(causal)}", sdpa_times(q, k, v, None, causal))
                for prec in precs:
                    cfgs = N1K_LOWP if prec is None else IEEE if prec == "strict" else TC32
                    sweep(f"  ELSA {name}{'-' + prec if prec else ''} H={H} D={D} causal={int(causal)}", q, k, v,
                          None, False, prec, cfgs, best, causal)
    else:
        for B, H, N in VIT[:5]:
            q, k, v = qkv(B, N, H, 64, torch.float32)
            best = header(f"ViT fp32 B={B} H={H} N={N} D=64", sdpa_times(q, k, v, None))
            for prec in ("precise", "turbo", "strict"):
                sweep(f"  ELSA fp32-{prec} N={N}", q, k, v, None, False, prec, IEEE if prec == "strict" else TC32, best)
        for BW, nW, H, N in SWIN[:1] + SWIN[3:4]:
            q, k, v = qkv(BW, N, H, 32, torch.float32)
            wmask, full = window_mask(BW, nW, H, N, torch.float32)
            best = header(f"Swin fp32 B*nW={BW} H={H} N={N} D=32", sdpa_times(q, k, v, full))
            for prec in ("precise", "turbo", "strict"):
                sweep(f"  ELSA fp32-{prec} window N={N}", q, k, v, wmask, True, prec,
                      IEEE if prec == "strict" else TC32, best)
    print(f"done {time.time() - T0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
