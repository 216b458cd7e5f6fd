"""A VGGT-shaped aggregator, written for the tests and ``recipes/vggt_eval.py`` (random weights).

Same structure as VGGT's aggregator, not its code: images ``[B, S, 3, H, W]`` are cut into 14×14
patches (a strided conv), each frame gets 1 camera token + 4 register tokens (P = 5 + patches; the first
frame uses its own pair of special tokens, as VGGT does), then ``depth`` pairs of blocks alternate

* **frame attention** over ``(B·S, P, C)``: every frame on its own;
* **global attention** over ``(B, S·P, C)``: all tokens of all frames together.

Attention: fused ``qkv`` linear, per-head LayerNorm qk-norm, 2-D rotary embedding of the token's
(row, col) position (special tokens at (0, 0), patches shifted by one), head_dim 64, native
``F.scaled_dot_product_attention``. A 392×518 image gives 28×37 = 1036 patches, P = 1041 (VGGT's
default resolution).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_SPECIAL = 5  # 1 camera + 4 register tokens


class Rope2D(nn.Module):
    """Rotary embedding in 2-D: the first half of head_dim rotates with the row, the second with the column."""

    def __init__(self, base: float = 100.0):
        super().__init__()
        self.base = base

    def _rotate(self, x: torch.Tensor, coord: torch.Tensor) -> torch.Tensor:
        # x [B, H, N, d] (d even), coord [B, N] integer positions
        d = x.shape[-1]
        inv = 1.0 / (self.base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # [d/2]
        ang = coord.to(torch.float32)[..., None] * inv  # [B, N, d/2]
        ang = torch.cat([ang, ang], dim=-1)[:, None]  # [B, 1, N, d]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        half1, half2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-half2, half1], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        rows, cols = x.chunk(2, dim=-1)
        return torch.cat([self._rotate(rows, pos[..., 0]), self._rotate(cols, pos[..., 1])], dim=-1)


class Attention(nn.Module):
    """VGGT-style attention: qkv, qk-norm, 2-D RoPE with ``pos``, SDPA."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, rope: Optional[nn.Module] = None):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        self.rope = rope

    def forward(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, pos), self.rope(k, pos)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj_drop(self.proj(y.transpose(1, 2).reshape(B, N, C)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, rope: Optional[nn.Module], mlp_ratio: float = 4.0,
                 init_scale: float = 0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qk_norm=True, rope=rope)
        self.ls1 = nn.Parameter(torch.full((dim,), init_scale))
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.ls2 = nn.Parameter(torch.full((dim,), init_scale))

    def forward(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.ls1 * self.attn(self.norm1(x), pos=pos)
        return x + self.ls2 * self.mlp(self.norm2(x))


class Aggregator(nn.Module):
    """Alternating frame / global attention over ``S`` frames of ``P = 5 + patches`` tokens."""

    def __init__(self, dim: int = 1024, depth: int = 24, num_heads: int = 16, patch_size: int = 14,
                 keep_layers: Optional[Sequence[int]] = None):
        super().__init__()
        self.patch_size = patch_size
        self.dim = dim
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.camera_token = nn.Parameter(torch.randn(1, 2, 1, dim) * 0.02)  # [first frame, other frames]
        self.register_token = nn.Parameter(torch.randn(1, 2, NUM_SPECIAL - 1, dim) * 0.02)
        self.rope = Rope2D()
        self.frame_blocks = nn.ModuleList(Block(dim, num_heads, self.rope) for _ in range(depth))
        self.global_blocks = nn.ModuleList(Block(dim, num_heads, self.rope) for _ in range(depth))
        # layers whose concatenated (frame, global) outputs are returned; VGGT's DPT heads read 4 of them
        self.keep_layers = list(range(depth)) if keep_layers is None else sorted(set(keep_layers))

    def _special(self, token: torch.Tensor, B: int, S: int) -> torch.Tensor:
        first = token[:, :1].expand(B, 1, *token.shape[2:])
        rest = token[:, 1:].expand(B, S - 1, *token.shape[2:])
        return torch.cat([first, rest], dim=1).reshape(B * S, *token.shape[2:])

    def positions(self, B: int, S: int, h: int, w: int, device) -> torch.Tensor:
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        grid = torch.stack([ys.reshape(-1), xs.reshape(-1)], dim=-1) + 1  # patches from (1, 1)
        special = torch.zeros(NUM_SPECIAL, 2, dtype=grid.dtype, device=device)
        return torch.cat([special, grid]).expand(B * S, -1, -1)  # [B*S, P, 2]

    def forward(self, images: torch.Tensor) -> List[torch.Tensor]:
        B, S, _, H, W = images.shape
        h, w = H // self.patch_size, W // self.patch_size
        x = self.patch_embed(images.reshape(B * S, 3, H, W)).flatten(2).transpose(1, 2)  # [B*S, h*w, C]
        x = torch.cat([self._special(self.camera_token, B, S), self._special(self.register_token, B, S), x], dim=1)
        P, C = x.shape[1], x.shape[2]
        pos = self.positions(B, S, h, w, images.device)
        outputs = []
        for i, (fb, gb) in enumerate(zip(self.frame_blocks, self.global_blocks)):
            x = fb(x.reshape(B * S, P, C), pos=pos)
            frame_out = x.reshape(B, S, P, C)
            x = gb(x.reshape(B, S * P, C), pos=pos.reshape(B, S * P, 2))
            if i in self.keep_layers:
                outputs.append(torch.cat([frame_out, x.reshape(B, S, P, C)], dim=-1))
        return outputs


def tokens_per_frame(height: int, width: int, patch_size: int = 14) -> int:
    return NUM_SPECIAL + (height // patch_size) * (width // patch_size)
