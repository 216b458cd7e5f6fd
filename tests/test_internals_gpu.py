"""Both routes of kernels/internals.py's version gate on the GPU: with the installed Triton checked (Triton 3.6 on
the device machine) replayed launches go through Triton's compiled launcher directly (and, on Hopper, encode their
TMA maps); with the gate closed (a stand-in: no checked version) they launch through ``kernel[grid]``. Both give the
oracle's answer, on the recorded call and on replays."""

import pytest
import torch

import elsa_surgery
from elsa_surgery.kernels import internals, launch, replay

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate", ["checked", "unchecked"])
def test_replay_routes_of_the_version_gate(gate, dtype, monkeypatch):
    if gate == "unchecked":
        monkeypatch.setattr(internals, "CHECKED_TRITON", ())
    elif internals.triton_version() not in internals.CHECKED_TRITON:
        pytest.skip(f"the installed Triton {internals.triton_version()} is not in CHECKED_TRITON")
    monkeypatch.setattr(internals, "_TRITON_OK", [])
    monkeypatch.delenv("ELSA_LAUNCH_PLANS", raising=False)
    replay.clear()
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype) for _ in range(3))
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference")
    before = dict(replay.STATS)
    for _ in range(3):  # recorded, then replayed twice
        out, _ = launch.attention(q, k, v, scale=64 ** -0.5, precision="strict" if dtype == torch.float32 else None)
        assert _rel(out, ref) <= (2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert replay.STATS["recorded"] - before["recorded"] == 1
    assert replay.STATS["replayed"] - before["replayed"] == 2
    plan = next(iter(replay._plans.values()))
    direct = [one.kernel is not None for one in plan.launches]
    assert direct and all(direct) == (gate == "checked") and any(direct) == (gate == "checked")
    assert replay.encodes_descriptors(q) is False or gate == "checked"
