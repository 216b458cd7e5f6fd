"""Question: what does a packed (varlen) call cost the host, and a packed forward of 12 layers that share one
cu_seqlens pair (transformers' flash-attention kwargs)? Session 40 memoised packed calls' validation and dispatch
(``callcache.prepare_varlen``) and checks each cu_seqlens tensor's values once while it is unchanged (a copy to the
host and a sync a check); session 41 gave packed calls direct routes (``callcache.direct_varlen``). Run this script
on the old and the new checkout in turn.

    python benchmarks/lab/varlen_host.py [--seqs 8] [--total 1024] [--calls 200]

Per call: host time (the clock stops before the device sync) and eager time (after it), medians of 5 rounds, for
one call and for a 12-call "forward" (one cu_seqlens pair, fresh q/k/v views per layer as a model makes them).
"""

import argparse

import torch

import elsa_surgery
from elsa_surgery import benchmark


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--total", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, help="then a cProfile of this many single calls")
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(a.total - 1, generator=g)[:a.seqs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([a.total])]).to(torch.int32).cuda()
    longest = int(cu.diff().max())
    qkv = torch.randn(a.total, 3, 12, 64, device="cuda", dtype=torch.bfloat16)

    def call():
        q, k, v = qkv.unbind(1)  # views, as a fused projection gives them
        return elsa_surgery.attention_varlen(q, k, v, cu, cu, longest, longest)

    def forward():
        for _ in range(12):
            call()

    for name, fn, n in (("one call", call, a.calls), ("12-layer forward", forward, max(1, a.calls // 12))):
        host, eager = benchmark.host_and_eager_us(fn, n)
        print(f"{name:18s} host {host:8.1f} us  eager {eager:8.1f} us", flush=True)
    if a.profile:
        benchmark.print_host_profile(call, a.profile, (("tottime", 30),))


if __name__ == "__main__":
    main()
