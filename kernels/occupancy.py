"""Tile configurations and the occupancy model that picks the K-partition count.

Everything here is a function of shapes and device properties only (no host syncs, no data reads), so
the launch path stays capturable in CUDA graphs and traceable by ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import knobs, replay

# Dot-product kinds understood by the kernels (see scan.py).
DOT_LOWP, DOT_IEEE, DOT_TF32, DOT_TF32X3, DOT_INTERP_BF16, DOT_F16X3, DOT_F16X3V = 0, 1, 2, 3, 4, 5, 6
DOT_F16X1 = 7  # the backward's turbo: one fp16 product of operands split as DOT_F16X3's (backward_dot)
DOT_OF_PRECISION = {"strict": DOT_IEEE, "turbo": DOT_TF32, "precise": DOT_TF32X3}
SPLIT_DOTS = (DOT_F16X3, DOT_F16X3V)  # kinds whose K (and V) the launcher splits into fp16 hi/lo parts

# A partition shorter than this many keys costs more (state traffic, a second launch) than it wins in
# parallelism (measured on an H100: at N=1K splitting saved 2 us of GPU time but added a launch).
MIN_KEYS_PER_PARTITION = 2048
MAX_PARTITIONS = 64
# The grid "fills" the GPU when one partition already gives every SM a program (measured: splitting a
# grid of ~2 waves, e.g. N=4K with 8 heads, made it slower); when it does not, K is split so that
# about TARGET_PROGRAMS_PER_SM programs per SM exist.
FILL_PROGRAMS_PER_SM = 1
TARGET_PROGRAMS_PER_SM = 2
# Decode and short queries (scan.elsa_fwd's PACK): calls with at most DECODE_MAX_ROWS query rows per K/V head
# (GQA group x queries) and at least DECODE_MIN_KEYS keys run one program per (batch, K/V head, row tile,
# partition), the group's query heads packed into the row tile, so that each K/V tile is read once per group.
# They are memory-bound: the keys are split until DECODE_PROGRAMS_PER_SM programs per SM are in flight, down to
# DECODE_MIN_KEYS_PER_PARTITION keys per partition. Tiles and programs per SM from a sweep on an H100
# (benchmarks/lab/decode_tiles.py, bf16, D=128, graph-replayed; docs/PERF.md "Decode path"): 64-key tiles, 4 warps,
# 2 stages, 2 programs per SM were best or within 1 % of the best at B=1 32:8 32K (63.8 us, cuDNN 62.8), 131K,
# B=16 32:8 4K and B=1 MHA 32K; 4 programs per SM and 3 stages cost 2-8 %. Value head dims <= 64 take 3 programs
# per SM (DECODE_PROGRAMS_PER_SM_NARROW; session 31, H100, bf16, graph-replayed: B=16 32:4 131K 761.7 -> 717.2 us,
# B=1 32:4 131K 72.7 -> 68.8, B=16 32:8 32K 380.6 -> 365.1, B=1 32:8 4K equal; at D = 128 3 per SM cost 1-5 %).
# Session 40 (decode_tiles.py --grid: 36 one-query shapes, B 1/16 x GQA 32:4, 32:8, MHA x D 64/128 x 4K-128K keys,
# 7 tiles x 4 programs-per-SM values, bf16, graph-replayed; H100 full table, H200 best four; docs/PERF.md) refined the
# rule for 2-byte operands on Hopper, where it was measured: calls with few (batch, K/V head) pairs
# (<= SMs / DECODE_FEW_GROUPS_DIV; their keys split across many short partitions) take 3 stages and 2 programs per
# SM (H100, B = 1 32:4 D = 64 131K 69.3 -> 65.2 us, 32:8 4K 15.7 -> 14.4, D = 128 32:4 4K 17.7 -> 16.0); one row per
# K/V head at head width 128 with >= SMs / DECODE_WIDE_GROUPS_DIV pairs takes 128-key tiles (H100, B = 16 MHA 131K
# 12.38 -> 11.04 ms, H200 9.47 -> 7.49). Each shape of the sweep is within 3.2 % of its best configuration; measured
# after, old and new processes on one H100: the grid's geometric mean 0.958x -> 0.986x the fastest SDPA backend
# (worst cell 0.851x -> 0.937x).
DECODE_MAX_ROWS = 64
DECODE_MIN_KEYS = 512
DECODE_PROGRAMS_PER_SM = 2
DECODE_PROGRAMS_PER_SM_NARROW = 3
DECODE_NARROW_DV = 64
DECODE_FEW_GROUPS_DIV = 4
DECODE_WIDE_GROUPS_DIV = 2
DECODE_MIN_KEYS_PER_PARTITION = 256
DECODE_MAX_PARTITIONS = 128
MERGE_PARTITIONS_PER_LOAD = 32  # scan.elsa_merge_rows: partitions read per [BLOCK_P, Dv] tile
# A packed call's phase 2 in its phase-1 launch (scan.elsa_fwd's FUSE_MERGE, ELSA_DECODE_MERGE): the last program of a
# row tile merges the partitions, FUSED_MERGE_TILE elements ([partitions, rows, Dv], fp32) a load, where that takes at
# most FUSED_MERGE_MAX_ROUNDS dependent loads; more partitions keep elsa_merge_rows, which spreads them over a
# program per row.
FUSED_MERGE_TILE = 4096
FUSED_MERGE_MAX_ROUNDS = 2

ENV_LEAN_ETA = knobs.LEAN_ETA  # float >= 0: partition-state memory <= eta * (bytes of the output)
ENV_PARTITIONS = knobs.NUM_PARTITIONS  # force a partition count (testing / benchmarking)
# "0" turns off staging V transposed for the fp32 tensor-core modes (see stage_operands)
ENV_STAGE = knobs.STAGE_OPERANDS
# Staging copies V once per call; it pays only when every key block is reused by enough query rows
# (decode steps and short queries read K/V once and stay memory-bound, so they run unstaged).
MIN_ROWS_PER_KV_HEAD_TO_STAGE = 1024
# Staging V may add at most STAGE_MEMORY_FRACTION of the output's bytes (ME-SDPA's extra memory is the
# output itself). When the whole V does not fit, V is staged a key chunk of every head at a time (each
# launch folds its chunk into row states kept between launches: two fp32 per row, W accumulating in the
# output) when the chunks are long (LONG_STAGE_CHUNK_KEYS: the per-launch state traffic is then a few
# percent), else a group of K/V heads at a time (each launch finishes its rows; only when the launches'
# programs fill whole waves of the SMs: a launch of ~6 waves of long programs whose last wave is 17 % full
# wasted 12 % of VGGT's global attention), else short key chunks. Calls too small to fill the GPU four times
# over stage V whole: per-launch costs would eat the gain (H200, B=1, H=8, D=64, N=4K TF32: whole 0.176 ms,
# 4 key chunks 0.302 ms), and so are calls whose budget allows key chunks shorter than
# MIN_KEYS_PER_STAGE_CHUNK.
STAGE_MEMORY_FRACTION = 0.1
MIN_KEYS_PER_STAGE_CHUNK = 1024
# masked calls whose rows span at least this many key blocks classify the mask's tiles first
# (scan.mask_tile_ranges: one more launch and one pass over the mask) so that the kernel skips the key blocks a
# tile's rows never see and folds those they wholly see unmasked (ELSA_MASK_TILES). Below it a row has too few
# blocks to skip for the launch to pay (Swin's 49-key windows are one block).
MASK_RANGE_MIN_KEY_BLOCKS = 8
# the fp16 split of ``precise`` stages twice V's bytes per key (K and V, hi and lo) and gains more per
# launch: 512-key chunks still run at 2.66x ME-SDPA (H100, B=1, H=8, D=64, N=16K; whole: 4.14x)
MIN_KEYS_PER_SPLIT_CHUNK = 512
# A causal call whose split would run in key chunks of less work than this per launch (query rows x chunk
# keys x head dim, every head) splits K alone and V inside the kernel (DOT_F16X3V): half the staged bytes per
# key, chunks twice as long. Its chunks would be mostly launch and row-state traffic. Since v9 this applies
# only where the output cannot hold the chunks (reverse_key_chunks: padded lengths, other output layouts). H100, N=16K causal: H=8, D=64
# in 512-key chunks (4.3e9) 6.23 ms eager (3.76 graph-replayed) split, 4.86 ms 3xTF32 (the v7 choice), 4.17 ms
# (4.04) K alone in 1,024-key chunks; H=32, D=128 in 640-key chunks (4.3e10) 21.1 ms split vs 30.0 ms 3xTF32
# and 24.2 ms K alone. Splitting V in the kernel costs more than it saves wherever the full split runs
# (H=8, D=64, N=16K, non-causal: 7.05 vs 6.13 ms).
MIN_CAUSAL_SPLIT_CHUNK_WORK = 1e10
LONG_STAGE_CHUNK_KEYS = 4096
MAX_HEAD_GROUP_WAVE_WASTE = 0.05
CHUNKED_STAGING_MIN_PROGRAMS_PER_SM = 4
ENV_STAGE_PLAN = knobs.STAGE_PLAN  # testing / benchmarking: "whole", "heads:G", "keys:N" or "rkeys:N"
# "precise" on long dense calls: "f16" (three fp16 products, K/V split by the launcher; see precise_split),
# "f16k" (the same with V split in the kernel), "tf32" (Triton's 3xTF32), unset = chosen by shape
ENV_PRECISE_SPLIT = knobs.PRECISE_SPLIT

@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_dim(d: int) -> int:
    """Padded head-dim block: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(d))


def interpreting() -> bool:
    return replay.env("TRITON_INTERPRET") not in ("", "0")


# Tuned on an H100 at N >= 4K and on an H200 at model shapes (docs/perf/kernels.md, "Tiles by length").
# Keyed by operand kind ("lowp" = fp16/bf16, "ieee", "tf32", "tf32x3"); rows (padded head dim bound,
# sequence length bound, config), first match wins, the length being max(Nq, Nk). Short sequences
# (ViT/BERT tokens, Swin windows) want short tiles: more programs, less padding (H200, batch 8, D=64:
# bf16 N=197 0.0148 -> 0.0130 ms, 3xTF32 N=325 0.104 -> 0.074 ms; Swin's 49-token windows with their
# mask, bf16 0.23 -> 0.023 ms). A handful of buckets: kernels compile once per bucket, not per length.
_INF = float("inf")
SHORT_N = 384
_TABLE = {
    "lowp": [(64, SHORT_N, TileConfig(64, 32, 4, 3)), (64, 2048, TileConfig(128, 64, 8, 3)),
             (64, _INF, TileConfig(128, 64, 4, 3)), (128, SHORT_N, TileConfig(64, 32, 4, 3)),
             (128, _INF, TileConfig(128, 64, 8, 3)), (256, _INF, TileConfig(64, 32, 4, 2))],
    "tf32": [(64, SHORT_N, TileConfig(32, 32, 2, 2)), (64, 2048, TileConfig(128, 64, 8, 3)),
             (64, _INF, TileConfig(128, 64, 4, 2)), (128, _INF, TileConfig(128, 32, 8, 3)),
             (256, _INF, TileConfig(64, 32, 8, 2))],
    "tf32x3": [(64, SHORT_N, TileConfig(32, 32, 2, 2)), (64, _INF, TileConfig(128, 64, 8, 3)),
               (128, _INF, TileConfig(128, 64, 8, 1)), (256, _INF, TileConfig(32, 32, 4, 1))],
    "f16x3": [(64, _INF, TileConfig(128, 64, 8, 3)), (128, _INF, TileConfig(128, 64, 8, 2)),
              (256, _INF, TileConfig(64, 32, 8, 2))],
    "ieee": [(64, SHORT_N, TileConfig(32, 32, 4, 1)), (64, _INF, TileConfig(64, 64, 4, 1)),
             (128, _INF, TileConfig(32, 64, 8, 2)), (256, _INF, TileConfig(32, 32, 4, 1))],
}
# Grids that cannot fill the GPU once with the ``<= 2,048`` bucket's 128-row tiles (``B·H·ceil(Nq/128)`` below
# the SM count: one 1K-token sequence with 8 heads gives 64 programs on 132 SMs) run 64-row tiles, twice the
# programs. Measured (H100, CUDA graphs, B=1, H=8, D=64, N=1K; docs/perf/history.md, "N = 1K"): bf16 0.0208 -> 0.0167 ms
# (cuDNN 0.0169), causal 0.0212 -> 0.0169; 3xTF32 0.0761 -> 0.0649; TF32 0.0339 -> 0.0309. H=32, D=128 fills
# the GPU (256 programs) and keeps its tile.
_SMALL_GRID = {"lowp": TileConfig(64, 64, 4, 3), "tf32": TileConfig(64, 32, 4, 3), "tf32x3": TileConfig(64, 64, 4, 2),
               "f16x3": TileConfig(64, 64, 4, 3)}
_SMALL_GRID_MAX_WIDTH, _SMALL_GRID_MAX_N = 64, 2048
# Causal fp16/bf16 calls with head dims up to 64, sequences past the ``<= 2,048`` bucket and a grid of 128-row
# tiles under CAUSAL_SMALL_GRID_WAVES waves of the SMs run 64x64 tiles: the rows of a causal grid have unequal
# lengths, and shorter row tiles even out the last wave. Measured (H100, CUDA graphs, B=1, H=8, D=64, bf16;
# docs/perf/history.md, "Version 8"): N=4K (256 programs) 0.0916 -> 0.0734 ms; N=16K (1,024) 0.780 -> 0.773 ms, no real
# gain; N=65K (4,096) 10.3 -> 11.0 ms, a loss. At D=128 the 128-row tile stays faster (H=32, N=4K: 0.344 vs 0.391).
_CAUSAL_LOWP = TileConfig(64, 64, 4, 3)
CAUSAL_SMALL_GRID_WAVES = 4
_KIND_OF_DOT = {DOT_LOWP: "lowp", DOT_IEEE: "ieee", DOT_TF32: "tf32", DOT_TF32X3: "tf32x3", DOT_INTERP_BF16: "lowp",
                DOT_F16X3: "f16x3", DOT_F16X3V: "f16x3"}
_OVERRIDE: Optional[TileConfig] = None


def set_config_override(cfg: Optional[TileConfig]) -> None:
    """Force one tile configuration for every launch (benchmark sweeps, tests); None restores the table."""
    global _OVERRIDE
    _OVERRIDE = cfg


def tile_config(dot: int, d: int, dv: int, n: int = 1 << 30, *, bh: Optional[int] = None,
                nq: Optional[int] = None, device: Optional[torch.device] = None, causal: bool = False) -> TileConfig:
    """Tile for a call with head dims ``d``/``dv`` and sequence length ``n = max(Nq, Nk)``; with ``bh``
    (batch·query heads), ``nq`` and ``device``, a grid too small to fill the SMs gets shorter row tiles, and
    so do causal fp16/bf16 calls with narrow heads whose grid is a few waves (``_CAUSAL_LOWP``)."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    if interpreting():
        return TileConfig(32, 32, 4, 1)  # the interpreter runs one numpy program at a time: mid-sized tiles
    width = max(block_dim(d), block_dim(dv))
    kind = _KIND_OF_DOT[dot]
    rows = _TABLE[kind]
    cfg = next((c for bound, n_bound, c in rows if width <= bound and n <= n_bound), rows[-1][2])
    if bh is None or nq is None or device is None or width > _SMALL_GRID_MAX_WIDTH:
        return cfg
    waves = bh * -(-nq // cfg.block_m) / _sms(device)  # of the bucket's tile
    if causal and kind == "lowp" and n > _SMALL_GRID_MAX_N and waves < CAUSAL_SMALL_GRID_WAVES:
        return _CAUSAL_LOWP
    small = _SMALL_GRID.get(kind)
    if small is not None and n <= _SMALL_GRID_MAX_N and cfg.block_m > small.block_m and waves < 1:
        return small
    return cfg


def decode_rows(*, n_q: int, groups: int, n_k: int, dot: int, varlen: bool) -> Optional[int]:
    """Query rows per K/V head of a call that the packed short-query kernel runs (decode, speculative
    decoding, chunked prefill against a long cache), or None for the ordinary tiles."""
    rows = n_q * groups
    if varlen or dot in SPLIT_DOTS or rows > DECODE_MAX_ROWS or n_k < DECODE_MIN_KEYS or n_q < 1:
        return None
    return rows


def fused_merge(parts: int, rows: int, block_m: int, bdv: int) -> Optional[Tuple[int, int]]:
    """``(FUSE_MERGE, MERGE_M)`` of scan.elsa_fwd for a packed call of ``parts`` partitions and ``rows`` query rows
    per K/V head in row tiles of ``block_m`` (value head dims padded to ``bdv``): partitions a load, and a tile's rows
    rounded up to a power of two; None where its phase 2 runs as elsa_merge_rows (one partition: nothing to merge;
    more than FUSED_MERGE_MAX_ROUNDS loads; ``ELSA_DECODE_MERGE=kernel``)."""
    if parts <= 1 or knobs.get(knobs.DECODE_MERGE) == "kernel":
        return None
    merge_m = min(next_pow2(max(1, rows)), block_m)
    fit = max(1, FUSED_MERGE_TILE // (merge_m * bdv))
    per_load = min(next_pow2(parts), 1 << (fit.bit_length() - 1))
    if -(-parts // per_load) > FUSED_MERGE_MAX_ROUNDS:
        return None
    return per_load, merge_m


def _decode_tuned(device: Optional[torch.device], itemsize: int, width: int) -> Optional[int]:
    """The SM count where session 40's decode rule applies (2-byte operands, head width <= 128, Hopper), else None."""
    if device is None or device.type != "cuda" or itemsize != 2 or width > 128:
        return None
    index = _cuda_index(device)
    return sm_count(index) if capability(index)[0] >= 9 else None


def decode_few(device: Optional[torch.device], *, groups: int, rows: int, d: int, dv: int, itemsize: int) -> bool:
    """Whether a packed short-query call has few (batch, K/V head) pairs (``groups``) for the SMs, so that its keys
    split into many short partitions: 3 stages and DECODE_PROGRAMS_PER_SM (session 40's rule, above)."""
    width = max(block_dim(d), block_dim(dv))
    n_sm = _decode_tuned(device, itemsize, width)
    if n_sm is None or (rows == 1 and width == 128):
        return False
    return groups * DECODE_FEW_GROUPS_DIV <= n_sm


def decode_tile_config(d: int, dv: int, rows: int, *, groups: int = 0, device: Optional[torch.device] = None,
                       itemsize: int = 4) -> TileConfig:
    """Tiles of the packed short-query kernel: the row tile holds the group's rows (at least 16, tl.dot's
    minimum); key tiles as wide as the head dims allow. ``groups``: (batch, K/V head) pairs of the call; with
    ``device`` and ``itemsize`` they select session 40's tiles (above)."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    block_m = min(DECODE_MAX_ROWS, max(16, next_pow2(rows)))
    if interpreting():
        return TileConfig(block_m, 32, 4, 1)
    width = max(block_dim(d), block_dim(dv))
    block_n = 64 if width <= 128 else 32
    n_sm = _decode_tuned(device, itemsize, width)
    if n_sm is not None and rows == 1 and width == 128 and groups * DECODE_WIDE_GROUPS_DIV >= n_sm:
        return TileConfig(block_m, 128, 4, 2)
    if decode_few(device, groups=groups, rows=rows, d=d, dv=dv, itemsize=itemsize):
        return TileConfig(block_m, block_n, 4, 3)
    return TileConfig(block_m, block_n, 4, 2)


def stage_operands(dot: int, rows_per_kv_head: int) -> bool:
    """Whether the launcher stages V transposed in memory for the fp32 tensor-core modes (TF32, 3xTF32).

    TF32 MMAs read both shared-memory operands K-major; V's natural layout is not, and Triton then fills
    its tile with 4-byte copies. Measured on an H100 (docs/perf/kernels.md, v4): B=1, H=8, D=64, N=16K,
    TF32 4.06 -> 2.28 ms, 3xTF32 9.39 -> 7.60 ms; H=32, D=128: 35.4 -> 18.4 ms and 99 -> 58 ms. The cost is
    one transposing copy of V (~3 % of the kernel time) into a buffer that ``stage_plan`` keeps within
    ``STAGE_MEMORY_FRACTION`` of the output. ``ELSA_STAGE_OPERANDS=0`` turns it off (slower). Calls with few query rows per K/V head
    (decode steps, short sequences) are not staged: the copy does not pay back there (measured, B=8, H=16,
    D=64, 3xTF32: N=257 0.089 ms unstaged vs 0.097 staged, N=577 0.267 vs 0.273, N=1041 0.767 vs 0.741).
    """
    if dot not in (DOT_TF32, DOT_TF32X3):
        return False
    if knobs.get(ENV_STAGE) == "0":
        return False
    return rows_per_kv_head >= MIN_ROWS_PER_KV_HEAD_TO_STAGE


# The split adds a launch and a staging buffer: calls of less work than this (query rows x keys x head dim, every
# head) or fewer query rows per K/V head keep 3xTF32. Before session 43 the split's calls had no launch plan (the
# planner ran on every call: 0.2-0.45 ms of host time eagerly) and the bounds were 2e9 and 1,024 rows. Session 43
# (H200, B x H x N x 64, fp32, `benchmarks/lab/precise_short.py`; split vs 3xTF32 kernel time, graph-replayed):
# 8x12x197 (2.4e8) 0.041 vs 0.046 ms, 8x6x197 (1.2e8) 0.024 vs 0.028, 64x6x197 (9.5e8) 0.112 vs 0.130, 8x16x257
# (5.4e8) 0.064 vs 0.081, 8x16x577 (2.7e9) 0.159 vs 0.268. Below ~4e8 the few µs saved do not pay the extra launch's
# host time: with the split, auto's race lost DeiT3-S fp32 b8 (8x6x197) to ME-SDPA; at 8x16x257 and above whole
# models gained (eager, b8: CLIP ViT-L/14 336 px 1.047 -> 1.083x native, 224 px 1.024 -> 1.037x; DeiT3-S b64
# 1.049 -> 1.063x). The rows bound: the split pass costs a read and a write of K/V per call, the attention reads them
# once per row tile of each query head, so its share grows as the rows per K/V head shrink (chunked prefill on a long
# cache, whatever the key count): 192 is just under the fewest rows measured to gain (197, ViT tokens).
MIN_SPLIT_WORK = 4e8
MIN_ROWS_PER_KV_HEAD_TO_SPLIT = 192


def precise_split(dot: int, rows_per_kv_head: int, eligible: bool, work: float = float("inf")) -> int:
    """The dot kind of a ``precise`` call: ``DOT_F16X3`` or Triton's ``DOT_TF32X3`` (other kinds pass through).

    ``DOT_F16X3`` computes each fp32 product from three fp16 tensor-core products (hi·hi + hi·lo + lo·hi,
    fp32 accumulation) on operands split with power-of-two scales: Q per row and P inside the kernel, K
    (per key) and V (per head dim) by the launcher, memory-bounded like V staging (``stage_plan``). fp16
    MMAs run at twice the TF32 rate, and the error stays that of 3xTF32 (~1e-6 relative). Measured
    (H200, B=1, N=16K): H=8 D=64 8.41 -> 4.01 ms, H=32 D=128 57.8 -> 31.1 ms. It is used for dense calls with
    one partition, no state output, enough query rows per K/V head to pay the split
    (``MIN_ROWS_PER_KV_HEAD_TO_SPLIT``) and ``work`` (rows x keys x head dim) of at least ``MIN_SPLIT_WORK``;
    ``eligible`` is the launcher's check of the first two.
    ``ELSA_PRECISE_SPLIT=f16|f16k|tf32`` forces one kind (``f16``/``f16k`` only where eligible; ``f16k`` is
    ``DOT_F16X3V``, K split by the launcher and V in the kernel, which the launcher also picks for causal
    calls whose full split would run in short key chunks: ``MIN_CAUSAL_SPLIT_CHUNK_WORK``; for head dims that
    need padding the launcher runs the full split instead, see ``launch._run``).
    """
    if dot != DOT_TF32X3:
        return dot
    env = _precise_split_env()
    if not eligible or env == "tf32":
        return dot
    if env == "f16k":
        return DOT_F16X3V
    if env == "f16" or (rows_per_kv_head >= MIN_ROWS_PER_KV_HEAD_TO_SPLIT and work >= MIN_SPLIT_WORK):
        return DOT_F16X3
    return dot


# precise's and turbo's backward take the fp16 split (backward.py's dot kinds 5 and 7) from this much work (query
# rows x keys x head dim of the whole call). Session 44, H200, precise forward + backward, B = 1, D = 64, split /
# 3xTF32: H = 96 at N = 256 (4.0e8) 0.558 / 0.507 ms, N = 320 (6.3e8) 0.560 / 0.550, N = 577 (2.0e9) 0.625 / 1.011,
# H = 16 at N = 4K (1.1e10) 2.59 / 6.32: below ~1e9 these calls are host-bound, and the split's two extra launches
# cost host time
MIN_BWD_SPLIT_WORK = 1e9
_BWD_SPLIT_OF = {DOT_TF32X3: DOT_F16X3, DOT_TF32: DOT_F16X1}


def backward_dot(dot: int, work: float) -> int:
    """The dot kind of a backward's general passes: ``precise`` (3xTF32) and ``turbo`` (TF32) take the fp16 split
    (``backward.py``'s dot kinds 5 and 7: each product from three fp16 tensor-core products, or ``turbo``'s one, of
    operands split with power-of-two scales per row, q and dO by the launcher for the key-block pass, K and V for the
    row pass) from ``MIN_BWD_SPLIT_WORK`` of ``work`` (rows x keys x head dim), or as ``ELSA_BWD_SPLIT=f16|tf32``
    forces; other kinds pass through."""
    split = _BWD_SPLIT_OF.get(dot)
    if split is None:
        return dot
    env = knobs.get(knobs.BWD_SPLIT) or ""
    if env:
        return split if env == "f16" else dot
    return split if work >= MIN_BWD_SPLIT_WORK else dot


def _precise_split_env() -> str:
    return knobs.get(ENV_PRECISE_SPLIT) or ""


def split_forced() -> bool:
    """``ELSA_PRECISE_SPLIT=f16``: the launcher's shape rules (short causal key chunks) do not veto the split."""
    return _precise_split_env() in ("f16", "f16k")


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: plans follow the memory budget alone
    return sm_count(_cuda_index(device))


def _forced_stage_plan() -> Optional[Tuple[str, int]]:
    """``ELSA_STAGE_PLAN`` parsed: ``None`` when unset, else ``(kind, N)`` with kind ``whole`` (N 0), ``heads``,
    ``keys`` or ``rkeys`` (N > 0)."""
    return knobs.get(ENV_STAGE_PLAN)


def stage_plan(device: torch.device, *, n_k: int, block_n: int, batch: int, kv_heads: int, groups: int,
               m_blocks: int, out_bytes: int, v_bytes_per_key_head: int, stats_bytes: int, causal: bool = False,
               min_chunk_keys: int = MIN_KEYS_PER_STAGE_CHUNK):
    """How V is staged for one call: ``("whole", 0)``, ``("heads", G)`` (G K/V heads per launch, every batch
    row) or ``("keys", C)`` (C keys of every head per launch, C a multiple of ``block_n``).

    ``v_bytes_per_key_head``: bytes of one key's V row of one head; ``stats_bytes``: the row statistics a
    key-chunked call keeps between launches; ``m_blocks``: query blocks per (batch, head). Causal calls
    are not split by heads: a launch of a few heads ends in a long tail of its longest rows (H200, H=32,
    D=128, N=16K, 3xTF32 causal: whole 28.7 ms, 3-head groups 37.7 ms, key chunks 30.8 ms), while key
    chunks let rows finish in the chunk of their causal frontier. A head group whose launch is a single
    wave at least 95 % full is taken too (the fp16 split of ``precise`` at H=32, D=128, N=16K: one head per
    launch, 128 programs on 132 SMs). ``min_chunk_keys``: shorter key chunks are not worth their launches.
    The launcher runs the key chunks of causal calls in reverse order, most of them staged in the output
    (``reverse_key_chunks``); ``C`` then bounds the chunks staged outside it.
    """
    forced = _forced_stage_plan()
    if forced is not None:
        kind, n = forced
        if kind in ("keys", "rkeys"):  # rkeys: the launcher orders the chunks (reverse_chunks_env)
            n = max(block_n, n // block_n * block_n)
            return ("keys", n) if n < n_k else ("whole", 0)
        if kind == "heads":
            return ("heads", n) if n < kv_heads else ("whole", 0)
        return "whole", 0
    budget = STAGE_MEMORY_FRACTION * out_bytes
    head_bytes = batch * n_k * v_bytes_per_key_head  # one K/V head of V, every batch row
    if kv_heads * head_bytes <= budget:
        return "whole", 0
    sms = _sms(device)
    per_key = batch * kv_heads * v_bytes_per_key_head
    keys = int((budget - stats_bytes) // max(per_key, 1)) // block_n * block_n
    fills = m_blocks * batch * kv_heads * groups >= CHUNKED_STAGING_MIN_PROGRAMS_PER_SM * sms
    if fills and keys >= LONG_STAGE_CHUNK_KEYS and keys < n_k:
        return "keys", _even_chunks(n_k, keys, block_n)
    if not causal:
        for heads in range(min(int(budget // max(head_bytes, 1)), kv_heads - 1), 0, -1):
            waves = m_blocks * batch * heads * groups / sms
            whole_waves = 1 - waves / -(-waves // 1) <= MAX_HEAD_GROUP_WAVE_WASTE
            if whole_waves and (waves >= TARGET_PROGRAMS_PER_SM or waves <= 1):
                return "heads", heads
    if not fills or keys < min_chunk_keys or keys >= n_k:
        # chunks short enough for the budget would cost more than they save (N=4K, H=32, D=128, TF32:
        # 4 chunks 1.58 ms vs whole 1.31 ms): such calls are small, V is staged whole
        return "whole", 0
    return "keys", _even_chunks(n_k, keys, block_n)


def reverse_chunks_env() -> Optional[int]:
    """Whether causal key chunks may run in reverse order (``reverse_key_chunks``): ``0`` when
    ``ELSA_STAGE_PLAN`` is unset (external chunks as the memory budget allows), ``N`` for ``rkeys:N``
    (testing / benchmarking: external chunks of at most N keys), ``None`` when it forces another plan."""
    forced = _forced_stage_plan()
    if forced is None:
        return 0
    return forced[1] if forced[0] == "rkeys" else None


@functools.lru_cache(maxsize=256)
def reverse_key_chunks(*, n_q: int, n_k: int, block_m: int, block_n: int, row_bytes: int, key_bytes: int,
                       fixed_bytes: int, ext_keys: int):
    """Key chunks of a causal call processed from the last keys to the first, ``((start, end, capacity), ...)``
    in that order.

    A causal row block is first touched by the chunk holding its last visible key, so while chunk
    ``[start, end)`` runs, the output rows of the blocks whose last key lies before ``start`` are unwritten: a
    chunk whose staged K/V (``key_bytes`` per key plus ``fixed_bytes``, per block of the output region) fits in
    those rows (``row_bytes`` each, whole ``block_m`` row tiles) is staged there (``capacity`` = their bytes)
    and costs no memory; the rest, ``[0, e)`` once such chunks would be shorter than ``ext_keys``, runs in even
    chunks of at most ``ext_keys`` keys staged in a separate buffer (``capacity`` None). Chunk boundaries are
    multiples of ``block_n``. Shrinking geometrically, the output-staged chunks cover most keys in a few long
    launches (H100, B=1, H=8, D=64, N=16K, fp16 split: 10 chunks 2.74 ms vs 16 uniform 1,024-key chunks 4.21 ms).
    """
    off = n_k - n_q  # bottom-right causal: row i sees keys up to i + off
    ext_keys = max(block_n, ext_keys // block_n * block_n)

    def capacity(start: int) -> int:  # bytes of the row tiles untouched while the chunk at ``start`` runs
        return 0 if start <= 0 else max(0, (start - off) // block_m * block_m) * row_bytes

    def fits(start: int, end: int) -> bool:
        return (end - start) * key_bytes + fixed_bytes <= capacity(start)

    chunks, end = [], n_k
    while end > ext_keys:
        # smallest start with room for [start, end): (end - start) * key <= (start - off - block_m) * row
        est = (end * key_bytes + fixed_bytes + (off + block_m) * row_bytes) / (key_bytes + row_bytes)
        start = min(end, max(block_n, -(-int(est) // block_n) * block_n))
        while start - block_n > 0 and fits(start - block_n, end):
            start -= block_n
        while start < end and not fits(start, end):
            start += block_n
        if end - start <= ext_keys:
            break
        chunks.append((start, end, capacity(start)))
        end = start
    if end > 0:
        step = _even_chunks(end, ext_keys, block_n)
        chunks.extend((s, min(end, s + step), None) for s in reversed(range(0, end, step)))
    return tuple(chunks)


def _even_chunks(n_k: int, keys: int, block_n: int) -> int:
    """At most ``keys`` per chunk, evened out over the chunks so that the last one is not a sliver."""
    chunks = -(-n_k // keys)
    return -(-(-(-n_k // chunks)) // block_n) * block_n


def capability(device_index: int) -> Tuple[int, int]:
    """The CUDA compute capability of a device (cached: the query costs microseconds on every call; under
    torch.compile tracing the query itself, which dynamo traces without warning about a cache)."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device_index)
    return _capability(device_index)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0)) or DEFAULT_L2_BYTES


# Causal grids run their row blocks heaviest first (most keys) across a group of heads at a time, not within
# each head: within each head, the heavy blocks of the last heads started last and ran alone at the end (N=4K
# H=8 D=64 causal on an H100: strict 24.7 -> 37.6 TFLOP/s, bf16 1.14 -> 1.37x cuDNN, graph-replayed, session
# 11). Across every head the K/V of all heads stream through L2 at once, which cost as much where they do not
# fit (bf16 N=65K H=32 D=128: 0.95 -> 0.82x cuDNN; turbo N=16K H=32 D=128: 4.44 -> 4.06x ME-SDPA). So a group
# holds the heads whose K/V fit in this share of L2, and at least enough heads that the heaviest row block of
# the last group is short next to the group's work per resident program (the tail): group >= 2 x (resident
# programs, ~2 a SM) / row blocks a head, i.e. CAUSAL_BALANCE_PROGRAMS_PER_SM x SMs / row blocks. The groups are then
# evened out (even_groups): a short last group was the same tail again (session 45).
CAUSAL_L2_SHARE = 0.5
CAUSAL_BALANCE_PROGRAMS_PER_SM = 4
# the CPU interpreter (and a torch without ``L2_cache_size``): an H100's L2, so that CPU tests take the same groups
DEFAULT_L2_BYTES = 50 * 2**20
ENV_HEAD_GROUP = knobs.CAUSAL_HEAD_GROUP  # force the group (tests, measurements)


def causal_head_group(device: torch.device, *, n_k: int, kv_bytes_per_key: int, groups: int, bh: int,
                      m_blocks: int) -> int:
    """Query heads (of the ``bh`` = batch x heads of a launch, ``m_blocks`` row blocks each) whose causal row blocks
    are ordered heaviest first together (see CAUSAL_L2_SHARE); ``groups`` query heads share one K/V head."""
    forced = knobs.get(ENV_HEAD_GROUP)
    if forced:
        return max(1, min(bh, forced))
    l2 = DEFAULT_L2_BYTES if device.type != "cuda" else _l2_bytes(_cuda_index(device))
    kv_heads = int(l2 * CAUSAL_L2_SHARE) // max(1, n_k * kv_bytes_per_key)
    balance = CAUSAL_BALANCE_PROGRAMS_PER_SM * _sms(device) // max(1, m_blocks)
    return even_groups(bh, max(1, min(bh, max(kv_heads * groups, balance))), groups)


def even_groups(bh: int, group: int, unit: int = 1) -> int:
    """``group`` evened out over ``bh`` heads: the same number of groups ``n`` (or fewer), ``ceil(bh / n)`` heads
    each rounded up to whole ``unit``s (the query heads of one K/V head stay in one group), so that no last group
    is left with a few heads (16 heads in groups of 12 -> two of 8). A short last group runs its
    heaviest blocks last, alone on a GPU that empties (session 45, H200, the fp32 split backward at H = 16, N = 4K,
    D = 64, causal, kernel time: groups of 12 (the second of 4 heads) 0.897 ms for turbo and 1.420 for precise;
    groups of 16 0.763 / 1.104, of 4 0.870 / 1.094)."""
    unit = max(1, unit)
    n = -(-bh // max(1, group))  # the groups the rule gave
    units = -(-bh // unit)  # whole units (K/V heads) to share among them
    return min(bh, -(-units // n) * unit)


_ETA_RANGE = knobs.KNOBS[knobs.LEAN_ETA].allowed


def check_eta(eta, name: str = "eta") -> float:
    """ELSA-Lean's bound: a real, finite number >= 0 (bytes of partition states per byte of output)."""
    value = float(eta) if isinstance(eta, numbers.Real) and not isinstance(eta, bool) else float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be {_ETA_RANGE}, got {eta!r}")
    return value


def lean_eta() -> Optional[float]:
    return knobs.get(ENV_LEAN_ETA)


def forced_partitions() -> Optional[int]:
    return knobs.get(ENV_PARTITIONS)


def blocked_pv(dot: int, keys_per_program: int) -> bool:
    """Whether ``scan.elsa_fwd`` adds each key block's P·V to a row's accumulator with a round-to-nearest add
    (``BLOCKED_PV``) rather than accumulating in the tensor cores across blocks: for rows of more than
    ``ELSA_BLOCKED_PV_KEYS`` keys in one program. The tensor cores' fp32 additions are reported to truncate; over
    millions of keys the bias toward zero reaches bf16's rounding (session 27: the 32M stream's 8M-key tasks gave
    rows 1.05e-2 from float64, the 8M stream's 1M-key tasks 2.6e-3). ``strict`` and the split kinds already add
    each block's products that way."""
    if dot == DOT_IEEE or dot in SPLIT_DOTS:
        return False
    return keys_per_program > knobs.get(knobs.BLOCKED_PV_KEYS)


def num_partitions(device: torch.device, *, tiles: int, n_k: int, block_n: int, rows: int, dv: int,
                   out_bytes: int, eta: Optional[float] = None, forced: Optional[int] = None,
                   decode: bool = False, decode_few: bool = False) -> int:
    """How many K-partitions phase 1 uses.

    ``tiles`` = programs of one partition (``B·H·ceil(Nq/BLOCK_M)``). When they cannot fill the SMs
    (fewer than ``FILL_PROGRAMS_PER_SM`` per SM), the keys are split so that ``tiles · partitions``
    reaches ``TARGET_PROGRAMS_PER_SM`` per SM, as long
    as each partition keeps ``MIN_KEYS_PER_PARTITION`` keys. ELSA-Lean: with ``eta`` the partition
    states (``partitions · rows · (Dv + 2)`` fp32) never exceed ``eta ·`` the bytes of the output;
    ``eta = 0`` means one partition (no state buffers at all). ``decode``: the packed short-query kernel's
    rule (``DECODE_*`` above): memory-bound programs, more of them, on shorter partitions; ``decode_few``: the
    call has few (batch, K/V head) pairs (:func:`decode_few`), DECODE_PROGRAMS_PER_SM whatever Dv.
    """
    eta = lean_eta() if eta is None else check_eta(eta)
    if forced is None:
        forced = forced_partitions()
    else:
        try:
            forced = operator.index(forced)  # Python and NumPy integers
        except TypeError:
            forced = 0
        if isinstance(forced, bool) or forced < 1:
            raise ValueError(f"num_partitions must be an integer >= 1, got {forced!r}")
    max_by_keys = max(1, -(-max(n_k, 1) // block_n))  # at least one key block per partition
    if forced is not None:
        return max(1, min(int(forced), max_by_keys))
    if device.type != "cuda":
        return 1
    n_sm = sm_count(_cuda_index(device))
    if decode:
        narrow = dv <= DECODE_NARROW_DV and not decode_few
        per_sm = DECODE_PROGRAMS_PER_SM_NARROW if narrow else DECODE_PROGRAMS_PER_SM
        target, min_keys, max_parts = n_sm * per_sm, DECODE_MIN_KEYS_PER_PARTITION, DECODE_MAX_PARTITIONS
    elif tiles >= n_sm * FILL_PROGRAMS_PER_SM:
        return 1
    else:
        target, min_keys, max_parts = n_sm * TARGET_PROGRAMS_PER_SM, MIN_KEYS_PER_PARTITION, MAX_PARTITIONS
    parts = min(-(-target // max(tiles, 1)), max(1, n_k // min_keys), max_parts)
    if eta is not None:
        per_part = rows * (dv + 2) * 4
        parts = min(parts, max(1, int(eta * out_bytes // max(per_part, 1))))
    return max(1, parts)
