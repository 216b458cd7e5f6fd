"""timm adapters: every attention variant of vision_transformer.py, eva.py, swin_transformer(_v2).py.

Small random-weight models (reduced depth / width / resolution). For each family: the converted model
matches the original; every attention module is swapped (count checked); PyTorch SDPA is never called
after conversion; revert is bit-exact; the state dict is unchanged. Then the module-level features
(masks, is_causal, RoPE, GQA, latent pooling) against the original timm modules.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")

from elsa_surgery import Adapter, ParityError, dispatch, get_adapter, patching  # noqa: E402
from elsa_surgery.surgery import convert, is_converted, revert  # noqa: E402  (not elsa_surgery.convert)
from timm.layers import Attention, AttentionRope  # noqa: E402
from timm.layers.attention_pool import AttentionPoolLatent  # noqa: E402
from timm.models.vision_transformer import DiffParallelScalingBlock, ParallelScalingBlock  # noqa: E402

VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0)
EVA = dict(img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=2, num_classes=0)
SWIN = dict(img_size=64, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2), num_classes=0)

# name -> (timm model, kwargs, {adapter: expected count}, images sdpa-native?)
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(VIT, qk_norm=True, reg_tokens=2), {"timm.vit.attention": 2}),
    "vit_clip_map": ("vit_base_patch16_clip_224", dict(VIT, global_pool="map"),
                     {"timm.vit.attention": 2, "timm.vit.attention_pool_latent": 1}),
    "vit_prr": ("vit_tiny_patch16_224", dict(VIT, global_pool="prr"),
                {"timm.vit.attention": 2, "timm.vit.attention_pool_prr": 1}),
    "vit_parallel": ("vit_tiny_patch16_224", dict(VIT, block_fn=ParallelScalingBlock),
                     {"timm.vit.parallel_scaling_block": 2}),
    "vit_diff": ("vit_tiny_patch16_224", dict(VIT, attn_layer="diff"), {"timm.vit.diff_attention": 2}),
    "vit_diff_parallel": ("vit_tiny_patch16_224", dict(VIT, block_fn=DiffParallelScalingBlock),
                          {"timm.vit.diff_parallel_scaling_block": 2}),
    "eva": ("eva02_tiny_patch14_224", dict(EVA), {"timm.eva.eva_attention": 2}),
    "eva_split_qkv": ("eva02_tiny_patch14_224", dict(EVA, qkv_fused=False, num_reg_tokens=1),
                      {"timm.eva.eva_attention": 2}),
    "eva_rope_gqa": ("eva02_tiny_patch14_224", dict(EVA, embed_dim=64, num_heads=4, attn_type="rope",
                                                     qkv_fused=False, num_kv_heads=2),
                     {"timm.eva.attention_rope": 2}),
    "swin": ("swin_tiny_patch4_window7_224", dict(SWIN), {"timm.swin.window_attention": 4}),
    "swinv2": ("swinv2_tiny_window8_256", dict(SWIN), {"timm.swin.window_attention_v2": 4}),
}


def build(family, dtype=torch.float32, **overrides):
    name, kw, _ = FAMILIES[family]
    torch.manual_seed(0)
    try:
        model = timm.create_model(name, pretrained=False, **dict(kw, **overrides)).eval().to(dtype)
    except TypeError as exc:  # an older timm without the family's option (the device's: Eva without num_kv_heads)
        if "unexpected keyword argument" not in str(exc):
            raise
        pytest.skip(f"timm {timm.__version__} cannot build {family}: {exc}")
    with torch.no_grad():  # random weights a little larger than timm's init, so attention is not uniform
        for n, p in model.named_parameters():
            if p.dim() == 1 and n.endswith("weight") and "norm" in n:  # SwinV2 zero-inits its post-norms
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            if p.dim() >= 2 and ("qkv" in n or "q_proj" in n or "k_proj" in n or "in_proj" in n or n.endswith(".q.weight")
                                 or n.endswith(".kv.weight")):
                p.mul_(8.0)
    return model


def images(model, batch=2, seed=1):
    h, w = model.patch_embed.img_size
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, h, w, generator=g)


class SdpaSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = F.scaled_dot_product_attention

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def snapshot(model):
    return {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}


def assert_state_unchanged(model, snap):
    sd = model.state_dict()
    assert list(sd) == list(snap)
    for k, v in sd.items():
        assert v.data_ptr() == snap[k][1], k
        assert torch.equal(v, snap[k][0]), k


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_convert_verify_revert(family, monkeypatch):
    model = build(family)
    x = images(model)
    spy = SdpaSpy(monkeypatch)
    with torch.no_grad():
        ref = model(x)
    native_sdpa_calls = spy.calls
    snap = snapshot(model)

    report = convert(model)
    assert report.counts == FAMILIES[family][2]
    assert report.parity.verified and report.parity.passed
    assert not report.skipped, report.skipped
    assert set(report.backends_used) == {"reference"}  # CPU: auto -> reference, and the report says so
    assert_state_unchanged(model, snap)

    spy.calls = 0
    with torch.no_grad(), dispatch.record() as log:
        out = model(x)
    assert spy.calls == 0, "PyTorch SDPA was called by a converted model"
    n_calls = sum(FAMILIES[family][2].values()) * (2 if "diff" in family else 1)
    assert len(log) == n_calls  # every attention call went through elsa_surgery.attention
    # against the original model (float32 vs float32; the reference backend accumulates in fp32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()

    restored = revert(model)
    assert len(restored) == sum(FAMILIES[family][2].values())
    spy.calls = 0
    with torch.no_grad():
        back = model(x)
    assert torch.equal(back, ref), "revert is not bit-exact"
    assert spy.calls == native_sdpa_calls
    assert_state_unchanged(model, snap)
    assert not any({"forward", "_elsa_config", "_elsa_patch"} & set(m.__dict__) for m in model.modules())


class _Wrong(Adapter):
    """Wraps a real timm adapter and makes its attention module's output slightly wrong."""

    library = "timm"

    def __init__(self, inner):
        self.inner = inner
        self.name = "test.wrong." + inner.name

    def matches(self, module):
        return self.inner.matches(module)

    def patch(self, module, config):
        self.inner.patch(module, config)
        right = module.forward

        def wrong(*args, **kwargs):
            out = right(*args, **kwargs)
            return out + 0.1 * out.roll(1, dims=-1)  # not a constant shift / scale that a LayerNorm would undo

        patching.record_of(module).set(module, "forward", wrong)  # (the record undoes it on rollback)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_idempotent_filters_and_wrong_attention(family):
    model = build(family)
    x = images(model)
    with torch.no_grad():
        ref = model(x)
    snap = snapshot(model)
    expected = sum(FAMILIES[family][2].values())
    # a wrong attention is caught, localised to a module of this family, and rolled back bit-exactly
    adapters = [_Wrong(get_adapter(n)) for n in FAMILIES[family][2]]
    with pytest.raises(ParityError) as ei:
        convert(model, adapters=adapters)
    assert ei.value.module in {e.name for e in ei.value.report.converted}
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert_state_unchanged(model, snap)
    assert not any({"forward", "_elsa_config", "_elsa_patch"} & set(m.__dict__) for m in model.modules())
    assert not any(patching.BASE_CLASS_ATTR in type(m).__dict__ for m in model.modules())  # classes put back
    # include / exclude
    first = convert(model, verify=False).converted[0].name
    revert(model)
    rep = convert(model, exclude=first, verify=False)
    assert rep.num_converted == expected - 1 and [e.name for e in rep.skipped] == [first]
    # idempotent: converting again changes nothing
    with torch.no_grad():
        once = model(x)
    rep = convert(model, verify=False)
    assert rep.num_converted == 1 and len(rep.already_converted) == expected - 1  # only the excluded one is new
    with torch.no_grad():
        twice = model(x)
    rep = convert(model, verify=False)
    assert rep.num_converted == 0 and len(rep.already_converted) == expected
    with torch.no_grad():
        assert torch.equal(model(x), twice)
    assert not torch.equal(once, ref)
    revert(model)
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_sdpa_spy_can_fail(monkeypatch):
    """The spy sees timm's native fused attention (so 'never called after conversion' means something)."""
    model = build("vit")
    spy = SdpaSpy(monkeypatch)
    with torch.no_grad():
        model(images(model))
    assert spy.calls == 2


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_bf16_model(family):
    model = build(family, torch.bfloat16)
    x = images(model).bfloat16()
    with torch.no_grad():
        ref = model(x).float()
    rep = convert(model)
    assert rep.parity.passed and rep.parity.dtype == "bfloat16"
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 3e-2 * ref.abs().max()


def test_deepcopy_of_converted_model_is_independent():
    model = build("vit")
    native_cls = type(model.blocks[0].attn)
    convert(model, verify=False)
    clone = copy.deepcopy(model)
    x = images(model)
    with torch.no_grad():
        a, b = model(x), clone(x)
    assert torch.equal(a, b)
    revert(clone)
    assert is_converted(model.blocks[0].attn)  # the original stays converted
    assert not is_converted(clone.blocks[0].attn) and type(clone.blocks[0].attn) is native_cls
    # the clone's forward works on the clone's own parameters
    with torch.no_grad():
        clone.blocks[0].attn.proj.weight.zero_()
        c = clone(x)
    assert not torch.equal(c, model(x).detach())


# --------------------------------------------------------------------------------------------------
# module-level features against the original timm modules
# --------------------------------------------------------------------------------------------------

def _scaled(module, factor=6.0):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    return module.eval()


def _compare(module, *args, rtol=2e-5, **kwargs):
    with torch.no_grad():
        ref = module(*args, **kwargs)
        convert(module, verify=False)
        out = module(*args, **kwargs)
        revert(module)
        back = module(*args, **kwargs)
    assert torch.equal(back, ref)
    err = (out - ref).abs().max() / ref.abs().max()
    assert err <= rtol, float(err)
    return ref, out


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal", "bool+causal"])
def test_attention_masks_and_causal(mask_kind):
    torch.manual_seed(0)
    attn = _scaled(Attention(32, num_heads=4, qkv_bias=True, qk_norm=True, norm_layer=torch.nn.LayerNorm))
    B, N = 3, 11
    x = torch.randn(B, N, 32)
    mask, causal = None, False
    if mask_kind.startswith("bool"):
        mask = torch.rand(B, 1, N, N) > 0.3
        mask[..., 0] = True  # every row sees a key (SDPA returns NaN otherwise)
    elif mask_kind == "additive":
        mask = torch.randn(B, 4, N, N) * 2
    if "causal" in mask_kind:
        causal = True
    if mask_kind == "bool+causal":
        # SDPA refuses mask + is_causal together; compare with the causal-and-mask intersection as one mask
        tri = torch.ones(N, N, dtype=torch.bool).tril()
        with torch.no_grad():
            ref = attn(x, attn_mask=mask & tri)
            convert(attn, verify=False)
            out = attn(x, attn_mask=mask, is_causal=True)
            revert(attn)
        assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()
        return
    ref, out = _compare(attn, x, attn_mask=mask, is_causal=causal)
    if mask is not None or causal:  # the mask matters (the test can fail)
        with torch.no_grad():
            assert not torch.allclose(attn(x), ref, rtol=1e-3, atol=1e-4)


def test_attention_gated_and_scale_norm():
    torch.manual_seed(0)
    attn = _scaled(Attention(32, num_heads=2, gated=True, scale_norm=True, norm_layer=torch.nn.LayerNorm))
    _compare(attn, torch.randn(2, 9, 32))


@pytest.mark.parametrize("latent_len", [1, 3])
def test_attention_pool_latent(latent_len):
    torch.manual_seed(0)
    pool = _scaled(AttentionPoolLatent(32, num_heads=4, latent_len=latent_len, pool_type="avg", qk_norm=True))
    x = torch.randn(2, 13, 32)
    mask = torch.rand(2, 1, latent_len, 13) > 0.4
    mask[..., 0] = True
    _compare(pool, x)
    _compare(pool, x, attn_mask=mask)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("prefix", [0, 2])
def test_attention_rope_gqa_prefix(kv_heads, prefix):
    torch.manual_seed(0)
    attn = _scaled(AttentionRope(64, num_heads=4, qkv_fused=kv_heads == 4, num_prefix_tokens=prefix,
                                 num_kv_heads=kv_heads))
    N = 9 + prefix
    x = torch.randn(2, N, 64)
    rope = torch.randn(N - prefix, 32)  # concatenated sin / cos for head_dim 16
    _compare(attn, x, rope=rope)
    _compare(attn, x, rope=rope, is_causal=True)


def test_swin_shifted_window_mask_is_per_window():
    """Swin's shifted blocks carry a [nW, N, N] mask; the converted forward never expands it per batch row."""
    model = build("swin")
    blk = model.layers[0].blocks[1]
    assert blk.attn_mask is not None and blk.attn_mask.shape[0] > 1  # shifted windows present
    x = images(model, batch=3)
    seen = []
    import elsa_surgery.adapters.timm_swin as sw

    real = sw.attention

    def watch(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[0], None if attn_mask is None else tuple(attn_mask.shape), kw.get("windowed_mask")))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    with torch.no_grad():
        ref = model(x)
        convert(model, verify=False)
        sw.attention = watch
        try:
            out = model(x)
        finally:
            sw.attention = real
    assert any(w for _, _, w in seen)
    for batch_rows, mshape, windowed in seen:
        assert mshape[0] < batch_rows or not windowed  # [nW, H, N, N], never [B*nW, ...]
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_through_triton_kernels(family, monkeypatch):
    """The same conversions with backend='elsa': the Triton kernels (in the interpreter on CPU)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Swin at 32 px: 8x8 tokens, 4x4 windows, still shifted in stage 0 (the interpreter is slow)
    model = build(family, **({"img_size": 32} if family.startswith("swin") else {}))
    x = images(model)
    with torch.no_grad():
        ref = model(x)
    rep = convert(model, backend="elsa")
    assert rep.parity.passed and rep.counts == FAMILIES[family][2]
    assert all(b.startswith("elsa/") for b in rep.backends_used), rep.backends_used
    with torch.no_grad():
        out = model(x)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    revert(model)


@pytest.mark.parametrize("family", ["vit", "swin", "eva_rope_gqa"])
def test_converted_model_compiles_fullgraph(family, monkeypatch):
    """The rebound forwards trace under torch.compile(fullgraph=True) (no graph break from the surgery). On a GPU
    host the model runs on the GPU (``backend="elsa"`` refuses CPU tensors there); elsewhere in the interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build(family, **({"img_size": 32} if family == "swin" else {})).to(dev)
    x = images(model).to(dev)
    convert(model, backend="elsa", verify=False)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, ref)
    revert(model)
