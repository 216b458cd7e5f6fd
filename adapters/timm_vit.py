"""timm ViT family (``timm/models/vision_transformer.py`` and the layers it uses).

Adapters (exact classes; subclasses are not matched):

* ``timm.vit.attention``: ``timm.layers.attention.Attention`` (ViT, DeiT/DeiT3, DINOv2, CLIP ViTs, register
  tokens; ``attn_mask`` and ``is_causal`` honoured; gated / qk-norm / scale-norm variants).
* ``timm.vit.attention_pool_latent``: ``AttentionPoolLatent`` (cross-attention from ``latent_len`` learned
  queries, Nq = 1 in SigLIP-style heads).
* ``timm.vit.attention_pool_prr``: ``AttentionPoolPrr`` (parameter-free self-attention pool).
* ``timm.vit.parallel_scaling_block``: ``ParallelScalingBlock`` (attention is inline in the block).
* ``timm.vit.diff_attention``: ``DiffAttention`` (two softmax maps, ``softmax(q1 k1) - λ softmax(q2 k2)``,
  computed as two ELSA calls on the shared ``v``).
* ``timm.vit.diff_parallel_scaling_block``: ``DiffParallelScalingBlock``.

Every forward below is the timm module's forward with its attention core replaced by
:func:`elsa_surgery.attention`; the projections, norms, gates and residuals are the module's own.
"""

from __future__ import annotations

from typing import Optional

import torch

from elsa_surgery.api import attention
from elsa_surgery.modules import timm_attention_forward
from elsa_surgery.registry import PatchConfig

from ._timm import EXAMPLE_TOKENS, TimmAdapter, token_inputs

_ATTN = "timm.layers.attention"
_POOL = "timm.layers.attention_pool"
_DIFF = "timm.layers.diff_attention"
_VIT = "timm.models.vision_transformer"


def _dropout(module, p: float) -> float:
    return p if module.training else 0.0


# --------------------------------------------------------------------------------------------------
# forwards
# --------------------------------------------------------------------------------------------------

def pool_latent_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *, config: PatchConfig):
    B, N, C = x.shape
    if self.pos_embed is not None:
        x = x + self.pos_embed.unsqueeze(0).to(x.dtype)
    q_latent = self.latent.expand(B, -1, -1)
    q = self.q(q_latent).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
    kv = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    k, v = kv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    x = attention(q, k, v, attn_mask=attn_mask, scale=self.scale, backend=config.backend, precision=config.precision)
    x = x.transpose(1, 2).reshape(B, self.latent_len, C)
    x = self.proj(x)
    x = self.proj_drop(x)
    if self.mlp is not None:
        x = x + self.mlp(self.norm(x))
    if self.pool == "token":
        x = x[:, 0]
    elif self.pool == "avg":
        x = x.mean(1)
    return x


def pool_prr_forward(self, x: torch.Tensor, *, config: PatchConfig):
    B, N, C = x.shape
    x = self.pre_norm(x)
    qkv = x.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
    x = attention(qkv, qkv, qkv, scale=self.scale, backend=config.backend, precision=config.precision)
    x = x.transpose(1, 2).reshape(B, N, C)
    x = self.post_norm(x)
    if self.pool == "token":
        x = x[:, 0]
    elif self.pool == "avg":
        x = x.mean(1)
    return x


def _parallel_block(self, x: torch.Tensor, attention_part) -> torch.Tensor:
    """The frame of timm's parallel-scaling blocks: one ``in_proj`` gives the MLP input and q, k, v;
    ``attention_part(q, k, v) -> [B, N, C]``; fused ``out_proj`` or separate attention / MLP projections."""
    y = self.in_proj(self.in_norm(x))
    x_mlp, q, k, v = torch.split(y, self.in_split, dim=-1)
    if self.mlp_bias is not None:
        x_mlp = x_mlp + self.mlp_bias
    x_attn = attention_part(q, k, v)
    x_mlp = self.mlp_drop(self.mlp_act(x_mlp))
    if self.out_proj is not None:
        y = self.out_proj(torch.cat((x_attn, x_mlp), dim=-1))
    else:
        y = self.attn_out_proj(x_attn) + self.mlp_out_proj(x_mlp)
    return x + self.drop_path(self.ls(y))


def parallel_scaling_block_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                                   is_causal: bool = False, *, config: PatchConfig):
    B, N, C = x.shape

    def attention_part(q, k, v):
        q = self.q_norm(q.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        x_attn = attention(q, k, v, attn_mask=attn_mask, dropout_p=_dropout(self, self.attn_drop.p),
                           is_causal=is_causal, scale=self.scale, backend=config.backend, precision=config.precision)
        return x_attn.transpose(1, 2).reshape(B, N, C)

    return _parallel_block(self, x, attention_part)


def _differential(self, q, k, v, attn_mask, is_causal, config: PatchConfig):
    """Differential attention on ``q, k, v [B, N, C]`` (timm's layout: 2 q/k heads per output head, v heads
    of 2·head_dim): ``sub_norm(softmax(q1 k1) v - λ softmax(q2 k2) v) · (1 - λ_init)`` -> ``[B, N, C]``."""
    B, N, C = q.shape
    q = q.reshape(B, N, 2 * self.num_heads, self.head_dim).transpose(1, 2)
    k = k.reshape(B, N, 2 * self.num_heads, self.head_dim).transpose(1, 2)
    v = v.reshape(B, N, self.num_heads, 2 * self.head_dim).transpose(1, 2)
    q, k = self.q_norm(q), self.k_norm(k)
    D = self.head_dim
    lambda_full = self._compute_lambda().type_as(q)
    q1, q2 = q.reshape(B, self.num_heads, 2, N, D).unbind(2)
    k1, k2 = k.reshape(B, self.num_heads, 2, N, D).unbind(2)
    kw = dict(attn_mask=attn_mask, dropout_p=_dropout(self, self.attn_drop_p), is_causal=is_causal,
              scale=self.scale, backend=config.backend, precision=config.precision)
    x = attention(q1, k1, v, **kw) - lambda_full * attention(q2, k2, v, **kw)
    x = self.sub_norm(x)
    x = x * (1 - self.lambda_init)
    return x.transpose(1, 2).reshape(B, N, C)


def diff_attention_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                           is_causal: bool = False, *, config: PatchConfig):
    q, k, v = self.qkv(x).chunk(3, dim=2)
    x = _differential(self, q, k, v, attn_mask, is_causal, config)
    x = self.norm(x)
    x = self.proj(x)
    return self.proj_drop(x)


def diff_parallel_scaling_block_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                                        is_causal: bool = False, *, config: PatchConfig):
    return _parallel_block(self, x, lambda q, k, v: _differential(self, q, k, v, attn_mask, is_causal, config))


# --------------------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------------------

class AttentionAdapter(TimmAdapter):
    name = "timm.vit.attention"
    description = "timm Attention (ViT, DeiT, DINOv2, CLIP ViT; masks and is_causal)"
    target = (_ATTN, "Attention")
    forward_fn = timm_attention_forward
    input_linears = ("qkv",)


class AttentionPoolLatentAdapter(TimmAdapter):
    name = "timm.vit.attention_pool_latent"
    description = "timm AttentionPoolLatent (latent-query cross-attention pooling)"
    target = (_POOL, "AttentionPoolLatent")
    forward_fn = pool_latent_forward
    input_linears = ("kv",)

    def module_tokens(self, module):
        return module.feat_size if module.pos_embed is not None else EXAMPLE_TOKENS


class AttentionPoolPrrAdapter(TimmAdapter):
    name = "timm.vit.attention_pool_prr"
    description = "timm AttentionPoolPrr (parameter-free self-attention pooling)"
    target = (_POOL, "AttentionPoolPrr")
    forward_fn = pool_prr_forward

    def module_inputs(self, module):
        return token_inputs(module, module.out_features)  # parameter-free: no input projection to read


class ParallelScalingBlockAdapter(TimmAdapter):
    name = "timm.vit.parallel_scaling_block"
    description = "timm ParallelScalingBlock (ViT-22B style parallel attention + MLP)"
    target = (_VIT, "ParallelScalingBlock")
    forward_fn = parallel_scaling_block_forward
    input_linears = ("in_proj",)


class DiffAttentionAdapter(TimmAdapter):
    name = "timm.vit.diff_attention"
    description = "timm DiffAttention (differential attention, two ELSA calls)"
    target = (_DIFF, "DiffAttention")
    forward_fn = diff_attention_forward
    input_linears = ("qkv",)


class DiffParallelScalingBlockAdapter(TimmAdapter):
    name = "timm.vit.diff_parallel_scaling_block"
    description = "timm DiffParallelScalingBlock"
    target = (_VIT, "DiffParallelScalingBlock")
    forward_fn = diff_parallel_scaling_block_forward
    input_linears = ("in_proj",)


ADAPTERS = [
    AttentionAdapter(),
    AttentionPoolLatentAdapter(),
    AttentionPoolPrrAdapter(),
    ParallelScalingBlockAdapter(),
    DiffAttentionAdapter(),
    DiffParallelScalingBlockAdapter(),
]
