"""Architecture adapters, one module per family (imported as ``elsa_surgery.adapters``).

Each module defines ``ADAPTERS = [...]`` and must not import its model library at import time;
:mod:`elsa_surgery.registry` discovers them.
"""
