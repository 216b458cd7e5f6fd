"""Smoke runs of recipes/vggt_eval.py and recipes/hsimae_bench.py on the CPU (tiny shapes; no timing asserted)."""

import importlib.util
import json
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["vggt_eval", "hsimae_bench"])
def test_recipe_smoke(tmp_path, name):
    out = tmp_path / "r.json"
    result = _load(name).main(["--smoke", "--device", "cpu", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(result["rows"]))
    converted = [r for r in rows if r["mode"] != "native"]
    assert converted and all("error" not in r for r in rows)
    for r in converted:
        assert r["rel_diff"] < 1e-5 and r["converted_modules"] > 0
        assert set(r["backends"]) == {"reference"}  # CPU: the reference backend, told in the row
