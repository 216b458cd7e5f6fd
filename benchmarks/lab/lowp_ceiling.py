"""Lab: How fast can Triton's own code generation run a bare FlashAttention loop at bf16 D = 128 (the ceiling of the portable kernel)?
Answered in docs/perf/history.md, section "Version 9". A one-off investigation, not a recipe.

The Triton ceiling behind the bf16 D=128 cell: a bare FlashAttention loop (no masks, no partitions, no
ragged lengths) against SDPA cuDNN and flash, and the same loop with two independent row sub-tiles per program
(``SUB=2``: one sub-tile's softmax may overlap the other's tensor-core products, the intra-warpgroup overlap
of FlashAttention-3) over a sweep of tiles. If the bare loop cannot reach 0.9x cuDNN, neither can ELSA's
kernel, which is the same loop plus masking and state logic.

    python benchmarks/lab/lowp_ceiling.py          # bf16, non-causal, (H=32, N=4K) and (H=8, N=16K), D=128, B=1

Needs a CUDA GPU. docs/perf/history.md, "Version 9", has its output on an H100.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tile_step(q, k, v, m_i, l_i, acc, qk_scale):
    s = tl.dot(q, k) * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def fa(Q, K, V, O, N, qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SUB: tl.constexpr):
    """Contiguous ``[BH, N, D]`` q/k/v/o, N a multiple of ``BM * SUB`` and ``BN``; ``qk_scale`` in log2 units."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    r0 = pid_m * (BM * SUB) + tl.arange(0, BM)
    q0 = tl.load(Q + base + r0[:, None] * D + offs_d[None, :])
    m0 = tl.full([BM], float("-inf"), tl.float32)
    l0 = tl.zeros([BM], tl.float32)
    a0 = tl.zeros([BM, D], tl.float32)
    if SUB == 2:
        r1 = r0 + BM
        q1 = tl.load(Q + base + r1[:, None] * D + offs_d[None, :])
        m1 = tl.full([BM], float("-inf"), tl.float32)
        l1 = tl.zeros([BM], tl.float32)
        a1 = tl.zeros([BM, D], tl.float32)
    kp = K + base + offs_n[None, :] * D + offs_d[:, None]
    vp = V + base + offs_n[:, None] * D + offs_d[None, :]
    for start in range(0, N, BN):
        k = tl.load(kp + start * D)
        v = tl.load(vp + start * D)
        m0, l0, a0 = _tile_step(q0, k, v, m0, l0, a0, qk_scale)
        if SUB == 2:
            m1, l1, a1 = _tile_step(q1, k, v, m1, l1, a1, qk_scale)
    tl.store(O + base + r0[:, None] * D + offs_d[None, :], (a0 / l0[:, None]).to(O.dtype.element_ty))
    if SUB == 2:
        tl.store(O + base + r1[:, None] * D + offs_d[None, :], (a1 / l1[:, None]).to(O.dtype.element_ty))


def run(q, k, v, o, cfg):
    """``cfg = (SUB, BM, BN, num_warps, num_stages)`` on ``[BH, N, D]`` tensors."""
    sub, bm, bn, w, s = cfg
    BH, N, D = q.shape
    fa[(N // (bm * sub), BH)](q, k, v, o, N, D ** -0.5 * LOG2E, BM=bm, BN=bn, D=D, SUB=sub, num_warps=w,
                              num_stages=s)


def main(argv=None):
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import elsa_surgery

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    print(torch.cuda.get_device_name(), triton.__version__)
    for H, N, D in [(32, 4096, 128), (8, 16384, 128)]:
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * H * N * N * D
        res = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel([be]):
                res[name] = bench(lambda: F.scaled_dot_product_attention(q, k, v))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        print(f"H={H} N={N} D={D}: cudnn {res['cudnn'] * 1e3:.1f} us ({flops / res['cudnn'] / 1e9:.0f} TF/s), "
              f"flash {res['flash'] * 1e3:.1f} us", flush=True)
        ms = bench(lambda: elsa_surgery.attention(q, k, v, backend="elsa"))
        print(f"  elsa (product)          {ms * 1e3:7.1f} us  {flops / ms / 1e9:4.0f} TF/s  x{res['cudnn'] / ms:.2f} cudnn",
              flush=True)
        q3, k3, v3 = (t[0] for t in (q, k, v))
        o = torch.empty_like(q3)
        best = []
        for cfg in itertools.product((1, 2), (64, 128), (64, 128), (4, 8), (2, 3)):
            if cfg[0] * cfg[1] > 256:
                continue
            try:
                run(q3, k3, v3, o, cfg)
                torch.cuda.synchronize()
                err = (o.float() - ref[0]).abs().max().item()
                ms = bench(lambda: run(q3, k3, v3, o, cfg))
            except Exception as e:  # out of shared memory for the largest tiles
                print(f"  SUB={cfg[0]} BM={cfg[1]} BN={cfg[2]} W={cfg[3]} S={cfg[4]}: failed {str(e).splitlines()[0][:60]}")
                continue
            best.append((ms, cfg, err))
        best.sort()
        for ms, (sub, bm, bn, w, s), err in best[:8]:
            print(f"  SUB={sub} BM={bm:3d} BN={bn:3d} W={w} S={s}: {ms * 1e3:7.1f} us {flops / ms / 1e9:4.0f} TF/s "
                  f"x{res['cudnn'] / ms:.2f} cudnn err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
