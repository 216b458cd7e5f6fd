"""The host side of one training call (forward + backward) against SDPA's, at the small shapes of vision training
(Swin-T window attention, ViT-B/16): session 31's H100 profile of bf16 16x64 N = 4K measured the causal forward +
backward at 1.52 ms by CUDA events while its kernels took 0.61 ms, so the call looked host-bound.

    python benchmarks/lab/bwd_host.py [--calls 200] [--profile 50]

Prints for each case the host-only time per step (clock stopped before the device sync) and the eager time per step
(host and GPU), ELSA (backend="elsa") and SDPA's default backend interleaved, and the host time of the forward
alone (autograd recording, no backward) and of the backward alone (replayed on a retained graph; also for a
pass-through Python autograd Function: the engine's floor for a Python node), over 5 rounds (medians), then
cProfile's 25 costliest functions by own time and 40 by cumulative time over ``--profile`` ELSA steps of the first
case (``--cases`` picks cases). Needs a CUDA GPU.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark

# name: (B, H, N, D, dtype, an additive bias that requires grad: Swin's relative-position bias)
CASES = {"swin_t_stage1_fp32": (512, 3, 49, 32, torch.float32, False),
         "swin_t_stage1_bias_fp32": (512, 3, 49, 32, torch.float32, True),
         "swin_t_stage1_bf16": (512, 3, 49, 32, torch.bfloat16, False),
         "vit_b16_bf16": (8, 12, 197, 64, torch.bfloat16, False),
         "vit_b16_fp32": (8, 12, 197, 64, torch.float32, False)}


class _Passthrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, made, q, *rest):
        ctx.made = made
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return (None, *ctx.made)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=50)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all); the first is profiled")
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    first = None
    for name, (B, H, N, D, dt, bias) in CASES.items():
        if a.cases and name not in a.cases.split(","):
            continue
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        go = torch.randn(B, H, N, D, device="cuda", dtype=dt)

        mask = torch.randn(1, H, N, N, device="cuda", dtype=dt, requires_grad=True) if bias else None

        def elsa():
            elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa").backward(go)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(go)

        # the backward alone, replayed on one retained graph: ELSA's, SDPA's, and a pass-through Python Function's
        # (its backward returns gradients made before: the autograd engine's floor for a Python node)
        elsa()  # (a call seen before: the graph below is the one later calls make, through their direct route)
        ins = (q, k, v) if mask is None else (q, k, v, mask)
        made = tuple(torch.randn_like(t) for t in ins)
        graphs = {"elsa": elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa"),
                  "sdpa": F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                  "passthrough": _Passthrough.apply(made, *ins)}
        fns = {"elsa": elsa, "sdpa": sdpa,  # and the forward alone, autograd recording (its graph then dropped)
               "elsa_fwd": lambda: elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa"),
               "sdpa_fwd": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
               **{f"{n}_bwd": (lambda o=o: o.backward(go, retain_graph=True)) for n, o in graphs.items()}}
        host = {n: [] for n in fns}
        eager = {n: [] for n in fns}
        for fn in fns.values():
            benchmark.per_call_ms(fn, 3)
        for _ in range(5):
            for n, fn in fns.items():
                host[n].append(benchmark.per_call_ms(fn, a.calls, host_only=True, warmup=0) * 1e3)
                eager[n].append(benchmark.per_call_ms(fn, a.calls, warmup=0) * 1e3)
        h = {n: statistics.median(t) for n, t in host.items()}
        e = {n: statistics.median(t) for n, t in eager.items()}
        print(f"{name} {B}x{H}x{N}x{D}: host us/step elsa {h['elsa']:.1f} sdpa {h['sdpa']:.1f} "
              f"({h['elsa'] / h['sdpa']:.2f}x); eager us/step elsa {e['elsa']:.1f} sdpa {e['sdpa']:.1f} "
              f"(sdpa/elsa {e['sdpa'] / e['elsa']:.2f}); forward alone host us elsa {h['elsa_fwd']:.1f} "
              f"sdpa {h['sdpa_fwd']:.1f}; backward alone host us elsa {h['elsa_bwd']:.1f} sdpa {h['sdpa_bwd']:.1f} "
              f"pass-through Function {h['passthrough_bwd']:.1f}", flush=True)
        first = first or elsa
    if a.profile and first is not None:
        benchmark.print_host_profile(first, a.profile, (("tottime", 25), ("cumulative", 40)))


if __name__ == "__main__":
    main()
