"""Where the time of one forward + backward goes, per kernel (torch.profiler), causal and not: session 29 measured
causal bf16 16x64 at N = 4K costing as much as non-causal (1.63 vs 1.55 ms), where it should cost about half.

    python benchmarks/lab/bwd_profile.py [--dtype bf16] [--shape 16x64] [--n 4096] [--mask random --tiles all,forward]
    python benchmarks/lab/bwd_profile.py --dtype fp32 --precision turbo   # an fp32 mode (default: the dispatch's)

``--mask random|causal``: a boolean mask ``[1, 1, N, N]`` (i.i.d. keys visible with probability 1/2, or
lower-triangular) instead of ``is_causal``, profiled once for each ``ELSA_MASK_TILES`` value of ``--tiles`` (session
35: the backward's tile ranges made an unstructured mask's backward slower). Prints, for each of causal False/True
(each tiles value): the CUDA-event time of forward + backward (median of 20), then the
profiler's kernels over 5 steps (total CUDA time per kernel name, calls). Needs a CUDA GPU.
"""

import argparse
import statistics

import torch

import elsa_surgery
from elsa_surgery import benchmark

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--shape", default="16x64", help="HxD")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--mask", choices=["random", "causal"], help="a boolean mask instead of is_causal")
    ap.add_argument("--tiles", default="all,forward", help="ELSA_MASK_TILES values (with --mask)")
    ap.add_argument("--precision", choices=["strict", "precise", "turbo"], help="fp32's mode")
    a = ap.parse_args()
    H, D = (int(x) for x in a.shape.split("x"))
    dt = DTYPES[a.dtype]
    q, k, v = (torch.randn(1, H, a.n, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    go = torch.randn(1, H, a.n, D, device="cuda", dtype=dt)
    mask, cases = None, [(c, None) for c in (False, True)]
    if a.mask:
        i = torch.arange(a.n, device="cuda")
        mask = (i[None, :] <= i[:, None] if a.mask == "causal"
                else torch.rand(a.n, a.n, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) < 0.5)
        mask, cases = mask[None, None], [(False, t) for t in a.tiles.split(",")]
    for causal, tiles in cases:
        def step():
            with benchmark.environ({"ELSA_MASK_TILES": tiles} if tiles else {}):
                out = elsa_surgery.attention(q, k, v, attn_mask=mask, is_causal=causal, backend="elsa",
                                           precision=a.precision)
                out.backward(go)
        for _ in range(3):
            step()
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        what = f"causal={causal}" + (f" mask={a.mask} tiles={tiles}" if tiles else "")
        print(f"{what}: forward + backward {statistics.median(times):.3f} ms (median of 20)", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        rows = sorted(((ev.key, ev.device_time_total / 5e3, ev.count // 5) for ev in prof.key_averages()
                       if ev.device_time_total > 0), key=lambda r: -r[1])
        for name, ms, calls in rows[:10]:
            print(f"  {ms:8.3f} ms/step  x{calls}  {name[:90]}", flush=True)


if __name__ == "__main__":
    main()
