"""``python -m elsa_surgery.convert``: the command line (see :mod:`elsa_surgery.cli`).

The *function* ``elsa_surgery.convert`` lives in :mod:`elsa_surgery.surgery`. Importing this module by
name (``import elsa_surgery.convert``) must not break ``elsa_surgery.convert(model)``: the package keeps
its attribute, and this module object is itself callable (it forwards to the function), so either way a
call converts a model.
"""

import sys as _sys
import types as _types

from .cli import main  # noqa: F401  (the console-script entry point: elsa-surgery = elsa_surgery.convert:main)
from .surgery import convert as _convert


class _CallableModule(_types.ModuleType):
    """This module, callable as :func:`elsa_surgery.surgery.convert`."""

    def __call__(self, *args, **kwargs):
        return _convert(*args, **kwargs)


if __name__ == "__main__":
    _sys.exit(main())
else:
    _module = _sys.modules[__name__]
    _module.__class__ = _CallableModule
    __wrapped__ = _convert  # inspect.signature(elsa_surgery.convert) shows the function's signature
