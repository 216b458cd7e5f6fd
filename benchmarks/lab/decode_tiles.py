"""Question: which tiles and partition counts make the packed short-query (decode) kernel fastest?

Answered in docs/PERF.md, "Decode path". Sweeps the packed kernel's key tile, warps, stages, and the
partition rule's programs per SM, on decode shapes (GQA, long caches), graph-replayed (kernel time), and prints
the best per shape beside SDPA's fastest backend replayed the same way.

    python benchmarks/lab/decode_tiles.py --dtype bf16 --shapes 1x32x8x128x32768,16x32x8x128x4096
    python benchmarks/lab/decode_tiles.py --shapes 16x32x8x64x4096 --configs none --partitions 1,2,3 --eager
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import torch

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import launch, occupancy as occ

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def graph_ms(fn):
    import triton.testing

    return triton.testing.do_bench(benchmark.cuda_graph(fn), warmup=25, rep=100, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--precision", default=None)
    ap.add_argument("--shapes", default="1x32x8x128x32768", help="BxHqxHkvxDxNk list (one query)")
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--bn", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--per-sm", default="2,4,8")
    ap.add_argument("--configs", default=None,
                    help="explicit BN:WARPS:STAGES list (e.g. 64:4:2,128:4:3) instead of --bn x --warps x --stages; "
                         "none: no sweep")
    ap.add_argument("--grid", action="store_true",
                    help="the decode grid's 1-query shapes: B 1, 16 x GQA 32:4, 32:8, MHA x D 64, 128 x keys 4K-128K")
    ap.add_argument("--partitions", default=None,
                    help="also time the rule's tiles at these forced partition counts (ELSA_NUM_PARTITIONS), e.g. 1,2,4")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--eager", action="store_true",
                    help="also eager calls (host included): the rule's tiles and each SDPA backend in interleaved "
                         "rounds (benchmark.interleaved_ms)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA's "kernel not used" for refused backends
    dtype = DTYPES[a.dtype]
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    if a.configs == "none":  # the rule's own tiles only (an old/new comparison across processes)
        tiles = []
    elif a.configs:
        tiles = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")]
    else:
        tiles = list(itertools.product(*(list(map(int, x.split(","))) for x in (a.bn, a.warps, a.stages))))
    shapes = a.shapes.split(",")
    if a.grid:
        shapes = [f"{b}x32x{hk}x{d}x{nk}" for b in (1, 16) for hk in (4, 8, 32) for d in (64, 128)
                  for nk in (4096, 32768, 131072)]
    for shape in shapes:
        B, Hq, Hkv, D, nk = (int(x) for x in shape.split("x"))
        q = torch.randn(B, Hq, a.nq, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, Hkv, nk, D, device="cuda", dtype=dtype) for _ in range(2))
        rows = a.nq * Hq // Hkv
        fn = lambda: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True, precision=a.precision)
        default = graph_ms(fn)
        results = []
        keep = occ.DECODE_PROGRAMS_PER_SM, occ.DECODE_PROGRAMS_PER_SM_NARROW
        for (bn, w, s), per in itertools.product(tiles, map(int, a.per_sm.split(","))):
            occ.set_config_override(occ.TileConfig(min(occ.DECODE_MAX_ROWS, max(16, occ.next_pow2(rows))), bn, w, s))
            occ.DECODE_PROGRAMS_PER_SM = occ.DECODE_PROGRAMS_PER_SM_NARROW = per
            launch.replay.clear()
            try:
                results.append((graph_ms(fn), bn, w, s, per))
            except Exception as exc:  # a tile that does not fit
                print(f"  bn={bn} w={w} s={s} per_sm={per}: {str(exc).splitlines()[0][:100]}")
            finally:
                occ.set_config_override(None)
                occ.DECODE_PROGRAMS_PER_SM, occ.DECODE_PROGRAMS_PER_SM_NARROW = keep
                launch.replay.clear()
        results.sort()
        for parts in (a.partitions.split(",") if a.partitions else ()):
            launch.replay.clear()
            with benchmark.environ({"ELSA_NUM_PARTITIONS": parts}):
                t = graph_ms(fn)
                extra = ""
                if a.eager:
                    extra = f", eager {benchmark.interleaved_ms({'elsa': fn}, rounds=3, calls=20)['elsa'] * 1e3:.1f} us"
            launch.replay.clear()
            print(f"   {t * 1e3:7.1f} us  rule's tiles, {parts} partition(s){extra}", flush=True)
        runs = benchmark.sdpa_backends(q, k, v, enable_gqa=Hq != Hkv)[0]
        sdpa = {name: graph_ms(run) for name, run in runs.items()}
        eager = ""
        if a.eager:
            ms = benchmark.interleaved_ms({"elsa": fn, **runs}, rounds=5, calls=20)
            best = min(runs, key=ms.get)
            eager = (f" eager: elsa={ms['elsa'] * 1e3:.1f} {best}={ms[best] * 1e3:.1f} "
                     f"x_eager={ms[best] / ms['elsa']:.3f}")
        kv_bytes = 2 * B * Hkv * nk * D * q.element_size()
        print(f"{a.dtype} B={B} {Hq}:{Hkv} D={D} Nk={nk} Nq={a.nq}: default {default * 1e3:.1f} us "
              f"({kv_bytes / default / 1e9:.2f} TB/s); SDPA " + " ".join(f"{n}={t * 1e3:.1f}" for n, t in sdpa.items()))
        for t, bn, w, s, per in results[:a.top]:
            print(f"   {t * 1e3:7.1f} us  bn={bn} warps={w} stages={s} per_sm={per}", flush=True)
        fastest = min(sdpa.values()) if sdpa else float("nan")
        t, bn, w, s, per = results[0] if results else (default, "-", "-", "-", "-")
        print(f"SUMMARY {shape} default={default * 1e3:.1f} best={t * 1e3:.1f} ({bn}:{w}:{s} per_sm={per}) "
              f"sdpa={fastest * 1e3:.1f} x_default={fastest / default:.3f} x_best={fastest / t:.3f}{eager}", flush=True)


if __name__ == "__main__":
    main()
