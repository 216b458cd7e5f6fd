"""Which (query token, key token) pairs each streaming task computes: the CQS divide and plain block tiles.

Pure index arithmetic (numpy only, no tensors), so that coverage is tested cheaply.

A :class:`Task` is a set of disjoint token ranges of the sequence (``segments``, sorted) and a relation between
them (``pairs[i, j]``: what query segment ``i`` computes against key segment ``j``): :data:`NONE`, :data:`FULL` (every
pair) or :data:`CAUSAL` (the causal triangle of one segment with itself, key ``<=`` query).

**CQS divide** (Stream-CQSA): cut a token list into ``c`` chunks, ``c = q² + q + 1`` with a Singer (planar)
difference set ``D`` of ``q + 1`` residues mod ``c``. Subsequence ``t`` holds chunks ``{(d + t) mod c : d ∈ D}``.
Every nonzero residue is a difference of ``D`` exactly once, so every pair of distinct chunks ``(a, b)`` meets in
exactly one subsequence. Chunk ``a`` meets itself in ``q + 1`` subsequences; **diagonal ownership** keeps the pair
``(a, a)`` only in subsequence ``t = (a - D[0]) mod c``. Applied to a task (``itr`` times, or to one task only:
**refinement**), the children split the task's token list and keep only pairs the parent computed (the
**inherited mask**); causality is decided by token positions, so it survives every level. Hence each pair is
computed exactly once at every depth.

**Blocks**: query block ``i`` × key block ``j`` tiles, query-major; under causality tiles above the diagonal are
skipped and diagonal tiles are causal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

NONE, FULL, CAUSAL = 0, 1, 2

#: the orders c = q² + q + 1 (q a prime power) this module builds Singer difference sets for
SINGER_ORDERS = (7, 13, 21, 31, 57, 73, 91)


@functools.lru_cache(maxsize=None)
def singer_set(c: int) -> Tuple[int, ...]:
    """A planar difference set mod ``c`` (size ``q + 1``, containing 0 and 1), by backtracking search.

    Every nonzero residue mod ``c`` is ``(x - y) mod c`` for exactly one ordered pair of members."""
    if c not in SINGER_ORDERS:
        raise ValueError(f"c={c} is not supported: the CQS divide needs c in {SINGER_ORDERS}")
    k = next(q + 1 for q in range(2, 10) if q * q + q + 1 == c)

    def extend(members, used):
        if len(members) == k:
            return members
        for x in range(members[-1] + 1, c):
            new = set()
            for y in members:
                d1, d2 = (x - y) % c, (y - x) % c
                if d1 in used or d2 in used or d1 in new or d1 == d2:
                    break
                new.update((d1, d2))
            else:
                found = extend(members + [x], used | new)
                if found:
                    return found
        return None

    return tuple(extend([0, 1], {1, c - 1}))


@dataclass(frozen=True)
class Task:
    """``tid``: a stable id (``"cqs:3.5"``: subsequence 5 of subsequence 3; ``"blk:2.0"``: tile (2, 0);
    a refined child appends ``"/r<t>"``). ``segments``: sorted disjoint ``(start, stop)`` token ranges.
    ``pairs``: int8 ``[n_seg, n_seg]``, query segment × key segment, values NONE / FULL / CAUSAL."""

    tid: str
    segments: Tuple[Tuple[int, int], ...]
    pairs: np.ndarray

    def query_segments(self) -> List[int]:
        return [i for i in range(len(self.segments)) if self.pairs[i].any()]

    def key_segments(self) -> List[int]:
        return [j for j in range(len(self.segments)) if self.pairs[:, j].any()]

    def tokens(self, which: Sequence[int]) -> int:
        return sum(self.segments[i][1] - self.segments[i][0] for i in which)

    @property
    def q_tokens(self) -> int:
        return self.tokens(self.query_segments())

    @property
    def k_tokens(self) -> int:
        return self.tokens(self.key_segments())

    def key_runs(self, i: int) -> List[Tuple[int, int]]:
        """Query segment ``i``'s FULL key segments as runs ``(x, y)`` of consecutive positions in
        :meth:`key_segments` (so each run is one contiguous slice of the task's gathered keys)."""
        runs: List[Tuple[int, int]] = []
        for x, j in enumerate(self.key_segments()):
            if self.pairs[i, j] == FULL:
                if runs and runs[-1][1] == x:
                    runs[-1] = (runs[-1][0], x + 1)
                else:
                    runs.append((x, x + 1))
        return runs

    def pair_count(self) -> int:
        """How many (query token, key token) pairs the task computes."""
        n = np.array([b - a for a, b in self.segments], dtype=np.int64)
        full = (self.pairs == FULL) * np.outer(n, n)
        tri = np.where(np.diag(self.pairs) == CAUSAL, n * (n + 1) // 2, 0)
        return int(full.sum() + tri.sum())


def _position_relation(seg_q, seg_k, causal: bool) -> int:
    """What a query segment computes against a key segment with the original positions alone."""
    if not causal:
        return FULL
    if seg_q == seg_k:
        return CAUSAL
    return FULL if seg_k[1] <= seg_q[0] else NONE


def whole(n: int, causal: bool) -> Task:
    """The whole sequence as one task."""
    return Task("cqs", ((0, n),), np.array([[CAUSAL if causal else FULL]], dtype=np.int8))


def divide(task: Task, c: int, causal: bool, sep: str = ".") -> List[Task]:
    """The CQS divide of ``task`` into ``c`` children (those that compute nothing are dropped).

    The task's token list (its segments in order) is cut into ``c`` chunks of near-equal length; each child holds
    the chunks of one subsequence, split at parent segment and chunk boundaries."""
    D = singer_set(c)
    lengths = [b - a for a, b in task.segments]
    total = sum(lengths)
    cuts = [total * i // c for i in range(c + 1)]  # chunk i = positions cuts[i]:cuts[i+1] of the token list
    # pieces: (chunk, parent segment index, (start, stop) in the sequence)
    pieces = []
    offset = 0
    for si, (a, b) in enumerate(task.segments):
        lo, hi = offset, offset + (b - a)
        for ch in range(c):
            s, e = max(lo, cuts[ch]), min(hi, cuts[ch + 1])
            if s < e:
                pieces.append((ch, si, (a + s - lo, a + e - lo)))
        offset = hi
    by_chunk: List[list] = [[] for _ in range(c)]
    for p in pieces:
        by_chunk[p[0]].append(p)
    children = []
    for t in range(c):
        chunks = sorted((d + t) % c for d in D)
        mine = sorted((p for ch in chunks for p in by_chunk[ch]), key=lambda p: p[2])
        n = len(mine)
        pairs = np.zeros((n, n), dtype=np.int8)
        for i, (ci, si, gi) in enumerate(mine):
            for j, (cj, sj, gj) in enumerate(mine):
                if ci == cj and (ci - D[0]) % c != t:
                    continue  # a diagonal chunk pair owned by another subsequence
                if task.pairs[si, sj] == NONE:
                    continue  # the inherited mask
                pairs[i, j] = _position_relation(gi, gj, causal)
        if pairs.any():
            children.append(Task(f"{task.tid}{sep}{t}", tuple(p[2] for p in mine), pairs))
    return children


def cqs_tasks(n: int, c: int, itr: int, causal: bool) -> List[Task]:
    """The CQS divide applied ``itr`` times to the whole sequence of ``n`` tokens."""
    if itr < 1:
        raise ValueError(f"itr={itr}: the CQS divide needs itr >= 1")
    tasks = [whole(n, causal)]
    for _ in range(itr):
        tasks = [child for t in tasks for child in divide(t, c, causal)]
    return tasks


def refine(task: Task, c: int, causal: bool) -> List[Task]:
    """Hybrid refinement: one task divided again (an OOM guardrail step), ids ``<tid>/r<t>``."""
    return divide(task, c, causal, sep="/r")


def block_tasks(n: int, block_q: int, block_k: int, causal: bool) -> List[Task]:
    """Query-block × key-block tiles, query-major (consecutive tiles share their queries)."""
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    tasks = []
    for i, qa in enumerate(range(0, n, block_q)):
        qs = (qa, min(n, qa + block_q))
        for j, ka in enumerate(range(0, n, block_k)):
            ks = (ka, min(n, ka + block_k))
            if causal and ks[0] >= qs[1]:
                break
            if ks == qs:
                tasks.append(Task(f"blk:{i}.{j}", (qs,), np.array([[CAUSAL if causal else FULL]], dtype=np.int8)))
                continue
            # tokens of both ranges, split where they overlap, so that causality is a per-segment relation
            bounds = sorted({qs[0], qs[1], ks[0], ks[1]})
            segs = tuple((a, b) for a, b in zip(bounds, bounds[1:])
                         if (qs[0] <= a and b <= qs[1]) or (ks[0] <= a and b <= ks[1]))
            pairs = np.zeros((len(segs), len(segs)), dtype=np.int8)
            for x, sq in enumerate(segs):
                for y, sk in enumerate(segs):
                    if qs[0] <= sq[0] and sq[1] <= qs[1] and ks[0] <= sk[0] and sk[1] <= ks[1]:
                        pairs[x, y] = _position_relation(sq, sk, causal)
            if pairs.any():
                tasks.append(Task(f"blk:{i}.{j}", segs, pairs))
    return tasks


def pair_counts(tasks: Sequence[Task], n: int) -> np.ndarray:
    """``[n, n]`` int: how many tasks compute each (query, key) token pair (the coverage check; small n)."""
    count = np.zeros((n, n), dtype=np.int64)
    for t in tasks:
        for i, j in zip(*np.nonzero(t.pairs)):
            (qa, qb), (ka, kb) = t.segments[i], t.segments[j]
            if t.pairs[i, j] == CAUSAL:
                count[qa:qb, ka:kb] += np.tril(np.ones((qb - qa, kb - ka), dtype=np.int64))
            else:
                count[qa:qb, ka:kb] += 1
    return count
