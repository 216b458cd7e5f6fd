"""Launch code: allocate outputs, pick tiles and partitions, run phase 1 and (if split) phase 2.

Plain functions on tensors (no torch.library here: ops.py wraps these). Inputs are never copied:
strides go to the kernels as they are. Sizes are runtime arguments of the kernels, so a new sequence
length reuses the compiled kernel. No host syncs: nothing here reads tensor data.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from . import occupancy as occ

LOG2E = 1.4426950408889634


def _scan():
    from . import scan  # imported on first launch, after TRITON_INTERPRET has been decided

    return scan


def _dot_kind(dtype: torch.dtype, precision: Optional[str]) -> int:
    if dtype == torch.bfloat16 and occ.interpreting():
        return occ.DOT_INTERP_BF16
    if dtype in (torch.float16, torch.bfloat16):
        return occ.DOT_LOWP
    if dtype == torch.float32:
        return occ.DOT_OF_PRECISION[precision or "strict"]
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


class _TransposedV:
    """Stages V transposed (keys contiguous) for the TF32 modes, into one reused buffer; K is read in place."""

    def __init__(self, k, v, heads: int, keys: int):
        self.buf = v.new_empty(v.shape[0] * heads * v.shape[3] * keys)

    def __call__(self, k, v):
        B, H, N, Dv = v.shape
        staged = self.buf[:B * H * Dv * N].view(B, H, Dv, N)
        staged.copy_(v.transpose(2, 3))
        return k, staged.transpose(2, 3), None


class _SplitKV:
    """Splits K and V for ``DOT_F16X3`` (``scan.split_f16``) into reused buffers: fp16 hi/lo parts of both,
    K's inverse scale per key, V's per head dim of each ``block_n`` keys (``split_bytes_per_key``). With
    ``split_v=False`` (``DOT_F16X3V``) K alone: V goes to the kernel as it is and is split there."""

    def __init__(self, k, v, heads: int, keys: int, *, block_n: int, split_v: bool = True):
        B, D, Dv = k.shape[0], k.shape[3], v.shape[3]
        n = B * heads * keys
        self.block_n = block_n
        self.split_v = split_v
        self.kh, self.kl = k.new_empty(2 * n * D, dtype=torch.float16).chunk(2)
        self.ki = k.new_empty(n)
        if split_v:
            self.vh, self.vl = k.new_empty(2 * n * Dv, dtype=torch.float16).chunk(2)
            self.vi = k.new_empty(B * heads * -(-keys // block_n) * Dv)

    def __call__(self, k, v):
        scan = _scan()
        B, H, N, D = k.shape
        Dv = v.shape[3]
        kh, kl = (t[:B * H * N * D].view(B, H, N, D) for t in (self.kh, self.kl))
        ki = self.ki[:B * H * N].view(B, H, N)
        parts = [(k, kh, kl, ki, True)]
        if self.split_v:
            vh, vl = (t[:B * H * N * Dv].view(B, H, N, Dv) for t in (self.vh, self.vl))
            nb = -(-N // self.block_n)
            vi = self.vi[:B * H * nb * Dv].view(B, H, nb, Dv)
            parts.append((v, vh, vl, vi, False))
        else:  # DOT_F16X3V: V goes to the kernel as it is (its lo/scale slots get K's, unread)
            vh, vl, vi = v, kl, ki
        for x, hi, lo, inv, per_row in parts:
            c = x.shape[3]
            bc = occ.block_dim(c)
            br = max(1, 4096 // bc) if per_row else self.block_n
            scan.split_f16[(-(-N // br), B * H)](
                x, hi, lo, inv, N, H, *x.stride(), inv.stride(0), inv.stride(1),
                C=c, BLOCK_R=br, BLOCK_C=bc, PER_ROW=per_row, num_warps=4)
        return kh, vh, (kl, ki, vl, vi)


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


def _run(q, k, v, *, scale, precision, mask=None, q_lengths=None, kv_lengths=None, cu_q=None, cu_k=None,
         is_causal=False, varlen_dims=None, out=None, lse=None, state=None, want_lse=True,
         num_partitions=None, eta=None):
    """Shared launcher. Dense: q [B,Hq,Nq,D]. Varlen: q [total,Hq,D] with varlen_dims=(B, max_q, max_k)."""
    scan = _scan()
    dot = _dot_kind(q.dtype, precision)
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

    def staging(dot_, cfg_, n_mb, parts_):
        """(stage?, plan): whether K/V are staged and in which pieces (occupancy.stage_plan)."""
        split_ = dot_ in occ.SPLIT_DOTS
        stage_ = split_ or (occ.stage_operands(dot_, rows_per_kv) and not _keys_contiguous(v, varlen))
        if not (stage_ and not varlen and parts_ == 1 and state is None):
            return stage_, ("whole", 0)
        per_key = (split_bytes_per_key(D, Dv, cfg_.block_n, dot_ == occ.DOT_F16X3) if split_
                   else Dv * v.element_size())
        return stage_, occ.stage_plan(
            q.device, n_k=Nk, block_n=cfg_.block_n, batch=B, kv_heads=Hkv, groups=groups, m_blocks=n_mb,
            out_bytes=rows * Dv * q.element_size(), v_bytes_per_key_head=per_key, stats_bytes=2 * rows * 4,
            causal=bool(is_causal),
            min_chunk_keys=occ.MIN_KEYS_PER_SPLIT_CHUNK if split_ else occ.MIN_KEYS_PER_STAGE_CHUNK)

    split_dot = occ.precise_split(dot, rows_per_kv, eligible=not varlen and state is None,
                                  work=float(BH) * Nq * Nk * D)
    if split_dot != dot:
        cfg, n_mblocks, parts, part_len = tiles(split_dot)
        stage, plan = staging(split_dot, cfg, n_mblocks, parts)
        # the split runs with one partition; causal calls whose memory budget allows only key chunks of
        # little work per launch split K alone, V in the kernel: chunks twice as long
        # (occupancy.MIN_CAUSAL_SPLIT_CHUNK_WORK), unless ELSA_PRECISE_SPLIT forces a kind
        short_chunks = plan[0] == "keys" and BH * Nq * plan[1] * D < occ.MIN_CAUSAL_SPLIT_CHUNK_WORK
        if parts == 1 and not (is_causal and short_chunks and not occ.split_forced()):
            dot = split_dot
        elif parts == 1:  # same tiles ("f16x3"), a plan for K's bytes alone
            dot = occ.DOT_F16X3V
            stage, plan = staging(dot, cfg, n_mblocks, parts)
    split = dot in occ.SPLIT_DOTS
    if not split:
        cfg, n_mblocks, parts, part_len = tiles(dot)
        stage, plan = staging(dot, cfg, n_mblocks, parts)
    if state is None:
        if out is None:  # dense: [B, Nq, Hq, Dv] in memory, as SDPA's flash/cuDNN outputs (_new_out)
            out = q.new_empty((q.shape[0], Hq, Dv)) if varlen else _new_out(q, B, Hq, Nq, Dv)
        if want_lse and lse is None:
            lse = torch.empty((Hq, q.shape[0]) if varlen else (B, Hq, Nq), device=q.device, dtype=torch.float32)
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
        scan.elsa_fwd[(n_mblocks * B * hq, parts)](
            q_, k_, v_, mask_t if mask_t is not None else dummy,
            q_lengths if q_lengths is not None else dummy, kv_lengths if kv_lengths is not None else dummy,
            cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy,
            out_ if out_ is not None else dummy, lse_ if lse_ is not None else dummy, pm_, ps_, pw_,
            kl, ki, vl, vi,
            float(scale) * LOG2E, Nq, Nk, hq, groups, n_mblocks, part_len_, Nq, B * hq, period, koff, klim,
            *_strides4(q_, varlen), *_strides4(k_, varlen), *_strides4(v_, varlen), *si, *sm,
            *so, *sl,
            D=D, DV=Dv, BLOCK_D=BD, BLOCK_DV=BDV, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), HAS_QLEN=q_lengths is not None,
            HAS_KVLEN=kv_lengths is not None, VARLEN=varlen, WRITE_STATE=write_state_,
            WRITE_LSE=lse_ is not None, DOT=dot, CHUNKED=chunked,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    lse_arg = lse if want_lse else None
    stager = (functools.partial(_SplitKV, block_n=cfg.block_n, split_v=dot == occ.DOT_F16X3) if split
              else _TransposedV)
    if plan[0] == "heads":
        _head_group_fwd(fwd, q, k, v, out, lse_arg, mask, plan[1], groups, part_len, stager)
        return out, lse, state
    if plan[0] == "keys":
        _key_chunk_fwd(fwd, q, k, v, out, lse_arg, mask, Nk, plan[1], cfg.block_n, rows, stager)
        return out, lse, state
    split_args = None
    if split:
        k, v, split_args = stager(k, v, Hkv, Nk)(k, v)
    elif stage:
        v = _stage_v(v, varlen)
    fwd(q, k, v, out, lse_arg, mask, 0, Nk, part_len, pm, ps, pw, write_state, False, split_args)
    if parts > 1:
        merge_m = 64 if BDV <= 128 else 32
        nmb = -(-Nq // merge_m)
        fm, fs, fw = state if state is not None else (dummy, dummy, dummy)
        scan.elsa_merge[(nmb * BH,)](
            pm, ps, pw, cu_q if cu_q is not None else dummy,
            out if out is not None else dummy, lse if want_lse and lse is not None else dummy, fm, fs, fw,
            Nq, Hq, nmb, Nq, BH, parts, *so, *sl,
            DV=Dv, BLOCK_DV=BDV, BLOCK_M=merge_m, VARLEN=varlen, WRITE_STATE=state is not None,
            WRITE_LSE=bool(want_lse and lse is not None), num_warps=4, num_stages=1,
        )
    return out, lse, state


def _head_group_fwd(fwd, q, k, v, out, lse, mask, kv_per_launch, groups, part_len, stager):
    """One launch per group of ``kv_per_launch`` K/V heads (every batch row), K/V staged for that group only
    into reused buffers (``stager``); each launch finishes its rows, so nothing else is kept between launches."""
    Nk = v.shape[2]
    stage = stager(k, v, kv_per_launch, Nk)
    headed_mask = mask is not None and mask.shape[1] != 1
    for h0 in range(0, v.shape[1], kv_per_launch):
        h1 = min(v.shape[1], h0 + kv_per_launch)
        k_op, v_op, split = stage(k[:, h0:h1], v[:, h0:h1])
        qs = slice(h0 * groups, h1 * groups)
        fwd(q[:, qs], k_op, v_op, out[:, qs], None if lse is None else lse[:, qs],
            mask[:, qs] if headed_mask else mask, 0, Nk, part_len, q, q, q, False, False, split)


def _key_chunk_fwd(fwd, q, k, v, out, lse, mask, Nk, chunk_keys, block_n, rows, stager):
    """Phase 1 once per key chunk, K/V staged (``stager``) one chunk at a time into reused buffers.

    Extra memory: the staging buffers (``chunk_keys`` keys) and two fp32 values per row (``m``, ``S``);
    ``W`` accumulates in ``out`` (fp32: the tensor-core fp32 modes are the only staged ones).
    Each launch reads the state the previous one wrote and finishes the rows whose last visible key it
    holds (out and lse); rows finished earlier are left alone.
    """
    stage = stager(k, v, v.shape[1], chunk_keys)
    f32 = dict(device=v.device, dtype=torch.float32)
    pm, ps = torch.empty(rows, **f32), torch.empty(rows, **f32)
    keyed_mask = mask is not None and mask.shape[-1] != 1
    for c0 in range(0, Nk, chunk_keys):
        n = min(chunk_keys, Nk - c0)
        k_op, v_op, split = stage(k[:, :, c0:c0 + n], v[:, :, c0:c0 + n])
        fwd(q, k_op, v_op, out, lse, mask[..., c0:c0 + n] if keyed_mask else mask,
            c0, n, _partition_len(n, 1, block_n), pm, ps, q, False, True, split)


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
