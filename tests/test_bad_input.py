"""Bad input: clear errors that name the argument, inputs never modified."""

import pytest
import torch

import elsa_surgery


def qkv(B=2, H=2, N=8, D=16, Hkv=None, Nk=None, Dv=None):
    return (torch.randn(B, H, N, D), torch.randn(B, Hkv or H, Nk or N, D), torch.randn(B, Hkv or H, Nk or N, Dv or D))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_integer_or_bool_inputs_raise_type_error(dtype, which):
    t = list(qkv())
    t[which] = (t[which] > 0).to(dtype)
    with pytest.raises(TypeError, match="qkv"[which]):
        elsa_surgery.attention(*t)


def test_non_tensor_raises_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        elsa_surgery.attention(q, k.tolist(), v)


def test_mixed_dtypes_raise():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype"):
        elsa_surgery.attention(q, k.double(), v)


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(3, 2, 8, 16)), "batch size"),
    (dict(v=torch.randn(2, 3, 8, 16)), "number of kv heads"),
    (dict(k=torch.randn(2, 2, 8, 12)), "head dim D"),
    (dict(v=torch.randn(2, 2, 9, 16)), "same sequence length"),
    (dict(q=torch.randn(2, 8, 16)), "same rank"),
    (dict(q=torch.randn(8, 16)), r"q must have shape"),
])
def test_mismatched_shapes_raise_value_error(bad, match):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        elsa_surgery.attention(args["q"], args["k"], args["v"])


def test_heads_not_multiple_raise():
    q, k, v = qkv(H=3, Hkv=2)
    with pytest.raises(ValueError, match=r"Hq % Hkv == 0.*Hq=3.*Hkv=2"):
        elsa_surgery.attention(q, k, v, enable_gqa=True)


def test_gqa_needs_enable_gqa():
    q, k, v = qkv(H=4, Hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        elsa_surgery.attention(q, k, v)
    assert elsa_surgery.attention(q, k, v, enable_gqa=True).shape == (2, 4, 8, 16)


@pytest.mark.parametrize("mask,match", [
    (torch.ones(2, 2, 8, 9, dtype=torch.bool), r"attn_mask of shape \[2, 2, 8, 9\] does not broadcast to \[B, Hq, Nq, Nk\] = \[2, 2, 8, 8\]"),
    (torch.ones(3, 1, 8, 8, dtype=torch.bool), "does not broadcast"),
    (torch.ones(1, 1, 1, 8, 8, dtype=torch.bool), "at most 4 dims"),
    (torch.ones(8, 8, dtype=torch.int64), "attn_mask must be bool"),
])
def test_wrong_mask_raises(mask, match):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        elsa_surgery.attention(q, k, v, mask)


def test_windowed_mask_must_divide_batch():
    q, k, v = qkv(B=6)
    with pytest.raises(ValueError, match=r"nW=4\) must divide the batch B=6"):
        elsa_surgery.attention(q, k, v, torch.zeros(4, 1, 8, 8), windowed_mask=True)


@pytest.mark.parametrize("p,err,match", [(-0.1, ValueError, r"dropout_p must lie in \[0, 1\], got -0.1"),
                                         (1.5, ValueError, r"dropout_p must lie in \[0, 1\], got 1.5"),
                                         (float("nan"), ValueError, r"dropout_p must lie in \[0, 1\]"),
                                         ("0.1", TypeError, r"dropout_p must be a number in \[0, 1\], got str")])
def test_bad_dropout_raises_clear_error(p, err, match):
    q, k, v = qkv()
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(err, match=match):
        elsa_surgery.attention(q, k, v, dropout_p=p)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))


def test_lengths_out_of_range():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"kv_lengths values must lie in \[0, 8\]"):
        elsa_surgery.attention(q, k, v, kv_lengths=[3, 9])
    with pytest.raises(ValueError, match=r"q_lengths must have shape \[B\] = \[2\]"):
        elsa_surgery.attention(q, k, v, q_lengths=[3])
    with pytest.raises(TypeError, match="q_lengths must hold integers"):
        elsa_surgery.attention(q, k, v, q_lengths=torch.tensor([1.0, 2.0]))


def test_lengths_made_under_inference_mode_are_checked_on_every_call():
    """Inference tensors have no version counter: such lengths run (session 31's H100 run raised "Inference tensors
    do not track version counter"), and an in-place change to an out-of-range value is still refused."""
    q, k, v = qkv()
    with torch.inference_mode():
        lengths = torch.tensor([3, 8])
        out = elsa_surgery.attention(q, k, v, kv_lengths=lengths)
        assert torch.equal(elsa_surgery.attention(q, k, v, kv_lengths=lengths), out)
        ref = elsa_surgery.attention(q, k, v, attn_mask=torch.arange(8) < lengths.view(2, 1, 1, 1))
        torch.testing.assert_close(out, ref)
        lengths[1] = 9
        with pytest.raises(ValueError, match=r"kv_lengths values must lie in \[0, 8\], got min 3 and max 9"):
            elsa_surgery.attention(q, k, v, kv_lengths=lengths)


def _packed(lens=(3, 5)):
    total = sum(lens)
    cu = torch.tensor([0, lens[0], total], dtype=torch.int32)
    return torch.randn(total, 2, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16), cu


def test_cu_seqlens_not_increasing():
    q, k, v, cu = _packed()
    bad = torch.tensor([0, 6, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing.*cu_seqlens_q\[1\]=6 > cu_seqlens_q\[2\]=5"):
        elsa_surgery.attention_varlen(q, k, v, bad, bad, 8, 8)


def test_cu_seqlens_total_mismatch():
    q, k, v, cu = _packed()
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=8 must equal k.shape\[0\] \(total_k\)=7"):
        elsa_surgery.attention_varlen(q, k[:7], v[:7], cu, cu, 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_q=4 is smaller than the longest sequence"):
        elsa_surgery.attention_varlen(q, k, v, cu, cu, 4, 5)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        elsa_surgery.attention_varlen(q, k, v, cu.float(), cu, 5, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[0\\] must be 0"):
        elsa_surgery.attention_varlen(q, k, v, cu + 1, cu, 5, 5)


def test_mixed_devices_raise():
    q, k, v = qkv()
    meta = torch.empty_like(k, device="meta")
    with pytest.raises(ValueError, match="one device"):
        elsa_surgery.attention(q, meta, v)
    with pytest.raises(ValueError, match="attn_mask must be on the same device"):
        elsa_surgery.attention(q, k, v, torch.ones(8, 8, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("kw,match", [
    (dict(backend="cuda"), "backend must be one of"),
    (dict(precision="fp64"), "precision must be one of"),
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(scale="big"), "scale must be a real number"),
])
def test_bad_options(kw, match):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        elsa_surgery.attention(q, k, v, **kw)


def test_env_override_validated(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setenv("ELSA_BACKEND", "fastest")
    with pytest.raises(ValueError, match="ELSA_BACKEND"):
        elsa_surgery.attention(q, k, v)


def test_errors_leave_inputs_untouched():
    q, k, v = qkv()
    saved = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError):
        elsa_surgery.attention(q, k, v, torch.ones(3, 3, dtype=torch.bool))
    elsa_surgery.attention(q, k, v, is_causal=True, q_lengths=[8, 3], kv_lengths=[8, 5], backend="reference")
    for t, s in zip((q, k, v), saved):
        assert torch.equal(t, s)


@pytest.mark.parametrize("D", [4, 12, 264])
def test_head_dim_outside_the_kernels_range(D):
    """backend='elsa' refuses naming D; auto answers (on CUDA: a fallback that says why, tests/test_sdpa_fidelity.py)."""
    q, k, v = qkv(D=D)
    saved = [t.clone() for t in (q, k, v)]
    with pytest.raises(elsa_surgery.dispatch.BackendUnavailable, match=rf"D={D}: the kernels take head dims"):
        elsa_surgery.attention(q, k, v, backend="elsa")
    assert elsa_surgery.attention(q, k, v).shape == (2, 2, 8, D)
    for t, s in zip((q, k, v), saved):
        assert torch.equal(t, s)


@pytest.mark.parametrize("shape", [(8, 16), (1, 2, 2, 8, 16)])
def test_ranks_sdpa_takes_but_we_refuse(shape):
    """SDPA takes any number of leading axes; ELSA takes 3-D and 4-D (docs/fidelity.md) and says so."""
    t = torch.randn(shape)
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, N, D\] \(or \[B, N, D\]\)"):
        elsa_surgery.attention(t, t, t)


def test_nested_tensors_are_refused_naming_the_argument():
    q = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])
    with pytest.raises(TypeError, match="q is a nested tensor: ELSA takes dense tensors"):
        elsa_surgery.attention(q, q, q)
