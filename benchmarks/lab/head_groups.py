"""Causal launches' head groups, evened out (``occupancy.even_groups``, session 45) against the groups as the rule
gave them before (a short last group), A/B interleaved in one process: forward alone and forward + backward, kernel
time (``benchmark.kernel_ms``) and wall time (``triton.testing.do_bench``), for fp32 precise/turbo and bf16 at
shapes where the groups change and where they do not.

    python benchmarks/lab/head_groups.py [--rounds 3]

Launch plans are cleared at each switch (a plan keeps the scalars it recorded, the head group among them). Needs a
CUDA GPU.
"""

import argparse
import statistics

import torch
import triton

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import occupancy, replay

CASES = [  # (dtype, precision, B, H, N, D)
    ("fp32", "turbo", 1, 16, 4096, 64), ("fp32", "precise", 1, 16, 4096, 64), ("fp32", "precise", 1, 16, 4096, 128),
    ("fp32", "turbo", 1, 16, 16384, 64), ("bf16", None, 1, 16, 4096, 64), ("bf16", None, 1, 16, 4096, 128),
    ("bf16", None, 1, 32, 16384, 128), ("bf16", None, 2, 12, 2048, 64), ("fp32", "precise", 1, 32, 8192, 128),
]
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    even = occupancy.even_groups
    for dt, prec, B, H, N, D in CASES:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DT[dt], requires_grad=True) for _ in range(3))
        go = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                return elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa", precision=prec)

        def step():
            out = elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa", precision=prec)
            return torch.autograd.grad(out, (q, k, v), go)

        res = {side: {"fwd": [], "step": [], "fwd_k": [], "step_k": []} for side in ("before", "even")}
        outs = {}
        for _ in range(a.rounds):
            for side in ("before", "even"):
                occupancy.even_groups = even if side == "even" else (lambda bh, group: group)
                replay.clear()
                outs[side] = (fwd(), step())
                for name, fn in (("fwd", fwd), ("step", step)):
                    res[side][name].append(triton.testing.do_bench(fn, warmup=5, rep=40))
                    res[side][name + "_k"].append(benchmark.kernel_ms(fn))
        occupancy.even_groups = even
        same = torch.equal(outs["before"][0], outs["even"][0]) and all(
            torch.equal(x, y) for x, y in zip(outs["before"][1], outs["even"][1]))
        med = {s: {n: statistics.median(t) for n, t in r.items()} for s, r in res.items()}
        b, e = med["before"], med["even"]
        print(f"{dt} {prec or ''} B={B} H={H} N={N} D={D} causal: forward {b['fwd']:.3f} -> {e['fwd']:.3f} ms "
              f"(kernels {b['fwd_k']:.3f} -> {e['fwd_k']:.3f}), forward + backward {b['step']:.3f} -> "
              f"{e['step']:.3f} ms (kernels {b['step_k']:.3f} -> {e['step_k']:.3f}); bitwise equal: {same}",
              flush=True)


if __name__ == "__main__":
    main()
