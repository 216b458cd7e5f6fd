"""The adapter contract and the registry of architecture adapters (docs/design.md, "Adapters").

An adapter knows one library's attention modules and nothing else. It declares:

* ``name``: unique, dotted by family (``"timm.vit"``, ``"transformers"``, ``"torch.mha"``...).
* ``library``: the import name it needs (``"timm"``), or None. The library is never imported by
  ``import elsa_surgery``; adapter modules defer it, and ``matches`` answers False for models that
  could not contain the library's classes (the library is not even in ``sys.modules``).
* ``matches(module)``: exact class checks (subclasses only where the adapter says so).
* ``patch(module, config)``: rebinds ``forward`` (:func:`bind_forward`: a class swap) or swaps submodules,
  reusing the module's own parameters, so the state dict never changes. The framework attaches the module's patch
  record (:mod:`elsa_surgery.patching`) before calling it; the class :func:`bind_forward` swaps and every instance
  attribute set through the record are restored exactly on revert; an adapter that changes anything
  else overrides ``unpatch``. :func:`bind_forward` does the rebinding in the way that survives
  ``copy.deepcopy``, pickling and ``torch.compile(fullgraph=True)``. Shared adapter plumbing (binding a
  forward, counting native calls, example inputs) is in ``elsa_surgery.adapters._base``.
* ``skip_reason(module, config)``: a module it matches but will not convert, with the reason (it is
  reported, never silently ignored).
* ``example_inputs(model)``: inputs for the parity check, or None when it cannot build them;
  ``sized_example_inputs(model, batch=, seq_len=, image_size=)`` the same at a requested size (the CLI).
* ``notes(model)``: per converted module, what the patch relies on (``[{"name", ...}]``; the CLI and
  :func:`elsa_surgery.save` print them), read from the patch record.

Model-level adapters (transformers' ``AttentionInterface``) patch a whole model at once instead of
one module at a time. They implement:

* ``claims_model(model) -> bool``: this adapter handles ``model`` as a whole. :func:`elsa_surgery.convert`
  asks every selected adapter first, before walking the modules.
* ``model_modules(model) -> [(qualified_name, module), ...]``: the attention modules the model-level patch
  covers. They are listed as converted in the report, used for include/exclude and for per-module parity
  localisation, and the module walk never hands them (or their submodules) to per-module adapters.
* ``patch_model(model, config)``: switch the model over (e.g. register and select an
  ``AttentionInterface`` function). ``config.modules`` holds the selected names from ``model_modules``
  when include/exclude selected only some of them, and only for adapters that set
  ``supports_module_filter = True``; for the others, a partial selection skips the adapter (reported).
* ``revert_model(model)``: undo ``patch_model`` exactly. Called by :func:`elsa_surgery.revert`, and by
  ``convert`` when parity verification fails.

All four have no-op defaults, so per-module adapters ignore them.

When several adapters match one module, :func:`elsa_surgery.convert` uses the first in its ``adapters=``
order (all registered adapters in name order by default).

Built-in adapters live in ``elsa_surgery.adapters``: every module there that defines a module-level
``ADAPTERS`` list is discovered when the registry is first used (importing an adapter module must not
import its library).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import sys
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch.nn as nn

logger = logging.getLogger("elsa_surgery")


class PatchConfig(NamedTuple):
    """What a patched module passes to :func:`elsa_surgery.attention` on every call.

    An immutable tuple of strings (not a dataclass): a patched module holds it in its ``__dict__``
    (:data:`elsa_surgery.patching.CONFIG_ATTR`) and its forward reads it there, and Dynamo counts tuples of strings
    and None as immutable, so a compiled model's guard check can skip the module's whole subtree when its
    ``__dict__`` is unchanged, as it does for native modules (torch's recursive dict tags). A dataclass there
    made every patched module, and the blocks above it, fall out of that fast path (session 49, H200, torch 2.11:
    ViT-B/16's guard check 27 µs against native's 6.4)."""

    backend: str = "auto"
    precision: Optional[str] = None
    # Model-level adapters only: the selected names from ``model_modules``, sorted (None = all of them).
    modules: Optional[Tuple[str, ...]] = None


class Adapter:
    """Base class of every architecture adapter. See the module docstring for the contract."""

    name: str = ""
    library: Optional[str] = None
    description: str = ""

    # -- per-module adapters -----------------------------------------------------------------
    def matches(self, module: nn.Module) -> bool:  # pragma: no cover - abstract
        return False

    def skip_reason(self, module: nn.Module, config: PatchConfig) -> Optional[str]:
        return None

    def patch(self, module: nn.Module, config: PatchConfig) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def unpatch(self, module: nn.Module) -> None:
        """Undo anything beyond the instance ``forward`` (which the framework restores itself)."""

    # -- parity inputs -----------------------------------------------------------------------
    def example_inputs(self, model: nn.Module) -> Optional[Any]:
        return None

    def sized_example_inputs(self, model: nn.Module, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                             image_size: Optional[int] = None) -> Optional[Any]:
        """:meth:`example_inputs` at a requested size where the adapter can honour it (default: ignores it)."""
        return self.example_inputs(model)

    def notes(self, model: nn.Module) -> List[dict]:
        """Per converted module of ``model``: ``{"name": ..., ...}`` facts the report prints (default: none)."""
        return []

    # -- model-level adapters ----------------------------------------------------------------
    supports_module_filter: bool = False  # patch_model honours config.modules

    def claims_model(self, model: nn.Module) -> bool:
        return False

    def model_modules(self, model: nn.Module) -> List[Tuple[str, nn.Module]]:
        """The ``(qualified_name, module)`` attention modules a model-level patch covers."""
        return []

    def patch_model(self, model: nn.Module, config: PatchConfig) -> None:
        """Switch ``model`` over to ELSA attention as a whole (model-level adapters)."""

    def revert_model(self, model: nn.Module) -> None:
        """Undo :meth:`patch_model` exactly."""

    def library_available(self) -> bool:
        return self.library is None or importlib.util.find_spec(self.library) is not None

    def library_loaded(self) -> bool:
        """True when the library is imported: a model built from it can exist only then."""
        return self.library is None or self.library in sys.modules

    def __repr__(self) -> str:
        return f"<Adapter {self.name!r} ({self.library or 'torch'})>"


_LOCK = threading.RLock()
_REGISTRY: Dict[str, Adapter] = {}
_DISCOVERED = False


def _discover_builtin() -> None:
    global _DISCOVERED
    with _LOCK:
        if _DISCOVERED:
            return
        _DISCOVERED = True
        package = importlib.import_module("elsa_surgery.adapters")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if info.name.startswith("_"):
                continue
            mod = importlib.import_module(f"elsa_surgery.adapters.{info.name}")
            for adapter in getattr(mod, "ADAPTERS", ()):
                if adapter.name not in _REGISTRY:
                    _REGISTRY[adapter.name] = adapter


def register_adapter(adapter: Adapter, *, override: bool = False) -> Adapter:
    """Register a third-party adapter. Raises ValueError if the name is taken (unless ``override``)."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an elsa_surgery.Adapter instance, got {type(adapter).__name__}")
    if not adapter.name or not isinstance(adapter.name, str):
        raise ValueError("adapter.name must be a non-empty string")
    _discover_builtin()
    with _LOCK:
        if adapter.name in _REGISTRY and not override:
            raise ValueError(f"an adapter named {adapter.name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[adapter.name] = adapter
    return adapter


def unregister_adapter(name: str) -> None:
    _discover_builtin()
    with _LOCK:
        if name not in _REGISTRY:
            raise KeyError(f"no adapter named {name!r}; known: {', '.join(sorted(_REGISTRY))}")
        del _REGISTRY[name]


def list_adapters() -> List[str]:
    """Names of every registered adapter, built-in and third-party."""
    _discover_builtin()
    return sorted(_REGISTRY)


def get_adapter(name: str) -> Adapter:
    _discover_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; known adapters: {', '.join(sorted(_REGISTRY))}") from None


def model_adapter_for(model: nn.Module, adapters=None) -> Optional[Adapter]:
    """The first (registered, or listed in ``adapters``) model-level adapter whose library is loaded and that
    claims ``model`` as a whole (e.g. the one for transformers models), or None."""
    for a in resolve_adapters(adapters):
        if a.library_loaded() and a.claims_model(model):
            return a
    return None


def resolve_adapters(names=None) -> List[Adapter]:
    """The adapters to use: all registered ones, or those named (glob-free names or family prefixes)."""
    _discover_builtin()
    if names is None:
        return [_REGISTRY[n] for n in sorted(_REGISTRY)]
    if isinstance(names, (str, Adapter)):
        names = [names]
    out: List[Adapter] = []
    for n in names:
        if isinstance(n, Adapter):
            out.append(n)
            continue
        if not isinstance(n, str):
            raise TypeError(f"adapters must be names or Adapter instances, got {type(n).__name__}")
        family = [a for k, a in sorted(_REGISTRY.items()) if k == n or k.startswith(n + ".")]
        if not family:
            raise ValueError(f"unknown adapter {n!r}; known adapters: {', '.join(sorted(_REGISTRY))}")
        out.extend(a for a in family if a not in out)
    return out


# The one binding of a patched forward (kept importable from here for adapters written against the registry).
from .patching import bind_forward  # noqa: E402,F401  (patching imports this module: defined last)
