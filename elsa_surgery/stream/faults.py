"""Fault injection for the streaming executor (tests and drills; no environment variable, no effect unless used).

``with inject(oom_at={3, 7}): stream.attention(...)`` raises ``torch.OutOfMemoryError`` when the executor starts
top-level task 3 and task 7 (indices into the plan's task list, in this rank's order) — ``oom_times`` times per
task, so ``oom_times=2`` with ``n_cap=2`` exercises the ladder's second step (refinement). ``exit_at=k`` ends the
process with ``os._exit(exit_code)`` when task ``k`` starts (a hard kill: no ``finally``, no flush), which is
how the resume and dead-rank tests kill a run mid-way; ``exit_after=n`` does it when this process starts its
(n+1)-th task, whichever it is (a rank's share is known only once the plan is made). ``log`` lists what was
injected.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch


@dataclass
class FaultPlan:
    oom_at: Dict[int, int] = field(default_factory=dict)  # task index -> OOMs left to raise
    exit_at: Optional[int] = None
    exit_code: int = 17
    exit_after: Optional[int] = None
    backward_oom_at: Dict[int, int] = field(default_factory=dict)  # the backward's task index -> OOMs left
    started: set = field(default_factory=set)
    log: List[str] = field(default_factory=list)


_active: Optional[FaultPlan] = None


@contextlib.contextmanager
def inject(oom_at: Iterable[int] = (), *, oom_times: int = 1, exit_at: Optional[int] = None, exit_code: int = 17,
           exit_after: Optional[int] = None, backward_oom_at: Iterable[int] = ()):
    """Arm the executor's fault hook for the ``with`` block; yields the :class:`FaultPlan` (its ``log``).
    ``backward_oom_at``: the backward's task indices (in its plan) that raise ``oom_times`` OOMs (its ladder)."""
    global _active
    plan = FaultPlan({int(i): int(oom_times) for i in oom_at}, exit_at, exit_code, exit_after,
                     {int(i): int(oom_times) for i in backward_oom_at})
    prev, _active = _active, plan
    try:
        yield plan
    finally:
        _active = prev


def check(index: int, tid: str) -> None:
    """Called by the executor before each attempt of a top-level task (``index``) and its refined children."""
    plan = _active
    if plan is None:
        return
    plan.started.add(index)
    if (plan.exit_at is not None and index == plan.exit_at) or (
            plan.exit_after is not None and len(plan.started) > plan.exit_after):
        os._exit(plan.exit_code)
    left = plan.oom_at.get(index, 0)
    if left > 0:
        plan.oom_at[index] = left - 1
        plan.log.append(f"oom {index} {tid}")
        raise torch.OutOfMemoryError(f"injected OutOfMemoryError at task {index} ({tid})")


def check_backward(index: int, tid: str) -> None:
    """Called by the stream backward before each attempt of task ``index`` (of its plan) and its refined children."""
    plan = _active
    if plan is None:
        return
    left = plan.backward_oom_at.get(index, 0)
    if left > 0:
        plan.backward_oom_at[index] = left - 1
        plan.log.append(f"backward oom {index} {tid}")
        raise torch.OutOfMemoryError(f"injected OutOfMemoryError in the backward at task {index} ({tid})")
