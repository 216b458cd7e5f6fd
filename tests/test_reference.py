"""The reference backend against the naive float64 statement of the semantics (tests/oracle.py), and
against PyTorch SDPA wherever SDPA defines the same thing. Property-based over shapes and masks."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elsa_surgery
from elsa_surgery import reference
from oracle import fp32_tolerance, naive_attention, rel_err

HEAD_DIMS = [8, 16, 48, 64, 72, 80, 88, 128]
FP32_TOL = 2e-6


def _layout(shape, gen, dtype, contiguous):
    """A tensor of ``shape`` [B, H, N, X]; non-contiguous ones are views of a [B, N, H, X] buffer."""
    B, H, N, X = shape
    if contiguous:
        return torch.randn(B, H, N, X, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randn(B, N, H, X, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    B = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 3]))
    hq = hkv * groups
    nq = draw(st.integers(1, 300))
    nk = draw(st.sampled_from([nq, draw(st.integers(1, 300))]))
    D = draw(st.sampled_from(HEAD_DIMS))
    Dv = draw(st.sampled_from([D, 8, 24]))
    contiguous = draw(st.booleans())
    q = _layout((B, hq, nq, D), gen, torch.float32, contiguous)
    k = _layout((B, hkv, nk, D), gen, torch.float32, contiguous)
    v = _layout((B, hkv, nk, Dv), gen, torch.float32, contiguous)
    mask_kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask = None
    if mask_kind != "none":
        # broadcast along any subset of axes (size 1), and possibly fewer than 4 dims
        shape = [B if draw(st.booleans()) else 1, hq if draw(st.booleans()) else 1,
                 nq if draw(st.booleans()) else 1, nk]
        if draw(st.booleans()) and shape[0] == 1:
            shape = shape[1:]
        if mask_kind == "bool":
            mask = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.5, 0.9]))
            if draw(st.booleans()):  # some fully masked rows
                mask[..., 0, :] = False
        else:
            mask = torch.randn(shape, generator=gen, dtype=torch.float64).float()
            mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    lengths = draw(st.booleans())
    q_lengths = torch.randint(0, nq + 1, (B,), generator=gen) if lengths else None
    kv_lengths = torch.randint(0, nk + 1, (B,), generator=gen) if lengths else None
    return dict(q=q, k=k, v=v, mask=mask, is_causal=draw(st.booleans()),
                scale=draw(st.sampled_from([None, 1.0, 0.3])), q_lengths=q_lengths, kv_lengths=kv_lengths)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_reference_fp32_matches_float64_oracle(pb):
    q, k, v = pb["q"], pb["k"], pb["v"]
    before = [t.clone() for t in (q, k, v)]
    kw = dict(is_causal=pb["is_causal"], scale=pb["scale"], q_lengths=pb["q_lengths"], kv_lengths=pb["kv_lengths"])
    out, lse = elsa_surgery.attention(q, k, v, pb["mask"], enable_gqa=True, backend="reference", return_lse=True, **kw)
    ref, ref_lse = naive_attention(q, k, v, pb["mask"], **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= fp32_tolerance(q, k, pb["scale"])
    # lse: -inf exactly where no key is visible, close elsewhere
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-5)
    # the float64 reference agrees with the naive oracle to rounding
    out64 = elsa_surgery.attention(q.double(), k.double(), v.double(), pb["mask"] if pb["mask"] is None or pb["mask"].dtype == torch.bool else pb["mask"].double(),
                                   enable_gqa=True, backend="reference", **kw)
    assert rel_err(out64, ref) <= 1e-12
    for t, b in zip((q, k, v), before):  # inputs untouched
        assert torch.equal(t, b)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), D=st.sampled_from(HEAD_DIMS),
       causal=st.booleans(), gqa=st.sampled_from([1, 2, 4]), mask_kind=st.sampled_from(["none", "bool", "additive"]))
def test_reference_agrees_with_sdpa(seed, n, D, causal, gqa, mask_kind):
    """Where SDPA defines the same thing: Nq == Nk (top-left == bottom-right), rows with a visible key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * gqa, n, D, generator=g)
    k = torch.randn(2, 2, n, D, generator=g)
    v = torch.randn(2, 2, n, D, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, n, n, generator=g) < 0.7
        mask[..., :, 0] = True  # every row keeps a key (SDPA returns NaN otherwise)
        if causal:
            mask = None
    elif mask_kind == "additive":
        mask = torch.randn(1, 2 * gqa, n, n, generator=g)
        causal = False  # SDPA rejects is_causal with an explicit mask
    ours = elsa_surgery.attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa > 1, backend="reference")
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa > 1)
    assert rel_err(ours, theirs) < 1e-5
    sdpa_backend = elsa_surgery.attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa > 1, backend="sdpa")
    assert rel_err(sdpa_backend, theirs) < 1e-6


def test_sdpa_backend_follows_our_semantics():
    """backend='sdpa' is a baseline: bottom-right causal, zeros for empty rows, lengths and windows honoured."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 2, 5, 16, generator=g)
    k = torch.randn(4, 2, 9, 16, generator=g)
    v = torch.randn(4, 2, 9, 16, generator=g)
    win = torch.rand(2, 1, 5, 9, generator=g) < 0.6
    win[0, 0, 1] = False  # an empty row
    kw = dict(is_causal=True, q_lengths=[5, 4, 3, 0], kv_lengths=[9, 2, 7, 4])
    ours = elsa_surgery.attention(q, k, v, win, windowed_mask=True, backend="sdpa", **kw)
    ref, _ = naive_attention(q, k, v, win, windowed=True, **kw)
    assert not torch.isnan(ours).any()
    assert rel_err(ours, ref) < 1e-6


def test_windowed_mask_matches_expanded_mask():
    g = torch.Generator().manual_seed(2)
    nW, n, H = 4, 49, 3
    q, k, v = (torch.randn(2 * nW, H, n, 32, generator=g) for _ in range(3))
    bias = torch.randn(nW, H, n, n, generator=g)
    bias[:, :, :, :5] = float("-inf")
    out = elsa_surgery.attention(q, k, v, bias, windowed_mask=True, backend="reference")
    expanded = bias.repeat(2, 1, 1, 1)  # row b uses window b % nW
    ref, _ = naive_attention(q, k, v, expanded)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence(causal):
    g = torch.Generator().manual_seed(3)
    lens_q = [5, 0, 37, 1, 64]
    lens_k = [7, 3, 37, 20, 50]
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 16, generator=g)
    k = torch.randn(sum(lens_k), 2, 16, generator=g)
    v = torch.randn(sum(lens_k), 2, 24, generator=g)
    out, lse = elsa_surgery.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), is_causal=causal,
                                             backend="reference", return_lse=True)
    assert out.shape == (sum(lens_q), 4, 24) and lse.shape == (4, sum(lens_q))
    for b in range(len(lens_q)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref, ref_lse = naive_attention(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                       v[ks].transpose(0, 1)[None], is_causal=causal)
        assert rel_err(out[qs], ref[0].transpose(0, 1)) < FP32_TOL
        fin = torch.isfinite(ref_lse[0])
        assert torch.allclose(lse[:, qs][fin].double(), ref_lse[0][fin], atol=1e-5)


def test_padded_lengths_equal_packed_varlen():
    g = torch.Generator().manual_seed(4)
    lens = [3, 17, 9]
    N = 17
    q, k, v = (torch.randn(3, 2, N, 16, generator=g) for _ in range(3))
    padded = elsa_surgery.attention(q, k, v, is_causal=True, q_lengths=lens, kv_lengths=lens, backend="reference")
    cu = torch.tensor([0, 3, 20, 29], dtype=torch.int32)
    pack = lambda t: torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])
    packed = elsa_surgery.attention_varlen(pack(q), pack(k), pack(v), cu, cu, N, N, is_causal=True, backend="reference")
    assert rel_err(pack(padded), packed) < 1e-7
    for b, n in enumerate(lens):  # padding query rows are zeros
        assert torch.count_nonzero(padded[b, :, n:]) == 0


def test_bottom_right_causal_decode_step():
    """One query against a KV cache sees every key (bottom-right); SDPA's top-left would see only key 0."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    causal = elsa_surgery.attention(q, k, v, is_causal=True, backend="reference")
    full = elsa_surgery.attention(q, k, v, backend="reference")
    assert torch.allclose(causal, full)
    # Nq > Nk: the first Nq - Nk query rows see no key -> zeros, never NaN
    q2 = torch.randn(1, 2, 12, 16, generator=g)
    out = elsa_surgery.attention(q2, k, v, is_causal=True, backend="reference")
    assert torch.count_nonzero(out[:, :, :2]) == 0 and not torch.isnan(out).any()


def test_scale_one_and_three_d_inputs():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 11, 8, generator=g) for _ in range(3))
    out = elsa_surgery.attention(q, k, v, scale=1.0, backend="reference")
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert out.shape == (3, 11, 8) and rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_reference_dtypes(dtype):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g) for _ in range(3))
    out = elsa_surgery.attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="reference")
    ref, _ = naive_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    assert rel_err(out, ref) < {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-13}[dtype]


def test_chunking_covers_every_row_and_key(monkeypatch):
    """Tiny chunks force many query and key blocks, including ragged last ones."""
    monkeypatch.setattr(reference, "SCORE_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(reference, "MIN_CHUNK", 5)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 2, 47, 16, generator=g)
    k, v = torch.randn(2, 2, 53, 16, generator=g), torch.randn(2, 2, 53, 16, generator=g)
    for causal in (False, True):
        out = elsa_surgery.attention(q, k, v, is_causal=causal, q_lengths=[47, 30], kv_lengths=[53, 41], backend="reference")
        ref, _ = naive_attention(q, k, v, is_causal=causal, q_lengths=[47, 30], kv_lengths=[53, 41])
        assert rel_err(out, ref) < FP32_TOL


def test_nan_propagates():
    q, k, v = (torch.randn(1, 1, 8, 8) for _ in range(3))
    k[0, 0, 3, 0] = float("nan")
    out = elsa_surgery.attention(q, k, v, backend="reference")
    assert torch.isnan(out).all()


def test_empty_sequences():
    q = torch.randn(2, 2, 0, 16)
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 8)
    out = elsa_surgery.attention(q, k, v, backend="reference")
    assert out.shape == (2, 2, 0, 8)
    q = torch.randn(2, 2, 4, 16)
    k, v = torch.randn(2, 2, 0, 16), torch.randn(2, 2, 0, 8)
    out, lse = elsa_surgery.attention(q, k, v, backend="reference", return_lse=True)
    assert out.shape == (2, 2, 4, 8) and torch.count_nonzero(out) == 0 and torch.isinf(lse).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 120)), min_size=1, max_size=5),
       D=st.sampled_from(HEAD_DIMS), groups=st.sampled_from([1, 2]), causal=st.booleans(), scale=st.sampled_from([None, 1.0]))
def test_varlen_fp32_matches_float64_oracle(seed, lens, D, groups, causal, scale):
    g = torch.Generator().manual_seed(seed)
    lq = [a for a, _ in lens]
    lk = [b for _, b in lens]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 2 * groups, D, generator=g)
    k = torch.randn(sum(lk), 2, D, generator=g)
    v = torch.randn(sum(lk), 2, 16, generator=g)
    out = elsa_surgery.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), is_causal=causal, scale=scale,
                                        backend="reference")
    assert not torch.isnan(out).any()
    for b in range(len(lens)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref, _ = naive_attention(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                 v[ks].transpose(0, 1)[None], is_causal=causal, scale=scale)
        assert rel_err(out[qs], ref[0].transpose(0, 1)) <= fp32_tolerance(q, k, scale)


def test_dropout_follows_sdpa_semantics(monkeypatch):
    """Attention dropout on the reference backend (where ``auto`` sends it): each probability kept with chance
    ``1 - p`` and scaled by ``1 / (1 - p)``, the normaliser left alone. Exact checks with one visible key per
    row (a row is 0 or v / (1 - p)); over many draws the mean is the dropout-free output; p = 1 gives zeros,
    p = 0 the plain result; masked rows stay zero; several score chunks draw independent masks."""
    B, H, N, D = 2, 3, 24, 8
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    eye = torch.eye(N, dtype=torch.bool)  # one visible key per row: the softmax is 1 on it
    out = elsa_surgery.attention(q, k, v, eye, dropout_p=0.25, backend="reference")
    kept = torch.isclose(out, v / 0.75).all(-1)
    dropped = (out == 0).all(-1)
    assert bool((kept | dropped).all()) and 0 < int(dropped.sum()) < kept.numel()

    plain = elsa_surgery.attention(q, k, v, backend="reference")
    assert torch.equal(elsa_surgery.attention(q, k, v, dropout_p=0.0, backend="reference"), plain)
    assert torch.equal(elsa_surgery.attention(q, k, v, dropout_p=1.0, backend="reference"), torch.zeros_like(plain))
    monkeypatch.setattr(reference, "SCORE_BLOCK_ELEMENTS", 64)  # many q/k chunks per call
    monkeypatch.setattr(reference, "MIN_CHUNK", 4)
    draws = torch.stack([elsa_surgery.attention(q, k, v, dropout_p=0.5, backend="reference") for _ in range(400)])
    assert (draws[0] != draws[1]).any()
    se = draws.std(0) / 400 ** 0.5
    assert bool(((draws.mean(0) - plain).abs() <= 5 * se + 1e-12).all())

    mask = torch.ones(B, 1, N, N, dtype=torch.bool)
    mask[:, :, 3] = False  # row 3 sees no key
    out = elsa_surgery.attention(q, k, v, mask, dropout_p=0.3, backend="reference")
    assert not out.isnan().any() and bool((out[:, :, 3] == 0).all())


def test_sdpa_backend_passes_dropout_through():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    torch.manual_seed(3)
    got = elsa_surgery.attention(q, k, v, dropout_p=0.4, backend="sdpa")
    torch.manual_seed(3)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, dropout_p=0.4))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_reference_is_differentiable(dropout_p):
    """The reference backend (where ``auto`` sends training calls with dropout) supports backward:
    float64 gradcheck through masks, causal and GQA, the dropout mask drawn from a fixed seed inside the
    function; without dropout the gradients equal SDPA's."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 1, 6, 9, dtype=torch.float64)
    mask[..., 0, :] = float("-inf")  # a row with no key: zeros, zero gradient, no NaN

    def f(q, k, v):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            return elsa_surgery.attention(q, k, v, mask, dropout_p=dropout_p, is_causal=True, enable_gqa=True,
                                          backend="reference")

    assert torch.autograd.gradcheck(f, (q, k, v))
    if dropout_p == 0.0:
        f(q, k, v).square().sum().backward()
        got = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        additive = mask.masked_fill(~torch.ones(6, 9, dtype=torch.bool).tril(9 - 6), float("-inf"))
        sdpa = F.scaled_dot_product_attention(q, k, v, additive, enable_gqa=True).nan_to_num(0.0)
        sdpa.square().sum().backward()
        for a, t in zip(got, (q, k, v)):
            assert torch.allclose(a, t.grad, atol=1e-10), (a - t.grad).abs().max()
