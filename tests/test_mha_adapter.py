"""The ``torch.mha`` and ``torch.transformer_encoder_layer`` adapters (adapters/torch_mha.py), on the CPU.

Every converted output is compared with the original module's on fresh random inputs; spies check that
neither PyTorch's SDPA nor its fused fast paths run after conversion (eval mode, no_grad: where the fast
paths trigger).
"""

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import dispatch

FAST_OPS = ("_native_multi_head_attention", "_transformer_encoder_layer_fwd")


@contextlib.contextmanager
def spy_attention_ops(monkeypatch):
    """Count calls of F.scaled_dot_product_attention and the fused fast-path ops."""
    calls = {name: 0 for name in FAST_OPS + ("sdpa",)}

    def wrap(key, fn):
        def inner(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return inner

    for name in FAST_OPS:
        monkeypatch.setattr(torch, name, wrap(name, getattr(torch, name)))
    monkeypatch.setattr(F, "scaled_dot_product_attention", wrap("sdpa", F.scaled_dot_product_attention))
    yield calls


def _close(a, b, tol=2e-5):
    assert a.shape == b.shape
    if a.numel() == 0:
        return
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _run(m, *args, **kw):
    with torch.no_grad():
        return m(*args, need_weights=False, **kw)[0]


CASES = [
    # (batch_first, kdim, vdim, bias, add_bias_kv, add_zero_attn, heads)
    (True, None, None, True, False, False, 4),
    (False, None, None, True, False, False, 2),
    (True, 12, 20, True, False, False, 4),
    (False, 12, 20, False, False, False, 4),
    (True, None, None, True, True, False, 4),
    (False, None, None, True, False, True, 4),
    (True, 12, 20, True, True, True, 2),
]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "bf{}-k{}-v{}-b{}-bkv{}-za{}-h{}".format(*c))
@pytest.mark.parametrize("masks", ["none", "bool", "float", "mixed", "3d"])
def test_mha_parity(case, masks):
    bf, kdim, vdim, bias, bkv, za, heads = case
    E, N, L, S = 32, 2, 5, 7
    m = nn.MultiheadAttention(E, heads, bias=bias, add_bias_kv=bkv, add_zero_attn=za, kdim=kdim, vdim=vdim,
                              batch_first=bf).eval()
    shape = lambda n, d: (N, n, d) if bf else (n, N, d)  # noqa: E731
    q = torch.randn(shape(L, E))
    k = torch.randn(shape(S, kdim or E))
    v = torch.randn(shape(S, vdim or E))
    kw = {}
    if masks != "none":
        kpm = torch.zeros(N, S, dtype=torch.bool)
        kpm[0, -2:] = True  # padding of the first sequence
        am = torch.rand(L, S) < 0.3
        am[:, 0] = False  # every row keeps key 0: no fully masked rows (PyTorch gives NaN there)
        if masks == "bool":
            kw = dict(key_padding_mask=kpm, attn_mask=am)
        elif masks == "float":
            kw = dict(key_padding_mask=kpm.float() * -1e4, attn_mask=torch.randn(L, S))
        elif masks == "mixed":
            kw = dict(key_padding_mask=kpm, attn_mask=torch.randn(L, S))
        else:
            am3 = torch.rand(N * heads, L, S) < 0.3
            am3[..., 0] = False
            kw = dict(attn_mask=am3)
    ref = _run(m, q, k, v, **kw)
    rep = elsa_surgery.convert(m, verify=False)
    assert rep.counts == {"torch.mha": 1}
    out = _run(m, q, k, v, **kw)
    _close(out, ref)
    assert out.dtype == ref.dtype


def test_mha_self_attention_causal_and_unbatched():
    m = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(3, 9, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(9)
    ref_c = _run(m, x, x, x, attn_mask=causal, is_causal=True)
    xu = torch.randn(9, 32)
    ref_u = _run(m, xu, xu, xu, key_padding_mask=torch.arange(9) > 6)
    elsa_surgery.convert(m, verify=False)
    with dispatch.record() as log:
        out_c = _run(m, x, x, x, attn_mask=causal, is_causal=True)
    _close(out_c, ref_c)
    out_u = _run(m, xu, xu, xu, key_padding_mask=torch.arange(9) > 6)
    _close(out_u, ref_u)
    assert out_u.shape == (9, 32)
    assert [d.backend for d in log] == ["reference"]
    with pytest.raises(RuntimeError, match="is_causal"):
        m(x, x, x, need_weights=False, is_causal=True)


def test_mha_float64_oracle():
    """The converted module in float64 equals the attention formula computed independently."""
    m = nn.MultiheadAttention(24, 3, batch_first=True, kdim=10, vdim=14).double().eval()
    elsa_surgery.convert(m, verify=False)
    q, k, v = torch.randn(2, 4, 24).double(), torch.randn(2, 6, 10).double(), torch.randn(2, 6, 14).double()
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    out = _run(m, q, k, v, key_padding_mask=kpm)
    b_q, b_k, b_v = m.in_proj_bias.chunk(3)
    qh = (q @ m.q_proj_weight.T + b_q).view(2, 4, 3, 8).transpose(1, 2)
    kh = (k @ m.k_proj_weight.T + b_k).view(2, 6, 3, 8).transpose(1, 2)
    vh = (v @ m.v_proj_weight.T + b_v).view(2, 6, 3, 8).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) / 8 ** 0.5
    s = s.masked_fill(kpm[:, None, None, :], float("-inf"))
    y = (s.softmax(-1) @ vh).transpose(1, 2).reshape(2, 4, 24)
    _close(out, m.out_proj(y), tol=1e-12)


def test_mha_state_dict_revert_and_spy(monkeypatch):
    m = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        ref = m(x, x, x, need_weights=False)[0]
    rep = elsa_surgery.convert(m, example_inputs={"query": x, "key": x, "value": x, "need_weights": False})
    assert rep.parity.passed
    assert list(m.state_dict()) == list(sd) and all(torch.equal(m.state_dict()[k], sd[k]) for k in sd)
    with spy_attention_ops(monkeypatch) as calls, torch.no_grad():
        out = m(x, x, x, need_weights=False)[0]
    assert calls == {"_native_multi_head_attention": 0, "_transformer_encoder_layer_fwd": 0, "sdpa": 0}
    _close(out, ref)
    elsa_surgery.revert(m)
    assert "forward" not in m.__dict__ and not m._forward_pre_hooks
    assert not [a for a in m.__dict__ if a.startswith("_elsa") or a.startswith("elsa")]
    with torch.no_grad():
        assert torch.equal(m(x, x, x, need_weights=False)[0], ref)


def test_mha_need_weights_runs_original_and_is_reported(caplog):
    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref_out, ref_w = m(x, x, x, average_attn_weights=False)
    elsa_surgery.convert(m, verify=False)
    with caplog.at_level(logging.WARNING, logger="elsa_surgery"), dispatch.record() as log, torch.no_grad():
        out, w = m(x, x, x, average_attn_weights=False)  # need_weights defaults to True
        m(x, x, x)
    assert w is not None and w.shape == (2, 2, 5, 5)
    assert torch.equal(w, ref_w) and torch.equal(out, ref_out)
    reason = "need_weights=True: the attention weights are requested"
    assert m.elsa_native_calls == {reason: 2}
    assert [d.backend for d in log] == ["native", "native"] and all(d.fallback for d in log)
    assert sum("need_weights=True" in r.message for r in caplog.records) <= 1  # logged once per process


def test_mha_training_dropout_runs_converted():
    """Training mode passes the module's ``dropout`` to the attention call (issue 25): no native fallback."""
    m = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True).train()
    elsa_surgery.convert(m, verify=False)
    x = torch.randn(2, 5, 16)
    with dispatch.record() as log:
        torch.manual_seed(1)
        a, _ = m(x, x, x, need_weights=False)
        torch.manual_seed(1)
        b, _ = m(x, x, x, need_weights=False)
    assert not getattr(m, "elsa_native_calls", None) and [d.backend for d in log] == ["reference"] * 2
    assert torch.equal(a, b)
    m.eval()
    ref = m(x, x, x, need_weights=False)[0]
    assert not torch.allclose(a, ref)  # the dropout was applied


def _encoder(norm_first=False, nested=True):
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_fast_path_never_escapes(monkeypatch, norm_first):
    enc = _encoder(norm_first, nested=not norm_first)
    x = torch.randn(3, 6, 32)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    with spy_attention_ops(monkeypatch) as native_calls, torch.no_grad():
        refs = [enc(x), enc(x, src_key_padding_mask=kpm), enc(x, mask=causal, is_causal=True)]
    assert native_calls["_transformer_encoder_layer_fwd"] > 0  # the spy sees the fast path
    rep = elsa_surgery.convert(enc, example_inputs=(x,))
    assert rep.counts == {"torch.transformer_encoder_layer": 2} and rep.parity.passed
    monkeypatch.undo()
    with spy_attention_ops(monkeypatch) as calls, torch.no_grad():
        outs = [enc(x), enc(x, src_key_padding_mask=kpm), enc(x, mask=causal, is_causal=True)]
    assert calls == {"_native_multi_head_attention": 0, "_transformer_encoder_layer_fwd": 0, "sdpa": 0}
    for o, r in zip(outs, refs):
        _close(o, r)
    assert all(not m.elsa_native_calls for m in enc.modules() if hasattr(m, "elsa_native_calls"))
    elsa_surgery.revert(enc)
    for layer in enc.layers:
        assert "forward" not in layer.__dict__ and "forward" not in layer.self_attn.__dict__
        assert not layer.self_attn._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(enc(x), refs[0])


def test_mha_adapter_alone_guards_the_encoder_layer(monkeypatch):
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = layer(x)
    rep = elsa_surgery.convert(layer, adapters=["torch.mha"], example_inputs=(x,))
    assert rep.counts == {"torch.mha": 1}
    with spy_attention_ops(monkeypatch) as calls, dispatch.record() as log, torch.no_grad():
        out = layer(x)
    assert calls["_transformer_encoder_layer_fwd"] == 0 and calls["sdpa"] == 0
    assert [d.backend for d in log] == ["reference"]
    _close(out, ref)


def test_deepcopy_of_converted_module_is_independent():
    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    elsa_surgery.convert(m, verify=False)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.out_proj.bias.add_(1.0)
    x = torch.randn(1, 3, 16)
    assert not torch.allclose(_run(c, x, x, x), _run(m, x, x, x))
    elsa_surgery.revert(c)
    assert "forward" not in c.__dict__


def test_bad_mask_shape_is_a_clear_error():
    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    elsa_surgery.convert(m, verify=False)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, need_weights=False, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, need_weights=False, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))


def _kernels_runnable():
    try:
        import elsa_surgery.kernels  # noqa: F401  (needs triton)
    except Exception:
        return False
    from elsa_surgery.kernels.occupancy import interpreting

    return torch.cuda.is_available() or interpreting()


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.skipif(not _kernels_runnable(), reason="the ELSA Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_mha_through_the_elsa_kernels():
    """backend='elsa': the adapter's strided q/k/v views and merged masks through the real kernels."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = nn.MultiheadAttention(32, 2, kdim=12, vdim=20, add_bias_kv=True).to(dev).eval()  # seq-first
    q, k, v = torch.randn(5, 2, 32, device=dev), torch.randn(7, 2, 12, device=dev), torch.randn(7, 2, 20, device=dev)
    kpm = torch.zeros(2, 7, dtype=torch.bool, device=dev)
    kpm[0, -2:] = True
    am = torch.randn(5, 7, device=dev)
    ref = _run(m, q, k, v, key_padding_mask=kpm, attn_mask=am)
    elsa_surgery.convert(m, backend="elsa", precision="strict", verify=False)
    with dispatch.record() as log:
        out = _run(m, q, k, v, key_padding_mask=kpm, attn_mask=am)
    assert [(d.backend, d.fallback) for d in log] == [("elsa", False)]
    _close(out, ref, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_on_gpu_uses_the_kernels(monkeypatch, dtype):
    enc = _encoder().cuda().to(dtype)
    x = torch.randn(4, 300, 32, device="cuda", dtype=dtype)
    causal = nn.Transformer.generate_square_subsequent_mask(300, device="cuda", dtype=dtype)
    with torch.no_grad():
        refs = [enc(x), enc(x, mask=causal, is_causal=True)]
    elsa_surgery.convert(enc, example_inputs=(x,))
    with spy_attention_ops(monkeypatch) as calls, dispatch.record() as log, torch.no_grad():
        outs = [enc(x), enc(x, mask=causal, is_causal=True)]
    assert calls == {"_native_multi_head_attention": 0, "_transformer_encoder_layer_fwd": 0, "sdpa": 0}
    assert {d.backend for d in log} == {"elsa"}
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for o, r in zip(outs, refs):
        _close(o.float(), r.float(), tol=tol)


def test_weights_unused_opt_in_runs_elsa_for_default_need_weights():
    from elsa_surgery.adapters.torch_mha import TorchMultiheadAttention

    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    ref = _run(m, x, x, x)
    rep = elsa_surgery.convert(m, adapters=[TorchMultiheadAttention(weights_unused=True)], verify=False)
    assert rep.counts == {"torch.mha": 1}
    with dispatch.record() as log, torch.no_grad():
        out, w = m(x, x, x)  # need_weights defaults to True
    assert w is None and [d.backend for d in log] == ["reference"] and not m.elsa_native_calls
    _close(out, ref)
    elsa_surgery.revert(m)
    assert "_elsa_weights_unused" not in m.__dict__
    with torch.no_grad():
        assert m(x, x, x)[1] is not None


# --------------------------------------------------------------------------------------------------
# drop-in fidelity (issue 30): converted modules against native ones over every mask they take
# --------------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _mha_masks(draw, N, heads, L, S, gen):
    """(key_padding_mask, attn_mask, is_causal, fully masked query rows [N, L] or None) for one call."""
    kpm_kind = draw(st.sampled_from(["none", "bool", "float"]))
    am_kind = draw(st.sampled_from(["none", "bool2", "float2", "bool3", "float3", "causal"]))
    kpm = am = None
    hidden = torch.zeros(N, heads, L, S, dtype=torch.bool)  # (query, key) pairs the masks hide
    if kpm_kind != "none":
        pad = torch.rand(N, S, generator=gen) < 0.3
        hidden |= pad[:, None, None, :]
        kpm = pad if kpm_kind == "bool" else torch.zeros(N, S).masked_fill(pad, float("-inf"))
    is_causal = False
    if am_kind == "causal":
        am = nn.Transformer.generate_square_subsequent_mask(L)[:, :S] if L == S else None
        is_causal = am is not None and draw(st.booleans())
        if am is not None:
            hidden |= am.isinf()
    elif am_kind != "none":
        shape = (L, S) if am_kind.endswith("2") else (N * heads, L, S)
        hide = torch.rand(shape, generator=gen) < 0.3
        hidden |= hide.view(-1, heads, L, S) if hide.dim() == 3 else hide
        am = hide if am_kind.startswith("bool") else torch.randn(shape, generator=gen).masked_fill(hide, float("-inf"))
    return kpm, am, is_causal, hidden.all(-1)


@st.composite
def mha_calls(draw):
    bf = draw(st.booleans())
    heads = draw(st.sampled_from([1, 2, 4]))
    N, L = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    S = draw(st.sampled_from([L, draw(st.integers(1, 6))]))
    return dict(bf=bf, heads=heads, N=N, L=L, S=S, seed=draw(st.integers(0, 2**31 - 1)),
                need_weights=draw(st.booleans()), average=draw(st.booleans()), kdim=draw(st.sampled_from([None, 12])),
                masks=draw(st.data()))


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=mha_calls())
def test_fuzz_mha_every_mask(call):
    """A converted nn.MultiheadAttention equals the native one for every mask it takes (key_padding_mask bool and
    float, attn_mask 2-D and 3-D bool and float, is_causal with its mask), need_weights, average_attn_weights and
    batch_first both ways. Rows whose every key is hidden: native gives NaN, the converted module zeros
    (docs/fidelity.md); they are compared as such."""
    gen = torch.Generator().manual_seed(call["seed"])
    E, N, L, S, heads = 16, call["N"], call["L"], call["S"], call["heads"]
    native = nn.MultiheadAttention(E, heads, batch_first=call["bf"], kdim=call["kdim"], vdim=call["kdim"]).eval()
    conv = copy.deepcopy(native)
    elsa_surgery.convert(conv, verify=False)
    kpm, am, is_causal, empty = _mha_masks(call["masks"].draw, N, heads, L, S, gen)
    shape = lambda n, d: (N, n, d) if call["bf"] else (n, N, d)  # noqa: E731
    q = torch.randn(shape(L, E), generator=gen)
    k = torch.randn(shape(S, call["kdim"] or E), generator=gen)
    kw = dict(key_padding_mask=kpm, attn_mask=am, is_causal=is_causal, need_weights=call["need_weights"],
              average_attn_weights=call["average"])
    note(f"{call} kw={kw}")
    with torch.no_grad():
        ref, ref_w = native(q, k, k, **kw)
        out, w = conv(q, k, k, **kw)
    row_empty = empty.any(1)  # [N, L]: any head of the row sees nothing (native: NaN there)
    ok = ~row_empty if call["bf"] else ~row_empty.T
    _close(out[ok], ref[ok])
    if call["need_weights"]:
        assert w is not None and w.shape == ref_w.shape
        torch.testing.assert_close(w.nan_to_num(), ref_w.nan_to_num(), equal_nan=True)
    else:
        assert w is None and ref_w is None
    if not call["need_weights"] and empty.all(1).any():  # every head of a row hidden: zeros, not NaN
        rows = empty.all(1)
        assert torch.equal(out[rows if call["bf"] else rows.T], torch.zeros_like(out[rows if call["bf"] else rows.T]))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors", "ignore:Support for mismatched")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bf=st.booleans(), norm_first=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_fuzz_encoder_layer_every_mask(bf, norm_first, seed, data):
    """A converted nn.TransformerEncoderLayer equals the native one for src_key_padding_mask (bool, float),
    src_mask (2-D, 3-D, bool, float), is_causal, batch_first both ways (no fully masked rows: the native fast path
    and slow path disagree there). The reference is the native layer's slow path (train mode, dropout 0): its fused
    eval fast path departs from it for additive float masks with finite nonzero values (0.46 max abs error on
    src_mask [[0, 0.57], [0, -inf]]; docs/fidelity.md), and the converted layer follows the documented math."""
    gen = torch.Generator().manual_seed(seed)
    N, L, heads = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 6)), 2
    native = nn.TransformerEncoderLayer(16, heads, 32, dropout=0.0, batch_first=bf, norm_first=norm_first).eval()
    conv = copy.deepcopy(native)
    elsa_surgery.convert(conv, verify=False)
    kpm, am, is_causal, empty = _mha_masks(data.draw, N, heads, L, L, gen)
    if empty.any():  # keep key 0 of every sequence visible
        if kpm is not None:
            kpm = kpm.clone()
            kpm[:, 0] = False if kpm.dtype == torch.bool else 0.0
        if am is not None and not is_causal and am.isinf().any() | (am.dtype == torch.bool):
            am = am.clone()
            am[..., 0] = False if am.dtype == torch.bool else 0.0
    x = torch.randn((N, L, 16) if bf else (L, N, 16), generator=gen)
    note(f"kpm={kpm} am={am} is_causal={is_causal}")
    with torch.no_grad():
        ref = native.train()(x, src_mask=am, src_key_padding_mask=kpm, is_causal=is_causal)
        out = conv(x, src_mask=am, src_key_padding_mask=kpm, is_causal=is_causal)
        fast = native.eval()(x, src_mask=am, src_key_padding_mask=kpm, is_causal=is_causal)
    if am is None or am.dtype == torch.bool:  # where the native fast path is right, it agrees too
        _close(out, fast, tol=5e-5)
    _close(out, ref, tol=5e-5)
