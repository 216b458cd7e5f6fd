"""The backward on Hopper (sm_90), in Gluon: strict's FMA passes and (session 59) one fp16/bf16 kernel.

fp16/bf16 (:func:`_lowp_bwd`, where ``ELSA_BWD_DQ=gluon`` asks for it): one program per key block of 64 keys
a warpgroup and (batch, K/V head), looping over the query tiles that see it, five products a tile on the tensor
cores (wgmma), dQ added into an fp32 buffer by TMA reduce-adds where Triton's Gluon has them, else by atomic adds.
The portable passes' deterministic form runs seven N x N products against cuDNN's five (docs/PERF.md, sessions 41
and 57: 0.73-0.81x cuDNN forward + backward at 4K and 16K non-causal); this kernel runs five. Exact on an H100
(session 60, Triton 3.6, atomic dQ: gradients as close to float64 as the row pass's) but 0.79-0.96x the row pass's
speed at 4K, D = 64 and 128 (docs/PERF.md): its products, softmax and dQ adds run one after another in each program.
It runs in the form ``ELSA_BWD_LOWP`` names (:func:`lowp_form`): ``plain``, ``overlap`` (:func:`_lowp_bwd`'s
``OVERLAP``), ``ws`` (:func:`_lowp_bwd_ws`, warp-specialised: a warpgroup of its own runs dQ's product and adds;
session 61, H100, the kernel alone at 4K: D = 64 0.90x the plain form's time non-causal, 0.91x causal) or ``ws2``,
the default (the same kernel with each of its two compute warpgroups a partition of its own, head dims up to 64;
session 62, H100, at 4K, D = 64: 0.85x ws's time non-causal through the public call, 0.87x causal for the kernels
alone), where ``backward_launch.gluon_auto`` or ``ELSA_BWD_DQ=gluon`` sends a call.

strict: every product an IEEE fp32 FMA (no tensor cores), blocked in
registers as the forward's ``hopper._elsa_fwd_sm90_fma``, with its layouts and TMA tiles.

Triton's FMA dot ran the portable backward (``backward.py``, dot kind 1) at ~5-6 TFLOP/s on an H200, 0.21-0.22x
ME-SDPA's forward + backward (docs/perf/history.md, sessions 39 and 45), where the forward's Gluon FMA kernel reaches
72-77 % of the GPU's IEEE SGEMM. Two kernels, deterministic (no atomics) as the portable passes with dQ by rows;
under ``ELSA_BWD_DQ=atomic`` (``backward_launch.atomic_dq``) the kv pass also adds dQ with atomics and the dQ pass
is skipped:

* :func:`_strict_bwd_kv` one program per (key block, batch, K/V head): K and V stay in shared memory; the query and
  output-gradient tiles of every query head of its group (GQA reduced here) stream through a TMA ring, from the
  causal diagonal on. Keys-major: ``s^T = K·q^T``, ``p^T = exp2(min(s^T·scale·log2e - lse2, 0))`` (the note above
  ``_key_block``), ``dP^T = V·dO^T``, ``dS^T = p^T (dP^T - delta)``; ``p^T`` and ``dS^T`` go through shared memory
  to become the left operands of ``dV += p^T·dO`` and ``dK += dS^T·q``. Each query tile's two products are summed in
  a fresh accumulator and then added (blocked summation, as the forward's P·V).
* :func:`_strict_bwd_dq` one program per (query block, batch, query head): q and dO stay in shared memory; K/V tiles
  stream; ``dS`` as above, rows-major, through shared memory into ``dQ += dS·K``.

``delta = rowsum(dO * out)`` comes from ``backward.bwd_delta`` (the launcher's). Scope (:func:`eligible`; other calls
run the portable passes): fp32 ``strict``, dense calls without a mask, lengths, varlen, dropout or a mask gradient,
head dims D, Dv in ``hopper.HEAD_DIMS``, TMA-compatible q, k, v and dO, a CUDA device of compute capability 9.x with
Gluon. The interpreter cannot run Gluon: tests/test_backward.py's GPU tests check these kernels against float64, and
tools/compile_kernels.py compiles them for sm_90 without a GPU.
"""

from __future__ import annotations

from typing import Optional

from . import hopper, knobs, replay
from .hopper import LOG2E, gl, gluon
from .occupancy import causal_head_group

if gluon is not None:
    from .hopper import (_grid_block, _issue_kv, _kv_tile, _program_block, _release, _start, _store_rows,
                         _visible_scores)
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _LOG2E = gl.constexpr(LOG2E)

    if hasattr(tma, "async_atomic_add"):
        @gluon.jit
        def _dq_reduce_add(desc, coord, tile):
            """TMA reduce-add of ``tile`` into ``desc`` at ``coord``."""
            tma.async_atomic_add(desc, coord, tile)
    else:  # (Triton 3.6's Gluon: a kernel naming tma.async_atomic_add fails to hash even where the branch is off)
        @gluon.jit
        def _dq_reduce_add(desc, coord, tile):
            """Never traced: ``lowp_backward`` sets DQ_TMA only where :func:`dq_tma_available`."""
            gl.static_assert(False, "this Triton's Gluon has no TMA reduce-add (tma.async_atomic_add)")

    @gluon.jit
    def _fma_products(a_smem, b_smem, acc, K: gl.constexpr, KC: gl.constexpr, a_layout: gl.constexpr,
                      b_layout: gl.constexpr, B_ROWS: gl.constexpr):
        """``acc + a·b`` over ``K`` in steps of ``KC`` as IEEE FMAs: ``a_smem [M, K]``; ``b_smem [K, N]`` when
        ``B_ROWS`` (sliced by rows), else ``[N, K]`` (read transposed)."""
        for c in gl.static_range(0, K, KC):
            if B_ROWS:
                b = b_smem.slice(c, KC, 0).load(b_layout)
            else:
                b = b_smem.slice(c, KC, 1).permute((1, 0)).load(b_layout)
            acc = gl.dot_fma(a_smem.slice(c, KC, 1).load(a_layout), b, acc)
        return acc

    @gluon.jit
    def _row_stats_g(lse_ptr, delta_ptr, b, h, s_lb, s_lh, s_ln, rows, Nq):
        """A tile's ``lse`` in base 2 (+inf where the row sees no key or is past Nq: its probabilities are 0, never
        NaN) and ``delta``."""
        off = b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows.to(gl.int64) * s_ln
        ok = rows < Nq
        lse = gl.load(lse_ptr + off, mask=ok, other=float("-inf"))
        delta = gl.load(delta_ptr + off, mask=ok, other=0.0)
        return gl.where(lse == float("-inf"), float("inf"), lse * _LOG2E), delta

    # The key-block passes compute p^T = exp2(min(s^T·scale·log2e - lse2, 0)): p <= 1 for every key a row sees (lse
    # is at least each of its logits; the min only trims the recomputed logit's rounding), and keys past Nk in a
    # ragged last key block, which load as zeros (TMA's fill) and get no visibility test (non-causal), get p = 1
    # instead of exp2(-lse2). That was huge for a row whose logits are all very negative: it overflowed dS^T in fp16
    # (lse below about -11) or exp2 in fp32 (below -88), and `inf * 0` in dQ += dS·K put NaN into dQ (atomic dQ: the
    # fp16/bf16 kernel always, strict's under ELSA_BWD_DQ=atomic). Their p and dS now stay finite and meet K's zero
    # rows, and their dK, dV rows are not stored. The portable row pass had the same bug (the gradient fuzzer's find,
    # session 67, fixed there by masking); found here by reading, session 68.

    @gluon.jit
    def _key_block(n_nblocks, head_group, Hkv, Nq, Nk, G, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                   IS_CAUSAL: gl.constexpr):
        """``(b, hk, n0, off, mb_lo, per_head, n_tiles, m_full)`` of a key-block program: its (batch, K/V head) and
        first key, the query tiles that see its keys (from tile ``mb_lo`` of each of the group's ``G`` heads,
        ``per_head`` a head, ``n_tiles`` in all) and the first query row from which a tile sees every key of the
        block. Causal grids run the heaviest key blocks (the first: every later row sees them) first."""
        nb, bh = _grid_block(n_nblocks, head_group, IS_CAUSAL, False)
        b = bh // Hkv
        hk = bh % Hkv
        n0 = nb * BLOCK_N
        off = Nk - Nq
        n_mb = gl.cdiv(Nq, BLOCK_M)
        mb_lo = 0
        if IS_CAUSAL:  # row i sees key j when j <= i + off: the first row that sees key n0 is n0 - off
            mb_lo = gl.minimum(gl.maximum(n0 - off, 0) // BLOCK_M, n_mb)
        per_head = n_mb - mb_lo
        return b, hk, n0, off, mb_lo, per_head, per_head * G, n0 + BLOCK_N - 1 - off

    @gluon.jit
    def _query_tile(t, hk, G, mb_lo, per_head, BLOCK_M: gl.constexpr):
        """``(h, m0)``: the query head and first row of query tile ``t`` of a key-block program (:func:`_key_block`:
        ``per_head`` tiles of each of its group's ``G`` heads, from tile ``mb_lo`` on)."""
        return hk * G + t // per_head, (mb_lo + t % per_head) * BLOCK_M

    @gluon.jit
    def _key_block_start(q_desc, do_desc, k_desc, v_desc, b, hk, n0, G, mb_lo, per_head, n_tiles,
                         BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr,
                         STAGES: gl.constexpr):
        """A key-block program's shared memory: its K and V tiles (loaded, returned 2-D), a ring of STAGES q and dO
        stages with their mbarriers (the first STAGES issued) and the K/V tiles' mbarrier."""
        dtype: gl.constexpr = q_desc.dtype
        k_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], k_desc.layout)
        v_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DV], v_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DV], do_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_tile)
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_tile)
        for i in gl.static_range(STAGES):
            if i < n_tiles:
                h, m0 = _query_tile(i, hk, G, mb_lo, per_head, BLOCK_M)
                _issue_kv(q_desc, do_desc, q_ring, do_ring, bars, b, h, m0, i)
        mbarrier.wait(kv_bar, 0)
        return (k_tile.reshape([BLOCK_N, HEAD_D]), v_tile.reshape([BLOCK_N, HEAD_DV]), q_ring, do_ring, bars,
                kv_bar)

    @gluon.jit
    def _strict_bwd_kv(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh,
                       s_kn, dv_ptr, s_vb, s_vh, s_vn, dq_ptr, s_qb, s_qh, s_qn, Nq, Nk, Hkv, G, qk_scale, scale,
                       n_nblocks, head_group, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                       HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       ATOMIC_DQ: gl.constexpr, num_warps: gl.constexpr):
        """dK, dV of one key block (``BLOCK_N`` keys) of one (batch, K/V head), over the ``BLOCK_M``-row query tiles
        of its group's ``G`` query heads that see it. Causal grids run the key blocks with the most query rows (the
        first) first across groups of ``head_group`` (batch, K/V head) pairs. ``ATOMIC_DQ``: also ``dQ += dS·K``
        added into the fp32 ``dq`` with atomics (no dQ pass; not deterministic)."""
        TC: gl.constexpr = 8  # threads of a warp along a tile's columns, 4 along its rows (as the forward)
        KC: gl.constexpr = 16  # columns per outer-product step (dot_fma needs K >= 16)
        CK: gl.constexpr = 4 if HEAD_D >= 32 else HEAD_D // TC
        CV: gl.constexpr = 4 if HEAD_DV >= 32 else HEAD_DV // TC
        WK: gl.constexpr = 2 if HEAD_D > 64 else 1
        WV: gl.constexpr = 2 if HEAD_DV > 64 else 1
        s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TC, TC], [num_warps, 1], [1, 0])
        # accumulators past 64 columns: two warps along the columns, so that a thread holds at most 8 of them (the
        # right operand of one KC step, 16 x 8, stays 128 registers; ptxas spilled at D = 128 with 16 columns)
        k_layout: gl.constexpr = gl.BlockedLayout([1, CK], [32 // TC, TC], [num_warps // WK, WK], [1, 0])
        v_layout: gl.constexpr = gl.BlockedLayout([1, CV], [32 // TC, TC], [num_warps // WV, WV], [1, 0])
        sa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=0)
        sb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_layout, k_width=0)
        ka: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=k_layout, k_width=0)
        kb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=k_layout, k_width=0)
        va: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_layout, k_width=0)
        vb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=v_layout, k_width=0)
        keys_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        t_shared: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])

        b, hk, n0, off, mb_lo, per_head, n_tiles, m_full = _key_block(n_nblocks, head_group, Hkv, Nq, Nk, G,
                                                                       BLOCK_N, BLOCK_M, IS_CAUSAL)
        pt_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], t_shared)
        dst_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], t_shared)
        if ATOMIC_DQ:  # dS as computed rows-major too: the left operand of dS·K
            ds_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], t_shared)
        k_smem, v_smem, q_ring, do_ring, bars, kv_bar = _key_block_start(
            q_desc, do_desc, k_desc, v_desc, b, hk, n0, G, mb_lo, per_head, n_tiles, BLOCK_N, BLOCK_M, HEAD_D,
            HEAD_DV, STAGES)

        keys = n0 + gl.arange(0, BLOCK_N, layout=keys_s)
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, k_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DV], gl.float32, v_layout)
        for j in range(0, n_tiles):
            h, m0 = _query_tile(j, hk, G, mb_lo, per_head, BLOCK_M)
            st, q_smem, do_smem = _kv_tile(q_ring, do_ring, bars, j, STAGES)
            rows = m0 + gl.arange(0, BLOCK_M, layout=rows_s)
            lse2, delta = _row_stats_g(lse_ptr, delta_ptr, b, h, s_lb, s_lh, s_ln, rows, Nq)
            st_ = _fma_products(k_smem, q_smem, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout), HEAD_D, KC,
                                sa, sb, False)
            pt = gl.exp2(gl.minimum(st_ * qk_scale - gl.expand_dims(lse2, 0), 0.0))  # (p <= 1: above _key_block)
            if IS_CAUSAL:
                if m0 < m_full:
                    pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows + off, 0), pt, 0.0)
            dpt = _fma_products(v_smem, do_smem, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout), HEAD_DV, KC,
                                sa, sb, False)
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            pt_smem.store(pt)
            dst_smem.store(dst)
            if ATOMIC_DQ:
                ds_smem.permute((1, 0)).store(dst)
            dv += _fma_products(pt_smem, do_smem, gl.zeros([BLOCK_N, HEAD_DV], gl.float32, v_layout), BLOCK_M, KC,
                                va, vb, True)
            dk += _fma_products(dst_smem, q_smem, gl.zeros([BLOCK_N, HEAD_D], gl.float32, k_layout), BLOCK_M, KC,
                                ka, kb, True)
            if ATOMIC_DQ:
                dq = _fma_products(ds_smem, k_smem, gl.zeros([BLOCK_M, HEAD_D], gl.float32, k_layout), BLOCK_N, KC,
                                   ka, kb, True)
                qrows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, k_layout))
                qcols = gl.arange(0, HEAD_D, gl.SliceLayout(0, k_layout))
                gl.atomic_add(dq_ptr + b.to(gl.int64) * s_qb + h.to(gl.int64) * s_qh
                              + gl.expand_dims(qrows.to(gl.int64) * s_qn, 1) + gl.expand_dims(qcols, 0), dq * scale,
                              mask=gl.expand_dims(qrows < Nq, 1), sem="relaxed")
            nxt = j + STAGES
            if nxt < n_tiles:
                nh, nm0 = _query_tile(nxt, hk, G, mb_lo, per_head, BLOCK_M)
                _issue_kv(q_desc, do_desc, q_ring, do_ring, bars, b, nh, nm0, st)

        _release(kv_bar, bars, STAGES)
        _store_rows(dk_ptr, dk * scale, b, hk, s_kb, s_kh, s_kn,
                    n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, k_layout)), Nk, HEAD_D, k_layout)
        _store_rows(dv_ptr, dv, b, hk, s_vb, s_vh, s_vn, n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, v_layout)),
                    Nk, HEAD_DV, v_layout)

    @gluon.jit
    def _strict_bwd_dq(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dq_ptr, s_qb, s_qh,
                       s_qn, Nq, Nk, Hq, G, qk_scale, scale, n_mblocks, head_group, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, STAGES: gl.constexpr,
                       IS_CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """dQ of one query block (``BLOCK_M`` rows) of one (batch, query head), over the key tiles its rows see
        (the forward's walk: ``hopper._start``, heaviest row blocks first when causal)."""
        TC: gl.constexpr = 8
        KC: gl.constexpr = 16
        CQ: gl.constexpr = 4 if HEAD_D >= 32 else HEAD_D // TC
        s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TC, TC], [num_warps, 1], [1, 0])
        WQ: gl.constexpr = 2 if HEAD_D > 64 else 1  # as the kv pass's accumulators
        q_layout: gl.constexpr = gl.BlockedLayout([1, CQ], [32 // TC, TC], [num_warps // WQ, WQ], [1, 0])
        sa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=0)
        sb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_layout, k_width=0)
        qa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=0)
        qb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=q_layout, k_width=0)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        ds_shared: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])

        b, h, hk, m0 = _program_block(n_mblocks, Hq, G, head_group, BLOCK_M, IS_CAUSAL)
        off = Nk - Nq
        q_smem, k_ring, v_ring, bars, q_bar, n_full, n_tiles = _start(
            q_desc, k_desc, v_desc, b, h, hk, m0, Nq, Nk, BLOCK_M, BLOCK_N, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)
        dtype: gl.constexpr = q_desc.dtype
        do_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DV], do_desc.layout)
        ds_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], ds_shared)
        do_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(do_bar, count=1)
        fence_async_shared()
        mbarrier.expect(do_bar, do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_bar, do_tile)
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        cols = gl.arange(0, BLOCK_N, layout=col_s)
        lse2, delta = _row_stats_g(lse_ptr, delta_ptr, b, h, s_lb, s_lh, s_ln, rows, Nq)
        mbarrier.wait(do_bar, 0)
        do_smem = do_tile.reshape([BLOCK_M, HEAD_DV])

        dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, q_layout)
        for j in range(0, n_tiles):
            n0 = j * BLOCK_N
            st, k_smem, v_smem = _kv_tile(k_ring, v_ring, bars, j, STAGES)
            s = _fma_products(q_smem, k_smem, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), HEAD_D, KC,
                              sa, sb, False)
            s = _visible_scores(s * qk_scale, n0, n_full, rows, cols, Nk, off, IS_CAUSAL)
            p = gl.exp2(s - gl.expand_dims(lse2, 1))
            dp = _fma_products(do_smem, v_smem, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), HEAD_DV, KC,
                               sa, sb, False)
            ds_smem.store(p * (dp - gl.expand_dims(delta, 1)))
            dq += _fma_products(ds_smem, k_smem, gl.zeros([BLOCK_M, HEAD_D], gl.float32, q_layout), BLOCK_N, KC,
                                qa, qb, True)
            if j + STAGES < n_tiles:
                _issue_kv(k_desc, v_desc, k_ring, v_ring, bars, b, hk, (j + STAGES) * BLOCK_N, st)

        _release(q_bar, bars, STAGES)
        mbarrier.invalidate(do_bar)
        _store_rows(dq_ptr, dq * scale, b, h, s_qb, s_qh, s_qn,
                    m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, q_layout)), Nq, HEAD_D, q_layout)

    @gluon.jit
    def _store_lowp_kv(dk, dv, scale, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, b, hk, n0, Nk,
                       BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr,
                       dk_layout: gl.constexpr, dv_layout: gl.constexpr):
        """A key block's dK (times ``scale``) and dV (fp32 accumulators in their wgmma layouts) stored in dk_ptr's
        and dv_ptr's dtype."""
        _store_rows(dk_ptr, (dk * scale).to(dk_ptr.dtype.element_ty), b, hk, s_kb, s_kh, s_kn,
                    n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, dk_layout)), Nk, HEAD_D, dk_layout)
        _store_rows(dv_ptr, dv.to(dv_ptr.dtype.element_ty), b, hk, s_vb, s_vh, s_vn,
                    n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, dv_layout)), Nk, HEAD_DV, dv_layout)

    @gluon.jit
    def _dq_add(dq, scale, dq_desc, dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, h, m0, Nq, BLOCK_M: gl.constexpr,
                HEAD_D: gl.constexpr, DQ_TMA: gl.constexpr, num_warps: gl.constexpr, DQ_T: gl.constexpr = False):
        """``dq * scale`` (one query tile's share, registers) added into the fp32 ``dq`` at (b, h, rows m0...) through
        ``dq_smem``: by a TMA reduce-add (``DQ_TMA``; ``dq_smem`` the descriptor's [1, 1, BLOCK_M, HEAD_D] tile), else
        read back from ``dq_smem`` ([BLOCK_M, HEAD_D]) by atomic adds of 16 bytes a thread, 32 columns at a time."""
        if DQ_TMA:
            tma.store_wait(pendings=0)  # the previous tile's reduce-add has read the tile
            if DQ_T:  # (dq^T, [HEAD_D, BLOCK_M])
                dq_smem.reshape([BLOCK_M, HEAD_D]).permute((1, 0)).store(dq * scale)
            else:
                dq_smem.reshape([BLOCK_M, HEAD_D]).store(dq * scale)
            fence_async_shared()
            _dq_reduce_add(dq_desc, [b, h, m0, 0], dq_smem)
        else:
            DQ_CHUNK: gl.constexpr = 32 if HEAD_D > 32 else HEAD_D
            add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (DQ_CHUNK // 4), DQ_CHUNK // 4],
                                                        [num_warps, 1], [1, 0])
            if DQ_T:
                dq_smem.permute((1, 0)).store(dq * scale)
            else:
                dq_smem.store(dq * scale)
            qrows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, add_layout))
            base = dq_ptr + b.to(gl.int64) * s_qb + h.to(gl.int64) * s_qh + m0.to(gl.int64) * s_qn
            offs = gl.expand_dims(qrows * s_qn, 1) + gl.expand_dims(gl.arange(0, DQ_CHUNK, gl.SliceLayout(
                0, add_layout)), 0)
            ok = gl.expand_dims(m0 + qrows < Nq, 1)
            for c in gl.static_range(0, HEAD_D, DQ_CHUNK):
                gl.atomic_add(base + c + offs, dq_smem.slice(c, DQ_CHUNK, 1).load(add_layout), mask=ok,
                              sem="relaxed")

    @gluon.jit
    def _lowp_ds(k_smem, v_smem, q_smem, do_smem, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, b, h, m0, keys, off, m_full,
                 Nq, qk_scale, st_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, TOGETHER: gl.constexpr):
        """``(p^T, dS^T)`` (fp32, ``st_layout``) of one query tile of a key block: ``s^T = K·q^T`` and
        ``dP^T = V·dO^T`` on the tensor cores, issued together (``TOGETHER``) or dP^T once s^T is in, p^T computed
        while dP^T runs; keys a row does not see (causal, ``keys`` against its rows) get p = 0."""
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)  # (made here: not live across the loop)
        st_ = warpgroup_mma(k_smem, q_smem.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        if TOGETHER:
            dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        lse2, delta = _row_stats_g(lse_ptr, delta_ptr, b, h, s_lb, s_lh, s_ln, rows, Nq)
        if TOGETHER:
            st_ = warpgroup_mma_wait(num_outstanding=1, deps=(st_, ))
        else:
            st_ = warpgroup_mma_wait(num_outstanding=0, deps=(st_, ))
            dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        pt = gl.exp2(gl.minimum(st_ * qk_scale - gl.expand_dims(lse2, 0), 0.0))  # (p <= 1: above _key_block)
        if IS_CAUSAL:
            if m0 < m_full:
                pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows + off, 0), pt, 0.0)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        return pt, pt * (dpt - gl.expand_dims(delta, 0))

    @gluon.jit
    def _lowp_bwd(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh,
                  s_kn, dv_ptr, s_vb, s_vh, s_vn, dq_ptr, s_qb, s_qh, s_qn, Nq, Nk, Hkv, G, qk_scale, scale,
                  n_nblocks, head_group, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                  HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr,
                  OVERLAP: gl.constexpr, num_warps: gl.constexpr):
        """fp16/bf16: dK, dV of one key block (``BLOCK_N`` keys, 64 a warpgroup) of one (batch, K/V head) and its
        share of dQ, over the ``BLOCK_M``-row query tiles of its group's ``G`` query heads that see it; five
        products a tile on the tensor cores, keys-major: ``s^T = K·q^T``, then ``dP^T = V·dO^T`` (issued while
        p^T is computed), ``dV += p^T·dO`` and ``dK += dS^T·q`` with p^T and dS^T as register operands, and
        ``dQ_part = dS·K`` with dS through shared memory, added into the fp32 ``dq`` (zero-filled) by TMA
        reduce-adds (``DQ_TMA``) or atomic adds of 16 bytes a thread read back from shared memory: not
        deterministic. ``OVERLAP``: s^T and dP^T issued together, then dQ's product before dV's and dK's, and its
        adds made while those two run. (Session 60 tried dQ's product in flight into the next tile, its adds
        overlapping that tile's first products: ptxas then serialised every wgmma of the kernel, C7514, reading an
        accumulator carried across the loop's back edge as read before its wait.)"""
        WM: gl.constexpr = BLOCK_M // 16 if BLOCK_M // 16 < num_warps else num_warps  # dQ's warps along rows
        WN: gl.constexpr = num_warps // WM
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_D, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_DV, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                            instr_shape=[16, HEAD_D // WN, 16])
        pt_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dst_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)

        b, hk, n0, off, mb_lo, per_head, n_tiles, m_full = _key_block(n_nblocks, head_group, Hkv, Nq, Nk, G,
                                                                       BLOCK_N, BLOCK_M, IS_CAUSAL)
        dtype: gl.constexpr = q_desc.dtype
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        if DQ_TMA:
            dq_smem = gl.allocate_shared_memory(gl.float32, [1, 1, BLOCK_M, HEAD_D], dq_desc.layout)
        else:  # the tile goes through shared memory to be added 16 bytes a thread
            dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D],
                                                gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
        k_smem, v_smem, q_ring, do_ring, bars, kv_bar = _key_block_start(
            q_desc, do_desc, k_desc, v_desc, b, hk, n0, G, mb_lo, per_head, n_tiles, BLOCK_N, BLOCK_M, HEAD_D,
            HEAD_DV, STAGES)

        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, dk_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DV], gl.float32, dv_layout)
        for j in range(0, n_tiles):
            h, m0 = _query_tile(j, hk, G, mb_lo, per_head, BLOCK_M)
            st, q_smem, do_smem = _kv_tile(q_ring, do_ring, bars, j, STAGES)
            pt, dst = _lowp_ds(k_smem, v_smem, q_smem, do_smem, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, b, h, m0, keys,
                               off, m_full, Nq, qk_scale, st_layout, BLOCK_N, BLOCK_M, IS_CAUSAL, OVERLAP)
            dst = dst.to(dtype)
            dq_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout)
            if OVERLAP:  # dQ first: its adds run while dV and dK's products do
                ds_smem.permute((1, 0)).store(dst)
                fence_async_shared()
                dq = warpgroup_mma(ds_smem, k_smem, dq_zero, use_acc=False, is_async=True)
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), pt_op), do_smem, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(dst, dst_op), q_smem, dk, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq, ))
                _dq_add(dq, scale, dq_desc, dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, h, m0, Nq, BLOCK_M, HEAD_D,
                        DQ_TMA, num_warps)
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            else:
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), pt_op), do_smem, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(dst, dst_op), q_smem, dk, is_async=True)
                ds_smem.permute((1, 0)).store(dst)
                fence_async_shared()
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))  # (p^T, dS^T's registers free)
                dq = warpgroup_mma(ds_smem, k_smem, dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            nxt = j + STAGES
            if nxt < n_tiles:
                nh, nm0 = _query_tile(nxt, hk, G, mb_lo, per_head, BLOCK_M)
                _issue_kv(q_desc, do_desc, q_ring, do_ring, bars, b, nh, nm0, st)
            if not OVERLAP:
                _dq_add(dq, scale, dq_desc, dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, h, m0, Nq, BLOCK_M, HEAD_D,
                        DQ_TMA, num_warps)

        _release(kv_bar, bars, STAGES)
        _store_lowp_kv(dk, dv, scale, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, b, hk, n0, Nk, BLOCK_N,
                       HEAD_D, HEAD_DV, dk_layout, dv_layout)
        if DQ_TMA:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _ws_compute(q_desc, do_desc, q_ring, do_ring, bars, free, k_smem, v_smem, ds_bufs, ds_ready, ds_empty,
                    lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, b, hk,
                    n0, off, G, mb_lo, per_head, n_tiles, m_full, Nq, Nk, qk_scale, scale, W: gl.constexpr,
                    NC: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                    HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Compute partition ``W`` of :func:`_lowp_bwd_ws` (``NC`` of them, ``KEYS`` keys each, from ``n0 + W·KEYS``):
        s^T, dP^T, p^T, dS^T and dV, dK of every query tile (four products); each tile's dS^T goes to the dQ
        partition through this partition's two shared buffers (``ds_bufs[2 W + j % 2]``). With one compute partition
        it refills the q/dO ring itself and returns (dK, dV); with two, each releases each stage (``free``) for the
        dQ partition to refill and stores its own keys' dK and dV."""
        CW: gl.constexpr = gl.num_warps()
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                            instr_shape=[16, HEAD_D, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                            instr_shape=[16, HEAD_DV, 16])
        pt_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dst_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        dtype: gl.constexpr = q_desc.dtype
        if NC == 1:
            kw_smem = k_smem
            vw_smem = v_smem
        else:
            kw_smem = k_smem.slice(KEYS * W, KEYS, 0)
            vw_smem = v_smem.slice(KEYS * W, KEYS, 0)
        nw = n0 + KEYS * W
        keys = nw + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
        dk = gl.zeros([KEYS, HEAD_D], gl.float32, dk_layout)
        dv = gl.zeros([KEYS, HEAD_DV], gl.float32, dv_layout)
        for j in range(0, n_tiles):
            h, m0 = _query_tile(j, hk, G, mb_lo, per_head, BLOCK_M)
            st, q_smem, do_smem = _kv_tile(q_ring, do_ring, bars, j, STAGES)
            pt, dst = _lowp_ds(kw_smem, vw_smem, q_smem, do_smem, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, b, h, m0,
                               keys, off, m_full, Nq, qk_scale, st_layout, KEYS, BLOCK_M, IS_CAUSAL, True)
            dst = dst.to(dtype)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), pt_op), do_smem, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst, dst_op), q_smem, dk, is_async=True)
            c = j % 2
            mbarrier.wait(ds_empty.index(c), ((j // 2) & 1) ^ 1)  # (a fresh mbarrier's phase 1 reads complete)
            if HEAD_D > 64:  # dS^T as computed: the dQ partition's right operand of dQ^T = K^T·dS^T
                ds_bufs.index(2 * W + c).store(dst)
            else:
                ds_bufs.index(2 * W + c).permute((1, 0)).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(c), count=1)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            if NC == 1:
                nxt = j + STAGES
                if nxt < n_tiles:
                    nh, nm0 = _query_tile(nxt, hk, G, mb_lo, per_head, BLOCK_M)
                    _issue_kv(q_desc, do_desc, q_ring, do_ring, bars, b, nh, nm0, st)
            else:
                mbarrier.arrive(free.index(st), count=1)
        if NC > 1:
            _store_lowp_kv(dk, dv, scale, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, b, hk, nw, Nk, KEYS,
                           HEAD_D, HEAD_DV, dk_layout, dv_layout)
        return dk, dv

    @gluon.jit
    def _ws_dq(q_desc, do_desc, q_ring, do_ring, bars, free, ds_bufs, ds_ready, ds_empty, k_smem, dq_desc, dq_smem,
               dq_ptr, s_qb, s_qh, s_qn, b, hk, G, mb_lo, per_head, n_tiles, Nq, scale, NC: gl.constexpr,
               KEYS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
               DQ_TMA: gl.constexpr):
        """:func:`_lowp_bwd_ws`'s dQ partition (one warpgroup): ``dS·K`` of each query tile from the ``NC`` compute
        partitions' dS^T buffers (one product each, into one accumulator), the buffers handed back, then (two compute
        partitions) the tile's q/dO stage refilled with tile ``j + STAGES`` once both have released it, and the
        adds into the fp32 ``dq`` (:func:`_dq_add`)."""
        DQ_T: gl.constexpr = HEAD_D > 64  # dQ^T = K^T·dS^T ([HEAD_D, BLOCK_M]): BLOCK_M may be under a warpgroup's 64
        if DQ_T:
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, BLOCK_M, 16])
        else:
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, HEAD_D, 16])
        for j in range(0, n_tiles):
            c = j % 2
            mbarrier.wait(ds_ready.index(c), (j // 2) & 1)
            if DQ_T:
                dq = gl.zeros([HEAD_D, BLOCK_M], gl.float32, dq_layout)
            else:
                dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout)
            for w in gl.static_range(NC):
                if NC == 1:
                    kw_smem = k_smem
                else:
                    kw_smem = k_smem.slice(KEYS * w, KEYS, 0)
                if DQ_T:
                    dq = warpgroup_mma(kw_smem.permute((1, 0)), ds_bufs.index(2 * w + c), dq, use_acc=w > 0,
                                       is_async=True)
                else:
                    dq = warpgroup_mma(ds_bufs.index(2 * w + c), kw_smem, dq, use_acc=w > 0, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.arrive(ds_empty.index(c), count=1)
            if NC > 1:
                nxt = j + STAGES
                if nxt < n_tiles:
                    st = j % STAGES
                    mbarrier.wait(free.index(st), (j // STAGES) & 1)
                    nh, nm0 = _query_tile(nxt, hk, G, mb_lo, per_head, BLOCK_M)
                    _issue_kv(q_desc, do_desc, q_ring, do_ring, bars, b, nh, nm0, st)
            h, m0 = _query_tile(j, hk, G, mb_lo, per_head, BLOCK_M)
            _dq_add(dq, scale, dq_desc, dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, h, m0, Nq, BLOCK_M, HEAD_D, DQ_TMA, 4,
                    DQ_T)
        if DQ_TMA:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _lowp_bwd_ws(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb,
                     s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, dq_ptr, s_qb, s_qh, s_qn, Nq, Nk, Hkv, G, qk_scale, scale,
                     n_nblocks, head_group, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                     HEAD_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr,
                     DQ_REGS: gl.constexpr, NC: gl.constexpr, COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr):
        """:func:`_lowp_bwd` warp-specialised: ``NC`` compute partitions (:func:`_ws_compute`) run four products a
        tile on ``BLOCK_N / NC`` keys each and hand each tile's dS, through shared buffers and their mbarriers, to a
        warpgroup of its own (:func:`_ws_dq`, ``DQ_REGS`` registers a thread) that runs dQ's product and adds, so
        that neither waits for the other's latency.

        ``NC`` = 1 (``ELSA_BWD_LOWP=ws``; session 60, exact on an H100 in session 61): the kernel's ``num_warps`` warps
        are one compute partition. ``NC`` = 2 (``ws2``, session 62): two compute warpgroups of 64 keys, each a
        partition of its own (``num_warps`` = 4, the second with ``COMPUTE_REGS`` registers a thread), that
        synchronise only with the dQ warpgroup (their own dS buffers and mbarrier arrivals), never with each other,
        so that one's softmax runs under the other's products; with one partition the compiler's barriers across it
        (the shared-memory stores before each dS hand-over) keep its two warpgroups in step. The dQ warpgroup then
        also refills the q/dO ring (``free``: an arrival from each compute partition a stage). H100, bf16, H = 16,
        D = 64, public backward: 4K 0.461 ms against ws's 0.541, 16K 7.01 against 7.67."""
        KEYS: gl.constexpr = BLOCK_N // NC
        b, hk, n0, off, mb_lo, per_head, n_tiles, m_full = _key_block(n_nblocks, head_group, Hkv, Nq, Nk, G,
                                                                       BLOCK_N, BLOCK_M, IS_CAUSAL)
        dtype: gl.constexpr = q_desc.dtype
        if HEAD_D > 64:  # dS^T as computed ([keys, rows]): the right operand of dQ^T = K^T·dS^T
            ds_bufs = gl.allocate_shared_memory(dtype, [2 * NC, KEYS, BLOCK_M],
                                                gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], dtype))
        else:
            ds_bufs = gl.allocate_shared_memory(dtype, [2 * NC, BLOCK_M, KEYS],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_M, KEYS], dtype))
        if DQ_TMA:
            dq_smem = gl.allocate_shared_memory(gl.float32, [1, 1, BLOCK_M, HEAD_D], dq_desc.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=NC)
            mbarrier.init(ds_empty.index(i), count=1)
        if NC > 1:
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(free.index(i), count=NC)
        k_smem, v_smem, q_ring, do_ring, bars, kv_bar = _key_block_start(  # (its fence covers the inits above)
            q_desc, do_desc, k_desc, v_desc, b, hk, n0, G, mb_lo, per_head, n_tiles, BLOCK_N, BLOCK_M, HEAD_D,
            HEAD_DV, STAGES)
        if NC == 1:
            free = bars  # (not used: the compute partition refills the ring itself)
        if NC == 1:
            dk, dv = gl.warp_specialize([
                (_ws_compute, (q_desc, do_desc, q_ring, do_ring, bars, free, k_smem, v_smem, ds_bufs, ds_ready,
                               ds_empty, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb,
                               s_vh, s_vn, b, hk, n0, off, G, mb_lo, per_head, n_tiles, m_full, Nq, Nk, qk_scale,
                               scale, 0, NC, KEYS, BLOCK_M, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)),
                (_ws_dq, (q_desc, do_desc, q_ring, do_ring, bars, free, ds_bufs, ds_ready, ds_empty, k_smem, dq_desc,
                          dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, hk, G, mb_lo, per_head, n_tiles, Nq, scale, NC, KEYS,
                          BLOCK_M, HEAD_D, STAGES, DQ_TMA)),
            ], [4], [DQ_REGS])
        else:
            gl.warp_specialize([
                (_ws_compute, (q_desc, do_desc, q_ring, do_ring, bars, free, k_smem, v_smem, ds_bufs, ds_ready,
                               ds_empty, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb,
                               s_vh, s_vn, b, hk, n0, off, G, mb_lo, per_head, n_tiles, m_full, Nq, Nk, qk_scale,
                               scale, 0, NC, KEYS, BLOCK_M, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)),
                (_ws_compute, (q_desc, do_desc, q_ring, do_ring, bars, free, k_smem, v_smem, ds_bufs, ds_ready,
                               ds_empty, lse_ptr, delta_ptr, s_lb, s_lh, s_ln, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb,
                               s_vh, s_vn, b, hk, n0, off, G, mb_lo, per_head, n_tiles, m_full, Nq, Nk, qk_scale,
                               scale, 1, NC, KEYS, BLOCK_M, HEAD_D, HEAD_DV, STAGES, IS_CAUSAL)),
                (_ws_dq, (q_desc, do_desc, q_ring, do_ring, bars, free, ds_bufs, ds_ready, ds_empty, k_smem, dq_desc,
                          dq_smem, dq_ptr, s_qb, s_qh, s_qn, b, hk, G, mb_lo, per_head, n_tiles, Nq, scale, NC, KEYS,
                          BLOCK_M, HEAD_D, STAGES, DQ_TMA)),
            ], [4, 4], [COMPUTE_REGS, DQ_REGS])
        _release(kv_bar, bars, STAGES)
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_ready.index(i))
            mbarrier.invalidate(ds_empty.index(i))
        if NC > 1:
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(free.index(i))
        else:
            dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                instr_shape=[16, HEAD_D, 16])
            dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                instr_shape=[16, HEAD_DV, 16])
            _store_lowp_kv(dk, dv, scale, dk_ptr, s_kb, s_kh, s_kn, dv_ptr, s_vb, s_vh, s_vn, b, hk, n0, Nk, BLOCK_N,
                           HEAD_D, HEAD_DV, dk_layout, dv_layout)

def eligible(q, k, v, do, *, dot: int, mask, q_lengths, kv_lengths, varlen: bool, dropout_p: float,
             mask_grad: bool) -> Optional[str]:
    """``None`` when this backward call runs on the Gluon FMA kernels, else why not (the portable passes run): the
    forward's scope (``hopper.eligible`` for strict, dO in place of the output), without its size rule for small
    eager calls, and no dropout or mask gradient."""
    from .occupancy import DOT_IEEE

    if dot != DOT_IEEE:
        return "not an fp32 strict call"
    if dropout_p > 0 or mask_grad:
        return "dropout and mask gradients run on the portable passes"
    if hopper.mode() == "0":
        return f"{hopper.ENV}=0"
    return hopper.eligible(q, k, v, do, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, varlen=varlen,
                           state=None, scale=1.0, precision="strict", how="force")


def lowp_eligible(q, k, v, do, *, dot: int, mask, q_lengths, kv_lengths, varlen: bool, dropout_p: float,
                  mask_grad: bool) -> Optional[str]:
    """``None`` when this fp16/bf16 backward call can run on :func:`_lowp_bwd` (whose dQ is added with atomics: it
    runs under ``ELSA_BWD_DQ=gluon``, ``backward_launch.atomic_dq``), else why not: the forward's scope
    (``hopper.eligible``, dO in place of the output; any scale), without its size rule for small eager calls, and no
    dropout or mask gradient."""
    from .occupancy import DOT_LOWP

    if dot != DOT_LOWP:
        return "not an fp16/bf16 call"
    if dropout_p > 0 or mask_grad:
        return "dropout and mask gradients run on the portable passes"
    return hopper.eligible(q, k, v, do, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, varlen=varlen,
                           state=None, scale=1.0, precision=None, how="force" if hopper.mode() != "0" else "0")


ENV_TILES = knobs.HOPPER_BWD_TILES


def tiles(d: int, dv: int) -> tuple:
    """``((kv pass: BLOCK_N keys, BLOCK_M rows, STAGES, num_warps), (dQ pass: BLOCK_M rows, BLOCK_N keys, STAGES,
    num_warps))``; ``ELSA_HOPPER_BWD_TILES`` forces both (each pass's resident block first). Measured on an H200
    (session 46, ``benchmarks/lab/strict_bwd_tiles.py``, H = 16, N = 4K, non-causal, the backward alone): D = 64,
    kv 64 x 32 with four warps (6.5-6.8 ms, against 17.2 at 64 x 64 and 7.7-9.4 for 64 x 16, 32 x 16, 128 x 16;
    128 x 32 or two warps 17.9), dQ 128 x 64 with eight warps (6.53, 64 x 64 6.51, 64 x 32 6.80, 7.4-8.1 for 64 x 16,
    32 x 32, 32 x 64; causal 3.42 against 3.52-3.55 at 64 x 64, 64 x 32, 128 x 32); D = 128 (accumulators with two
    warps along their columns): 32 x 32 for both passes (17.1 ms against 17.2-17.3 at 64 x 32 with eight warps,
    18.2-18.9 at 32 x 16, 64 x 16, 32 x 64, 23.4-37.7 at 32 x 32 with eight warps or 64 x 32 with four); session 47:
    the dQ pass at 64 x 64 with eight warps, 16.4 ms (kv pass 64 x 64 with eight warps 23.1: ptxas spills)."""
    forced = knobs.get(ENV_TILES)
    if forced:
        return forced, forced
    if max(d, dv) <= 64:
        return (64, 32, 2, 4), (128, 64, 2, 8)
    return (32, 32, 2, 4), (64, 64, 2, 8)


def backward(do, q, k, v, lse, delta, dq, dk, dv, *, scale: float, is_causal: bool, atomic: bool = False,
             kv_tiles=None, dq_tiles=None):
    """dK, dV and dQ (``dq``/``dk``/``dv``: fp32 ``[B, H, N, D]``, inner stride 1) of a dense strict call from the
    forward's ``lse`` and ``delta`` (both ``[B, Hq, Nq]``, one layout). ``atomic``: dQ added by the kv pass with
    atomics into ``dq`` (zero-filled), no dQ pass (``backward_launch.atomic_dq``). ``kv_tiles``/``dq_tiles``: as
    :func:`tiles` (benchmarks/lab/strict_bwd_tiles.py). Tiles forced by ``ELSA_HOPPER_BWD_TILES`` that need more
    shared memory than the GPU has raise a ValueError naming the knob."""
    try:
        return _backward(do, q, k, v, lse, delta, dq, dk, dv, scale=scale, is_causal=is_causal, atomic=atomic,
                         kv_tiles=kv_tiles, dq_tiles=dq_tiles)
    except Exception as e:
        from triton.runtime.errors import OutOfResources

        if isinstance(e, OutOfResources) and knobs.get(ENV_TILES):
            # (dq, dk, dv are the launcher's new tensors: the caller's are untouched)
            raise ValueError(f"{ENV_TILES}={knobs.raw(ENV_TILES)!r} does not fit this GPU's {e.name} for strict's "
                             f"backward at D={q.shape[-1]}, Dv={v.shape[-1]}: {e.required} needed, {e.limit} "
                             "available; use smaller tiles or unset it") from e
        raise


def _backward(do, q, k, v, lse, delta, dq, dk, dv, *, scale, is_causal, atomic, kv_tiles, dq_tiles):
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    auto_kv, auto_dq = tiles(D, Dv)
    bn, bm, stages, warps = kv_tiles or auto_kv
    desc = hopper._desc
    if Nk and B * Hkv:
        n_nb = -(-Nk // bn)
        group = (causal_head_group(q.device, n_k=Nq, kv_bytes_per_key=q.element_size() * (D + Dv) * G, groups=1,
                                   bh=B * Hkv, m_blocks=n_nb) if is_causal else 1)
        replay.launch(_strict_bwd_kv, (n_nb * B * Hkv,), desc(q, [1, 1, bm, D]), desc(do, [1, 1, bm, Dv]),
                      desc(k, [1, 1, bn, D]), desc(v, [1, 1, bn, Dv]), lse, delta, *lse.stride(), dk,
                      *dk.stride()[:3], dv, *dv.stride()[:3], dq, *dq.stride()[:3], Nq, Nk, Hkv, G,
                      float(scale) * LOG2E, float(scale), n_nb, group, BLOCK_N=bn, BLOCK_M=bm, HEAD_D=D, HEAD_DV=Dv,
                      STAGES=stages, IS_CAUSAL=bool(is_causal), ATOMIC_DQ=bool(atomic), num_warps=warps)
    bm, bn, stages, warps = dq_tiles or auto_dq
    if Nq and B * Hq and not atomic:
        n_mb = -(-Nq // bm)
        group = (causal_head_group(q.device, n_k=Nk, kv_bytes_per_key=q.element_size() * (D + Dv), groups=G,
                                   bh=B * Hq, m_blocks=n_mb) if is_causal else 1)
        replay.launch(_strict_bwd_dq, (n_mb * B * Hq,), desc(q, [1, 1, bm, D]), desc(k, [1, 1, bn, D]),
                      desc(v, [1, 1, bn, Dv]), desc(do, [1, 1, bm, Dv]), lse, delta, *lse.stride(), dq,
                      *dq.stride()[:3], Nq, Nk, Hq, G, float(scale) * LOG2E, float(scale), n_mb, group,
                      BLOCK_M=bm, BLOCK_N=bn, HEAD_D=D, HEAD_DV=Dv, STAGES=stages, IS_CAUSAL=bool(is_causal),
                      num_warps=warps)
    return dq, dk, dv


LOWP_TILES = (128, 64, 2, 8)  # BLOCK_N keys (64 a warpgroup), BLOCK_M query rows, STAGES, num_warps
# _lowp_bwd_ws's tiles: head dims up to 64 as LOWP_TILES; wider heads four compute warps on 64 x 64 (with eight,
# ptxas serialised the products for want of registers, C7512; session 61 H100, bf16 H = 16 N = 4K D = 128: 64 x 64
# 1.008 ms non-causal, 0.511 causal, against 1.135 and 0.870 at 128 x 64 with eight)
LOWP_WS_WIDE_TILES = (64, 64, 2, 4)
# ws2 at D = 128: 32 query rows a tile, so that a compute warpgroup's dK, dV, s^T, dP^T, statistics and operands fit
# ~216 registers; dQ computed transposed (M = D). Session 64, H100, bf16 H = 16 N = 4K, the kernel alone: 0.814 ms
# non-causal, 0.475 causal at 2 stages (3: 0.825 / 0.464, 4: 0.832 / 0.474), against ws's 0.984 / 0.517 (public)
LOWP_WS2_WIDE_TILES = (128, 32, 2, 8)
WS_DQ_REGS = 112  # _lowp_bwd_ws: registers a thread of its dQ warpgroup
LOWP_FORMS = ("plain", "overlap", "ws", "ws2")
WS2_COMPUTE_REGS = 200  # _lowp_bwd_ws at NC = 2 (ws2): registers a thread of its second compute warpgroup
# ws2 at D = 128: compute warpgroups 216 (ptxas, Triton 3.6: 80 / 180 bytes of spills non-causal / causal; 200: 284),
# the dQ warpgroup 80 (its dQ^T accumulator, 128 x 32, is 32 registers a thread); session 64 H100 4K: 224 / 64
# 0.828 / 0.488 ms against 216 / 80's 0.814 / 0.475
WS2_WIDE_REGS = (216, 80)


def ws2_regs(d: int, dv: int) -> tuple:
    """``(COMPUTE_REGS, DQ_REGS)`` of ws2 at head dims ``d``, ``dv``: :data:`WS2_WIDE_REGS` over 64, else
    :data:`WS2_COMPUTE_REGS` and :data:`WS_DQ_REGS`."""
    return WS2_WIDE_REGS if max(d, dv) > 64 else (WS2_COMPUTE_REGS, WS_DQ_REGS)


def lowp_form() -> str:
    """The form of the fp16/bf16 Gluon backward that runs (``ELSA_BWD_LOWP``; auto: ``ws2``, which runs ``ws`` at
    head dims over 64: :func:`kernel_form`)."""
    form = knobs.get(knobs.BWD_LOWP)
    return "ws2" if form == "auto" else form


def kernel_form(form: str, d: int, dv: int) -> str:
    """The form whose kernel runs ``form``'s calls at head dims ``d``, ``dv``: ``ws2`` at head dims up to 64 (each
    compute warpgroup's two accumulators, s^T, dP^T and the rows' statistics in ~200 registers) and at D = 128,
    Dv <= 128 (32 query rows a tile, :data:`LOWP_WS2_WIDE_TILES`), ``ws`` for its other wider calls; every other
    form itself."""
    return "ws" if form == "ws2" and max(d, dv) > 64 and not (d == 128 and dv <= 128) else form


def lowp_tiles(form: str, d: int, dv: int) -> tuple:
    """``(BLOCK_N, BLOCK_M, STAGES, num_warps)`` of ``form`` at head dims ``d``, ``dv``."""
    if form == "ws2" and max(d, dv) > 64:
        return LOWP_WS2_WIDE_TILES
    return LOWP_WS_WIDE_TILES if form == "ws" and max(d, dv) > 64 else LOWP_TILES


def ws_maxnreg(warps: int) -> int:
    """The register limit a thread of :func:`_lowp_bwd_ws` launched with ``warps`` compute warps (and the dQ
    warpgroup): the SM's 64K registers over all its threads, a multiple of 8, at most 248; the compute warps get
    what the dQ warpgroup leaves (8 warps: 168, of which they get 196; 4 warps: 248, capped there)."""
    return min(248, 65536 // (32 * (warps + 4)) // 8 * 8)


def dq_tma_available() -> bool:
    """Whether this Triton's Gluon has TMA reduce-adds (``tma.async_atomic_add``)."""
    return gluon is not None and hasattr(tma, "async_atomic_add")


def lowp_backward(do, q, k, v, lse, delta, dq, dk, dv, *, scale: float, is_causal: bool, tiles=None,
                  dq_tma: Optional[bool] = None, form: Optional[str] = None):
    """dK, dV (``dk``/``dv``: ``k``'s dtype, inner stride 1) and dQ added into ``dq`` (fp32, zero-filled,
    contiguous) of a dense fp16/bf16 call from the forward's ``lse`` and ``delta`` (``[B, Hq, Nq]``, one layout): one
    launch. ``form`` (default :func:`lowp_form`): ``plain`` or ``overlap`` (:func:`_lowp_bwd` without or with its
    ``OVERLAP`` order), ``ws`` or ``ws2`` (:func:`_lowp_bwd_ws` with one or two compute partitions; ws2's calls over
    D = 64 run ws, :func:`kernel_form`); ``tiles``: ``(BLOCK_N, BLOCK_M, STAGES, num_warps)``, default
    :func:`lowp_tiles` (ws2: BLOCK_N 128 and 8 warps, its two warpgroups, and BLOCK_M a multiple of 64 at D <= 64, or
    ValueError); ``dq_tma``: TMA reduce-adds (default where :func:`dq_tma_available`) or atomic adds."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    form = form or lowp_form()
    if form not in LOWP_FORMS:
        raise ValueError(f"form={form!r}: one of {LOWP_FORMS}")
    form = kernel_form(form, D, Dv)
    bn, bm, stages, warps = tiles or lowp_tiles(form, D, Dv)
    if form == "ws2" and (bn, warps) != (128, 8):
        raise ValueError(f"tiles={tiles}: ws2 runs two compute warpgroups of 64 keys each, so BLOCK_N = 128 and "
                         f"num_warps = 8 (got {bn} and {warps})")
    if form == "ws2" and max(D, Dv) <= 64 and bm % 64:
        raise ValueError(f"tiles={tiles}: ws2 at head dims up to 64 computes dQ as [BLOCK_M, D] in one warpgroup, "
                         f"so BLOCK_M is a multiple of 64 (got {bm}); 32-row tiles are its D = 128 form's")
    if dq_tma is None:
        dq_tma = dq_tma_available()
    if not (Nk and Nq and B * Hkv):
        return dq, dk, dv
    desc = hopper._desc
    n_nb = -(-Nk // bn)
    group = (causal_head_group(q.device, n_k=Nq, kv_bytes_per_key=q.element_size() * (D + Dv) * G, groups=1,
                               bh=B * Hkv, m_blocks=n_nb) if is_causal else 1)
    args = (desc(q, [1, 1, bm, D]), desc(do, [1, 1, bm, Dv]), desc(k, [1, 1, bn, D]), desc(v, [1, 1, bn, Dv]),
            desc(dq, [1, 1, bm, D]), lse, delta, *lse.stride(), dk, *dk.stride()[:3], dv, *dv.stride()[:3], dq,
            *dq.stride()[:3], Nq, Nk, Hkv, G, float(scale) * LOG2E, float(scale), n_nb, group)
    const = dict(BLOCK_N=bn, BLOCK_M=bm, HEAD_D=D, HEAD_DV=Dv, STAGES=stages, IS_CAUSAL=bool(is_causal),
                 DQ_TMA=bool(dq_tma), num_warps=warps)
    if form == "ws":
        replay.launch(_lowp_bwd_ws, (n_nb * B * Hkv,), *args, DQ_REGS=WS_DQ_REGS, NC=1, COMPUTE_REGS=0,
                      maxnreg=ws_maxnreg(warps), **const)
    elif form == "ws2":  # two compute warpgroups, each a partition: the kernel's own warps are the first
        compute_regs, dq_regs = ws2_regs(D, Dv)
        replay.launch(_lowp_bwd_ws, (n_nb * B * Hkv,), *args, DQ_REGS=dq_regs, NC=2, COMPUTE_REGS=compute_regs,
                      maxnreg=ws_maxnreg(8), **dict(const, num_warps=4))
    else:
        replay.launch(_lowp_bwd, (n_nb * B * Hkv,), *args, OVERLAP=form == "overlap", **const)
    return dq, dk, dv


# every kernel's Triton cache key computed callees first, once, at import (internals.settle_cache_keys)
if gluon is not None:
    from . import internals  # noqa: E402

    internals.settle_cache_keys(globals())
