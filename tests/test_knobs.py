"""The knob registry (kernels/knobs.py): every ``ELSA_*`` variable declared once, read through it, documented from it.

Fails when the registry, docs/configuration.md and the code's reads disagree: an ``ELSA_*`` name used anywhere in
the sources but not declared, a declared knob nothing reads, an ``os.environ`` read of an ``ELSA_*`` variable
outside the registry, a variable name spelled out in the package outside the registry, or a stale page."""

import ast
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elsa_surgery import config
from elsa_surgery.kernels import knobs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("elsa_surgery", "kernels", "adapters")
SOURCES = PACKAGE + ("recipes", "benchmarks", "tools", "examples", "tests")
REGISTRY = ROOT / "kernels" / "knobs.py"
NAME = re.compile(r"\bELSA_[A-Z][A-Z0-9_]*\b")
TEST_DUMMIES = re.compile(r"ELSA_TEST_KNOB_[A-Z]$")  # tests/test_profile_recipes.py: benchmark.environ's own test
ENV_READ = re.compile(r"os\.(?:environ\.get|getenv|environ\.setdefault)\(\s*[\"']ELSA_|os\.environ\[\s*[\"']ELSA_")


def _files():
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".sh") and path not in (REGISTRY, Path(__file__).resolve()):
                yield path


def test_every_name_in_the_sources_is_declared():
    unknown = {}
    for path in _files():
        for name in NAME.findall(path.read_text()):
            if name not in knobs.KNOBS and not TEST_DUMMIES.match(name):
                unknown.setdefault(name, path.relative_to(ROOT).as_posix())
    assert not unknown, f"ELSA_* variables used but not declared in kernels/knobs.py: {unknown}"


def test_every_declared_knob_is_read_somewhere():
    constants = {v: k for k, v in vars(knobs).items() if isinstance(v, str) and v in knobs.KNOBS}
    text = "\n".join(p.read_text() for p in _files() if p.suffix == ".py")
    unread = [name for name, const in constants.items()
              if f"knobs.{const}" not in text and name not in text]
    assert not unread, f"declared in kernels/knobs.py but read nowhere: {unread}"


def test_no_environment_read_of_a_knob_outside_the_registry():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in _files() for i, line in enumerate(p.read_text().splitlines(), 1)
           if ENV_READ.search(line) and "ELSA_TEST_KNOB_" not in line]
    assert not bad, f"read ELSA_* variables through kernels/knobs.get, not os.environ: {bad}"


def test_the_package_spells_no_variable_name_outside_the_registry():
    """In the package, a variable's name as a string constant (not prose) appears only in kernels/knobs.py; the
    readers take ``knobs.NAME`` (so a new knob cannot be read without being declared)."""
    bad = []
    for top in PACKAGE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == REGISTRY:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not bad, bad


def test_private_environ_store_only_in_internals():
    bad = [str(p.relative_to(ROOT)) for top in PACKAGE for p in (ROOT / top).rglob("*.py")
           if p.name != "internals.py" and re.search(r"environ\b.*_data\b|\bencodekey\b", p.read_text())]
    assert not bad, bad


def test_configuration_page_is_generated_from_the_registry():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == config.markdown(), "docs/configuration.md is stale: python -m elsa_surgery.config --markdown"
    for name in knobs.KNOBS:
        assert f"`{name}`" in page


BAD = {"int": "zero", "float": "-1", "tiles": "64,32", "stage plan": "rows:4"}


@pytest.mark.parametrize("name", sorted(n for n, k in knobs.KNOBS.items() if k.type != "flag"))
def test_bad_values_name_the_variable_and_the_allowed_values(name, monkeypatch):
    knob = knobs.KNOBS[name]
    monkeypatch.setenv(name, BAD.get(knob.type, "bogus"))
    with pytest.raises(ValueError) as e:
        knobs.get(name)
    assert name in str(e.value) and knob.allowed in str(e.value)
    monkeypatch.setenv(name, "bogus-again")  # errors are not kept: each bad read raises
    with pytest.raises(ValueError):
        knobs.get(name)


def test_values_defaults_and_parses(monkeypatch):
    for name in knobs.KNOBS:
        monkeypatch.delenv(name, raising=False)
    assert knobs.get(knobs.HOPPER) == "1" and knobs.get(knobs.BACKEND) is None
    assert knobs.get(knobs.TEST_RANDOM_CASES) == 8 and knobs.get(knobs.DEBUG) is False
    monkeypatch.setenv(knobs.HOPPER, " Force ")
    assert knobs.get(knobs.HOPPER) == "force"
    monkeypatch.setenv(knobs.BACKEND, "")  # empty: the default
    assert knobs.get(knobs.BACKEND) is None
    monkeypatch.setenv(knobs.LEAN_ETA, "0.5")
    monkeypatch.setenv(knobs.HOPPER_TILES, "64,32,3,4")
    monkeypatch.setenv(knobs.STAGE_PLAN, "rkeys:512")
    monkeypatch.setenv(knobs.NUM_PARTITIONS, "3")
    assert knobs.get(knobs.LEAN_ETA) == 0.5 and knobs.get(knobs.HOPPER_TILES) == (64, 32, 3, 4)
    assert knobs.get(knobs.STAGE_PLAN) == ("rkeys", 512) and knobs.get(knobs.NUM_PARTITIONS) == 3
    monkeypatch.setenv(knobs.PRECISE_SPLIT, "F16")  # case-sensitive, as before
    with pytest.raises(ValueError, match="ELSA_PRECISE_SPLIT"):
        knobs.get(knobs.PRECISE_SPLIT)
    with pytest.raises(KeyError):
        knobs.get("ELSA_NOT_A_KNOB")


def test_reads_are_observed_only_while_a_plan_records(monkeypatch):
    seen = []
    knobs.set_observer(lambda name, key, raw: seen.append((name, raw)))
    try:
        monkeypatch.setenv(knobs.HOPPER, "0")
        assert knobs.get(knobs.HOPPER) == "0"
    finally:
        knobs.set_observer(None)
    knobs.get(knobs.HOPPER)
    assert [n for n, _ in seen] == [knobs.HOPPER] and knobs.decode(seen[0][1]) == "0"


def test_show_prints_every_knob_and_errors(monkeypatch):
    monkeypatch.setenv(knobs.HOPPER_LAZY, "sometimes")
    monkeypatch.setenv(knobs.FP32_PRECISION, "turbo")
    buf = io.StringIO()
    config.show(buf)
    out = buf.getvalue()
    assert all(name in out for name in knobs.KNOBS)
    line = next(l for l in out.splitlines() if l.startswith(knobs.FP32_PRECISION))
    assert "'turbo'" in line
    assert "error: environment variable ELSA_HOPPER_LAZY must be" in out


def test_show_config_flag_of_the_cli():
    res = subprocess.run([sys.executable, "-m", "elsa_surgery.convert", "--show-config"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert all(name in res.stdout for name in knobs.KNOBS)
