"""GPU: full-size timm models (random weights) converted to the ELSA Triton kernels, fp32 and bf16.

ViT-B/16, ViT-L/14 (CLIP) and Swin-T: parity against the native model, every attention call on the
ELSA kernels (no fallback, no PyTorch SDPA), revert bit-exact.
"""

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")

from elsa_surgery.surgery import convert, revert  # noqa: E402

MODELS = {
    "vit_b16": ("vit_base_patch16_224", 12),
    "vit_l14_clip": ("vit_large_patch14_clip_224", 24),
    "swin_t": ("swin_tiny_patch4_window7_224", 12),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_model(name, dtype, monkeypatch):
    arch, n_attn = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=0).eval().to("cuda", dtype)
    x = torch.randn(4, 3, 224, 224, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = model(x)

    rep = convert(model)
    assert rep.num_converted == n_attn
    assert rep.parity.passed, str(rep)
    assert not rep.fallbacks, rep.fallbacks
    assert rep.backends_used and all(b.startswith("elsa") for b in rep.backends_used), rep.backends_used

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = model(x)
    assert not calls
    tol = 1e-4 if dtype == torch.float32 else 6e-2  # bf16: the default parity tolerance
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= tol, err

    revert(model)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model(x), ref)
