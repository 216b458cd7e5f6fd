"""The surgery framework: convert / revert, parity verification and rollback, reports, bad arguments.

Uses a tiny timm ViT (random weights) plus toy modules and test-only adapters registered here.
Imports ``convert`` from ``elsa_surgery.surgery``: the package attribute ``elsa_surgery.convert`` is the
same function (checked below) but importing the CLI submodule elsa_surgery.convert elsewhere must not
change what these tests call.
"""

import json

import pytest
import torch
import torch.nn as nn

import elsa_surgery
from elsa_surgery import Adapter, ConversionReport, ElsaAttention, ParityError, PatchConfig, patch_vit_attention
from elsa_surgery.registry import bind_forward, register_adapter, unregister_adapter
from elsa_surgery.surgery import convert, is_converted, revert

timm = pytest.importorskip("timm")
from timm.layers import Attention  # noqa: E402

from elsa_surgery.modules import timm_attention_forward  # noqa: E402


def vit(depth=3):
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                          depth=depth, num_heads=2, num_classes=0).eval()
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.qkv.weight.mul_(8.0)
    return m


def images(seed=1):
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def run(model, x):
    with torch.no_grad():
        return model(x)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, snap):
    sd = model.state_dict()
    return list(sd) == list(snap) and all(torch.equal(sd[k], snap[k]) for k in sd)


def pristine(model):
    """No trace of a conversion left on any module (patched class, instance forward, config, patch record)."""
    return not any(is_converted(m) or {"forward", "_elsa_config", "_elsa_patch"} & set(m.__dict__)
                   or elsa_surgery.patching.BASE_CLASS_ATTR in type(m).__dict__ for m in model.modules())


# -- test-only adapters ---------------------------------------------------------------------------

def _wrong_forward(self, x, attn_mask=None, is_causal=False, *, config):
    """A deliberately wrong attention: causal where the model is bidirectional."""
    return timm_attention_forward(self, x, attn_mask, True, config=config)


class BadAttention(Adapter):
    name = "test.bad_attention"
    library = "timm"

    def __init__(self, only=None):
        self.only = only  # wrong only for modules whose id is in this set (others are correct)

    def matches(self, module):
        return type(module) is Attention

    def patch(self, module, config):
        wrong = self.only is None or id(module) in self.only
        bind_forward(module, _wrong_forward if wrong else timm_attention_forward, config)

    def example_inputs(self, model):
        return images()


@pytest.fixture
def bad_adapter():
    a = register_adapter(BadAttention())
    yield a
    unregister_adapter(a.name)


# -- basics ---------------------------------------------------------------------------------------

def test_package_exports_the_functions():
    import sys

    # the function, or (once the CLI submodule elsa_surgery.convert was imported) that callable module
    assert elsa_surgery.convert in (convert, sys.modules.get("elsa_surgery.convert"))
    assert elsa_surgery.revert is revert
    assert callable(elsa_surgery.convert)


def test_convert_report_and_revert():
    model = vit()
    x = images()
    ref = run(model, x)
    snap = state(model)
    rep = convert(model)
    assert isinstance(rep, ConversionReport)
    assert rep.counts == {"timm.vit.attention": 3} and rep.num_converted == 3
    assert [e.name for e in rep.converted] == [f"blocks.{i}.attn" for i in range(3)]
    assert all(e.rel_err is not None and e.rel_err < 1e-5 for e in rep.converted)
    p = rep.parity
    assert p.verified and p.passed and p.dtype == "float32" and p.inputs == "adapter timm.vit.attention"
    assert p.rel_err < 1e-5 and p.worst_module in {e.name for e in rep.converted}
    assert p.drift is not None and set(p.drift) == {"dP_inf", "dP_rel2", "js", "argmax", "dY_inf", "dY_rel2"}
    assert rep.backends_used == {"reference": 3} and rep.dispatch_reasons
    assert same_state(model, snap)
    out = run(model, x)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    # readable and serialisable
    text = str(rep)
    assert "blocks.2.attn" in text and "PASSED" in text and "timm.vit.attention" in text
    d = json.loads(rep.to_json())
    assert d["counts"] == {"timm.vit.attention": 3} and d["parity"]["passed"] is True
    assert d == rep.to_dict() | {} and "converted=3" in repr(rep)
    assert sorted(revert(model)) == [f"blocks.{i}.attn" for i in range(3)]
    assert torch.equal(run(model, x), ref) and pristine(model) and same_state(model, snap)
    assert revert(model) == []  # reverting twice is a no-op


def test_idempotent():
    model = vit()
    x = images()
    convert(model)
    once = run(model, x)
    fwds = [blk.attn.forward for blk in model.blocks]
    rep = convert(model)
    assert rep.num_converted == 0 and len(rep.already_converted) == 3
    assert rep.parity.verified is False  # nothing new to verify
    assert [blk.attn.forward for blk in model.blocks] == fwds
    assert torch.equal(run(model, x), once)
    rep = convert(model, backend="reference")  # another configuration: kept, and the report says so
    assert all("revert first" in e.reason for e in rep.already_converted)
    revert(model)
    assert pristine(model)


def test_include_exclude_globs():
    model = vit()
    rep = convert(model, include="blocks.1")  # an ancestor's name selects its descendants
    assert [e.name for e in rep.converted] == ["blocks.1.attn"]
    assert {e.name for e in rep.skipped} == {"blocks.0.attn", "blocks.2.attn"}
    assert all(e.reason == "excluded by include/exclude" for e in rep.skipped)
    revert(model)
    rep = convert(model, include=["blocks.*.attn"], exclude=["blocks.0.*", "*2*"])
    assert [e.name for e in rep.converted] == ["blocks.1.attn"]
    assert not is_converted(model.blocks[0].attn) and is_converted(model.blocks[1].attn)
    revert(model)


def test_unknown_attention_modules_are_reported():
    class MyAttention(nn.Module):
        def forward(self, x):
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = vit(depth=1)
            self.extra = MyAttention()
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.extra(self.vit(x)))

    net = Net().eval()
    rep = convert(net, example_inputs=images())
    assert rep.counts == {"timm.vit.attention": 1}
    (skip,) = rep.skipped
    assert skip.name == "extra" and skip.adapter is None and "no registered adapter knows" in skip.reason
    assert rep.parity.inputs == "user" and rep.parity.passed
    revert(net)
    # restricting the adapters: a module another adapter knows is reported as not selected
    rep = convert(net, adapters=["torch"], verify=False)
    assert rep.num_converted == 0
    assert any("timm.vit.attention knows Attention but was not selected" in (e.reason or "") for e in rep.skipped)


def test_example_inputs_forms():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(16, num_heads=2)

        def forward(self, x, scale=1.0):
            return self.attn(x) * scale

    m = TwoInputs().eval()
    x = torch.randn(2, 5, 16)
    for inputs in (x, (x,), [x, 2.0], {"x": x, "scale": 3.0}):
        rep = convert(m, example_inputs=inputs)
        assert rep.parity.passed and rep.num_converted == 1
        revert(m)
    # a lone attention module: the adapter builds token inputs itself
    rep = convert(m.attn)
    assert rep.parity.verified and rep.parity.passed
    revert(m.attn)


def test_no_example_inputs_is_told():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(16, num_heads=2)

        def forward(self, x):
            return self.attn(x)

    net = Net()
    rep = convert(net)  # the adapter cannot guess inputs for an arbitrary wrapper
    assert rep.num_converted == 1 and rep.parity.verified is False and "example_inputs" in rep.parity.reason
    assert "not verified" in str(rep)
    revert(net)


def test_training_flags_restored_and_verify_false():
    model = vit().train()
    rep = convert(model)  # parity runs in eval mode, then the flags come back
    assert rep.parity.passed and all(m.training for m in model.modules())
    revert(model)
    rep = convert(model, verify=False)
    assert rep.parity is None and "not requested" in str(rep)
    revert(model)


# -- parity failures and rollback -------------------------------------------------------------------

def test_wrong_attention_is_caught_and_rolled_back(bad_adapter):
    model = vit()
    x = images()
    ref = run(model, x)
    snap = state(model)
    with pytest.raises(ParityError) as ei:
        convert(model, adapters=["test.bad_attention"])
    err = ei.value
    assert err.module in {f"blocks.{i}.attn" for i in range(3)} and err.error > 1e-3
    assert err.module in str(err) and "restored" in str(err)
    assert err.report is not None and err.report.parity.passed is False
    assert pristine(model) and same_state(model, snap)
    assert torch.equal(run(model, x), ref)


def test_parity_localises_the_worst_module():
    model = vit()
    x = images()
    ref = run(model, x)
    a = register_adapter(BadAttention(only={id(model.blocks[1].attn)}), override=True)
    try:
        with pytest.raises(ParityError) as ei:
            convert(model, adapters=[a.name])
    finally:
        unregister_adapter(a.name)
    assert ei.value.module == "blocks.1.attn"
    rep = ei.value.report
    errs = {e.name: e.rel_err for e in rep.converted}
    assert errs["blocks.0.attn"] < 1e-5 and errs["blocks.2.attn"] < 1e-5 and errs["blocks.1.attn"] > 1e-3
    assert pristine(model) and torch.equal(run(model, x), ref)


def test_rollback_keeps_earlier_conversions(bad_adapter):
    model = vit()
    convert(model, include="blocks.0", adapters=["timm"])
    x = images()
    before = run(model, x)
    with pytest.raises(ParityError):
        convert(model, adapters=["test.bad_attention"])
    assert is_converted(model.blocks[0].attn) and not is_converted(model.blocks[1].attn)
    assert torch.equal(run(model, x), before)
    revert(model)
    assert pristine(model)


def test_loose_tolerance_accepts_and_tight_rejects(bad_adapter):
    model = vit()
    rep = convert(model, adapters=["test.bad_attention"], rtol=10.0, atol=10.0)
    assert rep.parity.passed and rep.parity.rtol == 10.0
    revert(model)
    with pytest.raises(ParityError):
        convert(vit(), adapters=[bad_adapter], rtol=0.0, atol=0.0)  # Adapter instances work too


def test_converted_model_that_crashes_is_rolled_back():
    class Crash(Adapter):
        name = "test.crash"

        def matches(self, module):
            return type(module) is Attention

        def patch(self, module, config):
            def boom(self, *a, config, **k):
                raise RuntimeError("kaboom")
            bind_forward(module, boom, config)

    model = vit()
    with pytest.raises(ParityError, match="kaboom"):
        convert(model, adapters=[Crash()])
    assert pristine(model)


def test_failed_patch_rolls_back():
    class HalfBroken(Adapter):
        name = "test.half_broken"

        def __init__(self):
            self.n = 0

        def matches(self, module):
            return type(module) is Attention

        def patch(self, module, config):
            self.n += 1
            if self.n == 2:
                raise ValueError("cannot patch this one")
            bind_forward(module, timm_attention_forward, config)

    model = vit()
    with pytest.raises(RuntimeError, match="blocks.1.attn"):
        convert(model, adapters=[HalfBroken()], verify=False)
    assert pristine(model)


# -- model-level adapter hooks ---------------------------------------------------------------------

class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Attention(16, num_heads=2)
        self.wrong = False

    def forward(self, x):
        y = self.mixer(x)
        return -y if self.wrong else y


class ModelLevel(Adapter):
    name = "test.model_level"

    def __init__(self, wrong=False):
        self.calls = []
        self.wrong = wrong

    def claims_model(self, model):
        return isinstance(model, Toy)

    def model_modules(self, model):
        return [("mixer", model.mixer)]

    def patch_model(self, model, config):
        self.calls.append(("patch", config))
        model.wrong = self.wrong

    def revert_model(self, model):
        self.calls.append(("revert",))
        model.wrong = False

    def example_inputs(self, model):
        return torch.randn(2, 4, 16)


def test_model_level_adapter_hooks():
    a = ModelLevel()
    m = Toy().eval()
    rep = convert(m, adapters=[a], precision="strict")
    assert a.calls == [("patch", PatchConfig("auto", "strict"))]
    assert rep.model_adapters == [a.name] and [e.name for e in rep.converted] == ["mixer"]
    assert rep.parity.passed and rep.parity.inputs == f"adapter {a.name}"
    rep2 = convert(m, adapters=[a])
    assert rep2.num_converted == 0 and [e.name for e in rep2.already_converted] == ["mixer"]
    assert revert(m) == ["mixer"] and a.calls[-1] == ("revert",)
    assert not is_converted(m)


def test_model_level_parity_failure_calls_revert_model():
    a = ModelLevel(wrong=True)
    m = Toy().eval()
    with pytest.raises(ParityError):
        convert(m, adapters=[a])
    assert a.calls[-1] == ("revert",) and m.wrong is False and not is_converted(m)


def test_model_level_partial_filter_is_skipped_with_reason():
    a = ModelLevel()
    m = Toy().eval()
    rep = convert(m, adapters=[a], exclude="mixer")
    assert a.calls == [] and rep.skipped[0].reason == "excluded by include/exclude"


# -- bad arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(adapters=["no.such.adapter"]), ValueError, "unknown adapter"),
    (dict(adapters=[3]), TypeError, "adapters must be"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(precision="fp64"), ValueError, "precision must be one of"),
    (dict(include=5), TypeError, "include must be"),
    (dict(exclude=[None]), TypeError, "exclude must hold strings"),
    (dict(rtol=-1), ValueError, "rtol must be"),
    (dict(atol=float("nan")), ValueError, "atol must be"),
    (dict(verify="yes"), TypeError, "verify must be"),
    (dict(example_inputs=3), TypeError, "example_inputs must be"),
])
def test_bad_arguments_leave_model_untouched(kwargs, exc, words):
    model = vit(depth=1)
    with pytest.raises(exc, match=words):
        convert(model, **kwargs)
    assert pristine(model)


def test_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convert("not a model")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        revert(42)
    with pytest.raises(ValueError, match="unknown adapter"):
        elsa_surgery.get_adapter("nope")


def test_bad_user_inputs_fail_before_any_change():
    model = vit(depth=1)
    with pytest.raises(ValueError, match="example_inputs: the original"):
        convert(model, example_inputs=torch.randn(2, 5, 7, 7))  # wrong channel count: the original model fails
    assert pristine(model)


# -- ElsaAttention and the reference-code alias ----------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=True, qk_norm=True, gated=True, scale_norm=True)])
def test_elsa_attention_matches_timm_attention(kw):
    torch.manual_seed(0)
    norm = {"norm_layer": nn.LayerNorm} if kw else {}
    ref = Attention(32, num_heads=4, **kw, **norm).eval()
    with torch.no_grad():
        ref.qkv.weight.mul_(6)
    mine = ElsaAttention(32, num_heads=4, **kw, backend="reference").eval()
    assert list(mine.state_dict()) == list(ref.state_dict())
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 32)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    with torch.no_grad():
        for args in ({}, {"attn_mask": mask}):
            a, b = ref(x, **args), mine(x, **args)
            assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    with pytest.raises(ValueError, match="backend"):
        ElsaAttention(32, backend="flash")


def test_patch_vit_attention_alias():
    model = vit(depth=1)
    rep = patch_vit_attention(model, method="elsa", precision="fp32")
    assert rep.num_converted == 1 and rep.parity.passed and rep.backend == "auto" and rep.precision is None
    revert(model)
    rep = patch_vit_attention(model, method="reference", precision="tf32")
    assert rep.precision == "turbo" and rep.parity.rtol == 1e-2  # turbo: looser default tolerance
    revert(model)
    with pytest.raises(ValueError, match="method"):
        patch_vit_attention(model, method="flash")
    with pytest.raises(ValueError, match="precision"):
        patch_vit_attention(model, precision="fp8")
    assert pristine(model)


def test_hidden_branch_is_still_checked(bad_adapter):
    """The model output cannot see the attention (zero gate), but the module-level check catches the bug."""

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(16, num_heads=2)
            with torch.no_grad():
                self.attn.qkv.weight.mul_(8)

        def forward(self, x):
            return x + 0.0 * self.attn(x)

    m = Gated().eval()
    x = torch.randn(2, 6, 16)
    with pytest.raises(ParityError, match="model output agrees") as ei:
        convert(m, adapters=["test.bad_attention"], example_inputs=x)
    assert ei.value.module == "attn" and pristine(m)
    rep = convert(m, adapters=["timm"], example_inputs=x)  # the right adapter passes
    assert rep.parity.passed
    revert(m)


def test_parity_leaves_out_padding_positions():
    """Outputs at padding positions are undefined (CUDA SDPA kernels disagree on fully masked rows):
    parity compares real tokens only, and says how many positions it left out."""
    from elsa_surgery.verify import compare, padding_keep

    ref = torch.randn(2, 5, 3)
    test = ref.clone()
    test[1, :2] += 100.0  # garbage at two padding positions
    am = torch.ones(2, 5, dtype=torch.long)
    am[1, :2] = 0
    keep = padding_keep({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": am})
    assert keep is not None and int((~keep).sum()) == 2
    assert compare(ref, test, keep)["output"]["max_abs"] == 0.0
    assert compare(ref, test)["output"]["max_abs"] > 99.0  # without the mask the garbage counts
    test[0, 3] += 1.0  # a real token differs: still seen
    assert abs(compare(ref, test, keep)["output"]["max_abs"] - 1.0) < 1e-5
    assert padding_keep({"attention_mask": torch.ones(2, 5)}) is None and padding_keep(torch.ones(2, 5)) is None
