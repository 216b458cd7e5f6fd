"""Masked calls with the mask's tiles classified first (``scan.mask_tile_ranges``, ``ELSA_MASK_TILES``): the ranges
against a classification in torch, masked calls against the float64 oracle, and proof that blocks the mask hides
are never read. Small shapes for the Triton interpreter: rows of at least 8 key blocks (the CPU tiles are 32 keys)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are decorated (kernels/scan.py is imported lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import launch, occupancy
from kernel_env import DEV, needs_kernels
from test_backward import _check, _leaf
from test_kernels import TOL, oracle, rand, rel

pytestmark = needs_kernels


def tol(dtype):
    return TOL["strict" if dtype == torch.float32 else dtype]


def structured(kind, nq, nk, g):
    """A boolean ``[nq, nk]`` mask (True = attend) of the shapes models build."""
    i, j = torch.arange(nq)[:, None] + (nk - nq), torch.arange(nk)[None, :]
    if kind == "causal":
        return j <= i
    if kind == "packed":  # block-diagonal causal: three documents
        doc = torch.arange(nk) * 3 // nk
        return (j <= i) & (doc[None, :] == doc[i.clamp(0, nk - 1)])
    if kind == "window":
        return (j <= i) & (i - j < nk // 3)
    if kind == "padding":
        return (j < nk * 2 // 3).expand(nq, nk)
    if kind == "hidden_rows":  # random, with row tiles that see nothing
        m = torch.rand(nq, nk, generator=g) < 0.5
        m[: nq // 3] = False
        return m
    return torch.rand(nq, nk, generator=g) < 0.5


def plan_of(q, k, v, mask, precision="strict", **kw):
    sig = launch.call_signature(q, k, v, None, precision=precision if q.dtype == torch.float32 else None, mask=mask,
                                **kw)
    return launch.plan_launch(sig)


def torch_ranges(mask, bm, bn, nq, nk):
    """``[v_lo, f_lo, f_hi, v_hi]`` per row tile, as ``scan.mask_tile_ranges`` documents them, in torch."""
    P, H = mask.shape[:2]
    m = mask.expand(P, H, nq, nk).cpu()
    vis = m if m.dtype == torch.bool else m != float("-inf")
    clear = m if m.dtype == torch.bool else m == 0
    n_m, n_n = -(-nq // bm), -(-nk // bn)
    out = torch.zeros(P, H, n_m, 4, dtype=torch.int32)
    for p in range(P):
        for h in range(H):
            for t in range(n_m):
                rows = slice(t * bm, (t + 1) * bm)
                seen = [bool(vis[p, h, rows, j * bn:(j + 1) * bn].any()) for j in range(n_n)]
                whole = [bool(clear[p, h, rows, j * bn:(j + 1) * bn].all()) for j in range(n_n)]
                if not any(seen):
                    continue
                v_lo, v_hi = seen.index(True), n_n - seen[::-1].index(True)
                f_lo = f_hi = v_lo
                if any(whole):
                    f_lo = f_hi = whole.index(True)
                    while f_hi < n_n and whole[f_hi]:
                        f_hi += 1
                out[p, h, t] = torch.tensor([v_lo, f_lo, f_hi, v_hi])
    return out


@pytest.mark.parametrize("kind", ["causal", "packed", "window", "padding", "hidden_rows", "random"])
def test_tile_ranges_match_a_classification_in_torch(kind):
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    nq, nk = 150, 300  # ragged last tiles on both axes
    q, k, v = rand(1, 2, nq, 16), rand(1, 2, nk, 16), rand(1, 2, nk, 16)
    boolean = structured(kind, nq, nk, g)
    additive = torch.where(boolean, torch.where(torch.rand(nq, nk, generator=g) < 0.2, 0.5, 0.0), float("-inf"))
    headed = torch.stack([boolean, structured("random", nq, nk, g)])[None]  # [1, 2, nq, nk]
    for mask in (boolean[None, None], additive[None, None], headed, boolean[None, None, :1].expand(1, 1, nq, nk)):
        mask = mask.to(DEV)
        plan = plan_of(q, k, v, mask)
        assert plan.mask_ranges, "rows of 10 key blocks must classify the mask's tiles"
        got = launch._mask_ranges(mask, plan.dims, plan.cfg, plan.n_mblocks).cpu()
        want = torch_ranges(mask, plan.cfg.block_m, plan.cfg.block_n, nq, nk)
        assert torch.equal(got, want), (kind, mask.dtype, tuple(mask.shape), got, want)


CASES = [  # (mask kind, dtype, causal, kv_lengths, partitions, Hq:Hkv, mask heads, mask period)
    ("causal", torch.float32, False, False, None, "2:2", 1, 1),
    ("packed", torch.bfloat16, True, False, None, "4:2", 1, 1),
    ("window", torch.float32, True, True, 3, "2:1", 1, 1),
    ("padding", torch.float32, False, True, None, "2:2", 2, 2),
    ("hidden_rows", torch.float32, False, False, 2, "2:2", 1, 2),
    ("random", torch.bfloat16, False, False, None, "2:2", 2, 1),
]


@pytest.mark.parametrize("kind,dtype,causal,lengths,parts,heads,mheads,period", CASES)
@pytest.mark.parametrize("additive", [False, True])
def test_masked_calls_with_tile_ranges_match_the_oracle(kind, dtype, causal, lengths, parts, heads, mheads, period,
                                                        additive):
    g = torch.Generator().manual_seed(7)
    hq, hkv = (int(x) for x in heads.split(":"))
    B, nq, nk = 2, 130, 290
    q, k, v = rand(B, hq, nq, 16, dtype=dtype), rand(B, hkv, nk, 16, dtype=dtype), rand(B, hkv, nk, 24, dtype=dtype)
    planes = torch.stack([torch.stack([structured(kind, nq, nk, g) for _ in range(mheads)]) for _ in range(period)])
    mask = planes
    if additive:  # -inf where hidden, 0 or a bias elsewhere (only the -inf / 0 tiles are skipped / unmasked)
        mask = torch.where(planes, torch.where(torch.rand(planes.shape, generator=g) < 0.1, -1.5, 0.0), float("-inf"))
        mask = mask.to(dtype)
    mask = mask.to(DEV)
    kv_lengths = torch.tensor([nk, nk - 45], device=DEV, dtype=torch.int32) if lengths else None
    assert plan_of(q, k, v, mask, is_causal=causal, kv_lengths=kv_lengths, num_partitions=parts).mask_ranges
    full = mask.expand(B, mheads, nq, nk) if period == 1 else mask  # the kernels' b % period is the identity here
    ref_out, ref_lse = oracle(q, k, v, full, is_causal=causal, kv_lengths=kv_lengths)
    out, lse = launch.attention(q, k, v, scale=16 ** -0.5, mask=mask, is_causal=causal, kv_lengths=kv_lengths,
                                precision="strict" if dtype == torch.float32 else None, num_partitions=parts)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel(out, ref_out) <= tol(dtype), rel(out, ref_out)
    fin = torch.isfinite(ref_lse.cpu())
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert rel(lse.cpu()[fin], ref_lse.cpu()[fin]) <= max(tol(dtype), 1e-6)


def test_blocks_the_mask_hides_are_never_read():
    """NaN in V where the mask hides every key of some blocks from every row: the masked loop would fold them
    (0 · NaN = NaN), the tile ranges skip them. The same call with ``ELSA_MASK_TILES=0`` shows the test can fail."""
    g = torch.Generator().manual_seed(3)
    nq, nk = 64, 320
    q, k, v = rand(1, 1, nq, 16), rand(1, 1, nk, 16), rand(1, 1, nk, 16)
    mask = structured("window", nq, nk, g).to(DEV)[None, None]  # rows see keys [nk - nq - nk // 3, nk)
    hidden = ~mask[0, 0].any(0)  # keys no row sees
    assert hidden[:64].all()
    ref = oracle(q, k, v, mask)[0]
    v_bad = v.clone()
    v_bad[..., :64, :] = float("nan")  # two whole 32-key blocks nobody sees
    out = launch.attention(q, k, v_bad, scale=0.25, mask=mask, precision="strict")[0]
    assert not torch.isnan(out).any() and rel(out, ref) <= tol(torch.float32)
    with benchmark.environ({"ELSA_MASK_TILES": "0"}):
        assert not plan_of(q, k, v, mask).mask_ranges
        assert torch.isnan(launch.attention(q, k, v_bad, scale=0.25, mask=mask, precision="strict")[0]).any()


def test_short_rows_and_decode_keep_the_plain_masked_loop():
    """Rows of fewer than MASK_RANGE_MIN_KEY_BLOCKS key blocks, and packed decode rows, classify nothing."""
    q, k, v = rand(1, 2, 64, 16), rand(1, 2, 96, 16), rand(1, 2, 96, 16)
    mask = torch.ones(1, 1, 64, 96, dtype=torch.bool, device=DEV)
    plan = plan_of(q, k, v, mask)
    assert -(-96 // plan.cfg.block_n) < occupancy.MASK_RANGE_MIN_KEY_BLOCKS and not plan.mask_ranges
    q1 = rand(1, 4, 1, 16)
    k1, v1 = rand(1, 1, 4096, 16), rand(1, 1, 4096, 16)
    m1 = torch.ones(1, 1, 1, 4096, dtype=torch.bool, device=DEV)
    plan = plan_of(q1, k1, v1, m1)
    assert plan.pack_rows is not None and not plan.mask_ranges


# --- the backward: the key pass walks each key tile's row-block ranges, the row pass (dQ) each row tile's key ranges


def _spy_ranges(monkeypatch, tiles="all"):
    """Which passes ran with the mask's tile ranges: ``{pass name: [ranges given?, ...]}``, with ``ELSA_MASK_TILES``
    set to ``tiles`` (None: unset, the default); ``"short"`` where the pass's lines at its tile (the device's) span
    fewer than ``occupancy.MASK_RANGE_MIN_KEY_BLOCKS`` blocks, which classify nothing."""
    from elsa_surgery.kernels import backward_launch

    if tiles is None:
        monkeypatch.delenv("ELSA_MASK_TILES", raising=False)
    else:
        monkeypatch.setenv("ELSA_MASK_TILES", tiles)
    seen, real = {}, backward_launch._Call.mask_ranges

    def spy(self, name, bm, bn):
        r = real(self, name, bm, bn)
        line = -(-self.Nq // bm) if name == "bwd_kv" else -(-self.Nk // bn)
        seen.setdefault(name, []).append("short" if line < occupancy.MASK_RANGE_MIN_KEY_BLOCKS else r is not None)
        return r

    monkeypatch.setattr(backward_launch._Call, "mask_ranges", spy)
    return seen


def _assert_ranges_taken(seen):
    """Both passes ran once, each on the ranges unless its lines are short at the device's tiles (the GPU's row pass
    tiles are wider than the interpreter's), and at least one pass on them."""
    assert set(seen) == {"bwd_kv", "row_pass"} and all(len(runs) == 1 for runs in seen.values()), seen
    assert all(runs[0] in (True, "short") for runs in seen.values()) and True in sum(seen.values(), []), seen


def test_backward_with_tile_ranges_matches_the_oracle(monkeypatch):
    """A causal window (bool, one mask for both heads of a GQA pair), padded key lengths: dQ, dK, dV against the
    float64 oracle's autograd (test_backward's check, dQ by the row pass), both backward passes on the mask's tile
    ranges."""
    seen = _spy_ranges(monkeypatch)
    g = torch.Generator().manual_seed(11)
    nq, nk = 260, 270
    q, k, v = _leaf(2, 4, nq, 16), _leaf(2, 2, nk, 16), _leaf(2, 2, nk, 8)
    mask = structured("window", nq, nk, g).to(DEV)[None, None]
    _check(q, k, v, mask, deterministic=True, kv_lengths=torch.tensor([nk, 200], dtype=torch.int32))
    _assert_ranges_taken(seen)


def test_mask_gradient_with_tile_ranges_matches_the_oracle(monkeypatch):
    """A learnable additive mask (-inf outside a packed-sequence pattern, a bias inside) with causal on top: its
    gradient (dS, zero in the skipped tiles) at its broadcast shape, against the oracle."""
    seen = _spy_ranges(monkeypatch)
    g = torch.Generator().manual_seed(12)
    n = 256
    q, k, v = _leaf(1, 2, n, 16), _leaf(1, 2, n, 16), _leaf(1, 2, n, 16)
    pattern = structured("packed", n, n, g)
    bias = torch.where(pattern, 0.3 * torch.randn(n, n, dtype=torch.float64, generator=g), float("-inf"))
    mask = bias.float().to(DEV)[None, None].requires_grad_()
    dm = _check(q, k, v, mask, deterministic=True, is_causal=True)[3]
    assert dm.shape == mask.shape and (dm[0, 0][~pattern.to(DEV)] == 0).all()
    _assert_ranges_taken(seen)


def test_backward_never_reads_blocks_the_mask_hides(monkeypatch):
    """NaN in K and V at keys no row sees (two whole blocks): finite gradients with the tile ranges, zero dK, dV
    there, and the oracle's gradients elsewhere (the masked loops would fold 0 · NaN into dQ)."""
    monkeypatch.setenv("ELSA_MASK_TILES", "all")
    g = torch.Generator().manual_seed(13)
    nq, nk = 256, 512  # the first row sees keys [87, 256]
    q, k, v = _leaf(1, 1, nq, 16), _leaf(1, 1, nk, 16), _leaf(1, 1, nk, 16)
    mask = structured("window", nq, nk, g).to(DEV)[None, None]
    assert not mask[0, 0, :, :64].any()
    go = torch.randn(1, 1, nq, 16, dtype=torch.float64, generator=g).to(DEV)
    kb, vb = (t.detach().clone() for t in (k, v))
    kb[..., :64, :], vb[..., :64, :] = float("nan"), float("nan")
    kb.requires_grad_(), vb.requires_grad_()
    out = elsa_surgery.attention(q, kb, vb, attn_mask=mask, backend="elsa", precision="strict")
    dq, dk, dv = torch.autograd.grad((out.double() * go).sum(), [q, kb, vb])
    assert torch.isfinite(dq).all() and (dk[..., :64, :] == 0).all() and (dv[..., :64, :] == 0).all()
    ref = elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa", precision="strict")
    rq, rk, rv = torch.autograd.grad((ref.double() * go).sum(), [q, k, v])
    assert torch.equal(dq, rq) and torch.equal(dk[..., 64:, :], rk[..., 64:, :])


@pytest.mark.parametrize("tiles", [None, "forward"])
def test_backward_ranges_by_default_and_off_with_forward(tiles, monkeypatch):
    """The default (``all``) classifies the mask for the backward's two passes too; ``forward`` for the forward only.
    H100, session 35 (bwd_kv and the row pass each walking their masked runs in one loop): forward + backward of
    structured masks 1.7-2.5x faster with the backward's ranges, an unstructured mask's 0.96-1.05x the time (session
    34, before the one-loop walk: 1.49x, so they waited for ``all``)."""
    seen = _spy_ranges(monkeypatch, tiles=tiles)
    g = torch.Generator().manual_seed(14)
    q, k, v = _leaf(1, 1, 256, 16), _leaf(1, 1, 256, 16), _leaf(1, 1, 256, 16)
    mask = structured("causal", 256, 256, g).to(DEV)[None, None]
    assert plan_of(q.detach(), k.detach(), v.detach(), mask).mask_ranges
    out = elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa", precision="strict")
    torch.autograd.grad(out.sum(), [q, k, v])
    if tiles is None:
        _assert_ranges_taken(seen)
    else:
        assert seen and not any(ran is True for runs in seen.values() for ran in runs), seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,D", [(torch.bfloat16, None, 128), (torch.bfloat16, None, 64),
                                               (torch.float32, "precise", 64)])
@pytest.mark.parametrize("kind", ["causal", "packed"])
def test_gpu_backward_tile_ranges_as_exact_as_without(dtype, precision, D, kind, monkeypatch):
    """The backward's tile ranges on the compiled kernels (the GPU tiles, GQA 8:2, N = 2K, a bool mask and a
    learnable -inf / bias mask): gradients within 1.5x of the same call's without ranges, measured against float64
    (SDPA's math backend), and the passes did take the ranges. Written in session 33, whose device time ran out
    before it could run; it passed on an H100 in session 34."""
    seen = _spy_ranges(monkeypatch)
    g = torch.Generator().manual_seed(21)
    n = 2048
    q, k, v = (torch.randn(1, h, n, D, generator=g).to("cuda", dtype).requires_grad_() for h in (8, 2, 2))
    go = torch.randn(1, 8, n, D, generator=g).to("cuda", dtype)
    pattern = structured(kind, n, n, g).to("cuda")
    bias = torch.where(pattern, 0.2 * torch.randn(n, n, generator=g).to("cuda"), float("-inf"))
    for mask in (pattern[None, None], bias.to(dtype)[None, None].requires_grad_()):
        leaves = [q, k, v] + ([mask] if mask.requires_grad else [])
        exact = [t.detach().double().requires_grad_() for t in leaves]
        emask = exact[3] if mask.requires_grad else mask
        ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            exact[0], exact[1].repeat_interleave(4, 1), exact[2].repeat_interleave(4, 1), attn_mask=emask), exact,
            go.double())
        errs = {}
        for tiles in ("all", "0"):
            monkeypatch.setenv("ELSA_MASK_TILES", tiles)
            out = elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa", precision=precision,
                                         enable_gqa=True)
            got = torch.autograd.grad(out, leaves, go)
            assert all(torch.isfinite(t).all() for t in got)
            errs[tiles] = max(rel(a, b) for a, b in zip(got, ref))
        assert errs["all"] <= max(1.5 * errs["0"], 1e-6), errs
    assert seen["bwd_kv"][0] is True and seen["row_pass"][0] is True, seen
