"""elsa_surgery.stream in several processes (CPU): resume after a hard kill, resumable slices, checkpoint refusal,
2 and 4 gloo ranks against one (bit for bit where every query row merges on one rank), a rank killed mid-run
reported within the process group's timeout and the rerun resuming from every rank's finished tasks; the shard and
ownership arithmetic."""

import json
import multiprocessing
import time

import pytest
import torch

import stream_worker
from elsa_surgery import stream
from elsa_surgery.stream import distributed, planner
from stream_fixtures import cpu_stream  # noqa: F401 (autouse)
from oracle import rel_err

KW = dict(is_causal=True, schedule="cqs", itr=2, c=7)
BLOCKS = dict(is_causal=True, schedule="blocks", block=8)  # 10 query rows of tiles, 55 tasks at n=80


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


def _child(argv, method="fork"):
    """A child running tests/stream_worker.py's main. fork: no second torch import (~10 s each on 2 shared cores;
    the parent has no CUDA and no process group, and runs torch ops on one thread). Children that run a backward
    are spawned: autograd refuses to run in a child forked from a process whose autograd engine started its
    threads (the whole suite's earlier tests do that: "Unable to handle autograd's threading in combination with
    fork-based multiprocessing")."""
    p = multiprocessing.get_context(method).Process(target=stream_worker.main, args=(argv,))
    p.start()
    return p


def _ranks(tmp_path, world, exit_at=None, timeout=20, ckpt=None, tag="", grad=False):
    init = tmp_path / f"init{world}{tag}"
    procs = []
    for r in range(world):
        ex = exit_at if (exit_at is not None and r == world - 1) else -1
        procs.append(_child(["rank", str(r), str(world), str(init), str(tmp_path / "inputs.pt"),
                             str(tmp_path / f"res{world}-{r}.pt"), str(ex), str(timeout)]
                            + ([str(ckpt)] if ckpt else []) + (["grad"] if grad else []),
                            method="spawn" if grad else "fork"))
    for p in procs:
        p.join(240)
    return [p.exitcode for p in procs]


def _plan(kw, n=80):
    """The plan every rank makes for _inputs' shape (no budget, no calibration on the CPU)."""
    fixed = {x: kw.get(x) for x in ("itr", "c", "block")}
    return planner.make_plan(planner.Shape(1, 2, 2, n, 16, 16, 4), kw["schedule"], kw["is_causal"], None, **fixed)


@pytest.mark.parametrize("world,kw,pend", [(2, KW, False), (4, KW, False), (2, BLOCKS, False), (4, BLOCKS, False),
                                           (2, BLOCKS, True), (2, KW, True)],
                         ids=["cqs2", "cqs4", "blk2", "blk4", "blk2-pend", "cqs2-pend"])
def test_gloo_ranks_match_one_process(tmp_path, world, kw, pend):
    """``pend``: the ranks keep each query group's states pending as on CUDA with host accumulators, so the blocks
    rows are finalized where their group ends and the merge gathers rows read back from the output; the one-process
    reference finalizes after its run: the same bits."""
    d = _inputs(tmp_path, kw=kw)
    d["pend"] = pend
    torch.save(d, tmp_path / "inputs.pt")
    one = stream.attention(d["q"], d["k"], d["v"], progress=False, **kw)
    assert _ranks(tmp_path, world) == [0] * world
    runs = 0
    for r in range(world):
        res = torch.load(tmp_path / f"res{world}-{r}.pt")
        rep = res["report"]
        assert rep["world"] == world and rep["rank"] == r and rep["comm"]["seconds"] > 0
        runs += rep["tasks_run"]
        owned = sum(b - a for a, b, m in distributed.owners(_plan(kw), world) if m == 1 << r)
        assert rep["rows_finalized_early"] == (owned if pend and kw is BLOCKS else 0)
        if kw is BLOCKS:  # every query row merged on one rank, in one process's order: the same bits
            assert torch.equal(res["out"], one)
            # every row is a whole query row's: delivered by its owner (where the row ended, or after the run),
            # nothing left for the merge
            d = rep["comm"]["delivery"]
            assert rep["comm"]["shared_tokens"] == 0 and rep["comm"]["owned_tokens"] == 0
            assert d["delivered_tokens"] == 80 - owned
            mine = sum(1 for a, b, m in distributed.owners(_plan(kw), world) for _ in range((b - a) // 8)
                       if m == 1 << r)  # this rank's 8-token query rows
            assert d["late_segments"] == (0 if pend else mine)
        else:  # CQS: a query chunk's subsequences on several ranks, another merge order: fp32 rounding
            assert rel_err(res["out"], one) <= 1e-6
            assert rep["comm"]["shared_tokens"] > 0
    assert runs == len(_plan(kw).tasks)  # every task ran on exactly one rank


def test_a_rank_without_a_checkpoint_takes_the_others_plan(tmp_path):
    """A rank that died before its first save has no checkpoint while the others have one: the rerun agrees on the
    first run's plan (no rank calibrates or re-plans alone), the others resume, and the output is the same bits."""
    d = _inputs(tmp_path, kw=BLOCKS)
    one = stream.attention(d["q"], d["k"], d["v"], progress=False, **BLOCKS)
    ck = tmp_path / "ck"
    assert _ranks(tmp_path, 2, ckpt=ck) == [0, 0]
    import shutil

    shutil.rmtree(ck / "rank1-of-2")
    assert _ranks(tmp_path, 2, ckpt=ck, tag="rerun") == [0, 0]
    res = [torch.load(tmp_path / f"res2-{r}.pt") for r in range(2)]
    assert res[0]["report"]["resumed"] == len(distributed.shard(_plan(BLOCKS), 0, 2)) and res[0]["report"][
        "tasks_run"] == 0
    assert res[1]["report"]["resumed"] == 0 and res[1]["report"]["tasks_run"] == len(distributed.shard(_plan(BLOCKS),
                                                                                                       1, 2))
    assert all(torch.equal(r["out"], one) for r in res)


def test_backward_refuses_ranks_with_different_output_gradients(tmp_path):
    d = _inputs(tmp_path, kw=BLOCKS)
    d["g"] = torch.randn(1, 2, 80, 16, generator=torch.Generator().manual_seed(8))
    d["g_rank1"] = d["g"].clone()
    d["g_rank1"][0, 0, 0, 0] += 1.0
    torch.save(d, tmp_path / "inputs.pt")
    assert _ranks(tmp_path, 2, grad=True) == [3, 3]
    for r in range(2):
        assert "the output's gradient differs between ranks" in torch.load(tmp_path / f"res2-{r}.pt")["error"]


@pytest.mark.parametrize("world,kw", [(2, BLOCKS), (3, KW)], ids=["blk2", "cqs3"])
def test_backward_on_gloo_ranks_matches_one_process(tmp_path, world, kw):
    """Each rank runs the backward of its shard (lse of every row from the merge), then dQ, dK, dV are summed."""
    d = _inputs(tmp_path, kw=kw)
    d["g"] = torch.randn(1, 2, 80, 16, generator=torch.Generator().manual_seed(8))
    torch.save(d, tmp_path / "inputs.pt")
    q, k, v = (d[x].clone().requires_grad_(True) for x in "qkv")
    one = stream.attention(q, k, v, progress=False, **kw)
    one.backward(d["g"])
    rcs = _ranks(tmp_path, world, grad=True)
    assert rcs == [0] * world, [torch.load(tmp_path / f"res{world}-{r}.pt").get("error") for r in range(world)]
    for r in range(world):
        res = torch.load(tmp_path / f"res{world}-{r}.pt")
        assert rel_err(res["out"], one.detach()) <= 1e-6
        for name, ref in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert rel_err(res[name], ref) <= 1e-6, (r, name)  # summed in another order: fp32 rounding
    assert sum(torch.load(tmp_path / f"res{world}-{r}.pt")["report"]["backward"]["backward_tasks"]
               for r in range(world)) == len(_plan(kw).tasks)


def test_shards_deal_whole_query_rows_and_balance_flops():
    plan = _plan(BLOCKS, n=64)  # 8 causal query rows of 8-token tiles: row r holds r + 1 tiles
    rank_of = distributed.assignment(plan, 2)
    for g in distributed.groups(plan):
        assert len({rank_of[i] for i in g}) == 1  # a query row stays on one rank
    load = [sum(planner.task_flops(plan.shape, t) for i, t in enumerate(plan.tasks) if rank_of[i] == r)
            for r in range(2)]
    assert load[0] == load[1]  # rows 7+4+3+0 and 6+5+2+1 (diagonal tiles half): an even split
    assert sorted(distributed.shard(plan, 0, 2) + distributed.shard(plan, 1, 2)) == list(range(len(plan.tasks)))
    own = distributed.owners(plan, 2)
    assert own[0][0] == 0 and own[-1][1] == 64 and all(a[1] == b[0] for a, b in zip(own, own[1:]))
    diag = {t.segments[0][0] // 8: i for i, t in enumerate(plan.tasks) if len(t.segments) == 1}  # row -> tile (r, r)
    for a, b, mask in own:
        assert all(mask == 1 << rank_of[diag[row]] for row in range(a // 8, b // 8))  # one owner: the row's rank
    cqs = _plan(KW)
    assert any(bin(m).count("1") > 1 for _, _, m in distributed.owners(cqs, 2))  # CQS rows are shared


def test_ranges_minus_delivered_ones():
    got = distributed._minus([(0, 10, 1), (10, 20, 3)], [(2, 4), (8, 12), (15, 25)])
    assert got == [(0, 2, 1), (4, 8, 1), (12, 15, 3)]
    assert distributed._minus([(0, 10, 1)], []) == [(0, 10, 1)]
    assert distributed._minus([(0, 10, 1)], [(0, 10)]) == []


def test_calibration_tasks_are_largest_cheapest_in_distinct_groups_and_pin_their_group():
    plan = _plan(BLOCKS, n=64)  # 8 causal query rows; every tile has 16 tokens, the diagonal ones half the pairs
    group_of = {i: gi for gi, g in enumerate(distributed.groups(plan)) for i in g}
    for size in (1, 2, 4):
        cal = distributed.calibration_tasks(plan, size)
        assert len(cal) == size and len({group_of[i] for i in cal}) == size
        most = max(t.q_tokens + t.k_tokens for t in plan.tasks)
        least = min(planner.task_flops(plan.shape, t) for t in plan.tasks)
        assert all(plan.tasks[i].q_tokens + plan.tasks[i].k_tokens == most for i in cal)
        assert all(planner.task_flops(plan.shape, plan.tasks[i]) == least for i in cal)  # the diagonal tiles
    pins = dict(zip(distributed.calibration_tasks(plan, 2), (0, 1)))
    rank_of = distributed.assignment(plan, 2, pins)
    assert all(rank_of[i] == r for i, r in pins.items())
    for g in distributed.groups(plan):
        assert len({rank_of[i] for i in g}) == 1
    flops = [planner.task_flops(plan.shape, t) for t in plan.tasks]
    # what is left to compute (the pinned tasks are done) is balanced within the largest group's cost
    left = [sum(f for i, f in enumerate(flops) if rank_of[i] == r and i not in pins) for r in range(2)]
    assert abs(left[0] - left[1]) <= max(sum(flops[i] for i in g) for g in distributed.groups(plan))
    # two pins in one group: the lower rank takes the group
    g = max(distributed.groups(plan), key=len)
    assert set(distributed.assignment(plan, 2, {g[0]: 1, g[1]: 0})[i] for i in g) == {0}
    # fewer groups than ranks: the first task repeats
    one_row = _plan(dict(is_causal=False, schedule="blocks", block=64), n=64)
    assert distributed.calibration_tasks(one_row, 3) == [0, 0, 0]


def test_a_killed_rank_is_reported_not_hung_on_and_the_rerun_resumes(tmp_path):
    d = _inputs(tmp_path, kw=BLOCKS)
    one = stream.attention(d["q"], d["k"], d["v"], progress=False, **BLOCKS)
    mine = distributed.shard(_plan(BLOCKS), 1, 2)
    kill_at = mine[len(mine) // 2]  # half way through rank 1's share
    ck = tmp_path / "ck"
    t = time.perf_counter()
    rcs = _ranks(tmp_path, 2, exit_at=kill_at, timeout=20, ckpt=ck)
    assert rcs == [3, 17]
    res = torch.load(tmp_path / "res2-0.pt")
    assert "rank 0 of 2: waiting for every rank to finish its share failed" in res["error"]
    assert res["seconds"] < 20 + 10, res  # within the collective timeout (plus slack), not hung
    assert time.perf_counter() - t < 120
    # the rerun (same world): rank 0 saved its whole share before waiting, rank 1 the tasks before the kill
    assert _ranks(tmp_path, 2, ckpt=ck, tag="rerun") == [0, 0]
    for r, resumed in ((0, len(distributed.shard(_plan(BLOCKS), 0, 2))), (1, len(mine) // 2)):
        res = torch.load(tmp_path / f"res2-{r}.pt")
        assert res["report"]["resumed"] == resumed and torch.equal(res["out"], one)


def _bench(tmp_path, *args):
    """recipes/stream_bench.py on the CPU (it launches torchrun itself); its JSON rows."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "recipes" / "stream_bench.py"
    p = subprocess.run([sys.executable, str(bench), "--device", "cpu", "--n", "4096", "--heads", "2", "--dim", "16",
                        "--budget", "256KiB", "--schedule", "blocks", "--no-progress", "--data-dir", str(tmp_path),
                        *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("ranks", [2, 4])
def test_torchrun_gloo_ranks_give_one_process_bits(tmp_path, ranks):
    """torchrun (not forked children) with 2 and 4 gloo ranks: the same bits as one process, every task once."""
    rows = _bench(tmp_path, "--mode", "scaling", "--ranks", str(ranks))
    summary = rows[-1]
    assert summary["summary"] and summary["bit_identical"] is True and summary["ranks"] == ranks, summary
    per_rank = [r for r in rows if r.get("mode") == "scaling" and r.get("world") == ranks]
    assert sorted(r["rank"] for r in per_rank) == list(range(ranks))
    assert sum(r["tasks_run"] for r in per_rank) == per_rank[0]["settings"]["tasks"] > ranks


def test_torchrun_drill_fails_fast_and_the_rerun_resumes(tmp_path):
    rows = _bench(tmp_path, "--mode", "drill", "--ranks", "2", "--checkpoint-every", "0", "--timeout", "30")
    killed, rerun = rows[-2], rows[-1]
    assert killed["phase"] == "killed" and killed["exit_code"] != 0 and killed["seconds_to_failure"] < 30 + 60
    assert any("exitcode  : 17" in line for line in killed["stderr_tail"]), killed  # torchrun names the dead rank
    assert rerun["exit_code"] == 0 and rerun["bit_identical"] is True and sum(rerun["resumed"]) > 0, rerun
