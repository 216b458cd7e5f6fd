"""Saving a converted model and loading it back converted: :func:`save` / :func:`load`.

A saved directory holds

* the weights, unchanged, as safetensors (sharded beyond ``max_shard_size``, with the usual
  ``model.safetensors.index.json``);
* the model's own config (transformers: ``config.json`` via ``save_pretrained``; timm / open_clip: the
  model name and constructor arguments in the manifest);
* ``elsa_surgery.json``, the manifest: where the model came from, adapters, converted modules, backend,
  precision, parity metrics and library versions.

``elsa_surgery.load(DIR)`` rebuilds the model from that, loads the weights and runs
:func:`elsa_surgery.convert` with the recorded backend and precision, so the result is a converted model
that :func:`elsa_surgery.revert` can undo. A transformers directory also loads with plain
``from_pretrained(DIR, attn_implementation="elsa")`` after ``import elsa_surgery``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

MANIFEST = "elsa_surgery.json"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD = "5GB"


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def versions() -> Dict[str, Optional[str]]:
    from . import __version__

    return {
        "elsa_surgery": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "timm": _version("timm"),
        "open_clip_torch": _version("open_clip_torch"),
        "safetensors": _version("safetensors"),
        "accelerate": _version("accelerate"),
    }


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` / ``"500MiB"`` / ``1000`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"size must look like '5GB', '500MiB' or an int, got {size!r}")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(num * base ** power)


# --------------------------------------------------------------------------------------------------
# weights (non-transformers models)
# --------------------------------------------------------------------------------------------------

def _unique_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """State dict with tied tensors stored once (safetensors refuses shared storage)."""
    out, seen = {}, {}
    for k, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = k
        out[k] = t.detach().contiguous().cpu()
    return out


def save_state_dict_sharded(model: nn.Module, directory: Path, max_shard_size: Union[int, str] = DEFAULT_SHARD) -> List[str]:
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    state = _unique_state(model)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS), metadata={"format": "pt"})
        return [WEIGHTS]
    names, weight_map = [], {}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(directory / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in sh})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def load_state_dict_sharded(directory: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (directory / INDEX).exists():
        index = json.loads((directory / INDEX).read_text())
        state = {}
        for name in sorted(set(index["weight_map"].values())):
            state.update(load_file(str(directory / name)))
        return state
    return load_file(str(directory / WEIGHTS))


def _weight_files(directory: Path) -> List[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".safetensors")


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------

def _is_hf(model) -> bool:
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def save(model: nn.Module, directory: Union[str, os.PathLike], report=None, *, source: Optional[Dict[str, Any]] = None,
         max_shard_size: Union[int, str] = DEFAULT_SHARD, extra: Optional[Dict[str, Any]] = None,
         tokenizer=None) -> Path:
    """Write ``model`` (weights unchanged) and the manifest to ``directory``; returns the manifest path.

    Args:
        model: the converted model.
        report: its :class:`~elsa_surgery.report.ConversionReport` (recorded in the manifest).
        source: how to rebuild the module: ``{"kind": "hf"}`` (default for transformers models),
            ``{"kind": "timm", "name": ...}``, ``{"kind": "open_clip", "name": ...}`` or ``{"kind": "torch",
            "factory": "package.module:callable", "kwargs": {...}}``.
        max_shard_size: shard weights above this size (``"5GB"``).
        tokenizer: saved beside a transformers model when given.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = dict(source or {})
    hf = _is_hf(model)
    if hf:
        source.setdefault("kind", "hf")
        source.setdefault("class", type(model).__name__)
        model.save_pretrained(str(directory), safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    else:
        if source.get("kind") not in ("timm", "open_clip", "torch"):
            raise ValueError("source must say how to rebuild a non-transformers model: "
                             "{'kind': 'timm'|'open_clip', 'name': ...} or {'kind': 'torch', 'factory': 'pkg.mod:fn'}")
        save_state_dict_sharded(model, directory, max_shard_size)

    rep = report.to_dict() if report is not None and hasattr(report, "to_dict") else report
    impls = {}
    if hf:
        from .patching import model_notes

        notes = model_notes(model)  # from the model's patch record: its model-level adapter
        impls = {e["name"]: e["implementation"] for e in notes}
    manifest = {
        "format": "elsa_surgery",
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", ""),
        "backend": (rep or {}).get("backend", "auto"),
        "precision": (rep or {}).get("precision"),
        "adapters": sorted({e["adapter"] for e in (rep or {}).get("converted", []) if e.get("adapter")}),
        "model_adapters": (rep or {}).get("model_adapters", []),
        "modules": [e["name"] for e in (rep or {}).get("converted", [])],
        "attn_implementation": sorted(set(impls.values()))[0] if impls else None,
        "skipped": [{"name": e["name"], "reason": e.get("reason")} for e in (rep or {}).get("skipped", [])],
        "parity": (rep or {}).get("parity"),
        "weights": {"format": "safetensors", "files": _weight_files(directory), "unchanged": True},
        "versions": versions(),
    }
    if extra:
        manifest.update(extra)
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------

def read_manifest(directory: Union[str, os.PathLike]) -> Dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: directory is not an elsa_surgery save (written by --save / elsa_surgery.save)")
    m = json.loads(path.read_text())
    if m.get("format") != "elsa_surgery" or int(m.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported manifest (format={m.get('format')!r}, version={m.get('format_version')!r})")
    return m


def _build_hf(directory: Path, manifest, dtype, device_map, **kw):
    import transformers

    cls_name = (manifest.get("source") or {}).get("class")
    cls = getattr(transformers, cls_name, None) if cls_name else None
    if cls is None:
        cls = transformers.AutoModel
    args = {}
    if dtype is not None:
        args["dtype"] = dtype
    if device_map is not None:
        args["device_map"] = device_map
    args.update(kw)
    return cls.from_pretrained(str(directory), **args)


def _build_other(directory: Path, manifest, dtype):
    src = manifest.get("source") or {}
    kind = src.get("kind")
    if kind == "timm":
        import timm

        model = timm.create_model(src["name"], pretrained=False, **(src.get("kwargs") or {}))
    elif kind == "open_clip":
        import open_clip

        model = open_clip.create_model(src["name"], pretrained=None, **(src.get("kwargs") or {}))
    elif kind == "torch":
        import importlib

        mod, _, fn = src["factory"].partition(":")
        model = getattr(importlib.import_module(mod), fn)(**(src.get("kwargs") or {}))
    else:
        raise ValueError(f"manifest source kind {kind!r} is not one of 'hf', 'timm', 'open_clip', 'torch'")
    state = load_state_dict_sharded(directory)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied weights were stored once: whatever is missing must be a tie that load_state_dict already filled
    if unexpected:
        raise ValueError(f"weights in {directory} do not fit {type(model).__name__}: unexpected keys {unexpected[:5]}")
    if missing:
        ref = model.state_dict()
        really = [k for k in missing if not any(ref[k].data_ptr() == ref[o].data_ptr() for o in state if o in ref)]
        if really:
            raise ValueError(f"weights in {directory} do not fit {type(model).__name__}: missing keys {really[:5]}")
    if dtype is not None:
        model = model.to(dtype)
    return model


def load(directory: Union[str, os.PathLike], *, device: Optional[Union[str, torch.device]] = None,
         dtype: Optional[torch.dtype] = None, device_map=None, verify: bool = False, example_inputs=None,
         backend: Optional[str] = None, precision: Optional[str] = None, return_report: bool = False, **from_pretrained_kwargs):
    """Load a directory written by :func:`save` (or ``--save``) as a converted model (in eval mode).

    The recorded backend / precision are used unless ``backend`` / ``precision`` are given.
    ``verify=True`` re-runs the parity check (needs the model library's example inputs or ``example_inputs``).
    Returns the model, or ``(model, report)`` with ``return_report=True``.
    """
    from .surgery import convert

    directory = Path(directory)
    manifest = read_manifest(directory)
    kind = (manifest.get("source") or {}).get("kind")
    if kind == "hf":
        model = _build_hf(directory, manifest, dtype, device_map, **from_pretrained_kwargs)
    else:
        if device_map is not None:
            raise ValueError("device_map applies to transformers models only")
        model = _build_other(directory, manifest, dtype)
    if device is not None and device_map is None:
        model = model.to(device)
    model.eval()
    report = convert(model, backend=backend or manifest.get("backend") or "auto",
                     precision=precision if precision is not None else manifest.get("precision"),
                     verify=verify, example_inputs=example_inputs)
    if report.num_converted != len(manifest.get("modules", [])):
        import logging

        logging.getLogger("elsa_surgery").warning(
            "elsa_surgery.load: %d module(s) converted, the manifest lists %d", report.num_converted,
            len(manifest.get("modules", [])))
    return (model, report) if return_report else model
