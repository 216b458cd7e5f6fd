"""The interface the framework calls (re-exported by ``elsa_surgery.kernels``) (inputs already validated and canonical, see
``elsa_surgery/semantics.py``):

* :func:`unsupported_reason` — ``None`` when the kernels can run a case, else a sentence saying why not.
* :func:`attention` — ``(out, lse or None)``.
* :func:`attention_state` — ``(m, S, W)`` fp32, mergeable with ``elsa_surgery.monoid.merge``.
* :func:`attention_varlen` — packed sequences, ``(out, lse [Hq, total_q] or None)``.

Files: ``scan.py`` the Triton kernels, ``launch.py`` the launchers, ``occupancy.py`` tile table and
partition model (ELSA-Lean knob ``ELSA_LEAN_ETA``), ``replay.py`` launch plans (a call's launches recorded once per
signature and replayed), ``ops.py`` the ``torch.library`` custom ops (under torch.compile, a call that wants no
gradient is traced to the ops without an autograd formula: ``ops.attention_inference_op``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from . import knobs, occupancy

log = logging.getLogger("elsa_surgery.kernels")

MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 8, 256, 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

try:
    import triton  # noqa: F401

    _TRITON_ERROR: Optional[str] = None
except ImportError as exc:  # pragma: no cover - triton is a dependency on Linux
    _TRITON_ERROR = f"triton is not installed ({exc})"


def _dim_reason(name: str, d: int) -> Optional[str]:
    if d < MIN_HEAD_DIM or d > MAX_HEAD_DIM or d % HEAD_DIM_STEP:
        return (f"{name}={d}: the kernels take head dims from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} "
                f"in multiples of {HEAD_DIM_STEP}")
    return None


def unsupported_reason(q, k, v, mask, *, varlen: bool = False) -> Optional[str]:
    """Why the kernels cannot run this (canonical) case, or None when they can."""
    if _TRITON_ERROR is not None:
        return _TRITON_ERROR
    dev = q.device
    if dev.type != "cuda" and not (dev.type == "cpu" and occupancy.interpreting()):
        return f"{dev.type} tensors: the kernels need CUDA (or TRITON_INTERPRET=1 for CPU tensors)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"q dtype {q.dtype}: the kernels take float16, bfloat16 or float32"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    for name, d in (("D", q.shape[-1]), ("Dv", v.shape[-1])):
        why = _dim_reason(name, d)
        if why:
            return why
    if dev.type == "cuda" and q.dtype == torch.bfloat16 and occupancy.capability(occupancy._cuda_index(dev))[0] < 8:
        return "bfloat16 needs a GPU of compute capability 8.0 or newer"
    if mask is not None:
        if mask.dim() != 4:
            return f"mask must be the canonical 4-D view, got {mask.dim()}-D"
        if not (mask.dtype == torch.bool or mask.dtype in SUPPORTED_DTYPES):
            return f"mask dtype {mask.dtype}: bool or float16/bfloat16/float32 additive masks"
        if mask.device != dev:
            return "mask is on another device than q"
    return None


from . import launch, ops  # noqa: E402,F401  (torch only; triton is imported by launch on the first launch)
from .launch import default_precision  # noqa: E402,F401  (what precision=None means, stated once)
from . import training  # noqa: E402  (autograd of the ops, dropout; issue 25)


def _ops():
    return ops


def _eager() -> bool:
    """Outside torch.compile tracing, call the launchers directly (calls that want a gradient: through
    ``training.EagerAttention``, the ops' autograd formula without their dispatch): the custom-op dispatch costs tens
    of microseconds per call, which is the whole kernel time at N=1K. Under tracing, the ops are used."""
    return not torch.compiler.is_compiling()


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _ForwardOnly(torch.autograd.Function):
    """Runs a kernel call so that its outputs join the autograd graph, and refuses backward loudly
    (``attention_state`` only: ``attention`` and ``attention_varlen`` have a backward, training.py).

    Without it an eager call under grad mode would return outputs silently detached from q/k/v."""

    @staticmethod
    def forward(ctx, call, *inputs):
        outs = tuple(t for t in call() if t is not None)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "elsa_surgery: attention_state on the ELSA kernels has no backward. Use attention() (which has one), "
            "or backend='reference' where gradients of the state are needed")


def _run_eager(call, *tensors):
    """``call()`` directly, or through :class:`_ForwardOnly` when autograd would want its gradient."""
    if not _wants_grad(*tensors):
        return tuple(call())
    empty = []

    def tensors_only():
        res = tuple(call())
        empty[:] = [r is None for r in res]
        return res

    outs = _ForwardOnly.apply(tensors_only, *[t for t in tensors if t is not None])
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    return tuple(None if e else outs.pop(0) for e in empty)


def attention(q, k, v, *, scale, mask=None, is_causal=False, q_lengths=None, kv_lengths=None, precision=None,
              return_lse=False, dropout_p=0.0):
    """Calls that want a gradient, or dropout, go through the custom ops (their autograd: training.py)."""
    if dropout_p > 0:
        out, lse = training.attention_dropout_op(q, k, v, mask, q_lengths, kv_lengths, float(scale),
                                                 bool(is_causal), precision or "", float(dropout_p),
                                                 training.draw_seed(q.device))
        return out, (lse if return_lse else None)
    if _eager() and not _wants_grad(q, k, v, mask):
        return tuple(launch.attention(
            q, k, v, scale=float(scale), mask=mask, is_causal=bool(is_causal), q_lengths=q_lengths,
            kv_lengths=kv_lengths, precision=precision or None, return_lse=return_lse))
    if _eager():  # the ops' autograd formula without their dispatch
        out, lse = training.EagerAttention.apply(q, k, v, mask, q_lengths, kv_lengths, float(scale), bool(is_causal),
                                                 precision or "")
        return out, (lse if return_lse else None)
    args = (q, k, v, mask, q_lengths, kv_lengths, float(scale), bool(is_causal), precision or "")
    if _wants_grad(q, k, v, mask):
        out, lse = _ops().attention_op(*args)
    else:
        out, lse = inference_op()(*args, bool(return_lse))
    return out, (lse if return_lse else None)


def inference_op():
    """The op a call that wants no gradient traces to under torch.compile (``ELSA_COMPILE_OP``): the inline op (for
    ``inline`` and ``auto``: the inline op's body sends ``auto``'s long calls to the opaque op, ``launch.not_inline``),
    or the opaque one where asked or where this torch has no ``triton_op`` (logged once)."""
    ops = _ops()
    if knobs.get(knobs.COMPILE_OP) == "opaque" or occupancy.interpreting():
        return ops.attention_inference_op  # (wrap_triton cannot trace the interpreter's kernels)
    if ops.attention_inline_op is None:
        if not _INLINE_LOGGED:
            _INLINE_LOGGED.append(True)
            log.warning("elsa_surgery: compiled calls use the opaque ELSA op: %s", ops.INLINE_UNAVAILABLE)
        return ops.attention_inference_op
    _inline_ptxas()
    return ops.attention_inline_op


@torch.compiler.assume_constant_result
def _inline_ptxas() -> bool:
    """Matches Triton's ptxas to Inductor's (``internals.match_inductor_ptxas``) for a call traced to the inline op,
    as plain Python while torch.compile traces it, warm or cold: on a warm start (AOTAutograd's cache hit) the op's
    body is not traced, so no launch of ours ran before Inductor compiled the graph's ELSA kernels again in this
    process, with Triton's own ptxas, whose version is in Triton's cache key: the kernels compiled again (session 54,
    H200, the warm-start GPU test). True (a constant of the trace)."""
    from . import internals

    internals.match_inductor_ptxas()
    return True


_INLINE_LOGGED = []


def attention_state(q, k, v, *, scale, mask=None, is_causal=False, q_lengths=None, kv_lengths=None, precision=None):
    if _eager():
        return _run_eager(lambda: launch.attention_state(
            q, k, v, scale=float(scale), mask=mask, is_causal=bool(is_causal), q_lengths=q_lengths,
            kv_lengths=kv_lengths, precision=precision or None), q, k, v, mask)
    m, S, W = _ops().attention_state_op(q, k, v, mask, q_lengths, kv_lengths, float(scale), bool(is_causal),
                                        precision or "")
    return m, S, W


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal=False,
                     precision=None, return_lse=False, dropout_p=0.0):
    """As :func:`attention`: gradients and dropout through the custom ops."""
    if dropout_p > 0:
        out, lse = training.attention_varlen_dropout_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(scale),
            bool(is_causal), precision or "", float(dropout_p), training.draw_seed(q.device))
        return out, (lse if return_lse else None)
    if _eager() and not _wants_grad(q, k, v):
        return tuple(launch.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale=float(scale),
            is_causal=bool(is_causal), precision=precision or None, return_lse=return_lse))
    if _eager():
        out, lse = training.EagerAttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                       int(max_seqlen_k), float(scale), bool(is_causal),
                                                       precision or "")
        return out, (lse if return_lse else None)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(scale),
            bool(is_causal), precision or "")
    if _wants_grad(q, k, v):
        out, lse = _ops().attention_varlen_op(*args)
    else:
        out, lse = _ops().attention_varlen_inference_op(*args, bool(return_lse))
    return out, (lse if return_lse else None)
