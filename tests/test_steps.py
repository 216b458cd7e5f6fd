"""convert's named steps (elsa_surgery/surgery.py) and the CLI's (elsa_surgery/cli.py), each on its own."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from elsa_surgery import PatchConfig, patching
from elsa_surgery.registry import resolve_adapters
from elsa_surgery.surgery import find, patch, reference_run, verify_run

timm = pytest.importorskip("timm")


def _vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, patch_size=8,
                             embed_dim=32, depth=2, num_heads=2).eval()


def _untouched(model):
    return not any(patching.is_converted(m) or "forward" in m.__dict__ or patching.BASE_CLASS_ATTR in type(m).__dict__
                   for m in model.modules())


def test_find_plans_without_touching_the_model():
    model = _vit()
    plan = find(model, resolve_adapters(None), PatchConfig("reference"), exclude="blocks.1*")
    assert [n for n, _, _ in plan.modules] == ["blocks.0.attn"] and not plan.model_level
    assert [e.name for e in plan.report.converted] == ["blocks.0.attn"]
    assert [(e.name, e.reason) for e in plan.report.skipped] == [("blocks.1.attn", "excluded by include/exclude")]
    assert list(plan.watched()) == ["blocks.0.attn"] and _untouched(model)


def test_patch_then_rollback_restores_everything():
    model = _vit()
    plan = find(model, resolve_adapters("timm"), PatchConfig("reference"))
    done = patch(model, plan, PatchConfig("reference"))
    assert [patching.record_of(m).adapter_name for m in done.modules] == ["timm.vit.attention"] * 2
    assert done.rollback() == 2 and _untouched(model)


def test_reference_run_then_verify_run():
    model = _vit()
    cfg = PatchConfig("reference")
    plan = find(model, resolve_adapters(None), cfg)
    check = reference_run(model, plan)  # the adapter's inputs
    assert check is not None and check.inputs_source == "adapter timm.vit.attention" and _untouched(model)
    done = patch(model, plan, cfg)
    verify_run(check, done, plan.report)
    assert plan.report.parity.passed and patching.is_converted(model.blocks[0].attn)


def test_reference_run_without_inputs_says_why():
    model = nn.Sequential(nn.MultiheadAttention(8, 2))
    plan = find(model, resolve_adapters(None), PatchConfig())
    assert reference_run(model, plan) is None
    assert "no example inputs" in plan.report.parity.reason


def test_cli_argument_step_names_the_argument():
    from elsa_surgery import cli

    args = SimpleNamespace(batch=0, seq_len=None, device_map=None, max_memory=None, offload_folder=None, hf=None,
                           timm=None, open_clip=None, pretrained=None, device="cpu", precision=None, dtype="fp32")
    with pytest.raises(cli.CliError, match="--batch"):
        cli._check_run_args(args)
    args.batch = 2
    assert cli._check_run_args(args) == (torch.device("cpu"), None)
    args.device = "nowhere"
    with pytest.raises(cli.CliError, match="--device"):
        cli._check_run_args(args)
