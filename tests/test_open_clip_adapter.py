"""open_clip models (random weights, from open_clip's own configs) through elsa_surgery.convert, on the CPU.

Both towers of CLIP ViT-B-32 and of a reduced-depth ViT-L-14 (their blocks hold nn.MultiheadAttention: the
text tower passes its float causal mask), CoCa (attentional pooler with kdim/vdim, causal text decoder with
cross-attention), and open_clip's own ``Attention`` class (qk-norm, head scale, inner norm, scaled cosine).
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

open_clip = pytest.importorskip("open_clip")

import elsa_surgery  # noqa: E402
from elsa_surgery import dispatch  # noqa: E402
from elsa_surgery.registry import PatchConfig, get_adapter  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_open_clip(caplog):
    caplog.set_level(logging.ERROR, logger="root")  # "No pretrained weights loaded" warnings


def _build(name, layers=None, **tower_overrides):
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    kw = {}
    for tower in ("vision_cfg", "text_cfg", "multimodal_cfg"):
        if tower in cfg:
            if layers is not None:
                cfg[tower]["layers"] = layers
            cfg[tower].update(tower_overrides.get(tower, {}))
            kw[tower] = cfg[tower]
    return open_clip.create_model(name, pretrained=None, **kw).eval()


def _inputs(model, batch=2):
    from elsa_surgery.adapters.open_clip import example_inputs_for

    return example_inputs_for(model, batch) or {}


def _check(a, b, tol=1e-5):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _spy_sdpa(monkeypatch):
    calls = []
    orig = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or orig(*a, **k))
    for op in ("_native_multi_head_attention", "_transformer_encoder_layer_fwd"):
        fn = getattr(torch, op)
        monkeypatch.setattr(torch, op, lambda *a, _fn=fn, **k: calls.append(1) or _fn(*a, **k))
    return calls


def test_clip_vit_b32_both_towers(monkeypatch):
    model = _build("ViT-B-32")
    inp = _inputs(model)
    assert inp["image"].shape == (2, 3, 224, 224) and inp["text"].shape == (2, 77)
    with torch.no_grad():
        ref_img, ref_txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    rep = elsa_surgery.convert(model)  # parity on the adapter's inputs (image + text)
    assert rep.parity.passed and rep.parity.inputs.startswith("adapter")
    assert rep.counts == {"torch.mha": 24}
    assert model.state_dict().keys() == sd.keys() and all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    calls = _spy_sdpa(monkeypatch)
    with torch.no_grad(), dispatch.record() as log:
        img, txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    assert not calls and len(log) == 24 and {d.backend for d in log} == {"reference"}
    _check(img, ref_img)
    _check(txt, ref_txt)
    elsa_surgery.revert(model)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model.encode_image(inp["image"]), ref_img)
        assert torch.equal(model.encode_text(inp["text"]), ref_txt)


def test_clip_vit_l14_reduced_depth_text_causal_mask():
    model = _build("ViT-L-14", layers=2)
    assert model.attn_mask is not None and model.attn_mask.dtype == torch.float32  # float causal mask [L, L]
    inp = _inputs(model)
    with torch.no_grad():
        ref = model.encode_text(inp["text"])
        # the mask matters: without it the text features change
        no_mask = model.transformer(model.token_embedding(inp["text"]) + model.positional_embedding)
    rep = elsa_surgery.convert(model, verify=False)
    assert rep.counts == {"torch.mha": 4}
    with torch.no_grad():
        out = model.encode_text(inp["text"])
        conv_no_mask = model.transformer(model.token_embedding(inp["text"]) + model.positional_embedding)
    _check(out, ref)
    _check(conv_no_mask, no_mask)


def test_coca_pooler_and_multimodal_decoder():
    model = _build("coca_ViT-B-32", layers=1)
    with torch.no_grad():  # the decoder's projection is zero-initialised: make the logits informative
        model.text_decoder.text_projection.normal_(std=0.05)
    inp = _inputs(model)
    with torch.no_grad():
        ref = model(**inp)
    rep = elsa_surgery.convert(model, example_inputs=inp)
    assert rep.parity.passed
    names = {e.name for e in rep.converted}
    assert {"visual.attn_pool.attn", "text_decoder.cross_attn.0.attn", "text_decoder.resblocks.0.attn"} <= names
    assert model.visual.attn_pool.attn.kdim == 768 and model.visual.attn_pool.attn.embed_dim == 512
    with torch.no_grad():
        out = model(**inp)
    for k in ("image_features", "text_features", "logits"):
        assert ref[k].abs().max() > 0
        _check(out[k], ref[k])


def test_custom_attention_qk_norm_head_scale_inner_norm(monkeypatch):
    model = _build("ViT-B-32", layers=1,
                   vision_cfg=dict(qk_norm=True, scale_heads=True, scale_attn_inner=True, scale_attn=True),
                   text_cfg=dict(qk_norm=True))
    attn_cls = open_clip.transformer.Attention
    mods = [m for m in model.modules() if type(m) is attn_cls]
    assert len(mods) == 2
    with torch.no_grad():
        for m in mods:  # non-trivial head scale and qk-norm affine
            m.head_scale.normal_(1.0, 0.3) if m.head_scale is not None else None
            if hasattr(m.ln_q, "weight"):
                m.ln_q.weight.normal_(1.0, 0.3)
                m.ln_k.bias.normal_(0.0, 0.3)
    inp = _inputs(model)
    with torch.no_grad():
        ref_img, ref_txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    rep = elsa_surgery.convert(model, example_inputs=inp)
    assert rep.counts == {"open_clip.attention": 2}
    calls = _spy_sdpa(monkeypatch)
    with torch.no_grad():
        img, txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    assert not calls
    _check(img, ref_img)
    _check(txt, ref_txt)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float3d"])
def test_scaled_cosine_attention_against_float64_formula(mask_kind):
    """open_clip 3.3's own scaled-cosine path calls bmm on 4-D tensors and fails; check the formula instead."""
    attn = open_clip.transformer.Attention(48, 4, scaled_cosine=True, scale_heads=True).double().eval()
    with torch.no_grad():
        attn.logit_scale.copy_(torch.tensor([0.5, 2.0, 3.0, 5.0]).view(4, 1, 1))  # one head clamps at log(100)
        attn.head_scale.normal_(1.0, 0.3)
    x = torch.randn(3, 6, 48, dtype=torch.float64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(6, 6) < 0.3
        mask.fill_diagonal_(False)
    elif mask_kind == "float3d":
        mask = torch.randn(3 * 4, 6, 6, dtype=torch.float64)
    get_adapter("open_clip.attention").patch(attn, PatchConfig())
    out = attn(x, attn_mask=mask)
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(3, 6, 4, 12).transpose(1, 2) for t in (q, k, v))
    s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    s = s * attn.logit_scale.clamp(max=attn.logit_scale_max).exp()
    if mask_kind == "bool":
        s = s.masked_fill(mask, float("-inf"))
    elif mask_kind == "float3d":
        s = s + mask.view(3, 4, 6, 6)
    y = (s.softmax(-1) @ v) * attn.head_scale
    expected = attn.out_proj(y.transpose(1, 2).reshape(3, 6, 48))
    _check(out, expected, tol=1e-12)


def test_open_clip_attention_matches_exact_class_only():
    ad = get_adapter("open_clip.attention")

    class Sub(open_clip.transformer.Attention):
        pass

    assert ad.matches(open_clip.transformer.Attention(32, 4))
    assert not ad.matches(Sub(32, 4))
    assert not ad.matches(torch.nn.MultiheadAttention(32, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_vit_l14_on_gpu(dtype):
    model = _build("ViT-L-14", layers=4).cuda().to(dtype)
    inp = {k: (v.cuda().to(dtype) if v.is_floating_point() else v.cuda()) for k, v in _inputs(model, 4).items()}
    with torch.no_grad():
        ref_img, ref_txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    rep = elsa_surgery.convert(model, example_inputs=inp)
    assert rep.parity.passed
    with torch.no_grad(), dispatch.record() as log:
        img, txt = model.encode_image(inp["image"]), model.encode_text(inp["text"])
    assert {d.backend for d in log} == {"elsa"}
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    _check(img.float(), ref_img.float(), tol)
    _check(txt.float(), ref_txt.float(), tol)
