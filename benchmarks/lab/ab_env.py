"""Lab: Is one value of a kernel knob faster than another, kernel against kernel in one process (e.g. ELSA_HOPPER_LAZY)?
Answered in docs/perf/history.md, section "Version 17". A one-off investigation, not a recipe.

A/B of an environment knob of the kernels, kernel against kernel: each value of the variable and SDPA's
baseline (cuDNN for fp16/bf16, memory-efficient for fp32) timed from CUDA-graph replays, in interleaved rounds in
one process, on the same inputs.

    python benchmarks/lab/ab_env.py --env ELSA_HOPPER_LAZY --values 1,0                  # bf16 32x128, 4K and 16K
    python benchmarks/lab/ab_env.py --env ELSA_HOPPER_LAZY --values 1,0 --dtypes bf16,fp32-turbo --shapes 8x64,32x128 \\
        --n 1024,4096 --causal 0,1 --rounds 3

Each value's call is captured while the variable holds it (the launcher reads it when planning, so each graph
holds that value's kernel), and its output checked against the float64 reference on one head. Prints, per cell,
the median over rounds of each value's time, its ratio to the baseline, and the ratio of each value to the
first. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes"))
import bench_attention as ba  # noqa: E402

import elsa_surgery  # noqa: E402
from elsa_surgery import benchmark  # noqa: E402


def cell(dname, H, D, N, causal, env, values, rounds, B=1):
    dtype, prec = ba.DTYPES[dname]
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    ref = elsa_surgery.attention(q[:, :1].double(), k[:, :1].double(), v[:, :1].double(), is_causal=causal,
                                 backend="reference")
    graphs, errs = {}, {}
    for value in values:
        with benchmark.environ({env: value}):
            fn = ba.elsa_fn(q, k, v, causal, prec)
            errs[value] = ba.rel(fn()[:, :1], ref)
            graphs[value] = benchmark.cuda_graph(fn)
    base_name = "efficient" if dtype == torch.float32 else "cudnn"
    base = benchmark.cuda_graph(ba.sdpa_fn(base_name, q, k, v, causal))
    times = {value: [] for value in values}
    times[base_name] = []
    for _ in range(rounds):
        for value in values:
            times[value].append(ba.bench(graphs[value]))
        times[base_name].append(ba.bench(base))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    line = f"{dname:>12} B={B} H={H} D={D} N={N} {'causal' if causal else 'full  '} {base_name} {med[base_name]:.4f} ms"
    for value in values:
        line += (f" | {env}={value}: {med[value]:.4f} ({med[base_name] / med[value]:.3f}x {base_name}, "
                 f"{med[values[0]] / med[value]:.3f}x first, err {errs[value]:.1e})")
    print(line, flush=True)
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="the variable to vary")
    ap.add_argument("--values", required=True, help="comma list of its values (the first is the reference)")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--shapes", default="32x128", help="HxD list")
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--causal", default="0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    values = a.values.split(",")
    dnames = a.dtypes.split(",")
    for d in dnames:
        if d not in ba.DTYPES:
            raise SystemExit(f"--dtypes: {d!r} is not one of {', '.join(ba.DTYPES)}")
    shapes = [tuple(int(y) for y in s.split("x")) for s in a.shapes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for (H, D), dname, N, c in itertools.product(shapes, dnames, [int(x) for x in a.n.split(",")],
                                                 [bool(int(x)) for x in a.causal.split(",")]):
        cell(dname, H, D, N, c, a.env, values, a.rounds, B=a.batch)


if __name__ == "__main__":
    main()
