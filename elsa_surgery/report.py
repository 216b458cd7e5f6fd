"""What :func:`elsa_surgery.convert` did, as data: :class:`ConversionReport`.

A report lists every module that was converted (and by which adapter), every module that was already
converted, every attention-looking module that was skipped and why, the dispatch decisions of the
verification run (backends used, every fallback reason) and the parity numbers. It prints as a readable
table and serialises with :meth:`ConversionReport.to_dict` / :meth:`ConversionReport.to_json`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

CONVERTED = "converted"
ALREADY = "already converted"
SKIPPED = "skipped"


@dataclass
class ModuleEntry:
    """One module the conversion looked at."""

    name: str  # qualified name in the model ("" for the root)
    cls: str  # class name, module-qualified ("timm.models.vision_transformer.Attention")
    status: str  # "converted" | "already converted" | "skipped"
    adapter: Optional[str] = None  # the adapter that converted (or would have converted) it
    reason: Optional[str] = None  # why it was skipped
    max_abs_err: Optional[float] = None  # per-module parity: max |patched - original| on captured inputs
    rel_err: Optional[float] = None  # the same, divided by max |original|

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParityResult:
    """Model-level parity verification: the converted model against the original on example inputs."""

    verified: bool  # False when verification did not run (see ``reason``)
    passed: Optional[bool] = None
    reason: Optional[str] = None  # why not verified / why it failed
    inputs: Optional[str] = None  # where the example inputs came from ("user", "adapter timm.vit")
    dtype: Optional[str] = None  # the dtype the tolerances were chosen for
    rtol: Optional[float] = None
    atol: Optional[float] = None
    max_abs_err: Optional[float] = None  # max over output tensors of max |converted - original|
    rel_err: Optional[float] = None  # max over output tensors of max |δ| / max |original|
    rel_l2_err: Optional[float] = None  # max over output tensors of ||δ||_2 / ||original||_2
    worst_output: Optional[str] = None  # the output tensor with the largest rel_err
    worst_module: Optional[str] = None
    worst_module_rel_err: Optional[float] = None
    # The six drift metrics (elsa_surgery.parity.drift_metrics) of the primary output: P = softmax over
    # its last axis, Y = the output itself. Absent when the parity module does not provide them.
    drift: Optional[Dict[str, Dict[str, float]]] = None
    # Token positions left out of every comparison because the example inputs' 2-D ``attention_mask``
    # marks them as padding: their outputs are undefined (PyTorch's CUDA SDPA kernels disagree among
    # themselves on fully masked rows; ELSA returns zeros there).
    padding_positions_excluded: int = 0
    # convert(verify="grad"): parameter gradients of a loss on the example inputs (dropout off) against the
    # original model's; None when not requested
    grad_passed: Optional[bool] = None
    grad_params: Optional[int] = None  # how many parameter gradients were compared
    grad_rel_err: Optional[float] = None  # grad_worst_param's max |δ| / max |original|
    grad_rel_l2_err: Optional[float] = None  # max over parameters of ||δ||_2 / ||original||_2
    grad_worst_param: Optional[str] = None  # the parameter nearest (or furthest past) its tolerance
    grad_rtol: Optional[float] = None
    grad_atol: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ConversionReport:
    """The result of :func:`elsa_surgery.convert`."""

    model: str
    backend: str
    precision: Optional[str]
    converted: List[ModuleEntry] = field(default_factory=list)
    already_converted: List[ModuleEntry] = field(default_factory=list)
    skipped: List[ModuleEntry] = field(default_factory=list)
    model_adapters: List[str] = field(default_factory=list)  # model-level adapters applied in this call
    parity: Optional[ParityResult] = None
    # Dispatch decisions made during the converted verification run.
    backends_used: Dict[str, int] = field(default_factory=dict)  # "elsa/precise" -> calls
    fallbacks: List[str] = field(default_factory=list)  # distinct fallback reasons
    dispatch_reasons: List[str] = field(default_factory=list)  # distinct reasons of all decisions
    notes: List[str] = field(default_factory=list)

    # -- summaries -------------------------------------------------------------------------------
    @property
    def counts(self) -> Dict[str, int]:
        """Modules converted in this call, per adapter."""
        return dict(sorted(Counter(e.adapter for e in self.converted).items()))

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    @property
    def ok(self) -> bool:
        return self.parity is None or not self.parity.verified or bool(self.parity.passed)

    def module(self, name: str) -> ModuleEntry:
        for e in self.converted + self.already_converted + self.skipped:
            if e.name == name:
                return e
        raise KeyError(name)

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {
            "model": self.model,
            "backend": self.backend,
            "precision": self.precision,
            "counts": self.counts,
            "num_converted": self.num_converted,
            "model_adapters": list(self.model_adapters),
            "converted": [e.to_dict() for e in self.converted],
            "already_converted": [e.to_dict() for e in self.already_converted],
            "skipped": [e.to_dict() for e in self.skipped],
            "parity": None if self.parity is None else self.parity.to_dict(),
            "backends_used": dict(self.backends_used),
            "fallbacks": list(self.fallbacks),
            "dispatch_reasons": list(self.dispatch_reasons),
            "notes": list(self.notes),
        }

    def to_json(self, **kwargs) -> str:
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"elsa_surgery conversion of {self.model} (backend={self.backend}, precision={self.precision})"]
        counts = ", ".join(f"{a}: {n}" for a, n in self.counts.items()) or "none"
        lines.append(f"converted {self.num_converted} module(s) [{counts}]; "
                     f"already converted {len(self.already_converted)}; skipped {len(self.skipped)}")
        if self.model_adapters:
            lines.append(f"model-level adapters: {', '.join(self.model_adapters)}")
        rows = [(e.name or "<root>", e.cls.rsplit(".", 1)[-1], e.adapter or "-", e.status,
                 _fmt(e.rel_err) if e.rel_err is not None else (e.reason or ""))
                for e in self.converted + self.already_converted + self.skipped]
        if rows:
            lines.append("")
            lines.extend(_table(("module", "class", "adapter", "status", "rel. err / reason"), rows))
        p = self.parity
        lines.append("")
        if p is None:
            lines.append("parity: not requested (verify=False)")
        elif not p.verified:
            lines.append(f"parity: not verified ({p.reason})")
        else:
            verdict = "PASSED" if p.passed else "FAILED"
            lines.append(f"parity: {verdict} on {p.inputs} inputs ({p.dtype}, rtol={p.rtol:g}, atol={p.atol:g}): "
                         f"max|δ|={_fmt(p.max_abs_err)}, rel={_fmt(p.rel_err)}, rel_l2={_fmt(p.rel_l2_err)}")
            if p.worst_module is not None:
                lines.append(f"  worst module: {p.worst_module} (rel. err {_fmt(p.worst_module_rel_err)})")
            if p.padding_positions_excluded:
                lines.append(f"  {p.padding_positions_excluded} padding position(s) of attention_mask left out "
                             f"(their outputs are undefined)")
            if p.grad_passed is not None:
                lines.append(f"  gradients: {'PASSED' if p.grad_passed else 'FAILED'} over {p.grad_params} parameters "
                             f"(rtol={p.grad_rtol:g}, atol={p.grad_atol:g}): worst {p.grad_worst_param} "
                             f"rel={_fmt(p.grad_rel_err)}, max rel_l2={_fmt(p.grad_rel_l2_err)}")
            if p.drift:
                lines.append("  drift: " + ", ".join(
                    f"{k}={_fmt(v.get('max', v.get('rate')))}" for k, v in p.drift.items()))
        if self.backends_used:
            lines.append("backends: " + ", ".join(f"{b} x{n}" for b, n in self.backends_used.items()))
        for r in self.dispatch_reasons:
            if r not in self.fallbacks and not r.startswith("ELSA Triton kernel"):
                lines.append(f"dispatch: {r}")
        for r in self.fallbacks:
            lines.append(f"FALLBACK: {r}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ConversionReport(model={self.model!r}, converted={self.num_converted}, "
                f"skipped={len(self.skipped)}, parity={'n/a' if self.parity is None else self.parity.passed})")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _table(header, rows) -> List[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    widths[-1] = min(widths[-1], 100)
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return out
