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

# The dense output's layout under torch.compile: [B, Nq, Hq, Dv] in memory (STRIDED_OUTPUT, what the eager launcher
# writes) or contiguous [B, Hq, Nq, Dv]. Inductor asserts the fake's strides on a custom op's output
# (``assert_size_stride(buf, (B, H, N, Dv), (N*H*Dv, Dv, H*Dv, 1))``) and then reads it in place: the
# ``out.transpose(1, 2).reshape(B, Nq, Hq * Dv) @ W`` after attention becomes a matmul on the op's buffer, where a
# contiguous output costs a clone kernel before it. Seen with caches off on torch 2.14 (CPU, tests/test_compile.py,
# this op) and torch 2.11 (H100, a toy custom op of the same fake): 0 generated kernels strided, 1 clone contiguous.
# An earlier note here said torch 2.11's inductor asserted contiguous strides whatever the fake reported; the FX
# graph cache reproduces that: it keys on the graph, not on the op's fake, so after a fake's layout changes it
# replays code compiled for the old one (clear ~/.cache or /tmp/torchinductor_$USER). Older torch, untested, keeps
# the contiguous layout.
STRIDED_OUTPUT = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)

NS = "elsa_surgery"
if __name__ != "elsa_surgery.kernels.ops":  # see kernels/__init__.py: never register the ops twice
    raise ImportError(f"the ELSA custom ops live in elsa_surgery.kernels.ops, not {__name__}")


def dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale: float, is_causal: bool, precision: str):
    """``(out, lse)`` of :func:`attention_op`, without the op's dispatch (its body; the eager training path,
    ``training.EagerAttention``)."""
    return launch.attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, precision=precision or None, return_lse=True, out=dense_out(q, v))


@torch.library.custom_op(f"{NS}::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                 kv_lengths: Optional[Tensor], scale: float, is_causal: bool, precision: str) -> Tuple[Tensor, Tensor]:
    out, lse = dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision)
    return out, lse


def dense_out(q: Tensor, v: Tensor) -> Tensor:
    """The output ``[B, Hq, Nq, Dv]`` of the dense ops, real and fake alike, in the layout of
    :data:`STRIDED_OUTPUT`."""
    B, Hq, Nq, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    return launch._new_out(q, B, Hq, Nq, Dv) if STRIDED_OUTPUT else q.new_empty((B, Hq, Nq, Dv))


@attention_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
    B, Hq, Nq, _ = q.shape
    return dense_out(q, v), q.new_empty((B, Hq, Nq), dtype=torch.float32)


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


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   is_causal: bool, precision: str):
    """``(out, lse)`` of :func:`attention_varlen_op`, without the op's dispatch (``training.EagerAttentionVarlen``)."""
    return launch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                                   is_causal=is_causal, precision=precision or None, return_lse=True)


@torch.library.custom_op(f"{NS}::attention_varlen", mutates_args=())
def attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, scale: float, is_causal: bool,
                        precision: str) -> Tuple[Tensor, Tensor]:
    out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                              precision)
    return out, lse


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, precision):
    return varlen_fake(q, v)


def varlen_fake(q: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """The fake ``(out [total_q, Hq, Dv], lse [Hq, total_q])`` of the packed varlen ops."""
    total, Hq, _ = q.shape
    return q.new_empty((total, Hq, v.shape[2])), q.new_empty((Hq, total), dtype=torch.float32)
