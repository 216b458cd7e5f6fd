"""Attention dropout in the kernels: keep rate and unbiasedness (statistically), reproducibility from
``torch.manual_seed``, and the backward against a float64 reference that receives the kernel's own keep mask
(``kernels.training.dropout_keep_mask``, the debug hook)."""

import math

import pytest
import torch

import elsa_surgery
from elsa_surgery.kernels import training
from oracle import naive_attention, rel_err

from kernel_env import DEV, needs_kernels

pytestmark = needs_kernels


def _qkv(B=1, H=2, Nq=32, Nk=40, D=16, requires_grad=False):
    ts = [torch.randn(B, H, n, D, device=DEV) for n in (Nq, Nk, Nk)]
    return [t.requires_grad_(requires_grad) for t in ts]


def _keep(q, k, v, p, seed, **kw):
    return training.dropout_keep_mask(q, k, v, seed, scale=q.shape[-1] ** -0.5, precision="strict", dropout_p=p, **kw)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    """The keep fraction of ~20K draws lies within 5 standard deviations of ``1 - p``; rows and heads differ."""
    q, k, v = _qkv(B=2, H=2, Nq=64, Nk=80)
    keep = _keep(q, k, v, p, training.draw_seed(q.device))
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_unbiased():
    """Averaged over 48 independent draws (batch rows holding the same inputs), the dropout output approaches
    the output without dropout (SDPA's scaling by 1 / (1 - p)): its error stays near one draw's / sqrt(48)."""
    n = 48
    q, k, v = (t.expand(n, -1, -1, -1).contiguous() for t in _qkv(H=1, Nq=16, Nk=16))
    ref = elsa_surgery.attention(q[:1], k[:1], v[:1], backend="elsa", precision="strict")[0]
    draws = elsa_surgery.attention(q, k, v, dropout_p=0.3, backend="elsa", precision="strict")
    one = rel_err(draws[0], ref)
    mean = rel_err(draws.mean(0), ref)
    assert one > 0.2  # dropout does something
    assert mean < 3 * one / math.sqrt(n)


def test_same_seed_same_output_and_p_zero_one():
    q, k, v = _qkv()
    torch.manual_seed(3)
    a = elsa_surgery.attention(q, k, v, dropout_p=0.2, backend="elsa")
    b = elsa_surgery.attention(q, k, v, dropout_p=0.2, backend="elsa")
    torch.manual_seed(3)
    c = elsa_surgery.attention(q, k, v, dropout_p=0.2, backend="elsa")
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert elsa_surgery.attention(q, k, v, dropout_p=1.0, backend="elsa").abs().max() == 0


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(mask=True)])
def test_forward_and_backward_match_a_reference_given_the_kernels_mask(kw, backward_path):
    """Output and dQ/dK/dV/dMask against float64 ``(softmax * keep / (1 - p)) @ v`` with the keep mask the kernels
    drew (same seed), GQA and Dv != D."""
    p = 0.25
    q = torch.randn(2, 4, 24, 16, device=DEV, requires_grad=True)
    k = torch.randn(2, 2, 30, 16, device=DEV, requires_grad=True)
    v = torch.randn(2, 2, 30, 8, device=DEV, requires_grad=True)
    mask = torch.randn(1, 4, 24, 30, device=DEV, requires_grad=True) if kw.get("mask") else None
    causal = kw.get("is_causal", False)
    torch.manual_seed(11)
    out = elsa_surgery.attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, backend="elsa",
                                 precision="strict", enable_gqa=True)
    torch.manual_seed(11)
    seed = training.draw_seed(q.device)
    with torch.no_grad():
        keep = _keep(q, k, v, p, seed, mask=mask, is_causal=causal).cpu()
    go = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * go.to(DEV)).sum().backward()

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v) + ((mask,) if mask is not None else ())]
    qd, kd, vd = leaves[:3]
    md = leaves[3] if mask is not None else None
    kr, vr = kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1)
    s = qd @ kr.transpose(-1, -2) * 16 ** -0.5 + (md if md is not None else 0)
    if causal:
        s = s.masked_fill(torch.ones(24, 30, dtype=torch.bool).tril(30 - 24).logical_not(), float("-inf"))
    ref = (s.softmax(-1) * keep / (1 - p)) @ vr
    (ref * go).sum().backward()
    assert rel_err(out.detach().cpu(), ref.detach()) < 2e-6
    # without dropout the same reference is the oracle's output (the reference above is the right one)
    o0, _ = naive_attention(qd.detach(), kd.detach(), vd.detach(), md.detach() if md is not None else None,
                            is_causal=causal)
    assert rel_err((s.softmax(-1) @ vr).detach(), o0) < 1e-12
    for t, r in zip((q, k, v) + ((mask,) if mask is not None else ()), leaves):
        assert rel_err(t.grad.cpu(), r.grad) < 2e-5


def test_dropout_with_padding_keeps_zero_rows():
    q, k, v = _qkv(B=2, requires_grad=True)
    out = elsa_surgery.attention(q, k, v, dropout_p=0.3, backend="elsa", q_lengths=[32, 10], kv_lengths=[40, 7])
    assert out[1, :, 10:].abs().max() == 0
    out.sum().backward()
    assert k.grad[1, :, 7:].abs().max() == 0 and torch.isfinite(q.grad).all()


def test_activation_checkpointing_redraws_the_same_mask():
    """torch.utils.checkpoint recomputes the forward with the RNG state restored: the kernels' seed is drawn from
    PyTorch's generator, so the recomputed dropout mask, and hence every gradient, equals the plain run's."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(requires_grad=True)

    def f(q_, k_, v_):
        return elsa_surgery.attention(q_, k_, v_, dropout_p=0.3, backend="elsa").square().sum()

    torch.manual_seed(5)
    f(q, k, v).backward()
    plain = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(5)
    checkpoint(f, q, k, v, use_reentrant=False).backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(plain, (q, k, v)))
