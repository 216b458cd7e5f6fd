"""The host cost of the public call's routing on the CPU: ``elsa_surgery.attention(..., backend="sdpa")`` (a call
seen before runs through its direct route, plain SDPA) against ``F.scaled_dot_product_attention`` itself, on tiny
CPU tensors so that the kernel is small beside the Python around it. What this isolates is the layer every eager
call pays before its kernel (route lookup, announcement), the same code on a GPU host; the GPU's own launch path is
measured by ``recipes/profile_host_cost.py`` there.

    python benchmarks/lab/host_cost_cpu.py [--rounds 7] [--calls 20000]

Runs on older checkouts too (it uses only the public call). One thread; medians of interleaved rounds, in µs.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import elsa_surgery


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    mask = torch.randn(1, 2, 8, 8)
    cases = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "attention(backend='sdpa')": lambda: elsa_surgery.attention(q, k, v, backend="sdpa"),
        "F.sdpa, causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "attention(backend='sdpa'), causal": lambda: elsa_surgery.attention(q, k, v, is_causal=True,
                                                                           backend="sdpa"),
        "F.sdpa, float mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "attention(backend='reference'), float mask, memo": lambda: elsa_surgery.attention(
            q, k, v, attn_mask=mask, backend="reference"),
    }
    times = {name: [] for name in cases}
    with torch.inference_mode():
        for fn in cases.values():
            per_call_us(fn, 500)  # warm: the memo and the direct routes made
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(per_call_us(fn, args.calls))
    for name, ts in times.items():
        print(f"{name:52s} {statistics.median(ts):8.2f} us  (min {min(ts):.2f})")
    base, ours = (statistics.median(times[n]) for n in ("F.sdpa", "attention(backend='sdpa')"))
    print(f"routing overhead of a direct SDPA route: {ours - base:.2f} us a call ({ours / base:.2f}x SDPA's call)")


if __name__ == "__main__":
    main()
