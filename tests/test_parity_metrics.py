"""The six drift metrics: definitions checked on hand-made inputs, P read back exactly from a backend."""

import math

import torch

import elsa_surgery
from elsa_surgery import parity


def test_metrics_are_zero_for_identical_inputs():
    p = torch.softmax(torch.randn(2, 5, 7, dtype=torch.float64), -1)
    y = torch.randn(2, 5, 3, dtype=torch.float64)
    m = parity.drift_metrics(p, p.clone(), y, y.clone())
    assert m["argmax"]["rate"] == 0.0
    for name in ("dP_inf", "dP_rel2", "js", "dY_inf", "dY_rel2"):
        assert m[name]["max"] == 0.0


def test_metrics_on_known_values():
    p_ref = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    p_test = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    y_ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    y_test = torch.tensor([[3.0, 4.0], [1.0, 0.5]], dtype=torch.float64)
    rows = parity.drift_per_row(p_ref, p_test, y_ref, y_test)
    assert rows["dP_inf"].tolist() == [0.0, 1.0]
    assert math.isclose(rows["dP_rel2"][1].item(), math.sqrt(2))
    assert math.isclose(rows["js"][1].item(), math.log(2), rel_tol=1e-12)  # disjoint supports
    assert rows["argmax"].tolist() == [0.0, 1.0]
    assert rows["dY_inf"].tolist() == [0.0, 0.5]
    assert math.isclose(rows["dY_rel2"][1].item(), 0.5)
    s = parity.summarize(rows)
    assert s["argmax"]["rate"] == 0.5 and s["dP_inf"]["max"] == 1.0


def test_probabilities_read_back_from_backend_are_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 300, 16, generator=g, dtype=torch.float64)  # crosses an identity block boundary
    p = parity.probabilities(q, k, is_causal=True, backend="reference")
    s = (q @ k.transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.arange(300)[None, :] > torch.arange(9)[:, None] + 291, float("-inf"))
    assert torch.allclose(p, torch.softmax(s, -1), atol=1e-14)


def test_attention_drift_sees_a_wrong_backend(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    good = parity.attention_drift(q, k, v, backend="reference")
    assert good["dY_rel2"]["max"] < 2e-6 and good["dP_inf"]["max"] < 1e-6
    real = elsa_surgery.reference.run

    def skewed(p, return_lse=False):  # a backend with a 1% logit error
        if p.q.dtype == torch.float32:  # leave the float64 oracle alone
            p.scale *= 1.01
        return real(p, return_lse)

    monkeypatch.setattr(elsa_surgery.reference, "run", skewed)
    bad = parity.attention_drift(q, k, v, backend="reference")
    assert bad["dY_rel2"]["max"] > 1e-3 and bad["dP_inf"]["max"] > 1e-4


def test_scenarios_shapes():
    for name, sc in parity.SCENARIOS.items():
        q, k, v = parity.scenario_inputs(sc, rows=8)
        assert q.shape == (1, 1, 8, sc.d) and k.shape == (1, 1, sc.n, sc.d)
    assert (parity.SCENARIOS["regular"].n, parity.SCENARIOS["long"].n, parity.SCENARIOS["stress"].n) == (1024, 8192, 4096)


def test_summary_of_many_rows_on_any_device():
    rows = {name: torch.rand(2**24 + 5, dtype=torch.float64) for name in parity.METRICS}
    s = parity.summarize(rows)
    assert abs(s["dP_inf"]["median"] - 0.5) < 1e-3 and s["dP_inf"]["p99"] > s["dP_inf"]["p95"]
