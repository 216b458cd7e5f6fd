"""VGGT (facebookresearch/vggt): ``vggt.layers.attention.Attention`` and ``MemEffAttention``.

VGGT's aggregator alternates *frame* attention over ``(B·S, P, C)`` and *global* attention over
``(B, S·P, C)`` (P = 1 camera + 4 register tokens + patches), both with the same ``Attention`` class:
fused ``qkv`` linear, per-head qk-norm (``q_norm``/``k_norm``), 2-D RoPE applied to q and k with the
token positions ``pos`` (``self.rope(q, pos)``), then SDPA. The camera head's trunk uses the same
blocks; the track head's ``nn.MultiheadAttention`` is converted by the ``torch.mha`` adapter.

Matching (adapter ``vggt.attention``), never by accident:

1. **exact classes** ``vggt.layers.attention.Attention`` and ``vggt.layers.attention.MemEffAttention``
   when the ``vggt`` package is imported (the subclass ``MemEffAttention`` is listed on purpose);
2. **vendored copies**: a class named ``Attention`` or ``MemEffAttention`` defined in a module whose
   dotted path has a component named exactly ``vggt`` (``third_party.vggt.layers.attention``), with
   VGGT's structure: ``qkv`` ``nn.Linear(C, 3C)``, ``q_norm``, ``k_norm``, ``proj``, ``rope``
   attributes, ``num_heads * head_dim == C`` and a ``forward`` taking ``pos``;
3. **your own classes** of the same structure: register ``VGGTAttention(name=..., classes=(MyAttn,))``
   with :func:`elsa_surgery.register_adapter` (matched by exact class).

The patched forward reuses the module's submodules (``qkv``, ``q_norm``, ``k_norm``, ``rope``,
``proj``) and calls :func:`elsa_surgery.attention` with ``scale = self.scale``. Runs the original
implementation (counted in ``module.elsa_native_calls``): ``MemEffAttention`` called with an
``attn_bias`` or a ``pos`` (the original's xFormers-only / assertion paths), training with dropout.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional, Tuple

import torch
import torch.nn as nn

from elsa_surgery.registry import PatchConfig

from ._base import StructuralAdapter, attention, original_forward, record_native_call

CLASS_NAMES = ("Attention", "MemEffAttention")


def _installed_classes() -> Tuple[type, ...]:
    mod = sys.modules.get("vggt.layers.attention")
    if mod is None:
        return ()
    return tuple(c for c in (getattr(mod, n, None) for n in CLASS_NAMES) if isinstance(c, type))


def has_vggt_structure(module: nn.Module) -> bool:
    """VGGT's attention layout: fused qkv Linear(C, 3C), q_norm/k_norm, proj, rope, forward(x, pos)."""
    qkv, proj = getattr(module, "qkv", None), getattr(module, "proj", None)
    if not (isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)):
        return False
    if not all(hasattr(module, a) for a in ("q_norm", "k_norm", "rope", "num_heads", "head_dim", "scale")):
        return False
    C = qkv.in_features
    if qkv.out_features != 3 * C or module.num_heads * module.head_dim != C or proj.in_features != C:
        return False
    try:
        return "pos" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _is_vendored_vggt(cls: type) -> bool:
    return cls.__name__ in CLASS_NAMES and "vggt" in cls.__module__.split(".")


def _core(self, x: torch.Tensor, pos: Optional[torch.Tensor], config: PatchConfig) -> torch.Tensor:
    B, N, C = x.shape
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, H, N, hd]
    q, k = self.q_norm(q), self.k_norm(k)
    if self.rope is not None:
        q = self.rope(q, pos)
        k = self.rope(k, pos)
    out = attention(config, q, k, v, scale=self.scale)
    out = out.transpose(1, 2).reshape(B, N, C)
    return self.proj_drop(self.proj(out))


def _dropout_active(self) -> bool:
    drop = getattr(self, "attn_drop", None)
    return self.training and isinstance(drop, nn.Dropout) and drop.p > 0.0


def _attention_forward(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None, *, config: PatchConfig) -> torch.Tensor:
    if _dropout_active(self):
        record_native_call(self, f"training mode with attn_drop={self.attn_drop.p}")
        return original_forward(self)(x, pos=pos)
    return _core(self, x, pos, config)


def _memeff_forward(self, x: torch.Tensor, attn_bias=None, pos: Optional[torch.Tensor] = None, *,
                    config: PatchConfig) -> torch.Tensor:
    if attn_bias is not None or pos is not None or _dropout_active(self):
        why = ("attn_bias given (xFormers block-diagonal masks)" if attn_bias is not None else
               "pos given (the original asserts pos is None)" if pos is not None else
               f"training mode with attn_drop={self.attn_drop.p}")
        record_native_call(self, why)
        return original_forward(self)(x, attn_bias=attn_bias, pos=pos)
    return _core(self, x, None, config)


class VGGTAttention(StructuralAdapter):
    """``VGGTAttention(name="vggt.attention", classes=None)``: ``classes`` replaces the built-in match."""

    # matching needs no import: exact classes are looked up only if vggt is imported (library = None)
    name = "vggt.attention"
    description = ("VGGT Attention / MemEffAttention (fused qkv, qk-norm, 2-D RoPE with pos): exact classes, "
                   "vendored copies under a 'vggt' package path, or classes registered explicitly")
    structure_reason = "does not have VGGT's attention structure (qkv Linear(C, 3C), q_norm, k_norm, rope, proj, pos)"

    def matches_builtin(self, module: nn.Module) -> bool:
        cls = type(module)
        if cls in _installed_classes():
            return True
        return _is_vendored_vggt(cls) and has_vggt_structure(module)

    def has_structure(self, module: nn.Module) -> bool:
        return has_vggt_structure(module)

    def forward_for(self, module: nn.Module):
        takes_bias = "attn_bias" in inspect.signature(type(module).forward).parameters
        return _memeff_forward if takes_bias else _attention_forward

    def example_inputs(self, model: nn.Module):
        """Images ``[1, 2, 3, 28, 42]`` in [0, 1] for a VGGT model or aggregator (patch size 14)."""
        if not self.matches_any(model):
            return None
        try:
            p = next(model.parameters())
        except StopIteration:
            return None
        patch = getattr(getattr(model, "aggregator", model), "patch_size", 14)
        patch = patch if isinstance(patch, int) else 14
        return (torch.rand(1, 2, 3, 2 * patch, 3 * patch, device=p.device, dtype=p.dtype),)


ADAPTERS = [VGGTAttention()]
