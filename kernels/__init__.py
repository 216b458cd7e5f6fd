"""ELSA Triton kernels, installed as ``elsa_surgery.kernels``. Knows tensors, never models.

The interface the framework calls is in :mod:`elsa_surgery.kernels.interface` (re-exported here):
``unsupported_reason``, ``attention``, ``attention_state``, ``attention_varlen``. Files: ``scan.py`` the
Triton kernels, ``launch.py`` the launchers, ``occupancy.py`` the tile table and partition model
(ELSA-Lean knob ``ELSA_LEAN_ETA``), ``hopper.py`` the Gluon forward kernels of sm_90, ``backward.py`` and
``backward_launch.py`` the backward and dropout kernels and their launchers, ``hopper_backward.py`` strict's Gluon
backward, ``training.py`` the autograd formulas and the dropout and backward ops, ``replay.py`` launch plans,
``ops.py`` the ``torch.library`` custom ops, ``knobs.py`` every ``ELSA_*`` environment variable, ``internals.py``
the private Triton / CPython code.

From a source checkout this folder can also be found as a top-level ``kernels`` (transformers imports Hugging
Face's ``kernels`` package with a bare ``import kernels``). Imported under any name but ``elsa_surgery.kernels`` it
stays inert: registering the custom ops a second time would replace the dispatcher entries that the first
registration's op handles point to (a segfault at the next call). As a bare ``kernels`` it hands its place to Hugging
Face's package where that is installed (transformers >= 5.25 requires it).
"""

_INTERFACE = ("MAX_HEAD_DIM", "MIN_HEAD_DIM", "SUPPORTED_DTYPES", "attention", "attention_state", "attention_varlen",
              "default_precision", "launch", "ops", "unsupported_reason")

if __name__ == "elsa_surgery.kernels":
    def load():
        """Imports the interface (Triton, the custom ops) and binds its names here; ``import elsa_surgery.kernels``
        alone imports nothing heavy, so that the framework can read its knobs (``knobs.py``) without Triton."""
        from . import interface

        g = globals()
        for name in _INTERFACE:
            g[name] = getattr(interface, name)

    def __getattr__(name):
        if name in _INTERFACE:
            load()
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
elif __name__ == "kernels":
    def _hand_over() -> None:
        """Imported as a bare ``kernels`` from a source checkout (its root on sys.path: ``python -m pytest`` or
        ``python -m elsa_surgery.convert`` run there), this folder shadows Hugging Face's ``kernels`` distribution,
        which transformers >= 5.25 requires and imports (``from kernels import CUDAProperties, ...`` failed with an
        ImportError on every model). Where that distribution is installed, its package takes this module's place in
        ``sys.modules`` (the import system returns what ``sys.modules`` holds once this file has run); elsewhere this
        module stays inert."""
        import importlib.metadata
        import importlib.util
        import os
        import sys

        try:
            init = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
        except importlib.metadata.PackageNotFoundError:
            return
        here = os.path.dirname(os.path.abspath(__file__))
        if not os.path.isfile(init) or os.path.samefile(os.path.dirname(init), here):
            return
        spec = importlib.util.spec_from_file_location(__name__, init,
                                                      submodule_search_locations=[os.path.dirname(init)])
        theirs = importlib.util.module_from_spec(spec)
        ours = sys.modules[__name__]
        sys.modules[__name__] = theirs
        try:
            spec.loader.exec_module(theirs)
        except BaseException:
            sys.modules[__name__] = ours
            raise

    _hand_over()
