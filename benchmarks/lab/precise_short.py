"""Question (issue 24's fp32 cells): at the short lengths of vision models (N = 197-1024), which ``precise`` kernel
is fastest? The planner gives the fp16 split (``DOT_F16X3``: three fp16 tensor-core products, K and V split by two
extra launches) only to calls with >= 1,024 query rows per K/V head and >= 2e9 of work (``occupancy.precise_split``,
set when a launch cost ~40 µs of host time, before launch plans); shorter calls run Triton's 3xTF32 dots. At ViT-L/14
336 px (B = 8, H = 16, N = 577) 3xTF32 ran 1.57x ME-SDPA (v5), and ``auto`` took ME-SDPA for DeiT3-S fp32.

For each shape (BxHxNxD): ELSA ``precise`` with ``ELSA_PRECISE_SPLIT`` = ``tf32`` (3xTF32), ``f16`` (full split),
``f16k`` (K split, V in the kernel), and SDPA's efficient kernel (ME-SDPA): eager ms per call (interleaved rounds, the
knob set around each side's calls), graph-replayed ms (``do_bench`` on a CUDA graph), and the relative error vs
float64 (max |err| / max |ref|), and the plan the knob gives (dot kind: 3 = 3xTF32, 5 = split, 6 = K split)::

    python benchmarks/lab/precise_short.py [--shapes 8x12x197x64,...] [--rounds 5] [--calls 20]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import launch

SIDES = {"tf32x3": "tf32", "f16": "f16", "f16k": "f16k"}
SHAPES = "8x12x197x64,8x6x197x64,64x6x197x64,8x16x257x64,8x16x577x64,8x12x577x64,8x16x1024x64,1x32x1024x128"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="BxHxNxD list")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        B, H, N, D = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(B, H, N, D, device="cuda") for _ in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())

        def elsa(q=q, k=k, v=v):
            return elsa_surgery.attention(q, k, v, backend="elsa", precision="precise")

        calls = dict.fromkeys(SIDES, elsa)  # one call, the knob set around it: envs
        envs = {name: {"ELSA_PRECISE_SPLIT": knob} for name, knob in SIDES.items()}
        me, why = benchmark.sdpa_backends(q, k, v, ("efficient",))
        calls.update(me)
        envs["efficient"] = {}
        errs, graph, plans = {}, {}, {}
        eager = {name: [] for name in calls}
        for name, fn in calls.items():
            with benchmark.environ(envs[name]):
                if name in SIDES:
                    pl = launch.plan_launch(launch.call_signature(q, k, v, None, precision="precise"))
                    plans[name] = f"dot {pl.dot} parts {pl.parts} tiles {pl.cfg.block_m}x{pl.cfg.block_n}"
                out = fn()
                errs[name] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                benchmark.per_call_ms(fn, 1, warmup=3)
                replay = benchmark.cuda_graph(fn, warmup=2)
                graph[name] = do_bench(replay, warmup=25, rep=200)
                del replay
        for _ in range(a.rounds):
            for name, fn in calls.items():
                with benchmark.environ(envs[name]):
                    # warmup: the first call after the knob changed records the side's launch plan again (the
                    # plans' key holds no knob value; a plan replays while the knobs it read are unchanged)
                    eager[name].append(benchmark.per_call_ms(fn, a.calls, warmup=2))
        base_e = statistics.median(eager["efficient"]) if "efficient" in eager else None
        base_g = graph.get("efficient")
        print(f"== {shape} (work {B * H * N * N * D:.2e})" + (f"  efficient: {why}" if why else ""))
        for name in calls:
            e = statistics.median(eager[name])
            g = graph[name]
            ratio = (f"  vs ME eager {base_e / e:.2f}x graph {base_g / g:.2f}x" if base_e else "")
            print(f"  {name:9s} eager {e:.4f} ms  graph {g:.4f} ms  err {errs[name]:.2e}{ratio}"
                  f"  {plans.get(name, '')}", flush=True)


if __name__ == "__main__":
    main()
