"""Every ``ELSA_*`` environment variable, declared once: name, type, allowed values, default and a one-line doc.

Read a knob with :func:`get` (``knobs.get(knobs.HOPPER)``): it returns the parsed value (the default when the
variable is unset or empty) and raises ``ValueError`` naming the variable and its allowed values on a bad one.
Every reader of an ``ELSA_*`` variable goes through here (tests/test_knobs.py checks the source for others), and
``docs/configuration.md`` is generated from :data:`KNOBS` (``python -m elsa_surgery.config --markdown``).

Reads are cheap, as some happen on every eager call: the raw value comes from the environment's store
(``internals.ENVIRON``) and its parse is kept per raw value. While a launch plan records (``replay.py``), every
read is reported to its observer, so that a plan replays only while the knobs its planning read keep their values.
Plain Python: this module imports neither torch nor Triton nor the framework.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from . import internals

BACKEND = "ELSA_BACKEND"
FP32_PRECISION = "ELSA_FP32_PRECISION"
PRECISE_SPLIT = "ELSA_PRECISE_SPLIT"
LAUNCH_PLANS = "ELSA_LAUNCH_PLANS"
STAGE_OPERANDS = "ELSA_STAGE_OPERANDS"
STAGE_PLAN = "ELSA_STAGE_PLAN"
LEAN_ETA = "ELSA_LEAN_ETA"
NUM_PARTITIONS = "ELSA_NUM_PARTITIONS"
CAUSAL_HEAD_GROUP = "ELSA_CAUSAL_HEAD_GROUP"
HOPPER = "ELSA_HOPPER"
HOPPER_TILES = "ELSA_HOPPER_TILES"
HOPPER_BWD_TILES = "ELSA_HOPPER_BWD_TILES"
HOPPER_LAZY = "ELSA_HOPPER_LAZY"
DEBUG = "ELSA_DEBUG"
NCU_CHILD = "ELSA_NCU_CHILD"
TEST_RANDOM_CASES = "ELSA_TEST_RANDOM_CASES"
BLOCKED_PV_KEYS = "ELSA_BLOCKED_PV_KEYS"
BWD_DQ = "ELSA_BWD_DQ"
BWD_SHORT = "ELSA_BWD_SHORT"
BWD_LOWP = "ELSA_BWD_LOWP"
BWD_SPLIT = "ELSA_BWD_SPLIT"
MASK_TILES = "ELSA_MASK_TILES"
COMPILE_OP = "ELSA_COMPILE_OP"
PRECOMPILE = "ELSA_PRECOMPILE"
DECODE_MERGE = "ELSA_DECODE_MERGE"

_MAX_CACHED = 32  # parsed values kept per knob (by raw value)


@dataclass(eq=False, slots=True)
class Knob:
    name: str
    type: str  # "choice", "int", "float", "tiles", "stage plan", "flag"
    allowed: str  # the allowed values, as the error message and the docs state them
    default: object  # the value of an unset (or empty) variable
    doc: str  # one line
    parse: Callable[[str], object]  # the stripped, non-empty string -> value; raises ValueError when not allowed
    scope: str = "user"  # "user" (what a user sets), "tuning" (measurements and tests), "internal"
    choices: Tuple[str, ...] = ()
    key: object = None  # the name as the environment store spells it
    cache: Dict[object, object] = field(default_factory=dict)

    def value_of(self, raw: Optional[str]):
        """The value of the raw string ``raw`` (None: unset); ValueError naming the variable when not allowed."""
        text = "" if raw is None else raw.strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"environment variable {self.name} must be {self.allowed}, got {raw!r}") from None


def _choice(*choices: str, lower: bool = True):
    def parse(text: str):
        value = text.lower() if lower else text
        if value not in choices:
            raise ValueError(value)
        return value
    return parse


def _int_at_least(low: int):
    def parse(text: str):
        if not text.isdecimal() or int(text) < low:
            raise ValueError(text)
        return int(text)
    return parse


def _eta(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(text)
    return value


def _tiles(text: str) -> Tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdecimal() for p in parts):
        raise ValueError(text)
    return tuple(int(p) for p in parts)


def _stage_plan(text: str) -> Tuple[str, int]:
    kind, _, num = text.partition(":")
    if kind == "whole" and not num:
        return "whole", 0
    if kind in ("heads", "keys", "rkeys") and num.isdecimal() and int(num) > 0:
        return kind, int(num)
    raise ValueError(text)


def _flag(text: str) -> bool:
    return True


def _choices(*values: str) -> str:
    return "one of " + ", ".join(repr(v) for v in values)


_DECLARED = (
    Knob(BACKEND, "choice", _choices("auto", "elsa", "reference", "sdpa"), None,
         "backend of calls made with backend='auto' (the default of attention() and convert()); unset: auto",
         _choice("auto", "elsa", "reference", "sdpa"), choices=("auto", "elsa", "reference", "sdpa")),
    Knob(FP32_PRECISION, "choice", _choices("strict", "precise", "turbo"), None,
         "fp32 mode of calls without precision=; unset: precise on sm80+ GPUs, strict elsewhere",
         _choice("strict", "precise", "turbo"), choices=("strict", "precise", "turbo")),
    Knob(LAUNCH_PLANS, "choice", _choices("0", "1") + " (or unset: on for CUDA tensors)", None,
         "launch plans (a call's launches recorded once per signature, then replayed): 0 off, 1 on everywhere "
         "(the interpreter too); unset: on for CUDA tensors", _choice("0", "1"), choices=("0", "1")),
    Knob(HOPPER, "choice", _choices("0", "1", "force") + " (off, by size, whenever in scope)", "1",
         "Gluon kernels on Hopper (sm_90): 0 off, 1 by size (small eager calls without launch plans stay on the "
         "portable kernel), force whenever in scope", _choice("0", "1", "force"), choices=("0", "1", "force")),
    Knob(DEBUG, "flag", "any value (unset or empty: off)", False,
         "the CLI prints the full traceback of a failure instead of one line", _flag),
    Knob(PRECISE_SPLIT, "choice", _choices("f16", "f16k", "tf32"), None,
         "how precise computes dense calls: f16 (three fp16 products, K and V split by the launcher), f16k "
         "(V split in the kernel), tf32 (3xTF32); unset: by shape (the split for calls with enough work and query rows "
         "per K/V head, docs/kernels.md)", _choice("f16", "f16k", "tf32", lower=False),
         scope="tuning", choices=("f16", "f16k", "tf32")),
    Knob(STAGE_OPERANDS, "choice", _choices("0", "1"), "1",
         "0 turns off staging V transposed for the fp32 tensor-core modes on the portable kernel (slower)",
         _choice("0", "1"), scope="tuning", choices=("0", "1")),
    Knob(STAGE_PLAN, "stage plan", "'whole', 'heads:G', 'keys:N' or 'rkeys:N' with G, N > 0", None,
         "forces how V is staged: whole, G K/V heads a launch, N keys a launch (rkeys: causal chunks last first)",
         _stage_plan, scope="tuning"),
    Knob(LEAN_ETA, "float", "a finite number >= 0 (partition-state bytes per output byte; 0 = one partition)", None,
         "ELSA-Lean: partition states at most eta x the output's bytes; unset: no bound", _eta, scope="tuning"),
    Knob(NUM_PARTITIONS, "int", "an integer >= 1", None,
         "forces the number of K/V partitions (split-K) of every call", _int_at_least(1), scope="tuning"),
    Knob(CAUSAL_HEAD_GROUP, "int", "an integer >= 1", None,
         "forces how many heads' causal row blocks run heaviest first together; unset: from the L2 size",
         _int_at_least(1), scope="tuning"),
    Knob(HOPPER_TILES, "tiles", "'BLOCK_M,BLOCK_N,STAGES,num_warps' (integers)", None,
         "forces the Hopper kernels' tiles (tile sweeps)", _tiles, scope="tuning"),
    Knob(HOPPER_BWD_TILES, "tiles", "'RESIDENT,STREAMED,STAGES,num_warps' (integers)", None,
         "forces the tiles of strict's Hopper backward, both passes (each pass's resident block first)", _tiles,
         scope="tuning"),
    Knob(HOPPER_LAZY, "choice", _choices("0", "1", "force") + " (never, from 16 key tiles a row block, always)", "1",
         "lazy rescaling of the fp16/bf16 Hopper kernel's accumulator: 0 never, 1 from 16 key tiles a row block "
         "(8 causal), force always", _choice("0", "1", "force"), scope="tuning", choices=("0", "1", "force")),
    Knob(BLOCKED_PV_KEYS, "int", "an integer >= 0", 1 << 20,
         "keys a row accumulates in one kernel program above which the fp16/bf16/turbo portable kernel adds each key "
         "block's P·V with a round-to-nearest add instead of accumulating in the tensor cores (0: always)",
         _int_at_least(0), scope="tuning"),
    Knob(BWD_DQ, "choice", _choices("rows", "atomic", "gluon", "auto"), "auto",
         "how the backward computes dQ: rows, a pass over query blocks (deterministic; session 28 H100: faster in "
         "every measured tile); atomic, atomic adds from the key-block pass; gluon, atomic adds, and fp16/bf16 calls "
         "in the Hopper kernels' scope through one Gluon kernel (its form: ELSA_BWD_LOWP; H100: exact; at D = 64 the "
         "warp-specialised form with two compute partitions (session 62) 1.2-1.6x the row pass's speed at 4K and "
         "16K, the one-partition form 1.07-1.17x, level at 1-2K and slower at N <= 512 (session 61); at D = 128 "
         "the two-partition form with 32-row tiles 1.08-1.21x at 1-16K, causal 1.08-1.13x at 4-16K (session 64)); "
         "auto, that kernel for such calls with head dims <= 64, or D = 128 where that form runs, and enough "
         "query rows and keys (backward_launch.gluon_auto: 1024, causal 256 at D <= 64, causal 2048 at D = 128), "
         "atomic adds for fp32 strict calls that strict's Gluon backward takes from 1024 query rows and keys "
         "(session 67, H100, 1K-8K: forward + backward 1.13-1.34x the row pass's speed), the row pass for every "
         "other call. Never atomic under "
         "torch.use_deterministic_algorithms(True)",
         _choice("rows", "atomic", "gluon", "auto"), scope="tuning", choices=("rows", "atomic", "gluon", "auto")),
    Knob(BWD_LOWP, "choice", _choices("auto", "plain", "overlap", "ws", "ws2"), "auto",
         "which form of the fp16/bf16 Gluon backward (ELSA_BWD_DQ=gluon) runs: plain, five products a tile in one "
         "order; overlap, dQ's adds overlapping dV's and dK's products; ws, warp-specialised (a warpgroup of its own "
         "runs dQ's product and adds); ws2, ws with each compute warpgroup a partition of its own (head dims <= 64 "
         "and D = 128 with 32-row tiles, else ws); auto: ws2 (session 62 H100, public call, bf16 H = 16 N = 4K D = 64: 0.461 ms against ws's "
         "0.541 and plain's ~0.59; causal, the kernels alone, 0.232 against 0.267)",
         _choice("auto", "plain", "overlap", "ws", "ws2"), scope="tuning",
         choices=("auto", "plain", "overlap", "ws", "ws2")),
    Knob(DECODE_MERGE, "choice", _choices("fused", "kernel"), "fused",
         "phase 2 of a packed short-query call (decode) of several partitions: fused, merged by the last program of "
         "each row tile in the phase-1 launch (one launch a call; occupancy.fused_merge: where the merge takes at "
         "most two loads, not while a CUDA graph captures or torch.compile traces the call); kernel, a second "
         "launch (scan.elsa_merge_rows)", _choice("fused", "kernel"), scope="tuning", choices=("fused", "kernel")),
    Knob(BWD_SHORT, "choice", _choices("0", "1"), "1",
         "1: calls of at most 64 query rows and keys take the one-launch backward (bwd_short); 0: the general "
         "passes", _choice("0", "1"), scope="tuning", choices=("0", "1")),
    Knob(BWD_SPLIT, "choice", _choices("f16", "tf32"), None,
         "how precise's and turbo's backward compute their products (the general passes): f16 (three fp16 "
         "products, turbo one, of operands split by powers of two per row), tf32 (3xTF32, turbo TF32); unset: by "
         "work (docs/kernels.md)",
         _choice("f16", "tf32", lower=False), scope="tuning", choices=("f16", "tf32")),
    Knob(MASK_TILES, "choice", _choices("0", "forward", "all"), "all",
         "masked calls with lines of many blocks: classify the mask's tiles first (one pass over it) so that the "
         "kernels skip the blocks a tile's rows never see and fold those they wholly see unmasked; all: the forward "
         "and the backward's two passes (H100, session 35: forward + backward of causal, packed, window and padding "
         "masks 1.7-2.5x faster, an unstructured mask's 0.96-1.05x the time); forward: the forward kernels only; 0: "
         "every block through the masked loops",
         _choice("0", "forward", "all"), scope="tuning",
         choices=("0", "forward", "all")),
    Knob(COMPILE_OP, "choice", _choices("inline", "opaque", "auto"), "auto",
         "which operator a converted model's inference calls trace to under torch.compile: inline (a triton_op whose "
         "kernels Inductor sees and launches from its own code; calls the Hopper kernel takes, K/V staged by heads or "
         "key chunks and dynamic shapes stay opaque), opaque (one custom op whose Python launcher runs on every "
         "call) or auto (inline, but calls of at least launch.OPAQUE_MACS multiply-adds, about 100 us of kernel "
         "time, opaque: each launch of a user kernel costs torch 2.11's Inductor compile time, about 0.1 s, and "
         "a long call hides the launcher's host time; default since session 54: H200, the same compiled speed as "
         "inline, CLIP-L/14-336 fp32 cold compile 1.28x -> 1.21x native)", _choice("inline", "opaque", "auto"),
         choices=("inline", "opaque", "auto")),
    Knob(PRECOMPILE, "choice", _choices("0", "1"), "1",
         "1: while torch.compile traces a call that will run on the opaque op (a long call under ELSA_COMPILE_OP=auto, "
         "or every call under opaque), the Triton kernels its first run would compile are compiled in two background "
         "threads (launch.precompile: its launches recorded on fake tensors, then Triton's warmup; each kernel then "
         "loaded and its launcher built there), overlapping Inductor's own compile, and the first run waits for any "
         "still compiling; 0: they compile at that first run",
         _choice("0", "1"),
         choices=("0", "1")),
    Knob(NCU_CHILD, "flag", "any value (unset or empty: off)", False,
         "set by benchmarks/lab/ncu_profile.py in the process it profiles", _flag, scope="internal"),
    Knob(TEST_RANDOM_CASES, "int", "an integer >= 0", 8,
         "random shapes of tests/test_kernels.py's randomized kernel test", _int_at_least(0), scope="internal"),
)
KNOBS: Dict[str, Knob] = {k.name: k for k in _DECLARED}

_ENVIRON, _ENCODE = internals.ENVIRON, internals.ENCODE
for _k in _DECLARED:
    _k.key = _ENCODE(_k.name)
_observer: Optional[Callable] = None


def decode(raw) -> str:
    """A raw value of the environment store as a string."""
    return raw if isinstance(raw, str) else os.fsdecode(raw)


def set_observer(fn: Optional[Callable]) -> None:
    """``fn(name, key, raw)`` is called on every read (``replay.py`` records the reads of a plan being planned)."""
    global _observer
    _observer = fn


def get(name: str):
    """The value of knob ``name`` (its default when unset); ValueError naming it and its allowed values when the
    variable holds a bad value; KeyError for a name not declared here."""
    knob = KNOBS[name]
    raw = _ENVIRON.get(knob.key)
    if tracing():  # parsed afresh: a traced read or write of the cache would guard the graph on the cache's
        # contents, and its first write recompile it; no observer either (launch plans are never recorded while
        # tracing, and its thread-local state would become a guard)
        return knob.value_of(None if raw is None else decode(raw))
    if _observer is not None:
        _observer(name, knob.key, raw)
    cache = knob.cache
    try:
        return cache[raw]
    except KeyError:
        pass
    value = knob.value_of(None if raw is None else decode(raw))
    if len(cache) >= _MAX_CACHED:
        cache.clear()
    cache[raw] = value
    return value


def tracing() -> bool:
    """Whether torch.compile is tracing this call (torch is not imported here: see the module's docstring)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def raw(name: str) -> Optional[str]:
    """The variable's string as set (None when unset), for reports; not recorded by launch plans."""
    value = _ENVIRON.get(KNOBS[name].key)
    return None if value is None else decode(value)


def settings() -> list:
    """``(knob, raw string or None, effective value or the error message)`` of every knob."""
    out = []
    for knob in _DECLARED:
        text = raw(knob.name)
        try:
            value = knob.value_of(text)
        except ValueError as e:
            value = f"error: {e}"
        out.append((knob, text, value))
    return out
