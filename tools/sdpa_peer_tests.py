"""PyTorch's own SDPA tests as a peer: run ``test/test_transformers.py`` with ``elsa_surgery.attention`` patched in.

    python tools/sdpa_peer_tests.py PATH/TO/pytorch/test/test_transformers.py [--backend auto] [--route fused]
        [-k EXPR] [--markdown OUT.md] [-- extra pytest args]

The test file comes from a PyTorch checkout (it is not in the wheel, and is never copied into this project); its
folder is put on ``sys.path`` so that its sibling helpers import (missing ones, such as the C++-extension helper
``test_cpp_extensions_open_device_registration``, are stubbed: the tests that need them are skipped or fail).

``torch.nn.functional.scaled_dot_product_attention`` is replaced, before the test file is imported, by a function
that calls ``elsa_surgery.attention`` with the same arguments. PyTorch's tests compare a fused kernel (the call under
test) with the math kernel (the reference, under ``sdpa_kernel([SDPBackend.MATH])``). With ``--route fused``
(default) ELSA stands in for the fused kernels and calls made while only the math backend is enabled reach
PyTorch's own SDPA, so the tests compare ELSA against PyTorch's math; ``--route all`` sends every call to ELSA.
Nested tensors always go to PyTorch (ELSA takes dense tensors). Each test reports how many calls ELSA answered: a
test with none did not exercise ELSA. By default the device-generic CPU tests run (``-k`` picks others); on CPU,
``--backend elsa`` needs ``TRITON_INTERPRET=1`` set before this script starts (the interpreter is slow).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import elsa_surgery

DEFAULT_K = "CPU and (TestSDPA or TestAttnBias or TestSDPAFailureModes or TestTransformers)"
_REAL = F.scaled_dot_product_attention
CALLS = collections.Counter()  # per test: "elsa", "pytorch math", "pytorch nested"


def _math_only() -> bool:
    b = torch.backends.cuda
    fused = b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.cudnn_sdp_enabled()
    return b.math_sdp_enabled() and not fused


def make_patched(backend: str, route: str):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if any(getattr(t, "is_nested", False) for t in (query, key, value)):
            CALLS["pytorch nested"] += 1
            return _REAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if route == "fused" and _math_only():
            CALLS["pytorch math"] += 1
            return _REAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        CALLS["elsa"] += 1
        return elsa_surgery.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      backend=backend)

    return scaled_dot_product_attention


class _Recorder:
    """pytest plugin: each test's outcome, the first line of its failure, and the calls ELSA answered."""

    def __init__(self):
        self.rows = []

    def pytest_runtest_setup(self, item):
        CALLS.clear()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            why = ""
            if report.failed:
                text = str(report.longrepr).strip().splitlines()
                errors = [line for line in text if line.startswith("E ")]
                why = (errors[0][1:].strip() if errors else text[-1]) if text else ""
            elif report.skipped:
                why = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            self.rows.append((report.nodeid.split("::")[-1], report.outcome, why[:160], dict(CALLS)))


def _stub_missing_helpers():
    name = "test_cpp_extensions_open_device_registration"
    try:
        __import__(name)
    except ImportError:
        stub = types.ModuleType(name)
        stub.remove_build_path = lambda *a, **k: None
        stub.generate_faked_module = lambda *a, **k: types.ModuleType("faked")
        sys.modules[name] = stub


def _function_of(name: str, functions) -> str:
    """The test function a generated test (``<function>_<parameters>_<device>``) came from."""
    hits = [f for f in functions if name == f or name.startswith(f + "_")]
    return max(hits, key=len) if hits else name


def summarize(rows, backend: str, route: str, path: str) -> str:
    functions = set(re.findall(r"def (test_\w+)\(", Path(path).read_text()))
    outcomes = collections.Counter(r[1] for r in rows)
    exercised = [r for r in rows if r[3].get("elsa")]
    ex_out = collections.Counter(r[1] for r in exercised)
    lines = [f"PyTorch peer run: {path}", f"torch {torch.__version__}, backend={backend!r}, route={route!r}",
             f"tests: {len(rows)}; " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())),
             f"exercising ELSA (at least one call): {len(exercised)}; "
             + ", ".join(f"{k} {v}" for k, v in sorted(ex_out.items())), "", "| test (parametrisations) | outcome | count | ELSA calls | first failure line |",
             "|---|---|---|---|---|"]
    groups = collections.OrderedDict()
    for name, outcome, why, calls in rows:
        base = _function_of(name, functions)
        key = (base, outcome, why if outcome == "failed" else "")
        g = groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] += calls.get("elsa", 0)
    for (base, outcome, why), (n, elsa) in groups.items():
        lines.append(f"| {base} | {outcome} | {n} | {elsa} | {why.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", help="path to a PyTorch checkout's test/test_transformers.py")
    ap.add_argument("--backend", default="auto", choices=["auto", "elsa", "reference", "sdpa"])
    ap.add_argument("--route", default="fused", choices=["fused", "all"])
    ap.add_argument("-k", default=DEFAULT_K, help="pytest -k expression (default: the CPU instances)")
    ap.add_argument("--markdown", help="also write the summary table here")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    path = Path(args.test_file).resolve()
    if not path.is_file():
        ap.error(f"{path} does not exist")
    import pytest

    sys.path.insert(0, str(path.parent))
    _stub_missing_helpers()
    F.scaled_dot_product_attention = make_patched(args.backend, args.route)  # before the test file binds the name
    rec = _Recorder()
    pytest.main([str(path), "-q", "-p", "no:cacheprovider", "-k", args.k, "--rootdir", str(path.parent),
                 *args.pytest_args], plugins=[rec])
    F.scaled_dot_product_attention = _REAL
    text = summarize(rec.rows, args.backend, args.route, str(path))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
