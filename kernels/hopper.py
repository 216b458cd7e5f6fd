"""The ELSA scan on Hopper (sm_90), written in Gluon: two kernels, one partition each.

* fp16/bf16 and fp32 ``turbo`` (``_elsa_fwd_sm90``): asynchronous wgmma, TMA loads of K/V tiles into a ring of
  shared-memory stages completing on mbarriers, and (fp16/bf16) two or three CTAs per SM so one CTA's softmax
  overlaps another's tensor-core products. Triton's own code generation stops at 0.71-0.76x SDPA cuDNN for this
  loop at D=128 (docs/perf/history.md, v9); the explicit schedule here is what moves it. For ``turbo`` (TF32 products)
  each V tile is transposed in shared memory, as a TF32 wgmma reads K-major operands only: the portable kernel
  had to stage V transposed in memory for that (v5), and reached 4.0-4.4x ME-SDPA at D=128 16K causal vs 5.2x.
* fp32 ``strict`` (``_elsa_fwd_sm90_fma``): both products as IEEE FMAs, register-blocked with layouts chosen so
  that the shared-memory reads of the TMA tiles are free of bank conflicts; 37-40 TFLOP/s on an H100 at N >= 4K
  where Triton's FMA dot reached 12-19.5 (docs/perf/history.md, v8 and v12).

Each program folds the key tiles of its row block into per-row ``(m, S, W)`` on chip and finalises them, as
``scan.elsa_fwd`` does with one partition.

Scope (``eligible`` says why a call is not taken, and the launcher then runs ``scan.elsa_fwd``):
fp16/bf16, or fp32 in ``strict`` or ``turbo`` mode (``precise`` stays on the portable kernel), on a CUDA device of
compute capability 9.x with Gluon available (Triton >= 3.6); dense calls without a mask, ``q_lengths``/
``kv_lengths`` or state output; for the wgmma kernel a positive scale (it is applied after the row max); causal
(bottom-right) or not; GQA/MQA by head index; head dims D, Dv in {16, 32, 64, 128} (Gluon tiles are powers of
two; 256 does not fit), other head dims on the portable kernel; any Nq, Nk (TMA zero-fills past the end and the
last tiles are masked); any strides whose inner dim is contiguous and whose other strides are 16-byte multiples. The Triton interpreter cannot run Gluon, so this path
is tested on the GPU only (tests/test_kernels_gpu.py); every CPU test runs ``scan.elsa_fwd``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

from . import knobs, replay
from .occupancy import _cuda_index, _sms, capability, causal_head_group

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

# "0": off (the portable kernel runs); "1" or unset: by size (see MIN_WORK); "force": whenever in scope
ENV = knobs.HOPPER
_ENV_VALUES = knobs.KNOBS[ENV].choices
# Eager calls with less work than these (B·H·Nq·Nk·D, halved when causal) run the portable kernel when their Gluon
# launch costs more host time than the portable one's: without launch plans, or with a Triton whose descriptor
# launch replay.encodes_descriptors does not reproduce. With launch plans replaying encoded TMA maps (version 16)
# the Gluon launch costs no more (H100, launcher alone per call, medians: 28-29 vs 34-37 µs), and eager calls take
# the Gluon kernel at every size: it was faster in 100 of 106 cells timed eagerly (benchmarks/lab/eager_thresholds.py,
# best of 2-3 rounds, docs/perf/raw/eager_thresholds_h100_v16*.jsonl; 8e6 to 1.7e10 of work, N = 77 to 4K,
# bf16/fp16/strict/turbo), slower at N = 197 D = 64 non-causal (bf16/fp16 13.5-14.2 vs 12.8-13.1 µs with the
# 128-row tiles of then; see SHORT_KEYS) and strict 1x2x1024x128 (220 vs 198-199 µs: 32 programs), even (within
# 1%) at fp16 N = 197 and strict N = 77 causal. Without encoded maps, from session 10 (bf16: the Gluon launch ~30 µs
# more host time per public call, more than its kernel saves below 1e10: 1K H=32 D=128 39.7 vs 51.1 µs); captured
# calls pay the host time once and take the Gluon kernel at every size
MIN_WORK = 1e10
# The same for the fp32 (strict) kernel, which saves more kernel time per unit of work: eager public calls on an
# H100 (session 11, medians of 3 rounds of 200): work 1.1e9 (1x32x512x128) portable 376 us vs Gluon 226 us;
# 5.4e8: 310 vs 239 us (8x16x257x64) but 203 vs 236 us (1x8x1024x64); 2.4e8-2.7e8: 181-187 vs 217-226 us.
# With launch plans (session 13, kernels/replay.py: both launches cost about the same host time), eager do_bench
# medians of 2 rounds (docs/perf/raw/thresholds_eager_h100_v14.jsonl): 2.7e8 1x4x1024x64 168-214 vs 116 us, 1x8x1024x64
# causal 181 vs 110 us, but 1x2x1024x128 200 vs 221 us; 1.3e8 1x4x1024x64 causal 182 vs 105 us but 1x8x512x64 88 vs
# 111-115 us: work alone does not separate them below ~2.5e8
MIN_WORK_FP32 = 2.5e8
# The same for the TF32 (turbo) kernel, whose kernel saves less than strict's: eager public calls on an H100
# (session 12, medians of 3 rounds of 200): work 5.4e8 297 vs 291 us (1x8x1024x64) but 165 vs 208 us
# (8x16x257x64); 1.1e9 (1x32x512x128) 134 vs 173 us; 2.0e9-4.3e9: Gluon 1-5% faster (8x12x577x64, 1x32x1024x128)
MIN_WORK_TF32 = 2e9

# Lazy rescaling of the fp16/bf16 kernel's accumulator: a row's running max m (log2 units) moves only when a tile's
# max exceeds it by more than RESCALE_SLACK, so exp2(s - m) <= 2**RESCALE_SLACK for every score folded in (256: far
# from fp16's 65504). The fold stays exact: S and W are both taken against the same reference m, whichever it is,
# and lse = m + log2(S) as before. After the first tiles a row's max rarely grows that much, and a warp whose rows
# all keep their max skips the accumulator's rescale (64 multiplies a thread and key tile at 128 x 64 tiles,
# D = 128): the decision is a warp vote, in PTX, since Gluon has no warp-level branch (a CTA-wide vote through
# shared memory cost what it saved, docs/perf/history.md v11). Measured on an H100 (v17): D = 128 non-causal 2-6 % faster.
# The vote and its branch cost a few instructions a tile and split ptxas's scheduling region, which pays off once a
# row block folds enough key tiles for its max to settle: graph-replayed A/B on an H100 (v17), lazy against eager
# rescale: 16 tiles (D = 128 non-causal 1K) and more 1-6 % faster; 8 (D = 128 causal 1K, D = 64 1K) 0.7-2.4 % slower.
RESCALE_SLACK = 8.0
LAZY_MIN_TILES = 16
# "0": rescale the accumulator on every key tile; "1" or unset: lazily from LAZY_MIN_TILES key tiles a row block
# (half of them for causal calls); "force": lazily at every size
ENV_LAZY = knobs.HOPPER_LAZY
_LAZY_VALUES = knobs.KNOBS[ENV_LAZY].choices


def lazy_rescale(n_k: int, block_n: int, is_causal: bool) -> bool:
    """Whether the fp16/bf16 kernel rescales lazily (``RESCALE_SLACK``) for ``n_k`` keys in tiles of ``block_n``."""
    how = knobs.get(ENV_LAZY)
    if how != "1":
        return how == "force"
    return -(-n_k // block_n) / (2 if is_causal else 1) >= LAZY_MIN_TILES


def _rescale_asm(pack: int) -> str:
    """PTX of one inline-asm block over ``pack`` accumulator elements: outputs $0.. tied to the accumulator inputs,
    then ``pack`` alphas and ``pack`` copies of the warp's vote (all equal); multiplies only when the vote is set."""
    acc, alpha, vote = pack, 2 * pack, 3 * pack
    muls = "\n".join(f"mul.f32 ${i}, ${acc + i}, ${alpha + i};" for i in range(pack))
    return ("{\n.reg .pred p;\n"
            f"setp.ne.b32 p, ${vote}, 0;\n"
            "@!p bra.uni skip;\n"
            f"{muls}\n"
            "skip:\n}")


def _rescale_constraints(pack: int) -> str:
    return ",".join(["=r"] * pack + [str(i) for i in range(pack)] + ["r"] * (2 * pack))


# a thread's two rows of an NVMMA tile (rows lane/4 and lane/4 + 8 of its warp's 16): 1 when any row of the warp
# has alpha != 1 (its max moved), else 0, in both outputs
_VOTE_ASM = """{
.reg .pred p, q;
setp.neu.f32 p, $2, 0f3F800000;
setp.neu.f32 q, $3, 0f3F800000;
or.pred p, p, q;
vote.sync.any.pred p, p, -1;
selp.b32 $0, 1, 0, p;
mov.b32 $1, $0;
}"""

if gluon is not None:
    _LN2 = gl.constexpr(0.6931471805599453)
    _SLACK = gl.constexpr(RESCALE_SLACK)
    _RESCALE_16 = gl.constexpr(_rescale_asm(16))
    _RESCALE_16_C = gl.constexpr(_rescale_constraints(16))
    _RESCALE_8 = gl.constexpr(_rescale_asm(8))
    _RESCALE_8_C = gl.constexpr(_rescale_constraints(8))
    _VOTE = gl.constexpr(_VOTE_ASM)

    @gluon.jit
    def _rescale_lazily(acc, alpha, row_o: gl.constexpr, PER_THREAD: gl.constexpr):
        """``acc * alpha[:, None]``, skipped by every warp whose rows all have alpha == 1 (``RESCALE_SLACK``).
        ``alpha``: the rows' factors in the score tile's row layout (two rows a thread); ``PER_THREAD``: the
        accumulator's elements a thread (a multiple of 8)."""
        vote = gl.inline_asm_elementwise(_VOTE, "=r,=r,r,r", [alpha], dtype=gl.int32, is_pure=True, pack=2)
        vote = gl.expand_dims(gl.convert_layout(vote, row_o), 1)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if PER_THREAD % 16 == 0:
            acc = gl.inline_asm_elementwise(_RESCALE_16, _RESCALE_16_C, [acc, alpha_o, vote], dtype=gl.float32,
                                            is_pure=True, pack=16)
        else:
            acc = gl.inline_asm_elementwise(_RESCALE_8, _RESCALE_8_C, [acc, alpha_o, vote], dtype=gl.float32,
                                            is_pure=True, pack=8)
        return acc

    @gluon.jit
    def _grid_block(n_blocks, head_group, IS_CAUSAL: gl.constexpr, LAST_IS_HEAVIEST: gl.constexpr):
        """``(block, batch x head)`` of this program, in a grid of ``n_blocks`` blocks for each (batch, head) pair.
        Causal grids are ordered as ``scan.heaviest_first`` orders them: the heaviest blocks of each group of
        ``head_group`` heads (occupancy.causal_head_group) run first together, counting down from the last block
        (``LAST_IS_HEAVIEST``: a row block sees more keys the later it is) or up from the first (a key block is seen
        by more rows the earlier it is). Other grids: block-minor."""
        pid = gl.program_id(0)
        if IS_CAUSAL:
            n_bh = gl.num_programs(0) // n_blocks
            per_group = n_blocks * head_group
            g = pid // per_group
            gh = gl.minimum(head_group, n_bh - g * head_group)  # the last group may be smaller
            r = pid - g * per_group
            j = r // gh
            if LAST_IS_HEAVIEST:
                j = n_blocks - 1 - j
            bh = g * head_group + r % gh
        else:
            bh = pid // n_blocks
            j = pid % n_blocks
        return j, bh

    @gluon.jit
    def _program_block(n_mblocks, Hq, G, head_group, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """``(b, h, hk, m0)`` of this program. Causal grids run the row blocks with the most keys first across
        each group of ``head_group`` heads (:func:`_grid_block`), as ``scan.elsa_fwd`` does."""
        mb, bh = _grid_block(n_mblocks, head_group, IS_CAUSAL, True)
        b = bh // Hq
        h = bh % Hq
        return b, h, h // G, mb * BLOCK_M

    @gluon.jit
    def _key_range(Nq, Nk, m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """``(n_full, n_tiles)``: this row block sees keys [0, n_end) in n_tiles tiles; the tiles below n_full
        need no mask (every row sees them)."""
        off = Nk - Nq
        n_end = Nk
        n_full = (Nk // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            n_end = gl.minimum(Nk, m0 + BLOCK_M + off)
            n_full = gl.minimum(n_full, ((m0 + off + 1) // BLOCK_N) * BLOCK_N)
        return gl.maximum(n_full, 0), gl.cdiv(gl.maximum(n_end, 0), BLOCK_N)

    @gluon.jit
    def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, b, hk, n0, stage):
        bar = bars.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], bar, v_smem.index(stage))

    @gluon.jit
    def _start(q_desc, k_desc, v_desc, b, h, hk, m0, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """A program's key range (``_key_range``) and shared memory (Q tile, ring of K/V stages, their mbarriers):
        the first STAGES K/V tiles issued, Q loaded (returned as ``[BLOCK_M, HEAD_D]``)."""
        n_full, n_tiles = _key_range(Nq, Nk, m0, BLOCK_M, BLOCK_N, IS_CAUSAL)
        dtype: gl.constexpr = q_desc.dtype
        q_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_D], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_bar, q_tile)
        for i in gl.static_range(STAGES):
            if i < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, i * BLOCK_N, i)
        mbarrier.wait(q_bar, 0)
        return q_tile.reshape([BLOCK_M, HEAD_D]), k_ring, v_ring, bars, q_bar, n_full, n_tiles

    @gluon.jit
    def _row_state(m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DV: gl.constexpr, row_layout: gl.constexpr,
                   col_layout: gl.constexpr, o_layout: gl.constexpr):
        """The fold's per-row state before the first key (m = -inf, S = 0, W = 0), the rows' and a tile's key
        indices."""
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        return m_i, l_i, acc, rows, gl.arange(0, BLOCK_N, layout=col_layout)

    @gluon.jit
    def _kv_tile(k_ring, v_ring, bars, j, STAGES: gl.constexpr):
        """``(stage, K tile, V tile)`` of key tile ``j``, once its TMA loads have landed."""
        st = j % STAGES
        mbarrier.wait(bars.index(st), (j // STAGES) & 1)
        k_tile = k_ring.index(st)
        v_tile = v_ring.index(st)
        return (st, k_tile.reshape([k_tile.shape[2], k_tile.shape[3]]),
                v_tile.reshape([v_tile.shape[2], v_tile.shape[3]]))

    @gluon.jit
    def _visible_scores(s, n0, n_full, rows, cols, Nk, off, IS_CAUSAL: gl.constexpr):
        """Scores of keys a row does not see set to -inf: only the tiles at the ragged end or the causal
        diagonal (from ``n_full`` on) need it."""
        if n0 + s.shape[1] > n_full:
            keys = n0 + cols
            visible = gl.expand_dims(keys < Nk, 0)
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + off, 1))
            s = gl.where(visible, s, float("-inf"))
        return s

    @gluon.jit
    def _release(q_bar, bars, STAGES: gl.constexpr):
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _store_rows(ptr, x, b, h, s_b, s_h, s_n, rows, Nrows, COLS: gl.constexpr, layout: gl.constexpr):
        """``x [R, COLS]`` (``layout``) into rows ``rows`` (< Nrows) of ``ptr[b, h]`` (inner stride 1)."""
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        ptrs = (ptr + b.to(gl.int64) * s_b + h.to(gl.int64) * s_h + gl.expand_dims(rows.to(gl.int64) * s_n, 1)
                + gl.expand_dims(cols, 0))
        gl.store(ptrs, x, mask=gl.expand_dims(rows < Nrows, 1))

    @gluon.jit
    def _store_lse(lse_ptr, m_i, l_i, rows, b, h, s_lb, s_lh, s_ln, Nq):
        """lse = ln(S) + m (m in log2 units); rows with no key: -inf."""
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_i)) * _LN2)
        gl.store(lse_ptr + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows.to(gl.int64) * s_ln, lse,
                 mask=rows < Nq)

    @gluon.jit
    def _elsa_fwd_sm90(q_desc, k_desc, v_desc, o_desc, lse_ptr, s_lb, s_lh, s_ln, Nq, Nk, Hq, G, qk_scale,
                       n_mblocks, head_group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       WRITE_LSE: gl.constexpr, TF32: gl.constexpr, LAZY: gl.constexpr, num_warps: gl.constexpr):
        """fp16/bf16, or fp32 with TF32 products (``turbo``; ``TF32``). ``LAZY``: the accumulator is rescaled only
        when a row's max grows by more than ``RESCALE_SLACK`` (``_rescale_lazily``). A TF32 wgmma reads both shared
        operands K-major, which V's tile (keys x Dv, Dv contiguous) is not for P·V: each V tile is transposed through
        registers into a keys-contiguous buffer once Q·Kᵀ has landed (issued while the wgmma was in flight, the
        transpose crashed ptxas 12.8 and 12.9 with a segmentation fault)."""
        b, h, hk, m0 = _program_block(n_mblocks, Hq, G, head_group, BLOCK_M, IS_CAUSAL)
        dtype: gl.constexpr = q_desc.dtype

        KI: gl.constexpr = 8 if TF32 else 16  # K of one wgmma instruction: 32 bytes of operand
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, KI])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DV, KI])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=1 if TF32 else 2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # the V transpose: two rows x four columns a thread, 16 x 2 threads a warp; with the 128-byte swizzle of
        # both tiles neither the loads nor the stores conflict on banks (gl.bank_conflicts at 64 x 128: 0 and 0)
        vt_rows: gl.constexpr = 1 if BLOCK_N < 64 else (BLOCK_N // 32 if BLOCK_N // 32 < num_warps else num_warps)
        vt_layout: gl.constexpr = gl.BlockedLayout([2, 4], [16, 2], [vt_rows, num_warps // vt_rows], [1, 0])

        off = Nk - Nq
        q_smem, k_ring, v_ring, bars, q_bar, n_full, n_tiles = _start(
            q_desc, k_desc, v_desc, b, h, hk, m0, Nq, Nk, BLOCK_M, BLOCK_N, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)
        if TF32:
            vt_smem = gl.allocate_shared_memory(
                dtype, [HEAD_DV, BLOCK_N], gl.NVMMASharedLayout.get_default_for([HEAD_DV, BLOCK_N], dtype))
        m_i, l_i, acc, rows, cols = _row_state(m0, BLOCK_M, BLOCK_N, HEAD_DV, row_s, col_s, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        for j in range(0, n_tiles):
            n0 = j * BLOCK_N
            st, k_smem, v_smem = _kv_tile(k_ring, v_ring, bars, j, STAGES)
            s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # raw Q·Kᵀ: the scale is applied below
            if TF32:
                vt_smem.permute((1, 0)).store(v_smem.load(vt_layout))
                fence_async_shared()
                v_smem = vt_smem.permute((1, 0))
            s = _visible_scores(s, n0, n_full, rows, cols, Nk, off, IS_CAUSAL)
            # qk_scale > 0 (``eligible``): the row max of the raw scores, scaled, is the max of the scaled
            # scores, and the scale folds into exp2's argument as one FMA per score (no separate multiply)
            m_tile = gl.max(s, 1) * qk_scale
            if LAZY:  # m moves only by more than the slack (rows with no visible key keep -inf)
                m_new = gl.where(m_tile > m_i + _SLACK, m_tile, m_i)
            else:
                m_new = gl.maximum(m_i, m_tile)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            # 1 where m stays, and before a row's first visible key (its S and W are still 0): no rescale
            alpha = gl.where((m_new == m_i) | (m_i == float("-inf")), 1.0, gl.exp2(m_i - m_use))
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            if LAZY:
                acc = _rescale_lazily(acc, alpha, row_o, BLOCK_M * HEAD_DV // (num_warps * 32))
            else:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if j + STAGES < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, (j + STAGES) * BLOCK_N, st)

        _release(q_bar, bars, STAGES)
        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)  # rows with no key: zeros
        o_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DV], o_desc.layout)
        o_tile.reshape([BLOCK_M, HEAD_DV]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m0, 0], o_tile)
        if WRITE_LSE:
            _store_lse(lse_ptr, m_i, l_i, rows, b, h, s_lb, s_lh, s_ln, Nq)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _elsa_fwd_sm90_fma(q_desc, k_desc, v_desc, o_ptr, s_ob, s_oh, s_on, lse_ptr, s_lb, s_lh, s_ln, Nq, Nk,
                           Hq, G, qk_scale, n_mblocks, head_group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, STAGES: gl.constexpr,
                           IS_CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, num_warps: gl.constexpr,
                           COMPENSATED: gl.constexpr = True):
        """``strict`` fp32: the same fold with both products as IEEE FMAs (no tensor cores), blocked in registers.

        Each thread owns strided rows and key columns (rows ``r + 32·i``, keys ``c + 8·j``), so that
        the eight threads of a warp reading a K tile touch eight consecutive keys: with the 128-byte swizzle of
        the TMA tiles their 16-byte loads fall in distinct banks (a thread owning 8 consecutive keys made every
        load an 8-way bank conflict: 12 instead of 38 TFLOP/s on an H100). Q and K are read 16 columns of D at
        a time (four 16-byte loads per row) into outer products; P goes through shared memory to become the
        left operand of P·V."""
        TC: gl.constexpr = 8  # threads of a warp along keys (and along V's columns); 4 along rows
        CO: gl.constexpr = 4 if HEAD_DV >= 32 else HEAD_DV // TC  # V columns per thread and 16-byte load
        KC: gl.constexpr = 16  # D (and key) columns per outer-product step: dot_fma needs K >= 16
        b, h, hk, m0 = _program_block(n_mblocks, Hq, G, head_group, BLOCK_M, IS_CAUSAL)
        s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TC, TC], [num_warps, 1], [1, 0])
        o_layout: gl.constexpr = gl.BlockedLayout([1, CO], [32 // TC, TC], [num_warps, 1], [1, 0])
        qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=0)
        kb_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_layout, k_width=0)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=0)
        vb_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o_layout, k_width=0)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # P: 16-byte chunks swizzled by row, so that the row-strided reads of the P·V operand avoid conflicts
        p_shared: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])

        p_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], p_shared)
        off = Nk - Nq
        q_smem, k_ring, v_ring, bars, q_bar, n_full, n_tiles = _start(
            q_desc, k_desc, v_desc, b, h, hk, m0, Nq, Nk, BLOCK_M, BLOCK_N, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)
        m_i, l_i, acc, rows, cols = _row_state(m0, BLOCK_M, BLOCK_N, HEAD_DV, row_s, col_s, o_layout)
        comp = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)

        for j in range(0, n_tiles):
            n0 = j * BLOCK_N
            st, k_smem, v_smem = _kv_tile(k_ring, v_ring, bars, j, STAGES)
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            for d in gl.static_range(0, HEAD_D, KC):
                s = gl.dot_fma(q_smem.slice(d, KC, 1).load(qa_layout),
                               k_smem.slice(d, KC, 1).permute((1, 0)).load(kb_layout), s)
            s = _visible_scores(s * qk_scale, n0, n_full, rows, cols, Nk, off, IS_CAUSAL)  # any sign of scale
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p_smem.store(p)
            # the tile's P·V in a fresh accumulator, then one fused rescale-and-add: blocked summation, whose
            # rounding error grows with BLOCK_N + Nk / BLOCK_N instead of with Nk (one FMA chain over every key)
            pv = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)
            for c in gl.static_range(0, BLOCK_N, KC):
                pv = gl.dot_fma(p_smem.slice(c, KC, 1).load(pa_layout), v_smem.slice(c, KC, 0).load(vb_layout),
                                pv)
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            if COMPENSATED:  # Kahan: the low-order bits that each add drops are carried into the next tile's add
                acc = acc * alpha_o
                y = pv - comp * alpha_o
                t = acc + y
                comp = (t - acc) - y
                acc = t
            else:
                acc = acc * alpha_o + pv
            if j + STAGES < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, (j + STAGES) * BLOCK_N, st)

        _release(q_bar, bars, STAGES)
        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)  # rows with no key: zeros
        _store_rows(o_ptr, out, b, h, s_ob, s_oh, s_on, m0 + gl.arange(0, BLOCK_M, layout=row_o), Nq, HEAD_DV,
                    o_layout)
        if WRITE_LSE:
            _store_lse(lse_ptr, m_i, l_i, rows, b, h, s_lb, s_lh, s_ln, Nq)


# strict: each key tile's P·V is added to the running output with Kahan compensation (benchmarks/lab/strict_accuracy.py)
STRICT_COMPENSATED = True
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
HEAD_DIMS = (16, 32, 64, 128)  # D = 256 would not fit the registers at these tiles


def mode() -> str:
    return knobs.get(ENV)


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _kind(dtype: torch.dtype, precision: Optional[str]) -> Optional[str]:
    """Which Hopper kernel a dtype and fp32 mode run on: ``"lowp"`` (fp16/bf16 wgmma), ``"tf32"`` (``turbo``:
    the same wgmma kernel on fp32 tiles), ``"fma"`` (``strict``), ``None`` (``precise``: none)."""
    if dtype != torch.float32:
        return "lowp"
    return {"strict": "fma", "turbo": "tf32"}.get(precision or "strict")


def _descriptor_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and replay.aligned16(t)
            and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:-1]))


def eligible(q, k, v, out, *, mask, q_lengths, kv_lengths, varlen: bool, state, scale: float,
             precision: Optional[str], is_causal: bool = False, how: Optional[str] = None) -> Optional[str]:
    """``None`` when this call runs on a Hopper kernel, else the reason it does not (dense q ``[B,H,N,D]``).
    ``precision``: the fp32 mode (``None`` is ``strict``); ``how``: :func:`mode`, when the caller has read it."""
    how = mode() if how is None else how
    if how == "0":
        return f"{ENV}=0"
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if q.device.type != "cuda":
        return "not a CUDA device"
    if capability(_cuda_index(q.device))[0] != 9:
        return "not a Hopper (sm_90) device"
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype}"
    kind = _kind(q.dtype, precision)
    if kind is None:
        return (f"precision {precision!r} (fp32 Gluon kernels: strict's IEEE FMA products and turbo's TF32; "
                "precise's three products run on the portable kernel)")
    if varlen or state is not None or mask is not None or q_lengths is not None or kv_lengths is not None:
        return "masks, lengths, varlen and state output run on the portable kernel"
    if kind != "fma" and not scale > 0:
        return f"scale {scale} <= 0 (the wgmma kernel applies the scale after the row max)"
    D, Dv = q.shape[-1], v.shape[-1]
    if D not in HEAD_DIMS or Dv not in HEAD_DIMS:
        return f"head dims D={D}, Dv={Dv} (Gluon tiles need powers of two: one of {HEAD_DIMS})"
    if not all(_descriptor_ok(t) for t in (q, k, v, out)):
        return "strides not TMA-compatible (inner dim contiguous, others 16-byte multiples, 16-byte base)"
    work = float(q.shape[0] * q.shape[1]) * q.shape[2] * k.shape[2] * D * (0.5 if is_causal else 1.0)
    least = {"lowp": MIN_WORK, "tf32": MIN_WORK_TF32, "fma": MIN_WORK_FP32}[kind]
    if (how != "force" and work < least and not torch.cuda.is_current_stream_capturing()
            and not replay.encodes_descriptors(q)):
        return (f"small eager call (work {work:.2g} < {least:.0e}) without encoded TMA maps (launch plans off, or "
                "this Triton's descriptor launch differs): the portable kernel's launch is cheaper")
    return None


ENV_TILES = knobs.HOPPER_TILES  # "BLOCK_M,BLOCK_N,STAGES,num_warps", for tile sweeps (recipes/bench_attention.py)


# Grids of fewer 128-row programs than this many per SM take 64-row tiles (more, smaller programs balance
# better on 132 SMs), measured on an H100 in session 10 (bf16, graph-replayed, docs/perf/history.md v11): non-causal
# D=128 N=1K H=8 (64 programs) 1.04x cuDNN vs 0.84x; causal D=128 N=1K H=32 (256) 0.95x vs 0.91x, but at
# N=4K H=32 (1024) 128-row tiles: 0.89x vs 0.85x; non-causal D=64 N=2K H=8 (128) 1.00x vs 0.81x, N=4K H=8 (256)
# 128-row tiles: 0.99x vs 0.90x
SMALL_GRID_PER_SM = 1
CAUSAL_SMALL_GRID_PER_SM = 4
# Non-causal calls with narrow heads and at most this many keys take 64-row tiles at every grid size (version 16,
# H100, graph-replayed, `benchmarks/lab/sweep_short_tiles.py --group vit-hopper`, docs/perf/raw/hopper_short_tiles_h100_v16.log):
# ViT shapes at batch 8, N = 197 to 1601, 64 x 128 tiles took 0.88-1.01x the time of 128 x 128 (N = 197: 12.8 vs
# 14.2 µs; N = 785: 52.6 vs 59.6), N = 2048 0.92-0.99x; from 3072 keys 128 x 128 is faster (N = 4096 B = 1: 80.9
# vs 89.9 µs)
SHORT_KEYS = 2048
# fp32 kernel, D > 64: grids of at least this many 128-row programs per SM take 128 x 32 tiles with eight warps
FMA_WIDE_GRID_PER_SM = 4


def _forced_tiles():
    return knobs.get(ENV_TILES)


def tiles(d: int, dv: int, is_causal: bool, *, tiles_128: int = 0, sms: int = 132, n_k: Optional[int] = None):
    """``(BLOCK_M, BLOCK_N, STAGES, num_warps)``, shared memory under 113 KB so that two CTAs share an SM.
    ``tiles_128``: programs of the grid with 128-row tiles. Measured on an H100 (docs/perf/history.md, sessions 9-10):
    128 x 64 at D = 128, 128 x 128 for narrower heads; 64-row tiles for small grids; 64 x 128 (three CTAs per
    SM) for causal calls with narrow heads at every size (N=4K H=8 D=64 1.14x cuDNN, 64 x 64: 0.90x), and for
    non-causal ones over at most ``SHORT_KEYS`` keys (``n_k``)."""
    forced = _forced_tiles()
    if forced:
        return forced
    wide = max(d, dv) > 64
    small = tiles_128 < (CAUSAL_SMALL_GRID_PER_SM if is_causal else SMALL_GRID_PER_SM) * sms
    short = n_k is not None and n_k <= SHORT_KEYS
    if not wide and (is_causal or small or short):
        return 64, 128, 2, 4
    if small:
        return 64, 64, 2, 4
    return (128, 64, 2, 8) if wide else (128, 128, 2, 8)


def fma_tiles(d: int, dv: int, is_causal: bool, *, tiles_128: int = 0, sms: int = 132):
    """``(BLOCK_M, BLOCK_N, STAGES, num_warps)`` of the fp32 (``strict``) kernel; ``ELSA_HOPPER_TILES`` forces
    them as for :func:`tiles`. Measured on an H100 (docs/perf/history.md, v12): 64 x 64 with four warps for D <= 64 (two
    CTAs an SM); for wider heads 32-key tiles (shared memory), 128 rows with eight warps on large grids."""
    forced = _forced_tiles()
    if forced:
        return forced
    if max(d, dv) <= 64:
        return 64, 64, 2, 4
    return (128, 32, 2, 8) if tiles_128 >= FMA_WIDE_GRID_PER_SM * sms else (64, 32, 2, 4)


def tf32_tiles(d: int, dv: int, is_causal: bool, *, tiles_128: int = 0, sms: int = 132):
    """``(BLOCK_M, BLOCK_N, STAGES, num_warps)`` of the TF32 (``turbo``) kernel; ``ELSA_HOPPER_TILES`` forces them
    as for :func:`tiles`. fp32 tiles take twice the shared memory of fp16 ones: 128 x 64 with eight warps (224 KB
    at D = 128, one CTA an SM) was the fastest tile from 1K to 16K keys on an H100 (docs/perf/history.md, v13), except on
    grids too small to fill the SMs (64 rows) and narrow-head causal grids under 4 programs an SM (64 x 64)."""
    forced = _forced_tiles()
    if forced:
        return forced
    wide = max(d, dv) > 64
    if tiles_128 < SMALL_GRID_PER_SM * sms:
        return (64, 32, 2, 4) if wide else (64, 128, 2, 4)
    if is_causal and not wide and tiles_128 < CAUSAL_SMALL_GRID_PER_SM * sms:
        return 64, 64, 2, 4
    return 128, 64, 2, 8


def _desc(t: torch.Tensor, block):
    layout = _layout(tuple(block), t.dtype)
    if type(t) is torch.Tensor or not _is_fake(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
    # launch.precompile records the launches on fake tensors. The descriptor's checks read its base's data_ptr(),
    # which a fake tensor refuses in torch 2.11 (a RuntimeError: session 57's GPU run) and answers with a deprecation
    # warning in 2.14. Triton specialises a descriptor on its dtype, block and layout alone, and the recorded launch
    # is only compiled, never run: the fields are set without the checks (the real call's descriptor makes them).
    import dataclasses

    d = object.__new__(TensorDescriptor)
    given = dict(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=list(block), layout=layout)
    for f in dataclasses.fields(TensorDescriptor):
        object.__setattr__(d, f.name, given[f.name] if f.name in given else f.default)
    return d


def forward(q, k, v, out, lse, *, scale: float, is_causal: bool, precision: Optional[str] = None):
    """``out [B, Hq, Nq, Dv]`` (any TMA-compatible strides) and optionally ``lse [B, Hq, Nq]`` fp32: the wgmma kernel
    for fp16/bf16 and for fp32 ``turbo`` (TF32), the FMA kernel for fp32 ``strict`` (``precision``)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kind = _kind(q.dtype, precision)
    if kind is None:
        raise ValueError(f"precision {precision!r} has no Hopper kernel (see eligible)")
    fma = kind == "fma"
    pick = {"lowp": tiles, "tf32": tf32_tiles, "fma": fma_tiles}[kind]
    extra = {"n_k": Nk} if kind == "lowp" else {}
    bm, bn, stages, warps = pick(D, Dv, is_causal, tiles_128=-(-Nq // 128) * B * Hq, sms=_sms(q.device), **extra)
    n_mb = -(-Nq // bm)
    head_group = (causal_head_group(q.device, n_k=Nk, kv_bytes_per_key=q.element_size() * (D + Dv),
                                    groups=Hq // Hkv, bh=B * Hq, m_blocks=n_mb) if is_causal else 1)
    descs = _desc(q, [1, 1, bm, D]), _desc(k, [1, 1, bn, D]), _desc(v, [1, 1, bn, Dv])
    # fma: the output is stored from registers (through its strides); the wgmma kernel: through a TMA descriptor
    o_args = (out, *out.stride()[:3]) if fma else (_desc(out, [1, 1, bm, Dv]),)
    lse_args = (lse if lse is not None else out, *(lse.stride() if lse is not None else (0, 0, 0)))
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_D=D, HEAD_DV=Dv, STAGES=stages, IS_CAUSAL=bool(is_causal),
                  WRITE_LSE=lse is not None, num_warps=warps)
    if fma:
        kernel = _elsa_fwd_sm90_fma
        consts["COMPENSATED"] = STRICT_COMPENSATED
    else:
        kernel = _elsa_fwd_sm90
        consts["TF32"] = kind == "tf32"
        # fp16/bf16 only: at TF32 it measured 0-7 % slower at D = 64 and mixed at D = 128 (docs/perf/history.md, v17)
        consts["LAZY"] = kind == "lowp" and lazy_rescale(Nk, bn, is_causal)
        if warps >= 8 and kind == "lowp":
            # at most 128 registers a thread, so that two CTAs of eight warps (or one of sixteen) share an SM
            # (ptxas may take more); the fp32 kernels run one CTA an SM (shared memory) and need up to 196
            consts["maxnreg"] = 128
    try:
        replay.launch(kernel, (n_mb * B * Hq,), *descs, *o_args, *lse_args, Nq, Nk, Hq, Hq // Hkv,
                      float(scale) * LOG2E, n_mb, head_group, **consts)
    except Exception as e:
        from triton.runtime.errors import OutOfResources

        if isinstance(e, OutOfResources) and _forced_tiles():
            # nothing was launched: the caller's tensors are as they were
            raise ValueError(f"{ENV_TILES}={knobs.raw(ENV_TILES)!r} does not fit this GPU's {e.name} for "
                             f"{q.dtype} ({kind}) at D={D}, Dv={Dv}: {e.required} needed, {e.limit} available; "
                             "use smaller tiles or unset it") from e
        raise
    return out, lse


# every kernel's Triton cache key computed callees first, once, at import (internals.settle_cache_keys)
if gluon is not None:
    from . import internals  # noqa: E402

    internals.settle_cache_keys(globals())
