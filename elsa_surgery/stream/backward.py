"""Autograd for ``stream.attention``: dQ, dK and dV accumulated task by task, like Stream-CQSA's backward.

The forward keeps, besides the output, each row's final log-sum-exp ``lse`` (``m + log S`` of the merged state:
``[B, Hq, N]`` fp32). A task's query segment ``i`` attends to a few key pieces ``t`` (runs of FULL key segments,
and its CAUSAL diagonal); the row's output is ``O = Σ_t w_t O_t`` with ``w_t = exp(lse_t − lse)``, where
``(O_t, lse_t)`` is the piece's own attention. So the piece receives

    dO_t = w_t · dO,        dlse_t = w_t · (rowsum(dO ⊙ O_t) − rowsum(dO ⊙ O)),

(``∂O/∂lse_t = w_t (O_t − O)``), and ``elsa_surgery.attention(..., return_lse=True)``'s own backward — the ELSA
backward kernels with their ``dlse`` input on CUDA, the reference backend's autograd on CPU — turns those into the
piece's dQ, dK, dV. Each task's pieces are recomputed (as a flash backward recomputes probabilities), their grads
land on the task's gathered tokens and are added into fp32 accumulators ``dQ [B, Hq, N, D]``, ``dK [B, Hkv, N,
D]``, ``dV [B, Hkv, N, Dv]`` on the inputs' device, returned in the inputs' dtype.

Memory: a backward task holds its q, k, v and their grads, plus dO and O rows of its queries: about three times a
forward task's inputs, so the backward plans its tasks for a third of the budget (:func:`backward_plan`). A task
that still runs out of memory is refined into smaller tasks (the forward ladder's second step, :func:`_attempt`),
reported in ``last_report().backward["backward_events"]``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Dict, Optional

import torch

from . import distributed, divide, faults, planner
from .executor import Executor
from .sources import Source

logger = logging.getLogger("elsa_surgery.stream")


def backward_plan(plan: planner.Plan, budget: Optional[int]) -> planner.Plan:
    """The forward's plan when its tasks fit a third of the budget, else a finer plan of the same schedule."""
    if budget is None or 3 * max(plan.shape.input_bytes(t.q_tokens, t.k_tokens) for t in plan.tasks) <= budget:
        return plan
    fixed = {"itr": None, "c": plan.c} if plan.schedule == "cqs" else {"block": None}
    return planner.make_plan(plan.shape, plan.schedule, plan.causal, budget // 3, n_cap=1, overhead=plan.overhead,
                             **fixed)


def run(plan: planner.Plan, q, k, v, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, *, scale: float,
        device: torch.device, backend: str, stats: Dict, progress: bool = False) -> tuple:
    """``(dq, dk, dv)`` of ``stream.attention`` for the upstream gradient ``dout`` (see the module docstring).
    Under several ranks (every rank holds every row's ``lse``) each rank runs its shard of the tasks and the
    partial sums are summed over the ranks (:func:`distributed.all_reduce_sum_`). ``progress``: a tqdm bar of
    the tasks (rank 0), as the forward's."""
    from ..api import attention

    t0 = time.perf_counter()
    qs, ks, vs = Source(q, "q"), Source(k, "k"), Source(v, "v")
    B, Hq, N, D = qs.shape
    Hkv, Dv = ks.shape[1], vs.shape[3]
    home = q.device
    dq = torch.zeros(B, Hq, N, D, dtype=torch.float32, device=home)
    dk = torch.zeros(B, Hkv, N, D, dtype=torch.float32, device=home)
    dv = torch.zeros(B, Hkv, N, Dv, dtype=torch.float32, device=home)
    ex = Executor(plan, qs, ks, vs, scale=scale, device=device, backend=backend, progress=False)
    gqa = Hq != Hkv
    ranks = distributed.world()
    if ranks is not None:
        _same_dout_everywhere(dout, *ranks)
    order = range(len(plan.tasks)) if ranks is None else distributed.shard(plan, *ranks)
    from tqdm.auto import tqdm

    bar = tqdm(order, disable=not progress or (ranks is not None and ranks[0] != 0), unit="task",
               desc="stream.attention backward", mininterval=0.5 if sys.stderr.isatty() else 15.0)
    events: list = []
    kw = dict(scale=scale, device=device, backend=backend, gqa=gqa)
    with torch.enable_grad():  # autograd.Function.backward runs with grad mode off
        for i in bar:
            _attempt(plan, i, plan.tasks[i], ex, attention, dout, out, lse, (dq, dk, dv), home, events, 0, kw)
    bar.close()
    if ranks is not None:
        distributed.all_reduce_sum_((dq, dk, dv), *ranks, device=device)
    stats.update({"backward_tasks": len(order), "backward_seconds": time.perf_counter() - t0,
                  "backward_events": events})
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _same_dout_everywhere(dout: torch.Tensor, rank: int, size: int) -> None:
    """Every rank holds the same (replicated) output, and each computes the backward of its share of the tasks for
    its own ``dout``: the sum is the gradient only when the ``dout`` are equal (the same loss on every rank).
    Compared by two integer checksums of the bits (exact whatever the summation order), 64K tokens at a time, on
    the control plane."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dout.element_size()]
    sums = [0, 0]
    for a in range(0, dout.shape[2], 1 << 16):
        bits = dout[:, :, a:a + (1 << 16)].contiguous().view(ints).to(torch.int64)
        sums[0] += int(bits.sum())
        sums[1] += int((bits * bits).sum())
    for x in sums:
        if not distributed.same(x, rank, size):
            raise ValueError(f"stream.attention backward, rank {rank} of {size}: the output's gradient differs "
                             "between ranks; under several ranks every rank must compute the same loss of the "
                             "(replicated) output")


def _attempt(plan, index, task, ex, attention, dout, out, lse, acc, home, events, depth, kw) -> None:
    """One task's gradients added into ``acc`` (dq, dk, dv), with the forward's OOM ladder's refinement step: on
    ``torch.OutOfMemoryError`` while computing them (nothing is added before they are all computed, so nothing is
    counted twice) the task is refined into smaller tasks covering the same pairs (``divide.refine``, up to
    ``executor.MAX_REFINE`` levels), each retried the same way; then a clear ``OutOfMemoryError``."""
    from .executor import MAX_REFINE

    failed = grads = None
    try:
        faults.check_backward(index, task.tid)
        grads = _task_grads(task, ex, attention, dout, out, lse, **kw)
    except torch.OutOfMemoryError as e:
        failed = str(e)  # only the message: the traceback holds the failed attempt's tensors and graph
    if failed is None:
        _accumulate(task, grads, acc, home)
        return
    ex._free()
    if depth >= MAX_REFINE or task.q_tokens <= 1:
        raise torch.OutOfMemoryError(
            f"stream.attention backward: task {task.tid} ({task.q_tokens} query x {task.k_tokens} key tokens) "
            f"ran out of device memory after {depth} refinement(s) of its divide ({failed}); lower the other "
            "allocations on the device or give the forward a smaller memory_budget (the backward plans for a "
            "third of it)")
    children = divide.refine(task, plan.c or divide.SINGER_ORDERS[0], plan.causal)
    msg = f"backward: OOM in task {task.tid} ({failed}); refined into {len(children)} tasks"
    logger.warning("elsa_surgery.stream: %s", msg)
    events.append(msg)
    for child in children:
        _attempt(plan, index, child, ex, attention, dout, out, lse, acc, home, events, depth + 1, kw)


def _accumulate(task, grads, acc, home) -> None:
    """A task's gradients (of its gathered tokens) added into the full-sequence fp32 ``acc`` (dq, dk, dv)."""
    (gq, gk, gv, qoff, koff), (dq, dk, dv) = grads, acc
    seg_len = lambda i: task.segments[i][1] - task.segments[i][0]
    for i in task.query_segments():
        a, b = task.segments[i]
        dq[:, :, a:b] += gq[:, :, qoff[i]:qoff[i] + seg_len(i)].to(home, torch.float32)
    for j in task.key_segments():
        a, b = task.segments[j]
        dk[:, :, a:b] += gk[:, :, koff[j]:koff[j] + seg_len(j)].to(home, torch.float32)
        dv[:, :, a:b] += gv[:, :, koff[j]:koff[j] + seg_len(j)].to(home, torch.float32)


def _task_grads(task, ex, attention, dout, out, lse, *, scale, device, backend, gqa):
    """One task's pieces recomputed: the gradients of its gathered q, k, v tokens and their offsets."""
    qd, kd, vd, qoff, koff, event = ex._load(task)
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
    qd, kd, vd = (t.detach().requires_grad_(True) for t in (qd, kd, vd))
    keys = task.key_segments()
    seg_len = lambda i: task.segments[i][1] - task.segments[i][0]
    for i in task.query_segments():
        a, b = task.segments[i]
        qv = qd[:, :, qoff[i]:qoff[i] + seg_len(i)]
        do_i = dout[:, :, a:b].to(device, torch.float32)
        lse_i = lse[:, :, a:b].to(device)
        delta = (do_i * out[:, :, a:b].to(device, torch.float32)).sum(-1)
        pieces = []
        for x, y in task.key_runs(i):
            s, e = koff[keys[x]], koff[keys[y - 1]] + seg_len(keys[y - 1])
            pieces.append((s, e, False))
        if task.pairs[i, i] == divide.CAUSAL:
            pieces.append((koff[i], koff[i] + seg_len(i), True))
        outs, grads = [], []
        for s, e, causal in pieces:
            o_t, lse_t = attention(qv, kd[:, :, s:e], vd[:, :, s:e], is_causal=causal, scale=scale,
                                   enable_gqa=gqa, backend=backend, return_lse=True)
            lt, ot = lse_t.detach(), o_t.detach()
            w = torch.where(torch.isneginf(lse_i), torch.zeros_like(lse_i), torch.exp(lt - lse_i))
            outs += [o_t, lse_t]
            grads += [(w.unsqueeze(-1) * do_i).to(o_t.dtype), w * ((do_i * ot.float()).sum(-1) - delta)]
        torch.autograd.backward(outs, grads)
    return qd.grad, kd.grad, vd.grad, qoff, koff


class StreamAttention(torch.autograd.Function):
    """``stream.attention`` as an autograd node: the forward streams with grad off and keeps ``lse``; the backward
    streams the tasks again (:func:`run`)."""

    @staticmethod
    def forward(ctx, q, k, v, kw):
        from .api import attention

        grad: Dict = {}
        with torch.no_grad():
            out = attention(q.detach(), k.detach(), v.detach(), _grad=grad, **kw)
        ctx.save_for_backward(q.detach(), k.detach(), v.detach(), out, grad["lse"])
        ctx.plan, ctx.kw, ctx.device, ctx.budget = grad["plan"], kw, grad["device"], grad["budget"]
        return out

    @staticmethod
    def backward(ctx, dout):
        from . import api

        q, k, v, out, lse = ctx.saved_tensors
        plan = backward_plan(ctx.plan, ctx.budget)
        scale = q.shape[-1] ** -0.5 if ctx.kw["scale"] is None else float(ctx.kw["scale"])
        dq, dk, dv = run(plan, q, k, v, out, lse, dout, scale=scale, device=ctx.device, backend=ctx.kw["backend"],
                         stats=api.last_report().backward, progress=ctx.kw["progress"])
        return (dq if ctx.needs_input_grad[0] else None, dk if ctx.needs_input_grad[1] else None,
                dv if ctx.needs_input_grad[2] else None, None)
