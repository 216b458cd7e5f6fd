"""``torch.library`` custom ops (namespace ``elsa_surgery``) around the launchers, with fake impls.

``torch.compile(fullgraph=True)`` sees each kernel call as one opaque op whose output shapes come from
the fake implementation (no graph break, no recompilation when only sequence lengths change), and the
launchers do no host syncs, so the calls capture in CUDA graphs. ``lse`` is always produced (it is
``B·H·N`` floats); callers drop it when not asked for.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import launch

NS = "elsa_surgery"
if __name__ != "elsa_surgery.kernels.ops":  # see kernels/__init__.py: never register the ops twice
    raise ImportError(f"the ELSA custom ops live in elsa_surgery.kernels.ops, not {__name__}")


@torch.library.custom_op(f"{NS}::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                 kv_lengths: Optional[Tensor], scale: float, is_causal: bool, precision: str) -> Tuple[Tensor, Tensor]:
    # contiguous under torch.compile (the eager path returns the [B, N, H, Dv]-in-memory layout): torch 2.11's
    # inductor asserts contiguous strides on this op's output whatever the fake reports
    out = q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
    out, lse = launch.attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                                kv_lengths=kv_lengths, precision=precision or None, return_lse=True, out=out)
    return out, lse


@attention_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
    B, Hq, Nq, _ = q.shape
    out = q.new_empty((B, Hq, Nq, v.shape[3]))  # the real output's strides too (contiguous, see above)
    return out, q.new_empty((B, Hq, Nq), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::attention_state", mutates_args=())
def attention_state_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                       kv_lengths: Optional[Tensor], scale: float, is_causal: bool,
                       precision: str) -> Tuple[Tensor, Tensor, Tensor]:
    m, S, W = launch.attention_state(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                                     kv_lengths=kv_lengths, precision=precision or None)
    return m, S, W


@attention_state_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
    B, Hq, Nq, _ = q.shape
    f32 = dict(dtype=torch.float32)
    return q.new_empty((B, Hq, Nq), **f32), q.new_empty((B, Hq, Nq), **f32), q.new_empty((B, Hq, Nq, v.shape[3]), **f32)


@torch.library.custom_op(f"{NS}::attention_varlen", mutates_args=())
def attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, scale: float, is_causal: bool,
                        precision: str) -> Tuple[Tensor, Tensor]:
    out, lse = launch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                                       is_causal=is_causal, precision=precision or None, return_lse=True)
    return out, lse


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, precision):
    total, Hq, _ = q.shape
    return q.new_empty((total, Hq, v.shape[2])), q.new_empty((Hq, total), dtype=torch.float32)
