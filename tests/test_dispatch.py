"""The dispatch decision: one function, explicit > environment > auto, and the reason is always told."""

import logging

import pytest
import torch

import elsa_surgery
from elsa_surgery import dispatch


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def test_auto_on_cpu_picks_reference_and_says_why():
    q = _t(1, 2, 8, 16)
    d = dispatch.decide(q, q, q)
    assert d.backend == "reference" and not d.fallback
    assert "cpu" in d.reason and "Triton kernels need CUDA" in d.reason


def test_explicit_backend_beats_environment(monkeypatch):
    q = _t(1, 2, 8, 16)
    monkeypatch.setenv("ELSA_BACKEND", "sdpa")
    assert dispatch.decide(q, q, q).backend == "sdpa"
    assert dispatch.decide(q, q, q, backend="reference").backend == "reference"


def test_precision_from_environment(monkeypatch):
    monkeypatch.setenv("ELSA_FP32_PRECISION", "turbo")
    assert dispatch.requested_precision(None) == "turbo"
    assert dispatch.requested_precision("strict") == "strict"
    monkeypatch.setenv("ELSA_FP32_PRECISION", "fast")
    with pytest.raises(ValueError, match="ELSA_FP32_PRECISION"):
        dispatch.requested_precision(None)


def test_forced_elsa_without_cuda_or_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = _t(1, 2, 8, 16)
    with pytest.raises(elsa_surgery.BackendUnavailable, match="need CUDA"):
        elsa_surgery.attention(q, q, q, backend="elsa")


def test_record_collects_decisions_and_fallbacks_are_logged(caplog):
    q = _t(1, 2, 8, 16)
    with dispatch.record() as log:
        elsa_surgery.attention(q, q, q)
        elsa_surgery.attention(q, q, q, backend="sdpa")
    assert [d.backend for d in log] == ["reference", "sdpa"]
    with caplog.at_level(logging.WARNING, logger="elsa_surgery"):
        dispatch._logged.clear()
        dispatch.announce(dispatch.Decision("reference", None, "fallback to reference: test reason", fallback=True))
    assert "test reason" in caplog.text


def test_sdpa_backend_refuses_lse_and_varlen():
    q = _t(1, 2, 8, 16)
    with pytest.raises(ValueError, match="return_lse"):
        elsa_surgery.attention(q, q, q, backend="sdpa", return_lse=True)
