"""Model surgery: :func:`convert` swaps the attention of a model in place, :func:`revert` undoes it.

``convert`` walks the model once. Model-level adapters (``Adapter.claims_model``) are asked first; then
every module is offered to the selected per-module adapters in name order (``Adapter.matches``, exact
classes). A matched module, subject to ``include`` / ``exclude`` and the adapter's ``skip_reason``, has
its ``forward`` rebound on the instance by ``Adapter.patch``; its parameters, buffers and state-dict keys
are never touched. The framework keeps what is needed to undo it in a :class:`PatchRecord` on the
instance (attribute ``_elsa_patch``, not part of the state dict), so a module that is already converted is
recognised (idempotence) and :func:`revert` restores the exact original ``forward``.

With ``verify=True`` the model runs on example inputs before and after the swap
(:class:`elsa_surgery.verify.ParityCheck`); on disagreement every module converted by the call is
restored and :class:`elsa_surgery.verify.ParityError` names the worst module.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch.nn as nn

from . import dispatch
from .registry import CONFIG_ATTR, Adapter, PatchConfig, get_adapter, list_adapters, resolve_adapters
from .report import ALREADY, CONVERTED, SKIPPED, ConversionReport, ModuleEntry, ParityResult
from .verify import ParityCheck, ParityError, check_inputs, failure_message

logger = logging.getLogger("elsa_surgery")

PATCH_ATTR = "_elsa_patch"  # on a converted module: its PatchRecord
MODEL_ATTR = "_elsa_model_patches"  # on a model converted by model-level adapters: {adapter name: ModelPatch}

# Class names that look like attention: such modules are reported as skipped when no adapter knows them.
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


@dataclass
class PatchRecord:
    """How to undo one module's conversion."""

    adapter: Adapter
    config: PatchConfig
    had_forward: bool  # the instance already had its own ``forward`` attribute before conversion
    forward: Any = None  # that attribute (restored as is)
    had_config: bool = False  # the instance already had a bind_forward config attribute

    def __deepcopy__(self, memo):  # a deep-copied converted model stays revertible; adapters are shared
        return PatchRecord(self.adapter, self.config, self.had_forward, copy.deepcopy(self.forward, memo),
                           self.had_config)


@dataclass
class ModelPatch:
    adapter: Adapter
    config: PatchConfig
    modules: Tuple[str, ...] = ()

    def __deepcopy__(self, memo):
        return ModelPatch(self.adapter, self.config, self.modules)


def is_converted(module: nn.Module) -> bool:
    """True when ``module`` (or, for model-level adapters, the model) is converted."""
    return PATCH_ATTR in module.__dict__ or bool(module.__dict__.get(MODEL_ATTR))


def looks_like_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or bool(_ATTENTION_NAME.search(type(module).__name__))


def _qualname(module: nn.Module) -> str:
    t = type(module)
    return f"{t.__module__}.{t.__qualname__}"


# --------------------------------------------------------------------------------------------------
# argument checks (before anything is touched)
# --------------------------------------------------------------------------------------------------

def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _globs(name: str, value) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    try:
        value = list(value)
    except TypeError:
        raise TypeError(f"{name} must be a module-name glob or a list of globs, got {type(value).__name__}") from None
    for g in value:
        if not isinstance(g, str):
            raise TypeError(f"{name} must hold strings (module-name globs such as 'blocks.*.attn'), "
                            f"got {type(g).__name__}")
    return value


def _check_tol(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")


def _selected(name: str, include: Optional[List[str]], exclude: Optional[List[str]]) -> bool:
    """A glob selects a module when it matches its name or the name of one of its ancestors."""
    parts = name.split(".") if name else [""]
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    def hit(globs):
        return any(fnmatch.fnmatchcase(p, g) for g in globs for p in prefixes)

    if include is not None and not hit(include):
        return False
    if exclude is not None and hit(exclude):
        return False
    return True


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


# --------------------------------------------------------------------------------------------------
# patching / unpatching one module
# --------------------------------------------------------------------------------------------------

def _patch_module(module: nn.Module, adapter: Adapter, config: PatchConfig) -> None:
    record = PatchRecord(adapter, config, "forward" in module.__dict__, module.__dict__.get("forward"),
                         CONFIG_ATTR in module.__dict__)
    adapter.patch(module, config)
    module.__dict__[PATCH_ATTR] = record


def _unpatch_module(module: nn.Module) -> None:
    record: PatchRecord = module.__dict__[PATCH_ATTR]
    try:
        record.adapter.unpatch(module)
    finally:
        if record.had_forward:
            module.__dict__["forward"] = record.forward
        else:
            module.__dict__.pop("forward", None)
        if not record.had_config:
            module.__dict__.pop(CONFIG_ATTR, None)
        del module.__dict__[PATCH_ATTR]


# --------------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------------

def convert(
    model: nn.Module,
    *,
    backend: str = "auto",
    precision: Optional[str] = None,
    adapters=None,
    include=None,
    exclude=None,
    verify=True,
    example_inputs: Any = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
) -> ConversionReport:
    """Swap every recognised attention module of ``model`` for ELSA attention, in place.

    Args:
        model: any ``torch.nn.Module``.
        backend: what the patched modules pass to :func:`elsa_surgery.attention` (``"auto"`` | ``"elsa"`` |
            ``"reference"`` | ``"sdpa"``); ``"auto"`` also honours ``ELSA_BACKEND`` at call time.
        precision: fp32 mode (``"strict"`` | ``"precise"`` | ``"turbo"``), or None for the default.
        adapters: adapter names (a family prefix such as ``"timm"`` selects all ``timm.*``) or
            :class:`Adapter` instances; None = every registered adapter.
        include, exclude: module-name globs (``fnmatch``); a glob matching an ancestor's name also
            selects its descendants (``include="blocks.0"`` selects ``blocks.0.attn``).
        verify: run the model before and after on example inputs and compare (see :mod:`.verify`); ``"grad"``
            also compares the parameter gradients of a loss on those inputs (dropout off).
        example_inputs: a tensor (``model(x)``), a tuple/list (``model(*x)``) or a dict (``model(**x)``);
            default: the first selected adapter's ``example_inputs(model)``.
        rtol, atol: override the dtype-aware tolerances of the parity check.

    Returns:
        A :class:`ConversionReport`. Converting an already converted model changes nothing (the modules are
        listed as already converted).

    Raises:
        TypeError / ValueError for bad arguments (nothing is touched); ParityError when the converted model
        disagrees with the original (every module converted by this call is restored first).
    """
    _check_model(model)
    dispatch._check_choice("backend", backend, dispatch.BACKENDS)
    if precision is not None:
        dispatch._check_choice("precision", precision, dispatch.PRECISIONS)
    include = _globs("include", include)
    exclude = _globs("exclude", exclude)
    _check_tol("rtol", rtol)
    _check_tol("atol", atol)
    if not (isinstance(verify, bool) or verify == "grad"):
        raise TypeError(f"verify must be True, False or 'grad', got {verify!r}")
    if example_inputs is not None:
        check_inputs(example_inputs)
    chosen = resolve_adapters(adapters)
    explicit = adapters is not None
    config = PatchConfig(backend=backend, precision=precision)
    report = ConversionReport(model=type(model).__name__, backend=backend, precision=precision)

    plan: List[Tuple[str, nn.Module, Adapter]] = []
    model_plans: List[Tuple[Adapter, PatchConfig, List[Tuple[str, nn.Module]]]] = []
    handled: List[str] = []  # names whose subtree belongs to an adapter (converted, skipped or covered)

    # 1. model-level adapters
    model_state: Dict[str, ModelPatch] = model.__dict__.get(MODEL_ATTR, {})
    for a in chosen:
        if not a.library_loaded():
            continue
        if a.name in model_state:
            for n in model_state[a.name].modules:
                m = model.get_submodule(n)
                report.already_converted.append(ModuleEntry(n, _qualname(m), ALREADY, a.name))
                handled.append(n)
            continue
        if not a.claims_model(model):
            continue
        covered = list(a.model_modules(model))
        sel = [(n, m) for n, m in covered if _selected(n, include, exclude)]
        if covered and not sel:
            for n, m in covered:
                report.skipped.append(ModuleEntry(n, _qualname(m), SKIPPED, a.name, "excluded by include/exclude"))
            handled.extend(n for n, _ in covered)
            continue
        if len(sel) < len(covered) and not a.supports_module_filter:
            why = (f"model-level adapter {a.name} patches all {len(covered)} of its modules at once; "
                   f"include/exclude selected only {len(sel)}")
            for n, m in covered:
                report.skipped.append(ModuleEntry(n, _qualname(m), SKIPPED, a.name, why))
            handled.extend(n for n, _ in covered)
            continue
        mcfg = config if len(sel) == len(covered) else PatchConfig(
            backend, precision, modules=frozenset(n for n, _ in sel))
        model_plans.append((a, mcfg, sel))
        handled.extend(n for n, _ in covered)
        for n, m in covered:
            if (n, m) not in sel:
                report.skipped.append(ModuleEntry(n, _qualname(m), SKIPPED, a.name, "excluded by include/exclude"))

    # 2. per-module adapters
    per_module = [a for a in chosen if a.library_loaded()]
    attention_like: List[Tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if _under(name, handled):
            continue
        rec = m.__dict__.get(PATCH_ATTR)
        if rec is not None:
            report.already_converted.append(ModuleEntry(
                name, _qualname(m), ALREADY, rec.adapter.name,
                None if rec.config == config else
                f"kept its configuration (backend={rec.config.backend}, precision={rec.config.precision}); "
                f"revert first to change it"))
            handled.append(name)
            continue
        adapter = next((a for a in per_module if a.matches(m)), None)
        if adapter is None:
            if looks_like_attention(m):
                attention_like.append((name, m))
            continue
        handled.append(name)
        if not _selected(name, include, exclude):
            report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, adapter.name, "excluded by include/exclude"))
            continue
        why = adapter.skip_reason(m, config)
        if why:
            report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, adapter.name, why))
            continue
        plan.append((name, m, adapter))

    # 3. attention-looking modules nobody converts: told, not ignored
    for name, m in attention_like:
        if _under(name, handled) or any(h.startswith(name + ".") or name == "" for h in handled):
            continue  # inside or around a module an adapter handles
        report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, None, _unknown_reason(m, chosen, explicit)))

    for n, m, a in plan:
        report.converted.append(ModuleEntry(n, _qualname(m), CONVERTED, a.name))
    for a, _, sel in model_plans:
        report.model_adapters.append(a.name)
        for n, m in sel:
            report.converted.append(ModuleEntry(n, _qualname(m), CONVERTED, a.name))

    if not plan and not model_plans:
        report.parity = ParityResult(verified=False, reason="no module was converted by this call") if verify else None
        logger.info("%s", report)
        return report

    # 4. the reference run (before anything changes)
    check = None
    if verify:
        inputs, source = example_inputs, "user"
        if inputs is None:
            # the converting adapters first, then any other registered adapter that recognises the model
            inputs, source = _adapter_inputs(
                model, [a for a, _, _ in model_plans] + [a for _, _, a in plan]
                + [a for a in resolve_adapters(None) if a.library_loaded()], report)
        if inputs is None:
            report.parity = ParityResult(
                verified=False, reason="no example inputs: no selected adapter could build them; pass example_inputs=")
            logger.warning("elsa_surgery: converted %s without parity verification: no example inputs "
                           "(pass example_inputs=)", type(model).__name__)
        else:
            watched = {n: m for n, m, _ in plan}
            for _, _, sel in model_plans:
                watched.update(sel)
            check = ParityCheck(model, inputs, watched, inputs_source=source, rtol=rtol, atol=atol,
                                precision=dispatch.requested_precision(precision), grad=verify == "grad")
            try:
                check.reference()  # nothing has been changed yet
            except Exception as exc:
                if source == "user":
                    raise ValueError(f"example_inputs: the original (unconverted) model fails on them "
                                     f"({type(exc).__name__}: {exc}); nothing was changed") from exc
                check = None
                report.parity = ParityResult(verified=False, reason=(
                    f"the example inputs of {source} fail on the original model ({type(exc).__name__}: {exc}); "
                    f"pass example_inputs="))
                logger.warning("elsa_surgery: converted %s without parity verification: %s",
                               type(model).__name__, report.parity.reason)

    # 5. patch
    done_modules: List[nn.Module] = []
    done_models: List[Adapter] = []

    def rollback() -> int:
        for a in reversed(done_models):
            a.revert_model(model)
            model.__dict__[MODEL_ATTR].pop(a.name, None)
        if not model.__dict__.get(MODEL_ATTR, True):
            del model.__dict__[MODEL_ATTR]
        for m in reversed(done_modules):
            _unpatch_module(m)
        return len(done_modules) + sum(len(s) for _, _, s in model_plans[:len(done_models)])

    try:
        for a, mcfg, sel in model_plans:
            a.patch_model(model, mcfg)
            done_models.append(a)
            model.__dict__.setdefault(MODEL_ATTR, {})[a.name] = ModelPatch(a, mcfg, tuple(n for n, _ in sel))
        for n, m, a in plan:
            try:
                _patch_module(m, a, config)
            except Exception as exc:
                raise RuntimeError(f"adapter {a.name} failed to patch module {n!r} ({_qualname(m)}): {exc}") from exc
            done_modules.append(m)
    except BaseException:
        rollback()
        raise

    # 6. the converted run
    if check is not None:
        try:
            result, errors = check.converted()
        except ParityError as exc:
            restored = rollback()
            exc.report = report
            raise ParityError(f"{exc} All {restored} module(s) converted by this call were restored.",
                              report=report) from exc
        except Exception as exc:
            restored = rollback()
            raise ParityError(f"the converted model failed on the example inputs ({type(exc).__name__}: {exc}); "
                              f"all {restored} module(s) converted by this call were restored", report=report) from exc
        report.parity = result
        report.backends_used, report.fallbacks, report.dispatch_reasons = check.dispatch_summary()
        for e in report.converted:
            err = errors.get(e.name)
            if err is None:
                continue
            if "error" in err:
                report.notes.append(f"{e.name}: module-level parity not measured (replaying its captured inputs "
                                    f"failed: {err['error']})")
            else:
                e.max_abs_err, e.rel_err = err["max_abs"], err["rel"]
        if not result.passed:
            restored = rollback()
            msg = failure_message(result, errors, report.converted, restored)
            raise ParityError(msg, module=result.worst_module, error=result.worst_module_rel_err,
                              max_abs_err=result.max_abs_err, rel_err=result.rel_err, report=report)
    elif verify is False:
        report.parity = None
    for r in report.fallbacks:
        logger.warning("elsa_surgery: fallback during verification: %s", r)
    logger.info("%s", report)
    return report


def _unknown_reason(m: nn.Module, chosen: Sequence[Adapter], explicit: bool) -> str:
    if explicit:
        others = [n for n in list_adapters() if get_adapter(n) not in chosen]
        for n in others:
            a = get_adapter(n)
            try:
                if a.library_loaded() and a.matches(m):
                    return f"adapter {n} knows {type(m).__name__} but was not selected (adapters=...)"
            except Exception:  # a foreign adapter's matches() must not break the report
                continue
    return f"no registered adapter knows {_qualname(m)} (register one with elsa_surgery.register_adapter)"


def _adapter_inputs(model: nn.Module, adapters: Sequence[Adapter], report: ConversionReport):
    seen = []
    for a in adapters:
        if a in seen:
            continue
        seen.append(a)
        try:
            x = a.example_inputs(model)
        except Exception as exc:
            report.notes.append(f"adapter {a.name} could not build example inputs: {type(exc).__name__}: {exc}")
            continue
        if x is not None:
            return x, f"adapter {a.name}"
    return None, None


# --------------------------------------------------------------------------------------------------
# revert
# --------------------------------------------------------------------------------------------------

def revert(model: nn.Module) -> List[str]:
    """Restore the exact original ``forward`` of every converted module (and undo model-level patches).

    Returns the names of the modules restored; outputs are then bit-identical to the never-converted
    model. Reverting a model that is not converted does nothing.
    """
    _check_model(model)
    restored: List[str] = []
    state: Dict[str, ModelPatch] = model.__dict__.get(MODEL_ATTR, {})
    for name in list(state)[::-1]:
        mp = state[name]
        mp.adapter.revert_model(model)
        restored.extend(mp.modules)
        del state[name]
    model.__dict__.pop(MODEL_ATTR, None)
    for name, m in model.named_modules():
        if PATCH_ATTR in m.__dict__:
            _unpatch_module(m)
            restored.append(name)
        if name and m.__dict__.get(MODEL_ATTR):  # a submodule converted on its own by a model-level adapter
            restored.extend(f"{name}.{n}" for n in revert(m))
    return restored
