"""timm EVA family (``timm/models/eva.py``): ``EvaAttention`` and ``AttentionRope``.

Both take ``rope`` (concatenated sin/cos, applied to every token after the ``num_prefix_tokens`` class /
register tokens), ``attn_mask`` and ``is_causal``; fused ``qkv`` or split ``q/k/v`` projections; EVA's
``q_bias`` / zero ``k_bias`` / ``v_bias``. ``AttentionRope`` with ``num_kv_heads < num_heads`` (GQA) passes
the kv heads as they are (``enable_gqa=True``: query head h reads kv head ``h // groups``, timm's
``repeat_interleave`` layout) instead of copying them. Exact classes only.
"""

from __future__ import annotations

from typing import Optional

import torch

from elsa_surgery.api import attention
from elsa_surgery.registry import PatchConfig

from ._timm import TimmAdapter, fused_qkv

_EVA = "timm.models.eva"
_ATTN = "timm.layers.attention"


def _apply_rope(self, q, k, v, rope):
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat  # timm is loaded: this module holds a timm model

    npt = self.num_prefix_tokens
    half = getattr(self, "rotate_half", False)
    q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
    k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
    return q, k


def _finish(self, x, gate, B, N):
    x = x.transpose(1, 2).reshape(B, N, -1)
    x = self.norm(x)
    if gate is not None:
        x = x * gate
    x = self.proj(x)
    return self.proj_drop(x)


def eva_attention_forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                          attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, *, config: PatchConfig):
    B, N, C = x.shape
    gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
    if self.qkv is not None:
        q, k, v = fused_qkv(self, x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
    q, k = self.q_norm(q), self.k_norm(k)
    if rope is not None:
        q, k = _apply_rope(self, q, k, v, rope)
    x = attention(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0,
                  is_causal=is_causal, scale=self.scale, backend=config.backend, precision=config.precision)
    return _finish(self, x, gate, B, N)


def attention_rope_forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                           attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, *, config: PatchConfig):
    B, N, C = x.shape
    gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
    if self.qkv is not None:
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
    q, k = self.q_norm(q), self.k_norm(k)
    if rope is not None:
        q, k = _apply_rope(self, q, k, v, rope)
    x = attention(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0,
                  is_causal=is_causal, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
                  backend=config.backend, precision=config.precision)
    return _finish(self, x, gate, B, N)


class EvaAttentionAdapter(TimmAdapter):
    name = "timm.eva.eva_attention"
    description = "timm EvaAttention (RoPE, prefix tokens, fused/split qkv)"
    target = (_EVA, "EvaAttention")
    forward_fn = eva_attention_forward
    input_linears = ("qkv", "q_proj")


class AttentionRopeAdapter(TimmAdapter):
    name = "timm.eva.attention_rope"
    description = "timm AttentionRope (RoPE, prefix tokens, fused/split qkv, GQA)"
    target = (_ATTN, "AttentionRope")
    forward_fn = attention_rope_forward
    input_linears = ("qkv", "q_proj")


ADAPTERS = [EvaAttentionAdapter(), AttentionRopeAdapter()]
