"""Question: which tiles and partition counts make the packed short-query (decode) kernel fastest?

Answered in docs/PERF.md, "Decode path". Sweeps the packed kernel's key tile, warps, stages, and the
partition rule's programs per SM, on decode shapes (GQA, long caches), graph-replayed (kernel time), and prints
the best per shape beside SDPA's fastest backend replayed the same way.

    python benchmarks/lab/decode_tiles.py --dtype bf16 --shapes 1x32x8x128x32768,16x32x8x128x4096
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

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
    a = ap.parse_args(argv)
    dtype = DTYPES[a.dtype]
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    for shape in a.shapes.split(","):
        B, Hq, Hkv, D, nk = (int(x) for x in shape.split("x"))
        q = torch.randn(B, Hq, a.nq, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, Hkv, nk, D, device="cuda", dtype=dtype) for _ in range(2))
        rows = a.nq * Hq // Hkv
        fn = lambda: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True, precision=a.precision)
        default = graph_ms(fn)
        results = []
        keep = occ.DECODE_PROGRAMS_PER_SM, occ.DECODE_PROGRAMS_PER_SM_NARROW
        for bn, w, s, per in itertools.product(*(map(int, x.split(",")) for x in (a.bn, a.warps, a.stages, a.per_sm))):
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
        sdpa = {}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def run(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
            try:
                run()
                sdpa[name] = graph_ms(run)
            except Exception:
                pass
        kv_bytes = 2 * B * Hkv * nk * D * q.element_size()
        print(f"{a.dtype} B={B} {Hq}:{Hkv} D={D} Nk={nk} Nq={a.nq}: default {default * 1e3:.1f} us "
              f"({kv_bytes / default / 1e9:.2f} TB/s); SDPA " + " ".join(f"{n}={t * 1e3:.1f}" for n, t in sdpa.items()))
        for t, bn, w, s, per in results[:6]:
            print(f"   {t * 1e3:7.1f} us  bn={bn} warps={w} stages={s} per_sm={per}", flush=True)


if __name__ == "__main__":
    main()
