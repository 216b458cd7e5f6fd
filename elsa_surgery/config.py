"""The ``ELSA_*`` environment variables: their effective settings, and the page that documents them.

Every variable is declared once, in ``elsa_surgery.kernels.knobs`` (name, type, allowed values, default, doc);
read one with ``knobs.get(name)``. :func:`show` prints the effective settings (also
``python -m elsa_surgery.convert --show-config``); ``python -m elsa_surgery.config --markdown`` prints
``docs/configuration.md``, which tests/test_knobs.py keeps equal to :func:`markdown`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, TextIO

from .kernels import knobs

KNOBS = knobs.KNOBS
get = knobs.get

_SCOPES = (("user", "Settings for users"),
           ("tuning", "Tuning and measurement (forcing what the planner picks; for benchmarks and tests)"),
           ("internal", "Internal (set by the project's own scripts and tests)"))


def _shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if all(isinstance(v, int) for v in value) else ":".join(map(str, value))
    return str(value)


def show(file: Optional[TextIO] = None) -> None:
    """Prints every knob: its variable as set, the value in effect (or the error a call would raise) and its doc."""
    file = sys.stdout if file is None else file
    rows = [(k.name, "unset" if raw is None else repr(raw), value if isinstance(value, str) and
             value.startswith("error:") else _shown(value), k.doc) for k, raw, value in knobs.settings()]
    widths = [max(len(r[i]) for r in rows + [("variable", "set to", "in effect", "")]) for i in range(3)]
    print("  ".join(h.ljust(w) for h, w in zip(("variable", "set to", "in effect"), widths)) + "  meaning", file=file)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3], file=file)


def markdown() -> str:
    """``docs/configuration.md``: one table per scope, from the registry."""
    lines = ["# Configuration: the `ELSA_*` environment variables", "",
             "<!-- generated from kernels/knobs.py by `python -m elsa_surgery.config --markdown`: edit the registry, "
             "not this page -->", "",
             "Every variable is declared once, in `kernels/knobs.py` (`elsa_surgery.kernels.knobs`), and read through "
             "`knobs.get(name)`. An unset or empty variable takes the default; a value outside the allowed ones raises "
             "`ValueError` naming the variable and the allowed values, at the first call that reads it. Arguments "
             "(`backend=`, `precision=`) take precedence over `ELSA_BACKEND` and `ELSA_FP32_PRECISION`.", "",
             "`python -m elsa_surgery.convert --show-config` (or `elsa_surgery.config.show()`) prints the settings in "
             "effect.", ""]
    for scope, title in _SCOPES:
        lines += [f"## {title}", "", "| variable | type | allowed values | default | what it does |",
                  "|---|---|---|---|---|"]
        for k in KNOBS.values():
            if k.scope == scope:
                cells = (f"`{k.name}`", k.type, k.allowed, _shown(k.default), k.doc)
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m elsa_surgery.config",
                                description="Print the ELSA_* settings in effect, or docs/configuration.md.")
    p.add_argument("--markdown", action="store_true", help="print docs/configuration.md (generated from the registry)")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        show()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
