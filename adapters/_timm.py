"""Shared plumbing of the timm adapters (``timm_vit``, ``timm_eva``, ``timm_swin``).

Never imports timm: a class is looked up in ``sys.modules`` when a module is offered, so a model that
was not built by timm is rejected without importing anything, and timm's ``fused_attn`` switch (read at
construction time) plays no part: the adapters rebind ``forward`` (``bind_forward``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._base import ForwardAdapter, first_param, random_tensor

EXAMPLE_BATCH = 2  # parity inputs: two images, so per-batch indexing (Swin's b % nW) is exercised
EXAMPLE_TOKENS = 10  # token count for a lone attention module


def timm_class(module_path: str, name: str):
    mod = sys.modules.get(module_path)
    return None if mod is None else getattr(mod, name, None)


def image_inputs(model: nn.Module) -> Optional[torch.Tensor]:
    """A batch of random images for a timm image model (one with ``patch_embed.img_size``), else None."""
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    proj = getattr(pe, "proj", None)
    if size is None or not isinstance(proj, nn.Conv2d):
        return None
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return random_tensor((EXAMPLE_BATCH, proj.in_channels, h, w), first_param(model))


class TimmAdapter(ForwardAdapter):
    """One timm attention class (exact match), patched by rebinding ``forward`` to ``forward_fn``."""

    library = "timm"
    target: Tuple[str, str] = ("", "")  # (module path, class name)
    input_linears: Tuple[str, ...] = ()  # the module's input projection(s): the first one present gives dim

    def matches(self, module: nn.Module) -> bool:
        cls = timm_class(*self.target)
        return cls is not None and type(module) is cls

    def example_inputs(self, model: nn.Module) -> Optional[Any]:
        x = image_inputs(model)
        if x is None and self.matches(model):
            x = self.module_inputs(model)
        return x

    def module_inputs(self, module: nn.Module) -> Optional[Any]:
        """Inputs for a lone module of this class (the parity check of ``convert(attention_module)``):
        ``[EXAMPLE_BATCH, module_tokens, in_features]`` of the first of ``input_linears`` the module has."""
        for name in self.input_linears:
            linear = getattr(module, name, None)
            if linear is not None:
                return token_inputs(module, linear.in_features, tokens=self.module_tokens(module))
        return None

    def module_tokens(self, module: nn.Module) -> int:
        return EXAMPLE_TOKENS


def token_inputs(module: nn.Module, dim: int, tokens: int = EXAMPLE_TOKENS, batch: int = EXAMPLE_BATCH):
    return random_tensor((batch, tokens, dim), first_param(module))


def fused_qkv(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's fused ``qkv`` projection with its optional separate ``q_bias`` / ``k_bias`` / ``v_bias``
    (EVA, SwinV2): the bias added after the matmul when ``qkv_bias_separate``, else inside ``F.linear``."""
    if module.q_bias is None:
        return module.qkv(x)
    qkv_bias = torch.cat((module.q_bias, module.k_bias, module.v_bias))
    if module.qkv_bias_separate:
        qkv = module.qkv(x)
        qkv += qkv_bias
        return qkv
    return F.linear(x, weight=module.qkv.weight, bias=qkv_bias)
