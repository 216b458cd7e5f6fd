"""The one patch record: what a conversion leaves on a module, and the one way to bind and undo it.

Every patched module (and a model patched at model level) carries **one** :class:`PatchRecord` under
one attribute name, :data:`RECORD_ATTR` (``_elsa_patch``): the adapter, its :class:`PatchConfig`, every
instance attribute the patch set together with its previous value (restored exactly by
:func:`unpatch_module`), the native-call counts, and, for model-level patches, the modules covered.
:func:`bind_forward`, :func:`elsa_surgery.revert`, the report and :func:`is_converted` read only this record
(docs/design.md, "Adapters").

Levels:

* ``"module"``: a module patched by a per-module adapter (``Adapter.patch``), undone by :func:`unpatch_module`.
* ``"model"``: a model patched by a model-level adapter (``Adapter.patch_model``); ``modules`` holds the names
  of the attention modules it covers; undone by ``Adapter.revert_model`` and :func:`unpatch_module`.
* ``"part"``: a module that belongs to a model-level patch (transformers' attention modules, a wrapped
  ``PreTrainedModel``); the model-level adapter creates and removes it (:func:`attach`, :func:`detach`).

The patched ``forward`` is a :class:`BoundForward`, a small callable holding the function and the module:
``copy.deepcopy`` rebinds it to the copy, ``pickle`` / ``torch.save`` store the function by its qualified name
(a bound method would be pickled as ``getattr(module, fn.__name__)``, which fails), and ``torch.compile``
traces through it. One public alias remains: ``module.elsa_native_calls`` is the record's ``native_calls``
dict (the same object), set while the module is patched.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch.nn as nn

from .registry import Adapter, PatchConfig

RECORD_ATTR = "_elsa_patch"
NATIVE_CALLS_ATTR = "elsa_native_calls"  # public alias of PatchRecord.native_calls on a patched module
LEVELS = ("module", "model", "part")


class _Missing:
    """Marks an instance attribute that did not exist before the patch (so revert deletes it)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):
        return (_Missing, ())

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return "MISSING"


MISSING = _Missing()


@dataclass(eq=False)
class PatchRecord:
    """What one patch did to one module (or model), and how to undo it."""

    adapter: Optional[Adapter]  # None only for bind_forward used outside convert
    config: PatchConfig = field(default_factory=PatchConfig)
    level: str = "module"
    saved: Dict[str, Any] = field(default_factory=dict)  # instance attribute -> its value before (or MISSING)
    native_calls: Dict[str, int] = field(default_factory=dict)  # {reason: count} of calls run natively
    modules: Tuple[str, ...] = ()  # level "model": qualified names of the modules the patch covers
    extras: Dict[str, Any] = field(default_factory=dict)  # adapter-specific state (what else to restore)

    @property
    def adapter_name(self) -> Optional[str]:
        return None if self.adapter is None else self.adapter.name

    def set(self, module: nn.Module, name: str, value: Any) -> None:
        """Set an instance attribute of ``module``, remembering the value it had before (the first time)."""
        if name not in self.saved:
            self.saved[name] = module.__dict__.get(name, MISSING)
        module.__dict__[name] = value

    def restore(self, module: nn.Module) -> None:
        """Put back every instance attribute :meth:`set` changed, exactly as it was."""
        for name in reversed(list(self.saved)):
            old = self.saved.pop(name)
            if old is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old

    # -- copying and pickling: the adapter is shared, by its registered name where it has one ----------------
    def __deepcopy__(self, memo):
        new = PatchRecord(self.adapter, self.config, self.level)
        memo[id(self)] = new
        new.saved = copy.deepcopy(self.saved, memo)
        new.native_calls = copy.deepcopy(self.native_calls, memo)
        new.modules = self.modules
        new.extras = copy.deepcopy(self.extras, memo)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        a = self.adapter
        if a is not None and _registered(a):
            state["adapter"] = _AdapterName(a.name)
        return state

    def __setstate__(self, state):
        a = state.get("adapter")
        if isinstance(a, _AdapterName):
            state["adapter"] = a.resolve()
        self.__dict__.update(state)


@dataclass(frozen=True)
class _AdapterName:
    name: str

    def resolve(self) -> Adapter:
        from .registry import get_adapter

        try:
            return get_adapter(self.name)
        except ValueError as exc:
            raise ValueError(f"loading a converted model: its patch record names adapter {self.name!r}, which is not "
                             f"registered here (register it with elsa_surgery.register_adapter first)") from exc


def _registered(adapter: Adapter) -> bool:
    from .registry import _REGISTRY, _discover_builtin

    _discover_builtin()
    return _REGISTRY.get(adapter.name) is adapter


def record_of(module: nn.Module) -> Optional[PatchRecord]:
    """The module's patch record, or None."""
    rec = module.__dict__.get(RECORD_ATTR)
    return rec if isinstance(rec, PatchRecord) else None


def is_converted(module: nn.Module) -> bool:
    """True when ``module`` carries a patch record (a patched module, or a model patched at model level)."""
    return record_of(module) is not None


def config_of(module: nn.Module) -> PatchConfig:
    rec = record_of(module)
    return rec.config if rec is not None else PatchConfig()


def model_notes(model: nn.Module):
    """Per-module notes (``Adapter.notes``) of the adapter that patched ``model`` at model level, else ``[]``."""
    rec = record_of(model)
    if rec is None or rec.level != "model" or rec.adapter is None:
        return []
    return rec.adapter.notes(model)


def attach(module: nn.Module, adapter: Optional[Adapter], config: PatchConfig, level: str = "module",
           modules: Tuple[str, ...] = ()) -> PatchRecord:
    """Put a new record on ``module`` (it must have none). Model-level adapters use ``level="part"``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if RECORD_ATTR in module.__dict__:
        raise RuntimeError(f"{type(module).__name__} is already patched (by {record_of(module).adapter_name})")
    rec = PatchRecord(adapter, config, level, modules=tuple(modules))
    module.__dict__[RECORD_ATTR] = rec
    return rec


def detach(module: nn.Module) -> Optional[PatchRecord]:
    """Restore what the record's :meth:`PatchRecord.set` changed and remove the record (no adapter call)."""
    rec = module.__dict__.pop(RECORD_ATTR, None)
    if isinstance(rec, PatchRecord):
        rec.restore(module)
    return rec


class BoundForward:
    """``module.forward`` of a patched module: ``fn(module, *args, config=<record's config>, **kwargs)``.

    A plain object (not a bound method, not a closure): ``copy.deepcopy`` binds the copy to the copied module,
    pickling stores ``fn`` by its qualified name (a module-level function), and ``torch.compile`` traces it.
    """

    __slots__ = ("fn", "module")

    def __init__(self, fn, module: nn.Module):
        self.fn = fn
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        return self.fn(module, *args, config=module.__dict__[RECORD_ATTR].config, **kwargs)

    def __repr__(self) -> str:
        return f"<elsa_surgery forward {getattr(self.fn, '__qualname__', self.fn)} of {type(self.module).__name__}>"


def bind_forward(module: nn.Module, fn, config: PatchConfig) -> PatchRecord:
    """Set ``module.forward`` on the instance to ``fn(module, *args, config=config, **kwargs)``.

    Inside :func:`elsa_surgery.convert` the module already has its record (the adapter's ``patch`` runs after
    :func:`attach`); used on its own, ``bind_forward`` attaches one. The class's ``forward`` and any previous
    instance ``forward`` are kept in the record for :func:`unpatch_module`. Returns the record.
    """
    rec = record_of(module) or attach(module, None, config)
    rec.config = config
    rec.set(module, "forward", BoundForward(fn, module))
    rec.set(module, NATIVE_CALLS_ATTR, rec.native_calls)
    return rec


def original_forward(module: nn.Module):
    """The callable the module ran before it was patched (its previous instance ``forward``, or the class's)."""
    rec = record_of(module)
    fwd = rec.saved.get("forward", MISSING) if rec is not None else MISSING
    if fwd is MISSING:
        return type(module).forward.__get__(module)
    return fwd


def patch_module(module: nn.Module, adapter: Adapter, config: PatchConfig) -> PatchRecord:
    """Attach a record and let ``adapter.patch`` fill it; on failure the module is left as it was."""
    rec = attach(module, adapter, config)
    try:
        adapter.patch(module, config)
    except BaseException:
        unpatch_module(module)
        raise
    return rec


def unpatch_module(module: nn.Module) -> PatchRecord:
    """Undo a ``"module"``-level patch: the adapter's ``unpatch`` (anything beyond instance attributes), then
    every attribute the record saved, then the record itself."""
    rec = record_of(module)
    if rec is None:
        raise ValueError(f"{type(module).__name__} is not patched")
    try:
        if rec.adapter is not None:
            rec.adapter.unpatch(module)
    finally:
        detach(module)
    return rec
