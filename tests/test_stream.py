"""elsa_surgery.stream on the CPU: the CQS divide as index arithmetic, exactness against the float64 oracle for every
schedule, large logits, the OOM guardrails, bad input and autograd refusal (resume and ranks: test_stream_dist.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from elsa_surgery import monoid, stream
from elsa_surgery.stream import divide, faults, planner
from stream_fixtures import cpu_stream  # noqa: F401 (autouse)
from oracle import fp32_tolerance, naive_attention, rel_err


def _qkv(n=120, B=1, Hq=2, Hkv=2, D=16, Dv=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, n, D, generator=g, dtype=dtype), torch.randn(B, Hkv, n, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, n, Dv, generator=g, dtype=dtype))


# ------------------------------------------------------------------ the divide (pure index arithmetic)

@pytest.mark.parametrize("c", divide.SINGER_ORDERS)
def test_singer_sets_are_planar_difference_sets(c):
    D = divide.singer_set(c)
    diffs = sorted((x - y) % c for x in D for y in D if x != y)
    assert diffs == list(range(1, c)), "every nonzero residue must be a difference exactly once"


def _expected(n, causal):
    return np.tril(np.ones((n, n), dtype=np.int64)) if causal else np.ones((n, n), dtype=np.int64)


COVERAGE = [(7, 1), (7, 2), (7, 3), (7, 4), (13, 1), (13, 2), (13, 3), (21, 1), (21, 2), (31, 1), (31, 2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("c,itr", COVERAGE)
def test_cqs_computes_every_pair_exactly_once(c, itr, causal):
    """Token-level counts (stronger than chunk pairs) for a random N; c**itr <= 2197 keeps it cheap (31 with itr 3-4
    would be 30k-900k tasks: not built here)."""
    rng = np.random.default_rng(c * 10 + itr + causal)
    n = int(rng.integers(c, 140))
    tasks = divide.cqs_tasks(n, c, itr, causal)
    assert len({t.tid for t in tasks}) == len(tasks)
    np.testing.assert_array_equal(divide.pair_counts(tasks, n), _expected(n, causal))
    assert sum(t.pair_count() for t in tasks) == _expected(n, causal).sum()
    for t in tasks:  # segments are disjoint and sorted
        assert all(a < b for a, b in t.segments)
        assert all(t.segments[i][1] <= t.segments[i + 1][0] for i in range(len(t.segments) - 1))


def test_diagonal_ownership_and_one_level_chunk_pairs():
    """One level, N = c * 10: each chunk pair (a, b) in exactly one subsequence; (a, a) only in its owner."""
    c, n = 13, 130
    tasks = divide.cqs_tasks(n, c, 1, False)
    chunk_count = np.zeros((c, c), dtype=int)
    for t in tasks:
        for i, j in zip(*np.nonzero(t.pairs)):
            chunk_count[t.segments[i][0] // 10, t.segments[j][0] // 10] += 1
    np.testing.assert_array_equal(chunk_count, np.ones((c, c), dtype=int))
    D = divide.singer_set(c)
    for t in tasks:
        sub = int(t.tid.split(".")[-1])
        for i in range(len(t.segments)):
            chunk = t.segments[i][0] // 10
            assert bool(t.pairs[i, i]) == ((chunk - D[0]) % c == sub)


@pytest.mark.parametrize("causal", [False, True])
def test_refinement_and_blocks_cover_exactly(causal):
    n = 97
    tasks = divide.cqs_tasks(n, 7, 1, causal)
    refined = divide.refine(tasks[2], 13, causal) + tasks[:2] + tasks[3:]
    assert all(t.tid.startswith(tasks[2].tid + "/r") for t in refined[: -len(tasks) + 1])
    np.testing.assert_array_equal(divide.pair_counts(refined, n), _expected(n, causal))
    for bq, bk in ((16, 16), (16, 24), (40, 7)):
        np.testing.assert_array_equal(divide.pair_counts(divide.block_tasks(n, bq, bk, causal), n),
                                      _expected(n, causal))


# ------------------------------------------------------------------ exactness

CASES = [("cqs", dict(itr=1)), ("cqs", dict(itr=2)), ("cqs", dict(itr=1, c=13)), ("cqs", dict(itr=1, c=31)),
         ("cqs", dict(itr=1, c=21, n_cap=2)), ("cqs", dict(itr=3, n_cap=1)),
         ("blocks", dict(block=32)), ("blocks", dict(block=17, n_cap=3)), ("auto", {}),
         ("auto", dict(memory_budget=60_000))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule,kw", CASES)
def test_matches_float64_oracle(schedule, kw, causal):
    q, k, v = _qkv(n=101)
    ref, _ = naive_attention(q, k, v, is_causal=causal)
    out = stream.attention(q, k, v, is_causal=causal, schedule=schedule, progress=False, **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-6
    rep = stream.last_report()
    assert rep.finished and rep.tasks_run == rep.tasks_total
    if kw.get("memory_budget"):
        assert rep.predicted_peak <= kw["memory_budget"]


def test_four_levels_of_the_divide_match_the_oracle():
    q, k, v = _qkv(n=49, Hq=1, Hkv=1, D=8, Dv=8)
    out = stream.attention(q, k, v, is_causal=True, itr=4, c=7, progress=False)
    assert stream.last_report().tasks_total == 955  # 7**4 subsequences, those that compute nothing dropped
    assert rel_err(out, naive_attention(q, k, v, is_causal=True)[0]) <= 1e-6


def test_gqa_dv_scale_and_batches():
    q, k, v = _qkv(n=77, B=2, Hq=4, Hkv=2, D=8, Dv=12)
    ref, _ = naive_attention(q, k, v, is_causal=True, scale=1.0)
    out = stream.attention(q, k, v, is_causal=True, scale=1.0, schedule="cqs", itr=2, progress=False)
    assert rel_err(out, ref) <= fp32_tolerance(q, k, scale=1.0, base=1e-6)


def test_n_cap_does_not_change_a_bit():
    q, k, v = _qkv(n=90)
    outs = [stream.attention(q, k, v, is_causal=True, itr=2, n_cap=cap, progress=False) for cap in (1, 3)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kw,early", [(dict(schedule="blocks", block=16, is_causal=True), 90),
                                      (dict(schedule="blocks", block=32, is_causal=False), 90),
                                      (dict(schedule="cqs", itr=2, c=7, is_causal=True), 0)],
                         ids=["blocks-causal", "blocks", "cqs"])
def test_rows_finalized_where_their_group_ends_are_the_same_bits(monkeypatch, tmp_path, kw, early):
    """With the states of a query group pending until the group ends (CUDA with host accumulators; forced here), the
    rows of groups that no other group touches are finalized there (the blocks schedule's query rows; no CQS row):
    the same bits as after the run, into a tensor or a memmap, with a checkpoint, resumed from slices, and the same
    gradients (their lse comes from there too)."""
    from elsa_surgery.stream import executor

    q, k, v = _qkv(n=90)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    ref = stream.attention(q, k, v, progress=False, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (stream.attention(*leaves, progress=False, **kw) * g).sum().backward()
    ref_grads = [x.grad for x in leaves]
    assert stream.last_report().rows_finalized_early == 0
    monkeypatch.setattr(executor, "PEND_ON_ONE_DEVICE", True)
    assert torch.equal(stream.attention(q, k, v, progress=False, **kw), ref)
    assert stream.last_report().rows_finalized_early == early
    mm = np.lib.format.open_memmap(tmp_path / "o.npy", mode="w+", dtype=np.float32, shape=tuple(ref.shape))
    stream.attention(q, k, v, out=mm, progress=False, **kw)
    assert np.array_equal(mm, ref.numpy())
    ck = tmp_path / "ck"
    assert torch.equal(stream.attention(q, k, v, progress=False, checkpoint_dir=ck, checkpoint_every=0.0, **kw), ref)
    ck2 = tmp_path / "ck2"
    assert stream.attention(q, k, v, progress=False, checkpoint_dir=ck2, max_tasks=3, **kw) is None
    assert torch.equal(stream.attention(q, k, v, progress=False, checkpoint_dir=ck2, **kw), ref)
    assert stream.last_report().resumed == 3
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (stream.attention(*leaves, progress=False, **kw) * g).sum().backward()
    for x, want in zip(leaves, ref_grads):
        assert torch.equal(x.grad, want)


def test_a_precomputed_task_merges_like_a_computed_one():
    """On the GPU the calibration run's results (kept on the host by api._calibrate) stand in for that task's run:
    the accumulators come out with the same bits, and the task is not computed again."""
    from elsa_surgery.stream.executor import Accumulators, Executor
    from elsa_surgery.stream.sources import Source

    q, k, v = _qkv(n=96)
    B, H, N, D = q.shape
    plan = planner.make_plan(planner.Shape(B, H, k.shape[1], N, D, v.shape[3], 4), "blocks", True, None, block=16)
    states, computed = [], []
    for reuse in (False, True):
        ex = Executor(plan, Source(q, "q"), Source(k, "k"), Source(v, "v"), scale=D ** -0.5,
                      device=torch.device("cpu"), progress=False)
        if reuse:
            t = plan.tasks[7]
            ex.precomputed[7] = ex._compute(t, ex._load(t))
        real = ex._compute
        ex._compute = lambda task, data, real=real: computed.append(task.tid) or real(task, data)
        acc = Accumulators(B, H, N, v.shape[3], "cpu")
        assert ex.run(range(len(plan.tasks)), acc)
        states.append(acc.state)
    assert computed.count(plan.tasks[7].tid) == 1 and len(computed) == 2 * len(plan.tasks) - 1
    assert all(torch.equal(a, b) for a, b in zip(*states))


def test_logits_of_1e4_stay_finite_where_fp16_num_den_overflows():
    q, k, v = _qkv(n=64, D=16)
    q = q * (1e4 / ((q @ k.transpose(-1, -2)) * 16 ** -0.5).abs().max())  # the largest |logit| is 1e4
    assert ((q @ k.transpose(-1, -2)) * 16 ** -0.5).abs().max() > 9.9e3
    ref, _ = naive_attention(q, k, v, is_causal=True)
    out = stream.attention(q, k, v, is_causal=True, schedule="cqs", itr=1, progress=False)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= fp32_tolerance(q, k, base=1e-6)
    # the same tasks merged as Num/Den in fp16 (Num = exp(lse) * out, Den = exp(lse)): overflow
    tasks = divide.cqs_tasks(64, 7, 1, True)
    num = torch.zeros_like(out, dtype=torch.float16)
    den = torch.zeros(out.shape[:-1], dtype=torch.float16)
    from elsa_surgery import attention_state
    for t in tasks:
        for i in t.query_segments():
            (a, b) = t.segments[i]
            for j in t.key_segments():
                if t.pairs[i, j]:
                    ka, kb = t.segments[j]
                    st = attention_state(q[:, :, a:b], k[:, :, ka:kb], v[:, :, ka:kb],
                                         is_causal=bool(t.pairs[i, j] == divide.CAUSAL))
                    y, lse = monoid.finalize(st)
                    den[:, :, a:b] += torch.exp(lse).half()
                    num[:, :, a:b] += (torch.exp(lse).unsqueeze(-1) * y).half()
    assert torch.isinf(den).any() and not torch.isfinite(num / den.unsqueeze(-1)).all()


# ------------------------------------------------------------------ guardrails

@pytest.mark.parametrize("count,times,expect", [(1, 1, "retry with n_cap=1"), (3, 1, "refined into"),
                                                 (1, 4, "moved to the host")])
def test_injected_ooms_give_the_same_output(count, times, expect):
    """Ladder: the first OOM halves n_cap (2 -> 1), later ones at n_cap=1 refine the task (two levels), then the
    accumulators go to the host. ``count`` random tasks each raise ``times`` OOMs."""
    q, k, v = _qkv(n=96)
    clean = stream.attention(q, k, v, is_causal=True, itr=2, n_cap=2, progress=False)
    n_tasks = stream.last_report().tasks_total
    at = sorted(np.random.default_rng(count * 10 + times).choice(n_tasks, size=count, replace=False).tolist())
    with faults.inject(oom_at=at, oom_times=times) as fp:
        out = stream.attention(q, k, v, is_causal=True, itr=2, n_cap=2, progress=False)
    assert len(fp.log) == count * times
    events = stream.last_report().events
    assert len(events) == count * times and any(expect in e for e in events), events
    assert rel_err(out, clean) <= 1e-6
    if (count, times) == (1, 1):
        assert torch.equal(out, clean)  # only n_cap changed: the same merges in the same order


def test_oom_inside_a_merge_neither_loses_nor_repeats_a_segment(monkeypatch):
    """An OOM raised by the merge itself (its temporaries come first, so nothing was written) must not retry the
    task: the remaining segments merge on the host."""
    q, k, v = _qkv(n=96)
    clean = stream.attention(q, k, v, is_causal=True, itr=1, progress=False)
    real, calls = monoid.merge_, []

    def flaky(acc, b):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("injected in merge_")
        return real(acc, b)

    monkeypatch.setattr(monoid, "merge_", flaky)
    out = stream.attention(q, k, v, is_causal=True, itr=1, progress=False)
    assert any("while merging" in e for e in stream.last_report().events)
    assert torch.equal(out, clean)


def test_oom_everywhere_is_a_clear_error():
    q, k, v = _qkv(n=60)
    with faults.inject(oom_at=[0], oom_times=10_000), pytest.raises(torch.OutOfMemoryError) as ei:
        stream.attention(q, k, v, itr=1, n_cap=2, memory_budget=10**6, progress=False)
    msg = str(ei.value)
    assert "memory_budget=1000000" in msg and "smallest task tried" in msg and "query x" in msg


# ------------------------------------------------------------------ inputs and outputs

def test_memmap_inputs_and_out(tmp_path):
    q, k, v = _qkv(n=70)
    maps = []
    for name, t in zip("qkv", (q, k, v)):
        mm = np.memmap(tmp_path / f"{name}.bin", dtype=np.float32, mode="w+", shape=tuple(t.shape))
        mm[:] = t.numpy()
        maps.append(mm)
    out = np.memmap(tmp_path / "o.bin", dtype=np.float32, mode="w+", shape=tuple(q.shape))
    res = stream.attention(*maps, out=out, is_causal=True, schedule="blocks", block=16, progress=False)
    assert res is out
    ref = stream.attention(q, k, v, is_causal=True, schedule="blocks", block=16, progress=False)
    assert torch.equal(torch.from_numpy(np.asarray(out)), ref)


def test_safetensors_slices(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    q, k, v = _qkv(n=50)
    save_file({"q": q, "k": k, "v": v}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        out = stream.attention(f.get_slice("q"), f.get_slice("k"), f.get_slice("v"), itr=1, progress=False)
    assert torch.equal(out, stream.attention(q, k, v, itr=1, progress=False))


def test_bad_input_names_the_argument(tmp_path):
    q, k, v = _qkv(n=40)
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes is too small"):
        stream.attention(q, k, v, memory_budget=1000, progress=False)
    with pytest.raises(ValueError, match=r"memory_budget=2\.0"):
        stream.attention(q, k, v, memory_budget=2.0, progress=False)
    with pytest.raises(ValueError, match=r"^k, v: sequence length"):
        stream.attention(q, k[:, :, :30], v[:, :, :30], progress=False)
    with pytest.raises(ValueError, match=r"^k: head dim"):
        stream.attention(q, k[..., :8], v, progress=False)
    with pytest.raises(ValueError, match=r"^out: shape"):
        stream.attention(q, k, v, out=torch.empty(1), progress=False)
    with pytest.raises(ValueError, match=r"schedule='fast'"):
        stream.attention(q, k, v, schedule="fast", progress=False)
    with pytest.raises(ValueError, match=r"c=8"):
        stream.attention(q, k, v, c=8, progress=False)
    with pytest.raises(ValueError, match=r"itr=0"):
        stream.attention(q, k, v, itr=0, progress=False)
    mm = np.memmap(tmp_path / "q.bin", dtype=np.float32, mode="w+", shape=(1, 2, 16, 40))
    with pytest.raises(ValueError, match=r"^q: a numpy array / memmap must be C-contiguous"):
        stream.attention(mm.transpose(0, 1, 3, 2), k, v, progress=False)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match=r"checkpoint_dir=.*a_file/ck.* is not a writable directory"):
        stream.attention(q, k, v, checkpoint_dir=blocker / "ck", progress=False)
    with pytest.raises(ValueError, match=r"max_tasks / max_seconds .* need checkpoint_dir"):
        stream.attention(q, k, v, max_tasks=1, progress=False)
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b)


def _grads_vs_float64(q, k, v, **kw):
    """Max relative error of stream.attention's dq, dk, dv against float64 autograd of the naive attention."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = stream.attention(q, k, v, progress=False, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, is_causal=kw.get("is_causal", False))
    ref.backward(g.double())
    return [rel_err(a.grad, b.grad) for a, b in ((q, q64), (k, k64), (v, v64))], stream.last_report()


@pytest.mark.parametrize("kw", [dict(schedule="cqs", itr=2, c=7, is_causal=True),
                                dict(schedule="cqs", itr=1, c=7, is_causal=False),
                                dict(schedule="blocks", block=16, is_causal=True),
                                dict(schedule="blocks", block=32, is_causal=False)],
                         ids=["cqs2-causal", "cqs1", "blocks-causal", "blocks"])
def test_backward_matches_float64_autograd(kw):
    errs, rep = _grads_vs_float64(*_qkv(n=90), **kw)
    assert max(errs) <= 1e-5, errs
    assert rep.backward["backward_tasks"] == rep.tasks_total > 1


@pytest.mark.parametrize("kw", [dict(schedule="blocks", block=16, is_causal=True),
                                dict(schedule="cqs", itr=1, c=7, is_causal=True)], ids=["blocks", "cqs"])
def test_backward_oom_ladder_refines_and_loses_nothing(kw):
    """Injected OOMs in the backward's tasks: each is refined into smaller tasks covering the same pairs (the grads
    equal the clean run's up to fp32 summation order), reported in backward_events; OOMs at every level give a
    clear OutOfMemoryError naming the task."""
    q, k, v = _qkv(n=90)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (stream.attention(*leaves, progress=False, **kw) * g).sum().backward()
        return [t.grad for t in leaves]

    clean = grads()
    with faults.inject(backward_oom_at=[0, 2]) as fp:
        got = grads()
    assert [x for x in fp.log if x.startswith("backward oom")] and len(stream.last_report().backward[
        "backward_events"]) == 2
    for a, b in zip(got, clean):
        assert rel_err(a, b) <= 1e-6
    with faults.inject(backward_oom_at=[1], oom_times=50), pytest.raises(torch.OutOfMemoryError,
                                                                          match="backward: task .* refinement"):
        grads()


def test_backward_gqa_dv_scale():
    q, k, v = _qkv(n=70, Hq=4, Hkv=2, D=16, Dv=8, seed=3)
    errs, _ = _grads_vs_float64(q, k, v, schedule="blocks", block=16, is_causal=True)
    assert max(errs) <= 1e-5, errs
    q2 = q.clone().requires_grad_(True)
    stream.attention(q2, k, v, scale=0.3, progress=False, schedule="cqs", itr=1).sum().backward()
    q64 = q.double().requires_grad_(True)
    naive_attention(q64, k.double(), v.double(), scale=0.3)[0].sum().backward()
    assert rel_err(q2.grad, q64.grad) <= 1e-5


def test_backward_shows_progress_like_the_forward(capsys):
    q, k, v = (t.requires_grad_(True) for t in _qkv(n=48))
    stream.attention(q, k, v, schedule="blocks", block=16, is_causal=True, progress=True).sum().backward()
    err = capsys.readouterr().err
    assert "stream.attention backward" in err and "6/6" in err  # 3 causal query rows of tiles: 6 tasks
    stream.attention(q, k, v, schedule="blocks", block=16, is_causal=True, progress=False).sum().backward()
    assert "stream.attention" not in capsys.readouterr().err


def test_backward_plan_fits_a_third_of_the_budget():
    from elsa_surgery.stream import backward

    shape = planner.Shape(1, 2, 2, 4096, 16, 16, 4)
    fwd = planner.make_plan(shape, "blocks", True, 1 << 20)
    bwd = backward.backward_plan(fwd, 1 << 20)
    assert len(bwd.tasks) > len(fwd.tasks)
    assert 3 * max(shape.input_bytes(t.q_tokens, t.k_tokens) for t in bwd.tasks) <= 1 << 20
    assert backward.backward_plan(fwd, None) is fwd


def test_autograd_refusals_name_the_argument(tmp_path):
    q, k, v = _qkv(n=20)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="out: not supported when q, k or v require grad"):
        stream.attention(q, k, v, out=torch.empty(1, 2, 20, 16), progress=False)
    with pytest.raises(ValueError, match="checkpoint_dir / max_tasks / max_seconds: not supported"):
        stream.attention(q, k, v, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TypeError, match="autograd needs q, k and v as torch tensors"):
        stream.attention(q, k.numpy(), v, progress=False)
    with torch.no_grad():
        out = stream.attention(q, k, v, progress=False)
    assert out.shape == q.shape


def test_planner_budget_and_auto_rule():
    shape = planner.Shape(1, 8, 1, 1 << 16, 64, 64, 2)
    big = planner.make_plan(shape, "cqs", True, 2 << 30)
    small = planner.make_plan(shape, "cqs", True, 64 << 20)
    assert big.predicted_peak <= 2 << 30 and small.predicted_peak <= 64 << 20
    assert len(small.tasks) > len(big.tasks)
    q, k, v = _qkv(n=64)
    stream.attention(q, k, v, schedule="auto", memory_budget=40_000, progress=False)
    auto = stream.last_report().auto
    secs = auto["predicted_seconds"]
    assert auto["picked"] == min(secs, key=secs.get) == stream.last_report().schedule


def test_import_elsa_surgery_does_not_import_stream():
    code = "import sys, elsa_surgery; assert 'elsa_surgery.stream' not in sys.modules, 'stream imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stream_bench_recipe_runs_on_cpu(load_recipe, capsys, tmp_path):
    bench = load_recipe("stream_bench")
    bench.main(["--device", "cpu", "--n", "512", "--heads", "1", "--budget", "1MiB", "--mode", "compare",
                "--no-progress"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("schedule") for r in rows[:2]] == ["cqs", "blocks"] and rows[2]["auto"]["picked"] in ("cqs", "blocks")
    assert rows[3]["max_abs_diff_cqs_vs_blocks"] < 1e-2  # bf16 outputs of two merge orders
    for _ in range(4):  # slices: 10 tasks, 3 per invocation
        bench.main(["--device", "cpu", "--mode", "slices", "--n", "512", "--heads", "1", "--budget", "256KiB",
                    "--schedule", "blocks", "--max-tasks", "3", "--data-dir", str(tmp_path), "--no-progress"])
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["finished"] and last["spot_max_rel_err_vs_fp64"] < 1e-2
    bench.main(["--device", "cpu", "--mode", "incore", "--tile", "256", "--heads", "1"])
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["mode"] == "incore" and row["tile"] == 256 and row["in_core_tflops"] > 0
