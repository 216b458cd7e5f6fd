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
(:mod:`elsa_surgery.autoselect`); the memo keeps the winner.

Direct routes: once a signature's call has run with the same inputs (the canonical problem holds the caller's own
q, k, v and mask: no 3-D or broadcast views, no rebuilt mask view; no dropout, lengths or gradient), its entry also
keeps how to run it again without any of the above: for the kernels, the launch plan that ``kernels/replay.py``
recorded for it (keyed here by what that plan's key adds: strides, 16-byte alignment, which inputs are one tensor,
the current device and stream capture); for SDPA chosen by ``auto``, the plain SDPA call. :func:`direct` runs a
call through its route (the decision still announced), the cheapest eager path there is; :func:`learn` makes
routes after a call ran. A route is dropped with its plan (``replay.clear``) or when a knob the plan read changes.

Not memoised, so validated in full on every call: calls that raise (errors are never kept), calls with
``q_lengths`` / ``kv_lengths`` (their values are checked), a tensor ``scale``, arguments of other types than plain
tensors, bools, numbers and strings (tensor subclasses, NumPy scalars), and calls traced by ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import autoselect, dispatch
from .kernels import internals, knobs, replay
from .semantics import AttentionProblem, broadcast_batch_and_heads, build_problem, canonical_mask

MAX_ENTRIES = 1024  # signatures kept (the oldest dropped first)

# ELSA_LAUNCH_PLANS: whether the kernels' launch plans (and so direct routes) are used
_ENV_NAMES = (dispatch.ENV_BACKEND, dispatch.ENV_PRECISION, "TRITON_INTERPRET", knobs.LAUNCH_PLANS)
# the raw values, from the environment's store (CPython's encoded one where checked: kernels/internals.py); the knobs'
# values are validated by the dispatch (kernels/knobs.py)
_RAW = internals.ENVIRON
_E0, _E1, _E2, _E3 = (internals.ENCODE(n) for n in _ENV_NAMES)

_entries: dict = {}
STATS = {"hits": 0, "misses": 0, "bypassed": 0}
DIRECT = {"runs": 0, "routes": 0}  # calls run through a direct route (counted among the hits too), routes made

_PLAIN = frozenset((bool, int, float, str, type(None)))


def clear() -> None:
    _entries.clear()


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
        self.routes = {} if direct_ok else None  # _extras(...) -> route; None: calls of the signature never have one
        self.mask_shape = None if p.mask is None else tuple(p.mask.shape)  # a 4-D mask's canonical (expanded) view


def signature(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
              q_lengths, kv_lengths, windowed_mask) -> Optional[tuple]:
    """The memo's key of an eager call, or None for a call validated in full every time (traced by
    torch.compile, with lengths, or with arguments the key cannot hold: module docstring)."""
    if q_lengths is not None or kv_lengths is not None or torch.compiler.is_compiling():
        return None
    return _key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, return_lse,
                windowed_mask)


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
                                        precision, return_lse, None, None, windowed_mask)
            entry = _Entry(p, d, _direct_ok(p, d, q, k, v, attn_mask))
            if len(_entries) >= MAX_ENTRIES:
                del _entries[next(iter(_entries))]
            _entries[key] = entry
            if call is not None and autoselect.sdpa_reason(p, d, backend=backend, precision=precision,
                                                           return_lse=return_lse) is None:
                d = _race(entry, call, (q, k, v))
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
            p = AttentionProblem(q, k, v, scale_, mask, causal, None, None, squeeze, dropout)
    dispatch.announce(d)
    return p, d


def _direct_ok(p: AttentionProblem, d: dispatch.Decision, q, k, v, attn_mask) -> bool:
    """Whether calls of this signature can have direct routes: the problem is the caller's tensors as they are."""
    return (d.backend in ("elsa", "sdpa") and p.q is q and p.k is k and p.v is v
            and (attn_mask is None or attn_mask.dim() == 4)  # the canonical view: attn_mask.expand(mask_shape)
            and p.causal_rows is None and p.dropout_p == 0 and p.q_lengths is None and p.kv_lengths is None
            and (d.backend == "elsa" or (attn_mask is None and (not p.is_causal or p.n_q == p.n_k))))


def _extras(q, k, v, mask) -> tuple:
    """What a direct route depends on beyond the signature: the strides and 16-byte alignment its launch plan's
    kernels were specialised for, which inputs are one tensor, the current device and stream capture (the rest of
    the plan's key, kernels/launch.py). Whether autograd records the call is in the signature (:func:`_key`)."""
    cuda = q.is_cuda
    if mask is None:
        m = None
    else:
        m = (mask.stride(), mask.data_ptr() % 16 == 0)
    return (q.stride(), k.stride(), v.stride(), m, q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0,
            v.data_ptr() % 16 == 0, q is k, k is v, q is v, torch.cuda.current_device() if cuda else None,
            cuda and torch.cuda.is_current_stream_capturing())


def direct(key: tuple, q, k, v, attn_mask, return_lse: bool):
    """The call's result (as :func:`elsa_surgery.attention` returns it) through its direct route, the decision
    announced; None when it has none (the caller takes the full path). A route is ``enable_gqa`` for SDPA, ``(launch
    plan, replay.GENERATION when it was recorded)`` for the kernels."""
    entry = _entries.get(key)
    if entry is None or not entry.routes:
        return None
    extras = _extras(q, k, v, attn_mask)
    route = entry.routes.get(extras)
    if route is None:
        return None
    d = entry.decision
    if d.backend == "elsa":
        plan, generation = route
        if replay.GENERATION[0] != generation or not plan.env_unchanged():
            del entry.routes[extras]
            return None
    STATS["hits"] += 1
    DIRECT["runs"] += 1
    dispatch.announce(d)
    if d.backend == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=entry.causal, scale=entry.scale,
                                                                enable_gqa=route)
    mask = None if attn_mask is None else attn_mask.expand(entry.mask_shape)
    out, lse, _ = plan.replay({"q": q, "k": k, "v": v, "mask": mask})
    return (out, lse) if return_lse else out


def learn(key: tuple, p: AttentionProblem, d: dispatch.Decision, q, k, v, attn_mask, return_lse: bool) -> None:
    """After a memoised call ran on the full path: keep its direct route if it can have one (module docstring)."""
    entry = _entries.get(key)
    if entry is None or entry.routes is None or entry.decision is not d:
        return
    if key[-1]:  # autograd records the call (_key): no route
        return
    extras = _extras(q, k, v, attn_mask)
    if extras in entry.routes:
        return
    if d.backend == "sdpa":
        route = p.heads_q != p.heads_kv
    else:
        from .kernels import launch  # the kernels ran: imported

        plan = launch.attention_plan(q, k, v, scale=float(p.scale), mask=p.mask, is_causal=bool(p.is_causal),
                                     precision=d.precision or None, return_lse=return_lse)
        if plan is None:
            return
        route = (plan, replay.GENERATION[0])
    entry.routes[extras] = route
    DIRECT["routes"] += 1


def _race(entry: _Entry, call, qkv) -> dispatch.Decision:
    """auto's race (elsa_surgery/autoselect.py) for a new entry: ``call``, the public call, made with the entry set
    to the ELSA decision and to SDPA's in turn, unrecorded and uncounted; the entry keeps the winner. A training
    call (autograd records it: q, k or v requires grad) is raced as the call and its backward, on detached twins of
    the inputs (``call(*twins)``: the caller's graph and tensor hooks are not touched, no ``.grad`` is written).
    Tensors the race saves for backward skip any saved-tensor hooks in force (activation checkpointing's: a race
    inside a checkpointed forward would change the number of tensors saved there, which the recomputation, finding
    the signature decided, does not repeat: torch.utils.checkpoint's CheckpointError)."""
    d = entry.decision
    sides = {"elsa": (d, entry.routes), "sdpa": (autoselect.SDPA_SIDE, None if entry.routes is None else {})}
    twins, grads = (), []
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

    counts = dict(STATS), dict(DIRECT)
    try:
        with dispatch.unrecorded():
            with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                final = autoselect.choose(d, side("elsa"), side("sdpa"), training=bool(grads))
    finally:
        STATS.update(counts[0])
        DIRECT.update(counts[1])
    entry.decision, entry.routes = final, sides[final.backend][1]
    return final


def _as_is(t):
    return t


def _validate_and_decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision,
                         return_lse, q_lengths, kv_lengths, windowed_mask):
    p = build_problem(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      q_lengths=q_lengths, kv_lengths=kv_lengths, windowed_mask=windowed_mask)
    d = dispatch.decide(p.q, p.k, p.v, p.mask, backend=backend, precision=precision, need_lse=return_lse,
                        dropout_p=p.dropout_p)
    return p, d
