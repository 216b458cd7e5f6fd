"""Smoke run of recipes/clip_eval.py on the CPU (random-weight ViT-B-32 at 2 layers; no timing asserted)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("open_clip")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "clip_eval.py"


def test_clip_eval_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("_recipe_clip_eval", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "clip.json"
    mod.main(["--smoke", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["weights"] == "random"
    zs = result["zero_shot"]["modes"]["elsa-strict"]
    assert zs["top1_agreement"] == 1.0 and zs["logits_max_abs_diff"] < 1e-3 and zs["converted_modules"] == 4
    rows = result["latency"]
    assert [r["mode"] for r in rows] == ["native", "elsa-strict"] and all("ms" in r for r in rows)
    assert set(rows[1]["backends"]) == {"reference"} and rows[1]["speedup_vs_native"] > 0
