"""ELSA Triton kernels against the float64 oracle (the package's reference backend at float64).

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported).
Note: the interpreter evaluates every ``tl.dot`` in numpy fp32 whatever its ``input_precision``, so on
CPU ``turbo`` (TF32) and ``precise`` (3xTF32) show strict-like errors; their own error budgets are
checked on the GPU (tests/test_kernels_gpu.py). Outputs are checked through poisoned (NaN-filled)
preallocated buffers, so an element the kernel forgets to write fails the test.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are decorated (kernels/scan.py is imported lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import elsa_surgery
from elsa_surgery import dispatch, monoid
from elsa_surgery.kernels import knobs, launch, unsupported_reason

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"strict": 2e-6, "precise": 2e-6, "turbo": 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    d = ref.norm()
    return float((x - ref).norm() / d) if d > 0 else float((x - ref).norm())


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).to(DEV)


def oracle(q, k, v, mask=None, **kw):
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return elsa_surgery.attention(q.double(), k.double(), v.double(), mask, backend="reference",
                                  return_lse=True, enable_gqa=True, **kw)


def poisoned_run(q, k, v, *, scale=None, mask=None, is_causal=False, q_lengths=None, kv_lengths=None,
                 precision="strict", num_partitions=None):
    B, Hq, Nq, D = q.shape
    out = torch.full((B, Hq, Nq, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32, device=q.device)
    scale = D ** -0.5 if scale is None else scale
    launch.attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths,
                     kv_lengths=kv_lengths, precision=precision if q.dtype == torch.float32 else None,
                     return_lse=True, out=out, lse=lse, num_partitions=num_partitions)
    return out, lse


def check(out, lse, ref_out, ref_lse, tol):
    assert not torch.isnan(out).any(), "NaN (or an unwritten element) in out"
    assert not torch.isnan(lse).any(), "NaN (or an unwritten element) in lse"
    assert rel(out, ref_out) <= tol, rel(out, ref_out)
    fin = torch.isfinite(ref_lse.cpu())
    assert torch.equal(torch.isfinite(lse.cpu()), fin), "lse -inf pattern differs from the oracle"
    if fin.any():
        assert rel(lse.cpu()[fin], ref_lse.cpu()[fin]) <= max(tol, 1e-6)


@pytest.mark.parametrize("mode", ["strict", "precise", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nq,nk,causal", [(77, 77, True), (197, 1041, False), (1374, 77, True)])
def test_sequence_lengths_from_the_issue(nq, nk, causal, mode):
    """The lengths the issue names (77: CLIP text, 197: ViT, 1041: VGGT frame, 1374: DINOv2 at 518 px), as
    query and key lengths, causal (bottom-right; 1374 queries over 77 keys leaves rows with no key) or not."""
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = rand(1, 1, nq, 8, dtype=dtype), rand(1, 1, nk, 8, dtype=dtype), rand(1, 1, nk, 16, dtype=dtype)
    out, lse = poisoned_run(q, k, v, is_causal=causal, precision=mode if dtype == torch.float32 else None)
    check(out, lse, *oracle(q, k, v, is_causal=causal), TOL[mode])


@pytest.mark.parametrize("mode", ["strict", "precise", "turbo", torch.float16, torch.bfloat16])
def test_dtypes_and_modes(mode):
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = rand(1, 2, 150, 64, dtype=dtype), rand(1, 2, 170, 64, dtype=dtype), rand(1, 2, 170, 64, dtype=dtype)
    out, lse = poisoned_run(q, k, v, precision=mode if dtype == torch.float32 else None)
    assert out.dtype == dtype
    check(out, lse, *oracle(q, k, v), TOL[mode])


@pytest.mark.parametrize("d,dv", [(8, 8), (48, 48), (72, 40), (80, 80), (88, 24), (104, 104), (256, 16)])
def test_head_dims_padded_in_kernel(d, dv):
    q, k, v = rand(1, 1, 33, d), rand(1, 1, 47, d), rand(1, 1, 47, dv)
    out, lse = poisoned_run(q, k, v)
    check(out, lse, *oracle(q, k, v), TOL["strict"])


@pytest.mark.parametrize("nq,nk", [(70, 70), (40, 100), (100, 40)])
def test_causal_bottom_right(nq, nk):
    q, k, v = rand(2, 2, nq, 32), rand(2, 2, nk, 32), rand(2, 2, nk, 32)
    out, lse = poisoned_run(q, k, v, is_causal=True)
    ro, rl = oracle(q, k, v, is_causal=True)
    check(out, lse, ro, rl, TOL["strict"])
    if nq > nk:  # the first nq - nk rows see no key: zeros and -inf
        assert torch.all(out[:, :, : nq - nk] == 0) and torch.all(lse[:, :, : nq - nk] == float("-inf"))


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_and_noncontiguous(hkv):
    B, Hq, N, D = 2, 4, 57, 40
    q = rand(B, N, Hq, D).transpose(1, 2)  # [B, Hq, N, D] view of a [B, N, H, D] buffer
    kv = rand(B, N, 2, hkv, D)  # fused k/v buffer: strided views, never copied
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = poisoned_run(q, k, v, scale=1.0)
    check(out, lse, *oracle(q, k, v, scale=1.0), TOL["strict"])


def test_bool_mask_broadcast_and_fully_masked_rows():
    B, H, Nq, Nk = 2, 2, 45, 60
    q, k, v = rand(B, H, Nq, 32), rand(B, H, Nk, 32), rand(B, H, Nk, 32)
    mask = torch.rand(B, 1, Nq, Nk, device=DEV) > 0.4
    mask[:, :, 3] = False  # a row with no visible key
    canon = mask.expand(B, H, Nq, Nk)
    out, lse = poisoned_run(q, k, v, mask=canon)
    ro, rl = oracle(q, k, v, mask)
    check(out, lse, ro, rl, TOL["strict"])
    assert torch.all(out[:, :, 3] == 0)


@pytest.mark.parametrize("mdtype", [torch.float32, torch.float16, torch.bfloat16])
def test_additive_mask_with_inf_and_key_padding(mdtype):
    B, H, Nq, Nk = 2, 3, 40, 75
    q, k, v = rand(B, H, Nq, 16), rand(B, H, Nk, 16), rand(B, H, Nk, 16)
    bias = torch.randn(1, H, Nq, Nk, device=DEV).to(mdtype)
    bias[..., 50:] = float("-inf")
    bias[0, 1, 7] = float("-inf")  # fully masked row
    out, lse = poisoned_run(q, k, v, mask=bias.expand(B, H, Nq, Nk))
    check(out, lse, *oracle(q, k, v, bias), TOL["strict"])
    # key-padding style [B, 1, 1, Nk] mask (stride 0 over heads and rows) with torch.finfo.min
    pad = torch.zeros(B, 1, 1, Nk, device=DEV)
    pad[1, ..., 30:] = torch.finfo(torch.float32).min
    out, lse = poisoned_run(q, k, v, mask=pad.expand(B, 1, Nq, Nk))
    check(out, lse, *oracle(q, k, v, pad), TOL["strict"])


@pytest.mark.parametrize("mode", ["strict", "precise", torch.float16])
def test_rows_masked_with_finfo_min_average_their_keys(mode):
    """A finite ``torch.finfo.min`` mask hides nothing: a row masked that way everywhere averages its keys'
    V (as SDPA and the reference do), a row with one key at 0 reads that key's V, no NaN; the kernels floor
    such values at -2.3e38 (semantics.py), so the lse of the fully ``finfo.min`` row is finite and about
    -2.3e38 rather than the reference's -3.4e38."""
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = rand(1, 2, 6, 16, dtype=dtype), rand(1, 2, 40, 16, dtype=dtype), rand(1, 2, 40, 16, dtype=dtype)
    mask = torch.zeros(1, 1, 6, 40, device=DEV, dtype=dtype)
    mask[..., 2, :] = torch.finfo(dtype).min
    mask[..., 4, 1:] = torch.finfo(dtype).min
    out, lse = poisoned_run(q, k, v, mask=mask, precision=mode if dtype == torch.float32 else None)
    ro, rl = oracle(q, k, v, mask)
    tol = TOL[mode]
    assert not out.isnan().any() and rel(out, ro) <= tol
    assert rel(out[..., 4, :], v[..., 0, :]) <= tol
    if dtype == torch.float32:  # fp32's finfo.min absorbs the logits: uniform weights (fp16's -65504 does not)
        assert rel(out[..., 2, :], v.mean(2)) <= tol
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = dtype != torch.float32  # fp16's finfo.min (-65504) is above the floor: exact lse there too
    assert rel(lse[..., keep], rl[..., keep]) <= max(tol, 1e-6)
    if dtype == torch.float32:
        assert torch.isfinite(lse[..., 2]).all() and bool((lse[..., 2] - (-2.3e38)).abs().max() < 1e33)


def test_windowed_mask_swin_through_api():
    nW, Bimg, H, N = 4, 2, 2, 49
    B = nW * Bimg
    q, k, v = rand(B, H, N, 32), rand(B, H, N, 32), rand(B, H, N, 32)
    wmask = torch.where(torch.rand(nW, 1, N, N, device=DEV) > 0.3, 0.0, -100.0)
    with dispatch.record() as log:
        out = elsa_surgery.attention(q, k, v, wmask, windowed_mask=True, backend="elsa", precision="strict")
    assert log[-1].backend == "elsa"
    ro = elsa_surgery.attention(q.double(), k.double(), v.double(), wmask.double(), windowed_mask=True,
                                backend="reference")
    assert rel(out, ro) <= TOL["strict"]


def test_padded_lengths_causal():
    B, H, N = 3, 2, 70
    q, k, v = rand(B, H, N, 24), rand(B, H, N + 10, 24), rand(B, H, N + 10, 24)
    ql = torch.tensor([70, 33, 0], dtype=torch.int32, device=DEV)
    kl = torch.tensor([80, 41, 12], dtype=torch.int32, device=DEV)
    for causal in (False, True):
        out, lse = poisoned_run(q, k, v, is_causal=causal, q_lengths=ql, kv_lengths=kl)
        ro, rl = oracle(q, k, v, is_causal=causal, q_lengths=ql, kv_lengths=kl)
        check(out, lse, ro, rl, TOL["strict"])
        assert torch.all(out[1, :, 33:] == 0) and torch.all(out[2] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_partitioned_scan_matches(causal):
    """The two-level scan (phase 1 over 3 K-partitions + phase 2 merge) equals the oracle."""
    q, k, v = rand(1, 2, 64, 32), rand(1, 2, 150, 32), rand(1, 2, 150, 24)
    mask = torch.rand(1, 1, 64, 150, device=DEV) > 0.2
    mask[..., 5, :] = False
    out, lse = poisoned_run(q, k, v, is_causal=causal, mask=mask.expand(1, 2, 64, 150), num_partitions=3)
    check(out, lse, *oracle(q, k, v, mask, is_causal=causal), TOL["strict"])
    ql = torch.tensor([50], dtype=torch.int32, device=DEV)
    out, lse = poisoned_run(q, k, v, is_causal=causal, q_lengths=ql, num_partitions=4)
    check(out, lse, *oracle(q, k, v, is_causal=causal, q_lengths=ql), TOL["strict"])


@pytest.mark.parametrize("parts", [1, 3])
def test_state_merges_with_monoid(parts):
    q, k, v = rand(2, 2, 40, 32), rand(2, 1, 130, 32), rand(2, 1, 130, 16)
    scale = 32 ** -0.5
    full = launch.attention_state(q, k, v, scale=scale, precision="strict", num_partitions=parts)
    ref = elsa_surgery.attention_state(q.double(), k.double(), v.double(), backend="reference")
    fin_k = monoid.finalize(monoid.State(*full))
    fin_r = monoid.finalize(ref)
    assert rel(fin_k[0], fin_r[0]) <= TOL["strict"] and rel(fin_k[1], fin_r[1]) <= TOL["strict"]
    # states over two disjoint key halves merge to the whole (through the public API)
    a = elsa_surgery.attention_state(q, k[:, :, :70], v[:, :, :70], backend="elsa", precision="strict")
    b = elsa_surgery.attention_state(q, k[:, :, 70:], v[:, :, 70:], backend="elsa", precision="strict")
    merged = monoid.finalize(monoid.merge(a, b))
    assert rel(merged[0], fin_r[0]) <= TOL["strict"]
    assert not any(torch.isnan(t).any() for t in full)


@pytest.mark.parametrize("mode", ["turbo", torch.bfloat16])
def test_blocked_pv_for_rows_of_many_keys(mode, monkeypatch):
    """Rows of more than ELSA_BLOCKED_PV_KEYS keys a program add each key block's P·V with a round-to-nearest add
    (scan's BLOCKED_PV; session 27's 32M stream, occupancy.blocked_pv): the decision, and the kernel with it forced
    on (the knob at 0) against float64, dense with partitions and as states (a stream task's call)."""
    from elsa_surgery.kernels import occupancy as occ
    from elsa_surgery.kernels import replay

    assert occ.blocked_pv(occ.DOT_LOWP, (1 << 20) + 1) and not occ.blocked_pv(occ.DOT_LOWP, 1 << 20)
    assert not occ.blocked_pv(occ.DOT_IEEE, 1 << 30) and not occ.blocked_pv(occ.DOT_F16X3, 1 << 30)
    seen = []
    real = replay.launch

    def spy(fn, grid, *args, **kwargs):
        if "CHUNKED" in kwargs:  # scan.elsa_fwd's launches (not phase 2's merge)
            seen.append(kwargs.get("BLOCKED_PV"))
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(replay, "launch", spy)
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    precision = None if isinstance(mode, torch.dtype) else mode
    q, k, v = rand(1, 2, 70, 32, dtype=dtype), rand(1, 2, 150, 32, dtype=dtype), rand(1, 2, 150, 24, dtype=dtype)
    out, lse = poisoned_run(q, k, v, is_causal=True, precision=precision, num_partitions=2)
    assert seen and not any(seen)  # 75 keys a partition: the tensor cores' chain
    monkeypatch.setenv(knobs.BLOCKED_PV_KEYS, "0")
    assert occ.blocked_pv(occ.DOT_TF32, 1)
    seen.clear()
    out, lse = poisoned_run(q, k, v, is_causal=True, precision=precision, num_partitions=2)
    assert seen and all(seen)
    check(out, lse, *oracle(q, k, v, is_causal=True), TOL[mode])
    seen.clear()
    state = launch.attention_state(q, k, v, scale=32 ** -0.5, precision=precision)
    assert seen and all(seen)
    ref = monoid.finalize(elsa_surgery.attention_state(q.double(), k.double(), v.double(), backend="reference"))
    assert rel(monoid.finalize(monoid.State(*state))[0], ref[0]) <= TOL[mode]


@pytest.mark.parametrize("causal,parts", [(False, 1), (True, 1), (True, 2)])
def test_varlen_packed(causal, parts):
    lens_q = [37, 0, 90, 5]
    lens_k = [37, 10, 120, 5] if causal else [50, 3, 90, 0]
    Hq, Hkv, D = 4, 2, 32
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = rand(sum(lens_q), Hq, D), rand(sum(lens_k), Hkv, D), rand(sum(lens_k), Hkv, 16)
    out = torch.full((q.shape[0], Hq, 16), float("nan"), device=DEV)
    lse = torch.full((Hq, q.shape[0]), float("nan"), device=DEV)
    launch.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), scale=D ** -0.5, is_causal=causal,
                            precision="strict", out=out, lse=lse, num_partitions=parts)
    ro, rl = elsa_surgery.attention_varlen(q.double(), k.double(), v.double(), cq, ck, max(lens_q), max(lens_k),
                                           is_causal=causal, backend="reference", return_lse=True)
    check(out, lse, ro, rl, TOL["strict"])
    # through the public API (custom op)
    o2, l2 = elsa_surgery.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), is_causal=causal,
                                           backend="elsa", precision="strict", return_lse=True)
    check(o2, l2, ro, rl, TOL["strict"])


def test_api_return_lse_and_dispatch():
    q, k, v = rand(1, 2, 30, 16), rand(1, 2, 30, 16), rand(1, 2, 30, 16)
    with dispatch.record() as log:
        out, lse = elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa", precision="strict",
                                          return_lse=True)
    assert log[-1].backend == "elsa" and log[-1].precision == "strict"
    check(out, lse, *oracle(q, k, v, is_causal=True), TOL["strict"])


def test_unsupported_reasons(monkeypatch):
    q = torch.randn(1, 1, 4, 64)
    assert unsupported_reason(q, q, q, None) is None
    assert "float64" in unsupported_reason(q.double(), q.double(), q.double(), None)
    big = torch.randn(1, 1, 4, 264)
    assert "D=264" in unsupported_reason(big, big, big, None)
    odd = torch.randn(1, 1, 4, 12)
    assert "multiples of 8" in unsupported_reason(odd, odd, odd, None)
    assert "Dv=300" in unsupported_reason(q, q, torch.randn(1, 1, 4, 300), None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in unsupported_reason(q, q, q, None)


def test_fake_impls_shapes():
    """The custom ops' fake implementations (what torch.compile traces) give the real shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elsa_surgery.kernels import ops

    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 33, 16), torch.empty(2, 2, 40, 16), torch.empty(2, 2, 40, 8)
        out, lse = ops.attention_op(q, k, v, None, None, None, 0.25, True, "strict")
        assert out.shape == (2, 4, 33, 8) and lse.shape == (2, 4, 33) and lse.dtype == torch.float32
        # the real op's layout (what compiled code indexes by): [B, Nq, Hq, Dv] in memory where ops.STRIDED_OUTPUT
        assert out.stride() == ((33 * 4 * 8, 8, 4 * 8, 1) if ops.STRIDED_OUTPUT else (4 * 33 * 8, 33 * 8, 8, 1))
        m, S, W = ops.attention_state_op(q, k, v, None, None, None, 0.25, False, "")
        assert m.shape == (2, 4, 33) and W.shape == (2, 4, 33, 8)
        cu = torch.empty(3, dtype=torch.int32)
        o, l = ops.attention_varlen_op(torch.empty(20, 4, 16), torch.empty(30, 2, 16), torch.empty(30, 2, 8),
                                       cu, cu, 10, 15, 0.25, False, "")
        assert o.shape == (20, 4, 8) and l.shape == (4, 20)


def test_output_layout_makes_the_head_merge_a_view():
    """The eager dense output is [B, Nq, Hq, Dv] in memory (as SDPA flash/cuDNN): the usual
    ``out.transpose(1, 2).reshape(B, N, H * Dv)`` is a view of the kernel's output, not a copy. The custom op
    (torch.compile's path) returns the same layout where ``ops.STRIDED_OUTPUT`` holds (torch >= 2.11; contiguous
    below), and its fake implementation says so (test_fake_impls_shapes)."""
    from elsa_surgery.kernels import ops

    q, k, v = rand(2, 3, 20, 16), rand(2, 3, 20, 16), rand(2, 3, 20, 8)
    out = elsa_surgery.attention(q, k, v, backend="elsa")
    merged = out.transpose(1, 2).reshape(2, 20, 24)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None
    assert out.stride() == (20 * 3 * 8, 8, 3 * 8, 1)
    real, _ = ops.attention_op(q, k, v, None, None, None, 0.25, False, "strict")
    assert real.stride() == (out.stride() if ops.STRIDED_OUTPUT else (3 * 20 * 8, 20 * 8, 8, 1))
    assert rel(real, out) == 0
    assert rel(out, oracle(q, k, v)[0]) <= TOL["strict"]


def test_custom_ops_real_impl_and_compile():
    """The torch.library ops run the kernels, and a compiled caller (fullgraph) goes through them."""
    from elsa_surgery.kernels import ops

    q, k, v = rand(1, 2, 40, 16), rand(1, 1, 50, 16), rand(1, 1, 50, 8)
    out, lse = ops.attention_op(q, k, v, None, None, None, 0.25, True, "strict")
    ro, rl = oracle(q, k, v, is_causal=True, scale=0.25)
    check(out, lse, ro, rl, TOL["strict"])
    m, S, W = ops.attention_state_op(q, k, v, None, None, None, 0.25, True, "strict")
    assert rel(monoid.finalize(monoid.State(m, S, W))[0], ro) <= TOL["strict"]

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = lambda q, k, v: elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa", precision="strict",
                                               enable_gqa=True) * 2
    cf = torch.compile(f, fullgraph=True, backend="eager")
    for n in (20, 33, 47):
        qn, kn, vn = rand(1, 2, n, 16), rand(1, 1, n, 16), rand(1, 1, n, 8)
        assert rel(cf(qn, kn, vn), oracle(qn, kn, vn, is_causal=True)[0] * 2) <= TOL["strict"]
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("kind", ["bool", "float", "windowed", "kv_lengths"])
def test_compile_does_not_recompile_across_lengths(kind):
    """Masked, windowed and padded-length calls compile once per static/dynamic pair, not once per length
    (formatting a symbolic size, e.g. in an error message built eagerly, would specialise it)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def f(q, k, v, extra):
        if kind == "kv_lengths":
            return elsa_surgery.attention(q, k, v, backend="elsa", precision="strict", kv_lengths=extra)
        return elsa_surgery.attention(q, k, v, extra, backend="elsa", precision="strict",
                                      windowed_mask=kind == "windowed")

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, fullgraph=True, backend="eager")
    for n in (20, 33, 47, 58):
        q, k, v = rand(2, 2, n, 16), rand(2, 2, n + 3, 16), rand(2, 2, n + 3, 8)
        g = torch.Generator().manual_seed(n)
        if kind == "bool":
            extra = (torch.rand(2, 1, 1, n + 3, generator=g) > 0.2).to(DEV)
            want = oracle(q, k, v, mask=extra)[0]
        elif kind == "float":
            extra = torch.randn(1, 2, n, n + 3, generator=g).to(DEV)
            want = oracle(q, k, v, mask=extra)[0]
        elif kind == "windowed":  # nW = 1 window mask for B = 2: row b uses window b % 1
            extra = torch.randn(1, 1, n, n + 3, generator=g).to(DEV)
            want = oracle(q, k, v, mask=extra.expand(2, 1, n, n + 3))[0]
        else:
            extra = torch.tensor([n + 3, n // 2], device=DEV)
            keep = torch.arange(n + 3, device=DEV)[None, :] < extra[:, None]
            want = oracle(q, k, v, mask=keep[:, None, None, :])[0]
        assert rel(cf(q, k, v, extra), want) <= TOL["strict"]
    assert counters["stats"]["unique_graphs"] <= 2, (kind, dict(counters["stats"]))


@pytest.mark.parametrize("seed", range(knobs.get(knobs.TEST_RANDOM_CASES)))
def test_random_feature_combinations(seed):
    """Fresh random problems mixing GQA, strides, masks, causal, padded lengths and forced K-partitions."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    B, hkv, groups = pick([1, 2]), pick([1, 2]), pick([1, 2, 3])
    hq = hkv * groups
    nq, nk = int(torch.randint(1, 120, (1,), generator=g)), int(torch.randint(1, 160, (1,), generator=g))
    d, dv = pick([8, 16, 24, 40, 64]), pick([8, 32, 48])
    dtype = pick([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    q = rand(B, nq, hq, d, dtype=dtype).transpose(1, 2) if seed % 2 else rand(B, hq, nq, d, dtype=dtype)
    k, v = rand(B, hkv, nk, d, dtype=dtype), rand(B, hkv, nk, dv, dtype=dtype)
    causal = bool(seed % 3 == 0)
    mask = None
    kind = pick(["none", "bool", "float"])
    if kind == "bool":
        mask = torch.rand(B, pick([1, hq]), nq, nk, generator=g).to(DEV) > 0.3
    elif kind == "float":
        mask = torch.randn(pick([1, B]), 1, nq, nk, generator=g).to(DEV)
    lengths = {}
    if seed % 4 == 1:
        lengths = dict(q_lengths=torch.randint(0, nq + 1, (B,), generator=g, dtype=torch.int32).to(DEV),
                       kv_lengths=torch.randint(0, nk + 1, (B,), generator=g, dtype=torch.int32).to(DEV))
    canon = None if mask is None else mask.expand(mask.shape[0], hq if mask.shape[1] == hq else 1, nq, nk)
    out, lse = poisoned_run(q, k, v, mask=canon, is_causal=causal, num_partitions=pick([1, 2, 3]), **lengths)
    ro, rl = oracle(q, k, v, mask, is_causal=causal, **lengths)
    check(out, lse, ro, rl, TOL["strict"] if dtype == torch.float32 else TOL[dtype])


def test_eager_kernel_call_under_grad_mode_has_a_backward():
    """Outputs stay connected to autograd and backward runs the kernels' backward (tests/test_backward.py checks it in
    depth); attention_state, which has none, refuses loudly instead of returning silent zeros/None."""
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    out = elsa_surgery.attention(q, k, v, backend="elsa", precision="strict")
    assert out.requires_grad
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = elsa_surgery.attention(*ref_in, backend="reference")
    assert ((out.detach().double() - ref).norm() / ref.norm()) < 2e-6
    out.sum().backward()
    ref.sum().backward()
    for t, r in zip((q, k, v), ref_in):
        assert ((t.grad.double() - r.grad).norm() / r.grad.norm().clamp(min=1e-30)) < 2e-5
    with torch.no_grad():
        assert not elsa_surgery.attention(q, k, v, backend="elsa").requires_grad
    out2, lse = elsa_surgery.attention(q, k, v, backend="elsa", return_lse=True)
    assert out2.requires_grad and lse.shape == (1, 2, 20)
    state = elsa_surgery.attention_state(q, k, v, backend="elsa", precision="strict")
    with pytest.raises(RuntimeError, match="attention_state on the ELSA kernels has no backward"):
        state.W.sum().backward()


@pytest.mark.parametrize("mode", ["turbo", "precise"])
def test_staged_v_for_tensor_core_modes(mode, monkeypatch):
    """fp32 TF32/3xTF32 with V staged transposed in memory (keys contiguous): every feature path still
    matches the oracle, staging really happens (and not when opted out or decode-like), and the caller's
    K/V are left untouched. (Under the interpreter every dot is fp32, so this checks the data movement;
    the TF32 error budgets are checked on the GPU.)"""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "tf32")  # the 3xTF32 path (the fp16 split: test_precise_f16_split)
    staged = []
    real_stage = launch._stage_v
    monkeypatch.setattr(launch, "_stage_v", lambda v, varlen: staged.append(v) or real_stage(v, varlen))
    B, Hq, Hkv, D, Dv = 2, 4, 2, 72, 40
    q = rand(B, 53, Hq, D).transpose(1, 2)
    kv = rand(B, 61, 2, Hkv, D)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1, :, :Dv].transpose(1, 2)
    k0, v0 = k.clone(), v.clone()
    mask = torch.randn(1, Hq, 53, 61, device=DEV)
    mask[..., 7, :] = float("-inf")
    kvl = torch.tensor([61, 30], dtype=torch.int32, device=DEV)
    for kw, parts in [(dict(), 1), (dict(is_causal=True), 2), (dict(mask=mask), 1), (dict(kv_lengths=kvl), 3)]:
        out, lse = poisoned_run(q, k, v, precision=mode, num_partitions=parts, **kw)
        check(out, lse, *oracle(q, k, v, **kw), TOL["strict"])
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert len(staged) == 4
    # varlen (packed rows: V's key axis is the packed row axis)
    lens = [37, 90, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    qp, kp, vp = rand(sum(lens), Hq, 32), rand(sum(lens), Hkv, 32), rand(sum(lens), Hkv, 16)
    o, l = launch.attention_varlen(qp, kp, vp, cu, cu, max(lens), max(lens), scale=32 ** -0.5, is_causal=True,
                                   precision=mode)
    ro, rl = elsa_surgery.attention_varlen(qp.double(), kp.double(), vp.double(), cu, cu, max(lens), max(lens),
                                           is_causal=True, backend="reference", return_lse=True)
    check(o, l, ro, rl, TOL["strict"])
    assert len(staged) == 5
    # opted out, or too few query rows per K/V head, or a half-precision/strict call: not staged
    monkeypatch.setenv(occ.ENV_STAGE, "0")
    poisoned_run(q, k, v, precision=mode)
    monkeypatch.delenv(occ.ENV_STAGE)
    poisoned_run(q, k, v, precision="strict")
    poisoned_run(q.half(), k.half(), v.half())
    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 10_000)
    poisoned_run(q, k, v, precision=mode)
    assert len(staged) == 5


def _staged_pieces_cases(D=40, Dv=24):
    """Inputs for the staged-in-pieces tests (70 queries, 100 keys: 4 key chunks or 2 K/V-head groups under
    the interpreter's tiles): GQA, Dv != D, strided q/k/v, and the cases ``(kwargs)`` every plan must get right:
    causal, key-axis / per-head / key- and head-broadcast masks with fully masked rows, kv/q lengths shorter
    than one chunk, kv_len 0."""
    B, Hq, Hkv = 2, 4, 2
    q = rand(B, 70, Hq, D).transpose(1, 2)
    kv = rand(B, 100, 2, Hkv, D)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1, :, :Dv].transpose(1, 2)
    mask = torch.randn(B, Hq, 70, 100, device=DEV)
    mask[:, :, 5, :] = float("-inf")
    mask[:, 1, 9, 40:] = float("-inf")  # row 9 of head 1 sees keys of the first two chunks only
    keep_rows = torch.rand(1, 1, 70, 1, device=DEV) > 0.2  # broadcast along the keys and heads
    keep = torch.rand(1, 1, 70, 100, device=DEV) > 0.3  # broadcast along the heads
    kvl = torch.tensor([100, 20], dtype=torch.int32, device=DEV)
    ql = torch.tensor([3, 70], dtype=torch.int32, device=DEV)
    cases = [dict(), dict(is_causal=True), dict(mask=mask), dict(mask=keep_rows), dict(mask=keep),
             dict(kv_lengths=kvl, is_causal=True), dict(q_lengths=ql, kv_lengths=kvl),
             dict(kv_lengths=torch.tensor([0, 45], dtype=torch.int32, device=DEV))]
    return q, k, v, mask, cases


@pytest.mark.parametrize("plan,expected", [("keys:32", [True] * 4), ("heads:1", [False] * 2)])
@pytest.mark.parametrize("mode", ["turbo", "precise"])
def test_staged_v_in_pieces(mode, plan, expected, monkeypatch):
    """V staged a piece at a time to bound the extra memory: key chunks (each launch folds its chunk into the
    row states the previous one left, rows finishing in the chunk of their last visible key) and K/V-head groups (each launch finishes its
    heads' rows). Causal (the frontier inside a chunk), key-axis, per-head and key-broadcast masks (a fully
    masked row -> zeros, lse -inf), kv/q lengths shorter than one chunk, GQA, Dv != D and strided inputs
    must match the oracle with every element written (poisoned output), the caller's K/V untouched."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "tf32")
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, plan)  # keys:32 = the interpreter's BLOCK_N: 100 keys -> 4 launches
    launches = []
    for name in ("_key_chunk_fwd", "_head_group_fwd"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda fwd, *a, real=real: real(
            lambda *f: launches.append(f[13]) or fwd(*f), *a))
    q, k, v, mask, cases = _staged_pieces_cases()
    k0, v0 = k.clone(), v.clone()
    for kw in cases:
        launches.clear()
        out, lse = poisoned_run(q, k, v, precision=mode, **kw)
        check(out, lse, *oracle(q, k, v, **kw), TOL["strict"])
        assert launches == expected, launches
    assert torch.equal(k, k0) and torch.equal(v, v0)
    o, l = poisoned_run(q, k, v, precision=mode, mask=mask)
    assert (o[:, :, 5] == 0).all() and torch.isinf(l[:, :, 5]).all()
    # "whole" stages V in one piece (one launch); strict/fp16 are never staged
    launches.clear()
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, "whole")
    poisoned_run(q, k, v, precision=mode)
    poisoned_run(q, k, v, precision="strict")
    assert launches == []


@pytest.mark.parametrize("kind", ["f16", "f16k"])
@pytest.mark.parametrize("plan,launches", [("whole", 1), ("keys:32", 4), ("heads:1", 2)])
def test_precise_f16_split(plan, launches, kind, monkeypatch):
    """``precise`` from three fp16 products per fp32 product (DOT_F16X3): K and V split by the launcher
    (whole, a key chunk or a K/V-head group at a time), Q and P in the kernel. Every feature path matches
    the oracle within the precise budget with every element written, the split really runs (and
    only where eligible), and the caller's K/V are untouched."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)  # f16k: K split by the launcher, V in the kernel
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, plan)
    monkeypatch.setattr(occ, "MIN_CAUSAL_SPLIT_CHUNK_WORK", 0)
    splits = []
    real = launch._SplitKV.__call__
    monkeypatch.setattr(launch._SplitKV, "__call__", lambda self, k, v, views: splits.append(self.split_v) or real(self, k, v, views))
    # V split in the kernel (f16k) runs for head dims without padding only; padded ones take the full split
    q, k, v, mask, cases = _staged_pieces_cases(*((32, 16) if kind == "f16k" else (40, 24)))
    Hq, Hkv, D, Dv = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    k0, v0 = k.clone(), v.clone()
    for kw in cases:
        splits.clear()
        out, lse = poisoned_run(q, k, v, precision="precise", **kw)
        check(out, lse, *oracle(q, k, v, **kw), TOL["precise"])
        assert splits == [kind == "f16"] * launches, splits
    assert torch.equal(k, k0) and torch.equal(v, v0)
    # magnitudes far from 1: per-row Q, per-key K and per-dim V scales keep fp32 accuracy
    qw = q * torch.logspace(-3, 3, 70, device=DEV)[:, None]
    kw_ = k * torch.logspace(2, -2, 100, device=DEV)[:, None] * 1e-3
    vw = v * torch.logspace(-20, 20, Dv, device=DEV) * 1e10
    out, lse = poisoned_run(qw, kw_, vw, precision="precise", is_causal=True)
    check(out, lse, *oracle(qw, kw_, vw, is_causal=True), TOL["precise"])
    # a causal call whose key chunks would hold less work than MIN_CAUSAL_SPLIT_CHUNK_WORK splits K alone
    # (unless ELSA_PRECISE_SPLIT forces a kind)
    monkeypatch.setattr(occ, "MIN_CAUSAL_SPLIT_CHUNK_WORK", 1e18)
    for forced in (True, False):
        splits.clear()
        if not forced:  # chosen by shape: every other threshold let through
            monkeypatch.delenv(occ.ENV_PRECISE_SPLIT)
            monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_SPLIT", 0)
            monkeypatch.setattr(occ, "MIN_SPLIT_WORK", 0)
        out, lse = poisoned_run(q, k, v, precision="precise", is_causal=True)
        check(out, lse, *oracle(q, k, v, is_causal=True), TOL["precise"])
        if forced or not plan.startswith("keys"):
            expected = [(kind == "f16") if forced else True] * launches
        else:  # K alone where the head dims need no padding, else 3xTF32 (no split)
            expected = [False] * launches if (D, Dv) == (occ.block_dim(D), occ.block_dim(Dv)) else []
        assert splits == expected, (forced, splits)
    if kind == "f16k":  # padded head dims (D=40, Dv=24): the full split, forced or chosen
        qp, kp, vp, _, _ = _staged_pieces_cases()
        for forced in (True, False):
            splits.clear()
            if forced:
                monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "f16k")
            out, lse = poisoned_run(qp, kp, vp, precision="precise", is_causal=True)
            check(out, lse, *oracle(qp, kp, vp, is_causal=True), TOL["precise"])
            # chosen by shape with short causal chunks: 3xTF32 (no split), as v7 did
            assert splits == ([] if not forced and plan.startswith("keys") else [True] * launches), (forced, splits)
            monkeypatch.delenv(occ.ENV_PRECISE_SPLIT, raising=False)
    # not split: varlen, the state output, split-K partitions, strict/turbo, ELSA_PRECISE_SPLIT=tf32
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)
    splits.clear()
    cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEV)
    qp, kp, vp = rand(70, Hq, 32), rand(70, Hkv, 32), rand(70, Hkv, 16)
    o, l = launch.attention_varlen(qp, kp, vp, cu, cu, 40, 40, scale=32 ** -0.5, precision="precise")
    ro, rl = elsa_surgery.attention_varlen(qp.double(), kp.double(), vp.double(), cu, cu, 40, 40,
                                           backend="reference", return_lse=True)
    check(o, l, ro, rl, TOL["precise"])
    launch.attention_state(q, k, v, scale=D ** -0.5, precision="precise")
    out, lse = poisoned_run(q, k, v, precision="precise", num_partitions=3)
    check(out, lse, *oracle(q, k, v), TOL["precise"])
    poisoned_run(q, k, v, precision="turbo")
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "tf32")
    poisoned_run(q, k, v, precision="precise")
    assert splits == []


@pytest.mark.parametrize("mode,kind", [("precise", "f16"), ("precise", "f16k"), ("turbo", "tf32")])
def test_causal_key_chunks_in_reverse_staged_in_the_output(mode, kind, monkeypatch):
    """Causal key chunks run in reverse order (the last keys first): the staged K/V of a chunk go into the
    output rows that no launch has touched yet where they fit, the rest into a buffer of at most N keys
    (ELSA_STAGE_PLAN=rkeys:N). For both output layouts ([B, Nq, Hq, Dv] in memory: one block per batch row;
    contiguous: one per batch row and head), GQA, Dv != D, two batch rows, Nq = Nk, Nq < Nk and Nq > Nk
    (bottom-right causal: rows that see no key), and a key-axis mask with a fully masked row and a row that
    sees only the first keys, the result matches the oracle with every element written and K/V untouched;
    the output really held staged chunks, and the separate buffer only the external ones."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, "rkeys:32")  # the interpreter's BLOCK_N
    runs, buffers = [], []
    real_chunks, real_buffer = launch._key_chunk_fwd, launch._Region.buffer.__func__
    monkeypatch.setattr(launch, "_key_chunk_fwd", lambda fwd, q, k, v, out, lse, mask, chunks, region, *a: runs.append(
        (chunks, region is not None)) or real_chunks(fwd, q, k, v, out, lse, mask, chunks, region, *a))
    monkeypatch.setattr(launch._Region, "buffer", classmethod(
        lambda cls, like, batch, nbytes: buffers.append(nbytes) or real_buffer(cls, like, batch, nbytes)))
    B, Hq, Hkv, D, Dv = 2, 2, 1, 16, 32  # f16k (V split in the kernel) needs head dims without padding
    stager = (launch._SplitKV(rand(1, 1, 1, D), rand(1, 1, 1, Dv), block_n=32, split_v=kind == "f16")
              if kind != "tf32" else launch._TransposedV(None, rand(1, 1, 1, Dv)))
    ext_bytes = launch._specs_bytes(stager.specs(Hkv, 32))
    for nq, nk in ((256, 256), (192, 256), (256, 192)):
        q = rand(B, nq, Hq, D).transpose(1, 2)
        k, v = rand(B, Hkv, nk, D), rand(B, nk, Hkv, 2 * Dv)[..., ::2].transpose(1, 2)
        k0, v0 = k.clone(), v.clone()
        mask = torch.randn(B, 1, nq, nk, device=DEV)
        mask[:, :, -1, :] = float("-inf")
        mask[1, :, -3, 40:] = float("-inf")
        for kw in (dict(), dict(mask=mask)):
            ro, rl = oracle(q, k, v, is_causal=True, **kw)
            for layout in ("rows", "heads"):  # [B, Nq, Hq, Dv] in memory / contiguous [B, Hq, Nq, Dv]
                runs.clear()
                buffers.clear()
                if layout == "rows":
                    out = torch.full((B, nq, Hq, Dv), float("nan"), device=DEV).transpose(1, 2)
                    lse = torch.full((B, Hq, nq), float("nan"), device=DEV)
                    launch.attention(q, k, v, scale=D ** -0.5, precision=mode, is_causal=True, out=out, lse=lse, **kw)
                else:
                    out, lse = poisoned_run(q, k, v, precision=mode, is_causal=True, **kw)
                check(out, lse, ro, rl, TOL["strict"])
                (chunks, reverse), = runs
                starts = [c[0] for c in chunks]
                assert reverse and starts == sorted(starts, reverse=True) and chunks[-1][0] == 0
                assert [c[1] for c in chunks[1:]] == starts[:-1] and chunks[0][1] == nk
                in_out = [c for c in chunks if c[2] is not None]
                assert all(e - s <= 32 for s, e, cap in chunks if cap is None)
                assert buffers == [ext_bytes] if len(in_out) < len(chunks) else buffers == [], (buffers, ext_bytes)
                assert in_out, chunks
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # another plan forced (key order), and calls the output cannot hold chunks for: key order, no region
    runs.clear()
    q, k, v = rand(1, 2, 256, D), rand(1, 1, 256, D), rand(1, 1, 256, Dv)
    kvl = torch.tensor([200], dtype=torch.int32, device=DEV)
    for env, kw in (("keys:32", dict(is_causal=True)), ("rkeys:32", dict(is_causal=True, kv_lengths=kvl)),
                    ("rkeys:32", dict())):
        monkeypatch.setenv(occ.ENV_STAGE_PLAN, env)
        out, lse = poisoned_run(q, k, v, precision=mode, **kw)
        check(out, lse, *oracle(q, k, v, **kw), TOL["strict"])
    assert [r[1] for r in runs] == [False] * 3 and all(c[0][0] == 0 for c, _ in runs)


def test_reverse_key_chunks_plan():
    """The reverse plan covers the keys once, last keys first, in block_n multiples; a chunk staged in the
    output fits the row tiles that are untouched while it runs (their last visible key lies before its start);
    external chunks hold at most ext_keys keys and are not slivers. At the issue's shapes (H100, 16K causal
    precise) the output holds most keys in a few long chunks."""
    from elsa_surgery.kernels import occupancy as occ

    for nq, nk, bm, bn, row, key, ext in ((16384, 16384, 128, 64, 2048, 4160, 512),
                                           (16384, 16384, 128, 64, 16384, 33152, 640),
                                           (1000, 16384, 128, 64, 2048, 4160, 512),
                                           (65536, 65536, 128, 64, 2048, 4160, 2240),
                                           (300, 200, 32, 32, 100, 40, 32), (50, 50, 32, 32, 100, 40, 1000)):
        chunks = occ.reverse_key_chunks(n_q=nq, n_k=nk, block_m=bm, block_n=bn, row_bytes=row, key_bytes=key,
                                        fixed_bytes=100, ext_keys=ext)
        assert chunks[0][1] == nk and chunks[-1][0] == 0
        assert all(a[0] == b[1] and a[0] % bn == 0 for a, b in zip(chunks, chunks[1:]))
        for s, e, cap in chunks:
            assert e > s
            if cap is None:
                assert e - s <= ext and (e - s >= ext // 2 or s == 0 and e == chunks[-1][1] < ext), (s, e)
            else:  # rows of whole untouched tiles: (j + 1) * bm + (nk - nq) <= s
                untouched = max(j for j in range(-1, nq // bm + 1) if (j + 1) * bm + nk - nq <= s or j < 0) + 1
                assert cap == untouched * bm * row and (e - s) * key + 100 <= cap, (s, e, cap)
        if nq == nk == 16384:
            outs = [c for c in chunks if c[2] is not None]
            assert len(outs) >= 5 and outs[-1][0] <= nk // 8 and len(chunks) <= 12, chunks


def test_precise_split_choice_and_split_kernel(monkeypatch):
    """precise_split picks the fp16 split for eligible calls with enough query rows per K/V head, keeps other
    kinds as they are and rejects a bad ELSA_PRECISE_SPLIT; split_f16 gives fp16 hi/lo whose sum times the
    power-of-two inverse scale is x to ~2^-22 of the row (K) or column (V) maximum, zero rows included."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.delenv(occ.ENV_PRECISE_SPLIT, raising=False)
    many = occ.MIN_ROWS_PER_KV_HEAD_TO_SPLIT
    assert occ.precise_split(occ.DOT_TF32X3, many, True) == occ.DOT_F16X3
    assert occ.precise_split(occ.DOT_TF32X3, many - 1, True) == occ.DOT_TF32X3
    assert occ.precise_split(occ.DOT_TF32X3, many, False) == occ.DOT_TF32X3
    assert occ.precise_split(occ.DOT_TF32X3, many, True, work=occ.MIN_SPLIT_WORK / 2) == occ.DOT_TF32X3
    for dot in (occ.DOT_LOWP, occ.DOT_IEEE, occ.DOT_TF32):
        assert occ.precise_split(dot, many, True) == dot
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "f16")
    assert occ.precise_split(occ.DOT_TF32X3, 1, True) == occ.DOT_F16X3
    assert occ.precise_split(occ.DOT_TF32X3, 1, False) == occ.DOT_TF32X3
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "fp16")
    with pytest.raises(ValueError, match="ELSA_PRECISE_SPLIT"):
        occ.precise_split(occ.DOT_TF32X3, many, True)
    k = rand(2, 3, 48, 24) * torch.logspace(-30, 30, 48, device=DEV)[:, None]
    k[0, 1, 7] = 0.0
    v = rand(2, 3, 48, 40).transpose(2, 3).contiguous().transpose(2, 3) * torch.logspace(-15, 15, 40, device=DEV)
    v[1, 2, 16:32] *= 1e-12  # one key block far smaller than the others: its own scales
    stager = launch._SplitKV(k, v, block_n=16)
    # blocks wider than the pieces: the batch rows of every piece are apart by the block, not packed
    region = launch._Region.buffer(k, 2, launch._specs_bytes(stager.specs(3, 48)) + 48)
    kh, vh, (kl, ki, vl, vi) = launch._stage(stager, region, k, v)
    assert kh.stride(0) == kl.stride(0) == vh.stride(0) == region.capacity // 2 and ki.stride(0) == region.capacity // 4
    assert kh.dtype == kl.dtype == vh.dtype == vl.dtype == torch.float16 and vi.shape == (2, 3, 3, 40)
    for x, hi, lo, inv, ref in ((k, kh, kl, ki[..., None], k.double().abs().amax(-1, keepdim=True)),
                                (v, vh, vl, vi.repeat_interleave(16, 2),
                                 v.double().abs().unflatten(2, (3, 16)).amax(3).repeat_interleave(16, 2))):
        assert torch.isfinite(hi).all() and torch.isfinite(lo).all() and hi.abs().max() < 2 ** 15
        assert torch.equal(torch.log2(inv), torch.log2(inv).round())  # powers of two
        back = (hi.double() + lo.double()) * inv.double()
        err = (back - x.double()).abs() / ref.clamp_min(1e-300)
        assert err.max() <= 2 ** -21, err.max()
    assert (kh[0, 1, 7] == 0).all() and (kl[0, 1, 7] == 0).all() and torch.isfinite(ki).all()


def test_small_grids_get_shorter_row_tiles(monkeypatch):
    """A call whose grid of 128-row tiles cannot fill the SMs (B=1, H=8, N=1K: 64 programs on 132 SMs) gets
    64-row tiles; grids that fill the GPU, wider heads, longer sequences and calls without the grid size keep
    the length bucket's tile. Causal fp16/bf16 calls with narrow heads and a grid of a few waves get 64x64 tiles."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "_sms", lambda device: 132)
    monkeypatch.setattr(occ, "interpreting", lambda: False)
    dev = torch.device("cuda")
    for dot in (occ.DOT_LOWP, occ.DOT_TF32, occ.DOT_TF32X3):
        bucket = occ.tile_config(dot, 64, 64, 1024)
        assert bucket.block_m == 128
        small = occ.tile_config(dot, 64, 64, 1024, bh=8, nq=1024, device=dev)
        assert small.block_m == 64 and small == occ._SMALL_GRID[occ._KIND_OF_DOT[dot]]
        assert occ.tile_config(dot, 64, 64, 1024, bh=8 * 16, nq=1024, device=dev) == bucket  # ViT batch 8
        assert occ.tile_config(dot, 64, 64, 2048, bh=8, nq=2048, device=dev).block_m == 64  # 128 programs
        assert occ.tile_config(dot, 64, 64, 4096, bh=8, nq=4096, device=dev) == occ.tile_config(dot, 64, 64, 4096)
        assert occ.tile_config(dot, 128, 128, 1024, bh=4, nq=1024, device=dev) == occ.tile_config(dot, 128, 128, 1024)
    assert occ.tile_config(occ.DOT_IEEE, 64, 64, 1024, bh=8, nq=1024, device=dev) == occ.tile_config(occ.DOT_IEEE, 64, 64, 1024)
    assert occ.tile_config(occ.DOT_LOWP, 64, 64, 300, bh=1, nq=300, device=dev).block_m == 64  # short bucket as is
    # causal bf16/fp16 calls with narrow heads past 2,048 tokens whose 128-row grid is under 4 waves: 64x64
    # tiles; larger grids, wide heads, other kinds, the <= 2,048 bucket and non-causal calls keep theirs
    for n, bh, causal_tile in ((4096, 8, True), (4096, 16, True), (16384, 8, False), (65536, 8, False)):
        got = occ.tile_config(occ.DOT_LOWP, 64, 64, n, bh=bh, nq=n, device=dev, causal=True)
        assert (got == occ._CAUSAL_LOWP) == causal_tile, (n, bh, got)
        assert occ.tile_config(occ.DOT_LOWP, 64, 64, n, bh=bh, nq=n, device=dev).block_m == 128
    assert occ.tile_config(occ.DOT_LOWP, 48, 64, 8192, bh=4, nq=8192, device=dev, causal=True) == occ._CAUSAL_LOWP
    assert occ.tile_config(occ.DOT_LOWP, 64, 64, 4096, causal=True).block_m == 128  # no grid given
    assert occ.tile_config(occ.DOT_LOWP, 128, 128, 4096, bh=8, nq=4096, device=dev, causal=True).block_m == 128
    assert occ.tile_config(occ.DOT_TF32, 64, 64, 4096, bh=8, nq=4096, device=dev, causal=True).block_m == 128
    assert occ.tile_config(occ.DOT_LOWP, 64, 64, 2048, bh=16, nq=2048, device=dev, causal=True).block_m == 128


def test_stage_plan_keeps_the_memory_budget(monkeypatch):
    """Staging plans on a 132-SM GPU: the staged piece (plus the row statistics of key chunks) stays within
    STAGE_MEMORY_FRACTION of the output whenever V is staged in pieces; head groups only when they fill the
    GPU in whole waves; key chunks are multiples of BLOCK_N and not slivers; small calls stage V whole."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "_sms", lambda device: 132)
    frac = occ.STAGE_MEMORY_FRACTION
    cases = [((1, 8, 8, 16384, 64), "keys"), ((1, 32, 32, 16384, 128), "heads"), ((1, 8, 8, 65536, 64), "keys"),
             ((1, 32, 32, 65536, 128), "keys"), ((1, 40, 8, 32768, 128), "keys"), ((1, 8, 8, 4096, 64), "whole"),
             ((1, 16, 16, 104100, 64), "keys"), ((100, 16, 16, 1041, 64), "heads"), ((2, 64, 8, 4096, 128), "heads"),
             ((1, 2, 2, 16384, 64), "whole"),
             ((1, 32, 2, 4096, 128), "whole"), ((1, 32, 32, 16384, 128, True), "keys"),
             ((1, 32, 32, 4096, 128), "whole")]
    for shape, kind in cases:
        (B, Hq, Hkv, N, D), causal = shape[:5], len(shape) > 5
        rows = B * Hq * N
        out_b = rows * D * 4
        m_blocks = -(-N // 128)
        got, n = occ.stage_plan(torch.device("cpu"), n_k=N, block_n=64, batch=B, kv_heads=Hkv, groups=Hq // Hkv,
                                m_blocks=m_blocks, out_bytes=out_b, v_bytes_per_key_head=D * 4,
                                stats_bytes=2 * rows * 4, causal=causal)
        assert got == kind, (shape, got, n)
        if got == "heads":  # within the budget, and whole waves of programs (at most 5 % of the last wave idle)
            waves = m_blocks * B * n * (Hq // Hkv) / 132
            assert n * B * N * D * 4 <= frac * out_b and waves >= 2 and waves / -(-waves // 1) >= 0.95, waves
        elif got == "keys":
            assert n % 64 == 0 and n * B * Hkv * D * 4 + 2 * rows * 4 <= frac * out_b, n
            chunks = -(-N // n)
            assert N - (chunks - 1) * n > n // 2  # the last chunk is not a sliver
        elif Hkv * B * N * D * 4 > frac * out_b:  # V staged whole beyond the budget: only for small calls
            budget_keys = (frac * out_b - 2 * rows * 4) // (B * Hkv * D * 4)
            assert (m_blocks * B * Hq < occ.CHUNKED_STAGING_MIN_PROGRAMS_PER_SM * 132
                    or budget_keys < occ.MIN_KEYS_PER_STAGE_CHUNK)
    with pytest.raises(ValueError, match=occ.ENV_STAGE_PLAN):
        monkeypatch.setenv(occ.ENV_STAGE_PLAN, "chunks")
        occ.stage_plan(torch.device("cpu"), n_k=10, block_n=16, batch=1, kv_heads=1, groups=1, m_blocks=1,
                       out_bytes=1, v_bytes_per_key_head=1, stats_bytes=0)


def test_lean_eta_bounds_the_partition_states(monkeypatch):
    """ELSA-Lean on a (simulated) 132-SM GPU: grids that cannot fill it split the keys, and with ``eta`` the
    partition states (``partitions * rows * (Dv + 2)`` fp32) stay within ``eta`` times the output's bytes;
    ``eta = 0`` means one partition. The environment variable is the same knob."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "sm_count", lambda index: 132)
    monkeypatch.delenv(occ.ENV_LEAN_ETA, raising=False)
    monkeypatch.delenv(occ.ENV_PARTITIONS, raising=False)
    cuda = torch.device("cuda", 0)
    rows, dv = 8 * 128, 128  # a decode-like grid: 8 heads x 1 row tile of 128 rows, 64K keys
    args = dict(tiles=8, n_k=65536, block_n=64, rows=rows, dv=dv, out_bytes=rows * dv * 4)
    free = occ.num_partitions(cuda, **args)
    assert free > 4, free
    per_part = rows * (dv + 2) * 4
    for eta in (0, 0.5, 1.0, 2.0, 4.0):
        parts = occ.num_partitions(cuda, **args, eta=eta)
        assert parts == 1 or parts * per_part <= eta * args["out_bytes"], (eta, parts)
        assert parts == max(1, min(free, int(eta * args["out_bytes"] // per_part))), (eta, parts)
    monkeypatch.setenv(occ.ENV_LEAN_ETA, "2")
    assert occ.num_partitions(cuda, **args) == occ.num_partitions(cuda, **args, eta=2.0)
    monkeypatch.setenv(occ.ENV_LEAN_ETA, "0")
    assert occ.num_partitions(cuda, **args) == 1


def test_decode_partitions_per_sm_by_value_head_dim(monkeypatch):
    """The packed short-query kernel's partition rule on a (simulated) 132-SM GPU: enough partitions for 2 programs
    per SM at Dv = 128 and for 3 at Dv <= 64 (session 31's H100 sweep), never below 256 keys a partition."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "sm_count", lambda index: 132)
    monkeypatch.delenv(occ.ENV_LEAN_ETA, raising=False)
    monkeypatch.delenv(occ.ENV_PARTITIONS, raising=False)
    cuda = torch.device("cuda", 0)
    for dv, per_sm in ((128, 2), (64, 3), (32, 3)):
        parts = occ.num_partitions(cuda, tiles=64, n_k=131072, block_n=64, rows=4, dv=dv, out_bytes=4 * dv * 2,
                                   decode=True)
        assert parts == -(-132 * per_sm // 64), (dv, parts)
    assert occ.num_partitions(cuda, tiles=1, n_k=1024, block_n=64, rows=4, dv=64, out_bytes=512, decode=True) == 4


def test_decode_tiles_by_groups_width_dtype_and_device(monkeypatch):
    """Session 40's packed short-query rule on a (simulated) 132-SM Hopper: few (batch, K/V head) pairs take 3
    stages and 2 programs per SM whatever Dv; one row per K/V head at width 128 with many pairs takes 128-key tiles;
    other calls, 4-byte operands and pre-Hopper GPUs keep the former tiles (64 keys, 2 stages)."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "sm_count", lambda index: 132)
    monkeypatch.setattr(occ, "capability", lambda index: (9, 0))
    monkeypatch.setattr(occ, "interpreting", lambda: False)
    monkeypatch.delenv(occ.ENV_LEAN_ETA, raising=False)
    monkeypatch.delenv(occ.ENV_PARTITIONS, raising=False)
    cuda = torch.device("cuda", 0)

    def tiles(groups, rows, d, itemsize=2):
        cfg = occ.decode_tile_config(d, d, rows, groups=groups, device=cuda, itemsize=itemsize)
        few = occ.decode_few(cuda, groups=groups, rows=rows, d=d, dv=d, itemsize=itemsize)
        parts = occ.num_partitions(cuda, tiles=groups, n_k=131072, block_n=cfg.block_n, rows=rows, dv=d,
                                   out_bytes=rows * d * itemsize, decode=True, decode_few=few)
        return (cfg.block_n, cfg.num_stages), parts

    assert tiles(8, 4, 64) == ((64, 3), -(-132 * 2 // 8))  # B = 1, GQA 32:8: few pairs, 2 per SM (not 3)
    assert tiles(33, 1, 64) == ((64, 3), -(-132 * 2 // 33))  # B = 1 MHA, D = 64
    assert tiles(34, 8, 128) == ((64, 2), -(-132 * 2 // 34))  # past SMs / 4
    assert tiles(128, 4, 64) == ((64, 2), -(-132 * 3 // 128))  # many pairs at Dv <= 64: 3 per SM as before
    assert tiles(32, 1, 128) == ((64, 2), -(-132 * 2 // 32))  # MHA at width 128, few pairs: the former tile
    assert tiles(66, 1, 128) == ((128, 2), 132 * 2 // 66)  # ... many pairs: 128-key tiles
    assert tiles(66, 2, 128)[0] == (64, 2)  # two rows per K/V head
    assert tiles(8, 4, 64, itemsize=4) == ((64, 2), -(-132 * 3 // 8))  # fp32: the former rule
    assert tiles(8, 4, 256)[0] == (32, 2)  # head width 256
    monkeypatch.setattr(occ, "capability", lambda index: (8, 0))
    assert tiles(8, 4, 64) == ((64, 2), -(-132 * 3 // 8))
    assert tiles(512, 1, 128)[0] == (64, 2)


@pytest.mark.parametrize("env,value,match", [
    ("ELSA_LEAN_ETA", "inf", "ELSA_LEAN_ETA must be a finite number >= 0"),
    ("ELSA_LEAN_ETA", "nan", "ELSA_LEAN_ETA must be a finite number >= 0"),
    ("ELSA_LEAN_ETA", "-1", "ELSA_LEAN_ETA must be a finite number >= 0"),
    ("ELSA_LEAN_ETA", "abc", "ELSA_LEAN_ETA must be a finite number >= 0"),
    ("ELSA_NUM_PARTITIONS", "two", "ELSA_NUM_PARTITIONS must be an integer >= 1"),
    ("ELSA_NUM_PARTITIONS", "0", "ELSA_NUM_PARTITIONS must be an integer >= 1"),
    (None, "eta=-1", "eta must be a finite number >= 0"),
    (None, "eta=inf", "eta must be a finite number >= 0"),
    (None, "num_partitions=0", "num_partitions must be an integer >= 1"),
])
def test_partition_knobs_reject_bad_values(monkeypatch, env, value, match):
    """Bad ELSA-Lean / partition settings raise an error naming the knob and its range, before any kernel
    runs and with the user's tensors untouched (also on the CPU, where the count is always 1)."""
    q, k, v = rand(1, 2, 20, 16), rand(1, 2, 30, 16), rand(1, 2, 30, 16)
    before = [t.clone() for t in (q, k, v)]
    kw = {}
    if env is None:
        name, raw = value.split("=")
        kw[name] = float(raw) if name == "eta" else int(raw)
    else:
        monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=match):
        launch.attention(q, k, v, scale=0.25, precision="strict", **kw)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))


def test_partition_knobs_take_numpy_numbers():
    import numpy as np

    q, k, v = rand(1, 2, 20, 16), rand(1, 2, 30, 16), rand(1, 2, 30, 16)
    ro, rl = oracle(q, k, v)
    for kw in (dict(num_partitions=np.int64(2)), dict(eta=np.float32(0.5)), dict(eta=0)):
        out, lse = launch.attention(q, k, v, scale=0.25, precision="strict", **kw)
        check(out, lse, *oracle(q, k, v, scale=0.25), TOL["strict"])
    out = elsa_surgery.attention(q, k, v, dropout_p=np.float32(0.0), backend="elsa", precision="strict")
    assert rel(out, ro) <= TOL["strict"]


@pytest.mark.parametrize("pack", [8, 16])
def test_hopper_lazy_rescale_asm_operands(pack):
    """The PTX block of the lazy rescale (kernels/hopper.py): outputs tied to the accumulator inputs (so that a
    warp which skips the multiplies leaves its accumulator as it was), each multiply reading its own accumulator
    element and alpha, the branch reading a vote operand, and no operand past the constraint list. The kernel
    itself runs on the GPU only (tests/test_kernels_gpu.py::test_hopper_lazy_rescale_matches_the_oracle)."""
    import re

    from elsa_surgery.kernels import hopper

    cons = hopper._rescale_constraints(pack).split(",")
    assert cons[:pack] == ["=r"] * pack and cons[pack:2 * pack] == [str(i) for i in range(pack)]
    assert cons[2 * pack:] == ["r"] * (2 * pack)
    asm = hopper._rescale_asm(pack)
    muls = re.findall(r"mul\.f32 \$(\d+), \$(\d+), \$(\d+);", asm)
    assert [tuple(map(int, m)) for m in muls] == [(i, pack + i, 2 * pack + i) for i in range(pack)]
    assert re.search(r"setp\.ne\.b32 p, \$(\d+), 0;", asm).group(1) == str(3 * pack)
    assert asm.index("@!p bra.uni skip;") < asm.index("mul.f32") < asm.index("skip:")
    assert max(int(x) for x in re.findall(r"\$(\d+)", asm)) < len(cons)
    assert asm.count("{") == asm.count("}") == 1  # a scope of its own: one label per block


def test_hopper_lazy_rescale_rule(monkeypatch):
    """Lazy rescaling from ``LAZY_MIN_TILES`` key tiles a row block (half for causal calls), or as
    ``ELSA_HOPPER_LAZY`` says; a bad value names the variable."""
    from elsa_surgery.kernels import hopper

    monkeypatch.delenv(hopper.ENV_LAZY, raising=False)
    n = hopper.LAZY_MIN_TILES
    assert hopper.lazy_rescale(64 * n, 64, False) and not hopper.lazy_rescale(64 * n - 64, 64, False)
    assert hopper.lazy_rescale(64 * n - 63, 64, False)  # a ragged last tile counts
    assert not hopper.lazy_rescale(128 * n, 128, True) and hopper.lazy_rescale(2 * 128 * n, 128, True)
    monkeypatch.setenv(hopper.ENV_LAZY, "force")
    assert hopper.lazy_rescale(77, 128, True)
    monkeypatch.setenv(hopper.ENV_LAZY, "0")
    assert not hopper.lazy_rescale(1 << 20, 64, False)
    monkeypatch.setenv(hopper.ENV_LAZY, "sometimes")
    with pytest.raises(ValueError, match="ELSA_HOPPER_LAZY must be one of"):
        hopper.lazy_rescale(1024, 64, False)


def test_hopper_kernel_knobs_and_scope_on_the_cpu(monkeypatch):
    """The Gluon kernel (kernels/hopper.py) runs on sm_90 only, so the CPU checks its switches: bad
    ``ELSA_HOPPER`` / ``ELSA_HOPPER_TILES`` values raise naming the variable, before any launch and with the
    user's tensors untouched; CPU calls name why the kernel is not taken and still run the portable kernel.
    Its numerics are tested on the GPU (tests/test_kernels_gpu.py::test_hopper_kernel_matches_the_oracle)."""
    from elsa_surgery.kernels import hopper

    q = torch.randn(1, 2, 40, 64)
    before = q.clone()
    for bad in ("2", "yes"):
        monkeypatch.setenv("ELSA_HOPPER", bad)
        with pytest.raises(ValueError, match="ELSA_HOPPER"):
            elsa_surgery.attention(q, q, q, backend="elsa")
        assert torch.equal(q, before)
    monkeypatch.setenv("ELSA_HOPPER", "0")
    assert hopper.eligible(q, q, q, q, mask=None, q_lengths=None, kv_lengths=None, varlen=False,
                           state=None, scale=0.125, precision=None) == "ELSA_HOPPER=0"
    monkeypatch.setenv("ELSA_HOPPER", "force")
    reason = hopper.eligible(q, q, q, q, mask=None, q_lengths=None, kv_lengths=None, varlen=False, state=None,
                             scale=0.125, precision=None)
    assert reason == (hopper._IMPORT_ERROR or "not a CUDA device")
    out = elsa_surgery.attention(q, q, q, backend="elsa")  # the portable kernel, under the interpreter
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert (out.double() - ref).abs().max() < 2e-6
    monkeypatch.delenv("ELSA_HOPPER")
    assert hopper.tiles(128, 128, False, tiles_128=4096) == (128, 64, 2, 8)
    assert hopper.tiles(64, 64, False, tiles_128=4096) == (128, 128, 2, 8)
    assert hopper.tiles(64, 64, False, tiles_128=4096, n_k=4096) == (128, 128, 2, 8)
    assert hopper.tiles(64, 64, False, tiles_128=4096, n_k=hopper.SHORT_KEYS) == (64, 128, 2, 4)  # short keys
    assert hopper.tiles(128, 128, False, tiles_128=4096, n_k=197) == (128, 64, 2, 8)  # wide heads: not
    assert hopper.tiles(128, 128, True, tiles_128=1024) == (128, 64, 2, 8)
    assert hopper.tiles(128, 128, True, tiles_128=256) == (64, 64, 2, 4)  # small causal grid
    assert hopper.tiles(128, 64, False, tiles_128=64) == (64, 64, 2, 4)  # smaller than one program per SM
    assert hopper.tiles(64, 64, False, tiles_128=64) == (64, 128, 2, 4)
    assert hopper.tiles(32, 64, True, tiles_128=4096) == (64, 128, 2, 4)  # causal, narrow heads: every size
    assert hopper.tiles(64, 128, True, tiles_128=4096) == (128, 64, 2, 8)  # Dv decides too
    assert hopper.eligible(q, q, q, q, mask=None, q_lengths=None, kv_lengths=None, varlen=False, state=None,
                           scale=-0.125, precision="strict", how="force") == (hopper._IMPORT_ERROR or "not a CUDA device")
    # the fp32 (strict) kernel's tiles: 64 x 64 for narrow heads, 32-key tiles for wide ones, 128 rows on big grids
    assert hopper.fma_tiles(64, 64, False, tiles_128=64) == (64, 64, 2, 4)
    assert hopper.fma_tiles(32, 16, True, tiles_128=8192) == (64, 64, 2, 4)
    assert hopper.fma_tiles(128, 128, True, tiles_128=1024) == (128, 32, 2, 8)
    assert hopper.fma_tiles(64, 128, False, tiles_128=256) == (64, 32, 2, 4)
    # the TF32 (turbo) kernel's: 128 x 64 (one CTA an SM), 64-row tiles on grids under one program an SM, 64 x 64
    # for narrow-head causal grids under four
    assert hopper.tf32_tiles(128, 128, True, tiles_128=1024) == (128, 64, 2, 8)
    assert hopper.tf32_tiles(64, 64, False, tiles_128=256) == (128, 64, 2, 8)
    assert hopper.tf32_tiles(64, 64, True, tiles_128=256) == (64, 64, 2, 4)
    assert hopper.tf32_tiles(64, 64, True, tiles_128=1024) == (128, 64, 2, 8)
    assert hopper.tf32_tiles(64, 32, False, tiles_128=64) == (64, 128, 2, 4)
    assert hopper.tf32_tiles(64, 128, True, tiles_128=64) == (64, 32, 2, 4)
    monkeypatch.setenv("ELSA_HOPPER_TILES", "64,32,3,4")
    assert hopper.tiles(128, 128, False) == (64, 32, 3, 4)
    assert hopper.fma_tiles(128, 128, False) == (64, 32, 3, 4)
    assert hopper.tf32_tiles(128, 128, False) == (64, 32, 3, 4)
    monkeypatch.setenv("ELSA_HOPPER_TILES", "64,32")
    with pytest.raises(ValueError, match="ELSA_HOPPER_TILES"):
        hopper.tiles(128, 128, False)


@pytest.mark.parametrize("group", ["1", "3", "8", "auto"])
@pytest.mark.parametrize("varlen", [False, True])
def test_causal_row_blocks_ordered_by_head_group(group, varlen, monkeypatch):
    """Causal grids run their row blocks heaviest first across groups of heads (occupancy.causal_head_group):
    one head at a time, groups of 3 over 8 batch-heads (the last group of 2), every head, and the L2 rule. Every
    program maps to a distinct (head, row block): outputs poisoned first, GQA, ragged rows, against the oracle."""
    from elsa_surgery.kernels import occupancy

    if group == "auto":
        monkeypatch.delenv(occupancy.ENV_HEAD_GROUP, raising=False)
    else:
        monkeypatch.setenv(occupancy.ENV_HEAD_GROUP, group)
    q, k, v = rand(2, 4, 150, 16), rand(2, 2, 170, 16), rand(2, 2, 170, 8)
    if not varlen:
        out, lse = poisoned_run(q, k, v, is_causal=True)
        check(out, lse, *oracle(q, k, v, is_causal=True), TOL["strict"])
        return
    lens_q, lens_k = [150, 61], [170, 90]
    qp = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_q)])
    kp = torch.cat([k[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_k)])
    vp = torch.cat([v[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_k)])
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
    out = elsa_surgery.attention_varlen(qp, kp, vp, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                        is_causal=True, backend="elsa", precision="strict")
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        ref, _ = oracle(q[b:b + 1, :, :nq], k[b:b + 1, :, :nk], v[b:b + 1, :, :nk], is_causal=True)
        got = out[sum(lens_q[:b]):sum(lens_q[:b + 1])].transpose(0, 1)
        assert rel(got, ref[0]) <= TOL["strict"]


def test_causal_head_group_rule_and_knob(monkeypatch):
    """The group is the number of query heads whose K/V (of this launch's keys) fit in CAUSAL_L2_SHARE of L2, or,
    when more, enough heads to balance the grid's tail (CAUSAL_BALANCE_PROGRAMS_PER_SM x SMs / row blocks); at
    least one and at most the launch's batch-heads; evened out over them (occupancy.even_groups).
    ELSA_CAUSAL_HEAD_GROUP forces it and is validated."""
    from elsa_surgery.kernels import occupancy

    monkeypatch.delenv(occupancy.ENV_HEAD_GROUP, raising=False)
    cpu = torch.device("cpu")  # one "SM" (occupancy._sms): the L2 rule decides
    share = int(occupancy.DEFAULT_L2_BYTES * occupancy.CAUSAL_L2_SHARE)
    per = 4096 * 2 * (128 + 128)  # bf16 K and V of one head, N = 4K
    kw = dict(kv_bytes_per_key=512, m_blocks=32)
    assert share // per == 12  # three groups of 32 heads: 11, 11 and 10 (12, 12, 8 before evening them)
    assert occupancy.causal_head_group(cpu, n_k=4096, groups=1, bh=32, **kw) == 11
    assert occupancy.causal_head_group(cpu, n_k=4096, groups=1, bh=24, **kw) == 12  # two groups of 12 as they were
    assert occupancy.causal_head_group(cpu, n_k=4096, groups=4, bh=32, **kw) == 32  # GQA: 4 heads per K/V head
    assert occupancy.causal_head_group(cpu, n_k=65536, groups=1, bh=32, **kw) == 1
    assert occupancy.causal_head_group(cpu, n_k=128, groups=1, bh=6, **kw) == 6
    monkeypatch.setattr(occupancy, "_sms", lambda device: 132)  # an H100's balance term
    assert occupancy.causal_head_group(cpu, n_k=65536, groups=1, bh=32, kv_bytes_per_key=512, m_blocks=32) == 16
    assert occupancy.causal_head_group(cpu, n_k=65536, groups=1, bh=32, kv_bytes_per_key=512, m_blocks=512) == 1
    # evened groups: as many as before, the last one never smaller (session 45: 16 heads in 12 + 4 -> 8 + 8)
    for bh, group, even in ((16, 12, 8), (32, 12, 11), (16, 16, 16), (16, 5, 4), (7, 3, 3), (5, 1, 1), (1, 1, 1)):
        assert occupancy.even_groups(bh, group) == even, (bh, group)
        n = -(-bh // group)
        assert -(-bh // even) == n and bh - (n - 1) * even >= bh - (n - 1) * group
    # GQA: whole K/V heads' query heads a group (units of 4: 32 heads in groups of 12 stay 12, 12, 8, not 11s)
    for bh, group, unit, even in ((32, 12, 4, 12), (32, 8, 4, 8), (64, 24, 8, 24), (48, 20, 4, 16), (8, 3, 2, 4)):
        assert occupancy.even_groups(bh, group, unit) == even, (bh, group, unit)
        assert even % unit == 0 and -(-bh // even) <= -(-bh // group)
    # 12 K/V heads fit (24 query heads in pairs): two groups of 32, evened to 16 + 16
    assert occupancy.causal_head_group(cpu, n_k=4096, groups=2, bh=32, **kw) == 16
    monkeypatch.setenv(occupancy.ENV_HEAD_GROUP, "5")
    assert occupancy.causal_head_group(cpu, n_k=65536, groups=1, bh=32, **kw) == 5
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(occupancy.ENV_HEAD_GROUP, bad)
        with pytest.raises(ValueError, match=occupancy.ENV_HEAD_GROUP):
            occupancy.causal_head_group(cpu, n_k=1, kv_bytes_per_key=1, groups=1, bh=1, m_blocks=1)
