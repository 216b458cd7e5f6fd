"""The per-signature memo of a public call's validation and dispatch (elsa_surgery/callcache.py): a hit gives what
the full path gives (decision, output, errors, announcements), and every part of the signature makes its own entry."""

import logging

import numpy as np
import pytest
import torch

import elsa_surgery
from elsa_surgery import callcache, dispatch
from elsa_surgery.kernels import replay
from oracle import decoy, naive_attention, rel_err


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype, device=DEV) for _ in range(3))


def _oracle(q, k, v, mask=None, **kw):
    cpu = lambda t: None if t is None else t.cpu()
    return naive_attention(cpu(q), cpu(k), cpu(v), cpu(mask), **kw)[0]


def _counts():
    return dict(callcache.STATS)


def _delta(before):
    return {k: callcache.STATS[k] - before[k] for k in before}


def _kernels_on_cpu(monkeypatch):
    """On the CPU, ``auto`` as it decides on a GPU: the kernels run in the Triton interpreter (on a GPU: as is)."""
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(dispatch, "auto_runs_kernels_on", lambda device: True)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("three_d", [False, True])
def test_a_hit_computes_the_call_on_its_own_tensors(monkeypatch, mask_kind, three_d):
    """Decoys first (same signature, other values), then the real call: a hit that kept anything of the first call
    (a tensor, a mask view) fails the oracle. On the ELSA kernels, in the interpreter."""
    _kernels_on_cpu(monkeypatch)
    shape = (2, 24, 16) if three_d else (2, 3, 24, 16)
    q, k, v = _qkv(*shape)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 24, 24, device=DEV) > 0.3
    elif mask_kind == "additive":
        mask = torch.randn(24, device=DEV) * 2  # broadcast over batch, heads and rows: the canonical view is rebuilt
    kw = dict(attn_mask=mask, is_causal=mask_kind == "none", scale=0.3)
    before = _counts()
    with dispatch.record() as log:
        elsa_surgery.attention(*(decoy(t) for t in (q, k, v)), **{**kw, "attn_mask": decoy(mask)})
        out = elsa_surgery.attention(q, k, v, **kw)
    assert _delta(before) == {"hits": 1, "misses": 1, "bypassed": 0}
    assert [(d.backend, d.fallback) for d in log] == [("elsa", False)] * 2  # announced on the hit too
    unsq = (lambda t: t.unsqueeze(1)) if three_d else (lambda t: t)
    m4 = None if mask is None else (mask if mask.dim() == 4 else mask.view(1, 1, 1, 24))
    ref = _oracle(unsq(q), unsq(k), unsq(v), m4, is_causal=kw["is_causal"], scale=0.3)
    assert out.shape == (ref.squeeze(1) if three_d else ref).shape
    assert rel_err(unsq(out).cpu(), ref) < 2e-6


def test_every_part_of_the_signature_has_its_own_entry(monkeypatch):
    _kernels_on_cpu(monkeypatch)
    q, k, v = _qkv(1, 2, 16, 16)
    variants = [
        dict(), dict(scale=0.5), dict(scale=0.25), dict(is_causal=True), dict(is_causal=1),
        dict(precision="turbo"), dict(backend="reference"), dict(return_lse=True), dict(dropout_p=0),
        dict(attn_mask=torch.ones(16, 16, dtype=torch.bool, device=DEV)),
        dict(attn_mask=torch.zeros(16, 16, device=DEV)), dict(attn_mask=torch.zeros(1, 16, device=DEV)),
    ]
    before = _counts()
    for kw in variants:
        elsa_surgery.attention(q, k, v, **kw)
    assert _delta(before) == {"hits": 0, "misses": len(variants), "bypassed": 0}
    for kw in variants:
        elsa_surgery.attention(q, k, v, **kw)
    assert _delta(before) == {"hits": len(variants), "misses": len(variants), "bypassed": 0}
    # other shapes, dtypes, GQA
    elsa_surgery.attention(*_qkv(1, 2, 17, 16))
    elsa_surgery.attention(*_qkv(1, 2, 16, 16, dtype=torch.float16))
    elsa_surgery.attention(q, k[:, :1], v[:, :1], enable_gqa=True)
    assert _delta(before)["misses"] == len(variants) + 3


def test_the_environment_is_part_of_the_signature(monkeypatch):
    _kernels_on_cpu(monkeypatch)
    q, k, v = _qkv(1, 2, 16, 16)
    with dispatch.record() as log:
        elsa_surgery.attention(q, k, v)
        monkeypatch.setenv("ELSA_BACKEND", "reference")
        elsa_surgery.attention(q, k, v)
        monkeypatch.delenv("ELSA_BACKEND")
        monkeypatch.setenv("ELSA_FP32_PRECISION", "turbo")
        elsa_surgery.attention(q, k, v)
        monkeypatch.delenv("ELSA_FP32_PRECISION")
        elsa_surgery.attention(q, k, v)
    default = dispatch.default_precision(q.device)
    assert [(d.backend, d.precision) for d in log] == [
        ("elsa", default), ("reference", None), ("elsa", "turbo"), ("elsa", default)]
    monkeypatch.setenv("ELSA_BACKEND", "fast")
    with pytest.raises(ValueError, match="ELSA_BACKEND"):
        elsa_surgery.attention(q, k, v)


def test_errors_are_never_memoised():
    q, k, v = _qkv(1, 2, 16, 16)
    before = _counts()
    for _ in range(2):
        with pytest.raises(ValueError, match="scale must be finite"):
            elsa_surgery.attention(q, k, v, scale=float("inf"))
        with pytest.raises(ValueError, match="backend must be one of"):
            elsa_surgery.attention(q, k, v, backend="fast")
        with pytest.raises(ValueError, match="return_lse=True is not available with backend='sdpa'"):
            elsa_surgery.attention(q, k, v, backend="sdpa", return_lse=True)
        with pytest.raises(ValueError, match="attn_mask of shape"):
            elsa_surgery.attention(q, k, v, attn_mask=torch.zeros(3, 16, device=DEV))
        with pytest.raises(ValueError, match="must have the same head dim"):
            elsa_surgery.attention(q, k[..., :8], v)
    assert _delta(before) == {"hits": 0, "misses": 10, "bypassed": 0}
    assert not callcache._entries


def test_forced_elsa_that_cannot_run_raises_on_every_call(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(1, 2, 16, 264)
    for _ in range(2):
        with pytest.raises(elsa_surgery.BackendUnavailable, match="D=264"):
            elsa_surgery.attention(q, k, v, backend="elsa")


def test_fallbacks_are_announced_on_hits(monkeypatch, caplog):
    _kernels_on_cpu(monkeypatch)
    q, k, v = _qkv(1, 2, 16, 16, dtype=torch.float64)
    dispatch._logged.clear()
    with dispatch.record() as log, caplog.at_level(logging.WARNING, logger="elsa_surgery"):
        for _ in range(3):
            out = elsa_surgery.attention(q, k, v)
    assert [(d.backend, d.fallback) for d in log] == [("reference", True)] * 3
    assert caplog.text.count("dtype torch.float64") == 1  # logged once, recorded every time
    assert rel_err(out.cpu(), _oracle(q, k, v)) < 1e-12


def test_calls_it_does_not_memoise_are_validated_in_full(monkeypatch):
    _kernels_on_cpu(monkeypatch)
    q, k, v = _qkv(2, 2, 16, 16)
    before = _counts()
    for _ in range(2):
        out = elsa_surgery.attention(q, k, v, kv_lengths=[16, 9])
        elsa_surgery.attention(q, k, v, scale=torch.tensor(0.25))
        elsa_surgery.attention(q, k, v, scale=np.float64(0.25))
        elsa_surgery.attention(q, k, v, is_causal=np.bool_(True))
        elsa_surgery.attention(torch.nn.Parameter(q, requires_grad=False), k, v)
    assert _delta(before) == {"hits": 0, "misses": 0, "bypassed": 10}
    assert rel_err(out.cpu(), _oracle(q, k, v, kv_lengths=torch.tensor([16, 9]))) < 2e-6
    with pytest.raises(ValueError, match=r"kv_lengths values must lie in \[0, 16\]"):
        elsa_surgery.attention(q, k, v, kv_lengths=[17, 3])


def test_calls_with_lengths_tensors_are_memoised_and_their_values_checked(monkeypatch):
    """A lengths tensor's geometry joins the key (BERT's padding, static-cache decode: one validation a signature,
    not one a layer); its values are the call's own on a hit, and still checked (session 31)."""
    _kernels_on_cpu(monkeypatch)
    q, k, v = _qkv(2, 2, 16, 16)
    before = _counts()
    first = elsa_surgery.attention(q, k, v, kv_lengths=torch.tensor([16, 9], device=DEV))
    lengths = torch.tensor([5, 12], device=DEV)
    ql = torch.tensor([16, 3], device=DEV)
    out = elsa_surgery.attention(q, k, v, kv_lengths=lengths)
    assert _delta(before) == {"hits": 1, "misses": 1, "bypassed": 0}
    assert rel_err(first.cpu(), _oracle(q, k, v, kv_lengths=torch.tensor([16, 9]))) < 2e-6
    assert rel_err(out.cpu(), _oracle(q, k, v, kv_lengths=lengths.cpu())) < 2e-6
    with pytest.raises(ValueError, match=r"kv_lengths values must lie in \[0, 16\], got min 3 and max 17"):
        elsa_surgery.attention(q, k, v, kv_lengths=torch.tensor([17, 3], device=DEV))
    both = elsa_surgery.attention(q, k, v, q_lengths=ql, kv_lengths=lengths)  # another key: q_lengths too
    assert rel_err(both.cpu(), _oracle(q, k, v, q_lengths=ql.cpu(), kv_lengths=lengths.cpu())) < 2e-6
    assert _delta(before) == {"hits": 2, "misses": 2, "bypassed": 0}


def test_nothing_is_memoised_under_torch_compile(monkeypatch):
    """Traced calls neither read nor write the memo or its counters: dynamo would guard on them and recompile on
    every call (fullgraph compiles once here, for three calls)."""
    q, k, v = _qkv(1, 2, 16, 16)
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda a, b, c: elsa_surgery.attention(a, b, c, backend="reference"), backend=count_graphs,
                      fullgraph=True)
    before = _counts()
    for _ in range(3):
        out = f(q, k, v)
    assert len(graphs) == 1
    assert _delta(before) == {"hits": 0, "misses": 0, "bypassed": 0} and not callcache._entries
    assert rel_err(out.cpu(), _oracle(q, k, v)) < 2e-6


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(callcache, "MAX_ENTRIES", 3)
    q, k, v = _qkv(1, 2, 16, 16)
    for s in (0.1, 0.2, 0.3, 0.4, 0.5):
        elsa_surgery.attention(q, k, v, scale=s)
    assert len(callcache._entries) == 3


# ---- direct routes (callcache.direct / learn): a call seen before runs through its launch plan or plain SDPA ----


@pytest.mark.parametrize("how", ["evicted", "cleared"])
def test_direct_routes_go_with_their_entry(monkeypatch, how):
    """A route is found by its own flat key, apart from the memo's: an entry dropped from the memo (bounded, or
    cleared) takes its routes with it, so the next call decides afresh instead of running the old decision."""
    monkeypatch.setattr(callcache, "MAX_ENTRIES", 2)
    q, k, v = _qkv(1, 2, 16, 16)
    before = dict(callcache.DIRECT)
    for _ in range(2):
        elsa_surgery.attention(q, k, v, backend="sdpa", scale=0.1)
    assert _direct_delta(before) == {"runs": 1, "routes": 1}
    if how == "evicted":
        for s in (0.2, 0.3):  # two more signatures: the first entry is dropped
            elsa_surgery.attention(q, k, v, backend="sdpa", scale=s)
    else:
        callcache.clear()
    runs = callcache.DIRECT["runs"]
    hits = callcache.STATS["hits"]
    elsa_surgery.attention(q, k, v, backend="sdpa", scale=0.1)
    assert callcache.DIRECT["runs"] == runs and callcache.STATS["hits"] == hits  # decided again, in full
    elsa_surgery.attention(q, k, v, backend="sdpa", scale=0.1)
    assert callcache.DIRECT["runs"] == runs + 1  # and its new route taken

def _plans_on_cpu(monkeypatch):
    """Launch plans (and so direct routes) on the CPU too: the kernels in the interpreter, replayed."""
    _kernels_on_cpu(monkeypatch)
    if DEV == "cpu":
        monkeypatch.setenv("ELSA_LAUNCH_PLANS", "1")


def _direct_delta(before):
    return {k: callcache.DIRECT[k] - before[k] for k in before}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "padding"])
def test_a_direct_route_computes_the_call_on_its_own_tensors(monkeypatch, mask_kind):
    """Decoys first (same geometry, other values: the first call records the route), then the real call runs
    through the route: anything kept of the first call fails the oracle. Decisions are announced on every call."""
    _plans_on_cpu(monkeypatch)
    q, k, v = _qkv(2, 3, 24, 16)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 3, 24, 24, device=DEV) > 0.3
    elif mask_kind == "additive":
        mask = torch.randn(2, 3, 24, 24, device=DEV)
    elif mask_kind == "padding":  # [B, 1, 1, Nk]: its canonical view is expanded on every call
        mask = torch.rand(2, 1, 1, 24, device=DEV) > 0.4
    kw = dict(attn_mask=mask, scale=0.3, is_causal=mask_kind == "none")
    before, direct_before = _counts(), dict(callcache.DIRECT)
    with dispatch.record() as log:
        elsa_surgery.attention(*(decoy(t) for t in (q, k, v)), **{**kw, "attn_mask": decoy(mask)})
        assert _direct_delta(direct_before) == {"runs": 0, "routes": 1}  # made by the first call
        replayed = replay.STATS["replayed"]
        out = elsa_surgery.attention(q, k, v, **kw)
        assert _direct_delta(direct_before) == {"runs": 1, "routes": 1}
        # a direct route is a replay of the plan: counted there too (session 28: the GPU tests of launch plans
        # counted only replay.run's replays and failed once calls took their direct routes)
        assert replay.STATS["replayed"] == replayed + 1
        elsa_surgery.attention(*(decoy(t) for t in (q, k, v)), **{**kw, "attn_mask": decoy(mask)}, return_lse=True)
        out2, lse = elsa_surgery.attention(q, k, v, **kw, return_lse=True)  # another signature, its own route
    assert _direct_delta(direct_before) == {"runs": 2, "routes": 2}
    assert _delta(before) == {"hits": 2, "misses": 2, "bypassed": 0}
    assert [d.backend for d in log] == ["elsa"] * 4
    ref, ref_lse = naive_attention(*(None if t is None else t.cpu() for t in (q, k, v, mask)),
                                   is_causal=kw["is_causal"], scale=0.3)
    assert rel_err(out.cpu(), ref) < 2e-6 and torch.equal(out, out2)
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-5


def test_direct_routes_follow_strides_aliasing_and_autograd(monkeypatch):
    """Same signature, other strides / one tensor for q and k / inputs that want a gradient: each its own route or
    the full path, never a route recorded for another geometry."""
    _plans_on_cpu(monkeypatch)
    x = torch.randn(2, 24, 3, 16, device=DEV)
    q, k, v = _qkv(2, 3, 24, 16)
    t = x.transpose(1, 2)  # [B, H, N, D] view of [B, N, H, D] memory
    before = dict(callcache.DIRECT)
    for args in ((q, k, v), (t, k, v), (q, q, v), (t, t, t)):
        for _ in range(2):
            out = elsa_surgery.attention(*args, scale=0.25)
        assert rel_err(out.cpu(), _oracle(*args, scale=0.25)) < 2e-6
    assert _direct_delta(before) == {"runs": 4, "routes": 4}
    qg = q.clone().requires_grad_()
    for _ in range(2):  # autograd records the call: a route of its own (the full path, then that route)
        out = elsa_surgery.attention(qg, k, v, scale=0.25)
    out.sum().backward()
    assert qg.grad is not None and _direct_delta(before) == {"runs": 5, "routes": 5}
    with torch.no_grad():
        out = elsa_surgery.attention(qg, k, v, scale=0.25)  # no gradient recorded: the route of (q, k, v)
    assert _direct_delta(before)["runs"] == 6 and out.grad_fn is None
    bias = torch.zeros(2, 3, 24, 24, device=DEV).requires_grad_()  # a learned bias: autograd records the call
    with torch.no_grad():
        elsa_surgery.attention(q, k, v, bias, scale=0.25)  # (the inference route of the masked signature)
    for _ in range(2):
        out = elsa_surgery.attention(q, k, v, bias, scale=0.25)
    out.sum().backward()
    assert bias.grad is not None and _direct_delta(before) == {"runs": 7, "routes": 7}


def _backward_keys_built(monkeypatch) -> list:
    """The launch plan keys ``backward_launch._backward_key`` builds from now on, in order (a list kept up to date)."""
    from elsa_surgery.kernels import backward_launch as bl

    keys, real = [], bl._backward_key
    monkeypatch.setattr(bl, "_backward_key", lambda *a, **kw: keys.append(real(*a, **kw)) or keys[-1])
    return keys


def _check_against_float64(got, ins, go, **oracle):
    """``got`` (the output, then the gradients of ``ins`` that require grad, in order) against float64 autograd
    through ``naive_attention(*ins, **oracle)`` with output gradient ``go`` (bool masks as they are)."""
    ref_in = [t if t is None or t.dtype == torch.bool else t.detach().double().requires_grad_(t.requires_grad)
              for t in ins]
    ref = naive_attention(*ref_in, **oracle)[0]
    ref.backward(go.double())
    want = [ref.detach()] + [t.grad for t in ref_in if t is not None and t.requires_grad]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("case", ["plain", "gqa causal", "bias broadcast", "bool mask", "key lengths",
                                  "windowed bias"])
def test_a_training_call_through_its_route_gives_the_full_paths_output_and_gradients(monkeypatch, backward_path,
                                                                                      case):
    """A training call seen before runs through its direct route (training.RoutedAttention: the recorded forward
    replayed in an autograd node): the output and every gradient (q, k, v, a learned mask) equal the full path's
    bit for bit, on fresh inputs, and match float64 autograd; the backward's plan key is built once per route and
    output-gradient layout (a transposed output gradient: its own key, still exact)."""
    _plans_on_cpu(monkeypatch)
    B, Hq, Hkv, N, D = 4, 4, 4, 24, 16
    kw, windowed, mask_shape = dict(scale=0.3), False, None
    if case == "gqa causal":
        Hkv, kw = 2, dict(kw, is_causal=True, enable_gqa=True)
    elif case in ("bias broadcast", "windowed bias"):
        mask_shape = (1, Hq, N, N) if case == "bias broadcast" else (2, Hq, N, N)
        windowed = case == "windowed bias"
        kw = dict(kw, windowed_mask=windowed)
    elif case == "bool mask":
        mask_shape = (B, 1, N, N)
    elif case == "key lengths":
        kw = dict(kw, kv_lengths=torch.tensor([24, 5, 17, 1], dtype=torch.int32, device=DEV))

    def inputs():
        q = torch.randn(B, Hq, N, D, device=DEV, requires_grad=True)
        k, v = (torch.randn(B, Hkv, N, D, device=DEV, requires_grad=True) for _ in range(2))
        mask = None
        if case == "bool mask":
            mask = torch.rand(mask_shape, device=DEV) > 0.3
        elif mask_shape is not None:
            mask = torch.randn(mask_shape, device=DEV).requires_grad_()
        return q, k, v, mask

    def run(q, k, v, mask, go):
        out = elsa_surgery.attention(q, k, v, mask, **kw)
        out.backward(go)
        return [out.detach()] + [t.grad for t in (q, k, v, mask) if t is not None and t.requires_grad]

    before = dict(callcache.DIRECT)
    keys = _backward_keys_built(monkeypatch)
    first = inputs()
    go = torch.randn(B, Hq, N, D, device=DEV)
    full = run(*first, go)  # the full path (the route learnt)
    assert _direct_delta(before) == {"runs": 0, "routes": 1} and len(keys) == 1
    twins = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in first]
    routed = run(*twins, go)
    assert _direct_delta(before) == {"runs": 1, "routes": 1} and len(keys) == 2  # the route's memo filled
    for a, b in zip(full, routed):
        assert torch.equal(a, b)
    def against_float64(ins, go):
        _check_against_float64(run(*ins, go), ins, go, is_causal=kw.get("is_causal", False), scale=0.3,
                               kv_lengths=kw.get("kv_lengths"), windowed=windowed)

    against_float64(inputs(), go)  # fresh values through the route
    assert _direct_delta(before) == {"runs": 2, "routes": 1} and len(keys) == 2  # the backward's key from the memo
    against_float64(inputs(), torch.randn(B, N, Hq, D, device=DEV).transpose(1, 2))  # another output-grad layout
    assert _direct_delta(before) == {"runs": 3, "routes": 1} and len(keys) == 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_training_routes_under_activation_checkpointing(monkeypatch, reentrant):
    """torch.utils.checkpoint around a call that has a training route: the recomputation saves what the first forward
    saved (non-reentrant checkpointing checks it), and the gradients equal those of the call without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    _plans_on_cpu(monkeypatch)
    bias = torch.randn(1, 3, 20, 20, device=DEV).requires_grad_()

    def block(q, k, v):
        return elsa_surgery.attention(q, k, v, bias, scale=0.3) * 2

    def grads(wrap):
        torch.manual_seed(3)
        q, k, v = (torch.randn(2, 3, 20, 16, device=DEV, requires_grad=True) for _ in range(3))
        bias.grad = None
        out = checkpoint(block, q, k, v, use_reentrant=reentrant) if wrap else block(q, k, v)
        out.sum().backward()
        return out.detach(), q.grad, k.grad, v.grad, bias.grad

    before = dict(callcache.DIRECT)
    plain = grads(False)  # the full path: the route learnt
    assert _direct_delta(before) == {"runs": 0, "routes": 1}
    for _ in range(2):
        for a, b in zip(grads(True), plain):
            assert torch.equal(a, b)
    # non-reentrant: the forward and its recomputation both through the training route (2 x 2); reentrant: the
    # forward runs under no_grad (its own signature: the full path, then its route), the recomputation the route
    assert _direct_delta(before)["runs"] == (3 if reentrant else 4)


def test_a_training_routes_backward_follows_the_knobs_and_the_deterministic_mode(monkeypatch,
                                                                                   backward_kernels_fetched):
    """The route's memo of backward keys is keyed by the knobs that choose the backward (``ELSA_BWD_SHORT``,
    ``ELSA_BWD_DQ``, ``ELSA_LAUNCH_PLANS``) and by ``torch.use_deterministic_algorithms``: a change of any takes the
    backward it asks for, with a key of its own, and the gradients stay exact."""
    _plans_on_cpu(monkeypatch)
    fetched = backward_kernels_fetched
    keys = _backward_keys_built(monkeypatch)

    def step():
        q, k, v = (torch.randn(2, 3, 20, 16, device=DEV, requires_grad=True) for _ in range(3))
        go = torch.randn(2, 3, 20, 16, device=DEV)
        out = elsa_surgery.attention(q, k, v, scale=0.3)
        out.backward(go)
        _check_against_float64([out.detach(), q.grad, k.grad, v.grad], (q, k, v), go, scale=0.3)

    before = dict(callcache.DIRECT)
    monkeypatch.setenv("ELSA_BWD_SHORT", "1")
    step()  # the full path: the route learnt
    step()  # the route: its memo gets the key
    assert _direct_delta(before) == {"runs": 1, "routes": 1} and len(keys) == 2 and "bwd_short" in fetched
    fetched.clear()
    monkeypatch.setenv("ELSA_BWD_SHORT", "0")
    step()
    assert len(keys) == 3 and "bwd_kv" in fetched and "bwd_short" not in fetched
    step()
    assert len(keys) == 3  # (that entry of the memo)
    monkeypatch.setenv("ELSA_BWD_DQ", "atomic")
    fetched.clear()
    step()
    assert len(keys) == 4 and "row_pass" not in fetched  # dQ by atomic adds in the key-block pass
    with_det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        step()  # deterministic: the row pass again, the plan made at ELSA_BWD_SHORT=0 replayed
        assert len(keys) == 5 and keys[4] == keys[2] != keys[3]
    finally:
        torch.use_deterministic_algorithms(with_det)
    assert _direct_delta(before) == {"runs": 5, "routes": 1}


def test_direct_routes_are_dropped_with_their_plans(monkeypatch):
    """replay.clear() (the planner's constants changed) and a knob the plan read: the route is not used."""
    from elsa_surgery.kernels import internals, knobs, replay

    _plans_on_cpu(monkeypatch)
    q, k, v = _qkv(1, 2, 20, 16)
    elsa_surgery.attention(q, k, v)
    before = dict(callcache.DIRECT)
    elsa_surgery.attention(q, k, v)
    assert _direct_delta(before)["runs"] == 1
    replay.clear()
    out = elsa_surgery.attention(q, k, v)
    assert _direct_delta(before) == {"runs": 1, "routes": 1}  # full path, route made anew
    plan = next(iter(replay._plans.values()))
    assert internals.ENCODE(knobs.NUM_PARTITIONS) in plan.env_keys  # the planner read it
    monkeypatch.setenv(knobs.NUM_PARTITIONS, "2")
    out2 = elsa_surgery.attention(q, k, v)
    assert _direct_delta(before)["runs"] == 1
    for o in (out, out2):
        assert rel_err(o.cpu(), _oracle(q, k, v)) < 2e-6


def test_sdpa_chosen_runs_plain_sdpa_directly():
    q, k, v = _qkv(2, 4, 12, 8)
    kv = [t[:, :2] for t in (k, v)]
    before = dict(callcache.DIRECT)
    with dispatch.record() as log:
        for _ in range(2):
            out = elsa_surgery.attention(q, *kv, backend="sdpa", enable_gqa=True, is_causal=True)
    assert _direct_delta(before) == {"runs": 1, "routes": 1} and [d.backend for d in log] == ["sdpa"] * 2
    assert rel_err(out.cpu(), _oracle(q, *kv, is_causal=True)) < 2e-6


def test_direct_routes_announce_to_the_open_logs_of_their_thread():
    """A direct route announces its decision only while a ``record()`` block is open (a counter over threads makes
    the call without one skip the thread-local lookup), and only to the logs of its own thread."""
    import threading

    q, k, v = _qkv(1, 2, 8, 8)
    run = lambda: elsa_surgery.attention(q, k, v, backend="sdpa")  # noqa: E731
    run()  # the route made
    assert dispatch._OPEN[0] == 0
    before = dict(callcache.DIRECT)
    run()  # no log open anywhere: nothing to hand over
    other = []

    def in_thread():
        with dispatch.record() as theirs:
            run()
        other.append([d.backend for d in theirs])

    with dispatch.record() as log:
        run()
        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
        with dispatch.record() as inner:
            run()
    assert [d.backend for d in log] == ["sdpa"] * 2 and [d.backend for d in inner] == ["sdpa"]
    assert other == [["sdpa"]] and dispatch._OPEN[0] == 0
    assert _direct_delta(before) == {"runs": 4, "routes": 0}


@pytest.mark.parametrize("backend", ["elsa", "sdpa"])
def test_key_lengths_calls_take_direct_routes_while_their_values_need_no_check(monkeypatch, backend):
    """Calls with kv_lengths (BERT's padded batches, a static cache's decode) have direct routes, taken only while the
    lengths are known valid: checked before and unchanged, or trusted by their maker. A lengths tensor changed in
    place after its check takes the full path, which checks it again (an invalid value raises, never runs)."""
    from elsa_surgery import semantics

    _plans_on_cpu(monkeypatch)
    q, k, v = _qkv(3, 2, 16, 8)
    before = dict(callcache.DIRECT)
    decoys = [decoy(t) for t in (q, k, v)]
    elsa_surgery.attention(*decoys, backend=backend, kv_lengths=torch.tensor([4, 16, 9], dtype=torch.int32,
                                                                       device=DEV))  # the route
    assert _direct_delta(before) == {"runs": 0, "routes": 1}
    ours = torch.tensor([16, 0, 5], dtype=torch.int32, device=DEV)
    semantics.trust_lengths(ours, 16)
    with dispatch.record() as log:
        out = elsa_surgery.attention(q, k, v, backend=backend, kv_lengths=ours)
    assert _direct_delta(before) == {"runs": 1, "routes": 1} and [d.backend for d in log] == [backend]
    assert rel_err(out.cpu(), _oracle(q, k, v, kv_lengths=ours.cpu())) < 2e-6 and (out[1] == 0).all()
    users = torch.tensor([7, 16, 1], dtype=torch.int32, device=DEV)
    for _ in range(2):  # unseen: the full path checks it; then checked and unchanged: the route
        out = elsa_surgery.attention(q, k, v, backend=backend, kv_lengths=users)
        assert rel_err(out.cpu(), _oracle(q, k, v, kv_lengths=users.cpu())) < 2e-6
    assert _direct_delta(before) == {"runs": 2, "routes": 1}
    users[0] = 17  # changed in place: checked again on the full path
    with pytest.raises(ValueError, match=r"kv_lengths values must lie in \[0, 16\]"):
        elsa_surgery.attention(q, k, v, backend=backend, kv_lengths=users)
    assert _direct_delta(before) == {"runs": 2, "routes": 1}
    grad_key = callcache.signature(q.clone().requires_grad_(), k, v, None, 0.0, False, None, False, backend, None,
                                   False, None, ours, False)
    assert grad_key[callcache._GRAD] is True  # (learn reads the flag there: items follow it for lengths calls)


@pytest.mark.gpu
def test_route_keys_read_the_current_device_and_capture_as_pytorch_does():
    """A route's key reads the current CUDA device and stream capture through PyTorch's C functions where it has
    them (callcache._cuda_device / _cuda_capturing), else through torch.cuda's public functions: the same values."""
    assert callcache._cuda_device() == torch.cuda.current_device()
    assert callcache._cuda_capturing() == torch.cuda.is_current_stream_capturing() is False
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        capturing = (callcache._cuda_capturing(), torch.cuda.is_current_stream_capturing())
        torch.empty(1, device="cuda").add_(1)
    assert capturing == (True, True)


@pytest.mark.parametrize("form", ["plain", "mask", "bool mask", "scalars", "int scale", "numpy scale", "aliased",
                                  "kv_lengths", "grad", "grad mask", "kv_lengths grad"])
def test_a_route_key_holds_the_signature(form):
    """A call that misses its direct route takes its memo signature from the route key (one pass over the tensors):
    ``signature_of(route key)`` must be exactly ``signature(...)`` of the call, or the memo and the routes would
    part."""
    np = pytest.importorskip("numpy")
    q, k, v = _qkv(2, 3, 12, 8)
    args = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, backend="auto",
                precision=None, return_lse=False, windowed_mask=False)
    if form == "mask":
        args["attn_mask"] = torch.randn(2, 1, 12, 12, device=DEV)
    elif form == "bool mask":
        args["attn_mask"] = torch.rand(1, 1, 1, 12, device=DEV) > 0.5
    elif form == "scalars":
        args.update(is_causal=True, scale=0.3, backend="sdpa", precision="strict", return_lse=True)
    elif form == "int scale":
        args["scale"] = 1
    elif form == "numpy scale":
        args["scale"] = np.float32(0.5)  # not a plain scalar: no memo signature
    elif form == "aliased":
        k = v = q
    elif form in ("grad", "kv_lengths grad"):  # autograd records the call: the key's flag, from the route key's
        q = q.requires_grad_()
    elif form == "grad mask":  # a learned bias alone
        args["attn_mask"] = torch.randn(2, 1, 12, 12, device=DEV).requires_grad_()
    lengths = torch.tensor([12, 3], dtype=torch.int32, device=DEV) if form.startswith("kv_lengths") else None
    order = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "backend", "precision", "return_lse")
    miss = callcache.direct(q, k, v, *(args[n] for n in order), args["windowed_mask"], lengths)
    assert type(miss) is callcache.Miss and miss.key is not None
    expected = callcache.signature(q, k, v, *(args[n] for n in order), None, lengths, args["windowed_mask"])
    assert callcache.signature_of(miss.key) == expected
    assert (expected is None) == (form == "numpy scale")
    assert expected is None or expected[callcache._GRAD] is form.endswith(("grad", "grad mask"))


def _packed(lens, H=2, D=16, causal=False, scale=0.3):
    """q, k, v [total, H, D], cu_seqlens (int32), and the float64-free oracle of each sequence."""
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=DEV)
    q, k, v = _qkv(int(cu[-1]), H, D)

    def ref():
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s = lambda t: t[a:b].transpose(0, 1).unsqueeze(0)
            outs.append(_oracle(s(q), s(k), s(v), is_causal=causal, scale=scale)[0].transpose(0, 1))
        return torch.cat(outs)
    return q, k, v, cu, ref


def test_packed_calls_are_memoised_and_their_cu_seqlens_checked(monkeypatch):
    """A packed call's signature (q/k/v geometry, the cu_seqlens' geometry, the scalars) is validated and decided once
    (session 40: 155-186 µs of host time a call before, and two host syncs on a GPU); a hit computes the call on its
    own tensors and cu_seqlens, whose values are checked (once per tensor while unchanged: the layers of a packed
    forward share one pair); bad values and too small maxima still raise on a hit."""
    _kernels_on_cpu(monkeypatch)
    monkeypatch.setenv("ELSA_LAUNCH_PLANS", "0")  # the memo alone (no direct routes: those are tested below)
    from elsa_surgery import semantics

    looked = []
    real = semantics.cu_seqlens_checked
    monkeypatch.setattr(semantics, "cu_seqlens_checked", lambda *a: looked.append(real(*a)) or looked[-1])
    kw = dict(is_causal=True, scale=0.3)
    q0, k0, v0, cu0, _ = _packed([5, 7, 8], causal=True)
    before = _counts()
    with dispatch.record() as log:
        elsa_surgery.attention_varlen(decoy(q0), decoy(k0), decoy(v0), cu0, cu0, 8, 8, **kw)
        q, k, v, cu, ref = _packed([9, 3, 8], causal=True)  # same totals, other sequences
        outs = [elsa_surgery.attention_varlen(q, k, v, cu, cu, 9, 9, **kw) for _ in range(2)]
    assert _delta(before) == {"hits": 2, "misses": 1, "bypassed": 0}
    assert [d.backend for d in log] == ["elsa"] * 3  # announced on every call
    for out in outs:
        assert rel_err(out.cpu(), ref().cpu()) < 2e-6
    # the first sight of each cu tensor is checked (cu_seqlens_q: looked up for the shortcut, then before its value
    # check; cu_seqlens_k, the same tensor, is then known), later ones not
    assert looked == [False, False, True, False, False, True, True, True]
    cu_long = cu.long()  # int64 cu_seqlens: their own entry; on its hit the known values are still converted
    for _ in range(2):
        out = elsa_surgery.attention_varlen(q, k, v, cu_long, cu_long, 9, 9, **kw)
        assert rel_err(out.cpu(), ref().cpu()) < 2e-6
    assert _delta(before) == {"hits": 3, "misses": 2, "bypassed": 0}
    with pytest.raises(ValueError, match=r"max_seqlen_q=8 is smaller than the longest sequence in cu_seqlens_q \(9\)"):
        elsa_surgery.attention_varlen(q, k, v, cu, cu, 8, 9, **kw)  # a hit; the known cu, a smaller maximum
    cu[1:3] = torch.tensor([12, 9], dtype=torch.int32)  # in place: its version moves, so it is checked again
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        elsa_surgery.attention_varlen(q, k, v, cu, cu, 12, 12, **kw)
    bad = torch.tensor([0, 5, 21], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=21 must equal k.shape\[0\] \(total_k\)=20"):
        elsa_surgery.attention_varlen(q, k, v, torch.tensor([0, 5, 20], dtype=torch.int32, device=DEV), bad, 15, 16,
                                      **kw)
    with torch.inference_mode():  # no version counter: an inference tensor's values are checked on every call
        inf = torch.tensor([0, 9, 12, 20], dtype=torch.int32, device=DEV)
        elsa_surgery.attention_varlen(q, k, v, inf, inf, 9, 9, **kw)
        inf[1] = 13
        with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
            elsa_surgery.attention_varlen(q, k, v, inf, inf, 13, 13, **kw)


def test_a_packed_direct_route_computes_the_call_on_its_own_tensors(monkeypatch):
    """A packed call seen before replays its launch plan (no validation, no dispatch), only while both cu_seqlens are
    known valid for it: a decoy call records the route; a new cu tensor is checked on the full path first, then
    taken through the route; the output matches the oracle of the caller's own tensors; the decision is announced."""
    _plans_on_cpu(monkeypatch)
    kw = dict(is_causal=True, scale=0.3)
    q0, k0, v0, cu0, _ = _packed([5, 7, 8], causal=True)
    q, k, v, cu, ref = _packed([9, 3, 8], causal=True)  # same totals, other sequences
    before, direct_before = _counts(), dict(callcache.DIRECT)
    with dispatch.record() as log:
        elsa_surgery.attention_varlen(decoy(q0), decoy(k0), decoy(v0), cu0, cu0, 9, 9, **kw)
        assert _direct_delta(direct_before) == {"runs": 0, "routes": 1}  # made by the first call
        replayed = replay.STATS["replayed"]
        first = elsa_surgery.attention_varlen(q, k, v, cu, cu, 9, 9, **kw)  # a cu tensor not seen: the full path
        assert _direct_delta(direct_before) == {"runs": 0, "routes": 1}
        out = elsa_surgery.attention_varlen(q, k, v, cu, cu, 9, 9, **kw)  # checked and unchanged: the route
        assert _direct_delta(direct_before) == {"runs": 1, "routes": 1}
        assert replay.STATS["replayed"] == replayed + 2  # the full path replayed the plan, then the route did
        out2, lse = elsa_surgery.attention_varlen(q, k, v, cu, cu, 9, 9, **kw, return_lse=True)  # its own route
        out2, lse = elsa_surgery.attention_varlen(q, k, v, cu, cu, 9, 9, **kw, return_lse=True)
    assert _direct_delta(direct_before) == {"runs": 2, "routes": 2}
    assert _delta(before) == {"hits": 3, "misses": 2, "bypassed": 0}
    assert [d.backend for d in log] == ["elsa"] * 5
    for o in (first, out, out2):
        assert rel_err(o.cpu(), ref().cpu()) < 2e-6
    assert lse.shape == (2, 20) and torch.isfinite(lse).all()
    # another pair of tensors for keys (q's cu_seqlens apart): each is checked before the route runs
    ck = torch.tensor([0, 9, 12, 20], dtype=torch.int32, device=DEV)
    for _ in range(2):
        elsa_surgery.attention_varlen(q, k, v, cu, ck, 9, 9, **kw)
    assert _direct_delta(direct_before) == {"runs": 3, "routes": 3}


def test_a_packed_route_is_not_taken_for_unchecked_values_or_other_calls(monkeypatch):
    """The route never runs what the full path would refuse or compute otherwise: cu_seqlens changed in place
    (checked again, and an invalid value raises), a maximum below the known longest sequence (raises), other
    maxima (their own route), int64 cu_seqlens, calls autograd records and dropout (no route), plans dropped."""
    _plans_on_cpu(monkeypatch)
    q, k, v, cu, ref = _packed([9, 3, 8])
    call = lambda *a, **kw: elsa_surgery.attention_varlen(q, k, v, *(a or (cu, cu, 9, 9)), scale=0.3, **kw)
    call()
    before = dict(callcache.DIRECT)
    call()
    assert _direct_delta(before) == {"runs": 1, "routes": 0}
    with pytest.raises(ValueError, match=r"max_seqlen_q=8 is smaller than the longest sequence in cu_seqlens_q"):
        call(cu, cu, 8, 9)
    call(cu, cu, 12, 9)
    out = call(cu, cu, 12, 9)  # other maxima: a route of their own, the same answer
    assert _direct_delta(before) == {"runs": 2, "routes": 1}
    assert rel_err(out.cpu(), ref().cpu()) < 2e-6
    cu[1:3] = torch.tensor([12, 9], dtype=torch.int32)  # in place: checked again on the full path
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        call()
    cu[1:3] = torch.tensor([9, 12], dtype=torch.int32)
    for _ in range(2):
        out = call(cu.long(), cu.long(), 9, 9)  # converted by the full path: no route
        call(cu, cu, 9, 9, dropout_p=0.5)  # dropout: no route
        with torch.enable_grad():
            elsa_surgery.attention_varlen(q.detach().requires_grad_(), k, v, cu, cu, 9, 9, scale=0.3)  # no route
    assert _direct_delta(before) == {"runs": 2, "routes": 1}
    assert rel_err(out.cpu(), ref().cpu()) < 2e-6
    replay.clear()  # the planner's constants changed: the route is dropped, the call decided again
    call()
    call()
    assert _direct_delta(before) == {"runs": 3, "routes": 2}


def test_every_part_of_a_packed_calls_signature_has_its_own_entry(monkeypatch):
    """Scalars (with their types), the cu_seqlens' dtype, the environment and autograd each give their own entry; a
    tensor scale, NumPy scalars and tensor subclasses are validated in full on every call (no memo entry, no direct
    route)."""
    _plans_on_cpu(monkeypatch)
    q, k, v, cu, _ = _packed([5, 7, 8])
    call = lambda *a, **kw: elsa_surgery.attention_varlen(*(a or (q, k, v)), cu, cu, 8, 8, **kw)
    before = _counts()
    call()
    call(is_causal=True)
    call(is_causal=1)
    call(scale=0.5)
    call(return_lse=True)
    call(precision="precise")
    monkeypatch.setenv("ELSA_FP32_PRECISION", "strict")
    call()
    elsa_surgery.attention_varlen(q, k, v, cu.long(), cu, 8, 8)
    call(q.detach().requires_grad_(), k, v)
    assert _delta(before) == {"hits": 0, "misses": 9, "bypassed": 0}
    for _ in range(2):
        call(scale=torch.tensor(0.25))
        call(scale=np.float64(0.25))
        call(torch.nn.Parameter(q, requires_grad=False), k, v)
    assert _delta(before) == {"hits": 0, "misses": 9, "bypassed": 6}
    call()
    assert _delta(before) == {"hits": 1, "misses": 9, "bypassed": 6}
    rkey = callcache.direct_varlen(q, k, v, cu, cu, 8, 8, False, np.float32(0.5), "auto", None, False, 0.0).key
    assert rkey[callcache._VARLEN_TYPES] == (bool, np.float32, str, type(None), bool, float)
