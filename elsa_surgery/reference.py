"""The reference backend: pure PyTorch, any dtype (float64 is the project's oracle), any device.

It is the ELSA scan written with tensor ops: queries are processed in chunks, and each query chunk
folds key chunks into its ``(m, S, W)`` state with :func:`elsa_surgery.monoid.fold_scores`. Extra
memory is ``O(B · H · CHUNK_Q · CHUNK_K)``, never ``N × N``. Causal and padded-length chunks that are
fully masked are skipped, exactly as the kernels skip blocks.

:func:`run_state_backward` is the scan's backward: a second pass over the same blocks (and the same dropout
draws, given the forward's ``seed``) that writes the gradients without an autograd graph. Eager calls
differentiate the forward with autograd instead; the custom ops of :mod:`elsa_surgery.reference_ops`, which the
API calls under torch.compile, use it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import monoid
from .semantics import AttentionProblem, VarlenProblem

# Score-block budget in elements (B·Hq·chunk_q·chunk_k); 2**22 fp32 scores = 16 MiB per block.
SCORE_BLOCK_ELEMENTS = 1 << 22
MAX_CHUNK = 1024
MIN_CHUNK = 16


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_sizes(rows: int, n_q: int, n_k: int, budget: int = SCORE_BLOCK_ELEMENTS) -> Tuple[int, int]:
    """Query and key chunk lengths so that ``rows · chunk_q · chunk_k <= budget`` (where possible)."""
    per_row = max(1, budget // max(rows, 1))
    chunk_k = max(MIN_CHUNK, min(MAX_CHUNK, n_k, per_row))
    chunk_q = max(MIN_CHUNK, min(MAX_CHUNK, n_q, per_row // max(chunk_k, 1)))
    return max(1, min(chunk_q, max(n_q, 1))), max(1, min(chunk_k, max(n_k, 1)))


def _grouped(t: torch.Tensor, hkv: int, groups: int) -> torch.Tensor:
    """``[B, Hq, N, X] -> [B, Hkv, G, N, X]`` (a view)."""
    b, _, n, x = t.shape
    return t.reshape(b, hkv, groups, n, x)


def _mask_view(p: AttentionProblem) -> Optional[torch.Tensor]:
    """The canonical mask as ``[P, Hkv|1, G|1, Nq, Nk]`` (a view; broadcast axes keep stride 0)."""
    if p.mask is None:
        return None
    m = p.mask
    if m.shape[1] == 1:
        return m.unsqueeze(2)
    return m.reshape(m.shape[0], p.heads_kv, p.groups, p.n_q, p.n_k)


def _scan(p: AttentionProblem, seed: Optional[int]):
    """The blocks of the scan in order, shared by :func:`run_state` and :func:`run_state_backward` so that both
    visit the same chunks and draw the same dropout masks (from a generator seeded with ``seed``; from the
    global generator when ``seed`` is None).

    Yields one ``(rows, qc, blocks)`` per query chunk: ``rows`` the chunk's slice of the query axis, ``qc`` its
    queries times the scale ``[B, Hkv, G, cq, D]`` (accumulation dtype), and ``blocks`` an iterator of
    ``(cols, kc, vc, s, keep)`` over the chunk's key blocks: ``kc [B, Hkv, 1, ck, D]``, ``vc [B, Hkv, 1, ck, Dv]``,
    the masked scores ``s [B, Hkv, G, cq, ck]`` (hidden pairs ``-inf``) and the dropout factors (or None).
    Consume every ``blocks`` before the next query chunk.
    """
    acc = _acc_dtype(p.q.dtype)
    B, Hq, Nq, _ = p.q.shape
    Hkv, G, Nk = p.heads_kv, p.groups, p.n_k
    dev = p.q.device
    generator = None if seed is None else torch.Generator(device=dev).manual_seed(seed)
    q5 = _grouped(p.q, Hkv, G)  # [B, Hkv, G, Nq, D]
    k5 = p.k.unsqueeze(2)  # [B, Hkv, 1, Nk, D]
    v5 = p.v.unsqueeze(2)
    mask5 = _mask_view(p)
    period = 1 if mask5 is None else mask5.shape[0]
    batch_rows = torch.arange(B, device=dev) % period

    # Static skip bounds (no host sync): with no lengths the causal frontier is known exactly.
    static_offset = Nk - Nq if (p.q_lengths is None and p.kv_lengths is None) else None

    cq, ck = chunk_sizes(B * Hq, Nq, Nk)

    def blocks(i0: int, i1: int, qc: torch.Tensor):
        rows = torch.arange(i0, i1, device=dev)
        for j0 in range(0, Nk, ck):
            j1 = min(Nk, j0 + ck)
            if p.is_causal and static_offset is not None and j0 > (i1 - 1) + static_offset:
                break  # every later key block is above the causal frontier of this query chunk
            kc = k5[:, :, :, j0:j1].to(acc)
            s = torch.matmul(qc, kc.transpose(-1, -2))
            if mask5 is not None:
                mc = mask5[batch_rows, ..., i0:i1, j0:j1] if period not in (1, B) else mask5[..., i0:i1, j0:j1]
                if mc.dtype == torch.bool:
                    s.masked_fill_(~mc, float("-inf"))
                else:
                    s.add_(mc.to(acc))
            if p.has_index_mask:
                vis = p.visible(rows, torch.arange(j0, j1, device=dev))
                s.masked_fill_(~vis.view(B, 1, 1, i1 - i0, j1 - j0), float("-inf"))
            keep = _dropout_keep(s, p.dropout_p, generator) if p.dropout_p > 0 else None
            yield slice(j0, j1), kc, v5[:, :, :, j0:j1].to(acc), s, keep

    for i0 in range(0, Nq, cq):
        i1 = min(Nq, i0 + cq)
        qc = q5[:, :, :, i0:i1].to(acc) * p.scale  # fold the scale into q once per chunk
        yield slice(i0, i1), qc, blocks(i0, i1, qc)


def run_state(p: AttentionProblem, seed: Optional[int] = None) -> monoid.State:
    """Fold every visible key into per-row states ``m, S [B, Hq, Nq]``, ``W [B, Hq, Nq, Dv]``.

    Dropout (``p.dropout_p > 0``) draws its masks from the global generator, or with ``seed`` from a fresh
    generator seeded with it (the same masks on every call: what :func:`run_state_backward` relies on).
    """
    acc = _acc_dtype(p.q.dtype)
    B, Hq, Nq, _ = p.q.shape
    state = monoid.identity((B, p.heads_kv, p.groups, Nq), p.head_dim_v, dtype=acc, device=p.q.device)
    if p.empty:
        return monoid.State(*(t.reshape(B, Hq, Nq, *t.shape[4:]) for t in state))
    ms, Ss, Ws = [], [], []
    for rows, qc, blocks in _scan(p, seed):
        st = monoid.State(*(t[:, :, :, rows] for t in state))
        for _, _, vc, s, keep in blocks:
            st = monoid.fold_scores(st, s, vc, keep)
        ms.append(st.m)
        Ss.append(st.S)
        Ws.append(st.W)
    m = torch.cat(ms, dim=3).reshape(B, Hq, Nq)
    S = torch.cat(Ss, dim=3).reshape(B, Hq, Nq)
    W = torch.cat(Ws, dim=3).reshape(B, Hq, Nq, p.head_dim_v)
    return monoid.State(m, S, W)


def run_state_backward(p: AttentionProblem, state: monoid.State, grads: monoid.State, seed: Optional[int] = None,
                       mask_grad: bool = False):
    """``(dq, dk, dv, dmask)``: the gradients of a scalar whose gradients with respect to ``state =
    run_state(p, seed)`` are ``grads`` (a ``State`` of ``m, S, W`` gradients), computed block by block in the
    scan's order without an autograd graph (memory ``O(chunk)`` besides the results).

    ``dmask`` (with ``mask_grad``, for an additive mask; else None) has the canonical mask's shape
    ``[P, Hq|1, Nq, Nk]``. A row with no visible key is the constant identity (zero gradients). ``m`` is a
    maximum: its gradient, net of what ``S`` and ``W`` owe to it, goes to the first maximal score of the row.
    Dropout needs the ``seed`` that produced ``state``.
    """
    acc = _acc_dtype(p.q.dtype)
    B, Hq, Nq, D = p.q.shape
    Hkv, G, Nk, Dv = p.heads_kv, p.groups, p.n_k, p.head_dim_v
    dev = p.q.device
    mask5 = _mask_view(p) if mask_grad else None
    if mask_grad and (mask5 is None or mask5.dtype == torch.bool):
        raise ValueError("mask_grad=True needs an additive (floating-point) mask")
    dq = torch.zeros((B, Hkv, G, Nq, D), dtype=acc, device=dev)
    dk = torch.zeros((B, Hkv, Nk, D), dtype=acc, device=dev)
    dv = torch.zeros((B, Hkv, Nk, Dv), dtype=acc, device=dev)
    dmask5 = None if mask5 is None else torch.zeros(mask5.shape, dtype=acc, device=dev)
    if not p.empty:
        grouped = lambda t: t.reshape(B, Hkv, G, Nq, *t.shape[3:]).to(acc)
        m, S, W = (grouped(t) for t in state)
        gm, gS, gW = (grouped(t) for t in grads)
        filled = S > 0
        g_max = torch.where(filled, gm - gS * S - (gW * W).sum(-1), torch.zeros_like(gm))
        ref = monoid._safe_max(m)
        batch_rows = None if mask5 is None else torch.arange(B, device=dev) % mask5.shape[0]
        for rows, qc, blocks in _scan(p, seed):
            m_c, ref_c, gS_c, gW_c, g_max_c = (t[:, :, :, rows] for t in (m, ref, gS, gW, g_max))
            unclaimed = filled[:, :, :, rows]  # rows whose maximal score is still to be found
            for cols, kc, vc, s, keep in blocks:
                prob = torch.exp(s - ref_c.unsqueeze(-1))
                d_prob = torch.matmul(gW_c, vc.transpose(-1, -2))
                kept = prob
                if keep is not None:
                    d_prob = d_prob * keep
                    kept = prob * keep
                ds = prob * (gS_c.unsqueeze(-1) + d_prob)
                hit = (s == m_c.unsqueeze(-1)) & unclaimed.unsqueeze(-1)
                first = hit & (hit.cumsum(-1) == 1)
                ds = ds + first.to(acc) * g_max_c.unsqueeze(-1)
                unclaimed = unclaimed & ~hit.any(-1)
                dv[:, :, cols] += torch.matmul(kept.transpose(-1, -2), gW_c).sum(2)
                dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), qc).sum(2)
                dq[:, :, :, rows] += torch.matmul(ds, kc)
                if dmask5 is not None:
                    per_mask = ds.sum((1, 2), keepdim=True) if p.mask.shape[1] == 1 else ds
                    dmask5[..., rows, cols].index_add_(0, batch_rows, per_mask)
        dq *= p.scale
    dmask = None if dmask5 is None else dmask5.reshape(p.mask.shape).to(p.mask.dtype)
    return dq.reshape(B, Hq, Nq, D).to(p.q.dtype), dk.to(p.k.dtype), dv.to(p.v.dtype), dmask


def _dropout_keep(scores: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """SDPA's attention dropout for one score block: each probability kept with chance ``1 - p`` and scaled
    by ``1 / (1 - p)`` (all dropped at ``p = 1``)."""
    if p >= 1.0:
        return torch.zeros_like(scores)
    return torch.empty_like(scores).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)


def run(p: AttentionProblem, return_lse: bool = False, seed: Optional[int] = None):
    out, lse = monoid.finalize(run_state(p, seed), out_dtype=p.q.dtype)
    return out, (lse if return_lse else None)


def run_backward(p: AttentionProblem, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                 seed: Optional[int] = None, mask_grad: bool = False):
    """``(dq, dk, dv, dmask)`` for gradients ``grad_out``, ``grad_lse`` (None = zero) of :func:`run`'s
    ``(out, lse)``: the forward state is recomputed (with the same ``seed``), then :func:`run_state_backward`."""
    with torch.no_grad():
        state = run_state(p, seed)
        return run_state_backward(p, state, monoid.finalize_backward(state, grad_out, grad_lse), seed, mask_grad)


def sequence_seed(seed: Optional[int], b: int) -> Optional[int]:
    """The dropout seed of sequence ``b`` of a packed call seeded with ``seed`` (None: the global generator)."""
    return None if seed is None else (seed + b) % (1 << 63)


def _varlen_problems(vp: VarlenProblem):
    """``(b, rows_q, rows_k, problem)`` per non-empty sequence: its index, its slices of the packed axes and its
    dense problem (dropout within the sequence)."""
    cq = vp.cu_seqlens_q.tolist()
    ck = vp.cu_seqlens_k.tolist()
    dense = lambda t: t.transpose(0, 1).unsqueeze(0)  # [n, H, X] -> [1, H, n, X]
    for b in range(vp.batch):
        if cq[b + 1] == cq[b]:
            continue
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        yield b, qs, ks, AttentionProblem(q=dense(vp.q[qs]), k=dense(vp.k[ks]), v=dense(vp.v[ks]), scale=vp.scale,
                                          mask=None, is_causal=vp.is_causal, q_lengths=None, kv_lengths=None,
                                          dropout_p=vp.dropout_p)


def run_varlen(vp: VarlenProblem, return_lse: bool = False, seed: Optional[int] = None):
    """Packed varlen: each sequence is an independent dense problem (bottom-right causal per sequence). Dropout
    masks come from the global generator, one sequence after another, or with ``seed`` from
    :func:`sequence_seed`'s per-sequence seeds (what :func:`run_varlen_backward` redraws)."""
    total_q, Hq, _ = vp.q.shape
    Dv = vp.v.shape[-1]
    out = vp.q.new_zeros((total_q, Hq, Dv))
    lse = torch.full((Hq, total_q), float("-inf"), dtype=_acc_dtype(vp.q.dtype), device=vp.q.device)
    for b, qs, _, sub in _varlen_problems(vp):
        o, l = run(sub, return_lse=True, seed=sequence_seed(seed, b))
        out[qs] = o[0].transpose(0, 1)
        lse[:, qs] = l[0]
    return out, (lse if return_lse else None)


def run_varlen_backward(vp: VarlenProblem, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                        seed: Optional[int] = None):
    """``(dq, dk, dv)`` for gradients ``grad_out [total_q, Hq, Dv]``, ``grad_lse [Hq, total_q]`` (None = zero)
    of :func:`run_varlen`'s ``(out, lse)``, one sequence at a time with :func:`run_backward`."""
    dq, dk, dv = (t.new_zeros(t.shape) for t in (vp.q, vp.k, vp.v))
    for b, qs, ks, sub in _varlen_problems(vp):
        g_out = None if grad_out is None else grad_out[qs].transpose(0, 1).unsqueeze(0)
        g_lse = None if grad_lse is None else grad_lse[:, qs].unsqueeze(0)
        dq_b, dk_b, dv_b, _ = run_backward(sub, g_out, g_lse, sequence_seed(seed, b))
        dq[qs] = dq_b[0].transpose(0, 1)
        dk[ks] += dk_b[0].transpose(0, 1)
        dv[ks] += dv_b[0].transpose(0, 1)
    return dq, dk, dv
