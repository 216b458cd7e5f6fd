"""Shared plumbing of the adapters for models that are not pip packages (``hsimae``, ``vggt``).

Their classes are matched by their own rule (class name, module path, structure) unless the user names
exact classes (``Adapter(name=..., classes=(MyAttention,))``); a matched module without the expected
structure is skipped with a reason; ``revert`` clears the patch state that ``torch_mha.bind_forward`` set.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from elsa_surgery.registry import Adapter, PatchConfig

from .torch_mha import clear_patch_state


class StructuralAdapter(Adapter):
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

    def unpatch(self, module: nn.Module) -> None:
        clear_patch_state(module)

    def matches_any(self, model: nn.Module) -> bool:
        """Whether ``model`` holds a module this adapter matches (``example_inputs`` builds none otherwise)."""
        return any(self.matches(m) for m in model.modules())
