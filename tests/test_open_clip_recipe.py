"""Smoke run of recipes/clip_eval.py on the CPU (random-weight ViT-B-32 at 2 layers; no timing asserted)."""

import json

import pytest

pytest.importorskip("open_clip")


def test_clip_eval_smoke(tmp_path, load_recipe):
    mod = load_recipe("clip_eval")
    out = tmp_path / "clip.json"
    mod.main(["--smoke", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["weights"] == "random"
    zs = result["zero_shot"]["modes"]["elsa-strict"]
    assert zs["top1_agreement"] == 1.0 and zs["logits_max_abs_diff"] < 1e-3 and zs["converted_modules"] == 4
    rows = result["latency"]
    assert [r["mode"] for r in rows] == ["native", "elsa-strict"] and all("ms" in r for r in rows)
    assert set(rows[1]["backends"]) == {"reference"} and rows[1]["speedup_vs_native"] > 0
