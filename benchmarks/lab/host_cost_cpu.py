"""The host cost of the public call's routing on the CPU: ``elsa_surgery.attention(..., backend="sdpa")`` (a call
seen before runs through its direct route, plain SDPA) against ``F.scaled_dot_product_attention`` itself, on tiny
CPU tensors so that the kernel is small beside the Python around it. What this isolates is the layer every eager
call pays before its kernel (route lookup, announcement), the same code on a GPU host; the GPU's own launch path is
measured by ``recipes/profile_host_cost.py`` there.

    python benchmarks/lab/host_cost_cpu.py [--rounds 7] [--calls 20000]

Runs on older checkouts too (it uses only the public call). One thread; medians of interleaved rounds, in µs.
"""

import argparse

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark


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
    with torch.inference_mode():  # warm-up: the memo and the direct routes made
        us = {name: ms * 1e3 for name, ms in benchmark.interleaved_ms(
            cases, rounds=args.rounds, calls=args.calls, warmup=500, device="cpu").items()}
    for name, t in us.items():
        print(f"{name:52s} {t:8.2f} us")
    base, ours = us["F.sdpa"], us["attention(backend='sdpa')"]
    print(f"routing overhead of a direct SDPA route: {ours - base:.2f} us a call ({ours / base:.2f}x SDPA's call)")


if __name__ == "__main__":
    main()
