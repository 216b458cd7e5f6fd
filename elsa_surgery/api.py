"""The functional API: an SDPA drop-in and its varlen / state-returning siblings.

Semantics are stated once, in :mod:`elsa_surgery.semantics`; the backend is chosen once, in
:func:`elsa_surgery.dispatch.decide`. This file only wires the two together (for :func:`attention` through
:mod:`elsa_surgery.callcache`, which runs both once per call signature).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import callcache, dispatch, monoid, reference_ops, sdpa
from .semantics import _ANY_AUTOCAST, Lengths, autocast_cast, autocast_dtype, build_problem


_kernels = dispatch.kernels_module  # imported on first use: triton is only needed when the kernels run


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    precision: Optional[str] = None,
    return_lse: bool = False,
    q_lengths: Lengths = None,
    kv_lengths: Lengths = None,
    windowed_mask: bool = False,
):
    """Exact softmax attention, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q, k, v: ``[B, Hq, Nq, D]``, ``[B, Hkv, Nk, D]``, ``[B, Hkv, Nk, Dv]`` (or 3-D ``[B, N, D]``).
        attn_mask: bool (True = attend, SDPA's polarity) or additive float, broadcastable to
            ``[B, Hq, Nq, Nk]``; with ``windowed_mask=True``, ``[nW, Hq|1, Nq, Nk]`` applied to batch row
            ``b`` as row ``b % nW`` (Swin's shifted windows, never expanded to ``[B, H, N, N]``). PyTorch's
            ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left`` / ``causal_lower_right``) is honoured on
            every backend and device, without building a mask.
        dropout_p: attention dropout in [0, 1], as SDPA's (kept probabilities scaled by ``1 / (1 - p)``). The
            kernels draw it with a counter-based RNG seeded from PyTorch's generator (``torch.manual_seed``
            reproduces a call); the backward regenerates the same mask.
        is_causal: bottom-right aligned when ``Nq != Nk`` (query i sees keys ``j <= i + Nk - Nq``).
        scale: defaults to ``D ** -0.5``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (no K/V copies are made). Size-1 batch and head
            axes broadcast as in SDPA (one kv head serves every query head even without it).
        backend: ``"auto"`` | ``"elsa"`` | ``"reference"`` | ``"sdpa"`` (or ``ELSA_BACKEND``).
        precision: fp32 mode ``"strict"`` | ``"precise"`` | ``"turbo"`` (or ``ELSA_FP32_PRECISION``).
        return_lse: also return the log-sum-exp ``[B, Hq, Nq]`` (fp32; -inf for rows with no key).
        q_lengths, kv_lengths: per-batch valid lengths of padded inputs (zero-copy varlen).

    Returns:
        ``out`` (dtype of ``q``, shape ``[B, Hq, Nq, Dv]``), or ``(out, lse)`` with ``return_lse``.
        Rows with no visible key are zeros. Deliberate differences from SDPA: docs/fidelity.md.
    """
    cast_to = autocast_dtype(q) if _ANY_AUTOCAST() else None
    if cast_to is not None:  # inside torch.autocast: SDPA's rule, the inputs cast and the call run without autocast
        q, k, v, attn_mask = autocast_cast(cast_to, q.device.type, q, k, v, attn_mask)
        with torch.autocast(q.device.type, enabled=False):
            return attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend,
                             precision=precision, return_lse=return_lse, q_lengths=q_lengths, kv_lengths=kv_lengths,
                             windowed_mask=windowed_mask)
    # the direct route of a call seen before; else build_problem + dispatch.decide (+ announce), memoised per
    # signature: see callcache.py
    rkey = None
    if q_lengths is None:
        res = callcache.direct(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                               return_lse, windowed_mask, kv_lengths)
        if type(res) is not callcache.Miss:
            return res
        rkey = res.key
        if rkey is None and kv_lengths is None and torch.compiler.is_compiling():
            res = callcache.traced(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                                   return_lse, windowed_mask)  # validated and decided outside dynamo's tracing
            if res is not None:
                return res
    if rkey is not None:
        key = callcache.signature_of(rkey)
    else:
        key = callcache.signature(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                                  return_lse, q_lengths, kv_lengths, windowed_mask)
    p, d = callcache.prepare(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend,
                             precision=precision, return_lse=return_lse, q_lengths=q_lengths,
                             kv_lengths=kv_lengths, windowed_mask=windowed_mask, key=key,
                             call=lambda *qkv: attention(*(qkv or (q, k, v)), attn_mask, dropout_p, is_causal, scale,
                                                         enable_gqa, backend=backend, precision=precision,
                                                         return_lse=return_lse, windowed_mask=windowed_mask))
    pieces = [_run(piece, d, return_lse) for piece in p.row_pieces()]  # one, but for upper-left CausalBias
    out, lse = pieces[0] if len(pieces) == 1 else _cat_rows(pieces)
    out, lse = p.restore_shape(out, lse)
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if wants_grad and not out.requires_grad and p.empty:
        out = p.restore_shape(p.empty_output())[0]  # SDPA's zeros, joined to the autograd graph as SDPA's are
    if key is not None and rkey is not None:
        callcache.learn(key, rkey, p, d, q, k, v, attn_mask, return_lse)
    return (out, lse) if return_lse else out


def _run(p, d, return_lse: bool):
    """``(out, lse or None)`` of one canonical problem on the decided backend."""
    if d.backend == "elsa":
        return _kernels().attention(
            p.q, p.k, p.v, scale=p.scale, mask=p.mask, is_causal=p.is_causal, q_lengths=p.q_lengths,
            kv_lengths=p.kv_lengths, precision=d.precision, return_lse=return_lse, dropout_p=p.dropout_p,
        )
    if d.backend == "sdpa":
        return sdpa.run(p), None
    return reference_ops.run(p, return_lse=return_lse)


def _cat_rows(pieces):
    """Per-piece results (tuples of tensors over query rows, or None) joined along the row axis (dim 2)."""
    return tuple(None if parts[0] is None else torch.cat(parts, dim=2) for parts in zip(*pieces))


def attention_state(
    q, k, v, attn_mask=None, is_causal=False, scale=None, *, backend: str = "auto",
    precision: Optional[str] = None, q_lengths: Lengths = None, kv_lengths: Lengths = None,
    windowed_mask: bool = False,
) -> monoid.State:
    """Partial attention over the given keys as a monoid state ``(m, S, W)`` (fp32).

    States over disjoint key sets merge exactly with :func:`elsa_surgery.monoid.merge`, and
    :func:`elsa_surgery.monoid.finalize` turns a state into ``(out, lse)``: the building block of
    streaming (Stream-CQSA), split-K and multi-GPU attention. ``is_causal`` keeps its bottom-right
    meaning relative to *these* keys. GQA is implied by the shapes (``Hq % Hkv == 0``).
    """
    p = build_problem(q, k, v, attn_mask, 0.0, is_causal, scale, True,
                      q_lengths=q_lengths, kv_lengths=kv_lengths, windowed_mask=windowed_mask)
    d = dispatch.decide(p.q, p.k, p.v, p.mask, backend=backend, precision=precision, need_lse=True)
    dispatch.announce(d)
    pieces = [_run_state(piece, d) for piece in p.row_pieces()]  # one, but for upper-left CausalBias
    state = monoid.State(*(pieces[0] if len(pieces) == 1 else _cat_rows(pieces)))
    if p.squeeze_head:
        state = monoid.State(state.m.squeeze(1), state.S.squeeze(1), state.W.squeeze(1))
    return state


def _run_state(p, d):
    if d.backend == "elsa":
        return tuple(_kernels().attention_state(
            p.q, p.k, p.v, scale=p.scale, mask=p.mask, is_causal=p.is_causal, q_lengths=p.q_lengths,
            kv_lengths=p.kv_lengths, precision=d.precision,
        ))
    return tuple(reference_ops.run_state(p))


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    backend: str = "auto",
    precision: Optional[str] = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
):
    """Packed variable-length attention, flash-attn's convention.

    ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv, Dv]``; sequence ``b`` is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v.
    Causality is bottom-right per sequence. Returns ``out [total_q, Hq, Dv]`` and, with
    ``return_lse``, ``lse [Hq, total_q]`` (fp32; without dropout's effect, as :func:`attention`'s).

    ``dropout_p`` (in [0, 1]) is SDPA's attention dropout, applied within each sequence. On the kernels the mask is
    drawn as :func:`attention`'s, from a seed taken from PyTorch's generator (``torch.manual_seed`` reproduces a
    call; the backward regenerates the mask), and sequence ``b``'s mask is the one the padded dense call
    ``[B, Hq, max_seqlen_q, max_seqlen_k]`` draws for batch row ``b``: it depends on the seed, ``b`` and the two
    maxima, not on the other sequences of the pack. The reference backend draws its own masks (the same
    distribution, other draws), as the dense reference does.
    """
    cast_to = autocast_dtype(q) if _ANY_AUTOCAST() else None
    if cast_to is not None:  # inside torch.autocast: as attention
        q, k, v = autocast_cast(cast_to, q.device.type, q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    is_causal=is_causal, scale=scale, backend=backend, precision=precision,
                                    return_lse=return_lse, dropout_p=dropout_p)
    res = callcache.direct_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                  backend, precision, return_lse, dropout_p)  # a call seen before: callcache.py
    if type(res) is not callcache.Miss:
        return res
    vp, d = callcache.prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     is_causal=is_causal, scale=scale, backend=backend, precision=precision,
                                     return_lse=return_lse, dropout_p=dropout_p)
    if d.backend == "elsa":
        out, lse = _kernels().attention_varlen(
            vp.q, vp.k, vp.v, vp.cu_seqlens_q, vp.cu_seqlens_k, vp.max_seqlen_q, vp.max_seqlen_k,
            scale=vp.scale, is_causal=vp.is_causal, precision=d.precision, return_lse=return_lse,
            dropout_p=vp.dropout_p,
        )
    else:
        out, lse = reference_ops.run_varlen(vp, return_lse=return_lse)
    callcache.learn_varlen(res.key, vp, d, q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse)
    return (out, lse) if return_lse else out
