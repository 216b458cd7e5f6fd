"""The reference backend: pure PyTorch, any dtype (float64 is the project's oracle), any device.

It is the ELSA scan written with tensor ops: queries are processed in chunks, and each query chunk
folds key chunks into its ``(m, S, W)`` state with :func:`elsa_surgery.monoid.fold_scores`. Extra
memory is ``O(B · H · CHUNK_Q · CHUNK_K)``, never ``N × N``. Causal and padded-length chunks that are
fully masked are skipped, exactly as the kernels skip blocks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import monoid
from .semantics import AttentionProblem, VarlenProblem

# Score-block budget in elements (B·Hq·chunk_q·chunk_k); 2**22 fp32 scores = 16 MiB per block.
SCORE_BLOCK_ELEMENTS = 1 << 22
MAX_CHUNK = 1024
MIN_CHUNK = 16


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_sizes(rows: int, n_q: int, n_k: int, budget: int = SCORE_BLOCK_ELEMENTS) -> Tuple[int, int]:
    """Query and key chunk lengths so that ``rows · chunk_q · chunk_k <= budget`` (where possible)."""
    per_row = max(1, budget // max(rows, 1))
    chunk_k = max(MIN_CHUNK, min(MAX_CHUNK, n_k, per_row))
    chunk_q = max(MIN_CHUNK, min(MAX_CHUNK, n_q, per_row // max(chunk_k, 1)))
    return max(1, min(chunk_q, max(n_q, 1))), max(1, min(chunk_k, max(n_k, 1)))


def _grouped(t: torch.Tensor, hkv: int, groups: int) -> torch.Tensor:
    """``[B, Hq, N, X] -> [B, Hkv, G, N, X]`` (a view)."""
    b, _, n, x = t.shape
    return t.reshape(b, hkv, groups, n, x)


def _mask_view(p: AttentionProblem) -> Optional[torch.Tensor]:
    """The canonical mask as ``[P, Hkv|1, G|1, Nq, Nk]`` (a view; broadcast axes keep stride 0)."""
    if p.mask is None:
        return None
    m = p.mask
    if m.shape[1] == 1:
        return m.unsqueeze(2)
    return m.reshape(m.shape[0], p.heads_kv, p.groups, p.n_q, p.n_k)


def run_state(p: AttentionProblem) -> monoid.State:
    """Fold every visible key into per-row states ``m, S [B, Hq, Nq]``, ``W [B, Hq, Nq, Dv]``."""
    acc = _acc_dtype(p.q.dtype)
    B, Hq, Nq, _ = p.q.shape
    Hkv, G, Nk, Dv = p.heads_kv, p.groups, p.n_k, p.head_dim_v
    dev = p.q.device
    state = monoid.identity((B, Hkv, G, Nq), Dv, dtype=acc, device=dev)
    if B == 0 or Nq == 0 or Nk == 0 or Hq == 0:
        return monoid.State(*(t.reshape(B, Hq, Nq, *t.shape[4:]) for t in state))

    q5 = _grouped(p.q, Hkv, G)  # [B, Hkv, G, Nq, D]
    k5 = p.k.unsqueeze(2)  # [B, Hkv, 1, Nk, D]
    v5 = p.v.unsqueeze(2)
    mask5 = _mask_view(p)
    period = 1 if mask5 is None else mask5.shape[0]
    batch_rows = torch.arange(B, device=dev) % period

    # Static skip bounds (no host sync): with no lengths the causal frontier is known exactly.
    static_offset = Nk - Nq if (p.q_lengths is None and p.kv_lengths is None) else None

    cq, ck = chunk_sizes(B * Hq, Nq, Nk)
    ms, Ss, Ws = [], [], []
    for i0 in range(0, Nq, cq):
        i1 = min(Nq, i0 + cq)
        qc = q5[:, :, :, i0:i1].to(acc) * p.scale  # fold the scale into q once per chunk
        st = monoid.State(*(t[:, :, :, i0:i1] for t in state))
        rows = torch.arange(i0, i1, device=dev)
        for j0 in range(0, Nk, ck):
            j1 = min(Nk, j0 + ck)
            if p.is_causal and static_offset is not None and j0 > (i1 - 1) + static_offset:
                break  # every later key block is above the causal frontier of this query chunk
            s = torch.matmul(qc, k5[:, :, :, j0:j1].to(acc).transpose(-1, -2))
            if mask5 is not None:
                mc = mask5[batch_rows, ..., i0:i1, j0:j1] if period not in (1, B) else mask5[..., i0:i1, j0:j1]
                if mc.dtype == torch.bool:
                    s.masked_fill_(~mc, float("-inf"))
                else:
                    s.add_(mc.to(acc))
            if p.has_index_mask:
                vis = p.visible(rows, torch.arange(j0, j1, device=dev))
                s.masked_fill_(~vis.view(B, 1, 1, i1 - i0, j1 - j0), float("-inf"))
            keep = _dropout_keep(s, p.dropout_p) if p.dropout_p > 0 else None
            st = monoid.fold_scores(st, s, v5[:, :, :, j0:j1].to(acc), keep)
        ms.append(st.m)
        Ss.append(st.S)
        Ws.append(st.W)
    m = torch.cat(ms, dim=3).reshape(B, Hq, Nq)
    S = torch.cat(Ss, dim=3).reshape(B, Hq, Nq)
    W = torch.cat(Ws, dim=3).reshape(B, Hq, Nq, Dv)
    return monoid.State(m, S, W)


def _dropout_keep(scores: torch.Tensor, p: float) -> torch.Tensor:
    """SDPA's attention dropout for one score block: each probability kept with chance ``1 - p`` and scaled
    by ``1 / (1 - p)`` (all dropped at ``p = 1``)."""
    if p >= 1.0:
        return torch.zeros_like(scores)
    return torch.empty_like(scores).bernoulli_(1.0 - p).div_(1.0 - p)


def run(p: AttentionProblem, return_lse: bool = False):
    out, lse = monoid.finalize(run_state(p), out_dtype=p.q.dtype)
    return out, (lse if return_lse else None)


def _varlen_slices(vp: VarlenProblem):
    cq = vp.cu_seqlens_q.tolist()
    ck = vp.cu_seqlens_k.tolist()
    for b in range(vp.batch):
        yield (cq[b], cq[b + 1]), (ck[b], ck[b + 1])


def run_varlen(vp: VarlenProblem, return_lse: bool = False):
    """Packed varlen: each sequence is an independent dense problem (bottom-right causal per sequence)."""
    total_q, Hq, _ = vp.q.shape
    Dv = vp.v.shape[-1]
    out = vp.q.new_zeros((total_q, Hq, Dv))
    lse = torch.full((Hq, total_q), float("-inf"), dtype=_acc_dtype(vp.q.dtype), device=vp.q.device)
    for (qa, qb), (ka, kb) in _varlen_slices(vp):
        if qb == qa:
            continue
        sub = AttentionProblem(
            q=vp.q[qa:qb].transpose(0, 1).unsqueeze(0),
            k=vp.k[ka:kb].transpose(0, 1).unsqueeze(0),
            v=vp.v[ka:kb].transpose(0, 1).unsqueeze(0),
            scale=vp.scale, mask=None, is_causal=vp.is_causal, q_lengths=None, kv_lengths=None,
        )
        o, l = run(sub, return_lse=True)
        out[qa:qb] = o[0].transpose(0, 1)
        lse[:, qa:qb] = l[0]
    return out, (lse if return_lse else None)
