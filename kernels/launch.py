"""Launch code: allocate outputs, pick tiles and partitions, run phase 1 and (if split) phase 2.

Plain functions on tensors (no torch.library here: ops.py wraps these). Inputs are never copied:
strides go to the kernels as they are. Sizes are runtime arguments of the kernels, so a new sequence
length reuses the compiled kernel. No host syncs: nothing here reads tensor data.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import occupancy as occ
from . import replay

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
    """(tensor for the kernel, kind, strides). Bool masks are reinterpreted as uint8 (a view, no copy)."""
    if mask is None:
        return None, 0, (0, 0, 0, 0), 1
    kind = 1 if mask.dtype == torch.bool else 2
    m = mask.view(torch.uint8) if kind == 1 else mask
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
        """``(region, bytes of one row)`` over the fp32 output ``[B, Hq, Nq, Dv]``: its rows ``[0, r)`` of every
        head are one block per batch row when laid out ``[B, Nq, Hq, Dv]`` in memory (``_new_out``), one block
        per batch row and head when contiguous; ``None`` for other layouts."""
        B, Hq, Nq, Dv = out.shape
        if out.dtype != torch.float32 or out.data_ptr() % 16:
            return None
        flat = out.as_strided((out.numel(),), (1,), out.storage_offset())
        if out.transpose(1, 2).is_contiguous():
            region, row = cls(flat, (Nq * Hq * Dv * 4, 0), False), Hq * Dv * 4
        elif out.is_contiguous():
            region, row = cls(flat, (Hq * Nq * Dv * 4, Nq * Dv * 4), True), Dv * 4
        else:
            return None
        if region.bstride % STRIDE_BYTES or region.hstride % STRIDE_BYTES:
            return None  # strides of the staged pieces would not divide by 16 elements (see STRIDE_BYTES)
        return region, row

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
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


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
    cuda = q.is_cuda
    key = ((q is k, k is v, q is v, cu_q is cu_k, q_lengths is kv_lengths), q.device, torch.cuda.current_device() if cuda else None,
           cuda and torch.cuda.is_current_stream_capturing(), float(scale), precision, bool(is_causal), varlen_dims,
           bool(want_lse), num_partitions, eta, _geometry(q), _geometry(k), _geometry(v), _geometry(mask),
           _geometry(q_lengths), _geometry(kv_lengths), _geometry(cu_q), _geometry(cu_k), _geometry(out),
           _geometry(lse), None if state is None else tuple(map(_geometry, state)))
    return replay.run(key, slots, plan_and_run, _ALIASES)


def _plan_run(q, k, v, *, scale, precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=None, cu_k=None,
              is_causal=False, varlen_dims=None, out=None, lse=None, state=None, want_lse=True,
              num_partitions=None, eta=None):
    """Plans a call and runs it (see :func:`_run`)."""
    scan = _scan()
    from . import hopper  # after _scan(): Triton is imported only when kernels run

    hopper_mode = hopper.mode()  # read on every call: a bad ELSA_HOPPER raises wherever the call would run

    if q.dtype == torch.float32 and precision is None:  # resolved once: the Hopper path below reads it too
        precision = default_precision(q.device)
    dot = _dot_kind(q.dtype, precision, q.device)
    varlen = varlen_dims is not None
    if varlen:
        B, Nq, Nk = varlen_dims
        Hq, D = q.shape[1], q.shape[2]
        Hkv, Dv = k.shape[1], v.shape[2]
    else:
        B, Hq, Nq, D = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    groups = Hq // Hkv
    rows_per_kv = q.shape[0] * groups // max(B, 1) if varlen else Nq * groups  # varlen: mean per sequence
    BD, BDV = occ.block_dim(D), occ.block_dim(Dv)
    BH = B * Hq
    rows = BH * Nq

    def tiles(dot_):
        cfg_ = occ.tile_config(dot_, D, Dv, max(Nq, Nk), bh=BH, nq=Nq, device=q.device,
                               causal=bool(is_causal))
        n_mb = -(-Nq // cfg_.block_m) if Nq > 0 else 0
        parts_ = occ.num_partitions(q.device, tiles=n_mb * BH, n_k=Nk, block_n=cfg_.block_n, rows=rows, dv=Dv,
                                    out_bytes=rows * Dv * q.element_size(), eta=eta, forced=num_partitions)
        part_len_ = _partition_len(Nk, parts_, cfg_.block_n)
        return cfg_, n_mb, max(1, -(-max(Nk, 1) // part_len_)), part_len_

    if state is None:
        if out is None:  # dense: [B, Nq, Hq, Dv] in memory, as SDPA's flash/cuDNN outputs (_new_out)
            out = q.new_empty((q.shape[0], Hq, Dv)) if varlen else _new_out(q, B, Hq, Nq, Dv)
            replay.allocated("out", out)
        if want_lse and lse is None:
            lse = torch.empty((Hq, q.shape[0]) if varlen else (B, Hq, Nq), device=q.device, dtype=torch.float32)
            replay.allocated("lse", lse)

    def staging(dot_, cfg_, n_mb, parts_):
        """(stage?, plan): whether K/V are staged and in which pieces (occupancy.stage_plan); causal key
        chunks run in reverse order, staged in the output's unwritten rows where they fit:
        ``("rkeys", (chunks, region))`` (occupancy.reverse_key_chunks)."""
        split_ = dot_ in occ.SPLIT_DOTS
        stage_ = split_ or (occ.stage_operands(dot_, rows_per_kv) and not _keys_contiguous(v, varlen))
        if not (stage_ and not varlen and parts_ == 1 and state is None):
            return stage_, ("whole", 0)
        per_key = (split_bytes_per_key(D, Dv, cfg_.block_n, dot_ == occ.DOT_F16X3) if split_
                   else Dv * v.element_size())
        plan_ = occ.stage_plan(
            q.device, n_k=Nk, block_n=cfg_.block_n, batch=B, kv_heads=Hkv, groups=groups, m_blocks=n_mb,
            out_bytes=rows * Dv * q.element_size(), v_bytes_per_key_head=per_key, stats_bytes=2 * rows * 4,
            causal=bool(is_causal),
            min_chunk_keys=occ.MIN_KEYS_PER_SPLIT_CHUNK if split_ else occ.MIN_KEYS_PER_STAGE_CHUNK)
        ext_keys = occ.reverse_chunks_env()
        if plan_[0] != "keys" or not is_causal or q_lengths is not None or kv_lengths is not None or ext_keys is None:
            return stage_, plan_
        region = _Region.of_output(out)
        if region is None:
            return stage_, plan_
        region, row_bytes = region
        heads = 1 if region.per_head else Hkv  # K/V heads per block of the region
        chunks = occ.reverse_key_chunks(
            n_q=Nq, n_k=Nk, block_m=cfg_.block_m, block_n=cfg_.block_n, row_bytes=row_bytes,
            key_bytes=heads * per_key, fixed_bytes=16 * 6 + heads * Dv * 4, ext_keys=ext_keys or plan_[1])
        return stage_, ("rkeys", (chunks, region))

    split_dot = occ.precise_split(dot, rows_per_kv, eligible=not varlen and state is None,
                                  work=float(BH) * Nq * Nk * D)
    if split_dot == occ.DOT_F16X3V and (BD != D or BDV != Dv):
        # V split in the kernel (DOT 6) only for head dims that need no padding: on an H100 a call with
        # D=40, Dv=32 returned NaN rows (masked) or faulted (unmasked); the full split runs instead
        split_dot = occ.DOT_F16X3
    if split_dot != dot:
        cfg, n_mblocks, parts, part_len = tiles(split_dot)
        stage, plan = staging(split_dot, cfg, n_mblocks, parts)
        # the split runs with one partition; causal calls whose memory budget allows only key chunks of
        # little work per launch split K alone, V in the kernel: chunks twice as long
        # (occupancy.MIN_CAUSAL_SPLIT_CHUNK_WORK), unless ELSA_PRECISE_SPLIT forces a kind
        short_chunks = plan[0] == "keys" and BH * Nq * plan[1] * D < occ.MIN_CAUSAL_SPLIT_CHUNK_WORK
        if parts == 1 and not (is_causal and short_chunks and not occ.split_forced()):
            dot = split_dot
        elif parts == 1 and BD == D and BDV == Dv:  # same tiles ("f16x3"), a plan for K's bytes alone
            dot = occ.DOT_F16X3V
            stage, plan = staging(dot, cfg, n_mblocks, parts)
    split = dot in occ.SPLIT_DOTS
    if not split:
        cfg, n_mblocks, parts, part_len = tiles(dot)
        if dot in (occ.DOT_LOWP, occ.DOT_IEEE, occ.DOT_TF32) and parts == 1 and n_mblocks and BH:
            why_not = hopper.eligible(q, k, v, out, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                      varlen=varlen, state=state, is_causal=bool(is_causal), scale=scale,
                                      precision=precision, how=hopper_mode)
            if why_not is None:
                hopper.forward(q, k, v, out, lse if want_lse else None, scale=scale, is_causal=is_causal,
                               precision=precision)
                return out, lse, state
        stage, plan = staging(dot, cfg, n_mblocks, parts)
    if n_mblocks == 0 or BH == 0:
        return out, lse, state
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
    if parts > 1:
        pm = torch.empty((parts, BH, Nq), **f32)
        ps = torch.empty((parts, BH, Nq), **f32)
        pw = torch.empty((parts, BH, Nq, Dv), **f32)
        for name, t in (("part_m", pm), ("part_s", ps), ("part_w", pw)):
            replay.allocated(name, t)
    elif state is not None:
        pm, ps, pw = state
    else:
        pm = ps = pw = dummy
    write_state = parts > 1 or state is not None

    def fwd(q_, k_, v_, out_, lse_, mask_, koff, klim, part_len_, pm_, ps_, pw_, write_state_, chunked,
            split_=None):
        """One phase-1 launch over the heads of ``q_`` (a head slice of q, with the matching K/V/out/lse);
        ``split_``: ``(kl, ki, vl, vi)`` when K/V are the hi parts of a ``_SplitKV``."""
        mask_t, mask_kind, sm, period = _mask_arg(mask_)
        hq = q_.shape[1]
        kl, ki, vl, vi = split_ if split_ is not None else (dummy,) * 4
        si = (ki.stride(0), ki.stride(1), vi.stride(0), vi.stride(1)) if split_ is not None else (0,) * 4
        # causal: heads whose row blocks run heaviest first together, as many as their keys of this launch fit
        # in L2 (occupancy.causal_head_group)
        head_group = (occ.causal_head_group(q.device, n_k=min(klim, Nk - koff), kv_bytes_per_key=q.element_size()
                                            * (D + Dv), groups=groups, bh=B * hq, m_blocks=n_mblocks)
                      if is_causal else 1)
        replay.launch(
            scan.elsa_fwd, (n_mblocks * B * hq, parts), q_, k_, v_, mask_t if mask_t is not None else dummy,
            q_lengths if q_lengths is not None else dummy, kv_lengths if kv_lengths is not None else dummy,
            cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy,
            out_ if out_ is not None else dummy, lse_ if lse_ is not None else dummy, pm_, ps_, pw_,
            kl, ki, vl, vi,
            float(scale) * LOG2E, Nq, Nk, hq, groups, n_mblocks, part_len_, Nq, B * hq, period, koff, klim,
            head_group,
            *_strides4(q_, varlen), *_strides4(k_, varlen), *_strides4(v_, varlen), *si, *sm,
            *so, *sl,
            D=D, DV=Dv, BLOCK_D=BD, BLOCK_DV=BDV, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), HAS_QLEN=q_lengths is not None,
            HAS_KVLEN=kv_lengths is not None, VARLEN=varlen, WRITE_STATE=write_state_,
            WRITE_LSE=lse_ is not None, DOT=dot, CHUNKED=chunked,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    lse_arg = lse if want_lse else None
    stager = (_SplitKV(k, v, block_n=cfg.block_n, split_v=dot == occ.DOT_F16X3) if split
              else _TransposedV(k, v))
    if plan[0] == "heads":
        _head_group_fwd(fwd, q, k, v, out, lse_arg, mask, plan[1], groups, part_len, stager)
        return out, lse, state
    if plan[0] in ("keys", "rkeys"):
        chunks, region = (plan[1] if plan[0] == "rkeys"
                          else (tuple((s, min(Nk, s + plan[1]), None) for s in range(0, Nk, plan[1])), None))
        _key_chunk_fwd(fwd, q, k, v, out, lse_arg, mask, chunks, region, cfg.block_n, rows, stager)
        return out, lse, state
    split_args = None
    if split:
        k, v, split_args = _stage(stager, _Region.buffer(q, B, _specs_bytes(stager.specs(Hkv, Nk))), k, v)
    elif stage:
        staged = _stage_v(v, varlen)
        if staged is not v:
            replay.derived("v_staged", staged, lambda slots: _stage_v(slots["v"], varlen))
        v = staged
    fwd(q, k, v, out, lse_arg, mask, 0, Nk, part_len, pm, ps, pw, write_state, 0, split_args)
    if parts > 1:
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


def _head_group_fwd(fwd, q, k, v, out, lse, mask, kv_per_launch, groups, part_len, stager):
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
            mask[:, qs] if headed_mask else mask, 0, Nk, part_len, q, q, q, False, 0, split)


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
