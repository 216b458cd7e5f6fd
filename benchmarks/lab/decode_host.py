"""Question: where does an eager decode call's time go beyond its kernels? Session 40's decode grid read
16 x 32:8 D = 64 4K at 0.82-0.87x the fastest SDPA backend eager against 0.97x graph-replayed (H100): the call's
host side. For each shape: host time per call (the clock stops before the device sync), eager time (after it),
graph-replayed kernel time, for ``elsa_surgery.attention(backend="elsa")`` and SDPA's cuDNN and flash kernels; the
kernels one ELSA call launches (torch.profiler); then a cProfile of ``--profile`` ELSA calls (first shape).

    python benchmarks/lab/decode_host.py [--shapes 16x32x8x64x4096,1x32x8x128x4096] [--calls 200]

``--ab-env ELSA_DECODE_MERGE=kernel``: also time ELSA with that variable set (``elsa:kernel``), interleaved in the
rounds (session 65: the fused merge against the merge kernel; graph-replayed calls never fuse, so their column is
the same kernels for both).
"""

import argparse
import statistics
import warnings

import torch
import triton.testing

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import replay


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x32x8x64x4096,1x32x8x128x4096,1x32x4x64x32768", help="BxHqxHkvxDxNk")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=2000)
    ap.add_argument("--ab-pointer-ints", action="store_true",
                    help="also time ELSA with its replayed launches handing Triton's launcher the tensors themselves "
                         "('elsa-tensors') instead of their addresses (session 58), interleaved in the rounds")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                    help="also time ELSA with NAME=VALUE in the environment ('elsa:VALUE'), interleaved")
    a = ap.parse_args()
    envs = dict(e.split("=", 1) for e in a.ab_env)

    def env_of(name):
        """The environment an entry runs in (``elsa:VALUE``: its --ab-env variable set; others: as it is)."""
        return benchmark.environ({n: val for n, val in envs.items() if name == f"elsa:{val}"})

    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    first = None
    for shape in a.shapes.split(","):
        B, Hq, Hkv, D, nk = (int(x) for x in shape.split("x"))
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fns = {"elsa": lambda: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True)}
        if a.ab_pointer_ints:
            fns["elsa-tensors"] = fns["elsa"]
        for val in envs.values():
            fns[f"elsa:{val}"] = fns["elsa"]
        fns.update(benchmark.sdpa_backends(q, k, v, ("cudnn", "flash"), enable_gqa=Hq != Hkv)[0])
        res = {name: [] for name in fns}
        for _ in range(3):  # interleaved rounds
            for name, fn in fns.items():
                with env_of(name):
                    if name.startswith("elsa"):
                        fn()  # (the plan recorded)
                        for plan in replay._plans.values():  # every launch of every plan: addresses, or the tensors
                            for one in plan.launches or ():
                                one.ints = False if name == "elsa-tensors" else None
                    res[name].append(benchmark.host_and_eager_us(fn, a.calls))
        for plan in replay._plans.values():
            for one in plan.launches or ():
                one.ints = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fns["elsa"]()
            torch.cuda.synchronize()
        kernels = {e.key: e.count // 10 for e in prof.key_averages() if e.device_time_total > 0}
        print(f"{shape}: ELSA kernels a call {kernels}", flush=True)
        for name in fns:
            host = statistics.median(h for h, _ in res[name])
            wall = statistics.median(w for _, w in res[name])
            with env_of(name):
                graph = triton.testing.do_bench(benchmark.cuda_graph(fns[name]), warmup=25, rep=100,
                                                return_mode="median") * 1e3
            print(f"  {name:6s} host {host:7.1f} us  eager {wall:7.1f} us  graph {graph:7.1f} us", flush=True)
        first = first or fns["elsa"]
    if a.profile:
        benchmark.print_host_profile(first, a.profile, (("tottime", 18),))


if __name__ == "__main__":
    main()
