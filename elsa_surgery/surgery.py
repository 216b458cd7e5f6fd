"""Model surgery: :func:`convert` swaps the attention of a model in place, :func:`revert` undoes it.

``convert`` is a short list of named steps (docs/design.md, "Adapters" and "Parity contract"):

1. :func:`unwrap`: see through the wrappers users hold (``torch.compile``'s ``OptimizedModule``,
   ``nn.DataParallel`` / ``DistributedDataParallel``, PEFT's ``PeftModel``) to the model they wrap.
2. :func:`find`: model-level adapters (``Adapter.claims_model``) first, then every module offered to the
   selected per-module adapters in name order (``Adapter.matches``, exact classes), subject to ``include`` /
   ``exclude`` and ``skip_reason``; attention-looking modules nobody converts are reported. Gives a :class:`Plan`.
3. :func:`reference_run`: the model on example inputs before anything changes (``verify=True``).
4. :func:`patch`: every planned module gets its patch record (:mod:`elsa_surgery.patching`) and its adapter's
   ``patch``; model-level adapters get the model's record and ``patch_model``. Parameters, buffers and
   state-dict keys are never touched. Returns a :class:`Patched` that can roll everything back.
5. :func:`verify_run`: the converted model on the same inputs; on disagreement every module converted by the
   call is restored (keep or revert) and :class:`elsa_surgery.verify.ParityError` names the worst module.

:func:`revert` reads only the patch records and restores the exact original ``forward`` of every module.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch.nn as nn

from . import dispatch
from .patching import RECORD_ATTR, attach, detach, is_converted, patch_module, record_of, unpatch_module
from .registry import Adapter, PatchConfig, get_adapter, list_adapters, resolve_adapters
from .report import ALREADY, CONVERTED, SKIPPED, ConversionReport, ModuleEntry, ParityResult
from .verify import ParityCheck, ParityError, check_inputs, failure_message

logger = logging.getLogger("elsa_surgery")

PATCH_ATTR = RECORD_ATTR  # the patch record a conversion leaves on a module (elsa_surgery.patching)

# Class names that look like attention: such modules are reported as skipped when no adapter knows them.
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)

__all__ = ["convert", "revert", "is_converted", "unwrap", "find", "reference_run", "patch", "verify_run", "Plan",
           "Patched"]


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


def _check_arguments(model, backend, precision, include, exclude, verify, example_inputs, rtol, atol):
    """Every argument checked before anything is touched; returns the include / exclude glob lists."""
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
    return include, exclude


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


def _under(name: str, prefixes) -> bool:
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


# --------------------------------------------------------------------------------------------------
# step 1: the wrappers users hold
# --------------------------------------------------------------------------------------------------

def _is_compiled(model) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(eval_frame, "OptimizedModule", None)
    return cls is not None and isinstance(model, cls) and isinstance(getattr(model, "_orig_mod", None), nn.Module)


def _is_data_parallel(model) -> bool:
    return isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def _is_peft(model) -> bool:
    """A PEFT ``PeftModel`` (found by its package and ``get_base_model``: peft is never imported here)."""
    return type(model).__module__.split(".")[0] == "peft" and callable(getattr(model, "get_base_model", None))


def unwrap(model: nn.Module) -> Tuple[nn.Module, List[str]]:
    """The model inside the wrappers users hold, and the wrappers seen (outermost first).

    ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), ``nn.DataParallel`` / ``DistributedDataParallel``
    (``module``) and PEFT's ``PeftModel`` (``get_base_model()``), in any nesting. The wrapped model's modules are
    the wrapper's own, so patching them converts the wrapper too; the parity check runs the wrapped model
    eagerly (for a compiled model: the eager reference the compiled graph must match).
    """
    seen: List[str] = []
    while True:
        if _is_compiled(model):
            seen.append("OptimizedModule")
            model = model._orig_mod
        elif _is_data_parallel(model):
            seen.append(type(model).__name__)
            model = model.module
        elif _is_peft(model):
            inner = model.get_base_model()
            if inner is model or not isinstance(inner, nn.Module):
                break
            seen.append(type(model).__name__)
            model = inner
        else:
            return model, seen


# --------------------------------------------------------------------------------------------------
# step 2: find
# --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What :func:`find` decided: the modules to patch, the model-level patches, and the report so far."""

    report: ConversionReport
    modules: List[Tuple[str, nn.Module, Adapter]] = field(default_factory=list)
    model_level: List[Tuple[Adapter, PatchConfig, List[Tuple[str, nn.Module]]]] = field(default_factory=list)
    handled: List[str] = field(default_factory=list)  # names whose subtree belongs to an adapter

    @property
    def empty(self) -> bool:
        return not self.modules and not self.model_level

    def watched(self) -> dict:
        """Every module this plan converts, by name (for the per-module parity check)."""
        out = {n: m for n, m, _ in self.modules}
        for _, _, sel in self.model_level:
            out.update(sel)
        return out

    def adapters(self) -> List[Adapter]:
        return [a for a, _, _ in self.model_level] + [a for _, _, a in self.modules]


def _find_model_level(model, plan: Plan, chosen, config: PatchConfig, include, exclude) -> None:
    report = plan.report
    rec = record_of(model)
    for a in chosen:
        if not a.library_loaded():
            continue
        if rec is not None and rec.level == "model" and rec.adapter_name == a.name:
            for n in rec.modules:
                m = model.get_submodule(n)
                report.already_converted.append(ModuleEntry(n, _qualname(m), ALREADY, a.name))
                plan.handled.append(n)
            continue
        if not a.claims_model(model):
            continue
        covered = list(a.model_modules(model))
        sel = [(n, m) for n, m in covered if _selected(n, include, exclude)]
        if covered and not sel:
            _skip_all(plan, covered, a, "excluded by include/exclude")
            continue
        if len(sel) < len(covered) and not a.supports_module_filter:
            _skip_all(plan, covered, a, f"model-level adapter {a.name} patches all {len(covered)} of its modules at "
                                        f"once; include/exclude selected only {len(sel)}")
            continue
        if rec is not None or any(x is not a for x, _, _ in plan.model_level):
            holder = rec.adapter_name if rec is not None else plan.model_level[0][0].name
            _skip_all(plan, covered, a, f"the model is already patched at model level by {holder}")
            continue
        mcfg = config if len(sel) == len(covered) else PatchConfig(
            config.backend, config.precision, modules=tuple(sorted(n for n, _ in sel)))
        plan.model_level.append((a, mcfg, sel))
        plan.handled.extend(n for n, _ in covered)
        for n, m in covered:
            if (n, m) not in sel:
                report.skipped.append(ModuleEntry(n, _qualname(m), SKIPPED, a.name, "excluded by include/exclude"))


def _skip_all(plan: Plan, covered, adapter: Adapter, why: str) -> None:
    for n, m in covered:
        plan.report.skipped.append(ModuleEntry(n, _qualname(m), SKIPPED, adapter.name, why))
    plan.handled.extend(n for n, _ in covered)


def _find_modules(model, plan: Plan, chosen, config: PatchConfig, include, exclude) -> List[Tuple[str, nn.Module]]:
    """The per-module walk; returns the attention-looking modules no adapter matched."""
    report = plan.report
    per_module = [a for a in chosen if a.library_loaded()]
    attention_like: List[Tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if _under(name, plan.handled):
            continue
        rec = record_of(m)
        if rec is not None and rec.level == "module":
            report.already_converted.append(ModuleEntry(
                name, _qualname(m), ALREADY, rec.adapter_name,
                None if rec.config == config else
                f"kept its configuration (backend={rec.config.backend}, precision={rec.config.precision}); "
                f"revert first to change it"))
            plan.handled.append(name)
            continue
        adapter = next((a for a in per_module if a.matches(m)), None)
        if adapter is None:
            if looks_like_attention(m):
                attention_like.append((name, m))
            continue
        plan.handled.append(name)
        if not _selected(name, include, exclude):
            report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, adapter.name, "excluded by include/exclude"))
            continue
        why = adapter.skip_reason(m, config)
        if why:
            report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, adapter.name, why))
            continue
        plan.modules.append((name, m, adapter))
    return attention_like


def find(model: nn.Module, chosen: Sequence[Adapter], config: PatchConfig, *, include=None, exclude=None,
         explicit: bool = False, report: Optional[ConversionReport] = None) -> Plan:
    """Step 2: what to convert in ``model`` (nothing is changed). ``explicit``: the adapters were named by the user
    (the report then says which unselected adapter knows a skipped module)."""
    include, exclude = _globs("include", include), _globs("exclude", exclude)
    plan = Plan(report or ConversionReport(model=type(model).__name__, backend=config.backend,
                                           precision=config.precision))
    _find_model_level(model, plan, chosen, config, include, exclude)
    attention_like = _find_modules(model, plan, chosen, config, include, exclude)
    for name, m in attention_like:  # attention-looking modules nobody converts: told, not ignored
        if _under(name, plan.handled) or any(h.startswith(name + ".") or name == "" for h in plan.handled):
            continue  # inside or around a module an adapter handles
        plan.report.skipped.append(ModuleEntry(name, _qualname(m), SKIPPED, None,
                                               _unknown_reason(m, chosen, explicit)))
    for n, m, a in plan.modules:
        plan.report.converted.append(ModuleEntry(n, _qualname(m), CONVERTED, a.name))
    for a, _, sel in plan.model_level:
        plan.report.model_adapters.append(a.name)
        for n, m in sel:
            plan.report.converted.append(ModuleEntry(n, _qualname(m), CONVERTED, a.name))
    return plan


# --------------------------------------------------------------------------------------------------
# step 3: the reference run
# --------------------------------------------------------------------------------------------------

def reference_run(model: nn.Module, plan: Plan, *, example_inputs=None, precision=None, rtol=None,
                  atol=None, grad: bool = False) -> Optional[ParityCheck]:
    """Run the unconverted model on example inputs (the user's, else the first adapter that can build them: the
    converting adapters first, then every registered one). None, with the reason in the report, when it cannot."""
    report = plan.report
    inputs, source = example_inputs, "user"
    if inputs is None:
        inputs, source = _adapter_inputs(model, plan.adapters() + [a for a in resolve_adapters(None)
                                                                  if a.library_loaded()], report)
    if inputs is None:
        report.parity = ParityResult(
            verified=False, reason="no example inputs: no selected adapter could build them; pass example_inputs=")
        logger.warning("elsa_surgery: converted %s without parity verification: no example inputs "
                       "(pass example_inputs=)", type(model).__name__)
        return None
    check = ParityCheck(model, inputs, plan.watched(), inputs_source=source, rtol=rtol, atol=atol,
                        precision=dispatch.requested_precision(precision), grad=grad)
    try:
        check.reference()  # nothing has been changed yet
    except Exception as exc:
        if source == "user":
            raise ValueError(f"example_inputs: the original (unconverted) model fails on them "
                             f"({type(exc).__name__}: {exc}); nothing was changed") from exc
        report.parity = ParityResult(verified=False, reason=(
            f"the example inputs of {source} fail on the original model ({type(exc).__name__}: {exc}); "
            f"pass example_inputs="))
        logger.warning("elsa_surgery: converted %s without parity verification: %s",
                       type(model).__name__, report.parity.reason)
        return None
    return check


# --------------------------------------------------------------------------------------------------
# step 4: patch (and roll back)
# --------------------------------------------------------------------------------------------------

@dataclass
class Patched:
    """What :func:`patch` changed, so that :meth:`rollback` can undo exactly that."""

    model: nn.Module
    plan: Plan
    modules: List[nn.Module] = field(default_factory=list)
    models: List[Adapter] = field(default_factory=list)

    def rollback(self) -> int:
        """Undo everything this call patched (model-level first, then modules in reverse); returns the count."""
        for a in reversed(self.models):
            try:
                a.revert_model(self.model)
            finally:
                detach(self.model)
        for m in reversed(self.modules):
            unpatch_module(m)
        n = len(self.modules) + sum(len(s) for _, _, s in self.plan.model_level[:len(self.models)])
        self.modules, self.models = [], []
        return n


def patch(model: nn.Module, plan: Plan, config: PatchConfig) -> Patched:
    """Step 4: apply the plan. On any failure, what was patched so far is restored and the error re-raised."""
    done = Patched(model, plan)
    try:
        for a, mcfg, sel in plan.model_level:
            attach(model, a, mcfg, level="model", modules=tuple(n for n, _ in sel))
            try:
                a.patch_model(model, mcfg)
            except BaseException:
                detach(model)
                raise
            done.models.append(a)
        for n, m, a in plan.modules:
            try:
                patch_module(m, a, config)
            except Exception as exc:
                raise RuntimeError(f"adapter {a.name} failed to patch module {n!r} ({_qualname(m)}): {exc}") from exc
            done.modules.append(m)
    except BaseException:
        done.rollback()
        raise
    return done


# --------------------------------------------------------------------------------------------------
# step 5: verify (keep or revert)
# --------------------------------------------------------------------------------------------------

def verify_run(check: ParityCheck, done: Patched, report: ConversionReport) -> None:
    """Run the converted model and compare; on failure roll back and raise :class:`ParityError`."""
    try:
        result, errors = check.converted()
    except ParityError as exc:
        restored = done.rollback()
        exc.report = report
        raise ParityError(f"{exc} All {restored} module(s) converted by this call were restored.",
                          report=report) from exc
    except Exception as exc:
        restored = done.rollback()
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
        restored = done.rollback()
        msg = failure_message(result, errors, report.converted, restored)
        raise ParityError(msg, module=result.worst_module, error=result.worst_module_rel_err,
                          max_abs_err=result.max_abs_err, rel_err=result.rel_err, report=report)


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
        model: any ``torch.nn.Module``, or one held in a wrapper (``torch.compile``'s ``OptimizedModule``,
            ``nn.DataParallel`` / ``DistributedDataParallel``, PEFT's ``PeftModel``): the wrapped model is
            converted and verified (:func:`unwrap`); module names in the report are the wrapped model's.
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
    include, exclude = _check_arguments(model, backend, precision, include, exclude, verify, example_inputs,
                                        rtol, atol)
    chosen = resolve_adapters(adapters)
    config = PatchConfig(backend=backend, precision=precision)
    model, wrappers = unwrap(model)
    plan = find(model, chosen, config, include=include, exclude=exclude, explicit=adapters is not None)
    report = plan.report
    if wrappers:
        report.notes.append(f"converted the model inside {' > '.join(wrappers)}")
    if plan.empty:
        report.parity = ParityResult(verified=False, reason="no module was converted by this call") if verify else None
        logger.info("%s", report)
        return report
    check = reference_run(model, plan, example_inputs=example_inputs, precision=precision, rtol=rtol,
                          atol=atol, grad=verify == "grad") if verify else None
    done = patch(model, plan, config)
    if check is not None:
        verify_run(check, done, report)
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

    Reads only the patch records (:mod:`elsa_surgery.patching`); sees through the same wrappers as
    :func:`convert`. Returns the names of the modules restored; outputs are then bit-identical to the
    never-converted model. Reverting a model that is not converted does nothing.

    Raises:
        RuntimeError, before anything is restored, where a converted module's class was changed after the
        conversion (a ``torch.nn.utils.parametrize`` subclass, say): putting its class back would drop that change.
    """
    _check_model(model)
    model, _ = unwrap(model)
    for m in model.modules():
        rec = record_of(m)
        if rec is not None:
            rec.check_class(m)
    restored: List[str] = []
    for name, m in list(model.named_modules()):
        rec = record_of(m)
        if rec is None or rec.level == "part":  # parts are undone by their model-level adapter
            continue
        if rec.level == "model":
            try:
                rec.adapter.revert_model(m)
            finally:
                detach(m)
            restored.extend(f"{name}.{n}" if name else n for n in rec.modules)
        else:
            unpatch_module(m)
            restored.append(name)
    return restored
