"""Gradient fidelity (issue 25): a differential fuzzer of ``elsa_surgery.attention``'s backward against the float64
oracle's autograd (``tests/oracle.naive_attention``: ELSA's documented semantics, bottom-right ``is_causal``
intersected with a mask, rows with no visible key giving zeros and zero gradients).

Hypothesis draws calls from the forward fuzzer's space (``test_sdpa_fidelity.cases``: GQA/MQA, Nq != Nk, N = 1, head
dims inside and outside the kernels' range, strided and stride-0 inputs, bool and additive masks of every broadcast
shape with -inf, large finite values and fully masked rows, ``CausalBias``, ``scale``, ``return_lse``), without
autocast; the kernels' test also draws attention dropout (p = 0.3, the oracle taking the kernels' own keep mask
through the debug hook). q, k, v and an additive mask require grad in their own layouts; the loss is ``<out, g>``
for a random ``g``, plus ``<lse, g_lse>`` where the case returns the lse. A case passes when ELSA refuses its
forward (the forward fuzzer judges refusals), or returns finite gradients of each input's shape whose error is
within the dtype's tolerance (plus what rounding the logits costs, as the forward fuzzer allows) of the larger of
the oracle's gradient and a share of its terms' magnitude (:func:`_magnitudes`: a sum that cancels, such as dK where
each row sees one key or a mask constant along a row, has no relative error to speak of).

Budgets: CI runs ``GRAD_FUZZ_CPU`` cases of ``auto``/``reference`` on the CPU, and ``GRAD_FUZZ_INTERP`` cases of the
Triton kernels in the interpreter through each of the backward's paths (:data:`PATHS`; env, default 16 a path, at
most ``GRAD_FUZZ_INTERP_N`` query rows and keys, env, default 12), checking that each path's kernels ran. The
GPU-marked test draws ``GRAD_FUZZ_GPU`` cases (env, default 2,000) on CUDA with the compiled kernels, also through the
default dispatch, fp32 strict and Hopper's Gluon backwards (:data:`GPU_PATHS`; ``bash tools/gpu_suite.sh grad-fuzz``);
each outcome names the Gluon kernels that ran.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import CausalBias

import elsa_surgery
from elsa_surgery import benchmark
from oracle import naive_attention
from test_sdpa_fidelity import FUZZ, DTYPES, TRACE, Case, _interpreting, build, cases, effective_mask, logits

GRAD_FUZZ_CPU = 150
GRAD_FUZZ_INTERP = int(os.environ.get("GRAD_FUZZ_INTERP", "16"))  # a backward path
GRAD_FUZZ_INTERP_N = int(os.environ.get("GRAD_FUZZ_INTERP_N", "12"))  # longest Nq, Nk (exploring: 40 crosses tiles)
GRAD_FUZZ_GPU = int(os.environ.get("GRAD_FUZZ_GPU", "2000"))
# relative L2 error of each gradient against the float64 oracle's (test_backward.TOL's, fp32 with room for the
# fuzzer's scales and masks)
GRAD_TOL = {"float64": 1e-9, "float32": 5e-5, "float16": 3e-2, "bfloat16": 8e-2}


def _leafs(*ts):
    """Each tensor of ``ts`` (a view keeps its strides) as a leaf that requires grad; others unchanged."""
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.is_floating_point():
            t = t.detach().requires_grad_()
        out.append(t)
    return out


def _scale(case) -> float:
    return case.D ** -0.5 if case.scale is None else case.scale


def _rows(case, q, k, mask):
    """``(logits, empty)`` in float64 under ELSA's semantics (``mask`` the oracle's, :func:`_oracle_mask`), each row
    that sees no key set to 0 (its logsumexp and softmax would be NaN, and their gradients), and those rows
    (``[B, Hq, Nq, 1]`` bool)."""
    sc = logits(case, q, k, effective_mask(case, mask, "cpu", torch.float64))
    empty = (sc == float("-inf")).all(-1, keepdim=True)
    return sc.masked_fill(empty, 0.0), empty


def _probs(case, q, k, mask):
    """The probabilities in float64, rows that see no key all zeros."""
    sc, empty = _rows(case, q, k, mask)
    return torch.softmax(sc, dim=-1).masked_fill(empty, 0.0)


def _oracle_mask(case, mask):
    """The mask as the oracle takes it (a float64 leaf for an additive tensor, CausalBias materialised as bool)."""
    if isinstance(mask, CausalBias):
        return mask._materialize("cpu"), False
    if mask is None or mask.dtype == torch.bool:  # (on the CPU: the oracle's device, a GPU case's too)
        return mask if mask is None else mask.cpu(), False
    return mask.detach().cpu().double().requires_grad_(), True


# the kernels' backward paths a case may take (grad_check's ``path``): the one-launch backward (calls of at most 64
# query rows and keys, their default), the general passes with dQ by the row pass or by atomic adds, and fp32's
# fp16 split (precise: three products, turbo: one; dQ by rows)
PATHS = {"short": {"ELSA_BWD_SHORT": "1"},
         "rows": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_DQ": "rows"},
         "atomic": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_DQ": "atomic"},
         "precise-split": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_SPLIT": "f16", "ELSA_BWD_DQ": "rows"},
         "turbo-split": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_SPLIT": "f16", "ELSA_BWD_DQ": "rows"}}
# the GPU's further paths (Hopper's Gluon backwards, which the interpreter cannot run): fp32 strict (the Gluon FMA
# passes wherever ``hopper_backward.eligible``; fp32's default on a GPU is precise) and the fp16/bf16 Gluon kernel in
# its forms (``ELSA_BWD_DQ=gluon`` takes it at every size; auto from 1K rows, past the GPU fuzzer's lengths)
GPU_PATHS = {**PATHS, "strict": {}, "gluon": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_DQ": "gluon"},
             "gluon-ws": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_DQ": "gluon", "ELSA_BWD_LOWP": "ws"},
             "gluon-plain": {"ELSA_BWD_SHORT": "0", "ELSA_BWD_DQ": "gluon", "ELSA_BWD_LOWP": "plain"}}


def _gpu_paths() -> list:
    """The GPU test's paths: ``GRAD_FUZZ_PATHS`` (env: names of :data:`GPU_PATHS` or ``default``, comma-separated,
    e.g. ``strict,gluon`` to hunt there), else the default dispatch twice as often as each of :data:`GPU_PATHS`."""
    names = os.environ.get("GRAD_FUZZ_PATHS")
    if not names:
        return ["default", "default"] + list(GPU_PATHS)
    chosen = names.split(",")
    unknown = sorted(set(chosen) - set(GPU_PATHS) - {"default"})
    if unknown:
        raise ValueError(f"GRAD_FUZZ_PATHS: unknown path(s) {unknown}; known: default, {', '.join(GPU_PATHS)}")
    return chosen


TURBO_TOL = 3e-3  # test_backward.TURBO_SPLIT_TOL: one fp16 product of operands rounded to 11 significant bits


def grad_check(case: Case, path: str = "default", dropout_p: float = 0.0) -> str:
    """Run one case's forward and backward on ELSA (through ``path``'s knobs, :data:`PATHS`) and on the oracle, and
    judge the gradients (module docstring); returns the outcome's name. ``dropout_p`` (``backend="elsa"``): the
    kernels draw their keep mask from ``torch.manual_seed(case.seed)``; the oracle gets the same mask through the
    debug hook (``kernels.training.dropout_keep_mask``), ``softmax * keep / (1 - p)``."""
    precision = None
    if path.endswith("-split") or path == "strict":  # fp32 modes: other dtypes take the row pass, or the default
        if case.dtype == "float32":
            precision = path.split("-")[0]
        else:
            path = "default" if path == "strict" else "rows"
    q, k, v, mask = build(case)
    q, k, v, mask = _leafs(q, k, v, mask)
    gen = torch.Generator().manual_seed(case.seed + 1)
    with benchmark.environ(GPU_PATHS.get(path, {})), _hopper_runs(q.is_cuda) as hopper:
        torch.manual_seed(case.seed)
        try:
            res = elsa_surgery.attention(q, k, v, attn_mask=mask, is_causal=case.is_causal, scale=case.scale,
                                         enable_gqa=case.enable_gqa, backend=case.backend, return_lse=case.return_lse,
                                         precision=precision, dropout_p=dropout_p)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            return f"refused: {type(exc).__name__}: {str(exc)[:70]}"
        out, lse = res if case.return_lse else (res, None)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        loss = (out.double() * g.to(out.device)).sum()
        g_lse = None
        if lse is not None:
            g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
            loss = loss + (torch.where(lse.isinf(), 0.0, lse.double()) * g_lse.to(lse.device)).sum()
        inputs = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)

    rq, rk, rv = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    rm, mask_grad = _oracle_mask(case, mask)
    full = (case.B, case.Hq, case.Nq, case.Nk)
    om = rm if rm is None else rm.expand(full)
    ds = None
    if mask_grad:  # the logits' gradient at full shape: the mask's gradient before its broadcast reduction
        ds = torch.zeros(full, dtype=torch.float64, requires_grad=True)
        om = om + ds
    if dropout_p:
        ro = _dropped_oracle(case, q, k, v, rq, rk, rv, om, dropout_p)
    else:
        ro, _ = naive_attention(rq, rk, rv, om, is_causal=case.is_causal, scale=case.scale)
    rloss = (ro * g).sum()
    if g_lse is not None:  # the lse from the logits with empty rows set aside (logsumexp's gradient there is NaN)
        sc, empty = _rows(case, rq, rk, om)
        rl = torch.logsumexp(sc, dim=-1)
        rloss = rloss + (rl * g_lse).masked_fill(empty.squeeze(-1), 0.0).sum()
    ref_inputs = [rq, rk, rv] + ([rm, ds] if mask_grad else [])
    ref = torch.autograd.grad(rloss, ref_inputs, allow_unused=True)
    tol = (TURBO_TOL if precision == "turbo" else GRAD_TOL[case.dtype]) + _rounding(case, rq, rk, om, precision)
    floors = _magnitudes(case, rq.detach(), rk.detach(), rv.detach(), None if om is None else om.detach(), g,
                         1 / (1 - dropout_p))
    for name, t, gt, gr in zip("qkvm", inputs, grads, ref):
        if gt is None:
            gt = torch.zeros_like(t)
        if gt.shape != t.shape:
            raise AssertionError(f"d{name} has shape {tuple(gt.shape)}, the input {tuple(t.shape)}\n    {case!r}")
        if not bool(torch.isfinite(gt).all()):
            raise AssertionError(f"d{name} is not finite\n    grad_check({case!r})")
        gr = torch.zeros_like(gt, dtype=torch.float64, device="cpu") if gr is None else gr
        gt = gt.detach().cpu().double()
        # relative to the gradient, or to its terms' magnitude where the exact sum cancels (a row seeing one key
        # has dS = p (dP - delta) = 0 exactly, so dK's own size is 0; a mask constant along a row has gradient 0)
        size = max(float(gr.norm()), FLOOR_FRACTION * floors[name])
        err = float((gt - gr).norm()) / size if size else float((gt - gr).norm())
        if not err <= tol:
            raise AssertionError(f"d{name}: error {err:.3g} of max(|grad|, {FLOOR_FRACTION} x its terms) "
                                 f"> {tol:.3g}\n    grad_check({case!r})")
    ran = " + ".join(name for name, spy in hopper.items() if spy.call_count)
    return f"match ({path}{f', dropout {dropout_p}' if dropout_p else ''}{f', {ran} ran' if ran else ''})"


@contextlib.contextmanager
def _hopper_runs(cuda: bool):
    """Spies on Hopper's Gluon backwards inside the block (CUDA cases; none elsewhere): ``{name: spy}``, whose call
    counts say whether they ran (a Gluon path's case may run the portable passes: masks, dropout, shapes out of
    their scope)."""
    from elsa_surgery.kernels import hopper_backward

    with contextlib.ExitStack() as stack:
        yield {short: stack.enter_context(mock.patch.object(hopper_backward, name,
                                                            wraps=getattr(hopper_backward, name)))
               for name, short in (("lowp_backward", "gluon"), ("backward", "gluon-strict")) if cuda}


def _dropped_oracle(case, q, k, v, rq, rk, rv, om, p):
    """The float64 output under the kernels' own keep mask for this case's seed. The counters depend on the batch
    row, head, row and key of the problem the kernels run, not on the mask or the layouts (the hook draws for
    contiguous copies); an upper-left ``CausalBias`` runs as the problems ``semantics.causal_bias`` makes of it: the
    first Nq keys when Nq <= Nk, else two row pieces, each launch drawing its own seed in turn."""
    from elsa_surgery.kernels import training

    torch.manual_seed(case.seed)
    scale = _scale(case)
    qc, kc, vc = (t.detach().contiguous() for t in (q, k, v))

    def hook(qs, ks, vs):
        return training.dropout_keep_mask(qs, ks, vs, training.draw_seed(q.device), scale=scale, dropout_p=p).cpu()

    nq, nk = case.Nq, case.Nk
    with torch.no_grad():
        if case.mask != "causal_upper_left":
            keep = hook(qc, kc, vc)
        elif nq <= nk:
            keep = torch.zeros(case.B, case.Hq, nq, nk, dtype=torch.bool)
            keep[..., :nq] = hook(qc, kc[:, :, :nq], vc[:, :, :nq])
        else:
            keep = torch.cat([hook(qc[:, :, :nk], kc, vc), hook(qc[:, :, nk:], kc, vc)], dim=2)
    return (_probs(case, rq, rk, om) * keep / (1 - p)) @ rv.repeat_interleave(case.Hq // case.Hkv, 1)


# a gradient is compared against this share of its terms' magnitude at least (their Frobenius bound overstates the
# size of a product by up to ~sqrt(min(N, D)))
FLOOR_FRACTION = 0.25


def _magnitudes(case, q, k, v, mask, g, boost: float = 1.0) -> dict:
    """The Frobenius size of each gradient's terms before they cancel, in float64: for the logits (the mask's
    gradient before its broadcast sum) ``P (|dO| |V|^T + delta')``, ``delta'`` the row sums of ``P |dO| |V|^T``; that
    times ``scale |K|`` for dQ and ``scale |Q|`` for dK, ``|P| |dO|`` for dV (Cauchy-Schwarz bounds of the
    products)."""
    scale = _scale(case)
    p = _probs(case, q, k, mask) * boost  # dropout's 1 / (1 - p)
    grp = case.Hq // case.Hkv
    dp = g.abs() @ v.abs().repeat_interleave(grp, 1).transpose(-1, -2)  # dP's terms, before they cancel too
    delta = (p * dp).sum(-1, keepdim=True)
    ds = float((p * (dp + delta)).norm())
    return {"q": scale * ds * float(k.norm()) * grp ** 0.5, "k": scale * ds * float(q.norm()),
            "v": float(p.norm() * g.norm()), "m": ds}


# the unit roundoff of the products behind the logits, by fp32 mode: turbo's operands keep 11 significant bits (TF32,
# or the fp16 split's hi part alone), precise's three fp16 products ~22; fp32 itself 2^-24 (fp16/bf16 inputs too:
# their products are exact in fp32)
LOGIT_UNIT = {"turbo": 2.0 ** -11, "precise": 2.0 ** -22}


def _rounding(case, q, k, mask, precision=None) -> float:
    """What rounding the logits costs (the forward fuzzer's ``rounding_allowance``): a logit of magnitude ``|s|`` is
    rounded by ``u |s|`` per operation (:data:`LOGIT_UNIT`; float64 2^-53), three operations, and the forward and the
    backward's recomputation of ``s`` may round differently (turbo's forward by TF32, its backward by the fp16 split),
    so ``p = exp(s - lse)`` and every gradient carry that relative error; a mask of -1e4 shifting a whole row costs
    ~2e-3 in fp32 alone, where SDPA pays the same."""
    fp32 = 2.0 ** -53 if case.dtype == "float64" else 2.0 ** -24
    u = LOGIT_UNIT.get(precision, fp32)
    if mask is None or mask.dtype == torch.bool:
        big = 0.0
    else:
        m = mask.detach()
        big = float(m[torch.isfinite(m)].abs().max()) if bool(torch.isfinite(m).any()) else 0.0
    scale = _scale(case)
    grp = case.Hq // case.Hkv
    logit = 0.0
    if q.numel() and k.numel():  # the largest sum of |q_d k_d| over a (query, key) pair
        logit = float((q.detach().abs() @ k.detach().abs().repeat_interleave(grp, 1).transpose(-1, -2)).max()) * scale
    return 6 * (u * logit + fp32 * big)


def _no_autocast(case_strategy):
    return case_strategy.map(lambda c: Case(**{**c.__dict__, "autocast": "none", "v_dtype": "same"}))


def _answerable(c: Case) -> Case:
    """The case with the forward's refusals taken out, so that the kernels' budget goes to gradients: GQA asked for
    where the heads differ, Dv = 12 (outside the kernels' head dims) as 24, no ``is_causal`` beside a CausalBias."""
    return Case(**{**c.__dict__, "enable_gqa": c.enable_gqa or c.Hq != c.Hkv, "Dv": 24 if c.Dv == 12 else c.Dv,
                   "is_causal": c.is_causal and not c.mask.startswith("causal")})


@settings(FUZZ, max_examples=GRAD_FUZZ_CPU)
@given(case=_no_autocast(cases(backends=["reference", "auto"], max_n=24)))
def test_grad_fuzz_cpu(case):
    note(f"grad_check({case!r})")
    event(f"{case.backend}: {grad_check(case)}")


# what each path must have launched, by the backward kernels' names (conftest's backward_kernels_fetched), dQ's mode
# (backward_launch._launches' ``atomic``: "atomic-dq" or "rows-dq") and, for the split, scan.split_f16's operands
# (backward_launch._split_operands)
PATH_KERNELS = {"short": {"bwd_short"}, "rows": {"bwd_kv", "row_pass", "rows-dq"}, "atomic": {"bwd_kv", "atomic-dq"},
                "precise-split": {"bwd_kv", "row_pass", "split"}, "turbo-split": {"bwd_kv", "row_pass", "split"}}


@pytest.mark.skipif(torch.cuda.is_available() or not _interpreting(), reason="the interpreter run (CPU only)")
@pytest.mark.parametrize("path", list(PATHS))
def test_grad_fuzz_kernels_interpreter(path, backward_kernels_fetched, monkeypatch):
    """``GRAD_FUZZ_INTERP`` cases through each backward path; the path's kernels must have run (a knob that stopped
    steering them would leave the fuzzer testing another path)."""
    from elsa_surgery.kernels import backward_launch

    seen = backward_kernels_fetched
    split, launches = backward_launch._split_operands, backward_launch._launches
    monkeypatch.setattr(backward_launch, "_split_operands", lambda *a: seen.add("split") or split(*a))
    monkeypatch.setattr(backward_launch, "_launches", lambda *a, **kw: seen.add(
        "atomic-dq" if kw["atomic"] else "rows-dq") or launches(*a, **kw))

    @settings(FUZZ, max_examples=GRAD_FUZZ_INTERP)
    @given(case=_no_autocast(cases(backends=["elsa"], max_n=GRAD_FUZZ_INTERP_N, head_dims=[8, 16, 24, 40, 64, 8, 16],
                                   dtypes=("float32",) if path.endswith("split") else
                                   ("float32", "float16", "bfloat16"))).map(_answerable),
           dropout_p=st.sampled_from([0.0, 0.0, 0.3]))
    def fuzz(case, dropout_p):
        note(f"grad_check({case!r}, {path!r}, {dropout_p!r})")
        event(f"{case.backend}: {grad_check(case, path, dropout_p)}")

    fuzz()
    assert PATH_KERNELS[path] <= backward_kernels_fetched, (path, backward_kernels_fetched)
    if path == "atomic":
        assert "rows-dq" not in backward_kernels_fetched


@pytest.mark.gpu
@settings(FUZZ, max_examples=GRAD_FUZZ_GPU)
@given(case=_no_autocast(cases(backends=["elsa", "auto"], device="cuda", max_n=200,
                               dtypes=("float32", "float16", "bfloat16"))),
       path=st.sampled_from(_gpu_paths()), dropout_p=st.sampled_from([0.0, 0.0, 0.3]))
def test_grad_fuzz_gpu(case, path, dropout_p):
    dropout_p = dropout_p if case.backend == "elsa" else 0.0  # (auto may take SDPA, whose keep mask is its own)
    note(f"grad_check({case!r}, {path!r}, {dropout_p!r})")
    if TRACE:  # (tools/gpu_fuzz.sh: a case that breaks the CUDA context cannot be replayed by Hypothesis)
        with open(TRACE, "a") as f:
            f.write(f"grad_check({case!r}, {path!r}, {dropout_p!r})\n")
    outcome = f"{case.backend} {case.dtype}: {grad_check(case, path, dropout_p)}"
    if TRACE:  # each outcome beside the trace (gpu_fuzz.sh counts them: Hypothesis's statistics print only at the end
        # of a run, and the clock stops most runs)
        with open(TRACE + ".outcomes", "a") as f:
            f.write(outcome[:110] + "\n")
    event(outcome)


def test_grad_fuzz_strategy_reaches_masks_and_gqa():
    """The strategy (a guard against a map that drops what the forward fuzzer draws): its cases include additive
    masks, GQA and causal calls, and never autocast."""
    seen = set()

    @settings(FUZZ, max_examples=200, database=None)
    @given(case=_no_autocast(cases(backends=["reference"], max_n=8)))
    def probe(case):
        assert case.autocast == "none" and case.v_dtype == "same"
        seen.update({case.mask, "gqa" if case.Hq != case.Hkv else "mha", "causal" if case.is_causal else "plain"})

    probe()
    assert {"additive", "bool", "gqa", "causal"} <= seen, seen
    assert DTYPES["float32"] == torch.float32


def test_gpu_paths_env(monkeypatch):
    """``GRAD_FUZZ_PATHS`` narrows the GPU test's paths, and an unknown name is refused with the known ones."""
    monkeypatch.delenv("GRAD_FUZZ_PATHS", raising=False)
    assert _gpu_paths().count("default") == 2 and {"strict", "gluon", "rows"} <= set(_gpu_paths())
    monkeypatch.setenv("GRAD_FUZZ_PATHS", "strict,gluon-ws")
    assert _gpu_paths() == ["strict", "gluon-ws"]
    monkeypatch.setenv("GRAD_FUZZ_PATHS", "strict,glu")
    with pytest.raises(ValueError, match=r"unknown path\(s\) \['glu'\]; known: default, short"):
        _gpu_paths()
