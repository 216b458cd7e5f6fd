"""The VGGT adapter (adapters/vggt.py) on our own VGGT-shaped aggregator (tests/models/vggt_like.py), on the CPU.

The ``vggt`` package is not installed here: the test model's ``Attention`` is registered through the public
``register_adapter`` API (exact class), and the built-in adapter's vendored-copy rule is checked on classes
placed under a ``vggt`` package path.
"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import dispatch
from elsa_surgery.adapters.vggt import VGGTAttention
from elsa_surgery.registry import PatchConfig, get_adapter

try:
    from tests.models import vggt_like
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less import mode)
    from models import vggt_like


@pytest.fixture
def registered():
    adapter = elsa_surgery.register_adapter(VGGTAttention(name="test.vggt_like", classes=(vggt_like.Attention,)))
    yield adapter
    elsa_surgery.unregister_adapter("test.vggt_like")


def _aggregator(depth=2):
    torch.manual_seed(0)
    return vggt_like.Aggregator(dim=128, depth=depth, num_heads=2).eval()  # head_dim 64


def _images(B=1, S=3, h=3, w=4):
    return torch.rand(B, S, 3, 14 * h, 14 * w)


def test_builtin_adapter_does_not_match_the_test_model_by_accident():
    agg = _aggregator(depth=1)
    builtin = get_adapter("vggt.attention")
    assert not any(builtin.matches(m) for m in agg.modules())


def test_aggregator_parity_spy_and_revert(registered, monkeypatch):
    agg = _aggregator()
    images = _images()
    assert vggt_like.tokens_per_frame(42, 56) == 5 + 12
    with torch.no_grad():
        ref = agg(images)
    sd = {k: v.clone() for k, v in agg.state_dict().items()}
    rep = elsa_surgery.convert(agg, adapters=["test.vggt_like"], example_inputs=(images,))
    assert rep.counts == {"test.vggt_like": 4} and rep.parity.passed  # 2 frame + 2 global
    assert agg.state_dict().keys() == sd.keys()

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    images2 = _images(B=2, S=2)
    with torch.no_grad():
        converted2 = agg(images2)
    assert not calls
    monkeypatch.undo()
    with torch.no_grad(), dispatch.record() as log:
        out = agg(images)
    # frame attention runs over (B*S, P, C) and global over (B, S*P, C)
    assert len(log) == 4 and {d.backend for d in log} == {"reference"}
    for o, r in zip(out, ref):
        assert o.shape == r.shape == (1, 3, 17, 256)
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    elsa_surgery.revert(agg)
    with torch.no_grad():
        again = agg(images)
        native2 = agg(images2)
    assert all(torch.equal(a, b) for a, b in zip(again, ref))
    for a, b in zip(converted2, native2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_and_qk_norm_matter():
    """The adapter must apply RoPE with the caller's positions and the qk-norm: check against float64 math."""
    attn = vggt_like.Attention(128, 2, rope=vggt_like.Rope2D()).double().eval()
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.bias.normal_(0.0, 0.3)
    x = torch.randn(2, 9, 128, dtype=torch.float64)
    pos = torch.randint(0, 5, (2, 9, 2))
    with torch.no_grad():
        ref = attn(x, pos=pos)
        other = attn(x, pos=torch.zeros_like(pos))
    assert (ref - other).abs().max() > 1e-3  # positions change the output
    VGGTAttention(classes=(vggt_like.Attention,)).patch(attn, PatchConfig(backend="reference"))
    with torch.no_grad():
        out = attn(x, pos=pos)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _vendored(module_path: str, memeff: bool = False):
    """A copy of the test Attention class whose __module__ claims a vendored location."""
    base = vggt_like.Attention
    if memeff:
        def forward(self, x, attn_bias=None, pos=None):
            assert pos is None
            if attn_bias is not None:
                raise AssertionError("xFormers is required for using nested tensors")
            return base.forward(self, x)
        cls = types.new_class("MemEffAttention", (base,), exec_body=lambda d: d.update(forward=forward))
    else:
        cls = types.new_class("Attention", (base,), exec_body=lambda d: d.update(forward=base.forward))
    cls.__module__ = module_path
    return cls


@pytest.mark.parametrize("path,expected", [
    ("third_party.vggt.layers.attention", True),
    ("vggt.layers.attention_copy", True),
    ("myvggt.layers.attention", False),
    ("tests.models.vggt_like", False),
])
def test_vendored_copy_rule(path, expected):
    cls = _vendored(path)
    assert get_adapter("vggt.attention").matches(cls(128, 2, rope=vggt_like.Rope2D())) is expected


def test_vendored_rule_needs_the_structure():
    class Attention(nn.Module):  # right name and path, wrong structure
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 16)

        def forward(self, x, pos=None):
            return x

    Attention.__module__ = "third_party.vggt.layers.attention"
    assert not get_adapter("vggt.attention").matches(Attention())


def test_memeff_attention_converted_and_bias_runs_original():
    cls = _vendored("third_party.vggt.layers.attention", memeff=True)
    attn = cls(128, 2, rope=None).eval()
    x = torch.randn(2, 7, 128)
    with torch.no_grad():
        ref = attn(x)
    rep = elsa_surgery.convert(attn, example_inputs=(x,))
    assert rep.counts == {"vggt.attention": 1} and rep.parity.passed
    with torch.no_grad(), dispatch.record() as log:
        out = attn(x)
    assert [d.backend for d in log] == ["reference"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="xFormers"):
        attn(x, attn_bias=torch.zeros(1))  # the original's behaviour, reached through the fallback
    assert list(attn.elsa_native_calls) == ["attn_bias given (xFormers block-diagonal masks)"]


def test_register_rejects_non_module_classes():
    with pytest.raises(TypeError, match="classes"):
        VGGTAttention(classes=(int,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregator_on_gpu_uses_the_kernels(registered, dtype):
    agg = _aggregator().cuda().to(dtype)
    images = _images(B=1, S=4, h=6, w=8).cuda().to(dtype)  # 4 frames x 53 tokens
    with torch.no_grad():
        ref = agg(images)
    rep = elsa_surgery.convert(agg, adapters=["test.vggt_like"], example_inputs=(images,))
    assert rep.parity.passed and rep.fallbacks == []
    with torch.no_grad(), dispatch.record() as log:
        out = agg(images)
    assert {d.backend for d in log} == {"elsa"}
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.float(), r.float(), rtol=tol, atol=tol)
