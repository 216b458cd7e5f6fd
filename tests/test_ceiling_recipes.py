"""The ceiling recipes compute what they time: the plain Triton GEMM (``benchmarks/lab/gemm_ceiling.py``), the IEEE
attention variants (``benchmarks/lab/strict_variants.py``) and the bare FlashAttention loop (``benchmarks/lab/lowp_ceiling.py``,
one or two row sub-tiles) match float64 under the CPU interpreter, in every cut of their dots, so the rates they
report on the GPU are rates of correct kernels; the Gluon warp-specialised prototype (``benchmarks/lab/gluon_ws_ceiling.py``)
on the GPU, as the interpreter cannot run Gluon."""

import pytest
import torch


@pytest.mark.parametrize("ieee", [True, False])
def test_gemm_ceiling_kernel_matches_float64(ieee, load_recipe):
    g = load_recipe("gemm_ceiling")
    a, b = torch.randn(2, 40, 24), torch.randn(2, 24, 50)  # ragged against the 32-wide tiles
    c = torch.full((2, 40, 50), float("nan"))
    g.triton_gemm(a, b, c, (32, 32, 8, 4, 1), ieee)
    ref = a.double() @ b.double()
    assert float((c.double() - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("cfg", [(32, 32, 16, 0, 0, 4, 2), (32, 64, 16, 1, 2, 4, 2), (32, 32, 16, 2, 0, 4, 2),
                                 (32, 64, 32, 2, 2, 4, 2), (32, 128, 16, 2, 2, 4, 2)])
def test_strict_variants_match_float64(d, cfg, load_recipe):
    e = load_recipe("strict_variants")
    q, k, v = (torch.randn(2, 128, d) for _ in range(3))
    o = torch.full_like(q, float("nan"))
    e.run(q, k, v, o, cfg)
    ref = torch.softmax((q.double() @ k.double().transpose(1, 2)) * d ** -0.5, -1) @ v.double()
    assert float((o.double() - ref).norm() / ref.norm()) <= 2e-6


@pytest.mark.parametrize("cfg", [(1, 16, 16, 4, 1), (2, 16, 32, 4, 1), (2, 32, 16, 4, 1)])
def test_lowp_ceiling_loop_matches_float64(cfg, load_recipe):
    f = load_recipe("lowp_ceiling")
    q, k, v = (torch.randn(3, 128, 32) for _ in range(3))  # fp32 under the interpreter (its dot has no bf16)
    o = torch.full_like(q, float("nan"))
    f.run(q, k, v, o, cfg)
    ref = torch.softmax((q.double() @ k.double().transpose(1, 2)) * 32 ** -0.5, -1) @ v.double()
    assert float((o.double() - ref).norm() / ref.norm()) <= 2e-6


@pytest.mark.gpu
def test_gluon_ws_ceiling_kernels_match_float64(load_recipe):
    """The warp-specialised prototype whose timings docs/perf/history.md (v15) reports computes the right thing: both
    schedules, both key tiles, fp16/bf16, ragged N, Nq != Nk both ways, GQA, causal rows with no key (its own check
    raises SystemExit on a wrong output, lse or NaN)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon's Hopper kernels need an sm_90 GPU")
    from elsa_surgery.kernels import hopper

    if hopper._IMPORT_ERROR:
        pytest.skip(hopper._IMPORT_ERROR)
    load_recipe("gluon_ws_ceiling").check([0, 1])
