"""Register ELSA with transformers lazily, without importing transformers.

``import elsa_surgery`` must not import transformers, yet after it
``AutoModel.from_pretrained(..., attn_implementation="elsa")`` has to work. The registration is therefore
done at the first of these moments:

* at ``install()`` (called by ``import elsa_surgery``) when transformers' ``modeling_utils`` /
  ``masking_utils`` are already imported;
* otherwise right after Python finishes executing one of those two modules: a ``sys.meta_path`` finder
  wraps their loaders with a post-exec callback (the standard post-import-hook pattern), so transformers
  itself is imported exactly when the user imports it, and no sooner;
* and in any case at the first ``convert`` of a transformers model (``ensure_registered``).

The callback registers the attention function with ``AttentionInterface`` when ``modeling_utils`` is done
and the mask function with ``AttentionMaskInterface`` when ``masking_utils`` is done.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading

logger = logging.getLogger("elsa_surgery")

WATCHED = ("transformers.modeling_utils", "transformers.masking_utils")
_lock = threading.RLock()


def _on_loaded(name: str) -> None:
    try:
        from . import transformers_attention as ta

        if name == "transformers.modeling_utils":
            ta.register_attention_functions()
        elif name == "transformers.masking_utils":
            ta.register_mask_functions()
    except Exception as exc:  # never break the user's `import transformers`
        logger.warning("elsa_surgery: could not register with transformers after importing %s (%s: %s); "
                       "elsa_surgery.convert() registers again on first use", name, type(exc).__name__, exc)


class _PostExecLoader(importlib.abc.Loader):
    """Delegates to the real loader, then calls the elsa_surgery registration for that module."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # put the real loader back so that tools reading module.__loader__ / __spec__.loader see it
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _on_loaded(self._name)

    def __getattr__(self, item):
        return getattr(self._loader, item)


class _TransformersWatcher(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostExecLoader(spec.loader, fullname)
        return spec


_watcher = None


def install() -> None:
    """Register now for what is already imported; watch for the rest. Idempotent, cheap, imports nothing."""
    global _watcher
    with _lock:
        for name in WATCHED:
            mod = sys.modules.get(name)
            # a module that is mid-import has __spec__._initializing set: its post-exec hook will run
            if mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False):
                _on_loaded(name)
        if _watcher is None:
            _watcher = _TransformersWatcher()
            sys.meta_path.insert(0, _watcher)


def installed() -> bool:
    return _watcher is not None and _watcher in sys.meta_path
