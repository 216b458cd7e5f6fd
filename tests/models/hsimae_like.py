"""An HSIMAE-shaped masked autoencoder, written for the tests and ``recipes/hsimae_bench.py`` (random weights).

Same structure as HSIMAE, not its code: a hyperspectral patch ``[N, 1, bands, 9, 9]`` is embedded by a
Conv3d with kernel = stride = ``(band_patch, 3, 3)`` into ``(bands / band_patch) × 3 × 3`` tokens (64 bands,
band patch 16: 4 × 9 = 36 tokens); an encoder and a decoder of pre-norm blocks whose ``Attention`` has
separate q / k / v linears, an optional additive ``attn_bias`` and an explicit softmax.

Shapes of the paper (``SHAPES``): HSIMAE-B dim 144 (9 heads), -L dim 256 (16 heads), -H dim 512 (32 heads),
head_dim 16, depth 12; decoder dim 72, 9 heads, depth 1. Inference runs on large batches (1024+).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

SHAPES = {
    "B": dict(dim=144, depth=12, heads=9),
    "L": dict(dim=256, depth=12, heads=16),
    "H": dict(dim=512, depth=12, heads=32),
}


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int = 9, patch_size: int = 3, bands: int = 64, band_patch: int = 16,
                 in_chans: int = 1, dim: int = 144):
        super().__init__()
        assert img_size % patch_size == 0 and bands % band_patch == 0
        self.img_size, self.bands = img_size, bands
        self.num_tokens = (bands // band_patch) * (img_size // patch_size) ** 2
        self.proj = nn.Conv3d(in_chans, dim, kernel_size=(band_patch, patch_size, patch_size),
                              stride=(band_patch, patch_size, patch_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, bands, H, W] -> [N, T*h*w, dim]
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """HSIMAE-style attention: q / k / v linears, ``attn_bias`` added to the scaled logits, explicit softmax."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, qk_scale: Optional[float] = None,
                 proj_drop: float = 0.0, input_size: Tuple[int, int, int] = (4, 3, 3)):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.input_size = input_size

    def adjust_drop_rate(self, drop_rate: float = 0.0) -> None:
        self.proj_drop = nn.Dropout(drop_rate)

    def forward(self, x: torch.Tensor, attn_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, C = x.shape
        heads = [lin(x).view(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
                 for lin in (self.q, self.k, self.v)]
        q, k, v = heads
        logits = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if attn_bias is not None:
            logits = logits + attn_bias
        probs = torch.softmax(logits, dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x: torch.Tensor, attn_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_bias=attn_bias)
        return x + self.mlp(self.norm2(x))


class HSIMAELike(nn.Module):
    """Encoder + decoder over all tokens (inference: no masking); returns (latent, reconstruction)."""

    def __init__(self, dim: int = 144, depth: int = 12, heads: int = 9, dec_dim: int = 72, dec_depth: int = 1,
                 dec_heads: int = 9, img_size: int = 9, patch_size: int = 3, bands: int = 64, band_patch: int = 16):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, bands, band_patch, 1, dim)
        n = self.patch_embed.num_tokens
        self.pos_embed = nn.Parameter(torch.randn(1, n, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.decoder_embed = nn.Linear(dim, dec_dim)
        self.decoder_pos_embed = nn.Parameter(torch.randn(1, n, dec_dim) * 0.02)
        self.decoder_blocks = nn.ModuleList(Block(dec_dim, dec_heads) for _ in range(dec_depth))
        self.decoder_norm = nn.LayerNorm(dec_dim)
        self.decoder_pred = nn.Linear(dec_dim, band_patch * patch_size ** 2)

    def forward(self, imgs: torch.Tensor, attn_bias: Optional[torch.Tensor] = None):
        x = self.patch_embed(imgs) + self.pos_embed
        for blk in self.blocks:
            x = blk(x, attn_bias=attn_bias)
        latent = self.norm(x)
        y = self.decoder_embed(latent) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            y = blk(y)
        return latent, self.decoder_pred(self.decoder_norm(y))


def build(shape: str = "B", **overrides) -> HSIMAELike:
    cfg = dict(SHAPES[shape])
    cfg.update(overrides)
    return HSIMAELike(**cfg)
