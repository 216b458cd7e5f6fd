"""Validation and dispatch of a public call, memoised per signature (the eager host cost of small calls).

Before a kernel runs, an eager :func:`elsa_surgery.attention` call validates its arguments
(:func:`elsa_surgery.semantics.build_problem`) and picks its backend (:func:`elsa_surgery.dispatch.decide`):
13-17 µs of Python per call on an H100 host, about what a 197-token ViT attention kernel takes on the GPU.
Neither reads a tensor's values, only its signature: the type, shape, dtype and device of q, k, v and the mask,
the scalar arguments (``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``, ``windowed_mask``, ``backend``,
``precision``, ``return_lse``) and the environment variables the dispatch reads (``ELSA_BACKEND``,
``ELSA_FP32_PRECISION``, ``TRITON_INTERPRET``). :func:`prepare` keys on exactly those: the first call with a key
runs both and keeps the outcome; later calls with the key rebuild the problem around their own tensors (the same
views ``build_problem`` makes: 3-D inputs get their head axis, size-1 batch and head axes are broadcast, the
mask gets its canonical 4-D view) and reuse the decision, which is still announced (recorded and logged) on every
call. Under ``auto`` the first eager CUDA call of a signature may also race the kernels against PyTorch's SDPA
(:mod:`elsa_surgery.autoselect`); the memo keeps the winner.

Not memoised, so validated in full on every call: calls that raise (errors are never kept), calls with
``q_lengths`` / ``kv_lengths`` (their values are checked), a tensor ``scale``, arguments of other types than plain
tensors, bools, numbers and strings (tensor subclasses, NumPy scalars), and calls traced by ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import autoselect, dispatch
from .kernels import internals
from .semantics import AttentionProblem, broadcast_batch_and_heads, build_problem, canonical_mask

MAX_ENTRIES = 1024  # signatures kept (the oldest dropped first)

_ENV_NAMES = (dispatch.ENV_BACKEND, dispatch.ENV_PRECISION, "TRITON_INTERPRET")
# the raw values, from the environment's store (CPython's encoded one where checked: kernels/internals.py); the knobs'
# values are validated by the dispatch (kernels/knobs.py)
_RAW = internals.ENVIRON
_ENV_KEYS = tuple(internals.ENCODE(n) for n in _ENV_NAMES)

_entries: dict = {}
STATS = {"hits": 0, "misses": 0, "bypassed": 0}

_PLAIN = (bool, int, float, str, type(None))


def clear() -> None:
    _entries.clear()


def _tensor_sig(t):
    if type(t) is not torch.Tensor or t.is_nested:  # noqa: E721 - subclasses, nested and non-tensors: full path
        return None
    return t.shape, t.dtype, t.device


def _key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
         windowed_mask) -> Optional[tuple]:
    """The signature :func:`prepare` memoises on, or None for a call it validates in full."""
    sq, sk, sv = _tensor_sig(q), _tensor_sig(k), _tensor_sig(v)
    if sq is None or sk is None or sv is None:
        return None
    sm = None
    if attn_mask is not None:
        sm = _tensor_sig(attn_mask)
        if sm is None:
            return None
    scalars = (dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse, windowed_mask)
    for s in scalars:
        if type(s) not in _PLAIN:
            return None
    # the scalars' types too: True and 1 hash alike but are not the same argument
    return (sq, sk, sv, sm, scalars, tuple(map(type, scalars)), tuple(_RAW.get(e) for e in _ENV_KEYS))


def prepare(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            backend="auto", precision=None, return_lse=False, q_lengths=None, kv_lengths=None,
            windowed_mask=False) -> Tuple[AttentionProblem, dispatch.Decision]:
    """``(build_problem(...), dispatch.decide(...))`` of an :func:`elsa_surgery.attention` call, the decision
    announced; memoised per signature (module docstring)."""
    if torch.compiler.is_compiling():
        # traced once per graph: nothing here is read or written (dynamo would guard on the memo and on STATS)
        p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                    precision, return_lse, q_lengths, kv_lengths, windowed_mask)
        dispatch.announce(d)
        return p, d
    key = None
    if q_lengths is None and kv_lengths is None:
        key = _key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
                   windowed_mask)
    if key is None:
        STATS["bypassed"] += 1
        p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                    precision, return_lse, q_lengths, kv_lengths, windowed_mask)
    else:
        hit = _entries.get(key)
        if hit is None:
            STATS["misses"] += 1
            p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                        precision, return_lse, None, None, windowed_mask)
            d = autoselect.choose(p, d, lambda: _run_kernels(p, d), backend=backend, precision=precision,
                                  return_lse=return_lse)
            if len(_entries) >= MAX_ENTRIES:
                del _entries[next(iter(_entries))]
            _entries[key] = (p.squeeze_head, p.scale, p.is_causal, p.dropout_p, d)
        else:
            STATS["hits"] += 1
            squeeze, scale_, causal, dropout, d = hit
            if squeeze:
                q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            q, k, v = broadcast_batch_and_heads(q, k, v, enable_gqa)
            mask = None
            if attn_mask is not None:
                mask = canonical_mask(attn_mask, batch=q.shape[0], heads_q=q.shape[1], n_q=q.shape[2],
                                      n_k=k.shape[2], windowed=windowed_mask, device=q.device)
            p = AttentionProblem(q, k, v, scale_, mask, causal, None, None, squeeze, dropout)
    dispatch.announce(d)
    return p, d


def _run_kernels(p: AttentionProblem, d: dispatch.Decision):
    """The ELSA kernels on a problem (autoselect's race)."""
    return dispatch.kernels_module().attention(p.q, p.k, p.v, scale=p.scale, mask=p.mask, is_causal=p.is_causal,
                                               precision=d.precision, return_lse=False)


def _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                         return_lse, q_lengths, kv_lengths, windowed_mask):
    p = build_problem(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      q_lengths=q_lengths, kv_lengths=kv_lengths, windowed_mask=windowed_mask)
    d = dispatch.decide(p.q, p.k, p.v, p.mask, backend=backend, precision=precision, need_lse=return_lse,
                        dropout_p=p.dropout_p)
    return p, d
