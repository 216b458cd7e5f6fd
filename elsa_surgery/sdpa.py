"""``backend="sdpa"``: PyTorch's ``scaled_dot_product_attention`` made to follow our semantics.

For baselines and cross-checks. SDPA aligns ``is_causal`` top-left and returns NaN (CPU) for rows
with no visible key; here causality is bottom-right and such rows are zeros, like every other path.
The boolean mask this builds is ``[B, Hq|1, Nq, Nk]`` (materialised: this path is not O(n) in
memory for masked calls; use it for baselines only).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import semantics
from .semantics import MASK_FLOOR, AttentionProblem


def floor_mask(mask: torch.Tensor) -> torch.Tensor:
    """An additive mask with its finite values below :data:`MASK_FLOOR` raised to it (``-inf`` kept): PyTorch's fused
    CUDA kernels multiply logits by ``log2(e)``, which turns ``finfo.min`` into ``-inf`` and hides keys that SDPA's
    math hides nothing of (a one-key row masked with ``finfo(float32).min`` gave zeros instead of its value)."""
    low = (mask < MASK_FLOOR) & (mask != float("-inf"))
    return mask.masked_fill(low, MASK_FLOOR)


# Key-padding masks made from lengths that the caller made and never hands out (semantics.trusted_lengths: the
# transformers adapter's, one tensor per forward pass), kept for the next call with them: the layers of a forward pass
# share one mask, as the native model's do, instead of building it again in each layer (session 36: BERT-base bf16
# batch 32, host-bound, ran 0.58x native on an H200 with `auto` taking SDPA in every layer).
_KEY_MASKS: list = []  # [(weakref to the lengths, Nk, inference mode, keep mask, empty rows or None)]
_KEY_MASKS_MAX = 4


def _key_padding(kl: torch.Tensor, n_k: int):
    """``([B, 1, 1, Nk]`` bool keep mask, the rows of length 0 or None when there are none). A row of length 0 keeps
    every key (its output is zeroed after the call: :func:`run`)."""
    positive = semantics.trusted_lengths(kl)
    inference = torch.is_inference_mode_enabled()
    if positive is not None:
        for ref, nk, inf, keep, empty in _KEY_MASKS:
            if ref() is kl and nk == n_k and inf == inference:
                return keep, empty
    keep = torch.arange(n_k, device=kl.device) < kl[:, None]
    empty = None
    if not positive:
        empty = kl == 0
        keep = keep | empty[:, None]
    keep = keep[:, None, None, :]
    if positive is not None:
        _KEY_MASKS.append((weakref.ref(kl), n_k, inference, keep, empty))
        del _KEY_MASKS[:-_KEY_MASKS_MAX]
    return keep, empty


def key_padded(q, k, v, kv_lengths, scale: float, enable_gqa: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA over keys ``[0, kv_lengths[b])`` of batch row ``b`` (not causal, no other mask): the key-padding mask of
    :func:`_key_padding`, rows of length 0 zeros."""
    keep, empty = _key_padding(kv_lengths, k.shape[-2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=enable_gqa)
    return out if empty is None else out.masked_fill(empty[:, None, None, None], 0.0)


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
        return key_padded(p.q, p.k, p.v, p.kv_lengths, p.scale, p.heads_q != p.heads_kv, p.dropout_p)
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
