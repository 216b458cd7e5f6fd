"""elsa_surgery.stream in several processes (CPU): resume after a hard kill, resumable slices, checkpoint refusal,
2 and 4 gloo ranks against one, and a rank killed mid-run reported within the process group's timeout."""

import json
import multiprocessing
import time

import pytest
import torch

import stream_worker
from elsa_surgery import stream
from stream_fixtures import cpu_stream  # noqa: F401 (autouse)
from oracle import rel_err

KW = dict(is_causal=True, schedule="cqs", itr=2, c=7)


def _inputs(tmp_path, n=80, kw=KW):
    g = torch.Generator().manual_seed(5)
    d = {"q": torch.randn(1, 2, n, 16, generator=g), "k": torch.randn(1, 2, n, 16, generator=g),
         "v": torch.randn(1, 2, n, 16, generator=g), "kw": kw}
    torch.save(d, tmp_path / "inputs.pt")
    return d


def test_resume_after_a_hard_kill_is_bit_identical(tmp_path):
    d = _inputs(tmp_path)
    whole = stream.attention(d["q"], d["k"], d["v"], progress=False, **KW)
    ck = tmp_path / "ck"
    p = _child(["kill", str(tmp_path / "inputs.pt"), str(ck), "23"])
    p.join(120)
    assert p.exitcode == 17
    man = json.loads((ck / "manifest.json").read_text())
    assert len(man["done"]) == 23 and len(list(ck.glob("gen-*"))) == 1
    out = stream.attention(d["q"], d["k"], d["v"], progress=False, checkpoint_dir=ck, **KW)
    rep = stream.last_report()
    assert rep.resumed == 23 and rep.tasks_run == rep.tasks_total - 23
    assert torch.equal(out, whole)


def test_slices_then_refusal_of_another_runs_checkpoint(tmp_path):
    d = _inputs(tmp_path, kw={})
    whole = stream.attention(d["q"], d["k"], d["v"], progress=False, **KW)
    ck = tmp_path / "ck"
    runs = 0
    while True:
        runs += 1
        out = stream.attention(d["q"], d["k"], d["v"], progress=False, checkpoint_dir=ck, max_tasks=20, **KW)
        if out is not None:
            break
    assert runs == 3 and torch.equal(out, whole)  # 49 tasks in slices of 20
    q2 = d["q"].clone()
    q2[0, 0, 0, 0] += 1.0  # row 0 is always in the content sample: another input
    with pytest.raises(ValueError, match=r"checkpoint_dir=.* different run .*content_sha256"):
        stream.attention(q2, d["k"], d["v"], progress=False, checkpoint_dir=ck, **KW)
    with pytest.raises(ValueError, match=r"settings\.causal"):
        stream.attention(d["q"], d["k"], d["v"], progress=False, checkpoint_dir=ck, **{**KW, "is_causal": False})


def _child(argv):
    """A forked child running tests/stream_worker.py's main (fork: no second torch import, ~10 s each on 2 shared
    cores; the parent has no CUDA and no process group, and runs torch ops on one thread)."""
    p = multiprocessing.get_context("fork").Process(target=stream_worker.main, args=(argv,))
    p.start()
    return p


def _ranks(tmp_path, world, exit_at=None, timeout=20):
    init = tmp_path / f"init{world}"
    procs = []
    for r in range(world):
        ex = exit_at if (exit_at is not None and r == world - 1) else -1
        procs.append(_child(["rank", str(r), str(world), str(init), str(tmp_path / "inputs.pt"),
                             str(tmp_path / f"res{world}-{r}.pt"), str(ex), str(timeout)]))
    for p in procs:
        p.join(240)
    return [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_match_one_process(tmp_path, world):
    d = _inputs(tmp_path)
    one = stream.attention(d["q"], d["k"], d["v"], progress=False, **KW)
    assert _ranks(tmp_path, world) == [0] * world
    runs = 0
    for r in range(world):
        res = torch.load(tmp_path / f"res{world}-{r}.pt")
        assert res["report"]["world"] == world and res["report"]["rank"] == r
        runs += res["report"]["tasks_run"]
        assert rel_err(res["out"], one) <= 1e-6  # another merge order: equal up to fp32 rounding
    assert runs == 49  # every task ran on exactly one rank


def test_a_killed_rank_is_reported_not_hung_on(tmp_path):
    _inputs(tmp_path)
    t = time.perf_counter()
    rcs = _ranks(tmp_path, 2, exit_at=45, timeout=20)  # task 45 is in rank 1's shard (the last half)
    assert rcs == [3, 17]
    res = torch.load(tmp_path / "res2-0.pt")
    assert "rank 0 of 2: merging the partial states failed" in res["error"]
    assert res["seconds"] < 20 + 10, res  # within the collective timeout (plus slack), not hung
    assert time.perf_counter() - t < 120
