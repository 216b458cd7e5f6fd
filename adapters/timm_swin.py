"""timm Swin family: ``WindowAttention`` of ``swin_transformer.py`` (v1) and ``swin_transformer_v2.py`` (v2).

Both run on windows: ``x [B·nW, N, C]`` with the shifted-window mask ``[nW, N, N]`` (0 / -100) for the
shifted blocks. The relative-position bias ``[H, N, N]`` and the shift mask are added into one per-window
additive mask ``[nW, H, N, N]`` (size independent of the batch) and passed with ``windowed_mask=True``:
batch row ``b`` reads mask row ``b % nW``, as timm's ``view(-1, nW, H, N, N)`` does. No ``[B·nW, H, N, N]``
tensor is built.

SwinV2's cosine attention ``(q̂ · k̂ᵀ) · exp(clamp(logit_scale))`` is computed by folding the per-head
logit scale into the normalised queries and calling attention with ``scale=1.0``; its continuous position
bias (``16 · sigmoid(cpb_mlp(...))``) is the module's own code. Exact classes only (other timm window
attentions, e.g. ``swin_transformer_v2_cr``, are not matched and are reported as skipped).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from elsa_surgery.api import attention
from elsa_surgery.registry import PatchConfig

from ._timm import TimmAdapter, fused_qkv

_V1 = "timm.models.swin_transformer"
_V2 = "timm.models.swin_transformer_v2"


def _window_mask(bias: torch.Tensor, mask: Optional[torch.Tensor]):
    """``bias [1|H, N, N]`` (+ shift mask ``[nW, N, N]``) -> ``(attn_mask, windowed)``."""
    if bias.dim() == 3:
        bias = bias.unsqueeze(0)
    if mask is None:
        return bias, False
    return bias + mask.unsqueeze(1).to(bias.dtype), True


def swin_v1_forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *, config: PatchConfig):
    B_, N, C = x.shape
    q, k, v = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    attn_mask, windowed = _window_mask(self._get_rel_pos_bias(), mask)
    x = attention(q, k, v, attn_mask=attn_mask.to(q.dtype), dropout_p=self.attn_drop.p if self.training else 0.0,
                  scale=self.scale, windowed_mask=windowed, backend=config.backend, precision=config.precision)
    x = x.transpose(1, 2).reshape(B_, N, -1)
    x = self.proj(x)
    return self.proj_drop(x)


def _v2_position_bias(self) -> torch.Tensor:
    win = self.window_size[0] * self.window_size[1]
    table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
    bias = table[self.relative_position_index.view(-1)].view(win, win, -1).permute(2, 0, 1).contiguous()
    return 16 * torch.sigmoid(bias)  # [H, N, N]


def swin_v2_forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *, config: PatchConfig):
    B_, N, C = x.shape
    q, k, v = fused_qkv(self, x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()  # [H, 1, 1]
    # in q's own dtype: under autocast the fp32 logit_scale (and normalize) would promote q and k to fp32, where
    # timm's matmul runs them in the autocast dtype
    q = (F.normalize(q, dim=-1) * logit_scale).to(v.dtype)
    k = F.normalize(k, dim=-1).to(v.dtype)
    attn_mask, windowed = _window_mask(_v2_position_bias(self), mask)
    x = attention(q, k, v, attn_mask=attn_mask.to(q.dtype), dropout_p=self.attn_drop.p if self.training else 0.0,
                  scale=1.0, windowed_mask=windowed, backend=config.backend, precision=config.precision)
    x = x.transpose(1, 2).reshape(B_, N, C)
    x = self.proj(x)
    return self.proj_drop(x)


class SwinV1Adapter(TimmAdapter):
    name = "timm.swin.window_attention"
    description = "timm Swin v1 WindowAttention (relative-position bias, shifted-window mask per window)"
    target = (_V1, "WindowAttention")
    forward_fn = swin_v1_forward
    input_linears = ("qkv",)

    def module_tokens(self, module):
        return module.window_area


class SwinV2Adapter(TimmAdapter):
    name = "timm.swin.window_attention_v2"
    description = "timm SwinV2 WindowAttention (cosine attention: logit scale folded into q, scale=1)"
    target = (_V2, "WindowAttention")
    forward_fn = swin_v2_forward
    input_linears = ("qkv",)

    def module_tokens(self, module):
        return module.window_size[0] * module.window_size[1]


ADAPTERS = [SwinV1Adapter(), SwinV2Adapter()]
