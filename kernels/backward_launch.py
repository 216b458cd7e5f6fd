"""Launch code for the backward and dropout kernels (``backward.py``). Plain functions on tensors.

Dense tensors are ``[B, H, N, D]``; packed varlen ``[total, H, D]`` with ``cu_q``/``cu_k`` and
``varlen_dims = (B, max_q, max_k)`` (``lse [H, total]``), as in ``launch.py``. Inputs are never copied.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from . import knobs, launch, replay
from . import occupancy as occ

LOG2E = launch.LOG2E
# what row_pass computes (backward.row_pass's WHAT)
ROW_DQ, ROW_DROPOUT_OUT, ROW_KEEP_MASK = 0, 1, 2


def _kernels():
    from . import backward  # imported on first launch, after TRITON_INTERPRET has been decided

    return backward


log = logging.getLogger("elsa_surgery.kernels")
_OVERRIDE: Optional[occ.TileConfig] = None
# (kernel, device, what specialises it, the tiles asked for) -> the tiles that fit the GPU's shared memory
FITTED: Dict[tuple, tuple] = {}
_KEYS_MAJOR = False  # bwd_kv's query steps in _kv_step's KEYS_MAJOR form: the backward sweep's other variant
_ROW_SWAP = False  # the row pass with the tile transposed (the backward sweep's question, session 29)


def set_tiles_override(cfg: Optional[occ.TileConfig], keys_major: bool = False, row_swap: bool = False) -> None:
    """Force one tile configuration (block_m, block_n, num_warps, num_stages) for every backward and dropout launch,
    and ``bwd_kv``'s variant (``keys_major``: each query block computed as ``p^T``) (``recipes/bench_attention.py
    --backward --sweep``, tests); ``row_swap``: the row pass takes the tile transposed (BLOCK_M = the tile's
    BLOCK_N): the two passes are mirror images (``bwd_kv`` keeps a key block and its dK/dV and streams query
    blocks; the row pass keeps a row block and its dQ and streams key blocks), so the one tile makes the resident
    block of one pass the streamed block of the other. None (and False) restores the defaults."""
    global _OVERRIDE, _KEYS_MAJOR, _ROW_SWAP
    _OVERRIDE = cfg
    _KEYS_MAJOR = bool(keys_major)
    _ROW_SWAP = bool(row_swap) and cfg is not None


def _blocks(bd: int, wide: bool = False, strict: bool = False, split: bool = False, one: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages or None for Triton's default) for padded head dim ``bd``
    (``wide``: 4-byte operands, fp32 in any mode; ``strict``: IEEE fp32 products, no tensor cores): 32 under the
    interpreter (few programs); on a GPU, from the backward sweeps (bf16/fp32 precise, H=16, N=4K, causal;
    docs/PERF.md):

    * ``bd <= 64``: 64x64, 4 warps, 2 stages, bwd_kv rows-major for 2-byte operands (session 31, H100 bf16
      causal: kernels 0.314 ms against 0.554 ms for session 28's 32x64 keys-major, cuDNN 0.280, flash 0.448);
      32x64, 4 warps, 2 stages for fp32 (session 28);
    * ``bd <= 128``: 64x64, 4 warps, 2 stages for 2-byte operands (session 29, H200 bf16: 0.695 ms, 1.14x SDPA
      flash's backward, against 1.914 ms for the former 32x64/8 warps); 32x32, 4 warps, 2 stages for fp32 (7.13 ms
      against 10.1-13.2 ms for the rest; 64x64 needs more shared memory than an H100/H200 has); ``strict``: 32x32, 4
      warps, 1 stage, bwd_kv rows-major (session 38, H200, D = 128 N = 2K non-causal, dQ by the row pass: 14.2 ms
      against 26.5 ms keys-major; the first 29 tiles of a sweep that ran out of time, see :func:`_keys_major`);
    * larger: untuned first choices that ptxas compiles without spills (benchmarks/lab/bwd_spills.py);
    * ``split`` (``precise``'s fp16 split, keys-major): up to 128, 64x64, 4 warps, 2 stages (session 44, H200, H =
      16, N = 4K, the backward alone: D = 64 non-causal 2.08 ms against 3.24 ms at 32x64 and ME-SDPA's 4.97, causal
      1.41 against 2.13 and 3.06; D = 128 non-causal 5.25 ms against 6.68 at 32x64 and ME-SDPA's 9.33; 8 warps
      slower than 4 in every tile); turbo's split (``one``: one product) at ``bd <= 64``: 128x64 (session 45, H200,
      the backward alone at D = 64: non-causal 1.258 ms against 1.335 at 64x64, causal 0.892 against 0.910; 64x128
      0.885 causal but 1.336 non-causal), past 64 as precise's (D = 128 causal: 64x64 1.18 ms, 128x64 2.34)."""
    if _OVERRIDE is not None:
        return _OVERRIDE.block_m, _OVERRIDE.block_n, _OVERRIDE.num_warps, _OVERRIDE.num_stages
    if occ.interpreting():
        return 32, 32, 4, None
    if split and bd <= 128:
        return (128 if one and bd <= 64 else 64), 64, 4, 2
    if bd <= 64:
        return (32, 64, 4, 2) if wide else (64, 64, 4, 2)
    if bd <= 128:
        if strict:
            return 32, 32, 4, 1
        return (32, 32, 4, 2) if wide else (64, 64, 4, 2)
    return 32, 32, 8, None


def _ladder(bm: int, bn: int, warps: int, stages: Optional[int]):
    """The tiles tried when ``(bm, bn, warps, stages)`` needs more shared memory than the GPU has: the same with one
    stage, then BLOCK_N or BLOCK_M (the larger; BLOCK_N first) halved, one stage, down to 16 x 16."""
    yield bm, bn, warps, stages
    if stages != 1:
        yield bm, bn, warps, 1
    while bm > 16 or bn > 16:
        if bn >= bm and bn > 16:
            bn //= 2
        else:
            bm //= 2
        yield bm, bn, warps, 1


def _keys_major(bd: int, bm: int, bn: int, wide: bool = False, strict: bool = False) -> bool:
    """``bwd_kv``'s form where the sweeps measured it faster with :func:`_blocks`'s tile: keys-major for fp32
    (``wide``) up to 128 but ``strict`` past 64; rows-major elsewhere (2-byte operands: session 31 at D = 64) and
    under the interpreter;
    the override's when one is set. Rows-major tiles with ``BLOCK_N >= 4 * BLOCK_M`` run keys-major (logged once):
    32x128 rows-major with dQ by the row pass gave bf16 gradients 1.6-3x further from float64 than every other form
    on an H100 and an H200 (Triton 3.6; sessions 28 and 29; the interpreter and every other tile agree with float64), a
    suspected miscompile that no default tile or ladder rung reaches."""
    if _OVERRIDE is not None:
        km = _KEYS_MAJOR
    else:
        km = not occ.interpreting() and wide and (bd <= 64 if strict else bd <= 128)
    if not km and bn >= 4 * bm:
        if (bm, bn) not in _REROUTED:
            _REROUTED.add((bm, bn))
            log.info("elsa backward: bwd_kv's rows-major form is not used at %dx%d (wrong gradients on the GPU, "
                     "sessions 28-29); running it keys-major", bm, bn)
        return True
    return km


_REROUTED: set = set()  # the (BLOCK_M, BLOCK_N) that _keys_major moved to the keys-major form (logged once each)


def atomic_dq(deterministic: Optional[bool] = None, gluon_call: Optional[Callable[[], bool]] = None) -> bool:
    """Whether dQ is summed with atomic adds in the key-block pass rather than by the row pass: never when
    deterministic algorithms are on (``deterministic``, default ``torch.are_deterministic_algorithms_enabled()``);
    else when ``ELSA_BWD_DQ`` is atomic or gluon, or auto and ``gluon_call()`` says that the call runs the fp16/bf16
    Gluon kernel or strict's with atomic dQ (:func:`gluon_auto`)."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        return False
    mode = knobs.get(knobs.BWD_DQ)
    if mode == "auto":
        return gluon_call is not None and gluon_call()
    return mode in ("atomic", "gluon")


AUTO_GLUON_MAX_D = 128  # ELSA_BWD_DQ=auto: the widest head (D and Dv) that runs the Gluon kernel (gluon_auto)
# ... and the fewest query rows and keys a sequence, by head width (64: D and Dv <= 64; 128: wider) and causality
AUTO_GLUON_MIN_N = {(64, False): 1024, (64, True): 256, (128, False): 1024, (128, True): 2048}
# ... and fp32 strict calls that strict's Gluon backward of Hopper takes: dQ by atomic adds from its key-block pass from
# this many query rows and keys. Session 67 (H100, B = 1, H = 16, forward + backward against ME-SDPA, rows / atomic,
# non-causal | causal): N = 1K D = 64 0.890 / 1.056 | 0.826 / 1.025, D = 128 0.658 / 0.869 | 0.862 / 1.039; 2K D = 64
# 0.913 / 1.092 | 1.173 / 1.344, D = 128 0.626 / 0.826 | 0.777 / 0.970; 4K and 8K atomic ahead in every cell too. At
# 256-512 (B = 1: host-bound, wall-clock) neither wins throughout: rows ahead in 3 of the 6 cells timed both ways.
# Sessions 46-47's bound was 4K (D = 128 4K: 0.603 / 0.793, causal 0.672 / 0.840).
AUTO_STRICT_ATOMIC_MIN_N = 1024


def gluon_auto(q, k, v, do, call: dict, mask_grad: bool) -> bool:
    """``ELSA_BWD_DQ=auto``'s rule: a dense fp16/bf16 call in the Gluon backward's scope
    (``hopper_backward.lowp_eligible``) runs it (dQ by atomic adds) when its head dims are at most 64, or wider up to
    :data:`AUTO_GLUON_MAX_D` where the form that runs is ws2 (``hopper_backward.kernel_form``: D = 128, Dv <= 128),
    and its query rows and keys reach :data:`AUTO_GLUON_MIN_N` for its width and causality; any other call the row
    pass.

    The bounds are ws2's, session 64 (H100, bf16, H = 16, the backward through the public call: delta, dQ's
    zero-fill and cast included), ws2 against the row pass, ms, non-causal / causal:

    * D = 64: N = 256 B = 64 0.417 / 0.387, causal 0.301 / 0.395; 512 B = 32 0.442 / 0.413, causal 0.350 / 0.449;
      1K B = 16 0.595 / 0.654, causal 0.422 / 0.420; 2K B = 4 0.507 / 0.601, causal 0.305 / 0.335. D = 32: 1K 0.428 /
      0.495, causal 0.305 / 0.319; 2K 0.425 / 0.457, causal 0.213 / 0.336. Session 62, 4K and 16K: 0.461 / 0.562,
      7.01 / 8.59.
    * D = 128 (32-row tiles): N = 256 0.515 / 0.498, causal 0.669 / 0.456; 512 0.679 / 0.703, causal 0.656 / 0.551;
      1K 1.044 / 1.128, causal 0.801 / 0.751; 2K 0.930 / 1.038, causal 0.595 / 0.606; 4K B = 1 0.814 / 0.982, causal
      0.482 / 0.523; 16K 12.31 / 14.47, causal 6.77 / 7.62.

    Below the bounds the kernel's own time still wins at most lengths; dQ's fp32 zero-fill and cast and delta (about
    0.03-0.15 ms at these sizes) are what the row pass does not pay.

    fp32 ``strict`` calls that strict's Gluon backward takes (``hopper_backward.eligible``) add dQ atomically in its
    key-block pass from :data:`AUTO_STRICT_ATOMIC_MIN_N` query rows and keys (head dims up to 128; the row pass
    recomputes two of the backward's products): nondeterministic in the order of dQ's fp32 sums, as ME-SDPA's
    backward, and never under ``torch.use_deterministic_algorithms(True)`` (:func:`atomic_dq`)."""
    width = max(q.shape[-1], v.shape[-1])
    if call["varlen_dims"] is not None or q.dim() != 4 or width > AUTO_GLUON_MAX_D:
        return False
    n = min(q.shape[-2], k.shape[-2])
    dot = launch._dot_kind(q.dtype, call["precision"], q.device)
    from . import hopper_backward

    if dot == occ.DOT_IEEE:
        return n >= AUTO_STRICT_ATOMIC_MIN_N and hopper_backward.eligible(
            q, k, v, do, dot=dot, mask=call["mask"], q_lengths=call["q_lengths"], kv_lengths=call["kv_lengths"],
            varlen=False, dropout_p=call["dropout_p"], mask_grad=mask_grad) is None
    if n < AUTO_GLUON_MIN_N[(64 if width <= 64 else 128, bool(call["is_causal"]))] or dot != occ.DOT_LOWP:
        return False
    if width > 64 and hopper_backward.kernel_form(hopper_backward.lowp_form(), q.shape[-1], v.shape[-1]) != "ws2":
        return False
    return hopper_backward.lowp_eligible(q, k, v, do, dot=dot, mask=call["mask"], q_lengths=call["q_lengths"],
                                         kv_lengths=call["kv_lengths"], varlen=False, dropout_p=call["dropout_p"],
                                         mask_grad=mask_grad) is None


class _Call:
    """What every backward/dropout launch of one attention call shares: sizes, strides, the mask, the seed."""

    def __init__(self, q, k, v, *, scale, mask, is_causal, q_lengths, kv_lengths, cu_q, cu_k, varlen_dims,
                 precision, dropout_p, seed):
        self.varlen = varlen_dims is not None
        if self.varlen:
            self.B, self.Nq, self.Nk = varlen_dims
            self.Hq, self.D = q.shape[1], q.shape[2]
            self.Hkv, self.Dv = k.shape[1], v.shape[2]
        else:
            self.B, self.Hq, self.Nq, self.D = q.shape
            self.Hkv, self.Nk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.counter = (self.Hq * self.Nq, self.Nq, self.Nk)  # crb, crh, Nkc (backward._keep); packed: those of
        # the padded dense call [B, Hq, max_q, max_k]
        self.q, self.k, self.v = q, k, v
        self.scale = float(scale)
        self.dot = launch._dot_kind(q.dtype, precision, q.device)
        self.mask_t, self.mask_kind, self.sm, self.period = launch._mask_arg(mask)
        # the mask's tile classes per tiling (launch.mask_tile_classes), when its tiles are classified
        self.mask = mask if mask is not None and not self.varlen and knobs.get(knobs.MASK_TILES) == "all" else None
        self._classes: Dict[tuple, torch.Tensor] = {}
        self.is_causal = bool(is_causal)
        self.dropout_p = float(dropout_p)
        self.keep_scale = 1.0 / (1.0 - self.dropout_p) if self.dropout_p < 1 else 0.0  # a kept pair's factor
        dummy = q
        self.ptrs = (self.mask_t if self.mask_t is not None else dummy,
                     q_lengths if q_lengths is not None else dummy, kv_lengths if kv_lengths is not None else dummy,
                     cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy)
        self.seed = seed if (seed is not None and self.dropout_p > 0) else dummy
        self.flags = dict(MASK_KIND=self.mask_kind, IS_CAUSAL=self.is_causal, HAS_QLEN=q_lengths is not None,
                          HAS_KVLEN=kv_lengths is not None, VARLEN=self.varlen, DOT=self.dot,
                          DROPOUT=self.dropout_p > 0)
        self.BD, self.BDV = occ.block_dim(self.D), occ.block_dim(self.Dv)
        self._set_tiles()

    def _set_tiles(self, split: bool = False):
        bd, wide = max(self.BD, self.BDV), self.q.element_size() == 4
        strict = self.dot == occ.DOT_IEEE
        self.BM, self.BN, self.warps, self.stages = _blocks(bd, wide, strict, split, self.dot == occ.DOT_F16X1)
        self.keys_major = split or _keys_major(bd, self.BM, self.BN, wide, strict)
        # the tiles each pass asks for (set_tiles_override's row_swap: the row pass's transposed)
        self.tiles = {"bwd_kv": (self.BM, self.BN, self.warps, self.stages),
                      "row_pass": ((self.BN, self.BM) if _ROW_SWAP else (self.BM, self.BN)) + (self.warps, self.stages)}

    def use_split(self, dot: int):
        """The general passes with the fp16 split (``backward.py``'s dot kinds 5 and 7, ``occupancy.backward_dot``),
        which runs ``bwd_kv`` keys-major (also under a forced tile: :func:`set_tiles_override`'s ``keys_major`` does
        not apply)."""
        self.dot = self.flags["DOT"] = dot
        self._set_tiles(split=True)

    def strides(self, t):
        return launch._strides4(t, self.varlen)

    def lse_strides(self, lse):
        return (0, lse.stride(0), lse.stride(1)) if self.varlen else lse.stride()

    def scalars(self, n_blocks: int, n_bh: int, rows_major: bool):
        """The kernels' scalar arguments for ``n_blocks`` blocks of ``n_bh`` (batch, head) pairs: row blocks
        (``rows_major``: row_pass, one per query head) or key blocks (bwd_kv, one per K/V head). Causal launches order
        their blocks heaviest first over groups of heads that share the L2 (``scan.heaviest_first``, the forward's
        rule: ``occupancy.causal_head_group``; session 28, untimed in the backward): a row block reads the keys of its
        head, a key block the queries and output gradients of its group's heads."""
        groups = self.Hq // self.Hkv
        head_group = 1
        if self.is_causal:  # the operand rows a program walks: K/V of its head, or q/dO of its group's heads
            row = self.q.element_size() * (self.D + self.Dv)
            walked, row_bytes, shared = (self.Nk, row, groups) if rows_major else (self.Nq, row * groups, 1)
            head_group = occ.causal_head_group(self.q.device, n_k=walked, kv_bytes_per_key=row_bytes, groups=shared,
                                               bh=n_bh, m_blocks=n_blocks)
        return (self.scale * LOG2E, self.scale, self.dropout_p, self.keep_scale, self.Nq, self.Nk, self.Hq, groups,
                n_blocks, self.period, *self.counter, head_group, n_bh)

    def consts(self, bm: int, bn: int, warps: int, stages: Optional[int]):
        st = {} if stages is None else {"num_stages": stages}
        return dict(D=self.D, DV_=self.Dv, BLOCK_D=self.BD, BLOCK_DV=self.BDV, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, **st, **self.flags)

    def mask_ranges(self, name: str, bm: int, bn: int):
        """``(ranges, their plane and head strides)`` for pass ``name`` at tile ``bm x bn``: the mask's block ranges
        of each line the pass walks (``row_pass``: a row tile's key blocks; ``bwd_kv``: a key tile's row blocks;
        ``launch.mask_tile_ranges``), or None where the mask's tiles are not classified (no mask, packed varlen,
        ``ELSA_MASK_TILES`` other than ``all``, or lines of fewer than ``occupancy.MASK_RANGE_MIN_KEY_BLOCKS`` blocks)."""
        n_mb, n_nb = -(-self.Nq // bm), -(-self.Nk // bn)
        by_keys = name == "bwd_kv"
        if self.mask is None or (n_mb if by_keys else n_nb) < occ.MASK_RANGE_MIN_KEY_BLOCKS or not n_mb * n_nb:
            return None
        classes = self._classes.get((bm, bn))
        if classes is None:
            classes = self._classes[(bm, bn)] = launch.mask_tile_classes(self.mask, self.Nq, self.Nk, bm, bn)
        ranges = launch.mask_tile_ranges(classes, n_mb, n_nb, by_keys=by_keys)
        return ranges, (ranges.stride(0), ranges.stride(1) if ranges.shape[1] > 1 else 0)

    def launch(self, name: str, blocks_of, args_of, **extra):
        """``backward.<name>`` launched with this call's tiles, or, where Triton finds that they need more shared
        memory than the GPU has (it depends on the dot kind, the head dim, dQ's mode and the Triton version: session
        28, fp32 precise at D = 128 with atomic dQ asked 311,808 bytes of an H100's 232,448), with the first that fits
        of one stage, then halved BLOCK_N / BLOCK_M down to 16 (:func:`_ladder`), logged once and kept in
        :data:`FITTED` for the next calls. ``blocks_of(bm, bn)``: the grid's block count; ``args_of(n_blocks,
        ranges)``: the positional arguments, ``ranges`` being :meth:`mask_ranges`'s at the tile launched. A forced tile
        (:func:`set_tiles_override`) is launched as it is."""
        from triton.runtime.errors import OutOfResources

        asked = self.tiles[name]
        key = (name, self.q.device, self.q.dtype, self.BD, self.BDV, self.keys_major,
               tuple(sorted(self.flags.items())), tuple(sorted(extra.items())), asked)
        fitted = FITTED.get(key)
        rungs = [asked] if _OVERRIDE is not None else ([fitted] if fitted else list(_ladder(*asked)))
        kernel = getattr(_kernels(), name)
        for i, (bm, bn, warps, stages) in enumerate(rungs):
            n = blocks_of(bm, bn)
            ranges = self.mask_ranges(name, bm, bn)
            try:
                replay.launch(kernel, (n,), *args_of(n, ranges), **extra, HAS_RANGES=ranges is not None,
                              **self.consts(bm, bn, warps, stages))
            except OutOfResources as e:
                if "shared memory" not in str(e) or i + 1 == len(rungs):
                    raise
                continue
            if fitted is None and i:
                log.info("elsa backward: %s's tiles %dx%d (%s stages) need more shared memory than this GPU has; "
                         "running %dx%d with %s stage(s)", name, asked[0], asked[1], asked[3] or "Triton's default",
                         bm, bn, stages)
            FITTED[key] = (bm, bn, warps, stages)
            return

    def row_pass(self, what: int, res, res_strides, do=None, lse=None, delta=None, split=None):
        """``backward.row_pass`` over every (query block, batch, query head); ``split``: K and V's fp16 parts
        (:func:`_split_operands`' ``(pieces, strides)``) for dot kinds 5 and 7."""
        if self.Nq == 0 or self.B * self.Hq == 0:
            return res
        do_ = do if do is not None else self.q
        bh = self.B * self.Hq
        if split is not None:
            (kh, kl, ki, vh, vl, vi), (sk, sv, si) = split
        else:
            kh, kl, ki, vh, vl, vi = self.k, self.q, self.q, self.v, self.q, self.q
            sk, sv, si = self.strides(self.k), self.strides(self.v), (0, 0)
        self.launch(
            "row_pass", lambda bm, bn: -(-self.Nq // bm) * bh,
            lambda n, rg: (self.q, kh, vh, *self.ptrs, do_, lse, delta if delta is not None else lse,
                           self.seed, res, rg[0] if rg else self.q, kl, ki, vl, vi, *self.scalars(n // bh, bh, True),
                           *self.strides(self.q), *sk, *sv, *self.sm,
                           *(rg[1] if rg else (0, 0)), *(self.strides(do) if do is not None else (0, 0, 0, 0)),
                           *self.lse_strides(lse), *res_strides, *si),
            WHAT=what)
        return res


def dropout_output(q, k, v, out, lse, **call):
    """Overwrites ``out`` with the dropout output ``(softmax * keep / (1 - p)) @ v`` (``lse`` from the forward)."""
    c = _Call(q, k, v, **call)
    return c.row_pass(ROW_DROPOUT_OUT, out, c.strides(out), lse=lse)


def dropout_keep_mask(q, k, v, lse, **call):
    """Debug hook: the keep mask the kernels draw for this call, ``[B, Hq, Nq, Nk]`` bool (packed varlen:
    ``[B, Hq, max_q, max_k]``, sequence ``b``'s pairs at ``[b, :, :len_q, :len_k]``, False past them). Hidden pairs
    (causal, beyond the lengths) may read False. Materialises ``B·Hq·Nq·Nk`` bytes: meant for tests at small N."""
    c = _Call(q, k, v, **call)
    keep = torch.zeros((c.B, c.Hq, c.Nq, c.Nk), dtype=torch.uint8, device=q.device)
    c.row_pass(ROW_KEEP_MASK, keep, keep.stride(), lse=lse)
    return keep.bool()


def _delta(c: _Call, do, out, lse, dlse):
    """``rowsum(do * out) - dlse`` in ``lse``'s layout (a new contiguous fp32 tensor)."""
    delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    replay.allocated("delta", delta)
    if c.varlen:  # rows of head h: out[:, h], delta[h, :]
        n_rows, H = out.shape[0], out.shape[1]
        so, sd = (0, out.stride(1), out.stride(0), out.stride(2)), (0, do.stride(1), do.stride(0), do.stride(2))
        sg = (0, dlse.stride(0), dlse.stride(1)) if dlse is not None else (0, 0, 0)
        bh = H
    else:
        n_rows, H = out.shape[2], out.shape[1]
        so, sd = out.stride(), do.stride()
        sg = dlse.stride() if dlse is not None else (0, 0, 0)
        bh = out.shape[0] * H
    if n_rows == 0 or bh == 0:
        return delta
    block_r = 32
    replay.launch(_kernels().bwd_delta, (-(-n_rows // block_r), bh),
                  do, out, dlse if dlse is not None else lse, delta, n_rows, H, n_rows, *sd, *so, *sg,
                  DV=c.Dv, BLOCK_DV=c.BDV, BLOCK_R=block_r, HAS_DLSE=dlse is not None)
    return delta


def _reduce_mask_grad(ds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``dS [B, Hq, Nq, Nk]`` summed to the mask's shape: batch rows with the same ``b % period`` together
    (per-window masks; period = mask.shape[0]), then every axis where the mask has size 1."""
    B = ds.shape[0]
    period = mask.shape[0]
    g = ds.view(B // period, period, *ds.shape[1:]).sum(0) if period != B else ds
    dims = [i for i in range(1, 4) if mask.shape[i] == 1 and g.shape[i] != 1]
    if dims:
        g = g.sum(dims, keepdim=True)
    return g.to(mask.dtype)


def _zeros(name: str, shape, dtype, device) -> torch.Tensor:
    """A zero-filled tensor, registered with the launch plan being recorded (a replay fills a new one)."""
    shape = tuple(shape)
    t = torch.zeros(shape, dtype=dtype, device=device)
    replay.derived(name, t, lambda slots: torch.zeros(shape, dtype=dtype, device=device))
    return t


def _empty(name: str, shape, dtype, device) -> torch.Tensor:
    """An uninitialised tensor, registered with the launch plan being recorded."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    replay.allocated(name, t)
    return t


def _launches(do, q, k, v, out, lse, dlse, *, atomic: bool, mask_grad: bool, call: dict):
    """The backward's launches: ``(dq, dk, dv)`` and, with ``mask_grad``, ``dS`` (fp32 ``[B, Hq, Nq, Nk]``); dq
    in fp32 when ``atomic``. Every tensor it makes is registered with the launch plan being recorded, and nothing
    but launches touches them, so that a replay computes the same."""
    c = _Call(q, k, v, **call)
    has_keys = bool(c.Nk and c.B * c.Hkv)
    # contiguous, as ops' fake impl says; zero-filled where no launch writes them (no keys: no gradient)
    new = _empty if has_keys else _zeros
    dk = new("dk", k.shape, k.dtype, k.device)
    dv = new("dv", v.shape, v.dtype, v.device)
    short = _short_tiles(c) if has_keys and c.B * c.Hq else None
    dq_dtype = torch.float32 if atomic else q.dtype
    dense_short = short is not None and not c.varlen  # bwd_short writes every row of a dense dQ
    dq = (_empty("dq_short", q.shape, dq_dtype, q.device) if dense_short
          else _zeros("dq", q.shape, dq_dtype, q.device))
    ds = _zeros("ds", (c.B, c.Hq, c.Nq, c.Nk), torch.float32, q.device) if mask_grad else None
    if short is not None:
        if _short(c, short, do, out, lse, dlse, dq, dk, dv, ds):
            return (dq, dk, dv) + ((ds,) if ds is not None else ())
        if dense_short:  # the general passes leave rows past the lengths alone
            dq = _zeros("dq", q.shape, dq_dtype, q.device)
    delta = _delta(c, do, out, lse, dlse)
    if (has_keys and atomic and c.dot == occ.DOT_LOWP and _OVERRIDE is None
            and knobs.get(knobs.BWD_DQ) in ("gluon", "auto")):
        from . import hopper_backward

        why_not = hopper_backward.lowp_eligible(q, k, v, do, dot=c.dot, mask=c.mask_t, q_lengths=call["q_lengths"],
                                                kv_lengths=call["kv_lengths"], varlen=c.varlen,
                                                dropout_p=c.dropout_p, mask_grad=mask_grad)
        if why_not is None:  # fp16/bf16 on Hopper, ELSA_BWD_DQ=gluon (or auto's rule): the Gluon kernel, one launch
            hopper_backward.lowp_backward(do, q, k, v, lse, delta, dq, dk, dv, scale=c.scale, is_causal=c.is_causal)
            return dq, dk, dv
        if why_not not in _LOWP_PORTABLE:
            _LOWP_PORTABLE.add(why_not)
            log.info("elsa backward: ELSA_BWD_DQ=gluon, but this fp16/bf16 call runs the portable passes (%s)",
                     why_not)
    if has_keys and c.dot == occ.DOT_IEEE and _OVERRIDE is None:
        from . import hopper_backward

        why_not = hopper_backward.eligible(q, k, v, do, dot=c.dot, mask=c.mask_t, q_lengths=call["q_lengths"],
                                           kv_lengths=call["kv_lengths"], varlen=c.varlen, dropout_p=c.dropout_p,
                                           mask_grad=mask_grad)
        if why_not is None:  # strict on Hopper: the Gluon FMA passes (dQ by rows unless atomic)
            hopper_backward.backward(do, q, k, v, lse, delta, dq, dk, dv, scale=c.scale, is_causal=c.is_causal,
                                     atomic=atomic)
            return dq, dk, dv
        if why_not not in _STRICT_PORTABLE:
            _STRICT_PORTABLE.add(why_not)
            log.debug("elsa backward: strict runs the portable passes (%s)", why_not)
    bufs = None
    split_dot = occ.backward_dot(c.dot, float(q.numel()) * c.Nk) if not atomic and has_keys else c.dot
    if split_dot != c.dot:
        c.use_split(split_dot)
        bufs = _split_buffers(q, k, v, out, hi_only=split_dot == occ.DOT_F16X1)
    if has_keys:
        bh = c.B * c.Hkv
        if bufs is not None:  # q and dO split for the key-block pass
            pieces, (sq, so, si) = _split_operands(c, q, do, c.Hq, bufs)
            qh, ql, qi, oh, ol, oi = pieces
        else:
            qh, ql, qi, oh, ol, oi = q, q, q, do, q, q
            sq, so, si = c.strides(q), c.strides(do), (0, 0)
        c.launch("bwd_kv", lambda bm, bn: -(-c.Nk // bn) * bh,
                 lambda n, rg: (qh, k, v, *c.ptrs, oh, lse, delta, c.seed, dq, dk, dv, ds if ds is not None else q,
                                rg[0] if rg else q, ql, qi, ol, oi, *c.scalars(n // bh, bh, False), *sq,
                                *c.strides(k), *c.strides(v), *c.sm, *(rg[1] if rg else (0, 0)), *so,
                                *c.lse_strides(lse), *c.strides(dq), *c.strides(dk), *c.strides(dv),
                                *(ds.stride() if ds is not None else (0, 0, 0, 0)), *si),
                 ATOMIC_DQ=atomic, WRITE_DS=ds is not None, KEYS_MAJOR=c.keys_major)
    if not atomic:  # (with the split: K and V into the same buffers, after the key-block pass read q's and dO's)
        split = _split_operands(c, k, v, c.Hkv, bufs) if bufs is not None else None
        c.row_pass(ROW_DQ, dq, c.strides(dq), do=do, lse=lse, delta=delta, split=split)
    return (dq, dk, dv) + ((ds,) if ds is not None else ())


_LOWP_PORTABLE: set = set()  # why fp16/bf16 calls under ELSA_BWD_DQ=gluon ran the portable passes (logged once)
_STRICT_PORTABLE: set = set()  # why strict backward calls ran the portable passes, not the Gluon ones (logged once)


def _split_buffers(q, k, v, out, hi_only: bool = False):
    """Six flat tensors, registered with the plan being recorded, that hold two operands' fp16 hi and lo parts and
    inverse row scales (:func:`_split_operands`): q and dO for the key-block pass, then K and V for the row pass
    (extra memory: two fp32 copies of the larger of q and K, and of dO (out's size) and V). ``hi_only`` (dot kind 7,
    which reads hi parts alone): each lo entry is its hi buffer, left as the hi part (half the extra memory)."""
    d = q.shape[-1]
    rows = max(q.numel() // max(d, 1), k.numel() // max(d, 1))
    sizes = (max(q.numel(), k.numel()), max(out.numel(), v.numel()))
    bufs = []
    for part, n in (("a", sizes[0]), ("b", sizes[1])):
        hi = _empty(f"split_hi_{part}", (n,), torch.float16, q.device)
        bufs += [hi, hi if hi_only else _empty(f"split_lo_{part}", (n,), torch.float16, q.device),
                 _empty(f"split_inv_{part}", (rows,), torch.float32, q.device)]
    return bufs


def _split_operands(c: _Call, x, y, heads: int, bufs):
    """``x`` (``[B, heads, rows, D]``, packed ``[rows, heads, D]``) and ``y`` (the same with Dv) split by rows into
    ``bufs`` (``scan.split_f16``, scales per row): ``((x_hi, x_lo, x_inv, y_hi, y_lo, y_inv), (x's strides, y's
    strides, the scales' (batch, head) strides))``, the parts ``[B, heads, rows, C]`` contiguous from each buffer's
    start (packed: ``[heads, rows, C]``, batch stride 0), the scales ``[B, heads, rows]``."""
    d, dv = x.shape[-1], y.shape[-1]
    rows = x.shape[0] if c.varlen else x.shape[2]
    batch = 1 if c.varlen else c.B
    bd, bdv = occ.block_dim(d), occ.block_dim(dv)
    rk = max(1, 4096 // max(bd, bdv))  # rows per program
    n_rblocks = -(-rows // rk)
    sx, sy, si = (heads * rows * d, rows * d), (heads * rows * dv, rows * dv), (heads * rows, rows)
    if n_rblocks * batch * heads:
        xh, xl, xi, yh, yl, yi = bufs
        replay.launch(launch._scan().split_f16, (n_rblocks * batch * heads, 2), x, xh, xl, xi, y, yh, yl, yi, rows,
                      heads, n_rblocks, *c.strides(x), *sx, *si, *c.strides(y), *sy, *si,
                      D=d, DV=dv, BLOCK_RK=rk, BLOCK_D=bd, BLOCK_RV=rk, BLOCK_DV=bdv, V_ROWS=True,
                      HI_ONLY=xl is xh, num_warps=4)
    nb = 0 if c.varlen else 1  # (packed: the kernels' batch index is the sequence; its rows are offsets)
    return tuple(bufs), ((sx[0] * nb, sx[1], d, 1), (sy[0] * nb, sy[1], dv, 1), (si[0] * nb, si[1]))


# bwd_short takes calls of at most this many query rows and keys (one tile each) and head dims up to this
# (session 38, H200, benchmarks/lab/bwd_short.py: measured at D = 32 and 64, where its kernels took 0.55-0.77x the
# general passes' time; D = 128 holds five 64 x 128 tiles in registers, unmeasured)
SHORT_MAX_KEYS = 64
SHORT_MAX_HEAD_DIM = 64


def _short_tiles(c: _Call) -> Optional[tuple]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of ``backward.bwd_short`` for this call, or None where the general passes
    run: more than :data:`SHORT_MAX_KEYS` query rows or keys (packed varlen: the longest sequence), head dims past
    :data:`SHORT_MAX_HEAD_DIM`, a forced tile (sweeps, tests) or ``ELSA_BWD_SHORT=0``."""
    if _OVERRIDE is not None or knobs.get(knobs.BWD_SHORT) == "0":
        return None
    if c.Nq > SHORT_MAX_KEYS or c.Nk > SHORT_MAX_KEYS or max(c.BD, c.BDV) > SHORT_MAX_HEAD_DIM:
        return None
    return occ.block_dim(c.Nq), occ.block_dim(c.Nk), 4


_SHORT_REFUSED: set = set()  # (device, dtype, tiles, flags) whose bwd_short compile asked too many resources


def _short(c: _Call, tiles: tuple, do, out, lse, dlse, dq, dk, dv, ds) -> bool:
    """The whole backward in one ``bwd_short`` launch with :func:`_short_tiles`'s ``tiles`` (True when it ran). A
    tile that asks more resources than the GPU has falls back to the general passes, logged once."""
    bm, bn, warps = tiles
    key = (c.q.device, c.q.dtype, c.BD, c.BDV, tiles, tuple(sorted(c.flags.items())), ds is not None)
    if key in _SHORT_REFUSED:
        return False
    from triton.runtime.errors import OutOfResources

    consts = c.consts(bm, bn, warps, None)
    try:
        replay.launch(_kernels().bwd_short, (c.B * c.Hkv,), c.q, c.k, c.v, *c.ptrs, do, out, lse,
                      dlse if dlse is not None else lse, c.seed, dq, dk, dv, ds if ds is not None else c.q,
                      c.scale * LOG2E, c.scale, c.dropout_p, c.keep_scale, c.Nq, c.Nk, c.Hq, c.Hq // c.Hkv, c.period,
                      *c.counter, *c.strides(c.q), *c.strides(c.k), *c.strides(c.v), *c.sm, *c.strides(do),
                      *c.strides(out), *c.lse_strides(lse), *(c.lse_strides(dlse) if dlse is not None else (0, 0, 0)),
                      *c.strides(dq), *c.strides(dk), *c.strides(dv),
                      *(ds.stride() if ds is not None else (0, 0, 0, 0)),
                      WRITE_DS=ds is not None, HAS_DLSE=dlse is not None, **consts)
    except OutOfResources as e:
        _SHORT_REFUSED.add(key)
        log.info("elsa backward: the one-tile backward at %dx%d (head dims %d/%d, %s) does not fit this GPU (%s); "
                 "running the general passes", bm, bn, c.D, c.Dv, c.q.dtype, str(e).splitlines()[0][:80])
        return False
    return True


def _backward_key(do, q, k, v, out, lse, dlse, *, atomic: bool, mask_grad: bool, call: dict) -> tuple:
    """The launch plan key of a backward call (kernels/replay.py): identities, device, capture, scalars and every
    tensor's geometry (shape, strides, dtype, 16-byte alignment)."""
    g = launch._geometry
    c = call
    return ("backward", *launch.plan_key_head(q, k, v, c["cu_q"], c["cu_k"], c["q_lengths"], c["kv_lengths"]),
            float(c["scale"]), bool(c["is_causal"]), c["precision"], c["varlen_dims"], float(c["dropout_p"]),
            bool(atomic), bool(mask_grad), knobs.get(knobs.BWD_SHORT), knobs.get(knobs.BWD_LOWP), g(do), g(q), g(k),
            g(v), g(out), g(lse), g(dlse), g(c["mask"]),
            g(c["q_lengths"]), g(c["kv_lengths"]), g(c["cu_q"]), g(c["cu_k"]), g(c["seed"]))


KEY_MEMO_MAX = 8  # backward keys a key_memo keeps (output-gradient layouts x knob values: a few in practice)
# the knobs a key_memo entry was made under, by their raw values (what decides the dQ mode, the one-launch path and
# whether plans are used): a changed value makes a new entry, validated by knobs.get as it is made
_MEMO_ENV = tuple(knobs.KNOBS[n].key for n in (knobs.BWD_DQ, knobs.BWD_SHORT, knobs.BWD_LOWP, replay.ENV))


def attention_backward(do, q, k, v, out, lse, *, scale, mask=None, is_causal=False, q_lengths=None,
                       kv_lengths=None, cu_q=None, cu_k=None, varlen_dims=None, precision=None, dropout_p=0.0,
                       seed=None, mask_grad=False, dlse=None, deterministic: Optional[bool] = None,
                       key_memo: Optional[dict] = None):
    """``(dq, dk, dv, dmask or None)`` of one attention call (contiguous tensors). ``out``/``lse`` are the forward's;
    ``do`` may have any strides. dQ is computed by a separate pass over query blocks unless :func:`atomic_dq`
    (``ELSA_BWD_DQ=atomic`` and not ``deterministic``, default ``torch.are_deterministic_algorithms_enabled()``)
    picks atomic adds. Through a launch plan (kernels/replay.py) on CUDA tensors: a call's signature is planned once
    and its launches replayed after (session 31, H100: Triton's generic launch path was most of a small training
    call's host time).

    ``key_memo``: a dict kept by a caller whose calls share everything of the plan's key but ``do``, ``dlse``, the
    aliasing / device / capture head and the choices read here (the backward of one direct route:
    ``training.RoutedAttention``); the full key and the dQ mode are then found once per value of those (the
    deterministic setting and :data:`_MEMO_ENV`'s variables as set), not on every call."""
    if mask_grad and (mask is None or mask.dtype == torch.bool):
        raise ValueError("mask_grad: only an additive float mask has a gradient")
    lse = lse.contiguous()  # delta takes lse's layout (the forward's lse is contiguous: a no-op)
    if 0 in do.stride() and do.numel() > 1:
        # an expanded output gradient (``out.sum().backward()``): one copy, so that strict's Gluon passes can read it
        # through a TMA descriptor (hopper_backward.eligible; the portable passes read any strides)
        do = do.contiguous()
    short = hit = None
    if key_memo is not None and _OVERRIDE is None:
        g = launch._geometry
        det = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
        short = (*launch.plan_key_head(q, k, v, cu_q, cu_k, q_lengths, kv_lengths), g(do), g(dlse), det,
                 tuple(map(knobs._ENVIRON.get, _MEMO_ENV)))  # (the knobs as set: validated when the entry was made)
        hit = key_memo.get(short)
    call = dict(scale=scale, mask=mask, is_causal=is_causal, q_lengths=q_lengths, kv_lengths=kv_lengths, cu_q=cu_q,
                cu_k=cu_k, varlen_dims=varlen_dims, precision=precision, dropout_p=dropout_p, seed=seed)
    atomic = (atomic_dq(deterministic, lambda: gluon_auto(q, k, v, do, call, mask_grad)) if hit is None
              else hit[1])

    def plan_and_run():
        return None, None, _launches(do, q, k, v, out, lse, dlse, atomic=atomic, mask_grad=mask_grad, call=call)

    if hit is None and (_OVERRIDE is not None or not replay.wanted(q)):  # a forced tile (sweeps, tests): planned
        grads = plan_and_run()[2]  # on every call
    else:  # through a launch plan: planned and recorded once per signature, replayed after (ELSA_LAUNCH_PLANS)
        if hit is not None:
            key = hit[0]
        else:
            key = _backward_key(do, q, k, v, out, lse, dlse, atomic=atomic, mask_grad=mask_grad, call=call)
            if short is not None and len(key_memo) < KEY_MEMO_MAX:
                key_memo[short] = (key, atomic)
        slots = dict(do=do, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, mask=mask, q_lengths=q_lengths,
                     kv_lengths=kv_lengths, cu_q=cu_q, cu_k=cu_k, seed=seed)
        grads = replay.run(key, slots, plan_and_run, launch._ALIASES)[2]
    dq, dk, dv = grads[:3]
    if atomic:
        dq = dq.to(q.dtype)
    dmask = _reduce_mask_grad(grads[3], mask) if mask_grad else None
    return dq, dk, dv, dmask
