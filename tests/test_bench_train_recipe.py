"""``recipes/bench_models.py --train`` (issue 25's training-step benchmark): its options are checked, the first-step
comparison it reports sees a gradient that differs, and the whole flow (convert a deep copy, one forward/backward on
each side compared, interleaved training steps with AdamW, JSON rows) runs with ``--cpu-smoke`` on a one-block model
with the reference backend, fp32 and bf16 autocast. The GPU twin runs the kernels and reads the peaks."""

import json

import pytest
import torch
import torch.nn as nn


def test_train_options_are_checked(load_recipe, capsys):
    m = load_recipe("bench_models")
    for argv, words in ((["--train", "--eager"], "--eager, --compile and --train are separate suites"),
                        (["--train", "--compile", "default"], "separate suites"),
                        (["--train", "--dtypes", "fp8"], "--dtypes: unknown dtype 'fp8'"),
                        (["--train", "--cpu-smoke", "--workloads", "swin_t"],
                         "--train --cpu-smoke runs the workloads vit_b16, deit3_s, llama13b_2l_512, qwen2_7b_2l_512, "
                         "not swin_t"),
                        (["--train", "--calls", "0"], "--rounds and --calls must be >= 1")):
        with pytest.raises(SystemExit):
            m.parse_args(argv)
        assert words in capsys.readouterr().err, argv
    a = m.parse_args(["--train"])
    assert a.workloads == list(m.TRAIN_WORKLOADS) and a.ab_dtypes == ["fp32", "bf16-autocast"]
    assert {"vit_b16", "swin_t", "vit_l14_clip_336", "llama13b_2l_4k", "llama13b_2l_16k"} <= set(a.workloads)
    a = m.parse_args(["--train", "--cpu-smoke"])
    assert a.workloads == ["deit3_s"] and a.ab_dtypes == ["fp32"] and a.batches == [2]
    assert (a.rounds, a.calls) == (2, 2)
    assert m.main(["--train", "--list", "--workloads", "vit_b16,llama13b_2l_16k", "--dtypes", "bf16"]) == 0
    assert capsys.readouterr().out.split("\n") == ["vit_b16 bf16 8", "vit_b16 bf16 64", "llama13b_2l_16k bf16 1", ""]


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_first_step_diff_sees_a_different_gradient(load_recipe):
    m = load_recipe("bench_models")
    x = torch.randn(3, 8)
    native, other = _Tiny(), _Tiny()
    other.load_state_dict(native.state_dict())
    same = m.first_step_diff(native, other, lambda mod: mod(x), None, "cpu")
    assert same["loss_rel_err"] == 0 and same["grad_rel_err"] == 0 and same["backends_used"] == {}
    with torch.no_grad():
        other.a.weight[0, 0] += 1e-3
    diff = m.first_step_diff(native, other, lambda mod: mod(x), None, "cpu")
    assert diff["loss_rel_err"] > 0 and 1e-7 < diff["grad_rel_err"] < 1e-1
    assert all(p.grad is None for p in (*native.parameters(), *other.parameters()))  # gradients freed
    other.a.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="parameter a.bias: a gradient on one side only"):
        m.first_step_diff(native, other, lambda mod: mod(x), None, "cpu")


def test_train_step_steps_the_optimizer_and_frees_the_gradients(load_recipe):
    m = load_recipe("bench_models")
    model, x = _Tiny(), torch.randn(3, 8)
    before = [p.detach().clone() for p in model.parameters()]
    step = m.train_step(model, lambda mod: mod(x), torch.optim.AdamW(model.parameters(), lr=0.1), None, "cpu")
    expected = model(x).square().mean().item()
    loss = step()
    assert loss.item() == pytest.approx(expected) and not loss.requires_grad  # the loss, detached
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert step().item() < expected  # a second step, from the stepped weights


@pytest.fixture
def _one_thread():
    """One intra-op thread for the one-block model: its ops are tiny, and two threads on a shared two-core machine
    spin against the other load (a 25 ms step took 750 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_smoke_run_writes_rows(tmp_path, load_recipe, capsys, _one_thread):
    m = load_recipe("bench_models")
    out = tmp_path / "rows.json"
    assert m.main(["--train", "--cpu-smoke", "--dtypes", "fp32,bf16-autocast", "--rounds", "1", "--calls", "1",
                   "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["records"]
    assert [(r["workload"], r["dtype"], r["batch"]) for r in rows] == [("deit3_s", "fp32", 2),
                                                                       ("deit3_s", "bf16-autocast", 2)]
    for row, tol in zip(rows, (1e-5, 3e-2)):
        assert "error" not in row, row.get("traceback")
        assert row["converted_modules"] == 1 and row["backends_used"] == {"reference": 1} and not row["fallbacks"]
        assert row["loss_rel_err"] < tol and 0 < row["grad_rel_err"] < tol, row
        assert row["native_ms"] > 0 and row["converted_ms"] > 0
        assert row["ratio"] == pytest.approx(row["native_ms"] / row["converted_ms"])
        assert row["native_peak_mib"] is None and row["converted_peak_mib"] is None  # no peak on the CPU
    printed = capsys.readouterr().out
    assert "# training-step suite: cpu" in printed
    assert "deit3_s bf16-autocast b2: native " in printed and "peak - -> -, reference, loss rel" in printed


@pytest.mark.gpu
def test_train_gpu_rows_have_kernels_and_peaks(tmp_path, load_recipe):
    m = load_recipe("bench_models")
    out = tmp_path / "rows.json"
    assert m.main(["--train", "--workloads", "deit3_s", "--dtypes", "fp32,bf16-autocast", "--batches", "4",
                   "--backend", "elsa", "--rounds", "1", "--calls", "2", "--out", str(out)]) == 0
    for row in json.loads(out.read_text())["records"]:
        assert "error" not in row, row.get("traceback")
        assert all(b.startswith("elsa") for b in row["backends_used"]) and not row["fallbacks"]
        assert row["native_peak_mib"] > 0 and row["converted_peak_mib"] > 0 and row["memory_ratio"] > 0
        assert row["grad_rel_err"] < (1e-3 if row["dtype"] == "fp32" else 3e-2)
