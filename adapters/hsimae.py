"""HSIMAE (Ryan21wy/HSIMAE, hyperspectral masked autoencoder): its ``Attention`` class.

HSIMAE is not a pip package: its ``Models.py`` is copied into projects, so its classes live in modules
named ``Models``, ``hsimae.models``... The adapter (``hsimae.attention``) therefore matches by class
name **and** structure, which together are HSIMAE's signature and nothing else's:

* class named ``Attention`` in a module whose dotted path is ``Models`` or contains ``hsimae``
  (case-insensitive), and
* separate ``q``, ``k``, ``v`` ``nn.Linear(C, C)`` projections and ``proj`` ``nn.Linear(C, ·)``,
  ``num_heads`` dividing ``C``, a float ``scale``, an ``input_size`` attribute, an
  ``adjust_drop_rate`` method, no ``attn_drop`` (HSIMAE asserts it is 0 and keeps none), and a
  ``forward(x, attn_bias=None)``.

Other classes of the same structure (your own copy under another module name): register
``HSIMAEAttention(name=..., classes=(MyAttention,))`` with :func:`elsa_surgery.register_adapter`.

The original computes ``softmax(q kᵀ · scale + attn_bias) v`` with an explicit softmax; the patched
forward reuses ``q``/``k``/``v``/``proj``/``proj_drop`` and calls :func:`elsa_surgery.attention` with
``scale = self.scale`` and ``attn_bias`` as an additive float mask (broadcastable to ``[B, H, N, N]``).
A bool ``attn_bias`` (which the original *adds* as 0/1) runs the original implementation (counted in
``module.elsa_native_calls``).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn as nn

from elsa_surgery.registry import PatchConfig

from ._base import StructuralAdapter, attention, original_forward, record_native_call


def has_hsimae_structure(module: nn.Module) -> bool:
    lin = [getattr(module, n, None) for n in ("q", "k", "v", "proj")]
    if not all(isinstance(m, nn.Linear) for m in lin):
        return False
    q, k, v, proj = lin
    C = q.in_features
    if any(m.in_features != C or m.out_features != C for m in (q, k, v)) or proj.in_features != C:
        return False
    heads = getattr(module, "num_heads", None)
    if not isinstance(heads, int) or heads <= 0 or C % heads:
        return False
    if not isinstance(getattr(module, "scale", None), (int, float)):
        return False
    if not hasattr(module, "input_size") or not callable(getattr(module, "adjust_drop_rate", None)):
        return False
    if hasattr(module, "attn_drop") or hasattr(module, "qkv"):
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[:3] == ["self", "x", "attn_bias"]


def _hsimae_module_path(cls: type) -> bool:
    mod = cls.__module__
    return mod == "Models" or mod.endswith(".Models") or "hsimae" in mod.lower()


def _forward(self, x: torch.Tensor, attn_bias: Optional[torch.Tensor] = None, *, config: PatchConfig) -> torch.Tensor:
    if attn_bias is not None and not attn_bias.is_floating_point():
        record_native_call(self, f"non-float attn_bias ({attn_bias.dtype}) is added as numbers by the original")
        return original_forward(self)(x, attn_bias=attn_bias)
    B, N, C = x.shape
    H = self.num_heads
    q = self.q(x).reshape(B, N, H, C // H).transpose(1, 2)
    k = self.k(x).reshape(B, N, H, C // H).transpose(1, 2)
    v = self.v(x).reshape(B, N, H, C // H).transpose(1, 2)
    out = attention(config, q, k, v, attn_mask=attn_bias, scale=float(self.scale))
    out = out.transpose(1, 2).reshape(B, N, C)
    out = self.proj_drop(self.proj(out))
    return out.view(B, -1, out.shape[-1])


class HSIMAEAttention(StructuralAdapter):
    """``HSIMAEAttention(name="hsimae.attention", classes=None)``: ``classes`` replaces the built-in match."""

    name = "hsimae.attention"
    description = ("HSIMAE Attention (separate q/k/v linears, optional additive attn_bias, explicit softmax): "
                   "matched by class name, module path and structure, or by classes registered explicitly")
    structure_reason = ("does not have HSIMAE's attention structure (q/k/v/proj Linear(C, C), num_heads, scale, "
                        "input_size)")

    def matches_builtin(self, module: nn.Module) -> bool:
        cls = type(module)
        return cls.__name__ == "Attention" and _hsimae_module_path(cls) and has_hsimae_structure(module)

    def has_structure(self, module: nn.Module) -> bool:
        return has_hsimae_structure(module)

    forward_fn = _forward

    def example_inputs(self, model: nn.Module):
        """A batch of 4 hyperspectral patches ``[4, 1, bands, H, W]`` for a model with a Conv3d patch embedding."""
        if not self.matches_any(model):
            return None
        conv = next((m for m in model.modules() if isinstance(m, nn.Conv3d)), None)
        pe = getattr(model, "patch_embed", None)
        bands = getattr(pe, "bands", None)
        size = getattr(pe, "img_size", None)
        if conv is None or bands is None or size is None:
            return None
        size = (size, size) if isinstance(size, int) else tuple(size)
        return (torch.rand(4, conv.in_channels, bands, *size, device=conv.weight.device, dtype=conv.weight.dtype),)


ADAPTERS = [HSIMAEAttention()]
