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


@pytest.mark.parametrize("cap,mode", [((9, 0), "precise"), ((8, 0), "precise"), ((7, 5), "strict"), (None, "strict")])
def test_precision_none_means_one_mode_at_every_layer(monkeypatch, cap, mode):
    """precision=None: the same fp32 mode in elsa_surgery.attention's dispatch and in the kernels' launcher
    (issue 30: it was precise in the one and strict in the other on sm80+)."""
    from elsa_surgery.kernels import launch, occupancy

    dev = torch.device("cuda", 0) if cap else torch.device("cpu")
    monkeypatch.setattr(occupancy, "capability", lambda index: cap)
    monkeypatch.delenv("ELSA_FP32_PRECISION", raising=False)
    assert dispatch.default_precision(dev) == mode
    assert launch._dot_kind(torch.float32, None, dev) == occupancy.DOT_OF_PRECISION[mode]
    q = _t(1, 2, 8, 16)
    if dev.type == "cpu":  # the whole decision too (a CUDA device cannot be faked for decide's tensors)
        assert dispatch.decide(q, q, q, backend="elsa").precision == mode


def test_forced_elsa_without_cuda_or_interpreter_raises(monkeypatch):
    dispatch.kernels_module()  # triton is imported with the interpreter on (conftest), as later tests need it
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


def _auto_as_on_a_gpu(monkeypatch):
    """``auto`` as it decides on a GPU, on CPU tensors: the kernels run in the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "auto_runs_kernels_on", lambda device: True)


@pytest.mark.parametrize("case,why", [
    ("head dim 264", "D=264: the kernels take head dims from 8 to 256"),
    ("float64", "dtype torch.float64"),
])
def test_auto_falls_back_to_reference_and_says_why(monkeypatch, caplog, case, why):
    """Unsupported cases under ``auto`` (as on a GPU) run the reference backend, the reason logged once and
    recorded as a fallback; under ``backend="elsa"`` the same calls raise with that reason."""
    _auto_as_on_a_gpu(monkeypatch)
    dtype = torch.float64 if case == "float64" else torch.float32
    d = 264 if case == "head dim 264" else 16
    q, k, v = _t(1, 2, 8, d, dtype=dtype), _t(1, 2, 12, d, dtype=dtype), _t(1, 2, 12, d, dtype=dtype)
    drop = 0.0
    dispatch._logged.clear()
    with dispatch.record() as log, caplog.at_level(logging.WARNING, logger="elsa_surgery"):
        torch.manual_seed(0)
        out = elsa_surgery.attention(q, k, v, dropout_p=drop)
    assert [(x.backend, x.fallback) for x in log] == [("reference", True)], log
    assert why in log[0].reason and why in caplog.text
    torch.manual_seed(0)
    assert torch.equal(out, elsa_surgery.attention(q, k, v, dropout_p=drop, backend="reference"))
    with pytest.raises(elsa_surgery.BackendUnavailable, match=why.split(":")[0].replace("(", r"\(").replace(")", r"\)")):
        elsa_surgery.attention(q, k, v, dropout_p=drop, backend="elsa")


def test_auto_runs_dropout_on_the_kernels(monkeypatch):
    """Attention dropout no longer leaves the kernels (issue 25): ``auto`` (as on a GPU) runs it on them."""
    _auto_as_on_a_gpu(monkeypatch)
    q = _t(1, 2, 8, 16)
    with dispatch.record() as log:
        elsa_surgery.attention(q, q, q, dropout_p=0.25)
    assert [(x.backend, x.fallback) for x in log] == [("elsa", False)], log


def test_auto_runs_the_kernels_when_it_can(monkeypatch):
    _auto_as_on_a_gpu(monkeypatch)
    q = _t(1, 2, 8, 16)
    with dispatch.record() as log:
        elsa_surgery.attention(q, q, q)
    assert [(x.backend, x.fallback) for x in log] == [("elsa", False)], log
