"""Logs Triton's compile cache key of every ELSA kernel compiled in any process that has this directory on
PYTHONPATH (Inductor's compile workers included): ``$KEYS_DIR/keys_<pid>.txt`` lines ``tag|kernel|key``, ``tag`` from
``$KEYTAG``. Session 42 found with it that Inductor's workers and a warm start's main process keyed the same kernel
with two ptxas versions (``docs/perf/raw/compile_warm_ptxas_h100_s42.log``)::

    PYTHONPATH=$PYTHONPATH:benchmarks/lab/triton_keys KEYTAG=cold python benchmarks/lab/compile_cache.py ...
"""

import os

try:
    import triton.compiler.compiler as _compiler

    _get_cache_key = _compiler.get_cache_key

    def _logged(src, backend, options, env_vars):
        key = _get_cache_key(src, backend, options, env_vars)
        name = str(getattr(src, "name", "?"))
        if "elsa" in name:
            path = os.path.join(os.environ.get("KEYS_DIR", "/tmp"), f"keys_{os.getpid()}.txt")
            with open(path, "a") as f:
                f.write(f"{os.environ.get('KEYTAG', '?')}|{name}|{key}\n")
        return key

    _compiler.get_cache_key = _logged
except ImportError:  # no Triton: nothing to log
    pass
