"""Sharding tasks over ``torch.distributed`` ranks and merging their partial states (torch.distributed only).

Each rank runs a contiguous share of the task list (balanced by FLOPs, so the query-major blocks order keeps its
locality) into its own full-sequence accumulator, whose rows are the identity where the rank computed nothing.
The partial states then merge exactly like the monoid, token chunk by token chunk:
``m* = all_reduce(m, MAX)``; ``S ← S·e^(m − m*)``, ``W ← W·e^(m − m*)``; ``all_reduce(S, SUM)``,
``all_reduce(W, SUM)``; ``m ← m*`` — every rank ends with the full result. NCCL needs device tensors: chunks travel
through the rank's GPU; gloo reduces host tensors. A rank that died, or never reaches the collective, surfaces as
the process group's timeout error (``init_process_group(timeout=...)``), re-raised naming this rank.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import monoid
from .planner import Plan, task_flops

MERGE_CHUNK_TOKENS = 1 << 16


def world() -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` when a process group with more than one rank is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def shard(plan: Plan, rank: int, size: int) -> List[int]:
    """Task indices of ``rank``: a contiguous run of the task list holding ~1/size of its FLOPs."""
    costs = [task_flops(plan.shape, t) for t in plan.tasks]
    total = sum(costs) or 1.0
    mine, acc = [], 0.0
    for i, c in enumerate(costs):
        mid = (acc + c / 2) / total  # a task belongs to the rank whose share holds its midpoint
        if min(int(mid * size), size - 1) == rank:
            mine.append(i)
        acc += c
    return mine


def all_finished(finished: bool, rank: int, size: int) -> bool:
    """Whether every rank finished its share (a slice run stops all ranks together: no rank waits in the merge
    for one that stopped)."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if finished else 0], dtype=torch.int32, device=dev)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    except Exception as e:
        raise _merge_error(rank, size, e) from e
    return bool(flag.item())


def _merge_error(rank: int, size: int, e: Exception) -> RuntimeError:
    return RuntimeError(f"stream.attention: rank {rank} of {size}: merging the partial states failed — another "
                        f"rank died or did not reach the collective within the process group's timeout "
                        f"({type(e).__name__}: {e})")


def merge_states(state: monoid.State, rank: int, size: int) -> None:
    """All ranks' partial states merged in place into every rank's ``state`` (``[B, H, N]`` / ``[B, H, N, Dv]``)."""
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else state.m.device
    n = state.m.shape[-1]
    try:
        for a in range(0, n, MERGE_CHUNK_TOKENS):
            b = min(n, a + MERGE_CHUNK_TOKENS)
            m, S, W = (t[:, :, a:b].to(dev).contiguous() for t in state)
            gm = m.clone()
            dist.all_reduce(gm, op=dist.ReduceOp.MAX)
            f = torch.exp(m - torch.where(gm == float("-inf"), torch.zeros_like(gm), gm))
            S.mul_(f)
            W.mul_(f.unsqueeze(-1))
            dist.all_reduce(S, op=dist.ReduceOp.SUM)
            dist.all_reduce(W, op=dist.ReduceOp.SUM)
            for dst, src in zip(state, (gm, S, W)):
                dst[:, :, a:b].copy_(src)
    except Exception as e:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, timeouts)
        raise _merge_error(rank, size, e) from e

