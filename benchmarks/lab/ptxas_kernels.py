"""ELSA kernel times (``triton.testing.do_bench``, ms) under whichever ptxas ``TRITON_PTXAS_PATH`` names: session 42
compared Triton's own (CUDA 12.8) with torch's (CUDA 13.0) before making torch's the default for the ELSA kernels
(``kernels/internals.match_inductor_ptxas``). Run once per ptxas, each on a Triton cache of its own::

    TRITON_CACHE_DIR=/tmp/a TRITON_PTXAS_PATH=.../triton/backends/nvidia/bin/ptxas python benchmarks/lab/ptxas_kernels.py
    TRITON_CACHE_DIR=/tmp/b TRITON_PTXAS_PATH=.../torch/bin/ptxas python benchmarks/lab/ptxas_kernels.py
"""

import json
import os

import torch
from triton.testing import do_bench

import elsa_surgery

CASES = (("bf16 8x16x4096x64", torch.bfloat16, (8, 16, 4096, 64), None, False),
         ("bf16 8x12x197x64", torch.bfloat16, (8, 12, 197, 64), None, False),
         ("fp32 precise 1x16x4096x128", torch.float32, (1, 16, 4096, 128), "precise", False),
         ("bf16 bwd 1x16x4096x128", torch.bfloat16, (1, 16, 4096, 128), None, True))


def main():
    torch.manual_seed(0)
    res = {"ptxas": os.environ.get("TRITON_PTXAS_PATH", "unset")}
    for name, dtype, shape, precision, backward in CASES:
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=backward) for _ in range(3))
        if backward:
            out = elsa_surgery.attention(q, k, v, backend="elsa")
            go = torch.randn_like(out)

            def fn(out=out, go=go, q=q, k=k, v=v):
                return torch.autograd.grad(out, (q, k, v), go, retain_graph=True)
        else:
            def fn(q=q, k=k, v=v, precision=precision):
                return elsa_surgery.attention(q, k, v, backend="elsa", precision=precision)
        fn()
        torch.cuda.synchronize()
        res[name] = round(do_bench(fn, warmup=25, rep=200), 4)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
