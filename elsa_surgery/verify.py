"""Model-level parity verification for :func:`elsa_surgery.convert` (docs/design.md, "Parity contract").

:class:`ParityCheck` runs the model on example inputs before the swap (capturing, with forward hooks,
the inputs and output of every module about to be converted) and again after it, inside
:func:`elsa_surgery.dispatch.record`. It compares the outputs with dtype-aware tolerances
(:func:`default_tolerances`, overridable) and localises the error: each converted module is called on
the inputs it received in the original run and compared with the output it gave then, so a module's
error is its own, not the drift accumulated upstream.

The criterion, per floating output tensor of the model and per converted module (on its captured inputs):
``max|test - ref| <= atol + rtol * max|ref|`` (a norm-wise test: element-wise ``allclose`` is meaningless for
near-zero activations of deep models). Both must hold: a module whose output the model cannot see (a
zero-initialised post-norm or gate) is still checked.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import dispatch
from .report import ParityResult

# (rtol, atol) per dtype of the model / outputs, for the norm-wise criterion above.
TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-5),  # strict / precise fp32 attention (~1e-7 per call)
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (6e-2, 1e-2),
}
TURBO_TOLERANCE = (1e-2, 1e-3)  # fp32 inputs in TF32 ("turbo") mode: ~3e-4 per attention call
# verify="grad": parameter gradients pass through the whole backward (every layer's dQ/dK/dV, the mask gradients):
# fp32 gets 10x the output tolerances, fp16/bf16 (already loose) 2x
GRAD_TOLERANCE_FACTOR = {torch.float32: 10.0, torch.float64: 10.0, torch.float16: 2.0, torch.bfloat16: 2.0}
GRAD_LOSS_SEED = 0  # the fixed random weights of the gradient check's loss


class ParityError(RuntimeError):
    """The converted model disagrees with the original; every module converted by the call is restored.

    Attributes: ``module`` (qualified name of the worst module, or None), ``error`` (its relative error),
    ``max_abs_err`` / ``rel_err`` (full model), ``report`` (the :class:`ConversionReport`).
    """

    def __init__(self, message: str, *, module: Optional[str] = None, error: Optional[float] = None,
                 max_abs_err: Optional[float] = None, rel_err: Optional[float] = None, report=None):
        super().__init__(message)
        self.module = module
        self.error = error
        self.max_abs_err = max_abs_err
        self.rel_err = rel_err
        self.report = report


def default_tolerances(dtype: torch.dtype, precision: Optional[str] = None) -> Tuple[float, float]:
    """``(rtol, atol)`` for outputs of ``dtype``; ``precision="turbo"`` loosens fp32."""
    if dtype == torch.float32 and precision == "turbo":
        return TURBO_TOLERANCE
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


_PRECISION_ORDER = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def least_precise(dtypes) -> torch.dtype:
    ds = [d for d in dtypes if d in _PRECISION_ORDER]
    return min(ds, key=_PRECISION_ORDER.index) if ds else torch.float32


# --------------------------------------------------------------------------------------------------
# running a model on user / adapter inputs and flattening what comes out
# --------------------------------------------------------------------------------------------------

def call_model(model: nn.Module, inputs: Any):
    """A tensor is passed positionally, a tuple/list as positional arguments, a dict as keywords."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def check_inputs(inputs: Any) -> None:
    if isinstance(inputs, (torch.Tensor, Mapping, tuple, list)):
        return
    raise TypeError("example_inputs must be a tensor, a tuple/list of positional arguments or a dict of keyword "
                    f"arguments, got {type(inputs).__name__}")


def flatten_outputs(out: Any, prefix: str = "output") -> List[Tuple[str, torch.Tensor]]:
    """Every floating tensor in a (nested) output, with a path: ``output``, ``output[0]``, ``output.logits``."""
    found: List[Tuple[str, torch.Tensor]] = []
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() or out.is_complex():
            found.append((prefix, out))
    elif isinstance(out, Mapping):  # dicts and transformers' ModelOutput
        for k, v in out.items():
            found.extend(flatten_outputs(v, f"{prefix}.{k}"))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            found.extend(flatten_outputs(v, f"{prefix}[{i}]"))
    return found


def padding_keep(inputs: Any) -> Optional[torch.Tensor]:
    """``[B, L]`` bool, True at real tokens, from a Hugging Face-style ``attention_mask`` in dict inputs."""
    if not isinstance(inputs, Mapping):
        return None
    am = inputs.get("attention_mask")
    if not isinstance(am, torch.Tensor) or am.dim() != 2 or am.is_floating_point() and not bool(((am == 0) | (am == 1)).all()):
        return None
    keep = am.bool()
    return None if bool(keep.all()) else keep


def _real_rows(t: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The token rows of ``t`` that are not padding (tensors shaped ``[B, L, ...]`` only)."""
    if keep is None or t.dim() < 2 or tuple(t.shape[:2]) != tuple(keep.shape):
        return t
    return t[keep.to(t.device)]


def compare(ref: Any, test: Any, keep: Optional[torch.Tensor] = None) -> Dict[str, Dict[str, float]]:
    """Per output tensor: ``max_abs``, ``ref_max``, ``rel`` (max_abs / ref_max), ``rel_l2``.

    With ``keep`` (``[B, L]``, True at real tokens), outputs shaped ``[B, L, ...]`` are compared at real
    tokens only: padding positions carry no defined value.
    """
    a, b = flatten_outputs(ref), flatten_outputs(test)
    if [n for n, _ in a] != [n for n, _ in b]:
        raise ParityError(f"the converted model's outputs have a different structure: {[n for n, _ in a]} "
                          f"before, {[n for n, _ in b]} after")
    out = {}
    for (name, x), (_, y) in zip(a, b):
        if x.shape != y.shape:
            raise ParityError(f"{name} changed shape: {tuple(x.shape)} before, {tuple(y.shape)} after")
        x64, y64 = _real_rows(x.detach(), keep).double(), _real_rows(y.detach(), keep).double()
        d = y64 - x64
        if x64.numel() == 0:
            out[name] = dict(max_abs=0.0, ref_max=0.0, rel=0.0, rel_l2=0.0)
            continue
        finite = torch.isfinite(x64)
        if not bool(torch.equal(finite, torch.isfinite(y64))) or not bool(torch.equal(x64[~finite], y64[~finite])):
            out[name] = dict(max_abs=math.inf, ref_max=float(x64[finite].abs().max()) if finite.any() else 0.0,
                             rel=math.inf, rel_l2=math.inf)
            continue
        d = d[finite]
        xf = x64[finite]
        max_abs = float(d.abs().max()) if d.numel() else 0.0
        ref_max = float(xf.abs().max()) if xf.numel() else 0.0
        ref_l2 = float(xf.norm()) if xf.numel() else 0.0
        out[name] = dict(
            max_abs=max_abs, ref_max=ref_max,
            rel=max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else math.inf),
            rel_l2=float(d.norm()) / ref_l2 if ref_l2 > 0 else (0.0 if max_abs == 0 else math.inf),
        )
    return out


def within(stats: Mapping[str, float], rtol: float, atol: float) -> bool:
    return stats["max_abs"] <= atol + rtol * stats["ref_max"]


def _drift(ref: Any, test: Any, keep: Optional[torch.Tensor] = None) -> Optional[Dict[str, Dict[str, float]]]:
    try:
        from .parity import drift_metrics
    except ImportError:  # the parity module is optional: no metrics rather than made-up ones
        return None
    a, b = flatten_outputs(ref), flatten_outputs(test)
    if not a or a[0][1].dim() == 0 or a[0][1].is_complex():
        return None
    y_ref, y_test = _real_rows(a[0][1].detach(), keep).double(), _real_rows(b[0][1].detach(), keep).double()
    if y_ref.dim() == 1:
        y_ref, y_test = y_ref[None], y_test[None]
    if not (torch.isfinite(y_ref).all() and torch.isfinite(y_test).all()):
        return None
    p_ref, p_test = y_ref.softmax(-1), y_test.softmax(-1)
    return drift_metrics(p_ref, p_test, y_ref, y_test)


# --------------------------------------------------------------------------------------------------
# capturing per-module inputs
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def capture_first_call(modules: Mapping[str, nn.Module]):
    """Record ``(args, kwargs, output)`` of the first call of each module inside the block.

    The inputs are deep-copied before the module runs, so a stateful argument (a KV cache the module
    appends to) is replayed in the state the module first saw; inputs that cannot be copied are kept as is.
    """
    captured: Dict[str, Tuple[tuple, dict, Any]] = {}
    pending: Dict[str, Tuple[tuple, dict]] = {}
    handles = []

    def make_pre_hook(name):
        def hook(module, args, kwargs):
            if name not in captured and name not in pending:
                try:
                    pending[name] = copy.deepcopy((tuple(args), dict(kwargs)))
                except Exception:
                    pending[name] = (tuple(args), dict(kwargs))
        return hook

    def make_hook(name):
        def hook(module, args, kwargs, output):
            if name not in captured and name in pending:
                a, k = pending.pop(name)
                captured[name] = (a, k, output)
        return hook

    try:
        for name, m in modules.items():
            handles.append(m.register_forward_pre_hook(make_pre_hook(name), with_kwargs=True))
            handles.append(m.register_forward_hook(make_hook(name), with_kwargs=True))
        yield captured
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Evaluation mode for the parity runs (no dropout, no running-statistics updates), then restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def parameter_grads(model: nn.Module, inputs: Any) -> Dict[str, torch.Tensor]:
    """The gradients of every trainable parameter for ``loss = sum_i <out_i, w_i>`` over the model's floating
    outputs (``w_i`` fixed random weights, zero at padding tokens), dropout off (eval mode). The parameters'
    ``.grad`` are left as they were."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    keep = padding_keep(inputs)
    gen = torch.Generator().manual_seed(GRAD_LOSS_SEED)
    try:
        for _, p in params:
            p.grad = None
        with torch.enable_grad(), eval_mode(model):
            out = call_model(model, inputs)
            loss = 0.0
            for _, t in flatten_outputs(out):
                if not t.requires_grad or t.is_complex():
                    continue
                w = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, torch.float32)
                if keep is not None and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(keep.shape):
                    w = w * keep.to(t.device).reshape(*keep.shape, *([1] * (t.dim() - 2)))
                loss = loss + (t.float() * w).sum() / max(1, t.numel()) ** 0.5
            if isinstance(loss, torch.Tensor):
                loss.backward()
        return {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    finally:
        for (_, p), g in zip(params, saved):
            p.grad = g


class ParityCheck:
    """Before/after comparison of one conversion. Use :meth:`reference`, then patch, then :meth:`converted`.
    With ``grad=True`` (``convert(verify="grad")``) the parameter gradients of a loss on the inputs are compared
    too (:func:`parameter_grads`)."""

    def __init__(self, model: nn.Module, inputs: Any, modules: Mapping[str, nn.Module], *, inputs_source: str,
                 rtol: Optional[float] = None, atol: Optional[float] = None, precision: Optional[str] = None,
                 grad: bool = False):
        self.model = model
        self.inputs = inputs
        self.modules = dict(modules)
        self.inputs_source = inputs_source
        self.user_rtol, self.user_atol = rtol, atol
        self.precision = precision
        self.ref_out = None
        self.captured: Dict[str, Tuple[tuple, dict, Any]] = {}
        self.decisions: List[dispatch.Decision] = []
        self.grad = grad
        self.ref_grads: Dict[str, torch.Tensor] = {}

    def reference(self) -> None:
        with torch.no_grad(), eval_mode(self.model), capture_first_call(self.modules) as cap:
            self.ref_out = call_model(self.model, self.inputs)
        self.captured = cap
        if self.grad:
            self.ref_grads = parameter_grads(self.model, self.inputs)

    def _check_grads(self, result: ParityResult, dtype: torch.dtype, rtol: float, atol: float) -> None:
        """Parameter gradients after the swap against before; fills the ``grad_*`` fields of ``result``."""
        with dispatch.record() as log:
            grads = parameter_grads(self.model, self.inputs)
        self.decisions += list(log)
        if list(grads) != list(self.ref_grads):
            missing = sorted(set(self.ref_grads) ^ set(grads))
            stats = {"missing": dict(max_abs=math.inf, ref_max=0.0, rel=math.inf, rel_l2=math.inf)}
            result.grad_worst_param = f"gradient present on one side only: {missing[:3]}"
        else:
            stats = {n: compare(self.ref_grads[n], grads[n])["output"] for n in grads}
        factor = GRAD_TOLERANCE_FACTOR.get(dtype, 10.0)
        result.grad_rtol, result.grad_atol = rtol * factor, atol * factor
        bad = [n for n, s in stats.items() if not within(s, result.grad_rtol, result.grad_atol)]
        result.grad_passed = not bad
        result.grad_params = len(stats)
        if stats:  # worst: the closest to its tolerance (a gradient that is ~0 in exact arithmetic has a huge rel)
            worst = max(stats, key=lambda n: stats[n]["max_abs"] / (result.grad_atol + result.grad_rtol
                                                                     * stats[n]["ref_max"]))
            result.grad_worst_param = result.grad_worst_param or worst
            result.grad_rel_err = stats[worst]["rel"]
            result.grad_rel_l2_err = max(s["rel_l2"] for s in stats.values())
        if bad:
            result.passed = False
            result.reason = (f"parameter gradients differ from the original model's: {len(bad)} of {len(stats)} "
                             f"beyond atol + rtol*max|ref| with rtol={result.grad_rtol:g}, atol={result.grad_atol:g} "
                             f"(worst {result.grad_worst_param}, rel {result.grad_rel_err:.3g})")

    def converted(self) -> Tuple[ParityResult, Dict[str, Dict[str, float]]]:
        """Run the converted model; returns the parity result and per-module errors ``{name: stats}``."""
        with torch.no_grad(), eval_mode(self.model), dispatch.record() as log:
            test_out = call_model(self.model, self.inputs)
        self.decisions = list(log)
        keep = padding_keep(self.inputs)
        stats = compare(self.ref_out, test_out, keep)
        dtypes = [t.dtype for _, t in flatten_outputs(self.ref_out)]
        dtypes += [p.dtype for m in self.modules.values() for p in m.parameters(recurse=True)]
        dtype = least_precise(dtypes)
        rtol, atol = default_tolerances(dtype, self.precision)
        rtol = rtol if self.user_rtol is None else float(self.user_rtol)
        atol = atol if self.user_atol is None else float(self.user_atol)

        per_module = self.module_errors()
        model_ok = all(within(s, rtol, atol) for s in stats.values())
        # A module must also agree with its original on its own captured inputs: a branch the model output
        # cannot see (zero-initialised post-norm, a gate at 0) must not hide a wrong attention.
        numeric = {n: s for n, s in per_module.items() if "rel" in s}
        bad_modules = [n for n, s in numeric.items() if not within(s, rtol, atol)]
        passed = model_ok and not bad_modules
        worst_out = max(stats, key=lambda n: stats[n]["rel"]) if stats else None
        worst_mod = max(numeric, key=lambda n: numeric[n]["rel"]) if numeric else None
        result = ParityResult(
            verified=True, passed=passed, inputs=self.inputs_source, dtype=str(dtype).replace("torch.", ""),
            rtol=rtol, atol=atol,
            max_abs_err=max((s["max_abs"] for s in stats.values()), default=0.0),
            rel_err=max((s["rel"] for s in stats.values()), default=0.0),
            rel_l2_err=max((s["rel_l2"] for s in stats.values()), default=0.0),
            worst_output=worst_out, worst_module=worst_mod,
            worst_module_rel_err=None if worst_mod is None else per_module[worst_mod]["rel"],
            drift=_drift(self.ref_out, test_out, keep),
            padding_positions_excluded=0 if keep is None else int((~keep).sum()),
        )
        if not model_ok:
            result.reason = f"{worst_out} differs from the original model"
        elif bad_modules:
            result.reason = (f"{len(bad_modules)} module(s) differ from their original on their captured inputs "
                             f"although the model output agrees")
        if not stats and not bad_modules:
            result.passed, result.reason = True, "the model returned no floating-point tensor to compare"
        if self.grad and result.passed:
            self._check_grads(result, dtype, rtol, atol)
        return result, per_module

    def module_errors(self) -> Dict[str, Dict[str, Any]]:
        """Each converted module on its captured original inputs, against its captured original output.

        Compares the module's primary output (its first floating tensor: attention modules may return
        extra items, e.g. attention weights that only the original implementation computes). A module
        that cannot be replayed gets ``{"error": why}`` instead of numbers (a note, not a failure: the
        full-model comparison stands).
        """
        errors: Dict[str, Dict[str, Any]] = {}
        with torch.no_grad(), eval_mode(self.model):
            for name, (args, kwargs, out) in self.captured.items():
                try:
                    new = self.modules[name](*args, **kwargs)
                    a, b = flatten_outputs(out)[:1], flatten_outputs(new)[:1]
                    if not a or not b:
                        continue
                    s = compare(a[0][1], b[0][1], padding_keep(self.inputs))["output"]
                except Exception as exc:
                    errors[name] = dict(error=f"{type(exc).__name__}: {exc}")
                    continue
                errors[name] = dict(s)
        return errors

    def dispatch_summary(self) -> Tuple[Dict[str, int], List[str], List[str]]:
        used = Counter(d.backend + (f"/{d.precision}" if d.precision else "") for d in self.decisions)
        fallbacks = list(dict.fromkeys(d.reason for d in self.decisions if d.fallback))
        reasons = list(dict.fromkeys(d.reason for d in self.decisions))
        return dict(sorted(used.items())), fallbacks, reasons


def failure_message(result: ParityResult, per_module: Mapping[str, Mapping[str, float]], entries: Sequence,
                    restored: int) -> str:
    if result.grad_passed is False:
        return (f"gradient check failed on {result.inputs} inputs: {result.reason}. All {restored} module(s) "
                f"converted by this call were restored; the model is unchanged.")
    model_failed = result.max_abs_err is not None and result.max_abs_err > 0 and result.reason is not None \
        and result.reason.endswith("differs from the original model")
    if model_failed:
        msg = (f"parity check failed on {result.inputs} inputs: {result.worst_output} differs from the original model "
               f"by max|δ|={result.max_abs_err:.3g} (rel {result.rel_err:.3g}), beyond atol + rtol*max|ref| with "
               f"rtol={result.rtol:g}, atol={result.atol:g} ({result.dtype})")
    else:
        msg = (f"parity check failed on {result.inputs} inputs: the model output agrees (max|δ|="
               f"{result.max_abs_err:.3g}, rel {result.rel_err:.3g}) but converted modules differ from their "
               f"original beyond atol + rtol*max|ref| with rtol={result.rtol:g}, atol={result.atol:g} ({result.dtype})")
    if result.worst_module is not None:
        w = per_module[result.worst_module]
        adapter = next((e.adapter for e in entries if e.name == result.worst_module), None)
        msg += (f"; worst module: {result.worst_module!r} (adapter {adapter}) with max|δ|={w['max_abs']:.3g}, "
                f"rel {w['rel']:.3g} on its captured inputs")
    msg += f". All {restored} module(s) converted by this call were restored; the model is unchanged."
    return msg
