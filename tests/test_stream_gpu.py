"""elsa_surgery.stream on a GPU: ELSA kernels per task, pinned host buffers and the copy stream, device pending
states, the planner's memory model against the measured peak, guardrails under a real allocator cap."""

import pytest
import torch

from elsa_surgery import stream
from elsa_surgery.stream import faults
from oracle import naive_attention, rel_err

pytestmark = pytest.mark.gpu


def _host(n, H=4, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, D, generator=g).to(dtype).pin_memory() for _ in range(3)]


@pytest.mark.parametrize("schedule", ["cqs", "blocks", "auto"])
def test_host_resident_bf16_matches_float64_rows(schedule):
    q, k, v = _host(8192)
    out = stream.attention(q, k, v, is_causal=True, schedule=schedule, memory_budget=8 << 20, progress=False)
    rep = stream.last_report()
    assert out.device.type == "cpu" and out.dtype == torch.bfloat16 and rep.tasks_total > 1
    for r in (0, 1, 777, 4096, 8191):  # causal by hand: row r sees keys 0..r
        ref_r, _ = naive_attention(q[:, :, r:r + 1].float(), k[:, :, :r + 1].float(), v[:, :, :r + 1].float())
        assert rel_err(out[:, :, r:r + 1].float(), ref_r) <= 1e-2  # bf16 output rounding


def test_fp32_device_and_host_accumulators_agree_with_oracle():
    q, k, v = (t.float() for t in _host(2048, H=2, seed=1))
    ref, _ = naive_attention(q, k, v, is_causal=True)
    placed = set()
    for budget in (None, 1 << 20):  # 1 MiB: the accumulator cannot stay on the device (planner arithmetic)
        out = stream.attention(q, k, v, is_causal=True, schedule="cqs", itr=2, memory_budget=budget, progress=False)
        assert rel_err(out, ref) <= 1e-6, (budget, stream.last_report())
        placed.add(stream.last_report().settings["acc_on_device"])
    assert placed == {True, False}


def test_cuda_inputs_stay_on_the_device():
    q, k, v = (t.cuda() for t in _host(4096))
    out = stream.attention(q, k, v, is_causal=False, schedule="blocks", block=1024, progress=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.is_cuda and rel_err(out, ref) <= 1e-2


def test_predicted_peak_within_10_percent_and_under_budget():
    q, k, v = _host(1 << 17, H=8)
    # several tasks each (a task reused from the calibration is not computed again: a one-task plan would measure only
    # its merge)
    for budget in (256 << 20, 512 << 20, 768 << 20):
        stream.attention(q, k, v, is_causal=True, schedule="blocks", memory_budget=budget, progress=False)
        rep = stream.last_report()
        assert rep.tasks_total > 1 and rep.calibrated and rep.measured_peak <= budget, vars(rep)
        assert abs(rep.measured_peak - rep.predicted_peak) <= 0.10 * rep.measured_peak, vars(rep)


def test_injected_oom_on_the_gpu_gives_the_same_output():
    q, k, v = _host(16384)
    clean = stream.attention(q, k, v, is_causal=True, schedule="cqs", itr=2, n_cap=2, progress=False)
    with faults.inject(oom_at=[3, 20], oom_times=3):
        out = stream.attention(q, k, v, is_causal=True, schedule="cqs", itr=2, n_cap=2, progress=False)
    assert rel_err(out, clean) <= 1e-2 and stream.last_report().events


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL ranks")
def test_two_nccl_ranks_give_one_gpus_bits(tmp_path):
    """recipes/stream_bench.py --mode scaling: one GPU in the test's child process, then torchrun with 2 NCCL ranks
    (gloo control group beside it); the blocks schedule deals whole query rows, so the outputs are bit-identical
    unless a guardrail event changed where some rows merged (session 26: an OOM in a merge under the 96 MiB cap)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "recipes" / "stream_bench.py"
    p = subprocess.run([sys.executable, str(bench), "--mode", "scaling", "--ranks", "2", "--n", "256k", "--heads", "4",
                        "--budget", "96MiB", "--schedule", "blocks", "--no-progress", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    summary = rows[-1]
    assert summary["summary"], json.dumps(rows)
    if any(r.get("events") for r in rows):
        # a guardrail moved a run's accumulators to the host (under this tight allocator cap fragmentation can do
        # that, at a different task in each process): rows merged on the host round differently, within bf16's ulp
        assert summary["max_abs_diff"] <= 2e-3, json.dumps(rows)
    else:
        assert summary["bit_identical"] is True, json.dumps(rows)
    ranks = [r for r in rows if r.get("mode") == "scaling" and r.get("world") == 2]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["comm"]["shared_tokens"] == 0 for r in ranks)
    assert sum(r["tasks_run"] for r in ranks) == ranks[0]["settings"]["tasks"]


def test_backward_bf16_host_resident_matches_float64():
    """The backward on the ELSA kernels (their dlse input): host-resident bf16 inputs, several tasks."""
    q, k, v = (t.requires_grad_(True) for t in _host(4096, H=2, seed=4))
    out = stream.attention(q, k, v, is_causal=True, schedule="blocks", block=1024, progress=False)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, is_causal=True)
    ref.backward(g.double())
    for a, b in ((q, q64), (k, k64), (v, v64)):
        assert a.grad.device.type == "cpu" and rel_err(a.grad, b.grad) <= 2e-2  # bf16 inputs and pieces
    assert stream.last_report().backward["backward_tasks"] == 10


def test_rows_finalized_on_the_gpu_where_their_row_ends_are_the_host_finalize_bits(tmp_path):
    """Host accumulators: each query row of tiles is finalized on the GPU when its last tile has run, before any copy
    to the host; a run resumed from a slice finalizes the rows finished before it on the host: the same bits."""
    q, k, v = _host(16384)
    kw = dict(is_causal=True, schedule="blocks", block=1024, memory_budget=8 << 20, progress=False)
    out = stream.attention(q, k, v, **kw)
    rep = stream.last_report()
    assert not rep.settings["acc_on_device"] and rep.rows_finalized_early == 16384, vars(rep)
    assert rep.measured_peak <= 8 << 20
    assert stream.attention(q, k, v, checkpoint_dir=tmp_path, max_tasks=3, **kw) is None  # rows 0 and 1 done
    again = stream.attention(q, k, v, checkpoint_dir=tmp_path, **kw)
    assert stream.last_report().rows_finalized_early == 16384 - 2048 and torch.equal(again, out)
