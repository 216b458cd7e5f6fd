"""Plain-text tables for reports and recipes (no dependency)."""

from __future__ import annotations

from typing import Iterable, Sequence


def fmt(x) -> str:
    if isinstance(x, float):
        if x == 0.0:
            return "0"
        if abs(x) >= 1e4 or abs(x) < 1e-3:
            return f"{x:.2e}"
        return f"{x:.4g}"
    return str(x)


def format_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    rows = [[fmt(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)
