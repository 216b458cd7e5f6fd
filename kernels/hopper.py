"""The ELSA scan for fp16/bf16 on Hopper (sm_90), written in Gluon: asynchronous wgmma, TMA loads of K/V tiles
into a ring of shared-memory stages completing on mbarriers, and two or three CTAs per SM so one CTA's softmax
overlaps another's tensor-core products.

It is the same fold as ``scan.elsa_fwd`` with one partition: each program folds the key tiles of its row block
into per-row ``(m, S, W)`` on chip and finalises them. Triton's own code generation stops at 0.71-0.76x SDPA
cuDNN for this loop at D=128 (docs/PERF.md, v9); the explicit schedule here is what moves it.

Scope (``eligible`` says why a call is not taken, and the launcher then runs ``scan.elsa_fwd``):
fp16/bf16 on a CUDA device of compute capability 9.x with Gluon available (Triton >= 3.6); dense calls
without a mask, ``q_lengths``/``kv_lengths`` or state output; a positive scale (it is applied after the row
max); causal (bottom-right) or not; GQA/MQA by head index; head dims D, Dv in {16, 32, 64, 128} (Gluon tiles
are powers of two; 256 does not fit the registers), other head dims on the portable kernel; any Nq, Nk
(TMA zero-fills past the end and the last tiles are masked); any strides whose inner dim is contiguous and
whose other strides are 16-byte multiples. The Triton interpreter cannot run Gluon, so this path is tested
on the GPU only (tests/test_kernels_gpu.py); every CPU test runs ``scan.elsa_fwd``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .occupancy import _sms

LOG2E = 1.4426950408889634

try:  # Gluon's Hopper API as of Triton 3.6
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

    _IMPORT_ERROR: Optional[str] = None
except Exception as e:  # pragma: no cover - depends on the installed Triton
    gluon = None
    _IMPORT_ERROR = f"Gluon's Hopper API is not importable from this Triton ({type(e).__name__}: {e})"

ENV = "ELSA_HOPPER"  # "0": off (the portable kernel runs); "1" or unset: by size; "force": whenever in scope
_ENV_VALUES = ("0", "1", "force")
# Eager calls with less work than this (B·H·Nq·Nk·D, halved when causal; a kernel under ~100 µs on an H100) run
# the portable kernel: they are host-bound, and the Gluon launch (four TMA descriptors, Gluon's binder) costs
# ~30 µs more host time per public call (H100, session 10: 156-164 vs 125-132 µs), more than its kernel saves
# there (1K H=32 D=128: 39.7 vs 51.1 µs). During CUDA-graph capture the host time is paid once, so captured calls
# take the Gluon kernel at every size: it was the faster kernel in every cell measured, N = 1K included
# (graph-replayed: H=8 D=64 1.17x cuDNN vs 1.00x for the portable kernel, H=32 D=128 0.95x vs 0.75x)
MIN_WORK = 1e10

if gluon is not None:
    _LN2 = gl.constexpr(0.6931471805599453)

    @gluon.jit
    def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, b, hk, n0, stage):
        bar = bars.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], bar, v_smem.index(stage))

    @gluon.jit
    def _elsa_fwd_sm90(q_desc, k_desc, v_desc, o_desc, lse_ptr, s_lb, s_lh, s_ln, Nq, Nk, Hq, G, qk_scale,
                       n_mblocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       WRITE_LSE: gl.constexpr, num_warps: gl.constexpr):
        pid = gl.program_id(0)
        bh = pid // n_mblocks
        mb = pid % n_mblocks
        if IS_CAUSAL:
            mb = n_mblocks - 1 - mb  # the longest row blocks of each head first
        b = bh // Hq
        h = bh % Hq
        hk = h // G
        m0 = mb * BLOCK_M
        dtype: gl.constexpr = q_desc.dtype

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_D], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        # keys this row block sees: [0, n_end); the tiles below n_full need no mask (every row sees them)
        off = Nk - Nq
        n_end = Nk
        n_full = (Nk // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            n_end = gl.minimum(Nk, m0 + BLOCK_M + off)
            n_full = gl.minimum(n_full, ((m0 + off + 1) // BLOCK_N) * BLOCK_N)
        n_full = gl.maximum(n_full, 0)
        n_tiles = gl.cdiv(gl.maximum(n_end, 0), BLOCK_N)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_bar, q_tile)
        for i in gl.static_range(STAGES):
            if i < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, i * BLOCK_N, i)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        cols = gl.arange(0, BLOCK_N, layout=col_s)
        q_smem = q_tile.reshape([BLOCK_M, HEAD_D])
        mbarrier.wait(q_bar, 0)

        for j in range(0, n_tiles):
            st = j % STAGES
            n0 = j * BLOCK_N
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            k_smem = k_ring.index(st).reshape([BLOCK_N, HEAD_D])
            v_smem = v_ring.index(st).reshape([BLOCK_N, HEAD_DV])
            s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # raw Q·Kᵀ: the scale is applied below
            if n0 + BLOCK_N > n_full:  # the ragged end or the causal diagonal
                keys = n0 + cols
                visible = gl.expand_dims(keys < Nk, 0)
                if IS_CAUSAL:
                    visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + off, 1))
                s = gl.where(visible, s, float("-inf"))
            # qk_scale > 0 (``eligible``): the row max of the raw scores, scaled, is the max of the scaled
            # scores, and the scale folds into exp2's argument as one FMA per score (no separate multiply)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if j + STAGES < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, (j + STAGES) * BLOCK_N, st)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)  # rows with no key: zeros
        o_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DV], o_desc.layout)
        o_tile.reshape([BLOCK_M, HEAD_DV]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m0, 0], o_tile)
        if WRITE_LSE:
            lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_i)) * _LN2)
            gl.store(lse_ptr + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows.to(gl.int64) * s_ln, lse,
                     mask=rows < Nq)
        tma.store_wait(pendings=0)


_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
HEAD_DIMS = (16, 32, 64, 128)  # D = 256 would not fit the registers at these tiles


def mode() -> str:
    value = os.environ.get(ENV, "1").strip().lower() or "1"
    if value not in _ENV_VALUES:
        raise ValueError(f"{ENV} must be one of {_ENV_VALUES} (off, by size, whenever in scope), got {value!r}")
    return value


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _descriptor_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:-1]))


def eligible(q, k, v, out, *, mask, q_lengths, kv_lengths, varlen: bool, state, scale: float,
             is_causal: bool = False, how: Optional[str] = None) -> Optional[str]:
    """``None`` when this call runs on the Hopper kernel, else the reason it does not (dense q ``[B,H,N,D]``).
    ``how``: :func:`mode`, when the caller has read it already."""
    how = mode() if how is None else how
    if how == "0":
        return f"{ENV}=0"
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if q.device.type != "cuda":
        return "not a CUDA device"
    if _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())[0] != 9:
        return "not a Hopper (sm_90) device"
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype}"
    if varlen or state is not None or mask is not None or q_lengths is not None or kv_lengths is not None:
        return "masks, lengths, varlen and state output run on the portable kernel"
    if not scale > 0:
        return f"scale {scale} <= 0 (the kernel applies the scale after the row max)"
    D, Dv = q.shape[-1], v.shape[-1]
    if D not in HEAD_DIMS or Dv not in HEAD_DIMS:
        return f"head dims D={D}, Dv={Dv} (Gluon tiles need powers of two: one of {HEAD_DIMS})"
    if not all(_descriptor_ok(t) for t in (q, k, v, out)):
        return "strides not TMA-compatible (inner dim contiguous, others 16-byte multiples, 16-byte base)"
    work = float(q.shape[0] * q.shape[1]) * q.shape[2] * k.shape[2] * D * (0.5 if is_causal else 1.0)
    if how != "force" and work < MIN_WORK and not torch.cuda.is_current_stream_capturing():
        return f"small eager call (work {work:.2g} < {MIN_WORK:.0e}): the portable kernel's launch is cheaper"
    return None


ENV_TILES = "ELSA_HOPPER_TILES"  # "BLOCK_M,BLOCK_N,STAGES,num_warps", for tile sweeps (recipes/bench_attention.py)


# Grids of fewer 128-row programs than this many per SM take 64-row tiles (more, smaller programs balance
# better on 132 SMs), measured on an H100 in session 10 (bf16, graph-replayed, docs/PERF.md v11): non-causal
# D=128 N=1K H=8 (64 programs) 1.04x cuDNN vs 0.84x; causal D=128 N=1K H=32 (256) 0.95x vs 0.91x, but at
# N=4K H=32 (1024) 128-row tiles: 0.89x vs 0.85x; non-causal D=64 N=2K H=8 (128) 1.00x vs 0.81x, N=4K H=8 (256)
# 128-row tiles: 0.99x vs 0.90x
SMALL_GRID_PER_SM = 1
CAUSAL_SMALL_GRID_PER_SM = 4


def tiles(d: int, dv: int, is_causal: bool, *, tiles_128: int = 0, sms: int = 132):
    """``(BLOCK_M, BLOCK_N, STAGES, num_warps)``, shared memory under 113 KB so that two CTAs share an SM.
    ``tiles_128``: programs of the grid with 128-row tiles. Measured on an H100 (docs/PERF.md, sessions 9-10):
    128 x 64 at D = 128, 128 x 128 for narrower heads; 64-row tiles for small grids; 64 x 128 (three CTAs per
    SM) for causal calls with narrow heads at every size (N=4K H=8 D=64 1.14x cuDNN, 64 x 64: 0.90x)."""
    forced = os.environ.get(ENV_TILES, "").strip()
    if forced:
        parts = forced.split(",")
        if len(parts) != 4 or not all(p.strip().isdecimal() for p in parts):
            raise ValueError(f"{ENV_TILES} must be 'BLOCK_M,BLOCK_N,STAGES,num_warps' (integers), got {forced!r}")
        return tuple(int(p) for p in parts)
    wide = max(d, dv) > 64
    small = tiles_128 < (CAUSAL_SMALL_GRID_PER_SM if is_causal else SMALL_GRID_PER_SM) * sms
    if not wide and (is_causal or small):
        return 64, 128, 2, 4
    if small:
        return 64, 64, 2, 4
    return (128, 64, 2, 8) if wide else (128, 128, 2, 8)


def _desc(t: torch.Tensor, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(tuple(block), t.dtype))


def forward(q, k, v, out, lse, *, scale: float, is_causal: bool):
    """``out [B, Hq, Nq, Dv]`` (any TMA-compatible strides) and optionally ``lse [B, Hq, Nq]`` fp32."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bm, bn, stages, warps = tiles(D, Dv, is_causal, tiles_128=-(-Nq // 128) * B * Hq, sms=_sms(q.device))
    n_mb = -(-Nq // bm)
    sl = lse.stride() if lse is not None else (0, 0, 0)
    _elsa_fwd_sm90[(n_mb * B * Hq,)](
        _desc(q, [1, 1, bm, D]), _desc(k, [1, 1, bn, D]), _desc(v, [1, 1, bn, Dv]), _desc(out, [1, 1, bm, Dv]),
        lse if lse is not None else out, *sl, Nq, Nk, Hq, Hq // Hkv, float(scale) * LOG2E, n_mb,
        BLOCK_M=bm, BLOCK_N=bn, HEAD_D=D, HEAD_DV=Dv, STAGES=stages, IS_CAUSAL=bool(is_causal),
        WRITE_LSE=lse is not None, num_warps=warps,
        # eight warps: at most 128 registers a thread, so that two CTAs share an SM (ptxas may take more)
        **({"maxnreg": 128} if warps == 8 else {}),
    )
    return out, lse
