"""ELSA Triton kernels, installed as ``elsa_surgery.kernels``. Knows tensors, never models.

The interface the framework calls is in :mod:`elsa_surgery.kernels.interface` (re-exported here):
``unsupported_reason``, ``attention``, ``attention_state``, ``attention_varlen``. Files: ``scan.py`` the
Triton kernels, ``launch.py`` the launchers, ``occupancy.py`` the tile table and partition model
(ELSA-Lean knob ``ELSA_LEAN_ETA``), ``hopper.py`` the Gluon forward kernels of sm_90, ``backward.py`` and
``backward_launch.py`` the backward and dropout kernels and their launchers, ``hopper_backward.py`` strict's Gluon
backward, ``training.py`` the autograd formulas and the dropout and backward ops, ``replay.py`` launch plans,
``ops.py`` the ``torch.library`` custom ops, ``knobs.py`` every ``ELSA_*`` environment variable, ``internals.py``
the private Triton / CPython code.

From a source checkout this folder can also be found as a top-level ``kernels`` (transformers probes for
Hugging Face's ``kernels`` package with a bare ``import kernels``). Imported under any name but
``elsa_surgery.kernels`` it stays inert: registering the custom ops a second time would replace the
dispatcher entries that the first registration's op handles point to (a segfault at the next call).
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
