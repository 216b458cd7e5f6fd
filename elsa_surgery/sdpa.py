"""``backend="sdpa"``: PyTorch's ``scaled_dot_product_attention`` made to follow our semantics.

For baselines and cross-checks. SDPA aligns ``is_causal`` top-left and returns NaN (CPU) for rows
with no visible key; here causality is bottom-right and such rows are zeros, like every other path.
The boolean mask this builds is ``[B, Hq|1, Nq, Nk]`` (materialised: this path is not O(n) in
memory for masked calls; use it for baselines only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .semantics import AttentionProblem


def _index_mask(p: AttentionProblem) -> torch.Tensor:
    dev = p.q.device
    B, Nq, Nk = p.batch, p.n_q, p.n_k
    q_len = p.q_lengths.long() if p.q_lengths is not None else torch.full((B,), Nq, device=dev)
    kv_len = p.kv_lengths.long() if p.kv_lengths is not None else torch.full((B,), Nk, device=dev)
    rows = torch.arange(Nq, device=dev).view(1, -1, 1)
    cols = torch.arange(Nk, device=dev).view(1, 1, -1)
    vis = (cols < kv_len.view(-1, 1, 1)) & (rows < q_len.view(-1, 1, 1))
    if p.is_causal:
        vis = vis & (cols <= rows + (kv_len - q_len).view(-1, 1, 1))
    return vis.unsqueeze(1)  # [B, 1, Nq, Nk]


def run(p: AttentionProblem) -> torch.Tensor:
    mask = p.mask
    if mask is not None and mask.shape[0] not in (1, p.batch):  # per-window: row b uses b % nW
        mask = mask[torch.arange(p.batch, device=mask.device) % mask.shape[0]]
    if p.is_causal or p.q_lengths is not None or p.kv_lengths is not None:
        vis = _index_mask(p)
        if mask is None:
            mask = vis
        elif mask.dtype == torch.bool:
            mask = mask & vis
        else:
            mask = mask.masked_fill(~vis, float("-inf"))
    if mask is not None and mask.dtype != torch.bool and mask.dtype != p.q.dtype:
        mask = mask.to(p.q.dtype)
    out = F.scaled_dot_product_attention(
        p.q, p.k, p.v, attn_mask=mask, scale=p.scale, enable_gqa=p.heads_q != p.heads_kv
    )
    if mask is not None:
        visible = mask.any(dim=-1) if mask.dtype == torch.bool else (mask > float("-inf")).any(dim=-1)
        out = out.masked_fill(~visible.unsqueeze(-1), 0.0)
    return out
