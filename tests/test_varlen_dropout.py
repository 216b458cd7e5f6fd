"""Attention dropout on packed variable-length sequences (``attention_varlen(..., dropout_p)``, issue 25).

The kernels draw sequence ``b``'s keep mask as the padded dense call ``[B, Hq, max_seqlen_q, max_seqlen_k]`` draws
batch row ``b``'s: it depends on the seed, ``b`` and the two maxima, not on what else is packed. Checked here: keep
rate and unbiasedness (statistically), reproducibility from ``torch.manual_seed``, the packed mask against the
padded dense one, independence from the other sequences, forward and dQ/dK/dV against a float64 reference that
receives the kernels' own mask (``kernels.training.dropout_keep_mask``), ``dropout_p=0`` against the path without
dropout, the reference backend's dropout, and ``dropout_p`` validation."""

import math

import pytest
import torch

import elsa_surgery
from elsa_surgery.kernels import training
from oracle import rel_err

from kernel_env import DEV, needs_kernels

kernels = needs_kernels


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)


def _pack(lens_q, lens_k, Hq=2, Hkv=2, D=16, Dv=16, requires_grad=False, dtype=torch.float32):
    ts = (torch.randn(sum(lens_q), Hq, D), torch.randn(sum(lens_k), Hkv, D), torch.randn(sum(lens_k), Hkv, Dv))
    return [t.to(dtype).to(DEV).requires_grad_(requires_grad) for t in ts]


def _varlen(q, k, v, lens_q, lens_k, **kw):
    kw.setdefault("backend", "elsa")
    kw.setdefault("precision", "strict")
    return elsa_surgery.attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), **kw)


def _keep(q, k, v, lens_q, lens_k, p, seed, max_q=None, max_k=None, **kw):
    return training.dropout_keep_mask(q, k, v, seed, scale=q.shape[-1] ** -0.5, precision="strict", dropout_p=p,
                                      cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k),
                                      max_seqlen_q=max_q or max(lens_q), max_seqlen_k=max_k or max(lens_k), **kw)


def _dense(t, lens, n):
    """Packed ``[total, H, X]`` -> right-padded ``[B, H, n, X]`` (zeros past each length)."""
    out = t.new_zeros((len(lens), t.shape[1], n, t.shape[2]))
    for b, (a, e) in enumerate(zip(_cu(lens).tolist()[:-1], _cu(lens).tolist()[1:])):
        out[b, :, : e - a] = t[a:e].transpose(0, 1)
    return out


@kernels
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_per_sequence(p):
    """Each sequence's keep fraction (its valid pairs only) lies within 5 standard deviations of ``1 - p``;
    sequences, heads and rows get different masks; nothing is kept outside a sequence's pairs."""
    lens_q, lens_k = [40, 24, 33], [48, 30, 20]
    q, k, v = _pack(lens_q, lens_k)
    keep = _keep(q, k, v, lens_q, lens_k, p, training.draw_seed(q.device))
    assert keep.shape == (3, 2, 40, 48)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sub = keep[b, :, :lq, :lk]
        n = sub.numel()
        assert abs(sub.float().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n), b
        assert not keep[b, :, lq:].any() and not keep[b, :, :, lk:].any()
    assert not torch.equal(keep[0, 0, :20, :20], keep[1, 0, :20, :20])
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


@kernels
def test_packed_mask_is_the_padded_dense_mask_and_ignores_the_other_sequences():
    """Sequence b's packed mask equals batch row b's of the padded dense call with the same seed (and so the packed
    dropout output equals the padded one); repacking with another middle sequence (other length, other values)
    keeps the first and last sequences' masks and outputs, given the same maxima."""
    p = 0.4
    lens_q, lens_k = [6, 10, 7], [9, 12, 5]
    q, k, v = _pack(lens_q, lens_k)
    seed = training.draw_seed(q.device)
    keep = _keep(q, k, v, lens_q, lens_k, p, seed)
    lq_t = torch.tensor(lens_q, dtype=torch.int32, device=DEV)
    lk_t = torch.tensor(lens_k, dtype=torch.int32, device=DEV)
    qd, kd, vd = _dense(q, lens_q, 10), _dense(k, lens_k, 12), _dense(v, lens_k, 12)
    dense_keep = training.dropout_keep_mask(qd, kd, vd, seed, scale=16 ** -0.5, precision="strict", dropout_p=p,
                                            q_lengths=lq_t, kv_lengths=lk_t)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        assert torch.equal(keep[b, :, :lq, :lk], dense_keep[b, :, :lq, :lk])

    torch.manual_seed(21)
    out = _varlen(q, k, v, lens_q, lens_k, dropout_p=p)
    torch.manual_seed(21)
    out_dense = elsa_surgery.attention(qd, kd, vd, dropout_p=p, backend="elsa", precision="strict",
                                       q_lengths=lq_t, kv_lengths=lk_t)
    cq = _cu(lens_q).tolist()
    for b, lq in enumerate(lens_q):
        assert torch.allclose(out[cq[b]:cq[b + 1]].transpose(0, 1), out_dense[b, :, :lq], rtol=1e-5, atol=1e-6)

    # the middle sequence replaced: 3 queries over 4 keys of other values
    lens_q2, lens_k2 = [6, 3, 7], [9, 4, 5]
    q2, k2, v2 = _pack(lens_q2, lens_k2)
    ck, ck2, cq2 = _cu(lens_k).tolist(), _cu(lens_k2).tolist(), _cu(lens_q2).tolist()
    for b in (0, 2):
        q2[cq2[b]:cq2[b + 1]] = q[cq[b]:cq[b + 1]]
        k2[ck2[b]:ck2[b + 1]] = k[ck[b]:ck[b + 1]]
        v2[ck2[b]:ck2[b + 1]] = v[ck[b]:ck[b + 1]]
    keep2 = _keep(q2, k2, v2, lens_q2, lens_k2, p, seed, max_q=10, max_k=12)
    assert torch.equal(keep2[0], keep[0]) and torch.equal(keep2[2], keep[2])
    assert not torch.equal(keep2[1], keep[1])
    torch.manual_seed(21)
    out2 = elsa_surgery.attention_varlen(q2, k2, v2, _cu(lens_q2), _cu(lens_k2), 10, 12, dropout_p=p,
                                         backend="elsa", precision="strict")
    for b in (0, 2):
        assert torch.equal(out2[cq2[b]:cq2[b + 1]], out[cq[b]:cq[b + 1]])
    # and the first and last sequences (same inputs) drew independent masks: they differ
    assert not torch.equal(keep[0, :, :6, :5], keep[2, :, :6, :5])


@kernels
def test_unbiased():
    """48 copies of one sequence packed together: each draws its own mask, and their mean output approaches the
    output without dropout (SDPA's 1 / (1 - p) scaling) with an error near one draw's / sqrt(48)."""
    n, L = 48, 12
    q, k, v = _pack([L], [L], Hq=1, Hkv=1)
    ref = _varlen(q, k, v, [L], [L])
    draws = _varlen(q.repeat(n, 1, 1), k.repeat(n, 1, 1), v.repeat(n, 1, 1), [L] * n, [L] * n, dropout_p=0.3)
    draws = draws.view(n, L, 1, -1)
    one = rel_err(draws[0], ref)
    mean = rel_err(draws.mean(0), ref)
    assert one > 0.2  # dropout does something
    assert mean < 3 * one / math.sqrt(n)


@kernels
def test_same_seed_same_output_p_one_and_p_zero():
    """``torch.manual_seed`` reproduces a call (outputs and gradients), another draw differs, ``dropout_p=1`` gives
    zeros, and ``dropout_p=0`` is the path without dropout bit for bit, drawing nothing from the generator."""
    lens_q, lens_k = [5, 0, 9], [7, 3, 12]
    q, k, v = _pack(lens_q, lens_k, requires_grad=True)

    def run(p):
        out = _varlen(q, k, v, lens_q, lens_k, dropout_p=p, is_causal=True)
        out.square().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return out.detach(), grads

    torch.manual_seed(3)
    a, ga = run(0.2)
    b, _ = run(0.2)
    torch.manual_seed(3)
    c, gc = run(0.2)
    assert torch.equal(a, c) and all(torch.equal(x, y) for x, y in zip(ga, gc))
    assert not torch.equal(a, b)
    assert _varlen(q, k, v, lens_q, lens_k, dropout_p=1.0).abs().max() == 0

    state = torch.get_rng_state()
    z, gz = run(0.0)
    assert torch.equal(torch.get_rng_state(), state)
    out = _varlen(q, k, v, lens_q, lens_k, is_causal=True)
    out.square().sum().backward()
    assert torch.equal(z, out.detach()) and all(torch.equal(x, t.grad) for x, t in zip(gz, (q, k, v)))


@kernels
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_a_reference_given_the_kernels_mask(causal, backward_path):
    """Output and dQ/dK/dV against float64 ``(softmax * keep / (1 - p)) @ v`` per sequence, with the keep mask the
    kernels drew (same seed); GQA, Dv != D, an empty sequence, Nq != Nk (bottom-right causal)."""
    p = 0.25
    lens_q, lens_k = [5, 0, 9, 4], [7, 3, 12, 4]
    q, k, v = _pack(lens_q, lens_k, Hq=4, Hkv=2, Dv=8, requires_grad=True)
    torch.manual_seed(11)
    out = _varlen(q, k, v, lens_q, lens_k, dropout_p=p, is_causal=causal)
    torch.manual_seed(11)
    seed = training.draw_seed(q.device)
    with torch.no_grad():
        keep = _keep(q, k, v, lens_q, lens_k, p, seed, is_causal=causal).cpu()
    go = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * go.to(DEV)).sum().backward()

    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    ref = torch.zeros(out.shape, dtype=torch.float64)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        qs = qd[cq[b]:cq[b + 1]].transpose(0, 1)
        ks = kd[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(2, 0)
        vs = vd[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(2, 0)
        s = qs @ ks.transpose(-1, -2) * 16 ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).logical_not(), float("-inf"))
        ref[cq[b]:cq[b + 1]] = ((s.softmax(-1) * keep[b, :, :lq, :lk] / (1 - p)) @ vs).transpose(0, 1)
    (ref * go).sum().backward()
    assert rel_err(out.detach().cpu(), ref.detach()) < 2e-6
    for t, r in zip((q, k, v), (qd, kd, vd)):
        assert rel_err(t.grad.cpu(), r.grad) < 2e-5
    assert k.grad[ck[1]:ck[2]].abs().max() == 0  # the empty sequence's keys get no gradient


@pytest.mark.parametrize("backend", ["reference", "elsa"])
@pytest.mark.parametrize("bad, exc", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                      ("0.1", TypeError), (True, TypeError)])
def test_bad_dropout_p_is_refused_naming_it(backend, bad, exc):
    lens = [3, 4]
    q, k, v = _pack(lens, lens)
    with pytest.raises(exc, match=r"dropout_p"):
        _varlen(q, k, v, lens, lens, dropout_p=bad, backend=backend)


def test_reference_backend_dropout():
    """The reference draws its own masks (the same distribution as the kernels', other draws): reproducible from
    ``torch.manual_seed``, unbiased over 48 packed copies, p=1 gives zeros, p=0 is the path without dropout, and
    gradients flow (eager autograd)."""
    n, L = 48, 12
    q, k, v = (t.double() for t in _pack([L], [L], Hq=1, Hkv=1))
    ref = _varlen(q, k, v, [L], [L], backend="reference")
    qs, ks, vs = (t.repeat(n, 1, 1).requires_grad_() for t in (q, k, v))
    torch.manual_seed(4)
    draws = _varlen(qs, ks, vs, [L] * n, [L] * n, dropout_p=0.3, backend="reference")
    torch.manual_seed(4)
    again = _varlen(qs, ks, vs, [L] * n, [L] * n, dropout_p=0.3, backend="reference")
    assert torch.equal(draws, again)
    draws = draws.view(n, L, 1, -1)
    one = rel_err(draws[0].detach(), ref)
    assert one > 0.2 and not torch.equal(draws[0], draws[1])
    assert rel_err(draws.mean(0).detach(), ref) < 3 * one / math.sqrt(n)
    draws.sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().max() > 0 for t in (qs, ks, vs))
    assert _varlen(q, k, v, [L], [L], dropout_p=1.0, backend="reference").abs().max() == 0
    assert torch.equal(_varlen(q, k, v, [L], [L], dropout_p=0.0, backend="reference"), ref)
