"""``auto``'s honest choice: an exact SDPA kernel where it is measurably faster than ELSA for a call signature.

``auto`` exists to make the user's model faster. For most signatures the ELSA kernels are; for some (short eager
calls whose time is host-bound, shapes where cuDNN's tiles beat ours) PyTorch's own SDPA kernel is. On the first
eager CUDA call of a signature that PyTorch's SDPA answers with exactly our semantics (:func:`sdpa_reason`), both
are timed back to back on the caller's own tensors (:func:`race`, :data:`CALLS` calls each, interleaved, host and
GPU time: what an eager caller waits; long calls, at least :data:`SETTLED_MS` each, whose first timed calls already
differ by :data:`SETTLED_RATIO` are decided there), and SDPA is kept only if it is faster by more than
:data:`MIN_GAIN`. Each side is the whole public call as later calls of the signature will make it
(``elsa_surgery/callcache.py`` runs the race with the signature's memo entry set to each decision in turn: direct
routes, validation, launch plans and all), so the host cost of our Python counts against ELSA, as it does for the
user. A training call (autograd records it: q, k or v requires grad) is its own signature, raced forward + backward
(the backward to q, k, v only). The choice is made once per signature (``elsa_surgery/callcache.py`` keeps it;
unmasked signatures that differ only in their number of keys, as a growing KV cache's decode steps, share one race
per quarter octave of it, an SDPA verdict only after :func:`probe_new_count`: :func:`band_verdict`), and its
:class:`~.dispatch.Decision` names both timings, so the report's ``backends_used`` and ``dispatch_reasons`` show
it. ``backend="elsa"`` never races, nor does a call with an explicit ``precision`` (a request for one of ELSA's
modes).

Under ``torch.compile`` the choice is made when the call is traced: :func:`choose_compiled` races the custom op an
inference graph calls (``elsa_surgery::attention_inference``, its dispatch included) against SDPA on fresh tensors
of the call's (static) shapes, outside the graph (``torch.compiler.assume_constant_result``: a constant of the
trace, no guard), once per signature; the graph then holds the winner (SDPA's op, which Inductor sees, or ours). A
signature whose eager race one timed call of each side settled (:data:`SETTLED`: long calls, far apart) takes that
verdict instead of racing again. The verdicts are logged once and kept in :data:`COMPILED`
(``compiled_decisions()``). Dynamic shapes are not raced (the kernels are kept).

SDPA is *exact* here in the sense the design asks: fp16/bf16 flash, cuDNN and memory-efficient kernels and fp32's
memory-efficient kernel all compute softmax attention with fp32 accumulation; fp32 races only while PyTorch's
matmuls are IEEE (``torch.backends.cuda.matmul.allow_tf32`` off), since SDPA's fp32 math path would otherwise run
TF32 products. Calls with key lengths alone (``kv_lengths``: BERT's padded batches through the transformers adapter)
race SDPA with the key-padding mask ``[B, 1, 1, Nk]`` that the native model builds (``sdpa.run``; rows without a key
-> zeros); the race is per signature, whatever the lengths' values.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .dispatch import Decision

logger = logging.getLogger("elsa_surgery")

CALLS = 10  # at most this many timed calls of each side per round (fewer for long calls: BUDGET_MS)
BUDGET_MS = 2.0  # a round of one side takes about this long (at least one call)
ROUNDS = 3  # interleaved rounds; the median round counts
SETTLED_MS = 2.0  # a race is settled by one timed call of each side when both take at least this long ...
SETTLED_RATIO = 1.5  # ... and one is this many times faster than the other (the rounds would only refine it)
MAX_SETTLED = 1024  # settled eager verdicts kept for torch.compile's trace (the oldest dropped first)
MIN_GAIN = 1.05  # SDPA is taken only when ELSA's time is more than 5 % above SDPA's
ENABLED = True  # tests and benchmarks may turn the race off


def _eager_cuda(t: torch.Tensor) -> bool:
    """A CUDA call that may be raced: not one being captured into a CUDA graph. While torch.compile traces, the
    capture state is not read (``torch.cuda.is_current_stream_capturing`` returns a bool, which dynamo cannot put in
    a graph: it broke the graph at every converted attention module of a model compiled with ``auto``, session 31's
    H100 run, ViT-B/16 bf16 0.45x compiled native); the traced race runs outside the graph (:func:`choose_compiled`)."""
    if t.device.type != "cuda":
        return False
    return torch.compiler.is_compiling() or not torch.cuda.is_current_stream_capturing()


def sdpa_reason(p, d: Decision, *, backend: str, precision: Optional[str], return_lse: bool) -> Optional[str]:
    """None when SDPA may replace the kernels for this problem, else why not (kept for the log only)."""
    if not ENABLED:
        return "the race is off"
    if d.backend != "elsa" or backend not in ("auto", None) or precision is not None:
        return "not an automatic ELSA decision"
    if not _eager_cuda(p.q):
        return "not an eager CUDA call"
    if return_lse or p.dropout_p or p.q_lengths is not None:
        return "lse, dropout or padded query rows: SDPA has no equivalent"
    if p.kv_lengths is not None and (p.is_causal or torch.compiler.is_compiling()):
        # (the traced race, _trace_time_choice, times fresh tensors without lengths)
        return "key lengths with causal, or traced by torch.compile: not raced"
    if p.mask is not None:
        return "masked: SDPA differs on rows with no visible key"
    if p.is_causal and p.q.shape[2] != p.k.shape[2]:
        return "causal with Nq != Nk: SDPA aligns top-left"
    if p.q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "fp32 with TF32 matmuls on: SDPA's math path would not be exact"
    return None


def _per_call_ms(fn: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


class Times(NamedTuple):
    """What :func:`race` measured: each side's milliseconds per call, and in how many interleaved rounds (0: one
    timed call of each side settled it)."""
    elsa_ms: float
    sdpa_ms: float
    rounds: int


def race(elsa: Callable[[], object], sdpa: Callable[[], object]) -> Times:
    """Each side's time per call: both warmed up and timed once; unless that settles it (both calls at least
    :data:`SETTLED_MS` long and one :data:`SETTLED_RATIO` times faster: a VGGT-shaped global attention of 137K
    tokens, 0.35 s against 1.3 s a call, spent 5 s more in the rounds), then timed in interleaved rounds (median
    round) of up to :data:`CALLS` back-to-back calls, as many as fit :data:`BUDGET_MS`."""
    elsa()  # both warm (the kernels' first call compiles and records its launch plan, SDPA's picks its kernel)
    sdpa()
    first = (_per_call_ms(elsa, 1), _per_call_ms(sdpa, 1))
    if min(first) >= SETTLED_MS and max(first) >= SETTLED_RATIO * min(first):
        return Times(first[0], first[1], 0)
    calls = max(1, min(CALLS, int(BUDGET_MS / max(first[0], 1e-3))))
    times = ([], [])
    for _ in range(ROUNDS):
        times[0].append(_per_call_ms(elsa, calls))
        times[1].append(_per_call_ms(sdpa, calls))
    return Times(*(sorted(t)[len(t) // 2] for t in times), ROUNDS)


SDPA_SIDE = Decision("sdpa", None, "auto's race: the PyTorch SDPA side")  # what the race's SDPA calls run under


class _SdpaOutOfMemory(Exception):
    """SDPA's side of a race ran out of GPU memory (:func:`choose`)."""


def choose(d: Decision, elsa: Callable[[], object], sdpa: Callable[[], object], *, traced: bool = False,
           training: bool = False, settled_key: Optional[tuple] = None, times: Optional[list] = None) -> Decision:
    """``d`` (naming both timings), or an SDPA decision naming them when SDPA is faster by more than
    :data:`MIN_GAIN`; ``elsa`` and ``sdpa`` make the call each way; ``traced``: the race of a call torch.compile
    is tracing (:func:`choose_compiled`); ``training``: each side is a call and its backward; ``settled_key``: the
    eager inference call's :func:`traced_signature`, under which a settled verdict is kept in :data:`SETTLED`
    for torch.compile's trace of the same call; ``times``: a list the race's :class:`Times` is appended to. Where
    SDPA's side
    runs out of GPU memory (its math path, the only one for fp32 GQA, materialises the ``Nq x Nk`` scores: 112 GiB
    for a Qwen2-7B-shaped 32K prefill), ``d`` is kept and says so: the race must never fail a call ELSA can run."""

    def guarded():
        try:
            return sdpa()
        except torch.cuda.OutOfMemoryError as e:
            raise _SdpaOutOfMemory(str(e).splitlines()[0][:120]) from e

    try:
        elsa_ms, sdpa_ms, rounds = race(elsa, guarded)
    except _SdpaOutOfMemory as e:
        return Decision(d.backend, d.precision, f"{d.reason}; auto's race: PyTorch SDPA ran out of memory ({e})",
                        d.fallback)
    if times is not None:
        times.append(Times(elsa_ms, sdpa_ms, rounds))
    what = "forward + backward of each training call" if training else "call"
    measured = (f"median of {rounds} interleaved rounds" if rounds else
                f"one timed call of each: at least {SETTLED_MS:g} ms and {SETTLED_RATIO:g}x apart, settled")
    how = (f"{what} for this signature (raced once when torch.compile traced it"
           f"{'' if rounds else '; ' + measured})" if traced else
           f"eager {what} for this signature (measured once, {measured})")
    verdict = f"ELSA {elsa_ms * 1e3:.1f} us vs PyTorch SDPA {sdpa_ms * 1e3:.1f} us per {how}"
    where = "auto under torch.compile" if traced else "auto"
    if elsa_ms > MIN_GAIN * sdpa_ms:
        final = Decision("sdpa", None, f"{where}: PyTorch SDPA, faster here: {verdict}; backend='elsa' runs ELSA")
    else:
        final = Decision(d.backend, d.precision, f"{d.reason}; {verdict}", d.fallback)
    if settled_key is not None and not rounds and not traced and not training:
        if len(SETTLED) >= MAX_SETTLED:
            del SETTLED[next(iter(SETTLED))]
        SETTLED[settled_key] = final
    return final


# A band of key counts shares its race's verdict (elsa_surgery/callcache.py): the calls of a growing KV cache's decode
# steps, each at a key count not seen before. The race times SDPA repeating one call, but a PyTorch SDPA backend may
# build something per shape (session 58, H200, torch 2.11: unmasked bf16 decode calls through cuDNN rebuilt its plan
# at every new key count, 36-50 ms a step against microseconds repeated). Where SDPA wins a band, its first call at
# another key count of the band is timed once more (:func:`probe_new_count`); where that first call costs more than
# NEW_COUNT_RATIO times its repeated call and more than ELSA's raced time, the band shares ELSA instead
# (:func:`band_verdict`): each later step of it would pay SDPA's first-call cost.
NEW_COUNT_RATIO = 4.0


class Probe(NamedTuple):
    """SDPA's first call at a key count it had not seen, and the same call repeated, in milliseconds."""
    first_ms: float
    again_ms: float


def probe_new_count(sdpa_other: Callable[[], object]) -> Probe:
    """:class:`Probe` of ``sdpa_other``: SDPA's call at a key count of the band other than the raced one."""
    return Probe(_per_call_ms(sdpa_other, 1), _per_call_ms(sdpa_other, 1))


def band_verdict(final: Decision, kept: Decision, times: Times, probe: Probe, other_keys: int) -> Decision:
    """The verdict a band of key counts shares, after a race whose verdict was ``final`` (SDPA) with ``times`` and
    the :class:`Probe` of SDPA at ``other_keys`` keys: ``final``, or ``kept`` (ELSA's decision) naming the probe
    when SDPA's first call at a new key count costs more than :data:`NEW_COUNT_RATIO` times its repeated call and
    more than ELSA's call."""
    if not (probe.first_ms > NEW_COUNT_RATIO * probe.again_ms and probe.first_ms > times.elsa_ms):
        return final
    return Decision(kept.backend, kept.precision,
                    f"{kept.reason}; auto's race: PyTorch SDPA was faster repeating one call (ELSA "
                    f"{times.elsa_ms * 1e3:.1f} us vs SDPA {times.sdpa_ms * 1e3:.1f} us), but its first call at "
                    f"another key count ({other_keys}) took {probe.first_ms * 1e3:.1f} us ({probe.again_ms * 1e3:.1f} "
                    "us repeated): the band's calls, each at a new key count, share ELSA", kept.fallback)


# eager verdicts that one timed call of each side settled (calls of milliseconds, 1.5x apart: the custom op's few
# microseconds of dispatch, which the traced race counts, cannot turn them), by traced_signature: torch.compile's
# trace of such a call takes the verdict instead of racing again (VGGT-shaped 100 frames: 3.4 s of its compile)
SETTLED: Dict[tuple, Decision] = {}


def traced_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                     precision: Optional[str]) -> tuple:
    """The key of a traced call's race (:data:`COMPILED`, :data:`SETTLED`): the problem's q, k, v shapes, dtype,
    device, causality, scale and fp32 mode."""
    dev = q.device
    return ((tuple(q.shape), tuple(k.shape), tuple(v.shape)), str(q.dtype).replace("torch.", ""), dev.type,
            dev.index, bool(is_causal), float(scale), precision)


# trace-time verdicts by signature (shapes, dtype, device, causal, scale, precision)
COMPILED: Dict[tuple, Decision] = {}


def compiled_decisions() -> Dict[tuple, Decision]:
    """Every trace-time choice made so far (signature -> decision naming both timings)."""
    return dict(COMPILED)


@torch.compiler.assume_constant_result
def symbolic_sizes() -> bool:
    """Whether the graph torch.compile is tracing has symbolic sizes (dynamic shapes, or unbacked sizes): then a
    call's sizes may not be constants, which an ``assume_constant_result`` function must be given (anything else is a
    graph break, an error under ``fullgraph=True``), and traced code cannot tell which (dynamo reports a symbolic
    size's type as int). Read from the trace's shape environment, as a constant of the trace."""
    ctx = torch._guards.TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    return env is None or bool(env.var_to_range)


def choose_compiled(p, d: Decision) -> Decision:
    """``d`` or SDPA's decision for a call being traced by torch.compile (module docstring); ``p`` holds fake
    tensors, only their static shapes, dtype and device are read."""
    if symbolic_sizes():
        return d  # dynamic shapes: one graph serves many, no race (session 37: the type test here before saw ints)
    backend, reason = _trace_time_choice(traced_signature(p.q, p.k, p.v, p.is_causal, p.scale, d.precision))
    return d if backend == "elsa" else Decision("sdpa", None, reason)


@torch.compiler.assume_constant_result
def _trace_time_choice(sig: tuple) -> Tuple[str, str]:
    """``(backend, reason)`` for a traced call's signature: raced on fresh tensors the first time (a constant of the
    trace: dynamo runs this outside the graph and guards on nothing it reads)."""
    known = COMPILED.get(sig)
    eager = SETTLED.get(sig) if known is None else None
    if eager is not None:
        known = Decision(eager.backend, eager.precision,
                         f"auto under torch.compile: {'ELSA kept' if eager.backend == 'elsa' else 'PyTorch SDPA'}, "
                         f"as this signature's eager race settled it ({eager.reason})", eager.fallback)
        COMPILED[sig] = known
        logger.info("elsa_surgery: %s", known.reason)
    if known is None:
        (sq, sk, sv), dtype, dev_type, dev_index, causal, scale, precision = sig
        device = torch.device(dev_type, dev_index)
        dt = getattr(torch, dtype)
        q, k, v = (torch.randn(s, device=device, dtype=dt) for s in (sq, sk, sv))
        from .kernels import ops  # the kernels ran or will: imported

        # the op as an inference graph calls it (Inductor's wrapper calls the registered op): its dispatch counts
        # against ELSA, as it will in the graph (session 31: timing the launcher alone kept ELSA for ViT-B/16 bf16,
        # 0.90x compiled native)
        elsa = lambda: ops.attention_inference_op(q, k, v, None, None, None, scale, causal,  # noqa: E731
                                                  precision or "", False)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, scale=scale, enable_gqa=sq[1] != sk[1])
        known = choose(Decision("elsa", precision, "auto under torch.compile: ELSA kept"), elsa, sdpa, traced=True)
        COMPILED[sig] = known
        logger.info("elsa_surgery: %s", known.reason)
    return known.backend, known.reason
