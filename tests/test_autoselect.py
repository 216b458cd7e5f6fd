"""auto's per-signature race between the ELSA kernels and PyTorch's SDPA (elsa_surgery/autoselect.py).

On the CPU the kernels run in the Triton interpreter; the race's clock and its CUDA-only gate are replaced by
stand-ins (the GPU test at the end runs the real race), so that the decision, its reason and the report are
checked on every machine.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import elsa_surgery  # noqa: E402
from elsa_surgery import autoselect, callcache, dispatch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.race  # the race is off in every other test (tests/conftest.py)


@pytest.fixture
def racing(monkeypatch):
    """auto runs the kernels on this device, the race is allowed here, and its clock says ``times[0]`` (a race of
    the rounds unless a test says otherwise: :func:`_rounds`)."""
    times = [_rounds((0.2, 0.1))]
    monkeypatch.setattr(dispatch, "auto_runs_kernels_on", lambda device: True)
    monkeypatch.setattr(autoselect, "_eager_cuda", lambda t: True)
    monkeypatch.setattr(autoselect, "race", lambda elsa, sdpa: (elsa(), sdpa(), times[0])[-1])
    # SDPA's first call at another key count of a band it won costs what its repeated call does (a test may say not)
    monkeypatch.setattr(autoselect, "probe_new_count", lambda sdpa: (sdpa(), autoselect.Probe(0.1, 0.1))[-1])
    callcache.clear()
    yield times
    callcache.clear()


def _rounds(ms):
    """What :func:`autoselect.race` returns for ``(elsa_ms, sdpa_ms)`` timed in its interleaved rounds."""
    return autoselect.Times(*ms, autoselect.ROUNDS)


def _qkv(b=2, h=2, n=40, d=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, n, d, generator=g).to(DEV) for _ in range(3))


def test_sdpa_taken_when_faster_and_named_with_both_timings(racing):
    q, k, v = _qkv()
    with dispatch.record() as log:
        out = elsa_surgery.attention(q, k, v, is_causal=True)
        out2 = elsa_surgery.attention(q, k, v, is_causal=True)  # the memo: no second race
    assert [d.backend for d in log] == ["sdpa", "sdpa"]
    assert "ELSA 200.0 us vs PyTorch SDPA 100.0 us" in log[0].reason and "backend='elsa'" in log[0].reason
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref) and torch.equal(out2, ref)


def test_each_side_of_the_race_is_the_whole_public_call(racing, monkeypatch):
    """The race times the call as later calls make it: the ELSA side runs the kernels, the SDPA side PyTorch's SDPA,
    each through elsa_surgery.attention (so our host cost counts); neither is recorded nor counted."""
    seen = []
    real_sdpa = F.scaled_dot_product_attention
    kernels = dispatch.kernels_module()
    real_kernels = kernels.attention

    def spy(name, fn):
        return lambda *a, **kw: (seen.append(name), fn(*a, **kw))[1]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy("sdpa", real_sdpa))
    monkeypatch.setattr(kernels, "attention", spy("elsa", real_kernels))

    def fake_race(elsa, sdpa):
        seen.append("|")
        elsa()
        seen.append("|")
        sdpa()
        seen.append("|")
        return racing[0]

    monkeypatch.setattr(autoselect, "race", fake_race)
    q, k, v = _qkv()
    before = dict(callcache.STATS)
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v)
    # the race's two sides, SDPA probed at another key count of the band (callcache._band_probe), then the call
    # itself on SDPA
    assert seen == ["|", "elsa", "|", "sdpa", "|", "sdpa", "sdpa"]
    assert [d.backend for d in log] == ["sdpa"]
    assert {n: callcache.STATS[n] - before[n] for n in before} == {"hits": 0, "misses": 1, "bypassed": 0}


def test_elsa_kept_when_sdpa_is_not_faster_enough(racing):
    racing[0] = _rounds((0.104, 0.1))  # 4 % apart: under MIN_GAIN
    q, k, v = _qkv()
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v)
    assert log[0].backend == "elsa" and "ELSA 104.0 us vs PyTorch SDPA 100.0 us" in log[0].reason


def test_decode_steps_of_a_family_won_by_elsa_run_its_retargeted_plan(racing, monkeypatch):
    """Once a band's race went to the kernels, the band's later decode steps (new signatures) run the raced call's
    launch plan retargeted to their keys (launch.KeysFamily) instead of the full path; their reason says where the
    race ran, and the answers are the kernels'."""
    if DEV == "cpu":
        monkeypatch.setenv("ELSA_LAUNCH_PLANS", "1")
    racing[0] = _rounds((0.1, 0.2))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=g).to(DEV)
    kv = torch.randn(2, 1, 2, 600, 16, generator=g).to(DEV)
    before = dict(callcache.KERNEL_FAMILY)
    lengths = (520, 521, 530, 560)
    with dispatch.record() as log:
        outs = [elsa_surgery.attention(q, kv[0, :, :, :n].contiguous(), kv[1, :, :, :n].contiguous(),
                                       enable_gqa=True) for n in lengths]
    assert {n: callcache.KERNEL_FAMILY[n] - before[n] for n in before} == {"runs": 3, "made": 1}
    assert [d.backend for d in log] == ["elsa"] * len(lengths)
    assert all("raced at 520 keys, shared by the calls of 513-640 keys" in d.reason for d in log[1:]), log
    for n, out in zip(lengths, outs):
        ref = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
        assert float((out - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("times,winner", [((0.2, 0.1), "sdpa"), ((0.1, 0.2), "elsa")])
def test_decode_steps_share_a_race_per_band_of_key_counts(racing, monkeypatch, times, winner):
    """A growing KV cache makes each decode step a new signature: calls that differ only in their number of keys
    share one race per quarter octave of it (callcache.key_band), the verdict and where it was raced in the reason,
    and the shared verdict runs (the output is the winner's)."""
    raced = []
    monkeypatch.setattr(autoselect, "race", lambda elsa, sdpa: (raced.append(1), elsa(), sdpa(), racing[0])[-1])
    racing[0] = _rounds(times)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 16, generator=g).to(DEV)
    kv = torch.randn(2, 1, 2, 130, 16, generator=g).to(DEV)
    assert [callcache.key_band(n) for n in (100, 112, 113, 4097, 5120, 8)] == [
        (96, 112), (96, 112), (112, 128), (4096, 5120), (4096, 5120), (7, 8)]
    with dispatch.record() as log:
        outs = [elsa_surgery.attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
                for n in (100, 101, 112, 113, 120)]
    assert len(raced) == 2 and [d.backend for d in log] == [winner] * 5, (raced, log)
    assert "raced at" not in log[0].reason and "raced at 100 keys, shared by the calls of 97-112 keys" in log[1].reason
    assert "ELSA" in log[2].reason and "raced at 113 keys" in log[4].reason and "raced at" not in log[3].reason
    for n, out in zip((100, 101, 112, 113, 120), outs):
        ref = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
        assert float((out - ref).abs().max()) < 1e-5


def test_decode_steps_of_a_family_won_by_sdpa_run_sdpa_directly(racing, monkeypatch):
    """Once a band's race went to SDPA, the band's later calls (each a new signature: the next decode step) run
    plain SDPA through the family's route instead of the full path (session 36: ~45 µs of host
    time a layer and step); their reason still says where the race ran. Another band, or a masked call, does not."""
    raced = []
    monkeypatch.setattr(autoselect, "race", lambda elsa, sdpa: (raced.append(1), elsa(), sdpa(), racing[0])[-1])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 16, generator=g).to(DEV)
    kv = torch.randn(2, 1, 2, 130, 16, generator=g).to(DEV)
    before = dict(callcache.DIRECT)
    lengths = (100, 101, 102, 107, 112, 113)
    with dispatch.record() as log:
        outs = [elsa_surgery.attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True) for n in lengths]
        # 100 raced (the race's routes uncounted: its own and its family's made then), 101-112 through the family's
        # route, no route of their own made; 113: another band, a new race
        assert {n: callcache.DIRECT[n] - before[n] for n in before} == {"runs": 4, "routes": 0}
        mask = torch.ones(1, 1, 1, 105, dtype=torch.bool, device=DEV)
        masked = elsa_surgery.attention(q, kv[0, :, :, :105], kv[1, :, :, :105], mask, enable_gqa=True)
    assert len(raced) == 2 and [d.backend for d in log[:-1]] == ["sdpa"] * len(lengths), (raced, log)
    assert all("raced at 100 keys, shared by the calls of 97-112 keys" in d.reason for d in log[1:5]), log
    assert "raced at" not in log[5].reason
    for n, out in zip(lengths, outs):
        ref = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
        assert torch.equal(out, ref)
    assert log[-1].backend != "sdpa" or "PyTorch SDPA" not in log[-1].reason  # masked calls are not raced
    ref = F.scaled_dot_product_attention(q, kv[0, :, :, :105], kv[1, :, :, :105], enable_gqa=True)
    assert float((masked - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("first_ms", [0.3, 0.15])
def test_a_band_won_by_sdpa_shares_elsa_when_sdpa_pays_for_each_new_key_count(racing, monkeypatch, first_ms):
    """SDPA won the race repeating one call (0.1 against ELSA's 0.2 ms), but its first call at another key count of
    the band (probed at one key fewer, on views of the caller's k and v) costs 0.3 ms, more than 4x its repeated call
    and more than ELSA's: the band's later calls, each a new key count, share ELSA and say why; the raced call's own
    signature keeps SDPA. A first call of 0.15 ms (not more than ELSA's) leaves SDPA's verdict shared."""
    probed = []

    def probe(sdpa):
        out = sdpa()
        probed.append(out.shape)
        return autoselect.Probe(first_ms, 0.02)

    monkeypatch.setattr(autoselect, "probe_new_count", probe)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=g).to(DEV)
    kv = torch.randn(2, 1, 2, 130, 16, generator=g).to(DEV)
    with dispatch.record() as log:
        outs = [elsa_surgery.attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
                for n in (100, 101, 105, 100)]
    assert probed == [(1, 4, 1, 16)]  # once, at the race
    shared = "elsa" if first_ms == 0.3 else "sdpa"
    assert [d.backend for d in log] == ["sdpa", shared, shared, "sdpa"], log
    if shared == "elsa":
        assert ("its first call at another key count (99) took 300.0 us (20.0 us repeated)" in log[1].reason
                and "raced at 100 keys, shared by the calls of 97-112 keys" in log[1].reason), log[1].reason
    for n, out in zip((100, 101, 105, 100), outs):
        ref = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
        assert float((out - ref).abs().max()) < 1e-5


def test_a_failing_probe_leaves_the_races_verdict_shared(racing, monkeypatch, caplog):
    """The probe is a measurement: where it fails (out of memory, say), the call still runs and the band shares the
    race's verdict, with a log line saying why."""
    def probe(sdpa):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(autoselect, "probe_new_count", probe)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 1, 16, generator=g).to(DEV)
    kv = torch.randn(2, 1, 2, 130, 16, generator=g).to(DEV)
    with dispatch.record() as log, caplog.at_level("INFO", logger="elsa_surgery"):
        outs = [elsa_surgery.attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True) for n in (100, 101)]
    assert [d.backend for d in log] == ["sdpa", "sdpa"], log
    assert "SDPA's probe at 99 keys failed (OutOfMemoryError" in caplog.text
    for n, out in zip((100, 101), outs):
        ref = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], enable_gqa=True)
        assert float((out - ref).abs().max()) < 1e-5


def test_band_verdict_rule():
    """autoselect.band_verdict: ELSA shared only where SDPA's first call at a new key count costs more than
    NEW_COUNT_RATIO times its repeated call and more than ELSA's raced time."""
    sdpa = dispatch.Decision("sdpa", None, "raced")
    kept = dispatch.Decision("elsa", None, "auto")
    times = autoselect.Times(0.2, 0.1, 3)
    assert autoselect.band_verdict(sdpa, kept, times, autoselect.Probe(0.5, 0.1), 99).backend == "elsa"
    assert autoselect.band_verdict(sdpa, kept, times, autoselect.Probe(0.39, 0.1), 99) is sdpa  # under 4x
    assert autoselect.band_verdict(sdpa, kept, times, autoselect.Probe(0.19, 0.01), 99) is sdpa  # under ELSA's


@pytest.mark.parametrize("times,winner", [((0.2, 0.1), "sdpa"), ((0.1, 0.2), "elsa")])
def test_later_calls_take_the_winners_direct_route(racing, monkeypatch, times, winner):
    """Both sides of the race run the public call under one route key, so both make a direct route; later calls
    run through the winner's (session 30: routes found by one flat key, the loser's dropped when the race ends)."""
    if DEV == "cpu":
        monkeypatch.setenv("ELSA_LAUNCH_PLANS", "1")  # launch plans (so kernel routes) in the interpreter too
    racing[0] = _rounds(times)
    q, k, v = _qkv(n=24)
    before = dict(callcache.DIRECT)
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v, is_causal=True)  # the race (its routes uncounted), then the call itself
        out = elsa_surgery.attention(*(t.clone() for t in (q, k, v)), is_causal=True)
    # the route taken is the winner's: the loser's (a bool for SDPA, a launch plan for ELSA) would not even run
    assert {n: callcache.DIRECT[n] - before[n] for n in before} == {"runs": 1, "routes": 0}
    assert [d.backend for d in log] == [winner, winner]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((out - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("kw", [dict(backend="elsa"), dict(precision="strict"), dict(return_lse=True),
                                dict(is_causal=True, kv_rows=30), dict(mask=True), dict(kv_lengths=True)])
def test_no_race_where_sdpa_differs_or_elsa_was_asked_for(racing, kw):
    q, k, v = _qkv()
    kw = dict(kw)
    if kw.pop("kv_rows", None):
        k, v = k[:, :, :30], v[:, :, :30]
    if kw.pop("mask", None):
        kw["attn_mask"] = torch.ones(40, 40, dtype=torch.bool, device=DEV).tril()
    if kw.pop("kv_lengths", None):  # with causal: not raced (key lengths alone are: the test below)
        kw.update(kv_lengths=torch.tensor([40, 20], device=DEV), is_causal=True)
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v, **kw)
    assert log[0].backend == "elsa" and "PyTorch SDPA" not in log[0].reason


@pytest.mark.parametrize("times,winner", [((0.2, 0.1), "sdpa"), ((0.1, 0.2), "elsa")])
def test_key_lengths_race_sdpa_with_a_key_padding_mask(racing, times, winner):
    """Key lengths alone (the transformers adapter's padded batches) are raced: SDPA's side takes a [B, 1, 1, Nk]
    key-padding mask; either winner gives the oracle's answer, a row of kv_len 0 zeros (never NaN), and later
    calls with other lengths keep the verdict."""
    racing[0] = _rounds(times)
    q, k, v = _qkv(b=3)
    with dispatch.record() as log:
        outs = [elsa_surgery.attention(q, k, v, kv_lengths=torch.tensor(kl, dtype=torch.int32, device=DEV))
                for kl in ([40, 17, 0], [3, 40, 25])]
    assert [d.backend for d in log] == [winner] * 2, log
    assert "ELSA {:.1f} us vs PyTorch SDPA {:.1f} us".format(*(t * 1e3 for t in times)) in log[0].reason, log
    for kl, out in zip(([40, 17, 0], [3, 40, 25]), outs):
        ref = elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference",
                                     kv_lengths=torch.tensor(kl, dtype=torch.int32, device=DEV))
        assert torch.isfinite(out).all() and float((out.double() - ref).abs().max()) < 1e-5
    assert (outs[0][2] == 0).all()
    # a training call (raced forward + backward): finite gradients, the empty row's zero, as the oracle's (this
    # CPU's SDPA gives a fully masked row zeros itself; sdpa.run lets such a row see every key before zeroing it,
    # for backends that give NaN)
    lengths = torch.tensor([40, 17, 0], dtype=torch.int32, device=DEV)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with dispatch.record() as log:
        out = elsa_surgery.attention(*leaves, kv_lengths=lengths)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = elsa_surgery.attention(*ref_leaves, backend="reference", kv_lengths=lengths)
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    assert log[0].backend == winner and "forward + backward" in log[0].reason, log
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and float((g.double() - rg).abs().max()) < 1e-4
    assert (grads[0][2] == 0).all()


def test_key_lengths_are_not_raced_when_traced(racing, monkeypatch):
    """A call with key lengths traced by torch.compile is not raced: the traced race times fresh tensors without
    lengths, which would not be the call the graph makes."""
    from elsa_surgery.semantics import build_problem

    q, k, v = _qkv()
    p = build_problem(q, k, v, None, 0.0, False, None, False, kv_lengths=torch.tensor([40, 20], device=DEV))
    d = dispatch.decide(p.q, p.k, p.v, p.mask, backend="auto", precision=None, need_lse=False)
    assert autoselect.sdpa_reason(p, d, backend="auto", precision=None, return_lse=False) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "traced by torch.compile" in autoselect.sdpa_reason(p, d, backend="auto", precision=None,
                                                               return_lse=False)


def test_sdpa_running_out_of_memory_in_the_race_keeps_elsa(racing, monkeypatch):
    """SDPA's side of the race out of GPU memory (its math path materialises the scores: fp32 GQA at 32K asks
    112 GiB) leaves the call on ELSA, the reason saying why, instead of failing a call ELSA can run."""
    def oom(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 112.00 GiB.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", oom)
    q, k, v = _qkv()
    with dispatch.record() as log:
        out = elsa_surgery.attention(q, k, v)
        elsa_surgery.attention(q, k, v)  # decided: no second race
    assert [d.backend for d in log] == ["elsa", "elsa"], log
    assert "PyTorch SDPA ran out of memory (CUDA out of memory. Tried to allocate 112.00 GiB.)" in log[0].reason
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference")
    assert float((out.double() - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("ms,settled", [((345.6, 1326.1), True), ((1326.1, 345.6), True), ((3.0, 4.0), False),
                                        ((0.3, 1.2), False)])
def test_a_race_settled_by_one_timed_call_of_each_stops_there(monkeypatch, ms, settled):
    """``race``: after the warm-up, one timed call of each side; where both take at least SETTLED_MS and one is
    SETTLED_RATIO times faster (a VGGT-shaped global attention: 0.35 s against 1.3 s), that is the verdict, without
    the rounds (5 s more there); else the interleaved rounds run. The decision's reason says which."""
    calls = {"elsa": 0, "sdpa": 0}
    sides = {"elsa": lambda: calls.__setitem__("elsa", calls["elsa"] + 1),
             "sdpa": lambda: calls.__setitem__("sdpa", calls["sdpa"] + 1)}

    def per_call_ms(fn, n):  # (choose wraps the SDPA side in its out-of-memory guard)
        for _ in range(n):
            fn()
        return ms[0] if fn is sides["elsa"] else ms[1]

    monkeypatch.setattr(autoselect, "_per_call_ms", per_call_ms)
    got = autoselect.race(sides["elsa"], sides["sdpa"])
    assert (got.elsa_ms, got.sdpa_ms) == ms
    assert got.rounds == (0 if settled else autoselect.ROUNDS)
    if settled:
        assert calls == {"elsa": 2, "sdpa": 2}  # warm-up and one timed call each
    else:
        assert calls["elsa"] > 2 + autoselect.ROUNDS - 1 and calls["sdpa"] > 2 + autoselect.ROUNDS - 1
    d = autoselect.choose(dispatch.Decision("elsa", None, "kept"), sides["elsa"], sides["sdpa"])
    assert d.backend == ("elsa" if ms[0] <= ms[1] else "sdpa")
    assert ("one timed call of each" in d.reason) == settled
    assert ("median of 3 interleaved rounds" in d.reason) == (not settled)
    traced = autoselect.choose(dispatch.Decision("elsa", None, "kept"), sides["elsa"], sides["sdpa"], traced=True)
    assert "raced once when torch.compile traced it" in traced.reason
    assert ("settled" in traced.reason) == settled

def test_fp32_race_only_with_ieee_matmuls(racing):
    keep = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        q, k, v = _qkv()
        with dispatch.record() as log:
            elsa_surgery.attention(q, k, v)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = keep
    assert log[0].backend == "elsa" and "PyTorch SDPA" not in log[0].reason


def test_the_report_shows_the_choice(racing):
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=16, num_classes=3).eval().to(DEV)
    report = elsa_surgery.convert(model, example_inputs=(torch.randn(2, 3, 32, 32, device=DEV),))
    assert report.parity.passed
    assert report.backends_used.get("sdpa", 0) > 0, report.backends_used
    assert any("ELSA 200.0 us vs PyTorch SDPA 100.0 us" in r for r in report.dispatch_reasons)


@pytest.mark.gpu
def test_real_race_on_the_gpu_is_recorded_and_exact():
    """A ViT-B/16 attention call (bf16, batch 8): whichever wins, the decision names both timings, and the output is
    SDPA's within bf16 rounding."""
    callcache.clear()
    q, k, v = (torch.randn(8, 12, 197, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with dispatch.record() as log:
        out = elsa_surgery.attention(q, k, v)
    assert "PyTorch SDPA" in log[0].reason and " us" in log[0].reason, log[0].reason
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v, backend="elsa")
    assert log[0].backend == "elsa"


@pytest.mark.parametrize("times,backend", [((0.2, 0.1), "sdpa"), ((0.1, 0.2), "elsa")])
def test_compiled_call_holds_the_trace_time_winner(racing, monkeypatch, times, backend):
    """Under torch.compile the race runs once when the call is traced (fresh tensors of its shapes, outside the
    graph), and the graph holds the winner: SDPA's own op (which Inductor sees) or ELSA's; the verdict is kept."""
    racing[0] = _rounds(times)
    monkeypatch.setattr(autoselect, "COMPILED", {})
    torch._dynamo.reset()
    q, k, v = _qkv(n=24)
    graphs = []

    def backend_fn(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda a, b, c: elsa_surgery.attention(a, b, c, is_causal=True), backend=backend_fn,
                      fullgraph=True)
    for _ in range(2):
        out = f(q, k, v)
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    sdpa_in_graph = any("scaled_dot_product_attention" in t for t in targets)
    assert len(graphs) == 1 and sdpa_in_graph == (backend == "sdpa"), targets
    assert any(t.startswith("elsa_surgery.attention") for t in targets) == (backend == "elsa"), targets
    (decision,) = autoselect.compiled_decisions().values()
    assert decision.backend == backend and "raced once when torch.compile traced it" in decision.reason
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((out - ref).abs().max()) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("rounds,backend", [(0, "sdpa"), (0, "elsa"), (3, "elsa")])
def test_traced_call_takes_the_settled_eager_verdict(racing, monkeypatch, rounds, backend):
    """An eager call whose race one timed call of each side settled (long calls, far apart) leaves its verdict for
    torch.compile's trace of the same call, which takes it without racing again and says so; a verdict of the
    rounds is not taken (the traced race counts the op's dispatch, which can turn a close verdict). A masked call
    or a training call leaves none; callcache.clear() drops them."""
    ms = (1300.0, 400.0) if backend == "sdpa" else (400.0, 1300.0)
    racing[0] = autoselect.Times(*ms, rounds)
    monkeypatch.setattr(autoselect, "COMPILED", {})
    torch._dynamo.reset()
    q, k, v = _qkv(n=24)
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v, is_causal=True)
    assert log[0].backend == backend
    assert len(autoselect.SETTLED) == (1 if rounds == 0 else 0)
    raced = []
    real = autoselect.race
    monkeypatch.setattr(autoselect, "race", lambda elsa, sdpa: (raced.append(1), real(elsa, sdpa))[1])
    f = torch.compile(lambda a, b, c: elsa_surgery.attention(a, b, c, is_causal=True), backend="eager",
                      fullgraph=True)
    out = f(q, k, v)
    (decision,) = autoselect.compiled_decisions().values()
    assert decision.backend == backend
    assert ("as this signature's eager race settled it" in decision.reason) == (rounds == 0), decision.reason
    assert raced == ([] if rounds == 0 else [1])
    assert float((out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max()) < 1e-5
    torch._dynamo.reset()
    mask = torch.ones(24, 24, dtype=torch.bool, device=DEV).tril()
    callcache.clear()
    assert not autoselect.SETTLED
    racing[0] = autoselect.Times(*ms, 0)
    elsa_surgery.attention(q, k, v, attn_mask=mask)  # (a mask: not raced at all)
    qg = q.clone().requires_grad_()
    elsa_surgery.attention(qg, k, v)  # a training call: raced, its verdict not kept
    assert not autoselect.SETTLED

def test_traced_call_with_symbolic_sizes_is_not_raced(racing, monkeypatch):
    """A graph with symbolic sizes (dynamic shapes: torch.compile's second shape, or ``dynamic=True``) serves many
    shapes: its calls are not raced and keep ELSA, in one graph (session 37: the race's signature then held symbolic
    sizes, which dynamo refused as the race's constant argument: a graph break, an error under ``fullgraph=True``)."""
    monkeypatch.setattr(autoselect, "COMPILED", {})
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: elsa_surgery.attention(a, b, c, is_causal=True), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    for n in (24, 31):
        q, k, v = _qkv(n=n)
        out = f(q, k, v)
        assert float((out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max()) < 1e-5
    assert autoselect.compiled_decisions() == {}
    torch._dynamo.reset()


def test_traced_race_times_the_op_the_graph_calls(racing, monkeypatch):
    """The race of a traced call times ELSA through the registered custom op (what Inductor's wrapper calls, its
    dispatch included), not the launcher alone, on fresh tensors of the call's shapes."""
    seen = []
    monkeypatch.setattr(autoselect, "COMPILED", {})

    def fake_race(elsa, sdpa):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            elsa()
        seen.extend(e.name for e in prof.events())
        return racing[0]

    monkeypatch.setattr(autoselect, "race", fake_race)
    torch._dynamo.reset()
    q, k, v = _qkv(n=24)
    f = torch.compile(lambda a, b, c: elsa_surgery.attention(a, b, c), backend="eager", fullgraph=True)
    f(q, k, v)
    assert "elsa_surgery::attention_inference" in seen, seen[:20]
    torch._dynamo.reset()


def test_training_calls_race_forward_and_backward_on_their_own(racing, monkeypatch):
    """A call autograd records is its own signature, raced as forward + backward (the backward to q, k, v only: no
    parameter's ``.grad`` is written); the same shapes without grad keep their own forward-only race."""
    grads_run = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: (grads_run.append(1), real_grad(*a, **kw))[1])
    w = torch.nn.Parameter(torch.ones(16, device=DEV))
    q, k, v = _qkv()
    qg = q * w  # a non-leaf, as a projection's output
    hooked = []
    qg.register_hook(lambda g: hooked.append(1))  # the caller's tensor hooks: never fired by the race
    with dispatch.record() as log:
        out = elsa_surgery.attention(qg, k, v)
        elsa_surgery.attention(q, k, v)  # inference: another signature, another race
        with torch.no_grad():
            elsa_surgery.attention(qg, k, v)  # no grad recorded: the inference signature
    assert len(grads_run) == 2 and w.grad is None  # the race's two sides ran a backward; nothing accumulated
    assert "forward + backward of each training call" in log[0].reason
    assert "forward + backward" not in log[1].reason and log[2].reason == log[1].reason
    assert callcache.STATS["misses"] >= 2
    assert not hooked
    out.sum().backward()  # the training call's graph is intact
    assert w.grad is not None and hooked == [1]


@pytest.mark.parametrize("reentrant", [False, True])
def test_race_inside_activation_checkpointing(racing, reentrant):
    """The first call of a signature inside a checkpointed forward races there; the recomputation in backward finds
    the signature decided and does not race. The race's saved tensors must not reach the checkpoint's hooks (the
    non-reentrant checkpoint raised CheckpointError: a different number of tensors saved), and the gradients are
    the uncheckpointed ones."""
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16, device=DEV))
    q, k, v = _qkv()

    def block(x):
        return elsa_surgery.attention(x * w, k, v)

    with dispatch.record() as log:
        out = checkpoint(block, q.requires_grad_(reentrant), use_reentrant=reentrant)
    out.square().sum().backward()
    assert log[0].backend == "sdpa"  # the race ran (its clock says SDPA) and the call kept its choice
    got = w.grad.clone()
    w.grad = None
    block(q).square().sum().backward()
    torch.testing.assert_close(got, w.grad)


def test_sdpa_key_padding_mask_built_once_for_lengths_of_our_own(monkeypatch):
    """SDPA with key lengths builds its [B, 1, 1, Nk] key-padding mask once for lengths that their maker recorded as
    its own (semantics.trust_lengths: the transformers adapter's, one tensor per forward pass), as the native model
    builds one mask for all its layers; lengths a caller may change in place get a fresh mask on every call. The
    answers equal the oracle's either way, rows of length 0 zeros."""
    from elsa_surgery import semantics

    masks = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: (masks.append(kw.get("attn_mask")), real(*a, **kw))[1])
    q, k, v = _qkv(b=3)

    def check(kl, calls=2):
        masks.clear()
        outs = [elsa_surgery.attention(q, k, v, backend="sdpa", kv_lengths=kl) for _ in range(calls)]
        ref = elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference", kv_lengths=kl)
        for out in outs:
            assert torch.isfinite(out).all() and float((out.double() - ref).abs().max()) < 1e-5
            assert (out[kl == 0] == 0).all()
        return masks[:calls]

    users = torch.tensor([40, 17, 0], dtype=torch.int32, device=DEV)
    a, b = check(users)
    assert a is not b  # the caller's tensor: built for each call
    for values, positive in (([40, 17, 0], False), ([40, 17, 3], True)):
        ours = torch.tensor(values, dtype=torch.int32, device=DEV)
        semantics.trust_lengths(ours, 40, positive=positive)
        a, b = check(ours)
        assert a is b, values  # built once
        with torch.inference_mode():
            c, = check(ours, calls=1)
        assert c is not a  # another mode, another mask (an inference tensor cannot be saved for backward)
    ours.fill_(0)  # an in-place change: no longer the recorded lengths
    assert semantics.trusted_lengths(ours) is None
    a, b = check(ours)
    assert a is not b
