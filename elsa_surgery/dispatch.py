"""The dispatch decision, in one function: :func:`decide`.

Per call, from the tensors' device, dtype, shape and mask kind, it picks the backend and the fp32
precision mode and says why. Order of authority: an explicit ``backend=`` / ``precision=`` argument,
then the environment (``ELSA_BACKEND``, ``ELSA_FP32_PRECISION``), then the automatic choice.

Backends: ``"auto"``; ``"elsa"`` (the Triton kernels; on CPU tensors only under ``TRITON_INTERPRET=1``);
``"reference"`` (pure PyTorch monoid scan, any device and dtype); ``"sdpa"`` (PyTorch's
``scaled_dot_product_attention``, for baselines). Under ``auto`` a case the kernels cannot run falls
back to the reference and the reason is logged once and recorded (see :func:`record`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, asdict
from typing import List, Optional

import torch

from .kernels import knobs

logger = logging.getLogger("elsa_surgery")

BACKENDS = ("auto", "elsa", "reference", "sdpa")
PRECISIONS = ("strict", "precise", "turbo")
ENV_BACKEND = knobs.BACKEND
ENV_PRECISION = knobs.FP32_PRECISION


class BackendUnavailable(RuntimeError):
    """``backend="elsa"`` was forced for a case the kernels cannot run (the message says why)."""


@dataclass(frozen=True)
class Decision:
    backend: str  # "elsa" | "reference" | "sdpa"
    precision: Optional[str]  # fp32 mode for the elsa backend; None where it does not apply
    reason: str  # why this backend (and why not elsa, for a fallback)
    fallback: bool = False  # True when auto wanted elsa but could not use it

    def to_dict(self) -> dict:
        return asdict(self)


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


def requested_backend(backend: Optional[str]) -> str:
    backend = "auto" if backend is None else backend
    _check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        env = knobs.get(ENV_BACKEND)
        if env:
            return env
    return backend


def requested_precision(precision: Optional[str]) -> Optional[str]:
    if precision is not None:
        _check_choice("precision", precision, PRECISIONS)
        return precision
    return knobs.get(ENV_PRECISION)


def default_precision(device: torch.device) -> str:
    """fp32 default when neither ``precision=`` nor ``ELSA_FP32_PRECISION`` names a mode: the kernels' own rule
    (``elsa_surgery.kernels.default_precision``: ``precise`` on sm80+, ``strict`` elsewhere), stated once there."""
    return kernels_module().default_precision(device)


_KERNELS = None


def kernels_module():
    """``elsa_surgery.kernels``, imported once on first use (Triton is not imported by ``import elsa_surgery``).

    Cached in a global so that code traced by torch.compile reads an attribute instead of tracing an import. While
    torch.compile traces, the global is neither read nor written (a guard on it would recompile the graph once it
    is set) and the interface module stands in for the package: dynamo runs the import, not the binding of
    ``kernels.load()``, so a first call traced in a fresh process compiles with ``fullgraph=True``."""
    global _KERNELS
    if torch.compiler.is_compiling():
        from .kernels import interface

        return interface
    if _KERNELS is None:
        from . import kernels

        kernels.load()  # binds the interface's names (the package imports it lazily)
        _KERNELS = kernels
    return _KERNELS


def kernel_unsupported_reason(q, k, v, mask, *, varlen: bool = False) -> Optional[str]:
    """Why the Triton kernels cannot run this case, or None when they can."""
    try:
        kernels = kernels_module()
    except ImportError as exc:  # triton missing
        return f"the Triton kernels cannot be imported ({exc})"
    return kernels.unsupported_reason(q, k, v, mask, varlen=varlen)


def auto_runs_kernels_on(device: torch.device) -> bool:
    """Whether ``auto`` tries the kernels on this device at all (CUDA; elsewhere it picks the reference)."""
    return device.type == "cuda"


def decide(q, k, v, mask=None, *, backend: Optional[str] = "auto", precision: Optional[str] = None,
           varlen: bool = False, need_lse: bool = False, dropout_p: float = 0.0) -> Decision:
    """Pick the backend and precision for one call, and say why."""
    want = requested_backend(backend)
    prec = requested_precision(precision)
    fp32 = q.dtype == torch.float32

    if want == "reference":
        return Decision("reference", None, "backend='reference' requested")
    if want == "sdpa":
        if need_lse:
            raise ValueError("return_lse=True is not available with backend='sdpa' (PyTorch's SDPA does not return it); "
                             "use backend='elsa' or 'reference'")
        if varlen:
            raise ValueError("backend='sdpa' has no packed-varlen path; use backend='elsa' or 'reference'")
        return Decision("sdpa", None, "backend='sdpa' requested")

    if want == "auto" and not auto_runs_kernels_on(q.device):
        return Decision("reference", None,
                        f"auto on {q.device.type} tensors: the reference backend (the Triton kernels need CUDA; "
                        f"backend='elsa' with TRITON_INTERPRET=1 runs them in the interpreter)")
    why_not = kernel_unsupported_reason(q, k, v, mask, varlen=varlen)  # dropout: the kernels draw it (issue 25)
    if why_not is None:
        mode = (prec or default_precision(q.device)) if fp32 else None
        how = "requested" if want == "elsa" else f"auto: {q.device.type} {str(q.dtype).replace('torch.', '')}"
        return Decision("elsa", mode, f"ELSA Triton kernel ({how})")
    if want == "elsa":
        raise BackendUnavailable(f"backend='elsa' cannot run this call: {why_not}")
    return Decision("reference", None, f"fallback to reference: {why_not}", fallback=True)


# --------------------------------------------------------------------------------------------------
# telling the user: log each distinct fallback reason once, and let callers record every decision
# --------------------------------------------------------------------------------------------------

_local = threading.local()
_logged: set = set()
_OPEN = [0]  # record() blocks open in any thread: announce_eager's fast path while there are none
_OPEN_LOCK = threading.Lock()


@contextlib.contextmanager
def record():
    """Collect every :class:`Decision` made in this thread inside the block: ``with record() as log:``."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    log: List[Decision] = []
    stack.append(log)
    with _OPEN_LOCK:
        _OPEN[0] += 1
    try:
        yield log
    finally:
        with _OPEN_LOCK:
            _OPEN[0] -= 1
        stack.remove(log)


@contextlib.contextmanager
def unrecorded():
    """Decisions made in this thread inside the block reach no :func:`record` log (auto's race runs the call it is
    deciding, elsa_surgery/autoselect.py: those trial calls are not the user's)."""
    saved = getattr(_local, "stack", None)
    _local.stack = []
    try:
        yield
    finally:
        _local.stack = [] if saved is None else saved


def announce_eager(decision: Decision) -> None:
    """:func:`announce` for an eager call whose decision is not the reference backend's (a direct route: nothing to
    log, and no compile check needed): the per-call cost of a call seen before; nothing to do while no :func:`record`
    block is open in any thread."""
    if not _OPEN[0]:
        return
    for log in getattr(_local, "stack", ()):
        log.append(decision)


def announce(decision: Decision) -> None:
    """Hand ``decision`` to every open :func:`record` log of this thread (and log a reference fallback once).

    Never inside compiled code: under ``torch.compile`` the log stack is host state that dynamo would guard on
    (its length changes between the parity runs and the user's calls, so every block would recompile until the
    recompile limit sends the frame back to eager). Decisions are recorded by eager calls only.
    """
    if torch.compiler.is_compiling():
        return
    for log in getattr(_local, "stack", ()):
        log.append(decision)
    if decision.backend == "reference" and decision.reason not in _logged:
        _logged.add(decision.reason)
        (logger.warning if decision.fallback else logger.info)("elsa_surgery: %s", decision.reason)
