"""Lab: What fraction of cuBLAS does a plain Triton GEMM reach, per operand precision (the toolchain's ceiling for strict)?
Answered in docs/perf/history.md, section "Version 8". A one-off investigation, not a recipe.

The toolchain's own ceiling: a plain Triton GEMM against cuBLAS, per operand precision.

ELSA's ``strict`` mode is two IEEE-fp32 products per attention block, computed by Triton's FMA lowering of
``tl.dot(..., input_precision="ieee")``; its bf16 path is two ``wgmma`` products around the softmax. This
script measures what the same Triton (same ``tl.dot``, no softmax, no state) reaches on a bare GEMM, over a
sweep of tiles, next to cuBLAS (``torch.matmul``; TF32 off for fp32). If a bare Triton IEEE GEMM cannot reach
a fraction of SGEMM, neither can an attention kernel built from the same dot plus a softmax.

    python benchmarks/lab/gemm_ceiling.py                       # fp32 IEEE and bf16, square and attention shapes
    python benchmarks/lab/gemm_ceiling.py --dtypes ieee --json out.jsonl

Shapes: ``4096^3`` (a square GEMM) and the score product of one attention head batch, ``[B·H, N, D] x
[B·H, D, N]`` with ``B·H = 8, N = 4096, D = 64`` and ``B·H = 32, N = 4096, D = 128`` (the benchmark's cells).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm(A, B, C, M, N, K, sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = A + b * sab + rm[:, None] * sam + rk[None, :] * sak
    b_ptr = B + b * sbb + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        bb = tl.load(b_ptr, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, bb, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bb, acc)
        a_ptr += BK * sak
        b_ptr += BK * sbk
    tl.store(C + b * scb + rm[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_gemm(a, b, c, cfg, ieee):
    bm, bn, bk, w, s = cfg
    batch, m, k = a.shape
    n = b.shape[2]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), batch)
    _gemm[grid](a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(), BM=bm, BN=bn, BK=bk, IEEE=ieee,
                num_warps=w, num_stages=s)


SPACES = {
    "ieee": list(itertools.product([32, 64, 128], [64, 128], [8, 16, 32], [4, 8], [1, 2])),
    "bf16": list(itertools.product([64, 128], [64, 128, 256], [64], [4, 8], [3, 4])),
}
SHAPES = [(1, 4096, 4096, 4096), (8, 4096, 4096, 64), (32, 4096, 4096, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="ieee,bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    rows = []
    for kind in args.dtypes.split(","):
        dtype = torch.float32 if kind == "ieee" else torch.bfloat16
        for batch, m, n, k in SHAPES:
            a = torch.randn(batch, m, k, device="cuda", dtype=dtype)
            b = torch.randn(batch, k, n, device="cuda", dtype=dtype)
            c = torch.empty(batch, m, n, device="cuda", dtype=dtype)
            flops = 2.0 * batch * m * n * k
            ref = torch.matmul(a.double(), b.double()) if kind == "ieee" and batch * m * n <= 2 ** 27 else None
            t_cublas = triton.testing.do_bench(lambda: torch.matmul(a, b, out=c), warmup=10, rep=100)
            best = None
            for cfg in SPACES[kind]:
                if cfg[2] > k:
                    continue
                try:
                    t = triton.testing.do_bench(lambda: triton_gemm(a, b, c, cfg, kind == "ieee"), warmup=5, rep=40)
                except Exception as exc:  # out of shared memory / registers: that tile is not a candidate
                    print(f"  {kind} {cfg}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            triton_gemm(a, b, c, best[1], kind == "ieee")
            err = None
            if ref is not None:
                err = float(((c.double() - ref).abs().max() / ref.abs().max()).item())
            row = {"kind": kind, "shape": [batch, m, n, k], "cublas_ms": t_cublas, "cublas_tflops": flops / t_cublas / 1e9,
                   "triton_ms": best[0], "triton_tflops": flops / best[0] / 1e9, "triton_cfg": best[1],
                   "fraction_of_cublas": t_cublas / best[0], "rel_err": err}
            rows.append(row)
            print(f"{kind:5s} B={batch} M={m} N={n} K={k}: cuBLAS {row['cublas_tflops']:.1f} TFLOP/s, best Triton "
                  f"{row['triton_tflops']:.1f} TFLOP/s (BM,BN,BK,warps,stages={best[1]}) = "
                  f"{100 * row['fraction_of_cublas']:.0f} % of cuBLAS" + (f", rel err {err:.1e}" if err else ""),
                  flush=True)
            del a, b, c
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
