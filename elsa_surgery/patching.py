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

The patched ``forward`` is bound by a class swap: the module's class becomes :func:`patched_class` of it, a
subclass made once per (class, function) pair whose ``forward`` calls the function with the module's config. It
keeps the class's name, qualified name and module, so ``isinstance``, reports and ``repr`` see the original class;
``copy.deepcopy`` and ``pickle`` / ``torch.save`` rebuild it from the original class and the function (stored by
its qualified name), and :func:`elsa_surgery.revert` puts the original class back. ``torch.compile`` guards a
swapped module as it guards a native one (its class), where an instance ``forward`` made Dynamo trace and guard
``Module._call_impl`` for every patched module (session 48, ``benchmarks/lab/compile_gap.py``: +57 µs a compiled
12-block ViT call on a CPU; on an H200 compiled DeiT3-S bf16 b64 went from 0.965x native to 0.995x, ViT-B/16 bf16 b8
did not move). A module that already has an instance ``forward`` (an accelerate hook, another patch) keeps
precedence for it: it is bound there instead, by a :class:`BoundForward`. One public alias remains:
``module.elsa_native_calls`` is the record's ``native_calls`` dict (the same object), set while the module is
patched.

The config a patched forward passes on is the record's, also set on the module as :data:`CONFIG_ATTR`
(``_elsa_config``, through the record, so revert removes it) and read there as a plain attribute: a
:class:`PatchConfig` is a tuple of strings, which Dynamo's recursive dict tags count as immutable, so a compiled
model's guard check skips a patched module's subtree while its ``__dict__`` is unchanged, as it does for a native
one. Reading the record itself (a mutable object) made every patched module and the blocks above it fall out of that
fast path (session 49, H200, torch 2.11, compiled ViT-B/16: guard check 27 µs against native's 6.4; 10.9 after).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.nn as nn

from .registry import Adapter, PatchConfig

RECORD_ATTR = "_elsa_patch"
CONFIG_ATTR = "_elsa_config"  # the record's config on the patched module itself: what its forward reads
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
    cls: Optional[type] = None  # the module's class before bind_forward's class swap (None: not swapped)

    @property
    def adapter_name(self) -> Optional[str]:
        return None if self.adapter is None else self.adapter.name

    def set(self, module: nn.Module, name: str, value: Any) -> None:
        """Set an instance attribute of ``module``, remembering the value it had before (the first time)."""
        if name not in self.saved:
            self.saved[name] = module.__dict__.get(name, MISSING)
        module.__dict__[name] = value

    def restore(self, module: nn.Module) -> None:
        """Put back every instance attribute :meth:`set` changed, exactly as it was, and the class."""
        self.check_class(module)
        for name in reversed(list(self.saved)):
            old = self.saved.pop(name)
            if old is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
        if self.cls is not None:
            module.__class__, self.cls = self.cls, None

    def check_class(self, module: nn.Module) -> None:
        """Raise (before anything is undone) where the module's class was changed after the class swap (a
        ``torch.nn.utils.parametrize`` subclass of it, say): putting the original class back would drop that change."""
        if self.cls is not None and type(module).__dict__.get(BASE_CLASS_ATTR) is not self.cls:
            raise RuntimeError(f"cannot revert this {self.cls.__name__}: its class was changed after the conversion "
                               f"(now {type(module).__module__}.{type(module).__qualname__}); undo that change first")

    # -- copying and pickling: the adapter is shared, by its registered name where it has one ----------------
    def __deepcopy__(self, memo):
        new = PatchRecord(self.adapter, self.config, self.level)
        memo[id(self)] = new
        new.saved = copy.deepcopy(self.saved, memo)
        new.native_calls = copy.deepcopy(self.native_calls, memo)
        new.modules = self.modules
        new.extras = copy.deepcopy(self.extras, memo)
        new.cls = self.cls
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


_DEFAULT_CONFIG = PatchConfig()


def config_of(module: nn.Module) -> PatchConfig:
    """The config the module's patched forward passes on (:data:`CONFIG_ATTR`, the record's), or the default for a
    module without a record. A plain attribute read, which torch.compile traces without guarding the record."""
    return getattr(module, CONFIG_ATTR, _DEFAULT_CONFIG)


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
    rec.set(module, CONFIG_ATTR, config)
    return rec


def detach(module: nn.Module) -> Optional[PatchRecord]:
    """Restore what the record's :meth:`PatchRecord.set` changed and remove the record (no adapter call)."""
    rec = record_of(module)
    if rec is not None:
        rec.restore(module)
    module.__dict__.pop(RECORD_ATTR, None)
    return rec


class BoundForward:
    """``module.forward`` set on the instance, for a module that had an instance ``forward`` before it was patched
    (:func:`bind_forward`): ``fn(module, *args, config=<the module's CONFIG_ATTR>, **kwargs)``.

    A plain object (not a bound method, not a closure): ``copy.deepcopy`` binds the copy to the copied module,
    pickling stores ``fn`` by its qualified name (a module-level function), and ``torch.compile`` traces it.
    """

    __slots__ = ("fn", "module")

    def __init__(self, fn, module: nn.Module):
        self.fn = fn
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        return self.fn(module, *args, config=module._elsa_config, **kwargs)

    def __repr__(self) -> str:
        return f"<elsa_surgery forward {getattr(self.fn, '__qualname__', self.fn)} of {type(self.module).__name__}>"


FORWARD_FN_ATTR = "_elsa_forward_fn"  # on a patched class: the function its forward calls
BASE_CLASS_ATTR = "_elsa_base_class"  # on a patched class: the class it extends
_PATCHED: Dict[Tuple[type, Callable], type] = {}


def patched_class(base: type, fn) -> type:
    """The subclass of ``base`` whose ``forward(self, *args, **kwargs)`` is ``fn(self, *args, config=<the module's
    CONFIG_ATTR>, **kwargs)``: made once per ``(base, fn)`` pair, under ``base``'s name, qualified name and
    module. Instances pickle and deep-copy as ``(base, fn)`` and their state."""
    key = (base, fn)
    cls = _PATCHED.get(key)
    if cls is None:
        def forward(self, *args, **kwargs):
            return fn(self, *args, config=self._elsa_config, **kwargs)  # (CONFIG_ATTR: a plain attribute read)

        forward.__qualname__ = f"{base.__qualname__}.forward"
        forward.__doc__ = f"elsa_surgery's forward: {getattr(fn, '__qualname__', fn)} (the class's: {base.__name__})"
        ns = {"forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__,
              "__doc__": base.__doc__, "__reduce_ex__": _reduce_patched, FORWARD_FN_ATTR: fn, BASE_CLASS_ATTR: base}
        cls = _PATCHED[key] = type(base)(base.__name__, (base,), ns)
    return cls


def _reduce_patched(self, protocol):
    """``__reduce_ex__`` of a patched class: the default's state, rebuilt by :func:`_new_patched` from the original
    class and the function (a patched class is made at run time: pickle cannot name it)."""
    cls = type(self)
    rv = object.__reduce_ex__(self, max(int(protocol), 2))  # (copyreg.__newobj__, (cls,), state, ...)
    return (_new_patched, (cls.__dict__[BASE_CLASS_ATTR], cls.__dict__[FORWARD_FN_ATTR])) + tuple(rv[2:])


def _new_patched(base: type, fn):
    cls = patched_class(base, fn)
    return cls.__new__(cls)


def bind_forward(module: nn.Module, fn, config: PatchConfig) -> PatchRecord:
    """Make ``module``'s forward ``fn(module, *args, config=config, **kwargs)``.

    By a class swap (:func:`patched_class`), or, where the module has an instance ``forward`` already (an
    accelerate hook, another patch), by a :class:`BoundForward` set on the instance, which keeps that one's place
    (also for a class that refuses to be subclassed).
    Inside :func:`elsa_surgery.convert` the module already has its record (the adapter's ``patch`` runs after
    :func:`attach`); used on its own, ``bind_forward`` attaches one. The class, and any previous instance
    ``forward``, are kept in the record for :func:`unpatch_module`. Returns the record.
    """
    rec = record_of(module) or attach(module, None, config)
    rec.config = config
    rec.set(module, CONFIG_ATTR, config)
    cls = None
    if "forward" not in module.__dict__ and "forward" not in rec.saved:
        try:
            cls = patched_class(rec.cls or type(module), fn)
        except TypeError:  # a class that refuses subclasses (its __init_subclass__, its metaclass): the instance
            pass
    if cls is None:
        rec.set(module, "forward", BoundForward(fn, module))
    else:
        if rec.cls is None:
            rec.cls = type(module)
        module.__class__ = cls
    rec.set(module, NATIVE_CALLS_ATTR, rec.native_calls)
    return rec


def original_forward(module: nn.Module):
    """The callable the module ran before it was patched (its previous instance ``forward``, or the class's)."""
    rec = record_of(module)
    fwd = rec.saved.get("forward", MISSING) if rec is not None else MISSING
    if fwd is MISSING:
        cls = rec.cls if rec is not None and rec.cls is not None else type(module)
        return cls.forward.__get__(module)
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
    rec.check_class(module)
    try:
        if rec.adapter is not None:
            rec.adapter.unpatch(module)
    finally:
        detach(module)
    return rec
