"""The reference backend as ``torch.library`` custom ops (namespace ``elsa_surgery``), for torch.compile.

The reference loops over query and key chunks in Python, and the number of chunks depends on the sequence
lengths: traced by dynamo, every new length would specialise a new graph. Under torch.compile the API calls
these ops instead, which the compiler sees as opaque calls whose output shapes come from the fake
implementations (one graph for every length). Eager calls run :mod:`elsa_surgery.reference` directly, as
before (see :func:`run`, :func:`run_state`, :func:`run_varlen`).

The ops are differentiable: their backward is itself an opaque op (AOTAutograd traces no chunk loop) that
recomputes the forward state and runs the reference's own backward scan
(:func:`elsa_surgery.reference.run_state_backward`). Dropout takes an explicit ``seed`` (an int64 tensor drawn
with ``torch.randint`` by the caller, a traced random op): forward and backward seed a fresh generator with it
and so draw the same keep-masks. Gradients reach q, k, v and an additive (floating) mask.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import monoid, reference
from .semantics import AttentionProblem, VarlenProblem

NS = "elsa_surgery"
if __name__ != "elsa_surgery.reference_ops":  # registering the ops a second time would replace the first ones
    raise ImportError(f"the reference custom ops live in elsa_surgery.reference_ops, not {__name__}")


def _problem(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p) -> AttentionProblem:
    """The problem the API built, from the op's arguments (``mask`` already canonical ``[P, Hq|1, Nq, Nk]``)."""
    return AttentionProblem(q=q, k=k, v=v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, dropout_p=dropout_p)


def _seed(seed: Optional[Tensor]) -> Optional[int]:
    return None if seed is None else int(seed)


def _rows_shape(q: Tensor) -> tuple:
    return q.shape[0], q.shape[1], q.shape[2]


@torch.library.custom_op(f"{NS}::reference_attention", mutates_args=())
def reference_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                           kv_lengths: Optional[Tensor], scale: float, is_causal: bool, dropout_p: float,
                           seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`elsa_surgery.reference.run` (dropout masks drawn from ``seed``)."""
    p = _problem(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p)
    out, lse = reference.run(p, return_lse=True, seed=_seed(seed))
    return out, lse


@reference_attention_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p, seed):
    out = q.new_empty((*_rows_shape(q), v.shape[3]))
    return out, q.new_empty(_rows_shape(q), dtype=reference._acc_dtype(q.dtype))


@torch.library.custom_op(f"{NS}::reference_attention_state", mutates_args=())
def reference_attention_state_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                                 q_lengths: Optional[Tensor], kv_lengths: Optional[Tensor], scale: float,
                                 is_causal: bool, dropout_p: float,
                                 seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """The state ``(m, S, W)`` of :func:`elsa_surgery.reference.run_state` (dropout masks drawn from ``seed``)."""
    p = _problem(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p)
    m, S, W = reference.run_state(p, seed=_seed(seed))
    return m, S, W


@reference_attention_state_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p, seed):
    acc = dict(dtype=reference._acc_dtype(q.dtype))
    rows = _rows_shape(q)
    return q.new_empty(rows, **acc), q.new_empty(rows, **acc), q.new_empty((*rows, v.shape[3]), **acc)


@torch.library.custom_op(f"{NS}::reference_attention_backward", mutates_args=())
def reference_attention_backward_op(grads: List[Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor,
                                    mask: Optional[Tensor], q_lengths: Optional[Tensor],
                                    kv_lengths: Optional[Tensor], scale: float, is_causal: bool, dropout_p: float,
                                    seed: Optional[Tensor], of_state: bool,
                                    mask_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmask)`` of either forward op: ``grads`` are the gradients of its outputs (None = zero),
    ``(m, S, W)``'s with ``of_state``, else ``(out, lse)``'s. ``dmask`` is empty unless ``mask_grad``."""
    p = _problem(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p)
    s = _seed(seed)
    if of_state:
        with torch.no_grad():
            state = reference.run_state(p, s)
            zero = [torch.zeros_like(t) if g is None else g for t, g in zip(state, grads)]
            dq, dk, dv, dmask = reference.run_state_backward(p, state, monoid.State(*zero), s, mask_grad)
    else:
        dq, dk, dv, dmask = reference.run_backward(p, grads[0], grads[1], s, mask_grad)
    return dq, dk, dv, q.new_empty(0) if dmask is None else dmask


@reference_attention_backward_op.register_fake
def _(grads, q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p, seed, of_state, mask_grad):
    dmask = mask.new_empty(mask.shape) if mask_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


def _save_inputs(ctx, inputs, output):
    q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, mask, q_lengths, kv_lengths, seed)
    ctx.scalars = (scale, is_causal, dropout_p)


def _backward(of_state: bool):
    def backward(ctx, *grads):
        q, k, v, mask, q_lengths, kv_lengths, seed = ctx.saved_tensors
        scale, is_causal, dropout_p = ctx.scalars
        mask_grad = bool(ctx.needs_input_grad[3])  # only a floating mask can require grad
        dq, dk, dv, dmask = reference_attention_backward_op(
            list(grads), q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, dropout_p, seed, of_state, mask_grad)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dmask if mask_grad else None, None, None, None, None, None, None)

    return backward


reference_attention_op.register_autograd(_backward(of_state=False), setup_context=_save_inputs)
reference_attention_state_op.register_autograd(_backward(of_state=True), setup_context=_save_inputs)


@torch.library.custom_op(f"{NS}::reference_attention_varlen", mutates_args=())
def reference_attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                  scale: float, is_causal: bool, dropout_p: float,
                                  seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`elsa_surgery.reference.run_varlen` (its ``.tolist()`` happens inside the op;
    dropout masks drawn from ``seed``)."""
    vp = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p)
    out, lse = reference.run_varlen(vp, True, seed=_seed(seed))
    return out, lse


@reference_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed):
    total, Hq, _ = q.shape
    return q.new_empty((total, Hq, v.shape[2])), q.new_empty((Hq, total), dtype=reference._acc_dtype(q.dtype))


@torch.library.custom_op(f"{NS}::reference_attention_varlen_backward", mutates_args=())
def reference_attention_varlen_backward_op(grad_out: Optional[Tensor], grad_lse: Optional[Tensor], q: Tensor,
                                           k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                           scale: float, is_causal: bool, dropout_p: float,
                                           seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    vp = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p)
    dq, dk, dv = reference.run_varlen_backward(vp, grad_out, grad_lse, _seed(seed))
    return dq, dk, dv


@reference_attention_varlen_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p) -> VarlenProblem:
    # the max lengths are not read by the reference
    return VarlenProblem(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=0,
                         max_seqlen_k=0, scale=scale, is_causal=is_causal, dropout_p=dropout_p)


def _save_varlen_inputs(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, seed)
    ctx.scalars = (scale, is_causal, dropout_p)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, seed = ctx.saved_tensors
    dq, dk, dv = reference_attention_varlen_backward_op(grad_out, grad_lse, q, k, v, cu_q, cu_k, *ctx.scalars, seed)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 6


reference_attention_varlen_op.register_autograd(_varlen_backward, setup_context=_save_varlen_inputs)


# --------------------------------------------------------------------------------------------------
# what the API calls: the reference directly in eager, the ops while torch.compile traces
# --------------------------------------------------------------------------------------------------

def dropout_seed() -> Tensor:
    """The seed of one call's dropout masks: an int64 0-dim CPU tensor drawn from the global generator (under
    torch.compile a random op of the graph; the backward reads the same value)."""
    return torch.randint(0, torch.iinfo(torch.int64).max, (), dtype=torch.int64)


def _op_args(p: AttentionProblem) -> tuple:
    seed = dropout_seed() if p.dropout_p > 0 else None
    return p.q, p.k, p.v, p.mask, p.q_lengths, p.kv_lengths, p.scale, p.is_causal, p.dropout_p, seed


def run(p: AttentionProblem, return_lse: bool = False):
    """:func:`elsa_surgery.reference.run`, through ``elsa_surgery::reference_attention`` under torch.compile."""
    if not torch.compiler.is_compiling():
        return reference.run(p, return_lse=return_lse)
    out, lse = reference_attention_op(*_op_args(p))
    return out, (lse if return_lse else None)


def run_state(p: AttentionProblem) -> monoid.State:
    """:func:`elsa_surgery.reference.run_state`, through ``elsa_surgery::reference_attention_state`` under
    torch.compile."""
    if not torch.compiler.is_compiling():
        return reference.run_state(p)
    return monoid.State(*reference_attention_state_op(*_op_args(p)))


def run_varlen(vp: VarlenProblem, return_lse: bool = False):
    """:func:`elsa_surgery.reference.run_varlen`, through ``elsa_surgery::reference_attention_varlen`` under
    torch.compile."""
    if not torch.compiler.is_compiling():
        return reference.run_varlen(vp, return_lse=return_lse)
    seed = dropout_seed() if vp.dropout_p > 0 else None
    out, lse = reference_attention_varlen_op(vp.q, vp.k, vp.v, vp.cu_seqlens_q, vp.cu_seqlens_k, vp.scale,
                                             vp.is_causal, vp.dropout_p, seed)
    return out, (lse if return_lse else None)
