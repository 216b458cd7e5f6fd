"""open_clip: its own ``Attention`` class, plus parity inputs for open_clip models.

Where attention lives in open_clip (3.x), and who converts it:

* ``ResidualAttentionBlock`` (the default block of both towers: ViT image tower, text tower with its
  float causal mask ``[L, L]`` or, with padding / CoCa's CLS token, its ``[N*H, L, L]`` additive mask),
  ``MultimodalTransformer`` (CoCa's text decoder: causal self-attention plus cross-attention to the
  image tokens) and ``AttentionalPooler`` (CoCa's pooler: learned queries, ``kdim = vdim =
  context_dim``) all hold a plain ``nn.MultiheadAttention``: the ``torch.mha`` adapter converts them
  (see :mod:`elsa_surgery.adapters.torch_mha`).
* ``open_clip.transformer.Attention`` (used by ``CustomResidualAttentionBlock`` when a tower sets
  ``qk_norm``, ``scaled_cosine_attn``, ``scale_heads``, ``scale_attn_inner``...): this adapter,
  ``open_clip.attention``, matched by exact class. It keeps the module's parameters and submodules
  (``in_proj_weight``/``in_proj_bias``, ``ln_q``/``ln_k`` qk-norm, ``logit_scale``, ``head_scale``,
  ``ln_inner``, ``out_proj``); scaled cosine attention folds the clamped, exponentiated per-head logit
  scale into the normalised q and calls the kernel with ``scale=1``. Masks follow open_clip: bool
  True = masked (converted to the API's True = attend), float additive, 3-D masks ``[N*H, L, L]``.

  Note: in open_clip 3.3 the original ``scaled_cosine`` path calls ``torch.bmm`` on 4-D tensors and
  raises; the converted module computes the intended ``softmax(exp(clamp(s)) · cos(q, k) + mask) v``.

Training mode passes ``attn_drop.p`` to the kernels' attention dropout. ``import open_clip`` is never done at
import time.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from elsa_surgery.registry import PatchConfig

from ._base import ForwardAdapter, attention


def _attention_class():
    mod = sys.modules.get("open_clip.transformer")
    return getattr(mod, "Attention", None) if mod is not None else None


def _attention_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                       config: PatchConfig) -> torch.Tensor:
    N, L, C = x.shape
    H = self.num_heads
    q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
    q = q.reshape(N, L, H, -1).transpose(1, 2)
    k = k.reshape(N, L, H, -1).transpose(1, 2)
    v = v.reshape(N, L, H, -1).transpose(1, 2)

    mask = None
    if attn_mask is not None:
        if attn_mask.ndim == 3:  # [N*H, L, L]
            attn_mask = attn_mask.reshape(N, H, L, L)
        mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)

    if self.logit_scale is not None:  # scaled cosine attention: fold the per-head logit scale into q
        logit_scale = torch.clamp(self.logit_scale, max=self.logit_scale_max).exp()  # [H, 1, 1]
        q = F.normalize(q, dim=-1) * logit_scale.to(q.dtype)
        k = F.normalize(k, dim=-1)
        scale = 1.0
    else:
        q, k = self.ln_q(q), self.ln_k(k)
        scale = self.scale
    out = attention(config, q, k, v, attn_mask=mask, scale=scale,
                    dropout_p=self.attn_drop.p if self.training else 0.0)  # [N, H, L, hd]
    if self.head_scale is not None:
        out = out * self.head_scale
    out = out.transpose(1, 2).reshape(N, L, C)
    out = self.ln_inner(out)
    out = self.out_proj(out)
    return self.out_drop(out)


def _image_size(visual) -> Optional[tuple]:
    size = getattr(visual, "image_size", None)
    if size is None:
        size = getattr(getattr(visual, "preprocess_cfg", None) or {}, "get", lambda *_: None)("size")
    if size is None:
        return None
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def example_inputs_for(model: nn.Module, batch: int = 2):
    """Random inputs for an open_clip model (CLIP, CustomTextCLIP, CoCa) or one of its towers, else None."""
    if not type(model).__module__.startswith("open_clip"):
        return None
    try:
        p = next(model.parameters())
    except StopIteration:
        return None
    gen_dev, dtype = p.device, p.dtype if p.is_floating_point() else torch.float32

    def image(visual):
        hw = _image_size(visual)
        return None if hw is None else torch.rand(batch, 3, *hw, device=gen_dev, dtype=dtype)

    def text(ctx, vocab):
        # token 0 is open_clip's pad id: keep it out so no query row is fully masked
        return torch.randint(1, vocab, (batch, ctx), device=gen_dev)

    visual = getattr(model, "visual", None)
    if visual is not None and hasattr(model, "encode_text"):  # a two-tower model
        ctx = getattr(model, "context_length", None)
        vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "text", None), "vocab_size", None)
        img = image(visual)
        if img is None or ctx is None or vocab is None:
            return None
        return {"image": img, "text": text(ctx, vocab)}
    if hasattr(model, "image_size") and hasattr(model, "conv1"):  # VisionTransformer tower
        img = image(model)
        return None if img is None else (img,)
    if hasattr(model, "token_embedding") and hasattr(model, "context_length"):  # TextTransformer tower
        return (text(model.context_length, model.vocab_size),)
    return None


class OpenClipAttention(ForwardAdapter):
    """Also builds the parity inputs of every open_clip model (CLIP, CoCa, towers), whose ``nn.MultiheadAttention``
    modules the ``torch.mha`` adapter converts: :func:`elsa_surgery.convert` asks every registered adapter."""

    name = "open_clip.attention"
    library = "open_clip"
    description = ("open_clip.transformer.Attention (exact class): qk-norm, scaled cosine (logit scale folded "
                   "into q, scale=1), head scale, inner norm; bool masks True = masked")

    def matches(self, module: nn.Module) -> bool:
        cls = _attention_class()
        return cls is not None and type(module) is cls

    forward_fn = _attention_forward

    def example_inputs(self, model: nn.Module):
        return example_inputs_for(model)


ADAPTERS = [OpenClipAttention()]
