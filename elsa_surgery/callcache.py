"""Validation and dispatch of a public call, memoised per signature (the eager host cost of small calls).

Before a kernel runs, an eager :func:`elsa_surgery.attention` call validates its arguments
(:func:`elsa_surgery.semantics.build_problem`) and picks its backend (:func:`elsa_surgery.dispatch.decide`):
13-17 µs of Python per call on an H100 host, about what a 197-token ViT attention kernel takes on the GPU.
Neither reads a tensor's values, only its signature: the type, shape, dtype and device of q, k, v and the mask,
the scalar arguments (``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``, ``windowed_mask``, ``backend``,
``precision``, ``return_lse``) and the environment variables the dispatch reads (``ELSA_BACKEND``,
``ELSA_FP32_PRECISION``, ``TRITON_INTERPRET``). :func:`prepare` keys on exactly those: the first call with a key
runs both and keeps the outcome; later calls with the key rebuild the problem around their own tensors (the same
views ``build_problem`` makes: 3-D inputs get their head axis, size-1 batch and head axes are broadcast, the
mask gets its canonical 4-D view) and reuse the decision, which is still announced (recorded and logged) on every
call. Under ``auto`` the first eager CUDA call of a signature may also race the kernels against PyTorch's SDPA
(:mod:`elsa_surgery.autoselect`); the memo keeps the winner. Unmasked signatures that differ only in their number of
keys share one race per quarter octave of it (:func:`key_band`): the decode steps of a growing KV cache race once
every few hundred or thousand steps, not at every step.

Direct routes: once a signature's call has run with the same inputs (the canonical problem holds the caller's own
q, k, v and mask: no 3-D or broadcast views, no rebuilt mask view; no dropout or query lengths), its entry also
keeps how to run it again without any of the above: for the kernels, the launch plan that ``kernels/replay.py``
recorded for it; for SDPA chosen by ``auto``, the plain SDPA call. A training call (autograd records it) has routes
of its own: SDPA's call as it is, or the kernels' plan replayed inside ``kernels.training.RoutedAttention``, the
autograd node the full path makes, with its backward's plan keys kept by the route (session 39, H200, bf16 Swin-T
window call with a gradient: its forward's host time 66-117 µs on the full path, 37-64 µs through the route, SDPA's
22-37 µs; ``benchmarks/lab/bwd_host.py``). A route is found by one flat key, built by :func:`direct`: the
signature together with what the plan's key adds (strides, 16-byte alignment, which inputs are one tensor, the
current device and stream capture), built in one pass over the tensors and looked up once, so that a call seen
before reads each property of its tensors once (session 30, CPU host, direct SDPA route: 8.9 µs of routing a call
before, the signature and the route's extras built and looked up apart; 7.9 µs after;
``benchmarks/lab/host_cost_cpu.py``). :func:`direct` runs a call through its route (the decision still announced),
the cheapest eager path there is; :func:`learn` makes routes after a call ran. A route is dropped with its plan
(``replay.clear``), when a knob the plan read changes, and with its entry.

Decode steps of a growing KV cache are each a new signature (one more key, new K/V strides). Where SDPA won their
band's race (:func:`key_band`), the band's later steps run plain SDPA through the family's route; where the kernels
run them (the race won, or ``backend="elsa"``), through the kernels' family route: the first step's launch plan made
to run the step's own number of keys by ``kernels.launch.KeysFamily``, which declines (the full path then runs) where
the planner or Triton would treat the step otherwise (session 58, H200, 1 x 28:4 x 128 from 4,096 keys, 2 layers a
step: 72 µs of host time a call against 421 µs planned anew and 54 µs for a repeated call;
``benchmarks/lab/decode_growing.py``).

Calls with ``q_lengths`` / ``kv_lengths`` tensors are memoised on the lengths' shape, dtype and device too; their
values are checked on every call (``semantics.canonical_lengths``; a check is skipped for lengths checked before and
unchanged, or made by an adapter that trusts them). Calls with ``kv_lengths`` alone have direct routes, taken while
their lengths need no check (session 36: BERT-base with padding, host-bound, paid ~45 µs a layer for the full path).

Packed calls (:func:`elsa_surgery.attention_varlen`) are memoised the same way (:func:`prepare_varlen`), their
cu_seqlens' geometry in the key; their values are checked on every call, once per tensor while it is unchanged
(``semantics.varlen_cu_seqlens``). Packed calls without autograd or dropout on the kernels have direct routes too
(:func:`direct_varlen`, :func:`learn_varlen`): the launch plan replayed, taken only while both cu_seqlens are known
valid for the call (checked before and unchanged, int32 on q's device): H100 host, session 41, 30-50 µs a packed
call against 73-98 µs with the memo alone (``benchmarks/lab/varlen_host.py``).

Not memoised, so validated in full on every call: calls that raise (errors are never kept), lengths given as lists,
a tensor ``scale``, arguments of other types than plain tensors, bools, numbers and strings (tensor subclasses, NumPy
scalars), and calls traced by ``torch.compile``. A traced call is validated and decided once per trace, outside
dynamo's symbolic execution, by :func:`traced` (the end of this file).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from . import autoselect, dispatch, sdpa
from .kernels import internals, knobs, replay
from .semantics import (AttentionProblem, VarlenProblem, broadcast_batch_and_heads, build_problem,
                        build_varlen_problem, canonical_dense_lengths, canonical_mask, cu_seqlens_checked,
                        lengths_checked, varlen_cu_seqlens)

MAX_ENTRIES = 1024  # signatures kept (the oldest dropped first)

# ELSA_LAUNCH_PLANS: whether the kernels' launch plans (and so direct routes) are used
_ENV_NAMES = (dispatch.ENV_BACKEND, dispatch.ENV_PRECISION, "TRITON_INTERPRET", knobs.LAUNCH_PLANS)
# the raw values, from the environment's store (CPython's encoded one where checked: kernels/internals.py); the knobs'
# values are validated by the dispatch (kernels/knobs.py)
_RAW = internals.ENVIRON
_E0, _E1, _E2, _E3 = (internals.ENCODE(n) for n in _ENV_NAMES)

_entries: dict = {}
# a route's key (direct) -> (entry, the entry's routes dict it was made in, route): every live direct route
_routes: dict = {}
MAX_ROUTES = 4 * MAX_ENTRIES
STATS = {"hits": 0, "misses": 0, "bypassed": 0}
DIRECT = {"runs": 0, "routes": 0}  # calls run through a direct route (counted among the hits too), routes made

_PLAIN = frozenset((bool, int, float, str, type(None)))

# the current CUDA device and whether its stream is capturing, for a route's key: the C functions behind
# torch.cuda.current_device() and torch.cuda.is_current_stream_capturing() where this PyTorch has them (a CUDA tensor
# in hand: CUDA is initialised, the public function's lazy init has nothing to do), else those public functions
_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_cuda_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def clear() -> None:
    autoselect.SETTLED.clear()  # (eager verdicts, kept for torch.compile's trace of the same calls)
    _entries.clear()
    _varlen_entries.clear()
    _varlen_routes.clear()
    _routes.clear()
    _families.clear()
    _family_routes.clear()
    _kernel_routes.clear()


# auto's race verdicts shared by signatures that differ only in their number of keys (key_band): family ->
# (decision, the number of keys it was raced at). Each decode step of a growing KV cache is a new signature: without
# this, every step of a generation whose lengths were not seen before raced (H100, session 35: LLaMA-13B-shaped
# decode, one race per step, ~3 rounds of ~2 ms a side, against a step of ~3 ms).
_families: dict = {}
BANDS_PER_OCTAVE = 4
# SDPA's direct route shared by a family's calls (the decode steps of a growing cache, each a new signature, which
# would each take the full path once: ~45 µs of host time per layer and step): family route key (_family_key) ->
# (family, its raced decision, the decision to announce, enable_gqa, scale); valid while _families holds that race
_family_routes: dict = {}


# The kernels' launch plan shared by a family's calls (the same decode steps, when the kernels run them: each step
# would be planned and recorded again, 421 µs of host time against 43 µs replayed; H200, session 58,
# benchmarks/lab/decode_growing.py): family route key (_family_key, with K's and V's 16-byte alignment) ->
# _KernelFamily. Valid while its race holds (auto) or, with no race, while the entry it was made from lives; and while
# the plan is (its replay generation and environment).
_kernel_routes: dict = {}
KERNEL_FAMILY = {"runs": 0, "made": 0}  # calls run through a kernel family's route, such routes made


class _KernelFamily:
    __slots__ = ("entry", "routes", "fam", "raced", "shown", "family", "generation")

    def __init__(self, entry, fam, raced, shown, family):
        self.entry, self.routes, self.fam, self.raced, self.shown, self.family = (entry, entry.routes, fam, raced,
                                                                                  shown, family)
        self.generation = replay.GENERATION[0]

    def run(self, q, k, v, return_lse):
        """The call's result through the family's plan, or None (the full path)."""
        if self.raced is not None:
            if _families.get(self.fam, (None,))[0] is not self.raced:
                return None
        elif self.entry.routes is not self.routes:  # the entry it was made from was dropped
            return None
        family = self.family
        if replay.GENERATION[0] != self.generation or not family.plan.env_unchanged():
            return None
        plan = family.plan_for(k, v)
        if plan is None:
            return None
        STATS["hits"] += 1
        DIRECT["runs"] += 1
        KERNEL_FAMILY["runs"] += 1
        dispatch.announce_eager(self.shown)
        out, lse, _ = plan.replay({"q": q, "k": k, "v": v, "kv_lengths": None, "mask": None})
        return (out, lse) if return_lse else out


def key_band(n: int) -> Tuple[int, int]:
    """The band ``(lo, hi]`` of key counts whose calls share one race: a quarter of the octave ``(2^e, 2^(e+1)]``
    that holds ``n`` (``(4096, 5120]`` for 4,097 keys), each count alone up to 8."""
    if n <= 8:
        return n - 1, n
    e = (n - 1).bit_length() - 1
    w = (1 << e) // BANDS_PER_OCTAVE
    lo = (1 << e) + (n - 1 - (1 << e)) // w * w
    return lo, lo + w


def _family(key: tuple) -> tuple:
    """The race family of memo key ``key``: the key with k's and v's number of keys (their second-to-last size)
    replaced by its :func:`key_band`. (Masked calls are not raced: ``autoselect.sdpa_reason``.)"""
    ks, vs = key[3], key[6]
    band = key_band(ks[-2])
    return key[:3] + ((*ks[:-2], band, ks[-1]),) + key[4:6] + ((*vs[:-2], band, vs[-1]),) + key[7:]


def _family_key(rkey: tuple, k, v) -> tuple:
    """A route key (:func:`direct`) with k's and v's number of keys replaced by its :func:`key_band`, and their strides
    and alignment left out (SDPA's route reads neither): the key of an SDPA route shared by a race family."""
    band = key_band(k.shape[-2])
    return (rkey[:5], k.shape[:-2], band, k.shape[-1], rkey[7], rkey[8], v.shape[:-2], v.shape[-1], rkey[12],
            rkey[13], rkey[15:])


def _tensor_sig(t):
    if type(t) is not torch.Tensor or t.is_nested:  # noqa: E721 - subclasses, nested and non-tensors: full path
        return None
    return t.shape, t.dtype, t.device


class _Entry:
    """What a signature's first call decided (and, once learnt, the direct routes of its calls)."""
    __slots__ = ("squeeze", "scale", "causal", "dropout", "decision", "routes", "mask_shape")

    def __init__(self, p: AttentionProblem, d: dispatch.Decision, direct_ok: bool):
        self.squeeze, self.scale, self.causal, self.dropout, self.decision = (p.squeeze_head, p.scale, p.is_causal,
                                                                              p.dropout_p, d)
        # a route's key (direct) -> route; None: calls of the signature never have one (or the entry was dropped)
        self.routes = {} if direct_ok else None
        self.mask_shape = None if p.mask is None else tuple(p.mask.shape)  # a 4-D mask's canonical (expanded) view


def signature(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
              q_lengths, kv_lengths, windowed_mask) -> Optional[tuple]:
    """The memo's key of an eager call, or None for a call validated in full every time (traced by
    torch.compile, or with arguments the key cannot hold: module docstring). Lengths tensors add their shape, dtype
    and device; their values are checked on every call (``semantics.canonical_lengths``, which skips lengths it
    checked before while unchanged)."""
    if torch.compiler.is_compiling():
        return None
    key = _key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
               windowed_mask)
    if key is None or (q_lengths is None and kv_lengths is None):
        return key
    lq, lk = _lengths_sig(q_lengths), _lengths_sig(kv_lengths)
    if lq is False or lk is False:
        return None
    return key + (lq, lk)  # never a route's signature (signature_of): calls with lengths have no route


def _lengths_sig(t):
    """What the memo's key holds of a lengths argument: None, ``(shape, dtype, device)`` of a plain tensor, or False
    for anything else (a list, a subclass: validated in full)."""
    if t is None:
        return None
    if type(t) is not torch.Tensor or t.is_nested:  # noqa: E721
        return False
    return t.shape, t.dtype, t.device


def _key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
         windowed_mask) -> Optional[tuple]:
    """The signature :func:`prepare` memoises on, or None for a call it validates in full."""
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T or q.is_nested or k.is_nested or v.is_nested:
        return None  # subclasses, nested and non-tensors: the full path
    sm = None
    if attn_mask is not None:
        sm = _tensor_sig(attn_mask)
        if sm is None:
            return None
    scalars = (dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse, windowed_mask)
    types = tuple(map(type, scalars))  # in the key too: True and 1 hash alike but are not the same argument
    if not _PLAIN.issuperset(types):
        return None
    # whether autograd records the call: training calls are their own entry (raced forward + backward), and never
    # have direct routes
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (attn_mask is not None and attn_mask.requires_grad))
    return (q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device, sm, scalars, types,
            _RAW.get(_E0), _RAW.get(_E1), _RAW.get(_E2), _RAW.get(_E3), grad)


def prepare(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            backend="auto", precision=None, return_lse=False, q_lengths=None, kv_lengths=None,
            windowed_mask=False, key=False, call=None) -> Tuple[AttentionProblem, dispatch.Decision]:
    """``(build_problem(...), dispatch.decide(...))`` of an :func:`elsa_surgery.attention` call, the decision
    announced; memoised per signature (module docstring). ``key``: the call's :func:`signature` when the caller
    has it; ``call``: the public call itself (auto's race makes it under each decision)."""
    if torch.compiler.is_compiling():
        # traced once per graph: nothing here is read or written (dynamo would guard on the memo and on STATS)
        p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                    precision, return_lse, q_lengths, kv_lengths, windowed_mask)
        if autoselect.sdpa_reason(p, d, backend=backend, precision=precision, return_lse=return_lse) is None:
            d = autoselect.choose_compiled(p, d)  # raced once when traced, outside the graph
        dispatch.announce(d)
        return p, d
    if key is False:
        key = signature(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
                        q_lengths, kv_lengths, windowed_mask)
    if key is None:
        STATS["bypassed"] += 1
        p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                    precision, return_lse, q_lengths, kv_lengths, windowed_mask)
    else:
        hit = _entries.get(key)
        if hit is None:
            STATS["misses"] += 1
            p, d = _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                        precision, return_lse, q_lengths, kv_lengths, windowed_mask)
            entry = _Entry(p, d, _direct_ok(p, d, q, k, v, attn_mask, kv_lengths))
            if len(_entries) >= MAX_ENTRIES:
                _entries.pop(next(iter(_entries))).routes = None  # its direct routes go with it
            _entries[key] = entry
            if call is not None and autoselect.sdpa_reason(p, d, backend=backend, precision=precision,
                                                           return_lse=return_lse) is None:
                fam = _family(key)
                shared = _families.get(fam)
                if shared is not None:
                    d = _share(entry, *shared, k.shape[-2])
                else:
                    settled_key = (autoselect.traced_signature(p.q, p.k, p.v, p.is_causal, p.scale, d.precision)
                                   if p.mask is None and p.kv_lengths is None else None)
                    kept = entry.decision
                    d, times = _race(entry, call, (q, k, v), settled_key)
                    if len(_families) >= MAX_ENTRIES:
                        _families.pop(next(iter(_families)))
                    # (unmasked, no lengths: the band's later calls would be plain SDPA calls, probed first)
                    d_band = d if settled_key is None else _band_probe(entry, d, kept, times, q, k, v)
                    _families[fam] = (d_band, k.shape[-2])
        else:
            STATS["hits"] += 1
            squeeze, scale_, causal, dropout, d = hit.squeeze, hit.scale, hit.causal, hit.dropout, hit.decision
            if squeeze:
                q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            q, k, v = broadcast_batch_and_heads(q, k, v, enable_gqa)
            mask = None
            if attn_mask is not None:
                mask = canonical_mask(attn_mask, batch=q.shape[0], heads_q=q.shape[1], n_q=q.shape[2],
                                      n_k=k.shape[2], windowed=windowed_mask, device=q.device)
            ql = kl = None
            if q_lengths is not None or kv_lengths is not None:
                ql, kl = canonical_dense_lengths(q_lengths, kv_lengths, q.shape[0], q.shape[2], k.shape[2], q.device)
            p = AttentionProblem(q, k, v, scale_, mask, causal, ql, kl, squeeze, dropout)
    dispatch.announce(d)
    return p, d


# packed calls (attention_varlen): signature (_varlen_key) -> (scale, is_causal, dropout_p, decision)
_varlen_entries: dict = {}


def _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, backend, precision, return_lse,
                dropout_p) -> Optional[tuple]:
    """The memo key of a packed call, or None for one validated in full (as :func:`_key`; the cu_seqlens add their
    shape, dtype and device, the maxima nothing: they are checked with the cu_seqlens' values on every call)."""
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T or q.is_nested or k.is_nested or v.is_nested:
        return None
    cq, ck = _lengths_sig(cu_seqlens_q), _lengths_sig(cu_seqlens_k)
    if not cq or not ck:
        return None
    scalars = (is_causal, scale, backend, precision, return_lse, dropout_p)
    types = tuple(map(type, scalars))
    if not _PLAIN.issuperset(types):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device, cq, ck, scalars,
            types, _RAW.get(_E0), _RAW.get(_E1), _RAW.get(_E2), _RAW.get(_E3), grad)


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False, scale=None,
                   backend="auto", precision=None, return_lse=False,
                   dropout_p=0.0) -> Tuple[VarlenProblem, dispatch.Decision]:
    """``(build_varlen_problem(...), dispatch.decide(...))`` of an :func:`elsa_surgery.attention_varlen` call, the
    decision announced; memoised per signature as :func:`prepare`'s calls are. The cu_seqlens' values are checked on
    every call (``semantics.varlen_cu_seqlens``: a pair checked before and unchanged is not copied to the host
    again). Before (session 40, CPU host, the kernel stubbed): 155-186 µs of validation and dispatch a call, and two
    host syncs on a GPU."""
    compiling = torch.compiler.is_compiling()  # traced: nothing here is read or written (as prepare)
    key = None if compiling else _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, backend,
                                             precision, return_lse, dropout_p)
    hit = None if key is None else _varlen_entries.get(key)
    if hit is None:
        if not compiling:
            STATS["bypassed" if key is None else "misses"] += 1
        vp = build_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  is_causal=is_causal, scale=scale, dropout_p=dropout_p)
        d = dispatch.decide(vp.q, vp.k, vp.v, None, backend=backend, precision=precision, varlen=True,
                            need_lse=return_lse)
        if key is not None:
            if len(_varlen_entries) >= MAX_ENTRIES:
                _varlen_entries.pop(next(iter(_varlen_entries)))
                _varlen_routes.clear()  # (routes hold their entry's decision: decided afresh)
            _varlen_entries[key] = (vp.scale, vp.is_causal, vp.dropout_p, d)
    else:
        STATS["hits"] += 1
        scale_, causal, dropout, d = hit
        cq, ck = varlen_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        vp = VarlenProblem(q, k, v, cq, ck, int(max_seqlen_q), int(max_seqlen_k), scale_, causal, dropout)
    dispatch.announce(d)
    return vp, d


# packed calls' direct routes: route key (direct_varlen) -> (decision, launch plan, replay.GENERATION when recorded)
_varlen_routes: dict = {}
_VARLEN_TYPES = slice(37, 43)  # the scalars' types in a packed call's route key (pinned by tests/test_callcache.py)


def direct_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, backend,
                  precision, return_lse, dropout_p):
    """A packed call's result (as :func:`elsa_surgery.attention_varlen` returns it) through its direct route, the
    decision announced; a :class:`Miss` when it has none (as :func:`direct`).

    The route key holds the tensors' geometry (shape, strides, dtype, device, 16-byte alignment) and which are one
    tensor, the two maxima, the scalars with their types, the dispatch environment, the current CUDA device and
    stream capture. No route (and no key): calls traced by torch.compile, calls autograd records, maxima that are not
    plain ints, arguments other than plain tensors. The route runs only while both cu_seqlens are known valid for
    this call (``semantics.cu_seqlens_checked``: checked before for these totals and a longest sequence within the
    maxima, unchanged since); otherwise the full path checks them."""
    T = torch.Tensor
    cq, ck = cu_seqlens_q, cu_seqlens_k
    if (type(q) is not T or type(k) is not T or type(v) is not T or type(cq) is not T or type(ck) is not T
            or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int or torch.compiler.is_compiling()
            or q.is_nested or k.is_nested or v.is_nested):
        return _NO_ROUTE
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _NO_ROUTE  # a training call: the full path's autograd node
    cuda = q.is_cuda
    rkey = (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
            k.shape, k.stride(), k.dtype, k.device, k.data_ptr() % 16 == 0,
            v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0,
            cq.shape, cq.stride(), cq.dtype, cq.device, cq.data_ptr() % 16 == 0,
            ck.shape, ck.stride(), ck.dtype, ck.device, ck.data_ptr() % 16 == 0,
            q is k, k is v, q is v, cq is ck, max_seqlen_q, max_seqlen_k,
            is_causal, scale, backend, precision, return_lse, dropout_p,
            type(is_causal), type(scale), type(backend), type(precision), type(return_lse), type(dropout_p),
            _RAW.get(_E0), _RAW.get(_E1), _RAW.get(_E2), _RAW.get(_E3),
            _cuda_device() if cuda else None, cuda and _cuda_capturing())
    try:
        got = _varlen_routes.get(rkey)
    except TypeError:  # an unhashable scalar: no route (the full path validates it)
        return _NO_ROUTE
    if got is None:
        return Miss(rkey)
    d, plan, generation = got
    if replay.GENERATION[0] != generation or not plan.env_unchanged():
        del _varlen_routes[rkey]
        return Miss(rkey)
    if not (cu_seqlens_checked(cq, q.shape[0], max_seqlen_q) and cu_seqlens_checked(ck, k.shape[0], max_seqlen_k)):
        return Miss(rkey)  # the full path checks the values (and records them)
    STATS["hits"] += 1
    DIRECT["runs"] += 1
    dispatch.announce_eager(d)
    out, lse, _ = plan.replay({"q": q, "k": k, "v": v, "cu_q": cq, "cu_k": ck})
    return (out, lse) if return_lse else out


def learn_varlen(rkey: Optional[tuple], vp: VarlenProblem, d: dispatch.Decision, q, k, v, cu_seqlens_q,
                 cu_seqlens_k, return_lse: bool) -> None:
    """After a packed call (route key ``rkey`` from :func:`direct_varlen`'s :class:`Miss`) ran on the full path: keep
    its direct route if it can have one: on the kernels, no dropout, the caller's cu_seqlens as they are (int32 on
    q's device), its launch plan replayable."""
    if (rkey is None or d.backend != "elsa" or vp.dropout_p or vp.cu_seqlens_q is not cu_seqlens_q
            or vp.cu_seqlens_k is not cu_seqlens_k or rkey in _varlen_routes
            or not _PLAIN.issuperset(rkey[_VARLEN_TYPES])):  # (NumPy scalars: validated in full on every call)
        return
    from .kernels import launch  # the kernels ran: imported

    plan = launch.varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, vp.max_seqlen_q, vp.max_seqlen_k,
                              scale=float(vp.scale), is_causal=bool(vp.is_causal), precision=d.precision or None,
                              return_lse=return_lse)
    if plan is None:
        return
    if len(_varlen_routes) >= MAX_ROUTES:
        del _varlen_routes[next(iter(_varlen_routes))]
    _varlen_routes[rkey] = (d, plan, replay.GENERATION[0])
    DIRECT["routes"] += 1


def _direct_ok(p: AttentionProblem, d: dispatch.Decision, q, k, v, attn_mask, kv_lengths) -> bool:
    """Whether calls of this signature can have direct routes: the problem is the caller's tensors as they are."""
    return (d.backend in ("elsa", "sdpa") and p.q is q and p.k is k and p.v is v
            and (attn_mask is None or attn_mask.dim() == 4)  # the canonical view: attn_mask.expand(mask_shape)
            and p.causal_rows is None and p.dropout_p == 0 and p.q_lengths is None
            and (p.kv_lengths is None or p.kv_lengths is kv_lengths)  # the caller's lengths as they are
            and (d.backend == "elsa" or (attn_mask is None and (not p.is_causal or p.n_q == p.n_k)
                                         and (p.kv_lengths is None or not p.is_causal))))


class Miss:
    """What :func:`direct` returns for a call without a direct route: its route key (None: it cannot have one),
    for :func:`learn` after the full path ran."""
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


_NO_ROUTE = Miss(None)


def direct(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
           windowed_mask, kv_lengths=None):
    """The call's result (as :func:`elsa_surgery.attention` returns it) through its direct route, the decision
    announced; a :class:`Miss` when it has none (the caller takes the full path).

    The route is found by one flat key, built here in one pass over the tensors: all the signature holds
    (:func:`_key`), and the strides and 16-byte alignment the route's launch plan was specialised for, which inputs
    are one tensor, the current CUDA device and stream capture (the rest of the plan's key, kernels/launch.py), and
    whether autograd records the call (a training call: its own memo entry, raced forward + backward, and its own
    routes; a mask that requires grad says so in its part of the key). A call traced by torch.compile or with
    arguments other than plain tensors has no route and no key. A route is ``enable_gqa`` for SDPA,
    ``(launch plan, replay.GENERATION when it was recorded, the mask's canonical shape when the caller's mask must be
    expanded to it, else None, None or for a training call (training.RoutedAttention.apply, its training.Route))``
    for the kernels.

    ``kv_lengths`` (a call without ``q_lengths``): its geometry joins the key, and the route is taken only while the
    values are known to be valid for the call (``semantics.lengths_checked``: checked before and unchanged, or made
    by an adapter that trusts them); SDPA's route takes the key-padding mask ``sdpa.key_padded`` builds (once for
    trusted lengths)."""
    T = torch.Tensor
    if (type(q) is not T or type(k) is not T or type(v) is not T or torch.compiler.is_compiling() or q.is_nested
            or k.is_nested or v.is_nested):
        return _NO_ROUTE
    grad = torch.is_grad_enabled()
    if attn_mask is None:
        m = None
    elif type(attn_mask) is T and not attn_mask.is_nested:
        m = (attn_mask.shape, attn_mask.stride(), attn_mask.dtype, attn_mask.device, attn_mask.data_ptr() % 16 == 0,
             grad and attn_mask.requires_grad)
    else:
        return _NO_ROUTE
    # whether autograd records the call (as _key's flag): a training call's route is its own
    train = grad and (q.requires_grad or k.requires_grad or v.requires_grad or (m is not None and m[5]))
    cuda = q.is_cuda
    rkey = (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
            k.shape, k.stride(), k.dtype, k.device, k.data_ptr() % 16 == 0,
            v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0, m, q is k, k is v, q is v,
            # the scalars with their types: True and 1 hash alike but are not the same argument
            dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse, windowed_mask,
            type(dropout_p), type(is_causal), type(scale), type(enable_gqa), type(backend), type(precision),
            type(return_lse), type(windowed_mask),
            _RAW.get(_E0), _RAW.get(_E1), _RAW.get(_E2), _RAW.get(_E3),
            _cuda_device() if cuda else None, cuda and _cuda_capturing(), train)
    if kv_lengths is not None:
        if type(kv_lengths) is not T or kv_lengths.is_nested:
            return _NO_ROUTE
        rkey += ((kv_lengths.shape, kv_lengths.stride(), kv_lengths.dtype, kv_lengths.device,
                  kv_lengths.data_ptr() % 16 == 0),)
    try:
        got = _routes.get(rkey)
    except TypeError:  # an unhashable scalar: no route (the full path validates it)
        return _NO_ROUTE
    if got is None:
        fkey = None
        if _family_routes and m is None and kv_lengths is None:
            fkey = _family_key(rkey, k, v)
            shared = _family_routes.get(fkey)
            if shared is not None:
                fam, raced, d, gqa, scale_ = shared
                if _families.get(fam, (None,))[0] is raced:
                    STATS["hits"] += 1
                    DIRECT["runs"] += 1
                    dispatch.announce_eager(d)
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=scale_,
                                                                            enable_gqa=gqa)
        if _kernel_routes and m is None and kv_lengths is None:
            shared = _kernel_routes.get((fkey or _family_key(rkey, k, v), rkey[9], rkey[14]))
            if shared is not None:
                res = shared.run(q, k, v, return_lse)
                if res is not None:
                    return res
        return Miss(rkey)
    entry, routes, route = got
    if entry.routes is not routes:  # the entry was dropped, or the route was made on the losing side of a race
        del _routes[rkey]
        return Miss(rkey)
    d = entry.decision
    if d.backend == "elsa":
        plan, generation, expand, trains = route
        if replay.GENERATION[0] != generation or not plan.env_unchanged():
            del routes[rkey], _routes[rkey]
            return Miss(rkey)
    if kv_lengths is not None and not lengths_checked(kv_lengths, k.shape[-2]):
        return Miss(rkey)  # the full path checks the values (and records them)
    STATS["hits"] += 1
    DIRECT["runs"] += 1
    dispatch.announce_eager(d)
    if d.backend == "sdpa":
        if kv_lengths is not None:
            return sdpa.key_padded(q, k, v, kv_lengths, entry.scale, route)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, entry.causal, scale=entry.scale,
                                                                enable_gqa=route)
    mask = attn_mask if expand is None else attn_mask.expand(expand)
    if trains is not None:  # a training call: the forward replayed inside its autograd node
        out, lse = trains[0](q, k, v, mask, kv_lengths, trains[1])
    else:
        out, lse, _ = plan.replay({"q": q, "k": k, "v": v, "kv_lengths": kv_lengths, "mask": mask})
    return (out, lse) if return_lse else out


def signature_of(rkey: tuple) -> Optional[tuple]:
    """:func:`signature` of the call whose route key (:func:`direct`) is ``rkey``, taken from the key instead of read
    again from the tensors: a call without a route pays for one pass over them, not two. (The two layouts are
    pinned together by ``tests/test_callcache.py``.)"""
    types = rkey[27:35]
    if not _PLAIN.issuperset(types):
        return None
    m = rkey[15]
    key = (rkey[0], rkey[2], rkey[3], rkey[5], rkey[7], rkey[8], rkey[10], rkey[12], rkey[13],
           None if m is None else (m[0], m[2], m[3]), rkey[19:27], types, rkey[35], rkey[36], rkey[37], rkey[38],
           rkey[41])
    if len(rkey) > _ROUTE_KEY_LEN:  # kv_lengths (direct): signature's (q_lengths, kv_lengths) parts
        lk = rkey[_ROUTE_KEY_LEN]
        key += (None, (lk[0], lk[2], lk[3]))
    return key


_ROUTE_KEY_LEN = 42  # a route key's items without kv_lengths (direct)
_GRAD = 16  # the index of _key's flag "autograd records the call" (lengths calls' signatures have items after it)


def learn(key: tuple, rkey: tuple, p: AttentionProblem, d: dispatch.Decision, q, k, v, attn_mask,
          return_lse: bool) -> None:
    """After a memoised call (signature ``key``, route key ``rkey`` from :func:`direct`'s :class:`Miss`) ran on the
    full path: keep its direct route if it can have one (module docstring)."""
    entry = _entries.get(key)
    if entry is None or entry.routes is None or entry.decision is not d:
        return
    train = key[_GRAD]  # autograd records the call (_key)
    route = entry.routes.get(rkey)
    if route is None:
        if d.backend == "sdpa":
            route = p.heads_q != p.heads_kv
        else:
            from .kernels import launch, ops, training  # the kernels ran: imported

            if train and (p.empty or not ops.STRIDED_OUTPUT):
                return  # (the full path's forward then hands the launcher an output: another plan)
            plan = launch.attention_plan(q, k, v, scale=float(p.scale), mask=p.mask, is_causal=bool(p.is_causal),
                                         precision=d.precision or None, return_lse=return_lse or train,
                                         kv_lengths=p.kv_lengths)
            if plan is None:
                return
            expand = None if attn_mask is None or tuple(attn_mask.shape) == entry.mask_shape else entry.mask_shape
            trains = None
            if train:  # the forward the full path runs inside training.EagerAttention, in an autograd node
                trains = (training.RoutedAttention.apply, training.Route(
                    plan, p.scale, p.is_causal, d.precision, attn_mask is not None and attn_mask.requires_grad))
            route = (plan, replay.GENERATION[0], expand, trains)
        entry.routes[rkey] = route
        DIRECT["routes"] += 1
    if len(_routes) >= MAX_ROUTES and rkey not in _routes:
        del _routes[next(iter(_routes))]
    _routes[rkey] = (entry, entry.routes, route)
    if d.backend == "elsa" and attn_mask is None and p.kv_lengths is None and not train:
        _learn_kernel_family(key, rkey, entry, d, route[0], k, v)
    if d.backend == "sdpa" and attn_mask is None and p.kv_lengths is None and not entry.causal:
        fam = _family(key)
        raced = _families.get(fam)
        if raced is not None and raced[0].backend == "sdpa":
            shown = d if d is not raced[0] else _band_decision(raced[0], raced[1], k.shape[-2])
            if len(_family_routes) >= MAX_ROUTES:
                del _family_routes[next(iter(_family_routes))]
            _family_routes[_family_key(rkey, k, v)] = (fam, raced[0], shown, route, entry.scale)


def _learn_kernel_family(key: tuple, rkey: tuple, entry: _Entry, d: dispatch.Decision, plan, k, v) -> None:
    """Shares the route of an unmasked call on the kernels with its family (the calls that differ from it only in
    their number of keys, within its band, and in K's and V's strides) when its plan can run them
    (``launch.KeysFamily``: a packed short-query launch)."""
    from .kernels import launch

    family = launch.keys_family(plan)  # (None for any plan but a packed decode launch's: checked first)
    if family is None:
        return
    fam = _family(key)
    raced = _families.get(fam)
    if raced is not None and raced[0].backend != "elsa":
        return
    shown = d if raced is None or d is not raced[0] else _band_decision(raced[0], raced[1], k.shape[-2])
    fkey = (_family_key(rkey, k, v), rkey[9], rkey[14])
    if len(_kernel_routes) >= MAX_ROUTES and fkey not in _kernel_routes:
        del _kernel_routes[next(iter(_kernel_routes))]
    _kernel_routes[fkey] = _KernelFamily(entry, fam, None if raced is None else raced[0], shown, family)
    KERNEL_FAMILY["made"] += 1


def _band_probe(entry: _Entry, d: dispatch.Decision, kept: dispatch.Decision, times, q, k, v) -> dispatch.Decision:
    """The verdict the race's band shares (``autoselect.band_verdict``): where SDPA won the race of an unmasked
    non-causal inference call without lengths (the caller's test) of more than 8 keys, SDPA is timed at one key
    fewer (views of k and v, as the call's SDPA route would run them) before the band shares its verdict."""
    n = k.shape[-2]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if d.backend != "sdpa" or not times or times[0].rounds == 0 or entry.causal or n <= 8 or training:
        return d
    k1, v1 = k.narrow(-2, 0, n - 1), v.narrow(-2, 0, n - 1)
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    try:
        with dispatch.unrecorded():
            probe = autoselect.probe_new_count(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k1, v1, None, 0.0, False, scale=entry.scale, enable_gqa=gqa))
    except Exception as e:  # a measurement: it must never fail the call (SDPA ran this call at n keys)
        autoselect.logger.info("elsa auto: SDPA's probe at %d keys failed (%s: %s); the band shares the race's "
                               "verdict", n - 1, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
        return d
    return autoselect.band_verdict(d, kept, times[0], probe, n - 1)


def _race(entry: _Entry, call, qkv, settled_key=None) -> Tuple[dispatch.Decision, list]:
    """auto's race (elsa_surgery/autoselect.py) for a new entry: ``call``, the public call, made with the entry set
    to the ELSA decision and to SDPA's in turn, unrecorded and uncounted; the entry keeps the winner. A training
    call (autograd records it: q, k or v requires grad) is raced as the call and its backward, on detached twins of
    the inputs (``call(*twins)``: the caller's graph and tensor hooks are not touched, no ``.grad`` is written).
    Tensors the race saves for backward skip any saved-tensor hooks in force (activation checkpointing's: a race
    inside a checkpointed forward would change the number of tensors saved there, which the recomputation, finding
    the signature decided, does not repeat: torch.utils.checkpoint's CheckpointError). ``settled_key``: an unmasked
    call's key for torch.compile's race (``autoselect.choose``). Returns the verdict and ``[autoselect.Times]`` (empty
    where SDPA ran out of memory)."""
    d = entry.decision
    sides = {"elsa": (d, entry.routes), "sdpa": (autoselect.SDPA_SIDE, None if entry.routes is None else {})}
    twins, grads, times = (), [], []
    if torch.is_grad_enabled() and any(t.requires_grad for t in qkv):
        made = {}  # one twin per distinct tensor (q is k stays so: the signature's identity flags)
        for t in qkv:
            if id(t) not in made:
                made[id(t)] = t.detach().requires_grad_(t.requires_grad)
        twins = tuple(made[id(t)] for t in qkv)
        grads = [t for t in made.values() if t.requires_grad]

    def side(backend):
        def run():
            entry.decision, entry.routes = sides[backend]
            out = call(*twins)
            if grads:
                torch.autograd.grad(out, grads, torch.ones_like(out))
            return out
        return run

    counts = dict(STATS), dict(DIRECT), dict(KERNEL_FAMILY)
    try:
        with dispatch.unrecorded():
            with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                final = autoselect.choose(d, side("elsa"), side("sdpa"), training=bool(grads),
                                          settled_key=settled_key, times=times)
    finally:
        STATS.update(counts[0])
        DIRECT.update(counts[1])
        KERNEL_FAMILY.update(counts[2])
    entry.decision, entry.routes = final, sides[final.backend][1]
    # both sides made a route under the call's route key, the later side's left in _routes: direct() drops it unless
    # it is the winner's, and the call itself, run next on the full path, points the key at the winner's (learn)
    return final, times


def _share(entry: _Entry, raced: dispatch.Decision, raced_keys: int, keys: int) -> dispatch.Decision:
    """A new entry takes the verdict its family's race gave (:data:`_families`), saying so in its reason; its routes
    as :func:`_race` leaves a winner's."""
    d = _band_decision(raced, raced_keys, keys)
    if d.backend != "elsa":
        entry.routes = None if entry.routes is None else {}
    entry.decision = d
    return d


def _band_decision(raced: dispatch.Decision, raced_keys: int, keys: int) -> dispatch.Decision:
    """The family's verdict as a call of ``keys`` keys announces it: where it was raced, which calls share it."""
    lo, hi = key_band(keys)
    return dataclasses.replace(raced, reason=f"{raced.reason}; raced at {raced_keys} keys, shared by the calls of "
                                             f"{lo + 1}-{hi} keys (callcache.key_band)")


def _as_is(t):
    return t


def _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                         return_lse, q_lengths, kv_lengths, windowed_mask):
    p = build_problem(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      q_lengths=q_lengths, kv_lengths=kv_lengths, windowed_mask=windowed_mask)
    d = dispatch.decide(p.q, p.k, p.v, p.mask, backend=backend, precision=precision, need_lse=return_lse,
                        dropout_p=p.dropout_p)
    return p, d


# ---------------------------------------------------------------------------------------------------------------------
# calls traced by torch.compile: the traced route
# ---------------------------------------------------------------------------------------------------------------------
# While torch.compile traces a model, dynamo executes every line of Python on the call's path symbolically (each
# bytecode instruction tens of microseconds). The full path (build_problem, dispatch.decide, the kernels' interface,
# knobs) is ~2,000 instructions a call: session 37's H200 profile of a warm Swin-T fp32 compile spent 3.2 s of its
# 10.4 s tracing the 12 converted attention forwards. The traced route reads the call's signature (constants under
# static shapes) and hands it to _traced_plan, which dynamo runs as plain Python (assume_constant_result): it validates
# and decides on fake tensors of that signature, and returns what to put in the graph as constants. The traced code
# then only applies the canonical views and calls one op.

_SCALAR_TYPES = tuple(_PLAIN)  # (a tuple: what the traced test `type(x) not in` reads as constants)
(_INLINE, _OPAQUE, _GRAD_OP, _DROPOUT, _SDPA) = range(5)
TRACED = {"plans": 0, "full": 0}  # traced calls given a plan; traced calls left to the full path (_traced_plan)


def traced(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
           windowed_mask):
    """The result of an :func:`elsa_surgery.attention` call (without lengths) that torch.compile is tracing, through
    the traced route; None for a call the route does not take (the caller takes the full path): tensor subclasses,
    arguments of other types than bools, numbers, strings and None, every call of a graph with symbolic sizes
    (``autoselect.symbolic_sizes``), and whatever :func:`_traced_plan` returns None for. This function is what dynamo
    traces: keep it short."""
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T or autoselect.symbolic_sizes():
        return None
    m = None
    if attn_mask is not None:
        if type(attn_mask) is not T:
            return None
        m = (attn_mask.shape, attn_mask.dtype, attn_mask.device, attn_mask.requires_grad)
    for x in (dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse, windowed_mask):
        if type(x) not in _SCALAR_TYPES:
            return None
    plan = _traced_plan((q.shape, q.dtype, q.device, q.requires_grad, k.shape, k.dtype, k.device, k.requires_grad,
                         v.shape, v.dtype, v.device, v.requires_grad, m, dropout_p, is_causal, scale, enable_gqa,
                         backend, precision, return_lse, windowed_mask, torch.is_grad_enabled()))
    if plan is None:
        return None
    squeeze, q_to, k_to, v_to, m_view, m_to, kind, scale_, causal, prec, p_drop, gqa = plan
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if q_to is not None:
        q = q.expand(q_to)
    if k_to is not None:
        k = k.expand(k_to)
    if v_to is not None:
        v = v.expand(v_to)
    mask = attn_mask
    if m_view is not None:
        mask = mask.reshape(m_view)
    if m_to is not None:
        mask = mask.expand(m_to)
    if kind == _SDPA:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=causal,
                                                               scale=scale_, enable_gqa=gqa)
        lse = None
    else:  # (the plan names the op: objects in a plan cannot be guarded, dynamo refuses them)
        from .kernels import ops, training

        if kind == _INLINE:
            out, lse = ops.attention_inline_op(q, k, v, mask, None, None, scale_, causal, prec, return_lse)
        elif kind == _OPAQUE:
            out, lse = ops.attention_inference_op(q, k, v, mask, None, None, scale_, causal, prec, return_lse)
        elif kind == _GRAD_OP:
            out, lse = ops.attention_op(q, k, v, mask, None, None, scale_, causal, prec)
        else:
            out, lse = training.attention_dropout_op(q, k, v, mask, None, None, scale_, causal, prec, p_drop,
                                                     training.draw_seed(q.device))
    if squeeze:
        out = out.squeeze(1)
        if return_lse:
            lse = lse.squeeze(1)
    return (out, lse) if return_lse else out


@torch.compiler.assume_constant_result
def _traced_plan(sig: tuple) -> Optional[tuple]:
    """What :func:`traced` puts in the graph for a call of signature ``sig``, or None (the full path): run by dynamo as
    Python, not traced, and its result a constant of the graph (no guard on what it reads, as the full path's traced
    decision: ``autoselect.choose_compiled``). The call is validated and decided as the full path does
    (:func:`_validate_and_decide`, auto's trace-time race), on fake tensors of the signature; the views that
    ``build_problem`` made are replayed on them and checked, so that a plan never differs from the full path's
    problem. Calls that raise, run on the reference backend, or on SDPA with anything but SDPA's own arguments, have
    no plan: the full path raises or runs them. Not memoised (a plan is cheap next to a compile, and a memo would
    have to know every knob the decision reads)."""
    (qs, qd, qdev, qg, ks, kd, kdev, kg, vs, vd, vdev, vg, m, dropout_p, is_causal, scale, enable_gqa, backend,
     precision, return_lse, windowed_mask, grad_mode) = sig
    plan = None
    try:
        plan = _make_traced_plan(qs, qd, qdev, qg, ks, kd, kdev, kg, vs, vd, vdev, vg, m, dropout_p, is_causal, scale,
                                 enable_gqa, backend, precision, return_lse, windowed_mask, grad_mode)
    except Exception:  # noqa: BLE001 - the full path raises it again, to the user, with its own traceback
        plan = None
    TRACED["plans" if plan is not None else "full"] += 1
    return plan


def _precompile(p, d) -> None:
    """Starts compiling the kernels of a traced inference call that will run on the opaque op, in the background
    (``launch.precompile``); why not is counted in ``launch.PRECOMPILE["not"]``. Never raises: a kernel not
    compiled here compiles at the call's first run."""
    from .kernels import launch

    try:
        why = launch.precompile(p.q, p.k, p.v, scale=float(p.scale), mask=p.mask, is_causal=bool(p.is_causal),
                                precision=d.precision)
    except Exception as e:  # noqa: BLE001 - an optimisation, never the call's failure
        why = f"failed: {type(e).__name__}: {e}"[:200]
    if why is not None:
        seen = launch.PRECOMPILE["not"]
        seen[why] = seen.get(why, 0) + 1


def _make_traced_plan(qs, qd, qdev, qg, ks, kd, kdev, kg, vs, vd, vdev, vg, m, dropout_p, is_causal, scale,
                      enable_gqa, backend, precision, return_lse, windowed_mask, grad_mode):
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    with detect_fake_mode() or FakeTensorMode():  # (only while they are made: the race below times real tensors)
        q, k, v = (torch.empty(s, dtype=d, device=dev, requires_grad=g)
                   for s, d, dev, g in ((qs, qd, qdev, qg), (ks, kd, kdev, kg), (vs, vd, vdev, vg)))
        mask = None if m is None else torch.empty(m[0], dtype=m[1], device=m[2], requires_grad=m[3])
    with torch.set_grad_enabled(grad_mode):
        p, d = _validate_and_decide(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                                    return_lse, None, None, windowed_mask)
        if autoselect.sdpa_reason(p, d, backend=backend, precision=precision, return_lse=return_lse) is None:
            d = autoselect.choose_compiled(p, d)  # raced once when traced, outside the graph (as prepare does)
        if p.causal_rows is not None or p.empty or p.q_lengths is not None or p.kv_lengths is not None:
            return None
        # the views build_problem made, as this plan replays them (checked against the problem's own)
        squeeze = p.squeeze_head
        q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v)) if squeeze else (q, k, v)
        q_to, k_to, v_to = (None if a.shape == b.shape else tuple(b.shape)
                            for a, b in ((q4, p.q), (k4, p.k), (v4, p.v)))
        m_view = m_to = None
        if mask is not None:
            m4 = mask
            if mask.dim() < 4:
                m_view = (1,) * (4 - mask.dim()) + tuple(mask.shape)
                m4 = mask.reshape(m_view)
            if p.mask is None or m4.dim() != 4:
                return None
            m_to = None if m4.shape == p.mask.shape else tuple(p.mask.shape)
            if m_to is not None:
                m4 = m4.expand(m_to)
        replayed = tuple(t if to is None else t.expand(to) for t, to in ((q4, q_to), (k4, k_to), (v4, v_to)))
        if any(a.shape != b.shape or a.stride() != b.stride() for a, b in zip(replayed, (p.q, p.k, p.v))):
            return None
        if mask is not None and (m4.shape != p.mask.shape or m4.stride() != p.mask.stride()):
            return None
        wants_grad = grad_mode and (qg or kg or vg or (m is not None and m[3]))
    common = (float(p.scale), bool(p.is_causal))
    if d.backend == "sdpa":
        if p.mask is not None or return_lse or (p.is_causal and p.n_q != p.n_k):
            return None  # (sdpa.run's other branches: the full path)
        return (squeeze, q_to, k_to, v_to, m_view, m_to, _SDPA, *common, "", float(p.dropout_p),
                p.heads_q != p.heads_kv)
    if d.backend != "elsa":
        return None
    from .kernels import interface

    if p.dropout_p > 0:
        kind = _DROPOUT
    elif wants_grad:
        kind = _GRAD_OP
    else:
        kind = _INLINE if interface.inference_op() is interface.ops.attention_inline_op else _OPAQUE
        # ELSA_COMPILE_OP=auto's long call: the opaque op itself, not the inline op whose body would send it there
        # while AOTAutograd traces each call
        if kind == _INLINE and interface.launch.long_call(p.q, p.k, p.v, bool(p.is_causal)) is not None:
            kind = _OPAQUE
        _precompile(p, d)
    return (squeeze, q_to, k_to, v_to, m_view, m_to, kind, *common, d.precision or "", float(p.dropout_p), None)
