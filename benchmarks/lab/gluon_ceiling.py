"""Lab: Can a FlashAttention loop written in Gluon (explicit wgmma, TMA, mbarriers) pass Triton's 0.71-0.75x SDPA cuDNN ceiling at bf16/fp16 D = 128?
Answered in docs/perf/history.md, section "Version 10". A one-off investigation, not a recipe.

Beyond Triton's ceiling at bf16/fp16 D=128: a FlashAttention loop written in Gluon (Triton's explicit
dialect) with Hopper's asynchronous wgmma, TMA loads into a ring of shared-memory stages, and the softmax of
key tile j overlapped with the P·V product of tile j-1 (FlashAttention-3's intra-warpgroup pipelining),
against SDPA cuDNN on the same inputs. ``benchmarks/lab/lowp_ceiling.py`` measured that Triton's own code
generation stops at 0.74-0.76x cuDNN for this loop; this script measures whether the explicit schedule
moves that ceiling.

    python benchmarks/lab/gluon_ceiling.py                 # bf16, non-causal, (H=32, N=4K), (H=8, N=16K), D=128
    python benchmarks/lab/gluon_ceiling.py --check-only    # correctness vs float64 on small shapes

Needs a Hopper GPU (sm_90) and Triton >= 3.6 (Gluon). Prototype: B·H·N·D contiguous, N a multiple of the
tiles, no masks, no causal.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, kv_row, stage):
    bar = bars.index(stage)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, 0], bar, k_smem.index(stage))
    tma.async_copy_global_to_shared(v_desc, [kv_row, 0], bar, v_smem.index(stage))


@gluon.jit
def _issue_one(desc, ring, bars, row, stage):
    bar = bars.index(stage)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, ring.index(stage))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Fold one score tile (raw dot products) into the running max/sum; returns p (fp32), alpha, m, l."""
    s = s * qk_scale
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def fa_fwd(q_desc, k_desc, v_desc, o_desc, N, qk_scale,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
           OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    q_row = bh * N + pid_m * BLOCK_M
    kv_base = bh * N
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # OVERLAP: V's own
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    n_tiles = N // BLOCK_N
    for i in gl.static_range(STAGES):
        if i < n_tiles:
            if OVERLAP:
                _issue_one(k_desc, k_smem, bars, kv_base + i * BLOCK_N, i)
                _issue_one(v_desc, v_smem, v_bars, kv_base + i * BLOCK_N, i)
            else:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, kv_base + i * BLOCK_N, i)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        # K and V complete on their own barriers, so K's stage is refilled as soon as Q·K^T has read it
        # (before tile j-1's P·V is done) and V's once P·V has read it
        k_bars = bars
        mbarrier.wait(k_bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if STAGES < n_tiles:
            _issue_one(k_desc, k_smem, k_bars, kv_base + STAGES * BLOCK_N, 0)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            st = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_bars.index(st), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
            acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            if j + STAGES < n_tiles:
                _issue_one(k_desc, k_smem, k_bars, kv_base + (j + STAGES) * BLOCK_N, st)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)  # overlaps tile j-1's P·V
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            if j - 1 + STAGES < n_tiles:
                _issue_one(v_desc, v_smem, v_bars, kv_base + (j - 1 + STAGES) * BLOCK_N, prev)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    else:
        for j in range(0, n_tiles):
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            nxt = j + STAGES
            if nxt < n_tiles:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, kv_base + nxt * BLOCK_N, st)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], o_desc.layout)
    o_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], o_smem)
    tma.store_wait(pendings=0)


_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def run(q, k, v, o, cfg):
    """q/k/v/o contiguous ``[B, H, N, D]``; ``cfg = (BLOCK_M, BLOCK_N, STAGES, num_warps, OVERLAP)``."""
    bm, bn, stages, warps, overlap = cfg
    B, H, N, D = q.shape
    if N % bm or N % bn:
        raise ValueError(f"N={N} must be a multiple of the tiles ({bm}, {bn})")
    dt = _GL_DTYPE[q.dtype]
    flat = lambda t: t.view(B * H * N, D)
    lay_m = gl.NVMMASharedLayout.get_default_for([bm, D], dt)
    lay_n = gl.NVMMASharedLayout.get_default_for([bn, D], dt)
    qd = TensorDescriptor(flat(q), [B * H * N, D], [D, 1], [bm, D], lay_m)
    kd = TensorDescriptor(flat(k), [B * H * N, D], [D, 1], [bn, D], lay_n)
    vd = TensorDescriptor(flat(v), [B * H * N, D], [D, 1], [bn, D], lay_n)
    od = TensorDescriptor(flat(o), [B * H * N, D], [D, 1], [bm, D], lay_m)
    grid = (N // bm, B * H)
    fa_fwd[grid](qd, kd, vd, od, N, D ** -0.5 * LOG2E, BLOCK_M=bm, BLOCK_N=bn, HEAD_D=D, STAGES=stages,
                 OVERLAP=overlap, num_warps=warps)
    return o


def check(cfgs, dtype=torch.bfloat16):
    worst = 0.0
    for cfg in cfgs:
        for (B, H, N, D) in [(1, 2, 512, 128), (2, 3, 1024, 64)]:
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
            o = torch.empty_like(q)
            run(q, k, v, o, cfg)
            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
            err = ((o.double() - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            print(f"check cfg={cfg} B={B} H={H} N={N} D={D}: max rel err {err:.2e}", flush=True)
    return worst


def main(argv=None):
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--space", default="bm=128;bn=64,128;s=2,3;w=8;ov=0,1",
                    help="tile space: BLOCK_M, BLOCK_N, STAGES, num_warps, OVERLAP")
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    space = dict(kv.split("=") for kv in args.space.split(";"))
    cfgs = list(itertools.product(*(tuple(int(x) for x in space[key].split(",")) for key in ("bm", "bn", "s", "w", "ov"))))
    worst = check(cfgs, dtype)
    print(f"worst rel err {worst:.2e}")
    if args.check_only:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300)

    for (H, N) in [(32, 4096), (8, 16384)]:
        D = 128
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4.0 * H * N * N * D
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"H={H} N={N} D={D}: cuDNN {t_cudnn * 1e3:.1f} us ({flops / t_cudnn / 1e9:.0f} TFLOP/s)", flush=True)
        o = torch.empty_like(q)
        for cfg in cfgs:
            try:
                t = bench(lambda: run(q, k, v, o, cfg))
            except Exception as e:  # a tile that does not fit shared memory / registers
                print(f"  cfg={cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            print(f"  gluon cfg={cfg}: {t * 1e3:.1f} us ({flops / t / 1e9:.0f} TFLOP/s), "
                  f"{t_cudnn / t:.3f}x cuDNN", flush=True)


if __name__ == "__main__":
    main()
