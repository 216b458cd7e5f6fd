"""``torch.library`` custom ops (namespace ``elsa_surgery``) around the launchers, with fake impls.

``torch.compile(fullgraph=True)`` sees each kernel call as one opaque op whose output shapes come from
the fake implementation (no graph break, no recompilation when only sequence lengths change), and the
launchers do no host syncs, so the calls capture in CUDA graphs. The ops with an autograd formula always produce
``lse`` (``B·H·N`` floats, which the backward reads); the inference ops only when the call asks for it.

The ops are defined on a ``torch.library.Library`` fragment with one Python kernel each (``CompositeExplicitAutograd``,
any device), not through ``torch.library.custom_op``: Inductor's wrapper calls the op once per attention layer of a
compiled model, where a compiled Swin-T is host-bound, and custom_op's kernel wrapper (an output-aliasing check among
others) is host time on every call. ``benchmarks/lab/op_host.py`` on H100 hosts (session 32, ViT-B/16 bf16 shapes,
inference mode): the op's dispatch over its kernel's own time was 13.7 µs through custom_op (39.9 vs 26.2 µs) and
7.1 µs on the fragment (37.7 vs 30.6 µs; another machine, so the absolute times differ). For the same reason the
forward ops come in pairs: ``attention`` / ``attention_varlen`` carry the autograd formula (training.py),
``attention_inference`` / ``attention_varlen_inference`` have none, and a call that wants no gradient is traced to the
latter; under ``no_grad`` the formula's Python autograd kernel runs on every call even when nothing wants a gradient
(about 10 µs of a 17 µs dispatch on a CPU host).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import launch, replay

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


_LIB = torch.library.Library(NS, "FRAGMENT")  # kept for the process: the dispatcher entries live while it does

DENSE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? q_lengths, Tensor? kv_lengths, float scale, "
                "bool is_causal, str precision)")
VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
                 "SymInt max_seqlen_k, float scale, bool is_causal, str precision)")


def define(name: str, schema: str, impl, fake):
    """``elsa_surgery::name`` with ``impl`` as its kernel on every device and ``fake`` for tracing; its OpOverload."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NS), name).default


def dense_out(q: Tensor, v: Tensor) -> Tensor:
    """The output ``[B, Hq, Nq, Dv]`` of the dense ops, real and fake alike, in the layout of
    :data:`STRIDED_OUTPUT`."""
    B, Hq, Nq, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    return launch._new_out(q, B, Hq, Nq, Dv) if STRIDED_OUTPUT else q.new_empty((B, Hq, Nq, Dv))


def _out_arg(q: Tensor, v: Tensor) -> Optional[Tensor]:
    """The ``out`` the dense ops hand the launcher: none where the launcher's own output has the fake's layout (it
    allocates the strided output itself, through the launch plan's recorded geometry, and the plan is the one an
    eager call of the signature records), else the contiguous :func:`dense_out`."""
    return None if STRIDED_OUTPUT else dense_out(q, v)


def dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale: float, is_causal: bool, precision: str,
                  return_lse: bool = True):
    """``(out, lse)`` of :data:`attention_op`: its kernel, also called without the op's dispatch (the eager training
    path, ``training.EagerAttention``); ``return_lse=False`` (the inference op's kernel): lse is None. Kernels still
    compiling in the background for a traced call (``launch.precompile``) are waited for first."""
    if launch.PENDING:
        launch.wait_precompiled()
    return launch.attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, precision=precision or None, return_lse=return_lse,
                            out=_out_arg(q, v))


def dense_fake(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, *_):
    """The fake ``(out, lse)`` of the dense ops (extra arguments, as the dropout op's, ignored)."""
    B, Hq, Nq, _ = q.shape
    return dense_out(q, v), q.new_empty((B, Hq, Nq), dtype=torch.float32)


# (out, lse); autograd formula in training.py
attention_op = define("attention", DENSE_SCHEMA + " -> (Tensor, Tensor)", dense_forward, dense_fake)


def _no_lse(q: Tensor) -> Tensor:
    return q.new_empty(0, dtype=torch.float32)


def _dense_inference(q, k, v, mask, q_lengths, kv_lengths, scale: float, is_causal: bool, precision: str,
                     return_lse: bool):
    out, lse = dense_forward(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, return_lse)
    return out, (lse if return_lse else _no_lse(q))


def _dense_inference_fake(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, return_lse):
    out, lse = dense_fake(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision)
    return out, (lse if return_lse else _no_lse(q))


# the same without an autograd formula, for calls that want no gradient; lse only when asked for (an empty tensor
# else): the kernel variant that writes none, the one eager calls compile, so auto's trace-time race reuses it
attention_inference_op = define("attention_inference", DENSE_SCHEMA[:-1] + ", bool return_lse) -> (Tensor, Tensor)",
                                _dense_inference, _dense_inference_fake)


def _dense_inline(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                  kv_lengths: Optional[Tensor], scale: float, is_causal: bool, precision: str,
                  return_lse: bool) -> Tuple[Tensor, Tensor]:
    """The inline op's body: :func:`_dense_inference` itself on real tensors (the op called outside Inductor); traced
    on fake tensors, the same launcher with every kernel handed to ``wrap_triton`` (``replay.wrapped_launches``), so
    that Inductor's code launches the kernels planned here, without the launcher's host time on each call. Calls
    ``launch.not_inline`` names (the Hopper kernel's, K/V staged in carved buffers, ``ELSA_COMPILE_OP=auto``'s long
    calls) and calls with symbolic sizes trace to the opaque op instead."""
    if type(q) is Tensor:
        return _dense_inference(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, return_lse)
    if _static(q, k, v, mask, q_lengths, kv_lengths):  # (dynamic shapes: the planner needs sizes, the opaque op not)
        with replay.wrapped_launches():
            if launch.not_inline(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                                 kv_lengths=kv_lengths, precision=precision or None) is None:
                return _dense_inference(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, return_lse)
    return attention_inference_op(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision, return_lse)


def _static(*tensors) -> bool:
    """Whether every size, stride and storage offset of ``tensors`` (None skipped) is a plain int, not a SymInt."""
    return all(type(n) is int for t in tensors if t is not None for n in (*t.shape, *t.stride(), t.storage_offset()))


INLINE_UNAVAILABLE = None if hasattr(torch.library, "triton_op") else (
    f"torch {torch.__version__} has no torch.library.triton_op (torch >= 2.6)")
# the inference op for torch.compile (knobs.COMPILE_OP): Inductor traces its body and launches its Triton kernels
# from the generated code; its eager kernel (real tensors) is the opaque op's. None without triton_op.
_INLINE = None if INLINE_UNAVAILABLE else torch.library.triton_op(  # schema from the annotations (torch 2.11
    f"{NS}::attention_inline", _dense_inline, mutates_args=())     # infers it whatever it is given)
attention_inline_op = None if _INLINE is None else _INLINE._opoverload


def _state(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
    m, S, W = launch.attention_state(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                                     kv_lengths=kv_lengths, precision=precision or None)
    return m, S, W


def _state_fake(q, k, v, mask, q_lengths, kv_lengths, scale, is_causal, precision):
    B, Hq, Nq, _ = q.shape
    f32 = dict(dtype=torch.float32)
    return q.new_empty((B, Hq, Nq), **f32), q.new_empty((B, Hq, Nq), **f32), q.new_empty((B, Hq, Nq, v.shape[3]), **f32)


# (m, S, W) fp32: the scan's state, mergeable; no backward
attention_state_op = define("attention_state", DENSE_SCHEMA + " -> (Tensor, Tensor, Tensor)", _state, _state_fake)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   is_causal: bool, precision: str, return_lse: bool = True):
    """``(out, lse)`` of :data:`attention_varlen_op`: its kernel, also called without the op's dispatch
    (``training.EagerAttentionVarlen``); ``return_lse=False`` (the inference op's kernel): lse is None."""
    return launch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                                   is_causal=is_causal, precision=precision or None, return_lse=return_lse)


def varlen_fake(q: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """The fake ``(out [total_q, Hq, Dv], lse [Hq, total_q])`` of the packed varlen ops."""
    total, Hq, _ = q.shape
    return q.new_empty((total, Hq, v.shape[2])), q.new_empty((Hq, total), dtype=torch.float32)


def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, precision):
    return varlen_fake(q, v)


attention_varlen_op = define("attention_varlen", VARLEN_SCHEMA + " -> (Tensor, Tensor)", varlen_forward,
                              _varlen_fake)


def _varlen_inference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                      is_causal: bool, precision: str, return_lse: bool):
    out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                              precision, return_lse)
    return out, (lse if return_lse else _no_lse(q))


def _varlen_inference_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                           precision, return_lse):
    out, lse = varlen_fake(q, v)
    return out, (lse if return_lse else _no_lse(q))


attention_varlen_inference_op = define("attention_varlen_inference",
                                       VARLEN_SCHEMA[:-1] + ", bool return_lse) -> (Tensor, Tensor)",
                                       _varlen_inference, _varlen_inference_fake)
