"""ELSA kernels on the GPU at large shapes, plus torch.compile(fullgraph=True) and CUDA-graph capture.

The float64 oracle is the package's reference backend (chunked, O(N) memory) run on the GPU.
"""

import pytest
import torch

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import launch
from elsa_surgery.kernels import replay as launch_plans
from oracle import decoy

pytestmark = pytest.mark.gpu

TOL = {"strict": 2e-6, "precise": 2e-6, "turbo": 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _dtype(kind):
    """The tests of the Gluon kernels run on a ``kind``: a dtype (fp16/bf16) or an fp32 mode ("strict", "turbo")."""
    return kind if isinstance(kind, torch.dtype) else torch.float32


def _precision(kind):
    """The fp32 mode of a kind (the CUDA default is ``precise``, which no Gluon kernel runs); ``torch.float32``
    means ``strict``."""
    if kind == torch.float32:
        return "strict"
    return None if isinstance(kind, torch.dtype) else kind


def _mode(kind):
    """TOL's key for a kind (see _precision)."""
    return _precision(kind) or kind


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def oracle(q, k, v, **kw):
    return elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference", return_lse=True,
                                  enable_gqa=True, **kw)


def poisoned(q, k, v, precision, **kw):
    """``launch.attention`` into NaN-filled outputs, run first on decoys of q, k, v (same geometry, other values)
    when launch plans are on: the checked call replays the plan the decoys recorded (kernels/replay.py), as every
    later call of a signature does."""
    B, Hq, Nq, _ = q.shape

    def run(q, k, v):
        out = torch.full((B, Hq, Nq, v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
        lse = torch.full((B, Hq, Nq), float("nan"), device="cuda")
        launch.attention(q, k, v, scale=q.shape[-1] ** -0.5, precision=precision, out=out, lse=lse, **kw)
        return out, lse

    if launch_plans.wanted(q):
        run(decoy(q), decoy(k), decoy(v))
    return run(q, k, v)


@pytest.mark.parametrize("mode", ["strict", "precise", "turbo", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_modes_4k(mode, causal):
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    prec = mode if dtype == torch.float32 else None
    q, k, v = (rand(1, 4, 4096, 128, dtype=dtype) for _ in range(3))
    out, lse = poisoned(q, k, v, prec, is_causal=causal)
    ro, rl = oracle(q, k, v, is_causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out, ro) <= TOL[mode], rel(out, ro)
    assert rel(lse, rl) <= max(TOL[mode], 1e-6)


@pytest.mark.parametrize("mode", ["strict", "precise", "turbo", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,dv", [(80, 80), (256, 256), (72, 136), (8, 8)])
def test_head_dims_every_kind(mode, d, dv):
    """Every tile-table row compiles (shared memory fits) and is accurate, odd head dims included."""
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = rand(2, 2, 1000, d, dtype=dtype), rand(2, 2, 1100, d, dtype=dtype), rand(2, 2, 1100, dv, dtype=dtype)
    out, lse = poisoned(q, k, v, mode if dtype == torch.float32 else None, is_causal=True)
    ro, _ = oracle(q, k, v, is_causal=True)
    assert not out.isnan().any() and rel(out, ro) <= TOL[mode], rel(out, ro)


@pytest.mark.parametrize("mode", ["strict", "precise", "turbo", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,n", [(32, 49), (64, 197), (72, 300), (64, 1500)])
def test_short_sequence_tiles_every_kind(mode, d, n):
    """The short-sequence and mid-length tile rows (Swin windows with a per-window mask, ViT token counts)
    compile and are accurate, every element written."""
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = (rand(6, 3, n, d, dtype=dtype) for _ in range(3))
    mask = torch.randn(2, 3, n, n, device="cuda")
    mask[1, :, :, ::3] = float("-inf")
    mask = mask.to(dtype) if n < 100 else None  # windowed: batch row b reads mask row b % 2
    out, lse = poisoned(q, k, v, mode if dtype == torch.float32 else None, mask=mask)
    ro = elsa_surgery.attention(q.double(), k.double(), v.double(), None if mask is None else mask.double(),
                                windowed_mask=mask is not None, backend="reference")
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out, ro) <= TOL[mode], rel(out, ro)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_65k(dtype):
    N = 65536
    q, k, v = (rand(1, 1, N, 128, dtype=dtype) for _ in range(3))
    prec = "precise" if dtype == torch.float32 else None
    out, lse = poisoned(q, k, v, prec, is_causal=True)
    ro, _ = oracle(q, k, v, is_causal=True)
    assert not out.isnan().any()
    assert rel(out, ro) <= TOL[prec or dtype], rel(out, ro)


@pytest.mark.parametrize("n", [16384, 65536])
def test_strict_is_the_most_exact_mode_at_long_lengths(n):
    """strict (IEEE FMA, each key tile's P·V added with Kahan compensation) stays within 1e-6 of float64 and at
    least as close as precise (3xTF32), on 256 sampled query rows over all n keys (D = 64)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", generator=g) for _ in range(3))
    rows = torch.randperm(n, device="cuda", generator=g)[:256]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, rows].double(), k.double(), v.double())
    err = {mode: rel(elsa_surgery.attention(q, k, v, backend="elsa", precision=mode)[:, :, rows], ref)
           for mode in ("strict", "precise")}
    assert err["strict"] <= 1e-6 and err["strict"] <= err["precise"], err


@pytest.mark.parametrize("kind", [torch.bfloat16, torch.float16, "strict", "precise", "turbo"])
@pytest.mark.parametrize("nq,hq,hkv,nk", [(1, 32, 8, 32768), (8, 32, 4, 4096), (3, 8, 8, 20000), (1, 48, 48, 8192)])
def test_packed_decode_path_on_the_gpu(kind, nq, hq, hkv, nk):
    """The packed short-query kernel (GQA group in one row tile, split K, row merge) at decode shapes, causal
    bottom-right with per-row cache lengths; each tile of occupancy.decode_tile_config's rule on a Hopper GPU (few
    (batch, K/V head) pairs: 3 stages; one row per K/V head over 96 pairs, 2-byte operands: 128-key tiles)."""
    dtype, prec = _dtype(kind), _precision(kind)
    q, k, v = rand(2, hq, nq, 128, dtype=dtype), rand(2, hkv, nk, 128, dtype=dtype), rand(2, hkv, nk, 128, dtype=dtype)
    kl = torch.tensor([nk, nk // 3], dtype=torch.int32, device="cuda")
    out, lse = poisoned(q, k, v, prec, is_causal=True, kv_lengths=kl)
    ro, rl = oracle(q, k, v, is_causal=True, kv_lengths=kl)
    assert not out.isnan().any()
    assert rel(out, ro) <= TOL[_mode(kind)], rel(out, ro)


def test_split_k_decode_and_gqa():
    """Few query rows, long keys: the occupancy model splits K and phase 2 merges."""
    q, k, v = rand(2, 8, 16, 128, dtype=torch.bfloat16), rand(2, 2, 20000, 128, dtype=torch.bfloat16), \
        rand(2, 2, 20000, 64, dtype=torch.bfloat16)
    out, lse = poisoned(q, k, v, None, is_causal=True)
    ro, rl = oracle(q, k, v, is_causal=True)
    assert rel(out, ro) <= 2e-2 and rel(lse, rl) <= 1e-5
    m, S, W = launch.attention_state(q, k, v, scale=128 ** -0.5, is_causal=True)
    fo, fl = elsa_surgery.monoid.finalize(elsa_surgery.monoid.State(m, S, W))
    assert rel(fo, ro) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_8_random(dtype, causal):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(256, 1793, (8,), generator=g)
    cu = torch.zeros(9, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu = cu.cuda()
    total, mx = int(lens.sum()), int(lens.max())
    q, k, v = (rand(total, 8, 128, dtype=dtype) for _ in range(3))
    out = elsa_surgery.attention_varlen(q, k, v, cu, cu, mx, mx, is_causal=causal, backend="elsa",
                                        precision="precise" if dtype == torch.float32 else None)
    ro = elsa_surgery.attention_varlen(q.double(), k.double(), v.double(), cu, cu, mx, mx, is_causal=causal,
                                       backend="reference")
    assert rel(out, ro) <= (2e-6 if dtype == torch.float32 else 2e-2)


def test_masks_gpu():
    B, H, N = 4, 4, 1000
    q, k, v = (rand(B, H, N, 80, dtype=torch.float16) for _ in range(3))
    mask = torch.rand(2, 1, N, N, device="cuda") > 0.3
    out = elsa_surgery.attention(q, k, v, mask, windowed_mask=True, backend="elsa")
    ro = elsa_surgery.attention(q.double(), k.double(), v.double(), mask, windowed_mask=True, backend="reference")
    assert rel(out, ro) <= 5e-3


def _compile_across_lengths(kind=torch.bfloat16):
    """A causal call under torch.compile(fullgraph=True) over four lengths: accurate, and at most one static
    compile plus one dynamic-shape recompile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    prec, dtype = _precision(kind), _dtype(kind)
    cf = torch.compile(lambda q, k, v: elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa",
                                                              precision=prec) * 2, fullgraph=True)
    counters.clear()
    for n in (1000, 1500, 2100, 3000):
        q, k, v = (rand(1, 4, n, 64, dtype=dtype) for _ in range(3))
        assert rel(cf(q, k, v), oracle(q, k, v, is_causal=True)[0] * 2) <= TOL[_mode(kind)]
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def _cuda_graph_replay(d: int, kind=torch.float16):
    """A causal call captured in a CUDA graph, replayed on new inputs written into the captured ones."""
    q, k, v = (rand(2, 4, 777, d, dtype=_dtype(kind)) for _ in range(3))
    prec = _precision(kind)
    replay = benchmark.cuda_graph(lambda: elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa",
                                                                 precision=prec))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    out = replay()
    torch.cuda.synchronize()
    assert rel(out, oracle(q, k, v, is_causal=True)[0]) <= TOL[_mode(kind)]


def test_torch_compile_fullgraph_no_recompile_storm():
    _compile_across_lengths()


def test_cuda_graph_capture():
    _cuda_graph_replay(64)


def test_cuda_graph_helper_keeps_its_inputs_alive():
    """benchmark.cuda_graph's replay holds the captured call, hence the graph's inputs: dropping every other
    reference and emptying the allocator cache must not free (or unmap) them."""
    import gc

    q, k, v = (rand(2, 4, 333, 64, dtype=torch.float16) for _ in range(3))

    def make():
        qc, kc, vc = q.clone(), k.clone(), v.clone()  # referenced only by the captured call
        return benchmark.cuda_graph(lambda: elsa_surgery.attention(qc, kc, vc, backend="elsa"))

    replay = make()
    gc.collect()
    torch.cuda.empty_cache()
    junk = torch.full((1 << 24,), float("nan"), device="cuda")  # would take over freed input memory
    out = replay()
    torch.cuda.synchronize()
    del junk
    assert rel(out, oracle(q, k, v)[0]) <= 5e-3

@pytest.mark.parametrize("mode", ["precise", "turbo"])
@pytest.mark.parametrize("h,d,plan", [(8, 64, "keys"), (32, 128, "heads")])
def test_fp32_tensor_core_modes_extra_memory_within_1_1x_me_sdpa(mode, h, d, plan):
    """V staged in pieces (key chunks for 8 heads, K/V-head groups for 32) keeps the fp32 tensor-core modes'
    peak extra memory within 1.1x ME-SDPA's at N = 16K (issue target), fp32-accurate."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from elsa_surgery.kernels import occupancy as occ

    q, k, v = (rand(1, h, 16384, d) for _ in range(3))
    got = occ.stage_plan(q.device, n_k=16384, block_n=64, batch=1, kv_heads=h, groups=1, m_blocks=128,
                         out_bytes=q.numel() * 4, v_bytes_per_key_head=d * 4, stats_bytes=2 * h * 16384 * 4)
    assert got[0] == plan, got

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), benchmark.PeakMemory("cuda") as me:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with benchmark.PeakMemory("cuda") as ours:
        out = elsa_surgery.attention(q, k, v, backend="elsa", precision=mode)
    assert ours.mib <= 1.1 * me.mib, (ours.mib, me.mib)
    ro = oracle(q[:, :2], k[:, :2], v[:, :2])[0]
    assert rel(out[:, :2], ro) <= TOL[mode], rel(out[:, :2], ro)


@pytest.mark.parametrize("mode", ["precise", "turbo"])
@pytest.mark.parametrize("h,d", [(8, 64), (32, 128)])
def test_causal_key_chunks_in_the_output_within_1_1x_me_sdpa(mode, h, d, monkeypatch):
    """Causal fp32 tensor-core calls at N = 16K on the portable kernel (``ELSA_HOPPER=0``: what GPUs other than
    Hopper run, and Hopper for ``precise``) stage their key chunks in reverse order, most of them in the output's
    untouched rows: peak extra memory within 1.1x causal ME-SDPA's (issue target), fp32-accurate. On Hopper,
    ``turbo`` runs the Gluon kernel, which stages nothing: within 1.1x as well."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runs = []
    real = launch._key_chunk_fwd
    monkeypatch.setattr(launch, "_key_chunk_fwd", lambda fwd, q, k, v, out, lse, mask, chunks, region, *a: runs.append(
        (chunks, region is not None)) or real(fwd, q, k, v, out, lse, mask, chunks, region, *a))
    q, k, v = (rand(1, h, 16384, d) for _ in range(3))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), benchmark.PeakMemory("cuda") as me:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mode == "turbo" and _is_hopper():
        hopper_runs = _count_hopper_runs(monkeypatch)
        with benchmark.PeakMemory("cuda") as ours:
            elsa_surgery.attention(q, k, v, backend="elsa", precision=mode, is_causal=True)
        assert len(hopper_runs) == 1 and runs == [] and ours.mib <= 1.1 * me.mib, (hopper_runs, ours.mib, me.mib)
    monkeypatch.setenv("ELSA_HOPPER", "0")
    with benchmark.PeakMemory("cuda") as ours:
        out = elsa_surgery.attention(q, k, v, backend="elsa", precision=mode, is_causal=True)
    assert ours.mib <= 1.1 * me.mib, (ours.mib, me.mib)
    (chunks, reverse), = runs
    in_out = sum(e - s for s, e, cap in chunks if cap is not None)
    assert reverse and in_out >= 16384 * 3 // 4, chunks
    ro = oracle(q[:, :2], k[:, :2], v[:, :2], is_causal=True)[0]
    assert rel(out[:, :2], ro) <= TOL[mode], rel(out[:, :2], ro)


@pytest.mark.parametrize("kind", ["f16", "f16k"])
@pytest.mark.parametrize("plan", ["whole", "keys:1024", "rkeys:1024", "heads:1"])
@pytest.mark.parametrize("causal", [False, True])
def test_precise_f16_split_accuracy(plan, causal, kind, monkeypatch):
    """``precise`` through the fp16 split on the GPU's tensor cores (real fp16 MMAs and fp32 accumulation):
    GQA, causal, every staging plan, and magnitudes far from 1 (per-row Q, per-key K, per-dim V scales; logits
    in the hundreds, where fp32 itself misses the float64 oracle by ~2e-6) stay as accurate as IEEE fp32
    (``strict``) on the same data."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)  # f16k: V split in the kernel
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, plan)
    monkeypatch.setattr(occ, "MIN_CAUSAL_SPLIT_CHUNK_WORK", 0)
    splits = []
    real = launch._SplitKV.__call__
    monkeypatch.setattr(launch._SplitKV, "__call__", lambda self, k, v, views: splits.append(1) or real(self, k, v, views))
    q = rand(1, 8, 4096, 128) * torch.logspace(-2, 2, 4096, device="cuda")[:, None]
    k = rand(1, 2, 4096, 128) * torch.logspace(1, -1, 4096, device="cuda")[:, None]
    v = rand(1, 2, 4096, 128) * torch.logspace(-3, 3, 128, device="cuda")
    out, lse = poisoned(q, k, v, "precise", is_causal=causal)
    assert splits and not torch.isnan(out).any()
    ro, rl = oracle(q[:, :4], k[:, :1], v[:, :1], is_causal=causal)
    ieee, _ = poisoned(q, k, v, "strict", is_causal=causal)
    bound = max(TOL["precise"], 1.5 * rel(ieee[:, :4], ro))
    assert rel(out[:, :4], ro) <= bound, (rel(out[:, :4], ro), rel(ieee[:, :4], ro))
    assert rel(lse[:, :4], rl) <= 1e-6


@pytest.mark.parametrize("kind", ["f16", "f16k"])
@pytest.mark.parametrize("plan", ["whole", "keys:128", "rkeys:128"])
def test_precise_f16_split_padded_head_dims_masked(plan, kind, monkeypatch):
    """Regression (session-7 review, H100): the fp16 split with D=40, Dv=32, a float mask and causal returned NaN
    rows when its staging blocks were only 16-byte aligned, and the in-kernel V split (f16k) with those head dims
    returned NaN (masked) or faulted (unmasked). Staging blocks are now 64-byte strided and f16k falls back to the
    full split for padded head dims: every row finite and within the precise budget, for B = 1 and 3."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, plan)
    for B in (1, 3):
        for masked in (True, False):
            q, k = rand(B, 1, 1610, 40), rand(B, 1, 953, 40) * 2
            v = rand(B, 953, 1, 32).transpose(1, 2)
            mask = rand(B, 1, 1610, 953) if masked else None
            out, lse = poisoned(q, k, v, "precise", is_causal=True, mask=mask)
            ro, rl = oracle(q, k, v, is_causal=True, attn_mask=None if mask is None else mask.double())
            assert not torch.isnan(out).any() and not torch.isnan(lse).any(), (B, masked)
            assert rel(out, ro) <= TOL["precise"], (B, masked, rel(out, ro))


def test_precise_f16_split_more_batch_heads_than_grid_y(monkeypatch):
    """The fp16 split launches one program per (row block, batch, head) on grid axis x: B * H = 70,400 is past
    CUDA's 65,535 limit of grid axis y, where the batch-head index used to be."""
    from elsa_surgery.kernels import occupancy as occ

    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, "f16")
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, "whole")
    splits = []
    real = launch._SplitKV.__call__
    monkeypatch.setattr(launch._SplitKV, "__call__", lambda self, k, v, views: splits.append(k.shape) or real(self, k, v, views))
    q, k, v = rand(1100, 64, 40, 16), rand(1100, 64, 72, 16), rand(1100, 64, 72, 16)
    out, lse = poisoned(q, k, v, "precise")
    # the split really ran, on every batch row and head at once (twice with launch plans: poisoned's decoy call)
    assert splits and splits == [k.shape] * len(splits), splits
    sel = (slice(None, None, 97), slice(None))  # every 97th batch row, all heads
    ro, rl = oracle(q[sel], k[sel], v[sel])
    assert not torch.isnan(out).any()
    assert rel(out[sel], ro) <= TOL["precise"]
    assert rel(lse[sel], rl) <= TOL["precise"]


@pytest.mark.parametrize("case", ["head dim 264", "float64"])
def test_auto_falls_back_on_the_gpu_and_says_why(case):
    """On CUDA, ``auto`` runs what the kernels cannot (D > 256, float64) on the reference backend,
    recording the reason as a fallback; the same calls raise under ``backend="elsa"``."""
    from elsa_surgery import dispatch

    dtype = torch.float64 if case == "float64" else torch.float32
    d = 264 if case == "head dim 264" else 64
    q, k, v = (rand(2, 4, 300, d, dtype=dtype) for _ in range(3))
    drop = 0.0
    with dispatch.record() as log:
        torch.manual_seed(0)
        out = elsa_surgery.attention(q, k, v, dropout_p=drop)
    assert [(x.backend, x.fallback) for x in log] == [("reference", True)], log
    assert {"head dim 264": "D=264", "float64": "float64"}[case] in log[0].reason
    torch.manual_seed(0)
    assert torch.equal(out, elsa_surgery.attention(q, k, v, dropout_p=drop, backend="reference"))
    with pytest.raises(elsa_surgery.BackendUnavailable):
        elsa_surgery.attention(q, k, v, dropout_p=drop, backend="elsa")


def _is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _is_hopper(), reason="the Gluon kernel runs on sm_90 only")


def _count_hopper_runs(monkeypatch):
    """Counts the planner's calls of the Gluon kernels on real tensors; launch plans off, so that every call is
    planned. (A traced call's precompile, session 56, plans it on fake tensors too: not a run; session 58 found
    ``test_hopper_kernel_in_cuda_graphs_and_compile`` counting it, 5 runs for 4 lengths.)"""
    from torch._subclasses.fake_tensor import is_fake

    from elsa_surgery.kernels import hopper

    monkeypatch.setenv(launch_plans.ENV, "0")
    runs = []
    real = hopper.forward

    def counted(*a, **kw):
        if not is_fake(a[0]):
            runs.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(hopper, "forward", counted)
    return runs


def _layout(t, layout):
    """``t [B, H, N, D]`` as a view whose memory is ``[B, N, H, D]`` when ``layout == "bnhd"``."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bnhd" else t


@hopper_only
@pytest.mark.parametrize("kind", [torch.float16, torch.bfloat16, "strict", "turbo"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,Dv,layout", [
    (2, 4, 4, 1041, 1041, 64, 64, "bhnd"),
    (1, 8, 2, 1374, 77, 128, 128, "bnhd"),  # GQA; causal rows before the first key see none
    (2, 2, 1, 77, 1374, 128, 64, "bhnd"),  # MQA, Dv != D
    (1, 3, 3, 4096, 4096, 128, 128, "bnhd"),
    (3, 2, 2, 200, 333, 32, 16, "bhnd"),
])
def test_hopper_kernel_matches_the_oracle(kind, causal, B, Hq, Hkv, Nq, Nk, D, Dv, layout, monkeypatch):
    """The Gluon kernels (kernels/hopper.py: wgmma for fp16/bf16 and fp32 ``turbo``, FMA for fp32 ``strict``) on
    ragged lengths, Nq != Nk both ways, GQA/MQA, Dv != D, both memory layouts: outputs and lse against the float64
    oracle, every element written (poisoned first), rows with no key zeros with lse -inf, and the Gluon kernel
    really ran (``ELSA_HOPPER=force``: small calls too)."""
    monkeypatch.setenv("ELSA_NUM_PARTITIONS", "1")
    monkeypatch.setenv("ELSA_HOPPER", "force")
    runs = _count_hopper_runs(monkeypatch)
    dtype = _dtype(kind)
    q = _layout(rand(B, Hq, Nq, D, dtype=dtype), layout)
    k = _layout(rand(B, Hkv, Nk, D, dtype=dtype), layout)
    v = _layout(rand(B, Hkv, Nk, Dv, dtype=dtype), layout)
    out, lse = poisoned(q, k, v, _precision(kind), is_causal=causal)
    assert len(runs) == 1, runs
    ro, rl = oracle(q, k, v, is_causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    tol = TOL[_mode(kind)]
    assert rel(out, ro) <= tol, rel(out, ro)
    none = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), none) and (lse[none] < 0).all()
    assert (out[none] == 0).all()
    lse_tol = {"strict": 2e-6, "turbo": TOL["turbo"]}.get(_mode(kind), 1e-5)
    assert rel(lse[~none], rl[~none]) <= lse_tol, rel(lse[~none], rl[~none])
    # the public call (its own [B, N, H, Dv] output) takes the same kernel
    got = elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", enable_gqa=True,
                                 precision=_precision(kind))
    assert len(runs) == 2 and rel(got, ro) <= tol


def _ramped(B, H, N, D, steps, dtype):
    """q, k whose scores (scale D**-0.5) grow along the keys by ``steps[h]`` (log2 units) per 64 keys in head h
    (negative: fall), plus noise, so that the running max of every row moves by that much at each key tile. Values
    are bf16-representable, so that fp16 inputs and TF32 products hold them exactly."""
    from elsa_surgery.kernels import hopper

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, N, D, device="cuda", generator=g) * 0.3
    k = torch.randn(B, H, N, D, device="cuda", generator=g) * 0.3
    q[..., 0] = 4.0
    tile = torch.arange(N, device="cuda") // 64
    for h, step in enumerate(steps):
        k[:, h, :, 0] = (tile - (tile.max() if step < 0 else 0)) * abs(step) * D ** 0.5 / (4.0 * hopper.LOG2E)
    return q.to(torch.bfloat16).to(dtype), k.to(torch.bfloat16).to(dtype)



@hopper_only
@pytest.mark.parametrize("kind", [torch.bfloat16, torch.float16, "turbo"])  # turbo: never lazy, same checks
@pytest.mark.parametrize("lazy", ["force", "0"])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_lazy_rescale_matches_the_oracle(kind, lazy, causal, monkeypatch):
    """The wgmma kernel rescales its accumulator only when a row's max grows by more than ``RESCALE_SLACK``
    (``ELSA_HOPPER_LAZY``; by size by default, forced on and off here): scores that grow along the keys by 0.5, 3,
    7.9, 8.1, 20 and 200 per key tile (under and over the slack; a warp's vote skips or does the rescale), fall by
    20, or stay flat, at every tile configuration: outputs and lse against the float64 oracle, lazy or not."""
    from elsa_surgery.kernels import hopper

    monkeypatch.setenv("ELSA_NUM_PARTITIONS", "1")
    monkeypatch.setenv("ELSA_HOPPER", "force")
    monkeypatch.setenv(hopper.ENV_LAZY, lazy)
    decided = []
    real_rule = hopper.lazy_rescale
    monkeypatch.setattr(hopper, "lazy_rescale", lambda *a: decided.append(real_rule(*a)) or decided[-1])
    assert hopper.RESCALE_SLACK == 8.0  # the steps below straddle it
    dtype = _dtype(kind)
    steps = [0.5, 3.0, 7.9, 8.1, 20.0, 200.0, -20.0, 0.0]
    q, k = _ramped(1, len(steps), 777, 64, steps, dtype)
    v = rand(1, len(steps), 777, 64, dtype=dtype)
    ro, rl = oracle(q, k, v, is_causal=causal)
    for tiles in ("128,64,2,8", "128,128,2,8", "64,64,2,4", "64,128,2,4"):
        monkeypatch.setenv("ELSA_HOPPER_TILES", tiles)
        runs = _count_hopper_runs(monkeypatch)
        out, lse = poisoned(q, k, v, _precision(kind), is_causal=causal)
        assert len(runs) == 1, (tiles, runs)
        assert not out.isnan().any() and not lse.isnan().any(), tiles
        for h, step in enumerate(steps):  # per head: one head's large scores must not hide another's error
            assert rel(out[:, h], ro[:, h]) <= TOL[_mode(kind)], (tiles, step, rel(out[:, h], ro[:, h]))
            lse_tol = TOL["turbo"] if kind == "turbo" else 1e-5
            assert rel(lse[:, h], rl[:, h]) <= lse_tol, (tiles, step, rel(lse[:, h], rl[:, h]))
    # the fp16/bf16 kernel asked the rule once a call and got what the variable forces; the TF32 kernel never asks
    assert decided == ([] if kind == "turbo" else [lazy == "force"] * 4)


@hopper_only
@pytest.mark.parametrize("tiles", ["128,64,2,8", "128,128,2,8", "64,64,2,4", "64,128,2,4"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,B,Hq,Hkv,Nq,Nk,D,Dv,layout", [
    (torch.float16, 2, 4, 4, 1041, 1041, 64, 64, "bhnd"),
    (torch.bfloat16, 1, 8, 2, 1374, 77, 128, 128, "bnhd"),  # GQA; causal rows before the first key see none
    (torch.bfloat16, 2, 2, 1, 77, 1374, 32, 16, "bhnd"),
])
def test_hopper_kernel_every_tile_config(tiles, causal, dtype, B, Hq, Hkv, Nq, Nk, D, Dv, layout, monkeypatch):
    """Each tile configuration ``hopper.tiles`` chooses (by grid size and head dim), forced on shapes that would
    pick another: outputs and lse against the float64 oracle, poisoned outputs, rows with no key."""
    monkeypatch.setenv("ELSA_HOPPER_TILES", tiles)
    test_hopper_kernel_matches_the_oracle(dtype, causal, B, Hq, Hkv, Nq, Nk, D, Dv, layout, monkeypatch)


@hopper_only
@pytest.mark.parametrize("kind,tiles", [("strict", t) for t in ("64,64,2,4", "64,32,2,4", "128,32,2,8")]
                         + [("turbo", t) for t in ("128,64,2,8", "64,64,2,4", "64,128,2,4", "64,32,2,4")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,Dv,layout", [
    (2, 4, 4, 1041, 1041, 64, 64, "bhnd"),
    (1, 8, 2, 1374, 77, 128, 128, "bnhd"),  # GQA; causal rows before the first key see none
    (2, 2, 1, 77, 1374, 32, 16, "bhnd"),
    (1, 2, 2, 300, 500, 16, 128, "bhnd"),
])
def test_hopper_fp32_kernels_every_tile_config(kind, tiles, causal, B, Hq, Hkv, Nq, Nk, D, Dv, layout, monkeypatch):
    """The same for the fp32 kernels' tiles: ``strict`` (FMA, ``hopper.fma_tiles``) and ``turbo`` (TF32 wgmma,
    ``hopper.tf32_tiles``; its 64 x 128 tile fits narrow heads only)."""
    if kind == "turbo" and tiles == "64,128,2,4" and max(D, Dv) > 64:
        pytest.skip("64 x 128 fp32 tiles at D = 128 exceed shared memory")
    monkeypatch.setenv("ELSA_HOPPER_TILES", tiles)
    test_hopper_kernel_matches_the_oracle(kind, causal, B, Hq, Hkv, Nq, Nk, D, Dv, layout, monkeypatch)


@hopper_only
@pytest.mark.parametrize("case", ["mask", "head dim 80", "ELSA_HOPPER=0", "float32 precise", "negative scale",
                                  "float32 turbo negative scale"])
def test_hopper_kernel_not_taken_outside_its_scope(case, monkeypatch):
    """Calls outside the Gluon kernel's scope run the portable kernel, correctly."""
    monkeypatch.setenv("ELSA_NUM_PARTITIONS", "1")
    monkeypatch.setenv("ELSA_HOPPER", "0" if case == "ELSA_HOPPER=0" else "force")
    runs = _count_hopper_runs(monkeypatch)
    precision = case.split()[1] if case.startswith("float32") else None
    dtype = torch.float32 if precision else torch.bfloat16
    d = 80 if case == "head dim 80" else 64
    q, k, v = (rand(2, 4, 1000, d, dtype=dtype) for _ in range(3))
    mask = torch.rand(2, 1, 1000, 1000, device="cuda") > 0.2 if case == "mask" else None
    scale = -0.125 if case.endswith("negative scale") else None
    out = elsa_surgery.attention(q, k, v, mask, backend="elsa", scale=scale, precision=precision)
    assert runs == []
    ro = elsa_surgery.attention(q.double(), k.double(), v.double(), mask, backend="reference", scale=scale)
    assert rel(out, ro) <= TOL[precision or dtype]


@hopper_only
def test_hopper_forced_tiles_that_do_not_fit_name_the_variable(monkeypatch):
    """``ELSA_HOPPER_TILES`` forcing tiles whose shared memory exceeds the SM's (fp32 64 x 128 at D = 128) raises
    a ValueError naming the variable, not Triton's out-of-resources error, and writes nothing."""
    monkeypatch.setenv("ELSA_HOPPER", "force")
    monkeypatch.setenv("ELSA_HOPPER_TILES", "64,128,2,4")
    q, k, v = (rand(1, 2, 300, 128) for _ in range(3))
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="ELSA_HOPPER_TILES='64,128,2,4' does not fit"):
        launch.attention(q, k, v, scale=0.125, precision="turbo", out=out)
    assert (out == 7.0).all()


@hopper_only
def test_hopper_fp32_kernel_takes_any_scale(monkeypatch):
    """The fp32 kernel scales the scores before the row max (as the portable kernel), so a negative or zero
    scale runs on it too."""
    monkeypatch.setenv("ELSA_HOPPER", "force")
    runs = _count_hopper_runs(monkeypatch)
    q, k, v = (rand(2, 4, 1000, 64) for _ in range(3))
    for scale in (-0.125, 0.0):
        out = elsa_surgery.attention(q, k, v, backend="elsa", scale=scale, is_causal=True, precision="strict")
        ro = elsa_surgery.attention(q.double(), k.double(), v.double(), backend="reference", scale=scale,
                                    is_causal=True)
        assert rel(out, ro) <= TOL["strict"]
    assert len(runs) == 2


@hopper_only
@pytest.mark.parametrize("kind,big,small", [(torch.bfloat16, (8, 4096, 128), (8, 1024, 64)),
                                            ("strict", (8, 2048, 64), (2, 256, 64)),
                                            ("turbo", (8, 4096, 64), (8, 1024, 64))])
def test_hopper_kernel_taken_by_size_under_auto(kind, big, small, monkeypatch):
    """Unforced and without launch plans, the Gluon kernels take calls of at least ``hopper.MIN_WORK``
    (``MIN_WORK_FP32`` for strict, ``MIN_WORK_TF32`` for turbo) and leave smaller eager ones (whose launch they
    would make slower) to the portable kernel, but take them too when they are captured in a graph, or when launch
    plans replay them with encoded TMA maps (``replay.encodes_descriptors``: the launch then costs no more)."""
    from elsa_surgery.kernels import hopper

    least = {"strict": hopper.MIN_WORK_FP32, "turbo": hopper.MIN_WORK_TF32}.get(kind, hopper.MIN_WORK)
    dtype = _dtype(kind)
    monkeypatch.delenv("ELSA_HOPPER", raising=False)
    runs = _count_hopper_runs(monkeypatch)
    h, n, d = big
    q, k, v = (rand(1, h, n, d, dtype=dtype) for _ in range(3))
    assert h * n * n * d >= least
    out = elsa_surgery.attention(q, k, v, backend="elsa", precision=_precision(kind))
    assert len(runs) == 1
    assert rel(out[:, :2], oracle(q[:, :2], k[:, :2], v[:, :2])[0]) <= TOL[_mode(kind)]  # two heads: quick
    h, n, d = small
    q, k, v = (rand(1, h, n, d, dtype=dtype) for _ in range(3))
    assert h * n * n * d < least
    eager = elsa_surgery.attention(q, k, v, backend="elsa", precision=_precision(kind))
    assert len(runs) == 1
    # captured in a CUDA graph, the same small call takes the Gluon kernel (host time is paid once)
    replay = benchmark.cuda_graph(lambda: elsa_surgery.attention(q, k, v, backend="elsa",
                                                                 precision=_precision(kind)))
    assert len(runs) == 2
    assert rel(replay(), eager) <= 2 * TOL[_mode(kind)]
    monkeypatch.setenv(launch_plans.ENV, "1")
    planned = elsa_surgery.attention(q, k, v, backend="elsa", precision=_precision(kind))
    encoded = launch_plans.encodes_descriptors(q)
    assert len(runs) == 2 + encoded
    assert rel(planned, eager) <= 2 * TOL[_mode(kind)]
    import triton

    if triton.__version__.startswith("3.6"):
        assert encoded


@hopper_only
@pytest.mark.parametrize("kind", [torch.float16, "strict", "turbo"])
def test_hopper_kernel_in_cuda_graphs_and_compile(kind, monkeypatch):
    """The Gluon kernels capture in a CUDA graph (descriptors are launch parameters) and run inside
    torch.compile(fullgraph=True) across lengths without a recompile per length."""
    monkeypatch.setenv("ELSA_NUM_PARTITIONS", "1")
    monkeypatch.setenv("ELSA_HOPPER", "force")
    runs = _count_hopper_runs(monkeypatch)
    _cuda_graph_replay(128, kind)
    assert runs
    runs.clear()
    _compile_across_lengths(torch.bfloat16 if kind == torch.float16 else kind)
    assert len(runs) == 4


def _plan_launches():
    """The launches of the only launch plan recorded so far (tests start without plans: conftest.py)."""
    (plan,) = launch_plans._plans.values()
    return plan.launches


@pytest.mark.parametrize("kind", [torch.bfloat16, torch.float16, "strict", "turbo"])
@pytest.mark.parametrize("shape", ["1x8x1024x64", "1x32x4096x128", "decode"])
def test_launch_plans_replay_straight_to_the_compiled_kernels(kind, shape):
    """A call's second run replays its launch plan: every launch (the Gluon kernels on Hopper, the portable
    kernel, phase 2's merge of a split decode step) goes straight to the kernel Triton compiled for the first
    run, with the arguments rebuilt around the new tensors; outputs as accurate as the planned call's."""
    dtype = _dtype(kind)
    if shape == "decode":
        q, k, v = rand(2, 8, 16, 128, dtype=dtype), rand(2, 2, 20000, 128, dtype=dtype), \
            rand(2, 2, 20000, 128, dtype=dtype)
    else:
        B, H, N, D = map(int, shape.split("x"))
        q, k, v = (rand(B, H, N, D, dtype=dtype) for _ in range(3))
    before = dict(launch_plans.STATS)
    addresses = launch_plans.STATS_POINTERS["addresses"]
    out, lse = poisoned(q, k, v, _precision(kind), is_causal=True)
    assert launch_plans.STATS["recorded"] == before["recorded"] + 1
    assert launch_plans.STATS["replayed"] == before["replayed"] + 1
    launches = _plan_launches()
    assert launches and all(one.kernel is not None for one in launches), "a launch replayed through kernel[grid]"
    if shape == "decode":
        assert len(launches) == 2  # split keys: phase 1 and the merge
    # the replay handed the launcher the tensors' addresses (Triton 3.6's and 3.8's launchers take them), the Gluon
    # launches their expanded arguments
    import triton

    takes = launch_plans._launcher_takes_ints(type(launches[0].kernel.run))
    assert takes or not triton.__version__.startswith(("3.6", "3.8"))
    assert launch_plans.STATS_POINTERS["addresses"] - addresses == (
        sum(1 for one in launches if not one.descs) if takes else 0)
    heads, kv_heads = slice(0, 2), slice(0, -(-2 // (q.shape[1] // k.shape[1])))  # two query heads, their K/V
    ro, rl = oracle(q[:, heads], k[:, kv_heads], v[:, kv_heads], is_causal=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out[:, heads], ro) <= TOL[_mode(kind)], rel(out[:, heads], ro)
    assert rel(lse[:, heads], rl) <= max(1e-5, TOL[_mode(kind)] if kind == "turbo" else 0)


@hopper_only
@pytest.mark.parametrize("kind", [torch.bfloat16, "strict", "turbo"])
def test_replayed_gluon_launches_encode_their_tma_maps(kind, monkeypatch):
    """A replayed Gluon launch encodes its TMA maps itself and calls Triton's compiled launcher with the expanded
    arguments (on Triton 3.6: the statements ``replay._DESC_SOURCE`` checks), keeping the maps by base address. Right
    on the decoy-then-real call, on new values at the same addresses (a map reused), and on more tensors than a
    launch keeps maps for (maps dropped and encoded again)."""
    import triton

    monkeypatch.setenv("ELSA_HOPPER", "force")
    dtype, precision = _dtype(kind), _precision(kind)
    q, k, v = (rand(1, 4, 1024, 128, dtype=dtype) for _ in range(3))
    before = dict(launch_plans.STATS_DESC)
    out, lse = poisoned(q, k, v, precision)
    (one,) = _plan_launches()
    module = launch_plans._desc_module(type(one.kernel.run))
    if triton.__version__.startswith("3.6"):
        assert module is not None, "Triton 3.6's descriptor launch statements no longer match _DESC_SOURCE"
    encoded = launch_plans.STATS_DESC["encoded"] - before["encoded"]
    through = launch_plans.STATS_DESC["through_triton"] - before["through_triton"]
    assert (encoded, through) == ((1, 0) if module is not None else (0, 1))
    ro, _ = oracle(q, k, v)
    assert not out.isnan().any() and rel(out, ro) <= TOL[_mode(kind)]

    def again(q, k, v):  # the signature of poisoned's calls: its plan replays
        got = torch.full_like(out, float("nan"))
        launch.attention(q, k, v, scale=128 ** -0.5, precision=precision, out=got, lse=torch.empty_like(lse))
        assert rel(got, oracle(q, k, v)[0]) <= TOL[_mode(kind)]

    for t in (q, k, v):  # same addresses, other values: the kept maps are right for them
        t.normal_()
    again(q, k, v)
    for _ in range(launch_plans.MAPS_PER_DESCRIPTOR + 2):
        again(*(rand(1, 4, 1024, 128, dtype=dtype) for _ in range(3)))
    assert len(launch_plans._plans) == 1
    if module is not None:
        assert launch_plans.STATS_DESC["encoded"] - before["encoded"] == 2 + launch_plans.MAPS_PER_DESCRIPTOR + 2
        assert all(0 < len(maps) <= launch_plans.MAPS_PER_DESCRIPTOR for *_, maps in one.expanded[-1])


@hopper_only
def test_replayed_launches_still_call_launch_hooks(monkeypatch):
    """A replay skips Triton's launch hooks only while none is set: with an enter/exit hook added (as profilers
    do), replayed launches go through the kernel's launcher with its metadata and call both hooks."""
    from triton import knobs

    monkeypatch.setenv("ELSA_HOPPER", "force")
    q, k, v = (rand(1, 4, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    launch.attention(q, k, v, scale=0.1)  # recorded
    seen = []
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    hook = lambda meta: seen.append(meta)
    chains = hasattr(enter, "add")
    if chains:
        enter.add(hook)
        leave.add(hook)
    else:  # Triton versions where the hooks are plain attributes
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)
    before = dict(launch_plans.STATS)
    try:
        out, _ = launch.attention(q, k, v, scale=0.1)
    finally:
        if chains:
            enter.remove(hook)
            leave.remove(hook)
    assert launch_plans.STATS["replayed"] == before["replayed"] + 1
    assert len(seen) == 2 and all(m is not None for m in seen)  # Triton's launch metadata, not the quiet None
    assert rel(out, oracle(q, k, v, scale=0.1)[0]) <= TOL[torch.bfloat16]


def test_launch_plans_keyed_by_alignment_on_the_gpu():
    """Triton specialises pointers on 16-byte alignment: a call whose q sits 2 bytes off the grid gets its own
    plan (and kernel), and both calls are right."""
    q, k, v = (rand(1, 8, 1024, 64, dtype=torch.float16) for _ in range(3))
    ref, _ = oracle(q, k, v)
    aligned = elsa_surgery.attention(q, k, v, backend="elsa")
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_off = buf[1:].view(q.shape).copy_(q)
    before = dict(launch_plans.STATS)
    off = elsa_surgery.attention(q_off, k, v, backend="elsa")
    assert launch_plans.STATS["recorded"] == before["recorded"] + 1
    again = elsa_surgery.attention(q_off, k, v, backend="elsa")
    assert launch_plans.STATS["replayed"] == before["replayed"] + 1
    for out in (aligned, off, again):
        assert rel(out, ref) <= TOL[torch.float16]


@pytest.mark.parametrize("kind", [torch.bfloat16, "turbo"])
def test_launch_plans_under_cuda_graph_capture(kind):
    """Capturing is in a plan's key (the Gluon kernels take small captured calls): a second capture replays
    the plan the first one recorded, and both graphs compute the attention of what is in their inputs."""
    dtype = _dtype(kind)
    q, k, v = (rand(1, 8, 1024, 64, dtype=dtype) for _ in range(3))
    call = lambda: elsa_surgery.attention(q, k, v, backend="elsa", is_causal=True, precision=_precision(kind))
    call()
    before = dict(launch_plans.STATS)
    first = benchmark.cuda_graph(call)
    second = benchmark.cuda_graph(call)
    # the first capture records the captured plan; the warm-up calls (not captured) and the second capture replay
    assert launch_plans.STATS["recorded"] == before["recorded"] + 1
    assert launch_plans.STATS["replayed"] == before["replayed"] + 3
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    ro, _ = oracle(q, k, v, is_causal=True)
    for graph in (first, second):
        assert rel(graph(), ro) <= TOL[_mode(kind)]
