"""``elsa_surgery.stream.attention``: exact attention over sequences whose Q/K/V/O do not fit on the GPU."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from .. import monoid
from . import distributed, planner
from .checkpoint import Checkpoint, fingerprint
from .executor import Accumulators, Executor
from .sources import Source

logger = logging.getLogger("elsa_surgery.stream")
SCHEDULES = ("cqs", "blocks", "auto")
FINALIZE_CHUNK_TOKENS = 1 << 16


@dataclass
class StreamReport:
    """What the last call did (``elsa_surgery.stream.last_report()``)."""

    schedule: str = ""
    settings: Dict = field(default_factory=dict)
    n_cap: int = 0
    budget: Optional[int] = None
    predicted_peak: int = 0
    measured_peak: Optional[int] = None
    calibrated: bool = False
    overhead: int = 0
    auto: Dict = field(default_factory=dict)
    events: List[str] = field(default_factory=list)
    tasks_run: int = 0
    tasks_total: int = 0
    task_tokens: int = 0  # the largest task's query tokens
    resumed: int = 0
    finished: bool = False
    seconds: float = 0.0
    tflops: float = 0.0
    rank: int = 0
    world: int = 1
    # several ranks: seconds waiting for the others to finish their shares, and the merge's traffic and seconds
    # (distributed.merge_finalize): {"wait_seconds", "merge", "owned_tokens", "shared_tokens", "bytes", "seconds"}
    comm: Dict = field(default_factory=dict)
    plan_flops: float = 0.0  # every task's FLOPs, all ranks together (aggregate throughput: plan_flops / wall time)
    backward: Dict = field(default_factory=dict)  # after a backward: {"backward_tasks", "backward_seconds"}
    # output rows (tokens) finalized where their query group ended (on the device, for states pending there), not
    # after the run from the accumulator
    rows_finalized_early: int = 0


_last = StreamReport()


def last_report() -> StreamReport:
    return _last


def _check_inputs(q: Source, k: Source, v: Source, out):
    B, Hq, N, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k, v: batch {k.shape[0]}, {v.shape[0]} must equal q's batch {B}")
    if k.shape[2] != N or v.shape[2] != N:
        raise ValueError(f"k, v: sequence length {k.shape[2]}, {v.shape[2]} must equal q's N={N} "
                         "(stream.attention streams self-attention over one sequence)")
    if k.shape[3] != D:
        raise ValueError(f"k: head dim {k.shape[3]} must equal q's D={D}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v: {v.shape[1]} heads must equal k's {k.shape[1]}")
    if Hq % k.shape[1]:
        raise ValueError(f"q: {Hq} heads must be a multiple of k's {k.shape[1]} (GQA)")
    for s in (q, k, v):
        if not s.dtype.is_floating_point:
            raise TypeError(f"{s.name}: dtype {s.dtype} is not a floating type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    want = (B, Hq, N, v.shape[3])
    if out is not None:
        if tuple(out.shape) != want:
            raise ValueError(f"out: shape {tuple(out.shape)} must be {want}")
        if isinstance(out, np.ndarray):
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out: a numpy array / memmap must be C-contiguous and writable")
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or a numpy array/memmap, got {type(out).__name__}")
    return want


def _compute_device(sources, device) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    for s in sources:
        if s.device.type == "cuda":
            return s.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _plan(shape, schedule, causal, budget, device, *, itr, n_cap, c, block, overhead=0):
    kw = dict(itr=itr, n_cap=n_cap, c=c, block=block, overhead=overhead)
    if schedule != "auto":
        return planner.make_plan(shape, schedule, causal, budget, **kw), {}
    plans, errors = {}, {}
    for s in ("cqs", "blocks"):
        try:
            plans[s] = planner.make_plan(shape, s, causal, budget, **kw)
        except ValueError as e:
            errors[s] = str(e)
    if not plans:
        raise ValueError(" / ".join(errors.values()))
    secs = {s: planner.predicted_seconds(p, device.type) for s, p in plans.items()}
    pick = min(secs, key=secs.get)
    return plans[pick], {"predicted_seconds": secs, "picked": pick, "refused": errors}


def _output(out, shape_out, qs):
    """``(out, a torch view of it, its torch dtype)``; a new CPU (or, for CUDA inputs, CUDA) tensor when None."""
    if out is None:
        out = torch.empty(shape_out, dtype=qs.dtype, device=qs.device if qs.kind == "tensor" else "cpu")
    out_t = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    return out, out_t, out_t.dtype


def _final_rows(rng, st: monoid.State, out_t: torch.Tensor, dtype, lse, written) -> None:
    """Rows ``rng`` whose state ``st`` is complete: finalized where ``st`` is (the device, for a group pending
    there), in chunks of at most an eighth of the rows (the finalize's temporaries, about three chunk-sized fp32
    tensors, stay under half of ``st``: within the plan's merge peak, which holds two more states), written to the
    output (and their log-sum-exp to ``lse``)."""
    a0, b0 = rng
    step = max(1, min(FINALIZE_CHUNK_TOKENS, (b0 - a0) // 8))
    for a in range(a0, b0, step):
        b = min(b0, a + step)
        part = monoid.State(*(t[:, :, a - a0:b - a0] for t in st))
        y, lse_rows = monoid.finalize(part, dtype)
        out_t[:, :, a:b].copy_(y)
        if lse is not None:
            lse[:, :, a:b].copy_(lse_rows)
    written[a0:b0] = True


def _delivery(plan, rank_of, rank, size, acc, out_t, lse, exclusive):
    """A :class:`distributed.Delivery` of the exclusive query groups' rows when every rank can take one (host
    accumulator, output and lse on the host and contiguous), else None (the merge after the run gathers them)."""
    segments = []
    for g in distributed.groups(plan):
        key = Executor._qkey(plan.tasks[g[0]])
        if key in exclusive:
            segments += [(a, b, rank_of[g[0]]) for a, b in key if b > a]
    ok = (bool(segments) and acc.device.type == "cpu" and out_t.device.type == "cpu" and out_t.is_contiguous()
          and (lse is None or lse.is_contiguous())
          and distributed.Delivery.fits(len(segments), out_t.shape[0], out_t.shape[1], lse is not None))
    if distributed.agree(1.0 if ok else 0.0, "min", rank, size) != 1.0:
        return None
    return distributed.Delivery(sorted(segments), rank, size, out_t, lse)


def _runs(mask: np.ndarray, a: int, b: int):
    """The maximal ``[x0, x1)`` within ``[a, b)`` where ``mask`` is True."""
    m = np.concatenate(([False], mask[a:b], [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(a + int(x0), a + int(x1)) for x0, x1 in zip(edges[::2], edges[1::2])]


def _exclusive_groups(plan) -> Dict[tuple, int]:
    """Query key -> task count of the query groups (runs of tasks with the same query ranges) whose rows no other
    group touches: once such a group's tasks have run, its rows are final (the blocks schedule's query rows; CQS
    subsequences share chunks, so none there)."""
    gs = distributed.groups(plan)
    keys = [Executor._qkey(plan.tasks[g[0]]) for g in gs]
    points = sorted({p for key in keys for a, b in key for p in (a, b)})
    at = {p: i for i, p in enumerate(points)}
    diff = np.zeros(len(points) + 1, dtype=np.int64)
    for key in keys:  # a group's own ranges are disjoint: the count is of groups
        for a, b in key:
            diff[at[a]] += 1
            diff[at[b]] -= 1
    cover = np.cumsum(diff)
    shared = {gi for gi, key in enumerate(keys) if any(cover[at[a]:at[b]].max() > 1 for a, b in key if b > a)}
    totals: Dict[tuple, int] = {}
    for gi, (g, key) in enumerate(zip(gs, keys)):
        if gi not in shared:
            totals[key] = totals.get(key, 0) + len(g)
    return totals


def _calibrate(plan, shape, schedule, causal, budget, device, q, k, v, scale, backend, fixed, ranks):
    """Run a largest task once on the GPU; its measured peak minus the model's becomes the plan's overhead (under
    several ranks each rank runs a different largest task, :func:`distributed.calibration_tasks`, and the plan takes
    the largest overhead any rank measured, so that every rank makes the same plan). Returns the new plan, the
    task's results (states moved to the host) and every rank's calibration task: the run reuses the results when
    the new plan holds the same task (its group is then pinned to this rank), instead of computing it twice (a
    largest task is ~1/30 of a blocks run at 8M tokens; one rank's wasted calibration was ~3 % of a 2-rank run)."""
    if device.type != "cuda" or not plan.tasks:
        plan.notes.append("calibration skipped: no device memory to measure on " + device.type)
        return plan, None, []
    rank, size = ranks or (0, 1)
    calibrated_on = [plan.tasks[i] for i in distributed.calibration_tasks(plan, size)]
    big = calibrated_on[rank]
    ex = Executor(plan, q, k, v, scale=scale, device=device, backend=backend, progress=False, budget=budget)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    data = ex._load(big)
    results = ex._compute(big, data)
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    del data
    kept = (big, [(rng, monoid.State(*(t.cpu() for t in st))) for rng, st in results])
    del results
    predicted = shape.input_bytes(big.q_tokens, big.k_tokens) + shape.state_bytes(big.q_tokens)
    overhead = max(0, measured - predicted)
    if ranks is not None:
        overhead = int(distributed.agree(overhead, "max", *ranks))
    new, _ = _plan(shape, schedule if schedule != "auto" else plan.schedule, causal, budget, device,
                   overhead=overhead, **fixed)
    new.calibrated, new.overhead, new.calibration_peak = True, overhead, measured
    new.notes.append(f"calibrated on {big.tid}: measured {measured} B, model {predicted} B, overhead {overhead} B")
    return new, kept, calibrated_on


def attention(q, k, v, *, is_causal: bool = False, scale: Optional[float] = None, memory_budget=None,
              schedule: str = "cqs", itr: Optional[int] = None, n_cap: Optional[int] = None, out=None,
              checkpoint_dir=None, progress: bool = True, c: Optional[int] = None, block: Optional[int] = None,
              device=None, backend: str = "auto", calibrate: bool = True, checkpoint_every: float = 60.0,
              max_tasks: Optional[int] = None, max_seconds: Optional[float] = None, _grad: Optional[Dict] = None):
    """Exact softmax attention of ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]``, ``v [B, Hkv, N, Dv]`` streamed
    through the compute device as independent tasks whose ``(m, S, W)`` states merge with the ELSA monoid.

    Inputs may be CPU (ideally pinned) or CUDA tensors, C-contiguous numpy arrays / memmaps or safetensors slices;
    ``out`` (default: a new CPU tensor of q's dtype) may be a numpy memmap. ``is_causal`` is SDPA's (N is shared).
    ``memory_budget``: bytes, or a float fraction of free device memory (None: 90 % of free GPU memory, no limit
    on CPU). ``schedule``: ``"cqs"`` (CQS divide, ``c`` in divide.SINGER_ORDERS, ``itr`` levels), ``"blocks"``
    (``block`` × ``block`` tiles) or ``"auto"`` (the smaller predicted time of the planner's cost model).
    ``itr`` / ``n_cap`` / ``c`` / ``block``: fix what the planner would choose. ``checkpoint_dir``: resumable
    run (saved every ``checkpoint_every`` seconds at a task boundary, and at the end of a slice); ``max_tasks`` /
    ``max_seconds`` stop after a slice of work (needs ``checkpoint_dir``) and return None when unfinished.
    ``device`` / ``backend``: where and with what tasks run (default: the inputs' GPU, else CUDA if present,
    else CPU with the reference backend). Under ``torch.distributed`` tasks are sharded over the ranks and every
    rank returns the full output. Autograd: when q, k or v (torch tensors) require grad, the result is an autograd
    node whose backward streams the tasks again and accumulates dQ, dK, dV per task (under several ranks each rank
    its share, then summed; not with ``out``, checkpoints or slices). See docs/stream.md.
    """
    global _last
    t0 = time.perf_counter()
    tensors = [x for x in (q, k, v) if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        if len(tensors) != 3:
            raise TypeError("stream.attention: autograd needs q, k and v as torch tensors (numpy memmaps and "
                            "safetensors slices carry no gradient)")
        if out is not None:
            raise ValueError("out: not supported when q, k or v require grad (the output is an autograd node); "
                             "pass out=None")
        if checkpoint_dir is not None or max_tasks is not None or max_seconds is not None:
            raise ValueError("checkpoint_dir / max_tasks / max_seconds: not supported when q, k or v require grad "
                             "(a run stopped in slices returns no autograd graph); run under torch.no_grad()")
        from .backward import StreamAttention

        return StreamAttention.apply(q, k, v, dict(
            is_causal=is_causal, scale=scale, memory_budget=memory_budget, schedule=schedule, itr=itr, n_cap=n_cap,
            progress=progress, c=c, block=block, device=device, backend=backend, calibrate=calibrate))
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
    for name, val, lo in (("itr", itr, 1), ("n_cap", n_cap, 1), ("block", block, 1)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
            raise ValueError(f"{name}={val!r}: expected an int >= {lo} or None")
    if (max_tasks is not None or max_seconds is not None) and checkpoint_dir is None:
        raise ValueError("max_tasks / max_seconds stop a run part-way: they need checkpoint_dir to keep the progress")
    qs, ks, vs = Source(q, "q"), Source(k, "k"), Source(v, "v")
    shape_out = _check_inputs(qs, ks, vs, out)
    if c is not None:
        from .divide import SINGER_ORDERS
        if c not in SINGER_ORDERS:
            raise ValueError(f"c={c}: the CQS divide needs c in {SINGER_ORDERS}")
    B, Hq, N, D = qs.shape
    scale = D ** -0.5 if scale is None else float(scale)
    dev = _compute_device((qs, ks, vs), device)
    budget = planner.resolve_budget(memory_budget, dev)
    shape = planner.Shape(B, Hq, ks.shape[1], N, D, vs.shape[3], qs.dtype.itemsize)
    ranks = distributed.world()
    rank, size = ranks or (0, 1)
    if ranks is not None and torch.get_num_threads() == 1 and (os.cpu_count() or 1) >= 2 * size:
        logger.warning("elsa_surgery.stream: rank %d runs torch's CPU ops (token gathers, finalize) on 1 thread "
                       "(torchrun sets OMP_NUM_THREADS=1 unless it is set); set OMP_NUM_THREADS to about "
                       "cores / ranks (%d here) for host-resident inputs", rank, (os.cpu_count() or 1) // size)
    if ranks is not None:  # one plan on every rank: the smallest budget (a fraction of free memory differs by rank)
        agreed = distributed.agree(budget, "min", rank, size)
        budget = None if agreed is None else int(agreed)
        # the ranks' collectives must match one for one: all record the graph for a backward, or none does
        if not distributed.same(_grad is not None, rank, size):
            raise RuntimeError(f"stream.attention: rank {rank} of {size}: some ranks call it with inputs that "
                               "require grad and others without; every rank must make the same call")

    ckpt = resume = None
    fixed = dict(itr=itr, n_cap=n_cap, c=c, block=block)
    if checkpoint_dir is not None:
        settings = {"causal": bool(is_causal), "scale": scale, "schedule": schedule,
                    "memory_budget": memory_budget,  # as given: None / a fraction resolve differently each run
                    "rank": rank, "world": size, **fixed}
        sub = checkpoint_dir if ranks is None else f"{checkpoint_dir}/rank{rank}-of-{size}"
        ckpt = Checkpoint(sub, fingerprint((qs, ks, vs), settings))
        resume = ckpt.load()
        p = None if resume is None else resume[0]
        if ranks is not None:
            # a rank that died before its first save has no checkpoint while the others do: every rank takes the
            # plan of the first run (from a rank that has one) and skips calibration, or none does
            p = distributed.first_plan_settings(p, rank, size)
        if p is not None:  # the plan of the first slice, not a new one (bit-identical output)
            fixed = dict(itr=p["itr"], n_cap=n_cap, c=p["c"], block=p["block"])
            # the same accumulator placement too: device and host arithmetic may round differently
            plan = planner.make_plan(shape, p["schedule"], bool(is_causal), budget, acc_on_device=p["acc_on_device"],
                                     **fixed)
            auto = {}
    kept, pins = None, {}
    if checkpoint_dir is None or p is None:
        plan, auto = _plan(shape, schedule, bool(is_causal), budget, dev, **fixed)
        if calibrate:
            plan, kept, calibrated_on = _calibrate(plan, shape, schedule, bool(is_causal), budget, dev, qs, ks, vs,
                                                   scale, backend, fixed, ranks)
            # each rank's calibrated task, where the final plan holds it: pinned to that rank (its results are reused
            # instead of computed again), and this rank's as (task, results, index in the final plan). Not with
            # checkpoints: a resumed run does not calibrate, so it could not pin alike, and its ranks' finished
            # tasks must be dealt as before (a task dealt elsewhere would be computed twice)
            where = {(t.tid, t.segments): i for i, t in enumerate(plan.tasks)}
            at = [where.get((t.tid, t.segments)) for t in calibrated_on]
            at = [i if i is not None and np.array_equal(plan.tasks[i].pairs, t.pairs) else None
                  for i, t in zip(at, calibrated_on)]
            if checkpoint_dir is None:
                for r, i in enumerate(at):
                    if i is not None:
                        pins.setdefault(i, r)
            if kept is not None:
                kept = (*kept, at[rank]) if at and at[rank] is not None else None
    for note in plan.notes:
        logger.info("elsa_surgery.stream: %s", note)

    # once: the shard and the merge's owners
    rank_of = None if ranks is None else distributed.assignment(plan, size, pins)
    order = list(range(len(plan.tasks))) if ranks is None else [i for i, r in enumerate(rank_of) if r == rank]
    if dev.type == "cuda":  # the measured peak counts everything the run allocates, the device accumulator too
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    acc = Accumulators(B, Hq, N, vs.shape[3], dev if plan.acc_on_device else "cpu")
    done: List[str] = []
    resumed = 0
    if resume is not None and resume[1]:
        done, resumed = list(resume[1]), len(resume[1])
        for dst, src in zip(acc.state, resume[2]):
            dst.copy_(src)
    finished_ids = set(done)
    order = [i for i in order if plan.tasks[i].tid not in finished_ids]

    ex = Executor(plan, qs, ks, vs, scale=scale, device=dev, backend=backend, progress=progress and rank == 0,
                  budget=budget)
    if kept is not None and rank_of is not None and rank_of[kept[2]] != rank:
        kept = None  # its group went to another rank (two ranks calibrated in one group)
    if kept is not None and kept[2] in order:  # the calibrated task, if this rank runs it: its results, not a rerun
        ex.precomputed[kept[2]] = kept[1]
    kept = None
    # backward.StreamAttention: each row's final log-sum-exp (from the finalize) and the plan; on the device only
    # after the run (the plan's peak does not count it)
    host_acc = acc.device.type == "cpu"
    lse = torch.empty(acc.state.m.shape, dtype=torch.float32) if _grad is not None and host_acc else None
    written = np.zeros(N, dtype=bool)  # output rows written already (finalized when their group finished)
    out_t = None
    delivery = None
    # rows finalized where their group ends (and delivered to the other ranks) need the output before the run: only
    # for a whole run (no slices) with a host accumulator (states pending on the device) and a host output
    host_out = (isinstance(out, np.ndarray) or out.device.type == "cpu") if out is not None else not (
        qs.kind == "tensor" and qs.device.type == "cuda")
    if max_tasks is None and max_seconds is None and host_acc and host_out:
        out, out_t, dtype = _output(out, shape_out, qs)
        ex.group_total = _exclusive_groups(plan)
        if ranks is not None:
            delivery = _delivery(plan, rank_of, rank, size, acc, out_t, lse, ex.group_total)

        def on_final(rng, st):
            _final_rows(rng, st, out_t, dtype, lse, written)
            if delivery is not None and delivery.owns(*rng):
                delivery.send(*rng)

        ex.on_final = on_final
        for t in plan.tasks:  # (resumed tasks count toward their group's end)
            if t.tid in finished_ids:
                ex.group_done[Executor._qkey(t)] += 1
        ex.keep_final = ckpt is not None
    last_save = [time.perf_counter()]

    def on_task_done(index: int, flushed: bool) -> None:
        done.append(plan.tasks[index].tid)
        if ckpt is not None and flushed and time.perf_counter() - last_save[0] >= checkpoint_every:
            ckpt.save(plan.settings(), done, acc.state)
            last_save[0] = time.perf_counter()

    deadline = None if max_seconds is None else time.time() + max_seconds
    complete = ex.run(order, acc, on_task_done=on_task_done, max_tasks=max_tasks, deadline=deadline)
    # the call's peak: the run's, or the calibration run's where that was higher (a task reused from the calibration
    # is not computed again)
    measured = max(torch.cuda.max_memory_allocated(dev) - base, plan.calibration_peak) if dev.type == "cuda" else None
    if ckpt is not None:  # before waiting for the other ranks: this rank's share survives their failure
        ckpt.save(plan.settings(), done, acc.state)
    comm: Dict = {}
    if ranks is not None:
        t_wait = time.perf_counter()
        complete = distributed.all_finished(complete, rank, size)
        comm["wait_seconds"] = time.perf_counter() - t_wait
    secs = time.perf_counter() - t0
    _last = StreamReport(plan.schedule, plan.settings(), ex.n_cap, budget, plan.predicted_peak if plan.tasks else 0,
                         measured, plan.calibrated, plan.overhead, auto, ex.events, ex.tasks_run, len(plan.tasks),
                         max((t.q_tokens for t in plan.tasks), default=0),
                         resumed, complete, secs, ex.flops / max(secs, 1e-9) / 1e12, rank,
                         size, comm, sum(planner.task_flops(shape, t) for t in plan.tasks),
                         rows_finalized_early=int(written.sum()))
    if not complete:
        logger.info("elsa_surgery.stream: stopped after a slice; %d of %d tasks done, resume from %s", len(done),
                    len(order) + resumed, checkpoint_dir)
        return None
    if out_t is None:
        out, out_t, dtype = _output(out, shape_out, qs)
    if _grad is not None and lse is None:
        lse = torch.empty(acc.state.m.shape, dtype=torch.float32, device=acc.device)

    def rows(a: int, b: int):
        """Output rows ``[a, b)`` in ``dtype`` and their log-sum-exp (rows written already: read back from ``out``).
        The others are finalized where the accumulator is (one process and every rank of several alike). A host
        accumulator's rows stay on the host: copying the fp32 state to the GPU to divide there was slower (8M
        tokens, H=8, 2x H200 host: 9.5 s against 7.3 s on the host's cores)."""
        if written[a:b].all():
            return out_t[:, :, a:b], (None if lse is None else lse[:, :, a:b])
        y, lse_rows = monoid.finalize(acc.view(a, b))
        y = y.to(dtype)
        for x0, x1 in _runs(written, a, b):  # rows finalized earlier (their accumulator rows may be left empty)
            y[:, :, x0 - a:x1 - a] = out_t[:, :, x0:x1]
            if lse is not None:
                lse_rows[:, :, x0 - a:x1 - a] = lse[:, :, x0:x1]
        return y, lse_rows

    def write(a: int, b: int, y: torch.Tensor) -> None:
        dst = out_t[:, :, a:b]
        if y.device == dst.device and y.data_ptr() == dst.data_ptr() and y.stride() == dst.stride():
            return  # the rows read back from out by rows()
        dst.copy_(y)

    if ranks is not None:
        delivered = []
        if delivery is not None:
            def write_rows(a: int, b: int) -> None:  # a segment not finalized during the run
                y, lse_rows = rows(a, b)
                write(a, b, y)
                if lse is not None:
                    lse[:, :, a:b] = lse_rows

            comm["delivery"] = delivery.finish(write_rows)
            delivered = [(a, b) for a, b, _ in delivery.segments]
        comm.update(distributed.merge_finalize(acc.state, plan, rank_of, rank, size, rows, write, dtype,
                                               lse_out=lse, device=dev, budget=budget, delivered=delivered))
    else:
        for a in range(0, N, FINALIZE_CHUNK_TOKENS):
            b = min(N, a + FINALIZE_CHUNK_TOKENS)
            if written[a:b].all():
                continue
            y, lse_rows = rows(a, b)
            write(a, b, y)
            if lse is not None:
                lse[:, :, a:b] = lse_rows
    if _grad is not None:
        _grad.update(lse=lse, plan=plan, device=dev, budget=budget)
    return out
