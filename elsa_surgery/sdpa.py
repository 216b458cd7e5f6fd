"""``backend="sdpa"``: PyTorch's ``scaled_dot_product_attention`` made to follow our semantics.

For baselines and cross-checks. SDPA aligns ``is_causal`` top-left and returns NaN (CPU) for rows
with no visible key; here causality is bottom-right and such rows are zeros, like every other path.
The boolean mask this builds is ``[B, Hq|1, Nq, Nk]`` (materialised: this path is not O(n) in
memory for masked calls; use it for baselines only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .semantics import MASK_FLOOR, AttentionProblem


def floor_mask(mask: torch.Tensor) -> torch.Tensor:
    """An additive mask with its finite values below :data:`MASK_FLOOR` raised to it (``-inf`` kept): PyTorch's fused
    CUDA kernels multiply logits by ``log2(e)``, which turns ``finfo.min`` into ``-inf`` and hides keys that SDPA's
    math hides nothing of (a one-key row masked with ``finfo(float32).min`` gave zeros instead of its value)."""
    low = (mask < MASK_FLOOR) & (mask != float("-inf"))
    return mask.masked_fill(low, MASK_FLOOR)


def run(p: AttentionProblem) -> torch.Tensor:
    if p.mask is None and p.q_lengths is None and p.kv_lengths is None and (not p.is_causal or p.n_q == p.n_k):
        # SDPA's own semantics are ours here (every row sees a key; causal alignments agree): no mask to build
        return F.scaled_dot_product_attention(p.q, p.k, p.v, dropout_p=p.dropout_p, is_causal=p.is_causal,
                                              scale=p.scale, enable_gqa=p.heads_q != p.heads_kv)
    if p.mask is None and p.q_lengths is None and p.kv_lengths is not None and not p.is_causal:
        # key padding alone (BERT's padded batches through the adapter's kv_lengths): a [B, 1, 1, Nk] key mask, as
        # the native model builds, rather than the [B, 1, Nq, Nk] visibility below. A batch row of kv_len 0 sees
        # every key, its output then zeroed: finite whatever the backend does with a fully masked row (NaN on some,
        # and NaN gradients for k and v after it), and its zero output gradient adds nothing to theirs
        kl = p.kv_lengths
        empty = kl == 0
        keep = (torch.arange(p.n_k, device=kl.device) < kl[:, None]) | empty[:, None]
        out = F.scaled_dot_product_attention(p.q, p.k, p.v, attn_mask=keep[:, None, None, :], dropout_p=p.dropout_p,
                                             scale=p.scale, enable_gqa=p.heads_q != p.heads_kv)
        return out.masked_fill(empty[:, None, None, None], 0.0)
    mask = p.mask
    if mask is not None and mask.shape[0] not in (1, p.batch):  # per-window: row b uses b % nW
        mask = mask[torch.arange(p.batch, device=mask.device) % mask.shape[0]]
    if p.has_index_mask:
        dev = p.q.device
        vis = p.visible(torch.arange(p.n_q, device=dev), torch.arange(p.n_k, device=dev)).unsqueeze(1)
        if mask is None:
            mask = vis
        elif mask.dtype == torch.bool:
            mask = mask & vis
        else:
            mask = mask.masked_fill(~vis, float("-inf"))
    if mask is not None and mask.is_floating_point() and mask.dtype != p.q.dtype and (
            mask.dtype != torch.float32 or p.q.dtype == torch.float64):
        # SDPA takes bool, float32 or q's dtype; never narrow to fp16/bf16 (-1e9 would become -inf); for float64 q
        # the mask is widened to float64 (exact): torch 2.14's CPU SDPA silently gives wrong outputs for a float32
        # mask with float64 q (max error 0.85 on an [8, 8] call, found by the fuzzer)
        mask = mask.to(torch.float64 if p.q.dtype == torch.float64 else torch.float32)
    if mask is not None and mask.is_floating_point() and mask.is_cuda and mask.dtype != torch.float16:
        mask = floor_mask(mask)  # (fp16 cannot hold a value below the floor)
    q, k, v = p.q, p.k, p.v
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        # a float32 mask with fp16/bf16 q: PyTorch's CUDA memory-efficient kernel refuses it ("invalid dtype for bias
        # - should match query's dtype", session 27's GPU fuzz) and narrowing the mask would round its values (or
        # turn large ones into -inf): the call runs in float32, the output cast back
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=p.dropout_p, scale=p.scale, enable_gqa=p.heads_q != p.heads_kv
    ).to(p.q.dtype)
    if mask is not None:
        visible = mask.any(dim=-1) if mask.dtype == torch.bool else (mask > float("-inf")).any(dim=-1)
        out = out.masked_fill(~visible.unsqueeze(-1), 0.0)
    return out
