"""Tile configurations and the occupancy model that picks the K-partition count.

Everything here is a function of shapes and device properties only (no host syncs, no data reads), so
the launch path stays capturable in CUDA graphs and traceable by ``torch.compile``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

# Dot-product kinds understood by the kernels (see scan.py).
DOT_LOWP, DOT_IEEE, DOT_TF32, DOT_TF32X3, DOT_INTERP_BF16 = 0, 1, 2, 3, 4
DOT_OF_PRECISION = {"strict": DOT_IEEE, "turbo": DOT_TF32, "precise": DOT_TF32X3}

# A partition shorter than this many keys costs more (state traffic, a second launch) than it wins in
# parallelism (measured on an H100: at N=1K splitting saved 2 us of GPU time but added a launch).
MIN_KEYS_PER_PARTITION = 2048
MAX_PARTITIONS = 64
# The grid "fills" the GPU when one partition already gives every SM a program (measured: splitting a
# grid of ~2 waves, e.g. N=4K with 8 heads, made it slower); when it does not, K is split so that
# about TARGET_PROGRAMS_PER_SM programs per SM exist.
FILL_PROGRAMS_PER_SM = 1
TARGET_PROGRAMS_PER_SM = 2

ENV_LEAN_ETA = "ELSA_LEAN_ETA"  # float >= 0: partition-state memory <= eta * (bytes of the output)
ENV_PARTITIONS = "ELSA_NUM_PARTITIONS"  # force a partition count (testing / benchmarking)
# "0" turns off staging V transposed for the fp32 tensor-core modes (see stage_operands)
ENV_STAGE = "ELSA_STAGE_OPERANDS"
# Staging copies V once per call; it pays only when every key block is reused by enough query rows
# (decode steps and short queries read K/V once and stay memory-bound, so they run unstaged).
MIN_ROWS_PER_KV_HEAD_TO_STAGE = 1024


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
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


# Tuned on an H100 (docs/perf/kernels.md). Keyed by (operand kind, padded head dim upper bound).
# operand kind: "lowp" (fp16/bf16), "ieee", "tf32", "tf32x3".
_TABLE = {
    "lowp": [(64, TileConfig(128, 64, 4, 3)), (128, TileConfig(128, 64, 8, 3)), (256, TileConfig(64, 32, 4, 2))],
    "tf32": [(64, TileConfig(128, 64, 4, 2)), (128, TileConfig(128, 32, 8, 3)), (256, TileConfig(64, 32, 8, 2))],
    "tf32x3": [(64, TileConfig(128, 64, 8, 3)), (128, TileConfig(128, 64, 8, 1)), (256, TileConfig(32, 32, 4, 1))],
    "ieee": [(64, TileConfig(64, 64, 4, 1)), (128, TileConfig(32, 64, 8, 2)), (256, TileConfig(32, 32, 4, 1))],
}
_KIND_OF_DOT = {DOT_LOWP: "lowp", DOT_IEEE: "ieee", DOT_TF32: "tf32", DOT_TF32X3: "tf32x3", DOT_INTERP_BF16: "lowp"}
_OVERRIDE: Optional[TileConfig] = None


def set_config_override(cfg: Optional[TileConfig]) -> None:
    """Force one tile configuration for every launch (benchmark sweeps, tests); None restores the table."""
    global _OVERRIDE
    _OVERRIDE = cfg


def tile_config(dot: int, d: int, dv: int) -> TileConfig:
    if _OVERRIDE is not None:
        return _OVERRIDE
    if interpreting():
        return TileConfig(32, 32, 4, 1)  # the interpreter runs one numpy program at a time: mid-sized tiles
    width = max(block_dim(d), block_dim(dv))
    for bound, cfg in _TABLE[_KIND_OF_DOT[dot]]:
        if width <= bound:
            return cfg
    return _TABLE[_KIND_OF_DOT[dot]][-1][1]


def stage_operands(dot: int, rows_per_kv_head: int) -> bool:
    """Whether the launcher stages V transposed in memory for the fp32 tensor-core modes (TF32, 3xTF32).

    TF32 MMAs read both shared-memory operands K-major; V's natural layout is not, and Triton then fills
    its tile with 4-byte copies. Measured on an H100 (docs/perf/kernels.md, v4): B=1, H=8, D=64, N=16K,
    TF32 4.06 -> 2.28 ms, 3xTF32 9.39 -> 7.60 ms; H=32, D=128: 35.4 -> 18.4 ms and 99 -> 58 ms. The cost is
    one V-sized buffer for the duration of the call and one transposing copy (~3 % of the kernel time).
    ``ELSA_STAGE_OPERANDS=0`` turns it off (memory-lean, slower). Calls with few query rows per K/V head
    (decode steps, short sequences) are not staged: the copy does not pay back there (measured, B=8, H=16,
    D=64, 3xTF32: N=257 0.089 ms unstaged vs 0.097 staged, N=577 0.267 vs 0.273, N=1041 0.767 vs 0.741).
    """
    if dot not in (DOT_TF32, DOT_TF32X3):
        return False
    if os.environ.get(ENV_STAGE, "").strip() == "0":
        return False
    return rows_per_kv_head >= MIN_ROWS_PER_KV_HEAD_TO_STAGE


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def lean_eta() -> Optional[float]:
    raw = os.environ.get(ENV_LEAN_ETA, "").strip()
    if not raw:
        return None
    eta = float(raw)
    if eta < 0:
        raise ValueError(f"{ENV_LEAN_ETA} must be >= 0, got {raw!r}")
    return eta


def num_partitions(device: torch.device, *, tiles: int, n_k: int, block_n: int, rows: int, dv: int,
                   out_bytes: int, eta: Optional[float] = None, forced: Optional[int] = None) -> int:
    """How many K-partitions phase 1 uses.

    ``tiles`` = programs of one partition (``B·H·ceil(Nq/BLOCK_M)``). When they cannot fill the SMs
    (fewer than ``FILL_PROGRAMS_PER_SM`` per SM), the keys are split so that ``tiles · partitions``
    reaches ``TARGET_PROGRAMS_PER_SM`` per SM, as long
    as each partition keeps ``MIN_KEYS_PER_PARTITION`` keys. ELSA-Lean: with ``eta`` the partition
    states (``partitions · rows · (Dv + 2)`` fp32) never exceed ``eta ·`` the bytes of the output;
    ``eta = 0`` means one partition (no state buffers at all).
    """
    if forced is None:
        env = os.environ.get(ENV_PARTITIONS, "").strip()
        forced = int(env) if env else None
    max_by_keys = max(1, -(-max(n_k, 1) // block_n))  # at least one key block per partition
    if forced is not None:
        return max(1, min(int(forced), max_by_keys))
    if device.type != "cuda":
        return 1
    n_sm = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if tiles >= n_sm * FILL_PROGRAMS_PER_SM:
        return 1
    target = n_sm * TARGET_PROGRAMS_PER_SM
    parts = min(-(-target // max(tiles, 1)), max(1, n_k // MIN_KEYS_PER_PARTITION), MAX_PARTITIONS)
    eta = lean_eta() if eta is None else eta
    if eta is not None:
        per_part = rows * (dv + 2) * 4
        parts = min(parts, max(1, int(eta * out_bytes // max(per_part, 1))))
    return max(1, parts)
