"""Converted models train on the kernels: ``convert(verify="grad")`` gradient parity with the native model (timm
ViT, Swin's bias tables, SwinV2's continuous position bias, EVA with RoPE, HF LLaMA with GQA and padding, BERT,
open_clip CLIP), bf16 (cast and autocast) judged against the float64 model's gradients, train mode with the module's
own dropout on the kernels, and a compiled training step (``torch.compile(fullgraph=True)``) against eager. Tiny
configs, random weights; the kernels run in the Triton interpreter on CPU."""

import copy

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


@pytest.mark.parametrize("family", ["eva", "eva_rope_gqa"])
def test_timm_eva_rope_grad_parity(family):
    """EVA-02 (EvaAttention, fused qkv) and AttentionRope with GQA: RoPE is applied to q and k before the kernels,
    so dQ and dK pass back through the rotation to the projection weights."""
    pytest.importorskip("timm")
    from test_timm_adapters import build

    model = build(family, depth=1).to(DEV)
    assert model.rope is not None
    rep = _grad_report(model)
    assert set(rep.counts) == {"timm.eva.eva_attention" if family == "eva" else "timm.eva.attention_rope"}
    revert(model)


SWINV2 = dict(img_size=32, depths=(1,), num_heads=(2,))


def _zero_mask_grad(monkeypatch):
    """The kernels' backward with the additive mask's gradient zeroed (a broken dMask)."""
    from elsa_surgery.kernels import backward_launch

    real = backward_launch.attention_backward

    def no_dmask(*a, **kw):
        dq, dk, dv, dm = real(*a, **kw)
        return dq, dk, dv, None if dm is None else torch.zeros_like(dm)

    monkeypatch.setattr(backward_launch, "attention_backward", no_dmask)


def test_swinv2_continuous_position_bias_grad_parity(monkeypatch):
    """SwinV2: the continuous position bias (16·sigmoid(cpb_mlp(coords)), a float mask that requires grad) and the
    cosine attention's logit scale get their gradients through the kernels' dMask and dQ; with dMask zeroed the
    check fails on a cpb_mlp parameter."""
    pytest.importorskip("timm")
    from test_timm_adapters import build

    model = build("swinv2", **SWINV2).to(DEV)
    rep = _grad_report(model)
    assert set(rep.counts) == {"timm.swin.window_attention_v2"}
    revert(model)
    names = [n for n, _ in model.named_parameters() if "cpb_mlp" in n or "logit_scale" in n]
    assert len(names) == 4  # cpb_mlp.0.weight, cpb_mlp.0.bias, cpb_mlp.2.weight, logit_scale
    native = elsa_surgery.verify.parameter_grads(model, torch.randn(2, 3, 32, 32, device=DEV))
    assert all(native[n].abs().max() > 0 for n in names)  # the check compares gradients that are not all zero
    _zero_mask_grad(monkeypatch)
    with pytest.raises(elsa_surgery.ParityError, match="gradient check failed.*cpb_mlp"):
        convert(model, backend="elsa", precision="strict", verify="grad")


def test_open_clip_grad_parity():
    """open_clip CLIP (both towers through nn.MultiheadAttention, the text tower with its float causal mask)."""
    open_clip = pytest.importorskip("open_clip")
    cfg = open_clip.get_model_config("ViT-B-32")
    torch.manual_seed(0)
    model = open_clip.create_model(
        "ViT-B-32", pretrained=None, embed_dim=32,
        vision_cfg=dict(cfg["vision_cfg"], width=32, layers=1, image_size=32, patch_size=8, head_width=8),
        text_cfg=dict(cfg["text_cfg"], width=32, heads=4, layers=1, context_length=16, vocab_size=97)).eval().to(DEV)
    rep = _grad_report(model)
    assert rep.counts == {"torch.mha": 2} and rep.parity.inputs.startswith("adapter")
    revert(model)


def _rel_l2(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def _bf16_grad_errors(model, x, autocast):
    """Per parameter: the relative L2 error of the bf16 native and bf16 converted gradients against the float64
    model's (``verify.parameter_grads``' loss); bf16 by casting the model or by CPU/CUDA autocast."""
    from elsa_surgery.verify import parameter_grads

    ref = parameter_grads(copy.deepcopy(model).double(), x.double())
    native = model if autocast else copy.deepcopy(model).bfloat16()
    xin = x if autocast else x.bfloat16()
    grads = {}
    for side in ("native", "converted"):
        if side == "converted":
            convert(native, backend="elsa", verify=False)
        with torch.autocast(DEV, torch.bfloat16, enabled=autocast), dispatch.record() as log:
            grads[side] = parameter_grads(native, xin)
        if side == "converted":
            assert log and all(d.backend == "elsa" and d.precision is None for d in log)  # no fp32 mode: bf16, log
    top = max(r.norm() for r in ref.values())
    return {n: (_rel_l2(grads["native"][n], r), _rel_l2(grads["converted"][n], r))
            for n, r in ref.items() if r.norm() > 1e-6 * top}  # k's bias: ~0 in exact arithmetic


def _assert_bf16_as_good_as_native(errors):
    """Each converted gradient within max(3x native's error, 0.05) of float64's, and on average no worse than 1.5x
    native's bf16 error."""
    bad = {n: e for n, e in errors.items() if e[1] > max(3 * e[0], 0.05)}
    assert not bad, bad
    mean_native = sum(e[0] for e in errors.values()) / len(errors)
    mean_conv = sum(e[1] for e in errors.values()) / len(errors)
    assert mean_conv <= 1.5 * mean_native, (mean_conv, mean_native)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("family", ["vit", "swinv2"])
def test_bf16_grad_parity_against_float64(family, autocast):
    """bf16 training numerics: the converted model's parameter gradients (kernels in bf16) are as close to the
    float64 model's as the native bf16 model's are. (``verify="grad"``'s bf16 tolerances are loose; this is the
    tighter check.)"""
    pytest.importorskip("timm")
    from test_timm_adapters import build, images

    model = build(family, depth=1) if family == "vit" else build(family, **SWINV2)
    errors = _bf16_grad_errors(model.to(DEV), images(model).to(DEV), autocast)
    assert len(errors) >= 18
    _assert_bf16_as_good_as_native(errors)


def test_bf16_grad_check_catches_a_broken_mask_grad(monkeypatch):
    pytest.importorskip("timm")
    from test_timm_adapters import build, images

    model = build("swinv2", **SWINV2).to(DEV)
    _zero_mask_grad(monkeypatch)
    errors = _bf16_grad_errors(model, images(model).to(DEV), autocast=False)
    assert errors["layers.0.blocks.0.attn.cpb_mlp.0.weight"][1] > 0.9
    with pytest.raises(AssertionError, match="cpb_mlp"):
        _assert_bf16_as_good_as_native(errors)


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


def test_hf_clip_grad_parity():
    """transformers' CLIP, both towers (causal text with padding, bidirectional vision), through the attention
    interface: gradient parity with the native model."""
    pytest.importorskip("transformers")
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=16),
                     vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8),
                     projection_dim=16, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = CLIPModel(cfg).to(DEV)
    ids = torch.randint(1, 50, (2, 9))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    rep = _grad_report(model, {"input_ids": ids.to(DEV), "attention_mask": am.to(DEV),
                               "pixel_values": torch.randn(2, 3, 32, 32).to(DEV)})
    assert rep.num_converted >= 2, str(rep)  # a text and a vision attention at least


class _Embeds(nn.Module):
    """A transformers model fed float embeddings (so that the float64 reference can run it) with a fixed padding
    mask, returning its last hidden state."""

    def __init__(self, model, mask):
        super().__init__()
        self.model = model
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.model(inputs_embeds=x, attention_mask=self.mask).last_hidden_state


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_bf16_hf_grad_parity_against_float64(family):
    """bf16 (model cast) LLaMA (GQA, causal, left padding) and BERT (right padding: the varlen lengths path) train as
    closely to the float64 model as the native bf16 model does."""
    pytest.importorskip("transformers")
    am = torch.ones(2, 10, dtype=torch.long)
    if family == "llama":
        from test_hf_attention import _tiny_llama

        model, width = _tiny_llama().model, 64
        am[1, :3] = 0
    else:
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=48, max_position_embeddings=32, attn_implementation="sdpa")
        torch.manual_seed(0)
        model, width = BertModel(cfg), 32
        am[1, 7:] = 0
    wrapped = _Embeds(model, am).to(DEV)
    x = torch.randn(2, 10, width, generator=torch.Generator().manual_seed(3)).to(DEV)
    errors = _bf16_grad_errors(wrapped, x, autocast=False)
    assert len(errors) >= 8
    _assert_bf16_as_good_as_native(errors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_grad_scaling_and_checkpointing_like_native(dtype):
    """Issue 25's integration: a converted timm ViT (qk_norm: CUDA's autocast hands the kernels fp32 q/k from the
    LayerNorm beside a half v; the CPU's keeps them half, test_sdpa_fidelity covers mixed dtypes there) trained with
    activation checkpointing (timm's ``set_grad_checkpointing``: torch.utils.checkpoint),
    autocast and ``torch.amp.GradScaler``: the unscaled gradients of the first step match the native model's within
    the dtype's error, no step is skipped for infs, and both models take the same number of optimizer steps."""
    pytest.importorskip("timm")
    from test_timm_adapters import build, images

    native = build("vit", depth=1).to(DEV)
    native.set_grad_checkpointing(True)
    converted = copy.deepcopy(native)
    convert(converted, backend="elsa", verify=False)
    x = images(native).to(DEV)
    grads, scales = {}, {}
    for side, model in (("native", native), ("converted", converted)):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(torch.device(DEV).type, init_scale=2.0 ** 10)
        with dispatch.record() as log:
            for step in range(2):
                with torch.autocast(torch.device(DEV).type, dtype):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if step == 0:
                    grads[side] = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        scales[side] = scaler.get_scale()
        if side == "converted":
            assert log and all(d.backend == "elsa" for d in log), [d.backend for d in log]
    assert scales["native"] == scales["converted"] == 2.0 ** 10  # no inf found, no step skipped
    assert grads["native"].keys() == grads["converted"].keys() and len(grads["native"]) >= 18
    diff = sum(float((grads["converted"][n] - g).norm()) ** 2 for n, g in grads["native"].items()) ** 0.5
    ref = sum(float(g.norm()) ** 2 for g in grads["native"].values()) ** 0.5
    assert diff <= (2e-2 if dtype == torch.float16 else 6e-2) * ref, diff / ref
