"""Converted models train on the kernels: ``convert(verify="grad")`` gradient parity with the native model (timm
ViT, Swin's bias tables, HF LLaMA with GQA and padding, BERT), train mode with the module's own dropout on the
kernels, and a compiled training step (``torch.compile(fullgraph=True)``) against eager. fp32, tiny configs,
random weights; the kernels run in the Triton interpreter on CPU."""

import pytest
import torch
import torch.nn as nn

import elsa_surgery
from elsa_surgery import convert, dispatch, revert

from kernel_env import DEV, needs_kernels

pytestmark = needs_kernels


def _grad_report(model, inputs=None):
    rep = convert(model, backend="elsa", precision="strict", verify="grad", example_inputs=inputs)
    p = rep.parity
    assert p.passed and p.grad_passed, str(rep)
    assert p.grad_params and p.grad_params == sum(1 for q in model.parameters() if q.requires_grad)
    assert all(b.startswith("elsa/") for b in rep.backends_used), rep.backends_used
    assert "gradients: PASSED" in str(rep)
    return rep


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_timm_grad_parity(family):
    pytest.importorskip("timm")
    from test_timm_adapters import build

    model = build(family, **({"img_size": 32} if family == "swin" else {})).to(DEV)
    _grad_report(model)
    if family == "swin":  # the relative-position bias tables get their gradient through the kernels' dMask
        tables = [p for n, p in model.named_parameters() if "relative_position_bias_table" in n]
        x = torch.randn(2, 3, 32, 32, device=DEV)
        model(x).square().mean().backward()
        assert tables and all(t.grad is not None and t.grad.abs().max() > 0 for t in tables)
    revert(model)


def test_grad_check_catches_a_wrong_backward(monkeypatch):
    """verify="grad" fails (and restores the model) when the converted model's gradients are wrong although its
    outputs agree: a dV scaled by 1.01 in the kernels' backward."""
    pytest.importorskip("timm")
    from test_timm_adapters import build
    from elsa_surgery.kernels import backward_launch

    real = backward_launch.attention_backward

    def wrong(*a, **kw):
        dq, dk, dv, dm = real(*a, **kw)
        return dq, dk, dv * 1.01, dm

    monkeypatch.setattr(backward_launch, "attention_backward", wrong)
    model = build("vit").to(DEV)
    with pytest.raises(elsa_surgery.ParityError, match="gradient check failed"):
        convert(model, backend="elsa", precision="strict", verify="grad")
    from elsa_surgery.surgery import is_converted

    assert not any(is_converted(m) for m in model.modules())


def test_timm_vit_trains_with_its_attn_drop_on_the_kernels():
    pytest.importorskip("timm")
    from test_timm_adapters import build

    model = build("vit", attn_drop_rate=0.2).to(DEV)
    convert(model, backend="elsa", verify=False)
    model.train()
    x = torch.randn(2, 3, 32, 32, device=DEV)
    with dispatch.record() as log:
        torch.manual_seed(4)
        a = model(x)
        a.square().mean().backward()
        torch.manual_seed(4)
        b = model(x)
    assert log and all(d.backend == "elsa" for d in log)
    assert torch.equal(a, b)  # the same seed draws the same dropout masks
    model.eval()
    assert not torch.allclose(a, model(x))  # ... and dropout was applied
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_llama_gqa_padding_grad_parity():
    pytest.importorskip("transformers")
    from test_hf_attention import _ids, _tiny_llama

    model = _tiny_llama().to(DEV)
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :4] = 0  # left padding
    _grad_report(model, {"input_ids": _ids(2, 12, 97).to(DEV), "attention_mask": am.to(DEV)})


def test_bert_grad_parity_and_training_dropout():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel
    from test_hf_attention import _ids

    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=64, attn_implementation="sdpa",
                     attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertModel(cfg).eval().to(DEV)
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 7:] = 0
    inputs = {"input_ids": _ids(2, 11, 97).to(DEV), "attention_mask": am.to(DEV)}
    _grad_report(model, inputs)
    model.train()  # attention_probs_dropout_prob reaches the kernels (the adapter used to refuse it)
    with dispatch.record() as log:
        out = model(**inputs).last_hidden_state
        out.square().mean().backward()
    assert log and all(d.backend == "elsa" for d in log)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


class _BiasedAttention(nn.Module):
    """A tiny attention block with a learned additive bias (mask gradient) and GQA."""

    def __init__(self, d=32, heads=4, kv_heads=2, n=24):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd)
        self.o = nn.Linear(d, d)
        self.bias = nn.Parameter(0.5 * torch.randn(1, heads, n, n))

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.h, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kvh, self.hd).permute(2, 0, 3, 1, 4)
        y = elsa_surgery.attention(q, k, v, attn_mask=self.bias, enable_gqa=True, backend="elsa", precision="strict")
        return self.o(y.transpose(1, 2).reshape(B, N, -1))


def test_compiled_training_step_matches_eager():
    """Three SGD steps under torch.compile(fullgraph=True) (aot_eager: the kernels' custom ops and their
    registered autograd are traced; the interpreter cannot run inside Inductor-generated code on CPU) equal
    three eager steps."""
    torch.manual_seed(0)
    eager = _BiasedAttention().to(DEV)
    compiled_model = _BiasedAttention().to(DEV)
    compiled_model.load_state_dict(eager.state_dict())
    x = torch.randn(2, 24, 32, device=DEV)

    def step(model, opt, fn):
        opt.zero_grad()
        loss = fn(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    torch._dynamo.reset()
    fn = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.5)
    for _ in range(3):
        le, lc = step(eager, opt_e, eager), step(compiled_model, opt_c, fn)
        assert torch.allclose(le, lc, rtol=1e-5, atol=1e-7), (le, lc)
    for (n, a), b in zip(eager.named_parameters(), compiled_model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), n
