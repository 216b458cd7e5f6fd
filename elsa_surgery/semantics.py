"""The one statement of attention semantics (docs/design.md, "One statement of attention semantics").

Every backend receives an :class:`AttentionProblem` built here, so validation, defaults, mask
canonicalisation and the meaning of every argument live in this file and nowhere else:

* ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B, Hkv, Nk, Dv]``; ``Hq % Hkv == 0`` and query head
  ``h`` reads kv head ``h // (Hq // Hkv)``.
* ``scale`` defaults to ``D ** -0.5``.
* ``mask``: bool (True = attend) or additive float, canonicalised to a 4-D view ``[P, Hq|1, Nq, Nk]``
  (broadcast axes have stride 0, nothing is copied); batch row ``b`` reads mask row ``b % P``. ``P`` is
  1 or ``B`` for an ordinary broadcast mask, or ``nW`` for a per-window (Swin) mask.
* ``is_causal``: bottom-right aligned; with padded lengths, aligned to each row's own valid lengths:
  query ``i`` sees key ``j`` iff ``j <= i + kv_len[b] - q_len[b]``. Together with ``attn_mask`` the two
  intersect (torch 2.14's SDPA raises there: a deliberate extension, docs/fidelity.md).
* ``attn_mask`` may also be PyTorch's ``torch.nn.attention.bias.CausalBias`` (no dense mask is built, and its
  own device does not matter): ``causal_lower_right`` is ``is_causal``; ``causal_upper_left`` (query ``i``
  sees keys ``j <= i``) is ``is_causal`` over the first ``Nq`` keys when ``Nq <= Nk`` (later keys are never
  visible), and when ``Nq > Nk`` a causal square over the first ``Nk`` query rows plus rows that see every
  key (:meth:`AttentionProblem.row_pieces`: backends run each piece as an ordinary problem).
* ``q_lengths`` / ``kv_lengths``: per-batch valid lengths (``int32 [B]``). Keys ``j >= kv_len[b]`` are
  never attended; query rows ``i >= q_len[b]`` are padding and return zeros.
* A query row with no visible key returns zeros (and ``lse = -inf``), never NaN. An additive ``-inf``
  hides a key; finite values hide nothing (``torch.finfo.min`` rows average their keys, as in SDPA). The
  Triton kernels treat finite mask values below ``-2.3e38`` (:data:`MASK_FLOOR`) as ``-2.3e38`` (times
  ``log2(e)`` they must stay finite), and so does ``backend="sdpa"`` on CUDA (PyTorch's fused kernels scale
  the same way: a ``finfo.min`` mask turned rows to zeros there, found by the GPU fuzz): outputs are
  unchanged unless every visible key of a row lies below it with different values, and the lse of a row
  whose every key lies below it reads about ``-2.3e38``.
* Output dtype = input dtype; accumulation in fp32 (float64 for float64 inputs).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence, Union

# finite additive mask values below this act as this value (kernels/scan.py holds the same number as a Triton
# constexpr; the kernels package does not import this module)
MASK_FLOOR = -2.3e38

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

Lengths = Union[torch.Tensor, Sequence[int], None]


@dataclass
class AttentionProblem:
    """A validated, canonical attention call. Tensors are the caller's (never copied or modified)."""

    q: torch.Tensor  # [B, Hq, Nq, D]
    k: torch.Tensor  # [B, Hkv, Nk, D]
    v: torch.Tensor  # [B, Hkv, Nk, Dv]
    scale: float
    mask: Optional[torch.Tensor]  # [P, Hq|1, Nq, Nk], bool (True = attend) or float additive
    is_causal: bool
    q_lengths: Optional[torch.Tensor]  # int32 [B] on q.device
    kv_lengths: Optional[torch.Tensor]  # int32 [B] on q.device
    squeeze_head: bool = False  # the caller passed 3-D tensors; the output drops the head axis
    dropout_p: float = 0.0  # attention-probability dropout (SDPA's)
    causal_rows: Optional[int] = None  # upper-left CausalBias with Nq > Nk: only rows < causal_rows are causal

    def row_pieces(self) -> list:
        """The problem as consecutive blocks of query rows, each an ordinary problem that every backend runs
        as is; the outputs (and lse) concatenate along the row axis. One piece, except for an upper-left
        ``CausalBias`` with ``Nq > Nk``: the first ``Nk`` rows are a causal square (bottom-right = upper-left
        there), the rows below see every key."""
        n = self.causal_rows
        if n is None:
            return [self]
        top = dataclasses.replace(self, q=self.q[:, :, :n], is_causal=True, causal_rows=None)
        rest = dataclasses.replace(self, q=self.q[:, :, n:], is_causal=False, causal_rows=None)
        return [top, rest]

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def heads_kv(self) -> int:
        return self.k.shape[1]

    @property
    def groups(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def n_q(self) -> int:
        return self.q.shape[2]

    @property
    def n_k(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[3]

    @property
    def mask_kind(self) -> str:
        if self.mask is None:
            return "none"
        return "bool" if self.mask.dtype == torch.bool else "additive"

    def output_shape(self) -> tuple:
        return (self.batch, self.heads_q, self.n_q, self.head_dim_v)

    @property
    def empty(self) -> bool:
        """No (query, key) pair at all: every output row is zeros (a row with no key)."""
        return self.batch == 0 or self.n_q == 0 or self.n_k == 0 or self.heads_q == 0

    def empty_output(self) -> torch.Tensor:
        """The zeros of an :attr:`empty` call as products over its empty axis, so that autograd connects them to q,
        k and v as it does SDPA's answer (whose backward gives zero gradients): exact whatever the values, a sum
        over nothing being 0. GQA by grouping the query heads of a K/V head (no K/V copy)."""
        B, Hq, Nq, D = self.q.shape
        Hkv = self.k.shape[1]
        q = self.q.reshape(B, Hkv, (Hq // Hkv) * Nq, D)
        out = torch.matmul(torch.matmul(q, self.k.transpose(-1, -2)), self.v)
        return out.reshape(self.output_shape())

    @property
    def has_index_mask(self) -> bool:
        """Whether causality or padded lengths hide some (query, key) pairs."""
        return self.is_causal or self.q_lengths is not None or self.kv_lengths is not None

    def visible(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``[B, len(rows), len(cols)]`` bool: query ``i`` may see key ``j`` under lengths and causality.

        Keys ``j >= kv_len[b]`` and padding rows ``i >= q_len[b]`` see nothing; causal is bottom-right:
        ``j <= i + kv_len[b] - q_len[b]``.
        """
        B, dev = self.batch, rows.device
        q_len = self.q_lengths.long() if self.q_lengths is not None else torch.full((B,), self.n_q, device=dev)
        kv_len = self.kv_lengths.long() if self.kv_lengths is not None else torch.full((B,), self.n_k, device=dev)
        r, c = rows.view(1, -1, 1), cols.view(1, 1, -1)
        vis = (c < kv_len.view(-1, 1, 1)) & (r < q_len.view(-1, 1, 1))
        if self.is_causal:
            vis = vis & (c <= r + (kv_len - q_len).view(-1, 1, 1))
        return vis

    def restore_shape(self, out: torch.Tensor, lse: Optional[torch.Tensor] = None):
        if self.squeeze_head:
            out = out.squeeze(1)
            lse = None if lse is None else lse.squeeze(1)
        return out, lse


# --------------------------------------------------------------------------------------------------
# validation helpers (each error names the argument and what is supported)
# --------------------------------------------------------------------------------------------------

def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor: ELSA takes dense tensors (SDPA's nested inputs map onto "
                        f"elsa_surgery.attention_varlen's packed layout with cu_seqlens)")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got dtype {t.dtype}"
        )


# whether autocast is on for any device type: 0.27 us against 1.7 us for torch.is_autocast_enabled(q.device.type)
# (torch 2.14, CPU); PyTorch's private test where it has one, else True (then the public per-device test decides)
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_dtype(q) -> Optional[torch.dtype]:
    """The dtype of the ``torch.autocast`` region active for ``q``'s device type, or None (outside one).

    SDPA's autocast rule, which the entry points follow to be a drop-in (:func:`autocast_cast`): inside
    ``torch.autocast(device_type, dtype)`` every float16/bfloat16/float32 tensor argument on that device (q, k, v, a
    float mask) is cast to the autocast dtype (float64 and bool are left as they are), and the op itself runs with
    autocast off. (Session 29: timm ViT with ``qk_norm`` under CUDA autocast gave fp32 q/k from the fp32 LayerNorm
    beside a bf16 v, which SDPA accepts and ``check_qkv`` refused; the reference backend's fp32 scores, computed
    inside the region, were downcast by autocast.)"""
    if not _ANY_AUTOCAST() or not isinstance(q, torch.Tensor):  # the cheap test first: it is on every call's host
        return None
    dev = q.device.type
    try:
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except RuntimeError:  # a device type without autocast
        return None


def autocast_cast(dtype: torch.dtype, device_type: str, *tensors):
    """``tensors`` as autocast hands them to SDPA (:func:`autocast_dtype`): each float16/bfloat16/float32 tensor
    on ``device_type`` cast to ``dtype``; the rest (float64, bool, None, a ``CausalBias``, which holds no values)
    unchanged."""
    def cast(t):
        eligible = (isinstance(t, torch.Tensor) and not isinstance(t, CausalBias) and t.is_floating_point()
                    and t.dtype != torch.float64 and t.device.type == device_type)
        return t.to(dtype) if eligible else t

    return tuple(cast(t) for t in tensors)


def check_qkv(q, k, v, *, layout: str) -> None:
    """Types, dtypes and devices of q/k/v (shapes are checked by the caller, per layout)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    expected = {"dense": (3, 4), "varlen": (3,)}[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() not in expected:
            what = "[B, H, N, D] (or [B, N, D])" if layout == "dense" else "[total, H, D]"
            raise ValueError(f"{name} must have shape {what}, got {_shape(t)}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"q, k and v must have the same rank, got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")


def check_heads_and_dims(q, k, v, *, head_axis: int, seq_axis: int) -> None:
    hq, hkv = q.shape[head_axis], k.shape[head_axis]
    if k.shape[head_axis] != v.shape[head_axis]:
        raise ValueError(f"k and v must have the same number of heads, got k {_shape(k)}, v {_shape(v)}")
    if k.shape[seq_axis] != v.shape[seq_axis]:
        raise ValueError(f"k and v must have the same sequence length, got k {_shape(k)}, v {_shape(v)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim D, got q {_shape(q)}, k {_shape(k)}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be >= 1, got q {_shape(q)}, v {_shape(v)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of kv heads (Hq % Hkv == 0), "
            f"got Hq={hq} (q {_shape(q)}) and Hkv={hkv} (k {_shape(k)})"
        )


def resolve_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a Python number or a one-element tensor, got shape {_shape(scale)}")
        scale = scale.item()
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_dropout(dropout_p) -> float:
    """SDPA's ``dropout_p``: a number in [0, 1] (None = 0)."""
    if dropout_p is None:
        return 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):  # Python and NumPy numbers
        raise TypeError(f"dropout_p must be a number in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:  # also rejects NaN
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    return float(dropout_p)


def _data_checks_allowed(t: torch.Tensor) -> bool:
    """Value checks need a host sync: skip them while tracing or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def canonical_lengths(name: str, lengths: Lengths, batch: int, limit: int, device) -> Optional[torch.Tensor]:
    """Per-batch valid lengths as ``int32 [B]`` on ``device``, each in ``[0, limit]``."""
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.tensor(list(lengths), dtype=torch.int32)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an integer tensor or sequence of ints of length B={batch}") from None
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
    if lengths.dim() != 1 or lengths.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {_shape(lengths)}")
    if _data_checks_allowed(lengths) and batch > 0 and not lengths_checked(lengths, limit):
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > limit:
            raise ValueError(f"{name} values must lie in [0, {limit}], got min {lo} and max {hi}")
        _remember_valid(lengths, limit)
    return lengths.to(device=device, dtype=torch.int32)


def canonical_dense_lengths(q_lengths: Lengths, kv_lengths: Lengths, batch: int, n_q: int, n_k: int, device):
    """``(q_lengths, kv_lengths)`` of a dense call (:func:`canonical_lengths`: each in ``[0, n_q]`` / ``[0, n_k]``)."""
    return (canonical_lengths("q_lengths", q_lengths, batch, n_q, device),
            canonical_lengths("kv_lengths", kv_lengths, batch, n_k, device))


# Lengths tensors whose values were checked, while unchanged (same object, same in-place version): the layers of one
# forward pass share one lengths tensor (the transformers adapter computes it once per padding mask), so the value
# check, a host sync, runs once per forward instead of once per layer. Inference tensors (made under
# torch.inference_mode) have no version counter: a caller's is checked on every call, as an in-place change could
# not be seen; lengths a caller made itself and never hands out (:func:`trust_lengths`) are kept as they are.
_VALID_MAX = 8
_valid: list = []  # [(weakref to the tensor, its _version or None for an inference tensor, the checked limit,
#                      trusted (trust_lengths), every length >= 1)]


def lengths_checked(t: torch.Tensor, limit: int) -> bool:
    """Whether lengths ``t`` are known to lie in ``[0, limit]``: checked by :func:`canonical_lengths` before and
    unchanged since, or recorded by :func:`trust_lengths`."""
    for ref, version, checked, _, _ in _valid:  # (a loop, not any() over a generator: every eager call with lengths)
        if ref() is t and checked <= limit and (version is None or version == t._version):
            return True
    return False


def _remember_valid(t: torch.Tensor, limit: int, trusted: bool = False, positive: bool = False) -> None:
    if t.is_inference() and not trusted:
        return  # no version counter: an in-place change could not be seen, so the next call checks again
    _valid.append((weakref.ref(t), None if t.is_inference() else t._version, limit, trusted, positive))
    del _valid[:-_VALID_MAX]


def trust_lengths(t: torch.Tensor, limit: int, *, positive: bool = False) -> None:
    """Records lengths that lie in ``[0, limit]`` by construction (e.g. the row sums of a padding mask ``limit``
    keys wide) as checked, so their calls skip the value check and its host sync. Only for a tensor its caller
    made and does not hand out: nothing else can change it in place. ``positive``: the caller knows that every
    length is at least 1 (:func:`trusted_lengths`). A no-op while tracing or capturing."""
    if _data_checks_allowed(t):
        _remember_valid(t, limit, trusted=True, positive=positive)


def trusted_lengths(t: torch.Tensor) -> Optional[bool]:
    """For lengths recorded by :func:`trust_lengths` and unchanged since, whether every one is at least 1; None for
    any other tensor (whose values may change between calls: nothing derived from them may be kept)."""
    if torch.compiler.is_compiling():
        return None
    for ref, version, _, trusted, positive in _valid:
        if trusted and ref() is t and (version is None or version == t._version):
            return positive
    return None


def canonical_mask(attn_mask, *, batch: int, heads_q: int, n_q: int, n_k: int, windowed: bool, device):
    """Return a 4-D ``[P, Hq|1, Nq, Nk]`` view of ``attn_mask`` (no copy) or None."""
    if attn_mask is None:
        if windowed:
            raise ValueError("windowed_mask=True needs an attn_mask of shape [nW, Hq|1, Nq, Nk]")
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating (additive), got dtype {attn_mask.dtype}"
        )
    if attn_mask.device != device:
        raise ValueError(f"attn_mask must be on the same device as q ({device}), got {attn_mask.device}")
    # the target shape is formatted only when raising: formatting symbolic sizes under torch.compile would
    # specialise them (every new sequence length would recompile)
    target = lambda: f"[B, Hq, Nq, Nk] = [{batch}, {heads_q}, {n_q}, {n_k}]"
    if windowed:
        if attn_mask.dim() != 4:
            raise ValueError(
                f"with windowed_mask=True, attn_mask must be 4-D [nW, Hq|1, Nq, Nk], got {_shape(attn_mask)}"
            )
        n_win = attn_mask.shape[0]
        if n_win == 0 or batch % n_win != 0:
            raise ValueError(
                f"with windowed_mask=True, attn_mask's first axis (nW={n_win}) must divide the batch B={batch}"
            )
        rest = attn_mask.shape[1:]
        ok = rest[0] in (1, heads_q) and rest[1] in (1, n_q) and rest[2] in (1, n_k)
        if not ok:
            raise ValueError(f"attn_mask of shape {_shape(attn_mask)} does not broadcast to [nW, {heads_q}, {n_q}, {n_k}]")
        return attn_mask.expand(n_win, rest[0], n_q, n_k)
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims broadcastable to {target()}, got {_shape(attn_mask)}")
    shape4 = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    for got, want in zip(shape4, (batch, heads_q, n_q, n_k)):
        if got not in (1, want):
            raise ValueError(f"attn_mask of shape {_shape(attn_mask)} does not broadcast to {target()}")
    m4 = attn_mask.reshape(shape4) if attn_mask.dim() < 4 else attn_mask
    return m4.expand(shape4[0], shape4[1], n_q, n_k)


def broadcast_batch_and_heads(q, k, v, enable_gqa):
    """SDPA broadcasts size-1 batch and head axes of q, k and v: the same here, as stride-0 views (no copies).

    A single kv head serves every query head without ``enable_gqa`` (SDPA's broadcast; the kernels read it as
    MQA); a single query head is expanded to the kv heads (SDPA's output has that many heads)."""
    def common(name, sizes):
        big = {n for n in sizes if n != 1}
        if len(big) > 1:
            raise ValueError(f"q, k and v must share the {name} (or have 1 there, which broadcasts), "
                             f"got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
        return big.pop() if big else 1

    B = common("batch size B", (q.shape[0], k.shape[0], v.shape[0]))
    Hkv = common("number of kv heads", (k.shape[1], v.shape[1]))
    Hq = q.shape[1]
    if Hq == 1 and Hkv > 1 and not enable_gqa:
        Hq = Hkv
    grow = lambda t, h: t if t.shape[:2] == (B, h) else t.expand(B, h, *t.shape[2:])
    return grow(q, Hq), grow(k, Hkv), grow(v, Hkv)


def build_problem(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    *, q_lengths: Lengths = None, kv_lengths: Lengths = None, windowed_mask: bool = False,
) -> AttentionProblem:
    """Validate an SDPA-style call and return its canonical form (never copies q/k/v)."""
    check_qkv(q, k, v, layout="dense")
    dropout_p = check_dropout(dropout_p)
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    q, k, v = broadcast_batch_and_heads(q, k, v, enable_gqa)
    check_heads_and_dims(q, k, v, head_axis=1, seq_axis=2)
    if q.shape[1] != k.shape[1] and k.shape[1] != 1 and not enable_gqa:
        raise ValueError(
            f"q has {q.shape[1]} heads but k/v have {k.shape[1]}: pass enable_gqa=True for grouped-query "
            f"attention (Hq must be a multiple of Hkv)"
        )
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    causal_rows = None
    if isinstance(attn_mask, CausalBias):
        k, v, causal_rows = causal_bias(attn_mask, q, k, v, is_causal=is_causal, windowed=windowed_mask,
                                        lengths=q_lengths is not None or kv_lengths is not None)
        attn_mask, is_causal = None, True
    mask = canonical_mask(attn_mask, batch=B, heads_q=Hq, n_q=Nq, n_k=Nk, windowed=windowed_mask, device=q.device)
    ql, kl = canonical_dense_lengths(q_lengths, kv_lengths, B, Nq, Nk, q.device)
    return AttentionProblem(
        q=q, k=k, v=v, scale=resolve_scale(scale, D), mask=mask, is_causal=bool(is_causal),
        q_lengths=ql, kv_lengths=kl, squeeze_head=squeeze, dropout_p=dropout_p, causal_rows=causal_rows,
    )


def causal_bias(bias, q, k, v, *, is_causal, windowed, lengths):
    """``(k, v, causal_rows)`` of a call whose ``attn_mask`` is a ``CausalBias`` (module docstring); the caller
    then sets ``is_causal``. Keys are sliced (views), nothing is materialised."""
    Nq, Nk = q.shape[2], k.shape[2]
    if is_causal:
        raise ValueError("CausalBias should not be used with causal=True (SDPA's words: attn_mask=CausalBias and "
                         "is_causal=True ask for causality twice; pass one of them)")
    if windowed or lengths:
        raise ValueError("attn_mask=CausalBias cannot be combined with windowed_mask, q_lengths or kv_lengths; "
                         "pass is_causal=True instead")
    if (bias.seq_len_q, bias.seq_len_kv) != (Nq, Nk):
        raise ValueError(f"attn_mask=CausalBias was made for (seq_len_q, seq_len_kv) = ({bias.seq_len_q}, "
                         f"{bias.seq_len_kv}) but q and k have Nq={Nq} and Nk={Nk}")
    if bias.variant == CausalVariant.LOWER_RIGHT:
        return k, v, None
    if bias.variant != CausalVariant.UPPER_LEFT:
        raise ValueError(f"attn_mask=CausalBias has an unknown variant {bias.variant!r}")
    if Nq <= Nk:  # query i sees keys j <= i < Nq: a causal square over the first Nq keys
        return k[:, :, :Nq], v[:, :, :Nq], None
    return k, v, Nk


@dataclass
class VarlenProblem:
    """Packed sequences, flash-attn's convention: ``q [total_q, Hq, D]``, ``cu_seqlens_q [B + 1]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B + 1], cu[0] = 0, cu[-1] = total_q, non-decreasing
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    is_causal: bool
    dropout_p: float = 0.0  # attention-probability dropout (SDPA's), per sequence

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def _check_cu_seqlens(name: str, cu, total: int, total_name: str, max_name: str, max_len, device) -> torch.Tensor:
    if (type(max_len) is int and not torch.compiler.is_compiling() and cu_seqlens_checked(cu, total, max_len)
            and cu.dtype == torch.int32 and cu.device == device):
        return cu  # checked before and unchanged, int32 on the device: nothing to check or convert (never while
        # tracing: the in-place version is a data-dependent value for dynamo, as the value checks are)
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape [B + 1], got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 (or int64), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape [B + 1] with B >= 0, got {_shape(cu)}")
    try:
        max_len = int(max_len)
    except (TypeError, ValueError):
        raise TypeError(f"{max_name} must be an int, got {type(max_len).__name__}") from None
    if max_len < 0:
        raise ValueError(f"{max_name} must be >= 0, got {max_len}")
    if _data_checks_allowed(cu) and not cu_seqlens_checked(cu, total, max_len):
        host = cu.detach().to("cpu", torch.int64)
        if int(host[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
        steps = host[1:] - host[:-1]
        if steps.numel() and int(steps.min()) < 0:
            bad = int(torch.nonzero(steps < 0)[0])
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{bad}]={int(host[bad])} > {name}[{bad + 1}]={int(host[bad + 1])}"
            )
        if int(host[-1]) != total:
            raise ValueError(f"{name}[-1]={int(host[-1])} must equal {total_name}={total}")
        longest = int(steps.max()) if steps.numel() else 0
        if longest > max_len:
            raise ValueError(f"{max_name}={max_len} is smaller than the longest sequence in {name} ({longest})")
        if not cu.is_inference():  # (no version counter: checked on every call, as inference-tensor lengths are)
            _cu_valid.append((weakref.ref(cu), cu._version, total, longest))
            del _cu_valid[:-_VALID_MAX]
    return cu.to(device=device, dtype=torch.int32)


# cu_seqlens tensors whose values were checked, while unchanged (as lengths tensors above): the layers of a packed
# forward share one pair (transformers' flash-attention kwargs), so the check, a copy to the host and a sync, runs
# once per forward instead of twice per layer. [(weakref to the tensor, its _version, total rows, longest sequence)]
_cu_valid: list = []


def cu_seqlens_checked(cu: torch.Tensor, total: int, max_len: int) -> bool:
    """Whether ``cu`` was checked before (unchanged since) for ``total`` rows and a longest sequence <= ``max_len``
    (a packed call's direct route is taken only then: ``elsa_surgery.callcache.direct_varlen``)."""
    for ref, version, checked_total, longest in _cu_valid:
        if ref() is cu and version == cu._version and checked_total == total and longest <= max_len:
            return True
    return False


def varlen_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """``(cu_seqlens_q, cu_seqlens_k)`` of a packed call, checked (values too, unless checked before and unchanged)
    and as int32 on q's device."""
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0] (total_q)", "max_seqlen_q",
                           max_seqlen_q, q.device)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0] (total_k)", "max_seqlen_k",
                           max_seqlen_k, q.device)
    if cq.shape[0] != ck.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got {_shape(cq)} and {_shape(ck)}"
        )
    return cq, ck


def build_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False,
                         scale=None, dropout_p=0.0) -> VarlenProblem:
    dropout_p = check_dropout(dropout_p)
    check_qkv(q, k, v, layout="varlen")
    check_heads_and_dims(q, k, v, head_axis=1, seq_axis=0)
    cq, ck = varlen_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return VarlenProblem(
        q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k), scale=resolve_scale(scale, q.shape[-1]), is_causal=bool(is_causal),
        dropout_p=dropout_p,
    )
