"""The packed short-query (decode) path of the kernels against the float64 oracle.

Calls with at most ``occupancy.DECODE_MAX_ROWS`` query rows per K/V head (GQA group x queries) over at least
``occupancy.DECODE_MIN_KEYS`` keys run ``scan.elsa_fwd`` with ``PACK``: the group's query heads share one row
tile. Each test checks that the packed kernel really ran (the launch's ``PACK`` argument), through poisoned
(NaN-filled) output buffers, on the CPU under ``TRITON_INTERPRET=1``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are decorated (kernels/scan.py is imported lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from elsa_surgery.kernels import launch, occupancy as occ  # noqa: E402

from test_kernels import TOL, check, oracle, poisoned_run, rand, rel  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

NK = 600  # >= DECODE_MIN_KEYS, not a multiple of the key tile


@pytest.fixture
def packs(monkeypatch):
    """The PACK argument of every phase-1 launch of the test."""
    seen = []
    real = launch.replay.launch

    def spy(kernel, grid, *args, **kw):
        if "PACK" in kw:
            seen.append(kw["PACK"])
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(launch.replay, "launch", spy)
    return seen


def _qkv(B, Hq, Hkv, Nq, Nk, D=32, dtype=torch.float32):
    return rand(B, Hq, Nq, D, dtype=dtype), rand(B, Hkv, Nk, D, dtype=dtype), rand(B, Hkv, Nk, D, dtype=dtype)


@pytest.mark.parametrize("mode", ["strict", "precise", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nq,hq,hkv", [(1, 8, 2), (3, 4, 1), (16, 2, 2), (1, 4, 4)])
@pytest.mark.parametrize("parts", [1, 3])
def test_packed_matches_oracle(mode, nq, hq, hkv, parts, packs):
    dtype = mode if isinstance(mode, torch.dtype) else torch.float32
    q, k, v = _qkv(2, hq, hkv, nq, NK, dtype=dtype)
    out, lse = poisoned_run(q, k, v, precision=mode if dtype == torch.float32 else None, num_partitions=parts)
    ref_out, ref_lse = oracle(q, k, v)
    check(out, lse, ref_out, ref_lse, TOL[mode])
    assert packs == [True]


@pytest.mark.parametrize("nq", [1, 3, 16])
@pytest.mark.parametrize("parts", [1, 4])
def test_packed_causal_bottom_right_with_static_cache_lengths(nq, parts, packs):
    """A static cache: keys allocated for 640 tokens, each row valid up to its own length (no copy)."""
    q, k, v = _qkv(3, 4, 2, nq, 640)
    kv_lengths = torch.tensor([600, 17, 640], dtype=torch.int32, device=q.device)
    for causal in (False, True):
        out, lse = poisoned_run(q, k, v, is_causal=causal, kv_lengths=kv_lengths, num_partitions=parts)
        ref_out, ref_lse = oracle(q, k, v, is_causal=causal, kv_lengths=kv_lengths)
        check(out, lse, ref_out, ref_lse, TOL["strict"])
    assert packs == [True, True]


def test_packed_padded_batch_q_lengths(packs):
    """Speculative decoding with a different number of draft tokens per row."""
    q, k, v = _qkv(2, 6, 2, 5, NK)
    ql = torch.tensor([5, 2], dtype=torch.int32, device=q.device)
    kl = torch.tensor([NK, 530], dtype=torch.int32, device=q.device)
    out, lse = poisoned_run(q, k, v, is_causal=True, q_lengths=ql, kv_lengths=kl, num_partitions=2)
    ref_out, ref_lse = oracle(q, k, v, is_causal=True, q_lengths=ql, kv_lengths=kl)
    check(out, lse, ref_out, ref_lse, TOL["strict"])
    assert packs == [True]


@pytest.mark.parametrize("kind", ["bool_keys", "float_per_head"])
def test_packed_masks(kind, packs):
    B, Hq, Hkv, Nq = 2, 4, 2, 3
    q, k, v = _qkv(B, Hq, Hkv, Nq, NK)
    if kind == "bool_keys":  # left padding of a batch, every query head the same
        mask = torch.ones(B, 1, 1, NK, dtype=torch.bool, device=q.device)
        mask[0, ..., :100] = False
        mask[1, ..., :NK - 1] = False  # one visible key
        canon = mask.expand(B, Hq, Nq, NK)
    else:  # a bias that differs per query head and per query
        canon = rand(B, Hq, Nq, NK)
        canon[1, 2, 1] = float("-inf")  # a fully masked row gives zeros
        mask = canon
    out, lse = poisoned_run(q, k, v, mask=canon, num_partitions=3)
    ref_out, ref_lse = oracle(q, k, v, mask)
    check(out, lse, ref_out, ref_lse, TOL["strict"])
    if kind == "float_per_head":
        assert torch.all(out[1, 2, 1] == 0)
    assert packs == [True]


def test_packed_state_merges(packs):
    """attention_state through the packed kernel: the same (m, S, W) layout as the unpacked one."""
    q, k, v = _qkv(2, 8, 2, 2, NK)
    scale = q.shape[-1] ** -0.5
    m, S, W = launch.attention_state(q, k, v, scale=scale, precision="strict", num_partitions=3)
    assert packs == [True]
    ref_out, ref_lse = oracle(q, k, v)
    out = (W / S.unsqueeze(-1)).double()
    check(out, (m + S.log()), ref_out, ref_lse, TOL["strict"])


def test_packing_rule():
    """Which calls pack: few rows per K/V head, enough keys, dense, not the fp16-split precise kinds."""
    kw = dict(n_k=4096, dot=occ.DOT_LOWP, varlen=False)
    assert occ.decode_rows(n_q=1, groups=8, **kw) == 8
    assert occ.decode_rows(n_q=8, groups=8, **kw) == occ.DECODE_MAX_ROWS
    assert occ.decode_rows(n_q=9, groups=8, **kw) is None  # 72 rows: the ordinary tiles
    assert occ.decode_rows(n_q=1, groups=4, n_k=occ.DECODE_MIN_KEYS - 1, dot=occ.DOT_LOWP, varlen=False) is None
    assert occ.decode_rows(n_q=1, groups=4, n_k=4096, dot=occ.DOT_LOWP, varlen=True) is None
    assert occ.decode_rows(n_q=1, groups=4, n_k=4096, dot=occ.DOT_F16X3, varlen=False) is None


def test_unpacked_when_rows_exceed_the_tile(packs):
    q, k, v = _qkv(1, 8, 1, 9, NK)  # 72 rows per K/V head
    out, lse = poisoned_run(q, k, v, num_partitions=2)
    ref_out, ref_lse = oracle(q, k, v)
    check(out, lse, ref_out, ref_lse, TOL["strict"])
    assert packs == [False]


@pytest.mark.parametrize("state", [False, True])
def test_row_merge_reads_partitions_in_tiles(state, monkeypatch, packs):
    """Phase 2 of the packed path (scan.elsa_merge_rows) over more partitions than one tile holds, with
    partitions past a row's valid length (empty states, m = -inf)."""
    monkeypatch.setenv("ELSA_DECODE_MERGE", "kernel")
    monkeypatch.setattr(occ, "MERGE_PARTITIONS_PER_LOAD", 2)
    q, k, v = _qkv(2, 4, 2, 1, NK)
    kl = torch.tensor([NK, 40], dtype=torch.int32, device=q.device)  # row 1: every partition but the first is empty
    ref_out, ref_lse = oracle(q, k, v, kv_lengths=kl)
    if state:
        m, S, W = launch.attention_state(q, k, v, scale=q.shape[-1] ** -0.5, kv_lengths=kl, precision="strict",
                                         num_partitions=5)
        check((W / S.unsqueeze(-1)).double(), m + S.log(), ref_out, ref_lse, TOL["strict"])
    else:
        out, lse = poisoned_run(q, k, v, kv_lengths=kl, num_partitions=5)
        check(out, lse, ref_out, ref_lse, TOL["strict"])
    assert packs == [True]


@pytest.fixture
def merges(monkeypatch):
    """Phase 2 of every packed launch of the test: 'fused' (scan.elsa_fwd's FUSE_MERGE) or 'kernel'
    (scan.elsa_merge_rows launched), one entry a call; launch plans off, so that each call plans anew."""
    monkeypatch.setenv("ELSA_LAUNCH_PLANS", "0")
    seen = []
    real = launch.replay.launch

    def spy(kernel, grid, *args, **kw):
        if kw.get("PACK"):
            seen.append("fused" if kw.get("FUSE_MERGE") else "one")
        elif getattr(kernel, "__name__", "") == "elsa_merge_rows" or "elsa_merge_rows" in repr(kernel):
            seen[-1] = "kernel"
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(launch.replay, "launch", spy)
    return seen


def _counters_zero():
    """Whether every stream's ticket counters of the fused merge are zero."""
    return all(int(count.count_nonzero()) == 0 for count, _ in launch._SCRATCH.values())


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("case", ["gqa", "causal_lengths", "q_lengths", "mask", "fp16_mha"])
def test_fused_merge_matches_the_oracle(case, merge, merges, monkeypatch):
    """Phase 2 in the phase-1 launch (the last program of each row tile merges its partitions) and in a launch of
    its own give the oracle's answer, with partitions past a row's valid length (empty states), padded query rows,
    masks; the counters are zero again after every fused launch."""
    monkeypatch.setenv("ELSA_DECODE_MERGE", merge)
    kw, dtype, shape = {}, torch.float32, (3, 8, 2, 1)
    if case == "fp16_mha":
        dtype, shape = torch.float16, (2, 4, 4, 1)
    elif case == "causal_lengths":
        shape = (3, 4, 2, 3)
        kw = dict(is_causal=True, kv_lengths=torch.tensor([NK, 40, 300], dtype=torch.int32))
    elif case == "q_lengths":
        shape = (2, 6, 2, 5)
        kw = dict(is_causal=True, q_lengths=torch.tensor([5, 2], dtype=torch.int32),
                  kv_lengths=torch.tensor([NK, 530], dtype=torch.int32))
    B, Hq, Hkv, Nq = shape
    q, k, v = _qkv(B, Hq, Hkv, Nq, NK, dtype=dtype)
    kw = {n: t.to(q.device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    if case == "mask":
        kw["mask"] = rand(B, Hq, Nq, NK)
        kw["mask"][1, 3, 0] = float("-inf")  # a fully masked row: zeros
    for parts in (2, 5):
        out, lse = poisoned_run(q, k, v, num_partitions=parts, **kw)
        ref_out, ref_lse = oracle(q, k, v, **kw)
        check(out, lse, ref_out, ref_lse, TOL["strict" if dtype == torch.float32 else dtype])
        assert _counters_zero()
    if case == "mask":
        assert torch.all(out[1, 3, 0] == 0)
    assert merges == [merge, merge]


def test_fused_merge_in_several_loads_and_its_bounds(monkeypatch, merges):
    """A fused merge of more partitions than one load holds (two rounds), and past FUSED_MERGE_MAX_ROUNDS the merge
    kernel; rows padded to the merge tile's power of two (3 rows a K/V head)."""
    monkeypatch.setattr(occ, "FUSED_MERGE_TILE", 4 * 32 * 2)  # [2 partitions, 4 rows, Dv 32] a load
    q, k, v = _qkv(2, 3, 1, 1, NK)
    kl = torch.tensor([NK, 100], dtype=torch.int32, device=q.device)
    ref_out, ref_lse = oracle(q, k, v, kv_lengths=kl)
    for parts in (2, 3, 4, 5):
        out, lse = poisoned_run(q, k, v, num_partitions=parts, kv_lengths=kl)
        check(out, lse, ref_out, ref_lse, TOL["strict"])
    assert merges == ["fused", "fused", "fused", "kernel"]
    assert _counters_zero()


def test_fused_merge_calls_of_other_sizes_share_the_streams_buffers(merges):
    """Fused calls of different sizes one after another on one stream (fewer, more, fewer row tiles and partitions):
    each reads only its own partition states and finds its counters at zero, whatever the call before left."""
    shapes = [(1, 4, 1, 1, 3), (3, 8, 2, 2, 5), (1, 4, 1, 1, 2), (2, 6, 3, 1, 4)]  # B, Hq, Hkv, Nq, partitions
    for B, Hq, Hkv, Nq, parts in shapes + shapes[::-1]:
        q, k, v = _qkv(B, Hq, Hkv, Nq, NK)
        out, lse = poisoned_run(q, k, v, num_partitions=parts)
        check(out, lse, *oracle(q, k, v), TOL["strict"])
    assert merges == ["fused"] * 8 and _counters_zero()


def test_fused_merge_rule(monkeypatch):
    """(partitions a load, merge rows): a [partitions, rows, Dv] tile of at most FUSED_MERGE_TILE elements, at most
    FUSED_MERGE_MAX_ROUNDS loads; none for one partition or under ELSA_DECODE_MERGE=kernel."""
    monkeypatch.delenv("ELSA_DECODE_MERGE", raising=False)
    assert occ.FUSED_MERGE_TILE == 4096 and occ.FUSED_MERGE_MAX_ROUNDS == 2
    assert occ.fused_merge(1, 4, 16, 64) is None
    assert occ.fused_merge(4, 4, 16, 64) == (4, 4)  # B = 16 32:8 D = 64 4K on an H100: one load
    assert occ.fused_merge(3, 4, 16, 128) == (4, 4)
    assert occ.fused_merge(16, 4, 16, 128) == (8, 4)  # two loads
    assert occ.fused_merge(17, 4, 16, 128) is None  # three
    assert occ.fused_merge(64, 1, 16, 64) == (64, 1)
    assert occ.fused_merge(5, 64, 64, 128) is None  # [1, 64, 128] a load: five
    assert occ.fused_merge(2, 24, 16, 32) == (2, 16)  # rows past a 16-row tile: the tile's
    monkeypatch.setenv("ELSA_DECODE_MERGE", "kernel")
    assert occ.fused_merge(4, 4, 16, 64) is None
    monkeypatch.setenv("ELSA_DECODE_MERGE", "both")
    with pytest.raises(ValueError, match="ELSA_DECODE_MERGE"):
        occ.fused_merge(4, 4, 16, 64)


def test_merge_scratch_one_pair_a_stream():
    """The fused merge's buffers: counters zeroed, each at least as long as asked, the same buffers while they are
    long enough, a longer one (counters zeroed) otherwise."""
    launch._SCRATCH.clear()
    dev = torch.device("cpu")
    c, s = launch.merge_scratch(dev, 10, 20)
    assert c.dtype == torch.int32 and c.numel() >= 10 and int(c.count_nonzero()) == 0
    assert s.dtype == torch.float32 and s.numel() >= 20
    c2, s2 = launch.merge_scratch(dev, c.numel(), s.numel())
    assert c2 is c and s2 is s
    c3, s3 = launch.merge_scratch(dev, c.numel() + 1, 5)
    assert c3 is not c and c3.numel() > c.numel() and int(c3.count_nonzero()) == 0 and s3 is s
    c4, s4 = launch.merge_scratch(dev, 5, s.numel() + 1)
    assert c4 is c3 and s4.numel() > s.numel()
    launch._SCRATCH.clear()


def test_merge_scratch_looked_up_once_a_replay(monkeypatch):
    """A replay's two derived slots of the fused merge (counters, states) take one merge_scratch lookup between
    them: the second finds the pair the first kept in the replay's slots."""
    calls = []
    real = launch.merge_scratch
    monkeypatch.setattr(launch, "merge_scratch", lambda *a: calls.append(a) or real(*a))
    dev = torch.device("cpu")
    slots = {}
    count = launch._scratch_maker(dev, 7, 30, 0)(slots)
    part = launch._scratch_maker(dev, 7, 30, 1)(slots)
    assert calls == [(dev, 7, 30)] and count.dtype == torch.int32 and part.dtype == torch.float32
    pair = real(dev, 7, 30)
    assert pair[0] is count and pair[1] is part and launch._scratch_maker(dev, 7, 30, 1)({}) is part
    assert len(calls) == 2  # a new replay's slots: looked up again
    launch._SCRATCH.clear()


@pytest.mark.parametrize("nq,hq,hkv,causal", [(1, 4, 4, False), (1, 8, 2, True), (3, 4, 2, True)])
def test_packed_128_key_tiles(nq, hq, hkv, causal, packs, monkeypatch):
    """The 128-key tile of session 40's rule (one row per K/V head at width 128 with many (batch, K/V head) pairs;
    other shapes here too) with 3 stages, over keys that are no multiple of it, split or not, with per-row cache
    lengths."""
    q, k, v = _qkv(2, hq, hkv, nq, NK, D=128, dtype=torch.bfloat16)
    kv_lengths = torch.tensor([NK, 131], dtype=torch.int32, device=q.device)
    blocks = []
    real = launch.replay.launch

    def spy(kernel, grid, *args, **kw):
        if kw.get("PACK"):
            blocks.append((kw["BLOCK_N"], kw.get("num_stages")))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(launch.replay, "launch", spy)
    launch.replay.clear()  # no plan recorded with other tiles
    occ.set_config_override(occ.TileConfig(16, 128, 4, 3))
    try:
        for parts in (1, 3):
            out, lse = poisoned_run(q, k, v, is_causal=causal, kv_lengths=kv_lengths, num_partitions=parts)
            ref_out, ref_lse = oracle(q, k, v, is_causal=causal, kv_lengths=kv_lengths)
            check(out, lse, ref_out, ref_lse, TOL[torch.bfloat16])
    finally:
        occ.set_config_override(None)
        launch.replay.clear()
    assert packs == [True, True] and blocks == [(128, 3), (128, 3)]


# ---------------------------------------------------------------------------------------------------------------------
# a growing KV cache: every decode step a new signature, run through the family's retargeted plan (callcache and
# launch.KeysFamily)
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def families(monkeypatch):
    """Launch plans and direct routes on in the interpreter too, nothing remembered from other tests; yields
    ``callcache.KERNEL_FAMILY``'s counts from here on."""
    import elsa_surgery
    from elsa_surgery import callcache

    monkeypatch.setenv("ELSA_LAUNCH_PLANS", "1")
    callcache.clear()
    launch.replay.clear()
    before = dict(callcache.KERNEL_FAMILY)
    yield elsa_surgery, lambda: {n: callcache.KERNEL_FAMILY[n] - before[n] for n in before}
    callcache.clear()
    launch.replay.clear()


def _steps(lengths, B=1, Hq=4, Hkv=2, D=16, dtype=torch.float32, nq=1):
    """``nq`` queries and contiguous K/V of each length (a dynamic cache's steps: new tensors, new strides)."""
    k_all, v_all = rand(B, Hkv, max(lengths), D, dtype=dtype), rand(B, Hkv, max(lengths), D, dtype=dtype)
    return [(rand(B, Hq, nq, D, dtype=dtype), k_all[:, :, :n].contiguous(), v_all[:, :, :n].contiguous())
            for n in lengths]


def _route_plan(elsa_surgery, q, k, v, **kw):
    """The launch plan the full path records for this exact call (routes forgotten first)."""
    from elsa_surgery import callcache

    callcache.clear()
    out = elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True, **kw)
    miss = callcache.direct(q, k, v, None, 0.0, kw.get("is_causal", False), None, True, "elsa", None, False, False)
    assert type(miss) is not callcache.Miss  # the call has its own route now
    return out, next(route[2][0] for rkey, route in callcache._routes.items())


@pytest.mark.parametrize("dtype,parts,causal,nq,merge", [
    (torch.float32, None, False, 1, "fused"), (torch.bfloat16, "3", False, 1, "fused"),
    (torch.float16, "2", True, 1, "kernel"), (torch.float32, "2", True, 3, "fused"),
    (torch.float32, "3", False, 3, "kernel")])
def test_growing_cache_steps_run_one_retargeted_plan(dtype, parts, causal, nq, merge, families, monkeypatch):
    """Decode steps of 520-527 keys (one band): the first runs the full path and makes the family's route; the next
    seven run its plan retargeted to their keys, with the kernels' exact answer; each retargeted plan launches what
    the planner records for that call itself (same kernels, grids and arguments). Three queries a step, causal: a
    chunked prefill or speculative step, bottom-right over the step's own keys. Phase 2 fused into the one launch
    or in a launch of its own (ELSA_DECODE_MERGE)."""
    from elsa_surgery import callcache

    monkeypatch.setenv("ELSA_DECODE_MERGE", merge)
    if parts:
        monkeypatch.setenv("ELSA_NUM_PARTITIONS", parts)
    elsa_surgery, counts = families
    steps = _steps(range(520, 528), dtype=dtype, nq=nq)
    outs = [elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True, is_causal=causal) for q, k, v in steps]
    assert counts() == {"runs": 7, "made": 1}
    for (q, k, v), out in zip(steps, outs):
        ref, _ = oracle(q, k, v, is_causal=causal)
        assert rel(out, ref) <= TOL["strict" if dtype == torch.float32 else dtype]
    fam, = callcache._kernel_routes.values()
    for q, k, v in steps[3:5]:
        got = fam.family.plan_for(k, v)
        out, want = _route_plan(elsa_surgery, q, k, v, is_causal=causal)
        assert len(got.launches) == len(want.launches) == (1 if parts is None or merge == "fused" else 2)
        for a, b in zip(got.launches, want.launches):
            assert (a.fn, a.kernel, a.grid, a.vals, a.subs, a.options) == (b.fn, b.kernel, b.grid, b.vals, b.subs,
                                                                          b.options)
        assert got.prep == want.prep and got.result == want.result


def test_growing_cache_family_steps_aside_where_the_plan_would_differ(families, monkeypatch):
    """The family's plan is not used where the planner would plan otherwise: another partition count (a knob changed:
    the plan's environment), another band; V with another number of keys than K gets the full path's error."""
    from elsa_surgery import callcache

    elsa_surgery, counts = families
    for q, k, v in _steps((520, 522, 521, 524), D=8):
        out = elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True)
        assert rel(out, oracle(q, k, v)[0]) <= TOL["strict"]
    assert counts() == {"runs": 3, "made": 1}
    monkeypatch.setenv("ELSA_NUM_PARTITIONS", "2")
    q, k, v = _steps((526,), D=8)[0]
    assert rel(elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True), oracle(q, k, v)[0]) <= TOL["strict"]
    assert counts() == {"runs": 3, "made": 2}
    q, k, v = _steps((700,), D=8)[0]  # another band: its own family
    elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True)
    assert counts() == {"runs": 3, "made": 3}
    q, k, v = _steps((528,), D=8)[0]
    with pytest.raises(ValueError, match="same sequence length"):
        elsa_surgery.attention(q, k, v[:, :, :527], backend="elsa", enable_gqa=True)
    assert counts()["runs"] == 3 and len(callcache._kernel_routes) == 2


def test_keys_family_keeps_the_compiled_kernels_specialisation(families):
    """A plan that launches a compiled kernel directly is retargeted only to arguments Triton would specialise alike:
    K/V strides of the same divisibility by 16 (D = 8: odd lengths give strides that are not multiples of 16), 32-bit
    values; a plan launched through Triton's own dispatch (the interpreter's) takes any."""
    from elsa_surgery import callcache

    elsa_surgery, _ = families
    (q, k, v), = _steps((520,), D=8)
    elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True)
    shared, = callcache._kernel_routes.values()
    plan = shared.family.plan
    fwd = plan.launches[0]
    direct = launch.replay._Launch(fwd.fn, object(), fwd.grid, fwd.vals, fwd.subs, fwd.descs, fwd.options)
    compiled = launch.keys_family(plan.with_launches((direct,) + plan.launches[1:]))
    for n, same in ((522, True), (521, False), (524, True), (536, True)):
        (_, k, v), = _steps((n,), D=8)
        assert (compiled.plan_for(k, v) is not None) == same, n
        assert shared.family.plan_for(k, v) is not None
    kind = launch._int_kind
    assert kind(16, False) != kind(2 ** 31, False) and kind(17, True) != kind(1, True) != kind(16, True)
    assert kind(16, True) == kind(48, True) and kind(17, True) == kind(33, True) and kind(16, False) == kind(17, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_growing_cache_family_on_the_gpu(dtype):
    """On the GPU the family's plan launches the compiled kernels directly: decode steps 4,097-4,160 of a Qwen2-7B-
    shaped layer (28:4 heads, D = 128) all after the first run through it, each the kernels' answer for its keys."""
    import elsa_surgery
    from elsa_surgery import callcache

    callcache.clear()
    launch.replay.clear()
    before = dict(callcache.KERNEL_FAMILY)
    g = torch.Generator(device="cuda").manual_seed(5)
    kv = torch.randn(2, 1, 4, 4161, 128, device="cuda", dtype=dtype, generator=g)
    lengths = range(4097, 4161)  # one band (callcache.key_band: 4,096 closes the one before)
    qs = [torch.randn(1, 28, 1, 128, device="cuda", dtype=dtype, generator=g) for _ in lengths]
    steps = [(q, kv[0, :, :, :n].contiguous(), kv[1, :, :, :n].contiguous()) for q, n in zip(qs, lengths)]
    outs = [elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True) for q, k, v in steps]
    assert {n: callcache.KERNEL_FAMILY[n] - before[n] for n in before} == {"runs": len(lengths) - 1, "made": 1}
    shared, = callcache._kernel_routes.values()
    assert shared.family.fwd.kernel is not None  # launched directly: its specialisation checked
    for (q, k, v), out in zip(steps[::9], outs[::9]):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        assert rel(out, ref) <= TOL["strict" if dtype == torch.float32 else dtype]
    callcache.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fused_merge_on_the_gpu(d, monkeypatch):
    """On the GPU: decode steps of B = 16, GQA 32:8 over 4,096 keys (the fused merge's cell), fused in one launch,
    the merge kernel's answer to fp32 rounding and the float64 one to bf16's; 200 calls back to back give the same
    bits (the counters start every launch at zero); on a second stream (its own counters) and captured in a CUDA
    graph (not fused there: the merge kernel) the same answer."""
    import elsa_surgery

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(16, 32, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(16, 8, 4096, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    plan = launch.cached_plan(launch.call_signature(q, k, v, None, precision=None))
    assert plan.pack_rows == 4 and plan.parts > 1 and plan.merge_fused is not None

    def call():
        return elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True)

    first = call()
    outs = [call() for _ in range(200)]
    assert all(torch.equal(o, first) for o in outs)
    assert _counters_zero()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert rel(first, ref) <= TOL[torch.bfloat16]
    monkeypatch.setenv("ELSA_DECODE_MERGE", "kernel")
    unfused = call()
    monkeypatch.delenv("ELSA_DECODE_MERGE")
    assert (first.float() - unfused.float()).abs().max().item() <= 2 ** -7 * unfused.float().abs().max().item()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [call() for _ in range(20)]
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(o, first) for o in on_side)
    assert len({key for key in launch._SCRATCH if key[0] == torch.cuda.current_device()}) >= 2
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # (warm-up on the capture stream)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, unfused)
    assert _counters_zero()
