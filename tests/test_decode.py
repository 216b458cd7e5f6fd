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

from test_kernels import TOL, check, oracle, poisoned_run, rand  # noqa: E402

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
