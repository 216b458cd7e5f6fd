"""The HSIMAE adapter (adapters/hsimae.py) on our own HSIMAE-shaped model (tests/models/hsimae_like.py), CPU."""

import pytest
import torch
import torch.nn as nn

import elsa_surgery
from elsa_surgery import dispatch
from elsa_surgery.adapters.hsimae import HSIMAEAttention, has_hsimae_structure
from elsa_surgery.registry import PatchConfig, get_adapter

try:
    from tests.models import hsimae_like
except ImportError:  # tests/ itself is on sys.path
    from models import hsimae_like


def _model(depth=2):
    torch.manual_seed(0)
    return hsimae_like.build("B", depth=depth).eval()


def test_shapes_of_the_test_model():
    m = _model(depth=1)
    assert m.patch_embed.num_tokens == 36
    attn = m.blocks[0].attn
    assert attn.num_heads == 9 and attn.q.in_features // attn.num_heads == 16
    assert isinstance(m.patch_embed.proj, nn.Conv3d)


def test_parity_large_batch_and_revert(monkeypatch):
    m = _model()
    x = torch.rand(512, 1, 64, 9, 9)
    with torch.no_grad():
        ref_latent, ref_pred = m(x)
    rep = elsa_surgery.convert(m)  # the adapter builds the example inputs (Conv3d patch embedding)
    assert rep.parity.passed and rep.parity.inputs == "adapter hsimae.attention"
    assert rep.counts == {"hsimae.attention": 3}  # 2 encoder blocks + 1 decoder block
    softmax_calls = []
    orig = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: softmax_calls.append(1) or orig(*a, **k))
    with torch.no_grad(), dispatch.record() as log:
        latent, pred = m(x)
    monkeypatch.undo()
    assert not softmax_calls and len(log) == 3
    torch.testing.assert_close(latent, ref_latent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pred, ref_pred, rtol=1e-5, atol=1e-5)
    elsa_surgery.revert(m)
    with torch.no_grad():
        latent2, pred2 = m(x)
    assert torch.equal(latent2, ref_latent) and torch.equal(pred2, ref_pred)


@pytest.mark.parametrize("bias_shape", [(36, 36), (1, 9, 36, 36), (8, 1, 36, 36)])
def test_additive_attn_bias(bias_shape):
    m = _model(depth=1)
    x = torch.rand(8, 1, 64, 9, 9)
    bias = torch.randn(bias_shape) * 2
    with torch.no_grad():
        ref, _ = m(x, attn_bias=bias)
        no_bias, _ = m(x)
    assert (ref - no_bias).abs().max() > 1e-3
    elsa_surgery.convert(m, verify=False)
    with torch.no_grad():
        out, _ = m(x, attn_bias=bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_float64_oracle_single_module():
    attn = hsimae_like.Attention(32, 2, qk_scale=0.3).double()
    x = torch.randn(4, 36, 32, dtype=torch.float64)
    bias = torch.randn(36, 36, dtype=torch.float64)
    with torch.no_grad():
        ref = attn(x, attn_bias=bias)
    get_adapter("hsimae.attention").patch(attn, PatchConfig(backend="reference"))
    with torch.no_grad():
        out = attn(x, attn_bias=bias)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_bool_bias_runs_the_original():
    attn = hsimae_like.Attention(32, 2).eval()
    elsa_surgery.convert(attn, verify=False)
    x = torch.randn(2, 36, 32)
    attn(x, attn_bias=torch.zeros(36, 36, dtype=torch.bool))
    assert list(attn.elsa_native_calls) == ["non-float attn_bias (torch.bool) is added as numbers by the original"]


def test_structure_rule_does_not_match_other_attention_classes():
    ad = get_adapter("hsimae.attention")
    assert ad.matches(hsimae_like.Attention(32, 2))

    class Attention(nn.Module):  # q/k/v/proj like HSIMAE, but no input_size / adjust_drop_rate
        def __init__(self):
            super().__init__()
            self.num_heads, self.scale = 2, 0.25
            self.q, self.k, self.v, self.proj = (nn.Linear(16, 16) for _ in range(4))

        def forward(self, x, attn_bias=None):
            return x

    Attention.__module__ = "hsimae.models"
    assert not ad.matches(Attention())
    assert not has_hsimae_structure(Attention())
    # HSIMAE's structure under an unrelated module path: only an explicit registration matches it
    Copy = type("Attention", (hsimae_like.Attention,), {"forward": hsimae_like.Attention.forward})
    Copy.__module__ = "somewhere.else"
    assert not ad.matches(Copy(32, 2))
    assert HSIMAEAttention(name="mine", classes=(Copy,)).matches(Copy(32, 2))


@pytest.mark.gpu
def test_hsimae_on_gpu_large_batch():
    m = _model().cuda()
    x = torch.rand(4096, 1, 64, 9, 9, device="cuda")
    with torch.no_grad():
        ref_latent, ref_pred = m(x)
    rep = elsa_surgery.convert(m)
    assert rep.parity.passed
    with torch.no_grad(), dispatch.record() as log:
        latent, pred = m(x)
    assert len(log) == 3
    assert {d.backend for d in log} <= {"elsa", "reference"}
    torch.testing.assert_close(latent, ref_latent, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pred, ref_pred, rtol=1e-4, atol=1e-4)
