"""A naive, dense float64 statement of docs/design.md's attention semantics, written independently of the
package (it materialises the score matrix: small shapes only). The package's float64 reference is
checked against it, and everything else against the package's float64 reference."""

import torch


def naive_attention(q, k, v, mask=None, *, is_causal=False, scale=None, q_lengths=None, kv_lengths=None,
                    windowed=False):
    """q [B,Hq,Nq,D], k [B,Hkv,Nk,D], v [B,Hkv,Nk,Dv] -> (out float64, lse float64), on q's device (computed on
    the CPU)."""
    dev = q.device
    if dev.type != "cpu":
        cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
        out, lse = naive_attention(cpu(q), cpu(k), cpu(v), cpu(mask), is_causal=is_causal, scale=scale,
                                   q_lengths=cpu(q_lengths), kv_lengths=cpu(kv_lengths), windowed=windowed)
        return out.to(dev), lse.to(dev)
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scale = D ** -0.5 if scale is None else scale
    if Nk == 0 or Nq == 0:  # no keys: every row is empty
        return q.new_zeros(B, Hq, Nq, v.shape[-1]), q.new_full((B, Hq, Nq), float("-inf"))
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    visible = torch.ones(B, Hq, Nq, Nk, dtype=torch.bool)
    if mask is not None:
        if windowed:
            mask = mask[torch.arange(B) % mask.shape[0]]
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            s = s + mask.double()
    ql = torch.full((B,), Nq) if q_lengths is None else torch.as_tensor(q_lengths).long()
    kl = torch.full((B,), Nk) if kv_lengths is None else torch.as_tensor(kv_lengths).long()
    i = torch.arange(Nq).view(1, 1, -1, 1)
    j = torch.arange(Nk).view(1, 1, 1, -1)
    visible = visible & (j < kl.view(-1, 1, 1, 1)) & (i < ql.view(-1, 1, 1, 1))
    if is_causal:
        visible = visible & (j <= i + (kl - ql).view(-1, 1, 1, 1))
    s = s.masked_fill(~visible, float("-inf"))
    rowmax = s.amax(-1, keepdim=True)
    empty = rowmax == float("-inf")
    p = torch.exp(s - torch.where(empty, torch.zeros_like(rowmax), rowmax))
    denom = p.sum(-1, keepdim=True)
    out = (p / torch.where(empty, torch.ones_like(denom), denom)) @ v
    out = out.masked_fill(empty, 0.0)
    lse = torch.where(empty.squeeze(-1), torch.full_like(denom.squeeze(-1), float("-inf")),
                      (rowmax + torch.log(denom)).squeeze(-1))
    return out, lse


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float((x - ref).norm())
    return float((x - ref).norm() / denom)


def fp32_tolerance(q, k, scale=None, base=2e-6):
    """fp32 rounding of a logit s perturbs exp(s) by ~|s|·eps: scale the bound with the largest |logit|
    (unit-scale logits keep ``base``; SwinV2-style scale=1.0 with D=128 gives logits near 40).
    q [..., Hq, Nq, D] and k [..., Hkv, Nk, D] (dense) or [total, H, D] (packed); small shapes only."""
    if q.numel() == 0 or k.numel() == 0:
        return base
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    qd = q.double().reshape(-1, q.shape[-1])
    kd = k.double().reshape(-1, k.shape[-1])
    smax = float((qd @ kd.T).abs().max()) * abs(sc)  # over all pairs: an upper bound of the real max
    return base * max(1.0, smax / 10.0)


def decoy(t):
    """A new tensor with ``t``'s geometry (shape, strides, storage offset, hence the same 16-byte alignment) and
    other values: a call on decoys records the launch plan that the same call on the real tensors replays
    (kernels/replay.py), so a replay that kept a tensor of the first call fails the oracle."""
    if t is None:
        return None
    base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)
    if t.dtype == torch.bool:
        base.copy_(torch.rand(base.shape, device=t.device) > 0.5)
    elif t.dtype.is_floating_point:
        base.normal_()
    else:
        base.fill_(t.flatten()[0] if t.numel() else 0)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())
