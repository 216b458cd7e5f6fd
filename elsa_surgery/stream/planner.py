"""From a memory budget to a task list: the peak-memory model, the choice of ``itr`` / block size and ``n_cap``, the
calibration pass and the cost model behind ``schedule="auto"``.

**Memory model** (bytes on the compute device; ``in`` = one task's inputs
``B · (Hq·Lq·D + Hkv·Lk·(D + Dv)) · e``, ``st`` = its fp32 states ``B · Hq · Lq · (2 + Dv) · 4``, ``Lq``/``Lk`` its
query/key tokens, ``e`` the input element size):

* while a task computes, ``n_cap`` tasks' inputs are resident (it and the ``n_cap - 1`` prefetched on the copy
  stream), with its states, the pending state of the previous task with the same queries (when the accumulator is
  on the host) and the kernel's workspace: ``n_cap·in + (1 + pending)·st + overhead``;
* while its states merge, its inputs are gone and the next ``n_cap - 1`` tasks' are loaded, with its states, the
  pending state and one state-sized temporary of the merge: ``(n_cap - 1)·in + (2 + pending)·st``;
* the peak is the larger of the two, plus the full-sequence accumulator ``B · Hq · N · (2 + Dv) · 4`` when the plan
  keeps it on the device (then nothing is pending).

**Calibration** (CUDA only): the largest task runs once alone; its measured peak minus ``in + st`` becomes
``overhead`` (the kernel's workspace and the per-segment merge temporaries; never negative), and the plan is redone
with it. On CPU nothing is measured (``calibrated=False``).

**Cost model** (``schedule="auto"``): a task costs ``max(flops / F, h2d_bytes / BW_H2D) + calls · LAUNCH`` plus
``flushed_state_bytes / BW_MERGE`` for the host merges of its states; ``auto`` takes the schedule with the smaller
total (constants :data:`COST`, per device type).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from . import divide

MAX_TASKS = 20000  # plans with more tasks are not considered (host-side bookkeeping grows with the count)
CQS_ORDERS = (7, 13, 21, 31)  # the c the planner tries (any of divide.SINGER_ORDERS may be passed explicitly)
COST = {  # F: attention FLOP/s, BW_H2D / BW_MERGE: bytes/s, LAUNCH: s per kernel call
    "cuda": {"F": 250e12, "BW_H2D": 20e9, "BW_MERGE": 4e9, "LAUNCH": 40e-6},
    "cpu": {"F": 30e9, "BW_H2D": float("inf"), "BW_MERGE": 2e9, "LAUNCH": 300e-6},
}


@dataclass(frozen=True)
class Shape:
    B: int
    Hq: int
    Hkv: int
    N: int
    D: int
    Dv: int
    esize: int  # bytes per input element

    def state_bytes(self, tokens: int) -> int:
        return self.B * self.Hq * tokens * (2 + self.Dv) * 4

    def input_bytes(self, lq: int, lk: int) -> int:
        return self.B * (self.Hq * lq * self.D + self.Hkv * lk * (self.D + self.Dv)) * self.esize


@dataclass
class Plan:
    schedule: str
    tasks: List[divide.Task]
    n_cap: int
    budget: Optional[int]
    shape: Shape
    causal: bool
    c: Optional[int] = None
    itr: Optional[int] = None
    block: Optional[int] = None
    acc_on_device: bool = False
    overhead: int = 0
    calibrated: bool = False
    calibration_peak: int = 0  # bytes the calibration run's task took (part of the call's measured peak)
    notes: List[str] = field(default_factory=list)

    def task_peak(self, task: divide.Task, n_cap: Optional[int] = None) -> int:
        return peak_bytes(self.shape, task, self.n_cap if n_cap is None else n_cap, self.acc_on_device,
                          self.overhead)

    @property
    def predicted_peak(self) -> int:
        return max(self.task_peak(t) for t in self.tasks)

    def settings(self) -> Dict:
        return {"schedule": self.schedule, "c": self.c, "itr": self.itr, "block": self.block, "causal": self.causal,
                "tasks": len(self.tasks), "acc_on_device": self.acc_on_device}


def peak_bytes(shape: Shape, task: divide.Task, n_cap: int, acc_on_device: bool, overhead: int = 0) -> int:
    inp, st = shape.input_bytes(task.q_tokens, task.k_tokens), shape.state_bytes(task.q_tokens)
    pending = 0 if acc_on_device else 1
    computing = n_cap * inp + (1 + pending) * st + overhead
    merging = (n_cap - 1) * inp + (2 + pending) * st
    return max(computing, merging) + (shape.state_bytes(shape.N) if acc_on_device else 0)


def task_flops(shape: Shape, task: divide.Task) -> float:
    """``2 · B · Hq · pairs · (D + Dv)``: QK^T and PV over the pairs the task computes."""
    return 2.0 * shape.B * shape.Hq * task.pair_count() * (shape.D + shape.Dv)


def kernel_calls(task: divide.Task) -> int:
    return sum(len(task.key_runs(i)) + int(task.pairs[i, i] == divide.CAUSAL) for i in task.query_segments())


def predicted_seconds(plan: Plan, device_type: str) -> float:
    k = COST["cuda" if device_type == "cuda" else "cpu"]
    total, prev_q = 0.0, None
    for t in plan.tasks:
        qsegs = tuple(t.segments[i] for i in t.query_segments())
        h2d = plan.shape.input_bytes(t.q_tokens, t.k_tokens)
        total += max(task_flops(plan.shape, t) / k["F"], h2d / k["BW_H2D"]) + kernel_calls(t) * k["LAUNCH"]
        if not plan.acc_on_device and qsegs != prev_q:
            total += plan.shape.state_bytes(t.q_tokens) / k["BW_MERGE"]
        prev_q = qsegs
    return total


def _fits(shape, tasks, n_cap, acc_on_device, overhead, budget) -> bool:
    return budget is None or max(peak_bytes(shape, t, n_cap, acc_on_device, overhead) for t in tasks) <= budget


def _choose_cap(shape, tasks, acc_on_device, overhead, budget, n_cap) -> Optional[int]:
    for cap in ((n_cap,) if n_cap else (3, 2, 1)):
        if _fits(shape, tasks, cap, acc_on_device, overhead, budget):
            return cap
    return None


def _cqs_candidates(shape: Shape, causal: bool, c: Optional[int], itr: Optional[int]):
    """(c, itr, tasks), fewest tasks first; with no itr, itr grows from 1 while the task count stays bounded."""
    cands = []
    for cc in ((c,) if c else CQS_ORDERS):
        its = (itr,) if itr else range(1, 8)
        for it in its:
            if cc ** it > MAX_TASKS or (cc ** (it - 1) > shape.N and not itr):
                break
            cands.append((cc ** it, cc, it))
    cands.sort()
    for _, cc, it in cands:
        yield cc, it, divide.cqs_tasks(shape.N, cc, it, causal)


def _block_candidates(shape: Shape, causal: bool, block: Optional[int]):
    if block:
        yield block, divide.block_tasks(shape.N, block, block, causal)
        return
    b = 1 << max(4, math.ceil(math.log2(max(shape.N, 1))))
    while b >= 16:
        if (shape.N / b) ** 2 <= 2 * MAX_TASKS:
            yield b, divide.block_tasks(shape.N, b, b, causal)
        b //= 2


def make_plan(shape: Shape, schedule: str, causal: bool, budget: Optional[int], *, itr=None, n_cap=None, c=None,
              block=None, acc_on_device: Optional[bool] = None, overhead: int = 0) -> Plan:
    """The plan with the fewest tasks whose predicted peak fits ``budget`` (``None`` = no limit).

    ``acc_on_device=None`` keeps the full-sequence accumulator on the device when it fits beside the largest task."""
    if schedule not in ("cqs", "blocks"):
        raise ValueError(f"schedule={schedule!r}: expected 'cqs', 'blocks' or 'auto'")
    smallest: Optional[Tuple[int, str]] = None
    cands = (((cc, it, None), tasks) for cc, it, tasks in _cqs_candidates(shape, causal, c, itr)) \
        if schedule == "cqs" else (((None, None, b), tasks) for b, tasks in _block_candidates(shape, causal, block))
    for (cc, it, b), tasks in cands:
        if not tasks:
            return Plan(schedule, [], n_cap or 1, budget, shape, causal, cc, it, b, False, overhead)
        for on_dev in ((True, False) if acc_on_device is None else (acc_on_device,)):
            cap = _choose_cap(shape, tasks, on_dev, overhead, budget, n_cap)
            if cap is not None:
                return Plan(schedule, tasks, cap, budget, shape, causal, cc, it, b, on_dev, overhead)
        need = max(peak_bytes(shape, t, n_cap or 1, False, overhead) for t in tasks)
        if smallest is None or need < smallest[0]:
            what = f"c={cc}, itr={it}" if schedule == "cqs" else f"block={b}"
            smallest = (need, what)
    fixed = ", ".join(f"{k}={v}" for k, v in (("itr", itr), ("n_cap", n_cap), ("c", c), ("block", block)) if v)
    raise ValueError(
        f"memory_budget={budget} bytes is too small for schedule={schedule!r}"
        + (f" with {fixed}" if fixed else "")
        + (f": the smallest plan tried ({smallest[1]}, n_cap={n_cap or 1}) needs {smallest[0]} bytes"
           if smallest else "")
        + "; raise memory_budget" + (" or drop the fixed itr/n_cap/block" if fixed else ""))


def resolve_budget(memory_budget, device: torch.device) -> Optional[int]:
    """Bytes from ``memory_budget``: an int (bytes), a float in (0, 1] (a fraction of the device's free memory;
    on CPU of the host's available memory) or None (90 % of free memory on CUDA, no limit on CPU)."""
    if memory_budget is None:
        return int(0.9 * torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"memory_budget: expected bytes (int) or a fraction of free memory (float in (0, 1]), "
                        f"got {type(memory_budget).__name__}")
    if isinstance(memory_budget, float):
        if not 0.0 < memory_budget <= 1.0:
            raise ValueError(f"memory_budget={memory_budget}: a float is a fraction of free memory, in (0, 1]")
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(memory_budget * free)
    if memory_budget <= 0:
        raise ValueError(f"memory_budget={memory_budget}: bytes must be > 0")
    return int(memory_budget)
