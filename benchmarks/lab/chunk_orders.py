"""Lab: Do causal fp32 tensor-core calls at N = 16K run faster with their key chunks in reverse order, staged in the output?
Answered in docs/perf/history.md, section "Version 9". A one-off investigation, not a recipe.

Causal fp32 tensor-core calls (``precise``, ``turbo``) at N=16K: key chunks in reverse order staged in the
output (v9, the default), key chunks in key order (v8's plan: the reverse plan turned off), and V/K staged whole
(no memory bound), timed in one run against ME-SDPA fp32.

    python benchmarks/lab/chunk_orders.py           # B=1, (H=8, D=64) and (H=32, D=128), N=16K, causal
    python benchmarks/lab/chunk_orders.py --host    # also: host time per call without syncs, eager and graph-replayed

Needs a CUDA GPU. docs/perf/history.md, "Version 9", has its output on an H100.
"""

import argparse
import os
import warnings

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from elsa_surgery import benchmark
from elsa_surgery.kernels import launch
from elsa_surgery.kernels import occupancy as occ


def bench(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def gbench(fn):
    return bench(benchmark.cuda_graph(fn))


def orders(shapes):
    real_env = occ.reverse_chunks_env
    for H, D, N in shapes:
        q, k, v = (torch.randn(1, H, N, D, device="cuda") for _ in range(3))
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            me = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print(f"H={H} D={D} N={N} causal: ME fp32 {me:.3f} ms", flush=True)
        for mode in ("precise", "turbo"):
            for tag, how in (("v9 reverse", None), ("v8 key order", lambda: None), ("whole", "whole")):
                os.environ.pop(occ.ENV_STAGE_PLAN, None)
                occ.reverse_chunks_env = real_env
                if how == "whole":
                    os.environ[occ.ENV_STAGE_PLAN] = "whole"
                elif how is not None:
                    occ.reverse_chunks_env = how
                fn = lambda: launch.attention(q, k, v, scale=D ** -0.5, precision=mode, is_causal=True,
                                              return_lse=False)
                fn()
                torch.cuda.synchronize()
                ms, gms = bench(fn), gbench(fn)
                print(f"  {mode:8s} {tag:14s} {ms:7.3f} ms x{me / ms:5.2f} | graph {gms:7.3f} x{me / gms:5.2f}",
                      flush=True)
        occ.reverse_chunks_env = real_env
        os.environ.pop(occ.ENV_STAGE_PLAN, None)


def host(cases):
    for mode, H, D, N, causal in cases:
        q, k, v = (torch.randn(1, H, N, D, device="cuda") for _ in range(3))
        fn = lambda: launch.attention(q, k, v, scale=D ** -0.5, precision=mode, is_causal=causal, return_lse=False)
        ms = bench(fn)
        g = gbench(fn)
        print(f"{mode} N={N} causal={causal}: host {benchmark.per_call_ms(fn, 20 if N > 8192 else 200, host_only=True) * 1e3:8.1f} us/call, "
              f"eager {ms * 1e3:8.1f} us, graph {g * 1e3:8.1f} us", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="also the host-cost table (precise, H=8, D=64)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    orders([(8, 64, 16384), (32, 128, 16384)])
    if a.host:
        host([("precise", 8, 64, 16384, False), ("precise", 8, 64, 16384, True), ("precise", 8, 64, 4096, True)])


if __name__ == "__main__":
    main()
