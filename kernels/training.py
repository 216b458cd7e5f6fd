"""Autograd for the kernels: ``torch.library`` ops for attention with dropout and for the backward, and the
autograd formulas of the forward ops (``ops.attention_op``, ``ops.attention_varlen_op``, and
``attention_dropout_op`` and ``attention_varlen_dropout_op`` here), registered with ``torch.library.register_autograd``.

One autograd formula serves eager calls and ``torch.compile`` (which sees each op as one node with a fake
implementation, so a training step compiles with ``fullgraph=True``); eager calls without dropout run it through
:class:`EagerAttention` / :class:`EagerAttentionVarlen`, which skip the ops' dispatch (host time). The backward op is
itself registered with a formula that refuses a second-order backward with a clear error (an eager backward that
records a graph, ``create_graph=True``, goes through it).

Dropout: :func:`draw_seed` takes an int64 seed from PyTorch's generator of the tensors' device (so
``torch.manual_seed`` reproduces a run; no host sync); the forward op and the backward op regenerate the same
keep mask from it (backward.py).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from . import backward_launch as bl
from . import launch, ops

NS = ops.NS
if __name__ != "elsa_surgery.kernels.training":  # never register the ops twice (see kernels/__init__.py)
    raise ImportError(f"the ELSA training ops live in elsa_surgery.kernels.training, not {__name__}")

SEED_HIGH = 2 ** 62


def draw_seed(device: torch.device) -> Tensor:
    """A dropout seed ``[1]`` int64 on ``device``, drawn from PyTorch's (device) default generator."""
    return torch.randint(0, SEED_HIGH, (1,), device=device, dtype=torch.int64)


def _call_args(q_lengths, kv_lengths, cu_q, cu_k, max_q, max_k):
    varlen = cu_q is not None
    dims = (cu_q.shape[0] - 1, int(max_q), int(max_k)) if varlen else None
    return dict(q_lengths=q_lengths, kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k, varlen_dims=dims)


def _dropout_forward(q, k, v, mask, q_lengths, kv_lengths, scale: float, is_causal: bool, precision: str,
                     dropout_p: float, seed: Tensor) -> Tuple[Tensor, Tensor]:
    """Dense attention with SDPA's attention dropout: the scan gives ``lse``, a second pass over the key blocks
    gives ``(softmax * keep / (1 - p)) @ v`` (``backward.row_pass``)."""
    out, lse = ops.dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision)
    bl.dropout_output(q, k, v, out, lse, scale=scale, mask=mask, is_causal=is_causal, precision=precision or None,
                      dropout_p=dropout_p, seed=seed, **_call_args(q_lengths, kv_lengths, None, None, 0, 0))
    return out, lse


attention_dropout_op = ops.define("attention_dropout", ops.DENSE_SCHEMA[:-1] + ", float dropout_p, Tensor seed) -> "
                                  "(Tensor, Tensor)", _dropout_forward, ops.dense_fake)


def _varlen_dropout_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, is_causal: bool,
                            precision: str, dropout_p: float, seed: Tensor) -> Tuple[Tensor, Tensor]:
    """Packed varlen attention with SDPA's attention dropout, as :func:`_dropout_forward` (the keep mask of
    sequence ``b`` is the one the padded dense call ``[B, Hq, max_q, max_k]`` draws for batch row ``b``)."""
    out, lse = ops.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision)
    bl.dropout_output(q, k, v, out, lse, scale=scale, mask=None, is_causal=is_causal, precision=precision or None,
                      dropout_p=dropout_p, seed=seed, **_call_args(None, None, cu_q, cu_k, max_q, max_k))
    return out, lse


def _varlen_dropout_fake(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision, dropout_p, seed):
    return ops.varlen_fake(q, v)


attention_varlen_dropout_op = ops.define(
    "attention_varlen_dropout", ops.VARLEN_SCHEMA[:-1] + ", float dropout_p, Tensor seed) -> (Tensor, Tensor)",
    _varlen_dropout_forward, _varlen_dropout_fake)


def _backward(grad_out, grad_lse, q, k, v, out, lse, mask, q_lengths, kv_lengths, cu_q, cu_k, max_q: int, max_k: int,
              scale: float, is_causal: bool, precision: str, dropout_p: float, seed, mask_grad: bool, key_memo=None):
    """``(dq, dk, dv, dmask or None)``: the launcher (``key_memo``: ``backward_launch.attention_backward``)."""
    return bl.attention_backward(
        grad_out, q, k, v, out, lse, scale=scale, mask=mask, is_causal=is_causal, precision=precision or None,
        dropout_p=dropout_p, seed=seed, mask_grad=mask_grad, dlse=grad_lse, key_memo=key_memo,
        **_call_args(q_lengths, kv_lengths, cu_q, cu_k, max_q, max_k))


def backward_grads(grad_out, grad_lse, q, k, v, out, lse, mask, q_lengths, kv_lengths, cu_q, cu_k, max_q: int,
                   max_k: int, scale: float, is_causal: bool, precision: str, dropout_p: float, seed, mask_grad: bool):
    """:data:`attention_backward_op`'s kernel (eager calls' backward calls :func:`_backward` itself: :func:`_grads`)."""
    dq, dk, dv, dmask = _backward(grad_out, grad_lse, q, k, v, out, lse, mask, q_lengths, kv_lengths, cu_q, cu_k,
                                  max_q, max_k, scale, is_causal, precision, dropout_p, seed, mask_grad)
    return dq, dk, dv, (dmask if dmask is not None else q.new_empty(0))


def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, mask, q_lengths, kv_lengths, cu_q, cu_k, max_q, max_k, scale,
                   is_causal, precision, dropout_p, seed, mask_grad):
    dmask = mask.new_empty(mask.shape) if mask_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask  # contiguous, as the real ones


# (dq, dk, dv, dmask); dmask is empty unless mask_grad. Dense or packed varlen (cu_q)
attention_backward_op = ops.define(
    "attention_backward", "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor? mask, Tensor? q_lengths, Tensor? kv_lengths, Tensor? cu_q, Tensor? cu_k, SymInt max_q, SymInt max_k, "
    "float scale, bool is_causal, str precision, float dropout_p, Tensor? seed, bool mask_grad) -> "
    "(Tensor, Tensor, Tensor, Tensor)", backward_grads, _backward_fake)


def _no_second_order(ctx, *grads):
    raise RuntimeError("elsa_surgery: the ELSA attention backward is not differentiable (no second-order "
                       "gradients: double backward, create_graph=True through attention). Use backend='reference' "
                       "for higher-order gradients")


torch.library.register_autograd(f"{NS}::attention_backward", _no_second_order,
                                setup_context=lambda ctx, inputs, output: None)


def _scalars(max_q, max_k, scale, is_causal, precision, dropout_p, mask_needs_grad) -> dict:
    """What the backward (:func:`_grads`) reads of the forward's scalars."""
    return dict(max_q=max_q, max_k=max_k, scale=scale, is_causal=is_causal, precision=precision, dropout_p=dropout_p,
                mask_needs_grad=mask_needs_grad)


def _save(ctx, q, k, v, mask, q_lengths, kv_lengths, cu_q, cu_k, out, lse, seed, scalars: dict):
    """The forward's tensors and :func:`_scalars` for :func:`_grads` (``scalars`` is read, never written)."""
    ctx.save_for_backward(q, k, v, mask, q_lengths, kv_lengths, cu_q, cu_k, out, lse, seed)
    ctx.scalars = scalars


def _grads(ctx, grad_out, grad_lse, direct: bool = False, key_memo=None):
    """``(dq, dk, dv, dmask)`` from the saved forward (mask grad only when the mask wants one). ``direct`` (eager
    calls, :class:`EagerAttention`): the launcher is called without the backward op's dispatch (and with
    ``key_memo``, :class:`RoutedAttention`'s), unless the backward itself records a graph (``create_graph=True``),
    where the op's formula refuses a second order."""
    q, k, v, mask, q_lengths, kv_lengths, cu_q, cu_k, out, lse, seed = ctx.saved_tensors
    s = ctx.scalars
    mask_grad = bool(mask is not None and mask.dtype != torch.bool and s["mask_needs_grad"])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    args = (grad_out, grad_lse, q, k, v, out, lse, mask, q_lengths, kv_lengths, cu_q, cu_k, s["max_q"], s["max_k"],
            s["scale"], s["is_causal"], s["precision"], s["dropout_p"], seed, mask_grad)
    if direct and not torch.is_grad_enabled():
        dq, dk, dv, dmask = _backward(*args, key_memo=key_memo)
    else:
        dq, dk, dv, dmask = attention_backward_op(*args)
    return dq, dk, dv, (dmask if mask_grad else None)


def _setup_dense(ctx, inputs, output):
    q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision = inputs[:9]
    dropout_p, seed = inputs[9:] if len(inputs) > 9 else (0.0, None)
    _save(ctx, q, k, v, mask, q_lengths, kv_lengths, None, None, output[0], output[1], seed,
          _scalars(0, 0, scale, is_causal, precision, dropout_p, mask is not None and mask.requires_grad))


def _backward_dense(ctx, grad_out, grad_lse, direct: bool = False):
    dq, dk, dv, dmask = _grads(ctx, grad_out, grad_lse, direct)
    extra = (None, None) if len(ctx.needs_input_grad) > 9 else ()
    return (dq, dk, dv, dmask, None, None, None, None, None, *extra)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision = inputs[:10]
    dropout_p, seed = inputs[10:] if len(inputs) > 10 else (0.0, None)
    _save(ctx, q, k, v, None, None, None, cu_q, cu_k, output[0], output[1], seed,
          _scalars(max_q, max_k, scale, is_causal, precision, dropout_p, False))


def _backward_varlen(ctx, grad_out, grad_lse, direct: bool = False):
    dq, dk, dv, _ = _grads(ctx, grad_out, grad_lse, direct)
    return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)


for _op, _setup, _bwd in ((ops.attention_op, _setup_dense, _backward_dense),
                          (attention_dropout_op, _setup_dense, _backward_dense),
                          (ops.attention_varlen_op, _setup_varlen, _backward_varlen),
                          (attention_varlen_dropout_op, _setup_varlen, _backward_varlen)):
    torch.library.register_autograd(_op, _bwd, setup_context=_setup)


class EagerAttention(torch.autograd.Function):
    """Eager calls of ``ops.attention_op`` that want a gradient, without the custom ops' dispatch: the op's body
    (``ops.dense_forward``), the same saved tensors and the same backward formula (:func:`_setup_dense`,
    :func:`_backward_dense`), with the backward's launcher called directly. The ops' autograd wrapper and dispatch
    cost about 0.2 ms of host time per forward + backward on a CPU host (session 31), more than the kernels of a
    small call; ``torch.compile`` traces the ops instead (kernels/interface.py). ``forward`` takes ``ctx`` itself
    (no ``setup_context``): with a separate ``setup_context``, ``Function.apply`` binds the arguments through
    ``inspect.signature`` on every call (torch 2.11: ~10 % of a Swin-T window call's profiled host time)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
        output = ops.dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as through the op
        _setup_dense(ctx, (q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision), output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward_dense(ctx, grad_out, grad_lse, direct=True)


class Route:
    """What :class:`RoutedAttention` needs of a direct route's call (``elsa_surgery/callcache.py``): the launch plan
    that the signature's forward recorded (``launch.attention_plan(..., return_lse=True)``), the scalars the full
    path saves for the backward (:func:`_setup_dense`'s, made once: ``mask_needs_grad`` is part of the route's key),
    read-only, and the memo of its backward's plan keys."""
    __slots__ = ("plan", "scalars", "key_memo")

    def __init__(self, plan, scale: float, is_causal: bool, precision: str, mask_needs_grad: bool):
        self.plan = plan
        self.scalars = _scalars(0, 0, float(scale), bool(is_causal), precision or "", 0.0, bool(mask_needs_grad))
        self.key_memo = {}


class RoutedAttention(torch.autograd.Function):
    """:class:`EagerAttention` for a training call seen before (a direct route): the forward replays the recorded
    launch plan (no validation, dispatch or plan key: the route's key held all of it), the same tensors are saved,
    and the backward finds its plan key in the route's memo (``key_memo``: built once per output-gradient layout).
    Inputs: ``q, k, v``, the canonical mask (or None), ``kv_lengths`` (or None), the :class:`Route`."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kv_lengths, route):
        out, lse, _ = route.plan.replay({"q": q, "k": k, "v": v, "kv_lengths": kv_lengths, "mask": mask})
        ctx.set_materialize_grads(False)
        _save(ctx, q, k, v, mask, None, kv_lengths, None, None, out, lse, None, route.scalars)
        ctx.key_memo = route.key_memo
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        dq, dk, dv, dmask = _grads(ctx, grad_out, grad_lse, True, ctx.key_memo)
        return dq, dk, dv, dmask, None, None


class EagerAttentionVarlen(torch.autograd.Function):
    """:class:`EagerAttention` for ``ops.attention_varlen_op`` (packed sequences)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision):
        output = ops.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision)
        ctx.set_materialize_grads(False)
        _setup_varlen(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, precision), output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward_varlen(ctx, grad_out, grad_lse, direct=True)


def dropout_keep_mask(q, k, v, seed, *, scale, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, precision=None, dropout_p):
    """Debug hook (tests, small N): the keep mask ``[B, Hq, Nq, Nk]`` (bool) that :func:`attention_dropout_op`
    draws from ``seed`` for these canonical inputs; with ``cu_seqlens_q``/``cu_seqlens_k`` (packed ``[total, H, D]``
    inputs) the mask ``[B, Hq, max_seqlen_q, max_seqlen_k]`` of :func:`attention_varlen_dropout_op`, sequence
    ``b``'s at ``[b, :, :len_q, :len_k]``."""
    if cu_seqlens_q is not None:
        _, lse = launch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                         scale=scale, is_causal=is_causal, precision=precision, return_lse=True)
    else:
        _, lse = launch.attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                                  kv_lengths=kv_lengths, precision=precision, return_lse=True)
    return bl.dropout_keep_mask(q, k, v, lse, scale=scale, mask=mask, is_causal=is_causal, precision=precision,
                                dropout_p=dropout_p, seed=seed, **_call_args(q_lengths, kv_lengths, cu_seqlens_q,
                                                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k))
