"""Smoke runs of recipes/vggt_eval.py and recipes/hsimae_bench.py on the CPU (tiny shapes; no timing asserted)."""

import json

import pytest


@pytest.mark.parametrize("name", ["vggt_eval", "hsimae_bench"])
def test_recipe_smoke(tmp_path, name, load_recipe):
    out = tmp_path / "r.json"
    result = load_recipe(name).main(["--smoke", "--device", "cpu", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(result["rows"]))
    converted = [r for r in rows if r["mode"] != "native"]
    assert converted and all("error" not in r for r in rows)
    for r in converted:
        assert r["rel_diff"] < 1e-5 and r["converted_modules"] > 0
        assert set(r["backends"]) == {"reference"}  # CPU: the reference backend, told in the row


@pytest.mark.gpu
def test_peak_memory_counts_requested_bytes():
    """PeakMemory's requested-bytes peak is the tensors' own size; the allocated peak counts whole blocks."""
    import torch

    from elsa_surgery.benchmark import PeakMemory

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    keep = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # live before: not counted
    torch.cuda.empty_cache()
    # larger than all the memory reserved but free: segments that earlier tests still hold a tensor in cannot
    # be emptied, and a block that fitted in one would not come from the GPU (seen when the whole suite ran)
    big = (64 << 20) + 1 + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    with PeakMemory("cuda") as mem:
        a = torch.empty(1000, dtype=torch.uint8, device="cuda")
        b = torch.empty(big, dtype=torch.uint8, device="cuda")  # > 10 MiB: a segment of its own
        del a, b
    assert mem.requested_mib == pytest.approx((1000 + big) / 2**20, abs=1e-9)
    assert mem.mib >= mem.requested_mib
    assert mem.reserved_mib >= big / 2**20  # the block came from the GPU, not from the cache
    del keep
