"""Question: how accurate is each fp32 mode against float64 as the key count grows, and what does it cost?

Answered in docs/PERF.md, "strict accuracy". For n keys (B=1, H heads, D=64, Gaussian q/k/v), the relative L2
error of ELSA strict / precise / turbo and of SDPA's memory-efficient kernel against a float64 reference, on
``--rows`` sampled query rows over all keys; then the time of one full call per mode (graph-replayed, median).

    python benchmarks/lab/strict_accuracy.py --n 1024,8192,16384,65536
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def ms(fn):
    import triton.testing

    return triton.testing.do_bench(benchmark.cuda_graph(fn), warmup=25, rep=100, return_mode="median")


@contextlib.contextmanager
def uncompensated():
    """The Hopper strict kernel with blocked summation alone (no Kahan term), launch plans cleared around it."""
    from elsa_surgery.kernels import hopper, replay

    keep = hopper.STRICT_COMPENSATED
    hopper.STRICT_COMPENSATED = False
    replay.clear()
    try:
        yield
    finally:
        hopper.STRICT_COMPENSATED = keep
        replay.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1024,8192,16384,65536")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--time-n", default="4096,16384", help="lengths timed (B=1, H=8, D=64)")
    a = ap.parse_args(argv)
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in map(int, a.n.split(",")):
        q, k, v = (torch.randn(1, a.heads, n, 64, device="cuda", generator=g) for _ in range(3))
        rows = torch.randperm(n, device="cuda", generator=g)[:a.rows]
        ref = F.scaled_dot_product_attention(q[:, :, rows].double(), k.double(), v.double())
        errs = {}
        for mode in ("strict", "precise", "turbo"):
            errs[mode] = rel(elsa_surgery.attention(q, k, v, backend="elsa", precision=mode)[:, :, rows], ref)
        with uncompensated():
            errs["strict_blocked"] = rel(elsa_surgery.attention(q, k, v, backend="elsa", precision="strict")[:, :, rows], ref)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            errs["me_sdpa"] = rel(F.scaled_dot_product_attention(q, k, v)[:, :, rows], ref)
        print(f"n={n:6d} " + " ".join(f"{m}={e:.2e}" for m, e in errs.items()), flush=True)
    for n in map(int, a.time_n.split(",")):
        q, k, v = (torch.randn(1, 8, n, 64, device="cuda", generator=g) for _ in range(3))
        flops = 4 * 8 * n * n * 64
        for mode in ("strict", "precise"):
            t = ms(lambda: elsa_surgery.attention(q, k, v, backend="elsa", precision=mode))
            print(f"time n={n} {mode}: {t:.3f} ms ({flops / t / 1e9:.1f} TFLOP/s)", flush=True)
        with uncompensated():
            t = ms(lambda: elsa_surgery.attention(q, k, v, backend="elsa", precision="strict"))
            print(f"time n={n} strict_blocked: {t:.3f} ms ({flops / t / 1e9:.1f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
