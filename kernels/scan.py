"""The ELSA scan in Triton: phase 1 folds K/V partitions into per-row monoid states, phase 2 merges them.

State of one query row over a key set ``J``: ``m = max s_j``, ``S = sum exp(s_j - m)``,
``W = sum exp(s_j - m) v_j``; the output is ``W / S``. Inside the kernels logits are kept in the base-2
domain (``s * scale * log2(e)``, so ``exp2`` does the exponentials); every state that leaves a kernel
stores ``m`` in natural-log units.

Phase 1 (:func:`elsa_fwd`): one program per (query block, batch*head, K-partition). It walks the key
blocks of its partition in two loops: blocks where every (row, key) pair is visible run without any
masking arithmetic, the few boundary blocks (causal diagonal, ragged key tail, explicit mask) run
masked; blocks wholly above the causal frontier or past a row's valid length are never visited. An explicit
mask's tiles may be classified first (:func:`mask_tile_classes`, :func:`mask_tile_ranges`, ``HAS_RANGES``): blocks
the mask hides from every row of the tile are skipped too, and those it hides nothing of run unmasked. With
one partition the program finishes the row itself (``out = W / S``, ``lse = m + log S``); otherwise it
writes its partial state and phase 2 (:func:`elsa_merge`) merges the partitions (⊕ is associative).

Dot products: ``DOT = 0`` fp16/bf16 tensor cores (fp32 accumulate), ``1`` IEEE fp32 (no tensor
cores), ``2`` TF32, ``3`` 3xTF32 (hi/lo split done by Triton's ``input_precision="tf32x3"``), ``4``
bf16 under the CPU interpreter only (operands upcast to fp32 before the dot), ``5`` three fp16 products
per fp32 product (``x = (hi + lo) / 2^e`` with fp16 ``hi``/``lo`` and a power-of-two scale: Q per row and P
split here, K per key and V per head dim split by :func:`split_f16` before the launch; the three
products of a block are summed in a fresh accumulator and added to the running one in fp32), ``6`` the
same with V split here, per head dim of each key block (the launcher splits K alone: half the staged bytes).

TF32 tensor-core MMAs (``DOT`` 2, 3) need both shared-memory operands K-major. K (``[N, D]``, D contiguous)
is; V in its natural layout (Dv contiguous) is not, and Triton then fills V's tile with 4-byte copies. The
launcher therefore passes V transposed in memory (keys contiguous, ``stride_vn == 1``) for these modes; the
kernel is the same, only the strides differ. To keep the extra memory O(output), long key ranges are
staged one chunk at a time (``CHUNKED``): the launcher runs phase 1 once per key chunk, each run reading
the row states the previous one left (``m`` in the kernel's base-2 units, ``S``, and ``W`` in the output
buffer) and folding its chunk in; a program finishes its rows in the chunk that holds their last visible
key, and programs whose rows finished earlier (causal, short kv lengths) do nothing. Causal calls may run
the chunks in reverse order (the last keys first): a program then starts its rows in the chunk holding
their last visible key and finishes them in the first chunk, and the rows not yet started hold the staged
chunk (launch.py). ⊕ is associative and commutative, so either order is the same scan with the partitions
visited in sequence instead of merged by phase 2.
Head dims that are not powers of two are padded inside the kernel with masked loads.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Runtime sizes that must not trigger a recompilation when they change (Triton would otherwise
# specialise integers on ``== 1`` and on divisibility by 16).
# The lowest finite additive-mask value the kernels keep: times log2(e) it is still finite in fp32 (3.32e38).
MASK_FLOOR: tl.constexpr = tl.constexpr(-2.3e38)

_RUNTIME_SIZES = ["Nq", "Nk", "n_mblocks", "part_len", "n_rows_buf", "BH", "mask_period", "koff", "klim",
                  "head_group"]


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    if DOT == 0:
        acc = tl.dot(a, b, acc)
    elif DOT == 1:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif DOT == 2:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    elif DOT == 3:
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    else:  # DOT == 4: the CPU interpreter's bf16 (its numpy matmul cannot multiply bf16): upcast first
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return acc


@triton.jit
def _add_block(acc, pv):
    """``acc + pv`` as fp32 adds rounded to nearest, ``pv`` a block's products from a fresh accumulator. Written as
    ``fma(pv, 1, acc)``: Triton's combiner folds ``acc + tl.dot(a, b, 0)`` back into ``tl.dot(a, b, acc)``, the very
    chain this avoids (session 27: the PTX of both forms was identical; tools/compile_kernels.py checks they
    differ)."""
    return tl.fma(pv, 1.0, acc)


@triton.jit
def _split16(x):
    """``x`` (already scaled into fp16's range) as fp16 ``hi + lo``: 22 of fp32's 24 significant bits."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _split_rows(x):
    """``x [R, C]`` (fp32) as fp16 ``(hi, lo)`` and the inverse scale of each row: ``x = (hi + lo) * inv[:, None]``,
    each row scaled by a power of two into fp16's range (:func:`_pow2_scale`)."""
    sc = _pow2_scale(tl.max(tl.abs(x), 1))
    hi, lo = _split16(x * sc[:, None])
    return hi, lo, 1.0 / sc


@triton.jit
def _pow2_scale(amax):
    """A power of two taking ``amax`` into [2^14, 2^15) (far below fp16's 65504); zero rows get 2^14. Rows
    whose maximum is below 2^-100 (fp32's subnormal territory) keep an absolute error under ~2^-124."""
    e = tl.floor(tl.log2(tl.where(amax > 0, amax, 1.0)))
    return tl.exp2(14.0 - tl.minimum(tl.maximum(e, -100.0), 126.0))


@triton.jit
def _load_tile(ptrs, MASKED: tl.constexpr, PADDED: tl.constexpr, masked_ok, padded_ok):
    """A K/V tile: with the block's own mask (boundary blocks), the head-dim padding mask, or unmasked."""
    if MASKED:
        return tl.load(ptrs, mask=masked_ok, other=0.0)
    elif PADDED:
        return tl.load(ptrs, mask=padded_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _fold_block(
    acc, l_i, m_i, q, q_lo, q_rowf, k_ptrs, kl_ptrs, ki_ptrs, v_ptrs, vl_ptrs, vi_ptrs,
    start_n, offs_m, offs_n, offs_d, offs_dv,
    kv_len, causal_off, mask_ptrs, mask_row_ok, stride_kn, stride_vn, stride_mn, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr,
    BLOCKED_PV: tl.constexpr,
):
    """``state ⊕ block``: fold keys ``[start_n, start_n + BLOCK_N)`` into the running row states.

    ``BLOCKED_PV`` (rows of many keys, set by the launcher): the block's P·V in a fresh tensor-core accumulator,
    then added to the row's with a round-to-nearest add, instead of accumulating in the tensor cores across every
    key block, whose additions are reported to truncate (a bias toward zero that grows with the number of blocks)."""
    cols = start_n + offs_n
    kd_ok = offs_d[:, None] < D
    vd_ok = offs_dv[None, :] < DV
    col_ok = cols < kv_len  # used by boundary blocks only (MASKED)
    k_ok = kd_ok & col_ok[None, :]
    v_ok = col_ok[:, None] & vd_ok
    kt = _load_tile(k_ptrs + start_n * stride_kn, MASKED, BLOCK_D != D, k_ok, kd_ok)
    if DOT >= 5:  # q·k = (q_hi·k_hi + q_hi·k_lo + q_lo·k_hi) / (2^e_row · 2^e_key), small products first
        kl = _load_tile(kl_ptrs + start_n * stride_kn, MASKED, BLOCK_D != D, k_ok, kd_ok)
        ki = _load_tile(ki_ptrs + start_n, MASKED, False, col_ok, col_ok)
        s = tl.dot(q_lo, kt, tl.zeros([q.shape[0], kt.shape[1]], dtype=tl.float32))
        s = tl.dot(q, kl, s)
        s = tl.dot(q, kt, s)
        s = s * q_rowf[:, None] * ki[None, :]
    else:
        s = _dot(q, kt, tl.zeros([q.shape[0], kt.shape[1]], dtype=tl.float32), DOT) * qk_scale
    if MASKED:
        vis = col_ok[None, :]
        if IS_CAUSAL:
            vis = vis & (cols[None, :] <= offs_m[:, None] + causal_off)
        if MASK_KIND == 1:
            mk = tl.load(mask_ptrs + start_n * stride_mn, mask=mask_row_ok[:, None] & col_ok[None, :], other=0)
            vis = vis & (mk != 0)
        elif MASK_KIND == 2:
            mk = tl.load(mask_ptrs + start_n * stride_mn, mask=mask_row_ok[:, None] & col_ok[None, :], other=0.0)
            mk = mk.to(tl.float32)
            # finite "minus huge" masks (torch.finfo.min) stay finite after the log2(e) scaling: values below
            # MASK_FLOOR act as MASK_FLOOR (semantics.py: the same outputs, an lse near MASK_FLOOR)
            mk = tl.where(mk == float("-inf"), mk, tl.maximum(mk, MASK_FLOOR))
            s = s + mk * 1.4426950408889634
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row merges as identity
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_tile(v_ptrs + start_n * stride_vn, MASKED, BLOCK_DV != DV, v_ok, vd_ok)
    if DOT >= 5:  # p in [0, 1] scaled by 2^14; V's hi/lo parts with an inverse scale per head dim of this key block
        if DOT == 5:  # split by the launcher: v is the hi part
            v_lo = _load_tile(vl_ptrs + start_n * stride_vn, MASKED, BLOCK_DV != DV, v_ok, vd_ok)
            v_inv = tl.load(vi_ptrs + (start_n // offs_n.shape[0]) * DV, mask=offs_dv < DV, other=0.0)
        else:  # DOT 6: v as it is (fp32), split here
            v_sc = _pow2_scale(tl.max(tl.abs(v), 0))
            v, v_lo = _split16(v * v_sc[None, :])
            v_inv = 1.0 / v_sc
        p_hi, p_lo = _split16(p * 16384.0)
        pv = tl.dot(p_lo, v, tl.zeros([p.shape[0], v.shape[1]], dtype=tl.float32))
        pv = tl.dot(p_hi, v_lo, pv)
        pv = tl.dot(p_hi, v, pv)
        acc = acc + pv * (v_inv * (1.0 / 16384.0))[None, :]
    elif DOT == 1:  # strict: the block's P·V in a fresh accumulator, then one add (blocked summation: the
        # rounding error grows with BLOCK_N + Nk / BLOCK_N, not with Nk as one FMA chain over every key does)
        acc = _add_block(acc, _dot(p, v, tl.zeros([p.shape[0], v.shape[1]], dtype=tl.float32), DOT))
    elif BLOCKED_PV:
        acc = _add_block(acc, _dot(p.to(v.dtype), v, tl.zeros([p.shape[0], v.shape[1]], dtype=tl.float32), DOT))
    else:
        acc = _dot(p.to(v.dtype), v, acc, DOT)
    return acc, l_i, m_new


@triton.jit
def phase_span(phase: tl.constexpr, p0, p1, p2, p3, p4):
    """Blocks ``[p_phase, p_phase+1)`` of a static phase loop (``tl.static_range``) over consecutive spans (masked
    and unmasked runs): the bounds are set before the loop and picked by the phase alone, as Triton 3.6 failed to
    compile bounds assigned under a constexpr ``if`` inside the loop (elsa_fwd; backward.py's ``_span_of`` likewise)."""
    if phase == 0:
        lo, hi = p0, p1
    elif phase == 1:
        lo, hi = p1, p2
    elif phase == 2:
        lo, hi = p2, p3
    else:
        lo, hi = p3, p4
    return lo, hi


@triton.jit(do_not_specialize=["Nq", "Nk", "n_nblocks"])
def mask_tile_classes(
    MASK, CLS, Nq, Nk, n_nblocks,
    stride_mp, stride_mh, stride_mm, stride_mn, stride_cp, stride_ch,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """The class of every ``BLOCK_M x BLOCK_N`` tile of a mask (step 1 of 2, before ``elsa_fwd``; one program per
    tile, so the pass over the mask runs at memory speed): program ``(m * n_nblocks + j, h, p)`` reads rows
    ``[m * BLOCK_M, ...)`` and keys ``[j * BLOCK_N, ...)`` of mask plane ``(p, h)`` (``[P, H, Nq, Nk]``, any
    strides, 0 on broadcast axes; only valid rows and keys count) and writes to
    ``CLS + p * stride_cp + h * stride_ch + m * n_nblocks + j``: 0 when it hides every key from every row (bool
    False, float ``-inf``: the tile's fold is the identity), 2 when it hides nothing (bool True, float 0: the
    tile folds unmasked), 1 otherwise."""
    pid = tl.program_id(0)
    pid_m = pid // n_nblocks
    j = pid % n_nblocks
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < Nq) & (cols[None, :] < Nk)
    x = tl.load(MASK + p * stride_mp + h * stride_mh + rows[:, None].to(tl.int64) * stride_mm
                + cols[None, :].to(tl.int64) * stride_mn, mask=ok, other=0)
    if MASK_KIND == 1:
        vis = x != 0
        clear = vis
    else:
        vis = x != float("-inf")
        clear = x == 0.0
    seen = tl.max(tl.max(tl.where(ok & vis, 1, 0), 1), 0)
    whole = tl.min(tl.min(tl.where(ok & (clear == 0), 0, 1), 1), 0)
    tl.store(CLS + p * stride_cp + h * stride_ch + pid, (seen + whole).to(tl.int8))


@triton.jit(do_not_specialize=["n_items", "item_stride", "line_stride"])
def mask_tile_ranges(CLS, RANGES, n_items, item_stride, line_stride, stride_cp, stride_ch, stride_rp, stride_rh,
                     CHUNK: tl.constexpr):
    """The blocks each line of a mask's tiles needs (step 2 of 2): program ``(l, h, p)`` reads the classes
    (``mask_tile_classes``) of the ``n_items`` tiles of line ``l`` of plane ``(p, h)`` (a row tile's key blocks:
    ``item_stride = 1``, ``line_stride = n_nblocks``; a key tile's row blocks for the backward's key pass:
    ``item_stride = n_nblocks``, ``line_stride = 1``) and writes four block indices to
    ``RANGES + p * stride_rp + h * stride_rh + l * 4``: ``[v_lo, f_lo, f_hi, v_hi]``. Blocks outside
    ``[v_lo, v_hi)`` hide every pair: the kernels skip them. ``[f_lo, f_hi)``, inside it, is the first run of blocks
    that hide nothing: the kernels fold them without reading the mask. Every other block of ``[v_lo, v_hi)`` runs
    masked. A line with nothing visible gets ``[0, 0, 0, 0]``; one with no unmasked block ``f_lo = f_hi = v_lo``."""
    line = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2).to(tl.int64)
    base = CLS + p * stride_cp + h * stride_ch + line.to(tl.int64) * line_stride
    offs = tl.arange(0, CHUNK)
    v_lo = n_items
    v_hi = 0
    f_lo = n_items
    for j0 in range(0, n_items, CHUNK):
        j = j0 + offs
        c = tl.load(base + j.to(tl.int64) * item_stride, mask=j < n_items, other=0)
        v_lo = tl.minimum(v_lo, tl.min(tl.where(c > 0, j, n_items), 0))
        v_hi = tl.maximum(v_hi, tl.max(tl.where(c > 0, j + 1, 0), 0))
        f_lo = tl.minimum(f_lo, tl.min(tl.where(c == 2, j, n_items), 0))
    f_hi = n_items  # the first block after f_lo that is not clear
    for j0 in range(0, n_items, CHUNK):
        j = j0 + offs
        c = tl.load(base + j.to(tl.int64) * item_stride, mask=j < n_items, other=0)
        f_hi = tl.minimum(f_hi, tl.min(tl.where((j > f_lo) & (c != 2), j, n_items), 0))
    none = v_lo >= v_hi
    v_lo = tl.where(none, 0, v_lo)
    v_hi = tl.where(none, 0, v_hi)
    no_clear = f_lo >= n_items
    f_hi = tl.where(no_clear, v_lo, f_hi)
    f_lo = tl.where(no_clear, v_lo, f_lo)
    out = RANGES + p * stride_rp + h * stride_rh + line * 4
    tl.store(out, v_lo)
    tl.store(out + 1, f_lo)
    tl.store(out + 2, f_hi)
    tl.store(out + 3, v_hi)


@triton.jit
def heaviest_first(pid, n_blocks, BH, head_group, LAST_IS_HEAVIEST: tl.constexpr):
    """``(block, batch x head)`` of program ``pid`` of a causal launch of ``n_blocks`` blocks for each of ``BH``
    (batch, head) pairs, ordered so that the heaviest blocks of each group of ``head_group`` heads run first
    together (``occupancy.causal_head_group``: as many heads as keep their operands in L2, or enough to fill the
    GPU): the block index counts down from ``n_blocks - 1`` (``LAST_IS_HEAVIEST``: a row block sees more keys the
    later it is) or up from 0 (a key block is seen by more rows the earlier it is)."""
    per_group = n_blocks * head_group
    g = pid // per_group
    gh = tl.minimum(head_group, BH - g * head_group)  # the last group may be smaller
    r = pid - g * per_group
    j = r // gh
    if LAST_IS_HEAVIEST:
        j = n_blocks - 1 - j
    return j, g * head_group + r % gh


@triton.jit(do_not_specialize=_RUNTIME_SIZES)
def elsa_fwd(
    Q, K, V, MASK, QLEN, KVLEN, CUQ, CUK,
    OUT, LSE, PM, PS, PW, KL, KI, VL, VI, RANGES, COUNT,
    qk_scale, Nq, Nk, Hq, GROUPS, n_mblocks, part_len, n_rows_buf, BH, mask_period, koff, klim, head_group,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kib, stride_kih, stride_vib, stride_vih,
    stride_mp, stride_mh, stride_mm, stride_mn, stride_rp, stride_rh,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr,
    VARLEN: tl.constexpr, WRITE_STATE: tl.constexpr, WRITE_LSE: tl.constexpr, DOT: tl.constexpr,
    CHUNKED: tl.constexpr, PACK: tl.constexpr = False, BLOCKED_PV: tl.constexpr = False,
    HAS_RANGES: tl.constexpr = False, FUSE_MERGE: tl.constexpr = 0, MERGE_M: tl.constexpr = 1,
):
    """Phase 1. Keys ``[koff, koff + klim)`` of each row (``koff = 0``, ``klim = Nk`` unless chunked).

    ``CHUNKED`` (1: key chunks in key order, 2: in reverse order): this launch is one key chunk of a
    sequence of launches; it reads the row state left by the previous chunk and either writes it back or,
    in the rows' last chunk, finishes the rows. Chunked launches have one partition; the state's ``W`` lives
    in the fp32 output buffer (through its strides), ``m``/``S`` in ``PM``/``PS``.

    ``PACK`` (decode and short queries): a program's rows are the ``GROUPS · Nq`` (query head, query) pairs of
    one K/V head, row ``r`` being query ``r % Nq`` of head ``hk · GROUPS + r // Nq``, so that each K/V tile is
    loaded once for the whole GQA group; ``BH`` and ``pid_bh`` then count (batch, K/V head) pairs and
    ``n_rows_buf`` is ``GROUPS · Nq``: partition states land in the same ``[P, B, Hq, Nq]`` layout as unpacked
    ones, so phase 2 merges them unchanged. Not combined with ``VARLEN`` or ``CHUNKED``.

    ``FUSE_MERGE`` (packed calls of several partitions writing ``out``; 0: off): phase 2 in this launch. Each program
    writes its partition state, then takes a ticket from its row tile's counter in ``COUNT`` (int32, zero before the
    launch); the program that draws the last ticket merges every partition's state of its rows, ``FUSE_MERGE``
    partitions a ``[FUSE_MERGE, MERGE_M, Dv]`` tile (``MERGE_M``: the tile's rows, a power of two), always in
    partition order whoever comes last (deterministic), finishes them, and sets the counter back to zero. One launch
    a decode step instead of two (the launch's host time and the second kernel's start).
    """
    # fp32 whoever launches: Triton's launcher types a Python float fp32, Inductor's code for a wrap_triton launch
    # (kernels/ops.py's inline op) fp64, which would carry the scores and the dots' accumulators to fp64
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid = tl.program_id(0)
    pid_p = tl.program_id(1)
    if IS_CAUSAL:  # the longest rows first across each group of head_group heads (occupancy.causal_head_group)
        pid_m, pid_bh = heaviest_first(pid, n_mblocks, BH, head_group, True)
    else:
        pid_m = pid % n_mblocks
        pid_bh = pid // n_mblocks
    if PACK:
        b = pid_bh // (Hq // GROUPS)
        hk = pid_bh % (Hq // GROUPS)
        h = hk * GROUPS  # the group's first query head (scalar uses below are PACK-aware)
    else:
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // GROUPS
    b64 = b.to(tl.int64)

    if VARLEN:
        q0 = tl.load(CUQ + b)
        q_len = tl.load(CUQ + b + 1) - q0
        k0 = tl.load(CUK + b)
        kv_len = tl.load(CUK + b + 1) - k0
        store_rows = q_len
        q_row0 = q0.to(tl.int64)
        k_row0 = k0.to(tl.int64)
    else:
        q_len = Nq
        kv_len = Nk
        if HAS_QLEN:
            q_len = tl.load(QLEN + b)
        if HAS_KVLEN:
            kv_len = tl.load(KVLEN + b)
        store_rows = Nq
        if PACK:
            store_rows = Nq * GROUPS
        q_row0 = b64 * 0
        k_row0 = b64 * 0
    # key indices below are local to this launch's key range, which starts at koff
    causal_off = kv_len - q_len - koff
    kv_rest = kv_len - koff  # keys of each row from this launch's first key on
    kv_len = tl.minimum(kv_rest, klim)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if PACK:  # each row's query head and query index (row_q: the causal frontier's row)
        row_h = h + offs_m // Nq
        row_q = offs_m % Nq
    else:
        row_h = offs_m * 0 + h
        row_q = offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_row0 * stride_qn
    k_head = b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_row0 * stride_kn
    v_head = b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_row0 * stride_vn
    k_base = K + k_head
    v_base = V + v_head

    # this program's keys: [lo, hi) of its partition, cut at the valid length and the causal frontier
    lo = tl.multiple_of(pid_p * part_len, BLOCK_N)  # part_len is a multiple of BLOCK_N (launch.py)
    hi = tl.minimum(lo + part_len, kv_len)
    if IS_CAUSAL:
        if PACK:  # the tile's rows may hold every query index
            hi = tl.minimum(hi, q_len + causal_off)
        else:
            hi = tl.minimum(hi, tl.minimum(start_m + BLOCK_M, q_len) + causal_off)
    if PACK:
        if start_m >= store_rows:
            hi = lo
    elif start_m >= q_len:
        hi = lo
    if CHUNKED:
        # the last visible key of the tile's rows, relative to koff. In key order (CHUNKED == 1) the rows
        # start in the first chunk and finish in the chunk holding that key; when it lies before this chunk
        # (koff > 0) they finished earlier and the program does nothing. In reverse order (CHUNKED == 2,
        # the last keys first) the rows start in the chunk holding that key, before which the program does
        # nothing (its rows are untouched), and finish in the first chunk (koff == 0).
        ext = kv_rest
        if IS_CAUSAL:
            ext = tl.minimum(ext, tl.minimum(start_m + BLOCK_M, q_len) + causal_off)
        live = (koff == 0) | (ext > 0)
        if CHUNKED == 1:
            resume = live & (koff > 0)
            finish = live & (ext <= klim)
            carry = live & (ext > klim)
        else:
            resume = live & (ext > klim)
            finish = live & (koff == 0)
            carry = live & (koff > 0)
        hi = tl.where(live, hi, lo)
    hi = tl.maximum(hi, lo)
    # blocks in [lo, full_hi) need no masking: every key valid and visible from every row of the tile
    full_lim = hi
    if IS_CAUSAL:
        if PACK:
            full_lim = tl.minimum(full_lim, causal_off + 1)  # query 0 may be among the rows
        else:
            full_lim = tl.minimum(full_lim, start_m + causal_off + 1)
    full_hi = lo + tl.maximum(full_lim - lo, 0) // BLOCK_N * BLOCK_N
    if HAS_RANGES:  # the mask's tile ranges (mask_tile_ranges; not with PACK or CHUNKED): keys [r_lo, r_hi) are
        # folded, blocks wholly hidden by the mask skipped, those in [f_lo, f_hi) unmasked (the mask hides
        # nothing there and they are clear of the causal frontier and the valid length)
        rr = RANGES + (b % mask_period).to(tl.int64) * stride_rp + h.to(tl.int64) * stride_rh + pid_m * 4
        r_lo = tl.maximum(lo, tl.load(rr + 0) * BLOCK_N)
        r_hi = tl.maximum(r_lo, tl.minimum(hi, tl.load(rr + 3) * BLOCK_N))
        f_lo = tl.minimum(tl.maximum(tl.load(rr + 1) * BLOCK_N, r_lo), r_hi)
        f_hi = tl.maximum(f_lo, tl.minimum(tl.minimum(tl.load(rr + 2) * BLOCK_N, r_hi), full_hi))
        p0, p1, p2, p3 = r_lo, f_lo, f_hi, r_hi  # masked [r_lo, f_lo), unmasked [f_lo, f_hi), masked [f_hi, r_hi)
    else:
        if MASK_KIND != 0:
            full_hi = lo
        p0, p1, p2, p3 = lo, full_hi, hi, hi  # unmasked [lo, full_hi), masked [full_hi, hi)

    if PACK:
        q_ptrs = (Q + b64 * stride_qb + row_h[:, None].to(tl.int64) * stride_qh
                  + row_q[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd)
    else:
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd
    q_ok = (offs_m[:, None] < store_rows) & (offs_d[None, :] < D)
    if CHUNKED:
        q_ok = tl.where(live, q_ok, False)  # (tl.where: the interpreter mis-types `tensor & scalar`)
    q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    k_off = offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None] * stride_kd
    v_off = offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :] * stride_vd
    k_ptrs = k_base + k_off
    v_ptrs = v_base + v_off
    if DOT >= 5:  # K (and V for DOT 5) are the fp16 hi parts; KL/VL the lo parts (same layout), KI/VI the inverse scales
        kl_ptrs = KL + k_head + k_off
        vl_ptrs = VL + v_head + v_off
        ki_ptrs = KI + b64 * stride_kib + hk.to(tl.int64) * stride_kih + k_row0 + offs_n
        vi_ptrs = VI + b64 * stride_vib + hk.to(tl.int64) * stride_vih + offs_dv
        q_sc = _pow2_scale(tl.max(tl.abs(q), 1))
        q, q_lo = _split16(q * q_sc[:, None])
        q_rowf = qk_scale / q_sc
    else:
        kl_ptrs = k_ptrs
        vl_ptrs = v_ptrs
        ki_ptrs = K
        vi_ptrs = K
        q_lo = q
        q_rowf = qk_scale
    mask_ptrs = MASK
    mask_row_ok = offs_m < store_rows
    if MASK_KIND != 0:
        mrow = (b % mask_period).to(tl.int64)
        if PACK:
            mask_ptrs = (MASK + mrow * stride_mp + row_h[:, None].to(tl.int64) * stride_mh
                         + row_q[:, None].to(tl.int64) * stride_mm + offs_n[None, :].to(tl.int64) * stride_mn)
        else:
            mask_ptrs = (MASK + mrow * stride_mp + h.to(tl.int64) * stride_mh
                         + offs_m[:, None].to(tl.int64) * stride_mm + offs_n[None, :].to(tl.int64) * stride_mn)

    if PACK:
        o_ptrs = (OUT + b64 * stride_ob + row_h[:, None].to(tl.int64) * stride_oh
                  + row_q[:, None].to(tl.int64) * stride_on + offs_dv[None, :] * stride_od)
    else:
        o_ptrs = (OUT + b64 * stride_ob + h.to(tl.int64) * stride_oh
                  + (q_row0 + offs_m[:, None]) * stride_on + offs_dv[None, :] * stride_od)
    if CHUNKED:  # the row states left by the previous key chunk (m, S in PM/PS; W in the fp32 output)
        crow = pid_bh.to(tl.int64) * n_rows_buf + offs_m
        c_ok = tl.where(resume, offs_m < store_rows, False)
        m_i = tl.load(PM + crow, mask=c_ok, other=float("-inf"))
        l_i = tl.load(PS + crow, mask=c_ok, other=0.0)
        acc = tl.load(o_ptrs, mask=c_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # the phases' key blocks [p0, p1), [p1, p2), [p2, p3) (bounds set above: phase_span); masked: phases 0 and 2
    # with the mask's ranges, phase 1 without
    for phase in tl.static_range(2 + HAS_RANGES):
        blk_lo, blk_hi = phase_span(phase, p0, p1, p2, p3, p3)
        for start_n in range(blk_lo, blk_hi, BLOCK_N):
            acc, l_i, m_i = _fold_block(
                acc, l_i, m_i, q, q_lo, q_rowf, k_ptrs, kl_ptrs, ki_ptrs, v_ptrs, vl_ptrs, vi_ptrs,
                start_n, row_q, offs_n, offs_d, offs_dv,
                kv_len, causal_off, mask_ptrs, mask_row_ok, stride_kn, stride_vn, stride_mn, qk_scale,
                D, DV, BLOCK_D, BLOCK_DV, (phase != 1) == HAS_RANGES, IS_CAUSAL, MASK_KIND, DOT, BLOCKED_PV)

    row_store = offs_m < store_rows
    if PACK:
        row_ok = (row_q < q_len) & row_store
    else:
        row_ok = offs_m < q_len
    state_rows = row_store
    final_rows = row_store
    if CHUNKED:
        state_rows = tl.where(carry, row_store, False)
        final_rows = tl.where(finish, row_store, False)
    if WRITE_STATE or CHUNKED:
        # partial state of partition pid_p, m in natural-log units (a chunk's state for the next chunk's
        # launch keeps the kernel's base-2 units, so that no rounding enters between chunks); padded
        # rows are the identity
        if CHUNKED:
            m_st = m_i
        else:
            m_st = m_i * 0.6931471805599453
        l_st = l_i
        acc_st = acc
        if HAS_QLEN:
            m_st = tl.where(row_ok, m_st, float("-inf"))
            l_st = tl.where(row_ok, l_st, 0.0)
            acc_st = tl.where(row_ok[:, None], acc_st, 0.0)
        srow = (pid_p * BH + pid_bh).to(tl.int64) * n_rows_buf + offs_m
        tl.store(PM + srow, m_st, mask=state_rows)
        tl.store(PS + srow, l_st, mask=state_rows)
        if CHUNKED:
            tl.store(o_ptrs, acc_st.to(OUT.dtype.element_ty), mask=state_rows[:, None] & (offs_dv[None, :] < DV))
        else:
            tl.store(PW + srow[:, None] * DV + offs_dv[None, :], acc_st,
                     mask=state_rows[:, None] & (offs_dv[None, :] < DV))
        if FUSE_MERGE:
            _merge_last(PM, PS, PW, OUT, LSE, COUNT, pid_m, pid_bh, n_mblocks, start_m, store_rows, n_rows_buf, BH,
                        b64, h, Nq, stride_ob, stride_oh, stride_on, stride_od, stride_lb, stride_lh, stride_ln,
                        DV, BLOCK_DV, FUSE_MERGE, MERGE_M, WRITE_LSE)
    if (not WRITE_STATE) or CHUNKED:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_i * 0.6931471805599453 + tl.log(l_safe))
        if HAS_QLEN:
            out = tl.where(row_ok[:, None], out, 0.0)
            lse = tl.where(row_ok, lse, float("-inf"))
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=final_rows[:, None] & (offs_dv[None, :] < DV))
        if WRITE_LSE:
            if PACK:
                l_ptrs = LSE + b64 * stride_lb + row_h.to(tl.int64) * stride_lh + row_q * stride_ln
            else:
                l_ptrs = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + (q_row0 + offs_m) * stride_ln
            tl.store(l_ptrs, lse, mask=final_rows)


@triton.jit
def _merge_last(PM, PS, PW, OUT, LSE, COUNT, pid_m, pid_bh, n_mblocks, start_m, store_rows, n_rows_buf, BH, b64, h, Nq,
                stride_ob, stride_oh, stride_on, stride_od, stride_lb, stride_lh, stride_ln,
                DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, MERGE_M: tl.constexpr,
                WRITE_LSE: tl.constexpr):
    """``elsa_fwd``'s ``FUSE_MERGE``: the last of a packed row tile's partition programs merges them all.

    The states were stored by every thread of each program; the barrier orders them before the program's ticket
    (an atomic add by one thread, release and acquire at GPU scope), so the program that draws the last ticket reads
    every other program's states after its own acquire (as CUTLASS's serial split-K semaphore does); its loads skip
    L1 (``.cg``), which no other program's stores update."""
    tl.debug_barrier()
    counter = COUNT + pid_bh.to(tl.int64) * n_mblocks + pid_m
    n_part = tl.num_programs(1)
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == n_part - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # (the next launch's counters start at zero)
        offs_r = start_m + tl.arange(0, MERGE_M)
        r_ok = offs_r < store_rows
        offs_p = tl.arange(0, BLOCK_P)
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < DV
        m = tl.full([MERGE_M], float("-inf"), dtype=tl.float32)
        s = tl.zeros([MERGE_M], dtype=tl.float32)
        w = tl.zeros([MERGE_M, BLOCK_DV], dtype=tl.float32)
        for p0 in range(0, n_part, BLOCK_P):
            ok = ((p0 + offs_p) < n_part)[:, None] & r_ok[None, :]
            srow = ((p0 + offs_p)[:, None] * BH + pid_bh).to(tl.int64) * n_rows_buf + offs_r[None, :]
            m_p = tl.load(PM + srow, mask=ok, other=float("-inf"), cache_modifier=".cg")
            s_p = tl.load(PS + srow, mask=ok, other=0.0, cache_modifier=".cg")
            w_p = tl.load(PW + srow[:, :, None] * DV + offs_dv[None, None, :],
                          mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(m_p, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - ref)
            c = tl.exp(m_p - ref[None, :])  # partitions with no visible key (m_p = -inf) weigh 0
            s = s * a + tl.sum(s_p * c, 0)
            w = w * a[:, None] + tl.sum(w_p * c[:, :, None], 0)
            m = m_new
        empty = s == 0.0
        s_safe = tl.where(empty, 1.0, s)
        row_h = h + offs_r // Nq
        row_q = offs_r % Nq
        o_ptrs = (OUT + b64 * stride_ob + row_h[:, None].to(tl.int64) * stride_oh
                  + row_q[:, None].to(tl.int64) * stride_on + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, (w / s_safe[:, None]).to(OUT.dtype.element_ty), mask=r_ok[:, None] & dv_ok[None, :])
        if WRITE_LSE:
            lse = tl.where(empty, float("-inf"), m + tl.log(s_safe))
            l_ptrs = LSE + b64 * stride_lb + row_h.to(tl.int64) * stride_lh + row_q * stride_ln
            tl.store(l_ptrs, lse, mask=r_ok)


@triton.jit(do_not_specialize=["Nq", "n_mblocks", "n_rows_buf", "BH", "NUM_PART"])
def elsa_merge(
    PM, PS, PW, CUQ, OUT, LSE, FM, FS, FW,
    Nq, Hq, n_mblocks, n_rows_buf, BH, NUM_PART,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr, WRITE_STATE: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Phase 2: ⊕ over the partitions of each row, then finish (``out``, ``lse``) or write the state."""
    pid = tl.program_id(0)
    pid_m = pid % n_mblocks
    pid_bh = pid // n_mblocks
    b = pid_bh // Hq
    h = pid_bh % Hq
    b64 = b.to(tl.int64)
    if VARLEN:
        q0 = tl.load(CUQ + b)
        store_rows = tl.load(CUQ + b + 1) - q0
        q_row0 = q0.to(tl.int64)
    else:
        store_rows = Nq
        q_row0 = b64 * 0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_store = offs_m < store_rows
    dv_ok = offs_dv[None, :] < DV

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    w = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for p in range(0, NUM_PART):
        srow = (p * BH + pid_bh).to(tl.int64) * n_rows_buf + offs_m
        m_p = tl.load(PM + srow, mask=row_store, other=float("-inf"))
        s_p = tl.load(PS + srow, mask=row_store, other=0.0)
        w_p = tl.load(PW + srow[:, None] * DV + offs_dv[None, :], mask=row_store[:, None] & dv_ok, other=0.0)
        m_new = tl.maximum(m, m_p)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - ref)
        c = tl.exp(m_p - ref)
        s = s * a + s_p * c
        w = w * a[:, None] + w_p * c[:, None]
        m = m_new

    if WRITE_STATE:
        frow = pid_bh.to(tl.int64) * n_rows_buf + offs_m
        tl.store(FM + frow, m, mask=row_store)
        tl.store(FS + frow, s, mask=row_store)
        tl.store(FW + frow[:, None] * DV + offs_dv[None, :], w, mask=row_store[:, None] & dv_ok)
    else:
        empty = s == 0.0
        s_safe = tl.where(empty, 1.0, s)
        out = w / s_safe[:, None]
        o_ptrs = (OUT + b64 * stride_ob + h.to(tl.int64) * stride_oh
                  + (q_row0 + offs_m[:, None]) * stride_on + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_store[:, None] & dv_ok)
        if WRITE_LSE:
            lse = tl.where(empty, float("-inf"), m + tl.log(s_safe))
            l_ptrs = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + (q_row0 + offs_m) * stride_ln
            tl.store(l_ptrs, lse, mask=row_store)


@triton.jit(do_not_specialize=["Nq", "n_rows_buf", "BH", "NUM_PART"])
def elsa_merge_rows(
    PM, PS, PW, OUT, LSE, FM, FS, FW,
    Nq, Hq, n_rows_buf, BH, NUM_PART,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr,
    WRITE_STATE: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Phase 2 for few rows over many partitions (the packed decode kernel's): one program per row, the
    partitions read ``BLOCK_P`` at a time (a ``[BLOCK_P, Dv]`` tile) instead of one after another, so that a
    decode step's merge costs a few loads per row rather than one dependent load per partition."""
    pid = tl.program_id(0)
    row = pid % Nq
    pid_bh = pid // Nq
    b = pid_bh // Hq
    h = pid_bh % Hq
    offs_p = tl.arange(0, BLOCK_P)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    m = tl.max(tl.full([BLOCK_P], float("-inf"), dtype=tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK_P], dtype=tl.float32), 0)
    w = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for p0 in range(0, NUM_PART, BLOCK_P):
        p_ok = p0 + offs_p < NUM_PART
        srow = ((p0 + offs_p) * BH + pid_bh).to(tl.int64) * n_rows_buf + row
        m_p = tl.load(PM + srow, mask=p_ok, other=float("-inf"))
        s_p = tl.load(PS + srow, mask=p_ok, other=0.0)
        w_p = tl.load(PW + srow[:, None] * DV + offs_dv[None, :], mask=p_ok[:, None] & dv_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(m_p, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - ref)
        c = tl.exp(m_p - ref)  # partitions with no visible key (m_p = -inf) weigh 0
        s = s * a + tl.sum(s_p * c, 0)
        w = w * a + tl.sum(w_p * c[:, None], 0)
        m = m_new
    if WRITE_STATE:
        frow = pid_bh.to(tl.int64) * n_rows_buf + row
        tl.store(FM + frow, m)
        tl.store(FS + frow, s)
        tl.store(FW + frow * DV + offs_dv, w, mask=dv_ok)
    else:
        empty = s == 0.0
        s_safe = tl.where(empty, 1.0, s)
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + row * stride_on + offs_dv * stride_od
        tl.store(o_ptrs, (w / s_safe).to(OUT.dtype.element_ty), mask=dv_ok)
        if WRITE_LSE:
            lse = tl.where(empty, float("-inf"), m + tl.log(s_safe))
            tl.store(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + row * stride_ln, lse)


@triton.jit
def _split_tile(
    X, HI, LO, INV, R, H, pid_r, pid_bh,
    stride_xb, stride_xh, stride_xr, stride_xc, stride_ob, stride_oh, stride_ib, stride_ih,
    C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PER_ROW: tl.constexpr, HI_ONLY: tl.constexpr,
):
    """Rows ``[pid_r * BLOCK_R, ...)`` of head ``pid_bh`` of ``X`` into ``HI``/``LO``/``INV`` (see split_f16;
    ``HI_ONLY``: ``LO`` left unwritten)."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(X + b * stride_xb + h * stride_xh + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
                mask=ok, other=0.0)
    if PER_ROW:
        hi, lo, inv = _split_rows(x)
        tl.store(INV + b * stride_ib + h * stride_ih + rows, inv, mask=rows < R)
    else:
        sc = _pow2_scale(tl.max(tl.abs(x), 0))
        tl.store(INV + b * stride_ib + h * stride_ih + pid_r * C + cols, 1.0 / sc, mask=cols < C)
        hi, lo = _split16(x * sc[None, :])
    o = b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(HI + o, hi, mask=ok)
    if not HI_ONLY:
        tl.store(LO + o, lo, mask=ok)


@triton.jit(do_not_specialize=["R", "H", "n_rblocks"])
def split_f16(
    K, KH, KL, KI, V, VH, VL, VI, R, H, n_rblocks,
    stride_kb, stride_kh, stride_kr, stride_kc, stride_khb, stride_khh, stride_kib, stride_kih,
    stride_vb, stride_vh, stride_vr, stride_vc, stride_vhb, stride_vhh, stride_vib, stride_vih,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_RK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_RV: tl.constexpr, BLOCK_DV: tl.constexpr, V_ROWS: tl.constexpr = False, HI_ONLY: tl.constexpr = False,
):
    """fp32 ``K [B, H, R, D]`` and ``V [B, H, R, DV]`` (any strides) -> fp16 ``HI``, ``LO`` parts (``[B, H, R, C]``,
    each head's ``[R, C]`` contiguous, batch/head strides given) and inverse power-of-two scales ``INV``,
    ``X = (HI + LO) * INV``: K's per row (``KI [B, H, R]``), V's per column of each block of ``BLOCK_RV`` rows
    (``VI [B, H, ceil(R / BLOCK_RV), DV]``, ``BLOCK_RV`` being the attention kernel's ``BLOCK_N``). One launch:
    programs ``(bh * n_rblocks + r, 0)`` split K's row blocks, ``(bh * n_rblocks + r, 1)`` V's (grid ``y = 1``:
    K alone); batch and heads share grid axis x, whose limit is 2^31 - 1 (axis y's is 65,535). ``V_ROWS``: V's scales
    per row as K's (``VI [B, H, R]``; the backward's split operands, ``backward_launch``). ``HI_ONLY``: the ``LO``
    parts left unwritten (the backward's dot kind 7, which reads hi parts alone)."""
    pid_r = tl.program_id(0) % n_rblocks
    pid_bh = tl.program_id(0) // n_rblocks
    if tl.program_id(1) == 0:
        if pid_r * BLOCK_RK < R:
            _split_tile(K, KH, KL, KI, R, H, pid_r, pid_bh, stride_kb, stride_kh, stride_kr, stride_kc,
                        stride_khb, stride_khh, stride_kib, stride_kih, D, BLOCK_RK, BLOCK_D, True, HI_ONLY)
    else:
        if pid_r * BLOCK_RV < R:
            _split_tile(V, VH, VL, VI, R, H, pid_r, pid_bh, stride_vb, stride_vh, stride_vr, stride_vc,
                        stride_vhb, stride_vhh, stride_vib, stride_vih, DV, BLOCK_RV, BLOCK_DV, V_ROWS, HI_ONLY)


# every kernel's Triton cache key computed callees first, once, at import: the same key in every process (Triton 3.6's
# key of a caller depends on the order otherwise; internals.settle_cache_keys)
from . import internals  # noqa: E402

internals.settle_cache_keys(globals())
