"""Runs a plan's tasks: gathers each task's tokens onto the compute device, computes its ``(m, S, W)`` states with
:func:`elsa_surgery.attention_state` (ELSA kernels on CUDA, the reference backend on CPU) and merges them into the
accumulators with the public monoid (:func:`elsa_surgery.monoid.merge_`).

* **Overlap** (CUDA): once a task's kernels are launched, the next ``n_cap`` tasks' tokens are gathered into pinned
  host buffers and the next ``n_cap - 1`` are copied to the device on a copy stream, while the GPU computes; the
  compute stream waits on each copy's event. An upload first waits (on the events of launched tasks) until at most
  ``n_cap`` tasks' inputs are in use on the device, so ``n_cap`` bounds real residency, not just the allocator's
  count.
* **Accumulators**: the full-sequence state lives on the device when the plan says it fits, else on the host; then
  a task's states stay on the device while the next task has the same query ranges (the blocks schedule is
  query-major), and are merged into the host accumulator when the query ranges change ("flush"). Flush points
  depend on the task order only, so a checkpointed, resumed or uninterrupted run merge in the same order.
* **Guardrails** on ``torch.OutOfMemoryError`` (real, or injected by :mod:`.faults`): the task's partial results are
  dropped (a task merges only once it has finished: never lost, never counted twice) and it is retried after
  (1) halving ``n_cap``, then (2) refining its divide (``divide.refine``, up to :data:`MAX_REFINE` levels), then
  (3) moving the accumulators to the host. When nothing fits: an ``OutOfMemoryError`` naming the budget and the
  smallest task tried. Every step is logged and recorded in ``events``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import monoid
from . import divide, faults
from .planner import Plan, task_flops

logger = logging.getLogger("elsa_surgery.stream")
MAX_REFINE = 2
# keep a query group's states pending (then merged once, or finalized at the group's end) even where they are computed
# on the accumulator's device: for the CPU tests of the path that CUDA takes with host accumulators
PEND_ON_ONE_DEVICE = False


class Accumulators:
    """Full-sequence fp32 state ``m, S [B, Hq, N]``, ``W [B, Hq, N, Dv]`` on one device."""

    def __init__(self, B, Hq, N, Dv, device):
        if torch.device(device).type == "cpu":
            # S and W in calloc'd memory (numpy.zeros): the OS maps zero pages lazily, so rows never written (other
            # ranks' rows; rows finalized on the device where their group ended) cost neither time nor RAM.
            # torch.zeros writes every page: 4.4 s for 4 GiB on a CI-sized host, and a W is 16.5 GiB at 8M tokens.
            lazy = lambda *shape: torch.from_numpy(np.zeros(shape, dtype=np.float32))
            self.state = monoid.State(torch.full((B, Hq, N), monoid.NEG_INF, dtype=torch.float32), lazy(B, Hq, N),
                                      lazy(B, Hq, N, Dv))
        else:
            self.state = monoid.identity((B, Hq, N), Dv, device=device)

    @property
    def device(self) -> torch.device:
        return self.state.m.device

    def view(self, a: int, b: int) -> monoid.State:
        m, S, W = self.state
        return monoid.State(m[:, :, a:b], S[:, :, a:b], W[:, :, a:b])

    def to(self, device) -> None:
        self.state = monoid.State(*(t.to(device) for t in self.state))


class Executor:
    def __init__(self, plan: Plan, q, k, v, *, scale: float, device: torch.device, backend: str = "auto",
                 progress: bool = True, budget: Optional[int] = None):
        self.plan, self.q, self.k, self.v = plan, q, k, v
        self.scale, self.device, self.backend, self.progress = scale, device, backend, progress
        self.budget = budget
        self.n_cap = plan.n_cap
        self.host_only_states = False  # guardrail step 3 sets it: no state stays on the device between tasks
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ahead: Dict[int, tuple] = {}  # task index -> inputs on the device (prefetched)
        self.staged: Dict[int, tuple] = {}  # task index -> inputs gathered in host buffers
        self.inflight: Deque = collections.deque()  # CUDA events: the end of each launched task's kernels
        self.pending: Optional[Tuple[tuple, list]] = None  # (query ranges, [(range, State on device)])
        self.events: List[str] = []
        self.smallest: Optional[Tuple[int, divide.Task]] = None
        self.flops = 0.0
        self.tasks_run = 0
        self.precomputed: Dict[int, list] = {}  # task index -> its results computed already (the calibration run)
        # rows finished early: ``on_final(range, state)`` is called when the last task of a query group that no other
        # group touches has run (``group_total``: query key -> its task count, ``group_done``: tasks done so far,
        # resumed ones included); ``state`` is the rows' complete state, on the device when it was pending there.
        # ``keep_final``: also copy that state into the accumulator (needed by checkpoints).
        self.on_final: Optional[Callable[[Tuple[int, int], monoid.State], None]] = None
        self.group_total: Dict[tuple, int] = {}
        self.group_done: Dict[tuple, int] = collections.Counter()
        self.keep_final = True

    # ---------------------------------------------------------------- loading
    def _stage(self, task: divide.Task):
        """Host side of a load: the task's query and key tokens gathered into (pinned, on CUDA) host buffers; no
        device memory (sources already on the compute device are sliced there instead)."""
        def gather(src, segs):
            parts = [src.rows(a, b) for a, b in segs]
            if src.device.type == self.device.type:
                return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            n = sum(b - a for a, b in segs)
            host = torch.empty(parts[0].shape[:2] + (n,) + parts[0].shape[3:], dtype=src.dtype, pin_memory=self.cuda)
            if len(parts) == 1:
                host.copy_(parts[0])
            else:
                torch.cat(parts, dim=2, out=host)
            return host

        qsegs = [task.segments[i] for i in task.query_segments()]
        ksegs = [task.segments[j] for j in task.key_segments()]
        return gather(self.q, qsegs), gather(self.k, ksegs), gather(self.v, ksegs)

    def _make_room(self) -> None:
        """Wait until at most ``n_cap`` tasks' inputs are on the device with the one about to be uploaded: inputs of
        a launched task stay in use until its kernels end, whatever the allocator's count says."""
        while self.inflight and len(self.inflight) + len(self.ahead) + 1 > self.n_cap:
            self.inflight.popleft().synchronize()

    def _upload(self, task: divide.Task, staged):
        """Device side of a load: host buffers copied on the copy stream (an event marks the end of the copies)."""
        event = None
        if self.cuda:
            self._make_room()
            with torch.cuda.stream(self.copy_stream):
                dev = [t if t.is_cuda else t.to(self.device, non_blocking=True) for t in staged]
            for t in dev:
                t.record_stream(torch.cuda.current_stream(self.device))
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            staged = dev

        def offsets(idx):
            return dict(zip(idx, itertools.accumulate((task.segments[i][1] - task.segments[i][0] for i in idx),
                                                      initial=0)))

        return (*staged, offsets(task.query_segments()), offsets(task.key_segments()), event)

    def _load(self, task: divide.Task):
        return self._upload(task, self._stage(task))

    # ---------------------------------------------------------------- compute
    def _compute(self, task: divide.Task, data) -> List[Tuple[Tuple[int, int], monoid.State]]:
        from ..api import attention_state

        qd, kd, vd, qoff, koff, event = data
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        keys = task.key_segments()
        seg_len = lambda i: task.segments[i][1] - task.segments[i][0]
        results = []
        for i in task.query_segments():
            qv = qd[:, :, qoff[i]:qoff[i] + seg_len(i)]
            states = []
            for x, y in task.key_runs(i):
                a, b = koff[keys[x]], koff[keys[y - 1]] + seg_len(keys[y - 1])
                states.append(attention_state(qv, kd[:, :, a:b], vd[:, :, a:b], scale=self.scale,
                                              backend=self.backend))
            if task.pairs[i, i] == divide.CAUSAL:
                a = koff[i]
                states.append(attention_state(qv, kd[:, :, a:a + seg_len(i)], vd[:, :, a:a + seg_len(i)],
                                              is_causal=True, scale=self.scale, backend=self.backend))
            results.append((task.segments[i], monoid.merge_all(states)))
        return results

    # ---------------------------------------------------------------- merging
    @staticmethod
    def _into(acc: Accumulators, rng: Tuple[int, int], st: monoid.State, copy: bool = True) -> bool:
        """Merge ``st`` into the accumulator's rows ``rng``; True when those rows were the identity (then ``st`` is
        their state, copied only when ``copy``)."""
        view = acc.view(*rng)
        if bool(torch.isneginf(view.m).all()):
            # every row is still the identity (m = -inf holds only there): identity ⊕ st is st bit for bit (the
            # monoid's tested law), so copy it (from the device directly) instead of merging on the host
            if copy:
                for dst, src in zip(view, st):
                    dst.copy_(src)
            return True
        if st.m.device != acc.device:
            st = monoid.State(*(t.to(acc.device) for t in st))
        monoid.merge_(view, st)
        return False

    def flush(self, acc: Accumulators) -> None:
        """Merge the states pending on the device into the accumulator; rows whose group has finished go to
        ``on_final`` (finalized on the device, before any copy to the host)."""
        if self.pending is not None:
            key, results = self.pending
            final = self.on_final is not None and self.group_done.get(key, 0) == self.group_total.get(key, -1)
            for rng, st in results:
                copied = self.keep_final or not final
                fresh = self._into(acc, rng, st, copy=copied)
                if not final:
                    continue
                try:
                    self.on_final(rng, st if fresh else acc.view(*rng))
                except torch.OutOfMemoryError as e:  # the rows stay in the accumulator, finalized after the run
                    if fresh and not copied:
                        for dst, src in zip(acc.view(*rng), st):
                            dst.copy_(src)
                    self._free()
                    self._event(f"OOM while finalizing rows {rng[0]}:{rng[1]} on the device ({e}); they are "
                                "finalized after the run instead")
        self.pending = None

    def _merge(self, results, acc: Accumulators) -> None:
        """Merge a finished task's per-segment states; never leaves a task half-merged: an OOM at segment ``x``
        (the device temporaries of the merge) moves the accumulator and the pending state to the host (guardrail
        step 3), where segments ``x`` onwards then merge."""
        if self.inflight:
            # the task's kernels end first: its inputs' memory (freed, but in use until then) is then reusable for
            # the merge's temporaries instead of adding to the device's reserved memory
            self.inflight[-1].synchronize()
        key = tuple(r[0] for r in results)
        apart = acc.device != results[0][1].m.device or PEND_ON_ONE_DEVICE
        into_pending = not self.host_only_states and apart and self.pending is not None and self.pending[0] == key
        if not into_pending and not self.host_only_states and apart:
            self.flush(acc)
            self.pending = (key, results)
            return
        for x, (rng, st) in enumerate(results):
            try:
                if into_pending:
                    monoid.merge_(self.pending[1][x][1], st)
                else:
                    self._into(acc, rng, st)
            except torch.OutOfMemoryError as e:
                self._free()
                self._go_host(acc)
                self._event(f"OOM while merging states ({e}); accumulators moved to the host")
                for rng2, st2 in results[x:]:
                    self._into(acc, rng2, st2)
                return

    def _go_host(self, acc: Accumulators) -> None:
        self.flush(acc)
        if acc.device.type != "cpu":
            acc.to("cpu")
        self.host_only_states = True

    def _free(self) -> None:
        self.ahead.clear()
        self.staged.clear()
        self.inflight.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- the ladder
    def _attempt(self, index: int, task: divide.Task, acc: Accumulators, upcoming, depth: int = 0) -> None:
        while True:
            failed = data = results = None
            try:
                faults.check(index, task.tid)
                if depth == 0 and index in self.precomputed:  # host copies of the calibration run's states
                    self.ahead.pop(index, None)
                    self.staged.pop(index, None)
                    results = [(rng, monoid.State(*(t.to(self.device) for t in st)))
                               for rng, st in self.precomputed.pop(index)]
                else:
                    data = self.ahead.pop(index, None) if depth == 0 else None
                    if data is None:
                        staged = self.staged.pop(index, None) if depth == 0 else None
                        data = self._upload(task, staged or self._stage(task))
                    results = self._compute(task, data)
                    data = None
                if self.cuda:
                    self.inflight.append(torch.cuda.Event())
                    self.inflight[-1].record(torch.cuda.current_stream(self.device))
                if depth == 0:  # while this task's kernels run: stage n_cap tasks ahead, upload n_cap - 1
                    for j, t in upcoming[: self.n_cap]:
                        if j not in self.ahead and j not in self.staged and j not in self.precomputed:
                            self.staged[j] = self._stage(t)
                    for j, t in upcoming[: self.n_cap - 1]:
                        if j not in self.ahead and j in self.staged:
                            self.ahead[j] = self._upload(t, self.staged.pop(j))
            except torch.OutOfMemoryError as e:
                # only the message: the exception's traceback holds the failed attempt's frames (its inputs and
                # partial states), which must be gone before the ladder's next step allocates again
                failed = str(e)
            if failed is None:
                self._merge(results, acc)  # outside the retry: a task merges once, after it has fully run
                self.flops += task_flops(self.plan.shape, task)
                self.tasks_run += 1
                return
            data = results = None
            self._free()
            need = self.plan.task_peak(task, 1)
            if self.smallest is None or need < self.smallest[0]:
                self.smallest = (need, task)
            if self.n_cap > 1:
                self.n_cap = max(1, self.n_cap // 2)
                self._event(f"OOM in task {task.tid} ({failed}); retry with n_cap={self.n_cap}")
                continue
            if depth < MAX_REFINE and task.q_tokens > 1:
                c = self.plan.c or divide.SINGER_ORDERS[0]
                children = divide.refine(task, c, self.plan.causal)
                self._event(f"OOM in task {task.tid} at n_cap=1; refined into {len(children)} tasks (c={c})")
                for child in children:
                    self._attempt(index, child, acc, (), depth + 1)
                return
            if not self.host_only_states:
                self._go_host(acc)
                self._event(f"OOM in task {task.tid} after refinement; accumulators moved to the host, retry")
                continue
            t = self.smallest[1]
            raise torch.OutOfMemoryError(
                f"stream.attention: nothing fits in memory_budget={self.budget} bytes on {self.device}: the "
                f"smallest task tried ({t.tid}: {t.q_tokens} query x {t.k_tokens} key tokens, predicted peak "
                f"{self.smallest[0]} bytes at n_cap=1, accumulators on the host) ran out of memory ({failed})")

    def _event(self, msg: str) -> None:
        logger.warning("elsa_surgery.stream: %s", msg)
        self.events.append(msg)

    # ---------------------------------------------------------------- the loop
    def run(self, order: Sequence[int], acc: Accumulators, *,
            on_task_done: Optional[Callable[[int, bool], None]] = None,
            max_tasks: Optional[int] = None, deadline: Optional[float] = None) -> bool:
        """Run tasks ``order`` (indices into ``plan.tasks``); ``on_task_done(index, flushed)`` after each (the
        checkpoint hook: ``flushed`` means no state is pending on the device). Returns True when all ran."""
        from tqdm.auto import tqdm

        tasks = self.plan.tasks
        bar = tqdm(total=len(order), disable=not self.progress, unit="task", desc="stream.attention",
                   mininterval=0.5 if sys.stderr.isatty() else 15.0)  # logs (no tty): a line every 15 s
        start = time.perf_counter()
        try:
            for pos, index in enumerate(order):
                if (max_tasks is not None and pos >= max_tasks) or (deadline is not None and time.time() > deadline):
                    self.flush(acc)
                    return False
                upcoming = [(j, tasks[j]) for j in order[pos + 1: pos + self.n_cap]]
                self._attempt(index, tasks[index], acc, upcoming)
                self.group_done[self._qkey(tasks[index])] += 1
                nxt = order[pos + 1] if pos + 1 < len(order) else None
                if nxt is None or self._qkey(tasks[nxt]) != (self.pending[0] if self.pending else None):
                    self.flush(acc)
                if on_task_done is not None:
                    on_task_done(index, self.pending is None)
                el = time.perf_counter() - start
                bar.set_postfix_str(f"{self.flops / max(el, 1e-9) / 1e12:.2f} TFLOP/s", refresh=False)
                bar.update(1)
            self.flush(acc)
            return True
        finally:
            bar.close()
            self.ahead.clear()
            self.staged.clear()

    @staticmethod
    def _qkey(task: divide.Task) -> tuple:
        return tuple(task.segments[i] for i in task.query_segments())
