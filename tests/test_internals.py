"""The version gate of kernels/internals.py (every private Triton / CPython internal the project uses), on the CPU
with stand-in versions: a checked version takes the private fast path, any other the public one, with one log line
per process."""

import logging
import os

import pytest
import torch

from elsa_surgery.kernels import internals, replay


@pytest.fixture
def fresh_gate(monkeypatch):
    monkeypatch.setattr(internals, "_logged", set())
    monkeypatch.setattr(internals, "_TRITON_OK", [])


def test_python_gate_picks_the_private_store_only_where_checked(fresh_gate, caplog):
    checked = internals.CHECKED_PYTHON[0]
    store, encode = internals.environ_store(checked)
    if isinstance(getattr(os.environ, "_data", None), dict):
        assert store is os.environ._data and encode("ELSA_HOPPER") == os.environ.encodekey("ELSA_HOPPER")
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        store, encode = internals.environ_store((3, 99))
        assert store is os.environ and encode("ELSA_HOPPER") == "ELSA_HOPPER"
        internals.environ_store((3, 99))
        internals.python_private_ok((3, 98))
    lines = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(lines) == 1 and "Python 3.99" in lines[0] and "public path" in lines[0]


def test_public_store_reads_like_the_private_one(monkeypatch):
    """The knob registry and the call memo read raw values from either store; both agree on what is set."""
    monkeypatch.setenv("ELSA_HOPPER", "force")
    private, enc = internals.environ_store(internals.CHECKED_PYTHON[0])
    public, penc = internals.environ_store((2, 7))
    raw = private.get(enc("ELSA_HOPPER"))
    assert (raw.decode() if isinstance(raw, bytes) else raw) == public.get(penc("ELSA_HOPPER")) == "force"


def test_triton_gate_with_stand_in_versions(fresh_gate, caplog):
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        assert internals.triton_private_ok(internals.CHECKED_TRITON[0])
        assert internals.triton_private_ok((3, 6, 0))  # patch releases of a checked minor version
        assert not internals.triton_private_ok((3, 99))
        assert not internals.triton_private_ok((3, 99))
    lines = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(lines) == 1 and "Triton 3.99" in lines[0]


def test_installed_triton_is_judged_once(fresh_gate, monkeypatch):
    calls = []
    monkeypatch.setattr(internals, "triton_version", lambda: calls.append(1) or (3, 99))
    assert not internals.triton_private_ok() and not internals.triton_private_ok()
    assert calls == [1]


def _recorded_launch(monkeypatch, gate_open: bool):
    """A launch recorded with a stand-in compiled kernel that passes the source checks: the gate decides whether the
    plan keeps it (direct replay through Triton's launcher) or launches through ``kernel[grid]``."""
    monkeypatch.setattr(internals, "_TRITON_OK", [gate_open])
    monkeypatch.setattr(replay, "_direct_ok", lambda fn, kernel: True)

    class Fn:  # a JIT function's Python signature
        fn = staticmethod(lambda x, n: None)

    rec = replay._Recorder({"x": torch.zeros(4)})
    rec.add(Fn(), object(), (1,), (rec.slots["x"], 4), {})
    (one,) = rec.launches
    return one


def test_unchecked_triton_replays_through_the_public_launch(monkeypatch):
    assert _recorded_launch(monkeypatch, True).kernel is not None
    assert _recorded_launch(monkeypatch, False).kernel is None


def test_descriptor_encoding_needs_a_checked_triton(monkeypatch):
    """Hopper's size threshold for eager calls is lifted only where replays encode TMA maps: never on an unchecked
    Triton (``encodes_descriptors``), whatever the source checks say."""
    monkeypatch.setattr(internals, "_TRITON_OK", [False])
    monkeypatch.setattr(replay, "wanted", lambda t: True)
    monkeypatch.setattr(replay, "_desc_module", lambda cls: object())
    assert not replay.encodes_descriptors(torch.zeros(1))
