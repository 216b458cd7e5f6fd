"""Run one attention problem through every backend available here; print drift vs float64 and time.

    python examples/attention_backends.py            # B=1, H=8, N=1024, D=64 on the best device
    python examples/attention_backends.py --n 4096 --dtype bf16

On a CPU-only machine the ELSA Triton kernels cannot run at speed; the script says so and shows the
reference (the O(n)-memory monoid scan in PyTorch) and PyTorch's SDPA.
"""

import argparse
import os
import time

import torch

import elsa_surgery
from elsa_surgery import dispatch
from elsa_surgery.table import format_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _time(fn, device, reps=5):
    fn()  # warm-up (compilation, caches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, a.heads, a.n, a.head_dim, generator=g).to(dev, dtype) for _ in range(3))
    oracle = elsa_surgery.attention(q.double(), k.double(), v.double(), is_causal=a.causal, backend="reference")

    runs = [("reference", None), ("sdpa", None)]
    if dtype == torch.float32:
        runs += [("elsa", p) for p in ("strict", "precise", "turbo")]
    else:
        runs += [("elsa", None)]
    rows, notes = [], []
    for backend, precision in runs:
        label = backend + (f" ({precision})" if precision else "")
        if backend == "elsa":
            why = dispatch.kernel_unsupported_reason(q, k, v, None)
            if why is not None or (dev.type == "cpu" and os.environ.get("TRITON_INTERPRET")):
                notes.append(f"{label}: not run — {why or 'the Triton interpreter is too slow for this size'}")
                continue
        fn = lambda: elsa_surgery.attention(q, k, v, is_causal=a.causal, backend=backend, precision=precision)
        out = fn()
        err = ((out.double() - oracle).norm() / oracle.norm()).item()
        rows.append([label, err, _time(fn, dev)])
    print(f"attention B=1 H={a.heads} N={a.n} D={a.head_dim} {a.dtype} causal={a.causal} on {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(format_table(["backend", "rel. error vs float64", "ms"], rows))
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
