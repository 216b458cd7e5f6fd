"""The profiling recipes' own logic, on the CPU: ``benchmarks/lab/ncu_profile.py`` splits ncu's rows into calls at the
marker kernels and reads its metrics and stall reasons; ``benchmarks/lab/membar_probe.py`` removes from a kernel loop's PTX
exactly the barriers it names (the wait's and the TMA copies'), never the one that guards the stage's refill; and
``benchmark.environ``, the recipes' switch of the kernels' knobs; the timing, profiling and SDPA-backend helpers the lab
scripts share."""

import pytest
import torch

# the key loop of kernels/hopper._elsa_fwd_sm90 as Triton 3.6 emits it (trimmed to what classify() reads)
PTX = """\
$L__BB0_6:                              // =>This Inner Loop Header: Depth=1
\tbfe.u32 \t%r56, %r463, 1, 1;
\tbar.sync \t0;
\t// begin inline asm
{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r333], %r56;
\t@!complete bra.uni waitLoop;
}
\twgmma.wait_group.sync.aligned 0;
\tbar.sync \t0;
\t// begin inline asm
\t@%p28 mbarrier.arrive.expect_tx.shared.b64 _, [%r333], 32768;
\t// end inline asm
\tbar.sync \t0;
\telect.sync \t%r334|%p25, -1;
\t@%p23 cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r330], [%rd6], [%r333];
\tbar.sync \t0;
\telect.sync \t%r337|%p26, -1;
\t@%p24 cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r332], [%rd7], [%r333];
\tbra.uni \t$L__BB0_10;
$L__BB0_11:                             // %._crit_edge
\tbar.sync \t0;
"""


def test_membar_probe_removes_only_the_barriers_it_names(tmp_path, load_recipe):
    m = load_recipe("membar_probe")
    lines = PTX.split("\n")
    end = next(i for i, line in enumerate(lines) if "%._crit_edge" in line)
    assert sorted(m.classify(lines, 0, end).values()) == ["needed", "tma", "tma", "top"]
    (tmp_path / "dump" / "HASH").mkdir(parents=True)
    (tmp_path / "dump" / "HASH" / f"{m.KERNEL}.ptx").write_text(PTX)
    m.edit(str(tmp_path / "dump"), str(tmp_path / "override"))
    edited = (tmp_path / "override" / "HASH" / f"{m.KERNEL}.ptx").read_text().split("\n")
    assert len(edited) == len(lines)
    kept = [i for i, line in enumerate(edited) if line.strip() == "bar.sync \t0;"]
    # the refill's barrier (before expect) and the one after the loop stay; the other three go
    assert [lines[i + 2].strip() for i in kept[:1]] == ["@%p28 mbarrier.arrive.expect_tx.shared.b64 _, [%r333], 32768;"]
    assert len(kept) == 2 and kept[1] == len(lines) - 2
    assert sum("bar.sync removed" in line for line in edited) == 3


def test_membar_probe_says_when_no_kernel_was_dumped(tmp_path, load_recipe):
    m = load_recipe("membar_probe")
    with pytest.raises(SystemExit, match="_elsa_fwd_sm90.ptx"):
        m.edit(str(tmp_path), str(tmp_path / "override"))


def _row(name, **metrics):
    row = {"Kernel Name": name}
    row.update(metrics)
    return row


def test_ncu_profile_groups_kernels_by_call_and_reads_stalls(load_recipe, capsys):
    n = load_recipe("ncu_profile")
    M = n.METRICS
    rows = [
        _row("spin_kernel(long)"),
        _row("_elsa_fwd_sm90", **{M["us"]: "35,200", M["cycles"]: "60000", M["smem_wf"]: "1320000",
                                  M["issue_pct"]: "41.0", M["regs"]: "127",
                                  "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "2.72",
                                  "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "1.14",
                                  "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio": "0"}),
        _row("spin_kernel(long)"),
        _row("cudnn_generated_fort_native_sdpa", **{M["us"]: "32600"}),
        _row("some_helper_kernel", **{M["us"]: "1000"}),
    ]
    out = n.report(rows, ["bf16 elsa", "bf16 sdpa-cudnn"], sms=132)
    assert [(r["call"], r["kernel"]) for r in out] == [
        ("bf16 elsa", "_elsa_fwd_sm90"), ("bf16 sdpa-cudnn", "cudnn_generated_fort_native_sdpa"),
        ("bf16 sdpa-cudnn", "some_helper_kernel")]
    first = out[0]
    assert first["us"] == pytest.approx(35.2) and first["issue_%"] == 41.0 and first["regs"] == 127
    assert first["smem_%"] == pytest.approx(100 * 1320000 / (132 * 60000))
    assert list(first["stalls"]) == ["barrier", "wait"]  # largest first, zeros left out
    assert out[1]["tensor_%"] is None  # a metric this ncu did not give stays empty
    assert "stalls (warp cycles per issued instruction): barrier 2.72, wait 1.14" in capsys.readouterr().out


def test_ncu_profile_labels_missing_markers_and_checks_cells(load_recipe, capsys):
    n = load_recipe("ncu_profile")
    out = n.report([_row("spin_kernel"), _row("k")], ["a", "b"], sms=132)
    assert out[0]["call"] == "call 0" and "2 calls" in capsys.readouterr().out
    assert n.parse_cell("fp32-strict:1x32x1024x128:1") == ("fp32-strict", (1, 32, 1024, 128), True)
    for bad in ("bf16:1x32x1024:0", "fp8:1x1x1x8:0", "bf16:1x32x1024x128:2"):
        with pytest.raises(SystemExit, match="--cells"):
            n.parse_cell(bad)


def test_benchmark_environ_sets_and_restores(monkeypatch):
    """``benchmark.environ``, the recipes' knob switch: sets and unsets inside the block and restores every variable
    to what it was (set or unset) afterwards, also when the block raises."""
    import os

    from elsa_surgery import benchmark

    monkeypatch.setenv("ELSA_TEST_KNOB_A", "kept")
    monkeypatch.delenv("ELSA_TEST_KNOB_B", raising=False)
    with benchmark.environ({"ELSA_TEST_KNOB_A": None, "ELSA_TEST_KNOB_B": "force"}):
        assert "ELSA_TEST_KNOB_A" not in os.environ and os.environ["ELSA_TEST_KNOB_B"] == "force"
    assert os.environ["ELSA_TEST_KNOB_A"] == "kept" and "ELSA_TEST_KNOB_B" not in os.environ
    with pytest.raises(RuntimeError):
        with benchmark.environ({"ELSA_TEST_KNOB_A": "0", "ELSA_TEST_KNOB_B": "1"}):
            raise RuntimeError
    assert os.environ["ELSA_TEST_KNOB_A"] == "kept" and "ELSA_TEST_KNOB_B" not in os.environ


def test_host_cost_cpu_times_both_calls_and_routes_directly(load_recipe, monkeypatch, capsys):
    """``benchmarks/lab/host_cost_cpu.py`` times the public call through its direct route (made by the warm-up), not
    the full path: every timed SDPA call is a direct run, and it prints the overhead line."""
    from elsa_surgery import callcache

    m = load_recipe("host_cost_cpu")
    monkeypatch.setattr("sys.argv", ["host_cost_cpu.py", "--rounds", "1", "--calls", "20"])
    runs = callcache.DIRECT["runs"]
    m.main()
    out = capsys.readouterr().out
    assert "routing overhead of a direct SDPA route" in out and "F.sdpa" in out
    # warm-up 500 + 1 (benchmark.interleaved_ms) + one round of 20, for each of the two routed SDPA cases, less each
    # signature's first call
    assert callcache.DIRECT["runs"] - runs == 2 * (500 + 1 + 20 - 1)


def test_benchmark_host_and_eager_us_reads_both_clocks_from_the_same_calls():
    """``benchmark.host_and_eager_us``: ``rounds`` rounds of ``calls`` calls, host time never above eager time."""
    from elsa_surgery import benchmark

    made = []
    host, eager = benchmark.host_and_eager_us(lambda: made.append(sum(range(200))), 7, rounds=3, device="cpu")
    assert len(made) == 21 and 0 < host <= eager


def test_benchmark_print_host_profile_prints_each_order(capsys):
    from elsa_surgery import benchmark

    def work():
        return sorted(range(50), key=lambda x: -x)

    benchmark.print_host_profile(work, 10, (("tottime", 3), ("cumulative", 2)), device="cpu")
    out = capsys.readouterr().out
    assert out.count("function calls") == 2 and "Ordered by: internal time" in out
    assert "Ordered by: cumulative time" in out and "work" in out


def test_benchmark_sdpa_backends_runs_the_backends_that_can_and_says_why_not():
    """``benchmark.sdpa_backends`` on CPU tensors: the math backend runs and equals SDPA's default; the CUDA-only
    backends are refused, each with PyTorch's reason."""
    from elsa_surgery import benchmark

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    calls, errors = benchmark.sdpa_backends(q, k, v, ("math", "cudnn", "efficient"), is_causal=True)
    assert set(calls) == {"math"} and set(errors) == {"cudnn", "efficient"}
    assert all(errors.values())
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(calls["math"](), expected)


def test_compile_cache_counts_the_kernels_a_warm_process_compiled(load_recipe, monkeypatch, tmp_path):
    """``benchmarks/lab/compile_cache.py --side both`` reports the Triton cache entries each warm process added: the
    kernels of every entry directory (``<name>.json``; Triton's ``__grp__`` files are not kernels)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "lab"))
    cc = load_recipe("compile_cache")
    assert cc._triton_entries(str(tmp_path / "none")) == set()
    for d, names in (("A", ("elsa_fwd", "__grp__elsa_fwd")), ("B", ("mask_tile_ranges",)), ("C", ())):
        (tmp_path / d).mkdir()
        for n in names:
            (tmp_path / d / f"{n}.json").write_text("{}")
        (tmp_path / d / "x.cubin").write_text("")
    assert cc._triton_entries(str(tmp_path)) == {("A", "elsa_fwd"), ("B", "mask_tile_ranges")}


def test_compile_cache_runs_each_cold_process_on_fresh_caches(load_recipe, monkeypatch, tmp_path, capsys):
    """``compile_cache.py --side both --cold 2 --warm 1 --no-eager``: two cold processes a side, each on caches of its
    own that nothing compiled into before, then a warm one on the last cold one's, each told ``--no-eager``; the
    summary's ratios are of the medians."""
    import argparse
    import json
    import os
    import subprocess
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "lab"))
    cc = load_recipe("compile_cache")
    seen, flags = [], []

    def fake_run(cmd, env, **kw):
        side = cmd[cmd.index("--side") + 1]
        cache = env["TRITON_CACHE_DIR"]
        fresh = not os.path.exists(cache)
        os.makedirs(cache, exist_ok=True)
        seen.append((side, cache, fresh))
        flags.append("--no-eager" in cmd)
        s = {"native": 10.0, "converted": 11.0}[side] * (1 if fresh else 0.2) + len(seen) / 100
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"compile_s": s}) + "\n", stderr="")

    monkeypatch.setattr(cc.subprocess, "run", fake_run)
    monkeypatch.setattr(cc.torch.cuda, "get_device_name", lambda *a: "test")
    a = argparse.Namespace(cold=2, warm=1, workload="swin_t", dtype="fp32", batch=8, full_path=False, no_eager=True)
    assert cc.both_sides(a) == 0
    assert flags == [True] * 6  # (--no-eager passed on to every process)
    assert [(s, f) for s, _, f in seen] == [("native", True), ("converted", True), ("native", True),
                                            ("converted", True), ("native", False), ("converted", False)]
    caches = [c for _, c, _ in seen]
    assert len(set(caches[:4])) == 4 and caches[4] == caches[2] and caches[5] == caches[3]
    summary = json.loads(capsys.readouterr().out.split("converted / native):", 1)[1])
    assert summary["native_cold_s"] == [10.01, 10.03] and summary["converted_cold_s"] == [11.02, 11.04]
    assert summary["cold_ratio_of_medians"] == round(11.03 / 10.02, 3)


def test_generate_recipe_says_which_static_cells_transformers_compiled(load_recipe, monkeypatch):
    """``llama_long_context.py --generate`` on the CPU (tiny shape, 2 layers): every cache kind runs, native and
    converted give the same greedy tokens, and a cell whose decode steps transformers compiled itself (its
    auto-compile of a static cache, which it does on CUDA devices: session 57 found the Qwen2 static cells of sessions
    35-36 to be compiled ones) says so, ``static-eager`` turning that off. The auto-compile is stood in for on the
    CPU: its criteria say yes for a static cache unless ``disable_compile``, and the 'compiled' call is the model's
    own."""
    from transformers import LlamaForCausalLM

    m = load_recipe("llama_long_context")

    def criteria(self, kw, cfg):
        return not cfg.disable_compile and type(kw.get("cache")).__name__ == "StaticCache"

    monkeypatch.setattr(LlamaForCausalLM, "_valid_auto_compile_criteria", criteria, raising=False)
    monkeypatch.setattr(LlamaForCausalLM, "get_compiled_call", lambda self, cfg: self.__call__, raising=False)
    args = m.parse_args(["--generate", "--shape", "tiny", "--layers", "2", "--device", "cpu", "--new-tokens", "3",
                         "--iters", "1", "--cache", "dynamic,static,static-eager", "--backend", "reference"])
    args.lengths = [24]
    rows = m.generate_ab(args, torch.device("cpu"))
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert [r["decode_compiled"] for r in rows] == [False, True, False], rows
    assert all(r["tokens_identical"] and r["divergence"] == [None] for r in rows), rows
    assert all(r["routes"] == {"direct": 0, "kernel_family": 0} for r in rows), rows  # (the reference backend's)
    with pytest.raises(SystemExit, match="static-graphs"):
        args.cache = "static-graphs"
        m.generate_ab(args, torch.device("cpu"))


def test_generate_recipe_tells_where_and_how_near_a_tie_tokens_differ(load_recipe):
    """``first_divergence``: per batch row, None where the greedy tokens agree; else the first generated step they
    differ at, the native model's margin there (its token's logit minus the converted model's token's) in logits and
    in the dtype's spacing, the converted model's margin, the largest logit difference over the steps before and at
    the step, and whether the choice was a near tie (a margin within one spacing, or within twice the difference
    before)."""
    m = load_recipe("llama_long_context")
    prompt, steps, vocab = 3, 4, 6
    seq_n = torch.tensor([[9, 9, 9, 1, 2, 3, 4], [9, 9, 9, 5, 5, 5, 5], [9, 9, 9, 0, 1, 0, 1]])
    seq_c = seq_n.clone()
    seq_c[0, prompt + 2] = 4  # row 0: step 2, a tie in bf16
    seq_c[2, prompt + 1] = 3  # row 2: step 1
    logits_n = [torch.zeros(3, vocab) for _ in range(steps)]
    logits_c = [torch.zeros(3, vocab) for _ in range(steps)]
    logits_n[2][0, 3], logits_n[2][0, 4] = 8.0, 8.0 - 2 ** -5  # bf16's spacing at 8 is 2^-4: half of one
    logits_c[2][0, 4], logits_c[2][0, 3] = 8.0, 8.0 - 2 ** -5
    logits_c[0][2, 0] = 0.5  # row 2's logits differed by 0.5 at step 0
    logits_n[1][2, 1], logits_n[1][2, 3] = 6.0, 5.0
    logits_c[1][2, 3], logits_c[1][2, 1] = 5.5, 5.5
    rows = m.first_divergence(seq_c, seq_n, logits_c, logits_n, prompt, torch.bfloat16)
    assert rows[1] is None
    r0, r2 = rows[0], rows[2]
    assert (r0["step"], r0["native_token"], r0["converted_token"]) == (2, 3, 4)
    assert r0["native_margin"] == r0["converted_margin"] == 2 ** -5 and r0["margin_ulps"] == 0.5
    assert r0["logit_diff_before"] == 0.0 and r0["logit_diff_at"] == 2 ** -5 and r0["near_tie"]
    assert (r2["step"], r2["native_token"], r2["converted_token"]) == (1, 1, 3)
    assert r2["native_margin"] == 1.0 and r2["converted_margin"] == 0.0 and r2["margin_ulps"] == 1.0 / 2 ** -5
    assert r2["logit_diff_before"] == 0.5 and r2["logit_diff_at"] == 0.5 and r2["near_tie"]  # 1.0 <= 2 x 0.5
    logits_c[0][2, 0] = 0.25  # the models agreed more closely before: a margin of 1.0 is no near tie
    rows = m.first_divergence(seq_c, seq_n, logits_c, logits_n, prompt, torch.bfloat16)
    assert rows[2]["logit_diff_before"] == 0.25 and not rows[2]["near_tie"]
    text = m._divergence_text(rows)
    assert "row 0 first differs at step 2" in text and "(a near tie)" in text and "row 2" in text
    assert "NOT a near tie" in text and "row 1" not in text
    seq_c[2, prompt] = 4  # row 2 now differs at step 0: nothing before, the margin in spacings decides
    r2 = m.first_divergence(seq_c, seq_n, logits_c, logits_n, prompt, torch.bfloat16)[2]
    assert r2["step"] == 0 and r2["logit_diff_before"] is None and r2["margin_ulps"] == 0 and r2["near_tie"]
    assert "no step before" in m._divergence_text([r2])
    assert m._divergence_text([None, None]) == ""
