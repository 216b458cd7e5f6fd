"""The ELSA monoid over attention states ``(m, S, W)`` (docs/design.md, "What the product is").

For one query row and a set of keys ``J`` with logits ``s_j`` and values ``v_j``:

* ``m = max_j s_j`` (the running max logit),
* ``S = sum_j exp(s_j - m)``,
* ``W = sum_j exp(s_j - m) * v_j``,

and the softmax-attention output is ``y = W / S``. Two states over disjoint key sets merge with
``a ⊕ b = (m, S_a e^(m_a - m) + S_b e^(m_b - m), W_a e^(m_a - m) + W_b e^(m_b - m))``, ``m = max(m_a, m_b)``.
The identity is ``(-inf, 0, 0)``: a fully masked block merges as the identity, which needs a guard for
``exp(-inf - (-inf))``. ⊕ is associative and commutative, so partitions of the keys can be reduced in
any order — split-K kernels, varlen, streaming (Stream-CQSA) and multi-GPU reductions all use it.

Shapes: ``m`` and ``S`` are ``[..., N]``, ``W`` is ``[..., N, Dv]``; states are kept in fp32 (float64 for
a float64 oracle).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Tuple

import torch

NEG_INF = float("-inf")


class State(NamedTuple):
    """A partial attention state: ``m [..., N]``, ``S [..., N]``, ``W [..., N, Dv]``."""

    m: torch.Tensor
    S: torch.Tensor
    W: torch.Tensor


def identity(shape, dv: int, *, dtype=torch.float32, device=None) -> State:
    """The identity state ``(-inf, 0, 0)`` for ``shape`` query rows with value width ``dv``."""
    shape = tuple(shape)
    return State(
        torch.full(shape, NEG_INF, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape + (dv,), dtype=dtype, device=device),
    )


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """``m`` with -inf replaced by 0, so ``exp(x - safe)`` is 0 (not NaN) when ``x = m = -inf``."""
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def merge(a: State, b: State) -> State:
    """``a ⊕ b``. Exact for fully masked operands (the identity); NaN in either operand propagates."""
    m = torch.maximum(a.m, b.m)
    ref = _safe_max(m)
    ea = torch.exp(a.m - ref)
    eb = torch.exp(b.m - ref)
    S = a.S * ea + b.S * eb
    W = a.W * ea.unsqueeze(-1) + b.W * eb.unsqueeze(-1)
    return State(m, S, W)


def merge_(acc: State, b: State) -> State:
    """``acc ⊕= b`` in place, vectorised over rows: ``acc``'s tensors (which may be views into larger accumulators,
    e.g. a token range of a full-sequence state) are overwritten with exactly :func:`merge`'s values (same
    operations, same rounding). All temporaries are allocated before the first write, so an out-of-memory error
    leaves ``acc`` as it was. ``b`` must be on ``acc``'s device and dtype. Returns ``acc``."""
    m = torch.maximum(acc.m, b.m)
    ref = _safe_max(m)
    ea = torch.exp(acc.m - ref)
    eb = torch.exp(b.m - ref)
    sb, wb = b.S * eb, b.W * eb.unsqueeze(-1)  # every temporary first: an allocation failure leaves acc untouched
    acc.S.mul_(ea).add_(sb)
    acc.W.mul_(ea.unsqueeze(-1)).add_(wb)
    acc.m.copy_(m)
    return acc


def merge_all(states: Iterable[State]) -> State:
    """Tree-merge a sequence of states (pairwise, log depth); the order does not change the result."""
    level = list(states)
    if not level:
        raise ValueError("merge_all needs at least one state")
    while len(level) > 1:
        nxt = [merge(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def from_scores(scores: torch.Tensor, v: torch.Tensor) -> State:
    """The state of one block of keys: ``scores [..., N, K]`` (masked entries = -inf), ``v [..., K, Dv]``."""
    m = scores.amax(dim=-1)
    p = torch.exp(scores - _safe_max(m).unsqueeze(-1))
    return State(m, p.sum(dim=-1), torch.matmul(p.to(v.dtype), v).to(p.dtype))


def fold_scores(state: State, scores: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor] = None) -> State:
    """``state ⊕ from_scores(scores, v)`` in one pass over the block (what a kernel's inner loop does).

    ``scores`` is consumed: it is overwritten in place with the block's probabilities, unless autograd records
    the call (then every step is out of place, so that the reference backend can be differentiated). ``keep``
    (dropout: 0 or ``1 / (1 - p)`` per score) scales the probabilities that enter ``W`` only, so that ``W / S``
    is the dropped-out softmax times V, as in SDPA.
    """
    m = torch.maximum(state.m, scores.amax(dim=-1))
    ref = _safe_max(m)
    alpha = torch.exp(state.m - ref)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (scores, v, state.m, state.S, state.W))
    p = torch.exp(scores - ref.unsqueeze(-1)) if recorded else scores.sub_(ref.unsqueeze(-1)).exp_()
    S = state.S * alpha + p.sum(dim=-1)
    if keep is not None:
        p = p * keep if recorded else p.mul_(keep)
    W = torch.matmul(p.to(v.dtype), v).to(p.dtype)
    W = W + state.W * alpha.unsqueeze(-1) if recorded else W.add_(state.W * alpha.unsqueeze(-1))
    return State(m, S, W)


def finalize(state: State, out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: ``out = W / S`` (zeros where no key was visible), ``lse = m + log S`` (-inf there)."""
    empty = state.S == 0
    denom = torch.where(empty, torch.ones_like(state.S), state.S)
    out = state.W / denom.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(state.m, NEG_INF), state.m + torch.log(denom))
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out, lse


def finalize_backward(state: State, grad_out: Optional[torch.Tensor] = None,
                      grad_lse: Optional[torch.Tensor] = None) -> State:
    """The gradients with respect to ``state`` of a scalar whose gradients with respect to ``finalize(state)``
    are ``grad_out`` and ``grad_lse`` (None = zero), as a ``State`` ``(dm, dS, dW)``. Rows with no visible key
    finalize to constants: zero gradients."""
    empty = state.S == 0
    denom = torch.where(empty, torch.ones_like(state.S), state.S)
    g_out = torch.zeros_like(state.W) if grad_out is None else grad_out.to(state.W.dtype)
    g_lse = torch.zeros_like(state.S) if grad_lse is None else grad_lse.to(state.S.dtype)
    zero = torch.zeros_like(state.S)
    dW = torch.where(empty.unsqueeze(-1), torch.zeros_like(state.W), g_out / denom.unsqueeze(-1))
    dS = torch.where(empty, zero, (g_lse - (g_out * state.W).sum(-1) / denom) / denom)
    return State(torch.where(empty, zero, g_lse), dS, dW)


def from_output(out: torch.Tensor, lse: torch.Tensor) -> State:
    """The state equivalent to a finished ``(out, lse)`` pair: ``(lse, 1, out)`` (identity where lse = -inf).

    Lets results of any backend (or another GPU) be merged with ``merge``.
    """
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    lse = lse.to(out.dtype)
    empty = lse == NEG_INF
    S = torch.where(empty, torch.zeros_like(lse), torch.ones_like(lse))
    W = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    return State(lse, S, W)
