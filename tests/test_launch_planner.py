"""The launch planner (kernels/launch.py): a pure function from the call's signature to a LaunchPlan, cached by
that signature; the launcher executes the plan. CPU tests under TRITON_INTERPRET=1 (conftest sets it)."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import elsa_surgery  # noqa: E402
from elsa_surgery.kernels import launch, occupancy as occ, replay  # noqa: E402
from oracle import rel_err as rel  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).to(DEV)


# (q shape, k/v heads, keys, dtype, precision, extras)
CALLS = {
    "fp32 strict": ((2, 2, 70, 32), 2, 70, torch.float32, "strict", {}),
    "fp32 precise": ((1, 2, 64, 16), 2, 64, torch.float32, "precise", {}),
    "fp16 causal Nq<Nk": ((1, 2, 40, 16), 2, 90, torch.float16, None, {"is_causal": True}),
    "bf16 gqa": ((2, 4, 33, 24), 1, 33, torch.bfloat16, None, {}),
    "partitions": ((1, 2, 8, 32), 2, 600, torch.float32, "strict", {"num_partitions": 3}),
    "mask and lengths": ((2, 2, 30, 16), 2, 30, torch.float32, "strict", {"mask": True, "lengths": True}),
}


def _call(name):
    shape, hkv, nk, dtype, precision, extra = CALLS[name]
    B, H, N, D = shape
    q, k, v = rand(*shape, dtype=dtype), rand(B, hkv, nk, D, dtype=dtype), rand(B, hkv, nk, D, dtype=dtype)
    kw = dict(precision=precision, is_causal=extra.get("is_causal", False),
              num_partitions=extra.get("num_partitions"))
    if extra.get("mask"):
        kw["mask"] = torch.rand(B, 1, N, nk, device=DEV) > 0.2
    if extra.get("lengths"):
        kw["kv_lengths"] = torch.tensor([nk, nk // 2] * (B // 2), device=DEV, dtype=torch.int32)[:B]
    return q, k, v, kw


def _sig(q, k, v, kw, out=None):
    out = launch._new_out(q, *q.shape[:3], v.shape[3]) if out is None else out
    return launch.call_signature(q, k, v, out, **kw)


@pytest.fixture(autouse=True)
def fresh():
    launch.clear_plans()
    yield
    launch.clear_plans()


@pytest.mark.parametrize("name", list(CALLS))
def test_cached_plan_equals_a_fresh_one(name):
    q, k, v, kw = _call(name)
    sig = _sig(q, k, v, kw)
    first = launch.cached_plan(sig)
    assert launch.cached_plan(sig) is first  # served from the cache
    assert launch.plan_launch(sig) == first  # and equal to a plan computed again
    assert isinstance(first, launch.LaunchPlan) and first.dims.Nk == k.shape[2]
    again = _sig(*_call(name)[:3], kw)  # other tensors of the same geometry: the same key
    assert again == sig and hash(again) == hash(sig) and launch.cached_plan(again) is first


def test_planner_touches_no_tensor_and_launches_nothing(monkeypatch):
    q, k, v, kw = _call("fp32 strict")
    sig = _sig(q, k, v, kw)

    def forbidden(*a, **k):
        raise AssertionError("the planner must not allocate or launch")

    stats, plans = dict(replay.STATS), dict(replay._plans)
    monkeypatch.setattr(torch, "empty", forbidden)
    monkeypatch.setattr(replay, "launch", forbidden)
    monkeypatch.setattr(replay, "allocated", forbidden)
    plans_made = [launch.plan_launch(sig) for _ in range(3)]
    assert plans_made[0] == plans_made[1] == plans_made[2]
    assert replay.STATS == stats and replay._plans == plans
    assert launch._PLANS == {}  # plan_launch does not fill the cache; cached_plan does


def test_a_changed_knob_plans_again_and_the_old_plan_comes_back(monkeypatch):
    q, k, v, kw = _call("fp32 precise")
    sig = _sig(q, k, v, kw)
    default = launch.cached_plan(sig)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "tf32")
    forced = launch.cached_plan(sig)
    assert forced == launch.plan_launch(sig) and forced.dot == occ.DOT_TF32X3
    monkeypatch.delenv(occ.ENV_PRECISE_SPLIT)
    assert launch.cached_plan(sig) == default


def test_bad_knob_still_raises_on_a_cached_signature(monkeypatch):
    q, k, v, kw = _call("fp32 strict")
    sig = _sig(q, k, v, kw)
    launch.cached_plan(sig)
    from elsa_surgery.kernels import hopper

    monkeypatch.setenv(hopper.ENV, "sometimes")
    with pytest.raises(ValueError, match=hopper.ENV):
        launch.cached_plan(sig)


@pytest.mark.parametrize("name", ["fp32 strict", "fp16 causal Nq<Nk", "partitions", "mask and lengths"])
def test_launch_with_a_cached_plan_gives_the_same_answer(name, monkeypatch):
    monkeypatch.setenv(replay.ENV, "0")  # the planner path on every call (no launch-plan replay)
    q, k, v, kw = _call(name)
    mask, kvl = kw.pop("mask", None), kw.pop("kv_lengths", None)
    args = dict(scale=0.3, mask=mask, kv_lengths=kvl, **kw)
    first, _ = launch.attention(q, k, v, **args)
    assert len(launch._PLANS) == 1
    second, _ = launch.attention(q, k, v, **args)  # served from the plan cache
    assert len(launch._PLANS) == 1 and torch.equal(first, second)
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), attn_mask=mask, kv_lengths=kvl,
                                 is_causal=kw["is_causal"], scale=0.3, backend="reference")
    assert rel(second.double(), ref) <= (2e-6 if q.dtype == torch.float32 else 5e-3)


def test_replay_recorded_over_a_cached_plan_still_depends_on_the_knobs(monkeypatch):
    """A launch-plan replay (kernels/replay.py) recorded while the planning is served from the cache must still be
    invalidated by the knobs the planning read (ELSA_HOPPER is read only there)."""
    from elsa_surgery.kernels import hopper

    monkeypatch.setenv(replay.ENV, "1")
    q, k, v, _ = _call("fp32 strict")
    launch.cached_plan(_sig(q, k, v, dict(precision="strict")))  # planned before any replay is recorded
    launch.attention(q, k, v, scale=0.3, precision="strict")  # records a replay over the cached plan
    assert len(launch._PLANS) == 1
    (plan,) = replay._plans.values()
    assert replay._ENCODE(hopper.ENV) in {key for key, _ in plan.env}
