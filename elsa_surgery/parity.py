"""Drift metrics of the ELSA supplementary, measured against a float64 oracle.

For each query row, with ``P`` the attention probabilities and ``Y`` the output:

====================  ==================================================================
``dP_inf``            ``max_j |P_test - P_ref|``
``dP_rel2``           ``||P_test - P_ref||_2 / ||P_ref||_2``
``js``                Jensen-Shannon divergence between the two rows of ``P`` (nats)
``argmax``            1 when ``argmax P_test != argmax P_ref`` (reported as a rate)
``dY_inf``            ``max_d |Y_test - Y_ref|``
``dY_rel2``           ``||Y_test - Y_ref||_2 / ||Y_ref||_2``
====================  ==================================================================

Summaries give the median, p95, p99 and max over rows (the argmax metric: the disagreement rate).

No backend materialises ``P``; we read it out of the backend itself: attention with the values set
to the identity matrix returns ``P`` (``y_i = Σ_j P_ij e_j``). So ``P_test`` is the probability matrix
the backend really applies, in its own precision mode, computed in column blocks of the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from .api import attention

METRICS = ("dP_inf", "dP_rel2", "js", "argmax", "dY_inf", "dY_rel2")
IDENTITY_BLOCK = 256  # value width of each identity block (the kernels' largest head dim)


def _per_row_js(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence per row of two row-stochastic matrices (float64, nats)."""
    p = p.clamp_min(0)
    q = q.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-300)
    mid = 0.5 * (p + q)

    def kl(a, b):
        ratio = torch.where(a > 0, a / b.clamp_min(1e-300), torch.ones_like(a))
        return (a * torch.log(ratio)).sum(-1)

    return 0.5 * kl(p, mid) + 0.5 * kl(q, mid)


def drift_per_row(p_ref, p_test, y_ref, y_test) -> Dict[str, torch.Tensor]:
    """Per-row values of the six metrics. ``p_*``: ``[..., Nq, Nk]``; ``y_*``: ``[..., Nq, Dv]``."""
    p_ref, p_test = p_ref.double(), p_test.double()
    y_ref, y_test = y_ref.double(), y_test.double()
    dp = p_test - p_ref
    dy = y_test - y_ref
    tiny = torch.finfo(torch.float64).tiny
    rows = {
        "dP_inf": dp.abs().amax(-1),
        "dP_rel2": dp.norm(dim=-1) / p_ref.norm(dim=-1).clamp_min(tiny),
        "js": _per_row_js(p_ref, p_test),
        "argmax": (p_ref.argmax(-1) != p_test.argmax(-1)).double(),
        "dY_inf": dy.abs().amax(-1),
        "dY_rel2": dy.norm(dim=-1) / y_ref.norm(dim=-1).clamp_min(tiny),
    }
    return {k: v.reshape(-1) for k, v in rows.items()}


def summarize(rows: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, float]]:
    out = {}
    for name in METRICS:
        x = rows[name].double()
        if name == "argmax":
            out[name] = {"rate": float(x.mean()) if x.numel() else 0.0}
            continue
        if x.numel() == 0:
            out[name] = {"median": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
            continue
        # numpy: any device's rows (moved to the host) and any count (torch.quantile stops at 2**24)
        qs = np.quantile(x.detach().cpu().numpy(), [0.5, 0.95, 0.99])
        out[name] = {"median": float(qs[0]), "p95": float(qs[1]), "p99": float(qs[2]), "max": float(x.max())}
    return out


def drift_metrics(p_ref, p_test, y_ref, y_test) -> Dict[str, Dict[str, float]]:
    """The six metrics, summarised (median / p95 / p99 / max; argmax as a rate)."""
    return summarize(drift_per_row(p_ref, p_test, y_ref, y_test))


def probabilities(q, k, *, attn_mask=None, is_causal=False, scale=None, backend="auto", precision=None):
    """The attention probabilities ``[B, Hq, Nq, Nk]`` a backend applies (values = identity, in blocks)."""
    B, Hkv, Nk = k.shape[0], k.shape[1], k.shape[2]
    cols = []
    for j0 in range(0, Nk, IDENTITY_BLOCK):
        j1 = min(Nk, j0 + IDENTITY_BLOCK)
        eye = torch.zeros(Nk, j1 - j0, dtype=k.dtype, device=k.device)
        eye[j0:j1] = torch.eye(j1 - j0, dtype=k.dtype, device=k.device)
        v = eye.expand(B, Hkv, Nk, j1 - j0)
        cols.append(attention(q, k, v, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True,
                              backend=backend, precision=precision))
    return torch.cat(cols, dim=-1)


def attention_drift(q, k, v, *, attn_mask=None, is_causal=False, scale=None, backend="auto",
                    precision=None, with_rows: bool = False):
    """Six drift metrics of ``backend`` on ``(q, k, v)`` against the float64 reference oracle."""
    kw = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    o64 = dict(kw, attn_mask=None if attn_mask is None else (attn_mask if attn_mask.dtype == torch.bool else attn_mask.double()))
    y_test = attention(q, k, v, enable_gqa=True, backend=backend, precision=precision, **kw)
    y_ref = attention(q.double(), k.double(), v.double(), enable_gqa=True, backend="reference", **o64)
    p_test = probabilities(q, k, backend=backend, precision=precision, **kw)
    p_ref = probabilities(q.double(), k.double(), backend="reference", **o64)
    rows = drift_per_row(p_ref, p_test, y_ref, y_test)
    return (summarize(rows), rows) if with_rows else summarize(rows)


# --------------------------------------------------------------------------------------------------
# the paper's scenarios
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    name: str
    n: int
    d: int
    description: str
    logit_std: float = 1.0  # standard deviation of the logits q·k·scale
    near_ties: bool = False


SCENARIOS = {
    "regular": Scenario("regular", 1024, 64, "n=1024, d=64, Gaussian q/k/v (logit std 1)"),
    "long": Scenario("long", 8192, 64, "n=8192, d=64, Gaussian q/k/v (logit std 1)"),
    "long16k": Scenario("long16k", 16384, 64, "n=16384, d=64, Gaussian q/k/v (logit std 1)"),
    "long64k": Scenario("long64k", 65536, 64, "n=65536, d=64, Gaussian q/k/v (logit std 1)"),
    "stress": Scenario("stress", 4096, 64,
                       "n=4096, d=64, adversarial logits: std 12, and 16 clusters of 8 near-duplicate keys (1e-4 apart)",
                       logit_std=12.0, near_ties=True),
}


def scenario_inputs(sc: Scenario, *, rows: Optional[int] = None, heads: int = 1, dtype=torch.float32,
                    device="cpu", seed: int = 0):
    """``(q, k, v)`` for a scenario; ``rows`` samples that many query rows (all keys are kept)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nq = sc.n if rows is None else min(rows, sc.n)
    # q·k·d^-0.5 has std sigma_q · sigma_k: the requested logit spread goes into q.
    q = torch.randn(1, heads, nq, sc.d, generator=g, dtype=torch.float64) * sc.logit_std
    k = torch.randn(1, heads, sc.n, sc.d, generator=g, dtype=torch.float64)
    v = torch.randn(1, heads, sc.n, sc.d, generator=g, dtype=torch.float64)
    if sc.near_ties:
        # Near-ties: 16 source keys, each copied 8 times with a 1e-4 relative perturbation, so rows whose
        # maximum falls in a cluster have 8 almost equal top logits (argmax and P are then fragile).
        src = torch.randint(0, sc.n, (16,), generator=g)
        dst = torch.randperm(sc.n, generator=g)[: 16 * 8].view(16, 8)
        for a, targets in zip(src.tolist(), dst):
            for j in targets.tolist():
                k[:, :, j] = k[:, :, a] * (1 + 1e-4 * torch.randn(1, heads, sc.d, generator=g, dtype=torch.float64))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def scenario_drift(name: str, *, backend="auto", precision=None, dtype=torch.float32, device="cpu",
                   rows: Optional[int] = 256, heads: int = 1, seed: int = 0):
    sc = SCENARIOS[name]
    q, k, v = scenario_inputs(sc, rows=rows, heads=heads, dtype=dtype, device=device, seed=seed)
    return attention_drift(q, k, v, backend=backend, precision=precision)
