"""Launch code: allocate outputs, pick tiles and partitions, run phase 1 and (if split) phase 2.

Plain functions on tensors (no torch.library here: ops.py wraps these). Inputs are never copied:
strides go to the kernels as they are. Sizes are runtime arguments of the kernels, so a new sequence
length reuses the compiled kernel. No host syncs: nothing here reads tensor data.

A call goes through three named steps (``_plan_run``): allocate the outputs (``_outputs``), plan
(:func:`plan_launch`: a pure function from the call's :class:`CallSignature` — shapes, dtypes, the strides and
alignment it reads, settings — to a :class:`LaunchPlan`: dot kind, tiles, partitions, staging; cached by the
signature in :func:`cached_plan` while the ``ELSA_*`` knobs it read keep their values), and execute the plan
(:func:`execute`). On top of that, ``_run`` records the whole launch sequence of a call signature and replays it
(kernels/replay.py, ``ELSA_LAUNCH_PLANS``), which skips the planning and Triton's launch path altogether.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import knobs
from . import occupancy as occ
from . import replay

log = logging.getLogger("elsa_surgery.kernels")

LOG2E = 1.4426950408889634


def _scan():
    from . import scan  # imported on first launch, after TRITON_INTERPRET has been decided

    return scan


def default_precision(device: torch.device) -> str:
    """What ``precision=None`` means for fp32 at every layer (this launcher, the custom ops, and
    ``elsa_surgery.attention`` through its dispatch, which reads this rule): ``precise`` (3xTF32) where the tensor
    cores do TF32 (CUDA sm80+), ``strict`` (IEEE fp32) elsewhere, the CPU interpreter included."""
    if device.type == "cuda" and occ.capability(occ._cuda_index(device))[0] >= 8:
        return "precise"
    return "strict"


def _dot_kind(dtype: torch.dtype, precision: Optional[str], device: torch.device) -> int:
    if dtype == torch.bfloat16 and occ.interpreting():
        return occ.DOT_INTERP_BF16
    if dtype in (torch.float16, torch.bfloat16):
        return occ.DOT_LOWP
    if dtype == torch.float32:
        return occ.DOT_OF_PRECISION[precision or default_precision(device)]
    raise TypeError(f"the ELSA kernels take float16, bfloat16 or float32 tensors, got {dtype}")


def _mask_arg(mask: Optional[torch.Tensor]):
    """(tensor for the kernel, kind, strides). Bool masks are reinterpreted as uint8 (a view, no copy), but where
    launches are wrapped for Inductor (``replay.wrapping``), whose lowering of a bool -> uint8 view fails: the
    kernels read a bool pointer the same way (``!= 0``)."""
    if mask is None:
        return None, 0, (0, 0, 0, 0), 1
    kind = 1 if mask.dtype == torch.bool else 2
    m = mask.view(torch.uint8) if kind == 1 and not replay.wrapping() else mask
    strides = tuple(0 if size == 1 else st for size, st in zip(m.shape, m.stride()))  # broadcast axes
    return m, kind, strides, m.shape[0]


def _strides4(t, varlen: bool):
    """(batch, head, row, dim) strides; packed varlen ``[total, H, D]`` has batch stride 0 (rows come from cu_seqlens)."""
    return (0, t.stride(1), t.stride(0), t.stride(2)) if varlen else t.stride()


def _keys_contiguous(v, varlen: bool) -> bool:
    return (v.stride(0) if varlen else v.stride(2)) == 1 or v.numel() == 0


def _stage_v(v, varlen: bool):
    """V as a view whose key axis is contiguous in memory (occupancy.stage_operands); the caller's V is only read."""
    perm, inv = ((1, 2, 0), (2, 0, 1)) if varlen else ((0, 1, 3, 2), (0, 1, 3, 2))
    return v if _keys_contiguous(v, varlen) else v.permute(perm).contiguous().permute(inv)


# Blocks of staged pieces start STRIDE_BYTES apart, so that the pieces' batch (and head) strides divide by 16
# elements in fp16 and fp32, as with separately allocated contiguous buffers. On an H100 (Triton 3.6) the fp16
# split kernel (DOT 5) returned NaN rows for a masked causal call with D=40 whose staging blocks were only
# 16-byte aligned (fp32 batch stride 70,052), and an illegal address in another case; blocks of 64 bytes fixed it.
STRIDE_BYTES = 64


def _piece_bytes(dtype: torch.dtype, shape) -> int:
    return -(-math.prod(shape) * dtype.itemsize // 16) * 16


def _specs_bytes(specs, per_head: bool = False) -> int:
    """Bytes of one block holding the pieces ``specs`` (of every head, or of one with ``per_head``)."""
    return sum(_piece_bytes(dt, shape[1:] if per_head else shape) for dt, shape in specs)


def _output_layout(shape, stride, dtype, aligned16):
    """``(batch stride, head stride, per_head, bytes of one row)`` in bytes of the staging region over an fp32
    output ``[B, Hq, Nq, Dv]`` of this geometry: its rows ``[0, r)`` of every head are one block per batch row when
    laid out ``[B, Nq, Hq, Dv]`` in memory (``_new_out``), one block per batch row and head when contiguous;
    ``None`` for other layouts. Pure: the planner reads it from the call's signature."""
    if len(shape) != 4 or dtype != torch.float32 or not aligned16:
        return None
    B, Hq, Nq, Dv = shape
    if _contiguous((B, Nq, Hq, Dv), (stride[0], stride[2], stride[1], stride[3])):
        layout = (Nq * Hq * Dv * 4, 0, False, Hq * Dv * 4)
    elif _contiguous(shape, stride):
        layout = (Hq * Nq * Dv * 4, Nq * Dv * 4, True, Dv * 4)
    else:
        return None
    if layout[0] % STRIDE_BYTES or layout[1] % STRIDE_BYTES:
        return None  # strides of the staged pieces would not divide by 16 elements (see STRIDE_BYTES)
    return layout


def _contiguous(shape, stride) -> bool:
    """``torch.Tensor.is_contiguous`` from a geometry: size-1 dimensions may have any stride."""
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


class _Region:
    """Memory that staged K/V pieces are carved from: one block per batch row (``per_head``: per batch row and
    head), ``strides`` ``(batch, head)`` bytes apart. Pieces (``(dtype, (heads, ...))`` specs) are laid out back
    to back, 16-byte aligned, from the start of every block; a piece is ``[B, heads, ...]``, contiguous inside."""

    def __init__(self, flat: torch.Tensor, strides: Tuple[int, int], per_head: bool, capacity: Optional[int] = None):
        self.u8 = flat.view(torch.uint8)
        self.bstride, self.hstride = strides
        self.per_head = per_head
        self.capacity = capacity  # usable bytes of a block (None: given with every carve)
        self._views = {}  # carved views by (batch, specs): equal key chunks reuse them

    @classmethod
    def buffer(cls, like: torch.Tensor, batch: int, block_bytes: int) -> "_Region":
        """A new buffer of ``batch`` blocks of ``block_bytes``, rounded up to ``STRIDE_BYTES``."""
        block_bytes = max(STRIDE_BYTES, -(-block_bytes // STRIDE_BYTES) * STRIDE_BYTES)
        return cls(torch.empty(batch * block_bytes, dtype=torch.uint8, device=like.device), (block_bytes, 0), False,
                   block_bytes)

    @classmethod
    def of_output(cls, out: torch.Tensor):
        """``(region, bytes of one row)`` over the fp32 output ``[B, Hq, Nq, Dv]`` (:func:`_output_layout`), or
        ``None`` for layouts that cannot hold staged pieces."""
        layout = _output_layout(*_geometry(out))
        if layout is None:
            return None
        bstride, hstride, per_head, row = layout
        flat = out.as_strided((out.numel(),), (1,), out.storage_offset())
        return cls(flat, (bstride, hstride), per_head), row

    def carve(self, batch: int, specs, capacity: Optional[int] = None):
        """Views for ``specs`` in the first ``capacity`` bytes of every block (default: the whole block)."""
        need = _specs_bytes(specs, self.per_head)
        capacity = self.capacity if capacity is None else capacity
        if need > capacity:  # the plans keep every piece inside its block: this would overwrite live memory
            raise RuntimeError(f"elsa_surgery internal error: staged K/V need {need} bytes per block, "
                               f"the staging region holds {capacity}")
        key = (batch, tuple(specs))
        if key in self._views:
            return self._views[key]
        if replay.wrapping():  # traced for Inductor: a kernel writing an as_strided view of a dtype view cannot be
            # functionalized (torch.compile refuses it); pieces of their own instead, the same bytes in all
            self._views[key] = _own_pieces(batch, specs, self.u8.device)
            return self._views[key]
        views, off = [], 0
        for dt, (heads, *inner) in specs:
            size = dt.itemsize
            flat = self.u8.view(dt)
            strides = [1]
            for n in reversed(inner[1:]):
                strides.insert(0, strides[0] * n)
            head = self.hstride // size if self.per_head else math.prod(inner)
            views.append(flat.as_strided((batch, heads, *inner), (self.bstride // size, head, *strides),
                                         flat.storage_offset() + off // size))
            off += _piece_bytes(dt, inner if self.per_head else (heads, *inner))
        self._views[key] = views
        return views


class _TransposedV:
    """Stages V transposed (keys contiguous) for the TF32 modes; K is read in place."""

    def __init__(self, k, v):
        self.dtype, self.dv = v.dtype, v.shape[-1]

    def specs(self, heads: int, keys: int):
        return [(self.dtype, (heads, self.dv, keys))]

    def __call__(self, k, v, views):
        (staged,) = views
        staged.copy_(v.transpose(2, 3))
        return k, staged.transpose(2, 3), None


class _SplitKV:
    """Splits K and V for ``DOT_F16X3`` (``scan.split_f16``): fp16 hi/lo parts of both, K's inverse scale per
    key, V's per head dim of each ``block_n`` keys (``split_bytes_per_key``). With ``split_v=False``
    (``DOT_F16X3V``) K alone: V goes to the kernel as it is and is split there."""

    def __init__(self, k, v, *, block_n: int, split_v: bool = True):
        self.d, self.dv = k.shape[-1], v.shape[-1]
        self.block_n = block_n
        self.split_v = split_v

    def specs(self, heads: int, keys: int):
        f16, f32 = torch.float16, torch.float32
        specs = [(f16, (heads, keys, self.d)), (f16, (heads, keys, self.d)), (f32, (heads, keys))]
        if self.split_v:
            specs += [(f16, (heads, keys, self.dv)), (f16, (heads, keys, self.dv)),
                      (f32, (heads, -(-keys // self.block_n), self.dv))]
        return specs

    def __call__(self, k, v, views):
        scan = _scan()
        B, H, N, _ = k.shape
        kh, kl, ki = views[:3]
        if self.split_v:
            vh, vl, vi = views[3:]
        else:  # DOT_F16X3V: V goes to the kernel as it is (its lo/scale slots get K's, unread)
            vh, vl, vi = v, kl, ki
        bd, bdv = occ.block_dim(self.d), occ.block_dim(self.dv)
        rk = max(1, 4096 // bd)  # K's rows per program (a scale per row); V's: the attention kernel's key block
        n_rblocks = max(-(-N // rk), -(-N // self.block_n) if self.split_v else 0)
        grid = (n_rblocks * B * H, 2 if self.split_v else 1)
        replay.launch(
            scan.split_f16, grid, k, kh, kl, ki, v, vh, vl, vi, N, H, n_rblocks,
            *k.stride(), kh.stride(0), kh.stride(1), ki.stride(0), ki.stride(1),
            *v.stride(), vh.stride(0), vh.stride(1), vi.stride(0), vi.stride(1),
            D=self.d, DV=self.dv, BLOCK_RK=rk, BLOCK_D=bd, BLOCK_RV=self.block_n, BLOCK_DV=bdv, num_warps=4)
        return kh, vh, (kl, ki, vl, vi)


def _stage(stager, region: _Region, k, v, capacity: Optional[int] = None):
    """``stager`` on ``k``/``v`` (a slice of heads and keys), its pieces carved from ``region``."""
    return stager(k, v, region.carve(k.shape[0], stager.specs(k.shape[1], k.shape[2]), capacity))


def _stage_whole(stager, q, k, v):
    """``stager`` on the whole of ``k``/``v``, each piece a tensor of its own, registered with the plan being recorded
    (a replay allocates them again): split calls replay. (Pieces carved from one registered buffer, as the staged
    chunks' are, replayed too, at 10-16 µs more host time a call on an H200 host: a dtype view and an ``as_strided``
    a piece, session 43.)"""
    pieces = _own_pieces(k.shape[0], stager.specs(k.shape[1], k.shape[2]), q.device)
    for i, piece in enumerate(pieces):
        replay.allocated(f"stage_{i}", piece)
    return stager(k, v, pieces)


def _own_pieces(batch: int, specs, device):
    """A tensor of its own, ``[batch, heads, ...]`` and contiguous, for each ``(dtype, (heads, ...))`` of ``specs``."""
    return [torch.empty((batch, heads, *inner), dtype=dtype, device=device) for dtype, (heads, *inner) in specs]


def split_bytes_per_key(d: int, dv: int, block_n: int, split_v: bool = True) -> int:
    """Bytes ``_SplitKV`` stages per key and K/V head (fp16 hi + lo of K and V, K's scale, V's block scales;
    K's alone without ``split_v``)."""
    return d * 4 + 4 + ((dv * 4 + -(-dv * 4 // block_n)) if split_v else 0)


def _new_out(q, B: int, Hq: int, Nq: int, Dv: int):
    """The dense output ``[B, Hq, Nq, Dv]``, laid out ``[B, Nq, Hq, Dv]`` in memory (a transposed view), like
    the outputs of SDPA's flash and cuDNN kernels: the ``out.transpose(1, 2).reshape(B, Nq, Hq * Dv)`` that
    every attention module does next is then a view instead of a copy of the whole output."""
    return q.new_empty((B, Nq, Hq, Dv)).transpose(1, 2)


def _partition_len(n_k: int, parts: int, block_n: int) -> int:
    per = -(-max(n_k, 1) // parts)
    return -(-per // block_n) * block_n


# Inputs that are often one tensor (self-attention on one projection, one cu_seqlens for queries and keys):
# the key holds whether they are, so that their plans replay
_ALIASES = (("q", "k"), ("k", "v"), ("q", "v"), ("cu_q", "cu_k"), ("q_lengths", "kv_lengths"))  # _run's key: in order


def _geometry(t):
    """What a launch plan's key holds of a tensor: everything the planner and Triton's specialisation read."""
    return None if t is None else (t.shape, t.stride(), t.dtype, replay.aligned16(t))


def _run(q, k, v, *, scale, precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=None, cu_k=None,
         is_causal=False, varlen_dims=None, out=None, lse=None, state=None, want_lse=True,
         num_partitions=None, eta=None):
    """Shared launcher. Dense: q [B,Hq,Nq,D]. Varlen: q [total,Hq,D] with varlen_dims=(B, max_q, max_k).
    Through a launch plan (kernels/replay.py) keyed by the call's signature: planned and recorded once, replayed
    after (``ELSA_LAUNCH_PLANS``)."""
    def plan_and_run():
        return _plan_run(q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=q_lengths,
                         kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k, is_causal=is_causal, varlen_dims=varlen_dims,
                         out=out, lse=lse, state=state, want_lse=want_lse, num_partitions=num_partitions, eta=eta)

    if not replay.wanted(q):
        return plan_and_run()
    slots = dict(q=q, k=k, v=v, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k,
                 out=out, lse=lse)
    if state is not None:
        slots.update(state_m=state[0], state_s=state[1], state_w=state[2])
    key = _replay_key(q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=q_lengths,
                      kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k, is_causal=is_causal, varlen_dims=varlen_dims,
                      out=out, lse=lse, state=state, want_lse=want_lse, num_partitions=num_partitions, eta=eta)
    return replay.run(key, slots, plan_and_run, _ALIASES)


def plan_key_head(q, k, v, cu_q, cu_k, q_lengths, kv_lengths) -> tuple:
    """What every launch plan's key (forward and backward) starts with: which inputs are one tensor (the pairs of
    :data:`_ALIASES`, in order), the device, the current CUDA device and whether its stream is capturing."""
    cuda = q.is_cuda
    return ((q is k, k is v, q is v, cu_q is cu_k, q_lengths is kv_lengths), q.device,
            torch.cuda.current_device() if cuda else None, cuda and torch.cuda.is_current_stream_capturing())


def _replay_key(q, k, v, *, scale, precision, mask, q_lengths, kv_lengths, cu_q, cu_k, is_causal, varlen_dims,
                out, lse, state, want_lse, num_partitions, eta) -> tuple:
    """The launch plan key of a :func:`_run` call (its signature: see kernels/replay.py)."""
    return (*plan_key_head(q, k, v, cu_q, cu_k, q_lengths, kv_lengths), float(scale), precision, bool(is_causal),
            varlen_dims, bool(want_lse), num_partitions, eta, _geometry(q), _geometry(k), _geometry(v), _geometry(mask),
            _geometry(q_lengths), _geometry(kv_lengths), _geometry(cu_q), _geometry(cu_k), _geometry(out),
            _geometry(lse), None if state is None else tuple(map(_geometry, state)))


def attention_plan(q, k, v, *, scale: float, mask=None, is_causal=False, precision=None, return_lse=True,
                   kv_lengths=None):
    """The replayable launch plan that :func:`attention` with these arguments (no query lengths, no provided outputs)
    replays now, or None: what ``elsa_surgery.callcache`` keeps as a call's direct route. ``plan.replay(slots)``
    with ``slots = {"q": q, "k": k, "v": v, "mask": mask, "kv_lengths": kv_lengths}`` of a call with the same key
    runs that call."""
    if not replay.wanted(q):
        return None
    return replay.replayable(_replay_key(
        q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=None, kv_lengths=kv_lengths, cu_q=None,
        cu_k=None, is_causal=is_causal, varlen_dims=None, out=None, lse=None, state=None, want_lse=return_lse,
        num_partitions=None, eta=None))


# scan.elsa_fwd's arguments that follow the number of keys in a packed launch of a whole call (one launch, koff = 0):
# the count itself, the keys the launch reads (klim), each partition's, and K's and V's strides
_KEYS_ARGS = ("Nk", "klim", "part_len", "stride_kb", "stride_kh", "stride_kn", "stride_kd", "stride_vb", "stride_vh",
              "stride_vn", "stride_vd")
_I32 = range(-(2 ** 31), 2 ** 31)


def _int_kind(x: int, specialised: bool) -> tuple:
    """What Triton compiles an integer argument of value ``x`` as: its type (32 or 64 bits) and, where the kernel
    specialises the argument, its equality to 1 and divisibility by 16. Equal kinds, the same compiled kernel."""
    return (x in _I32, x == 1, x % 16 == 0) if specialised else (x in _I32,)


class KeysFamily:
    """The launch plan of a packed short-query call (a decode step: ``scan.elsa_fwd`` with ``PACK``, and the row merge
    when it has partitions) made to run calls that differ from it only in their number of keys and K's and V's
    strides: the next decode steps of a growing KV cache, each a new signature, which would otherwise be planned and
    recorded again at every step (H200, session 58: 421 µs of host time a step against 43 µs for a replayed call,
    1 × 28:4 × 128 from 4,096 keys, ``benchmarks/lab/decode_growing.py``).

    :meth:`plan_for` gives the plan of a call with other K/V, or None when the planner would plan that call otherwise:
    another partition count or ``BLOCKED_PV`` (the planner's own rule, ``split_keys`` with the partition rule it
    noted while recording), fewer keys than the packed kernel takes, V's key count not K's, or an argument Triton
    would specialise differently (a stride's divisibility by 16, a 64-bit value). Everything else the planner reads
    is the family's by construction: the caller (``elsa_surgery.callcache``) keys families on all of the call's
    signature but the key count (by band) and K's and V's strides. The plan stays valid while its environment is
    unchanged (``plan.env_unchanged()``), which the caller checks."""

    __slots__ = ("plan", "rule", "fwd", "at", "specs", "kinds", "last")

    def __init__(self, plan, rule, fwd, at):
        self.plan, self.rule, self.fwd, self.at = plan, rule, fwd, at
        self.specs = tuple(sp for _, sp in at)
        self.kinds = tuple(map(_int_kind, (fwd.vals[i] for i, _ in at), self.specs))
        self.last = None  # (key count, K's strides, V's strides, plan): the layers of one decode step share it

    def plan_for(self, k, v):
        n_k = k.shape[2]
        ks, vs = k.stride(), v.stride()
        last = self.last
        if last is not None and last[0] == n_k and last[1] == ks and last[2] == vs:
            return last[3]
        parts_of, block_n, dot, parts0, _, blocked0 = self.rule
        if n_k < occ.DECODE_MIN_KEYS or v.shape[2] != n_k:
            return None
        parts, part_len = split_keys(parts_of, n_k, block_n)
        if parts != parts0 or blocked_pv(dot, parts, part_len, n_k) != blocked0:
            return None
        vals = (n_k, n_k, part_len, *ks, *vs)
        if tuple(map(_int_kind, vals, self.specs)) != self.kinds:
            return None
        fwd = self.fwd.with_args({i: b for (i, _), b in zip(self.at, vals)})
        plan = self.plan.with_launches((fwd,) + self.plan.launches[1:])
        self.last = (n_k, ks, vs, plan)
        return plan


def keys_family(plan) -> Optional[KeysFamily]:
    """The :class:`KeysFamily` of a recorded launch plan (:func:`attention_plan`), or None when the plan is not one
    packed launch of a whole call (and its row merge)."""
    rule = plan.notes.get("keys") if plan is not None and plan.launches else None
    if rule is None or len(plan.launches) > 2:
        return None
    scan = _scan()
    fwd = plan.launches[0]
    if fwd.fn is not scan.elsa_fwd or fwd.descs or (len(plan.launches) == 2
                                                    and plan.launches[1].fn is not scan.elsa_merge_rows):
        return None
    names = [n for n, _ in replay._params(fwd.fn)]
    val = dict(zip(names, fwd.vals))
    if not val.get("PACK") or val.get("CHUNKED") or val.get("koff") != 0 or val.get("klim") != val.get("Nk"):
        return None
    # (parameter index, whether the compiled kernel is specialised on it): a launch that is not direct goes through
    # Triton's own dispatch (``fn[grid]``), which specialises whatever it is given
    params = getattr(fwd.fn, "params", None) if fwd.kernel is not None else ()
    at = tuple((names.index(n), fwd.kernel is not None and (
        params is None or not getattr(params[names.index(n)], "do_not_specialize", False))) for n in _KEYS_ARGS)
    if val.get("part_len") != rule[4] or val.get("BLOCKED_PV") != rule[5] or fwd.grid[1] != rule[3]:
        return None
    return KeysFamily(plan, rule, fwd, at)


def varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                is_causal=False, precision=None, return_lse=True):
    """:func:`attention_plan` of a packed call (:func:`attention_varlen` without provided outputs): ``slots =
    {"q": q, "k": k, "v": v, "cu_q": cu_seqlens_q, "cu_k": cu_seqlens_k}``."""
    if not replay.wanted(q):
        return None
    return replay.replayable(_replay_key(
        q, k, v, scale=scale, precision=precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=cu_seqlens_q,
        cu_k=cu_seqlens_k, is_causal=is_causal, varlen_dims=(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q),
                                                             int(max_seqlen_k)),
        out=None, lse=None, state=None, want_lse=return_lse, num_partitions=None, eta=None))


# --------------------------------------------------------------------------------------------------
# the launch planner: a pure function of the call's signature, cached by it
# --------------------------------------------------------------------------------------------------

class CallSignature(NamedTuple):
    """Everything the planner reads of a call: shapes, dtypes, the strides and alignment it looks at, settings.

    Built by :func:`call_signature` from the tensors (after the outputs are allocated: the reverse key-chunk
    staging reads the output's layout); a named tuple (cheap to build and hash on every call), so plans are cached
    by it (:func:`cached_plan`).
    """

    device: torch.device
    dtype: torch.dtype
    q_shape: Tuple[int, ...]
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]
    v_keys_contiguous: bool
    v_itemsize: int
    out: Optional[tuple]  # (shape, stride, dtype, 16-byte aligned) of the output the kernels write, if any
    varlen_dims: Optional[Tuple[int, int, int]]
    has_mask: bool
    has_lengths: bool  # q_lengths or kv_lengths given
    has_state: bool
    is_causal: bool
    precision: Optional[str]
    num_partitions: Optional[int]
    eta: Optional[float]


@dataclass(frozen=True)
class Dims:
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    Dv: int
    groups: int
    BD: int
    BDV: int
    varlen: bool

    @property
    def BH(self) -> int:
        return self.B * self.Hq

    @property
    def rows(self) -> int:
        return self.B * self.Hq * self.Nq


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher runs for one signature: the dot kind, tiles, partitions and K/V staging.

    ``staging``: ``("whole", 0)`` (the operands as they are, V staged whole when ``stage``), ``("heads", n)``
    (launches per group of ``n`` K/V heads), ``("keys", n)`` (key chunks of ``n`` keys, in key order) or
    ``("rkeys", chunks)`` (causal key chunks in reverse order staged in the output's unwritten rows:
    ``occupancy.reverse_key_chunks``). ``hopper``: the launcher offers the call to the Hopper kernel, which decides
    on the tensors themselves (``hopper.eligible``); ``hopper_mode`` is ``ELSA_HOPPER`` as read when planning.
    """

    dims: Dims
    dot: int
    cfg: occ.TileConfig
    n_mblocks: int
    parts: int
    part_len: int
    stage: bool
    staging: tuple
    hopper: bool
    hopper_mode: str
    pack_rows: Optional[int] = None  # decode / short queries: rows per K/V head packed in a tile (scan's PACK)
    mask_ranges: bool = False  # classify the mask's tiles first (scan.mask_tile_ranges, ELSA_MASK_TILES)
    # packed calls: their partition rule, ``parts_of(n_k=...)`` (split_keys), for calls with other key counts
    # (KeysFamily); not part of the plan's identity
    parts_of: Optional[Callable[..., int]] = field(default=None, compare=False, repr=False)
    # packed calls of several partitions: scan.elsa_fwd's (FUSE_MERGE, MERGE_M), phase 2 in the phase-1 launch
    # (occupancy.fused_merge), or None for elsa_merge_rows
    merge_fused: Optional[Tuple[int, int]] = None

    @property
    def split(self) -> bool:
        return self.dot in occ.SPLIT_DOTS


def call_signature(q, k, v, out, *, precision, mask=None, q_lengths=None, kv_lengths=None, is_causal=False,
                   varlen_dims=None, state=None, num_partitions=None, eta=None) -> CallSignature:
    varlen = varlen_dims is not None
    return CallSignature(
        q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), _keys_contiguous(v, varlen),
        v.element_size(), None if out is None else _geometry(out), varlen_dims, mask is not None,
        q_lengths is not None or kv_lengths is not None, state is not None, bool(is_causal), precision,
        num_partitions, eta)


def _dims(sig: CallSignature) -> Dims:
    if sig.varlen_dims is not None:
        B, Nq, Nk = sig.varlen_dims
        Hq, D = sig.q_shape[1], sig.q_shape[2]
        Hkv, Dv = sig.k_shape[1], sig.v_shape[2]
    else:
        B, Hq, Nq, D = sig.q_shape
        Hkv, Nk, Dv = sig.k_shape[1], sig.k_shape[2], sig.v_shape[3]
    return Dims(B, Hq, Hkv, Nq, Nk, D, Dv, Hq // Hkv, occ.block_dim(D), occ.block_dim(Dv), sig.varlen_dims is not None)


def _tiles(sig: CallSignature, d: Dims, dot: int, pack_rows: Optional[int] = None):
    """(tile config, query blocks, partitions, keys per partition, the partition rule ``parts_of``: split_keys) for
    one dot kind; ``pack_rows``: the packed short-query kernel's rows per K/V head (its row tiles then count per
    (batch, K/V head))."""
    itemsize = sig.dtype.itemsize
    few = False
    if pack_rows is not None:
        groups = d.B * d.Hkv
        cfg = occ.decode_tile_config(d.D, d.Dv, pack_rows, groups=groups, device=sig.device, itemsize=itemsize)
        few = occ.decode_few(sig.device, groups=groups, rows=pack_rows, d=d.D, dv=d.Dv, itemsize=itemsize)
        n_mb = -(-pack_rows // cfg.block_m)
        tiles = n_mb * groups
    else:
        cfg = occ.tile_config(dot, d.D, d.Dv, max(d.Nq, d.Nk), bh=d.BH, nq=d.Nq, device=sig.device,
                              causal=sig.is_causal)
        n_mb = -(-d.Nq // cfg.block_m) if d.Nq > 0 else 0
        tiles = n_mb * d.BH
    parts_of = functools.partial(occ.num_partitions, sig.device, tiles=tiles, block_n=cfg.block_n, rows=d.rows,
                                 dv=d.Dv, out_bytes=d.rows * d.Dv * itemsize, eta=sig.eta, forced=sig.num_partitions,
                                 decode=pack_rows is not None, decode_few=few)
    return (cfg, n_mb, *split_keys(parts_of, d.Nk, cfg.block_n), parts_of)


def split_keys(parts_of: Callable[..., int], n_k: int, block_n: int) -> Tuple[int, int]:
    """``(partitions, keys per partition)`` of a call of ``n_k`` keys whose partition rule is ``parts_of(n_k=...)``
    (``occupancy.num_partitions`` with the call's other arguments): each partition whole key blocks, none empty."""
    part_len = _partition_len(n_k, parts_of(n_k=n_k), block_n)
    return max(1, -(-max(n_k, 1) // part_len)), part_len


def blocked_pv(dot: int, parts: int, part_len: int, n_k: int) -> bool:
    """``scan.elsa_fwd``'s ``BLOCKED_PV`` for a launch of ``parts`` partitions of ``part_len`` keys over ``n_k``."""
    return occ.blocked_pv(dot, min(part_len, n_k) if parts > 1 else n_k)


def _rows_per_kv(sig: CallSignature, d: Dims) -> int:
    return sig.q_shape[0] * d.groups // max(d.B, 1) if d.varlen else d.Nq * d.groups  # varlen: mean per sequence


def _staging(sig: CallSignature, d: Dims, dot: int, cfg, n_mb: int, parts: int):
    """(stage?, staging): whether K/V are staged and in which pieces (occupancy.stage_plan); causal key chunks run
    in reverse order, staged in the output's unwritten rows where they fit (occupancy.reverse_key_chunks)."""
    split = dot in occ.SPLIT_DOTS
    stage = split or (occ.stage_operands(dot, _rows_per_kv(sig, d)) and not sig.v_keys_contiguous)
    if not (stage and not d.varlen and parts == 1 and not sig.has_state):
        return stage, ("whole", 0)
    itemsize = sig.dtype.itemsize
    per_key = (split_bytes_per_key(d.D, d.Dv, cfg.block_n, dot == occ.DOT_F16X3) if split else d.Dv * sig.v_itemsize)
    plan = occ.stage_plan(
        sig.device, n_k=d.Nk, block_n=cfg.block_n, batch=d.B, kv_heads=d.Hkv, groups=d.groups, m_blocks=n_mb,
        out_bytes=d.rows * d.Dv * itemsize, v_bytes_per_key_head=per_key, stats_bytes=2 * d.rows * 4,
        causal=sig.is_causal,
        min_chunk_keys=occ.MIN_KEYS_PER_SPLIT_CHUNK if split else occ.MIN_KEYS_PER_STAGE_CHUNK)
    ext_keys = occ.reverse_chunks_env()
    if plan[0] != "keys" or not sig.is_causal or sig.has_lengths or ext_keys is None:
        return stage, plan
    layout = None if sig.out is None else _output_layout(*sig.out)
    if layout is None:
        return stage, plan
    _, _, per_head, row_bytes = layout
    heads = 1 if per_head else d.Hkv  # K/V heads per block of the region
    chunks = occ.reverse_key_chunks(
        n_q=d.Nq, n_k=d.Nk, block_m=cfg.block_m, block_n=cfg.block_n, row_bytes=row_bytes,
        key_bytes=heads * per_key, fixed_bytes=16 * 6 + heads * d.Dv * 4, ext_keys=ext_keys or plan[1])
    return stage, ("rkeys", chunks)


def plan_launch(sig: CallSignature) -> LaunchPlan:
    """The launch plan of a call: which kernel (dot kind, split or not, Hopper candidate), tiles, partitions,
    staging and whether the mask's tiles are classified first. Pure: reads the signature, the device's properties
    and the ``ELSA_*`` knobs, touches no tensor."""
    plan = _kernel_plan(sig)
    d = plan.dims
    if (sig.has_mask and plan.pack_rows is None and not d.varlen and plan.staging[0] in ("whole", "heads")
            and -(-d.Nk // plan.cfg.block_n) >= occ.MASK_RANGE_MIN_KEY_BLOCKS and knobs.get(knobs.MASK_TILES) != "0"):
        plan = replace(plan, mask_ranges=True)
    return plan


def _kernel_plan(sig: CallSignature) -> LaunchPlan:
    from . import hopper  # Triton is imported only when kernels run

    hopper_mode = hopper.mode()  # read on every planning: a bad ELSA_HOPPER raises wherever the call would run
    d = _dims(sig)
    dot = _dot_kind(sig.dtype, sig.precision, sig.device)
    # decode / short queries: the GQA group's query rows packed into one row tile (scan.elsa_fwd's PACK)
    pack_rows = occ.decode_rows(n_q=d.Nq, groups=d.groups, n_k=d.Nk, dot=dot, varlen=d.varlen)
    if pack_rows is not None:
        cfg, n_mb, parts, part_len, parts_of = _tiles(sig, d, dot, pack_rows)
        fused = None if sig.has_state else occ.fused_merge(parts, pack_rows, cfg.block_m, d.BDV)
        return LaunchPlan(d, dot, cfg, n_mb, parts, part_len, False, ("whole", 0), False, hopper_mode, pack_rows,
                          parts_of=parts_of, merge_fused=fused)
    split_dot = occ.precise_split(dot, _rows_per_kv(sig, d), eligible=not d.varlen and not sig.has_state,
                                  work=float(d.BH) * d.Nq * d.Nk * d.D)
    if split_dot == occ.DOT_F16X3V and (d.BD != d.D or d.BDV != d.Dv):
        # V split in the kernel (DOT 6) only for head dims that need no padding: on an H100 a call with
        # D=40, Dv=32 returned NaN rows (masked) or faulted (unmasked); the full split runs instead
        split_dot = occ.DOT_F16X3
    if split_dot != dot:
        cfg, n_mb, parts, part_len, _ = _tiles(sig, d, split_dot)
        stage, staging = _staging(sig, d, split_dot, cfg, n_mb, parts)
        # the split runs with one partition; causal calls whose memory budget allows only key chunks of
        # little work per launch split K alone, V in the kernel: chunks twice as long
        # (occupancy.MIN_CAUSAL_SPLIT_CHUNK_WORK), unless ELSA_PRECISE_SPLIT forces a kind
        short_chunks = staging[0] == "keys" and d.BH * d.Nq * staging[1] * d.D < occ.MIN_CAUSAL_SPLIT_CHUNK_WORK
        if parts == 1 and not (sig.is_causal and short_chunks and not occ.split_forced()):
            return LaunchPlan(d, split_dot, cfg, n_mb, parts, part_len, stage, staging, False, hopper_mode)
        if parts == 1 and d.BD == d.D and d.BDV == d.Dv:  # same tiles ("f16x3"), a plan for K's bytes alone
            stage, staging = _staging(sig, d, occ.DOT_F16X3V, cfg, n_mb, parts)
            return LaunchPlan(d, occ.DOT_F16X3V, cfg, n_mb, parts, part_len, stage, staging, False, hopper_mode)
    cfg, n_mb, parts, part_len, _ = _tiles(sig, d, dot)
    try_hopper = bool(dot in (occ.DOT_LOWP, occ.DOT_IEEE, occ.DOT_TF32) and parts == 1 and n_mb and d.BH)
    stage, staging = _staging(sig, d, dot, cfg, n_mb, parts)
    return LaunchPlan(d, dot, cfg, n_mb, parts, part_len, stage, staging, try_hopper, hopper_mode)


MAX_CACHED_PLANS = 4096
_PLANS: Dict[CallSignature, Tuple[tuple, tuple, LaunchPlan]] = {}  # sig -> (env names, their values, plan)


def cached_plan(sig: CallSignature) -> LaunchPlan:
    """:func:`plan_launch`, cached by the signature and valid while every environment variable the planning read
    keeps the value it had (``replay.reading_env``). While torch.compile traces (the inline op's body) knob reads are
    not observed, so a plan made then is not cached: nothing would invalidate it when a knob changes."""
    if knobs.tracing():
        return plan_launch(sig)
    hit = _PLANS.get(sig)
    if hit is not None and replay.env_unchanged(hit[1]):
        replay.reread_env(hit[0])  # a launch plan being recorded depends on what the planning read
        return hit[2]
    with replay.reading_env() as read:
        plan = plan_launch(sig)
    if len(_PLANS) >= MAX_CACHED_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[sig] = (tuple(read), tuple(read.values()), plan)
    return plan


def clear_plans() -> None:
    """Forget every cached launch plan (also done by ``replay.clear()``)."""
    _PLANS.clear()


replay.CLEAR_HOOKS.append(clear_plans)


# --------------------------------------------------------------------------------------------------
# the launcher: executes a plan on the call's tensors
# --------------------------------------------------------------------------------------------------

def _outputs(q, k, v, *, varlen_dims, out, lse, state, want_lse):
    """The output and lse the kernels write (allocated here unless given; registered with the replay)."""
    if state is not None:
        return out, lse
    if varlen_dims is not None:
        Hq, Dv = q.shape[1], v.shape[2]
    else:
        Hq, Dv = q.shape[1], v.shape[3]
    if out is None:  # dense: [B, Nq, Hq, Dv] in memory, as SDPA's flash/cuDNN outputs (_new_out)
        out = q.new_empty((q.shape[0], Hq, Dv)) if varlen_dims is not None else _new_out(q, *q.shape[:3], Dv)
        replay.allocated("out", out)
    if want_lse and lse is None:
        shape = (Hq, q.shape[0]) if varlen_dims is not None else tuple(q.shape[:3])
        lse = torch.empty(shape, device=q.device, dtype=torch.float32)
        replay.allocated("lse", lse)
    return out, lse


def _plan_run(q, k, v, *, scale, precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=None, cu_k=None,
              is_causal=False, varlen_dims=None, out=None, lse=None, state=None, want_lse=True,
              num_partitions=None, eta=None):
    """Plans a call and runs it (see :func:`_run`): allocate the outputs, plan (pure, cached), execute."""
    _scan()  # after TRITON_INTERPRET has been decided
    if q.dtype == torch.float32 and precision is None:  # resolved once: the Hopper path reads it too
        precision = default_precision(q.device)
    out, lse = _outputs(q, k, v, varlen_dims=varlen_dims, out=out, lse=lse, state=state, want_lse=want_lse)
    sig = call_signature(q, k, v, out if state is None else None, precision=precision, mask=mask,
                         q_lengths=q_lengths, kv_lengths=kv_lengths, is_causal=is_causal, varlen_dims=varlen_dims,
                         state=state, num_partitions=num_partitions, eta=eta)
    plan = cached_plan(sig)
    return execute(plan, q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k, is_causal=is_causal, out=out, lse=lse, state=state,
                   want_lse=want_lse)


def execute(plan: LaunchPlan, q, k, v, *, scale, precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=None,
            cu_k=None, is_causal=False, out=None, lse=None, state=None, want_lse=True):
    """Run ``plan`` on the call's tensors: the Hopper kernel where it takes the call, else phase 1 (staged as
    planned) and, with several partitions, the merge."""
    scan = _scan()
    d = plan.dims
    if plan.hopper:
        from . import hopper

        why_not = hopper.eligible(q, k, v, out, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                  varlen=d.varlen, state=state, is_causal=bool(is_causal), scale=scale,
                                  precision=precision, how=plan.hopper_mode)
        if why_not is None:
            hopper.forward(q, k, v, out, lse if want_lse else None, scale=scale, is_causal=is_causal,
                           precision=precision)
            return out, lse, state
    if plan.n_mblocks == 0 or d.BH == 0:
        return out, lse, state
    B, Hq, Nq, Nk, D, Dv, groups = d.B, d.Hq, d.Nq, d.Nk, d.D, d.Dv, d.groups
    BD, BDV, BH, varlen, cfg, parts, dot = d.BD, d.BDV, d.BH, d.varlen, plan.cfg, plan.parts, plan.dot
    blocked = blocked_pv(dot, parts, plan.part_len, Nk)
    if varlen:
        so = _strides4(out, True)
        sl = (0, lse.stride(0), lse.stride(1)) if want_lse else (0, 0, 0)
    elif state is None:
        so = out.stride()
        sl = lse.stride() if want_lse else (0, 0, 0)
    else:
        so, sl = (0, 0, 0, 0), (0, 0, 0)

    dummy = q
    f32 = dict(device=q.device, dtype=torch.float32)
    n_mblocks, pack_rows = plan.n_mblocks, plan.pack_rows
    # phase 2 in the phase-1 launch: not through wrap_triton (its scratch is state kept between calls) nor into a
    # CUDA graph (a graph's replays would share the capture stream's scratch with whatever else runs there)
    fused = (plan.merge_fused if parts > 1 and state is None and not replay.wrapping()
             and not (q.is_cuda and torch.cuda.is_current_stream_capturing()) else None)
    count = dummy
    if parts > 1 and not replay.wrapping():
        # the partition states m, S and W carved from one allocation (each at a 16-byte boundary): a replay
        # allocates once, and hands the kernels the pieces' addresses (session 58). Fused: carved from the stream's
        # states buffer beside its ticket counters (merge_scratch), which a replay looks up instead of allocating
        n = parts * BH * Nq
        n16 = -(-n // 4) * 4
        size = 2 * n16 + n * Dv
        n_count = n_mblocks * B * (Hq // groups)  # (fused: a ticket counter a packed row tile)
        if fused is None or replay.collecting():  # (launch.precompile, on fake tensors: stand-ins)
            part = torch.empty(size, **f32)
            replay.allocated("part", part)
            if fused is not None:
                count = torch.empty(n_count, device=q.device, dtype=torch.int32)
        else:
            count, part = merge_scratch(q.device, n_count, size)
            replay.derived("merge_count", count, _scratch_maker(q.device, n_count, size, 0))
            replay.derived("part", part, _scratch_maker(q.device, n_count, size, 1))
        pm, ps = part[:n].view(parts, BH, Nq), part[n16:n16 + n].view(parts, BH, Nq)
        pw = part[2 * n16:size].view(parts, BH, Nq, Dv)
        for name, t in (("part_m", pm), ("part_s", ps), ("part_w", pw)):
            replay.carved(name, t, "part")
    elif parts > 1:  # traced into wrap_triton launches (kernels/ops.py): three tensors of their own
        pm = torch.empty((parts, BH, Nq), **f32)
        ps = torch.empty((parts, BH, Nq), **f32)
        pw = torch.empty((parts, BH, Nq, Dv), **f32)
    elif state is not None:
        pm, ps, pw = state
    else:
        pm = ps = pw = dummy
    write_state = parts > 1 or state is not None
    if pack_rows is not None and plan.parts_of is not None:  # (KeysFamily)
        replay.note("keys", (plan.parts_of, cfg.block_n, dot, parts, plan.part_len, blocked))

    def fwd(q_, k_, v_, out_, lse_, mask_, koff, klim, part_len_, pm_, ps_, pw_, write_state_, chunked,
            split_=None, ranges_=None):
        """One phase-1 launch over the heads of ``q_`` (a head slice of q, with the matching K/V/out/lse);
        ``split_``: ``(kl, ki, vl, vi)`` when K/V are the hi parts of a ``_SplitKV``; ``ranges_``: the mask's tile
        ranges (:func:`_mask_ranges`, sliced as ``mask_``)."""
        mask_t, mask_kind, sm, period = _mask_arg(mask_)
        sr = (ranges_.stride(0), ranges_.stride(1) if ranges_.shape[1] > 1 else 0) if ranges_ is not None else (0, 0)
        hq = q_.shape[1]
        kl, ki, vl, vi = split_ if split_ is not None else (dummy,) * 4
        si = (ki.stride(0), ki.stride(1), vi.stride(0), vi.stride(1)) if split_ is not None else (0,) * 4
        # causal: heads whose row blocks run heaviest first together, as many as their keys of this launch fit
        # in L2 (occupancy.causal_head_group)
        head_group = (occ.causal_head_group(q.device, n_k=min(klim, Nk - koff), kv_bytes_per_key=q.element_size()
                                            * (D + Dv), groups=groups, bh=B * hq, m_blocks=n_mblocks)
                      if is_causal and pack_rows is None else 1)
        # packed: programs and state rows per (batch, K/V head), GROUPS * Nq rows each
        bh_, rows_buf = (B * (hq // groups), pack_rows) if pack_rows is not None else (B * hq, Nq)
        replay.launch(
            scan.elsa_fwd, (n_mblocks * bh_, parts), q_, k_, v_, mask_t if mask_t is not None else dummy,
            q_lengths if q_lengths is not None else dummy, kv_lengths if kv_lengths is not None else dummy,
            cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy,
            out_ if out_ is not None else dummy, lse_ if lse_ is not None else dummy, pm_, ps_, pw_,
            kl, ki, vl, vi, ranges_ if ranges_ is not None else dummy, count,
            float(scale) * LOG2E, Nq, Nk, hq, groups, n_mblocks, part_len_, rows_buf, bh_, period, koff, klim,
            head_group,
            *_strides4(q_, varlen), *_strides4(k_, varlen), *_strides4(v_, varlen), *si, *sm, *sr,
            *so, *sl,
            D=D, DV=Dv, BLOCK_D=BD, BLOCK_DV=BDV, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), HAS_QLEN=q_lengths is not None,
            HAS_KVLEN=kv_lengths is not None, VARLEN=varlen, WRITE_STATE=write_state_,
            WRITE_LSE=lse_ is not None, DOT=dot, CHUNKED=chunked, PACK=pack_rows is not None, BLOCKED_PV=blocked,
            HAS_RANGES=ranges_ is not None, FUSE_MERGE=fused[0] if fused else 0, MERGE_M=fused[1] if fused else 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    lse_arg = lse if want_lse else None
    split, part_len, staging = plan.split, plan.part_len, plan.staging
    ranges = _mask_ranges(mask, d, cfg, n_mblocks) if plan.mask_ranges and mask is not None else None
    stager = (_SplitKV(k, v, block_n=cfg.block_n, split_v=dot == occ.DOT_F16X3) if split
              else _TransposedV(k, v))
    if staging[0] == "heads":
        _head_group_fwd(fwd, q, k, v, out, lse_arg, mask, staging[1], groups, part_len, stager, ranges)
        return out, lse, state
    if staging[0] in ("keys", "rkeys"):
        chunks, region = ((staging[1], _Region.of_output(out)[0]) if staging[0] == "rkeys"
                          else (tuple((s, min(Nk, s + staging[1]), None) for s in range(0, Nk, staging[1])), None))
        _key_chunk_fwd(fwd, q, k, v, out, lse_arg, mask, chunks, region, cfg.block_n, d.rows, stager)
        return out, lse, state
    split_args = None
    if split:
        k, v, split_args = _stage_whole(stager, q, k, v)
    elif plan.stage:
        staged = _stage_v(v, varlen)
        if staged is not v:
            replay.derived("v_staged", staged, lambda slots: _stage_v(slots["v"], varlen))
        v = staged
    fwd(q, k, v, out, lse_arg, mask, 0, Nk, part_len, pm, ps, pw, write_state, 0, split_args, ranges)
    if parts > 1 and pack_rows is not None and fused is None:  # few rows, many partitions: one program per row
        fm, fs, fw = state if state is not None else (dummy, dummy, dummy)
        replay.launch(
            scan.elsa_merge_rows, (BH * Nq,), pm, ps, pw, out if out is not None else dummy,
            lse if want_lse and lse is not None else dummy, fm, fs, fw, Nq, Hq, Nq, BH, parts, *so, *sl,
            DV=Dv, BLOCK_DV=BDV, BLOCK_P=min(occ.next_pow2(parts), occ.MERGE_PARTITIONS_PER_LOAD),
            WRITE_STATE=state is not None, WRITE_LSE=bool(want_lse and lse is not None), num_warps=4, num_stages=1,
        )
    elif parts > 1 and pack_rows is None:
        merge_m = 64 if BDV <= 128 else 32
        nmb = -(-Nq // merge_m)
        fm, fs, fw = state if state is not None else (dummy, dummy, dummy)
        replay.launch(
            scan.elsa_merge, (nmb * BH,), pm, ps, pw, cu_q if cu_q is not None else dummy,
            out if out is not None else dummy, lse if want_lse and lse is not None else dummy, fm, fs, fw,
            Nq, Hq, nmb, Nq, BH, parts, *so, *sl,
            DV=Dv, BLOCK_DV=BDV, BLOCK_M=merge_m, VARLEN=varlen, WRITE_STATE=state is not None,
            WRITE_LSE=bool(want_lse and lse is not None), num_warps=4, num_stages=1,
        )
    return out, lse, state


# (device, stream) -> the fused merge's buffers: [ticket counters (int32, zero between launches), partition states
# (fp32)]
_SCRATCH: Dict[tuple, list] = {}


def merge_scratch(device: torch.device, n_count: int, n_states: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(counters, states)`` of fused-merge launches on the current stream of ``device``: at least ``n_count`` int32
    ticket counters (``scan.elsa_fwd``'s ``COUNT``; zero, as every launch leaves them) and ``n_states`` fp32 for the
    partition states. One pair a stream: launches in one stream's order share it, each done with it before the next
    starts, and launches in two streams never do. Each grown (a new buffer allocated on that stream, counters zeroed)
    when too short."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, _raw_stream(index))
    else:
        key = (device.type, device.index)
    got = _SCRATCH.get(key)
    if got is None:
        got = _SCRATCH[key] = [None, None]
    count, states = got
    if count is None or count.numel() < n_count:
        count = got[0] = torch.zeros(max(n_count, 256, 2 * count.numel() if count is not None else 0),
                                     dtype=torch.int32, device=device)
    if states is None or states.numel() < n_states:
        states = got[1] = torch.empty(max(n_states, 2 * states.numel() if states is not None else 0),
                                      dtype=torch.float32, device=device)
    return count, states


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


_SCRATCH_SLOT = "\0merge_scratch"  # a replay's slots: the pair merge_scratch gave its first derived slot


def _scratch_of(device: torch.device, n_count: int, n_states: int, which: int, slots) -> torch.Tensor:
    """A replay's ``merge_count`` (``which`` 0) or ``part`` (1) slot of a fused launch (:func:`replay.derived`): the
    buffers of the stream it runs on, looked up once a replay (the second slot takes the pair the first kept)."""
    got = slots.get(_SCRATCH_SLOT)
    if got is None:
        got = slots[_SCRATCH_SLOT] = merge_scratch(device, n_count, n_states)
    return got[which]


@functools.lru_cache(maxsize=512)
def _scratch_maker(device: torch.device, n_count: int, n_states: int, which: int):
    """One :func:`_scratch_of` a (device, sizes, buffer): plans of equal launches have equal preparations."""
    return functools.partial(_scratch_of, device, n_count, n_states, which)


def not_inline(q, k, v, *, scale: float, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
               precision=None, long: bool = True) -> Optional[str]:
    """Why :func:`attention` on these (fake) tensors cannot be traced into ``wrap_triton`` launches (the inline op,
    kernels/ops.py, then traces to the opaque one), or None. Planned as a call is:

    * the Hopper kernel takes it (``hopper.eligible`` without its size rule for eager calls: replayed launches
      encode the TMA maps): ``wrap_triton`` cannot launch Gluon kernels;
    * K/V are staged by heads or key chunks (a memory budget, which the pieces :meth:`_Region.carve` allocates
      while tracing would not keep; the reverse chunks are carved from the output itself, a mutation through
      ``as_strided`` that torch.compile's functionalization refuses);
    * ``ELSA_COMPILE_OP=auto`` and a long call (:func:`long_call`; not asked with ``long=False``)."""
    from . import hopper

    why_long = long_call(q, k, v, is_causal) if long else None
    if why_long is not None:
        return why_long
    if q.dtype == torch.float32 and precision is None:
        precision = default_precision(q.device)
    out = _new_out(q, *q.shape[:3], v.shape[3])
    plan = cached_plan(call_signature(q, k, v, out, precision=precision, mask=mask, q_lengths=q_lengths,
                                      kv_lengths=kv_lengths, is_causal=is_causal))
    if plan.staging[0] != "whole":
        return f"K/V staged by {plan.staging[0]}"
    if not plan.hopper:
        return None
    how = "force" if plan.hopper_mode == "1" else plan.hopper_mode
    why_not = hopper.eligible(q, k, v, out, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, varlen=False,
                              state=None, scale=scale, precision=precision, is_causal=is_causal, how=how)
    return HOPPER_CALL if why_not is None else None


HOPPER_CALL = "the Hopper kernel"  # (not_inline's answer for a call the Hopper kernel takes)


# ELSA_COMPILE_OP=auto: calls of at least this many multiply-adds (QK^T and PV, B * Hq * Nq * Nk * (D + Dv), halved
# when causal) trace to the opaque op. About 100 us of kernel time on an H100/H200 (CLIP-L/14-336 fp32 b8's call,
# 5.4e9 in precise: 174 us on an H200, session 52), far above the opaque op's extra host time (~50 us a call, session
# 34), which a call this long hides; the inline op costs torch 2.11's Inductor compile time for each launch of a user
# kernel (session 53, H200: CLIP-L/14-336 fp32 cold compile 15.8 s native, 25.8 s inline with 48 launches, 21.6 s with
# 24, 13.8 s opaque; 0.2-0.3 s a launch, of which the TTIR memo's misses in Inductor's lowering, fixed since, were
# about 0.1 s).
OPAQUE_MACS = {torch.float32: 3e9, torch.float16: 1e10, torch.bfloat16: 1e10}


def long_call(q, k, v, is_causal: bool) -> Optional[str]:
    """Why ``ELSA_COMPILE_OP=auto`` traces this call to the opaque op (:data:`OPAQUE_MACS`), or None."""
    if knobs.get(knobs.COMPILE_OP) != "auto":
        return None
    B, Hq, Nq, D = q.shape
    macs = B * Hq * Nq * k.shape[2] * (D + v.shape[3]) * (0.5 if is_causal else 1.0)
    bound = OPAQUE_MACS.get(q.dtype, OPAQUE_MACS[torch.float32])
    if macs < bound:
        return None
    return f"a long call ({macs:.3g} multiply-adds >= {bound:.3g}, ELSA_COMPILE_OP=auto)"


# launch.precompile: the kernels of calls traced to the opaque op, compiled in the background while torch.compile
# traces (issue 33's compile time, session 54: the opaque op compiles them on its first run, after Inductor's compile,
# serially; Triton's compile leaves Python most of the GIL: a pure-Python thread kept 84 % of its rate beside one on a
# CPU). Stats for benchmarks/lab/compile_cache.py; one submission per call signature.
PRECOMPILE = {"calls": 0, "kernels": 0, "loaded": 0, "compiled_s": 0.0, "errors": 0, "last_error": None, "not": {}}
_PRECOMPILED: set = set()
_POOL: list = []  # [ThreadPoolExecutor], made at the first submission
_STATS_LOCK = threading.Lock()
PENDING: list = []  # the futures of kernels submitted and not yet waited for (wait_precompiled)


def precompile(q, k, v, *, scale: float, mask=None, is_causal=False, precision=None) -> Optional[str]:
    """Starts compiling, in background threads, the Triton kernels that :func:`attention` would launch for a call on
    these fake tensors (static sizes, a CUDA device), for a call that torch.compile traces to the opaque op: its
    launches are recorded on the fake tensors (``replay.wrapped_launches`` given a list: the launches a real run
    makes, a bool mask as its ``uint8`` view) and each kernel is compiled by Triton's ``warmup`` for the same
    specialisation (tensors as their dtype and 16-byte alignment), into the caches its first run reads; the opaque op
    waits for those still compiling (:func:`wait_precompiled`). Returns None when started, else why not: the knob
    (``ELSA_PRECOMPILE=0``), a call the inline op takes (Inductor compiles its kernels), or one the launcher cannot
    plan on fake tensors (K/V staged by heads or key chunks: they compile at their first run). A call the Hopper
    kernel takes runs on the opaque op whatever ``ELSA_COMPILE_OP`` says: its Gluon kernel is compiled here too, its
    TMA descriptors made on the fake tensors (Triton specialises a descriptor on its dtype, block and layout alone:
    ``hopper._desc``; a kernel this fails to compile compiles at its first run, the failure logged)."""
    from . import interface, ops

    if knobs.get(knobs.PRECOMPILE) == "0":
        return "ELSA_PRECOMPILE=0"
    if occ.interpreting() or not _triton_device(q):
        return "not a CUDA call compiled by Triton"
    if not ops._static(q, k, v, mask):
        return "symbolic sizes"
    precision = precision or None
    if q.dtype == torch.float32 and precision is None:
        precision = default_precision(q.device)
    inline = interface.inference_op() is ops.attention_inline_op and long_call(q, k, v, is_causal) is None
    sig = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape), v.stride(), q.dtype, q.device,
           None if mask is None else (tuple(mask.shape), mask.stride(), mask.dtype), float(scale), bool(is_causal),
           precision, inline)
    if sig in _PRECOMPILED:
        return "submitted before"
    if len(_PRECOMPILED) >= 4096:  # (signatures without end, as a growing cache's: compiled again at worst)
        _PRECOMPILED.clear()
    _PRECOMPILED.add(sig)
    launches: list = []
    with torch._guards.detect_fake_mode((q, k, v)) or contextlib.nullcontext(), replay.wrapped_launches(launches):
        why = not_inline(q, k, v, scale=scale, mask=mask, is_causal=is_causal, precision=precision, long=False)
        if why is None and inline:
            return "the inline op: Inductor compiles its kernels"
        if why is not None and why != HOPPER_CALL:  # (the Hopper kernel's call runs on the opaque op: compiled here)
            return why
        # (the Hopper kernel's TMA descriptors are made on the fake tensors without their checks: hopper._desc)
        attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, precision=precision, return_lse=False)
    if not launches:
        return "no launches"
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max_workers=2, thread_name_prefix="elsa-precompile"))
    PRECOMPILE["calls"] += 1
    index = q.device.index if q.device.index is not None or q.device.type != "cuda" else torch.cuda.current_device()
    for fn, grid, args, kwargs in launches:  # (a kernel a task: the pool's two threads compile two at once)
        PENDING.append(_POOL[0].submit(_warm, fn, grid, tuple(_mock(a) for a in args),
                                       {n: _mock(a) for n, a in kwargs.items()}, index))
    return None


def wait_precompiled() -> None:
    """Waits for every kernel :func:`precompile` submitted (called by the opaque op before it launches: a first run
    that came before the background compile finished compiled the same kernel again in the main thread, beside it,
    in session 55's GPU test of a short trace). ``_warm`` never raises."""
    while PENDING:
        PENDING.pop().result()


def _triton_device(t) -> bool:
    """Whether ``t``'s calls run Triton's compiled kernels (a CUDA device; a test without a GPU says yes for CPU fake
    tensors on an sm_90 target)."""
    return t.device.type == "cuda"


def _mock(a):
    """A launch argument for Triton's ``warmup``: a (fake) tensor as a mock of its dtype and 16-byte alignment (its
    storage offset: Inductor's and the caching allocator's storages are aligned), anything else as it is."""
    if not isinstance(a, torch.Tensor):
        return a
    if not _MOCK:
        from triton.runtime.jit import MockTensor

        class Aligned(MockTensor):  # (MockTensor's own address is 0: aligned)
            def __init__(self, t):
                super().__init__(t.dtype, list(t.shape))
                self.address = t.storage_offset() * t.element_size()

            def data_ptr(self):
                return self.address

        _MOCK.append(Aligned)
    return _MOCK[0](a)


_MOCK: list = []  # [the mock tensor class], made at the first use (triton imported then)


def _warm(fn, grid, args, kwargs, device_index) -> None:
    """Compiles one recorded launch's kernel (a pool thread); a failure is counted and logged, and the kernel then
    compiles at its first run."""
    import time

    t0 = time.perf_counter()
    error = loaded = None
    try:
        with torch.cuda.device(device_index) if device_index is not None else contextlib.nullcontext():
            kernel = fn.warmup(*args, grid=grid, **kwargs)
            loaded = _load(kernel)  # (never raises)
    except Exception as e:  # noqa: BLE001 - an optimisation: the first run compiles what this did not
        error = f"{getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}"[:300]
        log.info("elsa_surgery: precompiling a kernel failed (it compiles at its first run): %s", error)
    with _STATS_LOCK:  # (the pool's threads)
        PRECOMPILE["kernels" if error is None else "errors"] += 1
        PRECOMPILE["loaded"] += loaded is True
        PRECOMPILE["last_error"] = error or PRECOMPILE["last_error"]
        PRECOMPILE["compiled_s"] += time.perf_counter() - t0


def _load(kernel) -> Optional[bool]:
    """Loads a kernel that :func:`_warm` compiled onto the current GPU and builds its launcher (Triton's
    ``CompiledKernel._init_handles``, which its first launch calls otherwise): the launcher is a C module that Triton
    builds with the host compiler for each new signature, about 0.25 s each on a cold cache (session 56's profile of
    LLaMA-13B-shaped 4K bf16: three of the first run's 0.8 s in the main thread). True when loaded, None where there
    is nothing to load (no GPU: the CPU tests compile for an sm_90 target; a Triton whose kernel has no
    ``_init_handles``), False on a failure (logged: the first launch loads it)."""
    init = getattr(kernel, "_init_handles", None)
    if init is None or not torch.cuda.is_available():
        return None
    try:
        init()
    except Exception as e:  # noqa: BLE001 - an optimisation: the first launch loads what this did not
        log.info("elsa_surgery: loading a precompiled kernel failed (its first launch loads it): %s: %s",
                 type(e).__name__, str(e)[:200])
        return False
    return True


def mask_tile_classes(mask, nq: int, nk: int, block_m: int, block_n: int) -> torch.Tensor:
    """The class of every ``block_m x block_n`` tile of ``mask`` (``[P, Hm, Nq | 1, Nk | 1]``) over an
    ``nq x nk`` call: int8 ``[P, Hm, ceil(nq / block_m) * ceil(nk / block_n)]`` (0 hides every pair, 2 none, 1 some;
    ``scan.mask_tile_classes``: one program per tile, a pass over the mask)."""
    m, kind, (sp, sh, sm, sn), period = _mask_arg(mask)
    heads = m.shape[1]
    n_mb, n_nb = -(-nq // block_m), -(-nk // block_n)
    classes = torch.empty((period, heads, n_mb * n_nb), device=m.device, dtype=torch.int8)
    replay.allocated(f"mask_classes_{block_m}x{block_n}", classes)
    replay.launch(_scan().mask_tile_classes, (n_mb * n_nb, heads, period), m, classes, nq, nk, n_nb,
                  sp, sh, sm, sn, classes.stride(0), classes.stride(1) if heads > 1 else 0,
                  BLOCK_M=block_m, BLOCK_N=block_n, MASK_KIND=kind, num_warps=4, num_stages=1)
    return classes


def mask_tile_ranges(classes: torch.Tensor, n_mb: int, n_nb: int, by_keys: bool = False) -> torch.Tensor:
    """The ranges of blocks each line of tiles needs (``scan.mask_tile_ranges``), from :func:`mask_tile_classes`'s
    ``classes`` of an ``n_mb x n_nb`` tiling: int32 ``[P, Hm, lines, 4]``, a line being a row tile (key blocks, the
    forward and the backward's row pass) or, ``by_keys``, a key tile (row blocks, the backward's key pass)."""
    period, heads = classes.shape[:2]
    lines, items, item_stride, line_stride = (n_nb, n_mb, n_nb, 1) if by_keys else (n_mb, n_nb, 1, n_nb)
    ranges = torch.empty((period, heads, lines, 4), device=classes.device, dtype=torch.int32)
    replay.allocated(f"mask_ranges_{n_mb}x{n_nb}_{'keys' if by_keys else 'rows'}", ranges)
    replay.launch(_scan().mask_tile_ranges, (lines, heads, period), classes, ranges, items, item_stride, line_stride,
                  classes.stride(0), classes.stride(1) if heads > 1 else 0, ranges.stride(0),
                  ranges.stride(1) if heads > 1 else 0, CHUNK=min(1024, occ.next_pow2(items)), num_warps=4,
                  num_stages=1)
    return ranges


def _mask_ranges(mask, d: Dims, cfg, n_mblocks: int) -> torch.Tensor:
    """The key-block ranges of every row tile of ``mask``, read by ``scan.elsa_fwd`` (``HAS_RANGES``)."""
    classes = mask_tile_classes(mask, d.Nq, d.Nk, cfg.block_m, cfg.block_n)
    return mask_tile_ranges(classes, n_mblocks, -(-d.Nk // cfg.block_n))


def _head_group_fwd(fwd, q, k, v, out, lse, mask, kv_per_launch, groups, part_len, stager, ranges=None):
    """One launch per group of ``kv_per_launch`` K/V heads (every batch row), K/V staged for that group only
    into one reused buffer (``stager``); each launch finishes its rows, so nothing else is kept between launches."""
    Nk = v.shape[2]
    region = _Region.buffer(q, k.shape[0], _specs_bytes(stager.specs(kv_per_launch, Nk)))
    headed_mask = mask is not None and mask.shape[1] != 1
    for h0 in range(0, v.shape[1], kv_per_launch):
        h1 = min(v.shape[1], h0 + kv_per_launch)
        k_op, v_op, split = _stage(stager, region, k[:, h0:h1], v[:, h0:h1])
        qs = slice(h0 * groups, h1 * groups)
        fwd(q[:, qs], k_op, v_op, out[:, qs], None if lse is None else lse[:, qs],
            mask[:, qs] if headed_mask else mask, 0, Nk, part_len, q, q, q, False, 0, split,
            None if ranges is None else ranges[:, qs] if headed_mask else ranges)


def _key_chunk_fwd(fwd, q, k, v, out, lse, mask, chunks, out_region, block_n, rows, stager):
    """Phase 1 once per key chunk ``(start, end, capacity)`` of ``chunks``, K/V staged (``stager``) one chunk
    at a time: into a reused buffer (``capacity`` None), or into the first ``capacity`` bytes of every block
    of ``out_region``, the output rows that no launch has touched yet (reverse order, causal calls:
    ``occupancy.reverse_key_chunks``; ``out_region`` is None for chunks in key order).

    Extra memory: the buffer (the longest chunk it stages) and two fp32 values per row (``m``, ``S``);
    ``W`` accumulates in ``out`` (fp32: the tensor-core fp32 modes are the only staged ones).
    Each launch reads the state the previous one wrote and folds its chunk in; the rows finish in their
    last chunk (out and lse), rows outside a chunk's reach are left alone.
    """
    B, Hkv = k.shape[0], k.shape[1]
    longest = max((e - s for s, e, cap in chunks if cap is None), default=0)
    buffer = _Region.buffer(q, B, _specs_bytes(stager.specs(Hkv, longest))) if longest else None
    f32 = dict(device=v.device, dtype=torch.float32)
    pm, ps = torch.empty(rows, **f32), torch.empty(rows, **f32)
    keyed_mask = mask is not None and mask.shape[-1] != 1
    order = 1 if out_region is None else 2  # the kernel's CHUNKED: key order / reverse order
    for s, e, cap in chunks:
        k_op, v_op, split = _stage(stager, buffer if cap is None else out_region, k[:, :, s:e], v[:, :, s:e], cap)
        fwd(q, k_op, v_op, out, lse, mask[..., s:e] if keyed_mask else mask,
            s, e - s, _partition_len(e - s, 1, block_n), pm, ps, q, False, order, split)


def attention(q, k, v, *, scale: float, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
              precision=None, return_lse=True, out=None, lse=None, num_partitions=None, eta=None):
    """Dense attention: ``(out [B,Hq,Nq,Dv], lse [B,Hq,Nq] or None)``. ``out``/``lse`` may be preallocated."""
    out, lse, _ = _run(q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=q_lengths,
                       kv_lengths=kv_lengths, is_causal=is_causal, out=out, lse=lse, want_lse=return_lse,
                       num_partitions=num_partitions, eta=eta)
    return out, (lse if return_lse else None)


def attention_state(q, k, v, *, scale: float, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
                    precision=None, state=None, num_partitions=None, eta=None):
    """Dense partial attention as a monoid state ``(m, S, W)``: fp32 ``[B,Hq,Nq]``, ``[B,Hq,Nq]``, ``[B,Hq,Nq,Dv]``."""
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[3]
    if state is None:
        f32 = dict(device=q.device, dtype=torch.float32)
        state = (torch.empty((B, Hq, Nq), **f32), torch.empty((B, Hq, Nq), **f32),
                 torch.empty((B, Hq, Nq, Dv), **f32))
    _run(q, k, v, scale=scale, precision=precision, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
         is_causal=is_causal, state=state, want_lse=False, num_partitions=num_partitions, eta=eta)
    return state


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                     is_causal=False, precision=None, return_lse=True, out=None, lse=None, num_partitions=None,
                     eta=None):
    """Packed varlen: ``(out [total_q,Hq,Dv], lse [Hq,total_q] or None)``."""
    B = cu_seqlens_q.shape[0] - 1
    out, lse, _ = _run(q, k, v, scale=scale, precision=precision, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                       is_causal=is_causal, varlen_dims=(B, int(max_seqlen_q), int(max_seqlen_k)), out=out,
                       lse=lse, want_lse=return_lse, num_partitions=num_partitions, eta=eta)
    return out, (lse if return_lse else None)
