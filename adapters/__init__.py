"""Architecture adapters, one module per family (installed as ``elsa_surgery.adapters``).

Each module defines ``ADAPTERS = [...]`` and must not import its model library at import time;
:mod:`elsa_surgery.registry` discovers them. This file imports nothing, so that a bare ``import adapters``
from a source checkout (the name of another package on PyPI) finds nothing to run.
"""
