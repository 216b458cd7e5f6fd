"""What every adapter shares: binding a forward, counting native calls, example-input helpers, restoring.

The record itself (one :class:`~elsa_surgery.patching.PatchRecord` per patched module, attribute ``_elsa_patch``)
and the binding (:func:`~elsa_surgery.patching.bind_forward`) are the framework's; this module is the side of
them an adapter uses (docs/design.md, "Adapters"). An adapter file then holds only its family's code: how to
match a module and the forward that replaces its attention core.

* :class:`ForwardAdapter`: ``patch`` binds ``forward_fn`` (``fn(self, ..., *, config)``); ``revert`` restores
  what the record saved. Subclasses set ``forward_fn`` or override :meth:`ForwardAdapter.forward_for`.
* :class:`StructuralAdapter`: for models that are not pip packages (matched by their own rule unless the user
  names exact classes; modules without the expected structure are skipped with a reason).
* :func:`record_native_call` / :func:`original_forward`: a call the adapter hands to the original
  implementation is counted in the record (``module.elsa_native_calls``), logged once and announced to
  :func:`elsa_surgery.dispatch.record`.
* :func:`first_param`, :func:`random_tensor`: example inputs on the model's device and dtype.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

import elsa_surgery
from elsa_surgery import dispatch
from elsa_surgery.patching import NATIVE_CALLS_ATTR, bind_forward, original_forward, record_of
from elsa_surgery.registry import Adapter, PatchConfig

logger = logging.getLogger("elsa_surgery")

__all__ = ["ForwardAdapter", "StructuralAdapter", "attention", "bind_forward", "first_param", "original_forward",
           "random_tensor", "record_native_call"]

_logged_native: set = set()


class ForwardAdapter(Adapter):
    """An adapter that patches a module by rebinding its ``forward`` to ``forward_fn`` (:func:`bind_forward`)."""

    forward_fn: Callable = None  # fn(self, *args, config, **kwargs)

    def forward_for(self, module: nn.Module) -> Callable:
        return type(self).forward_fn

    def patch(self, module: nn.Module, config: PatchConfig) -> None:
        bind_forward(module, self.forward_for(module), config)


class StructuralAdapter(ForwardAdapter):
    """Matches ``classes`` exactly when given, else :meth:`matches_builtin`; skips modules failing
    :meth:`has_structure` with ``structure_reason``."""

    library = None
    structure_reason = "does not have the expected attention structure"

    def __init__(self, name: Optional[str] = None, classes: Optional[Sequence[type]] = None):
        if name is not None:
            self.name = name
        self.classes = None if classes is None else tuple(classes)
        if self.classes is not None:
            for c in self.classes:
                if not (isinstance(c, type) and issubclass(c, nn.Module)):
                    raise TypeError(f"classes must be nn.Module subclasses, got {c!r}")

    def matches(self, module: nn.Module) -> bool:
        if self.classes is not None:
            return type(module) in self.classes
        return self.matches_builtin(module)

    def matches_builtin(self, module: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def has_structure(self, module: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def skip_reason(self, module: nn.Module, config: PatchConfig) -> Optional[str]:
        return None if self.has_structure(module) else self.structure_reason

    def matches_any(self, model: nn.Module) -> bool:
        """Whether ``model`` holds a module this adapter matches (``example_inputs`` builds none otherwise)."""
        return any(self.matches(m) for m in model.modules())


def record_native_call(module: nn.Module, reason: str) -> None:
    """Count a call that runs the module's original implementation, log it once, record the decision."""
    rec = record_of(module)
    if rec is not None:
        rec.native_calls[reason] = rec.native_calls.get(reason, 0) + 1
    full = f"{type(module).__name__}: original implementation used ({reason})"
    dispatch.announce(dispatch.Decision("native", None, full, fallback=True))  # seen by dispatch.record()
    if full not in _logged_native and not torch.compiler.is_compiling():
        _logged_native.add(full)
        logger.warning("elsa_surgery: %s; counted in module.%s", full, NATIVE_CALLS_ATTR)


def attention(config: PatchConfig, q, k, v, **kwargs):
    """:func:`elsa_surgery.attention` with the patch's backend and precision."""
    return elsa_surgery.attention(q, k, v, backend=config.backend, precision=config.precision, **kwargs)


def first_param(model: nn.Module) -> Optional[torch.Tensor]:
    """The model's first parameter (else its first floating buffer): where example inputs go, and in which dtype."""
    for p in model.parameters():
        return p
    for b in model.buffers():
        if b.is_floating_point():
            return b
    return None


def random_tensor(shape, like: Optional[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """``randn(shape)`` from a fixed seed, on ``like``'s device and (floating) dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if like is not None:
        x = x.to(device=like.device, dtype=like.dtype if like.is_floating_point() else torch.float32)
    return x
