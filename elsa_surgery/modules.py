"""Ready-made modules and convenience aliases.

* :class:`ElsaAttention`: timm's ``Attention`` (same constructor arguments, same state-dict keys, so a
  timm checkpoint loads into it unchanged) whose attention core is :func:`elsa_surgery.attention`,
  plus ``backend=`` / ``precision=``. It needs only torch.
* :func:`timm_attention_forward`: the forward both :class:`ElsaAttention` and the ``timm.vit``
  adapter run (the adapter rebinds it onto timm ``Attention`` instances).
* :func:`patch_vit_attention`: the entry point of the ELSA reference code, ``patch_vit_attention(model,
  method="elsa", precision="fp32")``, mapped onto :func:`elsa_surgery.convert`.
"""

from __future__ import annotations

from typing import Optional, Type

import torch
import torch.nn as nn

from .api import attention
from .dispatch import BACKENDS, PRECISIONS
from .registry import PatchConfig


def timm_attention_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                           is_causal: bool = False, *, config: PatchConfig) -> torch.Tensor:
    """timm ``Attention.forward`` with the attention core replaced by :func:`elsa_surgery.attention`.

    ``attn_mask`` keeps SDPA's meaning (bool True = attend, or additive float). Where timm's unfused path
    lets ``is_causal`` override a mask (and SDPA refuses the pair), both are applied here.
    """
    B, N, _ = x.shape
    gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    x = attention(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0,
                  is_causal=is_causal, scale=self.scale, backend=config.backend, precision=config.precision)
    x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
    x = self.norm(x)
    if gate is not None:
        x = x * gate
    x = self.proj(x)
    return self.proj_drop(x)


class ElsaAttention(nn.Module):
    """Multi-head self-attention with timm ``Attention``'s arguments and state-dict keys, on ELSA.

    Keys: ``qkv.weight`` / ``qkv.bias``, ``q_norm.*`` / ``k_norm.*`` (with ``qk_norm``), ``norm.*`` (with
    ``scale_norm``), ``gate.*`` (with ``gated``), ``proj.weight`` / ``proj.bias``. ``backend`` and
    ``precision`` are passed to :func:`elsa_surgery.attention` on every call (``"auto"`` runs the Triton
    kernels on CUDA and the reference backend elsewhere). ``norm_layer`` defaults to ``nn.LayerNorm``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: Optional[int] = None,
        dim_out: Optional[int] = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: Optional[Type[nn.Module]] = None,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} or None; got {precision!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if attn_head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}) unless attn_head_dim is given")
            attn_head_dim = dim // num_heads
        dd = {"device": device, "dtype": dtype}
        norm_layer = norm_layer or nn.LayerNorm
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.attn_dim = num_heads * attn_head_dim
        self.scale = attn_head_dim ** -0.5
        self.backend = backend
        self.precision = precision
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        return timm_attention_forward(self, x, attn_mask, is_causal,
                                      config=PatchConfig(self.backend, self.precision))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}, precision={self.precision!r}"


# The ELSA reference code's vocabulary -> (backend, fp32 precision mode).
_METHODS = {"elsa": "auto", "reference": "reference", "sdpa": "sdpa"}
_PRECISION_ALIASES = {
    "fp32": None, "float32": None, "ieee": "strict", "strict": "strict",
    "3xtf32": "precise", "precise": "precise", "tf32": "turbo", "turbo": "turbo",
}


def patch_vit_attention(model: nn.Module, method: str = "elsa", precision: str = "fp32", **kwargs):
    """Alias of :func:`elsa_surgery.convert` for users of the ELSA reference code.

    ``method``: ``"elsa"`` (ELSA kernels, reference backend where they cannot run; told in the report),
    ``"reference"`` or ``"sdpa"``. ``precision``: ``"fp32"`` (the default fp32 mode: 3xTF32 on sm80+),
    ``"ieee"``/``"strict"``, ``"3xtf32"``/``"precise"``, ``"tf32"``/``"turbo"``; it selects the fp32 mode and
    never casts the model (half-precision models run in their own dtype). Other keyword arguments go to
    :func:`convert`. Returns the :class:`ConversionReport`.
    """
    from .surgery import convert

    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))}; got {method!r}")
    key = precision.lower() if isinstance(precision, str) else precision
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision must be one of {', '.join(map(repr, _PRECISION_ALIASES))}; got {precision!r}")
    return convert(model, backend=_METHODS[method], precision=_PRECISION_ALIASES[key], **kwargs)
