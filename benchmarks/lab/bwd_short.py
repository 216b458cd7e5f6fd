"""The one-launch backward (``backward.bwd_short``, calls of at most 64 query rows and keys) against the general
passes (``ELSA_BWD_SHORT=0``: delta, bwd_kv, row_pass) and SDPA's default backend, at window-attention shapes.

    python benchmarks/lab/bwd_short.py [--rounds 5]

For each case: the gradients' relative error against float64 (SDPA's math kernel on float64 copies) of each side,
then forward + backward per call in ms, eager (CUDA events around many calls, interleaved rounds, medians) and the
GPU kernels' own time (torch.profiler), all three sides in one process. Needs a CUDA GPU.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark

# name: (B, H, N, D, dtype, precision, bias mask that requires grad)
CASES = {"swin_t_s1_bias_fp32": (512, 3, 49, 32, torch.float32, "precise", True),
         "swin_t_s1_bias_bf16": (512, 3, 49, 32, torch.bfloat16, None, True),
         "swin_t_s3_bias_fp32": (32, 12, 49, 32, torch.float32, "precise", True),
         "swinv2_s1_bias_bf16": (512, 3, 64, 32, torch.bfloat16, None, True),
         "short_nomask_bf16": (64, 16, 64, 64, torch.bfloat16, None, False),
         "short_nomask_fp32": (64, 16, 64, 64, torch.float32, "precise", False)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for name, (B, H, N, D, dt, prec, bias) in CASES.items():
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        mask = torch.randn(1, H, N, N, device="cuda", dtype=dt, requires_grad=True) if bias else None
        go = torch.randn(B, H, N, D, device="cuda", dtype=dt)
        leaves = [q, k, v] + ([mask] if bias else [])
        exact = [t.detach().double().requires_grad_() for t in leaves]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ref = torch.autograd.grad(F.scaled_dot_product_attention(*exact[:3], attn_mask=exact[3] if bias else None),
                                      exact, go.double())

        def elsa():
            out = elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa", precision=prec)
            return torch.autograd.grad(out, leaves, go)

        def sdpa():
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), leaves, go)

        sides = {"short": elsa, "general": elsa, "sdpa": sdpa}
        envs = {"short": {"ELSA_BWD_SHORT": "1"}, "general": {"ELSA_BWD_SHORT": "0"}, "sdpa": {}}
        errs, kern = {}, {}
        for s, fn in sides.items():
            with benchmark.environ(envs[s]):
                errs[s] = max(rel(g, r) for g, r in zip(fn(), ref))
                kern[s] = benchmark.kernel_ms(fn, 20)
        times = {s: [] for s in sides}
        for _ in range(a.rounds):
            for s, fn in sides.items():
                with benchmark.environ(envs[s]):
                    fn()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(a.calls):
                        fn()
                    end.record()
                    torch.cuda.synchronize()
                times[s].append(start.elapsed_time(end) / a.calls)
        med = {s: statistics.median(t) for s, t in times.items()}
        print(f"{name} B={B} H={H} N={N} D={D}: "
              + "  ".join(f"{s} {med[s]:.4f} ms (kernels {kern[s]:.4f}, err {errs[s]:.1e})" for s in sides)
              + f"  sdpa/short {med['sdpa'] / med['short']:.3f} general/short {med['general'] / med['short']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
