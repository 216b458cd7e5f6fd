"""The ELSA backward in Triton, and attention dropout.

The backward recomputes the probabilities from the forward's per-row ``lse`` (never storing the attention
matrix): ``p_ij = exp(s_ij - lse_i)`` with ``s = scale * q.k + mask``. With ``do`` the output's gradient and the
dropout keep mask ``z`` (factor ``z / (1 - p_drop)``)::

    dV   = sum_i (p * z / (1 - p_drop))_ij do_i            dP = z / (1 - p_drop) * (do . v^T)
    dS   = p * (dP - delta_i),  delta_i = rowsum(do * out) - dlse_i
    dQ   = scale * dS @ K        dK = scale * dS^T @ Q        dMask = dS (reduced to the mask's shape)

Kernels (logits in base 2 as in ``scan.py``):

Both walks run their full tiles (no mask, keys in range, off the causal diagonal: :func:`_full_rows`,
:func:`_full_keys`) without the visibility tests that the diagonal's and the edges' tiles take.

* :func:`bwd_delta` ``delta = rowsum(do * out) - dlse`` per query row.
* :func:`bwd_kv` one program per (key block, batch, KV head): walks the query blocks that can see its keys
  (causal: from the diagonal on) of every query head of its group (GQA reduced here, without copying K/V), and
  writes dK, dV once. With ``ATOMIC_DQ`` it also adds ``dS @ K`` into an fp32 dQ buffer with atomics; by default
  (``ELSA_BWD_DQ=rows``, deterministic) :func:`row_pass` computes dQ instead. ``WRITE_DS`` stores dS (mask grads).
* :func:`bwd_short` the whole backward of a call whose query rows and keys each fit one tile (at most 64: Swin's
  windows), one program per (batch, KV head), in place of the three kernels here.
* :func:`row_pass` one program per (query block, batch, query head) over the key blocks its rows see:
  ``WHAT = 0`` dQ, ``1`` the dropout output ``sum_j p_ij z_ij / (1 - p_drop) v_j`` (the forward with dropout:
  lse from the scan, then this pass), ``2`` the keep mask itself (a debug hook for tests, small N).

Dropout: ``z_ij = rand(seed, counter_ij) >= p_drop`` with Triton's Philox (counter-based), ``seed`` an int64
drawn from PyTorch's generator of the tensors' device (training.py), the counter the element's index
``(b * crb + h * crh + row) * Nkc + key``: the backward regenerates exactly the forward's mask. ``row`` and ``key``
count within the sequence, also for packed varlen, whose counters are those of the padded dense call
``[B, Hq, max_seqlen_q, max_seqlen_k]``: a sequence's mask depends on the seed, its index ``b`` and the two
maxima, never on the lengths or contents of the sequences packed with it (as a dense batch row's).
Head dims that are not powers of two are padded with masked loads. Dot kinds as ``scan._dot`` (0 fp16/bf16, 1 IEEE fp32,
2 TF32, 3 3xTF32, 4 interpreter bf16), and 5 (``precise``'s fp16 split, :func:`bwd_kv` keys-major and :func:`row_pass`'s
dQ): every fp32 product from three fp16 tensor-core products (hi·hi + hi·lo + lo·hi) of operands scaled by powers of two
per row; 7 (``turbo``'s) the same with ``hi·hi`` alone, TF32's accuracy (11 significant bits a factor, rounded to
nearest) at fp16's rate. The launcher splits the operands each pass streams (Q and dO for ``bwd_kv``, K and V for the
row pass: ``scan.split_f16``, scales per row); the resident ones (K, V; Q, dO) are split once per program here. A
product that sums over query rows or keys takes the other operand's inverse row scales into the computed tile
(``dV = (p / s_dO)^T · dO_split``, ``dK = (dS / s_q)^T · q_split``, ``dQ = (dS / s_k) · K_split``), and that tile is
split with a scale per row of its own (``scan._split_rows``).
"""

import triton
import triton.language as tl

from .scan import MASK_FLOOR, _dot, _split_rows, heaviest_first

LOG2E_C: tl.constexpr = tl.constexpr(1.4426950408889634)

_SIZES = ["Nq", "Nk", "n_blocks", "mask_period", "crb", "crh", "Nkc", "head_group", "n_bh"]


@triton.jit
def _extent(b, CUQ, CUK, QLEN, KVLEN, Nq, Nk, VARLEN: tl.constexpr, HAS_QLEN: tl.constexpr,
            HAS_KVLEN: tl.constexpr):
    """``(first q row, first k row, q_len, kv_len)`` of batch row ``b`` (packed varlen: from cu_seqlens)."""
    if VARLEN:
        q0 = tl.load(CUQ + b)
        k0 = tl.load(CUK + b)
        q_len = tl.load(CUQ + b + 1) - q0
        kv_len = tl.load(CUK + b + 1) - k0
        return q0.to(tl.int64), k0.to(tl.int64), q_len, kv_len
    q_len = Nq
    kv_len = Nk
    if HAS_QLEN:
        q_len = tl.load(QLEN + b)
    if HAS_KVLEN:
        kv_len = tl.load(KVLEN + b)
    zero = b.to(tl.int64) * 0
    return zero, zero, q_len, kv_len


@triton.jit
def _masked_logits(s, r, c, q_len, kv_len, causal_off, mask_ptrs, IS_CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, MASKED: tl.constexpr = True):
    """Logits ``s`` (base 2) plus the additive mask, with hidden pairs at -inf. ``r`` / ``c``: the pairs' query rows
    and keys broadcast to ``s``'s orientation (rows-major ``rows[:, None]``, ``cols[None, :]``; keys-major the
    other way round); ``mask_ptrs`` in the same orientation. ``MASKED = False``: a full tile (every pair in range
    and visible, no mask; the loops' interior, :func:`_full_rows` / :func:`_full_keys`): ``s`` as it is."""
    if not MASKED:
        return s
    vis = (r < q_len) & (c < kv_len)
    if IS_CAUSAL:
        vis = vis & (c <= r + causal_off)
    if MASK_KIND == 1:
        mk = tl.load(mask_ptrs, mask=vis, other=0)
        vis = vis & (mk != 0)
    elif MASK_KIND == 2:
        mk = tl.load(mask_ptrs, mask=vis, other=0.0).to(tl.float32)
        mk = tl.where(mk == float("-inf"), mk, tl.maximum(mk, MASK_FLOOR))  # as the forward (scan.py)
        s = s + mk * LOG2E_C
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _probs(q, kt, lse2, rows, cols, q_len, kv_len, causal_off, mask_ptrs, qk_scale,
           IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr = True):
    """``p [BLOCK_M, BLOCK_N]`` recomputed from ``lse2`` (the row's lse in base 2; +inf for a row without a
    visible key, so that its probabilities are 0, never NaN). Hidden pairs give 0."""
    s = _dot(q, kt, tl.zeros([q.shape[0], kt.shape[1]], dtype=tl.float32), DOT) * qk_scale
    s = _masked_logits(s, rows[:, None], cols[None, :], q_len, kv_len, causal_off, mask_ptrs, IS_CAUSAL, MASK_KIND,
                       MASKED)
    return tl.exp2(s - lse2[:, None])


@triton.jit
def _keep(seed, crow, cols, Nkc, p_drop):
    """The dropout keep mask of counter rows ``crow`` (int64) and keys ``cols``, both broadcast to the tile's
    orientation (``crow[:, None]``, ``cols[None, :]`` rows-major)."""
    counter = crow * Nkc + cols.to(tl.int64)
    return tl.rand(seed, counter) >= p_drop


@triton.jit
def _dropped_keys_major(pt, dpt, seed, crow, cols, Nkc, p_drop, keep_scale, DROPOUT: tl.constexpr):
    """A keys-major tile's ``(p^T, dP^T)`` with the dropout keep mask applied (``crow``: the rows' counter rows,
    int64): ``p^T·keep / (1 - p_drop)`` and ``dP^T`` likewise; as they are without ``DROPOUT``."""
    pdt = pt
    if DROPOUT:
        keep = _keep(seed, crow[None, :], cols[:, None], Nkc, p_drop)
        pdt = tl.where(keep, pt * keep_scale, 0.0)
        dpt = tl.where(keep, dpt * keep_scale, 0.0)
    return pdt, dpt


@triton.jit
def _rows_major_grads(p, q, do, vt, delta, dk, dv, seed, crow, cols, Nkc, p_drop, keep_scale, DOT: tl.constexpr,
                      DROPOUT: tl.constexpr):
    """One rows-major tile's share of the gradients from its probabilities ``p [BLOCK_M, BLOCK_N]``: ``dS``, and
    ``dK += dS^T·q`` (unscaled), ``dV += (p·keep / (1 - p_drop))^T·dO``; ``crow`` the rows' dropout counter rows
    (int64), ``vt`` V transposed ``[BLOCK_DV, BLOCK_N]``. Returns ``(ds, dk, dv)``."""
    dp = _dot(do, vt, tl.zeros([p.shape[0], p.shape[1]], dtype=tl.float32), DOT)
    if DROPOUT:
        keep = _keep(seed, crow[:, None], cols[None, :], Nkc, p_drop)
        pd = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    else:
        pd = p
    dv = _dot(tl.trans(pd.to(do.dtype)), do, dv, DOT)
    ds = p * (dp - delta[:, None])
    dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, DOT)
    return ds, dk, dv


@triton.jit
def _dot3(a, a_lo, b, b_lo, ONE: tl.constexpr):
    """``(a + a_lo) · (b + b_lo)`` of fp16 parts as ``hi·hi + hi·lo + lo·hi`` in a fresh fp32 accumulator, the small
    products first; ``ONE`` (dot kind 7, turbo): ``hi·hi`` alone (the lo parts are then never read)."""
    acc = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
    if not ONE:
        acc = tl.dot(a_lo, b, acc)
        acc = tl.dot(a, b_lo, acc)
    return tl.dot(a, b, acc)


@triton.jit
def _load_split(hi_ptrs, lo_ptrs, inv_ptrs, ok, row_ok):
    """A split operand's tile: its hi and lo parts at ``hi_ptrs``/``lo_ptrs`` (zeros where not ``ok``) and the
    inverse scales of its rows at ``inv_ptrs`` (zeros where not ``row_ok``)."""
    return (tl.load(hi_ptrs, mask=ok, other=0.0), tl.load(lo_ptrs, mask=ok, other=0.0),
            tl.load(inv_ptrs, mask=row_ok, other=0.0))


@triton.jit
def _kv_step_split(q_base, ql_base, qi_base, o_base, ol_base, oi_base, m_base, DS, LSE, DELTA, l_off, m0, cols,
                   col_ok, k_hi, k_lo, k_inv, v_hi, v_lo, v_inv, dk, dv, b64, h64, q_row0, q_len, kv_len, causal_off,
                   seed, qk_scale, p_drop, keep_scale, crb, crh, Nkc, stride_qn, stride_qd, stride_on, stride_od,
                   stride_ln, stride_mm, stride_mn, stride_sb, stride_sh, stride_sm, stride_sn, offs_d, offs_dv,
                   D: tl.constexpr, DV_: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KIND: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, MASKED: tl.constexpr,
                   ONE: tl.constexpr):
    """One query block of :func:`bwd_kv` with the fp16 split (dot kinds 5 and 7: :func:`_dot3`), keys-major as
    :func:`_kv_step`'s ``KEYS_MAJOR`` form: q and dO come split (``*_base`` the hi parts, ``ql``/``ol`` the lo parts,
    ``qi``/``oi`` the inverse row scales); K and V were split by the program (``k_hi [BLOCK_N, BLOCK_D]``,
    ``k_inv [BLOCK_N]``)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    r64 = q_row0 + rows.to(tl.int64)
    q_off = r64[None, :] * stride_qn + offs_d[:, None] * stride_qd
    qt, qt_lo, q_inv = _load_split(q_base + q_off, ql_base + q_off, qi_base + r64,
                                   row_ok[None, :] & (offs_d[:, None] < D), row_ok)  # [BLOCK_D, BLOCK_M]
    o_off = r64[:, None] * stride_on + offs_dv[None, :] * stride_od
    do, do_lo, do_inv = _load_split(o_base + o_off, ol_base + o_off, oi_base + r64,
                                    row_ok[:, None] & (offs_dv[None, :] < DV_), row_ok)  # [BLOCK_M, BLOCK_DV]
    lse2, delta = _row_stats(LSE, DELTA, l_off, rows, row_ok, stride_ln, True)
    st = _dot3(k_hi, k_lo, qt, qt_lo, ONE) * k_inv[:, None] * (q_inv * qk_scale)[None, :]
    mask_ptrs = m_base + rows[None, :].to(tl.int64) * stride_mm + cols[:, None].to(tl.int64) * stride_mn
    st = _masked_logits(st, rows[None, :], cols[:, None], q_len, kv_len, causal_off, mask_ptrs, IS_CAUSAL,
                        MASK_KIND, MASKED)
    pt = tl.exp2(st - lse2[None, :])
    dpt = _dot3(v_hi, v_lo, tl.trans(do), tl.trans(do_lo), ONE) * v_inv[:, None] * do_inv[None, :]
    pdt, dpt = _dropped_keys_major(pt, dpt, seed, b64 * crb + h64 * crh + rows.to(tl.int64), cols, Nkc, p_drop,
                                   keep_scale, DROPOUT)
    a_hi, a_lo, a_inv = _split_rows(pdt * do_inv[None, :])
    dv += _dot3(a_hi, a_lo, do, do_lo, ONE) * a_inv[:, None]
    dst = pt * (dpt - delta[None, :])
    b_hi, b_lo, b_inv = _split_rows(dst * q_inv[None, :])
    dk += _dot3(b_hi, b_lo, tl.trans(qt), tl.trans(qt_lo), ONE) * b_inv[:, None]
    if WRITE_DS:
        tl.store(DS + b64 * stride_sb + h64 * stride_sh + rows[None, :].to(tl.int64) * stride_sm
                 + cols[:, None].to(tl.int64) * stride_sn, dst, mask=row_ok[None, :] & col_ok[:, None])
    return dk, dv


@triton.jit
def _store_kv_grads(DK, DV, dk, dv, scale, b64, hk64, k_row0, cols, col_ok, Nk, offs_d, offs_dv,
                    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                    D: tl.constexpr, DV_: tl.constexpr, VARLEN: tl.constexpr):
    """Stores a key block's ``dK`` (times ``scale``) and ``dV`` (:func:`bwd_kv`, :func:`bwd_short`). Dense calls
    write every key below ``Nk``: keys past a row's valid length get zero gradients; packed varlen ones only the
    sequence's own keys (``col_ok``), the rest being other sequences' rows."""
    if not VARLEN:
        col_ok = cols < Nk
    c64 = k_row0 + cols[:, None].to(tl.int64)
    tl.store(DK + b64 * stride_dkb + hk64 * stride_dkh + c64 * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DV + b64 * stride_dvb + hk64 * stride_dvh + c64 * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV_))


@triton.jit
def _row_stats(LSE, DELTA, l_off, rows, row_ok, stride_ln, WANT_DELTA: tl.constexpr):
    """A query block's ``lse`` in base 2 (+inf where the row sees nothing or is padding) and ``delta``."""
    lse = tl.load(LSE + l_off + rows.to(tl.int64) * stride_ln, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    delta = tl.zeros_like(lse)
    if WANT_DELTA:
        delta = tl.load(DELTA + l_off + rows.to(tl.int64) * stride_ln, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def _delta_rows(do, o, dlse_ptrs, row_ok, HAS_DLSE: tl.constexpr):
    """``delta = rowsum(do * out) - dlse`` of a row block (:func:`bwd_delta`, :func:`bwd_short`)."""
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptrs, mask=row_ok, other=0.0)
    return delta


@triton.jit(do_not_specialize=["n_rows", "Dv_rows"])
def bwd_delta(DO, OUT, DLSE, DELTA, n_rows, H, Dv_rows,
              stride_db, stride_dh, stride_dn, stride_dd, stride_ob, stride_oh, stride_on, stride_od,
              stride_gb, stride_gh, stride_gn,
              DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``DELTA[b, h, r] = sum_d DO * OUT - DLSE`` for ``n_rows`` rows of each (b, h) (``DELTA`` contiguous)."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < DV)
    r64 = rows[:, None].to(tl.int64)
    do = tl.load(DO + b * stride_db + h * stride_dh + r64 * stride_dn + cols[None, :] * stride_dd, mask=ok, other=0.0)
    o = tl.load(OUT + b * stride_ob + h * stride_oh + r64 * stride_on + cols[None, :] * stride_od, mask=ok, other=0.0)
    delta = _delta_rows(do, o, DLSE + b * stride_gb + h * stride_gh + rows.to(tl.int64) * stride_gn, rows < n_rows,
                        HAS_DLSE)
    tl.store(DELTA + pid_bh.to(tl.int64) * n_rows + rows, delta, mask=rows < n_rows)


@triton.jit
def _kv_step(q_base, o_base, m_base, DQ, DS, LSE, DELTA, l_off, m0, cols, col_ok, kt, k_rows, vt, v_rows, dk, dv,
             b64, h64, q_row0, q_len, kv_len, causal_off, seed, qk_scale, scale, p_drop, keep_scale, crb, crh, Nkc,
             stride_qn, stride_qd, stride_on, stride_od, stride_ln, stride_mm, stride_mn,
             stride_dqb, stride_dqh, stride_dqn, stride_dqd, stride_sb, stride_sh, stride_sm, stride_sn,
             offs_d, offs_dv, D: tl.constexpr, DV_: tl.constexpr, BLOCK_M: tl.constexpr,
             MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT: tl.constexpr, DROPOUT: tl.constexpr,
             ATOMIC_DQ: tl.constexpr, WRITE_DS: tl.constexpr, KEYS_MAJOR: tl.constexpr, MASKED: tl.constexpr):
    """One query block of :func:`bwd_kv`. Rows-major: ``p [BLOCK_M, BLOCK_N]``, dV += p^T·dO, dK += dS^T·q (``p``
    and ``dS``, computed tiles, transposed for those two products). ``KEYS_MAJOR``: ``p^T [BLOCK_N, BLOCK_M]``
    straight from ``k · q^T``, so that dV += p^T·dO and dK += dS^T·q take their first operand as computed, and
    dQ^T = K^T·dS^T needs no transpose either. Same arithmetic, another register layout; which is faster is the
    backward sweep's question. ``MASKED = False``: a full tile (:func:`_full_rows`)."""
    if KEYS_MAJOR:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        r64 = q_row0 + rows.to(tl.int64)
        qt = tl.load(q_base + r64[None, :] * stride_qn + offs_d[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_M]
        do = tl.load(o_base + r64[:, None] * stride_on + offs_dv[None, :] * stride_od,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV_), other=0.0)  # [BLOCK_M, BLOCK_DV]
        lse2, delta = _row_stats(LSE, DELTA, l_off, rows, row_ok, stride_ln, True)
        st = _dot(k_rows, qt, tl.zeros([k_rows.shape[0], BLOCK_M], dtype=tl.float32), DOT) * qk_scale
        mask_ptrs = m_base + rows[None, :].to(tl.int64) * stride_mm + cols[:, None].to(tl.int64) * stride_mn
        st = _masked_logits(st, rows[None, :], cols[:, None], q_len, kv_len, causal_off, mask_ptrs, IS_CAUSAL,
                            MASK_KIND, MASKED)
        pt = tl.exp2(st - lse2[None, :])
        dpt = _dot(v_rows, tl.trans(do), tl.zeros([k_rows.shape[0], BLOCK_M], dtype=tl.float32), DOT)
        pdt, dpt = _dropped_keys_major(pt, dpt, seed, b64 * crb + h64 * crh + rows.to(tl.int64), cols, Nkc,
                                       p_drop, keep_scale, DROPOUT)
        dv = _dot(pdt.to(do.dtype), do, dv, DOT)
        dst = pt * (dpt - delta[None, :])
        dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, DOT)
        if ATOMIC_DQ:
            dqt = _dot(kt, dst.to(qt.dtype), tl.zeros([kt.shape[0], BLOCK_M], dtype=tl.float32), DOT) * scale
            tl.atomic_add(DQ + b64 * stride_dqb + h64 * stride_dqh + r64[None, :] * stride_dqn
                          + offs_d[:, None] * stride_dqd, dqt, mask=row_ok[None, :] & (offs_d[:, None] < D),
                          sem="relaxed")  # (acq_rel, Triton's default, fences every add)
        if WRITE_DS:
            tl.store(DS + b64 * stride_sb + h64 * stride_sh + rows[None, :].to(tl.int64) * stride_sm
                     + cols[:, None].to(tl.int64) * stride_sn, dst, mask=row_ok[None, :] & col_ok[:, None])
    else:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        r64 = q_row0 + rows[:, None].to(tl.int64)
        q = tl.load(q_base + r64 * stride_qn + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        do = tl.load(o_base + r64 * stride_on + offs_dv[None, :] * stride_od,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV_), other=0.0)
        lse2, delta = _row_stats(LSE, DELTA, l_off, rows, row_ok, stride_ln, True)
        mask_ptrs = m_base + rows[:, None].to(tl.int64) * stride_mm + cols[None, :].to(tl.int64) * stride_mn
        p = _probs(q, kt, lse2, rows, cols, q_len, kv_len, causal_off, mask_ptrs, qk_scale, IS_CAUSAL, MASK_KIND, DOT,
                   MASKED)
        ds, dk, dv = _rows_major_grads(p, q, do, vt, delta, dk, dv, seed, b64 * crb + h64 * crh + rows.to(tl.int64),
                                       cols, Nkc, p_drop, keep_scale, DOT, DROPOUT)
        if ATOMIC_DQ:
            dq = _dot(ds.to(q.dtype), k_rows, tl.zeros([BLOCK_M, k_rows.shape[1]], dtype=tl.float32), DOT) * scale
            tl.atomic_add(DQ + b64 * stride_dqb + h64 * stride_dqh + r64 * stride_dqn
                          + offs_d[None, :] * stride_dqd, dq, mask=row_ok[:, None] & (offs_d[None, :] < D),
                          sem="relaxed")
        if WRITE_DS:
            tl.store(DS + b64 * stride_sb + h64 * stride_sh + rows[:, None].to(tl.int64) * stride_sm
                     + cols[None, :].to(tl.int64) * stride_sn, ds, mask=row_ok[:, None] & col_ok[None, :])
    return dk, dv


@triton.jit
def _two_runs(a_lo, a_hi, b_lo, b_hi, BLOCK: tl.constexpr):
    """Two runs of blocks, ``[a_lo, a_hi)`` and ``[b_lo, b_hi)``, walked as one loop ``range(a_lo, end, BLOCK)``
    whose steps from ``a_end`` on jump by ``gap`` (:func:`_skip_gap`): ``(a_end, gap, end)``. Where a second run
    follows, the first ends on a block boundary (the ranges' bounds are whole blocks; only a run that ends the line
    may end at its length), so ``a_end == a_hi`` and no step falls into the gap."""
    a_end = a_lo + (a_hi - a_lo + BLOCK - 1) // BLOCK * BLOCK
    return a_end, b_lo - a_end, a_end + (b_hi - b_lo + BLOCK - 1) // BLOCK * BLOCK


@triton.jit
def _skip_gap(x, a_end, gap, ON: tl.constexpr):
    """Step ``x`` of :func:`_two_runs`'s loop: the second run's block from ``a_end`` on (``ON``), else ``x``."""
    if ON:
        x = tl.where(x < a_end, x, x + gap)
    return x


@triton.jit
def _span_of(phase: tl.constexpr, a_lo, a_hi, b_lo, b_hi):
    """``[a_lo, a_hi)`` for phase 0, ``[b_lo, b_hi)`` for phase 1 (set before the loop, as scan.phase_span)."""
    if phase == 0:
        lo, hi = a_lo, a_hi
    else:
        lo, hi = b_lo, b_hi
    return lo, hi


@triton.jit
def _full_rows(m_lo, m_hi, n0, kv_len, causal_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """The first query block of :func:`bwd_kv`'s walk ``range(m_lo, m_hi, BLOCK_M)`` from which every row sees
    every key of ``[n0, n0 + BLOCK_N)`` (no mask; every key below ``kv_len``, as the dense call stores zero dK, dV
    for keys past a batch row's ``kv_len``; causal: rows from the diagonal's end on): the blocks from there run
    without visibility tests; ``m_hi`` when none. Rows past ``q_len`` need no test: their lse is +inf (p = 0)."""
    a = m_hi
    if MASK_KIND == 0:
        if n0 + BLOCK_N <= kv_len:
            a = m_lo
            if IS_CAUSAL:  # the first row that sees the block's last key, rounded up to a block
                a = tl.maximum(a, (tl.maximum(n0 + BLOCK_N - 1 - causal_off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
            a = tl.minimum(a, m_hi)
    return a


@triton.jit(do_not_specialize=_SIZES)
def bwd_kv(
    Q, K, V, MASK, QLEN, KVLEN, CUQ, CUK, DO, LSE, DELTA, SEED, DQ, DK, DV, DS, RANGES, QL, QI, OL, OI,
    qk_scale, scale, p_drop, keep_scale, Nq, Nk, Hq, GROUPS, n_blocks, mask_period, crb, crh, Nkc, head_group, n_bh,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mp, stride_mh, stride_mm, stride_mn, stride_rp, stride_rh,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_sb, stride_sh, stride_sm, stride_sn, stride_ib, stride_ih,
    D: tl.constexpr, DV_: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, WRITE_DS: tl.constexpr, KEYS_MAJOR: tl.constexpr = False,
    HAS_RANGES: tl.constexpr = False,
):
    """dK, dV of keys ``[n0, n0 + BLOCK_N)`` of one (batch, KV head); dQ by atomics (``ATOMIC_DQ``); dS (``WRITE_DS``).
    ``DO`` shares ``OUT``'s strides (``stride_o*``), ``DELTA`` ``LSE``'s. ``KEYS_MAJOR``: each query block by
    :func:`_kv_step`'s keys-major form (no transposes of computed tiles). ``HAS_RANGES``: the mask's row-block ranges
    of each key tile (``scan.mask_tile_ranges`` by keys): query blocks the mask hides the tile from are skipped (their
    dS is zero: ``DS`` comes zero-filled), those it hides nothing of run without visibility tests. ``DOT`` 5 or 7
    (the fp16 split, keys-major, dQ by the row pass): ``Q``/``DO`` are the hi parts of q and dO (strides
    ``stride_q*``, ``stride_o*``), ``QL``/``OL`` their lo parts (the same strides), ``QI``/``OI`` their inverse row
    scales (strides ``stride_ib``, ``stride_ih`` and 1 a row); K and V are split here."""
    tl.static_assert(DOT < 5 or (DOT != 6 and KEYS_MAJOR and not ATOMIC_DQ), "the fp16 split: keys-major, dQ by rows")
    pid = tl.program_id(0)
    Hkv = Hq // GROUPS
    if IS_CAUSAL:  # the key blocks that most query blocks see first (scan.heaviest_first)
        pid_n, pid_bk = heaviest_first(pid, n_blocks, n_bh, head_group, False)
    else:
        pid_n = pid % n_blocks
        pid_bk = pid // n_blocks
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    b64 = b.to(tl.int64)
    q_row0, k_row0, q_len, kv_len = _extent(b, CUQ, CUK, QLEN, KVLEN, Nq, Nk, VARLEN, HAS_QLEN, HAS_KVLEN)
    causal_off = kv_len - q_len
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < kv_len
    k_ptrs = (K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + (k_row0 + cols[None, :]) * stride_kn
              + offs_d[:, None] * stride_kd)
    kt = tl.load(k_ptrs, mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
    v_ptrs = (V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + (k_row0 + cols[None, :]) * stride_vn
              + offs_dv[:, None] * stride_vd)
    vt = tl.load(v_ptrs, mask=col_ok[None, :] & (offs_dv[:, None] < DV_), other=0.0)  # [BLOCK_DV, BLOCK_N]
    k_rows = tl.trans(kt)  # [BLOCK_N, BLOCK_D]
    v_rows = tl.trans(vt)  # [BLOCK_N, BLOCK_DV] (keys-major only)
    if DOT >= 5:
        k_hi, k_lo, k_inv = _split_rows(k_rows)
        v_hi, v_lo, v_inv = _split_rows(v_rows)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if DROPOUT:  # (SEED is a placeholder tensor, maybe empty, without dropout)
        seed = tl.load(SEED)
    m_lo = 0
    if IS_CAUSAL:  # rows before n0 - causal_off see none of these keys
        m_lo = tl.maximum(n0 - causal_off, 0) // BLOCK_M * BLOCK_M
    m_hi = tl.where(n0 < kv_len, q_len, 0)
    a_end = _full_rows(m_lo, m_hi, n0, kv_len, causal_off, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND)
    for g in range(0, GROUPS):
        h = hk * GROUPS + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        o_base = DO + b64 * stride_ob + h64 * stride_oh
        l_off = b64 * stride_lb + h64 * stride_lh + q_row0 * stride_ln
        m_base = MASK + (b % mask_period).to(tl.int64) * stride_mp + h64 * stride_mh
        # query blocks [p0, p1) run masked, [p1, p2) full, [p2, p3) masked: the causal diagonal's (every block when
        # masked), then full ones; with the mask's ranges, masked [r_lo, f_lo), full [f_lo, f_hi), masked [f_hi, r_hi)
        # (the masked runs first, in one loop)
        if HAS_RANGES:
            rr = RANGES + (b % mask_period).to(tl.int64) * stride_rp + h64 * stride_rh + pid_n * 4
            p0 = tl.maximum(m_lo, tl.load(rr + 0) * BLOCK_M)
            p3 = tl.maximum(p0, tl.minimum(m_hi, tl.load(rr + 3) * BLOCK_M))
            p2 = tl.maximum(p0, tl.minimum(tl.load(rr + 2) * BLOCK_M, p3))
            # clear of the causal diagonal and the valid keys too (the unmasked rule)
            p1 = tl.minimum(tl.maximum(tl.maximum(tl.load(rr + 1) * BLOCK_M, p0),
                                       _full_rows(m_lo, m_hi, n0, kv_len, causal_off, BLOCK_M, BLOCK_N, IS_CAUSAL, 0)),
                            p2)
            # the two masked runs [p0, p1) and [p2, p3) in one loop: one copy of the masked step (fewer registers)
            run_end, gap, m_end = _two_runs(p0, p1, p2, p3, BLOCK_M)
        else:
            p0, p1, p2, p3 = m_lo, a_end, m_hi, m_hi
            run_end, gap, m_end = p1, 0, p1
        # masked blocks, then the full ones (the bounds set before the loop, as scan.phase_span)
        for phase in tl.static_range(2):
            lo, hi = _span_of(phase, p0, m_end, p1, p2)
            for m_it in range(lo, hi, BLOCK_M):
                m0 = _skip_gap(m_it, run_end, gap, HAS_RANGES and phase == 0)
                if DOT >= 5:
                    i_off = b64 * stride_ib + h64 * stride_ih
                    dk, dv = _kv_step_split(q_base, QL + b64 * stride_qb + h64 * stride_qh, QI + i_off, o_base,
                                            OL + b64 * stride_ob + h64 * stride_oh, OI + i_off, m_base, DS, LSE,
                                            DELTA, l_off, m0, cols, col_ok, k_hi, k_lo, k_inv, v_hi, v_lo, v_inv,
                                            dk, dv, b64, h64, q_row0, q_len, kv_len, causal_off, seed, qk_scale,
                                            p_drop, keep_scale, crb, crh, Nkc, stride_qn, stride_qd, stride_on,
                                            stride_od, stride_ln, stride_mm, stride_mn, stride_sb, stride_sh,
                                            stride_sm, stride_sn, offs_d, offs_dv, D, DV_, BLOCK_M, MASK_KIND,
                                            IS_CAUSAL, DROPOUT, WRITE_DS, phase != 1, DOT == 7)
                else:
                    dk, dv = _kv_step(q_base, o_base, m_base, DQ, DS, LSE, DELTA, l_off, m0, cols, col_ok, kt,
                                      k_rows, vt, v_rows, dk, dv, b64, h64, q_row0, q_len, kv_len, causal_off, seed,
                                      qk_scale, scale, p_drop, keep_scale, crb, crh, Nkc, stride_qn, stride_qd,
                                      stride_on, stride_od, stride_ln, stride_mm, stride_mn, stride_dqb, stride_dqh,
                                      stride_dqn, stride_dqd, stride_sb, stride_sh, stride_sm, stride_sn, offs_d,
                                      offs_dv, D, DV_, BLOCK_M, MASK_KIND, IS_CAUSAL, DOT, DROPOUT, ATOMIC_DQ,
                                      WRITE_DS, KEYS_MAJOR, phase != 1)
    _store_kv_grads(DK, DV, dk, dv, scale, b64, hk.to(tl.int64), k_row0, cols, col_ok, Nk, offs_d, offs_dv,
                    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                    D, DV_, VARLEN)


@triton.jit
def _row_step(n0, q, do, lse2, delta, acc, seed, crow, rows, row_ok, offs_n, offs_d, offs_dv, k_base, v_base, m_base,
              k_row0, q_len, kv_len, causal_off, qk_scale, keep_scale, p_drop, Nkc, RES, b64, h64,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
              stride_rb, stride_rh, stride_rn, stride_rd, D: tl.constexpr, DV_: tl.constexpr,
              MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT: tl.constexpr, DROPOUT: tl.constexpr,
              WHAT: tl.constexpr, MASKED: tl.constexpr):
    """Key block ``[n0, n0 + BLOCK_N)`` of :func:`row_pass`."""
    cols = n0 + offs_n
    col_ok = cols < kv_len
    c64 = k_row0 + cols[None, :].to(tl.int64)
    kt = tl.load(k_base + c64 * stride_kn + offs_d[:, None] * stride_kd,
                 mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)
    mask_ptrs = m_base + rows[:, None].to(tl.int64) * stride_mm + cols[None, :].to(tl.int64) * stride_mn
    p = _probs(q, kt, lse2, rows, cols, q_len, kv_len, causal_off, mask_ptrs, qk_scale, IS_CAUSAL, MASK_KIND, DOT,
               MASKED)
    if DROPOUT:
        keep = _keep(seed, crow[:, None], cols[None, :], Nkc, p_drop)
    else:
        keep = p == p
    if WHAT == 2:
        tl.store(RES + b64 * stride_rb + h64 * stride_rh + rows[:, None].to(tl.int64) * stride_rn
                 + cols[None, :].to(tl.int64) * stride_rd, keep.to(tl.uint8),
                 mask=row_ok[:, None] & col_ok[None, :])
    elif WHAT == 1:
        v = tl.load(v_base + tl.trans(c64) * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < DV_), other=0.0)
        pd = tl.where(keep, p * keep_scale, 0.0)
        acc = _dot(pd.to(v.dtype), v, acc, DOT)
    else:
        vt = tl.load(v_base + c64 * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=col_ok[None, :] & (offs_dv[:, None] < DV_), other=0.0)
        dp = _dot(do, vt, tl.zeros([q.shape[0], kt.shape[1]], dtype=tl.float32), DOT)
        if DROPOUT:
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        acc = _dot(ds.to(q.dtype), tl.trans(kt), acc, DOT)
    return acc


@triton.jit
def _row_step_split(n0, q, q_lo, q_inv, do, do_lo, do_inv, lse2, delta, acc, seed, crow, rows, offs_n, offs_d,
                    offs_dv, k_base, kl_base, ki_base, v_base, vl_base, vi_base, m_base, k_row0, q_len, kv_len,
                    causal_off, qk_scale, keep_scale, p_drop, Nkc, stride_kn, stride_kd, stride_vn, stride_vd,
                    stride_mm, stride_mn, D: tl.constexpr, DV_: tl.constexpr, MASK_KIND: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr, ONE: tl.constexpr):
    """Key block ``[n0, n0 + BLOCK_N)`` of :func:`row_pass`'s dQ with the fp16 split (dot kinds 5 and 7): K and V come
    split (``*_base`` the hi parts, ``kl``/``vl`` the lo parts, ``ki``/``vi`` the inverse row scales); q and dO were
    split by the program."""
    cols = n0 + offs_n
    col_ok = cols < kv_len
    c64 = k_row0 + cols.to(tl.int64)
    k_off = c64[None, :] * stride_kn + offs_d[:, None] * stride_kd
    kt, kt_lo, k_inv = _load_split(k_base + k_off, kl_base + k_off, ki_base + c64,
                                   col_ok[None, :] & (offs_d[:, None] < D), col_ok)  # [BLOCK_D, BLOCK_N]
    s = _dot3(q, q_lo, kt, kt_lo, ONE) * (q_inv * qk_scale)[:, None] * k_inv[None, :]
    mask_ptrs = m_base + rows[:, None].to(tl.int64) * stride_mm + cols[None, :].to(tl.int64) * stride_mn
    s = _masked_logits(s, rows[:, None], cols[None, :], q_len, kv_len, causal_off, mask_ptrs, IS_CAUSAL, MASK_KIND,
                       MASKED)
    p = tl.exp2(s - lse2[:, None])
    v_off = c64[None, :] * stride_vn + offs_dv[:, None] * stride_vd
    vt, vt_lo, v_inv = _load_split(v_base + v_off, vl_base + v_off, vi_base + c64,
                                   col_ok[None, :] & (offs_dv[:, None] < DV_), col_ok)  # [BLOCK_DV, BLOCK_N]
    dp = _dot3(do, do_lo, vt, vt_lo, ONE) * do_inv[:, None] * v_inv[None, :]
    if DROPOUT:
        keep = _keep(seed, crow[:, None], cols[None, :], Nkc, p_drop)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    c_hi, c_lo, c_inv = _split_rows(ds * k_inv[None, :])
    return acc + _dot3(c_hi, c_lo, tl.trans(kt), tl.trans(kt_lo), ONE) * c_inv[:, None]


@triton.jit
def _full_keys(m_start, n_hi, causal_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """The end of :func:`row_pass`'s first key blocks ``range(0, n_hi, BLOCK_N)`` that every row of
    ``[m_start, m_start + BLOCK_M)`` sees whole (no mask; causal: keys up to the first row's diagonal), run without
    visibility tests; 0 when none. Whole blocks only: a key past ``kv_len`` loads as zeros, but its ``p =
    exp2(0 - lse2)`` is not 0 and is huge for a row whose logits are all very negative, so that ``dS`` overflowed
    fp16 (and fp32's exp2 below lse -88) and ``inf * 0`` put NaN into dQ (the gradient fuzzer's find, session 67); the
    partial last block runs masked. Rows past ``q_len`` need no test: their lse is +inf (p = 0)."""
    nf = n_hi * 0
    if MASK_KIND == 0:
        nf = n_hi // BLOCK_N * BLOCK_N
        if IS_CAUSAL:
            nf = tl.minimum(nf, tl.maximum(m_start + causal_off + 1, 0) // BLOCK_N * BLOCK_N)
    return nf


@triton.jit(do_not_specialize=_SIZES)
def row_pass(
    Q, K, V, MASK, QLEN, KVLEN, CUQ, CUK, DO, LSE, DELTA, SEED, RES, RANGES, KL, KI, VL, VI,
    qk_scale, scale, p_drop, keep_scale, Nq, Nk, Hq, GROUPS, n_blocks, mask_period, crb, crh, Nkc, head_group, n_bh,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mp, stride_mh, stride_mm, stride_mn, stride_gp, stride_gh,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_rb, stride_rh, stride_rn, stride_rd, stride_ib, stride_ih,
    D: tl.constexpr, DV_: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    DROPOUT: tl.constexpr, WHAT: tl.constexpr, HAS_RANGES: tl.constexpr = False,
):
    """Rows ``[m0, m0 + BLOCK_M)`` of one (batch, query head) over their visible key blocks. ``RES``: dQ (``WHAT = 0``,
    fp32 or q's dtype), the dropout output (``1``, ``[.., Dv]``), the keep mask (``2``, ``[B, Hq, Nq, Nk]`` uint8,
    ``stride_rd`` the key stride: pairs in skipped blocks are not written). ``DO`` shares ``OUT``'s strides
    (``stride_o*``). ``HAS_RANGES``: the mask's key-block ranges of each row tile (``scan.mask_tile_ranges``, strides
    ``stride_gp``, ``stride_gh``), as the forward reads them. ``DOT`` 5 or 7 (the fp16 split, dQ only): ``K``/``V`` are
    the hi parts of K and V (strides ``stride_k*``, ``stride_v*``), ``KL``/``VL`` their lo parts (the same strides),
    ``KI``/``VI`` their inverse row scales (strides ``stride_ib``, ``stride_ih`` and 1 a key); q and dO are split
    here."""
    tl.static_assert(DOT < 5 or (DOT != 6 and WHAT == 0), "the fp16 split computes dQ only")
    pid = tl.program_id(0)
    if IS_CAUSAL:  # the row blocks that see the most keys first (scan.heaviest_first)
        pid_m, pid_bh = heaviest_first(pid, n_blocks, n_bh, head_group, True)
    else:
        pid_m = pid % n_blocks
        pid_bh = pid // n_blocks
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUPS
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_row0, k_row0, q_len, kv_len = _extent(b, CUQ, CUK, QLEN, KVLEN, Nq, Nk, VARLEN, HAS_QLEN, HAS_KVLEN)
    causal_off = kv_len - q_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    r64 = q_row0 + rows[:, None].to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + r64 * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    l_off = b64 * stride_lb + h64 * stride_lh + q_row0 * stride_ln
    lse2, delta = _row_stats(LSE, DELTA, l_off, rows, row_ok, stride_ln, WHAT == 0)
    if WHAT == 0:
        do = tl.load(DO + b64 * stride_ob + h64 * stride_oh + r64 * stride_on + offs_dv[None, :] * stride_od,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV_), other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        do = q  # (unused)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if DROPOUT:  # (SEED is a placeholder tensor, maybe empty, without dropout)
        seed = tl.load(SEED)
    crow = b64 * crb + h64 * crh + rows.to(tl.int64)  # rows within the sequence (packed too)
    k_head = b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_head = b64 * stride_vb + hk.to(tl.int64) * stride_vh
    k_base = K + k_head
    v_base = V + v_head
    m_base = MASK + (b % mask_period).to(tl.int64) * stride_mp + h64 * stride_mh
    n_hi = tl.where(pid_m * BLOCK_M < q_len, kv_len, 0)
    if IS_CAUSAL:
        n_hi = tl.minimum(n_hi, tl.maximum(tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len) + causal_off, 0))
    nf = _full_keys(pid_m * BLOCK_M, n_hi, causal_off, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND)
    # key blocks [p0, p1) run full (those no row of the tile has hidden: no visibility tests), then [p2, p3)
    # masked; with the mask's ranges, full [f_lo, f_hi), then the masked [r_lo, f_lo) and [f_hi, r_hi) in one loop
    # (as bwd_kv: one copy of the masked step; the bounds before the loop)
    if HAS_RANGES:
        rr = RANGES + (b % mask_period).to(tl.int64) * stride_gp + h64 * stride_gh + pid_m * 4
        r_lo = tl.minimum(tl.load(rr + 0) * BLOCK_N, n_hi)
        r_hi = tl.maximum(r_lo, tl.minimum(n_hi, tl.load(rr + 3) * BLOCK_N))
        f_lo = tl.minimum(tl.maximum(tl.load(rr + 1) * BLOCK_N, r_lo), r_hi)
        # clear of the causal diagonal too (the unmasked rule)
        f_hi = tl.maximum(f_lo, tl.minimum(tl.minimum(tl.load(rr + 2) * BLOCK_N, r_hi),
                                           _full_keys(pid_m * BLOCK_M, n_hi, causal_off, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                      0)))
        p0, p1 = f_lo, f_hi  # full [f_lo, f_hi), then masked [r_lo, f_lo) and [f_hi, r_hi) in one loop
        run_end, gap, p3 = _two_runs(r_lo, f_lo, f_hi, r_hi, BLOCK_N)
        p2 = r_lo
    else:
        p0, p1, p2, p3 = 0, nf, nf, n_hi
        run_end, gap = p3, 0
    if DOT >= 5:
        q, q_lo, q_inv = _split_rows(q)
        do, do_lo, do_inv = _split_rows(do)
        i_off = b64 * stride_ib + hk.to(tl.int64) * stride_ih
    for phase in tl.static_range(2):
        lo, hi = _span_of(phase, p0, p1, p2, p3)
        for n_it in range(lo, hi, BLOCK_N):
            n0 = _skip_gap(n_it, run_end, gap, HAS_RANGES and phase == 1)
            if DOT >= 5:
                acc = _row_step_split(n0, q, q_lo, q_inv, do, do_lo, do_inv, lse2, delta, acc, seed, crow, rows,
                                      offs_n, offs_d, offs_dv, k_base, KL + k_head, KI + i_off, v_base,
                                      VL + v_head, VI + i_off, m_base, k_row0, q_len, kv_len, causal_off,
                                      qk_scale, keep_scale, p_drop, Nkc, stride_kn, stride_kd, stride_vn, stride_vd,
                                      stride_mm, stride_mn, D, DV_, MASK_KIND, IS_CAUSAL, DROPOUT, phase == 1,
                                      DOT == 7)
            else:
                acc = _row_step(n0, q, do, lse2, delta, acc, seed, crow, rows, row_ok, offs_n, offs_d, offs_dv,
                                k_base, v_base, m_base, k_row0, q_len, kv_len, causal_off, qk_scale, keep_scale,
                                p_drop, Nkc, RES, b64, h64, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
                                stride_mn, stride_rb, stride_rh, stride_rn, stride_rd, D, DV_, MASK_KIND, IS_CAUSAL,
                                DOT, DROPOUT, WHAT, phase == 1)
    if WHAT == 0:
        tl.store(RES + b64 * stride_rb + h64 * stride_rh + r64 * stride_rn + offs_d[None, :] * stride_rd,
                 (acc * scale).to(RES.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
    elif WHAT == 1:
        tl.store(RES + b64 * stride_rb + h64 * stride_rh + r64 * stride_rn + offs_dv[None, :] * stride_rd,
                 acc.to(RES.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV_))


@triton.jit(do_not_specialize=["Nq", "Nk", "mask_period", "crb", "crh", "Nkc"])
def bwd_short(
    Q, K, V, MASK, QLEN, KVLEN, CUQ, CUK, DO, OUT, LSE, DLSE, SEED, DQ, DK, DV, DS,
    qk_scale, scale, p_drop, keep_scale, Nq, Nk, Hq, GROUPS, mask_period, crb, crh, Nkc,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mp, stride_mh, stride_mm, stride_mn,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_eb, stride_eh, stride_en,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_sb, stride_sh, stride_sm, stride_sn,
    D: tl.constexpr, DV_: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """The whole backward of one (batch, KV head) whose query rows fit one ``BLOCK_M`` tile and keys one
    ``BLOCK_N`` tile (Swin's and SwinV2's windows, short sequences): one program, one launch, in place of
    :func:`bwd_delta`, :func:`bwd_kv` and :func:`row_pass`. For each query head of the group it computes ``delta``,
    the probabilities once, dV and dK (summed over the group in registers), dQ (complete: every key is in the tile;
    no atomics, deterministic) and dS (``WRITE_DS``). ``DO`` has strides ``stride_g*``, ``OUT`` ``stride_o*``,
    ``DLSE`` ``stride_e*``. Dense calls write every row of dQ and every key of dK, dV (zeros past the lengths)."""
    pid = tl.program_id(0)
    Hkv = Hq // GROUPS
    b = pid // Hkv
    hk = pid % Hkv
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    q_row0, k_row0, q_len, kv_len = _extent(b, CUQ, CUK, QLEN, KVLEN, Nq, Nk, VARLEN, HAS_QLEN, HAS_KVLEN)
    causal_off = kv_len - q_len
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < q_len
    col_ok = cols < kv_len
    r64 = q_row0 + rows[:, None].to(tl.int64)
    c64 = k_row0 + cols[None, :].to(tl.int64)
    kt = tl.load(K + b64 * stride_kb + hk64 * stride_kh + c64 * stride_kn + offs_d[:, None] * stride_kd,
                 mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
    vt = tl.load(V + b64 * stride_vb + hk64 * stride_vh + c64 * stride_vn + offs_dv[:, None] * stride_vd,
                 mask=col_ok[None, :] & (offs_dv[:, None] < DV_), other=0.0)  # [BLOCK_DV, BLOCK_N]
    k_rows = tl.trans(kt)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if DROPOUT:  # (SEED is a placeholder tensor, maybe empty, without dropout)
        seed = tl.load(SEED)
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    o_mask = row_ok[:, None] & (offs_dv[None, :] < DV_)
    for g in range(0, GROUPS):
        h64 = (hk * GROUPS + g).to(tl.int64)
        q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + r64 * stride_qn + offs_d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
        do = tl.load(DO + b64 * stride_gb + h64 * stride_gh + r64 * stride_gn + offs_dv[None, :] * stride_gd,
                     mask=o_mask, other=0.0)
        o = tl.load(OUT + b64 * stride_ob + h64 * stride_oh + r64 * stride_on + offs_dv[None, :] * stride_od,
                    mask=o_mask, other=0.0)
        l_off = b64 * stride_lb + h64 * stride_lh + q_row0 * stride_ln
        lse2, _ = _row_stats(LSE, LSE, l_off, rows, row_ok, stride_ln, False)  # (delta computed here)
        delta = _delta_rows(do, o, DLSE + b64 * stride_eb + h64 * stride_eh + (q_row0 + rows.to(tl.int64)) * stride_en,
                            row_ok, HAS_DLSE)
        m_base = MASK + (b % mask_period).to(tl.int64) * stride_mp + h64 * stride_mh
        mask_ptrs = m_base + rows[:, None].to(tl.int64) * stride_mm + cols[None, :].to(tl.int64) * stride_mn
        p = _probs(q, kt, lse2, rows, cols, q_len, kv_len, causal_off, mask_ptrs, qk_scale, IS_CAUSAL, MASK_KIND, DOT)
        ds, dk, dv = _rows_major_grads(p, q, do, vt, delta, dk, dv, seed, b64 * crb + h64 * crh + rows.to(tl.int64),
                                       cols, Nkc, p_drop, keep_scale, DOT, DROPOUT)
        dq = _dot(ds.to(q.dtype), k_rows, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), DOT) * scale
        dq_ok = q_mask
        if not VARLEN:  # dense: rows past q_len get zeros (packed: other sequences' rows)
            dq_ok = (rows[:, None] < Nq) & (offs_d[None, :] < D)
        tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + r64 * stride_dqn + offs_d[None, :] * stride_dqd,
                 dq.to(DQ.dtype.element_ty), mask=dq_ok)
        if WRITE_DS:
            tl.store(DS + b64 * stride_sb + h64 * stride_sh + rows[:, None].to(tl.int64) * stride_sm
                     + cols[None, :].to(tl.int64) * stride_sn, ds, mask=row_ok[:, None] & col_ok[None, :])
    _store_kv_grads(DK, DV, dk, dv, scale, b64, hk64, k_row0, cols, col_ok, Nk, offs_d, offs_dv,
                    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                    D, DV_, VARLEN)


# every kernel's Triton cache key computed callees first, once, at import: the same key in every process (Triton 3.6's
# key of a caller depends on the order otherwise; internals.settle_cache_keys)
from . import internals  # noqa: E402

internals.settle_cache_keys(globals())
