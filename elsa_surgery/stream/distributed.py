"""Sharding tasks over ``torch.distributed`` ranks and merging their partial states (torch.distributed only).

**Shards.** Tasks are grouped by query ranges (consecutive tasks of the plan with the same query segments: one query
row of tiles in the blocks schedule; one task each in CQS) and the groups are dealt to ranks largest first, each to
the rank with the least work so far (by FLOPs). A rank runs its tasks in plan order into its own full-sequence
accumulator, whose rows stay the identity where it computed nothing. Whole groups, not single tasks, go to a rank, so
a blocks query row merges on one rank in the same order as in one process.

**Merge** (:func:`merge_finalize`), token range by token range, by which ranks computed the range's rows:

* one rank (*owned*): that rank finalizes the rows from its own state and the ranks all_gather the output rows
  (``out``'s dtype; no state travels), every rank finalizing a chunk of its own rows at each step. The rows are bit
  for bit those of one process running the same tasks in the same order.
* several ranks (*shared*: CQS, or a range split across groups): ``m* = all_reduce(m, MAX)``;
  ``S ← S·e^(m − m*)``, ``W ← W·e^(m − m*)``; ``all_reduce(S, SUM)``, ``all_reduce(W, SUM)``; then every rank
  finalizes. Another merge order than one process: equal up to fp32 rounding.

Rows of query groups that no other group touches (the blocks schedule's rows) skip that merge: their owner sends
them to every other rank as soon as it has them (:class:`Delivery`, gloo point-to-point in the background), and the
merge gathers the rest.

Every rank ends with the full output. NCCL needs device tensors: the chunks travel through the rank's GPU; gloo works
on host tensors.

**Control plane.** Small agreements (the budget, the calibrated overhead, whether every rank finished its share) go
through a gloo group. Under NCCL that is a second group on the same ranks (:func:`control`): a rank that died is then
seen at once by gloo (its socket closes) instead of after NCCL's watchdog timeout, and the other ranks raise
``RuntimeError("stream.attention: rank r of w: ... another rank died ...")`` before any NCCL collective of the merge
starts. A rank that is alive but slow is waited for up to the process group's timeout.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import monoid
from .planner import Plan, task_flops

logger = logging.getLogger("elsa_surgery.stream")
MERGE_CHUNK_TOKENS = 1 << 16
_CONTROL: Dict[int, tuple] = {}  # id(default group) -> (that group, its gloo control group) (NCCL runs only)


def world() -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` when a process group with more than one rank is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "nccl"


def _default_timeout() -> Optional[timedelta]:
    """The default group's timeout (``init_process_group(timeout=...)``), read from its backend's options; None
    (torch's gloo default) where this torch version does not expose it."""
    import torch.distributed as dist

    try:
        pg = dist.distributed_c10d._get_default_group()
        dev = torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu")
        t = pg._get_backend(dev).options._timeout
        return t if isinstance(t, timedelta) else None
    except Exception:  # private API: absent or changed in this torch version
        return None


def _gloo_group(cache: Dict[int, tuple]):
    """A gloo group on every rank, created once per default group (collectively: every rank calls this at the same
    point of the run) with the default group's timeout, kept in ``cache``."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    entry = cache.get(id(default))
    if entry is None or entry[0] is not default:  # (a destroyed and re-created default group may reuse an id)
        timeout = _default_timeout()
        if timeout is None:
            logger.info("elsa_surgery.stream: the process group's timeout is not readable in this torch version; "
                        "a gloo group of stream.attention uses torch's default")
        entry = cache[id(default)] = (default, dist.new_group(backend="gloo", timeout=timeout))
    return entry[1]


def control():
    """The group for the control plane: the default group under gloo; under NCCL a gloo group on the same ranks."""
    return _gloo_group(_CONTROL) if _nccl() else None


def data_group():
    """A gloo group for the rows delivered in the background (:class:`Delivery`), apart from the control plane."""
    return _gloo_group(_DATA)


_DATA: Dict[int, tuple] = {}  # id(default group) -> (that group, its gloo group for delivered rows)
_CALLS = [0]  # stream.attention calls under ranks so far (every rank makes the same calls): tags of a call's messages
MAX_MESSAGES = 1 << 24  # a call's Delivery messages (their tags' range)


class Delivery:
    """Owned output rows sent to every other rank as soon as their owner has them, in the background.

    ``segments``: ``(a, b, owner)`` of the rows of query groups that no other group touches (the blocks schedule's
    query rows), the same list on every rank. Every rank posts its receives for the others' segments at once,
    straight into its output ``out`` (and ``lse``) rows (gloo point-to-point on :func:`data_group`, as bytes, one
    message per segment, batch row and head); an owner sends a segment when :meth:`send` is told its rows are
    written (where their group ended, on the device), and the rest in :meth:`finish` after the run. Every segment
    travels exactly once, so no rank needs to know where another finalized its rows; the merge after the run is left
    with the other ranges only. Needs ``out`` and ``lse`` on the host, contiguous."""

    def __init__(self, segments, rank: int, size: int, out_t: torch.Tensor, lse: Optional[torch.Tensor]):
        import torch.distributed as dist

        self.rank, self.size, self.out, self.lse = rank, size, out_t, lse
        self.group = data_group()
        _CALLS[0] += 1
        self.base = (_CALLS[0] % 64) << 24
        B, H = out_t.shape[0], out_t.shape[1]
        self.parts = 2 if lse is not None else 1
        self.index = {(a, b): i for i, (a, b, _) in enumerate(segments)}
        self.segments, self.B, self.H = segments, B, H
        self.sent = set()
        self.works: list = []
        self.stats = {"delivered_tokens": 0, "delivered_bytes": 0, "late_segments": 0, "wait_seconds": 0.0}
        if not Delivery.fits(len(segments), B, H, lse is not None):
            raise ValueError("too many segments to deliver")
        for i, (a, b, owner) in enumerate(segments):
            if owner == rank:
                continue
            for tag, t in self._messages(i, a, b):
                self.works.append(dist.irecv(t, src=owner, group=self.group, tag=tag))
            self.stats["delivered_tokens"] += b - a

    @staticmethod
    def fits(n_segments: int, B: int, H: int, with_lse: bool) -> bool:
        """Whether a call's messages (a segment, batch row and head each, twice with the lse) fit the tag range."""
        return n_segments * B * H * (2 if with_lse else 1) < MAX_MESSAGES

    def _messages(self, i, a, b):
        for bi in range(self.B):
            for hi in range(self.H):
                j = ((i * self.B + bi) * self.H + hi) * self.parts
                yield self.base + j, self.out[bi, hi, a:b].view(torch.uint8)
                if self.lse is not None:
                    yield self.base + j + 1, self.lse[bi, hi, a:b].view(torch.uint8)

    def owns(self, a: int, b: int) -> bool:
        i = self.index.get((a, b))
        return i is not None and self.segments[i][2] == self.rank

    def send(self, a: int, b: int) -> None:
        """Rows ``[a, b)`` of this rank's segment are written (and their lse): send them to every other rank."""
        import torch.distributed as dist

        i = self.index[(a, b)]
        self.sent.add(i)
        for tag, t in self._messages(i, a, b):
            for r in range(self.size):
                if r != self.rank:
                    self.works.append(dist.isend(t, dst=r, group=self.group, tag=tag))
                    self.stats["delivered_bytes"] += t.numel()

    def finish(self, write_rows: Callable[[int, int], None]) -> Dict:
        """Send this rank's segments that were not sent during the run (``write_rows(a, b)`` writes them first:
        finalized from the accumulator), then wait until every message has gone and arrived."""
        for i, (a, b, owner) in enumerate(self.segments):
            if owner == self.rank and i not in self.sent:
                write_rows(a, b)
                self.send(a, b)
                self.stats["late_segments"] += 1
        t0 = time.perf_counter()
        try:
            for w in self.works:
                w.wait()
        except Exception as e:
            raise _error(self.rank, self.size, "delivering the output rows", e) from e
        self.works = []
        self.stats["wait_seconds"] = time.perf_counter() - t0
        return self.stats


def _error(rank: int, size: int, what: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"stream.attention: rank {rank} of {size}: {what} failed — another rank died or did not "
                        f"reach the collective within the process group's timeout ({type(e).__name__}: {e})")


def agree(value: Optional[float], op: str, rank: int, size: int, what: str = "agreeing on a setting"
          ) -> Optional[float]:
    """``value`` reduced over the ranks with ``op`` ("min" / "max") on the control plane; None stands for +inf."""
    import torch.distributed as dist

    t = torch.tensor([float("inf") if value is None else float(value)], dtype=torch.float64)  # bools: 0 / 1
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=control())
    except Exception as e:
        raise _error(rank, size, what, e) from e
    x = t.item()
    return None if x == float("inf") else x


def same(value: Optional[float], rank: int, size: int) -> bool:
    """Whether every rank holds the same ``value`` (its minimum and maximum over the ranks agree)."""
    return agree(value, "min", rank, size) == agree(value, "max", rank, size)


def first_plan_settings(mine: Optional[Dict], rank: int, size: int) -> Optional[Dict]:
    """The plan settings of the first run from any rank's checkpoint (``mine``: this rank's, or None when it has no
    checkpoint: it died before its first save), the same on every rank; None when no rank has one."""
    import torch.distributed as dist

    every: List[Optional[Dict]] = [None] * size
    try:
        dist.all_gather_object(every, mine, group=control())
    except Exception as e:
        raise _error(rank, size, "comparing the ranks' checkpoints", e) from e
    found = [x for x in every if x is not None]
    if any(x != found[0] for x in found):
        raise ValueError(f"checkpoint_dir: the ranks' checkpoints hold different plans ({found}); they are not of "
                         "one run: use another directory or delete it to start over")
    return found[0] if found else None


def all_finished(finished: bool, rank: int, size: int) -> bool:
    """Whether every rank finished its share (a slice run stops all ranks together: no rank waits in the merge
    for one that stopped)."""
    return agree(1.0 if finished else 0.0, "min", rank, size, "waiting for every rank to finish its share") == 1.0


# ------------------------------------------------------------------------------------------------ shards
def groups(plan: Plan) -> List[List[int]]:
    """Runs of consecutive task indices with the same query ranges."""
    out: List[List[int]] = []
    prev = None
    for i, t in enumerate(plan.tasks):
        key = tuple(t.segments[j] for j in t.query_segments())
        if key != prev or not out:
            out.append([])
        out[-1].append(i)
        prev = key
    return out


def assignment(plan: Plan, size: int, pins: Optional[Dict[int, int]] = None) -> List[int]:
    """The rank of every task: whole query groups, largest first, each to the least loaded rank (ties: the lowest
    rank). Equal groups split evenly; in general the busiest rank exceeds the mean by less than the largest group.
    ``pins`` (task index -> rank): tasks computed already on that rank (calibration); their groups go to that rank
    first (the lowest rank when two pins share a group), loaded with the group's cost less the pinned tasks'."""
    gs = groups(plan)
    flops = [task_flops(plan.shape, t) for t in plan.tasks]
    cost = [sum(flops[i] for i in g) for g in gs]
    load = [0.0] * size
    rank_of = [0] * len(plan.tasks)
    placed = set()
    pins = pins or {}
    for gi, g in enumerate(gs):
        mine = sorted((pins[i], i) for i in g if i in pins)
        if mine:
            r = mine[0][0]
            load[r] += cost[gi] - sum(flops[i] for rr, i in mine if rr == r)
            placed.add(gi)
            for i in g:
                rank_of[i] = r
    for gi in sorted(range(len(gs)), key=lambda x: (-cost[x], x)):
        if gi in placed:
            continue
        r = min(range(size), key=lambda x: (load[x], x))
        load[r] += cost[gi]
        for i in gs[gi]:
            rank_of[i] = r
    return rank_of


def calibration_tasks(plan: Plan, size: int) -> List[int]:
    """A task index per rank for the calibration run: of the tasks with the most tokens (the largest inputs and
    states, so the largest measured peak), the cheapest first, each rank's in a query group of its own while there
    are enough groups (then its result is reused: :func:`assignment`'s ``pins``)."""
    most = max(t.q_tokens + t.k_tokens for t in plan.tasks)
    cands = sorted((task_flops(plan.shape, t), i) for i, t in enumerate(plan.tasks)
                   if t.q_tokens + t.k_tokens == most)
    group_of = {i: gi for gi, g in enumerate(groups(plan)) for i in g}
    picked: List[int] = []
    used = set()
    for _, i in cands:
        if len(picked) < size and group_of[i] not in used:
            picked.append(i)
            used.add(group_of[i])
    # fewer groups than ranks: the extra ranks calibrate on the first task too (their results are not reused)
    return picked + [picked[0]] * (size - len(picked))


def shard(plan: Plan, rank: int, size: int) -> List[int]:
    """Task indices of ``rank``, in plan order."""
    return [i for i, r in enumerate(assignment(plan, size)) if r == rank]


def owners(plan: Plan, size: int, rank_of: Optional[List[int]] = None) -> List[Tuple[int, int, int]]:
    """``(start, stop, mask)`` covering ``[0, N)``: bit r of ``mask`` is set when rank r computed rows of that token
    range (adjacent ranges with the same mask joined). ``rank_of``: :func:`assignment`'s result, if at hand."""
    if rank_of is None:
        rank_of = assignment(plan, size)
    per_rank: List[List[Tuple[int, int]]] = [[] for _ in range(size)]
    for i, t in enumerate(plan.tasks):
        per_rank[rank_of[i]].extend(t.segments[j] for j in t.query_segments())
    delta: Dict[int, int] = {0: 0, plan.shape.N: 0}
    for r, segs in enumerate(per_rank):
        segs.sort()
        union: List[List[int]] = []
        for a, b in segs:
            if union and a <= union[-1][1]:
                union[-1][1] = max(union[-1][1], b)
            else:
                union.append([a, b])
        for a, b in union:
            delta[a] = delta.get(a, 0) + (1 << r)
            delta[b] = delta.get(b, 0) - (1 << r)
    points = sorted(delta)
    out: List[Tuple[int, int, int]] = []
    mask = 0
    for a, b in zip(points, points[1:]):
        mask += delta[a]
        if out and out[-1][2] == mask:
            out[-1] = (out[-1][0], b, mask)
        else:
            out.append((a, b, mask))
    return out


# ------------------------------------------------------------------------------------------------ merge
def merge_finalize(state: monoid.State, plan: Plan, rank_of: List[int], rank: int, size: int,
                   finalize: Callable[[int, int], Tuple[torch.Tensor, torch.Tensor]],
                   write: Callable[[int, int, torch.Tensor], None],
                   out_dtype: torch.dtype, lse_out: Optional[torch.Tensor] = None,
                   device: Optional[torch.device] = None, budget: Optional[int] = None,
                   delivered: Sequence[Tuple[int, int]] = ()) -> Dict:
    """Every rank's output rows written with ``write(a, b, rows)``.

    Owned ranges (one rank computed their rows) go in steps: at step ``s`` every rank finalizes the ``s``-th chunk of
    its own rows (``finalize(a, b)``: the rows in ``out_dtype`` and their lse; ``rank_of``: :func:`assignment`'s
    result) and the ranks ``all_gather`` the chunks, so the
    ranks finalize in parallel and each writes the others' rows. Shared ranges are all_reduced as states (in place
    in ``state``) and finalized on every rank. ``lse_out`` (``[B, H, N]`` fp32, for the backward): every rank also
    gets every row's log-sum-exp (gathered from the owner, or from the all_reduced state). ``device``: the GPU
    that NCCL's chunks travel through (default: the current device); ``budget``: its memory budget in bytes (the
    chunks shrink from :data:`MERGE_CHUNK_TOKENS` so that the device buffers, ``1 + size`` chunks of output rows,
    take at most half of it). ``delivered``: token ranges every rank has already (:class:`Delivery`), left out.
    Returns what travelled and how long it took."""
    import torch.distributed as dist

    dev = _wire(device)
    B, H, _, Dv = state.W.shape
    stats = {"merge": "owned ranges: all_gather of the owners' output rows (finalized by their owner, where their "
                      "query row ended or after the run); shared ranges: all_reduce of the states",
             "owned_tokens": 0, "shared_tokens": 0, "bytes": 0, "seconds": 0.0}
    per_token = B * H * (Dv * torch.empty(0, dtype=out_dtype).element_size() + (4 if lse_out is not None else 0))
    step = MERGE_CHUNK_TOKENS if budget is None or dev.type != "cuda" else max(
        1, min(MERGE_CHUNK_TOKENS, budget // (2 * (1 + size) * per_token)))
    chunks = lambda a0, b0: [(a, min(b0, a + step)) for a in range(a0, b0, step)]
    own: List[List[Tuple[int, int]]] = [[] for _ in range(size)]  # per rank: its owned chunks, in token order
    shared: List[Tuple[int, int, bool]] = []
    for a0, b0, mask in _minus(owners(plan, size, rank_of), delivered):
        holders = [r for r in range(size) if mask >> r & 1]
        if len(holders) == 1:
            own[holders[0]] += chunks(a0, b0)
            stats["owned_tokens"] += b0 - a0
        else:
            shared += [(a, b, bool(holders)) for a, b in chunks(a0, b0)]
            stats["shared_tokens"] += (b0 - a0) if holders else 0
    t0 = time.perf_counter()
    try:
        _gather_owned(own, rank, size, finalize, write, out_dtype, (B, H, Dv), lse_out, dev, stats)
        for a, b, any_holder in shared:
            if any_holder:
                m, S, W = (t[:, :, a:b].to(dev).contiguous() for t in state)
                gm = m.clone()
                dist.all_reduce(gm, op=dist.ReduceOp.MAX)
                f = torch.exp(m - torch.where(gm == float("-inf"), torch.zeros_like(gm), gm))
                S.mul_(f)
                W.mul_(f.unsqueeze(-1))
                dist.all_reduce(S, op=dist.ReduceOp.SUM)
                dist.all_reduce(W, op=dist.ReduceOp.SUM)
                for dst, src_t in zip(state, (gm, S, W)):
                    dst[:, :, a:b].copy_(src_t)
                stats["bytes"] += sum(t.numel() * t.element_size() for t in (gm, S, W))
            # (rows no task touched, none in a valid plan: the identity's zeros, locally)
            rows, lse_rows = finalize(a, b)
            write(a, b, rows)
            if lse_out is not None:
                lse_out[:, :, a:b] = lse_rows
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, timeouts)
        raise _error(rank, size, "merging the partial states", e) from e
    stats["seconds"] = time.perf_counter() - t0
    return stats


def _minus(ranges, cut: Sequence[Tuple[int, int]]):
    """``(a, b, mask)`` ranges without the tokens of the ranges ``cut``."""
    cut = sorted(cut)
    out = []
    for a0, b0, mask in ranges:
        a = a0
        for c0, c1 in cut:
            if c1 <= a or c0 >= b0:
                continue
            if c0 > a:
                out.append((a, c0, mask))
            a = max(a, c1)
        if a < b0:
            out.append((a, b0, mask))
    return out


def _gather_owned(own, rank, size, finalize, write, out_dtype, dims, lse_out, dev, stats) -> None:
    """The owned chunks' rows, step by step: each rank finalizes (or reads back) its ``step``-th chunk and writes it,
    and the ranks ``all_gather`` the chunks. Under NCCL the rows travel through pinned host buffers, two steps in
    flight: while the host writes one step's received rows, the GPU copies and gathers the next."""
    import torch.distributed as dist

    B, H, Dv = dims
    steps = max(map(len, own), default=0)
    width = max((b - a for lst in own for a, b in lst), default=0)
    if not steps:
        return
    cuda = dev.type == "cuda"
    host = [torch.empty((B, H, width, Dv), dtype=out_dtype, pin_memory=cuda) for _ in range(2)]
    if cuda:
        got = [torch.empty((size, B, H, width, Dv), dtype=out_dtype, pin_memory=True) for _ in range(2)]
        send_d = torch.empty((B, H, width, Dv), dtype=out_dtype, device=dev)
        recv_d = torch.empty((size, B, H, width, Dv), dtype=out_dtype, device=dev)
        done = [torch.cuda.Event(), torch.cuda.Event()]
    pending = None  # (buffer index, spans) of the step whose received rows are still to be written

    def write_received(slot, spans):
        for r, (a, b) in enumerate(spans):
            if r != rank and b > a:
                write(a, b, got[slot][r, :, :, :b - a] if cuda else recv_h[r][:, :, :b - a])

    for step in range(steps):
        spans = [lst[step] if step < len(lst) else (0, 0) for lst in own]
        mine = spans[rank]
        slot = step % 2
        send = host[slot]
        if mine[1] > mine[0]:
            local, lse_rows = finalize(*mine)
            write(*mine, local)  # (a no-op for rows the output holds already)
            send[:, :, :mine[1] - mine[0]].copy_(local)
        else:
            lse_rows = None
        if cuda:
            send_d.copy_(send, non_blocking=True)
            dist.all_gather_into_tensor(recv_d, send_d)  # (a list of outputs would add a flat copy on the device)
            got[slot].copy_(recv_d, non_blocking=True)
            done[slot].record()
        else:
            recv_h = [torch.empty_like(send) for _ in range(size)]
            dist.all_gather(recv_h, send)
        stats["bytes"] += send.numel() * send.element_size() * size
        if lse_out is not None:
            lsend = torch.zeros((B, H, width), dtype=torch.float32, device=dev)
            if lse_rows is not None:
                lsend[:, :, :mine[1] - mine[0]].copy_(lse_rows)
            lrecv = [torch.empty_like(lsend) for _ in range(size)]
            dist.all_gather(lrecv, lsend)
            stats["bytes"] += lsend.numel() * 4 * size
            for r, (a, b) in enumerate(spans):
                if b > a:
                    lse_out[:, :, a:b] = lse_rows if r == rank else lrecv[r][:, :, :b - a]
        if not cuda:
            write_received(slot, spans)
            continue
        if pending is not None:
            done[pending[0]].synchronize()
            write_received(*pending)
        pending = (slot, spans)
    if pending is not None:
        done[pending[0]].synchronize()
        write_received(*pending)


def _wire(device: Optional[torch.device]) -> torch.device:
    """Where collective buffers live: the compute GPU under NCCL (the current device when not given), the host
    under gloo."""
    if not _nccl():
        return torch.device("cpu")
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce_sum_(tensors, rank: int, size: int, chunk_tokens: int = MERGE_CHUNK_TOKENS,
                    device: Optional[torch.device] = None) -> None:
    """In-place SUM over the ranks of ``[B, H, N, ...]`` tensors, token chunk by token chunk (through the rank's GPU
    under NCCL): the backward's partial dQ, dK, dV."""
    import torch.distributed as dist

    dev = _wire(device)
    try:
        for t in tensors:
            for a in range(0, t.shape[2], chunk_tokens):
                b = min(t.shape[2], a + chunk_tokens)
                part = t[:, :, a:b]
                buf = part.to(dev).contiguous()
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                part.copy_(buf)
    except Exception as e:
        raise _error(rank, size, "summing the gradients", e) from e
